// SPDX-License-Identifier: MIT
// GEMM with compressed weights:  y[m, n] = sum_k x[m, k] * W[n, k]   (gemm_nt), for decode batches and prefill
// chunks. Weights stay in their checkpoint layout in GPU memory and are decoded to bf16 in registers; products and
// sums run on the tensor cores (mma.sync bf16, fp32 accumulate).
//   m <= 64 (kGemvMaxM; decode batches below gemv_tiled_min_rows): the skinny kernel (gemv.cu): each weight byte
//     is read once per launch for all m rows, activations come through L1; at small m it runs at memory bandwidth.
//     FP4 / FP8 weights can instead come through the copy engine (gemv_bulk.cu, set_gemv_bulk below).
//   m > 64 (and decode batches from gemv_tiled_min_rows): the tiled kernel (gemv_tiled.cu): 256 (or, on small
//     grids, 128) weight rows x 64 (16 or 32 when m is that small) activation rows per block, activations and
//     weights staged in shared memory, weights from DRAM about once and from L2 for the further row tiles. FP8
//     block weights with f32 scales have no tiled kernel: they run as skinny 64-row pieces (logged once). FP4
//     weights in 64-row tiles run on wgmma (gemv_wgmma.cu, set_gemv_wgmma below).
//
// Contract
//   x  [m, k] bf16, row-major, contiguous (row stride k).
//   W  by format (row-major [n, ...], rows contiguous, base 16-byte aligned):
//     BF16       w [n, k] bf16                                               W = w
//     FP8_BLOCK  w [n, k] e4m3, w_scale [ceil(n/128), ceil(k/128)] e8m0 or f32 (fp8_scale)
//                                                                            W = e4m3(w) * scale[n/128, k/128]
//     MXFP4      w [n, k/2] e2m1, each 32-bit word in the device layout (fp4_layout.h: to_device of the
//                checkpoint's nibbles, low nibble = element 2j), w_scale [n, k/32] e8m0
//                                                                            W = e2m1 * 2^(E - 127)
//     NVFP4      w [n, k/2] e2m1 as MXFP4, w_scale [n, k/16] e4m3, w_scale_2 fp32 scalar
//                                                                            W = e2m1 * e4m3(scale) * w_scale_2
//   layout Tiles (MXFP4 / NVFP4): w and w_scale hold the same bytes regrouped per 16-row tile and 64-byte chunk
//      (cuda/weight_tiles.h), so each warp load of the skinny kernel is contiguous; n, w_row0 multiples of 16, k a
//      multiple of 128. Act FP8 then quantises x first (no W4A8 kernel) and no copy-engine kernel runs.
//   y  [m, n] fp32 or bf16 (round to nearest even), row stride ldy (0 = n). Every element y[i, 0..n) is written,
//      nothing else (a fused projection writes its parts side by side into one [m, ldy] buffer).
//   k: multiple of 8 (BF16), 16 (FP8_BLOCK), 32 (MXFP4, NVFP4). m in [0, kGemvMaxRows]; m == 0 or n == 0 is a
//   no-op.
// Numerics: W decodes exactly to bf16 (see dequant.cuh for the scale ranges), bf16 x bf16 products are exact,
// accumulation is fp32 in an unspecified order (tensor-core sums, then a split-k sum across warps in the skinny
// kernel; k in order of chunks in the tiled one), so m <= 64 and m > 64 may differ in the last bits.
// Activations (act):
//   BF16  x as given.
//   FP8   x is first quantised like the official reference's FP8/FP4 linears (act_quant_fp8 below): per row and
//         128-element block, s = 2^ceil(log2(max(amax, 1e-4) / 448)), x = e4m3(x / s) · s (nearest even,
//         saturating). MXFP4 / NVFP4 weights with m == 1 (grouped: base.m == 1) run the FP8 tensor-core kernel
//         (W4A8: e2m1 -> e4m3 exactly, block scales applied to fp32 partial sums); every other case quantises x
//         into act_scratch [m, k] bf16 (grouped: [x_rows, k]) with one more launch and runs the bf16 kernel on it
//         (the quantised values are exact in bf16, so both paths compute the same sum).
// The kernel is asynchronous on `stream`; launch errors are thrown as dsv4::Error.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "cuda/ops.h"

namespace dsv4 {

enum class GemvWeight { BF16, FP8_BLOCK, MXFP4, NVFP4 };
enum class GemvScale { E8M0, F32 };  // element type of the FP8_BLOCK scale tensor
enum class GemvOut { F32, BF16 };
enum class GemvAct { BF16, FP8 };  // activations as given, or quantised per 128-block (see Activations above)
enum class GemvLayout { Rows, Tiles };  // w / w_scale row-major, or in 16-row tiles (cuda/weight_tiles.h)

constexpr int kGemvMaxM = 64;            // the skinny kernel's rows; above, the tiled kernel
constexpr int kGemvMaxRows = 1 << 20;     // rows of one call

struct GemvParams {
  int m = 0, n = 0, k = 0;
  const void* x = nullptr;        // [m, k] bf16
  const void* w = nullptr;        // see the table above
  const void* w_scale = nullptr;  // see the table above; nullptr for BF16
  int w_row0 = 0;                 // the call covers rows [w_row0, w_row0 + n) of the matrix at w / w_scale
                                  // (FP8_BLOCK: a multiple of 16, the scale grid is the whole matrix's)
  float w_scale_2 = 1.0f;         // NVFP4 weight_scale_2 (the loader reads the scalar once); ignored otherwise
  void* y = nullptr;              // [m, n] of `out`, row stride ldy
  int64_t ldy = 0;                // 0 = n
  GemvWeight weight = GemvWeight::BF16;
  GemvScale fp8_scale = GemvScale::E8M0;
  GemvLayout layout = GemvLayout::Rows;
  GemvOut out = GemvOut::F32;
  int split_k = 0;  // warps sharing one 16-row tile (1, 2, 4 or 8); 0 = chosen from the shape (benchmarks set it)
  GemvAct act = GemvAct::BF16;
  void* act_scratch = nullptr;  // act FP8 outside the W4A8 kernel: [m, k] bf16 (gemv_uses_w4a8 says when)
  cudaStream_t stream = nullptr;
};

void gemv(const GemvParams& p);

// Whether p (act FP8) runs the W4A8 kernel, so that act_scratch is not needed (plain calls; grouped calls ask with
// their base).
bool gemv_uses_w4a8(const GemvParams& p);

// y[r, :] = act_quant_fp8(x[r, :]) for r < rows (x, y [rows, k] bf16, y == x allowed): the quantisation of
// act FP8, bit-identical to fp8_simulate_block (src/formats/fp8.h) of the bf16 values per 128-element block.
void act_quant_fp8(const void* x, void* y, int rows, int k, cudaStream_t stream);

// `batch` gemvs of the same shape in one launch (the grouped low-rank output projection, batch = o_groups):
//   for b < batch:  y[b·y_batch_stride + i·ldy + j] = Σ_kk x[b·x_batch_stride + i·k + kk] · W[w_row0 + b·n + j, kk]
// Batch b takes the next n rows of the matrix at base.w, its own x rows and its own output columns; strides in
// elements (of x / of the output type). Everything else as for gemv(); FP8_BLOCK needs n % 16 == 0; act BF16
// only (the reference's grouped output projection wo_a is not activation-quantised).
struct GemvBatchedParams {
  GemvParams base;
  int batch = 1;
  int64_t x_batch_stride = 0, y_batch_stride = 0;
};
void gemv_batched(const GemvBatchedParams& p);

// Routed (token, pick) pairs grouped by expert: written by moe_slots, read by gemv_grouped (device arrays).
//   count [1] active slots; expert [max_slots] the expert of each slot, ascending; offset [max_slots + 1] where
//   each slot's pairs start in row_order; row_order [pairs] the pair indices t·k + i, sorted by slot.
struct MoeSlots {
  int32_t* count = nullptr;
  int32_t* expert = nullptr;
  int32_t* offset = nullptr;
  int32_t* row_order = nullptr;
};

// Grouped (MoE) skinny GEMM over rows routed to experts on the device, so no host round trip decides which
// experts run:
//   for each active slot s < *slots.count, expert e = slots.expert[s], and each pair r in
//   slots.row_order[slots.offset[s] .. slots.offset[s+1]):   y[r, :] = x[r / x_row_div, :] · W_eᵀ
// W_e = the format of `base` at base.w + e·w_expert_stride bytes (scale: base.w_scale + e·scale_expert_stride),
// NVFP4 global scale scale_2[e] (nullptr: base.w_scale_2 for every expert). base.m is the most rows any slot
// holds (a host-known bound such as the chunk's token count; it picks the kernel and tile width), base.n / base.k the
// shape of one expert, base.x [rows, k] bf16, base.y [pairs, ldy]. Slots past *slots.count exit at once; the grid
// has max_slots of them, so the launch shape does not depend on the routing (graph capture). base.m > 64 runs the
// tiled kernel (a slot's rows in 64-row tiles); a slot with more than base.m rows is still computed whole
// (further passes over its weights), only slower.
// second.w set: a second projection of the same x and routing in the same launch (the experts' w1 and w3), with
// base's shape, format and strides, its own weights, scales and output.
struct GemvGroupedParams {
  GemvParams base;
  size_t w_expert_stride = 0, scale_expert_stride = 0;  // bytes
  const float* scale_2 = nullptr;                       // device [E]
  int max_slots = 0;
  int active_slots_hint = 0;  // slots typically active (decode: the token's pairs), for the split choice; 0 = max_slots
  // The slots (count, expert, offset, row_order) were final before the previous kernel let this launch start (it
  // triggered its dependents after its own wait, SwigluParams::trigger_after_wait, and the slots are older than its
  // predecessor): under gpu::early_gemv_weights the register kernel then reads its slot and issues its first weight
  // loads before waiting, like plain launches. Other kernels wait first (gemv_grouped_reads_slots_early).
  bool slots_settled = false;
  MoeSlots slots;
  int x_row_div = 1;
  int x_rows = 0;  // rows of base.x; read for act FP8 without the W4A8 kernel (base.act_scratch [x_rows, k])
  struct Second {
    const void* w = nullptr;
    const void* w_scale = nullptr;
    const float* scale_2 = nullptr;
    void* y = nullptr;
  } second;
  // swiglu.h set (w1 + w3 of an MoE: fp32 outputs, a second projection): then h = gpu::swiglu(swiglu) with gate =
  // base.y, up = second.y, ld = the outputs' row stride, inter = n. The register kernel (decode) computes it in the
  // last block of each slot to finish, for the slot's pairs (a ticket per slot: slot_tickets, max_slots uint32 of
  // device memory, 0 before the first launch and left at 0); the warp-specialised wgmma kernel (prefill chunks)
  // computes both projections of the same columns in each block and stores only h, leaving base.y and second.y
  // unwritten; other kernels are followed by a swiglu launch. The same bits every way.
  gpu::SwigluParams swiglu;
  uint32_t* slot_tickets = nullptr;
};
// Returns the kernels it launched (1, or 2 with a swiglu launch after).
int gemv_grouped(const GemvGroupedParams& p);
// Whether gemv_grouped(p) runs a kernel that honours slots_settled (the register or the copy-engine kernel; p otherwise
// valid).
bool gemv_grouped_reads_slots_early(const GemvGroupedParams& p);

// Builds the slot arrays of gemv_grouped from the router's picks ids [n, k] (expert ids in [0, experts)):
// pairs sorted by expert, ascending, stable; one slot per expert with at least one pair.
//   shared_expert < 0: pairs t·k + i are the picks.
//   shared_expert >= 0 (the shared expert stored as one more expert of the grouped weights): every token gets a
//   (k+1)-th pair t·(k+1) + k on that expert, picks are t·(k+1) + i, and pair_weights [n·(k+1)] receives the
//   routing weights [n, k] with 1 for the shared pairs (the SwiGLU's per-pair factor).
// slots.expert / slots.offset need min(experts, pairs) (+1) entries. experts <= 4096, pairs <= kMoeSlotsMaxPairs
// (a prefill chunk of 4096 tokens with 7 pairs each).
constexpr int kMoeSlotsMaxPairs = 32768;
struct MoeSlotsParams {
  const int32_t* ids = nullptr;
  int n = 0, k = 0, experts = 0;
  int shared_expert = -1;
  const float* weights = nullptr;  // [n, k], read when shared_expert >= 0
  float* pair_weights = nullptr;   // [n, k + 1], written when shared_expert >= 0
  MoeSlots slots;
  cudaStream_t stream = nullptr;
};
void moe_slots(const MoeSlotsParams& p);
// moe_slots' form for chunks of many pairs (experts <= 512): every warp of the block places its own run of pairs
// from per-warp expert counts, instead of warp 0 walking all of them (39 µs per 512-token prefill chunk, H100). The
// same slots and order. On by default (prefill +2 % at chunks of 512, H100, docs/perf.md twenty-second round).
// Process-wide; DSV4_MOE_SLOTS_BY_WARPS=0/1 in the environment sets it at the first call (bench switch slotwarps).
void set_moe_slots_by_warps(bool on);
bool moe_slots_by_warps();
// gpu::router then moe_slots in one launch, for decode steps (router.n <= 64 tokens, routed by the 16 warps of one
// block, which then places the pairs; experts <= 512): the same ids, weights and slots as the two launches, one
// launch fewer per MoE layer. slots.ids / weights must be router.ids / weights; slots.n / k must equal router.n / k.
void moe_route_and_slots(const gpu::RouterParams& router, const MoeSlotsParams& slots);
// The router gate (gpu::linear_f32 `gate`: router.logits = gate.y [n, E] = scale · x · Wᵀ) and then gpu::router +
// moe_slots in one launch, for decode steps: the gate's blocks are linear_f32's (the same logits, bit for bit), and the
// last of them to finish (a ticket: `ticket` is one unsigned of device memory, 0 before the first launch, left at 0
// by each) routes the tokens (one warp per token) and places the pairs. Same ids, weights and slots as the three
// launches, two launches fewer per MoE layer. Needs gate.m = router.n = slots.n in 1 .. kMoeGateMaxTokens,
// gate.n = router.experts <= 512, gate.k % 4 == 0 with 16-byte aligned x and W; moe_gate_fits says whether a
// shape can.
constexpr int kMoeGateMaxTokens = 63;  // linear_f32's skinny blocks (m < 64)
bool moe_gate_fits(const gpu::LinearF32Params& gate);
void moe_gate_route_and_slots(const gpu::LinearF32Params& gate, const gpu::RouterParams& router,
                              const MoeSlotsParams& slots, uint32_t* ticket);

// How FP4 / FP8 weights reach the skinny kernel (m <= kGemvMaxM): loads into registers (default), or copy-engine
// copies into a shared-memory ring (gemv_bulk.cu) for k a multiple of 512 (FP4) / 256 (FP8). Same decode and mma; the warps of a
// split tile take contiguous k ranges instead of interleaved chunks, so sums agree bit for bit at split_k 1 and to
// fp32 rounding otherwise. Process-wide; DSV4_GEMV_BULK=1 (all) or =dense in the environment switches it on at the
// first call. Dense: the plain and batched launches only, the grouped experts keep the register kernel (on the H100
// the copy engine won on single large GEMVs and lost on the grouped w1 + w3, docs/perf.md tenth round).
// Off by default until a GPU run has measured it.
enum class GemvBulk { Off, Dense, All };
void set_gemv_bulk(GemvBulk mode);
inline void set_gemv_bulk(bool on) { set_gemv_bulk(on ? GemvBulk::All : GemvBulk::Off); }
GemvBulk gemv_bulk_mode();
inline bool gemv_bulk_enabled() { return gemv_bulk_mode() != GemvBulk::Off; }

// Act FP8 with fp4 weights at m = 1: the W4A8 kernel (gemv_w4a8.cu: FP8 tensor cores, x quantised inside), or x
// quantised into act_scratch first and the bf16-activation kernel (same products: e4m3(x) * scale is exact in bf16;
// fp32 sums in another order). Process-wide; DSV4_GEMV_W4A8=0/1 in the environment sets it at the first call.
constexpr bool kGemvW4a8Default = true;
void set_gemv_w4a8(bool on);
bool gemv_w4a8_enabled();

// Decode batches on the tiled tensor-core kernel: calls of m >= rows (BF16 weights: 2 x rows; grouped: base.m, the
// most rows a slot may hold) run it instead of the skinny one when their grid has at least min_blocks_per_sm blocks
// of 128 weight rows per multiprocessor (the tiled kernel has no split-k: wo_b's 32 row blocks ran 2x slower on it
// at batch 32, the grouped experts and the q-side projection 1.2-2x faster). The skinny kernel's per-row FMAs on the
// CUDA cores (a decoded weight times m rows) bound it above m ~ 8; BF16 weights decode nothing, so their skinny
// kernel holds out longer. Measured on the H100 (docs/perf.md sixteenth round), NVFP4 from 16 rows: batch 8 -5 %,
// 16 +4 %, 32 +10 %, 64 +22 %; BF16 from 32: batch 16 -5 %, 32 +4 %, 64 +10 %. m > kGemvMaxM always runs the
// tiled kernel; formats without one stay skinny. The two kernels sum k in different orders (last bits).
// Process-wide; DSV4_GEMV_TILED_MIN_M in the environment sets rows at the first call (clamped to
// [2, kGemvMaxM + 1]; kGemvMaxM + 1: prefill chunks only). Tests pass min_blocks_per_sm 0 to force small calls.
constexpr int kGemvTiledMinRowsDefault = 16;
constexpr int kGemvTiledMinBlocksPerSm = 2;
void set_gemv_tiled_min_rows(int rows, int min_blocks_per_sm = kGemvTiledMinBlocksPerSm);
int gemv_tiled_min_rows();
int gemv_tiled_min_blocks_per_sm();

// FP4 weights (MXFP4 / NVFP4) in the tiled kernel's 64-row activation tiles (prefill chunks, decode batches of
// 33..64 rows there) on Hopper's warpgroup MMA (gemv_wgmma.cu: the decoded weights as the register operand, the
// activation tile read by the tensor cores from shared memory) instead of mma.sync. Only on compute capability 9.x
// (elsewhere the mma.sync kernel, logged once). The two sum k in the same 16-wide steps but may round differently
// inside a step (last bits). Process-wide; DSV4_GEMV_WGMMA=0/1 in the environment sets it at the first call.
constexpr bool kGemvWgmmaDefault = true;
void set_gemv_wgmma(bool on);
bool gemv_wgmma_enabled();
// The wgmma kernel's warp-specialised form (a producer warpgroup stages weights and activations for two consumer
// warpgroups that only decode and multiply; same bits) in place of the plain one, for the shapes the engine picks.
// Process-wide; DSV4_GEMV_WGMMA_WS=0/1 in the environment sets it at the first call.
constexpr bool kGemvWgmmaWsDefault = true;
void set_gemv_wgmma_ws(bool on);
bool gemv_wgmma_ws_enabled();
// The warp-specialised form's walking kernel (one block per SM, each walking its share of the launch's tiles with
// the stage ring running on from one tile to the next; same bits) instead of its kernel of one block per tile.
// Process-wide; DSV4_GEMV_WGMMA_PERSISTENT=0/1 in the environment sets it at the first call.
constexpr bool kGemvWgmmaPersistentDefault = false;  // never yet run on a GPU (docs/perf.md, stops 41-42)
void set_gemv_wgmma_persistent(bool on);
bool gemv_wgmma_persistent_enabled();
// Whether gemv(p) should run a prefill-sized dense linear instead of decoding its fp4 weights for cuBLASLt: fp4
// weights, bf16 activations, 64 < m < 1024 rows, and a grid that gives the warp-specialised wgmma kernel a block
// for ~every SM. dsv4_gemm_bench at m = 512 (H100): 32768 x 1024 91.7 µs against 108.9 (cuBLASLt + the decode),
// 4096 x 8192 86.2 against 101.5; smaller grids (1024 x 4096) and m >= 1024 stay faster on cuBLASLt.
// set_gemv_over_gemm(false) (bench switch cublasdense) sends them all to cuBLASLt again (process-wide).
bool gemv_beats_decode_and_gemm(const GemvParams& p);
void set_gemv_over_gemm(bool on);

// Tests: every skinny launch (gemv, gemv_batched, gemv_grouped) whose params leave split_k at 0 takes `split` (a power
// of two up to kGemvWarps) instead of gemv_default_split_k; 0 restores the heuristic. Process-wide. Model-level tests
// use it to see what a mere change of fp32 summation order does to the logits (bf16 activations turn it into
// rounding-boundary crossings everywhere), and to run two weight streams over the same partition.
void set_gemv_forced_split(int split);

// The split_k that gemv() chooses for p on a device with sm_count multiprocessors.
int gemv_default_split_k(const GemvParams& p, int sm_count);

const char* gemv_weight_name(GemvWeight w);

// The k every call with weights `w` must be a multiple of (8 BF16, 16 FP8_BLOCK, 32 MXFP4 / NVFP4).
int gemv_k_multiple(GemvWeight w);

// Whether an [n, k] weight in `w` can take the tile layout (GemvLayout::Tiles): MXFP4 / NVFP4, n a multiple of 16,
// k of 128.
bool gemv_tiles_fit(GemvWeight w, int64_t n, int64_t k);

// Bytes of an [n, k] weight in `w`'s layout above, and of its scale tensor (FP8_BLOCK with e8m0 scales; 0 for
// BF16).
int64_t gemv_weight_bytes(GemvWeight w, int64_t n, int64_t k);
int64_t gemv_scale_bytes(GemvWeight w, int64_t n, int64_t k, GemvScale fp8_scale = GemvScale::E8M0);

}  // namespace dsv4
