// loom convert: a model in another format. --to gguf writes one llama.cpp GGUF file with the
// tokenizer inside (checkpoint/gguf_export.h, docs/gguf.md); --to hf a Hugging Face model folder
// and --to loom a Loom checkpoint (checkpoint/hf_model.h, docs/models.md).
#include <cstdio>
#include <filesystem>

#include "cli.h"
#include "commands.h"
#include "loom/checkpoint/gguf_export.h"
#include "loom/checkpoint/hf_config.h"
#include "loom/checkpoint/hf_model.h"
#include "loom/checkpoint/peft.h"
#include "loom/nn/lora.h"
#include "loom/train/model_export.h"
#include "loom/core/error.h"
#include "loom/core/file_io.h"
#include "loom/data/bpe.h"
#include "loom/data/tokenizer_files.h"

namespace loom::cli {

namespace fs = std::filesystem;

namespace {
const char* kHelp =
    "usage: loom convert --to gguf|hf|loom|peft --checkpoint PATH --out OUT [--adapter DIR]\n"
    "                    [--type f32|f16|bf16|q8_0|q4_0] [--name NAME] [--tokenizer KIND_OR_DIR]\n"
    "\n"
    "PATH is a Loom checkpoint (a step folder, a run folder or a checkpoints folder: the newest\n"
    "valid checkpoint) or a Hugging Face model folder (config.json and model.safetensors or a\n"
    "sharded index).\n"
    "--to gguf: one GGUF v3 file OUT for llama.cpp (GPT-2 and Llama models) holding the weights, the\n"
    "architecture metadata and the tokenizer; --type chooses the matrices' type (norms and biases\n"
    "stay f32): f32 (default), f16, bf16, q8_0 or q4_0 (ggml's 32-element blocks). docs/gguf.md.\n"
    "--to hf: a Hugging Face model folder OUT (config.json, model.safetensors; --type f32 (default)\n"
    "or bf16) with the\n"
    "tokenizer's files copied in (Loom's byte tokenizer written as a tokenizer.json). --to loom: a Loom\n"
    "checkpoint OUT/checkpoints/step_00000000 (weights, no optimizer state, the tokenizer's files\n"
    "inside; none from a Hugging Face folder without them: give --tokenizer) that eval, generate,\n"
    "convert and train.init_from read; an existing OUT that holds anything else (a training run) is\n"
    "refused. Files are written to temporary names and renamed. docs/models.md has the families and\n"
    "how each maps.\n"
    "LoRA (docs/finetune.md): --adapter DIR applies a PEFT adapter folder to PATH's weights. A model\n"
    "with adapters is merged (W + s B A) for --to gguf and --to hf, kept as it is by --to loom, and\n"
    "--to peft writes its adapters alone in PEFT's layout (adapter_config.json, adapter_model.safetensors).\n"
    "--to gguf, hf and peft read PATH one tensor at a time (merging adapters into each weight as it is\n"
    "read): the peak memory is one weight in f32 and the adapters, not the model.\n";

// The tokenizer's files, copied into `out` (a named kind such as "byte" has none).
void copy_tokenizer_files(const std::string& tokenizer, const fs::path& out) {
  for (const std::string& file : tokenizer_files(tokenizer)) {
    fs::copy_file(file, out / fs::path(file).filename(), fs::copy_options::overwrite_existing);
  }
}

// Loom's byte tokenizer as Hugging Face files: tokenizer.json, a byte-level BPE without merges
// whose token b is byte b (in GPT-2's byte alphabet) and <|endoftext|> = 256, and a
// tokenizer_config.json naming it the end of sequence. Loom reads them back (HfTokenizer: the
// same ids for every byte string), and so does Hugging Face's tokenizers (its JavaScript port,
// tools/hf_encode.js, gives the same ids and parses <|endoftext|> in text).
void write_byte_tokenizer(const fs::path& out, int64_t max_seq_len) {
  nlohmann::ordered_json vocab = nlohmann::ordered_json::object();
  for (int b = 0; b < 256; ++b) vocab[gpt2_bytes_to_token(std::string(1, static_cast<char>(b)))] = b;
  const nlohmann::ordered_json byte_level = {
      {"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true}, {"use_regex", false}};
  const nlohmann::ordered_json tokenizer = {
      {"version", "1.0"},
      {"truncation", nullptr},
      {"padding", nullptr},
      {"added_tokens", {{{"id", ByteTokenizer::kEotToken}, {"content", "<|endoftext|>"}, {"single_word", false},
                         {"lstrip", false}, {"rstrip", false}, {"normalized", false}, {"special", true}}}},
      {"normalizer", nullptr},
      {"pre_tokenizer", byte_level},
      {"post_processor", byte_level},
      {"decoder", byte_level},
      {"model", {{"type", "BPE"}, {"dropout", nullptr}, {"unk_token", nullptr}, {"continuing_subword_prefix", nullptr},
                 {"end_of_word_suffix", nullptr}, {"fuse_unk", false}, {"byte_fallback", false},
                 {"ignore_merges", false}, {"vocab", vocab}, {"merges", nlohmann::ordered_json::array()}}}};
  const nlohmann::ordered_json config = {{"tokenizer_class", "PreTrainedTokenizerFast"},
                                         {"eos_token", "<|endoftext|>"},
                                         {"model_max_length", max_seq_len},
                                         {"clean_up_tokenization_spaces", false}};
  write_file_atomic((out / "tokenizer.json").string(), tokenizer.dump(2) + "\n");
  write_file_atomic((out / "tokenizer_config.json").string(), config.dump(2) + "\n");
}

int to_gguf(const Args& args, const ModelSource& source, ParamReader& params) {
  const LoomConfig& config = source.config;
  const auto type = parse_enum<GgufExportType>(args.get("type", "f32"), "--type");
  LOOM_CHECK(args.has("tokenizer") || !config.data.tokenizer.empty(), source.path, " records no tokenizer, which a GGUF "
             "file holds: give --tokenizer KIND_OR_DIR");
  const auto tokenizer = load_tokenizer(args.get("tokenizer", config.data.tokenizer));
  const GgufVocabulary vocab = gguf_vocabulary(*tokenizer);
  if (!vocab.placeholders.empty()) {
    std::string ids;
    for (size_t i = 0; i < vocab.placeholders.size() && i < 8; ++i) ids += (i ? ", " : "") + std::to_string(vocab.placeholders[i]);
    std::printf("note: %s gives no token for %zu id(s) below its size (%s%s); written as \"[PAD<id>]\", type unused\n",
                tokenizer->name().c_str(), vocab.placeholders.size(), ids.c_str(), vocab.placeholders.size() > 8 ? ", ..." : "");
  }
  const GgufExportSummary s =
      export_gguf(params, vocab, type, args.get("name", config.run.name), args.get("out"));
  std::printf("wrote %s: %s, %lld tensors (%lld matrices %s, the rest f32), %lld tokens, %.2f MB\n",
              args.get("out").c_str(), s.architecture.c_str(), static_cast<long long>(s.tensors),
              static_cast<long long>(s.converted), std::string(enum_name(type)).c_str(),
              static_cast<long long>(vocab.tokens.size()), static_cast<double>(s.bytes) / 1e6);
  return 0;
}

int to_hf(const Args& args, const ModelSource& source, ParamReader& params) {
  const fs::path out = args.get("out");
  const std::string type = args.get("type", "f32");
  LOOM_CHECK(type == "f32" || type == "bf16", "--to hf: --type must be f32 or bf16, got '", type, "'");
  save_hf_model(out.string(), params, type == "bf16" ? DTYPE_BF16 : DTYPE_F32);
  const std::string tokenizer = args.get("tokenizer", source.config.data.tokenizer);
  if (tokenizer == "byte") {
    write_byte_tokenizer(out, source.config.model.max_seq_len);
    std::printf("wrote Loom's byte tokenizer as tokenizer.json (a byte-level BPE without merges: token b is byte b, "
                "<|endoftext|> is %d) and tokenizer_config.json\n", ByteTokenizer::kEotToken);
  } else if (tokenizer.empty()) {
    std::fprintf(stderr, "loom convert: warning: %s records no tokenizer: %s has none, and eval, generate and serve "
                 "refuse it until one is copied in (or convert again with --tokenizer KIND_OR_DIR)\n",
                 source.path.c_str(), out.string().c_str());
  } else {
    copy_tokenizer_files(tokenizer, out);
  }
  std::printf("wrote %s: a Hugging Face %s folder (config.json, model.safetensors, %s, %lld parameters)\n",
              out.string().c_str(), hf_config_json(params.config())["model_type"].get<std::string>().c_str(),
              type.c_str(), static_cast<long long>(build_param_layout(params.config()).total));
  return 0;
}

int to_loom(const Args& args, const ModelSource& source, const Tensor& params) {
  LoomConfig config = source.config;
  if (args.has("tokenizer")) config.data.tokenizer = args.get("tokenizer");
  const std::string path = save_weights_checkpoint(args.get("out"), config, params);
  std::printf("wrote %s: a Loom checkpoint of a %s model (weights only)\n", path.c_str(),
              std::string(arch_name(config.model.arch)).c_str());
  return 0;
}
}  // namespace

int convert_main(int argc, char** argv) {
  const Args args(argc, argv, "convert", kHelp,
                  {{"to", "FORMAT", "the output format: gguf | hf | loom (required)"},
                   {"checkpoint", "PATH", "a Loom checkpoint or run folder, or a Hugging Face model folder (required)"},
                   {"out", "OUT", "the file (gguf) or folder (hf, loom) to write (required)"},
                   {"type", "TYPE", "--to gguf: f32 | f16 | bf16 | q8_0 | q4_0 for the matrices; --to hf: f32 | bf16 (default f32)"},
                   {"name", "NAME", "--to gguf: general.name (default: the run's run.name)"},
                   {"tokenizer", "KIND_OR_DIR", "the tokenizer to embed or copy (default: the model's)"},
                   {"adapter", "DIR", "a PEFT LoRA adapter folder applied to the weights first"}});
  LOOM_CHECK(args.has("to"), "loom convert needs --to gguf|hf|loom|peft");
  const std::string to = args.get("to");
  LOOM_CHECK(to == "gguf" || to == "hf" || to == "loom" || to == "peft", "--to must be gguf, hf, loom or peft, got '",
             to, "'");
  LOOM_CHECK(args.has("checkpoint"), "loom convert needs --checkpoint PATH");
  LOOM_CHECK(args.has("out"), "loom convert needs --out ", to == "gguf" ? "FILE" : "DIR");
  LOOM_CHECK(!args.has("type") || to == "gguf" || to == "hf", "--type sets the weights' type of --to gguf and --to hf; "
             "--to ", to, " writes them as the source holds them (drop --type)");
  if (to == "loom") check_weights_out(args.get("out"));
  ModelSource source = model_source(args.get("checkpoint"), args.get("adapter", ""));
  const ModelConfig& c = source.config.model;
  if (to == "peft") {
    LOOM_CHECK(c.lora(), args.get("checkpoint"), " has no LoRA adapters to write (peft.method = none)");
    CpuAllocator host;
    save_peft_adapter(args.get("out"), ModelState{c, read_adapters(source, host)});
    std::printf("wrote %s: a PEFT LoRA adapter (rank %lld, alpha %g, targets %s)\n", args.get("out").c_str(),
                static_cast<long long>(c.lora_rank), static_cast<double>(c.lora_alpha), c.lora_targets.c_str());
    return 0;
  }
  if (to == "loom") {
    auto backend = make_cpu_backend();
    Transformer model(*backend, c);
    load_weights(source, model.params());
    return to_loom(args, source, model.params());
  }
  const std::unique_ptr<ParamReader> params = open_export_reader(source);
  const ModelConfig adapted = c;
  source.config.model = params->config();  // without the adapters, if any: they are merged as each weight is read
  const int rc = to == "gguf" ? to_gguf(args, source, *params) : to_hf(args, source, *params);
  if (adapted.lora()) {
    std::printf("merged the LoRA adapters (rank %lld, scale %g, targets %s) into the base weights, one weight at a "
                "time as it was read\n", static_cast<long long>(adapted.lora_rank),
                static_cast<double>(adapted.lora_scale()), adapted.lora_targets.c_str());
  }
  return rc;
}

}  // namespace loom::cli
