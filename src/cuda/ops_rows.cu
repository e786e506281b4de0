// SPDX-License-Identifier: MIT
// Row-wise kernels of the forward pass: norm / RoPE / storage rounding, small fp32 linears, embedding and the
// mHC pre / post / head mixes. Where the CPU reference's result depends on the order of fp32 operations
// (RoPE, the mHC collapse) the products and sums are written with explicit _rn intrinsics, so nvcc does not
// contract them into FMAs and the GPU rounds exactly like the CPU.
#include <cmath>

#include "cuda/ops.h"
#include "cuda/ops_common.cuh"
#include "formats/fp4.h"
#include "formats/fp8.h"

namespace dsv4::gpu {
namespace {

using detail::block_sum;
using detail::blocks_for;
using detail::sigmoid;

constexpr int kRowThreads = 128;
constexpr int kMaxHc = 8;

// Rotates the pairs of v[0..rope_dim) in place (threads of the block share the pairs).
__device__ void rope_pairs(float* v, int rope_dim, const float* inv_freq, int64_t position, bool inverse) {
  for (int i = threadIdx.x; i < rope_dim / 2; i += blockDim.x) {
    const float angle = __fmul_rn(float(position), inv_freq[i]);
    const float c = float(cos(double(angle)));
    const float s = inverse ? -float(sin(double(angle))) : float(sin(double(angle)));
    const float a = v[2 * i], b = v[2 * i + 1];
    v[2 * i] = __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s));
    v[2 * i + 1] = __fadd_rn(__fmul_rn(a, s), __fmul_rn(b, c));
  }
}

__global__ void row_op_kernel(RowOpParams p) {
  extern __shared__ float row[];
  const int r = blockIdx.x, t = r / p.heads, h = r % p.heads;
  int64_t pos0 = p.pos_device ? *p.pos_device : p.pos0, entry = 0;
  if (p.emit_ratio > 0) {  // decode step of a captured graph: finish entry pos / r only if this step completes it
    if ((pos0 + 1) % p.emit_ratio != 0) return;
    entry = pos0 / p.emit_ratio;
    pos0 = entry * p.emit_ratio;
  }
  const float* x = p.x + (t + entry) * p.x_token_stride + h * p.x_head_stride;
  for (int i = threadIdx.x; i < p.dim; i += blockDim.x) row[i] = x[i];
  __syncthreads();
  if (p.norm) {
    double ss = 0;
    for (int i = threadIdx.x; i < p.dim; i += blockDim.x) ss += double(row[i]) * row[i];
    ss = block_sum(ss);
    const float inv_rms = 1.0f / sqrtf(float(ss / p.dim) + p.eps);
    for (int i = threadIdx.x; i < p.dim; i += blockDim.x)
      row[i] = __fmul_rn(__fmul_rn(row[i], inv_rms), p.weight ? p.weight[i] : 1.0f);
    __syncthreads();
  }
  if (p.rope_dim > 0) {
    rope_pairs(row + p.dim - p.rope_dim, p.rope_dim, p.inv_freq, pos0 + int64_t(t) * p.pos_step, p.inverse);
    __syncthreads();
  }
  switch (p.round) {
    case RowRound::None: break;
    case RowRound::Bf16:
      for (int i = threadIdx.x; i < p.dim; i += blockDim.x) row[i] = round_bf16(row[i]);
      break;
    case RowRound::KvFp8: {
      const int nope = p.dim - p.rope_dim;
      for (int b = threadIdx.x; b < nope / 64; b += blockDim.x) fp8_simulate_block(row + 64 * b, 64);
      for (int i = nope + threadIdx.x; i < p.dim; i += blockDim.x) row[i] = round_bf16(row[i]);
      break;
    }
    case RowRound::IndexerFp4: {
      const int n = p.dim;  // Sylvester-order butterflies, the same sums as cpu::hadamard_transform
      for (int half = 1; half < n; half *= 2) {
        for (int q = threadIdx.x; q < n / 2; q += blockDim.x) {
          const int i = (q / half) * 2 * half + q % half, j = i + half;
          const float a = row[i], b = row[j];
          row[i] = a + b;
          row[j] = a - b;
        }
        __syncthreads();
      }
      const float scale = 1.0f / sqrtf(float(n));
      for (int i = threadIdx.x; i < n; i += blockDim.x) row[i] *= scale;
      __syncthreads();
      for (int b = threadIdx.x; b < n / 32; b += blockDim.x) fp4_simulate_block(row + 32 * b, 32);
      break;
    }
  }
  __syncthreads();
  float* y = p.y ? p.y + (t + entry) * p.y_token_stride + h * p.y_head_stride : nullptr;
  uint16_t* yb = p.y_bf16 ? p.y_bf16 + int64_t(r) * p.dim : nullptr;
  for (int i = threadIdx.x; i < p.dim; i += blockDim.x) {
    if (y) y[i] = row[i];
    if (yb) yb[i] = f32_to_bf16(row[i]);
  }
}

constexpr int kLinearThreads = 128;

// One block per output y[row, col]: the k-long dot product (k up to hc·D = 16384 for the mHC mixes) spread over
// 128 threads, 16-byte loads when rows allow, so a decode step's few outputs do not walk k on one warp.
__global__ void linear_f32_kernel(LinearF32Params p) {
  __shared__ float partial[kLinearThreads / 32];
  const int64_t out = blockIdx.x;
  const int row = int(out / p.n), col = int(out % p.n);
  const float* x = p.x + int64_t(row) * p.k;
  const float* w = p.w + int64_t(col) * p.k;
  float acc = 0;
  if (p.k % 4 == 0 && (reinterpret_cast<uintptr_t>(x) | reinterpret_cast<uintptr_t>(w)) % 16 == 0) {
    const float4* x4 = reinterpret_cast<const float4*>(x);
    const float4* w4 = reinterpret_cast<const float4*>(w);
    for (int i = threadIdx.x; i < p.k / 4; i += blockDim.x) {
      const float4 a = x4[i], b = w4[i];
      acc += a.x * b.x + a.y * b.y + a.z * b.z + a.w * b.w;
    }
  } else {
    for (int i = threadIdx.x; i < p.k; i += blockDim.x) acc += x[i] * w[i];
  }
  acc = detail::warp_sum(acc);
  if ((threadIdx.x & 31) == 0) partial[threadIdx.x >> 5] = acc;
  __syncthreads();
  if (threadIdx.x == 0) {
    float total = 0;
    for (int i = 0; i < kLinearThreads / 32; ++i) total += partial[i];
    p.y[out] = total * p.scale;
  }
}

__global__ void embed_kernel(const uint16_t* embed, const int32_t* tokens, int n, int D, int hc, float* streams) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= int64_t(n) * hc * D) return;
  const int d = int(i % D), t = int(i / (int64_t(hc) * D));
  streams[i] = bf16_to_f32(embed[int64_t(tokens[t]) * D + d]);
}

// rs = (mean of streams[t]² + eps)^-½ over the hc·D values (fp64 sum like the reference).
__device__ float stream_rms_scale(const float* xs, int width, float eps) {
  double ss = 0;
  for (int i = threadIdx.x; i < width; i += blockDim.x) ss += double(xs[i]) * xs[i];
  ss = block_sum(ss);
  return 1.0f / sqrtf(float(ss / width) + eps);
}

// y[d] = rms_norm(Σ_k pre[k] · xs[k·D + d], weight), into shared `y`.
__device__ void collapse_and_norm(const float* xs, const float* pre, int hc, int D, const float* weight, float eps,
                                  float* y) {
  double ss = 0;
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    float acc = 0;
    for (int k = 0; k < hc; ++k) acc = __fadd_rn(acc, __fmul_rn(pre[k], xs[k * D + d]));
    y[d] = acc;
    ss += double(acc) * acc;
  }
  ss = block_sum(ss);
  const float inv_rms = 1.0f / sqrtf(float(ss / D) + eps);
  for (int d = threadIdx.x; d < D; d += blockDim.x) y[d] = __fmul_rn(__fmul_rn(y[d], inv_rms), weight[d]);
}

__global__ void hc_pre_kernel(HcPreParams p) {
  extern __shared__ float collapsed[];
  __shared__ float pre[kMaxHc];
  const int t = blockIdx.x, hc = p.hc, D = p.D, n_mix = (2 + hc) * hc;
  const float* xs = p.streams + int64_t(t) * hc * D;
  const float rs = stream_rms_scale(xs, hc * D, p.eps);
  // Warp 0: thread j owns row j of the softmax, then rows / columns alternate in the Sinkhorn iterations; each
  // row or column is summed in index order by one thread, so the results equal the sequential reference's.
  __shared__ float C[kMaxHc * kMaxHc];
  const float* m = p.mix + int64_t(t) * n_mix;
  const int tid = threadIdx.x;
  if (tid < hc) {
    pre[tid] = sigmoid(m[tid] * rs * p.scale[0] + p.base[tid]) + p.hc_eps;
    p.post[t * hc + tid] = 2.0f * sigmoid(m[hc + tid] * rs * p.scale[1] + p.base[hc + tid]);
    float* row = C + tid * hc;
    float mx = -INFINITY;
    for (int k = 0; k < hc; ++k) {
      row[k] = m[2 * hc + tid * hc + k] * rs * p.scale[2] + p.base[2 * hc + tid * hc + k];
      mx = fmaxf(mx, row[k]);
    }
    float sum = 0;
    for (int k = 0; k < hc; ++k) sum += (row[k] = expf(row[k] - mx));
    for (int k = 0; k < hc; ++k) row[k] = row[k] / sum + p.hc_eps;
  }
  if (tid < 32) {
    __syncwarp();
    for (int it = 0; it < p.sinkhorn_iters; ++it) {
      if (it > 0 && tid < hc) {
        float sum = 0;
        for (int k = 0; k < hc; ++k) sum += C[tid * hc + k];
        for (int k = 0; k < hc; ++k) C[tid * hc + k] /= sum + p.hc_eps;
      }
      __syncwarp();
      if (tid < hc) {
        float sum = 0;
        for (int j = 0; j < hc; ++j) sum += C[j * hc + tid];
        for (int j = 0; j < hc; ++j) C[j * hc + tid] /= sum + p.hc_eps;
      }
      __syncwarp();
    }
    for (int i = tid; i < hc * hc; i += 32) p.comb[int64_t(t) * hc * hc + i] = C[i];
  }
  __syncthreads();
  collapse_and_norm(xs, pre, hc, D, p.norm_weight, p.eps, collapsed);
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    if (p.normed) p.normed[int64_t(t) * D + d] = collapsed[d];
    if (p.normed_bf16) p.normed_bf16[int64_t(t) * D + d] = f32_to_bf16(collapsed[d]);
  }
}

__global__ void hc_post_kernel(const float* out, int out_k, const float* out2, const float* post, const float* comb,
                               int n, int hc, int D, float* streams) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= int64_t(n) * D) return;
  const int t = int(i / D), d = int(i % D);
  float* xs = streams + int64_t(t) * hc * D;
  float old[kMaxHc];
  for (int j = 0; j < hc; ++j) old[j] = xs[j * D + d];
  float o = out[(int64_t(t) * out_k) * D + d];
  for (int e = 1; e < out_k; ++e) o = __fadd_rn(o, out[(int64_t(t) * out_k + e) * D + d]);
  if (out2) o = __fadd_rn(o, out2[i]);
  const float* C = comb + int64_t(t) * hc * hc;
  for (int k = 0; k < hc; ++k) {
    float acc = __fmul_rn(post[t * hc + k], o);
    for (int j = 0; j < hc; ++j) acc = __fadd_rn(acc, __fmul_rn(C[j * hc + k], old[j]));
    xs[k * D + d] = acc;
  }
}

__global__ void hc_head_kernel(const float* streams, const float* mix, const float* base, const float* scale,
                               const float* norm_weight, int hc, int D, float hc_eps, float eps, uint16_t* y_bf16) {
  extern __shared__ float y[];
  __shared__ float pre[kMaxHc];
  const int t = blockIdx.x;
  const float* xs = streams + int64_t(t) * hc * D;
  const float rs = stream_rms_scale(xs, hc * D, eps);
  if (threadIdx.x < hc) pre[threadIdx.x] = sigmoid(mix[t * hc + threadIdx.x] * rs * scale[0] + base[threadIdx.x]) + hc_eps;
  __syncthreads();
  collapse_and_norm(xs, pre, hc, D, norm_weight, eps, y);
  for (int d = threadIdx.x; d < D; d += blockDim.x) y_bf16[int64_t(t) * D + d] = f32_to_bf16(y[d]);
}

__global__ void window_store_kernel(const float* kv, int n, int dim, int64_t pos0, const int64_t* pos_device,
                                    float* window, int slots) {
  if (pos_device) pos0 = *pos_device;
  const int first = n > slots ? n - slots : 0;
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= int64_t(n - first) * dim) return;
  const int t = first + int(i / dim), c = int(i % dim);
  window[((pos0 + t) % slots) * dim + c] = kv[int64_t(t) * dim + c];
}

__global__ void ungroup_kernel(const uint16_t* in, int groups, int n, int width, uint16_t* out) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= int64_t(groups) * n * width) return;
  const int c = int(i % width), t = int((i / width) % n), g = int(i / (int64_t(width) * n));
  out[(int64_t(t) * groups + g) * width + c] = in[i];
}

__global__ void fill_kernel(float* x, int64_t n, float value) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    x[i] = value;
}

}  // namespace

void row_op(const RowOpParams& p, cudaStream_t stream) {
  const int rows = p.tokens * p.heads;
  if (rows == 0) return;
  OPS_CHECK(p.dim > 0 && p.dim <= 4096, "row_op: dim %d outside (0, 4096]", p.dim);
  OPS_CHECK(p.emit_ratio == 0 || rows == 1, "row_op: emit_ratio needs one row, got %d", rows);
  OPS_CHECK(p.round != RowRound::KvFp8 || (p.dim - p.rope_dim) % 64 == 0,
             "row_op: FP8 KV rounding needs (dim - rope_dim) = %d to be a multiple of 64", p.dim - p.rope_dim);
  OPS_CHECK(p.round != RowRound::IndexerFp4 || (p.dim >= 32 && (p.dim & (p.dim - 1)) == 0),
             "row_op: FP4 indexer rounding needs a power-of-two dim >= 32, got %d", p.dim);
  row_op_kernel<<<rows, kRowThreads, p.dim * sizeof(float), stream>>>(p);
  DSV4_CUDA_LAUNCHED();
}

void linear_f32(const LinearF32Params& p, cudaStream_t stream) {
  const int64_t outputs = int64_t(p.m) * p.n;
  if (outputs == 0) return;
  OPS_CHECK(outputs <= 0x7fffffff, "linear_f32: %lld outputs exceed one grid", (long long)outputs);
  linear_f32_kernel<<<int(outputs), kLinearThreads, 0, stream>>>(p);
  DSV4_CUDA_LAUNCHED();
}

void embed_tokens(const uint16_t* embed, const int32_t* tokens, int n, int D, int hc, float* streams,
                  cudaStream_t stream) {
  embed_kernel<<<blocks_for(int64_t(n) * hc * D, 256), 256, 0, stream>>>(embed, tokens, n, D, hc, streams);
  DSV4_CUDA_LAUNCHED();
}

void hc_pre(const HcPreParams& p, cudaStream_t stream) {
  OPS_CHECK(p.hc > 0 && p.hc <= kMaxHc, "hc_pre: hc_mult %d outside [1, %d]", p.hc, kMaxHc);
  hc_pre_kernel<<<p.n, 256, p.D * sizeof(float), stream>>>(p);
  DSV4_CUDA_LAUNCHED();
}

void hc_post(const float* out, int out_k, const float* out2, const float* post, const float* comb, int n, int hc,
             int D, float* streams, cudaStream_t stream) {
  OPS_CHECK(hc > 0 && hc <= kMaxHc, "hc_post: hc_mult %d outside [1, %d]", hc, kMaxHc);
  OPS_CHECK(out_k > 0, "hc_post: out_k %d must be positive", out_k);
  hc_post_kernel<<<blocks_for(int64_t(n) * D, 256), 256, 0, stream>>>(out, out_k, out2, post, comb, n, hc, D,
                                                                      streams);
  DSV4_CUDA_LAUNCHED();
}

void hc_head_norm(const float* streams, const float* mix, const float* base, const float* scale,
                  const float* norm_weight, int n, int hc, int D, float hc_eps, float eps, uint16_t* y_bf16,
                  cudaStream_t stream) {
  OPS_CHECK(hc > 0 && hc <= kMaxHc, "hc_head_norm: hc_mult %d outside [1, %d]", hc, kMaxHc);
  hc_head_kernel<<<n, 256, D * sizeof(float), stream>>>(streams, mix, base, scale, norm_weight, hc, D, hc_eps, eps,
                                                        y_bf16);
  DSV4_CUDA_LAUNCHED();
}

void window_store(const float* kv_chunk, int n, int dim, int64_t pos0, const int64_t* pos_device, float* window,
                  int slots, cudaStream_t stream) {
  const int rows = n < slots ? n : slots;
  window_store_kernel<<<blocks_for(int64_t(rows) * dim, 256), 256, 0, stream>>>(kv_chunk, n, dim, pos0, pos_device,
                                                                                 window, slots);
  DSV4_CUDA_LAUNCHED();
}

void ungroup_bf16(const uint16_t* in, int groups, int n, int width, uint16_t* out, cudaStream_t stream) {
  ungroup_kernel<<<blocks_for(int64_t(groups) * n * width, 256), 256, 0, stream>>>(in, groups, n, width, out);
  DSV4_CUDA_LAUNCHED();
}

void fill_f32(float* x, int64_t n, float value, cudaStream_t stream) {
  if (n == 0) return;
  fill_kernel<<<blocks_for(n, 256) < 1024 ? blocks_for(n, 256) : 1024, 256, 0, stream>>>(x, n, value);
  DSV4_CUDA_LAUNCHED();
}

}  // namespace dsv4::gpu
