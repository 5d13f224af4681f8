#include "loom/train/layout.h"

#include "loom/comm/cuda_device_group.h"

#include "loom/core/error.h"
#include "loom/parallel/zero.h"
#include "loom/precision/policy.h"
#include "loom/train/config.h"
#include "loom/train/objective.h"

namespace loom {

const char* axis_name(Axis axis) {
  static constexpr const char* kNames[kAxisCount] = {"pp", "dp", "ep", "cp", "tp"};
  return kNames[static_cast<int>(axis)];
}

namespace {

// ---- The compatibility table ---------------------------------------------------------------
//
// One row per combination Loom refuses (or, for a note, a key that does nothing here). `when`
// reads the facts; `message` names the keys and their values and, where there is one, the way
// out. Rows are checked in order; the first refusal stops the run before anything is allocated.
enum class Verdict { refuse, no_effect, advise };  // advise: runs, with a note on what it is measured to cost

struct Rule {
  Verdict verdict;
  bool (*when)(const LayoutFacts&);
  std::string (*message)(const LayoutFacts&);
};

const ParallelConfig& par(const LayoutFacts& f) { return f.config->parallel; }
const ModelConfig& model(const LayoutFacts& f) { return f.config->model; }
const TrainConfig& train(const LayoutFacts& f) { return f.config->train; }
bool mla(const LayoutFacts& f) { return model(f).mla(); }
bool moe(const LayoutFacts& f) { return model(f).moe_experts > 0; }
bool recompute(const LayoutFacts& f) { return train(f).recompute != "none"; }
bool flash(const LayoutFacts& f) { return train(f).flash_attention; }
bool sp(const LayoutFacts& f) { return par(f).sequence_parallel && f.of(Axis::tp) > 1; }
int64_t zero(const LayoutFacts& f) { return par(f).zero_stage; }
const std::string& optimizer(const LayoutFacts& f) { return train(f).optim.name; }
// optim.name's registry row (the registry parses the name; it throws naming the known ones).
const OptimizerRow& optimizer_of(const LayoutFacts& f) { return optimizer_row(optimizer(f)); }
OptimizerKind kind(const LayoutFacts& f) { return optimizer_of(f).kind; }
bool elementwise(const LayoutFacts& f) { return optimizer_of(f).elementwise; }
bool keeps_gradients(const LayoutFacts& f) { return optimizer_of(f).keeps_gradients; }
// The ranks gradients are averaged over (dp x ep x cp); 0 when the world is not known.
int reduce_ranks(const LayoutFacts& f) { return f.data_parallel * f.of(Axis::cp); }
bool reduced(const LayoutFacts& f) { return reduce_ranks(f) > 1; }
bool model_parallel(const LayoutFacts& f) {
  return f.of(Axis::tp) > 1 || f.of(Axis::pp) > 1 || f.of(Axis::cp) > 1 || par(f).ep > 1;
}
bool low_precision(const LayoutFacts& f) {
  const PrecisionPolicy p = resolve_policy(train(f).precision);
  for (LinearRecipe r : p.recipe) {
    if (r != RECIPE_F32 && r != RECIPE_BF16) return true;
  }
  return p.qat != QAT_NONE || p.master_bf16 || p.reduce_bf16;
}
// What of the layout the objective's row says it does not run in ("" when it runs in all of it).
std::string objective_misfit(const LayoutFacts& f) {
  const ObjectiveLayout& o = objective_row(f.config->loop.objective).layout;
  if (!o.model_parallel && (f.of(Axis::tp) > 1 || f.of(Axis::pp) > 1 || f.of(Axis::cp) > 1)) {
    return str_cat("tensor, pipeline or context parallelism (parallel.tp = ", f.of(Axis::tp), ", pp = ", f.of(Axis::pp),
                   ", cp = ", f.of(Axis::cp), ")");
  }
  if (!o.data_parallel && f.data_parallel > 1) return str_cat(f.data_parallel, " data-parallel ranks");
  if (!o.moe && moe(f)) return str_cat("MoE blocks (model.moe_experts = ", model(f).moe_experts, ")");
  if (!o.compact_base && model(f).lora_quantize_base) return "peft.quantize_base (QLoRA)";
  return "";
}
std::string unsupported_on(const LayoutFacts& f, const std::string& what, const char* why) {
  return str_cat(what, " is not supported on the ", f.backend_name, " backend yet (", why, ")");
}

const Rule kRules[] = {
    // Packed documents (data.document_mask) run the attention per document on a rank's whole rows.
    {Verdict::refuse, [](const LayoutFacts& f) { return f.config->data.document_mask && f.of(Axis::cp) > 1; },
     [](const LayoutFacts& f) {
       return str_cat("data.document_mask is not supported with context parallelism (parallel.cp = ", f.of(Axis::cp),
                      ") yet; use data, tensor or pipeline parallelism");
     }},
    {Verdict::refuse, [](const LayoutFacts& f) { return f.config->data.document_mask && mla(f); },
     [](const LayoutFacts&) { return std::string("data.document_mask is not supported with model.mla_kv_rank > 0 (MLA) yet"); }},
    {Verdict::refuse, [](const LayoutFacts& f) { return f.config->data.document_mask && sp(f) && model(f).learned_positions(); },
     [](const LayoutFacts&) {
       return std::string("data.document_mask with learned positions (gpt2) and parallel.sequence_parallel is not "
                          "supported yet: the positions restart inside the sequence shards");
     }},
    // The objective's layout (its registry row, train/objective.h): what it does not run in yet.
    {Verdict::refuse, [](const LayoutFacts& f) { return !objective_misfit(f).empty(); },
     [](const LayoutFacts& f) {
       const ObjectiveRow& row = objective_row(f.config->loop.objective);
       return str_cat("train.objective = ", row.name, " does not run with ", objective_misfit(f), " yet: ", row.layout.why);
     }},
    // DPO's live reference (dpo.reference = live) copies the whole initial weights.
    {Verdict::refuse, [](const LayoutFacts& f) {
       const DpoConfig& d = f.config->dpo;
       return f.config->loop.objective == "dpo" && d.reference == DpoReference::live && !d.reference_free() &&
              !model(f).lora() && zero(f) >= 3;
     },
     [](const LayoutFacts&) {
       return std::string("dpo.reference = live copies the initial weights, which parallel.zero_stage = 3 has sharded: "
                          "use zero_stage <= 2, dpo.reference = once or LoRA");
     }},
    // QLoRA: the NF4 base is dequantized by the linear layers of one process's whole model.
    {Verdict::refuse, [](const LayoutFacts& f) { return model(f).lora_quantize_base && !model(f).lora(); },
     [](const LayoutFacts&) { return std::string("peft.quantize_base (QLoRA) needs peft.method = lora"); }},
    {Verdict::refuse, [](const LayoutFacts& f) { return model(f).lora_quantize_base && !f.backend.nf4; },
     [](const LayoutFacts& f) { return unsupported_on(f, "peft.quantize_base (QLoRA)", "it lacks nf4_dequantize; use device = \"cpu\""); }},
    {Verdict::refuse, [](const LayoutFacts& f) {
       return model(f).lora_quantize_base && (moe(f) || mla(f) || zero(f) >= 1 || low_precision(f) ||
                                              resolve_policy(train(f).precision).param_bf16);
     },
     [](const LayoutFacts&) {
       return std::string("peft.quantize_base (QLoRA) is not supported yet with MoE or MLA blocks, parallel.zero_stage >= 1, "
                          "precision.param = bf16 or the fp16/fp8/QAT recipes");
     }},
    // Model features against parallelisms and memory policies.
    {Verdict::refuse, [](const LayoutFacts& f) { return model(f).lora_dora && f.of(Axis::tp) > 1; },
     [](const LayoutFacts& f) {
       return str_cat("peft.dora is not supported with tensor parallelism (parallel.tp = ", f.of(Axis::tp),
                      ") yet: a row-parallel layer's row norms span the ranks; use LoRA, or data or pipeline parallelism");
     }},
    {Verdict::refuse, [](const LayoutFacts& f) { return model(f).lora() && f.of(Axis::tp) > 1 && zero(f) >= 2; },
     [](const LayoutFacts& f) {
       return str_cat("peft.method = lora with parallel.tp > 1 and parallel.zero_stage = ", zero(f), " is not supported "
                      "yet: the replicated adapters' gradients are summed over tp after backward, ZeRO-2/3 reduce-scatter "
                      "during it; use zero_stage 0 or 1");
     }},
    {Verdict::refuse, [](const LayoutFacts& f) { return model(f).lora() && par(f).compression != Compression::none; },
     [](const LayoutFacts& f) {
       return str_cat("parallel.compression = ", enum_name(par(f).compression), " with peft.method = lora is not "
                      "supported: the compressors cover the whole gradient buffer, LoRA's base has none");
     }},
    {Verdict::refuse, [](const LayoutFacts& f) { return mla(f) && f.of(Axis::tp) > 1; },
     [](const LayoutFacts& f) {
       return str_cat("model.mla_kv_rank > 0 (MLA) is not supported with tensor parallelism (parallel.tp = ", f.of(Axis::tp), ")");
     }},
    {Verdict::refuse, [](const LayoutFacts& f) { return mla(f) && par(f).sequence_parallel; },
     [](const LayoutFacts&) { return std::string("model.mla_kv_rank > 0 (MLA) is not supported with parallel.sequence_parallel"); }},
    {Verdict::refuse, [](const LayoutFacts& f) { return mla(f) && f.of(Axis::cp) > 1; },
     [](const LayoutFacts& f) {
       return str_cat("model.mla_kv_rank > 0 (MLA) is not supported with context parallelism (parallel.cp = ", f.of(Axis::cp), ")");
     }},
    {Verdict::refuse, [](const LayoutFacts& f) { return mla(f) && recompute(f); },
     [](const LayoutFacts& f) {
       return str_cat("model.mla_kv_rank > 0 (MLA) is not supported with activation checkpointing (train.recompute = ",
                      train(f).recompute, "); set train.recompute = none");
     }},
    {Verdict::refuse, [](const LayoutFacts& f) { return mla(f) && flash(f); },
     [](const LayoutFacts&) {
       return std::string("train.flash_attention is not supported with model.mla_kv_rank > 0 (MLA computes its own "
                          "attention); set train.flash_attention = false");
     }},
    {Verdict::refuse, [](const LayoutFacts& f) { return flash(f) && f.of(Axis::cp) > 1; },
     [](const LayoutFacts& f) {
       return str_cat("train.flash_attention is not supported with context parallelism (parallel.cp = ", f.of(Axis::cp),
                      " runs ring or Ulysses attention); set train.flash_attention = false or parallel.cp = 1");
     }},
    {Verdict::refuse, [](const LayoutFacts& f) { return flash(f) && f.of(Axis::pp) > 1; },
     [](const LayoutFacts& f) {
       return str_cat("train.flash_attention is not supported with pipeline parallelism (parallel.pp = ", f.of(Axis::pp),
                      ") yet; set train.flash_attention = false or parallel.pp = 1");
     }},
    {Verdict::refuse, [](const LayoutFacts& f) { return model(f).qk_norm_whole && f.of(Axis::tp) > 1; },
     [](const LayoutFacts& f) {
       return str_cat("model.qk_norm_whole (OLMo 2's q/k norms over all heads) with parallel.tp = ", f.of(Axis::tp),
                      " is not supported yet (the norm spans the heads the ranks split); use parallel.tp = 1");
     }},
    {Verdict::refuse, [](const LayoutFacts& f) { return !f.backend.head_norm && model(f).qk_norm; },
     [](const LayoutFacts& f) {
       return unsupported_on(f, "model.qk_norm (per-head q/k RMSNorm)", "it lacks Backend::head_rmsnorm_*; use device = \"cpu\"");
     }},
    {Verdict::refuse, [](const LayoutFacts& f) { return model(f).attn_window > 0 && f.of(Axis::cp) > 1; },
     [](const LayoutFacts& f) {
       return str_cat("model.attn_window = ", model(f).attn_window, " (sliding-window attention) is not supported with "
                      "context parallelism (parallel.cp = ", f.of(Axis::cp), "); set model.attn_window = 0 or parallel.cp = 1");
     }},
    {Verdict::refuse, [](const LayoutFacts& f) { return par(f).ep > 1 && !moe(f); },
     [](const LayoutFacts& f) { return str_cat("parallel.ep = ", par(f).ep, " needs an MoE model (model.moe_experts > 0)"); }},
    {Verdict::refuse, [](const LayoutFacts& f) { return par(f).ep > 1 && moe(f) && model(f).moe_experts % par(f).ep != 0; },
     [](const LayoutFacts& f) {
       return str_cat("parallel.ep = ", par(f).ep, " must divide model.moe_experts = ", model(f).moe_experts);
     }},
    {Verdict::refuse, [](const LayoutFacts& f) { return par(f).ep > 1 && par(f).dp > 0 && par(f).dp % par(f).ep != 0; },
     [](const LayoutFacts& f) {
       return str_cat("parallel.ep = ", par(f).ep, " must divide parallel.dp = ", par(f).dp,
                      " (experts are split over data-parallel ranks)");
     }},
    {Verdict::refuse, [](const LayoutFacts& f) { return moe(f) && f.of(Axis::cp) > 1; },
     [](const LayoutFacts& f) {
       return str_cat("parallel.cp > 1 with an MoE model (model.moe_experts = ", model(f).moe_experts, ") is not supported yet");
     }},
    {Verdict::refuse, [](const LayoutFacts& f) { return moe(f) && sp(f); },
     [](const LayoutFacts& f) {
       return str_cat("parallel.sequence_parallel with an MoE model (model.moe_experts = ", model(f).moe_experts,
                      ") is not supported yet");
     }},
    {Verdict::refuse, [](const LayoutFacts& f) { return sp(f) && f.of(Axis::cp) > 1; },
     [](const LayoutFacts& f) {
       return str_cat("parallel.cp = ", f.of(Axis::cp), " with parallel.sequence_parallel is not supported yet");
     }},
    {Verdict::refuse, [](const LayoutFacts& f) { return recompute(f) && (f.of(Axis::tp) > 1 || f.of(Axis::cp) > 1); },
     [](const LayoutFacts& f) {
       return str_cat("activation checkpointing (train.recompute = ", train(f).recompute, ") with tensor or context "
                      "parallelism (parallel.tp = ", f.of(Axis::tp), ", parallel.cp = ", f.of(Axis::cp), ") is not supported yet");
     }},
    {Verdict::refuse, [](const LayoutFacts& f) { return recompute(f) && f.of(Axis::pp) > 1; },
     [](const LayoutFacts& f) {
       return str_cat("train.recompute = ", train(f).recompute, " with parallel.pp > 1 is not supported yet");
     }},
    // Shapes each split needs.
    {Verdict::refuse,
     [](const LayoutFacts& f) {
       const int tp = f.of(Axis::tp);
       return tp > 1 && (model(f).n_head % tp != 0 || model(f).n_kv_head % tp != 0);
     },
     [](const LayoutFacts& f) {
       return str_cat("parallel.tp = ", f.of(Axis::tp), " must divide model.n_head (", model(f).n_head, ") and model.n_kv_head (",
                      model(f).n_kv_head, "): attention is split by heads");
     }},
    {Verdict::refuse, [](const LayoutFacts& f) { return f.of(Axis::tp) > 1 && model(f).d_ff % f.of(Axis::tp) != 0; },
     [](const LayoutFacts& f) { return str_cat("parallel.tp = ", f.of(Axis::tp), " must divide model.d_ff (", model(f).d_ff, ")"); }},
    {Verdict::refuse, [](const LayoutFacts& f) { return sp(f) && train(f).seq_len % f.of(Axis::tp) != 0; },
     [](const LayoutFacts& f) {
       return str_cat("parallel.sequence_parallel: train.seq_len (", train(f).seq_len, ") must be a multiple of parallel.tp (",
                      f.of(Axis::tp), ")");
     }},
    {Verdict::refuse, [](const LayoutFacts& f) { return f.of(Axis::cp) > 1 && train(f).seq_len % (2 * f.of(Axis::cp)) != 0; },
     [](const LayoutFacts& f) {
       return str_cat("parallel.cp = ", f.of(Axis::cp), " needs train.seq_len divisible by 2 x parallel.cp = ",
                      2 * f.of(Axis::cp), " (zig-zag chunks), got train.seq_len = ", train(f).seq_len);
     }},
    {Verdict::refuse,
     [](const LayoutFacts& f) {
       const int cp = f.of(Axis::cp);
       return cp > 1 && par(f).cp_attention == CpAttention::ulysses && (model(f).n_head % cp != 0 || model(f).n_kv_head % cp != 0);
     },
     [](const LayoutFacts& f) {
       return str_cat("parallel.cp_attention = ulysses needs parallel.cp = ", f.of(Axis::cp), " to divide model.n_head (",
                      model(f).n_head, ") and model.n_kv_head (", model(f).n_kv_head, "): its all-to-all splits the heads; "
                      "use parallel.cp_attention = ring");
     }},
    // Optimizer state and gradients across ranks.
    {Verdict::refuse, [](const LayoutFacts& f) { return zero(f) > 0 && par(f).ep > 1 && f.data_parallel > 1; },
     [](const LayoutFacts& f) {
       return str_cat("parallel.zero_stage = ", zero(f), " with parallel.ep > 1 is not supported yet (the data-parallel "
                      "ranks hold different experts): use zero_stage 0");
     }},
    {Verdict::refuse, [](const LayoutFacts& f) { return zero(f) >= 2 && f.of(Axis::pp) > 1; },
     [](const LayoutFacts& f) {
       return str_cat("parallel.zero_stage = ", zero(f), " with parallel.pp > 1: ZeRO-2/3 shard the whole model, this "
                      "rank updates only its own part; use zero_stage 0 or 1");
     }},
    {Verdict::refuse, [](const LayoutFacts& f) { return zero(f) >= 2 && sp(f); },
     [](const LayoutFacts& f) {
       return str_cat("parallel.sequence_parallel with parallel.zero_stage = ", zero(f), " is not supported: the norms' "
                      "gradients are summed over the tp group after backward, ZeRO-2/3 reduce-scatter them during it; "
                      "use zero_stage 0 or 1");
     }},
    {Verdict::refuse, [](const LayoutFacts& f) { return (f.of(Axis::pp) > 1 || par(f).ep > 1) && !elementwise(f); },
     [](const LayoutFacts& f) {
       return str_cat(f.of(Axis::pp) > 1 ? "parallel.pp > 1" : "parallel.ep > 1", " needs an element-wise optimizer (each "
                      "rank updates its own part of the model), got optim.name = ", optimizer(f));
     }},
    {Verdict::refuse, [](const LayoutFacts& f) { return f.of(Axis::tp) > 1 && !elementwise(f); },
     [](const LayoutFacts& f) {
       return str_cat("tensor parallelism needs an element-wise optimizer (each rank updates its slice), got optim.name = ",
                      optimizer(f));
     }},
    {Verdict::refuse, [](const LayoutFacts& f) { return zero(f) > 0 && reduced(f) && !elementwise(f); },
     [](const LayoutFacts& f) {
       return str_cat("parallel.zero_stage = ", zero(f), " shards at element boundaries and needs an element-wise optimizer "
                      "(sgd, momentum, nesterov, adagrad, rmsprop, adam, adamw, lion), got optim.name = ", optimizer(f));
     }},
    {Verdict::refuse, [](const LayoutFacts& f) { return reduced(f) && keeps_gradients(f); },
     [](const LayoutFacts& f) {
       return str_cat("data parallelism is not supported with optim.name = ", optimizer(f), " (its error feedback lives "
                      "in the gradient buffer, which the all-reduce would average)");
     }},
    {Verdict::refuse, [](const LayoutFacts& f) { return train(f).loss_scaling && keeps_gradients(f); },
     [](const LayoutFacts& f) {
       return str_cat("precision.loss_scaling is not supported with optim.name = ", optimizer(f), " (its error feedback "
                      "lives in the gradient buffer, which unscaling would rescale)");
     }},
    {Verdict::refuse, [](const LayoutFacts& f) { return par(f).compression != Compression::none && zero(f) >= 2 && reduced(f); },
     [](const LayoutFacts& f) {
       return str_cat("parallel.compression = ", enum_name(par(f).compression), " replaces DDP's all-reduce; parallel.zero_stage = ",
                      zero(f), " reduce-scatters instead: use zero_stage 0 or 1");
     }},
    {Verdict::refuse,
     [](const LayoutFacts& f) {
       const PrecisionPolicy p = resolve_policy(train(f).precision);
       return zero(f) == 3 && reduced(f) && (p.param_bf16 || p.master_bf16);
     },
     [](const LayoutFacts&) {
       return std::string("parallel.zero_stage = 3 shards the fp32 parameters; the bf16 weights of precision.param = bf16 "
                          "or precision.master = bf16 are not sharded: use f32 for both");
     }},
    // What the backend runs (Backend::capabilities).
    {Verdict::refuse, [](const LayoutFacts& f) { return !f.backend.model_parallel && model_parallel(f); },
     [](const LayoutFacts& f) {
       return unsupported_on(f, str_cat("parallel.tp = ", f.of(Axis::tp), ", pp = ", f.of(Axis::pp), ", cp = ", f.of(Axis::cp),
                                        ", ep = ", par(f).ep),
                             "it runs data parallelism only so far: parallel.tp, pp, cp and ep must be 1");
     }},
    {Verdict::refuse, [](const LayoutFacts& f) { return !f.backend.mixture_of_experts && moe(f); },
     [](const LayoutFacts& f) {
       return unsupported_on(f, "model.moe_experts > 0 (mixture of experts)", "it lacks the Backend::moe_* ops; use device = \"cpu\"");
     }},
    {Verdict::refuse, [](const LayoutFacts& f) { return !f.backend.latent_attention && mla(f); },
     [](const LayoutFacts& f) {
       return unsupported_on(f, "model.mla_kv_rank > 0 (MLA)", "it lacks the Backend::mla_* ops; use device = \"cpu\"");
     }},
    {Verdict::refuse, [](const LayoutFacts& f) { return !f.backend.zero_sharding && zero(f) > 0 && reduced(f); },
     [](const LayoutFacts& f) {
       return unsupported_on(f, str_cat("parallel.zero_stage = ", zero(f)), "it does not state capabilities().zero_sharding "
                             "(ZeRO's fill / scale_inplace views and sharded collectives); use zero_stage 0");
     }},
    {Verdict::refuse, [](const LayoutFacts& f) { return !f.backend.gradient_compression && par(f).compression != Compression::none; },
     [](const LayoutFacts& f) {
       return unsupported_on(f, str_cat("parallel.compression = ", enum_name(par(f).compression)), "the compressors run on the host");
     }},
    {Verdict::refuse, [](const LayoutFacts& f) { return !f.backend.low_precision && low_precision(f); },
     [](const LayoutFacts& f) {
       return unsupported_on(f, "precision.compute / qat / master / reduce beyond f32 and bf16 GEMMs",
                             "fp16 and fp8 quantize, QAT and bf16 master weights round on the host");
     }},
    {Verdict::refuse,
     [](const LayoutFacts& f) {
       return !f.backend.every_optimizer && !fused_adamw_only(train(f).optim);
     },
     [](const LayoutFacts& f) {
       return unsupported_on(f, str_cat("optim.name = ", optimizer(f)), "its update runs on the host: use adamw");
     }},
    // Keys that do nothing in this layout.
    {Verdict::no_effect, [](const LayoutFacts& f) { return par(f).sequence_parallel && f.of(Axis::tp) == 1; },
     [](const LayoutFacts&) { return std::string("parallel.sequence_parallel has no effect without parallel.tp > 1"); }},
    {Verdict::no_effect, [](const LayoutFacts& f) { return zero(f) > 0 && f.world > 0 && !reduced(f); },
     [](const LayoutFacts& f) {
       return str_cat("parallel.zero_stage = ", zero(f), " has no effect with one data-parallel rank (nothing to shard over)");
     }},
    {Verdict::no_effect, [](const LayoutFacts& f) { return par(f).compression != Compression::none && f.world > 0 && !reduced(f); },
     [](const LayoutFacts& f) {
       return str_cat("parallel.compression = ", enum_name(par(f).compression), " has no effect with one data-parallel rank");
     }},
    // Combinations that run but are measured to cost (docs/parallel.md, "Gradient compression").
    {Verdict::advise,
     [](const LayoutFacts& f) {
       const Compression c = par(f).compression;
       const bool sgd = kind(f) == OptimizerKind::sgd;
       const bool momentum = kind(f) == OptimizerKind::momentum || kind(f) == OptimizerKind::nesterov;
       return reduced(f) && ((c == Compression::dgc && !sgd) || ((c == Compression::topk || c == Compression::onebit) && !sgd && !momentum));
     },
     [](const LayoutFacts& f) {
       return str_cat("parallel.compression = ", enum_name(par(f).compression), " with optim.name = ", optimizer(f), ": ",
                      par(f).compression == Compression::dgc ? "DGC applies the momentum itself and suits optim.name = sgd"
                                                  : "Top-K and 1-bit suit momentum SGD (optim.name = momentum)",
                      "; with AdamW they end well above the uncompressed loss (docs/parallel.md)");
     }},
    {Verdict::no_effect, [](const LayoutFacts& f) { return par(f).cp_attention != CpAttention::ring && f.of(Axis::cp) == 1; },
     [](const LayoutFacts& f) { return str_cat("parallel.cp_attention = ", enum_name(par(f).cp_attention), " has no effect without parallel.cp > 1"); }},
    {Verdict::no_effect,
     [](const LayoutFacts& f) { return (par(f).schedule != PipeScheduleKind::one_f_one_b || par(f).virtual_stages != 1) && f.of(Axis::pp) == 1; },
     [](const LayoutFacts&) {
       return std::string("parallel.schedule and parallel.virtual_stages have no effect without parallel.pp > 1");
     }},
};

}  // namespace

LayoutFacts layout_facts(const LoomConfig& config, int world, const BackendCapabilities& backend,
                         const std::string& backend_name) {
  LayoutFacts f;
  f.config = &config;
  f.world = world;
  f.backend = backend;
  f.backend_name = backend_name;
  const ParallelConfig& p = config.parallel;
  for (auto [axis, value] : {std::pair{Axis::pp, p.pp}, {Axis::tp, p.tp}, {Axis::cp, p.cp}, {Axis::ep, p.ep}}) {
    LOOM_CHECK(value >= 1, "parallel.", axis_name(axis), " must be >= 1, got ", value);
    f.size[static_cast<size_t>(axis)] = static_cast<int>(value);
  }
  LOOM_CHECK(p.dp >= 0, "parallel.dp must be >= 0 (0: the ranks left), got ", p.dp);
  f.data_parallel = 0;
  if (world > 0) {
    const int64_t model_ranks = p.tp * p.pp * p.cp;
    f.data_parallel = p.dp > 0 ? static_cast<int>(p.dp) : static_cast<int>(world / model_ranks);
  }
  f.size[static_cast<size_t>(Axis::dp)] = f.data_parallel > 0 ? f.data_parallel / f.of(Axis::ep) : 1;
  return f;
}

std::vector<std::string> check_layout(const LayoutFacts& facts) {
  std::vector<std::string> notes;
  for (const Rule& rule : kRules) {
    if (!rule.when(facts)) continue;
    if (rule.verdict == Verdict::refuse) throw Error(rule.message(facts));
    notes.push_back(rule.message(facts));
  }
  return notes;
}

ParallelLayout::ParallelLayout(const LoomConfig& config, Communicator& world, Backend& backend)
    : world_(world),
      facts_(layout_facts(config, world.size(), backend.capabilities(), std::string(backend.name()))),
      mesh_((check_layout(layout_facts(config, 0, backend.capabilities(), std::string(backend.name()))),  // sizes alone first
             training_mesh(world.size(), static_cast<int>(config.parallel.dp), static_cast<int>(config.parallel.tp),
                           static_cast<int>(config.parallel.pp), static_cast<int>(config.parallel.cp),
                           static_cast<int>(config.parallel.ep)))) {
  notes_ = check_layout(facts_);
  const ParallelConfig& p = config.parallel;
  // A GPU's groups are split from one communicator over the world that sends device tensors to
  // NCCL and host values (losses, norms, flags) to MPI (comm/nccl_communicator.h): every axis'
  // activations, gradients and parameters go over NCCL.
  Communicator* source = &world;
  if (config.device == DEVICE_CUDA && world.size() > 1) {
    device_ = make_cuda_device_group(world, backend);
    source = device_.get();
  }
  // One communicator per axis of more than one rank; dp's is the whole data-parallel group.
  if (p.tp > 1) groups_[static_cast<size_t>(Axis::tp)] = mesh_group(*source, mesh_, "tp");
  if (p.ep > 1) groups_[static_cast<size_t>(Axis::ep)] = mesh_group(*source, mesh_, "ep");
  if (p.pp > 1) groups_[static_cast<size_t>(Axis::pp)] = mesh_group(*source, mesh_, "pp");
  if (p.cp > 1) groups_[static_cast<size_t>(Axis::cp)] = mesh_group(*source, mesh_, "cp");
  batch_ = reduce_ = source;
  if (p.tp > 1 || p.cp > 1 || p.pp > 1) {
    dp_group_ = mesh_group(*source, mesh_, data_parallel_dims(mesh_));
    batch_ = reduce_ = dp_group_.get();
  }
  if (p.cp > 1) {
    std::vector<std::string> dims = data_parallel_dims(mesh_);
    dims.push_back("cp");
    reduce_group_ = mesh_group(*source, mesh_, dims);
    reduce_ = reduce_group_.get();
  }
  if (p.pp > 1 || p.ep > 1) {
    std::vector<std::string> dims;
    if (p.pp > 1) dims.push_back("pp");
    if (p.ep > 1) dims.push_back("ep");
    owners_ = mesh_group(*source, mesh_, dims);
  }
}

std::vector<std::pair<const char*, Communicator*>> ParallelLayout::communicators() const {
  std::vector<std::pair<const char*, Communicator*>> out = {{"world", &world_}};
  static constexpr const char* kAxisNames[kAxisCount] = {"pp", "dp", "ep", "cp", "tp"};  // (Axis order)
  for (size_t a = 0; a < kAxisCount; ++a) {
    if (groups_[a]) out.emplace_back(kAxisNames[a], groups_[a].get());
  }
  if (dp_group_) out.emplace_back("dp", dp_group_.get());
  if (reduce_group_) out.emplace_back("reduce", reduce_group_.get());
  if (owners_) out.emplace_back("owners", owners_.get());
  if (device_) out.emplace_back("device", device_.get());
  return out;
}

std::string ParallelLayout::describe(int64_t batch_size, int64_t grad_accum, int64_t seq_len) const {
  return str_cat("mesh ", mesh_.describe(), "; data parallel: ", batch_->size(), " ranks (MPI), ", batch_size,
                 " sequences per rank per micro-batch, global batch ", batch_size * grad_accum * batch_->size(), " x ",
                 seq_len, " tokens");
}

}  // namespace loom
