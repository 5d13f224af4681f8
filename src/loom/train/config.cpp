#include "loom/train/config.h"

#include "loom/train/objective.h"

#include <cmath>
#include <charconv>
#include <filesystem>
#include <limits>
#include <sstream>
#include <variant>

// toml++ trips GCC 12's -Warray-bounds false positives inside its own headers.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Warray-bounds"
#include <toml++/toml.h>
#pragma GCC diagnostic pop

#include "loom/core/error.h"
#include "loom/core/utf8.h"
#include "loom/train/layout.h"

namespace loom {

namespace {

// One schema entry: a key bound to a typed field of a LoomConfig, with its meaning (one line,
// for `loom train --help` and docs/config.md; string keys name their accepted values).
// TriBool: a boolean that may be left to the optimizer's default (-1 unset, 0, 1).
struct TriBool {
  int64_t* value;
};
// An enum field (core/enum_names.h): a TOML string parsed into the enum at load.
struct EnumRef {
  void* field;
  void (*parse)(void* field, std::string_view name, std::string_view key);  // parse_enum: throws naming key
  std::string_view (*name)(const void* field);                              // enum_name
};
template <class E>
EnumRef enum_ref(E* field) {
  return {field, [](void* f, std::string_view name, std::string_view key) { *static_cast<E*>(f) = parse_enum<E>(name, key); },
          [](const void* f) { return enum_name(*static_cast<const E*>(f)); }};
}
using Target = std::variant<int64_t*, uint64_t*, double*, float*, std::string*, Arch*, bool*, TriBool, EnumRef>;

struct Binding {
  std::string key;
  Target target;
  const char* meaning;
};

std::vector<Binding> bindings(LoomConfig& c) {
  // Top-level keys first: TOML puts them before any [table]. The model's keys come from its
  // schema (arch/config.h), the one list checkpoints also read.
  std::vector<Binding> out = {{"device", enum_ref(&c.device), "the backend: cpu | cuda (a CUDA build and a visible GPU)"}};
  visit_model_fields(c.model, [&](const ModelField& f, auto& value) {
    using T = std::decay_t<decltype(value)>;
    if constexpr (kModelEnum<T>) {
      out.push_back({model_field_key(f), enum_ref(&value), f.meaning});
    } else {
      out.push_back({model_field_key(f), &value, f.meaning});
    }
  });
  std::vector<Binding> rest = {
      // After the model's peft.* keys (the last of its schema): one [peft] table.
      {"peft.adapter", &c.loop.peft_adapter, "a PEFT LoRA adapter folder (adapter_config.json + adapter_model.safetensors) loaded onto the weights; its config sets peft.*"},
      {"train.batch_size", &c.train.batch_size, "sequences per micro-batch on each data-parallel rank (global batch: x grad_accum x dp)"},
      {"train.seq_len", &c.train.seq_len, "tokens per training sequence (<= model.max_seq_len)"},
      {"train.grad_accum", &c.train.grad_accum, "micro-batches per optimizer step (with parallel.pp > 1: the pipeline's micro-batches)"},
      {"train.recompute", &c.train.recompute, "activation checkpointing: none | selective | full | every:K | budget (train.recompute_budget_mb)"},
      {"train.device_budget_mb", &c.train.device_budget_mb, "> 0: the device memory after setup must fit in this many MiB, else the run is refused naming remedies; 0 = no check"},
      {"train.recompute_budget_mb", &c.train.recompute_budget_mb, "train.recompute = budget: MiB of the blocks' kept activations per micro-batch"},
      {"train.offload_activations", &c.train.offload_activations, "keep the checkpointed blocks' saved activations in host memory between forward and backward (needs train.recompute != none)"},
      {"train.flash_attention", &c.train.flash_attention, "FlashAttention: keep each row's log-sum-exp instead of the (B,H,T,T) probabilities (not with parallel.cp/pp > 1 or MLA)"},
      {"train.steps", &c.train.steps, "optimizer steps of the run (and the length of the LR schedule)"},
      {"train.seed", &c.loop.seed, "seed of the weight initialisation and the data order"},
      {"train.objective", &c.loop.objective, objective_names_help().c_str()},
      {"train.init_from", &c.loop.init_from, "start from these weights (a Loom checkpoint or run folder, or a Hugging Face model folder) instead of a random init; fresh optimizer, schedule and data position; the model is the weights'"},
      {"train.eval_every", &c.loop.eval_every, "steps between validation evaluations; 0 = only at the end"},
      {"train.eval_batches", &c.loop.eval_batches, "validation batches per evaluation"},
      {"train.checkpoint_every", &c.loop.checkpoint_every, "steps between checkpoints; 0 = only at the end"},
      {"train.save_checkpoints", &c.loop.save_checkpoints, "false: write no checkpoint at all, not even the last (a stopped or preempted run cannot resume)"},
      {"train.keep_checkpoints", &c.loop.keep_checkpoints, "newest checkpoints kept in the run folder (older ones are deleted)"},
      {"train.log_every", &c.loop.log_every, "steps between progress lines when stdout is not a terminal"},
      {"train.async_checkpoint", &c.loop.async_checkpoint, "write checkpoints from a host snapshot in a background thread while training continues (one in flight)"},
      {"train.stop_on_save_error", &c.loop.stop_on_save_error, "a failed checkpoint save (e.g. a full disk) stops the run; false: report it and keep training"},
      {"train.on_anomaly", enum_ref(&c.train.anomaly.policy), "a non-finite or spiking loss: stop (before the update) | skip (no update, the batch recorded) | rollback (skip, and go back to the last checkpoint)"},
      {"train.spike_zscore", &c.train.anomaly.spike_zscore, "> 0: a loss this many standard deviations above the mean of the last train.spike_window steps is a spike; 0 = off"},
      {"train.spike_window", &c.train.anomaly.spike_window, "steps in the spike detector's moving window"},
      {"train.inject_fault_step", &c.train.anomaly.fault_step, "testing: >= 0 poisons this step's loss and gradients (train.inject_fault); -1 = off"},
      {"train.inject_fault", enum_ref(&c.train.anomaly.fault), "testing: nan (the loss and gradients NaN) | spike (multiplied by 100)"},
      {"train.watchdog_seconds", &c.loop.watchdog_seconds, "> 0: a step without progress for this long (a stopped or hung rank) ends the job naming the silent ranks; 0 = off"},
      {"train.memory_check", &c.loop.memory_check, "refuse a run whose estimated memory exceeds the machine's available memory (CPU)"},
      {"train.trace", &c.loop.trace, "write a Chrome/Perfetto trace per rank to <run>/trace/rank<N>.json (forward, backward, collectives with bytes, optimizer, checkpoint, data)"},
      // docs/optimizers.md: the rules, their defaults (-1 = the optimizer's own) and the schedules.
      {"optim.name", &c.train.optim.name, "sgd | momentum | nesterov | adagrad | rmsprop | adam | adamw | adafactor | sm3 | lion | adam-mini | came | ldadam | muon"},
      {"optim.offload", &c.train.optim.offload, "ZeRO-Offload: the optimizer state lives in host memory and the update runs on the CPU"},
      {"optim.lr", &c.train.schedule.max_lr, "peak learning rate (the schedule's maximum)"},
      {"optim.min_lr", &c.train.schedule.min_lr, "learning rate at the end of the schedule's decay"},
      {"optim.schedule", enum_ref(&c.train.schedule.kind), "LR schedule: constant | linear | cosine | wsd | step | exponential | inverse_sqrt"},
      {"optim.warmup_steps", &c.train.schedule.warmup, "steps of linear warm-up to optim.lr"},
      {"optim.decay_fraction", &c.train.schedule.decay_fraction, "wsd: share of the steps spent decaying"},
      {"optim.wsd_shape", enum_ref(&c.train.schedule.wsd_shape), "wsd decay shape: linear | sqrt | cosine"},
      {"optim.step_size", &c.train.schedule.step_size, "step schedule: steps between decays"},
      {"optim.gamma", &c.train.schedule.gamma, "step, exponential schedules: decay factor in (0, 1]"},
      {"optim.grad_clip", &c.train.grad_clip, "clip the global gradient norm to this value; <= 0 = off"},
      {"optim.weight_decay", &c.train.optim.weight_decay, "weight decay; -1 = the optimizer's default (adamw 0.01, adam-mini 0.1, others 0)"},
      {"optim.no_decay", &c.train.optim.no_decay, "comma-separated globs of parameter names that get no weight decay"},
      {"optim.lr_scale", &c.train.optim.lr_scale, "comma-separated glob=factor learning-rate multipliers, the first match wins (e.g. wte.*=0.5)"},
      {"optim.beta1", &c.train.optim.beta1, "first-moment decay (Adam family, Lion, CAME, LDAdam, Adafactor, Muon's AdamW part); -1 = the optimizer's default"},
      {"optim.beta2", &c.train.optim.beta2, "second-moment decay (RMSprop's alpha); -1 = the optimizer's default"},
      {"optim.beta3", &c.train.optim.beta3, "CAME: decay of the confidence estimate; -1 = the optimizer's default (0.9999)"},
      {"optim.eps", &c.train.optim.eps, "epsilon of the update's denominator; -1 = the optimizer's default"},
      {"optim.eps2", &c.train.optim.eps2, "Adafactor: floor of the parameter scale; CAME: epsilon of the confidence; -1 = the optimizer's default"},
      {"optim.momentum", &c.train.optim.momentum, "momentum (SGD, RMSprop, Muon); -1 = the optimizer's default"},
      {"optim.dampening", &c.train.optim.dampening, "SGD: dampening of the momentum buffer"},
      {"optim.nesterov", TriBool{&c.train.optim.nesterov}, "Nesterov momentum (SGD, Muon): true | false | -1 = the optimizer's default"},
      {"optim.centered", &c.train.optim.centered, "RMSprop: centered (divide by the estimated variance)"},
      {"optim.amsgrad", &c.train.optim.amsgrad, "Adam, AdamW: AMSGrad (the running maximum of the second moment)"},
      {"optim.lr_decay", &c.train.optim.lr_decay, "Adagrad: step size lr / (1 + (t-1) lr_decay)"},
      {"optim.initial_accumulator", &c.train.optim.initial_accumulator, "Adagrad: initial value of the squared-gradient sum"},
      {"optim.relative_step", &c.train.optim.relative_step, "Adafactor: relative step min(1e-2, 1/sqrt(t)) instead of the schedule's lr"},
      {"optim.scale_parameter", &c.train.optim.scale_parameter, "Adafactor: scale the step by the parameter's RMS"},
      {"optim.warmup_init", &c.train.optim.warmup_init, "Adafactor: warm the relative step up, min(1e-6 t, 1/sqrt(t))"},
      {"optim.clip_threshold", &c.train.optim.clip_threshold, "Adafactor, CAME: cap on the RMS of the update"},
      {"optim.decay_rate", &c.train.optim.decay_rate, "Adafactor: second-moment decay 1 - t^decay_rate"},
      {"optim.rank", &c.train.optim.rank, "LDAdam: rank of the projected optimizer state"},
      {"optim.rho", &c.train.optim.rho, "LDAdam: weight of the previous momentum in the subspace update (rho b + (1 - rho) G)"},
      {"optim.ns_steps", &c.train.optim.ns_steps, "Muon: Newton-Schulz iterations"},
      {"optim.muon_scale", &c.train.optim.muon_scale, "Muon update scale: moonshot (0.2 sqrt(max(rows, cols)), AdamW's update RMS) | keller (sqrt(max(1, rows/cols)))"},
      {"precision.compute", &c.train.precision.compute, "recipe of every linear layer not set below: f32 | bf16 | fp16 | fp8-delayed | fp8-current | fp8-block"},
      {"precision.attn_qkv", &c.train.precision.attn_qkv, "recipe of the attention QKV projections (values as precision.compute); \"\" = precision.compute"},
      {"precision.attn_out", &c.train.precision.attn_out, "recipe of the attention output projections; \"\" = precision.compute"},
      {"precision.mlp_in", &c.train.precision.mlp_in, "recipe of the MLP input projections; \"\" = precision.compute"},
      {"precision.mlp_out", &c.train.precision.mlp_out, "recipe of the MLP output projections; \"\" = precision.compute"},
      {"precision.head", &c.train.precision.head, "recipe of the output head; \"\" = precision.compute (bf16 when that is fp8)"},
      {"precision.param", &c.train.precision.param, "weight copy the linears read: f32 | bf16; \"\" = bf16 with bf16 compute, else f32"},
      {"precision.reduce", &c.train.precision.reduce, "dtype gradients are reduced in (across micro-batches and ranks): f32 | bf16"},
      {"precision.master", &c.train.precision.master, "master weights: f32 | bf16 (no fp32 master: weights rounded to bf16 after each update)"},
      {"precision.stochastic_rounding", &c.train.precision.stochastic_rounding, "precision.master = bf16: round stochastically instead of to nearest"},
      {"precision.activations", &c.train.precision.activations, "dtype of the saved activations bf16 linear layers read (their inputs, exact in bf16; the attention output's backward then reads it in bf16) and of the output gradients its bf16 GEMMs read (the MLP's first layer's; the output projection's and fc2's, a bf16 copy of the residual stream's gradient): bf16 | f32"},
      {"precision.attention", &c.train.precision.attention, "dtype attention's GEMMs (QK^T, PV and their backward) multiply in: f32 | bf16 (operands rounded, fp32 accumulation; the plain and the flash attention without a window: flash's on the CUDA backend's tensor cores)"},
      {"precision.outputs", &c.train.precision.outputs, "dtype of the GEMM outputs autocast returns in bf16 that Loom keeps so (the training loss's logits under a bf16 head, the MLP's first layer's output under a bf16 mlp_in): bf16 (written rounded, read widened) | f32"},
      {"precision.qat", &c.train.precision.qat, "quantization-aware training of the block linears' weights: none | mxfp4 | nvfp4"},
      {"precision.fp8_margin", &c.train.precision.fp8.margin, "fp8 recipes: scale so the amax lands 2^margin below the format's max"},
      {"precision.fp8_amax_history", &c.train.precision.fp8.amax_history, "fp8-delayed: steps of amax history"},
      {"precision.fp8_amax_compute", &c.train.precision.fp8.amax_compute, "fp8-delayed: amax from the history: max | most_recent"},
      {"precision.fp8_backward", &c.train.precision.fp8.backward, "fp8 gradient format: e5m2 | e4m3; \"\" = the recipe's (delayed/current: e5m2, block: e4m3)"},
      {"precision.loss_scaling", &c.train.loss_scaling, "dynamic loss scaling (GradScaler): scale the loss, skip steps with inf/NaN gradients"},
      {"precision.init_scale", &c.train.loss_scaler.init_scale, "loss scaling: initial scale"},
      {"precision.growth_factor", &c.train.loss_scaler.growth_factor, "loss scaling: factor on the scale after growth_interval clean steps"},
      {"precision.backoff_factor", &c.train.loss_scaler.backoff_factor, "loss scaling: factor on the scale after an overflow"},
      {"precision.growth_interval", &c.train.loss_scaler.growth_interval, "loss scaling: clean steps before the scale grows"},
      {"precision.hysteresis", &c.train.loss_scaler.hysteresis, "loss scaling: consecutive overflows tolerated before a backoff"},
      {"parallel.dp", &c.parallel.dp, "data-parallel ranks; 0 = all the ranks the model-parallel sizes leave"},
      {"parallel.tp", &c.parallel.tp, "tensor-parallel ranks"},
      {"parallel.pp", &c.parallel.pp, "pipeline-parallel stages (micro-batches: train.grad_accum)"},
      {"parallel.cp", &c.parallel.cp, "context-parallel ranks (each sequence split over them)"},
      {"parallel.ep", &c.parallel.ep, "expert parallel: MoE experts split over ep of the data-parallel ranks"},
      {"parallel.sequence_parallel", &c.parallel.sequence_parallel, "with tp > 1: norms and the residual stream on sequence shards"},
      {"parallel.cp_attention", enum_ref(&c.parallel.cp_attention), "with cp > 1: ring | ulysses"},
      {"parallel.schedule", enum_ref(&c.parallel.schedule), "pipeline schedule with pp > 1: gpipe | 1f1b | interleaved | zb-h1"},
      {"parallel.virtual_stages", &c.parallel.virtual_stages, "model chunks per pipeline rank (interleaved: >= 2)"},
      {"parallel.bucket_mb", &c.parallel.bucket_mb, "DDP gradient bucket size in MiB (PyTorch's bucket_cap_mb)"},
      {"parallel.overlap", &c.parallel.overlap, "DDP: start each bucket's all-reduce during backward"},
      {"parallel.zero_stage", &c.parallel.zero_stage, "0 = DDP; 1, 2, 3 = ZeRO: optimizer state; + gradients; + parameters sharded"},
      {"parallel.compression", enum_ref(&c.parallel.compression), "gradient compression on the DDP path: none | topk | dgc | onebit | qsgd | powersgd"},
      {"parallel.topk_ratio", &c.parallel.topk_ratio, "topk, dgc: (final) fraction of the gradient elements sent"},
      {"parallel.qsgd_levels", &c.parallel.qsgd_levels, "qsgd: quantization levels"},
      {"parallel.powersgd_rank", &c.parallel.powersgd_rank, "powersgd: rank of the low-rank approximation"},
      {"parallel.dgc_momentum", &c.parallel.dgc_momentum, "dgc: momentum correction (use it with optim.name = sgd)"},
      {"parallel.dgc_clip", &c.parallel.dgc_clip, "dgc: local gradient clipping threshold; <= 0 = off"},
      {"parallel.dgc_warmup_steps", &c.parallel.dgc_warmup_steps, "dgc: steps of sparsity warm-up"},
      {"parallel.compression_warmup", &c.parallel.compression_warmup, "steps of uncompressed all-reduce before parallel.compression takes over"},
      {"dpo.loss", enum_ref(&c.dpo.loss), "train.objective = dpo: sigmoid (DPO) | ipo (IPO) | simpo (SimPO: length-normalised, no reference)"},
      {"dpo.beta", &c.dpo.beta, "train.objective = dpo: beta, the strength of the reference (sigmoid, simpo) or 1/(2 beta) the target margin (ipo)"},
      {"dpo.gamma", &c.dpo.gamma, "dpo.loss = simpo: the target reward margin gamma"},
      {"dpo.reference", enum_ref(&c.dpo.reference), "train.objective = dpo: once (every pair's reference log-probabilities before training) | live (each micro-batch's, from the base with LoRA's adapters off, or a frozen copy of the initial weights)"},
      {"distill.teacher", &c.distill.teacher, "train.objective = distill: the teacher's checkpoint (a Loom run, step or quantized folder, or a Hugging Face folder) with the student's tokenizer"},
      {"distill.temperature", &c.distill.temperature, "train.objective = distill: the softmax temperature T of both distributions (the KL term is scaled by T^2)"},
      {"distill.alpha", &c.distill.alpha, "train.objective = distill: the weight of the KL term; 1 - alpha weighs the next-token cross-entropy"},
      {"orpo.beta", &c.orpo.beta, "train.objective = orpo: lambda, the weight of the odds-ratio term beside the chosen completions' NLL (TRL's beta)"},
      {"kto.beta", &c.kto.beta, "train.objective = kto: beta, the strength of the reference in the value function"},
      {"kto.desirable_weight", &c.kto.desirable_weight, "train.objective = kto: lambda_D, the weight of desirable examples' losses"},
      {"kto.undesirable_weight", &c.kto.undesirable_weight, "train.objective = kto: lambda_U, the weight of undesirable examples' losses"},
      {"grpo.group", &c.grpo.group, "train.objective = grpo: completions sampled per prompt (G; train.batch_size must be a multiple)"},
      {"grpo.max_new_tokens", &c.grpo.max_new_tokens, "train.objective = grpo: the longest completion"},
      {"grpo.temperature", &c.grpo.temperature, "train.objective = grpo: the rollouts' sampling temperature"},
      {"grpo.beta", &c.grpo.beta, "train.objective = grpo: weight of the KL term to the reference (the initial weights); 0 = no reference model"},
      {"grpo.epsilon", &c.grpo.epsilon, "train.objective = grpo: the clipping range of the probability ratio"},
      {"grpo.reward_command", &c.grpo.reward_command, "train.objective = grpo: a shell command reading {prompt, completion, answer} JSON lines, printing one reward per line; \"\" = the built-in exact-answer reward"},
      {"data.dir", &c.data.dir, "folder of the token shards `loom prepare` writes and `loom train` reads"},
      {"data.tokenizer", &c.data.tokenizer, "gpt2 | byte | bpe:N (learned by `loom prepare`) | a folder with encoder.json and vocab.bpe"},
      {"data.input", &c.data.input, "text file `loom prepare` tokenizes; \"\" = the default corpus (Debian's fortunes)"},
      {"data.format", enum_ref(&c.data.format), "what `loom prepare` reads in data.input: text | chat-jsonl (conversations; only the assistant's tokens count) | jsonl (prompt/completion; the completion counts)"},
      {"data.document_mask", &c.data.document_mask, "packed documents: each attends only within itself and its positions restart (documents end at the tokenizer's end-of-text token)"},
      {"data.val_fraction", &c.data.val_fraction, "share of the tokens held out for validation, in (0, 1)"},
      {"run.dir", &c.run.dir, "parent folder of the run folders"},
      {"run.name", &c.run.name, "the run's folder: <run.dir>/<run.name>"},
      {"sample.prompt", &c.sample.prompt, "prompt of the sample printed after training (and loom generate's default)"},
      {"sample.max_new_tokens", &c.sample.max_new_tokens, "tokens sampled after training, 0 = none (and loom generate's default)"},
      {"sample.temperature", &c.sample.sampling.temperature, "sampling temperature; 0 = greedy"},
      {"sample.top_k", &c.sample.sampling.top_k, "sample among the k most likely tokens; 0 = no limit"},
      {"sample.top_p", &c.sample.sampling.top_p, "nucleus sampling: the smallest set of tokens with probability >= p; 1 = no limit"},
      {"sample.seed", &c.sample.sampling.seed, "seed of the sampler"},
  };
  out.insert(out.end(), rest.begin(), rest.end());
  return out;
}

std::string type_name(const toml::node& node) {
  switch (node.type()) {
    case toml::node_type::string: return "a string";
    case toml::node_type::integer: return "an integer";
    case toml::node_type::floating_point: return "a float";
    case toml::node_type::boolean: return "a boolean";
    case toml::node_type::table: return "a table";
    case toml::node_type::array: return "an array";
    default: return "a date/time";
  }
}

void assign(const Binding& b, const toml::node& node, const std::string& origin) {
  auto wrong = [&](const char* expected) {
    return Error(str_cat(origin, ": key '", b.key, "' expects ", expected, ", got ", type_name(node)));
  };
  std::visit(
      [&](auto target) {
        using P = decltype(target);
        if constexpr (std::is_same_v<P, EnumRef>) {
          if (!node.is_string()) throw wrong("a string");
          try {
            target.parse(target.field, node.as_string()->get(), str_cat("key '", b.key, "'"));
          } catch (const Error& e) {
            throw Error(str_cat(origin, ": ", e.what()));
          }
          return;
        } else if constexpr (std::is_same_v<P, TriBool>) {
          if (node.is_boolean()) *target.value = node.as_boolean()->get() ? 1 : 0;
          else if (node.is_integer() && node.as_integer()->get() == -1) *target.value = -1;
          else throw wrong("a boolean (or -1 for the optimizer's default)");
          return;
        } else if constexpr (std::is_same_v<P, bool*>) {
          if (!node.is_boolean()) throw wrong("a boolean");
          *target = node.as_boolean()->get();
          return;
        } else {
        auto* field = target;
        using T = std::remove_pointer_t<decltype(field)>;
        if constexpr (std::is_same_v<T, int64_t> || std::is_same_v<T, uint64_t>) {
          if (!node.is_integer()) throw wrong("an integer");
          const int64_t v = node.as_integer()->get();
          if (std::is_same_v<T, uint64_t> && v < 0) throw Error(str_cat(origin, ": key '", b.key, "' must be >= 0"));
          *field = static_cast<T>(v);
        } else if constexpr (std::is_same_v<T, double> || std::is_same_v<T, float>) {
          double v = 0.0;
          if (node.is_floating_point()) v = node.as_floating_point()->get();
          else if (node.is_integer()) v = static_cast<double>(node.as_integer()->get());
          else throw wrong("a number");
          // No key means anything by inf or nan (TOML spells both): refused here, by name, instead
          // of surfacing steps later as a non-finite loss.
          if (!std::isfinite(v)) throw Error(str_cat(origin, ": key '", b.key, "' expects a finite number, got ", v));
          // A float key holds a 32-bit float: a larger magnitude would become inf when stored,
          // which the config's own text (config_to_toml) could then not be read back from.
          // (IEEE rounding: a value within half an ulp above the largest float still rounds to it.)
          if (std::is_same_v<T, float> && !std::isfinite(static_cast<float>(v)))
            throw Error(str_cat(origin, ": key '", b.key, "' expects a number of magnitude at most ",
                                std::numeric_limits<float>::max(), " (a 32-bit float), got ", v));
          *field = static_cast<T>(v);
        } else if constexpr (std::is_same_v<T, std::string>) {
          if (!node.is_string()) throw wrong("a string");
          *field = node.as_string()->get();
        } else {
          if (!node.is_string()) throw wrong("a string (gpt2 or llama)");
          try {
            *field = arch_from_name(node.as_string()->get());
          } catch (const Error& e) {
            throw Error(str_cat(origin, ": ", e.what()));
          }
        }
        }
      },
      b.target);
}

void set_key(LoomConfig& config, const std::string& key, const toml::node& node, const std::string& origin) {
  for (const Binding& b : bindings(config)) {
    if (b.key == key) return assign(b, node, origin);
  }
  throw Error(str_cat(origin, ": unknown config key '", key, "' (see `loom train --help` for the keys)"));
}

bool is_string_key(LoomConfig& config, const std::string& key) {
  for (const Binding& b : bindings(config)) {
    if (b.key == key) {
      return std::holds_alternative<std::string*>(b.target) || std::holds_alternative<Arch*>(b.target) ||
             std::holds_alternative<EnumRef>(b.target);
    }
  }
  return false;
}

// Walks nested tables, setting every leaf "a.b" it finds.
void apply_table(LoomConfig& config, const toml::table& table, const std::string& prefix, const std::string& origin) {
  for (const auto& [k, node] : table) {
    const std::string key = prefix.empty() ? std::string(k.str()) : prefix + "." + std::string(k.str());
    if (const toml::table* sub = node.as_table()) apply_table(config, *sub, key, origin);
    else set_key(config, key, node, origin);
  }
}

std::string toml_string(const std::string& s) {
  std::ostringstream out;
  out << toml::value<std::string>(s);
  return out.str();
}

// Shortest text that reads back as the same float/double, always with a '.' or exponent (a TOML float).
template <typename T>
std::string toml_float(T v) {
  char buffer[64];
  const auto result = std::to_chars(buffer, buffer + sizeof buffer, v);
  std::string text(buffer, result.ptr);
  if (text.find_first_of(".eEn") == std::string::npos) text += ".0";
  return text;
}

// The value a binding points at, as TOML text.
std::string toml_value(const Target& target) {
  return std::visit(
      [](auto t) -> std::string {
        using P = decltype(t);
        if constexpr (std::is_same_v<P, EnumRef>) {
          return toml_string(std::string(t.name(t.field)));
        } else if constexpr (std::is_same_v<P, TriBool>) {
          return *t.value < 0 ? "-1" : *t.value ? "true" : "false";
        } else {
          using T = std::remove_pointer_t<P>;
          if constexpr (std::is_same_v<T, bool>) return *t ? "true" : "false";
          else if constexpr (std::is_same_v<T, std::string>) return toml_string(*t);
          else if constexpr (std::is_same_v<T, Arch>) return toml_string(std::string(arch_name(*t)));
          else if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double>) return toml_float(*t);
          else return std::to_string(static_cast<int64_t>(*t));
        }
      },
      target);
}

// The schema's name for a binding's type (docs/config.md's "type" column).
std::string schema_type(const Target& target) {
  return std::visit(
      [](auto t) -> std::string {
        using P = decltype(t);
        if constexpr (std::is_same_v<P, EnumRef>) {
          return "string";  // a TOML string, one of the names the meaning lists
        } else if constexpr (std::is_same_v<P, TriBool>) {
          return "tri-bool";
        } else {
          using T = std::remove_pointer_t<P>;
          if constexpr (std::is_same_v<T, bool>) return "bool";
          else if constexpr (std::is_same_v<T, std::string>) return "string";
          else if constexpr (std::is_same_v<T, Arch>) return "arch";
          else if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double>) return "float";
          else if constexpr (std::is_same_v<T, uint64_t>) return "uint";
          else return "int";
        }
      },
      target);
}

// A Markdown table cell: '|' escaped so it does not end the cell.
std::string md_cell(const std::string& text) {
  std::string out;
  for (const char ch : text) {
    if (ch == '|') out += '\\';
    out += ch;
  }
  return out;
}

}  // namespace

void LoomConfig::validate() const {
  model.validate();
  train.validate();
  sample.sampling.validate();
  LOOM_CHECK(parallel.zero_stage >= 0 && parallel.zero_stage <= 3, "parallel.zero_stage must be 0, 1, 2 or 3, got ",
             parallel.zero_stage);
  LOOM_CHECK(parallel.bucket_mb > 0.0, "parallel.bucket_mb must be > 0, got ", parallel.bucket_mb);
  LOOM_CHECK(parallel.ep >= 1, "parallel.ep must be >= 1, got ", parallel.ep);
  // Every combination of parallelisms, model features, precision and optimizer: the layout's
  // compatibility table (train/layout.cpp), here without the world size or the backend (the
  // layout checks those when the run starts).
  (void)check_layout(layout_facts(*this, 0, kEveryCapability, "cpu"));
  LOOM_CHECK(train.seq_len <= model.max_seq_len, "train.seq_len (", train.seq_len, ") must be <= model.max_seq_len (",
             model.max_seq_len, ")");
  LOOM_CHECK(loop.eval_every >= 0 && loop.checkpoint_every >= 0 && loop.log_every >= 1 && loop.eval_batches >= 1,
             "train.eval_every and train.checkpoint_every must be >= 0, train.log_every and train.eval_batches >= 1");
  LOOM_CHECK(loop.keep_checkpoints >= 1, "train.keep_checkpoints must be >= 1, got ", loop.keep_checkpoints);
  LOOM_CHECK(loop.watchdog_seconds >= 0.0, "train.watchdog_seconds must be >= 0 (0 = off), got ", loop.watchdog_seconds);
  LOOM_CHECK(train.anomaly.policy != AnomalyPolicy::rollback || (loop.checkpoint_every > 0 && loop.save_checkpoints),
             "train.on_anomaly = rollback goes back to the last checkpoint: set train.checkpoint_every > 0 and "
             "train.save_checkpoints = true");
  LOOM_CHECK(data.val_fraction > 0.0 && data.val_fraction < 1.0, "data.val_fraction must be in (0, 1), got ",
             data.val_fraction);
  LOOM_CHECK(sample.max_new_tokens >= 0, "sample.max_new_tokens must be >= 0, got ", sample.max_new_tokens);
  validate_objective();
  LOOM_CHECK(!run.name.empty() && run.name.find('/') == std::string::npos, "run.name must be a non-empty folder name, got '",
             run.name, "'");
}

void LoomConfig::validate_objective() const {
  const ObjectiveRow& row = objective_row(loop.objective);  // (an unknown name: refused naming the known ones)
  row.check(*this);
  check_objective_format(*this);
}

void apply_config_file(LoomConfig& config, const std::string& path) {
  // A directory or a device (/dev/zero) is not a config: refused before the parser reads it.
  std::error_code ec;
  LOOM_CHECK(std::filesystem::is_regular_file(path, ec), path, ": not a config file (expected a TOML file)");
  const uintmax_t size = std::filesystem::file_size(path, ec);
  LOOM_CHECK(!ec && size <= kMaxConfigBytes, path, ": ", size, " bytes, more than a config file's limit of ",
             kMaxConfigBytes, " bytes");
  toml::table table;
  try {
    table = toml::parse_file(path);
  } catch (const toml::parse_error& e) {
    const auto& where = e.source().begin;
    throw Error(str_cat(path, ":", where.line, ":", where.column, ": ", e.description()));
  }
  apply_table(config, table, "", path);
}

void apply_config_text(LoomConfig& config, const std::string& text, const std::string& origin) {
  toml::table table;
  try {
    table = toml::parse(text, origin);
  } catch (const toml::parse_error& e) {
    throw Error(str_cat(origin, ":", e.source().begin.line, ": ", e.description()));
  }
  apply_table(config, table, "", origin);
}

void apply_overrides(LoomConfig& config, const std::string& assignments, const std::string& origin) {
  // Split at commas outside double quotes, so a quoted list stays one value:
  // --set 'optim.no_decay="*.bias,*norm*"'.
  std::vector<std::string> items(1);
  bool quoted = false;
  for (size_t i = 0; i < assignments.size(); ++i) {
    const char ch = assignments[i];
    if (ch == '"' && (i == 0 || assignments[i - 1] != '\\')) quoted = !quoted;
    if (ch == ',' && !quoted) items.emplace_back();
    else items.back() += ch;
  }
  for (const std::string& item : items) {
    if (item.empty()) continue;
    const size_t eq = item.find('=');
    LOOM_CHECK(eq != std::string::npos && eq > 0, origin, ": expected key=value, got '", item, "'");
    const std::string key = item.substr(0, eq), value = item.substr(eq + 1);
    // A bare word is kept as written, so it must be text config_to_toml can write back.
    LOOM_CHECK(valid_utf8(value) == value, origin, ": the value of '", key, "' is not valid UTF-8");
    toml::table parsed;
    try {
      parsed = toml::parse("v = " + value);
    } catch (const toml::parse_error&) {
      parsed = toml::table{{"v", value}};  // a bare word is a string: --set data.dir=data/x
    }
    // For string keys the text itself is the value unless it is a quoted TOML string, so
    // run.name=nan or data.dir=1e3 stay the strings they look like.
    if (is_string_key(config, key) && !parsed.get("v")->is_string()) parsed = toml::table{{"v", value}};
    set_key(config, key, *parsed.get("v"), origin);
  }
}

std::string config_to_toml(const LoomConfig& c) {
  LoomConfig copy = c;
  std::ostringstream out;
  std::string section;
  for (const Binding& b : bindings(copy)) {
    const size_t dot = b.key.find('.');  // no dot: a top-level key (listed first, before any table)
    const std::string sec = dot == std::string::npos ? "" : b.key.substr(0, dot), name = b.key.substr(dot + 1);
    if (sec != section) {
      out << (section.empty() ? "" : "\n") << "[" << sec << "]\n";
      section = sec;
    }
    out << name << " = " << toml_value(b.target) << "\n";
  }
  return out.str();
}

std::vector<std::string> config_keys() {
  LoomConfig c;
  std::vector<std::string> keys;
  for (const Binding& b : bindings(c)) keys.push_back(b.key);
  return keys;
}

std::string config_key_section(const std::string& key) {
  const size_t dot = key.find('.');
  return dot == std::string::npos ? "" : key.substr(0, dot);
}

std::vector<ConfigKey> config_schema() {
  LoomConfig c;
  std::vector<ConfigKey> rows;
  for (const Binding& b : bindings(c)) rows.push_back({b.key, schema_type(b.target), toml_value(b.target), b.meaning});
  return rows;
}

std::string config_markdown() {
  std::ostringstream out;
  out << "# Configuration keys\n"
         "\n"
         "Generated from the schema in src/loom/train/config.cpp; do not edit by hand. Regenerate with\n"
         "`build/bin/loom config --markdown > docs/config.md` (tests/test_config.cpp fails when this file\n"
         "is stale).\n"
         "\n"
         "Every key a run's configuration can set, as `section.key`: in a TOML file (`--config FILE`,\n"
         "`[section]` tables) or on the command line (`--set section.key=value,...`). An unknown key or a\n"
         "value of the wrong type is an error naming the key. `loom train --help` prints the same list.\n"
         "\n"
         "**Defaults** are the code's: the values of a default-constructed `LoomConfig`. Every command\n"
         "that reads a config (`loom train`, `prepare`, `memory`, `plan`, `config`) first applies\n"
         "`configs/default.toml` on top of them (the default run: a small GPT-2 on Debian's fortunes),\n"
         "then `--config FILE`, then every `--set`. `loom config [--config FILE] [--set ...]` prints the\n"
         "resolved values; a run writes them to `runs/<run.name>/config.toml`.\n"
         "\n"
         "**Types**: `int` (64-bit), `uint` (64-bit, >= 0), `float` (a TOML float or integer), `string`,\n"
         "`bool` (`true` / `false`), `arch` (the string `gpt2` or `llama`), `tri-bool` (`true`, `false`\n"
         "or `-1` for the optimizer's own default). In `--set`, a value of a string key is taken as\n"
         "written unless it is a quoted TOML string.\n";
  std::string section = "-";
  for (const ConfigKey& row : config_schema()) {
    const std::string sec = config_key_section(row.key);
    if (sec != section) {
      out << "\n## " << (sec.empty() ? "top level" : "[" + sec + "]") << "\n\n"
          << "| key | type | default | meaning |\n"
          << "|---|---|---|---|\n";
      section = sec;
    }
    out << "| `" << row.key << "` | " << row.type << " | `" << md_cell(row.default_value) << "` | " << md_cell(row.meaning)
        << " |\n";
  }
  return out.str();
}

}  // namespace loom
