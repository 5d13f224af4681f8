// Token shards and the dataset directory that lists them.
//
// A shard (.bin) is a 64-byte header followed by the token payload. Every integer is
// little-endian, whatever the host:
//
//   offset  bytes  field
//   0       8      magic "LOOMTOK\0"
//   8       4      format version, u32 (kShardVersion)
//   12      4      token dtype, u32: SHARD_DTYPE_U16 (1) when vocab_size <= 65536, else SHARD_DTYPE_U32 (2)
//   16      8      vocab_size, u64: every token id is < vocab_size
//   24      8      token count, u64
//   32      8      XXH64 (seed 0) of the payload bytes, u64
//   40      24     reserved, written as zero, ignored on read
//   64      count * dtype size   the tokens
//
// A file is valid only if its size is exactly 64 + count * dtype size, so a truncated or
// appended-to file is caught before the checksum is even computed.
//
// A dataset is a directory written by write_dataset (`loom prepare`):
//
//   meta.json            {"format": "loom-token-dataset", "version": 1, "tokenizer": "gpt2",
//                         "vocab_size": 50257, "val_fraction": 0.01, "shard_tokens": 100000000,
//                         "splits": {"train": {"tokens": N, "shards": [{"file": "train_000000.bin",
//                                                                       "tokens": n0}, ...]},
//                                    "val":   {"tokens": M, "shards": [...]}}}
//   train_000000.bin ... one shard per shard_tokens tokens of the training split
//   val_000000.bin ...   the same for the validation split
//
// The validation split is the LAST val_fraction of the token stream (floor(n * val_fraction)
// tokens), the training split is everything before it: a contiguous tail keeps documents whole
// (no document straddles the two splits except at the one cut) and makes the split independent
// of the seed. meta.json is written last, so a directory without it is an incomplete write.
#pragma once
#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace loom {

inline constexpr char kShardMagic[8] = {'L', 'O', 'O', 'M', 'T', 'O', 'K', '\0'};
inline constexpr uint32_t kShardVersion = 1;
inline constexpr uint64_t kShardHeaderBytes = 64;

enum ShardDType : uint32_t { SHARD_DTYPE_U16 = 1, SHARD_DTYPE_U32 = 2 };

// The dtype a shard of this vocabulary is stored in: u16 when every id fits, else u32.
ShardDType shard_dtype_for_vocab(uint64_t vocab_size);

struct TokenShard {
  uint64_t vocab_size = 0;
  std::vector<int32_t> tokens;  // [token count]
};

// Writes `tokens` (each in [0, vocab_size)) atomically: a temporary file in the same directory,
// fsync, rename over `path`, fsync of the directory. vocab_size must be in [1, 2^31].
void write_shard(const std::string& path, std::span<const int32_t> tokens, uint64_t vocab_size);

// Reads and validates a shard; each failure is a loom::Error naming `path`: missing file,
// truncated/oversized file, wrong magic, unsupported version, unknown dtype, checksum
// mismatch, token id >= vocab_size.
TokenShard read_shard(const std::string& path);

// One split of a dataset, its shards concatenated in order.
struct TokenSplit {
  std::string name;             // "train" or "val": error messages name it
  std::vector<int32_t> tokens;  // [token count]
  // Supervised data (data/sft.h): [token count], 1 where predicting the token counts; empty:
  // every token counts.
  std::vector<uint8_t> mask;
  // Packed documents (data.document_mask): the token ending each document (the tokenizer's
  // end-of-text token), set by whoever opens the split for it; -1: batches are plain windows.
  int32_t document_end = -1;
};

struct TokenDataset {
  std::string dir;
  std::string tokenizer;
  uint64_t vocab_size = 0;
  TokenSplit train;
  TokenSplit val;  // empty when the dataset was written with val_fraction 0
};

// Splits `tokens` into train (the first part) and val (the last floor(n * val_fraction)
// tokens), writes each as shards of at most shard_tokens tokens into `dir` (created if
// needed), then meta.json. val_fraction must be in [0, 1); shard_tokens >= 1. A `mask` (one
// 0/1 per token, supervised data) is written beside them as shards of the same format with a
// vocabulary of 2 (<split>_mask_NNNNNN.bin, listed under the split's "mask_shards").
void write_dataset(const std::string& dir, std::span<const int32_t> tokens, uint64_t vocab_size,
                   const std::string& tokenizer_name, double val_fraction, uint64_t shard_tokens,
                   std::span<const uint8_t> mask = {});

// Loads and validates a dataset directory: errors name the missing directory, meta.json, the
// offending key, or the listed shard that is missing or disagrees with meta.json.
TokenDataset open_dataset(const std::string& dir);

}  // namespace loom
