// The CUDA backend's multi-head latent attention ops (backend.h: mla_rope ... mla_attend_latents):
// each validates its operands with the CPU's checks (moe_checks.h, same one-line errors), then
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
#include "loom/backend/moe_checks.h"

namespace loom::cuda_backend_detail {

namespace {

// The shared checks' dimensions as the kernels' shape, after cuBLAS's 32-bit size limit (CUDA only).
cuda::MlaShape shape_of(const char* op, const checks::MlaAttentionDims& d, const MlaDims& m) {
  LOOM_CHECK(d.H * d.T <= INT_MAX && d.H * d.kvw <= INT_MAX && d.H * d.qk <= INT_MAX, op, ": ", d.H, " heads of ",
             d.T, " positions exceed cuBLAS's 32-bit sizes");
  cuda::MlaShape s;
  s.B = d.B, s.T = d.T, s.H = d.H, s.dn = d.dn, s.dr = d.dr, s.dv = d.dv, s.window = d.window;
  s.scale = static_cast<float>(m.score_scale) / std::sqrt(static_cast<float>(d.qk));  // as the CPU
  return s;
}

}  // namespace

bool mla_ops_complete() { return true; }

void CudaBackend::mla_rope(const Tensor& x, int64_t heads, int64_t stride, int64_t offset, int64_t rope_dim,
                           const RopeSpec& rope, int64_t pos_offset, bool inverse) {
  checks::check_mla_rope(x, heads, stride, offset, rope_dim, pos_offset);
  const int64_t width = x.dim(2);
  cuda::mla_rope(dptr<float>(x), x.numel() / width, x.dim(1), width, heads, stride, offset, rope_dim, rope, pos_offset,
                 inverse ? -1.0 : 1.0, stream());
}

void CudaBackend::mla_attention_forward(const Tensor& q, const Tensor& kr, const Tensor& kv, const Tensor& probs,
                                        const Tensor& out, const MlaDims& dims) {
  const char* op = "mla_attention_forward";
  const cuda::MlaShape s = shape_of(op, checks::check_mla_attention_forward(q, kr, kv, probs, out, dims), dims);
  cuda::mla_attention_forward(cublas(), dptr<float>(q), dptr<float>(kr), dptr<float>(kv), dptr<float>(probs),
                              dptr<float>(out), s, stream());
}

void CudaBackend::mla_attention_backward(const Tensor& q, const Tensor& kr, const Tensor& kv, const Tensor& probs,
                                         const Tensor& dout, const Tensor& dq, const Tensor& dkv, const Tensor& dkr,
                                         const Tensor& dp_row, const MlaDims& dims) {
  const char* op = "mla_attention_backward";
  const cuda::MlaShape s =
      shape_of(op, checks::check_mla_attention_backward(q, kr, kv, probs, dout, dq, dkv, dkr, dp_row, dims), dims);
  if (s.B == 0 || s.T == 0) return;
  cuda::mla_attention_backward(cublas(), dptr<float>(q), dptr<float>(kr), dptr<float>(kv), dptr<float>(probs),
                               dptr<float>(dout), dptr<float>(dq), dptr<float>(dkv), dptr<float>(dkr),
                               workspace(cuda::mla_attention_backward_scratch_bytes(s)), s, stream());
}

void CudaBackend::mla_attend_latents(const Tensor& q, const Tensor& latents, const Tensor& kv_b, const Tensor& out,
                                     const MlaDims& m) {
  const char* op = "mla_attend_latents";
  const checks::MlaLatentDims d = checks::check_mla_attend_latents(q, latents, kv_b, out, m);
  const int64_t H = d.H, dn = d.dn, dr = d.dr, dv = d.dv, dc = d.dc, qk = d.qk, count = d.count;
  LOOM_CHECK(H <= INT_MAX, op, ": ", H, " heads exceed the grid");
  const float scale = static_cast<float>(m.score_scale) / std::sqrt(static_cast<float>(qk));  // as the CPU
  cuda::mla_attend_latents(dptr<float>(q), dptr<float>(latents), dptr<float>(kv_b), dptr<float>(out), H, dn, dr, dv,
                           dc, count, scale, workspace(cuda::mla_attend_latents_scratch_bytes(H, dc, count)),
                           stream());
}

}  // namespace loom::cuda_backend_detail
