// The CUDA simulator's cuBLAS and cuBLASLt (docs/cuda.md "The simulator"): the GEMMs of
// include/cublas_v2.h and include/cublasLt.h computed on the CPU, on the caller's stream.
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
#include <cublasLt.h>
#include <cublas_v2.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "loom/backend/cuda/sim/sim_runtime.h"
#include "loom/core/dtype.h"

struct cublasContext {
  cudaStream_t stream = nullptr;
  cublasPointerMode_t pointer_mode = CUBLAS_POINTER_MODE_HOST;
  cublasMath_t math_mode = CUBLAS_DEFAULT_MATH;
  void* workspace = nullptr;  // nullptr: the library's own (the simulator needs none)
  size_t workspace_bytes = 0;
};

struct cublasLtContext {};

// The descriptors hold their attributes with the types the attribute enums name.
struct cublasLtMatrixLayoutOpaque_t {
  uint32_t type = CUDA_R_32F;
  int32_t order = CUBLASLT_ORDER_COL;
  uint64_t rows = 0;
  uint64_t cols = 0;
  int64_t ld = 0;
  int32_t batch_count = 1;
  int64_t batch_stride = 0;  // elements
  int64_t plane_offset = 0;
  uint32_t batch_mode = 0;
};

struct cublasLtMatmulDescOpaque_t {
  int32_t compute_type = CUBLAS_COMPUTE_32F;
  int32_t scale_type = CUDA_R_32F;
  int32_t pointer_mode = CUBLASLT_POINTER_MODE_HOST;
  int32_t trans_a = CUBLAS_OP_N;
  int32_t trans_b = CUBLAS_OP_N;
  int32_t trans_c = CUBLAS_OP_N;
  int32_t fill_mode = CUBLAS_FILL_MODE_FULL;
  uint32_t epilogue = CUBLASLT_EPILOGUE_DEFAULT;
  const void* bias = nullptr;
  int64_t bias_batch_stride = 0;  // elements
  const void* a_scale = nullptr;
  const void* b_scale = nullptr;
  const void* c_scale = nullptr;
  const void* d_scale = nullptr;
  int32_t bias_type = -1;  // -1: D's type
};

struct cublasLtMatmulPreferenceOpaque_t {
  uint32_t search_mode = CUBLASLT_SEARCH_BEST_FIT;
  uint64_t max_workspace_bytes = 0;
  uint32_t reduction_scheme_mask = 0x7;
  uint32_t min_alignment[4] = {256, 256, 256, 256};  // A, B, C, D
  float max_waves_count = 0;
  uint64_t impl_mask = ~uint64_t{0};
};

namespace {

using loom::sim::describe_address;
using loom::sim::fail;
using loom::sim::is_device_range;

// ------------------------------------------------------------------------------------ element types

size_t type_size(cudaDataType type) {
  switch (type) {
    case CUDA_R_64F:
      return 8;
    case CUDA_R_32F:
    case CUDA_R_32I:
      return 4;
    case CUDA_R_16F:
    case CUDA_R_16BF:
      return 2;
    default:
      return 1;
  }
}

const char* type_name(cudaDataType type) {
  switch (type) {
    case CUDA_R_32F:
      return "CUDA_R_32F";
    case CUDA_R_64F:
      return "CUDA_R_64F";
    case CUDA_R_16F:
      return "CUDA_R_16F";
    case CUDA_R_16BF:
      return "CUDA_R_16BF";
    case CUDA_R_8I:
      return "CUDA_R_8I";
    case CUDA_R_32I:
      return "CUDA_R_32I";
    case CUDA_R_8F_E4M3:
      return "CUDA_R_8F_E4M3";
    case CUDA_R_8F_E5M2:
      return "CUDA_R_8F_E5M2";
  }
  return "an unknown cudaDataType";
}

// bf16 is the upper half of a float: widening is exact; narrowing rounds to nearest even
// (core/dtype.h's conversions).
float bf16_to_float(uint16_t h) { return loom::bf16_to_f32(loom::bf16{h}); }
uint16_t float_to_bf16(float f) { return loom::f32_to_bf16(f).bits; }

// TF32 keeps 10 of float's 23 mantissa bits; rounded to nearest, ties away from zero (as PTX's
// cvt.rna.tf32.f32).
float round_to_tf32(float f) {
  if (!std::isfinite(f)) return f;
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  bits = (bits + 0x1000) & ~uint32_t{0x1FFF};
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// Element `index` of an array of `type` (only the types the supported combinations use).
template <typename Acc>
Acc load(const void* base, cudaDataType type, int64_t index) {
  switch (type) {
    case CUDA_R_32F:
      return static_cast<Acc>(static_cast<const float*>(base)[index]);
    case CUDA_R_64F:
      return static_cast<Acc>(static_cast<const double*>(base)[index]);
    case CUDA_R_16BF:
      return static_cast<Acc>(bf16_to_float(static_cast<const uint16_t*>(base)[index]));
    default:
      throw std::logic_error(std::string("cuBLAS simulator: cannot load ") + type_name(type));
  }
}

template <typename Acc>
void store(void* base, cudaDataType type, int64_t index, Acc value) {
  switch (type) {
    case CUDA_R_32F:
      static_cast<float*>(base)[index] = static_cast<float>(value);
      return;
    case CUDA_R_64F:
      static_cast<double*>(base)[index] = static_cast<double>(value);
      return;
    case CUDA_R_16BF:
      static_cast<uint16_t*>(base)[index] = float_to_bf16(static_cast<float>(value));
      return;
    default:
      throw std::logic_error(std::string("cuBLAS simulator: cannot store ") + type_name(type));
  }
}

// ------------------------------------------------------------------------------------ the product

// How the products are accumulated (cublasComputeType_t).
enum class Arithmetic { kFloat, kFloatTf32, kDouble };

// The arithmetic for a combination of compute type, alpha/beta type and A, B, C(=D) types, or none
// when cuBLAS has no kernel for it (the cublasGemmEx table, restricted to what is simulated: the
// real 16F, 32I, fp8, complex and emulated combinations are CUBLAS_STATUS_NOT_SUPPORTED here).
std::optional<Arithmetic> arithmetic_for(cublasComputeType_t compute, cudaDataType scale, cudaDataType a,
                                         cudaDataType b, cudaDataType c) {
  switch (compute) {
    case CUBLAS_COMPUTE_32F:
    case CUBLAS_COMPUTE_32F_PEDANTIC:
      if (scale != CUDA_R_32F) return std::nullopt;
      if (a == CUDA_R_32F && b == CUDA_R_32F && c == CUDA_R_32F) return Arithmetic::kFloat;
      if (a == CUDA_R_16BF && b == CUDA_R_16BF && (c == CUDA_R_32F || c == CUDA_R_16BF)) return Arithmetic::kFloat;
      return std::nullopt;
    case CUBLAS_COMPUTE_32F_FAST_TF32:
      if (scale == CUDA_R_32F && a == CUDA_R_32F && b == CUDA_R_32F && c == CUDA_R_32F) return Arithmetic::kFloatTf32;
      return std::nullopt;
    case CUBLAS_COMPUTE_64F:
    case CUBLAS_COMPUTE_64F_PEDANTIC:
      if (scale == CUDA_R_64F && a == CUDA_R_64F && b == CUDA_R_64F && c == CUDA_R_64F) return Arithmetic::kDouble;
      return std::nullopt;
    default:
      return std::nullopt;
  }
}

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
};

// The inner products, k-ordered with one fused multiply-add each. The "fma" clone uses the CPU's
// FMA instruction where it has one (same results, the library call is slower).
__attribute__((target_clones("fma", "default"))) float dot(const float* x, const float* y, int64_t k) {
  float acc = 0.0f;
  for (int64_t p = 0; p < k; ++p) acc = std::fma(x[p], y[p], acc);
  return acc;
}

__attribute__((target_clones("fma", "default"))) double dot(const double* x, const double* y, int64_t k) {
  double acc = 0.0;
  for (int64_t p = 0; p < k; ++p) acc = std::fma(x[p], y[p], acc);
  return acc;
}

// initcheck over the elements of one stored matrix, column by column (the gaps between columns
// when ld > rows are not read). Stops at the first column that draws a report; false then.
bool check_matrix_initialized(const Operand& x, const void* base, const std::string& what) {
  const size_t esize = type_size(x.type);
  for (int64_t j = 0; j < x.cols; ++j) {
    if (!loom::sim::check_initialized(static_cast<const char*>(base) + j * x.ld * static_cast<int64_t>(esize),
                                      static_cast<size_t>(x.rows) * esize, what.c_str())) {
      return false;
    }
  }
  return true;
}

void mark_matrix_written(const Operand& x, void* base) {
  const size_t esize = type_size(x.type);
  for (int64_t j = 0; j < x.cols; ++j) {
    loom::sim::mark_written(static_cast<char*>(base) + j * x.ld * static_cast<int64_t>(esize),
                            static_cast<size_t>(x.rows) * esize);
  }
}

template <typename Acc>
Acc read_scalar(const Scalar& s, const std::string& what) {
  if (s.device_ptr == nullptr) return static_cast<Acc>(s.host_value);
  loom::sim::check_initialized(s.device_ptr, sizeof(Acc), what.c_str());
  Acc value;
  std::memcpy(&value, s.device_ptr, sizeof value);
  return value;
}

// The work on the stream (device memory is addressable here). Per batch, op(A)'s rows and
// op(B)'s columns are first copied into contiguous rows of Acc, so that each output element is
// one dot() over k; then D = alpha * dot + beta * C (C not read when beta == 0) + bias.
template <typename Acc>
void run_gemm(const Gemm& g) {
  const std::string api = g.api;
  const Acc alpha = read_scalar<Acc>(g.alpha, api + " alpha");
  const Acc beta = read_scalar<Acc>(g.beta, api + " beta");
  const bool read_c = beta != Acc(0);
  const bool tf32 = g.arithmetic == Arithmetic::kFloatTf32;
  const auto widen = [&](const void* base, cudaDataType type, int64_t index) {
    const Acc v = load<Acc>(base, type, index);
    if constexpr (std::is_same_v<Acc, float>) return tf32 ? round_to_tf32(v) : v;
    return v;
  };
  const size_t d_size = type_size(g.d.type);

  bool check_uninitialized = true;                          // until the first initcheck report: one report per call
  std::vector<Acc> a_rows(static_cast<size_t>(g.m * g.k));  // a_rows[i * k + q] = op(A)(i, q)
  std::vector<Acc> b_cols(static_cast<size_t>(g.n * g.k));  // b_cols[j * k + q] = op(B)(q, j)
  for (int64_t p = 0; p < g.batch; ++p) {
    const void* a = g.a.batch(p);
    const void* b = g.b.batch(p);
    const void* c = g.c.batch(p);
    void* d = const_cast<void*>(g.d.batch(p));
    const void* bias =
        g.bias ? static_cast<const char*>(g.bias) + p * g.bias_stride * static_cast<int64_t>(d_size) : nullptr;
    if (check_uninitialized) {
      check_uninitialized = check_matrix_initialized(g.a, a, api + " A") &&
                            check_matrix_initialized(g.b, b, api + " B") &&
                            (!read_c || check_matrix_initialized(g.c, c, api + " C"));
    }
    if (bias) loom::sim::check_initialized(bias, static_cast<size_t>(g.m) * d_size, (api + " bias").c_str());

    for (int64_t i = 0; i < g.m; ++i) {
      for (int64_t q = 0; q < g.k; ++q) {
        a_rows[i * g.k + q] = widen(a, g.a.type, g.trans_a ? q + i * g.a.ld : i + q * g.a.ld);
      }
    }
    for (int64_t j = 0; j < g.n; ++j) {
      for (int64_t q = 0; q < g.k; ++q) {
        b_cols[j * g.k + q] = widen(b, g.b.type, g.trans_b ? j + q * g.b.ld : q + j * g.b.ld);
      }
    }
    for (int64_t j = 0; j < g.n; ++j) {
      for (int64_t i = 0; i < g.m; ++i) {
        Acc value = alpha * dot(a_rows.data() + i * g.k, b_cols.data() + j * g.k, g.k);
        if (read_c) value += beta * load<Acc>(c, g.c.type, i + j * g.c.ld);
        if (bias) value += load<Acc>(bias, g.d.type, i);
        store<Acc>(d, g.d.type, i + j * g.d.ld, value);
      }
    }
    mark_matrix_written(g.d, d);
  }
}

void run(const Gemm& g) {
  if (g.arithmetic == Arithmetic::kDouble) {
    run_gemm<double>(g);
  } else {
    run_gemm<float>(g);
  }
}

// ------------------------------------------------------------------------------------ checks

std::string pointer_text(const void* p) {
  std::ostringstream out;
  out << p;
  return out.str();
}

// Whether [p, p + bytes) is device memory; if not, the illegal-address report naming the call and
// `what`, and false.
bool check_device_range(const char* api, const std::string& what, const void* p, size_t bytes) {
  if (bytes == 0 || is_device_range(p, bytes)) return true;
  const std::string where =
      loom::sim::is_device_pointer(p)
          ? "it leaves its allocation: its last byte's " +
                describe_address(reinterpret_cast<const void*>(reinterpret_cast<uintptr_t>(p) + bytes - 1))
          : describe_address(p);
  fail(cudaErrorIllegalAddress,
       std::string(api) + ": " + what + " (" + std::to_string(bytes) + " bytes at " + pointer_text(p) + "): " + where);
  return false;
}

// Every matrix of the batch that the call addresses lies in device memory.
bool check_operand_memory(const char* api, const Operand& x, int64_t batch) {
  for (int64_t p = 0; p < batch; ++p) {
    const std::string what =
        "matrix " + std::string(x.name) + ", batch " + std::to_string(p) + " of " + std::to_string(batch);
    if (!check_device_range(api, what, x.batch(p), x.span_bytes())) return false;
  }
  return true;
}

bool valid_operation(int op) { return op == CUBLAS_OP_N || op == CUBLAS_OP_T || op == CUBLAS_OP_C; }

// The host value of alpha / beta, which has the compute type's precision.
double host_scalar(const void* p, Arithmetic arithmetic) {
  if (arithmetic == Arithmetic::kDouble) return *static_cast<const double*>(p);
  return *static_cast<const float*>(p);
}

size_t scalar_size(Arithmetic arithmetic) { return arithmetic == Arithmetic::kDouble ? 8 : 4; }

// Takes alpha and beta into `g` as the pointer mode says: in device mode they must be device
// memory (read later by the work); in host mode they are read now, and must not be device memory
// (host code cannot read that). False after the report when a check fails.
bool take_scalars(const char* api, bool device_mode, const void* alpha, const void* beta, Gemm* g) {
  const size_t size = scalar_size(g->arithmetic);
  if (device_mode) {
    if (!check_device_range(api, "alpha", alpha, size) || !check_device_range(api, "beta", beta, size)) return false;
    g->alpha.device_ptr = alpha;
    g->beta.device_ptr = beta;
    return true;
  }
  for (const auto& [name, p] : {std::pair{"alpha", alpha}, std::pair{"beta", beta}}) {
    if (loom::sim::is_device_pointer(p)) {
      fail(cudaErrorIllegalAddress, std::string(api) + ": " + name + " at " + pointer_text(p) +
                                        " is device memory but the pointer mode is HOST (host code cannot read it)");
      return false;
    }
  }
  g->alpha.host_value = host_scalar(alpha, g->arithmetic);
  g->beta.host_value = host_scalar(beta, g->arithmetic);
  return true;
}

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

// ------------------------------------------------------------------------------------ cuBLASLt

// An attribute of a descriptor: where it is stored and its size.
struct Field {
  void* addr = nullptr;
  size_t size = 0;
};

template <typename T>
Field field(T& value) {
  return {&value, sizeof value};
}

Field layout_field(cublasLtMatrixLayoutOpaque_t& l, cublasLtMatrixLayoutAttribute_t attr) {
  switch (attr) {
    case CUBLASLT_MATRIX_LAYOUT_TYPE:
      return field(l.type);
    case CUBLASLT_MATRIX_LAYOUT_ORDER:
      return field(l.order);
    case CUBLASLT_MATRIX_LAYOUT_ROWS:
      return field(l.rows);
    case CUBLASLT_MATRIX_LAYOUT_COLS:
      return field(l.cols);
    case CUBLASLT_MATRIX_LAYOUT_LD:
      return field(l.ld);
    case CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT:
      return field(l.batch_count);
    case CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET:
      return field(l.batch_stride);
    case CUBLASLT_MATRIX_LAYOUT_PLANE_OFFSET:
      return field(l.plane_offset);
    case CUBLASLT_MATRIX_LAYOUT_BATCH_MODE:
      return field(l.batch_mode);
  }
  return {};
}

Field desc_field(cublasLtMatmulDescOpaque_t& d, cublasLtMatmulDescAttributes_t attr) {
  switch (attr) {
    case CUBLASLT_MATMUL_DESC_COMPUTE_TYPE:
      return field(d.compute_type);
    case CUBLASLT_MATMUL_DESC_SCALE_TYPE:
      return field(d.scale_type);
    case CUBLASLT_MATMUL_DESC_POINTER_MODE:
      return field(d.pointer_mode);
    case CUBLASLT_MATMUL_DESC_TRANSA:
      return field(d.trans_a);
    case CUBLASLT_MATMUL_DESC_TRANSB:
      return field(d.trans_b);
    case CUBLASLT_MATMUL_DESC_TRANSC:
      return field(d.trans_c);
    case CUBLASLT_MATMUL_DESC_FILL_MODE:
      return field(d.fill_mode);
    case CUBLASLT_MATMUL_DESC_EPILOGUE:
      return field(d.epilogue);
    case CUBLASLT_MATMUL_DESC_BIAS_POINTER:
      return field(d.bias);
    case CUBLASLT_MATMUL_DESC_BIAS_BATCH_STRIDE:
      return field(d.bias_batch_stride);
    case CUBLASLT_MATMUL_DESC_A_SCALE_POINTER:
      return field(d.a_scale);
    case CUBLASLT_MATMUL_DESC_B_SCALE_POINTER:
      return field(d.b_scale);
    case CUBLASLT_MATMUL_DESC_C_SCALE_POINTER:
      return field(d.c_scale);
    case CUBLASLT_MATMUL_DESC_D_SCALE_POINTER:
      return field(d.d_scale);
    case CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE:
      return field(d.bias_type);
  }
  return {};
}

Field preference_field(cublasLtMatmulPreferenceOpaque_t& p, cublasLtMatmulPreferenceAttributes_t attr) {
  switch (attr) {
    case CUBLASLT_MATMUL_PREF_SEARCH_MODE:
      return field(p.search_mode);
    case CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES:
      return field(p.max_workspace_bytes);
    case CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK:
      return field(p.reduction_scheme_mask);
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES:
      return field(p.min_alignment[0]);
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES:
      return field(p.min_alignment[1]);
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES:
      return field(p.min_alignment[2]);
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES:
      return field(p.min_alignment[3]);
    case CUBLASLT_MATMUL_PREF_MAX_WAVES_COUNT:
      return field(p.max_waves_count);
    case CUBLASLT_MATMUL_PREF_IMPL_MASK:
      return field(p.impl_mask);
  }
  return {};
}

cublasStatus_t set_field(Field f, const void* buf, size_t size) {
  if (f.addr == nullptr || buf == nullptr || size != f.size) return CUBLAS_STATUS_INVALID_VALUE;
  std::memcpy(f.addr, buf, size);
  return CUBLAS_STATUS_SUCCESS;
}

// sizeInBytes == 0 asks for the size (into *sizeWritten) ("cublasLtMatmulDescGetAttribute()").
cublasStatus_t get_field(Field f, void* buf, size_t size, size_t* size_written) {
  if (f.addr == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  if (size == 0) {
    if (size_written == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
    *size_written = f.size;
    return CUBLAS_STATUS_SUCCESS;
  }
  if (buf == nullptr || size != f.size) return CUBLAS_STATUS_INVALID_VALUE;
  std::memcpy(buf, f.addr, size);
  if (size_written) *size_written = f.size;
  return CUBLAS_STATUS_SUCCESS;
}

// The simulator's algo: a tag (so a zeroed or foreign struct is recognised), the pointer alignment
// the heuristic was told for A, B, C, D, and the workspace it needs.
constexpr uint64_t kAlgoTag = 0x4c4f4f4d53494d31;  // "LOOMSIM1"
enum AlgoSlot { kTag = 0, kAlignA = 1, kAlignD = 4, kWorkspace = 5 };

// The cublasLtMatmul problem in Gemm form, or the status that refuses it (shared by the heuristic
// and the call, so both judge a configuration alike).
cublasStatus_t describe_lt(const char* api, const cublasLtMatmulDescOpaque_t* desc,
                           const cublasLtMatrixLayoutOpaque_t* layouts[4], Gemm* out) {
  if (desc == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  for (int i = 0; i < 4; ++i) {
    if (layouts[i] == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  }
  const cublasLtMatrixLayoutOpaque_t &la = *layouts[0], &lb = *layouts[1], &lc = *layouts[2], &ld = *layouts[3];
  if (!valid_operation(desc->trans_a) || !valid_operation(desc->trans_b)) return CUBLAS_STATUS_INVALID_VALUE;
  if (desc->trans_c != CUBLAS_OP_N || desc->fill_mode != CUBLAS_FILL_MODE_FULL) return CUBLAS_STATUS_NOT_SUPPORTED;
  for (int i = 0; i < 4; ++i) {
    const cublasLtMatrixLayoutOpaque_t& l = *layouts[i];
    if (l.order != CUBLASLT_ORDER_COL || l.plane_offset != 0 || l.batch_mode != 0) return CUBLAS_STATUS_NOT_SUPPORTED;
    if (l.rows > INT32_MAX || l.cols > INT32_MAX) return CUBLAS_STATUS_NOT_SUPPORTED;
    if (l.ld < std::max<int64_t>(1, static_cast<int64_t>(l.rows)) || l.batch_count < 1) {
      return CUBLAS_STATUS_INVALID_VALUE;
    }
  }
  // Shapes: D is m x n, C the same, op(A) m x k, op(B) k x n; one batch count for all.
  const bool ta = desc->trans_a != CUBLAS_OP_N, tb = desc->trans_b != CUBLAS_OP_N;
  const auto rows = [](const cublasLtMatrixLayoutOpaque_t& l) { return static_cast<int64_t>(l.rows); };
  const auto cols = [](const cublasLtMatrixLayoutOpaque_t& l) { return static_cast<int64_t>(l.cols); };
  const int64_t m = rows(ld), n = cols(ld);
  const int64_t k = ta ? rows(la) : cols(la);
  const bool shapes_agree = rows(lc) == m && cols(lc) == n && (ta ? cols(la) : rows(la)) == m &&
                            (tb ? cols(lb) : rows(lb)) == k && (tb ? rows(lb) : cols(lb)) == n;
  const bool batches_agree =
      la.batch_count == ld.batch_count && lb.batch_count == ld.batch_count && lc.batch_count == ld.batch_count;
  if (!shapes_agree || !batches_agree) return CUBLAS_STATUS_INVALID_VALUE;

  const auto type = [](const cublasLtMatrixLayoutOpaque_t& l) { return static_cast<cudaDataType>(l.type); };
  if (type(lc) != type(ld)) return CUBLAS_STATUS_NOT_SUPPORTED;
  const std::optional<Arithmetic> arithmetic =
      arithmetic_for(static_cast<cublasComputeType_t>(desc->compute_type), static_cast<cudaDataType>(desc->scale_type),
                     type(la), type(lb), type(ld));
  if (!arithmetic) return CUBLAS_STATUS_NOT_SUPPORTED;
  if (desc->pointer_mode != CUBLASLT_POINTER_MODE_HOST && desc->pointer_mode != CUBLASLT_POINTER_MODE_DEVICE) {
    return CUBLAS_STATUS_NOT_SUPPORTED;
  }
  if (desc->epilogue != CUBLASLT_EPILOGUE_DEFAULT && desc->epilogue != CUBLASLT_EPILOGUE_BIAS) {
    return CUBLAS_STATUS_NOT_SUPPORTED;
  }
  if (desc->epilogue == CUBLASLT_EPILOGUE_BIAS && desc->bias_type != -1 &&
      desc->bias_type != static_cast<int32_t>(ld.type)) {
    return CUBLAS_STATUS_NOT_SUPPORTED;
  }
  if (desc->a_scale || desc->b_scale || desc->c_scale || desc->d_scale) return CUBLAS_STATUS_INVALID_VALUE;

  const auto operand = [&](const char* name, const cublasLtMatrixLayoutOpaque_t& l) {
    return Operand{name, nullptr, type(l), rows(l), cols(l), l.ld, l.batch_stride};
  };
  *out = Gemm{.api = api,
              .trans_a = ta,
              .trans_b = tb,
              .m = m,
              .n = n,
              .k = k,
              .batch = ld.batch_count,
              .a = operand("A", la),
              .b = operand("B", lb),
              .c = operand("C", lc),
              .d = operand("D", ld),
              .arithmetic = *arithmetic};
  return CUBLAS_STATUS_SUCCESS;
}

// The simulated heuristic's rule for having an algorithm at all ("Tensor Core Usage"): leading
// dimensions, and batch offsets when there is more than one batch, are multiples of 16 bytes.
bool has_algorithm(const Gemm& g) {
  for (const Operand* x : {&g.a, &g.b, &g.c, &g.d}) {
    const int64_t esize = static_cast<int64_t>(type_size(x->type));
    if ((x->ld * esize) % 16 != 0) return false;
    if (g.batch > 1 && (x->stride * esize) % 16 != 0) return false;
  }
  return true;
}

bool aligned(const void* p, uint64_t alignment) {
  return alignment <= 1 || reinterpret_cast<uintptr_t>(p) % alignment == 0;
}

}  // namespace

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

// ------------------------------------------------------------------------------------ cuBLASLt API

cublasStatus_t cublasLtCreate(cublasLtHandle_t* lightHandle) {
  if (lightHandle == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  *lightHandle = new cublasLtContext();
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtDestroy(cublasLtHandle_t lightHandle) {
  if (lightHandle == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
  delete lightHandle;
  return CUBLAS_STATUS_SUCCESS;
}

const char* cublasLtGetStatusName(cublasStatus_t status) { return status_name(status); }

const char* cublasLtGetStatusString(cublasStatus_t status) { return status_string(status); }

cublasStatus_t cublasLtMatrixLayoutCreate(cublasLtMatrixLayout_t* matLayout, cudaDataType type, uint64_t rows,
                                          uint64_t cols, int64_t ld) {
  if (matLayout == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  auto* layout = new cublasLtMatrixLayoutOpaque_t();
  layout->type = static_cast<uint32_t>(type);
  layout->rows = rows;
  layout->cols = cols;
  layout->ld = ld;
  *matLayout = layout;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatrixLayoutDestroy(cublasLtMatrixLayout_t matLayout) {
  delete matLayout;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatrixLayoutSetAttribute(cublasLtMatrixLayout_t matLayout, cublasLtMatrixLayoutAttribute_t attr,
                                                const void* buf, size_t sizeInBytes) {
  if (matLayout == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  return set_field(layout_field(*matLayout, attr), buf, sizeInBytes);
}

cublasStatus_t cublasLtMatrixLayoutGetAttribute(cublasLtMatrixLayout_t matLayout, cublasLtMatrixLayoutAttribute_t attr,
                                                void* buf, size_t sizeInBytes, size_t* sizeWritten) {
  if (matLayout == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  return get_field(layout_field(*matLayout, attr), buf, sizeInBytes, sizeWritten);
}

cublasStatus_t cublasLtMatmulDescCreate(cublasLtMatmulDesc_t* matmulDesc, cublasComputeType_t computeType,
                                        cudaDataType_t scaleType) {
  if (matmulDesc == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  auto* desc = new cublasLtMatmulDescOpaque_t();
  desc->compute_type = computeType;
  desc->scale_type = scaleType;
  *matmulDesc = desc;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulDescDestroy(cublasLtMatmulDesc_t matmulDesc) {
  delete matmulDesc;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulDescSetAttribute(cublasLtMatmulDesc_t matmulDesc, cublasLtMatmulDescAttributes_t attr,
                                              const void* buf, size_t sizeInBytes) {
  if (matmulDesc == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  return set_field(desc_field(*matmulDesc, attr), buf, sizeInBytes);
}

cublasStatus_t cublasLtMatmulDescGetAttribute(cublasLtMatmulDesc_t matmulDesc, cublasLtMatmulDescAttributes_t attr,
                                              void* buf, size_t sizeInBytes, size_t* sizeWritten) {
  if (matmulDesc == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  return get_field(desc_field(*matmulDesc, attr), buf, sizeInBytes, sizeWritten);
}

cublasStatus_t cublasLtMatmulPreferenceCreate(cublasLtMatmulPreference_t* pref) {
  if (pref == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  *pref = new cublasLtMatmulPreferenceOpaque_t();
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulPreferenceDestroy(cublasLtMatmulPreference_t pref) {
  delete pref;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulPreferenceSetAttribute(cublasLtMatmulPreference_t pref,
                                                    cublasLtMatmulPreferenceAttributes_t attr, const void* buf,
                                                    size_t sizeInBytes) {
  if (pref == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  return set_field(preference_field(*pref, attr), buf, sizeInBytes);
}

cublasStatus_t cublasLtMatmulPreferenceGetAttribute(cublasLtMatmulPreference_t pref,
                                                    cublasLtMatmulPreferenceAttributes_t attr, void* buf,
                                                    size_t sizeInBytes, size_t* sizeWritten) {
  if (pref == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  return get_field(preference_field(*pref, attr), buf, sizeInBytes, sizeWritten);
}

cublasStatus_t cublasLtMatmulAlgoGetHeuristic(cublasLtHandle_t lightHandle, cublasLtMatmulDesc_t operationDesc,
                                              cublasLtMatrixLayout_t Adesc, cublasLtMatrixLayout_t Bdesc,
                                              cublasLtMatrixLayout_t Cdesc, cublasLtMatrixLayout_t Ddesc,
                                              cublasLtMatmulPreference_t preference, int requestedAlgoCount,
                                              cublasLtMatmulHeuristicResult_t heuristicResultsArray[],
                                              int* returnAlgoCount) {
  if (lightHandle == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (preference == nullptr || requestedAlgoCount <= 0 || heuristicResultsArray == nullptr ||
      returnAlgoCount == nullptr) {
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  *returnAlgoCount = 0;
  const cublasLtMatrixLayoutOpaque_t* layouts[4] = {Adesc, Bdesc, Cdesc, Ddesc};
  Gemm g{};
  const cublasStatus_t status = describe_lt("cublasLtMatmulAlgoGetHeuristic", operationDesc, layouts, &g);
  if (status != CUBLAS_STATUS_SUCCESS) return status;
  if (!has_algorithm(g)) return CUBLAS_STATUS_NOT_SUPPORTED;

  cublasLtMatmulHeuristicResult_t& result = heuristicResultsArray[0];
  result = cublasLtMatmulHeuristicResult_t{};
  result.algo.data[kTag] = kAlgoTag;
  for (int i = 0; i < 4; ++i) result.algo.data[kAlignA + i] = preference->min_alignment[i];
  result.algo.data[kWorkspace] = 0;  // the simulator never needs one
  result.workspaceSize = 0;
  result.state = CUBLAS_STATUS_SUCCESS;
  result.wavesCount = 1.0f;
  *returnAlgoCount = 1;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmul(cublasLtHandle_t lightHandle, cublasLtMatmulDesc_t computeDesc, const void* alpha,
                              const void* A, cublasLtMatrixLayout_t Adesc, const void* B, cublasLtMatrixLayout_t Bdesc,
                              const void* beta, const void* C, cublasLtMatrixLayout_t Cdesc, void* D,
                              cublasLtMatrixLayout_t Ddesc, const cublasLtMatmulAlgo_t* algo, void* workspace,
                              size_t workspaceSizeInBytes, cudaStream_t stream) {
  const char* api = "cublasLtMatmul";
  if (lightHandle == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
  const cublasLtMatrixLayoutOpaque_t* layouts[4] = {Adesc, Bdesc, Cdesc, Ddesc};
  Gemm g{};
  const cublasStatus_t status = describe_lt(api, computeDesc, layouts, &g);
  if (status != CUBLAS_STATUS_SUCCESS) return status;
  if (alpha == nullptr || beta == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  // In place (C == D) needs C's layout to be D's.
  if (C == D && (Cdesc->type != Ddesc->type || Cdesc->ld != Ddesc->ld || Cdesc->batch_stride != Ddesc->batch_stride)) {
    return CUBLAS_STATUS_INVALID_VALUE;
  }

  // No algo: the implicit heuristic query with the default preferences.
  cublasLtMatmulAlgo_t chosen{};
  if (algo == nullptr) {
    const cublasLtMatmulPreferenceOpaque_t defaults;
    chosen.data[kTag] = kAlgoTag;
    for (int i = 0; i < 4; ++i) chosen.data[kAlignA + i] = defaults.min_alignment[i];
  } else {
    chosen = *algo;
    if (chosen.data[kTag] != kAlgoTag) return CUBLAS_STATUS_INVALID_VALUE;  // not from the heuristic
  }
  if (!has_algorithm(g)) return CUBLAS_STATUS_NOT_SUPPORTED;
  const void* pointers[4] = {A, B, C, D};
  for (int i = 0; i < 4; ++i) {
    if (!aligned(pointers[i], chosen.data[kAlignA + i])) return CUBLAS_STATUS_NOT_SUPPORTED;
  }
  if (workspaceSizeInBytes < chosen.data[kWorkspace]) return CUBLAS_STATUS_INVALID_VALUE;
  if (workspaceSizeInBytes > 0 && !aligned(workspace, 256)) return CUBLAS_STATUS_INVALID_VALUE;
  if (computeDesc->epilogue == CUBLASLT_EPILOGUE_BIAS && computeDesc->bias == nullptr) {
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  if (g.m == 0 || g.n == 0) return CUBLAS_STATUS_SUCCESS;

  g.a.ptr = A;
  g.b.ptr = B;
  g.c.ptr = C;
  g.d.ptr = D;
  if (computeDesc->epilogue == CUBLASLT_EPILOGUE_BIAS) {
    g.bias = computeDesc->bias;
    g.bias_stride = computeDesc->bias_batch_stride;
  }
  if (!take_scalars(api, computeDesc->pointer_mode == CUBLASLT_POINTER_MODE_DEVICE, alpha, beta, &g)) {
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  // C is read only when beta != 0 (a beta in device memory may be anything).
  const bool reads_c = g.beta.device_ptr != nullptr || g.beta.host_value != 0;
  bool in_device_memory = check_operand_memory(api, g.a, g.batch) && check_operand_memory(api, g.b, g.batch) &&
                          (!reads_c || check_operand_memory(api, g.c, g.batch)) &&
                          check_operand_memory(api, g.d, g.batch) &&
                          check_device_range(api, "workspace", workspace, workspaceSizeInBytes);
  for (int64_t p = 0; in_device_memory && g.bias && p < g.batch; ++p) {
    const void* bias = static_cast<const char*>(g.bias) + p * g.bias_stride * static_cast<int64_t>(type_size(g.d.type));
    in_device_memory = check_device_range(api, "bias, batch " + std::to_string(p), bias,
                                          static_cast<size_t>(g.m) * type_size(g.d.type));
  }
  if (!in_device_memory) return CUBLAS_STATUS_INVALID_VALUE;
  loom::sim::enqueue(stream, api, [g] { run(g); });
  return CUBLAS_STATUS_SUCCESS;
}

}  // extern "C"
