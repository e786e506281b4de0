// SPDX-License-Identifier: MIT
// Shared by the gemv kernels: which weights, activation rows and outputs one block of a plain, batched or grouped
// launch works on (block_rows: gemv.cu, gemv_bulk.cu, gemv_tiled.cu; gemv_w4a8.cu, which has no batched form and
// waits for the previous kernel at its start, calls grouped_slot itself: through block_rows its grouped kernels
// spilled 4 bytes).
#pragma once
#include <cuda_bf16.h>

#include <cstdint>

#include "cuda/gemv_launch.h"
#include "cuda/launch.cuh"

namespace dsv4::detail {

// Expert e's weights of projection `second` (0 the base, 1 the second: w3 beside w1) in a grouped launch.
struct ExpertWeights {
  const uint8_t* w;        // the expert's weight bytes (row 0)
  const uint8_t* w_scale;  // its scale bytes
  float y_factor;          // output multiplier (NVFP4: the expert's weight_scale_2 times the decoder's bias gap)
};
__device__ __forceinline__ ExpertWeights expert_weights(const KernelArgs& a, int e, bool second) {
  const float* scale_2 = second ? a.scale_2_second : a.scale_2;
  return {(second ? a.w_second : a.w) + size_t(e) * a.w_stride,
          (second ? a.w_scale_second : a.w_scale) + size_t(e) * a.scale_stride,
          scale_2 ? __ldg(scale_2 + e) * a.nvfp4_factor : a.y_factor};
}

struct GroupedSlot {
  const uint8_t* w;        // ExpertWeights of the block's projection
  const uint8_t* w_scale;
  float y_factor;
  int order0, m_rows;      // its pairs: row_order[order0 .. order0 + m_rows)
};

// Slot blockIdx.y, projection blockIdx.z (0 base, 1 second) of a grouped launch. False when the slot holds no
// expert this step: the whole block must return (before any barrier). Blocks that compute both projections of the
// same rows (the wgmma kernel's w1 + w3 + SwiGLU tiles) take the second's from expert_weights.
// grouped_slot_at: slot s, projection z, for kernels whose blocks walk several (gemv_wgmma.cu's persistent tiles).
__device__ __forceinline__ bool grouped_slot_at(const KernelArgs& a, GroupedSlot& slot, int s, int z) {
  if (s >= *a.slot_count) return false;
  const int e = a.slot_expert[s];
  slot.order0 = a.slot_offset[s];
  slot.m_rows = a.slot_offset[s + 1] - slot.order0;
  const ExpertWeights w = expert_weights(a, e, z == 1);
  slot.w = w.w;
  slot.w_scale = w.w_scale;
  slot.y_factor = w.y_factor;
  return true;
}
__device__ __forceinline__ bool grouped_slot(const KernelArgs& a, GroupedSlot& slot) {
  return grouped_slot_at(a, slot, int(blockIdx.y), int(blockIdx.z));
}

// One block's share of a launch: the weights (row 0 of its matrix; the block adds w_row0 rows), x, the output
// factor, its activation rows (grouped: row_order[order0 .. order0 + m_rows)) and its offset into y.
struct BlockRows {
  const uint8_t* w;
  const uint8_t* w_scale;
  const __nv_bfloat16* x;
  float y_factor;
  int m_rows, order0, w_row0;
  int64_t y_offset;
};

// Plain launches: all m rows. Batched (blockIdx.y = batch): that batch's next n weight rows, x rows and y offset.
// Grouped: waits for the previous kernel (the slots are its output), then the slot's expert and pairs; false when the
// slot holds no expert this step, and then the whole block must return (before any barrier).
// wait_first = false (grouped, KernelArgs::slots_settled): the caller waits later, before its first load of x.
template <bool kGrouped>
__device__ __forceinline__ bool block_rows(const KernelArgs& a, BlockRows& b, bool wait_first = true) {
  b = {a.w, a.w_scale, reinterpret_cast<const __nv_bfloat16*>(a.x), a.y_factor, a.m, 0, a.w_row0, 0};
  if constexpr (kGrouped) {
    if (wait_first) gpu::dependent_wait();
    GroupedSlot slot;
    if (!grouped_slot(a, slot)) return false;
    b.w = slot.w;
    b.w_scale = slot.w_scale;
    b.y_factor = slot.y_factor;
    b.order0 = slot.order0;
    b.m_rows = slot.m_rows;
  } else {
    b.w_row0 += blockIdx.y * a.n;
    b.x += blockIdx.y * a.x_batch_stride;
    b.y_offset = blockIdx.y * a.y_batch_stride;
  }
  return true;
}

}  // namespace dsv4::detail
