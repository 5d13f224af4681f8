// Gated DeltaNet (nn/linear_attention.h), Qwen3-Next's linear-attention sub-layer: every
// gradient (input, the eight parameters, the state before the span) against central finite
// differences in f64, and a sequence run in two spans, the second from the first's state, equal
// to the whole run (what decoding and context parallelism carry).
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "loom/backend/backend.h"
#include "loom/comm/communicator.h"
#include "loom/nn/linear_attention.h"
#include "test_util.h"

namespace loom {
namespace {

struct Fixture {
  GatedDeltaNetShape shape{2, 4, 4, 3, 4};  // H_k 2, H_v 4, d_k 4, d_v 3, K 4
  int64_t B = 2, T = 7, C = 8;
  std::unique_ptr<Backend> be = make_cpu_backend();
  ModelConfig config;
  GatedDeltaNetParams p, g;
  std::vector<Tensor*> params() { return {&p.norm_w, &p.qkvz_w, &p.ba_w, &p.conv_w, &p.a_log, &p.dt_bias, &p.gate_norm_w, &p.out_w}; }
  std::vector<Tensor*> grads() { return {&g.norm_w, &g.qkvz_w, &g.ba_w, &g.conv_w, &g.a_log, &g.dt_bias, &g.gate_norm_w, &g.out_w}; }

  Fixture() {
    config = model_preset("llama-tiny");
    config.d_model = C;
    Allocator& a = be->allocator();
    const GatedDeltaNetShape& s = shape;
    const std::vector<Shape> shapes = {{C}, {s.qkvz_width(), C}, {2 * s.value_heads, C}, {s.conv_width(), s.conv_taps},
                                       {s.value_heads}, {s.value_heads}, {s.value_dim}, {C, s.v_width()}};
    const std::vector<double> scales = {0.2, 0.4, 0.4, 0.4, 0.5, 0.3, 0.2, 0.3};
    const std::vector<double> offsets = {1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 1.0, 0.0};  // norms near 1, A_log near 1
    const std::vector<Tensor*> ps = params(), gs = grads();
    for (size_t i = 0; i < ps.size(); ++i) {
      *ps[i] = test::random_tensor(a, shapes[i], DTYPE_F64, 10 + i, scales[i]);
      for (int64_t j = 0; j < ps[i]->numel(); ++j) ps[i]->data<double>()[j] += offsets[i];
      *gs[i] = Tensor::zeros(a, shapes[i], DTYPE_F64, MEM_GRADIENTS);
    }
  }
  GatedDeltaNet layer() { return GatedDeltaNet(config, shape, p, g); }
  Tensor zeros(Shape dims) { return Tensor::zeros(be->allocator(), std::move(dims), DTYPE_F64, MEM_WORKSPACE); }
};

// Also for a span shorter than the conv's K-1 = 3 taps (T = 2), whose final conv state holds rows
// of the initial one.
class GatedDeltaNetSpans : public ::testing::TestWithParam<int64_t> {};

TEST_P(GatedDeltaNetSpans, GradientsMatchFiniteDifferences) {
  Fixture f;
  f.T = GetParam();
  const GatedDeltaNetShape& s = f.shape;
  Allocator& a = f.be->allocator();
  const Tensor x = test::random_tensor(a, {f.B, f.T, f.C}, DTYPE_F64, 3, 0.8);
  const Tensor w = test::random_tensor(a, {f.B, f.T, f.C}, DTYPE_F64, 4);  // loss = sum w o out
  LinearAttentionState in{test::random_tensor(a, {f.B, s.conv_taps - 1, s.conv_width()}, DTYPE_F64, 5, 0.5),
                          test::random_tensor(a, {f.B, s.value_heads, s.key_dim, s.value_dim}, DTYPE_F64, 6, 0.3)};
  const LinearAttentionState out_state{f.zeros({f.B, s.conv_taps - 1, s.conv_width()}),
                                       f.zeros({f.B, s.value_heads, s.key_dim, s.value_dim})};
  const Tensor dw_state = test::random_tensor(a, {f.B, s.value_heads, s.key_dim, s.value_dim}, DTYPE_F64, 7);
  const Tensor dw_conv = test::random_tensor(a, {f.B, s.conv_taps - 1, s.conv_width()}, DTYPE_F64, 8);
  GatedDeltaNetSaved saved = allocate_gated_delta_net_saved(a, s, f.B, f.T, f.C, DTYPE_F64);
  const Tensor out = f.zeros({f.B, f.T, f.C});
  // loss = sum w o out + sum dw o final state (the final conv and delta states' gradients enter too)
  const auto loss = [&] {
    f.layer().forward(*f.be, x, saved, out, in, out_state);
    return test::weighted_sum(out, w) + test::weighted_sum(out_state.delta, dw_state) +
           test::weighted_sum(out_state.conv, dw_conv);
  };
  loss();
  const Tensor d = f.zeros({f.B, f.T, f.C});
  f.be->copy(w, d);
  const LinearAttentionState d_in{f.zeros({f.B, s.conv_taps - 1, s.conv_width()}),
                                  f.zeros({f.B, s.value_heads, s.key_dim, s.value_dim})};
  f.layer().backward(*f.be, x, saved, d, in, LinearAttentionState{dw_conv, dw_state}, d_in);
  const double tol = 1e-6;
  test::expect_gradient_matches(x, test::values(d), loss, tol, "x");
  const std::vector<const char*> names = {"norm_w", "qkvz_w", "ba_w", "conv_w", "a_log", "dt_bias", "gate_norm_w", "out_w"};
  const std::vector<Tensor*> ps = f.params(), gs = f.grads();
  for (size_t i = 0; i < ps.size(); ++i) test::expect_gradient_matches(*ps[i], test::values(*gs[i]), loss, tol, names[i]);
  test::expect_gradient_matches(in.conv, test::values(d_in.conv), loss, tol, "initial conv state");
  test::expect_gradient_matches(in.delta, test::values(d_in.delta), loss, tol, "initial delta state");
}

INSTANTIATE_TEST_SUITE_P(Lengths, GatedDeltaNetSpans, ::testing::Values(7, 2));

TEST(GatedDeltaNet, TwoSpansFromTheCarriedStateEqualTheWhole) {
  Fixture f;
  const GatedDeltaNetShape& s = f.shape;
  Allocator& a = f.be->allocator();
  const int64_t B = 1, T = 9, split = 4;
  const Tensor x = test::random_tensor(a, {B, T, f.C}, DTYPE_F64, 3, 0.8);
  GatedDeltaNetSaved whole_saved = allocate_gated_delta_net_saved(a, s, B, T, f.C, DTYPE_F64);
  const Tensor whole = f.zeros({B, T, f.C});
  f.layer().forward(*f.be, x, whole_saved, whole);
  const LinearAttentionState mid{f.zeros({B, s.conv_taps - 1, s.conv_width()}),
                                 f.zeros({B, s.value_heads, s.key_dim, s.value_dim})};
  std::vector<double> pieces;
  for (const auto& [first, n] : {std::pair<int64_t, int64_t>{0, split}, {split, T - split}}) {
    const Tensor xs = f.zeros({B, n, f.C}), out = f.zeros({B, n, f.C});
    f.be->copy(x.view(first * f.C, {B, n, f.C}), xs);
    GatedDeltaNetSaved saved = allocate_gated_delta_net_saved(a, s, B, n, f.C, DTYPE_F64);
    if (first == 0) {
      f.layer().forward(*f.be, xs, saved, out, {}, mid);
    } else {
      f.layer().forward(*f.be, xs, saved, out, mid, {});
    }
    const std::vector<double> v = test::values(out);
    pieces.insert(pieces.end(), v.begin(), v.end());
  }
  EXPECT_LT(test::max_rel_error(pieces, test::values(whole)), 1e-12);
  // Starting the second span from zeros instead is far from it: the state carries the past.
  GatedDeltaNetSaved saved = allocate_gated_delta_net_saved(a, s, B, T - split, f.C, DTYPE_F64);
  const Tensor xs = f.zeros({B, T - split, f.C}), out = f.zeros({B, T - split, f.C});
  f.be->copy(x.view(split * f.C, {B, T - split, f.C}), xs);
  f.layer().forward(*f.be, xs, saved, out);
  const std::vector<double> tail(pieces.begin() + split * f.C, pieces.end());
  EXPECT_GT(test::max_rel_error(test::values(out), tail), 1e-3);
}

// The context-parallel path on a cp group of one rank: its two chunks run as spans, the state
// relayed from the first to the second, d(state) back: the same output, input gradient and
// parameter gradients as the whole sequence at once.
TEST(GatedDeltaNet, ContextParallelSpansOfOneRankEqualTheWhole) {
  Fixture f;
  const GatedDeltaNetShape& s = f.shape;
  Allocator& a = f.be->allocator();
  const int64_t B = 2, T = 10;
  const Tensor x = test::random_tensor(a, {B, T, f.C}, DTYPE_F64, 3, 0.8);
  const Tensor w = test::random_tensor(a, {B, T, f.C}, DTYPE_F64, 4);
  std::vector<std::vector<double>> outs, dxs, grads;
  auto comm = make_local_communicator();
  ContextParallel cp;
  cp.comm = comm.get();
  for (const bool spans : {false, true}) {
    for (Tensor* g : f.grads()) g->zero_();
    GatedDeltaNet layer = f.layer();
    if (spans) layer.set_context_parallel(&cp);
    GatedDeltaNetSaved saved;
    gated_delta_net_saved_fields(s, B, T, f.C, saved, [&](Tensor& field, Shape dims, DType dt) {
      field = Tensor::zeros(a, std::move(dims), dt, MEM_ACTIVATIONS);
    }, DTYPE_F64, spans);
    const Tensor out = f.zeros({B, T, f.C}), d = f.zeros({B, T, f.C});
    layer.forward(*f.be, x, saved, out);
    f.be->copy(w, d);
    layer.backward(*f.be, x, saved, d);
    outs.push_back(test::values(out));
    dxs.push_back(test::values(d));
    std::vector<double> all;
    for (Tensor* g : f.grads()) {
      const std::vector<double> v = test::values(*g);
      all.insert(all.end(), v.begin(), v.end());
    }
    grads.push_back(all);
  }
  EXPECT_LT(test::max_rel_error(outs[1], outs[0]), 1e-12);
  EXPECT_LT(test::max_rel_error(dxs[1], dxs[0]), 1e-12);
  EXPECT_LT(test::max_rel_error(grads[1], grads[0]), 1e-12);
}

}  // namespace
}  // namespace loom
