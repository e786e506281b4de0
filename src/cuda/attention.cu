// SPDX-License-Identifier: MIT
// Sparse attention with sink over the sliding window and the compressed entries (contract in ops.h).
// A (token, head) has one query and at most window + top-k (or all compressed) keys, all heads reading the same
// keys (one shared K = V head). Head dim 512 or 128 (the models) runs the tensor-core kernel (64 heads of a token
// per block, 16 for small decode steps; bf16 products like the reference; a decode row spreads its 64-key tiles over
// a cluster of up to 8 blocks that merge in distributed shared memory); other head dims run two CUDA-core kernels,
// chosen by rows x heads (use_head_groups):
//   head groups (prefill chunks, large decode batches): a block takes 16 heads of one token, its keys pass through
//     shared memory in tiles of 8 once for all 16 heads (each warp owns two heads);
//   per head (small decode steps): a block takes one (token, head), its warps walk interleaved keys from L2.
// When the blocks do not fill the GPU, the keys are split over several blocks that each write an unnormalised
// partial per head (running max, sum of weights, weighted sum of keys) and a merge kernel adds the sink.
#include <cooperative_groups.h>
#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>

#include "cuda/device.h"
#include "cuda/launch.cuh"
#include "cuda/mma.cuh"
#include "cuda/ops.h"
#include "cuda/ops_common.cuh"

namespace dsv4::gpu {
namespace {

using detail::warp_sum;
using ::dsv4::detail::ldmatrix_x4;
using ::dsv4::detail::ldmatrix_x4_trans;
using ::dsv4::detail::mma_bf16;
using ::dsv4::detail::pack_bf16;

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
// (a, b) of one RoPE pair rotated by the angle whose cos is c and whose -sin is sn, rounded like the reference.
__device__ __forceinline__ void rotate_pair(float& a, float& b, float c, float sn) {
  const float a0 = a, b0 = b;
  a = __fsub_rn(__fmul_rn(a0, c), __fmul_rn(b0, sn));
  b = __fadd_rn(__fmul_rn(a0, sn), __fmul_rn(b0, c));
}

__device__ void inverse_rope(float* o, const AttentionParams& p, int64_t pos, int first, int step) {
  float* rope = o + p.dim - p.rope_dim;
  for (int i = first; i < p.rope_dim / 2; i += step) {
    const float angle = __fmul_rn(float(pos), p.inv_freq[i]);
    rotate_pair(rope[2 * i], rope[2 * i + 1], float(cos(double(angle))), -float(sin(double(angle))));
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


// ---- tensor-core kernel (head dim 512 / 128) --------------------------------------------------------------------
// Block (head group of kHeads = 64 or 16, token t): all heads of a token share its keys (one K = V head), so per tile
// of 64 keys S = Q Kᵀ is a kHeads x 64 x dim product and O += P V a kHeads x dim x 64 one, both on mma.sync (bf16
// in, fp32 sums), like the reference, which computes logits from bf16 q and bf16 keys and casts the probabilities to
// bf16 for P·V (spec 8.1). Q (bf16) and the key tile (fp32 state -> bf16) sit in shared memory; warp w computes S
// for heads 16·(w % 4) and keys 32·(w / 4) of a tile (16 heads: warps 0 and 1 only), writes P (bf16) to shared
// memory, and accumulates O for all the block's heads and dims [w·dim/8, (w+1)·dim/8) in registers. Online softmax
// per head row: the running max and sum live in shared memory and are advanced once per tile after every warp has
// used them. Grid (split, token, head group): decode rows spread their key tiles over a cluster of up to 8 blocks,
// which merge their partials through distributed shared memory (cluster_merge); prefill chunks fill the GPU with one
// block per (token, head group).
constexpr int kMmaHeads = 64, kMmaKeys = 64, kMmaWarps = 8;
constexpr int kMmaMinRows = 65;  // rows from which a (head group, token) block takes all of the token's keys
// Decode rows can run 16 heads per block instead of 64 (kHeads of the kernel): four times the blocks of a row, a
// quarter of the Q loads, P·V products and merge traffic per block, two blocks per SM. S = QKᵀ keeps the 64-head
// block's split (warps of 16 heads x 32 keys, so only two warps compute S) and every sum keeps its order: both give
// the same bits.
constexpr int kMmaDecodeHeads = 16;
// Decode: blocks of a row's cluster, the portable cluster size. 16 (non-portable; a CSA row's 10 tiles one per
// block) measured 1.4 % faster at batch 1 and 3 % slower at batch 8 and 32 (fewer clusters fit the GPU at once).
constexpr int kMaxMmaSplits = 8;

template <int kDim, int kHeads>
struct MmaLayout {
  static constexpr int kStride = kDim + 8;          // bf16 per Q / K row (16 bytes of padding: no bank conflicts)
  static constexpr int kPStride = kMmaKeys + 8;     // bf16 per P row
  static constexpr size_t kQ = 0, kK = kQ + size_t(kHeads) * kStride * 2, kP = kK + size_t(kMmaKeys) * kStride * 2;
  // P, later the merge's factors and rope table (cluster_merge)
  static constexpr size_t kPBytes = std::max(size_t(kHeads) * kPStride * 2,
                                             (size_t(kMaxMmaSplits + 1) * kHeads + kDim) * sizeof(float));
  static constexpr size_t kStats = kP + kPBytes;  // floats: max[2][kHeads] sum[2][kHeads] m[kHeads] l[kHeads]
  static constexpr size_t kBytes = kStats + 6 * kHeads * sizeof(float);
};

// The inverse-RoPE rotation of every pair i < rope_dim / 2 at position pos, as inverse_rope computes it (fp32 angle,
// cos / sin correctly rounded through double), into shared memory: one evaluation per pair instead of one per
// output element, and one copy of the (large) double trigonometry in the kernel's code. Needs a barrier after.
__device__ void fill_rope_table(const AttentionParams& p, int64_t pos, float* cos_s, float* sin_s) {
  for (int i = threadIdx.x; i < p.rope_dim / 2; i += blockDim.x) {
    double sn, c;
    sincos(double(__fmul_rn(float(pos), p.inv_freq[i])), &sn, &c);
    cos_s[i] = float(c);
    sin_s[i] = -float(sn);
  }
}

// The blocks of a decode row's cluster each hold an unnormalised partial for their key tiles: O in registers
// (fragment layout of the PV products), the running max m and sum l per head in shared memory. Every block puts its
// O in its own shared memory (where Q and K were); block `split` then finishes the float4 groups
// split, split + splits, ... of the kHeads x dim outputs from all blocks' partials, each weighted by
// exp(m_b - M) with M = max(sink, max_b m_b), like attention_merge_kernel, so no partial leaves the SMs.
template <int kDim, int kHeads>
__device__ void cluster_merge(const AttentionParams& p, const float (&o)[kHeads / 16][kDim / kMmaWarps / 8][4],
                              const float* m_s, const float* l_s, unsigned char* smem, int split, int splits, int t,
                              int h0, int64_t pos) {
  using L = MmaLayout<kDim, kHeads>;
  constexpr int kWarpDims = kDim / kMmaWarps, kDimTiles = kWarpDims / 8, kGroups = kHeads * kDim / 4;
  static_assert(size_t(kHeads) * kDim * sizeof(float) <= L::kP, "O fits where Q and K were");
  static_assert((size_t(kMaxMmaSplits + 1) * kHeads + kDim) * sizeof(float) <= L::kStats - L::kP,
                "factors and the rope table fit in P");
  namespace cg = cooperative_groups;
  cg::cluster_group cluster = cg::this_cluster();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, tq = lane & 3;
  float* o_s = reinterpret_cast<float*>(smem + L::kQ);              // [kHeads][kDim]
  float* factor_s = reinterpret_cast<float*>(smem + L::kP);         // [splits][kHeads]
  float* inv_denom_s = factor_s + kMaxMmaSplits * kHeads;           // [kHeads]
  float* cos_s = inv_denom_s + kHeads;                              // [rope_dim / 2]
  float* sin_s = cos_s + kDim / 2;
#pragma unroll
  for (int mt = 0; mt < kHeads / 16; ++mt)
#pragma unroll
    for (int hr = 0; hr < 2; ++hr)
#pragma unroll
      for (int nt = 0; nt < kDimTiles; ++nt)
        *reinterpret_cast<float2*>(o_s + (16 * mt + g + 8 * hr) * kDim + warp * kWarpDims + 8 * nt + 2 * tq) =
            make_float2(o[mt][nt][2 * hr], o[mt][nt][2 * hr + 1]);
  cluster.sync();  // every block's O, m and l are final

  if (threadIdx.x < kHeads && h0 + int(threadIdx.x) < p.heads) {
    const int hl = threadIdx.x;
    float m[kMaxMmaSplits], l[kMaxMmaSplits];  // every block's (max, sum) of this head: loads in flight together
#pragma unroll
    for (int b = 0; b < kMaxMmaSplits; ++b)
      if (b < splits) m[b] = cluster.map_shared_rank(m_s, b)[hl], l[b] = cluster.map_shared_rank(l_s, b)[hl];
    const float sink = p.sink[h0 + hl];
    float mx = sink;
#pragma unroll
    for (int b = 0; b < kMaxMmaSplits; ++b)
      if (b < splits) mx = fmaxf(mx, m[b]);
    float denom = expf(sink - mx);
#pragma unroll
    for (int b = 0; b < kMaxMmaSplits; ++b)
      if (b < splits) {
        const float f = l[b] > 0 ? expf(m[b] - mx) : 0.0f;
        factor_s[b * kHeads + hl] = f;
        denom += l[b] * f;
      }
    inv_denom_s[hl] = 1.0f / denom;
  }
  fill_rope_table(p, pos, cos_s, sin_s);
  __syncthreads();

  const int heads_per_group = p.heads / p.groups, width = heads_per_group * kDim, rope0 = kDim - p.rope_dim;
  for (int gi = split + splits * int(threadIdx.x); gi < kGroups; gi += splits * int(blockDim.x)) {
    const int hl = gi / (kDim / 4), d = (gi % (kDim / 4)) * 4, h = h0 + hl;
    if (h >= p.heads) continue;
    float4 v[kMaxMmaSplits];  // loads in flight together, then added in block order
#pragma unroll
    for (int b = 0; b < kMaxMmaSplits; ++b)
      if (b < splits) v[b] = *reinterpret_cast<const float4*>(cluster.map_shared_rank(o_s, b) + hl * kDim + d);
    float4 acc = make_float4(0, 0, 0, 0);
#pragma unroll
    for (int b = 0; b < kMaxMmaSplits; ++b)
      if (b < splits) {
        const float f = factor_s[b * kHeads + hl];
        acc.x = fmaf(v[b].x, f, acc.x), acc.y = fmaf(v[b].y, f, acc.y), acc.z = fmaf(v[b].z, f, acc.z),
        acc.w = fmaf(v[b].w, f, acc.w);
      }
    const float inv = inv_denom_s[hl];
    float out[4] = {acc.x * inv, acc.y * inv, acc.z * inv, acc.w * inv};
    if (d >= rope0) {  // rope0 is even: the float4 holds the pairs (d, d + 1) and (d + 2, d + 3)
      const int i = (d - rope0) / 2;
      rotate_pair(out[0], out[1], cos_s[i], sin_s[i]);
      rotate_pair(out[2], out[3], cos_s[i + 1], sin_s[i + 1]);
    }
    uint16_t* dst = p.out + (int64_t(h / heads_per_group) * (p.out_rows ? p.out_rows : p.n) + t) * width +
                    (h % heads_per_group) * kDim + d;
    *reinterpret_cast<uint2*>(dst) = make_uint2(pack_bf16(out[0], out[1]), pack_bf16(out[2], out[3]));
  }
  cluster.sync();  // the partials must outlive the other blocks' reads
}

// p.q_norm_rope: Q as the q-side projection left it. Warp w takes heads kHeads / 8 · w .. whole (lane: elements
// 4·(lane + 32u)), and does what the q row op would (row_op_block in ops_rows.cu, norm without weight, then RoPE at
// the query position): x · (mean(x²) + eps)^-½ with the sum of squares in fp64, the rotation of each pair of the
// last rope_dim elements by the fp32 angle position · inv_freq (cos / sin through double); then bf16 into shared
// memory.
// All loads (8 heads x kDim / 128 float4 per lane) are issued before the first use, like the plain Q load.
template <int kDim, int kHeads>
__device__ void load_q_normed(const AttentionParams& p, int t, int h0, int64_t pos, uint16_t* q_s) {
  constexpr int kStride = MmaLayout<kDim, kHeads>::kStride, kPerLane = kDim / 128, kWarpHeads = kHeads / kMmaWarps;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nope = kDim - p.rope_dim;
  float4 v[kWarpHeads][kPerLane];
#pragma unroll
  for (int hh = 0; hh < kWarpHeads; ++hh) {
    const int h = h0 + warp * kWarpHeads + hh;
#pragma unroll
    for (int u = 0; u < kPerLane; ++u)
      v[hh][u] = h < p.heads ? *reinterpret_cast<const float4*>(p.q + t * p.q_token_stride + int64_t(h) * kDim +
                                                                 4 * (lane + 32 * u))
                             : make_float4(0, 0, 0, 0);
  }
  // The angles do not depend on the head: the lane's pairs (4·(lane + 32u) + 2k, + 1) once, while the loads fly.
  float cos_a[kPerLane][2], sin_a[kPerLane][2];
#pragma unroll
  for (int u = 0; u < kPerLane; ++u)
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      const int d = 4 * (lane + 32 * u) + 2 * k;
      cos_a[u][k] = 1.0f, sin_a[u][k] = 0.0f;
      if (d >= nope) {
        double sn, c;
        sincos(double(__fmul_rn(float(pos), p.inv_freq[(d - nope) / 2])), &sn, &c);
        cos_a[u][k] = float(c), sin_a[u][k] = float(sn);
      }
    }
#pragma unroll
  for (int hh = 0; hh < kWarpHeads; ++hh) {
    double ss = 0;
#pragma unroll
    for (int u = 0; u < kPerLane; ++u) {
      const float4 q = v[hh][u];
      ss += double(q.x) * q.x + double(q.y) * q.y + double(q.z) * q.z + double(q.w) * q.w;
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    const float inv_rms = 1.0f / sqrtf(float(ss / kDim) + p.q_eps);
#pragma unroll
    for (int u = 0; u < kPerLane; ++u) {
      float e[4] = {__fmul_rn(v[hh][u].x, inv_rms), __fmul_rn(v[hh][u].y, inv_rms), __fmul_rn(v[hh][u].z, inv_rms),
                    __fmul_rn(v[hh][u].w, inv_rms)};
      const int d = 4 * (lane + 32 * u);
      if (d >= nope) rotate_pair(e[0], e[1], cos_a[u][0], sin_a[u][0]);
      if (d + 2 >= nope) rotate_pair(e[2], e[3], cos_a[u][1], sin_a[u][1]);
      *reinterpret_cast<uint2*>(q_s + (warp * kWarpHeads + hh) * kStride + d) =
          make_uint2(pack_bf16(e[0], e[1]), pack_bf16(e[2], e[3]));
    }
  }
}

template <int kDim, int kHeads>
__global__ void __launch_bounds__(kMmaWarps * 32, kHeads == kMmaHeads ? 1 : 2)
    attention_mma_kernel(AttentionParams p, int splits) {
  gpu::dependent_enter();
  using L = MmaLayout<kDim, kHeads>;
  constexpr int kStride = L::kStride, kPStride = L::kPStride;
  constexpr int kWarpDims = kDim / kMmaWarps, kDimTiles = kWarpDims / 8;  // PV: this warp's dims
  constexpr int kHeadTiles = kHeads / 16;  // of 16 heads: the mma's rows
  // S = QKᵀ: warps of 16 heads x 32 keys (head tile warp % kHeadTiles, key half warp / kHeadTiles); with 16 heads
  // only warps 0 and 1 compute S, the others wait at the barriers (kMmaDecodeHeads: the same bits as 64 heads).
  constexpr int kSWarps = 2 * kHeadTiles;
  static_assert(kWarpDims % 16 == 0, "two dim tiles per ldmatrix");
  static_assert(kHeads % 16 == 0 && kSWarps <= kMmaWarps, "whole head tiles, at most one S tile per warp");
  extern __shared__ __align__(16) unsigned char smem[];
  uint16_t* q_s = reinterpret_cast<uint16_t*>(smem + L::kQ);
  uint16_t* k_s = reinterpret_cast<uint16_t*>(smem + L::kK);
  uint16_t* p_s = reinterpret_cast<uint16_t*>(smem + L::kP);
  float* red_max = reinterpret_cast<float*>(smem + L::kStats);  // [2][kHeads]
  float* red_sum = red_max + 2 * kHeads;                         // [2][kHeads]
  float* m_s = red_sum + 2 * kHeads;                             // [kHeads] running max
  float* l_s = m_s + kHeads;                                     // [kHeads] running sum

  const int split = blockIdx.x, t = blockIdx.y, h0 = blockIdx.z * kHeads;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, tq = lane & 3;
  const KeyRange r = key_range(p, t);
  store_own_key(p, r, t);
  // This block's key tiles: split, split + splits, ... (decode rows: a cluster of `splits` blocks), or all of them.
  const int n_keys = r.n_window + r.n_comp;
  const bool has_keys = split * kMmaKeys < n_keys;

  if (has_keys && p.q_norm_rope) load_q_normed<kDim, kHeads>(p, t, h0, r.pos, q_s);
  // Q rows (heads past p.heads are zero) as bf16. Loads are issued 32 at a time before their stores: the global
  // pointers could alias shared memory as far as the compiler knows, so it would not hoist them itself.
  constexpr int kQLoads = kHeads * kDim / 4 / (kMmaWarps * 32), kQBatch = kQLoads < 32 ? kQLoads : 32;
  static_assert(kQLoads % kQBatch == 0);
  for (int i0 = 0; has_keys && !p.q_norm_rope && i0 < kQLoads; i0 += kQBatch) {
    float4 v[kQBatch];
#pragma unroll
    for (int i = 0; i < kQBatch; ++i) {
      const int idx = threadIdx.x + (i0 + i) * kMmaWarps * 32, h = idx / (kDim / 4), d = (idx % (kDim / 4)) * 4;
      v[i] = h0 + h < p.heads
                 ? *reinterpret_cast<const float4*>(p.q + t * p.q_token_stride + int64_t(h0 + h) * kDim + d)
                 : make_float4(0, 0, 0, 0);
    }
#pragma unroll
    for (int i = 0; i < kQBatch; ++i) {
      const int idx = threadIdx.x + (i0 + i) * kMmaWarps * 32, h = idx / (kDim / 4), d = (idx % (kDim / 4)) * 4;
      *reinterpret_cast<uint2*>(q_s + h * kStride + d) = make_uint2(pack_bf16(v[i].x, v[i].y), pack_bf16(v[i].z, v[i].w));
    }
  }
  if (threadIdx.x < kHeads) {
    m_s[threadIdx.x] = -INFINITY;
    l_s[threadIdx.x] = 0.0f;
  }

  const bool s_warp = warp < kSWarps;
  const int s_heads = 16 * (warp % kHeadTiles), s_keys = 32 * (warp / kHeadTiles % 2);  // S: heads, keys of a tile
  const int d0 = warp * kWarpDims;                                                     // PV: this warp's dims
  float o[kHeadTiles][kDimTiles][4];
#pragma unroll
  for (int mt = 0; mt < kHeadTiles; ++mt)
#pragma unroll
    for (int nt = 0; nt < kDimTiles; ++nt) o[mt][nt][0] = o[mt][nt][1] = o[mt][nt][2] = o[mt][nt][3] = 0.0f;

  for (int j0 = split * kMmaKeys; j0 < n_keys; j0 += splits * kMmaKeys) {
    // Keys j0 .. j0 + 63 (zeros past n_keys; their logits are masked below). Warp w loads keys w, w + 8, ...: lane
    // e < 8 finds key w + 8e (an indexer pick is one more load), then four keys' loads at a time are in flight
    // before their stores (see the Q loads).
    constexpr int kPerLane = kDim / 128;  // float4 of one key per lane
    constexpr int kWarpKeys = kMmaKeys / kMmaWarps, kBatch = 4;
    const float* my_key = nullptr;
    if (lane < kWarpKeys) {
      const int j = j0 + warp + kMmaWarps * lane;
      if (j < n_keys) my_key = key_ptr(p, r, t, j);
    }
    for (int i0 = 0; i0 < kWarpKeys; i0 += kBatch) {
      float4 v[kBatch][kPerLane];
#pragma unroll
      for (int e = 0; e < kBatch; ++e) {
        const float* key = reinterpret_cast<const float*>(
            __shfl_sync(0xffffffffu, reinterpret_cast<uintptr_t>(my_key), i0 + e));
#pragma unroll
        for (int u = 0; u < kPerLane; ++u)
          v[e][u] = key ? reinterpret_cast<const float4*>(key)[lane + 32 * u] : make_float4(0, 0, 0, 0);
      }
#pragma unroll
      for (int e = 0; e < kBatch; ++e)
#pragma unroll
        for (int u = 0; u < kPerLane; ++u)
          *reinterpret_cast<uint2*>(k_s + (warp + kMmaWarps * (i0 + e)) * kStride + 4 * (lane + 32 * u)) =
              make_uint2(pack_bf16(v[e][u].x, v[e][u].y), pack_bf16(v[e][u].z, v[e][u].w));
    }
    __syncthreads();  // (A) the tile, Q, and the running max / sum of the previous tile

    // S = Q Kᵀ for heads s_heads.. and keys s_keys.. (4 key tiles of 8).
    float s[4][4];
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
#pragma unroll 4
    for (int ks = 0; ks < (s_warp ? kDim / 16 : 0); ++ks) {
      uint32_t a[4], b[2][4];
      ldmatrix_x4(a, q_s + (s_heads + (lane & 15)) * kStride + ks * 16 + (lane >> 4) * 8);
#pragma unroll
      for (int half = 0; half < 2; ++half) {  // key tiles 2·half, 2·half + 1: matrices (tile, dims 0-7 / 8-15)
        const int mat = lane >> 3, key = s_keys + 16 * half + (mat >> 1) * 8 + (lane & 7);
        ldmatrix_x4(b[half], k_s + key * kStride + ks * 16 + (mat & 1) * 8);
      }
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) mma_bf16(s[nt], a, b[nt >> 1][2 * (nt & 1)], b[nt >> 1][2 * (nt & 1) + 1]);
    }
    // Rows g and g + 8 of the warp's heads; columns 2·tq, 2·tq + 1 of each key tile.
    float row_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int key = j0 + s_keys + 8 * nt + 2 * tq + (e & 1);
        s[nt][e] = key < n_keys ? s[nt][e] * p.scale : -INFINITY;
        row_max[e >> 1] = fmaxf(row_max[e >> 1], s[nt][e]);
      }
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      row_max[hr] = fmaxf(row_max[hr], __shfl_xor_sync(0xffffffffu, row_max[hr], 1));
      row_max[hr] = fmaxf(row_max[hr], __shfl_xor_sync(0xffffffffu, row_max[hr], 2));
      if (tq == 0 && s_warp) red_max[(warp / kHeadTiles) * kHeads + s_heads + g + 8 * hr] = row_max[hr];
    }
    __syncthreads();  // (B) both key halves' maxima
    float row_sum[2] = {0.0f, 0.0f};
#pragma unroll
    for (int hr = 0; hr < 2 && s_warp; ++hr) {
      const int h = s_heads + g + 8 * hr;
      const float m_new = fmaxf(m_s[h], fmaxf(red_max[h], red_max[kHeads + h]));
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) {
        const float w0 = expf(s[nt][2 * hr] - m_new), w1 = expf(s[nt][2 * hr + 1] - m_new);
        row_sum[hr] += w0 + w1;
        *reinterpret_cast<uint32_t*>(p_s + h * kPStride + s_keys + 8 * nt + 2 * tq) = pack_bf16(w0, w1);
      }
      row_sum[hr] += __shfl_xor_sync(0xffffffffu, row_sum[hr], 1);
      row_sum[hr] += __shfl_xor_sync(0xffffffffu, row_sum[hr], 2);
      if (tq == 0) red_sum[(warp / kHeadTiles) * kHeads + h] = row_sum[hr];
    }
    __syncthreads();  // (C) P and the sums

    // O = O · exp(m_old - m_new) + P V for all heads, dims d0 .. d0 + kWarpDims - 1.
#pragma unroll
    for (int mt = 0; mt < kHeadTiles; ++mt)
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        const int h = 16 * mt + g + 8 * hr;
        const float m_old = m_s[h], m_new = fmaxf(m_old, fmaxf(red_max[h], red_max[kHeads + h]));
        const float alpha = expf(m_old - m_new);  // 0 while m_old is -inf
#pragma unroll
        for (int nt = 0; nt < kDimTiles; ++nt) o[mt][nt][2 * hr] *= alpha, o[mt][nt][2 * hr + 1] *= alpha;
      }
#pragma unroll 1
    for (int ks = 0; ks < kMmaKeys / 16; ++ks) {
      uint32_t a[kHeadTiles][4];
#pragma unroll
      for (int mt = 0; mt < kHeadTiles; ++mt)
        ldmatrix_x4(a[mt], p_s + (16 * mt + (lane & 15)) * kPStride + ks * 16 + (lane >> 4) * 8);
#pragma unroll
      for (int np = 0; np < kDimTiles / 2; ++np) {  // dim tiles 2·np, 2·np + 1: matrices (keys 0-7 / 8-15, tile)
        const int mat = lane >> 3, key = ks * 16 + (mat & 1) * 8 + (lane & 7);
        uint32_t b[4];
        ldmatrix_x4_trans(b, k_s + key * kStride + d0 + 16 * np + (mat >> 1) * 8);
#pragma unroll
        for (int mt = 0; mt < kHeadTiles; ++mt) {
          mma_bf16(o[mt][2 * np], a[mt], b[0], b[1]);
          mma_bf16(o[mt][2 * np + 1], a[mt], b[2], b[3]);
        }
      }
    }
    __syncthreads();  // (D) every warp is done with K, P and the old running max
    if (threadIdx.x < kHeads) {
      const int h = threadIdx.x;
      const float m_old = m_s[h], m_new = fmaxf(m_old, fmaxf(red_max[h], red_max[kHeads + h]));
      l_s[h] = l_s[h] * expf(m_old - m_new) + red_sum[h] + red_sum[kHeads + h];
      m_s[h] = m_new;
    }
  }
  __syncthreads();

  if (splits > 1) {
    cluster_merge<kDim, kHeads>(p, o, m_s, l_s, smem, split, splits, t, h0, r.pos);
    return;
  }

  // Sink (a virtual key with zero value), normalisation, inverse RoPE on the last rope_dim dims, bf16 out.
  float* cos_s = reinterpret_cast<float*>(smem + L::kP);  // P is free now
  float* sin_s = cos_s + kDim / 2;
  fill_rope_table(p, r.pos, cos_s, sin_s);
  __syncthreads();
  const int heads_per_group = p.heads / p.groups, width = heads_per_group * kDim;
  const int rope0 = kDim - p.rope_dim;
#pragma unroll
  for (int mt = 0; mt < kHeadTiles; ++mt)
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int hl = 16 * mt + g + 8 * hr, h = h0 + hl;
      if (h >= p.heads) continue;
      const float sink = p.sink[h], m = m_s[hl], mx = fmaxf(sink, m);
      const float factor = expf(m - mx), scale = factor / (l_s[hl] * factor + expf(sink - mx));
      uint16_t* out = p.out + (int64_t(h / heads_per_group) * (p.out_rows ? p.out_rows : p.n) + t) * width +
                      (h % heads_per_group) * kDim;
#pragma unroll
      for (int nt = 0; nt < kDimTiles; ++nt) {
        const int d = d0 + 8 * nt + 2 * tq;
        float a = o[mt][nt][2 * hr] * scale, b = o[mt][nt][2 * hr + 1] * scale;
        if (d >= rope0) rotate_pair(a, b, cos_s[(d - rope0) / 2], sin_s[(d - rope0) / 2]);
        *reinterpret_cast<uint32_t*>(out + d) = pack_bf16(a, b);
      }
    }
}
}  // namespace

namespace {

// The head-group kernel reads each key once for 16 heads but runs its 8 warps as long dependent chains through
// shared memory; the per-head kernel has many short blocks. Measured on Flash shapes (H200, docs/perf.md): per
// head faster at 1 row (24 vs 28 µs per layer), head groups faster at 8 rows (70 vs 77 µs), 32 rows (190 vs
// 278 µs) and for prefill chunks.
bool use_head_groups(const AttentionParams& p) { return int64_t(p.n) * p.heads >= kGroupKernelMinRowHeads; }

}  // namespace

bool attention_uses_tensor_cores(const AttentionParams& p) {
  return (p.dim == 512 || p.dim == 128) && p.rope_dim % 2 == 0;
}

bool attention_can_norm_q(int dim, int rope_dim) {
  return (dim == 512 || dim == 128) && rope_dim >= 0 && rope_dim <= dim && (dim - rope_dim) % 4 == 0 &&
         rope_dim % 2 == 0;
}

namespace {

int g_decode_block_heads = 0;  // set_attention_decode_block_heads; 0: mma_block_heads' rule

// Heads per block of the tensor-core kernel: 64 for prefill chunks (their blocks fill the GPU anyway and each key
// tile serves 64 heads); decode rows 16 while the launch stays within two blocks per SM, else 64 (the four head
// groups of a row each read all its keys).
int mma_block_heads(const AttentionParams& p, int splits) {
  if (p.n >= kMmaMinRows) return kMmaHeads;
  if (g_decode_block_heads) return g_decode_block_heads;
  const int64_t blocks = int64_t(splits) * p.n * ((p.heads + kMmaDecodeHeads - 1) / kMmaDecodeHeads);
  return blocks <= 2 * current_sm_count() ? kMmaDecodeHeads : kMmaHeads;
}

template <int kDim, int kHeads>
void launch_mma(const AttentionParams& p, int splits, cudaStream_t stream) {
  const size_t smem = MmaLayout<kDim, kHeads>::kBytes;
  const cudaError_t configured = gpu::allow_dynamic_smem<attention_mma_kernel<kDim, kHeads>>(int(smem));
  OPS_CHECK(configured == cudaSuccess, "attention: cannot give the tensor-core kernel %zu bytes of shared memory",
            smem);
  const cudaError_t err = gpu::launch_ex(attention_mma_kernel<kDim, kHeads>,
                                         dim3(splits, p.n, (p.heads + kHeads - 1) / kHeads), kMmaWarps * 32, smem,
                                         unsigned(splits), stream, p, splits);
  OPS_CHECK(err == cudaSuccess, "attention: tensor-core launch (%d-block clusters of %d heads) failed: %s", splits,
            kHeads, cudaGetErrorString(err));
}

template <int kDim>
void launch_mma(const AttentionParams& p, cudaStream_t stream) {
  const int splits = attention_splits(p);
  if (mma_block_heads(p, splits) == kMmaDecodeHeads)
    launch_mma<kDim, kMmaDecodeHeads>(p, splits, stream);
  else
    launch_mma<kDim, kMmaHeads>(p, splits, stream);
}

}  // namespace

int attention_splits(const AttentionParams& p) {
  const int64_t comp = p.ratio == 0 ? 0 : p.selected ? p.topk : std::max(p.max_entries, 0);
  const int64_t max_keys = p.window + comp, sms = current_sm_count();
  if (attention_uses_tensor_cores(p)) {
    // Prefill chunks fill the GPU with (head group, token) blocks. Decode rows spread their key tiles over a
    // cluster of as many blocks as the longest row has tiles, up to 8, whatever the number of rows (a batched row
    // then matches the same row decoded alone, bit for bit).
    if (p.n >= kMmaMinRows) return 1;
    return int(std::clamp<int64_t>((max_keys + kMmaKeys - 1) / kMmaKeys, 1, kMaxMmaSplits));
  }
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

void set_attention_decode_block_heads(int heads) {
  OPS_CHECK(heads == 0 || heads == kMmaDecodeHeads || heads == kMmaHeads,
            "set_attention_decode_block_heads: %d heads (0, %d or %d)", heads, kMmaDecodeHeads, kMmaHeads);
  g_decode_block_heads = heads;
}

int attention_block_heads(const AttentionParams& p) {
  return attention_uses_tensor_cores(p) ? mma_block_heads(p, attention_splits(p)) : 0;
}

size_t attention_scratch_floats(const AttentionParams& p) {
  if (attention_uses_tensor_cores(p)) return 0;  // its splits merge in shared memory
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
  OPS_CHECK(!p.q_norm_rope || attention_can_norm_q(p.dim, p.rope_dim),
            "attention: q_norm_rope needs the tensor-core kernel (head dim 512 or 128, got %d) and rope_dim %d with "
            "head_dim - rope_dim a multiple of 4", p.dim, p.rope_dim);
  const int splits = attention_splits(p);
  OPS_CHECK(splits == 1 || p.scratch || attention_uses_tensor_cores(p),
            "attention: %d key splits need scratch (attention_scratch_floats)", splits);
  if (attention_uses_tensor_cores(p)) {
    if (p.dim == 512)
      launch_mma<512>(p, stream);
    else
      launch_mma<128>(p, stream);
  } else if (!use_head_groups(p)) {
    gpu::launch(attention_head_kernel, dim3(p.heads, p.n, splits), kAttnWarps * 32, 0, stream, p, splits);
  } else {
    const dim3 grid((p.heads + kBlockHeads - 1) / kBlockHeads, p.n, splits);
    if (p.dim == kMaxHeadDim)
      gpu::launch(attention_group_kernel<kMaxPerLane>, grid, kAttnWarps * 32, 0, stream, p, splits);
    else
      gpu::launch(attention_group_kernel<0>, grid, kAttnWarps * 32, 0, stream, p, splits);
  }
  DSV4_CUDA_LAUNCHED();
  if (splits == 1 || attention_uses_tensor_cores(p)) return;
  gpu::launch(attention_merge_kernel, dim3(p.heads, p.n), kMergeThreads, 0, stream, p, splits);
  DSV4_CUDA_LAUNCHED();
}

}  // namespace dsv4::gpu
