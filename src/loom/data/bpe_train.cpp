// Byte-level BPE training (Sennrich, Haddow & Birch 2016, "Neural Machine Translation of Rare
// Words with Subword Units"; byte-level as in GPT-2, Radford et al. 2019), writing GPT-2's format.
//
//   1. Split the text with GPT-2's pre-tokenizer (unicode.h) and count each distinct piece, a
//      "word": merges never cross a piece boundary, exactly as at encoding time.
//   2. Every word starts as its bytes; the vocabulary starts as the 256 one-byte tokens, with
//      ids in GPT-2's order (by the byte's code point in bytes_to_unicode's alphabet).
//   3. Repeat until the vocabulary is full: the most frequent adjacent pair of symbols (a, b),
//      counted over all words weighted by their frequency, becomes the token ab; every
//      occurrence of a b (left to right) is replaced by ab and "a b" is appended to the merges.
//      Ties go to the pair whose (bytes of a, bytes of b) is lexicographically smallest, so the
//      result depends only on the text and the size.
//   Stops early when no pair occurs twice. The end-of-text token takes the last id.
//
// Incremental counting: the count of every pair and, per pair, the words it occurs in are kept
// across merges. A merge revisits only the words listed for its pair and applies the change of
// their pair counts (-count for the pairs a word had, +count for the pairs it has now); the
// largest count comes from a max-heap with lazy deletion (an entry whose count is out of date
// is re-pushed with the current count when it surfaces). A step costs O(occurrences of the
// pair), not a recount of the corpus.
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>
#include <filesystem>
#include <queue>
#include <unordered_map>

#include "loom/core/error.h"
#include "loom/core/file_io.h"
#include "loom/data/bpe.h"
#include "loom/data/unicode.h"

namespace loom {
namespace {

uint64_t pair_key(int32_t left, int32_t right) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(left)) << 32) | static_cast<uint32_t>(right);
}
int32_t pair_left(uint64_t key) { return static_cast<int32_t>(key >> 32); }
int32_t pair_right(uint64_t key) { return static_cast<int32_t>(key & 0xFFFFFFFFu); }

struct Word {
  std::vector<int32_t> symbols;  // (current length) token ids
  int64_t count = 0;             // occurrences in the text
};

struct HeapEntry {
  int64_t count;
  uint64_t pair;
};

class BpeTrainer {
 public:
  explicit BpeTrainer(std::string_view text);
  // Learns merges until the vocabulary (with end of text) has `vocab_size` tokens or no pair
  // occurs twice.
  void learn(int64_t vocab_size);
  std::string encoder_json() const;
  std::string merges_text() const;
  int64_t vocab_size_with_eot() const { return static_cast<int64_t>(token_bytes_.size()) + 1; }
  int64_t merge_count() const { return static_cast<int64_t>(merges_.size()); }

 private:
  // Max-heap order: higher count first, then the lexicographically smaller (left, right) bytes.
  bool heap_less(const HeapEntry& x, const HeapEntry& y) const;
  void count_initial_pairs();
  void push(int64_t count, uint64_t pair);
  int32_t token_for(const std::string& bytes);
  void merge(uint64_t pair, int32_t merged, int64_t step);
  bool merge_word(Word& word, int32_t left, int32_t right, int32_t merged);

  std::vector<Word> words_;                                      // [word], sorted by bytes
  std::vector<std::string> token_bytes_;                          // [id] -> raw bytes
  std::unordered_map<std::string, int32_t> token_ids_;            // [raw bytes] -> id
  std::vector<uint64_t> merges_;                                  // [rank] -> (left, right) pair
  std::unordered_map<uint64_t, int64_t> pair_counts_;             // [pair] -> weighted count
  std::unordered_map<uint64_t, std::vector<int32_t>> pair_words_; // [pair] -> words it was seen in
  std::vector<HeapEntry> heap_;                                   // max-heap by heap_less
  std::vector<int64_t> word_stamp_;                               // [word] -> last step that merged it
  std::unordered_map<uint64_t, int64_t> step_delta_;              // [pair] -> count change this step
};

BpeTrainer::BpeTrainer(std::string_view text) {
  const std::array<char32_t, 256> alphabet = gpt2_byte_alphabet();
  std::array<int, 256> by_code_point{};  // [id] -> byte
  for (int b = 0; b < 256; ++b) by_code_point[static_cast<size_t>(b)] = b;
  std::sort(by_code_point.begin(), by_code_point.end(),
            [&](int x, int y) { return alphabet[static_cast<size_t>(x)] < alphabet[static_cast<size_t>(y)]; });
  std::array<int32_t, 256> byte_token{};  // [byte] -> id
  for (int32_t id = 0; id < 256; ++id) {
    const int b = by_code_point[static_cast<size_t>(id)];
    byte_token[static_cast<size_t>(b)] = id;
    token_bytes_.emplace_back(1, static_cast<char>(b));
    token_ids_.emplace(token_bytes_.back(), id);
  }

  std::unordered_map<std::string_view, int64_t> piece_counts;  // [piece bytes]
  Gpt2PreTokenizer split(text);
  for (std::string_view piece = split.next(); !piece.empty(); piece = split.next()) ++piece_counts[piece];
  std::vector<std::pair<std::string_view, int64_t>> pieces(piece_counts.begin(), piece_counts.end());
  std::sort(pieces.begin(), pieces.end());
  words_.reserve(pieces.size());
  for (const auto& [piece, count] : pieces) {
    Word word;
    word.count = count;
    for (char c : piece) word.symbols.push_back(byte_token[static_cast<unsigned char>(c)]);
    words_.push_back(std::move(word));
  }
  word_stamp_.assign(words_.size(), -1);
  count_initial_pairs();
}

bool BpeTrainer::heap_less(const HeapEntry& x, const HeapEntry& y) const {
  if (x.count != y.count) return x.count < y.count;
  const std::string& xl = token_bytes_[static_cast<size_t>(pair_left(x.pair))];
  const std::string& yl = token_bytes_[static_cast<size_t>(pair_left(y.pair))];
  if (xl != yl) return xl > yl;
  return token_bytes_[static_cast<size_t>(pair_right(x.pair))] > token_bytes_[static_cast<size_t>(pair_right(y.pair))];
}

void BpeTrainer::push(int64_t count, uint64_t pair) {
  heap_.push_back({count, pair});
  std::push_heap(heap_.begin(), heap_.end(),
                 [this](const HeapEntry& x, const HeapEntry& y) { return heap_less(x, y); });
}

void BpeTrainer::count_initial_pairs() {
  for (size_t w = 0; w < words_.size(); ++w) {
    const Word& word = words_[w];
    for (size_t i = 0; i + 1 < word.symbols.size(); ++i) {
      const uint64_t pair = pair_key(word.symbols[i], word.symbols[i + 1]);
      pair_counts_[pair] += word.count;
      std::vector<int32_t>& list = pair_words_[pair];
      if (list.empty() || list.back() != static_cast<int32_t>(w)) list.push_back(static_cast<int32_t>(w));
    }
  }
  // Push in key order so that the heap's layout does not depend on hash-map iteration order.
  std::vector<std::pair<uint64_t, int64_t>> counts(pair_counts_.begin(), pair_counts_.end());
  std::sort(counts.begin(), counts.end());
  for (const auto& [pair, count] : counts) push(count, pair);
}

int32_t BpeTrainer::token_for(const std::string& bytes) {
  const auto [it, inserted] = token_ids_.try_emplace(bytes, static_cast<int32_t>(token_bytes_.size()));
  if (inserted) token_bytes_.push_back(bytes);
  return it->second;
}

void BpeTrainer::learn(int64_t vocab_size) {
  const auto less = [this](const HeapEntry& x, const HeapEntry& y) { return heap_less(x, y); };
  while (vocab_size_with_eot() < vocab_size && !heap_.empty()) {
    std::pop_heap(heap_.begin(), heap_.end(), less);
    const HeapEntry top = heap_.back();
    heap_.pop_back();
    const auto found = pair_counts_.find(top.pair);
    const int64_t current = found == pair_counts_.end() ? 0 : found->second;
    if (current != top.count) {  // out of date: its count fell since it was pushed
      if (current > 0) push(current, top.pair);
      continue;
    }
    if (top.count < 2) break;
    const int32_t left = pair_left(top.pair), right = pair_right(top.pair);
    const int32_t merged =
        token_for(token_bytes_[static_cast<size_t>(left)] + token_bytes_[static_cast<size_t>(right)]);
    merge(top.pair, merged, static_cast<int64_t>(merges_.size()));
    merges_.push_back(top.pair);
  }
}

// Replaces (left, right) by `merged` in every word that has it and updates the pair counts.
void BpeTrainer::merge(uint64_t pair, int32_t merged, int64_t step) {
  const int32_t left = pair_left(pair), right = pair_right(pair);
  const std::vector<int32_t> candidates = std::move(pair_words_[pair]);  // [i] -> word
  pair_words_.erase(pair);
  step_delta_.clear();
  for (const int32_t w : candidates) {
    if (word_stamp_[static_cast<size_t>(w)] == step) continue;  // listed twice
    word_stamp_[static_cast<size_t>(w)] = step;
    Word& word = words_[static_cast<size_t>(w)];
    for (size_t i = 0; i + 1 < word.symbols.size(); ++i)
      step_delta_[pair_key(word.symbols[i], word.symbols[i + 1])] -= word.count;
    if (!merge_word(word, left, right, merged)) {
      for (size_t i = 0; i + 1 < word.symbols.size(); ++i)
        step_delta_[pair_key(word.symbols[i], word.symbols[i + 1])] += word.count;
      continue;
    }
    for (size_t i = 0; i + 1 < word.symbols.size(); ++i) {
      const int32_t a = word.symbols[i], b = word.symbols[i + 1];
      step_delta_[pair_key(a, b)] += word.count;
      if (a == merged || b == merged) {
        std::vector<int32_t>& list = pair_words_[pair_key(a, b)];
        if (list.empty() || list.back() != w) list.push_back(w);
      }
    }
  }
  std::vector<std::pair<uint64_t, int64_t>> changes(step_delta_.begin(), step_delta_.end());
  std::sort(changes.begin(), changes.end());
  for (const auto& [changed, delta] : changes) {
    if (delta == 0) continue;
    int64_t& count = pair_counts_[changed];
    count += delta;
    if (count == 0) pair_counts_.erase(changed);
    else if (delta > 0) push(count, changed);
  }
}

// Replaces every (left, right), left to right, by `merged`; returns whether there was one.
bool BpeTrainer::merge_word(Word& word, int32_t left, int32_t right, int32_t merged) {
  std::vector<int32_t>& s = word.symbols;
  size_t w = 0;
  for (size_t i = 0; i < s.size();) {
    if (i + 1 < s.size() && s[i] == left && s[i + 1] == right) {
      s[w++] = merged;
      i += 2;
    } else {
      s[w++] = s[i++];
    }
  }
  const bool changed = w != s.size();
  s.resize(w);
  return changed;
}

std::string BpeTrainer::encoder_json() const {
  nlohmann::ordered_json encoder = nlohmann::ordered_json::object();  // in id order, like GPT-2's
  for (size_t id = 0; id < token_bytes_.size(); ++id) encoder[gpt2_bytes_to_token(token_bytes_[id])] = id;
  encoder["<|endoftext|>"] = token_bytes_.size();
  return encoder.dump() + "\n";
}

std::string BpeTrainer::merges_text() const {
  std::string text = "#version: 0.2\n";
  for (const uint64_t pair : merges_) {
    text += gpt2_bytes_to_token(token_bytes_[static_cast<size_t>(pair_left(pair))]);
    text += ' ';
    text += gpt2_bytes_to_token(token_bytes_[static_cast<size_t>(pair_right(pair))]);
    text += '\n';
  }
  return text;
}

// Both files are written and fsynced under temporary names before either is renamed into
// place; then the directory is fsynced so that the renames are durable.
void write_tokenizer_files(const std::filesystem::path& dir, const std::string& encoder, const std::string& merges) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  LOOM_CHECK(!ec, dir.string(), ": cannot create directory: ", ec.message());
  const std::string encoder_path = (dir / "encoder.json").string(), merges_path = (dir / "vocab.bpe").string();
  const ByteRange encoder_bytes{encoder.data(), encoder.size()}, merges_bytes{merges.data(), merges.size()};
  const std::string encoder_tmp = write_temp_synced(encoder_path, std::span(&encoder_bytes, 1));
  std::string merges_tmp;
  try {
    merges_tmp = write_temp_synced(merges_path, std::span(&merges_bytes, 1));
    rename_into_place(merges_tmp, merges_path);
  } catch (...) {
    ::unlink(encoder_tmp.c_str());
    throw;
  }
  rename_into_place(encoder_tmp, encoder_path);
  fsync_directory(dir.string());
}

}  // namespace

BpeTrainResult train_bpe(std::string_view text, int64_t vocab_size, const std::string& out_dir) {
  LOOM_CHECK(vocab_size >= 257 && vocab_size <= INT32_MAX, "train_bpe: vocab_size ", vocab_size,
             " must be in [257, 2^31): 256 byte tokens + end of text + merges");
  BpeTrainer trainer(text);
  trainer.learn(vocab_size);
  write_tokenizer_files(out_dir, trainer.encoder_json(), trainer.merges_text());
  return {trainer.vocab_size_with_eot(), trainer.merge_count()};
}

}  // namespace loom
