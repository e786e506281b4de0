// SPDX-License-Identifier: MIT
// The DeepSeek-V4 forward pass's kernels other than the linear layers (those are gemv.h). Each launcher takes one
// params struct of raw device pointers, checks nothing the caller already knows, and enqueues on `stream`
// (asynchronous; launch errors are thrown as dsv4::Error). Activations are fp32 row-major; "bf16" buffers hold
// uint16_t bit patterns (round to nearest even). The CPU reference these reproduce is src/model/model.cpp and
// src/cpu/ops.h; section numbers refer to the architecture spec.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "formats/token_draw.h"

namespace dsv4::gpu {

// Simulated storage rounding applied to a row after norm / RoPE (cpu::round_kv, cpu::round_indexer).
enum class RowRound {
  None,
  Bf16,        // every element -> bf16
  KvFp8,       // first dim - rope_dim elements -> e4m3 in blocks of 64 (pow2 scale), last rope_dim -> bf16
  IndexerFp4,  // Hadamard (dim a power of two), then e2m1 in blocks of 32 (pow2 scale)
};

// Row-wise  y = round(rope(rms_norm(x)))  over rows (token t, head h), each of `dim` values:
//   x[t * x_token_stride + h * x_head_stride + i],  y likewise with the y strides (y == x allowed).
//   norm:  x · (mean(x²) + eps)^-½ · weight (weight nullptr = 1), sum of squares in fp64 like cpu::rms_norm.
//   rope:  interleaved RoPE on the last rope_dim values at position pos0 + t · pos_step, angles fp32
//          position · inv_freq[i] (inv_freq: device [rope_dim/2]); `inverse` rotates backwards. rope_dim 0 = none.
//   y_bf16: optional contiguous [tokens · heads, dim] bf16 copy of y.
// dim <= 4096 (< 4096 when dim - rope_dim is odd); KvFp8 needs (dim - rope_dim) % 64 == 0, IndexerFp4 a
// power-of-two dim >= 32 and an even rope_dim. The FP8 / FP4 rounding is bit-identical to src/formats'
// fp8_simulate_block / fp4_simulate_block.
// Graph-replayable decode: pos_device (when set) replaces pos0 with a position read on the device, and
// emit_ratio = r > 0 (one row, tokens = heads = 1) finishes a compressor entry only on the steps that complete
// one: when (pos + 1) % r == 0 the row is entry b = pos / r (x and y advanced by b row strides, RoPE at b·r),
// otherwise the launch does nothing. Batched decode (rows of different sequences): pos_rows (device, [tokens])
// gives token t its own position and replaces pos0 + t · pos_step. Batched entry finishing: emit_ratio with
// pos_rows and rows_base (device table) finishes row t's entry pos_rows[t] / r in rows_base[t] (x = y, strides as
// above) on the steps that complete it, one launch for all rows.
struct RowOpParams {
  const float* x = nullptr;
  int64_t x_token_stride = 0, x_head_stride = 0;
  float* y = nullptr;  // may be nullptr when only y_bf16 is wanted
  int64_t y_token_stride = 0, y_head_stride = 0;
  uint16_t* y_bf16 = nullptr;
  int tokens = 0, heads = 1, dim = 0;
  bool norm = false;
  const float* weight = nullptr;
  float eps = 1e-6f;
  int rope_dim = 0;
  const float* inv_freq = nullptr;
  int64_t pos0 = 0;
  int pos_step = 1;
  bool inverse = false;
  RowRound round = RowRound::None;
  const int64_t* pos_device = nullptr;
  int emit_ratio = 0;
  const int64_t* pos_rows = nullptr;
  float* const* rows_base = nullptr;
};
void row_op(const RowOpParams& p, cudaStream_t stream);
// a and b (independent: neither reads what the other writes) in one launch; rows of <= 32 threads as row_op runs
// them (several per block), wider ones one per block.
void row_op_pair(const RowOpParams& a, const RowOpParams& b, cudaStream_t stream);

// y[m, n] = scale · x[m, k] · W[n, k]ᵀ in fp32 (small fp32 matrices: mHC mixes, router gate, indexer weights).
// The sums are reordered (per-thread FMA chains, then shuffle / block / cluster trees; the order depends only on
// the shape and the SM count, so results are reproducible): |error| <= ~(k / 64 + 16) · 2^-24 · Σ|x·w|.
// Decode-sized grids split k over up to 8 blocks of one thread-block cluster (sm_90); from 64 rows (prefill) a
// block keeps 4 rows x up to 32 columns of outputs in registers, so x is read once per 32 columns, or, with
// set_linear_f32_tiles, computes 32 rows x up to 32 columns over an eighth of k (a cluster of 8 adds the eighths),
// so W is read once per 32 rows as well.
struct LinearF32Params {
  const float* x = nullptr;
  const float* w = nullptr;
  float* y = nullptr;
  int m = 0, n = 0, k = 0;
  float scale = 1.0f;
};
void linear_f32(const LinearF32Params& p, cudaStream_t stream);
// The 32-row cluster tiles for prefill-sized linear_f32 calls instead of the 4-row blocks. On by default (prefill
// +3–5 % at chunks of 2048, H100, docs/perf.md twenty-second round). Process-wide, read at launch;
// DSV4_LINEAR_F32_TILES=0/1 in the environment sets it at the first call (bench switch f32tiles).
void set_linear_f32_tiles(bool on);
bool linear_f32_tiles();

// 2.1: streams[t, k, :] = embed[tokens[t], :] for each of the hc streams. embed bf16 [vocab, D].
void embed_tokens(const uint16_t* embed, const int32_t* tokens, int n, int D, int hc, float* streams,
                  cudaStream_t stream);

// 2.3 mHC pre + the sublayer's RMSNorm: from mix = streams · fnᵀ [n, (2+hc)·hc] and streams [n, hc, D]:
//   rs = (mean over hc·D of streams²+eps)^-½; pre_k = σ(mix_k·rs·scale0 + base_k) + hc_eps;
//   post_k = 2σ(mix_{hc+k}·rs·scale1 + base_{hc+k}); comb = Sinkhorn(softmax rows(...) + hc_eps);
//   normed = rms_norm(Σ_k pre_k · streams_k, norm_weight). Outputs post [n, hc], comb [n, hc, hc],
//   normed fp32 [n, D] and/or bf16 [n, D] (either may be nullptr). hc <= 8, D <= 12032.
// The gate arguments, the collapse and every Sinkhorn row / column sum round like the CPU's fp32 expressions
// (only expf may differ by its last bits); Sinkhorn normalises the columns once even for sinkhorn_iters = 0, like
// the reference.
// mix_partials (instead of mix): the mix as hc_post_mix leaves it, [n, (2+hc)·hc, mix_blocks] partial sums that
// hc_pre adds in block order (hc <= 4).
// parts: both halves (one launch, the default), or only the collapse + norm (normed outputs; post and comb untouched)
// or only post + comb (the Sinkhorn; normed untouched). The sublayer needs only the collapse; post and comb are read
// by hc_post at its end, so a runner can launch the two halves on different streams (the same arithmetic).
enum class HcPreParts { Both, Collapse, PostComb };
struct HcPreParams {
  const float* streams = nullptr;
  const float* mix = nullptr;
  const float* base = nullptr;   // [(2+hc)·hc]
  const float* scale = nullptr;  // [3]
  const float* norm_weight = nullptr;
  int n = 0, hc = 0, D = 0, sinkhorn_iters = 0;
  float hc_eps = 1e-6f, eps = 1e-6f;
  float* post = nullptr;
  float* comb = nullptr;
  float* normed = nullptr;
  uint16_t* normed_bf16 = nullptr;
  const float* mix_partials = nullptr;
  int mix_blocks = 0;
  HcPreParts parts = HcPreParts::Both;
  // fn (instead of mix and mix_partials): the mix weights [(2+hc)·hc, hc·D] fp32; hc_pre computes the mix = streams ·
  // fnᵀ itself and writes it to mix_out [n, (2+hc)·hc] (where a later PostComb launch reads it as mix). Not with
  // parts PostComb. In the collapse's cluster where there is one (see the return value), else a linear_f32 launch
  // first (the same contract).
  const float* fn = nullptr;
  float* mix_out = nullptr;
  // prev_out (not with parts PostComb): the previous sublayer's mHC post first, hc_post(prev_out, prev_out_k,
  // prev_out2, post, comb, ..., streams), with the post and comb the previous hc_pre left (read before this call's
  // post + comb replace them). Inside the cluster collapse, which updates its own columns of the streams as it loads
  // them (the same arithmetic, one launch fewer); elsewhere an hc_post launch first.
  const float* prev_out = nullptr;
  int prev_out_k = 0;
  const float* prev_out2 = nullptr;
};
// Returns the kernels it launched: decode-sized chunks (n < 64, hc == 4, D % 64 == 0, 16-byte aligned rows) collapse
// in a cluster of 16 blocks per token, so both halves are two launches there (each part alone one); otherwise one,
// plus the mix's launch when fn is given, plus hc_post's when prev_out is given.
int hc_pre(const HcPreParams& p, cudaStream_t stream);
// Off: the collapse of decode-sized chunks runs in one block per token as well (A/B timing; process-wide).
void set_hc_collapse_cluster(bool on);

// 2.4 mHC post:  streams[t, k] <- post[t, k] · (o_t) + Σ_j comb[t, j, k] · streams[t, j]  with
//   o_t = (Σ_{i < out_k} out[t · out_k + i]) + out2[t]
// (out [n, out_k, D]: the routed experts' per-pick outputs, summed in pick order; out2 optional: the shared
// expert's output).
void hc_post(const float* out, int out_k, const float* out2, const float* post, const float* comb, int n, int hc,
             int D, float* streams, cudaStream_t stream);

// hc_post and the next mHC mix in one launch, for decode-sized chunks: streams updated as hc_post does, then
// partials[t, m, b] = Σ over block b's columns of streams[t] · fn[m]ᵀ (the updated streams; fn [n_mix, hc·D] fp32,
// the next sublayer's mHC mix weights), one 32-thread block per 128 columns of every stream and token, so the 1.5 MB
// of fn are read by D / 128 SMs at once. hc_pre (HcPreParams::mix_partials) adds the blocks in order: the mix costs
// no launch of its own. hc == 4, n_mix <= 24, D % 4 == 0 and 16-byte aligned out / out2 / streams / fn.
struct HcPostMixParams {
  const float* out = nullptr;
  int out_k = 1;
  const float* out2 = nullptr;
  const float* post = nullptr;
  const float* comb = nullptr;
  int n = 0, hc = 0, D = 0;
  float* streams = nullptr;
  const float* fn = nullptr;
  int n_mix = 0;
  float* partials = nullptr;  // [n, n_mix, hc_post_mix_blocks(D)]
};
int hc_post_mix_blocks(int D);
void hc_post_mix(const HcPostMixParams& p, cudaStream_t stream);

// 2.5 + 5: final collapse y = Σ_k (σ(mix_k·rs·scale0 + base_k) + hc_eps) · streams_k, then rms_norm(y, norm_weight)
// written as bf16 [n, D] (the head GEMM's input). mix [n, hc]. hc <= 8, D <= 12032.
void hc_head_norm(const float* streams, const float* mix, const float* base, const float* scale,
                  const float* norm_weight, int n, int hc, int D, float hc_eps, float eps, uint16_t* y_bf16,
                  cudaStream_t stream);

// 3.5 compressor advance (reference partial-state layout, see model/state.h) over a chunk of n tokens at
// positions pos0..: row (overlap ? r + i : i), i = p % r, gets kv_in[t] / gate_in[t] + ape[i]; when (p+1) % r == 0
// the softmax-pooled entry b = p / r is written (un-normalised) to entries[b]; overlapped states then shift the
// current block into the previous-block rows. Columns are independent, so one thread owns a column pair.
struct CompressorParams {
  const float* kv_in = nullptr;    // [n, width] with row stride in_stride
  const float* gate_in = nullptr;  // [n, width] with row stride in_stride
  int64_t in_stride = 0;
  const float* ape = nullptr;      // [ratio, width]
  float* state_kv = nullptr;       // [rows, width]
  float* state_score = nullptr;    // [rows, width]
  float* entries = nullptr;        // [max_entries, dim]
  int ratio = 0, dim = 0, n = 0;
  bool overlap = false;
  int64_t pos0 = 0;
  const int64_t* pos_device = nullptr;  // when set, pos0 is read here (graph replay)
  // Batched decode (state_kv_rows set): row t < n of kv_in / gate_in is one token of its own sequence, at
  // pos_rows[t], with that sequence's state_kv_rows[t], state_score_rows[t] and entries_rows[t].
  const int64_t* pos_rows = nullptr;
  float* const* state_kv_rows = nullptr;
  float* const* state_score_rows = nullptr;
  float* const* entries_rows = nullptr;
};
void compressor_advance(const CompressorParams& p, cudaStream_t stream);
// Only the partial-block state compressor_advance leaves after rows pos0 .. pos0 + n - 1 (the same bits; no entry
// is written, p.entries is not read; plain launches, n >= 1): speculative decoding's rollback rebuilds a state from
// the one saved before a verify step and the kept rows of its input.
void compressor_state(const CompressorParams& p, cudaStream_t stream);
// compressor_state for `count` compressors in one launch (a rollback rebuilds ~60): table[i] (a device array; plain,
// not batched) with n and pos0 replaced by the arguments. max_width >= every (overlap ? 2 : 1) · dim. Same bits.
void compressor_states(const CompressorParams* table, int count, int n, int64_t pos0, int max_width,
                       cudaStream_t stream);
// dst[r · dst_ld + c] = src[r · src_ld + c] for r < rows, c < width (a kernel, so programmatic launches stay chained;
// the CUDA runner keeps a verify step's compressor input rows with it).
void copy_rows(float* dst, int64_t dst_ld, const float* src, int64_t src_ld, int rows, int width, cudaStream_t stream);

// 3.6 lightning indexer, for query t at p = pos0 + t and its n_visible = min((p+1) / ratio, max_entries) keys s:
//   indexer_scores writes scores[t, s] = Σ_h w_scale · w[t, h] · max(q[t, h] · keys[s], 0) for s < n_visible
//     (fp32, summation order unspecified) and nothing else. heads · dim <= 12288, dim % 32 == 0, dim <= 512.
//   indexer_select reads scores[t, 0..n_visible) and writes selected[t, 0..min(topk, n_visible)) = the indices of
//     the largest scores, ties lower index first (the set of cpu::top_k_indices of that row), in descending score
//     order (exactly cpu::top_k_indices'), or with set_indexer_select_index_order(true) (the default) in ascending
//     index order (no sort of the candidates, which took ~40 % of the select; the attention's sum does not depend on
//     the order beyond fp32 rounding). n_visible <= topk selects every key. The rest of the row is not written
//     (n_visible 0: nothing). topk <= 2048; rows longer than shared memory holds (16384) are ranked from scores
//     itself, same result.
//   indexer_topk = indexer_scores, then indexer_select.
//   bf16_exact: the caller promises that every q and key value is a bf16 value (the official FP4 / bf16 storage of
//     the indexer's q and keys), so the products may run on bf16 tensor cores with fp32 sums, exactly the
//     reference's einsum (spec 8.1). indexer_scores then takes the mma.sync kernel for chunks of >= 16 queries of one
//     sequence at the V4 shape (64 heads x 128, rows 8-byte aligned); everything else runs the fp32 CUDA-core kernel.
// scores is scratch [n, max_entries]. Both size their grids from n, max_entries and topk only, so a graph replays
// them with pos_device.
struct IndexerTopkParams {
  const float* q = nullptr;  // q[t * q_token_stride + h * dim + i]
  int64_t q_token_stride = 0;
  const float* w = nullptr;  // [n, heads]
  float w_scale = 1.0f;
  const float* keys = nullptr;  // [max_entries, dim]
  float* scores = nullptr;
  int32_t* selected = nullptr;  // [n, topk]
  int n = 0, heads = 0, dim = 0, ratio = 0, topk = 0, max_entries = 0;
  int64_t pos0 = 0;
  const int64_t* pos_device = nullptr;  // when set, pos0 is read here (graph replay)
  // Batched decode (keys_rows set): query t is its own sequence's token at pos_rows[t] with keys keys_rows[t].
  const int64_t* pos_rows = nullptr;
  const float* const* keys_rows = nullptr;
  bool bf16_exact = false;
};
void indexer_scores(const IndexerTopkParams& p, cudaStream_t stream);
bool indexer_scores_on_tensor_cores(const IndexerTopkParams& p);  // which kernel indexer_scores takes for p
void indexer_select(const IndexerTopkParams& p, cudaStream_t stream);
// The order of indexer_select's picks: ascending index (on, the default: +2.6 % at batch 1 on the H100, docs/perf.md
// sixteenth round) or descending score (off; process-wide; DSV4_INDEX_ORDER=0 in the environment at the first call).
void set_indexer_select_index_order(bool on);
bool indexer_select_index_order();
void indexer_topk(const IndexerTopkParams& p, cudaStream_t stream);

// 3.7/3.8 attention with sink, one shared K = V head, for query t at p = pos0 + t and head h:
//   keys = window positions max(0, p-window+1)..p (this chunk's rows from kv_chunk, older ones from the ring
//   window_ring[s % window_slots]) ∪ compressed entries (selected[t, :min(topk, (p+1)/ratio)] when selected != nullptr,
//   else all (p+1)/ratio; none when ratio == 0);
//   o = Σ_j softmax_j(q·k_j·scale | sink_h) k_j, then inverse RoPE at p on the last rope_dim dims.
// Output bf16, grouped for the output projection: head h of token t goes to out[g][t][(h % hpg)·dim + i] with
// hpg = heads / groups, g = h / hpg  (layout [groups, out_rows, hpg·dim], out_rows = n unless set: a call for
// one sequence's rows of a batched decode writes its rows of the whole batch's array). dim <= 512, dim % 32 == 0.
// When the launch's blocks do not fill the GPU (decode), the keys of each (token, head) are split over
// attention_splits(p) blocks: the tensor-core kernel merges their partials within a thread-block cluster; the
// CUDA-core kernels write them to `scratch` (attention_scratch_floats(p) floats) and merge in a second launch. The kernel (tensor cores for dim 512 / 128; else per head, or 16 heads per block from
// n · heads >= 512) and the split count depend only on host-known fields (n, heads, window, ratio, topk or max_entries), so graph replays keep their shape.
struct AttentionParams {
  const float* q = nullptr;  // q[t * q_token_stride + h * dim + i]
  int64_t q_token_stride = 0;
  const float* kv_chunk = nullptr;  // [n, dim]
  float* window_ring = nullptr;  // [window_slots, dim]
  int window_slots = 0, window = 0;
  const float* compressed = nullptr;  // [max_entries, dim]
  int ratio = 0;
  const int32_t* selected = nullptr;  // [n, topk]
  int topk = 0;
  const float* sink = nullptr;  // [heads]
  const float* inv_freq = nullptr;
  int rope_dim = 0;
  int n = 0, heads = 0, dim = 0, groups = 1;
  int64_t pos0 = 0;
  float scale = 1.0f;
  uint16_t* out = nullptr;
  const int64_t* pos_device = nullptr;  // when set, pos0 is read here (graph replay)
  int max_entries = -1;       // capacity of `compressed` (keys when selected == nullptr; 0: context < ratio)
  int out_rows = 0;           // rows per group of `out` (0 = n)
  float* scratch = nullptr;   // split partials, see above
  // Batched decode (window_rings set): row t is the one new token of its own sequence, at position pos_rows[t],
  // with that sequence's ring window_rings[t] and compressed entries compressed_rows[t] (device pointer tables;
  // window_ring / compressed / pos0 / pos_device are then unused). kv_chunk row t is the token's own key.
  const int64_t* pos_rows = nullptr;
  float* const* window_rings = nullptr;
  const float* const* compressed_rows = nullptr;
  // Decode (n == 1, or batched rows): also store each row's own key (kv_chunk row t) into its ring slot
  // pos % window_slots, like window_store, in the same launch. The slot holds a position the window no longer
  // covers (window_slots >= window, or the position is below window_slots), so no query of the launch reads it.
  bool store_window = false;
  // q as the q-side projection left it: the tensor-core kernel applies the per-head norm (no weight, q_eps, sum of
  // squares in fp64) and RoPE (rope_dim, inv_freq, the row's position) itself, as the q row op would, before the bf16
  // rounding: one launch fewer per layer. Tensor-core kernel only (attention_uses_tensor_cores), and
  // (dim - rope_dim) % 4 == 0.
  bool q_norm_rope = false;
  float q_eps = 1e-6f;
};
// Numerics: the CUDA-core kernels use fp32 q, keys and weights. Dim 512 or 128 (attention_uses_tensor_cores: the
// models' head dims, decode and prefill) runs a tensor-core kernel with the reference's precisions (spec 8.1): logits from
// bf16(q) · bf16(key) with fp32 sums, probabilities rounded to bf16 for P·V, bf16 values, fp32 accumulation;
// the softmax max, sums and normalisation stay fp32.
void attention(const AttentionParams& p, cudaStream_t stream);
bool attention_uses_tensor_cores(const AttentionParams& p);
// Whether AttentionParams::q_norm_rope is available for this head dim and rope_dim.
bool attention_can_norm_q(int dim, int rope_dim);
int attention_splits(const AttentionParams& p);
size_t attention_scratch_floats(const AttentionParams& p);
// Heads per block of the tensor-core kernel for p (0: a CUDA-core kernel runs). Decode rows take 16 heads per block
// while the launch fits two blocks per SM, else 64; both give the same bits. set_attention_decode_block_heads forces
// 16 or 64 for decode rows (0: the rule), for tests and A/B timing (process-wide).
int attention_block_heads(const AttentionParams& p);
void set_attention_decode_block_heads(int heads);

// 3.4 window ring: window[(pos0 + t) % slots] = kv_chunk[t] for the last min(n, slots) rows of the chunk
// (pos0 read from pos_device when that is set).
void window_store(const float* kv_chunk, int n, int dim, int64_t pos0, const int64_t* pos_device, float* window,
                  int slots, cudaStream_t stream);
// 4.1 router: from logits = x · gateᵀ [n, E]: s = sqrt(softplus) | sigmoid | softmax (scoring 0 | 1 | 2);
// picks = tid2eid[tokens[t]] (hash layers, tid2eid != nullptr) or top-k of s + bias (descending, ties lower index);
// weights = (norm_topk ? s / Σ_picks s : s) · routed_scale. Outputs ids / weights [n, k]. E <= 1024.
struct RouterParams {
  const float* logits = nullptr;
  const float* bias = nullptr;
  const int32_t* tid2eid = nullptr;  // [vocab, k]
  const int32_t* tokens = nullptr;   // [n]
  int n = 0, experts = 0, k = 0, scoring = 0;
  bool norm_topk = true;
  float routed_scale = 1.0f;
  int32_t* ids = nullptr;
  float* weights = nullptr;
};
void router(const RouterParams& p, cudaStream_t stream);

// 4.2 SwiGLU between an expert's up projections (gemv / gemv_grouped outputs) and its down projection:
//   h[r, j] = silu(min(gate[r, j], limit)) · clamp(up[r, j], ±limit) · (weights ? weights[r] : 1)   (limit 0 = none)
// gate / up fp32 rows of stride ld (a fused [w1 | w3] output: up = gate + inter); h bf16 [rows, inter] (the
// down projection's input).
struct SwigluParams {
  const float* gate = nullptr;
  const float* up = nullptr;
  int64_t ld = 0;
  const float* weights = nullptr;  // [rows] routing weights, or nullptr (shared expert)
  int rows = 0, inter = 0;
  float limit = 0.0f;
  uint16_t* h = nullptr;
  // Let the next kernel start only after this one's wait for the previous kernel: the next one may then read before
  // its own wait anything written two launches back (GemvGroupedParams::slots_settled).
  bool trigger_after_wait = false;
};
void swiglu(const SwigluParams& p, cudaStream_t stream);

// 5 (MTP input) RMSNorm of rows into bf16: y[r, :] = bf16(x_r · rsqrt(mean(x_r²) + eps) · weight), with x_r = x[r · ld, ..]
// fp32, or (table set) the bf16 row table[ids[r]] (the embedding). Sum of squares in fp64, products rounded like
// cpu::rms_norm (x · inv_rms, then · weight). One block per row; any dim.
struct RmsNormRowsParams {
  const float* x = nullptr;
  int64_t ld = 0;
  const uint16_t* table = nullptr;  // instead of x: bf16 rows gathered by ids
  const int32_t* ids = nullptr;
  int rows = 0, dim = 0;
  const float* weight = nullptr;
  float eps = 1e-6f;
  uint16_t* y_bf16 = nullptr;  // [rows, dim]
};
void rms_norm_rows(const RmsNormRowsParams& p, cudaStream_t stream);
// streams[t, k, :] += e[t, :] for each of the hc streams (fp32 adds): the MTP block's input, X' = h_proj(..) + e_proj(..).
void add_to_streams(float* streams, const float* e, int n, int hc, int D, cudaStream_t stream);

// Fills n floats with value (state reset: compressor scores start at -inf).
void fill_f32(float* x, int64_t n, float value, cudaStream_t stream);

// dst[i] = src[i] for i < count, for each of n_spans spans (a device array) in one launch: the CUDA runner's
// snapshot of a sequence's ~100 compressor buffers before a forward it may roll back.
struct CopySpan {
  float* dst;
  const float* src;
  int64_t count;
};
void copy_spans(const CopySpan* spans, int n_spans, cudaStream_t stream);

// The next token of each row by the draw contract of formats/token_draw.h (the same id as the host's
// Sampler::draw for the same logits and TokenDraw): ids[r] is drawn from logits[r · ld, r · ld + n) with draws[r],
// where n = draws[r].vocab when it is set (at most `vocab`), else `vocab`. One block of 1024 threads per row: the
// maximum, then (top-k) a radix select of the k-th logit on counts and (top-p) one of the nucleus boundary on the
// fixed-point weights, 4 passes of 8 bits each, then the draw by per-warp segment sums and one warp's walk. Weights
// are integers, so the result does not depend on the order of the sums.
struct DrawTokensParams {
  const float* logits = nullptr;     // device [rows, ld] fp32
  int64_t ld = 0;
  int vocab = 0;
  int rows = 0;
  const TokenDraw* draws = nullptr;  // device [rows]
  int32_t* ids = nullptr;            // device [rows]
};
void draw_tokens(const DrawTokensParams& p, cudaStream_t stream);

// Programmatic dependent launch of the forward-pass kernels (launch.cuh), on by default. Graphs keep the mode they
// were captured with; benchmarks switch it off to measure what it saves.
void set_dependent_launch(bool on);
bool dependent_launch();

// Kernels whose first loads are weights issue them before waiting for the previous kernel of the stream
// (griddepcontrol.wait): no kernel writes weights, so under PDL they stream while the predecessor, often a few-µs
// latency-bound kernel, finishes. Same loads and arithmetic, same bits. Gemv: the register GEMV's plain and batched
// launches (measured +1.3 % at batch 1 on the H100, docs/perf.md fifteenth round); All: also linear_f32 (router
// gate, indexer weights_proj) and hc_pre's cluster mix (+1.7 % more at batch 1, level at 8 and 32: the default).
// Process-wide, read at launch; DSV4_EARLY_WEIGHTS=0 / gemv / all in the environment sets it at the first call.
enum class EarlyWeights { Off, Gemv, All };
constexpr EarlyWeights kEarlyWeightsDefault = EarlyWeights::All;
void set_early_weights(EarlyWeights mode);
EarlyWeights early_weights();
inline bool early_gemv_weights() { return early_weights() != EarlyWeights::Off; }
inline bool early_other_weights() { return early_weights() == EarlyWeights::All; }

}  // namespace dsv4::gpu
