// loom train: its arguments, then a training run (train/run.h) with the printer of
// train_output.h as its observer. --restarts runs this same command under `loom supervise`.
#include <cstring>
#include <filesystem>

#include "cli.h"
#include "commands.h"
#include "loom/comm/communicator.h"
#include "loom/core/error.h"
#include "loom/train/run.h"
#include "train_output.h"

namespace loom::cli {

namespace fs = std::filesystem;

namespace {

const char* kHelp =
    "usage: loom train [--config FILE] [--set key=value,...] [--resume [PATH]] [--overwrite] [--restarts N]\n"
    "                  [--stop-at-step N] [--dry-run]\n"
    "\n"
    "Trains the model described by configs/default.toml, then FILE, then the --set overrides\n"
    "(comma-separated or repeated). With no arguments it trains the default small GPT-2 on the\n"
    "default corpus (preparing it first if data/fortunes is missing). Writes runs/<run.name>/:\n"
    "config.toml (resolved), metrics.jsonl, checkpoints/step_N/, samples.txt.\n"
    "--resume continues from the newest valid checkpoint of the run (corrupt ones are skipped with\n"
    "a message), or from the checkpoint PATH names, bitwise identical to an uninterrupted run;\n"
    "metrics.jsonl is cut back to the resumed step. A run folder that already holds checkpoints or\n"
    "metrics is refused without --resume or --overwrite. SIGTERM or SIGINT finishes the step,\n"
    "writes a checkpoint and exits with status 75 (a second signal exits at once). --dry-run builds\n"
    "the model, data and optimizer, prints the memory by category and the optimizer state per\n"
    "parameter (measured and by formula), and takes no step. docs/operations.md.\n";

}  // namespace

int train_main(int argc, char** argv) {
  const Args args(argc, argv, "train", kHelp,
                  {{"config", "FILE", "a TOML config applied after configs/default.toml"},
                   {"set", "KEY=VALUE,...", "config overrides, applied last (comma-separated; repeatable)"},
                   {"resume", "[PATH]", "continue from the newest valid checkpoint of the run, or from PATH (a step folder)"},
                   {"overwrite", "", "start over in a run folder that holds checkpoints or metrics (deletes them)"},
                   {"restarts", "N", "relaunch the training when it dies, resuming, up to N times (loom supervise)"},
                   {"quiet", "", "print only warnings, errors and the final summary line"},
                   {"verbose", "", "a progress line every step, with its gradient norm and bytes per communicator"},
                   {"stop-at-step", "N", "checkpoint and stop after step N, as an interrupted run would"},
                   {"dry-run", "", "build everything, print the memory and optimizer state, take no step"}},
                  config_keys_help());
  if (args.has("restarts")) {  // this same command line without it, under `loom supervise` (cmd_supervise.cpp)
    LOOM_CHECK(!launched_by_mpirun(), "--restarts restarts one process; under mpirun supervise the whole job: "
               "loom supervise --restarts N -- mpirun ... loom train ...");
    std::vector<std::string> command = {fs::read_symlink("/proc/self/exe").string(), "train"};
    for (int i = 0; i < argc; ++i) {
      if (std::strcmp(argv[i], "--restarts") == 0) ++i;  // (and its value)
      else if (std::strncmp(argv[i], "--restarts=", 11) != 0) command.emplace_back(argv[i]);
    }
    return supervise(command, args.get_int("restarts", 0), 1.0);
  }
  LOOM_CHECK(!args.has("verbose") || !args.has("quiet"), "--quiet and --verbose exclude each other");
  LoomConfig config = load_config(args);
  resolve_run_config(config);
  RunOptions options;
  options.resume = args.has("resume"), options.resume_from = args.get("resume");
  options.overwrite = args.has("overwrite"), options.dry_run = args.has("dry-run"), options.verbose = args.has("verbose");
  options.stop_at = args.get_int("stop-at-step", -1);
  TrainPrinter printer(args.has("quiet"), options.verbose);
  TrainingRun run(std::move(config), options, printer,
                  launched_by_mpirun() ? make_mpi_communicator() : make_local_communicator());
  return run.run();
}

}  // namespace loom::cli
