#include "loom/data/loader.h"

#include "loom/core/targets.h"

#include <algorithm>
#include <nlohmann/json.hpp>
#include <numeric>
#include <utility>

#include "loom/core/error.h"
#include "loom/core/philox.h"

namespace loom {

namespace {
// Uniform in [0, bound) from 64 random bits by multiply-shift (Lemire, "Fast random integer
// generation in an interval", 2019); the bias is below bound / 2^64, i.e. nil for any split.
uint64_t uniform_below(uint64_t bits, uint64_t bound) {
  return static_cast<uint64_t>((static_cast<unsigned __int128>(bits) * bound) >> 64);
}

uint64_t require_state_u64(const nlohmann::json& json, const char* key) {
  const bool ok = json.is_object() && json.contains(key) && json.at(key).is_number_integer() &&
                  (json.at(key).is_number_unsigned() || json.at(key).get<int64_t>() >= 0);
  LOOM_CHECK(ok, "loader state: key '", key,
             "' missing or not a non-negative integer (expected {epoch, index, seed, windows_per_epoch})");
  return json.at(key).get<uint64_t>();
}
}  // namespace

void to_json(nlohmann::json& json, const LoaderState& state) {
  json = {{"epoch", state.epoch},
          {"index", state.index},
          {"seed", state.seed},
          {"windows_per_epoch", state.windows_per_epoch}};
}

void from_json(const nlohmann::json& json, LoaderState& state) {
  state.epoch = require_state_u64(json, "epoch");
  state.index = require_state_u64(json, "index");
  state.seed = require_state_u64(json, "seed");
  state.windows_per_epoch = require_state_u64(json, "windows_per_epoch");
}

TokenLoader::TokenLoader(TokenSplit split, int64_t seq_len, uint64_t seed, LoaderOrder order, int rank, int world)
    : split_(std::move(split)), seq_len_(seq_len), seed_(seed), order_(order), rank_(rank), world_(world) {
  LOOM_CHECK(seq_len_ >= 1, "TokenLoader(", split_.name, "): seq_len is ", seq_len_, ", expected >= 1");
  LOOM_CHECK(world_ >= 1 && rank_ >= 0 && rank_ < world_, "TokenLoader(", split_.name, "): rank ", rank_,
             " of world ", world_, ", expected 0 <= rank < world");
  LOOM_CHECK(order_ == LOADER_ORDER_SHUFFLED || order_ == LOADER_ORDER_SEQUENTIAL, "TokenLoader(", split_.name,
             "): unknown order ", static_cast<int>(order_));
  const auto n = static_cast<uint64_t>(split_.tokens.size());
  const auto t = static_cast<uint64_t>(seq_len_);
  LOOM_CHECK(n >= t + 1, "TokenLoader: split '", split_.name, "' has ", n, " tokens, fewer than seq_len + 1 = ", t + 1,
             " needed for one window");
  windows_ = (n - 1) / t;
  if (order_ == LOADER_ORDER_SHUFFLED) {
    epoch_order_.resize(windows_);
    shuffle_for_epoch(0);
  }
}

void TokenLoader::shuffle_for_epoch(uint64_t epoch) {
  std::iota(epoch_order_.begin(), epoch_order_.end(), uint64_t{0});
  const PhiloxKey key = {static_cast<uint32_t>(seed_), static_cast<uint32_t>(seed_ >> 32)};
  for (uint64_t i = windows_ - 1; i >= 1; --i) {
    const PhiloxCounter bits = philox4x32_10({static_cast<uint32_t>(i), static_cast<uint32_t>(i >> 32),
                                              static_cast<uint32_t>(epoch),
                                              static_cast<uint32_t>(epoch >> 32) ^ kLoaderShuffleTag},
                                             key);
    const uint64_t u = (static_cast<uint64_t>(bits[0]) << 32) | bits[1];
    std::swap(epoch_order_[i], epoch_order_[uniform_below(u, i + 1)]);
  }
  order_epoch_ = epoch;
}

uint64_t TokenLoader::window_at(uint64_t epoch, uint64_t index) {
  if (order_ == LOADER_ORDER_SEQUENTIAL) return index;
  if (epoch != order_epoch_) shuffle_for_epoch(epoch);
  return epoch_order_[index];
}

void TokenLoader::fill(const Tensor& tokens, const Tensor& targets) {
  LOOM_CHECK(tokens.ndim() == 2 && tokens.dim(1) == seq_len_ && targets.shape() == tokens.shape(), "TokenLoader(",
             split_.name, "): tokens ", tokens.describe(), " and targets ", targets.describe(), " must both be (B, ",
             seq_len_, ")");
  LOOM_CHECK(tokens.device() == DEVICE_CPU && targets.device() == DEVICE_CPU, "TokenLoader(", split_.name,
             "): tokens and targets must be in host memory");
  int32_t* x = tokens.data<int32_t>();   // (B, T)
  int32_t* y = targets.data<int32_t>();  // (B, T)
  const auto rows = static_cast<uint64_t>(tokens.dim(0));
  const auto t = static_cast<uint64_t>(seq_len_);
  for (uint64_t b = 0; b < rows; ++b) {
    const uint64_t window = row_window(b);
    const int32_t* src = split_.tokens.data() + window * t;
    std::copy(src, src + t, x + b * t);
    std::copy(src + 1, src + t + 1, y + b * t);
    if (!split_.mask.empty()) {  // supervised data: the targets that do not count are masked
      const uint8_t* counts = split_.mask.data() + window * t + 1;
      for (uint64_t i = 0; i < t; ++i) {
        if (counts[i] == 0) y[b * t + i] = kIgnoreTarget;
      }
    }
  }
  advance(rows);
}

uint64_t TokenLoader::row_window(uint64_t row) {
  // Position of this row in the global stream, relative to the cursor (epoch_, index_).
  const uint64_t ahead = index_ + static_cast<uint64_t>(rank_) + row * static_cast<uint64_t>(world_);
  return window_at(epoch_ + ahead / windows_, ahead % windows_);
}

void TokenLoader::advance(uint64_t rows) {
  const uint64_t advanced = index_ + rows * static_cast<uint64_t>(world_);
  epoch_ += advanced / windows_;
  index_ = advanced % windows_;
}

std::vector<int64_t> TokenLoader::next_windows(int64_t rows) {
  std::vector<int64_t> windows(static_cast<size_t>(rows));
  for (int64_t b = 0; b < rows; ++b) windows[static_cast<size_t>(b)] = static_cast<int64_t>(row_window(static_cast<uint64_t>(b)));
  advance(static_cast<uint64_t>(rows));
  return windows;
}

TokenSplit index_split(int64_t n, const std::string& name) {
  TokenSplit s;
  s.name = name;
  s.tokens.resize(static_cast<size_t>(n + 1));
  std::iota(s.tokens.begin(), s.tokens.end(), 0);
  return s;
}

LoaderState TokenLoader::state() const { return {epoch_, index_, seed_, windows_}; }

void TokenLoader::restore(const LoaderState& state) {
  LOOM_CHECK(state.seed == seed_, "TokenLoader(", split_.name, "): loader state is for seed ", state.seed,
             ", this loader's seed is ", seed_);
  LOOM_CHECK(state.windows_per_epoch == windows_, "TokenLoader(", split_.name, "): loader state is for ",
             state.windows_per_epoch, " windows per epoch, this split and seq_len give ", windows_);
  LOOM_CHECK(state.index < windows_, "TokenLoader(", split_.name, "): loader state index ", state.index,
             ", expected < ", windows_);
  epoch_ = state.epoch;
  index_ = state.index;
}

void TokenLoader::rewind() {
  epoch_ = 0;
  index_ = 0;
}

}  // namespace loom
