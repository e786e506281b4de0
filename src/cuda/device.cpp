// SPDX-License-Identifier: MIT
#include "cuda/device.h"

#include <mutex>
#include <utility>
#include <vector>

#include "cuda/cuda_check.h"

namespace dsv4 {

bool cuda_available() {
  static const bool available = [] {
    int count = 0;
    const cudaError_t err = cudaGetDeviceCount(&count);
    if (err != cudaSuccess) {
      cudaGetLastError();  // clear the sticky "no driver" error so later queries start clean
      return false;
    }
    return count > 0;
  }();
  return available;
}

DeviceInfo device_info(int ordinal) {
  cudaDeviceProp prop{};
  DSV4_CUDA_CHECK(cudaGetDeviceProperties(&prop, ordinal));
  DeviceInfo info;
  info.name = prop.name;
  info.ordinal = ordinal;
  info.cc_major = prop.major;
  info.cc_minor = prop.minor;
  info.sm_count = prop.multiProcessorCount;
  info.global_mem_bytes = prop.totalGlobalMem;
  info.l2_bytes = size_t(prop.l2CacheSize);
  info.smem_per_block_optin = prop.sharedMemPerBlockOptin;
  return info;
}

namespace {
// An attribute of the current device, read once per device ordinal.
int current_attribute(cudaDeviceAttr attr, std::vector<int>& cache) {
  static std::mutex mutex;
  int ordinal = 0;
  DSV4_CUDA_CHECK(cudaGetDevice(&ordinal));
  std::lock_guard<std::mutex> lock(mutex);
  if (size_t(ordinal) >= cache.size()) cache.resize(size_t(ordinal) + 1, -1);
  if (cache[size_t(ordinal)] < 0) DSV4_CUDA_CHECK(cudaDeviceGetAttribute(&cache[size_t(ordinal)], attr, ordinal));
  return cache[size_t(ordinal)];
}
}  // namespace

int current_sm_count() {
  static std::vector<int> counts;
  return current_attribute(cudaDevAttrMultiProcessorCount, counts);
}

int current_cc_major() {
  static std::vector<int> majors;
  return current_attribute(cudaDevAttrComputeCapabilityMajor, majors);
}

DeviceBuffer::DeviceBuffer(size_t bytes) : bytes_(bytes) {
  if (bytes > 0) {
    const cudaError_t err = cudaMalloc(&ptr_, bytes);
    if (err != cudaSuccess) {
      ptr_ = nullptr;
      bytes_ = 0;
      DSV4_FAIL("cudaMalloc of {} bytes failed: {} ({})", bytes, cudaGetErrorName(err), cudaGetErrorString(err));
    }
  }
}

DeviceBuffer::~DeviceBuffer() {
  if (ptr_) cudaFree(ptr_);  // no throw from a destructor; a failure here means the context is already gone
}

DeviceBuffer::DeviceBuffer(DeviceBuffer&& other) noexcept
    : ptr_(std::exchange(other.ptr_, nullptr)), bytes_(std::exchange(other.bytes_, 0)) {}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& other) noexcept {
  if (this != &other) {
    if (ptr_) cudaFree(ptr_);
    ptr_ = std::exchange(other.ptr_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
  }
  return *this;
}

void DeviceBuffer::upload(const void* host, size_t bytes, size_t offset) {
  DSV4_CHECK(offset + bytes <= bytes_, "DeviceBuffer::upload: {} bytes at offset {} exceed the buffer's {} bytes",
             bytes, offset, bytes_);
  DSV4_CUDA_CHECK(cudaMemcpy(static_cast<char*>(ptr_) + offset, host, bytes, cudaMemcpyHostToDevice));
}

void DeviceBuffer::download(void* host, size_t bytes, size_t offset) const {
  DSV4_CHECK(offset + bytes <= bytes_, "DeviceBuffer::download: {} bytes at offset {} exceed the buffer's {} bytes",
             bytes, offset, bytes_);
  DSV4_CUDA_CHECK(cudaMemcpy(host, static_cast<const char*>(ptr_) + offset, bytes, cudaMemcpyDeviceToHost));
}

void DeviceBuffer::fill_bytes(int value) {
  if (bytes_ > 0) DSV4_CUDA_CHECK(cudaMemset(ptr_, value, bytes_));
}

}  // namespace dsv4
