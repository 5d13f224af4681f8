#include "loom/infer/draft_model.h"

#include <algorithm>
#include <chrono>
#include <cmath>

#include "loom/core/error.h"

namespace loom {

DraftModel::DraftModel(Transformer& draft, const ModelConfig& target, int64_t positions, int64_t block_size,
                       int64_t max_batch, int64_t chunk, double min_probability)
    : model_(draft), chunk_(std::max<int64_t>(1, chunk)), min_probability_(min_probability) {
  const ModelConfig& c = draft.config();
  LOOM_CHECK(c.vocab_size == target.vocab_size, "the draft model's vocabulary has ", c.vocab_size,
             " tokens, the target's ", target.vocab_size, ": a draft needs the target's tokenizer");
  LOOM_CHECK(c.max_seq_len >= target.max_seq_len, "the draft model's context (model.max_seq_len = ", c.max_seq_len,
             ") is shorter than the target's (", target.max_seq_len, ")");
  LOOM_CHECK(!c.mla(), "a draft model with MLA attention is not supported (its latent cache is read back per row)");
  KvCacheConfig kv;
  kv.n_layer = c.n_layer;
  kv.k_width = kv.v_width = c.n_kv_head * c.head_dim();
  kv.block_size = block_size;
  const int64_t per_sequence = (c.max_seq_len + block_size - 1) / block_size;
  kv.num_blocks = std::min((positions + block_size - 1) / block_size, max_batch * per_sequence) + max_batch;
  kv.max_len = per_sequence * block_size;
  kv.validate();
  // Host memory on a backend the host reads (the draft's rows are attended on the host).
  LOOM_CHECK(draft.backend().allocator().host_accessible(), "a draft model runs on the CPU backend (--device cpu)");
  cache_ = make_paged_kv_cache(kv, &draft.backend().allocator());
  rows_ = std::make_unique<StepRows>(*cache_, c);
}

DraftModel::~DraftModel() = default;

DraftModel::Sequence& DraftModel::state(const DraftRequest& r) {
  auto it = sequences_.find(r.id);
  if (it != sequences_.end()) return it->second;
  SamplingConfig c = *r.sampling;
  c.presence_penalty = c.frequency_penalty = 0.0f;
  c.seed = c.seed ^ 0x9e3779b97f4a7c15ULL;  // draws of its own, not the target's
  it = sequences_.emplace(r.id, Sequence(c)).first;
  it->second.seq = cache_->add_sequence();
  return it->second;
}

void DraftModel::release(int64_t id) {
  const auto it = sequences_.find(id);
  if (it == sequences_.end()) return;
  cache_->release(it->second.seq);
  sequences_.erase(it);
}

void DraftModel::forward(const std::vector<int32_t>& tokens, const std::vector<int64_t>& positions,
                         const std::vector<int64_t>& logit_rows) {
  const int64_t n = static_cast<int64_t>(tokens.size()), k = static_cast<int64_t>(logit_rows.size());
  const int64_t vocab = model_.config().vocab_size;
  ActivationStore one;  // a prompt chunk's store lives for its forward only
  ActivationStore* store = &one;
  if (n <= 64) {
    auto it = stores_.find({n, k});
    if (it == stores_.end()) it = stores_.emplace(std::make_pair(n, k), model_.allocate_rows(n, k)).first;
    store = &it->second;
  } else {
    one = model_.allocate_rows(n, k);
  }
  model_.forward_rows(*store, tokens, positions, *rows_, &logit_rows);
  logits_.resize(static_cast<size_t>(k * vocab));
  model_.backend().read(store->logits.view(0, {k, vocab}), logits_.data());
  rows_->commit();
  rows_run_ += n;
}

void DraftModel::propose(std::vector<DraftRequest>& requests) {
  const auto start = std::chrono::steady_clock::now();
  const int64_t vocab = model_.config().vocab_size;
  std::vector<Sequence*> states;
  int64_t most = 0;
  for (DraftRequest& r : requests) {
    LOOM_CHECK(r.k >= 1 && r.prompt != nullptr && r.generated != nullptr && r.sampling != nullptr,
               "draft model: a request needs its tokens, sampling and k >= 1");
    r.drafts.clear();
    r.q.assign(r.sampling->temperature > 0.0f ? static_cast<size_t>(r.k * vocab) : 0, 0.0f);
    states.push_back(&state(r));
    most = std::max(most, r.k);
  }
  const auto token_at = [](const DraftRequest& r, int64_t t) {
    const auto P = static_cast<int64_t>(r.prompt->size());
    return t < P ? (*r.prompt)[static_cast<size_t>(t)] : (*r.generated)[static_cast<size_t>(t - P)];
  };
  std::vector<int64_t> wanted;  // [request] drafts it still takes: k, or fewer once the draft is unsure
  for (const DraftRequest& r : requests) wanted.push_back(r.k);
  const auto take = [&](size_t i, int64_t logit_row) {  // the next draft of request i from a row of logits_
    DraftRequest& r = requests[i];
    const size_t j = r.drafts.size();
    float* q = r.q.empty() ? nullptr : r.q.data() + j * static_cast<size_t>(vocab);
    const float* row = logits_.data() + logit_row * vocab;
    const int32_t token = q ? states[i]->sampler.propose(row, vocab, q) : states[i]->sampler.propose(row, vocab, nullptr);
    r.drafts.push_back(token);
    if (min_probability_ <= 0.0) return;
    double p = 0.0;  // the draft's probability of its pick: q's, or the softmax's at the argmax (greedy)
    if (q) {
      p = q[token];
    } else {
      double z = 0.0;
      for (int64_t v = 0; v < vocab; ++v) z += std::exp(static_cast<double>(row[v]) - row[token]);
      p = 1.0 / z;
    }
    if (p < min_probability_) wanted[i] = static_cast<int64_t>(r.drafts.size());
  };
  // Catch up: the verified tokens not yet fed, chunk_ a forward per request; the last one's logits
  // give the first draft. Single rows are written and advanced; chunks stored by commit().
  for (;;) {
    rows_->clear();
    std::vector<int32_t> tokens;
    std::vector<int64_t> positions, logit_rows;
    std::vector<size_t> owners, single;
    for (size_t i = 0; i < requests.size(); ++i) {
      const DraftRequest& r = requests[i];
      Sequence& s = *states[i];
      const int64_t L = static_cast<int64_t>(r.prompt->size() + r.generated->size());
      if (s.seen >= L) continue;
      const int64_t m = std::min(L - s.seen, chunk_);
      for (int64_t j = 0; j < m; ++j) {
        rows_->add(s.seq, j, m, m > 1);
        tokens.push_back(token_at(r, s.seen + j));
        positions.push_back(s.seen + j);
      }
      if (m == 1) single.push_back(i);
      s.seen += m;
      if (s.seen == L) logit_rows.push_back(static_cast<int64_t>(tokens.size()) - 1), owners.push_back(i);
    }
    if (tokens.empty()) break;
    forward(tokens, positions, logit_rows);
    for (const size_t i : single) cache_->advance(states[i]->seq);
    for (size_t o = 0; o < owners.size(); ++o) take(owners[o], static_cast<int64_t>(o));
  }
  // Drafts 2..k: the drafts so far as staged rows after the verified tokens, never stored.
  for (int64_t j = 2; j <= most; ++j) {
    rows_->clear();
    std::vector<int32_t> tokens;
    std::vector<int64_t> positions, logit_rows;
    std::vector<size_t> owners;
    for (size_t i = 0; i < requests.size(); ++i) {
      const DraftRequest& r = requests[i];
      if (wanted[i] < j) continue;
      const Sequence& s = *states[i];
      for (int64_t d = 0; d < j - 1; ++d) {
        rows_->add(s.seq, d, j - 1, false, true);
        tokens.push_back(r.drafts[static_cast<size_t>(d)]);
        positions.push_back(s.seen + d);
      }
      rows_->keep(s.seq, 0);
      logit_rows.push_back(static_cast<int64_t>(tokens.size()) - 1), owners.push_back(i);
    }
    if (tokens.empty()) break;  // every request stopped early
    forward(tokens, positions, logit_rows);
    for (size_t o = 0; o < owners.size(); ++o) take(owners[o], static_cast<int64_t>(o));
  }
  for (size_t i = 0; i < requests.size(); ++i) requests[i].q.resize(requests[i].drafts.size() * static_cast<size_t>(requests[i].q.empty() ? 0 : vocab));
  seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace loom
