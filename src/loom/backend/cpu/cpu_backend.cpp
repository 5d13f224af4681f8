// CPU implementation of the op interface: validates shapes and dtypes, then dispatches to the
// templated kernels of cpu_kernels.h (f32 for training, f64 for reference checks) and to oneDNN
// for f32 GEMMs. One OpenMP thread pool serves our kernels and oneDNN alike. The class is
// cpu_backend_internal.h's; its attention ops are cpu_backend_attention.cpp's.
#include <cmath>
#include <cstring>
#include <vector>

#include "loom/backend/backend.h"
#include "loom/backend/checks.h"
#include "loom/backend/cpu/cpu_backend_internal.h"
#include "loom/backend/cpu/cpu_gemm.h"
#include "loom/backend/cpu/cpu_kernels.h"
#include "loom/backend/parallel_checks.h"
#include "loom/core/error.h"

namespace loom {
namespace cpu_backend_detail {

void CpuBackend::gemm(const Tensor& a, const Tensor& b, const Tensor& c, const GemmSpec& spec, const Tensor* bias) {
  const checks::GemmDims d = checks::check_gemm(a, b, c, spec, bias);
  if (spec.c_in) {  // C read from c_in: a copy, then the GEMM on C
    if (spec.beta != 0.0f) copy(*spec.c_in, c);
    GemmSpec on_c = spec;
    on_c.c_in = nullptr;
    gemm(a, b, c, on_c, bias);
    return;
  }
  const bool bf16_in = a.dtype() == DTYPE_BF16;
  const int64_t batch = spec.batch, m = d.m, n = d.n, k = d.k;
  const int64_t a_rows = d.a_rows, a_cols = d.a_cols, b_rows = d.b_rows, b_cols = d.b_cols;
  if (bf16_in && c.dtype() == DTYPE_BF16) {
    gemm_bf16_out(a, b, c, spec, d, bias);
    return;
  }
  if (bf16_in) {
    const uint16_t* pa = static_cast<const uint16_t*>(a.raw_data());
    const uint16_t* pb = static_cast<const uint16_t*>(b.raw_data());
    float* pc = c.data<float>();
    for (int64_t i = 0; i < batch; ++i) {
      cpu::gemm_bf16(spec.trans_a, spec.trans_b, m, n, k, spec.alpha, pa + i * a_rows * a_cols, a_cols,
                     pb + i * b_rows * b_cols, b_cols, spec.beta, pc + i * m * n, n);
    }
    if (bias) add_bias_rows(pc, bias->data<float>(), batch * m, n);
    return;
  }
  dispatch_float(a.dtype(), "gemm", kBackend, [&]<typename T>() {
    const T* pa = a.data<T>();
    const T* pb = b.data<T>();
    T* pc = c.data<T>();
    for (int64_t i = 0; i < batch; ++i) {
      const T* ai = pa + i * a_rows * a_cols;
      const T* bi = pb + i * b_rows * b_cols;
      T* ci = pc + i * m * n;
      if constexpr (sizeof(T) == 4) {
        cpu::gemm_f32(spec.trans_a, spec.trans_b, m, n, k, spec.alpha, ai, a_cols, bi, b_cols, spec.beta, ci, n);
      } else {
        cpu::gemm_f64(spec.trans_a, spec.trans_b, m, n, k, spec.alpha, ai, a_cols, bi, b_cols, spec.beta, ci, n);
      }
    }
    if (bias) add_bias_rows(pc, bias->data<T>(), batch * m, n);
  });
}

namespace {
// n floats rounded to bf16 bits, in parallel blocks (as cast() rounds).
void round_rows(const float* x, uint16_t* out, int64_t n) {
  constexpr int64_t kBlock = 1 << 16;
#pragma omp parallel for schedule(static) if (n > kBlock)
  for (int64_t b = 0; b < n; b += kBlock) cpu::round_to_bf16_bits(x + b, out + b, std::min(kBlock, n - b));
}
}  // namespace

// A bf16 C: panels multiplied into an fp32 buffer (at most kPanelFloats, kept between calls), the
// bias rounded to bf16 added in fp32, each element rounded as cast() rounds. The panels cut the
// longer of C's two sides, so the GEMMs keep the other whole (a head's (B T, V) logits: column
// panels, the weight read once).
void CpuBackend::gemm_bf16_out(const Tensor& a, const Tensor& b, const Tensor& c, const GemmSpec& spec,
                               const checks::GemmDims& d, const Tensor* bias) {
  constexpr int64_t kPanelFloats = int64_t{1} << 22;  // 16 MB
  const int64_t m = d.m, n = d.n, k = d.k;
  const auto* pa = static_cast<const uint16_t*>(a.raw_data());
  const auto* pb = static_cast<const uint16_t*>(b.raw_data());
  auto* pc = static_cast<uint16_t*>(c.raw_data());
  std::vector<float> bias16;
  if (bias) {
    std::vector<uint16_t> bits(static_cast<size_t>(n));
    cpu::round_to_bf16_bits(bias->data<float>(), bits.data(), n);
    bias16.resize(static_cast<size_t>(n));
    for (int64_t j = 0; j < n; ++j) bias16[j] = bf16_to_f32(bf16{bits[j]});
  }
  const bool by_rows = m >= n;
  const int64_t whole = by_rows ? n : m, cut = by_rows ? m : n;
  const int64_t panel = std::clamp<int64_t>(kPanelFloats / std::max<int64_t>(whole, 1), 1, std::max<int64_t>(cut, 1));
  if (gemm_out_floats_ < panel * whole) {  // not zeroed: the GEMM overwrites it
    gemm_out_.reset(new float[static_cast<size_t>(panel * whole)]);
    gemm_out_floats_ = panel * whole;
  }
  float* acc = gemm_out_.get();
  for (int64_t i = 0; i < spec.batch; ++i) {
    const uint16_t* ai = pa + i * d.a_rows * d.a_cols;
    const uint16_t* bi = pb + i * d.b_rows * d.b_cols;
    uint16_t* ci = pc + i * m * n;
    for (int64_t first = 0; first < cut; first += panel) {
      const int64_t count = std::min(panel, cut - first);
      if (by_rows) {  // op(A)'s rows [first, first + count): a row panel of A (m, k), a column block of A stored (k, m)
        const uint16_t* a_panel = spec.trans_a ? ai + first : ai + first * d.a_cols;
        cpu::gemm_bf16(spec.trans_a, spec.trans_b, count, n, k, spec.alpha, a_panel, d.a_cols, bi, d.b_cols, 0.0f,
                       acc, n);
        if (bias) add_bias_rows(acc, bias16.data(), count, n);
        round_rows(acc, ci + first * n, count * n);
        continue;
      }
      // op(B)'s columns [first, first + count): a row panel of B stored (n, k), a column block of B (k, n)
      const uint16_t* b_panel = spec.trans_b ? bi + first * d.b_cols : bi + first;
      cpu::gemm_bf16(spec.trans_a, spec.trans_b, m, count, k, spec.alpha, ai, d.a_cols, b_panel, d.b_cols, 0.0f, acc,
                     count);
      if (bias) add_bias_rows(acc, bias16.data() + first, m, count);
#pragma omp parallel for schedule(static) if (m * count > (int64_t{1} << 16))
      for (int64_t r = 0; r < m; ++r) cpu::round_to_bf16_bits(acc + r * count, ci + r * n + first, count);
    }
  }
}

void CpuBackend::fill(const Tensor& x, double value) {
  dispatch_float(x.dtype(), "fill", kBackend, [&]<typename T>() {
    T* p = x.data<T>();
    const int64_t n = x.numel();
#pragma omp parallel for simd schedule(dynamic, cpu::kStreamChunk) if (n > cpu::kStreamChunk)
    for (int64_t i = 0; i < n; ++i) p[i] = static_cast<T>(value);
  });
}

void CpuBackend::copy(const Tensor& src, const Tensor& dst) {
  expect_dtype(dst, src.dtype(), "copy", "dst");
  expect_numel(dst, src.numel(), "copy", "dst");
  std::memcpy(dst.raw_data(), src.raw_data(), src.nbytes());
}

void CpuBackend::cast(const Tensor& src, const Tensor& dst) {
  expect_numel(dst, src.numel(), "cast", "dst");
  const int64_t n = src.numel();
  if (src.dtype() == dst.dtype()) return copy(src, dst);
  if (src.dtype() == DTYPE_F32 && dst.dtype() == DTYPE_BF16) {
    const float* s = src.data<float>();
    uint16_t* d = reinterpret_cast<uint16_t*>(dst.data<bf16>());
    constexpr int64_t kBlock = 4096;  // (f32_to_bf16's rounding, vectorized: cpu_math.h)
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < n; b += kBlock) cpu::round_to_bf16_bits(s + b, d + b, std::min(kBlock, n - b));
  } else if (src.dtype() == DTYPE_BF16 && dst.dtype() == DTYPE_F32) {
    const bf16* s = src.data<bf16>();
    float* d = dst.data<float>();
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) d[i] = bf16_to_f32(s[i]);
  } else if (src.dtype() == DTYPE_F32 && dst.dtype() == DTYPE_F64) {
    const float* s = src.data<float>();
    double* d = dst.data<double>();
    for (int64_t i = 0; i < n; ++i) d[i] = s[i];
  } else if (src.dtype() == DTYPE_F64 && dst.dtype() == DTYPE_F32) {
    const double* s = src.data<double>();
    float* d = dst.data<float>();
    for (int64_t i = 0; i < n; ++i) d[i] = static_cast<float>(s[i]);
  } else {
    throw Error(str_cat("cast: not supported from ", dtype_name(src.dtype()), " to ", dtype_name(dst.dtype())));
  }
}

void CpuBackend::add(const Tensor& a, const Tensor& b, const Tensor& out) {
  expect_dtype(b, a.dtype(), "add", "b");
  expect_dtype(out, a.dtype(), "add", "out");
  expect_numel(b, a.numel(), "add", "b");
  expect_numel(out, a.numel(), "add", "out");
  dispatch_float(a.dtype(), "add", kBackend, [&]<typename T>() {
    const T* pa = a.data<T>();
    const T* pb = b.data<T>();
    T* po = out.data<T>();
    const int64_t n = a.numel();
#pragma omp parallel for simd schedule(static)
    for (int64_t i = 0; i < n; ++i) po[i] = pa[i] + pb[i];
  });
}

void CpuBackend::add_inplace(const Tensor& acc, const Tensor& x) { add(acc, x, acc); }

void CpuBackend::scale_inplace(const Tensor& x, double factor) {
  dispatch_float(x.dtype(), "scale_inplace", kBackend, [&]<typename T>() {
    T* p = x.data<T>();
    const T f = static_cast<T>(factor);
    const int64_t n = x.numel();
#pragma omp parallel for simd schedule(static)
    for (int64_t i = 0; i < n; ++i) p[i] *= f;
  });
}

double CpuBackend::sum_squares(const Tensor& x) {
  return reduce_fixed_order(x, "sum_squares", [](double v) { return v * v; });
}

double CpuBackend::sum(const Tensor& x) {
  return reduce_fixed_order(x, "sum", [](double v) { return v; });
}

void CpuBackend::bias_backward(const Tensor& dout, const Tensor& dbias) {
  if (checks::check_bias_backward(dout, dbias)) {  // a bf16 dout, widened, into an f32 dbias
    cpu::column_sums_accumulate(bf16_bits(dout), rows_of(dout), dout.dim(-1), dbias.data<float>());
    return;
  }
  dispatch_float(dout.dtype(), "bias_backward", kBackend, [&]<typename T>() {
    cpu::column_sums_accumulate(dout.data<T>(), rows_of(dout), dout.dim(-1), dbias.data<T>());
  });
}

void CpuBackend::embedding_forward(const Tensor& tokens, const Tensor& table, const Tensor* positions,
                                   const Tensor& out) {
  const char* op = "embedding_forward";
  const auto [n_tokens, seq_len, channels] = check_embedding(op, tokens, table, positions, out);
  check_token_range(op, tokens, table.dim(0));
  if (table.dtype() == DTYPE_BF16) {
    cpu::embedding_forward(tokens.data<int32_t>(), table.data<bf16>(), positions ? positions->data<float>() : nullptr,
                           out.data<float>(), n_tokens, seq_len, channels);
    return;
  }
  dispatch_float(table.dtype(), op, kBackend, [&]<typename T>() {
    cpu::embedding_forward(tokens.data<int32_t>(), table.data<T>(), positions ? positions->data<T>() : nullptr,
                           out.data<T>(), n_tokens, seq_len, channels);
  });
}

void CpuBackend::embedding_backward(const Tensor& tokens, const Tensor& dout, const Tensor& dtable,
                                    const Tensor* dpositions) {
  const char* op = "embedding_backward";
  const auto [n_tokens, seq_len, channels] = check_embedding(op, tokens, dtable, dpositions, dout);
  check_token_range(op, tokens, dtable.dim(0));
  dispatch_float(dtable.dtype(), op, kBackend, [&]<typename T>() {
    cpu::embedding_backward(tokens.data<int32_t>(), dout.data<T>(), dtable.data<T>(),
                            dpositions ? dpositions->data<T>() : nullptr, n_tokens, seq_len, channels);
  });
}

void CpuBackend::layernorm_forward(const Tensor& x, const Tensor& weight, const Tensor& bias, const Tensor& out,
                                   const Tensor& mean, const Tensor& rstd, float eps) {
  const char* op = "layernorm_forward";
  const int64_t rows = rows_of(x), channels = x.dim(-1);
  check_row_op(op, x, {}, {&weight, &bias}, {&mean, &rstd});
  if (check_output(op, x, out, x.numel())) {
    cpu::layernorm_forward(x.data<float>(), weight.data<float>(), bias.data<float>(), bf16_bits(out),
                           mean.data<float>(), rstd.data<float>(), rows, channels, eps);
    return;
  }
  dispatch_float(x.dtype(), op, kBackend, [&]<typename T>() {
    cpu::layernorm_forward(x.data<T>(), weight.data<T>(), bias.data<T>(), out.data<T>(), mean.data<T>(),
                           rstd.data<T>(), rows, channels, static_cast<T>(eps));
  });
}

void CpuBackend::layernorm_backward(const Tensor& dout, const Tensor& x, const Tensor& weight, const Tensor& mean,
                                    const Tensor& rstd, const Tensor& dx, const Tensor& dweight, const Tensor& dbias,
                                    bool accumulate, const Tensor& dx16) {
  const char* op = "layernorm_backward";
  check_row_op(op, x, {&dout, &dx}, {&weight, &dweight, &dbias}, {&mean, &rstd});
  uint16_t* rounded = checks::check_rounded_copy(op, x, dx, dx16) ? bf16_bits(dx16) : nullptr;
  dispatch_float(x.dtype(), op, kBackend, [&]<typename T>() {
    cpu::layernorm_backward(dout.data<T>(), x.data<T>(), weight.data<T>(), mean.data<T>(), rstd.data<T>(),
                            dx.data<T>(), dweight.data<T>(), dbias.data<T>(), rows_of(x), x.dim(-1), accumulate,
                            rounded);
  });
}

void CpuBackend::rmsnorm_forward(const Tensor& x, const Tensor& weight, const Tensor& out, const Tensor& rstd,
                                 float eps) {
  const char* op = "rmsnorm_forward";
  check_row_op(op, x, {}, {&weight}, {&rstd});
  if (check_output(op, x, out, x.numel())) {
    cpu::rmsnorm_forward(x.data<float>(), weight.data<float>(), bf16_bits(out), rstd.data<float>(), rows_of(x),
                         x.dim(-1), eps);
    return;
  }
  dispatch_float(x.dtype(), op, kBackend, [&]<typename T>() {
    cpu::rmsnorm_forward(x.data<T>(), weight.data<T>(), out.data<T>(), rstd.data<T>(), rows_of(x), x.dim(-1),
                         static_cast<T>(eps));
  });
}

void CpuBackend::rmsnorm_backward(const Tensor& dout, const Tensor& x, const Tensor& weight, const Tensor& rstd,
                                  const Tensor& dx, const Tensor& dweight, bool accumulate, const Tensor& dx16) {
  const char* op = "rmsnorm_backward";
  check_row_op(op, x, {&dout, &dx}, {&weight, &dweight}, {&rstd});
  uint16_t* rounded = checks::check_rounded_copy(op, x, dx, dx16) ? bf16_bits(dx16) : nullptr;
  dispatch_float(x.dtype(), op, kBackend, [&]<typename T>() {
    cpu::rmsnorm_backward(dout.data<T>(), x.data<T>(), weight.data<T>(), rstd.data<T>(), dx.data<T>(),
                          dweight.data<T>(), rows_of(x), x.dim(-1), accumulate, rounded);
  });
}

void CpuBackend::head_rmsnorm_forward(const Tensor& x, const Tensor& weight, int64_t first, int64_t n, int64_t hd,
                                      float eps, const Tensor& in, const Tensor& rstd) {
  const char* op = "head_rmsnorm_forward";
  const int64_t rows = checks::check_head_rmsnorm_forward(x, weight, first, n, hd, in, rstd);
  dispatch_float(x.dtype(), op, kBackend, [&]<typename T>() {
    cpu::head_rmsnorm_forward(x.data<T>(), weight.data<T>(), in.data<T>(), rstd.data<T>(), rows, x.dim(-1),
                              first, n, hd, static_cast<T>(eps));
  });
}

void CpuBackend::head_rmsnorm_backward(const Tensor& dx, const Tensor& in, const Tensor& weight, const Tensor& rstd,
                                       int64_t first, int64_t n, int64_t hd, const Tensor& dweight) {
  const char* op = "head_rmsnorm_backward";
  const int64_t rows = checks::check_head_rmsnorm_backward(dx, in, weight, rstd, first, n, hd, dweight);
  dispatch_float(dx.dtype(), op, kBackend, [&]<typename T>() {
    cpu::head_rmsnorm_backward(dx.data<T>(), in.data<T>(), weight.data<T>(), rstd.data<T>(), dweight.data<T>(), rows,
                               dx.dim(-1), first, n, hd);
  });
}

namespace {
// fn(x's elements, out's elements) for an activation whose x or out is bf16 (checks::ActivationIo):
// bf16 bits or floats each.
template <typename Fn>
void with_mixed_io(const Tensor& x, const Tensor& out, checks::ActivationIo io, Fn&& fn) {
  const auto* x16 = static_cast<const uint16_t*>(x.raw_data());
  auto* o16 = static_cast<uint16_t*>(out.raw_data());
  if (io.x_bf16 && io.out_bf16) fn(x16, o16);
  else if (io.x_bf16) fn(x16, out.data<float>());
  else fn(static_cast<const float*>(x.data<float>()), o16);
}
}  // namespace

void CpuBackend::gelu_forward(const Tensor& x, const Tensor& out) {
  const checks::ActivationIo io = checks::check_activation("gelu_forward", x, out, x.numel());
  if (io.mixed()) {
    with_mixed_io(x, out, io, [&](const auto* xs, auto* o) { cpu::gelu_forward<float>(xs, o, x.numel()); });
    return;
  }
  dispatch_float(x.dtype(), "gelu_forward", kBackend,
                 [&]<typename T>() { cpu::gelu_forward<T>(x.data<T>(), out.data<T>(), x.numel()); });
}

void CpuBackend::gelu_backward(const Tensor& x, const Tensor& dout, const Tensor& dx) {
  const checks::ActivationIo io = checks::check_activation("gelu_backward", x, dx, x.numel(), &dout, x.numel());
  if (io.mixed()) {
    with_mixed_io(x, dx, io, [&](const auto* xs, auto* d) {
      cpu::gelu_backward<float>(xs, dout.data<float>(), d, x.numel());
    });
    return;
  }
  dispatch_float(x.dtype(), "gelu_backward", kBackend, [&]<typename T>() {
    cpu::gelu_backward<T>(x.data<T>(), dout.data<T>(), dx.data<T>(), x.numel());
  });
}

void CpuBackend::glu_forward(const Tensor& x, const Tensor& out, GateActivation act) {
  const char* op = "glu_forward";
  checks::check_glu_shapes(op, x, out);
  const checks::ActivationIo io = checks::check_activation(op, x, out, out.numel());
  // The activation as a template argument (its branch out of the loop), into out's dtype.
  const auto run = [&]<typename T>(const auto* xs, auto* o) {
    const int64_t rows = rows_of(out), hidden = out.dim(-1);
    if (act == GateActivation::silu) cpu::glu_forward<T, GateActivation::silu>(xs, o, rows, hidden);
    else if (act == GateActivation::sigmoid) cpu::glu_forward<T, GateActivation::sigmoid>(xs, o, rows, hidden);
    else if (act == GateActivation::swiglu_oai) cpu::glu_forward<T, GateActivation::swiglu_oai>(xs, o, rows, hidden);
    else cpu::glu_forward<T, GateActivation::gelu_tanh>(xs, o, rows, hidden);
  };
  if (io.mixed()) {
    with_mixed_io(x, out, io, [&](const auto* xs, auto* o) { run.template operator()<float>(xs, o); });
    return;
  }
  dispatch_float(x.dtype(), op, kBackend, [&]<typename T>() { run.template operator()<T>(x.data<T>(), out.data<T>()); });
}

void CpuBackend::glu_backward(const Tensor& x, const Tensor& dout, const Tensor& dx, GateActivation act) {
  const char* op = "glu_backward";
  checks::check_glu_shapes(op, x, dout);
  const checks::ActivationIo io = checks::check_activation(op, x, dx, x.numel(), &dout, x.numel() / 2);
  const auto run = [&]<typename T>(const auto* xs, auto* d) {  // the activation as a template argument
    const int64_t rows = rows_of(dout), hidden = dout.dim(-1);
    const T* g = dout.data<T>();
    if (act == GateActivation::silu) cpu::glu_backward<T, GateActivation::silu>(xs, g, d, rows, hidden);
    else if (act == GateActivation::sigmoid) cpu::glu_backward<T, GateActivation::sigmoid>(xs, g, d, rows, hidden);
    else if (act == GateActivation::swiglu_oai) cpu::glu_backward<T, GateActivation::swiglu_oai>(xs, g, d, rows, hidden);
    else cpu::glu_backward<T, GateActivation::gelu_tanh>(xs, g, d, rows, hidden);
  };
  if (io.mixed()) {
    with_mixed_io(x, dx, io, [&](const auto* xs, auto* d) { run.template operator()<float>(xs, d); });
    return;
  }
  dispatch_float(x.dtype(), op, kBackend, [&]<typename T>() { run.template operator()<T>(x.data<T>(), dx.data<T>()); });
}

void CpuBackend::rope_forward(const Tensor& x, int64_t head_dim, int64_t n_heads, const RopeSpec& rope_spec,
                              int64_t pos_offset) {
  rope(x, head_dim, n_heads, rope_spec, pos_offset, 1.0, "rope_forward");
}

void CpuBackend::rope_backward(const Tensor& dx, int64_t head_dim, int64_t n_heads, const RopeSpec& rope_spec,
                               int64_t pos_offset) {
  rope(dx, head_dim, n_heads, rope_spec, pos_offset, -1.0, "rope_backward");
}

void CpuBackend::cross_entropy_forward(const Tensor& logits, const Tensor& targets, const Tensor& losses,
                                       const Tensor& lse) {
  const char* op = "cross_entropy_forward";
  check_cross_entropy(op, logits, targets, lse);
  check_target_range(op, logits.dim(-1), targets);
  expect_dtype(losses, logits.dtype(), op, "losses");
  expect_numel(losses, rows_of(logits), op, "losses");
  dispatch_float(logits.dtype(), op, kBackend, [&]<typename T>() {
    cpu::cross_entropy_forward(logits.data<T>(), targets.data<int32_t>(), losses.data<T>(), lse.data<T>(),
                               rows_of(logits), logits.dim(-1));
  });
}

void CpuBackend::cross_entropy_backward(const Tensor& logits, const Tensor& targets, const Tensor& lse, float dloss,
                                        const Tensor& dlogits) {
  const char* op = "cross_entropy_backward";
  check_cross_entropy(op, logits, targets, lse);
  check_target_range(op, logits.dim(-1), targets);
  check_elementwise(op, logits, {&dlogits});
  dispatch_float(logits.dtype(), op, kBackend, [&]<typename T>() {
    cpu::cross_entropy_backward(logits.data<T>(), targets.data<int32_t>(), lse.data<T>(), static_cast<T>(dloss),
                                dlogits.data<T>(), rows_of(logits), logits.dim(-1));
  });
}

void CpuBackend::cross_entropy_loss_and_grad(const Tensor& logits, const Tensor& targets, const Tensor& losses,
                                             const Tensor& lse, float dloss, const Tensor& dlogits) {
  loss_and_grad("cross_entropy_loss_and_grad", false, logits, targets, losses, lse, dloss, dlogits);
}

void CpuBackend::cross_entropy_loss_and_grad_columns(const Tensor& logits, const Tensor& targets, const Tensor& losses,
                                                     const Tensor& lse, float dloss, const Tensor& dlogits) {
  loss_and_grad("cross_entropy_loss_and_grad_columns", true, logits, targets, losses, lse, dloss, dlogits);
}

void CpuBackend::loss_and_grad(const char* op, bool by_columns, const Tensor& logits, const Tensor& targets,
                               const Tensor& losses, const Tensor& lse, float dloss, const Tensor& dlogits) {
  const checks::LossGradOut out = check_loss_and_grad(op, logits, targets, losses, lse, dlogits, by_columns);
  const int64_t rows = targets.numel(), vocab = by_columns ? logits.dim(0) : logits.dim(-1);
  check_target_range(op, vocab, targets);
  if (out == checks::LossGradOut::bf16_in_place) {
    cpu::cross_entropy_loss_and_grad_bf16(static_cast<uint16_t*>(logits.raw_data()), targets.data<int32_t>(),
                                          losses.data<float>(), lse.data<float>(), dloss, rows, vocab, by_columns);
    return;
  }
  const bool to_bf16 = out == checks::LossGradOut::to_bf16;
  const auto run = [&]<typename T, typename D>(D* d) {
    (by_columns ? cpu::cross_entropy_loss_and_grad_columns<T, D> : cpu::cross_entropy_loss_and_grad<T, D>)(
        logits.data<T>(), targets.data<int32_t>(), losses.data<T>(), lse.data<T>(), static_cast<T>(dloss), d, rows,
        vocab);
  };
  if (to_bf16) run.template operator()<float>(dlogits.data<bf16>());
  else dispatch_float(logits.dtype(), op, kBackend, [&]<typename T>() { run.template operator()<T>(logits.data<T>()); });
}

void CpuBackend::adamw_step(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v,
                            const AdamWHyper& h) {
  const char* op = "adamw_step";
  check_elementwise(op, param, {&grad, &m, &v});
  LOOM_CHECK(h.step >= 1, op, ": step must be >= 1 (bias correction), got ", h.step);
  const double bias1 = 1.0 - std::pow(static_cast<double>(h.beta1), static_cast<double>(h.step));
  const double bias2 = 1.0 - std::pow(static_cast<double>(h.beta2), static_cast<double>(h.step));
  dispatch_float(param.dtype(), op, kBackend, [&]<typename T>() {
    cpu::adamw_step<T>(param.data<T>(), grad.data<T>(), m.data<T>(), v.data<T>(), param.numel(), h.lr, h.beta1,
                       h.beta2, h.eps, h.weight_decay, h.grad_scale, static_cast<T>(bias1),
                       static_cast<T>(bias2));
  });
}

template <typename T>
void CpuBackend::add_bias_rows(T* c, const T* bias, int64_t rows, int64_t cols) {
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    T* row = c + r * cols;
#pragma omp simd
    for (int64_t j = 0; j < cols; ++j) row[j] += bias[j];
  }
}

// Sum of f(x_i) in double over fixed chunks summed in order: bitwise identical for any thread count.
template <typename F>
double CpuBackend::reduce_fixed_order(const Tensor& x, const char* op, F f) {
  constexpr int64_t kChunks = 64;
  double partial[kChunks] = {};
  const int64_t n = x.numel();
  const int64_t chunk = (n + kChunks - 1) / kChunks;
  dispatch_float(x.dtype(), op, kBackend, [&]<typename T>() {
    const T* p = x.data<T>();
#pragma omp parallel for schedule(dynamic, 1) if (n > cpu::kStreamChunk)
    for (int64_t c = 0; c < kChunks; ++c) {
      double acc = 0;
      const int64_t end = std::min(n, (c + 1) * chunk);
#pragma omp simd reduction(+ : acc)
      for (int64_t i = c * chunk; i < end; ++i) acc += f(static_cast<double>(p[i]));
      partial[c] = acc;
    }
  });
  double total = 0;
  for (double v : partial) total += v;
  return total;
}

void CpuBackend::check_token_range(const char* op, const Tensor& tokens, int64_t vocab) {
  const int32_t* t = tokens.data<int32_t>();
  for (int64_t i = 0; i < tokens.numel(); ++i) {
    LOOM_CHECK(t[i] >= 0 && t[i] < vocab, op, ": token id ", t[i], " at position ", i, " outside vocab [0, ", vocab,
               ")");
  }
}

void CpuBackend::rope(const Tensor& x, int64_t head_dim, int64_t n_heads, const RopeSpec& rope_spec,
                      int64_t pos_offset, double direction, const char* op) {
  checks::check_rope(op, x, head_dim, n_heads);
  dispatch_float(x.dtype(), op, kBackend, [&]<typename T>() {
    cpu::rope_rotate(x.data<T>(), x.dim(0), x.dim(1), x.dim(2), head_dim, n_heads,
                     rope_span(rope_spec, pos_offset + x.dim(1)), pos_offset, direction);
  });
}

void CpuBackend::check_target_range(const char* op, int64_t vocab, const Tensor& targets) {
  const int32_t* t = targets.data<int32_t>();
  for (int64_t i = 0; i < targets.numel(); ++i) {
    LOOM_CHECK((t[i] >= 0 && t[i] < vocab) || t[i] == kIgnoreTarget, op, ": target ", t[i], " at row ", i,
               " outside vocab [0, ", vocab, ") and not kIgnoreTarget (", kIgnoreTarget, ")");
  }
}

}  // namespace cpu_backend_detail

std::unique_ptr<Backend> make_cpu_backend() { return std::make_unique<cpu_backend_detail::CpuBackend>(); }

}  // namespace loom
