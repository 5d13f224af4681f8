// Low-precision linear layers (nn/linear.h) against naive references that quantize with the
// per-element codecs of formats.h and multiply in float64: FP8 current, delayed and block-wise
// scaling forward and backward, fp16 rounding and overflow, and MXFP4 QAT's straight-through
// gradient. The tolerance is fp32 accumulation over K <= 300 terms: 1e-5 relative.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "loom/backend/backend.h"
#include "loom/nn/linear.h"
#include "loom/precision/formats.h"
#include "test_util.h"

namespace loom {
namespace {

using Matrix = std::vector<double>;  // row-major

struct Quantized {
  Matrix values;  // dequantized: decode(encode(x * s)) / s, per element
};

// Per-tensor: decode(encode(x * s)) / s.
Matrix quant_tensor(const Tensor& x, MiniFormat f, double s) {
  Matrix out(static_cast<size_t>(x.numel()));
  for (int64_t i = 0; i < x.numel(); ++i) {
    out[static_cast<size_t>(i)] = decode(f, encode(f, static_cast<float>(x.data<float>()[i] * s))) / s;
  }
  return out;
}

// Blocks of br x bc: s = max(amax, 1e-4) / max(f); decode(encode(x / s)) * s.
Matrix quant_blocks(const Tensor& x, int64_t rows, int64_t cols, MiniFormat f, int64_t br, int64_t bc) {
  const float* p = x.data<float>();
  Matrix out(static_cast<size_t>(rows * cols));
  for (int64_t r0 = 0; r0 < rows; r0 += br) {
    for (int64_t c0 = 0; c0 < cols; c0 += bc) {
      float amax = 0.0f;
      for (int64_t r = r0; r < std::min(rows, r0 + br); ++r) {
        for (int64_t c = c0; c < std::min(cols, c0 + bc); ++c) amax = std::max(amax, std::fabs(p[r * cols + c]));
      }
      const float s = std::max(amax, 1e-4f) / static_cast<float>(format_info(f).max);
      for (int64_t r = r0; r < std::min(rows, r0 + br); ++r) {
        for (int64_t c = c0; c < std::min(cols, c0 + bc); ++c) {
          out[static_cast<size_t>(r * cols + c)] = static_cast<double>(decode(f, encode(f, p[r * cols + c] / s))) * s;
        }
      }
    }
  }
  return out;
}

// C (m, n) = op(A) op(B) in float64; A is (m, k) or, transposed, (k, m); B likewise.
Matrix matmul(const Matrix& a, const Matrix& b, int64_t m, int64_t n, int64_t k, bool ta, bool tb) {
  Matrix c(static_cast<size_t>(m * n), 0.0);
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      double acc = 0.0;
      for (int64_t l = 0; l < k; ++l) {
        acc += a[static_cast<size_t>(ta ? l * m + i : i * k + l)] * b[static_cast<size_t>(tb ? j * k + l : l * n + j)];
      }
      c[static_cast<size_t>(i * n + j)] = acc;
    }
  }
  return c;
}

double amax(const Tensor& t) {
  double m = 0;
  for (int64_t i = 0; i < t.numel(); ++i) m = std::max(m, std::fabs(static_cast<double>(t.data<float>()[i])));
  return m;
}

struct Case {
  std::unique_ptr<Backend> backend = make_cpu_backend();
  int64_t N = 40, in = 300, out = 72;
  Tensor x, w, dy, y, dx, dw;
  Case(int64_t n = 40, int64_t i = 300, int64_t o = 72) : N(n), in(i), out(o) {
    Allocator& a = backend->allocator();
    x = test::random_tensor(a, {N, in}, DTYPE_F32, 1, 3.0);
    w = test::random_tensor(a, {out, in}, DTYPE_F32, 2, 0.05);
    dy = test::random_tensor(a, {N, out}, DTYPE_F32, 3, 1e-3);
    y = Tensor::zeros(a, {N, out}, DTYPE_F32, MEM_WORKSPACE);
    dx = Tensor::zeros(a, {N, in}, DTYPE_F32, MEM_WORKSPACE);
    dw = Tensor::zeros(a, {out, in}, DTYPE_F32, MEM_WORKSPACE);
  }
  void run(LinearLayer& layer) {
    LinearWorkspace ws(backend->allocator());
    layer.forward(*backend, x, w, Tensor{}, Tensor{}, y, 0.0f, &ws);
    layer.backward(*backend, x, w, Tensor{}, dy, dx, dw, Tensor{}, &ws);
  }
};

LinearSetup setup_of(LinearRecipe r, MiniFormat backward = FMT_E5M2) {
  LinearSetup s;
  s.recipe = r;
  s.fp8_backward = backward;
  return s;
}

TEST(LinearTest, Fp8CurrentScalingIsAnExactFp8Gemm) {
  Case c;
  LinearLayer layer(setup_of(RECIPE_FP8_CURRENT));
  c.run(layer);
  const double sx = 448.0f / static_cast<float>(amax(c.x)), sw = 448.0f / static_cast<float>(amax(c.w));
  const double sdy = 57344.0f / static_cast<float>(amax(c.dy));
  const Matrix xq = quant_tensor(c.x, FMT_E4M3, sx), wq = quant_tensor(c.w, FMT_E4M3, sw);
  const Matrix dyq = quant_tensor(c.dy, FMT_E5M2, sdy);
  EXPECT_LT(test::max_rel_error(test::values(c.y), matmul(xq, wq, c.N, c.out, c.in, false, true)), 1e-5);
  EXPECT_LT(test::max_rel_error(test::values(c.dx), matmul(dyq, wq, c.N, c.in, c.out, false, false)), 1e-5);
  EXPECT_LT(test::max_rel_error(test::values(c.dw), matmul(dyq, xq, c.out, c.in, c.N, true, false)), 1e-5);
  // And it is FP8, not fp32: the forward differs from the unquantized product by ~2^-4.
  const Matrix exact = matmul(test::values(c.x), test::values(c.w), c.N, c.out, c.in, false, true);
  const double fp8_err = test::max_rel_error(test::values(c.y), exact);
  EXPECT_GT(fp8_err, 1e-3);
  EXPECT_LT(fp8_err, 0.1);
}

TEST(LinearTest, Fp8DelayedScalingUsesThePreviousStepsAmax) {
  Case c(16, 64, 32);
  LinearSetup s = setup_of(RECIPE_FP8_DELAYED);
  s.fp8_history = 4;
  LinearLayer layer(s);
  // Step 0: no history yet, scale 1 (values above 448 saturate; x is in [-3, 3)).
  c.run(layer);
  Matrix xq = quant_tensor(c.x, FMT_E4M3, 1.0), wq = quant_tensor(c.w, FMT_E4M3, 1.0);
  EXPECT_LT(test::max_rel_error(test::values(c.y), matmul(xq, wq, c.N, c.out, c.in, false, true)), 1e-5);
  EXPECT_EQ(layer.scaling()[0].history()[0], static_cast<float>(amax(c.x)));
  layer.end_step();
  // Step 1: scales from step 0's amaxes, whatever this step's tensors hold.
  const double sx = 448.0f / static_cast<float>(amax(c.x)), sw = 448.0f / static_cast<float>(amax(c.w));
  const double sdy = 57344.0f / static_cast<float>(amax(c.dy));
  c.backend->scale_inplace(c.x, 0.5);  // a smaller amax this step: the scale does not follow yet
  xq = quant_tensor(c.x, FMT_E4M3, sx), wq = quant_tensor(c.w, FMT_E4M3, sw);
  std::fill_n(c.dw.data<float>(), c.dw.numel(), 0.0f);
  c.run(layer);
  const Matrix dyq = quant_tensor(c.dy, FMT_E5M2, sdy);
  EXPECT_LT(test::max_rel_error(test::values(c.y), matmul(xq, wq, c.N, c.out, c.in, false, true)), 1e-5);
  EXPECT_LT(test::max_rel_error(test::values(c.dw), matmul(dyq, xq, c.out, c.in, c.N, true, false)), 1e-5);
  // Evaluation passes do not record.
  layer.end_step();
  const std::vector<float> before = layer.scaling()[0].history();
  layer.set_recording(false);
  LinearWorkspace ws(c.backend->allocator());
  layer.forward(*c.backend, c.x, c.w, Tensor{}, Tensor{}, c.y, 0.0f, &ws);
  EXPECT_EQ(layer.scaling()[0].history(), before);
}

TEST(LinearTest, Fp8BlockScalingQuantizesTilesAlongTheReductionDimension) {
  Case c(150, 300, 72);  // neither dimension a multiple of 128
  LinearLayer layer(setup_of(RECIPE_FP8_BLOCK, FMT_E4M3));
  c.run(layer);
  const Matrix xq = quant_blocks(c.x, c.N, c.in, FMT_E4M3, 1, 128);
  const Matrix wq = quant_blocks(c.w, c.out, c.in, FMT_E4M3, 128, 128);
  const Matrix dyq = quant_blocks(c.dy, c.N, c.out, FMT_E4M3, 1, 128);
  const Matrix dyt = quant_blocks(c.dy, c.N, c.out, FMT_E4M3, 128, 1), xt = quant_blocks(c.x, c.N, c.in, FMT_E4M3, 128, 1);
  EXPECT_LT(test::max_rel_error(test::values(c.y), matmul(xq, wq, c.N, c.out, c.in, false, true)), 1e-5);
  EXPECT_LT(test::max_rel_error(test::values(c.dx), matmul(dyq, wq, c.N, c.in, c.out, false, false)), 1e-5);
  EXPECT_LT(test::max_rel_error(test::values(c.dw), matmul(dyt, xt, c.out, c.in, c.N, true, false)), 1e-5);
}

TEST(LinearTest, Fp16RoundsOperandsAndProductsAndOverflowsToInf) {
  Case c(8, 64, 16);
  LinearLayer layer(setup_of(RECIPE_FP16));
  c.run(layer);
  const Matrix xq = quant_tensor(c.x, FMT_FP16, 1.0), wq = quant_tensor(c.w, FMT_FP16, 1.0);
  const Matrix ref = matmul(xq, wq, c.N, c.out, c.in, false, true);
  for (size_t i = 0; i < ref.size(); ++i) {  // the product, rounded once more to fp16
    EXPECT_EQ(c.y.data<float>()[i], decode(FMT_FP16, encode(FMT_FP16, static_cast<float>(ref[i])))) << i;
  }
  // The scaled gradient of an fp16 run overflows to inf above 65504: what the loss scaler sees.
  c.backend->scale_inplace(c.dy, 1e9);
  LinearWorkspace ws(c.backend->allocator());
  layer.backward(*c.backend, c.x, c.w, Tensor{}, c.dy, c.dx, c.dw, Tensor{}, &ws);
  EXPECT_TRUE(std::isinf(c.dx.data<float>()[0]) || std::isnan(c.dx.data<float>()[0]));
}

TEST(LinearTest, QatUsesTheQuantizedWeightAndAStraightThroughGradient) {
  Case c(12, 64, 32);
  LinearSetup s = setup_of(RECIPE_F32);
  s.qat = QAT_MXFP4;
  LinearLayer layer(s);
  c.run(layer);
  Matrix wq(static_cast<size_t>(c.w.numel()));
  for (int64_t r = 0; r < c.out; ++r) {  // MXFP4 along each row (the reduction dimension)
    std::vector<uint8_t> codes(static_cast<size_t>(c.in)), scales(static_cast<size_t>(c.in / kMxBlock));
    std::vector<float> back(static_cast<size_t>(c.in));
    mxfp4_quantize({c.w.data<float>() + r * c.in, static_cast<size_t>(c.in)}, codes, scales);
    mxfp4_dequantize(codes, scales, back);
    for (int64_t k = 0; k < c.in; ++k) wq[static_cast<size_t>(r * c.in + k)] = back[static_cast<size_t>(k)];
  }
  const Matrix x = test::values(c.x), dy = test::values(c.dy);
  EXPECT_LT(test::max_rel_error(test::values(c.y), matmul(x, wq, c.N, c.out, c.in, false, true)), 1e-5);
  EXPECT_LT(test::max_rel_error(test::values(c.dx), matmul(dy, wq, c.N, c.in, c.out, false, false)), 1e-5);
  // Straight-through: dW is the fp32 gradient w.r.t. the quantized weight, applied to the master.
  EXPECT_LT(test::max_rel_error(test::values(c.dw), matmul(dy, x, c.out, c.in, c.N, true, false)), 1e-5);
  const double qerr = test::max_rel_error(wq, test::values(c.w));
  EXPECT_GT(qerr, 1e-2);  // it really is 4-bit
}

}  // namespace
}  // namespace loom
