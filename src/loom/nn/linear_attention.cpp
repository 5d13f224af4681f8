#include "loom/nn/linear_attention.h"

#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>

#include "loom/core/error.h"
#include "loom/nn/linear.h"

namespace loom {

namespace {

// transformers' l2norm eps (x rsqrt(sum x^2 + 1e-6)) as head_rmsnorm's (mean x^2 + eps / d).
constexpr double kL2Eps = 1e-6;

Tensor rows2d(const Tensor& t, int64_t cols) { return t.view(0, {t.numel() / cols, cols}); }

// Columns [col, col + cols) of src (rows x src_width) into columns [dst_col, ...) of dst (rows x dst_width).
void copy_cols(Backend& backend, const Tensor& src, int64_t src_width, int64_t src_col, const Tensor& dst,
               int64_t dst_width, int64_t dst_col, int64_t rows, int64_t cols) {
  BlockCopy b;
  b.rows = rows, b.cols = cols;
  b.src_col = src_col, b.src_stride = src_width;
  b.dst_col = dst_col, b.dst_stride = dst_width;
  backend.copy_block(src, dst, b);
}

}  // namespace

GatedDeltaNetShape gated_delta_net_shape(const ModelConfig& c) {
  return {c.linear_key_heads, c.linear_value_heads, c.linear_key_dim, c.linear_value_dim, c.linear_conv_taps};
}

void gated_delta_net_saved_fields(const GatedDeltaNetShape& sh, int64_t B, int64_t T, int64_t C, GatedDeltaNetSaved& s,
                                  const SavedFieldFn& f, DType dt) {
  const int64_t N = B * T, Hk = sh.key_heads, Hv = sh.value_heads, dk = sh.key_dim, dv = sh.value_dim;
  f(s.norm.out, {B, T, C}, dt), f(s.norm.rstd, {B, T}, dt);
  f(s.qkvz, {N, sh.qkvz_width()}, dt), f(s.ba, {N, 2 * Hv}, dt);
  f(s.mixed, {B, T, sh.conv_width()}, dt);
  f(s.q, {B, T, Hk, dk}, dt), f(s.k, {B, T, Hk, dk}, dt), f(s.v, {B, T, Hv, dv}, dt);
  f(s.q_in, {N * Hk * dk}, dt), f(s.q_rstd, {N * Hk}, dt), f(s.k_in, {N * Hk * dk}, dt), f(s.k_rstd, {N * Hk}, dt);
  f(s.g, {B, T, Hv}, dt), f(s.beta, {B, T, Hv}, dt);
  f(s.gated, {N * Hv, 2 * dv}, dt);
  f(s.gate_in, {N * Hv * dv}, dt), f(s.gate_rstd, {N * Hv}, dt);
  f(s.act, {N, sh.v_width()}, dt);
}

GatedDeltaNetSaved allocate_gated_delta_net_saved(Allocator& allocator, const GatedDeltaNetShape& sh, int64_t B,
                                                  int64_t T, int64_t C, DType dtype) {
  GatedDeltaNetSaved s;
  gated_delta_net_saved_fields(sh, B, T, C, s, [&](Tensor& field, Shape dims, DType dt) {
    field = Tensor::empty(allocator, std::move(dims), dt, MEM_ACTIVATIONS);
  }, dtype);
  return s;
}

GatedDeltaNet::GatedDeltaNet(const ModelConfig& config, const GatedDeltaNetShape& shape, GatedDeltaNetParams params,
                             GatedDeltaNetParams grads)
    : config_(config), shape_(shape), params_(std::move(params)), grads_(std::move(grads)) {
  LOOM_CHECK(shape.key_heads >= 1 && shape.value_heads % shape.key_heads == 0 && shape.key_dim >= 1 &&
                 shape.value_dim >= 1 && shape.conv_taps >= 1,
             "gated DeltaNet: value heads (", shape.value_heads, ") must be a multiple of key heads (", shape.key_heads,
             ") and the widths >= 1");
}

Tensor GatedDeltaNet::l2_weight(Backend& backend, bool query) const {
  const int64_t dk = shape_.key_dim;
  const Tensor w = Tensor::empty(backend.allocator(), {dk}, params_.qkvz_w.dtype(), MEM_WORKSPACE);
  backend.fill(w, query ? 1.0 / static_cast<double>(dk) : 1.0 / std::sqrt(static_cast<double>(dk)));
  return w;
}

void GatedDeltaNet::forward(Backend& be, const Tensor& x, GatedDeltaNetSaved& s, const Tensor& out,
                            const LinearAttentionState& in, const LinearAttentionState& out_state) const {
  const GatedDeltaNetParams& p = params_;
  const GatedDeltaNetShape& sh = shape_;
  const int64_t B = x.dim(0), T = x.dim(1), C = x.dim(2), N = B * T;
  const int64_t Hk = sh.key_heads, Hv = sh.value_heads, dk = sh.key_dim, dv = sh.value_dim;
  const int64_t Dq = sh.qk_width(), Dv = sh.v_width(), Dc = sh.conv_width(), W = sh.qkvz_width();
  const DType dt = x.dtype();
  Allocator& a = be.allocator();

  norm_forward(be, config_, x, p.norm_w, Tensor{}, s.norm.out, Tensor{}, s.norm.rstd);
  const Tensor h = rows2d(s.norm.out, C);
  linear_forward(be, h, p.qkvz_w, Tensor{}, s.qkvz);
  linear_forward(be, h, p.ba_w, Tensor{}, s.ba);
  copy_cols(be, s.qkvz, W, 0, rows2d(s.mixed, Dc), Dc, 0, N, Dc);
  const Tensor conv = Tensor::empty(a, {B, T, Dc}, dt, MEM_WORKSPACE);
  be.causal_conv1d_silu_forward(s.mixed, p.conv_w, in.conv, conv, out_state.conv);
  const Tensor c2 = rows2d(conv, Dc);
  copy_cols(be, c2, Dc, 0, rows2d(s.q, Dq), Dq, 0, N, Dq);
  copy_cols(be, c2, Dc, Dq, rows2d(s.k, Dq), Dq, 0, N, Dq);
  copy_cols(be, c2, Dc, 2 * Dq, rows2d(s.v, Dv), Dv, 0, N, Dv);
  const double eps = kL2Eps / static_cast<double>(dk);
  be.head_rmsnorm_forward(rows2d(s.q, Dq), l2_weight(be, true), 0, Hk, dk, static_cast<float>(eps), s.q_in, s.q_rstd);
  be.head_rmsnorm_forward(rows2d(s.k, Dq), l2_weight(be, false), 0, Hk, dk, static_cast<float>(eps), s.k_in, s.k_rstd);
  be.delta_gates_forward(s.ba, p.a_log, p.dt_bias, rows2d(s.g, Hv), rows2d(s.beta, Hv));
  const Tensor o = Tensor::empty(a, {B, T, Hv, dv}, dt, MEM_WORKSPACE);
  be.delta_rule_forward(s.q, s.k, s.v, s.g, s.beta, in.delta, o, out_state.delta, DeltaRuleForm::chunked,
                        kDeltaRuleChunk);
  // [z | o] per value head, normed o times w times silu(z).
  const Tensor gated = rows2d(s.gated, Hv * 2 * dv), o2 = rows2d(o, Dv);
  for (int64_t hv = 0; hv < Hv; ++hv) {
    copy_cols(be, s.qkvz, W, Dc + hv * dv, gated, Hv * 2 * dv, hv * 2 * dv, N, dv);
    copy_cols(be, o2, Dv, hv * dv, gated, Hv * 2 * dv, hv * 2 * dv + dv, N, dv);
  }
  be.head_rmsnorm_forward(s.gated, p.gate_norm_w, 1, 1, dv, config_.norm_eps, s.gate_in, s.gate_rstd);
  be.glu_forward(s.gated, s.act.view(0, {N * Hv, dv}), GateActivation::silu);
  be.copy(x, out);
  linear_forward(be, s.act, p.out_w, Tensor{}, rows2d(out, C), 1.0f);
}

void GatedDeltaNet::backward(Backend& be, const Tensor& x, const GatedDeltaNetSaved& s, const Tensor& d_residual,
                             const LinearAttentionState& in, const LinearAttentionState& d_out_state,
                             const LinearAttentionState& d_in) const {
  const GatedDeltaNetParams& p = params_;
  const GatedDeltaNetParams& g = grads_;
  const GatedDeltaNetShape& sh = shape_;
  const int64_t B = x.dim(0), T = x.dim(1), C = x.dim(2), N = B * T;
  const int64_t Hk = sh.key_heads, Hv = sh.value_heads, dk = sh.key_dim, dv = sh.value_dim;
  const int64_t Dq = sh.qk_width(), Dv = sh.v_width(), Dc = sh.conv_width(), W = sh.qkvz_width();
  const DType dt = x.dtype();
  Allocator& a = be.allocator();
  const auto scratch = [&](Shape dims) { return Tensor::empty(a, std::move(dims), dt, MEM_WORKSPACE); };

  // out = x + act W_out^T
  const Tensor d_act = scratch({N, Dv});
  linear_backward(be, s.act, p.out_w, rows2d(d_residual, C), d_act, g.out_w, Tensor{});
  // act = silu(z) * (rmsnorm(o) w): d[z | o] per value head
  const Tensor d_gated = scratch({N * Hv, 2 * dv});
  be.glu_backward(s.gated, d_act.view(0, {N * Hv, dv}), d_gated, GateActivation::silu);
  be.head_rmsnorm_backward(d_gated, s.gate_in, p.gate_norm_w, s.gate_rstd, 1, 1, dv, g.gate_norm_w);
  const Tensor d_qkvz = scratch({N, W}), d_o = scratch({B, T, Hv, dv});
  const Tensor dg2 = rows2d(d_gated, Hv * 2 * dv);
  for (int64_t hv = 0; hv < Hv; ++hv) {
    copy_cols(be, dg2, Hv * 2 * dv, hv * 2 * dv, d_qkvz, W, Dc + hv * dv, N, dv);
    copy_cols(be, dg2, Hv * 2 * dv, hv * 2 * dv + dv, rows2d(d_o, Dv), Dv, hv * dv, N, dv);
  }
  // the delta rule and its gates
  const Tensor dq = scratch({B, T, Hk, dk}), dk_ = scratch({B, T, Hk, dk}), dvv = scratch({B, T, Hv, dv});
  const Tensor dgate = scratch({B, T, Hv}), dbeta = scratch({B, T, Hv});
  be.delta_rule_backward(s.q, s.k, s.v, s.g, s.beta, in.delta, d_o, d_out_state.delta, dq, dk_, dvv, dgate, dbeta,
                         d_in.delta, DeltaRuleForm::chunked, kDeltaRuleChunk);
  const Tensor d_ba = scratch({N, 2 * Hv});
  be.delta_gates_backward(s.ba, p.a_log, p.dt_bias, rows2d(dgate, Hv), rows2d(dbeta, Hv), d_ba, g.a_log, g.dt_bias);
  // the l2 norms (their constant weights' gradients go to a scratch sink)
  const Tensor sink = scratch({dk});
  be.head_rmsnorm_backward(rows2d(dq, Dq), s.q_in, l2_weight(be, true), s.q_rstd, 0, Hk, dk, sink);
  be.head_rmsnorm_backward(rows2d(dk_, Dq), s.k_in, l2_weight(be, false), s.k_rstd, 0, Hk, dk, sink);
  // the conv: d(its output) from q, k, v; d(its input) into d_qkvz's [q | k | v] columns
  const Tensor d_conv = scratch({B, T, Dc}), d_mixed = scratch({B, T, Dc});
  const Tensor dc2 = rows2d(d_conv, Dc);
  copy_cols(be, rows2d(dq, Dq), Dq, 0, dc2, Dc, 0, N, Dq);
  copy_cols(be, rows2d(dk_, Dq), Dq, 0, dc2, Dc, Dq, N, Dq);
  copy_cols(be, rows2d(dvv, Dv), Dv, 0, dc2, Dc, 2 * Dq, N, Dv);
  be.causal_conv1d_silu_backward(s.mixed, p.conv_w, in.conv, d_conv, d_mixed, g.conv_w, d_in.conv);
  copy_cols(be, rows2d(d_mixed, Dc), Dc, 0, d_qkvz, W, 0, N, Dc);
  // the projections and the input norm
  const Tensor h = rows2d(s.norm.out, C), d_h = scratch({N, C}), d_h2 = scratch({N, C});
  linear_backward(be, h, p.qkvz_w, d_qkvz, d_h, g.qkvz_w, Tensor{});
  linear_backward(be, h, p.ba_w, d_ba, d_h2, g.ba_w, Tensor{});
  be.add_inplace(d_h, d_h2);
  const Tensor dx = scratch({B, T, C});
  norm_backward(be, config_, d_h.view(0, {B, T, C}), x, p.norm_w, Tensor{}, s.norm.rstd, dx, g.norm_w, Tensor{});
  be.add_inplace(d_residual, dx);
}

void GatedDeltaNet::forward_rows(Backend& be, const Tensor& x, const Tensor& out, DecodeCache& cache,
                                 int64_t layer) const {
  const GatedDeltaNetShape& sh = shape_;
  const int64_t n = x.dim(0), C = x.dim(2), taps = sh.conv_taps - 1, Dc = sh.conv_width();
  const int64_t conv_floats = taps * Dc, delta_floats = sh.value_heads * sh.key_dim * sh.value_dim;
  std::vector<float*> states(static_cast<size_t>(n));
  for (int64_t r = 0; r < n; ++r) states[static_cast<size_t>(r)] = cache.linear_state(layer, r);
  // Runs of consecutive rows sharing a state (one sequence's chunk): each a span of its own;
  // when every run is one row, the rows are one batch of independent sequences.
  std::vector<std::pair<int64_t, int64_t>> runs;  // (first row, rows)
  for (int64_t r = 0; r < n; ++r) {
    if (!runs.empty() && states[static_cast<size_t>(runs.back().first)] == states[static_cast<size_t>(r)]) {
      ++runs.back().second;
    } else {
      runs.push_back({r, 1});
    }
  }
  const bool batch = static_cast<int64_t>(runs.size()) == n;
  if (batch) runs = {{0, n}};
  Allocator& a = be.allocator();
  std::vector<float> host;
  for (const auto& [first, rows] : runs) {
    const int64_t B = batch ? rows : 1, T = batch ? 1 : rows;
    const auto ws = [&](Shape dims) { return Tensor::empty(a, std::move(dims), DTYPE_F32, MEM_WORKSPACE); };
    LinearAttentionState in{ws({B, taps, Dc}), ws({B, sh.value_heads, sh.key_dim, sh.value_dim})};
    LinearAttentionState next{ws({B, taps, Dc}), ws({B, sh.value_heads, sh.key_dim, sh.value_dim})};
    host.resize(static_cast<size_t>(B * (conv_floats + delta_floats)));
    for (int64_t b = 0; b < B; ++b) {  // [conv | delta] per sequence -> the two batched tensors
      const float* st = states[static_cast<size_t>(first + b)];
      std::copy(st, st + conv_floats, host.data() + b * conv_floats);
      std::copy(st + conv_floats, st + conv_floats + delta_floats, host.data() + B * conv_floats + b * delta_floats);
    }
    be.write(in.conv, host.data());
    be.write(in.delta, host.data() + B * conv_floats);
    GatedDeltaNetSaved s = allocate_gated_delta_net_saved(a, sh, B, T, C);
    forward(be, x.view(first * C, {B, T, C}), s, out.view(first * C, {B, T, C}), in, next);
    be.read(next.conv, host.data());
    be.read(next.delta, host.data() + B * conv_floats);
    for (int64_t b = 0; b < B; ++b) {
      float* st = states[static_cast<size_t>(first + b)];
      std::copy(host.data() + b * conv_floats, host.data() + (b + 1) * conv_floats, st);
      std::copy(host.data() + B * conv_floats + b * delta_floats, host.data() + B * conv_floats + (b + 1) * delta_floats,
                st + conv_floats);
    }
  }
}

}  // namespace loom
