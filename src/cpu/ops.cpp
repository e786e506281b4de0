// SPDX-License-Identifier: MIT
#include "cpu/ops.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "core/check.h"
#include "formats/fp4.h"
#include "formats/fp8.h"
#include "quant/stored_weight.h"

namespace dsv4::cpu {

void gemm_nt(const float* x, const float* w, float* y, int M, int N, int K) {
  if (M == 0 || N == 0) return;
  if (M == 1) {
    cblas_sgemv(CblasRowMajor, CblasNoTrans, N, K, 1.0f, w, K, x, 1, 0.0f, y, 1);
    return;
  }
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, M, N, K, 1.0f, x, K, w, K, 0.0f, y, N);
}

void gemm_nt_accumulate(const float* x, const float* w, float* y, int M, int N, int K) {
  if (M == 0 || N == 0) return;
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, M, N, K, 1.0f, x, K, w, K, 1.0f, y, N);
}

void rms_norm(const float* x, const float* weight, float* y, int rows, int dim, float eps) {
  // Threads from 2^16 values: below, waking them costs more than the norm, and their spinning afterwards takes the
  // cores from OpenBLAS's threads in the next gemm (a speculative verify of 6 tokens ran 2.5x slower).
#pragma omp parallel for if (int64_t(rows) * dim >= (1 << 16))
  for (int r = 0; r < rows; ++r) {
    const float* xr = x + int64_t(r) * dim;
    float* yr = y + int64_t(r) * dim;
    double sum_sq = 0.0;
    for (int i = 0; i < dim; ++i) sum_sq += double(xr[i]) * xr[i];
    const float inv_rms = 1.0f / std::sqrt(float(sum_sq / dim) + eps);
    for (int i = 0; i < dim; ++i) yr[i] = xr[i] * inv_rms * (weight ? weight[i] : 1.0f);
  }
}

void rope_interleaved(float* x, int rope_dim, const float* inv_freq, int64_t position, bool inverse) {
  for (int i = 0; i < rope_dim / 2; ++i) {
    // fp32 angle like the references (torch computes position * inv_freq in fp32).
    const float angle = float(position) * inv_freq[i];
    const float c = float(std::cos(double(angle)));
    const float s = inverse ? -float(std::sin(double(angle))) : float(std::sin(double(angle)));
    const float a = x[2 * i], b = x[2 * i + 1];
    x[2 * i] = a * c - b * s;
    x[2 * i + 1] = a * s + b * c;
  }
}

void hadamard_transform(float* x, int n) {
  DSV4_CHECK(n > 0 && (n & (n - 1)) == 0, "hadamard_transform: length {} is not a power of two", n);
  for (int half = 1; half < n; half *= 2)
    for (int i = 0; i < n; i += 2 * half)
      for (int j = i; j < i + half; ++j) {
        const float a = x[j], b = x[j + half];
        x[j] = a + b;
        x[j + half] = a - b;
      }
  const float scale = 1.0f / std::sqrt(float(n));
  for (int i = 0; i < n; ++i) x[i] *= scale;
}

void round_kv(float* kv, int dim, int rope_dim, KvStorage storage) {
  if (storage == KvStorage::F32) return;
  if (storage == KvStorage::BF16) {
    for (int i = 0; i < dim; ++i) kv[i] = round_bf16(kv[i]);
    return;
  }
  const int nope = dim - rope_dim;
  constexpr int kBlock = 64;
  DSV4_CHECK(nope % kBlock == 0, "FP8 KV storage needs the nope dims ({}) to be a multiple of {}", nope, kBlock);
  for (int b = 0; b < nope; b += kBlock) fp8_simulate_block(kv + b, kBlock);
  for (int i = nope; i < dim; ++i) kv[i] = round_bf16(kv[i]);
}

void round_indexer(float* x, int dim, IndexerStorage storage) {
  if (storage == IndexerStorage::F32) return;
  if (storage == IndexerStorage::BF16) {
    for (int i = 0; i < dim; ++i) x[i] = round_bf16(x[i]);
    return;
  }
  constexpr int kBlock = 32;
  DSV4_CHECK(dim % kBlock == 0, "FP4 indexer storage needs index_head_dim ({}) to be a multiple of {}", dim, kBlock);
  hadamard_transform(x, dim);
  for (int b = 0; b < dim; b += kBlock) fp4_simulate_block(x + b, kBlock);
}

float silu(float x) { return x / (1.0f + std::exp(-x)); }
float softplus(float x) { return x > 20.0f ? x : std::log1p(std::exp(x)); }

std::vector<int> top_k_indices(std::span<const float> values, int k) {
  std::vector<int> idx(values.size());
  std::iota(idx.begin(), idx.end(), 0);
  k = std::min<int>(k, int(values.size()));
  std::partial_sort(idx.begin(), idx.begin() + k, idx.end(), [&](int a, int b) {
    return values[a] > values[b] || (values[a] == values[b] && a < b);
  });
  idx.resize(k);
  return idx;
}

}  // namespace dsv4::cpu

namespace dsv4::cpu {
void gemm_nt_strided(const float* x, int ldx, const float* w, float* y, int ldy, int M, int N, int K) {
  if (M == 0 || N == 0) return;
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, M, N, K, 1.0f, x, ldx, w, K, 0.0f, y, ldy);
}

namespace {

// A thread's decoded tile, kept between calls (OpenMP threads persist): a fresh megabyte per call would be mapped and
// faulted in every time.
std::vector<float>& tile_buffer(size_t floats) {
  thread_local std::vector<float> tile;
  if (tile.size() < floats) tile.resize(floats);
  return tile;
}

}  // namespace

void gemm_nt_packed(const float* x, int ldx, const PackedWeight& w, int row0, float* y, int ldy, int M, int N, int K,
                    bool accumulate) {
  if (M == 0 || N == 0) return;
  DSV4_CHECK(M > 0 && N > 0 && K > 0 && row0 >= 0, "gemm_nt_packed: M {} N {} K {} row0 {}", M, N, K, row0);
  // Checked here: nothing may throw inside the OpenMP region below.
  DSV4_CHECK(w.format != WeightFormat::Fp8Tensor, "gemm_nt_packed: per-tensor FP8 has no packed form");
  const bool parallel = int64_t(N) * K >= (1 << 16);  // below, waking the threads costs more than the product
  if (M <= kPackedDotRows && packed_row_dot_fused(w)) {  // each weight row decoded in registers, used for every x row
#pragma omp parallel for schedule(static) if (parallel)
    for (int r = 0; r < N; ++r) {
      float v[kPackedDotRows];
      packed_row_dot(w, K, row0 + r, x, ldx, M, v);
      for (int m = 0; m < M; ++m) {
        float& out = y[int64_t(m) * ldy + r];
        out = accumulate ? out + v[m] : v[m];
      }
    }
    return;
  }
  if (M <= kPackedDotRows) {
    constexpr int kTileRows = 32;
    const int tiles = (N + kTileRows - 1) / kTileRows;
#pragma omp parallel for schedule(static) if (parallel)
    for (int t = 0; t < tiles; ++t) {
      const int r0 = t * kTileRows, rows = std::min(kTileRows, N - r0);
      float* tile = tile_buffer(size_t(kTileRows) * K).data();
      decode_packed_rows(w, K, row0 + r0, rows, tile);
      for (int m = 0; m < M; ++m)
        for (int r = 0; r < rows; ++r) {
          const float v = dot(x + int64_t(m) * ldx, tile + int64_t(r) * K, K);
          float& out = y[int64_t(m) * ldy + r0 + r];
          out = accumulate ? out + v : v;
        }
    }
    return;
  }
  constexpr int kTileRows = 512;
  float* tile = tile_buffer(size_t(std::min(kTileRows, N)) * K).data();
  for (int r0 = 0; r0 < N; r0 += kTileRows) {
    const int rows = std::min(kTileRows, N - r0);
    decode_packed_rows(w, K, row0 + r0, rows, tile);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, M, rows, K, 1.0f, x, ldx, tile, K, accumulate ? 1.0f : 0.0f,
                y + r0, ldy);
  }
}
}  // namespace dsv4::cpu
