// SPDX-License-Identifier: MIT
// Sparse attention with sink over the sliding window and the compressed entries (contract in ops.h).
#include <cmath>

#include "cuda/ops.h"
#include "cuda/ops_common.cuh"

namespace dsv4::gpu {
namespace {

using detail::warp_sum;

constexpr int kMaxHeadDim = 512;
constexpr int kMaxPerLane = kMaxHeadDim / 32;
constexpr int kAttnWarps = 8;  // a decode step has only heads x 1 blocks: more warps per block hide latency

// One block per (head, token); each warp runs an online softmax over a strided share of the keys with the
// query and its accumulator spread over the lanes (element lane + 32·e), then the warps are merged with the sink.
__global__ void attention_kernel(AttentionParams p) {
  __shared__ float warp_max[kAttnWarps], warp_sum_e[kAttnWarps], warp_factor[kAttnWarps], inv_denom;
  __shared__ float warp_acc[kAttnWarps][kMaxHeadDim];
  __shared__ float o[kMaxHeadDim];
  const int h = blockIdx.x, t = blockIdx.y, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int dim = p.dim, per_lane = dim / 32;
  const int64_t pos0 = p.pos_device ? *p.pos_device : p.pos0, pos = pos0 + t;
  const float* qv = p.q + t * p.q_token_stride + int64_t(h) * dim;
  float qr[kMaxPerLane], acc[kMaxPerLane];  // fully unrolled with guards, so they stay in registers
#pragma unroll
  for (int e = 0; e < kMaxPerLane; ++e) {
    qr[e] = e < per_lane ? qv[lane + 32 * e] : 0.0f;
    acc[e] = 0;
  }
  const int64_t first = pos - p.window + 1 > 0 ? pos - p.window + 1 : 0;
  const int n_window = int(pos - first + 1);
  int n_comp = p.ratio ? int((pos + 1) / p.ratio) : 0;
  if (p.selected && n_comp > p.topk) n_comp = p.topk;
  float m = -INFINITY, l = 0;
  for (int j = warp; j < n_window + n_comp; j += kAttnWarps) {
    const float* key;
    if (j < n_window) {
      const int64_t s = first + j;
      key = s >= pos0 ? p.kv_chunk + (s - pos0) * dim : p.window_ring + (s % p.window_slots) * dim;
    } else {
      const int c = j - n_window;
      key = p.compressed + int64_t(p.selected ? p.selected[t * p.topk + c] : c) * dim;
    }
    float kr[kMaxPerLane], dot = 0;
#pragma unroll
    for (int e = 0; e < kMaxPerLane; ++e) {
      kr[e] = e < per_lane ? key[lane + 32 * e] : 0.0f;
      dot += qr[e] * kr[e];
    }
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
  if (threadIdx.x == 0) {  // the sink is a virtual key with zero value: it only adds to the denominator
    const float sink = p.sink[h];
    float mx = sink;
    for (int w = 0; w < kAttnWarps; ++w) mx = fmaxf(mx, warp_max[w]);
    float denom = expf(sink - mx);
    for (int w = 0; w < kAttnWarps; ++w) {
      warp_factor[w] = warp_sum_e[w] > 0 ? expf(warp_max[w] - mx) : 0.0f;
      denom += warp_sum_e[w] * warp_factor[w];
    }
    inv_denom = 1.0f / denom;
  }
  __syncthreads();
  for (int i = threadIdx.x; i < dim; i += blockDim.x) {
    float v = 0;
    for (int w = 0; w < kAttnWarps; ++w) v += warp_acc[w][i] * warp_factor[w];
    o[i] = v * inv_denom;
  }
  __syncthreads();
  // V carries RoPE: de-rotate the last rope_dim dims at the query position (fp32 angle like the reference).
  float* rope = o + dim - p.rope_dim;
  for (int i = threadIdx.x; i < p.rope_dim / 2; i += blockDim.x) {
    const float angle = __fmul_rn(float(pos), p.inv_freq[i]);
    const float c = float(cos(double(angle))), s = -float(sin(double(angle)));
    const float a = rope[2 * i], b = rope[2 * i + 1];
    rope[2 * i] = __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s));
    rope[2 * i + 1] = __fadd_rn(__fmul_rn(a, s), __fmul_rn(b, c));
  }
  __syncthreads();
  const int heads_per_group = p.heads / p.groups, g = h / heads_per_group, width = heads_per_group * dim;
  uint16_t* out = p.out + (int64_t(g) * p.n + t) * width + (h % heads_per_group) * dim;
  for (int i = threadIdx.x; i < dim; i += blockDim.x) out[i] = f32_to_bf16(o[i]);
}

}  // namespace

void attention(const AttentionParams& p, cudaStream_t stream) {
  if (p.n == 0) return;
  OPS_CHECK(p.dim % 32 == 0 && p.dim <= kMaxHeadDim, "attention: head_dim %d must be a multiple of 32 and <= %d",
            p.dim, kMaxHeadDim);
  OPS_CHECK(p.groups > 0 && p.heads % p.groups == 0, "attention: %d heads do not split into %d groups", p.heads,
            p.groups);
  attention_kernel<<<dim3(p.heads, p.n), kAttnWarps * 32, 0, stream>>>(p);
  DSV4_CUDA_LAUNCHED();
}

}  // namespace dsv4::gpu
