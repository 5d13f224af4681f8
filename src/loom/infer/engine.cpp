#include "loom/infer/engine.h"

#include <algorithm>
#include <cmath>

#include "loom/core/error.h"
#include "loom/core/memory.h"
#include "loom/infer/chunk_attention.h"
#include "loom/infer/draft_model.h"
#include "loom/infer/step_rows.h"

namespace loom {

void EngineConfig::validate() const {
  LOOM_CHECK(max_batch >= 1, "generate.max_batch must be >= 1, got ", max_batch);
  LOOM_CHECK(block_size >= 1, "generate.kv_block_size must be >= 1, got ", block_size);
  LOOM_CHECK(num_blocks >= 0, "generate.kv_blocks must be >= 0 (0: enough for max_batch full sequences), got ", num_blocks);
  LOOM_CHECK(residual >= 0, "generate.kv_residual must be >= 0, got ", residual);
  LOOM_CHECK(prefill_chunk >= 0, "--prefill-chunk must be >= 0 (0: every prompt in one forward), got ", prefill_chunk);
  LOOM_CHECK(draft_p_min >= 0.0 && draft_p_min <= 1.0, "--draft-p-min must be in [0, 1], got ", draft_p_min);
  LOOM_CHECK(speculate >= 0 && ngram >= 1, "--speculate must be >= 0 and --ngram >= 1, got ", speculate, " and ", ngram);
  LOOM_CHECK(speculate == 0 || (k_format == KV_FP32 && v_format == KV_FP32 && residual == 0),
             "--speculate needs an fp32 KV cache (--kv fp32): the draft rows attend to each other before they are stored");
}

KvCacheConfig engine_cache_config(const ModelConfig& model, const EngineConfig& engine) {
  engine.validate();
  KvCacheConfig c;
  // A hybrid model's linear-attention blocks keep a recurrent state instead (infer/recurrent_state.h).
  c.n_layer = model.n_layer - model.linear_layer_count();
  LOOM_CHECK(c.n_layer > 0, "decoding a model whose blocks are all linear attention (model.linear_interval = ",
             model.linear_interval, " > model.n_layer = ", model.n_layer, ") is not supported: the KV cache needs an "
             "attention block");
  if (model.mla()) {  // MLA: one [normed latent | RoPE key] row per position, read back by StepRows::latent
    c.k_width = kv_cache_width(model), c.v_width = 0;
  } else {
    c.k_width = c.v_width = model.n_kv_head * model.head_dim();
  }
  c.block_size = engine.block_size;
  const int64_t blocks_per_sequence = (model.max_seq_len + engine.block_size - 1) / engine.block_size;
  c.num_blocks = engine.num_blocks > 0 ? engine.num_blocks : engine.max_batch * blocks_per_sequence;
  c.max_len = blocks_per_sequence * engine.block_size;  // whole tiles (per-channel formats need them)
  c.k_format = engine.k_format, c.v_format = engine.v_format;
  c.k_axis = engine.k_axis, c.v_axis = engine.v_axis;
  c.group = engine.group, c.residual = engine.residual;
  // Per-token groups of head_dim channels may not divide an MLA row (d_c + d_r): one group a row.
  if (c.group > 0 && c.k_width % c.group != 0) c.group = 0;
  c.validate();
  if (engine.num_blocks == 0 && engine.paged) {  // the budget caps the default pool
    LOOM_CHECK(engine.kv_memory >= 0, "--kv-memory must be >= 0, got ", engine.kv_memory);
    const int64_t budget = engine.kv_memory > 0 ? engine.kv_memory : default_kv_memory();
    const int64_t block = kv_block_bytes(c), fits = budget / block;
    LOOM_CHECK(budget == 0 || fits >= 1, "the KV cache budget of ", format_bytes(static_cast<size_t>(budget)),
               engine.kv_memory > 0 ? " (--kv-memory)" : " (90% of the available memory)", " holds no block of ",
               format_bytes(static_cast<size_t>(block)), " (", engine.block_size, " positions)");
    if (budget > 0) c.num_blocks = std::min(c.num_blocks, fits);
  }
  return c;
}

int64_t default_kv_memory() {
  const int64_t free = available_memory_bytes() - resident_file_bytes();
  return free > 0 ? free / 10 * 9 : 0;
}


struct GenerationEngine::Active {
  int64_t id = 0, seq = 0, fed = 0, blocks = 0;
  bool feeds_prompt = false;  // the rest of a prefix-cached prompt goes through the rows
  std::vector<int32_t> drafts;  // this step's speculative tokens, verified after its last token
  std::vector<float> draft_q;   // a draft model's (drafts, vocab) proposal distributions (sampled requests)
  GenerationRequest request;
  Sampler sampler;
  GenerationResult result;
  Active(int64_t id_, GenerationRequest r) : id(id_), request(std::move(r)), sampler(request.sampling) {}
};

namespace {

// Where the KV cache lives: host memory on a backend whose memory the host reads (the CPU: the
// backend's allocator, so the cache's bytes count in its tracker); the backend's memory on one
// that states kv_cache (a GPU: Backend::kv_store / kv_attention, max_batch sequences alive at
// once); else host memory of `host` (an MLA latent cache too: StepRows::latent reads its rows back).
std::unique_ptr<KvCache> make_engine_cache(const ModelConfig& model, const EngineConfig& engine, Backend& backend,
                                           CpuAllocator& host) {
  const KvCacheConfig kv = engine_cache_config(model, engine);
  Allocator& alloc = backend.allocator();
  if (!alloc.host_accessible() && backend.capabilities().kv_cache && !model.mla()) {
    return make_device_kv_cache(kv, backend, engine.max_batch, engine.paged);
  }
  Allocator* on = alloc.host_accessible() ? &alloc : &host;
  return engine.paged ? make_paged_kv_cache(kv, on) : make_contiguous_kv_cache(kv, engine.max_batch, on);
}

}  // namespace

std::string prefix_cache_unsupported(const Transformer& model, const EngineConfig& engine) {
  const auto& plan = model.recompute_plan();
  if (!engine.paged) return "it needs a paged KV cache";
  if (model.config().linear_interval > 0) return "linear-attention blocks (model.linear_interval) keep a recurrent state, not cacheable blocks";
  if (engine.chunked_prefill || model.context_parallel() != nullptr ||
      !std::all_of(plan.begin(), plan.end(), [](RecomputePolicy p) { return p == RECOMPUTE_NONE; })) {
    return "it needs whole-prompt prefill (no chunked prefill, context parallelism or recompute plan)";
  }
  if (model.config().windowed_everywhere()) return "a sliding window (model.attn_window) forgets the prompt's blocks";
  if (kv_window_bytes(engine_cache_config(model.config(), engine)) > 0) {
    return "its KV format keeps an fp32 window of recent rows outside the blocks (use fp32, bf16, int8 or int4 with no residual)";
  }
  return "";
}

GenerationEngine::GenerationEngine(Transformer& model, EngineConfig config, Transformer* draft)
    : model_(model), config_(config) {
  LOOM_CHECK(draft == nullptr || config_.speculate > 0, "a draft model needs --speculate K > 0 (the drafts it proposes a step)");
  if (draft != nullptr && config_.kv_memory == 0 && config_.num_blocks == 0) {
    // The default budget shared by the two caches in proportion to their fp32 bytes per position.
    const auto per_position = [](const ModelConfig& m) { return static_cast<double>(m.n_layer * m.n_kv_head * m.head_dim()); };
    const double target = per_position(model.config()), other = per_position(draft->config());
    config_.kv_memory = static_cast<int64_t>(static_cast<double>(default_kv_memory()) * target / (target + other));
  }
  cache_ = make_engine_cache(model.config(), config_, model.backend(), host_allocator_);
  rows_ = std::make_unique<StepRows>(*cache_, model.config());
  if (model.config().linear_interval > 0) {
    LOOM_CHECK(config_.speculate == 0, "--speculate with linear-attention blocks (model.linear_interval) is not "
               "supported: their recurrent state has no rollback for rejected drafts");
    states_ = std::make_unique<RecurrentStates>(model.config());
    rows_->set_recurrent_states(states_.get());
  }
  if (draft != nullptr) {
    const KvCacheConfig& kv = cache_->config();
    draft_ = std::make_unique<DraftModel>(*draft, model.config(), kv.num_blocks * kv.block_size, config_.block_size,
                                          config_.max_batch, chunk_rows(), config_.draft_p_min);
  }
  if (config_.prefix_cache) {
    const std::string why = prefix_cache_unsupported(model, config_);
    LOOM_CHECK(why.empty(), "automatic prefix caching is not supported here: ", why);
    prefix_ = std::make_unique<PrefixCache>(*cache_);
  }
  workspace_bytes_ = measure_workspace();
  for (int64_t j = 1; j <= chunk_rows(); ++j) prompt_budget_ += forward_flops_per_position(model.config(), j);
}

GenerationEngine::~GenerationEngine() = default;

int64_t GenerationEngine::measure_workspace() {
  if (config_.prefill_chunk <= 0) return 0;
  const MemoryTracker& tracker = model_.backend().allocator().tracker();
  const auto bytes_of = [&](auto&& allocate) {  // allocated and freed: no page of it is touched
    const size_t before = tracker.current_total();
    const ActivationStore store = allocate();
    return static_cast<int64_t>(tracker.current_total() - before);
  };
  const ModelConfig& c = model_.config();
  const KvCacheConfig& kv = cache_->config();
  const int64_t C = chunk_rows(), decoding = config_.max_batch * (1 + config_.speculate);
  int64_t bytes = bytes_of([&] { return model_.allocate_rows(decoding + C, config_.max_batch); }) +
                  bytes_of([&] { return model_.allocate_prompt_store(std::min(C, c.max_seq_len)); });
  for (int64_t n = 1; n <= config_.max_batch; ++n) bytes += bytes_of([&] { return model_.allocate_rows(n); });
  return bytes + 4 * (config_.max_batch * c.vocab_size + C * c.n_layer * (kv.k_width + kv.v_width)) +
         ChunkAttention::workspace_bytes(c, C);
}

bool GenerationEngine::forgets() const {
  // StepRows::latent (MLA) reads every position, so only an attend cache may forget.
  // Global blocks among windowed ones (model.window_pattern) read every position: nothing is forgotten.
  return model_.config().windowed_everywhere() && !config_.keep_all_blocks && cache_->config().v_width > 0;
}

int64_t GenerationEngine::blocks_needed(const GenerationRequest& r) const {
  if (!config_.paged) return 1;
  const int64_t B = config_.block_size, P = static_cast<int64_t>(r.prompt.size());
  const int64_t positions = std::min(P + r.max_new_tokens, model_.config().max_seq_len);
  if (!forgets()) return (positions + B - 1) / B;
  // Sliding window W: step() forgets positions < length - W + 1 after each advance, so position
  // p is written while positions [p - W + 1, p] are live: tiles (p - W + 1) / B .. p / B, i.e.
  //     held(p) = p / B - max(0, p - W + 1) / B + 1  <=  ceil((W + B - 1) / B)  <=  ceil(W / B) + 1
  // blocks. Exceptions: a one-forward prefill writes [0, P) at once (ceil(P / B) blocks), and the
  // first decoding step after it writes P with [0, P] live. The positions written are
  // [0, T), T = min(P + max_new - 1, max_seq_len) (the last sampled token is never fed). The
  // reservation is the largest of these. held(p) grows with p for p <= W - 1 and depends on
  // p mod B only from there on, so its maximum over [from, T) lies in the last B positions.
  const int64_t T = std::min(P + r.max_new_tokens - 1, model_.config().max_seq_len), W = model_.config().attn_window;
  int64_t peak = 0, from = 0;
  if (!config_.chunked_prefill) {
    peak = (P + B - 1) / B;
    if (P < T) peak = std::max(peak, P / B + 1);
    from = P + 1;
  }
  for (int64_t p = std::max(from, T - B); p < T; ++p) peak = std::max(peak, p / B - std::max<int64_t>(0, p - W + 1) / B + 1);
  return peak;
}

int64_t GenerationEngine::submit(GenerationRequest request) {
  try {
    check(request);
  } catch (const Error& e) {
    throw Error(str_cat("request ", next_id_, ": ", e.what()));
  }
  const int64_t id = next_id_;
  const auto now = std::chrono::steady_clock::now();
  for (int64_t k = 0; k < request.n; ++k) submitted_[id + k] = now;
  next_id_ += request.n;
  waiting_.emplace_back(id, std::move(request));
  return id;
}

void GenerationEngine::check(const GenerationRequest& request) const {
  const int64_t context = model_.config().max_seq_len, vocab = model_.config().vocab_size;
  LOOM_CHECK(!request.prompt.empty(), "the prompt must hold at least one token");
  LOOM_CHECK(static_cast<int64_t>(request.prompt.size()) <= context, "prompt of ",
             request.prompt.size(), " tokens exceeds model.max_seq_len = ", context);
  for (const int32_t t : request.prompt) {
    LOOM_CHECK(t >= 0 && t < vocab, "token ", t, " outside the vocabulary [0, ", vocab, ")");
  }
  LOOM_CHECK(request.max_new_tokens >= 1, "max_new_tokens must be >= 1, got ", request.max_new_tokens);
  request.sampling.validate();
  LOOM_CHECK(request.n >= 1 && request.n <= config_.max_batch, "n = ", request.n,
             " samples must be in [1, generate.max_batch = ", config_.max_batch, "] (they run side by side)");
  LOOM_CHECK(group_blocks(request) <= cache_->config().num_blocks, "the request needs ", group_blocks(request),
             " KV blocks of ", config_.block_size, " positions, more than the pool's ", cache_->config().num_blocks,
             " (generate.kv_blocks)");
}

bool GenerationEngine::whole_prefill() const {
  // A context-parallel model's forward spans its cp group, and a model with a checkpointing plan
  // does not keep its blocks' keys and values: their prompts go through the rows.
  // Linear-attention blocks take their recurrent state from the rows too.
  const auto& plan = model_.recompute_plan();
  return !config_.chunked_prefill && model_.context_parallel() == nullptr && model_.config().linear_interval == 0 &&
         std::all_of(plan.begin(), plan.end(), [](RecomputePolicy p) { return p == RECOMPUTE_NONE; });
}

bool GenerationEngine::shares_prompt() const { return config_.paged && whole_prefill(); }

// Sliding window W: the next position n = length attends to [n + 1 - W, n] (KvCache::attend's
// first = max(0, visible - W), visible = n + 1), so older positions are never read again and the
// paged cache returns their blocks (vLLM's sliding-window block release; Mistral 7B's rolling
// buffer): a sequence then holds at most ceil((W + B - 1) / B) blocks.
void GenerationEngine::forget_out_of_window(const Active& a) {
  if (forgets()) cache_->forget_before(a.seq, cache_->length(a.seq) - model_.config().attn_window + 1);
}

bool GenerationEngine::feeds_in_chunks(const GenerationRequest& r) const {
  // A LongRoPE prompt past the original context is prefilled whole: one forward rotates all its
  // positions with the long factors (as transformers' prefill), chunks would not.
  const auto P = static_cast<int64_t>(r.prompt.size());
  return config_.prefill_chunk > 0 && P > config_.prefill_chunk && whole_prefill() &&
         !crosses_longrope_context(model_.config(), P);
}

int64_t GenerationEngine::chunk_rows() const { return config_.prefill_chunk > 0 ? config_.prefill_chunk : kMaxChunk; }

int64_t GenerationEngine::group_blocks(const GenerationRequest& r) const {
  const int64_t one = blocks_needed(r);
  if (r.n == 1 || !shares_prompt() || forgets() || feeds_in_chunks(r)) return r.n * one;
  // The prompt's full blocks are shared and never written again; each sample may own the rest.
  const int64_t shared = static_cast<int64_t>(r.prompt.size()) / config_.block_size;
  return shared + r.n * (one - shared);
}

void GenerationEngine::admit() {
  const auto now = std::chrono::steady_clock::now();
  while (!waiting_.empty()) {
    const GenerationRequest& next = waiting_.front().second;
    if (!submitted_.contains(waiting_.front().first)) {  // cancelled while waiting
      waiting_.pop_front();
      continue;
    }
    if (static_cast<int64_t>(active_.size()) + next.n > config_.max_batch) break;
    const int64_t need = group_blocks(next);
    if (config_.paged) {
      // Blocks in use <= the active requests' reservations + the cached blocks no request holds.
      const int64_t pool = cache_->config().num_blocks;
      int64_t idle = prefix_ ? prefix_->idle_blocks() : 0;
      if (reserved_blocks_ + need + idle > pool && idle > 0) idle -= prefix_->evict(reserved_blocks_ + need + idle - pool);
      if (reserved_blocks_ + need + idle > pool) break;  // first come, first served
    }
    const int64_t first = waiting_.front().first, n = next.n;
    GenerationRequest request = std::move(waiting_.front().second);
    waiting_.pop_front();
    std::vector<Active*> group;
    for (int64_t k = 0; k < n; ++k) {
      GenerationRequest r = request;
      r.sampling.seed = request.sampling.seed + static_cast<uint64_t>(k);
      auto a = std::make_unique<Active>(first + k, std::move(r));
      a->blocks = k == 0 ? need - (n - 1) * (need / n) : need / n;  // released per sample; sums to need
      a->result.prompt_tokens = static_cast<int64_t>(a->request.prompt.size());
      a->result.queued_s = std::chrono::duration<double>(now - submitted_.at(a->id)).count();
      group.push_back(a.get());
      active_.push_back(std::move(a));
    }
    reserved_blocks_ += need;
    if (prefix_ && n == 1) {
      // The cached blocks of the prompt's longest cached prefix, leaving its last token to feed.
      Active& a = *group.front();
      const std::vector<int64_t> blocks = prefix_->match(a.request.prompt, (a.result.prompt_tokens - 1) / config_.block_size);
      if (!blocks.empty()) {
        a.seq = cache_->add_sequence_with(blocks);
        a.fed = cache_->length(a.seq);
        a.result.cached_tokens = a.fed;
        a.feeds_prompt = true;
        continue;
      }
    }
    if (feeds_in_chunks(request)) {  // a long prompt: chunks through the rows, one a step (each sample its own)
      for (Active* a : group) a->seq = cache_->add_sequence(), a->feeds_prompt = true;
    } else if (shares_prompt()) {
      prefill(group);
    } else if (whole_prefill()) {  // a contiguous cache would copy the prompt on fork: prefill each
      for (Active* a : group) prefill({a});
    } else {
      for (Active* a : group) a->seq = cache_->add_sequence();  // prompts fed through the rows
    }
  }
}

void GenerationEngine::prefill(const std::vector<Active*>& group) {
  Active& a = *group.front();
  a.seq = cache_->add_sequence();
  const ModelConfig& c = model_.config();
  const int64_t P = static_cast<int64_t>(a.request.prompt.size());
  Backend& backend = model_.backend();
  ActivationStore s = model_.allocate_prompt_store(P);  // logits of the last position only
  backend.write(s.tokens, a.request.prompt.data());  // the prompt, staged on the host
  model_.set_recording(false);  // no MoE routing statistics from generation
  model_.forward(s, false);
  model_.set_recording(true);
  store_prompt(s, a.seq, P);
  stats_.prompt_tokens += P;
  if (prefix_) prefix_->insert(a.request.prompt, P / config_.block_size, a.seq);
  logits_.resize(static_cast<size_t>(c.vocab_size));  // the last position's logits
  backend.read(s.logits.view(0, {c.vocab_size}), logits_.data());
  const float* last = logits_.data();
  const auto now = std::chrono::steady_clock::now();
  for (Active* sample : group) {  // the others share the prompt's blocks (paged fork)
    if (sample != &a) sample->seq = cache_->fork(a.seq);
    if (sample != &a && states_) states_->fork(a.seq, sample->seq);
    sample->fed = P;
    if (on_logits_ && sample->request.logits) on_logits_(sample->id, last, c.vocab_size);
    sampled(*sample, sample->sampler.sample(last, c.vocab_size), now);
  }
}

void GenerationEngine::store_prompt(const ActivationStore& s, int64_t seq, int64_t P) {
  const ModelConfig& c = model_.config();
  const int64_t H = c.n_head, hd = c.head_dim(), W = c.qkv_width(), KW = c.n_kv_head * hd;
  Backend& backend = model_.backend();
  // Each layer's (P, W) q/k/v rows (after RoPE) in f32: the record itself, or (bf16 around the
  // bf16 flash attention: LayerPlan::qkv_bf16) widened once, so the cache holds the values the
  // prompt's attention read. Kept until the cache's flush (write_rows keeps its source). Layers
  // may differ (windowed ones keep an fp32 record); MLA has no q/k/v record.
  std::vector<Tensor> rows;
  for (int64_t l = 0; l < (c.mla() ? 0 : c.n_layer); ++l) {
    const Tensor record = s.blocks[static_cast<size_t>(l)].attention.qkv.view(0, {P, W});
    if (record.dtype() == DTYPE_F32) {
      rows.push_back(record);
      continue;
    }
    rows.push_back(Tensor::empty(backend.allocator(), {P, W}, DTYPE_F32, MEM_WORKSPACE));
    backend.cast(record, rows.back());
  }
  if (cache_->in_backend_memory()) {  // each layer's rows stored from where they are
    for (int64_t t = 0; t < P; ++t) {
      for (int64_t l = 0; l < c.n_layer; ++l) {
        cache_->write_rows(l, {seq}, rows.at(static_cast<size_t>(l)), t, H * hd, H * hd + KW);
      }
      cache_->advance(seq);
    }
    cache_->flush();  // one kv_store for the whole prompt
    return;
  }
  // A host cache: each layer's rows on the host, in place where the host can read the backend's
  // memory, else read in one Backend::read a layer into prefill_qkv_.
  std::vector<float> latent(static_cast<size_t>(c.mla() ? kv_cache_width(c) : 0));
  std::vector<const float*> qkv(static_cast<size_t>(c.n_layer), nullptr);
  if (!c.mla()) {
    const bool in_place = rows.front().host_accessible();
    if (!in_place) prefill_qkv_.resize(static_cast<size_t>(c.n_layer * P * W));
    for (int64_t l = 0; l < c.n_layer; ++l) {
      const Tensor& layer = rows[static_cast<size_t>(l)];
      if (in_place) {
        qkv[static_cast<size_t>(l)] = layer.data<float>();
        continue;
      }
      float* host = prefill_qkv_.data() + l * P * W;
      backend.read(layer, host);
      qkv[static_cast<size_t>(l)] = host;
    }
  }
  for (int64_t t = 0; t < P; ++t) {
    for (int64_t l = 0; l < c.n_layer; ++l) {
      const BlockSaved& b = s.blocks[static_cast<size_t>(l)];
      if (c.mla()) {  // the cache row [normed latent | RoPE key] (nn/mla.h)
        const int64_t dc = c.mla_kv_rank, dr = c.mla_rope_dim;
        backend.read(b.attention.mla_c_norm.view(t * dc, {dc}), latent.data());
        backend.read(b.attention.mla_kr.view(t * dr, {dr}), latent.data() + dc);
        cache_->write(seq, l, latent.data(), nullptr);
        continue;
      }
      const float* row = qkv[static_cast<size_t>(l)] + t * W;
      cache_->write(seq, l, row + H * hd, row + H * hd + KW);
    }
    cache_->advance(seq);
  }
}

void GenerationEngine::sampled(Active& a, int32_t next, std::chrono::steady_clock::time_point now) {
  a.result.tokens.push_back(next);
  ++stats_.generated_tokens;
  if (on_token_) on_token_(a.id, next);
  const double since = std::chrono::duration<double>(now - submitted_.at(a.id)).count();
  if (a.result.tokens.size() == 1) a.result.first_token_s = since;
  const auto& stops = a.request.stop_tokens;
  if (std::find(stops.begin(), stops.end(), next) != stops.end()) a.result.finish = "stop";
  else if (static_cast<int64_t>(a.result.tokens.size()) >= a.request.max_new_tokens) a.result.finish = "length";
  else if (a.fed >= model_.config().max_seq_len) a.result.finish = "context";
  if (!a.result.finish.empty()) a.result.total_s = since;
}

void GenerationEngine::retire() {
  for (size_t i = 0; i < active_.size();) {
    Active& a = *active_[i];
    if (a.result.finish.empty()) {
      ++i;
      continue;
    }
    cache_->release(a.seq);
    if (states_) states_->release(a.seq);
    if (draft_) draft_->release(a.id);
    reserved_blocks_ -= a.blocks;
    finish(a.id, std::move(a.result));
    active_.erase(active_.begin() + static_cast<std::ptrdiff_t>(i));
  }
}

void GenerationEngine::finish(int64_t id, GenerationResult&& result) {
  submitted_.erase(id);
  if (on_finish_) on_finish_(id, std::move(result));
  else results_[id] = std::move(result);
}

void GenerationEngine::cancel(int64_t first, int64_t count) {
  for (int64_t id = first; id < first + count; ++id) {
    const auto active = std::find_if(active_.begin(), active_.end(), [&](const auto& a) { return a->id == id; });
    if (active != active_.end()) {
      if ((*active)->result.finish.empty()) (*active)->result.finish = "cancelled";
      continue;
    }
    if (!submitted_.contains(id)) continue;  // finished already, or unknown
    // Waiting: admit() drops the group once its first id is gone; its results say "cancelled".
    const auto waiting = std::find_if(waiting_.begin(), waiting_.end(), [&](const auto& w) {
      return w.first <= id && id < w.first + w.second.n;
    });
    if (waiting == waiting_.end()) continue;
    const int64_t group = waiting->first, n = waiting->second.n;
    for (int64_t k = group; k < group + n; ++k) {
      if (!submitted_.contains(k)) continue;
      GenerationResult r;
      r.finish = "cancelled";
      r.prompt_tokens = static_cast<int64_t>(waiting->second.prompt.size());
      finish(k, std::move(r));
    }
  }
}

// The rows of a step: every active request's next position (a prompt chunk, or its last token
// and its drafts), in the order of active_.
struct GenerationEngine::StepPlan {
  std::vector<int32_t> tokens;
  std::vector<int64_t> positions;
  std::vector<int64_t> last_row;     // [active] its last row this step (-1: none, its chunk waits)
  std::vector<int64_t> first_logit;  // [active] its first row of the step's logits (-1: none)
  std::vector<int64_t> logit_rows;   // the rows whose logits the step computes, in order
  bool speculating = false;
};

GenerationEngine::StepPlan GenerationEngine::plan_step() {
  StepPlan p;
  rows_->clear();
  // The prompt chunks of a step share one chunk's work, in admission order: the FLOPs of a
  // prompt's first chunk_rows() rows (prompt_budget_), so a step's work beside the decoding rows is
  // bounded however many long prompts arrive at once and however long their prefixes grow (a
  // row deep in a long prompt attends to all before it: fewer rows a step there). The decoding
  // requests' inter-token latency grows by that much work at most.
  double budget = prompt_budget_;
  bool prompt_rows = false;  // the step's first prompt row goes whatever it costs (progress)
  propose_drafts();
  for (const auto& a : active_) {
    const int64_t prompt = static_cast<int64_t>(a->request.prompt.size());
    int64_t m = 1, logits_from = 0;  // the request's rows this step; its first row with logits
    if (a->feeds_prompt && a->fed < prompt) {  // a long prompt, or a prefix-cache hit's rest: one chunk
      m = 0;
      for (; a->fed + m < prompt && m < chunk_rows(); ++m) {
        const double cost = forward_flops_per_position(model_.config(), a->fed + m + 1);
        if (cost > budget && prompt_rows) break;
        budget -= cost, prompt_rows = true;
      }
      if (m == 0) {
        p.last_row.push_back(-1), p.first_logit.push_back(-1);
        continue;
      }
      for (int64_t j = 0; j < m; ++j) p.tokens.push_back(a->request.prompt[static_cast<size_t>(a->fed + j)]);
      logits_from = m - 1;
    } else {
      const bool decoding = a->fed >= prompt;
      p.tokens.push_back(decoding ? a->result.tokens.back() : a->request.prompt[static_cast<size_t>(a->fed)]);
      // With drafts: the last token and the drafts as one chunk, every row's logits read.
      p.tokens.insert(p.tokens.end(), a->drafts.begin(), a->drafts.end());
      m += static_cast<int64_t>(a->drafts.size());
      p.speculating = p.speculating || m > 1;
    }
    const int64_t first = static_cast<int64_t>(p.tokens.size()) - m;
    const bool of_prompt = a->feeds_prompt && a->fed < prompt;
    for (int64_t j = 0; j < m; ++j) p.positions.push_back(a->fed + j), rows_->add(a->seq, j, m, of_prompt);
    p.first_logit.push_back(static_cast<int64_t>(p.logit_rows.size()));
    for (int64_t j = logits_from; j < m; ++j) p.logit_rows.push_back(first + j);
    p.last_row.push_back(first + m - 1);
  }
  return p;
}

std::vector<std::vector<int32_t>> GenerationEngine::verify_drafts(const StepPlan& p, const float* logits) {
  // The model's picks at the last token's row and each draft's, up to the first draft it would
  // not have picked; the cache keeps the rows of the drafts it agreed with.
  const int64_t vocab = model_.config().vocab_size;
  std::vector<std::vector<int32_t>> picked(active_.size());
  for (size_t i = 0; i < active_.size(); ++i) {
    Active& a = *active_[i];
    if (a.drafts.empty() || p.last_row[i] < 0) continue;
    const int64_t m = 1 + static_cast<int64_t>(a.drafts.size());
    for (int64_t j = 0; j < m; ++j) {  // Sampler::verify: the kept drafts and the one after are drawn as sample() would
      const float* row = logits + (p.first_logit[i] + j) * vocab;
      const float* q = a.draft_q.empty() ? nullptr : a.draft_q.data() + j * vocab;  // a draft model's proposal
      picked[i].push_back(j + 1 < m ? a.sampler.verify(row, vocab, a.drafts[static_cast<size_t>(j)], q) : a.sampler.sample(row, vocab));
      if (j + 1 == m || picked[i].back() != a.drafts[static_cast<size_t>(j)]) break;
    }
    rows_->keep(a.seq, static_cast<int64_t>(picked[i].size()));
    stats_.drafted += m - 1;
    stats_.accepted += static_cast<int64_t>(picked[i].size()) - 1;
  }
  return picked;
}

bool GenerationEngine::step() {
  const auto start = std::chrono::steady_clock::now();
  retire();  // cancelled requests free their rows and blocks for this step's admissions
  admit();
  retire();  // a prefill's first token may already finish a request
  if (active_.empty()) {
    const bool more = !waiting_.empty();
    stats_.seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    return more;
  }
  const int64_t vocab = model_.config().vocab_size;
  const StepPlan p = plan_step();
  const int64_t n = static_cast<int64_t>(p.tokens.size()), k = static_cast<int64_t>(p.logit_rows.size());
  // Stores of up to max_batch rows are kept; a step with a prompt chunk gets one with logits for
  // its active requests' last rows only (Transformer::forward_rows' logit_rows), kept while the
  // steps' shape repeats and freed by the first step without one.
  ActivationStore* store = nullptr;
  if (n <= config_.max_batch) {
    chunk_store_ = ActivationStore{}, chunk_shape_ = {0, 0};  // no prompt chunk: not held beside decoding
    auto it = stores_.find(n);
    if (it == stores_.end()) it = stores_.emplace(n, model_.allocate_rows(n)).first;
    store = &it->second;
  } else {
    if (chunk_shape_ != std::pair{n, k}) {
      chunk_store_ = ActivationStore{};  // freed before its successor is allocated
      chunk_store_ = model_.allocate_rows(n, k), chunk_shape_ = {n, k};
    }
    store = &chunk_store_;
  }
  const bool graph = config_.step_graphs && rows_->in_backend_memory() && model_.step_graphs() && !p.speculating;
  const int64_t graphs_before = model_.backend().step_graph_counts().launched;
  model_.forward_rows(*store, p.tokens, p.positions, *rows_, &p.logit_rows, graph);
  stats_.graph_steps += model_.backend().step_graph_counts().launched - graphs_before;
  const auto now = std::chrono::steady_clock::now();
  const bool on_backend = read_step_outputs(store->logits.view(0, {k, vocab}), p);
  const float* logits = logits_.data();
  const std::vector<std::vector<int32_t>> picked = verify_drafts(p, logits);
  rows_->commit();
  stats_.peak_blocks = std::max(stats_.peak_blocks, cache_->blocks_in_use());
  stats_.peak_bytes_used = std::max(stats_.peak_bytes_used, cache_->bytes_used());
  stats_.utilisation_sum += cache_->utilisation();
  cache_->check_status();  // a row its format could not store fails the step (a cache in backend memory)
  for (size_t i = 0; i < active_.size(); ++i) {
    Active& a = *active_[i];
    const int64_t r = p.last_row[i];
    if (r < 0) continue;  // its chunk waits for the next step
    const int64_t row = p.first_logit[i];  // its row of the step's (k, vocab) logits
    if (!a.drafts.empty()) {  // the last token and the accepted drafts are in the cache
      for (size_t j = 0; j < picked[i].size() && a.result.finish.empty(); ++j) {
        ++a.fed;
        if (on_logits_ && a.request.logits) on_logits_(a.id, logits + (row + static_cast<int64_t>(j)) * vocab, vocab);
        sampled(a, picked[i][j], now);
      }
      forget_out_of_window(a);
      continue;
    }
    const int64_t prompt = static_cast<int64_t>(a.request.prompt.size());
    const int64_t fed = rows_->chunk_len[static_cast<size_t>(r)];  // positions this step fed (committed by the chunk)
    if (fed > 1) {
      a.fed += fed;
      stats_.prompt_tokens += fed;
    } else {
      cache_->advance(a.seq);
      ++a.fed;
      forget_out_of_window(a);
      if (a.fed <= prompt) ++stats_.prompt_tokens;
    }
    if (a.fed < prompt) continue;
    if (a.fed == prompt && a.feeds_prompt) {
      if (prefix_) prefix_->insert(a.request.prompt, prompt / config_.block_size, a.seq);
      a.feeds_prompt = false;
    }
    if (on_backend) {
      ++stats_.backend_picks;
      sampled(a, a.sampler.took(picks_[static_cast<size_t>(row)]), now);
      continue;
    }
    if (on_logits_ && a.request.logits) on_logits_(a.id, logits + row * vocab, vocab);
    sampled(a, a.sampler.sample(logits + row * vocab, vocab), now);
  }
  retire();  // their rows and blocks go to the next step's admissions
  ++stats_.steps;
  stats_.rows += n;
  stats_.seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return true;
}

bool GenerationEngine::read_step_outputs(const Tensor& logits, const StepPlan& p) {
  Backend& backend = model_.backend();
  const int64_t n = logits.dim(0);
  const bool on_backend = !p.speculating && cache_->in_backend_memory() && std::none_of(active_.begin(), active_.end(), [&](const auto& a) {
    return on_logits_ && a->request.logits;
  });
  if (!on_backend) {
    logits_.resize(static_cast<size_t>(logits.numel()));
    backend.read(logits, logits_.data());
    return false;
  }
  if (!picks_device_.defined() || picks_device_.numel() < n) {
    picks_device_ = Tensor::empty(backend.allocator(), {n}, DTYPE_I32, MEM_WORKSPACE);
  }
  const Tensor picks = picks_device_.view(0, {n});
  if (std::all_of(active_.begin(), active_.end(), [](const auto& a) { return a->sampler.plain_greedy(); })) {
    backend.argmax_rows(logits, picks);
  } else {
    std::vector<RowSampling> rows(static_cast<size_t>(n));  // a row no request samples: greedy
    std::vector<SamplePenalty> penalties;
    for (size_t i = 0; i < active_.size(); ++i) {
      const int64_t row = p.first_logit[i];
      if (row < 0) continue;
      rows[static_cast<size_t>(row)] = active_[i]->sampler.row();
      active_[i]->sampler.penalties(static_cast<int32_t>(row), penalties);
    }
    backend.sample_rows(logits, rows, penalties, picks);
  }
  picks_.resize(static_cast<size_t>(n));
  backend.read(picks, picks_.data());
  return true;
}

int64_t GenerationEngine::draft_room(const Active& a) const {
  const int64_t generated = static_cast<int64_t>(a.result.tokens.size());
  // Every draft kept yields one more token: at most max_new_tokens in all, and positions below the context.
  return std::max<int64_t>(0, std::min({config_.speculate, a.request.max_new_tokens - generated - 1,
                                        model_.config().max_seq_len - 1 - a.fed}));
}

std::vector<int32_t> GenerationEngine::drafts_for(const Active& a) const {
  const int64_t room = draft_room(a);
  if (room <= 0) return {};
  std::vector<int32_t> context = a.request.prompt;
  context.insert(context.end(), a.result.tokens.begin(), a.result.tokens.end());
  return propose_ngram_drafts(context, config_.ngram, room);
}

void GenerationEngine::propose_drafts() {
  std::vector<DraftRequest> asks;
  std::vector<Active*> asking;
  for (const auto& a : active_) {
    a->drafts.clear(), a->draft_q.clear();
    const bool decoding = a->fed >= static_cast<int64_t>(a->request.prompt.size()) && !a->result.tokens.empty();
    if (!decoding || config_.speculate == 0) continue;
    if (!draft_) {
      a->drafts = drafts_for(*a);
      continue;
    }
    const int64_t room = draft_room(*a);
    if (room == 0) continue;
    DraftRequest r;
    r.id = a->id, r.prompt = &a->request.prompt, r.generated = &a->result.tokens, r.sampling = &a->request.sampling, r.k = room;
    asks.push_back(std::move(r));
    asking.push_back(a.get());
  }
  if (asks.empty()) return;
  draft_->propose(asks);
  for (size_t i = 0; i < asks.size(); ++i) asking[i]->drafts = std::move(asks[i].drafts), asking[i]->draft_q = std::move(asks[i].q);
  stats_.draft_seconds = draft_->seconds();
}

std::vector<int32_t> propose_ngram_drafts(const std::vector<int32_t>& context, int64_t max_n, int64_t k) {
  const int64_t L = static_cast<int64_t>(context.size());
  for (int64_t n = std::min(max_n, L - 1); n >= 1; --n) {
    const auto tail = context.end() - n;
    for (int64_t s = L - n - 1; s >= 0; --s) {  // the latest earlier occurrence
      if (!std::equal(tail, context.end(), context.begin() + s)) continue;
      const int64_t from = s + n, to = std::min(L, from + k);
      return {context.begin() + from, context.begin() + to};
    }
  }
  return {};
}

void apply_kv_preset(EngineConfig& e, const std::string& name, int64_t head_dim) {
  e.group = 0, e.residual = 0;
  e.k_axis = e.v_axis = KV_PER_TOKEN;
  if (name == "fp32" || name == "bf16") {
    e.k_format = e.v_format = parse_kv_format(name);
  } else if (name == "int8" || name == "int4") {
    e.k_format = e.v_format = parse_kv_format(name);
    e.group = head_dim;
  } else if (name == "kivi4" || name == "kivi2") {
    e.k_format = e.v_format = name == "kivi4" ? KV_INT4 : KV_INT2;
    e.k_axis = KV_PER_CHANNEL;
    e.group = head_dim;
    e.residual = 32;
  } else {
    throw Error(str_cat("unknown KV cache format '", name, "', expected fp32, bf16, int8, int4, kivi4 or kivi2"));
  }
}

double teacher_forced_loss(Transformer& model, const std::vector<std::vector<int32_t>>& sequences,
                           const EngineConfig& engine) {
  const ModelConfig& c = model.config();
  const int64_t vocab = c.vocab_size;
  CpuAllocator host;
  auto cache = make_engine_cache(c, engine, model.backend(), host);
  StepRows rows(*cache, c);
  double sum = 0.0;
  int64_t count = 0;
  for (size_t first = 0; first < sequences.size(); first += static_cast<size_t>(engine.max_batch)) {
    const size_t last = std::min(sequences.size(), first + static_cast<size_t>(engine.max_batch));
    const int64_t n = static_cast<int64_t>(last - first);
    const int64_t T = static_cast<int64_t>(sequences[first].size());
    LOOM_CHECK(T >= 2 && T <= c.max_seq_len, "teacher_forced_loss: sequences of 2 to model.max_seq_len tokens, got ", T);
    rows.clear();
    for (size_t s = first; s < last; ++s) {
      LOOM_CHECK(static_cast<int64_t>(sequences[s].size()) == T, "teacher_forced_loss: sequences of equal length");
      rows.add(cache->add_sequence());
    }
    ActivationStore store = model.allocate_rows(n);
    std::vector<float> all(static_cast<size_t>(n * vocab));
    for (int64_t t = 0; t + 1 < T; ++t) {
      std::vector<int32_t> tokens;
      for (size_t s = first; s < last; ++s) tokens.push_back(sequences[s][static_cast<size_t>(t)]);
      model.forward_rows(store, tokens, std::vector<int64_t>(static_cast<size_t>(n), t), rows);
      model.backend().read(store.logits.view(0, {n, vocab}), all.data());
      cache->check_status();
      for (int64_t r = 0; r < n; ++r) {
        const float* logits = all.data() + r * vocab;
        double max = logits[0], z = 0.0;
        for (int64_t v = 1; v < vocab; ++v) max = std::max(max, static_cast<double>(logits[v]));
        for (int64_t v = 0; v < vocab; ++v) z += std::exp(static_cast<double>(logits[v]) - max);
        sum += max + std::log(z) - logits[sequences[first + static_cast<size_t>(r)][static_cast<size_t>(t + 1)]];
        ++count;
        cache->advance(rows.seqs[static_cast<size_t>(r)]);
      }
    }
    for (const int64_t seq : rows.seqs) cache->release(seq);
  }
  return sum / static_cast<double>(count);
}

std::vector<GenerationResult> GenerationEngine::run() {
  while (step()) {
  }
  LOOM_CHECK(waiting_.empty(), "generation engine: ", waiting_.size(), " requests could not be admitted");
  std::vector<GenerationResult> out;
  for (auto& [id, r] : results_) out.push_back(std::move(r));
  results_.clear();
  return out;
}

}  // namespace loom
