// The gate activations of gated MLPs (Shazeer 2020, "GLU Variants Improve Transformer"):
// x = [gate | up], out = act(gate) * up, with act
//   silu       g sigmoid(g)                                   SwiGLU (Llama, Qwen, Mistral, ...)
//   gelu_tanh  0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3)))  GeGLU (Gemma's gelu_pytorch_tanh)
//   sigmoid    sigmoid(g)                                      a plain gate (Qwen3-Next's gated
//                                                              attention output and shared expert)
//   swiglu_oai GPT-OSS's clamped SwiGLU: with g' = min(g, 7) and u' = clamp(u, -7, 7),
//              out = g' sigmoid(1.702 g') (u' + 1)              (transformers' GptOssExperts:
//                                                              alpha 1.702, swiglu_limit 7)
#pragma once
#include <array>
#include <cstdint>
#include <string_view>

#include "loom/core/enum_names.h"

namespace loom {

enum class GateActivation : uint8_t { silu, gelu_tanh, sigmoid, swiglu_oai };

// swiglu_oai's constants (GPT-OSS's released config: swiglu_limit 7.0; alpha fixed in its code).
inline constexpr double kSwigluOaiAlpha = 1.702, kSwigluOaiLimit = 7.0;

template <>
struct EnumNames<GateActivation> {  // model.gate_activation
  static constexpr std::array<std::string_view, 4> names{"silu", "gelu_tanh", "sigmoid", "swiglu_oai"};
};

}  // namespace loom
