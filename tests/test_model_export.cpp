// Exports read one parameter at a time (checkpoint/param_reader.h, train/model_export.h): a Loom
// checkpoint's parameters read singly are the loaded model's, bit for bit; LoRA and DoRA adapters
// merged weight by weight (a run's own, and a PEFT folder given over a Hugging Face base) equal
// the whole-model merge (lora_merge) bit for bit; a GGUF file exported from the reader is the one
// exported from the loaded buffer, byte for byte, in every type (bf16 too, read back as the
// weights rounded to nearest even); and a tensor whose bytes come out wrong while the file is
// written leaves no file behind.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>

#include "loom/arch/param_layout.h"
#include "loom/checkpoint/checkpoint.h"
#include "loom/checkpoint/gguf.h"
#include "loom/checkpoint/gguf_export.h"
#include "loom/checkpoint/hf_model.h"
#include "loom/checkpoint/peft.h"
#include "loom/core/dtype.h"
#include "loom/core/error.h"
#include "loom/data/tokenizer.h"
#include "loom/model/transformer.h"
#include "loom/nn/lora.h"
#include "loom/train/config.h"
#include "loom/train/model_export.h"
#include "loom/train/model_source.h"
#include "test_util.h"

namespace loom {
namespace {

namespace fs = std::filesystem;

fs::path fresh_dir(const std::string& name) {
  const fs::path dir = fs::path(::testing::TempDir()) / ("model_export_" + name);
  fs::remove_all(dir);
  return dir;
}

std::string file_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

ModelConfig adapted(const char* preset, bool dora) {
  ModelConfig c = model_preset(preset);
  c.peft_method = PeftMethod::lora;
  c.lora_targets = c.arch == ARCH_GPT2 ? "q,k,v,o,up,down" : "q,k,v,o,gate,up,down";
  c.lora_rank = 4;
  c.lora_alpha = 8.0f;
  c.lora_dora = dora;
  return c;
}

// The base initialised, the adapters given trained-looking values (B nonzero), DoRA's magnitudes
// their initial norms perturbed.
void randomize(Backend& backend, Transformer& m, bool dora) {
  m.init_weights(5);
  dora_init_magnitudes(backend, m.config(), m.params());
  float* p = m.params().data<float>();
  const int64_t begin = lora_begin(m.config(), m.layout());
  for (const ParamSpec& spec : m.layout().params) {
    if (spec.offset < begin) continue;
    const bool magnitude = spec.name.find("magnitude") != std::string::npos;
    for (int64_t i = spec.offset; i < spec.offset + spec.numel; ++i) {
      const float r = std::sin(static_cast<float>(i) * 0.731f + 0.3f);
      p[i] = magnitude && dora ? p[i] * (1.0f + 0.3f * r) : 0.3f * r;
    }
  }
}

std::string save_checkpoint(const fs::path& dir, const ModelConfig& c, const Tensor& params) {
  LoomConfig config;
  config.model = c;
  config.data.tokenizer = "byte";
  CheckpointContents contents;
  contents.model = ModelState{c, params};
  contents.optimizer.name = "none";
  contents.config_text = config_to_toml(config);
  return CheckpointManager((dir / "checkpoints").string()).save(contents);
}

// Every parameter the reader gives equals `expected`'s (config's layout) bit for bit.
void expect_reads(ParamReader& reader, const Tensor& expected, const std::string& what) {
  const ParamLayout layout = build_param_layout(reader.config());
  ASSERT_EQ(expected.numel(), layout.total) << what;
  for (const ParamSpec& spec : layout.params) {
    const std::span<const float> v = reader.read(spec.name);
    ASSERT_EQ(static_cast<int64_t>(v.size()), spec.numel) << what << " " << spec.name;
    EXPECT_EQ(std::memcmp(v.data(), expected.data<float>() + spec.offset, v.size() * sizeof(float)), 0)
        << what << ": " << spec.name;
  }
}

TEST(ModelExport, ACheckpointReadOneParameterAtATimeIsTheLoadedModel) {
  auto backend = make_cpu_backend();
  for (const char* preset : {"gpt2-tiny", "llama-tiny"}) {
    ModelConfig c = model_preset(preset);
    c.vocab_size = 257;  // the byte tokenizer's, which the GGUF files hold
    Transformer m(*backend, c);
    m.init_weights(3);
    const std::string ckpt = save_checkpoint(fresh_dir(preset), c, m.params());
    const auto reader = open_export_reader(model_source(ckpt));
    expect_reads(*reader, m.params(), preset);
    // GGUF from the reader = GGUF from the loaded buffer, every type.
    for (const GgufExportType type : {GgufExportType::F32, GgufExportType::F16, GgufExportType::BF16,
                                      GgufExportType::Q8_0, GgufExportType::Q4_0}) {
      const std::string a = (fresh_dir("a") += ".gguf").string(), b = (fresh_dir("b") += ".gguf").string();
      const GgufVocabulary vocab = gguf_vocabulary(ByteTokenizer());
      export_gguf(*open_export_reader(model_source(ckpt)), vocab, type, "x", a);
      export_gguf(c, {m.params().data<float>(), static_cast<size_t>(m.params().numel())}, vocab, type, "x", b);
      EXPECT_EQ(file_bytes(a), file_bytes(b)) << preset << " " << enum_name(type);
    }
  }
}

TEST(ModelExport, AdaptersAreMergedWeightByWeightAsTheWholeModelMerge) {
  auto backend = make_cpu_backend();
  for (const bool dora : {false, true}) {
    for (const char* preset : {"gpt2-tiny", "llama-tiny"}) {
      const std::string what = str_cat(preset, dora ? " DoRA" : " LoRA");
      const ModelConfig c = adapted(preset, dora);
      Transformer m(*backend, c);
      randomize(*backend, m, dora);
      Transformer whole(*backend, lora_base_config(c));
      lora_merge(*backend, c, m.params(), whole.params());
      // A run's checkpoint holding the adapters.
      const std::string ckpt = save_checkpoint(fresh_dir(what), c, m.params());
      const auto reader = open_export_reader(model_source(ckpt));
      EXPECT_FALSE(reader->config().lora()) << what;
      expect_reads(*reader, whole.params(), what + " (checkpoint)");
      // A Hugging Face base and a PEFT folder (loom convert --adapter).
      const fs::path base_dir = fresh_dir(what + "_hf"), peft_dir = fresh_dir(what + "_peft");
      const ParamLayout layout = build_param_layout(c);
      save_hf_model(base_dir.string(), ModelState{lora_base_config(c), m.params().view(0, {lora_begin(c, layout)})});
      save_peft_adapter(peft_dir.string(), ModelState{c, m.params()});
      const ModelSource source = model_source(base_dir.string(), peft_dir.string());
      expect_reads(*open_export_reader(source), whole.params(), what + " (PEFT folder)");
      // --to peft reads the adapters alone: the same values, the base's elements never written.
      CpuAllocator host;
      const Tensor adapters = read_adapters(source, host);
      for (const ParamSpec& spec : layout.params) {
        if (spec.offset < lora_begin(c, layout)) continue;
        EXPECT_EQ(std::memcmp(adapters.data<float>() + spec.offset, m.params().data<float>() + spec.offset,
                              static_cast<size_t>(spec.numel) * sizeof(float)), 0) << what << " " << spec.name;
      }
    }
  }
}

TEST(ModelExport, Bf16GgufHoldsTheWeightsRoundedToNearestEven) {
  auto backend = make_cpu_backend();
  ModelConfig c = model_preset("llama-tiny");
  c.vocab_size = 257;  // the byte tokenizer's
  Transformer m(*backend, c);
  m.init_weights(9);
  const GgufVocabulary vocab = gguf_vocabulary(ByteTokenizer());
  const std::string path = (fresh_dir("bf16") += ".gguf").string();
  const GgufExportSummary s = export_gguf(c, {m.params().data<float>(), static_cast<size_t>(m.params().numel())}, vocab,
                                          GgufExportType::BF16, "x", path);
  EXPECT_EQ(s.converted, 1 + 7 * c.n_layer + (c.tie_embeddings ? 0 : 1));  // embedding, q k v o gate up down, head
  const GgufFile f = GgufFile::read(path);
  EXPECT_EQ(f.get("general.file_type").i, 32);  // LLAMA_FTYPE_MOSTLY_BF16
  const GgufTensorInfo& t = f.tensor("blk.0.ffn_down.weight");
  EXPECT_EQ(t.type, GgmlType::BF16);
  const ParamSpec& down = m.layout().find("model.layers.0.mlp.down_proj.weight");
  const std::vector<float> got = f.tensor_f32("blk.0.ffn_down.weight");
  ASSERT_EQ(static_cast<int64_t>(got.size()), down.numel);
  int64_t rounded = 0;
  for (int64_t i = 0; i < down.numel; ++i) {
    const float w = m.params().data<float>()[down.offset + i];
    ASSERT_EQ(got[static_cast<size_t>(i)], bf16_to_f32(f32_to_bf16(w))) << i;
    rounded += got[static_cast<size_t>(i)] != w;
  }
  EXPECT_GT(rounded, down.numel / 2);  // f32 weights: most change (the file is not f32 relabelled)
  EXPECT_EQ(f.tensor("blk.0.attn_norm.weight").type, GgmlType::F32);  // vectors stay f32
}

TEST(ModelExport, ATensorThatComesOutWrongLeavesNoFile) {
  const fs::path dir = fresh_dir("wrong");
  fs::create_directories(dir);
  const std::string path = (dir / "x.gguf").string();
  GgufWriter w;
  w.add_tensor("a", {32}, GgmlType::F32, std::vector<uint8_t>(128, 0));
  w.add_tensor("b", {32, 2}, GgmlType::Q8_0, [] { return std::vector<uint8_t>(10, 0); });  // 68 bytes expected
  EXPECT_THROW(
      {
        try {
          w.write(path);
        } catch (const Error& e) {
          EXPECT_NE(std::string(e.what()).find("GGUF tensor b: 10 bytes for 64 Q8_0 elements"), std::string::npos)
              << e.what();
          throw;
        }
      },
      Error);
  EXPECT_TRUE(fs::is_empty(dir));  // neither the file nor its temporary
  // The same writer with the right bytes writes a file GgufFile reads back.
  GgufWriter ok;
  ok.add_tensor("b", {32, 2}, GgmlType::BF16, [] { return std::vector<uint8_t>(128, 0); });
  ok.write(path);
  EXPECT_EQ(GgufFile::read(path).tensor("b").type, GgmlType::BF16);
}

}  // namespace
}  // namespace loom
