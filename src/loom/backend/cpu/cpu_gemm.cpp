#include "loom/backend/cpu/cpu_gemm.h"

#include <oneapi/dnnl/dnnl.h>

#include "loom/core/error.h"

// Exported by oneDNN 2.x (libdnnl.so) but not declared in its dnnl.h: row-major
// C = alpha op(A) op(B) + beta C with bf16 A and B (raw 16-bit patterns), fp32 accumulation
// and output. It uses the CPU's AVX-512 BF16 dot products (vdpbf16ps) where present.
extern "C" dnnl_status_t dnnl_gemm_bf16bf16f32(char transa, char transb, dnnl_dim_t M, dnnl_dim_t N, dnnl_dim_t K,
                                               float alpha, const uint16_t* A, dnnl_dim_t lda, const uint16_t* B,
                                               dnnl_dim_t ldb, float beta, float* C, dnnl_dim_t ldc);

namespace loom::cpu {

void gemm_bf16(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const uint16_t* a, int64_t lda,
               const uint16_t* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  if (m == 0 || n == 0) return;
  const dnnl_status_t status = dnnl_gemm_bf16bf16f32(trans_a ? 'T' : 'N', trans_b ? 'T' : 'N', m, n, k, alpha, a, lda, b,
                                                     ldb, beta, c, ldc);
  LOOM_CHECK(status == dnnl_success, "oneDNN bf16 gemm failed with status ", static_cast<int>(status), " for M=", m,
             " N=", n, " K=", k);
}

void gemm_f32(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
              const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  if (m == 0 || n == 0) return;
  const dnnl_status_t status =
      dnnl_sgemm(trans_a ? 'T' : 'N', trans_b ? 'T' : 'N', m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  LOOM_CHECK(status == dnnl_success, "oneDNN sgemm failed with status ", static_cast<int>(status), " for M=", m,
             " N=", n, " K=", k);
}

void gemm_f64(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, double alpha, const double* a,
              int64_t lda, const double* b, int64_t ldb, double beta, double* c, int64_t ldc) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      double acc = 0;
      for (int64_t p = 0; p < k; ++p) {
        const double av = trans_a ? a[p * lda + i] : a[i * lda + p];
        const double bv = trans_b ? b[j * ldb + p] : b[p * ldb + j];
        acc += av * bv;
      }
      c[i * ldc + j] = alpha * acc + (beta == 0.0 ? 0.0 : beta * c[i * ldc + j]);
    }
  }
}

}  // namespace loom::cpu
