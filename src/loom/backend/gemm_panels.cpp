#include "loom/backend/gemm_panels.h"

#include <algorithm>

namespace loom {
namespace {

size_t round256(size_t bytes) { return (bytes + 255) / 256 * 256; }

}  // namespace

bool row_aligned(int64_t elements, size_t bytes) { return static_cast<size_t>(elements) * bytes % 16 == 0; }

int64_t padded_row(int64_t elements, size_t bytes) {
  int64_t padded = elements;
  while (!row_aligned(padded, bytes)) ++padded;  // at most 15 steps
  return padded;
}

GemmPanels plan_gemm_panels(const GemmPanelShape& s, const GemmPanelLimits& limits) {
  GemmPanels p;
  if (s.batch != 1 || s.m <= 0 || s.n <= 0 || s.k <= 0) return p;
  // Leading dimensions: A's rows hold k (or m when trans_a), B's n (or k when trans_b), C's n.
  const int64_t a_row = s.trans_a ? s.m : s.k;
  const int64_t b_row = s.trans_b ? s.k : s.n;
  const bool a_misaligned = !row_aligned(a_row, s.in_bytes);
  const bool c_misaligned = !row_aligned(s.n, s.out_bytes);
  if (!row_aligned(b_row, s.in_bytes) || (!a_misaligned && !c_misaligned)) return p;
  // A stored (k, m) is cut into row panels along K; C only along M.
  if (a_misaligned && s.trans_a && c_misaligned) return p;
  const GemmPanels::Dim dim = (a_misaligned && s.trans_a) ? GemmPanels::K : GemmPanels::M;

  const double flops = 2.0 * static_cast<double>(s.m) * static_cast<double>(s.n) * static_cast<double>(s.k);
  const int64_t lda = padded_row(a_row, s.in_bytes), ldc = padded_row(s.n, s.out_bytes);
  // Bytes staged per unit of the cut dimension (a row of A's panel, of C's panel).
  const size_t a_unit = a_misaligned ? static_cast<size_t>(lda) * s.in_bytes : 0;
  const size_t c_unit = c_misaligned ? static_cast<size_t>(ldc) * s.out_bytes : 0;
  const int64_t extent = dim == GemmPanels::M ? s.m : s.k;
  const double staged = static_cast<double>(a_unit + c_unit) * static_cast<double>(extent);
  if (flops < limits.min_flops || flops < static_cast<double>(limits.min_flops_per_staged_byte) * staged) return p;

  const int64_t fit = static_cast<int64_t>(limits.panel_bytes / (a_unit + c_unit));
  int64_t rows = std::max<int64_t>(GemmPanels::kPanelQuantum, fit / GemmPanels::kPanelQuantum * GemmPanels::kPanelQuantum);
  rows = std::min(rows, extent);
  p.dim = dim;
  p.rows = rows;
  p.stage_a = a_misaligned;
  p.stage_c = c_misaligned;
  p.lda_padded = a_misaligned ? lda : a_row;
  p.ldc_padded = c_misaligned ? ldc : s.n;
  p.a_scratch_bytes = round256(a_unit * static_cast<size_t>(rows));
  p.c_scratch_bytes = round256(c_unit * static_cast<size_t>(rows));
  p.count = (extent + rows - 1) / rows;
  return p;
}

}  // namespace loom
