// SPDX-License-Identifier: MIT
#include <gtest/gtest.h>

#include "core/dtype.h"

using namespace dsv4;

TEST(DType, NamesRoundTripAndSizes) {
  for (DType t : {DType::F64, DType::F32, DType::BF16, DType::F16, DType::F8_E4M3, DType::F8_E5M2,
                  DType::F8_E8M0, DType::I64, DType::I32, DType::I16, DType::I8, DType::U8, DType::BOOL}) {
    auto back = dtype_from_name(dtype_name(t));
    ASSERT_TRUE(back.has_value()) << dtype_name(t);
    EXPECT_EQ(*back, t);
  }
  EXPECT_EQ(dtype_size(DType::BF16), 2u);
  EXPECT_EQ(dtype_size(DType::I64), 8u);
  EXPECT_EQ(dtype_size(DType::F8_E8M0), 1u);
  EXPECT_FALSE(dtype_from_name("Q4_K").has_value());
}
