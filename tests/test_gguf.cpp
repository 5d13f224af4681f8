// GGUF export (checkpoint/gguf.h, gguf_export.h) and ggml's Q8_0 / Q4_0 blocks
// (precision/ggml_blocks.h): the header, metadata and tensor infos parsed back byte by byte and
// through GgufFile, the block quantizers against a naive reference written from ggml's
// definitions, and the Loom -> llama.cpp tensor mapping, RoPE permutation included.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <unistd.h>

#include "loom/arch/param_layout.h"
#include "loom/checkpoint/gguf.h"
#include "loom/checkpoint/gguf_export.h"
#include "loom/core/file_io.h"
#include "loom/core/philox.h"
#include "loom/precision/formats.h"
#include "loom/precision/ggml_blocks.h"
#include "test_util.h"

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

Exported export_tiny(Arch arch, GgufExportType type) {
  Exported e{tiny(arch), {}, {}};
  const ParamLayout layout = build_param_layout(e.config);
  e.params = random_floats(layout.total, 4, 0.5f);
  const std::string path = temp_path(std::string(arch_name(arch)) + ".gguf");
  export_gguf(e.config, e.params, gguf_vocabulary(ByteTokenizer()), type, "tiny", path);
  e.file = GgufFile::read(path);
  std::filesystem::remove(path);
  return e;
}

std::vector<float> param(const Exported& e, const std::string& name) {
  const ParamSpec& p = build_param_layout(e.config).find(name);
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
  EXPECT_FALSE(f.has("output.weight"));
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

  ModelConfig moe = tiny(ARCH_LLAMA);
  moe.moe_experts = 2;
  const std::vector<float> p(static_cast<size_t>(build_param_layout(moe).total));
  const std::string err = test::error_of([&] {
    export_gguf(moe, p, gguf_vocabulary(ByteTokenizer()), GgufExportType::F32, "x", temp_path("moe.gguf"));
  });
  EXPECT_NE(err.find("model.moe_experts"), std::string::npos) << err;
  ModelConfig small = tiny(ARCH_GPT2);
  small.vocab_size = 300;
  const std::vector<float> p2(static_cast<size_t>(build_param_layout(small).total));
  EXPECT_NE(test::error_of([&] {
              export_gguf(small, p2, gguf_vocabulary(ByteTokenizer()), GgufExportType::F32, "x", temp_path("v.gguf"));
            }).find("model.vocab_size = 300"),
            std::string::npos);
}

}  // namespace
}  // namespace loom
