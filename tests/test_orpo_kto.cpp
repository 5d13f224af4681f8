// ORPO (train/orpo.h) and KTO (train/kto.h):
//   - each term function's derivatives against central differences, and its values written out;
//     the ORPO micro-batch's row weights against central differences of its loss in the rows'
//     summed cross-entropies;
//   - against PyTorch (tools/orpo_kto_reference.py, float64 autograd of TRL's formulas; the
//     committed fixtures tests/fixtures/orpo_kto/*.safetensors): on a tiny GPT-2 and a tiny Llama
//     in f32, the loss within 1e-5 relative and every parameter's gradient within 1e-5 of its
//     tensor's largest element; TRL's metrics too. Broken variants (ORPO with summed
//     log-probabilities, KTO without z0's clamp) give losses the tolerance tells apart;
//   - KTO's rows (examples, then each one's mismatched sequence: TRL's rotation, cut to the row;
//     the fixture's rows rebuilt) and its live reference (a frozen copy, or LoRA's base); training
//     that learns;
//   - each component as the run drives it, through its registry row (train/objective.h);
//   - the unpaired preference file's errors, named by file and line, and the unpairing of pairs.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>

#include "loom/checkpoint/safetensors.h"
#include "loom/core/str_printf.h"
#include "loom/comm/communicator.h"
#include "loom/core/targets.h"
#include "loom/data/tokenizer.h"
#include "loom/train/dpo.h"
#include "loom/train/kto.h"
#include "loom/train/orpo.h"
#include "loom/train/parallelize.h"
#include "parity_util.h"
#include "test_util.h"

namespace loom {
namespace {

namespace fs = std::filesystem;

// ---- the term functions --------------------------------------------------------------------

TEST(Orpo, PairTermDerivativesMatchCentralDifferencesAndTheFormula) {
  OrpoConfig c;
  c.beta = 0.3;
  const double h = 1e-6;
  // Long completions (a far below 0), and short likely ones (a near 0: log1mexp's other branch).
  for (const auto& [lw, ll, nw, nl] : {std::tuple{-7.5, -9.25, 5, 7}, std::tuple{-0.2, -0.9, 2, 3},
                                       std::tuple{-0.01, -3.0, 1, 4}}) {
    const OrpoPairTerms t = orpo_pair(c, lw, ll, nw, nl);
    const double dw = (orpo_pair(c, lw + h, ll, nw, nl).loss - orpo_pair(c, lw - h, ll, nw, nl).loss) / (2 * h);
    const double dl = (orpo_pair(c, lw, ll + h, nw, nl).loss - orpo_pair(c, lw, ll - h, nw, nl).loss) / (2 * h);
    EXPECT_NEAR(t.d_chosen, dw, 1e-8) << lw;
    EXPECT_NEAR(t.d_rejected, dl, 1e-8) << lw;
    // Written out: P = exp(l / |y|), odds = P / (1 - P), L = log(odds_w / odds_l).
    const double pw = std::exp(lw / nw), pl = std::exp(ll / nl);
    const double L = std::log((pw / (1 - pw)) / (pl / (1 - pl)));
    EXPECT_NEAR(t.log_odds, L, 1e-10);
    EXPECT_NEAR(t.loss, -0.3 * std::log(1.0 / (1.0 + std::exp(-L))), 1e-12);
    EXPECT_NEAR(t.log_sigmoid, std::log(1.0 / (1.0 + std::exp(-L))), 1e-12);
    EXPECT_NEAR(t.reward_chosen, 0.3 * lw / nw, 1e-15);
    EXPECT_NEAR(t.reward_rejected, 0.3 * ll / nl, 1e-15);
  }
  // Equal averages: odds ratio 1, the term beta log 2.
  EXPECT_NEAR(orpo_pair(c, -6.0, -9.0, 2, 3).loss, 0.3 * std::log(2.0), 1e-12);
  EXPECT_NE(test::error_of([&] { orpo_pair(c, -1.0, -1.0, 0, 1); }).find("without counted targets"), std::string::npos);
}

TEST(Kto, ExampleTermDerivativesMatchCentralDifferencesAndTheFormula) {
  KtoConfig c;
  c.beta = 0.4, c.desirable_weight = 1.5, c.undesirable_weight = 0.75;
  const double h = 1e-6, ref = -11.0;
  for (const bool desirable : {true, false}) {
    for (const double z0 : {0.0, 0.8}) {
      for (const double logp : {-14.0, -10.5, -3.0}) {
        const KtoTerms t = kto_example(c, desirable, logp, ref, z0);
        const double up = kto_example(c, desirable, logp + h, ref, z0).loss;
        const double down = kto_example(c, desirable, logp - h, ref, z0).loss;
        const double d = (up - down) / (2 * h);
        EXPECT_NEAR(t.d_logp, d, 1e-9) << desirable << " " << z0 << " " << logp;
        const double r = logp - ref, w = desirable ? 1.5 : 0.75;
        const double v = desirable ? 1.0 / (1.0 + std::exp(-0.4 * (r - z0))) : 1.0 / (1.0 + std::exp(-0.4 * (z0 - r)));
        EXPECT_NEAR(t.loss, w * (1.0 - v), 1e-12);  // eq. 7: lambda_y - v(x, y)
        EXPECT_NEAR(t.reward, 0.4 * r, 1e-15);
      }
    }
  }
  // Policy == reference and z0 = 0: each example loses half its weight.
  EXPECT_NEAR(kto_example(c, true, -5.0, -5.0, 0.0).loss, 0.75, 1e-15);
  EXPECT_NEAR(kto_example(c, false, -5.0, -5.0, 0.0).loss, 0.375, 1e-15);
  // z0: the mean difference, clamped at 0.
  const std::vector<double> policy{-3.0, -5.0, -4.0}, reference{-3.5, -4.0, -4.0};
  EXPECT_DOUBLE_EQ(kto_kl_estimate(reference, policy), (0.5 - 1.0 + 0.0) / -3.0);
  EXPECT_EQ(kto_kl_estimate(policy, reference), 0.0) << "the mean is -1/6: clamped";
}

// A batch source whose rows() are given.
class GivenRows final : public BatchSource {
 public:
  explicit GivenRows(std::vector<RowInfo> rows) : rows_(std::move(rows)) {}
  void fill(const Tensor&, const Tensor&) override {}
  std::vector<RowInfo> rows() const override { return rows_; }

 private:
  std::vector<RowInfo> rows_;
};

// ORPO's micro-batch: the NLL over every chosen target and the pairs' terms; each row weight is
// the loss's derivative in that row's summed cross-entropy (central differences on one of its
// positions' losses), |y| counted from the targets.
TEST(Orpo, RowWeightsAreTheLossDerivativesInTheRowsCrossEntropies) {
  auto backend = make_cpu_backend();
  CpuAllocator host;
  const int64_t B = 4, T = 5;
  ActivationStore store;
  store.batch = B, store.seq_len = T;
  store.losses = Tensor::empty(host, {B, T}, DTYPE_F32, MEM_WORKSPACE);
  store.targets = Tensor::empty(host, {B, T}, DTYPE_I32, MEM_WORKSPACE);
  const int32_t I = kIgnoreTarget;
  const std::vector<int32_t> targets = {I, 3, 4, I, I, I, 5, I, I, I, 6, 7, 8, 9, I, I, I, 2, 2, 2};
  const std::vector<float> losses = {0, 1.5f, 2.25f, 0, 0,    0, 0.75f, 0,    0,    0,
                                     3, 0.5f, 1,     2, 0,    0, 0,     4.0f, 1.0f, 0.25f};
  std::copy(targets.begin(), targets.end(), store.targets.data<int32_t>());
  std::copy(losses.begin(), losses.end(), store.losses.data<float>());
  const GivenRows rows({{0, true, 0, 2}, {0, false, 0, 1}, {1, true, 0, 4}, {1, false, 0, 3}});
  OrpoConfig c;
  c.beta = 0.5;
  OrpoRowObjective objective(c);
  const double loss = objective.weigh(*backend, store, rows);
  // Written out: NLL over the 6 chosen targets, then the two pairs' terms.
  const double nll = (1.5 + 2.25 + 3.0 + 0.5 + 1.0 + 2.0) / 6.0;
  const double want = nll + (orpo_pair(c, -3.75, -0.75, 2, 1).loss + orpo_pair(c, -6.5, -5.25, 4, 3).loss) / 2.0;
  EXPECT_NEAR(loss, want, 1e-6);
  const std::vector<float> weights = store.row_weights;
  ASSERT_EQ(weights.size(), 4u);
  const int64_t counted_position[4] = {1, 6, 11, 17};
  for (int64_t r = 0; r < B; ++r) {
    float* at = store.losses.data<float>() + counted_position[r];
    const float saved = *at, h = 1e-2f;
    *at = saved + h;
    const double up = objective.weigh(*backend, store, rows);
    *at = saved - h;
    const double down = objective.weigh(*backend, store, rows);
    *at = saved;
    EXPECT_NEAR(weights[static_cast<size_t>(r)], (up - down) / (2.0 * h), 2e-4) << "row " << r;
  }
  const OrpoRowObjective::Stats s = objective.take_stats();
  EXPECT_EQ(s.pairs, 2 * (1 + 2 * B));
  EXPECT_EQ(s.batches, 1 + 2 * B);
  const nlohmann::json m = orpo_metrics(s);
  EXPECT_EQ(m["pairs"].get<int64_t>(), s.pairs);
  for (const char* key : {"loss", "nll_loss", "reward_chosen", "reward_rejected", "margin", "accuracy",
                          "log_odds_ratio", "log_odds_chosen"}) {
    EXPECT_TRUE(m.contains(key)) << key;
  }
  // Rows that are not a pair's chosen and rejected sequences, or no pairs at all, are refused.
  const GivenRows swapped({{0, false, 0, 2}, {0, true, 0, 1}, {1, true, 0, 4}, {1, false, 0, 3}});
  EXPECT_NE(test::error_of([&] { objective.weigh(*backend, store, swapped); }).find("not one pair's"),
            std::string::npos);
  EXPECT_NE(test::error_of([&] { objective.weigh(*backend, store, GivenRows({})); }).find("preference-jsonl"),
            std::string::npos);
}

// An example of these tokens (the completion's counted), named as line `line` of examples.jsonl.
UnpairedExample example(std::vector<int32_t> prompt, std::vector<int32_t> completion, bool desirable, int line) {
  UnpairedExample e;
  e.sequence.tokens = std::move(prompt);
  e.sequence.mask.assign(e.sequence.tokens.size(), 0);
  e.sequence.tokens.insert(e.sequence.tokens.end(), completion.begin(), completion.end());
  e.sequence.mask.insert(e.sequence.mask.end(), completion.size(), 1);
  e.sequence.counted = static_cast<int64_t>(completion.size());
  e.desirable = desirable;
  e.line = "examples.jsonl:" + std::to_string(line);
  return e;
}

// ---- against PyTorch ---------------------------------------------------------------------

fs::path fixture(const std::string& name) {
  const char* dir = std::getenv("LOOM_SOURCE_DIR");
  const fs::path source = dir && *dir ? fs::path(dir) : fs::current_path();
  return source / "tests" / "fixtures" / "orpo_kto" / (name + ".safetensors");
}

std::string sci(double x) { return str_printf("%.2e", x); }

// Each parameter's gradient against the fixture's: the worst error relative to its tensor's
// largest element, and the largest absolute difference.
struct GradientAgreement {
  double rel = 0, abs = 0;
};
GradientAgreement compare_gradients(Backend& backend, const Transformer& model, const SafetensorsFile& f,
                                    const std::string& variant) {
  CpuAllocator host;
  GradientAgreement worst;
  for (const ParamSpec& p : model.layout().params) {
    const std::vector<double> got = test::values(backend, model.grad(p.name));
    const std::vector<double> want = test::values(f.tensor("grad." + variant + "." + p.name, host, MEM_WORKSPACE));
    const double e = test::max_rel_error(got, want);
    EXPECT_LT(e, 1e-5) << variant << " " << p.name;
    worst.rel = std::max(worst.rel, e);
    for (size_t i = 0; i < got.size() && i < want.size(); ++i) {
      worst.abs = std::max(worst.abs, std::abs(got[i] - want[i]));
    }
  }
  return worst;
}

class OrpoKtoParity : public ::testing::TestWithParam<std::string> {};

TEST_P(OrpoKtoParity, OrpoLossGradientsAndMetricsMatchPyTorch) {
  const SafetensorsFile f = SafetensorsFile::read(fixture(GetParam()).string());
  auto backend = make_cpu_backend();
  CpuAllocator host;
  const auto values = [&](const std::string& name) { return test::values(f.tensor(name, host, MEM_WORKSPACE)); };
  Transformer model(*backend, test::config_from(f));
  for (const ParamSpec& p : model.layout().params) f.copy_into(p.name, model.param(p.name), *backend);
  const Tensor tokens = f.tensor("orpo.tokens", host, MEM_WORKSPACE);
  ActivationStore store = model.allocate_store(tokens.dim(0), tokens.dim(1));
  f.copy_into("orpo.tokens", store.tokens, *backend);
  f.copy_into("orpo.targets", store.targets, *backend);
  std::vector<RowInfo> rows;
  for (int64_t r = 0; r < tokens.dim(0); ++r) rows.push_back({r / 2, r % 2 == 0, 0.0, 0});  // (|y| from the targets)
  OrpoConfig c;
  c.beta = std::stod(f.metadata_value("orpo.beta"));
  OrpoRowObjective objective(c);
  model.zero_grads();
  model.forward(store);
  const double loss = objective.weigh(*backend, store, GivenRows(rows)), want = values("loss.orpo")[0];
  EXPECT_NEAR(loss, want, 1e-5 * std::abs(want));
  model.backward(store, 1.0f);
  const GradientAgreement g = compare_gradients(*backend, model, f, "orpo");
  // TRL's metrics: nll_loss, rewards chosen, rejected, margin, accuracy, log_odds_ratio, log_odds_chosen.
  const nlohmann::json m = orpo_metrics(objective.take_stats());
  const std::vector<double> trl = values("metrics.orpo");
  const char* keys[] = {"nll_loss", "reward_chosen", "reward_rejected", "margin", "accuracy", "log_odds_ratio",
                        "log_odds_chosen"};
  for (size_t k = 0; k < 7; ++k) {
    EXPECT_NEAR(m[keys[k]].get<double>(), trl[k], 1e-5 * std::max(1.0, std::abs(trl[k]))) << keys[k];
  }
  // The broken variant (summed log-probabilities in the odds) is far outside the tolerance.
  EXPECT_GT(std::abs(loss - values("loss.orpo.summed")[0]), 1e3 * 1e-5 * std::abs(want));
  RecordProperty("loss_abs_diff", sci(std::abs(loss - want)));
  RecordProperty("summed_loss_abs_diff", sci(std::abs(loss - values("loss.orpo.summed")[0])));
  RecordProperty("grad_max_abs_diff", sci(g.abs));
  RecordProperty("grad_max_rel_error", sci(g.rel));
}

// KTO: the reference is a frozen copy of the weights the model held when it was set (the
// fixture's second initialisation, or for kto_swapped its first), then the policy's are loaded.
TEST_P(OrpoKtoParity, KtoLossGradientsAndKlEstimateMatchPyTorch) {
  const SafetensorsFile f = SafetensorsFile::read(fixture(GetParam()).string());
  auto backend = make_cpu_backend();
  CpuAllocator host;
  const auto values = [&](const std::string& name) { return test::values(f.tensor(name, host, MEM_WORKSPACE)); };
  const std::vector<int32_t> labels = test::entry_values<int32_t>(f, "kto.labels");
  const auto n = static_cast<int64_t>(labels.size());
  std::vector<RowInfo> rows;
  for (int64_t r = 0; r < 2 * n; ++r) rows.push_back({r % n, r < n && labels[static_cast<size_t>(r % n)] != 0, 0.0, 0});
  KtoConfig c;
  c.beta = std::stod(f.metadata_value("kto.beta"));
  c.desirable_weight = std::stod(f.metadata_value("kto.desirable_weight"));
  c.undesirable_weight = std::stod(f.metadata_value("kto.undesirable_weight"));
  for (const std::string variant : {"kto", "kto_swapped"}) {
    const std::string policy = variant == "kto" ? "" : "reference.", reference = variant == "kto" ? "reference." : "";
    Transformer model(*backend, test::config_from(f));
    for (const ParamSpec& p : model.layout().params) f.copy_into(reference + p.name, model.param(p.name), *backend);
    KtoRowObjective objective(c);
    EXPECT_NE(objective.set_live_reference(model).find("frozen copy"), std::string::npos);
    for (const ParamSpec& p : model.layout().params) f.copy_into(policy + p.name, model.param(p.name), *backend);
    ActivationStore store = model.allocate_store(2 * n, f.tensor("kto.tokens", host, MEM_WORKSPACE).dim(1));
    f.copy_into("kto.tokens", store.tokens, *backend);
    f.copy_into("kto.targets", store.targets, *backend);
    model.zero_grads();
    objective.before_forward(*backend, store);
    model.forward(store);
    const double loss = objective.weigh(*backend, store, GivenRows(rows)), want = values("loss." + variant)[0];
    EXPECT_NEAR(loss, want, 1e-5 * std::abs(want)) << variant;
    for (int64_t r = n; r < 2 * n; ++r) {
      EXPECT_EQ(store.row_weights[static_cast<size_t>(r)], 0.0f) << "mismatched row " << r;
    }
    model.backward(store, 1.0f);
    const GradientAgreement g = compare_gradients(*backend, model, f, variant);
    const std::vector<double> z0 = values("kto." + variant + ".z0");  // before and after the clamp
    const nlohmann::json m = kto_metrics(objective.take_stats());
    EXPECT_NEAR(m["kl"].get<double>(), z0[1], 1e-5 * std::max(1.0, std::abs(z0[1]))) << variant;
    // Without the clamp the loss differs where z0 < 0 (the fixture's kto, in both models), far
    // outside the tolerance; where z0 > 0 the clamp changes nothing.
    const double broken = values("loss." + variant + ".noclamp")[0];
    if (z0[0] < 0) {
      EXPECT_GT(std::abs(loss - broken), 100 * 1e-5 * std::abs(want)) << variant;
    } else {
      EXPECT_DOUBLE_EQ(broken, want) << variant;
    }
    RecordProperty(variant + "_loss_abs_diff", sci(std::abs(loss - want)));
    RecordProperty(variant + "_noclamp_loss_abs_diff", sci(std::abs(loss - broken)));
    RecordProperty(variant + "_grad_max_abs_diff", sci(g.abs));
    RecordProperty(variant + "_grad_max_rel_error", sci(g.rel));
  }
}

// KtoBatches, given the fixture's examples (read back from its example rows), builds PyTorch's
// batch: the examples, then the mismatched sequences of TRL's rotation.
TEST_P(OrpoKtoParity, KtoBatchesBuildTheReferenceRows) {
  const SafetensorsFile f = SafetensorsFile::read(fixture(GetParam()).string());
  CpuAllocator host;
  const Tensor want_x = f.tensor("kto.tokens", host, MEM_WORKSPACE);
  const Tensor want_y = f.tensor("kto.targets", host, MEM_WORKSPACE);
  const std::vector<int32_t> labels = test::entry_values<int32_t>(f, "kto.labels");
  const int64_t n = static_cast<int64_t>(labels.size()), T = want_x.dim(1);
  std::vector<UnpairedExample> examples;
  for (int64_t i = 0; i < n; ++i) {
    const int32_t* x = want_x.data<int32_t>() + i * T;
    const int32_t* y = want_y.data<int32_t>() + i * T;
    int64_t first = 0, last = T - 1;  // the counted targets' span
    while (y[first] == kIgnoreTarget) ++first;
    while (y[last] == kIgnoreTarget) --last;
    std::vector<int32_t> prompt(x, x + first + 1), completion(y + first, y + last + 1);
    examples.push_back(example(prompt, completion, labels[static_cast<size_t>(i)] != 0, static_cast<int>(i + 1)));
  }
  KtoBatches batches(std::move(examples), T, 1, LOADER_ORDER_SEQUENTIAL, 0, "train");
  const Tensor tokens = Tensor::empty(host, {2 * n, T}, DTYPE_I32, MEM_WORKSPACE);
  const Tensor targets = Tensor::empty(host, {2 * n, T}, DTYPE_I32, MEM_WORKSPACE);
  batches.fill(tokens, targets);
  const auto ints = [](const Tensor& t) {
    return std::vector<int32_t>(t.data<int32_t>(), t.data<int32_t>() + t.numel());
  };
  EXPECT_EQ(ints(tokens), ints(want_x));
  EXPECT_EQ(ints(targets), ints(want_y));
}

INSTANTIATE_TEST_SUITE_P(TinyModels, OrpoKtoParity, ::testing::Values("gpt2", "llama"));

// ---- KTO's rows, reference and training --------------------------------------------------


TEST(Kto, RowsHoldTheExamplesThenEachOnesMismatchedSequence) {
  CpuAllocator host;
  KtoBatches batches({example({5, 6, 7}, {8, 9}, true, 1), example({11}, {12, 13, 14}, false, 2),
                      example({20}, {22, 23, 24, 25, 26}, true, 3)},
                     6, 1, LOADER_ORDER_SEQUENTIAL, 2, "train");
  EXPECT_EQ(batches.examples(), 3);
  EXPECT_EQ(batches.desirable(), 2);
  const Tensor tokens = Tensor::empty(host, {6, 6}, DTYPE_I32, MEM_WORKSPACE);
  const Tensor targets = Tensor::empty(host, {6, 6}, DTYPE_I32, MEM_WORKSPACE);
  batches.fill(tokens, targets);
  const int32_t I = kIgnoreTarget;
  // Rows 3..5: example i's prompt with example i - 1's completion (example 0's with example 2's,
  // 8 tokens cut to seq_len + 1 = 7).
  const std::vector<int32_t> want_x = {5, 6, 7,  8,  9,  2,  11, 12, 13, 14, 2, 2, 20, 22, 23, 24, 25, 26,
                                       5, 6, 7,  22, 23, 24, 11, 8,  9,  2,  2, 2, 20, 12, 13, 14, 2,  2};
  const std::vector<int32_t> want_y = {I, I, 8,  9,  I,  I,  12, 13, 14, I, I, I, 22, 23, 24, 25, 26, I,
                                       I, I, 22, 23, 24, 25, 8,  9,  I,  I, I, I, 12, 13, 14, I,  I,  I};
  EXPECT_EQ(std::vector<int32_t>(tokens.data<int32_t>(), tokens.data<int32_t>() + 36), want_x);
  EXPECT_EQ(std::vector<int32_t>(targets.data<int32_t>(), targets.data<int32_t>() + 36), want_y);
  const std::vector<RowInfo> rows = batches.rows();
  ASSERT_EQ(rows.size(), 6u);
  EXPECT_TRUE(rows[0].chosen && !rows[1].chosen && rows[2].chosen);
  EXPECT_FALSE(rows[3].chosen || rows[4].chosen || rows[5].chosen);
  const int64_t lengths[6] = {2, 3, 5, 4, 2, 3};  // the mismatched row 3's completion cut from 5 to 4
  for (size_t r = 0; r < 6; ++r) EXPECT_EQ(rows[r].length, lengths[r]) << r;
  for (size_t r = 3; r < 6; ++r) EXPECT_EQ(rows[r].pair, rows[r - 3].pair);
  // A longer example is refused naming its line; a batch without two examples is refused.
  const std::string e = test::error_of([] {
    KtoBatches({example({1, 2}, {3, 4}, true, 1), example({1, 2, 3, 4, 5}, {6, 7}, false, 2)}, 5, 1,
               LOADER_ORDER_SEQUENTIAL, 2, "train");
  });
  EXPECT_NE(e.find("examples.jsonl:2: the prompt and the completion are 7 tokens"), std::string::npos) << e;
  const Tensor two = Tensor::empty(host, {2, 6}, DTYPE_I32, MEM_WORKSPACE);
  EXPECT_NE(test::error_of([&] { batches.fill(two, two); }).find("at least 2 examples"), std::string::npos);
}

// A tiny Llama (all weights, or LoRA rank 4 on the attention) and its trainer: rows of 8
// positions, a constant learning rate of 1e-2, no clipping.
struct TinyRun {
  std::unique_ptr<Backend> backend;
  std::unique_ptr<Transformer> model;
  std::unique_ptr<Trainer> trainer;
};
TinyRun tiny_run(bool lora) {
  TinyRun r;
  r.backend = make_cpu_backend();
  ModelConfig c = model_preset("llama-tiny");
  if (lora) c.peft_method = PeftMethod::lora, c.lora_rank = 4, c.lora_targets = "q,k,v,o";
  r.model = std::make_unique<Transformer>(*r.backend, c);
  r.model->init_weights(3);
  TrainConfig tc;
  tc.batch_size = 8, tc.seq_len = 8, tc.steps = 40, tc.grad_clip = 0.0;
  tc.schedule.warmup = 0, tc.schedule.max_lr = tc.schedule.min_lr = 1e-2;
  r.trainer = std::make_unique<Trainer>(*r.backend, *r.model, tc);
  return r;
}

// `steps` more training steps; the last one's stats.
template <typename Loss>
typename Loss::Stats last_of_steps(Trainer& trainer, BatchSource& batches, Loss& objective, int steps) {
  typename Loss::Stats last;
  for (int s = 0; s < steps; ++s) {
    objective.take_stats();
    trainer.train_step(batches);
    last = objective.take_stats();
  }
  return last;
}

// A tiny Llama trained with KTO on four examples: at the first step the policy is the reference
// (r = 0, z0 = 0), so every example loses half its weight; the loss then falls, and the desirable
// completions' rewards end above 0, the undesirable ones' below, for a live reference that is a
// frozen copy and for LoRA's base.
TEST(Kto, TrainingRaisesTheDesirableCompletionsAgainstALiveReference) {
  for (const bool lora : {false, true}) {
    TinyRun run = tiny_run(lora);
    std::vector<UnpairedExample> examples;
    for (int32_t i = 0; i < 4; ++i) examples.push_back(example({4 + i, 9, 12}, {20 + i, 30}, i % 2 == 0, i + 1));
    KtoBatches batches(std::move(examples), 8, 7, LOADER_ORDER_SHUFFLED, 0, "train");
    KtoConfig kc;
    kc.beta = 0.5, kc.undesirable_weight = 1.5;
    KtoRowObjective objective(kc);
    EXPECT_NE(objective.set_live_reference(*run.model).find(lora ? "adapters off" : "frozen copy"), std::string::npos);
    run.trainer->set_objective(&objective);
    EXPECT_NEAR(run.trainer->train_step(batches).loss, (2 * 1.0 + 2 * 1.5) / 4 * 0.5, 1e-6) << "policy == reference";
    const KtoRowObjective::Stats first = objective.take_stats();
    EXPECT_EQ(first.desirable, 2);
    EXPECT_NEAR(first.kl, 0.0, 1e-6);
    const KtoRowObjective::Stats last = last_of_steps(*run.trainer, batches, objective, 29);
    EXPECT_LT(last.loss, 0.6 * first.loss) << (lora ? "LoRA" : "full");
    EXPECT_GT(last.reward_desirable, 0.0) << (lora ? "LoRA" : "full");
    EXPECT_LT(last.reward_undesirable, 0.0) << (lora ? "LoRA" : "full");
  }
}

// ORPO on a tiny Llama: the loss falls and every pair ends preferred.
TEST(Orpo, TrainingPrefersTheChosenCompletions) {
  TinyRun run = tiny_run(false);
  std::vector<PreferencePair> pairs;
  for (int32_t i = 0; i < 4; ++i) {
    PreferencePair p;
    for (int side = 0; side < 2; ++side) {
      SftStream& s = side == 0 ? p.chosen : p.rejected;
      s.tokens = {4 + i, 9, 12, (side == 0 ? 20 : 40) + i, side == 0 ? 30 : 50};
      s.mask = {0, 0, 0, 1, 1};
      s.counted = 2;
    }
    p.line = "pairs.jsonl:" + std::to_string(i + 1);
    pairs.push_back(std::move(p));
  }
  PreferenceBatches batches(std::move(pairs), 8, 7, LOADER_ORDER_SHUFFLED, 0, "train");
  OrpoRowObjective objective(OrpoConfig{});
  run.trainer->set_objective(&objective);
  const double first = run.trainer->train_step(batches).loss;
  const OrpoRowObjective::Stats last = last_of_steps(*run.trainer, batches, objective, 39);
  EXPECT_EQ(last.pairs, 4);
  EXPECT_LT(last.loss, 0.25 * first);
  EXPECT_EQ(last.correct, 4.0);
}

// ---- through the objective seam (train/objective.h) ---------------------------------------

// What an objective records and prints.
class CapturingSink final : public ObjectiveSink {
 public:
  void record(const ObjectiveRecord& record) override { records.push_back(to_json(record)); }
  void line(const std::string& text) override { lines.push_back(text); }
  std::vector<nlohmann::json> records;
  std::vector<std::string> lines;
};

// A component as the run drives it (train/run.cpp): its row's check and make, read_data,
// make_splits into the run's TrainingData, set_up, one step, its record and line, validation.
struct SeamRun {
  LoomConfig config;
  std::unique_ptr<Backend> backend = make_cpu_backend();
  std::unique_ptr<Communicator> world = make_local_communicator();
  std::unique_ptr<Objective> objective;
  std::unique_ptr<ParallelLayout> layout;
  TrainingModel parts;
  std::unique_ptr<TrainingData> data;
  CapturingSink sink;
  std::unique_ptr<ObjectiveContext> ctx;

  SeamRun(const std::string& name, SftFormat format, const std::string& input) {
    config.loop.objective = name;
    config.data.format = format, config.data.input = input, config.data.tokenizer = "byte";
    config.model = model_preset("llama-tiny");
    config.model.vocab_size = 0;  // follows the tokenizer
    config.train.batch_size = 4, config.train.seq_len = 16;
    const ObjectiveRow& row = objective_row(name);
    row.check(config);
    objective = row.make(config);
    objective->read_data(config);
    layout = std::make_unique<ParallelLayout>(config, *world, *backend);
    parts.local_config = config.model;
    parts.model = std::make_unique<Transformer>(*backend, config.model);
    parts.model->init_weights(3);
    parts.trainer = std::make_unique<Trainer>(*backend, *parts.model, config.train);
    data = std::make_unique<TrainingData>(objective->make_splits(config, *parts.model), config, *layout,
                                          backend->allocator());
    ctx = std::make_unique<ObjectiveContext>(ObjectiveContext{*backend, config, parts, *data, sink});
    objective->set_up(*ctx);
  }
  // One step and its record; then validation and its record.
  std::pair<nlohmann::json, nlohmann::json> step_and_validate() {
    const StepStats stats = parts.trainer->train_step(data->train());
    objective->after_step(*ctx, stats, true);
    const nlohmann::json step = sink.records.back();
    const Validation v = objective->validate(*ctx);
    objective->after_validation(*ctx, 1, v);
    EXPECT_FALSE(v.reward);  // a held-out loss ("val_loss")
    return {step, sink.records.back()};
  }
};

std::string write_lines(const std::string& name, const std::vector<std::string>& lines) {
  const std::string path = (fs::temp_directory_path() / (name + std::to_string(::getpid()) + ".jsonl")).string();
  std::ofstream out(path);
  for (const std::string& line : lines) out << line << "\n";
  return path;
}

// Whether `row`'s check refuses `config` with this batch size and data format, naming `what`.
::testing::AssertionResult refuses(const ObjectiveRow& row, LoomConfig config, int64_t batch_size, SftFormat format,
                                   const std::string& what) {
  config.train.batch_size = batch_size, config.data.format = format;
  const std::string e = test::error_of([&] { row.check(config); });
  if (e.find(what) != std::string::npos) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "refusal: '" << e << "'";
}

// n preference pairs "i+i=": chosen 2i, rejected 2i + 1.
std::vector<std::string> pair_lines(int n) {
  std::vector<std::string> lines;
  for (int i = 1; i <= n; ++i) {
    lines.push_back(str_cat(R"({"prompt": ")", i, "+", i, R"(=", "chosen": ")", 2 * i, R"(", "rejected": ")", 2 * i + 1,
                            R"("})"));
  }
  return lines;
}

TEST(Orpo, ComponentRunsThroughTheObjectiveSeam) {
  const std::string path = write_lines("loom_test_orpo_pairs_", pair_lines(4));
  SeamRun run("orpo", SftFormat::preference_jsonl, path);
  ASSERT_EQ(run.sink.lines.size(), 1u);
  EXPECT_EQ(run.sink.lines[0], "orpo (beta 0.1): 3 training pairs, 1 held out; no reference model");
  const auto [step, val] = run.step_and_validate();
  EXPECT_EQ(step["step"].get<int64_t>(), 1);
  EXPECT_EQ(step["orpo"]["pairs"].get<int64_t>(), 2);
  EXPECT_NE(run.sink.lines[1].find("step 1: orpo loss "), std::string::npos) << run.sink.lines[1];
  EXPECT_EQ(val["val_orpo"]["pairs"].get<int64_t>(), 2) << "the held-out pair, in one batch of two";
  EXPECT_NE(run.sink.lines.back().find("step 1: validation orpo loss "), std::string::npos);
  EXPECT_EQ(run.objective->validation_name(), "ORPO loss");
  // The row's checks name the key.
  EXPECT_TRUE(refuses(objective_row("orpo"), run.config, 3, SftFormat::preference_jsonl, "train.batch_size (3)"));
  EXPECT_TRUE(refuses(objective_row("orpo"), run.config, 4, SftFormat::jsonl, "data.format = preference-jsonl"));
  fs::remove(path);
}

TEST(Kto, ComponentRunsThroughTheObjectiveSeam) {
  std::vector<std::string> lines;
  for (int i = 0; i < 6; ++i) {
    lines.push_back(str_cat(R"({"prompt": ")", i, "+", i, R"(=", "completion": ")", i % 3 == 2 ? i + 1 : 2 * i,
                            R"(", "label": )", i % 3 == 2 ? "false" : "true", "}"));
  }
  const std::string path = write_lines("loom_test_kto_examples_", lines);
  SeamRun run("kto", SftFormat::unpaired_preference_jsonl, path);
  ASSERT_EQ(run.sink.lines.size(), 2u);
  EXPECT_EQ(run.sink.lines[0], "kto (beta 0.1, desirable weight 1, undesirable weight 1): 5 training examples (4 "
                               "desirable, 1 undesirable), 1 held out; reference live: a frozen copy of the initial "
                               "weights; z0 from 2 mismatched rows a micro-batch");
  EXPECT_NE(run.sink.lines[1].find("note: kto: desirable_weight x desirable / (undesirable_weight x undesirable) = "
                                   "4.000; the KTO paper advises 1 to 4/3 (e.g. kto.desirable_weight = 0.25)"),
            std::string::npos) << run.sink.lines[1];
  const auto [step, val] = run.step_and_validate();
  EXPECT_EQ(step["kto"]["examples"].get<int64_t>(), 2);
  EXPECT_EQ(step["kto"]["kl"].get<double>(), 0.0) << "the policy is the reference at the first step";
  EXPECT_NEAR(step["kto"]["loss"].get<double>(), 0.5, 1e-6);
  EXPECT_EQ(val["val_kto"]["examples"].get<int64_t>(), 2) << "the held-out example, in one batch of two";
  EXPECT_NE(run.sink.lines.back().find("step 1: validation kto loss "), std::string::npos);
  // Pairs are read too; the row's checks name the key.
  const std::string pairs = write_lines("loom_test_kto_pairs_", pair_lines(2));
  SeamRun paired("kto", SftFormat::preference_jsonl, pairs);
  const std::string banner = paired.sink.lines[0];
  EXPECT_NE(banner.find("2 training examples (1 desirable, 1 undesirable), 2 held out"), std::string::npos) << banner;
  EXPECT_TRUE(refuses(objective_row("kto"), run.config, 2, SftFormat::preference_jsonl, "train.batch_size (2)"));
  EXPECT_TRUE(refuses(objective_row("kto"), run.config, 4, SftFormat::prompt_jsonl,
                      "data.format = unpaired-preference-jsonl"));
  fs::remove(path);
  fs::remove(pairs);
}

// ---- the data ----------------------------------------------------------------------------

TEST(Kto, UnpairedPreferenceFileErrorsNameTheLine) {
  const std::string path =
      (fs::temp_directory_path() / ("loom_test_unpaired_" + std::to_string(::getpid()) + ".jsonl")).string();
  const auto tok = load_tokenizer("byte");
  const auto error_for = [&](const std::string& text) {
    std::ofstream(path) << text;
    return test::error_of([&] { read_unpaired_preference_file(path, *tok); });
  };
  const std::string good = R"({"prompt": "1+1=", "completion": "2", "label": true})" "\n";
  const auto names = [&](const std::string& text, const std::string& what) {
    return error_for(text).find(path + what) != std::string::npos;
  };
  EXPECT_TRUE(names(good + R"({"prompt": "1+2=", "completion": "3"})" "\n", ":2: expected a boolean \"label\""));
  EXPECT_TRUE(names(good + R"({"prompt": "1+2=", "completion": "3", "label": "true"})" "\n", ":2: expected a boolean"));
  EXPECT_TRUE(names(good + "\n" + R"({"prompt": "1+2=", "label": false})" "\n",
                    ":3: expected a string \"completion\""));  // (the blank line counted)
  EXPECT_NE(error_for(good + "{\n").find(path + ":2: not valid JSON"), std::string::npos);
  EXPECT_NE(error_for(R"({"prompt": "a", "completion": "", "label": false})" "\n").find(":1: the completion is empty"),
            std::string::npos);
  EXPECT_NE(error_for("").find("no examples"), std::string::npos);
  std::ofstream(path) << good << R"({"prompt": "1+1=", "completion": "3", "label": false})" "\n";
  const std::vector<UnpairedExample> examples = read_unpaired_preference_file(path, *tok);
  ASSERT_EQ(examples.size(), 2u);
  EXPECT_TRUE(examples[0].desirable);
  EXPECT_FALSE(examples[1].desirable);
  EXPECT_EQ(examples[1].line, path + ":2");
  EXPECT_EQ(examples[0].sequence.counted, 2);  // "2" and the end-of-sequence token
  EXPECT_EQ(tok->decode(examples[1].sequence.tokens), "1+1=3" + tok->decode(std::vector<int32_t>{tok->eot_token()}));
  // Not supervised data for loom prepare.
  const std::string prepare =
      test::error_of([&] { read_sft_file(path, SftFormat::unpaired_preference_jsonl, *tok, ""); });
  EXPECT_NE(prepare.find("holds labelled completions: loom train reads them itself"), std::string::npos) << prepare;
  fs::remove(path);
}

TEST(Kto, PreferencePairsAreUnpairedAsTrlDoes) {
  PreferencePair p;
  p.chosen.tokens = {1, 2, 3}, p.chosen.counted = 1;
  p.rejected.tokens = {1, 2, 4, 5}, p.rejected.counted = 2;
  p.line = "pairs.jsonl:7";
  const std::vector<UnpairedExample> e = unpair_preferences({p, p});
  ASSERT_EQ(e.size(), 4u);
  EXPECT_TRUE(e[0].desirable && !e[1].desirable && e[2].desirable && !e[3].desirable);
  EXPECT_EQ(e[1].sequence.tokens, p.rejected.tokens);
  EXPECT_EQ(e[1].sequence.counted, 2);
  EXPECT_EQ(e[3].line, "pairs.jsonl:7");
}

}  // namespace
}  // namespace loom
