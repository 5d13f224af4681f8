#include "loom/backend/cpu/cpu_gemm.h"

#include <oneapi/dnnl/dnnl.h>

#include <algorithm>
#include <cstring>
#include <vector>

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
  if (status == dnnl_unimplemented) {
    // A CPU without AVX-512 (oneDNN 2.x has no bf16 GEMM for AVX2): widen A and B to fp32, which
    // is exact, and run sgemm. The products of two bf16 values are exact in fp32, so this is
    // still bf16 products accumulated in fp32; only the summation order is the library's. The
    // widened copies live in per-thread buffers that grow to the largest shape once.
    thread_local std::vector<float> wa, wb;
    auto widen = [](const uint16_t* src, int64_t rows, int64_t cols, int64_t ld, std::vector<float>& dst) {
      if (dst.size() < static_cast<size_t>(rows * ld)) dst.resize(static_cast<size_t>(rows * ld));
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t j = 0; j < cols; ++j) {
          const uint32_t bits = static_cast<uint32_t>(src[r * ld + j]) << 16;
          std::memcpy(&dst[static_cast<size_t>(r * ld + j)], &bits, sizeof(float));
        }
      }
    };
    widen(a, trans_a ? k : m, trans_a ? m : k, lda, wa);
    widen(b, trans_b ? n : k, trans_b ? k : n, ldb, wb);
    gemm_f32(trans_a, trans_b, m, n, k, alpha, wa.data(), lda, wb.data(), ldb, beta, c, ldc);
    return;
  }
  LOOM_CHECK(status == dnnl_success, "oneDNN bf16 gemm failed with status ", static_cast<int>(status), " for M=", m,
             " N=", n, " K=", k);
}

// oneDNN 2.6's sgemm takes another path on one thread than on several for A x B^T (trans_b
// only) when K > 768 or alpha != 1, and its last bits differ (measured: K = 1024, 1100, 1536,
// 2048, 4096, 5000, 8192 at alpha 1, and every K at alpha 0.75, differ between 1 and 2 threads;
// 2, 3 and 4 threads agree; the other transposes and the bf16 GEMM agree for every thread count).
// So that a run gives the same bits on any number of threads, such a GEMM is computed as
// T = op(A) op(B) with alpha 1 in K slices of at most 768 accumulated in order (beta 1 after the
// first slice), and C = alpha T + beta C by an elementwise pass where alpha != 1 or beta != 0
// (T in a per-thread buffer). Tested on 1, 2 and 4 threads (tests/test_gemm.cpp); neutral in
// speed on the GPT-2 shapes (0.96-1.03x per shape).
constexpr int64_t kThreadStableK = 768;

namespace {

void sgemm_checked(char ta, char tb, int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
                   const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  const dnnl_status_t status = dnnl_sgemm(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  LOOM_CHECK(status == dnnl_success, "oneDNN sgemm failed with status ", static_cast<int>(status), " for M=", m,
             " N=", n, " K=", k);
}

}  // namespace

void gemm_f32(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
              const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  if (m == 0 || n == 0) return;
  if (trans_a || !trans_b || k == 0) {
    sgemm_checked(trans_a ? 'T' : 'N', trans_b ? 'T' : 'N', m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
    return;
  }
  // A x B^T: the product with alpha 1 in slices of K, into C itself or into T.
  const bool direct = alpha == 1.0f && beta == 0.0f;
  thread_local std::vector<float> scratch;
  if (!direct && scratch.size() < static_cast<size_t>(m * n)) scratch.resize(static_cast<size_t>(m * n));
  float* t = direct ? c : scratch.data();
  const int64_t ldt = direct ? ldc : n;
  for (int64_t k0 = 0; k0 < k; k0 += kThreadStableK) {
    sgemm_checked('N', 'T', m, n, std::min(kThreadStableK, k - k0), 1.0f, a + k0, lda, b + k0, ldb,
                  k0 == 0 ? 0.0f : 1.0f, t, ldt);
  }
  if (direct) return;
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < m; ++i) {
    float* ci = c + i * ldc;
    const float* ti = t + i * ldt;
    if (beta == 0.0f) {
      for (int64_t j = 0; j < n; ++j) ci[j] = alpha * ti[j];
    } else {
      for (int64_t j = 0; j < n; ++j) ci[j] = alpha * ti[j] + beta * ci[j];
    }
  }
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
