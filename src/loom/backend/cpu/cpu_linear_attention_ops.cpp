// The CPU kernels of Qwen3-Next's linear-attention helpers around the gated delta rule
// (Backend::causal_conv1d_silu_* and Backend::delta_gates_*; backend.h states the math and the
// layouts): the causal depthwise convolution with SiLU over [q | k | v] channels, and the gates
// beta = sigmoid(b), g = -exp(a_log) softplus(a + dt_bias). Written from transformers'
// Qwen3NextGatedDeltaNet (torch_causal_conv1d_update / the F.conv1d fallback, F.softplus) and
// tools/make_qwen3_next_fixture.py's float64 reference.
//
// Work: rows (b, t) in parallel over OpenMP threads, channels contiguous in the inner loop; the
// weight gradients reduce per channel block (conv) or per head (gates) on one thread each, so every
// sum has a fixed order whatever the thread count. Sums run in the operands' dtype (f32 or f64).
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "loom/backend/checks.h"
#include "loom/backend/cpu/cpu_backend_internal.h"

namespace loom::cpu_backend_detail {
namespace {

template <typename F>
F sigmoid_of(F x) {
  return F(1) / (F(1) + std::exp(-x));
}

// softplus as torch's F.softplus (beta 1, threshold 20): x above 20, else log(1 + exp(x)); and its
// derivative (1 above 20, else sigmoid(x)).
template <typename F>
F softplus_of(F x) {
  return x > F(20) ? x : std::log1p(std::exp(x));
}
template <typename F>
F softplus_grad(F x) {
  return x > F(20) ? F(1) : sigmoid_of(x);
}

// ---------------------------------------------------------------- causal conv1d + SiLU
// x' = [initial; x] per batch row: row s of x' for s in [-(K-1), T) is x's row s (s >= 0) or
// initial's row K-1+s; nullptr where initial is undefined (zeros).
template <typename F>
struct ConvInput {
  const F* x;
  const F* initial;  // nullptr: zeros
  int64_t T, C, K;
  const F* row(int64_t b, int64_t s) const {
    if (s >= 0) return x + (b * T + s) * C;
    return initial == nullptr ? nullptr : initial + (b * (K - 1) + (K - 1 + s)) * C;
  }
};

// pre (C) = the pre-activation of row (b, t): sum_i w[c, i] x'[b, t - K + 1 + i, c], i ascending.
template <typename F>
void conv_pre_row(const ConvInput<F>& in, const F* w, int64_t b, int64_t t, F* pre) {
  const int64_t C = in.C, K = in.K;
  std::fill(pre, pre + C, F(0));
  for (int64_t i = 0; i < K; ++i) {
    const F* src = in.row(b, t - K + 1 + i);
    if (src == nullptr) continue;
    for (int64_t c = 0; c < C; ++c) pre[c] += w[c * K + i] * src[c];
  }
}

template <typename F>
void conv_forward_kernel(const ConvInput<F>& in, int64_t B, const F* w, F* y, F* final_state) {
  const int64_t T = in.T, C = in.C, K = in.K;
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < B * T; ++n) {
    F* yr = y + n * C;
    conv_pre_row(in, w, n / T, n % T, yr);
    for (int64_t c = 0; c < C; ++c) yr[c] = yr[c] * sigmoid_of(yr[c]);
  }
  if (final_state == nullptr || K == 1) return;
  // final row j = x' row T - K + 1 + j. Rows ascending: row j reads initial's row T + j > j when it
  // reads initial at all, so final may even be initial itself (an in-place cache update).
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t j = 0; j < K - 1; ++j) {
      F* dst = final_state + (b * (K - 1) + j) * C;
      const F* src = in.row(b, T - K + 1 + j);
      if (src == nullptr) std::fill(dst, dst + C, F(0));
      else if (src != dst) std::memmove(dst, src, sizeof(F) * C);
    }
  }
}

// dpre (B T C) is scratch: d(pre-activation) = dy silu'(pre), silu'(z) = s (1 + z (1 - s)).
// dx[b, s, c] (and dinitial's rows, s < 0) = sum_i w[c, i] dpre[b, s + K - 1 - i, c] over the
// outputs that read x' row s; dweight[c, i] += sum_{b, t} dpre[b, t, c] x'[b, t - K + 1 + i, c].
template <typename F>
void conv_backward_kernel(const ConvInput<F>& in, int64_t B, const F* w, const F* dy, F* dx, F* dweight, F* dinitial,
                          F* dpre) {
  const int64_t T = in.T, C = in.C, K = in.K;
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < B * T; ++n) {
    F* p = dpre + n * C;
    const F* g = dy + n * C;
    conv_pre_row(in, w, n / T, n % T, p);
    for (int64_t c = 0; c < C; ++c) {
      const F z = p[c], s = sigmoid_of(z);
      p[c] = g[c] * s * (F(1) + z * (F(1) - s));
    }
  }
  // Rows of x' (s from -(K-1) to T-1) per batch row: x's into dx, the ones before into dinitial.
  const int64_t span = T + K - 1;
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < B * span; ++n) {
    const int64_t b = n / span, s = n % span - (K - 1);
    F* dst = s >= 0 ? dx + (b * T + s) * C : (dinitial == nullptr ? nullptr : dinitial + (b * (K - 1) + K - 1 + s) * C);
    if (dst == nullptr) continue;
    std::fill(dst, dst + C, F(0));
    for (int64_t i = 0; i < K; ++i) {
      const int64_t t = s + K - 1 - i;  // the output whose tap i reads row s
      if (t < 0 || t >= T) continue;
      const F* p = dpre + (b * T + t) * C;
      for (int64_t c = 0; c < C; ++c) dst[c] += w[c * K + i] * p[c];
    }
  }
  // dweight per block of channels, each block's sums on one thread in (b, t) order.
  constexpr int64_t kBlock = 64;
  const int64_t blocks = (C + kBlock - 1) / kBlock;
#pragma omp parallel
  {
    std::vector<F> acc(static_cast<size_t>(kBlock * K));
#pragma omp for schedule(static)
    for (int64_t blk = 0; blk < blocks; ++blk) {
      const int64_t c0 = blk * kBlock, c1 = std::min(C, c0 + kBlock);
      std::fill(acc.begin(), acc.end(), F(0));
      for (int64_t b = 0; b < B; ++b) {
        for (int64_t t = 0; t < T; ++t) {
          const F* p = dpre + (b * T + t) * C;
          for (int64_t i = 0; i < K; ++i) {
            const F* src = in.row(b, t - K + 1 + i);
            if (src == nullptr) continue;
            for (int64_t c = c0; c < c1; ++c) acc[static_cast<size_t>((c - c0) * K + i)] += p[c] * src[c];
          }
        }
      }
      for (int64_t c = c0; c < c1; ++c) {
        for (int64_t i = 0; i < K; ++i) dweight[c * K + i] += acc[static_cast<size_t>((c - c0) * K + i)];
      }
    }
  }
}

// ---------------------------------------------------------------- the gates
template <typename F>
void gates_forward_kernel(int64_t N, int64_t H, const F* ba, const F* a_log, const F* dt_bias, F* g, F* beta) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const F* b = ba + n * 2 * H;
    const F* a = b + H;
    for (int64_t h = 0; h < H; ++h) {
      beta[n * H + h] = sigmoid_of(b[h]);
      g[n * H + h] = -std::exp(a_log[h]) * softplus_of(a[h] + dt_bias[h]);
    }
  }
}

// d(b) = dbeta beta (1 - beta); d(a) = dg (-exp(a_log)) softplus'(a + dt_bias);
// da_log += sum_n dg g (g is linear in exp(a_log)); ddt_bias += sum_n d(a).
template <typename F>
void gates_backward_kernel(int64_t N, int64_t H, const F* ba, const F* a_log, const F* dt_bias, const F* dg,
                           const F* dbeta, F* dba, F* da_log, F* ddt_bias) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const F* b = ba + n * 2 * H;
    const F* a = b + H;
    F* db = dba + n * 2 * H;
    F* da = db + H;
    for (int64_t h = 0; h < H; ++h) {
      const F s = sigmoid_of(b[h]);
      db[h] = dbeta[n * H + h] * s * (F(1) - s);
      da[h] = -dg[n * H + h] * std::exp(a_log[h]) * softplus_grad(a[h] + dt_bias[h]);
    }
  }
#pragma omp parallel for schedule(static)
  for (int64_t h = 0; h < H; ++h) {
    const F A = std::exp(a_log[h]);
    F sa = 0, sb = 0;
    for (int64_t n = 0; n < N; ++n) {
      sa += dg[n * H + h] * (-A * softplus_of(ba[n * 2 * H + H + h] + dt_bias[h]));
      sb += dba[n * 2 * H + H + h];
    }
    da_log[h] += sa;
    ddt_bias[h] += sb;
  }
}

template <typename F>
const F* data_or_null(const Tensor& t) {
  return t.defined() ? t.data<F>() : nullptr;
}

}  // namespace

void CpuBackend::causal_conv1d_silu_forward(const Tensor& x, const Tensor& weight, const Tensor& initial,
                                            const Tensor& y, const Tensor& final_state) {
  const char* op = "causal_conv1d_silu_forward";
  const checks::ConvDims d = checks::check_causal_conv1d(op, x, weight, initial, y, "y", final_state);
  dispatch_float(x.dtype(), op, kBackend, [&]<typename F>() {
    const ConvInput<F> in{x.data<F>(), data_or_null<F>(initial), d.T, d.C, d.K};
    conv_forward_kernel<F>(in, d.B, weight.data<F>(), y.data<F>(),
                           final_state.defined() ? final_state.data<F>() : nullptr);
  });
}

void CpuBackend::causal_conv1d_silu_backward(const Tensor& x, const Tensor& weight, const Tensor& initial,
                                             const Tensor& dy, const Tensor& dx, const Tensor& dweight,
                                             const Tensor& dinitial) {
  const char* op = "causal_conv1d_silu_backward";
  const checks::ConvDims d = checks::check_causal_conv1d(op, x, weight, initial, dy, "dy", Tensor());
  checks::check_causal_conv1d_grads(op, d, x, dx, dweight, dinitial);
  dispatch_float(x.dtype(), op, kBackend, [&]<typename F>() {
    const Tensor ws = workspace(std::max<int64_t>(d.B * d.T * d.C, 1), x.dtype());
    const ConvInput<F> in{x.data<F>(), data_or_null<F>(initial), d.T, d.C, d.K};
    conv_backward_kernel<F>(in, d.B, weight.data<F>(), dy.data<F>(), dx.data<F>(), dweight.data<F>(),
                            dinitial.defined() ? dinitial.data<F>() : nullptr, ws.data<F>());
  });
}

void CpuBackend::delta_gates_forward(const Tensor& ba, const Tensor& a_log, const Tensor& dt_bias, const Tensor& g,
                                     const Tensor& beta) {
  const char* op = "delta_gates_forward";
  const checks::GateDims d = checks::check_delta_gates(op, ba, a_log, dt_bias, g, "g", beta, "beta");
  dispatch_float(ba.dtype(), op, kBackend, [&]<typename F>() {
    gates_forward_kernel<F>(d.N, d.H, ba.data<F>(), a_log.data<F>(), dt_bias.data<F>(), g.data<F>(), beta.data<F>());
  });
}

void CpuBackend::delta_gates_backward(const Tensor& ba, const Tensor& a_log, const Tensor& dt_bias, const Tensor& dg,
                                      const Tensor& dbeta, const Tensor& dba, const Tensor& da_log,
                                      const Tensor& ddt_bias) {
  const char* op = "delta_gates_backward";
  const checks::GateDims d = checks::check_delta_gates(op, ba, a_log, dt_bias, dg, "dg", dbeta, "dbeta");
  checks::check_delta_gates_grads(op, ba, a_log, dba, da_log, ddt_bias);
  dispatch_float(ba.dtype(), op, kBackend, [&]<typename F>() {
    gates_backward_kernel<F>(d.N, d.H, ba.data<F>(), a_log.data<F>(), dt_bias.data<F>(), dg.data<F>(),
                             dbeta.data<F>(), dba.data<F>(), da_log.data<F>(), ddt_bias.data<F>());
  });
}

}  // namespace loom::cpu_backend_detail
