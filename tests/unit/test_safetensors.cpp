// SPDX-License-Identifier: MIT
// safetensors reader/writer: round trips, every header corruption the reader must reject (with the
// file and tensor named in the message), exact element decoding, sharded checkpoints, and a fuzz loop.
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <random>

#include "core/check.h"
#include "io/safetensors.h"

using namespace dsv4;
namespace fs = std::filesystem;

namespace {

// A fresh directory per test, removed afterwards.
class SafetensorsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    static std::atomic<int> counter{0};
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = fs::temp_directory_path() /
           fmt::format("dsv4_st_{}_{}_{}", info->name(), ::getpid(), counter.fetch_add(1));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string path(const std::string& name) const { return (dir_ / name).string(); }
  fs::path dir_;
};

// The message of the dsv4::Error that f throws; "<no error>" / "<other exception: ...>" otherwise.
std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const dsv4::Error& e) {
    return e.what();
  } catch (const std::exception& e) {
    return std::string("<other exception: ") + e.what() + ">";
  }
  return "<no error>";
}

// Expect f to throw dsv4::Error whose message contains every string in `parts`.
void expect_error(const std::function<void()>& f, std::initializer_list<std::string> parts) {
  const std::string msg = error_of(f);
  for (const std::string& p : parts) EXPECT_NE(msg.find(p), std::string::npos) << "missing \"" << p << "\" in: " << msg;
}

std::vector<uint8_t> bytes_of(const void* p, size_t n) {
  const auto* b = static_cast<const uint8_t*>(p);
  return {b, b + n};
}

// A file with the given header text (no padding added) and data section, written byte for byte.
void write_raw(const std::string& path, const std::string& header, const std::vector<uint8_t>& data,
               std::optional<uint64_t> header_length = std::nullopt) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  const uint64_t n = header_length.value_or(header.size());
  out.write(reinterpret_cast<const char*>(&n), 8);
  out.write(header.data(), std::streamsize(header.size()));
  out.write(reinterpret_cast<const char*>(data.data()), std::streamsize(data.size()));
}

std::vector<uint8_t> read_all(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void write_bytes(const std::string& path, const std::vector<uint8_t>& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(bytes.data()), std::streamsize(bytes.size()));
}

// A one-tensor file "x": F32 [2] at bytes [0, 8).
void write_one_f32(const std::string& path, const std::string& name = "x") {
  const float v[2] = {1.5f, -2.0f};
  write_safetensors(path, {{name, DType::F32, {2}, bytes_of(v, sizeof v)}});
}

std::vector<float> decode(DType dtype, const std::vector<uint8_t>& raw) {
  TensorView t;
  t.name = "t";
  t.dtype = dtype;
  t.shape = {int64_t(raw.size() / dtype_size(dtype))};
  t.data = raw.data();
  t.nbytes = raw.size();
  return to_f32(t);
}

std::vector<uint8_t> u16_bytes(std::initializer_list<uint16_t> v) {
  std::vector<uint8_t> out;
  for (uint16_t x : v) {
    out.push_back(uint8_t(x & 0xFF));
    out.push_back(uint8_t(x >> 8));
  }
  return out;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Round trips

TEST_F(SafetensorsTest, RoundTripEveryDtypeWithMetadata) {
  const std::vector<DType> dtypes = {DType::F64, DType::F32, DType::BF16, DType::F16, DType::F8_E4M3,
                                     DType::F8_E5M2, DType::F8_E8M0, DType::I64, DType::I32, DType::I16,
                                     DType::I8, DType::U8, DType::BOOL};
  std::vector<std::vector<uint8_t>> payloads;
  std::vector<TensorToWrite> tensors;
  std::mt19937 rng(7);
  for (DType d : dtypes) {
    std::vector<uint8_t> bytes(15 * dtype_size(d));
    for (auto& b : bytes) b = uint8_t(rng());
    payloads.push_back(bytes);
  }
  for (size_t i = 0; i < dtypes.size(); ++i)
    tensors.push_back({"t." + std::string(dtype_name(dtypes[i])), dtypes[i], {3, 5}, payloads[i]});
  tensors.push_back({"scalar", DType::F32, {}, std::span<const uint8_t>(payloads[1]).first(4)});
  tensors.push_back({"empty", DType::BF16, {0, 7}, {}});
  const std::map<std::string, std::string> metadata = {{"format", "pt"}, {"dsv4.note", "round \"trip\""}};

  const std::string p = path("all.safetensors");
  write_safetensors(p, tensors, metadata);
  auto f = SafetensorsFile::open(p);
  EXPECT_EQ(f->path(), p);
  EXPECT_EQ(f->metadata(), metadata);
  ASSERT_EQ(f->tensors().size(), tensors.size());
  for (size_t i = 1; i < f->tensors().size(); ++i) EXPECT_LT(f->tensors()[i - 1].name, f->tensors()[i].name);

  for (const TensorToWrite& w : tensors) {
    const TensorView* t = nullptr;
    for (const auto& v : f->tensors())
      if (v.name == w.name) t = &v;
    ASSERT_NE(t, nullptr) << w.name;
    EXPECT_EQ(t->dtype, w.dtype) << w.name;
    EXPECT_EQ(t->shape, w.shape) << w.name;
    EXPECT_EQ(t->file, p);
    ASSERT_EQ(t->nbytes, w.bytes.size()) << w.name;
    EXPECT_EQ(t->numel() * int64_t(dtype_size(t->dtype)), int64_t(t->nbytes));
    EXPECT_TRUE(w.bytes.empty() || std::memcmp(t->data, w.bytes.data(), t->nbytes) == 0) << w.name;
  }
  EXPECT_EQ(f->tensors()[0].name, "empty");
  EXPECT_EQ(f->tensors()[0].shape_str(), "[0, 7]");
}

TEST_F(SafetensorsTest, WriterLayoutIsSortedAlignedAndSpacePadded) {
  const float a[3] = {1, 2, 3};
  const uint8_t b[1] = {9};
  const std::string p = path("layout.safetensors");
  write_safetensors(p, {{"zeta", DType::F32, {3}, bytes_of(a, sizeof a)}, {"alpha", DType::U8, {1}, bytes_of(b, 1)}},
                    {{"k", "v"}});
  const std::vector<uint8_t> raw = read_all(p);
  uint64_t n;
  std::memcpy(&n, raw.data(), 8);
  EXPECT_EQ(n % 8, 0u);
  ASSERT_EQ(raw.size(), 8 + n + 13);
  const std::string header(raw.begin() + 8, raw.begin() + 8 + long(n));
  // Trailing padding is spaces only, and the JSON is compact and sorted by key.
  const size_t last = header.find_last_not_of(' ');
  EXPECT_EQ(header[last], '}');
  EXPECT_LT(header.size() - last - 1, 8u);
  EXPECT_EQ(header.substr(0, last + 1),
            R"({"__metadata__":{"k":"v"},"alpha":{"data_offsets":[0,1],"dtype":"U8","shape":[1]},)"
            R"("zeta":{"data_offsets":[1,13],"dtype":"F32","shape":[3]}})");
  EXPECT_EQ(raw[8 + n], 9);
  float back[3];
  std::memcpy(back, &raw[8 + n + 1], 12);
  EXPECT_EQ(back[2], 3.0f);
}

TEST_F(SafetensorsTest, UnalignedTensorDataDecodes) {
  // "a" (1 byte) goes first, so "b" starts at an odd address.
  const uint8_t a[1] = {1};
  const float b[4] = {0.25f, -1.0f, 3.5f, 1e-30f};
  const int64_t c[2] = {-5, int64_t(1) << 40};
  write_safetensors(path("u.safetensors"), {{"a", DType::U8, {1}, bytes_of(a, 1)},
                                            {"b", DType::F32, {2, 2}, bytes_of(b, sizeof b)},
                                            {"c", DType::I64, {2}, bytes_of(c, sizeof c)}});
  auto f = SafetensorsFile::open(path("u.safetensors"));
  const TensorView& tb = f->tensors()[1];
  const TensorView& tc = f->tensors()[2];
  EXPECT_NE(reinterpret_cast<uintptr_t>(tb.data) % 4, 0u);
  EXPECT_EQ(to_f32(tb), std::vector<float>(b, b + 4));
  EXPECT_EQ(to_i64(tc), std::vector<int64_t>(c, c + 2));
  EXPECT_EQ(to_f32(tc), (std::vector<float>{-5.0f, 1099511627776.0f}));
}

TEST_F(SafetensorsTest, WriterRejectsBadInput) {
  const float v[2] = {1, 2};
  const std::string p = path("bad.safetensors");
  expect_error([&] { write_safetensors(p, {{"w", DType::F32, {3}, bytes_of(v, sizeof v)}}); },
               {"\"w\"", "needs 12 bytes, got 8", p});
  expect_error([&] { write_safetensors(p, {{"w", DType::BF16, {-1, -4}, bytes_of(v, sizeof v)}}); },
               {"\"w\"", "negative dimension", p});
  expect_error([&] {
    write_safetensors(p, {{"w", DType::F32, {2}, bytes_of(v, 8)}, {"w", DType::F32, {2}, bytes_of(v, 8)}});
  }, {"\"w\" given twice"});
  expect_error([&] { write_safetensors(p, {{"__metadata__", DType::F32, {2}, bytes_of(v, 8)}}); }, {"reserved"});
  expect_error([&] { write_safetensors(p, {{"bad\xff", DType::F32, {2}, bytes_of(v, 8)}}); }, {p, "UTF-8"});
  expect_error([&] { write_one_f32((dir_ / "no_such_dir" / "x.safetensors").string()); }, {"cannot create"});
}

// ---------------------------------------------------------------------------------------------
// Header validation: every corruption names the file and, where there is one, the tensor.

TEST_F(SafetensorsTest, RejectsShortAndMissingFiles) {
  const std::string p = path("short.safetensors");
  write_bytes(p, {});
  expect_error([&] { SafetensorsFile::open(p); }, {p, "shorter than the 8-byte header length"});
  write_bytes(p, {1, 2, 3, 4, 5, 6, 7});
  expect_error([&] { SafetensorsFile::open(p); }, {p, "7 bytes"});
  expect_error([&] { SafetensorsFile::open(path("missing.safetensors")); },
               {"cannot open", path("missing.safetensors")});
  expect_error([&] { SafetensorsFile::open(dir_.string()); }, {"not a regular file"});
}

TEST_F(SafetensorsTest, RejectsAbsurdHeaderLength) {
  const std::string p = path("len.safetensors");
  write_raw(p, "{}", {}, uint64_t(200) << 20);
  expect_error([&] { SafetensorsFile::open(p); }, {p, "absurd"});
  write_raw(p, "{}", {}, ~uint64_t(0));
  expect_error([&] { SafetensorsFile::open(p); }, {p, "absurd"});
  write_raw(p, "{}   ", {}, 1000);  // header claims more bytes than the file has
  expect_error([&] { SafetensorsFile::open(p); }, {p, "truncated"});
}

TEST_F(SafetensorsTest, RejectsInvalidJson) {
  const std::string p = path("json.safetensors");
  write_raw(p, R"({"x": {"dtype": "F32", )", {});
  expect_error([&] { SafetensorsFile::open(p); }, {p, "not valid JSON"});
  write_raw(p, "{\"bad\xff\": {}}", {});  // not UTF-8
  expect_error([&] { SafetensorsFile::open(p); }, {p, "not valid JSON"});
  write_raw(p, R"([1, 2])", {});
  expect_error([&] { SafetensorsFile::open(p); }, {p, "must be a JSON object"});
  write_raw(p, R"({"x": 5})", {});
  expect_error([&] { SafetensorsFile::open(p); }, {p, "\"x\"", "must be a JSON object"});
  write_raw(p, R"({"__metadata__": {"a": 1}})", {});
  expect_error([&] { SafetensorsFile::open(p); }, {p, "__metadata__", "must be a string"});
  write_raw(p, R"({"__metadata__": [1]})", {});
  expect_error([&] { SafetensorsFile::open(p); }, {p, "__metadata__", "must be an object"});
}

TEST_F(SafetensorsTest, RejectsMissingFields) {
  const std::string p = path("fields.safetensors");
  const std::vector<uint8_t> data(8);
  write_raw(p, R"({"w.a": {"shape": [2], "data_offsets": [0, 8]}})", data);
  expect_error([&] { SafetensorsFile::open(p); }, {p, "\"w.a\"", "missing \"dtype\""});
  write_raw(p, R"({"w.b": {"dtype": "F32", "data_offsets": [0, 8]}})", data);
  expect_error([&] { SafetensorsFile::open(p); }, {p, "\"w.b\"", "missing \"shape\""});
  write_raw(p, R"({"w.c": {"dtype": "F32", "shape": [2]}})", data);
  expect_error([&] { SafetensorsFile::open(p); }, {p, "\"w.c\"", "missing \"data_offsets\""});
  write_raw(p, R"({"w.d": {"dtype": 3, "shape": [2], "data_offsets": [0, 8]}})", data);
  expect_error([&] { SafetensorsFile::open(p); }, {p, "\"w.d\"", "\"dtype\" must be a string"});
  write_raw(p, R"({"w.e": {"dtype": "F32", "shape": 2, "data_offsets": [0, 8]}})", data);
  expect_error([&] { SafetensorsFile::open(p); }, {p, "\"w.e\"", "\"shape\" must be an array"});
  write_raw(p, R"({"w.f": {"dtype": "F32", "shape": [2.5], "data_offsets": [0, 8]}})", data);
  expect_error([&] { SafetensorsFile::open(p); }, {p, "\"w.f\"", "must be integers"});
}

TEST_F(SafetensorsTest, RejectsUnknownDtype) {
  const std::string p = path("dtype.safetensors");
  write_raw(p, R"({"x": {"dtype": "Q4", "shape": [2], "data_offsets": [0, 1]}})", {0});
  expect_error([&] { SafetensorsFile::open(p); }, {"unknown dtype \"Q4\" for tensor \"x\" in file " + p});
}

TEST_F(SafetensorsTest, RejectsNegativeAndOverflowingShapes) {
  const std::string p = path("shape.safetensors");
  write_raw(p, R"({"neg": {"dtype": "F32", "shape": [-2, -4], "data_offsets": [0, 32]}})", std::vector<uint8_t>(32));
  expect_error([&] { SafetensorsFile::open(p); }, {p, "\"neg\"", "negative dimension -2"});
  write_raw(p, R"({"big": {"dtype": "F32", "shape": [4294967296, 4294967296], "data_offsets": [0, 0]}})", {});
  expect_error([&] { SafetensorsFile::open(p); }, {p, "\"big\"", "overflows"});
  write_raw(p, R"({"huge": {"dtype": "F32", "shape": [18446744073709551615], "data_offsets": [0, 0]}})", {});
  expect_error([&] { SafetensorsFile::open(p); }, {p, "\"huge\"", "too large"});
  write_raw(p, R"({"bytes": {"dtype": "F32", "shape": [4611686018427387904], "data_offsets": [0, 0]}})", {});
  expect_error([&] { SafetensorsFile::open(p); }, {p, "\"bytes\"", "too many"});
}

TEST_F(SafetensorsTest, RejectsBadDataOffsets) {
  const std::string p = path("offsets.safetensors");
  const std::vector<uint8_t> data(8);
  write_raw(p, R"({"r": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}})", data);
  expect_error([&] { SafetensorsFile::open(p); }, {p, "\"r\"", "begin > end"});
  write_raw(p, R"({"r": {"dtype": "F32", "shape": [2], "data_offsets": [0]}})", data);
  expect_error([&] { SafetensorsFile::open(p); }, {p, "\"r\"", "[begin, end]"});
  write_raw(p, R"({"r": {"dtype": "F32", "shape": [2], "data_offsets": [-8, 0]}})", data);
  expect_error([&] { SafetensorsFile::open(p); }, {p, "\"r\"", "non-negative"});
  write_raw(p, R"({"r": {"dtype": "F32", "shape": [2], "data_offsets": "0-8"}})", data);
  expect_error([&] { SafetensorsFile::open(p); }, {p, "\"r\"", "data_offsets"});
}

TEST_F(SafetensorsTest, RejectsTruncatedData) {
  const std::string p = path("trunc.safetensors");
  write_raw(p, R"({"t": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}})", std::vector<uint8_t>(10));
  expect_error([&] { SafetensorsFile::open(p); }, {p, "\"t\"", "truncated"});

  // A valid file cut short anywhere inside its data section.
  const std::string q = path("cut.safetensors");
  const std::vector<float> v(64, 1.0f);
  write_safetensors(q, {{"weight", DType::F32, {8, 8}, bytes_of(v.data(), 256)}});
  std::vector<uint8_t> raw = read_all(q);
  raw.resize(raw.size() - 3);
  write_bytes(q, raw);
  expect_error([&] { SafetensorsFile::open(q); }, {q, "\"weight\"", "truncated"});
}

TEST_F(SafetensorsTest, RejectsSizeMismatch) {
  const std::string p = path("size.safetensors");
  write_raw(p, R"({"m": {"dtype": "BF16", "shape": [2, 3], "data_offsets": [0, 8]}})", std::vector<uint8_t>(8));
  expect_error([&] { SafetensorsFile::open(p); }, {p, "\"m\"", "needs 12 bytes", "span 8"});
}

TEST_F(SafetensorsTest, RejectsOverlapsGapsAndTrailingBytes) {
  const std::string p = path("overlap.safetensors");
  const std::vector<uint8_t> data(12);
  write_raw(p,
            R"({"first": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},)"
            R"( "second": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}})",
            data);
  expect_error([&] { SafetensorsFile::open(p); }, {p, "\"first\"", "\"second\"", "overlap"});
  write_raw(p,
            R"({"same1": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},)"
            R"( "same2": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]}})",
            std::vector<uint8_t>(4));
  expect_error([&] { SafetensorsFile::open(p); }, {p, "\"same1\"", "\"same2\"", "overlap"});
  write_raw(p, R"({"late": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}})", data);
  expect_error([&] { SafetensorsFile::open(p); }, {p, "\"late\"", "gap of 4"});
  write_raw(p, R"({"short": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}})", data);
  expect_error([&] { SafetensorsFile::open(p); }, {p, "4 trailing bytes"});
}

TEST_F(SafetensorsTest, AcceptsHandWrittenHeaderWithPadding) {
  // The reference writer pads the header with spaces; parse must tolerate that and zero-size tensors.
  const std::string p = path("hand.safetensors");
  const uint16_t bf16[2] = {0x3F80, 0xC040};
  write_raw(p,
            R"({"__metadata__":{"format":"pt"},"e":{"dtype":"F32","shape":[0],"data_offsets":[0,0]},)"
            R"("w":{"dtype":"BF16","shape":[2],"data_offsets":[0,4]}}      )",
            bytes_of(bf16, 4));
  auto f = SafetensorsFile::open(p);
  ASSERT_EQ(f->tensors().size(), 2u);
  EXPECT_EQ(f->metadata().at("format"), "pt");
  EXPECT_EQ(to_f32(f->tensors()[1]), (std::vector<float>{1.0f, -3.0f}));
  EXPECT_TRUE(to_f32(f->tensors()[0]).empty());
}

// ---------------------------------------------------------------------------------------------
// Element decoding (exact values)

TEST(SafetensorsDecode, Bf16KnownPatterns) {
  auto v = decode(DType::BF16, u16_bytes({0x3F80, 0xC000, 0x3F81, 0x0001, 0x8000, 0x7F80, 0xFF80, 0x7FC0, 0x4049}));
  EXPECT_EQ(v[0], 1.0f);
  EXPECT_EQ(v[1], -2.0f);
  EXPECT_EQ(v[2], 1.0f + 0x1p-7f);
  EXPECT_EQ(v[3], 0x1p-133f);  // smallest bf16 subnormal
  EXPECT_EQ(v[4], 0.0f);
  EXPECT_TRUE(std::signbit(v[4]));
  EXPECT_EQ(v[5], INFINITY);
  EXPECT_EQ(v[6], -INFINITY);
  EXPECT_TRUE(std::isnan(v[7]));
  EXPECT_EQ(v[8], 3.140625f);
}

TEST(SafetensorsDecode, F16KnownPatterns) {
  auto v = decode(DType::F16, u16_bytes({0x3C00, 0xC000, 0x7BFF, 0x0001, 0x03FF, 0x0400, 0x7C00, 0xFC00, 0x7E00,
                                         0x8000, 0x3555, 0x8001}));
  EXPECT_EQ(v[0], 1.0f);
  EXPECT_EQ(v[1], -2.0f);
  EXPECT_EQ(v[2], 65504.0f);
  EXPECT_EQ(v[3], 0x1p-24f);
  EXPECT_EQ(v[4], 1023.0f * 0x1p-24f);
  EXPECT_EQ(v[5], 0x1p-14f);
  EXPECT_EQ(v[6], INFINITY);
  EXPECT_EQ(v[7], -INFINITY);
  EXPECT_TRUE(std::isnan(v[8]));
  EXPECT_TRUE(v[9] == 0.0f && std::signbit(v[9]));
  EXPECT_EQ(v[10], 0.333251953125f);
  EXPECT_EQ(v[11], -0x1p-24f);
}

TEST(SafetensorsDecode, F16MatchesCompilerHalfForAllPatterns) {
#if defined(__FLT16_MAX__)
  std::vector<uint16_t> all(65536);
  for (int i = 0; i < 65536; ++i) all[i] = uint16_t(i);
  TensorView t;
  t.name = "all";
  t.dtype = DType::F16;
  t.shape = {65536};
  t.data = reinterpret_cast<const uint8_t*>(all.data());
  t.nbytes = all.size() * 2;
  const std::vector<float> v = to_f32(t);
  int mismatches = 0;
  for (int i = 0; i < 65536; ++i) {
    _Float16 h;
    std::memcpy(&h, &all[i], 2);
    const float ref = float(h);
    const bool same = std::isnan(ref) ? std::isnan(v[i]) : (std::memcmp(&ref, &v[i], 4) == 0);
    if (!same && mismatches++ < 5) ADD_FAILURE() << "f16 bits 0x" << std::hex << i << ": got " << v[i] << " want " << ref;
  }
  EXPECT_EQ(mismatches, 0);
#else
  GTEST_SKIP() << "compiler has no _Float16";
#endif
}

TEST(SafetensorsDecode, E4M3KnownPatterns) {
  auto v = decode(DType::F8_E4M3, {0x7E, 0x01, 0x07, 0x08, 0x38, 0x7F, 0xFF, 0xFE, 0x80, 0x78, 0x77, 0xB8, 0x00});
  EXPECT_EQ(v[0], 448.0f);
  EXPECT_EQ(v[1], 0x1p-9f);
  EXPECT_EQ(v[2], 7.0f * 0x1p-9f);
  EXPECT_EQ(v[3], 0x1p-6f);  // min normal
  EXPECT_EQ(v[4], 1.0f);
  EXPECT_TRUE(std::isnan(v[5]));
  EXPECT_TRUE(std::isnan(v[6]));
  EXPECT_EQ(v[7], -448.0f);
  EXPECT_TRUE(v[8] == 0.0f && std::signbit(v[8]));
  EXPECT_EQ(v[9], 256.0f);  // exponent 15 is a normal binade in the fn variant
  EXPECT_EQ(v[10], 240.0f);
  EXPECT_EQ(v[11], -1.0f);
  EXPECT_EQ(v[12], 0.0f);
}

TEST(SafetensorsDecode, E4M3AllPatternsAreFiniteMonotoneExceptNaN) {
  std::vector<uint8_t> all(256);
  for (int i = 0; i < 256; ++i) all[i] = uint8_t(i);
  const std::vector<float> v = decode(DType::F8_E4M3, all);
  int nans = 0;
  for (int i = 0; i < 256; ++i) {
    if (std::isnan(v[i])) {
      ++nans;
      continue;
    }
    EXPECT_TRUE(std::isfinite(v[i])) << i;
    EXPECT_EQ(v[i], -v[i ^ 0x80]) << i;  // sign bit is a pure sign
  }
  EXPECT_EQ(nans, 2);  // 0x7F and 0xFF only
  for (int i = 1; i < 0x7F; ++i) EXPECT_LT(v[i - 1], v[i]) << i;
}

TEST(SafetensorsDecode, E5M2KnownPatternsAndHalfRelation) {
  auto v = decode(DType::F8_E5M2, {0x3C, 0x7B, 0x7C, 0xFC, 0x7D, 0x01, 0x04, 0xC0});
  EXPECT_EQ(v[0], 1.0f);
  EXPECT_EQ(v[1], 57344.0f);
  EXPECT_EQ(v[2], INFINITY);
  EXPECT_EQ(v[3], -INFINITY);
  EXPECT_TRUE(std::isnan(v[4]));
  EXPECT_EQ(v[5], 0x1p-16f);
  EXPECT_EQ(v[6], 0x1p-14f);
  EXPECT_EQ(v[7], -2.0f);
  // e5m2 is the top byte of an IEEE half.
  std::vector<uint8_t> all(256);
  std::vector<uint16_t> halves(256);
  for (int i = 0; i < 256; ++i) all[i] = uint8_t(i), halves[i] = uint16_t(i << 8);
  const auto e5 = decode(DType::F8_E5M2, all);
  std::vector<uint8_t> half_bytes(512);
  std::memcpy(half_bytes.data(), halves.data(), 512);
  const auto h = decode(DType::F16, half_bytes);
  for (int i = 0; i < 256; ++i) {
    if (std::isnan(h[i]))
      EXPECT_TRUE(std::isnan(e5[i])) << i;
    else
      EXPECT_EQ(e5[i], h[i]) << i;
  }
}

TEST(SafetensorsDecode, WideAndIntegerTypes) {
  const double d[3] = {0.1, -1e300, 3.0};
  EXPECT_EQ(decode(DType::F64, bytes_of(d, sizeof d)), (std::vector<float>{0.1f, -INFINITY, 3.0f}));
  const int32_t i32[3] = {-7, 0, 16777217};
  EXPECT_EQ(decode(DType::I32, bytes_of(i32, sizeof i32)), (std::vector<float>{-7.0f, 0.0f, 16777216.0f}));
  const int16_t i16[2] = {-32768, 32767};
  EXPECT_EQ(decode(DType::I16, bytes_of(i16, sizeof i16)), (std::vector<float>{-32768.0f, 32767.0f}));
  EXPECT_EQ(decode(DType::I8, {0x80, 0x7F, 0xFF}), (std::vector<float>{-128.0f, 127.0f, -1.0f}));
  EXPECT_EQ(decode(DType::U8, {0x80, 0x7F, 0xFF}), (std::vector<float>{128.0f, 127.0f, 255.0f}));
  EXPECT_EQ(decode(DType::BOOL, {0, 1, 2}), (std::vector<float>{0.0f, 1.0f, 1.0f}));
}

TEST(SafetensorsDecode, ToI64) {
  auto view = [](DType dtype, const void* p, size_t bytes) {
    TensorView t;
    t.name = "ids";
    t.dtype = dtype;
    t.shape = {int64_t(bytes / dtype_size(dtype))};
    t.data = static_cast<const uint8_t*>(p);
    t.nbytes = bytes;
    return t;
  };
  const int64_t i64[2] = {INT64_MIN, INT64_MAX};
  EXPECT_EQ(to_i64(view(DType::I64, i64, 16)), (std::vector<int64_t>{INT64_MIN, INT64_MAX}));
  const int32_t i32[2] = {-3, 129280};
  EXPECT_EQ(to_i64(view(DType::I32, i32, 8)), (std::vector<int64_t>{-3, 129280}));
  const int16_t i16[1] = {-300};
  EXPECT_EQ(to_i64(view(DType::I16, i16, 2)), (std::vector<int64_t>{-300}));
  const uint8_t u8[2] = {200, 0};
  EXPECT_EQ(to_i64(view(DType::U8, u8, 2)), (std::vector<int64_t>{200, 0}));
  EXPECT_EQ(to_i64(view(DType::I8, u8, 2)), (std::vector<int64_t>{-56, 0}));
  EXPECT_EQ(to_i64(view(DType::BOOL, u8, 2)), (std::vector<int64_t>{1, 0}));
  const float f[1] = {1.0f};
  expect_error([&] { to_i64(view(DType::F32, f, 4)); }, {"\"ids\"", "F32", "integer"});
}

TEST(SafetensorsDecode, RejectsScaleDtypeAndWrongOutputSize) {
  std::vector<uint8_t> raw = {127, 128};
  TensorView t;
  t.name = "w.scale";
  t.file = "/m/model.safetensors";
  t.dtype = DType::F8_E8M0;
  t.shape = {2};
  t.data = raw.data();
  t.nbytes = 2;
  expect_error([&] { to_f32(t); }, {"\"w.scale\"", "F8_E8M0", "/m/model.safetensors"});
  t.dtype = DType::U8;
  std::vector<float> out(3);
  expect_error([&] { convert_to_f32(t, out); }, {"\"w.scale\"", "has 2 elements but the output holds 3"});
}

TEST(SafetensorsDecode, LargeTensorsDecodeInParallelExactly) {
  // Above the OpenMP threshold: every element must still land in its own slot.
  const int64_t n = 300000;
  std::vector<uint16_t> bf(n);
  std::vector<uint8_t> e4(n);
  for (int64_t i = 0; i < n; ++i) {
    bf[i] = uint16_t(0x3F80 + (i % 128));  // 1 + k/128
    e4[i] = uint8_t(0x38 + (i % 8));       // 1 + k/8
  }
  std::vector<uint8_t> bf_bytes(size_t(n) * 2);
  std::memcpy(bf_bytes.data(), bf.data(), bf_bytes.size());
  const auto a = decode(DType::BF16, bf_bytes);
  const auto b = decode(DType::F8_E4M3, e4);
  for (int64_t i = 0; i < n; ++i) {
    ASSERT_EQ(a[i], 1.0f + float(i % 128) / 128.0f) << i;
    ASSERT_EQ(b[i], 1.0f + float(i % 8) / 8.0f) << i;
  }
}

// ---------------------------------------------------------------------------------------------
// Checkpoints (directories)

TEST_F(SafetensorsTest, CheckpointSingleFile) {
  write_one_f32(path("model.safetensors"), "embed.weight");
  write_one_f32(path("other.safetensors"), "ignored");  // model.safetensors wins over the glob
  Checkpoint c = Checkpoint::open(dir_.string());
  EXPECT_EQ(c.dir(), dir_.string());
  ASSERT_EQ(c.tensors().size(), 1u);
  const TensorView* t = c.find("embed.weight");
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(to_f32(*t), (std::vector<float>{1.5f, -2.0f}));
  EXPECT_EQ(c.find("ignored"), nullptr);
  EXPECT_EQ(c.total_bytes(), 8u);
}

TEST_F(SafetensorsTest, CheckpointShardedWithIndex) {
  const float a[4] = {1, 2, 3, 4};
  const uint16_t b[2] = {0x3F80, 0x4000};
  const int32_t c[1] = {42};
  write_safetensors(path("model-00001-of-00002.safetensors"),
                    {{"layers.0.w", DType::F32, {2, 2}, bytes_of(a, 16)}, {"layers.0.b", DType::BF16, {2}, bytes_of(b, 4)}});
  write_safetensors(path("model-00002-of-00002.safetensors"), {{"head.ids", DType::I32, {1}, bytes_of(c, 4)}});
  write_one_f32(path("stray.safetensors"), "stray");  // not in the index: not loaded
  nlohmann::json index = {{"metadata", {{"total_size", 24}}},
                          {"weight_map",
                           {{"layers.0.w", "model-00001-of-00002.safetensors"},
                            {"layers.0.b", "model-00001-of-00002.safetensors"},
                            {"head.ids", "model-00002-of-00002.safetensors"}}}};
  std::ofstream(path("model.safetensors.index.json")) << index.dump(2);

  // Open, then move the Checkpoint around: views must stay valid.
  Checkpoint ckpt = [&] {
    Checkpoint tmp = Checkpoint::open(dir_.string());
    return tmp;
  }();
  ASSERT_EQ(ckpt.tensors().size(), 3u);
  EXPECT_EQ(ckpt.total_bytes(), 24u);
  EXPECT_EQ(ckpt.find("stray"), nullptr);
  EXPECT_EQ(ckpt.find("layers.0.b")->file, path("model-00001-of-00002.safetensors"));
  EXPECT_EQ(ckpt.find("head.ids")->file, path("model-00002-of-00002.safetensors"));
  EXPECT_EQ(to_f32(*ckpt.find("layers.0.w")), (std::vector<float>{1, 2, 3, 4}));
  EXPECT_EQ(to_f32(*ckpt.find("layers.0.b")), (std::vector<float>{1, 2}));
  EXPECT_EQ(to_i64(*ckpt.find("head.ids")), (std::vector<int64_t>{42}));
}

TEST_F(SafetensorsTest, CheckpointIndexErrors) {
  write_one_f32(path("a.safetensors"), "x");
  write_one_f32(path("b.safetensors"), "y");
  auto write_index = [&](const nlohmann::json& weight_map) {
    std::ofstream(path("model.safetensors.index.json")) << nlohmann::json{{"weight_map", weight_map}}.dump();
  };
  const std::string index = path("model.safetensors.index.json");

  write_index({{"x", "a.safetensors"}, {"z", "missing-shard.safetensors"}});
  expect_error([&] { Checkpoint::open(dir_.string()); }, {path("missing-shard.safetensors"), "\"z\"", "does not exist"});

  write_index({{"x", "a.safetensors"}, {"absent", "a.safetensors"}});
  expect_error([&] { Checkpoint::open(dir_.string()); }, {"\"absent\"", path("a.safetensors"), index});

  write_index({{"x", "a.safetensors"}, {"y", "a.safetensors"}, {"unused", "b.safetensors"}});
  expect_error([&] { Checkpoint::open(dir_.string()); }, {"\"y\"", path("a.safetensors"), "does not contain"});

  write_index({{"x", 3}});
  expect_error([&] { Checkpoint::open(dir_.string()); }, {index, "weight_map[\"x\"]"});

  write_index(nlohmann::json::object());
  expect_error([&] { Checkpoint::open(dir_.string()); }, {index, "empty"});

  std::ofstream(index) << "{\"weight_map\": {";
  expect_error([&] { Checkpoint::open(dir_.string()); }, {index, "not valid JSON"});

  std::ofstream(index) << "[]";
  expect_error([&] { Checkpoint::open(dir_.string()); }, {index, "weight_map"});

  // A shard that exists but is corrupt reports the shard's own error.
  write_bytes(path("a.safetensors"), {1, 2, 3});
  write_index({{"x", "a.safetensors"}});
  expect_error([&] { Checkpoint::open(dir_.string()); }, {path("a.safetensors"), "shorter"});
}

TEST_F(SafetensorsTest, CheckpointGlobFallbackAndDuplicates) {
  write_one_f32(path("part-b.safetensors"), "beta");
  write_one_f32(path("part-a.safetensors"), "alpha");
  std::ofstream(path("notes.txt")) << "not a tensor file";
  Checkpoint c = Checkpoint::open(dir_.string());
  ASSERT_EQ(c.tensors().size(), 2u);
  EXPECT_EQ(c.find("alpha")->file, path("part-a.safetensors"));
  EXPECT_EQ(c.find("beta")->file, path("part-b.safetensors"));

  write_one_f32(path("part-c.safetensors"), "alpha");
  expect_error([&] { Checkpoint::open(dir_.string()); },
               {"\"alpha\"", path("part-a.safetensors"), path("part-c.safetensors")});
}

TEST_F(SafetensorsTest, CheckpointDirectoryErrors) {
  expect_error([&] { Checkpoint::open(dir_.string()); }, {"no safetensors files in " + dir_.string()});
  expect_error([&] { Checkpoint::open(path("nope")); }, {path("nope"), "does not exist"});
  write_one_f32(path("file.safetensors"));
  expect_error([&] { Checkpoint::open(path("file.safetensors")); }, {path("file.safetensors"), "not a directory"});
}

// ---------------------------------------------------------------------------------------------
// Fuzz: corrupted files load or throw dsv4::Error; nothing else, never a crash. Build with
// -DDSV4_FUZZ_ITERATIONS=100000 (and sanitizers) for a longer run.

#ifndef DSV4_FUZZ_ITERATIONS
#define DSV4_FUZZ_ITERATIONS 400
#endif

namespace {
// A random JSON value of the kinds a broken writer might produce.
nlohmann::json random_json_value(std::mt19937& rng) {
  switch (rng() % 8) {
    case 0: return -int64_t(rng() % 100);
    case 1: return uint64_t(rng() % 64);
    case 2: return uint64_t(1) << (rng() % 64);
    case 3: return "F8_E4M3";
    case 4: return nlohmann::json::array({rng() % 40, rng() % 40});
    case 5: return nlohmann::json::array();
    case 6: return 2.5;
    default: return nullptr;
  }
}
}  // namespace

TEST_F(SafetensorsTest, FuzzedFilesLoadOrThrowCleanly) {
  const std::string good = path("good.safetensors");
  const float f[6] = {1, 2, 3, 4, 5, 6};
  const uint16_t h[4] = {0x3C00, 0x3F80, 0x7C00, 0x0001};
  const uint8_t q[5] = {0x7E, 0x01, 0x7F, 0x38, 0x80};
  const int64_t ids[2] = {3, -4};
  write_safetensors(good,
                    {{"a.weight", DType::F32, {2, 3}, bytes_of(f, sizeof f)},
                     {"b.half", DType::F16, {4}, bytes_of(h, sizeof h)},
                     {"c.fp8", DType::F8_E4M3, {5}, bytes_of(q, sizeof q)},
                     {"d.scale", DType::F8_E8M0, {1}, bytes_of(q, 1)},
                     {"e.ids", DType::I64, {2}, bytes_of(ids, sizeof ids)}},
                    {{"format", "pt"}});
  const std::vector<uint8_t> original = read_all(good);
  uint64_t header_size;
  std::memcpy(&header_size, original.data(), 8);

  std::mt19937 rng(1234);
  const std::string p = path("fuzz.safetensors");
  int loaded = 0, rejected = 0;
  const int iterations = DSV4_FUZZ_ITERATIONS;
  for (int iter = 0; iter < iterations; ++iter) {
    std::vector<uint8_t> bytes = original;
    const int kind = int(rng() % 5);
    if (kind == 0 || kind == 3) {  // flip a few bytes, mostly inside the header where parsing happens
      const int flips = 1 + int(rng() % 4);
      for (int k = 0; k < flips; ++k) {
        const size_t limit = rng() % 4 ? 8 + header_size : bytes.size();
        bytes[rng() % limit] ^= uint8_t(1u << (rng() % 8));
      }
    }
    if (kind == 1) {  // replace one header byte with a JSON-significant character
      const char chars[] = "{}[]\":,-0123456789 eE.";
      bytes[8 + rng() % header_size] = uint8_t(chars[rng() % (sizeof chars - 1)]);
    }
    if (kind == 2 || kind == 3) bytes.resize(rng() % (bytes.size() + 1));  // truncate
    if (kind == 4) {  // well-formed JSON with one field of one tensor replaced: exercises validation
      nlohmann::json header = nlohmann::json::parse(bytes.begin() + 8, bytes.begin() + 8 + long(header_size));
      auto entry = header.begin();
      std::advance(entry, long(rng() % header.size()));
      const char* fields[] = {"dtype", "shape", "data_offsets"};
      const char* field = fields[rng() % 3];
      if (entry->is_object() && entry->contains(field) && (*entry)[field].is_array() && !(*entry)[field].empty() &&
          rng() % 2)
        (*entry)[field][rng() % (*entry)[field].size()] = random_json_value(rng);
      else
        (*entry)[field] = random_json_value(rng);
      std::string text = header.dump();
      const uint64_t n = text.size();
      std::vector<uint8_t> rebuilt(8);
      std::memcpy(rebuilt.data(), &n, 8);
      rebuilt.insert(rebuilt.end(), text.begin(), text.end());
      rebuilt.insert(rebuilt.end(), bytes.begin() + 8 + long(header_size), bytes.end());
      bytes = std::move(rebuilt);
    }
    write_bytes(p, bytes);

    try {
      auto file = SafetensorsFile::open(p);
      for (const TensorView& t : file->tensors()) {
        ASSERT_EQ(t.nbytes, size_t(t.numel()) * dtype_size(t.dtype)) << t.name;
        if (t.dtype == DType::F8_E8M0) continue;
        const std::vector<float> v = to_f32(t);
        ASSERT_EQ(v.size(), size_t(t.numel()));
      }
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
  EXPECT_GT(rejected, iterations / 4);  // most mutations must be caught
  EXPECT_GT(loaded, 0);      // flips inside tensor data still load
}
