// Attention sinks on the CPU backend (Backend::attention_sink_forward / _backward; backend.h
// states the math): GPT-OSS's per-head sink logit s_h joins each attention row's softmax
// denominator, which scales the row's output by g = sigmoid(lse - s_h) (lse: the row's
// log-sum-exp over its keys). Rows (b, t) in parallel; the sinks' gradient sums per head over
// fixed blocks of rows, added in order, so the sum does not depend on the thread count.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "loom/backend/checks.h"
#include "loom/backend/cpu/cpu_backend_internal.h"

namespace loom::cpu_backend_detail {
namespace {

struct SinkDims {
  int64_t B = 0, T = 0, H = 0, hd = 0;
};
SinkDims dims_of(const checks::Dims3& d, int64_t n_head) { return {d.a, d.b, n_head, d.c}; }

template <typename F>
F sink_gate(F lse, F sink) {
  return F(1) / (F(1) + std::exp(sink - lse));
}

}  // namespace

void CpuBackend::attention_sink_forward(const Tensor& out, const Tensor& lse, const Tensor& sinks, int64_t n_head) {
  const char* op = "attention_sink_forward";
  const SinkDims d = dims_of(checks::check_attention_sinks(op, out, lse, sinks, n_head), n_head);
  dispatch_float(out.dtype(), op, kBackend, [&]<typename F>() {
    F* o = out.data<F>();
    const F* l = lse.data<F>();
    const F* s = sinks.data<F>();
#pragma omp parallel for schedule(static)
    for (int64_t bt = 0; bt < d.B * d.T; ++bt) {
      const int64_t b = bt / d.T, t = bt % d.T;
      for (int64_t h = 0; h < d.H; ++h) {
        const F g = sink_gate(l[(b * d.H + h) * d.T + t], s[h]);
        F* row = o + (bt * d.H + h) * d.hd;
        for (int64_t i = 0; i < d.hd; ++i) row[i] *= g;
      }
    }
  });
}

void CpuBackend::attention_sink_backward(const Tensor& dout, const Tensor& out, const Tensor& lse, const Tensor& sinks,
                                         const Tensor& dsinks, int64_t n_head) {
  const char* op = "attention_sink_backward";
  const SinkDims d = dims_of(checks::check_attention_sinks(op, out, lse, sinks, n_head, &dout, &dsinks), n_head);
  dispatch_float(out.dtype(), op, kBackend, [&]<typename F>() {
    F* dO = dout.data<F>();
    const F* O = out.data<F>();
    const F* l = lse.data<F>();
    const F* s = sinks.data<F>();
    constexpr int64_t kBlock = 64;  // rows per partial sum
    const int64_t rows = d.B * d.T, blocks = (rows + kBlock - 1) / kBlock;
    std::vector<F> partial(static_cast<size_t>(blocks * d.H), F(0));
#pragma omp parallel for schedule(static)
    for (int64_t blk = 0; blk < blocks; ++blk) {
      for (int64_t bt = blk * kBlock; bt < std::min(rows, (blk + 1) * kBlock); ++bt) {
        const int64_t b = bt / d.T, t = bt % d.T;
        for (int64_t h = 0; h < d.H; ++h) {
          const F g = sink_gate(l[(b * d.H + h) * d.T + t], s[h]);
          F* drow = dO + (bt * d.H + h) * d.hd;
          const F* orow = O + (bt * d.H + h) * d.hd;
          F dot = 0;
          for (int64_t i = 0; i < d.hd; ++i) dot += drow[i] * orow[i];
          partial[static_cast<size_t>(blk * d.H + h)] -= (F(1) - g) * dot;  // d(sink) = -(1 - g) dO . O
          for (int64_t i = 0; i < d.hd; ++i) drow[i] *= g;                  // dO' = g dO
        }
      }
    }
    F* ds = dsinks.data<F>();
    for (int64_t blk = 0; blk < blocks; ++blk) {
      for (int64_t h = 0; h < d.H; ++h) ds[h] += partial[static_cast<size_t>(blk * d.H + h)];
    }
  });
}

}  // namespace loom::cpu_backend_detail
