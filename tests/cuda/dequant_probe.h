// SPDX-License-Identifier: MIT
// Host entry points that run src/cuda/dequant.cuh on the device for exhaustive code tests.
#pragma once
#include <cstdint>
#include <vector>

namespace dsv4::probe {

// All 256 e4m3 codes decoded with factor fp8_factor_e8m0(e8m0): returns the bf16 bit patterns, code order.
std::vector<uint16_t> decode_e4m3_codes(uint8_t e8m0);
// All 256 bytes (two e2m1 nibbles each, low nibble first) decoded with mxfp4_factor(e8m0): 512 bf16 bit patterns.
std::vector<uint16_t> decode_e2m1_bytes_mx(uint8_t e8m0);
// Same with nvfp4_factor(e4m3 scale code): values are e2m1 * e4m3(scale) * 2^-8.
std::vector<uint16_t> decode_e2m1_bytes_nv(uint8_t e4m3_scale);
// For every scale code s: nvfp4_factor(s), then the f0 and f1 of nvfp4_factor_pair(s | (255 - s) << 8), i.e. s in
// the low byte and 255 - s in the high one. 3 x 256 bf16x2 words, code order.
std::vector<uint32_t> nvfp4_factors_both_ways();

}  // namespace dsv4::probe
