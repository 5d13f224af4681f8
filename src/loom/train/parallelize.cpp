#include "loom/train/parallelize.h"

#include <algorithm>
#include <cmath>
#include <memory>
#include <set>

#include "loom/arch/param_layout.h"
#include "loom/checkpoint/hf_model.h"
#include "loom/checkpoint/peft.h"
#include "loom/checkpoint/weights.h"
#include "loom/core/error.h"
#include "loom/nn/lora.h"
#include "loom/parallel/tensor_parallel.h"

namespace loom {

namespace {

struct Build {
  Backend& backend;
  const LoomConfig& config;
  ParallelLayout& layout;
  TrainingModel out;
  // A compact base (QLoRA, or LoRA's base in bf16 only) from a Hugging Face folder: the reader of
  // its base, whose block matrices data_parallel's load_quantized_base or load_bf16_base reads one
  // at a time (streamed_base).
  std::shared_ptr<const HfWeightReader> base_reader;
};

// LoRA whose frozen base is kept in bf16 only (model/frozen_base.h keeps_bf16), where the
// objective does not decode with the fp32 weights while training and the parameters are host
// memory.
bool bf16_base(const Build& b) {
  return FrozenBase::keeps_bf16(b.config.model, resolve_policy(b.config.train.precision).param_bf16,
                                b.config.parallel.zero_stage) &&
         objective_row(b.config.loop.objective).layout.compact_base && b.backend.allocator().host_accessible();
}

// A compact base (QLoRA, or bf16_base) whose weights are a Hugging Face folder, one process per
// model replica (no tp): the block matrices go from the folder to NF4 or bf16 one at a time and
// never into the fp32 parameters, which are lazy (their untouched pages hold no memory), so a
// model whose fp32 base exceeds the machine trains. Other bases (a Loom checkpoint, a folder
// under tp) are loaded whole and made compact after (Transformer::quantize_base, keep_base_bf16).
bool streamed_base(const Build& b) {
  const LoopConfig& loop = b.config.loop;
  return (b.config.model.lora_quantize_base || bf16_base(b)) && !loop.init_from.empty() &&
         is_hf_model_dir(loop.init_from) && b.layout.group(Axis::tp) == nullptr;
}

// The base (the first `base` elements) from the folder, except the block matrices (and an untied
// head, in bf16) made compact (FrozenBase::weight_specs), which stay untouched.
void load_unquantized_base(Build& b, Transformer& model, const HfWeightReader& reader, int64_t base) {
  std::set<const ParamSpec*> compact;
  for (const ParamSpec* spec : FrozenBase::weight_specs(model.config(), model.layout(), model.params(), bf16_base(b))) {
    compact.insert(spec);
  }
  CpuAllocator host;
  for (const ParamSpec& spec : model.layout().params) {
    if (spec.offset >= base || compact.count(&spec) != 0) continue;
    const Tensor dst = model.params().view(spec.offset, spec.shape);
    if (dst.host_accessible()) {
      reader.read(spec.name, dst);
    } else {
      const Tensor staged = Tensor::empty(host, spec.shape, DTYPE_F32, MEM_WORKSPACE);
      reader.read(spec.name, staged);
      b.backend.write(dst, staged.data<float>());
    }
  }
}

// The weights a run starts from: train.init_from's, or the seeded random initialisation.
// LoRA on weights without adapters: the adapters start initialised (B = 0, so the model starts
// as the base) and the base, the layout's first lora_begin elements, is the weights'.
void initialise(Build& b, Transformer& model, const ModelConfig& config) {
  const LoopConfig& loop = b.config.loop;
  if (loop.init_from.empty()) {
    model.init_weights(loop.seed);
  } else if (streamed_base(b) && !weights_model_config(loop.init_from).lora()) {
    const int64_t base = lora_begin(config, model.layout());
    model.init_weights(loop.seed, base);  // the adapters; the base is the folder's
    b.base_reader = std::make_shared<const HfWeightReader>(loop.init_from, lora_base_config(config));
    load_unquantized_base(b, model, *b.base_reader, base);
  } else if (config.lora() && !weights_model_config(loop.init_from).lora()) {
    const int64_t base = lora_begin(config, model.layout());
    model.init_weights(loop.seed, base);
    load_weights_from(loop.init_from, lora_base_config(config), model.params().view(0, {base}), b.backend);
    dora_init_magnitudes(b.backend, config, model.params());  // DoRA: m = the loaded base rows' norms
  } else {
    load_weights_from(loop.init_from, config, model.params(), b.backend);
  }
  if (!loop.peft_adapter.empty()) {
    if (model.params().host_accessible()) {
      load_peft_adapter(loop.peft_adapter, ModelState{config, model.params()});
    } else {  // a device's weights: the adapter is read into a host copy, which is written back
      CpuAllocator host;
      const Tensor staged = Tensor::empty(host, model.params().shape(), model.params().dtype(), MEM_PARAMETERS);
      b.backend.read(model.params(), staged.raw_data());
      load_peft_adapter(loop.peft_adapter, ModelState{config, staged});
      b.backend.write(model.params(), staged.raw_data());
    }
  }
}

void tensor_parallel(Build& b) {
  const ModelConfig& global = b.config.model;
  Communicator* tp = b.layout.group(Axis::tp);
  b.out.local_config = tp != nullptr ? tp_local_config(global, tp->size()) : global;
  b.out.model = std::make_unique<Transformer>(b.backend, b.out.local_config, ModelUse{.lazy_params = streamed_base(b)});
  if (tp == nullptr) {
    initialise(b, *b.out.model, global);
    return;
  }
  // The whole model is initialised as one process would, then sliced.
  b.out.whole = std::make_unique<Transformer>(b.backend, global);
  initialise(b, *b.out.whole, global);
  tp_copy(b.backend, global, b.out.whole->params(), b.out.local_config, b.out.model->params(), tp->rank(), tp->size(), true);
  const VocabRange vocab = tp_vocab_range(global, tp->rank(), tp->size());
  b.out.model->set_tensor_parallel(tp, vocab.begin, vocab.valid, b.config.parallel.sequence_parallel);
}

void context_parallel(Build& b) {
  if (Communicator* cp = b.layout.group(Axis::cp)) b.out.model->set_context_parallel(cp, b.config.parallel.cp_attention == CpAttention::ulysses);
}

void expert_parallel(Build& b) {
  if (Communicator* ep = b.layout.group(Axis::ep)) b.out.model->set_expert_parallel(ep);
}

void pipeline_parallel(Build& b) {
  Communicator* pp = b.layout.group(Axis::pp);
  if (pp == nullptr) return;
  const ParallelConfig& p = b.config.parallel;
  const TrainConfig& t = b.config.train;
  // The stage stores' fields follow the precision policy (bf16-saved inputs): set it first, as
  // the trainer does again.
  b.out.model->set_precision(resolve_policy(t.precision));
  b.out.pipeline = std::make_unique<PipelineRunner>(
      *b.out.model, *pp,
      make_pipe_schedule(p.schedule, pp->size(), static_cast<int>(t.grad_accum), static_cast<int>(p.virtual_stages)),
      t.batch_size, t.seq_len);
}

void data_parallel(Build& b) {
  const ParallelConfig& p = b.config.parallel;
  DdpConfig ddp;
  ddp.bucket_bytes = static_cast<int64_t>(p.bucket_mb * (1 << 20));
  ddp.overlap = p.overlap;
  ddp.zero_stage = p.zero_stage;
  ddp.compression = p.compression;
  ddp.topk_ratio = p.topk_ratio;
  ddp.qsgd_levels = static_cast<int>(p.qsgd_levels);
  ddp.powersgd_rank = static_cast<int>(p.powersgd_rank);
  ddp.dgc.momentum = p.dgc_momentum;
  ddp.dgc.clip_norm = p.dgc_clip;
  ddp.dgc.warmup_steps = p.dgc_warmup_steps;
  ddp.compression_warmup = p.compression_warmup;
  b.out.trainer = std::make_unique<Trainer>(b.backend, *b.out.model, b.config.train, &b.layout.reduce_group(), ddp,
                                            b.out.pipeline.get());
  const bool qlora = b.config.model.lora_quantize_base;
  if (b.base_reader) {  // from a folder: its block matrices read one at a time, into NF4 or bf16
    const std::shared_ptr<const HfWeightReader> reader = std::move(b.base_reader);
    const FrozenBase::WeightRead read = [&](const std::string& name, const Tensor& dst) { reader->read(name, dst); };
    if (qlora) b.out.model->load_quantized_base(read);
    else b.out.model->load_bf16_base(read);
  } else if (qlora) {
    b.out.model->quantize_base();  // after the weights are final
  } else if (bf16_base(b)) {
    b.out.model->keep_base_bf16();  // the trainer has made the bf16 copy
  }
}

// The order of the passes: each may rely on every one above it.
struct Pass {
  Axis axis;
  void (*apply)(Build&);
};
constexpr Pass kPasses[] = {
    {Axis::tp, tensor_parallel}, {Axis::cp, context_parallel}, {Axis::ep, expert_parallel},
    {Axis::pp, pipeline_parallel}, {Axis::dp, data_parallel},
};

}  // namespace

TrainingModel parallelize(Backend& backend, const LoomConfig& config, ParallelLayout& layout) {
  Build b{backend, config, layout, {}, nullptr};
  for (const Pass& pass : kPasses) pass.apply(b);
  return std::move(b.out);
}

TrainingData::TrainingData(TrainingSplits splits, const LoomConfig& config, const ParallelLayout& layout,
                           Allocator& allocator)
    : train_(std::move(splits.train)), val_(std::move(splits.val)), max_val_batches_(splits.max_val_batches) {
  const int64_t B = config.train.batch_size, T = config.train.seq_len;
  // Each data-parallel rank trains on its rows of the global batch the source draws.
  Communicator& dp = layout.batch_group();
  Allocator& staging = allocator.host_accessible() ? allocator : host_;  // batch sources write host memory
  rank_ = std::make_unique<RankSliceSource>(*train_, staging, dp.rank(), dp.size(), B, T);
  if (splits.whole_sequences) return;
  if (dp.size() > 1) {
    dp_ = &dp;
    val_rank_ = std::make_unique<RankSliceSource>(*val_, staging, dp.rank(), dp.size(), B, T);
  }
  BatchSource& val = val_rank_ ? static_cast<BatchSource&>(*val_rank_) : *val_;
  cp_ = layout.group(Axis::cp);
  if (cp_ != nullptr) {
    cp_train_ = std::make_unique<ContextSliceSource>(*rank_, staging, cp_->rank(), cp_->size(), B, T);
    cp_val_ = std::make_unique<ContextSliceSource>(val, staging, cp_->rank(), cp_->size(), B, T);
  }
}

double TrainingData::validation_loss(Trainer& trainer, int64_t batches, Allocator& allocator) {
  val_->rewind();
  if (max_val_batches_ > 0) batches = std::min(batches, max_val_batches_);  // (held-out pairs: each once)
  BatchSource& val = cp_val_ ? static_cast<BatchSource&>(*cp_val_)
                    : val_rank_ ? static_cast<BatchSource&>(*val_rank_)
                                : *val_;
  double loss = trainer.evaluate(val, batches);
  for (Communicator* group : {cp_, dp_}) {  // the mean over the ranks' equal shares
    if (group == nullptr) continue;
    Tensor sum = Tensor::zeros(allocator, {1}, DTYPE_F64, MEM_WORKSPACE);  // the backend's memory: through it
    trainer.backend().write(sum, &loss);
    group->all_reduce(sum);
    trainer.backend().read(sum, &loss);
    loss /= group->size();
  }
  return loss;
}

}  // namespace loom
