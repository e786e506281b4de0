// SPDX-License-Identifier: MIT
// The tiled kernel's 64-row activation tiles for fp4 weights on Hopper's warpgroup MMA (wgmma), chosen by
// gemv_tiled.cu when gemv_wgmma_enabled() and gemv_wgmma_pick_shape() (contract in gemv.h, arguments in
// gemv_launch.h).
// Why: the mma.sync kernel decodes each weight tile in registers and issues 16 mma.sync per 16 k per warp; at one
// block of 8 warps per SM it is latency-bound (tensor pipe ~40 %, docs/perf.md sixth round) and every warp reads
// the whole activation tile from shared memory (8x the tile per stage). Here a block of two warpgroups computes 256
// (or 128) weight rows x 128 (or 64) activation rows (WgmmaShape), and each warp still decodes its 16-row weight
// tiles from the checkpoint bytes exactly like the mma.sync kernel (same pieces, same k permutation), but the
// decoded words go to wgmma as the A operand in registers (a warpgroup's four warps hold one 64-row tile) and the
// activation tile is read by the tensor cores from shared memory once per 64-row tile, asynchronously: the decode
// of the next k16 pair overlaps the MMAs. Measured (H100, docs/perf.md seventeenth round): 256 x 128 reaches ~0.48
// of the 790 TFLOP/s peak on large grids against mma.sync's ~0.33; the warps, which also stage the activations,
// leave the tensor pipe idle ~70 % of the time. So the default is the warp-specialised form further down (block
// shapes 4 and 5): a third warpgroup stages weights, scales and activations through an mbarrier ring and the two
// others only decode and multiply (0.51-0.68 of peak on large grids, docs/perf.md eighteenth round); the plain
// form stays for DSV4_GEMV_WGMMA_WS=0. The warp-specialised form also has a persistent kernel (one block per SM
// walking the launch's tiles, the ring running on from tile to tile): a tile's block launch, pipeline fill and
// epilogue cost ~6 µs besides ~2 µs per 128-k chunk (the twenty-seventh round's fit), and a grouped grid sized for
// the worst case launches mostly empty blocks. It is off (DSV4_GEMV_WGMMA_PERSISTENT=1 turns it on) and the
// one-block-per-tile kernel stays beside it until it has been run and timed on a GPU.
//
// k order: the activation tile sits in shared memory in natural k order (the canonical K-major layout with the
// 128-byte swizzle, two 64-k halves per 128-k chunk), so its 16-byte units are plain copies of x. The weights
// follow it: a wgmma k16 step takes from quad thread t the k pairs (2t, 2t + 1) and (2t + 8, 2t + 9) of rows g and
// g + 8, which are pair t of two consecutive 32-bit words of one 16-byte weight piece (word j of a piece holds k
// 8j .. 8j + 7). So each thread of a quad reads the same piece of its rows from the weight stage and decodes its own
// pair of every word (decode_pair). (Until stop 40 each thread decoded its own piece and the activations were stored
// with k permuted to match, through the producer's registers: 64 of them per thread in flight, which starved the
// consumers' registers until ptxas serialised their wgmma; docs/perf.md twenty-sixth round.)
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>

#include "cuda/dequant.cuh"
#include "cuda/device.h"
#include "cuda/gemv_launch.h"
#include "cuda/gemv_slot.cuh"
#include "cuda/gemv_tile_walk.h"
#include "cuda/gemv_tile_io.cuh"
#include "cuda/launch.cuh"
#include "cuda/weight_tiles.h"

namespace dsv4::detail {
namespace {

constexpr int kThreads = 256;  // two warpgroups
constexpr int kChunkK = 128;   // k per stage: a quad's four 16-byte pieces of 32 fp4 values per row
constexpr int kWStages = 4;    // raw weight bytes, cp.async ring
constexpr int kXStages = 3;    // activation tiles in the wgmma layout

// A block: kTiles 64-row weight tiles per warpgroup (kBlockRows rows) x kN activation rows (the wgmma N).
template <int kTiles, int kN>
struct WgmmaShape {
  static constexpr int kBlockRows = 2 * 64 * kTiles;
  static constexpr int kWStageBytes = kBlockRows * 64;
  static constexpr int kXHalfBytes = kN * 128;  // one 64-k half of a stage: kN rows of 128 bytes (8-row atoms)
  static constexpr int kXStageBytes = 2 * kXHalfBytes;
  static constexpr int kOutStride = kBlockRows + 4;  // floats per token row of the epilogue's output tile
  static constexpr size_t kStagesBytes = size_t(kXStages) * kXStageBytes + size_t(kWStages) * kWStageBytes;
  static constexpr size_t kSmemBytes = 1024 + kStagesBytes;  // + the alignment of the swizzle atoms
  static_assert(size_t(kN) * kOutStride * 4 <= kStagesBytes, "the output tile reuses the stages");
};

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define DSV4_WGMMA 1
#endif

__device__ __forceinline__ uint32_t smem_addr(const void* p) { return uint32_t(__cvta_generic_to_shared(p)); }

// Shared-memory matrix descriptor of a K-major operand with the 128-byte swizzle: rows of 128 bytes, 8-row atoms
// 1024 bytes apart (the leading byte offset is unused in this mode and encoded as 1).
__device__ __forceinline__ uint64_t sw128_desc(uint32_t addr) {
  return uint64_t((addr & 0x3FFFF) >> 4) | uint64_t(1) << 16 | uint64_t(1024 >> 4) << 32 | uint64_t(1) << 62;
}

__device__ __forceinline__ void wgmma_fence() {
#ifdef DSV4_WGMMA
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#endif
}
__device__ __forceinline__ void wgmma_commit() {
#ifdef DSV4_WGMMA
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
#endif
}
template <int N>
__device__ __forceinline__ void wgmma_wait() {
#ifdef DSV4_WGMMA
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
#endif
}
// Generic-proxy shared-memory writes (st.shared, cp.async) made visible to the tensor cores' async proxy.
__device__ __forceinline__ void fence_async_shared() {
#ifdef DSV4_WGMMA
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#endif
}
// mbarriers in shared memory (the warp-specialised kernel's stage hand-offs). wait() spins on try_wait of the given
// phase parity; a fresh barrier counts its phase "before the first" (parity 1) as complete.
__device__ __forceinline__ void mbar_init(uint64_t* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(bar)) : "memory");
}
// An arrive once every cp.async this thread issued so far has landed (counted in the barrier's expected arrivals).
__device__ __forceinline__ void mbar_arrive_on_copies(uint64_t* bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(smem_addr(bar)) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred done;\n"
      "WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT;\n}\n" ::"r"(smem_addr(bar)),
      "r"(parity)
      : "memory");
}
// Moves registers between warpgroups (every warp of the warpgroup executes it).
template <int kRegs>
__device__ __forceinline__ void regs_release() {
#ifdef DSV4_WGMMA
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kRegs));
#endif
}
template <int kRegs>
__device__ __forceinline__ void regs_claim() {
#ifdef DSV4_WGMMA
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(kRegs));
#endif
}
// Keeps the compiler from moving reads of the accumulators above a wgmma_wait.
template <int R>
__device__ __forceinline__ void fence_accumulators(float (&d)[R]) {
#pragma unroll
  for (int i = 0; i < R; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// d[64 x N] += A[64 x 16] (bf16 registers, the mma.sync A fragment per warp) x B[16 x N] (K-major in shared memory).
template <int N>
__device__ void wgmma_64xNx16(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t b);
template <>
__device__ __forceinline__ void wgmma_64xNx16<64>(float (&d)[32], const uint32_t (&a)[4], uint64_t b) {
#ifdef DSV4_WGMMA
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
      "}, {%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
#else
  __trap();  // the host launches this kernel on sm_90 only
#endif
}

template <>
__device__ __forceinline__ void wgmma_64xNx16<128>(float (&d)[64], const uint32_t (&a)[4], uint64_t b) {
#ifdef DSV4_WGMMA
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
      "}, {%64, %65, %66, %67}, %68, p, 1, 1, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
#else
  __trap();  // the host launches this kernel on sm_90 only
#endif
}

// The weight stage: row r's 16-byte piece p at unit 4 r + (p ^ (r >> 1 & 3)), so that the 8 rows g of a warp
// reading the same piece hit 8 different 16-byte bank groups.
__device__ __forceinline__ int w_unit(int row, int piece) { return 4 * row + (piece ^ ((row >> 1) & 3)); }

// The activation stage: 16-byte unit u (k 8u .. 8u + 7 of the chunk) of token row tok, at this byte offset.
template <int kXHalfBytes>
__device__ __forceinline__ uint32_t x_unit_at(int tok, int u) {
  return uint32_t((u >> 3) * kXHalfBytes + tok * 128 + (((u & 7) ^ (tok & 7)) << 4));
}

// Pair t (elements 2t, 2t + 1) of a device fp4 word as bf16x2 bit patterns: out[t] of fp4_layout::raw_bf16x2, in one
// formula for every t (rotations and masks per thread, so a warp's quads do not diverge).
struct PairDecode {
  uint32_t rot, mask, mask_b;
};
__device__ __forceinline__ PairDecode pair_decode(int t) {
  constexpr uint32_t kMask = 0x81C081C0u;
  return {t == 0 ? 0u : t == 1 ? 6u : t == 2 ? 28u : 2u, t == 3 ? 0x80C080C0u : kMask, t == 3 ? 0x01000100u : 0u};
}
__device__ __forceinline__ uint32_t decode_pair(uint32_t w, const PairDecode& d) {
  return (__funnelshift_l(w, w, d.rot) & d.mask) | (__funnelshift_l(w, w, 26) & d.mask_b);
}

// One 128-k chunk of a warpgroup's kTiles 64-row tiles: piece cc of this thread's rows local[wt][h] from the weight
// stage ws (raw scale bits scale_of(wt, h, cc): NVFP4's pair, for k 0-15 and 16-31 of the piece, or MXFP4's byte),
// decoded pair by pair (see the top of the file), then k steps 2cc and 2cc + 1 against the activation stage at
// x_base; at most two commit groups in flight. after_first_step runs once the first step's wait returned, i.e. when
// every MMA of the previous chunk has completed.
template <bool kNvfp4, int kTiles, int kN, class ScaleOf, class AfterFirstStep>
__device__ __forceinline__ void mma_chunk(float (&acc)[kTiles][kN / 2], const uint4* ws, const int (&local)[kTiles][2],
                                          const PairDecode& pd, ScaleOf scale_of, uint32_t x_base,
                                          AfterFirstStep after_first_step) {
  constexpr int kXHalfBytes = kN * 128;
#pragma unroll
  for (int cc = 0; cc < 4; ++cc) {  // piece cc: k steps 2cc and 2cc + 1
    uint32_t wa[kTiles][2][4];
#pragma unroll
    for (int wt = 0; wt < kTiles; ++wt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const uint4 raw = ws[w_unit(local[wt][h], cc)];
        uint32_t f0, f1;  // words 0-1 (k 0-15 of the piece), words 2-3 (k 16-31)
        if constexpr (kNvfp4) dq::nvfp4_factor_pair(scale_of(wt, h, cc), f0, f1);
        else f0 = f1 = dq::mxfp4_factor(scale_of(wt, h, cc));
        wa[wt][h][0] = dq::bf16x2_mul(decode_pair(raw.x, pd), f0);
        wa[wt][h][1] = dq::bf16x2_mul(decode_pair(raw.y, pd), f0);
        wa[wt][h][2] = dq::bf16x2_mul(decode_pair(raw.z, pd), f1);
        wa[wt][h][3] = dq::bf16x2_mul(decode_pair(raw.w, pd), f1);
      }
    wgmma_fence();
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      const int s = 2 * cc + u;  // k16 step: its 64-k half, then 32 bytes per step within the 128-byte rows
      const uint64_t b = sw128_desc(x_base + (s >> 2) * kXHalfBytes + (s & 3) * 32);
#pragma unroll
      for (int wt = 0; wt < kTiles; ++wt) {
        const uint32_t frag[4] = {wa[wt][0][2 * u], wa[wt][1][2 * u], wa[wt][0][2 * u + 1], wa[wt][1][2 * u + 1]};
        wgmma_64xNx16<kN>(acc[wt], frag, b);
      }
    }
    wgmma_commit();
    wgmma_wait<1>();  // the previous step's MMAs: their registers may be reused
    if (cc == 0) after_first_step();
  }
}

template <bool kNvfp4, bool kGrouped, int kTiles, int kN>
__global__ void __launch_bounds__(kThreads, 1) gemv_wgmma_kernel(const KernelArgs a) {
  using S = WgmmaShape<kTiles, kN>;
  constexpr int kBlockRows = S::kBlockRows, kOutStride = S::kOutStride;
  constexpr int kXGroups = kN * 4 / kThreads;  // activation copy groups per thread per stage (see load_x)
  gpu::allow_dependents();
  extern __shared__ __align__(16) uint8_t smem_raw[];
  // The swizzle atoms need 1024-byte alignment: activation stages first, then the raw weight stages.
  uint8_t* smem = smem_raw + ((1024 - smem_addr(smem_raw) % 1024) % 1024);
  auto x_stage = [&](int c) { return smem + (c % kXStages) * S::kXStageBytes; };
  auto w_stage = [&](int c) {
    return reinterpret_cast<uint4*>(smem + kXStages * S::kXStageBytes + (c % kWStages) * S::kWStageBytes);
  };

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3, wg = warp >> 2, wq = warp & 3;
  const int token_blocks = int(gridDim.x) / ((a.n + kBlockRows - 1) / kBlockRows);
  const int tok_first = int(blockIdx.x) % token_blocks * kN;
  const int row_block0 = int(blockIdx.x) / token_blocks * kBlockRows;
  const size_t row_bytes = size_t(a.k) / 2;

  BlockRows rows;
  if (!block_rows<kGrouped>(a, rows)) return;  // an empty slot: the whole block, before any barrier
  // Grouped grids give every slot the token blocks of the most rows any slot may hold: most find no rows.
  if (tok_first >= rows.m_rows) return;
  auto pair_of = [&](int row) { return kGrouped ? a.row_order[rows.order0 + row] : row; };

  const bool tiles = a.tiles;
  const size_t w_chunk_stride = tiles ? 16 * 64 : 64;
  const uint8_t* w_base = rows.w + size_t(rows.w_row0) * row_bytes;
  const uint8_t* w_scale = rows.w_scale + size_t(rows.w_row0) * (kNvfp4 ? a.k / 16 : a.k / 32);
  const int n_chunks = (a.k + kChunkK - 1) / kChunkK;
  // This thread's weight rows in the block: tile wt of warpgroup wg is 64 rows, of which warp wq holds 16 (the A
  // fragment: rows g and g + 8); its piece of each row is bytes t·16 of the chunk's 64.
  int local[kTiles][2];
#pragma unroll
  for (int wt = 0; wt < kTiles; ++wt)
#pragma unroll
    for (int h = 0; h < 2; ++h) local[wt][h] = (wg * kTiles + wt) * 64 + wq * 16 + g + 8 * h;

  auto load_scales = [&](int c, uint32_t sc[kTiles][2][4]) {  // raw scale bits of the 4 pieces of chunk c
#pragma unroll
    for (int wt = 0; wt < kTiles; ++wt)
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int cc = 0; cc < 4; ++cc) {
          const int r = row_block0 + local[wt][h], kk = c * kChunkK + cc * 32;
          const bool ok = c < n_chunks && kk < a.k && r < a.n;
          sc[wt][h][cc] = ok ? fp4_piece_scale<kNvfp4>(w_scale, tiles, r, kk, a.k) : 0;
        }
  };

  // Raw weight pieces this thread copies into every stage: row idx / 4 of the block, piece idx % 4.
  constexpr int kWCopies = kBlockRows * 4 / kThreads;
  const uint8_t* w_src[kWCopies];
  int w_piece_k[kWCopies];
#pragma unroll
  for (int i = 0; i < kWCopies; ++i) {
    const int idx = threadIdx.x + i * kThreads, r = row_block0 + idx / 4;
    w_piece_k[i] = (idx % 4) * 32;
    const size_t at = tiles ? weight_tiles::offset(size_t(r), size_t(idx % 4) * 16, row_bytes, 16)
                            : size_t(r) * row_bytes + (idx % 4) * 16;
    w_src[i] = r < a.n ? w_base + at : nullptr;
  }
  auto copy_w = [&](int c) {  // always commits a group (empty ones keep the wait counts uniform)
    if (c < n_chunks) {
      uint4* ws = w_stage(c);
#pragma unroll
      for (int i = 0; i < kWCopies; ++i) {
        const bool valid = w_src[i] && c * kChunkK + w_piece_k[i] < a.k;
        const int idx = threadIdx.x + i * kThreads;
        cp_async_16(ws + w_unit(idx / 4, idx % 4), valid ? w_src[i] + size_t(c) * w_chunk_stride : a.w, valid);
      }
    }
    cp_async_commit();
  };

  // Activation copies, group q: token x_tok + 64q of the tile, 16-byte units x_r + 4i (i = 0..3) of its chunk row.
  const int x_tok = threadIdx.x >> 2, x_r = threadIdx.x & 3;
  uint32_t x_dst[kXGroups][4];  // shared-memory offsets of those units in a stage
#pragma unroll
  for (int q = 0; q < kXGroups; ++q)
#pragma unroll
    for (int i = 0; i < 4; ++i) x_dst[q][i] = x_unit_at<S::kXHalfBytes>(x_tok + 64 * q, x_r + 4 * i);

  // x belongs to the step: plain / batched blocks wait before it (under early_weights after issuing the first
  // weight stages), grouped ones waited in block_rows.
  gpu::WaitOnce wait{!kGrouped};
  if (!a.early_weights) wait();
  for (int tok0 = tok_first; tok0 < rows.m_rows; tok0 += token_blocks * kN) {
  const int tokens = min(kN, rows.m_rows - tok0);
  const __nv_bfloat16* x_row[kXGroups];
#pragma unroll
  for (int q = 0; q < kXGroups; ++q) {
    const int tok = x_tok + 64 * q;
    x_row[q] = tok < tokens ? rows.x + size_t(kGrouped ? pair_of(tok0 + tok) / a.x_row_div : tok0 + tok) * a.k
                            : nullptr;
  }
  uint4 xr[kXGroups][4];
  auto load_x = [&](int c) {  // plain loads (x is the previous kernel's output); zeros past k and past the rows
#pragma unroll
    for (int q = 0; q < kXGroups; ++q)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int kk = c * kChunkK + (x_r + 4 * i) * 8;
        xr[q][i] = x_row[q] && c < n_chunks && kk < a.k ? __ldcg(reinterpret_cast<const uint4*>(x_row[q] + kk))
                                                        : make_uint4(0, 0, 0, 0);
      }
  };
  auto store_x = [&](int c) {
    uint8_t* xs = x_stage(c);
#pragma unroll
    for (int q = 0; q < kXGroups; ++q)
#pragma unroll
      for (int i = 0; i < 4; ++i) *reinterpret_cast<uint4*>(xs + x_dst[q][i]) = xr[q][i];
    fence_async_shared();
  };

  float acc[kTiles][kN / 2];
#pragma unroll
  for (int wt = 0; wt < kTiles; ++wt)
#pragma unroll
    for (int i = 0; i < kN / 2; ++i) acc[wt][i] = 0.0f;

  uint32_t sc_cur[kTiles][2][4], sc_next[kTiles][2][4];
  const PairDecode pd = pair_decode(t);
  load_scales(0, sc_cur);
#pragma unroll
  for (int s = 0; s < kWStages - 1; ++s) copy_w(s);
  wait();
  load_x(0);
  store_x(0);
  load_x(1);
  for (int c = 0; c < n_chunks; ++c) {
    load_scales(c + 1, sc_next);
    cp_async_wait<kWStages - 2>();
    // Stage c's weights and activations are complete for every thread; every warpgroup has waited for its MMAs of
    // chunk c - 2 (the wait_group<1> of chunk c - 1's first step), so that activation stage can be refilled, and
    // chunk c - 1's raw weights have been read.
    __syncthreads();
    copy_w(c + kWStages - 1);
    store_x(c + 1);  // the stage of chunk c - 2
    load_x(c + 2);
    mma_chunk<kNvfp4, kTiles, kN>(acc, w_stage(c), local, pd,
                                  [&](int wt, int h, int cc) { return sc_cur[wt][h][cc]; }, smem_addr(x_stage(c)),
                                  [] {});
#pragma unroll
    for (int wt = 0; wt < kTiles; ++wt)
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int cc = 0; cc < 4; ++cc) sc_cur[wt][h][cc] = sc_next[wt][h][cc];
  }
  wgmma_wait<0>();
#pragma unroll
  for (int wt = 0; wt < kTiles; ++wt) fence_accumulators(acc[wt]);
  cp_async_wait<0>();
  __syncthreads();  // every stage read: the output tile reuses them

  // acc[wt][4j + e]: weight row local[wt][e >> 1], token 8j + 2t + (e & 1) -> the [token][row] tile, then each
  // token's row of outputs with consecutive threads on consecutive columns (coalesced stores).
  float* tile = reinterpret_cast<float*>(smem);
#pragma unroll
  for (int wt = 0; wt < kTiles; ++wt)
#pragma unroll
    for (int i = 0; i < kN / 2; ++i)
      tile[(8 * (i >> 2) + 2 * t + (i & 1)) * kOutStride + local[wt][(i >> 1) & 1]] = acc[wt][i] * rows.y_factor;
  __syncthreads();
  store_output_tile<kGrouped, kThreads / 32>(a, rows, tile, kOutStride, tokens, tok0, row_block0, kBlockRows, pair_of);
  __syncthreads();  // the tile is read: a further pass may refill the stages
  }  // row passes
}

// The warp-specialised form (block shapes 4 = 256 x 128 and 5 = 256 x 64): warpgroups 0 and 1 only decode and
// multiply (mma_chunk, as above), warpgroup 2 only moves bytes: the raw weight pieces, their scales and the
// activation units by cp.async (no registers held for loads in flight), into a ring of stages handed over by
// mbarriers (full: the producer's copies and stores have landed; empty: every consumer warp's MMAs on the stage
// completed). Same MMAs in the same order as above: same bits.
constexpr int kWsThreads = 384;
// setmaxnreg moves registers within the block's allocation (384 x 168 at launch): 128 · 104 + 256 · 200 = 64512.
// The producer only issues copies; a consumer of a 256 x 128 block holds 128 accumulators, and with fewer than
// ~200 registers ptxas serialises its wgmma (C7512: every HGMMA waits for the one before; so it ran with the
// k-permuted activations, whose producer needed ~150, docs/perf.md twenty-sixth round). ptxas: no spills at 104 / 200.
constexpr int kProducerRegs = 104, kConsumerRegs = 200;
static_assert(128 * kProducerRegs + 256 * kConsumerRegs <= kWsThreads * 168);

template <int kTiles, int kN>
struct WsShape {
  using S = WgmmaShape<kTiles, kN>;
  // A stage: the activation tile, the raw weight pieces, then their scales ([row][piece]: NVFP4's pair of e4m3 or
  // MXFP4's e8m0 byte; room for two bytes either way).
  static constexpr int kScaleStageBytes = S::kBlockRows * 4 * 2;
  static constexpr int kStageBytes = S::kXStageBytes + S::kWStageBytes + kScaleStageBytes;
  static constexpr int kStages = 200 * 1024 / kStageBytes < 6 ? 200 * 1024 / kStageBytes : 6;
  static constexpr size_t kBarrierOffset = size_t(kStages) * kStageBytes;
  static constexpr size_t kSmemBytes = 1024 + kBarrierOffset + 2 * kStages * sizeof(uint64_t);
  static_assert(S::kXStageBytes % 1024 == 0 && kStageBytes % 1024 == 0, "swizzle atoms stay 1024-byte aligned");
};

__device__ __forceinline__ void named_barrier(int id, int threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// One block per tile (the grid of `launch`), passes over the tokens of grid.x / row blocks token blocks: the form
// measured on GPUs and the default, kept beside gemv_wgmma_walk_kernel until that one is measured (then the walk
// replaces it: same stages and MMAs, a block walks tiles).
//
// kPaired (grouped w1 + w3 with the SwiGLU, KernelArgs::swiglu_h): a block computes kBlockRows / 2 rows of both
// projections (warpgroup 0 the first's, 1 the second's, so both halves of the output tile hold the same columns)
// and stores only h = SwiGLU(first, second) of its columns, gpu::swiglu's arithmetic on the fp32 values the
// unpaired launch would store: the same bits, without the round trip of both projections' fp32 outputs
// (2 · pairs · n · 4 bytes written and read again) and without the SwiGLU's own launch.
template <bool kNvfp4, bool kGrouped, int kTiles, int kN, bool kPaired = false>
__global__ void __launch_bounds__(kWsThreads, 1) gemv_wgmma_ws_kernel(const KernelArgs a) {
  using S = WgmmaShape<kTiles, kN>;
  using W = WsShape<kTiles, kN>;
  static_assert(!kPaired || kGrouped, "paired projections are the grouped w1 + w3");
  constexpr int kStages = W::kStages, kBlockRows = S::kBlockRows, kOutStride = S::kOutStride;
  static_assert(size_t(kN) * kOutStride * 4 <= W::kBarrierOffset, "the output tile reuses the stages");
  constexpr int kBlockCols = kPaired ? kBlockRows / 2 : kBlockRows;  // output columns per block
  constexpr int kPassBarrier = 1, kConsumerBarrier = 2;  // named barriers (0 is __syncthreads)
  gpu::allow_dependents();
  extern __shared__ __align__(16) uint8_t smem_raw[];
  uint8_t* smem = smem_raw + ((1024 - smem_addr(smem_raw) % 1024) % 1024);
  auto x_stage = [&](int s) { return smem + s * W::kStageBytes; };
  auto w_stage = [&](int s) { return reinterpret_cast<uint4*>(smem + s * W::kStageBytes + S::kXStageBytes); };
  auto scale_stage = [&](int s) { return smem + s * W::kStageBytes + S::kXStageBytes + S::kWStageBytes; };
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + W::kBarrierOffset);
  uint64_t* empty = full + kStages;

  const int token_blocks = int(gridDim.x) / ((a.n + kBlockCols - 1) / kBlockCols);
  const int tok_first = int(blockIdx.x) % token_blocks * kN;
  const int row_block0 = int(blockIdx.x) / token_blocks * kBlockCols;
  const size_t row_bytes = size_t(a.k) / 2;
  const int n_chunks = (a.k + kChunkK - 1) / kChunkK;
  const int pass_tokens = token_blocks * kN;

  BlockRows rows;
  if (!block_rows<kGrouped>(a, rows)) return;  // an empty slot: the whole block, before any barrier
  // Grouped grids give every slot the token blocks of the most rows any slot may hold: most find no rows.
  if (tok_first >= rows.m_rows) return;
  auto pair_of = [&](int row) { return kGrouped ? a.row_order[rows.order0 + row] : row; };
  ExpertWeights second{};
  if constexpr (kPaired) second = expert_weights(a, a.slot_expert[blockIdx.y], true);
  if (threadIdx.x == 0)
    for (int s = 0; s < kStages; ++s) {
      mbar_init(full + s, 2 * 128);  // each producer thread: its copies (noinc), then its scale stores
      mbar_init(empty + s, 8);       // lane 0 of each consumer warp
    }
  __syncthreads();
  // x belongs to the step: the producer waits before loading it (under early_weights after issuing the first
  // weight stages), the consumers before their first store; grouped blocks waited in block_rows.
  gpu::WaitOnce wait{!kGrouped};

  if (threadIdx.x >= 256) {  // the producer warpgroup
    regs_release<kProducerRegs>();
    const int pt = int(threadIdx.x) - 256;
    // Raw weight pieces: unit pt + 128 i of a stage is row pt / 4 + 32 i of the block, piece pt % 4 (the layout
    // mma_chunk reads); rows 32 apart are 32 rows of bytes apart in both layouts (two whole 16-row tiles).
    // Paired: copies past the first half are the second projection's rows r0 + 32 (i - half).
    constexpr int kWCopies = kBlockRows * 4 / 128, kHalfCopies = kPaired ? kWCopies / 2 : kWCopies;
    const int piece = pt & 3, r0 = row_block0 + (pt >> 2);
    const size_t w_at = a.tiles ? weight_tiles::offset(size_t(r0), size_t(piece) * 16, row_bytes, 16)
                                : size_t(r0) * row_bytes + piece * 16;
    const uint8_t* w_src0 = rows.w + size_t(rows.w_row0) * row_bytes + w_at;
    // The second projection's rows start at the same w_row0 as the first's (as in the unpaired launch's blocks).
    const uint8_t* w_src1 = kPaired ? second.w + size_t(rows.w_row0) * row_bytes + w_at : nullptr;
    const size_t w_chunk_stride = a.tiles ? 16 * 64 : 64;
    // Scales: in the tile layout a chunk's scales of a 16-row tile are 16 x 4 pieces, contiguous and in the
    // stage's [row][piece] order (128 bytes for NVFP4, 64 for MXFP4: copied whole, 16 bytes per thread); the
    // row-major layout's pieces are loaded one by one (its rows need not be 16-byte aligned).
    constexpr int kScaleBytes = kNvfp4 ? 2 : 1, kScaleUnitsPerTile = 4 * kScaleBytes;
    constexpr int kScaleUnits = kBlockRows / 16 * kScaleUnitsPerTile;
    static_assert(kScaleUnits <= 128, "one 16-byte scale copy per producer thread at most");
    const size_t scale_row_bytes = size_t(a.k) / (kNvfp4 ? 16 : 32);
    const uint8_t* w_scale = rows.w_scale + size_t(rows.w_row0) * scale_row_bytes;
    const uint8_t* w_scale1 = kPaired ? second.w_scale + size_t(rows.w_row0) * scale_row_bytes : nullptr;
    // The block's 16-row tile of this thread's scale copy: paired, the second half's tiles are the second's.
    constexpr int kHalfTiles = kPaired ? kBlockRows / 32 : kBlockRows / 16;
    const int scale_tile = pt / kScaleUnitsPerTile, scale_matrix_tile = scale_tile % kHalfTiles;
    const uint8_t* scale_matrix = kPaired && scale_tile >= kHalfTiles ? w_scale1 : w_scale;
    const bool scale_ok = pt < kScaleUnits && row_block0 + 16 * scale_matrix_tile < a.n;
    const uint8_t* scale_src = scale_matrix + size_t(row_block0 / 16 + scale_matrix_tile) * 16 * scale_row_bytes +
                               (pt % kScaleUnitsPerTile) * 16;
    auto copy_w = [&](int c, int s) {
      uint4* ws = w_stage(s);
      const bool k_ok = c * kChunkK + piece * 32 < a.k;
#pragma unroll
      for (int i = 0; i < kWCopies; ++i) {
        const int ih = i % kHalfCopies;
        const uint8_t* src = kPaired && i >= kHalfCopies ? w_src1 : w_src0;
        const bool valid = k_ok && r0 + 32 * ih < a.n;
        const int idx = pt + 128 * i;
        cp_async_16(ws + w_unit(idx / 4, idx % 4),
                    valid ? src + size_t(ih) * 32 * row_bytes + size_t(c) * w_chunk_stride : a.w, valid);
      }
      uint8_t* ss = scale_stage(s);
      if (a.tiles) {  // k is a multiple of the 128-k chunk in the tile layout
        if (pt < kScaleUnits)
          cp_async_16(ss + pt * 16, scale_ok ? scale_src + size_t(c) * 16 * kScaleUnitsPerTile : a.w, scale_ok);
      } else {
#pragma unroll
        for (int i = 0; i < kBlockRows * 4 / 128; ++i) {
          const int idx = pt + 128 * i, lr = idx / 4, kk = c * kChunkK + (idx % 4) * 32;
          const int r = row_block0 + lr % kBlockCols;
          const uint8_t* matrix = kPaired && lr >= kBlockCols ? w_scale1 : w_scale;
          const uint32_t v = r < a.n && kk < a.k ? fp4_piece_scale<kNvfp4>(matrix, false, r, kk, a.k) : 0;
          if constexpr (kNvfp4) reinterpret_cast<uint16_t*>(ss)[idx] = uint16_t(v);
          else ss[idx] = uint8_t(v);
        }
      }
    };
    // Activations, group q: token x_tok + 32q of the tile, 16-byte units x_r + 4i (i = 0..3) of its chunk row,
    // copied as they are (zeros past k and past the tile's tokens).
    constexpr int kXq = kN / 32;
    const int x_tok = pt >> 2, x_r = pt & 3;
    uint32_t x_dst[4];  // offsets of unit x_r + 4i of group 0; group q is 32 token rows further (same swizzle)
#pragma unroll
    for (int i = 0; i < 4; ++i) x_dst[i] = x_unit_at<S::kXHalfBytes>(x_tok, x_r + 4 * i);
    if (!a.early_weights) wait();
    // The first pass's first weight stages (the stages start empty); a block without tokens issues none. Their
    // arrivals come with the activation copies of the same stage below.
    const int prefetched = tok_first < rows.m_rows ? min(n_chunks, kStages) : 0;
    for (int c = 0; c < prefetched; ++c) copy_w(c, c);
    for (int tok0 = tok_first, chunk0 = 0; tok0 < rows.m_rows; tok0 += pass_tokens, chunk0 += n_chunks) {
      const int tokens = min(kN, rows.m_rows - tok0);
      const __nv_bfloat16* x_row[kXq];
#pragma unroll
      for (int q = 0; q < kXq; ++q) {
        const int tok = x_tok + 32 * q;
        x_row[q] = tok < tokens ? rows.x + size_t(kGrouped ? pair_of(tok0 + tok) / a.x_row_div : tok0 + tok) * a.k
                                : nullptr;
      }
      for (int c = 0; c < n_chunks; ++c) {
        const int g = chunk0 + c, s = g % kStages;
        wait();
        if (g >= kStages) mbar_wait(empty + s, ((g / kStages) & 1) ^ 1);  // the stage's last chunk consumed
        if (g >= prefetched) copy_w(c, s);  // a later pass may start on stages never used when k is short
        uint8_t* xs = x_stage(s);
#pragma unroll
        for (int q = 0; q < kXq; ++q)
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const int kk = c * kChunkK + (x_r + 4 * i) * 8;
            const bool valid = x_row[q] && kk < a.k;
            cp_async_16(xs + q * 32 * 128 + x_dst[i], valid ? x_row[q] + kk : rows.x, valid);
          }
        mbar_arrive_on_copies(full + s);  // once every copy this thread issued so far has landed
        mbar_arrive(full + s);            // after this thread's scale stores (row-major layout)
      }
      if (tok0 + pass_tokens < rows.m_rows) named_barrier(kPassBarrier, kWsThreads);  // the tile is stored
    }
    cp_async_wait<0>();  // no copy outlives its thread
    return;
  }

  regs_claim<kConsumerRegs>();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g8 = lane >> 2, t = lane & 3, wg = warp >> 2, wq = warp & 3;
  const PairDecode pd = pair_decode(t);
  int local[kTiles][2];  // as in gemv_wgmma_kernel
#pragma unroll
  for (int wt = 0; wt < kTiles; ++wt)
#pragma unroll
    for (int h = 0; h < 2; ++h) local[wt][h] = (wg * kTiles + wt) * 64 + wq * 16 + g8 + 8 * h;
  for (int tok0 = tok_first, chunk0 = 0; tok0 < rows.m_rows; tok0 += pass_tokens, chunk0 += n_chunks) {
    const int tokens = min(kN, rows.m_rows - tok0);
    float acc[kTiles][kN / 2];
#pragma unroll
    for (int wt = 0; wt < kTiles; ++wt)
#pragma unroll
      for (int i = 0; i < kN / 2; ++i) acc[wt][i] = 0.0f;
    for (int c = 0; c < n_chunks; ++c) {
      const int g = chunk0 + c, s = g % kStages;
      mbar_wait(full + s, (g / kStages) & 1);
      fence_async_shared();  // the activation units landed by cp.async (generic proxy) before the wgmma reads them
      const uint8_t* ss = scale_stage(s);
      auto scale_of = [&](int wt, int h, int cc) -> uint32_t {  // [row][piece]: the same for a quad's threads
        const int idx = local[wt][h] * 4 + cc;
        if constexpr (kNvfp4) return reinterpret_cast<const uint16_t*>(ss)[idx];
        else return ss[idx];
      };
      mma_chunk<kNvfp4, kTiles, kN>(acc, w_stage(s), local, pd, scale_of, smem_addr(x_stage(s)), [&] {
        if (c > 0 && lane == 0) mbar_arrive(empty + (g - 1) % kStages);  // chunk c - 1's MMAs have completed
      });
    }
    wgmma_wait<0>();
#pragma unroll
    for (int wt = 0; wt < kTiles; ++wt) fence_accumulators(acc[wt]);
    if (lane == 0) mbar_arrive(empty + (chunk0 + n_chunks - 1) % kStages);
    named_barrier(kConsumerBarrier, 256);  // every stage of the pass read: the output tile reuses them
    float* tile = reinterpret_cast<float*>(smem);
    const float y_factor = kPaired && wg == 1 ? second.y_factor : rows.y_factor;
#pragma unroll
    for (int wt = 0; wt < kTiles; ++wt)
#pragma unroll
      for (int i = 0; i < kN / 2; ++i)
        tile[(8 * (i >> 2) + 2 * t + (i & 1)) * kOutStride + local[wt][(i >> 1) & 1]] = acc[wt][i] * y_factor;
    named_barrier(kConsumerBarrier, 256);
    wait();
    if constexpr (kPaired)
      store_swiglu_tile<8>(a, tile, kOutStride, kBlockCols, tokens, tok0, row_block0, pair_of);
    else
      store_output_tile<kGrouped, 8>(a, rows, tile, kOutStride, tokens, tok0, row_block0, kBlockRows, pair_of);
    if (tok0 + pass_tokens < rows.m_rows) named_barrier(kPassBarrier, kWsThreads);  // the producer may refill
  }
}

// The current matrix's share of a walked launch (block_rows for it); paired: *second (when given), the slot's second
// projection.
template <bool kGrouped, bool kPaired, int kN>
__device__ __forceinline__ BlockRows walk_rows(const KernelArgs& a, const TileWalk<kGrouped, kN>& walk,
                                               ExpertWeights* second = nullptr) {
  const auto* x = reinterpret_cast<const __nv_bfloat16*>(a.x);
  if constexpr (kGrouped) {
    const int s = walk.slot(a);
    GroupedSlot slot;
    grouped_slot_at(a, slot, s, walk.projection(a));
    if constexpr (kPaired)
      if (second) *second = expert_weights(a, a.slot_expert[s], true);
    return {slot.w, slot.w_scale, x, slot.y_factor, slot.m_rows, slot.order0, a.w_row0, 0};
  } else {
    return {a.w, a.w_scale, x + walk.matrix * a.x_batch_stride, a.y_factor, a.m, 0, a.w_row0 + walk.matrix * a.n,
            walk.matrix * a.y_batch_stride};
  }
}

// kPaired (grouped w1 + w3 with the SwiGLU, KernelArgs::swiglu_h): a block computes kBlockRows / 2 columns of both
// projections (stage rows [0, kBlockRows / 2) the first's, the rest the second's; each warpgroup's tile 0 holds
// columns of the first and its tile 1 the same columns of the second, so that a thread holds both values of its
// outputs) and stores only h = SwiGLU(first, second), gpu::swiglu's arithmetic on the fp32 values the unpaired
// launch would store: the same bits, without the round trip of both projections' fp32 outputs (2 · pairs · n · 4
// bytes written and read again) and without the SwiGLU's own launch.
//
// Walking (gemv_wgmma_persistent_enabled(): grid.x one block per SM): a block walks its tiles (TileWalk) and the
// ring runs on across them, so the producer stages the next tile's first chunks while the consumers finish this
// one's and store it. The consumers store straight from their accumulators (per store instruction a warp writes 8
// consecutive columns of 4 tokens: whole 32-byte sectors), so no stage is held by an output tile.
template <bool kNvfp4, bool kGrouped, int kTiles, int kN, bool kPaired = false>
__global__ void __launch_bounds__(kWsThreads, 1) gemv_wgmma_walk_kernel(const KernelArgs a) {
  using S = WgmmaShape<kTiles, kN>;
  using W = WsShape<kTiles, kN>;
  static_assert(!kPaired || (kGrouped && kTiles == 2), "paired projections are the grouped w1 + w3, a tile each");
  constexpr int kStages = W::kStages, kBlockRows = S::kBlockRows;
  constexpr int kBlockCols = kPaired ? kBlockRows / 2 : kBlockRows;  // output columns per block
  gpu::allow_dependents();
  extern __shared__ __align__(16) uint8_t smem_raw[];
  uint8_t* smem = smem_raw + ((1024 - smem_addr(smem_raw) % 1024) % 1024);
  auto x_stage = [&](int s) { return smem + s * W::kStageBytes; };
  auto w_stage = [&](int s) { return reinterpret_cast<uint4*>(smem + s * W::kStageBytes + S::kXStageBytes); };
  auto scale_stage = [&](int s) { return smem + s * W::kStageBytes + S::kXStageBytes + S::kWStageBytes; };
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + W::kBarrierOffset);
  uint64_t* empty = full + kStages;

  const size_t row_bytes = size_t(a.k) / 2;
  const int n_chunks = (a.k + kChunkK - 1) / kChunkK;
  const int row_blocks = (a.n + kBlockCols - 1) / kBlockCols;

  // Grouped: the slots are the previous kernel's output. x belongs to the step: otherwise the producer waits
  // before loading it (under early_weights after issuing the first tile's first weight stages), the consumers
  // before their first store.
  if constexpr (kGrouped) gpu::dependent_wait();
  gpu::WaitOnce wait{!kGrouped};
  TileWalk<kGrouped, kN> walk;  // cuda/gemv_tile_walk.h
  int tile = int(blockIdx.x);
  if (!walk.seek(a, tile, row_blocks)) return;  // no tile for this block: all of it, before any barrier
  if (threadIdx.x == 0)
    for (int s = 0; s < kStages; ++s) {
      mbar_init(full + s, 2 * 128);  // each producer thread: its copies (noinc), then its scale stores
      mbar_init(empty + s, 8);       // lane 0 of each consumer warp
    }
  __syncthreads();

  if (threadIdx.x >= 256) {  // the producer warpgroup
    regs_release<kProducerRegs>();
    const int pt = int(threadIdx.x) - 256;
    // Raw weight pieces: unit pt + 128 i of a stage is row pt / 4 + 32 i of the block, piece pt % 4 (the layout
    // mma_chunk reads); rows 32 apart are 32 rows of bytes apart in both layouts (two whole 16-row tiles).
    // Paired: copies past the first half are the second projection's rows r0 + 32 (i - half), at the same offset
    // from a.w_second (a.w_scale_second) as the first's from a.w (a.w_scale): expert_weights' layout. Derived, not
    // held: with the second's pointers in registers the paired producer spilled.
    constexpr int kWCopies = kBlockRows * 4 / 128, kHalfCopies = kPaired ? kWCopies / 2 : kWCopies;
    const int piece = pt & 3;
    const size_t w_chunk_stride = a.tiles ? 16 * 64 : 64;
    // Scales: in the tile layout a chunk's scales of a 16-row tile are 16 x 4 pieces, contiguous and in the
    // stage's [row][piece] order (128 bytes for NVFP4, 64 for MXFP4: copied whole, 16 bytes per thread); the
    // row-major layout's pieces are loaded one by one (its rows need not be 16-byte aligned).
    constexpr int kScaleBytes = kNvfp4 ? 2 : 1, kScaleUnitsPerTile = 4 * kScaleBytes;
    constexpr int kScaleUnits = kBlockRows / 16 * kScaleUnitsPerTile;
    static_assert(kScaleUnits <= 128, "one 16-byte scale copy per producer thread at most");
    const size_t scale_row_bytes = size_t(a.k) / (kNvfp4 ? 16 : 32);
    // The block's 16-row tile of this thread's scale copy: paired, the second half's tiles are the second's.
    constexpr int kHalfTiles = kPaired ? kBlockRows / 32 : kBlockRows / 16;
    const int scale_tile = pt / kScaleUnitsPerTile, scale_matrix_tile = scale_tile % kHalfTiles;
    // Activations, group q: token x_tok + 32q of the tile, 16-byte units x_r + 4i (i = 0..3) of its chunk row,
    // copied as they are (zeros past k and past the tile's tokens).
    constexpr int kXq = kN / 32;
    const int x_tok = pt >> 2, x_r = pt & 3;
    uint32_t x_dst[4];  // offsets of unit x_r + 4i of group 0; group q is 32 token rows further (same swizzle)
#pragma unroll
    for (int i = 0; i < 4; ++i) x_dst[i] = x_unit_at<S::kXHalfBytes>(x_tok, x_r + 4 * i);

    // The current tile's sources (begin_tile).
    int row_block0 = 0, r0 = 0;
    const uint8_t* w_src0 = nullptr;
    auto second_of = [&](const uint8_t* p, const uint8_t* base, const uint8_t* base_second) {
      return base_second + (p - base);
    };
    const uint8_t* scale_src = nullptr;  // tiles: this thread's scale copy; rows: the matrix's first scale row
    bool scale_ok = false;
    int x_row[kXq];  // x rows of the tile's tokens x_tok + 32q, -1 past them (row indices: half the registers)
    auto begin_tile = [&] {
      const BlockRows rows = walk_rows<kGrouped, false>(a, walk);
      row_block0 = walk.row_block0(tile, kBlockCols);
      r0 = row_block0 + (pt >> 2);
      const size_t w_at = a.tiles ? weight_tiles::offset(size_t(r0), size_t(piece) * 16, row_bytes, 16)
                                  : size_t(r0) * row_bytes + piece * 16;
      w_src0 = rows.w + size_t(rows.w_row0) * row_bytes + w_at;
      const uint8_t* w_scale = rows.w_scale + size_t(rows.w_row0) * scale_row_bytes;
      const uint8_t* scale_matrix =
          kPaired && scale_tile >= kHalfTiles ? second_of(w_scale, a.w_scale, a.w_scale_second) : w_scale;
      scale_ok = pt < kScaleUnits && row_block0 + 16 * scale_matrix_tile < a.n;
      scale_src = !a.tiles ? w_scale
                           : scale_matrix + size_t(row_block0 / 16 + scale_matrix_tile) * 16 * scale_row_bytes +
                                 (pt % kScaleUnitsPerTile) * 16;
    };
    const uint16_t* x_tiles = a.x;  // the current matrix's x (batched: its batch's)
    auto begin_tile_x = [&] {  // x rows are the previous kernel's output (grouped: row_order too): after wait()
      const BlockRows rows = walk_rows<kGrouped, false>(a, walk);  // x and the pairs: the base's alone
      const int tok0 = walk.tok0(tile), tokens = min(kN, walk.m_rows - tok0);
      x_tiles = reinterpret_cast<const uint16_t*>(rows.x);
#pragma unroll
      for (int q = 0; q < kXq; ++q) {
        const int tok = x_tok + 32 * q;
        const int x_at = kGrouped ? (tok < tokens ? a.row_order[rows.order0 + tok0 + tok] / a.x_row_div : 0)
                                  : tok0 + tok;
        x_row[q] = tok < tokens ? x_at : -1;
      }
    };
    auto copy_w = [&](int c, int s) {
      uint4* ws = w_stage(s);
      const bool k_ok = c * kChunkK + piece * 32 < a.k;
#pragma unroll
      for (int i = 0; i < kWCopies; ++i) {
        const int ih = i % kHalfCopies;
        const uint8_t* src = kPaired && i >= kHalfCopies ? second_of(w_src0, a.w, a.w_second) : w_src0;
        const bool valid = k_ok && r0 + 32 * ih < a.n;
        const int idx = pt + 128 * i;
        cp_async_16(ws + w_unit(idx / 4, idx % 4),
                    valid ? src + size_t(ih) * 32 * row_bytes + size_t(c) * w_chunk_stride : a.w, valid);
      }
      uint8_t* ss = scale_stage(s);
      if (a.tiles) {  // k is a multiple of the 128-k chunk in the tile layout
        if (pt < kScaleUnits)
          cp_async_16(ss + pt * 16, scale_ok ? scale_src + size_t(c) * 16 * kScaleUnitsPerTile : a.w, scale_ok);
      } else {
#pragma unroll
        for (int i = 0; i < kBlockRows * 4 / 128; ++i) {
          const int idx = pt + 128 * i, lr = idx / 4, kk = c * kChunkK + (idx % 4) * 32;
          const int r = row_block0 + lr % kBlockCols;
          const uint8_t* matrix =
              kPaired && lr >= kBlockCols ? second_of(scale_src, a.w_scale, a.w_scale_second) : scale_src;
          const uint32_t v = r < a.n && kk < a.k ? fp4_piece_scale<kNvfp4>(matrix, false, r, kk, a.k) : 0;
          if constexpr (kNvfp4) reinterpret_cast<uint16_t*>(ss)[idx] = uint16_t(v);
          else ss[idx] = uint8_t(v);
        }
      }
    };
    begin_tile();
    if (!a.early_weights) wait();
    // The first tile's first weight stages (the stages start empty). Their arrivals come with the activation
    // copies of the same stage below.
    const int prefetched = min(n_chunks, kStages);
    for (int c = 0; c < prefetched; ++c) copy_w(c, c);
    wait();
    begin_tile_x();
    for (int g = 0;;) {
      for (int c = 0; c < n_chunks; ++c, ++g) {
        const int s = g % kStages;
        if (g >= kStages) mbar_wait(empty + s, ((g / kStages) & 1) ^ 1);  // the stage's last chunk consumed
        if (g >= prefetched) copy_w(c, s);
        uint8_t* xs = x_stage(s);
#pragma unroll
        for (int q = 0; q < kXq; ++q)
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const int kk = c * kChunkK + (x_r + 4 * i) * 8;
            const bool valid = x_row[q] >= 0 && kk < a.k;
            cp_async_16(xs + q * 32 * 128 + x_dst[i], valid ? x_tiles + size_t(x_row[q]) * a.k + kk : a.x, valid);
          }
        mbar_arrive_on_copies(full + s);  // once every copy this thread issued so far has landed
        mbar_arrive(full + s);            // after this thread's scale stores (row-major layout)
      }
      tile += int(gridDim.x);
      if (!walk.seek(a, tile, row_blocks)) break;
      begin_tile();
      begin_tile_x();
    }
    cp_async_wait<0>();  // no copy outlives its thread
    return;
  }

  regs_claim<kConsumerRegs>();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g8 = lane >> 2, t = lane & 3, wg = warp >> 2, wq = warp & 3;
  const PairDecode pd = pair_decode(t);
  int local[kTiles][2];  // stage rows of this thread's fragments (as in gemv_wgmma_kernel; paired: see above)
#pragma unroll
  for (int wt = 0; wt < kTiles; ++wt)
#pragma unroll
    for (int h = 0; h < 2; ++h)
      local[wt][h] = (kPaired ? wt * (kBlockRows / 2) + wg * 64 : (wg * kTiles + wt) * 64) + wq * 16 + g8 + 8 * h;
  constexpr int kLaneTokens = kN / 32;  // tokens lane, lane + 32, ... of the tile: their output rows, for all lanes
  for (int g = 0;;) {
    // Output rows (grouped: pairs) of the tile's tokens, loaded under the MMAs and shuffled to the lanes that store.
    int lane_row[kLaneTokens];
    float lane_weight[kLaneTokens];  // paired: the pairs' SwiGLU weights
    {
      const int order0 = kGrouped ? a.slot_offset[walk.slot(a)] : 0;
      const int tok0 = walk.tok0(tile), tokens = min(kN, walk.m_rows - tok0);
#pragma unroll
      for (int r = 0; r < kLaneTokens; ++r) {
        const int tok = lane + 32 * r;
        lane_row[r] = kGrouped ? (tok < tokens ? a.row_order[order0 + tok0 + tok] : 0) : tok0 + tok;
        lane_weight[r] = kPaired && a.swiglu_weights && tok < tokens ? a.swiglu_weights[lane_row[r]] : 1.0f;
      }
    }
    float acc[kTiles][kN / 2];
#pragma unroll
    for (int wt = 0; wt < kTiles; ++wt)
#pragma unroll
      for (int i = 0; i < kN / 2; ++i) acc[wt][i] = 0.0f;
    for (int c = 0; c < n_chunks; ++c, ++g) {
      const int s = g % kStages;
      mbar_wait(full + s, (g / kStages) & 1);
      fence_async_shared();  // the activation units landed by cp.async (generic proxy) before the wgmma reads them
      const uint8_t* ss = scale_stage(s);
      auto scale_of = [&](int wt, int h, int cc) -> uint32_t {  // [row][piece]: the same for a quad's threads
        const int idx = local[wt][h] * 4 + cc;
        if constexpr (kNvfp4) return reinterpret_cast<const uint16_t*>(ss)[idx];
        else return ss[idx];
      };
      mma_chunk<kNvfp4, kTiles, kN>(acc, w_stage(s), local, pd, scale_of, smem_addr(x_stage(s)), [&] {
        if (c > 0 && lane == 0) mbar_arrive(empty + (g - 1) % kStages);  // chunk c - 1's MMAs have completed
      });
    }
    wgmma_wait<0>();
#pragma unroll
    for (int wt = 0; wt < kTiles; ++wt) fence_accumulators(acc[wt]);
    if (lane == 0) mbar_arrive(empty + (g - 1) % kStages);
    wait();
    ExpertWeights second{};
    // Again: not held in registers through the MMAs.
    const BlockRows rows = walk_rows<kGrouped, kPaired>(a, walk, &second);
    const int tokens = min(kN, walk.m_rows - walk.tok0(tile)), row_block0 = walk.row_block0(tile, kBlockCols);
    // Fragment i of tile wt: token 8 (i >> 2) + 2t + (i & 1), stage row local[wt][(i >> 1) & 1].
#pragma unroll
    for (int j = 0; j < kN / 8; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int tok = 8 * j + 2 * t + e;
        const int out_row = __shfl_sync(0xffffffffu, lane_row[j >> 2], tok & 31);
        if constexpr (kPaired) {
          const float weight = __shfl_sync(0xffffffffu, lane_weight[j >> 2], tok & 31);
          if (tok < tokens)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              const int col = row_block0 + local[0][h];
              if (col < a.n)
                a.swiglu_h[int64_t(out_row) * a.n + col] =
                    swiglu_bf16(acc[0][4 * j + 2 * h + e] * rows.y_factor,
                                acc[1][4 * j + 2 * h + e] * second.y_factor, a.swiglu_limit, weight);
            }
        } else {
          void* y = kGrouped && walk.projection(a) == 1 ? a.y_second : a.y;
          const int64_t at = rows.y_offset + int64_t(out_row) * a.ldy + row_block0;
          if (tok < tokens)
#pragma unroll
            for (int wt = 0; wt < kTiles; ++wt)
#pragma unroll
              for (int h = 0; h < 2; ++h) {
                const int col = local[wt][h];
                if (row_block0 + col >= a.n) continue;
                const float v = acc[wt][4 * j + 2 * h + e] * rows.y_factor;
                if (a.out_bf16)
                  static_cast<__nv_bfloat16*>(y)[at + col] = __float2bfloat16_rn(v);
                else
                  static_cast<float*>(y)[at + col] = v;
              }
        }
      }
    tile += int(gridDim.x);
    if (!walk.seek(a, tile, row_blocks)) break;
  }
}

// One launch of either form: blocks of kBlockRows weight rows x kN activation rows cover the call (grid.y / z as
// the caller set them).
template <auto kKernel, int kBlockRows, int kN, int kBlockThreads, size_t kSmemBytes>
cudaError_t launch(const KernelArgs& a, dim3 grid, cudaStream_t stream) {
  const int token_blocks = (a.m + kN - 1) / kN;
  grid.x = unsigned((a.n + kBlockRows - 1) / kBlockRows * token_blocks);
  const cudaError_t configured = gpu::allow_dynamic_smem<kKernel>(int(kSmemBytes));
  if (configured != cudaSuccess) return configured;
  gpu::launch(kKernel, grid, kBlockThreads, kSmemBytes, stream, a);
  return cudaGetLastError();
}

template <bool kNvfp4, bool kGrouped, int kTiles, int kN>
cudaError_t launch_plain(const KernelArgs& a, dim3 grid, cudaStream_t stream) {
  using S = WgmmaShape<kTiles, kN>;
  return launch<gemv_wgmma_kernel<kNvfp4, kGrouped, kTiles, kN>, S::kBlockRows, kN, kThreads, S::kSmemBytes>(
      a, grid, stream);
}

// The walking form: its tiles are those of the grid `launch` would size (grid.y batches or slots, grid.z projections),
// walked by one block per SM (detail::wgmma_walk_blocks in tests); blocks past the tiles a grouped launch turns
// out to have return at once.
template <auto kKernel, int kBlockCols, int kN, size_t kSmemBytes>
cudaError_t launch_walk(KernelArgs a, dim3 grid, cudaStream_t stream) {
  a.tile_ys = int(grid.y);
  a.tile_zs = int(grid.z);
  const int64_t walkers = wgmma_walk_blocks > 0 ? wgmma_walk_blocks : current_sm_count();
  const int64_t blocks = std::min<int64_t>(walk_tiles_bound(a, kBlockCols, kN), walkers);
  const cudaError_t configured = gpu::allow_dynamic_smem<kKernel>(int(kSmemBytes));
  if (configured != cudaSuccess) return configured;
  gpu::launch(kKernel, dim3(unsigned(blocks), 1, 1), kWsThreads, kSmemBytes, stream, a);
  return cudaGetLastError();
}

// The warp-specialised form, one block per tile or (gemv_wgmma_persistent_enabled()) walking.
template <bool kNvfp4, bool kGrouped, int kTiles, int kN>
cudaError_t launch_ws(const KernelArgs& a, dim3 grid, cudaStream_t stream) {
  using W = WsShape<kTiles, kN>;
  constexpr int kRows = W::S::kBlockRows;
  const bool walk = gemv_wgmma_persistent_enabled();
  if constexpr (kGrouped)
    if (a.swiglu_h) {  // both projections in each block: the grid has no projection dimension
      grid.z = 1;
      if (walk)
        return launch_walk<gemv_wgmma_walk_kernel<kNvfp4, true, kTiles, kN, true>, kRows / 2, kN, W::kSmemBytes>(
            a, grid, stream);
      return launch<gemv_wgmma_ws_kernel<kNvfp4, true, kTiles, kN, true>, kRows / 2, kN, kWsThreads,
                    W::kSmemBytes>(a, grid, stream);
    }
  if (walk)
    return launch_walk<gemv_wgmma_walk_kernel<kNvfp4, kGrouped, kTiles, kN>, kRows, kN, W::kSmemBytes>(a, grid,
                                                                                                       stream);
  return launch<gemv_wgmma_ws_kernel<kNvfp4, kGrouped, kTiles, kN>, kRows, kN, kWsThreads, W::kSmemBytes>(a, grid,
                                                                                                        stream);
}

template <bool kNvfp4, bool kGrouped>
cudaError_t launch_shape(const KernelArgs& a, int shape, dim3 grid, cudaStream_t stream) {
  if (shape == 4) return launch_ws<kNvfp4, kGrouped, 2, 128>(a, grid, stream);
  if (shape == 5) return launch_ws<kNvfp4, kGrouped, 2, 64>(a, grid, stream);
  if (shape == 2) return launch_plain<kNvfp4, kGrouped, 1, 128>(a, grid, stream);
  if (shape == 3) return launch_plain<kNvfp4, kGrouped, 2, 128>(a, grid, stream);
  return launch_plain<kNvfp4, kGrouped, 2, 64>(a, grid, stream);
}

}  // namespace

int gemv_wgmma_rule_shape(int64_t m, int64_t n, int64_t matrices) {
  const int64_t enough = current_sm_count() * 7 / 8;
  auto blocks = [&](int rows, int tokens) { return (n + rows - 1) / rows * ((m + tokens - 1) / tokens) * matrices; };
  const bool ws = gemv_wgmma_ws_enabled();
  if (m > 64 && blocks(256, 128) >= enough) return ws ? 4 : 3;
  if (blocks(256, 64) >= enough) return ws ? 5 : 1;
  return 0;
}

bool gemv_wgmma_computes_swiglu(int shape) { return shape == 4 || shape == 5; }

int gemv_wgmma_pick_shape(const KernelArgs& a, dim3 grid) {
  if (const int forced = wgmma_forced_shape()) return forced;
  return gemv_wgmma_rule_shape(a.m, a.n, int64_t(grid.y) * grid.z);
}

cudaError_t gemv_wgmma_launch(const KernelArgs& a, GemvWeight w, int shape, dim3 grid, cudaStream_t stream,
                              bool grouped) {
  if (w == GemvWeight::NVFP4)
    return grouped ? launch_shape<true, true>(a, shape, grid, stream)
                   : launch_shape<true, false>(a, shape, grid, stream);
  if (w == GemvWeight::MXFP4)
    return grouped ? launch_shape<false, true>(a, shape, grid, stream)
                   : launch_shape<false, false>(a, shape, grid, stream);
  return cudaErrorInvalidValue;
}

}  // namespace dsv4::detail
