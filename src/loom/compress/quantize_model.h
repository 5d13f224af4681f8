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
// Calibration is sequential over blocks (as AutoGPTQ and AutoAWQ; compress/calibration.h):
// block l's inputs come from the model whose blocks before l are already quantized (their
// dequantized weights written into the fp32 parameters), so each layer corrects the error of
// those before it. Streaming (QuantizeStream): only the block being quantized, the embedding
// while block 0 runs and the head at the end need their f32 weights in memory, and each result
// leaves as soon as it is made.
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "loom/compress/calibration.h"
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
  IntStorage storage;    // f16 scales, symmetric groups (weight-only methods)
};

// Where quantize_model reads the weights and where each result goes (streaming quantization).
// load(names) fills those f32 parameters of the model before they are first read, release(names)
// follows their last read (empty: the model holds every weight). emit(name, weight) takes each
// quantized weight as soon as it is made (a folder writer; empty: quantize_model returns them).
struct QuantizeStream {
  std::function<void(const std::vector<std::string>&)> load, release;
  std::function<void(const std::string&, IntWeight)> emit;
};

// The parameter names of what a sequential pass loads together: [0] the embeddings, [l + 1]
// block l, [n_layer + 1] the final norm, [n_layer + 2] the untied head (empty when tied).
std::vector<std::vector<std::string>> quantize_load_units(const ModelConfig& config, const ParamLayout& layout);

// Quantizes the model's linear weights; on return the model's fp32 parameters hold the
// dequantized block weights (the head's are left as they were: a tied head is the embedding).
// `progress` gets one line per layer.
std::map<std::string, IntWeight> quantize_model(Transformer& model, const std::vector<std::vector<int32_t>>& sequences,
                                                const QuantizeOptions& options,
                                                const std::function<void(const std::string&)>& progress,
                                                const QuantizeStream& stream = {});

// w (rows, cols) with the input scale folded back: dequantize(q) diag(input_scale).
std::vector<float> effective_weight(const IntWeight& q);

}  // namespace loom
