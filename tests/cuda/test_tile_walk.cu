// SPDX-License-Identifier: MIT
// The warp-specialised wgmma kernel's tile walk (cuda/gemv_tile_walk.h) on the host: whatever the number of walking
// blocks, every tile of a plain, batched or grouped launch is walked exactly once, and a grouped launch walks only
// the token blocks its slots' rows fill. Needs no GPU: the walk is counting.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <random>
#include <tuple>
#include <vector>

#include "cuda/gemv_tile_walk.h"

namespace dsv4::detail {
namespace {

using Tile = std::tuple<int, int, int>;  // matrix (batch, or slot * projections + projection), first column, token

// Walks the launch as `blocks` blocks of the kernel would (block b: tiles b, b + blocks, ...), counting each tile.
template <bool kGrouped, int kN>
std::map<Tile, int> walk_all(const KernelArgs& a, int blocks, int block_cols) {
  const int row_blocks = (a.n + block_cols - 1) / block_cols;
  std::map<Tile, int> seen;
  for (int b = 0; b < blocks; ++b) {
    TileWalk<kGrouped, kN> walk;
    for (int tile = b; walk.seek(a, tile, row_blocks); tile += blocks) {
      const int tok0 = walk.tok0(tile), col0 = walk.row_block0(tile, block_cols);
      EXPECT_LT(tok0, walk.m_rows) << "a tile without rows";
      EXPECT_LT(col0, a.n);
      EXPECT_EQ(walk.slot(a) * a.tile_zs + walk.projection(a), kGrouped ? walk.matrix : 0);
      ++seen[{walk.matrix, col0, tok0}];
    }
  }
  return seen;
}

// The tiles the launch has: rows[matrix] rows in each matrix.
std::map<Tile, int> expected_tiles(const std::vector<int>& rows, int n, int block_cols, int kn) {
  std::map<Tile, int> tiles;
  for (int matrix = 0; matrix < int(rows.size()); ++matrix)
    for (int col0 = 0; col0 < n; col0 += block_cols)
      for (int tok0 = 0; tok0 < rows[matrix]; tok0 += kn) tiles[{matrix, col0, tok0}] = 1;
  return tiles;
}

// The walker counts a launch may have: one block (walks everything), a few (each walks several tiles of a small
// grid, as the GPU tests force), an SM count, the grid's bound (one tile per block) and more blocks than tiles.
std::vector<int> walker_counts(int64_t bound) {
  return {1, 2, 3, 7, 132, int(bound), int(bound) + 5};
}

template <int kN>
void check_batched(int m, int n, int batches, int block_cols) {
  KernelArgs a{};
  a.m = m;
  a.n = n;
  a.tile_ys = batches;
  a.tile_zs = 1;
  const int64_t bound = walk_tiles_bound(a, block_cols, kN);
  const auto want = expected_tiles(std::vector<int>(size_t(batches), m), n, block_cols, kN);
  EXPECT_EQ(int64_t(want.size()), bound) << "the plain bound is exact";
  for (int blocks : walker_counts(bound))
    EXPECT_EQ((walk_all<false, kN>(a, blocks, block_cols)), want)
        << "m " << m << " n " << n << " batches " << batches << " walkers " << blocks;
}

TEST(TileWalk, PlainAndBatchedLaunchesWalkEveryTileOnce) {
  for (int block_cols : {128, 256}) {
    check_batched<128>(4096, 1024, 1, block_cols);
    check_batched<128>(300, 1000, 1, block_cols);  // partial token and column blocks
    check_batched<64>(65, 4096, 8, block_cols);    // batched (wo_a's groups)
    check_batched<64>(1, 256, 3, block_cols);
  }
}

// Slot s holds sizes[s] rows (a.slot_offset their prefix sums), slot_count of the tile_ys slots hold an expert.
template <int kN>
void check_grouped(int m, int n, int tile_ys, int tile_zs, const std::vector<int>& sizes, int block_cols) {
  std::vector<int32_t> offset(1, 0);
  for (int size : sizes) offset.push_back(offset.back() + size);
  const int32_t slot_count = int32_t(sizes.size());
  KernelArgs a{};
  a.m = m;
  a.n = n;
  a.tile_ys = tile_ys;
  a.tile_zs = tile_zs;
  a.slot_count = &slot_count;
  a.slot_offset = offset.data();
  std::vector<int> rows;  // per matrix: slot-major, its projections
  for (int size : sizes)
    for (int z = 0; z < tile_zs; ++z) rows.push_back(size);
  const auto want = expected_tiles(rows, n, block_cols, kN);
  const int64_t bound = walk_tiles_bound(a, block_cols, kN);
  EXPECT_LE(int64_t(want.size()), bound) << "the grid's bound covers the real tiles";
  for (int blocks : walker_counts(bound))
    EXPECT_EQ((walk_all<true, kN>(a, blocks, block_cols)), want)
        << "slots " << slot_count << " of " << tile_ys << " projections " << tile_zs << " walkers " << blocks;
}

TEST(TileWalk, GroupedLaunchesWalkOnlyTheSlotsRows) {
  // Hand-made: empty slots first, between and last; a slot of exactly kN rows; fewer experts than slots.
  check_grouped<128>(512, 2048, 8, 2, {0, 130, 128, 0, 1, 512, 0}, 256);
  check_grouped<128>(512, 2048, 8, 1, {0, 130, 128, 0, 1, 512, 0}, 128);  // paired: both projections per tile
  check_grouped<64>(64, 1024, 4, 2, {64, 0, 63}, 256);
  check_grouped<64>(10, 300, 2, 1, {}, 128);  // no expert this step: no tile at all
  // Random routings: a 4096-token chunk's pairs over 33 slots and smaller ones.
  std::mt19937 rng(7);
  for (int trial = 0; trial < 40; ++trial) {
    const int tile_ys = 1 + int(rng() % 40), m = 1 + int(rng() % 2048);
    const int experts = int(rng() % (tile_ys + 1));
    std::vector<int> sizes;
    for (int s = 0; s < experts; ++s) sizes.push_back(rng() % 4 == 0 ? 0 : int(rng() % (m + 1)));
    const int n = 128 * (1 + int(rng() % 24)) - (trial % 3 == 0 ? 17 : 0);
    if (trial % 2)
      check_grouped<128>(m, n, tile_ys, 1 + trial % 2, sizes, trial % 4 == 1 ? 128 : 256);
    else
      check_grouped<64>(m, n, tile_ys, 1 + trial % 3 % 2, sizes, 256);
  }
}

}  // namespace
}  // namespace dsv4::detail
