// SPDX-License-Identifier: MIT
// The MoE routing of a decode step as device functions: the router (one warp per token) and the placement of the
// routed pairs into per-expert slots (one block), shared by their own kernels (ops_attention.cu router_kernel,
// gemv.cu moe_slots_kernel) and the fused moe_route_and_slots kernel.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "cuda/gemv.h"
#include "cuda/ops.h"
#include "cuda/ops_common.cuh"
#include "formats/float_key.h"

namespace dsv4::detail {

// The router's experts per lane, rounded up to a register-array size (V4: 256 -> 8, 384 -> 12): returns
// f(std::integral_constant<int, K>{}). Sizes above kMaxPerLane are not instantiated (experts must not need them).
template <int kMaxPerLane, class F>
decltype(auto) with_experts_per_lane(int experts, F&& f) {
  if (experts <= 128) return f(std::integral_constant<int, 4>{});
  if (experts <= 256) return f(std::integral_constant<int, 8>{});
  if (experts <= 384) return f(std::integral_constant<int, 12>{});
  if constexpr (kMaxPerLane > 16) {
    if (experts > 512) return f(std::integral_constant<int, 32>{});
  }
  return f(std::integral_constant<int, 16>{});
}

// One warp per token. Lane l owns experts l + 32·i (i < kPerLane): s in shared memory (the weights' source), the
// selection keys of s + bias in registers. Each pick is a warp argmax: the lane's best (strictly greater, so the
// lowest of its ties), then redux max over the lanes and redux min of the tying experts: ties go to the lower index,
// exactly top_k_indices. The weights' sum runs in pick order like the reference.
// s: E floats of shared memory for this warp.
template <int kPerLane>
__device__ __forceinline__ void route_token(const gpu::RouterParams& p, int t, int lane, float* s) {
  const int E = p.experts, k = p.k;
  const float* logits = p.logits + int64_t(t) * E;
  // Every global load first (one memory latency): the hash layer's picks, the bias, the logits.
  int pick = 0;  // lane i < k: the i-th pick
  if (p.tid2eid && lane < k) pick = p.tid2eid[int64_t(p.tokens[t]) * k + lane];
  const bool biased = p.bias && !p.tid2eid;
  float v[kPerLane], bias[kPerLane];
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int e = lane + 32 * i;
    bias[i] = biased && e < E ? p.bias[e] : 0.0f;
    const float x = e < E ? logits[e] : 0.0f;
    if (p.scoring == 0) v[i] = sqrtf(x > 20.0f ? x : log1pf(expf(x)));
    else if (p.scoring == 1) v[i] = gpu::detail::sigmoid(x);
    else v[i] = x;
  }
  if (p.scoring == 2) {
    float mx = -INFINITY;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i)
      if (lane + 32 * i < E) mx = fmaxf(mx, v[i]);
    for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
#pragma unroll
    for (int i = 0; i < kPerLane; ++i)
      if (lane + 32 * i < E) s[lane + 32 * i] = v[i] = expf(v[i] - mx);
    __syncwarp();
    // The sum in expert order, as the reference adds it (E dependent adds, a softmax-only cost).
    float sum = 0;
    if (lane == 0)
      for (int e = 0; e < E; ++e) sum += s[e];
    sum = __shfl_sync(0xffffffffu, sum, 0);
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) v[i] /= sum;
    __syncwarp();  // s is rewritten below
  }
#pragma unroll
  for (int i = 0; i < kPerLane; ++i)
    if (lane + 32 * i < E) s[lane + 32 * i] = v[i];
  __syncwarp();

  if (!p.tid2eid) {
    uint32_t key[kPerLane];  // float_order_key(s + bias); 0 (below every finite value) when absent or picked
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) key[i] = lane + 32 * i < E ? float_order_key(biased ? v[i] + bias[i] : v[i]) : 0;
    for (int r = 0; r < k; ++r) {
      uint32_t best = 0;
      int best_i = 0;
#pragma unroll
      for (int i = 0; i < kPerLane; ++i)
        if (key[i] > best) best = key[i], best_i = i;
      const uint32_t top = __reduce_max_sync(0xffffffffu, best);
      const uint32_t mine = best == top ? uint32_t(lane + 32 * best_i) : 0xffffffffu;
      const uint32_t winner = __reduce_min_sync(0xffffffffu, mine);
      if (lane == r) pick = int(winner);
#pragma unroll
      for (int i = 0; i < kPerLane; ++i)
        if (mine == winner && i == best_i) key[i] = 0;
    }
  }
  const float w = lane < k ? s[pick] : 0.0f;
  float sum = 0;
  for (int i = 0; i < k; ++i) sum += __shfl_sync(0xffffffffu, w, i);
  if (lane < k) {
    p.ids[t * k + lane] = pick;
    p.weights[t * k + lane] = (p.norm_topk ? w / sum : w) * p.routed_scale;
  }
}

// moe_slots: a stable counting sort of the pairs by expert (experts <= 4096, pairs <= kMoeSlotsMaxPairs), in two
// forms below that give the same slots and order. Pair i of token t = i / per_token is its pick j = i % per_token (the
// shared expert last).
struct PairExperts {
  const MoeSlotsParams& p;
  int per_token, pairs;
  __device__ explicit PairExperts(const MoeSlotsParams& params)
      : p(params), per_token(params.k + (params.shared_expert >= 0 ? 1 : 0)), pairs(params.n * per_token) {}
  __device__ int expert(int i) const {
    const int t = i / per_token, j = i % per_token;
    return j == p.k ? p.shared_expert : p.ids[t * p.k + j];
  }
  // pair_weights[i]: the routing weight, 1 for the shared expert's pairs (written when there is one).
  __device__ void weight(int i) const {
    if (p.shared_expert < 0) return;
    const int t = i / per_token, j = i % per_token;
    p.pair_weights[i] = j == p.k ? 1.0f : p.weights[t * p.k + j];
  }
};

// Warp 0 (lane = threadIdx.x): start[e] = the exclusive scan of count (each lane a run of experts, a shuffle scan
// across lanes), and the slot arrays: every expert with pairs, its offset, the count.
__device__ __forceinline__ void scan_slots(const MoeSlotsParams& p, const int* count, int* start, int lane) {
  const int per_lane = (p.experts + 31) / 32, e0 = min(p.experts, lane * per_lane),
            e1 = min(p.experts, e0 + per_lane);
  int rows = 0, slots = 0;  // this lane's run of experts
  for (int e = e0; e < e1; ++e) rows += count[e], slots += count[e] > 0;
  int rows_before = rows, slots_before = slots;  // inclusive scans across lanes, then made exclusive
#pragma unroll
  for (int d = 1; d < 32; d *= 2) {
    const int r = __shfl_up_sync(0xffffffffu, rows_before, d), s = __shfl_up_sync(0xffffffffu, slots_before, d);
    if (lane >= d) rows_before += r, slots_before += s;
  }
  rows_before -= rows, slots_before -= slots;
  for (int e = e0; e < e1; ++e) {
    start[e] = rows_before;
    if (count[e]) {
      p.slots.expert[slots_before] = e;
      p.slots.offset[slots_before] = rows_before;
      ++slots_before;
    }
    rows_before += count[e];
  }
  if (lane == 31) {
    p.slots.offset[slots_before] = rows_before;
    *p.slots.count = slots_before;
  }
}

// One warp places pairs [i0, i1) in ascending order, 32 at a time: lanes of one expert are ranked by
// __match_any_sync, pair i goes to row_order[next[e] + rank], and the group's lowest lane advances next[e].
template <class ExpertOf>
__device__ __forceinline__ void place_run(const MoeSlotsParams& p, int i0, int i1, int* next, int lane,
                                          ExpertOf expert_of) {
  for (int base = i0; base < i1; base += 32) {
    const int i = base + lane;
    const bool valid = i < i1;
    const int e = valid ? expert_of(i) : -1;
    const unsigned peers = __match_any_sync(0xffffffffu, e);
    const unsigned lower = peers & ((1u << lane) - 1u);
    if (valid) p.slots.row_order[next[e] + __popc(lower)] = i;
    __syncwarp();
    if (valid && lower == 0) next[e] += __popc(peers);
    __syncwarp();
  }
}

// The one-block form for a decode step's few pairs (and any expert count): the block counts with shared-memory
// atomics, then warp 0 alone scans and places every pair. Every thread of the block calls it; count and start:
// p.experts ints of shared memory each.
__device__ __forceinline__ void place_pairs(const MoeSlotsParams& p, int* count, int* start) {
  const PairExperts pe(p);
  for (int e = threadIdx.x; e < p.experts; e += blockDim.x) count[e] = 0;
  __syncthreads();
  for (int i = threadIdx.x; i < pe.pairs; i += blockDim.x) {
    atomicAdd(&count[pe.expert(i)], 1);
    pe.weight(i);
  }
  __syncthreads();
  if (threadIdx.x >= 32) return;
  scan_slots(p, count, start, threadIdx.x);
  __syncwarp();
  place_run(p, 0, pe.pairs, start, threadIdx.x, [&](int i) { return pe.expert(i); });
}

// The form for prefill chunks (thousands of pairs; experts <= kSlotsWarpExperts): warp w of the block's W warps owns
// the w-th run of ceil(pairs / W) consecutive pairs. It counts its run's pairs per expert (hist[w][e]) and keeps their
// experts in shared memory; each expert's counts become exclusive prefixes over the warps; warp 0 scans the totals;
// then every warp places its own run from start[e] + hist[w][e]: the same order as one warp walking all pairs, in
// 1 / W of the steps. smem: W · experts + 2 · experts ints, then pairs uint16.
constexpr int kSlotsWarpExperts = 512;
__device__ __forceinline__ void place_pairs_by_warps(const MoeSlotsParams& p, int* smem) {
  const PairExperts pe(p);
  const int E = p.experts, warps = blockDim.x / 32, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  int* hist = smem;                  // [warps][E]
  int* count = hist + warps * E;     // [E]
  int* start = count + E;            // [E]
  uint16_t* pair_expert = reinterpret_cast<uint16_t*>(start + E);  // [pairs]
  const int run = (pe.pairs + warps - 1) / warps, i0 = min(pe.pairs, warp * run), i1 = min(pe.pairs, i0 + run);
  for (int j = threadIdx.x; j < warps * E; j += blockDim.x) hist[j] = 0;
  __syncthreads();
  for (int i = i0 + lane; i < i1; i += 32) {
    const int e = pe.expert(i);
    pair_expert[i] = uint16_t(e);
    atomicAdd(&hist[warp * E + e], 1);
    pe.weight(i);
  }
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    int total = 0;
    for (int w = 0; w < warps; ++w) {
      const int c = hist[w * E + e];
      hist[w * E + e] = total;
      total += c;
    }
    count[e] = total;
  }
  __syncthreads();
  if (warp == 0) scan_slots(p, count, start, lane);
  __syncthreads();
  int* next = hist + warp * E;  // this warp's first row of each expert, relative to start
  for (int e = lane; e < E; e += 32) next[e] += start[e];
  __syncwarp();
  place_run(p, i0, i1, next, lane, [&](int i) { return int(pair_expert[i]); });
}

// The router, then the placement, by every thread of a block of `warps` warps: warp w routes tokens w, w + warps,
// .. with its E floats of smem, then the block places the pairs (the ids and weights this block wrote to global
// memory are visible to it after __syncthreads). smem: warps · E floats, then count and start, p.experts ints each.
template <int kPerLane>
__device__ __forceinline__ void route_and_place(const gpu::RouterParams& r, const MoeSlotsParams& p, int warps,
                                                float* smem) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  float* s = smem + warp * r.experts;
  for (int t = warp; t < r.n; t += warps) {
    route_token<kPerLane>(r, t, lane, s);
    __syncwarp();  // the token's reads of s before the next token's writes
  }
  __syncthreads();
  int* count = reinterpret_cast<int*>(smem + warps * r.experts);
  place_pairs(p, count, count + p.experts);
}

}  // namespace dsv4::detail
