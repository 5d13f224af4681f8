// The strided-batched GEMMs of the attention paths that keep their probabilities (the fp32 / fp64
// attention of cuda_attention.cu, MLA's of cuda_mla.cu, the bf16 attention of cuda_quant.cu),
// behind one interface: those .cu files launch kernels and call these, and include no BLAS
// header, so they compile with hipcc too. cuda_blas.cpp implements it with cuBLAS (the nvcc
// build and the simulator's cuBLAS). A HIP port implements the same functions with rocBLAS's
// rocblas_gemm_strided_batched_ex or hipBLAS (docs/accelerators.md: neither is packaged in
// Debian 12, so the HIP target compiles the kernels only).
#pragma once
#include <cstddef>
#include <cstdint>

// cuBLAS's handle, declared as cublas_api.h declares it (C++ allows the identical typedef twice),
// so that the launcher headers need not include cuBLAS. A HIP port's cuda_blas.cpp would map this
// opaque type to its rocblas_handle.
struct cublasContext;
typedef struct cublasContext* cublasHandle_t;

namespace loom::cuda {

// alpha and beta are host values: the handle reads them so for the scope (cublasSetPointerMode),
// and gets the caller's mode back after (it is the default, so this is normally two cheap calls).
class BlasHostScalars {
 public:
  explicit BlasHostScalars(cublasHandle_t handle);
  ~BlasHostScalars();
  BlasHostScalars(const BlasHostScalars&) = delete;
  BlasHostScalars& operator=(const BlasHostScalars&) = delete;

 private:
  cublasHandle_t handle_;
  int previous_;  // the caller's cublasPointerMode_t
};

// Row-major strided-batched GEMM on the handle's stream, for p in [0, batch):
//   C_p (m, n) = alpha op(A_p) op(B_p) + beta C_p,  X_p = X + p stride_x, row-major, leading dims ld*.
// cuBLAS is column-major: a row-major (r, c) matrix with leading dim ld is the column-major (c, r)
// matrix X^T with the same ld, so C^T (n, m) = op(B)^T op(A)^T is the column-major call
//   gemm(op_b, op_a, n, m, k, B, ldb, A, lda, C, ldc)
// (the transpose flags carry over unchanged). beta = 0 does not read C. A failure throws
// loom::Error naming cuBLAS's status and `what`.
// f32: true fp32 whatever the handle's math mode (CUBLAS_COMPUTE_32F_PEDANTIC: no TF32, no bf16x9).
void gemm_rm(cublasHandle_t handle, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
             const float* a, int64_t lda, int64_t stride_a, const float* b, int64_t ldb, int64_t stride_b, float beta,
             float* c, int64_t ldc, int64_t stride_c, int64_t batch, const char* what);
// f64: true fp64 (CUBLAS_COMPUTE_64F_PEDANTIC: no fixed-point emulation).
void gemm_rm(cublasHandle_t handle, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, double alpha,
             const double* a, int64_t lda, int64_t stride_a, const double* b, int64_t ldb, int64_t stride_b,
             double beta, double* c, int64_t ldc, int64_t stride_c, int64_t batch, const char* what);
// A and B bf16 (their bits), C f32, fp32 accumulation (CUBLAS_COMPUTE_32F: tensor cores).
void gemm_rm_bf16(cublasHandle_t handle, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
                  const uint16_t* a, int64_t lda, int64_t stride_a, const uint16_t* b, int64_t ldb, int64_t stride_b,
                  float beta, float* c, int64_t ldc, int64_t stride_c, int64_t batch, const char* what);

}  // namespace loom::cuda
