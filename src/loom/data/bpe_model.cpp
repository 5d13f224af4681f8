// BPE merging (bpe_model.h).
#include "loom/data/bpe_model.h"

#include <algorithm>
#include <climits>
#include <queue>

#include "loom/data/unicode.h"

namespace loom {
namespace {

constexpr int32_t kNoRank = INT32_MAX;

uint64_t pair_key(int32_t left, int32_t right) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(left)) << 32) | static_cast<uint32_t>(right);
}

}  // namespace

BpeModel::BpeModel(const std::array<int32_t, 256>& byte_token, const std::vector<BpeMerge>& merges)
    : byte_token_(byte_token) {
  merges_.reserve(merges.size());
  for (size_t rank = 0; rank < merges.size(); ++rank)
    merges_[pair_key(merges[rank].left, merges[rank].right)] = {static_cast<int32_t>(rank), merges[rank].merged};
}

BpeModel::BpeModel(BpeCharacters characters, const std::vector<BpeMerge>& merges)
    : BpeModel(std::array<int32_t, 256>{}, merges) {
  characters_ = std::make_unique<BpeCharacters>(std::move(characters));
}

// The symbols of a SentencePiece-style piece, as tokenizers' BPE::merge_word: each character's
// token; a character outside the vocabulary as its bytes' <0xNN> tokens (byte_fallback), else
// the unknown token, one for a run of them with fuse_unk.
void BpeModel::character_symbols(std::string_view piece, std::vector<int32_t>& tokens) const {
  const BpeCharacters& c = *characters_;
  bool unknown_run = false;  // the last symbol is an unk that a fused run may extend
  for (size_t pos = 0; pos < piece.size();) {
    const size_t n = scan_code_point(piece, pos).bytes;
    const std::string_view ch = piece.substr(pos, n);
    pos += n;
    if (const auto it = c.ids.find(std::string(ch)); it != c.ids.end()) {
      tokens.push_back(it->second);
      unknown_run = false;
    } else if (c.byte_fallback) {
      for (const char b : ch) tokens.push_back(c.byte_tokens[static_cast<unsigned char>(b)]);
      unknown_run = false;
    } else if (!(unknown_run && c.fuse_unk)) {
      tokens.push_back(c.unk);
      unknown_run = true;
    }
  }
}

std::vector<BpeMerge> BpeModel::merges() const {
  std::vector<std::pair<int32_t, BpeMerge>> by_rank;  // (rank, merge)
  by_rank.reserve(merges_.size());
  for (const auto& [key, rule] : merges_) {
    by_rank.push_back({rule.rank, BpeMerge{static_cast<int32_t>(key >> 32), static_cast<int32_t>(key & 0xFFFFFFFFu),
                                           rule.merged}});
  }
  std::sort(by_rank.begin(), by_rank.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  std::vector<BpeMerge> out;
  out.reserve(by_rank.size());
  for (const auto& [rank, merge] : by_rank) out.push_back(merge);
  return out;
}

const BpeModel::MergeRule* BpeModel::find_merge(int32_t left, int32_t right) const {
  const auto it = merges_.find(pair_key(left, right));
  return it == merges_.end() ? nullptr : &it->second;
}

// BPE of one pre-token, as encoder.py's bpe(): start from one token per byte; repeatedly take
// the adjacent pair of lowest rank and merge every occurrence of that pair left to right.
// ranks[i] is the rank of (tokens[i], tokens[i+1]); after a merge only the pairs touching a
// merged token are looked up again. Cost: O(length x merges applied).
void BpeModel::merge_piece(std::string_view piece, std::vector<int32_t>& tokens) const {
  tokens.clear();  // (n) token ids of the piece
  if (characters_ != nullptr) {
    character_symbols(piece, tokens);
    merge_by_queue(tokens);
    return;
  }
  for (char c : piece) tokens.push_back(byte_token_[static_cast<unsigned char>(c)]);
  const auto rank_of = [this](int32_t left, int32_t right) {
    const MergeRule* rule = find_merge(left, right);
    return rule ? rule->rank : kNoRank;
  };
  std::vector<int32_t> ranks;  // (n - 1)
  for (size_t i = 0; i + 1 < tokens.size(); ++i) ranks.push_back(rank_of(tokens[i], tokens[i + 1]));

  while (tokens.size() > 1) {
    size_t best = 0;
    for (size_t i = 1; i < ranks.size(); ++i)
      if (ranks[i] < ranks[best]) best = i;
    if (ranks[best] == kNoRank) break;
    const int32_t left = tokens[best], right = tokens[best + 1];
    const int32_t merged = find_merge(left, right)->merged;
    // Compact in place: the write index w never passes the read index i.
    const size_t n = tokens.size();
    size_t w = 0;
    bool prev_merged = false;
    for (size_t i = 0; i < n;) {
      const bool merge_here = i + 1 < n && tokens[i] == left && tokens[i + 1] == right;
      const int32_t token = merge_here ? merged : tokens[i];
      if (w > 0) ranks[w - 1] = (merge_here || prev_merged) ? rank_of(tokens[w - 1], token) : ranks[i - 1];
      tokens[w++] = token;
      prev_merged = merge_here;
      i += merge_here ? 2 : 1;
    }
    tokens.resize(w);
    ranks.resize(w - 1);
  }
}

// The same merges in O(n log n), for the long pieces of SentencePiece-style BPE (Llama 2's
// tokenizer.json has no pre-tokenizer: a whole text between added tokens is one piece). As
// tokenizers' Word::merge_all: a queue of adjacent pairs ordered by rank, then position; a
// popped pair whose symbols changed since it was queued is skipped; a merge queues the pairs
// the new symbol makes with its neighbours. The lowest rank is merged first and, within one
// rank, the leftmost pair, so overlapping occurrences ("a a a") merge left to right as above.
void BpeModel::merge_by_queue(std::vector<int32_t>& tokens) const {
  const size_t n = tokens.size();
  if (n < 2) return;
  struct Pair {
    int32_t rank;
    uint32_t pos;  // the left symbol
    int32_t left, right;  // their ids when queued
  };
  const auto later = [](const Pair& a, const Pair& b) { return a.rank != b.rank ? a.rank > b.rank : a.pos > b.pos; };
  std::priority_queue<Pair, std::vector<Pair>, decltype(later)> queue(later);
  std::vector<int64_t> prev(n), next(n);  // linked list of the live symbols; -1 / n at the ends
  std::vector<bool> live(n, true);
  for (size_t i = 0; i < n; ++i) {
    prev[i] = static_cast<int64_t>(i) - 1;
    next[i] = static_cast<int64_t>(i) + 1;
  }
  const auto push = [&](size_t pos) {
    const auto right = static_cast<size_t>(next[pos]);
    if (const MergeRule* rule = find_merge(tokens[pos], tokens[right]))
      queue.push({rule->rank, static_cast<uint32_t>(pos), tokens[pos], tokens[right]});
  };
  for (size_t i = 0; i + 1 < n; ++i) push(i);
  while (!queue.empty()) {
    const Pair top = queue.top();
    queue.pop();
    const size_t pos = top.pos;
    if (!live[pos] || next[pos] >= static_cast<int64_t>(n)) continue;
    const auto right = static_cast<size_t>(next[pos]);
    if (tokens[pos] != top.left || tokens[right] != top.right) continue;  // changed since queued
    tokens[pos] = find_merge(top.left, top.right)->merged;
    live[right] = false;
    next[pos] = next[right];
    if (next[pos] < static_cast<int64_t>(n)) prev[static_cast<size_t>(next[pos])] = static_cast<int64_t>(pos);
    if (prev[pos] >= 0) push(static_cast<size_t>(prev[pos]));
    if (next[pos] < static_cast<int64_t>(n)) push(pos);
  }
  size_t w = 0;
  for (size_t i = 0; i < n; ++i)
    if (live[i]) tokens[w++] = tokens[i];
  tokens.resize(w);
}

void BpeModel::encode_piece(std::string_view piece, std::vector<int32_t>& scratch,
                                std::vector<int32_t>& out) const {
  const bool cacheable = piece.size() <= kCacheMaxPieceBytes;
  if (cacheable) {
    std::lock_guard<std::mutex> lock(cache_mutex_);
    const auto it = cache_.find(piece);
    if (it != cache_.end()) {
      const int32_t* first = cache_tokens_.data() + it->second.offset;
      out.insert(out.end(), first, first + it->second.count);
      return;
    }
  }
  merge_piece(piece, scratch);
  out.insert(out.end(), scratch.begin(), scratch.end());
  if (!cacheable) return;
  std::lock_guard<std::mutex> lock(cache_mutex_);
  if (cache_.size() >= kCacheMaxPieces || cache_tokens_.size() + scratch.size() > kCacheMaxTokens) {
    cache_.clear();
    cache_tokens_.clear();
  }
  const CachedPiece entry{static_cast<uint32_t>(cache_tokens_.size()), static_cast<uint32_t>(scratch.size())};
  if (cache_.try_emplace(std::string(piece), entry).second)
    cache_tokens_.insert(cache_tokens_.end(), scratch.begin(), scratch.end());
}

}  // namespace loom
