// The CUDA simulator's cublasLt.h (docs/cuda.md "The simulator"): the part of NVIDIA's cuBLASLt API
// that Loom calls, with the names, types and enum values of CUDA 13's cublasLt.h, implemented on
// the CPU in sim/cublas_lt.cpp. The descriptors are opaque here (the real header's semi-opaque
// structs and their *Init functions are not simulated); the algo and heuristic-result structs have
// the real layout.
#pragma once
#include <cublas_v2.h>
#include <cuda_runtime_api.h>
#include <library_types.h>

#include <cstddef>
#include <cstdint>

struct cublasLtContext;
typedef struct cublasLtContext* cublasLtHandle_t;

struct cublasLtMatrixLayoutOpaque_t;
typedef struct cublasLtMatrixLayoutOpaque_t* cublasLtMatrixLayout_t;

struct cublasLtMatmulDescOpaque_t;
typedef struct cublasLtMatmulDescOpaque_t* cublasLtMatmulDesc_t;

struct cublasLtMatmulPreferenceOpaque_t;
typedef struct cublasLtMatmulPreferenceOpaque_t* cublasLtMatmulPreference_t;

// An algorithm chosen by cublasLtMatmulAlgoGetHeuristic: plain data the caller copies around.
typedef struct {
  uint64_t data[8];
} cublasLtMatmulAlgo_t;

typedef struct {
  cublasLtMatmulAlgo_t algo;
  size_t workspaceSize;  // bytes of workspace cublasLtMatmul needs with this algo
  cublasStatus_t state;  // the other fields are valid only when this is CUBLAS_STATUS_SUCCESS
  float wavesCount;
  int reserved[4];
} cublasLtMatmulHeuristicResult_t;

typedef enum {
  CUBLASLT_POINTER_MODE_HOST = CUBLAS_POINTER_MODE_HOST,
  CUBLASLT_POINTER_MODE_DEVICE = CUBLAS_POINTER_MODE_DEVICE,
  CUBLASLT_POINTER_MODE_DEVICE_VECTOR = 2,
  CUBLASLT_POINTER_MODE_ALPHA_DEVICE_VECTOR_BETA_ZERO = 3,
  CUBLASLT_POINTER_MODE_ALPHA_DEVICE_VECTOR_BETA_HOST = 4,
} cublasLtPointerMode_t;

typedef enum {
  CUBLASLT_ORDER_COL = 0,
  CUBLASLT_ORDER_ROW = 1,
  CUBLASLT_ORDER_COL32 = 2,
  CUBLASLT_ORDER_COL4_4R2_8C = 3,
  CUBLASLT_ORDER_COL32_2R_4R4 = 4,
} cublasLtOrder_t;

// Attribute value types (what SetAttribute's sizeInBytes must be) are in the comments.
typedef enum {
  CUBLASLT_MATRIX_LAYOUT_TYPE = 0,                  // uint32_t (cudaDataType)
  CUBLASLT_MATRIX_LAYOUT_ORDER = 1,                 // int32_t (cublasLtOrder_t), default COL
  CUBLASLT_MATRIX_LAYOUT_ROWS = 2,                  // uint64_t
  CUBLASLT_MATRIX_LAYOUT_COLS = 3,                  // uint64_t
  CUBLASLT_MATRIX_LAYOUT_LD = 4,                    // int64_t, elements
  CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT = 5,           // int32_t, default 1
  CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET = 6,  // int64_t, elements, default 0
  CUBLASLT_MATRIX_LAYOUT_PLANE_OFFSET = 7,          // int64_t, bytes, default 0
  CUBLASLT_MATRIX_LAYOUT_BATCH_MODE = 8,            // uint32_t, default 0 (strided)
} cublasLtMatrixLayoutAttribute_t;

typedef enum {
  CUBLASLT_MATMUL_DESC_COMPUTE_TYPE = 0,        // int32_t (cublasComputeType_t)
  CUBLASLT_MATMUL_DESC_SCALE_TYPE = 1,          // int32_t (cudaDataType): the type of alpha and beta
  CUBLASLT_MATMUL_DESC_POINTER_MODE = 2,        // int32_t (cublasLtPointerMode_t), default HOST
  CUBLASLT_MATMUL_DESC_TRANSA = 3,              // int32_t (cublasOperation_t), default N
  CUBLASLT_MATMUL_DESC_TRANSB = 4,              // int32_t (cublasOperation_t), default N
  CUBLASLT_MATMUL_DESC_TRANSC = 5,              // int32_t (cublasOperation_t), only N supported
  CUBLASLT_MATMUL_DESC_FILL_MODE = 6,           // int32_t (cublasFillMode_t), default FULL
  CUBLASLT_MATMUL_DESC_EPILOGUE = 7,            // uint32_t (cublasLtEpilogue_t), default DEFAULT
  CUBLASLT_MATMUL_DESC_BIAS_POINTER = 8,        // const void*, default NULL
  CUBLASLT_MATMUL_DESC_BIAS_BATCH_STRIDE = 10,  // int64_t, elements, default 0
  CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER = 11,       // void* (GELU_AUX: written) / const void* (DGELU: read)
  CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD = 12,            // int64_t, elements: a multiple of 8, >= D's rows
  CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_BATCH_STRIDE = 13,  // int64_t, elements, a multiple of 8, default 0
  CUBLASLT_MATMUL_DESC_A_SCALE_POINTER = 17,    // const void*, default NULL (fp8 only)
  CUBLASLT_MATMUL_DESC_B_SCALE_POINTER = 18,    // const void*, default NULL (fp8 only)
  CUBLASLT_MATMUL_DESC_C_SCALE_POINTER = 19,    // const void*, default NULL (fp8 only)
  CUBLASLT_MATMUL_DESC_D_SCALE_POINTER = 20,    // const void*, default NULL (fp8 only)
  CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_DATA_TYPE = 22,  // int32_t (cudaDataType), default -1: D's type
  CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE = 26,     // int32_t (cudaDataType), default -1: D's type
} cublasLtMatmulDescAttributes_t;

typedef enum {
  CUBLASLT_EPILOGUE_DEFAULT = 1,
  CUBLASLT_EPILOGUE_RELU = 2,
  CUBLASLT_EPILOGUE_BIAS = 4,
  CUBLASLT_EPILOGUE_RELU_BIAS = CUBLASLT_EPILOGUE_RELU | CUBLASLT_EPILOGUE_BIAS,
  CUBLASLT_EPILOGUE_GELU = 32,
  CUBLASLT_EPILOGUE_GELU_BIAS = CUBLASLT_EPILOGUE_GELU | CUBLASLT_EPILOGUE_BIAS,
  CUBLASLT_EPILOGUE_GELU_AUX = CUBLASLT_EPILOGUE_GELU | 128,  // D = GELU(x), the GELU's input x to aux
  CUBLASLT_EPILOGUE_GELU_AUX_BIAS = CUBLASLT_EPILOGUE_GELU_AUX | CUBLASLT_EPILOGUE_BIAS,
  CUBLASLT_EPILOGUE_DGELU = 64 | 128,  // D = the product times GELU'(aux)
  CUBLASLT_EPILOGUE_DGELU_BGRAD = CUBLASLT_EPILOGUE_DGELU | 16,
} cublasLtEpilogue_t;

typedef enum {
  CUBLASLT_SEARCH_BEST_FIT = 0,
  CUBLASLT_SEARCH_LIMITED_BY_ALGO_ID = 1,
} cublasLtMatmulSearch_t;

typedef enum {
  CUBLASLT_MATMUL_PREF_SEARCH_MODE = 0,            // uint32_t (cublasLtMatmulSearch_t)
  CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES = 1,    // uint64_t, default 0
  CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK = 3,  // uint32_t
  CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES = 5,  // uint32_t, default 256
  CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES = 6,  // uint32_t, default 256
  CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES = 7,  // uint32_t, default 256
  CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES = 8,  // uint32_t, default 256
  CUBLASLT_MATMUL_PREF_MAX_WAVES_COUNT = 9,        // float, default 0
  CUBLASLT_MATMUL_PREF_IMPL_MASK = 12,             // uint64_t, default all
} cublasLtMatmulPreferenceAttributes_t;

#ifdef __cplusplus
extern "C" {
#endif

cublasStatus_t cublasLtCreate(cublasLtHandle_t* lightHandle);
cublasStatus_t cublasLtDestroy(cublasLtHandle_t lightHandle);
const char* cublasLtGetStatusName(cublasStatus_t status);
const char* cublasLtGetStatusString(cublasStatus_t status);

cublasStatus_t cublasLtMatrixLayoutCreate(cublasLtMatrixLayout_t* matLayout, cudaDataType type, uint64_t rows,
                                          uint64_t cols, int64_t ld);
cublasStatus_t cublasLtMatrixLayoutDestroy(cublasLtMatrixLayout_t matLayout);
cublasStatus_t cublasLtMatrixLayoutSetAttribute(cublasLtMatrixLayout_t matLayout, cublasLtMatrixLayoutAttribute_t attr,
                                                const void* buf, size_t sizeInBytes);
cublasStatus_t cublasLtMatrixLayoutGetAttribute(cublasLtMatrixLayout_t matLayout, cublasLtMatrixLayoutAttribute_t attr,
                                                void* buf, size_t sizeInBytes, size_t* sizeWritten);

cublasStatus_t cublasLtMatmulDescCreate(cublasLtMatmulDesc_t* matmulDesc, cublasComputeType_t computeType,
                                        cudaDataType_t scaleType);
cublasStatus_t cublasLtMatmulDescDestroy(cublasLtMatmulDesc_t matmulDesc);
cublasStatus_t cublasLtMatmulDescSetAttribute(cublasLtMatmulDesc_t matmulDesc, cublasLtMatmulDescAttributes_t attr,
                                              const void* buf, size_t sizeInBytes);
cublasStatus_t cublasLtMatmulDescGetAttribute(cublasLtMatmulDesc_t matmulDesc, cublasLtMatmulDescAttributes_t attr,
                                              void* buf, size_t sizeInBytes, size_t* sizeWritten);

cublasStatus_t cublasLtMatmulPreferenceCreate(cublasLtMatmulPreference_t* pref);
cublasStatus_t cublasLtMatmulPreferenceDestroy(cublasLtMatmulPreference_t pref);
cublasStatus_t cublasLtMatmulPreferenceSetAttribute(cublasLtMatmulPreference_t pref,
                                                    cublasLtMatmulPreferenceAttributes_t attr, const void* buf,
                                                    size_t sizeInBytes);
cublasStatus_t cublasLtMatmulPreferenceGetAttribute(cublasLtMatmulPreference_t pref,
                                                    cublasLtMatmulPreferenceAttributes_t attr, void* buf,
                                                    size_t sizeInBytes, size_t* sizeWritten);

// Fills heuristicResultsArray[0, *returnAlgoCount) with algorithms that can run the described
// product; CUBLAS_STATUS_NOT_SUPPORTED with *returnAlgoCount = 0 when there is none.
cublasStatus_t cublasLtMatmulAlgoGetHeuristic(cublasLtHandle_t lightHandle, cublasLtMatmulDesc_t operationDesc,
                                              cublasLtMatrixLayout_t Adesc, cublasLtMatrixLayout_t Bdesc,
                                              cublasLtMatrixLayout_t Cdesc, cublasLtMatrixLayout_t Ddesc,
                                              cublasLtMatmulPreference_t preference, int requestedAlgoCount,
                                              cublasLtMatmulHeuristicResult_t heuristicResultsArray[],
                                              int* returnAlgoCount);

// D = alpha op(A) op(B) + beta C (+ epilogue), column-major, on `stream`.
cublasStatus_t cublasLtMatmul(cublasLtHandle_t lightHandle, cublasLtMatmulDesc_t computeDesc, const void* alpha,
                              const void* A, cublasLtMatrixLayout_t Adesc, const void* B, cublasLtMatrixLayout_t Bdesc,
                              const void* beta, const void* C, cublasLtMatrixLayout_t Cdesc, void* D,
                              cublasLtMatrixLayout_t Ddesc, const cublasLtMatmulAlgo_t* algo, void* workspace,
                              size_t workspaceSizeInBytes, cudaStream_t stream);

#ifdef __cplusplus
}
#endif
