// SPDX-License-Identifier: MIT
// Shared by the grouped launches of both gemv kernels (gemv.cu, gemv_w4a8.cu): which expert's weights and which
// routed pairs one block works on.
#pragma once
#include <cstdint>

#include "cuda/gemv_launch.h"

namespace dsv4::detail {

struct GroupedSlot {
  const uint8_t* w;        // the expert's weight bytes (row 0)
  const uint8_t* w_scale;  // its scale bytes
  float y_factor;          // output multiplier (NVFP4: the expert's weight_scale_2 times the decoder's bias gap)
  int order0, m_rows;      // its pairs: row_order[order0 .. order0 + m_rows)
};

// Slot blockIdx.y, projection blockIdx.z (0 base, 1 second) of a grouped launch. False when the slot holds no
// expert this step: the whole block must return (before any barrier).
__device__ __forceinline__ bool grouped_slot(const KernelArgs& a, GroupedSlot& slot) {
  const int s = blockIdx.y;
  if (s >= *a.slot_count) return false;
  const int e = a.slot_expert[s];
  slot.order0 = a.slot_offset[s];
  slot.m_rows = a.slot_offset[s + 1] - slot.order0;
  const bool second = blockIdx.z == 1;
  const float* scale_2 = second ? a.scale_2_second : a.scale_2;
  slot.w = (second ? a.w_second : a.w) + size_t(e) * a.w_stride;
  slot.w_scale = (second ? a.w_scale_second : a.w_scale) + size_t(e) * a.scale_stride;
  slot.y_factor = scale_2 ? __ldg(scale_2 + e) * a.nvfp4_factor : a.y_factor;
  return true;
}

}  // namespace dsv4::detail
