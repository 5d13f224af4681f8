// Shared by the simulator's cuBLAS (cublas.cpp), its cuBLASLt (cublas_lt.cpp) and the GEMM both
// enqueue (cublas_gemm.cpp: the element types, the product, the device-memory checks): a call in
// Gemm form and what the three call. Not for callers.
#pragma once
#include <cublas_v2.h>
#include <library_types.h>

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>

namespace loom::sim::cublas_detail {

size_t type_size(cudaDataType type);  // bytes per element

// ------------------------------------------------------------------------------------ the product

// How the products are accumulated (cublasComputeType_t).
enum class Arithmetic { kFloat, kFloatTf32, kDouble };

std::optional<Arithmetic> arithmetic_for(cublasComputeType_t compute, cudaDataType scale, cudaDataType a,
                                         cudaDataType b, cudaDataType c);

// One matrix of a strided batch as stored: column-major, `rows` x `cols`, element (i, j) of batch
// p at ptr[p * stride + i + j * ld] (all in elements).
struct Operand {
  const char* name;  // "A", "B", "C", "D" in reports
  const void* ptr;
  cudaDataType type;
  int64_t rows, cols, ld, stride;

  const void* batch(int64_t p) const {  // integer arithmetic: ptr may be anything before the checks
    return reinterpret_cast<const void*>(reinterpret_cast<uintptr_t>(ptr) +
                                         static_cast<uintptr_t>(p * stride * static_cast<int64_t>(type_size(type))));
  }
  // Bytes from the first to one past the last element of one matrix (0 when it is empty).
  size_t span_bytes() const {
    if (rows == 0 || cols == 0) return 0;
    return static_cast<size_t>((cols - 1) * ld + rows) * type_size(type);
  }
};

// alpha or beta: its value when it was in host memory, else where it is in device memory.
struct Scalar {
  double host_value = 0;
  const void* device_ptr = nullptr;
};

// A whole call, as the work on the stream runs it: D_p = alpha op(A_p) op(B_p) + beta C_p
// (+ bias_p as a column added to every column) for each batch p.
struct Gemm {
  const char* api = "";
  bool trans_a = false, trans_b = false;
  int64_t m = 0, n = 0, k = 0, batch = 0;
  Operand a{}, b{}, c{}, d{};  // cuBLAS: d is c
  Arithmetic arithmetic = Arithmetic::kFloat;
  Scalar alpha{}, beta{};
  const void* bias = nullptr;  // m elements of d's type per batch (CUBLASLT_EPILOGUE_BIAS)
  int64_t bias_stride = 0;
  // The GELU epilogues (tanh form): kForward writes the GELU's input (the sum plus the bias) to aux
  // and its GELU to D (CUBLASLT_EPILOGUE_GELU_AUX(_BIAS)); kBackward reads aux and writes the sum
  // times GELU'(aux) (CUBLASLT_EPILOGUE_DGELU). aux: D's type and shape, its own ld and stride.
  enum class Gelu { kNone, kForward, kBackward } gelu = Gelu::kNone;
  Operand aux{"aux", nullptr, CUDA_R_32F, 0, 0, 0, 0};
};

// Runs a whole call on the stream's worker (device memory addressable).
void run(const Gemm& g);

// The checks at the call (cublas_gemm.cpp): each failing one has written its report.
bool check_device_range(const char* api, const std::string& what, const void* p, size_t bytes);
bool check_operand_memory(const char* api, const Operand& x, int64_t batch);
bool valid_operation(int op);
bool take_scalars(const char* api, bool device_mode, const void* alpha, const void* beta, Gemm* g);
bool aligned(const void* p, uint64_t alignment);

// cublasGetStatusName / cublasGetStatusString, which cuBLASLt's answer alike (cublas.cpp).
const char* status_name(cublasStatus_t status);
const char* status_string(cublasStatus_t status);

}  // namespace loom::sim::cublas_detail
