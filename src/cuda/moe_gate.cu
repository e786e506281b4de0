// SPDX-License-Identifier: MIT
// The MoE gate of a decode step in one launch (contract in gemv.h, moe_gate_route_and_slots): linear_f32's blocks
// compute the router logits, then the last block to finish routes and places the pairs (moe_route.cuh). At batch 1
// the three kernels it replaces (gate, router, moe_slots) were ~19 µs of dependent launches per layer for a few
// KB of work (docs/perf.md, fifteenth round).
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/device.h"
#include "cuda/gemv_launch.h"
#include "cuda/launch.cuh"
#include "cuda/linear_f32.cuh"
#include "cuda/moe_route.cuh"

namespace dsv4::detail {
namespace {

using gpu::detail::kLinearThreads;
constexpr int kGateWarps = kLinearThreads / 32;

template <int kRows, bool kCluster, int kPerLane>
__global__ void __launch_bounds__(kLinearThreads)
    moe_gate_kernel(gpu::LinearF32Params gate, int slices, bool early, gpu::RouterParams r, MoeSlotsParams s,
                    uint32_t* ticket) {
  gpu::detail::linear_f32_block<kRows, 4, kCluster>(gate, slices, early);
  // The block that arrives last sees every block's logits.
  if (!gpu::detail::last_block_to_arrive(ticket, gridDim.x * gridDim.y)) return;
  extern __shared__ float route_smem[];
  route_and_place<kPerLane>(r, s, kGateWarps, route_smem);
}

template <int kRows, bool kCluster, int kPerLane>
cudaError_t launch_gate(const gpu::LinearF32Params& g, int slices, const gpu::RouterParams& r, const MoeSlotsParams& s,
                        uint32_t* ticket) {
  constexpr auto kKernel = moe_gate_kernel<kRows, kCluster, kPerLane>;
  const size_t smem = (size_t(kGateWarps) * r.experts + 2 * size_t(s.experts)) * sizeof(float);
  const cudaError_t attr = gpu::allow_dynamic_smem<kKernel>(int((kGateWarps * 512 + 2 * 4096) * sizeof(float)));
  if (attr != cudaSuccess) return attr;
  const dim3 grid(unsigned(g.n) * slices, unsigned((g.m + kRows - 1) / kRows));
  return gpu::launch_ex(kKernel, grid, kLinearThreads, smem, kCluster ? unsigned(slices) : 1u, s.stream, g, slices,
                        gpu::early_other_weights(), r, s, ticket);
}

template <int kPerLane>
cudaError_t launch_for_rows(const gpu::LinearF32Params& g, int slices, const gpu::RouterParams& r,
                            const MoeSlotsParams& s, uint32_t* ticket) {
  const bool cluster = slices > 1;
  if (gpu::detail::linear_f32_rows_per_block(g.m) == 4)
    return cluster ? launch_gate<4, true, kPerLane>(g, slices, r, s, ticket)
                   : launch_gate<4, false, kPerLane>(g, slices, r, s, ticket);
  return cluster ? launch_gate<1, true, kPerLane>(g, slices, r, s, ticket)
                 : launch_gate<1, false, kPerLane>(g, slices, r, s, ticket);
}

}  // namespace

cudaError_t moe_gate_launch(const gpu::LinearF32Params& gate, const gpu::RouterParams& r, const MoeSlotsParams& p,
                            uint32_t* ticket) {
  const int slices = gpu::detail::linear_f32_slices(gate, current_sm_count());
  return with_experts_per_lane<16>(
      r.experts, [&](auto per_lane) { return launch_for_rows<per_lane>(gate, slices, r, p, ticket); });
}

}  // namespace dsv4::detail
