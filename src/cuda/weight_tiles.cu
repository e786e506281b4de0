// SPDX-License-Identifier: MIT
// The tile layout's permutation on the device (contract in weight_tiles.h): the uploader writes a matrix as the
// checkpoint stores it and regroups it here, at device bandwidth, instead of byte by byte on the host (argument
// checks in weight_tiles.cpp).
#include "cuda/weight_tiles.h"


namespace dsv4::gpu {
namespace {

// One thread per piece of kPiece bytes (16: one uint4; 2 / 1: the fp4 scales).
template <int kPiece>
__global__ void rows_to_tiles_kernel(const uint8_t* __restrict__ src, uint8_t* __restrict__ dst, size_t rows,
                                     size_t row_bytes) {
  const size_t pieces_per_row = row_bytes / kPiece;
  const size_t piece = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (piece >= rows * pieces_per_row) return;
  const size_t row = piece / pieces_per_row, byte = piece % pieces_per_row * kPiece;
  const size_t to = weight_tiles::offset(row, byte, row_bytes, kPiece);
  if constexpr (kPiece == 16)
    *reinterpret_cast<uint4*>(dst + to) = *reinterpret_cast<const uint4*>(src + row * row_bytes + byte);
  else if constexpr (kPiece == 2)
    *reinterpret_cast<uint16_t*>(dst + to) = *reinterpret_cast<const uint16_t*>(src + row * row_bytes + byte);
  else
    dst[to] = src[row * row_bytes + byte];
}

}  // namespace

cudaError_t rows_to_tiles_launch(void* data, void* scratch, size_t rows, size_t row_bytes, size_t piece_bytes,
                                 cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  const cudaError_t copied = cudaMemcpyAsync(scratch, data, rows * row_bytes, cudaMemcpyDeviceToDevice, stream);
  if (copied != cudaSuccess) return copied;
  const size_t pieces = rows * row_bytes / piece_bytes;
  const unsigned threads = 256, blocks = unsigned((pieces + threads - 1) / threads);
  const auto* src = static_cast<const uint8_t*>(scratch);
  auto* dst = static_cast<uint8_t*>(data);
  if (piece_bytes == 16) rows_to_tiles_kernel<16><<<blocks, threads, 0, stream>>>(src, dst, rows, row_bytes);
  else if (piece_bytes == 2) rows_to_tiles_kernel<2><<<blocks, threads, 0, stream>>>(src, dst, rows, row_bytes);
  else rows_to_tiles_kernel<1><<<blocks, threads, 0, stream>>>(src, dst, rows, row_bytes);
  return cudaGetLastError();
}

}  // namespace dsv4::gpu
