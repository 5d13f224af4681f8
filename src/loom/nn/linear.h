// Linear layers y = x W^T + b and their backward, in fp32 or in a low-precision recipe of
// precision/policy.h. A LinearLayer holds what a recipe keeps between calls (the FP8 amax
// histories); operands are cast or quantized into a LinearWorkspace shared by all the layers
// of a model, so a step allocates nothing after the first.
//
// The quantizers are Backend ops (amax, fake_quant, quant_codes_bf16, fake_quant_blocks,
// fake_quant_mxfp4 / _nvfp4); only the FP8 scales and amax histories live on the host. The CPU
// backend computes the low-precision GEMMs either natively (bf16, through oneDNN) or as an
// exact emulation (fp16, fp8: values on the format's grid multiplied with fp32 accumulation). A
// device backend would run the same recipes with its own casts and FP8 GEMMs.
#pragma once
#include <array>
#include <cstdint>

#include "loom/backend/backend.h"
#include "loom/precision/policy.h"

namespace loom {

struct Nf4Device;  // precision/nf4.h
struct IntWeightDevice;  // precision/int_quant.h

// y (N, out) = x (N, in) @ w^T (+ b), with beta = 1 accumulating into y (the residual add).
void linear_forward(Backend& backend, const Tensor& x, const Tensor& w, const Tensor& b, const Tensor& y, float beta = 0.0f);
// dx = dy @ w (overwritten); dw += dy^T @ x; db += colsum(dy).
void linear_backward(Backend& backend, const Tensor& x, const Tensor& w, const Tensor& dy, const Tensor& dx,
                     const Tensor& dw, const Tensor& db);

// Flat scratch buffers, grown on demand (MEM_WORKSPACE) and reused by every layer.
class LinearWorkspace {
 public:
  // D: LoRA's dropped-out input; E, F, G: DoRA's merged rows, their correction and their norms;
  // H: a DoRA layer's whole merged weight (nn/lora.h lora_layer_weight); S: the fp32 staging of
  // a saved activation kept in bf16 (nn/layer.h saved_target); L: the logits' gradient in bf16,
  // from the loss to the head's backward (Transformer, ActivationStore::fused_loss_weight); Y: an
  // output gradient in bf16 from the op before to its layer's backward: the MLP's first layer's
  // from the activation (LayerPlan::mlp_in_dy_bf16), the QKV projection's from the flash attention
  // (qkv_dy_bf16), one after the other; P: the attention output's gradient in bf16, from the output
  // projection's backward to the flash backward (LayerPlan::attn_dy_bf16); R: the QKV projection's
  // fp32 output under RoPE or q/k norms, rounded into a bf16 record after (LayerPlan::qkv_bf16);
  // O: the residual stream's gradient in bf16, written by the norm backward that finalises it, read
  // by fc2's / proj's backward as its dy (LayerPlan::proj_dy_bf16 / fc2_dy_bf16, nn/layer.h residual_dy16).
  enum Slot { A, B, C, W, Q, D, E, F, G, H, S, L, Y, P, R, O, SLOT_COUNT };
  explicit LinearWorkspace(Allocator& allocator) : allocator_(allocator) {}
  // A view of `shape` into slot's f32 (or bf16) buffer, growing it when too small.
  Tensor f32(Slot slot, const Shape& shape);
  Tensor bf16(Slot slot, const Shape& shape);

 private:
  Tensor get(std::array<Tensor, SLOT_COUNT>& buffers, Slot slot, const Shape& shape, DType dtype);
  Allocator& allocator_;
  std::array<Tensor, SLOT_COUNT> f32_, bf16_;
};

// The GELU whose input gradient a layer's input gradient becomes (LayerPlan::fc2_dgelu): dx =
// gelu'(pre) o (dy w) through Backend::gemm_dgelu; scratch (f32, dx's shape) for a backend that
// computes the product first.
struct GeluBackward {
  Tensor pre;
  Tensor scratch;
};

// How one linear layer computes; default-constructed = fp32, no state.
struct LinearSetup {
  LinearRecipe recipe = RECIPE_F32;
  QatFormat qat = QAT_NONE;  // fake-quantize the weight first (straight-through gradient)
  int64_t fp8_margin = 0, fp8_history = 1024;
  bool fp8_most_recent = false;
  MiniFormat fp8_backward = FMT_E5M2;  // format of dy (E4M3 for fp8-block by default)
};
LinearSetup linear_setup(const PrecisionPolicy& policy, LinearKind kind, bool block_weight);

class LinearLayer {
 public:
  LinearLayer() = default;
  // base: QLoRA's frozen weight in NF4 (precision/nf4.h), dequantized on the fly into workspace
  // slot Q wherever the recipe reads the weight (forward and the input gradient); the w passed
  // to forward and backward then only gives its shape. nullptr: w is the weight.
  explicit LinearLayer(const LinearSetup& setup, const Nf4Device* base = nullptr);
  const Nf4Device* base() const { return base_; }
  void set_base(const Nf4Device* base);
  // A post-training-quantized weight (loom quantize, precision/int_quant.h) used instead of w:
  // forward multiplies with it through Backend::int_linear for up to kIntDirectRows input rows
  // (decoding: the codes are read once), and for more rows dequantizes it into workspace slot Q
  // for one f32 GEMM (prefill, evaluation); W8A8 always runs int_linear. backward refuses it.
  static constexpr int64_t kIntDirectRows = 16;
  void set_int_weight(const IntWeightDevice* q) { int_weight_ = q; }
  const IntWeightDevice* int_weight() const { return int_weight_; }
  // A bf16 weight (rows, cols) used where it lies instead of w (a bf16 checkpoint's,
  // Transformer::set_bf16_weights): forward and decoding multiply with it through
  // Backend::bf16_weight_linear (each element widened exactly, f32 products); backward refuses.
  void set_bf16_weight(const Tensor& w) { bf16_weight_ = w; }
  const Tensor& stored_bf16_weight() const { return bf16_weight_; }
  // Decoding's product: the quantized or bf16 weight when set, else linear_forward's fp32 GEMM.
  void forward_plain(Backend& backend, const Tensor& x, const Tensor& w, const Tensor& b, const Tensor& y, float beta,
                     LinearWorkspace* ws) const;

  // w is the fp32 master weight; w16, when defined, its bf16 copy (precision.param = bf16),
  // which the layer reads instead. ws must be set unless the recipe is f32 without QAT. x may
  // be bf16 with the bf16 recipe (a saved input, nn/plan.h LayerPlan::saved_bf16): it is then
  // multiplied as it is, where an fp32 x is first rounded to bf16.
  void forward(Backend& backend, const Tensor& x, const Tensor& w, const Tensor& w16, const Tensor& b, const Tensor& y,
               float beta, LinearWorkspace* ws);
  // dx = dy @ w; dw += dy^T @ x; db += colsum(dy). With the f32 recipe dx or dw may be left
  // undefined to compute the other half alone (the input / weight split of zero-bubble schedules).
  // dy may be bf16 with the bf16 recipe (the loss's gradient for the head, the MLP activation's
  // backward for fc: LayerPlan::mlp_in_dy_bf16); db then sums its bf16 values, as autocast does.
  // dy16, when defined (the bf16 recipe, an fp32 dy): dy rounded to bf16 already (the bits cast
  // gives: the residual stream's gradient from the norm backward, LayerPlan::proj_dy_bf16 /
  // fc2_dy_bf16), which the GEMMs read instead of rounding dy; db sums dy.
  // gelu (the bf16 recipe only): dx is the gradient of that GELU's input instead (GeluBackward).
  void backward(Backend& backend, const Tensor& x, const Tensor& w, const Tensor& w16, const Tensor& dy,
                const Tensor& dx, const Tensor& dw, const Tensor& db, LinearWorkspace* ws,
                const Tensor& dy16 = Tensor{}, const GeluBackward* gelu = nullptr);
  // The forward with a GELU after it (LayerPlan::fc_gelu): pre = x w^T + b (the activation's
  // input) and act = gelu(pre); the bf16 recipe's GEMM through Backend::gemm_gelu, any other way
  // of computing the layer (another recipe, a quantized or bf16-in-place weight) forward() then gelu_forward.
  void forward_gelu(Backend& backend, const Tensor& x, const Tensor& w, const Tensor& w16, const Tensor& b,
                    const Tensor& pre, const Tensor& act, LinearWorkspace* ws);

  // A loss pass's head with its logits kept by columns (Backend::logits_by_columns): yt (out, N)
  // = w x^T, and from dyt (out, N): dx = dyt^T w, dw += dyt x (dw may be undefined: a frozen
  // weight). Only where the layer computes plainly: the f32 recipe on w itself, or the bf16
  // recipe, without QAT, an NF4 base or a quantized / bf16-in-place weight.
  bool computes_plainly(const Tensor& w16) const;
  void forward_columns(Backend& backend, const Tensor& x, const Tensor& w, const Tensor& w16, const Tensor& yt,
                       LinearWorkspace* ws);
  void backward_columns(Backend& backend, const Tensor& x, const Tensor& w, const Tensor& w16, const Tensor& dyt,
                        const Tensor& dx, const Tensor& dw, LinearWorkspace* ws);

  // y = residual + this layer's output (a block's output projection onto the residual stream):
  // where the layer computes plainly its GEMM reads the residual as its C (GemmSpec::c_in: no
  // copy of the stream); otherwise the residual is copied into y and forward() accumulates.
  void forward_residual(Backend& backend, const Tensor& x, const Tensor& w, const Tensor& w16, const Tensor& b,
                        const Tensor& residual, const Tensor& y, LinearWorkspace* ws);

  // Delayed scaling: the amaxes recorded since the last call become history (once per step).
  void end_step();
  // Evaluation passes leave the amax history alone.
  void set_recording(bool on) { recording_ = on; }
  const LinearSetup& setup() const { return setup_; }
  // x, w, dy scaling states (fp8-delayed only; checkpointed).
  std::array<DelayedScaling, 3>& scaling() { return scaling_; }

 private:
  // The weight the recipe quantizes, in fp32: w itself, or w16 / QAT(w) / the NF4 base
  // dequantized in workspace slot Q.
  Tensor effective_weight(Backend& backend, const Tensor& w, const Tensor& w16, LinearWorkspace& ws) const;
  // That weight in bf16: w16 itself, or effective_weight() cast into workspace slot W.
  Tensor bf16_weight(Backend& backend, const Tensor& w, const Tensor& w16, LinearWorkspace& ws) const;
  // The bf16 recipe's forward product: y = op(x in bf16, bf16_weight()) per spec.
  void bf16_gemm(Backend& backend, const Tensor& x, const Tensor& w, const Tensor& w16, const Tensor& y,
                 const GemmSpec& spec, const Tensor* bias, LinearWorkspace& ws) const;
  // x is fp32, or bf16 for the bf16 recipe (a saved input, nn/plan.h LayerPlan::saved_bf16).
  void check_input(const Tensor& x) const;
  void require_plain(const Tensor& w16) const;  // computes_plainly, or a one-line error
  // x's FP8 scale for this call (records its amax under delayed scaling).
  float fp8_scale(Backend& backend, int which, MiniFormat f, const Tensor& x, bool record);

  LinearSetup setup_;
  const Nf4Device* base_ = nullptr;
  const IntWeightDevice* int_weight_ = nullptr;
  Tensor bf16_weight_;  // set_bf16_weight
  std::array<DelayedScaling, 3> scaling_;
  bool recording_ = true;
};

}  // namespace loom
