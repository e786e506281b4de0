// SPDX-License-Identifier: MIT
// Minimal NumPy .npy (format 1.0/2.0/3.0) reader and writer for golden data and --logits-out.
// Reads little-endian <f2 <f4 <f8 |i1 <i2 <i4 <i8 |u1 |b1, C order only; writes <f4 with the header
// padded so the data starts at a multiple of 64 bytes, as numpy does.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace dsv4 {

struct NpyArray {
  std::vector<int64_t> shape;
  std::vector<double> values;  // every supported dtype (<f4 <f8 <i4 <i8 <u1 ...) read into double, C order
};

NpyArray read_npy(const std::string& path);  // throws dsv4::Error on malformed / unsupported files
void write_npy_f32(const std::string& path, const float* data, const std::vector<int64_t>& shape);

}  // namespace dsv4
