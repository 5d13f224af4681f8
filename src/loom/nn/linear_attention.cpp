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

// The conv's final state is the last K-1 rows of [initial | x] (x: the span's conv input, (B, T,
// D_c)): d(final state) adds to d(x)'s last rows and, for a span shorter than K-1, to d(initial)'s
// rows after its first T. d_final undefined: zeros (nothing to add).
void add_final_conv_gradient(Backend& be, const Tensor& d_final, const Tensor& d_x, const Tensor& d_initial) {
  if (!d_final.defined()) return;
  const int64_t B = d_x.dim(0), T = d_x.dim(1), Dc = d_x.dim(2), K1 = d_final.dim(1);
  const int64_t from_initial = std::max<int64_t>(0, K1 - T);  // final rows [0, from_initial) are initial rows T + j
  for (int64_t b = 0; b < B; ++b) {
    const int64_t n = K1 - from_initial;
    if (n > 0) {
      be.add_inplace(d_x.view((b * T + T - n) * Dc, {n * Dc}), d_final.view((b * K1 + from_initial) * Dc, {n * Dc}));
    }
    if (from_initial > 0) {
      LOOM_CHECK(d_initial.defined(), "gated DeltaNet: a span shorter than the conv's K-1 = ", K1,
                 " taps needs d(initial state) for its final state's gradient");
      be.add_inplace(d_initial.view((b * K1 + T) * Dc, {from_initial * Dc}), d_final.view(b * K1 * Dc, {from_initial * Dc}));
    }
  }
}

}  // namespace

GatedDeltaNetShape gated_delta_net_shape(const ModelConfig& c) {
  return {c.linear_key_heads, c.linear_value_heads, c.linear_key_dim, c.linear_value_dim, c.linear_conv_taps};
}

void gated_delta_net_saved_fields(const GatedDeltaNetShape& sh, int64_t B, int64_t T, int64_t C, GatedDeltaNetSaved& s,
                                  const SavedFieldFn& f, DType dt, bool context_parallel) {
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
  if (context_parallel) {
    f(s.span_conv, {2, B, sh.conv_taps - 1, sh.conv_width()}, dt);
    f(s.span_delta, {2, B, Hv, dk, dv}, dt);
  }
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
  if (cp_ != nullptr && !in.delta.defined() && !out_state.delta.defined()) {  // this rank's chunks of the sequence
    LOOM_CHECK(s.span_delta.defined(), "gated DeltaNet under context parallelism: the record lacks the spans' states");
    forward_cp(be, x, s, out);
    return;
  }
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
  if (tp_ == nullptr) {
    be.copy(x, out);
    linear_forward(be, s.act, p.out_w, Tensor{}, rows2d(out, C), 1.0f);
    return;
  }
  const Tensor y = Tensor::empty(a, {B, T, C}, dt, MEM_WORKSPACE);  // this rank's heads' share, summed over tp
  linear_forward(be, s.act, p.out_w, Tensor{}, rows2d(y, C));
  tp_->all_reduce(y);
  be.add(x, y, out);
}

void GatedDeltaNet::backward(Backend& be, const Tensor& x, const GatedDeltaNetSaved& s, const Tensor& d_residual,
                             const LinearAttentionState& in, const LinearAttentionState& d_out_state,
                             const LinearAttentionState& d_in) const {
  if (cp_ != nullptr && !in.delta.defined() && !d_in.delta.defined()) {
    LOOM_CHECK(s.span_delta.defined(), "gated DeltaNet under context parallelism: the record lacks the spans' states");
    backward_cp(be, x, s, d_residual);
    return;
  }
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
  add_final_conv_gradient(be, d_out_state.conv, d_mixed, d_in.conv);
  copy_cols(be, rows2d(d_mixed, Dc), Dc, 0, d_qkvz, W, 0, N, Dc);
  // the projections and the input norm
  const Tensor h = rows2d(s.norm.out, C), d_h = scratch({N, C}), d_h2 = scratch({N, C});
  linear_backward(be, h, p.qkvz_w, d_qkvz, d_h, g.qkvz_w, Tensor{});
  linear_backward(be, h, p.ba_w, d_ba, d_h2, g.ba_w, Tensor{});
  be.add_inplace(d_h, d_h2);
  if (tp_ != nullptr) tp_->all_reduce(d_h);  // the heads' partial d(normed input), summed over tp
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

namespace {

// Rows [first, first + n) of a record field over BT = B T positions, as a (1, n, ...) view for
// (B, T, ...) fields and as n positions' rows of the flat or (B T m, W) ones.
Tensor position_rows(const Tensor& f, int64_t BT, int64_t first, int64_t n) {
  const int64_t per = f.numel() / BT;
  Shape shape = f.shape();
  if (shape.size() >= 3 || (shape.size() == 2 && shape[0] * shape[1] == BT)) {  // (B, T, ...) -> (1, n, ...)
    shape[0] = 1, shape[1] = n;
  } else {
    shape[0] = shape[0] / BT * n;
  }
  return f.view(first * per, shape);
}

// The record's rows of sequence b's positions [t0, t0 + n) of T (one span).
GatedDeltaNetSaved span_rows(const GatedDeltaNetSaved& s, int64_t B, int64_t T, int64_t b, int64_t t0, int64_t n) {
  GatedDeltaNetSaved r;
  const int64_t BT = B * T, first = b * T + t0;
  for (auto field : {&GatedDeltaNetSaved::qkvz, &GatedDeltaNetSaved::ba, &GatedDeltaNetSaved::mixed, &GatedDeltaNetSaved::q,
                     &GatedDeltaNetSaved::k, &GatedDeltaNetSaved::v, &GatedDeltaNetSaved::q_in, &GatedDeltaNetSaved::q_rstd,
                     &GatedDeltaNetSaved::k_in, &GatedDeltaNetSaved::k_rstd, &GatedDeltaNetSaved::g, &GatedDeltaNetSaved::beta,
                     &GatedDeltaNetSaved::gated, &GatedDeltaNetSaved::gate_in, &GatedDeltaNetSaved::gate_rstd,
                     &GatedDeltaNetSaved::act}) {
    r.*field = position_rows(s.*field, BT, first, n);
  }
  r.norm.out = position_rows(s.norm.out, BT, first, n);
  r.norm.rstd = position_rows(s.norm.rstd, BT, first, n);
  return r;
}

// Chunk c of 2N's owner in the zig-zag layout, and its index (0, 1) among that rank's chunks.
int owner_of(int64_t c, int world) { return static_cast<int>(c < world ? c : 2 * world - 1 - c); }
int64_t local_chunk(int64_t c, int world) { return c < world ? 0 : 1; }

// A workspace tensor of one span's states, (B, ...), from the record's two (2, B, ...).
Tensor one_span(Backend& be, const Tensor& spans) {
  const Shape& d = spans.shape();
  return Tensor::empty(be.allocator(), Shape(d.begin() + 1, d.end()), spans.dtype(), MEM_WORKSPACE);
}

// Sequence b's state of batched (B, K-1, D_c) and (B, H_v, d_k, d_v) ones.
LinearAttentionState state_of(const Tensor& conv, const Tensor& delta, int64_t b) {
  const int64_t cn = conv.numel() / conv.dim(0), dn = delta.numel() / delta.dim(0);
  return {conv.view(b * cn, {1, conv.dim(1), conv.dim(2)}), delta.view(b * dn, {1, delta.dim(1), delta.dim(2), delta.dim(3)})};
}

}  // namespace

void GatedDeltaNet::forward_cp(Backend& be, const Tensor& x, GatedDeltaNetSaved& s, const Tensor& out) const {
  Communicator& comm = *cp_->comm;
  const int world = comm.size(), rank = comm.rank();
  const int64_t B = x.dim(0), Tl = x.dim(1), C = x.dim(2), L = Tl / 2;
  LOOM_CHECK(s.norm.rstd.numel() == B * Tl && Tl % 2 == 0, "gated DeltaNet under context parallelism: a record of ",
             s.norm.rstd.numel(), " positions for ", B, " x ", Tl, " (two chunks a rank)");
  const int64_t conv = s.span_conv.numel() / (2 * B), delta = s.span_delta.numel() / (2 * B);
  const Tensor next_conv = one_span(be, s.span_conv), next_delta = one_span(be, s.span_delta);  // (B, ...): the state a chunk leaves
  for (int64_t c = 0; c < 2 * world; ++c) {
    if (owner_of(c, world) != rank) continue;
    const int64_t k = local_chunk(c, world);
    const Tensor in_conv = s.span_conv.view(k * B * conv, next_conv.shape());
    const Tensor in_delta = s.span_delta.view(k * B * delta, next_delta.shape());
    if (c == 0) {
      be.fill(in_conv, 0.0), be.fill(in_delta, 0.0);
    } else if (owner_of(c - 1, world) != rank) {
      comm.recv(in_conv, owner_of(c - 1, world), 0), comm.recv(in_delta, owner_of(c - 1, world), 1);
    } else {  // this rank's previous chunk (rank N-1: chunks N-1 and N)
      be.copy(next_conv, in_conv), be.copy(next_delta, in_delta);
    }
    for (int64_t b = 0; b < B; ++b) {
      GatedDeltaNetSaved r = span_rows(s, B, Tl, b, k * L, L);
      const int64_t at = (b * Tl + k * L) * C;
      forward(be, x.view(at, {1, L, C}), r, out.view(at, {1, L, C}), state_of(in_conv, in_delta, b),
              state_of(next_conv, next_delta, b));
    }
    if (c + 1 < 2 * world && owner_of(c + 1, world) != rank) {
      comm.send(next_conv, owner_of(c + 1, world), 0), comm.send(next_delta, owner_of(c + 1, world), 1);
    }
  }
}

void GatedDeltaNet::backward_cp(Backend& be, const Tensor& x, const GatedDeltaNetSaved& s, const Tensor& d_residual) const {
  Communicator& comm = *cp_->comm;
  const int world = comm.size(), rank = comm.rank();
  const int64_t B = x.dim(0), Tl = x.dim(1), C = x.dim(2), L = Tl / 2;
  // d(the state a chunk leaves), and d(the state it enters with), per sequence.
  const Tensor d_out_conv = one_span(be, s.span_conv), d_out_delta = one_span(be, s.span_delta);
  const Tensor d_in_conv = one_span(be, s.span_conv), d_in_delta = one_span(be, s.span_delta);
  for (int64_t c = 2 * world - 1; c >= 0; --c) {
    if (owner_of(c, world) != rank) continue;
    const int64_t k = local_chunk(c, world);
    if (c == 2 * world - 1) {
      be.fill(d_out_conv, 0.0), be.fill(d_out_delta, 0.0);
    } else if (owner_of(c + 1, world) != rank) {
      comm.recv(d_out_conv, owner_of(c + 1, world), 2), comm.recv(d_out_delta, owner_of(c + 1, world), 3);
    } else {  // this rank's next chunk
      be.copy(d_in_conv, d_out_conv), be.copy(d_in_delta, d_out_delta);
    }
    const Tensor in_conv = s.span_conv.view(k * d_out_conv.numel(), d_out_conv.shape());
    const Tensor in_delta = s.span_delta.view(k * d_out_delta.numel(), d_out_delta.shape());
    for (int64_t b = 0; b < B; ++b) {
      const GatedDeltaNetSaved r = span_rows(s, B, Tl, b, k * L, L);
      const int64_t at = (b * Tl + k * L) * C;
      backward(be, x.view(at, {1, L, C}), r, d_residual.view(at, {1, L, C}), state_of(in_conv, in_delta, b),
               state_of(d_out_conv, d_out_delta, b), state_of(d_in_conv, d_in_delta, b));
    }
    if (c > 0 && owner_of(c - 1, world) != rank) {
      comm.send(d_in_conv, owner_of(c - 1, world), 2), comm.send(d_in_delta, owner_of(c - 1, world), 3);
    }
  }
}

}  // namespace loom
