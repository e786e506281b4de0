// SPDX-License-Identifier: MIT
// 3.5 KV compressor advance (contract in ops.h). Decode steps (one token, or a graph replay reading the position on
// the device) walk the reference state update token by token; prefill chunks compute every entry that completes
// in the chunk in parallel (a block per (entry, 128 columns)), then rewrite the partial-block state in a second
// launch (not overlapped: a thread per (column, position)). Both give the same bits: each entry is pooled over the
// same rows in the same order.
#include <algorithm>
#include <cmath>

#include "cuda/launch.cuh"
#include "cuda/ops.h"
#include "cuda/ops_common.cuh"

namespace dsv4::gpu {
namespace {

using detail::blocks_for;

constexpr int kColumnThreads = 128;

// One thread per column j < dim (and its partner dim + j of the second series when overlapped); columns never
// interact, so the chunk's tokens are walked in order without block synchronisation.
// Batched decode: blockIdx.y is the row (its own sequence's one token).
__global__ void compressor_walk_kernel(CompressorParams p) {
  gpu::dependent_enter();
  const int j = blockIdx.x * blockDim.x + threadIdx.x;
  if (j >= p.dim) return;
  if (p.state_kv_rows) {
    const int b = blockIdx.y;
    p.kv_in += b * p.in_stride;
    p.gate_in += b * p.in_stride;
    p.state_kv = p.state_kv_rows[b];
    p.state_score = p.state_score_rows[b];
    p.entries = p.entries_rows[b];
    p.pos0 = p.pos_rows[b];
    p.pos_device = nullptr;
    p.n = 1;
  }
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

// Where position pos's (kv, score) of column col lives at the start of the chunk: this chunk's input rows when
// pos >= pos0 (score = gate + ape), else the state: the partial block of pos0 in rows (overlap ? r : 0) + pos % r,
// the complete block before it (overlap only) in rows pos % r. Positions before the sequence read the state's
// initial rows (kv 0, score -inf).
struct ChunkRows {
  const CompressorParams& p;
  int r, width;
  int64_t block0;  // first position of pos0's block

  __device__ void get(int64_t pos, int col, float& kv, float& score) const {
    const int i = int(((pos % r) + r) % r);
    if (pos >= p.pos0) {
      const int64_t t = pos - p.pos0;
      kv = p.kv_in[t * p.in_stride + col];
      score = p.gate_in[t * p.in_stride + col] + p.ape[i * width + col];
      return;
    }
    const int row = pos >= block0 && p.overlap ? r + i : i;
    kv = p.state_kv[row * width + col];
    score = p.state_score[row * width + col];
  }
};

// Block (column slice, entry b_first + blockIdx.y): the entry's softmax pool over its rows (previous block's first
// half + current block's second half when overlapped), in the walk kernel's row order and roundings. The block's
// kEntryGroups thread groups first stage the (kv, score) rows in shared memory, all loads in flight together; then
// one thread per column pools them in order (the max is order-free, the sums run in the walk's order: same bits).
constexpr int kEntryGroups = 8;

__global__ void compressor_entries_kernel(CompressorParams p, int64_t b_first) {
  gpu::dependent_enter();
  extern __shared__ float entry_rows[];  // kv [n_rows][kColumnThreads], then score [n_rows][kColumnThreads]
  const int jl = threadIdx.x % kColumnThreads, group = threadIdx.x / kColumnThreads;
  const int j = blockIdx.x * kColumnThreads + jl;
  const int r = p.ratio, d = p.dim, width = p.overlap ? 2 * d : d, n_rows = p.overlap ? 2 * r : r;
  float* kv_rows = entry_rows;
  float* score_rows = entry_rows + n_rows * kColumnThreads;
  const ChunkRows rows{p, r, width, (p.pos0 / r) * r};
  const int64_t b = b_first + blockIdx.y, first = p.overlap ? (b - 1) * r : b * r;
  if (j < d)
    for (int rr = group; rr < n_rows; rr += kEntryGroups)
      rows.get(first + rr, p.overlap && rr >= r ? d + j : j, kv_rows[rr * kColumnThreads + jl],
               score_rows[rr * kColumnThreads + jl]);
  __syncthreads();
  if (group != 0 || j >= d) return;
  float mx = -INFINITY;
  for (int rr = 0; rr < n_rows; ++rr) mx = fmaxf(mx, score_rows[rr * kColumnThreads + jl]);
  float sum = 0, acc = 0;
  for (int rr = 0; rr < n_rows; ++rr) {
    const float e = expf(score_rows[rr * kColumnThreads + jl] - mx);
    sum = __fadd_rn(sum, e);
    acc = __fadd_rn(acc, __fmul_rn(e, kv_rows[rr * kColumnThreads + jl]));
  }
  p.entries[b * d + j] = acc / sum;
}

// Not overlapped: the partial block at the end of the chunk is a plain copy of chunk rows (score = gate + ape); one
// (column, position) of it.
__device__ void state_copy_cell(const CompressorParams& p, int col, int64_t pos) {
  const int64_t t = pos - p.pos0;
  const int i = int(pos % p.ratio);
  p.state_kv[i * p.dim + col] = p.kv_in[t * p.in_stride + col];
  p.state_score[i * p.dim + col] = p.gate_in[t * p.in_stride + col] + p.ape[i * p.dim + col];
}

__global__ void compressor_state_copy_kernel(CompressorParams p, int64_t from) {
  gpu::dependent_enter();
  const int col = blockIdx.x * blockDim.x + threadIdx.x;
  if (col >= p.dim) return;
  state_copy_cell(p, col, from + blockIdx.y);
}

// After the entries: the state the walk would leave, in column col < width. Overlapped: rows 0..r-1 = the last
// complete block (moved from the partial-block rows or taken from the chunk), rows r.. = the new partial block.
// Rows the walk leaves stale are never read before being rewritten, so they are not touched.
__device__ void state_column(const CompressorParams& p, int col) {
  const int r = p.ratio, width = p.overlap ? 2 * p.dim : p.dim;
  const ChunkRows rows{p, r, width, (p.pos0 / r) * r};
  const int64_t end = p.pos0 + p.n, last_block = end / r * r;  // first position of the partial block at the end
  if (p.overlap && last_block > (p.pos0 / r) * r) {  // a block completed in this chunk
    for (int i = 0; i < r; ++i) {  // reads rows r + i (or i) before anything below rewrites them
      float kv, score;
      rows.get(last_block - r + i, col, kv, score);
      p.state_kv[i * width + col] = kv;
      p.state_score[i * width + col] = score;
    }
  }
  for (int64_t pos = last_block > p.pos0 ? last_block : p.pos0; pos < end; ++pos) {
    const int i = int(pos % r), row = p.overlap ? r + i : i;
    float kv, score;
    rows.get(pos, col, kv, score);  // pos >= pos0: from the chunk
    p.state_kv[row * width + col] = kv;
    p.state_score[row * width + col] = score;
  }
}

__global__ void compressor_state_kernel(CompressorParams p) {
  gpu::dependent_enter();
  const int col = blockIdx.x * blockDim.x + threadIdx.x;
  if (col < (p.overlap ? 2 * p.dim : p.dim)) state_column(p, col);
}

// compressor_states: block row blockIdx.y rebuilds table[blockIdx.y] with the shared n and pos0, like
// compressor_state (the same cells, the same operations).
__global__ void compressor_states_kernel(const CompressorParams* table, int n, int64_t pos0) {
  gpu::dependent_enter();
  CompressorParams p = table[blockIdx.y];
  p.n = n;
  p.pos0 = pos0;
  const int col = blockIdx.x * blockDim.x + threadIdx.x;
  if (p.overlap) {
    if (col < 2 * p.dim) state_column(p, col);
    return;
  }
  if (col >= p.dim) return;
  const int64_t end = p.pos0 + p.n, from = max(end / p.ratio * p.ratio, p.pos0);
  for (int64_t pos = from; pos < end; ++pos) state_copy_cell(p, col, pos);
}

}  // namespace

void compressor_advance(const CompressorParams& p, cudaStream_t stream) {
  if (p.n == 0) return;
  OPS_CHECK(p.ratio > 0 && p.dim > 0, "compressor_advance: ratio %d and dim %d must be positive", p.ratio, p.dim);
  if (p.state_kv_rows) {
    OPS_CHECK(p.pos_rows && p.state_score_rows && p.entries_rows && p.n <= 65535,
              "compressor_advance: batched rows need pos_rows and every state table (n = %d)", p.n);
    gpu::launch(compressor_walk_kernel, dim3(blocks_for(p.dim, kColumnThreads), p.n), kColumnThreads, 0, stream, p);
    DSV4_CUDA_LAUNCHED();
    return;
  }
  if (p.pos_device || p.n == 1) {
    gpu::launch(compressor_walk_kernel, blocks_for(p.dim, kColumnThreads), kColumnThreads, 0, stream, p);
    DSV4_CUDA_LAUNCHED();
    return;
  }
  const int64_t b_first = p.pos0 / p.ratio, b_end = (p.pos0 + p.n) / p.ratio;
  if (b_end > b_first) {
    OPS_CHECK(b_end - b_first <= 65535, "compressor_advance: %lld entries in one chunk", (long long)(b_end - b_first));
    const int n_rows = p.overlap ? 2 * p.ratio : p.ratio;
    const size_t smem = size_t(2) * n_rows * kColumnThreads * sizeof(float);
    OPS_CHECK(smem <= size_t(200) << 10, "compressor_advance: ratio %d stages %zu bytes of rows", p.ratio, smem);
    const cudaError_t configured = gpu::allow_dynamic_smem<compressor_entries_kernel>(int(size_t(200) << 10));
    OPS_CHECK(configured == cudaSuccess, "compressor_advance: cannot give the entry kernel 200 KB of shared memory");
    gpu::launch(compressor_entries_kernel, dim3(blocks_for(p.dim, kColumnThreads), unsigned(b_end - b_first)),
                kColumnThreads * kEntryGroups, smem, stream, p, b_first);
    DSV4_CUDA_LAUNCHED();
  }
  compressor_state(p, stream);
}

void compressor_state(const CompressorParams& p, cudaStream_t stream) {
  if (p.n == 0) return;
  OPS_CHECK(p.ratio > 0 && p.dim > 0 && !p.pos_device && !p.state_kv_rows,
            "compressor_state: ratio %d and dim %d must be positive, plain launches only", p.ratio, p.dim);
  if (!p.overlap) {  // the rows of the partial block at the end come straight from the chunk
    const int64_t end = p.pos0 + p.n, from = std::max(end / p.ratio * p.ratio, p.pos0);
    if (end > from) {
      gpu::launch(compressor_state_copy_kernel, dim3(blocks_for(p.dim, kColumnThreads), unsigned(end - from)),
                  kColumnThreads, 0, stream, p, from);
      DSV4_CUDA_LAUNCHED();
    }
    return;
  }
  const int width = p.overlap ? 2 * p.dim : p.dim;
  gpu::launch(compressor_state_kernel, blocks_for(width, kColumnThreads), kColumnThreads, 0, stream, p);
  DSV4_CUDA_LAUNCHED();
}

void compressor_states(const CompressorParams* table, int count, int n, int64_t pos0, int max_width,
                       cudaStream_t stream) {
  OPS_CHECK(count >= 0 && count <= 65535 && n >= 0 && max_width > 0,
            "compressor_states: %d compressors, n %d, max width %d", count, n, max_width);
  if (count == 0 || n == 0) return;
  gpu::launch(compressor_states_kernel, dim3(blocks_for(max_width, kColumnThreads), count), kColumnThreads, 0, stream,
              table, n, pos0);
  DSV4_CUDA_LAUNCHED();
}

}  // namespace dsv4::gpu
