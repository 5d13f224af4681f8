// Sequential calibration of post-training compression (loom quantize, loom prune;
// docs/compression.md), block by block as AutoGPTQ and AutoAWQ do: the calibration sequences'
// hidden states are kept on the host between blocks, so each block runs once to measure its
// linear layers' inputs and once more, after the caller changed its weights, to make the next
// block's inputs. Block l's statistics therefore come from a model whose blocks before l are
// already compressed (each layer corrects the error of those before it), and only the block
// being worked on needs its weights in memory (streaming quantization, compress/quantize_model.h).
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "loom/model/transformer.h"

namespace loom {

// Per linear layer: the calibration inputs' statistics.
struct InputStats {
  int64_t rows = 0;
  std::vector<double> hessian;  // (K, K) sum x x^T (GPTQ, SparseGPT)
  std::vector<double> abs_sum, abs_max, sq_sum;  // (K): sum |x|, max |x|, sum x^2 (AWQ, SmoothQuant, Wanda)
  std::vector<float> sample;    // up to kSampleRows rows of x (AWQ's search)
  static constexpr int64_t kSampleRows = 512;
};

// t's elements on the host (any backend), as f32.
std::vector<float> read_host(Backend& backend, const Tensor& t);

// Block `layer`'s four linear weights in linear_weights() order, or (layer = n_layer) the head.
std::vector<Transformer::LinearWeight> layer_linear_weights(Transformer& model, int64_t layer);

class SequentialCalibration {
 public:
  // sequences: equal lengths <= model.max_seq_len, run in batches of 4. hessian: accumulate
  // sum x x^T (each batch's by Backend::gemm in f32, summed in double; AutoGPTQ sums in f32).
  SequentialCalibration(Transformer& model, const std::vector<std::vector<int32_t>>& sequences, bool hessian);

  // The statistics of block `layer`'s four linear inputs with its current weights, by the
  // weight's parameter name (layer must be the next block: 0, 1, ... in order). layer = n_layer:
  // the head's input, the final norm's output as the last advance() left it.
  std::map<std::string, InputStats> stats(int64_t layer);
  // Runs block `layer` (after stats(layer)) with its weights as they are now, making the next
  // block's inputs (after the last block: the head's statistics). Its weights are not read after.
  void advance(int64_t layer);

  // Bytes this holds on the host: the hidden states (two copies while a block advances).
  int64_t hidden_bytes() const;

 private:
  // Runs block `layer` on batch b's inputs (tokens for layer 0); its store's records hold the
  // layer's linear inputs after.
  ActivationStore& run(int64_t layer, int64_t b);
  void accumulate(std::map<std::string, InputStats>& stats, const std::vector<Transformer::LinearWeight>& weights,
                  const std::vector<Tensor>& inputs, int64_t rows, int64_t batches);

  Transformer& model_;
  const std::vector<std::vector<int32_t>>& sequences_;
  bool hessian_;
  int64_t seq_len_ = 0, batches_ = 0, next_ = 0;  // next_: the layer stats() expects
  std::vector<std::vector<float>> hidden_;         // [batch] (n, T, C): block next_'s inputs
  std::map<std::string, InputStats> head_;         // the head's statistics (after the last advance)
  ActivationStore store_;
  int64_t store_layer_ = -1;
};

}  // namespace loom
