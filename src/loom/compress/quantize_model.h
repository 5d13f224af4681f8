// Post-training quantization of a whole model (loom quantize, docs/compression.md): each block's
// four linear weights and the head into the integer format of precision/int_quant.h, by
//   rtn          round-to-nearest per group (no calibration);
//   gptq         GPTQ (precision/gptq.h) from each layer's calibration Hessian;
//   awq          AWQ (Lin et al. 2024, "AWQ: Activation-aware Weight Quantization", sec. 3.2):
//                per input channel s = mean|x|^a / sqrt(max s min s), a searched over a grid of
//                20 values in [0, 1) for the smallest output error ||X W^T - (X / s) Q(W s)^T||^2
//                on calibration rows; the weight is stored as Q(W diag(s)) with input scale 1 / s;
//   smoothquant  SmoothQuant W8A8 (Xiao et al. 2023, eq. 4): s_j = max|X_j|^alpha /
//                max|W_:,j|^(1 - alpha), W diag(s) in per-channel symmetric int8, the input
//                scaled by 1 / s and quantized per token at run time;
//   w8a8         the same without smoothing (s = 1): the naive W8A8 baseline.
// Calibration is sequential over blocks (as AutoGPTQ and AutoAWQ): block l's inputs come from
// the model whose blocks before l are already quantized (their dequantized weights written into
// the fp32 parameters), so each layer corrects the error of those before it.
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "loom/model/transformer.h"
#include "loom/precision/gptq.h"
#include "loom/precision/int_quant.h"

namespace loom {

enum class QuantMethod : uint8_t { rtn, gptq, awq, smoothquant, w8a8 };
QuantMethod parse_quant_method(const std::string& name);  // an Error naming --method
const char* quant_method_name(QuantMethod m);
bool quant_method_calibrates(QuantMethod m);

struct QuantizeOptions {
  QuantMethod method = QuantMethod::rtn;
  int bits = 4;
  int64_t group = 128;  // 0: one group per row
  GptqOptions gptq;
  double alpha = 0.5;    // SmoothQuant's migration strength
  int awq_grid = 20;
  bool head = true;      // quantize the output layer too
  int64_t calib_seq_len = 256;
};

// Per linear layer: the calibration inputs' statistics.
struct InputStats {
  int64_t rows = 0;
  std::vector<double> hessian;  // (K, K) sum x x^T (GPTQ, SparseGPT)
  std::vector<double> abs_sum, abs_max, sq_sum;  // (K): sum |x|, max |x|, sum x^2 (AWQ, SmoothQuant, Wanda)
  std::vector<float> sample;    // up to kSampleRows rows of x (AWQ's search)
  static constexpr int64_t kSampleRows = 512;
};

// Block `layer`'s four linear weights in linear_weights() order, or (layer = n_layer) the head.
std::vector<Transformer::LinearWeight> layer_linear_weights(Transformer& model, int64_t layer);

// The statistics of block `layer`'s four linear inputs (or, with layer = n_layer, the head's)
// over the calibration sequences (each calib_seq_len tokens), by the weight's parameter name.
// `hessian`: accumulate sum x x^T (each batch's by Backend::gemm in f32, summed in double).
std::map<std::string, InputStats> calibration_stats(Transformer& model, const std::vector<std::vector<int32_t>>& sequences,
                                                    int64_t layer, bool hessian);

// Quantizes the model's linear weights; on return the model's fp32 parameters hold the
// dequantized block weights (the head's are left as they were: a tied head is the embedding).
// `progress` gets one line per layer.
std::map<std::string, IntWeight> quantize_model(Transformer& model, const std::vector<std::vector<int32_t>>& sequences,
                                                const QuantizeOptions& options,
                                                const std::function<void(const std::string&)>& progress);

// w (rows, cols) with the input scale folded back: dequantize(q) diag(input_scale).
std::vector<float> effective_weight(const IntWeight& q);

}  // namespace loom
