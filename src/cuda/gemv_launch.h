// SPDX-License-Identifier: MIT
// Internal boundary between gemv.cpp (validation, heuristics, errors) and the kernels (gemv.cu: bf16 tensor-core
// kernel for every format; gemv_bulk.cu: the same for FP4 / FP8 weights fed by the copy engine; gemv_w4a8.cu: FP4
// weights x FP8 activations at m = 1; act_quant).
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "cuda/gemv.h"

namespace dsv4::detail {

constexpr int kGemvWarps = 8;  // warps per block; split_k of them share one 16-row tile

// What every gemv kernel reads (one struct for the plain, batched and grouped launches).
struct KernelArgs {
  int m, n, k;
  int split;                    // warps per 16-row tile
  const uint16_t* x;            // [m, k] bf16
  const uint8_t* w;             // weight bytes, rows of row_bytes
  const uint8_t* w_scale;       // format's scale tensor (bytes)
  void* y;                      // [m, ldy]
  int64_t ldy;
  int w_row0;                   // first weight row of the call (FP8: its scale row block is (w_row0 + r) / 128)
  float y_factor;               // output multiplier (NVFP4: weight_scale_2 * the decoder's bias gap; else 1)
  bool out_bf16;
  bool tiles;                   // w / w_scale in the tile layout (GemvLayout::Tiles, cuda/weight_tiles.h)
  bool early_weights;           // plain / batched: the first round of weight loads before waiting (gpu::set_early_weights)
  bool slots_settled;           // grouped, register kernel: the slot read and the first weight loads before waiting
  // batched launches (gemv_batched): blockIdx.y is the batch, which takes the next n weight rows
  int64_t x_batch_stride, y_batch_stride;
  // grouped launches (gemv_grouped): blockIdx.y is the slot, blockIdx.z the projection (0 base, 1 second)
  size_t w_stride, scale_stride;
  const float* scale_2;         // [E] or nullptr
  float nvfp4_factor;           // the decoder's bias gap when NVFP4, else 0 (scale_2 unused)
  const int32_t *slot_count, *slot_expert, *slot_offset, *row_order;
  int x_row_div;
  const uint8_t *w_second, *w_scale_second;
  const float* scale_2_second;
  void* y_second;
  // grouped w1 + w3 with the SwiGLU after (GemvGroupedParams::swiglu; register kernel): h [pairs, n] bf16
  uint16_t* swiglu_h;
  const float* swiglu_weights;  // [pairs] or nullptr
  float swiglu_limit;
  uint32_t* slot_tickets;
  // the warp-specialised wgmma kernel's tile walk (its grid.x blocks walk the tiles of what was grid.y x grid.z):
  // batches (batched) or slots (grouped), and projections per slot (grouped, 1 when paired)
  int tile_ys, tile_zs;
};

// Launch the kernel for validated params with a concrete split_k; return cudaGetLastError(). With act FP8 the
// caller has already replaced x by its quantised copy unless gemv_w4a8_supported(p) (then the kernel quantises).
cudaError_t gemv_launch(const GemvParams& p, int split_k);
cudaError_t gemv_batched_launch(const GemvBatchedParams& p, int split_k);
// *swiglu_done: whether the kernel it chose computed p.swiglu (the register kernel), when p.swiglu.h is set.
cudaError_t gemv_grouped_launch(const GemvGroupedParams& p, int split_k, bool* swiglu_done);
// The kernel gemv_grouped_launch runs for validated params.
enum class GroupedKernel { Tiled, W4a8, Bulk, Register };
GroupedKernel grouped_kernel(const GemvGroupedParams& g);
cudaError_t moe_slots_launch(const MoeSlotsParams& p, bool by_warps);
cudaError_t moe_route_and_slots_launch(const gpu::RouterParams& router, const MoeSlotsParams& slots);
// moe_gate.cu: validated params.
cudaError_t moe_gate_launch(const gpu::LinearF32Params& gate, const gpu::RouterParams& router,
                            const MoeSlotsParams& slots, uint32_t* ticket);

// FP4 weights x FP8 activations (gemv_w4a8.cu): MXFP4 / NVFP4 weights, act FP8, one row per call (grouped: per
// slot), k <= kW4a8MaxK.
constexpr int kW4a8MaxK = 16384;
bool gemv_w4a8_supported(const GemvParams& p);
// With set_gemv_bulk on, the W4A8 kernel streams its weights through the copy engine when k % 512 == 0 and w,
// w_scale are 16-byte aligned (grouped: expert strides too, checked at launch).
bool gemv_w4a8_bulk_supported(const GemvParams& p);
cudaError_t gemv_w4a8_launch(const KernelArgs& a, const GemvParams& p, dim3 grid, bool grouped);

// FP4 / FP8 weights through the copy engine (gemv_bulk.cu), when switched on (gemv_bulk_enabled in gemv.h): MXFP4
// / NVFP4 with k a multiple of 512 and 16-byte aligned w_scale, or FP8 blocks with k a multiple of 256; m <=
// kGemvMaxM, w 16-byte aligned (grouped launches also need expert strides that keep them aligned:
// gemv_bulk_grouped_supported). Same tiles and split as the register kernel.
bool gemv_bulk_supported(const GemvParams& p);
bool gemv_bulk_grouped_supported(const GemvGroupedParams& g);
cudaError_t gemv_bulk_launch(const KernelArgs& a, const GemvParams& p, dim3 grid, bool grouped);

// The tiled kernel for m > kGemvMaxM and decode batches from gemv_tiled_min_rows() (gemv_tiled.cu): every format
// except FP8 block weights with f32 scales.
// Plain, batched (grid.y) and grouped (grid.y slots, grid.z projections) like the skinny kernel; a.m is the row
// count (grouped: the most rows a slot holds; more are covered by further passes).
// The matrices of a grouped launch that typically have work: active slots x projections.
inline int64_t gemv_grouped_matrices(const GemvGroupedParams& g) {
  const int active = g.active_slots_hint > 0 && g.active_slots_hint < g.max_slots ? g.active_slots_hint : g.max_slots;
  return int64_t(active) * (g.second.w ? 2 : 1);
}
// matrices: the launch's matrices side by side in the grid (batched: batch; grouped: active slots x projections),
// for the decode-batch rule of set_gemv_tiled_min_rows.
bool gemv_tiled_supported(const GemvParams& p, int64_t matrices = 1);
// 16-row weight tiles per warp of the tiled kernel: 0 = chosen per launch (1 when 256-row blocks would not give
// every SM two blocks, else 2), or forced to 2 (256 rows per block, one block per SM) or 1 (128 rows, two blocks
// per SM). Benchmarks and tests force it to compare; the engine leaves 0.
extern int tiled_weight_tiles;
// Grouped with a.swiglu_h set: *swiglu_done (when given) says whether the kernel it chose computed the SwiGLU (the
// wgmma kernel's warp-specialised shapes, gemv_wgmma_computes_swiglu); the others ignore swiglu_h.
cudaError_t gemv_tiled_launch(const KernelArgs& a, const GemvParams& p, dim3 grid, bool grouped,
                              bool* swiglu_done = nullptr);

// FP4 weights (w MXFP4 / NVFP4) in 64-row activation tiles on wgmma (gemv_wgmma.cu), called by gemv_tiled.cu when
// gemv_wgmma_enabled() and gemv_wgmma_pick_shape() > 0, with its grid (plain, batched, grouped); a.m as for
// gemv_tiled_launch. Block shapes (weight rows x activation rows): 1 = 256 x 64, 2 = 128 x 128, 3 = 256 x 128;
// warp-specialised (a producer warpgroup beside the two that multiply): 4 = 256 x 128, 5 = 256 x 64.
// Grouped with a.swiglu_h set, shapes 4 and 5 compute w1 and w3 of the same rows in each block and store only
// their SwiGLU (gemv_wgmma_computes_swiglu; base.y and second.y are not written); the other shapes ignore it.
cudaError_t gemv_wgmma_launch(const KernelArgs& a, GemvWeight w, int shape, dim3 grid, cudaStream_t stream,
                              bool grouped);
bool gemv_wgmma_computes_swiglu(int shape);
// The shape for a launch: forced by wgmma_shape, else 256 x 128 above 64 rows when that grid has a block for ~every
// SM, else 256 x 64 when that one has, else 0: the mma.sync kernel (its 128-row blocks, two per SM, were faster on
// such small grids in dsv4_gemm_bench; grid.y x grid.z counts the matrices side by side). Under
// gemv_wgmma_ws_enabled() the warp-specialised form of the same block shape (4 for 3, 5 for 1).
int gemv_wgmma_pick_shape(const KernelArgs& a, dim3 grid);
// The same rule for m activation rows, n weight rows and `matrices` side by side, without a forced shape.
int gemv_wgmma_rule_shape(int64_t m, int64_t n, int64_t matrices);
// Benchmarks and tests: 0 = chosen per launch, or 1..5 forced; -1 (the start) = not yet read from
// DSV4_GEMV_WGMMA_SHAPE, which wgmma_forced_shape() reads at its first call.
extern int wgmma_shape;
int wgmma_forced_shape();
// Tests: the persistent warp-specialised launches' block count, 0 = one per SM (the engine); a few blocks give each
// several tiles of a small grid, so the stage ring's run from one tile into the next is tested.
extern int wgmma_walk_blocks;

// y[r, :] = act_quant_fp8(x[r, :]) as bf16 for r < rows (act_quant_fp8 in gemv.h).
cudaError_t act_quant_launch(const uint16_t* x, uint16_t* y, int rows, int k, cudaStream_t stream);

}  // namespace dsv4::detail
