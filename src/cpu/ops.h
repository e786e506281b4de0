// SPDX-License-Identifier: MIT
// CPU reference ops (fp32). This is the readable reference the CUDA kernels are tested against: plain loops,
// fp32 accumulation (BLAS for the matrix products), OpenMP across rows. Shapes are written outer -> inner and
// every matrix is row-major.
#pragma once
#include <cstdint>
#include <span>
#include <vector>

namespace dsv4::cpu {

// Σ a[i]·b[i] in a fixed order: eight interleaved fp32 partial sums (element i into lane i % 8), added pairwise,
// then the last n % 8 products in order. Vectorised without reassociating any one sum (-ffp-contract=off, no
// fast-math; an AVX2 clone measured no faster on the 2-core EPYC), and independent of how the caller batches rows,
// so a chunk and a one-token step agree bit for bit. The packed GEMM's row dots, and the attention's and the
// indexer's dot products over gathered keys.
inline float dot(const float* a, const float* b, int n) {
  float lane[8] = {};
  int i = 0;
  for (; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; ++j) lane[j] += a[i + j] * b[i + j];
  float sum = ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

// y[M,N] = x[M,K] · W[N,K]^T  (the one matmul convention of the engine, "gemm_nt").
void gemm_nt(const float* x, const float* w, float* y, int M, int N, int K);

// y[M,N] += x[M,K] · W[N,K]^T
void gemm_nt_accumulate(const float* x, const float* w, float* y, int M, int N, int K);

// Row-wise RMSNorm over the last axis: y = x · (mean(x²) + eps)^-½ · weight (weight may be nullptr = 1).
// In-place allowed (y == x).
void rms_norm(const float* x, const float* weight, float* y, int rows, int dim, float eps);

// Interleaved RoPE on x[0..rope_dim): pair (2i, 2i+1) rotated by angle position · inv_freq[i]; `inverse`
// rotates by the negative angle. inv_freq has rope_dim/2 entries.
void rope_interleaved(float* x, int rope_dim, const float* inv_freq, int64_t position, bool inverse);

// In-place orthonormal Hadamard transform of length n (power of two): x <- (H_n / sqrt(n)) x, Sylvester order.
void hadamard_transform(float* x, int n);

// Simulated storage rounding of a KV vector of `dim` values whose last `rope_dim` are RoPE dims.
enum class KvStorage { F32, BF16, FP8 };
// FP8: nope dims -> FP8 e4m3 in blocks of 64 with power-of-two scales (spec 3.3), rope dims -> bf16.
// BF16: every dim -> bf16. F32: unchanged.
void round_kv(float* kv, int dim, int rope_dim, KvStorage storage);

// Simulated storage rounding of an indexer query / key of `dim` values.
enum class IndexerStorage { F32, BF16, FP4 };
// FP4: Hadamard rotation, then FP4 e2m1 in blocks of 32 with power-of-two scales (spec 3.6). BF16: bf16 round.
void round_indexer(float* x, int dim, IndexerStorage storage);

float silu(float x);
float softplus(float x);  // torch semantics: x for x > 20

// Indices of the k largest values (descending; equal values: lower index first).
std::vector<int> top_k_indices(std::span<const float> values, int k);

}  // namespace dsv4::cpu

namespace dsv4 {
struct PackedWeight;  // quant/stored_weight.h
}

namespace dsv4::cpu {
// Strided variant: y[M,N] (row stride ldy) = x[M,K] (row stride ldx) · W[N,K]^T.
void gemm_nt_strided(const float* x, int ldx, const float* w, float* y, int ldy, int M, int N, int K);

// y[M,N] (row stride ldy; += when accumulate) = x[M,K] (row stride ldx) · W[row0 .. row0+N, K]^T for a weight left in
// its checkpoint encoding (WeightLoad::KeepLinearsPacked): tiles of rows are decoded to fp32 (decode_packed_rows, the
// values dequantize gives) and multiplied, so the fp32 copy of the whole weight never exists. Up to
// kPackedDotRows rows of x (decode steps) the tiles run in parallel, each thread decoding its tile and taking the dot
// products, so the packed bytes stream once; above, one tile at a time through BLAS. The sums run in another order
// than gemm_nt's on the decoded weight: the same results to fp32 rounding, not the same bits.
constexpr int kPackedDotRows = 8;
void gemm_nt_packed(const float* x, int ldx, const PackedWeight& w, int row0, float* y, int ldy, int M, int N, int K,
                    bool accumulate = false);
}  // namespace dsv4::cpu
