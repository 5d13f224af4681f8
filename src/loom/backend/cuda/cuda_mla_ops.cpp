// The CUDA backend's multi-head latent attention ops (backend.h: mla_rope ... mla_attend_latents):
// each validates its operands as the CPU does (cpu/cpu_mla_ops.cpp, same one-line errors), then
// runs cuda_mla.cu on the backend's stream:
//   mla_rope                one kernel over (row, pair), the heads' slices in a loop;
//   mla_attention_forward   per sequence, strided-batched cuBLAS GEMMs over the heads (S = Q_n K_n^T
//                           + Q_r K_r^T, O = P V) around one masked-softmax kernel;
//   mla_attention_backward  per sequence, GEMMs for dV, dP, dQ, dK_n, dK_r around the dS row kernel;
//                           its scratch (one sequence's dS, H T^2 floats) is the backend's
//                           workspace(): the contract's dp_row (T floats) is too small and unused;
//   mla_attend_latents      one block per head (decoding), scratch in workspace().
// No op synchronizes with the host.
#include <climits>
#include <cmath>

#include "loom/backend/cuda/cuda_backend_internal.h"
#include "loom/backend/cuda/cuda_mla.h"

namespace loom::cuda_backend_detail {

namespace {

using checks::expect_dtype;
using checks::expect_numel;

void expect_shape(const char* op, const char* what, const Tensor& t, const Shape& shape) {
  LOOM_CHECK(t.shape() == shape && t.dtype() == DTYPE_F32, op, ": ", what, " is ", t.describe(), ", expected f32",
             shape_str(shape));
}

// q (B,T,H qk), kr (B,T,d_r), kv (B,T,H (d_n + d_v)), probs (B,H,T,T), out / dout (B,T,H d_v).
cuda::MlaShape check_attention(const char* op, const Tensor& q, const Tensor& kr, const Tensor& kv,
                               const Tensor& probs, const Tensor& out, const MlaDims& m) {
  LOOM_CHECK(m.n_head >= 1 && m.nope >= 0 && m.rope >= 0 && m.v >= 1 && m.nope + m.rope >= 1 && m.window >= 0 &&
                 q.ndim() == 3,
             op, ": bad dimensions (", m.n_head, " heads, d_n ", m.nope, ", d_r ", m.rope, ", d_v ", m.v,
             ", window ", m.window, ") or q ", q.describe());
  cuda::MlaShape s;
  s.B = q.dim(0), s.T = q.dim(1), s.H = m.n_head, s.dn = m.nope, s.dr = m.rope, s.dv = m.v, s.window = m.window;
  const int64_t qk = s.dn + s.dr, kvw = s.dn + s.dv;
  expect_shape(op, "q", q, {s.B, s.T, s.H * qk});
  expect_shape(op, "kr", kr, {s.B, s.T, s.dr});
  expect_shape(op, "kv", kv, {s.B, s.T, s.H * kvw});
  expect_shape(op, "probs", probs, {s.B, s.H, s.T, s.T});
  expect_shape(op, "out", out, {s.B, s.T, s.H * s.dv});
  LOOM_CHECK(s.H * s.T <= INT_MAX && s.H * kvw <= INT_MAX && s.H * qk <= INT_MAX, op, ": ", s.H, " heads of ", s.T,
             " positions exceed cuBLAS's 32-bit sizes");
  s.scale = static_cast<float>(m.score_scale) / std::sqrt(static_cast<float>(qk));  // as the CPU
  return s;
}

}  // namespace

bool mla_ops_complete() { return true; }

void CudaBackend::mla_rope(const Tensor& x, int64_t heads, int64_t stride, int64_t offset, int64_t rope_dim,
                           const RopeSpec& rope, int64_t pos_offset, bool inverse) {
  const char* op = "mla_rope";
  expect_dtype(x, DTYPE_F32, op, "x");
  LOOM_CHECK(x.ndim() == 3 && rope_dim > 0 && rope_dim % 2 == 0 && heads >= 1 && offset >= 0 && pos_offset >= 0 &&
                 offset + (heads - 1) * stride + rope_dim <= x.dim(2),
             op, ": x ", x.describe(), " has no ", heads, " slices of width ", rope_dim, " at ", offset, " + h ",
             stride);
  const int64_t width = x.dim(2);
  cuda::mla_rope(dptr<float>(x), x.numel() / width, x.dim(1), width, heads, stride, offset, rope_dim, rope, pos_offset,
                 inverse ? -1.0 : 1.0, stream());
}

void CudaBackend::mla_attention_forward(const Tensor& q, const Tensor& kr, const Tensor& kv, const Tensor& probs,
                                        const Tensor& out, const MlaDims& dims) {
  const cuda::MlaShape s = check_attention("mla_attention_forward", q, kr, kv, probs, out, dims);
  cuda::mla_attention_forward(cublas(), dptr<float>(q), dptr<float>(kr), dptr<float>(kv), dptr<float>(probs),
                              dptr<float>(out), s, stream());
}

void CudaBackend::mla_attention_backward(const Tensor& q, const Tensor& kr, const Tensor& kv, const Tensor& probs,
                                         const Tensor& dout, const Tensor& dq, const Tensor& dkv, const Tensor& dkr,
                                         const Tensor& dp_row, const MlaDims& dims) {
  const char* op = "mla_attention_backward";
  const cuda::MlaShape s = check_attention(op, q, kr, kv, probs, dout, dims);
  expect_shape(op, "dq", dq, q.shape());
  expect_shape(op, "dkv", dkv, kv.shape());
  expect_shape(op, "dkr", dkr, kr.shape());
  expect_dtype(dp_row, DTYPE_F32, op, "dp_row");
  LOOM_CHECK(dp_row.numel() >= s.T, op, ": dp_row ", dp_row.describe(), " holds fewer than T = ", s.T, " floats");
  if (s.B == 0 || s.T == 0) return;
  cuda::mla_attention_backward(cublas(), dptr<float>(q), dptr<float>(kr), dptr<float>(kv), dptr<float>(probs),
                               dptr<float>(dout), dptr<float>(dq), dptr<float>(dkv), dptr<float>(dkr),
                               workspace(cuda::mla_attention_backward_scratch_bytes(s)), s, stream());
}

void CudaBackend::mla_attend_latents(const Tensor& q, const Tensor& latents, const Tensor& kv_b, const Tensor& out,
                                     const MlaDims& m) {
  const char* op = "mla_attend_latents";
  const int64_t H = m.n_head, dn = m.nope, dr = m.rope, dv = m.v, dc = m.latent, qk = dn + dr, kvw = dn + dv;
  const int64_t lw = dc + dr;
  LOOM_CHECK(H >= 1 && dc >= 1 && qk >= 1 && dv >= 1 && latents.ndim() == 2 && latents.dim(1) == lw &&
                 latents.dim(0) >= 1,
             op, ": latents ", latents.describe(), " for d_c ", dc, " + d_r ", dr, " (at least one position)");
  expect_dtype(latents, DTYPE_F32, op, "latents");
  expect_dtype(q, DTYPE_F32, op, "q");
  expect_numel(q, H * qk, op, "q");
  expect_shape(op, "kv_b", kv_b, {H * kvw, dc});
  expect_dtype(out, DTYPE_F32, op, "out");
  expect_numel(out, H * dv, op, "out");
  LOOM_CHECK(H <= INT_MAX, op, ": ", H, " heads exceed the grid");
  const int64_t count = latents.dim(0);
  const float scale = static_cast<float>(m.score_scale) / std::sqrt(static_cast<float>(qk));  // as the CPU
  cuda::mla_attend_latents(dptr<float>(q), dptr<float>(latents), dptr<float>(kv_b), dptr<float>(out), H, dn, dr, dv,
                           dc, count, scale, workspace(cuda::mla_attend_latents_scratch_bytes(H, dc, count)),
                           stream());
}

}  // namespace loom::cuda_backend_detail
