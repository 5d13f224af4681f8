// The simulator's cuBLAS and cuBLASLt, the GEMM itself (cublas.cpp's top comment gives the
// library's rules): element types, the arithmetic of each compute type, the product a call's work
// runs on the stream, and the checks at the call that its memory is device memory.
#include <cublas_v2.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "loom/backend/cuda/sim/cublas_internal.h"
#include "loom/backend/cuda/sim/sim_runtime.h"
#include "loom/core/dtype.h"

namespace loom::sim::cublas_detail {

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

namespace {

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

// The GELU epilogues' function and slope, the tanh form (Hendrycks & Gimpel 2016), in the
// accumulator's type from the unrounded sum: gelu(x) = 0.5 x (1 + tanh(u)), u = sqrt(2/pi) (x +
// 0.044715 x^3); gelu'(x) = 0.5 (1 + tanh u) + 0.5 x (1 - tanh^2 u) sqrt(2/pi) (1 + 3 0.044715 x^2).
constexpr double kGeluScale = 0.7978845608028654, kGeluCubic = 0.044715;  // sqrt(2/pi), the cubic's
template <typename Acc>
Acc gelu_tanh(Acc x) {  // tanh(u)
  return std::tanh(Acc(kGeluScale) * (x + Acc(kGeluCubic) * x * x * x));
}
template <typename Acc>
Acc gelu(Acc x) {
  return Acc(0.5) * x * (Acc(1) + gelu_tanh(x));
}
template <typename Acc>
Acc gelu_slope(Acc x) {
  const Acc t = gelu_tanh(x);
  return Acc(0.5) * (Acc(1) + t) + Acc(0.5) * x * (Acc(1) - t * t) * Acc(kGeluScale) * (Acc(1) + Acc(3 * kGeluCubic) * x * x);
}

}  // namespace

// ------------------------------------------------------------------------------------ the product

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

namespace {

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
    void* aux = g.gelu == Gemm::Gelu::kNone ? nullptr : const_cast<void*>(g.aux.batch(p));
    if (g.gelu == Gemm::Gelu::kBackward) check_matrix_initialized(g.aux, aux, api + " aux");
    for (int64_t j = 0; j < g.n; ++j) {
      for (int64_t i = 0; i < g.m; ++i) {
        Acc value = alpha * dot(a_rows.data() + i * g.k, b_cols.data() + j * g.k, g.k);
        if (read_c) value += beta * load<Acc>(c, g.c.type, i + j * g.c.ld);
        if (bias) value += load<Acc>(bias, g.d.type, i);
        if (g.gelu == Gemm::Gelu::kForward) {
          store<Acc>(aux, g.aux.type, i + j * g.aux.ld, value);
          value = gelu(value);
        } else if (g.gelu == Gemm::Gelu::kBackward) {
          value *= gelu_slope(load<Acc>(aux, g.aux.type, i + j * g.aux.ld));
        }
        store<Acc>(d, g.d.type, i + j * g.d.ld, value);
      }
    }
    mark_matrix_written(g.d, d);
    if (g.gelu == Gemm::Gelu::kForward) mark_matrix_written(g.aux, aux);
  }
}

}  // namespace

void run(const Gemm& g) {
  if (g.arithmetic == Arithmetic::kDouble) {
    run_gemm<double>(g);
  } else {
    run_gemm<float>(g);
  }
}

// ------------------------------------------------------------------------------------ checks

namespace {

std::string pointer_text(const void* p) {
  std::ostringstream out;
  out << p;
  return out.str();
}

// The host value of alpha / beta, which has the compute type's precision.
double host_scalar(const void* p, Arithmetic arithmetic) {
  if (arithmetic == Arithmetic::kDouble) return *static_cast<const double*>(p);
  return *static_cast<const float*>(p);
}

size_t scalar_size(Arithmetic arithmetic) { return arithmetic == Arithmetic::kDouble ? 8 : 4; }

}  // namespace

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

bool aligned(const void* p, uint64_t alignment) {
  return alignment <= 1 || reinterpret_cast<uintptr_t>(p) % alignment == 0;
}

}  // namespace loom::sim::cublas_detail
