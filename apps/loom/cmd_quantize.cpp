// loom quantize: post-training quantization of a checkpoint into a quantized model folder
// (compress/quantize_model.h; the format in checkpoint/checkpoint.h and precision/int_quant.h;
// docs/compression.md).
#include <cstdio>

#include "cli.h"
#include "commands.h"
#include "loom/compress/quantize_model.h"
#include "loom/train/quantize_run.h"
#include "loom/core/error.h"

namespace loom::cli {

namespace {
const char* kHelp =
    "usage: loom quantize --checkpoint PATH --method rtn|gptq|awq|smoothquant|w8a8 --out DIR\n"
    "                     [--bits 8|4|3] [--group G] [--calib FILE] [--calib-tokens N] [--act-order]\n"
    "                     [--damp D] [--alpha A] [--no-head] [--scales f32|f16] [--symmetric]\n"
    "\n"
    "Quantizes every block's linear weights and the output layer of PATH (a Loom checkpoint or a\n"
    "Hugging Face folder) and writes a quantized model folder DIR that eval, generate and serve load:\n"
    "packed integer codes with per-group scales and zero points (docs/compression.md). A Hugging\n"
    "Face folder is streamed: one block's weights in memory at a time (the planned peak is printed\n"
    "first), its token embedding kept in its dtype (BF16 stays BF16).\n"
    "  rtn          round to nearest per group of G input columns (default G = 128; 0: per row)\n"
    "  gptq         GPTQ from calibration activations (lazy batches of 128, --damp 0.01, --act-order)\n"
    "  awq          AWQ: an activation-aware per-channel scale searched on calibration activations\n"
    "  smoothquant  SmoothQuant W8A8 (--bits 8; migration strength --alpha, default 0.5)\n"
    "  w8a8         W8A8 without smoothing (the naive baseline)\n"
    "gptq, awq and smoothquant read --calib FILE, a text tokenized with the model's tokenizer, of\n"
    "which the first N tokens (--calib-tokens, default 8192) are used in sequences of min(256,\n"
    "model.max_seq_len) tokens.\n";

}  // namespace

int quantize_main(int argc, char** argv) {
  const Args args(argc, argv, "quantize", kHelp,
                  {{"checkpoint", "PATH", "a Loom checkpoint or run folder, or a Hugging Face model folder (required)"},
                   {"method", "METHOD", "rtn | gptq | awq | smoothquant | w8a8 (required)"},
                   {"out", "DIR", "the quantized model folder to write (required)"},
                   {"bits", "B", "bits per weight: 8, 4 or 3 (default 4; W8A8 methods: 8)"},
                   {"group", "G", "input columns per scale: a multiple of 32, 0 = one per row (default 128)"},
                   {"calib", "FILE", "calibration text (gptq, awq, smoothquant)"},
                   {"calib-tokens", "N", "calibration tokens used (default 8192)"},
                   {"act-order", "", "gptq: columns in order of decreasing activation energy"},
                   {"damp", "D", "gptq: dampening, a fraction of the Hessian's mean diagonal (default 0.01)"},
                   {"alpha", "A", "smoothquant: migration strength in [0, 1] (default 0.5)"},
                   {"no-head", "", "keep the output layer in f32 (or the source's bf16)"},
                   {"scales", "f32|f16", "the groups' scale format (default f32; f16 as ggml's blocks)"},
                   {"symmetric", "", "symmetric groups: no zero points stored (AutoGPTQ's sym=True)"}});
  LOOM_CHECK(args.has("checkpoint"), "loom quantize needs --checkpoint PATH");
  LOOM_CHECK(args.has("method"), "loom quantize needs --method rtn|gptq|awq|smoothquant|w8a8");
  LOOM_CHECK(args.has("out"), "loom quantize needs --out DIR");
  QuantizeOptions o;
  o.method = parse_quant_method(args.get("method"));
  const bool w8a8 = o.method == QuantMethod::smoothquant || o.method == QuantMethod::w8a8;
  o.bits = static_cast<int>(args.get_int("bits", w8a8 ? 8 : 4));
  LOOM_CHECK(o.bits == 8 || o.bits == 4 || o.bits == 3, "--bits ", o.bits, " is not supported: expected 8, 4 or 3");
  LOOM_CHECK(!w8a8 || o.bits == 8, "--bits ", o.bits, " is not supported by --method ", args.get("method"),
             " (W8A8 stores int8 weights): use --bits 8");
  o.group = args.get_int("group", 128);
  LOOM_CHECK(o.group >= 0, "--group must be >= 0, got ", o.group);
  o.gptq.act_order = args.has("act-order");
  o.gptq.damp = args.get_double("damp", 0.01);
  LOOM_CHECK(o.gptq.damp > 0.0, "--damp must be > 0, got ", o.gptq.damp);
  o.alpha = args.get_double("alpha", 0.5);
  LOOM_CHECK(o.alpha >= 0.0 && o.alpha <= 1.0, "--alpha must be in [0, 1], got ", o.alpha);
  o.head = !args.has("no-head");
  LOOM_CHECK(!args.has("act-order") || o.method == QuantMethod::gptq, "--act-order applies to --method gptq only");
  LOOM_CHECK(quant_method_calibrates(o.method) || !args.has("calib"), "--method ", args.get("method"),
             " uses no calibration data: drop --calib");
  LOOM_CHECK(!quant_method_calibrates(o.method) || args.has("calib"), "--method ", args.get("method"),
             " needs calibration text: --calib FILE");

  const std::string scales = args.get("scales", "f32");
  LOOM_CHECK(scales == "f32" || scales == "f16", "--scales '", scales, "' is not a scale format: expected f32 or f16");
  o.storage.f16_scales = scales == "f16";
  o.storage.symmetric = args.has("symmetric");
  LOOM_CHECK(!w8a8 || !(args.has("scales") || args.has("symmetric")), "--method ", args.get("method"),
             " stores int8 weights with f32 per-row scales: drop --scales and --symmetric");

  const ModelSource source = model_source(args.get("checkpoint"));
  const LoomConfig& config = source.config;
  o.calib_seq_len = std::min<int64_t>(256, config.model.max_seq_len);
  const std::vector<std::vector<int32_t>> sequences =
      quant_method_calibrates(o.method) ? calibration_sequences(args.get("calib"), args.get_int("calib-tokens", 8192), config, o.calib_seq_len)
                                        : std::vector<std::vector<int32_t>>{};
  const QuantizeMemory m = quantize_memory_estimate(source, o, static_cast<int64_t>(sequences.size()));
  std::printf("%s\n", describe(m).c_str());
  std::fflush(stdout);
  const bool verbose = stdout_is_terminal();
  const QuantizeRunResult r = quantize_to_folder(source, o, sequences, args.get("out"), [&](const std::string& line) {
    if (verbose) std::printf("  %s\n", line.c_str());
  });
  std::printf("wrote %s: %s %d-bit%s, %lld of %lld parameters quantized (%.1f MiB of codes, scales and zeros; "
              "%.1f MiB in f32 before), %.1f MiB of plain parameters kept; model.safetensors %.1f MiB; %.1f s\n",
              args.get("out").c_str(), quant_method_name(o.method), o.bits,
              o.group == 0 || w8a8 ? " per row" : str_cat(" groups of ", o.group).c_str(),
              static_cast<long long>(r.quantized_params), static_cast<long long>(r.total_params),
              static_cast<double>(r.stored_bytes) / (1 << 20), static_cast<double>(r.quantized_params) * 4 / (1 << 20),
              static_cast<double>(r.plain_bytes) / (1 << 20), static_cast<double>(r.file_bytes) / (1 << 20), r.seconds);
  return 0;
}

}  // namespace loom::cli
