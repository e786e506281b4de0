// SPDX-License-Identifier: MIT
// The tile layout of fp4 weights for the skinny GEMV (GemvLayout::Tiles in gemv.h).
// The skinny kernel gives each warp a 16-row tile; quad thread t of mma group g takes bytes 16t..16t+15 of each
// 64-byte chunk of rows g (lo) and g + 8 (hi). In the row-major layout one warp load of a chunk touches 8 pieces
// of 64 bytes a row apart; in the tile layout the same bytes are 512 contiguous bytes per load:
//   tile = row / 16, chunk = byte / 64 of the row, half = (row % 16) / 8 (lo / hi rows), lane = (row % 8) * 4 +
//   (byte % 64) / 16, offset = tile · 16 · row_bytes + chunk · 1024 + half · 512 + lane · 16 + byte % 16.
// Scales move the same way with a piece of 2 bytes (NVFP4: the two e4m3 scales of a lane's 32 elements) or 1 byte
// (MXFP4: its e8m0 scale): each warp load of a chunk's scales is 64 (32) contiguous bytes.
// A tile holds exactly the bytes of its 16 rows, so every 16-row-aligned range of rows is the same byte range in
// both layouts: row offsets of fused projections, expert strides and scale tensor sizes do not change.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#if defined(__CUDACC__)
#define DSV4_TILES_HD __host__ __device__ __forceinline__
#else
#define DSV4_TILES_HD inline
#endif

namespace dsv4::weight_tiles {

constexpr int kRows = 16;        // rows per tile
constexpr int kChunkPieces = 4;  // pieces of a row per chunk (quad threads)
constexpr int kWeightPiece = 16; // bytes of one weight piece

// Offset in the tile layout of byte `byte` of row `row`, for rows of row_bytes bytes made of pieces of piece_bytes
// (row_bytes a multiple of 4 · piece_bytes, rows a multiple of 16).
DSV4_TILES_HD size_t offset(size_t row, size_t byte, size_t row_bytes, size_t piece_bytes) {
  const size_t chunk_bytes = kChunkPieces * piece_bytes;  // of one row
  const size_t half = (row % kRows) / 8, lane = (row % 8) * kChunkPieces + (byte % chunk_bytes) / piece_bytes;
  return row / kRows * kRows * row_bytes + byte / chunk_bytes * (kRows * chunk_bytes) + half * (8 * chunk_bytes) +
         lane * piece_bytes + byte % piece_bytes;
}

// The row and the byte of that row held at `offset` of the tile layout (the inverse of offset()).
struct RowByte {
  size_t row, byte;
};
DSV4_TILES_HD RowByte position(size_t offset, size_t row_bytes, size_t piece_bytes) {
  const size_t chunk_bytes = kChunkPieces * piece_bytes, tile_bytes = kRows * row_bytes;
  const size_t in_tile = offset % tile_bytes, in_chunk = in_tile % (kRows * chunk_bytes);
  const size_t half = in_chunk / (8 * chunk_bytes), lane = in_chunk % (8 * chunk_bytes) / piece_bytes;
  return {offset / tile_bytes * kRows + half * 8 + lane / kChunkPieces,
          in_tile / (kRows * chunk_bytes) * chunk_bytes + lane % kChunkPieces * piece_bytes + offset % piece_bytes};
}

// Whether [rows, row_bytes] can take the tile layout with pieces of piece_bytes.
DSV4_TILES_HD bool fits(size_t rows, size_t row_bytes, size_t piece_bytes) {
  return rows % kRows == 0 && row_bytes % (kChunkPieces * piece_bytes) == 0;
}

// Row-major bytes [rows, row_bytes] -> the tile layout (dst and src must not overlap).
inline void from_rows(const uint8_t* src, uint8_t* dst, size_t rows, size_t row_bytes, size_t piece_bytes) {
  for (size_t r = 0; r < rows; ++r)
    for (size_t b = 0; b < row_bytes; b += piece_bytes)
      for (size_t i = 0; i < piece_bytes; ++i) dst[offset(r, b + i, row_bytes, piece_bytes)] = src[r * row_bytes + b + i];
}

}  // namespace dsv4::weight_tiles

namespace dsv4::gpu {

// data [rows, row_bytes] row-major -> the tile layout in place, through scratch (>= rows · row_bytes bytes) on
// `stream` (weight_tiles::fits must hold; piece_bytes 16, 2 or 1). Errors are thrown as dsv4::Error.
void rows_to_tiles(void* data, void* scratch, size_t rows, size_t row_bytes, size_t piece_bytes, cudaStream_t stream);

}  // namespace dsv4::gpu
