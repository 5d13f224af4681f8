// Integer weight formats on host arrays (the layout in int_quant.h). The kernels that multiply
// with them are Backend::int_linear (backend/cpu/cpu_int_linear.cpp), tested against
// int_dequantize here.
#include "loom/precision/int_quant.h"

#include <algorithm>
#include <cmath>

#include "loom/core/error.h"
#include "loom/precision/formats.h"

namespace loom {

int64_t int_row_bytes(int bits, int64_t cols) {
  switch (bits) {
    case 8: return cols;
    case 4: return cols / 2;
    case 3: return cols / 8 * 3;
    default: throw Error(str_cat("int_row_bytes: ", bits, " bits is not a stored width (8, 4 or 3)"));
  }
}

int64_t IntWeight::bytes() const {
  return static_cast<int64_t>(codes.size() + scales.size() * sizeof(float) + zeros.size() +
                              input_scale.size() * sizeof(float));
}

int64_t IntWeight::stored_bytes() const {
  return static_cast<int64_t>(codes.size() + scales.size() * (storage.f16_scales ? 2 : sizeof(float)) +
                              (storage.symmetric ? 0 : zeros.size()) + input_scale.size() * sizeof(float));
}

IntWeightSpec int_weight_spec(int bits, int64_t group, int64_t rows, int64_t cols, bool act_int8, const std::string& what) {
  LOOM_CHECK(bits == 8 || bits == 4 || bits == 3, what, ": --bits ", bits, " is not supported, expected 8, 4 or 3");
  LOOM_CHECK(!act_int8 || bits == 8, what, ": W8A8 needs --bits 8, got ", bits);
  LOOM_CHECK(cols % 32 == 0, what, ": ", cols, " input columns, expected a multiple of 32 for the packed formats");
  const int64_t g = group == 0 || act_int8 ? cols : group;
  LOOM_CHECK(g > 0 && g % 32 == 0 && cols % g == 0, what, ": --group ", group, " must be a multiple of 32 that divides ",
             cols, " (the input columns), or 0 for one group per row");
  IntWeightSpec spec;
  spec.bits = bits, spec.group = g, spec.rows = rows, spec.cols = cols, spec.act_int8 = act_int8;
  return spec;
}

uint8_t int_code(const uint8_t* row, int bits, int64_t col) {
  if (bits == 8) return row[col];
  if (bits == 4) {
    const uint8_t b = row[col / 32 * 16 + col % 16];
    return (col % 32) < 16 ? b & 0x0F : b >> 4;
  }
  const uint8_t* chunk = row + col / 8 * 3;
  const uint32_t bits24 = chunk[0] | (uint32_t{chunk[1]} << 8) | (uint32_t{chunk[2]} << 16);
  return static_cast<uint8_t>((bits24 >> (3 * (col % 8))) & 7u);
}

void int_pack_row(const uint8_t* codes, int bits, int64_t cols, uint8_t* out) {
  if (bits == 8) {
    std::copy(codes, codes + cols, out);
    return;
  }
  if (bits == 4) {
    for (int64_t c = 0; c < cols; c += 32) {
      for (int j = 0; j < 16; ++j) out[c / 2 + j] = static_cast<uint8_t>((codes[c + j] & 0x0F) | (codes[c + j + 16] << 4));
    }
    return;
  }
  for (int64_t c = 0; c < cols; c += 8) {
    uint32_t v = 0;
    for (int j = 0; j < 8; ++j) v |= uint32_t{codes[c + j] & 7u} << (3 * j);
    uint8_t* chunk = out + c / 8 * 3;
    chunk[0] = static_cast<uint8_t>(v), chunk[1] = static_cast<uint8_t>(v >> 8), chunk[2] = static_cast<uint8_t>(v >> 16);
  }
}

void int_unpack_row(const uint8_t* packed, int bits, int64_t cols, uint8_t* codes) {
  for (int64_t c = 0; c < cols; ++c) codes[c] = int_code(packed, bits, c);
}

GroupParams int_group_params(std::span<const float> x, int bits, bool symmetric) {
  GroupParams p;
  if (symmetric) {
    float amax = 0.0f;
    for (float v : x) amax = std::max(amax, std::fabs(v));
    p.scale = amax > 0.0f ? amax / 127.0f : 1.0f;
    p.zero = 128;
    return p;
  }
  float lo = 0.0f, hi = 0.0f;
  for (float v : x) lo = std::min(lo, v), hi = std::max(hi, v);
  if (hi == lo) return p;  // all zeros
  const float top = static_cast<float>((1 << bits) - 1);
  p.scale = (hi - lo) / top;
  p.zero = static_cast<uint8_t>(std::clamp(std::nearbyint(-lo / p.scale), 0.0f, top));
  return p;
}

GroupParams int_stored_params(double lo, double hi, int bits, const IntStorage& storage) {
  const double top = static_cast<double>((1 << bits) - 1);
  GroupParams p;
  if (storage.symmetric) {
    const double amax = std::max(-lo, hi);
    p.zero = static_cast<uint8_t>(1 << (bits - 1));
    if (amax > 0.0) p.scale = static_cast<float>(2.0 * amax / top);
  } else if (hi != lo) {
    p.scale = static_cast<float>((hi - lo) / top);
  }
  if (storage.f16_scales) {
    // Up to the next f16 value (nearest, then one step up if that fell below): the group's range
    // still fits in 2^b - 1 steps, so no value is clipped by the rounding.
    uint32_t code = encode(FMT_FP16, p.scale, /*saturate=*/false);
    if (decode(FMT_FP16, code) < p.scale) ++code;
    const float rounded = decode(FMT_FP16, code);
    if (!std::isfinite(rounded)) return GroupParams{rounded, 0};  // check_stored_scales refuses it
    p.scale = rounded > 0.0f ? rounded : std::ldexp(1.0f, -24);  // below f16's smallest: its smallest subnormal
  }
  if (!storage.symmetric && hi != lo) {
    p.zero = static_cast<uint8_t>(std::clamp(std::nearbyint(-lo / static_cast<double>(p.scale)), 0.0, top));
  }
  return p;
}

IntWeight rtn_quantize(std::span<const float> w, const IntWeightSpec& spec, const IntStorage& storage) {
  LOOM_CHECK(!spec.act_int8 || storage == IntStorage{}, "rtn_quantize: W8A8 weights keep f32 per-row scales");
  const bool compact = !(storage == IntStorage{});
  LOOM_CHECK(static_cast<int64_t>(w.size()) == spec.rows * spec.cols, "rtn_quantize: ", w.size(), " values for (",
             spec.rows, ", ", spec.cols, ")");
  IntWeight q;
  q.spec = spec;
  q.storage = storage;
  const int64_t groups = spec.cols / spec.group, rb = int_row_bytes(spec.bits, spec.cols);
  q.codes.resize(static_cast<size_t>(spec.rows * rb));
  q.scales.resize(static_cast<size_t>(spec.rows * groups));
  q.zeros.resize(static_cast<size_t>(spec.rows * groups));
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < spec.rows; ++r) {
    std::vector<uint8_t> codes(static_cast<size_t>(spec.cols));
    for (int64_t g = 0; g < groups; ++g) {
      const std::span<const float> x = w.subspan(static_cast<size_t>(r * spec.cols + g * spec.group), static_cast<size_t>(spec.group));
      GroupParams p;
      if (compact) {
        float lo = 0.0f, hi = 0.0f;
        for (float v : x) lo = std::min(lo, v), hi = std::max(hi, v);
        p = int_stored_params(lo, hi, spec.bits, storage);
      } else {
        p = int_group_params(x, spec.bits, spec.act_int8);
      }
      q.scales[static_cast<size_t>(r * groups + g)] = p.scale;
      q.zeros[static_cast<size_t>(r * groups + g)] = p.zero;
      for (int64_t c = 0; c < spec.group; ++c) {
        uint8_t code = int_quantize_value(x[static_cast<size_t>(c)], p, spec.bits);
        if (spec.act_int8) code = std::max<uint8_t>(code, 1);  // symmetric: q - 128 in [-127, 127]
        codes[static_cast<size_t>(g * spec.group + c)] = code;
      }
    }
    int_pack_row(codes.data(), spec.bits, spec.cols, q.codes.data() + r * rb);
  }
  return q;
}

void check_stored_scales(const IntWeight& q, const std::string& what) {
  for (float s : q.scales) {
    LOOM_CHECK(std::isfinite(s), what, ": a group's scale is beyond f16's range (65504); quantize with --scales f32");
  }
}

std::vector<uint16_t> int_f16_scales(const IntWeight& q, const std::string& what) {
  std::vector<uint16_t> half(q.scales.size());
  for (size_t i = 0; i < half.size(); ++i) {
    half[i] = static_cast<uint16_t>(encode(FMT_FP16, q.scales[i], /*saturate=*/false));
    LOOM_CHECK(decode(FMT_FP16, half[i]) == q.scales[i], what, ": scale ", q.scales[i], " is not an f16 value");
  }
  return half;
}

std::vector<float> int_dequantize(const IntWeight& q) {
  const IntWeightSpec& s = q.spec;
  const int64_t groups = s.cols / s.group, rb = int_row_bytes(s.bits, s.cols);
  std::vector<float> w(static_cast<size_t>(s.rows * s.cols));
  for (int64_t r = 0; r < s.rows; ++r) {
    for (int64_t c = 0; c < s.cols; ++c) {
      const size_t g = static_cast<size_t>(r * groups + c / s.group);
      w[static_cast<size_t>(r * s.cols + c)] =
          int_dequantize_value(int_code(q.codes.data() + r * rb, s.bits, c), GroupParams{q.scales[g], q.zeros[g]});
    }
  }
  return w;
}

IntWeightDevice int_weight_to_backend(const IntWeight& q, Backend& backend, MemCategory category,
                                      std::optional<bool> compact) {
  const IntWeightSpec& s = q.spec;
  LOOM_CHECK(static_cast<int64_t>(q.codes.size()) == s.rows * int_row_bytes(s.bits, s.cols) &&
             static_cast<int64_t>(q.scales.size()) == s.rows * (s.cols / s.group) && q.zeros.size() == q.scales.size(),
             "int_weight_to_backend: the codes, scales and zeros do not match (", s.rows, ", ", s.cols, ") at ", s.bits,
             " bits, group ", s.group);
  const bool small = compact.value_or(backend.capabilities().compact_int_weights);
  const bool f16 = small && q.storage.f16_scales, no_zeros = small && q.storage.symmetric;
  IntWeightDevice d;
  d.spec = s;
  Allocator& a = backend.allocator();
  d.codes = Tensor::empty(a, {s.rows, int_row_bytes(s.bits, s.cols)}, DTYPE_U8, category);
  backend.write(d.codes, q.codes.data());
  d.scales = Tensor::empty(a, {s.rows, s.cols / s.group}, f16 ? DTYPE_F16 : DTYPE_F32, category);
  if (f16) {
    backend.write(d.scales, int_f16_scales(q, "int_weight_to_backend: an f16-scaled weight").data());
  } else {
    backend.write(d.scales, q.scales.data());
  }
  if (no_zeros) {
    const uint8_t z = static_cast<uint8_t>(1 << (s.bits - 1));
    for (uint8_t v : q.zeros) {
      LOOM_CHECK(v == z, "int_weight_to_backend: zero point ", int{v}, " in a symmetric weight, expected ", int{z});
    }
  } else {
    d.zeros = Tensor::empty(a, {s.rows, s.cols / s.group}, DTYPE_U8, category);
    backend.write(d.zeros, q.zeros.data());
  }
  if (!q.input_scale.empty()) {
    LOOM_CHECK(static_cast<int64_t>(q.input_scale.size()) == s.cols, "int_weight_to_backend: input scale of ",
               q.input_scale.size(), " values for ", s.cols, " columns");
    d.input_scale = Tensor::empty(a, {s.cols}, DTYPE_F32, category);
    backend.write(d.input_scale, q.input_scale.data());
  }
  d.bytes = d.codes.nbytes() + d.scales.nbytes() + (d.zeros.defined() ? d.zeros.nbytes() : 0) +
            (d.input_scale.defined() ? d.input_scale.nbytes() : 0);
  return d;
}

}  // namespace loom
