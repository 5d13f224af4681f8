// GPT-OSS's expert tensors as a Hugging Face folder holds them <-> Loom's per-expert parameters.
// transformers' GptOssExperts keeps each layer's experts fused and transposed, gate and up
// interleaved: gate_up_proj (E, C, 2F) with gate = [..., 0::2] and up = [..., 1::2],
// gate_up_proj_bias (E, 2F) likewise, down_proj (E, F, C), down_proj_bias (E, C). Loom keeps one
// gate_up_proj.weight (2F, C) = [gate rows | up rows] and down_proj.weight (C, F) per expert, with
// their biases (arch/param_layout.cpp). The release stores the two weights in MXFP4 instead
// (OCP Microscaling v1.0, the seeds' FP4): gate_up_proj_blocks (E, 2F, C/32, 16) u8 and
// gate_up_proj_scales (E, 2F, C/32) u8 hold W_gu^T (E, 2F, C) — two E2M1 codes a byte, the low
// nibble first, each block of 32 times 2^(scale - 127) — and down_proj_blocks (E, C, F/32, 16) /
// down_proj_scales hold W_d^T (E, C, F); they are dequantized on import (precision/formats.h
// mxfp4_dequantize), exported in the plain layout.
#pragma once
#include <cstdint>
#include <functional>
#include <optional>
#include <set>
#include <string>

#include "loom/arch/config.h"
#include "loom/checkpoint/safetensors.h"

namespace loom {

enum class GptOssPart : uint8_t { gate_up, gate_up_bias, down, down_bias };

// A Loom parameter that is one expert's part of a fused folder tensor.
struct GptOssExpertRef {
  std::string folder;  // the fused tensor's name ("model.layers.L.mlp.experts.gate_up_proj", ...)
  GptOssPart part = GptOssPart::gate_up;
  int64_t expert = 0;
};
// For "model.layers.L.mlp.experts.E.{gate_up_proj,down_proj}.{weight,bias}"; nullopt otherwise.
std::optional<GptOssExpertRef> gpt_oss_expert_ref(const std::string& loom_name);

// The fused tensor's shape in the plain layout, and (weights only) its MXFP4 blocks' shape.
Shape gpt_oss_folder_shape(const ModelConfig& c, GptOssPart part);
Shape gpt_oss_blocks_shape(const ModelConfig& c, GptOssPart part);

// Finds a folder tensor by name (the stored name out), or nullptr.
using FolderLookup = std::function<const SafetensorsFile*(const std::string& name, std::string* stored)>;

// Expert ref.expert's part in Loom's layout into dst (f32, the Loom parameter's elements), from the
// plain tensor or its _blocks / _scales; the stored names read go into `used`. Errors name the
// tensor and the expected shape.
void read_gpt_oss_expert(const FolderLookup& find, const ModelConfig& c, const GptOssExpertRef& ref, float* dst,
                         std::set<std::string>& used);
// The folder tensor names read_gpt_oss_expert may read for ref (the plain one, or blocks and scales).
std::set<std::string> gpt_oss_stored_names(const FolderLookup& find, const GptOssExpertRef& ref);

// Export: the Loom parameter src (ref's expert and part) into its place in the plain fused tensor
// `folder` (gpt_oss_folder_shape(c, ref.part) elements).
void write_gpt_oss_expert(const ModelConfig& c, const GptOssExpertRef& ref, const float* src, float* folder);

}  // namespace loom
