// Training throughput of Loom on the CPU: a GPT-2-shaped model, random tokens, AdamW steps.
// Prints one JSON line: tokens/s, step time, MFU against the GEMM peak of the recipe's compute
// dtype (f32 or bf16; 2048^3 through the backend, measured once per machine and cached:
// train/throughput.h; --peak-cache none measures it in the process) and against the
// datasheet-style peak beside it, and peak bytes per memory category.
//   build/bench/train_bench --model gpt2-124m --batch 4 --seq 64 --steps 10 --warmup 2 [--compute LIST] [--lora R [--qlora 1] [--dora 1]]
// --compute takes a comma-separated list of linear recipes (precision/policy.h: f32, bf16, fp16,
// fp8-delayed, fp8-current, fp8-block), each optionally with +mxfp4 or +nvfp4 (weight QAT) and
// +f32-saved (precision.activations = f32: no bf16-saved inputs), +f32-outputs (precision.outputs =
// f32: fp32 logits and fc output) and +attn-bf16 (precision.attention = bf16); "both" means f32,bf16. Each runs in the same process, one JSON line each; with more than one, a
// last line gives every recipe's tokens/s relative to the first.
// bench/compare_train.py runs it beside the PyTorch reference and prints the ratios.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>
#include <algorithm>

#include <sys/resource.h>
#include <unistd.h>

#include "loom/core/error.h"
#include "loom/core/pages.h"
#include "loom/core/threads.h"
#include "loom/train/throughput.h"
#include "loom/train/trainer.h"

namespace {

using namespace loom;

struct Args {
  std::string model = "gpt2-124m";
  int64_t batch = 4, seq = 64, steps = 10, warmup = 2;
  std::string compute = "f32";
  std::string device = "cpu";  // make_backend: cpu | cuda
  bool flash = false;          // train.flash_attention
  double peak_tflops = 0.0;    // > 0: MFU against this stated peak instead of the measured GEMM peak
  std::string peak_cache = default_peak_cache_dir();  // "none": measure the peak in this process
  int64_t lora = 0;            // > 0: LoRA of this rank on every linear layer of the blocks, the base frozen
  bool qlora = false;          // with --lora: the base's block matrices in NF4 (peft.quantize_base)
  bool dora = false;           // with --lora: DoRA's magnitudes (peft.dora)
};

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string key = argv[i], value = argv[i + 1];
    if (key == "--model") a.model = value;
    else if (key == "--batch") a.batch = std::stoll(value);
    else if (key == "--seq") a.seq = std::stoll(value);
    else if (key == "--steps") a.steps = std::stoll(value);
    else if (key == "--warmup") a.warmup = std::stoll(value);
    else if (key == "--compute") a.compute = value;
    else if (key == "--device") a.device = value;
    else if (key == "--flash") a.flash = value == "1" || value == "true";
    else if (key == "--peak-tflops") a.peak_tflops = std::stod(value);
    else if (key == "--peak-cache") a.peak_cache = value == "none" ? "" : value;
    else if (key == "--lora") a.lora = std::stoll(value);
    else if (key == "--qlora") a.qlora = value == "1" || value == "true";
    else if (key == "--dora") a.dora = value == "1" || value == "true";
    else throw Error("unknown option " + key + " (expected --model, --batch, --seq, --steps, --warmup, --compute, "
                     "--device, --flash, --peak-tflops, --peak-cache, --lora, --qlora, --dora)");
  }
  return a;
}

// The process's peak resident set (getrusage), in bytes: comparable with PyTorch's.
long long max_rss_bytes() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return static_cast<long long>(usage.ru_maxrss) * 1024;
}

// The resident set now (/proc/self/statm), not the lifetime peak.
long long current_rss_bytes() {
  long long pages = 0, resident = 0;
  if (FILE* f = std::fopen("/proc/self/statm", "r")) {
    if (std::fscanf(f, "%lld %lld", &pages, &resident) != 2) resident = 0;
    std::fclose(f);
  }
  return resident * static_cast<long long>(sysconf(_SC_PAGESIZE));
}

// Random token ids (Philox-free: a simple LCG is enough for throughput).
std::vector<int32_t> random_tokens(int64_t count, int64_t vocab) {
  std::vector<int32_t> t(count);
  uint64_t state = 12345;
  for (auto& v : t) {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    v = static_cast<int32_t>((state >> 33) % static_cast<uint64_t>(vocab));
  }
  return t;
}

// One measured run; prints its JSON line and returns tokens/s.
double run(const Args& args, const std::string& compute) {
  auto backend = make_backend(args.device);
  ModelConfig config = model_preset(args.model);
  if (args.lora > 0) {  // docs/finetune.md: alpha = 2 r, every linear layer of the blocks
    config.peft_method = PeftMethod::lora;
    config.lora_rank = args.lora;
    config.lora_alpha = static_cast<float>(2 * args.lora);
    config.lora_targets = config.arch == ARCH_GPT2 ? "q,k,v,o,up,down" : "q,k,v,o,gate,up,down";
    config.lora_dora = args.dora;
  }
  Transformer model(*backend, config);
  model.init_weights(1);
  TrainConfig tc;
  tc.batch_size = args.batch, tc.seq_len = args.seq, tc.steps = args.warmup + args.steps, tc.schedule.warmup = 1;
  size_t plus = compute.find('+');
  tc.precision.compute = compute.substr(0, plus);
  while (plus != std::string::npos) {  // "+mxfp4" / "+nvfp4": QAT; "+f32-saved", "+f32-outputs", "+attn-bf16": the precision keys
    const size_t next = compute.find('+', plus + 1);
    const std::string part = compute.substr(plus + 1, next == std::string::npos ? std::string::npos : next - plus - 1);
    if (part == "f32-saved") tc.precision.activations = "f32";
    else if (part == "f32-outputs") tc.precision.outputs = "f32";
    else if (part == "attn-bf16") tc.precision.attention = "bf16";
    else tc.precision.qat = part;
    plus = next;
  }
  tc.flash_attention = args.flash;
  Trainer trainer(*backend, model, tc);
  GemmPeak peak;  // of the recipe's compute dtype, or the stated one
  if (args.peak_tflops > 0.0) {
    peak.measured_gflops = args.peak_tflops * 1e3;  // a stated peak (a GPU's datasheet dense bf16 figure)
  } else {
    peak = gemm_peak(*backend, mfu_dtype(model.precision()), args.peak_cache);
  }
  if (args.qlora) model.quantize_base();  // as loom train does, after the trainer
  RandomWindowSource data(random_tokens(1 << 20, config.vocab_size), 7);
  for (int64_t i = 0; i < args.warmup; ++i) trainer.train_step(data);
  backend->allocator().tracker().reset_peaks();
  double seconds = 0.0, loss = 0.0;
  int64_t tokens = 0;
  for (int64_t i = 0; i < args.steps; ++i) {
    const StepStats s = trainer.train_step(data);
    seconds += s.seconds;
    tokens += s.tokens;
    loss = s.loss;
  }
  const double tps = static_cast<double>(tokens) / seconds;
  const double flops = train_flops_per_token(config, args.seq) * tps;
  const double mfu = flops / 1e9 / peak.measured_gflops;
  if (const std::string w = peak.above_peak_warning(mfu); !w.empty())
    std::fprintf(stderr, "train_bench: warning: %s\n", w.c_str());
  const MemoryTracker& mem = backend->allocator().tracker();
  std::printf(
      "{\"impl\": \"loom\", \"device\": \"%s\", \"omp_wait_policy\": \"%s\", \"flash\": %s, \"compute\": \"%s\", \"model\": \"%s\", \"batch\": %lld, \"seq\": %lld, \"steps\": %lld, "
      "\"tokens_per_s\": %.2f, \"step_ms\": %.2f, \"peak_dtype\": \"%s\", \"gemm_peak_gflops\": %.1f, \"peak_cached\": %s, \"gemm_kernels\": \"%s\", "
      "\"datasheet_peak_gflops\": %.1f, \"clock_ghz\": %.3f, \"achieved_gflops\": %.1f, \"mfu\": %.4f, \"mfu_datasheet\": %.4f, "
      "\"final_loss\": %.4f, \"params\": %lld, \"lora\": %lld, \"qlora\": %s, \"max_rss\": %lld, \"rss_end\": %lld",
      args.device.c_str(), omp_wait_policy().c_str(), args.flash ? "true" : "false", compute.c_str(), args.model.c_str(), static_cast<long long>(args.batch), static_cast<long long>(args.seq),
      static_cast<long long>(args.steps), tps, 1e3 * seconds / static_cast<double>(args.steps),
      args.peak_tflops > 0.0 ? "stated" : std::string(dtype_name(peak.dtype)).c_str(), peak.measured_gflops,
      peak.cached ? "true" : "false", backend->gemm_kernels(peak.dtype).c_str(), peak.datasheet_gflops, peak.clock_ghz, flops / 1e9, mfu,
      peak.datasheet_gflops > 0.0 ? flops / 1e9 / peak.datasheet_gflops : 0.0, loss, static_cast<long long>(param_count(config)), static_cast<long long>(args.lora),
      args.qlora ? "true" : "false", max_rss_bytes(), current_rss_bytes());
  for (int c = 0; c < MEM_CATEGORY_COUNT; ++c) {
    const auto cat = static_cast<MemCategory>(c);
    std::printf(", \"peak_bytes_%s\": %zu", std::string(mem_category_name(cat)).c_str(), mem.peak(cat));
  }
  // Allocated is not resident: a frozen range's gradient pages are released (LoRA).
  std::printf(", \"peak_bytes_total\": %zu, \"resident_bytes_gradients\": %lld, \"resident_bytes_parameters\": %lld, "
              "\"nf4_bytes\": %lld}\n", mem.peak_total(), static_cast<long long>(resident_bytes(model.grads())),
              static_cast<long long>(resident_bytes(model.params())), static_cast<long long>(model.quantized_bytes()));
  std::fflush(stdout);
  return tps;
}

}  // namespace

int main(int argc, char** argv) {
  use_passive_omp_waits(argv);  // as loom: passive waits unless OMP_WAIT_POLICY or GOMP_SPINCOUNT is set
  try {
    const Args args = parse(argc, argv);
    std::vector<std::string> recipes;
    const std::string list = args.compute == "both" ? "f32,bf16" : args.compute;
    for (size_t begin = 0; begin <= list.size();) {
      const size_t end = std::min(list.find(',', begin), list.size());
      if (end > begin) recipes.push_back(list.substr(begin, end - begin));
      begin = end + 1;
    }
    LOOM_CHECK(!recipes.empty(), "--compute needs at least one recipe");
    std::vector<double> tps;
    for (const std::string& r : recipes) tps.push_back(run(args, r));
    if (recipes.size() > 1) {
      std::printf("{\"tokens_per_s_relative_to\": \"%s\"", recipes[0].c_str());
      for (size_t i = 1; i < recipes.size(); ++i) std::printf(", \"%s\": %.3f", recipes[i].c_str(), tps[i] / tps[0]);
      std::printf("}\n");
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "train_bench: %s\n", e.what());
    return 1;
  }
}
