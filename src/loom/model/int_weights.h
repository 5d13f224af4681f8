// Post-training-quantized weights in a model (loom quantize, precision/int_quant.h;
// Transformer::set_int_weights): each named linear layer multiplies with its integer weight
// (forward and decoding; backward refuses), and the fp32 elements' pages are released (not a
// tied head's: the embedding still looks tokens up).
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "loom/backend/backend.h"
#include "loom/arch/config.h"
#include "loom/arch/param_layout.h"
#include "loom/nn/block.h"
#include "loom/nn/linear.h"
#include "loom/precision/int_quant.h"

namespace loom {

// A linear layer with its weight: its ParamLayout name and its view into the model's flat
// parameters (the embedding's for a tied head). Transformer::linear_weights lists them.
struct LinearWeight {
  std::string name;
  LinearLayer* layer = nullptr;
  Tensor weight;
};

// Every block's four linear weights (attn_qkv, attn_out, mlp_in, mlp_out: views into params,
// the model's flat buffer), then the head's (head_w: its weight, the embedding for a tied head),
// each named by the layout. Dense blocks only (no MoE or MLA).
std::vector<LinearWeight> collect_linear_weights(const ModelConfig& config, const ParamLayout& layout,
                                                 const Tensor& params, std::vector<Block>& blocks, LinearLayer& head,
                                                 const Tensor& head_w);

// Owned by the Transformer: the layers point at the device copies, which must outlive them.
class IntWeights {
 public:
  // Refuses a backend without int_linear or host-readable parameters, and a second set.
  void check(const Backend& backend, const Tensor& params) const;
  // Gives each of `linears` named in `weights` its integer weight and releases its elements of
  // params (the model's flat buffer) unless it is `tied` (the embedding a tied head shares;
  // undefined: none). A name that is not among linears, or a shape that differs from the
  // weight's, is an error naming it.
  void set(Backend& backend, const Tensor& params, const std::vector<LinearWeight>& linears, const Tensor& tied,
           std::map<std::string, IntWeight> weights);
  int64_t params() const;  // elements replaced
  int64_t bytes() const;   // their stored bytes (codes, scales, zeros, input scales)

 private:
  std::vector<std::unique_ptr<IntWeightDevice>> weights_;  // stable: the layers point at them
};

}  // namespace loom
