// SPDX-License-Identifier: MIT
#include "tokenizer/tokenizer.h"

#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <unordered_set>

#include "core/check.h"
#include "tokenizer/added_tokens.h"
#include "tokenizer/bpe.h"
#include "tokenizer/pretokenizer.h"
#include "tokenizer/utf8.h"

namespace dsv4 {

struct Tokenizer::Impl {
  BpeModel model;
  AddedVocabulary added;
  PreTokenizer pre_tokenizer;
  // Per id: what decode() emits, its spelling, and flags. Holes (ids that are no token) are absent.
  std::vector<std::string> id_bytes;
  std::vector<uint8_t> id_flags;  // kExists | kSpecial
  static constexpr uint8_t kExists = 1, kSpecial = 2;
  std::optional<int32_t> bos, eos;
  bool add_bos = false;
};

namespace {

nlohmann::json read_json(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  DSV4_CHECK(in, "cannot open {}", path.string());
  std::stringstream ss;
  ss << in.rdbuf();
  try {
    return nlohmann::json::parse(ss.str());
  } catch (const nlohmann::json::exception& e) {
    DSV4_FAIL("{} is not valid JSON: {}", path.string(), e.what());
  }
}

// tokenizer_config.json spells bos/eos either as a string or as an AddedToken object.
std::optional<std::string> config_token(const nlohmann::json& config, const char* field) {
  if (!config.contains(field)) return std::nullopt;
  const auto& v = config[field];
  if (v.is_string()) return v.get<std::string>();
  if (v.is_object() && v.contains("content")) return v["content"].get<std::string>();
  return std::nullopt;
}

void check_normalizer(const nlohmann::json& n) {
  if (n.is_null()) return;
  const std::string type = n.value("type", "");
  DSV4_CHECK(type == "Sequence" && n.value("normalizers", nlohmann::json::array()).empty(),
             "tokenizer.json: normalizer {} is not supported (DeepSeek tokenizers have none or an empty Sequence)",
             n.dump());
}

void check_decoder(const nlohmann::json& d) {
  DSV4_CHECK(d.is_object() && d.value("type", "") == "ByteLevel",
             "tokenizer.json: decoder must be ByteLevel for a byte-level BPE, got {}", d.dump());
}

}  // namespace

Tokenizer Tokenizer::load(const std::string& path_or_dir) {
  namespace fs = std::filesystem;
  fs::path json_path = path_or_dir;
  DSV4_CHECK(fs::exists(json_path), "tokenizer path {} does not exist", path_or_dir);
  if (fs::is_directory(json_path)) json_path /= "tokenizer.json";
  DSV4_CHECK(fs::is_regular_file(json_path), "no tokenizer.json at {} (pass a tokenizer.json or a model directory)",
             json_path.string());

  const nlohmann::json j = read_json(json_path);
  auto impl = std::make_shared<Impl>();
  try {
    check_normalizer(j.value("normalizer", nlohmann::json()));
    check_decoder(j.value("decoder", nlohmann::json()));
    impl->model = BpeModel::from_json(j.at("model"));
    impl->added = AddedVocabulary::from_json(j.value("added_tokens", nlohmann::json::array()), impl->model);
    impl->pre_tokenizer = PreTokenizer::from_json(j.value("pre_tokenizer", nlohmann::json()));
  } catch (const nlohmann::json::exception& e) {
    DSV4_FAIL("{}: unexpected structure: {}", json_path.string(), e.what());
  } catch (const Error& e) {
    DSV4_FAIL("{}: {}", json_path.string(), e.what());
  }

  // The decode table. HF's ByteLevel decoder maps a spelling back to bytes when every code point is
  // in the byte alphabet and otherwise emits the spelling's own UTF-8 (e.g. <｜User｜>).
  int32_t n = impl->model.size();
  for (const AddedToken& t : impl->added.tokens()) n = std::max(n, t.id + 1);
  impl->id_bytes.assign(n, std::string());
  impl->id_flags.assign(n, 0);
  std::unordered_set<std::string> special_contents;
  for (const AddedToken& t : impl->added.tokens()) {
    if (t.special) special_contents.insert(t.content);
  }
  auto set_entry = [&](int32_t id, const std::string& spelling) {
    auto bytes = byte_level_to_bytes(spelling);
    impl->id_bytes[id] = bytes ? std::move(*bytes) : spelling;
    impl->id_flags[id] = Impl::kExists | (special_contents.count(spelling) ? Impl::kSpecial : 0);
  };
  for (int32_t id = 0; id < impl->model.size(); ++id) {
    if (!impl->model.spelling(id).empty()) set_entry(id, impl->model.spelling(id));
  }
  for (const AddedToken& t : impl->added.tokens()) set_entry(t.id, t.content);  // added wins, as in HF

  fs::path config_path = json_path.parent_path() / "tokenizer_config.json";
  if (fs::is_regular_file(config_path)) {
    const nlohmann::json config = read_json(config_path);
    Tokenizer probe(impl);
    if (auto s = config_token(config, "bos_token")) {
      impl->bos = probe.token_id(*s);
      DSV4_CHECK(impl->bos, "{}: bos_token `{}` is not a token of {}", config_path.string(), *s, json_path.string());
    }
    if (auto s = config_token(config, "eos_token")) {
      impl->eos = probe.token_id(*s);
      DSV4_CHECK(impl->eos, "{}: eos_token `{}` is not a token of {}", config_path.string(), *s, json_path.string());
    }
    impl->add_bos = config.value("add_bos_token", false);
  }
  return Tokenizer(std::move(impl));
}

std::vector<int32_t> Tokenizer::encode(std::string_view text, bool allow_special) const {
  std::string repaired;
  if (!utf8::is_valid(text)) {
    repaired = utf8::sanitize(text);
    text = repaired;
  }
  std::vector<int32_t> ids;
  ids.reserve(text.size() / 3 + 1);
  std::vector<AddedVocabulary::Segment> segments;
  impl_->added.split(text, allow_special, segments);
  std::vector<std::string_view> pieces;
  for (const auto& seg : segments) {
    if (seg.token >= 0) {
      ids.push_back(seg.token);
      continue;
    }
    impl_->pre_tokenizer.split(text.substr(seg.begin, seg.end - seg.begin), pieces);
    for (std::string_view piece : pieces) impl_->model.encode(piece, ids);
  }
  return ids;
}

void Tokenizer::append_token_bytes(int32_t id, bool skip_special, std::string& out) const {
  if (id < 0 || id >= static_cast<int32_t>(impl_->id_flags.size())) return;
  const uint8_t flags = impl_->id_flags[id];
  if (!(flags & Impl::kExists) || (skip_special && (flags & Impl::kSpecial))) return;
  out += impl_->id_bytes[id];
}

std::string Tokenizer::decode(std::span<const int32_t> ids, bool skip_special) const {
  std::string bytes;
  for (int32_t id : ids) append_token_bytes(id, skip_special, bytes);
  return utf8::is_valid(bytes) ? bytes : utf8::sanitize(bytes);
}

int32_t Tokenizer::vocab_size() const { return static_cast<int32_t>(impl_->id_flags.size()); }

std::optional<int32_t> Tokenizer::token_id(std::string_view token) const {
  if (const AddedToken* t = impl_->added.find(token)) return t->id;
  return impl_->model.find(token);
}

std::optional<std::string> Tokenizer::id_to_token(int32_t id) const {
  if (id < 0 || id >= vocab_size() || !(impl_->id_flags[id] & Impl::kExists)) return std::nullopt;
  for (const AddedToken& t : impl_->added.tokens()) {
    if (t.id == id) return t.content;
  }
  return impl_->model.spelling(id);
}

bool Tokenizer::is_special(int32_t id) const {
  return id >= 0 && id < vocab_size() && (impl_->id_flags[id] & Impl::kSpecial);
}

std::optional<int32_t> Tokenizer::bos_id() const { return impl_->bos; }
std::optional<int32_t> Tokenizer::eos_id() const { return impl_->eos; }
bool Tokenizer::add_bos_token() const { return impl_->add_bos; }

std::string StreamDecoder::push(int32_t id) {
  tokenizer_->append_token_bytes(id, skip_special_, pending_);
  const size_t n = utf8::complete_prefix_length(pending_);
  std::string out = utf8::sanitize(std::string_view(pending_).substr(0, n));
  pending_.erase(0, n);
  return out;
}

std::string StreamDecoder::finish() {
  std::string out = utf8::sanitize(pending_);
  pending_.clear();
  return out;
}

}  // namespace dsv4
