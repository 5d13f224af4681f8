// Row-major GEMM on the CPU: C = alpha * op(A) @ op(B) + beta * C, op(A) (M,K), op(B) (K,N), C (M,N).
// f32 goes to oneDNN's sgemm (chosen by measurement: docs/gemm.md); f64 is a plain blocked
// loop used only by reference checks.
#pragma once
#include <cstdint>
#include <string>

namespace loom::cpu {

// The same bits for any thread count (cpu_gemm.cpp): oneDNN's own threading on its AVX-512
// kernels (with K slices), else gemm_f32_tiled, or one call on this thread inside a parallel
// region.
void gemm_f32(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
              const float* b, int64_t ldb, float beta, float* c, int64_t ldc);
// C split into fixed tiles, each one single-threaded oneDNN call (op(A) = A^T is copied
// transposed first): the same bits for any thread count on any CPU. gemm_f32's path where
// oneDNN runs AVX2 kernels; public so that tests run it on every CPU.
void gemm_f32_tiled(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
                    int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc);
// dst (cols x rows, rows ld_dst apart) = src (rows x cols, rows ld_src apart) transposed, on the
// threads, in 8 x 8 AVX2 register tiles. Exact (a copy).
void transpose_f32(const float* src, int64_t ld_src, int64_t rows, int64_t cols, float* dst, int64_t ld_dst);
// Which kernels gemm_f32 (bf16 = false) or gemm_bf16 (true) run on this CPU, in words, ending in
// the revision of Loom's path (kGemmRevision in cpu_gemm.cpp), e.g. "oneDNN sgemm, oneDNN's AVX2
// kernels in 128 x 256 tiles (cpu gemm r4)". The backend's gemm_kernels().
std::string gemm_kernels(bool bf16);
// bf16 A and B (raw bit patterns), fp32 accumulation and C: oneDNN's bf16 GEMM (2x fp32 on
// this CPU's AVX-512 BF16, docs/gemm.md).
void gemm_bf16(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const uint16_t* a, int64_t lda,
               const uint16_t* b, int64_t ldb, float beta, float* c, int64_t ldc);
void gemm_f64(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, double alpha, const double* a,
              int64_t lda, const double* b, int64_t ldb, double beta, double* c, int64_t ldc);

template <typename T>
inline void gemm_t(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, T alpha, const T* a, int64_t lda,
                   const T* b, int64_t ldb, T beta, T* c, int64_t ldc) {
  if constexpr (sizeof(T) == 4) gemm_f32(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  else gemm_f64(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

}  // namespace loom::cpu
