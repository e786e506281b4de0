// SPDX-License-Identifier: MIT
// Model-level helpers of the GPU tests: the CPU reference on the weights the GPU holds (linear_matrices, model/weights.h,
// lists the ones the CUDA runner stores as bf16 or keeps packed).
#pragma once
#include <gtest/gtest.h>

#include <vector>

#include "formats/bf16.h"
#include "model/weights.h"

namespace dsv4 {

// CPU only: how far do logits move when only the linear weights are rounded to bf16 (what the CUDA runner
// stores)? This is the model's own sensitivity, the floor under the CUDA-vs-CPU tolerance. With `packed` (the
// same checkpoint loaded KeepLinearsPacked), the matrices the runner keeps packed stay exact: it decodes them
// exactly inside its kernels.
inline ModelWeights bf16_linears(ModelWeights w, const ModelWeights* packed = nullptr) {
  const std::vector<Matrix*> mats = linear_matrices(w);
  std::vector<const Matrix*> kept;
  if (packed) {
    kept = linear_matrices(*packed);
    EXPECT_EQ(kept.size(), mats.size());
  }
  for (size_t i = 0; i < mats.size(); ++i) {
    if (i < kept.size() && kept[i]->packed.has_value()) continue;
    for (float& v : mats[i]->data) v = round_bf16(v);
  }
  return w;
}

}  // namespace dsv4
