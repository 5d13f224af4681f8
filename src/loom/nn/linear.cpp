#include "loom/nn/linear.h"

#include <cmath>

#include "loom/core/error.h"
#include "loom/precision/int_quant.h"
#include "loom/precision/nf4.h"
#include "loom/precision/quantize.h"

namespace loom {

void linear_forward(Backend& backend, const Tensor& x, const Tensor& w, const Tensor& b, const Tensor& y, float beta) {
  GemmSpec spec;
  spec.trans_b = true;
  spec.beta = beta;
  backend.gemm(x, w, y, spec, b.defined() ? &b : nullptr);
}

void linear_backward(Backend& backend, const Tensor& x, const Tensor& w, const Tensor& dy, const Tensor& dx,
                     const Tensor& dw, const Tensor& db) {
  backend.gemm(dy, w, dx, GemmSpec{});  // (N, out) @ (out, in)
  GemmSpec accumulate;
  accumulate.trans_a = true;
  accumulate.beta = 1.0f;
  backend.gemm(dy, x, dw, accumulate);  // (out, N) @ (N, in)
  if (db.defined()) backend.bias_backward(dy, db);
}

Tensor LinearWorkspace::get(std::array<Tensor, SLOT_COUNT>& buffers, Slot slot, const Shape& shape, DType dtype) {
  int64_t numel = 1;
  for (int64_t d : shape) numel *= d;
  Tensor& buf = buffers[static_cast<size_t>(slot)];
  if (!buf.defined() || buf.numel() < numel) buf = Tensor::empty(allocator_, {numel}, dtype, MEM_WORKSPACE);
  return buf.view(0, shape);
}

Tensor LinearWorkspace::f32(Slot slot, const Shape& shape) { return get(f32_, slot, shape, DTYPE_F32); }
Tensor LinearWorkspace::bf16(Slot slot, const Shape& shape) { return get(bf16_, slot, shape, DTYPE_BF16); }

LinearSetup linear_setup(const PrecisionPolicy& policy, LinearKind kind, bool block_weight) {
  LinearSetup s;
  s.recipe = policy.recipe[kind];
  s.qat = block_weight ? policy.qat : QAT_NONE;
  s.fp8_margin = policy.fp8_margin;
  s.fp8_history = policy.fp8_history;
  s.fp8_most_recent = policy.fp8_most_recent;
  s.fp8_backward = s.recipe == RECIPE_FP8_BLOCK ? policy.fp8_backward_block : policy.fp8_backward_delayed;
  return s;
}

LinearLayer::LinearLayer(const LinearSetup& setup, const Nf4Device* base) : setup_(setup), base_(base) {
  LOOM_CHECK(base == nullptr || setup.qat == QAT_NONE, "an NF4 base weight (peft.quantize_base) with precision.qat");
  if (setup_.recipe == RECIPE_FP8_DELAYED) {
    for (DelayedScaling& s : scaling_) s = DelayedScaling(setup_.fp8_history, setup_.fp8_margin, setup_.fp8_most_recent);
  }
}

void LinearLayer::set_base(const Nf4Device* base) {
  LOOM_CHECK(base == nullptr || setup_.qat == QAT_NONE, "an NF4 base weight (peft.quantize_base) with precision.qat");
  base_ = base;
}

void LinearLayer::end_step() {
  if (setup_.recipe != RECIPE_FP8_DELAYED) return;
  for (DelayedScaling& s : scaling_) s.advance();
}

namespace {

constexpr int kX = 0, kW = 1, kDy = 2;  // scaling_[] slots
constexpr int64_t kTile = 128;          // DeepSeek-V3 tile / block edge

GemmSpec spec_of(bool trans_a, bool trans_b, float beta, float alpha = 1.0f) {
  GemmSpec s;
  s.trans_a = trans_a, s.trans_b = trans_b, s.beta = beta, s.alpha = alpha;
  return s;
}

// Rounds t in place to fp16 (overflow -> inf): what an fp16 GEMM returns.
void round_fp16(Backend& backend, const Tensor& t) { backend.fake_quant(t, t, number_grid(FMT_FP16, false), 1.0f, 1.0f); }

Tensor fp16_of(Backend& backend, const Tensor& x, LinearWorkspace& ws, LinearWorkspace::Slot slot) {
  Tensor q = ws.f32(slot, x.shape());
  backend.fake_quant(x, q, number_grid(FMT_FP16, false), 1.0f, 1.0f);
  return q;
}

Tensor codes_of(Backend& backend, const Tensor& x, MiniFormat f, float scale, LinearWorkspace& ws,
                LinearWorkspace::Slot slot) {
  Tensor q = ws.bf16(slot, x.shape());
  backend.quant_codes_bf16(x, q, number_grid(f, true), scale);
  return q;
}

// The bf16 recipe's operand: x itself when it is already bf16 (a saved input, nn/plan.h
// LayerPlan::saved_bf16, or the loss's gradient), else x rounded into the workspace's slot.
Tensor bf16_input(Backend& backend, const Tensor& x, LinearWorkspace& ws, LinearWorkspace::Slot slot) {
  if (x.dtype() == DTYPE_BF16) return x;
  const Tensor xb = ws.bf16(slot, x.shape());
  backend.cast(x, xb);
  return xb;
}

Tensor blocks_of(Backend& backend, const Tensor& x, MiniFormat f, int64_t block_rows, int64_t block_cols,
                 LinearWorkspace& ws, LinearWorkspace::Slot slot) {
  Tensor q = ws.f32(slot, x.shape());
  backend.fake_quant_blocks(x, q, number_grid(f, true), block_rows, block_cols);  // x as (rows, last dim)
  return q;
}

}  // namespace

void LinearLayer::check_input(const Tensor& x) const {
  LOOM_CHECK(x.dtype() == DTYPE_F32 || (x.dtype() == DTYPE_BF16 && setup_.recipe == RECIPE_BF16), "linear layer (",
             recipe_name(setup_.recipe), "): an input in ", dtype_name(x.dtype()), " (only the bf16 recipe reads bf16 inputs)");
}

Tensor LinearLayer::effective_weight(Backend& backend, const Tensor& w, const Tensor& w16, LinearWorkspace& ws) const {
  if (base_ != nullptr) {  // QLoRA: the NF4 weight, dequantized for this call only
    Tensor q = ws.f32(LinearWorkspace::Q, w.shape());
    backend.nf4_dequantize(base_->codes, base_->absmax_codes, base_->absmax_steps, base_->spec, 0, q);
    return q;
  }
  if (!w16.defined() && setup_.qat == QAT_NONE) return w;
  Tensor q = ws.f32(LinearWorkspace::Q, w.shape());
  const Tensor& src = w16.defined() ? q : w;
  if (w16.defined()) backend.cast(w16, q);
  if (setup_.qat == QAT_MXFP4) backend.fake_quant_mxfp4(src, q);
  if (setup_.qat == QAT_NVFP4) backend.fake_quant_nvfp4(src, q);
  return q;
}

Tensor LinearLayer::bf16_weight(Backend& backend, const Tensor& w, const Tensor& w16, LinearWorkspace& ws) const {
  if (w16.defined() && setup_.qat == QAT_NONE && base_ == nullptr) return w16;  // the kept bf16 copy, as is
  Tensor wb = ws.bf16(LinearWorkspace::W, w.shape());
  backend.cast(effective_weight(backend, w, w16, ws), wb);
  return wb;
}

float LinearLayer::fp8_scale(Backend& backend, int which, MiniFormat f, const Tensor& x, bool record) {
  if (setup_.recipe == RECIPE_FP8_CURRENT) {
    const float amax = backend.amax(x);
    return std::isfinite(amax) && amax > 0.0f ? static_cast<float>(format_info(f).max) / amax : 1.0f;
  }
  DelayedScaling& s = scaling_[static_cast<size_t>(which)];
  if (record && recording_) s.record(backend.amax(x));
  return s.scale(f);  // from previous steps: this step's amax only joins the history
}

void LinearLayer::forward_plain(Backend& backend, const Tensor& x, const Tensor& w, const Tensor& b, const Tensor& y,
                                float beta, LinearWorkspace* ws) const {
  // An integer weight wins over a bf16 one: a quantized tied head whose embedding is looked up in bf16.
  if (int_weight_ == nullptr && bf16_weight_.defined()) {
    backend.bf16_weight_linear(x, bf16_weight_, y, beta, b.defined() ? &b : nullptr);
    return;
  }
  if (int_weight_ == nullptr) {
    linear_forward(backend, x, w, b, y, beta);
    return;
  }
  const IntWeightDevice& q = *int_weight_;
  const Tensor* bias = b.defined() ? &b : nullptr;
  const Tensor* scale = q.input_scale.defined() ? &q.input_scale : nullptr;
  if (q.spec.act_int8 || x.numel() / q.spec.cols <= kIntDirectRows || ws == nullptr) {
    backend.int_linear(x, q.codes, q.scales, q.zeros, q.spec, scale, y, beta, bias);
    return;
  }
  const Tensor wq = ws->f32(LinearWorkspace::Q, {q.spec.rows, q.spec.cols});
  backend.int_dequantize(q.codes, q.scales, q.zeros, q.spec, scale, wq);
  backend.gemm(x, wq, y, spec_of(false, true, beta), bias);
}

void LinearLayer::forward(Backend& backend, const Tensor& x, const Tensor& w, const Tensor& w16, const Tensor& b,
                          const Tensor& y, float beta, LinearWorkspace* ws) {
  // A bf16 y (an autocast-style output, LayerPlan::fc_bf16): the bf16 recipe's GEMM writes it
  // rounded; any other way of computing this layer writes fp32 into the staging slot, rounded after.
  const bool plain_bf16 = setup_.recipe == RECIPE_BF16 && int_weight_ == nullptr && !bf16_weight_.defined();
  if (y.dtype() == DTYPE_BF16 && !plain_bf16) {
    LOOM_CHECK(ws != nullptr && beta == 0.0f, "linear layer (", recipe_name(setup_.recipe), "): a bf16 output "
               "needs a workspace and is written, not accumulated");
    const Tensor t = ws->f32(LinearWorkspace::S, y.shape());
    forward(backend, x, w, w16, b, t, 0.0f, ws);
    backend.cast(t, y);
    return;
  }
  if (int_weight_ != nullptr || bf16_weight_.defined()) {
    forward_plain(backend, x, w, b, y, beta, ws);
    return;
  }
  const Tensor* bias = b.defined() ? &b : nullptr;
  const GemmSpec spec = spec_of(false, true, beta);
  check_input(x);
  if (setup_.recipe == RECIPE_F32 && setup_.qat == QAT_NONE && !w16.defined() && base_ == nullptr) {
    backend.gemm(x, w, y, spec, bias);
    return;
  }
  LOOM_CHECK(ws != nullptr, "linear layer (", recipe_name(setup_.recipe), "): no workspace");
  using S = LinearWorkspace;
  switch (setup_.recipe) {
    case RECIPE_F32: backend.gemm(x, effective_weight(backend, w, w16, *ws), y, spec, bias); return;
    case RECIPE_BF16: bf16_gemm(backend, x, w, w16, y, spec, bias, *ws); return;
    case RECIPE_FP16: {
      const Tensor wq = fp16_of(backend, effective_weight(backend, w, w16, *ws), *ws, S::W);
      const Tensor xq = fp16_of(backend, x, *ws, S::A);
      const Tensor t = ws->f32(S::C, y.shape());
      backend.gemm(xq, wq, t, spec_of(false, true, 0.0f), bias);
      round_fp16(backend, t);  // autocast fp16 returns the product in fp16; the residual add is fp32
      if (beta == 0.0f) backend.copy(t, y);
      else backend.add_inplace(y, t);
      return;
    }
    case RECIPE_FP8_DELAYED:
    case RECIPE_FP8_CURRENT: {
      const Tensor we = effective_weight(backend, w, w16, *ws);
      const float sx = fp8_scale(backend, kX, FMT_E4M3, x, true), sw = fp8_scale(backend, kW, FMT_E4M3, we, true);
      const Tensor xc = codes_of(backend, x, FMT_E4M3, sx, *ws, S::A), wc = codes_of(backend, we, FMT_E4M3, sw, *ws, S::W);
      backend.gemm(xc, wc, y, spec_of(false, true, beta, (1.0f / sx) * (1.0f / sw)), bias);
      return;
    }
    case RECIPE_FP8_BLOCK: {
      const Tensor wq = blocks_of(backend, effective_weight(backend, w, w16, *ws), FMT_E4M3, kTile, kTile, *ws, S::W);
      const Tensor xq = blocks_of(backend, x, FMT_E4M3, 1, kTile, *ws, S::A);
      backend.gemm(xq, wq, y, spec, bias);
      return;
    }
    case RECIPE_COUNT: break;
  }
  LOOM_CHECK(false, "linear layer: unknown recipe ", static_cast<int>(setup_.recipe));
}

bool LinearLayer::computes_plainly(const Tensor& w16) const {
  return int_weight_ == nullptr && !bf16_weight_.defined() && base_ == nullptr && setup_.qat == QAT_NONE &&
         (setup_.recipe == RECIPE_BF16 || (setup_.recipe == RECIPE_F32 && !w16.defined()));
}

void LinearLayer::require_plain(const Tensor& w16) const {
  LOOM_CHECK(computes_plainly(w16), "linear layer (", recipe_name(setup_.recipe), "): outputs by columns need the f32 "
             "or bf16 recipe without QAT, an NF4 base or a quantized weight");
}

void LinearLayer::forward_residual(Backend& backend, const Tensor& x, const Tensor& w, const Tensor& w16,
                                   const Tensor& b, const Tensor& residual, const Tensor& y, LinearWorkspace* ws) {
  if (!computes_plainly(w16) || (setup_.recipe == RECIPE_BF16 && ws == nullptr)) {
    backend.copy(residual, y);
    forward(backend, x, w, w16, b, y, 1.0f, ws);
    return;
  }
  check_input(x);
  GemmSpec spec = spec_of(false, true, 1.0f);
  spec.c_in = &residual;
  const Tensor* bias = b.defined() ? &b : nullptr;
  if (setup_.recipe == RECIPE_F32) backend.gemm(x, w, y, spec, bias);
  else bf16_gemm(backend, x, w, w16, y, spec, bias, *ws);
}

void LinearLayer::forward_gelu(Backend& backend, const Tensor& x, const Tensor& w, const Tensor& w16, const Tensor& b,
                               const Tensor& pre, const Tensor& act, LinearWorkspace* ws) {
  if (setup_.recipe != RECIPE_BF16 || int_weight_ != nullptr || bf16_weight_.defined() || ws == nullptr) {
    forward(backend, x, w, w16, b, pre, 0.0f, ws);  // (a quantized or bf16-in-place weight: its own product)
    backend.gelu_forward(pre, act);
    return;
  }
  check_input(x);
  const Tensor wb = bf16_weight(backend, w, w16, *ws);
  const Tensor xb = bf16_input(backend, x, *ws, LinearWorkspace::A);
  backend.gemm_gelu(xb, wb, pre, act, spec_of(false, true, 0.0f), b.defined() ? &b : nullptr);
}

void LinearLayer::bf16_gemm(Backend& backend, const Tensor& x, const Tensor& w, const Tensor& w16, const Tensor& y,
                            const GemmSpec& spec, const Tensor* bias, LinearWorkspace& ws) const {
  const Tensor wb = bf16_weight(backend, w, w16, ws);
  const Tensor xb = bf16_input(backend, x, ws, LinearWorkspace::A);
  backend.gemm(xb, wb, y, spec, bias);
}

void LinearLayer::forward_columns(Backend& backend, const Tensor& x, const Tensor& w, const Tensor& w16,
                                  const Tensor& yt, LinearWorkspace* ws) {
  require_plain(w16);
  check_input(x);
  const GemmSpec spec = spec_of(false, true, 0.0f);  // (out, in) @ (in, N)
  if (setup_.recipe == RECIPE_F32) {
    backend.gemm(w, x, yt, spec);
    return;
  }
  LOOM_CHECK(ws != nullptr, "linear layer (", recipe_name(setup_.recipe), "): no workspace");
  backend.gemm(bf16_weight(backend, w, w16, *ws), bf16_input(backend, x, *ws, LinearWorkspace::A), yt, spec);
}

void LinearLayer::backward_columns(Backend& backend, const Tensor& x, const Tensor& w, const Tensor& w16,
                                   const Tensor& dyt, const Tensor& dx, const Tensor& dw, LinearWorkspace* ws) {
  require_plain(w16);
  check_input(x);
  LOOM_CHECK(dyt.dtype() == DTYPE_F32 || (dyt.dtype() == DTYPE_BF16 && setup_.recipe == RECIPE_BF16), "linear layer (",
             recipe_name(setup_.recipe), "): an output gradient in ", dtype_name(dyt.dtype()),
             " (only the bf16 recipe reads a bf16 one)");
  const GemmSpec dgrad = spec_of(true, false, 0.0f), wgrad = spec_of(false, false, 1.0f);  // (N, out) @ (out, in); (out, N) @ (N, in)
  if (setup_.recipe == RECIPE_F32) {
    backend.gemm(dyt, w, dx, dgrad);
    if (dw.defined()) backend.gemm(dyt, x, dw, wgrad);
    return;
  }
  LOOM_CHECK(ws != nullptr, "linear layer (", recipe_name(setup_.recipe), "): no workspace");
  const Tensor dyb = bf16_input(backend, dyt, *ws, LinearWorkspace::A);
  backend.gemm(dyb, bf16_weight(backend, w, w16, *ws), dx, dgrad);
  if (dw.defined()) backend.gemm(dyb, bf16_input(backend, x, *ws, LinearWorkspace::B), dw, wgrad);
}

void LinearLayer::backward(Backend& backend, const Tensor& x, const Tensor& w, const Tensor& w16, const Tensor& dy,
                           const Tensor& dx, const Tensor& dw, const Tensor& db, LinearWorkspace* ws,
                           const Tensor& dy16, const GeluBackward* gelu) {
  LOOM_CHECK(gelu == nullptr || (setup_.recipe == RECIPE_BF16 && dx.defined()), "linear layer (",
             recipe_name(setup_.recipe), "): a GELU's input gradient from the GEMM needs the bf16 recipe");
  LOOM_CHECK(int_weight_ == nullptr, "a quantized checkpoint (loom quantize) cannot be trained: its weights are "
             "integer codes; fine-tune the checkpoint it was made from");
  LOOM_CHECK(!bf16_weight_.defined(), "a model loaded for inference with its bf16 weights in place cannot be trained "
             "(train.init_from loads it in f32)");
  check_input(x);
  LOOM_CHECK(dy.dtype() == DTYPE_F32 || (dy.dtype() == DTYPE_BF16 && setup_.recipe == RECIPE_BF16),
             "linear layer (", recipe_name(setup_.recipe), "): an output gradient in ", dtype_name(dy.dtype()),
             " (only the bf16 recipe reads a bf16 one)");
  LOOM_CHECK(!dy16.defined() || (setup_.recipe == RECIPE_BF16 && dy.dtype() == DTYPE_F32 &&
                                 dy16.dtype() == DTYPE_BF16 && dy16.numel() == dy.numel()),
             "linear layer (", recipe_name(setup_.recipe), "): a rounded copy of dy needs the bf16 recipe, an fp32 dy "
             "and a bf16 copy of its size");
  if (db.defined()) backend.bias_backward(dy, db);  // an fp32 reduction in every recipe (of a bf16 dy's values)
  const GemmSpec dgrad = spec_of(false, false, 0.0f), wgrad = spec_of(true, false, 1.0f);
  if (setup_.recipe == RECIPE_F32 && setup_.qat == QAT_NONE && !w16.defined() && base_ == nullptr) {
    if (dx.defined()) backend.gemm(dy, w, dx, dgrad);  // either half alone: zero-bubble's B and W
    if (dw.defined()) backend.gemm(dy, x, dw, wgrad);
    return;
  }
  LOOM_CHECK(dx.defined(), "linear layer (", recipe_name(setup_.recipe), "): a split backward (the weight gradient "
             "alone) needs the f32 recipe");  // dw alone may be undefined: a frozen weight (LoRA's base)
  LOOM_CHECK(ws != nullptr, "linear layer (", recipe_name(setup_.recipe), "): no workspace");
  using S = LinearWorkspace;
  switch (setup_.recipe) {
    case RECIPE_F32: {
      backend.gemm(dy, effective_weight(backend, w, w16, *ws), dx, dgrad);
      if (dw.defined()) backend.gemm(dy, x, dw, wgrad);
      return;
    }
    case RECIPE_BF16: {
      const Tensor wb = bf16_weight(backend, w, w16, *ws);
      // (a bf16 dy: the loss's, Transformer::backward; dy16: the norm backward's rounding of dy)
      const Tensor dyb = dy16.defined() ? dy16.view(0, dy.shape()) : bf16_input(backend, dy, *ws, S::A);
      if (gelu != nullptr) backend.gemm_dgelu(dyb, wb, gelu->pre, gelu->scratch, dx, dgrad);
      else backend.gemm(dyb, wb, dx, dgrad);
      if (!dw.defined()) return;
      backend.gemm(dyb, bf16_input(backend, x, *ws, S::B), dw, wgrad);
      return;
    }
    case RECIPE_FP16: {
      const Tensor wq = fp16_of(backend, effective_weight(backend, w, w16, *ws), *ws, S::W);
      const Tensor dyq = fp16_of(backend, dy, *ws, S::A);
      backend.gemm(dyq, wq, dx, dgrad);
      round_fp16(backend, dx);
      if (!dw.defined()) return;
      const Tensor xq = fp16_of(backend, x, *ws, S::B);
      const Tensor t = ws->f32(S::C, dw.shape());
      backend.gemm(dyq, xq, t, spec_of(true, false, 0.0f));
      round_fp16(backend, t);  // the weight's fp16 gradient, accumulated into the fp32 one
      backend.add_inplace(dw, t);
      return;
    }
    case RECIPE_FP8_DELAYED:
    case RECIPE_FP8_CURRENT: {
      const Tensor we = effective_weight(backend, w, w16, *ws);
      const float sdy = fp8_scale(backend, kDy, setup_.fp8_backward, dy, true);
      const float sw = fp8_scale(backend, kW, FMT_E4M3, we, false), sx = fp8_scale(backend, kX, FMT_E4M3, x, false);
      const Tensor dyc = codes_of(backend, dy, setup_.fp8_backward, sdy, *ws, S::A);
      const Tensor wc = codes_of(backend, we, FMT_E4M3, sw, *ws, S::W), xc = codes_of(backend, x, FMT_E4M3, sx, *ws, S::B);
      backend.gemm(dyc, wc, dx, spec_of(false, false, 0.0f, (1.0f / sdy) * (1.0f / sw)));
      if (dw.defined()) backend.gemm(dyc, xc, dw, spec_of(true, false, 1.0f, (1.0f / sdy) * (1.0f / sx)));
      return;
    }
    case RECIPE_FP8_BLOCK: {
      // dgrad reduces over `out`: dy in 1x128 tiles along it, W in its forward 128x128 blocks.
      const Tensor wq = blocks_of(backend, effective_weight(backend, w, w16, *ws), FMT_E4M3, kTile, kTile, *ws, S::W);
      backend.gemm(blocks_of(backend, dy, setup_.fp8_backward, 1, kTile, *ws, S::A), wq, dx, dgrad);
      // wgrad reduces over tokens: dy and x in 128x1 tiles along them.
      if (!dw.defined()) return;
      const Tensor dyt = blocks_of(backend, dy, setup_.fp8_backward, kTile, 1, *ws, S::A);
      backend.gemm(dyt, blocks_of(backend, x, FMT_E4M3, kTile, 1, *ws, S::B), dw, wgrad);
      return;
    }
    case RECIPE_COUNT: break;
  }
  LOOM_CHECK(false, "linear layer: unknown recipe ", static_cast<int>(setup_.recipe));
}

}  // namespace loom
