// SPDX-License-Identifier: MIT
// safetensors layout: [u64 little-endian N][N bytes of JSON header][data section]. The header maps each
// tensor name to {dtype, shape, data_offsets: [begin, end]} with offsets relative to the data section,
// plus an optional "__metadata__" string->string map. Nothing in the file is trusted: every field is
// checked before a TensorView pointing into the mapping is handed out.
#include "io/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>

#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "core/check.h"
#include "formats/bf16.h"
#include "formats/fp8.h"

static_assert(std::endian::native == std::endian::little, "safetensors data is little-endian");

namespace dsv4 {
namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

constexpr uint64_t kMaxHeaderBytes = 100ull << 20;  // same cap as the reference implementation
constexpr int64_t kParallelMinElements = 1 << 16;   // below this a thread team costs more than it saves
constexpr const char* kMetadataKey = "__metadata__";

// a * b, or nullopt on overflow of int64.
std::optional<int64_t> checked_mul(int64_t a, int64_t b) {
  int64_t r;
  if (__builtin_mul_overflow(a, b, &r)) return std::nullopt;
  return r;
}

template <class T>
T load_unaligned(const uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

// out[i] = decode(element i), elements of type Raw read unaligned from src.
template <class Raw, class Decode>
void decode_elements(const uint8_t* src, int64_t n, float* out, Decode decode) {
#pragma omp parallel for schedule(static) if (n >= kParallelMinElements)
  for (int64_t i = 0; i < n; ++i) out[i] = decode(load_unaligned<Raw>(src + i * sizeof(Raw)));
}

// 8-bit formats go through a 256-entry table built from the exact decoder in formats/.
template <class Decode>
void decode_bytes_via_table(const uint8_t* src, int64_t n, float* out, Decode decode) {
  float table[256];
  for (int b = 0; b < 256; ++b) table[b] = decode(uint8_t(b));
#pragma omp parallel for schedule(static) if (n >= kParallelMinElements)
  for (int64_t i = 0; i < n; ++i) out[i] = table[src[i]];
}

template <class Raw>
void widen_integers(const uint8_t* src, int64_t n, int64_t* out) {
#pragma omp parallel for schedule(static) if (n >= kParallelMinElements)
  for (int64_t i = 0; i < n; ++i) out[i] = int64_t(load_unaligned<Raw>(src + i * sizeof(Raw)));
}

// Parse one header entry into a TensorView (data pointer left unset); offsets returned separately.
struct ParsedEntry {
  TensorView view;
  uint64_t begin = 0, end = 0;
};

ParsedEntry parse_entry(const std::string& path, const std::string& name, const json& entry,
                        uint64_t data_size) {
  ParsedEntry p;
  p.view.name = name;
  p.view.file = path;
  DSV4_CHECK(entry.is_object(), "tensor \"{}\" in {}: header entry must be a JSON object, got {}", name,
             path, entry.type_name());

  auto dtype_it = entry.find("dtype");
  DSV4_CHECK(dtype_it != entry.end(), "tensor \"{}\" in {}: missing \"dtype\"", name, path);
  DSV4_CHECK(dtype_it->is_string(), "tensor \"{}\" in {}: \"dtype\" must be a string", name, path);
  const std::string dtype_str = dtype_it->get<std::string>();
  auto dtype = dtype_from_name(dtype_str);
  DSV4_CHECK(dtype.has_value(), "unknown dtype \"{}\" for tensor \"{}\" in file {}", dtype_str, name,
             path);
  p.view.dtype = *dtype;

  auto shape_it = entry.find("shape");
  DSV4_CHECK(shape_it != entry.end(), "tensor \"{}\" in {}: missing \"shape\"", name, path);
  DSV4_CHECK(shape_it->is_array(), "tensor \"{}\" in {}: \"shape\" must be an array", name, path);
  int64_t numel = 1;
  for (const json& d : *shape_it) {
    DSV4_CHECK(d.is_number_integer(), "tensor \"{}\" in {}: shape entries must be integers, got {}",
               name, path, d.dump());
    DSV4_CHECK(!(d.is_number_unsigned() && d.get<uint64_t>() > uint64_t(INT64_MAX)),
               "tensor \"{}\" in {}: dimension {} is too large", name, path, d.dump());
    const int64_t dim = d.get<int64_t>();
    DSV4_CHECK(dim >= 0, "tensor \"{}\" in {}: negative dimension {} in shape {}", name, path, dim,
               shape_it->dump());
    auto prod = checked_mul(numel, dim);
    DSV4_CHECK(prod.has_value(), "tensor \"{}\" in {}: shape {} overflows", name, path,
               shape_it->dump());
    numel = *prod;
    p.view.shape.push_back(dim);
  }

  auto offsets_it = entry.find("data_offsets");
  DSV4_CHECK(offsets_it != entry.end(), "tensor \"{}\" in {}: missing \"data_offsets\"", name, path);
  const json& offsets = *offsets_it;
  DSV4_CHECK(offsets.is_array() && offsets.size() == 2 && offsets[0].is_number_unsigned() &&
                 offsets[1].is_number_unsigned(),
             "tensor \"{}\" in {}: \"data_offsets\" must be [begin, end] with non-negative integers, "
             "got {}",
             name, path, offsets.dump());
  p.begin = offsets[0].get<uint64_t>();
  p.end = offsets[1].get<uint64_t>();
  DSV4_CHECK(p.begin <= p.end, "tensor \"{}\" in {}: data_offsets [{}, {}] has begin > end", name, path,
             p.begin, p.end);
  DSV4_CHECK(p.end <= data_size,
             "tensor \"{}\" in {}: data_offsets end {} is beyond the {}-byte data section (file "
             "truncated?)",
             name, path, p.end, data_size);
  auto expected = checked_mul(numel, int64_t(dtype_size(p.view.dtype)));
  DSV4_CHECK(expected.has_value() && uint64_t(*expected) == p.end - p.begin,
             "tensor \"{}\" in {}: shape {} x {} needs {} bytes but data_offsets [{}, {}] span {}", name,
             path, shape_it->dump(), dtype_str, expected ? fmt::to_string(*expected) : "too many",
             p.begin, p.end, p.end - p.begin);
  p.view.nbytes = size_t(p.end - p.begin);
  return p;
}

struct FileDescriptor {
  int fd = -1;
  ~FileDescriptor() {
    if (fd >= 0) ::close(fd);
  }
};

}  // namespace

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::string TensorView::shape_str() const { return fmt::format("[{}]", fmt::join(shape, ", ")); }

SafetensorsFile::~SafetensorsFile() {
  if (map_) ::munmap(map_, map_size_);
}

std::unique_ptr<SafetensorsFile> SafetensorsFile::open(const std::string& path) {
  std::unique_ptr<SafetensorsFile> file(new SafetensorsFile());
  file->path_ = path;

  FileDescriptor fd{::open(path.c_str(), O_RDONLY | O_CLOEXEC)};
  DSV4_CHECK(fd.fd >= 0, "cannot open safetensors file {}: {}", path, std::strerror(errno));
  struct stat st {};
  DSV4_CHECK(::fstat(fd.fd, &st) == 0, "cannot stat {}: {}", path, std::strerror(errno));
  DSV4_CHECK(S_ISREG(st.st_mode), "{} is not a regular file", path);
  const uint64_t file_size = uint64_t(st.st_size);
  DSV4_CHECK(file_size >= 8, "{} is not a safetensors file: {} bytes, shorter than the 8-byte header length",
             path, file_size);

  void* map = ::mmap(nullptr, file_size, PROT_READ, MAP_PRIVATE, fd.fd, 0);
  DSV4_CHECK(map != MAP_FAILED, "cannot mmap {} ({} bytes): {}", path, file_size, std::strerror(errno));
  file->map_ = map;
  file->map_size_ = file_size;
  const auto* base = static_cast<const uint8_t*>(map);

  const uint64_t header_size = load_unaligned<uint64_t>(base);
  DSV4_CHECK(header_size <= kMaxHeaderBytes, "{}: header length {} is absurd (limit {} bytes); not a safetensors file?",
             path, header_size, kMaxHeaderBytes);
  DSV4_CHECK(header_size <= file_size - 8,
             "{}: header length {} exceeds the {} bytes after the length field (file truncated?)", path,
             header_size, file_size - 8);
  // The header is read now; tensor data is touched later, mostly once and in order.
  ::madvise(map, size_t(8 + header_size), MADV_WILLNEED);

  const char* header_begin = reinterpret_cast<const char*>(base + 8);
  json header = json::parse(header_begin, header_begin + header_size, nullptr, /*allow_exceptions=*/false);
  DSV4_CHECK(!header.is_discarded(), "{}: header is not valid JSON", path);
  DSV4_CHECK(header.is_object(), "{}: header must be a JSON object, got {}", path, header.type_name());

  const uint64_t data_offset = 8 + header_size;
  const uint64_t data_size = file_size - data_offset;
  std::vector<ParsedEntry> entries;
  for (auto it = header.begin(); it != header.end(); ++it) {
    if (it.key() == kMetadataKey) {
      DSV4_CHECK(it->is_object(), "{}: \"__metadata__\" must be an object", path);
      for (auto m = it->begin(); m != it->end(); ++m) {
        DSV4_CHECK(m->is_string(), "{}: __metadata__[\"{}\"] must be a string, got {}", path, m.key(),
                   m->type_name());
        file->metadata_[m.key()] = m->get<std::string>();
      }
      continue;
    }
    entries.push_back(parse_entry(path, it.key(), *it, data_size));
  }

  // Ranges must tile the data section: no overlap, no holes, nothing left over.
  std::vector<const ParsedEntry*> by_offset;
  for (const auto& e : entries) by_offset.push_back(&e);
  std::sort(by_offset.begin(), by_offset.end(), [](const ParsedEntry* a, const ParsedEntry* b) {
    return a->begin != b->begin ? a->begin < b->begin : a->end < b->end;
  });
  uint64_t covered = 0;
  const ParsedEntry* previous = nullptr;
  for (const ParsedEntry* e : by_offset) {
    DSV4_CHECK(e->begin >= covered, "{}: tensor \"{}\" bytes [{}, {}) overlap tensor \"{}\" bytes [{}, {})",
               path, e->view.name, e->begin, e->end, previous->view.name, previous->begin, previous->end);
    DSV4_CHECK(e->begin == covered, "{}: gap of {} unused bytes before tensor \"{}\" at data offset {}", path,
               e->begin - covered, e->view.name, covered);
    covered = e->end;
    previous = e;
  }
  DSV4_CHECK(covered == data_size, "{}: {} trailing bytes after the last tensor (data section {} bytes)", path,
             data_size - covered, data_size);

  file->tensors_.reserve(entries.size());
  for (auto& e : entries) {
    e.view.data = base + data_offset + e.begin;
    file->tensors_.push_back(std::move(e.view));
  }
  return file;
}

Checkpoint Checkpoint::open(const std::string& model_dir) {
  Checkpoint ckpt;
  ckpt.dir_ = model_dir;
  std::error_code ec;
  DSV4_CHECK(fs::exists(model_dir, ec), "model directory {} does not exist", model_dir);
  DSV4_CHECK(fs::is_directory(model_dir, ec), "model path {} is not a directory", model_dir);
  const fs::path dir(model_dir);

  auto add_file = [&](const fs::path& p) -> const SafetensorsFile& {
    std::shared_ptr<SafetensorsFile> f = SafetensorsFile::open(p.string());
    for (const TensorView& t : f->tensors()) {
      auto [it, inserted] = ckpt.by_name_.emplace(t.name, &t);
      DSV4_CHECK(inserted, "tensor \"{}\" appears in both {} and {}", t.name, it->second->file, t.file);
    }
    ckpt.files_.push_back(f);
    return *f;
  };

  const fs::path index_path = dir / "model.safetensors.index.json";
  if (fs::exists(index_path, ec)) {
    std::ifstream in(index_path);
    DSV4_CHECK(in.good(), "cannot read {}", index_path.string());
    json index = json::parse(in, nullptr, /*allow_exceptions=*/false);
    DSV4_CHECK(!index.is_discarded(), "{} is not valid JSON", index_path.string());
    DSV4_CHECK(index.is_object() && index.contains("weight_map") && index["weight_map"].is_object(),
               "{}: expected an object with a \"weight_map\" object", index_path.string());
    // shard file name -> tensor names the index places there
    std::map<std::string, std::vector<std::string>> shards;
    for (auto it = index["weight_map"].begin(); it != index["weight_map"].end(); ++it) {
      DSV4_CHECK(it->is_string(), "{}: weight_map[\"{}\"] must be a file name string", index_path.string(),
                 it.key());
      shards[it->get<std::string>()].push_back(it.key());
    }
    DSV4_CHECK(!shards.empty(), "{}: weight_map is empty", index_path.string());
    for (const auto& [shard, names] : shards) {
      const fs::path shard_path = dir / shard;
      DSV4_CHECK(fs::is_regular_file(shard_path, ec), "shard {} (holding tensor \"{}\" per {}) does not exist",
                 shard_path.string(), names.front(), index_path.string());
      const SafetensorsFile& f = add_file(shard_path);
      for (const std::string& name : names) {
        auto it = ckpt.by_name_.find(name);
        DSV4_CHECK(it != ckpt.by_name_.end() && it->second->file == f.path(),
                   "tensor \"{}\" is listed in {} as stored in {} but that file does not contain it", name,
                   index_path.string(), shard_path.string());
      }
    }
  } else if (fs::exists(dir / "model.safetensors", ec)) {
    add_file(dir / "model.safetensors");
  } else {
    std::vector<fs::path> found;
    for (const auto& entry : fs::directory_iterator(dir, ec))
      if (entry.path().extension() == ".safetensors" && entry.is_regular_file(ec)) found.push_back(entry.path());
    DSV4_CHECK(!ec, "cannot list {}: {}", model_dir, ec.message());
    DSV4_CHECK(!found.empty(), "no safetensors files in {}", model_dir);
    std::sort(found.begin(), found.end());
    for (const auto& p : found) add_file(p);
  }
  return ckpt;
}

const TensorView* Checkpoint::find(const std::string& name) const {
  auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : it->second;
}

uint64_t Checkpoint::total_bytes() const {
  uint64_t total = 0;
  for (const auto& [name, t] : by_name_) total += t->nbytes;
  return total;
}

void convert_to_f32(const TensorView& t, std::span<float> out) {
  const int64_t n = t.numel();
  DSV4_CHECK(out.size() == size_t(n), "convert_to_f32: tensor \"{}\" {} has {} elements but the output holds {}",
             t.name, t.shape_str(), n, out.size());
  DSV4_CHECK(t.nbytes == size_t(n) * dtype_size(t.dtype), "convert_to_f32: tensor \"{}\" has {} bytes, expected {}",
             t.name, t.nbytes, size_t(n) * dtype_size(t.dtype));
  const uint8_t* src = t.data;
  float* dst = out.data();
  if (n == 0) return;
  switch (t.dtype) {
    case DType::F32: std::memcpy(dst, src, size_t(n) * sizeof(float)); return;
    case DType::F64: decode_elements<double>(src, n, dst, [](double v) { return float(v); }); return;
    case DType::BF16: decode_elements<uint16_t>(src, n, dst, [](uint16_t b) { return bf16_to_f32(b); }); return;
    case DType::F16: decode_elements<uint16_t>(src, n, dst, [](uint16_t h) { return f16_to_f32(h); }); return;
    case DType::F8_E4M3: decode_bytes_via_table(src, n, dst, e4m3_to_f32); return;
    case DType::F8_E5M2: decode_bytes_via_table(src, n, dst, e5m2_to_f32); return;
    case DType::I64: decode_elements<int64_t>(src, n, dst, [](int64_t v) { return float(v); }); return;
    case DType::I32: decode_elements<int32_t>(src, n, dst, [](int32_t v) { return float(v); }); return;
    case DType::I16: decode_elements<int16_t>(src, n, dst, [](int16_t v) { return float(v); }); return;
    case DType::I8: decode_elements<int8_t>(src, n, dst, [](int8_t v) { return float(v); }); return;
    case DType::U8: decode_elements<uint8_t>(src, n, dst, [](uint8_t v) { return float(v); }); return;
    case DType::BOOL: decode_elements<uint8_t>(src, n, dst, [](uint8_t v) { return v ? 1.0f : 0.0f; }); return;
    case DType::F8_E8M0: break;
  }
  DSV4_FAIL("convert_to_f32: tensor \"{}\" in {} has dtype {}, which is a block-scale type; the weight loader "
            "decodes it together with its weight",
            t.name, t.file, dtype_name(t.dtype));
}

std::vector<float> to_f32(const TensorView& t) {
  std::vector<float> out(static_cast<size_t>(t.numel()));
  convert_to_f32(t, out);
  return out;
}

std::vector<int64_t> to_i64(const TensorView& t) {
  const int64_t n = t.numel();
  DSV4_CHECK(t.nbytes == size_t(n) * dtype_size(t.dtype), "to_i64: tensor \"{}\" has {} bytes, expected {}", t.name,
             t.nbytes, size_t(n) * dtype_size(t.dtype));
  std::vector<int64_t> out(static_cast<size_t>(n));
  const uint8_t* src = t.data;
  switch (t.dtype) {
    case DType::I64: widen_integers<int64_t>(src, n, out.data()); return out;
    case DType::I32: widen_integers<int32_t>(src, n, out.data()); return out;
    case DType::I16: widen_integers<int16_t>(src, n, out.data()); return out;
    case DType::I8: widen_integers<int8_t>(src, n, out.data()); return out;
    case DType::U8: widen_integers<uint8_t>(src, n, out.data()); return out;
    case DType::BOOL:
      for (int64_t i = 0; i < n; ++i) out[size_t(i)] = src[i] ? 1 : 0;
      return out;
    default: break;
  }
  DSV4_FAIL("to_i64: tensor \"{}\" in {} has dtype {}; expected an integer or BOOL tensor", t.name, t.file,
            dtype_name(t.dtype));
}

void write_safetensors(const std::string& path, const std::vector<TensorToWrite>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  std::vector<const TensorToWrite*> sorted;
  for (const auto& t : tensors) sorted.push_back(&t);
  std::sort(sorted.begin(), sorted.end(), [](auto* a, auto* b) { return a->name < b->name; });

  json header = json::object();
  uint64_t offset = 0;
  for (size_t i = 0; i < sorted.size(); ++i) {
    const TensorToWrite& t = *sorted[i];
    DSV4_CHECK(t.name != kMetadataKey, "write_safetensors {}: \"__metadata__\" is reserved, not a tensor name",
               path);
    DSV4_CHECK(i == 0 || sorted[i - 1]->name != t.name, "write_safetensors {}: tensor \"{}\" given twice", path,
               t.name);
    int64_t numel = 1;
    for (int64_t d : t.shape) {
      DSV4_CHECK(d >= 0, "write_safetensors {}: tensor \"{}\" has negative dimension {}", path, t.name, d);
      auto prod = checked_mul(numel, d);
      DSV4_CHECK(prod.has_value(), "write_safetensors {}: tensor \"{}\" shape overflows", path, t.name);
      numel = *prod;
    }
    const uint64_t expected = uint64_t(numel) * dtype_size(t.dtype);
    DSV4_CHECK(t.bytes.size() == expected,
               "write_safetensors {}: tensor \"{}\" shape [{}] x {} needs {} bytes, got {}", path, t.name,
               fmt::join(t.shape, ", "), dtype_name(t.dtype), expected, t.bytes.size());
    header[t.name] = {{"dtype", std::string(dtype_name(t.dtype))},
                      {"shape", t.shape},
                      {"data_offsets", {offset, offset + expected}}};
    offset += expected;
  }
  if (!metadata.empty()) header[kMetadataKey] = metadata;

  std::string header_text;
  try {
    header_text = header.dump();
  } catch (const json::exception& e) {
    DSV4_FAIL("write_safetensors {}: tensor names and metadata must be valid UTF-8 ({})", path, e.what());
  }
  // Pad with spaces so the data section starts 8-byte aligned (the reference writer does the same).
  header_text.append((8 - header_text.size() % 8) % 8, ' ');
  const uint64_t header_size = header_text.size();

  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  DSV4_CHECK(out.good(), "write_safetensors: cannot create {}: {}", path, std::strerror(errno));
  out.write(reinterpret_cast<const char*>(&header_size), sizeof(header_size));
  out.write(header_text.data(), std::streamsize(header_text.size()));
  for (const TensorToWrite* t : sorted)
    out.write(reinterpret_cast<const char*>(t->bytes.data()), std::streamsize(t->bytes.size()));
  out.close();
  DSV4_CHECK(out.good(), "write_safetensors: writing {} failed (disk full?)", path);
}

}  // namespace dsv4
