// The config fuzzer validates configs (train/config.cpp, the layout table) and never builds a
// training objective. The objectives' registry (train/objective.cpp) names each objective's
// factory; their real definitions sit in the objectives' files (train/dpo.cpp, grpo.cpp, ...),
// which would bring the whole training, data and inference code into this clang build. These
// stand in for them here and say so if anything ever calls one.
#include "loom/core/error.h"
#include "loom/train/distill.h"
#include "loom/train/dpo.h"
#include "loom/train/grpo.h"
#include "loom/train/kto.h"
#include "loom/train/lm_objective.h"
#include "loom/train/orpo.h"

namespace loom {

namespace {

[[noreturn]] void not_built(const char* name) {
  throw Error(str_cat("train.objective = ", name, ": objectives are not built into the config fuzzer"));
}

}  // namespace

std::unique_ptr<Objective> make_lm_objective(const LoomConfig&) { not_built("lm"); }
std::unique_ptr<Objective> make_dpo_objective(const LoomConfig&) { not_built("dpo"); }
std::unique_ptr<Objective> make_grpo_objective(const LoomConfig&) { not_built("grpo"); }
std::unique_ptr<Objective> make_distill_objective(const LoomConfig&) { not_built("distill"); }
std::unique_ptr<Objective> make_orpo_objective(const LoomConfig&) { not_built("orpo"); }
std::unique_ptr<Objective> make_kto_objective(const LoomConfig&) { not_built("kto"); }

}  // namespace loom
