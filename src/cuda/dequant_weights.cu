// SPDX-License-Identifier: MIT
// Weight decode for the prefill GEMM (contract in gemm.h): checkpoint bytes -> bf16 [n, k]. Every row of every
// format is a whole number of 16-byte pieces (k % 8 / 16 / 32), so one thread takes one 16-byte piece of the
// flat weight array (coalesced loads across the warp) and writes its 8, 16 or 32 bf16 values as 16-byte stores.
// The register decoders are those of the gemv kernels (dequant.cuh), so both paths decode bit-identically.
#include <cuda_bf16.h>

#include <cstdint>

#include "cuda/dequant.cuh"
#include "cuda/gemm.h"
#include "cuda/weight_tiles.h"

namespace dsv4::detail {
namespace {

enum class Fmt { FP8_E8M0, FP8_F32, MXFP4, NVFP4 };

constexpr int kThreads = 256;

struct DequantArgs {
  int64_t pieces;        // 16-byte pieces in w
  int pieces_per_row;
  int k;
  int scale_row_stride;  // FP8: ceil(k/128) scales per 128-row band; MXFP4: k/32; NVFP4: k/16 (elements)
  const uint8_t* w;
  const uint8_t* w_scale;
  uint16_t* out;         // [n, k]
  bool tiles;            // w / w_scale in the tile layout (weight_tiles.h): piece i of w is not piece i of the rows
};

template <Fmt F>
constexpr int elems_per_piece() {
  return (F == Fmt::FP8_E8M0 || F == Fmt::FP8_F32) ? 16 : 32;
}

__device__ __forceinline__ uint4 load_streaming(const uint8_t* p) {
  uint4 r;  // read once: keep it out of L1
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
      : "l"(p));
  return r;
}

// bf16x2 word (exact e4m3 values) times an fp32 scale, each half rounded to nearest even: the same fp32 multiply
// and rounding as the host reference bf16_rn(e4m3_to_f32(q) * scale).
__device__ __forceinline__ uint32_t scale_bf16x2_f32(uint32_t v, float scale) {
  const float lo = __fmul_rn(__uint_as_float(v << 16), scale);
  const float hi = __fmul_rn(__uint_as_float(v & 0xffff0000u), scale);
  return uint32_t(__bfloat16_as_ushort(__float2bfloat16_rn(lo))) |
         uint32_t(__bfloat16_as_ushort(__float2bfloat16_rn(hi))) << 16;
}

template <Fmt F>
__global__ void __launch_bounds__(kThreads) dequant_kernel(const DequantArgs a) {
  constexpr int kElems = elems_per_piece<F>();
  const int64_t piece = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  if (piece >= a.pieces) return;
  // The row and first element of this thread's piece (in the tile layout piece i of w is not piece i of the rows).
  int64_t row;
  int col;
  if (a.tiles) {
    const weight_tiles::RowByte at = weight_tiles::position(size_t(piece) * 16, size_t(a.pieces_per_row) * 16, 16);
    row = int64_t(at.row);
    col = int(at.byte / 16) * kElems;
  } else {
    row = piece / a.pieces_per_row;
    col = int(piece - row * a.pieces_per_row) * kElems;
  }
  // The scale byte of element `e` of this row (the tile layout moves scales in pieces of one per 32 elements).
  auto scale_at = [&](int e, int per_scale, int piece_bytes) -> const uint8_t* {
    const int64_t j = e / per_scale;  // scale index in the row
    return a.w_scale + (a.tiles ? int64_t(weight_tiles::offset(size_t(row), size_t(j), size_t(a.scale_row_stride),
                                                               size_t(piece_bytes)))
                                : row * a.scale_row_stride + j);
  };
  const uint4 raw = load_streaming(a.w + piece * 16);
  const uint32_t word[4] = {raw.x, raw.y, raw.z, raw.w};
  uint32_t out[kElems / 2];
  if constexpr (F == Fmt::FP8_E8M0) {
    // A 16-element piece never straddles a 128-wide scale block (col % 16 == 0).
    const uint32_t e = a.w_scale[(row / 128) * a.scale_row_stride + col / 128];
    const uint32_t factor = dq::fp8_factor_e8m0(e);
#pragma unroll
    for (int i = 0; i < 4; ++i) dq::e4m3x4_to_bf16x2(word[i], factor, out + 2 * i);
  } else if constexpr (F == Fmt::FP8_F32) {
    const float scale = reinterpret_cast<const float*>(a.w_scale)[(row / 128) * a.scale_row_stride + col / 128];
#pragma unroll
    for (int i = 0; i < 4; ++i) dq::e4m3x4_to_bf16x2(word[i], dq::fp8_factor_unit(), out + 2 * i);
#pragma unroll
    for (int i = 0; i < kElems / 2; ++i) out[i] = scale_bf16x2_f32(out[i], scale);
  } else if constexpr (F == Fmt::MXFP4) {
    const uint32_t factor = dq::mxfp4_factor(*scale_at(col, 32, 1));
#pragma unroll
    for (int i = 0; i < 4; ++i) dq::e2m1x8_to_bf16x2(word[i], factor, out + 4 * i);
  } else {  // NVFP4: two 16-element blocks (words 0-1 and 2-3); nvfp4_factor leaves a 2^-8 that 2^8 undoes exactly
    const uint16_t s = *reinterpret_cast<const uint16_t*>(scale_at(col, 16, 2));
    uint32_t f0, f1;
    dq::nvfp4_factor_pair(s, f0, f1);
    const uint32_t undo = dq::bf16x2_pow2(8);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      dq::e2m1x8_to_bf16x2(word[i], i < 2 ? f0 : f1, out + 4 * i);
#pragma unroll
      for (int j = 0; j < 4; ++j) out[4 * i + j] = dq::bf16x2_mul(out[4 * i + j], undo);
    }
  }
  uint4* dst = reinterpret_cast<uint4*>(a.out + row * a.k + col);
#pragma unroll
  for (int i = 0; i < kElems / 8; ++i) dst[i] = make_uint4(out[4 * i], out[4 * i + 1], out[4 * i + 2], out[4 * i + 3]);
}

}  // namespace

cudaError_t dequant_weight_launch(const WeightDesc& w, uint16_t* out_bf16, cudaStream_t stream) {
  const int64_t n = w.n, k = w.k;
  if (w.weight == GemvWeight::BF16)
    return cudaMemcpyAsync(out_bf16, w.w, size_t(n * k) * 2, cudaMemcpyDeviceToDevice, stream);
  const bool fp8 = w.weight == GemvWeight::FP8_BLOCK;
  const int64_t row_bytes = fp8 ? k : k / 2;
  DequantArgs a;
  a.pieces = n * row_bytes / 16;
  a.pieces_per_row = int(row_bytes / 16);
  a.k = int(k);
  a.scale_row_stride = int(fp8 ? (k + 127) / 128 : w.weight == GemvWeight::MXFP4 ? k / 32 : k / 16);
  a.w = static_cast<const uint8_t*>(w.w);
  a.w_scale = static_cast<const uint8_t*>(w.w_scale);
  a.out = out_bf16;
  a.tiles = w.layout == GemvLayout::Tiles;
  const unsigned blocks = unsigned((a.pieces + kThreads - 1) / kThreads);
  switch (w.weight) {
    case GemvWeight::FP8_BLOCK:
      if (w.fp8_scale == GemvScale::E8M0) dequant_kernel<Fmt::FP8_E8M0><<<blocks, kThreads, 0, stream>>>(a);
      else dequant_kernel<Fmt::FP8_F32><<<blocks, kThreads, 0, stream>>>(a);
      break;
    case GemvWeight::MXFP4: dequant_kernel<Fmt::MXFP4><<<blocks, kThreads, 0, stream>>>(a); break;
    case GemvWeight::NVFP4: dequant_kernel<Fmt::NVFP4><<<blocks, kThreads, 0, stream>>>(a); break;
    case GemvWeight::BF16: break;
  }
  return cudaGetLastError();
}

}  // namespace dsv4::detail
