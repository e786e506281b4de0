// SPDX-License-Identifier: MIT
// Sequence kernels of the forward pass: KV compressors, the lightning indexer with its top-k, the MoE router and
// the SwiGLU between the experts' projections. Sparse attention is in attention.cu.
#include <cmath>

#include "cuda/ops.h"
#include "cuda/ops_common.cuh"

namespace dsv4::gpu {
namespace {

using detail::blocks_for;
using detail::unpack_bf16x8;
using detail::warp_sum;

constexpr int kMaxHeadDim = 512;
constexpr int kMaxPerLane = kMaxHeadDim / 32;
constexpr int kMaxTopK = 16;  // experts per token

// One thread per column j < dim (and its partner dim + j of the second series when overlapped); columns never
// interact, so the chunk's tokens are walked in order without block synchronisation.
__global__ void compressor_kernel(CompressorParams p) {
  const int j = blockIdx.x * blockDim.x + threadIdx.x;
  if (j >= p.dim) return;
  const int r = p.ratio, d = p.dim, width = p.overlap ? 2 * d : d, n_rows = p.overlap ? 2 * r : r;
  const int n_cols = p.overlap ? 2 : 1;
  const int64_t pos0 = p.pos_device ? *p.pos_device : p.pos0;
  for (int t = 0; t < p.n; ++t) {
    const int64_t pos = pos0 + t;
    const int i = int(pos % r), row = p.overlap ? r + i : i;
    for (int c = 0; c < n_cols; ++c) {
      const int col = j + c * d;
      p.state_kv[row * width + col] = p.kv_in[t * p.in_stride + col];
      p.state_score[row * width + col] = p.gate_in[t * p.in_stride + col] + p.ape[i * width + col];
    }
    if ((pos + 1) % r != 0) continue;
    float mx = -INFINITY;
    for (int rr = 0; rr < n_rows; ++rr) {
      const int col = p.overlap && rr >= r ? d + j : j;
      mx = fmaxf(mx, p.state_score[rr * width + col]);
    }
    float sum = 0, acc = 0;
    for (int rr = 0; rr < n_rows; ++rr) {
      const int col = p.overlap && rr >= r ? d + j : j;
      const float e = expf(p.state_score[rr * width + col] - mx);
      sum = __fadd_rn(sum, e);
      acc = __fadd_rn(acc, __fmul_rn(e, p.state_kv[rr * width + col]));
    }
    p.entries[(pos / r) * d + j] = acc / sum;
    if (p.overlap)
      for (int rr = 0; rr < r; ++rr)
        for (int c = 0; c < n_cols; ++c) {
          const int col = j + c * d;
          p.state_kv[rr * width + col] = p.state_kv[(r + rr) * width + col];
          p.state_score[rr * width + col] = p.state_score[(r + rr) * width + col];
        }
  }
}

// The indexer in two launches: scores spread over (query, 32-key slice) blocks, then one block per query ranks
// them. The ranking is O(n_visible²) per query: a radix select would replace it for very long contexts.
constexpr int kIndexEntriesPerBlock = 32;  // 8 warps x 4 keys: a decode query spreads over many SMs
constexpr int kSelectThreads = 1024;

// Scores of keys [blockIdx.y · 32, +32) for query blockIdx.x: a warp per key, the key held in registers (lane i
// owns elements i + 32·e) while the heads are summed in order.
__global__ void indexer_scores_kernel(IndexerTopkParams p) {
  extern __shared__ float q[];  // [heads, dim]
  const int t = blockIdx.x, lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
  const int64_t pos = (p.pos_device ? *p.pos_device : p.pos0) + t;
  const int n_visible = int((pos + 1) / p.ratio);
  const int s0 = blockIdx.y * kIndexEntriesPerBlock;
  if (s0 >= n_visible) return;  // the whole block: graph replays launch the grid for max_entries
  const float* qt = p.q + t * p.q_token_stride;
  for (int i = threadIdx.x; i < p.heads * p.dim; i += blockDim.x) q[i] = qt[i];
  __syncthreads();
  float* score = p.scores + int64_t(t) * p.max_entries;
  const int per_lane = p.dim / 32;
  for (int s = s0 + warp; s < min(s0 + kIndexEntriesPerBlock, n_visible); s += n_warps) {
    const float* k = p.keys + int64_t(s) * p.dim;
    float kr[kMaxPerLane];
#pragma unroll
    for (int e = 0; e < kMaxPerLane; ++e) kr[e] = e < per_lane ? k[lane + 32 * e] : 0.0f;
    float acc = 0;
    for (int h = 0; h < p.heads; ++h) {
      float dot = 0;
#pragma unroll
      for (int e = 0; e < kMaxPerLane; ++e)
        if (e < per_lane) dot += q[h * p.dim + lane + 32 * e] * kr[e];
      dot = warp_sum(dot);
      acc += p.w[t * p.heads + h] * p.w_scale * fmaxf(dot, 0.0f);
    }
    if (lane == 0) score[s] = acc;
  }
}

// Each score's rank (the number of scores that beat it, ties to the lower index) places it in the top-k list.
// O(n_visible²) per query over 1024 threads.
__global__ void indexer_select_kernel(IndexerTopkParams p) {
  const int t = blockIdx.x;
  const int64_t pos = (p.pos_device ? *p.pos_device : p.pos0) + t;
  const int n_visible = int((pos + 1) / p.ratio);
  const float* score = p.scores + int64_t(t) * p.max_entries;
  for (int s = threadIdx.x; s < n_visible; s += blockDim.x) {
    const float v = score[s];
    int rank = 0;
    for (int s2 = 0; s2 < n_visible && rank < p.topk; ++s2) {
      const float v2 = score[s2];
      rank += (v2 > v) || (v2 == v && s2 < s);
    }
    if (rank < p.topk) p.selected[t * p.topk + rank] = s;
  }
}

// One block per token; thread 0 picks the experts sequentially (k passes over E) exactly like top_k_indices.
__global__ void router_kernel(RouterParams p) {
  extern __shared__ float s[];  // [E]
  __shared__ int picks[kMaxTopK];
  const int t = blockIdx.x, E = p.experts, k = p.k;
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    const float v = p.logits[int64_t(t) * E + e];
    if (p.scoring == 0) s[e] = sqrtf(v > 20.0f ? v : log1pf(expf(v)));
    else if (p.scoring == 1) s[e] = detail::sigmoid(v);
    else s[e] = v;
  }
  __syncthreads();
  if (threadIdx.x != 0) return;
  if (p.scoring == 2) {
    float mx = -INFINITY, sum = 0;
    for (int e = 0; e < E; ++e) mx = fmaxf(mx, s[e]);
    for (int e = 0; e < E; ++e) sum += (s[e] = expf(s[e] - mx));
    for (int e = 0; e < E; ++e) s[e] /= sum;
  }
  if (p.tid2eid) {
    for (int i = 0; i < k; ++i) picks[i] = p.tid2eid[int64_t(p.tokens[t]) * k + i];
  } else {
    for (int i = 0; i < k; ++i) {
      int best = -1;
      float best_v = 0;
      for (int e = 0; e < E; ++e) {
        bool taken = false;
        for (int q = 0; q < i; ++q) taken |= picks[q] == e;
        if (taken) continue;
        const float v = s[e] + (p.bias ? p.bias[e] : 0.0f);
        if (best < 0 || v > best_v) best = e, best_v = v;
      }
      picks[i] = best;
    }
  }
  float sum = 0;
  for (int i = 0; i < k; ++i) sum += s[picks[i]];
  for (int i = 0; i < k; ++i) {
    const float w = s[picks[i]];
    p.ids[t * k + i] = picks[i];
    p.weights[t * k + i] = (p.norm_topk ? w / sum : w) * p.routed_scale;
  }
}

__global__ void swiglu_kernel(SwigluParams p) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= int64_t(p.rows) * p.inter) return;
  const int r = int(i / p.inter), j = int(i % p.inter);
  float g = p.gate[r * p.ld + j], u = p.up[r * p.ld + j];
  if (p.limit > 0) {  // gate clamped from above only, up on both sides
    g = fminf(g, p.limit);
    u = fminf(fmaxf(u, -p.limit), p.limit);
  }
  const float w = p.weights ? p.weights[r] : 1.0f;
  p.h[i] = f32_to_bf16(g / (1.0f + expf(-g)) * u * w);
}

}  // namespace

void compressor_advance(const CompressorParams& p, cudaStream_t stream) {
  if (p.n == 0) return;
  OPS_CHECK(p.ratio > 0 && p.dim > 0, "compressor_advance: ratio %d and dim %d must be positive", p.ratio, p.dim);
  compressor_kernel<<<blocks_for(p.dim, 128), 128, 0, stream>>>(p);
  DSV4_CUDA_LAUNCHED();
}

void indexer_topk(const IndexerTopkParams& p, cudaStream_t stream) {
  if (p.n == 0) return;
  OPS_CHECK(p.ratio > 0 && p.topk > 0, "indexer_topk: ratio %d and topk %d must be positive", p.ratio, p.topk);
  OPS_CHECK(p.heads * p.dim <= 12288, "indexer_topk: heads x dim = %d exceeds 12288 (shared memory)",
            p.heads * p.dim);
  OPS_CHECK(p.dim % 32 == 0 && p.dim <= kMaxHeadDim, "indexer_topk: dim %d must be a multiple of 32 and <= %d",
            p.dim, kMaxHeadDim);
  OPS_CHECK(p.max_entries > 0, "indexer_topk: max_entries %d must be positive", p.max_entries);
  const dim3 grid(p.n, blocks_for(p.max_entries, kIndexEntriesPerBlock));
  indexer_scores_kernel<<<grid, 256, p.heads * p.dim * sizeof(float), stream>>>(p);
  DSV4_CUDA_LAUNCHED();
  indexer_select_kernel<<<p.n, kSelectThreads, 0, stream>>>(p);
  DSV4_CUDA_LAUNCHED();
}

void router(const RouterParams& p, cudaStream_t stream) {
  if (p.n == 0) return;
  OPS_CHECK(p.k > 0 && p.k <= kMaxTopK && p.k <= p.experts, "router: %d experts per token (at most %d, E = %d)",
            p.k, kMaxTopK, p.experts);
  OPS_CHECK(p.experts <= 12288, "router: %d experts exceed 12288 (shared memory)", p.experts);
  router_kernel<<<p.n, 256, p.experts * sizeof(float), stream>>>(p);
  DSV4_CUDA_LAUNCHED();
}

void swiglu(const SwigluParams& p, cudaStream_t stream) {
  if (p.rows == 0) return;
  OPS_CHECK(p.inter > 0 && p.ld >= p.inter, "swiglu: inter %d and row stride %lld", p.inter, (long long)p.ld);
  swiglu_kernel<<<blocks_for(int64_t(p.rows) * p.inter, 256), 256, 0, stream>>>(p);
  DSV4_CUDA_LAUNCHED();
}

}  // namespace dsv4::gpu
