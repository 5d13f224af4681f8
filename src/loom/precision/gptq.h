// GPTQ (Frantar, Ashkboos, Hoefler, Alistarh 2022, "GPTQ: Accurate Post-Training Quantization
// for Generative Pre-trained Transformers", Algorithm 1) on a host weight, into the integer
// format of precision/int_quant.h, and the second-order pruning of SparseGPT (Frantar and
// Alistarh 2023), which shares its inverse-Hessian machinery.
//
// With H = sum_x x x^T over the calibration inputs of the layer (K x K, double):
//   1. dead columns (H_ii = 0) get H_ii = 1 and a zero weight column;
//   2. act_order: columns in order of decreasing H_ii (the paper's "act-order" heuristic); the
//      groups' scales and zero points are then computed first, from the unmodified weight in
//      natural column order ("static groups", so the stored format needs no column permutation);
//   3. H += damp mean(diag H) I, U = the upper Cholesky factor of H^-1;
//   4. for each block of `block` columns (lazy batch updates), column by column: q = Q(w_i)
//      with its group's parameters (without act_order computed when the column opens its group,
//      from the current, already-updated weight, as AutoGPTQ does), err = (w_i - q) / U_ii,
//      the block's later columns w_j -= err U_ij; after the block, all later columns
//      W[:, i2:] -= Err U[i1:i2, i2:].
// Everything is in double; the result's codes, scales and zeros are the format's.
#pragma once
#include <cstdint>
#include <span>
#include <vector>

#include "loom/precision/int_quant.h"

namespace loom {

struct GptqOptions {
  double damp = 0.01;     // percdamp: the fraction of mean(diag H) added to the diagonal
  int64_t block = 128;    // lazy batch size
  bool act_order = false;
  IntStorage storage;     // how the groups' scales and zero points are stored (int_quant.h)
};

// w: (spec.rows, spec.cols) row-major; h: (cols, cols) row-major, sum of x x^T (symmetric).
IntWeight gptq_quantize(std::span<const float> w, std::span<const double> h, const IntWeightSpec& spec,
                        const GptqOptions& options = {});

// Steps 1-3, shared by every row of a layer (rows are independent in steps 4): the column order,
// the dead columns and U. A large weight is quantized in row chunks with one factor
// (gptq_quantize_rows on each), the same codes as gptq_quantize on the whole.
struct GptqFactor {
  int64_t cols = 0;
  std::vector<int64_t> perm;  // processing order -> column
  std::vector<bool> dead;     // by position in that order
  std::vector<double> u;      // (cols, cols) row-major upper, in that order
};
GptqFactor gptq_factor(std::span<const double> h, int64_t cols, const GptqOptions& options);
// Step 4 on w (spec.rows rows of the layer, row-major) with the layer's factor.
IntWeight gptq_quantize_rows(std::span<const float> w, const GptqFactor& factor, const IntWeightSpec& spec,
                             const GptqOptions& options);

// SparseGPT: zeroes a fraction `sparsity` of w's weights (per block of `block` columns the
// smallest w_ij^2 / U_jj^2 of each row, or with n_of_m = {n, m} the n smallest of every m
// consecutive columns: 2:4 is {2, 4}), updating the remaining weights with the same OBS
// correction as GPTQ. Returns the pruned weight (rows x cols).
std::vector<float> sparsegpt_prune(std::span<const float> w, std::span<const double> h, int64_t rows, int64_t cols,
                                   double sparsity, int n, int m, double damp = 0.01, int64_t block = 128);

// U: the upper Cholesky factor of (H + damp mean(diag H) I)^-1 (K x K row-major, lower part 0),
// with dead columns handled as in step 1 (returned in `dead`). An Error when H is not positive
// definite after damping.
std::vector<double> gptq_inverse_factor(std::vector<double> h, int64_t k, double damp, std::vector<bool>& dead);

}  // namespace loom
