// The CUDA backend's Adafactor, SM3, CAME and LDAdam ops (contracts in backend.h; kernels in
// cuda_optim_factored.cu). Each op validates its operands with the checks it shares with the
// CPU (optim_checks.h: the same messages), then enqueues its kernels on the backend's
// stream, with scratch from workspace(). Nothing synchronizes except leading_eigenvectors:
//   leading_eigenvectors is a host round trip: s is read to the host, the CPU's own
//   cpu::leading_eigenvectors (LAPACK dsyevd in double, as the contract states) runs there, and p
//   is written back. LDAdam calls it once per hidden matrix, at step 1 only (optim/ldadam.cpp),
//   on s = G G^T of n = min(rows, cols) (768 for GPT-2 124M: 2.4 MB of f32), so the copy and the
//   synchronization are paid once per run; cuSOLVER is neither linked nor in the simulator.
// Adafactor, SM3 and CAME: the factored row and column statistics and the RMS run on the device
// (the RMS scalars stay in device memory, read by the update kernels: no host round trip).
#include <cmath>
#include <initializer_list>
#include <utility>

#include "loom/backend/cpu/cpu_optim_ops.h"
#include "loom/backend/cuda/cuda_backend_internal.h"
#include "loom/backend/cuda/cuda_optim_factored.h"
#include "loom/backend/optim_checks.h"

namespace loom::cuda_backend_detail {

bool optim_factored_ops_complete() { return true; }

namespace {

cuda::FactoredHyper factored_hyper(const OptimHyper& h) {
  cuda::FactoredHyper f;
  f.lr = h.lr;
  f.weight_decay = h.weight_decay;
  f.grad_scale = h.grad_scale;
  f.beta1 = h.beta1;
  f.beta2 = h.beta2;
  f.beta3 = h.beta3;
  f.eps = h.eps;
  f.eps2 = h.eps2;
  f.clip_threshold = h.clip_threshold;
  f.scale_parameter = h.scale_parameter;
  return f;
}

}  // namespace

void CudaBackend::adafactor_step(const Tensor& param, const Tensor& grad, const Tensor& state, const Tensor& m,
                                 const Tensor& u, const OptimHyper& hyper) {
  const auto [rows, cols] = checks::check_adafactor_step(param, grad, state, m, u, hyper.factored);
  LOOM_CHECK(u.defined(), "adafactor_step: needs the u operand (scratch of the segment's size)");
  void* scratch = workspace(cuda::adafactor_scratch_bytes(rows, cols));
  cuda::adafactor_step(dptr<float>(param), dptr<float>(grad), dptr<float>(state), dptr_or_null<float>(m), dptr<float>(u), rows, cols,
                       hyper.factored, factored_hyper(hyper), scratch, stream());
}

void CudaBackend::sm3_step(const Tensor& param, const Tensor& grad, const Tensor& acc, const OptimHyper& hyper) {
  const auto [rows, cols] = checks::check_sm3_step(param, grad, acc, hyper.factored);
  void* scratch = hyper.factored ? workspace(cuda::sm3_scratch_bytes(rows, cols)) : nullptr;
  cuda::sm3_step(dptr<float>(param), dptr<float>(grad), dptr<float>(acc), rows, cols, hyper.factored,
                 factored_hyper(hyper), scratch, stream());
}

void CudaBackend::came_step(const Tensor& param, const Tensor& grad, const Tensor& state, const Tensor& m,
                            const Tensor& res, const Tensor& u, const OptimHyper& hyper) {
  const auto [rows, cols] = checks::check_came_step(param, grad, state, m, res, u, hyper.factored);
  LOOM_CHECK(u.defined(), "came_step: needs the u operand (scratch of the segment's size)");
  void* scratch = workspace(cuda::came_scratch_bytes(rows, cols));
  cuda::came_step(dptr<float>(param), dptr<float>(grad), dptr<float>(state), dptr<float>(m),
                  hyper.factored ? dptr<float>(res) : nullptr, dptr<float>(u), rows, cols, hyper.factored,
                  factored_hyper(hyper), scratch, stream());
}

void CudaBackend::leading_eigenvectors(const Tensor& s, const Tensor& p) {
  const auto [n, r] = checks::check_leading_eigenvectors(s, p);
  // Host round trip (see the file comment): the CPU's own LAPACK call on a host copy of s.
  CpuAllocator host;
  {
    const Tensor hs = Tensor::empty(host, {n, n}, DTYPE_F32, MEM_WORKSPACE);
    const Tensor hp = Tensor::empty(host, {n, r}, DTYPE_F32, MEM_WORKSPACE);
    read(s, hs.raw_data());
    cpu::leading_eigenvectors(hs, hp);
    write(p, hp.raw_data());
  }
}

void CudaBackend::gram_schmidt(const Tensor& y, const Tensor& fallback, const Tensor& p) {
  const auto [n, r] = checks::check_gram_schmidt(y, fallback, p);
  void* scratch = workspace(cuda::gram_schmidt_scratch_bytes(n, r));
  cuda::gram_schmidt(dptr<float>(y), dptr<float>(fallback), dptr<float>(p), n, r, scratch, stream());
}

void CudaBackend::ldadam_rotate(const Tensor& p, const Tensor& prev, const Tensor& m, const Tensor& v, const Tensor& mt,
                                const Tensor& vt, const OptimHyper& hyper) {
  const auto [M, r, N] = checks::check_ldadam_rotate(p, prev, m, v, mt, vt);
  LOOM_CHECK(r > 0, "ldadam_rotate: p ", p.describe(), " has no columns");
  const double t = static_cast<double>(hyper.step);
  const double bc1_prev = 1.0 - std::pow(hyper.beta1, t - 1.0), bc2_prev = 1.0 - std::pow(hyper.beta2, t - 1.0);
  void* scratch = workspace(cuda::ldadam_rotate_scratch_bytes(r));
  cuda::ldadam_rotate(dptr<float>(p), dptr<float>(prev), dptr<float>(m), dptr<float>(v), dptr<float>(mt),
                      dptr<float>(vt), M, r, N, hyper.step, bc1_prev, bc2_prev, scratch, stream());
}

void CudaBackend::ldadam_adam(const Tensor& m, const Tensor& v, const Tensor& mt, const Tensor& vt, const Tensor& gh,
                              const OptimHyper& hyper) {
  const int64_t n = checks::check_ldadam_adam(m, v, mt, vt, gh);
  const double t = static_cast<double>(hyper.step);
  const float bc1 = static_cast<float>(1.0 - std::pow(hyper.beta1, t));
  const float bc2 = static_cast<float>(1.0 - std::pow(hyper.beta2, t));
  cuda::ldadam_adam(dptr<float>(m), dptr<float>(v), dptr<float>(mt), dptr<float>(vt), dptr<float>(gh), n,
                    static_cast<float>(hyper.beta1), static_cast<float>(hyper.beta2), bc1, bc2,
                    static_cast<float>(hyper.eps), stream());
}

void CudaBackend::ldadam_apply(const Tensor& param, const Tensor& grad, const Tensor& d, const Tensor& e, bool transpose,
                               const OptimHyper& hyper) {
  const auto [rows, cols] = checks::check_ldadam_apply(param, grad, d, e);
  const float eta = static_cast<float>(hyper.lr), decay = 1.0f - eta * hyper.weight_decay;
  cuda::ldadam_apply(dptr<float>(param), dptr<float>(grad), dptr<float>(d), dptr<float>(e), rows, cols, transpose, eta,
                     decay, stream());
}

}  // namespace loom::cuda_backend_detail
