// SPDX-License-Identifier: MIT
// Every storage format goes through quant/stored_weight: classify from dtype + companion scales, then the exact
// fp32 dequantisation (docs/formats.md).
#include "model/weight_decode.h"

#include "io/safetensors.h"
#include "quant/stored_weight.h"

namespace dsv4 {

std::vector<float> decode_weight_f32(const Checkpoint& checkpoint, const TensorView& t,
                                     const std::vector<int64_t>& shape) {
  return dequantize(classify_weight(checkpoint, t), shape);
}

}  // namespace dsv4
