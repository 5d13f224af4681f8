// The CUDA backend's linear-attention ops (backend.h: delta_rule_*, causal_conv1d_silu_*,
// delta_gates_*; Qwen3-Next's Gated DeltaNet layers): each validates its operands with the CPU's
// checks (checks.h, the same one-line errors), then runs cuda_linear_attention.cu on the
// backend's stream, scratch in workspace(). Both delta-rule forms run the recurrent kernels
// (backend.h: the forms agree to rounding); the chunk is the backward's checkpoint interval.
// No op synchronizes with the host.
#include "loom/backend/checks.h"
#include "loom/backend/cuda/cuda_backend_internal.h"
#include "loom/backend/cuda/cuda_linear_attention.h"

namespace loom::cuda_backend_detail {

using checks::dispatch_float;

namespace {

constexpr int64_t kMaxHeadDim = 256;  // cuda_linear_attention.cu's shared rows

cuda::DeltaRuleShape delta_shape(const char* op, const checks::DeltaRuleDims& d, int64_t chunk) {
  LOOM_CHECK(d.dk <= kMaxHeadDim && d.dv <= kMaxHeadDim, op, ": key / value head dims ", d.dk, " / ", d.dv,
             " exceed the CUDA kernel's ", kMaxHeadDim);
  return cuda::DeltaRuleShape{.B = d.B, .T = d.T, .Hv = d.H, .Hk = d.Hk, .dk = d.dk, .dv = d.dv, .chunk = chunk};
}

}  // namespace

void CudaBackend::delta_rule_forward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                                     const Tensor& beta, const Tensor& initial_state, const Tensor& out,
                                     const Tensor& final_state, DeltaRuleForm, int64_t chunk) {
  const char* op = "delta_rule_forward";
  const checks::DeltaRuleDims d = checks::check_delta_rule(q, k, v, g, beta, initial_state, out, final_state, chunk);
  const cuda::DeltaRuleShape s = delta_shape(op, d, chunk);
  dispatch_float(q.dtype(), op, kBackend, [&]<typename F>() {
    void* scratch = final_state.defined() ? nullptr : workspace(cuda::delta_rule_forward_scratch_bytes(s, sizeof(F)));
    cuda::delta_rule_forward<F>(dptr<F>(q), dptr<F>(k), dptr<F>(v), dptr<F>(g), dptr<F>(beta),
                                dptr_or_null<F>(initial_state), dptr<F>(out), dptr_or_null<F>(final_state), scratch,
                                s, stream_);
  });
}

void CudaBackend::delta_rule_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                                      const Tensor& beta, const Tensor& initial_state, const Tensor& dout,
                                      const Tensor& dfinal_state, const Tensor& dq, const Tensor& dk, const Tensor& dv,
                                      const Tensor& dg, const Tensor& dbeta, const Tensor& dinitial_state,
                                      DeltaRuleForm, int64_t chunk) {
  const char* op = "delta_rule_backward";
  const checks::DeltaRuleDims d = checks::check_delta_rule_backward(q, k, v, g, beta, initial_state, dout, dfinal_state,
                                                                    dq, dk, dv, dg, dbeta, dinitial_state, chunk);
  const cuda::DeltaRuleShape s = delta_shape(op, d, chunk);
  dispatch_float(q.dtype(), op, kBackend, [&]<typename F>() {
    void* scratch = workspace(cuda::delta_rule_backward_scratch_bytes(s, sizeof(F)));
    cuda::delta_rule_backward<F>(dptr<F>(q), dptr<F>(k), dptr<F>(v), dptr<F>(g), dptr<F>(beta),
                                 dptr_or_null<F>(initial_state), dptr<F>(dout), dptr_or_null<F>(dfinal_state),
                                 dptr<F>(dq), dptr<F>(dk), dptr<F>(dv), dptr<F>(dg), dptr<F>(dbeta),
                                 dptr_or_null<F>(dinitial_state), scratch, s, stream_);
  });
}

void CudaBackend::causal_conv1d_silu_forward(const Tensor& x, const Tensor& weight, const Tensor& initial,
                                             const Tensor& y, const Tensor& final_state) {
  const char* op = "causal_conv1d_silu_forward";
  const checks::ConvDims d = checks::check_causal_conv1d(op, x, weight, initial, y, "y", final_state);
  dispatch_float(x.dtype(), op, kBackend, [&]<typename F>() {
    cuda::causal_conv1d_silu_forward<F>(dptr<F>(x), dptr<F>(weight), dptr_or_null<F>(initial), dptr<F>(y),
                                        dptr_or_null<F>(final_state), d.B, d.T, d.C, d.K, stream_);
  });
}

void CudaBackend::causal_conv1d_silu_backward(const Tensor& x, const Tensor& weight, const Tensor& initial,
                                              const Tensor& dy, const Tensor& dx, const Tensor& dweight,
                                              const Tensor& dinitial) {
  const char* op = "causal_conv1d_silu_backward";
  const checks::ConvDims d = checks::check_causal_conv1d(op, x, weight, initial, dy, "dy", Tensor());
  checks::check_causal_conv1d_grads(op, d, x, dx, dweight, dinitial);
  dispatch_float(x.dtype(), op, kBackend, [&]<typename F>() {
    void* scratch = workspace(cuda::causal_conv1d_silu_backward_scratch_bytes(d.B, d.T, d.C, sizeof(F)));
    cuda::causal_conv1d_silu_backward<F>(dptr<F>(x), dptr<F>(weight), dptr_or_null<F>(initial), dptr<F>(dy),
                                         dptr<F>(dx), dptr<F>(dweight), dptr_or_null<F>(dinitial), scratch, d.B,
                                         d.T, d.C, d.K, stream_);
  });
}

void CudaBackend::delta_gates_forward(const Tensor& ba, const Tensor& a_log, const Tensor& dt_bias, const Tensor& g,
                                      const Tensor& beta) {
  const char* op = "delta_gates_forward";
  const checks::GateDims d = checks::check_delta_gates(op, ba, a_log, dt_bias, g, "g", beta, "beta");
  dispatch_float(ba.dtype(), op, kBackend, [&]<typename F>() {
    cuda::delta_gates_forward<F>(dptr<F>(ba), dptr<F>(a_log), dptr<F>(dt_bias), dptr<F>(g), dptr<F>(beta), d.N, d.H,
                                 stream_);
  });
}

void CudaBackend::delta_gates_backward(const Tensor& ba, const Tensor& a_log, const Tensor& dt_bias, const Tensor& dg,
                                       const Tensor& dbeta, const Tensor& dba, const Tensor& da_log,
                                       const Tensor& ddt_bias) {
  const char* op = "delta_gates_backward";
  const checks::GateDims d = checks::check_delta_gates(op, ba, a_log, dt_bias, dg, "dg", dbeta, "dbeta");
  checks::check_delta_gates_grads(op, ba, a_log, dba, da_log, ddt_bias);
  dispatch_float(ba.dtype(), op, kBackend, [&]<typename F>() {
    cuda::delta_gates_backward<F>(dptr<F>(ba), dptr<F>(a_log), dptr<F>(dt_bias), dptr<F>(dg), dptr<F>(dbeta),
                                  dptr<F>(dba), dptr<F>(da_log), dptr<F>(ddt_bias), d.N, d.H, stream_);
  });
}

}  // namespace loom::cuda_backend_detail
