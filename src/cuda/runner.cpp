// SPDX-License-Identifier: MIT
// CUDA SequenceRunner: the forward pass of src/model/model.cpp, step for step, as kernel launches on one stream.
// Launch order per layer (decode, CSA layer):
//   attention: mix (fp32 linear) -> hc_pre+norm -> gemv [wq_a|wkv|compressor wkv,wgate|indexer wkv,wgate]
//              -> q_norm -> gemv [wq_b|indexer wq_b] -> q norm+rope -> kv norm+rope+round -> compressors (+ entry
//              norm/rope/round when a block completes) -> indexer q rope+round -> weights_proj -> scores -> top-k
//              -> attention (+ merge of the key splits at decode) -> window ring -> gemv wo_a (batched over the
//              groups) -> gemv wo_b -> hc_post
//   ffn:       mix -> hc_pre+norm -> gate (fp32 linear) -> router -> moe_slots -> grouped gemv [w1, w3] -> swiglu
//              -> grouped gemv w2 -> hc_post (sums the pairs). The shared expert is one more grouped expert when
//              it has the routed experts' shape and encoding, else: shared [w1|w3] gemv -> swiglu -> shared w2.
// Linear weights stay in their checkpoint encoding (device_weights.h); the fused projections are launched as
// one gemv per run of parts sharing an encoding.
#include "cuda/runner.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <charconv>
#include <cstring>
#include <string>
#include <string_view>
#include <utility>
#include <limits>
#include <map>
#include <tuple>
#include <optional>
#include <vector>

#include "core/check.h"
#include "cuda/bandwidth.h"
#include "cuda/cuda_check.h"
#include "cuda/device.h"
#include "cuda/device_weights.h"
#include "cuda/gemm.h"
#include "core/env.h"
#include "cuda/gemv.h"
#include "cuda/ops.h"
#include "model/model.h"
#include "model/sampler.h"
#include "spdlog/spdlog.h"

namespace dsv4 {
namespace {

// The largest compressed-entry count of any layer (the indexer scores' row length, which bounds the prefill chunk),
// over every layer of the model, not only a stage's: all stages settle on the same prefill chunk.
int max_compressed_entries(const ModelConfig& c, int max_context) {
  int entries = 1;
  for (int l = 0; l < c.n_layers; ++l)
    if (c.ratio(l)) entries = std::max(entries, max_context / c.ratio(l));
  return entries;
}

// Rows from which a dense linear runs as dequantise + cuBLASLt (dsv4_gemm_bench on the H200: at 512 rows cuBLASLt
// with the decode included beats the tiled gemv on every Flash shape, at 128 the tiled gemv wins on the wide ones).
constexpr int kGemmMinRows = 256;

using gpu::RowOpParams;
using gpu::RowRound;

// ---- uploads ---------------------------------------------------------------------------------------------

DeviceBuffer upload_f32(const std::vector<float>& v) {
  DeviceBuffer b(std::max<size_t>(v.size(), 1) * sizeof(float));
  if (!v.empty()) b.upload(v.data(), v.size() * sizeof(float));
  return b;
}

DeviceBuffer upload_i32(const std::vector<int32_t>& v) {
  DeviceBuffer b(std::max<size_t>(v.size(), 1) * sizeof(int32_t));
  if (!v.empty()) b.upload(v.data(), v.size() * sizeof(int32_t));
  return b;
}

DeviceBuffer zeros(size_t bytes) {
  DeviceBuffer b(std::max<size_t>(bytes, 16));
  b.fill_bytes(0);
  return b;
}

// ---- device model -------------------------------------------------------------------------------------------

struct HcDevice {
  DeviceBuffer fn, base, scale;
  explicit HcDevice(const HyperConnWeights& w) : fn(upload_f32(w.fn.data)), base(upload_f32(w.base)),
                                                 scale(upload_f32(w.scale)) {}
};

// Compressor weights; its partial-block state ([rows, width] kv and score) is per sequence (SequenceDevice).
struct CompressorDevice {
  int ratio = 0, dim = 0, rows = 0, width = 0;
  bool overlap = false;
  DeviceBuffer ape, norm;
  DeviceBuffer history;  // [kMaxRollback + 1, 2 * width]: a verify step's (kv, gate) input rows, for rollback
};

struct LayerDevice {
  int ratio = 0;  // 0 = sliding only
  bool indexer = false, hash = false;
  const float* inv_freq = nullptr;
  HcDevice hc_attn, hc_ffn;
  DeviceBuffer attn_norm, ffn_norm, q_norm, kv_norm, sink;
  // x-side fused projection rows: wq_a | wkv | compressor wkv | compressor wgate | indexer wkv | indexer wgate
  FusedLinear w_x;
  int n_x = 0, off_kv = 0, off_ckv = 0, off_cgate = 0, off_ikv = 0, off_igate = 0;
  // q-side fused projection rows: wq_b | indexer wq_b
  FusedLinear w_q;
  int n_q = 0, off_iq = 0;
  DeviceLinear wo_a, wo_b;
  std::optional<CompressorDevice> compressor, index_compressor;
  DeviceBuffer index_wproj;  // fp32 [index_n_heads, D]
  // MoE
  DeviceBuffer gate, gate_bias, tid2eid;
  DeviceExperts w1, w3, w2;
  // The shared expert: expert E of w1 / w3 / w2 when it has their shape and encoding (one more pair per token
  // in the grouped launches), else its own gemvs.
  bool shared_grouped = false;
  FusedLinear shared_w13;  // [w1 | w3] of the shared expert
  DeviceLinear shared_w2;
  int shared_inter = 0;

  LayerDevice(const LayerWeights& w) : hc_attn(w.hc_attn), hc_ffn(w.hc_ffn) {}
};

// The MTP block's weights besides its transformer block (which is layers_[n_layers]).
struct MtpDevice {
  HcDevice hc_head;
  DeviceLinear e_proj, h_proj;
  DeviceBuffer enorm, hnorm, norm;
  explicit MtpDevice(const HyperConnWeights& w) : hc_head(w) {}
};

// One sequence's state, with the CPU layout and sizes of model/state.h: per layer the window ring, the compressed
// KV, the indexer keys and the two compressors' partial-block states (kv 0 and scores -inf at sequence start).
struct SequenceDevice {
  struct Layer {
    DeviceBuffer window, compressed, index_keys;
    DeviceBuffer compressor_kv, compressor_score, index_compressor_kv, index_compressor_score;
  };
  std::vector<Layer> layers;  // the model's, then the MTP block's when loaded
  int64_t n_tokens = 0;
  // With the MTP block: the main model's final streams [kMtpRows, hc·D] of the last positions, row p at slot
  // p % kMtpRows; the block has consumed positions < mtp_tokens and trails by the rest (at most kMtpRows).
  DeviceBuffer mtp_rows;
  int64_t mtp_tokens = 0;

  template <class F>
  void for_each_buffer(F&& f) {
    for (Layer& l : layers)
      for (DeviceBuffer* b : {&l.window, &l.compressed, &l.index_keys, &l.compressor_kv, &l.compressor_score,
                              &l.index_compressor_kv, &l.index_compressor_score})
        f(*b);
    f(mtp_rows);
  }
};

// The rows of the chunk being enqueued are positions pos0.. of sequence `seq` (pos0 read from pos_device when set:
// graph-replayable steps). A prefill chunk is one part; a batched decode step one part per sequence, row b for
// sequence b.
struct ChunkPart {
  int seq = 0;
  int64_t pos0 = 0;
  const int64_t* pos_device = nullptr;
};

size_t bytes_of(const DeviceBuffer& b) { return b.data() ? b.size() : 0; }

// Makes `device` current for the scope (each stage of a runner lives on its own GPU) and then restores the previous one.
class DeviceScope {
 public:
  explicit DeviceScope(int device) {
    DSV4_CUDA_CHECK(cudaGetDevice(&previous_));
    if (previous_ != device) DSV4_CUDA_CHECK(cudaSetDevice(device));
    changed_ = previous_ != device;
  }
  ~DeviceScope() {
    if (changed_) cudaSetDevice(previous_);  // no throw from a destructor
  }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

 private:
  int previous_ = 0;
  bool changed_ = false;
};

class CudaRunner final : public SequenceRunner {
 public:
  // Stage `stage` of `stages` (cuda_pipeline_stages); make_cuda_runner checks the memory of every device first and
  // hands the later stages to the first (add_stage).
  CudaRunner(const Model& model, int max_context, CudaRunnerOptions options, const std::vector<CudaStage>& stages,
             size_t stage);
  ~CudaRunner() override;
  void add_stage(std::unique_ptr<CudaRunner> next);

  const ModelConfig& config() const override { return c_; }
  std::vector<float> forward(std::span<const int32_t> tokens, bool last_only) override;
  int32_t forward_draw(std::span<const int32_t> tokens, const TokenDraw& draw) override;
  std::vector<int32_t> forward_draw_rows(std::span<const int32_t> tokens, std::span<const TokenDraw> draws) override;
  int64_t n_tokens() const override { return seqs_[current_seq_].n_tokens; }
  int max_rollback() const override { return kMaxRollback; }
  void rollback(int64_t n_tokens) override;
  bool has_mtp() const override { return model_.has_mtp(); }
  int64_t mtp_pending() const override {
    return has_mtp() ? seqs_[current_seq_].n_tokens - seqs_[current_seq_].mtp_tokens : 0;
  }
  // The MTP block runs on the last stage (it holds the block, the head and an embedding copy).
  int32_t mtp_draft(std::span<const int32_t> next_tokens) override {
    CudaRunner& last = last_stage();
    run_mtp(next_tokens, true);
    return last.host_drawn_[0];
  }
  std::vector<float> mtp_logits(std::span<const int32_t> next_tokens) {
    CudaRunner& last = last_stage();
    run_mtp(next_tokens, false);
    return std::vector<float>(last.host_logits_, last.host_logits_ + next_tokens.size() * size_t(c_.vocab_size));
  }
  int max_context() const override { return max_context_; }
  void reset() override {
    for_each_stage([](CudaRunner& s) { s.reset_stage(); });
  }
  size_t state_bytes() const override;
  CudaRunnerStats stats() const;
  std::vector<CudaStage> stages() const;
  bool draws_on_device() const { return options_.draw_on_device; }
  void set_draw_on_device(bool on) {
    for_each_stage([on](CudaRunner& s) { s.options_.draw_on_device = on; });
  }
  const CudaRunnerOptions& options() const { return options_; }
  void set_step_switches(const CudaRunnerOptions& o) {
    for_each_stage([&o](CudaRunner& s) {
      s.drop_stage_graphs();
      s.options_.draw_on_device = o.draw_on_device;
      s.options_.fuse_mhc_mix = o.fuse_mhc_mix;
      s.options_.fuse_moe_routing = o.fuse_moe_routing;
      s.options_.fuse_moe_gate = o.fuse_moe_gate;
      s.options_.fuse_mhc_post = o.fuse_mhc_post;
      s.options_.swiglu_in_w1_w3_rows = o.swiglu_in_w1_w3_rows;
      s.options_.early_w2_weights = o.early_w2_weights;
      s.options_.overlap_branches = o.overlap_branches;
      s.options_.q_norm_in_attention_rows = o.q_norm_in_attention_rows;
      if (o.overlap_branches) {
        DeviceScope scope(s.stage_.device);
        s.make_side_stream();
      }
    });
  }
  std::vector<LaunchTiming> profile_step(std::span<const int32_t> tokens, bool prefill = false);
  int prefill_chunk() const { return chunk_; }
  int sequences() const { return int(seqs_.size()); }
  void select_sequence(int seq);
  std::vector<float> decode_batch(std::span<const int32_t> tokens);
  std::vector<int32_t> decode_batch_draw(std::span<const int32_t> tokens, std::span<const TokenDraw> draws);
  void copy_sequence(int from, int to);
  void drop_graphs() {
    for_each_stage([](CudaRunner& s) { s.drop_stage_graphs(); });
  }

 private:
  enum class Rows { None, Last, All };  // logits rows a chunk returns (or draws from, when drawn)
  // ---- stages: the runner the caller holds is the first; it drives the later ones (later_), each on its device.
  // Host-side bookkeeping (sequence lengths, the selected sequence, snapshots) is kept by every stage alike.
  template <class F>
  void for_each_stage(F&& f) {
    f(*this);
    for (const std::unique_ptr<CudaRunner>& s : later_) f(*s);
  }
  template <class F>
  void for_each_stage(F&& f) const {
    f(*this);
    for (const std::unique_ptr<CudaRunner>& s : later_) f(std::as_const(*s));
  }
  CudaRunner& last_stage() { return later_.empty() ? *this : *later_.back(); }
  // This stage's part of the public operations.
  void reset_stage();
  void rollback_stage(int64_t n);
  void copy_sequence_stage(int from, int to);
  void drop_stage_graphs();
  // The host side of a chunk on this stage: its token ids (waiting for a queued upload of the previous ones) and the
  // parts (one sequence at pos0, positions on the device when `graph`).
  void stage_chunk(std::span<const int32_t> tokens, int64_t pos0, bool graph);
  // The streams of the chunk's n rows from the previous stage (after its streams_ready_, a peer copy on this stage's
  // stream), then streams_taken_ so that the previous stage does not overwrite them before.
  void take_streams(const CudaRunner& previous, int n);
  // Enqueues this stage's part of the chunk in parts_ (graph replay or direct launches) on its device.
  void launch_stage(int n, Rows rows, bool drawn, bool graph);
  // The last stage: waits for the chunk and appends its logits (or leaves the drawn ids in host_drawn_).
  void collect(int n, Rows rows, bool drawn, std::vector<float>& logits);
  // A captured decode step: one token for each of `count` sequences from `first` on.
  struct DecodeGraph {
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    int64_t kernels = 0;
  };
  void check_tokens(std::span<const int32_t> tokens) const;
  // Speculative decoding. A forward of 2 .. kMaxRollback + 1 tokens (a verify step) first saves the sequence's
  // compressor rows (one launch into snapshot_) and keeps each compressor's input rows (CompressorDevice::history).
  // rollback(n) copies the saved rows back and rebuilds the state the kept rows leave (gpu::compressor_state, the
  // same bits as the forward's). Nothing else needs undoing: the window ring has kMaxRollback spare slots, and
  // entries / indexer keys past the kept positions are never read before being rewritten (model/state.h).
  void save_snapshot();
  std::vector<gpu::CopySpan> snapshot_spans(int seq, bool restore) const;
  // The compressor_states table of a rollback of sequence seq: each compressor's history rows and seq's state (n and
  // pos0 are set per rollback).
  std::vector<gpu::CompressorParams> rollback_params(int seq) const {
    std::vector<gpu::CompressorParams> table;
    for (size_t l = 0; l < layers_.size(); ++l) {
      const SequenceDevice::Layer& st = seqs_[size_t(seq)].layers[l];
      auto add = [&](const CompressorDevice& cd, const DeviceBuffer& kv, const DeviceBuffer& score) {
        const float* rows = cd.history.as<float>();
        table.push_back({rows, rows + cd.width, 2 * int64_t(cd.width), cd.ape.as<float>(), kv.as<float>(),
                         score.as<float>(), nullptr, cd.ratio, cd.dim, 0, cd.overlap, 0});
      };
      if (layers_[l].compressor) add(*layers_[l].compressor, st.compressor_kv, st.compressor_score);
      if (layers_[l].index_compressor) add(*layers_[l].index_compressor, st.index_compressor_kv, st.index_compressor_score);
    }
    return table;
  }
  void check_draw(const TokenDraw& d, const char* what) const;  // its vocab is within the model's
  // The selected sequence consumes tokens in chunks; rows: the logits wanted (All, or Last of the last chunk), or
  // with `drawn` the last row's token drawn by host_draws_[0] into host_drawn_[0].
  std::vector<float> run_sequence(std::span<const int32_t> tokens, Rows rows, bool drawn);
  void run_chunk(std::span<const int32_t> tokens, int64_t pos0, Rows rows, bool drawn, std::vector<float>& logits);
  // parts_ (token ids in host_tokens_, positions in host_pos_ when on the device) through the decode graph of
  // its sequences when `graph`, else by direct launches; waits for the logits unless rows == None. `drawn`: the
  // rows' tokens are drawn on the device by host_draws_ and land in host_drawn_ instead (no logits come back).
  void run_parts(int n, Rows rows, bool drawn, bool graph, std::vector<float>& logits);
  // Everything from the token upload to the logits (or drawn ids) download, asynchronously, for the rows of
  // parts_. Parts with pos_device read their positions from device memory and decide entry finishing on the device
  // (graph capture).
  void enqueue_chunk(int n, Rows rows, bool drawn);
  // The head (final mHC collapse, norm, lm_head) of rows [first, first + rows), rows <= kCudaMaxChunk, and the
  // copy of their logits into host_logits_, or (drawn) the draw of their tokens by draws_ and the copy of the ids
  // into host_drawn_.
  void enqueue_head(int first, int rows, bool drawn, const HcDevice& collapse, const DeviceBuffer& norm);
  // The MTP block on the selected sequence's next next.size() pending pairs (spec 5; model.cpp's mtp_forward): its
  // greedy guess of the token after the last pair drawn into host_drawn_[0] (drawn), or every row's logits into
  // host_logits_. Direct launches, one synchronisation.
  void run_mtp(std::span<const int32_t> next, bool drawn);
  // After a forward of the selected sequence (or a batched step, `stored` false: no rows were kept): the MTP block
  // skips what fell out of the kept rows.
  void mtp_after_forward(SequenceDevice& seq, bool stored) const {
    if (has_mtp()) seq.mtp_tokens = stored ? std::max(seq.mtp_tokens, seq.n_tokens - kMtpRows) : seq.n_tokens;
  }
  // The decode step of sequences 0..B-1; draws: their tokens drawn on the device (host_drawn_), else logits.
  std::vector<float> decode_rows(std::span<const int32_t> tokens, std::span<const TokenDraw> draws);
  void attention_block(int l, int n);
  void ffn_block(int l, int n);
  // The positions of a row op over all n rows of the chunk: one sequence's pos0 / pos_device, or (batched decode)
  // one device position per row.
  void set_positions(RowOpParams& p) const {
    if (parts_.size() == 1) {
      p.pos0 = parts_[0].pos0;
      p.pos_device = parts_[0].pos_device;
    } else {
      p.pos_rows = pos_.as<int64_t>();
    }
  }
  SequenceDevice make_sequence(size_t& state_bytes) const;  // adds the sizes SequenceState::create uses
  // Device tables of model layer l's per-sequence state pointers (index = sequence), for the batched kernels.
  enum StateTable { Window, Compressed, IndexKeys, CompressorKv, CompressorScore, IndexCompressorKv,
                    IndexCompressorScore, kStateTables };
  float* const* state_table(int l, StateTable which) const {
    return state_tables_.as<float*>() + (kStateTables * local(l) + size_t(which)) * seqs_.size();
  }
  float* const* window_rings(int l) const { return state_table(l, Window); }
  float* const* compressed_rows(int l) const { return state_table(l, Compressed); }
  float* const* index_keys_rows(int l) const { return state_table(l, IndexKeys); }
  // Counts the kernels of one launch site; when profiling, an event after it times the site.
  void launched(const char* site, int kernels = 1);
  void record_event(size_t index);  // events_[index] on the stream, created when first needed
  // CudaRunnerOptions::overlap_branches: launches between fork_side() and to_main() go to side_, which first waits
  // for everything queued on the main stream so far; join_side() makes the main stream wait for them. Under graph
  // capture the side launches become a parallel branch. Not while profiling (the sites' events are on stream_).
  bool overlapping() const { return options_.overlap_branches && !profiling_; }
  void fork_side() {
    DSV4_CUDA_CHECK(cudaEventRecord(fork_event_, stream_));
    DSV4_CUDA_CHECK(cudaStreamWaitEvent(side_, fork_event_, 0));
    cur_ = side_;
    side_pending_ = true;
  }
  void to_main() { cur_ = stream_; }
  void make_side_stream() {
    if (side_) return;
    DSV4_CUDA_CHECK(cudaStreamCreateWithFlags(&side_, cudaStreamNonBlocking));
    DSV4_CUDA_CHECK(cudaEventCreateWithFlags(&fork_event_, cudaEventDisableTiming));
    DSV4_CUDA_CHECK(cudaEventCreateWithFlags(&join_event_, cudaEventDisableTiming));
  }
  void join_side() {
    DSV4_CUDA_CHECK(cudaEventRecord(join_event_, side_));
    DSV4_CUDA_CHECK(cudaStreamWaitEvent(stream_, join_event_, 0));
    cur_ = stream_;
    side_pending_ = false;
  }
  void row_op(const char* site, const RowOpParams& p) {
    gpu::row_op(p, cur_);
    launched(site);
  }
  // The activation quantisation of one of the reference's FP8/FP4 linears (Numerics::act) on p.
  GemvParams quantised(GemvParams p) const {
    p.act = act_;
    p.act_scratch = act_scratch_.data();
    return p;
  }
  // y[m, :] = x[m, k] · Wᵀ with bf16 x; `fp8_linear`: one of the reference's FP8/FP4 linears, whose input is
  // quantised under --act-quant fp8.
  void linear(const char* site, const DeviceLinear& w, const void* x, void* y, int m, GemvOut out,
              bool fp8_linear = false) {
    GemvParams p = w.params(x, y, m, out);
    p.stream = cur_;
    dense(fp8_linear ? quantised(p) : p);
    launched(site);
  }
  // A dense linear layer: prefill chunks of kGemmMinRows rows or more through cuBLASLt (the weight decoded into
  // the context's bf16 scratch first; measured faster than the tiled gemv from there on, docs/perf.md), else
  // gemv. Quantised activations, row ranges and the fp4 weights that gemv_beats_decode_and_gemm stay on gemv.
  void dense(const GemvParams& p) {
    const int64_t ldy = p.ldy ? p.ldy : p.n, out_bytes = p.out == GemvOut::BF16 ? 2 : 4;
    auto aligned16 = [](const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; };
    if (!gemm_ || p.m < kGemmMinRows || gemv_beats_decode_and_gemm(p) || p.act != GemvAct::BF16 || p.w_row0 != 0 ||
        !aligned16(p.x) || !aligned16(p.y) || ldy * out_bytes % 16 != 0) {
      gemv(p);
      return;
    }
    GemmParams g;
    g.m = p.m, g.n = p.n, g.k = p.k, g.x = p.x, g.weight = p.weight, g.w = p.w, g.w_scale = p.w_scale;
    g.w_scale_2 = p.w_scale_2, g.fp8_scale = p.fp8_scale, g.y = p.y, g.ldy = ldy, g.out = p.out, g.stream = p.stream;
    g.layout = p.layout;
    gemm_->gemm(g);
    ++stats_.cublas_linears;
  }
  // Every part of a fused projection into its columns of y [m, f.n] (fp32); columns below fp8_rows belong to
  // FP8/FP4 linears of the reference (a part that straddles the boundary runs as two calls).
  void linear(const char* site, const FusedLinear& f, const void* x, float* y, int m, int fp8_rows = 0) {
    if (act_ == GemvAct::BF16) fp8_rows = 0;
    for (const FusedLinear::Part& part : f.parts) {
      const int end = part.row0 + part.weight.n, split = std::clamp(fp8_rows, part.row0, end) - part.row0;
      for (const auto& [row0, rows, fp8] : {std::tuple{0, split, true}, {split, part.weight.n - split, false}}) {
        if (rows == 0) continue;
        GemvParams p = part.weight.params(x, y + part.row0 + row0, m, GemvOut::F32, f.n, row0, rows);
        p.stream = cur_;
        dense(fp8 ? quantised(p) : p);
        launched(site);
      }
    }
  }
  // y[pair, :] = x[pair / x_row_div, :] · W_eᵀ for the routed pairs of the moe_slots arrays.
  // active_slots: at most this many experts hold pairs (the chunk's pairs), for the kernel's split choice.
  // x_rows: the rows of x (for the activation quantisation outside the W4A8 kernel).
  GemvGroupedParams grouped_params(const DeviceExperts& w, const void* x, int x_row_div, int x_rows, void* y,
                                   int max_rows, int active_slots, GemvOut out) const {
    GemvGroupedParams g;
    g.base.m = max_rows;
    g.base.n = w.n;
    g.base.k = w.k;
    g.base.x = x;
    g.base.w = w.w.data();
    g.base.w_scale = w.scale.data();
    g.base.y = y;
    g.base.weight = w.format;
    g.base.fp8_scale = w.fp8_scale;
    g.base.layout = w.layout;
    g.base.out = out;
    g.base.stream = cur_;
    g.w_expert_stride = w.w_stride;
    g.scale_expert_stride = w.scale_stride;
    g.scale_2 = w.scale_2.data() ? w.scale_2.as<float>() : nullptr;
    g.max_slots = max_slots_;
    g.active_slots_hint = active_slots;
    g.slots = slots_;
    g.x_row_div = x_row_div;
    g.x_rows = x_rows;
    g.base = quantised(g.base);  // the routed and shared experts are FP8/FP4 linears of the reference
    return g;
  }
  // grouped_params' launch; second / y_second: another projection of the same x and routing in the same launch (w3
  // next to w1), optionally with the SwiGLU of both after it.
  void linear_grouped(const char* site, const DeviceExperts& w, const void* x, int x_row_div, int x_rows, void* y,
                      int max_rows, int active_slots, GemvOut out, const DeviceExperts* second = nullptr,
                      void* y_second = nullptr, const gpu::SwigluParams* swiglu = nullptr) {
    GemvGroupedParams g = grouped_params(w, x, x_row_div, x_rows, y, max_rows, active_slots, out);
    if (second) {
      DSV4_CHECK(second->format == w.format && second->fp8_scale == w.fp8_scale && second->layout == w.layout &&
                     second->n == w.n &&
                     second->k == w.k && second->w_stride == w.w_stride && second->scale_stride == w.scale_stride,
                 "cuda runner: experts' w1 and w3 differ in encoding or shape");
      g.second.w = second->w.data();
      g.second.w_scale = second->scale.data();
      g.second.scale_2 = second->scale_2.data() ? second->scale_2.as<float>() : nullptr;
      g.second.y = y_second;
    }
    if (swiglu) {
      g.swiglu = *swiglu;
      g.slot_tickets = slot_tickets_.as<uint32_t>();
    }
    launched(site, gemv_grouped(g));
  }
  // Decode-sized chunks with CudaRunnerOptions::fuse_mhc_mix: each hc_post also computes the next sublayer's mix
  // (gpu::hc_post_mix) and hc_pre adds its partials, one launch fewer per sublayer.
  bool fused_mix(int n) const {
    return options_.fuse_mhc_mix && n <= kCudaMaxChunk && c_.hc_mult == 4 && c_.hidden_size % 4 == 0;
  }
  enum class Sublayer { Attention, Ffn };
  // 2.3 mHC mix + pre + the sublayer's norm; mix_ready: the previous hc_post_mix left the mix partials. Otherwise
  // hc_pre computes the mix itself (HcPreParams::fn: inside the collapse's cluster at decode) into mix_.
  void mhc_pre(Sublayer sublayer, const HcDevice& w, const DeviceBuffer& norm, int n, bool mix_ready) {
    const int D = c_.hidden_size, hc = c_.hc_mult;
    const bool attn = sublayer == Sublayer::Attention;
    gpu::HcPreParams p{streams_.as<float>(), nullptr, w.base.as<float>(), w.scale.as<float>(),
                       norm.as<float>(), n, hc, D, c_.hc_sinkhorn_iters, c_.hc_eps, c_.rms_norm_eps,
                       post_.as<float>(), comb_.as<float>(), normed_.as<float>(), normed_bf16_.as<uint16_t>()};
    if (mix_ready) {
      p.mix_partials = mix_partials_.as<float>();
      p.mix_blocks = gpu::hc_post_mix_blocks(D);
    } else {
      p.fn = w.fn.as<float>();
      p.mix_out = mix_.as<float>();
    }
    const bool posts = pending_post_.out != nullptr;  // the previous sublayer's mHC post, left to this launch
    if (posts) {
      p.prev_out = pending_post_.out;
      p.prev_out_k = pending_post_.out_k;
      p.prev_out2 = pending_post_.out2;
      pending_post_ = {};
    }
    if (!overlapping()) {
      launched(posts ? (attn ? "attn: mHC post + mix + hc_pre + norm" : "ffn: mHC post + mix + hc_pre + norm")
                     : (attn ? "attn: mHC mix + hc_pre + norm" : "ffn: mHC mix + hc_pre + norm"),
               gpu::hc_pre(p, cur_));
      return;
    }
    // overlap_branches: the sublayer needs only the collapse; post and comb (the Sinkhorn, hc_pre's longer half) are
    // read by mhc_post at its end, so they run on the second stream meanwhile (joined in mhc_post at the latest).
    p.parts = gpu::HcPreParts::Collapse;
    launched(posts ? (attn ? "attn: mHC post + mix + hc_pre collapse + norm"
                           : "ffn: mHC post + mix + hc_pre collapse + norm")
                   : (attn ? "attn: mHC mix + hc_pre collapse + norm" : "ffn: mHC mix + hc_pre collapse + norm"),
             gpu::hc_pre(p, cur_));
    p.prev_out = p.prev_out2 = nullptr;
    fork_side();
    p.parts = gpu::HcPreParts::PostComb;
    if (!mix_ready) {  // the mix the collapse wrote
      p.fn = nullptr;
      p.mix = mix_.as<float>();
    }
    launched(attn ? "attn: hc_pre post + comb" : "ffn: hc_pre post + comb", gpu::hc_pre(p, cur_));
    to_main();
  }
  // 2.4 mHC post of the sublayer output (out [n, out_k, D] summed in order, + out2); `next`: the mHC whose mix the
  // fused kernel computes on the way (none after the last layer, or when not fused).
  void mhc_post(Sublayer sublayer, const float* out, int out_k, const float* out2, int n, const HcDevice* next) {
    const int D = c_.hidden_size, hc = c_.hc_mult;
    const bool attn = sublayer == Sublayer::Attention;
    if (side_pending_) join_side();  // post and comb, when mhc_pre left them to the second stream
    if (next && fused_mix(n)) {
      gpu::hc_post_mix({out, out_k, out2, post_.as<float>(), comb_.as<float>(), n, hc, D, streams_.as<float>(),
                        next->fn.as<float>(), (2 + hc) * hc, mix_partials_.as<float>()},
                       cur_);
      launched(attn ? "attn: hc_post + ffn mix" : "ffn: hc_post + next attn mix");
      return;
    }
    if (next && options_.fuse_mhc_post) {  // the next sublayer's hc_pre applies it (one launch fewer)
      pending_post_ = {out, out_k, out2};
      return;
    }
    gpu::hc_post(out, out_k, out2, post_.as<float>(), comb_.as<float>(), n, hc, D, streams_.as<float>(), cur_);
    launched(attn ? "attn: hc_post" : "ffn: hc_post");
  }
  void linear_f32(const char* site, const float* x, const DeviceBuffer& w, float* y, int m, int rows, int k,
                  float scale = 1.0f) {
    gpu::linear_f32({x, w.as<float>(), y, m, rows, k, scale}, cur_);
    launched(site);
  }

  // Declared first, so destroyed last: the destructor makes this stage's device current for the members' release and
  // this gives the caller's device back afterwards.
  struct RestoreDevice {
    int device = -1;
    ~RestoreDevice() {
      if (device >= 0) cudaSetDevice(device);
    }
  } restore_device_;
  const Model& model_;
  const ModelConfig& c_;
  const Numerics numerics_;
  const GemvAct act_;  // FP8 under Numerics::act == FP8: the inputs of the reference's FP8/FP4 linears
  int max_context_ = 0, window_slots_ = 0;
  int chunk_ = kCudaMaxChunk;  // tokens per prefill chunk (last-row logits); workspaces hold this many rows
  std::optional<GemmContext> gemm_;  // cuBLASLt for the dense linears of chunks >= kGemmMinRows rows
  std::vector<SequenceDevice> seqs_;
  int current_seq_ = 0;              // the sequence forward() / reset() / n_tokens() act on
  std::vector<ChunkPart> parts_;     // of the chunk being enqueued (capacity chunk_: never reallocates)
  size_t state_bytes_ = 0;
  CudaRunnerStats stats_;
  int64_t launches_ = 0;
  cudaStream_t stream_ = nullptr;
  // The stream the launch helpers use: stream_, or side_ between fork_side() and to_main() / join_side().
  cudaStream_t cur_ = nullptr;
  cudaStream_t side_ = nullptr;  // CudaRunnerOptions::overlap_branches
  // CudaRunnerOptions::fuse_mhc_post: the sublayer output mhc_post left to the next mhc_pre (out null: none).
  struct PendingPost {
    const float* out = nullptr;
    int out_k = 0;
    const float* out2 = nullptr;
  } pending_post_;
  cudaEvent_t fork_event_ = nullptr, join_event_ = nullptr;
  bool side_pending_ = false;  // launches on side_ that the main stream has not joined yet
  CudaRunnerOptions options_;
  CudaStage stage_;  // this runner's device and layers [stage_.layer_begin, stage_.layer_end)
  bool last_ = true;  // holds the head (and the MTP block)
  std::vector<std::unique_ptr<CudaRunner>> later_;  // the first stage only: the stages after it, in order
  CudaRunner* next_ = nullptr;                      // the stage after this one
  cudaEvent_t streams_ready_ = nullptr;  // after this stage's layers of the chunk (not on the last stage)
  cudaEvent_t streams_taken_ = nullptr;  // after this stage copied the previous stage's streams (not on the first)
  std::map<std::tuple<int, int, bool>, DecodeGraph> decode_graphs_;  // by (first sequence, count, drawn)
  cudaEvent_t tokens_uploaded_ = nullptr;  // host_tokens_ may be rewritten once this has completed
  bool upload_pending_ = false;

  // weights
  DeviceBuffer final_norm_, inv_freq_main_, inv_freq_compress_;
  DeviceLinear embed_, head_;
  std::optional<HcDevice> hc_head_;
  // This stage's blocks, model layer l at local(l), then (last stage) the MTP block's when the model has it.
  std::vector<LayerDevice> layers_;
  size_t local(int l) const { return size_t(l - stage_.layer_begin); }
  std::optional<MtpDevice> mtp_;
  DeviceBuffer mtp_e_, mtp_h_bf16_;  // MTP input workspaces: e_proj output [kMtpRows, D], hnorm'd rows bf16

  // workspaces, sized for chunk_ tokens (the logits for kCudaMaxChunk rows)
  DeviceBuffer tokens_, streams_, mix_, post_, comb_, normed_, normed_bf16_, y_x_, qr_bf16_, y_q_, kv_chunk_,
      index_w_, scores_, selected_, o_grouped_, z_, attn_out_, router_logits_, expert_ids_,
      expert_weights_, slot_count_, slot_expert_, slot_offset_, row_order_, expert_gate_, expert_up_, h_, y_pairs_,
      shared_y13_, h_shared_, shared_out_, head_in_, logits_, attention_scratch_, pair_weights_,
      act_scratch_, mix_partials_;
  MoeSlots slots_;     // views of slot_count_ .. row_order_
  int max_slots_ = 1;  // grouped-gemv grid: min(experts, picks of a full chunk)
  int max_entries_ = 1;  // largest compressed-entry count of any layer (scores scratch row length)
  int32_t* host_tokens_ = nullptr;  // pinned [chunk_]
  int64_t* host_pos_ = nullptr;     // pinned [kCudaMaxChunk], the decode steps' positions (one per part)
  DeviceBuffer pos_;                // int64 [kCudaMaxChunk] positions read by the decode steps' kernels
  DeviceBuffer moe_ticket_;         // uint32, 0 between launches: moe_gate_route_and_slots's ticket
  DeviceBuffer slot_tickets_;       // uint32 [max_slots_], 0 between launches: the grouped w1 + w3's SwiGLU
  DeviceBuffer state_tables_;       // [layer][StateTable][sequence] state pointers
  float* host_logits_ = nullptr;    // pinned [kCudaMaxChunk, vocab]
  DeviceBuffer snapshot_;                               // one sequence's compressor rows (save_snapshot)
  std::vector<DeviceBuffer> save_spans_, restore_spans_;  // per sequence: gpu::CopySpan tables into / out of it
  std::vector<DeviceBuffer> rollback_tables_;           // per sequence: rollback_params on the device
  int rollback_count_ = 0, rollback_max_width_ = 1;     // compressors in a table, widest state row
  int snapshot_seq_ = -1;                               // whose rows snapshot_ holds, -1: none
  int snapshot_span_count_ = 0;                         // buffers per sequence it covers
  int64_t snapshot_pos_ = 0;                            // the position they were saved at
  bool recording_ = false;                              // the chunk being enqueued keeps its compressor rows
  DeviceBuffer draws_, drawn_;      // TokenDraw / int32 [kCudaMaxChunk]: the device draw's parameters and ids
  TokenDraw* host_draws_ = nullptr; // pinned [kCudaMaxChunk]
  int32_t* host_drawn_ = nullptr;   // pinned [kCudaMaxChunk]

  // profile_step: an event after every launch site of one eager step (events_[0] marks its start)
  struct SiteMark {
    const char* site;
    int layer, kernels;
  };
  bool profiling_ = false;
  int current_layer_ = -1;
  std::vector<SiteMark> marks_;
  std::vector<cudaEvent_t> events_;
};

CudaRunner::CudaRunner(const Model& model, int max_context, CudaRunnerOptions options,
                       const std::vector<CudaStage>& stages, size_t stage)
    : model_(model), c_(model.config()), numerics_(model.numerics()),
      act_(model.numerics().act == ActQuant::FP8 ? GemvAct::FP8 : GemvAct::BF16),
      max_context_(max_context),
      options_(options), stage_(stages.at(stage)), last_(stage + 1 == stages.size()) {
  DSV4_CHECK(cuda_available(), "--device cuda: no usable CUDA device or driver");
  DSV4_CHECK(max_context > 0, "--max-context must be positive, got {}", max_context);
  DeviceScope scope(stage_.device);
  const ModelConfig& c = c_;
  const ModelWeights& W = model.weights();
  const int D = c.hidden_size, H = c.n_heads, hd = c.head_dim, rd = c.rope_dim, hc = c.hc_mult;
  DSV4_CHECK(hd % 32 == 0 && hd <= 512, "cuda runner: head_dim {} must be a multiple of 32 and at most 512", hd);
  DSV4_CHECK(D % 8 == 0 && c.q_lora_rank % 8 == 0, "cuda runner: hidden_size {} and q_lora_rank {} must be multiples of 8",
             D, c.q_lora_rank);
  DSV4_CHECK(c.o_groups > 0 && H % c.o_groups == 0, "cuda runner: {} heads do not split into o_groups = {}", H,
             c.o_groups);
  DSV4_CHECK(c.moe_inter % 8 == 0, "cuda runner: moe_intermediate_size {} must be a multiple of 8", c.moe_inter);
  // Non-blocking (graph capture must not meet the legacy stream); the constructor ends with a device sync, so
  // the uploads and memsets on the legacy stream are complete before the first launch.
  DSV4_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  DSV4_CUDA_CHECK(cudaEventCreateWithFlags(&tokens_uploaded_, cudaEventDisableTiming));
  DSV4_CUDA_CHECK(cudaEventCreateWithFlags(&streams_ready_, cudaEventDisableTiming));
  DSV4_CUDA_CHECK(cudaEventCreateWithFlags(&streams_taken_, cudaEventDisableTiming));
  cur_ = stream_;
  if (options_.overlap_branches) make_side_stream();

  window_slots_ = std::min(c.window + kMaxRollback, max_context);  // model/state.h: room for rolled-back tokens
  WeightUploader uploader(options.synthetic_format, options.synthetic_seed, options.fp4_tiles);
  // The embedding is a gather from a bf16 table: the uploader's bf16 rows (of fp32 values, or synthetic codes). The
  // first stage embeds the tokens; the last one needs the table too for the MTP block's input.
  if (stage_.first() || (last_ && model.has_mtp())) {
    embed_ = uploader.linear(W.embed, GemvWeight::BF16);
    DSV4_CHECK(embed_.format == GemvWeight::BF16 && embed_.n == c.vocab_size && embed_.k == D,
               "cuda runner: the embedding must be a bf16 [{}, {}] table", c.vocab_size, D);
  }
  if (last_) {
    head_ = uploader.linear(W.head, GemvWeight::BF16);
    final_norm_ = upload_f32(W.norm);
    hc_head_.emplace(W.hc_head);
  }
  inv_freq_main_ = upload_f32(rope_inv_freq(c.rope_main, rd));
  inv_freq_compress_ = upload_f32(rope_inv_freq(c.rope_compress, rd));

  int max_n_x = 0, max_n_q = 0, max_inter = 1, max_shared = 1, shared_grouped_layers = 0;
  max_entries_ = max_compressed_entries(c, max_context);
  layers_.reserve(size_t(stage_.layer_end - stage_.layer_begin) + 1);
  // Block l of the model (l = n_layers: the MTP block, sliding-window attention only, like ModelConfig's accessors).
  auto add_layer = [&](const LayerWeights& L, int l) {
    const AttentionWeights& A = L.attn;
    LayerDevice& d = layers_.emplace_back(L);
    d.ratio = c.ratio(l);
    d.indexer = A.indexer.has_value();
    d.hash = c.hashed(l);
    d.inv_freq = (c.has_compressor(l) ? inv_freq_compress_ : inv_freq_main_).as<float>();
    d.attn_norm = upload_f32(L.attn_norm);
    d.ffn_norm = upload_f32(L.ffn_norm);
    d.q_norm = upload_f32(A.q_norm);
    d.kv_norm = upload_f32(A.kv_norm);
    d.sink = upload_f32(A.sink);

    std::vector<const Matrix*> x_rows = {&A.wq_a, &A.wkv};
    d.off_kv = c.q_lora_rank;
    int n_x = c.q_lora_rank + hd;
    auto add_compressor = [&](const CompressorWeights& cw, int& off_kv, int& off_gate) {
      off_kv = n_x;
      off_gate = n_x + cw.wkv.rows;
      n_x += cw.wkv.rows + cw.wgate.rows;
      x_rows.push_back(&cw.wkv);
      x_rows.push_back(&cw.wgate);
      CompressorDevice dev;
      dev.ratio = cw.ratio;
      dev.dim = cw.dim;
      dev.overlap = cw.overlap;
      dev.rows = (cw.overlap ? 2 : 1) * cw.ratio;
      dev.width = (cw.overlap ? 2 : 1) * cw.dim;
      dev.ape = upload_f32(cw.ape.data);
      dev.norm = upload_f32(cw.norm);
      dev.history = DeviceBuffer(size_t(kMaxRollback + 1) * 2 * dev.width * sizeof(float));
      return dev;
    };
    if (A.compressor) d.compressor = add_compressor(*A.compressor, d.off_ckv, d.off_cgate);
    if (A.indexer) d.index_compressor = add_compressor(A.indexer->compressor, d.off_ikv, d.off_igate);
    d.n_x = n_x;
    d.w_x = uploader.fused(x_rows);
    std::vector<const Matrix*> q_rows = {&A.wq_b};
    d.n_q = H * hd;
    d.off_iq = H * hd;
    if (A.indexer) {
      q_rows.push_back(&A.indexer->wq_b);
      d.n_q += A.indexer->wq_b.rows;
      d.index_wproj = upload_f32(A.indexer->weights_proj.data);
    }
    d.w_q = uploader.fused(q_rows);
    d.wo_a = uploader.linear(A.wo_a);
    d.wo_b = uploader.linear(A.wo_b);
    DSV4_CHECK(d.wo_a.format != GemvWeight::FP8_BLOCK || c.o_lora_rank % 16 == 0,
               "cuda runner: fp8 wo_a needs o_lora_rank {} to be a multiple of 16 (per-group row ranges)",
               c.o_lora_rank);
    max_n_x = std::max(max_n_x, d.n_x);
    max_n_q = std::max(max_n_q, d.n_q);

    const MoEWeights& M = L.ffn;
    d.gate = upload_f32(M.gate.data);
    if (!M.gate_bias.empty()) d.gate_bias = upload_f32(M.gate_bias);
    if (d.hash) d.tid2eid = upload_i32(M.tid2eid);
    std::vector<const Matrix*> w1, w3, w2;
    for (const ExpertWeights& e : M.experts) {
      w1.push_back(&e.w1);
      w3.push_back(&e.w3);
      w2.push_back(&e.w2);
    }
    if (M.shared) {
      d.shared_inter = M.shared->w1.rows;
      DSV4_CHECK(d.shared_inter % 8 == 0, "cuda runner: shared expert width {} must be a multiple of 8",
                 d.shared_inter);
      auto with_shared = [](std::vector<const Matrix*> v, const Matrix& m) {
        v.push_back(&m);
        return v;
      };
      d.shared_grouped = options.group_shared_expert && uploader.groupable(with_shared(w1, M.shared->w1)) &&
                         uploader.groupable(with_shared(w3, M.shared->w3)) &&
                         uploader.groupable(with_shared(w2, M.shared->w2));
      if (d.shared_grouped) {
        w1.push_back(&M.shared->w1);
        w3.push_back(&M.shared->w3);
        w2.push_back(&M.shared->w2);
        ++shared_grouped_layers;
      } else {
        d.shared_w13 = uploader.fused({&M.shared->w1, &M.shared->w3});
        d.shared_w2 = uploader.linear(M.shared->w2);
        max_shared = std::max(max_shared, d.shared_inter);
      }
    }
    d.w1 = uploader.experts(w1);
    d.w3 = uploader.experts(w3);
    d.w2 = uploader.experts(w2);
    max_inter = std::max(max_inter, c.moe_inter);
  };
  for (int l = stage_.layer_begin; l < stage_.layer_end; ++l) add_layer(W.layers[size_t(l)], l);
  if (last_ && model.has_mtp()) {
    const MtpWeights& m = *W.mtp;
    add_layer(m.block, c.n_layers);
    mtp_.emplace(m.hc_head);
    mtp_->e_proj = uploader.linear(m.e_proj);
    mtp_->h_proj = uploader.linear(m.h_proj);
    mtp_->enorm = upload_f32(m.enorm);
    mtp_->hnorm = upload_f32(m.hnorm);
    mtp_->norm = upload_f32(m.norm);
    stats_.weight_bytes += mtp_->e_proj.bytes() + mtp_->h_proj.bytes();
  }
  uploader.release_scratch();  // before the workspaces and state
  if (shared_grouped_layers)
    spdlog::info("cuda runner: the shared expert runs as one more grouped expert in {} of {} layers (same shape and "
                 "encoding as the routed ones)", shared_grouped_layers, layers_.size());
  else if (!options.group_shared_expert)
    spdlog::info("cuda runner: the shared expert runs through its own gemvs (group_shared_expert off){}",
                 options.overlap_branches ? ", beside the routing on a second stream" : "");
  stats_.weight_bytes += embed_.bytes() + head_.bytes();
  for (const LayerDevice& d : layers_) {
    stats_.weight_bytes += d.w_x.bytes() + d.w_q.bytes() + d.wo_a.bytes() + d.wo_b.bytes() + d.w1.bytes() +
                           d.w3.bytes() + d.w2.bytes() + d.shared_w13.bytes() + d.shared_w2.bytes();
    for (const DeviceBuffer* b : {&d.gate, &d.index_wproj}) stats_.weight_bytes += bytes_of(*b);
  }
  const int n_mix = (2 + hc) * hc, k = c.n_experts_per_tok, pairs = k + 1;  // + the shared expert's pair
  chunk_ = cuda_prefill_chunk(options.prefill_chunk, pairs, max_entries_, max_context);
  if (stage_.first() && chunk_ < options.prefill_chunk && chunk_ < max_context)  // lowered by the limits
    spdlog::info("cuda runner: prefill chunks of {} tokens instead of {} ({} routed pairs per token, {} indexer "
                 "scores per row)", chunk_, options.prefill_chunk, pairs, max_entries_);
  const size_t C = chunk_, f = sizeof(float), b16 = sizeof(uint16_t);
  if (chunk_ >= kGemmMinRows) {  // scratch for the largest non-bf16 dense weight (the experts stay on gemv)
    size_t scratch = 0;
    auto need = [&](const DeviceLinear& w) {
      if (w.format != GemvWeight::BF16) scratch = std::max(scratch, size_t(w.n) * w.k);
    };
    for (const LayerDevice& d : layers_) {
      for (const FusedLinear* fl : {&d.w_x, &d.w_q, &d.shared_w13})
        for (const FusedLinear::Part& part : fl->parts) need(part.weight);
      need(d.wo_b);
      need(d.shared_w2);
    }
    if (mtp_) {
      need(mtp_->e_proj);
      need(mtp_->h_proj);
    }
    gemm_.emplace(scratch);
    stats_.workspace_bytes += scratch * b16 + GemmContext::kWorkspaceBytes;
  }
  // The workspaces scale with the prefill chunk: an allocation that fails says which knob lowers them.
  size_t allocated = 0;
  auto workspace = [&](size_t bytes) {
    try {
      DeviceBuffer b = zeros(bytes);
      allocated += bytes;
      return b;
    } catch (const Error& e) {
      DSV4_FAIL("cuda runner: the workspaces for prefill chunks of {} tokens do not fit the GPU ({:.2f} GB allocated, "
                "{:.3f} GB more asked: {}); lower --cuda-prefill-chunk (CudaRunnerOptions::prefill_chunk)",
                chunk_, allocated / 1e9, bytes / 1e9, e.what());
    }
  };
  tokens_ = workspace(C * sizeof(int32_t));
  streams_ = workspace(C * hc * D * f);
  mix_ = workspace(C * n_mix * f);
  post_ = workspace(C * hc * f);
  comb_ = workspace(C * hc * hc * f);
  normed_ = workspace(C * D * f);
  normed_bf16_ = workspace(C * D * b16);
  y_x_ = workspace(C * max_n_x * f);
  qr_bf16_ = workspace(C * c.q_lora_rank * b16);
  y_q_ = workspace(C * max_n_q * f);
  kv_chunk_ = workspace(C * hd * f);
  index_w_ = workspace(C * std::max(c.index_n_heads, 1) * f);
  scores_ = workspace(C * max_entries_ * f);
  selected_ = workspace(C * std::max(c.index_topk, 1) * sizeof(int32_t));
  o_grouped_ = workspace(C * H * hd * b16);
  z_ = workspace(C * c.o_groups * c.o_lora_rank * b16);
  attn_out_ = workspace(C * D * f);
  router_logits_ = workspace(C * c.n_routed_experts * f);
  moe_ticket_ = workspace(sizeof(uint32_t));
  expert_ids_ = workspace(C * k * sizeof(int32_t));
  expert_weights_ = workspace(C * k * f);
  max_slots_ = std::max(1, std::min<int>(c.n_routed_experts + 1, int(C) * pairs));
  slot_count_ = workspace(sizeof(int32_t));
  slot_tickets_ = workspace(size_t(max_slots_) * sizeof(uint32_t));
  slot_expert_ = workspace(max_slots_ * sizeof(int32_t));
  slot_offset_ = workspace((max_slots_ + 1) * sizeof(int32_t));
  row_order_ = workspace(C * pairs * sizeof(int32_t));
  pair_weights_ = workspace(C * pairs * f);
  slots_ = {slot_count_.as<int32_t>(), slot_expert_.as<int32_t>(), slot_offset_.as<int32_t>(),
            row_order_.as<int32_t>()};
  expert_gate_ = workspace(C * pairs * max_inter * f);
  expert_up_ = workspace(C * pairs * max_inter * f);
  h_ = workspace(C * pairs * max_inter * b16);
  y_pairs_ = workspace(C * pairs * D * f);
  shared_y13_ = workspace(C * 2 * max_shared * f);
  h_shared_ = workspace(C * max_shared * b16);
  shared_out_ = workspace(C * D * f);
  head_in_ = workspace(C * D * b16);
  logits_ = workspace(size_t(kCudaMaxChunk) * c.vocab_size * f);
  // Always: set_step_switches may turn fuse_mhc_mix on later (dsv4 bench --switches mhc wrote past an unallocated
  // buffer on the H100 when this depended on the build-time option). 196 KB for Flash.
  mix_partials_ = workspace(size_t(kCudaMaxChunk) * (2 + hc) * hc * gpu::hc_post_mix_blocks(D) * f);
  size_t attention_scratch = 0;  // split-key partials of the chunks with few tokens (decode)
  for (const LayerDevice& d : layers_)
    for (int n = 1; n <= chunk_; ++n) {
      gpu::AttentionParams ap;
      ap.n = n;
      ap.heads = H;
      ap.dim = hd;
      ap.window = c.window;
      ap.ratio = d.ratio;
      ap.selected = d.indexer ? selected_.as<int32_t>() : nullptr;
      ap.topk = c.index_topk;
      ap.max_entries = d.ratio ? max_context / d.ratio : 0;
      attention_scratch = std::max(attention_scratch, gpu::attention_scratch_floats(ap));
    }
  attention_scratch_ = workspace(attention_scratch * f);
  if (act_ == GemvAct::FP8)  // the largest input of a quantised linear (bf16); the MTP block's h_proj has hc rows a pair
    act_scratch_ = workspace(std::max(C * std::max({D, c.q_lora_rank, c.o_groups * c.o_lora_rank, pairs * max_inter,
                                                max_shared}),
                                  mtp_ ? size_t(kMtpRows) * hc * D : 0) *
                         b16);
  if (mtp_) {
    mtp_e_ = workspace(size_t(kMtpRows) * D * f);
    mtp_h_bf16_ = workspace(size_t(kMtpRows) * hc * D * b16);
  }
  for (const DeviceBuffer* b : {&tokens_, &streams_, &mix_, &post_, &comb_, &normed_, &normed_bf16_, &y_x_,
                                &qr_bf16_, &y_q_, &kv_chunk_, &index_w_, &scores_, &selected_, &o_grouped_,
                                &z_, &attn_out_, &router_logits_, &expert_ids_, &expert_weights_,
                                &slot_count_, &slot_expert_, &slot_offset_, &row_order_, &expert_gate_, &expert_up_,
                                &h_, &y_pairs_, &shared_y13_, &h_shared_, &shared_out_, &head_in_, &logits_,
                                &attention_scratch_, &pair_weights_, &act_scratch_, &mix_partials_, &mtp_e_,
                                &mtp_h_bf16_})
    stats_.workspace_bytes += bytes_of(*b);
  pos_ = zeros(kCudaMaxChunk * sizeof(int64_t));
  DSV4_CUDA_CHECK(cudaMallocHost(&host_tokens_, C * sizeof(int32_t)));
  DSV4_CUDA_CHECK(cudaMallocHost(&host_pos_, kCudaMaxChunk * sizeof(int64_t)));
  DSV4_CUDA_CHECK(cudaMallocHost(&host_logits_, size_t(kCudaMaxChunk) * c.vocab_size * f));
  draws_ = zeros(kCudaMaxChunk * sizeof(TokenDraw));
  drawn_ = zeros(kCudaMaxChunk * sizeof(int32_t));
  DSV4_CUDA_CHECK(cudaMallocHost(&host_draws_, kCudaMaxChunk * sizeof(TokenDraw)));
  DSV4_CUDA_CHECK(cudaMallocHost(&host_drawn_, kCudaMaxChunk * sizeof(int32_t)));
  DSV4_CHECK(options.sequences >= 1 && options.sequences <= kCudaMaxChunk,
             "cuda runner: sequences = {} must be in [1, {}] (a batched decode step is one chunk)", options.sequences,
             kCudaMaxChunk);
  parts_.reserve(C);
  for (int s = 0; s < options.sequences; ++s) {
    seqs_.push_back(make_sequence(state_bytes_));
    current_seq_ = s;
    reset();
  }
  current_seq_ = 0;
  std::vector<float*> tables;
  for (size_t l = 0; l < layers_.size(); ++l) {
    for (DeviceBuffer SequenceDevice::Layer::*b :  // in StateTable order
         {&SequenceDevice::Layer::window, &SequenceDevice::Layer::compressed, &SequenceDevice::Layer::index_keys,
          &SequenceDevice::Layer::compressor_kv, &SequenceDevice::Layer::compressor_score,
          &SequenceDevice::Layer::index_compressor_kv, &SequenceDevice::Layer::index_compressor_score})
      for (SequenceDevice& s : seqs_) tables.push_back((s.layers[l].*b).as<float>());
  }
  state_tables_ = DeviceBuffer(tables.size() * sizeof(float*));
  state_tables_.upload(tables.data(), tables.size() * sizeof(float*));
  size_t snapshot_floats = 0;
  for (const gpu::CopySpan& s : snapshot_spans(0, false)) snapshot_floats += size_t(s.count), ++snapshot_span_count_;
  snapshot_ = DeviceBuffer(std::max<size_t>(snapshot_floats, 4) * sizeof(float));
  for (int s = 0; s < sequences(); ++s)
    for (bool restore : {false, true}) {
      const std::vector<gpu::CopySpan> spans = snapshot_spans(s, restore);
      DeviceBuffer table(std::max<size_t>(spans.size(), 1) * sizeof(gpu::CopySpan));
      if (!spans.empty()) table.upload(spans.data(), spans.size() * sizeof(gpu::CopySpan));
      (restore ? restore_spans_ : save_spans_).push_back(std::move(table));
    }
  for (int s = 0; s < sequences(); ++s) {
    const std::vector<gpu::CompressorParams> params = rollback_params(s);
    rollback_count_ = int(params.size());
    for (const gpu::CompressorParams& p : params)
      rollback_max_width_ = std::max(rollback_max_width_, p.overlap ? 2 * p.dim : p.dim);
    DeviceBuffer table(std::max<size_t>(params.size(), 1) * sizeof(gpu::CompressorParams));
    if (!params.empty()) table.upload(params.data(), params.size() * sizeof(gpu::CompressorParams));
    rollback_tables_.push_back(std::move(table));
  }
  DSV4_CUDA_CHECK(cudaDeviceSynchronize());
  if (stages.size() > 1)
    spdlog::info("cuda runner: stage {} of {} on GPU {}: layers {}..{}{}{}, {:.2f} GiB of weights", stage + 1,
                 stages.size(), stage_.device, stage_.layer_begin, stage_.layer_end - 1,
                 stage_.first() ? " + embedding" : "", last_ ? (mtp_ ? " + head + MTP block" : " + head") : "",
                 double(stats_.weight_bytes) / double(size_t(1) << 30));
}

void CudaRunner::add_stage(std::unique_ptr<CudaRunner> next) {
  DSV4_CHECK(stage_.first() && next && next.get() != this, "cuda runner: stages are added to the first one");
  CudaRunner& tail = last_stage();
  tail.next_ = next.get();
  tail.last_ = false;
  later_.push_back(std::move(next));
}

SequenceDevice CudaRunner::make_sequence(size_t& state_bytes) const {
  const int hd = c_.head_dim;
  auto floats = [&](size_t n) {  // at least 16 bytes, so that kernels always get a pointer
    state_bytes += n * sizeof(float);
    return DeviceBuffer(std::max<size_t>(n, 4) * sizeof(float));
  };
  SequenceDevice s;
  s.layers.resize(layers_.size());
  for (size_t l = 0; l < layers_.size(); ++l) {
    const LayerDevice& d = layers_[l];
    SequenceDevice::Layer& st = s.layers[l];
    st.window = floats(size_t(window_slots_) * hd);
    if (d.ratio) {
      const size_t entries = size_t(max_context_ / d.ratio);
      st.compressed = floats(entries * hd);
      if (d.indexer) st.index_keys = floats(entries * c_.index_head_dim);
    }
    if (d.compressor) {
      st.compressor_kv = floats(size_t(d.compressor->rows) * d.compressor->width);
      st.compressor_score = floats(size_t(d.compressor->rows) * d.compressor->width);
    }
    if (d.index_compressor) {
      st.index_compressor_kv = floats(size_t(d.index_compressor->rows) * d.index_compressor->width);
      st.index_compressor_score = floats(size_t(d.index_compressor->rows) * d.index_compressor->width);
    }
  }
  if (mtp_) s.mtp_rows = floats(size_t(kMtpRows) * c_.hc_mult * c_.hidden_size);
  return s;
}

void CudaRunner::drop_stage_graphs() {
  DeviceScope scope(stage_.device);
  if (stream_) cudaStreamSynchronize(stream_);
  for (auto& [key, g] : decode_graphs_) {
    if (g.exec) cudaGraphExecDestroy(g.exec);
    if (g.graph) cudaGraphDestroy(g.graph);
  }
  decode_graphs_.clear();
}

CudaRunner::~CudaRunner() {
  later_.clear();
  // The members are freed after this body, on this stage's device; restore_device_ then restores the caller's.
  if (cudaGetDevice(&restore_device_.device) != cudaSuccess) restore_device_.device = -1;
  cudaSetDevice(stage_.device);
  drop_stage_graphs();
  if (host_tokens_) cudaFreeHost(host_tokens_);
  if (host_pos_) cudaFreeHost(host_pos_);
  if (host_logits_) cudaFreeHost(host_logits_);
  if (host_draws_) cudaFreeHost(host_draws_);
  if (host_drawn_) cudaFreeHost(host_drawn_);
  if (tokens_uploaded_) cudaEventDestroy(tokens_uploaded_);
  for (cudaEvent_t e : events_) cudaEventDestroy(e);
  for (cudaEvent_t e : {fork_event_, join_event_, streams_ready_, streams_taken_})
    if (e) cudaEventDestroy(e);
  if (side_) cudaStreamDestroy(side_);
  if (stream_) cudaStreamDestroy(stream_);
}

void CudaRunner::reset_stage() {
  DeviceScope scope(stage_.device);
  SequenceDevice& s = seqs_[current_seq_];
  s.n_tokens = 0;
  s.mtp_tokens = 0;
  if (snapshot_seq_ == current_seq_) snapshot_seq_ = -1;
  for (size_t l = 0; l < layers_.size(); ++l) {  // spec 3.5: kv 0, scores -inf at sequence start
    SequenceDevice::Layer& st = s.layers[l];
    for (auto [kv, score] : {std::pair{&st.compressor_kv, &st.compressor_score},
                             std::pair{&st.index_compressor_kv, &st.index_compressor_score}})
      if (kv->data()) {
        gpu::fill_f32(kv->as<float>(), int64_t(kv->size() / sizeof(float)), 0.0f, stream_);
        gpu::fill_f32(score->as<float>(), int64_t(score->size() / sizeof(float)),
                      -std::numeric_limits<float>::infinity(), stream_);
      }
  }
}

void CudaRunner::select_sequence(int seq) {
  DSV4_CHECK(seq >= 0 && seq < sequences(), "cuda runner: sequence {} is not one of the {} held", seq, sequences());
  for_each_stage([seq](CudaRunner& s) { s.current_seq_ = seq; });
}

void CudaRunner::copy_sequence(int from, int to) {
  DSV4_CHECK(from >= 0 && from < sequences() && to >= 0 && to < sequences(),
             "cuda runner: copy_sequence({}, {}) outside the {} sequences held", from, to, sequences());
  if (from == to) return;
  for_each_stage([from, to](CudaRunner& s) { s.copy_sequence_stage(from, to); });
}

void CudaRunner::copy_sequence_stage(int from, int to) {
  DeviceScope scope(stage_.device);
  std::vector<const DeviceBuffer*> src;
  seqs_[from].for_each_buffer([&](const DeviceBuffer& b) { src.push_back(&b); });
  size_t i = 0;
  seqs_[to].for_each_buffer([&](DeviceBuffer& b) {
    if (b.data()) DSV4_CUDA_CHECK(cudaMemcpyAsync(b.data(), src[i]->data(), b.size(), cudaMemcpyDeviceToDevice, stream_));
    ++i;
  });
  seqs_[to].n_tokens = seqs_[from].n_tokens;
  seqs_[to].mtp_tokens = seqs_[from].mtp_tokens;
  if (snapshot_seq_ == to) snapshot_seq_ = -1;
}

std::vector<gpu::CopySpan> CudaRunner::snapshot_spans(int seq, bool restore) const {
  std::vector<gpu::CopySpan> spans;
  float* at = snapshot_.as<float>();  // null while the constructor only counts
  for (const SequenceDevice::Layer& l : seqs_[size_t(seq)].layers)
    for (const DeviceBuffer* b : {&l.compressor_kv, &l.compressor_score, &l.index_compressor_kv,
                                  &l.index_compressor_score})
      if (b->data()) {
        const int64_t count = int64_t(b->size() / sizeof(float));
        spans.push_back(restore ? gpu::CopySpan{b->as<float>(), at, count} : gpu::CopySpan{at, b->as<float>(), count});
        if (at) at += count;
      }
  return spans;
}

void CudaRunner::save_snapshot() {
  DeviceScope scope(stage_.device);
  gpu::copy_spans(save_spans_[size_t(current_seq_)].as<gpu::CopySpan>(), snapshot_span_count_, stream_);
  snapshot_seq_ = current_seq_;
  snapshot_pos_ = seqs_[current_seq_].n_tokens;
}

void CudaRunner::rollback(int64_t n) {
  for_each_stage([n](CudaRunner& s) { s.rollback_stage(n); });
}

void CudaRunner::rollback_stage(int64_t n) {
  SequenceDevice& seq = seqs_[current_seq_];
  if (n == seq.n_tokens) return;
  DSV4_CHECK(snapshot_seq_ == current_seq_ && n >= snapshot_pos_ && n < seq.n_tokens,
             "cuda runner: cannot roll back to {} tokens (holding {}): only tokens of the last forward, when it fed "
             "2 to {} tokens, can be forgotten", n, seq.n_tokens, kMaxRollback + 1);
  DeviceScope scope(stage_.device);
  gpu::copy_spans(restore_spans_[size_t(current_seq_)].as<gpu::CopySpan>(), snapshot_span_count_, stream_);
  // Every compressor's state from the kept rows, in one launch (rollback_params: the history rows, this sequence's
  // state buffers).
  gpu::compressor_states(rollback_tables_[size_t(current_seq_)].as<gpu::CompressorParams>(), rollback_count_,
                         int(n - snapshot_pos_), snapshot_pos_, rollback_max_width_, stream_);
  seq.n_tokens = n;
  seq.mtp_tokens = std::min(seq.mtp_tokens, n);  // its kept rows past n are rewritten by position before use
}

void CudaRunner::check_draw(const TokenDraw& d, const char* what) const {
  DSV4_CHECK(d.vocab >= 0 && d.vocab <= c_.vocab_size, "{}: vocab {} outside [0, {}]", what, d.vocab, c_.vocab_size);
}

void CudaRunner::check_tokens(std::span<const int32_t> tokens) const {
  const SequenceDevice& seq = seqs_[current_seq_];
  DSV4_CHECK(!tokens.empty(), "forward: no tokens");
  DSV4_CHECK(seq.n_tokens + int64_t(tokens.size()) <= max_context_,
             "sequence of {} tokens does not fit the context of {} tokens (--max-context)",
             seq.n_tokens + int64_t(tokens.size()), max_context_);
  for (int32_t id : tokens)
    DSV4_CHECK(id >= 0 && id < c_.vocab_size, "token id {} is outside the vocabulary [0, {})", id, c_.vocab_size);
}

std::vector<float> CudaRunner::forward(std::span<const int32_t> tokens, bool last_only) {
  return run_sequence(tokens, last_only ? Rows::Last : Rows::All, false);
}

int32_t CudaRunner::forward_draw(std::span<const int32_t> tokens, const TokenDraw& draw) {
  if (!options_.draw_on_device) return SequenceRunner::forward_draw(tokens, draw);
  check_draw(draw, "forward_draw");
  CudaRunner& last = last_stage();  // it draws
  last.host_draws_[0] = draw;       // free: the last drawn chunk waited for its ids
  run_sequence(tokens, Rows::Last, true);
  return last.host_drawn_[0];
}

// A verify step's rows drawn on the device (draw_on_device): ids come back instead of rows x vocab logits.
std::vector<int32_t> CudaRunner::forward_draw_rows(std::span<const int32_t> tokens, std::span<const TokenDraw> draws) {
  DSV4_CHECK(draws.size() == tokens.size(), "forward_draw_rows: {} draws for {} tokens", draws.size(), tokens.size());
  if (!options_.draw_on_device) return SequenceRunner::forward_draw_rows(tokens, draws);
  if (tokens.size() > size_t(std::min(chunk_, kCudaMaxChunk))) {  // the device draws one chunk's rows at most
    spdlog::debug("cuda runner: forward_draw_rows of {} rows: logits back, drawn on the host", tokens.size());
    return SequenceRunner::forward_draw_rows(tokens, draws);
  }
  for (const TokenDraw& d : draws) check_draw(d, "forward_draw_rows");
  CudaRunner& last = last_stage();
  std::copy(draws.begin(), draws.end(), last.host_draws_);
  run_sequence(tokens, Rows::All, true);
  return std::vector<int32_t>(last.host_drawn_, last.host_drawn_ + tokens.size());
}

std::vector<float> CudaRunner::run_sequence(std::span<const int32_t> tokens, Rows rows, bool drawn) {
  check_tokens(tokens);
  const int n = int(tokens.size());
  const bool record = n >= 2 && n <= kMaxRollback + 1;  // a verify step of speculative decoding (one chunk)
  struct StopRecording {  // also when the forward throws: no later chunk or batched step keeps rows
    CudaRunner& r;
    ~StopRecording() {
      r.for_each_stage([](CudaRunner& s) { s.recording_ = false; });
    }
  } stop_recording{*this};
  for_each_stage([record](CudaRunner& s) {
    s.recording_ = record;
    if (record) s.save_snapshot();
    else if (s.snapshot_seq_ == s.current_seq_) s.snapshot_seq_ = -1;
    s.launches_ = 0;
    s.stats_.last_forward_replayed_graph = false;
  });
  std::vector<float> logits;
  for (int at = 0; at < n; at += chunk_) {
    const int len = std::min(chunk_, n - at);
    const bool last = at + len == n;
    run_chunk(tokens.subspan(at, len), seqs_[current_seq_].n_tokens,
              rows == Rows::All ? Rows::All : last ? Rows::Last : Rows::None, drawn && last, logits);
    for_each_stage([len](CudaRunner& s) { s.seqs_[s.current_seq_].n_tokens += len; });
  }
  int64_t launches = 0;
  for_each_stage([&launches](CudaRunner& s) {
    s.mtp_after_forward(s.seqs_[s.current_seq_], true);
    launches += s.launches_;
  });
  stats_.launches_last_forward = launches;
  return logits;
}

std::vector<float> CudaRunner::decode_batch(std::span<const int32_t> tokens) { return decode_rows(tokens, {}); }

std::vector<int32_t> CudaRunner::decode_batch_draw(std::span<const int32_t> tokens, std::span<const TokenDraw> draws) {
  DSV4_CHECK(draws.size() == tokens.size(), "decode_batch_draw: {} draws for {} tokens", draws.size(), tokens.size());
  for (const TokenDraw& d : draws) check_draw(d, "decode_batch_draw");
  if (!options_.draw_on_device) return draw_rows(decode_rows(tokens, {}), draws);  // logits back, host draws
  decode_rows(tokens, draws);
  const CudaRunner& last = last_stage();
  return std::vector<int32_t>(last.host_drawn_, last.host_drawn_ + tokens.size());
}

std::vector<float> CudaRunner::decode_rows(std::span<const int32_t> tokens, std::span<const TokenDraw> draws) {
  const int B = int(tokens.size());
  DSV4_CHECK(B > 0 && B <= sequences(), "decode_batch: {} tokens for {} sequences held", B, sequences());
  for (int b = 0; b < B; ++b) {
    DSV4_CHECK(tokens[b] >= 0 && tokens[b] < c_.vocab_size, "token id {} is outside the vocabulary [0, {})",
               tokens[b], c_.vocab_size);
    DSV4_CHECK(seqs_[b].n_tokens + 1 <= max_context_,
               "decode_batch: sequence {} of {} tokens is at the context of {} tokens (--max-context)", b,
               seqs_[b].n_tokens, max_context_);
  }
  for_each_stage([&](CudaRunner& s) {
    s.snapshot_seq_ = -1;
    if (s.upload_pending_) {
      DSV4_CUDA_CHECK(cudaEventSynchronize(s.tokens_uploaded_));
      s.upload_pending_ = false;
    }
    s.launches_ = 0;
    s.stats_.last_forward_replayed_graph = false;
    s.parts_.clear();
    for (int b = 0; b < B; ++b) {
      s.host_tokens_[b] = tokens[b];
      s.host_pos_[b] = s.seqs_[b].n_tokens;
      s.parts_.push_back({b, s.seqs_[b].n_tokens, s.pos_.as<int64_t>() + b});
    }
  });
  const bool drawn = !draws.empty();
  if (drawn) std::copy(draws.begin(), draws.end(), last_stage().host_draws_);
  std::vector<float> logits;
  run_parts(B, Rows::All, drawn, options_.graph_decode, logits);
  int64_t launches = 0;
  for_each_stage([&](CudaRunner& s) {
    for (int b = 0; b < B; ++b) {
      ++s.seqs_[b].n_tokens;
      s.mtp_after_forward(s.seqs_[b], B == 1);
    }
    launches += s.launches_;
  });
  stats_.launches_last_forward = launches;
  return logits;
}

void CudaRunner::run_chunk(std::span<const int32_t> tokens, int64_t pos0, Rows wanted, bool drawn,
                           std::vector<float>& logits) {
  const bool graph = options_.graph_decode && tokens.size() == 1 && wanted == Rows::Last;
  for_each_stage([&](CudaRunner& s) { s.stage_chunk(tokens, pos0, graph); });
  run_parts(int(tokens.size()), wanted, drawn, graph, logits);
}

void CudaRunner::stage_chunk(std::span<const int32_t> tokens, int64_t pos0, bool graph) {
  if (upload_pending_) {  // a chunk without logits did not synchronise: its token upload may still be queued
    DSV4_CUDA_CHECK(cudaEventSynchronize(tokens_uploaded_));
    upload_pending_ = false;
  }
  std::memcpy(host_tokens_, tokens.data(), tokens.size() * sizeof(int32_t));
  host_pos_[0] = pos0;
  parts_.clear();
  parts_.push_back({current_seq_, pos0, graph ? pos_.as<int64_t>() : nullptr});
}

// Each stage in turn: the streams from the previous stage, then its layers; the last stage's head and logits. Stage
// i's next chunk waits until stage i + 1 has taken its streams, so prefill chunks pipeline over the GPUs.
void CudaRunner::run_parts(int n, Rows wanted, bool drawn, bool graph, std::vector<float>& logits) {
  const CudaRunner* previous = nullptr;
  for_each_stage([&](CudaRunner& s) {
    DeviceScope scope(s.stage_.device);
    if (previous) s.take_streams(*previous, n);
    if (s.next_) DSV4_CUDA_CHECK(cudaStreamWaitEvent(s.stream_, s.next_->streams_taken_, 0));
    s.launch_stage(n, wanted, drawn && s.last_, graph);
    if (s.next_) DSV4_CUDA_CHECK(cudaEventRecord(s.streams_ready_, s.stream_));
    previous = &s;
  });
  if (wanted == Rows::None) {  // no synchronisation: the token uploads may still be queued
    for_each_stage([](CudaRunner& s) { s.upload_pending_ = true; });
    return;
  }
  last_stage().collect(n, wanted, drawn, logits);
}

void CudaRunner::take_streams(const CudaRunner& previous, int n) {
  const size_t bytes = size_t(n) * size_t(c_.hc_mult) * size_t(c_.hidden_size) * sizeof(float);
  DSV4_CUDA_CHECK(cudaStreamWaitEvent(stream_, previous.streams_ready_, 0));
  DSV4_CUDA_CHECK(cudaMemcpyPeerAsync(streams_.data(), stage_.device, previous.streams_.data(),
                                      previous.stage_.device, bytes, stream_));
  DSV4_CUDA_CHECK(cudaEventRecord(streams_taken_, stream_));
  ++stats_.stage_copies;
}

void CudaRunner::launch_stage(int n, Rows wanted, bool drawn, bool graph) {
  if (graph) {
    // Captured once per (first sequence, count, drawn); later steps replay it with new tokens and positions.
    DecodeGraph& g = decode_graphs_[{parts_.front().seq, int(parts_.size()), drawn}];
    if (!g.exec) {
      const int64_t before = launches_;
      DSV4_CUDA_CHECK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
      try {
        enqueue_chunk(n, wanted, drawn);
      } catch (...) {
        cudaGraph_t broken = nullptr;
        cudaStreamEndCapture(stream_, &broken);
        if (broken) cudaGraphDestroy(broken);
        throw;
      }
      DSV4_CUDA_CHECK(cudaStreamEndCapture(stream_, &g.graph));
      DSV4_CUDA_CHECK(cudaGraphInstantiate(&g.exec, g.graph, 0));
      g.kernels = launches_ - before;
      launches_ = before;
    }
    DSV4_CUDA_CHECK(cudaGraphLaunch(g.exec, stream_));
    ++launches_;
    stats_.graph_kernels = g.kernels;
    stats_.last_forward_replayed_graph = true;
  } else {
    enqueue_chunk(n, wanted, drawn);
  }
}

void CudaRunner::collect(int n, Rows wanted, bool drawn, std::vector<float>& logits) {
  DeviceScope scope(stage_.device);
  if (drawn) {  // the ids are in host_drawn_
    DSV4_CUDA_CHECK(cudaStreamSynchronize(stream_));
    return;
  }
  if (wanted == Rows::All && n > kCudaMaxChunk) {  // the logits buffers hold kCudaMaxChunk rows
    for (int first = 0; first < n; first += kCudaMaxChunk) {
      const int rows = std::min(kCudaMaxChunk, n - first);
      enqueue_head(first, rows, false, *hc_head_, final_norm_);
      DSV4_CUDA_CHECK(cudaStreamSynchronize(stream_));
      logits.insert(logits.end(), host_logits_, host_logits_ + size_t(rows) * c_.vocab_size);
    }
    return;
  }
  DSV4_CUDA_CHECK(cudaStreamSynchronize(stream_));
  const size_t count = size_t(wanted == Rows::Last ? 1 : n) * c_.vocab_size;
  logits.insert(logits.end(), host_logits_, host_logits_ + count);
}

void CudaRunner::enqueue_chunk(int n, Rows wanted, bool drawn) {
  const ModelConfig& c = c_;
  const int D = c.hidden_size, hc = c.hc_mult;
  DSV4_CHECK(!drawn || wanted == Rows::Last || (wanted == Rows::All && n <= kCudaMaxChunk),
             "cuda runner: a drawn chunk draws its last row or up to {} rows", kCudaMaxChunk);
  cur_ = stream_;  // also after a chunk that threw between fork_side() and join_side()
  side_pending_ = false;
  pending_post_ = {};
  DSV4_CUDA_CHECK(cudaMemcpyAsync(tokens_.data(), host_tokens_, n * sizeof(int32_t), cudaMemcpyHostToDevice, stream_));
  if (drawn && last_)
    DSV4_CUDA_CHECK(cudaMemcpyAsync(draws_.data(), host_draws_, (wanted == Rows::All ? n : 1) * sizeof(TokenDraw),
                                    cudaMemcpyHostToDevice, stream_));
  if (parts_.front().pos_device)
    DSV4_CUDA_CHECK(cudaMemcpyAsync(pos_.data(), host_pos_, parts_.size() * sizeof(int64_t), cudaMemcpyHostToDevice,
                                    stream_));
  else
    DSV4_CUDA_CHECK(cudaEventRecord(tokens_uploaded_, stream_));
  if (stage_.first()) {  // later stages got the streams from the previous one (take_streams)
    gpu::embed_tokens(embed_.w.as<uint16_t>(), tokens_.as<int32_t>(), n, D, hc, streams_.as<float>(), stream_);
    launched("embed");
  }
  for (int l = stage_.layer_begin; l < stage_.layer_end; ++l) {
    current_layer_ = l;
    attention_block(l, n);
    ffn_block(l, n);
  }
  current_layer_ = -1;
  if (!last_) return;
  if (mtp_ && parts_.size() == 1) {  // the rows the MTP block trails by, by position (graph replays keep them too)
    const ChunkPart& part = parts_.front();
    gpu::window_store(streams_.as<float>(), n, hc * D, part.pos0, part.pos_device,
                      seqs_[size_t(part.seq)].mtp_rows.as<float>(), kMtpRows, stream_);
    launched("mtp: keep the final streams");
  }
  if (wanted == Rows::Last) enqueue_head(n - 1, 1, drawn, *hc_head_, final_norm_);
  if (wanted == Rows::All && n <= kCudaMaxChunk)  // larger: run_parts, 64 rows at a time
    enqueue_head(0, n, drawn, *hc_head_, final_norm_);
}

void CudaRunner::enqueue_head(int first, int rows, bool drawn, const HcDevice& collapse, const DeviceBuffer& norm) {
  const ModelConfig& c = c_;
  const int D = c.hidden_size, hc = c.hc_mult, V = c.vocab_size;
  // 5: final collapse, norm, head for rows first .. first + rows - 1 (<= kCudaMaxChunk) into host_logits_
  const float* streams = streams_.as<float>() + size_t(first) * hc * D;
  linear_f32("head: mHC mix", streams, collapse.fn, mix_.as<float>(), rows, hc, hc * D);
  gpu::hc_head_norm(streams, mix_.as<float>(), collapse.base.as<float>(), collapse.scale.as<float>(),
                    norm.as<float>(), rows, hc, D, c.hc_eps, c.rms_norm_eps, head_in_.as<uint16_t>(), stream_);
  launched("head: mHC collapse + norm");
  linear("head: lm_head", head_, head_in_.data(), logits_.data(), rows, GemvOut::F32);
  if (drawn) {
    gpu::draw_tokens({logits_.as<float>(), V, V, rows, draws_.as<TokenDraw>(), drawn_.as<int32_t>()}, stream_);
    launched("head: draw");
    DSV4_CUDA_CHECK(cudaMemcpyAsync(host_drawn_, drawn_.data(), size_t(rows) * sizeof(int32_t),
                                    cudaMemcpyDeviceToHost, stream_));
    return;
  }
  DSV4_CUDA_CHECK(cudaMemcpyAsync(host_logits_, logits_.data(), size_t(rows) * V * sizeof(float),
                                  cudaMemcpyDeviceToHost, stream_));
}

void CudaRunner::run_mtp(std::span<const int32_t> next, bool drawn) {
  if (CudaRunner& last = last_stage(); &last != this) {  // the block lives on the last stage
    last.run_mtp(next, drawn);
    const int64_t consumed = last.seqs_[last.current_seq_].mtp_tokens;
    for_each_stage([consumed](CudaRunner& s) { s.seqs_[s.current_seq_].mtp_tokens = consumed; });
    stats_.launches_last_forward = last.stats_.launches_last_forward;
    return;
  }
  const ModelConfig& c = c_;
  DSV4_CHECK(has_mtp() && mtp_, "mtp_draft: the model was loaded without its MTP block");
  DeviceScope scope(stage_.device);
  SequenceDevice& seq = seqs_[current_seq_];
  const int n = int(next.size()), D = c.hidden_size, hc = c.hc_mult, L = c.n_layers;
  DSV4_CHECK(n >= 1 && n <= mtp_pending(), "mtp_draft: {} tokens for {} pending", n, mtp_pending());
  for (int32_t id : next)
    DSV4_CHECK(id >= 0 && id < c.vocab_size, "token id {} is outside the vocabulary [0, {})", id, c.vocab_size);
  if (upload_pending_) {  // host_tokens_ may still be read by a queued upload
    DSV4_CUDA_CHECK(cudaEventSynchronize(tokens_uploaded_));
    upload_pending_ = false;
  }
  cur_ = stream_;
  side_pending_ = false;
  pending_post_ = {};
  launches_ = 0;
  std::memcpy(host_tokens_, next.data(), size_t(n) * sizeof(int32_t));
  DSV4_CUDA_CHECK(cudaMemcpyAsync(tokens_.data(), host_tokens_, size_t(n) * sizeof(int32_t), cudaMemcpyHostToDevice,
                                  stream_));
  if (drawn) {
    host_draws_[0] = TokenDraw{};  // greedy over the whole vocabulary
    host_draws_[0].vocab = c.vocab_size;
    DSV4_CUDA_CHECK(cudaMemcpyAsync(draws_.data(), host_draws_, sizeof(TokenDraw), cudaMemcpyHostToDevice, stream_));
  }
  // The main model's final streams of positions p0 .. p0 + n - 1 (ring slots p % kMtpRows), in order (kernels, like
  // the verify step's row copies: programmatic launches stay chained).
  const int64_t p0 = seq.mtp_tokens;
  const int row = hc * D;
  for (int t = 0; t < n;) {
    const int slot = int((p0 + t) % kMtpRows), len = std::min(n - t, kMtpRows - slot);
    gpu::copy_rows(streams_.as<float>() + size_t(t) * row, row, seq.mtp_rows.as<float>() + size_t(slot) * row, row,
                   len, row, stream_);
    launched("mtp: main streams");
    t += len;
  }
  // X' = e_proj(RMSNorm(embed(next); enorm)) on every stream + h_proj(RMSNorm(X_k; hnorm)) per stream k
  gpu::RmsNormRowsParams h;
  h.x = streams_.as<float>();
  h.ld = D;
  h.rows = n * hc;
  h.dim = D;
  h.weight = mtp_->hnorm.as<float>();
  h.eps = c.rms_norm_eps;
  h.y_bf16 = mtp_h_bf16_.as<uint16_t>();
  gpu::rms_norm_rows(h, stream_);
  launched("mtp: hnorm");
  linear("mtp: h_proj", mtp_->h_proj, mtp_h_bf16_.data(), streams_.data(), n * hc, GemvOut::F32, true);
  gpu::RmsNormRowsParams e = h;
  e.x = nullptr;
  e.table = embed_.w.as<uint16_t>();
  e.ids = tokens_.as<int32_t>();
  e.rows = n;
  e.weight = mtp_->enorm.as<float>();
  e.y_bf16 = normed_bf16_.as<uint16_t>();
  gpu::rms_norm_rows(e, stream_);
  launched("mtp: embed + enorm");
  linear("mtp: e_proj", mtp_->e_proj, normed_bf16_.data(), mtp_e_.data(), n, GemvOut::F32, true);
  gpu::add_to_streams(streams_.as<float>(), mtp_e_.as<float>(), n, hc, D, stream_);
  launched("mtp: h + e");
  // The block, at the MTP block's own positions p0.. (its window ring), then its head collapse and norm.
  parts_.clear();
  parts_.push_back({current_seq_, p0, nullptr});
  current_layer_ = L;
  attention_block(L, n);
  ffn_block(L, n);
  current_layer_ = -1;
  if (drawn)
    enqueue_head(n - 1, 1, true, mtp_->hc_head, mtp_->norm);
  else
    enqueue_head(0, n, false, mtp_->hc_head, mtp_->norm);
  DSV4_CUDA_CHECK(cudaStreamSynchronize(stream_));
  seq.mtp_tokens += n;
  stats_.launches_last_forward = launches_;
}

void CudaRunner::record_event(size_t index) {
  if (index == events_.size()) {  // the pool grows on the first profiled step
    cudaEvent_t e = nullptr;
    DSV4_CUDA_CHECK(cudaEventCreate(&e));
    events_.push_back(e);
  }
  DSV4_CUDA_CHECK(cudaEventRecord(events_[index], stream_));
}

void CudaRunner::launched(const char* site, int kernels) {
  launches_ += kernels;
  if (cur_ == side_) stats_.side_stream_kernels += kernels;
  if (!profiling_) return;
  record_event(marks_.size() + 1);
  marks_.push_back({site, current_layer_, kernels});
}

std::vector<LaunchTiming> CudaRunner::profile_step(std::span<const int32_t> tokens, bool prefill) {
  DSV4_CHECK(later_.empty(), "cuda runner: profiled steps run on one GPU (this runner is split over {} stages)",
             later_.size() + 1);
  DeviceScope scope(stage_.device);
  marks_.clear();
  struct Restore {  // direct, serialised launches and events for this step only, however it ends
    CudaRunner& r;
    bool graph, overlapped;
    ~Restore() {
      r.profiling_ = false;
      r.options_.graph_decode = graph;
      gpu::set_dependent_launch(overlapped);
    }
  } restore{*this, options_.graph_decode, gpu::dependent_launch()};
  options_.graph_decode = false;
  profiling_ = true;
  gpu::set_dependent_launch(false);  // overlapped launches would blur the sites' boundaries
  // The GPU waits while the host queues the step, so host launch time does not show up between events.
  launch_delay_kernel(20000.0, stream_);
  record_event(0);
  const TokenDraw draw{1.0f, 1.0f, 0, 0, 0.5};  // with draw_on_device: the step draws its tokens (temperature 1)
  if (prefill)
    forward(tokens, true);
  else if (tokens.size() == 1)
    options_.draw_on_device ? void(forward_draw(tokens, draw)) : void(forward(tokens, true));
  else if (options_.draw_on_device)
    decode_batch_draw(tokens, std::vector<TokenDraw>(tokens.size(), draw));
  else
    decode_batch(tokens);
  DSV4_CUDA_CHECK(cudaStreamSynchronize(stream_));
  std::vector<LaunchTiming> timings;
  timings.reserve(marks_.size());
  for (size_t i = 0; i < marks_.size(); ++i) {
    float ms = 0;
    DSV4_CUDA_CHECK(cudaEventElapsedTime(&ms, events_[i], events_[i + 1]));
    timings.push_back({marks_[i].site, marks_[i].layer, marks_[i].kernels, 1e3 * double(ms)});
  }
  return timings;
}

void CudaRunner::attention_block(int l, int n) {
  const ModelConfig& c = c_;
  const size_t li = local(l);  // this stage's index of the layer
  LayerDevice& d = layers_[li];
  auto state = [&](const ChunkPart& part) -> SequenceDevice::Layer& { return seqs_[part.seq].layers[li]; };
  const int D = c.hidden_size, H = c.n_heads, hd = c.head_dim, rd = c.rope_dim;
  const int r = d.ratio;
  float* y_x = y_x_.as<float>();
  float* y_q = y_q_.as<float>();

  // 2.3 mHC pre + attn_norm (the mix comes from the previous layer's hc_post when fused)
  mhc_pre(Sublayer::Attention, d.hc_attn, d.attn_norm, n, l > stage_.layer_begin && l < c.n_layers && fused_mix(n));

  // 3.2 / 3.3 / 3.5 input projections in one GEMM, then q_norm and the q projections in another.
  linear("attn: gemv x-side [wq_a|wkv|compressors]", d.w_x, normed_bf16_.data(), y_x, n, c.q_lora_rank + hd);
  RowOpParams qn;
  qn.x = y_x;
  qn.x_token_stride = d.n_x;
  qn.y_bf16 = qr_bf16_.as<uint16_t>();
  qn.tokens = n;
  qn.dim = c.q_lora_rank;
  qn.norm = true;
  qn.weight = d.q_norm.as<float>();
  qn.eps = c.rms_norm_eps;
  const RowRound kv_round = numerics_.kv == cpu::KvStorage::FP8    ? RowRound::KvFp8
                            : numerics_.kv == cpu::KvStorage::BF16 ? RowRound::Bf16
                                                                   : RowRound::None;
  const RowRound index_round = numerics_.indexer == cpu::IndexerStorage::FP4    ? RowRound::IndexerFp4
                               : numerics_.indexer == cpu::IndexerStorage::BF16 ? RowRound::Bf16
                                                                                : RowRound::None;
  RowOpParams kv;
  kv.x = y_x + d.off_kv;
  kv.x_token_stride = d.n_x;
  kv.y = kv_chunk_.as<float>();
  kv.y_token_stride = hd;
  kv.tokens = n;
  kv.dim = hd;
  kv.norm = true;
  kv.weight = d.kv_norm.as<float>();
  kv.eps = c.rms_norm_eps;
  kv.rope_dim = rd;
  kv.inv_freq = d.inv_freq;
  kv.round = kv_round;
  set_positions(kv);
  // q_norm and the kv row read the x-side output only: one launch for both.
  gpu::row_op_pair(qn, kv, cur_);
  launched("attn: q_norm + kv norm + rope + round");
  // The state kernels below run once over all n rows: a prefill chunk or one-sequence decode step is one part;
  // a batched decode step has one part per sequence (row b = sequence b), and the kernels find each row's state
  // through the pointer tables and its position in pos_ (the first part's own fields are then unused).
  const ChunkPart& part = parts_.front();
  const bool batched = parts_.size() > 1;

  // 3.5 compressors; the entries completed by the chunk (blocks pos0/r .. (pos0+n)/r - 1) are finished after.
  auto advance = [&](const char* site, const char* finish_site, CompressorDevice& cd, int off_kv, int off_gate,
                     DeviceBuffer& state_kv, DeviceBuffer& state_score, float* entries, RowRound round,
                     StateTable kv_table, StateTable score_table, StateTable entries_table) {
    const int64_t pos0 = part.pos0;
    const int64_t* pos_device = part.pos_device;
    gpu::CompressorParams cp{y_x + off_kv, y_x + off_gate, d.n_x, cd.ape.as<float>(), state_kv.as<float>(),
                             state_score.as<float>(), entries, cd.ratio, cd.dim, n, cd.overlap, pos0, pos_device};
    if (recording_) {  // keep the rows for rollback (kv and gate are adjacent in y_x) and read them from there
      DSV4_CHECK(off_gate == off_kv + cd.width && n <= kMaxRollback + 1, "cuda runner: compressor rows layout");
      float* rows = cd.history.as<float>();
      gpu::copy_rows(rows, 2 * cd.width, y_x + off_kv, d.n_x, n, 2 * cd.width, cur_);  // a kernel: PDL stays chained
      launched("attn: keep compressor rows");
      cp.kv_in = rows;
      cp.gate_in = rows + cd.width;
      cp.in_stride = 2 * cd.width;
    }
    if (batched) {
      cp.pos_rows = pos_.as<int64_t>();
      cp.state_kv_rows = state_table(l, kv_table);
      cp.state_score_rows = state_table(l, score_table);
      cp.entries_rows = state_table(l, entries_table);
    }
    gpu::compressor_advance(cp, cur_);
    launched(site);
    const int64_t b_first = pos_device ? 0 : pos0 / r, b_end = pos_device ? 1 : (pos0 + n) / r;
    if (b_end == b_first) return;
    RowOpParams fin;
    fin.emit_ratio = pos_device ? r : 0;  // graph: the kernel decides whether this step completes an entry
    fin.pos_device = pos_device;
    fin.x = fin.y = entries + b_first * cd.dim;
    fin.x_token_stride = fin.y_token_stride = cd.dim;
    fin.tokens = int(b_end - b_first);
    fin.dim = cd.dim;
    fin.norm = true;
    fin.weight = cd.norm.as<float>();
    fin.eps = c.rms_norm_eps;
    fin.rope_dim = rd;
    fin.inv_freq = d.inv_freq;
    fin.pos0 = b_first * r;
    fin.pos_step = r;
    fin.round = round;
    if (batched) {  // every row's sequence, in one launch
      fin.tokens = n;
      fin.pos_rows = pos_.as<int64_t>();
      fin.rows_base = state_table(l, entries_table);
    }
    row_op(finish_site, fin);
  };

  // 3.6 lightning indexer
  const int nh = c.index_n_heads, ihd = c.index_head_dim;
  // The state side (overlap_branches: a second stream) needs only the x-side output and the normed input: the
  // compressors with their entries, and the indexer's weights_proj. The q side needs only q_norm's output. They
  // meet before the indexer scores.
  const bool side = overlapping() && (d.compressor || d.indexer);
  if (side) fork_side();
  if (d.compressor)
    advance("attn: compressor", "attn: compressor entry", *d.compressor, d.off_ckv, d.off_cgate,
            state(part).compressor_kv, state(part).compressor_score, state(part).compressed.as<float>(), kv_round,
            StateTable::CompressorKv, StateTable::CompressorScore, StateTable::Compressed);
  if (d.indexer) {
    advance("indexer: compressor", "indexer: compressor entry", *d.index_compressor, d.off_ikv, d.off_igate,
            state(part).index_compressor_kv, state(part).index_compressor_score, state(part).index_keys.as<float>(),
            index_round, StateTable::IndexCompressorKv, StateTable::IndexCompressorScore, StateTable::IndexKeys);
    linear_f32("indexer: weights_proj", normed_.as<float>(), d.index_wproj, index_w_.as<float>(), n, nh, D);
  }
  if (side) to_main();

  linear("attn: gemv q-side [wq_b|indexer wq_b]", d.w_q, qr_bf16_.data(), y_q, n, d.n_q);

  // Per-head norm (no weight) + RoPE of q: in place, or (q_norm_in_attention_rows) inside the attention kernel.
  const bool q_in_attention = n >= options_.q_norm_in_attention_rows && gpu::attention_can_norm_q(hd, rd);
  RowOpParams q;
  if (!q_in_attention) {
    q.x = q.y = y_q;
    q.x_token_stride = q.y_token_stride = d.n_q;
    q.x_head_stride = q.y_head_stride = hd;
    q.tokens = n;
    q.heads = H;
    q.dim = hd;
    q.norm = true;
    q.eps = c.rms_norm_eps;
    q.rope_dim = rd;
    q.inv_freq = d.inv_freq;
    set_positions(q);
  }
  if (d.indexer) {
    RowOpParams qi;  // RoPE + rounding, no norm
    qi.x = qi.y = y_q + d.off_iq;
    qi.x_token_stride = qi.y_token_stride = d.n_q;
    qi.x_head_stride = qi.y_head_stride = ihd;
    qi.tokens = n;
    qi.heads = nh;
    qi.dim = ihd;
    qi.rope_dim = rd;
    qi.inv_freq = d.inv_freq;
    qi.round = index_round;
    set_positions(qi);
    if (q_in_attention) {
      row_op("indexer: q rope + round", qi);
    } else {  // both read the q-side output only: one launch
      gpu::row_op_pair(q, qi, cur_);
      launched("attn: q norm + rope, indexer q rope + round");
    }
  } else if (!q_in_attention) {
    row_op("attn: q norm + rope", q);
  }
  if (side) join_side();
  if (d.indexer) {
    gpu::IndexerTopkParams ip;
    ip.q = y_q + d.off_iq;
    ip.q_token_stride = d.n_q;
    ip.w = index_w_.as<float>();
    ip.w_scale = 1.0f / std::sqrt(float(ihd)) / std::sqrt(float(nh));
    ip.keys = state(part).index_keys.as<float>();
    ip.scores = scores_.as<float>();
    ip.selected = selected_.as<int32_t>();
    ip.n = n;
    ip.heads = nh;
    ip.dim = ihd;
    ip.ratio = r;
    ip.topk = c.index_topk;
    ip.max_entries = max_entries_;
    ip.pos0 = part.pos0;
    ip.pos_device = part.pos_device;
    ip.bf16_exact = numerics_.indexer != cpu::IndexerStorage::F32;  // q and keys rounded to FP4 or bf16 values
    if (batched) {
      ip.pos_rows = pos_.as<int64_t>();
      ip.keys_rows = index_keys_rows(l);
    }
    gpu::indexer_scores(ip, cur_);
    launched("indexer: scores");
    gpu::indexer_select(ip, cur_);
    launched("indexer: top-k select");
  }

  // 3.7 / 3.8 attention (a batched decode step: one launch over all rows, each with its sequence's state through
  // the pointer tables), then the window ring takes the chunk's last positions.
  const int G = c.o_groups, ol = c.o_lora_rank, gw = H * hd / G;
  gpu::AttentionParams ap;
  ap.q = y_q;
  ap.q_token_stride = d.n_q;
  ap.kv_chunk = kv_chunk_.as<float>();
  ap.window_ring = state(part).window.as<float>();
  ap.window_slots = window_slots_;
  ap.window = c.window;
  ap.compressed = r ? state(part).compressed.as<float>() : nullptr;
  ap.ratio = r;
  ap.selected = d.indexer ? selected_.as<int32_t>() : nullptr;
  ap.topk = c.index_topk;
  ap.sink = d.sink.as<float>();
  ap.inv_freq = d.inv_freq;
  ap.rope_dim = rd;
  ap.n = n;
  ap.heads = H;
  ap.dim = hd;
  ap.groups = G;
  ap.pos0 = part.pos0;
  ap.scale = 1.0f / std::sqrt(float(hd));
  ap.out = o_grouped_.as<uint16_t>();
  ap.out_rows = n;
  ap.pos_device = part.pos_device;
  ap.max_entries = r ? max_context_ / r : 0;
  ap.scratch = attention_scratch_.as<float>();
  ap.q_norm_rope = q_in_attention;
  ap.q_eps = c.rms_norm_eps;
  if (batched) {
    ap.pos_rows = pos_.as<int64_t>();
    ap.window_rings = window_rings(l);
    ap.compressed_rows = r ? compressed_rows(l) : nullptr;
  }
  // Decode steps store their keys into the rings inside the attention launch; prefill chunks after it (their
  // later rows may overwrite ring slots that earlier rows of the chunk still read).
  ap.store_window = batched || n == 1;
  gpu::attention(ap, cur_);
  launched("attn: attention");
  if (!ap.store_window) {
    gpu::window_store(kv_chunk_.as<float>(), n, hd, part.pos0, part.pos_device, state(part).window.as<float>(),
                      window_slots_, cur_);
    launched("attn: window store");
  }

  // 3.9 grouped low-rank output projection: group g's heads [G, n, gw] through wo_a rows g·o_lora.. (one
  // batched launch), written token-major as z [n, G·o_lora], then wo_b.
  GemvBatchedParams wo_a;
  wo_a.base = d.wo_a.params(o_grouped_.data(), z_.data(), n, GemvOut::BF16, int64_t(G) * ol, 0, ol);
  wo_a.base.stream = cur_;
  wo_a.batch = G;
  wo_a.x_batch_stride = int64_t(n) * gw;
  wo_a.y_batch_stride = ol;
  gemv_batched(wo_a);
  launched("attn: gemv wo_a (batched over groups)");
  linear("attn: gemv wo_b", d.wo_b, z_.data(), attn_out_.data(), n, GemvOut::F32, true);

  mhc_post(Sublayer::Attention, attn_out_.as<float>(), 1, nullptr, n, &d.hc_ffn);
}

void CudaRunner::ffn_block(int l, int n) {
  const ModelConfig& c = c_;
  const size_t li = local(l);
  LayerDevice& d = layers_[li];
  const int D = c.hidden_size, E = c.n_routed_experts;
  const int k = c.n_experts_per_tok;

  mhc_pre(Sublayer::Ffn, d.hc_ffn, d.ffn_norm, n, fused_mix(n));

  // The shared expert apart from the grouped launches (group_shared_expert off, or another shape or encoding): its
  // own gemvs, which need only the normed input. With overlap_branches they run on the second stream beside the
  // router, whose few small kernels leave the GPU mostly idle (under act fp8 both sides would quantise into the one
  // act_scratch, so there it stays on the main stream, after the routed experts).
  const bool shared = d.shared_inter > 0 && !d.shared_grouped;
  const bool side = shared && overlapping() && act_ == GemvAct::BF16;
  auto shared_expert = [&] {
    const int si = d.shared_inter;
    linear("ffn: gemv shared [w1|w3]", d.shared_w13, normed_bf16_.data(), shared_y13_.as<float>(), n,
           d.shared_w13.n);
    gpu::SwigluParams ss;
    ss.gate = shared_y13_.as<float>();
    ss.up = shared_y13_.as<float>() + si;
    ss.ld = 2 * si;
    ss.rows = n;
    ss.inter = si;
    ss.limit = c.swiglu_limit;
    ss.h = h_shared_.as<uint16_t>();
    gpu::swiglu(ss, cur_);
    launched("ffn: shared swiglu");
    linear("ffn: gemv shared w2", d.shared_w2, h_shared_.data(), shared_out_.data(), n, GemvOut::F32, true);
  };
  if (side) {
    fork_side();
    shared_expert();
    to_main();
  }

  // 4.1 router (fp32)
  const gpu::LinearF32Params gate{normed_.as<float>(), d.gate.as<float>(), router_logits_.as<float>(), n, E, D, 1.0f};
  const bool gate_fused = options_.fuse_moe_gate && moe_gate_fits(gate);
  if (!gate_fused) linear_f32("ffn: router gate", gate.x, d.gate, gate.y, n, E, D);
  gpu::RouterParams rp;
  rp.logits = router_logits_.as<float>();
  rp.bias = d.hash || !d.gate_bias.data() ? nullptr : d.gate_bias.as<float>();
  rp.tid2eid = d.hash ? d.tid2eid.as<int32_t>() : nullptr;
  rp.tokens = tokens_.as<int32_t>();
  rp.n = n;
  rp.experts = E;
  rp.k = k;
  rp.scoring = c.scoring == ScoringFunc::SqrtSoftplus ? 0 : c.scoring == ScoringFunc::Sigmoid ? 1 : 2;
  rp.norm_topk = c.norm_topk_prob;
  rp.routed_scale = c.routed_scaling_factor;
  rp.ids = expert_ids_.as<int32_t>();
  rp.weights = expert_weights_.as<float>();

  // 4.2 routed experts (only the picked ones, grouped by expert on the device), then the shared expert: as pair k
  // of every token on expert E when it is grouped with them (so the sum over pairs below adds it last, like the
  // reference), else through its own gemvs.
  const int pairs = d.shared_grouped ? k + 1 : k;
  MoeSlotsParams slots;
  slots.ids = expert_ids_.as<int32_t>();
  slots.n = n;
  slots.k = k;
  slots.experts = d.w1.experts;
  slots.slots = slots_;
  slots.stream = cur_;
  if (d.shared_grouped) {
    slots.shared_expert = E;
    slots.weights = expert_weights_.as<float>();
    slots.pair_weights = pair_weights_.as<float>();
  }
  if (gate_fused) {
    moe_gate_route_and_slots(gate, rp, slots, moe_ticket_.as<uint32_t>());
    launched("ffn: router gate + router + moe_slots");
  } else if (options_.fuse_moe_routing && n <= kCudaMaxChunk && E <= 512) {
    moe_route_and_slots(rp, slots);
    launched("ffn: router + moe_slots");
  } else {
    gpu::router(rp, cur_);
    launched("ffn: router");
    moe_slots(slots);
    launched("ffn: moe_slots");
  }
  gpu::SwigluParams sw;
  sw.gate = expert_gate_.as<float>();
  sw.up = expert_up_.as<float>();
  sw.ld = c.moe_inter;
  sw.weights = d.shared_grouped ? pair_weights_.as<float>() : expert_weights_.as<float>();
  sw.rows = n * pairs;
  sw.inter = c.moe_inter;
  sw.limit = c.swiglu_limit;
  sw.h = h_.as<uint16_t>();
  GemvGroupedParams w2 = grouped_params(d.w2, h_.data(), 1, n * pairs, y_pairs_.data(), n, n * pairs, GemvOut::F32);
  if (n >= options_.swiglu_in_w1_w3_rows) {  // inside the grouped launch where its kernel can, else right after it
    linear_grouped("ffn: grouped gemv w1 + w3 + swiglu", d.w1, normed_bf16_.data(), pairs, n, expert_gate_.data(), n,
                   n * pairs, GemvOut::F32, &d.w3, expert_up_.data(), &sw);
  } else {
    linear_grouped("ffn: grouped gemv w1 + w3", d.w1, normed_bf16_.data(), pairs, n, expert_gate_.data(), n,
                   n * pairs, GemvOut::F32, &d.w3, expert_up_.data());
    // early_w2_weights: the SwiGLU lets w2 start only after its own wait, so the slots are final when w2 reads
    // them; only where w2 runs the register kernel (the others wait first, and the later start alone cost 5 % at
    // batch 32 on the tiled kernel, docs/perf.md seventeenth round).
    w2.slots_settled = options_.early_w2_weights && gemv_grouped_reads_slots_early(w2);
    sw.trigger_after_wait = w2.slots_settled;
    gpu::swiglu(sw, cur_);
    launched("ffn: swiglu");
  }
  launched("ffn: grouped gemv w2", gemv_grouped(w2));

  if (shared && !side) shared_expert();
  if (side) join_side();
  mhc_post(Sublayer::Ffn, y_pairs_.as<float>(), pairs, shared ? shared_out_.as<float>() : nullptr, n,
           l + 1 < stage_.layer_end ? &layers_[li + 1].hc_attn : nullptr);  // the next layer's mix, when fused
}

size_t CudaRunner::state_bytes() const {
  size_t bytes = 0;
  for_each_stage([&bytes](const CudaRunner& s) { bytes += s.state_bytes_; });
  return bytes;
}

CudaRunnerStats CudaRunner::stats() const {
  CudaRunnerStats total = stats_;  // launches_last_forward and the graph flag: the first stage keeps the step's
  total.graph_kernels = total.cublas_linears = total.side_stream_kernels = total.stage_copies = 0;
  total.weight_bytes = total.workspace_bytes = 0;
  total.stages = 1 + int(later_.size());
  for_each_stage([&total](const CudaRunner& s) {
    total.graph_kernels += s.stats_.graph_kernels;
    total.cublas_linears += s.stats_.cublas_linears;
    total.side_stream_kernels += s.stats_.side_stream_kernels;
    total.weight_bytes += s.stats_.weight_bytes;
    total.workspace_bytes += s.stats_.workspace_bytes;
    total.stage_copies += s.stats_.stage_copies;
  });
  return total;
}

std::vector<CudaStage> CudaRunner::stages() const {
  std::vector<CudaStage> out;
  for_each_stage([&out](const CudaRunner& s) {
    CudaStage stage = s.stage_;
    stage.weight_bytes = s.stats_.weight_bytes;
    out.push_back(stage);
  });
  return out;
}

}  // namespace

namespace {
// Device bytes of one linear matrix as WeightUploader stores it.
size_t linear_bytes(const Matrix& m, std::optional<GemvWeight> synthetic) {
  if (m.packed) return m.packed->w_bytes + m.packed->scale_bytes;
  if (m.has_values()) return size_t(m.rows) * size_t(m.cols) * 2;  // fp32 values go up as bf16
  if (synthetic) return size_t(gemv_weight_bytes(*synthetic, m.rows, m.cols) + gemv_scale_bytes(*synthetic, m.rows, m.cols));
  return 0;
}
size_t f32_bytes(const Matrix& m) { return size_t(m.rows) * size_t(m.cols) * sizeof(float); }
size_t f32_bytes(const Vector& v) { return v.size() * sizeof(float); }
}  // namespace

CudaMemoryNeed cuda_memory_need(const Model& model, int max_context, const CudaRunnerOptions& options) {
  return cuda_memory_need(model, max_context, options, 0, model.config().n_layers);
}

CudaMemoryNeed cuda_memory_need(const Model& model, int max_context, const CudaRunnerOptions& options, int layer_begin,
                                int layer_end) {
  const ModelConfig& c = model.config();
  const ModelWeights& W = model.weights();
  DSV4_CHECK(0 <= layer_begin && layer_begin < layer_end && layer_end <= c.n_layers,
             "cuda_memory_need: layers [{}, {}) outside the model's {}", layer_begin, layer_end, c.n_layers);
  const bool first = layer_begin == 0, last = layer_end == c.n_layers;
  const std::optional<GemvWeight> synthetic = options.synthetic_format;
  CudaMemoryNeed need;
  need.sequences = options.sequences;
  size_t& w = need.weights;
  const size_t bf16_table = size_t(c.vocab_size) * size_t(c.hidden_size) * 2;  // embedding, lm_head: bf16
  if (first || (last && W.mtp)) w += bf16_table;  // the MTP block embeds too
  if (last)
    w += bf16_table + f32_bytes(W.norm) + f32_bytes(W.hc_head.fn) + f32_bytes(W.hc_head.base) +
         f32_bytes(W.hc_head.scale);
  auto compressor = [&](const CompressorWeights& cw) {
    w += linear_bytes(cw.wkv, synthetic) + linear_bytes(cw.wgate, synthetic) + f32_bytes(cw.ape) + f32_bytes(cw.norm);
  };
  auto expert = [&](const ExpertWeights& e) {
    w += linear_bytes(e.w1, synthetic) + linear_bytes(e.w2, synthetic) + linear_bytes(e.w3, synthetic);
  };
  auto layer = [&](const LayerWeights& L) {
    w += f32_bytes(L.attn_norm) + f32_bytes(L.ffn_norm);
    for (const HyperConnWeights* h : {&L.hc_attn, &L.hc_ffn})
      w += f32_bytes(h->fn) + f32_bytes(h->base) + f32_bytes(h->scale);
    const AttentionWeights& A = L.attn;
    for (const Matrix* m : {&A.wq_a, &A.wq_b, &A.wkv, &A.wo_a, &A.wo_b}) w += linear_bytes(*m, synthetic);
    w += f32_bytes(A.q_norm) + f32_bytes(A.kv_norm) + f32_bytes(A.sink);
    if (A.compressor) compressor(*A.compressor);
    if (A.indexer) {
      w += linear_bytes(A.indexer->wq_b, synthetic) + f32_bytes(A.indexer->weights_proj);
      compressor(A.indexer->compressor);
    }
    const MoEWeights& M = L.ffn;
    w += f32_bytes(M.gate) + f32_bytes(M.gate_bias) + M.tid2eid.size() * sizeof(int32_t);
    for (const ExpertWeights& e : M.experts) expert(e);
    if (M.shared) expert(*M.shared);
  };
  for (int l = layer_begin; l < layer_end; ++l) layer(W.layers[size_t(l)]);
  if (last && W.mtp) {
    layer(W.mtp->block);
    w += linear_bytes(W.mtp->e_proj, synthetic) + linear_bytes(W.mtp->h_proj, synthetic) + f32_bytes(W.mtp->enorm) +
         f32_bytes(W.mtp->hnorm) + f32_bytes(W.mtp->norm) + f32_bytes(W.mtp->hc_head.fn) +
         f32_bytes(W.mtp->hc_head.base) + f32_bytes(W.mtp->hc_head.scale);
  }
  // A sequence's state, fp32 (model/state.h's layout): the window ring, then per compressed layer its entries, the
  // indexer's keys and both compressors' partial blocks.
  size_t& s = need.state_per_sequence;
  const size_t window = size_t(std::min(c.window + kMaxRollback, max_context)) * c.head_dim;
  for (int l = layer_begin; l < layer_end; ++l) {
    s += window;
    const int ratio = c.has_compressor(l) ? c.compress_ratio[size_t(l)] : 0;
    if (ratio == 0) continue;
    const size_t entries = size_t(max_context / ratio);
    s += entries * c.head_dim;
    const int series = c.is_csa(l) ? 2 : 1;
    s += 2 * size_t(series * ratio) * size_t(series * c.head_dim);  // kv and score partials
    if (c.is_csa(l)) s += entries * c.index_head_dim + 2 * size_t(series * ratio) * size_t(series * c.index_head_dim);
  }
  if (last && W.mtp) s += window + size_t(kMtpRows) * c.hc_mult * c.hidden_size;  // its window ring, the rows it trails by
  s *= sizeof(float);
  // The chunk-sized workspaces every stage allocates (the runner's constructor; the small ones left out).
  const int max_entries = max_compressed_entries(c, max_context);
  const int pairs = c.n_experts_per_tok + 1;  // + the shared expert's pair
  need.prefill_chunk = cuda_prefill_chunk(options.prefill_chunk, pairs, max_entries, max_context);
  const size_t D = size_t(c.hidden_size), f = sizeof(float), b16 = sizeof(uint16_t);
  const size_t per_row = size_t(c.hc_mult) * D * f                             // streams
                         + D * (f + b16 + f + f + b16)                          // normed (+ bf16), attn, shared, head
                         + size_t(c.n_heads) * size_t(c.head_dim) * b16         // o_grouped
                         + size_t(max_entries) * f                              // indexer scores
                         + size_t(pairs) * size_t(c.moe_inter) * (f + f + b16)  // expert gate, up, h
                         + size_t(pairs) * D * f;                               // y_pairs
  need.workspaces = size_t(need.prefill_chunk) * per_row + size_t(kCudaMaxChunk) * size_t(c.vocab_size) * f;
  return need;
}

void check_cuda_memory(const CudaMemoryNeed& need, size_t free_bytes, size_t total_bytes, int max_context) {
  constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;
  if (need.total() <= free_bytes) return;
  const bool weights_fit = need.weights <= free_bytes;
  const bool state_fits = need.weights + need.state_per_sequence * size_t(need.sequences) <= free_bytes;
  DSV4_FAIL("--device cuda: the model needs at least {:.1f} GiB of GPU memory (weights {:.1f} GiB + state {:.2f} GiB "
            "per sequence x {} for --max-context {} + workspaces {:.2f} GiB for prefill chunks of {} tokens), but the "
            "GPU has {:.1f} GiB free of {:.1f} GiB. {}",
            need.total() / kGiB, need.weights / kGiB, need.state_per_sequence / kGiB, need.sequences, max_context,
            need.workspaces / kGiB, need.prefill_chunk, free_bytes / kGiB, total_bytes / kGiB,
            !weights_fit  ? "The weights alone do not fit this GPU: split the layers over several GPUs (--gpus 0,1 or "
                            "more)."
            : state_fits ? "Lower --cuda-prefill-chunk so the workspaces fit."
                         : "Lower --max-context (or --max-batch) so the state fits.");
}

int fit_prefill_chunk(int requested, size_t free_bytes, const std::function<CudaMemoryNeed(int chunk)>& need_at) {
  const CudaMemoryNeed first = need_at(requested);
  if (first.total() <= free_bytes || first.total() - first.workspaces > free_bytes) return requested;
  int chunk = requested;
  while (chunk > kCudaMinFitChunk) {
    chunk = std::max(kCudaMinFitChunk, chunk / 2 / kCudaMaxChunk * kCudaMaxChunk);
    if (need_at(chunk).total() <= free_bytes) return chunk;
  }
  return chunk;  // does not fit: check_cuda_memory says so with these sizes
}

int cuda_prefill_chunk(int requested, int pairs_per_token, int max_entries, int max_context) {
  DSV4_CHECK(requested >= kCudaMaxChunk && requested <= 4096 && requested % kCudaMaxChunk == 0,
             "cuda runner: prefill_chunk = {} must be a multiple of {} in [{}, 4096]", requested, kCudaMaxChunk,
             kCudaMaxChunk);
  DSV4_CHECK(pairs_per_token > 0 && max_entries > 0 && max_context > 0,
             "cuda_prefill_chunk: pairs_per_token {}, max_entries {} and max_context {} must be positive",
             pairs_per_token, max_entries, max_context);
  auto down = [](int64_t v) { return int(v / kCudaMaxChunk * kCudaMaxChunk); };
  const int by_slots = down(kMoeSlotsMaxPairs / pairs_per_token);
  const int by_scores = down(std::min<int64_t>(4096, (int64_t(256) << 20) / (int64_t(max_entries) * 4)));
  const int by_context = down(int64_t(max_context) + kCudaMaxChunk - 1);  // no chunk longer than the context
  return std::max(kCudaMaxChunk, std::min({requested, by_slots, by_scores, by_context}));
}

std::vector<int> parse_cuda_devices(std::string_view list) {
  std::vector<int> devices;
  size_t at = 0;
  while (at <= list.size()) {
    const size_t end = std::min(list.find(',', at), list.size());
    const std::string_view item = list.substr(at, end - at);
    int device = -1;
    const auto [ptr, ec] = std::from_chars(item.data(), item.data() + item.size(), device);
    DSV4_CHECK(!item.empty() && ec == std::errc() && ptr == item.data() + item.size() && device >= 0,
               "GPU list '{}': expected comma-separated device ordinals such as 0,1", list);
    devices.push_back(device);
    at = end + 1;
  }
  return devices;
}

std::vector<CudaStage> cuda_pipeline_stages(const Model& model, const CudaRunnerOptions& options, int current_device) {
  const int L = model.config().n_layers;
  const std::vector<int> devices = options.devices.empty() ? std::vector<int>{current_device} : options.devices;
  const int G = int(devices.size());
  for (int d : devices) DSV4_CHECK(d >= 0, "cuda runner: GPU {} is not a device ordinal", d);
  DSV4_CHECK(G <= L, "cuda runner: {} GPUs for a model of {} layers: every GPU needs at least one layer", G, L);
  std::vector<int> firsts = options.stage_first_layers;
  if (!firsts.empty()) {
    DSV4_CHECK(int(firsts.size()) == G - 1, "cuda runner: {} stage first layers for {} GPUs (expected {})",
               firsts.size(), G, G - 1);
    for (size_t i = 0; i < firsts.size(); ++i)
      DSV4_CHECK(firsts[i] > (i ? firsts[i - 1] : 0) && firsts[i] < L,
                 "cuda runner: stage first layers must increase inside (0, {}), got {} at position {}", L, firsts[i],
                 i);
  } else if (G > 1) {
    // prefix[l]: weight bytes of the layers before l, the embedding with layer 0, the head and MTP block with the last
    std::vector<double> prefix(size_t(L) + 1, 0.0);
    for (int l = 0; l < L; ++l)
      prefix[size_t(l) + 1] = prefix[size_t(l)] + double(cuda_memory_need(model, 1, options, l, l + 1).weights);
    int previous = 0;
    for (int i = 1; i < G; ++i) {
      const double target = prefix[size_t(L)] * i / G;
      int best = previous + 1;
      for (int b = previous + 1; b <= L - (G - i); ++b)  // leave a layer for each later stage
        if (std::abs(prefix[size_t(b)] - target) < std::abs(prefix[size_t(best)] - target)) best = b;
      firsts.push_back(best);
      previous = best;
    }
  }
  std::vector<CudaStage> stages;
  for (int i = 0; i < G; ++i) {
    CudaStage s;
    s.device = devices[size_t(i)];
    s.layer_begin = i == 0 ? 0 : firsts[size_t(i) - 1];
    s.layer_end = i + 1 == G ? L : firsts[size_t(i)];
    s.weight_bytes = cuda_memory_need(model, 1, options, s.layer_begin, s.layer_end).weights;
    stages.push_back(s);
  }
  return stages;
}

std::unique_ptr<SequenceRunner> make_cuda_runner(const Model& model, int max_context, CudaRunnerOptions options) {
  if (const char* env = std::getenv("DSV4_CUDA_GRAPH"); env && std::string(env) == "0") options.graph_decode = false;
  if (const char* env = std::getenv("DSV4_CUDA_DEVICES"); env && *env && options.devices.empty())  // --gpus wins
    options.devices = parse_cuda_devices(env);
  for (const auto& [name, on] : {std::pair{"DSV4_DEVICE_DRAW", &options.draw_on_device},
                                 {"DSV4_FUSED_MHC", &options.fuse_mhc_mix},
                                 {"DSV4_FUSED_ROUTING", &options.fuse_moe_routing},
                                 {"DSV4_FUSED_GATE", &options.fuse_moe_gate},
                                 {"DSV4_FUSED_POST", &options.fuse_mhc_post},
                                 {"DSV4_EARLY_W2", &options.early_w2_weights},
                                 {"DSV4_OVERLAP", &options.overlap_branches},
                                 {"DSV4_GROUP_SHARED", &options.group_shared_expert},
                                 {"DSV4_GEMV_TILES", &options.fp4_tiles}})
    if (const std::optional<bool> env = env_switch(name)) *on = *env;
  if (const std::optional<bool> env = env_switch("DSV4_FUSED_QNORM"))
    options.q_norm_in_attention_rows = *env ? 1 : CudaRunnerOptions::kNever;
  if (const std::optional<bool> env = env_switch("DSV4_FUSED_SWIGLU"))
    options.swiglu_in_w1_w3_rows = *env ? 1 : CudaRunnerOptions::kNever;
  DSV4_CHECK(cuda_available(), "--device cuda: no usable CUDA device or driver");
  DSV4_CHECK(max_context > 0, "--max-context must be positive, got {}", max_context);
  int current = 0, count = 0;
  DSV4_CUDA_CHECK(cudaGetDevice(&current));
  DSV4_CUDA_CHECK(cudaGetDeviceCount(&count));
  const std::vector<CudaStage> stages = cuda_pipeline_stages(model, options, current);
  for (const CudaStage& s : stages)
    DSV4_CHECK(s.device < count, "--gpus: GPU {} does not exist (this machine has {})", s.device, count);
  // Before any upload: a model larger than its GPUs fails now, not after minutes of copying. A device holding
  // several stages (tests) needs their sum.
  auto per_device_at = [&](int chunk) {
    CudaRunnerOptions o = options;
    o.prefill_chunk = chunk;
    std::map<int, CudaMemoryNeed> per_device;
    for (const CudaStage& s : stages) {
      const CudaMemoryNeed need = cuda_memory_need(model, max_context, o, s.layer_begin, s.layer_end);
      CudaMemoryNeed& sum = per_device[s.device];
      sum.weights += need.weights;
      sum.state_per_sequence += need.state_per_sequence;
      sum.workspaces += need.workspaces;  // each stage has its own
      sum.sequences = need.sequences;
      sum.prefill_chunk = need.prefill_chunk;
    }
    return per_device;
  };
  std::map<int, std::pair<size_t, size_t>> memory;  // free and total bytes per device
  for (const CudaStage& s : stages) {
    DeviceScope scope(s.device);
    DSV4_CUDA_CHECK(cudaMemGetInfo(&memory[s.device].first, &memory[s.device].second));
  }
  int chunk = options.prefill_chunk;
  for (const auto& [device, bytes] : memory)
    chunk = std::min(chunk, fit_prefill_chunk(chunk, bytes.first, [&](int c) { return per_device_at(c)[device]; }));
  if (chunk != options.prefill_chunk) {
    spdlog::info("cuda runner: prefill chunks of {} tokens instead of {}, so that their workspaces fit the GPU's free "
                 "memory next to the weights and state", chunk, options.prefill_chunk);
    options.prefill_chunk = chunk;
  }
  for (const auto& [device, need] : per_device_at(chunk)) {
    const auto [free_bytes, total_bytes] = memory[device];
    try {
      check_cuda_memory(need, free_bytes, total_bytes, max_context);
    } catch (const Error& e) {
      if (stages.size() == 1) throw;
      DSV4_FAIL("GPU {} (its share of the {} stages): {}", device, stages.size(), e.what());
    }
  }
  // Each stage copies the streams from the previous one: directly when it may read that GPU's memory.
  for (size_t i = 1; i < stages.size(); ++i) {
    const int from = stages[i - 1].device, to = stages[i].device;
    if (from == to) continue;
    int can = 0;
    DSV4_CUDA_CHECK(cudaDeviceCanAccessPeer(&can, to, from));
    if (!can) {
      spdlog::warn("cuda runner: GPU {} cannot read GPU {}'s memory: the streams between their stages go through the "
                   "host", to, from);
      continue;
    }
    DeviceScope scope(to);
    const cudaError_t e = cudaDeviceEnablePeerAccess(from, 0);
    if (e == cudaErrorPeerAccessAlreadyEnabled)
      cudaGetLastError();  // clear it: enabled by an earlier runner
    else
      DSV4_CUDA_CHECK(e);
  }
  auto first = std::make_unique<CudaRunner>(model, max_context, options, stages, 0);
  for (size_t i = 1; i < stages.size(); ++i)
    first->add_stage(std::make_unique<CudaRunner>(model, max_context, options, stages, i));
  return first;
}

std::vector<CudaStage> cuda_runner_stages(const SequenceRunner& runner) {
  const auto* cuda = dynamic_cast<const CudaRunner*>(&runner);
  DSV4_CHECK(cuda, "cuda_runner_stages: not a CUDA runner");
  return cuda->stages();
}


namespace {
CudaRunner& as_cuda(SequenceRunner& runner, const char* what) {
  auto* cuda = dynamic_cast<CudaRunner*>(&runner);
  DSV4_CHECK(cuda, "{}: not a CUDA runner", what);
  return *cuda;
}
}  // namespace

void cuda_runner_select_sequence(SequenceRunner& runner, int sequence) {
  as_cuda(runner, "cuda_runner_select_sequence").select_sequence(sequence);
}

std::vector<float> cuda_runner_decode_batch(SequenceRunner& runner, std::span<const int32_t> tokens) {
  return as_cuda(runner, "cuda_runner_decode_batch").decode_batch(tokens);
}

std::vector<int32_t> cuda_runner_decode_batch_draw(SequenceRunner& runner, std::span<const int32_t> tokens,
                                                   std::span<const TokenDraw> draws) {
  return as_cuda(runner, "cuda_runner_decode_batch_draw").decode_batch_draw(tokens, draws);
}

std::vector<float> cuda_runner_mtp_logits(SequenceRunner& runner, std::span<const int32_t> next_tokens) {
  return as_cuda(runner, "cuda_runner_mtp_logits").mtp_logits(next_tokens);
}

void cuda_runner_copy_sequence(SequenceRunner& runner, int from, int to) {
  as_cuda(runner, "cuda_runner_copy_sequence").copy_sequence(from, to);
}

void cuda_runner_drop_graphs(SequenceRunner& runner) { as_cuda(runner, "cuda_runner_drop_graphs").drop_graphs(); }

std::vector<LaunchTiming> cuda_runner_profile_step(SequenceRunner& runner, std::span<const int32_t> tokens) {
  return as_cuda(runner, "cuda_runner_profile_step").profile_step(tokens);
}

std::vector<LaunchTiming> cuda_runner_profile_prefill(SequenceRunner& runner, std::span<const int32_t> tokens) {
  return as_cuda(runner, "cuda_runner_profile_prefill").profile_step(tokens, true);
}

int cuda_runner_prefill_chunk(const SequenceRunner& runner) {
  const auto* cuda = dynamic_cast<const CudaRunner*>(&runner);
  DSV4_CHECK(cuda, "cuda_runner_prefill_chunk: not a CUDA runner");
  return cuda->prefill_chunk();
}

bool cuda_runner_draws_on_device(const SequenceRunner& runner) {
  const auto* cuda = dynamic_cast<const CudaRunner*>(&runner);
  DSV4_CHECK(cuda, "cuda_runner_draws_on_device: not a CUDA runner");
  return cuda->draws_on_device();
}

void cuda_runner_set_draw_on_device(SequenceRunner& runner, bool on) {
  as_cuda(runner, "cuda_runner_set_draw_on_device").set_draw_on_device(on);
}

CudaRunnerOptions cuda_runner_options(const SequenceRunner& runner) {
  const auto* cuda = dynamic_cast<const CudaRunner*>(&runner);
  DSV4_CHECK(cuda, "cuda_runner_options: not a CUDA runner");
  return cuda->options();
}

void cuda_runner_set_step_switches(SequenceRunner& runner, const CudaRunnerOptions& switches) {
  as_cuda(runner, "cuda_runner_set_step_switches").set_step_switches(switches);
}

CudaRunnerStats cuda_runner_stats(const SequenceRunner& runner) {
  const auto* cuda = dynamic_cast<const CudaRunner*>(&runner);
  DSV4_CHECK(cuda, "cuda_runner_stats: not a CUDA runner");
  return cuda->stats();
}

}  // namespace dsv4
