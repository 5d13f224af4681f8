// The generation engine (infer/engine.h): the row decoding path reproduces the full forward,
// continuous batching gives every request the tokens it gets alone, paged and contiguous caches
// agree, waste stays under one block per sequence, and bad requests are refused.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <map>
#include <random>
#include <set>
#include <string>

#include "loom/core/error.h"
#include "loom/infer/chunk_attention.h"
#include "loom/infer/engine.h"
#include "loom/infer/score.h"
#include "kv_test_util.h"
#include "test_util.h"

namespace loom {
namespace {

// Token streams of the model's vocabulary (deterministic).
std::vector<int32_t> prompt_of(int64_t length, int64_t salt, int64_t vocab) {
  std::vector<int32_t> p;
  for (int64_t i = 0; i < length; ++i) p.push_back(static_cast<int32_t>((i * 31 + salt * 17 + i * i * salt) % vocab));
  return p;
}

std::vector<GenerationRequest> requests(int64_t vocab, int64_t context) {
  std::vector<GenerationRequest> out;
  for (int64_t i = 0; i < 12; ++i) {
    GenerationRequest r;
    r.prompt = prompt_of(1 + (i * 5) % 9, i, vocab);
    r.max_new_tokens = 2 + (i * 7) % 11;
    if (static_cast<int64_t>(r.prompt.size()) + r.max_new_tokens > context) r.max_new_tokens = context - r.prompt.size();
    r.sampling.seed = 100 + static_cast<uint64_t>(i);
    r.sampling.temperature = i % 3 == 0 ? 0.0f : 0.9f;  // greedy, and sampled
    r.sampling.top_k = i % 3 == 1 ? 20 : 0;
    r.sampling.top_p = i % 3 == 2 ? 0.9f : 1.0f;
    if (i == 4) r.stop_tokens = {static_cast<int32_t>(i)};
    out.push_back(std::move(r));
  }
  return out;
}

std::vector<GenerationResult> generate_all(Transformer& model, const std::vector<GenerationRequest>& reqs,
                                           EngineConfig config) {
  GenerationEngine engine(model, config);
  for (const GenerationRequest& r : reqs) engine.submit(r);
  return engine.run();
}

// A request alone, in an engine of one row.
std::vector<int32_t> alone(Transformer& model, const GenerationRequest& r, bool paged, bool chunked = false) {
  EngineConfig one;
  one.max_batch = 1, one.paged = paged, one.chunked_prefill = chunked;
  return generate_all(model, {r}, one).front().tokens;
}

// Also with a sliding window (model.attn_window = 3 < T = 11): each row attends to its last 3
// positions, as row t of the windowed forward does; and with Qwen3's q/k norm plus Llama 3.1's
// RoPE scaling (each row normed and rotated at its own position); and with SmolLM3's NoPE layers,
// OLMo 2's post-norms and Gemma 3's blocks (a windowed and a global layer, each with its RoPE).
TEST(EngineTest, RowDecodingMatchesTheFullForward) {
  for (const std::string preset : {"gpt2-tiny", "llama-tiny", "moe-tiny", "gpt2-tiny+window", "llama-tiny+window",
                                   "llama-tiny+qknorm", "llama-tiny+nope", "llama-tiny+olmo2", "gemma-tiny"}) {
    const bool windowed = preset.find("+window") != std::string::npos;
    ModelConfig config = model_preset(preset.substr(0, preset.find('+')));
    if (windowed) config.attn_window = 3;
    if (preset.find("+qknorm") != std::string::npos) {
      config.qk_norm = true;
      config.rope_scaling = ROPE_SCALING_LLAMA3;
      config.rope_factor = 4.0f;
      config.rope_original_context = 8;
    }
    if (preset.find("+nope") != std::string::npos) config.nope_interval = 2;  // SmolLM3's NoPE: layer 1 unrotated
    if (preset.find("+olmo2") != std::string::npos) {  // OLMo 2: output norms, whole-width q/k norms
      config.post_norm = config.qk_norm = config.qk_norm_whole = true;
    }
    auto backend = make_cpu_backend();
    Transformer model(*backend, config);
    model.init_weights(3);
    const int64_t T = 11, V = config.vocab_size;
    ActivationStore full = model.allocate_store(1, T);
    const std::vector<int32_t> tokens = prompt_of(T, 5, V);
    std::copy(tokens.begin(), tokens.end(), full.tokens.data<int32_t>());
    model.forward(full, false);
    // Two sequences decoded side by side, one two positions behind.
    EngineConfig ec;
    ec.max_batch = 2;
    auto cache = make_paged_kv_cache(engine_cache_config(config, ec), &backend->allocator());
    kvtest::CacheRows rows;
    rows.cache = cache.get(), rows.config = &config;
    rows.seqs = {cache->add_sequence(), cache->add_sequence()};
    ActivationStore one = model.allocate_rows(1), two = model.allocate_rows(2);
    const std::vector<int64_t> seqs = rows.seqs;
    for (int64_t t = 0; t < T + 2; ++t) {
      std::vector<int32_t> toks;
      std::vector<int64_t> pos;
      rows.seqs.clear();
      for (int64_t r = 0; r < 2; ++r) {  // sequence 1 runs two positions behind sequence 0
        const int64_t p = t - 2 * r;
        if (p < 0 || p >= T) continue;
        toks.push_back(tokens[p]), pos.push_back(p), rows.seqs.push_back(seqs[r]);
      }
      ActivationStore& step = toks.size() == 2 ? two : one;
      model.forward_rows(step, toks, pos, rows);
      for (size_t r = 0; r < toks.size(); ++r) {
        const float* expected = full.logits.data<float>() + pos[r] * V;
        const float* got = step.logits.data<float>() + static_cast<int64_t>(r) * V;
        for (int64_t v = 0; v < V; ++v) ASSERT_NEAR(got[v], expected[v], 1e-5) << preset << " position " << pos[r];
        cache->advance(rows.seqs[r]);
      }
    }
    EXPECT_EQ(cache->length(seqs[0]), T);
    EXPECT_EQ(cache->length(seqs[1]), T);
  }
}

// A prompt's store (the engine's prefill) holds the last position's logits alone: V floats
// instead of T V, equal to the whole forward's last row within f32 rounding (the head multiplies
// one row); a loss over it is refused.
// A tiny preset with a 64-position context; "+window": a sliding window of 3 positions
// (gemma-tiny: its windowed layer 0 and global layer 1).
ModelConfig long_context_preset(const std::string& preset) {
  ModelConfig config = model_preset(preset.substr(0, preset.find('+')));
  config.max_seq_len = 64;
  if (preset.find("+window") != std::string::npos) config.attn_window = 3;
  return config;
}

// Speculative decoding by prompt lookup (EngineConfig::speculate): the greedy requests' tokens
// equal those without it (verified in chunks of drafts; a sampled one keeps its length),
// for MHA, GQA, MoE and a sliding window, while drafts are kept (prompts that repeat a pattern)
// and the run takes fewer steps; the proposer takes the latest earlier occurrence of the longest
// recurring suffix; a quantized cache is refused.
TEST(EngineTest, SpeculativeDecodingKeepsTheGreedyTokens) {
  EXPECT_EQ(propose_ngram_drafts({1, 2, 3, 4, 1, 2}, 3, 3), (std::vector<int32_t>{3, 4, 1}));
  EXPECT_EQ(propose_ngram_drafts({1, 2, 9, 1, 2, 7, 1, 2}, 3, 4), (std::vector<int32_t>{7, 1, 2}));
  EXPECT_EQ(propose_ngram_drafts({4, 5, 6, 5, 6}, 3, 1), (std::vector<int32_t>{5}));  // [5, 6] recurs
  EXPECT_TRUE(propose_ngram_drafts({1, 2, 3}, 3, 4).empty());
  EXPECT_TRUE(propose_ngram_drafts({7}, 3, 4).empty());
  int64_t kept = 0;
  for (const std::string preset : {"gpt2-tiny", "llama-tiny", "moe-tiny", "llama-tiny+window"}) {
    const ModelConfig config = long_context_preset(preset);
    auto backend = make_cpu_backend();
    Transformer model(*backend, config, ModelUse{.gradients = false});
    model.init_weights(4);
    const int64_t V = config.vocab_size;
    std::vector<GenerationRequest> reqs(4);
    for (int64_t i = 0; i < 4; ++i) {
      const std::vector<int32_t> motif = prompt_of(3 + i, 10 + i, V);
      for (int rep = 0; rep < 4; ++rep) reqs[i].prompt.insert(reqs[i].prompt.end(), motif.begin(), motif.end());
      reqs[i].max_new_tokens = i == 3 ? 6 : 24 + i;
      reqs[i].sampling.temperature = i == 3 ? 0.9f : 0.0f;  // the last one sampled
      reqs[i].sampling.seed = 7 + static_cast<uint64_t>(i);
    }
    EngineConfig plain;
    plain.max_batch = 4, plain.block_size = 4;
    EngineConfig spec = plain;
    spec.speculate = 4;
    GenerationEngine a(model, plain), b(model, spec);
    for (const GenerationRequest& r : reqs) a.submit(r), b.submit(r);
    const std::vector<GenerationResult> want = a.run(), got = b.run();
    for (size_t i = 0; i < 3; ++i) EXPECT_EQ(got[i].tokens, want[i].tokens) << preset << " request " << i;
    // The sampled request verifies its drafts by Sampler::verify (its distribution: SamplerTest):
    // other draws, the same length.
    EXPECT_EQ(got[3].tokens.size(), want[3].tokens.size()) << preset;
    EXPECT_GT(b.stats().drafted, 0) << preset;
    EXPECT_LE(b.stats().accepted, b.stats().drafted) << preset;
    if (b.stats().accepted > 0) {
      EXPECT_LT(b.stats().steps, a.stats().steps) << preset;
    }
    kept += b.stats().accepted;
  }
  EXPECT_GT(kept, 0);
  EngineConfig quantized;
  apply_kv_preset(quantized, "int8", 8);
  quantized.speculate = 2;
  EXPECT_NE(test::error_of([&] { quantized.validate(); }).find("--speculate needs an fp32 KV cache"), std::string::npos);
}

// Speculative decoding with a draft model (GenerationEngine's draft, infer/draft_model.h): the
// greedy requests' tokens equal the target's alone, with a draft of the target's own weights
// (nearly every draft kept, fewer steps) and with a smaller random one (few kept), for MHA, GQA,
// MoE and a sliding window, prompts longer than a prefill chunk among them (the draft catches
// up in chunks); a sampled request keeps its length. A draft of another vocabulary or a shorter
// context, and a draft without --speculate, are refused by name.
TEST(EngineTest, DraftModelKeepsTheGreedyTokens) {
  for (const std::string preset : {"gpt2-tiny", "llama-tiny", "moe-tiny", "llama-tiny+window", "gemma-tiny"}) {
    const ModelConfig config = long_context_preset(preset);
    auto backend = make_cpu_backend();
    Transformer model(*backend, config, ModelUse{.gradients = false}), same(*backend, config, ModelUse{.gradients = false});
    model.init_weights(4), same.init_weights(4);
    ModelConfig small_config = config;
    small_config.n_layer = 1;
    Transformer small(*backend, small_config, ModelUse{.gradients = false});
    small.init_weights(9);
    const int64_t V = config.vocab_size;
    std::vector<GenerationRequest> reqs(4);
    for (int64_t i = 0; i < 4; ++i) {
      reqs[i].prompt = prompt_of(3 + i, i == 1 ? 21 : 5 + i, V);  // request 1's prompt is fed in chunks of 8
      reqs[i].max_new_tokens = i == 3 ? 6 : 20 + i;
      reqs[i].sampling.temperature = i == 3 ? 0.9f : 0.0f;
      reqs[i].sampling.seed = 7 + static_cast<uint64_t>(i);
    }
    EngineConfig plain;
    plain.max_batch = 4, plain.block_size = 4, plain.prefill_chunk = 8;
    EngineConfig spec = plain;
    spec.speculate = 3;
    GenerationEngine a(model, plain), b(model, spec, &same), c(model, spec, &small);
    for (const GenerationRequest& r : reqs) a.submit(r), b.submit(r), c.submit(r);
    const std::vector<GenerationResult> want = a.run(), own = b.run(), other = c.run();
    for (size_t i = 0; i < 3; ++i) {
      EXPECT_EQ(own[i].tokens, want[i].tokens) << preset << " request " << i;
      EXPECT_EQ(other[i].tokens, want[i].tokens) << preset << " request " << i;
    }
    EXPECT_EQ(own[3].tokens.size(), want[3].tokens.size()) << preset;
    EXPECT_EQ(other[3].tokens.size(), want[3].tokens.size()) << preset;
    EXPECT_GT(b.stats().drafted, 20) << preset;
    EXPECT_GE(b.stats().accepted, b.stats().drafted * 9 / 10) << preset;  // its own weights: its picks
    EXPECT_LT(b.stats().steps, a.stats().steps * 2 / 3) << preset;
    EXPECT_LT(c.stats().accepted, b.stats().accepted) << preset;
    EXPECT_GT(b.stats().draft_seconds, 0.0) << preset;
  }
  auto backend = make_cpu_backend();
  const ModelConfig config = long_context_preset("llama-tiny");
  Transformer model(*backend, config, ModelUse{.gradients = false});
  ModelConfig other = config;
  other.vocab_size = config.vocab_size + 1;
  Transformer wrong_vocab(*backend, other, ModelUse{.gradients = false});
  other = config;
  other.max_seq_len = config.max_seq_len / 2;
  Transformer short_context(*backend, other, ModelUse{.gradients = false});
  EngineConfig spec;
  spec.speculate = 2;
  EXPECT_NE(test::error_of([&] { GenerationEngine e(model, spec, &wrong_vocab); }).find("draft model's vocabulary"), std::string::npos);
  EXPECT_NE(test::error_of([&] { GenerationEngine e(model, spec, &short_context); }).find("draft model's context"), std::string::npos);
  spec.speculate = 0;
  EXPECT_NE(test::error_of([&] { GenerationEngine e(model, spec, &model); }).find("needs --speculate"), std::string::npos);
}

// The paged pool's budget (EngineConfig::kv_memory, --kv-memory): max_batch full-length
// sequences when they fit, else the blocks the budget holds; a budget below one block is refused
// naming it; --kv-blocks is taken as given. A request the capped pool cannot hold is refused at
// submit with the numbers (serve's 400). parse_bytes reads the option's sizes.
TEST(EngineTest, KvPoolFitsTheMemoryBudget) {
  ModelConfig config = model_preset("llama-tiny");
  config.max_seq_len = 64;
  EngineConfig ec;
  ec.max_batch = 4, ec.block_size = 4;
  const int64_t block = kv_block_bytes(engine_cache_config(config, [&] { EngineConfig e = ec; e.num_blocks = 1; return e; }()));
  EXPECT_EQ(block, 2 * 2 * 4 * 16 * 4);  // K and V, 2 layers, 4 positions, 2 kv heads x 8 channels, fp32
  ec.kv_memory = 1 << 30;
  EXPECT_EQ(engine_cache_config(config, ec).num_blocks, 4 * 16);  // all full-length sequences fit
  ec.kv_memory = 10 * block + block / 2;
  EXPECT_EQ(engine_cache_config(config, ec).num_blocks, 10);
  ec.kv_memory = block - 1;
  const std::string e = test::error_of([&] { engine_cache_config(config, ec); });
  EXPECT_NE(e.find("--kv-memory"), std::string::npos) << e;
  EXPECT_NE(e.find("holds no block"), std::string::npos) << e;
  ec.num_blocks = 7;
  EXPECT_EQ(engine_cache_config(config, ec).num_blocks, 7);
  ec.num_blocks = 0, ec.kv_memory = 0;
  EXPECT_GE(engine_cache_config(config, ec).num_blocks, 1);  // 90% of what this machine has: at least a block
  // A request beyond the capped pool: refused before any work, naming the blocks.
  auto backend = make_cpu_backend();
  Transformer model(*backend, config, ModelUse{.gradients = false});
  model.init_weights(1);
  ec.kv_memory = 10 * block;
  GenerationEngine engine(model, ec);
  GenerationRequest r;
  r.prompt = prompt_of(30, 1, config.vocab_size), r.max_new_tokens = 20;  // 50 positions: 13 blocks
  const std::string refused = test::error_of([&] { engine.submit(r); });
  EXPECT_NE(refused.find("needs 13 KV blocks"), std::string::npos) << refused;
  r.max_new_tokens = 8;  // 38 positions: 10 blocks
  EXPECT_NO_THROW(engine.submit(r));
  EXPECT_EQ(engine.run().front().tokens.size(), 8u);

  EXPECT_EQ(parse_bytes("4096", "x"), 4096);
  EXPECT_EQ(parse_bytes("8GiB", "x"), int64_t{8} << 30);
  EXPECT_EQ(parse_bytes("512M", "x"), int64_t{512} << 20);
  EXPECT_EQ(parse_bytes("1.5KB", "x"), 1536);
  for (const char* bad : {"", "G", "8X", "-1G", "0", "8 GiB", "8GiBs"}) {
    EXPECT_NE(test::error_of([&] { parse_bytes(bad, "--kv-memory"); }).find("--kv-memory: '"), std::string::npos) << bad;
  }
}

// Chunked prefill (EngineConfig::prefill_chunk): prompts of 45 and 20 tokens fed 8 rows a step
// between them (the second waits for the first's chunks), beside a short request's decoding rows, give the first token's logits of the whole-prompt
// forward within 1e-5 (its rows' attention: flash attention against the cache's kernel) and the
// same greedy tokens, for MHA, GQA and a sliding window (3 < the chunk); a prompt of up to 8
// tokens still runs in one forward. The activations a long prompt's steps hold do not grow with
// the prompt (24 and 56 tokens: the same peak), where the whole-prompt forward's do.
TEST(EngineTest, ChunkedPrefillMatchesTheWholeForwardInBoundedMemory) {
  for (const std::string preset : {"gpt2-tiny", "llama-tiny", "llama-tiny+window", "gemma-tiny"}) {
    const ModelConfig config = long_context_preset(preset);
    auto backend = make_cpu_backend();
    Transformer model(*backend, config, ModelUse{.gradients = false});
    model.init_weights(9);
    const int64_t V = config.vocab_size;
    std::vector<GenerationRequest> reqs(3);
    reqs[0].prompt = prompt_of(45, 1, V), reqs[0].max_new_tokens = 6;
    reqs[1].prompt = prompt_of(3, 2, V), reqs[1].max_new_tokens = 12;
    reqs[2].prompt = prompt_of(20, 3, V), reqs[2].max_new_tokens = 5;
    for (GenerationRequest& r : reqs) r.sampling.temperature = 0.0f;
    auto run = [&](int64_t chunk, std::map<int64_t, std::vector<float>>& first_logits) {
      EngineConfig ec;
      ec.max_batch = 3, ec.block_size = 4, ec.prefill_chunk = chunk;
      GenerationEngine engine(model, ec);
      engine.set_on_logits([&](int64_t id, const float* logits, int64_t vocab) {
        if (!first_logits.contains(id)) first_logits[id].assign(logits, logits + vocab);
      });
      for (const GenerationRequest& r : reqs) engine.submit(r);
      // The two long prompts share one chunk's rows a step (8), beside at most 3 decoding rows.
      int64_t rows = 0, most = 0;
      while (engine.step()) most = std::max(most, engine.stats().rows - rows), rows = engine.stats().rows;
      if (chunk > 0) {
        EXPECT_LE(most, chunk + 3) << preset;
      }
      std::vector<GenerationResult> out = engine.run();
      EXPECT_EQ(engine.stats().prompt_tokens, 45 + 3 + 20) << preset;
      return out;
    };
    std::map<int64_t, std::vector<float>> whole_logits, chunk_logits;
    const std::vector<GenerationResult> whole = run(0, whole_logits), chunked = run(8, chunk_logits);
    for (size_t i = 0; i < reqs.size(); ++i) {
      EXPECT_EQ(chunked[i].tokens, whole[i].tokens) << preset << " request " << i;
      const std::vector<float>& a = whole_logits.at(static_cast<int64_t>(i));
      const std::vector<float>& b = chunk_logits.at(static_cast<int64_t>(i));
      ASSERT_EQ(a.size(), b.size());
      for (int64_t v = 0; v < V; ++v) ASSERT_NEAR(b[static_cast<size_t>(v)], a[static_cast<size_t>(v)], 1e-5) << preset << " request " << i;
    }
    // Peak activation bytes of one request of P prompt tokens, from a fresh engine.
    auto peak = [&](int64_t P, int64_t chunk) {
      MemoryTracker& mem = backend->allocator().tracker();
      GenerationRequest r;
      r.prompt = prompt_of(P, 4, V), r.max_new_tokens = 2;
      EngineConfig ec;
      ec.max_batch = 2, ec.block_size = 4, ec.prefill_chunk = chunk;
      mem.reset_peaks();
      const size_t before = mem.current(MEM_ACTIVATIONS);
      GenerationEngine engine(model, ec);
      engine.submit(r);
      engine.run();
      return mem.peak(MEM_ACTIVATIONS) - before;
    };
    EXPECT_EQ(peak(24, 8), peak(56, 8)) << preset;
    EXPECT_GT(peak(56, 0), peak(24, 0)) << preset;
    EXPECT_LT(peak(56, 8), peak(56, 0)) << preset;
    // The workspace the engine states covers what a chunked prompt's steps allocate, and is 0
    // (unbounded) for whole-prompt prefill.
    EngineConfig ec;
    ec.max_batch = 2, ec.block_size = 4, ec.prefill_chunk = 8;
    const int64_t stated = GenerationEngine(model, ec).workspace_bytes();
    EXPECT_GE(stated, static_cast<int64_t>(peak(56, 8))) << preset;
    ec.prefill_chunk = 0;
    EXPECT_EQ(GenerationEngine(model, ec).workspace_bytes(), 0) << preset;
  }
}

TEST(EngineTest, PromptStoreKeepsOnlyTheLastLogits) {
  for (const std::string preset : {"gpt2-tiny", "llama-tiny"}) {
    const ModelConfig config = model_preset(preset);
    auto backend = make_cpu_backend();
    Transformer model(*backend, config, ModelUse{.gradients = false});
    model.init_weights(3);
    const int64_t T = 11, V = config.vocab_size;
    const std::vector<int32_t> tokens = prompt_of(T, 5, V);
    ActivationStore full = model.allocate_store(1, T), prompt = model.allocate_prompt_store(T);
    std::copy(tokens.begin(), tokens.end(), full.tokens.data<int32_t>());
    std::copy(tokens.begin(), tokens.end(), prompt.tokens.data<int32_t>());
    model.forward(full, false);
    model.forward(prompt, false);
    ASSERT_EQ(prompt.logits.numel(), V) << preset;
    double scale = 0.0, worst = 0.0;
    for (int64_t v = 0; v < V; ++v) {
      const double want = full.logits.data<float>()[(T - 1) * V + v];
      scale = std::max(scale, std::fabs(want));
      worst = std::max(worst, std::fabs(prompt.logits.data<float>()[v] - want));
    }
    EXPECT_LE(worst, 1e-6 * scale) << preset;
    EXPECT_NE(test::error_of([&] { model.forward(prompt, true); }).find("last-position logits"), std::string::npos);
    // The inference store's layers share one record (each its own input and qkv): the same bits
    // as a training model's store, in a fraction of its activation bytes.
    auto train_backend = make_cpu_backend();
    Transformer trained(*train_backend, config);
    trained.init_weights(3);
    ActivationStore whole = trained.allocate_store(1, T);
    std::copy(tokens.begin(), tokens.end(), whole.tokens.data<int32_t>());
    trained.forward(whole, false);
    EXPECT_EQ(std::memcmp(whole.logits.data<float>(), full.logits.data<float>(), full.logits.nbytes()), 0) << preset;
    for (int64_t l = 0; l < config.n_layer; ++l) {
      const Tensor& a = whole.blocks[static_cast<size_t>(l)].attention.qkv, &b = full.blocks[static_cast<size_t>(l)].attention.qkv;
      EXPECT_EQ(std::memcmp(a.data<float>(), b.data<float>(), a.nbytes()), 0) << preset << " layer " << l;
    }
    auto fresh = make_cpu_backend();
    Transformer inference(*fresh, config, ModelUse{.gradients = false});
    const ActivationStore alone = inference.allocate_store(1, T);
    const size_t shared = fresh->allocator().tracker().current(MEM_ACTIVATIONS);
    const size_t kept = train_backend->allocator().tracker().current(MEM_ACTIVATIONS);
    EXPECT_LT(shared, kept) << preset;
    std::printf("%s (%lld layers): activation bytes of an inference store %zu, a training store %zu\n", preset.c_str(),
                static_cast<long long>(config.n_layer), shared, kept);
  }
}

TEST(EngineTest, ContinuousBatchingGivesEachRequestItsTokensAlone) {
  for (const char* preset : {"gpt2-tiny", "llama-tiny", "moe-tiny", "mla-tiny"}) {
    const ModelConfig config = model_preset(preset);
    auto backend = make_cpu_backend();
    Transformer model(*backend, config);
    model.init_weights(11);
    const std::vector<GenerationRequest> reqs = requests(config.vocab_size, config.max_seq_len);
    EngineConfig batched;
    batched.max_batch = 4;  // 12 requests: they queue, join as others finish
    batched.block_size = 4;
    const std::vector<GenerationResult> together = generate_all(model, reqs, batched);
    ASSERT_EQ(together.size(), reqs.size());
    int64_t stopped = 0;
    for (size_t i = 0; i < reqs.size(); ++i) {
      EXPECT_EQ(together[i].tokens, alone(model, reqs[i], true)) << preset << " request " << i;
      EXPECT_EQ(together[i].tokens, alone(model, reqs[i], false)) << preset << " request " << i << " (contiguous)";
      EXPECT_FALSE(together[i].tokens.empty());
      EXPECT_LE(static_cast<int64_t>(together[i].tokens.size()), reqs[i].max_new_tokens);
      if (together[i].finish == "stop") {
        ++stopped;
        EXPECT_EQ(together[i].tokens.back(), reqs[i].stop_tokens.front());
      } else {
        EXPECT_EQ(static_cast<int64_t>(together[i].tokens.size()), reqs[i].max_new_tokens) << together[i].finish;
      }
    }
    // Chunked prefill (prompts fed one token per step among the decoding rows): the same per request.
    EngineConfig chunked = batched;
    chunked.chunked_prefill = true;
    const std::vector<GenerationResult> ch = generate_all(model, reqs, chunked);
    for (size_t i = 0; i < reqs.size(); ++i) {
      EXPECT_EQ(ch[i].tokens, alone(model, reqs[i], true, true)) << preset << " request " << i << " (chunked prefill)";
    }
    // Different seeds and sampling settings give different continuations.
    EXPECT_NE(together[1].tokens, together[2].tokens) << preset;
    // The same batch on a contiguous cache.
    EngineConfig contiguous = batched;
    contiguous.paged = false;
    const std::vector<GenerationResult> c = generate_all(model, reqs, contiguous);
    for (size_t i = 0; i < reqs.size(); ++i) EXPECT_EQ(c[i].tokens, together[i].tokens) << preset << " request " << i;
  }
}

TEST(EngineTest, RequestsJoinAndLeaveAndWasteStaysUnderABlockPerSequence) {
  const ModelConfig config = model_preset("llama-tiny");
  auto backend = make_cpu_backend();
  Transformer model(*backend, config);
  model.init_weights(5);
  const std::vector<GenerationRequest> reqs = requests(config.vocab_size, config.max_seq_len);
  EngineConfig ec;
  ec.max_batch = 5, ec.block_size = 4;
  GenerationEngine engine(model, ec);
  for (const GenerationRequest& r : reqs) engine.submit(r);
  int64_t most = 0, steps = 0, joined_later = 0, previous = 0;
  while (engine.step()) {
    ++steps;
    const KvCache& cache = engine.cache();
    const int64_t active = engine.active();
    // Every sequence's blocks hold all its positions but at most one partly filled block.
    EXPECT_LT(cache.blocks_in_use() * ec.block_size - cache.positions_in_use(), std::max<int64_t>(active, 1) * ec.block_size);
    EXPECT_LE(active, ec.max_batch);
    most = std::max(most, active);
    if (steps > 1 && active > previous) ++joined_later;
    previous = active;
  }
  EXPECT_EQ(most, ec.max_batch);
  EXPECT_GT(joined_later, 0);  // requests were admitted while others ran
  EXPECT_EQ(engine.cache().blocks_in_use(), 0);  // all released
  const EngineStats& st = engine.stats();
  int64_t prompt = 0, generated = 0;
  for (const GenerationRequest& r : reqs) prompt += static_cast<int64_t>(r.prompt.size());
  for (const GenerationResult& r : engine.run()) generated += static_cast<int64_t>(r.tokens.size());
  EXPECT_EQ(st.prompt_tokens, prompt);
  EXPECT_EQ(st.generated_tokens, generated);
  EXPECT_EQ(st.steps, steps);
}

// Teacher-forced loss through the cache: fp32 equals the full forward's loss; quantized caches
// cost a little (int8 less than int4 less than 2-bit).
TEST(EngineTest, TeacherForcedLossThroughTheCacheMatchesTheForward) {
  const ModelConfig config = model_preset("llama-tiny");
  auto backend = make_cpu_backend();
  Transformer model(*backend, config);
  model.init_weights(9);
  const int64_t B = 3, T = config.max_seq_len;
  std::vector<std::vector<int32_t>> seqs;
  ActivationStore full = model.allocate_store(B, T - 1);
  for (int64_t b = 0; b < B; ++b) {
    seqs.push_back(prompt_of(T, b + 1, config.vocab_size));
    for (int64_t t = 0; t + 1 < T; ++t) {
      full.tokens.data<int32_t>()[b * (T - 1) + t] = seqs[b][t];
      full.targets.data<int32_t>()[b * (T - 1) + t] = seqs[b][t + 1];
    }
  }
  const double expected = model.forward(full);
  EngineConfig ec;
  ec.max_batch = 2, ec.block_size = 4;  // two chunks of sequences
  std::map<std::string, double> loss;
  for (const char* kv : {"fp32", "bf16", "int8", "int4", "kivi2"}) {
    apply_kv_preset(ec, kv, config.head_dim());
    ec.residual = std::min<int64_t>(ec.residual, 4);
    loss[kv] = teacher_forced_loss(model, seqs, ec);
  }
  EXPECT_NEAR(loss["fp32"], expected, 1e-5 * expected);
  EXPECT_NEAR(loss["bf16"], expected, 1e-3 * expected);
  EXPECT_NEAR(loss["int8"], expected, 1e-2 * expected);
  EXPECT_GT(std::abs(loss["kivi2"] - expected), std::abs(loss["int8"] - expected));
  EXPECT_NE(test::error_of([&] { apply_kv_preset(ec, "int3", 8); }).find("kivi2"), std::string::npos);
}

// KV bytes per token of a model's cache: L layers x (K + V) rows of n_kv_head x head_dim values,
// 4 bytes each in fp32 (MHA: n_kv_head = n_head; GQA: fewer; MQA: 1), 2 in bf16, and for the
// integer formats b/8 bytes a value plus a (scale, min) fp16 pair per group (per token: a group
// of head_dim channels; KIVI keys per channel: one pair per channel per block of B positions).
TEST(EngineTest, KvBytesPerTokenMatchTheirFormulas) {
  ModelConfig mqa = model_preset("llama-tiny");
  mqa.n_kv_head = 1;
  for (const ModelConfig& c : {model_preset("gpt2-124m"), model_preset("llama-tiny"), mqa}) {
    const double L = static_cast<double>(c.n_layer), w = static_cast<double>(c.n_kv_head * c.head_dim());
    const double hd = static_cast<double>(c.head_dim()), B = 16;
    EngineConfig ec;
    ec.block_size = 16;
    const std::map<std::string, double> expected = {
        {"fp32", L * 2 * 4 * w},
        {"bf16", L * 2 * 2 * w},
        {"int8", L * 2 * (w + 4 * w / hd)},
        {"int4", L * 2 * (w / 2 + 4 * w / hd)},
        {"kivi4", L * ((w / 2 + 4 * w / B) + (w / 2 + 4 * w / hd))},
        {"kivi2", L * ((w / 4 + 4 * w / B) + (w / 4 + 4 * w / hd))},
    };
    for (const auto& [name, bytes] : expected) {
      apply_kv_preset(ec, name, c.head_dim());
      EXPECT_DOUBLE_EQ(kv_bytes_per_token(engine_cache_config(c, ec)), bytes) << name << " n_kv_head " << c.n_kv_head;
    }
  }
  // MLA: one [latent | RoPE key] row of d_c + d_r values per layer, no V row.
  const ModelConfig mla = model_preset("mla-tiny");
  EngineConfig fp32;
  EXPECT_DOUBLE_EQ(kv_bytes_per_token(engine_cache_config(mla, fp32)),
                   4.0 * static_cast<double>(mla.n_layer * (mla.mla_kv_rank + mla.mla_rope_dim)));
  // MHA against GQA at the same width: the cache shrinks by n_head / n_kv_head.
  ModelConfig gqa = model_preset("gpt2-124m");
  gqa.n_kv_head = 3;
  EngineConfig ec;
  EXPECT_DOUBLE_EQ(kv_bytes_per_token(engine_cache_config(model_preset("gpt2-124m"), ec)),
                   4 * kv_bytes_per_token(engine_cache_config(gqa, ec)));
}

// Parallel sampling: n samples of one prompt are prefilled once and forked; they share the
// prompt's blocks (refcount n) and each gets the tokens of an independent request with its seed.
TEST(EngineTest, SamplesOfOnePromptShareItsBlocks) {
  for (const char* preset : {"llama-tiny", "mla-tiny"}) {
    const ModelConfig config = model_preset(preset);
    auto backend = make_cpu_backend();
    Transformer model(*backend, config);
    model.init_weights(13);
    GenerationRequest r;
    r.prompt = prompt_of(9, 3, config.vocab_size);
    r.max_new_tokens = 6, r.n = 4;
    r.sampling.temperature = 1.0f, r.sampling.seed = 40;
    EngineConfig ec;
    ec.max_batch = 4, ec.block_size = 4;
    GenerationEngine engine(model, ec);
    EXPECT_EQ(engine.submit(r), 0);
    ASSERT_TRUE(engine.step());  // admitted: prefilled once, forked 3 times, one token decoded
    const KvCache& cache = engine.cache();
    EXPECT_EQ(engine.active(), 4);
    EXPECT_EQ(cache.block_refcount(0, 0), 4);  // the prompt's first block: one copy for all four
    EXPECT_EQ(cache.block_refcount(0, 4), 4);
    // Shared full blocks 2, plus each sample's own copy of the partly filled third.
    EXPECT_EQ(cache.blocks_in_use(), 2 + 4);
    const std::vector<GenerationResult> got = engine.run();
    ASSERT_EQ(got.size(), 4u);
    std::set<std::vector<int32_t>> distinct;
    for (int64_t k = 0; k < 4; ++k) {
      GenerationRequest one = r;
      one.n = 1, one.sampling.seed = 40 + static_cast<uint64_t>(k);
      EXPECT_EQ(got[k].tokens, alone(model, one, true)) << preset << " sample " << k;
      distinct.insert(got[k].tokens);
    }
    EXPECT_GT(distinct.size(), 1u) << preset;  // different seeds, different samples
    EXPECT_EQ(engine.cache().blocks_in_use(), 0);
  }
}

TEST(EngineTest, BadRequestsAreRefusedNamingTheProblem) {
  const ModelConfig config = model_preset("gpt2-tiny");
  auto backend = make_cpu_backend();
  Transformer model(*backend, config);
  EngineConfig ec;
  ec.num_blocks = 2, ec.block_size = 4;
  GenerationEngine engine(model, ec);
  GenerationRequest r;
  EXPECT_NE(test::error_of([&] { engine.submit(r); }).find("at least one token"), std::string::npos);
  r.prompt = {1, 2, static_cast<int32_t>(config.vocab_size)};
  EXPECT_NE(test::error_of([&] { engine.submit(r); }).find("outside the vocabulary"), std::string::npos);
  r.prompt = prompt_of(config.max_seq_len + 1, 1, config.vocab_size);
  EXPECT_NE(test::error_of([&] { engine.submit(r); }).find("model.max_seq_len"), std::string::npos);
  r.prompt = {1, 2, 3}, r.max_new_tokens = 10;  // 13 positions: 4 blocks of 4 > 2
  EXPECT_NE(test::error_of([&] { engine.submit(r); }).find("generate.kv_blocks"), std::string::npos);
  ec.max_batch = 0;
  EXPECT_NE(test::error_of([&] { GenerationEngine e(model, ec); }).find("generate.max_batch"), std::string::npos);
}


// Sliding window (llama-tiny with attn_window = 3): step() forgets the KV blocks older than the
// window (KvCache::forget_before). The tokens are those of an engine that keeps every block
// (EngineConfig::keep_all_blocks), the peak is smaller, and the admission reservation is exact:
// a pool of exactly a request's measured peak runs it, one block less refuses it.
TEST(EngineTest, SlidingWindowForgettingKeepsTheTokensAndShrinksThePeak) {
  ModelConfig config = model_preset("llama-tiny");
  config.attn_window = 3;
  auto backend = make_cpu_backend();
  Transformer model(*backend, config);
  model.init_weights(13);
  const std::vector<GenerationRequest> reqs = requests(config.vocab_size, config.max_seq_len);
  for (const bool chunked : {false, true}) {
    EngineConfig ec;
    ec.max_batch = 4, ec.block_size = 2, ec.chunked_prefill = chunked;
    EngineConfig keep = ec;
    keep.keep_all_blocks = true;
    GenerationEngine forgetting(model, ec), keeping(model, keep);
    for (const GenerationRequest& r : reqs) forgetting.submit(r), keeping.submit(r);
    const std::vector<GenerationResult> got = forgetting.run(), want = keeping.run();
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < got.size(); ++i) {
      EXPECT_EQ(got[i].tokens, want[i].tokens) << "request " << i << (chunked ? " (chunked prefill)" : "");
      EXPECT_EQ(got[i].finish, want[i].finish) << "request " << i;
    }
    EXPECT_LT(forgetting.stats().peak_blocks, keeping.stats().peak_blocks);
    EXPECT_EQ(forgetting.cache().blocks_in_use(), 0);
    std::printf("[          ] W = 3, B = 2, 12 requests, 4 rows%s: peak blocks %lld forgetting, %lld keeping all\n",
                chunked ? ", chunked prefill" : "", static_cast<long long>(forgetting.stats().peak_blocks),
                static_cast<long long>(keeping.stats().peak_blocks));
  }
  for (const bool chunked : {false, true}) {
    for (const int64_t block : {2, 4}) {
      for (const int64_t prompt : {1, 4, 7, 9}) {
        for (const int64_t max_new : {2, 5, 12}) {
          GenerationRequest r;
          r.prompt = prompt_of(prompt, prompt + max_new, config.vocab_size);
          r.max_new_tokens = std::min<int64_t>(max_new, config.max_seq_len - prompt + 1);
          const std::string what = "prompt " + std::to_string(prompt) + ", max_new " + std::to_string(max_new) +
                                   ", B " + std::to_string(block) + (chunked ? ", chunked" : "");
          EngineConfig ec;
          ec.max_batch = 1, ec.block_size = block, ec.chunked_prefill = chunked;
          EngineConfig keep = ec;
          keep.keep_all_blocks = true;
          GenerationEngine measure(model, ec), all(model, keep);
          measure.submit(r), all.submit(r);
          const std::vector<int32_t> tokens = measure.run().front().tokens;
          EXPECT_EQ(tokens, all.run().front().tokens) << what;
          const int64_t peak = measure.stats().peak_blocks;
          EXPECT_LE(peak, all.stats().peak_blocks) << what;
          if (chunked) {
            EXPECT_LE(peak, (3 + block - 1) / block + 1) << what;  // ceil(W / B) + 1
          }
          ec.num_blocks = peak;
          GenerationEngine tight(model, ec);
          tight.submit(r);
          EXPECT_EQ(tight.run().front().tokens, tokens) << what;
          ec.num_blocks = peak - 1;
          if (peak > 1) {
            GenerationEngine tighter(model, ec);
            EXPECT_NE(test::error_of([&] { tighter.submit(r); }).find("generate.kv_blocks"), std::string::npos) << what;
          }
        }
      }
    }
  }
  {  // One request of 15 positions alone: blocks per sequence at the peak.
    GenerationRequest r;
    r.prompt = prompt_of(4, 1, config.vocab_size);
    r.max_new_tokens = 12;
    for (const bool chunked : {false, true}) {
      EngineConfig ec;
      ec.max_batch = 1, ec.block_size = 2, ec.chunked_prefill = chunked;
      EngineConfig keep = ec;
      keep.keep_all_blocks = true;
      GenerationEngine forgetting(model, ec), keeping(model, keep);
      forgetting.submit(r), keeping.submit(r);
      forgetting.run(), keeping.run();
      std::printf("[          ] W = 3, B = 2, prompt 4 + 12 new%s: peak blocks %lld forgetting, %lld keeping all\n",
                  chunked ? " (chunked prefill)" : "", static_cast<long long>(forgetting.stats().peak_blocks),
                  static_cast<long long>(keeping.stats().peak_blocks));
      EXPECT_EQ(keeping.stats().peak_blocks, 8);
      EXPECT_EQ(forgetting.stats().peak_blocks, chunked ? 2 : 3);  // prefill: [0, 4] live while 4 is written
    }
  }
}


// Automatic prefix caching (EngineConfig::prefix_cache): a prompt's full blocks stay cached after
// its request; a later prompt that starts with them takes them (shared: refcount 2 while it runs)
// and feeds only the rest, and gets the tokens it gets without the cache. Hits count whole
// blocks; under memory pressure idle cached blocks are evicted, least recently used first.
TEST(EngineTest, PrefixCacheSharesBlocksAndKeepsTheTokens) {
  for (const char* preset : {"llama-tiny", "mla-tiny"}) {
  SCOPED_TRACE(preset);
  ModelConfig config = model_preset(preset);
  config.max_seq_len = 32;
  auto backend = make_cpu_backend();
  Transformer model(*backend, config);
  model.init_weights(13);
  const std::vector<int32_t> base = prompt_of(20, 5, config.vocab_size);
  GenerationRequest a;
  a.prompt.assign(base.begin(), base.begin() + 14);  // 3 full blocks of 4, and 2 tokens
  a.max_new_tokens = 5, a.sampling.temperature = 0.0f;
  GenerationRequest b = a;  // the same 14 tokens, then its own 3
  for (int32_t t : {7, 8, 9}) b.prompt.push_back(t);
  GenerationRequest sampled = b;
  sampled.sampling.temperature = 0.9f, sampled.sampling.seed = 77;
  EngineConfig ec;
  ec.max_batch = 2, ec.block_size = 4, ec.prefix_cache = true;
  GenerationEngine engine(model, ec);
  engine.submit(a);
  const std::vector<GenerationResult> first = engine.run();
  EXPECT_EQ(first.front().tokens, alone(model, a, true));
  EXPECT_EQ(first.front().cached_tokens, 0);
  const PrefixCache& prefix = *engine.prefix_cache();
  EXPECT_EQ(prefix.entries(), 3);                 // the prompt's full blocks, kept
  EXPECT_EQ(engine.cache().blocks_in_use(), 3);
  EXPECT_EQ(prefix.idle_blocks(), 3);
  EXPECT_EQ(prefix.stats().query_tokens, 12);     // (14 - 1) / 4 = 3 tiles looked up
  EXPECT_EQ(prefix.stats().hit_tokens, 0);

  engine.submit(b);
  ASSERT_TRUE(engine.step());                     // admitted on the cached blocks: sequence 1
  EXPECT_EQ(engine.cache().block_refcount(1, 0), 2);  // the table's reference and b's
  EXPECT_EQ(engine.cache().block_refcount(1, 8), 2);
  EXPECT_EQ(prefix.idle_blocks(), 0);
  const GenerationResult got_b = engine.run().front();
  EXPECT_EQ(got_b.cached_tokens, 12);
  EXPECT_EQ(got_b.tokens, alone(model, b, true));
  EXPECT_EQ(prefix.stats().hit_tokens, 12);
  EXPECT_EQ(prefix.entries(), 4);                 // b's fourth block (tokens 12..15) joined

  engine.submit(a);                               // the same prompt again: all 3 blocks hit
  engine.submit(sampled);                         // and a sampled request on 4 cached blocks
  const std::vector<GenerationResult> again = engine.run();
  EXPECT_EQ(again[0].tokens, first.front().tokens);
  EXPECT_EQ(again[0].cached_tokens, 12);
  EXPECT_EQ(again[1].cached_tokens, 16);
  EXPECT_EQ(again[1].tokens, alone(model, sampled, true));
  EXPECT_EQ(engine.cache().blocks_in_use(), prefix.entries());

  // A pool of 8 blocks: 4 cached and idle, a new prompt reserving 6 evicts 2, the least recently
  // used (b's fourth block, then the deepest of a's), and gets its tokens.
  ec.num_blocks = 8;
  GenerationEngine tight(model, ec);
  tight.submit(b);
  tight.run();
  EXPECT_EQ(tight.prefix_cache()->entries(), 4);
  GenerationRequest c;
  c.prompt = prompt_of(20, 9, config.vocab_size);
  c.max_new_tokens = 4, c.sampling.temperature = 0.0f;  // 24 positions: 6 blocks
  tight.submit(c);
  EXPECT_EQ(tight.run().front().tokens, alone(model, c, true));
  EXPECT_EQ(tight.prefix_cache()->stats().evicted_blocks, 2);
  EXPECT_EQ(tight.prefix_cache()->entries(), 2 + 5);  // b's first two, c's five
  }
}

// Cancelling: an active request finishes "cancelled" and frees its row for the waiting one at
// the next step; a waiting one is never admitted. The others get their tokens.
TEST(EngineTest, CancelledRequestsFreeTheirRowsAtTheNextStep) {
  const ModelConfig config = model_preset("llama-tiny");
  auto backend = make_cpu_backend();
  Transformer model(*backend, config);
  model.init_weights(13);
  std::vector<GenerationRequest> rs(3);
  for (size_t i = 0; i < rs.size(); ++i) {
    rs[i].prompt = prompt_of(5, static_cast<int64_t>(i) + 1, config.vocab_size);
    rs[i].max_new_tokens = 8, rs[i].sampling.temperature = 0.0f;
  }
  EngineConfig ec;
  ec.max_batch = 1, ec.block_size = 4;
  GenerationEngine engine(model, ec);
  std::vector<int64_t> finished;
  engine.set_on_finish([&](int64_t id, GenerationResult&& r) {
    finished.push_back(id);
    if (id == 0) {
      EXPECT_EQ(r.finish, "cancelled");
      EXPECT_EQ(r.tokens.size(), 3u);  // its prefill's token and two steps'
    } else if (id == 1) {
      EXPECT_EQ(r.finish, "cancelled");
      EXPECT_TRUE(r.tokens.empty());
    } else {
      EXPECT_EQ(r.tokens, alone(model, rs[2], true));
    }
  });
  for (const GenerationRequest& r : rs) engine.submit(r);
  ASSERT_TRUE(engine.step());
  ASSERT_TRUE(engine.step());
  EXPECT_EQ(engine.active(), 1);
  engine.cancel(1);  // waiting
  engine.cancel(0);  // running
  ASSERT_TRUE(engine.step());  // 0 leaves, 2 joins
  EXPECT_EQ(engine.waiting(), 0);
  EXPECT_TRUE(engine.run().empty());  // results went to the callback
  EXPECT_EQ(finished, (std::vector<int64_t>{1, 0, 2}));
  EXPECT_EQ(engine.cache().blocks_in_use(), 0);
}

// OpenAI's penalties: logit[t] -= presence * (count > 0) + frequency * count over the drawn tokens.
TEST(EngineTest, PresenceAndFrequencyPenaltiesLowerDrawnTokens) {
  const float logits[3] = {2.0f, 1.5f, 0.0f};
  SamplingConfig greedy;
  greedy.temperature = 0.0f;
  greedy.presence_penalty = 1.0f;
  Sampler presence(greedy);
  // 0; then 0 is 1.0 < 1.5: 1; then 0 and 1 both penalised once: 0 (1.0 > 0.5).
  EXPECT_EQ(presence.sample(logits, 3), 0);
  EXPECT_EQ(presence.sample(logits, 3), 1);
  EXPECT_EQ(presence.sample(logits, 3), 0);
  greedy.presence_penalty = 0.0f, greedy.frequency_penalty = 0.4f;
  Sampler frequency(greedy);
  // 2.0, 1.6 (> 1.5), 1.2 < 1.5: 1, then 1.1 < 1.2: 0 again.
  std::vector<int32_t> drawn;
  for (int i = 0; i < 4; ++i) drawn.push_back(frequency.sample(logits, 3));
  EXPECT_EQ(drawn, (std::vector<int32_t>{0, 0, 1, 0}));
  greedy.frequency_penalty = 2.5f;
  EXPECT_NE(test::error_of([&] { Sampler bad(greedy); }).find("frequency_penalty"), std::string::npos);
}

}  // namespace
}  // namespace loom

namespace loom {
namespace {

// The whole forward's mean next-token loss of `tokens` (one window, T - 1 positions).
double whole_forward_loss(Transformer& model, const std::vector<int32_t>& tokens) {
  const int64_t T = static_cast<int64_t>(tokens.size());
  ActivationStore store = model.allocate_store(1, T - 1);
  model.backend().write(store.tokens, tokens.data());
  model.backend().write(store.targets, tokens.data() + 1);
  return model.forward(store);
}

// ChunkAttention against a naive softmax in double: 37 rows at the end of 1,300 positions (three key
// tiles of 512), GQA 4/2, with and without a 700-position window, the keys and values handed out
// interleaved as a KV cache does (interleaved()) and per kv head (a KvTile of views). Within 1e-5
// (fp32 sums in another order); attending to the last tile alone is far from it, so every tile's
// running max and sum are carried.
TEST(ChunkAttentionTest, KeyTilesMatchANaiveSoftmax) {
  loom::ModelConfig c;
  c.d_model = 32, c.n_head = 4, c.n_kv_head = 2;
  const int64_t hd = c.head_dim(), G = c.n_kv_head, first = 1263, n = 37, P = first + n;
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> q(static_cast<size_t>(n * c.n_head * hd)), k(static_cast<size_t>(P * G * hd)), v(k.size());
  for (auto* x : {&q, &k, &v}) {
    for (float& e : *x) e = 2.0f * normal(rng);
  }
  for (const int64_t W : {int64_t{0}, int64_t{700}}) {
    c.attn_window = W;
    const int64_t lo = W > 0 ? first + 1 - W : 0;
    std::vector<double> want(q.size());
    for (int64_t r = 0; r < n; ++r) {
      for (int64_t h = 0; h < c.n_head; ++h) {
        const int64_t p = first + r, from = W > 0 ? std::max<int64_t>(0, p + 1 - W) : 0, g = h / (c.n_head / G);
        std::vector<double> w;
        double top = -1e300, total = 0.0;
        for (int64_t t = from; t <= p; ++t) {
          double dot = 0.0;
          for (int64_t d = 0; d < hd; ++d) dot += double(q[(r * c.n_head + h) * hd + d]) * k[(t * G + g) * hd + d];
          w.push_back(dot / std::sqrt(double(hd))), top = std::max(top, w.back());
        }
        for (double& x : w) total += (x = std::exp(x - top));
        for (int64_t t = from; t <= p; ++t) {
          for (int64_t d = 0; d < hd; ++d) want[(r * c.n_head + h) * hd + d] += w[t - from] / total * v[(t * G + g) * hd + d];
        }
      }
    }
    loom::ChunkAttention attention(c);
    std::vector<float> got(q.size()), per_head(q.size());
    attention.run(first, n, lo, W, attention.interleaved([&](int64_t begin, int64_t end, float* kk, float* vv) {
      std::copy(k.begin() + (lo + begin) * G * hd, k.begin() + (lo + end) * G * hd, kk);
      std::copy(v.begin() + (lo + begin) * G * hd, v.begin() + (lo + end) * G * hd, vv);
    }), q.data(), c.n_head * hd, got.data(), c.n_head * hd);
    // Per kv head contiguous rows (as infer/score.h keeps them), views straight into them.
    loom::Allocator& a = attention.backend().allocator();
    loom::Tensor kh = loom::Tensor::empty(a, {G, P, hd}, loom::DTYPE_F32, loom::MEM_WORKSPACE), vh = loom::Tensor::empty(a, {G, P, hd}, loom::DTYPE_F32, loom::MEM_WORKSPACE);
    for (int64_t t = 0; t < P; ++t) {
      for (int64_t g = 0; g < G; ++g) {
        std::copy_n(k.begin() + (t * G + g) * hd, hd, kh.data<float>() + (g * P + t) * hd);
        std::copy_n(v.begin() + (t * G + g) * hd, hd, vh.data<float>() + (g * P + t) * hd);
      }
    }
    attention.run(first, n, lo, W, [&](int64_t g, int64_t begin, int64_t end) {
      return std::pair{kh.view((g * P + lo + begin) * hd, {end - begin, hd}), vh.view((g * P + lo + begin) * hd, {end - begin, hd})};
    }, q.data(), c.n_head * hd, per_head.data(), c.n_head * hd);
    // The last tile alone (no window: its rows would see the earlier positions): a variant that
    // drops the earlier tiles' running max and sum.
    std::vector<float> last(q.size());
    if (W == 0) {
    const int64_t tail = (P - lo - 1) / loom::ChunkAttention::kTile * loom::ChunkAttention::kTile;
    attention.run(first, n, lo + tail, W, [&](int64_t g, int64_t begin, int64_t end) {
      return std::pair{kh.view((g * P + lo + tail + begin) * hd, {end - begin, hd}), vh.view((g * P + lo + tail + begin) * hd, {end - begin, hd})};
    }, q.data(), c.n_head * hd, last.data(), c.n_head * hd);
    }
    double err = 0.0, err_heads = 0.0, err_last = 0.0;
    for (size_t i = 0; i < want.size(); ++i) {
      err = std::max(err, std::abs(got[i] - want[i])), err_heads = std::max(err_heads, std::abs(per_head[i] - want[i]));
      err_last = std::max(err_last, std::abs(last[i] - want[i]));
    }
    std::printf("window %lld: %lld positions in %lld tiles, interleaved within %.2e, per head %.2e", static_cast<long long>(W),
                static_cast<long long>(P - lo),
                static_cast<long long>((P - lo + loom::ChunkAttention::kTile - 1) / loom::ChunkAttention::kTile), err, err_heads);
    if (W == 0) std::printf(", the last tile alone %.2e away", err_last);
    std::printf("\n");
    EXPECT_LT(err, 1e-5);
    EXPECT_LT(err_heads, 1e-5);
    if (W == 0) {
      EXPECT_GT(err_last, 1e-2);
    }
  }
}

// Scoring in chunks (infer/score.h, `loom eval --text` over windows longer than a chunk): the mean
// next-token loss of a sequence fed C positions a forward through a one-sequence KV cache is the
// whole forward's within 1e-5 (the attention sums in another order) for GPT-2's learned positions,
// Llama's GQA and a sliding window, chunks of 1, 5 and the whole; scoring each chunk as a sequence
// of its own (no cached prefix) is far from it, so the prefix is read; the activation peak does not
// grow with the sequence; MLA is refused by name.
TEST(ScoreTest, ChunkedScoringMatchesTheWholeForwardInBoundedMemory) {
  for (const std::string preset : {"gpt2-tiny", "llama-tiny", "llama-tiny+window", "gemma-tiny"}) {
    const ModelConfig config = long_context_preset(preset);
    auto backend = make_cpu_backend();
    Transformer model(*backend, config, ModelUse{.gradients = false});
    model.init_weights(4);
    const int64_t T = 41;
    const std::vector<int32_t> tokens = prompt_of(T, 5, config.vocab_size);
    const double want = whole_forward_loss(model, tokens);
    double worst = 0.0;
    for (int64_t chunk : {1, 5, 64}) {
      const SequenceLoss got = score_tokens(model, tokens, chunk);
      EXPECT_EQ(got.count, T - 1);
      worst = std::max(worst, std::abs(got.sum / static_cast<double>(got.count) - want));
    }
    EXPECT_LT(worst, 1e-5 * std::max(1.0, std::abs(want))) << preset;
    double alone = 0.0;  // each chunk of 8 positions scored without its prefix
    for (int64_t first = 0; first < T - 1; first += 8) {
      const std::vector<int32_t> piece(tokens.begin() + first, tokens.begin() + std::min(first + 9, T));
      alone += score_tokens(model, piece, 8).sum;
    }
    EXPECT_GT(std::abs(alone / static_cast<double>(T - 1) - want), 100.0 * worst) << preset;
    std::printf("%s: whole %.9f, chunked within %.2e, without the prefix %.2e away\n", preset.c_str(), want, worst,
                std::abs(alone / static_cast<double>(T - 1) - want));
  }
  // The activations a chunk holds, whatever the sequence's length.
  std::vector<size_t> peaks;
  for (int64_t T : {24, 56}) {
    auto backend = make_cpu_backend();
    Transformer model(*backend, long_context_preset("llama-tiny"), ModelUse{.gradients = false});
    model.init_weights(4);
    score_tokens(model, prompt_of(T, 3, model.config().vocab_size), 8);
    peaks.push_back(backend->allocator().tracker().peak(MEM_ACTIVATIONS));
  }
  EXPECT_EQ(peaks[0], peaks[1]);
  const ModelConfig tiny = model_preset("llama-tiny");
  EXPECT_EQ(score_bytes(tiny, 56, 8).kv, 2 * tiny.n_layer * 55 * tiny.n_kv_head * tiny.head_dim() * 4);
  EXPECT_EQ(score_bytes(tiny, 56, 8).logits, 8 * tiny.vocab_size * 4);
  EXPECT_FALSE(can_score_in_chunks(model_preset("mla-tiny")));
  auto backend = make_cpu_backend();
  Transformer mla(*backend, model_preset("mla-tiny"), ModelUse{.gradients = false});
  EXPECT_NE(test::error_of([&] { score_tokens(mla, prompt_of(9, 1, mla.config().vocab_size), 4); }).find("MLA"),
            std::string::npos);
}

}  // namespace
}  // namespace loom
