// Every optimizer against its float64 reference: tools/make_optim_fixtures.py runs 4 steps of
// each case (torch.optim for SGD/Adagrad/RMSprop/Adam/AdamW, tools/optim_reference.py's numpy
// implementation of docs/optimizers.md for the rest) on a synthetic model with an embedding, a
// fused QKV matrix, tall and wide hidden matrices, biases and norms, per-parameter weight decay
// and lr multipliers, varying lr and clipping coefficients. Loom, in fp32, must match after
// every step within the case's tolerance: max |loom - ref| / max |ref| over all parameters,
// 1e-6 for the elementwise and factored rules, 1e-5 for Muon and LDAdam (eigen/QR/NS5 in fp32).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <nlohmann/json.hpp>

#include <set>

#include "loom/backend/backend.h"
#include "loom/checkpoint/safetensors.h"
#include "loom/optim/optimizer.h"
#include "loom/train/config.h"
#include "test_util.h"

namespace loom {
namespace {

class OptimGolden : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    file = new SafetensorsFile(SafetensorsFile::read(test::fixture_dir() + "/optim_golden.safetensors"));
    spec = new nlohmann::json(nlohmann::json::parse(file->metadata_value("spec")));
  }
  static void TearDownTestSuite() {
    delete file;
    delete spec;
  }
  std::vector<double> values(const std::string& name) {
    const Tensor t = file->tensor(name, backend->allocator(), MEM_WORKSPACE);
    return std::vector<double>(t.data<double>(), t.data<double>() + t.numel());
  }
  std::vector<OptimParam> params() const {
    std::vector<OptimParam> list;
    for (const auto& j : (*spec)["params"]) {
      OptimParam q;
      q.name = j["name"].get<std::string>();
      q.offset = j["offset"].get<int64_t>();
      q.numel = j["numel"].get<int64_t>();
      q.matrix = j["matrix"].get<bool>();
      q.hidden = j["hidden"].get<bool>();
      q.weight_decay = j["weight_decay"].get<float>();
      q.lr_scale = j["lr_scale"].get<float>();
      const int64_t total_rows = q.matrix ? j["shape"][0].get<int64_t>() : 1;
      const int64_t cols = q.numel / total_rows;
      int64_t row = 0;
      for (const auto& s : j["segments"]) {
        const int64_t rows = s["rows"].get<int64_t>();
        q.segments.push_back({q.offset + row * cols, rows, cols, s["block_rows"].get<int64_t>()});
        row += rows;
      }
      list.push_back(q);
    }
    return list;
  }

  static SafetensorsFile* file;
  static nlohmann::json* spec;
  std::unique_ptr<Backend> backend = make_cpu_backend();
};

SafetensorsFile* OptimGolden::file = nullptr;
nlohmann::json* OptimGolden::spec = nullptr;

void copy_f64(const std::vector<double>& src, const Tensor& dst, bool accumulate) {
  float* d = dst.data<float>();
  for (size_t i = 0; i < src.size(); ++i) d[i] = static_cast<float>(src[i]) + (accumulate ? d[i] : 0.0f);
}

TEST_F(OptimGolden, EveryCaseMatchesTheFloat64ReferenceAfterEveryStep) {
  const int64_t P = (*spec)["total"].get<int64_t>(), steps = (*spec)["steps"].get<int64_t>();
  const auto lrs = (*spec)["lrs"].get<std::vector<double>>();
  const auto scales = (*spec)["grad_scales"].get<std::vector<double>>();
  std::set<std::string> covered;
  for (const auto& c : (*spec)["cases"]) {
    const std::string name = c["name"].get<std::string>();
    SCOPED_TRACE(name + ": " + c["set"].get<std::string>());
    LoomConfig lc;
    apply_overrides(lc, c["set"].get<std::string>(), "fixture case " + name);
    Tensor params = Tensor::empty(backend->allocator(), {P}, DTYPE_F32, MEM_PARAMETERS);
    Tensor grads = Tensor::zeros(backend->allocator(), {P}, DTYPE_F32, MEM_GRADIENTS);
    copy_f64(values("params"), params, false);
    auto opt = make_optimizer(*backend, params, grads, this->params(), lc.train.optim);
    covered.insert(opt->name());
    const double tol = c["tolerance"].get<double>();
    for (int64_t k = 0; k < steps; ++k) {
      copy_f64(values("grad." + std::to_string(k)), grads, opt->keeps_gradients());
      opt->step(static_cast<float>(lrs[static_cast<size_t>(k)]), static_cast<float>(scales[static_cast<size_t>(k)]));
      const std::vector<double> ref = values(name + ".params." + std::to_string(k));
      double err = 0.0, scale = 0.0;
      for (int64_t i = 0; i < P; ++i) {
        err = std::max(err, std::fabs(static_cast<double>(params.data<float>()[i]) - ref[static_cast<size_t>(i)]));
        scale = std::max(scale, std::fabs(ref[static_cast<size_t>(i)]));
      }
      EXPECT_LE(err / scale, tol) << "after step " << k + 1;
      if (k == steps - 1) std::printf("%-16s %.2e (tolerance %.0e)\n", name.c_str(), err / scale, tol);
      // The test can fail: the update moved the parameters by far more than the tolerance.
      if (k == 0) {
        const std::vector<double> init = values("params");
        double moved = 0.0;
        for (int64_t i = 0; i < P; ++i) moved = std::max(moved, std::fabs(ref[static_cast<size_t>(i)] - init[static_cast<size_t>(i)]));
        EXPECT_GT(moved / scale, 100 * tol);
      }
    }
  }
  EXPECT_EQ(covered.size(), optimizer_names().size()) << "every optimizer has a golden case";
}

}  // namespace
}  // namespace loom
