#include "loom/nn/mla.h"

#include "loom/core/error.h"
#include "loom/nn/linear.h"

namespace loom {

namespace {

// Rotate-half RoPE on q's per-head q_r slices and on k_r, at positions pos_offset + t (backward:
// the inverse rotation).
void rope_q_and_k(Backend& backend, const ModelConfig& config, const Tensor& q, const Tensor& kr, int64_t pos_offset,
                  bool inverse) {
  const int64_t H = config.n_head, dn = config.mla_nope(), dr = config.mla_rope_dim;
  backend.mla_rope(q, H, dn + dr, dn, dr, config.rope(), pos_offset, inverse);
  backend.mla_rope(kr, 1, dr, 0, dr, config.rope(), pos_offset, inverse);
}

// dx (+)= dy @ w; dw += dy^T @ x (linear_backward with an accumulating dx).
void linear_backward_into(Backend& backend, const Tensor& x, const Tensor& w, const Tensor& dy, const Tensor& dx,
                          const Tensor& dw, float dx_beta) {
  GemmSpec input;
  input.beta = dx_beta;
  backend.gemm(dy, w, dx, input);
  GemmSpec weight;
  weight.trans_a = true;
  weight.beta = 1.0f;
  backend.gemm(dy, x, dw, weight);
}

struct Dims {
  int64_t B, T, N, C, H, dc, dr, dn, dv, dq, qk, kvw;
};

Dims dims_of(const ModelConfig& config, int64_t batch, int64_t seq_len) {
  Dims d;
  d.B = batch, d.T = seq_len, d.N = batch * seq_len, d.C = config.d_model, d.H = config.n_head;
  d.dc = config.mla_kv_rank, d.dr = config.mla_rope_dim, d.dn = config.mla_nope(), d.dv = config.mla_v();
  d.dq = config.mla_q_rank, d.qk = d.dn + d.dr, d.kvw = d.dn + d.dv;
  return d;
}

// W_dkv (d_c, C) and W_kr (d_r, C): row slices of kv_a_proj_with_mqa.
Tensor latent_rows(const Tensor& kv_a, const Dims& d) { return kv_a.view(0, {d.dc, d.C}); }
Tensor rope_rows(const Tensor& kv_a, const Dims& d) { return kv_a.view(d.dc * d.C, {d.dr, d.C}); }

// The attention ops' dimensions.
MlaDims mla_dims(const ModelConfig& config) {
  MlaDims m;
  m.n_head = config.n_head, m.nope = config.mla_nope(), m.rope = config.mla_rope_dim, m.v = config.mla_v();
  m.latent = config.mla_kv_rank, m.window = config.attn_window, m.score_scale = config.mla_score_scale;
  return m;
}

}  // namespace

int64_t mla_scratch_floats(const ModelConfig& config, int64_t batch, int64_t seq_len) {
  const Dims d = dims_of(config, batch, seq_len);
  // d_q, d_kv, d_kr, d_c', d_c, then d_qa' and d_qa (d_q > 0), then one row of dp (T).
  return d.N * (d.H * d.qk + d.H * d.kvw + d.dr + 2 * d.dc + 2 * d.dq) + d.T;
}

void mla_project(Backend& backend, const ModelConfig& config, const MlaParams& p, const Tensor& x,
                 const MlaActivations& a, const int64_t* positions) {
  const Dims d = dims_of(config, x.dim(0), x.dim(1));
  if (d.dq > 0) {
    linear_forward(backend, x, p.q_a_w, Tensor{}, a.qa);
    backend.rmsnorm_forward(a.qa, p.q_a_norm, a.qa_norm, a.qa_rstd, config.norm_eps);
    linear_forward(backend, a.qa_norm, p.q_b_w, Tensor{}, a.q);
  } else {
    linear_forward(backend, x, p.q_w, Tensor{}, a.q);
  }
  linear_forward(backend, x, latent_rows(p.kv_a_w, d), Tensor{}, a.c);
  linear_forward(backend, x, rope_rows(p.kv_a_w, d), Tensor{}, a.kr);
  if (positions == nullptr) {
    rope_q_and_k(backend, config, a.q, a.kr, 0, false);
  } else {  // decoding rows (T = 1), each at its own position
    LOOM_CHECK(d.T == 1, "mla_project: positions are for decoding rows (T = 1), got x ", x.describe());
    for (int64_t n = 0; n < d.N; ++n) {
      rope_q_and_k(backend, config, a.q.view(n * d.H * d.qk, {1, 1, d.H * d.qk}), a.kr.view(n * d.dr, {1, 1, d.dr}),
                   positions[n], false);
    }
  }
  backend.rmsnorm_forward(a.c, p.kv_norm, a.c_norm, a.c_rstd, config.norm_eps);
  if (a.kv.defined()) linear_forward(backend, a.c_norm, p.kv_b_w, Tensor{}, a.kv);
}

void mla_forward(Backend& backend, const ModelConfig& config, const MlaParams& p, const Tensor& x,
                 const MlaActivations& a) {
  mla_project(backend, config, p, x, a);
  backend.mla_attention_forward(a.q, a.kr, a.kv, a.probs, a.attn, mla_dims(config));
}

void mla_backward(Backend& backend, const ModelConfig& config, const MlaParams& p, const MlaParams& g,
                  const Tensor& x, const MlaActivations& a, const Tensor& d_attn, const Tensor& dx,
                  const Tensor& scratch) {
  const Dims d = dims_of(config, x.dim(0), x.dim(1));
  const int64_t T = d.T;
  LOOM_CHECK(scratch.numel() >= mla_scratch_floats(config, d.B, d.T), "mla_backward: scratch of ", scratch.numel(),
             " floats, needs ", mla_scratch_floats(config, d.B, d.T));
  int64_t offset = 0;
  const auto carve = [&](Shape shape) {
    const Tensor t = scratch.view(offset, shape);
    offset += t.numel();
    return t;
  };
  const Tensor dq = carve({d.B, T, d.H * d.qk}), dkv = carve({d.B, T, d.H * d.kvw}), dkr = carve({d.B, T, d.dr});
  const Tensor dcn = carve({d.B, T, d.dc}), dc = carve({d.B, T, d.dc});
  const Tensor dqan = d.dq > 0 ? carve({d.B, T, d.dq}) : Tensor{}, dqa = d.dq > 0 ? carve({d.B, T, d.dq}) : Tensor{};
  const Tensor dp_row = carve({T});

  // Attention: dv_h(j) += p(i,j) do_h(i); dp(i,j) = do_h(i) . v_h(j); ds = p (dp - sum_j p dp);
  // dq(i) = scale sum_j ds(i,j) k(j); dk(j) += scale ds(i,j) q(i), the RoPE key's summed over heads.
  backend.fill(dq, 0.0);
  backend.fill(dkv, 0.0);
  backend.fill(dkr, 0.0);
  backend.mla_attention_backward(a.q, a.kr, a.kv, a.probs, d_attn, dq, dkv, dkr, dp_row, mla_dims(config));
  // Through RoPE (the inverse rotation), the up-projection, the latent's norm and the projections.
  rope_q_and_k(backend, config, dq, dkr, 0, true);
  linear_backward_into(backend, a.c_norm, p.kv_b_w, dkv, dcn, g.kv_b_w, 0.0f);
  backend.rmsnorm_backward(dcn, a.c, p.kv_norm, a.c_rstd, dc, g.kv_norm);
  linear_backward_into(backend, x, latent_rows(p.kv_a_w, d), dc, dx, latent_rows(g.kv_a_w, d), 0.0f);
  linear_backward_into(backend, x, rope_rows(p.kv_a_w, d), dkr, dx, rope_rows(g.kv_a_w, d), 1.0f);
  if (d.dq > 0) {
    linear_backward_into(backend, a.qa_norm, p.q_b_w, dq, dqan, g.q_b_w, 0.0f);
    backend.rmsnorm_backward(dqan, a.qa, p.q_a_norm, a.qa_rstd, dqa, g.q_a_norm);
    linear_backward_into(backend, x, p.q_a_w, dqa, dx, g.q_a_w, 1.0f);
  } else {
    linear_backward_into(backend, x, p.q_w, dq, dx, g.q_w, 1.0f);
  }
}

void mla_attend_latents(Backend& backend, const ModelConfig& config, const MlaParams& p, const Tensor& q,
                        const Tensor& latents, const Tensor& out) {
  backend.mla_attend_latents(q, latents, p.kv_b_w, out, mla_dims(config));
}

}  // namespace loom
