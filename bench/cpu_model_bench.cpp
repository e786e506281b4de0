// SPDX-License-Identifier: MIT
// cpu_model_bench: the CPU backend on the first layers of the V4-Flash shape (hidden 4096, 64 heads x 512, experts of
// 2048, vocabulary 129280; 8 routed experts so that it fits in memory, batch-1 decode reads 6 of them whatever the
// count), with fp32 weights and then with every linear layer packed as NVFP4 (quantised in memory, as
// --cpu-weights packed keeps a checkpoint's). Prints the resident weight bytes, the prefill and decode times, the
// bytes each decoded token reads and their rate against this machine's copy bandwidth (measured in the same run).
//   cpu_model_bench [layers = 4] [decode steps = 8]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <vector>

#include "model/model.h"
#include "model/state.h"
#include "model/synthetic.h"
#include "quant/quantize.h"
#include "quant/stored_weight.h"

namespace {

using namespace dsv4;
using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

double copy_bandwidth_gbs() {
  const size_t bytes = size_t(1) << 30;
  std::vector<char> a(bytes, 1), b(bytes, 0);
  std::memcpy(b.data(), a.data(), bytes);
  const auto start = Clock::now();
  for (int i = 0; i < 3; ++i) std::memcpy(b.data(), a.data(), bytes);
  return 3 * 2.0 * double(bytes) / seconds_since(start) / 1e9;  // read + write
}

// The linear layers the CPU forward reads through linear() (model/model.cpp): linear_matrices without the embedding,
// which the forward gathers rows from as fp32.
std::vector<Matrix*> linears(ModelWeights& w) {
  std::vector<Matrix*> out = linear_matrices(w);
  out.erase(out.begin());
  return out;
}

size_t weight_bytes(ModelWeights& w, const std::deque<Nvfp4Matrix>& packed) {
  size_t bytes = 0;
  for (const Matrix* m : linear_matrices(w)) bytes += m->data.size() * sizeof(float);
  for (const Nvfp4Matrix& m : packed) bytes += m.packed.size() + m.scale.size();
  return bytes;
}

struct Timing {
  double prefill_s = 0, decode_s_per_token = 0;
  int32_t last_token = 0;
};

Timing run(const Model& model, int prompt_len, int steps) {
  SequenceState state = model.new_sequence(prompt_len + steps + 1);
  std::vector<int32_t> prompt(static_cast<size_t>(prompt_len));
  for (int i = 0; i < prompt_len; ++i) prompt[size_t(i)] = int32_t((i * 7919 + 13) % model.config().vocab_size);
  Timing t;
  auto start = Clock::now();
  std::vector<float> logits = model.forward(state, prompt, true);
  t.prefill_s = seconds_since(start);
  start = Clock::now();
  for (int s = 0; s < steps; ++s) {
    const int32_t next = int32_t(std::max_element(logits.begin(), logits.end()) - logits.begin());
    t.last_token = next;
    logits = model.forward(state, std::vector<int32_t>{next}, true);
  }
  t.decode_s_per_token = seconds_since(start) / steps;
  return t;
}

}  // namespace

int main(int argc, char** argv) {
  const int layers = argc > 1 ? std::atoi(argv[1]) : 4, steps = argc > 2 ? std::atoi(argv[2]) : 8;
  const int prompt_len = 16;
  ModelConfig c = flash_shaped_config(8);
  c.n_layers = std::clamp(layers, 1, c.n_layers);
  c.attn_kind.resize(size_t(c.n_layers));
  c.compress_ratio.resize(size_t(c.n_layers));
  c.hash_routed.resize(size_t(c.n_layers));
  const double copy = copy_bandwidth_gbs();
  std::printf("copy bandwidth (1 GiB memcpy, read + write): %.1f GB/s\nmodel: %s\n", copy, c.summary().c_str());

  // Bytes a decoded token reads: every linear but the routed experts, 6 of those, one embedding row.
  auto bytes_per_token = [&](double bytes_per_weight) {
    const double D = c.hidden_size, experts = 3.0 * c.moe_inter * D;
    ModelWeights shapes = synthetic_weights(c, 1, SyntheticLinears::ShapeOnly);
    double all = 0, routed = 0;
    for (Matrix* m : linears(shapes)) all += double(m->rows) * m->cols;
    for (const LayerWeights& L : shapes.layers) routed += double(L.ffn.experts.size()) * experts;
    return (all - routed + double(c.n_layers) * c.n_experts_per_tok * experts) * bytes_per_weight;
  };

  for (const bool packed : {false, true}) {
    auto start = Clock::now();
    ModelWeights w = synthetic_weights(c, 1, SyntheticLinears::Filled);
    std::deque<Nvfp4Matrix> store;  // the packed bytes the views point into
    if (packed)
      for (Matrix* m : linears(w)) {
        Nvfp4Matrix& q = store.emplace_back(quantize_nvfp4(m->data, m->rows, m->cols, abs_max(m->data)));
        PackedWeight p;
        p.format = WeightFormat::Nvfp4;
        p.w = q.packed.data();
        p.w_bytes = q.packed.size();
        p.scale = q.scale.data();
        p.scale_bytes = q.scale.size();
        p.scale_2 = q.global_scale;
        m->packed = p;
        std::vector<float>().swap(m->data);
      }
    const size_t resident = weight_bytes(w, store);
    const Model model(c, std::move(w), Numerics{});
    std::printf("\n%s weights: %.2f GB resident (built in %.0f s)\n", packed ? "NVFP4 packed" : "fp32",
                double(resident) / 1e9, seconds_since(start));
    const Timing t = run(model, prompt_len, steps);
    const double per_token = bytes_per_token(packed ? 0.5 + 1.0 / 16 : 4.0);
    std::printf("  prefill %d tokens: %.2f s (%.1f tok/s)\n", prompt_len, t.prefill_s, prompt_len / t.prefill_s);
    std::printf("  decode: %.3f s/token (%.2f tok/s); %.2f GB of linear weights per token -> %.1f GB/s, %.3f of "
                "copy bandwidth (last token %d)\n", t.decode_s_per_token, 1.0 / t.decode_s_per_token, per_token / 1e9,
                per_token / t.decode_s_per_token / 1e9, per_token / t.decode_s_per_token / 1e9 / copy, t.last_token);
  }
  return 0;
}
