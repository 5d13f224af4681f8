// CPU kernels of the multi-head latent attention ops (contracts in backend.h; the layouts in
// nn/mla.h): the decoupled RoPE slices, the attention over [k_n | v] heads and the shared RoPE
// key, its backward, and decoding over cached latents with W_uk absorbed into the query. The
// loops are sequential, so every sum runs in index order.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "loom/backend/cpu/cpu_moe_ops.h"
#include "loom/backend/moe_checks.h"
#include "loom/core/error.h"

namespace loom::cpu {

namespace {

// The first key position row i sees: 0, or i - W + 1 with a sliding window of W.
int64_t first_visible(int64_t i, int64_t window) { return window > 0 ? std::max<int64_t>(0, i - window + 1) : 0; }

}  // namespace

void mla_rope(const Tensor& xt, int64_t heads, int64_t stride, int64_t offset, int64_t dr, const RopeSpec& rope,
              int64_t pos_offset, bool inverse) {
  checks::check_mla_rope(xt, heads, stride, offset, dr, pos_offset);
  const int64_t T = xt.dim(1), width = xt.dim(2), rows = xt.numel() / width, half = dr / 2;
  const double direction = inverse ? -1.0 : 1.0;
  float* x = xt.data<float>();
  for (int64_t n = 0; n < rows; ++n) {
    const int64_t pos = pos_offset + n % T;
    float* row = x + n * width;
    for (int64_t j = 0; j < half; ++j) {
      const double angle = direction * static_cast<double>(pos) * rope_inv_freq(rope, j, dr);
      const float cs = static_cast<float>(std::cos(angle) * rope.amplitude);
      const float sn = static_cast<float>(std::sin(angle) * rope.amplitude);
      for (int64_t h = 0; h < heads; ++h) {
        float* v = row + offset + h * stride;
        const float a = v[j], c = v[j + half];
        v[j] = a * cs - c * sn;
        v[j + half] = c * cs + a * sn;
      }
    }
  }
}

void mla_attention_forward(const Tensor& q_t, const Tensor& kr_t, const Tensor& kv_t, const Tensor& probs_t,
                           const Tensor& out_t, const MlaDims& dims) {
  const checks::MlaAttentionDims d = checks::check_mla_attention_forward(q_t, kr_t, kv_t, probs_t, out_t, dims);
  const int64_t T = d.T, W = d.window;
  const float scale = static_cast<float>(dims.score_scale) / std::sqrt(static_cast<float>(d.qk));
  const float* q = q_t.data<float>();
  const float* kr = kr_t.data<float>();
  const float* kv = kv_t.data<float>();
  float* probs = probs_t.data<float>();
  float* out = out_t.data<float>();
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

void mla_attention_backward(const Tensor& q_t, const Tensor& kr_t, const Tensor& kv_t, const Tensor& probs_t,
                            const Tensor& dout_t, const Tensor& dq_t, const Tensor& dkv_t, const Tensor& dkr_t,
                            const Tensor& dp_row, const MlaDims& dims) {
  const checks::MlaAttentionDims d =
      checks::check_mla_attention_backward(q_t, kr_t, kv_t, probs_t, dout_t, dq_t, dkv_t, dkr_t, dp_row, dims);
  const int64_t T = d.T, W = d.window;
  // dv_h(j) += p(i,j) do_h(i); dp(i,j) = do_h(i) . v_h(j); ds = p (dp - sum_j p dp);
  // dq(i) = scale sum_j ds(i,j) k(j); dk(j) += scale ds(i,j) q(i), the RoPE key's summed over heads.
  const float scale = static_cast<float>(dims.score_scale) / std::sqrt(static_cast<float>(d.qk));
  const float* q = q_t.data<float>();
  const float* kr = kr_t.data<float>();
  const float* kv = kv_t.data<float>();
  const float* probs = probs_t.data<float>();
  const float* dout = dout_t.data<float>();
  float* dqp = dq_t.data<float>();
  float* dkvp = dkv_t.data<float>();
  float* dkrp = dkr_t.data<float>();
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
}

void mla_attend_latents(const Tensor& q_t, const Tensor& latents_t, const Tensor& kv_b, const Tensor& out_t,
                        const MlaDims& m) {
  const checks::MlaLatentDims d = checks::check_mla_attend_latents(q_t, latents_t, kv_b, out_t, m);
  const int64_t H = d.H, dn = d.dn, dr = d.dr, dv = d.dv, dc = d.dc, qk = d.qk, kvw = d.kvw, lw = d.lw;
  const int64_t count = d.count;
  const float scale = static_cast<float>(m.score_scale) / std::sqrt(static_cast<float>(qk));
  const float* q = q_t.data<float>();
  const float* latents = latents_t.data<float>();
  const float* wkvb = kv_b.data<float>();  // (H (d_n + d_v), d_c)
  float* out = out_t.data<float>();
  std::vector<float> qt(static_cast<size_t>(dc)), scores(static_cast<size_t>(count)), ctx(static_cast<size_t>(dc));
  for (int64_t h = 0; h < H; ++h) {
    const float* qn = q + h * qk;
    const float* qr = qn + dn;
    const float* wuk = wkvb + h * kvw * dc;   // (d_n, d_c)
    const float* wuv = wuk + dn * dc;         // (d_v, d_c)
    std::fill(qt.begin(), qt.end(), 0.0f);  // q~ = W_uk^T q_n
    for (int64_t e = 0; e < dn; ++e) {
      for (int64_t k = 0; k < dc; ++k) qt[k] += qn[e] * wuk[e * dc + k];
    }
    float maxs = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < count; ++j) {
      const float* lat = latents + j * lw;
      float s = 0.0f;
      for (int64_t k = 0; k < dc; ++k) s += qt[k] * lat[k];
      for (int64_t e = 0; e < dr; ++e) s += qr[e] * lat[dc + e];
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
      for (int64_t k = 0; k < dc; ++k) ctx[k] += w * latents[j * lw + k];
    }
    float* o = out + h * dv;  // o_h = W_uv ctx
    for (int64_t e = 0; e < dv; ++e) {
      float s = 0.0f;
      for (int64_t k = 0; k < dc; ++k) s += wuv[e * dc + k] * ctx[k];
      o[e] = s;
    }
  }
}

}  // namespace loom::cpu
