// loom memory: the bytes a training rank holds, by category, before anything runs
// (memory/estimate.h), and with --measure the same measured after one step.
#include <algorithm>
#include <cstdio>
#include <fstream>
#include <string>

#include <unistd.h>

#include <nlohmann/json.hpp>

#include "cli.h"
#include "commands.h"
#include "loom/comm/communicator.h"
#include "loom/core/error.h"
#include "loom/core/pages.h"
#include "loom/data/batch_source.h"
#include "loom/memory/estimate.h"
#include "loom/train/quantize_run.h"
#include "loom/train/run.h"
#include "loom/train/trainer.h"

namespace loom::cli {

namespace {
const char* kHelp =
    "usage: loom memory [--config FILE] [--set k=v,...] [--ranks N] [--params P] [--measure]\n"
    "\n"
    "Prints the bytes per rank of the run the config describes, by memory category, before\n"
    "anything runs: parameters (fp32, + the bf16 copy with precision.param = bf16), gradients,\n"
    "optimizer state (its exact formula; ZeRO shards it, and with stages 2/3 the gradients and\n"
    "parameters), and one micro-batch's activations under train.recompute. Then the ZeRO paper's\n"
    "model-state accounting, (w + g + K) bytes per parameter over N ranks, stages 0-3.\n"
    "--measure also builds the model, runs one training step on synthetic tokens, and prints the\n"
    "measured bytes (resident pages for parameters and gradients) beside the estimate (under\n"
    "mpirun: data parallel over the world, as loom train).\n"
    "Model-parallel layouts (parallel.tp, sequence_parallel, pp with its schedule, cp, ep) are\n"
    "estimated for the rank that holds the most: its tensor slice, its pipeline stages' layers and\n"
    "live micro-batches, its 1/cp of each sequence, its experts (--measure: data parallel only).\n"
    "--methods prints the model states of fine-tuning this model by each method: full, LoRA with the\n"
    "peft.* keys' rank and targets, and QLoRA's formula (docs/finetune.md).\n"
    "--quantize METHOD --checkpoint PATH [--bits B] [--group G] [--calib-tokens N] prints the peak host\n"
    "memory `loom quantize` plans for that model (a Hugging Face folder is streamed block by block;\n"
    "docs/compression.md) instead of a training run's.\n"
    "--serve --checkpoint PATH [--max-batch N] [--prefill-chunk N] [--kv-memory B | --kv-blocks N] prints what\n"
    "`loom serve` with those flags holds before its first request: the model loaded (measured), the KV pool\n"
    "and the step workspace, which bound a request's peak whatever its prompt's length (docs/serving.md).\n";

std::string gb(double bytes) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.1f GB", bytes / 1e9);
  return buf;
}
// loom memory --quantize: loom quantize's plan for the model, before anything is read.
int quantize_memory(const Args& args) {
  LOOM_CHECK(args.has("checkpoint"), "loom memory --quantize needs --checkpoint PATH (the model to quantize)");
  QuantizeOptions o;
  o.method = parse_quant_method(args.get("quantize"));
  const bool w8a8 = o.method == QuantMethod::smoothquant || o.method == QuantMethod::w8a8;
  o.bits = static_cast<int>(args.get_int("bits", w8a8 ? 8 : 4));
  o.group = args.get_int("group", 128);
  const ModelSource source = model_source(args.get("checkpoint"));
  o.calib_seq_len = std::min<int64_t>(256, source.config.model.max_seq_len);
  const int64_t sequences = quant_method_calibrates(o.method) ? args.get_int("calib-tokens", 8192) / o.calib_seq_len : 0;
  std::printf("loom quantize --method %s --bits %d on %s: %s\n", quant_method_name(o.method), o.bits, source.path.c_str(),
              describe(quantize_memory_estimate(source, o, sequences)).c_str());
  return 0;
}

// The process's resident bytes now (/proc/self/statm), 0 where unreadable.
int64_t process_rss() {
  std::ifstream statm("/proc/self/statm");
  int64_t pages = 0, resident = 0;
  return statm >> pages >> resident ? resident * static_cast<int64_t>(::sysconf(_SC_PAGESIZE)) : 0;
}

// loom memory --serve: what `loom serve` with these flags holds before its first request: the
// model loaded as it loads it (measured: the process's resident bytes), the KV pool it reserves
// and the step workspace of its engine (GenerationEngine::workspace_bytes). A request's peak
// stays within their sum whatever its prompt's length (--prefill-chunk > 0).
int serve_memory(const Args& args) {
  LOOM_CHECK(args.has("checkpoint"), "loom memory --serve needs --checkpoint PATH (the model loom serve would serve)");
  const ModelSource source = model_source(args.get("checkpoint"));
  const EngineConfig ec = serving_engine_config(args, source.config.model.head_dim());
  auto backend = inference_backend(source, args.get("device", ""));
  const std::unique_ptr<Transformer> model = open_inference_model(source, *backend);
  const int64_t loaded = process_rss();
  const GenerationEngine engine(*model, ec);
  const int64_t kv = engine.cache().bytes_reserved(), workspace = engine.workspace_bytes();
  const int64_t state = engine.recurrent_state_bytes_max();  // hybrid models' linear-attention blocks
  const std::string state_line =
      state > 0 ? str_cat("  linear-attention state (", ec.max_batch, " sequences x ",
                          format_bytes(static_cast<size_t>(recurrent_state_bytes(model->config()))), ", host) ",
                          format_bytes(static_cast<size_t>(state)), "\n")
                : "";
  std::printf("loom serve --checkpoint %s (max batch %lld, --prefill-chunk %lld, %lld KV blocks of %lld):\n"
              "  model loaded, with the process (measured resident) %s\n  KV pool (reserved) %s\n%s"
              "  step workspace %s\n  total %s\n",
              source.path.c_str(), static_cast<long long>(ec.max_batch), static_cast<long long>(ec.prefill_chunk),
              static_cast<long long>(engine.cache().config().num_blocks), static_cast<long long>(ec.block_size),
              format_bytes(static_cast<size_t>(loaded)).c_str(), format_bytes(static_cast<size_t>(kv)).c_str(),
              state_line.c_str(), workspace_note(engine).c_str(),
              workspace > 0 ? format_bytes(static_cast<size_t>(loaded + kv + state + workspace)).c_str()
                            : "unbounded: whole prompts grow the workspace (--prefill-chunk 0)");
  return 0;
}

}  // namespace

int memory_main(int argc, char** argv) {
  const Args args(argc, argv, "memory", kHelp,
                  {{"config", "FILE", "a TOML config applied after configs/default.toml"},
                   {"set", "KEY=VALUE,...", "config overrides, applied last (comma-separated; repeatable)"},
                   {"ranks", "N", "data-parallel ranks (default: the mpirun world, else 1)"},
                   {"params", "P", "the parameter count of the ZeRO table (default: the model's), e.g. 7.5e9"},
                   {"measure", "", "also run one training step and print the measured bytes beside the estimate"},
                   {"methods", "", "also print full fine-tuning vs LoRA vs QLoRA model-state bytes for this model"},
                   {"quantize", "METHOD", "the peak of loom quantize --method METHOD on --checkpoint instead"},
                   {"checkpoint", "PATH", "the model --quantize reads (a Hugging Face folder or Loom checkpoint)"},
                   {"bits", "B", "--quantize: bits per weight (default 4; W8A8 methods 8)"},
                   {"group", "G", "--quantize: input columns per scale (default 128)"},
                   {"calib-tokens", "N", "--quantize: calibration tokens of gptq, awq, smoothquant (default 8192)"},
                   {"serve", "", "what loom serve holds for --checkpoint before its first request instead"},
                   {"max-batch", "N", "--serve: rows of continuous batching (default 16)"},
                   {"prefill-chunk", "N", "--serve: prompt tokens a step beside the decoding rows (default 512)"},
                   {"kv-memory", "BYTES", "--serve: the KV pool's budget (default: 90% of the available memory)"},
                   {"kv-blocks", "N", "--serve: blocks in the KV pool"},
                   {"kv-block", "N", "--serve: positions a block (default 16)"},
                   {"kv", "FORMAT", "--serve: the KV cache's format (default fp32)"},
                   {"speculate", "K", "--serve: tokens a request proposes a step"},
                   {"device", "cpu|cuda", "--serve: where the model runs (default: the checkpoint's)"}});
  if (args.has("quantize")) return quantize_memory(args);
  if (args.has("serve")) return serve_memory(args);
  LoomConfig config = load_config(args);
  const bool model_parallel = config.parallel.tp > 1 || config.parallel.pp > 1 || config.parallel.cp > 1 ||
                              config.parallel.ep > 1;
  LOOM_CHECK(!args.has("measure") || !model_parallel, "loom memory --measure runs data-parallel layouts only "
             "(parallel.tp, pp, cp and ep are estimated, not measured: got ", config.parallel.tp, ", ",
             config.parallel.pp, ", ", config.parallel.cp, ", ", config.parallel.ep, ")");
  resolve_run_config(config);  // train.init_from: the model is the weights' (with the run's peft.*), as loom train
  vocab_from_data(config);
  const bool mpi = launched_by_mpirun();
  std::unique_ptr<Communicator> comm = mpi ? make_mpi_communicator() : make_local_communicator();
  MemoryPlan plan = memory_plan(config, 1);
  // The data-parallel ranks: --ranks, else parallel.dp, else what the world leaves.
  const int model_ranks = plan.tp * plan.pp * plan.cp;  // (memory_plan's, from parallel.*)
  const int dp_default = config.parallel.dp > 0 ? static_cast<int>(config.parallel.dp) : std::max(1, comm->size() / model_ranks);
  plan.ranks = static_cast<int>(args.get_int("ranks", dp_default));
  LOOM_CHECK(!args.has("measure") || plan.ranks == comm->size(), "loom memory --measure runs on the ranks it has (",
             comm->size(), "): drop --ranks or launch with mpirun -np ", plan.ranks);
  const MemoryEstimate est = estimate_memory(plan);
  const bool lead = comm->rank() == 0;

  MemoryEstimate measured;
  if (args.has("measure")) {
    auto backend = make_cpu_backend();
    Transformer model(*backend, config.model);
    model.init_weights(config.loop.seed);
    DdpConfig ddp;
    ddp.zero_stage = config.parallel.zero_stage;
    Trainer trainer(*backend, model, config.train, comm->size() > 1 ? comm.get() : nullptr, ddp);
    // LoRA's compact frozen base, as a run makes it (train/parallelize.cpp).
    if (config.model.lora_quantize_base) model.quantize_base();
    else if (plan.compact_base && FrozenBase::keeps_bf16(config.model, model.precision().param_bf16, plan.zero_stage)) {
      model.keep_base_bf16();
    }
    std::vector<int32_t> tokens(static_cast<size_t>(64 * config.train.seq_len));
    for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<int32_t>((i * 2654435761u) % config.model.vocab_size);
    RandomWindowSource data(std::move(tokens), config.loop.seed);
    trainer.train_step(data);
    const MemoryTracker& mem = backend->allocator().tracker();
    for (int c = 0; c < MEM_CATEGORY_COUNT; ++c) measured.bytes[c] = static_cast<int64_t>(mem.peak(static_cast<MemCategory>(c)));
    // Parameters and gradients as resident pages (ZeRO returns the unowned ones to the OS); the
    // bf16 weight copy is allocated apart from the flat fp32 buffer.
    if (model.params().category() == MEM_PARAMETERS) {
      measured.bytes[MEM_PARAMETERS] = resident_bytes(model.params()) +
                                       (static_cast<int64_t>(mem.peak(MEM_PARAMETERS)) - 4 * model.params().numel());
    } else {  // the fp32 master weights offloaded: the device holds the bf16 copy
      measured.bytes[MEM_PARAMETERS] = static_cast<int64_t>(mem.current(MEM_PARAMETERS));
    }
    measured.bytes[MEM_GRADIENTS] = resident_bytes(model.grads());
  }
  if (!lead) return 0;
  std::printf("%s: %lld parameters%s, micro-batch %lld x %lld, optimizer %s, precision %s, recompute %s%s, "
              "ZeRO-%d over %d data-parallel ranks%s\n", std::string(arch_name(config.model.arch)).c_str(),
              static_cast<long long>(est.parameters),
              plan.tp > 1 ? str_cat(" in each of the ", plan.tp, " tensor-parallel slices").c_str() : "", static_cast<long long>(plan.batch),
              static_cast<long long>(plan.seq_len), config.train.optim.name.c_str(),
              resolve_policy(config.train.precision).describe().c_str(), plan.recompute.c_str(),
              plan.flash_attention ? ", flash attention" : "", plan.zero_stage,
              plan.ranks, plan.cp > 1 ? str_cat(" x ", plan.cp, " context-parallel").c_str() : "");
  if (model_parallel) {
    std::printf("layout: tp %d%s x pp %d%s x cp %d%s x ep %d; this rank computes %lld parameters%s\n", plan.tp,
                plan.sequence_parallel ? " (sequence parallel)" : "", plan.pp,
                plan.pp > 1 ? str_cat(" (", enum_name(plan.schedule), ", ", plan.micro, " micro-batches)").c_str() : "", plan.cp,
                plan.cp > 1 ? (plan.ulysses ? " (Ulysses)" : " (ring)") : "", plan.ep,
                static_cast<long long>(est.rank_parameters),
                plan.pp > 1 ? str_cat(", pipeline rank ", est.pp_rank, " (the largest)").c_str() : "");
  }
  std::printf("  %-16s %14s%s\n", "per rank", "estimated", args.has("measure") ? "       measured  measured/est" : "");
  for (const MemCategory c : {MEM_PARAMETERS, MEM_GRADIENTS, MEM_OPTIMIZER_STATE, MEM_ACTIVATIONS, MEM_WORKSPACE,
                              MEM_OFFLOADED}) {
    if ((c == MEM_OFFLOADED || c == MEM_WORKSPACE) && est.bytes[c] == 0) continue;
    std::printf("  %-16s %14s", std::string(mem_category_name(c)).c_str(),
                format_bytes(static_cast<size_t>(est.bytes[c])).c_str());
    if (args.has("measure")) {
      std::printf(" %14s %8.4f", format_bytes(static_cast<size_t>(measured.bytes[c])).c_str(),
                  est.bytes[c] > 0 ? static_cast<double>(measured.bytes[c]) / static_cast<double>(est.bytes[c]) : 0.0);
    }
    std::printf("\n");
  }
  std::printf("  %-16s %14s  (%s not estimated)\n", "total", format_bytes(static_cast<size_t>(est.total())).c_str(),
              est.bytes[MEM_WORKSPACE] > 0 ? "other workspace and communication buffers"
                                            : "workspace and communication buffers");
  const double P = args.has("params") ? args.get_double("params", 0.0) : static_cast<double>(est.parameters);
  const auto [w, g, K] = zero_bytes_per_param(plan);
  const auto z = zero_model_state_bytes(P, plan.ranks, w, g, K);
  std::printf("ZeRO model states (Rajbhandari et al. 2020), %.4g parameters x (w %g + g %g + K %g) bytes over %d ranks:\n"
              "  stage 0 %s | stage 1 (os) %s | stage 2 (os+g) %s | stage 3 (os+g+p) %s\n",
              P, w, g, K, plan.ranks, gb(z[0]).c_str(), gb(z[1]).c_str(), gb(z[2]).c_str(), gb(z[3]).c_str());
  if (args.has("methods")) {
    const ModelConfig& m = config.model;
    std::printf("fine-tuning methods (one rank; fp32 weights and gradients, optimizer %s; LoRA rank %lld, alpha %g, "
                "targets %s):\n  %-8s %14s %11s %11s %11s %11s %13s\n", config.train.optim.name.c_str(),
                static_cast<long long>(m.lora_rank), static_cast<double>(m.lora_alpha), m.lora_targets.c_str(), "method",
                "trainable", "weights", "gradients", "optimizer", "total", "saved weights");
    for (const FinetuneMemory& r : finetune_memory(m, config.train.optim)) {
      std::printf("  %-8s %14lld %11s %11s %11s %11s %13s%s\n", r.method.c_str(), static_cast<long long>(r.trainable),
                  gb(static_cast<double>(r.weights)).c_str(), gb(static_cast<double>(r.gradients)).c_str(),
                  gb(static_cast<double>(r.optimizer)).c_str(), gb(static_cast<double>(r.total())).c_str(),
                  format_bytes(static_cast<size_t>(r.adapter_file)).c_str(), r.method == "qlora" ? "  (formula)" : "");
    }
  }
  return 0;
}

}  // namespace loom::cli
