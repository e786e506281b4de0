// SPDX-License-Identifier: MIT
// gpu::compressor_advance: a sequence fed in chunks of mixed sizes (the parallel prefill path) must leave the same
// entries and the same live state bits as the same sequence fed one token at a time (the decode walk), for the
// overlapped ratio-4 compressor (CSA) and the plain ratio-128 one (HCA), chunks starting mid-block included.
#include <gtest/gtest.h>

#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "cuda/ops.h"
#include "cuda_test_util.h"

namespace dsv4 {
namespace {

using namespace cuda_test;

struct CompressorRun {
  std::vector<float> entries, kv, score;
};

CompressorRun run_compressor(int ratio, int dim, bool overlap, const std::vector<float>& kv_in,
                             const std::vector<float>& gate_in, const std::vector<float>& ape, int tokens,
                             const std::vector<int>& chunks) {
  const int width = overlap ? 2 * dim : dim, rows = overlap ? 2 * ratio : ratio, max_entries = tokens / ratio + 1;
  const int64_t stride = 2 * width + 3;  // inputs interleaved in one padded row, like the runner's fused output
  std::vector<float> in(size_t(tokens) * stride, 0.0f);
  for (int t = 0; t < tokens; ++t) {
    std::memcpy(&in[size_t(t) * stride], &kv_in[size_t(t) * width], width * sizeof(float));
    std::memcpy(&in[size_t(t) * stride + width], &gate_in[size_t(t) * width], width * sizeof(float));
  }
  DeviceBuffer din = to_device(in), dape = to_device(ape);
  DeviceBuffer kv = to_device(std::vector<float>(size_t(rows) * width, 0.0f));
  DeviceBuffer score = to_device(std::vector<float>(size_t(rows) * width, -std::numeric_limits<float>::infinity()));
  DeviceBuffer entries = nan_buffer(size_t(max_entries) * dim);
  int64_t pos = 0;
  for (int len : chunks) {
    gpu::CompressorParams p;
    p.kv_in = din.as<float>() + pos * stride;
    p.gate_in = din.as<float>() + pos * stride + width;
    p.in_stride = stride;
    p.ape = dape.as<float>();
    p.state_kv = kv.as<float>();
    p.state_score = score.as<float>();
    p.entries = entries.as<float>();
    p.ratio = ratio;
    p.dim = dim;
    p.n = len;
    p.overlap = overlap;
    p.pos0 = pos;
    gpu::compressor_advance(p, nullptr);
    pos += len;
  }
  EXPECT_EQ(pos, tokens) << "test setup: chunks must cover the tokens";
  sync();
  return {to_host<float>(entries, size_t(max_entries) * dim), to_host<float>(kv, size_t(rows) * width),
          to_host<float>(score, size_t(rows) * width)};
}

void check_chunked_equals_walk(int ratio, int dim, bool overlap, const std::vector<int>& chunks) {
  int tokens = 0;
  for (int c : chunks) tokens += c;
  SCOPED_TRACE("ratio " + std::to_string(ratio) + (overlap ? " overlapped" : "") + ", " + std::to_string(tokens) +
               " tokens");
  std::mt19937 rng(ratio * 1000 + tokens);
  const int width = overlap ? 2 * dim : dim;
  const std::vector<float> kv_in = random_vector(size_t(tokens) * width, rng, -2.0f, 2.0f);
  const std::vector<float> gate_in = random_vector(size_t(tokens) * width, rng, -3.0f, 3.0f);
  const std::vector<float> ape = random_vector(size_t(ratio) * width, rng, -1.0f, 1.0f);
  const CompressorRun chunked = run_compressor(ratio, dim, overlap, kv_in, gate_in, ape, tokens, chunks);
  const CompressorRun walked =
      run_compressor(ratio, dim, overlap, kv_in, gate_in, ape, tokens, std::vector<int>(size_t(tokens), 1));
  const int n_entries = tokens / ratio;
  int bad = 0;
  for (size_t i = 0; i < size_t(n_entries) * dim; ++i)
    if (std::memcmp(&chunked.entries[i], &walked.entries[i], sizeof(float)) != 0 && ++bad <= 5)
      ADD_FAILURE() << "entry " << i / dim << " column " << i % dim << ": chunked " << chunked.entries[i]
                    << ", walked " << walked.entries[i];
  EXPECT_EQ(bad, 0);
  // Live state rows: the partial block at the end (and, overlapped, the last complete block in rows 0..r-1).
  const int partial = tokens % ratio;
  std::vector<int> live;
  for (int i = 0; i < partial; ++i) live.push_back(overlap ? ratio + i : i);
  if (overlap && tokens >= ratio)
    for (int i = 0; i < ratio; ++i) live.push_back(i);
  for (int row : live)
    for (int col = 0; col < width; ++col) {
      const size_t at = size_t(row) * width + col;
      EXPECT_EQ(std::memcmp(&chunked.kv[at], &walked.kv[at], sizeof(float)), 0) << "kv row " << row << " col " << col;
      EXPECT_EQ(std::memcmp(&chunked.score[at], &walked.score[at], sizeof(float)), 0)
          << "score row " << row << " col " << col;
    }
}

TEST(CudaCompressor, ChunkedOverlappedRatio4MatchesWalk) {
  DSV4_REQUIRE_CUDA();
  check_chunked_equals_walk(4, 512, true, {64, 64, 1, 3, 64, 37, 2});   // chunks ending mid-block
  check_chunked_equals_walk(4, 128, true, {3, 1, 64, 5});               // first entry inside the first chunk
  check_chunked_equals_walk(4, 96, true, {2, 2, 64});                   // no entry in the first chunks
}

TEST(CudaCompressor, ChunkedRatio128MatchesWalk) {
  DSV4_REQUIRE_CUDA();
  check_chunked_equals_walk(128, 512, false, {64, 64, 64, 64, 30, 64});  // entries at chunk ends and mid-chunk
  check_chunked_equals_walk(128, 64, false, {100, 64, 64});
  check_chunked_equals_walk(128, 96, false, {512, 300, 1, 200});       // prefill chunks: several entries each
}

TEST(CudaCompressor, PrefillChunksOverlappedMatchWalk) {
  DSV4_REQUIRE_CUDA();
  check_chunked_equals_walk(4, 512, true, {512, 70, 1, 130});
}

}  // namespace
}  // namespace dsv4
