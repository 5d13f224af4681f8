// loom bench generate: generation throughput with continuous batching against one request at a
// time (the same requests, in the same run), time to first token, KV bytes per token and cache
// utilisation; with --ppl, the quality cost of each KV cache format (teacher-forced loss through
// the cache on validation text).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <optional>
#include <sstream>

#include "cli.h"
#include "commands.h"
#include "loom/core/error.h"
#include "loom/data/shard.h"
#include "loom/infer/engine.h"

namespace loom::cli {

namespace {
const char* kHelp =
    "usage: loom bench generate [--checkpoint PATH | --config FILE --set k=v,...] [--requests N]\n"
    "                           [--prompt-tokens L] [--new-tokens M] [--max-batch B] [--kv FORMAT]\n"
    "                           [--kv-block K] [--kv-group G] [--kv-residual R] [--contiguous]\n"
    "                           [--temperature T] [--top-k K] [--top-p P] [--step-graphs]\n"
    "                           [--ppl FORMATS] [--ppl-sequences S]\n"
    "\n"
    "Generates M tokens (greedy, or sampled with --temperature) for each of N prompts of L tokens\n"
    "(default 32 x 32 x 64), windows of the dataset's validation split (random tokens without one),\n"
    "twice in one run: one request at a time (an engine of one row), then all of them through the\n"
    "engine with continuous batching of up to B rows (default 16). Prints tokens/s of both and their\n"
    "ratio, the time to first token (mean, p50, p90), the KV bytes per token (formula, and\n"
    "measured: bytes in use / positions at the peak), the cache's mean utilisation, and whether\n"
    "every request got the same tokens (sampled requests draw with their own seeds).\n"
    "FORMAT: fp32 (default), bf16, int8, int4, kivi4, kivi2 (infer/engine.h); --kv-group and\n"
    "--kv-residual override the preset's group size and fp32 residual.\n"
    "--ppl fp32,bf16,int8,...: for each format, the teacher-forced loss and perplexity of S\n"
    "(default 16) validation windows of train.seq_len tokens through the cache, and the change\n"
    "against fp32.\n"
    "Without --checkpoint the model is the config's, randomly initialised (speed only).\n";

double percentile(std::vector<double> v, double q) {
  std::sort(v.begin(), v.end());
  return v[static_cast<size_t>(std::min<double>(static_cast<double>(v.size() - 1), q * static_cast<double>(v.size())))];
}

std::vector<std::string> split_list(const std::string& text) {
  std::vector<std::string> out;
  std::stringstream in(text);
  for (std::string item; std::getline(in, item, ',');) {
    if (!item.empty()) out.push_back(item);
  }
  return out;
}

int bench_generate(const Args& args) {
  const SamplingConfig sampling = sampling_from_args(args, SamplingConfig{0.0f, 0, 1.0f, 1});  // greedy by default
  LoomConfig config;
  std::optional<ModelSource> source;
  if (args.has("checkpoint")) {
    source = model_source(args.get("checkpoint"));
    config = source->config;
  } else {
    config = load_config(args);
    vocab_from_data(config);
  }
  const std::string device = args.get("device", "");
  auto backend = source ? inference_backend(*source, device) : make_backend(device.empty() ? std::string(enum_name(config.device)) : device);
  std::unique_ptr<Transformer> owned;
  const auto setup_start = std::chrono::steady_clock::now();
  LOOM_CHECK(!(source && args.has("bf16-weights")), "--bf16-weights is for a random model: a checkpoint's own dtype "
             "decides (a bf16 Hugging Face folder is used in place; --f32-weights widens it)");
  if (source) {
    owned = open_inference_model(*source, *backend, args.has("f32-weights"));
  } else {
    owned = std::make_unique<Transformer>(*backend, config.model, ModelUse{.gradients = false});
    owned->init_weights(config.loop.seed);
    if (args.has("bf16-weights")) use_bf16_weights(*owned);
  }
  Transformer& model = *owned;
  const double setup_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - setup_start).count();
  const int64_t n = args.get_int("requests", 32), L = args.get_int("prompt-tokens", 32), M = args.get_int("new-tokens", 64);
  LOOM_CHECK(n >= 1 && L >= 1 && M >= 1, "--requests, --prompt-tokens and --new-tokens must be >= 1");
  LOOM_CHECK(L + M <= config.model.max_seq_len, "--prompt-tokens + --new-tokens = ", L + M, " exceeds model.max_seq_len = ",
             config.model.max_seq_len);
  std::vector<int32_t> text;  // validation tokens, if the dataset is there
  try {
    TokenDataset data = open_dataset(config.data.dir);
    if (static_cast<int64_t>(data.vocab_size) == config.model.vocab_size) text = std::move(data.val.tokens);
  } catch (const Error&) {
  }
  auto window = [&](int64_t i, int64_t length) {
    std::vector<int32_t> w;
    for (int64_t t = 0; t < length; ++t) {
      const int64_t at = i * length + t;
      w.push_back(static_cast<int32_t>(static_cast<int64_t>(text.size()) >= (i + 1) * length
                                           ? text[static_cast<size_t>(at)]
                                           : (at * 2654435761LL) % config.model.vocab_size));
    }
    return w;
  };
  std::vector<GenerationRequest> requests;
  for (int64_t i = 0; i < n; ++i) {
    GenerationRequest r;
    r.prompt = window(i, L);
    r.sampling = sampling;
    r.sampling.seed = static_cast<uint64_t>(i) + 1;
    r.max_new_tokens = M;
    requests.push_back(std::move(r));
  }
  EngineConfig ec;
  ec.max_batch = args.get_int("max-batch", 16);
  ec.block_size = args.get_int("kv-block", 16);
  ec.prefill_chunk = args.get_int("prefill-chunk", ec.prefill_chunk);
  ec.speculate = args.get_int("speculate", 0);
  ec.step_graphs = args.has("step-graphs");
  if (args.has("kv-memory")) ec.kv_memory = parse_bytes(args.get("kv-memory"), "--kv-memory");
  ec.paged = !args.has("contiguous");
  const std::string kv = args.get("kv", "fp32");
  apply_kv_preset(ec, kv, config.model.head_dim());
  ec.group = args.get_int("kv-group", ec.group), ec.residual = args.get_int("kv-residual", ec.residual);
  const KvCacheConfig cache_config = engine_cache_config(config.model, ec);
  const std::unique_ptr<Transformer> draft = open_draft(args, *backend, ec);

  const std::string how = sampling.temperature == 0.0f ? std::string("greedy")
                                                       : str_cat("sampled at temperature ", sampling.temperature, ", top_k ",
                                                                 sampling.top_k, ", top_p ", sampling.top_p);
  std::printf("%s: %lld parameters (%lld linear weights in bf16 in place); %lld requests of %lld prompt + %lld new "
              "tokens (%s); KV cache %s, %s; model set up in %.1f s\n",
              source ? source->path.c_str() : "random init", static_cast<long long>(param_count(config.model)),
              static_cast<long long>(model.bf16_weight_params()),
              static_cast<long long>(n), static_cast<long long>(L), static_cast<long long>(M), how.c_str(), kv.c_str(),
              ec.paged ? str_cat("paged, blocks of ", ec.block_size).c_str() : "contiguous", setup_s);
  // One at a time: each request alone in an engine of one row.
  EngineConfig single = ec;
  single.max_batch = 1;
  std::vector<std::vector<int32_t>> alone;
  std::vector<double> alone_ttft;
  const auto t0 = std::chrono::steady_clock::now();
  {
    GenerationEngine engine(model, single, draft.get());
    for (const GenerationRequest& r : requests) {
      engine.submit(r);
      const GenerationResult g = engine.run().back();
      alone.push_back(g.tokens);
      alone_ttft.push_back(g.first_token_s);
    }
  }
  const double alone_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  // All at once, continuous batching.
  const auto t1 = std::chrono::steady_clock::now();
  GenerationEngine engine(model, ec, draft.get());
  for (const GenerationRequest& r : requests) engine.submit(r);
  const std::vector<GenerationResult> together = engine.run();
  const double batched_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t1).count();
  int64_t generated = 0, same = 0;
  std::vector<double> ttft;
  for (size_t i = 0; i < together.size(); ++i) {
    generated += static_cast<int64_t>(together[i].tokens.size());
    same += together[i].tokens == alone[i] ? 1 : 0;
    ttft.push_back(together[i].first_token_s);
  }
  const EngineStats& st = engine.stats();
  std::printf("one at a time:       %8.1f new tokens/s (%.2f s)  time to first token mean %.3f s\n", generated / alone_s,
              alone_s, [&] { double s = 0; for (double x : alone_ttft) s += x; return s / alone_ttft.size(); }());
  {  // one stream's two phases: the prompt (up to the first token) and the tokens after it
    double first_s = 0.0;
    for (double x : alone_ttft) first_s += x;
    std::printf("single stream:       prefill %8.1f prompt tokens/s (prompt / time to first token), decode %8.1f tokens/s "
                "(after the first token)\n", static_cast<double>(n * L) / first_s,
                static_cast<double>(generated - n) / (alone_s - first_s));
  }
  std::printf("continuous batching: %8.1f new tokens/s (%.2f s)  time to first token mean %.3f s, p50 %.3f s, p90 %.3f s "
              "(all submitted at t = 0)\n", generated / batched_s, batched_s,
              [&] { double s = 0; for (double x : ttft) s += x; return s / ttft.size(); }(), percentile(ttft, 0.5),
              percentile(ttft, 0.9));
  if (ec.step_graphs) {
    const Backend::StepGraphCounts g = backend->step_graph_counts();
    std::printf("step graphs: %lld of the batched run's %lld steps; over both runs %lld graphs made, %lld updated in place\n",
                static_cast<long long>(st.graph_steps), static_cast<long long>(st.steps), static_cast<long long>(g.made),
                static_cast<long long>(g.updated));
  }
  std::printf("ratio %.2fx; %lld steps, %.1f rows per step (max %lld); every request the same tokens: %s (%lld of %lld)\n",
              alone_s / batched_s, static_cast<long long>(st.steps),
              static_cast<double>(st.rows) / std::max<int64_t>(st.steps, 1), static_cast<long long>(ec.max_batch),
              same == n ? "yes" : "NO", static_cast<long long>(same), static_cast<long long>(n));
  if (ec.speculate > 0) {
    std::printf("speculative decoding (%s, up to %lld drafts): %lld drafted, %lld accepted (%.1f%%) in the batched run, "
                "%.2f s of its %.2f s in the draft model\n",
                draft ? str_cat("draft model ", args.get("draft"), ", ", param_count(draft->config()), " parameters").c_str()
                      : "prompt lookup",
                static_cast<long long>(ec.speculate), static_cast<long long>(st.drafted),
                static_cast<long long>(st.accepted), st.drafted > 0 ? 100.0 * static_cast<double>(st.accepted) / static_cast<double>(st.drafted) : 0.0,
                st.draft_seconds, st.seconds);
  }
  std::printf("KV cache: %.1f bytes per token by formula (%lld layers), peak %s in use of %s reserved, %lld blocks at the "
              "peak, mean utilisation %.3f\n", kv_bytes_per_token(cache_config), static_cast<long long>(cache_config.n_layer),
              format_bytes(static_cast<size_t>(st.peak_bytes_used)).c_str(),
              format_bytes(static_cast<size_t>(engine.cache().bytes_reserved())).c_str(),
              static_cast<long long>(st.peak_blocks), st.utilisation_sum / std::max<int64_t>(st.steps, 1));
  LOOM_CHECK(same == n, "continuous batching changed the tokens of ", n - same, " requests");

  if (args.has("ppl")) {
    const int64_t S = args.get_int("ppl-sequences", 16), T = std::min(config.train.seq_len, config.model.max_seq_len);
    LOOM_CHECK(static_cast<int64_t>(text.size()) >= S * T, "--ppl needs ", S * T, " validation tokens in ", config.data.dir,
               ", found ", text.size());
    std::vector<std::vector<int32_t>> seqs;
    for (int64_t i = 0; i < S; ++i) seqs.push_back(window(i, T));
    std::printf("\nteacher-forced loss through the KV cache, %lld validation windows of %lld tokens:\n", static_cast<long long>(S),
                static_cast<long long>(T));
    std::printf("%-8s %14s %10s %12s %12s\n", "format", "bytes/token", "loss", "perplexity", "change");
    double reference = 0;
    for (const std::string& f : split_list(args.get("ppl"))) {
      EngineConfig pc = ec;
      apply_kv_preset(pc, f, config.model.head_dim());
      pc.group = args.get_int("kv-group", pc.group), pc.residual = args.get_int("kv-residual", pc.residual);
      const double loss = teacher_forced_loss(model, seqs, pc);
      if (reference == 0) reference = std::exp(loss);
      std::printf("%-8s %14.1f %10.5f %12.4f %+11.3f%%\n", f.c_str(), kv_bytes_per_token(engine_cache_config(config.model, pc)),
                  loss, std::exp(loss), 100 * (std::exp(loss) / reference - 1));
    }
  }
  return 0;
}
}  // namespace

int bench_main(int argc, char** argv) {
  const std::vector<Option> options = {
      {"checkpoint", "PATH", "a step folder, a run folder or a checkpoints folder (default: a random model)"},
      {"device", "cpu|cuda", "the backend (default: the checkpoint's or the config's device)"},
      kF32WeightsOption,
      {"bf16-weights", "", "a random model's weights rounded to bf16 and used in place, as a bf16 folder's are"},
      {"config", "FILE", "a TOML config applied after configs/default.toml"},
      {"set", "KEY=VALUE,...", "config overrides, applied last (comma-separated; repeatable)"},
      {"requests", "N", "requests (default 32)"},
      {"prompt-tokens", "L", "tokens per prompt (default 32)"},
      {"new-tokens", "M", "tokens generated per request (default 64)"},
      {"max-batch", "B", "rows of continuous batching (default 16)"},
      kStepGraphsOption,
      {"temperature", "T", "sample at temperature T, request i with seed i + 1 (default 0: greedy)"},
      {"top-k", "K", "sample from the K most likely tokens (default 0: all)"},
      {"top-p", "P", "sample from the nucleus of probability P (default 1)"},
      kDraftOption,
      kDraftPMinOption,
      {"speculate", "K", "requests propose up to K tokens by prompt lookup, verified in one forward: the same greedy tokens, sampled ones distributed the same (default 0: off; needs --kv fp32)"},
      {"prefill-chunk", "N", "prompts longer than N tokens are fed N a step beside the decoding rows (default 512; 0: each prompt in one forward)"},
      {"kv", "FORMAT", "KV cache format fp32 | bf16 | int8 | int4 | kivi4 | kivi2 (default fp32)"},
      {"kv-block", "K", "positions per paged KV cache block (default 16)"},
      {"kv-memory", "BYTES", "the KV pool's budget, e.g. 8GiB (default: 90% of the available memory after loading; --kv-blocks overrides)"},
      {"kv-group", "G", "channels per (scale, min) of the per-token formats (default: the preset's)"},
      {"kv-residual", "R", "newest positions kept fp32 (default: the preset's)"},
      {"contiguous", "", "one max_seq_len KV region per row instead of paged blocks"},
      {"ppl", "FORMATS", "comma-separated KV formats whose teacher-forced perplexity to measure"},
      {"ppl-sequences", "S", "--ppl: validation windows (default 16)"}};
  if (argc < 1) return std::fputs(options_help(kHelp, options).c_str(), stderr), 2;
  const std::string what = argv[0];
  if (what == "--help" || what == "-h") throw HelpRequest{options_help(kHelp, options)};
  LOOM_CHECK(what == "generate", "unknown benchmark '", what, "', expected generate (see `loom bench --help`)");
  const Args args(argc - 1, argv + 1, "bench generate", kHelp, options);
  return bench_generate(args);
}

}  // namespace loom::cli
