// loom: the command-line front end. Every error reaches the user as one line on stderr and a
// non-zero exit status.
#include <chrono>
#include <cstdio>
#include <cstring>
#include <exception>
#include <new>
#include <string>
#include <thread>

#include "cli.h"
#include "commands.h"
#include "loom/comm/communicator.h"
#include "loom/core/signals.h"
#include "loom/core/threads.h"
#include "loom/train/run_control.h"

#ifndef LOOM_VERSION
#define LOOM_VERSION "unknown"
#endif

namespace {

const char* kUsage =
    "usage: loom <command> [options]\n"
    "\n"
    "commands:\n"
    "  prepare     tokenize a text file (default: Debian's fortunes) into token shards\n"
    "  train       train a model (no arguments: the default small GPT-2 on the default corpus)\n"
    "  eval        validation loss and perplexity of a checkpoint\n"
    "  generate    sample text from a checkpoint (KV cache; greedy, temperature, top-k, top-p)\n"
    "  tokenizer   train a byte-level BPE tokenizer on your own corpus\n"
    "  tokenize    print the token ids or pieces of standard input (tokenizer.json, tokenizer.model, ...)\n"
    "  plan        rank the parallel layouts that fit a cluster, or simulate a pipeline schedule\n"
    "  memory      bytes per rank by category before running (--measure: and after one step)\n"
    "  serve       an OpenAI-compatible HTTP server (completions, chat, streaming, prefix caching, /metrics)\n"
    "  bench       bench generate: continuous batching against one at a time, KV cache formats\n"
    "  config      print the resolved configuration, or (--markdown) every config key's reference\n"
    "  convert     a checkpoint as another format: --to gguf (llama.cpp, tokenizer included)\n"
    "  quantize    post-training quantization: rtn, gptq, awq (8/4/3 bits), smoothquant / w8a8\n"
    "  prune       magnitude, Wanda or SparseGPT pruning (a sparsity, or 2:4)\n"
    "  merge       average, task arithmetic, TIES or DARE over checkpoints of one model\n"
    "  report      charts and a one-page HTML summary of one or several runs' metrics\n"
    "  supervise   run a training job and relaunch it, resuming, when it dies (--restarts N)\n"
    "  version     print loom's version (also `loom --version`)\n"
    "\n"
    "`loom <command> --help` (or -h) describes each command's options; docs/config.md every config key.\n";

}  // namespace

// No thread that computes may run a signal handler (core/signals.h: oneDNN's JIT GEMMs move the
// stack pointer into the heap): every asynchronous signal is blocked before any thread exists.
LOOM_BLOCK_SIGNALS_BEFORE_LIBRARIES

int main(int argc, char** argv) {
  if (argc < 2 || std::strcmp(argv[1], "--help") == 0 || std::strcmp(argv[1], "-h") == 0) {
    std::fputs(kUsage, argc < 2 ? stderr : stdout);
    return argc < 2 ? 2 : 0;
  }
  const std::string command = argv[1];
  // The commands that compute on several threads start with passive OpenMP waits unless the user
  // chose a policy (core/threads.h); that re-executes the program (~0.5 s here), which the
  // others are spared.
  bool computes = false;
  for (const char* heavy : {"train", "eval", "generate", "serve", "bench", "quantize", "prune"}) computes |= command == heavy;
  if (computes) loom::use_passive_omp_waits(argv);
  // Asynchronous signals were blocked before any library started a thread (below); they reach
  // one signal thread, started once `train` has its handlers (a stop signal sent meanwhile waits).
  // (`serve` starts it itself, once its drain handler is installed.)
  if (command == "train") loom::install_stop_handlers();
  if (command != "serve") loom::start_signal_thread();
  if (command == "--version" || command == "version") {
    std::printf("loom %s\n", LOOM_VERSION);
    return 0;
  }
  try {
    if (computes) loom::short_region_spin_micros();  // a bad LOOM_SPIN_US is refused before any work
    if (command == "prepare") return loom::cli::prepare_main(argc - 2, argv + 2);
    if (command == "train") return loom::cli::train_main(argc - 2, argv + 2);
    if (command == "eval") return loom::cli::eval_main(argc - 2, argv + 2);
    if (command == "generate") return loom::cli::generate_main(argc - 2, argv + 2);
    if (command == "tokenizer") return loom::cli::tokenizer_main(argc - 2, argv + 2);
    if (command == "tokenize") return loom::cli::tokenize_main(argc - 2, argv + 2);
    if (command == "plan") return loom::cli::plan_main(argc - 2, argv + 2);
    if (command == "memory") return loom::cli::memory_main(argc - 2, argv + 2);
    if (command == "serve") return loom::cli::serve_main(argc - 2, argv + 2);
    if (command == "bench") return loom::cli::bench_main(argc - 2, argv + 2);
    if (command == "config") return loom::cli::config_main(argc - 2, argv + 2);
    if (command == "convert") return loom::cli::convert_main(argc - 2, argv + 2);
    if (command == "quantize") return loom::cli::quantize_main(argc - 2, argv + 2);
    if (command == "prune") return loom::cli::prune_main(argc - 2, argv + 2);
    if (command == "merge") return loom::cli::merge_main(argc - 2, argv + 2);
    if (command == "report") return loom::cli::report_main(argc - 2, argv + 2);
    if (command == "supervise") return loom::cli::supervise_main(argc - 2, argv + 2);
    std::fprintf(stderr, "loom: unknown command '%s'; commands: prepare, train, eval, generate, tokenizer, tokenize, plan, memory, "
                 "serve, bench, config, convert, quantize, prune, merge, report, supervise, version (see `loom --help`)\n", command.c_str());
    return 2;
  } catch (const loom::cli::HelpRequest& help) {
    std::fputs(help.text.c_str(), stdout);
    return 0;
  } catch (const std::bad_alloc&) {
    // Every reader and renderer bounds what it holds and names the file and the limit; an
    // allocation that still fails is said in one line rather than as std::bad_alloc.
    std::fprintf(stderr, "loom %s: error: out of memory (an allocation failed; see `loom %s --help` and "
                 "docs/operations.md \"Memory and input limits\")\n", command.c_str(), command.c_str());
    loom::abort_other_ranks(1);
    return 1;
  } catch (const std::exception& e) {
    // Under several ranks the error is printed once, by the rank that found it, naming it: rank 0
    // prints at once; another waits a moment, in which rank 0 ends the job if it found the same
    // error (a bad config), so that only one line reaches the user.
    int rank = -1;
    try {
      const loom::LaunchInfo launch = loom::detect_launch();
      if (launch.mpi && launch.size != 1) rank = launch.rank;
    } catch (const std::exception&) {
    }
    if (rank > 0) std::this_thread::sleep_for(std::chrono::seconds(1));
    std::fprintf(stderr, "loom %s: error: %s%s\n", command.c_str(), rank >= 0 ? ("rank " + std::to_string(rank) + ": ").c_str() : "",
                 e.what());
    std::fflush(stderr);
    loom::abort_other_ranks(1);  // under mpirun the peers would otherwise wait for this rank forever
    return 1;
  }
}
