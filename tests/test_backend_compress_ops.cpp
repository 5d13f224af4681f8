// The gradient compression ops of the Backend interface (backend.h: topk_extract ...
// lowrank_expand), in the manner of test_backend_ops.cpp (which holds the other ops; this file
// keeps both under 700 lines): each case builds random inputs in host memory, runs the op on the
// CPU backend and on the backend under test (copies written with Backend::write, read back with
// Backend::read), and runs a naive reference written here from the op's one-line contract.
// Tolerance: bitwise, for every output against both — the contracts fix every summation order
// (sequential, in double), so a backend that follows them gives the same bits.
// Backends: "strict" (the CPU kernels on memory host code may not read, tests/strict_backend.h)
// and "cuda", skipped where the build has no CUDA backend, no GPU is visible or the backend does
// not state capabilities().gradient_compression (the CUDA backend's defaults throw).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <numeric>
#include <string>
#include <tuple>
#include <vector>

#include "loom/backend/backend.h"
#include "loom/core/error.h"
#include "loom/core/philox.h"
#include "strict_backend.h"
#include "test_util.h"

namespace loom {
namespace {

using Tensors = std::vector<Tensor>;
using Op = std::function<void(Backend&, const Tensors&)>;

class BackendCompressOpsTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    if (GetParam() == "strict") {
      backend_ = std::make_unique<test::StrictBackend>();
      return;
    }
    if (!cuda_backend_built()) GTEST_SKIP() << "this build has no CUDA backend";
    try {
      backend_ = make_backend(GetParam());
    } catch (const Error& e) {
      GTEST_SKIP() << e.what();
    }
    if (!backend_->capabilities().gradient_compression) GTEST_SKIP() << backend_->name() << " lacks gradient compression";
  }

  Tensor f32(int64_t n, uint64_t seed, double scale = 1.0) { return test::random_tensor(host_, {n}, DTYPE_F32, seed, scale); }
  Tensor i32(std::vector<int32_t> v) {
    Tensor t = Tensor::empty(host_, {static_cast<int64_t>(v.size())}, DTYPE_I32, MEM_WORKSPACE);
    std::copy(v.begin(), v.end(), t.data<int32_t>());
    return t;
  }
  // Random bits: a word of garbage an encoder must overwrite, or gathered codes to decode.
  Tensor noise_words(int64_t n, uint64_t seed) {
    Tensor t = Tensor::empty(host_, {n}, DTYPE_I32, MEM_WORKSPACE);
    for (int64_t i = 0; i < n; ++i) {
      t.data<int32_t>()[i] = static_cast<int32_t>(philox4x32_10({static_cast<uint32_t>(i), 0, 0, 0}, {static_cast<uint32_t>(seed), 1})[0]);
    }
    return t;
  }
  Tensor copy(const Tensor& t) {
    Tensor c = Tensor::empty(host_, t.shape(), t.dtype(), MEM_WORKSPACE);
    std::memcpy(c.raw_data(), t.raw_data(), t.nbytes());
    return c;
  }

  // Runs op on `backend` with its own copies of `in`; returns host copies of them afterwards.
  Tensors run(Backend& backend, const Tensors& in, const Op& op) {
    Tensors dev;
    for (const Tensor& t : in) {
      dev.push_back(Tensor::empty(backend.allocator(), t.shape(), t.dtype(), MEM_WORKSPACE));
      backend.write(dev.back(), t.raw_data());
    }
    op(backend, dev);
    Tensors out;
    for (const Tensor& t : dev) {
      out.push_back(Tensor::empty(host_, t.shape(), t.dtype(), MEM_WORKSPACE));
      backend.read(t, out.back().raw_data());
    }
    return out;
  }

  // The op on the CPU backend and on the backend under test, `reference` on host copies: every
  // operand afterwards (but the scratch operand `scratch`, if any) has the same bytes in all three.
  void check(const std::string& what, const Tensors& in, const Op& op, const std::function<void(const Tensors&)>& reference,
             size_t scratch = SIZE_MAX) {
    Tensors ref;
    for (const Tensor& t : in) ref.push_back(copy(t));
    reference(ref);
    const Tensors cpu = run(*cpu_, in, op), got = run(*backend_, in, op);
    for (size_t k = 0; k < in.size(); ++k) {
      if (k == scratch) continue;
      EXPECT_EQ(std::memcmp(cpu[k].raw_data(), ref[k].raw_data(), ref[k].nbytes()), 0)
          << what << ": operand " << k << " on the CPU differs from the reference";
      EXPECT_EQ(std::memcmp(got[k].raw_data(), ref[k].raw_data(), ref[k].nbytes()), 0)
          << what << ": operand " << k << " on " << GetParam() << " differs from the reference";
    }
  }

  CpuAllocator host_;
  std::unique_ptr<Backend> cpu_ = make_cpu_backend();
  std::unique_ptr<Backend> backend_;
};

// Top-K with ties (equal magnitudes of both signs) at k = 1, 37 and n: the k largest |acc| (ties:
// lower index), indices ascending, zeroed in acc.
TEST_P(BackendCompressOpsTest, TopkExtractTakesTheLargestMagnitudesTiesByIndex) {
  const int64_t n = 1000;
  Tensor acc = f32(n, 11);
  for (int64_t i = 0; i < 40; ++i) acc.data<float>()[500 + i] = (i % 2 ? -1.0f : 1.0f) * 0.999f;  // ties
  for (const int64_t k : {int64_t{1}, int64_t{37}, n}) {
    const Tensors in = {acc, i32(std::vector<int32_t>(k, -1)), f32(k, 12), i32(std::vector<int32_t>(n + 3, 7))};
    check("topk_extract k=" + std::to_string(k), in,
          [](Backend& b, const Tensors& t) { b.topk_extract(t[0], t[1], t[2], t[3]); },
          [&](const Tensors& t) {
            float* a = t[0].data<float>();
            std::vector<int32_t> order(static_cast<size_t>(n));
            std::iota(order.begin(), order.end(), 0);
            std::stable_sort(order.begin(), order.end(), [a](int32_t x, int32_t y) { return std::fabs(a[x]) > std::fabs(a[y]); });
            std::sort(order.begin(), order.begin() + k);
            for (int64_t j = 0; j < k; ++j) {
              t[1].data<int32_t>()[j] = order[static_cast<size_t>(j)];
              t[2].data<float>()[j] = a[order[static_cast<size_t>(j)]];
              a[order[static_cast<size_t>(j)]] = 0.0f;
            }
          },
          3);  // what the op leaves in its scratch is its own
  }
}

// Gathered sparse vectors of two ranks that share indices: added in order; DGC's masking zeroes.
TEST_P(BackendCompressOpsTest, ScatterAddInOrderAndScatterZero) {
  const Tensors in = {i32({3, 17, 40, 0, 3, 40, 99}), f32(7, 21), f32(100, 22)};
  check("scatter_add", in, [](Backend& b, const Tensors& t) { b.scatter_add(t[0], t[1], t[2]); }, [](const Tensors& t) {
    for (int64_t j = 0; j < 7; ++j) t[2].data<float>()[t[0].data<int32_t>()[j]] += t[1].data<float>()[j];
  });
  check("scatter_zero", {in[0], in[2]}, [](Backend& b, const Tensors& t) { b.scatter_zero(t[0], t[1]); }, [](const Tensors& t) {
    for (int64_t j = 0; j < 7; ++j) t[1].data<float>()[t[0].data<int32_t>()[j]] = 0.0f;
  });
}

// DGC's clipping (off, active, inactive), momentum correction and accumulation.
TEST_P(BackendCompressOpsTest, DgcAccumulateClipsThenAccumulates) {
  const int64_t n = 777;
  for (const double clip : {0.0, 1.5, 1e6}) {
    check("dgc_accumulate clip=" + std::to_string(clip), {f32(n, 31), f32(n, 32), f32(n, 33)},
          [clip](Backend& b, const Tensors& t) { b.dgc_accumulate(t[0], t[1], t[2], 0.9f, clip); },
          [clip, n](const Tensors& t) {
            float *g = t[0].data<float>(), *u = t[1].data<float>(), *v = t[2].data<float>();
            double sq = 0.0;
            for (int64_t i = 0; i < n; ++i) sq += static_cast<double>(g[i]) * g[i];
            if (clip > 0.0 && std::sqrt(sq) > clip) {
              for (int64_t i = 0; i < n; ++i) g[i] *= static_cast<float>(clip / std::sqrt(sq));
            }
            for (int64_t i = 0; i < n; ++i) u[i] = 0.9f * u[i] + g[i], v[i] += u[i];
          });
  }
}

// 1-bit: n = 1000 is not a multiple of 32 (the last word's unused bits are 0); decoding 3 ranks.
TEST_P(BackendCompressOpsTest, OnebitEncodeAndDecode) {
  const int64_t n = 1000, w = 32;
  check("onebit_encode", {f32(n, 41), noise_words(w, 42), f32(1, 43)},
        [](Backend& b, const Tensors& t) { b.onebit_encode(t[0], t[1], t[2]); },
        [n](const Tensors& t) {
          float* a = t[0].data<float>();
          double l1 = 0.0;
          for (int64_t i = 0; i < n; ++i) l1 += std::fabs(static_cast<double>(a[i]));
          const float s = static_cast<float>(l1 / n);
          auto* bits = reinterpret_cast<uint32_t*>(t[1].data<int32_t>());
          std::fill(bits, bits + w, 0u);
          for (int64_t i = 0; i < n; ++i) {
            if (a[i] < 0.0f) bits[i / 32] |= 1u << (i % 32);
            a[i] -= a[i] < 0.0f ? -s : s;
          }
          t[2].data<float>()[0] = s;
        });
  check("onebit_decode_add", {noise_words(3 * w, 44), f32(3, 45), f32(n, 46)},
        [](Backend& b, const Tensors& t) { b.onebit_decode_add(t[0], t[1], t[2]); },
        [n](const Tensors& t) {
          for (int64_t r = 0; r < 3; ++r) {
            for (int64_t i = 0; i < n; ++i) {
              const uint32_t word = static_cast<uint32_t>(t[0].data<int32_t>()[r * w + i / 32]);
              const float s = t[1].data<float>()[r];
              t[2].data<float>()[i] += (word >> (i % 32)) & 1u ? -s : s;
            }
          }
        });
}

// QSGD at s = 127 and s = 3 (n = 1003: a partial last word), and an all-zero gradient; decoding 2 ranks.
TEST_P(BackendCompressOpsTest, QsgdEncodeWithPhiloxAndDecode) {
  const int64_t n = 1003, w = 251;
  for (const int levels : {127, 3}) {
    const QsgdSpec spec{levels, 0x1234567890ull, 1, 5, 64};
    for (const bool zero : {false, true}) {
      Tensor g = f32(n, 51);
      if (zero) std::fill(g.data<float>(), g.data<float>() + n, 0.0f);
      check("qsgd_encode s=" + std::to_string(levels), {g, noise_words(w, 52), f32(1, 53)},
            [spec](Backend& b, const Tensors& t) { b.qsgd_encode(t[0], t[1], t[2], spec); },
            [spec, n](const Tensors& t) {
              const float* x = t[0].data<float>();
              double sq = 0.0;
              for (int64_t i = 0; i < n; ++i) sq += static_cast<double>(x[i]) * x[i];
              const float norm = static_cast<float>(std::sqrt(sq));
              auto* bytes = reinterpret_cast<int8_t*>(t[1].data<int32_t>());
              std::fill(bytes, bytes + 4 * w, int8_t{0});
              for (int64_t i = 0; i < n && norm > 0.0f; ++i) {
                const PhiloxCounter r = philox4x32_10(
                    {static_cast<uint32_t>(spec.offset + i / 4 * 4), spec.stream, spec.draw, 0x9597u},
                    {static_cast<uint32_t>(spec.seed), static_cast<uint32_t>(spec.seed >> 32)});
                const double v = std::fabs(static_cast<double>(x[i])) / norm * spec.levels, l = std::floor(v);
                const int level = static_cast<int>(l) + (philox_uniform(r[static_cast<size_t>(i % 4)]) < v - l ? 1 : 0);
                bytes[i] = static_cast<int8_t>(x[i] < 0.0f ? -level : level);
              }
              t[2].data<float>()[0] = norm;
            });
    }
  }
  Tensor codes = noise_words(2 * w, 54);
  for (int64_t i = 0; i < 8 * w; ++i) reinterpret_cast<int8_t*>(codes.data<int32_t>())[i] %= 4;  // levels within s = 3
  check("qsgd_decode_add", {codes, f32(2, 55, 2.0), f32(n, 56)},
        [](Backend& b, const Tensors& t) { b.qsgd_decode_add(t[0], t[1], 3, t[2]); },
        [n](const Tensors& t) {
          for (int64_t r = 0; r < 2; ++r) {
            const auto* bytes = reinterpret_cast<const int8_t*>(t[0].data<int32_t>() + r * w);
            const float unit = t[1].data<float>()[r] / 3.0f;
            for (int64_t i = 0; i < n; ++i) t[2].data<float>()[i] = std::fma(unit, static_cast<float>(bytes[i]), t[2].data<float>()[i]);
          }
        });
}

// Naive double-accumulated products: out (a_rows x r) = sum over the inner dim of a and b.
double dot_at(const float* a, int64_t a_stride, const float* b, int64_t b_stride, int64_t inner) {
  double acc = 0.0;
  for (int64_t c = 0; c < inner; ++c) acc += static_cast<double>(a[c * a_stride]) * b[c * b_stride];
  return acc;
}

// PowerSGD's products (both projections, the expansion overwriting NaN and subtracting) and the
// orthonormalization, with one column a multiple of another and one all zero.
TEST_P(BackendCompressOpsTest, LowrankProjectOrthonormalizeExpand) {
  const int64_t rows = 37, cols = 23, r = 4;
  auto mat = [&](int64_t a, int64_t b, uint64_t seed) { return test::random_tensor(host_, {a, b}, DTYPE_F32, seed); };
  const Tensor m = mat(rows, cols, 61), q = mat(cols, r, 62), p = mat(rows, r, 63);
  check("lowrank_project", {m, q, mat(rows, r, 64)}, [](Backend& b, const Tensors& t) { b.lowrank_project(t[0], t[1], t[2], false); },
        [&](const Tensors& t) {
          for (int64_t i = 0; i < rows; ++i)
            for (int64_t j = 0; j < r; ++j) t[2].data<float>()[i * r + j] = static_cast<float>(dot_at(t[0].data<float>() + i * cols, 1, t[1].data<float>() + j, r, cols));
        });
  check("lowrank_project^T", {m, p, mat(cols, r, 65)}, [](Backend& b, const Tensors& t) { b.lowrank_project(t[0], t[1], t[2], true); },
        [&](const Tensors& t) {
          for (int64_t c = 0; c < cols; ++c)
            for (int64_t j = 0; j < r; ++j) t[2].data<float>()[c * r + j] = static_cast<float>(dot_at(t[0].data<float>() + c, cols, t[1].data<float>() + j, r, rows));
        });
  Tensor degenerate = copy(p);
  for (int64_t i = 0; i < rows; ++i) {
    degenerate.data<float>()[i * r + 2] = 2.0f * degenerate.data<float>()[i * r];
    degenerate.data<float>()[i * r + 3] = 0.0f;
  }
  for (const Tensor& x : {p, degenerate}) {
    check("orthonormalize_columns", {x}, [](Backend& b, const Tensors& t) { b.orthonormalize_columns(t[0]); }, [&](const Tensors& t) {
      std::vector<double> d(t[0].data<float>(), t[0].data<float>() + rows * r);
      for (int pass = 0; pass < 2; ++pass) {
        for (int64_t j = 0; j < r; ++j) {
          for (int64_t k = 0; k < j; ++k) {
            double dot = 0.0;
            for (int64_t i = 0; i < rows; ++i) dot += d[i * r + j] * d[i * r + k];
            for (int64_t i = 0; i < rows; ++i) d[i * r + j] -= dot * d[i * r + k];
          }
          double sq = 0.0;
          for (int64_t i = 0; i < rows; ++i) sq += d[i * r + j] * d[i * r + j];
          for (int64_t i = 0; i < rows; ++i) d[i * r + j] *= sq > 1e-30 ? 1.0 / std::sqrt(sq) : 0.0;
        }
      }
      for (int64_t i = 0; i < rows * r; ++i) t[0].data<float>()[i] = static_cast<float>(d[i]);
    });
  }
  Tensor nan_out = mat(rows, cols, 66);
  std::fill(nan_out.data<float>(), nan_out.data<float>() + rows * cols, std::numeric_limits<float>::quiet_NaN());
  for (const auto& [out, alpha, beta] : {std::tuple{nan_out, 1.0f, 0.0f}, std::tuple{m, -1.0f, 1.0f}}) {
    check("lowrank_expand", {p, q, out}, [a = alpha, b = beta](Backend& be, const Tensors& t) { be.lowrank_expand(t[0], t[1], t[2], a, b); },
          [&, a = alpha, b = beta](const Tensors& t) {
            for (int64_t i = 0; i < rows; ++i) {
              for (int64_t c = 0; c < cols; ++c) {
                float& o = t[2].data<float>()[i * cols + c];
                const float pq = static_cast<float>(dot_at(t[0].data<float>() + i * r, 1, t[1].data<float>() + c * r, 1, r));
                o = b == 0.0f ? a * pq : a * pq + b * o;
              }
            }
          });
  }
}

INSTANTIATE_TEST_SUITE_P(AllBackends, BackendCompressOpsTest, ::testing::Values(std::string("strict"), std::string("cuda")),
                         [](const ::testing::TestParamInfo<std::string>& p) { return p.param; });

}  // namespace
}  // namespace loom
