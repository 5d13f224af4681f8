// GEMMs whose rows are not a multiple of 16 bytes, in panels staged through padded rows.
//
// Tensor-core GEMM kernels (cuBLASLt's, and hipBLASLt's alike) want every matrix's leading
// dimension to be a multiple of 16 bytes ("Tensor Core Usage" in cuBLAS's documentation). A row of
// GPT-2's logits is 50,257 elements, so the head's three GEMMs (logits = x W^T, dx = dlogits W,
// dW = dlogits^T x) have an operand with odd rows and run on the library's align-1 kernels:
// measured on an H100 (docs/cuda.md), 30.6 ms of a 98.8 ms GPT-2 124M step at 124 TFLOP/s, where
// the same GEMMs with aligned rows run near 650. Padding the vocabulary changes the model; instead a
// large such GEMM runs in panels: each panel's misaligned rows are copied into a buffer whose rows
// are padded to 16 bytes (and C's copied back), so every panel's GEMM has aligned operands.
// Copying costs two passes over the staged bytes (about 4 ms a GPT-2 step on an H100 against
// about 24 saved); it pays when the GEMM does many FLOPs per staged byte, hence the thresholds.
// A training step's loss pass avoids them altogether where the positions' rows are aligned: it
// keeps the logits by columns (Backend::logits_by_columns); the panels serve the other odd-row
// GEMMs (evaluation's head, a step of odd positions).
//
// This header only plans (plain arithmetic, unit-tested on any machine); the CUDA backend runs
// the plan. Row-major throughout, as Backend::gemm: A is (m, k), or (k, m) stored when trans_a;
// B is (k, n), or (n, k) when trans_b; C is (m, n).
#pragma once
#include <cstddef>
#include <cstdint>

namespace loom {

struct GemmPanelLimits {
  size_t panel_bytes = size_t{128} << 20;  // staged bytes per panel (the scratch the GEMM may hold)
  double min_flops = 1 << 30;              // 2 m n k below this: the align-1 kernels, no staging
  size_t min_flops_per_staged_byte = 32;   // the copy must be cheap beside the GEMM
};

struct GemmPanelShape {
  int64_t m = 0, n = 0, k = 0;
  bool trans_a = false, trans_b = false;
  int64_t batch = 1;
  size_t in_bytes = 4;   // A's and B's element size
  size_t out_bytes = 4;  // C's
};

struct GemmPanels {
  // The dimension the panels split: M (rows of C and of op(A)) or K (the reduction: panels
  // accumulate into C, the first with the caller's beta, the rest with beta 1). NONE: run as is.
  enum Dim { NONE, M, K } dim = NONE;
  int64_t rows = 0;        // panel extent along dim: a multiple of kPanelQuantum, or the whole dim
  bool stage_a = false;    // A's panel is copied into padded rows (ld lda_padded)
  bool stage_c = false;    // C's panel is computed in padded rows (ld ldc_padded) and copied back
  int64_t lda_padded = 0;  // elements
  int64_t ldc_padded = 0;
  size_t a_scratch_bytes = 0;  // per panel, 256-byte multiples; C's follows A's in the scratch
  size_t c_scratch_bytes = 0;
  int64_t count = 0;  // panels

  static constexpr int64_t kPanelQuantum = 64;  // panel offsets keep unstaged views 16-byte aligned
};

// Whether a row of `elements` of `bytes` each is a multiple of 16 bytes.
bool row_aligned(int64_t elements, size_t bytes);
// The smallest count >= elements whose row is a multiple of 16 bytes.
int64_t padded_row(int64_t elements, size_t bytes);

// The panels for a GEMM, or dim NONE when it should run as it is: rows already aligned, a batch,
// B misaligned (not staged: no head GEMM has it), A misaligned along K while C is misaligned (the
// panels would cut different dimensions), or too few FLOPs for the copies to pay.
GemmPanels plan_gemm_panels(const GemmPanelShape& shape, const GemmPanelLimits& limits);

}  // namespace loom
