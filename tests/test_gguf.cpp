// GGUF export (checkpoint/gguf.h, gguf_export.h, gguf_vocab.h) and ggml's Q8_0 / Q4_0 blocks
// (precision/ggml_blocks.h): the header, metadata and tensor infos parsed back byte by byte and
// through GgufFile, the block quantizers against a naive reference written from ggml's
// definitions, the Loom -> llama.cpp tensor mapping, RoPE permutation included, and the
// tokenizer.ggml.* keys of a tokenizer.json and a SentencePiece model (trained by
// python3-sentencepiece, whose tokenizer.vocab lists the pieces and scores independently).
#include <gtest/gtest.h>

#include <functional>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <map>
#include <unistd.h>

#include "loom/arch/param_layout.h"
#include "loom/checkpoint/gguf.h"
#include "loom/checkpoint/gguf_export.h"
#include "loom/core/file_io.h"
#include "loom/core/philox.h"
#include "loom/data/bpe.h"
#include "loom/data/sentencepiece_model.h"
#include "loom/precision/formats.h"
#include "loom/precision/ggml_blocks.h"
#include "test_util.h"
#include "tokenizer_test_util.h"

namespace loom {
namespace {

std::string temp_path(const std::string& name) {
  return (std::filesystem::temp_directory_path() / ("loom_gguf_" + std::to_string(::getpid()) + "_" + name)).string();
}

std::vector<float> random_floats(int64_t n, uint64_t seed, float scale) {
  std::vector<float> u(static_cast<size_t>(n));
  philox_fill_uniform(u.data(), n, seed, 0, 0);
  for (float& v : u) v = (2.0f * v - 1.0f) * scale;
  return u;
}

template <class T>
T at(const std::string& bytes, size_t pos) {
  T v;
  std::memcpy(&v, bytes.data() + pos, sizeof(T));
  return v;
}

TEST(Gguf, HeaderMetadataAndTensorInfosParseBack) {
  const std::string path = temp_path("roundtrip.gguf");
  GgufWriter w;
  w.put("test.u32", GgufValue::u32(7));
  w.put("test.i32", GgufValue::i32(-3));
  w.put("test.f32", GgufValue::f32(0.5f));
  w.put("test.bool", GgufValue::boolean(true));
  w.put("test.string", GgufValue::string("héllo"));
  w.put("test.strings", GgufValue::strings({"a", "", "Ġb"}));
  w.put("test.i32s", GgufValue::i32s({1, -2, 3}));
  w.put("test.u64", GgufValue::u64(uint64_t{1} << 40));
  const std::vector<float> m = random_floats(2 * 64, 1, 1.0f);
  std::vector<uint8_t> f32(m.size() * 4);
  std::memcpy(f32.data(), m.data(), f32.size());
  w.add_tensor("m.f32", {64, 2}, GgmlType::F32, f32);
  std::vector<uint8_t> q8(ggml_blocks_size(GgmlBlock::Q8_0, 128));
  ggml_quantize(GgmlBlock::Q8_0, m, q8);
  w.add_tensor("m.q8", {64, 2}, GgmlType::Q8_0, q8);
  std::vector<uint8_t> v3(3 * 4, 0);  // 12 bytes: the next tensor starts 32-aligned after padding
  w.add_tensor("v", {3}, GgmlType::F32, v3);
  std::vector<uint8_t> q4(ggml_blocks_size(GgmlBlock::Q4_0, 128));
  ggml_quantize(GgmlBlock::Q4_0, m, q4);
  w.add_tensor("m.q4", {32, 4}, GgmlType::Q4_0, q4);
  w.write(path);

  // The raw bytes, by the specification.
  const std::string b = test::read_file_bytes(path);
  ASSERT_GE(b.size(), 24u);
  EXPECT_EQ(b.substr(0, 4), "GGUF");
  EXPECT_EQ(at<uint32_t>(b, 4), 3u);
  EXPECT_EQ(at<uint64_t>(b, 8), 4u);    // tensors
  EXPECT_EQ(at<uint64_t>(b, 16), 9u);   // metadata: general.alignment and the 8 above
  EXPECT_EQ(at<uint64_t>(b, 24), std::strlen("general.alignment"));
  EXPECT_EQ(b.substr(32, 17), "general.alignment");
  EXPECT_EQ(at<uint32_t>(b, 49), 4u);   // GGUF_TYPE_UINT32
  EXPECT_EQ(at<uint32_t>(b, 53), 32u);
  EXPECT_EQ(at<uint64_t>(b, 57), std::strlen("test.u32"));

  const GgufFile f = GgufFile::read(path);
  EXPECT_EQ(f.version, 3u);
  EXPECT_EQ(f.alignment, 32u);
  EXPECT_EQ(f.data_offset % 32, 0u);
  EXPECT_EQ(f.get("test.u32").i, 7);
  EXPECT_EQ(f.get("test.i32").i, -3);
  EXPECT_EQ(f.get("test.i32").type, GgufValueType::I32);
  EXPECT_EQ(f.get("test.f32").f, 0.5);
  EXPECT_EQ(f.get("test.bool").i, 1);
  EXPECT_EQ(f.get("test.string").s, "héllo");
  ASSERT_EQ(f.get("test.strings").array.size(), 3u);
  EXPECT_EQ(f.get("test.strings").element, GgufValueType::STRING);
  EXPECT_EQ(f.get("test.strings").array[2].s, "Ġb");
  EXPECT_EQ(f.get("test.i32s").array[1].i, -2);
  EXPECT_EQ(f.get("test.u64").i, int64_t{1} << 40);
  ASSERT_EQ(f.tensors.size(), 4u);
  EXPECT_EQ(f.tensor("m.f32").offset, 0u);
  EXPECT_EQ(f.tensor("m.q8").offset, 512u);               // 512 bytes of f32
  EXPECT_EQ(f.tensor("v").offset, 512u + 160u);           // 4 blocks of 34 = 136, padded to 160
  EXPECT_EQ(f.tensor("m.q4").offset, 512u + 160u + 32u);  // 12 bytes padded to 32
  EXPECT_EQ(f.tensor("m.q4").ne, (std::vector<uint64_t>{32, 4}));
  EXPECT_EQ(f.tensor("m.q4").type, GgmlType::Q4_0);
  EXPECT_EQ(f.tensor_f32("m.f32"), m);
  EXPECT_EQ(f.tensor_data("m.q8"), q8);
  EXPECT_EQ(f.tensor_data("m.q4"), q4);
  EXPECT_EQ(b.size(), f.data_offset + 512 + 160 + 32 + 96);  // the last tensor padded too (72 -> 96)
  std::filesystem::remove(path);
}

TEST(Gguf, BadFilesAreOneLineErrorsNamingThePath) {
  const std::string path = temp_path("bad.gguf");
  write_file_atomic(path, std::string("GGML\3\0\0\0", 8));
  EXPECT_NE(test::error_of([&] { GgufFile::read(path); }).find(path + ": not a GGUF file"), std::string::npos);
  write_file_atomic(path, std::string("GGUF\3\0\0\0\1\0\0\0", 12));
  EXPECT_NE(test::error_of([&] { GgufFile::read(path); }).find("truncated"), std::string::npos);
  std::filesystem::remove(path);
  GgufWriter w;
  EXPECT_NE(test::error_of([&] { w.put("general.alignment", GgufValue::u32(64)); }).find("twice"), std::string::npos);
  EXPECT_NE(test::error_of([&] { w.add_tensor("t", {33}, GgmlType::Q8_0, std::vector<uint8_t>(34)); }).find("32"),
            std::string::npos);
}

// Counts and shapes a file cannot hold are refused before anything is sized by them (issue 41):
// an array of 2^60 elements, a tensor of 2^40 x 2^40 elements, a device read whole.
TEST(Gguf, CountsAndShapesBeyondTheFileAreRefusedBeforeAllocating) {
  const std::string path = temp_path("huge.gguf");
  auto u32 = [](uint32_t v) { return std::string(reinterpret_cast<const char*>(&v), 4); };
  auto u64 = [](uint64_t v) { return std::string(reinterpret_cast<const char*>(&v), 8); };
  auto str = [&](const std::string& x) { return u64(x.size()) + x; };
  // One metadata key: an array of 2^60 u32.
  write_file_atomic(path, "GGUF" + u32(3) + u64(0) + u64(1) + str("big") + u32(9) + u32(4) + u64(uint64_t{1} << 60) +
                              std::string(64, '\0'));
  std::string msg = test::error_of([&] { GgufFile::read(path); });
  EXPECT_NE(msg.find(path + ": metadata key big: array of 1152921504606846976 elements past the end"), std::string::npos) << msg;
  // One tensor of 2^40 x 2^40 f32 elements (the product overflows 64 bits).
  const std::string info = str("t") + u32(2) + u64(uint64_t{1} << 40) + u64(uint64_t{1} << 40) + u32(0) + u64(0);
  write_file_atomic(path, "GGUF" + u32(3) + u64(1) + u64(0) + info + std::string(64, '\0'));
  msg = test::error_of([&] { GgufFile::read(path); });
  EXPECT_NE(msg.find(path + ": tensor t of 2 dimensions"), std::string::npos) << msg;
  EXPECT_NE(msg.find("has more elements than the"), std::string::npos) << msg;
  // A tensor that fits in 64 bits but not in the file, at an offset past its end.
  const std::string far = str("t") + u32(1) + u64(8) + u32(0) + u64(uint64_t{1} << 62);
  write_file_atomic(path, "GGUF" + u32(3) + u64(1) + u64(0) + far + std::string(64, '\0'));
  msg = test::error_of([&] { GgufFile::read(path); });
  EXPECT_NE(msg.find("ends past the end of the file"), std::string::npos) << msg;
  std::filesystem::remove(path);
  msg = test::error_of([&] { GgufFile::read("/dev/zero"); });
  EXPECT_NE(msg.find("/dev/zero: not a regular file"), std::string::npos) << msg;
}

struct Blocks {
  std::vector<uint8_t> bytes;
  std::vector<float> back;  // dequantized
};

Blocks round_trip(GgmlBlock type, const std::vector<float>& x) {
  Blocks r{std::vector<uint8_t>(ggml_blocks_size(type, static_cast<int64_t>(x.size()))), std::vector<float>(x.size())};
  ggml_quantize(type, x, r.bytes);
  ggml_dequantize(type, r.bytes, r.back);
  return r;
}

// ggml's Q8_0, written from its definition: d = amax / 127, q = round half away.
TEST(GgmlBlocks, Q8_0MatchesNaiveReferenceAndBoundsTheError) {
  std::vector<float> x = random_floats(32 * 64, 2, 3.0f);
  for (int j = 0; j < 32; ++j) x[j] = 0.0f;          // an all-zero block: d = 0, codes 0
  x[40] = 1e-3f, x[41] = -1e-3f;                     // a block of tiny and equal magnitudes
  const auto [blocks, back] = round_trip(GgmlBlock::Q8_0, x);
  for (size_t b = 0; b < x.size() / 32; ++b) {
    float amax = 0.0f;
    for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(x[b * 32 + j]));
    const float d = amax / 127.0f;
    const uint8_t* block = blocks.data() + b * 34;
    const uint32_t bits = block[0] | (block[1] << 8);
    EXPECT_EQ(bits, encode(FMT_FP16, d, false)) << "block " << b;
    const float stored = decode(FMT_FP16, bits);
    for (int j = 0; j < 32; ++j) {
      const float v = x[b * 32 + j];
      const int expect = d == 0.0f ? 0 : static_cast<int>(std::round(v * (1.0f / d)));
      EXPECT_EQ(static_cast<int8_t>(block[2 + j]), expect) << b << "," << j;
      EXPECT_EQ(back[b * 32 + j], static_cast<float>(expect) * stored);
      EXPECT_LE(std::fabs(back[b * 32 + j] - v), 0.5 * d + 127 * std::fabs(stored - d) + 1e-7);
    }
  }
}

// ggml's Q4_0: m = the signed value of largest magnitude, d = m / -8, nibble = min(15,
// trunc(x / d + 8.5)); element j in the low nibble of byte j, element j + 16 in its high nibble.
TEST(GgmlBlocks, Q4_0MatchesNaiveReferenceNibbleOrderAndBoundsTheError) {
  std::vector<float> x = random_floats(32 * 64, 3, 2.0f);
  x[33] = 5.0f, x[50] = -5.0f;  // block 1: equal magnitudes, the first (positive) one sets the sign
  const auto [blocks, back] = round_trip(GgmlBlock::Q4_0, x);
  for (size_t b = 0; b < x.size() / 32; ++b) {
    double m = 0.0;
    for (int j = 0; j < 32; ++j) {
      if (std::fabs(x[b * 32 + j]) > std::fabs(m)) m = x[b * 32 + j];
    }
    const float d = static_cast<float>(m) / -8.0f;
    if (b == 1) {
      EXPECT_LT(d, 0.0f);  // m = +5, the first of the two: d negative
    }
    const uint8_t* block = blocks.data() + b * 18;
    const float stored = decode(FMT_FP16, block[0] | (block[1] << 8));
    EXPECT_EQ(stored, decode(FMT_FP16, encode(FMT_FP16, d, false)));
    for (int j = 0; j < 32; ++j) {
      const float v = x[b * 32 + j];
      const int nibble = std::min(15, static_cast<int>(std::trunc(v * (1.0f / d) + 8.5f)));
      const int got = j < 16 ? (block[2 + j] & 0x0F) : (block[2 + j - 16] >> 4);
      EXPECT_EQ(got, nibble) << b << "," << j;
      EXPECT_EQ(back[b * 32 + j], static_cast<float>(nibble - 8) * stored);
      EXPECT_LE(std::fabs(back[b * 32 + j] - v), std::fabs(d) + 16 * std::fabs(stored - d) + 1e-6);
    }
  }
}

ModelConfig tiny(Arch arch) {
  ModelConfig c;
  c.arch = arch;
  c.vocab_size = 257, c.max_seq_len = 16, c.n_layer = 2, c.n_head = 4, c.d_model = 32, c.d_ff = 64;
  c.n_kv_head = arch == ARCH_LLAMA ? 2 : 4;
  return c;
}

struct Exported {
  ModelConfig config;
  std::vector<float> params;
  GgufFile file;
};

Exported export_tiny(Arch arch, GgufExportType type, const std::function<void(ModelConfig&)>& edit = {}) {
  Exported e{tiny(arch), {}, {}};
  if (edit) edit(e.config);
  const ParamLayout layout = build_param_layout(e.config);
  e.params = random_floats(layout.total, 4, 0.5f);
  const std::string path = temp_path(std::string(arch_name(arch)) + ".gguf");
  export_gguf(e.config, e.params, gguf_vocabulary(ByteTokenizer()), type, "tiny", path);
  e.file = GgufFile::read(path);
  std::filesystem::remove(path);
  return e;
}

bool has_tensor(const GgufFile& f, const std::string& name) {
  return std::any_of(f.tensors.begin(), f.tensors.end(), [&](const GgufTensorInfo& t) { return t.name == name; });
}

std::vector<float> param(const Exported& e, const std::string& name) {
  const ParamLayout layout = build_param_layout(e.config);  // (find's reference lives as long as the layout)
  const ParamSpec& p = layout.find(name);
  return {e.params.begin() + p.offset, e.params.begin() + p.offset + p.numel};
}

TEST(GgufExport, Gpt2KeysNamesShapesAndTokenizer) {
  const Exported e = export_tiny(ARCH_GPT2, GgufExportType::F32);
  const GgufFile& f = e.file;
  EXPECT_EQ(f.get("general.architecture").s, "gpt2");
  EXPECT_EQ(f.get("gpt2.context_length").i, 16);
  EXPECT_EQ(f.get("gpt2.embedding_length").i, 32);
  EXPECT_EQ(f.get("gpt2.feed_forward_length").i, 64);
  EXPECT_EQ(f.get("gpt2.block_count").i, 2);
  EXPECT_EQ(f.get("gpt2.attention.head_count").i, 4);
  EXPECT_FLOAT_EQ(static_cast<float>(f.get("gpt2.attention.layer_norm_epsilon").f), 1e-5f);
  EXPECT_EQ(f.get("tokenizer.ggml.model").s, "gpt2");
  EXPECT_EQ(f.get("tokenizer.ggml.pre").s, "gpt-2");
  const GgufValue& tokens = f.get("tokenizer.ggml.tokens");
  ASSERT_EQ(tokens.array.size(), 257u);
  EXPECT_EQ(tokens.array[' '].s, "Ġ");
  EXPECT_EQ(tokens.array['a'].s, "a");
  EXPECT_EQ(tokens.array[256].s, "<|endoftext|>");
  EXPECT_EQ(f.get("tokenizer.ggml.token_type").array[256].i, 3);  // control
  EXPECT_EQ(f.get("tokenizer.ggml.eos_token_id").i, 256);
  EXPECT_TRUE(f.get("tokenizer.ggml.merges").array.empty());
  EXPECT_EQ(f.tensors.size(), 4u + 2 * 12);  // token/position embeddings, output norm weight + bias
  EXPECT_EQ(f.tensor("token_embd.weight").ne, (std::vector<uint64_t>{32, 257}));
  EXPECT_EQ(f.tensor("position_embd.weight").ne, (std::vector<uint64_t>{32, 16}));
  EXPECT_EQ(f.tensor("blk.1.attn_qkv.weight").ne, (std::vector<uint64_t>{32, 96}));
  EXPECT_EQ(f.tensor("blk.1.ffn_up.weight").ne, (std::vector<uint64_t>{32, 64}));
  EXPECT_EQ(f.tensor("blk.1.ffn_down.weight").ne, (std::vector<uint64_t>{64, 32}));
  EXPECT_EQ(f.tensor_f32("blk.1.attn_qkv.weight"), param(e, "h.1.attn.c_attn.weight"));  // (out, in) as Loom
  EXPECT_EQ(f.tensor_f32("blk.0.attn_output.bias"), param(e, "h.0.attn.c_proj.bias"));
  EXPECT_EQ(f.tensor_f32("output_norm.bias"), param(e, "ln_f.bias"));
  EXPECT_FALSE(has_tensor(f, "output.weight"));
}

// Loom's rotate-half RoPE on the Loom rows equals llama.cpp's adjacent-pair RoPE (rope type NORM:
// pair (2j, 2j + 1) turns by pos theta^(-2j/hd)) on the exported rows, permuted alike.
TEST(GgufExport, LlamaSplitsQkvAndGateUpAndPermutesForAdjacentPairRope) {
  const Exported e = export_tiny(ARCH_LLAMA, GgufExportType::F32);
  const GgufFile& f = e.file;
  EXPECT_EQ(f.get("general.architecture").s, "llama");
  EXPECT_EQ(f.get("llama.attention.head_count_kv").i, 2);
  EXPECT_EQ(f.get("llama.rope.dimension_count").i, 8);
  EXPECT_FLOAT_EQ(static_cast<float>(f.get("llama.rope.freq_base").f), 10000.0f);
  EXPECT_TRUE(f.has("llama.attention.layer_norm_rms_epsilon"));
  EXPECT_EQ(f.tensor("blk.0.attn_q.weight").ne, (std::vector<uint64_t>{32, 32}));
  EXPECT_EQ(f.tensor("blk.0.attn_k.weight").ne, (std::vector<uint64_t>{32, 16}));
  EXPECT_EQ(f.tensor("output.weight").ne, (std::vector<uint64_t>{32, 257}));
  const int64_t C = 32, hd = 8, F = 64;
  const std::vector<float> qkv = param(e, "model.layers.1.self_attn.qkv_proj.weight");
  const std::vector<float> gate_up = param(e, "model.layers.1.mlp.gate_up_proj.weight");
  EXPECT_EQ(f.tensor_f32("blk.1.ffn_gate.weight"), std::vector<float>(gate_up.begin(), gate_up.begin() + F * C));
  EXPECT_EQ(f.tensor_f32("blk.1.ffn_up.weight"), std::vector<float>(gate_up.begin() + F * C, gate_up.end()));
  EXPECT_EQ(f.tensor_f32("blk.1.attn_v.weight"), std::vector<float>(qkv.begin() + 48 * C, qkv.end()));
  const std::vector<float> k = f.tensor_f32("blk.1.attn_k.weight");
  const std::vector<float> x = random_floats(C, 5, 1.0f);
  auto project = [&](const float* w, int64_t rows) {
    std::vector<double> y(static_cast<size_t>(rows));
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < C; ++c) y[r] += static_cast<double>(w[r * C + c]) * x[c];
    return y;
  };
  const int64_t pos = 5;
  std::vector<double> loom = project(qkv.data() + 32 * C, 16), gguf = project(k.data(), 16);
  for (int64_t h = 0; h < 2; ++h) {
    for (int64_t j = 0; j < hd / 2; ++j) {
      const double a = pos * std::pow(10000.0, -2.0 * j / hd);
      double* l = loom.data() + h * hd;  // rotate-half: (j, j + hd/2)
      const double l0 = l[j], l1 = l[j + hd / 2];
      l[j] = l0 * std::cos(a) - l1 * std::sin(a), l[j + hd / 2] = l1 * std::cos(a) + l0 * std::sin(a);
      double* g = gguf.data() + h * hd;  // adjacent: (2j, 2j + 1)
      const double g0 = g[2 * j], g1 = g[2 * j + 1];
      g[2 * j] = g0 * std::cos(a) - g1 * std::sin(a), g[2 * j + 1] = g1 * std::cos(a) + g0 * std::sin(a);
    }
  }
  for (int64_t h = 0; h < 2; ++h) {
    for (int64_t j = 0; j < hd / 2; ++j) {
      for (int64_t c = 0; c < 2; ++c) EXPECT_NEAR(gguf[h * hd + 2 * j + c], loom[h * hd + c * hd / 2 + j], 1e-12);
    }
  }
}

// Qwen2 (q/k/v biases) as llama.cpp's qwen2: its RoPE turns the halves (NEOX) as Loom does, so q
// and k keep Loom's row order (no permutation), and the biases are split as the weight's rows.
TEST(GgufExport, Qwen2IsWrittenAsLlamaCppsQwen2WithBiasesAndUnpermutedRows) {
  const Exported e = export_tiny(ARCH_LLAMA, GgufExportType::F32, [](ModelConfig& c) { c.qkv_bias = true; });
  const ModelConfig& c = e.config;
  EXPECT_EQ(e.file.get("general.architecture").s, "qwen2");
  EXPECT_EQ(e.file.get("qwen2.attention.head_count_kv").i, c.n_kv_head);
  const int64_t q = c.n_head * c.head_dim(), kv = c.n_kv_head * c.head_dim(), C = c.d_model;
  const std::vector<float> w = param(e, "model.layers.0.self_attn.qkv_proj.weight");
  const std::vector<float> b = param(e, "model.layers.0.self_attn.qkv_proj.bias");
  EXPECT_EQ(e.file.tensor_f32("blk.0.attn_q.weight"), std::vector<float>(w.begin(), w.begin() + q * C));
  EXPECT_EQ(e.file.tensor_f32("blk.0.attn_k.weight"), std::vector<float>(w.begin() + q * C, w.begin() + (q + kv) * C));
  EXPECT_EQ(e.file.tensor_f32("blk.0.attn_q.bias"), std::vector<float>(b.begin(), b.begin() + q));
  EXPECT_EQ(e.file.tensor_f32("blk.0.attn_k.bias"), std::vector<float>(b.begin() + q, b.begin() + q + kv));
  EXPECT_EQ(e.file.tensor_f32("blk.0.attn_v.bias"), std::vector<float>(b.begin() + q + kv, b.end()));
}

// Qwen3 (q/k norms) as llama.cpp's qwen3: unpermuted q/k rows (NEOX) and the two norms per layer.
TEST(GgufExport, Qwen3IsWrittenAsLlamaCppsQwen3WithItsNorms) {
  const Exported e = export_tiny(ARCH_LLAMA, GgufExportType::F32, [](ModelConfig& c) { c.qk_norm = true; });
  const ModelConfig& c = e.config;
  EXPECT_EQ(e.file.get("general.architecture").s, "qwen3");
  const int64_t q = c.n_head * c.head_dim(), C = c.d_model;
  const std::vector<float> w = param(e, "model.layers.1.self_attn.qkv_proj.weight");
  EXPECT_EQ(e.file.tensor_f32("blk.1.attn_q.weight"), std::vector<float>(w.begin(), w.begin() + q * C));
  EXPECT_EQ(e.file.tensor_f32("blk.1.attn_q_norm.weight"), param(e, "model.layers.1.self_attn.q_norm.weight"));
  EXPECT_EQ(e.file.tensor_f32("blk.1.attn_k_norm.weight"), param(e, "model.layers.1.self_attn.k_norm.weight"));
}

// OLMo 2 (output norms, q/k norms over all heads) as llama.cpp's olmo2: no attn_norm / ffn_norm,
// the output norms as post_attention_norm / post_ffw_norm, the whole-width q/k norms; Gemma 3 as
// gemma3: all four norms (Loom's 1 + w as they are), its window, unpermuted (NEOX) rows. A Gemma
// shape llama.cpp would run otherwise (a window pattern other than its fixed 6) is refused.
TEST(GgufExport, Olmo2AndGemma3AreWrittenAsLlamaCppsOlmo2AndGemma3) {
  const Exported o = export_tiny(ARCH_LLAMA, GgufExportType::F32, [](ModelConfig& c) {
    c.post_norm = c.qk_norm = c.qk_norm_whole = true;
  });
  EXPECT_EQ(o.file.get("general.architecture").s, "olmo2");
  const auto has_tensor = [](const GgufFile& f, const std::string& name) {
    return std::any_of(f.tensors.begin(), f.tensors.end(), [&](const GgufTensorInfo& t) { return t.name == name; });
  };
  EXPECT_FALSE(has_tensor(o.file, "blk.0.attn_norm.weight"));
  EXPECT_FALSE(has_tensor(o.file, "blk.0.ffn_norm.weight"));
  EXPECT_EQ(o.file.tensor_f32("blk.0.post_attention_norm.weight"), param(o, "model.layers.0.post_attention_layernorm.weight"));
  EXPECT_EQ(o.file.tensor_f32("blk.1.post_ffw_norm.weight"), param(o, "model.layers.1.post_feedforward_layernorm.weight"));
  EXPECT_EQ(o.file.tensor_f32("blk.0.attn_q_norm.weight").size(), static_cast<size_t>(o.config.n_head * o.config.head_dim()));
  const auto gemma = [](ModelConfig& c) {
    c.n_layer = 6, c.sandwich_norm = c.qk_norm = c.tie_embeddings = true;
    c.gate_activation = GateActivation::gelu_tanh;
    c.embed_scale = std::sqrt(static_cast<float>(c.d_model));
    c.attn_window = 4, c.window_pattern = 6, c.rope_local_theta = 10000.0f;
  };
  const Exported g = export_tiny(ARCH_LLAMA, GgufExportType::F32, gemma);
  EXPECT_EQ(g.file.get("general.architecture").s, "gemma3");
  EXPECT_EQ(g.file.get("gemma3.attention.sliding_window").i, 4);
  EXPECT_EQ(g.file.tensor_f32("blk.2.attn_norm.weight"), param(g, "model.layers.2.input_layernorm.weight"));
  EXPECT_EQ(g.file.tensor_f32("blk.2.ffn_norm.weight"), param(g, "model.layers.2.pre_feedforward_layernorm.weight"));
  EXPECT_EQ(g.file.tensor_f32("blk.2.post_attention_norm.weight"), param(g, "model.layers.2.post_attention_layernorm.weight"));
  EXPECT_EQ(g.file.tensor_f32("blk.2.post_ffw_norm.weight"), param(g, "model.layers.2.post_feedforward_layernorm.weight"));
  EXPECT_FALSE(has_tensor(g.file, "output.weight"));  // tied: llama.cpp reads token_embd
  const int64_t q = g.config.n_head * g.config.head_dim(), C = g.config.d_model;
  const std::vector<float> w = param(g, "model.layers.0.self_attn.qkv_proj.weight");
  EXPECT_EQ(g.file.tensor_f32("blk.0.attn_q.weight"), std::vector<float>(w.begin(), w.begin() + q * C));
  ModelConfig other = tiny(ARCH_LLAMA);
  gemma(other);
  other.window_pattern = 2;
  const std::vector<float> p(static_cast<size_t>(build_param_layout(other).total));
  EXPECT_NE(test::error_of([&] {
              export_gguf(other, p, gguf_vocabulary(ByteTokenizer()), GgufExportType::F32, "x", temp_path("g.gguf"));
            }).find("window_pattern = 6"),
            std::string::npos);
}

// Phi-3-128k's LongRoPE as llama.cpp's phi3: fused attn_qkv and ffn_up (Loom's rows as they are:
// q, k, v; gate then up), the factors as rope_factors_short / _long, the attention factor and the
// original context as keys.
TEST(GgufExport, LongRopeIsWrittenAsLlamaCppsPhi3) {
  const Exported e = export_tiny(ARCH_LLAMA, GgufExportType::F32, [](ModelConfig& c) {
    c.rope_scaling = ROPE_SCALING_LONGROPE;  // head_dim 8: 4 pairs
    c.rope_original_context = 8, c.rope_attention_factor = 1.25f;
    c.rope_short_factors = "1,1.5,2,2.5", c.rope_long_factors = "1,4,16,64";
  });
  EXPECT_EQ(e.file.get("general.architecture").s, "phi3");
  EXPECT_EQ(e.file.tensor_f32("blk.0.attn_qkv.weight"), param(e, "model.layers.0.self_attn.qkv_proj.weight"));
  EXPECT_EQ(e.file.tensor_f32("blk.1.ffn_up.weight"), param(e, "model.layers.1.mlp.gate_up_proj.weight"));
  EXPECT_EQ(e.file.tensor_f32("rope_factors_short.weight"), (std::vector<float>{1.0f, 1.5f, 2.0f, 2.5f}));
  EXPECT_EQ(e.file.tensor_f32("rope_factors_long.weight"), (std::vector<float>{1.0f, 4.0f, 16.0f, 64.0f}));
  EXPECT_FLOAT_EQ(e.file.get("phi3.rope.scaling.attn_factor").f, 1.25f);
  EXPECT_EQ(e.file.get("phi3.rope.scaling.original_context_length").i, 8);
}

// MoE as llama.cpp's stacked experts: the router (f32), ffn_gate_exps / ffn_up_exps (E, F, C) from
// the first and last F rows of each expert's gate_up_proj, ffn_down_exps (E, C, F), the expert
// counts and widths as keys; without q/k norms as llama (Mixtral), with them as qwen3moe.
TEST(GgufExport, MoeIsWrittenAsLlamaCppsStackedExperts) {
  for (const bool qk_norm : {false, true}) {
    const Exported e = export_tiny(ARCH_LLAMA, GgufExportType::F16, [qk_norm](ModelConfig& c) {
      c.moe_experts = 3, c.moe_top_k = 2, c.moe_d_ff = 32, c.qk_norm = qk_norm;
    });
    const std::string a = qk_norm ? "qwen3moe" : "llama";
    EXPECT_EQ(e.file.get("general.architecture").s, a);
    EXPECT_EQ(e.file.get(a + ".expert_count").i, 3);
    EXPECT_EQ(e.file.get(a + ".expert_used_count").i, 2);
    EXPECT_EQ(e.file.get(a + ".expert_feed_forward_length").i, 32);
    EXPECT_EQ(e.file.get(a + ".feed_forward_length").i, 32);
    const int64_t C = 32, F = 32;
    EXPECT_EQ(e.file.tensor("blk.1.ffn_gate_inp.weight").type, GgmlType::F32);
    EXPECT_EQ(e.file.tensor_f32("blk.1.ffn_gate_inp.weight"), param(e, "model.layers.1.mlp.gate.weight"));
    EXPECT_EQ(e.file.tensor("blk.1.ffn_gate_exps.weight").ne, (std::vector<uint64_t>{32, 32, 3}));
    EXPECT_EQ(e.file.tensor("blk.1.ffn_down_exps.weight").ne, (std::vector<uint64_t>{32, 32, 3}));
    EXPECT_EQ(e.file.tensor("blk.1.ffn_up_exps.weight").type, GgmlType::F16);
    const std::vector<float> gate = e.file.tensor_f32("blk.1.ffn_gate_exps.weight"),
                             up = e.file.tensor_f32("blk.1.ffn_up_exps.weight"),
                             down = e.file.tensor_f32("blk.1.ffn_down_exps.weight");
    for (int64_t x = 0; x < 3; ++x) {
      const std::string ex = "model.layers.1.mlp.experts." + std::to_string(x) + ".";
      const std::vector<float> gu = param(e, ex + "gate_up_proj.weight"), d = param(e, ex + "down_proj.weight");
      for (int64_t i = 0; i < F * C; ++i) {
        const auto at = static_cast<size_t>(x * F * C + i);
        EXPECT_NEAR(gate[at], gu[static_cast<size_t>(i)], 1e-3) << a << " expert " << x << " gate " << i;
        EXPECT_NEAR(up[at], gu[static_cast<size_t>(F * C + i)], 1e-3) << a << " expert " << x << " up " << i;
        EXPECT_NEAR(down[at], d[static_cast<size_t>(i)], 1e-3) << a << " expert " << x << " down " << i;
      }
    }
    EXPECT_FALSE(has_tensor(e.file, "blk.0.ffn_gate.weight"));
  }
}

// GPT-OSS as llama.cpp's gpt-oss: the sinks (f32), o_proj's bias, the MLP's input norm named
// post_attention_norm, the router's bias and the experts' biases stacked (E, F) / (E, C) in f32
// whatever the file's type, the window and head sizes as keys, an untied head.
TEST(GgufExport, GptOssIsWrittenAsLlamaCppsGptOss) {
  const Exported e = export_tiny(ARCH_LLAMA, GgufExportType::Q8_0, [](ModelConfig& c) {
    c.attn_sinks = c.qkv_bias = c.attn_out_bias = true;
    c.gate_activation = GateActivation::swiglu_oai;
    c.moe_experts = 2, c.moe_top_k = 2, c.moe_router_bias = c.moe_expert_bias = true;
    c.attn_window = 4, c.window_pattern = 2;
  });
  const GgufFile& f = e.file;
  EXPECT_EQ(f.get("general.architecture").s, "gpt-oss");
  EXPECT_EQ(f.get("gpt-oss.attention.sliding_window").i, 4);
  EXPECT_EQ(f.get("gpt-oss.attention.key_length").i, 8);
  EXPECT_EQ(f.get("gpt-oss.expert_feed_forward_length").i, 64);
  EXPECT_EQ(f.tensor_f32("blk.0.attn_sinks.weight"), param(e, "model.layers.0.self_attn.sinks"));
  EXPECT_EQ(f.tensor_f32("blk.0.attn_output.bias"), param(e, "model.layers.0.self_attn.o_proj.bias"));
  EXPECT_EQ(f.tensor_f32("blk.0.post_attention_norm.weight"), param(e, "model.layers.0.post_attention_layernorm.weight"));
  EXPECT_FALSE(has_tensor(f, "blk.0.ffn_norm.weight"));
  EXPECT_EQ(f.tensor_f32("blk.1.ffn_gate_inp.bias"), param(e, "model.layers.1.mlp.gate.bias"));
  EXPECT_EQ(f.tensor("blk.1.ffn_gate_exps.weight").type, GgmlType::Q8_0);
  EXPECT_EQ(f.tensor("blk.1.ffn_up_exps.bias").type, GgmlType::F32);
  EXPECT_EQ(f.tensor("blk.1.ffn_up_exps.bias").ne, (std::vector<uint64_t>{64, 2}));
  EXPECT_EQ(f.tensor("blk.1.ffn_down_exps.bias").ne, (std::vector<uint64_t>{32, 2}));
  std::vector<float> up, down;
  for (int64_t x = 0; x < 2; ++x) {
    const std::string ex = "model.layers.1.mlp.experts." + std::to_string(x) + ".";
    const std::vector<float> gu = param(e, ex + "gate_up_proj.bias"), d = param(e, ex + "down_proj.bias");
    up.insert(up.end(), gu.begin() + 64, gu.end());
    down.insert(down.end(), d.begin(), d.end());
  }
  EXPECT_EQ(f.tensor_f32("blk.1.ffn_up_exps.bias"), up);
  EXPECT_EQ(f.tensor_f32("blk.1.ffn_down_exps.bias"), down);
  EXPECT_TRUE(has_tensor(f, "output.weight"));
  // What llama.cpp's gpt-oss would run otherwise is refused by name: a tied head, the release's
  // untruncated YaRN.
  for (const auto& edit : std::vector<std::function<void(ModelConfig&)>>{
           [](ModelConfig& c) { c.tie_embeddings = true; },
           [](ModelConfig& c) { c.rope_scaling = ROPE_SCALING_YARN, c.rope_factor = 4, c.rope_yarn_truncate = false; }}) {
    ModelConfig c = e.config;
    edit(c);
    const std::vector<float> p(static_cast<size_t>(build_param_layout(c).total));
    EXPECT_NE(test::error_of([&] {
                export_gguf(c, p, gguf_vocabulary(ByteTokenizer()), GgufExportType::F32, "x", temp_path("o.gguf"));
              }).find("llama.cpp's gpt-oss"),
              std::string::npos);
  }
}

// Qwen3-Next as llama.cpp's qwen3next: a DeltaNet layer's attn_qkv / attn_gate from Loom's
// [q | k | v | z] rows, ssm_ba regrouped per key head as the Hub's [b r | a r], ssm_a = -exp(A_log),
// the conv in f32; a gated-attention layer's attn_q with each head's query rows then its gate
// rows; the shared expert and its gate; the ssm keys and the partial RoPE's dims.
TEST(GgufExport, Qwen3NextIsWrittenAsLlamaCppsQwen3Next) {
  const Exported e = export_tiny(ARCH_LLAMA, GgufExportType::F32, [](ModelConfig& c) {
    c.linear_interval = 2, c.linear_key_heads = 2, c.linear_value_heads = 4, c.linear_key_dim = 8, c.linear_value_dim = 8;
    c.attn_output_gate = c.qk_norm = true;
    c.rope_fraction = 0.5f;
    c.moe_experts = 2, c.moe_top_k = 1, c.moe_d_ff = 16, c.moe_shared = 1, c.moe_shared_gate = true;
  });
  const GgufFile& f = e.file;
  const int64_t C = 32, hd = 8, H = 4;
  EXPECT_EQ(f.get("general.architecture").s, "qwen3next");
  EXPECT_EQ(f.get("qwen3next.full_attention_interval").i, 2);
  EXPECT_EQ(f.get("qwen3next.ssm.state_size").i, 8);
  EXPECT_EQ(f.get("qwen3next.ssm.group_count").i, 2);
  EXPECT_EQ(f.get("qwen3next.ssm.time_step_rank").i, 4);
  EXPECT_EQ(f.get("qwen3next.ssm.inner_size").i, 32);
  EXPECT_EQ(f.get("qwen3next.ssm.conv_kernel").i, 4);
  EXPECT_EQ(f.get("qwen3next.rope.dimension_count").i, 4);
  EXPECT_EQ(f.get("qwen3next.expert_shared_feed_forward_length").i, 16);
  const std::vector<float> qkvz = param(e, "model.layers.0.linear_attn.in_proj_qkvz.weight");
  EXPECT_EQ(f.tensor_f32("blk.0.attn_qkv.weight"), std::vector<float>(qkvz.begin(), qkvz.begin() + 64 * C));
  EXPECT_EQ(f.tensor_f32("blk.0.attn_gate.weight"), std::vector<float>(qkvz.begin() + 64 * C, qkvz.end()));
  const std::vector<float> ba = param(e, "model.layers.0.linear_attn.in_proj_ba.weight"), got = f.tensor_f32("blk.0.ssm_ba.weight");
  // Key head 1 (r = 2 value heads each): [b2 b3 | a2 a3] at rows 4..7; Loom's [b0..b3 | a0..a3].
  for (const auto& [to, from] : {std::pair{4, 2}, {5, 3}, {6, 6}, {7, 7}, {0, 0}, {2, 4}}) {
    EXPECT_EQ(std::vector<float>(got.begin() + to * C, got.begin() + (to + 1) * C),
              std::vector<float>(ba.begin() + from * C, ba.begin() + (from + 1) * C)) << "row " << to;
  }
  const std::vector<float> a_log = param(e, "model.layers.0.linear_attn.A_log"), a = f.tensor_f32("blk.0.ssm_a");
  for (size_t i = 0; i < a_log.size(); ++i) EXPECT_FLOAT_EQ(a[i], -std::exp(a_log[i]));
  EXPECT_EQ(f.tensor("blk.0.ssm_conv1d.weight").ne, (std::vector<uint64_t>{4, 64}));
  EXPECT_EQ(f.tensor_f32("blk.0.ssm_norm.weight"), param(e, "model.layers.0.linear_attn.norm.weight"));
  const std::vector<float> q = param(e, "model.layers.1.self_attn.qkv_proj.weight"),
                           gate = param(e, "model.layers.1.self_attn.gate_proj.weight"),
                           attn_q = f.tensor_f32("blk.1.attn_q.weight");
  ASSERT_EQ(attn_q.size(), static_cast<size_t>(2 * H * hd * C));
  for (int64_t h = 0; h < H; ++h) {  // head h: rows [2h hd, 2h hd + hd) its queries, then its gates
    EXPECT_TRUE(std::equal(q.begin() + h * hd * C, q.begin() + (h + 1) * hd * C, attn_q.begin() + 2 * h * hd * C));
    EXPECT_TRUE(std::equal(gate.begin() + h * hd * C, gate.begin() + (h + 1) * hd * C, attn_q.begin() + (2 * h + 1) * hd * C));
  }
  EXPECT_EQ(f.tensor_f32("blk.1.ffn_gate_inp_shexp.weight"), param(e, "model.layers.1.mlp.shared_expert_gate.weight"));
  EXPECT_EQ(f.tensor("blk.1.ffn_up_shexp.weight").ne, (std::vector<uint64_t>{32, 16}));
  EXPECT_EQ(f.tensor("blk.1.ffn_down_shexp.weight").ne, (std::vector<uint64_t>{16, 32}));
  EXPECT_FALSE(has_tensor(f, "blk.0.attn_q.weight"));
  // llama.cpp's state is square: another value head size is refused by name.
  ModelConfig c = e.config;
  c.linear_value_dim = 16;
  const std::vector<float> p(static_cast<size_t>(build_param_layout(c).total));
  EXPECT_NE(test::error_of([&] {
              export_gguf(c, p, gguf_vocabulary(ByteTokenizer()), GgufExportType::F32, "x", temp_path("n.gguf"));
            }).find("linear_value_dim = linear_key_dim"),
            std::string::npos);
}

TEST(GgufExport, QuantizedTypesKeepVectorsF32AndRefuseWhatLlamaCppCannotRun) {
  const Exported q4 = export_tiny(ARCH_LLAMA, GgufExportType::Q4_0);
  EXPECT_EQ(q4.file.get("general.file_type").i, 2);
  EXPECT_EQ(q4.file.tensor("blk.0.attn_q.weight").type, GgmlType::Q4_0);
  EXPECT_EQ(q4.file.tensor("blk.0.attn_norm.weight").type, GgmlType::F32);
  const Exported f16 = export_tiny(ARCH_GPT2, GgufExportType::F16);
  EXPECT_EQ(f16.file.tensor("blk.0.ffn_up.weight").type, GgmlType::F16);
  EXPECT_EQ(f16.file.tensor("blk.0.ffn_up.bias").type, GgmlType::F32);
  const std::vector<float> w = param(f16, "h.0.mlp.c_fc.weight"), back = f16.file.tensor_f32("blk.0.ffn_up.weight");
  for (size_t i = 0; i < w.size(); ++i) EXPECT_NEAR(back[i], w[i], std::max(std::fabs(w[i]) / 1024.0f, 0x1p-25f));  // fp16 subnormals: 2^-24 apart

  ModelConfig moe = tiny(ARCH_LLAMA);  // shared experts: llama.cpp's llama and qwen3moe have none
  moe.moe_experts = 2, moe.moe_shared = 1;
  const std::vector<float> p(static_cast<size_t>(build_param_layout(moe).total));
  const std::string err = test::error_of([&] {
    export_gguf(moe, p, gguf_vocabulary(ByteTokenizer()), GgufExportType::F32, "x", temp_path("moe.gguf"));
  });
  EXPECT_NE(err.find("model.moe_experts = 2: GGUF export writes MoE as llama.cpp's stacked experts"), std::string::npos)
      << err;
  ModelConfig biased = tiny(ARCH_LLAMA);
  biased.qkv_bias = true;
  biased.rope_scaling = ROPE_SCALING_LLAMA3;
  const std::vector<float> pb(static_cast<size_t>(build_param_layout(biased).total));
  EXPECT_NE(test::error_of([&] {
              export_gguf(biased, pb, gguf_vocabulary(ByteTokenizer()), GgufExportType::F32, "x", temp_path("b.gguf"));
            }).find("model.qkv_bias / qk_norm with model.rope_scaling = llama3"),
            std::string::npos);
  ModelConfig nope = tiny(ARCH_LLAMA);  // SmolLM3's NoPE layers: llama.cpp's llama would rotate them
  nope.nope_interval = 2;  // (4 is written as llama.cpp's smollm3, tests/gguf_test.py)
  const std::vector<float> pn(static_cast<size_t>(build_param_layout(nope).total));
  EXPECT_NE(test::error_of([&] {
              export_gguf(nope, pn, gguf_vocabulary(ByteTokenizer()), GgufExportType::F32, "x", temp_path("n.gguf"));
            }).find("model.nope_interval = 2: llama.cpp's smollm3 skips RoPE on every 4th layer only"),
            std::string::npos);
  // A name llama.cpp takes for Phi-3's, on a tokenizer without Phi-3's tokens: it would not load.
  const ModelConfig plain = tiny(ARCH_LLAMA);
  const std::vector<float> pp(static_cast<size_t>(build_param_layout(plain).total));
  EXPECT_NE(test::error_of([&] {
              export_gguf(plain, pp, gguf_vocabulary(ByteTokenizer()), GgufExportType::F32, "My-Phi3-tune", temp_path("p.gguf"));
            }).find("--name 'My-Phi3-tune': llama.cpp takes a model so named for Phi-3"),
            std::string::npos);
  ModelConfig small = tiny(ARCH_GPT2);
  small.vocab_size = 300;
  const std::vector<float> p2(static_cast<size_t>(build_param_layout(small).total));
  EXPECT_NE(test::error_of([&] {
              export_gguf(small, p2, gguf_vocabulary(ByteTokenizer()), GgufExportType::F32, "x", temp_path("v.gguf"));
            }).find("model.vocab_size = 300"),
            std::string::npos);
}

// ---- the tokenizer inside the file (gguf_vocab.h) ----

using nlohmann::json;
using tokenizer_test::TempDir;
using tokenizer_test::write_file;

constexpr const char* kLlama3Regex =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
constexpr const char* kQwen2Regex =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
constexpr const char* kGpt2Regex = R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

json byte_level(bool use_regex, bool add_prefix_space = false) {
  return {{"type", "ByteLevel"}, {"add_prefix_space", add_prefix_space}, {"use_regex", use_regex}};
}

json split(const std::string& regex) {
  return {{"type", "Split"}, {"pattern", {{"Regex", regex}}}, {"behavior", "Isolated"}, {"invert", false}};
}

json splits_then_byte_level(const std::vector<std::string>& regexes) {
  json steps = json::array();
  for (const std::string& r : regexes) steps.push_back(split(r));
  steps.push_back(byte_level(false));
  return {{"type", "Sequence"}, {"pretokenizers", steps}};
}

// A byte-level tokenizer.json: the 256 byte tokens (id = byte), "Ġt" 256, "he" 257, "Ġthe" 258
// by the merges "Ġ t", "h e", "Ġt he"; added <|endoftext|> 259 (special) and <tool> 261 (not
// special); id 260 is a hole.
json small_tokenizer_json(const json& pre_tokenizer, bool ignore_merges) {
  json vocab = json::object();
  for (int b = 0; b < 256; ++b) vocab[gpt2_bytes_to_token(std::string(1, static_cast<char>(b)))] = b;
  vocab["Ġt"] = 256, vocab["he"] = 257, vocab["Ġthe"] = 258;
  json added = json::array();
  added.push_back({{"id", 259}, {"content", "<|endoftext|>"}, {"special", true}});
  added.push_back({{"id", 261}, {"content", "<tool>"}, {"special", false}});
  return {{"model",
           {{"type", "BPE"}, {"vocab", vocab}, {"merges", json::array({"Ġ t", "h e", "Ġt he"})}, {"ignore_merges", ignore_merges}}},
          {"added_tokens", added},
          {"pre_tokenizer", pre_tokenizer},
          {"decoder", {{"type", "ByteLevel"}}}};
}

// A TemplateProcessing post-processor that puts <|endoftext|> (259) before a text.
json bos_template() {
  return {{"type", "TemplateProcessing"},
          {"single", json::array({{{"SpecialToken", {{"id", "<|endoftext|>"}, {"type_id", 0}}}},
                                  {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}})},
          {"special_tokens", {{"<|endoftext|>", {{"id", "<|endoftext|>"}, {"ids", {259}}, {"tokens", {"<|endoftext|>"}}}}}}};
}

// The GGUF vocabulary of `tokenizer_json` written as dir/name/tokenizer.json (and `config`, when
// not null, as its tokenizer_config.json).
GgufVocabulary vocabulary_of(const TempDir& dir, const std::string& name, const json& tokenizer_json,
                             const json& config = nullptr) {
  std::filesystem::create_directories(dir / name);
  write_file(dir / name / "tokenizer.json", tokenizer_json.dump());
  if (!config.is_null()) write_file(dir / name / "tokenizer_config.json", config.dump());
  return gguf_vocabulary(*load_tokenizer((dir / name).string()));
}

std::string vocabulary_error(const TempDir& dir, const std::string& name, const json& tokenizer_json) {
  return test::error_of([&] { vocabulary_of(dir, name, tokenizer_json); });
}

// Exports a tiny model of `arch` with `vocab` and reads the file back.
GgufFile export_with(Arch arch, const GgufVocabulary& vocab) {
  ModelConfig c = tiny(arch);
  c.vocab_size = static_cast<int64_t>(vocab.tokens.size());
  const std::vector<float> p = random_floats(build_param_layout(c).total, 6, 0.5f);
  const std::string path = temp_path("vocab.gguf");
  export_gguf(c, p, vocab, GgufExportType::F32, "v", path);
  GgufFile f = GgufFile::read(path);
  std::filesystem::remove(path);
  return f;
}

TEST(GgufVocab, TokenizerJsonTokensTypesHolesMergesAndSpecials) {
  const TempDir dir("gguf_vocab_gpt2");
  const GgufVocabulary v = vocabulary_of(dir, "gpt2", small_tokenizer_json(byte_level(true), false),
                                         {{"bos_token", "<|endoftext|>"}, {"eos_token", "<|endoftext|>"}});
  EXPECT_EQ(v.model, "gpt2");
  EXPECT_EQ(v.pre, "gpt-2");
  ASSERT_EQ(v.tokens.size(), 262u);
  EXPECT_EQ(v.tokens[' '], "Ġ");
  EXPECT_EQ(v.tokens['\n'], "Ċ");
  EXPECT_EQ(v.tokens[258], "Ġthe");
  EXPECT_EQ(v.tokens[259], "<|endoftext|>");
  EXPECT_EQ(v.tokens[260], "[PAD260]");
  EXPECT_EQ(v.tokens[261], "<tool>");
  EXPECT_EQ(v.types['a'], kGgufTokenNormal);
  EXPECT_EQ(v.types[258], kGgufTokenNormal);
  EXPECT_EQ(v.types[259], kGgufTokenControl);
  EXPECT_EQ(v.types[260], kGgufTokenUnused);
  EXPECT_EQ(v.types[261], kGgufTokenUserDefined);
  EXPECT_EQ(v.placeholders, std::vector<int32_t>{260});
  EXPECT_EQ(v.merges, (std::vector<std::string>{"Ġ t", "h e", "Ġt he"}));
  EXPECT_EQ(v.bos, 259);
  EXPECT_EQ(v.eos, 259);
  EXPECT_FALSE(v.unknown);
  EXPECT_FALSE(v.add_bos);
  EXPECT_FALSE(v.add_eos);
  EXPECT_TRUE(v.scores.empty());
  EXPECT_FALSE(v.add_space_prefix);

  const GgufFile f = export_with(ARCH_LLAMA, v);
  EXPECT_EQ(f.get("tokenizer.ggml.model").s, "gpt2");
  EXPECT_EQ(f.get("tokenizer.ggml.pre").s, "gpt-2");
  const GgufValue& types = f.get("tokenizer.ggml.token_type");
  EXPECT_EQ(types.element, GgufValueType::I32);
  EXPECT_EQ(types.array[260].i, kGgufTokenUnused);
  EXPECT_EQ(f.get("tokenizer.ggml.tokens").array[261].s, "<tool>");
  EXPECT_EQ(f.get("tokenizer.ggml.merges").array[2].s, "Ġt he");
  EXPECT_EQ(f.get("tokenizer.ggml.bos_token_id").type, GgufValueType::U32);
  EXPECT_EQ(f.get("tokenizer.ggml.eos_token_id").i, 259);
  EXPECT_EQ(f.get("tokenizer.ggml.add_bos_token").type, GgufValueType::BOOL);
  EXPECT_FALSE(f.has("tokenizer.ggml.scores"));
  EXPECT_FALSE(f.has("tokenizer.ggml.unknown_token_id"));
  EXPECT_FALSE(f.has("tokenizer.ggml.add_space_prefix"));
}

TEST(GgufVocab, PreTokenizerNamedByItsRegexAndBosFromThePostProcessor) {
  const TempDir dir("gguf_vocab_pre");
  json llama3 = small_tokenizer_json(splits_then_byte_level({kLlama3Regex}), true);
  llama3["post_processor"] = bos_template();
  const GgufVocabulary l = vocabulary_of(dir, "llama3", llama3);
  EXPECT_EQ(l.pre, "llama-bpe");
  EXPECT_EQ(l.bos, 259);
  EXPECT_TRUE(l.add_bos);
  EXPECT_FALSE(l.add_eos);

  json qwen2 = small_tokenizer_json(splits_then_byte_level({kQwen2Regex}), false);
  qwen2["normalizer"] = {{"type", "NFC"}};
  const GgufVocabulary q = vocabulary_of(dir, "qwen2", qwen2);
  EXPECT_EQ(q.pre, "qwen2");
  EXPECT_FALSE(q.bos);
  EXPECT_EQ(q.eos, 259);  // no eos_token: end of text, the added <|endoftext|>
  EXPECT_FALSE(q.add_bos);

  EXPECT_EQ(vocabulary_of(dir, "gpt2_split", small_tokenizer_json(splits_then_byte_level({kGpt2Regex}), false)).pre,
            "gpt-2");
  // tokenizer_config.json's add_bos_token replaces what the post-processor adds.
  EXPECT_FALSE(vocabulary_of(dir, "llama3_no_bos", llama3, {{"add_bos_token", false}}).add_bos);
}

TEST(GgufVocab, RefusesWhatLlamaCppWouldTokenizeDifferentlyNamingTheFileAndKey) {
  const TempDir dir("gguf_vocab_refused");
  const auto expect_refused = [&](const std::string& name, const json& tokenizer_json, const std::string& key,
                                  const std::string& what) {
    const std::string err = vocabulary_error(dir, name, tokenizer_json);
    EXPECT_NE(err.find((dir / name / "tokenizer.json").string() + ": key " + key + ": "), std::string::npos) << err;
    EXPECT_NE(err.find(what), std::string::npos) << err;
    EXPECT_EQ(err.find('\n'), std::string::npos) << err;
  };
  expect_refused("unknown_regex", small_tokenizer_json(splits_then_byte_level({R"(\s+|\S+)"}), false),
                 "pre_tokenizer.pretokenizers[0].pattern", "is not a pre-tokenizer llama.cpp knows by name");
  expect_refused("two_regexes", small_tokenizer_json(splits_then_byte_level({kQwen2Regex, kGpt2Regex}), false),
                 "pre_tokenizer.pretokenizers[1].pattern", "llama.cpp's pre-tokenizers split by one regex");
  expect_refused("no_regex", small_tokenizer_json(byte_level(false), false), "pre_tokenizer", "no regex split");
  expect_refused("prefix_space", small_tokenizer_json(byte_level(true, true), false), "pre_tokenizer.add_prefix_space",
                 "adds no space");
  expect_refused("llama3_merges", small_tokenizer_json(splits_then_byte_level({kLlama3Regex}), false),
                 "model.ignore_merges", "\"llama-bpe\"");
  expect_refused("gpt2_ignore", small_tokenizer_json(byte_level(true), true), "model.ignore_merges", "\"gpt-2\"");
  json twice = small_tokenizer_json(byte_level(true), false);
  twice["added_tokens"].push_back({{"id", 262}, {"content", "he"}, {"special", false}});
  expect_refused("twice", twice, "added_tokens", "ids 257 and 262 are both \"he\"");
  json two_before = small_tokenizer_json(byte_level(true), false);
  two_before["post_processor"] = bos_template();
  json& single = two_before["post_processor"]["single"];
  const json first = single[0];
  single.insert(single.begin(), first);  // <|endoftext|> <|endoftext|> $A
  expect_refused("two_before", two_before, "post_processor", "adds 2 token(s) before a text");
}

// A SentencePiece BPE model trained by python3-sentencepiece on the GPL-3 with a user-defined
// and a control symbol, and its tokenizer.vocab (piece <tab> score, one line per id).
struct TrainedSentencePiece {
  TempDir dir{"gguf_vocab_sp"};
  bool trained = false;
  explicit TrainedSentencePiece(const std::string& options = "") {
    trained = tokenizer_test::train_sentencepiece(
        dir.str(), "input=/usr/share/common-licenses/GPL-3 vocab_size=400 hard_vocab_limit=false "
                   "user_defined_symbols='<tool>' control_symbols='<ctrl>' " + options);
  }
  std::string model() const { return (dir / "tokenizer.model").string(); }
};

TEST(GgufVocab, SentencePiecePiecesScoresTypesAndSettings) {
  const TrainedSentencePiece sp;
  ASSERT_TRUE(sp.trained) << "tools/sentencepiece_reference.py train failed: run scripts/setup (python3-sentencepiece)";
  GgufVocabulary v = gguf_vocabulary(*load_tokenizer(sp.model()));
  EXPECT_EQ(v.model, "llama");
  EXPECT_EQ(v.pre, "");
  EXPECT_TRUE(v.merges.empty());
  std::istringstream listed(read_text_file((sp.dir / "tokenizer.vocab").string()));
  size_t id = 0;
  std::map<std::string, int32_t> type_of;
  for (std::string line; std::getline(listed, line); ++id) {
    const size_t tab = line.find('\t');
    ASSERT_LT(id, v.tokens.size());
    EXPECT_EQ(v.tokens[id], line.substr(0, tab)) << id;
    EXPECT_FLOAT_EQ(v.scores[id], std::stof(line.substr(tab + 1))) << id;
    type_of[v.tokens[id]] = v.types[id];
  }
  EXPECT_EQ(id, v.tokens.size());
  EXPECT_EQ(v.scores.size(), v.tokens.size());
  EXPECT_EQ(type_of["<unk>"], kGgufTokenUnknown);
  EXPECT_EQ(type_of["<s>"], kGgufTokenControl);
  EXPECT_EQ(type_of["</s>"], kGgufTokenControl);
  EXPECT_EQ(type_of["<ctrl>"], kGgufTokenControl);
  EXPECT_EQ(type_of["<tool>"], kGgufTokenUserDefined);
  EXPECT_EQ(type_of["<0x41>"], kGgufTokenByte);
  EXPECT_EQ(type_of["<0x0A>"], kGgufTokenByte);
  EXPECT_EQ(type_of["▁the"], kGgufTokenNormal);
  EXPECT_EQ(v.unknown, 0);
  EXPECT_EQ(v.bos, 1);
  EXPECT_EQ(v.eos, 2);
  EXPECT_TRUE(v.add_bos);  // no tokenizer_config.json: llama.cpp's default for "llama"
  EXPECT_FALSE(v.add_eos);
  EXPECT_EQ(v.add_space_prefix, true);
  EXPECT_TRUE(v.placeholders.empty());

  const GgufFile f = export_with(ARCH_LLAMA, v);
  EXPECT_EQ(f.get("tokenizer.ggml.model").s, "llama");
  EXPECT_FALSE(f.has("tokenizer.ggml.pre"));
  EXPECT_FALSE(f.has("tokenizer.ggml.merges"));
  const GgufValue& scores = f.get("tokenizer.ggml.scores");
  EXPECT_EQ(scores.element, GgufValueType::F32);
  ASSERT_EQ(scores.array.size(), v.scores.size());
  for (size_t i = 0; i < v.scores.size(); ++i) EXPECT_EQ(static_cast<float>(scores.array[i].f), v.scores[i]);
  EXPECT_EQ(f.get("tokenizer.ggml.unknown_token_id").i, 0);
  EXPECT_EQ(f.get("tokenizer.ggml.add_space_prefix").i, 1);
  EXPECT_EQ(f.get("tokenizer.ggml.add_bos_token").i, 1);

  write_file(sp.dir / "tokenizer_config.json", R"({"add_bos_token": false, "add_eos_token": true})");
  v = gguf_vocabulary(*load_tokenizer(sp.model()));
  EXPECT_FALSE(v.add_bos);
  EXPECT_TRUE(v.add_eos);
}

TEST(GgufVocab, SentencePieceModelsLlamaCppWouldTokenizeDifferentlyAreRefused) {
  for (const auto& [options, key] : std::vector<std::pair<std::string, std::string>>{
           {"model_type=unigram", "trainer_spec.model_type"},
           {"byte_fallback=false", "trainer_spec.byte_fallback"},
           {"normalization_rule_name=nmt_nfkc", "normalizer_spec.precompiled_charsmap"},
           {"remove_extra_whitespaces=true", "normalizer_spec.remove_extra_whitespaces"}}) {
    const TrainedSentencePiece sp(options);
    ASSERT_TRUE(sp.trained) << options;
    const std::string err = test::error_of([&] { gguf_vocabulary(*load_tokenizer(sp.model())); });
    EXPECT_EQ(err.rfind(sp.model() + ": key " + key + ": ", 0), 0u) << options << ": " << err;
    EXPECT_EQ(err.find('\n'), std::string::npos) << err;
  }
}

// The protocol buffers wire format by hand: a key is (field << 3 | wire type) as a varint.
std::string varint(uint64_t v) {
  std::string out;
  for (; v >= 0x80; v >>= 7) out.push_back(static_cast<char>((v & 0x7F) | 0x80));
  out.push_back(static_cast<char>(v));
  return out;
}
std::string field_varint(uint32_t field, uint64_t v) { return varint(field << 3 | 0) + varint(v); }
std::string field_bytes(uint32_t field, const std::string& bytes) { return varint(field << 3 | 2) + varint(bytes.size()) + bytes; }
std::string field_float(uint32_t field, float f) {
  std::string out = varint(field << 3 | 5);
  out.append(reinterpret_cast<const char*>(&f), 4);
  return out;
}

TEST(SentencePieceModelProto, ReadsPiecesAndSpecsSkipsOtherFieldsAndNamesTheFileWhenCut) {
  const std::string piece0 = field_bytes(1, "<unk>") + field_float(2, 0.0f) + field_varint(3, 2);
  const std::string piece1 = field_bytes(1, "▁a") + field_float(2, -1.5f) + field_varint(3, 5) + field_varint(200, 7);
  const std::string piece2 = field_bytes(1, "b");  // type absent: NORMAL
  const std::string trainer = field_varint(3, 2) + field_bytes(1, "corpus.txt") + field_varint(35, 1) + field_varint(24, 0);
  const std::string normalizer = field_bytes(1, "identity") + field_varint(3, 0) + field_varint(4, 0);
  const std::string bytes = field_bytes(1, piece0) + field_bytes(1, piece1) + field_bytes(2, trainer) +
                            field_bytes(1, piece2) + field_bytes(3, normalizer) + field_bytes(4, "self test");
  const SentencePieceModel m = parse_sentencepiece_model(bytes, "x.model");
  ASSERT_EQ(m.pieces.size(), 3u);
  EXPECT_EQ(m.pieces[0].text, "<unk>");
  EXPECT_EQ(m.pieces[0].type, SentencePieceModel::kUnknown);
  EXPECT_EQ(m.pieces[1].text, "▁a");
  EXPECT_EQ(m.pieces[1].score, -1.5f);
  EXPECT_EQ(m.pieces[1].type, SentencePieceModel::kUnused);
  EXPECT_EQ(m.pieces[2].type, SentencePieceModel::kNormal);
  EXPECT_EQ(m.model_type, SentencePieceModel::kBpe);
  EXPECT_TRUE(m.byte_fallback);
  EXPECT_EQ(m.normalizer_name, "identity");
  EXPECT_FALSE(m.has_charsmap);
  EXPECT_FALSE(m.add_dummy_prefix);
  EXPECT_FALSE(m.remove_extra_whitespaces);
  EXPECT_TRUE(m.escape_whitespaces);  // absent: the proto's default

  const std::string err = test::error_of([&] { parse_sentencepiece_model(bytes.substr(0, bytes.size() - 3), "x.model"); });
  EXPECT_EQ(err.rfind("x.model: not a SentencePiece model: ", 0), 0u) << err;
  EXPECT_NE(test::error_of([&] { parse_sentencepiece_model(field_varint(2, 1), "x.model"); }).find("wire type 0"),
            std::string::npos);
}

}  // namespace
}  // namespace loom
