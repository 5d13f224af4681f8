// Pruning and model merging over a model's flat parameters (loom prune, loom merge;
// docs/compression.md).
//
// Pruning zeroes a fraction of every block's linear weights (the embeddings, norms, biases and
// head stay dense), by
//   magnitude  the smallest |W_ij| of the whole matrix (Han et al. 2015; the layer-wise baseline
//              of Sun et al. 2024);
//   wanda      the smallest |W_ij| ||X_j||_2 within each output row (Sun, Liu, Bair, Kolter 2024,
//              "A Simple and Effective Pruning Approach for Large Language Models", eq. 1), ||X_j||
//              over the calibration inputs of the layer;
//   sparsegpt  SparseGPT's OBS reconstruction (precision/gptq.h sparsegpt_prune).
// With an n:m pattern (2:4) the comparison groups are m consecutive input columns of a row, of
// which n are zeroed. Calibration is sequential over blocks, as for quantization.
//
// Merging combines checkpoints of one architecture (every model's config must be equal):
//   average          theta = sum_i w_i theta_i / sum_i w_i (model soups, Wortsman et al. 2022);
//   task-arithmetic  theta = theta_base + sum_i w_i (theta_i - theta_base) (Ilharco et al. 2023);
//   ties             TIES-merging (Yadav et al. 2023): each task vector tau_i = theta_i - base
//                    trimmed to its top `density` fraction by magnitude (per tensor), the sign
//                    per element elected as sign(sum_i w_i tau_i), and the mean of the w_i tau_i
//                    that agree with it added to the base;
//   dare             DARE (Yu et al. 2024): each task vector's elements dropped with probability
//                    1 - density (Philox, seeded) and the rest scaled by 1 / density, then task
//                    arithmetic.
// Sums are in double, so the average of identical models is the model bit for bit and task
// arithmetic with weight 0 is the base.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "loom/arch/param_layout.h"
#include "loom/model/transformer.h"

namespace loom {

enum class PruneMethod : uint8_t { magnitude, wanda, sparsegpt };
PruneMethod parse_prune_method(const std::string& name);  // an Error naming --method

struct PruneOptions {
  PruneMethod method = PruneMethod::magnitude;
  double sparsity = 0.5;  // unstructured: the fraction zeroed
  int n = 0, m = 0;       // n:m pattern (n zeroed of every m), 0: unstructured
};

// Prunes the model's block linear weights in place; returns the zeroed count and the total.
std::pair<int64_t, int64_t> prune_model(Transformer& model, const std::vector<std::vector<int32_t>>& sequences,
                                        const PruneOptions& options,
                                        const std::function<void(const std::string&)>& progress);

enum class MergeMethod : uint8_t { average, task_arithmetic, ties, dare };
MergeMethod parse_merge_method(const std::string& name);

struct MergeOptions {
  MergeMethod method = MergeMethod::average;
  std::vector<double> weights;  // one per model (default 1 each)
  double density = 0.5;         // ties, dare
  uint64_t seed = 0;            // dare
};

// Merges `models` (flat parameter vectors of one layout) onto `base` (task-arithmetic, ties,
// dare; empty for average) into `out`. `layout` gives ties its tensors. A weight that is not
// finite, or a merged value that is not (an overflow of f32), is an Error naming the tensor.
void merge_models(const std::vector<std::vector<float>>& models, const std::vector<float>& base, const ParamLayout& layout,
                  const MergeOptions& options, std::vector<float>& out);

}  // namespace loom
