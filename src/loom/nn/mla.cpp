#include "loom/nn/mla.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "loom/core/error.h"
#include "loom/nn/linear.h"

namespace loom {

namespace {

// Rotate-half RoPE over d_r-wide slices: row n's `heads` slices start at offset + h stride and
// turn by direction * position(n) * theta^(-2j/d_r) (direction -1: the inverse, for backward).
// position(n) = positions[n / T] when given (one position per row of a decoding batch), else n % T.
void rope_slices(float* x, int64_t rows, int64_t T, int64_t width, int64_t heads, int64_t stride, int64_t offset,
                 int64_t dr, double theta, const int64_t* positions, double direction) {
  const int64_t half = dr / 2;
  for (int64_t n = 0; n < rows; ++n) {
    const int64_t pos = positions != nullptr ? positions[n / T] : n % T;
    float* row = x + n * width;
    for (int64_t j = 0; j < half; ++j) {
      const double angle = direction * static_cast<double>(pos) * std::pow(theta, -2.0 * static_cast<double>(j) / dr);
      const float cs = static_cast<float>(std::cos(angle)), sn = static_cast<float>(std::sin(angle));
      for (int64_t h = 0; h < heads; ++h) {
        float* v = row + offset + h * stride;
        const float a = v[j], c = v[j + half];
        v[j] = a * cs - c * sn;
        v[j + half] = c * cs + a * sn;
      }
    }
  }
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

// The first key position row i sees: 0, or i - W + 1 with a sliding window of W.
int64_t first_visible(int64_t i, int64_t window) { return window > 0 ? std::max<int64_t>(0, i - window + 1) : 0; }

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
  rope_slices(a.q.data<float>(), d.N, d.T, d.H * d.qk, d.H, d.qk, d.dn, d.dr, config.rope_theta, positions, 1.0);
  linear_forward(backend, x, latent_rows(p.kv_a_w, d), Tensor{}, a.c);
  linear_forward(backend, x, rope_rows(p.kv_a_w, d), Tensor{}, a.kr);
  rope_slices(a.kr.data<float>(), d.N, d.T, d.dr, 1, d.dr, 0, d.dr, config.rope_theta, positions, 1.0);
  backend.rmsnorm_forward(a.c, p.kv_norm, a.c_norm, a.c_rstd, config.norm_eps);
  if (a.kv.defined()) linear_forward(backend, a.c_norm, p.kv_b_w, Tensor{}, a.kv);
}

void mla_forward(Backend& backend, const ModelConfig& config, const MlaParams& p, const Tensor& x,
                 const MlaActivations& a) {
  mla_project(backend, config, p, x, a);
  const Dims d = dims_of(config, x.dim(0), x.dim(1));
  const int64_t T = d.T, W = config.attn_window;
  const float scale = 1.0f / std::sqrt(static_cast<float>(d.qk));
  const float* q = a.q.data<float>();
  const float* kr = a.kr.data<float>();
  const float* kv = a.kv.data<float>();
  float* probs = a.probs.data<float>();
  float* out = a.attn.data<float>();
  for (int64_t b = 0; b < d.B; ++b) {
    for (int64_t h = 0; h < d.H; ++h) {
      for (int64_t i = 0; i < T; ++i) {
        const float* qi = q + (b * T + i) * d.H * d.qk + h * d.qk;
        float* pr = probs + ((b * d.H + h) * T + i) * T;
        std::fill(pr, pr + T, 0.0f);
        const int64_t j0 = first_visible(i, W);
        float maxs = -std::numeric_limits<float>::infinity();
        for (int64_t j = j0; j <= i; ++j) {
          const float* kn = kv + (b * T + j) * d.H * d.kvw + h * d.kvw;
          const float* krj = kr + (b * T + j) * d.dr;
          float s = 0.0f;
          for (int64_t e = 0; e < d.dn; ++e) s += qi[e] * kn[e];
          for (int64_t e = 0; e < d.dr; ++e) s += qi[d.dn + e] * krj[e];
          pr[j] = s * scale;
          maxs = std::max(maxs, pr[j]);
        }
        double sum = 0.0;
        for (int64_t j = j0; j <= i; ++j) {
          pr[j] = std::exp(pr[j] - maxs);
          sum += pr[j];
        }
        const float inv = static_cast<float>(1.0 / sum);
        float* o = out + (b * T + i) * d.H * d.dv + h * d.dv;
        std::fill(o, o + d.dv, 0.0f);
        for (int64_t j = j0; j <= i; ++j) {
          pr[j] *= inv;
          const float* v = kv + (b * T + j) * d.H * d.kvw + h * d.kvw + d.dn;
          for (int64_t e = 0; e < d.dv; ++e) o[e] += pr[j] * v[e];
        }
      }
    }
  }
}

void mla_backward(Backend& backend, const ModelConfig& config, const MlaParams& p, const MlaParams& g,
                  const Tensor& x, const MlaActivations& a, const Tensor& d_attn, const Tensor& dx,
                  const Tensor& scratch) {
  const Dims d = dims_of(config, x.dim(0), x.dim(1));
  const int64_t T = d.T, W = config.attn_window;
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
  const float scale = 1.0f / std::sqrt(static_cast<float>(d.qk));
  backend.fill(dq, 0.0);
  backend.fill(dkv, 0.0);
  backend.fill(dkr, 0.0);
  const float* q = a.q.data<float>();
  const float* kr = a.kr.data<float>();
  const float* kv = a.kv.data<float>();
  const float* probs = a.probs.data<float>();
  const float* dout = d_attn.data<float>();
  float* dqp = dq.data<float>();
  float* dkvp = dkv.data<float>();
  float* dkrp = dkr.data<float>();
  float* dpr = dp_row.data<float>();
  for (int64_t b = 0; b < d.B; ++b) {
    for (int64_t h = 0; h < d.H; ++h) {
      for (int64_t i = 0; i < T; ++i) {
        const float* pr = probs + ((b * d.H + h) * T + i) * T;
        const float* doi = dout + (b * T + i) * d.H * d.dv + h * d.dv;
        const float* qi = q + (b * T + i) * d.H * d.qk + h * d.qk;
        float* dqi = dqp + (b * T + i) * d.H * d.qk + h * d.qk;
        const int64_t j0 = first_visible(i, W);
        double dot = 0.0;
        for (int64_t j = j0; j <= i; ++j) {
          const float* v = kv + (b * T + j) * d.H * d.kvw + h * d.kvw + d.dn;
          float* dv = dkvp + (b * T + j) * d.H * d.kvw + h * d.kvw + d.dn;
          float s = 0.0f;
          for (int64_t e = 0; e < d.dv; ++e) {
            s += doi[e] * v[e];
            dv[e] += pr[j] * doi[e];
          }
          dpr[j] = s;
          dot += static_cast<double>(pr[j]) * s;
        }
        for (int64_t j = j0; j <= i; ++j) {
          const float ds = pr[j] * (dpr[j] - static_cast<float>(dot)) * scale;
          const float* kn = kv + (b * T + j) * d.H * d.kvw + h * d.kvw;
          const float* krj = kr + (b * T + j) * d.dr;
          float* dkn = dkvp + (b * T + j) * d.H * d.kvw + h * d.kvw;
          float* dkrj = dkrp + (b * T + j) * d.dr;
          for (int64_t e = 0; e < d.dn; ++e) {
            dqi[e] += ds * kn[e];
            dkn[e] += ds * qi[e];
          }
          for (int64_t e = 0; e < d.dr; ++e) {
            dqi[d.dn + e] += ds * krj[e];
            dkrj[e] += ds * qi[d.dn + e];
          }
        }
      }
    }
  }
  // Through RoPE (the inverse rotation), the up-projection, the latent's norm and the projections.
  rope_slices(dqp, d.N, T, d.H * d.qk, d.H, d.qk, d.dn, d.dr, config.rope_theta, nullptr, -1.0);
  rope_slices(dkrp, d.N, T, d.dr, 1, d.dr, 0, d.dr, config.rope_theta, nullptr, -1.0);
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

void mla_attend_latents(const ModelConfig& config, const MlaParams& p, const float* q, const float* latents,
                        int64_t count, float* out) {
  const Dims d = dims_of(config, 1, 1);
  const int64_t lw = d.dc + d.dr;
  const float scale = 1.0f / std::sqrt(static_cast<float>(d.qk));
  const float* wkvb = p.kv_b_w.data<float>();  // (H (d_n + d_v), d_c)
  std::vector<float> qt(static_cast<size_t>(d.dc)), scores(static_cast<size_t>(count)), ctx(static_cast<size_t>(d.dc));
  for (int64_t h = 0; h < d.H; ++h) {
    const float* qn = q + h * d.qk;
    const float* qr = qn + d.dn;
    const float* wuk = wkvb + h * d.kvw * d.dc;  // (d_n, d_c)
    const float* wuv = wuk + d.dn * d.dc;        // (d_v, d_c)
    std::fill(qt.begin(), qt.end(), 0.0f);       // q~ = W_uk^T q_n
    for (int64_t e = 0; e < d.dn; ++e) {
      for (int64_t k = 0; k < d.dc; ++k) qt[k] += qn[e] * wuk[e * d.dc + k];
    }
    float maxs = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < count; ++j) {
      const float* lat = latents + j * lw;
      float s = 0.0f;
      for (int64_t k = 0; k < d.dc; ++k) s += qt[k] * lat[k];
      for (int64_t e = 0; e < d.dr; ++e) s += qr[e] * lat[d.dc + e];
      scores[j] = s * scale;
      maxs = std::max(maxs, scores[j]);
    }
    double sum = 0.0;
    for (int64_t j = 0; j < count; ++j) {
      scores[j] = std::exp(scores[j] - maxs);
      sum += scores[j];
    }
    const float inv = static_cast<float>(1.0 / sum);
    std::fill(ctx.begin(), ctx.end(), 0.0f);  // sum_j p(j) c'(j)
    for (int64_t j = 0; j < count; ++j) {
      const float w = scores[j] * inv;
      for (int64_t k = 0; k < d.dc; ++k) ctx[k] += w * latents[j * lw + k];
    }
    float* o = out + h * d.dv;  // o_h = W_uv ctx
    for (int64_t e = 0; e < d.dv; ++e) {
      float s = 0.0f;
      for (int64_t k = 0; k < d.dc; ++k) s += wuv[e * d.dc + k] * ctx[k];
      o[e] = s;
    }
  }
}

}  // namespace loom
