// SPDX-License-Identifier: MIT
#include "quant/stored_weight.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <fmt/ranges.h>

#include "core/check.h"
#include "formats/bf16.h"
#include "formats/blocks.h"
#include "formats/fp4.h"
#include "formats/fp8.h"
#include "formats/nvfp4.h"
#include "io/safetensors.h"

namespace dsv4 {
namespace {

bool ends_with(std::string_view s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.substr(s.size() - suffix.size()) == suffix;
}

std::string shape_str(const std::vector<int64_t>& s) { return fmt::format("[{}]", fmt::join(s, ", ")); }

int64_t product(const std::vector<int64_t>& s, size_t begin, size_t end) {
  int64_t p = 1;
  for (size_t i = begin; i < end; ++i) p *= s[i];
  return p;
}

const TensorView* find_first(const Checkpoint& c, const std::vector<std::string>& names) {
  for (const std::string& n : names)
    if (const TensorView* t = c.find(n)) return t;
  return nullptr;
}

bool is_float_dtype(DType d) { return d == DType::F32 || d == DType::F64 || d == DType::BF16 || d == DType::F16; }

// Float values of a small scale tensor (F32/BF16/F16/F64 or F8_E4M3; e8m0 decoded separately).
std::vector<float> float_scales(const TensorView& s) {
  std::vector<float> v(size_t(s.numel()));
  convert_to_f32(s, v);
  return v;
}

// e8m0 scales as floats; a 0xFF byte (NaN) is rejected with its position.
std::vector<float> e8m0_scales(const TensorView& s, const TensorView& weight) {
  std::vector<float> v(size_t(s.numel()));
  for (size_t i = 0; i < v.size(); ++i) {
    DSV4_CHECK(s.data[i] != 0xff, "tensor \"{}\" in {}: scale \"{}\" element {} is 0xFF (NaN in e8m0)", weight.name,
               weight.file, s.name, i);
    v[i] = e8m0_to_f32(s.data[i]);
  }
  return v;
}

void check_scale_values(const std::vector<float>& v, const TensorView& s, const TensorView& weight) {
  for (size_t i = 0; i < v.size(); ++i)
    DSV4_CHECK(std::isfinite(v[i]) && v[i] >= 0.0f,
               "tensor \"{}\" in {}: scale \"{}\" element {} is {} (scales must be finite and >= 0)", weight.name,
               weight.file, s.name, i, v[i]);
}

// Same element count and the same innermost extent: accepts a scale stored flattened over its leading dims
// (e.g. [E*O, I/16] next to a weight [E, O, I/2]), the layout quirk of some grouped-expert exports.
bool scale_shape_fits(const std::vector<int64_t>& got, const std::vector<int64_t>& want) {
  if (got == want) return true;
  if (got.empty() || want.empty()) return false;
  return got.back() == want.back() && product(got, 0, got.size()) == product(want, 0, want.size());
}

bool is_fp8_block_scale(const std::vector<int64_t>& weight, const std::vector<int64_t>& scale) {
  if (weight.size() < 2) return false;
  std::vector<int64_t> want(weight.begin(), weight.end() - 2);
  want.push_back(ceil_div(weight[weight.size() - 2], kFp8BlockSize));
  want.push_back(ceil_div(weight.back(), kFp8BlockSize));
  return scale_shape_fits(scale, want);
}

void check_shape_rank(const StoredWeight& w, const std::vector<int64_t>& shape) {
  const TensorView& t = *w.weight;
  DSV4_CHECK(shape.size() >= 2, "tensor \"{}\" in {}: {} weights must be matrices, but the model expects shape {}",
             t.name, t.file, format_name(w.format), shape_str(shape));
  DSV4_CHECK(t.shape.size() == shape.size(), "tensor \"{}\" in {}: stored {} has rank {}, the model expects {}",
             t.name, t.file, t.shape_str(), t.shape.size(), shape_str(shape));
}

std::vector<float> decode_float(const StoredWeight& w, const std::vector<int64_t>& shape) {
  const TensorView& t = *w.weight;
  DSV4_CHECK(t.shape == shape, "tensor \"{}\" in {}: expected shape {}, got {}", t.name, t.file, shape_str(shape),
             t.shape_str());
  return to_f32(t);
}

// Per-element scale index maps: out[m, o, i] *= scales[m * per_matrix + f(o, i)].
std::vector<float> decode_fp8(const StoredWeight& w, const std::vector<int64_t>& shape) {
  const TensorView& t = *w.weight;
  const TensorView& s = *w.scale;
  check_shape_rank(w, shape);
  DSV4_CHECK(t.shape == shape, "tensor \"{}\" in {}: expected shape {}, got {}", t.name, t.file, shape_str(shape),
             t.shape_str());
  const size_t r = shape.size();
  const int64_t O = shape[r - 2], I = shape[r - 1], M = product(shape, 0, r - 2);
  const int64_t bo = ceil_div(O, kFp8BlockSize), bi = ceil_div(I, kFp8BlockSize);

  std::vector<float> scales;
  if (s.dtype == DType::F8_E8M0) scales = e8m0_scales(s, t);
  else if (is_float_dtype(s.dtype)) scales = float_scales(s);
  else DSV4_FAIL("tensor \"{}\" in {}: scale \"{}\" has dtype {}; FP8 weights take F8_E8M0 or float scales", t.name,
                 t.file, s.name, dtype_name(s.dtype));
  check_scale_values(scales, s, t);

  int64_t per_matrix = 0;  // scales per [O, I] matrix: bo*bi (block) or 1 (per tensor / per matrix)
  if (w.format == WeightFormat::Fp8Block) {
    std::vector<int64_t> want(shape.begin(), shape.end() - 2);
    want.push_back(bo);
    want.push_back(bi);
    DSV4_CHECK(scale_shape_fits(s.shape, want),
               "tensor \"{}\" in {}: FP8 weight {} needs a 128x128 block scale of shape {}, but \"{}\" is {}", t.name,
               t.file, t.shape_str(), shape_str(want), s.name, s.shape_str());
    per_matrix = bo * bi;
  } else {
    DSV4_CHECK(s.numel() == 1 || s.numel() == M,
               "tensor \"{}\" in {}: per-tensor FP8 scale \"{}\" has {} elements; expected 1 or {} (one per matrix)",
               t.name, t.file, s.name, s.numel(), M);
    per_matrix = s.numel() == 1 ? 0 : 1;
  }

  std::vector<float> out(size_t(t.numel()));
  std::atomic<int64_t> bad_code{-1};
#pragma omp parallel for schedule(static)
  for (int64_t row = 0; row < M * O; ++row) {
    const int64_t m = row / O, o = row % O;
    const uint8_t* codes = t.data + row * I;
    float* dst = out.data() + row * I;
    const float* srow = scales.data() + m * per_matrix + (per_matrix > 1 ? (o / kFp8BlockSize) * bi : 0);
    for (int64_t i = 0; i < I; ++i) {
      const uint8_t c = codes[i];
      if ((c & 0x7f) == 0x7f) bad_code.store(row * I + i);
      dst[i] = e4m3_to_f32(c) * srow[per_matrix > 1 ? i / kFp8BlockSize : 0];
    }
  }
  DSV4_CHECK(bad_code.load() < 0, "tensor \"{}\" in {}: element {} is an e4m3 NaN code", t.name, t.file,
             bad_code.load());
  return out;
}

// Shared by MXFP4 and NVFP4: packed [.., O, I/2] nibbles times a per-group scale along K.
std::vector<float> decode_fp4(const StoredWeight& w, const std::vector<int64_t>& shape) {
  const TensorView& t = *w.weight;
  const TensorView& s = *w.scale;
  check_shape_rank(w, shape);
  const size_t r = shape.size();
  const int64_t O = shape[r - 2], I = shape[r - 1], M = product(shape, 0, r - 2);
  DSV4_CHECK(I % 2 == 0, "tensor \"{}\" in {}: packed FP4 needs an even K (inner dimension), the model expects {}",
             t.name, t.file, shape_str(shape));
  std::vector<int64_t> packed = shape;
  packed.back() = I / 2;
  DSV4_CHECK(t.shape == packed, "tensor \"{}\" in {}: packed FP4 weight for logical shape {} must be stored as {}, got {}",
             t.name, t.file, shape_str(shape), shape_str(packed), t.shape_str());

  const bool nv = w.format == WeightFormat::Nvfp4;
  const int64_t group = nv ? kNvfp4GroupSize : kMxfp4GroupSize;
  const int64_t groups = ceil_div(I, group);
  std::vector<int64_t> want(shape.begin(), shape.end() - 1);
  want.push_back(groups);
  DSV4_CHECK(scale_shape_fits(s.shape, want), "tensor \"{}\" in {}: {} weight {} needs a scale of shape {} (one per {} "
             "along K), but \"{}\" is {}", t.name, t.file, format_name(w.format), shape_str(shape), shape_str(want),
             group, s.name, s.shape_str());

  std::vector<float> scales;
  std::vector<float> global(size_t(M), 1.0f);
  if (nv) {
    DSV4_CHECK(s.dtype == DType::F8_E4M3, "tensor \"{}\" in {}: NVFP4 weight_scale \"{}\" must be F8_E4M3, got {}",
               t.name, t.file, s.name, dtype_name(s.dtype));
    scales = float_scales(s);
    check_scale_values(scales, s, t);
    const TensorView& s2 = *w.scale_2;
    DSV4_CHECK(is_float_dtype(s2.dtype), "tensor \"{}\" in {}: weight_scale_2 \"{}\" must be a float, got {}", t.name,
               t.file, s2.name, dtype_name(s2.dtype));
    DSV4_CHECK(s2.numel() == 1 || s2.numel() == M,
               "tensor \"{}\" in {}: weight_scale_2 \"{}\" has {} elements; expected 1 or {} (one per matrix)", t.name,
               t.file, s2.name, s2.numel(), M);
    const std::vector<float> g = float_scales(s2);
    check_scale_values(g, s2, t);
    for (int64_t m = 0; m < M; ++m) global[size_t(m)] = g[g.size() == 1 ? 0 : size_t(m)];
  } else {
    DSV4_CHECK(s.dtype == DType::F8_E8M0, "tensor \"{}\" in {}: FP4 expert scale \"{}\" must be F8_E8M0, got {}",
               t.name, t.file, s.name, dtype_name(s.dtype));
    scales = e8m0_scales(s, t);
  }

  std::vector<float> out(size_t(M * O * I));
#pragma omp parallel for schedule(static)
  for (int64_t row = 0; row < M * O; ++row) {
    const uint8_t* bytes = t.data + row * (I / 2);
    const float* srow = scales.data() + row * groups;
    const float g = global[size_t(row / O)];
    float* dst = out.data() + row * I;
    for (int64_t i = 0; i < I; ++i) {
      const uint8_t code = fp4_code_at(bytes, i);
      dst[i] = nv ? nvfp4_decode(code, srow[i / group], g) : e2m1_to_f32(code) * srow[i / group];
    }
  }
  return out;
}

}  // namespace

std::string_view format_name(WeightFormat f) {
  switch (f) {
    case WeightFormat::Float: return "float";
    case WeightFormat::Fp8Block: return "fp8-block128";
    case WeightFormat::Fp8Tensor: return "fp8-tensor";
    case WeightFormat::Mxfp4: return "mxfp4";
    case WeightFormat::Nvfp4: return "nvfp4";
  }
  return "?";
}

int64_t StoredWeight::bytes() const {
  int64_t n = 0;
  for (const TensorView* t : {weight, scale, scale_2, input_scale})
    if (t) n += int64_t(t->nbytes);
  return n;
}

std::optional<PackedWeight> packed_view(const StoredWeight& w, int64_t matrix, int64_t row0, int64_t rows,
                                        std::string* why) {
  const TensorView& t = *w.weight;
  const std::vector<int64_t>& shape = w.logical_shape;
  auto refuse = [&](std::string reason) -> std::optional<PackedWeight> {
    if (why) *why = std::move(reason);
    return std::nullopt;
  };
  DSV4_CHECK(shape.size() >= 2, "tensor \"{}\": a packed linear weight needs rank >= 2, got {}", t.name,
             shape_str(shape));
  const int64_t O = shape[shape.size() - 2], I = shape.back();
  const int64_t M = product(shape, 0, shape.size() - 2);
  DSV4_CHECK(matrix >= 0 && matrix < M && row0 >= 0 && rows > 0 && row0 + rows <= O,
             "tensor \"{}\": rows [{}, {}) of matrix {} are outside its shape {}", t.name, row0, row0 + rows, matrix,
             shape_str(shape));
  const int64_t first_row = matrix * O + row0;  // in the flattened [M * O, I] view
  PackedWeight p;
  p.format = w.format;
  switch (w.format) {
    case WeightFormat::Float:
      if (t.dtype != DType::BF16) return refuse(fmt::format("{} floats are converted to bf16", dtype_name(t.dtype)));
      p.w = t.data + first_row * I * 2;
      p.w_bytes = size_t(rows * I * 2);
      return p;
    case WeightFormat::Fp8Tensor: return refuse("per-tensor FP8 scales");
    case WeightFormat::Fp8Block: {
      const TensorView& s = *w.scale;
      if (s.dtype != DType::F8_E8M0 && s.dtype != DType::F32)
        return refuse(fmt::format("FP8 block scales of dtype {}", dtype_name(s.dtype)));
      if (row0 % kFp8BlockSize != 0 || (rows % kFp8BlockSize != 0 && row0 + rows != O))
        return refuse("the rows split a 128-row scale block");
      if (I % 16 != 0) return refuse("K is not a multiple of 16");
      const int64_t row_blocks = ceil_div(O, kFp8BlockSize), col_blocks = ceil_div(I, kFp8BlockSize);
      const size_t elem = s.dtype == DType::F32 ? 4 : 1;
      p.scale_f32 = s.dtype == DType::F32;
      p.w = t.data + first_row * I;
      p.w_bytes = size_t(rows * I);
      p.scale = s.data + size_t((matrix * row_blocks + row0 / kFp8BlockSize) * col_blocks) * elem;
      p.scale_bytes = size_t(ceil_div(rows, kFp8BlockSize) * col_blocks) * elem;
      return p;
    }
    case WeightFormat::Mxfp4:
    case WeightFormat::Nvfp4: {
      if (I % 32 != 0) return refuse("K is not a multiple of 32");
      const TensorView& s = *w.scale;
      const int64_t group = w.format == WeightFormat::Nvfp4 ? kNvfp4GroupSize : kMxfp4GroupSize;
      p.w = t.data + first_row * (I / 2);
      p.w_bytes = size_t(rows * (I / 2));
      p.scale = s.data + first_row * (I / group);
      p.scale_bytes = size_t(rows * (I / group));
      if (w.format == WeightFormat::Nvfp4) {
        const std::vector<float> g = float_scales(*w.scale_2);
        p.scale_2 = g[g.size() == 1 ? 0 : size_t(matrix)];
      }
      return p;
    }
  }
  return refuse("unknown format");
}

namespace {

// Every code of the packed formats as fp32 (the formats' own decoders, run once): the per-element decode of a tile
// becomes a table lookup and one multiply by the group's scale.
struct CodeTables {
  float e2m1[16], e4m3[256], e8m0[256];
  CodeTables() {
    for (int c = 0; c < 16; ++c) e2m1[c] = e2m1_to_f32(uint8_t(c));
    for (int c = 0; c < 256; ++c) {
      e4m3[c] = e4m3_to_f32(uint8_t(c));
      e8m0[c] = e8m0_to_f32(uint8_t(c));
    }
  }
};
const CodeTables& code_tables() {
  static const CodeTables tables;
  return tables;
}

// The scale of FP8 block b (index into the view's scales) and of fp4 group g of row r: how decode_packed_rows and the
// fused row products read them.
float fp8_block_scale(const PackedWeight& w, int64_t b) {
  if (!w.scale_f32) return code_tables().e8m0[w.scale[b]];
  float scale;
  std::memcpy(&scale, w.scale + 4 * b, 4);
  return scale;
}
int fp4_group(const PackedWeight& w) { return w.format == WeightFormat::Nvfp4 ? kNvfp4GroupSize : kMxfp4GroupSize; }
float fp4_group_scale(const PackedWeight& w, int64_t cols, int64_t r, int64_t g) {
  const uint8_t code = w.scale[r * (cols / fp4_group(w)) + g];
  return w.format == WeightFormat::Nvfp4 ? code_tables().e4m3[code] * w.scale_2 : code_tables().e8m0[code];
}

#if defined(__x86_64__)
bool avx2() {
  static const bool supported = __builtin_cpu_supports("avx2");
  return supported;
}

// 16 e2m1 codes (8 packed bytes, element 2j in the low nibble of byte j) times `scale`, bit for bit the scalar loop's
// e2m1 · scale: the magnitude k / 2 (k in 0..12) comes from a byte shuffle as the integer k, and k · (scale / 2) is the
// same single rounding of the same exact product while scale / 2 is exact (the caller checks scale >= 2^-125 or
// +0); the code's sign bit then becomes the float's (so -0 stays -0).
__attribute__((target("avx2"), always_inline)) inline void fp4_16_avx2(const uint8_t* bytes, float half_scale,
                                                                        __m256& first, __m256& second) {
  const __m128i magnitudes = _mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, 1, 2, 3, 4, 6, 8, 12);
  const __m128i packed = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes));
  const __m128i nibble = _mm_set1_epi8(0x0f);
  const __m128i codes = _mm_unpacklo_epi8(_mm_and_si128(packed, nibble),
                                          _mm_and_si128(_mm_srli_epi16(packed, 4), nibble));  // element order
  const __m128i k = _mm_shuffle_epi8(magnitudes, codes);
  const __m128i sign = _mm_and_si128(codes, _mm_set1_epi8(8));
  const __m256 scale = _mm256_set1_ps(half_scale);
  __m256* out[2] = {&first, &second};
  for (int half = 0; half < 2; ++half) {
    const __m128i k8 = half ? _mm_srli_si128(k, 8) : k, sign8 = half ? _mm_srli_si128(sign, 8) : sign;
    const __m256 value = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(k8)), scale);
    const __m256i sign_bits = _mm256_slli_epi32(_mm256_cvtepu8_epi32(sign8), 28);  // code bit 3 -> float bit 31
    *out[half] = _mm256_or_ps(value, _mm256_castsi256_ps(sign_bits));
  }
}

__attribute__((target("avx2"))) void decode_fp4_16_avx2(const uint8_t* bytes, float half_scale, float* out) {
  __m256 first, second;
  fp4_16_avx2(bytes, half_scale, first, second);
  _mm256_storeu_ps(out, first);
  _mm256_storeu_ps(out + 8, second);
}

// 8 e4m3 codes times `scale`, bit for bit the table's e4m3 · scale: normal codes become the float with the code's
// exponent and mantissa bits moved into place and the bias changed (7 -> 127), subnormal ones (exponent 0) the integer
// mantissa times 2^-9, both exact; the sign bit moves to bit 31. The caller checks that no code is NaN (0x7f / 0xff).
__attribute__((target("avx2"), always_inline)) inline __m256 e4m3_8_avx2(const uint8_t* codes, __m256 scale) {
  const __m256i c = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes)));
  const __m256i magnitude = _mm256_and_si256(c, _mm256_set1_epi32(0x7f));
  const __m256 normal =
      _mm256_castsi256_ps(_mm256_add_epi32(_mm256_slli_epi32(magnitude, 20), _mm256_set1_epi32(120 << 23)));
  const __m256 subnormal = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_and_si256(c, _mm256_set1_epi32(7))),
                                         _mm256_set1_ps(0.001953125f));  // mantissa * 2^-9
  const __m256i is_subnormal = _mm256_cmpeq_epi32(_mm256_and_si256(c, _mm256_set1_epi32(0x78)), _mm256_setzero_si256());
  const __m256 value = _mm256_blendv_ps(normal, subnormal, _mm256_castsi256_ps(is_subnormal));
  const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(c, _mm256_set1_epi32(0x80)), 24);
  return _mm256_mul_ps(_mm256_or_ps(value, _mm256_castsi256_ps(sign)), scale);
}

__attribute__((target("avx2"))) void decode_e4m3_8_avx2(const uint8_t* codes, float scale, float* out) {
  _mm256_storeu_ps(out, e4m3_8_avx2(codes, _mm256_set1_ps(scale)));
}

// Sums of 16 lanes in a fixed order.
__attribute__((target("avx2"), always_inline)) inline float lane_sum(__m256 a, __m256 b) {
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, _mm256_add_ps(a, b));
  return ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
}

// out[m] = x_m · row r of a packed FP8-block view for R rows of x (stride ldx), the row decoded in registers 8 codes
// at a time (decode_packed_rows' values) and used for every x row, each summed in 16 lanes, then the lanes in a
// fixed order; a block's last cols % 16 codes through the table.
template <int R>
__attribute__((target("avx2"))) void fp8_row_dot_avx2(const PackedWeight& w, int64_t cols, int64_t r, const float* x,
                                                      int64_t ldx, float* out) {
  const float* e4m3 = code_tables().e4m3;
  const uint8_t* codes = w.w + r * cols;
  const int64_t col_blocks = ceil_div(cols, kFp8BlockSize), block_row = (r / kFp8BlockSize) * col_blocks;
  __m256 acc0[R], acc1[R];
  float rest[R];
  for (int m = 0; m < R; ++m) acc0[m] = acc1[m] = _mm256_setzero_ps(), rest[m] = 0.0f;
  for (int64_t b = 0; b < col_blocks; ++b) {
    const float scale = fp8_block_scale(w, block_row + b);
    const __m256 s = _mm256_set1_ps(scale);
    int64_t i = b * kFp8BlockSize;
    const int64_t end = std::min<int64_t>(cols, (b + 1) * kFp8BlockSize);
    for (; i + 16 <= end; i += 16) {
      const __m256 first = e4m3_8_avx2(codes + i, s), second = e4m3_8_avx2(codes + i + 8, s);
      for (int m = 0; m < R; ++m) {
        acc0[m] = _mm256_add_ps(acc0[m], _mm256_mul_ps(first, _mm256_loadu_ps(x + m * ldx + i)));
        acc1[m] = _mm256_add_ps(acc1[m], _mm256_mul_ps(second, _mm256_loadu_ps(x + m * ldx + i + 8)));
      }
    }
    for (; i < end; ++i)
      for (int m = 0; m < R; ++m) rest[m] += e4m3[codes[i]] * scale * x[m * ldx + i];
  }
  for (int m = 0; m < R; ++m) out[m] = lane_sum(acc0[m], acc1[m]) + rest[m];
}
#endif

// scale / 2 is exact, and the shuffle decode gives the table's bits (decode_fp4_16_avx2).
bool half_scale_exact(float s) { return (s >= 0x1p-125f || (s == 0.0f && !std::signbit(s))) && std::isfinite(s); }

#if defined(__x86_64__)
// out[m] = x_m · row r of a packed fp4 view for R rows of x (stride ldx), the row decoded in registers 16 codes at a
// time (decode_packed_rows' values) and used for every x row, each summed in 16 lanes, then the lanes in a fixed
// order.
template <int R>
__attribute__((target("avx2"))) void fp4_row_dot_avx2(const PackedWeight& w, int64_t cols, int64_t r, const float* x,
                                                      int64_t ldx, float* out) {
  const CodeTables& t = code_tables();
  const int group = fp4_group(w);
  const uint8_t* bytes = w.w + r * (cols / 2);
  __m256 acc0[R], acc1[R];
  float rest[R];  // groups whose scale takes the table loop
  for (int m = 0; m < R; ++m) acc0[m] = acc1[m] = _mm256_setzero_ps(), rest[m] = 0.0f;
  for (int64_t g = 0; g < cols / group; ++g) {
    const float s = fp4_group_scale(w, cols, r, g);
    const uint8_t* b = bytes + g * group / 2;
    const int64_t i0 = g * group;
    if (!half_scale_exact(s)) {
      for (int m = 0; m < R; ++m)
        for (int j = 0; j < group / 2; ++j)
          rest[m] += t.e2m1[b[j] & 0xf] * s * x[m * ldx + i0 + 2 * j] +
                     t.e2m1[b[j] >> 4] * s * x[m * ldx + i0 + 2 * j + 1];
      continue;
    }
    for (int j = 0; j < group; j += 16) {
      __m256 first, second;
      fp4_16_avx2(b + j / 2, s * 0.5f, first, second);
      for (int m = 0; m < R; ++m) {
        acc0[m] = _mm256_add_ps(acc0[m], _mm256_mul_ps(first, _mm256_loadu_ps(x + m * ldx + i0 + j)));
        acc1[m] = _mm256_add_ps(acc1[m], _mm256_mul_ps(second, _mm256_loadu_ps(x + m * ldx + i0 + j + 8)));
      }
    }
  }
  for (int m = 0; m < R; ++m) out[m] = lane_sum(acc0[m], acc1[m]) + rest[m];
}

template <int R>
void row_dot_avx2(const PackedWeight& w, int64_t cols, int64_t r, const float* x, int64_t ldx, float* out) {
  if (w.format == WeightFormat::Fp8Block)
    fp8_row_dot_avx2<R>(w, cols, r, x, ldx, out);
  else
    fp4_row_dot_avx2<R>(w, cols, r, x, ldx, out);
}
#endif

// Row r of a packed fp4 view, `group` codes to a scale: value = e2m1 * scale (nvfp4_decode's e2m1 * (block scale
// * global scale) with the product taken once per group; MXFP4's e8m0 scales are powers of two). With AVX2, 16 codes
// at a time through a byte shuffle (docs/perf.md), same bits.
void decode_fp4_row(const PackedWeight& w, int64_t cols, int64_t r, float* out) {
  const float* e2m1 = code_tables().e2m1;
  const int group = fp4_group(w);
  const uint8_t* bytes = w.w + r * (cols / 2);
  for (int64_t g = 0; g < cols / group; ++g) {
    const float s = fp4_group_scale(w, cols, r, g);
    const uint8_t* b = bytes + g * group / 2;
    float* o = out + g * group;
#if defined(__x86_64__)
    if (avx2() && group % 16 == 0 && half_scale_exact(s)) {
      for (int j = 0; j < group; j += 16) decode_fp4_16_avx2(b + j / 2, s * 0.5f, o + j);
      continue;
    }
#endif
    for (int j = 0; j < group / 2; ++j) {
      o[2 * j] = e2m1[b[j] & 0xf] * s;
      o[2 * j + 1] = e2m1[b[j] >> 4] * s;
    }
  }
}

}  // namespace

void decode_packed_rows(const PackedWeight& w, int64_t cols, int64_t first, int64_t count, float* out) {
  const CodeTables& t = code_tables();
  for (int64_t r = first; r < first + count; ++r, out += cols) {
    switch (w.format) {
      case WeightFormat::Float: {  // bf16
        const uint8_t* row = w.w + r * cols * 2;
        for (int64_t i = 0; i < cols; ++i) {
          uint16_t b;
          std::memcpy(&b, row + 2 * i, 2);
          out[i] = bf16_to_f32(b);
        }
        break;
      }
      case WeightFormat::Fp8Block: {
        const uint8_t* codes = w.w + r * cols;
        const int64_t col_blocks = ceil_div(cols, kFp8BlockSize), block_row = (r / kFp8BlockSize) * col_blocks;
        for (int64_t b = 0; b < col_blocks; ++b) {
          const float scale = fp8_block_scale(w, block_row + b);
          int64_t i = b * kFp8BlockSize;
          const int64_t end = std::min<int64_t>(cols, (b + 1) * kFp8BlockSize);
#if defined(__x86_64__)
          if (avx2())  // NaN codes were refused when the view was made (dequantize's checks)
            for (; i + 8 <= end; i += 8) decode_e4m3_8_avx2(codes + i, scale, out + i);
#endif
          for (; i < end; ++i) out[i] = t.e4m3[codes[i]] * scale;
        }
        break;
      }
      case WeightFormat::Mxfp4:
      case WeightFormat::Nvfp4: decode_fp4_row(w, cols, r, out); break;
      case WeightFormat::Fp8Tensor: DSV4_FAIL("decode_packed_rows: per-tensor FP8 has no packed view");
    }
  }
}

bool packed_row_dot_fused(const PackedWeight& w) {
#if defined(__x86_64__)
  return avx2() && (w.format == WeightFormat::Nvfp4 || w.format == WeightFormat::Mxfp4 ||
                    w.format == WeightFormat::Fp8Block);
#else
  return false;
#endif
}

void packed_row_dot(const PackedWeight& w, int64_t cols, int64_t row, const float* x, int64_t ldx, int rows,
                    float* out) {
  DSV4_CHECK(packed_row_dot_fused(w), "packed_row_dot: no fused path for {} here (packed_row_dot_fused is false)",
             format_name(w.format));
#if defined(__x86_64__)
  for (int m = 0; m < rows; m += 4) {  // four rows of x at a time keep the 16 accumulators in registers
    const float* xm = x + m * ldx;
    switch (std::min(4, rows - m)) {
      case 1: row_dot_avx2<1>(w, cols, row, xm, ldx, out + m); break;
      case 2: row_dot_avx2<2>(w, cols, row, xm, ldx, out + m); break;
      case 3: row_dot_avx2<3>(w, cols, row, xm, ldx, out + m); break;
      default: row_dot_avx2<4>(w, cols, row, xm, ldx, out + m); break;
    }
  }
#endif
}

CompanionNames companion_names(const std::string& weight_name) {
  std::vector<std::string> bases;  // stems to which a suffix is appended
  CompanionNames c;
  auto with_prefix_toggled = [](std::vector<std::string> names) {
    std::vector<std::string> out;
    for (const std::string& n : names) {
      out.push_back(n);
      out.push_back(n.rfind("model.", 0) == 0 ? n.substr(6) : "model." + n);
    }
    return out;
  };
  if (ends_with(weight_name, ".weight")) {
    const std::string p = weight_name.substr(0, weight_name.size() - 7);
    c.scale = with_prefix_toggled({p + ".scale", p + ".weight_scale_inv", p + ".weight_scale"});
    c.scale_2 = with_prefix_toggled({p + ".weight_scale_2"});
    c.input_scale = with_prefix_toggled({p + ".input_scale"});
  } else {
    const std::string& p = weight_name;
    c.scale = with_prefix_toggled({p + "_scale_inv", p + "_scale", p + "_weight_scale"});
    c.scale_2 = with_prefix_toggled({p + "_weight_scale_2", p + "_scale_2"});
    c.input_scale = with_prefix_toggled({p + "_input_scale"});
  }
  return c;
}

StoredWeight classify_weight(const Checkpoint& checkpoint, const TensorView& t) {
  StoredWeight w;
  w.weight = &t;
  w.logical_shape = t.shape;
  if (is_float_dtype(t.dtype)) return w;

  const CompanionNames names = companion_names(t.name);
  w.scale = find_first(checkpoint, names.scale);
  w.scale_2 = find_first(checkpoint, names.scale_2);
  w.input_scale = find_first(checkpoint, names.input_scale);
  switch (t.dtype) {
    case DType::F8_E4M3:
      DSV4_CHECK(w.scale, "tensor \"{}\" in {}: F8_E4M3 weight without a scale tensor (looked for: {})", t.name,
                 t.file, fmt::join(names.scale, ", "));
      w.format = is_fp8_block_scale(t.shape, w.scale->shape) || (w.scale->numel() != 1 &&
                 (t.shape.size() < 3 || w.scale->numel() != product(t.shape, 0, t.shape.size() - 2)))
                     ? WeightFormat::Fp8Block
                     : WeightFormat::Fp8Tensor;
      return w;
    case DType::I8:
    case DType::U8: {
      DSV4_CHECK(w.scale, "tensor \"{}\" in {}: {} weight (packed FP4) without a scale tensor (looked for: {})",
                 t.name, t.file, dtype_name(t.dtype), fmt::join(names.scale, ", "));
      DSV4_CHECK(!t.shape.empty(), "tensor \"{}\" in {}: packed FP4 weight must have a shape", t.name, t.file);
      w.logical_shape.back() *= 2;
      if (w.scale->dtype == DType::F8_E8M0) {
        w.format = WeightFormat::Mxfp4;
      } else if (w.scale->dtype == DType::F8_E4M3) {
        DSV4_CHECK(w.scale_2, "tensor \"{}\" in {}: NVFP4 weight (F8_E4M3 block scale \"{}\") without its global "
                   "scale (looked for: {})", t.name, t.file, w.scale->name, fmt::join(names.scale_2, ", "));
        w.format = WeightFormat::Nvfp4;
      } else {
        DSV4_FAIL("tensor \"{}\" in {}: packed FP4 weight with scale \"{}\" of dtype {}; expected F8_E8M0 (DeepSeek "
                  "FP4, 32 per scale) or F8_E4M3 (NVFP4, 16 per scale)", t.name, t.file, w.scale->name,
                  dtype_name(w.scale->dtype));
      }
      return w;
    }
    default:
      DSV4_FAIL("tensor \"{}\" in {}: weights stored as {} are not supported (expected a float dtype, F8_E4M3 with "
                "scales, or packed FP4 in I8/U8)", t.name, t.file, dtype_name(t.dtype));
  }
}

std::vector<float> dequantize(const StoredWeight& w, const std::vector<int64_t>& shape) {
  switch (w.format) {
    case WeightFormat::Float: return decode_float(w, shape);
    case WeightFormat::Fp8Block:
    case WeightFormat::Fp8Tensor: return decode_fp8(w, shape);
    case WeightFormat::Mxfp4:
    case WeightFormat::Nvfp4: return decode_fp4(w, shape);
  }
  DSV4_FAIL("tensor \"{}\": unknown weight format", w.weight->name);
}

}  // namespace dsv4
