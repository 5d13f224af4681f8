// The training run (train/run.h) without the command line: its loop's policies seen through a
// recording observer. The cadence of logged steps and validation, --stop-at-step and a resume
// that continues bitwise, an anomaly skipped without a step report, the objective registry's
// refusals, and a dry run that takes no step.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "loom/core/error.h"
#include "loom/core/str_printf.h"
#include "loom/data/prepare.h"
#include "loom/train/objective.h"
#include "loom/train/run.h"

namespace loom {
namespace {

namespace fs = std::filesystem;

// What the run reported, in order.
struct Recorder final : RunObserver {
  std::vector<std::string> lines, warnings;
  std::vector<StepReport> steps;
  std::string sampled;
  bool dry = false, done = false;
  void line(const std::string& text) override { lines.push_back(text); }
  void warning(const std::string& text) override { warnings.push_back(text); }
  void dry_run(const TrainingRun&) override { dry = true; }
  void started(const TrainingRun&) override {}
  void step(const StepReport& r) override { steps.push_back(r); }
  void sample(const TrainingRun&, const std::string& text) override { sampled = text; }
  void finished(const TrainingRun&) override { done = true; }
  bool said(const std::string& needle) const {
    for (const std::string& l : lines) {
      if (l.find(needle) != std::string::npos) return true;
    }
    return false;
  }
};

class RunTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("loom_test_run_" + std::to_string(::getpid()));
    fs::remove_all(dir_);
    std::vector<std::string> documents;
    for (int i = 0; i < 200; ++i) documents.push_back("the quick brown fox " + std::to_string(i * 7919 % 1000) + " jumps. ");
    prepare_dataset(documents, *load_tokenizer("byte"), (dir_ / "data").string(), 0.1);
  }
  void TearDown() override { fs::remove_all(dir_); }

  LoomConfig config(const std::string& name, const std::string& extra = "") const {
    LoomConfig c;
    apply_overrides(c, "model.n_layer=2,model.n_head=2,model.n_kv_head=2,model.d_model=32,model.d_ff=64,"
                       "model.max_seq_len=16,model.vocab_size=0,train.seq_len=16,train.batch_size=4,train.steps=6,"
                       "optim.warmup_steps=1,train.eval_every=3,train.eval_batches=1,train.checkpoint_every=2,"
                       "train.log_every=4,train.memory_check=false,train.watchdog_seconds=0,sample.max_new_tokens=4,"
                       "data.tokenizer=byte,data.dir=" + (dir_ / "data").string() + ",run.dir=" + (dir_ / "runs").string() +
                       ",run.name=" + name + (extra.empty() ? "" : "," + extra), "test");
    resolve_run_config(c);
    return c;
  }
  std::vector<double> losses(const Recorder& r) const {
    std::vector<double> out;
    for (const StepReport& s : r.steps) out.push_back(s.stats.loss);
    return out;
  }
  fs::path dir_;
};

TEST_F(RunTest, LogsValidatesAndCheckpointsOnItsCadenceThenSamples) {
  Recorder r;
  TrainingRun run(config("cadence"), RunOptions{}, r, make_local_communicator());
  EXPECT_EQ(run.run(), 0);
  ASSERT_EQ(r.steps.size(), 6u);
  // Logged: every log_every = 4th step, every validation step (3, 6) and the last.
  const std::vector<bool> logged = {false, false, true, true, false, true};
  for (size_t i = 0; i < 6; ++i) EXPECT_EQ(r.steps[i].logged, logged[i]) << "step " << i + 1;
  EXPECT_TRUE(r.said("step 3: validation loss"));
  EXPECT_TRUE(r.said("step 6: validation loss"));
  EXPECT_TRUE(std::isfinite(run.last_validation()));
  EXPECT_EQ(run.validation_name(), "loss");
  for (const int step : {2, 4, 6}) {
    EXPECT_TRUE(fs::exists(dir_ / "runs" / "cadence" / "checkpoints" / str_printf("step_%08d", step))) << step;
  }
  EXPECT_TRUE(r.done);
  EXPECT_EQ(r.sampled.rfind("The", 0), 0u);  // sample.prompt's default starts the text
  EXPECT_TRUE(r.warnings.empty());
}

// --stop-at-step, then --resume: the same losses as one uninterrupted run, bit for bit.
TEST_F(RunTest, StopAtAStepThenResumeContinuesBitwise) {
  Recorder straight;
  EXPECT_EQ(TrainingRun(config("straight"), RunOptions{}, straight, make_local_communicator()).run(), 0);
  Recorder first, second;
  RunOptions stop;
  stop.stop_at = 3;
  EXPECT_EQ(TrainingRun(config("stopped"), stop, first, make_local_communicator()).run(), 0);
  EXPECT_TRUE(first.said("stopped after step 3 (--stop-at-step)"));
  EXPECT_FALSE(first.done);
  RunOptions resume;
  resume.resume = true;
  EXPECT_EQ(TrainingRun(config("stopped"), resume, second, make_local_communicator()).run(), 0);
  EXPECT_TRUE(second.said("resumed from"));
  std::vector<double> both = losses(first);
  for (double l : losses(second)) both.push_back(l);
  EXPECT_EQ(both, losses(straight));
}

// train.on_anomaly = skip: the poisoned step is a warning and no step report; the run goes on.
TEST_F(RunTest, AnAnomalousStepIsSkippedWithoutAStepReport) {
  Recorder r;
  TrainingRun run(config("skip", "train.on_anomaly=skip,train.inject_fault_step=1"), RunOptions{}, r,
                  make_local_communicator());
  EXPECT_EQ(run.run(), 0);
  EXPECT_EQ(r.steps.size(), 5u);  // 6 steps, one skipped
  ASSERT_EQ(r.warnings.size(), 1u);
  EXPECT_NE(r.warnings[0].find("step 2: loss nan is not finite"), std::string::npos) << r.warnings[0];
  EXPECT_NE(r.warnings[0].find("skipped (no update)"), std::string::npos);
}

TEST_F(RunTest, ADryRunTakesNoStep) {
  Recorder r;
  RunOptions dry;
  dry.dry_run = true;
  EXPECT_EQ(TrainingRun(config("dry"), dry, r, make_local_communicator()).run(), 0);
  EXPECT_TRUE(r.dry);
  EXPECT_TRUE(r.steps.empty());
  EXPECT_FALSE(fs::exists(dir_ / "runs" / "dry" / "metrics.jsonl"));
}

// The registry names every objective; a wrong one, a data.format the objective does not read and
// an objective's layout are refused before anything is built, naming the key.
TEST_F(RunTest, TheObjectiveRegistryRefusesByName) {
  std::vector<std::string> names;
  for (const ObjectiveRow& row : objective_rows()) names.emplace_back(row.name);
  for (const char* name : {"lm", "dpo", "grpo", "distill"}) {
    EXPECT_NE(std::find(names.begin(), names.end(), name), names.end()) << name;
  }
  Recorder r;
  try {
    TrainingRun run(config("bad", "train.objective=nope"), RunOptions{}, r, make_local_communicator());  // throws
    FAIL() << "an unknown objective was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("train.objective must be one of lm | dpo"), std::string::npos) << e.what();
  }
  try {
    TrainingRun run(config("bad", "data.format=prompt-jsonl,data.input=x.jsonl"), RunOptions{}, r,
                    make_local_communicator());
    FAIL() << "prompts were accepted by train.objective = lm";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("data.format = prompt-jsonl holds prompts with answers: train them with "
                                         "train.objective = grpo"), std::string::npos) << e.what();
  }
  EXPECT_EQ(objectives_reading("preference-jsonl").find("dpo"), 0u);
  EXPECT_FALSE(objective_row("grpo").layout.data_parallel);
  EXPECT_TRUE(objective_row("lm").layout.model_parallel);
}

}  // namespace
}  // namespace loom
