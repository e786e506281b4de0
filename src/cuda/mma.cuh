// SPDX-License-Identifier: MIT
// The warp-level tensor-core pieces the mma.sync kernels share (attention.cu, gemv_tiled.cu, the indexer's scores):
// the m16n8k16 bf16 product with fp32 sums, ldmatrix from shared memory, the fp32 -> bf16x2 pack and the 16-byte
// cp.async stage copies.
// Fragment layout (PTX ISA, mma.m16n8k16 .bf16), g = lane / 4, c = lane % 4:
//   A (16 x 16, row-major): a0 = (g, 2c..2c+1), a1 = (g + 8, 2c..), a2 = (g, 2c + 8..), a3 = (g + 8, 2c + 8..)
//   B (16 x 8, column-major): b0 = (k 2c..2c+1, n g), b1 = (k 2c + 8.., n g)
//   C (16 x 8 fp32): c0, c1 = (g, 2c), (g, 2c + 1); c2, c3 = (g + 8, 2c), (g + 8, 2c + 1)
#pragma once
#include <cuda_bf16.h>

#include <cstdint>

namespace dsv4::detail {

__device__ __forceinline__ uint32_t smem_addr(const void* p) { return uint32_t(__cvta_generic_to_shared(p)); }

__device__ __forceinline__ void ldmatrix_x4(uint32_t r[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(p)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t r[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(p)));
}
// c += a · b, a 16 x 16 bf16 tile, b 16 x 8 bf16, c 16 x 8 fp32.
__device__ __forceinline__ void mma_bf16(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// Two floats -> bf16x2 (lo in the low half), round to nearest even in one cvt: the same values as f32_to_bf16.
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// 16 bytes global -> shared, bypassing L1; !valid: 16 zero bytes, nothing read (gmem must still be a valid address).
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(smem_addr(smem)), "l"(gmem), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N)); }

}  // namespace dsv4::detail
