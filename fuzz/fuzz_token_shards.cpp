// libFuzzer target: a token dataset folder (data/shard.h) as `loom prepare` writes it and
// `loom train` reads it: the input is a FileSet (fuzz_input.h) whose first file is meta.json and
// whose further files are its shards ("==> train_000000.bin <==" ...). open_dataset on the folder,
// and read_shard on each .bin file, must succeed or throw loom::Error; anything else is a finding,
// and so is a broken promise of the format: a token outside [0, vocab_size), a vocab_size outside
// [1, 2^31], a token count that is not the file's payload, a mask that is not one 0/1 per token,
// or a shard that write_shard does not write back to the same tokens (and, stored in the dtype
// write_shard picks, the same header and payload bytes).
#include <xxhash.h>

#include <cstring>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "fuzz_input.h"
#include "json_mutator.h"
#include "loom/core/error.h"
#include "loom/data/shard.h"

namespace {

constexpr uint64_t kMaxVocab = uint64_t{1} << 31;  // shard.cpp's bound: ids are int32 in memory

// The header's little-endian fields (shard.h).
uint64_t load_le(const std::string& b, size_t at, size_t bytes) {
  uint64_t v = 0;
  for (size_t i = 0; i < bytes; ++i) v |= static_cast<uint64_t>(static_cast<unsigned char>(b[at + i])) << (8 * i);
  return v;
}
uint64_t load_u64(const std::string& b, size_t at) { return load_le(b, at, 8); }
uint32_t load_u32(const std::string& b, size_t at) { return static_cast<uint32_t>(load_le(b, at, 4)); }
void store_u64(std::string& b, size_t at, uint64_t v) {
  for (size_t i = 0; i < 8; ++i) b[at + i] = static_cast<char>(v >> (8 * i));
}
void store_u32(std::string& b, size_t at, uint32_t v) {
  for (size_t i = 0; i < 4; ++i) b[at + i] = static_cast<char>(v >> (8 * i));
}

bool is_shard(const std::string& bytes) {
  return bytes.size() >= loom::kShardHeaderBytes && std::memcmp(bytes.data(), loom::kShardMagic, 8) == 0;
}

// A shard's header made to agree with its payload (the token count for a known dtype, then the
// checksum), so that mutations reach the token checks behind the checksum.
void repair_shard(std::string& bytes) {
  if (!is_shard(bytes)) return;
  const uint32_t dtype = load_u32(bytes, 12);
  const uint64_t payload = bytes.size() - loom::kShardHeaderBytes;
  if (dtype == loom::SHARD_DTYPE_U16 || dtype == loom::SHARD_DTYPE_U32) {
    const uint64_t width = dtype == loom::SHARD_DTYPE_U16 ? 2 : 4;
    bytes.resize(loom::kShardHeaderBytes + payload / width * width);
    store_u64(bytes, 24, payload / width);
  }
  store_u64(bytes, 32, XXH64(bytes.data() + loom::kShardHeaderBytes, bytes.size() - loom::kShardHeaderBytes, 0));
}

// meta.json's token counts made to agree with the shards' headers, each split's total with its
// shards' sum, and vocab_size with the first shard's.
std::optional<std::string> sync_meta(const loom_fuzz::FileSet& files) {
  nlohmann::json meta = nlohmann::json::parse(files[0].bytes, nullptr, false);
  if (!meta.is_object() || !meta.contains("splits") || !meta["splits"].is_object()) return std::nullopt;
  auto count_of = [&](const nlohmann::json& name) -> std::optional<uint64_t> {
    if (!name.is_string()) return std::nullopt;
    for (auto it = files.rbegin(); it != files.rend(); ++it) {
      if (it->name == name.get<std::string>()) {
        if (!is_shard(it->bytes)) return std::nullopt;
        if (!meta.contains("vocab_size") || !meta["vocab_size"].is_number_unsigned())
          meta["vocab_size"] = load_u64(it->bytes, 16);
        return load_u64(it->bytes, 24);
      }
    }
    return std::nullopt;
  };
  for (auto& [split_name, split] : meta["splits"].items()) {
    for (const char* list : {"shards", "mask_shards"}) {
      if (!split.is_object() || !split.contains(list) || !split[list].is_array()) continue;
      uint64_t total = 0;
      for (nlohmann::json& shard : split[list]) {
        if (!shard.is_object() || !shard.contains("file")) continue;
        if (const std::optional<uint64_t> n = count_of(shard["file"])) shard["tokens"] = *n;
        if (shard.contains("tokens") && shard["tokens"].is_number_unsigned()) total += shard["tokens"].get<uint64_t>();
      }
      if (std::strcmp(list, "shards") == 0) split["tokens"] = total;
    }
  }
  try {
    return meta.dump(1);
  } catch (const nlohmann::json::exception&) {
    return std::nullopt;
  }
}

// One shard read on its own, then written back and read again.
void check_shard(const loom_fuzz::ScratchDir& scratch, const std::string& name, const std::string& bytes) {
  loom::TokenShard shard;
  try {
    shard = loom::read_shard((std::filesystem::path(scratch.path()) / name).string());
  } catch (const loom::Error&) {
    return;
  }
  using loom_fuzz::require;
  require(shard.vocab_size >= 1 && shard.vocab_size <= kMaxVocab, "a shard that reads has vocab_size in [1, 2^31]");
  for (const int32_t t : shard.tokens)
    require(t >= 0 && static_cast<uint64_t>(t) < shard.vocab_size, "a shard's tokens are in [0, vocab_size)");
  const uint32_t dtype = load_u32(bytes, 12);
  const uint64_t width = dtype == loom::SHARD_DTYPE_U16 ? 2 : 4;
  require(bytes.size() == loom::kShardHeaderBytes + shard.tokens.size() * width,
          "a shard's size is the header + count tokens");

  const std::string copy = (std::filesystem::path(scratch.path()) / "rewritten.bin.out").string();
  loom::write_shard(copy, shard.tokens, shard.vocab_size);
  const loom::TokenShard back = loom::read_shard(copy);
  require(back.vocab_size == shard.vocab_size && back.tokens == shard.tokens,
          "write_shard writes back the same tokens");
  if (dtype == loom::shard_dtype_for_vocab(shard.vocab_size)) {
    std::ifstream in(copy, std::ios::binary);
    const std::string written((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    // Bytes 40..63 are reserved: written as zero, ignored on read.
    require(written.size() == bytes.size() && written.compare(0, 40, bytes, 0, 40) == 0 &&
                written.compare(loom::kShardHeaderBytes, std::string::npos, bytes, loom::kShardHeaderBytes) == 0,
            "write_shard writes the bytes it read (header and payload)");
  }
  std::filesystem::remove(copy);
}

void check_split(const loom::TokenSplit& split, uint64_t vocab_size) {
  using loom_fuzz::require;
  for (const int32_t t : split.tokens)
    require(t >= 0 && static_cast<uint64_t>(t) < vocab_size, "a dataset's tokens are in [0, vocab_size)");
  require(split.mask.empty() || split.mask.size() == split.tokens.size(), "a split's mask has one value per token");
  for (const uint8_t m : split.mask) require(m <= 1, "a split's mask values are 0 or 1");
}

}  // namespace

extern "C" size_t LLVMFuzzerMutate(uint8_t* data, size_t size, size_t max_size);

// Half of the mutations change one file of the set: meta.json as JSON (json_mutator.h), a shard's
// bytes by libFuzzer or one header field to an edge value; then, mostly, the shards' headers and
// meta.json's counts are made to agree again, so the reader gets past its consistency checks.
extern "C" size_t LLVMFuzzerCustomMutator(uint8_t* data, size_t size, size_t max_size, unsigned int seed) {
  static const loom_fuzz::JsonWords words{
      {"format", "version", "tokenizer", "vocab_size", "val_fraction", "shard_tokens", "splits", "train", "val",
       "tokens", "shards", "mask_shards", "file"},
      {"loom-token-dataset", "gpt2", "train_000000.bin", "val_000000.bin", "train_mask_000000.bin",
       "val_mask_000000.bin", "", ".", "..", "meta.json", "train"}};
  if (seed % 2 == 0) {
    std::mt19937_64 rng(seed / 2);
    loom_fuzz::FileSet files = loom_fuzz::split_files({reinterpret_cast<const char*>(data), size}, "meta.json");
    loom_fuzz::NamedFile& f = files[rng() % files.size()];
    if (&f == &files[0]) {
      if (std::optional<std::string> changed = loom_fuzz::mutate_json(f.bytes, rng(), words))
        f.bytes = std::move(*changed);
    } else if (is_shard(f.bytes) && rng() % 2 == 0) {
      static constexpr uint64_t kEdges[] = {0, 1, 2, 255, 256, 65535, 65536, 65537, kMaxVocab, kMaxVocab + 1,
                                            uint64_t{1} << 32, ~uint64_t{0}};
      const uint64_t edge = kEdges[rng() % std::size(kEdges)];
      switch (rng() % 4) {
        case 0: store_u32(f.bytes, 8, static_cast<uint32_t>(edge)); break;   // version
        case 1: store_u32(f.bytes, 12, static_cast<uint32_t>(edge)); break;  // dtype
        case 2: store_u64(f.bytes, 16, edge); break;                          // vocab_size
        default: store_u64(f.bytes, 24, edge); break;                         // count
      }
    } else {
      std::vector<uint8_t> buffer(f.bytes.begin(), f.bytes.end());
      buffer.resize(std::max<size_t>(buffer.size() * 2, 128));
      buffer.resize(LLVMFuzzerMutate(buffer.data(), f.bytes.size(), buffer.size()));
      f.bytes.assign(buffer.begin(), buffer.end());
    }
    if (rng() % 4 != 0) {
      for (size_t i = 1; i < files.size(); ++i) repair_shard(files[i].bytes);
      if (std::optional<std::string> meta = sync_meta(files)) files[0].bytes = std::move(*meta);
    }
    if (const size_t n = loom_fuzz::emit(loom_fuzz::join_files(files), data, max_size)) return n;
  }
  return LLVMFuzzerMutate(data, size, max_size);
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const loom_fuzz::ScratchDir scratch;
  const loom_fuzz::FileSet files = loom_fuzz::split_files({reinterpret_cast<const char*>(data), size}, "meta.json");
  loom_fuzz::write_files(scratch, files);
  try {
    const loom::TokenDataset ds = loom::open_dataset(scratch.path());
    check_split(ds.train, ds.vocab_size);
    check_split(ds.val, ds.vocab_size);
    loom_fuzz::require(ds.train.name == "train" && ds.val.name == "val", "the splits are named train and val");
  } catch (const loom::Error&) {
  }
  // Each shard as its own file (the last of a name is the one on disk).
  for (size_t i = 1; i < files.size(); ++i) {
    bool last = true;
    for (size_t j = i + 1; j < files.size(); ++j) last = last && files[j].name != files[i].name;
    if (last && files[i].name.ends_with(".bin")) check_shard(scratch, files[i].name, files[i].bytes);
  }
  return 0;
}
