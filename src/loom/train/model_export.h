// What `loom convert` writes from (docs/models.md "Exporting"): a model source's weights read one
// parameter at a time (checkpoint/param_reader.h: a Hugging Face folder or a Loom checkpoint,
// widened from the file tensor by tensor), with LoRA adapters merged into each adapted weight as
// it is read (W + s B A, DoRA rescaled: nn/lora.h lora_merge_weight; Hu et al. 2021 sec. 4.1).
// So exporting an 8B model, or merging a QLoRA run's adapters into its (dequantized) base, holds
// one weight in f32 and the adapters, never the model. A sharded checkpoint (one file per rank)
// is read whole first.
#pragma once
#include <memory>

#include "loom/checkpoint/param_reader.h"
#include "loom/train/model_source.h"

namespace loom {

// The source's weights; config() is the exported model's: the source's without its adapters
// (lora_base_config) when it has any. The adapters alone are held in memory (a lazy buffer of
// the whole layout whose base pages are never written).
std::unique_ptr<ParamReader> open_export_reader(const ModelSource& source);

// The source's LoRA adapters in the whole layout's flat f32 buffer (Tensor::zeros_lazy: the base
// elements are never written, so only the adapters' pages are resident): what `--to peft` writes.
Tensor read_adapters(const ModelSource& source, Allocator& host);

}  // namespace loom
