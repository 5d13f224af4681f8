// CPU kernels, templated on the float type (float for training, double for reference checks).
// Each kernel states its formula; legend and gradient invariants are those of backend.h.
// Parallel loops split rows (or column blocks, where rows would race on a parameter gradient)
// with static schedules, so every result is independent of timing: a run is reproducible.
#pragma once
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "loom/backend/cpu/cpu_gemm.h"
#include "loom/backend/cpu/cpu_math.h"
#include "loom/backend/activation.h"
#include "loom/backend/rope.h"
#include "loom/core/dtype.h"

namespace loom::cpu {

constexpr int64_t kColumnBlock = 64;  // columns per task in column-parallel reductions

// The calling thread's row of at least n Ts (in cache), one per use, so that an op may hold
// several at once: an output row (output_row), a widened input row (input_row), a row stored
// before it is added (the norms' accumulating backward).
enum ThreadRow { kOutputRow, kInputRow, kAddedRow };
template <typename T, ThreadRow use>
T* thread_row(int64_t n) {
  thread_local std::vector<T> row;
  if (static_cast<int64_t>(row.size()) < n) row.resize(static_cast<size_t>(n));
  return row.data();
}

// A forward op's output O: T itself, or bf16 bits (O = uint16_t with T = float; precision.activations
// = bf16's saved fields). A bf16 output is computed in T into the calling thread's output row and
// rounded into out after (round_to_bf16_bits: the bits Backend::cast gives), in cache.
template <typename T, typename O>
T* output_row(O* out, int64_t n) {
  if constexpr (std::is_same_v<T, O>) {
    return out;
  } else {
    static_assert(std::is_same_v<T, float> && std::is_same_v<O, uint16_t>, "a bf16 output of an f32 op only");
    return thread_row<float, kOutputRow>(n);
  }
}
// Adds row t into d (d += t), as add_inplace adds: t is a value stored first (kAddedRow), so that
// its product is rounded on its own, not contracted into the add.
template <typename T>
void add_row(T* d, const T* t, int64_t n) {
#pragma omp simd
  for (int64_t c = 0; c < n; ++c) d[c] += t[c];
}

// An op's input S: T itself, or bf16 bits (S = uint16_t with T = float: a bf16 GEMM output,
// LayerPlan::fc_bf16) widened exactly into the calling thread's input row.
template <typename T, typename S>
const T* input_row(const S* x, int64_t n) {
  if constexpr (std::is_same_v<T, S>) {
    return x;
  } else {
    static_assert(std::is_same_v<T, float> && std::is_same_v<S, uint16_t>, "a bf16 input of an f32 op only");
    float* row = thread_row<float, kInputRow>(n);
    for (int64_t i = 0; i < n; ++i) row[i] = bf16_to_f32(bf16{x[i]});
    return row;
  }
}
template <typename T, typename O>
void store_output_row(const T* row, O* out, int64_t n) {
  if constexpr (!std::is_same_v<T, O>) round_to_bf16_bits(row, out, n);
}

// acc[c] (C) += sum over rows r of x[r, c]; parallel over column blocks, rows summed in order. x
// may be bf16 bits (S = uint16_t, T = float: each element widened exactly, summed in f32).
template <typename T, typename S>
void column_sums_accumulate(const S* x, int64_t rows, int64_t cols, T* acc) {
#pragma omp parallel for schedule(static)
  for (int64_t c0 = 0; c0 < cols; c0 += kColumnBlock) {
    const int64_t c1 = std::min(cols, c0 + kColumnBlock);
    for (int64_t r = 0; r < rows; ++r) {
      const S* row = x + r * cols;
#pragma omp simd
      for (int64_t c = c0; c < c1; ++c) {
        if constexpr (std::is_same_v<S, uint16_t>) acc[c] += bf16_to_f32(bf16{row[c]});
        else acc[c] += row[c];
      }
    }
  }
}

// out[n, c] = table[tokens[n], c] (+ positions[n % T, c]). S: the table's element, T or bf16 (a
// checkpoint's embedding used in place, widened exactly into f32).
template <typename T, typename S = T>
void embedding_forward(const int32_t* tokens, const S* table, const T* positions, T* out, int64_t n_tokens,
                       int64_t seq_len, int64_t channels) {
  const auto value = [](S v) -> T {
    if constexpr (std::is_same_v<S, bf16>) return bf16_to_f32(v);
    else return v;
  };
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < n_tokens; ++n) {
    const S* row = table + static_cast<int64_t>(tokens[n]) * channels;
    const T* pos = positions ? positions + (n % seq_len) * channels : nullptr;
    T* o = out + n * channels;
    if (pos) {
#pragma omp simd
      for (int64_t c = 0; c < channels; ++c) o[c] = value(row[c]) + pos[c];
    } else {
      std::transform(row, row + channels, o, value);
    }
  }
}

// dtable[tokens[n]] += dout[n]; dpositions[n % T] += dout[n]. Column blocks keep it race-free.
template <typename T>
void embedding_backward(const int32_t* tokens, const T* dout, T* dtable, T* dpositions, int64_t n_tokens,
                        int64_t seq_len, int64_t channels) {
#pragma omp parallel for schedule(static)
  for (int64_t c0 = 0; c0 < channels; c0 += kColumnBlock) {
    const int64_t c1 = std::min(channels, c0 + kColumnBlock);
    for (int64_t n = 0; n < n_tokens; ++n) {
      const T* g = dout + n * channels;
      T* dt = dtable + static_cast<int64_t>(tokens[n]) * channels;
#pragma omp simd
      for (int64_t c = c0; c < c1; ++c) dt[c] += g[c];
      if (dpositions) {
        T* dp = dpositions + (n % seq_len) * channels;
#pragma omp simd
        for (int64_t c = c0; c < c1; ++c) dp[c] += g[c];
      }
    }
  }
}

// out = (x - mean) * rstd * w + b, mean and rstd over the row (biased variance).
template <typename T, typename O = T>
void layernorm_forward(const T* x, const T* w, const T* b, O* out, T* mean, T* rstd, int64_t rows,
                       int64_t channels, T eps) {
#pragma omp parallel for schedule(static) if (rows * channels >= kParallelMinElements)
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * channels;
    T sum = 0;
#pragma omp simd reduction(+ : sum)
    for (int64_t c = 0; c < channels; ++c) sum += xr[c];
    const T m = sum / static_cast<T>(channels);
    T var = 0;
#pragma omp simd reduction(+ : var)
    for (int64_t c = 0; c < channels; ++c) var += (xr[c] - m) * (xr[c] - m);
    const T s = T(1) / std::sqrt(var / static_cast<T>(channels) + eps);
    T* o = output_row<T>(out + r * channels, channels);
#pragma omp simd
    for (int64_t c = 0; c < channels; ++c) o[c] = (xr[c] - m) * s * w[c] + b[c];
    store_output_row(o, out + r * channels, channels);
    mean[r] = m;
    rstd[r] = s;
  }
}

// xhat = (x - mean) * rstd; g = dout * w;
// dx = rstd * (g - mean(g) - xhat * mean(g * xhat)) (or dx += that: accumulate); dw += sum_rows
// dout * xhat; db += sum_rows dout. dx16 (f32 only; null: none): each finished row of dx rounded
// to bf16 bits as cast rounds (round_to_bf16_bits), while it is in cache.
template <typename T>
void layernorm_backward(const T* dout, const T* x, const T* w, const T* mean, const T* rstd, T* dx, T* dw,
                        T* db, int64_t rows, int64_t channels, bool accumulate = false, uint16_t* dx16 = nullptr) {
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * channels;
    const T* gr = dout + r * channels;
    const T m = mean[r], s = rstd[r];
    T sum_g = 0, sum_gx = 0;
#pragma omp simd reduction(+ : sum_g, sum_gx)
    for (int64_t c = 0; c < channels; ++c) {
      const T g = gr[c] * w[c];
      sum_g += g;
      sum_gx += g * (xr[c] - m) * s;
    }
    const T mean_g = sum_g / static_cast<T>(channels), mean_gx = sum_gx / static_cast<T>(channels);
    T* d = accumulate ? thread_row<T, kAddedRow>(channels) : dx + r * channels;
#pragma omp simd
    for (int64_t c = 0; c < channels; ++c) d[c] = s * (gr[c] * w[c] - mean_g - (xr[c] - m) * s * mean_gx);
    if (accumulate) add_row(dx + r * channels, d, channels);
    if constexpr (std::is_same_v<T, float>) {
      if (dx16 != nullptr) round_to_bf16_bits(dx + r * channels, dx16 + r * channels, channels);
    }
  }
#pragma omp parallel for schedule(static)
  for (int64_t c0 = 0; c0 < channels; c0 += kColumnBlock) {
    const int64_t c1 = std::min(channels, c0 + kColumnBlock);
    for (int64_t r = 0; r < rows; ++r) {
      const T* xr = x + r * channels;
      const T* gr = dout + r * channels;
      const T m = mean[r], s = rstd[r];
#pragma omp simd
      for (int64_t c = c0; c < c1; ++c) {
        dw[c] += gr[c] * (xr[c] - m) * s;
        db[c] += gr[c];
      }
    }
  }
}

// out = x * rstd * w, rstd = 1 / sqrt(mean(x^2) + eps).
template <typename T, typename O = T>
void rmsnorm_forward(const T* x, const T* w, O* out, T* rstd, int64_t rows, int64_t channels, T eps) {
#pragma omp parallel for schedule(static) if (rows * channels >= kParallelMinElements)
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * channels;
    T ss = 0;
#pragma omp simd reduction(+ : ss)
    for (int64_t c = 0; c < channels; ++c) ss += xr[c] * xr[c];
    const T s = T(1) / std::sqrt(ss / static_cast<T>(channels) + eps);
    T* o = output_row<T>(out + r * channels, channels);
#pragma omp simd
    for (int64_t c = 0; c < channels; ++c) o[c] = xr[c] * s * w[c];
    store_output_row(o, out + r * channels, channels);
    rstd[r] = s;
  }
}

// One row of the RMSNorm backward: xhat = x * s; d = s * (g w - xhat * mean(g w xhat)), or d +=
// that (accumulate). d may be g (in place: each g[c] is read before d[c] is written).
template <typename T>
inline void rmsnorm_row_dx(const T* g, const T* x, const T* w, T s, T* d, int64_t channels, bool accumulate = false) {
  T sum_gx = 0;
#pragma omp simd reduction(+ : sum_gx)
  for (int64_t c = 0; c < channels; ++c) sum_gx += g[c] * w[c] * x[c] * s;
  const T mean_gx = sum_gx / static_cast<T>(channels);
  T* t = accumulate ? thread_row<T, kAddedRow>(channels) : d;
#pragma omp simd
  for (int64_t c = 0; c < channels; ++c) t[c] = s * (g[c] * w[c] - x[c] * s * mean_gx);
  if (accumulate) add_row(d, t, channels);
}

// xhat = x * rstd; g = dout * w; dx = rstd * (g - xhat * mean(g * xhat)); dw += sum_rows dout * xhat.
// dx16: as layernorm_backward's.
template <typename T>
void rmsnorm_backward(const T* dout, const T* x, const T* w, const T* rstd, T* dx, T* dw, int64_t rows,
                      int64_t channels, bool accumulate = false, uint16_t* dx16 = nullptr) {
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    rmsnorm_row_dx(dout + r * channels, x + r * channels, w, rstd[r], dx + r * channels, channels, accumulate);
    if constexpr (std::is_same_v<T, float>) {
      if (dx16 != nullptr) round_to_bf16_bits(dx + r * channels, dx16 + r * channels, channels);
    }
  }
#pragma omp parallel for schedule(static)
  for (int64_t c0 = 0; c0 < channels; c0 += kColumnBlock) {
    const int64_t c1 = std::min(channels, c0 + kColumnBlock);
    for (int64_t r = 0; r < rows; ++r) {
      const T* xr = x + r * channels;
      const T* gr = dout + r * channels;
      const T s = rstd[r];
#pragma omp simd
      for (int64_t c = c0; c < c1; ++c) dw[c] += gr[c] * xr[c] * s;
    }
  }
}

// Per-head RMSNorm in place: row r = (token r / n, head first + r % n) of x (tokens, width),
// hd wide, is copied to in[r] and normalised as rmsnorm_forward does.
template <typename T>
void head_rmsnorm_forward(T* x, const T* w, T* in, T* rstd, int64_t tokens, int64_t width, int64_t first, int64_t n,
                          int64_t hd, T eps) {
#pragma omp parallel for schedule(static) if (tokens * n * hd >= kParallelMinElements)
  for (int64_t r = 0; r < tokens * n; ++r) {
    T* xr = x + (r / n) * width + (first + r % n) * hd;
    T* ir = in + r * hd;
    T ss = 0;
#pragma omp simd reduction(+ : ss)
    for (int64_t c = 0; c < hd; ++c) ir[c] = xr[c], ss += xr[c] * xr[c];
    const T s = T(1) / std::sqrt(ss / static_cast<T>(hd) + eps);
#pragma omp simd
    for (int64_t c = 0; c < hd; ++c) xr[c] = ir[c] * s * w[c];
    rstd[r] = s;
  }
}

// Its backward, rmsnorm_backward's formulas on the same rows: dw first (it reads d(out)), then
// d(out) is replaced by d(in) in place.
template <typename T>
void head_rmsnorm_backward(T* dx, const T* in, const T* w, const T* rstd, T* dw, int64_t tokens, int64_t width,
                           int64_t first, int64_t n, int64_t hd) {
  auto grad = [&](int64_t r) { return dx + (r / n) * width + (first + r % n) * hd; };
#pragma omp parallel for schedule(static)
  for (int64_t c0 = 0; c0 < hd; c0 += kColumnBlock) {
    const int64_t c1 = std::min(hd, c0 + kColumnBlock);
    for (int64_t r = 0; r < tokens * n; ++r) {
      const T* gr = grad(r);
      const T* xr = in + r * hd;
      for (int64_t c = c0; c < c1; ++c) dw[c] += gr[c] * xr[c] * rstd[r];
    }
  }
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < tokens * n; ++r) rmsnorm_row_dx(grad(r), in + r * hd, w, rstd[r], grad(r), hd);
}

constexpr double kGeluScale = 0.7978845608028654;  // sqrt(2/pi)
constexpr double kGeluCubic = 0.044715;

// y = 0.5 x (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x^3).
template <typename T>
inline T gelu_of(T v) {
  const T u = T(kGeluScale) * (v + T(kGeluCubic) * v * v * v);
  return T(0.5) * v * (T(1) + tanh_t<T>(u));
}
template <typename T, typename O = T, typename S = T>
void gelu_forward(const S* x, O* out, int64_t n) {
  if constexpr (std::is_same_v<T, O> && std::is_same_v<T, S>) {
#pragma omp parallel for simd schedule(static) if (n >= kParallelMinElements)
    for (int64_t i = 0; i < n; ++i) out[i] = gelu_of(x[i]);
  } else {  // a bf16 x or out: blocks widened (input_row), computed in T and rounded (output_row)
    constexpr int64_t kBlock = 4096;
#pragma omp parallel for schedule(static) if (n >= kParallelMinElements)
    for (int64_t b0 = 0; b0 < n; b0 += kBlock) {
      const int64_t m = std::min(kBlock, n - b0);
      const T* xr = input_row<T>(x + b0, m);
      T* o = output_row<T>(out + b0, m);
#pragma omp simd
      for (int64_t i = 0; i < m; ++i) o[i] = gelu_of(xr[i]);
      store_output_row(o, out + b0, m);
    }
  }
}

// dy/dx = 0.5 (1 + tanh u) + 0.5 x (1 - tanh^2 u) sqrt(2/pi) (1 + 3 * 0.044715 x^2).
template <typename T>
inline T gelu_grad_of(T v, T g) {
  const T u = T(kGeluScale) * (v + T(kGeluCubic) * v * v * v);
  const T t = tanh_t<T>(u);
  const T du = T(kGeluScale) * (T(1) + T(3 * kGeluCubic) * v * v);
  return g * (T(0.5) * (T(1) + t) + T(0.5) * v * (T(1) - t * t) * du);
}
template <typename T, typename O = T, typename S = T>
void gelu_backward(const S* x, const T* dout, O* dx, int64_t n) {
  if constexpr (std::is_same_v<T, O> && std::is_same_v<T, S>) {
#pragma omp parallel for simd schedule(static)
    for (int64_t i = 0; i < n; ++i) dx[i] = gelu_grad_of(x[i], dout[i]);
  } else {  // a bf16 x or dx: blocks widened (input_row), computed in T and rounded (output_row)
    constexpr int64_t kBlock = 4096;
#pragma omp parallel for schedule(static)
    for (int64_t b0 = 0; b0 < n; b0 += kBlock) {
      const int64_t m = std::min(kBlock, n - b0);
      const T* xr = input_row<T>(x + b0, m);
      T* d = output_row<T>(dx + b0, m);
#pragma omp simd
      for (int64_t i = 0; i < m; ++i) d[i] = gelu_grad_of(xr[i], dout[b0 + i]);
      store_output_row(d, dx + b0, m);
    }
  }
}

// The gate activation act(g) and its derivative (backend/activation.h).
template <typename T>
inline T gate_act(GateActivation act, T g) {
  if (act == GateActivation::silu) return g * sigmoid_t<T>(g);
  if (act == GateActivation::sigmoid) return sigmoid_t<T>(g);
  if (act == GateActivation::swiglu_oai) {
    const T c = g < T(kSwigluOaiLimit) ? g : T(kSwigluOaiLimit);
    return c * sigmoid_t<T>(T(kSwigluOaiAlpha) * c);
  }
  const T u = T(kGeluScale) * (g + T(kGeluCubic) * g * g * g);
  return T(0.5) * g * (T(1) + tanh_t<T>(u));
}
template <typename T>
inline T gate_act_grad(GateActivation act, T g) {
  if (act == GateActivation::silu) {
    const T sg = sigmoid_t<T>(g);
    return sg * (T(1) + g * (T(1) - sg));
  }
  if (act == GateActivation::sigmoid) {
    const T sg = sigmoid_t<T>(g);
    return sg * (T(1) - sg);
  }
  if (act == GateActivation::swiglu_oai) {  // the clamp passes the gradient up to the limit (torch's clamp)
    if (g > T(kSwigluOaiLimit)) return T(0);
    const T sg = sigmoid_t<T>(T(kSwigluOaiAlpha) * g);
    return sg * (T(1) + T(kSwigluOaiAlpha) * g * (T(1) - sg));
  }
  const T u = T(kGeluScale) * (g + T(kGeluCubic) * g * g * g);
  const T t = tanh_t<T>(u);
  const T du = T(kGeluScale) * (T(1) + T(3 * kGeluCubic) * g * g);
  return T(0.5) * (T(1) + t) + T(0.5) * g * (T(1) - t * t) * du;
}
// The gated MLP's up operand: u itself, or swiglu_oai's clamp(u, -7, 7) + 1; and its derivative.
template <typename T>
inline T glu_up(GateActivation act, T u) {
  if (act != GateActivation::swiglu_oai) return u;
  const T l = T(kSwigluOaiLimit);
  return (u < -l ? -l : (u > l ? l : u)) + T(1);
}
template <typename T>
inline T glu_up_grad(GateActivation act, T u) {
  if (act != GateActivation::swiglu_oai) return T(1);
  return u >= -T(kSwigluOaiLimit) && u <= T(kSwigluOaiLimit) ? T(1) : T(0);
}

// x (N, 2F) = [gate | up]; out = act(gate) * up (silu: SwiGLU, gelu_tanh: GeGLU; swiglu_oai: its up clamped, + 1).
template <typename T, GateActivation act, typename O = T, typename S = T>
void glu_forward(const S* x, O* out, int64_t rows, int64_t hidden) {
#pragma omp parallel for schedule(static) if (rows * hidden >= kParallelMinElements)
  for (int64_t r = 0; r < rows; ++r) {
    const T* gate = input_row<T>(x + r * 2 * hidden, 2 * hidden);
    const T* up = gate + hidden;
    T* o = output_row<T>(out + r * hidden, hidden);
#pragma omp simd
    for (int64_t j = 0; j < hidden; ++j) o[j] = gate_act<T>(act, gate[j]) * glu_up<T>(act, up[j]);
    store_output_row(o, out + r * hidden, hidden);
  }
}

// dgate = dout * up * act'(g); dup = dout * act(g).
template <typename T, GateActivation act, typename O = T, typename S = T>
void glu_backward(const S* x, const T* dout, O* dx, int64_t rows, int64_t hidden) {
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const T* gate = input_row<T>(x + r * 2 * hidden, 2 * hidden);
    const T* up = gate + hidden;
    const T* g = dout + r * hidden;
    T* dgate = output_row<T>(dx + r * 2 * hidden, 2 * hidden);
    T* dup = dgate + hidden;
#pragma omp simd
    for (int64_t j = 0; j < hidden; ++j) {
      dgate[j] = g[j] * glu_up<T>(act, up[j]) * gate_act_grad<T>(act, gate[j]);
      dup[j] = g[j] * gate_act<T>(act, gate[j]) * glu_up_grad<T>(act, up[j]);
    }
    store_output_row(dgate, dx + r * 2 * hidden, 2 * hidden);
  }
}

// Rotates pairs (j, j + d/2) of the first n_heads heads of every row by angle
// direction * (pos_offset + t) * theta^(-2j/d), d = rope_rotary_dim (the head's first d dims; hd
// unless partial). direction -1 is the inverse (the backward).
template <typename T>
void rope_rotate(T* x, int64_t batch, int64_t seq_len, int64_t width, int64_t head_dim, int64_t n_heads,
                 const RopeSpec& rope, int64_t pos_offset, double direction) {
  const int64_t rotary = rope_rotary_dim(rope, head_dim), half = rotary / 2;
#pragma omp parallel for schedule(static) if (batch * seq_len * n_heads * head_dim >= kParallelMinElements)
  for (int64_t t = 0; t < seq_len; ++t) {
    for (int64_t j = 0; j < half; ++j) {
      const double angle =
          direction * static_cast<double>(pos_offset + t) * rope_inv_freq(rope, j, rotary);
      const T cs = static_cast<T>(std::cos(angle) * rope.amplitude), sn = static_cast<T>(std::sin(angle) * rope.amplitude);
      for (int64_t b = 0; b < batch; ++b) {
        T* row = x + (b * seq_len + t) * width;
        for (int64_t h = 0; h < n_heads; ++h) {
          T* v = row + h * head_dim;
          const T a = v[j], c = v[j + half];
          v[j] = a * cs - c * sn;
          v[j + half] = c * cs + a * sn;
        }
      }
    }
  }
}

// Query rows per block of the causal kernels: a block of rows [i0, i1) attends to keys [0, i1)
// only, so S, P V and the backward's GEMMs skip the blocks above the diagonal: (nb + 1) / (2 nb)
// of the full T x T work for nb = T / 64 blocks (62.5% at T = 256, 56% at 512). Within a block
// the upper triangle is still computed and discarded: a GEMM at full speed beats a triangular
// loop at a tenth of it. 64 rows keep the GEMMs at speed (measured: the small model's step).
inline constexpr int64_t kCausalRows = 64;

// Rows [i0, i1) of S (leading dimension T) into the causal softmax P in place: row i over keys
// [0, i], zero after (the rest of the row too).
template <typename T>
inline void causal_softmax_rows(T* p, int64_t Tn, int64_t i0, int64_t i1) {
  for (int64_t i = i0; i < i1; ++i) {
    T* row = p + i * Tn;
    const T max_s = max_of(row, i + 1);
    T sum = 0;
#pragma omp simd reduction(+ : sum)
    for (int64_t j = 0; j <= i; ++j) {
      row[j] = exp_t<T>(row[j] - max_s);
      sum += row[j];
    }
    const T inv = T(1) / sum;
#pragma omp simd
    for (int64_t j = 0; j <= i; ++j) row[j] *= inv;
    std::fill(row + i + 1, row + Tn, T(0));
  }
}

// Rows [i0, i1) of dP (in ds, leading dimension T, keys [0, i1)) into dS = scale P o (dP - D),
// D_i = dO_i . O_i (dO, O: head rows with leading dimension OW).
template <typename T>
inline void softmax_grad_rows(T* ds, const T* p, const T* dO, const T* o, int64_t Tn, int64_t OW, int64_t head_dim,
                              int64_t i0, int64_t i1, T scale) {
  for (int64_t i = i0; i < i1; ++i) {
    T D = 0;
#pragma omp simd reduction(+ : D)
    for (int64_t d = 0; d < head_dim; ++d) D += dO[i * OW + d] * o[i * OW + d];
    T* row = ds + i * Tn;
    const T* prow = p + i * Tn;
#pragma omp simd
    for (int64_t j = 0; j < i1; ++j) row[j] = scale * prow[j] * (row[j] - D);
  }
}

// Causal attention, one (batch, head) per task, as GEMMs on strided views of qkv (no permute),
// per block of kCausalRows query rows [i0, i1):
//   S = scale Q_h[i0,i1) K_g[0,i1)^T written into probs; P = causal_softmax(S) in place (P[i, j>i]
//   = 0, the rest of the row too); O_h[i0,i1) = P[i0,i1)(0,i1) V_g[0,i1).
// Query head h reads kv head g = h / (H/KV).
// One parallel region per call: the tasks are spread over the threads (static schedule) and each
// runs its GEMMs (oneDNN sgemm, sequential inside the region) and rows on its own thread. Each
// task's arithmetic is the same whatever the thread count, so results are bitwise independent of
// it. Before, the tasks ran one after another with the threads inside each GEMM and row loop:
// 6 parallel regions per (batch, head) and layer, 5,100 per GPT-2 124M step (B=4, T=64), which
// made passive OpenMP waits cost 12% of the step; one region per call is as fast spinning and
// costs ~2% passive (docs/performance.md).
template <typename T>
void attention_forward(const T* qkv, T* out, T* probs, int64_t batch, int64_t seq_len, int64_t n_head,
                       int64_t n_kv_head, int64_t head_dim) {
  const int64_t W = (n_head + 2 * n_kv_head) * head_dim, OW = n_head * head_dim, Tn = seq_len;
  const int64_t group = n_head / n_kv_head;
  const T scale = T(1) / std::sqrt(static_cast<T>(head_dim));
#pragma omp parallel for schedule(static)
  for (int64_t task = 0; task < batch * n_head; ++task) {
    const int64_t b = task / n_head, h = task % n_head, g = h / group;
    const T* q = qkv + b * Tn * W + h * head_dim;
    const T* k = qkv + b * Tn * W + (n_head + g) * head_dim;
    const T* v = qkv + b * Tn * W + (n_head + n_kv_head + g) * head_dim;
    T* p = probs + (b * n_head + h) * Tn * Tn;
    for (int64_t i0 = 0; i0 < Tn; i0 += kCausalRows) {
      const int64_t i1 = std::min(Tn, i0 + kCausalRows);
      gemm_t<T>(false, true, i1 - i0, i1, head_dim, scale, q + i0 * W, W, k, W, T(0), p + i0 * Tn, Tn);
      causal_softmax_rows(p, Tn, i0, i1);
      gemm_t<T>(false, false, i1 - i0, head_dim, i1, T(1), p + i0 * Tn, Tn, v, W, T(0),
                out + (b * Tn + i0) * OW + h * head_dim, OW);
    }
  }
}

// Backward with the saved P (FlashAttention-2's formulation, Dao 2023), per (batch, kv head) task,
// per block of kCausalRows query rows [i0, i1) and their keys [0, i1) (the forward's blocks):
//   dP = dO_h V_g^T; D_i = dO_i . O_i; dS = scale P o (dP - D)  (scratch, T x T per thread)
//   dQ_h = dS K_g;  dK_g += dS^T Q_h;  dV_g += P^T dO_h  (the group's query heads and the row
//   blocks accumulate into dK and dV, zeroed first, in a fixed order).
// scratch holds threads x T x T elements (omp_get_max_threads()). One region, as the forward.
template <typename T>
void attention_backward(const T* dout, const T* qkv, const T* out, const T* probs, T* dqkv, T* scratch,
                        int64_t batch, int64_t seq_len, int64_t n_head, int64_t n_kv_head, int64_t head_dim) {
  const int64_t W = (n_head + 2 * n_kv_head) * head_dim, OW = n_head * head_dim, Tn = seq_len;
  const int64_t group = n_head / n_kv_head;
  const T scale = T(1) / std::sqrt(static_cast<T>(head_dim));
#pragma omp parallel for schedule(static)
  for (int64_t task = 0; task < batch * n_kv_head; ++task) {
    const int64_t b = task / n_kv_head, g = task % n_kv_head;
    T* ds = scratch + static_cast<int64_t>(omp_get_thread_num()) * Tn * Tn;
    const T* k = qkv + b * Tn * W + (n_head + g) * head_dim;
    const T* v = qkv + b * Tn * W + (n_head + n_kv_head + g) * head_dim;
    T* dk = dqkv + b * Tn * W + (n_head + g) * head_dim;
    T* dv = dqkv + b * Tn * W + (n_head + n_kv_head + g) * head_dim;
    for (int64_t t = 0; t < Tn; ++t) {
      std::fill(dk + t * W, dk + t * W + head_dim, T(0));
      std::fill(dv + t * W, dv + t * W + head_dim, T(0));
    }
    for (int64_t h = g * group; h < (g + 1) * group; ++h) {
      const T* q = qkv + b * Tn * W + h * head_dim;
      const T* o = out + b * Tn * OW + h * head_dim;
      const T* dO = dout + b * Tn * OW + h * head_dim;
      const T* p = probs + (b * n_head + h) * Tn * Tn;
      for (int64_t i0 = 0; i0 < Tn; i0 += kCausalRows) {
        const int64_t i1 = std::min(Tn, i0 + kCausalRows), rows = i1 - i0;
        T* dsb = ds + i0 * Tn;
        gemm_t<T>(false, true, rows, i1, head_dim, T(1), dO + i0 * OW, OW, v, W, T(0), dsb, Tn);
        softmax_grad_rows(ds, p, dO, o, Tn, OW, head_dim, i0, i1, scale);
        gemm_t<T>(false, false, rows, head_dim, i1, T(1), dsb, Tn, k, W, T(0), dqkv + (b * Tn + i0) * W + h * head_dim, W);
        gemm_t<T>(true, false, i1, head_dim, rows, T(1), dsb, Tn, q + i0 * W, W, T(1), dk, W);
        gemm_t<T>(true, false, i1, head_dim, rows, T(1), p + i0 * Tn, Tn, dO + i0 * OW, OW, T(1), dv, W);
      }
    }
  }
}

// precision.attention = bf16: attention_forward / attention_backward with every GEMM's operands
// rounded to bf16 (round_to_bf16_bits, RNE) and multiplied by oneDNN's bf16 GEMM with fp32
// accumulation; the softmax, D and dS are computed, and P saved, in fp32 as there. Each task
// rounds its heads' q, k, v (and dO) rows into contiguous bf16 copies (T x hd), and each block's
// P (and dS) rows into a bf16 block (rows x i1). Per-thread scratch: attention_bf16_scratch floats.
inline int64_t attention_bf16_scratch(int64_t seq_len, int64_t head_dim) {
  const int64_t halves = 4 * seq_len * head_dim + 2 * kCausalRows * seq_len;  // bf16 elements
  return seq_len * seq_len + (halves + 1) / 2;  // dS (fp32), then the bf16 copies
}

// rows x width fp32 (leading dimension ld) into bf16, contiguous.
inline void rows_to_bf16(const float* x, int64_t ld, int64_t rows, int64_t width, uint16_t* out) {
  for (int64_t r = 0; r < rows; ++r) round_to_bf16_bits(x + r * ld, out + r * width, width);
}

inline void attention_forward_bf16(const float* qkv, float* out, float* probs, float* scratch, int64_t batch,
                                   int64_t seq_len, int64_t n_head, int64_t n_kv_head, int64_t head_dim) {
  const int64_t W = (n_head + 2 * n_kv_head) * head_dim, OW = n_head * head_dim, Tn = seq_len, hd = head_dim;
  const int64_t group = n_head / n_kv_head;
  const float scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
#pragma omp parallel for schedule(static)
  for (int64_t task = 0; task < batch * n_head; ++task) {
    const int64_t b = task / n_head, h = task % n_head, g = h / group;
    float* mine = scratch + static_cast<int64_t>(omp_get_thread_num()) * attention_bf16_scratch(Tn, hd);
    uint16_t* qb = reinterpret_cast<uint16_t*>(mine + Tn * Tn);
    uint16_t *kb = qb + Tn * hd, *vb = kb + Tn * hd, *pb = vb + Tn * hd;
    rows_to_bf16(qkv + b * Tn * W + h * hd, W, Tn, hd, qb);
    rows_to_bf16(qkv + b * Tn * W + (n_head + g) * hd, W, Tn, hd, kb);
    rows_to_bf16(qkv + b * Tn * W + (n_head + n_kv_head + g) * hd, W, Tn, hd, vb);
    float* p = probs + (b * n_head + h) * Tn * Tn;
    for (int64_t i0 = 0; i0 < Tn; i0 += kCausalRows) {
      const int64_t i1 = std::min(Tn, i0 + kCausalRows), rows = i1 - i0;
      gemm_bf16(false, true, rows, i1, hd, scale, qb + i0 * hd, hd, kb, hd, 0.0f, p + i0 * Tn, Tn);
      causal_softmax_rows(p, Tn, i0, i1);
      rows_to_bf16(p + i0 * Tn, Tn, rows, i1, pb);
      gemm_bf16(false, false, rows, hd, i1, 1.0f, pb, i1, vb, hd, 0.0f, out + (b * Tn + i0) * OW + h * hd, OW);
    }
  }
}

inline void attention_backward_bf16(const float* dout, const float* qkv, const float* out, const float* probs,
                                    float* dqkv, float* scratch, int64_t batch, int64_t seq_len, int64_t n_head,
                                    int64_t n_kv_head, int64_t head_dim) {
  const int64_t W = (n_head + 2 * n_kv_head) * head_dim, OW = n_head * head_dim, Tn = seq_len, hd = head_dim;
  const int64_t group = n_head / n_kv_head;
  const float scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
#pragma omp parallel for schedule(static)
  for (int64_t task = 0; task < batch * n_kv_head; ++task) {
    const int64_t b = task / n_kv_head, g = task % n_kv_head;
    float* ds = scratch + static_cast<int64_t>(omp_get_thread_num()) * attention_bf16_scratch(Tn, hd);
    uint16_t* qb = reinterpret_cast<uint16_t*>(ds + Tn * Tn);
    uint16_t *kb = qb + Tn * hd, *vb = kb + Tn * hd, *dob = vb + Tn * hd, *dsb = dob + Tn * hd;
    uint16_t* pb = dsb + kCausalRows * Tn;
    rows_to_bf16(qkv + b * Tn * W + (n_head + g) * hd, W, Tn, hd, kb);
    rows_to_bf16(qkv + b * Tn * W + (n_head + n_kv_head + g) * hd, W, Tn, hd, vb);
    float* dk = dqkv + b * Tn * W + (n_head + g) * hd;
    float* dv = dqkv + b * Tn * W + (n_head + n_kv_head + g) * hd;
    for (int64_t t = 0; t < Tn; ++t) {
      std::fill(dk + t * W, dk + t * W + hd, 0.0f);
      std::fill(dv + t * W, dv + t * W + hd, 0.0f);
    }
    for (int64_t h = g * group; h < (g + 1) * group; ++h) {
      const float* o = out + b * Tn * OW + h * hd;
      const float* dO = dout + b * Tn * OW + h * hd;
      const float* p = probs + (b * n_head + h) * Tn * Tn;
      rows_to_bf16(qkv + b * Tn * W + h * hd, W, Tn, hd, qb);
      rows_to_bf16(dO, OW, Tn, hd, dob);
      for (int64_t i0 = 0; i0 < Tn; i0 += kCausalRows) {
        const int64_t i1 = std::min(Tn, i0 + kCausalRows), rows = i1 - i0;
        gemm_bf16(false, true, rows, i1, hd, 1.0f, dob + i0 * hd, hd, vb, hd, 0.0f, ds + i0 * Tn, Tn);
        softmax_grad_rows(ds, p, dO, o, Tn, OW, hd, i0, i1, scale);
        rows_to_bf16(ds + i0 * Tn, Tn, rows, i1, dsb);
        rows_to_bf16(p + i0 * Tn, Tn, rows, i1, pb);
        gemm_bf16(false, false, rows, hd, i1, 1.0f, dsb, i1, kb, hd, 0.0f, dqkv + (b * Tn + i0) * W + h * hd, W);
        gemm_bf16(true, false, i1, hd, rows, 1.0f, dsb, i1, qb + i0 * hd, hd, 1.0f, dk, W);
        gemm_bf16(true, false, i1, hd, rows, 1.0f, pb, i1, dob + i0 * hd, hd, 1.0f, dv, W);
      }
    }
  }
}

// Query rows per tile of the windowed kernels: a tile of Bq rows needs keys [i0 - W + 1, i0 + Bq),
// Bq + W - 1 of them, so the GEMMs compute (Bq + W - 1) / W times the band; Bq = max(W, 32)
// keeps that under 2x for W >= 32 and the GEMMs large enough to run at speed.
inline int64_t window_tile_rows(int64_t window) { return std::max<int64_t>(window, 32); }

// Sliding-window causal attention (Beltagy et al. 2020, Longformer; Jiang et al. 2023, Mistral 7B),
// window W < T: query i attends to keys j in [max(0, i - W + 1), i]:
//   s_ij = scale q_i . k_j;  P_ij = softmax_j(s_ij) over the window, 0 elsewhere;  o_i = sum_j P_ij v_j.
// Per tile of query rows [i0, i1) and its keys [lo, i1), lo = max(0, i0 - W + 1), the GEMMs write
// into and read from the tile's block of probs in place (its natural columns, leading dim T):
//   S = scale Q_[i0,i1) K_[lo,i1)^T;  band softmax per row;  O_[i0,i1) = P V_[lo,i1).
// Keys outside [lo, i1) are never touched: O(T (W + Bq) hd) per head instead of O(T^2 hd); the
// rest of each probs row is written 0 (a fill, no arithmetic). Measured against a one-row-at-a-
// time kernel (docs/inference.md): the tiles' GEMMs win from W = 16 on, 2-4x at W >= 64.
template <typename T>
void attention_forward_window(const T* qkv, T* out, T* probs, int64_t batch, int64_t seq_len, int64_t n_head,
                              int64_t n_kv_head, int64_t head_dim, int64_t window) {
  const int64_t W = (n_head + 2 * n_kv_head) * head_dim, OW = n_head * head_dim, Tn = seq_len;
  const int64_t group = n_head / n_kv_head, tile = window_tile_rows(window);
  const T scale = T(1) / std::sqrt(static_cast<T>(head_dim));
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t h = 0; h < n_head; ++h) {
      const int64_t g = h / group;
      const T* q = qkv + b * Tn * W + h * head_dim;
      const T* k = qkv + b * Tn * W + (n_head + g) * head_dim;
      const T* v = qkv + b * Tn * W + (n_head + n_kv_head + g) * head_dim;
      T* p = probs + (b * n_head + h) * Tn * Tn;
      for (int64_t i0 = 0; i0 < Tn; i0 += tile) {
        const int64_t i1 = std::min(Tn, i0 + tile), lo = std::max<int64_t>(0, i0 - window + 1), n = i1 - lo;
        gemm_t<T>(false, true, i1 - i0, n, head_dim, scale, q + i0 * W, W, k + lo * W, W, T(0), p + i0 * Tn + lo, Tn);
#pragma omp parallel for schedule(static)
        for (int64_t i = i0; i < i1; ++i) {
          T* row = p + i * Tn;
          const int64_t first = std::max<int64_t>(0, i - window + 1);
          const T max_s = max_of(row + first, i - first + 1);
          T sum = 0;
#pragma omp simd reduction(+ : sum)
          for (int64_t j = first; j <= i; ++j) {
            row[j] = exp_t<T>(row[j] - max_s);
            sum += row[j];
          }
          const T inv = T(1) / sum;
#pragma omp simd
          for (int64_t j = first; j <= i; ++j) row[j] *= inv;
          std::fill(row, row + first, T(0));
          std::fill(row + i + 1, row + Tn, T(0));
        }
        gemm_t<T>(false, false, i1 - i0, head_dim, n, T(1), p + i0 * Tn + lo, Tn, v + lo * W, W, T(0),
                  out + (b * Tn + i0) * OW + h * head_dim, OW);
      }
    }
  }
}

// Backward of attention_forward_window, per (batch, kv head, query head, tile), with the saved P:
//   dP = dO_[i0,i1) V_[lo,i1)^T;  dS = scale P o (dP - D) on the band, 0 elsewhere (scratch,
//   Bq x (Bq + W - 1));  dQ_[i0,i1) = dS K_[lo,i1);  dK_[lo,i1) += dS^T Q_[i0,i1);
//   dV_[lo,i1) += P^T dO_[i0,i1). Tiles overlap on keys, so dK and dV are zeroed once per kv head
// and every tile accumulates, in a fixed order.
template <typename T>
void attention_backward_window(const T* dout, const T* qkv, const T* out, const T* probs, T* dqkv, T* scratch,
                               int64_t batch, int64_t seq_len, int64_t n_head, int64_t n_kv_head, int64_t head_dim,
                               int64_t window) {
  const int64_t W = (n_head + 2 * n_kv_head) * head_dim, OW = n_head * head_dim, Tn = seq_len;
  const int64_t group = n_head / n_kv_head, tile = window_tile_rows(window);
  const T scale = T(1) / std::sqrt(static_cast<T>(head_dim));
  T* ds = scratch;
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t g = 0; g < n_kv_head; ++g) {
      const T* k = qkv + b * Tn * W + (n_head + g) * head_dim;
      const T* v = qkv + b * Tn * W + (n_head + n_kv_head + g) * head_dim;
      T* dk = dqkv + b * Tn * W + (n_head + g) * head_dim;
      T* dv = dqkv + b * Tn * W + (n_head + n_kv_head + g) * head_dim;
#pragma omp parallel for schedule(static)
      for (int64_t t = 0; t < Tn; ++t) {
        std::fill(dk + t * W, dk + t * W + head_dim, T(0));
        std::fill(dv + t * W, dv + t * W + head_dim, T(0));
      }
      for (int64_t h = g * group; h < (g + 1) * group; ++h) {
        const T* q = qkv + b * Tn * W + h * head_dim;
        const T* o = out + b * Tn * OW + h * head_dim;
        const T* dO = dout + b * Tn * OW + h * head_dim;
        const T* p = probs + (b * n_head + h) * Tn * Tn;
        for (int64_t i0 = 0; i0 < Tn; i0 += tile) {
          const int64_t i1 = std::min(Tn, i0 + tile), lo = std::max<int64_t>(0, i0 - window + 1), n = i1 - lo;
          gemm_t<T>(false, true, i1 - i0, n, head_dim, T(1), dO + i0 * OW, OW, v + lo * W, W, T(0), ds, n);
#pragma omp parallel for schedule(static)
          for (int64_t i = i0; i < i1; ++i) {
            T D = 0;
#pragma omp simd reduction(+ : D)
            for (int64_t d = 0; d < head_dim; ++d) D += dO[i * OW + d] * o[i * OW + d];
            T* row = ds + (i - i0) * n;
            const T* prow = p + i * Tn + lo;  // zero outside the band: so is dS
#pragma omp simd
            for (int64_t c = 0; c < n; ++c) row[c] = scale * prow[c] * (row[c] - D);
          }
          gemm_t<T>(false, false, i1 - i0, head_dim, n, T(1), ds, n, k + lo * W, W, T(0),
                    dqkv + (b * Tn + i0) * W + h * head_dim, W);
          gemm_t<T>(true, false, n, head_dim, i1 - i0, T(1), ds, n, q + i0 * W, W, T(1), dk + lo * W, W);
          gemm_t<T>(true, false, n, head_dim, i1 - i0, T(1), p + i0 * Tn + lo, Tn, dO + i0 * OW, OW, T(1),
                    dv + lo * W, W);
        }
      }
    }
  }
}

// One row of the loss: lse = max + log sum exp(x - max), loss = lse - x_t (0 for a masked row).
template <typename T>
inline void cross_entropy_row_loss(const T* x, int32_t t, int64_t vocab, T* lse, T* loss) {
  const T max_x = max_of(x, vocab);
  T sum = 0;
#pragma omp simd reduction(+ : sum)
  for (int64_t v = 0; v < vocab; ++v) sum += exp_t<T>(x[v] - max_x);
  *lse = max_x + std::log(sum);
  *loss = t == kIgnoreTarget ? T(0) : *lse - x[t];
}

// One row of its gradient: d_v = dloss (exp(x_v - lse) - [v == t]), 0 for a masked row. d may be x.
template <typename T>
inline void cross_entropy_row_grad(const T* x, int32_t t, T lse, T dloss, T* d, int64_t vocab) {
  if (t == kIgnoreTarget) {  // a masked position: no gradient
    std::fill(d, d + vocab, T(0));
    return;
  }
#pragma omp simd
  for (int64_t v = 0; v < vocab; ++v) d[v] = dloss * exp_t<T>(x[v] - lse);
  d[t] -= dloss;
}

template <typename T>
void cross_entropy_forward(const T* logits, const int32_t* targets, T* losses, T* lse, int64_t rows,
                           int64_t vocab) {
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) cross_entropy_row_loss(logits + r * vocab, targets[r], vocab, lse + r, losses + r);
}

// dx[n, v] = dloss * (exp(x[n,v] - lse_n) - [v == t_n]). In place when dx == logits.
template <typename T>
void cross_entropy_backward(const T* logits, const int32_t* targets, const T* lse, T dloss, T* dx, int64_t rows,
                            int64_t vocab) {
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    cross_entropy_row_grad(logits + r * vocab, targets[r], lse[r], dloss, dx + r * vocab, vocab);
  }
}

// cross_entropy_forward then cross_entropy_backward of each row while it is in cache (the row,
// V floats, is read from memory once instead of twice): the same row functions, so losses, lse
// and the gradient are bitwise theirs. With D = T the gradient replaces the row in place; with a
// bf16 dx (Backend::cross_entropy_loss_and_grad) it goes through a per-thread fp32 row (in cache)
// and is rounded into dx as cast() rounds, the logits left as they are.
template <typename T, typename D>
void cross_entropy_loss_and_grad(T* logits, const int32_t* targets, T* losses, T* lse, T dloss, D* dx, int64_t rows,
                                 int64_t vocab) {
  constexpr bool kInPlace = std::is_same_v<T, D>;
  std::vector<T> scratch(kInPlace ? 0 : static_cast<size_t>(omp_get_max_threads() * vocab));
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    T* x = logits + r * vocab;
    cross_entropy_row_loss(x, targets[r], vocab, lse + r, losses + r);
    T* g = kInPlace ? x : scratch.data() + static_cast<int64_t>(omp_get_thread_num()) * vocab;
    cross_entropy_row_grad(x, targets[r], lse[r], dloss, g, vocab);
    if constexpr (!kInPlace) {
      static_assert(sizeof(D) == sizeof(uint16_t), "dx: bf16");
      round_to_bf16_bits(g, reinterpret_cast<uint16_t*>(dx + r * vocab), vocab);
    }
  }
}

// The same on logits kept by columns (vocab, rows): each column gathered into a per-thread row,
// the same row functions (so every value is bitwise the row op's on the transposed logits), the
// gradient scattered back in place or rounded to bf16 bits as cast() rounds.
template <typename T, typename D>
void cross_entropy_loss_and_grad_columns(T* logits, const int32_t* targets, T* losses, T* lse, T dloss, D* dx,
                                         int64_t rows, int64_t vocab) {
  std::vector<T> scratch(static_cast<size_t>(omp_get_max_threads() * vocab));
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    T* x = scratch.data() + static_cast<int64_t>(omp_get_thread_num()) * vocab;
    for (int64_t v = 0; v < vocab; ++v) x[v] = logits[v * rows + r];
    cross_entropy_row_loss(x, targets[r], vocab, lse + r, losses + r);
    cross_entropy_row_grad(x, targets[r], lse[r], dloss, x, vocab);
    for (int64_t v = 0; v < vocab; ++v) {
      if constexpr (std::is_same_v<T, D>) dx[v * rows + r] = x[v];
      else round_to_bf16_bits(x + v, reinterpret_cast<uint16_t*>(dx + v * rows + r), 1);
    }
  }
}

// The same on bf16 logits (a bf16 head's output), by rows (N, V) or by columns (V, N): each row
// widened exactly into a per-thread fp32 row, the same row functions, the gradient rounded back in
// place as cast() rounds: bitwise the f32 op on the widened logits with a bf16 dx.
inline void cross_entropy_loss_and_grad_bf16(uint16_t* logits, const int32_t* targets, float* losses, float* lse,
                                             float dloss, int64_t rows, int64_t vocab, bool by_columns) {
  std::vector<float> scratch(static_cast<size_t>(omp_get_max_threads() * vocab));
  const int64_t row_step = by_columns ? 1 : vocab, v_step = by_columns ? rows : 1;
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    float* x = scratch.data() + static_cast<int64_t>(omp_get_thread_num()) * vocab;
    uint16_t* row = logits + r * row_step;
    if (by_columns) {
      for (int64_t v = 0; v < vocab; ++v) x[v] = bf16_to_f32(bf16{row[v * v_step]});
    } else {
#pragma omp simd
      for (int64_t v = 0; v < vocab; ++v) x[v] = bf16_to_f32(bf16{row[v]});
    }
    cross_entropy_row_loss(x, targets[r], vocab, lse + r, losses + r);
    cross_entropy_row_grad(x, targets[r], lse[r], dloss, x, vocab);
    if (!by_columns) {
      round_to_bf16_bits(x, row, vocab);
      continue;
    }
    for (int64_t v = 0; v < vocab; ++v) round_to_bf16_bits(x + v, row + v * v_step, 1);
  }
}

// AdamW with g = grad_scale * grad; bias1 = 1 - beta1^t, bias2 = 1 - beta2^t. One pass over
// p, g, m, v (memory-bound: 28 bytes per fp32 parameter).
template <typename T>
void adamw_step(T* p, const T* grad, T* m, T* v, int64_t n, T lr, T beta1, T beta2, T eps, T weight_decay,
                T grad_scale, T bias1, T bias2) {
  const T decay = T(1) - lr * weight_decay;
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const T g = grad[i] * grad_scale;
    m[i] = beta1 * m[i] + (T(1) - beta1) * g;
    v[i] = beta2 * v[i] + (T(1) - beta2) * g * g;
    const T mhat = m[i] / bias1;
    const T vhat = v[i] / bias2;
    p[i] = p[i] * decay - lr * mhat / (std::sqrt(vhat) + eps);
  }
}

}  // namespace loom::cpu
