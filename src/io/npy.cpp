// SPDX-License-Identifier: MIT
// .npy layout (numpy/lib/format.py): "\x93NUMPY", major, minor, header length (u16 LE for 1.0, u32 LE
// for 2.0 and 3.0), then a Python dict literal {'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }
// padded with spaces and ended by '\n', then the raw C-order data.
#include "io/npy.h"

#include <bit>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <iterator>
#include <map>
#include <optional>
#include <variant>

#include "core/check.h"
#include "formats/bf16.h"

static_assert(std::endian::native == std::endian::little, "npy data is read as little-endian");

namespace dsv4 {
namespace {

constexpr char kMagic[] = "\x93NUMPY";
constexpr size_t kMagicSize = 6;
constexpr size_t kAlign = 64;  // numpy aligns the data start to 64 bytes

enum class NpyType { F2, F4, F8, I1, I2, I4, I8, U1, B1 };

struct NpyDescr {
  std::string_view descr;
  NpyType type;
  size_t size;
};
constexpr NpyDescr kDescrs[] = {
    {"<f2", NpyType::F2, 2}, {"<f4", NpyType::F4, 4}, {"<f8", NpyType::F8, 8},
    {"|i1", NpyType::I1, 1}, {"<i2", NpyType::I2, 2}, {"<i4", NpyType::I4, 4},
    {"<i8", NpyType::I8, 8}, {"|u1", NpyType::U1, 1}, {"<u1", NpyType::U1, 1},
    {"|b1", NpyType::B1, 1},
};

// Values a .npy header dict can hold that we accept: strings, booleans, tuples of integers.
using HeaderValue = std::variant<std::string, bool, std::vector<int64_t>>;

// Parser for the restricted Python literal numpy writes (repr of a dict).
class HeaderParser {
 public:
  HeaderParser(std::string_view text, const std::string& path) : s_(text), path_(path) {}

  std::map<std::string, HeaderValue> parse_dict() {
    std::map<std::string, HeaderValue> dict;
    expect('{');
    while (true) {
      skip_space();
      if (peek() == '}') break;
      std::string key = parse_string();
      expect(':');
      dict[key] = parse_value(key);
      skip_space();
      if (peek() == ',') {
        ++pos_;
        continue;
      }
      DSV4_CHECK(peek() == '}', "{}: npy header: expected ',' or '}}' after key '{}' at offset {}", path_, key, pos_);
    }
    ++pos_;
    skip_space();
    DSV4_CHECK(pos_ == s_.size(), "{}: npy header: unexpected text after the dict at offset {}", path_, pos_);
    return dict;
  }

 private:
  char peek() const { return pos_ < s_.size() ? s_[pos_] : '\0'; }
  void skip_space() {
    while (pos_ < s_.size() && (s_[pos_] == ' ' || s_[pos_] == '\n' || s_[pos_] == '\t' || s_[pos_] == '\r')) ++pos_;
  }
  void expect(char c) {
    skip_space();
    DSV4_CHECK(peek() == c, "{}: npy header: expected '{}' at offset {}", path_, c, pos_);
    ++pos_;
  }
  std::string parse_string() {
    skip_space();
    const char quote = peek();
    DSV4_CHECK(quote == '\'' || quote == '"', "{}: npy header: expected a quoted string at offset {}", path_, pos_);
    const size_t end = s_.find(quote, pos_ + 1);
    DSV4_CHECK(end != std::string_view::npos, "{}: npy header: unterminated string at offset {}", path_, pos_);
    std::string out(s_.substr(pos_ + 1, end - pos_ - 1));
    pos_ = end + 1;
    return out;
  }
  int64_t parse_int() {
    skip_space();
    const size_t start = pos_;
    int64_t v = 0;
    while (pos_ < s_.size() && s_[pos_] >= '0' && s_[pos_] <= '9') {
      DSV4_CHECK(!__builtin_mul_overflow(v, 10, &v) && !__builtin_add_overflow(v, s_[pos_] - '0', &v),
                 "{}: npy header: dimension too large at offset {}", path_, start);
      ++pos_;
    }
    DSV4_CHECK(pos_ > start, "{}: npy header: expected a non-negative integer at offset {}", path_, start);
    if (peek() == 'L') ++pos_;  // Python 2 long suffix in old files
    return v;
  }
  HeaderValue parse_value(const std::string& key) {
    skip_space();
    if (peek() == '\'' || peek() == '"') return parse_string();
    if (s_.substr(pos_, 4) == "True") {
      pos_ += 4;
      return true;
    }
    if (s_.substr(pos_, 5) == "False") {
      pos_ += 5;
      return false;
    }
    DSV4_CHECK(peek() == '(', "{}: npy header: unsupported value for '{}' at offset {} (structured dtype?)", path_,
               key, pos_);
    ++pos_;
    std::vector<int64_t> dims;
    while (true) {
      skip_space();
      if (peek() == ')') break;
      dims.push_back(parse_int());
      skip_space();
      if (peek() == ',') {
        ++pos_;
        continue;
      }
      DSV4_CHECK(peek() == ')', "{}: npy header: expected ',' or ')' in '{}' at offset {}", path_, key, pos_);
    }
    ++pos_;
    return dims;
  }

  std::string_view s_;
  const std::string& path_;
  size_t pos_ = 0;
};

template <class T>
T load_le(const uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

template <class Raw>
void widen(const uint8_t* src, size_t n, double* out) {
  for (size_t i = 0; i < n; ++i) out[i] = double(load_le<Raw>(src + i * sizeof(Raw)));
}

}  // namespace

NpyArray read_npy(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  DSV4_CHECK(in.good(), "cannot open npy file {}: {}", path, std::strerror(errno));
  const std::vector<uint8_t> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  DSV4_CHECK(!in.bad(), "reading {} failed", path);

  DSV4_CHECK(bytes.size() >= kMagicSize + 2 && std::memcmp(bytes.data(), kMagic, kMagicSize) == 0,
             "{} is not a .npy file (bad magic)", path);
  const int major = bytes[6], minor = bytes[7];
  DSV4_CHECK(major >= 1 && major <= 3, "{}: unsupported .npy format version {}.{}", path, major, minor);
  const size_t length_field = major == 1 ? 2 : 4;
  const size_t prefix = kMagicSize + 2 + length_field;
  DSV4_CHECK(bytes.size() >= prefix, "{}: truncated .npy preamble", path);
  const size_t header_size = major == 1 ? load_le<uint16_t>(&bytes[8]) : load_le<uint32_t>(&bytes[8]);
  DSV4_CHECK(header_size <= bytes.size() - prefix, "{}: .npy header of {} bytes is truncated (file has {} bytes)",
             path, header_size, bytes.size());
  const std::string_view header(reinterpret_cast<const char*>(&bytes[prefix]), header_size);

  auto dict = HeaderParser(header, path).parse_dict();
  for (const auto& [key, value] : dict)
    DSV4_CHECK(key == "descr" || key == "fortran_order" || key == "shape", "{}: unexpected key '{}' in .npy header",
               path, key);
  auto* descr = dict.count("descr") ? std::get_if<std::string>(&dict["descr"]) : nullptr;
  auto* fortran = dict.count("fortran_order") ? std::get_if<bool>(&dict["fortran_order"]) : nullptr;
  auto* shape = dict.count("shape") ? std::get_if<std::vector<int64_t>>(&dict["shape"]) : nullptr;
  DSV4_CHECK(descr && fortran && shape,
             "{}: .npy header needs 'descr' (string), 'fortran_order' (bool) and 'shape' (tuple): {}", path, header);
  DSV4_CHECK(!*fortran, "{}: fortran_order=True arrays are not supported; save with np.ascontiguousarray", path);

  const NpyDescr* type = nullptr;
  for (const auto& d : kDescrs)
    if (d.descr == *descr) type = &d;
  DSV4_CHECK(type, "{}: unsupported .npy dtype '{}' (supported: <f2 <f4 <f8 |i1 <i2 <i4 <i8 |u1 |b1, little-endian)",
             path, *descr);

  size_t numel = 1;
  for (int64_t d : *shape)
    DSV4_CHECK(!__builtin_mul_overflow(numel, size_t(d), &numel), "{}: .npy shape overflows", path);
  size_t data_bytes = 0;
  DSV4_CHECK(!__builtin_mul_overflow(numel, type->size, &data_bytes), "{}: .npy shape overflows", path);
  const size_t available = bytes.size() - prefix - header_size;
  DSV4_CHECK(available >= data_bytes, "{}: .npy data truncated: shape needs {} bytes of '{}', file holds {}", path,
             data_bytes, *descr, available);
  DSV4_CHECK(available == data_bytes, "{}: .npy has {} trailing bytes after the {} bytes the shape needs", path,
             available - data_bytes, data_bytes);

  NpyArray array;
  array.shape = *shape;
  array.values.resize(numel);
  const uint8_t* src = bytes.data() + prefix + header_size;
  double* out = array.values.data();
  switch (type->type) {
    case NpyType::F2:
      for (size_t i = 0; i < numel; ++i) out[i] = f16_to_f32(load_le<uint16_t>(src + 2 * i));
      break;
    case NpyType::F4: widen<float>(src, numel, out); break;
    case NpyType::F8: widen<double>(src, numel, out); break;
    case NpyType::I1: widen<int8_t>(src, numel, out); break;
    case NpyType::I2: widen<int16_t>(src, numel, out); break;
    case NpyType::I4: widen<int32_t>(src, numel, out); break;
    case NpyType::I8: widen<int64_t>(src, numel, out); break;
    case NpyType::U1: widen<uint8_t>(src, numel, out); break;
    case NpyType::B1:
      for (size_t i = 0; i < numel; ++i) out[i] = src[i] ? 1.0 : 0.0;
      break;
  }
  return array;
}

void write_npy_f32(const std::string& path, const float* data, const std::vector<int64_t>& shape) {
  size_t numel = 1;
  for (int64_t d : shape) {
    DSV4_CHECK(d >= 0, "write_npy_f32 {}: negative dimension {}", path, d);
    DSV4_CHECK(!__builtin_mul_overflow(numel, size_t(d), &numel), "write_npy_f32 {}: shape overflows", path);
  }
  DSV4_CHECK(data != nullptr || numel == 0, "write_npy_f32 {}: null data for {} elements", path, numel);

  // numpy's repr of the shape tuple: "()", "(5,)", "(2, 3)".
  std::string shape_text = "(";
  for (size_t i = 0; i < shape.size(); ++i) shape_text += (i ? ", " : "") + std::to_string(shape[i]);
  if (shape.size() == 1) shape_text += ",";
  shape_text += ")";
  std::string header = "{'descr': '<f4', 'fortran_order': False, 'shape': " + shape_text + ", }";

  // Pad with spaces and end with '\n' so the data starts at a multiple of 64 bytes. Version 1.0
  // unless the padded header does not fit its u16 length field.
  auto padded_length = [&](size_t prefix) {
    const size_t unpadded = prefix + header.size() + 1;
    return header.size() + (kAlign - unpadded % kAlign) % kAlign + 1;
  };
  int major = 1;
  size_t length = padded_length(kMagicSize + 2 + 2);
  if (length > 65535) {
    major = 2;
    length = padded_length(kMagicSize + 2 + 4);
  }
  header.resize(length - 1, ' ');
  header += '\n';

  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  DSV4_CHECK(out.good(), "write_npy_f32: cannot create {}: {}", path, std::strerror(errno));
  out.write(kMagic, kMagicSize);
  const char version[2] = {char(major), 0};
  out.write(version, 2);
  if (major == 1) {
    const uint16_t len = uint16_t(header.size());
    out.write(reinterpret_cast<const char*>(&len), 2);
  } else {
    const uint32_t len = uint32_t(header.size());
    out.write(reinterpret_cast<const char*>(&len), 4);
  }
  out.write(header.data(), std::streamsize(header.size()));
  if (numel) out.write(reinterpret_cast<const char*>(data), std::streamsize(numel * sizeof(float)));
  out.close();
  DSV4_CHECK(out.good(), "write_npy_f32: writing {} failed (disk full?)", path);
}

}  // namespace dsv4
