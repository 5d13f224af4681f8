#include "loom/train/config.h"

#include <charconv>
#include <sstream>
#include <variant>

// toml++ trips GCC 12's -Warray-bounds false positives inside its own headers.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Warray-bounds"
#include <toml++/toml.h>
#pragma GCC diagnostic pop

#include "loom/core/error.h"

namespace loom {

namespace {

// One schema entry: a key bound to a typed field of a LoomConfig.
// TriBool: a boolean that may be left to the optimizer's default (-1 unset, 0, 1).
struct TriBool {
  int64_t* value;
};
using Target = std::variant<int64_t*, uint64_t*, double*, float*, std::string*, Arch*, bool*, TriBool>;

struct Binding {
  std::string key;
  Target target;
};

std::vector<Binding> bindings(LoomConfig& c) {
  return {
      {"device", &c.device},  // top-level keys first: TOML puts them before any [table]
      {"model.arch", &c.model.arch},
      {"model.vocab_size", &c.model.vocab_size},
      {"model.max_seq_len", &c.model.max_seq_len},
      {"model.n_layer", &c.model.n_layer},
      {"model.n_head", &c.model.n_head},
      {"model.n_kv_head", &c.model.n_kv_head},
      {"model.d_model", &c.model.d_model},
      {"model.d_ff", &c.model.d_ff},
      {"model.norm_eps", &c.model.norm_eps},
      {"model.rope_theta", &c.model.rope_theta},
      {"model.init_std", &c.model.init_std},
      {"model.attn_window", &c.model.attn_window},
      {"model.mla_kv_rank", &c.model.mla_kv_rank},
      {"model.mla_rope_dim", &c.model.mla_rope_dim},
      {"model.mla_nope_dim", &c.model.mla_nope_dim},
      {"model.mla_v_dim", &c.model.mla_v_dim},
      {"model.mla_q_rank", &c.model.mla_q_rank},
      {"model.moe_experts", &c.model.moe_experts},
      {"model.moe_top_k", &c.model.moe_top_k},
      {"model.moe_d_ff", &c.model.moe_d_ff},
      {"model.moe_shared", &c.model.moe_shared},
      {"model.moe_dense_layers", &c.model.moe_dense_layers},
      {"model.moe_sigmoid", &c.model.moe_sigmoid},
      {"model.moe_renorm", &c.model.moe_renorm},
      {"model.moe_route_scale", &c.model.moe_route_scale},
      {"model.moe_groups", &c.model.moe_groups},
      {"model.moe_topk_groups", &c.model.moe_topk_groups},
      {"model.moe_capacity_factor", &c.model.moe_capacity_factor},
      {"model.moe_aux_alpha", &c.model.moe_aux_alpha},
      {"model.moe_seq_aux_alpha", &c.model.moe_seq_aux_alpha},
      {"model.moe_z_alpha", &c.model.moe_z_alpha},
      {"model.moe_bias_gamma", &c.model.moe_bias_gamma},
      {"train.batch_size", &c.train.batch_size},
      {"train.seq_len", &c.train.seq_len},
      {"train.grad_accum", &c.train.grad_accum},
      {"train.recompute", &c.train.recompute},
      {"train.device_budget_mb", &c.train.device_budget_mb},
      {"train.recompute_budget_mb", &c.train.recompute_budget_mb},
      {"train.offload_activations", &c.train.offload_activations},
      {"train.flash_attention", &c.train.flash_attention},
      {"train.steps", &c.train.steps},
      {"train.seed", &c.loop.seed},
      {"train.eval_every", &c.loop.eval_every},
      {"train.eval_batches", &c.loop.eval_batches},
      {"train.checkpoint_every", &c.loop.checkpoint_every},
      {"train.keep_checkpoints", &c.loop.keep_checkpoints},
      {"train.log_every", &c.loop.log_every},
      // docs/optimizers.md: the rules, their defaults (-1 = the optimizer's own) and the schedules.
      {"optim.name", &c.train.optim.name},
      {"optim.offload", &c.train.optim.offload},
      {"optim.lr", &c.train.schedule.max_lr},
      {"optim.min_lr", &c.train.schedule.min_lr},
      {"optim.schedule", &c.train.schedule.kind},
      {"optim.warmup_steps", &c.train.schedule.warmup},
      {"optim.decay_fraction", &c.train.schedule.decay_fraction},
      {"optim.wsd_shape", &c.train.schedule.wsd_shape},
      {"optim.step_size", &c.train.schedule.step_size},
      {"optim.gamma", &c.train.schedule.gamma},
      {"optim.grad_clip", &c.train.grad_clip},
      {"optim.weight_decay", &c.train.optim.weight_decay},
      {"optim.no_decay", &c.train.optim.no_decay},
      {"optim.lr_scale", &c.train.optim.lr_scale},
      {"optim.beta1", &c.train.optim.beta1},
      {"optim.beta2", &c.train.optim.beta2},
      {"optim.beta3", &c.train.optim.beta3},
      {"optim.eps", &c.train.optim.eps},
      {"optim.eps2", &c.train.optim.eps2},
      {"optim.momentum", &c.train.optim.momentum},
      {"optim.dampening", &c.train.optim.dampening},
      {"optim.nesterov", TriBool{&c.train.optim.nesterov}},
      {"optim.centered", &c.train.optim.centered},
      {"optim.amsgrad", &c.train.optim.amsgrad},
      {"optim.lr_decay", &c.train.optim.lr_decay},
      {"optim.initial_accumulator", &c.train.optim.initial_accumulator},
      {"optim.relative_step", &c.train.optim.relative_step},
      {"optim.scale_parameter", &c.train.optim.scale_parameter},
      {"optim.warmup_init", &c.train.optim.warmup_init},
      {"optim.clip_threshold", &c.train.optim.clip_threshold},
      {"optim.decay_rate", &c.train.optim.decay_rate},
      {"optim.rank", &c.train.optim.rank},
      {"optim.rho", &c.train.optim.rho},
      {"optim.ns_steps", &c.train.optim.ns_steps},
      {"optim.muon_scale", &c.train.optim.muon_scale},
      {"precision.compute", &c.train.precision.compute},
      {"precision.attn_qkv", &c.train.precision.attn_qkv},
      {"precision.attn_out", &c.train.precision.attn_out},
      {"precision.mlp_in", &c.train.precision.mlp_in},
      {"precision.mlp_out", &c.train.precision.mlp_out},
      {"precision.head", &c.train.precision.head},
      {"precision.param", &c.train.precision.param},
      {"precision.reduce", &c.train.precision.reduce},
      {"precision.master", &c.train.precision.master},
      {"precision.stochastic_rounding", &c.train.precision.stochastic_rounding},
      {"precision.qat", &c.train.precision.qat},
      {"precision.fp8_margin", &c.train.precision.fp8.margin},
      {"precision.fp8_amax_history", &c.train.precision.fp8.amax_history},
      {"precision.fp8_amax_compute", &c.train.precision.fp8.amax_compute},
      {"precision.fp8_backward", &c.train.precision.fp8.backward},
      {"precision.loss_scaling", &c.train.loss_scaling},
      {"precision.init_scale", &c.train.loss_scaler.init_scale},
      {"precision.growth_factor", &c.train.loss_scaler.growth_factor},
      {"precision.backoff_factor", &c.train.loss_scaler.backoff_factor},
      {"precision.growth_interval", &c.train.loss_scaler.growth_interval},
      {"precision.hysteresis", &c.train.loss_scaler.hysteresis},
      {"parallel.dp", &c.parallel.dp},
      {"parallel.tp", &c.parallel.tp},
      {"parallel.pp", &c.parallel.pp},
      {"parallel.cp", &c.parallel.cp},
      {"parallel.ep", &c.parallel.ep},
      {"parallel.sequence_parallel", &c.parallel.sequence_parallel},
      {"parallel.cp_attention", &c.parallel.cp_attention},
      {"parallel.schedule", &c.parallel.schedule},
      {"parallel.virtual_stages", &c.parallel.virtual_stages},
      {"parallel.bucket_mb", &c.parallel.bucket_mb},
      {"parallel.overlap", &c.parallel.overlap},
      {"parallel.zero_stage", &c.parallel.zero_stage},
      {"parallel.compression", &c.parallel.compression},
      {"parallel.topk_ratio", &c.parallel.topk_ratio},
      {"parallel.qsgd_levels", &c.parallel.qsgd_levels},
      {"parallel.powersgd_rank", &c.parallel.powersgd_rank},
      {"parallel.dgc_momentum", &c.parallel.dgc_momentum},
      {"parallel.dgc_clip", &c.parallel.dgc_clip},
      {"parallel.dgc_warmup_steps", &c.parallel.dgc_warmup_steps},
      {"data.dir", &c.data.dir},
      {"data.tokenizer", &c.data.tokenizer},
      {"data.input", &c.data.input},
      {"data.val_fraction", &c.data.val_fraction},
      {"run.dir", &c.run.dir},
      {"run.name", &c.run.name},
      {"sample.prompt", &c.sample.prompt},
      {"sample.max_new_tokens", &c.sample.max_new_tokens},
      {"sample.temperature", &c.sample.sampling.temperature},
      {"sample.top_k", &c.sample.sampling.top_k},
      {"sample.top_p", &c.sample.sampling.top_p},
      {"sample.seed", &c.sample.sampling.seed},
  };
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
        if constexpr (std::is_same_v<P, TriBool>) {
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
          if (node.is_floating_point()) *field = static_cast<T>(node.as_floating_point()->get());
          else if (node.is_integer()) *field = static_cast<T>(node.as_integer()->get());
          else throw wrong("a number");
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
    if (b.key == key) return std::holds_alternative<std::string*>(b.target) || std::holds_alternative<Arch*>(b.target);
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

}  // namespace

void LoomConfig::validate() const {
  model.validate();
  train.validate();
  sample.sampling.validate();
  LOOM_CHECK(device == "cpu" || device == "cuda", "device must be \"cpu\" or \"cuda\", got \"", device, "\"");
  LOOM_CHECK(parallel.zero_stage >= 0 && parallel.zero_stage <= 3, "parallel.zero_stage must be 0, 1, 2 or 3, got ",
             parallel.zero_stage);
  LOOM_CHECK(parallel.bucket_mb > 0.0, "parallel.bucket_mb must be > 0, got ", parallel.bucket_mb);
  LOOM_CHECK(parallel.ep >= 1, "parallel.ep must be >= 1, got ", parallel.ep);
  LOOM_CHECK(model.attn_window == 0 || parallel.cp == 1, "model.attn_window = ", model.attn_window,
             " (sliding-window attention) is not supported with context parallelism (parallel.cp = ", parallel.cp,
             "); set model.attn_window = 0 or parallel.cp = 1");
  if (model.mla()) {  // MLA (nn/mla.h) runs on whole blocks: no head, sequence or context split
    LOOM_CHECK(parallel.tp == 1, "model.mla_kv_rank > 0 (MLA) is not supported with tensor parallelism (parallel.tp = ",
               parallel.tp, ")");
    LOOM_CHECK(!parallel.sequence_parallel, "model.mla_kv_rank > 0 (MLA) is not supported with "
               "parallel.sequence_parallel");
    LOOM_CHECK(parallel.cp == 1, "model.mla_kv_rank > 0 (MLA) is not supported with context parallelism (parallel.cp = ",
               parallel.cp, ")");
    LOOM_CHECK(train.recompute == "none", "model.mla_kv_rank > 0 (MLA) is not supported with activation checkpointing "
               "(train.recompute = ", train.recompute, "); set train.recompute = none");
  }
  if (train.flash_attention) {  // the blocks' own attention only (nn/block.h set_flash_attention)
    LOOM_CHECK(parallel.cp == 1, "train.flash_attention is not supported with context parallelism (parallel.cp = ",
               parallel.cp, " runs ring or Ulysses attention); set train.flash_attention = false or parallel.cp = 1");
    LOOM_CHECK(parallel.pp == 1, "train.flash_attention is not supported with pipeline parallelism (parallel.pp = ",
               parallel.pp, ") yet; set train.flash_attention = false or parallel.pp = 1");
    LOOM_CHECK(!model.mla(), "train.flash_attention is not supported with model.mla_kv_rank > 0 (MLA computes its own "
               "attention); set train.flash_attention = false");
  }
  LOOM_CHECK(parallel.ep == 1 || model.moe_experts > 0, "parallel.ep = ", parallel.ep, " needs an MoE model (model.moe_experts > 0)");
  LOOM_CHECK(parallel.ep == 1 || parallel.dp == 0 || parallel.dp % parallel.ep == 0, "parallel.ep = ", parallel.ep,
             " must divide parallel.dp = ", parallel.dp, " (experts are split over data-parallel ranks)");
  LOOM_CHECK(train.seq_len <= model.max_seq_len, "train.seq_len (", train.seq_len, ") must be <= model.max_seq_len (",
             model.max_seq_len, ")");
  LOOM_CHECK(loop.eval_every >= 0 && loop.checkpoint_every >= 0 && loop.log_every >= 1 && loop.eval_batches >= 1,
             "train.eval_every and train.checkpoint_every must be >= 0, train.log_every and train.eval_batches >= 1");
  LOOM_CHECK(loop.keep_checkpoints >= 1, "train.keep_checkpoints must be >= 1, got ", loop.keep_checkpoints);
  LOOM_CHECK(data.val_fraction > 0.0 && data.val_fraction < 1.0, "data.val_fraction must be in (0, 1), got ",
             data.val_fraction);
  LOOM_CHECK(sample.max_new_tokens >= 0, "sample.max_new_tokens must be >= 0, got ", sample.max_new_tokens);
  LOOM_CHECK(!run.name.empty() && run.name.find('/') == std::string::npos, "run.name must be a non-empty folder name, got '",
             run.name, "'");
}

void apply_config_file(LoomConfig& config, const std::string& path) {
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
    out << name << " = ";
    std::visit(
        [&](auto target) {
          using P = decltype(target);
          if constexpr (std::is_same_v<P, TriBool>) {
            if (*target.value < 0) out << -1;
            else out << (*target.value ? "true" : "false");
          } else if constexpr (std::is_same_v<P, bool*>) {
            out << (*target ? "true" : "false");
          } else {
          auto* field = target;
          using T = std::remove_pointer_t<decltype(field)>;
          if constexpr (std::is_same_v<T, std::string>) out << toml_string(*field);
          else if constexpr (std::is_same_v<T, Arch>) out << toml_string(std::string(arch_name(*field)));
          else if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double>) out << toml_float(*field);
          else out << static_cast<int64_t>(*field);
          }
        },
        b.target);
    out << "\n";
  }
  return out.str();
}

std::vector<std::string> config_keys() {
  LoomConfig c;
  std::vector<std::string> keys;
  for (const Binding& b : bindings(c)) keys.push_back(b.key);
  return keys;
}

}  // namespace loom
