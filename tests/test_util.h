// Helpers for op tests: random tensors from Philox, naive comparisons, and a float64
// central-difference gradient check.
#pragma once
#include <gtest/gtest.h>

#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <cmath>
#include <fstream>
#include <functional>
#include <iterator>
#include <string>
#include <vector>

#include "loom/backend/backend.h"
#include "loom/checkpoint/safetensors.h"
#include "loom/core/error.h"
#include "loom/core/philox.h"
#include "loom/core/tensor.h"
#include "loom/arch/param_layout.h"

namespace loom::test {

// The message of the loom::Error f throws ("" if none).
inline std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}


#ifdef LOOM_FIXTURE_DIR
// The folder of ctest's fixtures for the programs built with their path (LOOM_FIXTURE_DIR, the
// build's): $LOOM_FIXTURE_DIR when set, so that programs moved to another machine
// (scripts/gpu_pack) read the fixtures carried beside them.
inline std::string fixture_dir() {
  const char* dir = std::getenv("LOOM_FIXTURE_DIR");
  return dir != nullptr && *dir != 0 ? std::string(dir) : std::string(LOOM_FIXTURE_DIR);
}
#endif

// A fixture a tools/ script writes (python3 tools/<script> --out DIR writes DIR/<file>):
// $LOOM_FIXTURE_DIR/<file> when ctest's setup test wrote it, else the script run here into a
// fresh temporary folder, returned in `temp` for the caller to remove. Empty when the script failed.
inline std::filesystem::path python_fixture(const std::string& script, const std::string& file, std::filesystem::path& temp) {
  namespace fs = std::filesystem;
  const char* dir = std::getenv("LOOM_FIXTURE_DIR");
  if (dir != nullptr && *dir != 0 && fs::exists(fs::path(dir) / file)) return fs::path(dir) / file;
  const char* source = std::getenv("LOOM_SOURCE_DIR");
  const char* python = std::getenv("LOOM_PYTHON");
  temp = fs::temp_directory_path() / ("loom_test_" + file + "_" + std::to_string(::getpid()));
  const std::string command = std::string(python && *python ? python : "/usr/bin/python3") + " \"" +
                              ((source && *source ? fs::path(source) : fs::current_path()) / "tools" / script).string() +
                              "\" --out \"" + temp.string() + "\" > /dev/null";
  return std::system(command.c_str()) == 0 ? temp / file : fs::path();
}

// A safetensors entry's values, as stored.
template <typename T>
std::vector<T> entry_values(const SafetensorsFile& f, const std::string& name) {
  CpuAllocator host;
  const Tensor t = f.tensor(name, host, MEM_WORKSPACE);
  return std::vector<T>(t.data<T>(), t.data<T>() + t.numel());
}

// A file's bytes ("" if unreadable).
inline std::string read_file_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// Uniform in [-scale, scale), deterministic in (seed).
inline Tensor random_tensor(Allocator& alloc, Shape shape, DType dtype, uint64_t seed, double scale = 1.0) {
  Tensor t = Tensor::empty(alloc, std::move(shape), dtype, MEM_WORKSPACE);
  std::vector<float> u(static_cast<size_t>(t.numel()));
  philox_fill_uniform(u.data(), t.numel(), seed, 0, 0);
  for (int64_t i = 0; i < t.numel(); ++i) {
    const double v = (2.0 * u[i] - 1.0) * scale;
    if (dtype == DTYPE_F64) t.data<double>()[i] = v;
    else t.data<float>()[i] = static_cast<float>(v);
  }
  return t;
}

inline Tensor random_tokens(Allocator& alloc, Shape shape, int32_t vocab, uint64_t seed) {
  Tensor t = Tensor::empty(alloc, std::move(shape), DTYPE_I32, MEM_WORKSPACE);
  std::vector<float> u(static_cast<size_t>(t.numel()));
  philox_fill_uniform(u.data(), t.numel(), seed, 1, 0);
  for (int64_t i = 0; i < t.numel(); ++i) t.data<int32_t>()[i] = std::min(vocab - 1, static_cast<int32_t>(u[i] * vocab));
  return t;
}

template <typename T>
std::vector<double> to_vector(const Tensor& t) {
  const T* p = t.data<T>();
  return std::vector<double>(p, p + t.numel());
}

inline std::vector<double> values(const Tensor& t) {
  return t.dtype() == DTYPE_F64 ? to_vector<double>(t) : to_vector<float>(t);
}

// The values of a tensor of any backend (read through Backend::read into host memory).
inline std::vector<double> values(Backend& backend, const Tensor& t) {
  CpuAllocator host;
  Tensor h = Tensor::empty(host, t.shape(), t.dtype(), MEM_WORKSPACE);
  backend.read(t, h.raw_data());
  return values(h);
}

// n token ids (i * 13 + i / 7) mod vocab: a fixed, non-trivial sequence for training tests.
inline std::vector<int32_t> cyclic_tokens(int64_t n, int32_t vocab) {
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) t[static_cast<size_t>(i)] = static_cast<int32_t>((i * 13 + i / 7) % vocab);
  return t;
}

// max |a - b| / max(max |b|, tiny): the error relative to the reference's scale.
inline double max_rel_error(const std::vector<double>& a, const std::vector<double>& b) {
  EXPECT_EQ(a.size(), b.size());
  double err = 0.0, scale = 0.0;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) {
    err = std::max(err, std::abs(a[i] - b[i]));
    scale = std::max(scale, std::abs(b[i]));
  }
  return err / std::max(scale, 1e-30);
}

// Central differences of loss() w.r.t. every element of x (f64) against `analytic`: the worst
// |numeric - analytic| / max(1, |analytic|) over the elements, and where it is (`worst_at`).
// Step 1e-6 gives ~1e-9 error for smooth ops.
inline double fd_worst_ratio(const Tensor& x, const std::vector<double>& analytic, const std::function<double()>& loss,
                             std::string* worst_at = nullptr) {
  LOOM_CHECK(x.dtype() == DTYPE_F64 && static_cast<int64_t>(analytic.size()) == x.numel(),
             "fd_worst_ratio: an f64 tensor and one analytic value per element");
  double* p = x.data<double>();
  const double h = 1e-6;
  double worst = 0.0;
  for (int64_t i = 0; i < x.numel(); ++i) {
    const double saved = p[i];
    p[i] = saved + h;
    const double up = loss();
    p[i] = saved - h;
    const double down = loss();
    p[i] = saved;
    const double numeric = (up - down) / (2 * h);
    const double ratio = std::abs(numeric - analytic[i]) / std::max(1.0, std::abs(analytic[i]));
    if (ratio > worst && worst_at != nullptr) {
      *worst_at = "element " + std::to_string(i) + ": numeric " + std::to_string(numeric) + " analytic " +
                  std::to_string(analytic[i]);
    }
    worst = std::max(worst, ratio);
  }
  return worst;
}

// fd_worst_ratio within tol: |numeric - analytic| <= tol * max(1, |analytic|) for every element.
inline void expect_gradient_matches(const Tensor& x, const std::vector<double>& analytic,
                                    const std::function<double()>& loss, double tol, const char* what) {
  ASSERT_EQ(x.dtype(), DTYPE_F64);
  ASSERT_EQ(static_cast<int64_t>(analytic.size()), x.numel());
  std::string at;
  ASSERT_LE(fd_worst_ratio(x, analytic, loss, &at), tol) << what << " " << at;
}

// A one-sequence store of model for `tokens`: inputs tokens[0, n-1), targets tokens[1, n).
template <typename Model>
auto next_token_store(Model& model, const std::vector<int32_t>& tokens) {
  const int64_t T = static_cast<int64_t>(tokens.size()) - 1;
  auto store = model.allocate_store(1, T);
  for (int64_t t = 0; t < T; ++t) {
    store.tokens.template data<int32_t>()[t] = tokens[static_cast<size_t>(t)];
    store.targets.template data<int32_t>()[t] = tokens[static_cast<size_t>(t + 1)];
  }
  return store;
}

// `steps` plain gradient steps of size lr on the model's parameters from flat offset `begin` on
// (LoRA's adapters), on host memory; returns the loss before and after each step, and fails the
// test if a step finds no gradient there.
template <typename Model, typename Store>
std::vector<double> descend_from(Model& model, Backend& backend, Store& store, int64_t begin, int steps, double lr) {
  std::vector<double> losses{model.forward(store)};
  const int64_t n = model.params().numel() - begin;
  for (int step = 0; step < steps; ++step) {
    model.zero_grads();
    model.forward(store);
    model.backward(store, 1.0f);
    const std::vector<double> g = values(backend, model.grads().view(begin, {n}));
    double norm = 0;
    for (double v : g) norm += v * v;
    EXPECT_GT(norm, 0.0) << "step " << step << ": no gradient on the parameters from " << begin;
    float* p = model.params().template data<float>() + begin;
    for (int64_t i = 0; i < n; ++i) p[i] -= static_cast<float>(lr * g[static_cast<size_t>(i)]);
    losses.push_back(model.forward(store));
  }
  return losses;
}

// sum_i out_i * weights_i, the scalar whose gradient w.r.t. out is `weights`.
inline double weighted_sum(const Tensor& out, const Tensor& weights) {
  const std::vector<double> o = values(out), w = values(weights);
  double s = 0.0;
  for (size_t i = 0; i < o.size(); ++i) s += o[i] * w[i];
  return s;
}

// Central differences of loss() (step h, 1e-2 unless given, on the model's fp32 parameters) against the gradients
// g (flat, the model's layout), at 3 elements of every trained parameter (those at flat offset
// >= from: LoRA's adapters follow the frozen base): each within 2e-3 max(1, |fd|) + 1e-4.
// Returns the worst |analytic - fd| / max(1, |fd|).
template <typename Model>
double expect_gradients_match_fd(Model& model, const float* g, const std::function<double()>& loss,
                                 const std::string& what, int64_t from = 0, float h = 1e-2f) {
  float* p = model.params().template data<float>();
  double worst = 0.0;
  for (const auto& spec : model.layout().params) {
    if (spec.role == ROLE_BUFFER || spec.offset < from) continue;  // the MoE routing bias is not trained
    for (int64_t k = 0; k < 3; ++k) {
      const int64_t i = spec.offset + (k * 7919) % spec.numel;
      const float saved = p[i];
      p[i] = saved + h;
      const double up = loss();
      p[i] = saved - h;
      const double down = loss();
      p[i] = saved;
      const double numeric = (up - down) / (2.0 * h);
      const double scale = std::max(1.0, std::abs(numeric));
      EXPECT_NEAR(g[i], numeric, 2e-3 * scale + 1e-4) << what << " " << spec.name << "[" << i - spec.offset << "]";
      worst = std::max(worst, std::abs(g[i] - numeric) / scale);
    }
  }
  return worst;
}

// The same for the model's own loss on `store` and the gradients its backward left in model.grads().
template <typename Model, typename Store>
double expect_model_gradients_match_fd(Model& model, Store& store, const std::string& what, int64_t from = 0,
                                       float h = 1e-2f) {
  return expect_gradients_match_fd(model, model.grads().template data<float>(), [&] { return model.forward(store); },
                                   what, from, h);
}

}  // namespace loom::test
