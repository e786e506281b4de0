// SPDX-License-Identifier: MIT
// Sparse attention with sink over the sliding window and the compressed entries (contract in ops.h).
// A (token, head) has one query and at most window + top-k (or all compressed) keys, all heads reading the same
// keys (one shared K = V head). Prefill chunks have tokens x heads blocks, enough for the GPU; a decode step has
// only `heads` of them, so its keys are split over several blocks that each write an unnormalised partial
// (running max, sum of weights, weighted sum of keys) and a second kernel merges the partials with the sink.
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
constexpr int kKeysPerSplit = 64;  // 8 keys per warp: a few round trips to L2 per block
constexpr int kMaxSplits = 128;

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

// De-rotates the last rope_dim dims of o (V carries RoPE) at the query position, fp32 angle like the reference.
__device__ void inverse_rope(float* o, const AttentionParams& p, int64_t pos) {
  float* rope = o + p.dim - p.rope_dim;
  for (int i = threadIdx.x; i < p.rope_dim / 2; i += blockDim.x) {
    const float angle = __fmul_rn(float(pos), p.inv_freq[i]);
    const float c = float(cos(double(angle))), s = -float(sin(double(angle)));
    const float a = rope[2 * i], b = rope[2 * i + 1];
    rope[2 * i] = __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s));
    rope[2 * i + 1] = __fadd_rn(__fmul_rn(a, s), __fmul_rn(b, c));
  }
}

// o (normalised, de-rotated) -> bf16, grouped for the output projection [groups, n, heads_per_group · dim].
__device__ void store_grouped(const float* o, const AttentionParams& p, int h, int t) {
  const int heads_per_group = p.heads / p.groups, g = h / heads_per_group, width = heads_per_group * p.dim;
  uint16_t* out = p.out + (int64_t(g) * (p.out_rows ? p.out_rows : p.n) + t) * width + (h % heads_per_group) * p.dim;
  for (int i = threadIdx.x; i < p.dim; i += blockDim.x) out[i] = f32_to_bf16(o[i]);
}

// Block (h, t, split): keys [split · per, (split + 1) · per) of query t, per = ceil(keys / splits). Each warp runs
// an online softmax over a strided share of them with the query and accumulator spread over the lanes (element
// lane + 32·e), loading the next key before using the current one; the warps are then merged. One split: the
// sink is added and the output finished here; more: the partial goes to scratch for attention_merge_kernel.
__global__ void attention_kernel(AttentionParams p, int splits) {
  gpu::dependent_enter();
  __shared__ float warp_max[kAttnWarps], warp_sum_e[kAttnWarps], warp_factor[kAttnWarps], block_max, block_sum_e;
  __shared__ float warp_acc[kAttnWarps][kMaxHeadDim];
  __shared__ float o[kMaxHeadDim];
  const int h = blockIdx.x, t = blockIdx.y, split = blockIdx.z, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int dim = p.dim, per_lane = dim / 32;
  const KeyRange r = key_range(p, t);
  const int n_keys = r.n_window + r.n_comp, per = (n_keys + splits - 1) / splits;
  const int j0 = split * per, j1 = min(n_keys, j0 + per);
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
  inverse_rope(o, p, r.pos);
  __syncthreads();
  store_grouped(o, p, h, t);
}

// Block (h, t): merges the splits' partials of attention_kernel with the sink, then finishes like one split.
__global__ void attention_merge_kernel(AttentionParams p, int splits) {
  gpu::dependent_enter();
  __shared__ float factor[kMaxSplits];
  __shared__ float o[kMaxHeadDim];
  __shared__ float inv_denom;
  const int h = blockIdx.x, t = blockIdx.y, dim = p.dim;
  const float* parts = p.scratch + (int64_t(t) * p.heads + h) * splits * (dim + 2);
  if (threadIdx.x == 0) {
    const float sink = p.sink[h];
    float mx = sink;
    for (int s = 0; s < splits; ++s) mx = fmaxf(mx, parts[s * (dim + 2)]);
    float denom = expf(sink - mx);
    for (int s = 0; s < splits; ++s) {
      const float l = parts[s * (dim + 2) + 1];
      factor[s] = l > 0 ? expf(parts[s * (dim + 2)] - mx) : 0.0f;
      denom += l * factor[s];
    }
    inv_denom = 1.0f / denom;
  }
  __syncthreads();
  for (int i = threadIdx.x; i < dim; i += blockDim.x) {
    float v = 0;
    for (int s = 0; s < splits; ++s) v += parts[s * (dim + 2) + 2 + i] * factor[s];
    o[i] = v * inv_denom;
  }
  __syncthreads();
  inverse_rope(o, p, key_range(p, t).pos);
  __syncthreads();
  store_grouped(o, p, h, t);
}

}  // namespace

int attention_splits(const AttentionParams& p) {
  if (int64_t(p.n) * p.heads >= 2 * int64_t(current_sm_count())) return 1;  // enough blocks without splitting
  const int64_t comp = p.ratio == 0 ? 0 : p.selected ? p.topk : p.max_entries;
  const int64_t max_keys = p.window + comp;
  return int(std::min<int64_t>(kMaxSplits, std::max<int64_t>(1, (max_keys + kKeysPerSplit - 1) / kKeysPerSplit)));
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
  OPS_CHECK(p.ratio == 0 || p.selected || p.max_entries >= 0,
            "attention: max_entries must be set when all compressed entries are attended (ratio %d)", p.ratio);
  const int splits = attention_splits(p);
  OPS_CHECK(splits == 1 || p.scratch, "attention: %d key splits need scratch (attention_scratch_floats)", splits);
  gpu::launch(attention_kernel, dim3(p.heads, p.n, splits), kAttnWarps * 32, 0, stream, p, splits);
  DSV4_CUDA_LAUNCHED();
  if (splits == 1) return;
  gpu::launch(attention_merge_kernel, dim3(p.heads, p.n), 128, 0, stream, p, splits);
  DSV4_CUDA_LAUNCHED();
}

}  // namespace dsv4::gpu
