// SPDX-License-Identifier: MIT
#include "model/weight_decode.h"

#include <fmt/ranges.h>

#include "core/check.h"
#include "io/safetensors.h"

namespace dsv4 {

std::vector<float> decode_weight_f32(const Checkpoint& checkpoint, const TensorView& t,
                                     const std::vector<int64_t>& shape) {
  (void)checkpoint;
  switch (t.dtype) {
    case DType::F32: case DType::F64: case DType::BF16: case DType::F16:
      DSV4_CHECK(t.shape == shape, "tensor \"{}\" in {}: expected shape [{}], got {}", t.name, t.file,
                 fmt::join(shape, ", "), t.shape_str());
      return to_f32(t);
    default:
      DSV4_FAIL("tensor \"{}\" in {}: weights stored as {} are not supported yet", t.name, t.file,
                dtype_name(t.dtype));
  }
}

}  // namespace dsv4
