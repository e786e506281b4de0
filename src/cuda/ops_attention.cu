// SPDX-License-Identifier: MIT
// Sequence kernels of the forward pass: the lightning indexer with its top-k, the MoE router and the SwiGLU
// between the experts' projections. Sparse attention is in attention.cu, the KV compressors in compressor.cu.
#include <algorithm>
#include <cmath>

#include "core/env.h"
#include "cuda/device.h"
#include "cuda/launch.cuh"
#include "cuda/mma.cuh"
#include "cuda/moe_route.cuh"
#include "cuda/ops.h"
#include "cuda/ops_common.cuh"
#include "cuda/swiglu.cuh"
#include "formats/float_key.h"

namespace dsv4::gpu {
namespace {

using detail::blocks_for;
using detail::unpack_bf16x8;
using detail::warp_sum;
using ::dsv4::detail::cp_async_16;
using ::dsv4::detail::cp_async_commit;
using ::dsv4::detail::cp_async_wait;
using ::dsv4::detail::mma_bf16;
using ::dsv4::detail::pack_bf16;

constexpr int kMaxHeadDim = 512;
constexpr int kMaxTopK = 16;  // experts per token

// The indexer in two launches. Scores: (query, 16-key tile) blocks; each thread keeps q of two heads x 16 dims in
// registers and every warp reads the same key values (shared-memory broadcasts), so a key costs 32 FMAs per thread
// and no per-head reduction. Select: one block per query, radix select of the top-k threshold, then a bitonic sort
// of the <= topk candidates.
constexpr int kScoreThreads = 256;
constexpr int kScoreWarps = kScoreThreads / 32;
constexpr int kScoreKeys = 16;                                 // keys per tile: a decode query spreads over ~n/16 SMs
constexpr int kScoreWarpDims = 16;                             // dims of a slab one warp owns
constexpr int kScoreSlab = kScoreWarps * kScoreWarpDims;       // dims per pass over the keys (128)
constexpr int kScoreHeads = 64;                                // heads per group: lane owns heads lane and lane + 32
constexpr int kScoreKeysPerWarp = kScoreKeys / kScoreWarps;    // keys each warp finishes in the reduction
constexpr int kScoreMaxQ = 12288;                              // heads x dim
constexpr int kScoreBlocksPerSm = 8;                           // grid.y target: enough blocks, q loaded once each
constexpr int kStageBatch = 32;                                // loads in flight per thread staging q (keys: 8)
constexpr int kSelectThreads = 1024;
constexpr int kSelectWarps = kSelectThreads / 32;
constexpr int kSelectMaxTopK = 2048;
constexpr int kSelectPerThread = kSelectMaxTopK / kSelectThreads;  // sort positions per thread
constexpr int kSelectCacheEntries = 16384;  // longer rows are ranked from the global scores (same result)
constexpr int kSelectBatch = 4;             // loads in flight per thread in the select's passes over a row
static_assert(kSelectWarps == 32, "the select kernel scans its warps' counts within one warp");

__host__ __device__ constexpr size_t score_smem_floats(int heads, int dim) {
  return size_t(kScoreKeys) * dim + size_t(kScoreWarps) * kScoreKeys * kScoreHeads + size_t(heads) * (dim + 4);
}
// The largest a shape within the launcher's limits needs: heads <= kScoreMaxQ / 32, dim <= kMaxHeadDim.
constexpr size_t kScoreMaxSmem =
    sizeof(float) * (size_t(kScoreKeys) * kMaxHeadDim + size_t(kScoreWarps) * kScoreKeys * kScoreHeads +
                     kScoreMaxQ + 4 * (kScoreMaxQ / 32));
constexpr size_t kSelectMaxSmem = 2 * kSelectMaxTopK * sizeof(uint64_t) + kSelectCacheEntries * sizeof(uint32_t);

__device__ __forceinline__ int visible_entries(const IndexerTopkParams& p, int t) {
  const int64_t pos = p.keys_rows ? p.pos_rows[t] : (p.pos_device ? *p.pos_device : p.pos0) + t;
  const int64_t visible = (pos + 1) / p.ratio;
  return visible < p.max_entries ? int(visible) : p.max_entries;
}

// q[t, h, d0 .. d0 + 16) of heads h = g·64 + lane + 32·i (zero past heads / dim) from the padded shared copy.
__device__ __forceinline__ void load_q_slice(float (&q)[2][kScoreWarpDims], const float* q_s, int q_row, int heads,
                                             int dim, int g, int d0, int lane) {
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int h = g * kScoreHeads + lane + 32 * i;
    const bool valid = h < heads && d0 < dim;
    const float4* src = reinterpret_cast<const float4*>(q_s + (valid ? h * q_row + d0 : 0));
#pragma unroll
    for (int j = 0; j < kScoreWarpDims / 4; ++j) {
      const float4 v = valid ? src[j] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      q[i][4 * j] = v.x, q[i][4 * j + 1] = v.y, q[i][4 * j + 2] = v.z, q[i][4 * j + 3] = v.w;
    }
  }
}

// Block (t, y) scores the 16-key tiles y, y + gridDim.y, ... of query t. Warp w owns dims [16w, 16w + 16) of each
// 128-dim slab and lane l heads l, l + 32 of each 64-head group: its partial dots over those dims go to shared memory
// ([warp][key][head], conflict-free), then each warp sums two keys' partials over the warps, applies max(·, 0) and
// the head weights, and reduces over the heads with one warp_sum per key.
__global__ void __launch_bounds__(kScoreThreads, 2) indexer_scores_kernel(IndexerTopkParams p) {
  gpu::dependent_enter();
  extern __shared__ float4 score_smem[];
  float* keys_s = reinterpret_cast<float*>(score_smem);       // [kScoreKeys, dim]
  float* partial = keys_s + kScoreKeys * p.dim;               // [kScoreWarps, kScoreKeys, kScoreHeads]
  float* q_s = partial + kScoreWarps * kScoreKeys * kScoreHeads;  // [heads, dim + 4]: the pad spreads rows over banks
  const int t = blockIdx.x, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int n_visible = visible_entries(p, t);
  const int n_tiles = (n_visible + kScoreKeys - 1) / kScoreKeys;
  if (int(blockIdx.y) >= n_tiles) return;  // the whole block: graph replays size the grid for max_entries
  const int dim = p.dim, heads = p.heads, q_row = dim + 4;
  const int groups = (heads + kScoreHeads - 1) / kScoreHeads, slabs = (dim + kScoreSlab - 1) / kScoreSlab;
  const bool q_resident = groups == 1 && slabs == 1;  // the V4 shapes: q registers loaded once per block
  const float* qt = p.q + int64_t(t) * p.q_token_stride;
  const float* wt = p.w + int64_t(t) * heads;
  float* score = p.scores + int64_t(t) * p.max_entries;

  // Every load of a thread is issued before its stores (one memory latency, not one per row): q as 32-float
  // chunks (dim % 32 == 0, so a chunk lies in one row), then the first tile's keys, then one barrier for both.
  const int row_chunks = dim / 32, n_chunks = heads * row_chunks;
  const int row_shift = (row_chunks & (row_chunks - 1)) == 0 ? __ffs(row_chunks) - 1 : -1;  // V4: a shift
  for (int c0 = warp; c0 < n_chunks; c0 += kScoreWarps * kStageBatch) {
    float v[kStageBatch];
#pragma unroll
    for (int b = 0; b < kStageBatch; ++b) {
      const int c = c0 + kScoreWarps * b;
      v[b] = c < n_chunks ? qt[c * 32 + lane] : 0.0f;
    }
#pragma unroll
    for (int b = 0; b < kStageBatch; ++b) {
      const int c = c0 + kScoreWarps * b;
      const int h = row_shift >= 0 ? c >> row_shift : c / row_chunks;
      if (c < n_chunks) q_s[c * 32 + lane + 4 * h] = v[b];  // row h starts at h · (dim + 4)
    }
  }
  float wh[2];  // w_scale · w[t, h] of the lane's two heads in group g
  auto load_weights = [&](int g) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int h = g * kScoreHeads + lane + 32 * i;
      wh[i] = h < heads ? wt[h] * p.w_scale : 0.0f;
    }
  };
  load_weights(0);
  float q[2][kScoreWarpDims];

  for (int tile = blockIdx.y; tile < n_tiles; tile += gridDim.y) {
    const int s0 = tile * kScoreKeys;
    if (tile != int(blockIdx.y)) __syncthreads();  // the previous tile's keys and partial sums have been read
    // The tile's rows are contiguous: keys[s0 · dim + i], i < 16 · dim, valid below n_visible · dim.
    const float* tile_keys = (p.keys_rows ? p.keys_rows[t] : p.keys) + int64_t(s0) * dim;
    const int tile_floats = kScoreKeys * dim, valid_floats = min(kScoreKeys, n_visible - s0) * dim;
    for (int i0 = threadIdx.x; i0 < tile_floats; i0 += kScoreThreads * kStageBatch / 4) {
      float v[kStageBatch / 4];
#pragma unroll
      for (int b = 0; b < kStageBatch / 4; ++b) {
        const int i = i0 + kScoreThreads * b;
        v[b] = i < valid_floats ? tile_keys[i] : 0.0f;
      }
#pragma unroll
      for (int b = 0; b < kStageBatch / 4; ++b) {
        const int i = i0 + kScoreThreads * b;
        if (i < tile_floats) keys_s[i] = v[b];
      }
    }
    __syncthreads();
    if (q_resident && tile == int(blockIdx.y)) load_q_slice(q, q_s, q_row, heads, dim, 0, warp * kScoreWarpDims, lane);
    float total[kScoreKeysPerWarp] = {};
    for (int g = 0; g < groups; ++g) {
      if (groups > 1) load_weights(g);
      float acc[2][kScoreKeys] = {};
      for (int slab = 0; slab < slabs; ++slab) {
        const int d0 = slab * kScoreSlab + warp * kScoreWarpDims;
        if (d0 >= dim) break;  // warp-uniform, and no barrier inside the slab loop
        if (!q_resident) load_q_slice(q, q_s, q_row, heads, dim, g, d0, lane);
#pragma unroll
        for (int s = 0; s < kScoreKeys; ++s) {
          const float4* k4 = reinterpret_cast<const float4*>(keys_s + s * dim + d0);
#pragma unroll
          for (int j = 0; j < kScoreWarpDims / 4; ++j) {
            const float4 k = k4[j];  // the same address in every lane: a broadcast
#pragma unroll
            for (int i = 0; i < 2; ++i) {
              acc[i][s] = fmaf(q[i][4 * j], k.x, acc[i][s]);
              acc[i][s] = fmaf(q[i][4 * j + 1], k.y, acc[i][s]);
              acc[i][s] = fmaf(q[i][4 * j + 2], k.z, acc[i][s]);
              acc[i][s] = fmaf(q[i][4 * j + 3], k.w, acc[i][s]);
            }
          }
        }
      }
      if (g > 0) __syncthreads();  // the previous group's partial sums have been read
#pragma unroll
      for (int s = 0; s < kScoreKeys; ++s)
#pragma unroll
        for (int i = 0; i < 2; ++i) partial[(warp * kScoreKeys + s) * kScoreHeads + lane + 32 * i] = acc[i][s];
      __syncthreads();
#pragma unroll
      for (int m = 0; m < kScoreKeysPerWarp; ++m) {
        const int s = warp * kScoreKeysPerWarp + m;
        float v = 0;
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          float dot = 0;
#pragma unroll
          for (int w = 0; w < kScoreWarps; ++w) dot += partial[(w * kScoreKeys + s) * kScoreHeads + lane + 32 * i];
          v += wh[i] * fmaxf(dot, 0.0f);  // 0 for heads past `heads`
        }
        total[m] += warp_sum(v);
      }
    }
    if (lane == 0)
#pragma unroll
      for (int m = 0; m < kScoreKeysPerWarp; ++m) {
        const int s = s0 + warp * kScoreKeysPerWarp + m;
        if (s < n_visible) score[s] = total[m];
      }
  }
}

// ---- scores on tensor cores (IndexerTopkParams::bf16_exact, chunks of one sequence) -----------------------------
// Block (group of kTcTokens queries, y) scores the 64-key tiles y, y + gridDim.y, .. below its last query's
// n_visible. A tile is a (4 queries x 64 heads) x 64 keys x 128 dims product on mma.sync: warp w holds q of query
// w / 2, heads 32·(w % 2) .. + 32 as bf16 A fragments in registers (loaded once per block); the keys come by cp.async
// into a two-stage ring of fp32 rows and are packed to bf16 B fragments as they are read. The epilogue applies
// max(·, 0) and the head weights in registers, then sums the lane's four heads, the 8 lanes of a key column
// (shuffles) and the query's two warps (shared memory). Each key costs a query 8192 multiply-adds: a chunk of 512
// queries over 2048 keys is 17 GFLOP, 0.26 ms at the CUDA cores' fp32 peak and ~30 µs at mma.sync's bf16 rate.
constexpr int kTcTokens = 4, kTcHeads = 64, kTcDim = 128, kTcKeys = 64;
constexpr int kTcThreads = 256;               // 8 warps, 2 per query; the epilogue's store: one thread per score
constexpr int kTcKeyStride = kTcDim + 8;      // floats per staged key row: a half warp's 8-byte reads hit 16 banks
constexpr int kTcStages = 2;
constexpr int kTcMinRows = 16;                // chunks from which the tensor-core kernel runs
constexpr int kTcBlocksTarget = 4;            // blocks per SM the grid aims at (one runs per SM: 182 registers)
constexpr size_t kTcSmem =
    sizeof(float) * (size_t(kTcStages) * kTcKeys * kTcKeyStride + size_t(kTcThreads / 32) * kTcKeys);
static_assert(kTcThreads == kTcTokens * kTcKeys && kTcHeads == 2 * 32, "one score per thread, two warps per query");

__global__ void __launch_bounds__(kTcThreads, 1) indexer_scores_mma_kernel(IndexerTopkParams p) {
  gpu::dependent_enter();
  extern __shared__ float4 tc_smem[];
  float* keys_s = reinterpret_cast<float*>(tc_smem);                 // [kTcStages][kTcKeys][kTcKeyStride]
  float* head_sums = keys_s + kTcStages * kTcKeys * kTcKeyStride;    // [warp][kTcKeys]
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, c = lane & 3;
  const int t0 = blockIdx.x * kTcTokens;
  const int block_visible = visible_entries(p, min(t0 + kTcTokens, p.n) - 1);  // n_visible grows with t
  const int n_tiles = (block_visible + kTcKeys - 1) / kTcKeys;
  if (int(blockIdx.y) >= n_tiles) return;  // the whole block

  // Rows past block_visible are zeros (the state past the emitted entries is never read): 8 copies per thread.
  auto stage_tile = [&](int tile, int stage) {
    const int s0 = tile * kTcKeys;
    float* dst = keys_s + stage * kTcKeys * kTcKeyStride;
#pragma unroll
    for (int i = threadIdx.x; i < kTcKeys * kTcDim / 4; i += kTcThreads) {
      const int r = i / (kTcDim / 4), c4 = i % (kTcDim / 4);
      const bool valid = s0 + r < block_visible;
      cp_async_16(dst + r * kTcKeyStride + 4 * c4, valid ? p.keys + int64_t(s0 + r) * kTcDim + 4 * c4 : p.keys, valid);
    }
    cp_async_commit();
  };
  stage_tile(blockIdx.y, 0);

  // A fragments: query t (past n: the last one, never stored), heads h0 + 16·mt + g (+ 8), dims 16·ks + 2c (+ 8).
  const int t = min(t0 + warp / 2, p.n - 1), h0 = 32 * (warp & 1);
  const float* qt = p.q + int64_t(t) * p.q_token_stride + int64_t(h0 + g) * kTcDim + 2 * c;
  uint32_t a[2][kTcDim / 16][4];
  float wh[2][2];  // w_scale · w[t, h] of the lane's heads h0 + 16·mt + g + 8·i
#pragma unroll
  for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
    for (int ks = 0; ks < kTcDim / 16; ++ks) {
      const float* r = qt + 16 * mt * kTcDim + 16 * ks;
      const float2 v0 = *reinterpret_cast<const float2*>(r);
      const float2 v1 = *reinterpret_cast<const float2*>(r + 8 * kTcDim);
      const float2 v2 = *reinterpret_cast<const float2*>(r + 8);
      const float2 v3 = *reinterpret_cast<const float2*>(r + 8 * kTcDim + 8);
      a[mt][ks][0] = pack_bf16(v0.x, v0.y);
      a[mt][ks][1] = pack_bf16(v1.x, v1.y);
      a[mt][ks][2] = pack_bf16(v2.x, v2.y);
      a[mt][ks][3] = pack_bf16(v3.x, v3.y);
    }
#pragma unroll
    for (int i = 0; i < 2; ++i) wh[mt][i] = p.w[int64_t(t) * kTcHeads + h0 + 16 * mt + g + 8 * i] * p.w_scale;
  }

  int stage = 0;
  for (int tile = blockIdx.y; tile < n_tiles; tile += gridDim.y, stage ^= 1) {
    // The other stage was last read before the previous tile's second barrier.
    if (tile + int(gridDim.y) < n_tiles) stage_tile(tile + gridDim.y, stage ^ 1);
    else cp_async_commit();  // an empty group keeps the wait count uniform
    cp_async_wait<1>();
    __syncthreads();
    float acc[2][kTcKeys / 8][4] = {};
    const float* kb = keys_s + (stage * kTcKeys + g) * kTcKeyStride + 2 * c;  // B: key 8·j + g, dims 16·ks + 2c (+ 8)
#pragma unroll
    for (int ks = 0; ks < kTcDim / 16; ++ks)
#pragma unroll
      for (int j = 0; j < kTcKeys / 8; ++j) {
        const float* k = kb + 8 * j * kTcKeyStride + 16 * ks;
        const float2 lo = *reinterpret_cast<const float2*>(k), hi = *reinterpret_cast<const float2*>(k + 8);
        const uint32_t b0 = pack_bf16(lo.x, lo.y), b1 = pack_bf16(hi.x, hi.y);
        mma_bf16(acc[0][j], a[0][ks], b0, b1);
        mma_bf16(acc[1][j], a[1][ks], b0, b1);
      }
    // C element e of acc[mt][j]: head h0 + 16·mt + g + 8·(e / 2), key 8·j + 2c + e % 2.
#pragma unroll
    for (int j = 0; j < kTcKeys / 8; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float v = wh[0][0] * fmaxf(acc[0][j][e], 0.0f);
        v += wh[0][1] * fmaxf(acc[0][j][2 + e], 0.0f);
        v += wh[1][0] * fmaxf(acc[1][j][e], 0.0f);
        v += wh[1][1] * fmaxf(acc[1][j][2 + e], 0.0f);
        v += __shfl_xor_sync(0xffffffffu, v, 4);
        v += __shfl_xor_sync(0xffffffffu, v, 8);
        v += __shfl_xor_sync(0xffffffffu, v, 16);
        if (g == 0) head_sums[warp * kTcKeys + 8 * j + 2 * c + e] = v;
      }
    __syncthreads();
    const int query = threadIdx.x / kTcKeys, key = threadIdx.x % kTcKeys;
    const int tq = t0 + query, s = tile * kTcKeys + key;
    if (tq < p.n && s < visible_entries(p, tq))
      p.scores[int64_t(tq) * p.max_entries + s] =
          head_sums[2 * query * kTcKeys + key] + head_sums[(2 * query + 1) * kTcKeys + key];
  }
}

// Order-preserving keys of the scores: formats/float_key.h.
__device__ __forceinline__ uint32_t order_key(float f) { return float_order_key(f); }

// Score key and index in one word that sorts descending like top_k_indices: higher key first, then lower index.
__device__ __forceinline__ uint64_t rank_word(uint32_t key, int index) {
  return (uint64_t(key) << 32) | (0xffffffffu - uint32_t(index));
}

// One block per query. When n_visible > topk: a 4 x 8-bit radix select (256-bin histograms, warp-aggregated
// atomics) finds the threshold key T with count(> T) < topk <= count(>= T); the keys > T and the lowest-index ones
// == T are gathered in index order (ballot ranks within a warp, a scan over warps, each warp owning a contiguous
// index range); then a bitonic sort orders the candidates by rank_word (shuffles for strides < 32, shared memory
// above). Rows of up to cache_entries scores are read once into shared memory as keys; longer ones from p.scores.
__global__ void __launch_bounds__(kSelectThreads) indexer_select_kernel(IndexerTopkParams p, int sort_cap,
                                                                         int cache_entries, bool index_order) {
  gpu::dependent_enter();
  extern __shared__ uint64_t select_smem[];
  uint64_t* sort_a = select_smem;             // [sort_cap]: the candidates, then one of the sort's buffers
  uint64_t* sort_b = select_smem + sort_cap;  // [sort_cap]
  uint32_t* cache = reinterpret_cast<uint32_t*>(select_smem + 2 * sort_cap);  // [cache_entries]
  __shared__ __align__(16) uint32_t hist[256];
  __shared__ uint64_t warp_counts[kSelectWarps];
  __shared__ uint32_t chosen_prefix, chosen_needed;
  const int t = blockIdx.x, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int n_visible = visible_entries(p, t);
  if (n_visible <= 0) return;  // the whole block
  const float* score = p.scores + int64_t(t) * p.max_entries;
  const bool cached = n_visible <= cache_entries;
  if (cached) {
    for (int i0 = tid; i0 < n_visible; i0 += kSelectThreads * kSelectBatch) {
      float v[kSelectBatch];
#pragma unroll
      for (int b = 0; b < kSelectBatch; ++b)
        v[b] = i0 + kSelectThreads * b < n_visible ? score[i0 + kSelectThreads * b] : 0.0f;
#pragma unroll
      for (int b = 0; b < kSelectBatch; ++b)
        if (i0 + kSelectThreads * b < n_visible) cache[i0 + kSelectThreads * b] = order_key(v[b]);
    }
    __syncthreads();
  }
  auto key_at = [&](int i) { return cached ? cache[i] : order_key(score[i]); };
  const int count = min(p.topk, n_visible);

  if (n_visible > p.topk) {
    for (int i = tid; i < 256; i += kSelectThreads) hist[i] = 0;
    uint32_t prefix = 0, mask = 0, needed = uint32_t(p.topk);  // needed: how many keys matching prefix to take
    __syncthreads();
    for (int shift = 24; shift >= 0; shift -= 8) {
      // Uniform trip count (full warps for match_any); the batch's loads first, for the rows read from p.scores.
      for (int base = 0; base < n_visible; base += kSelectThreads * kSelectBatch) {
        uint32_t k[kSelectBatch];
#pragma unroll
        for (int b = 0; b < kSelectBatch; ++b) {
          const int i = base + kSelectThreads * b + tid;
          k[b] = i < n_visible ? key_at(i) : 0;
        }
#pragma unroll
        for (int b = 0; b < kSelectBatch; ++b) {
          const bool counted = base + kSelectThreads * b + tid < n_visible && (k[b] & mask) == prefix;
          const uint32_t digit = counted ? (k[b] >> shift) & 0xffu : 256;  // 256: none
          // Scores cluster in few bins (the exponent byte): one atomic per distinct digit of the warp.
          const unsigned peers = __match_any_sync(0xffffffffu, digit);
          if (counted && lane == __ffs(peers) - 1) atomicAdd(&hist[digit], uint32_t(__popc(peers)));
        }
      }
      __syncthreads();
      if (warp == 0) {
        // Lane l holds bins b0 .. b0 + 7 with b0 = 8·(31 - l), so the scan over lanes walks the bins downwards.
        const int b0 = 8 * (31 - lane);
        uint4* bins = reinterpret_cast<uint4*>(&hist[b0]);
        const uint4 lo = bins[0], hi = bins[1];
        bins[0] = bins[1] = make_uint4(0, 0, 0, 0);  // cleared for the next pass
        const uint32_t h[8] = {hi.w, hi.z, hi.y, hi.x, lo.w, lo.z, lo.y, lo.x};  // bins b0 + 7 - j
        uint32_t lane_total = 0;
#pragma unroll
        for (int j = 0; j < 8; ++j) lane_total += h[j];
        uint32_t above = lane_total;  // inclusive scan over the lanes, then exclusive
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
          const uint32_t x = __shfl_up_sync(0xffffffffu, above, o);
          if (lane >= o) above += x;
        }
        above -= lane_total;
#pragma unroll
        for (int j = 0; j < 8; ++j) {  // exactly one bin crosses `needed`
          if (above < needed && above + h[j] >= needed) {
            chosen_prefix = prefix | (uint32_t(b0 + 7 - j) << shift);
            chosen_needed = needed - above;
          }
          above += h[j];
        }
      }
      __syncthreads();
      prefix = chosen_prefix;
      needed = chosen_needed;
      mask |= 0xffu << shift;
    }
    const uint32_t T = prefix, n_above = uint32_t(p.topk) - needed;

    // Warp w owns indices [lo, hi) (whole 32-index rounds), so index order = (warp, round, lane) order.
    const int span = (n_visible + 32 * kSelectWarps - 1) / (32 * kSelectWarps) * 32;
    const int lo = min(n_visible, warp * span), hi = min(n_visible, lo + span);
    uint32_t warp_above = 0, warp_equal = 0;
    for (int base = lo; base < hi; base += 32 * kSelectBatch) {
      uint32_t k[kSelectBatch];  // 0 past hi: below every finite key
#pragma unroll
      for (int b = 0; b < kSelectBatch; ++b) k[b] = base + 32 * b + lane < hi ? key_at(base + 32 * b + lane) : 0;
#pragma unroll
      for (int b = 0; b < kSelectBatch; ++b) {
        warp_above += __popc(__ballot_sync(0xffffffffu, k[b] > T));
        warp_equal += __popc(__ballot_sync(0xffffffffu, base + 32 * b + lane < hi && k[b] == T));
      }
    }
    if (lane == 0) warp_counts[warp] = (uint64_t(warp_above) << 32) | warp_equal;
    __syncthreads();
    uint64_t before = warp_counts[lane];  // kSelectWarps == 32: inclusive scan over the warps
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const uint64_t x = __shfl_up_sync(0xffffffffu, before, o);
      if (lane >= o) before += x;
    }
    before = __shfl_sync(0xffffffffu, before, (warp + 31) & 31);
    if (warp == 0) before = 0;
    uint32_t above_pos = uint32_t(before >> 32), equal_pos = uint32_t(before);
    const unsigned lanes_below = (1u << lane) - 1;
    if (index_order) {
      // The picks in index order, straight to the output: key > T, or == T among the first `needed` of those.
      int32_t* selected = p.selected + int64_t(t) * p.topk;
      uint32_t pos = above_pos + min(equal_pos, needed);
      for (int base = lo; base < hi; base += 32 * kSelectBatch) {
        uint32_t k[kSelectBatch];
#pragma unroll
        for (int b = 0; b < kSelectBatch; ++b) k[b] = base + 32 * b + lane < hi ? key_at(base + 32 * b + lane) : 0;
#pragma unroll
        for (int b = 0; b < kSelectBatch; ++b) {
          const int i = base + 32 * b + lane;
          const bool is_equal = i < hi && k[b] == T;
          const unsigned equal_mask = __ballot_sync(0xffffffffu, is_equal);
          const bool pick = k[b] > T || (is_equal && equal_pos + __popc(equal_mask & lanes_below) < needed);
          const unsigned pick_mask = __ballot_sync(0xffffffffu, pick);
          if (pick) selected[pos + __popc(pick_mask & lanes_below)] = i;
          pos += __popc(pick_mask);
          equal_pos += __popc(equal_mask);
        }
      }
      return;
    }
    for (int base = lo; base < hi; base += 32 * kSelectBatch) {
      uint32_t k[kSelectBatch];
#pragma unroll
      for (int b = 0; b < kSelectBatch; ++b) k[b] = base + 32 * b + lane < hi ? key_at(base + 32 * b + lane) : 0;
#pragma unroll
      for (int b = 0; b < kSelectBatch; ++b) {  // rounds in index order
        const int i = base + 32 * b + lane;
        const bool is_above = k[b] > T, is_equal = i < hi && k[b] == T;
        const unsigned above_mask = __ballot_sync(0xffffffffu, is_above);
        const unsigned equal_mask = __ballot_sync(0xffffffffu, is_equal);
        if (is_above) sort_a[above_pos + __popc(above_mask & lanes_below)] = rank_word(k[b], i);
        if (is_equal) {
          const uint32_t r = equal_pos + __popc(equal_mask & lanes_below);
          if (r < needed) sort_a[n_above + r] = rank_word(k[b], i);
        }
        above_pos += __popc(above_mask);
        equal_pos += __popc(equal_mask);
      }
    }
  } else {
    if (index_order) {  // every key, in index order
      for (int i = tid; i < n_visible; i += kSelectThreads) p.selected[int64_t(t) * p.topk + i] = i;
      return;
    }
    for (int i = tid; i < n_visible; i += kSelectThreads) sort_a[i] = rank_word(key_at(i), i);
  }
  __syncthreads();

  // Bitonic sort, descending, of sort_a[0 .. n) padded with 0 (below every rank word); n a power of two >= 32, so a
  // warp's positions are all active or all idle. Position x = tid + kSelectThreads·m lives in v[m].
  int n = 32;
  while (n < count) n <<= 1;
  uint64_t v[kSelectPerThread];
#pragma unroll
  for (int m = 0; m < kSelectPerThread; ++m) {
    const int x = tid + kSelectThreads * m;
    v[m] = x < count ? sort_a[x] : 0;
  }
  int exchanges = 0;
  for (int k = 2; k <= n; k <<= 1)
    for (int j = k >> 1; j > 0; j >>= 1) {
      uint64_t other[kSelectPerThread];
      if (j >= 32) {
        // Alternating buffers: the barrier of the next exchange orders this one's reads before its writes.
        uint64_t* buf = (exchanges++ & 1) ? sort_b : sort_a;
#pragma unroll
        for (int m = 0; m < kSelectPerThread; ++m)
          if (tid + kSelectThreads * m < n) buf[tid + kSelectThreads * m] = v[m];
        __syncthreads();
#pragma unroll
        for (int m = 0; m < kSelectPerThread; ++m)
          if (tid + kSelectThreads * m < n) other[m] = buf[(tid + kSelectThreads * m) ^ j];
      } else {
#pragma unroll
        for (int m = 0; m < kSelectPerThread; ++m)
          if (tid + kSelectThreads * m < n) other[m] = __shfl_xor_sync(0xffffffffu, v[m], j);
      }
#pragma unroll
      for (int m = 0; m < kSelectPerThread; ++m) {
        const int x = tid + kSelectThreads * m;
        if (x >= n) continue;
        // Pair (x, x ^ j) of a block of k sorted descending when (x & k) == 0: the lower position keeps the larger.
        const bool keep_larger = ((x & j) == 0) == ((x & k) == 0);
        v[m] = keep_larger == (v[m] > other[m]) ? v[m] : other[m];
      }
    }
  int32_t* selected = p.selected + int64_t(t) * p.topk;
#pragma unroll
  for (int m = 0; m < kSelectPerThread; ++m) {
    const int x = tid + kSelectThreads * m;
    if (x < count) selected[x] = int32_t(0xffffffffu - uint32_t(v[m]));
  }
}

// One warp per token: route_token (cuda/moe_route.cuh).
template <int kPerLane>
__global__ void __launch_bounds__(32) router_kernel(RouterParams p) {
  gpu::dependent_enter();
  extern __shared__ float s[];  // [E]
  ::dsv4::detail::route_token<kPerLane>(p, blockIdx.x, threadIdx.x, s);
}

__global__ void swiglu_kernel(SwigluParams p) {
  if (!p.trigger_after_wait) gpu::allow_dependents();
  gpu::dependent_wait();
  if (p.trigger_after_wait) gpu::allow_dependents();
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= int64_t(p.rows) * p.inter) return;
  const int r = int(i / p.inter), j = int(i % p.inter);
  const float w = p.weights ? p.weights[r] : 1.0f;
  p.h[i] = ::dsv4::detail::swiglu_bf16(p.gate[r * p.ld + j], p.up[r * p.ld + j], p.limit, w);
}

}  // namespace

namespace {

bool aligned(const void* p, int bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

void check_indexer(const IndexerTopkParams& p, const char* op) {
  OPS_CHECK(p.ratio > 0 && p.topk > 0, "%s: ratio %d and topk %d must be positive", op, p.ratio, p.topk);
  OPS_CHECK(p.max_entries > 0, "%s: max_entries %d must be positive", op, p.max_entries);
}

}  // namespace

bool indexer_scores_on_tensor_cores(const IndexerTopkParams& p) {
  return p.bf16_exact && !p.keys_rows && p.n >= kTcMinRows && p.heads == kTcHeads && p.dim == kTcDim &&
         aligned(p.q, 8) && p.q_token_stride % 2 == 0 && aligned(p.keys, 16);
}

void indexer_scores(const IndexerTopkParams& p, cudaStream_t stream) {
  if (p.n == 0) return;
  check_indexer(p, "indexer_scores");
  OPS_CHECK(p.heads > 0 && p.heads * p.dim <= kScoreMaxQ, "indexer_scores: heads x dim = %d exceeds %d (shared memory)",
            p.heads * p.dim, kScoreMaxQ);
  OPS_CHECK(p.dim > 0 && p.dim % 32 == 0 && p.dim <= kMaxHeadDim,
            "indexer_scores: dim %d must be a multiple of 32 and <= %d", p.dim, kMaxHeadDim);
  if (indexer_scores_on_tensor_cores(p)) {
    const cudaError_t attr = gpu::allow_dynamic_smem<indexer_scores_mma_kernel>(int(kTcSmem));
    OPS_CHECK(attr == cudaSuccess, "indexer_scores: cannot allow %d bytes of shared memory", int(kTcSmem));
    const int groups = blocks_for(p.n, kTcTokens), tiles = blocks_for(p.max_entries, kTcKeys);
    const int per_group = std::max(1, blocks_for(kTcBlocksTarget * current_sm_count(), groups));
    gpu::launch(indexer_scores_mma_kernel, dim3(groups, std::min(tiles, per_group)), kTcThreads, kTcSmem, stream, p);
    DSV4_CUDA_LAUNCHED();
    return;
  }
  const cudaError_t attr = gpu::allow_dynamic_smem<indexer_scores_kernel>(int(kScoreMaxSmem));
  OPS_CHECK(attr == cudaSuccess, "indexer_scores: cannot allow %d bytes of shared memory", int(kScoreMaxSmem));
  // grid.y from host-known sizes only (graph replay): all tiles of max_entries, at most ~8 blocks per SM in all.
  const int tiles = blocks_for(p.max_entries, kScoreKeys);
  const int per_query = std::max(1, kScoreBlocksPerSm * current_sm_count() / p.n);
  const dim3 grid(p.n, std::min(tiles, per_query));
  gpu::launch(indexer_scores_kernel, grid, kScoreThreads, score_smem_floats(p.heads, p.dim) * sizeof(float), stream, p);
  DSV4_CUDA_LAUNCHED();
}

namespace {

// set_indexer_select_index_order (+2.6 % at batch 1, docs/perf.md); -1: not yet read from DSV4_INDEX_ORDER
int g_select_index_order = -1;

void launch_select(const IndexerTopkParams& p, cudaStream_t stream) {
  constexpr auto kKernel = indexer_select_kernel;
  const cudaError_t attr = gpu::allow_dynamic_smem<kKernel>(int(kSelectMaxSmem));
  OPS_CHECK(attr == cudaSuccess, "indexer_select: cannot allow %d bytes of shared memory", int(kSelectMaxSmem));
  const bool index_order = indexer_select_index_order();
  int sort_cap = 0;  // the sort's power-of-two length for the most candidates a row can have (no sort in index order)
  if (!index_order)
    for (sort_cap = 32; sort_cap < std::min(p.topk, p.max_entries);) sort_cap <<= 1;
  const int cache_entries = std::min(p.max_entries, kSelectCacheEntries);
  const size_t smem = 2 * size_t(sort_cap) * sizeof(uint64_t) + size_t(cache_entries) * sizeof(uint32_t);
  gpu::launch(kKernel, p.n, kSelectThreads, smem, stream, p, sort_cap, cache_entries, index_order);
  DSV4_CUDA_LAUNCHED();
}

}  // namespace

void set_indexer_select_index_order(bool on) { g_select_index_order = on ? 1 : 0; }
bool indexer_select_index_order() {
  if (g_select_index_order < 0) g_select_index_order = env_switch("DSV4_INDEX_ORDER").value_or(true) ? 1 : 0;
  return g_select_index_order == 1;
}

void indexer_select(const IndexerTopkParams& p, cudaStream_t stream) {
  if (p.n == 0) return;
  check_indexer(p, "indexer_select");
  OPS_CHECK(p.topk <= kSelectMaxTopK, "indexer_select: topk %d exceeds %d", p.topk, kSelectMaxTopK);
  launch_select(p, stream);
}

void indexer_topk(const IndexerTopkParams& p, cudaStream_t stream) {
  indexer_scores(p, stream);
  indexer_select(p, stream);
}

void router(const RouterParams& p, cudaStream_t stream) {
  if (p.n == 0) return;
  OPS_CHECK(p.k > 0 && p.k <= kMaxTopK && p.k <= p.experts, "router: %d experts per token (at most %d, E = %d)",
            p.k, kMaxTopK, p.experts);
  OPS_CHECK(p.experts <= 1024, "router: %d experts exceed 1024", p.experts);
  const size_t smem = p.experts * sizeof(float);
  ::dsv4::detail::with_experts_per_lane<32>(
      p.experts, [&](auto per_lane) { gpu::launch(router_kernel<per_lane>, p.n, 32, smem, stream, p); });
  DSV4_CUDA_LAUNCHED();
}

void swiglu(const SwigluParams& p, cudaStream_t stream) {
  if (p.rows == 0) return;
  OPS_CHECK(p.inter > 0 && p.ld >= p.inter, "swiglu: inter %d and row stride %lld", p.inter, (long long)p.ld);
  gpu::launch(swiglu_kernel, blocks_for(int64_t(p.rows) * p.inter, 256), 256, 0, stream, p);
  DSV4_CUDA_LAUNCHED();
}

}  // namespace dsv4::gpu
