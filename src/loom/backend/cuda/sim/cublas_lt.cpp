// The simulator's cuBLASLt (cublas.cpp's top comment gives the library's rules): the handle, the
// matrix layouts, matmul descriptors and preferences with their attributes, the heuristic, and
// cublasLtMatmul, which checks a call as the heuristic judges it and enqueues cublas_gemm.cpp's GEMM.
#include <cublasLt.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>

#include "loom/backend/cuda/sim/cublas_internal.h"
#include "loom/backend/cuda/sim/sim_runtime.h"

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
  const void* aux = nullptr;  // GELU_AUX(_BIAS): written; DGELU: read
  int64_t aux_ld = 0;
  int64_t aux_batch_stride = 0;
  int32_t aux_type = -1;  // -1: D's type
};

struct cublasLtMatmulPreferenceOpaque_t {
  uint32_t search_mode = CUBLASLT_SEARCH_BEST_FIT;
  uint64_t max_workspace_bytes = 0;
  uint32_t reduction_scheme_mask = 0x7;
  uint32_t min_alignment[4] = {256, 256, 256, 256};  // A, B, C, D
  float max_waves_count = 0;
  uint64_t impl_mask = ~uint64_t{0};
};

namespace loom::sim::cublas_detail {
namespace {

// ------------------------------------------------------------------------------------ cuBLASLt

// What an epilogue adds to the product: a bias (BIAS, GELU_AUX_BIAS), or a GELU whose input it
// writes to the auxiliary matrix (GELU_AUX(_BIAS)), or GELU' of that matrix (DGELU).
struct Epilogue {
  bool bias = false, gelu_out = false, dgelu = false;
  explicit Epilogue(uint32_t e)
      : bias(e == CUBLASLT_EPILOGUE_BIAS || e == CUBLASLT_EPILOGUE_GELU_AUX_BIAS),
        gelu_out(e == CUBLASLT_EPILOGUE_GELU_AUX || e == CUBLASLT_EPILOGUE_GELU_AUX_BIAS),
        dgelu(e == CUBLASLT_EPILOGUE_DGELU) {}
  bool aux() const { return gelu_out || dgelu; }
};

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
    case CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER:
      return field(d.aux);
    case CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD:
      return field(d.aux_ld);
    case CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_BATCH_STRIDE:
      return field(d.aux_batch_stride);
    case CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_DATA_TYPE:
      return field(d.aux_type);
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
  const Epilogue e(desc->epilogue);
  if (desc->epilogue != CUBLASLT_EPILOGUE_DEFAULT && !e.bias && !e.aux()) return CUBLAS_STATUS_NOT_SUPPORTED;
  if (e.bias && desc->bias_type != -1 && desc->bias_type != static_cast<int32_t>(ld.type)) {
    return CUBLAS_STATUS_NOT_SUPPORTED;
  }
  // The GELU epilogues' auxiliary matrix (the GELU's input): D's shape, its leading dimension a
  // multiple of 8 and at least D's rows, a batch stride a multiple of 8, the type D's (no other
  // is simulated). Simulated for fp32 arithmetic with a real D only.
  if (e.aux()) {
    const bool real = ld.type == CUDA_R_32F || ld.type == CUDA_R_16BF;
    if (!real || (desc->aux_type != -1 && desc->aux_type != static_cast<int32_t>(ld.type))) {
      return CUBLAS_STATUS_NOT_SUPPORTED;
    }
    if (desc->aux_ld % 8 != 0 || desc->aux_ld < static_cast<int64_t>(ld.rows) || desc->aux_batch_stride % 8 != 0) {
      return CUBLAS_STATUS_INVALID_VALUE;
    }
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

}  // namespace
}  // namespace loom::sim::cublas_detail

using namespace loom::sim::cublas_detail;

// ------------------------------------------------------------------------------------ cuBLASLt API

extern "C" {

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
  const Epilogue e(computeDesc->epilogue);
  if (e.bias && computeDesc->bias == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  if (e.aux() && computeDesc->aux == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  if (g.m == 0 || g.n == 0) return CUBLAS_STATUS_SUCCESS;

  g.a.ptr = A;
  g.b.ptr = B;
  g.c.ptr = C;
  g.d.ptr = D;
  if (e.bias) {
    g.bias = computeDesc->bias;
    g.bias_stride = computeDesc->bias_batch_stride;
  }
  if (e.aux()) {
    g.gelu = e.gelu_out ? Gemm::Gelu::kForward : Gemm::Gelu::kBackward;
    g.aux = Operand{"aux", computeDesc->aux, g.d.type, g.d.rows, g.d.cols, computeDesc->aux_ld,
                    computeDesc->aux_batch_stride};
  }
  if (!take_scalars(api, computeDesc->pointer_mode == CUBLASLT_POINTER_MODE_DEVICE, alpha, beta, &g)) {
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  // C is read only when beta != 0 (a beta in device memory may be anything).
  const bool reads_c = g.beta.device_ptr != nullptr || g.beta.host_value != 0;
  bool in_device_memory = check_operand_memory(api, g.a, g.batch) && check_operand_memory(api, g.b, g.batch) &&
                          (!reads_c || check_operand_memory(api, g.c, g.batch)) &&
                          check_operand_memory(api, g.d, g.batch) &&
                          (g.gelu == Gemm::Gelu::kNone || check_operand_memory(api, g.aux, g.batch)) &&
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
