// SPDX-License-Identifier: MIT
// Argument checks of the tile permutation (kernel in weight_tiles.cu).
#include "cuda/weight_tiles.h"

#include "core/check.h"
#include "cuda/cuda_check.h"

namespace dsv4::gpu {

cudaError_t rows_to_tiles_launch(void* data, void* scratch, size_t rows, size_t row_bytes, size_t piece_bytes,
                                 cudaStream_t stream);

void rows_to_tiles(void* data, void* scratch, size_t rows, size_t row_bytes, size_t piece_bytes, cudaStream_t stream) {
  DSV4_CHECK((piece_bytes == 16 || piece_bytes == 2 || piece_bytes == 1) &&
                 weight_tiles::fits(rows, row_bytes, piece_bytes),
             "rows_to_tiles: [{}, {} bytes] in pieces of {} has no tile layout (rows a multiple of 16, rows of whole "
             "4-piece chunks)", rows, row_bytes, piece_bytes);
  DSV4_CHECK(reinterpret_cast<uintptr_t>(data) % 16 == 0 && reinterpret_cast<uintptr_t>(scratch) % 16 == 0,
             "rows_to_tiles: data and scratch must be 16-byte aligned");
  DSV4_CUDA_CHECK(rows_to_tiles_launch(data, scratch, rows, row_bytes, piece_bytes, stream));
}

}  // namespace dsv4::gpu
