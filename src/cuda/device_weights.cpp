// SPDX-License-Identifier: MIT
#include "cuda/device_weights.h"

#include <algorithm>
#include <cstring>

#include "core/check.h"
#include "cuda/cuda_check.h"
#include "cuda/fp4_layout.h"
#include "cuda/synthetic.h"
#include "cuda/weight_tiles.h"
#include "formats/bf16.h"

namespace dsv4 {
namespace {

GemvWeight gemv_format(WeightFormat f) {
  switch (f) {
    case WeightFormat::Float: return GemvWeight::BF16;
    case WeightFormat::Fp8Block: return GemvWeight::FP8_BLOCK;
    case WeightFormat::Mxfp4: return GemvWeight::MXFP4;
    case WeightFormat::Nvfp4: return GemvWeight::NVFP4;
    case WeightFormat::Fp8Tensor: break;
  }
  DSV4_FAIL("packed weight of format {} has no gemv encoding", format_name(f));
}

void append(std::vector<uint8_t>& out, const uint8_t* p, size_t n) { out.insert(out.end(), p, p + n); }

// Appends m's device bytes: its packed weight and scale as stored, or its fp32 values rounded to bf16.
void append_encoded(const Matrix& m, std::vector<uint8_t>& w, std::vector<uint8_t>& scale) {
  if (m.packed) {
    const size_t at = w.size();
    append(w, m.packed->w, m.packed->w_bytes);
    if (m.packed->format == WeightFormat::Mxfp4 || m.packed->format == WeightFormat::Nvfp4)
      fp4_layout::bytes_to_device(w.data() + at, m.packed->w_bytes);  // the GEMV kernels' bit order
    if (m.packed->scale) append(scale, m.packed->scale, m.packed->scale_bytes);
    return;
  }
  const size_t at = w.size();
  w.resize(at + m.data.size() * 2);
  for (size_t i = 0; i < m.data.size(); ++i) {
    const uint16_t b = f32_to_bf16(m.data[i]);
    std::memcpy(w.data() + at + 2 * i, &b, 2);
  }
}

DeviceBuffer upload_bytes(const std::vector<uint8_t>& bytes) {
  DeviceBuffer b(std::max<size_t>(bytes.size(), 16));
  if (!bytes.empty()) b.upload(bytes.data(), bytes.size());
  return b;
}

}  // namespace

GemvParams DeviceLinear::params(const void* x, void* y, int m, GemvOut out, int64_t ldy, int row0, int rows) const {
  GemvParams p;
  p.m = m;
  p.n = rows < 0 ? n - row0 : rows;
  p.k = k;
  p.x = x;
  p.w = w.data();
  p.w_scale = scale.data();
  p.w_row0 = row0;
  p.w_scale_2 = scale_2;
  p.y = y;
  p.ldy = ldy;
  p.weight = format;
  p.fp8_scale = fp8_scale;
  p.layout = layout;
  p.out = out;
  return p;
}

size_t FusedLinear::bytes() const {
  size_t b = 0;
  for (const Part& p : parts) b += p.weight.bytes();
  return b;
}

size_t DeviceExperts::bytes() const {
  size_t b = 0;
  for (const DeviceBuffer* d : {&w, &scale, &scale_2})
    if (d->data()) b += d->size();
  return b;
}

WeightUploader::Encoding WeightUploader::encoding_of(const Matrix& m, std::optional<GemvWeight> synthetic_as) const {
  Encoding e;
  if (m.packed) {
    e.format = gemv_format(m.packed->format);
    e.fp8_scale = m.packed->scale_f32 ? GemvScale::F32 : GemvScale::E8M0;
    e.scale_2 = m.packed->scale_2;
  } else if (!m.has_values()) {
    const std::optional<GemvWeight> f = synthetic_as ? synthetic_as : synthetic_;
    DSV4_CHECK(f, "cuda runner: a [{}, {}] weight has no values (shape-only weights need a synthetic format)", m.rows,
               m.cols);
    e.format = *f;
    e.synthetic = true;
  }
  return e;
}

bool WeightUploader::tiled(GemvWeight format, const std::vector<int>& rows, int k) const {
  return fp4_tiles_ && std::all_of(rows.begin(), rows.end(), [&](int r) { return gemv_tiles_fit(format, r, k); });
}

void WeightUploader::to_tiles(GemvWeight format, void* w, void* scale, int rows, int k) {
  const size_t w_bytes = size_t(gemv_weight_bytes(format, rows, k)), s_bytes = size_t(gemv_scale_bytes(format, rows, k));
  if (tile_scratch_.size() < w_bytes) tile_scratch_ = DeviceBuffer(w_bytes);
  gpu::rows_to_tiles(w, tile_scratch_.data(), size_t(rows), w_bytes / size_t(rows), weight_tiles::kWeightPiece,
                     nullptr);
  const size_t scale_piece = format == GemvWeight::NVFP4 ? 2 : 1;  // per 32 elements
  gpu::rows_to_tiles(scale, tile_scratch_.data(), size_t(rows), s_bytes / size_t(rows), scale_piece, nullptr);
  DSV4_CUDA_CHECK(cudaStreamSynchronize(nullptr));  // the scratch is reused by the next matrix
}

DeviceLinear WeightUploader::upload(const std::vector<const Matrix*>& parts, const Encoding& e) {
  DeviceLinear d;
  d.format = e.format;
  d.fp8_scale = e.fp8_scale;
  d.scale_2 = e.scale_2;
  d.k = parts.front()->cols;
  std::vector<int> rows;
  for (const Matrix* m : parts) d.n += m->rows, rows.push_back(m->rows);
  if (e.synthetic) {
    d.w = DeviceBuffer(std::max<int64_t>(gemv_weight_bytes(e.format, d.n, d.k), 16));
    const int64_t scale_bytes = gemv_scale_bytes(e.format, d.n, d.k);
    if (scale_bytes) d.scale = DeviceBuffer(scale_bytes);
    fill_synthetic_weight(e.format, d.w.data(), d.scale.data(), d.n, d.k, seed_++, nullptr);
  } else {
    std::vector<uint8_t> w, scale;
    for (const Matrix* m : parts) append_encoded(*m, w, scale);
    d.w = upload_bytes(w);
    if (!scale.empty()) d.scale = upload_bytes(scale);
  }
  if (tiled(d.format, rows, d.k)) {  // the same matrix either way (synthetic codes too): only the bytes move
    to_tiles(d.format, d.w.data(), d.scale.data(), d.n, d.k);
    d.layout = GemvLayout::Tiles;
  }
  return d;
}

DeviceLinear WeightUploader::linear(const Matrix& m, std::optional<GemvWeight> synthetic_as) {
  return upload({&m}, encoding_of(m, synthetic_as));
}

FusedLinear WeightUploader::fused(const std::vector<const Matrix*>& parts) {
  FusedLinear f;
  f.k = parts.front()->cols;
  std::vector<const Matrix*> group;
  Encoding group_enc;
  int group_rows = 0, group_row0 = 0;
  auto flush = [&] {
    if (group.empty()) return;
    f.parts.push_back({upload(group, group_enc), group_row0});
    group_row0 += group_rows;
    group.clear();
    group_rows = 0;
  };
  for (const Matrix* m : parts) {
    DSV4_CHECK(m->cols == f.k, "cuda runner: fused projection parts have k = {} and {}", f.k, m->cols);
    const Encoding e = encoding_of(*m);
    const bool joins = !group.empty() && e.format == group_enc.format && e.fp8_scale == group_enc.fp8_scale &&
                       e.synthetic == group_enc.synthetic &&
                       (e.format != GemvWeight::NVFP4 || e.scale_2 == group_enc.scale_2) &&
                       (e.format != GemvWeight::FP8_BLOCK || group_rows % 128 == 0);  // scale rows stay whole
    if (!joins) {
      flush();
      group_enc = e;
    }
    group.push_back(m);
    group_rows += m->rows;
    f.n += m->rows;
  }
  flush();
  return f;
}

bool WeightUploader::same_group(const Matrix& m, const Matrix& first) const {
  const Encoding x = encoding_of(m), e = encoding_of(first);
  return m.rows == first.rows && m.cols == first.cols && x.format == e.format && x.fp8_scale == e.fp8_scale &&
         x.synthetic == e.synthetic;
}

bool WeightUploader::groupable(const std::vector<const Matrix*>& matrices) const {
  return !matrices.empty() && std::all_of(matrices.begin(), matrices.end(), [&](const Matrix* m) {
    return same_group(*m, *matrices.front());
  });
}

DeviceExperts WeightUploader::experts(const std::vector<const Matrix*>& per_expert) {
  DSV4_CHECK(!per_expert.empty(), "cuda runner: a MoE layer without routed experts");
  DeviceExperts d;
  const Encoding e = encoding_of(*per_expert.front());
  d.format = e.format;
  d.fp8_scale = e.fp8_scale;
  d.experts = int(per_expert.size());
  d.n = per_expert.front()->rows;
  d.k = per_expert.front()->cols;
  d.w_stride = size_t(gemv_weight_bytes(d.format, d.n, d.k));
  d.scale_stride = size_t(gemv_scale_bytes(d.format, d.n, d.k, d.fp8_scale));
  d.w = DeviceBuffer(std::max<size_t>(d.w_stride * d.experts, 16));
  if (d.scale_stride) d.scale = DeviceBuffer(d.scale_stride * d.experts);
  std::vector<float> scale_2(d.experts, 1.0f);
  for (int x = 0; x < d.experts; ++x) {
    const Matrix& m = *per_expert[x];
    const Encoding ex = encoding_of(m);
    DSV4_CHECK(same_group(m, *per_expert.front()),
               "cuda runner: routed expert {} is stored as {} [{}, {}], expert 0 as {} [{}, {}]; the grouped expert "
               "kernel needs one encoding per layer", x, gemv_weight_name(ex.format), m.rows, m.cols,
               gemv_weight_name(e.format), d.n, d.k);
    scale_2[x] = ex.scale_2;
    uint8_t* w_at = d.w.as<uint8_t>() + size_t(x) * d.w_stride;
    uint8_t* s_at = d.scale_stride ? d.scale.as<uint8_t>() + size_t(x) * d.scale_stride : nullptr;
    if (e.synthetic) {
      fill_synthetic_weight(e.format, w_at, s_at, d.n, d.k, seed_++, nullptr);
      continue;
    }
    std::vector<uint8_t> w, scale;
    append_encoded(m, w, scale);
    DSV4_CHECK(w.size() == d.w_stride && scale.size() == d.scale_stride,
               "cuda runner: routed expert {} has {} + {} bytes, its shape needs {} + {}", x, w.size(), scale.size(),
               d.w_stride, d.scale_stride);
    d.w.upload(w.data(), w.size(), size_t(x) * d.w_stride);
    if (s_at) d.scale.upload(scale.data(), scale.size(), size_t(x) * d.scale_stride);
  }
  if (tiled(d.format, {d.n}, d.k)) {
    for (int x = 0; x < d.experts; ++x)
      to_tiles(d.format, d.w.as<uint8_t>() + size_t(x) * d.w_stride, d.scale.as<uint8_t>() + size_t(x) * d.scale_stride,
               d.n, d.k);
    d.layout = GemvLayout::Tiles;
  }
  if (d.format == GemvWeight::NVFP4) {
    d.scale_2 = DeviceBuffer(scale_2.size() * sizeof(float));
    d.scale_2.upload(scale_2.data(), scale_2.size() * sizeof(float));
  }
  return d;
}

}  // namespace dsv4
