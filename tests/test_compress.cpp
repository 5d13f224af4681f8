// Post-training quantization (docs/compression.md): the packed formats round-trip exactly, RTN's
// error bound, the int_linear / int_dequantize Backend ops against a dequantize-then-f64
// reference (every width, 1 to 17 input rows, input scales, bias, accumulation; W8A8 exactly),
// GPTQ against an independent PyTorch implementation (tools/gptq_reference.py) and against RTN,
// SparseGPT's sparsity and 2:4 pattern, a model with quantized weights against the same model
// with the dequantized weights in f32 (forward and decoding rows), and the quantized folder's
// round trip and errors.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "loom/backend/backend.h"
#include "loom/backend/cpu/cpu_quant_ops.h"
#include "loom/checkpoint/checkpoint.h"
#include "loom/checkpoint/safetensors.h"
#include "loom/compress/quantize_model.h"
#include "loom/core/file_io.h"
#include "loom/core/philox.h"
#include "loom/infer/engine.h"
#include "kv_test_util.h"
#include "loom/model/transformer.h"
#include "loom/precision/formats.h"
#include "loom/precision/gptq.h"
#include "loom/precision/int_quant.h"
#include "test_util.h"

namespace loom {
namespace {

namespace fs = std::filesystem;
using test::error_of;

std::vector<float> normal(int64_t n, uint64_t seed, float stddev) {
  std::vector<float> w(static_cast<size_t>(n));
  philox_fill_normal(w.data(), n, seed, 0, 0, 0.0f, stddev);
  return w;
}

TEST(IntQuant, PackingRoundTripsExactlyAtEveryWidth) {
  for (int bits : {8, 4, 3}) {
    const int64_t cols = 96;
    std::vector<uint8_t> codes(cols), back(cols);
    for (int64_t c = 0; c < cols; ++c) codes[static_cast<size_t>(c)] = static_cast<uint8_t>((c * 37 + 11) % (1 << bits));
    std::vector<uint8_t> packed(static_cast<size_t>(int_row_bytes(bits, cols)));
    int_pack_row(codes.data(), bits, cols, packed.data());
    int_unpack_row(packed.data(), bits, cols, back.data());
    EXPECT_EQ(back, codes) << bits << " bits";
    EXPECT_EQ(static_cast<int64_t>(packed.size()), cols * bits / 8) << bits << " bits";
  }
  // 4 bits: byte j of a 32-column chunk holds column j low, column j + 16 high.
  std::vector<uint8_t> codes(32, 0), packed(16);
  codes[3] = 0x5, codes[19] = 0xA;
  int_pack_row(codes.data(), 4, 32, packed.data());
  EXPECT_EQ(packed[3], 0xA5);
}

TEST(IntQuant, RtnIsWithinHalfAStepAndCodesFitTheWidth) {
  const int64_t rows = 8, cols = 256;
  const std::vector<float> w = normal(rows * cols, 3, 0.1f);
  for (int bits : {8, 4, 3}) {
    const IntWeight q = rtn_quantize(w, int_weight_spec(bits, 64, rows, cols, false, "test"));
    const std::vector<float> d = int_dequantize(q);
    for (int64_t i = 0; i < rows * cols; ++i) {
      const float s = q.scales[static_cast<size_t>(i / 64)];
      ASSERT_LE(std::fabs(d[static_cast<size_t>(i)] - w[static_cast<size_t>(i)]), 0.5f * s * (1 + 1e-5f)) << bits << " bits, " << i;
    }
    EXPECT_EQ(q.bytes(), rows * cols * bits / 8 + rows * 4 * 5);  // codes + f32 scale and u8 zero per group
  }
  EXPECT_NE(error_of([&] { (void)int_weight_spec(5, 64, rows, cols, false, "layer"); }).find("--bits 5"), std::string::npos);
  EXPECT_NE(error_of([&] { (void)int_weight_spec(4, 48, rows, cols, false, "layer"); }).find("--group 48"), std::string::npos);
  EXPECT_NE(error_of([&] { (void)int_weight_spec(4, 0, rows, cols, true, "layer"); }).find("W8A8 needs --bits 8"), std::string::npos);
}

// Compact storage (--scales f16, --symmetric): every scale is an f16 value, rounded up, and the
// codes are chosen with it (within half a step of the stored scale: nothing clipped), symmetric groups share z = 2^(b-1)
// with s = 2 max|x| / (2^b - 1) (AutoGPTQ's sym=True), and a file holds 2-byte scales and no
// zero points. A scale beyond f16 is refused by name. GPTQ stores the same way.
TEST(IntQuant, CompactStorageRoundsScalesToF16AndSharesTheZeroPoint) {
  const int64_t rows = 8, cols = 256;
  const std::vector<float> w = normal(rows * cols, 5, 0.1f);
  for (int bits : {8, 4, 3}) {
    for (const IntStorage storage : {IntStorage{.f16_scales = true}, IntStorage{.symmetric = true},
                                     IntStorage{.f16_scales = true, .symmetric = true}}) {
      const IntWeight q = rtn_quantize(w, int_weight_spec(bits, 32, rows, cols, false, "test"), storage);
      EXPECT_EQ(q.storage, storage);
      const std::vector<float> d = int_dequantize(q);
      for (int64_t i = 0; i < rows * cols; ++i) {
        const size_t g = static_cast<size_t>(i / 32);
        const float s = q.scales[g];
        if (storage.f16_scales) {
          ASSERT_EQ(decode(FMT_FP16, encode(FMT_FP16, s, false)), s) << i;
        }
        if (storage.symmetric) {
          ASSERT_EQ(q.zeros[g], 1 << (bits - 1)) << i;
        }
        // Symmetric: the largest magnitude may clamp at the top code, one step from it.
        const float bound = storage.symmetric ? 1.0f * s : 0.5f * s;
        ASSERT_LE(std::fabs(d[static_cast<size_t>(i)] - w[static_cast<size_t>(i)]), bound * (1 + 1e-5f)) << bits << " bits, " << i;
      }
      if (storage.symmetric) {  // s = 2 amax / (2^b - 1) of the first group
        float amax = 0.0f;
        for (int64_t c = 0; c < 32; ++c) amax = std::max(amax, std::fabs(w[static_cast<size_t>(c)]));
        const float want = static_cast<float>(2.0 * amax / ((1 << bits) - 1));
        EXPECT_GE(q.scales[0], want);
        EXPECT_NEAR(q.scales[0], want, storage.f16_scales ? 1e-3f * want : 1e-7f * want);
      }
      const int64_t groups = rows * cols / 32;
      EXPECT_EQ(q.stored_bytes(), rows * cols * bits / 8 + groups * (storage.f16_scales ? 2 : 4) + (storage.symmetric ? 0 : groups));
    }
  }
  // ggml's Q4_0 size: 4 bits and an f16 scale per 32 weights, 18 bytes a block.
  const IntWeight q40 = rtn_quantize(w, int_weight_spec(4, 32, rows, cols, false, "test"), {.f16_scales = true, .symmetric = true});
  EXPECT_EQ(q40.stored_bytes(), rows * cols / 32 * 18);
  // GPTQ with the same storage: f16 scales, shared zero points.
  std::vector<double> h(static_cast<size_t>(cols * cols), 0.0);
  for (int64_t i = 0; i < cols; ++i) h[static_cast<size_t>(i * cols + i)] = 1.0 + static_cast<double>(i % 7);
  GptqOptions o;
  o.storage = {.f16_scales = true, .symmetric = true};
  const IntWeight g = gptq_quantize(w, h, int_weight_spec(4, 32, rows, cols, false, "test"), o);
  for (size_t i = 0; i < g.scales.size(); ++i) {
    ASSERT_EQ(decode(FMT_FP16, encode(FMT_FP16, g.scales[i], false)), g.scales[i]);
    ASSERT_EQ(g.zeros[i], 8);
  }
  // Beyond f16's 65504: refused, naming the weight.
  const std::vector<float> huge(static_cast<size_t>(32), 1e6f);
  const IntWeight big = rtn_quantize(huge, int_weight_spec(4, 32, 1, 32, false, "test"), {.f16_scales = true});
  EXPECT_NE(error_of([&] { check_stored_scales(big, "h.0.mlp.c_fc.weight"); }).find("h.0.mlp.c_fc.weight"), std::string::npos);
  EXPECT_NE(error_of([&] { check_stored_scales(big, "x"); }).find("--scales f32"), std::string::npos);
}

struct OpCase {
  int bits;
  int64_t group;
  bool act_int8, input_scale, bias;
  float beta;
};

// y = beta y + x diag(s) W^T + b in f64 from the dequantized weight; with `quantize_input`, x's
// groups of the weight's group size rounded to int8 first as the op states (s_x = max |x| / 127,
// the op's own f32 arithmetic). bound[i]: the most that rounding can move y[i] (s_x / 2 times
// sum |w| per group).
std::vector<double> reference_linear(const std::vector<float>& x, int64_t N, const IntWeight& q, const std::vector<float>& s,
                                     const std::vector<float>& b, const std::vector<float>& y0, float beta,
                                     bool quantize_input, std::vector<double>* bound = nullptr) {
  const int64_t K = q.spec.cols, O = q.spec.rows, G = q.spec.group;
  const std::vector<float> w = int_dequantize(q);
  std::vector<double> y(static_cast<size_t>(N * O));
  if (bound != nullptr) bound->assign(y.size(), 0.0);
  for (int64_t n = 0; n < N; ++n) {
    std::vector<float> xf(static_cast<size_t>(K));
    for (int64_t c = 0; c < K; ++c) xf[static_cast<size_t>(c)] = x[static_cast<size_t>(n * K + c)] * (s.empty() ? 1.0f : s[static_cast<size_t>(c)]);
    std::vector<double> in(xf.begin(), xf.end()), step(static_cast<size_t>(K / G));
    for (int64_t g = 0; g < K / G; ++g) {
      float amax = 0.0f;
      for (int64_t c = g * G; c < (g + 1) * G; ++c) amax = std::max(amax, std::fabs(xf[static_cast<size_t>(c)]));
      const float sx = amax > 0 ? amax / 127.0f : 1.0f;
      step[static_cast<size_t>(g)] = sx;
      if (!quantize_input) continue;
      for (int64_t c = g * G; c < (g + 1) * G; ++c) {
        in[static_cast<size_t>(c)] = static_cast<double>(sx) * std::clamp(std::nearbyint(xf[static_cast<size_t>(c)] / sx), -127.0f, 127.0f);
      }
    }
    for (int64_t o = 0; o < O; ++o) {
      double acc = 0.0;
      for (int64_t c = 0; c < K; ++c) {
        acc += in[static_cast<size_t>(c)] * w[static_cast<size_t>(o * K + c)];
        if (bound != nullptr) (*bound)[static_cast<size_t>(n * O + o)] += 0.5 * step[static_cast<size_t>(c / G)] * std::fabs(w[static_cast<size_t>(o * K + c)]);
      }
      if (!b.empty()) acc += b[static_cast<size_t>(o)];
      y[static_cast<size_t>(n * O + o)] = acc + beta * y0[static_cast<size_t>(n * O + o)];
    }
  }
  return y;
}

TEST(IntLinearOp, MatchesDequantizeThenF64AtEveryWidthAndRowCount) {
  auto backend = make_cpu_backend();
  Allocator& a = backend->allocator();
  const int64_t O = 40, K = 256;
  const std::vector<OpCase> cases = {{8, 128, false, false, false, 0.0f}, {4, 128, false, true, true, 1.0f},
                                     {4, 32, false, false, true, 0.0f},   {3, 64, false, true, false, 1.0f},
                                     {3, 256, false, false, false, 0.0f}, {8, 0, true, false, true, 0.0f},
                                     {8, 0, true, true, false, 1.0f}};
  int checked = 0;
  for (const OpCase& c : cases) {
    const IntWeightSpec spec = int_weight_spec(c.bits, c.group, O, K, c.act_int8, "op");
    IntWeight q = rtn_quantize(normal(O * K, 11 + c.bits, 0.05f), spec);
    std::vector<float> s;
    if (c.input_scale) {
      s = normal(K, 5, 0.3f);
      for (float& v : s) v = std::exp(v);
      q.input_scale = s;
    }
    const IntWeightDevice d = int_weight_to_backend(q, *backend, MEM_PARAMETERS);
    const std::vector<float> b = c.bias ? normal(O, 7, 0.1f) : std::vector<float>{};
    Tensor bt;
    if (c.bias) bt = Tensor::empty(a, {O}, DTYPE_F32, MEM_WORKSPACE), backend->write(bt, b.data());
    for (int64_t N : {1, 3, 5, 17}) {
      const std::vector<float> x = normal(N * K, 100 + N, 1.0f), y0 = normal(N * O, 200 + N, 1.0f);
      Tensor xt = Tensor::empty(a, {N, K}, DTYPE_F32, MEM_WORKSPACE), yt = Tensor::empty(a, {N, O}, DTYPE_F32, MEM_WORKSPACE);
      backend->write(xt, x.data());
      backend->write(yt, y0.data());
      backend->int_linear(xt, d.codes, d.scales, d.zeros, spec, c.input_scale ? &d.input_scale : nullptr, yt, c.beta,
                          c.bias ? &bt : nullptr);
      // The op's stated arithmetic (the input in int8 per row and group, every format), up to f32
      // rounding; and the dequantize-then-f64 product of the f32 input within the input
      // rounding's bound.
      std::vector<double> bound;
      const std::vector<double> want = reference_linear(x, N, q, s, b, y0, c.beta, true);
      const std::vector<double> exact = reference_linear(x, N, q, s, b, y0, c.beta, false, &bound);
      for (int64_t i = 0; i < N * O; ++i) {
        const double got = yt.data<float>()[i], tol = 2e-5 * (1.0 + std::fabs(want[static_cast<size_t>(i)]));
        ASSERT_NEAR(got, want[static_cast<size_t>(i)], tol) << c.bits << " bits, group " << c.group << ", N " << N << ", " << i;
        ASSERT_NEAR(got, exact[static_cast<size_t>(i)], bound[static_cast<size_t>(i)] + tol) << c.bits << " bits, group " << c.group << ", N " << N;
      }
      ++checked;
    }
    // int_dequantize is the host's dequantization (times the input scale) bit for bit.
    Tensor w = Tensor::empty(a, {O, K}, DTYPE_F32, MEM_WORKSPACE);
    backend->int_dequantize(d.codes, d.scales, d.zeros, spec, c.input_scale ? &d.input_scale : nullptr, w);
    const std::vector<float> host = effective_weight(q);
    for (int64_t i = 0; i < O * K; ++i) ASSERT_EQ(w.data<float>()[i], host[static_cast<size_t>(i)]) << i;
  }
  EXPECT_EQ(checked, 28);
}

// ---------------------------------------------------------------- GPTQ

class GptqReference : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { path_ = test::python_fixture("gptq_reference.py", "gptq.safetensors", temp_); }
  static void TearDownTestSuite() {
    if (!temp_.empty()) fs::remove_all(temp_);
  }
  void SetUp() override { ASSERT_TRUE(!path_.empty() && fs::exists(path_)) << "tools/gptq_reference.py failed"; }
  template <typename T>
  static std::vector<T> read(const SafetensorsFile& f, const std::string& name) {
    return test::entry_values<T>(f, name);
  }
  static inline fs::path path_, temp_;
};

double relative_error(const std::vector<float>& x, int64_t N, const std::vector<float>& w, const std::vector<float>& q, int64_t R,
                      int64_t K) {
  double num = 0.0, den = 0.0;
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t r = 0; r < R; ++r) {
      double y = 0.0, yq = 0.0;
      for (int64_t k = 0; k < K; ++k) {
        y += static_cast<double>(x[static_cast<size_t>(n * K + k)]) * w[static_cast<size_t>(r * K + k)];
        yq += static_cast<double>(x[static_cast<size_t>(n * K + k)]) * q[static_cast<size_t>(r * K + k)];
      }
      num += (y - yq) * (y - yq), den += y * y;
    }
  }
  return num / den;
}

TEST_F(GptqReference, ReconstructionErrorMatchesPyTorchWithin1e5) {
  const SafetensorsFile f = SafetensorsFile::read(path_.string());
  int cases = 0;
  for (const char* name : {"g32", "g64_act", "row8_dead", "g128_blocks"}) {
    const std::string c = name;
    int bits = 0, group = 0, act = 0, block = 0;
    ASSERT_EQ(std::sscanf(f.metadata_value(c).c_str(), "%d,%d,%d,%d", &bits, &group, &act, &block), 4);
    const std::vector<float> w = read<float>(f, c + ".w"), x = read<float>(f, c + ".x");
    const int64_t R = f.shape(c + ".w")[0], K = f.shape(c + ".w")[1], N = f.shape(c + ".x")[0];
    std::vector<double> h(static_cast<size_t>(K * K), 0.0);
    for (int64_t n = 0; n < N; ++n) {
      for (int64_t i = 0; i < K; ++i) {
        for (int64_t j = 0; j < K; ++j) h[static_cast<size_t>(i * K + j)] += static_cast<double>(x[static_cast<size_t>(n * K + i)]) * x[static_cast<size_t>(n * K + j)];
      }
    }
    GptqOptions o;
    o.act_order = act != 0, o.block = block;
    const IntWeight q = gptq_quantize(w, h, int_weight_spec(bits, group, R, K, false, c), o);
    const std::vector<float> deq = int_dequantize(q);
    const double err = relative_error(x, N, w, deq, R, K), want = read<double>(f, c + ".error")[0];
    EXPECT_NEAR(err, want, 1e-5 * want) << c;
    // The codes agree (a rounding tie decided differently would show here).
    const std::vector<uint8_t> codes = read<uint8_t>(f, c + ".codes");
    int64_t differ = 0;
    for (int64_t r = 0; r < R; ++r) {
      for (int64_t k = 0; k < K; ++k) differ += int_code(q.codes.data() + r * int_row_bytes(bits, K), bits, k) != codes[static_cast<size_t>(r * K + k)];
    }
    EXPECT_EQ(differ, 0) << c;
    // GPTQ beats round-to-nearest with the same groups (by 3-5x here).
    const IntWeight rtn = rtn_quantize(w, int_weight_spec(bits, group, R, K, false, c));
    const double rtn_err = relative_error(x, N, w, int_dequantize(rtn), R, K);
    EXPECT_NEAR(rtn_err, read<double>(f, c + ".rtn_error")[0], 1e-5 * rtn_err) << c;
    EXPECT_LT(err, 0.5 * rtn_err) << c;
    ++cases;
  }
  EXPECT_EQ(cases, 4);
}

TEST(SparseGpt, PrunesTheFractionAndTheTwoOfFourPattern) {
  const int64_t R = 16, K = 128, N = 300;
  const std::vector<float> w = normal(R * K, 1, 0.1f), x = normal(N * K, 2, 1.0f);
  std::vector<double> h(static_cast<size_t>(K * K), 0.0);
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t i = 0; i < K; ++i) {
      for (int64_t j = 0; j < K; ++j) h[static_cast<size_t>(i * K + j)] += static_cast<double>(x[static_cast<size_t>(n * K + i)]) * x[static_cast<size_t>(n * K + j)];
    }
  }
  const std::vector<float> half = sparsegpt_prune(w, h, R, K, 0.5, 0, 0);
  int64_t zeros = 0;
  for (float v : half) zeros += v == 0.0f;
  EXPECT_EQ(zeros, R * K / 2);
  const std::vector<float> p24 = sparsegpt_prune(w, h, R, K, 0.5, 2, 4);
  for (int64_t i = 0; i < R * K; i += 4) {
    int z = 0;
    for (int j = 0; j < 4; ++j) z += p24[static_cast<size_t>(i + j)] == 0.0f;
    ASSERT_EQ(z, 2) << i;
  }
  // The OBS update makes the output error smaller than zeroing the same weights does.
  std::vector<float> masked(w);
  for (size_t i = 0; i < w.size(); ++i) masked[i] = half[i] == 0.0f ? 0.0f : w[i];
  EXPECT_LT(relative_error(x, N, w, half, R, K), relative_error(x, N, w, masked, R, K));
}

// ---------------------------------------------------------------- a model with quantized weights

ModelConfig tiny_config(Arch arch) {
  ModelConfig c;
  c.arch = arch;
  c.vocab_size = 96;
  c.max_seq_len = 32;
  c.n_layer = 2;
  c.n_head = 2;
  c.n_kv_head = arch == ARCH_LLAMA ? 1 : 2;
  c.d_model = 64;
  c.d_ff = 128;
  return c;
}

TEST(QuantizedModel, ForwardAndDecodingEqualTheDequantizedWeightsInF32) {
  for (Arch arch : {ARCH_GPT2, ARCH_LLAMA}) {
    for (int bits : {8, 4}) {
      auto backend = make_cpu_backend();
      const ModelConfig c = tiny_config(arch);
      Transformer q(*backend, c), f(*backend, c);
      q.init_weights(1);
      std::map<std::string, IntWeight> weights;
      for (const Transformer::LinearWeight& lw : q.linear_weights()) {
        // A tied head is the embedding: the f32 twin could not keep its lookups unquantized.
        if (c.tied_head() && lw.layer == q.linear_layers().back()) continue;
        const std::vector<float> w(lw.weight.data<float>(), lw.weight.data<float>() + lw.weight.numel());
        weights[lw.name] = rtn_quantize(w, int_weight_spec(bits, 32, lw.weight.dim(0), lw.weight.dim(1), false, lw.name));
      }
      backend->copy(q.params(), f.params());
      for (const Transformer::LinearWeight& lw : f.linear_weights()) {
        if (weights.count(lw.name) == 0) continue;
        const std::vector<float> d = effective_weight(weights.at(lw.name));
        backend->write(lw.weight, d.data());
      }
      const size_t n = weights.size();
      q.set_int_weights(weights);
      EXPECT_EQ(q.int_weight_params(), c.n_layer * (c.d_model * (c.qkv_width() + c.d_model) + c.d_model * (arch == ARCH_LLAMA ? 3 : 2) * c.d_ff) +
                                           (c.tied_head() ? 0 : c.vocab_size * c.d_model));
      EXPECT_EQ(n, static_cast<size_t>(4 * c.n_layer + (c.tied_head() ? 0 : 1)));
      // Forward over 2 x 24 tokens (48 rows: the dequantize-and-GEMM path).
      ActivationStore sq = q.allocate_store(2, 24), sf = f.allocate_store(2, 24);
      const Tensor tokens = test::random_tokens(backend->allocator(), {2, 24}, 96, 9);
      backend->copy(tokens, sq.tokens), backend->copy(tokens, sf.tokens);
      backend->copy(tokens, sq.targets), backend->copy(tokens, sf.targets);
      const double lq = q.forward(sq), lf = f.forward(sf);
      EXPECT_NEAR(lq, lf, 1e-5 * std::fabs(lf)) << arch << " " << bits;
      for (int64_t i = 0; i < sq.logits.numel(); ++i) ASSERT_NEAR(sq.logits.data<float>()[i], sf.logits.data<float>()[i], 1e-4) << i;
      // Decoding rows (int_linear: the codes read directly) against the f32 model's rows.
      EngineConfig ec;
      ec.max_batch = 3;
      auto kq = make_paged_kv_cache(engine_cache_config(c, ec), &backend->allocator());
      auto kf = make_paged_kv_cache(engine_cache_config(c, ec), &backend->allocator());
      kvtest::CacheRows cq, cf;
      cq.cache = kq.get(), cq.config = &c, cf.cache = kf.get(), cf.config = &c;
      for (int r = 0; r < 3; ++r) cq.seqs.push_back(kq->add_sequence()), cf.seqs.push_back(kf->add_sequence());
      ActivationStore rq = q.allocate_rows(3), rf = f.allocate_rows(3);
      // int_linear's inputs in int8 move each logit by at most 2% of the step's largest |logit|
      // (about 1% seen).
      double worst = 0.0;
      for (int64_t pos = 0; pos < 5; ++pos) {
        const std::vector<int32_t> tok = {static_cast<int32_t>(pos + 3), static_cast<int32_t>(2 * pos + 1), 40};
        const std::vector<int64_t> positions = {pos, pos, pos};
        q.forward_rows(rq, tok, positions, cq);
        f.forward_rows(rf, tok, positions, cf);
        double scale = 0.0;
        for (int64_t i = 0; i < rf.logits.numel(); ++i) scale = std::max(scale, static_cast<double>(std::fabs(rf.logits.data<float>()[i])));
        const double tol = 2e-2 * scale;
        for (int64_t i = 0; i < rq.logits.numel(); ++i) {
          ASSERT_NEAR(rq.logits.data<float>()[i], rf.logits.data<float>()[i], tol) << "pos " << pos << " " << i;
          worst = std::max(worst, static_cast<double>(std::fabs(rq.logits.data<float>()[i] - rf.logits.data<float>()[i])));
        }
        for (int r = 0; r < 3; ++r) kq->advance(cq.seqs[static_cast<size_t>(r)]), kf->advance(cf.seqs[static_cast<size_t>(r)]);
      }
      EXPECT_GT(worst, 0.0);  // the rows ran the integer kernel, not a copy of the f32 weights
      // A quantized model does not train.
      EXPECT_NE(error_of([&] { q.backward(sq, 1.0f); }).find("cannot be trained"), std::string::npos);
    }
  }
}

// Sequential calibration (compress/calibration.h) carries the hidden states from block to block:
// with the weights unchanged, block 1's statistics are those of the whole model's forward (its
// records of block 1's linear inputs), and the head's come from the final norm's output.
// With OLMo 2's post-norms the q/k/v and gate/up projections read the residual stream (the block
// input and mid), not a norm's output.
TEST(SequentialCalibration, BlockStatisticsEqualTheWholeForwards) {
 for (const bool post : {false, true}) {
  SCOPED_TRACE(post ? "post_norm" : "pre-norm");
  auto backend = make_cpu_backend();
  ModelConfig c = tiny_config(ARCH_LLAMA);
  c.post_norm = post;
  Transformer model(*backend, c);
  model.init_weights(3);
  const int64_t T = 8;
  std::vector<std::vector<int32_t>> sequences;
  for (int s = 0; s < 3; ++s) {
    std::vector<int32_t> seq(static_cast<size_t>(T));
    for (int64_t t = 0; t < T; ++t) seq[static_cast<size_t>(t)] = static_cast<int32_t>((s * 13 + t * 5) % c.vocab_size);
    sequences.push_back(seq);
  }
  SequentialCalibration calibration(model, sequences, true);
  (void)calibration.stats(0);
  calibration.advance(0);
  const std::map<std::string, InputStats> block1 = calibration.stats(1);
  for (int64_t l = 1; l < c.n_layer; ++l) {
    if (l > 1) (void)calibration.stats(l);
    calibration.advance(l);
  }
  const std::map<std::string, InputStats> head = calibration.stats(c.n_layer);
  // The whole forward of the three sequences at once.
  ActivationStore store = model.allocate_store(3, T);
  std::vector<int32_t> tokens;
  for (const auto& s : sequences) tokens.insert(tokens.end(), s.begin(), s.end());
  backend->write(store.tokens, tokens.data());
  backend->write(store.targets, tokens.data());
  model.forward(store, false);
  const BlockSaved& b = store.blocks[1];
  const std::vector<Transformer::LinearWeight> weights = layer_linear_weights(model, 1);
  const Tensor inputs[] = {post ? b.input : b.attention.norm.out, b.attention.attn, post ? b.mid : b.mlp.norm.out,
                           b.mlp.act};
  auto check = [&](const InputStats& st, const Tensor& x, const std::string& name) {
    const int64_t K = static_cast<int64_t>(st.abs_sum.size()), rows = x.numel() / K;
    ASSERT_EQ(st.rows, rows) << name;
    const std::vector<double> v = test::values(*backend, x);
    for (int64_t i = 0; i < K; ++i) {
      double sum = 0.0;
      for (int64_t r = 0; r < rows; ++r) sum += std::fabs(v[static_cast<size_t>(r * K + i)]);
      ASSERT_NEAR(st.abs_sum[static_cast<size_t>(i)], sum, 1e-9 * std::max(1.0, sum)) << name << " " << i;
      double h = 0.0;
      for (int64_t r = 0; r < rows; ++r) h += v[static_cast<size_t>(r * K + i)] * v[static_cast<size_t>(r * K + (K - 1 - i))];
      ASSERT_NEAR(st.hessian[static_cast<size_t>(i * K + (K - 1 - i))], h, 1e-4 * std::max(1.0, std::fabs(h))) << name << " " << i;
    }
  };
  for (size_t i = 0; i < weights.size(); ++i) check(block1.at(weights[i].name), inputs[i], weights[i].name);
  check(head.at(layer_linear_weights(model, c.n_layer)[0].name), store.final_norm, "head");
  // Out of order: refused.
  EXPECT_NE(error_of([&] { (void)calibration.stats(0); }).find("calibration"), std::string::npos);
 }
}

TEST(QuantizedModel, FolderRoundTripsAndRejectsDamage) {
  auto backend = make_cpu_backend();
  const ModelConfig c = tiny_config(ARCH_GPT2);
  Transformer model(*backend, c);
  model.init_weights(4);
  QuantizedModelContents contents;
  contents.model = ModelState{c, model.params()};
  for (const Transformer::LinearWeight& lw : model.linear_weights()) {
    const std::vector<float> w(lw.weight.data<float>(), lw.weight.data<float>() + lw.weight.numel());
    contents.weights[lw.name] = rtn_quantize(w, int_weight_spec(3, 64, lw.weight.dim(0), lw.weight.dim(1), false, lw.name));
  }
  const std::string head = model.linear_weights().back().name;  // GPT-2's tied head: the embedding
  contents.also_f32.insert(head);
  contents.weights.begin()->second.input_scale.assign(static_cast<size_t>(contents.weights.begin()->second.spec.cols), 0.5f);
  contents.quantization = {{"method", "rtn"}, {"bits", 3}, {"group", 64}, {"activations", "f32"}};
  const fs::path dir = fs::temp_directory_path() / ("loom_test_qfolder_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  write_quantized_model(dir.string(), contents);
  EXPECT_EQ(checkpoint_problem(dir.string()), "");
  EXPECT_TRUE(is_quantized_model(dir.string()));
  EXPECT_EQ(checkpoint_model_config(dir.string()).d_model, c.d_model);
  Transformer other(*backend, c);
  std::map<std::string, IntWeight> back;
  const nlohmann::json meta = read_quantized_model(dir.string(), ModelState{c, other.params()}, back);
  EXPECT_EQ(meta.at("bits").get<int>(), 3);
  ASSERT_EQ(back.size(), contents.weights.size());
  for (const auto& [name, q] : contents.weights) {
    EXPECT_EQ(back.at(name).codes, q.codes) << name;
    EXPECT_EQ(back.at(name).scales, q.scales) << name;
    EXPECT_EQ(back.at(name).zeros, q.zeros) << name;
    EXPECT_EQ(back.at(name).input_scale, q.input_scale) << name;
  }
  // The tied head's embedding comes back in f32 beside its codes (lookups read it).
  const Tensor e0 = model.param(head), e1 = other.param(head);
  for (int64_t i = 0; i < e0.numel(); ++i) ASSERT_EQ(e1.data<float>()[i], e0.data<float>()[i]) << i;
  const Tensor norm = other.param(build_param_layout(c).params[2].name);
  EXPECT_EQ(norm.data<float>()[0], model.param(build_param_layout(c).params[2].name).data<float>()[0]);
  // A plain checkpoint load refuses it, naming what it is.
  EXPECT_NE(error_of([&] { CheckpointManager(dir.string()).load(dir.string(), ModelState{c, other.params()}, {}); })
                .find("is a quantized model"), std::string::npos);
  // A flipped byte fails the manifest's checksum, naming the file.
  {
    const std::string path = (dir / "model.safetensors").string();
    std::string bytes = test::read_file_bytes(path);
    bytes[bytes.size() - 3] ^= 0x40;
    write_file_atomic(path, bytes);
  }
  EXPECT_NE(error_of([&] { (void)read_quantized_model(dir.string(), ModelState{c, other.params()}, back); })
                .find("model.safetensors has XXH64"), std::string::npos);
  // Another shape: the tensor and both shapes named.
  ModelConfig wide = c;
  wide.d_ff = 256;
  write_quantized_model(dir.string(), contents);
  Transformer wider(*backend, wide);
  const std::string e = error_of([&] { (void)read_quantized_model(dir.string(), ModelState{wide, wider.params()}, back); });
  EXPECT_NE(e.find("expected"), std::string::npos) << e;
  fs::remove_all(dir);
}

}  // namespace
}  // namespace loom

namespace loom {
namespace {

// ---------------------------------------------------------------- distillation's loss

// T^2 KL(softmax(t / T) || softmax(s / T)) of one row, in double.
double kd_row(const std::vector<double>& s, const std::vector<double>& t, double T) {
  double ms = -1e300, mt = -1e300;
  for (size_t v = 0; v < s.size(); ++v) ms = std::max(ms, s[v] / T), mt = std::max(mt, t[v] / T);
  double zs = 0, zt = 0;
  for (size_t v = 0; v < s.size(); ++v) zs += std::exp(s[v] / T - ms), zt += std::exp(t[v] / T - mt);
  double kl = 0;
  for (size_t v = 0; v < s.size(); ++v) {
    const double lpt = t[v] / T - mt - std::log(zt), lps = s[v] / T - ms - std::log(zs);
    kl += std::exp(lpt) * (lpt - lps);
  }
  return T * T * kl;
}

TEST(DistillLoss, MatchesTheDoubleKlAndItsFiniteDifferences) {
  auto backend = make_cpu_backend();
  Allocator& a = backend->allocator();
  const int64_t N = 5, V = 37;
  for (double T : {1.0, 2.0, 4.0}) {
    const std::vector<float> s = normal(N * V, 1, 2.0f), t = normal(N * V, 2, 2.0f);
    Tensor st = Tensor::empty(a, {N, V}, DTYPE_F32, MEM_WORKSPACE), tt = Tensor::empty(a, {N, V}, DTYPE_F32, MEM_WORKSPACE);
    Tensor losses = Tensor::empty(a, {N}, DTYPE_F32, MEM_WORKSPACE), grad = Tensor::empty(a, {N, V}, DTYPE_F32, MEM_WORKSPACE);
    backend->write(st, s.data()), backend->write(tt, t.data());
    const float scale = 0.25f;
    backend->soft_target_loss(st, tt, static_cast<float>(T), scale, losses, grad);
    for (int64_t i = 0; i < N; ++i) {
      std::vector<double> si(s.begin() + i * V, s.begin() + (i + 1) * V), ti(t.begin() + i * V, t.begin() + (i + 1) * V);
      const double want = kd_row(si, ti, T);
      EXPECT_NEAR(losses.data<float>()[i], want, 1e-5 * (1 + want)) << "T " << T << " row " << i;
      EXPECT_GE(losses.data<float>()[i], -1e-6f);
      for (int64_t v = 0; v < V; v += 6) {  // d(scale loss)/d s_v by central differences in double
        const double h = 1e-4;
        std::vector<double> up = si, down = si;
        up[static_cast<size_t>(v)] += h, down[static_cast<size_t>(v)] -= h;
        const double fd = scale * (kd_row(up, ti, T) - kd_row(down, ti, T)) / (2 * h);
        EXPECT_NEAR(grad.data<float>()[i * V + v], fd, 1e-5) << "T " << T << " row " << i << " v " << v;
      }
    }
    // The teacher itself: zero loss and zero gradient.
    backend->soft_target_loss(tt, tt, static_cast<float>(T), 1.0f, losses, grad);
    for (int64_t i = 0; i < N; ++i) EXPECT_NEAR(losses.data<float>()[i], 0.0f, 1e-6f);
    for (int64_t i = 0; i < N * V; ++i) ASSERT_NEAR(grad.data<float>()[i], 0.0f, 1e-7f);
  }
}

}  // namespace
}  // namespace loom
