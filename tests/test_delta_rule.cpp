// The gated delta rule (Backend::delta_rule_forward / _backward; Gated DeltaNet, Yang, Kautz &
// Hatamizadeh 2024, arXiv 2412.06464) on the CPU backend:
//   1. the chunked form against the recurrent one (f32, T not a multiple of the chunk, chunks
//      1, 5, 16, 64 and > T, with and without an initial state): out and final state within
//      1e-5 absolute;
//   2. against PyTorch (tools/make_delta_rule_fixture.py: the published recurrence in float64,
//      its gradients by autograd; committed as tests/fixtures/delta_rule/delta_rule.safetensors):
//      out, final state and every gradient within 1e-5 relative to the reference's largest
//      element in f32, 1e-10 in f64, both forms;
//   3. the backward against float64 central differences for q, k, v, g, beta and the initial
//      state (both forms, 1e-7), and the chunked backward against the recurrent one (f32, 1e-5
//      relative);
//   4. a sequence split in two, the second half starting from the first half's final state and
//      its d(initial state) fed to the first half's backward as d(final state) (what context
//      parallelism does), against the whole run, forward and backward (f32, 1e-5);
//   5. bad operands: a one-line error naming the tensor and the expected shape;
//   6. grouped heads (q, k with Hk heads, v and the rest with Hv = r Hk; value head h reads key
//      head h / r): the op on grouped q/k against the same op on q/k repeat_interleave'd to Hv
//      heads (transformers' qwen3_next): out, final state, dv, dg, dbeta, d(initial state)
//      bitwise equal (the same arithmetic per value head), dq and dk the sums of the repeated
//      copies' gradients (f64 within 1e-12, f32 within 1e-6 relative), both forms, r = 2 and 3;
//      and the grouped backward against f64 central differences (1e-7).
// A broken kernel fails them (each variant below was built and run against these tests):
//  - exp(g_t) dropped from the recurrent step (S never decays): ChunkedMatchesRecurrentForward
//    (out differs by 0.22, final state by 1.0), MatchesPyTorchFloat64 (recurrent out 1.5
//    relative), and both backward tests; SplitSequenceMatchesWhole alone does not see it (the
//    split is consistent with the broken whole);
//  - the chunk's decay gamma_L dropped from the state advance only (S0 not decayed across a
//    chunk boundary): ChunkedMatchesRecurrentForward (final state 1.0), MatchesPyTorchFloat64
//    (chunk 16; at chunk 64 the fixture's T = 40 is one chunk and only the final state moves),
//    and the backward and split tests;
//  - one backward term dropped (dgamma_L += <dS_L, S0>): BackwardMatchesFiniteDifferences (dg),
//    MatchesPyTorchFloat64 (dg 7e-2), ChunkedBackwardMatchesRecurrent, SplitSequenceMatchesWhole.
// Grouped heads, the variants these tests are written to catch (the second was built and run:
// GroupedHeadsMatchRepeatedKeys failed dq and dk in all 32 of its configurations, and
// GroupedBackwardMatchesFiniteDifferences failed):
//  - a value head reading key head h % Hk (tiled, as torch's repeat / expand would) instead of
//    h / r (interleaved): GroupedHeadsMatchRepeatedKeys's out and final state (and every
//    gradient), GroupedBackwardMatchesFiniteDifferences; the Hk == Hv tests do not see it;
//  - dq / dk overwritten by every value head of a group (accumulate ignored, so only the last
//    copy's gradient survives) or never written by the first: GroupedHeadsMatchRepeatedKeys's
//    dq / dk and GroupedBackwardMatchesFiniteDifferences (q, k); the 1e30 fill of run_backward
//    shows a row no head wrote;
//  - the backward parallelised over value heads with the accumulation kept (two threads adding
//    to one dq row): a race, seen as GroupedHeadsMatchRepeatedKeys's dq / dk differing when the
//    two threads interleave (not deterministic: the kernel avoids it by construction).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include "loom/backend/backend.h"
#include "loom/checkpoint/safetensors.h"
#include "loom/core/error.h"
#include "loom/core/philox.h"
#include "strict_backend.h"
#include "test_util.h"

namespace loom {
namespace {

namespace fs = std::filesystem;
using test::error_of;
using test::max_rel_error;
using test::values;
using test::weighted_sum;

CpuAllocator& host() {
  static CpuAllocator allocator;
  return allocator;
}

struct Dims {
  int64_t B, T, H, dk, dv;
};

Tensor tensor_of(Shape shape, DType dtype, const std::vector<double>& x) {
  Tensor t = Tensor::empty(host(), std::move(shape), dtype, MEM_WORKSPACE);
  EXPECT_EQ(t.numel(), static_cast<int64_t>(x.size()));
  for (int64_t i = 0; i < t.numel(); ++i) {
    if (dtype == DTYPE_F64) t.data<double>()[i] = x[static_cast<size_t>(i)];
    else t.data<float>()[i] = static_cast<float>(x[static_cast<size_t>(i)]);
  }
  return t;
}

std::vector<double> uniform(int64_t n, uint64_t seed) {
  std::vector<float> u(static_cast<size_t>(n));
  philox_fill_uniform(u.data(), n, seed, 7, 0);
  return std::vector<double>(u.begin(), u.end());
}

// Rows of `width` normalised to unit length, times `scale`.
std::vector<double> unit_rows(int64_t rows, int64_t width, uint64_t seed, double scale) {
  std::vector<double> x = uniform(rows * width, seed);
  for (int64_t r = 0; r < rows; ++r) {
    double n = 0;
    for (int64_t i = 0; i < width; ++i) n += (x[r * width + i] - 0.5) * (x[r * width + i] - 0.5);
    for (int64_t i = 0; i < width; ++i) x[r * width + i] = (x[r * width + i] - 0.5) / std::sqrt(n) * scale;
  }
  return x;
}

struct Inputs {
  Dims d;
  Tensor q, k, v, g, beta, s0;
};

// What Qwen3-Next hands the op: q and k L2-normalised, q times 1/sqrt(d_k); g = -softplus(.) in
// about (-1.3, -0.05); beta = sigmoid(.) in about (0.12, 0.88); an initial state in [-0.5, 0.5).
Inputs make_inputs(const Dims& d, DType dtype, uint64_t seed) {
  const int64_t rows = d.B * d.T * d.H;
  Inputs in{d, {}, {}, {}, {}, {}, {}};
  in.q = tensor_of({d.B, d.T, d.H, d.dk}, dtype, unit_rows(rows, d.dk, seed, 1.0 / std::sqrt(double(d.dk))));
  in.k = tensor_of({d.B, d.T, d.H, d.dk}, dtype, unit_rows(rows, d.dk, seed + 1, 1.0));
  std::vector<double> v = uniform(rows * d.dv, seed + 2), g = uniform(rows, seed + 3), beta = uniform(rows, seed + 4);
  for (double& x : v) x = 2 * x - 1;
  for (double& x : g) x = -std::log1p(std::exp(4 * x - 3));
  for (double& x : beta) x = 1 / (1 + std::exp(-(4 * x - 2)));
  std::vector<double> s0 = uniform(d.B * d.H * d.dk * d.dv, seed + 5);
  for (double& x : s0) x = x - 0.5;
  in.v = tensor_of({d.B, d.T, d.H, d.dv}, dtype, v);
  in.g = tensor_of({d.B, d.T, d.H}, dtype, g);
  in.beta = tensor_of({d.B, d.T, d.H}, dtype, beta);
  in.s0 = tensor_of({d.B, d.H, d.dk, d.dv}, dtype, s0);
  return in;
}

Tensor random_like(const Tensor& t, uint64_t seed) {
  std::vector<double> x = uniform(t.numel(), seed);
  for (double& v : x) v = 2 * v - 1;
  return tensor_of(t.shape(), t.dtype(), x);
}

struct Forward {
  Tensor out, final_state;
};

Forward run_forward(Backend& be, const Inputs& in, bool with_initial, DeltaRuleForm form, int64_t chunk) {
  const Dims& d = in.d;
  Forward f{Tensor::empty(host(), {d.B, d.T, d.H, d.dv}, in.q.dtype(), MEM_WORKSPACE),
            Tensor::empty(host(), {d.B, d.H, d.dk, d.dv}, in.q.dtype(), MEM_WORKSPACE)};
  be.delta_rule_forward(in.q, in.k, in.v, in.g, in.beta, with_initial ? in.s0 : Tensor(), f.out, f.final_state, form,
                        chunk);
  return f;
}

struct Grads {
  Tensor dq, dk, dv, dg, dbeta, ds0;
};

// Every gradient starts as 1e30, so one the op did not overwrite shows.
Grads run_backward(Backend& be, const Inputs& in, bool with_initial, const Tensor& dout, const Tensor& dfinal,
                   DeltaRuleForm form, int64_t chunk) {
  const auto like = [&](const Tensor& t) {
    Tensor x = Tensor::empty(host(), t.shape(), t.dtype(), MEM_WORKSPACE);
    be.fill(x, 1e30);
    return x;
  };
  Grads r{like(in.q), like(in.k), like(in.v), like(in.g), like(in.beta), like(in.s0)};
  be.delta_rule_backward(in.q, in.k, in.v, in.g, in.beta, with_initial ? in.s0 : Tensor(), dout, dfinal, r.dq, r.dk,
                         r.dv, r.dg, r.dbeta, r.ds0, form, chunk);
  return r;
}

double max_abs_diff(const Tensor& a, const Tensor& b) {
  const std::vector<double> x = values(a), y = values(b);
  EXPECT_EQ(x.size(), y.size());
  double m = 0;
  for (size_t i = 0; i < std::min(x.size(), y.size()); ++i) m = std::max(m, std::abs(x[i] - y[i]));
  return m;
}

const char* form_name(DeltaRuleForm form) { return form == DeltaRuleForm::chunked ? "chunked" : "recurrent"; }

// Positions [t0, t1) of a (B, T, ...) tensor, copied.
Tensor slice_time(const Tensor& x, int64_t t0, int64_t t1) {
  Shape shape = x.shape();
  const int64_t T = shape[1], inner = x.numel() / (shape[0] * T);
  shape[1] = t1 - t0;
  Tensor out = Tensor::empty(host(), shape, x.dtype(), MEM_WORKSPACE);
  const size_t es = x.dtype() == DTYPE_F64 ? 8 : 4;
  for (int64_t b = 0; b < shape[0]; ++b) {
    std::memcpy(static_cast<char*>(out.raw_data()) + b * (t1 - t0) * inner * es,
                static_cast<const char*>(x.raw_data()) + (b * T + t0) * inner * es, (t1 - t0) * inner * es);
  }
  return out;
}

Inputs slice_inputs(const Inputs& in, int64_t t0, int64_t t1) {
  Inputs s = in;
  s.d.T = t1 - t0;
  s.q = slice_time(in.q, t0, t1), s.k = slice_time(in.k, t0, t1), s.v = slice_time(in.v, t0, t1);
  s.g = slice_time(in.g, t0, t1), s.beta = slice_time(in.beta, t0, t1);
  return s;
}

std::vector<std::pair<const char*, double>> grad_errors(const Grads& a, const Grads& b) {
  return {{"dq", max_rel_error(values(a.dq), values(b.dq))},       {"dk", max_rel_error(values(a.dk), values(b.dk))},
          {"dv", max_rel_error(values(a.dv), values(b.dv))},       {"dg", max_rel_error(values(a.dg), values(b.dg))},
          {"dbeta", max_rel_error(values(a.dbeta), values(b.dbeta))},
          {"dinitial_state", max_rel_error(values(a.ds0), values(b.ds0))}};
}

// Central differences (test_util.h's fd_worst_ratio), each within tol; returns the worst ratio.
double fd_check(const Tensor& x, const std::vector<double>& analytic, const std::function<double()>& loss, double tol,
                const std::string& what) {
  std::string at;
  const double worst = test::fd_worst_ratio(x, analytic, loss, &at);
  EXPECT_LE(worst, tol) << what << " " << at;
  return worst;
}

// Grouped heads: q and k (B, T, Hk, d) repeated to Hk r heads as transformers'
// repeat_interleave(r, dim=2) does (head h of the result = head h / r).
Tensor repeat_heads(const Tensor& x, int64_t r) {
  const int64_t B = x.dim(0), T = x.dim(1), Hk = x.dim(2), w = x.dim(3);
  const std::vector<double> in = values(x);
  std::vector<double> out(static_cast<size_t>(B * T * Hk * r * w));
  for (int64_t bt = 0; bt < B * T; ++bt) {
    for (int64_t h = 0; h < Hk * r; ++h) {
      for (int64_t i = 0; i < w; ++i) out[((bt * Hk * r + h) * w + i)] = in[((bt * Hk + h / r) * w + i)];
    }
  }
  return tensor_of({B, T, Hk * r, w}, x.dtype(), out);
}

// The gradient of the grouped tensor from the repeated one's: the r copies of each head summed
// (in copy order).
std::vector<double> sum_repeated(const Tensor& x, int64_t r) {
  const int64_t B = x.dim(0), T = x.dim(1), H = x.dim(2), w = x.dim(3), Hk = H / r;
  const std::vector<double> in = values(x);
  std::vector<double> out(static_cast<size_t>(B * T * Hk * w), 0.0);
  for (int64_t bt = 0; bt < B * T; ++bt) {
    for (int64_t h = 0; h < H; ++h) {
      for (int64_t i = 0; i < w; ++i) out[((bt * Hk + h / r) * w + i)] += in[((bt * H + h) * w + i)];
    }
  }
  return out;
}

// Inputs with Hv = d.H value heads and q, k of Hk heads (Hk divides d.H).
Inputs make_grouped_inputs(const Dims& d, int64_t Hk, DType dtype, uint64_t seed) {
  Inputs in = make_inputs(d, dtype, seed);
  const Inputs keys = make_inputs(Dims{d.B, d.T, Hk, d.dk, d.dv}, dtype, seed + 100);
  in.q = keys.q, in.k = keys.k;
  return in;
}

// fd_check of every input (q, k, v, g, beta, the initial state) of loss = sum dout o out + sum
// dfinal o final state against the op's backward (tolerance 1e-7); returns the worst ratio.
double fd_check_all(Backend& be, const Inputs& in, const Tensor& dout, const Tensor& dfinal, DeltaRuleForm form,
                    int64_t chunk, const std::string& what) {
  const Grads gr = run_backward(be, in, true, dout, dfinal, form, chunk);
  const auto loss = [&] {
    const Forward f = run_forward(be, in, true, form, chunk);
    return weighted_sum(f.out, dout) + weighted_sum(f.final_state, dfinal);
  };
  const std::vector<std::pair<const Tensor*, const Tensor*>> pairs{
      {&in.q, &gr.dq}, {&in.k, &gr.dk}, {&in.v, &gr.dv}, {&in.g, &gr.dg}, {&in.beta, &gr.dbeta}, {&in.s0, &gr.ds0}};
  const char* names[] = {"q", "k", "v", "g", "beta", "initial_state"};
  double worst = 0;
  for (size_t i = 0; i < pairs.size(); ++i) {
    worst = std::max(worst, fd_check(*pairs[i].first, values(*pairs[i].second), loss, 1e-7, what + names[i]));
  }
  return worst;
}

// ---- 1. chunked == recurrent, forward

TEST(DeltaRule, ChunkedMatchesRecurrentForward) {
  auto be = make_cpu_backend();
  double worst_out = 0, worst_state = 0;
  for (const Dims& d : {Dims{2, 37, 3, 16, 12}, Dims{1, 150, 2, 64, 32}}) {
    const Inputs in = make_inputs(d, DTYPE_F32, 11);
    for (bool with_initial : {false, true}) {
      const Forward rec = run_forward(*be, in, with_initial, DeltaRuleForm::recurrent, kDeltaRuleChunk);
      for (int64_t chunk : {int64_t{1}, int64_t{5}, int64_t{16}, kDeltaRuleChunk, int64_t{200}}) {
        const Forward ch = run_forward(*be, in, with_initial, DeltaRuleForm::chunked, chunk);
        const double eo = max_abs_diff(ch.out, rec.out), es = max_abs_diff(ch.final_state, rec.final_state);
        EXPECT_LE(eo, 1e-5) << "out, T " << d.T << " chunk " << chunk << " initial " << with_initial;
        EXPECT_LE(es, 1e-5) << "final state, T " << d.T << " chunk " << chunk << " initial " << with_initial;
        worst_out = std::max(worst_out, eo), worst_state = std::max(worst_state, es);
      }
    }
  }
  std::printf("[delta_rule] f32 chunked vs recurrent: out %.2e, final state %.2e (max abs)\n", worst_out, worst_state);
}

// ---- 2. against PyTorch's float64 recurrence

TEST(DeltaRule, MatchesPyTorchFloat64) {
  const char* source = std::getenv("LOOM_SOURCE_DIR");
  const fs::path path = (source && *source ? fs::path(source) : fs::current_path()) / "tests" / "fixtures" /
                        "delta_rule" / "delta_rule.safetensors";
  ASSERT_TRUE(fs::exists(path)) << path << " (tools/make_delta_rule_fixture.py writes it)";
  const SafetensorsFile f = SafetensorsFile::read(path.string());
  auto be = make_cpu_backend();
  const auto load = [&](const std::string& name, DType dtype) {
    const Tensor t = f.tensor(name, host(), MEM_WORKSPACE);
    if (dtype == DTYPE_F64) return t;
    Tensor c = Tensor::empty(host(), t.shape(), dtype, MEM_WORKSPACE);
    be->cast(t, c);
    return c;
  };
  const Shape qs = f.shape("q");
  const Dims d{qs[0], qs[1], qs[2], qs[3], f.shape("v")[3]};
  for (DType dtype : {DTYPE_F64, DTYPE_F32}) {
    const double tol = dtype == DTYPE_F64 ? 1e-10 : 1e-5;
    const Inputs in{d, load("q", dtype), load("k", dtype), load("v", dtype), load("g", dtype), load("beta", dtype),
                    load("initial_state", dtype)};
    const auto ref = [&](const char* name) { return test::values(f.tensor(name, host(), MEM_WORKSPACE)); };
    for (DeltaRuleForm form : {DeltaRuleForm::recurrent, DeltaRuleForm::chunked}) {
      for (int64_t chunk : {int64_t{16}, kDeltaRuleChunk}) {
        const std::string what = str_cat(dtype_name(dtype), " ", form_name(form), " chunk ", chunk);
        const Forward fw = run_forward(*be, in, true, form, chunk);
        const double eo = max_rel_error(values(fw.out), ref("out"));
        const double es = max_rel_error(values(fw.final_state), ref("final_state"));
        EXPECT_LT(eo, tol) << what << " out";
        EXPECT_LT(es, tol) << what << " final_state";
        const Forward zero = run_forward(*be, in, false, form, chunk);
        EXPECT_LT(max_rel_error(values(zero.out), ref("out_zero")), tol) << what << " out from a zero state";
        EXPECT_LT(max_rel_error(values(zero.final_state), ref("final_state_zero")), tol) << what;
        const Grads gr = run_backward(*be, in, true, load("dout", dtype), load("dfinal_state", dtype), form, chunk);
        const Grads want{load("dq", dtype), load("dk", dtype), load("dv", dtype), load("dg", dtype),
                         load("dbeta", dtype), load("dinitial_state", dtype)};
        double eg = 0;
        for (const auto& [name, e] : grad_errors(gr, want)) {
          EXPECT_LT(e, tol) << what << " " << name;
          eg = std::max(eg, e);
        }
        std::printf("[delta_rule] vs PyTorch f64, %s: out %.2e, final state %.2e, gradients %.2e (max rel)\n",
                    what.c_str(), eo, es, eg);
      }
    }
  }
}

// ---- 3. backward: finite differences, chunked == recurrent

TEST(DeltaRule, BackwardMatchesFiniteDifferences) {
  auto be = make_cpu_backend();
  const Dims d{2, 7, 2, 3, 2};
  const Inputs in = make_inputs(d, DTYPE_F64, 21);
  const Tensor dout = random_like(Tensor::empty(host(), {d.B, d.T, d.H, d.dv}, DTYPE_F64, MEM_WORKSPACE), 22);
  const Tensor dfinal = random_like(in.s0, 23);
  struct Run {
    DeltaRuleForm form;
    int64_t chunk;
  };
  double worst = 0;
  for (const Run& run : {Run{DeltaRuleForm::recurrent, 3}, Run{DeltaRuleForm::chunked, 3},
                         Run{DeltaRuleForm::chunked, 1}, Run{DeltaRuleForm::chunked, kDeltaRuleChunk}}) {
    worst = std::max(worst, fd_check_all(*be, in, dout, dfinal, run.form, run.chunk,
                                         str_cat(form_name(run.form), " chunk ", run.chunk, " d")));
  }
  std::printf("[delta_rule] f64 backward vs central differences: %.2e (max |fd - analytic| / max(1, |analytic|))\n",
              worst);
}

TEST(DeltaRule, ChunkedBackwardMatchesRecurrent) {
  auto be = make_cpu_backend();
  double worst = 0;
  {  // a longer sequence with wider heads: 150 positions, d_k 64, d_v 32, chunk 64
    const Dims big{1, 150, 2, 64, 32};
    const Inputs in = make_inputs(big, DTYPE_F32, 34);
    const Tensor dout = random_like(Tensor::empty(host(), {big.B, big.T, big.H, big.dv}, DTYPE_F32, MEM_WORKSPACE), 35);
    const Tensor dfinal = random_like(in.s0, 36);
    const Grads rec = run_backward(*be, in, true, dout, dfinal, DeltaRuleForm::recurrent, kDeltaRuleChunk);
    const Grads ch = run_backward(*be, in, true, dout, dfinal, DeltaRuleForm::chunked, kDeltaRuleChunk);
    for (const auto& [name, e] : grad_errors(ch, rec)) {
      EXPECT_LT(e, 1e-5) << "T " << big.T << " d_k " << big.dk << " " << name;
      worst = std::max(worst, e);
    }
  }
  const Dims d{2, 37, 3, 16, 12};
  const Inputs in = make_inputs(d, DTYPE_F32, 31);
  const Tensor dout = random_like(Tensor::empty(host(), {d.B, d.T, d.H, d.dv}, DTYPE_F32, MEM_WORKSPACE), 32);
  const Tensor dfinal = random_like(in.s0, 33);
  for (bool with_initial : {false, true}) {
    const Grads rec = run_backward(*be, in, with_initial, dout, dfinal, DeltaRuleForm::recurrent, kDeltaRuleChunk);
    // The recurrent form's chunk is only its checkpoint interval.
    const Grads rec1 = run_backward(*be, in, with_initial, dout, dfinal, DeltaRuleForm::recurrent, 1);
    for (const auto& [name, e] : grad_errors(rec1, rec)) EXPECT_LT(e, 1e-6) << "recurrent, checkpoints 1 " << name;
    for (int64_t chunk : {int64_t{1}, int64_t{5}, int64_t{16}, kDeltaRuleChunk}) {
      const Grads ch = run_backward(*be, in, with_initial, dout, dfinal, DeltaRuleForm::chunked, chunk);
      for (const auto& [name, e] : grad_errors(ch, rec)) {
        EXPECT_LT(e, 1e-5) << "chunk " << chunk << " initial " << with_initial << " " << name;
        worst = std::max(worst, e);
      }
    }
  }
  std::printf("[delta_rule] f32 chunked vs recurrent backward: %.2e (max rel)\n", worst);
  // An undefined dfinal_state is zeros; an undefined dinitial_state is not written.
  for (DeltaRuleForm form : {DeltaRuleForm::recurrent, DeltaRuleForm::chunked}) {
    const Tensor zeros = Tensor::zeros(host(), in.s0.shape(), DTYPE_F32, MEM_WORKSPACE);
    const Grads a = run_backward(*be, in, true, dout, zeros, form, 16);
    Grads b = run_backward(*be, in, true, dout, Tensor(), form, 16);
    for (const auto& [name, e] : grad_errors(a, b)) EXPECT_EQ(e, 0.0) << form_name(form) << " " << name;
    be->delta_rule_backward(in.q, in.k, in.v, in.g, in.beta, in.s0, dout, Tensor(), b.dq, b.dk, b.dv, b.dg, b.dbeta,
                            Tensor(), form, 16);
    EXPECT_EQ(max_rel_error(values(b.dq), values(a.dq)), 0.0);
  }
}

// ---- 4. a split sequence (context parallelism's pieces) equals the whole

TEST(DeltaRule, SplitSequenceMatchesWhole) {
  auto be = make_cpu_backend();
  const Dims d{2, 41, 2, 16, 8};
  const int64_t split = 17;
  const Inputs in = make_inputs(d, DTYPE_F32, 41);
  const Inputs first = slice_inputs(in, 0, split), second_in = slice_inputs(in, split, d.T);
  const Tensor dout = random_like(Tensor::empty(host(), {d.B, d.T, d.H, d.dv}, DTYPE_F32, MEM_WORKSPACE), 42);
  const Tensor dfinal = random_like(in.s0, 43);
  double worst_fwd = 0, worst_bwd = 0;
  for (DeltaRuleForm form : {DeltaRuleForm::recurrent, DeltaRuleForm::chunked}) {
    const int64_t chunk = 8;
    const Forward whole = run_forward(*be, in, true, form, chunk);
    const Forward a = run_forward(*be, first, true, form, chunk);
    Inputs second = second_in;
    second.s0 = a.final_state;  // the previous rank's final state
    const Forward b = run_forward(*be, second, true, form, chunk);
    const double e1 = max_abs_diff(a.out, slice_time(whole.out, 0, split));
    const double e2 = max_abs_diff(b.out, slice_time(whole.out, split, d.T));
    const double e3 = max_abs_diff(b.final_state, whole.final_state);
    EXPECT_LE(std::max({e1, e2, e3}), 1e-5) << form_name(form) << " forward " << e1 << " " << e2 << " " << e3;
    worst_fwd = std::max({worst_fwd, e1, e2, e3});

    // Backward: the second piece first, its d(initial state) is the first piece's d(final state).
    const Grads whole_g = run_backward(*be, in, true, dout, dfinal, form, chunk);
    const Grads gb = run_backward(*be, second, true, slice_time(dout, split, d.T), dfinal, form, chunk);
    const Grads ga = run_backward(*be, first, true, slice_time(dout, 0, split), gb.ds0, form, chunk);
    const auto check = [&](const Tensor& piece, const Tensor& whole_t, int64_t t0, int64_t t1, const char* name) {
      const double e = max_rel_error(values(piece), values(slice_time(whole_t, t0, t1)));
      EXPECT_LT(e, 1e-5) << form_name(form) << " " << name << " [" << t0 << ", " << t1 << ")";
      worst_bwd = std::max(worst_bwd, e);
    };
    check(ga.dq, whole_g.dq, 0, split, "dq"), check(gb.dq, whole_g.dq, split, d.T, "dq");
    check(ga.dk, whole_g.dk, 0, split, "dk"), check(gb.dk, whole_g.dk, split, d.T, "dk");
    check(ga.dv, whole_g.dv, 0, split, "dv"), check(gb.dv, whole_g.dv, split, d.T, "dv");
    check(ga.dg, whole_g.dg, 0, split, "dg"), check(gb.dg, whole_g.dg, split, d.T, "dg");
    check(ga.dbeta, whole_g.dbeta, 0, split, "dbeta"), check(gb.dbeta, whole_g.dbeta, split, d.T, "dbeta");
    const double es = max_rel_error(values(ga.ds0), values(whole_g.ds0));
    EXPECT_LT(es, 1e-5) << form_name(form) << " dinitial_state";
    worst_bwd = std::max(worst_bwd, es);
  }
  std::printf("[delta_rule] f32 split at %lld of %lld vs whole: forward %.2e (max abs), backward %.2e (max rel)\n",
              static_cast<long long>(split), static_cast<long long>(d.T), worst_fwd, worst_bwd);
}

// ---- 5. bad operands

TEST(DeltaRule, BadShapesAreOneLineErrors) {
  auto be = make_cpu_backend();
  const Dims d{1, 5, 2, 8, 3};
  const Inputs in = make_inputs(d, DTYPE_F32, 51);
  const Forward ok = run_forward(*be, in, true, DeltaRuleForm::chunked, 4);
  const auto forward_error = [&](const Tensor& k, const Tensor& beta, const Tensor& s0, int64_t chunk) {
    const std::string e = error_of([&] {
      be->delta_rule_forward(in.q, k, in.v, in.g, beta, s0, ok.out, ok.final_state, DeltaRuleForm::chunked, chunk);
    });
    EXPECT_EQ(e.find('\n'), std::string::npos) << e;
    return e;
  };
  const Tensor k7 = Tensor::empty(host(), {1, 5, 2, 7}, DTYPE_F32, MEM_WORKSPACE);
  EXPECT_EQ(forward_error(k7, in.beta, in.s0, 4),
            "delta_rule_forward: k is f32(1, 5, 2, 7), expected f32(1, 5, 2, 8) (B, T, Hk, d_k)");
  const Tensor s0 = Tensor::empty(host(), {1, 2, 3, 8}, DTYPE_F32, MEM_WORKSPACE);  // d_v and d_k swapped
  EXPECT_EQ(forward_error(in.k, in.beta, s0, 4),
            "delta_rule_forward: initial_state is f32(1, 2, 3, 8), expected f32(1, 2, 8, 3) (B, Hv, d_k, d_v)");
  const Tensor beta64 = Tensor::empty(host(), {1, 5, 2}, DTYPE_F64, MEM_WORKSPACE);
  EXPECT_EQ(forward_error(in.k, beta64, in.s0, 4),
            "delta_rule_forward: beta is f64(1, 5, 2), expected f32(1, 5, 2) (B, T, Hv)");
  EXPECT_EQ(forward_error(in.k, in.beta, in.s0, 0), "delta_rule_forward: chunk 0 must be >= 1");
  EXPECT_THROW(
      be->delta_rule_forward(in.q, k7, in.v, in.g, in.beta, in.s0, ok.out, ok.final_state, DeltaRuleForm::recurrent, 4),
      Error);
  // The backward: a dg of the wrong length.
  const Grads gr = run_backward(*be, in, true, ok.out, ok.final_state, DeltaRuleForm::chunked, 4);
  const Tensor dg = Tensor::empty(host(), {1, 4, 2}, DTYPE_F32, MEM_WORKSPACE);
  const std::string e = error_of([&] {
    be->delta_rule_backward(in.q, in.k, in.v, in.g, in.beta, in.s0, ok.out, ok.final_state, gr.dq, gr.dk, gr.dv, dg,
                            gr.dbeta, gr.ds0, DeltaRuleForm::chunked, 4);
  });
  EXPECT_EQ(e, "delta_rule_backward: dg is f32(1, 4, 2), expected f32(1, 5, 2) (B, T, Hv)");
  // Grouped heads: v's heads must be a multiple of q's; with Hv = 4 over Hk = 2 the states have
  // Hv heads and dq keeps q's shape.
  const Tensor v3 = Tensor::empty(host(), {1, 5, 3, 3}, DTYPE_F32, MEM_WORKSPACE);
  EXPECT_EQ(error_of([&] {
              be->delta_rule_forward(in.q, in.k, v3, in.g, in.beta, Tensor(), ok.out, Tensor(), DeltaRuleForm::chunked,
                                     4);
            }),
            "delta_rule_forward: v is f32(1, 5, 3, 3), expected f32(1, 5, Hv, d_v) (B, T, Hv, d_v) with Hv a "
            "multiple of q's 2 heads");
  const Inputs grouped = make_grouped_inputs(Dims{1, 5, 4, 8, 3}, 2, DTYPE_F32, 52);
  const Forward gok = run_forward(*be, grouped, true, DeltaRuleForm::recurrent, 4);
  EXPECT_EQ(error_of([&] {
              be->delta_rule_forward(grouped.q, grouped.k, grouped.v, grouped.g, grouped.beta, in.s0, gok.out,
                                     gok.final_state, DeltaRuleForm::recurrent, 4);
            }),
            "delta_rule_forward: initial_state is f32(1, 2, 8, 3), expected f32(1, 4, 8, 3) (B, Hv, d_k, d_v)");
  const Tensor dq_wide = Tensor::empty(host(), {1, 5, 4, 8}, DTYPE_F32, MEM_WORKSPACE);  // Hv heads, not Hk
  const Grads gg = run_backward(*be, grouped, true, gok.out, gok.final_state, DeltaRuleForm::recurrent, 4);
  EXPECT_EQ(error_of([&] {
              be->delta_rule_backward(grouped.q, grouped.k, grouped.v, grouped.g, grouped.beta, grouped.s0, gok.out,
                                      gok.final_state, dq_wide, gg.dk, gg.dv, gg.dg, gg.dbeta, gg.ds0,
                                      DeltaRuleForm::recurrent, 4);
            }),
            "delta_rule_backward: dq is f32(1, 5, 4, 8), expected f32(1, 5, 2, 8) (B, T, Hk, d_k)");
  // bf16 operands: the dtype dispatch's error.
  const Tensor q16 = Tensor::empty(host(), in.q.shape(), DTYPE_BF16, MEM_WORKSPACE);
  const Tensor k16 = Tensor::empty(host(), in.q.shape(), DTYPE_BF16, MEM_WORKSPACE);
  const Tensor v16 = Tensor::empty(host(), in.v.shape(), DTYPE_BF16, MEM_WORKSPACE);
  const Tensor g16 = Tensor::empty(host(), in.g.shape(), DTYPE_BF16, MEM_WORKSPACE);
  const Tensor o16 = Tensor::empty(host(), in.v.shape(), DTYPE_BF16, MEM_WORKSPACE);
  EXPECT_EQ(error_of([&] {
              be->delta_rule_forward(q16, k16, v16, g16, g16, Tensor(), o16, Tensor(), DeltaRuleForm::chunked, 4);
            }),
            "delta_rule_forward: not supported for dtype bf16 on the CPU backend (f32, f64)");
}

// ---- 6. grouped heads: equal to the op on repeat_interleave'd q / k

TEST(DeltaRule, GroupedHeadsMatchRepeatedKeys) {
  auto be = make_cpu_backend();
  struct Case {
    Dims d;  // d.H: the value heads
    int64_t Hk;
  };
  double worst_qk[2] = {0, 0};  // f64, f32
  for (DType dtype : {DTYPE_F64, DTYPE_F32}) {
    const double tol = dtype == DTYPE_F64 ? 1e-12 : 1e-6;
    const int di = dtype == DTYPE_F64 ? 0 : 1;
    for (const Case& cs : {Case{Dims{2, 37, 4, 16, 12}, 2}, Case{Dims{1, 23, 3, 8, 5}, 1}}) {
      const int64_t r = cs.d.H / cs.Hk;
      const Inputs grouped = make_grouped_inputs(cs.d, cs.Hk, dtype, 71);
      Inputs repeated = grouped;
      repeated.q = repeat_heads(grouped.q, r), repeated.k = repeat_heads(grouped.k, r);
      const Tensor dout = random_like(Tensor::empty(host(), grouped.v.shape(), dtype, MEM_WORKSPACE), 72);
      const Tensor dfinal = random_like(grouped.s0, 73);
      for (DeltaRuleForm form : {DeltaRuleForm::recurrent, DeltaRuleForm::chunked}) {
        for (int64_t chunk : {int64_t{5}, kDeltaRuleChunk}) {
          for (bool with_initial : {false, true}) {
            const std::string what = str_cat(dtype_name(dtype), " Hk ", cs.Hk, " Hv ", cs.d.H, " ", form_name(form),
                                             " chunk ", chunk, " initial ", with_initial, " ");
            const Forward fg = run_forward(*be, grouped, with_initial, form, chunk);
            const Forward fr = run_forward(*be, repeated, with_initial, form, chunk);
            EXPECT_EQ(values(fg.out), values(fr.out)) << what << "out";
            EXPECT_EQ(values(fg.final_state), values(fr.final_state)) << what << "final state";
            const Grads gg = run_backward(*be, grouped, with_initial, dout, dfinal, form, chunk);
            const Grads gr = run_backward(*be, repeated, with_initial, dout, dfinal, form, chunk);
            EXPECT_EQ(values(gg.dv), values(gr.dv)) << what << "dv";
            EXPECT_EQ(values(gg.dg), values(gr.dg)) << what << "dg";
            EXPECT_EQ(values(gg.dbeta), values(gr.dbeta)) << what << "dbeta";
            EXPECT_EQ(values(gg.ds0), values(gr.ds0)) << what << "dinitial_state";
            const double eq = max_rel_error(values(gg.dq), sum_repeated(gr.dq, r));
            const double ek = max_rel_error(values(gg.dk), sum_repeated(gr.dk, r));
            EXPECT_LT(eq, tol) << what << "dq";
            EXPECT_LT(ek, tol) << what << "dk";
            worst_qk[di] = std::max({worst_qk[di], eq, ek});
          }
        }
      }
    }
  }
  std::printf("[delta_rule] grouped vs repeated q/k: out, state, dv, dg, dbeta, dstate equal; dq/dk vs summed "
              "copies %.2e (f64), %.2e (f32) (max rel)\n",
              worst_qk[0], worst_qk[1]);
}

TEST(DeltaRule, GroupedBackwardMatchesFiniteDifferences) {
  auto be = make_cpu_backend();
  const Dims d{1, 6, 4, 3, 2};  // Hv = 4 value heads over Hk = 2 key heads
  const Inputs in = make_grouped_inputs(d, 2, DTYPE_F64, 81);
  const Tensor dout = random_like(Tensor::empty(host(), {d.B, d.T, d.H, d.dv}, DTYPE_F64, MEM_WORKSPACE), 82);
  const Tensor dfinal = random_like(in.s0, 83);
  double worst = 0;
  for (DeltaRuleForm form : {DeltaRuleForm::recurrent, DeltaRuleForm::chunked}) {
    const int64_t chunk = 4;
    worst = std::max(worst, fd_check_all(*be, in, dout, dfinal, form, chunk, str_cat("grouped ", form_name(form), " d")));
  }
  std::printf("[delta_rule] f64 grouped (Hk 2, Hv 4) backward vs central differences: %.2e\n", worst);
}

// ---- The strict backend (tests/strict_backend.h) forwards both ops to the CPU kernels.

TEST(DeltaRule, StrictBackendRunsTheCpuKernels) {
  auto cpu = make_cpu_backend();
  test::StrictBackend strict;
  const Dims d{1, 9, 2, 4, 3};
  const Inputs in = make_inputs(d, DTYPE_F32, 61);
  const auto upload = [&](const Tensor& t) {
    Tensor x = Tensor::empty(strict.allocator(), t.shape(), t.dtype(), MEM_WORKSPACE);
    strict.write(x, t.raw_data());
    return x;
  };
  const Inputs dev{d, upload(in.q), upload(in.k), upload(in.v), upload(in.g), upload(in.beta), upload(in.s0)};
  const Forward want = run_forward(*cpu, in, true, DeltaRuleForm::chunked, 4);
  const Tensor out = Tensor::empty(strict.allocator(), want.out.shape(), DTYPE_F32, MEM_WORKSPACE);
  const Tensor fin = Tensor::empty(strict.allocator(), want.final_state.shape(), DTYPE_F32, MEM_WORKSPACE);
  strict.delta_rule_forward(dev.q, dev.k, dev.v, dev.g, dev.beta, dev.s0, out, fin, DeltaRuleForm::chunked, 4);
  EXPECT_EQ(values(strict, out), values(want.out));
  EXPECT_EQ(values(strict, fin), values(want.final_state));
  const Grads gw = run_backward(*cpu, in, true, want.out, want.final_state, DeltaRuleForm::recurrent, 4);
  const Grads gd{upload(gw.dq), upload(gw.dk), upload(gw.dv), upload(gw.dg), upload(gw.dbeta), upload(gw.ds0)};
  strict.fill(gd.dq, 0.0);
  strict.delta_rule_backward(dev.q, dev.k, dev.v, dev.g, dev.beta, dev.s0, upload(want.out), upload(want.final_state),
                             gd.dq, gd.dk, gd.dv, gd.dg, gd.dbeta, gd.ds0, DeltaRuleForm::recurrent, 4);
  EXPECT_EQ(values(strict, gd.dq), values(gw.dq));
  EXPECT_EQ(values(strict, gd.ds0), values(gw.ds0));
}

}  // namespace
}  // namespace loom
