#include "loom/train/objective.h"

#include <cmath>
#include <cstdio>

#include "loom/core/error.h"
#include "loom/core/str_printf.h"
#include "loom/train/config.h"
#include "loom/train/distill.h"
#include "loom/train/dpo.h"
#include "loom/train/grpo.h"
#include "loom/train/lm_objective.h"
#include "loom/train/parallelize.h"

namespace loom {

namespace {

// The registry: one row per train.objective, defined in the objective's own file.
const ObjectiveRow* const kObjectives[] = {&kLmObjective, &kDpoObjective, &kGrpoObjective, &kDistillObjective};

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

std::span<const ObjectiveRow* const> objective_rows() { return kObjectives; }

const ObjectiveRow& objective_row(std::string_view name) {
  std::string known;
  for (const ObjectiveRow* row : kObjectives) {
    if (row->name == name) return *row;
    known += str_cat(known.empty() ? "" : " | ", row->name);
  }
  throw Error(str_cat("train.objective must be one of ", known, ", got '", name, "'"));
}

const std::string& objective_names_help() {
  static const std::string help = [] {
    std::string s;
    for (const ObjectiveRow* row : kObjectives) s += str_cat(s.empty() ? "" : " | ", row->name, " (", row->meaning, ")");
    return s;
  }();
  return help;
}

std::string objectives_reading(std::string_view format) {
  std::string names;
  for (const ObjectiveRow* row : kObjectives) {
    if (reads(*row, format)) names += str_cat(names.empty() ? "" : ", ", row->name);
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

Validation Objective::validate(ObjectiveContext& ctx) {
  return {"val_loss", ctx.data.validation_loss(*ctx.parts.trainer, ctx.config.loop.eval_batches, ctx.backend.allocator())};
}

void Objective::after_validation(ObjectiveContext& ctx, int64_t step, const Validation& v) {
  ctx.sink.line(str_printf("step %lld: validation loss %.4f (perplexity %.1f)", static_cast<long long>(step), v.value,
                           std::exp(v.value)));
}

std::shared_ptr<Tokenizer> objective_tokenizer(LoomConfig& config) {
  std::shared_ptr<Tokenizer> tokenizer = load_tokenizer(config.data.tokenizer);
  if (config.model.vocab_size == 0) config.model.vocab_size = tokenizer->vocab_size();
  LOOM_CHECK(tokenizer->vocab_size() <= config.model.vocab_size, "data.tokenizer ", config.data.tokenizer, " has ",
             tokenizer->vocab_size(), " tokens, more than model.vocab_size = ", config.model.vocab_size);
  return tokenizer;
}

}  // namespace loom
