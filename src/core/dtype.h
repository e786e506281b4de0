// SPDX-License-Identifier: MIT
// Element types as they appear in checkpoints. Quantised formats are listed by their storage type
// (F8_E4M3 values, F8_E8M0 scales, I8/U8 packed FP4 nibbles); how a weight is decoded is decided by
// the weight loader from the storage type plus the shape of its companion scale tensor.
#pragma once
#include <cstddef>
#include <optional>
#include <string_view>

namespace dsv4 {

enum class DType { F64, F32, BF16, F16, F8_E4M3, F8_E5M2, F8_E8M0, I64, I32, I16, I8, U8, BOOL };

size_t dtype_size(DType t);                  // bytes per element
std::string_view dtype_name(DType t);        // safetensors spelling: "F32", "BF16", ...
std::optional<DType> dtype_from_name(std::string_view safetensors_name);

}  // namespace dsv4
