// loom prune: magnitude, Wanda or SparseGPT pruning of a checkpoint's block linear weights
// (compress/prune_merge.h, docs/compression.md), written as a Loom checkpoint.
#include <cstdio>

#include "cli.h"
#include "commands.h"
#include "loom/compress/prune_merge.h"
#include "loom/core/error.h"

namespace loom::cli {

namespace {
const char* kHelp =
    "usage: loom prune --checkpoint PATH --method magnitude|wanda|sparsegpt --out DIR\n"
    "                  [--sparsity S | --pattern N:M] [--calib FILE] [--calib-tokens N]\n"
    "\n"
    "Zeroes a fraction S (default 0.5) of every block's linear weights, or N of every M\n"
    "consecutive inputs of each row (--pattern 2:4, the semi-structured sparsity of sparse tensor\n"
    "cores); the embeddings, norms and head stay dense. magnitude: the smallest |w| of each matrix;\n"
    "wanda: the smallest |w| ||x|| of each output row; sparsegpt: SparseGPT's reconstruction. wanda\n"
    "and sparsegpt read --calib FILE (first --calib-tokens tokens, default 8192). The result is a\n"
    "Loom checkpoint DIR/checkpoints/step_00000000 (f32, the zeros stored) that eval, generate,\n"
    "serve, convert and quantize read.\n";
}  // namespace

int prune_main(int argc, char** argv) {
  const Args args(argc, argv, "prune", kHelp,
                  {{"checkpoint", "PATH", "a Loom checkpoint or run folder, or a Hugging Face model folder (required)"},
                   {"method", "METHOD", "magnitude | wanda | sparsegpt (required)"},
                   {"out", "DIR", "the run folder to write (required)"},
                   {"sparsity", "S", "fraction of each matrix zeroed (default 0.5)"},
                   {"pattern", "N:M", "zero N of every M consecutive inputs instead (e.g. 2:4)"},
                   {"calib", "FILE", "calibration text (wanda, sparsegpt)"},
                   {"calib-tokens", "N", "calibration tokens used (default 8192)"}});
  LOOM_CHECK(args.has("checkpoint"), "loom prune needs --checkpoint PATH");
  LOOM_CHECK(args.has("method"), "loom prune needs --method magnitude|wanda|sparsegpt");
  LOOM_CHECK(args.has("out"), "loom prune needs --out DIR");
  PruneOptions o;
  o.method = parse_prune_method(args.get("method"));
  o.sparsity = args.get_double("sparsity", 0.5);
  if (args.has("pattern")) {
    LOOM_CHECK(!args.has("sparsity"), "--pattern and --sparsity exclude each other");
    const std::string p = args.get("pattern");
    LOOM_CHECK(std::sscanf(p.c_str(), "%d:%d", &o.n, &o.m) == 2 && o.n > 0 && o.m > o.n && o.m <= 64, "--pattern '", p,
               "' is not N:M with 0 < N < M <= 64 (e.g. 2:4)");
    o.sparsity = static_cast<double>(o.n) / o.m;
  }
  LOOM_CHECK(o.sparsity >= 0.0 && o.sparsity < 1.0, "--sparsity must be in [0, 1), got ", o.sparsity);
  const bool calibrates = o.method != PruneMethod::magnitude;
  LOOM_CHECK(calibrates || !args.has("calib"), "--method magnitude uses no calibration data: drop --calib");
  LOOM_CHECK(!calibrates || args.has("calib"), "--method ", args.get("method"), " needs calibration text: --calib FILE");
  check_weights_out(args.get("out"));
  const ModelSource source = model_source(args.get("checkpoint"));
  LOOM_CHECK(!source.quantized, source.path, " is quantized: prune the checkpoint it was made from");
  const LoomConfig& config = source.config;
  auto backend = make_cpu_backend();
  Transformer model(*backend, config.model);
  load_weights(source, model.params());
  const auto sequences = calibrates ? calibration_sequences(args.get("calib"), args.get_int("calib-tokens", 8192), config,
                                                            std::min<int64_t>(256, config.model.max_seq_len))
                                    : std::vector<std::vector<int32_t>>{};
  const bool verbose = stdout_is_terminal();
  const auto [zeroed, total] = prune_model(model, sequences, o, [&](const std::string& line) {
    if (verbose) std::printf("  %s\n", line.c_str());
  });
  const nlohmann::json extra = {{"pruning", {{"method", args.get("method")}, {"sparsity", o.sparsity},
                                             {"pattern", o.m > 0 ? args.get("pattern") : ""}, {"source", source.path},
                                             {"zeroed", zeroed}, {"of", total}}}};
  const std::string path = save_weights_checkpoint(args.get("out"), config, model.params(), extra);
  std::printf("wrote %s: %s pruning, %lld of %lld block linear weights zero (%.2f%%; %.2f%% of all %lld parameters)\n",
              path.c_str(), args.get("method").c_str(), static_cast<long long>(zeroed), static_cast<long long>(total),
              100.0 * static_cast<double>(zeroed) / static_cast<double>(total),
              100.0 * static_cast<double>(zeroed) / static_cast<double>(model.params().numel()),
              static_cast<long long>(model.params().numel()));
  return 0;
}

}  // namespace loom::cli
