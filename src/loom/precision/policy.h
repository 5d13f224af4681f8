// The precision policy: which number format each kind of linear layer computes in, the dtype
// of the weight copy they read, of the gradient reduction and of the master weights.
//
// Only the GEMMs of linear layers run in low precision: they are on the autocast fp16/bf16 list
// of PyTorch's CUDA AMP (linear, addmm, matmul). Everything on its fp32 list stays fp32 here:
// softmax, layer_norm / RMSNorm, cross_entropy / log_softmax, sum and norm reductions, exp,
// rsqrt; so do embeddings, residual adds and the optimizer. Attention's two batched matmuls
// stay fp32 on the CPU backend (see docs/precision.md).
//
// Linear recipes (each linear layer: y = x W^T + b, dx = dy W, dW = dy^T x):
//   f32            fp32 operands.
//   bf16           operands rounded to bf16, fp32 accumulation and output (autocast bf16).
//   fp16           operands rounded to fp16 (overflow -> inf), fp32 accumulation, and the
//                  products y, dx, dW rounded to fp16 as autocast fp16 returns them: with loss
//                  scaling this is the FP16 AMP recipe, emulated on CPUs without fp16 GEMMs.
//   fp8-delayed    TransformerEngine DelayedScaling: per-tensor scales S = 448 / amax / 2^margin
//                  (E5M2 backward: 57344 / ...) from the amax history of previous steps.
//   fp8-current    Float8CurrentScaling: the same with amax of the tensor being cast.
//   fp8-block      DeepSeek-V3 / Float8BlockScaling: 1x128 tiles for activations and gradients,
//                  128x128 blocks for weights, E4M3 in both passes, fp32 scales.
// FP8 GEMMs multiply the quantized values exactly (fp32 accumulation), then scale.
// qat = mxfp4 | nvfp4 additionally rounds the block linears' weights to MXFP4 / NVFP4 in the
// forward and backward (quantization-aware training, straight-through gradient to the master).
#pragma once
#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "loom/precision/formats.h"

namespace loom {

enum LinearRecipe : uint8_t {
  RECIPE_F32,
  RECIPE_BF16,
  RECIPE_FP16,
  RECIPE_FP8_DELAYED,
  RECIPE_FP8_CURRENT,
  RECIPE_FP8_BLOCK,
  RECIPE_COUNT
};
const char* recipe_name(LinearRecipe r);
// "f32" -> RECIPE_F32 ...; throws naming `key` and the accepted names.
LinearRecipe parse_recipe(const std::string& name, const std::string& key);
inline bool is_fp8(LinearRecipe r) { return r >= RECIPE_FP8_DELAYED; }

// The kinds of linear layer a policy can set separately.
enum LinearKind : uint8_t { LINEAR_ATTN_QKV, LINEAR_ATTN_OUT, LINEAR_MLP_IN, LINEAR_MLP_OUT, LINEAR_HEAD, LINEAR_KIND_COUNT };
const char* linear_kind_name(LinearKind k);  // "attn_qkv", ... (the precision.* key)

enum QatFormat : uint8_t { QAT_NONE, QAT_MXFP4, QAT_NVFP4 };

// FP8 options shared by the fp8 recipes (TransformerEngine's DelayedScaling defaults).
struct Fp8Options {
  int64_t margin = 0;             // scale so the max lands 2^margin below the format max
  int64_t amax_history = 1024;    // steps of amax history (delayed scaling)
  std::string amax_compute = "max";  // max (over the history) | most_recent
  std::string backward = "";      // e5m2 | e4m3; "" = the recipe's (HYBRID: e5m2; block: e4m3)
};

// As configured (strings, "" = default) ...
struct PrecisionConfig {
  std::string compute = "f32";  // recipe of every linear layer not set below
  std::string attn_qkv, attn_out, mlp_in, mlp_out, head;  // "" = compute (head: bf16 when compute is fp8)
  std::string param = "";    // f32 | bf16: the weight copy linears read; "" = bf16 for bf16 compute
  std::string reduce = "f32";  // f32 | bf16: dtype gradients are reduced in (summed across micro-batches and ranks)
  std::string master = "f32";  // f32 | bf16: bf16 = no fp32 master, weights rounded to bf16 after each update
  bool stochastic_rounding = false;  // master = bf16: round stochastically instead of to nearest
  std::string qat = "none";    // none | mxfp4 | nvfp4
  // bf16 | f32: the dtype of the saved activations a bf16 linear layer reads (its input, which
  // the bf16 recipe rounds to bf16 in the forward and again for the weight gradient, so the bf16
  // copy loses nothing there; nn/plan.h LayerPlan::saved_bf16 says which), and the MLP's first
  // layer's output gradient (LayerPlan::mlp_in_dy_bf16); f32 keeps them fp32.
  std::string activations = "bf16";
  // f32 | bf16: the dtype attention's GEMMs (QK^T, PV and their four backward products) multiply
  // in; bf16 rounds their operands (fp32 accumulation; softmax and the saved probabilities stay
  // fp32), as autocast's attention does. The plain and the flash attention without a window have
  // bf16 kernels (nn/plan.h LayerPlan::attention_bf16; flash's run on the CUDA backend's tensor
  // cores); windowed and context-parallel attention stay fp32.
  std::string attention = "f32";
  // bf16 | f32: the dtype of the GEMM outputs autocast returns in bf16 that Loom keeps so: a
  // training loss's logits under a bf16 head (the fused loss reads them widened and writes d(logits)
  // over them: Transformer::head_and_loss) and the MLP's first layer's output under a bf16 mlp_in
  // (the activation reads it widened: nn/plan.h LayerPlan::fc_bf16); written rounded to nearest
  // even. f32 keeps them fp32.
  std::string outputs = "bf16";
  Fp8Options fp8;

  void validate() const;  // throws naming the precision.* key
};

// ... and resolved.
struct PrecisionPolicy {
  std::array<LinearRecipe, LINEAR_KIND_COUNT> recipe{};
  bool param_bf16 = false;
  bool reduce_bf16 = false;
  bool master_bf16 = false;
  bool stochastic_rounding = false;
  bool activations_bf16 = true;  // precision.activations = bf16 (only bf16 linears' inputs are affected)
  bool attention_bf16 = false;   // precision.attention = bf16
  bool outputs_bf16 = true;      // precision.outputs = bf16 (the logits of a bf16 head's fused loss, a bf16 fc's output)
  QatFormat qat = QAT_NONE;
  int64_t fp8_margin = 0, fp8_history = 1024;
  bool fp8_most_recent = false;
  MiniFormat fp8_backward_delayed = FMT_E5M2, fp8_backward_block = FMT_E4M3;

  bool any(LinearRecipe r) const;
  bool any_fp8() const;
  std::string describe() const;  // one line: "attn_qkv=bf16 ... param=bf16 reduce=f32 master=f32"
};
PrecisionPolicy resolve_policy(const PrecisionConfig& config);

// TransformerEngine delayed scaling for one tensor: an amax history of `length` steps, slot 0
// the current step. record() folds each cast's amax into slot 0; advance() (once per optimizer
// step) recomputes scale = fmax / amax / 2^margin from the history (amax = max over the history,
// or slot 0 with most_recent), then rolls the history by -1 and zeroes the new slot 0. The
// scale starts at 1 and stays when the amax is 0 or not finite.
class DelayedScaling {
 public:
  DelayedScaling(int64_t length = 1024, int64_t margin = 0, bool most_recent = false);
  float scale(MiniFormat f) const;  // for format f (fmax 448 or 57344): the scale of this step
  void record(float amax);
  void advance();
  const std::vector<float>& history() const { return history_; }
  void restore(std::vector<float> history, float amax_used);
  float amax_used() const { return amax_; }  // the amax the current scales come from (0 = none yet)

 private:
  std::vector<float> history_;
  int64_t margin_;
  bool most_recent_;
  float amax_ = 0.0f;
};

}  // namespace loom
