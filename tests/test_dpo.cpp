// Preference optimisation (train/dpo.h): each variant's pair loss and its derivatives against
// central differences, the preference rows (prompt and padding not counted, pairs kept together,
// too-long sequences refused by line), the preference file's errors, and DPO training that
// learns: on a tiny model the loss starts at log 2 (policy == reference) and falls, and every
// training pair ends preferred. The per-row gradients are checked against PyTorch in
// tests/test_dpo_parity.cpp.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>

#include "loom/core/targets.h"
#include "loom/data/tokenizer.h"
#include "loom/train/dpo.h"
#include "test_util.h"

namespace loom {
namespace {

TEST(Dpo, PairLossDerivativesMatchCentralDifferences) {
  for (const DpoLoss loss : {DpoLoss::sigmoid, DpoLoss::ipo, DpoLoss::simpo}) {
    DpoConfig c;
    c.loss = loss;
    c.beta = loss == DpoLoss::simpo ? 2.0 : 0.3;
    const double lw = -7.5, ll = -9.25, rw = -8.0, rl = -8.5;
    const PairTerms t = dpo_pair(c, lw, ll, rw, rl, 5, 7);
    const double h = 1e-6;
    const double dw = (dpo_pair(c, lw + h, ll, rw, rl, 5, 7).loss - dpo_pair(c, lw - h, ll, rw, rl, 5, 7).loss) / (2 * h);
    const double dl = (dpo_pair(c, lw, ll + h, rw, rl, 5, 7).loss - dpo_pair(c, lw, ll - h, rw, rl, 5, 7).loss) / (2 * h);
    EXPECT_NEAR(t.d_chosen, dw, 1e-8) << enum_name(loss);
    EXPECT_NEAR(t.d_rejected, dl, 1e-8) << enum_name(loss);
  }
  DpoConfig c;  // the values, written out
  c.beta = 0.3;
  const double z = 0.3 * ((-7.5 + 8.0) - (-9.25 + 8.5));
  EXPECT_NEAR(dpo_pair(c, -7.5, -9.25, -8.0, -8.5, 5, 7).loss, std::log1p(std::exp(-z)), 1e-12);
  EXPECT_NEAR(dpo_pair(c, -7.5, -9.25, -8.0, -8.5, 5, 7).reward_chosen, 0.3 * 0.5, 1e-12);
  EXPECT_NEAR(dpo_pair(c, -8.0, -8.5, -8.0, -8.5, 5, 7).loss, std::log(2.0), 1e-12) << "policy == reference";
  c.loss = DpoLoss::ipo;
  EXPECT_NEAR(dpo_pair(c, -7.5, -9.25, -8.0, -8.5, 5, 7).loss, std::pow(1.25 - 1.0 / 0.6, 2), 1e-12);
  c.loss = DpoLoss::simpo, c.beta = 2.0, c.gamma = 0.5;
  const double zs = 2.0 * -7.5 / 5 - 2.0 * -9.25 / 7 - 0.5;
  EXPECT_NEAR(dpo_pair(c, -7.5, -9.25, 0, 0, 5, 7).loss, std::log1p(std::exp(-zs)), 1e-12);
}

PreferencePair pair(std::vector<int32_t> prompt, std::vector<int32_t> chosen, std::vector<int32_t> rejected) {
  PreferencePair p;
  for (int side = 0; side < 2; ++side) {
    SftStream& s = side == 0 ? p.chosen : p.rejected;
    const std::vector<int32_t>& completion = side == 0 ? chosen : rejected;
    s.tokens = prompt;
    s.mask.assign(prompt.size(), 0);
    s.tokens.insert(s.tokens.end(), completion.begin(), completion.end());
    s.mask.insert(s.mask.end(), completion.size(), 1);
    s.counted = static_cast<int64_t>(completion.size());
  }
  p.line = "pairs.jsonl:1";
  return p;
}

TEST(Dpo, RowsHoldPairsWithOnlyTheCompletionsCounted) {
  CpuAllocator host;
  PreferenceBatches batches({pair({5, 6, 7}, {8, 9}, {10}), pair({11}, {12, 13, 14}, {15, 16})}, 6, 1,
                            LOADER_ORDER_SEQUENTIAL, 2, "train");
  const Tensor tokens = Tensor::empty(host, {4, 6}, DTYPE_I32, MEM_WORKSPACE);
  const Tensor targets = Tensor::empty(host, {4, 6}, DTYPE_I32, MEM_WORKSPACE);
  batches.fill(tokens, targets);
  const int32_t I = kIgnoreTarget;
  const std::vector<int32_t> want_x = {5, 6, 7, 8, 9, 2, 5, 6, 7, 10, 2, 2, 11, 12, 13, 14, 2, 2, 11, 15, 16, 2, 2, 2};
  const std::vector<int32_t> want_y = {I, I, 8, 9, I, I, I, I, 10, I, I, I, 12, 13, 14, I, I, I, 15, 16, I, I, I, I};
  EXPECT_EQ(std::vector<int32_t>(tokens.data<int32_t>(), tokens.data<int32_t>() + 24), want_x);
  EXPECT_EQ(std::vector<int32_t>(targets.data<int32_t>(), targets.data<int32_t>() + 24), want_y);
  const std::vector<RowInfo> rows = batches.rows();
  ASSERT_EQ(rows.size(), 4u);
  EXPECT_TRUE(rows[0].chosen && !rows[1].chosen && rows[0].pair == 0 && rows[1].pair == 0 && rows[2].pair == 1);
  EXPECT_EQ(rows[0].length, 2);
  EXPECT_EQ(rows[3].length, 2);
  // A sequence longer than seq_len + 1 tokens: refused naming its line.
  const std::string e = test::error_of([&] {
    PreferenceBatches({pair({1, 2, 3, 4, 5}, {6, 7}, {8})}, 5, 1, LOADER_ORDER_SEQUENTIAL, 2, "train");
  });
  EXPECT_NE(e.find("pairs.jsonl:1: the prompt and the chosen completion are 7 tokens"), std::string::npos) << e;
  // An odd number of rows cannot hold pairs.
  const Tensor odd = Tensor::empty(host, {3, 6}, DTYPE_I32, MEM_WORKSPACE);
  EXPECT_NE(test::error_of([&] { batches.fill(odd, odd); }).find("must be even"), std::string::npos);
}

TEST(Dpo, PreferenceFileErrorsNameTheLine) {
  const std::string path = (std::filesystem::temp_directory_path() / "loom_test_pairs.jsonl").string();
  const auto tok = load_tokenizer("byte");
  const auto error_for = [&](const std::string& text) {
    std::ofstream(path) << text;
    return test::error_of([&] { read_preference_file(path, *tok); });
  };
  const std::string good = R"({"prompt": "1+1=", "chosen": "2", "rejected": "3"})" "\n";
  EXPECT_NE(error_for(good + R"({"prompt": "1+2=", "chosen": "3"})" "\n").find(path + ":2: expected a string \"rejected\""),
            std::string::npos);
  EXPECT_NE(error_for(good + "{\n").find(path + ":2: not valid JSON"), std::string::npos);
  EXPECT_NE(error_for(R"({"prompt": "a", "chosen": "", "rejected": "b"})" "\n").find(":1: the chosen is empty"),
            std::string::npos);
  std::ofstream(path) << good;
  const std::vector<PreferencePair> pairs = read_preference_file(path, *tok);
  ASSERT_EQ(pairs.size(), 1u);
  EXPECT_EQ(pairs[0].chosen.counted, 2);  // "2" and the end-of-sequence token
  EXPECT_EQ(tok->decode(pairs[0].rejected.tokens), "1+1=3" + tok->decode(std::vector<int32_t>{tok->eot_token()}));
  std::filesystem::remove(path);
}

TEST(Dpo, TrainingPrefersTheChosenCompletions) {
  auto backend = make_cpu_backend();
  const ModelConfig c = model_preset("llama-tiny");
  Transformer model(*backend, c);
  model.init_weights(3);
  TrainConfig tc;
  tc.batch_size = 8, tc.seq_len = 8, tc.steps = 40, tc.grad_clip = 0.0;
  tc.schedule.warmup = 0, tc.schedule.max_lr = tc.schedule.min_lr = 1e-2;
  Trainer trainer(*backend, model, tc);
  std::vector<PreferencePair> pairs;
  for (int32_t i = 0; i < 4; ++i) pairs.push_back(pair({4 + i, 9, 12}, {20 + i, 30}, {40 + i, 50}));
  PreferenceBatches batches(std::move(pairs), 8, 7, LOADER_ORDER_SHUFFLED, 0, "train");
  DpoConfig dc;
  DpoObjective objective(dc);
  objective.compute_reference(trainer, batches, 8);
  trainer.set_objective(&objective);
  const double first = trainer.train_step(batches).loss;
  EXPECT_NEAR(first, std::log(2.0), 1e-5) << "the policy starts as the reference";
  DpoObjective::Stats last;
  for (int s = 1; s < 40; ++s) {
    objective.take_stats();
    trainer.train_step(batches);
    last = objective.take_stats();
  }
  EXPECT_EQ(last.pairs, 4);
  EXPECT_LT(last.loss / 4, 0.3);
  EXPECT_EQ(last.correct, 4.0);
  EXPECT_GT(last.reward_chosen, last.reward_rejected);
}

// dpo.reference = live: the reference log-probabilities of each micro-batch from the base with
// LoRA's adapters off, or from a frozen copy of the initial weights, give the run that the
// references computed once give (the same numbers, up to the summation order of a batch of
// other rows: 1e-6), for full fine-tuning and LoRA, at every step.
TEST(Dpo, LiveReferenceGivesTheOnceComputedRun) {
  for (const bool lora : {false, true}) {
    std::vector<double> curves[2];
    for (const DpoReference kind : {DpoReference::once, DpoReference::live}) {
      auto backend = make_cpu_backend();
      ModelConfig c = model_preset("llama-tiny");
      if (lora) c.peft_method = PeftMethod::lora, c.lora_rank = 4, c.lora_targets = "q,k,v,o";
      Transformer model(*backend, c);
      model.init_weights(3);
      TrainConfig tc;
      tc.batch_size = 8, tc.seq_len = 8, tc.steps = 8, tc.grad_clip = 0.0;
      tc.schedule.warmup = 0, tc.schedule.max_lr = tc.schedule.min_lr = 1e-2;
      Trainer trainer(*backend, model, tc);
      std::vector<PreferencePair> pairs;
      for (int32_t i = 0; i < 6; ++i) pairs.push_back(pair({4 + i, 9, 12}, {20 + i, 30}, {40 + i, 50}));
      PreferenceBatches batches(std::move(pairs), 8, 7, LOADER_ORDER_SHUFFLED, 0, "train");
      DpoConfig dc;
      dc.reference = kind;
      DpoObjective objective(dc);
      objective.compute_reference(trainer, batches, 8);
      if (kind == DpoReference::live) {
        EXPECT_NE(objective.set_live_reference(model).find(lora ? "adapters off" : "frozen copy"), std::string::npos);
      }
      trainer.set_objective(&objective);
      for (int s = 0; s < 8; ++s) curves[static_cast<int>(kind)].push_back(trainer.train_step(batches).loss);
    }
    EXPECT_NEAR(curves[0][0], std::log(2.0), 1e-5);
    EXPECT_LT(curves[0].back(), curves[0][0] - 0.05) << "the run learns (the test can fail)";
    for (size_t s = 0; s < curves[0].size(); ++s) {
      EXPECT_NEAR(curves[1][s], curves[0][s], 1e-6) << (lora ? "LoRA" : "full") << " step " << s;
    }
  }
}

}  // namespace
}  // namespace loom
