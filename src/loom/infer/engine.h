// A generation engine with continuous batching (Orca, Yu et al. 2022; vLLM, Kwon et al. 2023):
// requests wait in a queue; every step admits waiting requests while a batch row and the KV
// blocks they may need are free, runs one position of every active request through the model
// (Transformer::forward_rows: the request's next prompt token during its prefill, else its
// last sampled token), samples each request whose prompt is consumed, and retires the finished
// ones (max_new_tokens, a stop token, or the model's context), freeing their rows and blocks for
// the next step. Requests join and leave between steps.
//
// Each request has its own Sampler (its seed and draw counter) and its own sequence in the KV
// cache, and a row's arithmetic does not depend on the other rows (each row's GEMM outputs are
// the same dot products in the same order, its attention reads only its sequence), so a request
// gets the same tokens in any batch as alone: tests/test_engine.cpp holds it.
//
// Prefill: an admitted request's whole prompt of up to prefill_chunk tokens runs in one forward
// (Transformer::forward over its P positions: GEMMs of P rows; a longer one: "Chunked prefill"),
// its keys and values (each block's saved qkv, after RoPE) go into the cache, and its first
// token is sampled from the last position's logits, before the step's decoding. With EngineConfig::chunked_prefill the prompt is instead fed one token per step as a
// decoding row (chunks of one): no (P, P) attention store, but P steps to the first token.
//
// Chunked prefill (EngineConfig::prefill_chunk = C, default 512; vLLM's chunked prefill,
// llama.cpp's n_batch): a prompt longer than C tokens is fed through the rows in chunks, beside
// the other requests' decoding rows, as a prefix-cache hit's rest is. The prompts being fed share
// one budget a step, in admission order: the forward FLOPs of a prompt's first C rows
// (forward_flops_per_position: 2N for the weights plus the attention over the row's prefix), so a
// row deep in a long prompt, which attends to all before it, costs more of it and a step takes
// fewer of them (at least one). A step is therefore at most one chunk's work plus the decoding
// rows, which wait that long at most however long the prompt grows. Each chunk row attends to the
// sequence's cached positions and the chunk's rows up to itself (ChunkAttention: key tiles read
// from the cache one at a time, two GEMMs per kv head and tile, an online softmax), the chunk is
// stored in the cache after the step, and only each request's last row of the step gets logits.
// A step then holds C rows of activations, k <= max_batch rows of logits and the attention's
// scratch (the chunk's queries and outputs, one key tile), whatever the prompt's length; the
// whole-prompt forward holds every position's activations and attention scores.
//
// Automatic prefix caching (EngineConfig::prefix_cache, infer/prefix_cache.h): a prompt's full
// blocks stay cached after its request; a later request (n = 1) whose prompt starts with cached
// blocks takes them and feeds only the rest of its prompt (at least its last token, for the first
// token's logits) as a chunk of rows in the next step, beside the other requests' decoding rows:
// each chunk row attends to the cached positions and the chunk's rows before it (up to
// kMaxChunk rows a step). Its prompt's full blocks are cached once the prompt is consumed. Cached blocks no request holds are evicted
// least-recently-used when an admission needs room.
//
// Admission reserves the worst case, ceil(min(prompt + max_new, max_seq_len) / block_size)
// blocks (a contiguous cache: one region), so a running request never runs out (no preemption).
// With a sliding window (model.attn_window = W) step() forgets positions older than the window
// (KvCache::forget_before), so the worst case is at most ceil((W + B - 1) / B) blocks, or
// ceil((prompt + 1) / B) with a one-forward prefill (blocks_needed in engine.cpp, exact).
//
// Memory: the model's tensors live in its backend's memory and the engine reaches them only
// through ops and Backend::read / write (the prompt written, the logits read once a step), so
// generation runs on any backend. The KV cache (infer/kv_cache.h "Memory") is host memory on a
// backend the host reads (the CPU: every format's writes and attention on the host, the rows
// staged through DecodeCache's host buffers), and the backend's own memory on one that states
// capabilities().kv_cache (a GPU): a step's rows are stored by one Backend::kv_store and attended
// by one Backend::kv_attention per layer, a prompt stored by one kv_store, nothing of the cache
// crossing to the host (a step with a prefix-cache hit's prompt chunk stages its rows through the
// host; an MLA latent cache stays host memory). There, a step without drafts, with no one reading
// its logits (GenerationRequest::logits, on_logits), takes the backend's tokens
// (Backend::argmax_rows when all are greedy, else Backend::sample_rows with OpenAI's penalties:
// the host sampler's token, backend/sampling_rule.h; 4 bytes a row) instead of reading the
// (n, vocab) logits.
#pragma once
#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "loom/infer/kv_cache.h"
#include "loom/infer/prefix_cache.h"
#include "loom/infer/recurrent_state.h"
#include "loom/infer/sampler.h"
#include "loom/model/transformer.h"

namespace loom {

class DraftModel;
class StepRows;

struct GenerationRequest {
  std::vector<int32_t> prompt;        // at least one token
  SamplingConfig sampling;            // its seed makes the request reproducible
  int64_t max_new_tokens = 64;
  std::vector<int32_t> stop_tokens;   // generation ends after drawing one (it is kept)
  // n samples of this prompt (parallel sampling): ids id .. id + n - 1, sample k drawn with seed
  // sampling.seed + k. They are admitted together, the prompt prefilled once and the samples
  // forked from it: they share the prompt's KV blocks, each copying a block only when it writes
  // into a shared one (copy-on-write).
  int64_t n = 1;
  // Whether the engine's on_logits callback is called for this request. Without it a backend
  // holding the KV cache draws the token itself (Backend::argmax_rows, sample_rows) and the step
  // moves 4 bytes for the row instead of its vocab logits.
  bool logits = true;
};

struct GenerationResult {
  std::vector<int32_t> tokens;        // the new tokens
  std::string finish;                 // "length", "stop", "context" or "cancelled"
  int64_t prompt_tokens = 0;
  int64_t cached_tokens = 0;          // prompt tokens taken from the prefix cache
  double queued_s = 0;                // submit -> admitted
  double first_token_s = 0;           // submit -> first new token (time to first token)
  double total_s = 0;                 // submit -> finished
};

struct EngineConfig {
  int64_t max_batch = 16;             // rows per step
  bool paged = true;                  // paged KV cache, else contiguous (one max_seq_len region per row)
  int64_t block_size = 16;
  int64_t num_blocks = 0;             // paged pool; 0: see kv_memory
  // With num_blocks 0 the paged pool holds max_batch full-length sequences, ceil(max_seq_len /
  // block_size) blocks each, but at most the blocks kv_memory bytes hold (--kv-memory); 0: 90% of
  // the memory available when the engine starts less the file pages the process maps (a model's
  // mapped weights, which the machine counts as reclaimable), default_kv_memory(). A Llama-3-8B
  // shape at 8,192 positions and 16 rows would otherwise reserve 32 GiB of fp32 cache.
  int64_t kv_memory = 0;
  KvFormat k_format = KV_FP32, v_format = KV_FP32;
  KvAxis k_axis = KV_PER_TOKEN, v_axis = KV_PER_TOKEN;
  int64_t group = 0;                  // per-token integer formats: channels per (scale, min)
  int64_t residual = 0;               // KIVI: newest positions kept fp32
  bool chunked_prefill = false;       // prompts one token per step instead of one forward
  // Prompts longer than this many tokens are fed through the rows in chunks of this many, one
  // chunk a step beside the other requests' decoding rows, instead of one forward over the whole
  // prompt, so a step's activations, logits and attention scratch are bounded by the chunk, not
  // the prompt (see "Chunked prefill" above). 0: every prompt in one forward.
  int64_t prefill_chunk = 512;
  // Speculative decoding by prompt lookup (Saxena 2023, vLLM's n-gram speculator): a request's
  // step proposes up to `speculate` tokens, those that followed the latest earlier occurrence of
  // its context's last n tokens (n = ngram down to 1), and the model verifies them in the same
  // step as a chunk of rows (Leviathan et al. 2023 with a one-hot draft, Sampler::verify): a
  // greedy request keeps the drafts the model would have picked and its own pick after them, so
  // its output is the model's; a sampled one keeps each draft with its probability and draws
  // the next token from the rest, so its output is distributed as without speculation. Needs an
  // fp32 KV cache (the drafts' rows attend to each other before they are stored; a quantized row
  // would be attended as stored one step later). 0: off. With a draft model (the engine's
  // constructor, infer/draft_model.h) the drafts are the draft model's instead, verified the same
  // way against its proposal distributions.
  int64_t speculate = 0;
  int64_t ngram = 3;
  // A draft model stops a request's drafts once it gave its own pick a probability below this
  // (--draft-p-min; llama.cpp's option of the same name): a likely rejection is not worth a forward.
  double draft_p_min = 0.0;
  // Automatic prefix caching: needs a paged cache without an fp32 window (fp32, bf16, int8 or
  // int4 with no residual), no sliding window and whole-prompt prefill; prefix_cache_supported.
  bool prefix_cache = false;
  // Decoding steps as one graph each (a CUDA graph: Backend::begin_step_graph): steps whose rows
  // all decode with the cache in the backend's memory (no prompt chunk, no drafts) of a model
  // whose step never waits for the host (Transformer::step_graphs). The same tokens and logits;
  // off by default until a GPU has measured what it gains.
  bool step_graphs = false;
  // Test-only: with a sliding window (model.attn_window > 0), keep every position's KV blocks
  // instead of forgetting those older than the window (KvCache::forget_before).
  bool keep_all_blocks = false;

  void validate() const;  // throws naming the key (generate.max_batch, ...)
};

// The KV cache configuration of `model` under `engine`: k_width = v_width = n_kv_head x head_dim,
// the paged pool sized as EngineConfig::kv_memory says (an Error naming --kv-memory when the
// budget holds no block).
KvCacheConfig engine_cache_config(const ModelConfig& model, const EngineConfig& engine);
// 90% of (available memory - this process's resident file pages), 0 when unknown.
int64_t default_kv_memory();

// Named cache formats (--kv): fp32; bf16; int8 and int4 (keys and values per token, one
// (scale, min) per head: group = head_dim); kivi4 and kivi2 (KIVI, Liu et al. 2024: keys per
// channel over each block of block_size positions, values per token per head, the newest
// `residual` positions in fp32, default 32). Sets the format fields of `engine`; throws naming
// the accepted names.
void apply_kv_preset(EngineConfig& engine, const std::string& name, int64_t head_dim);

// The mean next-token loss (nats) of `sequences` (each of at least 2 tokens), teacher-forced one
// position at a time through a KV cache in `engine`'s formats (max_batch sequences side by side):
// the quality cost of a quantized cache, next to loom eval's loss of the full forward.
double teacher_forced_loss(Transformer& model, const std::vector<std::vector<int32_t>>& sequences,
                           const EngineConfig& engine);

// Why automatic prefix caching cannot run with `engine` on `model` ("" when it can).
std::string prefix_cache_unsupported(const Transformer& model, const EngineConfig& engine);

struct EngineStats {
  int64_t steps = 0;
  int64_t rows = 0;                   // sum over steps of the rows run
  int64_t prompt_tokens = 0, generated_tokens = 0;
  double seconds = 0;                 // in step()
  int64_t peak_blocks = 0;            // blocks in use (paged) or regions (contiguous)
  int64_t peak_bytes_used = 0;        // KV bytes holding positions
  double utilisation_sum = 0;         // of the cache, summed over steps (mean = / steps)
  int64_t backend_picks = 0;          // tokens drawn by Backend::argmax_rows / sample_rows (their logits stayed on the device)
  int64_t graph_steps = 0;            // steps run as one graph (EngineConfig::step_graphs)
  int64_t drafted = 0, accepted = 0;  // speculative decoding: draft tokens verified, and kept
  double draft_seconds = 0;           // of seconds, spent in the draft model's proposals
};

// Prompt lookup: up to k tokens that followed the latest earlier occurrence of the last n tokens
// of context, for the largest n <= max_n whose last n tokens occur earlier; empty when none do.
std::vector<int32_t> propose_ngram_drafts(const std::vector<int32_t>& context, int64_t max_n, int64_t k);

class GenerationEngine {
 public:
  static constexpr int64_t kMaxChunk = 256;  // prompt rows of one request in one step (prefix-cache hits)

  // With `draft` (a smaller model of the same vocabulary; needs config.speculate > 0) the drafts of
  // speculative decoding are the draft model's; its KV cache then shares the default budget
  // (kv_memory 0) with the target's in proportion to their bytes per position.
  GenerationEngine(Transformer& model, EngineConfig config, Transformer* draft = nullptr);
  ~GenerationEngine();

  // Returns its id (0, 1, ...; with n samples the first of n consecutive ids), in submission order.
  int64_t submit(GenerationRequest request);
  // Throws what submit would for this request (a prompt too long, n too large, more blocks than
  // the pool); reads only the configuration, so any thread may call it.
  void check(const GenerationRequest& request) const;
  // One step; false when no request is waiting or active.
  bool step();
  // Steps until every submitted request has finished; the results not yet returned (nor handed
  // to the finish callback), in submission order.
  std::vector<GenerationResult> run();
  // Ends requests ids [first, first + count): a waiting one is never admitted, an active one
  // finishes ("cancelled") and frees its row and blocks at the next step.
  void cancel(int64_t first, int64_t count = 1);

  // Called with (request id, token) as each token is drawn (streaming); empty: none.
  void set_on_token(std::function<void(int64_t, int32_t)> on_token) { on_token_ = std::move(on_token); }
  // Called with (request id, logits, vocab_size) just before each token is drawn from them (the
  // host copy the sampler reads, valid during the call and until on_token for the same id, which
  // the engine calls next with the token drawn from them); empty: none.
  void set_on_logits(std::function<void(int64_t, const float*, int64_t)> on_logits) { on_logits_ = std::move(on_logits); }

  // Called with (request id, result) as each request finishes, instead of keeping the result for
  // run() (a server's engine then holds nothing for finished requests); empty: kept.
  void set_on_finish(std::function<void(int64_t, GenerationResult&&)> on_finish) { on_finish_ = std::move(on_finish); }

  const EngineStats& stats() const { return stats_; }
  const PrefixCache* prefix_cache() const { return prefix_.get(); }
  int64_t waiting() const { return static_cast<int64_t>(waiting_.size()); }
  const KvCache& cache() const { return *cache_; }
  // A hybrid model's linear-attention state at a full batch (max_batch sequences, each
  // recurrent_state_bytes: fixed, whatever their lengths), held in host memory beside the KV cache.
  int64_t recurrent_state_bytes_max() const { return config_.max_batch * recurrent_state_bytes(model_.config()); }
  int64_t active() const { return static_cast<int64_t>(active_.size()); }
  // The bytes a step may hold beside the weights and the KV pool, whatever the prompts' lengths
  // (prefill_chunk > 0; 0 when every prompt runs in one forward, which grows with the prompt):
  // the model's stores of up to max_batch decoding rows (one per row count, kept), a step's store
  // of a prompt chunk beside max_batch x (1 + speculate) decoding rows, a whole prompt's store of
  // prefill_chunk positions (as allocated: their bytes in the backend's tracker, measured at
  // construction), the host's logits of max_batch rows, the chunk's own keys and values before
  // they are stored, and ChunkAttention's scratch. `loom serve` and `loom memory --serve` state it.
  int64_t workspace_bytes() const { return workspace_bytes_; }

 private:
  struct Active;

  int64_t blocks_needed(const GenerationRequest& request) const;
  bool forgets() const;
  void forget_out_of_window(const Active& a);  // after a's newest positions were committed
  bool whole_prefill() const;  // prompts in one forward (else through the rows)
  bool shares_prompt() const;  // n samples prefill once and fork (paged, whole prefill)
  bool feeds_in_chunks(const GenerationRequest& r) const;  // a prompt beyond prefill_chunk
  int64_t chunk_rows() const;  // prompt rows of one request in one step
  int64_t measure_workspace();  // workspace_bytes(), by allocating (untouched) and freeing the stores
  void admit();
  void prefill(const std::vector<Active*>& group);  // group[0]'s prompt; the others forked from it
  // A prefill's P positions (the store's saved q/k/v rows, or MLA latents) into sequence seq.
  void store_prompt(const ActivationStore& s, int64_t seq, int64_t P);
  int64_t group_blocks(const GenerationRequest& request) const;  // the blocks n samples reserve
  void finish(int64_t id, GenerationResult&& result);
  void retire();  // releases the finished requests' sequences and blocks
  // After a new token: finished by a stop token, max_new_tokens or the context.
  void sampled(Active& a, int32_t token, std::chrono::steady_clock::time_point now);
  // A step's (n, vocab) logits to the host (logits_), or, when the step has no drafts and no one
  // reads its logits on a backend holding the KV cache, each row's token drawn by the backend
  // (argmax_rows when every row is plain greedy, else sample_rows under each request's settings
  // and penalties: the host sampler's token) (picks_: 4 bytes a row); returns true for the latter.
  struct StepPlan;
  bool read_step_outputs(const Tensor& logits, const StepPlan& p);
  StepPlan plan_step();  // the step's rows (and rows_'s sequences), each request's drafts proposed
  // Speculative requests' picks ([active]: the accepted drafts, then the model's own), their kept rows set in rows_.
  std::vector<std::vector<int32_t>> verify_drafts(const StepPlan& plan, const float* logits);
  std::vector<int32_t> drafts_for(const Active& a) const;  // this step's speculative tokens (prompt lookup)
  int64_t draft_room(const Active& a) const;  // drafts a may propose this step (max_new_tokens, context)
  void propose_drafts();  // every decoding request's drafts (prompt lookup or the draft model) into Active::drafts

  Transformer& model_;
  EngineConfig config_;
  // A host KV cache on a backend whose memory the host cannot read (and without kv_cache) comes
  // from here (declared before the cache, which it outlives).
  CpuAllocator host_allocator_;
  std::unique_ptr<KvCache> cache_;
  std::unique_ptr<StepRows> rows_;  // the step's rows (infer/step_rows.h)
  std::unique_ptr<RecurrentStates> states_;  // linear-attention blocks' per-sequence state (hybrid models)
  std::unique_ptr<PrefixCache> prefix_;       // EngineConfig::prefix_cache
  std::unique_ptr<DraftModel> draft_;         // speculative decoding's draft model, if any
  std::map<int64_t, ActivationStore> stores_;  // [rows] one-position stores
  // The last step's store with a prompt chunk, kept while its (rows, logit rows) repeat (they do
  // for many steps deep in a long prompt, where the budget takes the same rows a step).
  std::pair<int64_t, int64_t> chunk_shape_{0, 0};
  ActivationStore chunk_store_;
  int64_t workspace_bytes_ = 0;
  double prompt_budget_ = 0.0;  // a step's prompt FLOPs: a prompt's first chunk_rows() rows (plan_step)
  std::deque<std::pair<int64_t, GenerationRequest>> waiting_;
  std::vector<std::unique_ptr<Active>> active_;
  int64_t next_id_ = 0;
  std::map<int64_t, GenerationResult> results_;  // finished, not yet returned by run()
  std::map<int64_t, std::chrono::steady_clock::time_point> submitted_;  // [id] of unfinished requests
  int64_t reserved_blocks_ = 0;                // by the active requests
  EngineStats stats_;
  std::function<void(int64_t, int32_t)> on_token_;
  std::function<void(int64_t, const float*, int64_t)> on_logits_;
  std::function<void(int64_t, GenerationResult&&)> on_finish_;
  std::vector<float> logits_;       // host copy of a step's (n, vocab) logits (or a prefill's last row)
  std::vector<int32_t> picks_;      // the step's rows' tokens drawn on the backend, host copy
  Tensor picks_device_;             // the same in the backend's memory
  std::vector<float> prefill_qkv_;  // host copy of a prefill's (n_layer, P, qkv_width) rows (device memory)
};

}  // namespace loom
