#include "loom/train/objective.h"

#include "loom/core/error.h"
#include "loom/train/config.h"
#include "loom/train/distill.h"
#include "loom/train/dpo.h"
#include "loom/train/grpo.h"
#include "loom/train/kto.h"
#include "loom/train/lm_objective.h"
#include "loom/train/orpo.h"

namespace loom {

namespace {

void check_lm(const LoomConfig&) {}  // (data.format: the row's formats)

void check_dpo(const LoomConfig& c) {
  LOOM_CHECK(c.data.format == SftFormat::preference_jsonl && !c.data.input.empty(), "train.objective = dpo reads preference "
             "pairs: set data.format = preference-jsonl and data.input = FILE (one {\"prompt\", \"chosen\", "
             "\"rejected\"} per line)");
  LOOM_CHECK(c.train.batch_size % 2 == 0, "train.objective = dpo: train.batch_size (", c.train.batch_size, ") counts rows, "
             "a chosen and a rejected one per pair: it must be even");
  LOOM_CHECK(c.dpo.beta > 0.0, "dpo.beta must be > 0, got ", c.dpo.beta);
}

void check_grpo(const LoomConfig& c) {
  LOOM_CHECK(c.data.format == SftFormat::prompt_jsonl && !c.data.input.empty(), "train.objective = grpo samples from "
             "prompts: set data.format = prompt-jsonl and data.input = FILE (one {\"prompt\", \"answer\"} per line)");
  LOOM_CHECK(c.grpo.group >= 2 && c.train.batch_size % c.grpo.group == 0, "train.objective = grpo: train.batch_size (",
             c.train.batch_size, ") must be a multiple of grpo.group (", c.grpo.group, "), itself >= 2");
  LOOM_CHECK(c.grpo.max_new_tokens >= 1 && c.grpo.temperature > 0.0 && c.grpo.beta >= 0.0 && c.grpo.epsilon > 0.0,
             "grpo.max_new_tokens must be >= 1, grpo.temperature and grpo.epsilon > 0, grpo.beta >= 0");
}

void check_distill(const LoomConfig& c) {
  LOOM_CHECK(!c.distill.teacher.empty(), "train.objective = distill needs distill.teacher = PATH (the teacher's checkpoint)");
  LOOM_CHECK(c.distill.temperature > 0.0, "distill.temperature must be > 0, got ", c.distill.temperature);
  LOOM_CHECK(c.distill.alpha >= 0.0 && c.distill.alpha <= 1.0, "distill.alpha must be in [0, 1], got ", c.distill.alpha);
  LOOM_CHECK(c.data.format == SftFormat::text, "train.objective = distill trains on plain text data (data.format = text)");
}

void check_orpo(const LoomConfig& c) {
  LOOM_CHECK(c.data.format == SftFormat::preference_jsonl && !c.data.input.empty(), "train.objective = orpo reads "
             "preference pairs: set data.format = preference-jsonl and data.input = FILE (one {\"prompt\", \"chosen\", "
             "\"rejected\"} per line)");
  LOOM_CHECK(c.train.batch_size % 2 == 0, "train.objective = orpo: train.batch_size (", c.train.batch_size, ") counts "
             "rows, a chosen and a rejected one per pair: it must be even");
  LOOM_CHECK(c.orpo.beta >= 0.0, "orpo.beta must be >= 0 (0: the chosen completions' NLL alone), got ", c.orpo.beta);
}

void check_kto(const LoomConfig& c) {
  LOOM_CHECK((c.data.format == SftFormat::unpaired_preference_jsonl || c.data.format == SftFormat::preference_jsonl) &&
                 !c.data.input.empty(),
             "train.objective = kto reads labelled completions: set data.format = unpaired-preference-jsonl (one "
             "{\"prompt\", \"completion\", \"label\": true | false} per line) or preference-jsonl (pairs, unpaired) "
             "and data.input = FILE");
  LOOM_CHECK(c.train.batch_size % 2 == 0 && c.train.batch_size >= 4, "train.objective = kto: train.batch_size (",
             c.train.batch_size, ") counts rows, an example and its mismatched sequence (the KL estimate's) per "
             "example, at least 2 examples: it must be even and >= 4");
  LOOM_CHECK(c.kto.beta > 0.0, "kto.beta must be > 0, got ", c.kto.beta);
  LOOM_CHECK(c.kto.desirable_weight >= 0.0 && c.kto.undesirable_weight >= 0.0 &&
                 c.kto.desirable_weight + c.kto.undesirable_weight > 0.0,
             "kto.desirable_weight and kto.undesirable_weight must be >= 0 and not both 0, got ",
             c.kto.desirable_weight, " and ", c.kto.undesirable_weight);
}

// How often the chosen completion out-scores the rejected one, in percent, in training and held out.
const std::vector<ObjectiveSeries>& dpo_series() {
  static const std::vector<ObjectiveSeries> series = {
      {"dpo", "accuracy", "dpo_accuracy.svg", "Preference accuracy (DPO)", "accuracy (%)", "training accuracy", false,
       100.0, true},
      {"val_dpo", "accuracy", "dpo_accuracy.svg", "Preference accuracy (DPO)", "accuracy (%)", "validation accuracy",
       true, 100.0, true},
  };
  return series;
}

// The rollouts' mean reward and the held-out greedy reward.
const std::vector<ObjectiveSeries>& grpo_series() {
  static const std::vector<ObjectiveSeries> series = {
      {"grpo", "reward", "reward.svg", "Reward (GRPO)", "mean reward", "rollout reward", false, 1.0, false},
      {"val_reward", "", "reward.svg", "Reward (GRPO)", "mean reward", "validation greedy reward", true, 1.0, false},
  };
  return series;
}

// How often the chosen completion's odds out-score the rejected one's, in percent.
const std::vector<ObjectiveSeries>& orpo_series() {
  static const std::vector<ObjectiveSeries> series = {
      {"orpo", "accuracy", "orpo_accuracy.svg", "Preference accuracy (ORPO)", "accuracy (%)", "training accuracy", false,
       100.0, true},
      {"val_orpo", "accuracy", "orpo_accuracy.svg", "Preference accuracy (ORPO)", "accuracy (%)", "validation accuracy",
       true, 100.0, true},
  };
  return series;
}

// The loss, in training and held out (KTO's rewards are per label and absent from a batch without one).
const std::vector<ObjectiveSeries>& kto_series() {
  static const std::vector<ObjectiveSeries> series = {
      {"kto", "loss", "kto_loss.svg", "KTO loss", "loss", "training loss", false, 1.0, true},
      {"val_kto", "loss", "kto_loss.svg", "KTO loss", "loss", "validation loss", true, 1.0, true},
  };
  return series;
}

// The registry: one row per train.objective, its implementation in the file named on its line.
// A row's check is its keys and data against the rest of the config; its layout is read by the
// compatibility table (layout.cpp); its series are what `loom report` charts from its records.
const ObjectiveRow kObjectives[] = {
    {    "lm", "the mean next-token loss; supervised fine-tuning on chat-jsonl / jsonl data with its loss mask",
    "text|chat-jsonl|jsonl", {}, check_lm, make_lm_objective},

    {    "dpo", "preference pairs from data.input: DPO, IPO or SimPO by dpo.loss; the dpo.* keys", "preference-jsonl",
    {.model_parallel = false, .why = "the rows' weights are applied by the one-process cross-entropy; use data parallelism"},
    check_dpo, make_dpo_objective, dpo_series},

    {    "grpo", "rollouts of the prompts of data.input with verifiable rewards; the grpo.* keys", "prompt-jsonl",
    {.model_parallel = false, .data_parallel = false, .moe = false, .compact_base = false,
     .why = "the rollouts decode with one process's whole fp32 model"},
    check_grpo, make_grpo_objective, grpo_series},

    {    "distill", "next-token loss and a teacher's softened distribution; the distill.* keys", "text",
    {.model_parallel = false, .why = "the teacher runs as one process's whole model; use data parallelism"},
    check_distill, make_distill_objective},

    {    "orpo", "preference pairs from data.input: ORPO, the chosen completion's NLL and an odds-ratio term, no reference "
    "model; the orpo.* keys", "preference-jsonl",
    {.model_parallel = false, .why = "the rows' weights are applied by the one-process cross-entropy"}, check_orpo,
    make_orpo_objective, orpo_series},

    {    "kto", "labelled completions (or preference pairs, unpaired) from data.input: KTO against a live reference; the "
    "kto.* keys", "unpaired-preference-jsonl|preference-jsonl",
    {.model_parallel = false, .data_parallel = false,
     .why = "the KL estimate z0 is a mean over the whole batch, and the rows' weights are applied by the one-process "
            "cross-entropy"},
    check_kto, make_kto_objective, kto_series},
};

// What a data.format holds, for the refusal of one the objective does not read.
std::string_view format_contents(std::string_view format) {
  if (format == "preference-jsonl") return "preference pairs";
  if (format == "prompt-jsonl") return "prompts with answers";
  if (format == "unpaired-preference-jsonl") return "completions labelled desirable or not";
  return "token shards of text or supervised examples (loom prepare)";
}

// Whether `format` is one of the row's "|"-separated data.format values.
bool reads(const ObjectiveRow& row, std::string_view format) {
  std::string_view formats = row.formats;
  while (!formats.empty()) {
    const size_t bar = formats.find('|');
    if (formats.substr(0, bar) == format) return true;
    formats = bar == std::string_view::npos ? std::string_view() : formats.substr(bar + 1);
  }
  return false;
}

}  // namespace

std::span<const ObjectiveRow> objective_rows() { return kObjectives; }

const ObjectiveRow& objective_row(std::string_view name) {
  std::string known;
  for (const ObjectiveRow& row : kObjectives) {
    if (row.name == name) return row;
    known += str_cat(known.empty() ? "" : " | ", row.name);
  }
  throw Error(str_cat("train.objective must be one of ", known, ", got '", name, "'"));
}

const std::string& objective_names_help() {
  static const std::string help = [] {
    std::string s;
    for (const ObjectiveRow& row : kObjectives) s += str_cat(s.empty() ? "" : " | ", row.name, " (", row.meaning, ")");
    return s;
  }();
  return help;
}

std::string objectives_reading(std::string_view format) {
  std::string names;
  for (const ObjectiveRow& row : kObjectives) {
    if (reads(row, format)) names += str_cat(names.empty() ? "" : ", ", row.name);
  }
  return names;
}

void check_objective_format(const LoomConfig& config) {
  const ObjectiveRow& row = objective_row(config.loop.objective);
  const std::string format(enum_name(config.data.format));
  if (reads(row, format)) return;
  throw Error(str_cat("data.format = ", format, " holds ", format_contents(format), ": train them with ",
                      "train.objective = ", objectives_reading(format), " (train.objective = ", row.name, " reads ",
                      row.formats, ")"));
}

const std::vector<ObjectiveSeries>& objective_series() {
  static const std::vector<ObjectiveSeries> all = [] {
    std::vector<ObjectiveSeries> out;
    for (const ObjectiveRow& row : kObjectives) {
      if (row.series != nullptr) out.insert(out.end(), row.series().begin(), row.series().end());
    }
    return out;
  }();
  return all;
}

}  // namespace loom
