// cuda_blas.h with cuBLAS (host code: the nvcc build compiles it with the host compiler, the
// simulator against its own cuBLAS, sim/cublas_gemm.cpp).
#include "loom/backend/cuda/cuda_blas.h"

#include <cublas_v2.h>

#include "loom/core/error.h"

namespace loom::cuda {
namespace {

void check_cublas(cublasStatus_t status, const char* what) {
  if (status != CUBLAS_STATUS_SUCCESS) {
    throw Error(str_cat("cuBLAS error ", static_cast<int>(status), " (", cublasGetStatusName(status), ") in ", what));
  }
}

cublasOperation_t op(bool trans) { return trans ? CUBLAS_OP_T : CUBLAS_OP_N; }

// The column-major call C^T = op(B)^T op(A)^T of cuda_blas.h's row-major GEMM.
void gemm_ex(cublasHandle_t handle, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, const void* alpha,
             const void* a, cudaDataType_t ab_type, int64_t lda, int64_t stride_a, const void* b, int64_t ldb,
             int64_t stride_b, const void* beta, void* c, cudaDataType_t c_type, int64_t ldc, int64_t stride_c,
             int64_t batch, cublasComputeType_t compute, const char* what) {
  check_cublas(cublasGemmStridedBatchedEx(handle, op(trans_b), op(trans_a), static_cast<int>(n), static_cast<int>(m),
                                          static_cast<int>(k), alpha, b, ab_type, static_cast<int>(ldb),
                                          static_cast<long long>(stride_b), a, ab_type, static_cast<int>(lda),
                                          static_cast<long long>(stride_a), beta, c, c_type, static_cast<int>(ldc),
                                          static_cast<long long>(stride_c), static_cast<int>(batch), compute,
                                          CUBLAS_GEMM_DEFAULT),
               what);
}

}  // namespace

BlasHostScalars::BlasHostScalars(cublasHandle_t handle) : handle_(handle), previous_(CUBLAS_POINTER_MODE_HOST) {
  cublasPointerMode_t mode = CUBLAS_POINTER_MODE_HOST;
  check_cublas(cublasGetPointerMode(handle_, &mode), "cublasGetPointerMode");
  previous_ = static_cast<int>(mode);
  if (mode != CUBLAS_POINTER_MODE_HOST) {
    check_cublas(cublasSetPointerMode(handle_, CUBLAS_POINTER_MODE_HOST), "cublasSetPointerMode");
  }
}

BlasHostScalars::~BlasHostScalars() {
  const auto mode = static_cast<cublasPointerMode_t>(previous_);
  if (mode != CUBLAS_POINTER_MODE_HOST) (void)cublasSetPointerMode(handle_, mode);
}

void gemm_rm(cublasHandle_t handle, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
             const float* a, int64_t lda, int64_t stride_a, const float* b, int64_t ldb, int64_t stride_b, float beta,
             float* c, int64_t ldc, int64_t stride_c, int64_t batch, const char* what) {
  gemm_ex(handle, trans_a, trans_b, m, n, k, &alpha, a, CUDA_R_32F, lda, stride_a, b, ldb, stride_b, &beta, c,
          CUDA_R_32F, ldc, stride_c, batch, CUBLAS_COMPUTE_32F_PEDANTIC, what);
}

void gemm_rm(cublasHandle_t handle, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, double alpha,
             const double* a, int64_t lda, int64_t stride_a, const double* b, int64_t ldb, int64_t stride_b,
             double beta, double* c, int64_t ldc, int64_t stride_c, int64_t batch, const char* what) {
  gemm_ex(handle, trans_a, trans_b, m, n, k, &alpha, a, CUDA_R_64F, lda, stride_a, b, ldb, stride_b, &beta, c,
          CUDA_R_64F, ldc, stride_c, batch, CUBLAS_COMPUTE_64F_PEDANTIC, what);
}

void gemm_rm_bf16(cublasHandle_t handle, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
                  const uint16_t* a, int64_t lda, int64_t stride_a, const uint16_t* b, int64_t ldb, int64_t stride_b,
                  float beta, float* c, int64_t ldc, int64_t stride_c, int64_t batch, const char* what) {
  gemm_ex(handle, trans_a, trans_b, m, n, k, &alpha, a, CUDA_R_16BF, lda, stride_a, b, ldb, stride_b, &beta, c,
          CUDA_R_32F, ldc, stride_c, batch, CUBLAS_COMPUTE_32F, what);
}

}  // namespace loom::cuda
