// loom generate: text from a checkpoint with the KV cache and a sampler; with --prompts, many
// prompts at once through the generation engine (continuous batching, infer/engine.h).
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>

#include "cli.h"
#include "commands.h"
#include "loom/core/error.h"
#include "loom/core/file_io.h"
#include "loom/infer/engine.h"
#include "loom/infer/generate.h"

#include <nlohmann/json.hpp>

namespace loom::cli {

namespace {
const char* kHelp =
    "usage: loom generate --checkpoint PATH [--prompt TEXT | --prompt-file FILE] [--tokens N]\n"
    "                     [--temperature T] [--top-k K] [--top-p P] [--seed S] [--greedy]\n"
    "\n"
    "PATH is a step folder, a run folder or a checkpoints folder (newest valid checkpoint).\n"
    "Feeds the prompt through the model's KV cache, then samples N tokens (default: the run's\n"
    "sample.* settings): temperature 0 or --greedy takes the most likely token. Stops at the\n"
    "end-of-text token or the model's context length. Same seed, same text.\n"
    "\n"
    "       loom generate --checkpoint PATH --prompts FILE [--out FILE] [--max-batch B] [--kv FORMAT]\n"
    "                     [--kv-block N] [--kv-group G] [--kv-residual R] [--contiguous] [--tokens N]\n"
    "                     [sampling options as above]\n"
    "\n"
    "Every non-empty line of FILE is a prompt; they run together through the generation engine:\n"
    "continuous batching of up to B rows (default 8), a paged KV cache of N-position blocks\n"
    "(default 16; --contiguous: one max_seq_len region per row) in FORMAT (fp32, bf16, int8, int4,\n"
    "kivi4, kivi2; default fp32; --kv-group: channels per (scale, min) of the per-token formats,\n"
    "--kv-residual: positions kept fp32). Prompt i samples with seed S + i, so its text does not depend on\n"
    "the others. Writes one JSON line per prompt, in order ({\"id\", \"prompt\", \"text\",\n"
    "\"tokens\", \"finish\", \"ttft_s\", \"total_s\"}) to --out (atomically) or stdout, then a summary.\n";
}  // namespace

int generate_main(int argc, char** argv) {
  const Args args(argc, argv, "generate", kHelp,
                  {{"checkpoint", "PATH", "a step folder, a run folder or a checkpoints folder (required)"},
                   kDeviceOption,
                   kF32WeightsOption,
                   {"adapter", "DIR", "a PEFT LoRA adapter folder applied to the weights (docs/finetune.md)"},
                   {"prompt", "TEXT", "the prompt (default: the run's sample.prompt)"},
                   {"prompt-file", "FILE", "read the prompt from a file"},
                   {"tokens", "N", "tokens to sample (default: the run's sample.max_new_tokens)"},
                   {"temperature", "T", "sampling temperature; 0 = greedy (default: sample.temperature)"},
                   {"top-k", "K", "sample among the K most likely tokens; 0 = no limit (default: sample.top_k)"},
                   {"top-p", "P", "nucleus sampling threshold; 1 = no limit (default: sample.top_p)"},
                   {"seed", "S", "sampling seed (default: sample.seed)"},
                   {"greedy", "", "always take the most likely token (temperature 0)"},
                   {"prompts", "FILE", "one prompt per non-empty line, generated together by the engine"},
                   {"out", "FILE", "--prompts: write the JSON lines here (atomically) instead of stdout"},
                   {"max-batch", "B", "--prompts: rows of continuous batching (default 8)"},
                   {"draft", "PATH", "--prompts: " + kDraftOption.help},
                   {"draft-p-min", "P", "--prompts: " + kDraftPMinOption.help},
                   {"step-graphs", "", "--prompts: " + kStepGraphsOption.help},
                   {"speculate", "K", "--prompts: requests propose up to K tokens by prompt lookup, verified in one forward: the same greedy tokens, sampled ones distributed the same (default 0: off; needs --kv fp32)"},
                   {"prefill-chunk", "N", "--prompts: prompts longer than N tokens are fed N a step beside the decoding rows (default 512; 0: each prompt in one forward)"},
                   {"kv", "FORMAT", "--prompts: KV cache format fp32 | bf16 | int8 | int4 | kivi4 | kivi2 (default fp32)"},
                   {"kv-block", "N", "--prompts: positions per paged KV cache block (default 16)"},
                   {"kv-memory", "BYTES", "--prompts: the KV pool's budget, e.g. 8GiB (default: 90% of the available memory after loading; --kv-blocks overrides)"},
                   {"kv-group", "G", "--prompts: channels per (scale, min) of the per-token formats (default: the preset's)"},
                   {"kv-residual", "R", "--prompts: newest positions kept fp32 (default: the preset's)"},
                   {"contiguous", "", "--prompts: one max_seq_len KV region per row instead of paged blocks"}});
  LOOM_CHECK(args.has("checkpoint"), "loom generate needs --checkpoint PATH");
  const ModelSource source = model_source(args.get("checkpoint"), args.get("adapter", ""));
  const LoomConfig& config = source.config;
  std::string prompt = args.get("prompt", config.sample.prompt);
  if (args.has("prompt-file")) {
    prompt = read_text_file(args.get("prompt-file"), uint64_t{16} << 20, "--prompt-file's limit");
  }
  const SamplingConfig sampling = sampling_from_args(args, config.sample.sampling);

  const auto tokenizer = model_tokenizer(config);
  auto backend = inference_backend(source, args.get("device", ""));
  const std::unique_ptr<Transformer> owned = open_inference_model(source, *backend, args.has("f32-weights"));
  Transformer& model = *owned;
  if (args.has("prompts")) {
    const std::string path = args.get("prompts");
    std::istringstream in(read_text_file(path, uint64_t{64} << 20, "--prompts' limit"));
    std::vector<std::string> prompts;
    for (std::string line; std::getline(in, line);) {
      if (!line.empty() && line.back() == '\r') line.pop_back();
      if (!line.empty()) prompts.push_back(line);
    }
    LOOM_CHECK(!prompts.empty(), path, ": no prompts (one per non-empty line)");
    EngineConfig ec;
    ec.max_batch = args.get_int("max-batch", 8);
    ec.block_size = args.get_int("kv-block", 16);
    ec.prefill_chunk = args.get_int("prefill-chunk", ec.prefill_chunk);
    ec.speculate = args.get_int("speculate", 0);
    ec.step_graphs = args.has("step-graphs");
    if (args.has("kv-memory")) ec.kv_memory = parse_bytes(args.get("kv-memory"), "--kv-memory");
    ec.paged = !args.has("contiguous");
    apply_kv_preset(ec, args.get("kv", "fp32"), config.model.head_dim());
    ec.group = args.get_int("kv-group", ec.group), ec.residual = args.get_int("kv-residual", ec.residual);
    const std::unique_ptr<Transformer> draft = open_draft(args, *backend, ec);
    GenerationEngine engine(model, ec, draft.get());
    const int64_t max_new = args.get_int("tokens", config.sample.max_new_tokens);
    for (size_t i = 0; i < prompts.size(); ++i) {
      GenerationRequest r;
      r.prompt = tokenizer->encode(prompts[i]);
      if (r.prompt.empty()) r.prompt.push_back(tokenizer->eot_token());
      r.sampling = sampling;
      r.sampling.seed = sampling.seed + i;
      r.max_new_tokens = std::min<int64_t>(max_new, config.model.max_seq_len - static_cast<int64_t>(r.prompt.size()));
      LOOM_CHECK(r.max_new_tokens >= 1, path, ":", i + 1, ": the prompt fills the model's context (model.max_seq_len = ",
                 config.model.max_seq_len, ")");
      r.stop_tokens = {tokenizer->eot_token()};
      engine.submit(std::move(r));
    }
    const std::vector<GenerationResult> results = engine.run();
    std::string lines;
    int64_t generated = 0;
    double ttft = 0;
    for (size_t i = 0; i < results.size(); ++i) {
      const GenerationResult& g = results[i];
      std::vector<int32_t> shown = g.tokens;
      if (!shown.empty() && shown.back() == tokenizer->eot_token()) shown.pop_back();
      nlohmann::json j = {{"id", i}, {"prompt", prompts[i]}, {"text", printable_utf8(tokenizer->decode(shown))},
                          {"tokens", g.tokens.size()}, {"finish", g.finish}, {"ttft_s", g.first_token_s},
                          {"total_s", g.total_s}};
      lines += j.dump() + "\n";
      generated += static_cast<int64_t>(g.tokens.size());
      ttft += g.first_token_s;
    }
    const EngineStats& st = engine.stats();
    const std::string summary = str_cat(results.size(), " prompts, ", generated, " tokens in ", st.steps, " steps (",
                                        st.seconds, " s, ", static_cast<int64_t>(generated / st.seconds),
                                        " new tokens/s), mean time to first token ", ttft / results.size(),
                                        " s, KV cache ", args.get("kv", "fp32"), " ", ec.paged ? "paged" : "contiguous",
                                        ", mean utilisation ", st.utilisation_sum / std::max<int64_t>(st.steps, 1), "\n");
    if (args.has("out")) {
      write_file_atomic(args.get("out"), lines);
      std::fputs(summary.c_str(), stdout);
    } else {
      std::fputs(lines.c_str(), stdout);
      std::fputs(summary.c_str(), stderr);
    }
    return 0;
  }
  std::vector<int32_t> ids = tokenizer->encode(prompt);
  if (ids.empty()) ids.push_back(tokenizer->eot_token());
  GenerateOptions options;
  options.max_new_tokens = args.get_int("tokens", config.sample.max_new_tokens);
  options.stop_token = tokenizer->eot_token();
  std::fputs(prompt.c_str(), stdout);
  std::fflush(stdout);
  std::vector<int32_t> pending;  // tokens not yet printed: a UTF-8 character may span several
  generate(model, ids, sampling, options, [&](int32_t token) {
    if (token == tokenizer->eot_token()) return;
    pending.push_back(token);
    const std::string text = tokenizer->decode(pending);
    const unsigned char last = text.empty() ? 0 : static_cast<unsigned char>(text.back());
    if (last < 0x80) {
      std::fputs(printable_utf8(text).c_str(), stdout);
      std::fflush(stdout);
      pending.clear();
    }
  });
  std::fputs(printable_utf8(tokenizer->decode(pending)).c_str(), stdout);
  std::fputs("\n", stdout);
  return 0;
}

}  // namespace loom::cli
