// SPDX-License-Identifier: MIT
// Decoding a stored weight to fp32, whatever its storage format. Plain float tensors convert element-wise;
// quantised tensors are recognised from their dtype plus companion scale tensors next to them in the checkpoint.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace dsv4 {

class Checkpoint;
struct TensorView;

// `t` is the stored tensor (e.g. "layers.0.attn.wq_a.weight"); `shape` the logical [rows, cols] (or any rank)
// the model expects. Throws dsv4::Error naming the tensor when the storage, its scales or the shape don't fit.
std::vector<float> decode_weight_f32(const Checkpoint& checkpoint, const TensorView& t,
                                     const std::vector<int64_t>& shape);

}  // namespace dsv4
