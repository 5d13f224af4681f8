// NF4 and its double quantization on host arrays (the format in nf4.h; Dettmers et al. 2023,
// sec. 3). The dequantizing Backend op (Backend::nf4_dequantize, backend/cpu/cpu_quant_ops.cpp)
// is tested against nf4_dequantize here.
#include "loom/precision/nf4.h"

#include <algorithm>
#include <cmath>
#include <numbers>

#include "loom/core/error.h"

namespace loom {

namespace {

constexpr int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// The exact midpoints of neighbouring codes: a float's sum is exact in double here (the codes'
// exponents differ by at most 4), and so is its half.
constexpr std::array<double, 15> midpoints() {
  std::array<double, 15> m{};
  for (size_t i = 0; i < m.size(); ++i) m[i] = (static_cast<double>(kNf4Codes[i]) + static_cast<double>(kNf4Codes[i + 1])) / 2;
  return m;
}
constexpr std::array<double, 15> kMidpoints = midpoints();

// Code k of element e (nf4.h: the high nibble for even e).
inline int code_at(std::span<const uint8_t> codes, int64_t e) {
  return (codes[static_cast<size_t>(e >> 1)] >> ((~e & 1) << 2)) & 0x0F;
}

// out[i] = code value of element first + i times scale(its block).
template <typename Scale>
void decode_with(std::span<const uint8_t> codes, int64_t first, std::span<float> out, Scale scale) {
  const auto n = static_cast<int64_t>(out.size());
  LOOM_CHECK(first >= 0 && static_cast<int64_t>(codes.size()) >= ceil_div(first + n, 2), "nf4: elements [", first,
             ", ", first + n, ") beyond ", codes.size(), " code bytes");
  for (int64_t i = 0; i < n; ++i) {
    const int64_t e = first + i;
    out[static_cast<size_t>(i)] = kNf4Codes[static_cast<size_t>(code_at(codes, e))] * scale(e / kNf4Block);
  }
}

}  // namespace

double normal_quantile(double p) {
  LOOM_CHECK(p > 0.0 && p < 1.0, "normal_quantile: p = ", p, " is not in (0, 1)");
  // Newton from 0 on Phi(x) - p: Phi is concave on the side of the root, so the iterates approach
  // it monotonically; stop when a step no longer changes x.
  double x = 0.0;
  for (int it = 0; it < 100; ++it) {
    const double cdf = 0.5 * std::erfc(-x / std::sqrt(2.0));
    const double pdf = std::exp(-0.5 * x * x) / std::sqrt(2.0 * std::numbers::pi);
    const double next = x - (cdf - p) / pdf;
    if (next == x) break;
    x = next;
  }
  return x;
}

std::array<float, 16> nf4_construct_codes() {
  // `steps` probabilities from delta down to 1/2 in float32, each end's half counted from its own
  // end (torch.linspace); the products are exact in double and rounded once to float32.
  const auto spaced = [](int steps) {
    const float start = 0.9677083f, end = 0.5f, step = (end - start) / static_cast<float>(steps - 1);
    std::vector<float> p(static_cast<size_t>(steps));
    for (int i = 0; i < steps; ++i) {
      const auto offset = [&](int k) { return static_cast<float>(static_cast<double>(step) * k); };
      p[static_cast<size_t>(i)] = i < steps / 2 ? start + offset(i) : end - offset(steps - 1 - i);
    }
    return p;
  };
  std::array<float, 16> v{};
  const std::vector<float> pos = spaced(9), neg = spaced(8);
  for (int i = 0; i < 7; ++i) v[static_cast<size_t>(i)] = static_cast<float>(-normal_quantile(neg[static_cast<size_t>(i)]));
  v[kNf4ZeroCode] = 0.0f;
  for (int i = 0; i < 8; ++i) v[static_cast<size_t>(15 - i)] = static_cast<float>(normal_quantile(pos[static_cast<size_t>(i)]));
  const float max = v[15];
  for (float& x : v) x /= max;
  return v;
}

int nf4_nearest_code(float v) {
  const auto d = static_cast<double>(v);
  int k = 0;
  for (const double m : kMidpoints) k += d > m ? 1 : 0;
  return k;
}

size_t nf4_bytes(int64_t numel) {
  const int64_t blocks = ceil_div(numel, kNf4Block);
  return static_cast<size_t>(ceil_div(numel, 2) + blocks + 4 * ceil_div(blocks, kNf4ScaleBlock) + 4);
}

size_t Nf4Tensor::bytes() const {
  return codes.size() + absmax_codes.size() + sizeof(float) * absmax_steps.size() + sizeof(absmax_mean);
}

double Nf4Tensor::bits_per_parameter() const { return 8.0 * static_cast<double>(bytes()) / static_cast<double>(numel()); }

float Nf4Tensor::block_absmax(int64_t block) const {
  return nf4_block_absmax(absmax_codes[static_cast<size_t>(block)],
                          absmax_steps[static_cast<size_t>(block / kNf4ScaleBlock)], absmax_mean);
}

Nf4Spec Nf4Tensor::spec() const { return Nf4Spec{kNf4Codes, absmax_mean}; }

void nf4_encode(std::span<const float> x, std::span<uint8_t> codes, std::span<float> absmax) {
  const auto n = static_cast<int64_t>(x.size());
  const int64_t blocks = ceil_div(n, kNf4Block);
  LOOM_CHECK(static_cast<int64_t>(codes.size()) == ceil_div(n, 2) && static_cast<int64_t>(absmax.size()) == blocks,
             "nf4_encode: ", n, " elements need ", ceil_div(n, 2), " code bytes and ", blocks, " scales, got ",
             codes.size(), " and ", absmax.size());
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t e0 = b * kNf4Block, e1 = std::min(n, e0 + kNf4Block);
    float amax = 0.0f;
    bool finite = true;
    for (int64_t e = e0; e < e1; ++e) {
      finite = finite && std::isfinite(x[static_cast<size_t>(e)]);
      amax = std::max(amax, std::fabs(x[static_cast<size_t>(e)]));
    }
    if (!finite) amax = NAN;
    absmax[static_cast<size_t>(b)] = amax;
    // Blocks start at even elements, so each block owns its bytes.
    for (int64_t e = e0; e < e1; e += 2) {
      const auto nibble = [&](int64_t i) {
        if (i >= e1) return 0;  // the pad nibble after an odd n
        if (amax == 0.0f || !std::isfinite(amax)) return kNf4ZeroCode;  // an all-zero block (inf / NaN: refused below)
        return nf4_nearest_code(x[static_cast<size_t>(i)] / amax);
      };
      codes[static_cast<size_t>(e / 2)] = static_cast<uint8_t>(nibble(e) << 4 | nibble(e + 1));
    }
  }
  for (int64_t b = 0; b < blocks; ++b) {
    LOOM_CHECK(std::isfinite(absmax[static_cast<size_t>(b)]), "nf4_encode: block ", b, " (elements ", b * kNf4Block,
               "...) holds inf or NaN");
  }
}

Nf4Scales nf4_double_quantize(std::span<const float> absmax) {
  const auto blocks = static_cast<int64_t>(absmax.size());
  Nf4Scales s;
  double sum = 0.0;
  for (const float c : absmax) sum += c;
  s.mean = blocks == 0 ? 0.0f : static_cast<float>(sum / static_cast<double>(blocks));
  s.codes.resize(absmax.size());
  s.steps.resize(static_cast<size_t>(ceil_div(blocks, kNf4ScaleBlock)));
  for (int64_t g = 0; g < static_cast<int64_t>(s.steps.size()); ++g) {
    const int64_t b0 = g * kNf4ScaleBlock, b1 = std::min(blocks, b0 + kNf4ScaleBlock);
    float amax = 0.0f;
    for (int64_t b = b0; b < b1; ++b) amax = std::max(amax, std::fabs(absmax[static_cast<size_t>(b)] - s.mean));
    const float step = amax / 127.0f;
    s.steps[static_cast<size_t>(g)] = step;
    for (int64_t b = b0; b < b1; ++b) {
      const float q = step > 0.0f ? std::clamp(std::rint((absmax[static_cast<size_t>(b)] - s.mean) / step), -127.0f, 127.0f)
                                  : 0.0f;
      s.codes[static_cast<size_t>(b)] = static_cast<int8_t>(q);
    }
  }
  return s;
}

Nf4Tensor nf4_quantize(std::span<const float> x, int64_t rows, int64_t cols) {
  LOOM_CHECK(rows >= 0 && cols >= 0 && static_cast<int64_t>(x.size()) == rows * cols, "nf4_quantize: ", x.size(),
             " elements for a (", rows, ", ", cols, ") weight");
  Nf4Tensor t;
  t.rows = rows, t.cols = cols;
  t.codes.resize(static_cast<size_t>(ceil_div(rows * cols, 2)));
  std::vector<float> absmax(static_cast<size_t>(ceil_div(rows * cols, kNf4Block)));
  nf4_encode(x, t.codes, absmax);
  Nf4Scales s = nf4_double_quantize(absmax);
  t.absmax_codes = std::move(s.codes);
  t.absmax_steps = std::move(s.steps);
  t.absmax_mean = s.mean;
  return t;
}

void nf4_decode(std::span<const uint8_t> codes, std::span<const float> absmax, int64_t first, std::span<float> out) {
  LOOM_CHECK(static_cast<int64_t>(absmax.size()) >= ceil_div(first + static_cast<int64_t>(out.size()), kNf4Block),
             "nf4_decode: ", absmax.size(), " scales for elements up to ", first + static_cast<int64_t>(out.size()));
  decode_with(codes, first, out, [&](int64_t b) { return absmax[static_cast<size_t>(b)]; });
}

void nf4_dequantize(const Nf4Tensor& t, int64_t first, std::span<float> out) {
  LOOM_CHECK(first >= 0 && first + static_cast<int64_t>(out.size()) <= t.numel(), "nf4_dequantize: elements [", first,
             ", ", first + static_cast<int64_t>(out.size()), ") of ", t.numel());
  decode_with(t.codes, first, out, [&](int64_t b) { return t.block_absmax(b); });
}

Nf4Device nf4_to_backend(const Nf4Tensor& t, Backend& backend, MemCategory category) {
  Nf4Device d;
  Allocator& a = backend.allocator();
  d.codes = Tensor::empty(a, {static_cast<int64_t>(t.codes.size())}, DTYPE_U8, category);
  d.absmax_codes = Tensor::empty(a, {static_cast<int64_t>(t.absmax_codes.size())}, DTYPE_U8, category);
  d.absmax_steps = Tensor::empty(a, {static_cast<int64_t>(t.absmax_steps.size())}, DTYPE_F32, category);
  backend.write(d.codes, t.codes.data());
  backend.write(d.absmax_codes, t.absmax_codes.data());  // int8 as its two's complement bytes
  backend.write(d.absmax_steps, t.absmax_steps.data());
  d.spec = t.spec();
  return d;
}

}  // namespace loom
