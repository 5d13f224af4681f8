// The CUDA backend's gradient compression ops (Top-K, DGC, 1-bit, QSGD, PowerSGD; contracts in
// backend.h, kernels in cuda_compress.cu). Each op validates its operands with the CPU twin's
// checks and messages (cpu/cpu_compress.cpp), then enqueues its kernels on the backend's stream;
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

#include "loom/backend/cuda/cuda_backend_internal.h"
#include "loom/backend/cuda/cuda_compress.h"

namespace loom::cuda_backend_detail {

using checks::expect_dtype;
using checks::expect_numel;

namespace {

void expect_f32(const Tensor& t, const char* op, const char* what) { expect_dtype(t, DTYPE_F32, op, what); }
void expect_i32(const Tensor& t, const char* op, const char* what) { expect_dtype(t, DTYPE_I32, op, what); }

// (rows, cols) of a matrix operand: its first dim and the rest.
void matrix_dims(const Tensor& t, const char* op, const char* what, int64_t& rows, int64_t& cols) {
  LOOM_CHECK(t.ndim() >= 1 && t.dim(0) > 0, op, ": ", what, " is ", t.describe(), ", expected a matrix");
  rows = t.dim(0);
  cols = t.numel() / rows;
}

// Checks R gathered rows of `per_rank` words each and R scalars; returns the words per rank.
int64_t gathered_words(const Tensor& words, const Tensor& scalars, const char* op) {
  expect_i32(words, op, "codes");
  expect_f32(scalars, op, "scales");
  const int64_t ranks = scalars.numel();
  LOOM_CHECK(ranks > 0 && words.numel() % ranks == 0, op, ": ", words.describe(), " is not ", ranks, " equal rows");
  return words.numel() / ranks;
}

uint32_t* words_of(const Tensor& t) { return static_cast<uint32_t*>(t.device_ptr()); }

}  // namespace

bool compress_ops_complete() { return true; }

void CudaBackend::topk_extract(const Tensor& acc, const Tensor& idx, const Tensor& val, const Tensor& scratch) {
  const char* op = "topk_extract";
  expect_f32(acc, op, "acc");
  expect_i32(idx, op, "idx");
  expect_f32(val, op, "val");
  expect_i32(scratch, op, "scratch");
  const int64_t n = acc.numel(), k = idx.numel();
  expect_numel(val, k, op, "val");
  LOOM_CHECK(k >= 1 && k <= n, op, ": k = ", k, " must be in [1, ", n, "]");
  LOOM_CHECK(scratch.numel() >= n, op, ": scratch has ", scratch.numel(), " elements, expected at least ", n);
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
  expect_i32(idx, op, "idx");
  expect_f32(val, op, "val");
  expect_f32(out, op, "out");
  expect_numel(val, idx.numel(), op, "val");
  const int64_t m = idx.numel(), n = out.numel();
  if (m == 0) return;
  LOOM_CHECK(m <= INT32_MAX, op, ": ", m, " indices, at most ", INT32_MAX, " supported");
  void* work = workspace(cuda::scatter_add_scratch_bytes(m, n));
  reset_flag();
  cuda::scatter_add(dptr<int32_t>(idx), dptr<float>(val), m, dptr<float>(out), n, work, flag(), stream());
  check_indices(*this, op, idx, n);
}

void CudaBackend::scatter_zero(const Tensor& idx, const Tensor& x) {
  const char* op = "scatter_zero";
  expect_i32(idx, op, "idx");
  expect_f32(x, op, "x");
  if (idx.numel() == 0) return;
  reset_flag();
  cuda::scatter_zero(dptr<int32_t>(idx), idx.numel(), dptr<float>(x), x.numel(), flag(), stream());
  check_indices(*this, op, idx, x.numel());
}

void CudaBackend::dgc_accumulate(const Tensor& g, const Tensor& u, const Tensor& v, float momentum, double clip) {
  const char* op = "dgc_accumulate";
  expect_f32(g, op, "g");
  expect_f32(u, op, "u");
  expect_f32(v, op, "v");
  const int64_t n = g.numel();
  expect_numel(u, n, op, "u");
  expect_numel(v, n, op, "v");
  void* work = clip > 0.0 ? workspace(cuda::dgc_scratch_bytes()) : nullptr;
  cuda::dgc_accumulate(dptr<float>(g), dptr<float>(u), dptr<float>(v), n, momentum, clip, work, stream());
}

void CudaBackend::onebit_encode(const Tensor& acc, const Tensor& words, const Tensor& scale) {
  const char* op = "onebit_encode";
  expect_f32(acc, op, "acc");
  expect_i32(words, op, "words");
  expect_f32(scale, op, "scale");
  const int64_t n = acc.numel();
  expect_numel(words, (n + 31) / 32, op, "words");
  expect_numel(scale, 1, op, "scale");
  cuda::onebit_encode(dptr<float>(acc), n, words_of(words), dptr<float>(scale), stream());
}

void CudaBackend::onebit_decode_add(const Tensor& words, const Tensor& scales, const Tensor& out) {
  const char* op = "onebit_decode_add";
  const int64_t w = gathered_words(words, scales, op), n = out.numel();
  expect_f32(out, op, "out");
  LOOM_CHECK(w == (n + 31) / 32, op, ": ", w, " words per rank do not hold ", n, " signs");
  cuda::onebit_decode_add(words_of(words), dptr<float>(scales), scales.numel(), w, dptr<float>(out), n, stream());
}

void CudaBackend::qsgd_encode(const Tensor& g, const Tensor& codes, const Tensor& norm, const QsgdSpec& spec) {
  const char* op = "qsgd_encode";
  expect_f32(g, op, "g");
  expect_i32(codes, op, "codes");
  expect_f32(norm, op, "norm");
  const int64_t n = g.numel(), words = (n + 3) / 4;
  expect_numel(codes, words, op, "codes");
  expect_numel(norm, 1, op, "norm");
  LOOM_CHECK(spec.levels >= 1 && spec.levels <= 127, op, ": levels must be in [1, 127], got ", spec.levels);
  cuda::qsgd_encode(dptr<float>(g), n, words_of(codes), dptr<float>(norm), spec.levels, spec.seed, spec.stream,
                    spec.draw, spec.offset, stream());
}

void CudaBackend::qsgd_decode_add(const Tensor& codes, const Tensor& norms, int levels, const Tensor& out) {
  const char* op = "qsgd_decode_add";
  const int64_t w = gathered_words(codes, norms, op), n = out.numel();
  expect_f32(out, op, "out");
  LOOM_CHECK(w == (n + 3) / 4, op, ": ", w, " words per rank do not hold ", n, " codes");
  cuda::qsgd_decode_add(words_of(codes), dptr<float>(norms), norms.numel(), w, levels, dptr<float>(out), n, stream());
}

void CudaBackend::lowrank_project(const Tensor& m, const Tensor& q, const Tensor& out, bool transpose) {
  const char* op = "lowrank_project";
  expect_f32(m, op, "m");
  expect_f32(q, op, "q");
  expect_f32(out, op, "out");
  int64_t rows = 0, cols = 0, q_rows = 0, r = 0;
  matrix_dims(m, op, "m", rows, cols);
  matrix_dims(q, op, "q", q_rows, r);
  LOOM_CHECK(q_rows == (transpose ? rows : cols), op, ": q ", q.describe(), " does not match m ", m.describe());
  expect_numel(out, (transpose ? cols : rows) * r, op, "out");
  cuda::lowrank_project(dptr<float>(m), dptr<float>(q), dptr<float>(out), rows, cols, r, transpose, stream());
}

void CudaBackend::orthonormalize_columns(const Tensor& p) {
  const char* op = "orthonormalize_columns";
  expect_f32(p, op, "p");
  int64_t rows = 0, r = 0;
  matrix_dims(p, op, "p", rows, r);
  void* work = workspace(cuda::orthonormalize_scratch_bytes(rows, r));
  cuda::orthonormalize_columns(dptr<float>(p), rows, r, work, stream());
}

void CudaBackend::lowrank_expand(const Tensor& p, const Tensor& q, const Tensor& out, float alpha, float beta) {
  const char* op = "lowrank_expand";
  expect_f32(p, op, "p");
  expect_f32(q, op, "q");
  expect_f32(out, op, "out");
  int64_t rows = 0, r = 0, cols = 0, q_r = 0;
  matrix_dims(p, op, "p", rows, r);
  matrix_dims(q, op, "q", cols, q_r);
  LOOM_CHECK(q_r == r, op, ": q ", q.describe(), " and p ", p.describe(), " differ in rank");
  expect_numel(out, rows * cols, op, "out");
  cuda::lowrank_expand(dptr<float>(p), dptr<float>(q), dptr<float>(out), rows, cols, r, alpha, beta, stream());
}

}  // namespace loom::cuda_backend_detail
