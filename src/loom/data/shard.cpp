#include "loom/data/shard.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "loom/core/error.h"
#include "loom/core/file_io.h"

namespace loom {

namespace {
constexpr uint64_t kMaxVocab = uint64_t{1} << 31;  // token ids are int32 in memory
constexpr const char* kDatasetFormat = "loom-token-dataset";
constexpr uint64_t kDatasetVersion = 1;

uint64_t shard_dtype_size(ShardDType dtype) { return dtype == SHARD_DTYPE_U16 ? 2 : 4; }
const char* shard_dtype_name(ShardDType dtype) { return dtype == SHARD_DTYPE_U16 ? "u16" : "u32"; }

// Little-endian encode/decode of the header and payload integers, independent of the host.
template <typename U>
void store_le(unsigned char* p, U v) {
  for (size_t i = 0; i < sizeof(U); ++i) p[i] = static_cast<unsigned char>(v >> (8 * i));
}
template <typename U>
U load_le(const unsigned char* p) {
  U v = 0;
  for (size_t i = 0; i < sizeof(U); ++i) v |= static_cast<U>(static_cast<U>(p[i]) << (8 * i));
  return v;
}

// Closes a file descriptor on every path out of a scope.
struct FdGuard {
  int fd;
  ~FdGuard() {
    if (fd >= 0) ::close(fd);
  }
};

void read_all(int fd, void* data, size_t bytes, const std::string& path) {
  char* p = static_cast<char*>(data);
  while (bytes > 0) {
    const ssize_t n = ::read(fd, p, bytes);
    if (n < 0 && errno == EINTR) continue;
    LOOM_CHECK(n >= 0, path, ": read failed: ", std::strerror(errno));
    LOOM_CHECK(n > 0, path, ": file shrank while being read");
    p += n;
    bytes -= static_cast<size_t>(n);
  }
}

// Reads and validates the shard at `path`, appending its tokens to `out`; returns vocab_size.
uint64_t read_shard_into(const std::string& path, std::vector<int32_t>& out) {
  FdGuard in{::open(path.c_str(), O_RDONLY | O_CLOEXEC)};
  LOOM_CHECK(in.fd >= 0 || errno != ENOENT, path, ": no such token shard");
  LOOM_CHECK(in.fd >= 0, path, ": cannot open token shard: ", std::strerror(errno));
  struct stat st {};
  LOOM_CHECK(::fstat(in.fd, &st) == 0, path, ": cannot stat: ", std::strerror(errno));
  LOOM_CHECK(S_ISREG(st.st_mode), path, ": not a regular file, expected a token shard");
  const auto size = static_cast<uint64_t>(st.st_size);
  LOOM_CHECK(size >= kShardHeaderBytes, path, ": truncated token shard: ", size, " bytes, expected at least the ",
             kShardHeaderBytes, "-byte header");

  unsigned char header[kShardHeaderBytes];
  read_all(in.fd, header, sizeof(header), path);
  LOOM_CHECK(std::memcmp(header, kShardMagic, sizeof(kShardMagic)) == 0, path,
             ": not a token shard (wrong magic, expected \"LOOMTOK\\0\")");
  const auto version = load_le<uint32_t>(header + 8);
  LOOM_CHECK(version == kShardVersion, path, ": unsupported token shard version ", version, ", expected ",
             kShardVersion);
  const auto dtype_code = load_le<uint32_t>(header + 12);
  LOOM_CHECK(dtype_code == SHARD_DTYPE_U16 || dtype_code == SHARD_DTYPE_U32, path, ": unknown token dtype code ",
             dtype_code, ", expected ", SHARD_DTYPE_U16, " (u16) or ", SHARD_DTYPE_U32, " (u32)");
  const auto dtype = static_cast<ShardDType>(dtype_code);
  const auto vocab_size = load_le<uint64_t>(header + 16);
  LOOM_CHECK(vocab_size >= 1 && vocab_size <= kMaxVocab, path, ": vocab size ", vocab_size, " out of range [1, ",
             kMaxVocab, "]");
  const auto count = load_le<uint64_t>(header + 24);
  const auto checksum = load_le<uint64_t>(header + 32);

  const uint64_t width = shard_dtype_size(dtype);
  const uint64_t payload_bytes = size - kShardHeaderBytes;
  LOOM_CHECK(payload_bytes % width == 0 && payload_bytes / width == count, path, ": file is ", size,
             " bytes, expected the ", kShardHeaderBytes, "-byte header + ", count, " ", shard_dtype_name(dtype),
             " tokens (truncated or corrupt token shard)");

  std::vector<unsigned char> payload(payload_bytes);
  read_all(in.fd, payload.data(), payload.size(), path);
  const uint64_t actual = XXH64(payload.data(), payload.size(), 0);
  LOOM_CHECK(actual == checksum, path, ": payload checksum mismatch (XXH64 ", actual, ", header says ", checksum,
             "): corrupt token shard");

  const size_t first = out.size();
  out.resize(first + count);
  for (uint64_t i = 0; i < count; ++i) {
    const unsigned char* p = payload.data() + i * width;
    const uint64_t id = dtype == SHARD_DTYPE_U16 ? load_le<uint16_t>(p) : load_le<uint32_t>(p);
    LOOM_CHECK(id < vocab_size, path, ": token ", i, " is ", id, ", expected < vocab size ", vocab_size);
    out[first + i] = static_cast<int32_t>(id);
  }
  return vocab_size;
}

void check_tokens_in_vocab(std::span<const int32_t> tokens, uint64_t vocab_size, const std::string& where) {
  for (size_t i = 0; i < tokens.size(); ++i) {
    LOOM_CHECK(tokens[i] >= 0 && static_cast<uint64_t>(tokens[i]) < vocab_size, where, ": token ", i, " is ",
               tokens[i], ", expected in [0, ", vocab_size, ")");
  }
}

std::string shard_file_name(const std::string& split, size_t index) {
  char name[64];
  std::snprintf(name, sizeof(name), "%s_%06zu.bin", split.c_str(), index);
  return name;
}

// Writes one split as shards of at most shard_tokens tokens; returns its meta.json entry.
nlohmann::json write_split(const std::filesystem::path& dir, const std::string& split, std::span<const int32_t> tokens,
                           uint64_t vocab_size, uint64_t shard_tokens) {
  nlohmann::json shards = nlohmann::json::array();
  for (size_t begin = 0, index = 0; begin < tokens.size(); begin += shard_tokens, ++index) {
    const size_t count = std::min<size_t>(shard_tokens, tokens.size() - begin);
    const std::string file = shard_file_name(split, index);
    write_shard((dir / file).string(), tokens.subspan(begin, count), vocab_size);
    shards.push_back({{"file", file}, {"tokens", count}});
  }
  return {{"tokens", tokens.size()}, {"shards", shards}};
}

// The mask's shards: the same format, a vocabulary of 2.
nlohmann::json write_mask(const std::filesystem::path& dir, const std::string& split, std::span<const uint8_t> mask,
                          uint64_t shard_tokens) {
  const std::vector<int32_t> bits(mask.begin(), mask.end());
  return write_split(dir, split + "_mask", bits, 2, shard_tokens)["shards"];
}

// meta.json accessors: each failure names the file and the key path.
const nlohmann::json& require(const nlohmann::json& obj, const char* key, const std::string& meta,
                              const std::string& where) {
  LOOM_CHECK(obj.is_object() && obj.contains(key), meta, ": missing key '", where, key, "'");
  return obj.at(key);
}
uint64_t require_u64(const nlohmann::json& obj, const char* key, const std::string& meta, const std::string& where) {
  const nlohmann::json& v = require(obj, key, meta, where);
  LOOM_CHECK(v.is_number_integer() && (v.is_number_unsigned() || v.get<int64_t>() >= 0), meta, ": key '", where, key,
             "' must be a non-negative integer");
  return v.get<uint64_t>();
}
std::string require_string(const nlohmann::json& obj, const char* key, const std::string& meta,
                           const std::string& where) {
  const nlohmann::json& v = require(obj, key, meta, where);
  LOOM_CHECK(v.is_string(), meta, ": key '", where, key, "' must be a string");
  return v.get<std::string>();
}

TokenSplit open_split(const std::filesystem::path& dir, const nlohmann::json& splits, const std::string& name,
                      uint64_t vocab_size, const std::string& meta) {
  const std::string where = "splits." + name + ".";
  const nlohmann::json& split = require(splits, name.c_str(), meta, "splits.");
  const uint64_t total = require_u64(split, "tokens", meta, where);
  const nlohmann::json& shards = require(split, "shards", meta, where);
  LOOM_CHECK(shards.is_array(), meta, ": key '", where, "shards' must be an array of {file, tokens}");
  // First every listed shard must exist; their sizes bound the reservation, so a corrupt count
  // in meta.json cannot ask for more memory than the files could hold.
  std::vector<std::string> paths;  // [shard]
  uint64_t payload_bytes = 0;
  for (size_t i = 0; i < shards.size(); ++i) {
    const std::string entry = str_cat(where, "shards[", i, "].");
    const std::string file = require_string(shards[i], "file", meta, entry);
    LOOM_CHECK(!file.empty() && file.find('/') == std::string::npos && file != "." && file != "..", meta, ": key '",
               entry, "file' is \"", file, "\", expected a file name inside the dataset directory");
    paths.push_back((dir / file).string());
    std::error_code ec;
    const uint64_t size = std::filesystem::file_size(paths.back(), ec);
    LOOM_CHECK(!ec, paths.back(), ": shard listed in ", meta, " is missing");
    payload_bytes += size;
  }
  TokenSplit out;
  out.name = name;
  out.tokens.reserve(std::min<uint64_t>(total, payload_bytes / 2));
  for (size_t i = 0; i < shards.size(); ++i) {
    const std::string& path = paths[i];
    const uint64_t count = require_u64(shards[i], "tokens", meta, str_cat(where, "shards[", i, "]."));
    const size_t before = out.tokens.size();
    const uint64_t shard_vocab = read_shard_into(path, out.tokens);
    LOOM_CHECK(shard_vocab == vocab_size, path, ": vocab size ", shard_vocab, ", but ", meta, " says ", vocab_size);
    LOOM_CHECK(out.tokens.size() - before == count, path, ": holds ", out.tokens.size() - before, " tokens, but ",
               meta, " says ", count);
  }
  LOOM_CHECK(out.tokens.size() == total, meta, ": split '", name, "' lists shards holding ", out.tokens.size(),
             " tokens, but its 'tokens' says ", total);
  if (split.contains("mask_shards")) {  // supervised data: one 0/1 per token (vocabulary 2)
    const nlohmann::json masks = {{name, {{"tokens", total}, {"shards", split.at("mask_shards")}}}};
    const TokenSplit bits = open_split(dir, masks, name, 2, meta);
    out.mask.assign(bits.tokens.begin(), bits.tokens.end());
  }
  return out;
}
}  // namespace

ShardDType shard_dtype_for_vocab(uint64_t vocab_size) {
  return vocab_size <= 65536 ? SHARD_DTYPE_U16 : SHARD_DTYPE_U32;
}

void write_shard(const std::string& path, std::span<const int32_t> tokens, uint64_t vocab_size) {
  LOOM_CHECK(vocab_size >= 1 && vocab_size <= kMaxVocab, path, ": vocab size ", vocab_size, " out of range [1, ",
             kMaxVocab, "]");
  check_tokens_in_vocab(tokens, vocab_size, path);
  const ShardDType dtype = shard_dtype_for_vocab(vocab_size);
  const uint64_t width = shard_dtype_size(dtype);

  std::vector<unsigned char> bytes(kShardHeaderBytes + tokens.size() * width, 0);
  unsigned char* payload = bytes.data() + kShardHeaderBytes;
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (dtype == SHARD_DTYPE_U16) store_le(payload + i * width, static_cast<uint16_t>(tokens[i]));
    else store_le(payload + i * width, static_cast<uint32_t>(tokens[i]));
  }
  std::memcpy(bytes.data(), kShardMagic, sizeof(kShardMagic));
  store_le(bytes.data() + 8, kShardVersion);
  store_le(bytes.data() + 12, static_cast<uint32_t>(dtype));
  store_le(bytes.data() + 16, vocab_size);
  store_le(bytes.data() + 24, static_cast<uint64_t>(tokens.size()));
  store_le(bytes.data() + 32, static_cast<uint64_t>(XXH64(payload, tokens.size() * width, 0)));
  write_file_atomic(path, std::string_view(reinterpret_cast<const char*>(bytes.data()), bytes.size()));
}

TokenShard read_shard(const std::string& path) {
  TokenShard shard;
  shard.vocab_size = read_shard_into(path, shard.tokens);
  return shard;
}

void write_dataset(const std::string& dir, std::span<const int32_t> tokens, uint64_t vocab_size,
                   const std::string& tokenizer_name, double val_fraction, uint64_t shard_tokens,
                   std::span<const uint8_t> mask) {
  LOOM_CHECK(val_fraction >= 0.0 && val_fraction < 1.0, dir, ": val_fraction is ", val_fraction,
             ", expected in [0, 1)");
  LOOM_CHECK(shard_tokens >= 1, dir, ": shard_tokens is 0, expected at least 1");
  LOOM_CHECK(!tokens.empty(), dir, ": no tokens to write");
  LOOM_CHECK(vocab_size >= 1 && vocab_size <= kMaxVocab, dir, ": vocab size ", vocab_size, " out of range [1, ",
             kMaxVocab, "]");
  check_tokens_in_vocab(tokens, vocab_size, str_cat(dir, ": input stream"));

  const std::filesystem::path root(dir);
  std::error_code ec;
  std::filesystem::create_directories(root, ec);
  LOOM_CHECK(!ec && std::filesystem::is_directory(root), dir, ": cannot create dataset directory: ", ec.message());

  // An interrupted rewrite must not leave an old meta.json describing a mix of old and new shards.
  const std::filesystem::path meta_path = root / "meta.json";
  std::filesystem::remove(meta_path, ec);
  LOOM_CHECK(!ec, meta_path.string(), ": cannot remove the previous dataset description: ", ec.message());

  const auto val_tokens = static_cast<size_t>(std::floor(static_cast<double>(tokens.size()) * val_fraction));
  const size_t train_tokens = tokens.size() - val_tokens;
  nlohmann::json meta = {
      {"format", kDatasetFormat},
      {"version", kDatasetVersion},
      {"tokenizer", tokenizer_name},
      {"vocab_size", vocab_size},
      {"val_fraction", val_fraction},
      {"shard_tokens", shard_tokens},
      {"splits",
       {{"train", write_split(root, "train", tokens.first(train_tokens), vocab_size, shard_tokens)},
        {"val", write_split(root, "val", tokens.subspan(train_tokens), vocab_size, shard_tokens)}}}};
  if (!mask.empty()) {
    LOOM_CHECK(mask.size() == tokens.size(), dir, ": ", mask.size(), " mask values for ", tokens.size(), " tokens");
    meta["splits"]["train"]["mask_shards"] = write_mask(root, "train", mask.first(train_tokens), shard_tokens);
    meta["splits"]["val"]["mask_shards"] = write_mask(root, "val", mask.subspan(train_tokens), shard_tokens);
  }
  const std::string text = meta.dump(2) + "\n";
  write_file_atomic(meta_path.string(), text);
}

TokenDataset open_dataset(const std::string& dir) {
  const std::filesystem::path root(dir);
  LOOM_CHECK(std::filesystem::is_directory(root), dir, ": dataset directory not found (write one with loom prepare)");
  const std::string meta_path = (root / "meta.json").string();
  LOOM_CHECK(std::filesystem::exists(meta_path), meta_path,
             ": missing dataset description (write one with loom prepare)");

  std::ifstream in(meta_path);
  LOOM_CHECK(in, meta_path, ": cannot open: ", std::strerror(errno));
  nlohmann::json meta;
  try {
    meta = nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception& e) {
    throw Error(str_cat(meta_path, ": not valid JSON (", e.what(), ")"));
  }
  const std::string format = require_string(meta, "format", meta_path, "");
  LOOM_CHECK(format == kDatasetFormat, meta_path, ": key 'format' is \"", format, "\", expected \"", kDatasetFormat,
             "\"");
  const uint64_t version = require_u64(meta, "version", meta_path, "");
  LOOM_CHECK(version == kDatasetVersion, meta_path, ": unsupported dataset version ", version, ", expected ",
             kDatasetVersion);

  TokenDataset ds;
  ds.dir = dir;
  ds.tokenizer = require_string(meta, "tokenizer", meta_path, "");
  ds.vocab_size = require_u64(meta, "vocab_size", meta_path, "");
  const nlohmann::json& splits = require(meta, "splits", meta_path, "");
  ds.train = open_split(root, splits, "train", ds.vocab_size, meta_path);
  ds.val = open_split(root, splits, "val", ds.vocab_size, meta_path);
  return ds;
}

}  // namespace loom
