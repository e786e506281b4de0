// SPDX-License-Identifier: MIT
// Read-only access to HF safetensors checkpoints through mmap. A Checkpoint is a model directory:
// either one `model.safetensors` or a sharded `model.safetensors.index.json` (weight_map name -> file),
// or as a fallback every `*.safetensors` file in the directory. Every header is validated on open
// (JSON syntax, known dtype, shape x dtype size == byte range, ranges inside the file and not
// overlapping, data section fully covered); any problem throws dsv4::Error naming the file and tensor.
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "core/dtype.h"

namespace dsv4 {

// A tensor inside a mapped file. Non-owning: valid while its SafetensorsFile / Checkpoint lives.
struct TensorView {
  std::string name;
  DType dtype = DType::F32;
  std::vector<int64_t> shape;   // outer -> inner, as stored
  const uint8_t* data = nullptr;
  size_t nbytes = 0;
  std::string file;             // path of the file holding it (for error messages)

  int64_t numel() const;
  std::string shape_str() const;  // "[4, 16]"
};

class SafetensorsFile {
 public:
  static std::unique_ptr<SafetensorsFile> open(const std::string& path);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  const std::vector<TensorView>& tensors() const { return tensors_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

 private:
  SafetensorsFile() = default;
  std::string path_;
  void* map_ = nullptr;
  size_t map_size_ = 0;
  std::vector<TensorView> tensors_;
  std::map<std::string, std::string> metadata_;
};

class Checkpoint {
 public:
  static Checkpoint open(const std::string& model_dir);

  // nullptr when absent.
  const TensorView* find(const std::string& name) const;
  const std::map<std::string, const TensorView*>& tensors() const { return by_name_; }
  const std::string& dir() const { return dir_; }
  uint64_t total_bytes() const;

 private:
  std::string dir_;
  std::vector<std::shared_ptr<SafetensorsFile>> files_;
  std::map<std::string, const TensorView*> by_name_;
};

// Decode one element type to fp32 (F32, F64, BF16, F16, F8_E4M3 (fn: max 448, 0x7F/0xFF NaN), F8_E5M2,
// I64/I32/I16/I8/U8 as integers, BOOL as 0/1). Quantised weights with scales are decoded by the weight
// loader, not here: F8_E8M0 throws. convert_to_f32 needs out.size() == t.numel().
void convert_to_f32(const TensorView& t, std::span<float> out);
std::vector<float> to_f32(const TensorView& t);
std::vector<int64_t> to_i64(const TensorView& t);  // integer tensors only

// Write a safetensors file (used by tests and `dsv4 quantize`).
struct TensorToWrite {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  std::span<const uint8_t> bytes;
};
void write_safetensors(const std::string& path, const std::vector<TensorToWrite>& tensors,
                       const std::map<std::string, std::string>& metadata = {});

}  // namespace dsv4
