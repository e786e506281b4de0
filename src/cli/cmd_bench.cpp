// SPDX-License-Identifier: MIT
// `dsv4 bench`: a random model with the real V4-Flash shapes (fewer routed experts per layer so that it fits one
// GPU; batch-1 decode reads 6 of them whatever the count) on the CUDA runner, in NVFP4 and BF16. Reports prefill
// tokens/s (1K / 8K / 32K prompts) and decode tokens/s at batch 1, 8, 32, each against its roofline:
//   decode   bytes that must be read per step (weights of the experts the batch's tokens pick, expected under
//            uniform routing: 6 at batch 1; the shared expert, attention, fp32 mixes, lm_head once; KV at the
//            decode context and one embedding row per sequence) / copy bandwidth measured in the same run, times
//            the batch. Batches > 1 are sequences copied from the batch-1 one (same context, no B prefills).
//   prefill  FLOPs per token (2 x active params + attention) / the bf16 tensor-core rate, and the weight-streaming
//            bound of the runner's chunked prefill (every chunk of prefill_chunk tokens reads the weights once)
// docs/bench.md explains the accounting. `--plan-only` prints the accounting without a GPU.
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "cli/commands.h"
#include "core/check.h"
#include "model/model.h"
#include "model/synthetic.h"
#ifdef DSV4_HAVE_CUDA
#include "cuda/bandwidth.h"
#include "cuda/cuda_check.h"
#include "cuda/device.h"
#include "cuda/ops.h"
#include "cuda/runner.h"
#endif

namespace dsv4::cli {
namespace {

using nlohmann::json;

// Dense bf16 tensor-core rate of one H200 as measured on these machines (8192^3 bf16 matmul through PyTorch,
// 769-798 TFLOP/s on random data): the device README's "bf16 matrix work at about 790 TFLOP/s".
constexpr double kBf16DenseFlops = 790e12;
constexpr int kDecodeWarmupSteps = 2;  // the first 1-token step captures the CUDA graph
#ifdef DSV4_HAVE_CUDA
constexpr int kPlanPrefillChunk = kCudaPrefillChunk;
#else
constexpr int kPlanPrefillChunk = 4096;  // the CUDA runner's default (kCudaPrefillChunk), for --plan-only in CPU builds
#endif

enum class BenchFormat { NVFP4, BF16 };

const char* format_name(BenchFormat f) { return f == BenchFormat::NVFP4 ? "nvfp4" : "bf16"; }

// Storage of one linear-layer weight element: NVFP4 = e2m1 nibble + one e4m3 scale per 16 (the fp32 global scale
// per matrix is negligible); BF16 = 2 bytes.
double linear_bytes_per_element(BenchFormat f) { return f == BenchFormat::NVFP4 ? 0.5 + 1.0 / 16 : 2.0; }

struct BenchArgs {
  std::string format = "both";
  int experts = 32;
  std::vector<int> prefill = {1024, 8192, 32768};
  int decode_context = 8192;
  int decode_steps = 64;
  std::vector<int> decode_batch = {1, 8, 32};
  int max_context = 0;  // 0 = max(prefill lengths, decode context + warm-up + steps)
  int prefill_chunk = kPlanPrefillChunk;  // CudaRunnerOptions::prefill_chunk (the runner may lower it, logged)
  std::vector<int> verify_rows;  // --verify-rows: speculative decoding's verify step of K rows at batch 1
  bool mtp = false;  // --mtp: the model gets a synthetic MTP block, and a decode step + its draft is timed
  uint64_t seed = 1;
  std::string json_path;
  bool plan_only = false;
  bool profile = false;  // one more decode step with an event after every launch site
  int profile_prefill = 0;  // > 0: a prefill of this many tokens with an event after every launch site
  std::string act_quant = "none";  // --act-quant: fp8 quantises the FP8/FP4 linears' inputs (official numerics)
  std::string gpus;  // --gpus 0,1: the layers split over these GPUs (CudaRunnerOptions::devices)
  // Decode is timed once per launch mode: "pdl" (the default: programmatic dependent launch) or "plain" (serialised
  // launches). Prefill and --profile use the first.
  std::vector<std::string> launch_modes = {"pdl"};
  // Decode is also timed once per draw: "none" (the default: logits computed, nothing comes back), "host" (logits
  // copied back and drawn by the host Sampler, rows in parallel) or "device" (drawn on the GPU, ids come back); the
  // draws are temperature 1, top_p 1 (the server's default).
  std::vector<std::string> draws = {"none"};
  // Decode is also timed once per set of step switches: "default" (as the runner was built, environment included),
  // or '+'-joined names turned on: bulk (fp4 / fp8 GEMVs through the copy engine, set_gemv_bulk), bulkdense (the same
  // for the plain and batched launches only, the grouped experts stay on the register kernel), overlap
  // (CudaRunnerOptions::overlap_branches; serial turns it off), mhc (fuse_mhc_mix), routing (fuse_moe_routing),
  // qnorm / noqnorm (q's norm inside the attention kernel in every chunk / in none: q_norm_in_attention_rows),
  // heads16 / heads64 (the decode attention's heads per block, gpu::set_attention_decode_block_heads), hcblock
  // (hc_pre's decode collapse in one block per token, gpu::set_hc_collapse_cluster), now4a8 (act fp8 at m = 1
  // through act_quant + the bf16 kernel instead of the W4A8 kernel, set_gemv_w4a8), early / earlyall / late (the
  // GEMVs' / also linear_f32's and hc_pre's / no first weight loads before the wait for the previous kernel,
  // gpu::set_early_weights), gate / nogate
  // (the router gate, router and slots in one launch or three: CudaRunnerOptions::fuse_moe_gate), post / nopost (each
  // mHC post inside the next hc_pre or its own launch: fuse_mhc_post), swiglu / noswiglu (the experts' SwiGLU inside
  // the grouped w1 + w3 in every chunk / in none: swiglu_in_w1_w3_rows), earlyw2 / noearlyw2 (the experts' w2 issues
  // weight loads before its wait: early_w2_weights), indexorder / scoreorder (the indexer's picks in index order
  // or sorted by score: set_indexer_select_index_order), tiledN (N = 2..65: calls of >= N rows whose grid fills the
  // GPU, decode batches included, on the tiled tensor-core GEMM: set_gemv_tiled_min_rows), split1 / 2 / 4 / 8 (every
  // skinny GEMV at that split_k instead of the heuristic's: set_gemv_forced_split), ws / nows (the fp4 prefill GEMMs'
  // wgmma kernel in its warp-specialised form or not: set_gemv_wgmma_ws), persist / nopersist (that form with one
  // block per SM walking the tiles, or one block per tile: set_gemv_wgmma_persistent), cublasdense (every prefill-sized dense
  // linear through the weight decode + cuBLASLt, none on the wgmma kernel: set_gemv_over_gemm(false)), f32tiles
  // (prefill's fp32 linears on 32-row cluster tiles: gpu::set_linear_f32_tiles), slotwarps (moe_slots placed by every
  // warp: set_moe_slots_by_warps).
  // Prefill is timed with each set too; --profile uses the first.
  std::vector<std::string> switches = {"default"};
};

// One entry of --switches.
struct StepSwitches {
  bool bulk = false, bulk_dense = false, overlap = false, serial = false, mhc = false, routing = false;
  int attention_heads = 0;  // heads16 / heads64: the tensor-core attention's heads per block at decode (0: its rule)
  bool hc_block = false;    // hcblock: hc_pre's decode collapse in one block per token, not a cluster
  bool no_w4a8 = false;     // now4a8: act fp8 at m = 1 quantises x first and runs the bf16 kernel (set_gemv_w4a8)
  bool early = false, early_all = false, late = false;  // gpu::set_early_weights: Gemv (at least), All, Off
  // -1: as built; 0 / 1: off / on (nogate / gate: fuse_moe_gate, nopost / post: fuse_mhc_post, noswiglu / swiglu:
  // swiglu_in_w1_w3_rows 1 / never, scoreorder / indexorder: set_indexer_select_index_order).
  int gate = -1, post = -1, swiglu = -1, index_order = -1, early_w2 = -1;  // earlyw2 / noearlyw2: early_w2_weights
  int qnorm = -1;  // qnorm / noqnorm: q_norm_in_attention_rows 1 / never (-1: as built)
  int tiled_min = 0;  // tiledN: the tiled tensor-core GEMM from N rows (set_gemv_tiled_min_rows; 0: as built)
  int split = 0;      // splitN: every skinny GEMV launch at split_k N (set_gemv_forced_split; 0: the heuristic)
  int wgmma_ws = -1;  // ws / nows: set_gemv_wgmma_ws (-1: as built)
  int persistent = -1;  // persist / nopersist: set_gemv_wgmma_persistent (-1: as built)
  bool cublas_dense = false;  // cublasdense: set_gemv_over_gemm(false)
  bool f32_tiles = false;     // f32tiles: gpu::set_linear_f32_tiles(true)
  bool slot_warps = false;    // slotwarps: set_moe_slots_by_warps(true)
};

StepSwitches parse_switches(const std::string& spec) {
  StepSwitches s;
  if (spec == "default") return s;
  size_t from = 0;
  while (from <= spec.size()) {
    const size_t to = std::min(spec.find('+', from), spec.size());
    const std::string name = spec.substr(from, to - from);
    if (name == "bulk") s.bulk = true;
    else if (name == "bulkdense") s.bulk_dense = true;
    else if (name == "overlap") s.overlap = true;
    else if (name == "serial") s.serial = true;
    else if (name == "mhc") s.mhc = true;
    else if (name == "routing") s.routing = true;
    else if (name == "qnorm" || name == "noqnorm") s.qnorm = name == "qnorm";
    else if (name == "heads16") s.attention_heads = 16;
    else if (name == "heads64") s.attention_heads = 64;
    else if (name == "hcblock") s.hc_block = true;
    else if (name == "now4a8") s.no_w4a8 = true;
    else if (name == "early") s.early = true;
    else if (name == "earlyall") s.early_all = true;
    else if (name == "late") s.late = true;
    else if (name == "nogate") s.gate = 0;
    else if (name == "gate") s.gate = 1;
    else if (name == "nopost") s.post = 0;
    else if (name == "post") s.post = 1;
    else if (name == "noswiglu") s.swiglu = 0;
    else if (name == "swiglu") s.swiglu = 1;
    else if (name == "noearlyw2") s.early_w2 = 0;
    else if (name == "earlyw2") s.early_w2 = 1;
    else if (name == "scoreorder") s.index_order = 0;
    else if (name == "indexorder") s.index_order = 1;
    else if (name == "ws") s.wgmma_ws = 1;
    else if (name == "nows") s.wgmma_ws = 0;
    else if (name == "persist") s.persistent = 1;
    else if (name == "nopersist") s.persistent = 0;
    else if (name == "cublasdense") s.cublas_dense = true;
    else if (name == "f32tiles") s.f32_tiles = true;
    else if (name == "slotwarps") s.slot_warps = true;
    else if (name.rfind("tiled", 0) == 0 && name.size() > 5 &&
             name.find_first_not_of("0123456789", 5) == std::string::npos)
      s.tiled_min = std::stoi(name.substr(5));
    else if (name == "split1" || name == "split2" || name == "split4" || name == "split8")
      s.split = name[5] - '0';
    else DSV4_FAIL("dsv4 bench: --switches entry '{}' has '{}' (expected default, or bulk, bulkdense, overlap, "
                   "serial, mhc, routing, [no]qnorm, heads16, heads64, hcblock, now4a8, early, earlyall, late, "
                   "[no]gate, [no]post, [no]swiglu, [no]earlyw2, scoreorder, indexorder, tiledN, split1/2/4/8, [no]ws, "
                   "[no]persist, cublasdense, f32tiles and slotwarps joined by '+')",
                   spec, name);
    from = to + 1;
  }
  return s;
}

// ---- accounting -------------------------------------------------------------------------------------------

// Elements of the linear-layer weights, summed over layers (one routed expert counted apart: batch 1 reads k).
struct LinearElements {
  double attention = 0;     // wq_a, wq_b, wkv, wo_a, wo_b
  double compressors = 0;   // main KV compressors wkv + wgate (CSA, HCA)
  double indexer = 0;       // indexer wq_b + indexer compressor wkv + wgate (CSA)
  double routed_expert = 0; // w1 + w2 + w3 of one routed expert, all layers
  double shared = 0;        // shared expert w1 + w2 + w3, all layers
  double fp32 = 0;          // fp32 matrices: mHC fn (2 per layer + head), router gate, indexer weights_proj
  double vectors = 0;       // norms, sinks, hc base/scale, gate bias, one ape row per compressor (fp32)
  double head = 0, embed_row = 0;
};

LinearElements linear_elements(const ModelConfig& c) {
  LinearElements e;
  const double D = c.hidden_size, H = c.n_heads, hd = c.head_dim, hc = c.hc_mult, n_mix = (2 + hc) * hc;
  for (int l = 0; l < c.n_layers; ++l) {
    e.attention += c.q_lora_rank * D + H * hd * c.q_lora_rank + hd * D +
                   double(c.o_groups) * c.o_lora_rank * (H * hd / c.o_groups) + D * c.o_groups * c.o_lora_rank;
    e.vectors += 2 * D + c.q_lora_rank + hd + H + 2 * (n_mix + 3);
    if (c.has_compressor(l)) {
      const double width = (c.is_csa(l) ? 2 : 1) * hd;
      e.compressors += 2 * width * D;
      e.vectors += hd + width;
    }
    if (c.is_csa(l)) {
      const double width = 2.0 * c.index_head_dim;
      e.indexer += double(c.index_n_heads) * c.index_head_dim * c.q_lora_rank + 2 * width * D;
      e.fp32 += c.index_n_heads * D;
      e.vectors += c.index_head_dim + width;
    }
    e.fp32 += 2 * n_mix * hc * D + c.n_routed_experts * D;
    if (!c.hash_routed[l]) e.vectors += c.n_routed_experts;
    e.routed_expert += 3.0 * c.moe_inter * D;
    e.shared += 3.0 * c.moe_inter * c.n_shared_experts * D;
  }
  e.fp32 += hc * hc * D;  // hc_head fn
  e.vectors += D + hc + 1;
  e.head = double(c.vocab_size) * D;
  e.embed_row = D;
  return e;
}

// Keys one token at `pos` attends, summed over layers (spec 3.7): window min(pos+1, W) in every layer; CSA the
// top-k of its (pos+1) div 4 entries, all of which the indexer scores; HCA every (pos+1) div 128 entry.
struct AttendedKeys {
  double window = 0, csa = 0, hca = 0, index_keys = 0;
};

AttendedKeys attended_keys(const ModelConfig& c, int64_t pos) {
  AttendedKeys k;
  for (int l = 0; l < c.n_layers; ++l) {
    k.window += double(std::min<int64_t>(pos + 1, c.window));
    if (!c.has_compressor(l)) continue;
    const int64_t entries = (pos + 1) / c.compress_ratio[l];
    if (c.is_csa(l)) {
      k.csa += double(std::min<int64_t>(entries, c.index_topk));
      k.index_keys += double(entries);
    } else {
      k.hca += double(entries);
    }
  }
  return k;
}

// FLOPs per attended key (QK^T and PV over H heads of head_dim: 4 H d) and per indexer key (2 x heads x dim),
// spec 9.
double attention_flops(const ModelConfig& c, const AttendedKeys& k) {
  return (k.window + k.csa + k.hca) * 4.0 * c.n_heads * c.head_dim +
         k.index_keys * 2.0 * c.index_n_heads * c.index_head_dim;
}

struct CostLine {
  std::string name;
  double bytes = 0, flops = 0;
};

double total_bytes(const std::vector<CostLine>& lines) {
  double s = 0;
  for (const CostLine& l : lines) s += l.bytes;
  return s;
}
double total_flops(const std::vector<CostLine>& lines) {
  double s = 0;
  for (const CostLine& l : lines) s += l.flops;
  return s;
}

// Expected distinct experts a chunk of `tokens` tokens touches in one layer under uniform random routing
// (exactly k for one token).
double experts_touched(const ModelConfig& c, int tokens) {
  const double E = c.n_routed_experts;
  return E * (1.0 - std::pow(1.0 - c.n_experts_per_tok / E, tokens));
}

// Bytes read and FLOPs of one decode step of `batch` sequences, each at position `pos`, in the sizes the CUDA
// runner stores: linear weights in `f` (read once per step; routed experts: those the batch touches), embedding
// and lm_head bf16, mixes / gate / weights_proj fp32, KV and indexer keys fp32 (read per sequence).
std::vector<CostLine> decode_step_cost(const ModelConfig& c, BenchFormat f, int64_t pos, int batch = 1) {
  const LinearElements e = linear_elements(c);
  const double w = linear_bytes_per_element(f), f32 = 4, bf16 = 2, B = batch;
  const AttendedKeys k = attended_keys(c, pos);
  const double kv_entry = c.head_dim * f32, index_entry = c.index_head_dim * f32;
  const double key_flops = 4.0 * c.n_heads * c.head_dim;
  const double touched = experts_touched(c, batch);
  const std::string routed = batch == 1 ? fmt::format("routed experts ({} of {})", c.n_experts_per_tok,
                                                      c.n_routed_experts)
                                        : fmt::format("routed experts ({:.1f} of {} touched)", touched,
                                                      c.n_routed_experts);
  return {
      {"attention wq_a wq_b wkv wo_a wo_b", e.attention * w, 2 * B * e.attention},
      {"KV compressors wkv wgate", e.compressors * w, 2 * B * e.compressors},
      {"indexer wq_b + compressor", e.indexer * w, 2 * B * e.indexer},
      {routed, touched * e.routed_expert * w, 2 * B * c.n_experts_per_tok * e.routed_expert},
      {"shared expert", e.shared * w, 2 * B * e.shared},
      {"fp32 mHC fn, router gate, weights_proj", e.fp32 * f32, 2 * B * e.fp32},
      {"fp32 norms, sinks, biases, ape rows", e.vectors * f32, 0},
      {"lm_head (bf16)", e.head * bf16, 2 * B * e.head},
      {"embedding rows (bf16)", B * e.embed_row * bf16, 0},
      {"KV window entries (fp32)", B * k.window * kv_entry, B * k.window * key_flops},
      {"KV CSA top-k entries (fp32)", B * k.csa * kv_entry, B * k.csa * key_flops},
      {"KV HCA entries (fp32)", B * k.hca * kv_entry, B * k.hca * key_flops},
      {"indexer keys (fp32)", B * k.index_keys * index_entry,
       B * k.index_keys * 2.0 * c.index_n_heads * c.index_head_dim},
  };
}

struct PrefillBounds {
  double flops_per_token = 0;       // averaged over the prompt's positions; lm_head once (last_only)
  double compute_tok_s = 0;         // at kBf16DenseFlops
  double weight_bytes_per_chunk = 0;
  double streaming_seconds = 0;     // weight bytes of all chunks + lm_head once, at `bandwidth` (0 = unknown)
  double streaming_tok_s = 0;
};

PrefillBounds prefill_bounds(const ModelConfig& c, BenchFormat f, int tokens, int chunk_tokens,
                             double bandwidth_bytes_s) {
  const LinearElements e = linear_elements(c);
  const double w = linear_bytes_per_element(f);
  PrefillBounds b;
  double attention = 0;
  for (int64_t pos = 0; pos < tokens; ++pos) attention += attention_flops(c, attended_keys(c, pos));
  const double linear = 2 * (e.attention + e.compressors + e.indexer + c.n_experts_per_tok * e.routed_expert +
                             e.shared + e.fp32);
  b.flops_per_token = linear + attention / tokens + 2 * e.head / tokens;
  b.compute_tok_s = kBf16DenseFlops / b.flops_per_token;
  const int chunk = std::min(tokens, chunk_tokens);
  b.weight_bytes_per_chunk = (e.attention + e.compressors + e.indexer + e.shared) * w + e.fp32 * 4 +
                             experts_touched(c, chunk) * e.routed_expert * w;
  if (bandwidth_bytes_s > 0) {
    const double chunks = std::ceil(double(tokens) / chunk_tokens);
    b.streaming_seconds = (chunks * b.weight_bytes_per_chunk + e.head * 2) / bandwidth_bytes_s;
    b.streaming_tok_s = tokens / b.streaming_seconds;
  }
  return b;
}

std::vector<BenchFormat> parse_formats(const std::string& s) {
  if (s == "nvfp4") return {BenchFormat::NVFP4};
  if (s == "bf16") return {BenchFormat::BF16};
  return {BenchFormat::NVFP4, BenchFormat::BF16};
}

// Position of the middle timed decode step (the KV read grows by a few entries over the steps).
int64_t decode_mean_position(const BenchArgs& a) {
  return int64_t(a.decode_context) + kDecodeWarmupSteps + a.decode_steps / 2;
}

void validate(BenchArgs& a) {
  DSV4_CHECK(a.experts >= 6, "dsv4 bench: --experts must be >= 6 (top-6 routing), got {}", a.experts);
  DSV4_CHECK(!a.prefill.empty(), "dsv4 bench: --prefill lists no prompt length");
  for (int len : a.prefill) DSV4_CHECK(len > 0, "dsv4 bench: --prefill length {} must be positive", len);
  DSV4_CHECK(a.decode_context >= 0, "dsv4 bench: --decode-context {} must be >= 0", a.decode_context);
  DSV4_CHECK(a.decode_steps > 0, "dsv4 bench: --decode-steps {} must be positive", a.decode_steps);
  DSV4_CHECK(a.prefill_chunk >= 64 && a.prefill_chunk <= 4096 && a.prefill_chunk % 64 == 0,
             "dsv4 bench: --prefill-chunk {} must be a multiple of 64 in [64, 4096]", a.prefill_chunk);
  DSV4_CHECK(!a.decode_batch.empty(), "dsv4 bench: --decode-batch lists no batch size");
  for (int b : a.decode_batch)
    DSV4_CHECK(b >= 1 && b <= 64, "dsv4 bench: --decode-batch {} must be in [1, 64] (one chunk of the runner)", b);
  DSV4_CHECK(!a.launch_modes.empty(), "dsv4 bench: --launch-modes lists no mode");
  // Sequence 0 goes on from batch to batch and mode to mode (the others are copied from it).
  DSV4_CHECK(!a.draws.empty(), "dsv4 bench: --draws lists no draw");
  DSV4_CHECK(!a.switches.empty(), "dsv4 bench: --switches lists no set");
  for (const std::string& spec : a.switches) parse_switches(spec);  // throws for an unknown name
  const int timed_runs =
      int(a.decode_batch.size() * a.launch_modes.size() * a.draws.size() * a.switches.size());
  DSV4_CHECK(a.profile_prefill >= 0, "dsv4 bench: --profile-prefill {} must be >= 0", a.profile_prefill);
  const int needed = std::max({*std::max_element(a.prefill.begin(), a.prefill.end()), a.profile_prefill,
                              a.decode_context + timed_runs * (kDecodeWarmupSteps + a.decode_steps) +
                                  (a.profile ? int(a.decode_batch.size()) : 0) +
                                  // each verify of K rows keeps 1 (plus its decode-step baseline), the last
                                  // one holds K - 1 more before its rollback
                                  (a.verify_rows.empty() ? 0 : int(a.verify_rows.size() + 1) *
                                                                   (kDecodeWarmupSteps + a.decode_steps) +
                                                               kMaxRollback + 1) +
                                  // --mtp times the step with its draft, then the step alone
                                  (a.mtp ? 2 * (kDecodeWarmupSteps + a.decode_steps) : 0)});
  for (int k : a.verify_rows)
    DSV4_CHECK(k >= 2 && k <= kMaxRollback + 1, "dsv4 bench: --verify-rows {} must be in [2, {}]", k,
               kMaxRollback + 1);
  if (a.max_context == 0) a.max_context = needed;
  DSV4_CHECK(a.max_context >= needed, "dsv4 bench: --max-context {} is below the {} tokens the runs need",
             a.max_context, needed);
}

void print_cost_table(const std::vector<CostLine>& lines, BenchFormat f, int64_t pos, int batch = 1) {
  fmt::print("\nbytes read per decode step, batch {}, {} linears, position {}:\n", batch, format_name(f), pos);
  fmt::print("  {:<42} {:>10} {:>10}\n", "component (all layers)", "GB/step", "GFLOP");
  for (const CostLine& l : lines) fmt::print("  {:<42} {:>10.4f} {:>10.3f}\n", l.name, l.bytes / 1e9, l.flops / 1e9);
  fmt::print("  {:<42} {:>10.4f} {:>10.3f}\n", "total", total_bytes(lines) / 1e9, total_flops(lines) / 1e9);
}

json cost_json(const std::vector<CostLine>& lines) {
  json j = json::array();
  for (const CostLine& l : lines) j.push_back({{"component", l.name}, {"bytes", l.bytes}, {"flops", l.flops}});
  return j;
}

void write_json(const BenchArgs& a, const json& report) {
  if (a.json_path.empty()) return;
  std::ofstream out(a.json_path);
  DSV4_CHECK(out.good(), "dsv4 bench: cannot write --json {}", a.json_path);
  out << report.dump(2) << "\n";
  DSV4_CHECK(out.good(), "dsv4 bench: writing --json {} failed", a.json_path);
}

json args_json(const BenchArgs& a, const ModelConfig& c) {
  return {{"experts_per_layer", a.experts}, {"prefill", a.prefill}, {"decode_context", a.decode_context},
          {"decode_steps", a.decode_steps}, {"decode_batch", a.decode_batch}, {"max_context", a.max_context},
          {"seed", a.seed},
          {"act_quant", a.act_quant},
          {"launch_modes", a.launch_modes}, {"draws", a.draws}, {"switches", a.switches},
          {"config", c.summary()}, {"bf16_dense_flops", kBf16DenseFlops}, {"prefill_chunk", a.prefill_chunk}};
}

// The accounting alone, no GPU needed.
int run_plan(const BenchArgs& a) {
  const ModelConfig config = flash_shaped_config(a.experts);
  fmt::print("model: {}\n", config.summary());
  json report = args_json(a, config);
#ifdef DSV4_HAVE_CUDA
  if (!a.gpus.empty()) {  // how the runner would split the layers (host arithmetic)
    const Model model(config, synthetic_weights(config, a.seed, SyntheticLinears::ShapeOnly, a.mtp), Numerics{});
    CudaRunnerOptions options;
    options.devices = parse_cuda_devices(a.gpus);
    options.prefill_chunk = a.prefill_chunk;
    for (BenchFormat f : parse_formats(a.format)) {
      options.synthetic_format = f == BenchFormat::NVFP4 ? GemvWeight::NVFP4 : GemvWeight::BF16;
      fmt::print("{} over GPUs {}:\n", format_name(f), a.gpus);
      for (const CudaStage& s : cuda_pipeline_stages(model, options)) {
        // What the pre-upload check asks of this GPU: its weights, one sequence's state, its chunk workspaces.
        const CudaMemoryNeed need = cuda_memory_need(model, a.max_context, options, s.layer_begin, s.layer_end);
        fmt::print("  GPU {}: layers {:>2}..{:>2}, weights {:.2f} GB, state {:.2f} GB per sequence at context {}, "
                   "workspaces {:.2f} GB for prefill chunks of {}\n", s.device, s.layer_begin, s.layer_end - 1,
                   s.weight_bytes / 1e9, need.state_per_sequence / 1e9, a.max_context, need.workspaces / 1e9,
                   need.prefill_chunk);
        report["stages"][format_name(f)].push_back(
            {{"device", s.device}, {"layer_begin", s.layer_begin}, {"layer_end", s.layer_end},
             {"weight_bytes", s.weight_bytes}, {"state_bytes_per_sequence", need.state_per_sequence},
             {"workspace_bytes", need.workspaces}, {"prefill_chunk", need.prefill_chunk}});
      }
    }
  }
#endif
  for (BenchFormat f : parse_formats(a.format)) {
    const int64_t pos = decode_mean_position(a);
    const std::vector<CostLine> lines = decode_step_cost(config, f, pos);
    print_cost_table(lines, f, pos);
    json batches = json::array();
    for (int B : a.decode_batch) {
      const std::vector<CostLine> step = decode_step_cost(config, f, pos, B);
      fmt::print("  decode batch {:>2}: {:.2f} GB per step, {:.2f} GB per token\n", B, total_bytes(step) / 1e9,
                 total_bytes(step) / 1e9 / B);
      batches.push_back({{"batch", B}, {"bytes_per_step", total_bytes(step)}, {"flops_per_step", total_flops(step)}});
    }
    json prefill = json::array();
    for (int len : a.prefill) {
      const PrefillBounds b = prefill_bounds(config, f, len, a.prefill_chunk, 0);
      fmt::print("  prefill {:>6}: {:.2f} GFLOP/token -> compute bound {:.0f} tok/s; {:.2f} GB of weights per "
                 "{}-token chunk\n", len, b.flops_per_token / 1e9, b.compute_tok_s, b.weight_bytes_per_chunk / 1e9,
                 std::min(len, a.prefill_chunk));
      prefill.push_back({{"tokens", len}, {"flops_per_token", b.flops_per_token},
                         {"compute_bound_tok_s", b.compute_tok_s},
                         {"weight_bytes_per_chunk", b.weight_bytes_per_chunk}});
    }
    report["formats"][format_name(f)] = {{"decode_position", pos}, {"decode_bytes_per_token", total_bytes(lines)},
                                         {"decode_flops_per_token", total_flops(lines)},
                                         {"decode_components", cost_json(lines)}, {"decode_batches", batches},
                                         {"prefill", prefill}};
  }
  write_json(a, report);
  return 0;
}

#ifdef DSV4_HAVE_CUDA

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

void set_launch_mode(const std::string& mode) { gpu::set_dependent_launch(mode == "pdl"); }

std::vector<int32_t> random_tokens(std::mt19937_64& rng, int n, int vocab) {
  std::uniform_int_distribution<int32_t> pick(0, vocab - 1);
  std::vector<int32_t> ids(static_cast<size_t>(n));
  for (int32_t& id : ids) id = pick(rng);
  return ids;
}

size_t device_used_bytes() {
  size_t free_bytes = 0, total_bytes = 0;
  DSV4_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
  return total_bytes - free_bytes;
}

// GPU time per launch site of a profiled step or prefill, summed over the layers (and chunks), largest first.
json print_profile(const std::vector<LaunchTiming>& timings, const std::string& title, double reference_ms,
                   const char* reference_name) {
  struct Site {
    std::string name;
    int launches = 0, kernels = 0;
    double us = 0, max_us = 0;
  };
  std::vector<Site> sites;
  double total_us = 0;
  for (const LaunchTiming& t : timings) {
    auto it = std::find_if(sites.begin(), sites.end(), [&](const Site& s) { return s.name == t.site; });
    if (it == sites.end()) it = sites.insert(sites.end(), Site{t.site});
    ++it->launches;
    it->kernels += t.kernels;
    it->us += t.us;
    it->max_us = std::max(it->max_us, t.us);
    total_us += t.us;
  }
  std::sort(sites.begin(), sites.end(), [](const Site& x, const Site& y) { return x.us > y.us; });
  fmt::print("\nprofile of {} (direct launches, an event after each launch site): {:.3f} ms of GPU time in {} launch "
             "sites; {} took {:.3f} ms\n", title, total_us / 1e3, timings.size(), reference_name, reference_ms);
  fmt::print("  {:<44} {:>8} {:>8} {:>10} {:>9} {:>9} {:>7}\n", "site", "launches", "kernels", "total us",
             "mean us", "max us", "share");
  json out = {{"total_us", total_us}, {"reference_ms", reference_ms}, {"sites", json::array()}};
  for (const Site& s : sites) {
    fmt::print("  {:<44} {:>8} {:>8} {:>10.1f} {:>9.2f} {:>9.2f} {:>7.3f}\n", s.name, s.launches, s.kernels, s.us,
               s.us / s.launches, s.max_us, s.us / total_us);
    out["sites"].push_back({{"site", s.name}, {"launches", s.launches}, {"kernels", s.kernels}, {"total_us", s.us},
                            {"max_us", s.max_us}});
  }
  return out;
}

json bench_format(const BenchArgs& a, const Model& model, BenchFormat f, double bandwidth_gbs) {
  const ModelConfig& c = model.config();
  const double bandwidth = bandwidth_gbs * 1e9;
  CudaRunnerOptions options;
  options.synthetic_format = f == BenchFormat::NVFP4 ? GemvWeight::NVFP4 : GemvWeight::BF16;
  options.synthetic_seed = a.seed;
  options.sequences = *std::max_element(a.decode_batch.begin(), a.decode_batch.end());
  options.prefill_chunk = a.prefill_chunk;
  if (!a.gpus.empty()) options.devices = parse_cuda_devices(a.gpus);
  fmt::print("\n=== {} ===\n", format_name(f));
  std::fflush(stdout);
  auto start = std::chrono::steady_clock::now();
  std::unique_ptr<SequenceRunner> runner = make_cuda_runner(model, a.max_context, options);
  const CudaRunnerStats built = cuda_runner_stats(*runner);
  const size_t used = device_used_bytes();
  fmt::print("runner built in {:.1f} s: weights {:.2f} GB, workspaces {:.2f} GB, state {:.2f} GB; GPU memory in use "
             "{:.2f} GB of {:.2f} GB\n", seconds_since(start), built.weight_bytes / 1e9, built.workspace_bytes / 1e9,
             runner->state_bytes() / 1e9, used / 1e9, device_info().global_mem_bytes / 1e9);
  if (built.stages > 1)
    for (const CudaStage& s : cuda_runner_stages(*runner))
      fmt::print("  stage on GPU {}: layers {}..{}, weights {:.2f} GB\n", s.device, s.layer_begin, s.layer_end - 1,
                 s.weight_bytes / 1e9);
  json report = {{"weight_bytes", built.weight_bytes}, {"workspace_bytes", built.workspace_bytes},
                 {"state_bytes", runner->state_bytes()}, {"gpu_memory_used_bytes", used}};
  // --switches: each set is applied on top of the options the runner was built with.
  const CudaRunnerOptions built_options = cuda_runner_options(*runner);
  if (built_options.fp4_tiles) fmt::print("fp4 weights in the tile layout (DSV4_GEMV_TILES)\n");
  report["fp4_tiles"] = built_options.fp4_tiles;
  const GemvBulk built_bulk = gemv_bulk_mode();
  const bool built_w4a8 = gemv_w4a8_enabled();
  const gpu::EarlyWeights built_early = gpu::early_weights();
  const bool built_index_order = gpu::indexer_select_index_order();
  const int built_tiled_min = gemv_tiled_min_rows(), built_tiled_blocks = gemv_tiled_min_blocks_per_sm();
  const bool built_wgmma_ws = gemv_wgmma_ws_enabled(), built_persistent = gemv_wgmma_persistent_enabled();
  const bool built_f32_tiles = gpu::linear_f32_tiles(), built_slot_warps = moe_slots_by_warps();
  auto use_switches = [&](const std::string& spec) {
    const StepSwitches s = parse_switches(spec);
    CudaRunnerOptions o = built_options;
    o.overlap_branches = (o.overlap_branches || s.overlap) && !s.serial;
    o.fuse_mhc_mix = o.fuse_mhc_mix || s.mhc;
    o.fuse_moe_routing = o.fuse_moe_routing || s.routing;
    if (s.gate >= 0) o.fuse_moe_gate = s.gate == 1;
    if (s.post >= 0) o.fuse_mhc_post = s.post == 1;
    if (s.swiglu >= 0) o.swiglu_in_w1_w3_rows = s.swiglu == 1 ? 1 : CudaRunnerOptions::kNever;
    if (s.early_w2 >= 0) o.early_w2_weights = s.early_w2 == 1;
    if (s.qnorm >= 0) o.q_norm_in_attention_rows = s.qnorm == 1 ? 1 : CudaRunnerOptions::kNever;
    gpu::set_attention_decode_block_heads(s.attention_heads);
    gpu::set_hc_collapse_cluster(!s.hc_block);
    gpu::set_indexer_select_index_order(s.index_order >= 0 ? s.index_order == 1 : built_index_order);
    set_gemv_w4a8(built_w4a8 && !s.no_w4a8);
    set_gemv_tiled_min_rows(s.tiled_min ? s.tiled_min : built_tiled_min, built_tiled_blocks);
    set_gemv_forced_split(s.split);
    set_gemv_wgmma_ws(s.wgmma_ws >= 0 ? s.wgmma_ws == 1 : built_wgmma_ws);
    set_gemv_wgmma_persistent(s.persistent >= 0 ? s.persistent == 1 : built_persistent);
    set_gemv_over_gemm(!s.cublas_dense);
    gpu::set_linear_f32_tiles(built_f32_tiles || s.f32_tiles);
    set_moe_slots_by_warps(built_slot_warps || s.slot_warps);
    gpu::set_early_weights(s.late ? gpu::EarlyWeights::Off
                           : s.early_all ? gpu::EarlyWeights::All
                           : s.early && built_early == gpu::EarlyWeights::Off ? gpu::EarlyWeights::Gemv
                                                                               : built_early);
    cuda_runner_set_step_switches(*runner, o);
    set_gemv_bulk(s.bulk ? GemvBulk::All
                  : s.bulk_dense && built_bulk == GemvBulk::Off ? GemvBulk::Dense
                                                                : built_bulk);
  };
  std::mt19937_64 rng(a.seed);

  const int chunk = cuda_runner_prefill_chunk(*runner);
  report["prefill_chunk"] = chunk;
  fmt::print("\nprefill (last-row logits; chunks of {} tokens):\n", chunk);
  fmt::print("  {:>7} {:>9} {:>10} {:>13} {:>9} {:>15} {:>9}\n", "tokens", "seconds", "tok/s", "compute bound",
             "fraction", "weight-stream", "fraction");
  json prefill = json::array();
  for (const std::string& switches : a.switches) {
    use_switches(switches);
    if (a.switches.size() > 1) fmt::print("  [switches {}]\n", switches);
    for (int len : a.prefill) {
      runner->reset();
      // Warm-up with the first chunk's shape: a shorter one left the first timed 1K prefill ~4 % slow (H100: the
      // same switches gave 9366 and 9802 tok/s first and last in one process, docs/perf.md).
      runner->forward(random_tokens(rng, std::min(len, chunk), c.vocab_size), true);
      runner->reset();
      const std::vector<int32_t> prompt = random_tokens(rng, len, c.vocab_size);
      start = std::chrono::steady_clock::now();
      runner->forward(prompt, true);
      const double seconds = seconds_since(start);
      const double tok_s = len / seconds;
      const PrefillBounds b = prefill_bounds(c, f, len, chunk, bandwidth);
      fmt::print("  {:>7} {:>9.3f} {:>10.0f} {:>13.0f} {:>9.3f} {:>15.0f} {:>9.3f}\n", len, seconds, tok_s,
                 b.compute_tok_s, tok_s / b.compute_tok_s, b.streaming_tok_s, tok_s / b.streaming_tok_s);
      prefill.push_back({{"tokens", len}, {"switches", switches}, {"seconds", seconds}, {"tok_s", tok_s},
                         {"flops_per_token", b.flops_per_token}, {"compute_bound_tok_s", b.compute_tok_s},
                         {"fraction_of_compute_bound", tok_s / b.compute_tok_s},
                         {"weight_bytes_per_chunk", b.weight_bytes_per_chunk},
                         {"weight_streaming_bound_tok_s", b.streaming_tok_s},
                         {"fraction_of_weight_streaming_bound", tok_s / b.streaming_tok_s}});
    }
  }
  use_switches(a.switches.front());  // the prefill profile and the first decode timing run with the first set
  report["prefill"] = prefill;
  if (a.profile_prefill > 0) {
    runner->reset();
    const std::vector<int32_t> prompt = random_tokens(rng, a.profile_prefill, c.vocab_size);
    start = std::chrono::steady_clock::now();
    runner->forward(prompt, true);
    const double timed_ms = 1e3 * seconds_since(start);
    runner->reset();
    report["prefill_profile"] =
        print_profile(cuda_runner_profile_prefill(*runner, prompt),
                      fmt::format("a prefill of {} tokens in chunks of {}", a.profile_prefill, chunk), timed_ms,
                      "the same prefill timed with PDL");
  }

  runner->reset();
  if (a.decode_context > 0) runner->forward(random_tokens(rng, a.decode_context, c.vocab_size), true);
  // Batch 1 through forward() (the single-sequence path generate uses); larger batches are copies of sequence 0
  // at its current length, stepped together with decode_batch.
  json decodes = json::array();
  std::vector<int32_t> tokens = random_tokens(rng, 64, c.vocab_size);
  for (int B : a.decode_batch) {
    for (int b = 1; b < B; ++b) cuda_runner_copy_sequence(*runner, 0, b);
    std::vector<TokenDraw> draws(size_t(B), TokenDraw{1.0f, 1.0f, 0, 0, 0.0});
    std::uniform_real_distribution<double> uniform(0.0, 1.0);
    std::string draw = "none";
    auto step = [&] {
      const std::span<const int32_t> fed(tokens.data(), size_t(B));
      if (draw == "none") {  // no sampling cost: the next tokens are made up
        for (int b = 0; b < B; ++b) tokens[b] = int32_t((tokens[b] + 7919) % c.vocab_size);
        if (B == 1)
          runner->forward(fed, true);
        else
          cuda_runner_decode_batch(*runner, fed);
        return;
      }
      for (TokenDraw& d : draws) d.u = uniform(rng);
      // On the device, or (host) logits back and the rows drawn in parallel, as the runner is set below.
      if (B == 1) {
        tokens[0] = runner->forward_draw(fed, draws[0]);
      } else {
        const std::vector<int32_t> ids = cuda_runner_decode_batch_draw(*runner, fed, draws);
        std::copy(ids.begin(), ids.end(), tokens.begin());
      }
    };
    double first_mode_ms = 0;
    for (const std::string& mode : a.launch_modes)
    for (const std::string& run_draw : a.draws)
    for (const std::string& switches : a.switches) {
      draw = run_draw;
      use_switches(switches);
      cuda_runner_set_draw_on_device(*runner, draw == "device");
      set_launch_mode(mode);
      cuda_runner_drop_graphs(*runner);
      for (int i = 0; i < kDecodeWarmupSteps; ++i) step();  // the first step captures the graph of this batch size
      const int64_t pos = runner->n_tokens() + a.decode_steps / 2;
      start = std::chrono::steady_clock::now();
      for (int i = 0; i < a.decode_steps; ++i) step();
      const double seconds = seconds_since(start);
      const CudaRunnerStats stats = cuda_runner_stats(*runner);
      const int64_t kernels = stats.last_forward_replayed_graph ? stats.graph_kernels : stats.launches_last_forward;
      const std::vector<CostLine> lines = decode_step_cost(c, f, pos, B);
      const double bytes = total_bytes(lines), tok_s = double(B) * a.decode_steps / seconds;
      const double roofline = B * bandwidth / bytes;
      const bool first_run =
          mode == a.launch_modes.front() && draw == a.draws.front() && switches == a.switches.front();
      if (B == a.decode_batch.front() && first_run) print_cost_table(lines, f, pos, B);
      if (first_run) first_mode_ms = 1e3 * seconds / a.decode_steps;
      fmt::print("\ndecode batch {} at context {} [{}, draw {}, switches {}]: {:.1f} tok/s ({:.3f} ms/step), {} "
                 "kernels per step{}; roofline {:.1f} tok/s ({:.2f} GB/step at {:.0f} GB/s) -> {:.3f} of roofline\n",
                 B, pos, mode, draw, switches, tok_s, 1e3 * seconds / a.decode_steps, kernels,
                 stats.last_forward_replayed_graph ? " (graph replay)" : "", roofline, bytes / 1e9, bandwidth_gbs,
                 tok_s / roofline);
      decodes.push_back({{"batch", B}, {"launch_mode", mode}, {"draw", draw}, {"switches", switches},
                         {"context", a.decode_context},
                         {"steps", a.decode_steps}, {"mean_position", pos}, {"seconds", seconds}, {"tok_s", tok_s},
                         {"ms_per_step", 1e3 * seconds / a.decode_steps}, {"kernels_per_step", kernels},
                         {"graph_replay", stats.last_forward_replayed_graph}, {"bytes_per_step", bytes},
                         {"flops_per_step", total_flops(lines)}, {"components", cost_json(lines)},
                         {"roofline_tok_s", roofline}, {"fraction_of_roofline", tok_s / roofline}});
    }
    set_launch_mode(a.launch_modes.front());
    use_switches(a.switches.front());
    // The profiled step draws on the device when that was timed, so its table shows the draw kernel.
    cuda_runner_set_draw_on_device(*runner,
                                   std::find(a.draws.begin(), a.draws.end(), "device") != a.draws.end());
    if (a.profile)
      report[B == 1 ? std::string("decode_profile") : fmt::format("decode_profile_batch_{}", B)] =
          print_profile(cuda_runner_profile_step(*runner, std::span<const int32_t>(tokens.data(), B)),
                        fmt::format("one decode step at batch {}", B), first_mode_ms, "the graph step above");
  }
  report["decode"] = decodes;

  // Batch-1 steps drawn on the device with the first switches and launch mode (set once, below): ms per call of
  // `step`, after warm-up.
  const TokenDraw draw{1.0f, 1.0f, 0, 0, 0.5};
  auto time_steps = [&](auto&& step) {
    for (int i = 0; i < kDecodeWarmupSteps; ++i) step();
    start = std::chrono::steady_clock::now();
    for (int i = 0; i < a.decode_steps; ++i) step();
    return 1e3 * seconds_since(start) / a.decode_steps;
  };
  if (!a.verify_rows.empty() || a.mtp) {
    use_switches(a.switches.front());
    set_launch_mode(a.launch_modes.front());
    cuda_runner_set_draw_on_device(*runner, true);
  }
  // Speculative decoding's verify step at batch 1: K rows (the last token and K - 1 drafts) drawn on the device,
  // then the K - 1 drafts rolled back as if all were rejected (the rollback's full cost). A step that keeps j
  // drafts emits j + 1 tokens for this time, so its ratio to a decode step is what a kept draft must beat.
  json verifies = json::array();
  if (!a.verify_rows.empty()) {
    const double step_ms = time_steps([&] { runner->forward_draw(std::span<const int32_t>(tokens.data(), 1), draw); });
    fmt::print("\nverify steps at batch 1 (drawn on the device; all drafts rolled back), decode step {:.3f} ms:\n",
               step_ms);
    for (int K : a.verify_rows) {
      const std::vector<TokenDraw> draws(size_t(K), draw);
      const double ms = time_steps([&] {
        runner->forward_draw_rows(std::span<const int32_t>(tokens.data(), size_t(K)), draws);
        runner->rollback(runner->n_tokens() - (K - 1));
      });
      fmt::print("  {:>2} rows: {:.3f} ms = {:.2f} decode steps; with every draft kept {:.1f} tok/s ({:.2f}x)\n", K,
                 ms, ms / step_ms, K * 1e3 / ms, K * step_ms / ms);
      verifies.push_back({{"rows", K}, {"ms", ms}, {"decode_step_ms", step_ms}, {"steps_per_verify", ms / step_ms},
                          {"tok_s_all_kept", K * 1e3 / ms}});
    }
  }
  report["verify"] = verifies;
  // --mtp: a decode step followed by the MTP block's draft for the token it drew (what MTP speculation adds to each
  // step besides the verify's second row), against the decode step alone.
  if (a.mtp) {
    const double both_ms = time_steps([&] {
      const int32_t id = runner->forward_draw(std::span<const int32_t>(tokens.data(), 1), draw);
      runner->mtp_draft(std::span<const int32_t>(&id, 1));
    });
    const double step_ms = time_steps([&] { runner->forward_draw(std::span<const int32_t>(tokens.data(), 1), draw); });
    fmt::print("\nMTP draft at batch 1: decode step + draft {:.3f} ms, decode step {:.3f} ms: the draft costs {:.3f} "
               "ms = {:.3f} decode steps\n", both_ms, step_ms, both_ms - step_ms, (both_ms - step_ms) / step_ms);
    report["mtp_draft"] = {{"step_and_draft_ms", both_ms}, {"step_ms", step_ms}, {"draft_ms", both_ms - step_ms}};
  }
  set_gemv_bulk(built_bulk);
  return report;
}

int run_bench(const BenchArgs& a) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);  // progress reaches a redirected log even if the run is cut short
  DSV4_CHECK(cuda_available(), "dsv4 bench: no usable CUDA device");
  const DeviceInfo info = device_info();
  fmt::print("device: {}, {} SMs, {:.1f} GB\n", info.name, info.sm_count, info.global_mem_bytes / 1e9);
  const double bandwidth_gbs = measure_copy_bandwidth_gbs();
  fmt::print("copy bandwidth (2 GiB copy kernel, read + write): {:.0f} GB/s\n", bandwidth_gbs);
  set_launch_mode(a.launch_modes.front());

  auto start = std::chrono::steady_clock::now();
  ModelConfig config = flash_shaped_config(a.experts);
  ModelWeights weights = synthetic_weights(config, a.seed, SyntheticLinears::ShapeOnly, a.mtp);
  Numerics numerics;
  numerics.act = parse_act_quant(a.act_quant);
  const Model model(std::move(config), std::move(weights), numerics);
  fmt::print("model: {} (host tensors built in {:.1f} s); activations of the FP8/FP4 linears: {}\n",
             model.config().summary(), seconds_since(start), a.act_quant);

  json report = args_json(a, model.config());
  report["device"] = info.name;
  report["copy_bandwidth_gbs"] = bandwidth_gbs;
  // One runner at a time: BF16 with 32 experts alone takes ~85 GB.
  for (BenchFormat f : parse_formats(a.format)) report["formats"][format_name(f)] =
      bench_format(a, model, f, bandwidth_gbs);
  write_json(a, report);
  return 0;
}

#else

int run_bench(const BenchArgs&) { DSV4_FAIL("dsv4 bench needs a CUDA build (configure with -DDSV4_CUDA=ON)"); }

#endif

}  // namespace

void add_bench_command(CLI::App& app, Handler& handler) {
  auto args = std::make_shared<BenchArgs>();
  CLI::App* cmd = app.add_subcommand("bench", "Benchmark a random model with the V4-Flash shapes on the GPU: prefill "
                                              "and decode tokens/s against their rooflines");
  cmd->add_option("--format", args->format, "Linear-layer weight format: nvfp4, bf16 or both (one after the other)")
      ->capture_default_str()->check(CLI::IsMember({"nvfp4", "bf16", "both"}));
  cmd->add_option("--experts", args->experts, "Routed experts per layer (>= 6; Flash has 256, which do not fit one "
                                              "GPU; batch-1 decode reads 6 whatever the count)")
      ->capture_default_str();
  cmd->add_option("--prefill", args->prefill, "Prompt lengths to time, comma-separated")
      ->delimiter(',')->capture_default_str();
  cmd->add_option("--decode-context", args->decode_context, "Tokens prefilled before the timed decode steps")
      ->capture_default_str();
  cmd->add_option("--decode-steps", args->decode_steps, "Timed decode steps per batch size")->capture_default_str();
  cmd->add_option("--decode-batch", args->decode_batch,
                  "Decode batch sizes to time, comma-separated (sequences at the decode context, one token each "
                  "per step)")
      ->delimiter(',')->capture_default_str();
  cmd->add_option("--max-context", args->max_context,
                  "Tokens of state preallocated (default: the longest prompt or decode context + steps)");
  cmd->add_option("--prefill-chunk", args->prefill_chunk,
                  "Tokens per prefill chunk (a multiple of 64 up to 4096; each chunk reads the weights of every "
                  "expert it touches once)")
      ->capture_default_str();
  cmd->add_option("--seed", args->seed, "Seed of the weights and token ids")->capture_default_str();
  cmd->add_option("--json", args->json_path, "Also write every number to this JSON file");
  cmd->add_option("--act-quant", args->act_quant,
                  "Inputs of the FP8/FP4 linears: none, or fp8 (official numerics; with DSV4_GEMV_TILES=0 NVFP4 "
                  "decode runs the W4A8 kernel)")
      ->capture_default_str()->check(CLI::IsMember({"none", "fp8"}));
  cmd->add_option("--launch-modes", args->launch_modes,
                  "Decode timed in each mode: pdl (programmatic dependent launch, the default) or plain (serialised "
                  "launches), e.g. pdl,plain")
      ->delimiter(',')->capture_default_str()->check(CLI::IsMember({"pdl", "plain"}));
  cmd->add_option("--draws", args->draws,
                  "Decode also timed with each way of drawing the next tokens (temperature 1): none (the default: "
                  "nothing comes back), host (logits back, host Sampler) or device (drawn on the GPU), e.g. "
                  "none,host,device")
      ->delimiter(',')->capture_default_str()->check(CLI::IsMember({"none", "host", "device"}));
  cmd->add_option("--switches", args->switches,
                  "Decode (and prefill) also timed with each set of step switches: default (as built), or names "
                  "joined by '+': "
                  "bulk (fp4 / fp8 GEMVs through the copy engine), bulkdense (the same but not for the grouped "
                  "experts), overlap (the attention state side on a second "
                  "stream; serial: off), mhc (hc_post with the next mix), routing (router + slots in one launch), "
                  "qnorm / noqnorm (q norm + RoPE inside attention in every chunk / in none), heads16 / heads64 "
                  "(decode attention blocks of 16 / 64 heads), hcblock (hc_pre's decode collapse in one block per "
                  "token), now4a8 (--act-quant fp8 at batch 1 without the W4A8 kernel: x quantised first, then the "
                  "bf16 kernel), early / earlyall / late (GEMVs / also linear_f32 and hc_pre's mix / nothing load "
                  "their first weights before waiting for the previous kernel), "
                  "gate / nogate (router gate, router and moe_slots in one launch or three), post / nopost (mHC post "
                  "inside the next hc_pre or apart), swiglu / noswiglu (the experts' SwiGLU inside the grouped w1 + w3 "
                  "or apart), earlyw2 / noearlyw2 (the experts' w2 loads weights before its wait), indexorder / "
                  "scoreorder (the indexer's picks in index or score order), tiledN (calls of >= N rows, N = 2..65, "
                  "on the tiled tensor-core GEMM where their grid fills the GPU), split1 / 2 / 4 / 8 (every skinny "
                  "GEMV at that split_k), ws / nows (the fp4 prefill GEMMs' wgmma kernel warp-specialised or not), "
                  "cublasdense (prefill's dense fp4 linears all through cuBLASLt), f32tiles (prefill's fp32 linears "
                  "on 32-row cluster tiles), slotwarps (moe_slots placed by every warp); prefill is timed with each "
                  "set as well, e.g. "
                  "default,bulk,overlap,mhc+routing+qnorm,bulk+overlap+mhc+routing+qnorm,heads64")
      ->delimiter(',')->capture_default_str();
  cmd->add_flag("--mtp", args->mtp,
                "Give the model a synthetic MTP block and time a decode step followed by the block's draft");
  cmd->add_option("--verify-rows", args->verify_rows,
                  "Also time speculative decoding's verify step of K rows at batch 1 (K - 1 drafts, drawn on the "
                  "device and rolled back), e.g. 2,4,8,17")
      ->delimiter(',');
  cmd->add_flag("--profile", args->profile,
                "After the timed decode steps, time every launch site of one more step (events, no graph)");
  cmd->add_option("--profile-prefill", args->profile_prefill,
                  "After the timed prefills, time every launch site of a prefill of this many tokens");
  cmd->add_option("--gpus", args->gpus,
                  "Split the layers over these GPUs, in order (e.g. 0,1: --experts 256 needs two H200s or four "
                  "H100s); with --plan-only, print the split");
  cmd->add_flag("--plan-only", args->plan_only,
                "Print the bytes / FLOPs accounting only (no GPU needed)");
  cmd->callback([&handler, args] {
    handler = [args] {
      validate(*args);
      return args->plan_only ? run_plan(*args) : run_bench(*args);
    };
  });
}

}  // namespace dsv4::cli
