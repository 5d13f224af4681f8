// DPO, IPO and SimPO against PyTorch (tools/make_dpo_fixtures.py): two pairs through a tiny GPT-2
// and a tiny Llama, the reference log-probabilities given; Loom's objective (train/dpo.h) over
// the forward's per-position losses, its per-row weights through the backward, must give the
// reference's loss and every parameter's gradient. Tolerances (fp32 against float64): the loss
// within 1e-5 relative, each gradient tensor within 1e-5 of its largest element.
#include <gtest/gtest.h>

#include <cmath>

#include "loom/checkpoint/safetensors.h"
#include "loom/train/dpo.h"
#include "parity_util.h"
#include "test_util.h"

namespace loom {
namespace {

// The fixture's rows: pair r / 2, chosen on even rows, with the reference and length it stores.
class FixtureRows final : public BatchSource {
 public:
  FixtureRows(std::vector<double> reference, std::vector<int32_t> lengths)
      : reference_(std::move(reference)), lengths_(std::move(lengths)) {}
  void fill(const Tensor&, const Tensor&) override {}
  std::vector<RowInfo> rows() const override {
    std::vector<RowInfo> r;
    for (size_t i = 0; i < reference_.size(); ++i) {
      r.push_back({static_cast<int64_t>(i / 2), i % 2 == 0, reference_[i], lengths_[i]});
    }
    return r;
  }

 private:
  std::vector<double> reference_;
  std::vector<int32_t> lengths_;
};

class DpoParity : public ::testing::TestWithParam<std::tuple<std::string, std::string>> {};

TEST_P(DpoParity, LossAndEveryGradientMatchPyTorch) {
  const auto& [file, variant] = GetParam();
  const SafetensorsFile f = SafetensorsFile::read(test::fixture_dir() + "/dpo/" + file);
  auto backend = make_cpu_backend();
  CpuAllocator host;
  const auto values = [&](const std::string& name) { return test::values(f.tensor(name, host, MEM_WORKSPACE)); };
  const ModelConfig config = test::config_from(f);
  Transformer model(*backend, config);
  for (const ParamSpec& p : model.layout().params) f.copy_into(p.name, model.param(p.name), *backend);
  ActivationStore store = model.allocate_store(4, f.tensor("tokens", host, MEM_WORKSPACE).dim(1));
  f.copy_into("tokens", store.tokens, *backend);
  f.copy_into("targets", store.targets, *backend);
  const Tensor counted = f.tensor("lengths", host, MEM_WORKSPACE);
  const std::vector<int32_t> lengths(counted.data<int32_t>(), counted.data<int32_t>() + counted.numel());
  FixtureRows rows(values("reference"), lengths);
  DpoConfig dc;
  dc.loss = parse_enum<DpoLoss>(variant, "dpo.loss");
  dc.beta = std::stod(f.metadata_value("beta." + variant));
  dc.gamma = std::stod(f.metadata_value("gamma." + variant));
  DpoObjective objective(dc);
  model.zero_grads();
  model.forward(store);
  const double loss = objective.weigh(*backend, store, rows), want = values("loss." + variant)[0];
  EXPECT_NEAR(loss, want, 1e-5 * std::abs(want));
  model.backward(store, 1.0f);
  double worst = 0.0;
  for (const ParamSpec& p : model.layout().params) {
    const double e = test::max_rel_error(test::values(*backend, model.grad(p.name)), values("grad." + variant + "." + p.name));
    EXPECT_LT(e, 1e-5) << p.name;
    worst = std::max(worst, e);
  }
  RecordProperty("grad_max_rel_error", std::to_string(worst));
  RecordProperty("loss_rel_error", std::to_string(std::abs(loss - want) / std::abs(want)));
}

INSTANTIATE_TEST_SUITE_P(TinyModels, DpoParity,
                         ::testing::Combine(::testing::Values("gpt2_tiny.safetensors", "llama_tiny.safetensors"),
                                            ::testing::Values("sigmoid", "ipo", "simpo")));

}  // namespace
}  // namespace loom
