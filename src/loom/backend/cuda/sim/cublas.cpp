// The CUDA simulator's cuBLAS and cuBLASLt (docs/cuda.md "The simulator"): the GEMMs of
// include/cublas_v2.h and include/cublasLt.h computed on the CPU, on the caller's stream. This
// file has cuBLAS's handle and calls; cublas_lt.cpp cuBLASLt's, cublas_gemm.cpp the GEMM both
// enqueue and the checks of its memory.
//
// Where the rules come from (NVIDIA's cuBLAS Library User Guide, CUDA 13):
//   - "cublas<t>gemm()", "cublasGemmEx()", "cublas<t>gemmStridedBatched()",
//     "cublasGemmStridedBatchedEx()": column-major C = alpha op(A) op(B) + beta C, op(A) m x k,
//     op(B) k x n; the error values: CUBLAS_STATUS_NOT_INITIALIZED without a handle,
//     CUBLAS_STATUS_INVALID_VALUE for m, n, k or batchCount < 0, an unknown transa / transb, lda <
//     max(1, rows of A as stored), ldb likewise, ldc < max(1, m) or a null alpha / beta;
//     CUBLAS_STATUS_NOT_SUPPORTED for a type / compute-type combination or algo the library does
//     not have (the cublasGemmEx table of supported combinations).
//   - "cublasComputeType_t": 32F and 32F_PEDANTIC accumulate in float (here: one fmaf per product,
//     in k order), 32F_FAST_TF32 may round the inputs to TF32, 64F accumulates in double; alpha and
//     beta have the compute type's precision ("scaleType").
//   - "Scalar Parameters" / "cublasSetPointerMode()": alpha and beta live in host memory (read
//     before the call returns) or, in CUBLAS_POINTER_MODE_DEVICE, in device memory (read by the
//     work on the stream). "cublas<t>gemm()": with beta == 0, C need not be a valid input (it is
//     not read: NaN there does not propagate). A and B are always read (nothing documents
//     otherwise for alpha == 0).
//   - "cublasSetWorkspace()": the workspace must be 256-byte aligned (CUBLAS_STATUS_INVALID_VALUE);
//     "cublasSetStream()" resets the workspace to the library's own.
//   - cuBLASLt "cublasLtMatmul()": D = alpha op(A) op(B) + beta C with layouts that must agree
//     (CUBLAS_STATUS_INVALID_VALUE); its return values: a workspace smaller than the algo needs is
//     CUBLAS_STATUS_INVALID_VALUE; "cublasLtMatmulDescAttributes_t": the A/B/C/D scale pointers are
//     for fp8 types, and set for other types cublasLtMatmul returns CUBLAS_STATUS_INVALID_VALUE;
//     TRANSC supports only CUBLAS_OP_N; the workspace must be 256-byte aligned.
//   - "cublasLtMatmulAlgoGetHeuristic()": CUBLAS_STATUS_NOT_SUPPORTED with no algorithm when none
//     fits; "cublasLtMatmulPreferenceAttributes_t": MIN_ALIGNMENT_{A,B,C,D}_BYTES (default 256)
//     exclude algorithms needing more alignment than the caller promises, so the returned algo
//     assumes pointers that aligned, and cublasLtMatmul with a less aligned pointer is
//     CUBLAS_STATUS_NOT_SUPPORTED (the simulator requires exactly the promised alignment).
//   - "Tensor Core Usage": tensor-core kernels need leading dimensions and strided-batch offsets
//     that are multiples of 16 bytes. The simulator's heuristic offers no algorithm at all
//     otherwise — stricter than a GPU's library, which may choose a slower kernel — so that the
//     caller's fallback (Loom's backend: cublasGemmStridedBatchedEx) is exercised.
//   - "cublasLtMatrixLayoutAttribute_t": for CUBLASLT_ORDER_COL the leading dimension is at least
//     the row count; only column order, strided batches and non-planar layouts are simulated.
//   - "*SetAttribute()" / "*GetAttribute()": a null buffer or a size other than the attribute's is
//     CUBLAS_STATUS_INVALID_VALUE.
// Simulator checks beyond the library's own: every matrix (and alpha / beta in device pointer
// mode, the Lt workspace) must lie in device memory over the whole extent the call addresses —
// otherwise CUBLAS_STATUS_INVALID_VALUE and a sticky cudaErrorIllegalAddress with a report
// (a GPU kernel would fault there); the work marks D written and checks, inside the work, that
// everything it reads was written before (initcheck).
#include <cublas_v2.h>

#include <algorithm>
#include <cstdint>
#include <optional>

#include "loom/backend/cuda/sim/cublas_internal.h"
#include "loom/backend/cuda/sim/sim_runtime.h"

struct cublasContext {
  cudaStream_t stream = nullptr;
  cublasPointerMode_t pointer_mode = CUBLAS_POINTER_MODE_HOST;
  cublasMath_t math_mode = CUBLAS_DEFAULT_MATH;
  void* workspace = nullptr;  // nullptr: the library's own (the simulator needs none)
  size_t workspace_bytes = 0;
};

namespace loom::sim::cublas_detail {
namespace {

// ------------------------------------------------------------------------------------ cuBLAS

bool known_gemm_algo(cublasGemmAlgo_t algo) {
  const int a = static_cast<int>(algo);
  return (a >= CUBLAS_GEMM_DEFAULT && a <= CUBLAS_GEMM_ALGO23) ||
         (a >= CUBLAS_GEMM_DEFAULT_TENSOR_OP && a <= CUBLAS_GEMM_ALGO15_TENSOR_OP) || a == CUBLAS_GEMM_AUTOTUNE;
}

cublasStatus_t gemm_strided_batched(const char* api, cublasHandle_t handle, cublasOperation_t transa,
                                    cublasOperation_t transb, int m, int n, int k, const void* alpha, const void* A,
                                    cudaDataType Atype, int lda, long long strideA, const void* B, cudaDataType Btype,
                                    int ldb, long long strideB, const void* beta, void* C, cudaDataType Ctype, int ldc,
                                    long long strideC, int batch, cublasComputeType_t compute, cublasGemmAlgo_t algo) {
  if (handle == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (!valid_operation(transa) || !valid_operation(transb)) return CUBLAS_STATUS_INVALID_VALUE;
  if (m < 0 || n < 0 || k < 0 || batch < 0) return CUBLAS_STATUS_INVALID_VALUE;
  const bool ta = transa != CUBLAS_OP_N, tb = transb != CUBLAS_OP_N;
  const Operand a{"A", A, Atype, ta ? k : m, ta ? m : k, lda, strideA};
  const Operand b{"B", B, Btype, tb ? n : k, tb ? k : n, ldb, strideB};
  const Operand c{"C", C, Ctype, m, n, ldc, strideC};
  for (const Operand* x : {&a, &b, &c}) {
    if (x->ld < std::max<int64_t>(1, x->rows)) return CUBLAS_STATUS_INVALID_VALUE;
  }
  if (alpha == nullptr || beta == nullptr) return CUBLAS_STATUS_INVALID_VALUE;

  const bool fp64 = compute == CUBLAS_COMPUTE_64F || compute == CUBLAS_COMPUTE_64F_PEDANTIC;
  std::optional<Arithmetic> arithmetic = arithmetic_for(compute, fp64 ? CUDA_R_64F : CUDA_R_32F, Atype, Btype, Ctype);
  if (!arithmetic || !known_gemm_algo(algo)) return CUBLAS_STATUS_NOT_SUPPORTED;
  // CUBLAS_TF32_TENSOR_OP_MATH lets the default fp32 compute type use TF32 ("cublasSetMathMode()").
  if (compute == CUBLAS_COMPUTE_32F && Atype == CUDA_R_32F && (handle->math_mode & 0xf) == CUBLAS_TF32_TENSOR_OP_MATH) {
    arithmetic = Arithmetic::kFloatTf32;
  }
  if (m == 0 || n == 0 || batch == 0) return CUBLAS_STATUS_SUCCESS;

  Gemm g{.api = api,
         .trans_a = ta,
         .trans_b = tb,
         .m = m,
         .n = n,
         .k = k,
         .batch = batch,
         .a = a,
         .b = b,
         .c = c,
         .d = c,
         .arithmetic = *arithmetic};
  if (!take_scalars(api, handle->pointer_mode == CUBLAS_POINTER_MODE_DEVICE, alpha, beta, &g)) {
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  // C is always checked: it is written even when beta == 0.
  if (!check_operand_memory(api, a, batch) || !check_operand_memory(api, b, batch) ||
      !check_operand_memory(api, c, batch)) {
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  loom::sim::enqueue(handle->stream, api, [g] { run(g); });
  return CUBLAS_STATUS_SUCCESS;
}

}  // namespace

const char* status_name(cublasStatus_t status) {
  switch (status) {
    case CUBLAS_STATUS_SUCCESS:
      return "CUBLAS_STATUS_SUCCESS";
    case CUBLAS_STATUS_NOT_INITIALIZED:
      return "CUBLAS_STATUS_NOT_INITIALIZED";
    case CUBLAS_STATUS_ALLOC_FAILED:
      return "CUBLAS_STATUS_ALLOC_FAILED";
    case CUBLAS_STATUS_INVALID_VALUE:
      return "CUBLAS_STATUS_INVALID_VALUE";
    case CUBLAS_STATUS_ARCH_MISMATCH:
      return "CUBLAS_STATUS_ARCH_MISMATCH";
    case CUBLAS_STATUS_MAPPING_ERROR:
      return "CUBLAS_STATUS_MAPPING_ERROR";
    case CUBLAS_STATUS_EXECUTION_FAILED:
      return "CUBLAS_STATUS_EXECUTION_FAILED";
    case CUBLAS_STATUS_INTERNAL_ERROR:
      return "CUBLAS_STATUS_INTERNAL_ERROR";
    case CUBLAS_STATUS_NOT_SUPPORTED:
      return "CUBLAS_STATUS_NOT_SUPPORTED";
    case CUBLAS_STATUS_LICENSE_ERROR:
      return "CUBLAS_STATUS_LICENSE_ERROR";
  }
  return "CUBLAS_STATUS_UNKNOWN";
}

const char* status_string(cublasStatus_t status) {
  switch (status) {
    case CUBLAS_STATUS_SUCCESS:
      return "success";
    case CUBLAS_STATUS_NOT_INITIALIZED:
      return "the library was not initialized (no handle)";
    case CUBLAS_STATUS_ALLOC_FAILED:
      return "a resource allocation failed";
    case CUBLAS_STATUS_INVALID_VALUE:
      return "an unsupported value or parameter was passed to the function";
    case CUBLAS_STATUS_ARCH_MISMATCH:
      return "the function needs a feature absent from the device architecture";
    case CUBLAS_STATUS_MAPPING_ERROR:
      return "an access to GPU memory space failed";
    case CUBLAS_STATUS_EXECUTION_FAILED:
      return "the GPU program failed to execute";
    case CUBLAS_STATUS_INTERNAL_ERROR:
      return "an internal operation failed";
    case CUBLAS_STATUS_NOT_SUPPORTED:
      return "the functionality requested is not supported";
    case CUBLAS_STATUS_LICENSE_ERROR:
      return "the functionality requested requires a license";
  }
  return "unknown cuBLAS status";
}

}  // namespace loom::sim::cublas_detail

using namespace loom::sim::cublas_detail;

// ------------------------------------------------------------------------------------ cuBLAS API

extern "C" {

cublasStatus_t cublasCreate_v2(cublasHandle_t* handle) {
  if (handle == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  *handle = new cublasContext();
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasDestroy_v2(cublasHandle_t handle) {
  if (handle == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
  delete handle;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetWorkspace_v2(cublasHandle_t handle, void* workspace, size_t workspaceSizeInBytes) {
  if (handle == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (!aligned(workspace, 256)) return CUBLAS_STATUS_INVALID_VALUE;
  if (workspaceSizeInBytes > 0 &&
      !check_device_range("cublasSetWorkspace", "workspace", workspace, workspaceSizeInBytes)) {
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  handle->workspace = workspace;
  handle->workspace_bytes = workspaceSizeInBytes;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetStream_v2(cublasHandle_t handle, cudaStream_t streamId) {
  if (handle == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
  handle->stream = streamId;
  handle->workspace = nullptr;  // back to the library's own workspace ("cublasSetStream()")
  handle->workspace_bytes = 0;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasGetStream_v2(cublasHandle_t handle, cudaStream_t* streamId) {
  if (handle == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (streamId == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  *streamId = handle->stream;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasGetPointerMode_v2(cublasHandle_t handle, cublasPointerMode_t* mode) {
  if (handle == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (mode == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  *mode = handle->pointer_mode;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetPointerMode_v2(cublasHandle_t handle, cublasPointerMode_t mode) {
  if (handle == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (mode != CUBLAS_POINTER_MODE_HOST && mode != CUBLAS_POINTER_MODE_DEVICE) return CUBLAS_STATUS_INVALID_VALUE;
  handle->pointer_mode = mode;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasGetMathMode(cublasHandle_t handle, cublasMath_t* mode) {
  if (handle == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (mode == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  *mode = handle->math_mode;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetMathMode(cublasHandle_t handle, cublasMath_t mode) {
  if (handle == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
  handle->math_mode = mode;
  return CUBLAS_STATUS_SUCCESS;
}

const char* cublasGetStatusName(cublasStatus_t status) { return status_name(status); }

const char* cublasGetStatusString(cublasStatus_t status) { return status_string(status); }

cublasStatus_t cublasSgemm_v2(cublasHandle_t handle, cublasOperation_t transa, cublasOperation_t transb, int m, int n,
                              int k, const float* alpha, const float* A, int lda, const float* B, int ldb,
                              const float* beta, float* C, int ldc) {
  return gemm_strided_batched("cublasSgemm", handle, transa, transb, m, n, k, alpha, A, CUDA_R_32F, lda, 0, B,
                              CUDA_R_32F, ldb, 0, beta, C, CUDA_R_32F, ldc, 0, 1, CUBLAS_COMPUTE_32F,
                              CUBLAS_GEMM_DEFAULT);
}

cublasStatus_t cublasGemmEx(cublasHandle_t handle, cublasOperation_t transa, cublasOperation_t transb, int m, int n,
                            int k, const void* alpha, const void* A, cudaDataType Atype, int lda, const void* B,
                            cudaDataType Btype, int ldb, const void* beta, void* C, cudaDataType Ctype, int ldc,
                            cublasComputeType_t computeType, cublasGemmAlgo_t algo) {
  return gemm_strided_batched("cublasGemmEx", handle, transa, transb, m, n, k, alpha, A, Atype, lda, 0, B, Btype, ldb,
                              0, beta, C, Ctype, ldc, 0, 1, computeType, algo);
}

cublasStatus_t cublasDgemmStridedBatched(cublasHandle_t handle, cublasOperation_t transa, cublasOperation_t transb,
                                         int m, int n, int k, const double* alpha, const double* A, int lda,
                                         long long int strideA, const double* B, int ldb, long long int strideB,
                                         const double* beta, double* C, int ldc, long long int strideC,
                                         int batchCount) {
  return gemm_strided_batched("cublasDgemmStridedBatched", handle, transa, transb, m, n, k, alpha, A, CUDA_R_64F, lda,
                              strideA, B, CUDA_R_64F, ldb, strideB, beta, C, CUDA_R_64F, ldc, strideC, batchCount,
                              CUBLAS_COMPUTE_64F, CUBLAS_GEMM_DEFAULT);
}

cublasStatus_t cublasGemmStridedBatchedEx(cublasHandle_t handle, cublasOperation_t transa, cublasOperation_t transb,
                                          int m, int n, int k, const void* alpha, const void* A, cudaDataType Atype,
                                          int lda, long long int strideA, const void* B, cudaDataType Btype, int ldb,
                                          long long int strideB, const void* beta, void* C, cudaDataType Ctype, int ldc,
                                          long long int strideC, int batchCount, cublasComputeType_t computeType,
                                          cublasGemmAlgo_t algo) {
  return gemm_strided_batched("cublasGemmStridedBatchedEx", handle, transa, transb, m, n, k, alpha, A, Atype, lda,
                              strideA, B, Btype, ldb, strideB, beta, C, Ctype, ldc, strideC, batchCount, computeType,
                              algo);
}

}  // extern "C"
