// SPDX-License-Identifier: MIT
// DeepSeek-V4 forward pass on the CPU reference backend (fp32). One code path serves prefill and decode: a chunk
// of n tokens at positions p..p+n-1 is exactly n sequential decode steps (spec 3.11): window = last `window`
// positions, compressed entry s visible to query t iff s < (t+1) div r, compressors advanced token by token.
#pragma once
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "cpu/ops.h"
#include "model/config.h"
#include "model/state.h"
#include "model/weights.h"

namespace dsv4 {

// Activation quantisation of the linears the official reference runs in FP8/FP4 (spec 8.1: wq_a, wkv, wq_b,
// indexer wq_b, wo_b, routed and shared experts; not wo_a, the compressor, the router gate, weights_proj, head).
enum class ActQuant {
  None,  // the input as computed (fp32 here; bf16 on CUDA)
  FP8,   // bf16(x), then per row and 128-block fp8_simulate_block (e4m3, power-of-two scale), like the official
         // act_quant on its bf16 activations
};

struct Numerics {
  cpu::KvStorage kv = cpu::KvStorage::FP8;                 // --kv-dtype fp8|bf16|f32
  cpu::IndexerStorage indexer = cpu::IndexerStorage::FP4;  // --indexer-dtype fp4|bf16|f32
  ActQuant act = ActQuant::None;                           // --act-quant none|fp8
};

cpu::KvStorage parse_kv_storage(const std::string& name);            // "fp8", "bf16", "f32"
cpu::IndexerStorage parse_indexer_storage(const std::string& name);  // "fp4", "bf16", "f32"
ActQuant parse_act_quant(const std::string& name);                   // "none", "fp8"
// The state's entries in the bytes the rounding leaves (kv fp8 -> KvCodec::Fp8, bf16 -> Bf16, f32 -> F32; indexer
// fp4 -> Fp4 ...): storing them that way loses nothing.
StateCodecs state_codecs(const Numerics& numerics);

// Receives named intermediates ("attn_norm", layer, [rows, cols]) when set; layer -1 = not per layer.
using TraceFn = std::function<void(const std::string& name, int layer, const float* data, int rows, int cols)>;

class Model {
 public:
  Model(ModelConfig config, ModelWeights weights, Numerics numerics = {});
  // WeightLoad::KeepLinearsPacked: the CUDA runner uploads the packed encodings; forward() on the CPU decodes them a
  // tile of rows at a time (cpu::gemm_nt_packed), so a checkpoint runs in about its own size of memory.
  // mtp: also load the MTP block (throws when the checkpoint has none).
  static Model load(const std::string& model_dir, Numerics numerics = {}, WeightLoad load = WeightLoad::DecodeAll,
                    bool mtp = false);

  const ModelConfig& config() const { return config_; }
  const Numerics& numerics() const { return numerics_; }
  const ModelWeights& weights() const { return weights_; }
  bool has_mtp() const { return weights_.mtp.has_value(); }
  SequenceState new_sequence(int max_context) const {
    return SequenceState::create(config_, max_context, has_mtp(), state_codecs(numerics_));
  }

  // Consumes `tokens` at positions state.n_tokens.. and returns next-token logits [n, vocab] row-major
  // (all rows, or only the last row when last_only). final_streams: also the residual streams after the last
  // block, [n, hc·D] (the MTP block's input).
  std::vector<float> forward(SequenceState& state, std::span<const int32_t> tokens, bool last_only,
                             std::vector<float>* final_streams = nullptr) const;

  // The MTP block (spec 5) on the pairs (X_i, next_tokens[i]) at positions state.mtp_tokens.. (which the main
  // model consumed): X_i = main_streams row i (forward's final_streams at that position), next_tokens[i] the token
  // after it. Returns the MTP's logits for the token after each next token [n, vocab] (or the last row), and
  // advances the MTP block's own window state.
  std::vector<float> mtp_forward(SequenceState& state, const float* main_streams,
                                 std::span<const int32_t> next_tokens, bool last_only) const;

  void set_trace(TraceFn fn) { trace_ = std::move(fn); }

 private:
  struct Chunk;
  const LayerWeights& block(int layer) const;  // layer n_layers: the MTP block
  void run_block(int layer, float* streams, Chunk& chunk, LayerState& layer_state, const SequenceState& state) const;
  std::vector<float> head_logits(const HyperConnWeights& collapse, const Vector& norm, const float* streams, int n,
                                 bool last_only) const;
  void attention(int layer, const float* x, Chunk& chunk, LayerState& layer_state, const SequenceState& state,
                 float* out) const;
  void moe(int layer, const float* x, const Chunk& chunk, float* out) const;
  void trace(const char* name, int layer, const float* data, int rows, int cols) const;

  ModelConfig config_;
  ModelWeights weights_;
  Numerics numerics_;
  std::vector<float> inv_freq_main_, inv_freq_compress_;  // [rope_dim/2]
  TraceFn trace_;
};

// RoPE inverse frequencies (spec 3.1): theta^(-2i/d), with YaRN's ramp between the beta_fast / beta_slow
// correction dims when enabled (no magnitude scaling).
std::vector<float> rope_inv_freq(const RopeConfig& rope, int rope_dim);

}  // namespace dsv4
