// SPDX-License-Identifier: MIT
// draw_tokens (ops.h): the draw contract of formats/token_draw.h on the device, one block per row of logits.
//   1. the row's maximum and argmax (greedy rows stop here);
//   2. top-k: the k-th logit in "before" order by a radix select on counts, 4 passes of 8 bits over the keys;
//   3. top-p: the nucleus boundary by a radix select on weight within the top-k cut, 4 passes;
//   4. the draw: each warp sums the cut's weight over its segment of ids, one warp of the block finds the segment
//      where the point lands, and that segment's warp walks it in id order.
// A cut is a pivot (tau, ties): every id whose key is above tau, and the first `ties` ids in id order whose key is
// tau. Weights are the contract's integers, so every sum is exact in any order and the id matches the host's.
#include "cuda/launch.cuh"
#include "cuda/ops.h"
#include "cuda/ops_common.cuh"

namespace dsv4::gpu {
namespace {

constexpr int kThreads = 1024, kWarps = kThreads / 32, kLoads = 4;
constexpr unsigned kFull = 0xffffffffu;
constexpr uint32_t kNoDigit = 256;  // match_any value of lanes outside a histogram

struct Cut {
  uint32_t tau = 0;        // key
  uint32_t ties = ~0u;     // ids with key tau kept, the lowest first
};

struct Shared {
  unsigned long long mass[256];
  uint32_t count[256];
  unsigned long long seg_mass[kWarps];
  uint32_t seg_ties[kWarps];
  float warp_max[kWarps];
  int warp_arg[kWarps];
  // one thread's findings for the block
  int digit, segment;
  uint32_t digit_count;
  unsigned long long before_digit, digit_mass, target, seg_point;
  uint32_t seg_ties_before;
};

// f(id, logit, valid) for every id of the row, kLoads loads in flight per thread; every lane of every warp runs
// every iteration (ids past n come with valid = false), so f may use warp collectives.
template <class F>
__device__ __forceinline__ void for_each_logit(const float* row, int n, F&& f) {
  for (int base = 0; base < n; base += kLoads * kThreads) {
    float v[kLoads];
#pragma unroll
    for (int j = 0; j < kLoads; ++j) {
      const int id = base + j * kThreads + int(threadIdx.x);
      v[j] = id < n ? row[id] : 0.0f;  // plain loads: the lm_head wrote them (launch.cuh)
    }
#pragma unroll
    for (int j = 0; j < kLoads; ++j) {
      const int id = base + j * kThreads + int(threadIdx.x);
      f(id, v[j], id < n);
    }
  }
}

template <class T>
__device__ __forceinline__ T warp_exclusive_scan(T v, int lane) {
  T inclusive = v;
  for (int o = 1; o < 32; o <<= 1) {
    const T up = __shfl_up_sync(kFull, inclusive, o);
    if (lane >= o) inclusive += up;
  }
  return inclusive - v;
}

// Warp 0: the digit of a 256-bin histogram (highest digit first) where the running sum reaches `need` (> 0, at
// most the histogram's total). Leaves in s the digit, the sum of the digits above it (before_digit), its bin and
// its count. Lane L holds digits 255 - 8L .. 248 - 8L.
template <class T>
__device__ void find_digit(Shared& s, const T* bins, unsigned long long need, int lane) {
  T own[8];
  unsigned long long sum = 0;
#pragma unroll
  for (int j = 0; j < 8; ++j) sum += (own[j] = bins[255 - 8 * lane - j]);
  const unsigned long long before = warp_exclusive_scan(sum, lane);
  const unsigned reached = __ballot_sync(kFull, before + sum >= need);
  const int first = reached ? __ffs(int(reached)) - 1 : 31;  // 31: not reached (cannot happen), the last digit
  if (lane != first) return;
  unsigned long long run = before, value = 0;
  int pick = -1;
#pragma unroll
  for (int j = 0; j < 8; ++j) {  // unrolled: own[] stays in registers
    if (pick >= 0) continue;
    if (run + own[j] >= need || j == 7) {
      pick = j;
      value = own[j];
    } else {
      run += own[j];
    }
  }
  s.digit = 255 - 8 * lane - pick;
  s.before_digit = run;
  s.digit_mass = value;
  s.digit_count = s.count[s.digit];
}

__global__ void __launch_bounds__(kThreads, 1) draw_tokens_kernel(DrawTokensParams p) {
  __shared__ Shared s;
  dependent_enter();
  const int row_index = int(blockIdx.x), lane = int(threadIdx.x) & 31, warp = int(threadIdx.x) >> 5;
  const TokenDraw d = p.draws[row_index];
  const int n = d.vocab > 0 && d.vocab < p.vocab ? d.vocab : p.vocab;
  const float* row = p.logits + int64_t(row_index) * p.ld;

  // 1. maximum and argmax (the lowest id among equal logits)
  float best = -INFINITY;
  int best_id = n;
  for_each_logit(row, n, [&](int id, float v, bool valid) {
    if (valid && (v > best || (v == best && id < best_id))) best = v, best_id = id;
  });
  for (int o = 16; o > 0; o >>= 1) {
    const float other = __shfl_xor_sync(kFull, best, o);
    const int other_id = __shfl_xor_sync(kFull, best_id, o);
    if (other > best || (other == best && other_id < best_id)) best = other, best_id = other_id;
  }
  if (lane == 0) s.warp_max[warp] = best, s.warp_arg[warp] = best_id;
  __syncthreads();
  float mx = s.warp_max[0];
  int argmax = s.warp_arg[0];
  for (int w = 1; w < kWarps; ++w)
    if (s.warp_max[w] > mx || (s.warp_max[w] == mx && s.warp_arg[w] < argmax)) mx = s.warp_max[w], argmax = s.warp_arg[w];
  if (argmax >= n) argmax = 0;  // every logit NaN
  if (d.temperature == 0.0f || !isfinite(mx)) {
    if (threadIdx.x == 0) p.ids[row_index] = argmax;
    return;
  }
  const float inv_t = __fdiv_rn(1.0f, d.temperature);
  auto weight = [&](float v) { return (unsigned long long)draw_weight(v, mx, inv_t); };

  Cut cut;  // none yet: every id (no real logit has key 0)
  bool cut_active = false;
  // 2. top-k: the k-th key, and how many ids of that key the cut keeps
  if (d.top_k > 0 && d.top_k < n) {
    uint32_t prefix = 0, mask = 0;
    unsigned long long need = unsigned(d.top_k);
    for (int shift = 24; shift >= 0; shift -= 8) {
      for (int i = int(threadIdx.x); i < 256; i += kThreads) s.count[i] = 0;
      __syncthreads();
      for_each_logit(row, n, [&](int, float v, bool valid) {
        const uint32_t key = float_order_key(v), digit = (key >> shift) & 255u;
        const bool in = valid && (key & mask) == prefix;
        const unsigned peers = __match_any_sync(kFull, in ? digit : kNoDigit);
        if (in && lane == __ffs(int(peers)) - 1) atomicAdd(&s.count[digit], uint32_t(__popc(int(peers))));
      });
      __syncthreads();
      if (warp == 0) find_digit(s, s.count, need, lane);
      __syncthreads();
      prefix |= uint32_t(s.digit) << shift;
      mask |= 255u << shift;
      need -= s.before_digit;
      __syncthreads();  // s.digit is rewritten by the next pass
    }
    cut = {prefix, uint32_t(need)};
    cut_active = true;
  }
  // 3. top-p: the shortest prefix of the cut in "before" order whose weight reaches the target
  if (d.top_p < 1.0f) {
    const unsigned long long tie_weight = cut_active ? weight(float_of_order_key(cut.tau)) : 0;
    uint32_t prefix = 0, mask = 0;
    unsigned long long above = 0;  // the weight of the cut's ids with keys above the prefix
    for (int shift = 24; shift >= 0; shift -= 8) {
      for (int i = int(threadIdx.x); i < 256; i += kThreads) s.mass[i] = 0, s.count[i] = 0;
      __syncthreads();
      for_each_logit(row, n, [&](int, float v, bool valid) {
        const uint32_t key = float_order_key(v), digit = (key >> shift) & 255u;
        const bool in = valid && (key & mask) == prefix && (!cut_active || key > cut.tau);
        const unsigned peers = __match_any_sync(kFull, in ? digit : kNoDigit);
        // The group's weight as two 20-bit halves (a weight is at most 2^40), each summed in 32 bits.
        const unsigned long long w = in ? weight(v) : 0;
        const uint32_t high = __reduce_add_sync(peers, uint32_t(w >> 20));
        const uint32_t low = __reduce_add_sync(peers, uint32_t(w & 0xfffffu));
        if (in && lane == __ffs(int(peers)) - 1) {
          atomicAdd(&s.mass[digit], ((unsigned long long)high << 20) + low);
          atomicAdd(&s.count[digit], uint32_t(__popc(int(peers))));
        }
      });
      __syncthreads();
      if (threadIdx.x == 0 && cut_active && (cut.tau & mask) == prefix) {  // the top-k cut's kept ties
        const uint32_t digit = (cut.tau >> shift) & 255u;
        s.mass[digit] += cut.ties * tie_weight;
        s.count[digit] += cut.ties;
      }
      __syncthreads();
      if (warp == 0) {
        if (shift == 24) {  // the whole cut is in this first histogram: its total sets the target
          unsigned long long total = 0;
          for (int j = 0; j < 8; ++j) total += s.mass[8 * lane + j];
          total = detail::warp_sum(total);
          if (lane == 0) s.target = nucleus_target(d.top_p, total);
          __syncwarp();
        }
        find_digit(s, s.mass, s.target - above, lane);
      }
      __syncthreads();
      prefix |= uint32_t(s.digit) << shift;
      mask |= 255u << shift;
      above += s.before_digit;
      __syncthreads();
    }
    // The ids of key `prefix` the nucleus needs: the fewest whose weight closes the gap to the target.
    const unsigned long long w = weight(float_of_order_key(prefix)), gap = s.target - above;
    unsigned long long ties = w > 0 ? (gap + w - 1) / w : 1;
    if (ties < 1) ties = 1;
    if (ties > s.digit_count) ties = s.digit_count;
    cut = {prefix, uint32_t(ties)};
    cut_active = true;
  }

  // 4. the draw: segment sums, the segment holding the point, its warp's walk in id order
  const unsigned long long tie_weight = cut_active ? weight(float_of_order_key(cut.tau)) : 0;
  const int segment = ((n + kWarps - 1) / kWarps + 31) / 32 * 32;
  const int begin = warp * segment, end = min(begin + segment, n);
  {
    unsigned long long sum = 0;
    uint32_t ties = 0;
    for (int c = begin; c < end; c += kLoads * 32) {
      float v[kLoads];
#pragma unroll
      for (int j = 0; j < kLoads; ++j) {
        const int id = c + 32 * j + lane;
        v[j] = id < end ? row[id] : 0.0f;
      }
#pragma unroll
      for (int j = 0; j < kLoads; ++j) {
        if (c + 32 * j + lane >= end) continue;
        const uint32_t key = float_order_key(v[j]);
        if (key > cut.tau) sum += weight(v[j]);
        else if (key == cut.tau) ++ties;
      }
    }
    sum = detail::warp_sum(sum);
    ties = __reduce_add_sync(kFull, ties);
    if (lane == 0) s.seg_mass[warp] = sum, s.seg_ties[warp] = ties;
  }
  __syncthreads();
  if (warp == 0) {  // lane L: segment L
    const uint32_t ties = s.seg_ties[lane], ties_before = warp_exclusive_scan(ties, lane);
    const uint32_t kept_ties = ties_before >= cut.ties ? 0 : min(cut.ties - ties_before, ties);
    const unsigned long long mass = s.seg_mass[lane] + (unsigned long long)kept_ties * tie_weight;
    const unsigned long long before = warp_exclusive_scan(mass, lane), total = detail::warp_sum(mass);
    const unsigned long long point = draw_point(d.u, total);
    const unsigned holds = __ballot_sync(kFull, before + mass > point);
    const int first = holds ? __ffs(int(holds)) - 1 : 0;
    if (lane == first) {
      s.segment = first;
      s.seg_point = point - before;
      s.seg_ties_before = ties_before;
    }
  }
  __syncthreads();
  if (warp != s.segment) return;
  unsigned long long point = s.seg_point;
  uint32_t ties_before = s.seg_ties_before;
  for (int c = begin; c < end; c += 32) {
    const int id = c + lane;
    const float v = id < end ? row[id] : 0.0f;
    const uint32_t key = float_order_key(v);
    const bool tie = id < end && key == cut.tau;
    const unsigned tie_lanes = __ballot_sync(kFull, tie);
    const uint32_t tie_rank = ties_before + uint32_t(__popc(int(tie_lanes & ((1u << lane) - 1u))));
    const bool kept = id < end && (key > cut.tau || (tie && tie_rank < cut.ties));
    const unsigned long long w = kept ? weight(v) : 0;
    const unsigned long long inclusive = warp_exclusive_scan(w, lane) + w;
    const unsigned hits = __ballot_sync(kFull, inclusive > point);
    if (hits) {
      if (lane == __ffs(int(hits)) - 1) p.ids[row_index] = id;
      return;
    }
    point -= __shfl_sync(kFull, inclusive, 31);
    ties_before += uint32_t(__popc(int(tie_lanes)));
  }
  if (lane == 0) p.ids[row_index] = argmax;  // not reached: the point lies inside the segment's weight
}

}  // namespace

void draw_tokens(const DrawTokensParams& p, cudaStream_t stream) {
  OPS_CHECK(p.rows >= 0 && p.vocab > 0 && p.ld >= p.vocab, "draw_tokens: %d rows of %d logits (ld %lld)", p.rows,
            p.vocab, (long long)p.ld);
  if (p.rows == 0) return;
  gpu::launch(draw_tokens_kernel, dim3(unsigned(p.rows)), dim3(kThreads), 0, stream, p);
  DSV4_CUDA_LAUNCHED();
}

}  // namespace dsv4::gpu
