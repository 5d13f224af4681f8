// The rows of one generation step as the model's DecodeCache (Transformer::forward_rows): row r
// is a position of sequence seqs[r] of a KV cache. A sequence normally has one row, its next
// position, written into the cache and attended there (the caller advances the sequence after
// the step). A chunk of consecutive rows of one sequence (chunk[r] = 0, 1, ... of chunk_len[r]
// rows: a prompt's chunk, or a decoding token and its speculative drafts) attends to the
// sequence's cached positions and the chunk's rows up to itself, gathered here one layer at a
// time; commit() then stores the chunk's rows (all of them, or the first keep(seq, n)) as the
// sequence's next positions, in order. Used by the generation engine, teacher-forced scoring and
// a speculative draft model (infer/draft_model.h).
#pragma once
#include <cstdint>
#include <map>
#include <vector>

#include "loom/infer/chunk_attention.h"
#include "loom/infer/kv_cache.h"
#include "loom/infer/recurrent_state.h"
#include "loom/model/transformer.h"

namespace loom {

class StepRows : public DecodeCache {
 public:
  StepRows(KvCache& cache, const ModelConfig& model) : cache_(cache), model_(model), prompt_attention_(model) {
    for (int64_t l = 0, k = 0; l < model.n_layer; ++l) kv_layer_.push_back(model.linear_layer(l) ? -1 : k++);
  }
  // The linear-attention blocks' per-sequence state (infer/recurrent_state.h): needed for a
  // hybrid model (model.linear_interval), whose KV cache holds its attention blocks only.
  void set_recurrent_states(RecurrentStates* states) { states_ = states; }
  float* linear_state(int64_t layer, int64_t row) override;
  std::vector<int64_t> seqs, chunk, chunk_len;  // [row]
  std::vector<bool> prompt;                     // [row] of a prompt's chunk (not speculation's drafts)
  std::vector<bool> gathered;                   // [row] attended as a chunk's row, stored by commit()

  void clear();
  // Row `index` of a chunk of `length` rows of sequence seq (a single row: index 0, length 1).
  // A prompt's chunk (of_prompt) is attended by two GEMMs per kv head (chunk_attention.h); other
  // chunks by the decoding kernel row by row, so a verified draft's row computes bitwise what
  // decoding it alone would. `staged`: a single row attended as a chunk of one (stored only by
  // commit(), so keep(seq, 0) leaves the cache as it was: a draft model's tentative row).
  void add(int64_t seq, int64_t index = 0, int64_t length = 1, bool of_prompt = false, bool staged = false) {
    seqs.push_back(seq), chunk.push_back(index), chunk_len.push_back(length), prompt.push_back(of_prompt);
    gathered.push_back(length > 1 || staged);
  }
  // commit() stores only the first `rows` rows of seq's chunk (speculative decoding: the rows of
  // the accepted drafts).
  void keep(int64_t seq, int64_t rows) { keep_[seq] = rows; }
  // Stores every chunk's kept rows (all layers) as its sequence's next positions.
  void commit();

  // A cache in the backend's memory takes the step's rows where they are, unless a chunk is among
  // them (its rows attend to each other before they are stored: through the host below).
  bool in_backend_memory() const override;
  void attend_all(Backend& backend, int64_t layer, const Tensor& qkv, const Tensor& out) override;
  void attend(int64_t layer, int64_t row, const float* q, const float* k, const float* v, float* out) override;
  void attend_host_rows(int64_t layer, int64_t n, const float* qkv, int64_t width, int64_t k_col, int64_t v_col,
                        float* out, int64_t out_width) override;
  const float* latent(int64_t layer, int64_t row, const float* latent, int64_t* count) override;

 private:
  // A chunk of one sequence in this step. Its attention reads the sequence's cached rows and the
  // chunk's own up to each row: those of the layer running are gathered here (the cached ones
  // read from the cache, dequantized, on the chunk's first row of each layer), one layer at a
  // time, so a chunk holds one layer's visible rows in fp32 plus its own rows of every layer.
  struct Chunk {
    int64_t prefix = 0, rows = 0;
    int64_t first = 0;  // the first position gathered: a sliding window's rows before it are never read (nor kept)
    std::vector<float> k, v;                       // the current layer's (prefix - first + rows so far, width)
    std::vector<std::vector<float>> new_k, new_v;  // [layer] the chunk's own rows (rows, width), for commit
  };

  // Row `row` of a chunk into the gathered rows of `layer` (the sequence's cached rows first, on
  // the chunk's first row) and the chunk's own; returns the rows now visible. gather = false (a
  // prompt's chunk, attended by ChunkAttention, which reads the cached rows itself): the chunk's
  // own rows only.
  int64_t append(int64_t layer, int64_t row, const float* k, const float* v, bool gather = true);
  // KvCache::attend's kernel (attend_rows.h) over seq's gathered rows [first, count), the
  // newest `window` of them under a window (the layer's; 0: all).
  void attend_chunk(int64_t seq, const float* q, int64_t count, int64_t window, float* out, std::vector<float>& scores,
                    std::vector<float>& sums) const;

  // Block `layer`'s layer in the KV cache: its index among the attention blocks.
  int64_t kv_layer(int64_t layer) const { return kv_layer_[static_cast<size_t>(layer)]; }

  KvCache& cache_;
  const ModelConfig& model_;
  std::vector<int64_t> kv_layer_;  // [model layer] cache layer, -1 for a linear-attention block
  RecurrentStates* states_ = nullptr;
  Tensor q_;  // attend_all's contiguous query rows
  std::vector<float> buffer_, scores_, sums_;
  std::map<int64_t, Chunk> chunks_;  // [sequence] this step's chunk
  std::map<int64_t, int64_t> keep_;  // [sequence] rows of its chunk commit() stores
  ChunkAttention prompt_attention_;  // a prompt chunk's attention (its scratch reused across steps)
};

}  // namespace loom
