// Qwen3-Next's linear-attention ops on every backend against the CPU backend (the fixture:
// backend_ops_fixture.h): the gated delta rule forward and backward (grouped heads, sequences
// across several backward checkpoints, with and without initial / final states, the CPU's chunked
// form against the backend's own), the causal conv1d + SiLU forward and backward (a decoding
// continuation whose final state overwrites its initial one in place, T < K - 1), and the gates
// (softplus past its threshold of 20). Outputs start as NaN; gradients that accumulate (dweight,
// da_log, ddt_bias) start as noise. The backwards must be deterministic.
// Tolerances as the fixture's: f32 1e-5 of the output's scale (the CUDA kernels run the recurrent
// form and sum in another order), f64 1e-12.
#include <cmath>

#include "backend_ops_fixture.h"

namespace loom::backend_ops_test {

namespace {

struct DeltaCase {
  int64_t B, T, Hk, Hv, dk, dv, chunk;
  bool states;  // initial / final / dfinal / dinitial defined
};

const DeltaCase kDeltaCases[] = {
    {2, 37, 2, 4, 24, 40, 16, true},   // grouped heads, 3 checkpoints, columns fewer than the block's threads
    {1, 20, 2, 2, 128, 128, 8, false},  // Qwen3-Next's head dims, one-to-one heads, no states
    {1, 5, 1, 3, 16, 8, 64, true},      // one chunk longer than the sequence
};

}  // namespace

TEST_P(BackendOpsTest, DeltaRuleForwardBackward) {
  for (DType dtype : kFloatTypes) {
    for (const DeltaCase& c : kDeltaCases) {
      Operands x;
      const double qk_scale = 1.0 / std::sqrt(static_cast<double>(c.dk));  // |k| about 0.6: a stable recurrence
      x.tensors["q"] = rnd({c.B, c.T, c.Hk, c.dk}, dtype, 1, qk_scale);
      x.tensors["k"] = rnd({c.B, c.T, c.Hk, c.dk}, dtype, 2, qk_scale);
      x.tensors["v"] = rnd({c.B, c.T, c.Hv, c.dv}, dtype, 3);
      x.tensors["g"] = rnd({c.B, c.T, c.Hv}, dtype, 4, 0.5, -0.6);    // log-decays in (-1.1, -0.1)
      x.tensors["beta"] = rnd({c.B, c.T, c.Hv}, dtype, 5, 0.45, 0.5);  // write strengths in (0.05, 0.95)
      x.tensors["out"] = nans({c.B, c.T, c.Hv, c.dv}, dtype);
      x.tensors["dout"] = rnd({c.B, c.T, c.Hv, c.dv}, dtype, 6);
      for (const char* name : {"dq", "dk"}) x.tensors[name] = nans({c.B, c.T, c.Hk, c.dk}, dtype);
      x.tensors["dv"] = nans({c.B, c.T, c.Hv, c.dv}, dtype);
      for (const char* name : {"dg", "dbeta"}) x.tensors[name] = nans({c.B, c.T, c.Hv}, dtype);
      const Shape state{c.B, c.Hv, c.dk, c.dv};
      if (c.states) {
        x.tensors["initial"] = rnd(state, dtype, 7, 0.5);
        x.tensors["dfinal"] = rnd(state, dtype, 8);
        x.tensors["final"] = nans(state, dtype);
        x.tensors["dinitial"] = nans(state, dtype);
      }
      std::vector<Output> outputs = {{"out", reduction_tol(dtype)}, {"dq", reduction_tol(dtype)},
                                     {"dk", reduction_tol(dtype)},  {"dv", reduction_tol(dtype)},
                                     {"dg", reduction_tol(dtype)},  {"dbeta", reduction_tol(dtype)}};
      if (c.states) {
        outputs.push_back({"final", reduction_tol(dtype)});
        outputs.push_back({"dinitial", reduction_tol(dtype)});
      }
      const auto opt = [&c](Operands& o, const char* name) { return c.states ? o[name] : Tensor{}; };
      check(str_cat("delta rule ", dt(dtype), " B ", c.B, " T ", c.T, " heads ", c.Hk, "/", c.Hv, " dims ", c.dk, "/",
                    c.dv, " chunk ", c.chunk, c.states ? " states" : ""),
            x,
            [&](Backend& be, Operands& o) {
              be.delta_rule_forward(o["q"], o["k"], o["v"], o["g"], o["beta"], opt(o, "initial"), o["out"],
                                    opt(o, "final"), DeltaRuleForm::chunked, c.chunk);
              be.delta_rule_backward(o["q"], o["k"], o["v"], o["g"], o["beta"], opt(o, "initial"), o["dout"],
                                     opt(o, "dfinal"), o["dq"], o["dk"], o["dv"], o["dg"], o["dbeta"],
                                     opt(o, "dinitial"), DeltaRuleForm::chunked, c.chunk);
            },
            outputs, true);
    }
  }
}

TEST_P(BackendOpsTest, CausalConv1dSiluForwardBackward) {
  for (DType dtype : kFloatTypes) {
    for (int64_t T : {int64_t{2}, int64_t{19}}) {  // 2 < K - 1: the final state reads the initial one
      const int64_t B = 2, C = 37, K = 4;
      Operands x;
      x.tensors["x"] = rnd({B, T, C}, dtype, 1, 2.0);
      x.tensors["w"] = rnd({C, K}, dtype, 2, 0.6);
      x.tensors["initial"] = rnd({B, K - 1, C}, dtype, 3, 2.0);
      x.tensors["state"] = rnd({B, K - 1, C}, dtype, 4, 2.0);  // initial and final at once (decoding's cache)
      x.tensors["y"] = nans({B, T, C}, dtype);
      x.tensors["y_in_place"] = nans({B, T, C}, dtype);
      x.tensors["final"] = nans({B, K - 1, C}, dtype);
      x.tensors["dy"] = rnd({B, T, C}, dtype, 5);
      x.tensors["dx"] = nans({B, T, C}, dtype);
      x.tensors["dinitial"] = nans({B, K - 1, C}, dtype);
      x.tensors["dweight"] = rnd({C, K}, dtype, 6);
      x.tensors["dx_no_initial"] = nans({B, T, C}, dtype);
      x.tensors["dweight_no_initial"] = rnd({C, K}, dtype, 7);
      check(str_cat("causal conv1d silu ", dt(dtype), " T ", T), x,
            [](Backend& be, Operands& o) {
              be.causal_conv1d_silu_forward(o["x"], o["w"], o["initial"], o["y"], o["final"]);
              be.causal_conv1d_silu_forward(o["x"], o["w"], o["state"], o["y_in_place"], o["state"]);
              be.causal_conv1d_silu_backward(o["x"], o["w"], o["initial"], o["dy"], o["dx"], o["dweight"],
                                             o["dinitial"]);
              be.causal_conv1d_silu_backward(o["x"], o["w"], Tensor{}, o["dy"], o["dx_no_initial"],
                                             o["dweight_no_initial"], Tensor{});
            },
            {{"y", elementwise_tol(dtype)},
             {"final", kBitwise},
             {"y_in_place", elementwise_tol(dtype)},
             {"state", kBitwise},
             {"dx", reduction_tol(dtype)},
             {"dinitial", reduction_tol(dtype)},
             {"dweight", reduction_tol(dtype)},
             {"dx_no_initial", reduction_tol(dtype)},
             {"dweight_no_initial", reduction_tol(dtype)}},
            true);
    }
  }
}

TEST_P(BackendOpsTest, DeltaGatesForwardBackward) {
  for (DType dtype : kFloatTypes) {
    const int64_t N = 300, H = 6;
    Operands x;
    x.tensors["ba"] = rnd({N, 2 * H}, dtype, 1, 12.0, 8.0);  // a + dt_bias from -5 to 21: both softplus branches
    x.tensors["a_log"] = rnd({H}, dtype, 2, 1.0);
    x.tensors["dt_bias"] = rnd({H}, dtype, 3, 1.0);
    x.tensors["g"] = nans({N, H}, dtype);
    x.tensors["beta"] = nans({N, H}, dtype);
    x.tensors["dg"] = rnd({N, H}, dtype, 4);
    x.tensors["dbeta"] = rnd({N, H}, dtype, 5);
    x.tensors["dba"] = nans({N, 2 * H}, dtype);
    x.tensors["da_log"] = rnd({H}, dtype, 6);
    x.tensors["ddt_bias"] = rnd({H}, dtype, 7);
    check(str_cat("delta gates ", dt(dtype)), x,
          [](Backend& be, Operands& o) {
            be.delta_gates_forward(o["ba"], o["a_log"], o["dt_bias"], o["g"], o["beta"]);
            be.delta_gates_backward(o["ba"], o["a_log"], o["dt_bias"], o["dg"], o["dbeta"], o["dba"], o["da_log"],
                                    o["ddt_bias"]);
          },
          {{"g", elementwise_tol(dtype)},
           {"beta", elementwise_tol(dtype)},
           {"dba", elementwise_tol(dtype)},
           {"da_log", reduction_tol(dtype)},
           {"ddt_bias", reduction_tol(dtype)}},
          true);
  }
}

}  // namespace loom::backend_ops_test
