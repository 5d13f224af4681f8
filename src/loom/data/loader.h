// TokenLoader: training and validation micro-batches over one split of a token dataset.
//
// Legend: n = tokens in the split, T = sequence length, N = windows per epoch,
//         B = rows of one rank's micro-batch, W = world (data-parallel ranks), r = rank.
//
// Windows. Window w (0 <= w < N = floor((n - 1) / T)) is tokens[w*T .. w*T + T], T+1 tokens:
// the first T are the inputs, the last T the targets (inputs shifted by one). Inputs of two
// windows never overlap (stride T); the < T tokens left at the end of the split are never inputs.
//
// Global order. The loader walks one endless stream of windows: the order of epoch 0, then
// that of epoch 1, ... In LOADER_ORDER_SHUFFLED epoch e's order is a Fisher-Yates shuffle of
// [0, N) whose swap partner for position i (i = N-1 .. 1) is floor(u * (i + 1) / 2^64), u the
// first 64 bits of Philox4x32-10(counter = (i lo, i hi, e lo, e hi ^ kLoaderShuffleTag),
// key = (seed lo, seed hi)): a pure function of (seed, e, N), independent of thread count and
// platform. In LOADER_ORDER_SEQUENTIAL (validation) every epoch's order is 0, 1, ..., N-1.
//
// Data parallel. One fill() consumes the next B*W windows of the global order; rank r takes
// the windows at offsets r, r + W, ..., r + (B-1)*W as its rows 0..B-1. The ranks' batches are
// disjoint and their union is exactly the B*W windows a single process (W = 1) would take for
// the same global batch. Batches run across epoch boundaries: no window is dropped, and each
// epoch covers every window exactly once.
//
// Position. LoaderState is the global cursor (epoch, index of the next window in that epoch's
// order). It is identical on every rank and independent of B and W, so restore(state()) in a
// fresh loader, in any layout, continues the same stream of windows.
//
// The split is held in memory as int32; fill() copies rows and allocates nothing (the order of
// an epoch is regenerated in place when the cursor enters it).
#pragma once
#include <cstdint>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <vector>

#include "loom/core/tensor.h"
#include "loom/data/batch_source.h"
#include "loom/data/shard.h"

namespace loom {

inline constexpr uint32_t kLoaderShuffleTag = 0x53485546u;  // "SHUF": keeps these draws apart from init's streams

enum LoaderOrder : uint8_t { LOADER_ORDER_SHUFFLED, LOADER_ORDER_SEQUENTIAL, LOADER_ORDER_COUNT };

struct LoaderState {
  uint64_t epoch = 0;
  uint64_t index = 0;              // next window in epoch's order, in [0, windows_per_epoch)
  uint64_t seed = 0;               // checked by restore: a position only means something in its order
  uint64_t windows_per_epoch = 0;  // checked by restore: the same split and seq_len
  bool operator==(const LoaderState&) const = default;
};

// {"epoch": e, "index": i, "seed": s, "windows_per_epoch": N}, for checkpoints. from_json
// throws loom::Error naming the missing or mistyped key.
void to_json(nlohmann::json& json, const LoaderState& state);
void from_json(const nlohmann::json& json, LoaderState& state);

// The split 0, 1, ..., n: a TokenLoader over it with windows of one orders n items (preference
// pairs, prompts; next_windows gives their indices) -- its shuffling, epochs and position.
TokenSplit index_split(int64_t n, const std::string& name);

// A source whose position goes into checkpoints: the token loader, and the sources of whole
// sequences (preference pairs, prompts) whose order is a token loader's over their indices.
class ResumableSource : public BatchSource {
 public:
  virtual LoaderState state() const = 0;
  virtual void restore(const LoaderState& state) = 0;
  virtual void rewind() = 0;  // back to the start (before each validation pass)
};

class TokenLoader final : public ResumableSource {
 public:
  // Throws if the split has fewer than seq_len + 1 tokens, or unless 0 <= rank < world.
  TokenLoader(TokenSplit split, int64_t seq_len, uint64_t seed, LoaderOrder order = LOADER_ORDER_SHUFFLED,
              int rank = 0, int world = 1);

  // tokens, targets: (B, T) i32 on the CPU, T == seq_len(); advances the cursor by B * world.
  void fill(const Tensor& tokens, const Tensor& targets) override;
  // The window ids of the next `rows` rows (this rank's), advancing the cursor as fill() does;
  // over an index_split they are the indices of the next items in the loader's order.
  std::vector<int64_t> next_windows(int64_t rows);
  int32_t document_end() const override { return split_.document_end; }

  LoaderState state() const override;
  // Continues from `state`; throws if it came from another seed or another windows_per_epoch.
  void restore(const LoaderState& state) override;
  // Back to window 0 of epoch 0 (e.g. before each validation pass).
  void rewind() override;

  const std::string& split_name() const { return split_.name; }
  int64_t seq_len() const { return seq_len_; }
  uint64_t windows_per_epoch() const { return windows_; }
  int rank() const { return rank_; }
  int world() const { return world_; }

 private:
  // The window id at position `index` of epoch `epoch`'s order.
  uint64_t window_at(uint64_t epoch, uint64_t index);
  // Row `row`'s window of the next fill (this rank's rows are every world-th of the stream).
  uint64_t row_window(uint64_t row);
  void advance(uint64_t rows);  // the cursor past `rows` rows of every rank
  void shuffle_for_epoch(uint64_t epoch);

  TokenSplit split_;
  int64_t seq_len_;
  uint64_t seed_;
  LoaderOrder order_;
  int rank_;
  int world_;
  uint64_t windows_;  // N
  uint64_t epoch_ = 0;
  uint64_t index_ = 0;
  std::vector<uint64_t> epoch_order_;  // [N] window ids of epoch order_epoch_ (shuffled order only)
  uint64_t order_epoch_ = 0;
};

}  // namespace loom
