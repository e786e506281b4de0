// SPDX-License-Identifier: MIT
// The tiles of a warp-specialised wgmma launch (gemv_wgmma.cu) and the order its blocks walk them: counting only,
// host and device alike, so that a CPU test (tests/cuda/test_tile_walk.cu) checks that every tile is walked once.
#pragma once
#include <cstdint>

#include "cuda/gemv_launch.h"
#include "formats/hd.h"

namespace dsv4::detail {

// The launch's tiles as the host sizes its grid: every matrix (a.tile_ys batches or slots x a.tile_zs projections)
// with a.m's token blocks. Grouped launches have at most this many (a slot holds at most a.m rows).
DSV4_HD int64_t walk_tiles_bound(const KernelArgs& a, int block_cols, int n_tokens) {
  return int64_t((a.n + block_cols - 1) / block_cols) * ((a.m + n_tokens - 1) / n_tokens) * a.tile_ys * a.tile_zs;
}

// Every thread of a block walks tiles blockIdx.x, + gridDim.x, ... in the same increasing order: matrices one after
// the other (batched: a.tile_ys batches; grouped: slot-major, the slots' a.tile_zs projections), each of row blocks x
// token blocks, token blocks fastest, so that the blocks at work at one time share a weight row block. A grouped
// matrix has ceil(m_rows / kN) token blocks: slots and token blocks without rows are no tiles (the grid of one block
// per tile gave every slot a.m's token blocks, most of them empty). Reads a.slot_count and a.slot_offset (grouped),
// so on the device only after the wait for the kernel that wrote them.
template <bool kGrouped, int kN>
struct TileWalk {
  int matrix = -1, first = 0, count = 0, token_blocks = 0, m_rows = 0;

  // Moves to the matrix that holds `tile` (tiles only increase); false when the launch has fewer tiles. Only counts
  // are kept: the producer's 104 registers do not hold a matrix's pointers across tiles (with them its N = 64 forms
  // spilled).
  DSV4_HD bool seek(const KernelArgs& a, int tile, int row_blocks) {
    while (tile >= first + count) {
      first += count;
      ++matrix;
      m_rows = a.m;
      if constexpr (kGrouped) {
        const int s = matrix / a.tile_zs;
        if (s >= a.tile_ys || s >= *a.slot_count) return false;
        m_rows = a.slot_offset[s + 1] - a.slot_offset[s];
      } else {
        if (matrix >= a.tile_ys) return false;
      }
      token_blocks = (m_rows + kN - 1) / kN;
      count = token_blocks * row_blocks;
    }
    return true;
  }
  DSV4_HD int slot(const KernelArgs& a) const { return kGrouped ? matrix / a.tile_zs : 0; }
  DSV4_HD int projection(const KernelArgs& a) const { return kGrouped ? matrix % a.tile_zs : 0; }
  // The tile's first token and first output column (of block_cols per row block).
  DSV4_HD int tok0(int tile) const { return (tile - first) % token_blocks * kN; }
  DSV4_HD int row_block0(int tile, int block_cols) const { return (tile - first) / token_blocks * block_cols; }
};

}  // namespace dsv4::detail
