// SPDX-License-Identifier: MIT
// Floats as unsigned keys that sort like the floats (a > b <=> key(a) > key(b)), -0 and +0 as one key. The radix
// selects of the indexer's top-k, the router and the token draw rank by these. NaN has keys too, meaningless ones.
#pragma once
#include <cstdint>

#include "formats/bf16.h"

namespace dsv4 {

DSV4_HD uint32_t float_order_key(float f) {
  const uint32_t bits = f == 0.0f ? 0u : f32_to_bits(f);
  return (bits & 0x80000000u) ? ~bits : bits | 0x80000000u;
}

// The float of a key (float_order_key's inverse; +0 for the key of zero).
DSV4_HD float float_of_order_key(uint32_t key) {
  return bits_to_f32((key & 0x80000000u) ? key & 0x7fffffffu : ~key);
}

}  // namespace dsv4
