#include "loom/compress/prune_merge.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <optional>

#include "loom/compress/quantize_model.h"
#include "loom/core/error.h"
#include "loom/core/philox.h"
#include "loom/precision/gptq.h"

namespace loom {

PruneMethod parse_prune_method(const std::string& name) {
  if (name == "magnitude") return PruneMethod::magnitude;
  if (name == "wanda") return PruneMethod::wanda;
  if (name == "sparsegpt") return PruneMethod::sparsegpt;
  throw Error(str_cat("--method '", name, "' is not a pruning method: expected magnitude, wanda or sparsegpt"));
}

MergeMethod parse_merge_method(const std::string& name) {
  if (name == "average") return MergeMethod::average;
  if (name == "task-arithmetic") return MergeMethod::task_arithmetic;
  if (name == "ties") return MergeMethod::ties;
  if (name == "dare") return MergeMethod::dare;
  throw Error(str_cat("--method '", name, "' is not a merging method: expected average, task-arithmetic, ties or dare"));
}

namespace {

// Zeroes, in each comparison group of `idx` (indices into w), the `count` lowest scores.
void zero_lowest(std::vector<float>& w, const std::vector<double>& score, std::vector<int64_t>& idx, int64_t count) {
  std::stable_sort(idx.begin(), idx.end(), [&](int64_t a, int64_t b) { return score[static_cast<size_t>(a)] < score[static_cast<size_t>(b)]; });
  for (int64_t k = 0; k < count && k < static_cast<int64_t>(idx.size()); ++k) w[static_cast<size_t>(idx[static_cast<size_t>(k)])] = 0.0f;
}

// Magnitude (whole matrix, or n:m groups) and Wanda (per output row, or n:m groups).
void prune_by_score(std::vector<float>& w, const std::vector<double>& score, int64_t rows, int64_t cols,
                    const PruneOptions& o, bool per_row) {
  if (o.m > 0) {
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < cols; c += o.m) {
        std::vector<int64_t> idx;
        for (int64_t j = c; j < std::min(c + o.m, cols); ++j) idx.push_back(r * cols + j);
        zero_lowest(w, score, idx, o.n);
      }
    }
    return;
  }
  if (!per_row) {
    std::vector<int64_t> idx(static_cast<size_t>(rows * cols));
    std::iota(idx.begin(), idx.end(), 0);
    zero_lowest(w, score, idx, static_cast<int64_t>(std::floor(o.sparsity * static_cast<double>(rows * cols))));
    return;
  }
  for (int64_t r = 0; r < rows; ++r) {
    std::vector<int64_t> idx(static_cast<size_t>(cols));
    std::iota(idx.begin(), idx.end(), r * cols);
    zero_lowest(w, score, idx, static_cast<int64_t>(std::floor(o.sparsity * static_cast<double>(cols))));
  }
}

}  // namespace

std::pair<int64_t, int64_t> prune_model(Transformer& model, const std::vector<std::vector<int32_t>>& sequences,
                                        const PruneOptions& o, const std::function<void(const std::string&)>& progress) {
  LOOM_CHECK(o.m > 0 || (o.sparsity >= 0.0 && o.sparsity < 1.0), "--sparsity must be in [0, 1), got ", o.sparsity);
  LOOM_CHECK(o.m == 0 || (o.n > 0 && o.n < o.m), "--pattern n:m needs 0 < n < m, got ", o.n, ":", o.m);
  LOOM_CHECK(o.method == PruneMethod::magnitude || !sequences.empty(), "--method ",
             o.method == PruneMethod::wanda ? "wanda" : "sparsegpt", " needs calibration text (--calib FILE)");
  Backend& backend = model.backend();
  int64_t zeroed = 0, total = 0;
  std::optional<SequentialCalibration> calibration;
  if (o.method != PruneMethod::magnitude) calibration.emplace(model, sequences, o.method == PruneMethod::sparsegpt);
  const int64_t L = model.config().n_layer;
  for (int64_t layer = 0; layer < L; ++layer) {
    std::map<std::string, InputStats> stats;
    if (calibration) stats = calibration->stats(layer);
    for (const Transformer::LinearWeight& lw : layer_linear_weights(model, layer)) {
      const int64_t rows = lw.weight.dim(0), cols = lw.weight.dim(1);
      LOOM_CHECK(o.m == 0 || cols % o.m == 0, lw.name, ": ", cols, " input columns, not a multiple of the pattern's ", o.m);
      std::vector<float> w(static_cast<size_t>(rows * cols));
      backend.read(lw.weight, w.data());
      if (o.method == PruneMethod::sparsegpt) {
        w = sparsegpt_prune(w, stats.at(lw.name).hessian, rows, cols, o.sparsity, o.n, o.m);
      } else {
        std::vector<double> score(w.size());
        const std::vector<double>* sq = o.method == PruneMethod::wanda ? &stats.at(lw.name).sq_sum : nullptr;
        for (size_t i = 0; i < w.size(); ++i) {
          score[i] = std::fabs(static_cast<double>(w[i])) * (sq != nullptr ? std::sqrt((*sq)[i % static_cast<size_t>(cols)]) : 1.0);
        }
        prune_by_score(w, score, rows, cols, o, o.method == PruneMethod::wanda);
      }
      int64_t z = 0;
      for (float v : w) z += v == 0.0f;
      backend.write(lw.weight, w.data());  // sequential: later layers calibrate on the pruned ones
      zeroed += z, total += rows * cols;
      if (progress) {
        char line[200];
        std::snprintf(line, sizeof line, "%s (%lld x %lld): %.1f%% zero", lw.name.c_str(), static_cast<long long>(rows),
                      static_cast<long long>(cols), 100.0 * static_cast<double>(z) / static_cast<double>(rows * cols));
        progress(line);
      }
    }
    if (calibration && layer + 1 < L) calibration->advance(layer);  // the next block's inputs, after this one's pruning
  }
  return {zeroed, total};
}

namespace {

// A merge whose weights or values overflow f32 (or a weight of NaN) gives inf or NaN: refused
// naming the first such tensor and element, before anything is written.
void check_merged_finite(const std::vector<float>& out, const ParamLayout& layout) {
  for (const ParamSpec& spec : layout.params) {
    if (spec.offset + spec.numel > static_cast<int64_t>(out.size())) continue;
    for (int64_t i = 0; i < spec.numel; ++i) {
      const float v = out[static_cast<size_t>(spec.offset + i)];
      LOOM_CHECK(std::isfinite(v), "merge: the merged tensor ", spec.name, " holds ", v, " at element ", i,
                 " (the weights times the models' values overflow f32?); nothing was written");
    }
  }
}

void merge_into(const std::vector<std::vector<float>>& models, const std::vector<float>& base, const ParamLayout& layout,
                const MergeOptions& o, const std::vector<double>& w, std::vector<float>& out);

}  // namespace

void merge_models(const std::vector<std::vector<float>>& models, const std::vector<float>& base, const ParamLayout& layout,
                  const MergeOptions& o, std::vector<float>& out) {
  LOOM_CHECK(!models.empty(), "merge: no models");
  std::vector<double> w = o.weights.empty() ? std::vector<double>(models.size(), 1.0) : o.weights;
  LOOM_CHECK(w.size() == models.size(), "--weights has ", w.size(), " values for ", models.size(), " models");
  for (const double x : w) LOOM_CHECK(std::isfinite(x), "--weights: ", x, " is not a finite number");
  merge_into(models, base, layout, o, w, out);
  check_merged_finite(out, layout);
}

namespace {

void merge_into(const std::vector<std::vector<float>>& models, const std::vector<float>& base, const ParamLayout& layout,
                const MergeOptions& o, const std::vector<double>& w, std::vector<float>& out) {
  const size_t P = models[0].size();
  LOOM_CHECK(o.method == MergeMethod::average || base.size() == P, "--method needs --base PATH");
  LOOM_CHECK(o.method == MergeMethod::average || o.method == MergeMethod::task_arithmetic || (o.density > 0.0 && o.density <= 1.0),
             "--density must be in (0, 1], got ", o.density);
  out.assign(P, 0.0f);
  if (o.method == MergeMethod::average) {
    const double sum = std::accumulate(w.begin(), w.end(), 0.0);
    LOOM_CHECK(sum != 0.0 && std::isfinite(sum), "--weights sum to ", sum, ": the average is undefined");
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < P; ++i) {
      double acc = 0.0;
      for (size_t k = 0; k < models.size(); ++k) acc += w[k] * static_cast<double>(models[k][i]);
      out[i] = static_cast<float>(acc / sum);
    }
    return;
  }
  // Task vectors, transformed per method.
  std::vector<std::vector<double>> tau(models.size(), std::vector<double>(P));
  for (size_t k = 0; k < models.size(); ++k) {
    for (size_t i = 0; i < P; ++i) tau[k][i] = static_cast<double>(models[k][i]) - static_cast<double>(base[i]);
    if (o.method == MergeMethod::dare) {
      std::vector<float> u(P);
      philox_fill_uniform(u.data(), static_cast<int64_t>(P), o.seed, static_cast<uint32_t>(k), 0);
      for (size_t i = 0; i < P; ++i) tau[k][i] = u[i] < o.density ? tau[k][i] / o.density : 0.0;
    } else if (o.method == MergeMethod::ties) {  // trim each tensor to its top-density magnitudes
      for (const ParamSpec& spec : layout.params) {
        const int64_t n = shape_numel(spec.shape);
        std::vector<double> mags(static_cast<size_t>(n));
        for (int64_t i = 0; i < n; ++i) mags[static_cast<size_t>(i)] = std::fabs(tau[k][static_cast<size_t>(spec.offset + i)]);
        const int64_t keep = static_cast<int64_t>(std::ceil(o.density * static_cast<double>(n)));
        if (keep >= n) continue;
        std::nth_element(mags.begin(), mags.begin() + (n - keep), mags.end());
        const double threshold = mags[static_cast<size_t>(n - keep)];
        for (int64_t i = 0; i < n; ++i) {
          double& t = tau[k][static_cast<size_t>(spec.offset + i)];
          if (std::fabs(t) < threshold) t = 0.0;
        }
      }
    }
  }
#pragma omp parallel for schedule(static)
  for (size_t i = 0; i < P; ++i) {
    double acc = 0.0;
    if (o.method == MergeMethod::ties) {  // elected sign, mean of the agreeing
      double sum = 0.0;
      for (size_t k = 0; k < models.size(); ++k) sum += w[k] * tau[k][i];
      int count = 0;
      for (size_t k = 0; k < models.size(); ++k) {
        const double t = w[k] * tau[k][i];
        if (t != 0.0 && (t > 0.0) == (sum > 0.0)) acc += t, ++count;
      }
      acc = count > 0 ? acc / count : 0.0;
    } else {
      for (size_t k = 0; k < models.size(); ++k) acc += w[k] * tau[k][i];
    }
    out[i] = static_cast<float>(static_cast<double>(base[i]) + acc);
  }
}

}  // namespace

}  // namespace loom
