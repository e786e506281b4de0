// SPDX-License-Identifier: MIT
// .npy reader/writer. Files are built byte for byte the way numpy/lib/format.py writes them
// (magic, version, little-endian header length, repr(dict) padded with spaces + '\n' to 64 bytes).
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <random>

#include "core/check.h"
#include "io/npy.h"

using namespace dsv4;
namespace fs = std::filesystem;

namespace {

class NpyTest : public ::testing::Test {
 protected:
  void SetUp() override {
    static std::atomic<int> counter{0};
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = fs::temp_directory_path() / fmt::format("dsv4_npy_{}_{}_{}", info->name(), ::getpid(), counter.fetch_add(1));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string path(const std::string& name) const { return (dir_ / name).string(); }
  fs::path dir_;
};

std::string npy_error(const std::string& path) {
  try {
    read_npy(path);
  } catch (const dsv4::Error& e) {
    return e.what();
  } catch (const std::exception& e) {
    return std::string("<other exception: ") + e.what() + ">";
  }
  return "<no error>";
}

void expect_npy_error(const std::string& path, std::initializer_list<std::string> parts) {
  const std::string msg = npy_error(path);
  for (const std::string& p : parts) EXPECT_NE(msg.find(p), std::string::npos) << "missing \"" << p << "\" in: " << msg;
}

// Bytes of a .npy file as numpy writes it: the dict text, padded so the data starts at a multiple of 64.
std::vector<uint8_t> npy_bytes(int major, const std::string& dict, const std::vector<uint8_t>& data, bool pad = true) {
  const size_t length_field = major == 1 ? 2 : 4;
  std::string header = dict;
  if (pad) {
    const size_t unpadded = 8 + length_field + header.size() + 1;
    header.append((64 - unpadded % 64) % 64, ' ');
  }
  header += '\n';
  std::vector<uint8_t> out = {0x93, 'N', 'U', 'M', 'P', 'Y', uint8_t(major), 0};
  const uint32_t len = uint32_t(header.size());
  for (size_t i = 0; i < length_field; ++i) out.push_back(uint8_t(len >> (8 * i)));
  out.insert(out.end(), header.begin(), header.end());
  out.insert(out.end(), data.begin(), data.end());
  return out;
}

template <class T>
std::vector<uint8_t> raw(std::initializer_list<T> values) {
  std::vector<uint8_t> out(values.size() * sizeof(T));
  std::memcpy(out.data(), std::data(values), out.size());
  return out;
}

void write_bytes(const std::string& path, const std::vector<uint8_t>& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(bytes.data()), std::streamsize(bytes.size()));
}

std::vector<uint8_t> read_all(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

std::string dict_for(const std::string& descr, const std::string& shape, const std::string& fortran = "False") {
  return "{'descr': '" + descr + "', 'fortran_order': " + fortran + ", 'shape': " + shape + ", }";
}

}  // namespace

TEST_F(NpyTest, WriterProducesNumpyBytes) {
  const float v[6] = {0, 1, 2, 3, 4, 5.5f};
  const std::string p = path("a.npy");
  write_npy_f32(p, v, {2, 3});
  std::vector<uint8_t> data(sizeof v);
  std::memcpy(data.data(), v, sizeof v);
  // Exactly what numpy 1.x np.save(np.array(..., '<f4').reshape(2, 3)) writes: 128 bytes of preamble.
  const std::vector<uint8_t> expected = npy_bytes(1, dict_for("<f4", "(2, 3)"), data);
  EXPECT_EQ(read_all(p), expected);
  EXPECT_EQ(expected.size(), 128u + 24u);
}

TEST_F(NpyTest, WriterShapesRoundTripAndAlign) {
  const std::vector<std::vector<int64_t>> shapes = {{}, {5}, {2, 3}, {0}, {2, 0, 3}, {1, 1, 1, 1, 7}};
  std::vector<float> values(64);
  for (size_t i = 0; i < values.size(); ++i) values[i] = float(i) * 0.5f - 3.0f;
  for (const auto& shape : shapes) {
    int64_t numel = 1;
    for (int64_t d : shape) numel *= d;
    const std::string p = path("s.npy");
    write_npy_f32(p, values.data(), shape);
    const std::vector<uint8_t> bytes = read_all(p);
    ASSERT_GE(bytes.size(), 10u);
    EXPECT_EQ(bytes[6], 1);  // version 1.0
    const size_t header_len = bytes[8] | (bytes[9] << 8);
    EXPECT_EQ((10 + header_len) % 64, 0u);
    EXPECT_EQ(bytes[10 + header_len - 1], '\n');
    EXPECT_EQ(bytes.size(), 10 + header_len + size_t(numel) * 4);
    const NpyArray a = read_npy(p);
    EXPECT_EQ(a.shape, shape);
    ASSERT_EQ(a.values.size(), size_t(numel));
    for (int64_t i = 0; i < numel; ++i) EXPECT_EQ(a.values[i], double(values[i]));
  }
  // numpy's tuple repr: scalar "()" and one-element "(5,)".
  write_npy_f32(path("scalar.npy"), values.data(), {});
  const std::vector<uint8_t> scalar = read_all(path("scalar.npy"));
  EXPECT_NE(std::string(scalar.begin(), scalar.end()).find("'shape': (), }"), std::string::npos);
  write_npy_f32(path("vec.npy"), values.data(), {5});
  const std::vector<uint8_t> vec = read_all(path("vec.npy"));
  EXPECT_NE(std::string(vec.begin(), vec.end()).find("'shape': (5,), }"), std::string::npos);
}

TEST_F(NpyTest, WriterSwitchesToVersion2ForHugeHeaders) {
  // 25000 dimensions of 1 ("1, " each) make a header longer than the u16 length field of version 1.0 allows.
  const std::vector<int64_t> shape(25000, 1);
  const float v = 2.5f;
  const std::string p = path("v2.npy");
  write_npy_f32(p, &v, shape);
  const std::vector<uint8_t> bytes = read_all(p);
  EXPECT_EQ(bytes[6], 2);
  uint32_t header_len;
  std::memcpy(&header_len, &bytes[8], 4);
  EXPECT_GT(header_len, 65535u);
  EXPECT_EQ((12 + header_len) % 64, 0u);
  const NpyArray a = read_npy(p);
  EXPECT_EQ(a.shape, shape);
  EXPECT_EQ(a.values, std::vector<double>{2.5});
}

TEST_F(NpyTest, WriterRejectsBadShapes) {
  const float v = 1;
  try {
    write_npy_f32(path("bad.npy"), &v, {2, -1});
    ADD_FAILURE() << "no error";
  } catch (const dsv4::Error& e) {
    EXPECT_NE(std::string(e.what()).find("negative dimension -1"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find(path("bad.npy")), std::string::npos) << e.what();
  }
  EXPECT_THROW(write_npy_f32(path("null.npy"), nullptr, {3}), dsv4::Error);
  EXPECT_THROW(write_npy_f32((dir_ / "missing" / "x.npy").string(), &v, {1}), dsv4::Error);
}

TEST_F(NpyTest, ReadsEverySupportedDtype) {
  struct Case {
    std::string descr;
    std::vector<uint8_t> data;
    std::vector<double> expected;
  };
  const std::vector<Case> cases = {
      {"<f4", raw<float>({1.5f, -0.1f, INFINITY}), {1.5, double(-0.1f), INFINITY}},
      {"<f8", raw<double>({0.1, -1e300, 5e-324}), {0.1, -1e300, 5e-324}},
      {"<f2", raw<uint16_t>({0x3C00, 0x0001, 0xFC00}), {1.0, std::ldexp(1.0, -24), -INFINITY}},
      {"<i2", raw<int16_t>({-32768, 1, 32767}), {-32768, 1, 32767}},
      {"<i4", raw<int32_t>({-2147483647 - 1, 0, 7}), {-2147483648.0, 0, 7}},
      {"<i8", raw<int64_t>({-(int64_t(1) << 53), 3, int64_t(1) << 40}), {-9007199254740992.0, 3, 1099511627776.0}},
      {"|i1", raw<int8_t>({-128, 0, 127}), {-128, 0, 127}},
      {"|u1", raw<uint8_t>({0, 128, 255}), {0, 128, 255}},
      {"<u1", raw<uint8_t>({9, 8, 7}), {9, 8, 7}},
      {"|b1", raw<uint8_t>({1, 0, 1}), {1, 0, 1}},
  };
  for (const Case& c : cases) {
    for (int major : {1, 2, 3}) {
      const std::string p = path("d.npy");
      write_bytes(p, npy_bytes(major, dict_for(c.descr, "(3,)"), c.data));
      const NpyArray a = read_npy(p);
      EXPECT_EQ(a.shape, (std::vector<int64_t>{3})) << c.descr << " v" << major;
      EXPECT_EQ(a.values, c.expected) << c.descr << " v" << major;
    }
  }
}

TEST_F(NpyTest, ReadsHeaderVariants) {
  const std::vector<uint8_t> data = raw<float>({1, 2, 3, 4, 5, 6});
  const std::string p = path("v.npy");
  // Keys in another order, double quotes, Python 2 long suffixes, no trailing comma, no padding,
  // and numpy 2's extra growth spaces.
  const std::vector<std::string> dicts = {
      "{'shape': (2, 3), 'fortran_order': False, 'descr': '<f4'}",
      "{\"descr\": \"<f4\", \"fortran_order\": False, \"shape\": (2L, 3L)}",
      "{'descr':'<f4','fortran_order':False,'shape':(2,3,),}",
      dict_for("<f4", "(2, 3)") + std::string(20, ' '),
  };
  for (const std::string& d : dicts) {
    for (bool pad : {true, false}) {
      write_bytes(p, npy_bytes(1, d, data, pad));
      const NpyArray a = read_npy(p);
      EXPECT_EQ(a.shape, (std::vector<int64_t>{2, 3})) << d;
      EXPECT_EQ(a.values, (std::vector<double>{1, 2, 3, 4, 5, 6})) << d;
    }
  }
  write_bytes(p, npy_bytes(1, dict_for("<f8", "()"), raw<double>({-7.25})));
  EXPECT_EQ(read_npy(p).values, std::vector<double>{-7.25});
  write_bytes(p, npy_bytes(1, dict_for("<f8", "(0, 4)"), {}));
  const NpyArray empty = read_npy(p);
  EXPECT_EQ(empty.shape, (std::vector<int64_t>{0, 4}));
  EXPECT_TRUE(empty.values.empty());
}

TEST_F(NpyTest, RejectsMalformedFiles) {
  const std::string p = path("bad.npy");
  const std::vector<uint8_t> data = raw<float>({1, 2, 3});
  auto good = npy_bytes(1, dict_for("<f4", "(3,)"), data);

  expect_npy_error(path("absent.npy"), {"cannot open", path("absent.npy")});

  auto bytes = good;
  bytes[1] = 'X';
  write_bytes(p, bytes);
  expect_npy_error(p, {p, "bad magic"});
  write_bytes(p, {0x93, 'N', 'U'});
  expect_npy_error(p, {p, "bad magic"});

  bytes = good;
  bytes[6] = 4;
  write_bytes(p, bytes);
  expect_npy_error(p, {p, "version 4.0"});

  write_bytes(p, std::vector<uint8_t>(good.begin(), good.begin() + 9));
  expect_npy_error(p, {p, "truncated"});
  write_bytes(p, std::vector<uint8_t>(good.begin(), good.begin() + 40));
  expect_npy_error(p, {p, "header", "truncated"});

  write_bytes(p, std::vector<uint8_t>(good.begin(), good.end() - 1));
  expect_npy_error(p, {p, "data truncated", "needs 12 bytes"});
  bytes = good;
  bytes.push_back(0);
  write_bytes(p, bytes);
  expect_npy_error(p, {p, "1 trailing bytes"});
  write_bytes(p, npy_bytes(1, dict_for("<f4", "(2, 2)"), data));
  expect_npy_error(p, {p, "needs 16 bytes", "holds 12"});

  write_bytes(p, npy_bytes(1, dict_for("<f4", "(3,)", "True"), data));
  expect_npy_error(p, {p, "fortran_order"});
  write_bytes(p, npy_bytes(1, dict_for(">f4", "(3,)"), data));
  expect_npy_error(p, {p, "unsupported .npy dtype '>f4'"});
  write_bytes(p, npy_bytes(1, dict_for("<c8", "(3,)"), data));
  expect_npy_error(p, {p, "'<c8'"});
  write_bytes(p, npy_bytes(1, "{'descr': [('a', '<f4')], 'fortran_order': False, 'shape': (3,), }", data));
  expect_npy_error(p, {p, "'descr'"});
  write_bytes(p, npy_bytes(1, "{'descr': '<f4', 'shape': (3,), }", data));
  expect_npy_error(p, {p, "needs 'descr'"});
  write_bytes(p, npy_bytes(1, "{'descr': '<f4', 'fortran_order': False, 'shape': (3,), 'extra': 1}", data));
  expect_npy_error(p, {p});
  write_bytes(p, npy_bytes(1, "{'descr': '<f4', 'fortran_order': False, 'shape': (-3,), }", data));
  expect_npy_error(p, {p, "non-negative integer"});
  write_bytes(p, npy_bytes(1, "{'descr': '<f4', 'fortran_order': False, 'shape': (3,) ", data));
  expect_npy_error(p, {p, "expected ',' or '}'"});
  write_bytes(p, npy_bytes(1, "{'descr': '<f4', 'fortran_order': False, 'shape': (99999999999999999999,)}", data));
  expect_npy_error(p, {p, "too large"});
  write_bytes(p, npy_bytes(1, "{'descr': '<f4', 'fortran_order': False, 'shape': (4294967296, 4294967296)}", data));
  expect_npy_error(p, {p, "overflows"});
  write_bytes(p, npy_bytes(1, "{'descr': '<f4', 'fortran_order': False, 'shape': (3,)} x", data));
  expect_npy_error(p, {p, "after the dict"});
}

#ifndef DSV4_FUZZ_ITERATIONS
#define DSV4_FUZZ_ITERATIONS 300
#endif

TEST_F(NpyTest, FuzzedFilesLoadOrThrowCleanly) {
  const int iterations = DSV4_FUZZ_ITERATIONS;
  std::vector<float> v(40);
  for (size_t i = 0; i < v.size(); ++i) v[i] = float(i);
  const std::string good = path("good.npy");
  write_npy_f32(good, v.data(), {4, 10});
  const std::vector<uint8_t> original = read_all(good);
  std::mt19937 rng(99);
  const std::string p = path("fuzz.npy");
  int loaded = 0, rejected = 0;
  for (int iter = 0; iter < iterations; ++iter) {
    std::vector<uint8_t> bytes = original;
    const int kind = int(rng() % 3);
    if (kind != 1) {
      const int flips = 1 + int(rng() % 3);
      for (int k = 0; k < flips; ++k) bytes[rng() % 128] ^= uint8_t(1u << (rng() % 8));  // the preamble
    }
    if (kind != 0) bytes.resize(rng() % (bytes.size() + 1));
    write_bytes(p, bytes);
    try {
      const NpyArray a = read_npy(p);
      size_t numel = 1;
      for (int64_t d : a.shape) numel *= size_t(d);
      ASSERT_EQ(a.values.size(), numel);
      ++loaded;
    } catch (const dsv4::Error&) {
      ++rejected;
    } catch (const std::exception& e) {
      FAIL() << "iteration " << iter << ": non-dsv4 exception " << e.what();
    }
  }
  RecordProperty("loaded", loaded);
  RecordProperty("rejected", rejected);
  EXPECT_EQ(loaded + rejected, iterations);
  EXPECT_GT(rejected, iterations / 3);
}
