// Every op of the Backend interface on every backend against the CPU backend: norms, activations,
// RoPE, both attention kernels, cross-entropy, AdamW, and bad ids naming the op. The fixture and
// the tolerances: backend_ops_fixture.h; instantiated for every backend in test_backend_ops.cpp.
#include "backend_ops_fixture.h"

#include <algorithm>
#include <cstring>

#include "loom/core/targets.h"

namespace loom::backend_ops_test {

// ---------------------------------------------------------------- norms

// Rows x C: odd, wider than one thread block's sweep, and GPT-2 small's 4096 x 768. x has a mean
// offset (2 + U(-3, 3)), which a one-pass variance would get wrong.
const std::vector<std::pair<int64_t, int64_t>> kNormShapes = {{2 * 17, 37}, {33, 2053}, {4096, 768}};

TEST_P(BackendOpsTest, LayerNormForwardBackward) {
  for (DType dtype : kFloatTypes) {
    for (auto [N, C] : kNormShapes) {
      Operands x = norm_operands(N, C, dtype);
      x.tensors["dx"] = nans({N, C}, dtype);
      x.tensors["dweight"] = rnd({C}, dtype, 5);
      x.tensors["dbias"] = rnd({C}, dtype, 6);
      const Tol tol = elementwise_tol(dtype);
      check(str_cat("layernorm ", dt(dtype), " (", N, ", ", C, ")"), x,
            [](Backend& be, Operands& o) {
              be.layernorm_forward(o["x"], o["weight"], o["bias"], o["out"], o["mean"], o["rstd"], 1e-5f);
              be.layernorm_backward(o["dout"], o["x"], o["weight"], o["mean"], o["rstd"], o["dx"], o["dweight"],
                                    o["dbias"]);
            },
            {{"out", tol}, {"mean", tol}, {"rstd", tol}, {"dx", tol}, {"dweight", tol}, {"dbias", tol}}, true);
    }
  }
}

TEST_P(BackendOpsTest, RmsNormForwardBackward) {
  for (DType dtype : kFloatTypes) {
    for (auto [N, C] : kNormShapes) {
      Operands x = norm_operands(N, C, dtype);  // (bias and mean unused)
      x.tensors["dx"] = nans({N, C}, dtype);
      x.tensors["dweight"] = rnd({C}, dtype, 5);
      const Tol tol = elementwise_tol(dtype);
      check(str_cat("rmsnorm ", dt(dtype), " (", N, ", ", C, ")"), x,
            [](Backend& be, Operands& o) {
              be.rmsnorm_forward(o["x"], o["weight"], o["out"], o["rstd"], 1e-5f);
              be.rmsnorm_backward(o["dout"], o["x"], o["weight"], o["rstd"], o["dx"], o["dweight"]);
            },
            {{"out", tol}, {"rstd", tol}, {"dx", tol}, {"dweight", tol}}, true);
    }
  }
}

// The norms' backward with accumulate (the residual stream's gradient: dx += the input
// gradient): on each backend bitwise the same op into a scratch followed by add_inplace, and
// within the f32 tolerance of the CPU.
TEST_P(BackendOpsTest, NormBackwardsAccumulateIntoDxAsASeparateAdd) {
  for (DType dtype : kFloatTypes) {
    for (auto [N, C] : kNormShapes) {
      for (const bool rms : {false, true}) {
        Operands x = norm_operands(N, C, dtype);
        x.tensors["acc"] = rnd({N, C}, dtype, 7, 2.0);
        x.tensors["want"] = rnd({N, C}, dtype, 7, 2.0);  // acc's values
        x.tensors["scratch"] = nans({N, C}, dtype);
        for (const char* name : {"dweight", "dbias", "dweight2", "dbias2"}) x.tensors[name] = rnd({C}, dtype, 5);
        const std::string what = str_cat(rms ? "rmsnorm" : "layernorm", " backward accumulating ", dt(dtype), " (",
                                         N, ", ", C, ")");
        const Op op = [rms](Backend& be, Operands& o) {
          const auto backward = [&](const Tensor& dx, const char* dw, const char* db, bool accumulate) {
            if (rms) be.rmsnorm_backward(o["dout"], o["x"], o["weight"], o["rstd"], dx, o[dw], accumulate);
            else be.layernorm_backward(o["dout"], o["x"], o["weight"], o["mean"], o["rstd"], dx, o[dw], o[db], accumulate);
          };
          if (rms) be.rmsnorm_forward(o["x"], o["weight"], o["out"], o["rstd"], 1e-5f);
          else be.layernorm_forward(o["x"], o["weight"], o["bias"], o["out"], o["mean"], o["rstd"], 1e-5f);
          backward(o["acc"], "dweight", "dbias", true);
          backward(o["scratch"], "dweight2", "dbias2", false);
          be.add_inplace(o["want"], o["scratch"]);
        };
        const Tol tol = elementwise_tol(dtype);
        check(what, x, op, {{"acc", tol}, {"dweight", tol}}, true);
        Operands got = copy_to_backend(x);
        op(*backend_, got);
        EXPECT_TRUE(bytes_of(*backend_, got["acc"]) == bytes_of(*backend_, got["want"]))
            << what << ": not bitwise the op then add_inplace on " << GetParam();
        EXPECT_TRUE(bytes_of(*backend_, got["dweight"]) == bytes_of(*backend_, got["dweight2"])) << what;
      }
    }
  }
}

// The norms' backward with a bf16 copy of dx (dx16: the residual stream's gradient for the bf16
// GEMMs of fc2 / proj, LayerPlan::proj_dy_bf16 / fc2_dy_bf16), overwriting and accumulating: on
// each backend dx16 is bitwise cast(dx) of the finished dx (the accumulated sum), dx is bitwise the
// op's without dx16, and both are within tolerance of the CPU (for dx16 one bf16 step of an
// element, at most 2^-7 of the largest: a 1-ulp f32 difference may round the other way). GPT-2
// small's 4096 x 768 holds ~48 elements exactly halfway between two bf16 values (ties to even).
// A dx16 that is not bf16, of another size, or of an f64 op is refused naming the op.
TEST_P(BackendOpsTest, NormBackwardsWriteTheirDxRoundedToBf16) {
  constexpr Tol kOneBf16Step{1.0 / 128};
  for (auto [N, C] : kNormShapes) {
    for (const bool rms : {false, true}) {
      for (const bool accumulate : {false, true}) {
        Operands x = norm_operands(N, C, DTYPE_F32);
        x.tensors["dx"] = rnd({N, C}, DTYPE_F32, 7, 2.0);  // the stream's gradient before (accumulate)
        x.tensors["plain"] = rnd({N, C}, DTYPE_F32, 7, 2.0);
        x.tensors["dx16"] = nans({N, C}, DTYPE_BF16);
        x.tensors["rounded"] = nans({N, C}, DTYPE_BF16);
        for (const char* name : {"dweight", "dbias", "dweight2", "dbias2"}) x.tensors[name] = rnd({C}, DTYPE_F32, 5);
        const std::string what = str_cat(rms ? "rmsnorm" : "layernorm", " backward", accumulate ? " accumulating" : "",
                                         " with dx16 (", N, ", ", C, ")");
        check(what, x,
              [rms, accumulate, &what](Backend& be, Operands& o) {
                const auto backward = [&](const char* dx, const char* dw, const char* db, const Tensor& dx16) {
                  if (rms) be.rmsnorm_backward(o["dout"], o["x"], o["weight"], o["rstd"], o[dx], o[dw], accumulate, dx16);
                  else be.layernorm_backward(o["dout"], o["x"], o["weight"], o["mean"], o["rstd"], o[dx], o[dw], o[db],
                                             accumulate, dx16);
                };
                if (rms) be.rmsnorm_forward(o["x"], o["weight"], o["out"], o["rstd"], 1e-5f);
                else be.layernorm_forward(o["x"], o["weight"], o["bias"], o["out"], o["mean"], o["rstd"], 1e-5f);
                backward("dx", "dweight", "dbias", o["dx16"]);
                backward("plain", "dweight2", "dbias2", Tensor{});
                be.cast(o["plain"], o["rounded"]);
                EXPECT_TRUE(bytes_of(be, o["dx16"]) == bytes_of(be, o["rounded"]))
                    << what << " on " << be.name() << ": dx16 is not the bits of cast(dx)";
                EXPECT_TRUE(bytes_of(be, o["dx"]) == bytes_of(be, o["plain"]))
                    << what << " on " << be.name() << ": dx is not the op's without dx16";
                EXPECT_TRUE(bytes_of(be, o["dweight"]) == bytes_of(be, o["dweight2"])) << what << " on " << be.name();
              },
              {{"dx", elementwise_tol(DTYPE_F32)}, {"dx16", kOneBf16Step}}, true);
      }
    }
  }
  Operands bad = norm_operands(4, 8, DTYPE_F32);
  bad.tensors["dx"] = nans({4, 8}, DTYPE_F32);
  bad.tensors["dw"] = rnd({8}, DTYPE_F32, 5);
  bad.tensors["f32"] = nans({4, 8}, DTYPE_F32);
  bad.tensors["short"] = nans({4, 7}, DTYPE_BF16);
  Operands o = copy_to_backend(bad);
  for (const char* copy : {"f32", "short"}) {
    const std::string rms_error = test::error_of([&] {
      backend_->rmsnorm_backward(o["dout"], o["x"], o["weight"], o["rstd"], o["dx"], o["dw"], false, o[copy]);
    });
    EXPECT_NE(rms_error.find("rmsnorm_backward"), std::string::npos) << copy << ": " << rms_error;
    const std::string ln_error = test::error_of([&] {
      backend_->layernorm_backward(o["dout"], o["x"], o["weight"], o["mean"], o["rstd"], o["dx"], o["dw"], o["bias"],
                                   true, o[copy]);
    });
    EXPECT_NE(ln_error.find("layernorm_backward"), std::string::npos) << copy << ": " << ln_error;
  }
  Operands wide = norm_operands(4, 8, DTYPE_F64);
  wide.tensors["dx"] = nans({4, 8}, DTYPE_F64);
  wide.tensors["dw"] = rnd({8}, DTYPE_F64, 5);
  wide.tensors["dx16"] = nans({4, 8}, DTYPE_BF16);
  Operands w = copy_to_backend(wide);
  EXPECT_THROW(backend_->rmsnorm_backward(w["dout"], w["x"], w["weight"], w["rstd"], w["dx"], w["dw"], false, w["dx16"]),
               Error);
}

// ---------------------------------------------------------------- activations

TEST_P(BackendOpsTest, GeluForwardBackward) {
  for (DType dtype : kFloatTypes) {
    for (int64_t n : kFlatSizes) {
      Operands x;
      x.tensors["x"] = rnd({n}, dtype, 1, 8.0);  // both tails and the curved middle
      x.tensors["dout"] = rnd({n}, dtype, 2);
      x.tensors["out"] = nans({n}, dtype);
      x.tensors["dx"] = nans({n}, dtype);
      check(str_cat("gelu ", dt(dtype), " n ", n), x,
            [](Backend& be, Operands& o) {
              be.gelu_forward(o["x"], o["out"]);
              be.gelu_backward(o["x"], o["dout"], o["dx"]);
            },
            {{"out", elementwise_tol(dtype)}, {"dx", elementwise_tol(dtype)}});
    }
  }
}

TEST_P(BackendOpsTest, GluForwardBackward) {
  for (DType dtype : kFloatTypes) {
    for (auto [N, F, act] : {std::tuple<int64_t, int64_t, GateActivation>{17, 37, GateActivation::silu},
                             {2048, 1024, GateActivation::silu}, {17, 37, GateActivation::gelu_tanh},
                             {2048, 1024, GateActivation::gelu_tanh}, {17, 37, GateActivation::sigmoid}}) {
      Operands x;
      x.tensors["x"] = rnd({N, 2 * F}, dtype, 1, 6.0);
      x.tensors["dout"] = rnd({N, F}, dtype, 2);
      x.tensors["out"] = nans({N, F}, dtype);
      x.tensors["dx"] = nans({N, 2 * F}, dtype);
      check(str_cat("glu ", enum_name(act), " ", dt(dtype), " (", N, ", ", F, ")"), x,
            [act](Backend& be, Operands& o) {
              be.glu_forward(o["x"], o["out"], act);
              be.glu_backward(o["x"], o["dout"], o["dx"], act);
            },
            {{"out", elementwise_tol(dtype)}, {"dx", elementwise_tol(dtype)}});
    }
  }
}

// ---------------------------------------------------------------- bf16 outputs

// The activations of a bf16 x (a bf16 GEMM output: LayerPlan::fc_bf16), into an f32 and a bf16
// out: on each backend the same bits as the op on x widened by cast() (each element widened
// exactly, the same arithmetic), and within the f32 tolerance (one bf16 step for a bf16 out) of the
// CPU. GELU, SwiGLU and GeGLU, forward and backward (dout f32).
TEST_P(BackendOpsTest, ActivationsOfABf16InputAreTheOpsOnItWidened) {
  const int64_t N = 33, C = 2053, F = 1024;
  struct Case {
    std::string name;
    Shape in, out;
    std::function<void(Backend&, const Tensor& x, const Tensor& g, const Tensor& out)> run;
  };
  const std::vector<Case> cases = {
      {"gelu", {N, C}, {N, C}, [](Backend& be, const Tensor& x, const Tensor&, const Tensor& out) { be.gelu_forward(x, out); }},
      {"gelu backward", {N, C}, {N, C},
       [](Backend& be, const Tensor& x, const Tensor& g, const Tensor& dx) { be.gelu_backward(x, g, dx); }},
      {"swiglu", {N, 2 * F}, {N, F},
       [](Backend& be, const Tensor& x, const Tensor&, const Tensor& out) { be.glu_forward(x, out, GateActivation::silu); }},
      {"geglu", {N, 2 * F}, {N, F},
       [](Backend& be, const Tensor& x, const Tensor&, const Tensor& out) { be.glu_forward(x, out, GateActivation::gelu_tanh); }},
      {"swiglu backward", {N, 2 * F}, {N, 2 * F},
       [N, F](Backend& be, const Tensor& x, const Tensor& g, const Tensor& dx) {
         be.glu_backward(x, g.view(0, {N, F}), dx, GateActivation::silu);
       }},
  };
  for (const Case& c : cases) {
    for (const DType out_dtype : {DTYPE_F32, DTYPE_BF16}) {
      Operands x;
      x.tensors["x16"] = rnd(c.in, DTYPE_BF16, 1, 6.0, 1.0);
      x.tensors["wide"] = nans(c.in, DTYPE_F32);
      x.tensors["g"] = rnd(c.in, DTYPE_F32, 4);
      x.tensors["out"] = nans(c.out, out_dtype);
      x.tensors["want"] = nans(c.out, out_dtype);
      const std::string what = str_cat(c.name, " of a bf16 x into ", dt(out_dtype));
      check(what, x,
            [&c, &what](Backend& be, Operands& o) {
              c.run(be, o["x16"], o["g"], o["out"]);
              be.cast(o["x16"], o["wide"]);
              c.run(be, o["wide"], o["g"], o["want"]);
              EXPECT_TRUE(bytes_of(be, o["out"]) == bytes_of(be, o["want"]))
                  << what << " on " << be.name() << ": not the bits of the op on the widened x";
            },
            {{"out", out_dtype == DTYPE_BF16 ? Tol{1.0 / 256} : elementwise_tol(DTYPE_F32)}}, true);
    }
  }
  // A bf16 x's dout is f32.
  Operands bad;
  bad.tensors["x"] = rnd({4, 8}, DTYPE_BF16, 1);
  bad.tensors["g"] = rnd({4, 8}, DTYPE_BF16, 2);
  bad.tensors["dx"] = nans({4, 8}, DTYPE_F32);
  Operands o = copy_to_backend(bad);
  EXPECT_THROW(backend_->gelu_backward(o["x"], o["g"], o["dx"]), Error);
}

// The forward norms and activations with a bf16 out (precision.activations = bf16 writes the saved
// fields so): on each backend the same bits as its f32 op followed by cast(), and within one bf16
// step (2^-8 of the output's scale: a 1-ulp f32 difference may round the other way) of the CPU.
TEST_P(BackendOpsTest, Bf16OutputsAreTheRoundedF32Outputs) {
  constexpr Tol kOneBf16Step{1.0 / 256};
  struct Case {
    std::string name;
    Shape in, out;
    std::function<void(Backend&, Operands&, const Tensor& out)> run;
  };
  const int64_t N = 33, C = 2053, F = 1024;
  const std::vector<Case> cases = {
      {"layernorm", {N, C}, {N, C},
       [](Backend& be, Operands& o, const Tensor& out) {
         be.layernorm_forward(o["x"], o["w"], o["b"], out, o["mean"], o["rstd"], 1e-5f);
       }},
      {"rmsnorm", {N, C}, {N, C},
       [](Backend& be, Operands& o, const Tensor& out) { be.rmsnorm_forward(o["x"], o["w"], out, o["rstd"], 1e-5f); }},
      {"gelu", {N, C}, {N, C}, [](Backend& be, Operands& o, const Tensor& out) { be.gelu_forward(o["x"], out); }},
      {"gelu, 2^20 + 3 elements", {(int64_t{1} << 20) + 3}, {(int64_t{1} << 20) + 3},
       [](Backend& be, Operands& o, const Tensor& out) { be.gelu_forward(o["x"], out); }},
      {"swiglu", {N, 2 * F}, {N, F},
       [](Backend& be, Operands& o, const Tensor& out) { be.glu_forward(o["x"], out, GateActivation::silu); }},
      {"swiglu_oai", {N, 2 * F}, {N, F},
       [](Backend& be, Operands& o, const Tensor& out) { be.glu_forward(o["x"], out, GateActivation::swiglu_oai); }},
      // The activations' backward dx (LayerPlan::mlp_in_dy_bf16), dout from the "g" operand.
      {"gelu backward", {N, C}, {N, C},
       [](Backend& be, Operands& o, const Tensor& dx) { be.gelu_backward(o["x"], o["g"], dx); }},
      {"swiglu backward", {N, 2 * F}, {N, 2 * F},
       [N, F](Backend& be, Operands& o, const Tensor& dx) {
         be.glu_backward(o["x"], o["g"].view(0, {N, F}), dx, GateActivation::silu);
       }},
  };
  for (const Case& c : cases) {
    Operands x;
    x.tensors["x"] = rnd(c.in, DTYPE_F32, 1, 6.0, 1.0);
    x.tensors["w"] = rnd({c.in.back()}, DTYPE_F32, 2);
    x.tensors["b"] = rnd({c.in.back()}, DTYPE_F32, 3);
    x.tensors["g"] = rnd(c.in, DTYPE_F32, 4);
    x.tensors["mean"] = nans({x.tensors["x"].numel() / c.in.back()}, DTYPE_F32);
    x.tensors["rstd"] = nans({x.tensors["x"].numel() / c.in.back()}, DTYPE_F32);
    x.tensors["out"] = nans(c.out, DTYPE_F32);
    x.tensors["out16"] = nans(c.out, DTYPE_BF16);
    x.tensors["rounded"] = nans(c.out, DTYPE_BF16);
    const std::string what = str_cat(c.name, " with a bf16 out");
    check(what, x,
          [&c, &what](Backend& be, Operands& o) {
            c.run(be, o, o["out16"]);
            c.run(be, o, o["out"]);
            be.cast(o["out"], o["rounded"]);
            EXPECT_TRUE(bytes_of(be, o["out16"]) == bytes_of(be, o["rounded"]))
                << what << " on " << be.name() << ": not the bits of the f32 output rounded by cast()";
          },
          {{"out16", kOneBf16Step}, {"out", elementwise_tol(DTYPE_F32)}}, true);
  }
  // bias_backward of a bf16 dout into an f32 dbias: bitwise the sums of its widened values on each
  // backend, within the f32 tolerance of the CPU.
  Operands bias;
  bias.tensors["dout32"] = rnd({N, C}, DTYPE_F32, 5, 3.0);
  bias.tensors["dout16"] = nans({N, C}, DTYPE_BF16);
  bias.tensors["db16"] = rnd({C}, DTYPE_F32, 6);
  bias.tensors["db32"] = rnd({C}, DTYPE_F32, 6);
  check("bias_backward of a bf16 dout", bias,
        [](Backend& be, Operands& o) {
          be.cast(o["dout32"], o["dout16"]);
          be.cast(o["dout16"], o["dout32"]);  // the bf16 values, widened
          be.bias_backward(o["dout16"], o["db16"]);
          be.bias_backward(o["dout32"], o["db32"]);
          EXPECT_TRUE(bytes_of(be, o["db16"]) == bytes_of(be, o["db32"])) << "bias_backward of a bf16 dout on " << be.name();
        },
        {{"db16", elementwise_tol(DTYPE_F32)}}, true);
  // A bf16 out of an f64 op is refused, naming the op and the operand.
  Operands bad;
  bad.tensors["x"] = rnd({4, 8}, DTYPE_F64, 1);
  bad.tensors["out"] = nans({4, 8}, DTYPE_BF16);
  const Operands b = copy_to_backend(bad);
  EXPECT_NE(error_of([&] { backend_->gelu_forward(b["x"], b["out"]); }).find("gelu_forward: out"), std::string::npos);
  EXPECT_NE(error_of([&] { backend_->rmsnorm_forward(b["x"], b["x"].view(0, {8}), b["out"], b["x"].view(0, {4}), 1e-5f); })
                .find("rmsnorm_forward: out"),
            std::string::npos);
}

// ---------------------------------------------------------------- RoPE

// q and k heads rotated, v heads untouched (the layout attention reads); pos_offset as in
// decoding with a KV cache.
TEST_P(BackendOpsTest, RopeForwardBackwardWithPosOffset) {
  struct Case {
    int64_t B, T, H, KV, hd, pos_offset;
    RopeSpec theta;
  };
  const RopeSpec llama31{500000.0, ROPE_SCALING_LLAMA3, 8.0, 1.0, 4.0, 8192.0};
  // LongRoPE over an original context of 40: the span [5, 22) takes the short factors, [30, 63) the long.
  RopeSpec longrope{10000.0, ROPE_SCALING_LONGROPE, 1.0, 1.0, 4.0, 40.0};
  longrope.amplitude = 1.19;
  for (int j = 0; j < 32; ++j) longrope.short_factor[j] = 1.0f + 0.05f * j, longrope.long_factor[j] = 1.0f + 0.9f * j;
  RopeSpec partial{10000.0};  // Qwen3-Next: a quarter of each head rotates
  partial.rotary_dim = 16;
  for (DType dtype : kFloatTypes) {
    for (const Case& c : {Case{2, 17, 3, 1, 8, 5, {10000.0}}, Case{4, 256, 4, 4, 64, 1000, {500000.0}},
                          Case{2, 33, 2, 1, 64, 7000, llama31}, Case{2, 17, 2, 1, 64, 5, longrope},
                          Case{2, 33, 2, 1, 64, 30, longrope}, Case{2, 17, 4, 2, 64, 9, partial}}) {
      const int64_t W = (c.H + 2 * c.KV) * c.hd, rotated = c.H + c.KV;
      Operands x;
      x.tensors["x"] = rnd({c.B, c.T, W}, dtype, 1);
      x.tensors["dx"] = rnd({c.B, c.T, W}, dtype, 2);
      check(str_cat("rope ", dt(dtype), " B ", c.B, " T ", c.T, " hd ", c.hd, " heads ", rotated, " of ",
                    c.H + 2 * c.KV, " pos_offset ", c.pos_offset),
            x,
            [c, rotated](Backend& be, Operands& o) {
              be.rope_forward(o["x"], c.hd, rotated, c.theta, c.pos_offset);
              be.rope_backward(o["dx"], c.hd, rotated, c.theta, c.pos_offset);
            },
            {{"x", elementwise_tol(dtype)}, {"dx", elementwise_tol(dtype)}});
    }
  }
}

// Decoding's RoPE of a step's rows, each at its own position (Backend::rope_rows_forward, one
// call): bitwise rope_forward row by row on the same backend, for 70 rows (more than the CUDA
// kernel's 64 a launch), positions in any order, LongRoPE rows on both sides of its original
// context (two spans in one call), llama3 scaling and a partial rotary; against the CPU within
// the elementwise tolerance. Rows' positions that do not match their count are refused by name.
TEST_P(BackendOpsTest, RopeRowsIsRopeForwardRowByRow) {
  RopeSpec longrope{10000.0, ROPE_SCALING_LONGROPE, 1.0, 1.0, 4.0, 40.0};
  longrope.amplitude = 1.19;
  for (int j = 0; j < 32; ++j) longrope.short_factor[j] = 1.0f + 0.05f * j, longrope.long_factor[j] = 1.0f + 0.9f * j;
  RopeSpec partial{10000.0};
  partial.rotary_dim = 16;
  const RopeSpec llama31{500000.0, ROPE_SCALING_LLAMA3, 8.0, 1.0, 4.0, 8192.0};
  const int64_t n = 70, hd = 64, heads = 6, W = 8 * hd;
  std::vector<int64_t> positions(n);
  for (int64_t r = 0; r < n; ++r) positions[static_cast<size_t>(r)] = (r * 37 + 11) % 90;  // 0 .. 89, unsorted
  for (DType dtype : {DTYPE_F32, DTYPE_F64}) {
    for (const RopeSpec& spec : {longrope, partial, llama31}) {
      Operands x;
      x.tensors["rows"] = rnd({n, 1, W}, dtype, 3);
      x.tensors["each"] = x.tensors["rows"];
      Operands got = copy_to_backend(x);
      backend_->rope_rows_forward(got["rows"], hd, heads, spec, positions);
      for (int64_t r = 0; r < n; ++r) {
        backend_->rope_forward(got["each"].view(r * W, {1, 1, W}), hd, heads, spec, positions[static_cast<size_t>(r)]);
      }
      EXPECT_TRUE(bytes_of(*backend_, got["rows"]) == bytes_of(*backend_, got["each"])) << dt(dtype) << " " << spec.scaling;
      EXPECT_FALSE(bytes_of(*backend_, got["rows"]) == bytes_of(*backend_, copy_to_backend(x)["rows"]));  // rotated
      check(str_cat("rope rows ", dt(dtype)), x,
            [&](Backend& be, Operands& o) { be.rope_rows_forward(o["rows"], hd, heads, spec, positions); },
            {{"rows", elementwise_tol(dtype)}});
    }
  }
  Operands x;
  x.tensors["rows"] = rnd({n, 1, W}, DTYPE_F32, 3);
  Operands got = copy_to_backend(x);
  const std::vector<int64_t> short_list(positions.begin(), positions.begin() + 5);
  EXPECT_NE(error_of([&] { backend_->rope_rows_forward(got["rows"], hd, heads, partial, short_list); }).find("rope_rows_forward"),
            std::string::npos);
}

// ---------------------------------------------------------------- attention

struct AttentionCase {
  int64_t B, T, H, KV, hd, window;
  int64_t width() const { return (H + 2 * KV) * hd; }
  std::string name() const {
    return str_cat("B ", B, " T ", T, " H ", H, " KV ", KV, " hd ", hd, " window ", window);
  }
};

// T = 17 with MHA, GQA and MQA x windows 0 (full), 3 and T (full, the boundary); then T = 256,
// hd = 64 (GPT-2's head) MHA full and GQA with a window.
std::vector<AttentionCase> attention_cases() {
  std::vector<AttentionCase> cases;
  for (auto [H, KV] : {std::pair<int64_t, int64_t>{4, 4}, {6, 2}, {3, 1}}) {
    for (int64_t window : {0, 3, 17}) cases.push_back({2, 17, H, KV, 8, window});
  }
  cases.push_back({2, 256, 4, 4, 64, 0});
  cases.push_back({2, 256, 4, 2, 64, 100});
  return cases;
}

// Forward, then the backward from the forward's results; probs and dqkv start as NaN.
TEST_P(BackendOpsTest, AttentionForwardBackward) {
  for (DType dtype : kFloatTypes) {
    for (const AttentionCase& c : attention_cases()) {
      Operands x;
      x.tensors["qkv"] = rnd({c.B, c.T, c.width()}, dtype, 1, 2.0);  // scaled: a peaked softmax
      x.tensors["dout"] = rnd({c.B, c.T, c.H * c.hd}, dtype, 2);
      x.tensors["out"] = nans({c.B, c.T, c.H * c.hd}, dtype);
      x.tensors["probs"] = nans({c.B, c.H, c.T, c.T}, dtype);
      x.tensors["dqkv"] = nans({c.B, c.T, c.width()}, dtype);
      const Tol tol = reduction_tol(dtype);
      check(str_cat("attention ", dt(dtype), " ", c.name()), x,
            [c](Backend& be, Operands& o) {
              be.attention_forward(o["qkv"], o["out"], o["probs"], c.H, c.KV, c.window);
              be.attention_backward(o["dout"], o["qkv"], o["out"], o["probs"], o["dqkv"], c.H, c.KV, c.window);
            },
            {{"out", tol}, {"probs", tol}, {"dqkv", tol}}, true);
    }
  }
}

TEST_P(BackendOpsTest, FlashAttentionForwardBackward) {
  for (DType dtype : kFloatTypes) {
    for (const AttentionCase& c : attention_cases()) {
      Operands x;
      x.tensors["qkv"] = rnd({c.B, c.T, c.width()}, dtype, 1, 2.0);
      x.tensors["dout"] = rnd({c.B, c.T, c.H * c.hd}, dtype, 2);
      x.tensors["out"] = nans({c.B, c.T, c.H * c.hd}, dtype);
      x.tensors["lse"] = nans({c.B, c.H, c.T}, dtype);
      x.tensors["dqkv"] = nans({c.B, c.T, c.width()}, dtype);
      const Tol tol = reduction_tol(dtype);
      check(str_cat("flash attention ", dt(dtype), " ", c.name()), x,
            [c](Backend& be, Operands& o) {
              be.flash_attention_forward(o["qkv"], o["out"], o["lse"], c.H, c.KV, c.window);
              be.flash_attention_backward(o["dout"], o["qkv"], o["out"], o["lse"], o["dqkv"], c.H, c.KV, c.window);
            },
            {{"out", tol}, {"lse", tol}, {"dqkv", tol}}, true);
    }
  }
}

// GPT-OSS's attention sinks on flash attention's output: the forward scales each row by
// sigmoid(lse - s_h); the backward turns dout into d(O') and adds d(s_h) into dsinks (which start
// at 1: accumulated, not overwritten), then flash's own backward. The T = 17 cases (MHA, GQA,
// MQA; full and windowed), sinks spread so that some rows are dominated by the sink and some by
// the keys.
TEST_P(BackendOpsTest, AttentionSinksForwardBackward) {
  for (DType dtype : kFloatTypes) {
    for (const AttentionCase& c : attention_cases()) {
      if (c.T != 17) continue;
      Operands x;
      x.tensors["qkv"] = rnd({c.B, c.T, c.width()}, dtype, 1, 2.0);
      x.tensors["sinks"] = rnd({c.H}, dtype, 3, 3.0);
      x.tensors["dout"] = rnd({c.B, c.T, c.H * c.hd}, dtype, 2);
      x.tensors["out"] = nans({c.B, c.T, c.H * c.hd}, dtype);
      x.tensors["lse"] = nans({c.B, c.H, c.T}, dtype);
      x.tensors["dqkv"] = nans({c.B, c.T, c.width()}, dtype);
      x.tensors["dsinks"] = rnd({c.H}, dtype, 4, 0.0, 1.0);
      const Tol tol = reduction_tol(dtype);
      check(str_cat("attention sinks ", dt(dtype), " ", c.name()), x,
            [c](Backend& be, Operands& o) {
              be.flash_attention_forward(o["qkv"], o["out"], o["lse"], c.H, c.KV, c.window);
              be.attention_sink_forward(o["out"], o["lse"], o["sinks"], c.H);
              be.attention_sink_backward(o["dout"], o["out"], o["lse"], o["sinks"], o["dsinks"], c.H);
              be.flash_attention_backward(o["dout"], o["qkv"], o["out"], o["lse"], o["dqkv"], c.H, c.KV, c.window);
            },
            {{"out", tol}, {"dout", tol}, {"dsinks", tol}, {"dqkv", tol}}, true);
    }
  }
}

// ---------------------------------------------------------------- cross-entropy

// Forward; backward into a separate dlogits; backward in place (dlogits aliasing logits). One
// logit of 100 in the small case: exp without the max subtracted overflows f32.
TEST_P(BackendOpsTest, CrossEntropyForwardBackwardAndInPlace) {
  for (DType dtype : kFloatTypes) {
    for (auto [N, V] : {std::pair<int64_t, int64_t>{17, 101}, {64, 50257}}) {
      Operands x;
      Tensor logits = rnd({N, V}, dtype, 1, 5.0);
      if (V == 101) {
        if (dtype == DTYPE_F64) logits.data<double>()[3 * V + 7] = 100.0;
        else logits.data<float>()[3 * V + 7] = 100.0f;
      }
      x.tensors["logits"] = logits;
      x.tensors["targets"] = ids({N}, static_cast<int32_t>(V), 2);
      x.tensors["losses"] = nans({N}, dtype);
      x.tensors["lse"] = nans({N}, dtype);
      x.tensors["dlogits"] = nans({N, V}, dtype);
      const Tol tol = reduction_tol(dtype);
      check(str_cat("cross_entropy ", dt(dtype), " N ", N, " V ", V), x,
            [](Backend& be, Operands& o) {
              be.cross_entropy_forward(o["logits"], o["targets"], o["losses"], o["lse"]);
              be.cross_entropy_backward(o["logits"], o["targets"], o["lse"], 0.37f, o["dlogits"]);
              be.cross_entropy_backward(o["logits"], o["targets"], o["lse"], 0.37f, o["logits"]);  // in place
            },
            {{"losses", tol}, {"lse", tol}, {"dlogits", tol}, {"logits", tol}});
    }
  }
}

// The loss and d(logits) in one call (a training step's loss pass), with the logits by rows
// (N, V) and by columns (V, N; Backend::logits_by_columns): against the CPU as the two ops above,
// d(logits) in place (f32, f64) or rounded to bf16 (f32 logits: the bf16 head's operand), whose
// tolerance against the CPU is one bf16 rounding (2^-8 of the largest element) since another
// summation order may move a value across a rounding boundary. By rows, on the backend under test
// the result is bitwise its own forward, backward and cast (Backend's default, called by name); by
// columns, the CPU's is bitwise its rows result transposed. A masked row (kIgnoreTarget) has loss 0
// and a zero gradient; N = 17 and 40 leave a device's last block of 32 columns part empty.
TEST_P(BackendOpsTest, CrossEntropyLossAndGradByRowsAndByColumns) {
  struct Case {
    DType dtype, grad;
  };
  for (const bool by_columns : {false, true}) {
    for (const Case c : {Case{DTYPE_F32, DTYPE_F32}, Case{DTYPE_F64, DTYPE_F64}, Case{DTYPE_F32, DTYPE_BF16}}) {
      for (auto [N, V] : {std::pair<int64_t, int64_t>{17, 101}, {by_columns ? 40 : 64, 50257}}) {
        const bool in_place = c.grad == c.dtype;
        const size_t width = dtype_size(c.dtype), gw = dtype_size(c.grad);
        const Tensor rows = rnd({N, V}, c.dtype, 1, 5.0);
        Tensor logits = rows;
        if (by_columns) {
          logits = empty({V, N}, c.dtype);
          for (int64_t n = 0; n < N; ++n) {
            for (int64_t v = 0; v < V; ++v) {
              std::memcpy(static_cast<char*>(logits.raw_data()) + (v * N + n) * width,
                          static_cast<const char*>(rows.raw_data()) + (n * V + v) * width, width);
            }
          }
        }
        Tensor targets = ids({N}, static_cast<int32_t>(V), 2);
        targets.data<int32_t>()[3] = kIgnoreTarget;
        Operands x;
        x.tensors["logits"] = logits;
        x.tensors["targets"] = targets;
        x.tensors["losses"] = nans({N}, c.dtype);
        x.tensors["lse"] = nans({N}, c.dtype);
        x.tensors["dlogits"] = nans(logits.shape(), c.grad);
        const std::string what = str_cat("cross_entropy_loss_and_grad", by_columns ? "_columns " : " ", dt(c.dtype),
                                         " -> ", dt(c.grad), " N ", N, " V ", V);
        const Op fused = [in_place, by_columns](Backend& be, Operands& o) {
          const Tensor& d = in_place ? o["logits"] : o["dlogits"];
          if (by_columns) be.cross_entropy_loss_and_grad_columns(o["logits"], o["targets"], o["losses"], o["lse"], 0.37f, d);
          else be.cross_entropy_loss_and_grad(o["logits"], o["targets"], o["losses"], o["lse"], 0.37f, d);
        };
        const Tol tol = reduction_tol(c.dtype);
        const std::string grad = in_place ? "logits" : "dlogits";
        // (lse is compared through the losses, lse - x[target]: a masked row's lse is not defined)
        check(what, x, fused, {{"losses", tol}, {grad, in_place ? tol : Tol{1.0 / 256}}});

        // The reference of the layout: the separate ops on this backend, or the CPU's rows.
        Backend& be = by_columns ? *cpu_ : *backend_;
        Operands got = by_columns ? copy_to_host(x) : copy_to_backend(x), want = got;
        if (by_columns) {
          want.tensors["logits"] = rows;
          want.tensors["dlogits"] = nans({N, V}, c.grad);
          want = copy_to_host(want);
        } else {
          want = copy_to_backend(x);
        }
        fused(be, got);
        be.Backend::cross_entropy_loss_and_grad(want["logits"], want["targets"], want["losses"], want["lse"], 0.37f,
                                                in_place ? want["logits"] : want["dlogits"]);
        for (const char* name : {"losses", "lse"}) {
          EXPECT_TRUE(bytes_of(be, got[name]) == bytes_of(be, want[name])) << what << ": " << name << " on " << be.name();
        }
        const std::vector<uint8_t> g = bytes_of(be, got[grad]), w = bytes_of(be, want[grad]);
        int64_t mismatches = 0;
        for (int64_t n = 0; n < N; ++n) {
          for (int64_t v = 0; v < V; ++v) {
            const int64_t at = by_columns ? v * N + n : n * V + v;
            mismatches += std::memcmp(g.data() + at * gw, w.data() + (n * V + v) * gw, gw) != 0;
          }
        }
        EXPECT_EQ(mismatches, 0) << what << ": the gradient is not bitwise its reference on " << be.name();
        const std::vector<double> losses = values_of(bytes_of(be, got["losses"]), c.dtype), gv = values_of(g, c.grad);
        EXPECT_EQ(losses[3], 0.0) << what;
        int64_t nonzero = 0;
        for (int64_t v = 0; v < V; ++v) nonzero += gv[static_cast<size_t>(by_columns ? v * N + 3 : 3 * V + v)] != 0.0;
        EXPECT_EQ(nonzero, 0) << what << ": the masked row's gradient";
      }
    }
  }
}

// Logits in bf16 (a bf16 head's output under precision.activations = bf16), by rows and by
// columns: f32 losses and lse, the bf16 gradient written over the logits. On each backend bitwise
// the same backend's f32 op on the logits widened (with a bf16 d(logits)); against the CPU at the
// f32 op's tolerances (the gradient within one bf16 rounding).
TEST_P(BackendOpsTest, CrossEntropyOnBf16LogitsIsTheOpOnThemWidened) {
  for (const bool by_columns : {false, true}) {
    for (auto [N, V] : {std::pair<int64_t, int64_t>{17, 101}, {by_columns ? 40 : 64, 50257}}) {
      const Shape shape = by_columns ? Shape{V, N} : Shape{N, V};
      Operands x;
      x.tensors["logits"] = rnd(shape, DTYPE_BF16, 1, 5.0);
      x.tensors["wide"] = nans(shape, DTYPE_F32);
      Tensor targets = ids({N}, static_cast<int32_t>(V), 2);
      targets.data<int32_t>()[3] = kIgnoreTarget;
      x.tensors["targets"] = targets;
      for (const char* name : {"losses", "lse", "wide_losses", "wide_lse"}) x.tensors[name] = nans({N}, DTYPE_F32);
      x.tensors["wide_grad"] = nans(shape, DTYPE_BF16);
      const std::string what = str_cat("cross_entropy_loss_and_grad", by_columns ? "_columns" : "", " bf16 logits N ",
                                       N, " V ", V);
      const Op op = [by_columns](Backend& be, Operands& o) {
        be.cast(o["logits"], o["wide"]);
        const auto fused = by_columns ? &Backend::cross_entropy_loss_and_grad_columns
                                      : &Backend::cross_entropy_loss_and_grad;
        (be.*fused)(o["wide"], o["targets"], o["wide_losses"], o["wide_lse"], 0.37f, o["wide_grad"]);
        (be.*fused)(o["logits"], o["targets"], o["losses"], o["lse"], 0.37f, o["logits"]);
      };
      check(what, x, op, {{"losses", {kF32ReductionTol}}, {"logits", Tol{1.0 / 256}}});
      Operands got = copy_to_backend(x);
      op(*backend_, got);
      for (auto [mine, wide] : {std::pair{"losses", "wide_losses"}, {"logits", "wide_grad"}}) {
        EXPECT_TRUE(bytes_of(*backend_, got[mine]) == bytes_of(*backend_, got[wide]))
            << what << ": " << mine << " is not bitwise the widened op's on " << GetParam();
      }
    }
  }
}

// ---------------------------------------------------------------- AdamW

// Three steps (bias correction 1..3) from m = v = 0 with weight decay and grad_scale, a new
// gradient each step; lr 0.05 so the updates are visible at the parameters' scale.
TEST_P(BackendOpsTest, AdamWThreeSteps) {
  for (DType dtype : kFloatTypes) {
    for (int64_t n : {int64_t{101}, int64_t{1} << 20}) {
      Operands x;
      x.tensors["param"] = rnd({n}, dtype, 1);
      x.tensors["m"] = Tensor::zeros(host_, {n}, dtype, MEM_WORKSPACE);
      x.tensors["v"] = Tensor::zeros(host_, {n}, dtype, MEM_WORKSPACE);
      for (int step = 1; step <= 3; ++step) x.tensors[str_cat("grad", step)] = rnd({n}, dtype, 10 + step, 2.0);
      const Tol tol = elementwise_tol(dtype);
      check(str_cat("adamw ", dt(dtype), " n ", n), x,
            [](Backend& be, Operands& o) {
              for (int64_t step = 1; step <= 3; ++step) {
                be.adamw_step(o["param"], o[str_cat("grad", step)], o["m"], o["v"],
                              AdamWHyper{0.05f, 0.9f, 0.95f, 1e-8f, 0.1f, 0.5f, step});
              }
            },
            {{"param", tol}, {"m", tol}, {"v", tol}});
    }
  }
}

// ---------------------------------------------------------------- errors

// A token id outside the vocab (too large, then negative) is a loom::Error naming the op, on the
// CPU and on the backend under test, in the forward and the backward; the backend stays usable.
TEST_P(BackendOpsTest, BadTokenIdThrowsNamingTheOp) {
  const int64_t B = 2, T = 5, C = 4, V = 5;
  for (int32_t bad : {7, -1}) {
    Operands x;
    Tensor tokens = ids({B, T}, V, 1);
    tokens.data<int32_t>()[3] = bad;
    x.tensors["tokens"] = tokens;
    x.tensors["table"] = rnd({V, C}, DTYPE_F32, 2);
    x.tensors["out"] = nans({B, T, C}, DTYPE_F32);
    for (Backend* be : {cpu_.get(), backend_.get()}) {
      const Operands o = be == cpu_.get() ? copy_to_host(x) : copy_to_backend(x);
      for (const char* op : {"embedding_forward", "embedding_backward"}) {
        const std::string message = error_of([&] {
          if (std::string(op) == "embedding_forward") be->embedding_forward(o["tokens"], o["table"], nullptr, o["out"]);
          else be->embedding_backward(o["tokens"], o["out"], o["table"], nullptr);
          be->synchronize();  // a device backend reports a bad id at its next host synchronisation
        });
        EXPECT_NE(message.find(op), std::string::npos) << be->name() << " token " << bad << ": \"" << message << "\"";
        EXPECT_NE(message.find("outside vocab"), std::string::npos) << be->name() << ": \"" << message << "\"";
      }
    }
  }
  Operands x;  // then a good call on the backend under test
  x.tensors["tokens"] = ids({B, T}, V, 1);
  x.tensors["table"] = rnd({V, C}, DTYPE_F32, 2);
  x.tensors["out"] = nans({B, T, C}, DTYPE_F32);
  check("embedding_forward after errors", x,
        [](Backend& be, Operands& o) { be.embedding_forward(o["tokens"], o["table"], nullptr, o["out"]); },
        {{"out", {kF32ElementwiseTol}}});
}

TEST_P(BackendOpsTest, BadTargetThrowsNamingTheOp) {
  const int64_t N = 6, V = 5;
  for (int32_t bad : {5, -1}) {
    Operands x;
    Tensor targets = ids({N}, V, 1);
    targets.data<int32_t>()[N - 1] = bad;
    x.tensors["targets"] = targets;
    x.tensors["logits"] = rnd({N, V}, DTYPE_F32, 2);
    x.tensors["columns"] = rnd({V, N}, DTYPE_F32, 3);
    x.tensors["losses"] = nans({N}, DTYPE_F32);
    x.tensors["lse"] = nans({N}, DTYPE_F32);
    for (Backend* be : {cpu_.get(), backend_.get()}) {
      const Operands o = be == cpu_.get() ? copy_to_host(x) : copy_to_backend(x);
      const std::string message = error_of([&] {
        be->cross_entropy_forward(o["logits"], o["targets"], o["losses"], o["lse"]);
        be->synchronize();
      });
      EXPECT_NE(message.find("cross_entropy_forward"), std::string::npos)
          << be->name() << " target " << bad << ": \"" << message << "\"";
      EXPECT_NE(message.find("outside vocab"), std::string::npos) << be->name() << ": \"" << message << "\"";
      const std::string fused = error_of([&] {
        be->cross_entropy_loss_and_grad(o["logits"], o["targets"], o["losses"], o["lse"], 1.0f, o["logits"]);
        be->synchronize();
      });
      EXPECT_NE(fused.find("cross_entropy_loss_and_grad: target " + std::to_string(bad)), std::string::npos)
          << be->name() << " target " << bad << ": \"" << fused << "\"";
      const std::string columns = error_of([&] {
        be->cross_entropy_loss_and_grad_columns(o["columns"], o["targets"], o["losses"], o["lse"], 1.0f, o["columns"]);
        be->synchronize();
      });
      EXPECT_NE(columns.find("cross_entropy_loss_and_grad_columns: target " + std::to_string(bad)), std::string::npos)
          << be->name() << " target " << bad << ": \"" << columns << "\"";
    }
  }
  Operands x;
  x.tensors["targets"] = ids({N}, V, 1);
  x.tensors["logits"] = rnd({N, V}, DTYPE_F32, 2);
  x.tensors["losses"] = nans({N}, DTYPE_F32);
  x.tensors["lse"] = nans({N}, DTYPE_F32);
  check("cross_entropy_forward after errors", x,
        [](Backend& be, Operands& o) { be.cross_entropy_forward(o["logits"], o["targets"], o["losses"], o["lse"]); },
        {{"losses", {kF32ReductionTol}}, {"lse", {kF32ReductionTol}}});
}

}  // namespace loom::backend_ops_test
