// loom convert: a checkpoint in another format. --to gguf writes one llama.cpp GGUF file with
// the tokenizer inside (checkpoint/gguf_export.h, docs/gguf.md).
#include <cstdio>

#include "cli.h"
#include "commands.h"
#include "loom/checkpoint/gguf_export.h"
#include "loom/core/error.h"

namespace loom::cli {

namespace {
const char* kHelp =
    "usage: loom convert --to gguf --checkpoint PATH --out FILE.gguf [--type f32|f16|q8_0|q4_0]\n"
    "                    [--name NAME] [--tokenizer KIND_OR_DIR]\n"
    "\n"
    "PATH is a step folder, a run folder or a checkpoints folder (newest valid checkpoint).\n"
    "--to gguf: one GGUF v3 file for llama.cpp (GPT-2 and Llama models) holding the weights, the\n"
    "architecture metadata and the run's tokenizer; --type chooses the matrices' type (norms and\n"
    "biases stay f32): f32 (default), f16, q8_0 or q4_0 (ggml's 32-element blocks). The file is\n"
    "written atomically. docs/gguf.md has the tensor mapping and llama.cpp's measured agreement.\n";
}  // namespace

int convert_main(int argc, char** argv) {
  const Args args(argc, argv, "convert", kHelp,
                  {{"to", "FORMAT", "the output format: gguf (required)"},
                   {"checkpoint", "PATH", "a step folder, a run folder or a checkpoints folder (required)"},
                   {"out", "FILE", "the file to write (required)"},
                   {"type", "TYPE", "--to gguf: f32 | f16 | q8_0 | q4_0 for the matrices (default f32)"},
                   {"name", "NAME", "--to gguf: general.name (default: the run's run.name)"},
                   {"tokenizer", "KIND_OR_DIR", "the tokenizer to embed (default: the run's data.tokenizer)"}});
  LOOM_CHECK(args.has("to"), "loom convert needs --to gguf");
  LOOM_CHECK(args.get("to") == "gguf", "--to must be gguf, got '", args.get("to"), "'");
  LOOM_CHECK(args.has("checkpoint"), "loom convert needs --checkpoint PATH");
  LOOM_CHECK(args.has("out"), "loom convert needs --out FILE");
  const auto type = parse_enum<GgufExportType>(args.get("type", "f32"), "--type");
  const std::string step_dir = resolve_checkpoint(args.get("checkpoint"));
  const LoomConfig config = checkpoint_config(step_dir);
  const auto tokenizer = load_tokenizer(args.get("tokenizer", config.data.tokenizer));
  const GgufVocabulary vocab = gguf_vocabulary(*tokenizer);

  auto backend = make_cpu_backend();
  Transformer model(*backend, config.model);
  CheckpointManager(step_dir).load(step_dir, ModelState{config.model, model.params()}, OptimizerState{});
  const Tensor& params = model.params();
  const GgufExportSummary s =
      export_gguf(config.model, {params.data<float>(), static_cast<size_t>(params.numel())}, vocab, type,
                  args.get("name", config.run.name), args.get("out"));
  std::printf("wrote %s: %s, %lld tensors (%lld matrices %s, the rest f32), %lld tokens, %.2f MB\n",
              args.get("out").c_str(), std::string(arch_name(config.model.arch)).c_str(), static_cast<long long>(s.tensors),
              static_cast<long long>(s.converted), std::string(enum_name(type)).c_str(),
              static_cast<long long>(vocab.tokens.size()), static_cast<double>(s.bytes) / 1e6);
  return 0;
}

}  // namespace loom::cli
