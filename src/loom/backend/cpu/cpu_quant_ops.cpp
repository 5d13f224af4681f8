// CPU kernels of the low-precision ops (contracts in backend.h; the formats in
// precision/formats.h, docs/precision.md). Each fake quantizer returns values on the format's
// grid as floats, so the GEMM that follows multiplies exactly the numbers the hardware would
// (an FP8 value times an FP8 value is exact in fp32). They round in float arithmetic (rint on
// the format's quantum) instead of a per-element search, so a training step can afford them;
// tests/test_quantize.cpp checks them bit for bit against the reference codecs of formats.h.
#include "loom/backend/cpu/cpu_quant_ops.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <type_traits>

#include "loom/backend/checks.h"
#include "loom/core/dtype.h"
#include "loom/core/error.h"
#include "loom/core/philox.h"

namespace loom::cpu {

namespace {

// The saturating grids of the block formats' element (FP4 E2M1: max 6) and scale (FP8 E4M3:
// max 448) types, OCP Microscaling Formats v1.0 sec. 5.3.3 and OCP 8-bit Floating Point v1.0.
constexpr NumberGrid kE2M1{1, 0, 6.0f, 6.0f};
constexpr NumberGrid kE4M3{3, -6, 448.0f, 448.0f};
constexpr int64_t kMxBlock = 32, kNvBlock = 16;

// 2^k for k in [-126, 127], built from its bits.
inline float pow2(int k) { return std::bit_cast<float>(static_cast<uint32_t>(k + 127) << 23); }

// Round to nearest even onto the grid: |v| / quantum is exact (a power-of-two scaling of a
// float), rint rounds it half-to-even, and anything that lands above max overflows.
inline float round_grid(float v, const NumberGrid& g) {
  // Branch-free (selects, integer min/max, sign by bits) so the loops below vectorize.
  const uint32_t bits = std::bit_cast<uint32_t>(v);
  const float a = std::bit_cast<float>(bits & 0x7FFFFFFFu);
  int e = static_cast<int>((bits >> 23) & 0xFFu) - 127;
  e = e < g.emin ? g.emin : e;
  e = e > 127 ? 127 : e;
  const float r0 = std::rint(a * pow2(g.man_bits - e)) * pow2(e - g.man_bits);
  const float r = r0 > g.max ? g.overflow : r0;
  return std::bit_cast<float>(std::bit_cast<uint32_t>(r) | (bits & 0x80000000u));
}

// Calls fn(xb, ob, len) for every run of `block` consecutive elements along each row of the
// (rows, cols) arrays x and out (the last run of a row shorter), in parallel.
template <typename Fn>
void for_each_row_block(const float* x, float* out, int64_t rows, int64_t cols, int64_t block, Fn fn) {
  const int64_t blocks = (cols + block - 1) / block;
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t b = 0; b < blocks; ++b) {
      fn(x + r * cols + b * block, out + r * cols + b * block, std::min(block, cols - b * block));
    }
  }
}

}  // namespace

float amax_of(const float* x, int64_t n) {
  float m = 0.0f;
  bool nan = false;
#pragma omp parallel for reduction(max : m) reduction(|| : nan) schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const float a = std::fabs(x[i]);
    nan = nan || std::isnan(a);
    m = std::max(m, a);
  }
  return nan ? NAN : m;
}

void fake_quant(const NumberGrid& g, const float* x, int64_t n, float scale, float post, float* out) {
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; ++i) out[i] = round_grid(x[i] * scale, g) * post;
}

void quant_codes_bf16(const NumberGrid& g, const float* x, int64_t n, float scale, uint16_t* out) {
  constexpr int64_t kChunk = 512;  // round into a float chunk, then keep the upper halves (exact)
#pragma omp parallel for schedule(static)
  for (int64_t c = 0; c < (n + kChunk - 1) / kChunk; ++c) {
    float q[kChunk];
    const int64_t begin = c * kChunk, len = std::min(kChunk, n - begin);
#pragma omp simd
    for (int64_t i = 0; i < len; ++i) q[i] = round_grid(x[begin + i] * scale, g);
#pragma omp simd
    for (int64_t i = 0; i < len; ++i) out[begin + i] = static_cast<uint16_t>(std::bit_cast<uint32_t>(q[i]) >> 16);
  }
}

void fake_quant_blocks(const NumberGrid& g, const float* x, int64_t rows, int64_t cols, int64_t block_rows,
                       int64_t block_cols, float* out) {
  LOOM_CHECK(block_rows > 0 && block_cols > 0, "fake_quant_blocks: block ", block_rows, "x", block_cols);
  const int64_t brs = (rows + block_rows - 1) / block_rows, bcs = (cols + block_cols - 1) / block_cols;
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t br = 0; br < brs; ++br) {
    for (int64_t bc = 0; bc < bcs; ++bc) {
      const int64_t r0 = br * block_rows, r1 = std::min(rows, r0 + block_rows);
      const int64_t c0 = bc * block_cols, c1 = std::min(cols, c0 + block_cols);
      float amax = 0.0f;
      for (int64_t r = r0; r < r1; ++r) {
        for (int64_t c = c0; c < c1; ++c) amax = std::max(amax, std::fabs(x[r * cols + c]));
      }
      const float s = std::max(amax, 1e-4f) / g.max;  // DeepSeek-V3: max(amax, 1e-4) / 448
      for (int64_t r = r0; r < r1; ++r) {
        for (int64_t c = c0; c < c1; ++c) out[r * cols + c] = round_grid(x[r * cols + c] / s, g) * s;
      }
    }
  }
}

void fake_quant_mxfp4(const float* x, int64_t rows, int64_t cols, float* out) {
  for_each_row_block(x, out, rows, cols, kMxBlock, [&](const float* xb, float* ob, int64_t len) {
    float amax = 0.0f;
    bool finite = true;
    for (int64_t k = 0; k < len; ++k) {
      finite = finite && std::isfinite(xb[k]);
      amax = std::max(amax, std::fabs(xb[k]));
    }
    if (!finite) {
      std::fill(ob, ob + len, NAN);
      return;
    }
    int e = -127;
    if (amax > 0.0f) e = std::clamp(std::ilogb(amax) - 2, -127, 127);  // floor(log2 amax) - emax(E2M1)
    const float X = std::ldexp(1.0f, e);
    for (int64_t k = 0; k < len; ++k) ob[k] = round_grid(xb[k] / X, kE2M1) * X;
  });
}

void fake_quant_nvfp4(const float* x, int64_t rows, int64_t cols, float* out) {
  const float amax = amax_of(x, rows * cols);
  if (!std::isfinite(amax)) {
    std::fill(out, out + rows * cols, NAN);
    return;
  }
  const float global = amax > 0.0f ? amax / (448.0f * 6.0f) : 1.0f;
  for_each_row_block(x, out, rows, cols, kNvBlock, [&](const float* xb, float* ob, int64_t len) {
    float block_amax = 0.0f;
    for (int64_t k = 0; k < len; ++k) block_amax = std::max(block_amax, std::fabs(xb[k]));
    const float scale = round_grid((block_amax / 6.0f) / global, kE4M3) * global;
    for (int64_t k = 0; k < len; ++k) ob[k] = scale == 0.0f ? 0.0f : round_grid(xb[k] / scale, kE2M1) * scale;
  });
}

void round_to_bf16(float* x, int64_t n, bool stochastic, const RoundingDraw& draw) {
  if (!stochastic) {
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) x[i] = bf16_to_f32(f32_to_bf16(x[i]));
    return;
  }
  const PhiloxKey key = {static_cast<uint32_t>(draw.seed), static_cast<uint32_t>(draw.seed >> 32)};
  const int64_t groups = (n + 3) / 4;
#pragma omp parallel for schedule(static)
  for (int64_t q = 0; q < groups; ++q) {
    const PhiloxCounter r = philox4x32_10(
        {static_cast<uint32_t>(q), static_cast<uint32_t>(static_cast<uint64_t>(q) >> 32), draw.stream, draw.draw}, key);
    for (int64_t j = 0; j < 4 && q * 4 + j < n; ++j) {
      float& v = x[q * 4 + j];
      if (!std::isfinite(v)) continue;
      const uint32_t u = std::bit_cast<uint32_t>(v) + (r[static_cast<size_t>(j)] >> 16);
      v = std::bit_cast<float>(u & 0xFFFF0000u);
    }
  }
}

// QLoRA's NF4 (precision/nf4.h): per block of 64, the 16 code values times the block's
// double-quantized absmax, then a lookup per element, a byte (two elements) at a time.
template <typename T>
void nf4_dequantize(const uint8_t* codes, const uint8_t* absmax_codes, const float* absmax_steps, const Nf4Spec& spec,
                    int64_t first, int64_t n, T* out) {
  if (n <= 0) return;
  const int64_t b0 = first / kNf4Block, b1 = (first + n - 1) / kNf4Block;
#pragma omp parallel for schedule(static)
  for (int64_t b = b0; b <= b1; ++b) {
    // The block's 16 values, scaled once: values[k] c_b, as the contract's product.
    const float c = nf4_block_absmax(static_cast<int8_t>(absmax_codes[b]), absmax_steps[b / kNf4ScaleBlock],
                                     spec.absmax_mean);
    T table[16];
    for (int k = 0; k < 16; ++k) {
      if constexpr (std::is_same_v<T, float>) table[k] = spec.values[static_cast<size_t>(k)] * c;
      else table[k] = f32_to_bf16(spec.values[static_cast<size_t>(k)] * c);
    }
    const int64_t e0 = std::max(first, b * kNf4Block), e1 = std::min(first + n, (b + 1) * kNf4Block);
    const auto code = [&](int64_t e) { return (codes[e >> 1] >> ((~e & 1) << 2)) & 0x0F; };
    int64_t e = e0;
    if (e & 1) {  // a range starting at a low nibble
      out[e - first] = table[code(e)];
      ++e;
    }
    T* dst = out + (e - first);
    const uint8_t* pairs = codes + (e >> 1);
    const int64_t whole = (e1 - e) / 2;  // whole bytes: both of their elements are in range
    for (int64_t i = 0; i < whole; ++i) {
      dst[2 * i] = table[pairs[i] >> 4];
      dst[2 * i + 1] = table[pairs[i] & 0x0F];
    }
    if (e + 2 * whole < e1) out[e1 - 1 - first] = table[code(e1 - 1)];
  }
}
template void nf4_dequantize<float>(const uint8_t*, const uint8_t*, const float*, const Nf4Spec&, int64_t, int64_t, float*);
template void nf4_dequantize<bf16>(const uint8_t*, const uint8_t*, const float*, const Nf4Spec&, int64_t, int64_t, bf16*);

// ------------------------------------------------------------------------------ the Tensor ops

namespace {

// x f32; out (when given) of x's numel in `out_dtype`.
void check_quant(const char* op, const Tensor& x, const Tensor* out, DType out_dtype = DTYPE_F32) {
  checks::expect_dtype(x, DTYPE_F32, op, "x");
  if (out == nullptr) return;
  checks::expect_dtype(*out, out_dtype, op, "out");
  checks::expect_numel(*out, x.numel(), op, "out");
}

// The (rows, last dim) view of x, for the row-blocked formats.
int64_t cols_of(const Tensor& x) { return x.ndim() == 0 ? 1 : x.dim(-1); }

}  // namespace

float amax(const Tensor& x) {
  check_quant("amax", x, nullptr);
  return amax_of(x.data<float>(), x.numel());
}

void fake_quant(const Tensor& x, const Tensor& out, const NumberGrid& grid, float scale, float post) {
  check_quant("fake_quant", x, &out);
  fake_quant(grid, x.data<float>(), x.numel(), scale, post, out.data<float>());
}

void quant_codes_bf16(const Tensor& x, const Tensor& out, const NumberGrid& grid, float scale) {
  check_quant("quant_codes_bf16", x, &out, DTYPE_BF16);
  LOOM_CHECK(grid.man_bits <= 7, "quant_codes_bf16: a grid of ", grid.man_bits, " mantissa bits is not bf16 values");
  quant_codes_bf16(grid, x.data<float>(), x.numel(), scale, static_cast<uint16_t*>(out.raw_data()));
}

void fake_quant_blocks(const Tensor& x, const Tensor& out, const NumberGrid& grid, int64_t block_rows,
                       int64_t block_cols) {
  check_quant("fake_quant_blocks", x, &out);
  const int64_t cols = cols_of(x);
  fake_quant_blocks(grid, x.data<float>(), cols == 0 ? 0 : x.numel() / cols, cols, block_rows, block_cols,
                    out.data<float>());
}

void fake_quant_mxfp4(const Tensor& x, const Tensor& out) {
  check_quant("fake_quant_mxfp4", x, &out);
  const int64_t cols = cols_of(x);
  fake_quant_mxfp4(x.data<float>(), cols == 0 ? 0 : x.numel() / cols, cols, out.data<float>());
}

void fake_quant_nvfp4(const Tensor& x, const Tensor& out) {
  check_quant("fake_quant_nvfp4", x, &out);
  const int64_t cols = cols_of(x);
  fake_quant_nvfp4(x.data<float>(), cols == 0 ? 0 : x.numel() / cols, cols, out.data<float>());
}

void dropout(const Tensor& x, const Tensor& out, float p, const RoundingDraw& draw) {
  check_quant("dropout", x, &out);
  LOOM_CHECK(p >= 0.0f && p < 1.0f, "dropout: p = ", p, ", expected [0, 1)");
  const float* in = x.data<float>();
  float* o = out.data<float>();
  const int64_t n = x.numel(), groups = (n + 3) / 4;
  const auto threshold = static_cast<uint64_t>(static_cast<double>(p) * 4294967296.0);
  const float keep = 1.0f / (1.0f - p);
  const PhiloxKey key = {static_cast<uint32_t>(draw.seed), static_cast<uint32_t>(draw.seed >> 32)};
#pragma omp parallel for schedule(static)
  for (int64_t q = 0; q < groups; ++q) {
    const PhiloxCounter r = philox4x32_10(
        {static_cast<uint32_t>(q), static_cast<uint32_t>(static_cast<uint64_t>(q) >> 32), draw.stream, draw.draw}, key);
    for (int64_t j = 0; j < 4 && q * 4 + j < n; ++j) {
      const int64_t i = q * 4 + j;
      o[i] = r[static_cast<size_t>(j)] >= threshold ? in[i] * keep : 0.0f;
    }
  }
}

namespace {

// DoRA's operands: merged (rows, cols) f32 and per-row vectors of `rows` elements.
int64_t dora_rows(const char* op, const Tensor& m, std::initializer_list<const Tensor*> vectors) {
  checks::expect_dtype(m, DTYPE_F32, op, "matrix");
  LOOM_CHECK(m.ndim() == 2, op, ": expected a (rows, cols) matrix, got ", m.describe());
  for (const Tensor* v : vectors) {
    checks::expect_dtype(*v, DTYPE_F32, op, "vector");
    checks::expect_numel(*v, m.dim(0), op, "vector");
  }
  return m.dim(0);
}

inline float dora_gain(float magnitude, float norm) { return norm > 0.0f ? magnitude / norm : 0.0f; }

}  // namespace

void row_norms(const Tensor& x, const Tensor& norms) {
  const int64_t rows = dora_rows("row_norms", x, {&norms}), cols = x.dim(1);
  const float* in = x.data<float>();
  float* out = norms.data<float>();
#pragma omp parallel for schedule(static)
  for (int64_t j = 0; j < rows; ++j) {
    double sum = 0.0;
    for (int64_t i = 0; i < cols; ++i) sum += static_cast<double>(in[j * cols + i]) * in[j * cols + i];
    out[j] = static_cast<float>(std::sqrt(sum));
  }
}

void dora_weight(const Tensor& merged, const Tensor& base, const Tensor& magnitude, const Tensor& norms,
                 const Tensor& out) {
  const int64_t rows = dora_rows("dora_weight", merged, {&magnitude, &norms}), cols = merged.dim(1);
  checks::expect_numel(out, merged.numel(), "dora_weight", "out");
  if (base.defined()) checks::expect_numel(base, merged.numel(), "dora_weight", "base");
  const float* w = merged.data<float>();
  const float* b = base.defined() ? base.data<float>() : nullptr;
  const float* m = magnitude.data<float>();
  const float* n = norms.data<float>();
  float* o = out.data<float>();
#pragma omp parallel for schedule(static)
  for (int64_t j = 0; j < rows; ++j) {
    const float g = dora_gain(m[j], n[j]);
    for (int64_t i = 0; i < cols; ++i) o[j * cols + i] = g * w[j * cols + i] - (b != nullptr ? b[j * cols + i] : 0.0f);
  }
}

void dora_backward(const Tensor& grad, const Tensor& merged, const Tensor& magnitude, const Tensor& norms,
                   const Tensor& dmagnitude) {
  const int64_t rows = dora_rows("dora_backward", merged, {&magnitude, &norms, &dmagnitude}), cols = merged.dim(1);
  checks::expect_dtype(grad, DTYPE_F32, "dora_backward", "grad");
  checks::expect_numel(grad, merged.numel(), "dora_backward", "grad");
  float* d = grad.data<float>();
  const float* w = merged.data<float>();
  const float* m = magnitude.data<float>();
  const float* n = norms.data<float>();
  float* dm = dmagnitude.data<float>();
#pragma omp parallel for schedule(static)
  for (int64_t j = 0; j < rows; ++j) {
    double dot = 0.0;
    for (int64_t i = 0; i < cols; ++i) dot += static_cast<double>(d[j * cols + i]) * w[j * cols + i];
    if (n[j] > 0.0f) dm[j] += static_cast<float>(dot / static_cast<double>(n[j]));
    const float g = dora_gain(m[j], n[j]);
    for (int64_t i = 0; i < cols; ++i) d[j * cols + i] *= g;
  }
}

void round_bf16(const Tensor& x, bool stochastic, const RoundingDraw& draw) {
  check_quant("round_bf16", x, nullptr);
  round_to_bf16(x.data<float>(), x.numel(), stochastic, draw);
}

void nf4_dequantize(const Tensor& codes, const Tensor& absmax_codes, const Tensor& absmax_steps, const Nf4Spec& spec,
                    int64_t first, const Tensor& out) {
  const char* op = "nf4_dequantize";
  checks::expect_dtype(codes, DTYPE_U8, op, "codes");
  checks::expect_dtype(absmax_codes, DTYPE_U8, op, "absmax_codes");
  checks::expect_dtype(absmax_steps, DTYPE_F32, op, "absmax_steps");
  LOOM_CHECK(out.dtype() == DTYPE_F32 || out.dtype() == DTYPE_BF16, op, ": out is ", out.describe(), ", expected f32 or bf16");
  const int64_t n = out.numel(), end = first + n;
  const int64_t blocks = (end + kNf4Block - 1) / kNf4Block;
  LOOM_CHECK(first >= 0 && codes.numel() >= (end + 1) / 2 && absmax_codes.numel() >= blocks &&
                 absmax_steps.numel() >= (blocks + kNf4ScaleBlock - 1) / kNf4ScaleBlock,
             op, ": elements [", first, ", ", end, ") need ", (end + 1) / 2, " code bytes, ", blocks, " absmax codes and ",
             (blocks + kNf4ScaleBlock - 1) / kNf4ScaleBlock, " steps; got ", codes.describe(), ", ",
             absmax_codes.describe(), ", ", absmax_steps.describe());
  const uint8_t* c = codes.data<uint8_t>();
  const uint8_t* q = absmax_codes.data<uint8_t>();
  const float* s = absmax_steps.data<float>();
  if (out.dtype() == DTYPE_F32) nf4_dequantize(c, q, s, spec, first, n, out.data<float>());
  else nf4_dequantize(c, q, s, spec, first, n, out.data<bf16>());
}

}  // namespace loom::cpu
