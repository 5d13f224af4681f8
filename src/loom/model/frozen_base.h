// LoRA's frozen base kept compact (docs/finetune.md): every block's four linear weights (and, in
// bf16, an untied head) held in a form smaller than the model's fp32 elements, which the linear
// layers read instead:
//   - NF4 with double-quantized scales (QLoRA, peft.quantize_base; Dettmers et al. 2023,
//     precision/nf4.h), dequantized on the fly (LinearLayer's base);
//   - bf16 (precision.param = bf16 with LoRA): the layers already read the model's bf16 copy of
//     the weights (Transformer's params16), and a weight that is never updated needs no fp32
//     master, so the copy is all that is kept. What is computed is unchanged.
// The model's fp32 elements of those weights hold the same values only when asked
// (materialize: before a checkpoint or decoding, which read them) and their pages are released
// otherwise (release); loading from a folder one weight at a time (load, load_bf16) never writes
// them, so the fp32 base never exists.
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
#include "loom/core/range_set.h"
#include "loom/nn/block.h"
#include "loom/precision/nf4.h"

namespace loom {

// A component the Transformer owns (model/transformer.h quantize_base, keep_base_bf16) rather
// than free functions over its flat buffer: the NF4 copies are state the linear layers point at,
// so they must live exactly as long as the blocks, and the list of compact ranges is what
// materialize, release, the bf16 copy's refresh and the counts walk.
class FrozenBase {
 public:
  // Reads the parameter `name` (the model's layout's) into `dst`, a host f32 tensor of its shape.
  using WeightRead = std::function<void(const std::string& name, const Tensor& dst)>;
  // The parameters made compact, in their order: each block's qkv, proj, fc, fc2; with head, then
  // the untied head (bf16 only: QLoRA keeps the head in f32, as the paper does).
  static std::vector<const ParamSpec*> weight_specs(const ModelConfig& config, const ParamLayout& layout,
                                                   const Tensor& params, bool head = false);
  // Whether a LoRA model keeps its frozen base in bf16 only: LoRA without QLoRA or DoRA, dense
  // blocks, the bf16 copy (precision.param = bf16) and no ZeRO (which gathers the fp32 buffer).
  // The run also needs an objective that does not decode while training (GRPO's rollouts read
  // the fp32 weights) and host-readable parameters. The one place this is decided (the run's
  // set-up and `loom memory` ask it).
  static bool keeps_bf16(const ModelConfig& config, bool param_bf16, int64_t zero_stage);

  // Refuses what QLoRA does not support, before the model prepares its blocks' workspace: no
  // LoRA or already compact, a backend without nf4 or host-readable parameters, MoE or MLA
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
  // bf16: the weights' elements of params16 (the model's bf16 copy, up to date) become the only
  // copy and their fp32 pages are released. Refuses what keeps_bf16 excludes, naming it.
  void keep_bf16(Backend& backend, const ModelConfig& config, const ParamLayout& layout, const Tensor& params,
                 const Tensor& params16);
  // The same, each weight read by `read` into a host buffer of one weight and rounded into
  // params16 (exact for a bf16 checkpoint's), its fp32 elements never written.
  void load_bf16(Backend& backend, const ModelConfig& config, const ParamLayout& layout, const Tensor& params,
                 const Tensor& params16, const WeightRead& read);
  void materialize() const;  // the values the layers compute with into the weights' fp32 elements
  void release() const;      // their pages back to the OS
  // One compact weight at a time, by the offset where it starts in params (a checkpoint's
  // writer: ParamPages): whether one starts there; its values in, its pages out.
  bool covers(int64_t offset) const { return find(offset) != nullptr; }
  void materialize(int64_t offset) const;
  void release(int64_t offset) const;
  int64_t params() const;    // the compact weights' element count
  int64_t bytes() const;     // their bytes (nf4_bytes of each, or 2 a bf16 element)
  bool bf16() const { return bf16_; }          // by keep_bf16 or load_bf16
  bool streamed() const { return streamed_; }  // by load or load_bf16
  RangeSet ranges() const;   // the compact weights' elements of params

 private:
  struct Weight {
    int64_t offset = 0;
    Shape shape;
    size_t bytes = 0;
    std::unique_ptr<Nf4Device> nf4;  // NF4: stable, the linear layers point at it
    Tensor bf16;                     // bf16: the weight's view of the model's bf16 copy
  };
  void add(Backend& backend, const Tensor& params, const Tensor& weight, std::span<const float> values,
           LinearLayer& linear);
  void check_bf16(const Backend& backend, const ModelConfig& config, const Tensor& params, const Tensor& params16) const;
  void add_bf16(const ModelConfig& config, const ParamLayout& layout, const Tensor& params, const Tensor& params16);
  Backend* backend_ = nullptr;
  Tensor params_;  // the model's flat parameters (set by quantize)
  const Weight* find(int64_t offset) const;
  const Weight& at(int64_t offset) const;  // find, or an error naming the offset
  void materialize(const Weight& q) const;
  void release(const Weight& q) const;
  std::vector<Weight> weights_;
  bool streamed_ = false, bf16_ = false;
};

}  // namespace loom
