// The CUDA backend's GEMMs (Backend::gemm). C (m, n) row-major is the column-major (n, m) matrix
// C^T = op(B)^T op(A)^T, so every call passes B as cuBLAS's "A" and A as its "B", with the
// transposes unchanged:
//   f32: cuBLASLt, CUBLAS_COMPUTE_32F (true fp32, no TF32: the op tests compare at 1e-5);
//   bf16 A, B with f32 C: cuBLASLt, bf16 inputs, fp32 accumulation and output;
//   bf16 A, B and C (an autocast-style output): cuBLASLt rounds the fp32 sum, its bias epilogue
//     reading a bf16 copy of the bias (cuBLASLt's bias has D's type); shapes it declines, and
//     those that would need panels, run as fp32 row chunks in the workspace, rounded after;
//   f64: cublasDgemmStridedBatched (reference checks);
//   large GEMMs with rows that are not 16-byte multiples (GPT-2's 50,257-wide logits): in panels
//     staged through padded rows (gemm_panels.h), so cuBLASLt's tensor-core kernels take them;
//   shapes cuBLASLt declines (rows not 16-byte aligned): cublasGemmStridedBatchedEx, fp32 accumulation.
// The bias goes into cuBLASLt's epilogue (CUBLASLT_EPILOGUE_BIAS), or a row kernel after the other GEMMs.
// gemm_gelu / gemm_dgelu put the MLP's GELU into the epilogue too (GELU_AUX_BIAS, DGELU) where the
// operands are bf16 and the heuristic has an algorithm; otherwise the GEMM, then the GELU kernel.
#include <cublasLt.h>
#include <cublas_v2.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <utility>

#include "loom/backend/checks.h"
#include "loom/backend/cuda/cuda_backend_internal.h"
#include "loom/backend/cuda/cuda_check.h"
#include "loom/backend/cuda/cuda_kernels.h"
#include "loom/backend/cuda/cuda_parallel.h"
#include "loom/backend/gemm_panels.h"
#include "loom/core/error.h"

namespace loom::cuda_backend_detail {

using checks::dispatch_float;

namespace {

// Bytes of an A or B element of a GEMM call (C is f32).
int64_t in_bytes(cudaDataType_t in_type) { return in_type == CUDA_R_16BF ? 2 : 4; }

// The largest power of two, at most 256, that divides the address (cuBLASLt's alignment unit).
uint32_t pointer_alignment(const void* p) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  uint32_t alignment = 256;
  while (alignment > 1 && a % alignment != 0) alignment /= 2;
  return alignment;
}

}  // namespace

void CudaBackend::gemm(const Tensor& a, const Tensor& b, const Tensor& c, const GemmSpec& spec, const Tensor* bias) {
  const checks::GemmDims d = checks::check_gemm(a, b, c, spec, bias);
  if (d.m == 0 || d.n == 0) return;
  LOOM_CHECK(d.m <= INT_MAX && d.n <= INT_MAX && d.k <= INT_MAX && spec.batch <= INT_MAX, "gemm: dims (", d.m, ", ",
             d.n, ", ", d.k, ") exceed cuBLAS's 32-bit sizes");
  bool bias_done = false;  // cuBLASLt's epilogue added it
  if (a.dtype() == DTYPE_F64) {
    if (spec.c_in != nullptr && spec.beta != 0.0f) copy(*spec.c_in, c);
    gemm_f64(a, b, c, spec, d);
  } else if (a.dtype() == DTYPE_F32 || a.dtype() == DTYPE_BF16) {
    GemmCall call = gemm_call(a, b, c, spec, d);
    if (call.out_type == CUDA_R_16BF) {
      gemm_bf16_out(call, bias);
      return;
    }
    const GemmPanels panels = plan_gemm_panels(
        {.m = d.m, .n = d.n, .k = d.k, .trans_a = spec.trans_a, .trans_b = spec.trans_b, .batch = spec.batch,
         .in_bytes = static_cast<size_t>(in_bytes(call.in_type)), .out_bytes = 4},
        panel_limits_);
    // A separate C (GemmSpec::c_in) goes to cuBLASLt as its C; the other paths read C in place,
    // copied from c_in first.
    const void* bias_ptr = bias ? bias->device_ptr() : nullptr;
    bool done = false;
    if (call.c_in != nullptr && panels.dim == GemmPanels::NONE) {
      bool declined = false;
      bias_done = gemm_lt(call, bias_ptr, false, &declined);
      done = !declined;
    }
    if (!done) {
      if (call.c_in != nullptr) copy(*spec.c_in, c), call.c_in = nullptr;
      if (panels.dim == GemmPanels::NONE) bias_done = gemm_lt(call, bias_ptr);
      else gemm_panels(call, panels);
    }
  } else {
    throw Error(str_cat("gemm: not supported for dtype ", dtype_name(a.dtype()), " on the CUDA backend (f32, bf16, f64)"));
  }
  if (bias && !bias_done) {
    dispatch_float(c.dtype(), "gemm", kBackend, [&]<typename T>() {
      cuda::add_bias_rows<T>(dptr<T>(c), dptr<T>(*bias), spec.batch * d.m, d.n, stream_);
    });
  }
}

CudaBackend::GemmCall CudaBackend::gemm_call(const Tensor& a, const Tensor& b, const Tensor& c, const GemmSpec& spec,
                                            const checks::GemmDims& d) {
  return GemmCall{.a = a.device_ptr(),
                  .b = b.device_ptr(),
                  .c = c.device_ptr(),
                  .m = d.m,
                  .n = d.n,
                  .k = d.k,
                  .lda = d.a_cols,
                  .ldb = d.b_cols,
                  .ldc = d.n,
                  .batch = spec.batch,
                  .stride_a = d.a_rows * d.a_cols,
                  .stride_b = d.b_rows * d.b_cols,
                  .stride_c = d.m * d.n,
                  .trans_a = spec.trans_a,
                  .trans_b = spec.trans_b,
                  .alpha = spec.alpha,
                  .beta = spec.beta,
                  .in_type = a.dtype() == DTYPE_BF16 ? CUDA_R_16BF : CUDA_R_32F,
                  .out_type = c.dtype() == DTYPE_BF16 ? CUDA_R_16BF : CUDA_R_32F,
                  .c_in = spec.c_in && spec.beta != 0.0f ? spec.c_in->device_ptr() : nullptr};
}

void CudaBackend::gemm_bf16_out(const GemmCall& g, const Tensor* bias) {
  constexpr int64_t kChunkBytes = int64_t{64} << 20;  // the staged path's fp32 rows at a time
  constexpr int64_t kAlign = 256;
  const int64_t bias_bytes = bias ? (g.n * 2 + kAlign - 1) / kAlign * kAlign : 0;
  const GemmPanels panels = plan_gemm_panels(
      {.m = g.m, .n = g.n, .k = g.k, .trans_a = g.trans_a, .trans_b = g.trans_b, .batch = g.batch,
       .in_bytes = 2, .out_bytes = 2},
      panel_limits_);
  const int64_t chunk_rows = std::clamp<int64_t>(kChunkBytes / (g.n * 4), 1, g.m);
  // cuBLASLt's epilogue takes one bias vector: a batch with a bias is staged.
  const bool direct = panels.dim == GemmPanels::NONE && (bias == nullptr || g.batch == 1);
  auto* scratch = static_cast<char*>(workspace(static_cast<size_t>(bias_bytes + (direct ? 0 : chunk_rows * g.n * 4))));
  auto* bias16 = bias ? reinterpret_cast<uint16_t*>(scratch) : nullptr;
  if (bias) cuda::cast_f32_to_bf16(dptr<float>(*bias), bias16, g.n, stream_);
  bool declined = !direct;
  if (direct) {
    gemm_lt(g, bias16, false, &declined);
    if (!declined) return;
    // A larger workspace replaces the buffer: the bias's copy is made again in the new one.
    scratch = static_cast<char*>(workspace(static_cast<size_t>(bias_bytes + chunk_rows * g.n * 4)));
    bias16 = bias ? reinterpret_cast<uint16_t*>(scratch) : nullptr;
    if (bias) cuda::cast_f32_to_bf16(dptr<float>(*bias), bias16, g.n, stream_);
  }
  // Staged: per matrix of the batch and chunk of rows, the fp32 product into the workspace.
  auto* acc = reinterpret_cast<float*>(scratch + bias_bytes);
  const int64_t in = 2;
  for (int64_t i = 0; i < g.batch; ++i) {
    for (int64_t first = 0; first < g.m; first += chunk_rows) {
      GemmCall chunk = g;
      chunk.batch = 1, chunk.m = std::min(chunk_rows, g.m - first), chunk.beta = 0.0f, chunk.out_type = CUDA_R_32F;
      const auto* a = static_cast<const char*>(g.a) + i * g.stride_a * in;
      chunk.a = g.trans_a ? a + first * in : a + first * g.lda * in;  // op(A)'s rows [first, first + m)
      chunk.b = static_cast<const char*>(g.b) + i * g.stride_b * in;
      chunk.c = acc, chunk.ldc = g.n;
      gemm_lt(chunk, nullptr);
      auto* c = static_cast<uint16_t*>(g.c) + i * g.stride_c + first * g.ldc;
      cuda::round_rows_bf16(acc, bias16, c, chunk.m, g.n, stream_);
    }
  }
}

bool CudaBackend::gemm_lt(const GemmCall& g, const void* bias, bool ex_fallback, bool* declined) {
  const bool use_bias = bias != nullptr && g.batch == 1;
  // Stored row-major shapes: A (m, k) or (k, m) when transposed, B (k, n) or (n, k).
  const int64_t a_rows = g.trans_a ? g.k : g.m, a_cols = g.trans_a ? g.m : g.k;
  const int64_t b_rows = g.trans_b ? g.n : g.k, b_cols = g.trans_b ? g.k : g.n;
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t la = nullptr, lb = nullptr, lc = nullptr;
  const auto cleanup = [&] {  // idempotent
    if (la) cublasLtMatrixLayoutDestroy(la);
    if (lb) cublasLtMatrixLayoutDestroy(lb);
    if (lc) cublasLtMatrixLayoutDestroy(lc);
    if (desc) cublasLtMatmulDescDestroy(desc);
    la = lb = lc = nullptr;
    desc = nullptr;
  };
  try {
    LOOM_CUBLAS_STATUS(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    // cuBLAS's A is our B, its B our A: op flags unchanged.
    const cublasOperation_t op_first = g.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
    const cublasOperation_t op_second = g.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
    LOOM_CUBLAS_STATUS(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_first, sizeof(op_first)));
    LOOM_CUBLAS_STATUS(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_second, sizeof(op_second)));
    // The bias in the GEMM's epilogue (one pass over C saved): cuBLAS's D is our C^T, whose rows
    // are our columns, so its per-row bias is our bias[n]. One matrix only (a batch would need the
    // bias's batch stride); the other calls add it with a kernel after the GEMM.
    cublasLtEpilogue_t epilogue = use_bias ? CUBLASLT_EPILOGUE_BIAS : CUBLASLT_EPILOGUE_DEFAULT;
    if (g.gelu == GemmCall::Gelu::forward) epilogue = use_bias ? CUBLASLT_EPILOGUE_GELU_AUX_BIAS : CUBLASLT_EPILOGUE_GELU_AUX;
    if (g.gelu == GemmCall::Gelu::backward) epilogue = CUBLASLT_EPILOGUE_DGELU;  // (gemm_dgelu has no bias)
    if (epilogue != CUBLASLT_EPILOGUE_DEFAULT) {
      LOOM_CUBLAS_STATUS(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue, sizeof(epilogue)));
    }
    if (use_bias) {
      LOOM_CUBLAS_STATUS(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof(bias)));
    }
    // The GELU's input matrix: cuBLAS's D is our C^T, so aux, laid out as C, has C's leading dimension.
    if (g.gelu != GemmCall::Gelu::none) {
      const int64_t aux_ld = g.ldc;
      LOOM_CUBLAS_STATUS(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &g.aux,
                                                        sizeof(g.aux)));
      LOOM_CUBLAS_STATUS(
          cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &aux_ld, sizeof(aux_ld)));
    }
    // Column-major views: our row-major (r, c) with leading dim ld is cuBLAS's (c, r) with ld.
    LOOM_CUBLAS_STATUS(cublasLtMatrixLayoutCreate(&la, g.in_type, b_cols, b_rows, g.ldb));
    LOOM_CUBLAS_STATUS(cublasLtMatrixLayoutCreate(&lb, g.in_type, a_cols, a_rows, g.lda));
    LOOM_CUBLAS_STATUS(cublasLtMatrixLayoutCreate(&lc, g.out_type, g.n, g.m, g.ldc));
    if (g.batch > 1) {
      const int32_t count = static_cast<int32_t>(g.batch);
      for (auto [layout, stride] : {std::pair{la, g.stride_b}, std::pair{lb, g.stride_a}, std::pair{lc, g.stride_c}}) {
        LOOM_CUBLAS_STATUS(
            cublasLtMatrixLayoutSetAttribute(layout, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count, sizeof(count)));
        LOOM_CUBLAS_STATUS(cublasLtMatrixLayoutSetAttribute(layout, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET,
                                                            &stride, sizeof(stride)));
      }
    }
    cublasLtMatmulPreference_t pref = nullptr;
    LOOM_CUBLAS_STATUS(cublasLtMatmulPreferenceCreate(&pref));
    const size_t ws = static_cast<size_t>(kLtWorkspaceBytes);
    cublasLtMatmulHeuristicResult_t result{};
    int found = 0;
    cublasStatus_t hs = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws,
                                                             sizeof(ws));
    // The pointers' own alignment: the heuristic assumes 256 bytes unless told, and the chosen
    // algorithm then refuses a view that starts inside a block (found by the CUDA simulator).
    const std::pair<cublasLtMatmulPreferenceAttributes_t, const void*> operands[] = {
        {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, g.b},
        {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, g.a},
        {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, g.c_in ? g.c_in : g.c},
        {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, g.c}};
    for (const auto& [attribute, pointer] : operands) {
      const uint32_t alignment = pointer_alignment(pointer);
      if (hs != CUBLAS_STATUS_SUCCESS) break;
      hs = cublasLtMatmulPreferenceSetAttribute(pref, attribute, &alignment, sizeof(alignment));
    }
    const cublasStatus_t hr =
        hs == CUBLAS_STATUS_SUCCESS ? cublasLtMatmulAlgoGetHeuristic(lt_, desc, la, lb, lc, lc, pref, 1, &result, &found)
                                    : hs;
    cublasLtMatmulPreferenceDestroy(pref);
    if (hr != CUBLAS_STATUS_SUCCESS || found == 0) {  // e.g. rows not 16-byte aligned: cuBLAS takes any
      cleanup();
      if (declined) *declined = true;
      if (ex_fallback) gemm_ex(g);
      return false;
    }
    const float alpha = g.alpha, beta = g.beta;
    LOOM_CUBLAS_STATUS(cublasLtMatmul(lt_, desc, &alpha, g.b, la, g.a, lb, &beta, g.c_in ? g.c_in : g.c, lc, g.c, lc, &result.algo,
                                      lt_workspace_.device_ptr(), ws, stream_));
  } catch (...) {
    cleanup();
    throw;
  }
  cleanup();
  return use_bias;
}

void CudaBackend::gemm_gelu(const Tensor& a, const Tensor& b, const Tensor& pre, const Tensor& act,
                            const GemmSpec& spec, const Tensor* bias) {
  const checks::GemmDims d = checks::check_gemm_gelu("gemm_gelu", a, b, pre, act, spec, bias, nullptr);
  if (!gemm_gelu_epilogue(a, b, pre, act, spec, d, bias, GemmCall::Gelu::forward)) {
    Backend::gemm_gelu(a, b, pre, act, spec, bias);
  }
}

void CudaBackend::gemm_dgelu(const Tensor& a, const Tensor& b, const Tensor& pre, const Tensor& scratch,
                             const Tensor& dx, const GemmSpec& spec) {
  const checks::GemmDims d = checks::check_gemm_gelu("gemm_dgelu", a, b, pre, dx, spec, nullptr, &scratch);
  if (!gemm_gelu_epilogue(a, b, pre, dx, spec, d, nullptr, GemmCall::Gelu::backward)) {
    Backend::gemm_dgelu(a, b, pre, scratch, dx, spec);
  }
}

// cuBLASLt's GELU epilogues take one matrix of bf16 A, B, D and aux here (the autocast layout the
// MLP writes); aux's leading dimension must be a multiple of 8 elements. Anything else, and any
// shape the heuristic declines, runs the default: the GEMM, then the GELU kernel.
bool CudaBackend::gemm_gelu_epilogue(const Tensor& a, const Tensor& b, const Tensor& aux, const Tensor& c,
                                     const GemmSpec& spec, const checks::GemmDims& d, const Tensor* bias,
                                     GemmCall::Gelu gelu) {
  if (a.dtype() != DTYPE_BF16 || c.dtype() != DTYPE_BF16 || aux.dtype() != DTYPE_BF16 || spec.batch != 1) return false;
  if (d.m == 0 || d.n == 0 || d.n % 8 != 0 || d.m > INT_MAX || d.n > INT_MAX || d.k > INT_MAX) return false;
  if (pointer_alignment(aux.device_ptr()) < 16) return false;  // (no preference states aux's alignment)
  const GemmPanels panels = plan_gemm_panels({.m = d.m, .n = d.n, .k = d.k, .trans_a = spec.trans_a,
                                              .trans_b = spec.trans_b, .batch = 1, .in_bytes = 2, .out_bytes = 2},
                                             panel_limits_);
  if (panels.dim != GemmPanels::NONE) return false;
  GemmCall call = gemm_call(a, b, c, spec, d);
  call.gelu = gelu;
  call.aux = aux.device_ptr();
  uint16_t* bias16 = nullptr;  // cuBLASLt's bias has D's type
  if (bias != nullptr) {
    bias16 = static_cast<uint16_t*>(workspace(static_cast<size_t>(d.n) * 2));
    cuda::cast_f32_to_bf16(dptr<float>(*bias), bias16, d.n, stream_);
  }
  bool declined = false;
  gemm_lt(call, bias16, false, &declined);
  if (!declined) ++gelu_epilogue_gemms_;
  return !declined;
}

void CudaBackend::gemm_ex(const GemmCall& g) {
  const float alpha = g.alpha, beta = g.beta;
  LOOM_CUBLAS_STATUS(cublasGemmStridedBatchedEx(
      cublas_, g.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, g.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, static_cast<int>(g.n),
      static_cast<int>(g.m), static_cast<int>(g.k), &alpha, g.b, g.in_type, static_cast<int>(g.ldb), g.stride_b, g.a,
      g.in_type, static_cast<int>(g.lda), g.stride_a, &beta, g.c, g.out_type, static_cast<int>(g.ldc), g.stride_c,
      static_cast<int>(g.batch), CUBLAS_COMPUTE_32F_PEDANTIC, CUBLAS_GEMM_DEFAULT));
}

// gemm_panels.h's plan, run: per panel, A's rows copied into padded rows (or a view of A), C's
// copied in when beta reads it, the GEMM on aligned operands, C's rows copied back. Panels along K
// accumulate: the first with the caller's beta, the rest with beta 1. The bias is left to the
// caller's row kernel (a panel the heuristic declined would otherwise have had none).
void CudaBackend::gemm_panels(const GemmCall& g, const GemmPanels& p) {
  const int64_t in = in_bytes(g.in_type), out = 4;
  auto* scratch = static_cast<char*>(workspace(p.a_scratch_bytes + p.c_scratch_bytes));
  char* a_panel = scratch;
  char* c_panel = scratch + p.a_scratch_bytes;
  const auto* a = static_cast<const char*>(g.a);
  const auto* b = static_cast<const char*>(g.b);
  auto* c = static_cast<char*>(g.c);
  const int64_t extent = p.dim == GemmPanels::M ? g.m : g.k;
  for (int64_t first = 0; first < extent; first += p.rows) {
    const int64_t rows = std::min(p.rows, extent - first);
    GemmCall panel = g;
    if (p.dim == GemmPanels::M) {  // rows [first, first + rows) of C and of op(A)
      panel.m = rows;
      // A (m, k): a row panel; A stored (k, m): a column block, a view (kPanelQuantum keeps it aligned).
      panel.a = g.trans_a ? a + first * in : a + first * g.lda * in;
      panel.c = c + first * g.ldc * out;
    } else {  // the reduction's [first, first + rows): rows of A stored (k, m), of B (k, n) or B's columns
      panel.k = rows;
      panel.a = a + first * g.lda * in;
      panel.b = g.trans_b ? b + first * in : b + first * g.ldb * in;
      if (first > 0) panel.beta = 1.0f;
    }
    if (p.stage_a) {
      const int64_t a_cols = g.trans_a ? g.m : g.k;
      cuda::copy_block(panel.a, a_panel, rows, a_cols * in, g.lda * in, p.lda_padded * in, stream_);
      panel.a = a_panel;
      panel.lda = p.lda_padded;
    }
    void* c_rows = panel.c;
    if (p.stage_c) {
      if (g.beta != 0.0f) {
        cuda::copy_block(c_rows, c_panel, rows, g.n * out, g.ldc * out, p.ldc_padded * out, stream_);
      }
      panel.c = c_panel;
      panel.ldc = p.ldc_padded;
    }
    gemm_lt(panel, nullptr);
    if (p.stage_c) {
      cuda::copy_block(c_panel, c_rows, rows, g.n * out, p.ldc_padded * out, g.ldc * out, stream_);
    }
  }
  ++panel_gemms_;
}

void CudaBackend::gemm_f64(const Tensor& a, const Tensor& b, const Tensor& c, const GemmSpec& spec, const checks::GemmDims& d) {
  const double alpha = spec.alpha, beta = spec.beta;
  LOOM_CUBLAS_STATUS(cublasDgemmStridedBatched(
      cublas_, spec.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, spec.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N,
      static_cast<int>(d.n), static_cast<int>(d.m), static_cast<int>(d.k), &alpha, dptr<double>(b),
      static_cast<int>(d.b_cols), d.b_rows * d.b_cols, dptr<double>(a), static_cast<int>(d.a_cols),
      d.a_rows * d.a_cols, &beta, dptr<double>(c), static_cast<int>(d.n), d.m * d.n, static_cast<int>(spec.batch)));
}

}  // namespace loom::cuda_backend_detail
