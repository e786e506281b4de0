// SPDX-License-Identifier: MIT
// The copy engine (sm_90+) and the shared-memory barriers it completes: cp.async.bulk copies a contiguous run of
// global bytes into shared memory without registers or per-thread load instructions, and counts its bytes on an
// mbarrier; a consumer waits on the barrier's phase. One stage of a ring is one barrier with arrival count 1:
//   producer:  fence_proxy_async(); expect_bytes(bar, total); copies ... each completing on bar
//   consumer:  wait_phase(bar, parity)  (parity = how many times this barrier completed before, mod 2)
// Sizes and addresses of a copy must be multiples of 16 bytes.
#pragma once
#include <cstdint>

namespace dsv4::detail {

__device__ __forceinline__ uint32_t shared_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Count 1; then make the initialisation visible to the copy engine before any copy completes on it.
__device__ __forceinline__ void barrier_init(uint64_t* bar) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(shared_address(bar)) : "memory");
}
__device__ __forceinline__ void barrier_init_fence() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

// Orders this thread's earlier shared-memory accesses (e.g. reads of a stage about to be refilled) before later
// copy-engine writes.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// The producer's arrival: the phase completes once `bytes` more have landed.
__device__ __forceinline__ void expect_bytes(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(shared_address(bar)), "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void bulk_copy(void* dst_shared, const void* src_global, uint32_t bytes, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               ::"r"(shared_address(dst_shared)), "l"(src_global), "r"(bytes), "r"(shared_address(bar))
               : "memory");
}

// A copy that never completes (a byte count that does not match the copies) would hang the kernel; after ~2^26
// polls (seconds; each try_wait also suspends for a while) it traps instead, so the launch fails with an error.
__device__ __forceinline__ void wait_phase(uint64_t* bar, uint32_t parity) {
  const uint32_t addr = shared_address(bar);
  uint32_t done = 0;
  for (uint32_t polls = 0; !done; ++polls) {
    asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                 : "=r"(done)
                 : "r"(addr), "r"(parity)
                 : "memory");
    if (polls == (1u << 26)) __trap();
  }
}

}  // namespace dsv4::detail
