// QLoRA's frozen base (peft.quantize_base, docs/finetune.md; Dettmers et al. 2023): every block's
// four linear weights (the frozen base's matrices) stored in NF4 with double-quantized scales
// (precision/nf4.h), which the linear layers dequantize on the fly in forward and backward
// (LinearLayer's base). The model's fp32 elements of those weights first get the dequantized
// values -- what training computes with, so checkpoints, decoding and merging see the same
// weights -- and then their pages are released (release) until materialize writes them again
// (before a checkpoint or decoding).
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "loom/arch/config.h"
#include "loom/arch/param_layout.h"
#include "loom/backend/backend.h"
#include "loom/nn/block.h"
#include "loom/precision/nf4.h"

namespace loom {

// A component the Transformer owns (model/transformer.h quantize_base) rather than free
// functions over its flat buffer: the NF4 copies are state the linear layers point at, so they
// must live exactly as long as the blocks, and the list of quantized ranges is what
// materialize, release and the counts walk.
class QloraBase {
 public:
  // Reads the parameter `name` (the model's layout's) into `dst`, a host f32 tensor of its shape.
  using WeightRead = std::function<void(const std::string& name, const Tensor& dst)>;
  // The parameters quantize and load quantize, in their order: each block's qkv, proj, fc, fc2.
  static std::vector<const ParamSpec*> weight_specs(const ModelConfig& config, const ParamLayout& layout,
                                                   const Tensor& params);

  // Refuses what QLoRA does not support, before the model prepares its blocks' workspace: no
  // LoRA or already quantized, a backend without nf4 or host-readable parameters, MoE or MLA
  // blocks, a bf16 copy of the weights (bf16_copy: precision.param = bf16).
  void check(const Backend& backend, const ModelConfig& config, const Tensor& params, bool bf16_copy) const;
  // Quantizes each block's four linear weights (views into params, the model's flat buffer),
  // points the block's layers at their NF4 copies, then materialize() and release().
  void quantize(Backend& backend, const ModelConfig& config, const ParamLayout& layout, const Tensor& params,
                std::vector<Block>& blocks);
  // The same from weights read one at a time into a host buffer of one weight (`read`), leaving
  // their elements of params untouched (no materialize, no release): the fp32 base never exists.
  void load(Backend& backend, const ModelConfig& config, const ParamLayout& layout, const Tensor& params,
            std::vector<Block>& blocks, const WeightRead& read);
  void materialize() const;  // the dequantized values into the weights' fp32 elements
  void release() const;      // their pages back to the OS
  // One quantized weight at a time, by the offset where it starts in params (a checkpoint's
  // writer: ParamPages): whether one starts there; its values in, its pages out.
  bool covers(int64_t offset) const { return find(offset) != nullptr; }
  void materialize(int64_t offset) const;
  void release(int64_t offset) const;
  int64_t params() const;    // the quantized weights' element count
  int64_t bytes() const;     // their NF4 bytes (nf4_bytes of each)
  bool streamed() const { return streamed_; }  // built by load

 private:
  void add(Backend& backend, const Tensor& params, const Tensor& weight, std::span<const float> values,
           LinearLayer& linear);
  struct Weight {
    int64_t offset = 0;
    Shape shape;
    size_t bytes = 0;
    std::unique_ptr<Nf4Device> nf4;  // stable: the linear layers point at it
  };
  Backend* backend_ = nullptr;
  Tensor params_;  // the model's flat parameters (set by quantize)
  const Weight* find(int64_t offset) const;
  const Weight& at(int64_t offset) const;  // find, or an error naming the offset
  void materialize(const Weight& q) const;
  void release(const Weight& q) const;
  std::vector<Weight> weights_;
  bool streamed_ = false;
};

}  // namespace loom
