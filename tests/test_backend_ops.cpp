// Every op of the Backend interface on every backend against the CPU backend (ggml's
// test-backend-ops idea): GEMM, elementwise ops, casts, reductions, embedding. The fixture, the
// tolerances and how a case is compared: backend_ops_fixture.h. Norms, activations, RoPE,
// attention, cross-entropy, AdamW and bad ids: test_backend_ops_nn.cpp.
#include "backend_ops_fixture.h"

namespace loom::backend_ops_test {

// ---------------------------------------------------------------- GEMM

// Every transpose, batched with bias and alpha/beta, and plain (alpha 1, beta 0: C starts as NaN
// and must be overwritten, not scaled); then one transformer-sized product, a linear layer's
// forward x (512, 768) @ W^T + b (f64: 128 rows, the CPU's f64 GEMM is a plain loop).
std::vector<GemmCase> gemm_shapes(DType in) {
  std::vector<GemmCase> cases;
  for (bool ta : {false, true}) {
    for (bool tb : {false, true}) {
      cases.push_back({GemmSpec{ta, tb, 0.5f, 0.25f, 3}, 7, 5, 37, true});
      cases.push_back({GemmSpec{ta, tb, 1.0f, 0.0f, 1}, 19, 23, 37, false});
    }
  }
  cases.push_back({GemmSpec{false, true, 1.0f, 0.0f, 1}, in == DTYPE_F64 ? 128 : 512, 768, 768, true});
  cases.push_back({GemmSpec{true, false, 1.0f, 1.0f, 2}, 96, 160, 1000, false});  // weight gradient, accumulated
  return cases;
}

std::string gemm_name(DType in, const GemmCase& g) {
  return str_cat("gemm ", dtype_name(in), " trans_a ", g.spec.trans_a, " trans_b ", g.spec.trans_b, " batch ",
                 g.spec.batch, " (", g.m, ", ", g.n, ", ", g.k, ") alpha ", g.spec.alpha, " beta ", g.spec.beta,
                 g.bias ? " bias" : "");
}

Operands BackendOpsTest::gemm_ab(DType in, const GemmCase& g) {
  const int64_t b = g.spec.batch;
  Operands x;
  x.tensors["a"] = rnd(g.spec.trans_a ? Shape{b, g.k, g.m} : Shape{b, g.m, g.k}, in, 1);
  x.tensors["b"] = rnd(g.spec.trans_b ? Shape{b, g.n, g.k} : Shape{b, g.k, g.n}, in, 2);
  return x;
}

// A and B of dtype `in`, C and the bias of dtype `out`.
void BackendOpsTest::gemm_cases(DType in, DType out, Tol tol) {
  for (const GemmCase& g : gemm_shapes(in)) {
    const int64_t b = g.spec.batch;
    Operands x = gemm_ab(in, g);
    x.tensors["c"] = g.spec.beta == 0.0f ? nans({b, g.m, g.n}, out) : rnd({b, g.m, g.n}, out, 3);
    if (g.bias) x.tensors["bias"] = rnd({g.n}, out, 4);
    check(gemm_name(in, g), x,
          [g](Backend& be, Operands& o) { be.gemm(o["a"], o["b"], o["c"], g.spec, g.bias ? &o["bias"] : nullptr); },
          {{"c", tol}});
  }
}

TEST_P(BackendOpsTest, GemmF32AllTransposesBatchedBiasAlphaBeta) { gemm_cases(DTYPE_F32, DTYPE_F32, {kF32ReductionTol}); }
TEST_P(BackendOpsTest, GemmBf16InputsAccumulateInF32) { gemm_cases(DTYPE_BF16, DTYPE_F32, {kBf16GemmTol}); }
TEST_P(BackendOpsTest, GemmF64) { gemm_cases(DTYPE_F64, DTYPE_F64, {kF64Tol}); }

// GemmSpec::c_in: C = alpha op(A) op(B) + beta c_in (+ bias), C only written (a residual stream
// added by the output projection without a copy). On every backend within the GEMM's tolerance of
// the CPU; on the strict backend bitwise copy(c_in, C) then the GEMM; c_in itself left as it was.
// f32 (a linear layer's shape, and a batch with alpha and beta), bf16 inputs into f32, f64; odd
// rows (cuBLASLt declines them: the C is copied first).
TEST_P(BackendOpsTest, GemmReadsBetasCFromCIn) {
  for (const DType in : {DTYPE_F32, DTYPE_BF16, DTYPE_F64}) {
    const DType out = in == DTYPE_BF16 ? DTYPE_F32 : in;
    for (const GemmCase& g : {GemmCase{GemmSpec{false, true, 1.0f, 1.0f, 1}, 64, 96, 128, true},
                              GemmCase{GemmSpec{true, false, 0.5f, 0.25f, 2}, 24, 40, 37, true},
                              GemmCase{GemmSpec{false, true, 1.0f, 1.0f, 1}, 17, 101, 64, false}}) {
      const int64_t b = g.spec.batch;
      const std::string what = gemm_name(in, g) + " with c_in";
      Operands x = gemm_ab(in, g);
      x.tensors["c"] = nans({b, g.m, g.n}, out);
      x.tensors["c_in"] = rnd({b, g.m, g.n}, out, 3);
      x.tensors["want"] = rnd({b, g.m, g.n}, out, 3);  // c_in's values
      x.tensors["bias"] = rnd({g.n}, out, 4);
      const Op op = [g](Backend& be, Operands& o) {
        GemmSpec spec = g.spec;
        spec.c_in = &o["c_in"];
        be.gemm(o["a"], o["b"], o["c"], spec, g.bias ? &o["bias"] : nullptr);
        be.gemm(o["a"], o["b"], o["want"], g.spec, g.bias ? &o["bias"] : nullptr);
      };
      const Tol tol = in == DTYPE_F64 ? Tol{kF64Tol} : Tol{kF32ReductionTol};
      check(what, x, op, {{"c", tol}, {"c_in", kBitwise}});
      if (GetParam() != "strict") continue;
      Operands got = copy_to_backend(x);
      op(*backend_, got);
      EXPECT_TRUE(bytes_of(*backend_, got["c"]) == bytes_of(*backend_, got["want"])) << what;
    }
  }
}

// A bf16 C (an autocast-style linear output, beta 0): the same backend's fp32 product plus the
// bias rounded to bf16, rounded as cast() rounds. Bitwise on the CPU kernels (the same product);
// within one bf16 step on a device, whose cuBLASLt may sum a bf16 D in another order; against the
// CPU within one bf16 rounding. Shapes: each transpose with a bias, a batch with and without one
// (a device stages a batch with a bias), rows that are not 16-byte multiples (cuBLASLt declines
// them: staged), a linear layer's forward, and products the CPU computes in several panels.
TEST_P(BackendOpsTest, GemmBf16OutputIsTheRoundedF32Product) {
  std::vector<GemmCase> cases;
  for (bool ta : {false, true}) {
    for (bool tb : {false, true}) cases.push_back({GemmSpec{ta, tb, 1.0f, 0.0f, 1}, 24, 40, 37, true});
  }
  cases.push_back({GemmSpec{false, true, 0.5f, 0.0f, 3}, 16, 24, 32, false});
  cases.push_back({GemmSpec{false, true, 1.0f, 0.0f, 2}, 16, 24, 32, true});
  cases.push_back({GemmSpec{false, true, 1.0f, 0.0f, 1}, 17, 101, 64, true});
  cases.push_back({GemmSpec{false, true, 1.0f, 0.0f, 1}, 512, 768, 768, true});
  // More rows than columns, and the CPU's 16 MB panels cut twice: by rows, and by columns (a head).
  cases.push_back({GemmSpec{true, false, 1.0f, 0.0f, 1}, 40, 24, 37, true});
  cases.push_back({GemmSpec{false, false, 1.0f, 0.0f, 1}, 70000, 64, 16, true});
  cases.push_back({GemmSpec{false, true, 1.0f, 0.0f, 1}, 64, 70000, 16, true});
  for (const GemmCase& g : cases) {
    const int64_t b = g.spec.batch;
    const std::string what = gemm_name(DTYPE_BF16, g) + " -> bf16";
    Operands x = gemm_ab(DTYPE_BF16, g);
    x.tensors["c"] = nans({b, g.m, g.n}, DTYPE_BF16);
    x.tensors["f"] = nans({b, g.m, g.n}, DTYPE_F32);
    x.tensors["bias"] = rnd({g.n}, DTYPE_F32, 4);
    const Op op = [g](Backend& be, Operands& o) {
      be.gemm(o["a"], o["b"], o["c"], g.spec, g.bias ? &o["bias"] : nullptr);
      be.gemm(o["a"], o["b"], o["f"], g.spec);
    };
    check(what, x, op, {{"c", Tol{1.0 / 256}}, {"f", {kBf16GemmTol}}});
    Operands got = copy_to_backend(x);
    op(*backend_, got);
    const std::vector<uint8_t> cb = bytes_of(*backend_, got["c"]);
    const std::vector<double> f = values_of(bytes_of(*backend_, got["f"]), DTYPE_F32);
    const float* bias = x["bias"].data<float>();
    int64_t differ = 0, far = 0;
    for (size_t i = 0; i < f.size(); ++i) {
      const float sum = static_cast<float>(f[i]) + (g.bias ? bf16_to_f32(f32_to_bf16(bias[i % g.n])) : 0.0f);
      uint16_t bits;
      std::memcpy(&bits, cb.data() + 2 * i, 2);
      const int want = f32_to_bf16(sum).bits;
      differ += bits != want;
      far += std::abs(static_cast<int>(bits) - want) > 1;
    }
    if (GetParam() == "strict") {
      EXPECT_EQ(differ, 0) << what << ": not bitwise the rounded f32 product";
    }
    EXPECT_EQ(far, 0) << what << ": more than one bf16 step from the rounded f32 product on " << GetParam();
  }
  // A bf16 C is written, not accumulated.
  Operands x;
  x.tensors["a"] = rnd({4, 8}, DTYPE_BF16, 1);
  x.tensors["b"] = rnd({8, 8}, DTYPE_BF16, 2);
  x.tensors["c"] = rnd({4, 8}, DTYPE_BF16, 3);
  Operands o = copy_to_backend(x);
  EXPECT_THROW(backend_->gemm(o["a"], o["b"], o["c"], GemmSpec{false, false, 1.0f, 1.0f, 1}), Error);
}

// Backend::gemm_gelu / gemm_dgelu (the MLP's GEMMs with their GELU, LayerPlan::fc_gelu and
// fc2_dgelu), bf16 A, B, pre, act and dx: against the CPU within a bf16 step of the largest
// element, 2^-7 of it (a device may take the GELU of the unrounded sum x where the ops take it of
// bf16(x): |gelu(x) - gelu(bf16(x))| <= 1.13 * 2^-9 |x|, plus each act's own rounding, 2^-9 of
// it: at most 1.6 * 2^-8 of the largest), and on the backend itself against the ops they stand
// for (gemm() into pre, gelu_forward; gemm() into f32, gelu_backward on the same pre) within the
// same bound; bitwise on the strict
// backend, whose ops are the default (those very ops). Shapes: fc's forward x W^T + b and fc2's
// input gradient dy W (CUDA fuses both into cuBLASLt's epilogues), and odd columns (aux's leading
// dimension not a multiple of 8: the default there). GELU inputs in [-4, 4]: its tails and its
// minimum. A gemm_dgelu that skipped gelu' (dx = the product) fails.
TEST_P(BackendOpsTest, GemmWithItsGeluIsTheGemmThenTheGelu) {
  for (const GemmCase& g : {GemmCase{GemmSpec{false, true, 1.0f, 0.0f, 1}, 64, 256, 96, true},
                            GemmCase{GemmSpec{false, false, 1.0f, 0.0f, 1}, 64, 256, 96, false},
                            GemmCase{GemmSpec{false, true, 1.0f, 0.0f, 1}, 17, 101, 64, true}}) {
    const std::string what = gemm_name(DTYPE_BF16, g) + " with its GELU";
    Operands x;
    const double s = 2.0 / std::sqrt(static_cast<double>(g.k));  // sums of about U(-4, 4)'s spread
    x.tensors["a"] = rnd(g.spec.trans_a ? Shape{g.k, g.m} : Shape{g.m, g.k}, DTYPE_BF16, 1, std::sqrt(3.0 * s));
    x.tensors["b"] = rnd(g.spec.trans_b ? Shape{g.n, g.k} : Shape{g.k, g.n}, DTYPE_BF16, 2, std::sqrt(3.0 * s));
    for (const char* name : {"pre", "act", "dx", "pre_ref", "act_ref", "dx_ref"}) {
      x.tensors[name] = nans({g.m, g.n}, DTYPE_BF16);
    }
    x.tensors["scratch"] = nans({g.m, g.n}, DTYPE_F32);
    x.tensors["sum"] = nans({g.m, g.n}, DTYPE_F32);
    x.tensors["bias"] = rnd({g.n}, DTYPE_F32, 4, 0.5);
    const Op op = [g](Backend& be, Operands& o) {
      const Tensor* bias = g.bias ? &o["bias"] : nullptr;
      be.gemm_gelu(o["a"], o["b"], o["pre"], o["act"], g.spec, bias);
      be.gemm_dgelu(o["a"], o["b"], o["pre"], o["scratch"], o["dx"], g.spec);
    };
    const Op ref = [g](Backend& be, Operands& o) {
      be.gemm(o["a"], o["b"], o["pre_ref"], g.spec, g.bias ? &o["bias"] : nullptr);
      be.gelu_forward(o["pre_ref"], o["act_ref"]);
      be.gemm(o["a"], o["b"], o["sum"], g.spec);
      be.gelu_backward(o["pre"], o["sum"], o["dx_ref"]);
    };
    const Tol bf16_step{1.0 / 128};
    check(what, x, [&](Backend& be, Operands& o) { op(be, o), ref(be, o); },
          {{"pre", bf16_step}, {"act", bf16_step}, {"dx", bf16_step}});
    Operands got = copy_to_backend(x);
    op(*backend_, got);
    ref(*backend_, got);
    for (const std::string name : {"pre", "act", "dx"}) {
      const std::vector<uint8_t> fused = bytes_of(*backend_, got[name]), plain = bytes_of(*backend_, got[name + "_ref"]);
      if (GetParam() == "strict") {
        EXPECT_TRUE(fused == plain) << what << ": " << name << " is not the ops' bits";
      }
      const Mismatch m = rel_error(values_of(fused, DTYPE_BF16), values_of(plain, DTYPE_BF16));
      EXPECT_LE(m.error, bf16_step.rel) << what << ": " << name << " against the ops on " << GetParam() << ", element "
                                        << m.index << ": " << m.got << ", the ops' " << m.want;
    }
  }
  // Operands the GEMM cannot take: beta, and an f32 scratch of another size.
  Operands x;
  x.tensors["a"] = rnd({4, 8}, DTYPE_BF16, 1);
  x.tensors["b"] = rnd({8, 8}, DTYPE_BF16, 2);
  x.tensors["pre"] = rnd({4, 8}, DTYPE_BF16, 3);
  x.tensors["act"] = rnd({4, 8}, DTYPE_BF16, 3);
  x.tensors["scratch"] = rnd({4, 4}, DTYPE_F32, 3);
  Operands o = copy_to_backend(x);
  EXPECT_NE(error_of([&] { backend_->gemm_gelu(o["a"], o["b"], o["pre"], o["act"], GemmSpec{false, false, 1.0f, 1.0f, 1}); })
                .find("gemm_gelu: the product is written, not accumulated"),
            std::string::npos);
  EXPECT_THROW(backend_->gemm_dgelu(o["a"], o["b"], o["pre"], o["scratch"], o["act"], GemmSpec{}), Error);
}

// ---------------------------------------------------------------- elementwise, casts, reductions


TEST_P(BackendOpsTest, FillCopyAddAddInplaceScaleInplace) {
  for (DType dtype : kFloatTypes) {
    for (int64_t n : kFlatSizes) {
      Operands x;
      x.tensors["a"] = rnd({n}, dtype, 1, 3.0);
      x.tensors["b"] = rnd({n}, dtype, 2, 3.0);
      x.tensors["filled"] = nans({n}, dtype);
      x.tensors["copied"] = nans({n}, dtype);
      x.tensors["sum"] = nans({n}, dtype);
      x.tensors["acc"] = rnd({n}, dtype, 3);
      x.tensors["scaled"] = rnd({n}, dtype, 4);
      check(str_cat("elementwise ", dt(dtype), " n ", n), x,
            [](Backend& be, Operands& o) {
              be.fill(o["filled"], 0.3);
              be.copy(o["a"], o["copied"]);
              be.add(o["a"], o["b"], o["sum"]);
              be.add_inplace(o["acc"], o["b"]);
              be.scale_inplace(o["scaled"], 0.37);
            },
            {{"filled", kBitwise},
             {"copied", kBitwise},
             {"sum", elementwise_tol(dtype)},
             {"acc", elementwise_tol(dtype)},
             {"scaled", elementwise_tol(dtype)}});
    }
  }
}

// f32 -> bf16: rounding ties (to even, both ways), the largest finite values (rounding up to
// infinity), infinities, signed zeros, subnormals, NaNs with payloads (kept, quiet bit set),
// then every 2^16-th bit pattern and 2^20 random ones. bf16 -> f32: all 65536 patterns.
TEST_P(BackendOpsTest, CastF32ToBf16AndBackBitwise) {
  std::vector<uint32_t> bits = {0x00000000u, 0x80000000u, 0x3f808000u, 0x3f818000u, 0x3f807fffu, 0x3f808001u,
                                0x7f7fffffu, 0xff7fffffu, 0x7f7f8000u, 0x7f7f7fffu, 0x7f800000u, 0xff800000u,
                                0x00000001u, 0x80000001u, 0x007fffffu, 0x00008000u, 0x00018000u, 0x7fc00000u,
                                0xffc00000u, 0x7f800001u, 0x7fa5a5a5u, 0xff812345u, 0x7fffffffu};
  for (uint32_t hi = 0; hi < 0x10000u; ++hi) bits.push_back(hi << 16 | (hi * 0x9e37u & 0xffffu));
  uint64_t state = 0x243f6a8885a308d3ull;  // splitmix64
  for (int i = 0; i < (1 << 20); ++i) {
    uint64_t z = (state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    bits.push_back(static_cast<uint32_t>(z ^ (z >> 31)));
  }
  const int64_t n = static_cast<int64_t>(bits.size());
  Operands x;
  x.tensors["f32"] = empty({n}, DTYPE_F32);
  std::memcpy(x["f32"].raw_data(), bits.data(), bits.size() * 4);
  x.tensors["to_bf16"] = nans({n}, DTYPE_BF16);
  x.tensors["all_bf16"] = empty({65536}, DTYPE_BF16);
  for (int64_t i = 0; i < 65536; ++i) x["all_bf16"].data<bf16>()[i] = bf16{static_cast<uint16_t>(i)};
  x.tensors["to_f32"] = nans({65536}, DTYPE_F32);
  check("cast f32 <-> bf16", x,
        [](Backend& be, Operands& o) {
          be.cast(o["f32"], o["to_bf16"]);
          be.cast(o["all_bf16"], o["to_f32"]);
        },
        {{"to_bf16", kBitwise}, {"to_f32", kBitwise}});
}

// f32 <-> f64 are exact (f32 -> f64) and round to nearest even (f64 -> f32): bitwise, over wide
// magnitudes, values that overflow f32 and values that land on f32 subnormals. NaN payloads are
// not part of the contract (a GPU's conversion canonicalizes them), so there are no NaNs.
TEST_P(BackendOpsTest, CastF32F64Bitwise) {
  const int64_t n = (int64_t{1} << 16) + 5;
  Operands x;
  Tensor f32 = rnd({n}, DTYPE_F32, 1), f64 = rnd({n}, DTYPE_F64, 2);
  for (int64_t i = 0; i < n; ++i) {
    const double e = static_cast<double>(i % 601) - 300.0;  // 2^-300 .. 2^300
    f64.data<double>()[i] *= std::exp2(e);
    f32.data<float>()[i] *= static_cast<float>(std::exp2(static_cast<double>(i % 250) - 125.0));
  }
  f32.data<float>()[0] = std::numeric_limits<float>::infinity();
  f32.data<float>()[1] = -0.0f;
  f32.data<float>()[2] = std::numeric_limits<float>::denorm_min();
  f64.data<double>()[0] = 1.0 + std::exp2(-24);          // a tie: rounds to 1
  f64.data<double>()[1] = 1.0 + 3 * std::exp2(-24);      // a tie: rounds up to even
  f64.data<double>()[2] = 3.5e38;                         // beyond f32's max: infinity
  f64.data<double>()[3] = -std::numeric_limits<double>::infinity();
  f64.data<double>()[4] = 3e-42;                          // an f32 subnormal
  x.tensors["f32"] = f32;
  x.tensors["f64"] = f64;
  x.tensors["to_f64"] = nans({n}, DTYPE_F64);
  x.tensors["to_f32"] = nans({n}, DTYPE_F32);
  check("cast f32 <-> f64", x,
        [](Backend& be, Operands& o) {
          be.cast(o["f32"], o["to_f64"]);
          be.cast(o["f64"], o["to_f32"]);
        },
        {{"to_f64", kBitwise}, {"to_f32", kBitwise}});
}

TEST_P(BackendOpsTest, SumAndSumSquaresInDouble) {
  for (DType dtype : kFloatTypes) {
    for (int64_t n : {int64_t{1001}, int64_t{1} << 20, (int64_t{1} << 20) + 3}) {
      Operands x;
      x.tensors["x"] = rnd({n}, dtype, 1, 2.0, 0.25);
      double abs_sum = 0.0, sq_sum = 0.0;
      for (double v : test::values(x["x"])) abs_sum += std::abs(v), sq_sum += v * v;
      check(str_cat("sum ", dt(dtype), " n ", n), x,
            [](Backend& be, Operands& o) {
              o.scalars["sum"] = be.sum(o["x"]);
              o.scalars["sum_squares"] = be.sum_squares(o["x"]);
            },
            {{"sum", {kF64Tol}, abs_sum}, {"sum_squares", {kF64Tol}, sq_sum}}, true);
    }
  }
}

TEST_P(BackendOpsTest, BiasBackwardAccumulatesColumnSums) {
  for (DType dtype : kFloatTypes) {
    for (auto [rows, cols] : {std::pair<int64_t, int64_t>{2 * 17, 67}, {4096, 768}, {3, 2053}}) {
      Operands x;
      x.tensors["dout"] = rnd({rows, cols}, dtype, 1);
      x.tensors["dbias"] = rnd({cols}, dtype, 2);
      check(str_cat("bias_backward ", dt(dtype), " (", rows, ", ", cols, ")"), x,
            [](Backend& be, Operands& o) { be.bias_backward(o["dout"], o["dbias"]); },
            {{"dbias", reduction_tol(dtype)}}, true);
    }
  }
}

// ---------------------------------------------------------------- embedding

// Few ids (V = 11 for 34 tokens) and a hot id (every third token is 7) make the backward add many
// rows into one: the accumulation is what differs between kernels.
TEST_P(BackendOpsTest, EmbeddingForwardBackwardWithAndWithoutPositions) {
  struct Case {
    int64_t B, T, C, V, Tmax;
  };
  for (DType dtype : kFloatTypes) {
    for (const Case& c : {Case{2, 17, 37, 11, 20}, Case{8, 512, 768, 1000, 1024}}) {
      for (bool with_positions : {false, true}) {
        Operands x;
        Tensor tokens = ids({c.B, c.T}, static_cast<int32_t>(c.V), 1);
        for (int64_t i = 0; i < tokens.numel(); i += 3) tokens.data<int32_t>()[i] = 7;
        x.tensors["tokens"] = tokens;
        x.tensors["table"] = rnd({c.V, c.C}, dtype, 2);
        x.tensors["out"] = nans({c.B, c.T, c.C}, dtype);
        x.tensors["dout"] = rnd({c.B, c.T, c.C}, dtype, 3);
        x.tensors["dtable"] = rnd({c.V, c.C}, dtype, 4);
        std::vector<Output> outputs = {{"out", elementwise_tol(dtype)}, {"dtable", elementwise_tol(dtype)}};
        if (with_positions) {
          x.tensors["positions"] = rnd({c.Tmax, c.C}, dtype, 5);
          x.tensors["dpositions"] = rnd({c.Tmax, c.C}, dtype, 6);
          outputs.push_back({"dpositions", elementwise_tol(dtype)});
        }
        check(str_cat("embedding ", dt(dtype), " B ", c.B, " T ", c.T, " C ", c.C, " V ", c.V,
                      with_positions ? " with positions" : ""),
              x,
              [with_positions](Backend& be, Operands& o) {
                be.embedding_forward(o["tokens"], o["table"], with_positions ? &o["positions"] : nullptr, o["out"]);
                be.embedding_backward(o["tokens"], o["dout"], o["dtable"], with_positions ? &o["dpositions"] : nullptr);
              },
              outputs, true);
      }
    }
  }
  // A bf16 table (a checkpoint's embedding used in place, embedding_forward only): each row
  // widened exactly into f32 (plus f32 positions), bitwise the CPU's; the widened values against
  // the table's own f32 by hand.
  for (bool with_positions : {false, true}) {
    Operands x;
    x.tensors["tokens"] = ids({2, 17}, 37, 1);
    x.tensors["table"] = rnd({37, 20}, DTYPE_BF16, 2);
    x.tensors["out"] = nans({2, 17, 20}, DTYPE_F32);
    if (with_positions) x.tensors["positions"] = rnd({20, 20}, DTYPE_F32, 5);
    check(str_cat("embedding bf16 table", with_positions ? " with positions" : ""), x,
          [with_positions](Backend& be, Operands& o) {
            be.embedding_forward(o["tokens"], o["table"], with_positions ? &o["positions"] : nullptr, o["out"]);
          },
          {{"out", Tol{0.0, true}}}, true);
    const int32_t token = x.tensors["tokens"].data<int32_t>()[5];
    const float want = bf16_to_f32(x.tensors["table"].data<bf16>()[token * 20 + 3]) +
                       (with_positions ? x.tensors["positions"].data<float>()[5 * 20 + 3] : 0.0f);
    const auto cpu = make_cpu_backend();
    Tensor out = nans({2, 17, 20}, DTYPE_F32);
    cpu->embedding_forward(x.tensors["tokens"], x.tensors["table"], with_positions ? &x.tensors["positions"] : nullptr,
                          out);
    EXPECT_EQ(out.data<float>()[5 * 20 + 3], want);
  }
}

INSTANTIATE_TEST_SUITE_P(AllBackends, BackendOpsTest, ::testing::Values(std::string("strict"), std::string("cuda")),
                         [](const ::testing::TestParamInfo<std::string>& param) { return param.param; });

}  // namespace loom::backend_ops_test
