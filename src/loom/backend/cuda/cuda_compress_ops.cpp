// The CUDA backend's gradient compression ops (Top-K, DGC, 1-bit, QSGD, PowerSGD; contracts in
// backend.h, kernels in cuda_compress.cu). Each op validates its operands with the checks it
// shares with the CPU (compress_checks.h: the same messages), then enqueues its kernels on the backend's stream;
// the results are the CPU's bytes (the contracts fix every summation order, and the kernels
// follow them). Scratch comes from the backend's workspace (Top-K: its sort arrays, the first
// sort's indices in the op's own scratch operand; scatter_add: its sort arrays; DGC: the clip
// factor; orthonormalize_columns: the double copy of p).
//
// Host round trips: none, except that scatter_add and scatter_zero read one 8-byte "bad index"
// slot after their kernels (as the embedding ops do), so that an index outside [0, n) throws one
// line as on the CPU (the kernels skip such an index; like the CPU's, the valid writes before it
// are done). Scalars that the CPU computes between two loops (DGC's clip factor, 1-bit's scale,
// QSGD's norm) are computed on the device and read there by the next kernel.
#include <cuda_runtime_api.h>

#include <climits>

#include "loom/backend/compress_checks.h"
#include "loom/backend/cuda/cuda_backend_internal.h"
#include "loom/backend/cuda/cuda_compress.h"

namespace loom::cuda_backend_detail {

namespace {

uint32_t* words_of(const Tensor& t) { return static_cast<uint32_t*>(t.device_ptr()); }

}  // namespace

bool compress_ops_complete() { return true; }

void CudaBackend::topk_extract(const Tensor& acc, const Tensor& idx, const Tensor& val, const Tensor& scratch) {
  const char* op = "topk_extract";
  const auto [n, k] = checks::check_topk_extract(acc, idx, val, scratch);
  LOOM_CHECK(n <= INT32_MAX, op, ": acc has ", n, " elements, at most ", INT32_MAX, " supported");
  void* work = workspace(cuda::topk_scratch_bytes(n, k));
  cuda::topk_extract(dptr<float>(acc), n, dptr<int32_t>(idx), dptr<float>(val), k, words_of(scratch), work, stream());
}

namespace {

// After a scatter kernel: the lowest position of an index outside [0, n) throws (one 8-byte read).
void check_indices(CudaBackend& backend, const char* op, const Tensor& idx, int64_t n) {
  unsigned long long bad = 0;
  LOOM_CUDA_CHECK(cudaMemcpyAsync(&bad, backend.flag(), sizeof(bad), cudaMemcpyDeviceToHost, backend.stream()));
  LOOM_CUDA_CHECK(cudaStreamSynchronize(backend.stream()));
  if (bad == ~0ull) return;
  int32_t id = 0;
  backend.read(idx.view(static_cast<int64_t>(bad), {1}), &id);
  throw Error(str_cat(op, ": index ", id, " at ", bad, " is outside [0, ", n, ")"));
}

}  // namespace

void CudaBackend::scatter_add(const Tensor& idx, const Tensor& val, const Tensor& out) {
  const char* op = "scatter_add";
  const int64_t m = checks::check_scatter_add(idx, val, out), n = out.numel();
  if (m == 0) return;
  LOOM_CHECK(m <= INT32_MAX, op, ": ", m, " indices, at most ", INT32_MAX, " supported");
  void* work = workspace(cuda::scatter_add_scratch_bytes(m, n));
  reset_flag();
  cuda::scatter_add(dptr<int32_t>(idx), dptr<float>(val), m, dptr<float>(out), n, work, flag(), stream());
  check_indices(*this, op, idx, n);
}

void CudaBackend::scatter_zero(const Tensor& idx, const Tensor& x) {
  const char* op = "scatter_zero";
  checks::check_scatter_zero(idx, x);
  if (idx.numel() == 0) return;
  reset_flag();
  cuda::scatter_zero(dptr<int32_t>(idx), idx.numel(), dptr<float>(x), x.numel(), flag(), stream());
  check_indices(*this, op, idx, x.numel());
}

void CudaBackend::dgc_accumulate(const Tensor& g, const Tensor& u, const Tensor& v, float momentum, double clip) {
  const int64_t n = checks::check_dgc_accumulate(g, u, v);
  void* work = clip > 0.0 ? workspace(cuda::dgc_scratch_bytes()) : nullptr;
  cuda::dgc_accumulate(dptr<float>(g), dptr<float>(u), dptr<float>(v), n, momentum, clip, work, stream());
}

void CudaBackend::onebit_encode(const Tensor& acc, const Tensor& words, const Tensor& scale) {
  const int64_t n = checks::check_onebit_encode(acc, words, scale);
  cuda::onebit_encode(dptr<float>(acc), n, words_of(words), dptr<float>(scale), stream());
}

void CudaBackend::onebit_decode_add(const Tensor& words, const Tensor& scales, const Tensor& out) {
  const int64_t w = checks::check_onebit_decode_add(words, scales, out), n = out.numel();
  cuda::onebit_decode_add(words_of(words), dptr<float>(scales), scales.numel(), w, dptr<float>(out), n, stream());
}

void CudaBackend::qsgd_encode(const Tensor& g, const Tensor& codes, const Tensor& norm, const QsgdSpec& spec) {
  const int64_t n = checks::check_qsgd_encode(g, codes, norm, spec);
  cuda::qsgd_encode(dptr<float>(g), n, words_of(codes), dptr<float>(norm), spec.levels, spec.seed, spec.stream,
                    spec.draw, spec.offset, stream());
}

void CudaBackend::qsgd_decode_add(const Tensor& codes, const Tensor& norms, int levels, const Tensor& out) {
  const int64_t w = checks::check_qsgd_decode_add(codes, norms, out), n = out.numel();
  cuda::qsgd_decode_add(words_of(codes), dptr<float>(norms), norms.numel(), w, levels, dptr<float>(out), n, stream());
}

void CudaBackend::lowrank_project(const Tensor& m, const Tensor& q, const Tensor& out, bool transpose) {
  const auto [rows, cols, r] = checks::check_lowrank_project(m, q, out, transpose);
  cuda::lowrank_project(dptr<float>(m), dptr<float>(q), dptr<float>(out), rows, cols, r, transpose, stream());
}

void CudaBackend::orthonormalize_columns(const Tensor& p) {
  const auto [rows, r] = checks::check_orthonormalize_columns(p);
  void* work = workspace(cuda::orthonormalize_scratch_bytes(rows, r));
  cuda::orthonormalize_columns(dptr<float>(p), rows, r, work, stream());
}

void CudaBackend::lowrank_expand(const Tensor& p, const Tensor& q, const Tensor& out, float alpha, float beta) {
  const auto [rows, cols, r] = checks::check_lowrank_expand(p, q, out);
  cuda::lowrank_expand(dptr<float>(p), dptr<float>(q), dptr<float>(out), rows, cols, r, alpha, beta, stream());
}

}  // namespace loom::cuda_backend_detail
