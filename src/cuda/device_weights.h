// SPDX-License-Identifier: MIT
// The model's linear-layer weights on the device, in the encodings gemv() reads: a checkpoint's FP8 / MXFP4 /
// NVFP4 / BF16 bytes uploaded as they are (Matrix::packed), fp32 values rounded to bf16 (Matrix::data), or random
// codes of a chosen format for shape-only matrices (benchmarks).
#pragma once
#include <cstdint>
#include <optional>
#include <vector>

#include "cuda/device.h"
#include "cuda/gemv.h"
#include "model/weights.h"

namespace dsv4 {

// One weight matrix [n, k] on the device.
struct DeviceLinear {
  GemvWeight format = GemvWeight::BF16;
  GemvScale fp8_scale = GemvScale::E8M0;
  float scale_2 = 1.0f;  // NVFP4
  GemvLayout layout = GemvLayout::Rows;
  int n = 0, k = 0;
  DeviceBuffer w, scale;

  size_t bytes() const { return (w.data() ? w.size() : 0) + (scale.data() ? scale.size() : 0); }
  // gemv of rows [row0, row0 + rows) (rows < 0: to the end) against x [m, k] into y [m, ldy].
  GemvParams params(const void* x, void* y, int m, GemvOut out, int64_t ldy = 0, int row0 = 0, int rows = -1) const;
};

// A row-concatenation of matrices sharing k (the fused input projections): as few DeviceLinears as their
// encodings allow, each writing its columns [row0, row0 + n) of the [m, n_total] output.
struct FusedLinear {
  struct Part {
    DeviceLinear weight;
    int row0 = 0;
  };
  std::vector<Part> parts;
  int n = 0, k = 0;
  size_t bytes() const;
};

// The routed experts of one layer and one projection (w1, w3 or w2): E matrices [n, k] in one encoding,
// expert e at e·w_stride bytes (scales at e·scale_stride); NVFP4 global scales scale_2 [E] fp32.
struct DeviceExperts {
  GemvWeight format = GemvWeight::BF16;
  GemvScale fp8_scale = GemvScale::E8M0;
  GemvLayout layout = GemvLayout::Rows;
  int experts = 0, n = 0, k = 0;
  size_t w_stride = 0, scale_stride = 0;
  DeviceBuffer w, scale, scale_2;
  size_t bytes() const;
};

class WeightUploader {
 public:
  // synthetic: the format of shape-only matrices (nullopt: such a matrix is an error). fp4_tiles: MXFP4 / NVFP4
  // matrices whose rows come in whole 16-row tiles (every part of a fused projection too) and whose k is a multiple
  // of 128 go to the GPU in the tile layout (GemvLayout::Tiles, cuda/weight_tiles.h).
  WeightUploader(std::optional<GemvWeight> synthetic, uint64_t seed, bool fp4_tiles = false)
      : synthetic_(synthetic), seed_(seed), fp4_tiles_(fp4_tiles) {}

  // synthetic_as: overrides the synthetic format for this matrix (the lm_head stays bf16 in benchmarks).
  DeviceLinear linear(const Matrix& m, std::optional<GemvWeight> synthetic_as = std::nullopt);
  FusedLinear fused(const std::vector<const Matrix*>& parts);
  DeviceExperts experts(const std::vector<const Matrix*>& per_expert);
  // Whether experts() takes these matrices: one shape and one encoding (format, FP8 scale type, synthetic).
  bool groupable(const std::vector<const Matrix*>& matrices) const;
  // Frees the tile layout's scratch (up to one matrix) once every matrix is up: cuda_memory_need does not count it.
  void release_scratch() { tile_scratch_ = DeviceBuffer(); }

 private:
  struct Encoding {
    GemvWeight format = GemvWeight::BF16;
    GemvScale fp8_scale = GemvScale::E8M0;
    float scale_2 = 1.0f;
    bool synthetic = false;
  };
  Encoding encoding_of(const Matrix& m, std::optional<GemvWeight> synthetic_as = std::nullopt) const;
  // m can share one DeviceExperts with `first`: same shape, format, FP8 scale type and synthetic-ness.
  bool same_group(const Matrix& m, const Matrix& first) const;
  DeviceLinear upload(const std::vector<const Matrix*>& parts, const Encoding& e);
  // Whether matrices of `format` with these row counts and k go up in the tile layout.
  bool tiled(GemvWeight format, const std::vector<int>& rows, int k) const;
  // The [rows, k] matrix at w / scale (row-major) regrouped into the tile layout on the device.
  void to_tiles(GemvWeight format, void* w, void* scale, int rows, int k);

  std::optional<GemvWeight> synthetic_;
  uint64_t seed_;
  bool fp4_tiles_;
  DeviceBuffer tile_scratch_;  // to_tiles's copy of one matrix, grown as needed
};

}  // namespace dsv4
