#include "loom/memory/estimate.h"

#include <algorithm>

#include "loom/core/error.h"
#include "loom/memory/recompute.h"
#include "loom/model/frozen_base.h"
#include "loom/arch/param_layout.h"
#include "loom/nn/moe.h"
#include "loom/parallel/pipeline.h"
#include "loom/parallel/tensor_parallel.h"
#include "loom/parallel/zero.h"
#include "loom/precision/nf4.h"

namespace loom {

std::array<double, 4> zero_model_state_bytes(double P, int N, double w, double g, double K) {
  const double n = static_cast<double>(N);
  return {(w + g + K) * P, (w + g) * P + K * P / n, w * P + (g + K) * P / n, (w + g + K) * P / n};
}

namespace {
bool param_bf16(const PrecisionConfig& p) { return resolve_policy(p).param_bf16; }

// The optimizer state bytes of the whole model (its exact per-parameter formula).
int64_t optimizer_bytes(const MemoryPlan& plan, const ParamLayout& layout) {
  const OptimConfig resolved = plan.optim.resolved();
  return optimizer_state_bytes(optim_params(layout, resolved), resolved);
}

// The model a rank computes: the whole, or its tensor-parallel slice.
ModelConfig rank_model(const MemoryPlan& plan) {
  return plan.tp > 1 ? tp_local_config(plan.model, plan.tp) : plan.model;
}

void check_plan(const MemoryPlan& p) {
  LOOM_CHECK(p.ranks >= 1, "loom memory: the data-parallel ranks must be >= 1, got ", p.ranks);
  LOOM_CHECK(p.tp >= 1 && p.pp >= 1 && p.cp >= 1 && p.ep >= 1, "parallel.tp, pp, cp and ep must be >= 1, got ", p.tp,
             ", ", p.pp, ", ", p.cp, ", ", p.ep);
  LOOM_CHECK(p.zero_stage >= 0 && p.zero_stage <= 3, "parallel.zero_stage must be 0, 1, 2 or 3, got ", p.zero_stage);
  LOOM_CHECK(!p.sequence_parallel || p.tp > 1, "parallel.sequence_parallel needs parallel.tp > 1");
  LOOM_CHECK(p.ep == 1 || p.model.moe_experts % p.ep == 0, "parallel.ep = ", p.ep, " must divide model.moe_experts = ",
             p.model.moe_experts);
  LOOM_CHECK(!p.offload_activations || (p.recompute != "none" && p.recompute != "budget"),
             "loom memory: train.offload_activations is estimated with train.recompute = selective, full or every:K");
  LOOM_CHECK(p.recompute == "none" || (p.tp == 1 && p.pp == 1 && p.cp == 1),
             "activation checkpointing (train.recompute) with tensor, pipeline or context parallelism is not supported yet");
  LOOM_CHECK(!p.model.mla() || p.recompute == "none", "model.mla_kv_rank > 0 (MLA) is not supported with activation "
             "checkpointing (train.recompute = ", p.recompute, ")");
}

// The layers of each model stage and the schedule (pp > 1).
struct Stages {
  PipeSchedule schedule;
  std::vector<std::pair<int64_t, int64_t>> layers;
};
Stages plan_stages(const MemoryPlan& plan, const ModelConfig& c) {
  Stages s;
  if (plan.pp == 1) {
    s.schedule.per_rank = {{}};
    s.layers = {{0, c.n_layer}};
    return s;
  }
  s.schedule = make_pipe_schedule(plan.schedule, plan.pp, static_cast<int>(plan.micro), plan.virtual_stages);
  s.layers = pipeline_stage_split(c, s.schedule.model_stages(), plan.seq_len);
  return s;
}

// What decides the records' fields (nn/plan.h): the attention kind, the layout's sequence
// parallelism, the precision policy's bf16-saved inputs (and the MLP kind, per layer).
PlanChoices plan_choices(const MemoryPlan& plan) {
  PlanChoices choices;
  choices.flash = plan.flash_attention;
  choices.context = plan.cp == 1 ? PlanChoices::NONE : plan.ulysses ? PlanChoices::ULYSSES : PlanChoices::RING;
  choices.tensor_parallel = choices.sequence_parallel = plan.sequence_parallel && plan.tp > 1;
  choose_precision(choices, resolve_policy(plan.precision));
  return choices;
}

// One activation store of layers [first, last) (Transformer::allocate_store_for).
int64_t store_bytes(const MemoryPlan& plan, const ModelConfig& c, int64_t first, int64_t last, bool split) {
  const bool cp = plan.cp > 1;
  const int64_t B = plan.batch, T = cp ? plan.seq_len / plan.cp : plan.seq_len, C = c.d_model, BT = B * T;
  const int64_t shards = plan.sequence_parallel ? plan.tp : 1, Ts = T / shards;
  int64_t bytes = 4 * 2 * BT;  // tokens and targets (i32)
  // The model's ends (last stage): the last block's output, the final norm (its shard under
  // sequence parallel, its statistics), the logits, the per-position losses and log-sum-exps.
  const int64_t ends = 4 * (B * Ts * C + BT * C + (shards > 1 ? B * Ts * C : 0) + (c.rmsnorm() ? 1 : 2) * B * Ts +
                            BT * c.vocab_size + 2 * BT);
  if (plan.recompute == "budget") return bytes + static_cast<int64_t>(plan.recompute_budget_mb * (1 << 20)) + ends;
  const std::vector<RecomputePolicy> policies = recompute_plan(plan.recompute, c.n_layer);
  const bool flash = plan.flash_attention;  // lse (B,H,T) in the blocks' records instead of probs (B,H,T,T)
  const PlanChoices choices = plan_choices(plan);
  bool shared = false;
  for (int64_t l = first; l < last; ++l) {
    const RecomputePolicy keep = c.moe_layer(l) ? RECOMPUTE_NONE : policies[l];
    bytes += block_saved_bytes(c, resolve_layer_plan(c, l, choices),
                               {.batch = B, .seq_len = T, .seq_shards = shards, .split_backward = split, .keep = keep,
                                .ep = plan.ep});
    shared |= keep != RECOMPUTE_NONE;
    if (cp && plan.ulysses) {  // UlyssesSaved: the whole sequence for this rank's heads
      const int64_t N = plan.cp, Tf = plan.seq_len, hd = c.head_dim(), hl = c.n_head / N, kvl = c.n_kv_head / N;
      bytes += 4 * (B * Tf * (hl + 2 * kvl) * hd + B * Tf * hl * hd + B * hl * (flash ? Tf : Tf * Tf));
    }
  }
  if (shared) {  // the recompute record and output
    bytes += block_kept_bytes(c, B, T, RECOMPUTE_NONE, choices) +
             4 * BT * std::max(C, c.n_head * c.head_dim());
  }
  return bytes + (last < c.n_layer ? 4 * B * Ts * C : ends);  // the stage's output, or the model's ends
}

int64_t rank_activation_bytes(const MemoryPlan& plan, const ModelConfig& c, const Stages& st, int pp_rank) {
  if (plan.pp == 1) return store_bytes(plan, c, 0, c.n_layer, false);
  const std::vector<int> peak = pipe_live_peak(st.schedule, pp_rank);
  int64_t bytes = 0;
  for (int chunk = 0; chunk < st.schedule.virtual_chunks; ++chunk) {
    const auto [first, last] = st.layers[static_cast<size_t>(st.schedule.stage_of(pp_rank, chunk))];
    bytes += std::max(1, peak[static_cast<size_t>(chunk)]) * store_bytes(plan, c, first, last, st.schedule.split_backward);
  }
  return bytes;
}

// A block matrix of the base, which QLoRA holds in NF4 (model/frozen_base.h: each block's qkv,
// proj, fc, fc2; the 2-D hidden-role parameters of a dense block).
bool qlora_matrix(const ParamSpec& spec) { return spec.role == ROLE_HIDDEN && spec.shape.size() == 2; }

MemoryEstimate estimate_rank(const MemoryPlan& plan, const ModelConfig& c, const ParamLayout& layout, const Stages& st,
                             int pp_rank) {
  MemoryEstimate e;
  e.pp_rank = pp_rank;
  e.parameters = layout.total;
  // The elements this rank computes and updates: its stages' (pipeline_owned_ranges), less the
  // experts other ep ranks compute (ep rank 0's view: every ep rank holds as many).
  RangeSet held = plan.pp > 1 ? pipeline_owned_ranges(c, layout, st.schedule, pp_rank, st.layers, false)
                              : RangeSet::span(0, layout.total);
  if (plan.ep > 1) held = held.subtract(moe_expert_ranges(c, layout, 0, plan.ep, false));
  // LoRA (docs/finetune.md): the frozen base is held but has no gradients and no optimizer state.
  const int64_t frozen_end = c.lora() ? lora_begin(c, layout) : 0;
  const RangeSet domain = held.subtract(RangeSet::span(0, frozen_end));
  const int64_t H = held.size(), D = domain.size();
  e.rank_parameters = D;
  // ZeRO shards the domain over the data-parallel ranks (x cp), rank 0 the largest shard.
  const int Z = plan.ranks * plan.cp;
  const bool sharded = plan.zero_stage > 0 && Z > 1;
  const ShardRange shard = sharded ? shard_range(D, 0, Z) : ShardRange{0, D, D};
  const int64_t S = shard.end - shard.begin;
  int64_t fp32 = 4 * (H - D + (plan.zero_stage == 3 && sharded ? S : D));
  // ZeRO-2/3 over a frozen base (LoRA) shard the whole buffer (Trainer, ZeroSharding's
  // frozen_end): a rank's gradients and optimizer state are the adapters inside its shard, which
  // are not spread evenly (they follow the base): the estimate is the rank holding the most.
  RangeSet trained = domain.pieces(shard.begin, shard.end);
  if (plan.zero_stage >= 2 && sharded && frozen_end > 0) {
    int64_t most = -1;
    for (int r = 0; r < Z; ++r) {
      const ShardRange z = shard_range(layout.total, r, Z);
      const RangeSet mine = RangeSet::span(z.begin, z.end).intersect(domain);
      if (mine.size() > most) most = mine.size(), trained = mine;
    }
    fp32 = 4 * (plan.zero_stage == 3 ? shard_range(layout.total, 0, Z).shard : layout.total);
  }
  e.bytes[MEM_PARAMETERS] = fp32 + (param_bf16(plan.precision) ? 2 * H : 0);
  if (c.lora_quantize_base) {  // QLoRA: the base's block matrices in NF4, their fp32 elements released or never written
    int64_t largest = 0;
    for (const ParamSpec& spec : layout.params) {
      if (spec.offset >= frozen_end || !qlora_matrix(spec)) continue;
      e.bytes[MEM_PARAMETERS] += static_cast<int64_t>(nf4_bytes(spec.numel)) - 4 * spec.numel;
      largest = std::max(largest, spec.numel);
    }
    // Each layer dequantizes its NF4 weight for the call into one shared f32 scratch
    // (LinearWorkspace slot Q, nn/linear.h): the largest block matrix (the layout is the rank's
    // tensor slice already).
    e.bytes[MEM_WORKSPACE] += 4 * largest;
  } else if (param_bf16(plan.precision)) {
    // A layer whose recipe is not bf16 widens its bf16 weight copy for the call into the same
    // scratch (LinearLayer::effective_weight): the largest such weight.
    const PrecisionPolicy policy = resolve_policy(plan.precision);
    bool blocks = false;
    for (int k = 0; k < LINEAR_HEAD; ++k) blocks = blocks || policy.recipe[static_cast<size_t>(k)] != RECIPE_BF16;
    const std::string head = head_param_name(c);
    int64_t largest = 0;
    for (const ParamSpec& spec : layout.params) {
      const bool widened = (blocks && qlora_matrix(spec)) || (policy.recipe[LINEAR_HEAD] != RECIPE_BF16 && spec.name == head);
      if (widened) largest = std::max(largest, spec.numel);
    }
    e.bytes[MEM_WORKSPACE] += 4 * largest;
  }
  if (plan.compact_base && FrozenBase::keeps_bf16(c, param_bf16(plan.precision), plan.zero_stage)) {
    // LoRA's base in bf16 only: the block matrices' and an untied head's fp32 elements released
    // or never written (FrozenBase::weight_specs; the bf16 copy is counted above).
    const std::string head = c.tied_head() ? "" : head_param_name(c);
    for (const ParamSpec& spec : layout.params) {
      if (spec.offset >= frozen_end || !(qlora_matrix(spec) || spec.name == head)) continue;
      e.bytes[MEM_PARAMETERS] -= 4 * held.intersect(RangeSet::span(spec.offset, spec.offset + spec.numel)).size();
    }
  }
  if (plan.optim.offload && param_bf16(plan.precision)) {  // the fp32 master weights in host memory
    e.bytes[MEM_PARAMETERS] -= fp32;
    e.bytes[MEM_OFFLOADED] += fp32;
  }
  e.bytes[MEM_GRADIENTS] = 4 * (plan.zero_stage >= 2 && sharded ? trained.size() : D);
  // The optimizer's own list over the rank's elements (Trainer's rank_params).
  const OptimConfig resolved = plan.optim.resolved();
  std::vector<OptimParam> all = optim_params(layout, resolved), mine;
  if (plan.pp == 1 && plan.ep == 1 && !sharded && frozen_end == 0) {
    mine = std::move(all);
  } else {
    for (const Range& piece : trained) {
      for (OptimParam& p : shard_optim_params(all, piece.begin, piece.end)) mine.push_back(std::move(p));
    }
  }
  e.bytes[plan.optim.offload ? MEM_OFFLOADED : MEM_OPTIMIZER_STATE] += optimizer_state_bytes(mine, resolved);
  e.bytes[MEM_ACTIVATIONS] = rank_activation_bytes(plan, c, st, pp_rank);
  if (plan.offload_activations && plan.recompute != "budget") {  // the checkpointed blocks' kept fields
    const std::vector<RecomputePolicy> policies = recompute_plan(plan.recompute, c.n_layer);
    for (int64_t l = 0; l < c.n_layer; ++l) {
      if (c.moe_layer(l) || policies[l] == RECOMPUTE_NONE) continue;
      const int64_t kept = block_kept_bytes(c, plan.batch, plan.seq_len, policies[l], plan_choices(plan));
      e.bytes[MEM_ACTIVATIONS] -= kept;
      e.bytes[MEM_OFFLOADED] += kept;
    }
  }
  return e;
}
}  // namespace

std::array<double, 3> zero_bytes_per_param(const MemoryPlan& plan) {
  const ParamLayout layout = build_param_layout(plan.model);
  const bool w16 = param_bf16(plan.precision);
  const double K = static_cast<double>(optimizer_bytes(plan, layout)) / static_cast<double>(layout.total) +
                   (w16 && plan.precision.master != "bf16" ? 4.0 : 0.0);
  return {w16 ? 2.0 : 4.0, plan.precision.reduce == "bf16" ? 2.0 : 4.0, K};
}

int64_t MemoryEstimate::total() const {
  int64_t t = 0;
  for (int64_t b : bytes) t += b;
  return t;
}

int64_t activation_store_bytes(const MemoryPlan& plan, int pp_rank) {
  check_plan(plan);
  const ModelConfig c = rank_model(plan);
  return rank_activation_bytes(plan, c, plan_stages(plan, c), pp_rank);
}

MemoryEstimate estimate_memory(const MemoryPlan& plan, int pp_rank) {
  check_plan(plan);
  LOOM_CHECK(pp_rank < plan.pp, "pipeline rank ", pp_rank, " of parallel.pp = ", plan.pp);
  const ModelConfig c = rank_model(plan);
  const ParamLayout layout = build_param_layout(c);
  const Stages st = plan_stages(plan, c);
  if (pp_rank >= 0) return estimate_rank(plan, c, layout, st, pp_rank);
  MemoryEstimate best;
  for (int r = 0; r < plan.pp; ++r) {
    MemoryEstimate e = estimate_rank(plan, c, layout, st, r);
    if (r == 0 || e.total() > best.total()) best = std::move(e);
  }
  return best;
}

std::vector<FinetuneMemory> finetune_memory(const ModelConfig& model, const OptimConfig& optim) {
  ModelConfig base = model, adapted = model;
  base.peft_method = PeftMethod::none;
  adapted.peft_method = PeftMethod::lora;
  const OptimConfig resolved = optim.resolved();
  const ParamLayout full_layout = build_param_layout(base), lora_layout = build_param_layout(adapted);
  const int64_t P = full_layout.total, A = lora_layout.total - P;
  std::vector<OptimParam> all = optim_params(lora_layout, resolved), adapters;
  for (OptimParam& p : shard_optim_params(all, P, lora_layout.total)) adapters.push_back(std::move(p));
  const int64_t adapter_state = optimizer_state_bytes(adapters, resolved);
  std::vector<FinetuneMemory> rows;
  rows.push_back({"full", P, 4 * P, 4 * P, optimizer_state_bytes(optim_params(full_layout, resolved), resolved), 4 * P});
  rows.push_back({"lora", A, 4 * (P + A), 4 * A, adapter_state, 4 * A});
  // QLoRA: each block matrix (ROLE_HIDDEN, 2-D) in NF4, everything else of the base in bf16.
  int64_t nf4 = 0, rest = 0;
  for (const ParamSpec& spec : full_layout.params) {
    if (qlora_matrix(spec)) nf4 += static_cast<int64_t>(nf4_bytes(spec.numel));
    else rest += spec.numel;
  }
  rows.push_back({"qlora", A, nf4 + 2 * rest + 4 * A, 4 * A, adapter_state, 4 * A});
  return rows;
}

}  // namespace loom
