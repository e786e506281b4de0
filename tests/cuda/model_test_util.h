// SPDX-License-Identifier: MIT
// Model-level helpers of the GPU tests: the linear weights of a model (the ones the CUDA runner stores as bf16 or
// keeps packed) and the CPU reference on the weights the GPU holds.
#pragma once
#include <gtest/gtest.h>

#include <vector>

#include "formats/bf16.h"
#include "model/weights.h"

namespace dsv4 {

// The linear weights of w in a fixed order (embedding and head first, the MTP block's last when loaded); W is
// ModelWeights or const ModelWeights.
template <class W>
auto linear_matrices(W& w) {
  std::vector<decltype(&w.embed)> out = {&w.embed, &w.head};
  auto block = [&](auto& L) {
    auto& A = L.attn;
    for (auto* m : {&A.wq_a, &A.wq_b, &A.wkv, &A.wo_a, &A.wo_b}) out.push_back(m);
    if (A.compressor) out.push_back(&A.compressor->wkv), out.push_back(&A.compressor->wgate);
    if (A.indexer)
      for (auto* m : {&A.indexer->wq_b, &A.indexer->compressor.wkv, &A.indexer->compressor.wgate}) out.push_back(m);
    for (auto& e : L.ffn.experts) out.push_back(&e.w1), out.push_back(&e.w2), out.push_back(&e.w3);
    if (L.ffn.shared) out.push_back(&L.ffn.shared->w1), out.push_back(&L.ffn.shared->w2), out.push_back(&L.ffn.shared->w3);
  };
  for (auto& L : w.layers) block(L);
  if (w.mtp) {
    block(w.mtp->block);
    out.push_back(&w.mtp->e_proj);
    out.push_back(&w.mtp->h_proj);
  }
  return out;
}

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
