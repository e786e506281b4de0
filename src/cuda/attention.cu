// SPDX-License-Identifier: MIT
// Sparse attention with sink over the sliding window and the compressed entries (contract in ops.h).
// A (token, head) has one query and at most window + top-k (or all compressed) keys, all heads reading the same
// keys (one shared K = V head). Two kernels, chosen by rows x heads (use_head_groups):
//   head groups (prefill chunks, large decode batches): a block takes 16 heads of one token, its keys pass through
//     shared memory in tiles of 8 once for all 16 heads (each warp owns two heads);
//   per head (small decode steps): a block takes one (token, head), its warps walk interleaved keys from L2.
// When the blocks do not fill the GPU, the keys are split over several blocks that each write an unnormalised
// partial per head (running max, sum of weights, weighted sum of keys) and a merge kernel adds the sink.
#include <algorithm>
#include <cmath>

#include "cuda/device.h"
#include "cuda/launch.cuh"
#include "cuda/ops.h"
#include "cuda/ops_common.cuh"

namespace dsv4::gpu {
namespace {

using detail::warp_sum;

constexpr int kMaxHeadDim = 512;
constexpr int kMaxPerLane = kMaxHeadDim / 32;
constexpr int kAttnWarps = 8;
constexpr int kWarpHeads = 2;                               // heads per warp
constexpr int kBlockHeads = kAttnWarps * kWarpHeads;        // heads per block, sharing every key load
constexpr int kTileKeys = 8;                                // keys per shared-memory tile
constexpr int kMinKeysPerSplit = 16;                        // a split reads the block's queries once: amortise them
constexpr int kHeadKeysPerSplit = 64;                       // per-head kernel: 8 keys per warp
constexpr int64_t kGroupKernelMinRowHeads = 512;            // rows x heads from which head groups are used
constexpr int kMaxSplits = 128;
constexpr int kMergeThreads = 128, kMergeDims = kMaxHeadDim / kMergeThreads;

struct KeyRange {
  int64_t pos, first;  // query position, first window position
  int n_window, n_comp;
};

__device__ KeyRange key_range(const AttentionParams& p, int t) {
  KeyRange r;
  const int64_t pos0 = p.pos_device ? *p.pos_device : p.pos0;
  r.pos = p.window_rings ? p.pos_rows[t] : pos0 + t;
  r.first = r.pos - p.window + 1 > 0 ? r.pos - p.window + 1 : 0;
  r.n_window = int(r.pos - r.first + 1);
  r.n_comp = p.ratio ? int((r.pos + 1) / p.ratio) : 0;
  if (p.selected && r.n_comp > p.topk) r.n_comp = p.topk;
  return r;
}

// Key j of query t: window keys first (this chunk's rows from kv_chunk, older ones from the ring), then the
// compressed entries (the indexer's picks, or all of them).
__device__ const float* key_ptr(const AttentionParams& p, const KeyRange& r, int t, int j) {
  if (j < r.n_window) {
    const int64_t s = r.first + j;
    if (p.window_rings)  // batched decode: only the row's own token is in the chunk
      return s == r.pos ? p.kv_chunk + int64_t(t) * p.dim : p.window_rings[t] + (s % p.window_slots) * p.dim;
    const int64_t pos0 = r.pos - t;
    return s >= pos0 ? p.kv_chunk + (s - pos0) * p.dim : p.window_ring + (s % p.window_slots) * p.dim;
  }
  const int c = j - r.n_window;
  const float* compressed = p.window_rings ? p.compressed_rows[t] : p.compressed;
  return compressed + int64_t(p.selected ? p.selected[int64_t(t) * p.topk + c] : c) * p.dim;
}

__device__ __forceinline__ void load_key(const float* key, int lane, int per_lane, float kr[kMaxPerLane]) {
#pragma unroll
  for (int e = 0; e < kMaxPerLane; ++e) kr[e] = e < per_lane ? key[lane + 32 * e] : 0.0f;
}

// store_window: the first block of row t (head or head group 0, split 0) writes the row's key into its ring slot.
__device__ void store_own_key(const AttentionParams& p, const KeyRange& r, int t) {
  if (!p.store_window || blockIdx.x != 0 || blockIdx.z != 0) return;
  float* ring = p.window_rings ? p.window_rings[t] : p.window_ring;
  float* dst = ring + (r.pos % p.window_slots) * p.dim;
  const float* src = p.kv_chunk + int64_t(t) * p.dim;
  for (int i = threadIdx.x; i < p.dim; i += blockDim.x) dst[i] = src[i];
}

// De-rotates the last rope_dim dims of o (V carries RoPE) at the query position, fp32 angle like the reference;
// pairs i = first, first + step, ... (a block or one warp).
__device__ void inverse_rope(float* o, const AttentionParams& p, int64_t pos, int first, int step) {
  float* rope = o + p.dim - p.rope_dim;
  for (int i = first; i < p.rope_dim / 2; i += step) {
    const float angle = __fmul_rn(float(pos), p.inv_freq[i]);
    const float c = float(cos(double(angle))), s = -float(sin(double(angle)));
    const float a = rope[2 * i], b = rope[2 * i + 1];
    rope[2 * i] = __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s));
    rope[2 * i + 1] = __fadd_rn(__fmul_rn(a, s), __fmul_rn(b, c));
  }
}

// o (normalised, de-rotated) -> bf16, grouped for the output projection [groups, n, heads_per_group · dim].
__device__ void store_grouped(const float* o, const AttentionParams& p, int h, int t, int first, int step) {
  const int heads_per_group = p.heads / p.groups, g = h / heads_per_group, width = heads_per_group * p.dim;
  uint16_t* out = p.out + (int64_t(g) * (p.out_rows ? p.out_rows : p.n) + t) * width + (h % heads_per_group) * p.dim;
  for (int i = first; i < p.dim; i += step) out[i] = f32_to_bf16(o[i]);
}

// Block (head group, t, split): keys [split · per, (split + 1) · per) of query t, per = ceil(keys / splits), for
// heads 16 · blockIdx.x .. + 15. The block stages kTileKeys keys at a time in shared memory (the next tile's loads
// in flight while the current one is used); warp w runs an online softmax for heads 2w and 2w + 1 with element
// lane + 32·e of query and accumulator in its lane. One split: the sink is added and the output finished here;
// more: the partials go to scratch for attention_merge_kernel.
// kFixedPerLane: the head dim / 32 known at compile time (16: dim 512), or 0 for any dim (guarded loops).
template <int kFixedPerLane>
__global__ void __launch_bounds__(kAttnWarps * 32) attention_group_kernel(AttentionParams p, int splits) {
  gpu::dependent_enter();
  __shared__ __align__(16) float tiles[2][kTileKeys][kMaxHeadDim];  // after the loop: per-warp output staging
  const int t = blockIdx.y, split = blockIdx.z, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int dim = kFixedPerLane ? 32 * kFixedPerLane : p.dim, per_lane = dim / 32;
  const int h0 = blockIdx.x * kBlockHeads + warp * kWarpHeads;  // this warp's first head
  const KeyRange r = key_range(p, t);
  const int n_keys = r.n_window + r.n_comp, per = (n_keys + splits - 1) / splits;
  const int j0 = split * per, j1 = min(n_keys, j0 + per), count = max(0, j1 - j0);
  store_own_key(p, r, t);
  const int n_tiles = (count + kTileKeys - 1) / kTileKeys;

  float q[kWarpHeads][kMaxPerLane], acc[kWarpHeads][kMaxPerLane], m[kWarpHeads], l[kWarpHeads];
#pragma unroll
  for (int hh = 0; hh < kWarpHeads; ++hh) {
    const bool valid = h0 + hh < p.heads;
    const float* qv = p.q + t * p.q_token_stride + int64_t(h0 + hh) * dim;
#pragma unroll
    for (int e = 0; e < kMaxPerLane; ++e) {
      q[hh][e] = valid && e < per_lane ? qv[lane + 32 * e] * p.scale : 0.0f;
      acc[hh][e] = 0.0f;
    }
    m[hh] = -INFINITY;
    l[hh] = 0.0f;
  }

  // Loader role: warp w stages key w of each tile (elements lane + 32·e).
  float stage[kMaxPerLane];
  auto load_tile = [&](int tile) {
    const int j = j0 + tile * kTileKeys + warp;
    if (j < j1) {
      const float* key = key_ptr(p, r, t, j);
#pragma unroll
      for (int e = 0; e < kMaxPerLane; ++e) stage[e] = e < per_lane ? key[lane + 32 * e] : 0.0f;
    } else {  // past the split's keys: zeros, so the masked rows add 0 · 0
#pragma unroll
      for (int e = 0; e < kMaxPerLane; ++e) stage[e] = 0.0f;
    }
  };
  auto store_tile = [&](int tile) {
    float* dst = tiles[tile & 1][warp];
#pragma unroll
    for (int e = 0; e < kMaxPerLane; ++e)
      if (e < per_lane) dst[lane + 32 * e] = stage[e];
  };
  if (n_tiles > 0) {
    load_tile(0);
    store_tile(0);
  }
  __syncthreads();
  const bool warp_active = h0 < p.heads;
  for (int tile = 0; tile < n_tiles; ++tile) {
    if (tile + 1 < n_tiles) load_tile(tile + 1);
    const float(*keys)[kMaxHeadDim] = tiles[tile & 1];
    const int in_tile = min(kTileKeys, count - tile * kTileKeys);
    if (warp_active) {
      float logit[kWarpHeads][kTileKeys];
#pragma unroll
      for (int kk = 0; kk < kTileKeys; ++kk) {
        float d[kWarpHeads] = {};
#pragma unroll
        for (int e = 0; e < kMaxPerLane; ++e) {
          const float k = e < per_lane ? keys[kk][lane + 32 * e] : 0.0f;
#pragma unroll
          for (int hh = 0; hh < kWarpHeads; ++hh) d[hh] = fmaf(q[hh][e], k, d[hh]);
        }
#pragma unroll
        for (int hh = 0; hh < kWarpHeads; ++hh) logit[hh][kk] = d[hh];
      }
#pragma unroll
      for (int hh = 0; hh < kWarpHeads; ++hh) {
#pragma unroll
        for (int kk = 0; kk < kTileKeys; ++kk) logit[hh][kk] = kk < in_tile ? warp_sum(logit[hh][kk]) : -INFINITY;
        float m_new = m[hh];
#pragma unroll
        for (int kk = 0; kk < kTileKeys; ++kk) m_new = fmaxf(m_new, logit[hh][kk]);
        const float correction = expf(m[hh] - m_new);  // 0 while m is -inf
        float w[kTileKeys], sum_w = 0.0f;
#pragma unroll
        for (int kk = 0; kk < kTileKeys; ++kk) {
          w[kk] = expf(logit[hh][kk] - m_new);  // 0 for the masked keys
          sum_w += w[kk];
        }
        l[hh] = l[hh] * correction + sum_w;
#pragma unroll
        for (int e = 0; e < kMaxPerLane; ++e) {
          if (e >= per_lane) continue;
          float v = acc[hh][e] * correction;
#pragma unroll
          for (int kk = 0; kk < kTileKeys; ++kk) v = fmaf(w[kk], keys[kk][lane + 32 * e], v);
          acc[hh][e] = v;
        }
        m[hh] = m_new;
      }
    }
    if (tile + 1 < n_tiles) store_tile(tile + 1);  // the other buffer: nobody reads it during this tile
    __syncthreads();
  }
  if (!warp_active) return;

  float* o = &tiles[0][0][0] + warp * (2 * kTileKeys * kMaxHeadDim / kAttnWarps);  // this warp's staging
#pragma unroll
  for (int hh = 0; hh < kWarpHeads; ++hh) {
    const int h = h0 + hh;
    if (h >= p.heads) break;
    if (splits > 1) {  // unnormalised partial: weights relative to m
      float* part = p.scratch + ((int64_t(t) * p.heads + h) * splits + split) * (dim + 2);
#pragma unroll
      for (int e = 0; e < kMaxPerLane; ++e)
        if (e < per_lane) part[2 + lane + 32 * e] = acc[hh][e];
      if (lane == 0) {
        part[0] = m[hh];
        part[1] = l[hh];
      }
      continue;
    }
    // The sink is a virtual key with zero value that only adds to the denominator.
    const float sink = p.sink[h], mx = fmaxf(sink, m[hh]);
    const float factor = expf(m[hh] - mx), denom = l[hh] * factor + expf(sink - mx);
    const float scale = factor / denom;
#pragma unroll
    for (int e = 0; e < kMaxPerLane; ++e)
      if (e < per_lane) o[lane + 32 * e] = acc[hh][e] * scale;
    __syncwarp();
    inverse_rope(o, p, r.pos, lane, 32);
    __syncwarp();
    store_grouped(o, p, h, t, lane, 32);
    __syncwarp();
  }
}

// Few rows (decode): block (h, t, split) takes keys [split · per, (split + 1) · per) of query t,
// per = ceil(keys / splits). Each warp runs an online softmax over a strided share of them with the query and accumulator spread over the lanes (element
// lane + 32·e), loading the next key before using the current one; the warps are then merged. One split: the
// sink is added and the output finished here; more: the partial goes to scratch for attention_merge_kernel.
__global__ void attention_head_kernel(AttentionParams p, int splits) {
  gpu::dependent_enter();
  __shared__ float warp_max[kAttnWarps], warp_sum_e[kAttnWarps], warp_factor[kAttnWarps], block_max, block_sum_e;
  __shared__ float warp_acc[kAttnWarps][kMaxHeadDim];
  __shared__ float o[kMaxHeadDim];
  const int h = blockIdx.x, t = blockIdx.y, split = blockIdx.z, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int dim = p.dim, per_lane = dim / 32;
  const KeyRange r = key_range(p, t);
  const int n_keys = r.n_window + r.n_comp, per = (n_keys + splits - 1) / splits;
  const int j0 = split * per, j1 = min(n_keys, j0 + per);
  store_own_key(p, r, t);
  const float* qv = p.q + t * p.q_token_stride + int64_t(h) * dim;
  float qr[kMaxPerLane], acc[kMaxPerLane];  // fully unrolled with guards, so they stay in registers
#pragma unroll
  for (int e = 0; e < kMaxPerLane; ++e) {
    qr[e] = e < per_lane ? qv[lane + 32 * e] : 0.0f;
    acc[e] = 0;
  }
  float m = -INFINITY, l = 0;
  float next[kMaxPerLane];
  int j = j0 + warp;
  if (j < j1) load_key(key_ptr(p, r, t, j), lane, per_lane, next);
  for (; j < j1; j += kAttnWarps) {
    float kr[kMaxPerLane];
#pragma unroll
    for (int e = 0; e < kMaxPerLane; ++e) kr[e] = next[e];
    if (j + kAttnWarps < j1) load_key(key_ptr(p, r, t, j + kAttnWarps), lane, per_lane, next);
    float dot = 0;
#pragma unroll
    for (int e = 0; e < kMaxPerLane; ++e) dot += qr[e] * kr[e];
    const float logit = warp_sum(dot) * p.scale;
    const float m_new = fmaxf(m, logit), correction = expf(m - m_new), w = expf(logit - m_new);
    l = l * correction + w;
#pragma unroll
    for (int e = 0; e < kMaxPerLane; ++e) acc[e] = acc[e] * correction + w * kr[e];
    m = m_new;
  }
  if (lane == 0) {
    warp_max[warp] = m;
    warp_sum_e[warp] = l;
  }
#pragma unroll
  for (int e = 0; e < kMaxPerLane; ++e)
    if (e < per_lane) warp_acc[warp][lane + 32 * e] = acc[e];
  __syncthreads();
  if (threadIdx.x == 0) {
    // One split: the sink is a virtual key with zero value that only adds to the denominator.
    float mx = splits == 1 ? p.sink[h] : -INFINITY;
    for (int w = 0; w < kAttnWarps; ++w) mx = fmaxf(mx, warp_max[w]);
    float denom = splits == 1 ? expf(p.sink[h] - mx) : 0.0f;
    for (int w = 0; w < kAttnWarps; ++w) {
      warp_factor[w] = warp_sum_e[w] > 0 ? expf(warp_max[w] - mx) : 0.0f;
      denom += warp_sum_e[w] * warp_factor[w];
    }
    block_max = mx;
    block_sum_e = denom;
  }
  __syncthreads();
  if (splits > 1) {  // unnormalised partial: weights relative to block_max
    const int64_t slot = (int64_t(t) * p.heads + h) * splits + split;
    float* part = p.scratch + slot * (dim + 2);
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
      float v = 0;
      for (int w = 0; w < kAttnWarps; ++w) v += warp_acc[w][i] * warp_factor[w];
      part[2 + i] = v;
    }
    if (threadIdx.x == 0) {
      part[0] = block_max;
      part[1] = block_sum_e;
    }
    return;
  }
  const float inv_denom = 1.0f / block_sum_e;
  for (int i = threadIdx.x; i < dim; i += blockDim.x) {
    float v = 0;
    for (int w = 0; w < kAttnWarps; ++w) v += warp_acc[w][i] * warp_factor[w];
    o[i] = v * inv_denom;
  }
  __syncthreads();
  inverse_rope(o, p, r.pos, threadIdx.x, blockDim.x);
  __syncthreads();
  store_grouped(o, p, h, t, threadIdx.x, blockDim.x);
}

// Block (h, t): merges the splits' partials of either attention kernel with the sink, then finishes like one
// split.
__global__ void attention_merge_kernel(AttentionParams p, int splits) {
  gpu::dependent_enter();
  __shared__ float split_max[kMaxSplits], split_sum[kMaxSplits], factor[kMaxSplits];
  __shared__ float o[kMaxHeadDim];
  __shared__ float inv_denom;
  const int h = blockIdx.x, t = blockIdx.y, dim = p.dim;
  const float* parts = p.scratch + (int64_t(t) * p.heads + h) * splits * (dim + 2);
  for (int s = threadIdx.x; s < splits; s += blockDim.x) {  // every split's (max, sum) in one round trip
    split_max[s] = parts[s * (dim + 2)];
    split_sum[s] = parts[s * (dim + 2) + 1];
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    const float sink = p.sink[h];
    float mx = sink;
    for (int s = 0; s < splits; ++s) mx = fmaxf(mx, split_max[s]);
    float denom = expf(sink - mx);
    for (int s = 0; s < splits; ++s) {
      factor[s] = split_sum[s] > 0 ? expf(split_max[s] - mx) : 0.0f;
      denom += split_sum[s] * factor[s];
    }
    inv_denom = 1.0f / denom;
  }
  __syncthreads();
  // Each thread sums its kMergeDims dims over the splits, eight splits' loads in flight at a time.
  float v[kMergeDims] = {};
  for (int s0 = 0; s0 < splits; s0 += 8) {
#pragma unroll
    for (int ds = 0; ds < 8; ++ds) {
      const int s = s0 + ds;
      if (s >= splits) break;
#pragma unroll
      for (int d = 0; d < kMergeDims; ++d) {
        const int i = threadIdx.x + d * kMergeThreads;
        if (i < dim) v[d] = fmaf(parts[s * (dim + 2) + 2 + i], factor[s], v[d]);
      }
    }
  }
#pragma unroll
  for (int d = 0; d < kMergeDims; ++d) {
    const int i = threadIdx.x + d * kMergeThreads;
    if (i < dim) o[i] = v[d] * inv_denom;
  }
  __syncthreads();
  inverse_rope(o, p, key_range(p, t).pos, threadIdx.x, blockDim.x);
  __syncthreads();
  store_grouped(o, p, h, t, threadIdx.x, blockDim.x);
}

}  // namespace

namespace {

// The head-group kernel reads each key once for 16 heads but runs its 8 warps as long dependent chains through
// shared memory; the per-head kernel has many short blocks. Measured on Flash shapes (H200, docs/perf.md): per
// head faster at 1 row (24 vs 28 µs per layer), head groups faster at 8 rows (70 vs 77 µs), 32 rows (190 vs
// 278 µs) and for prefill chunks.
bool use_head_groups(const AttentionParams& p) { return int64_t(p.n) * p.heads >= kGroupKernelMinRowHeads; }

}  // namespace

int attention_splits(const AttentionParams& p) {
  const int64_t comp = p.ratio == 0 ? 0 : p.selected ? p.topk : std::max(p.max_entries, 0);
  const int64_t max_keys = p.window + comp, sms = current_sm_count();
  if (!use_head_groups(p)) {  // per head: split only when (token, head) blocks do not fill the GPU
    if (int64_t(p.n) * p.heads >= 2 * sms) return 1;
    return int(std::clamp<int64_t>((max_keys + kHeadKeysPerSplit - 1) / kHeadKeysPerSplit, 1, kMaxSplits));
  }
  // Head groups: keys split while each split keeps kMinKeysPerSplit keys and the launch stays within a few waves;
  // past that, only as far as ~3 blocks per SM need (a block's warps are latency-bound: more blocks hide more).
  const int64_t blocks = int64_t(p.n) * ((p.heads + kBlockHeads - 1) / kBlockHeads);
  const int64_t by_keys = std::clamp<int64_t>(max_keys / kMinKeysPerSplit, 1, kMaxSplits);
  if (blocks * by_keys <= 4 * sms) return int(by_keys);
  return int(std::clamp<int64_t>((3 * sms + blocks - 1) / blocks, 1, by_keys));
}

size_t attention_scratch_floats(const AttentionParams& p) {
  const int splits = attention_splits(p);
  return splits == 1 ? 0 : size_t(p.n) * p.heads * splits * (p.dim + 2);
}

void attention(const AttentionParams& p, cudaStream_t stream) {
  if (p.n == 0) return;
  OPS_CHECK(p.dim % 32 == 0 && p.dim <= kMaxHeadDim, "attention: head_dim %d must be a multiple of 32 and <= %d",
            p.dim, kMaxHeadDim);
  OPS_CHECK(p.groups > 0 && p.heads % p.groups == 0, "attention: %d heads do not split into %d groups", p.heads,
            p.groups);
  OPS_CHECK(!p.window_rings || (p.pos_rows && (p.ratio == 0 || p.compressed_rows)),
            "attention: batched rows need pos_rows and (with compressed keys) compressed_rows");
  OPS_CHECK(!p.store_window || ((p.n == 1 || p.window_rings) && p.window_slots >= 1),
            "attention: store_window is for decode (one row or batched rows), got %d rows", p.n);
  OPS_CHECK(p.ratio == 0 || p.selected || p.max_entries >= 0,
            "attention: max_entries must be set when all compressed entries are attended (ratio %d)", p.ratio);
  const int splits = attention_splits(p);
  OPS_CHECK(splits == 1 || p.scratch, "attention: %d key splits need scratch (attention_scratch_floats)", splits);
  if (!use_head_groups(p)) {
    gpu::launch(attention_head_kernel, dim3(p.heads, p.n, splits), kAttnWarps * 32, 0, stream, p, splits);
  } else {
    const dim3 grid((p.heads + kBlockHeads - 1) / kBlockHeads, p.n, splits);
    if (p.dim == kMaxHeadDim)
      gpu::launch(attention_group_kernel<kMaxPerLane>, grid, kAttnWarps * 32, 0, stream, p, splits);
    else
      gpu::launch(attention_group_kernel<0>, grid, kAttnWarps * 32, 0, stream, p, splits);
  }
  DSV4_CUDA_LAUNCHED();
  if (splits == 1) return;
  gpu::launch(attention_merge_kernel, dim3(p.heads, p.n), kMergeThreads, 0, stream, p, splits);
  DSV4_CUDA_LAUNCHED();
}

}  // namespace dsv4::gpu
