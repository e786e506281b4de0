// SPDX-License-Identifier: MIT
// Device plumbing for the CUDA backend: is a usable GPU present, what is it, and an owning device buffer.
// Nothing here needs a driver to be linked; without one cuda_available() is false and nothing else is called.
#pragma once
#include <cstddef>
#include <string>

namespace dsv4 {

// True when the CUDA runtime finds a driver and at least one device. Never throws; cached after the first call.
bool cuda_available();

struct DeviceInfo {
  std::string name;
  int ordinal = 0;
  int cc_major = 0, cc_minor = 0;  // compute capability (9.0 for H100/H200)
  int sm_count = 0;
  size_t global_mem_bytes = 0;
  size_t l2_bytes = 0;
  size_t smem_per_block_optin = 0;  // the most dynamic shared memory a block may opt in to
};

// Properties of `ordinal` (throws dsv4::Error if it does not exist).
DeviceInfo device_info(int ordinal = 0);

// Multiprocessor count of the current device, cached per ordinal (used by launch heuristics).
int current_sm_count();
// Compute capability major of the current device (9 for H100 / H200), cached per device.
int current_cc_major();

// Owning, move-only device allocation (cudaMalloc / cudaFree). Size in bytes; data() is 256-byte aligned.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t bytes);
  ~DeviceBuffer();
  DeviceBuffer(DeviceBuffer&& other) noexcept;
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  void* data() const { return ptr_; }
  template <typename T>
  T* as() const { return static_cast<T*>(ptr_); }
  size_t size() const { return bytes_; }

  void upload(const void* host, size_t bytes, size_t offset = 0);  // synchronous copies
  void download(void* host, size_t bytes, size_t offset = 0) const;
  void fill_bytes(int value);  // cudaMemset of the whole buffer (synchronous)

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

}  // namespace dsv4
