// Speculative decoding with a draft model (Leviathan et al. 2023, Chen et al. 2023; vLLM's and
// llama.cpp's --model-draft): a smaller model with the target's vocabulary proposes k tokens of a
// request one after another, and the target verifies them in one forward as a chunk of rows
// (GenerationEngine, Sampler::verify with the draft's distributions): greedy output is the
// target's, sampled output is distributed as the target's. The draft pays off when its k
// forwards and the target's one forward of k + 1 rows cost less than the target's accepted
// tokens one by one: on a CPU, decoding reads every weight once per forward whatever the rows.
//
// The draft keeps its own KV cache (paged, fp32) with one sequence per request, holding only
// verified tokens: each call first feeds the request's tokens the draft has not seen (its prompt
// at the first call, in chunks; afterwards the tokens accepted by the last verification and the
// target's own pick), samples the first draft from the last row's logits, then feeds the drafts
// so far as staged rows of one chunk (StepRows::add staged, keep 0: attended, never stored) to
// sample the next. A rejected draft therefore never needs removing from the cache; the price is
// recomputing draft j - 1's row j - 1 times (k(k - 1)/2 extra rows in all), which costs little
// where a forward's time is its weights' reading.
//
// A request stops drafting early where the draft is unsure: once the probability the draft gave
// its own pick is below min_probability (llama.cpp's --draft-p-min), its next draft would likely
// be rejected, and proposing it costs a forward.
//
// Requests of one call run side by side (one forward per round for all of them). Each request
// has the draft's own sampler (its sampling without penalties, its own seed): any proposal
// distribution keeps the target's output distribution exact; a closer one is accepted more.
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <utility>
#include <vector>

#include "loom/infer/kv_cache.h"
#include "loom/infer/sampler.h"
#include "loom/infer/step_rows.h"
#include "loom/model/transformer.h"

namespace loom {

struct DraftRequest {
  int64_t id = 0;                               // the request's (engine) id: its draft sequence
  const std::vector<int32_t>* prompt = nullptr;  // its verified tokens: the prompt, then
  const std::vector<int32_t>* generated = nullptr;  // the tokens generated so far
  const SamplingConfig* sampling = nullptr;     // the request's sampling (temperature 0: greedy drafts)
  int64_t k = 0;                                // drafts wanted (>= 1)
  std::vector<int32_t> drafts;                  // out: up to k tokens
  std::vector<float> q;                         // out: sampled requests, (k, vocab) proposal distributions
};

class DraftModel {
 public:
  // Refuses a draft whose vocabulary differs from the target's or whose context is shorter
  // (naming both). The cache holds `positions` positions (the target's pool) plus one block per
  // row of max_batch, in blocks of block_size; prompts are fed chunk positions a forward.
  DraftModel(Transformer& draft, const ModelConfig& target, int64_t positions, int64_t block_size, int64_t max_batch,
             int64_t chunk, double min_probability = 0.0);
  ~DraftModel();

  // Each request's drafts, up to k (fewer where the draft became unsure), and q for sampled ones.
  void propose(std::vector<DraftRequest>& requests);
  // The request finished: its sequence and sampler go.
  void release(int64_t id);

  const KvCache& cache() const { return *cache_; }
  Transformer& model() { return model_; }
  double seconds() const { return seconds_; }  // spent in propose()
  int64_t rows() const { return rows_run_; }    // rows fed through the draft

 private:
  struct Sequence {
    int64_t seq = 0, seen = 0;  // its cache sequence; the verified tokens fed
    Sampler sampler;
    explicit Sequence(const SamplingConfig& c) : sampler(c) {}
  };
  Sequence& state(const DraftRequest& r);
  // One forward of the rows in rows_ (tokens at positions), logits of logit_rows into logits_.
  void forward(const std::vector<int32_t>& tokens, const std::vector<int64_t>& positions,
               const std::vector<int64_t>& logit_rows);

  Transformer& model_;
  int64_t chunk_;
  double min_probability_;
  std::unique_ptr<KvCache> cache_;
  std::unique_ptr<StepRows> rows_;
  std::map<int64_t, Sequence> sequences_;                          // [request id]
  std::map<std::pair<int64_t, int64_t>, ActivationStore> stores_;  // [(rows, logit rows)] of small forwards
  std::vector<float> logits_;
  double seconds_ = 0;
  int64_t rows_run_ = 0;
};

}  // namespace loom
