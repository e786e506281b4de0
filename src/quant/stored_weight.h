// SPDX-License-Identifier: MIT
// How a weight is stored in a checkpoint, decided from its dtype plus the companion scale tensors beside it
// (never from config.json alone), and its exact fp32 dequantisation. Formats (docs/formats.md):
//   Float        F32 / F64 / BF16 / F16, converted element-wise
//   Fp8Block     F8_E4M3 [.., O, I] + scale [.., ceil(O/128), ceil(I/128)] (F8_E8M0, or F32/BF16/F16)
//   Fp8Tensor    F8_E4M3 [.., O, I] + one scale per tensor (or per leading matrix), e.g. ModelOpt FP8
//   Mxfp4        I8/U8 [.., O, I/2] + F8_E8M0 scale [.., O, ceil(I/32)]  (official DeepSeek FP4 experts)
//   Nvfp4        U8/I8 [.., O, I/2] + F8_E4M3 weight_scale [.., O, ceil(I/16)] + F32 weight_scale_2 (one, or one
//                per leading matrix); input_scale, if present, is recorded but never used
// Companion names tried for weight "P.weight": P.scale, P.weight_scale_inv, P.weight_scale (+ P.weight_scale_2,
// P.input_scale); for a fused tensor "P" without ".weight" (transformers experts): P_scale_inv, P_scale,
// P_weight_scale (+ P_weight_scale_2 / P_scale_2, P_input_scale). Each also with the "model." prefix toggled.
#pragma once
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace dsv4 {

class Checkpoint;
struct TensorView;

enum class WeightFormat { Float, Fp8Block, Fp8Tensor, Mxfp4, Nvfp4 };
std::string_view format_name(WeightFormat f);  // "float", "fp8-block128", "fp8-tensor", "mxfp4", "nvfp4"

struct StoredWeight {
  WeightFormat format = WeightFormat::Float;
  const TensorView* weight = nullptr;
  const TensorView* scale = nullptr;        // block / tensor scale (FP8, MXFP4) or weight_scale (NVFP4)
  const TensorView* scale_2 = nullptr;      // NVFP4 weight_scale_2
  const TensorView* input_scale = nullptr;  // calibrated activation scale; recorded, never used
  std::vector<int64_t> logical_shape;       // the decoded shape (packed FP4: last dim doubled)
  int64_t bytes() const;                    // weight + every companion tensor
};

// Rows [row0, row0 + rows) of matrix `matrix` of a stored weight, left in its encoding for a backend that
// decodes it in its kernels (the CUDA gemv). Views into the checkpoint mapping: the Checkpoint must outlive it.
//   Float    BF16 bytes [rows, I]
//   Fp8Block e4m3 [rows, I] + scale [ceil(rows/128), ceil(I/128)] as e8m0 bytes or f32 (scale_f32)
//   Mxfp4    packed e2m1 [rows, I/2] + e8m0 [rows, I/32]
//   Nvfp4    packed e2m1 [rows, I/2] + e4m3 [rows, I/16] + scale_2
struct PackedWeight {
  WeightFormat format = WeightFormat::Float;
  const uint8_t* w = nullptr;
  size_t w_bytes = 0;
  const uint8_t* scale = nullptr;
  size_t scale_bytes = 0;
  bool scale_f32 = false;
  float scale_2 = 1.0f;
};

// The packed view of `w` (checked first, like dequantize: call that too for the value checks), or nullopt with
// `why` set when the encoding has no packed form the kernels read: F32/F16 floats, per-tensor FP8, BF16/F16 FP8
// block scales, FP4 with K not a multiple of 32, or an FP8 row range that splits a 128-row scale block.
std::optional<PackedWeight> packed_view(const StoredWeight& w, int64_t matrix, int64_t row0, int64_t rows,
                                        std::string* why);

// Rows [first, first + count) of a packed view of `cols` columns (rows counted from the view's first row) as fp32,
// out [count, cols]: the values dequantize gives for them, bit for bit (the CPU backend's linears decode a tile of
// rows at a time from the mapped checkpoint, cpu::gemm_nt_packed). The bytes were checked when the view was made.
void decode_packed_rows(const PackedWeight& w, int64_t cols, int64_t first, int64_t count, float* out);

// out[m] = x_m · row `row` of a packed view for `rows` rows of x (`cols` values each, stride ldx), the weight row
// decoded in registers once per four x rows: the values of decode_packed_rows, summed in an order of its own (each
// x row in the same order whatever `rows` is). Available where packed_row_dot_fused(w) says so (NVFP4, MXFP4 and
// FP8 blocks on CPUs with AVX2); throws elsewhere.
bool packed_row_dot_fused(const PackedWeight& w);
void packed_row_dot(const PackedWeight& w, int64_t cols, int64_t row, const float* x, int64_t ldx, int rows,
                    float* out);

// Companion names tried for `weight_name`, in order: {block-scale names}, {second-scale names}, {input-scale}.
struct CompanionNames {
  std::vector<std::string> scale, scale_2, input_scale;
};
CompanionNames companion_names(const std::string& weight_name);

// Classifies `t` (a tensor of `checkpoint`). Throws dsv4::Error naming the tensor when it is a quantised
// dtype without a usable scale (missing scale, unknown scale dtype, NVFP4 without weight_scale_2).
StoredWeight classify_weight(const Checkpoint& checkpoint, const TensorView& t);

// Exact fp32 values of `w` in the logical `shape` the caller expects. Rejects, naming the tensor: a shape that
// does not match the storage (incl. odd K for packed FP4), scale tensors of the wrong shape or dtype, NaN / inf /
// negative scales, 0xFF e8m0 bytes, NaN e4m3 weight codes.
std::vector<float> dequantize(const StoredWeight& w, const std::vector<int64_t>& shape);

}  // namespace dsv4
