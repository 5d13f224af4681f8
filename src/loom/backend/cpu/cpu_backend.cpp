// CPU implementation of the op interface: validates shapes and dtypes, then dispatches to the
// templated kernels of cpu_kernels.h (f32 for training, f64 for reference checks) and to oneDNN
// for f32 GEMMs. One OpenMP thread pool serves our kernels and oneDNN alike.
#include <cmath>
#include <cstring>

#include "loom/backend/backend.h"
#include "loom/backend/cpu/cpu_gemm.h"
#include "loom/backend/cpu/cpu_kernels.h"
#include "loom/core/error.h"

namespace loom {
namespace {

// Calls fn.template operator()<T>() with T = float or double according to dtype.
template <typename Fn>
void dispatch_float(DType dtype, const char* op, Fn&& fn) {
  if (dtype == DTYPE_F32) fn.template operator()<float>();
  else if (dtype == DTYPE_F64) fn.template operator()<double>();
  else throw Error(str_cat(op, ": not supported for dtype ", dtype_name(dtype), " on the CPU backend (f32, f64)"));
}

void expect_dtype(const Tensor& t, DType dtype, const char* op, const char* what) {
  LOOM_CHECK(t.defined(), op, ": ", what, " is undefined");
  LOOM_CHECK(t.dtype() == dtype, op, ": ", what, " is ", t.describe(), ", expected dtype ", dtype_name(dtype));
}

void expect_numel(const Tensor& t, int64_t numel, const char* op, const char* what) {
  LOOM_CHECK(t.numel() == numel, op, ": ", what, " is ", t.describe(), ", expected ", numel, " elements");
}

// Rows of a tensor viewed as (rows, last dim).
int64_t rows_of(const Tensor& t) { return t.ndim() == 0 || t.dim(-1) == 0 ? 0 : t.numel() / t.dim(-1); }

class CpuBackend final : public Backend {
 public:
  std::string_view name() const override { return "cpu"; }
  Allocator& allocator() override { return allocator_; }

  void gemm(const Tensor& a, const Tensor& b, const Tensor& c, const GemmSpec& spec, const Tensor* bias) override {
    const char* op = "gemm";
    const bool bf16_in = a.dtype() == DTYPE_BF16;  // bf16 A and B, fp32 C (and bias)
    expect_dtype(b, a.dtype(), op, "B");
    expect_dtype(c, bf16_in ? DTYPE_F32 : a.dtype(), op, "C");
    const int64_t batch = spec.batch;
    LOOM_CHECK(batch >= 1 && a.numel() % batch == 0 && b.numel() % batch == 0 && c.numel() % batch == 0, op,
               ": batch ", batch, " does not divide A ", a.describe(), ", B ", b.describe(), ", C ", c.describe());
    const int64_t a_cols = a.dim(-1), b_cols = b.dim(-1), n = c.dim(-1);
    const int64_t a_rows = a.numel() / batch / a_cols, b_rows = b.numel() / batch / b_cols;
    const int64_t m = c.numel() / batch / n;
    const int64_t op_a_rows = spec.trans_a ? a_cols : a_rows, k = spec.trans_a ? a_rows : a_cols;
    const int64_t op_b_rows = spec.trans_b ? b_cols : b_rows, op_b_cols = spec.trans_b ? b_rows : b_cols;
    LOOM_CHECK(op_a_rows == m && op_b_rows == k && op_b_cols == n, op, ": shapes do not chain: op(A) (", op_a_rows,
               ", ", k, ") @ op(B) (", op_b_rows, ", ", op_b_cols, ") -> C (", m, ", ", n, "); A ", a.describe(),
               " B ", b.describe(), " C ", c.describe());
    if (bias) {
      expect_dtype(*bias, c.dtype(), op, "bias");
      expect_numel(*bias, n, op, "bias");
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
    dispatch_float(a.dtype(), op, [&]<typename T>() {
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

  void fill(const Tensor& x, double value) override {
    dispatch_float(x.dtype(), "fill", [&]<typename T>() {
      T* p = x.data<T>();
      const int64_t n = x.numel();
#pragma omp parallel for simd schedule(static)
      for (int64_t i = 0; i < n; ++i) p[i] = static_cast<T>(value);
    });
  }

  void copy(const Tensor& src, const Tensor& dst) override {
    expect_dtype(dst, src.dtype(), "copy", "dst");
    expect_numel(dst, src.numel(), "copy", "dst");
    std::memcpy(dst.raw_data(), src.raw_data(), src.nbytes());
  }

  void cast(const Tensor& src, const Tensor& dst) override {
    expect_numel(dst, src.numel(), "cast", "dst");
    const int64_t n = src.numel();
    if (src.dtype() == dst.dtype()) return copy(src, dst);
    if (src.dtype() == DTYPE_F32 && dst.dtype() == DTYPE_BF16) {
      const float* s = src.data<float>();
      bf16* d = dst.data<bf16>();
#pragma omp parallel for schedule(static)
      for (int64_t i = 0; i < n; ++i) d[i] = f32_to_bf16(s[i]);
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

  void add(const Tensor& a, const Tensor& b, const Tensor& out) override {
    expect_dtype(b, a.dtype(), "add", "b");
    expect_dtype(out, a.dtype(), "add", "out");
    expect_numel(b, a.numel(), "add", "b");
    expect_numel(out, a.numel(), "add", "out");
    dispatch_float(a.dtype(), "add", [&]<typename T>() {
      const T* pa = a.data<T>();
      const T* pb = b.data<T>();
      T* po = out.data<T>();
      const int64_t n = a.numel();
#pragma omp parallel for simd schedule(static)
      for (int64_t i = 0; i < n; ++i) po[i] = pa[i] + pb[i];
    });
  }

  void add_inplace(const Tensor& acc, const Tensor& x) override { add(acc, x, acc); }

  void scale_inplace(const Tensor& x, double factor) override {
    dispatch_float(x.dtype(), "scale_inplace", [&]<typename T>() {
      T* p = x.data<T>();
      const T f = static_cast<T>(factor);
      const int64_t n = x.numel();
#pragma omp parallel for simd schedule(static)
      for (int64_t i = 0; i < n; ++i) p[i] *= f;
    });
  }

  double sum_squares(const Tensor& x) override {
    return reduce_fixed_order(x, "sum_squares", [](double v) { return v * v; });
  }
  double sum(const Tensor& x) override {
    return reduce_fixed_order(x, "sum", [](double v) { return v; });
  }

  void bias_backward(const Tensor& dout, const Tensor& dbias) override {
    expect_dtype(dbias, dout.dtype(), "bias_backward", "dbias");
    expect_numel(dbias, dout.dim(-1), "bias_backward", "dbias");
    dispatch_float(dout.dtype(), "bias_backward", [&]<typename T>() {
      cpu::column_sums_accumulate(dout.data<T>(), rows_of(dout), dout.dim(-1), dbias.data<T>());
    });
  }

  void embedding_forward(const Tensor& tokens, const Tensor& table, const Tensor* positions,
                         const Tensor& out) override {
    const char* op = "embedding_forward";
    const auto [n_tokens, seq_len, channels] = check_embedding(op, tokens, table, positions, out);
    check_token_range(op, tokens, table.dim(0));
    dispatch_float(table.dtype(), op, [&]<typename T>() {
      cpu::embedding_forward(tokens.data<int32_t>(), table.data<T>(), positions ? positions->data<T>() : nullptr,
                             out.data<T>(), n_tokens, seq_len, channels);
    });
  }

  void embedding_backward(const Tensor& tokens, const Tensor& dout, const Tensor& dtable,
                          const Tensor* dpositions) override {
    const char* op = "embedding_backward";
    const auto [n_tokens, seq_len, channels] = check_embedding(op, tokens, dtable, dpositions, dout);
    check_token_range(op, tokens, dtable.dim(0));
    dispatch_float(dtable.dtype(), op, [&]<typename T>() {
      cpu::embedding_backward(tokens.data<int32_t>(), dout.data<T>(), dtable.data<T>(),
                              dpositions ? dpositions->data<T>() : nullptr, n_tokens, seq_len, channels);
    });
  }

  void layernorm_forward(const Tensor& x, const Tensor& weight, const Tensor& bias, const Tensor& out,
                         const Tensor& mean, const Tensor& rstd, float eps) override {
    const char* op = "layernorm_forward";
    const int64_t rows = rows_of(x), channels = x.dim(-1);
    check_row_op(op, x, {&out}, {&weight, &bias}, {&mean, &rstd});
    dispatch_float(x.dtype(), op, [&]<typename T>() {
      cpu::layernorm_forward(x.data<T>(), weight.data<T>(), bias.data<T>(), out.data<T>(), mean.data<T>(),
                             rstd.data<T>(), rows, channels, static_cast<T>(eps));
    });
  }

  void layernorm_backward(const Tensor& dout, const Tensor& x, const Tensor& weight, const Tensor& mean,
                          const Tensor& rstd, const Tensor& dx, const Tensor& dweight, const Tensor& dbias) override {
    const char* op = "layernorm_backward";
    check_row_op(op, x, {&dout, &dx}, {&weight, &dweight, &dbias}, {&mean, &rstd});
    dispatch_float(x.dtype(), op, [&]<typename T>() {
      cpu::layernorm_backward(dout.data<T>(), x.data<T>(), weight.data<T>(), mean.data<T>(), rstd.data<T>(),
                              dx.data<T>(), dweight.data<T>(), dbias.data<T>(), rows_of(x), x.dim(-1));
    });
  }

  void rmsnorm_forward(const Tensor& x, const Tensor& weight, const Tensor& out, const Tensor& rstd,
                       float eps) override {
    const char* op = "rmsnorm_forward";
    check_row_op(op, x, {&out}, {&weight}, {&rstd});
    dispatch_float(x.dtype(), op, [&]<typename T>() {
      cpu::rmsnorm_forward(x.data<T>(), weight.data<T>(), out.data<T>(), rstd.data<T>(), rows_of(x), x.dim(-1),
                           static_cast<T>(eps));
    });
  }

  void rmsnorm_backward(const Tensor& dout, const Tensor& x, const Tensor& weight, const Tensor& rstd,
                        const Tensor& dx, const Tensor& dweight) override {
    const char* op = "rmsnorm_backward";
    check_row_op(op, x, {&dout, &dx}, {&weight, &dweight}, {&rstd});
    dispatch_float(x.dtype(), op, [&]<typename T>() {
      cpu::rmsnorm_backward(dout.data<T>(), x.data<T>(), weight.data<T>(), rstd.data<T>(), dx.data<T>(),
                            dweight.data<T>(), rows_of(x), x.dim(-1));
    });
  }

  void gelu_forward(const Tensor& x, const Tensor& out) override {
    check_elementwise("gelu_forward", x, {&out});
    dispatch_float(x.dtype(), "gelu_forward",
                   [&]<typename T>() { cpu::gelu_forward(x.data<T>(), out.data<T>(), x.numel()); });
  }

  void gelu_backward(const Tensor& x, const Tensor& dout, const Tensor& dx) override {
    check_elementwise("gelu_backward", x, {&dout, &dx});
    dispatch_float(x.dtype(), "gelu_backward", [&]<typename T>() {
      cpu::gelu_backward(x.data<T>(), dout.data<T>(), dx.data<T>(), x.numel());
    });
  }

  void swiglu_forward(const Tensor& x, const Tensor& out) override {
    const char* op = "swiglu_forward";
    check_swiglu(op, x, out);
    dispatch_float(x.dtype(), op, [&]<typename T>() {
      cpu::swiglu_forward(x.data<T>(), out.data<T>(), rows_of(out), out.dim(-1));
    });
  }

  void swiglu_backward(const Tensor& x, const Tensor& dout, const Tensor& dx) override {
    const char* op = "swiglu_backward";
    check_swiglu(op, x, dout);
    check_elementwise(op, x, {&dx});
    dispatch_float(x.dtype(), op, [&]<typename T>() {
      cpu::swiglu_backward(x.data<T>(), dout.data<T>(), dx.data<T>(), rows_of(dout), dout.dim(-1));
    });
  }

  void rope_forward(const Tensor& x, int64_t head_dim, int64_t n_heads, float theta, int64_t pos_offset) override {
    rope(x, head_dim, n_heads, theta, pos_offset, 1.0, "rope_forward");
  }

  void rope_backward(const Tensor& dx, int64_t head_dim, int64_t n_heads, float theta, int64_t pos_offset) override {
    rope(dx, head_dim, n_heads, theta, pos_offset, -1.0, "rope_backward");
  }

  void attention_forward(const Tensor& qkv, const Tensor& out, const Tensor& probs, int64_t n_head,
                         int64_t n_kv_head, int64_t window) override {
    const char* op = "attention_forward";
    const auto [batch, seq_len, head_dim] = check_attention(op, qkv, out, probs, n_head, n_kv_head);
    LOOM_CHECK(window >= 0, op, ": window must be >= 0, got ", window);
    dispatch_float(qkv.dtype(), op, [&]<typename T>() {
      if (window > 0 && window < seq_len) {
        cpu::attention_forward_window(qkv.data<T>(), out.data<T>(), probs.data<T>(), batch, seq_len, n_head,
                                      n_kv_head, head_dim, window);
      } else {
        cpu::attention_forward(qkv.data<T>(), out.data<T>(), probs.data<T>(), batch, seq_len, n_head, n_kv_head,
                               head_dim);
      }
    });
  }

  void attention_backward(const Tensor& dout, const Tensor& qkv, const Tensor& out, const Tensor& probs,
                          const Tensor& dqkv, int64_t n_head, int64_t n_kv_head, int64_t window) override {
    const char* op = "attention_backward";
    const auto [batch, seq_len, head_dim] = check_attention(op, qkv, out, probs, n_head, n_kv_head);
    LOOM_CHECK(window >= 0, op, ": window must be >= 0, got ", window);
    check_elementwise(op, out, {&dout});
    check_elementwise(op, qkv, {&dqkv});
    const bool windowed = window > 0 && window < seq_len;
    const int64_t tile = cpu::window_tile_rows(window);  // the windowed backward's dS tile: Bq x (Bq + W - 1)
    const Tensor scratch = workspace(windowed ? tile * (tile + window - 1) : seq_len * seq_len, qkv.dtype());
    dispatch_float(qkv.dtype(), op, [&]<typename T>() {
      if (windowed) {
        cpu::attention_backward_window(dout.data<T>(), qkv.data<T>(), out.data<T>(), probs.data<T>(), dqkv.data<T>(),
                                       scratch.data<T>(), batch, seq_len, n_head, n_kv_head, head_dim, window);
      } else {
        cpu::attention_backward(dout.data<T>(), qkv.data<T>(), out.data<T>(), probs.data<T>(), dqkv.data<T>(),
                                scratch.data<T>(), batch, seq_len, n_head, n_kv_head, head_dim);
      }
    });
  }

  void cross_entropy_forward(const Tensor& logits, const Tensor& targets, const Tensor& losses,
                             const Tensor& lse) override {
    const char* op = "cross_entropy_forward";
    check_cross_entropy(op, logits, targets, lse);
    expect_dtype(losses, logits.dtype(), op, "losses");
    expect_numel(losses, rows_of(logits), op, "losses");
    dispatch_float(logits.dtype(), op, [&]<typename T>() {
      cpu::cross_entropy_forward(logits.data<T>(), targets.data<int32_t>(), losses.data<T>(), lse.data<T>(),
                                 rows_of(logits), logits.dim(-1));
    });
  }

  void cross_entropy_backward(const Tensor& logits, const Tensor& targets, const Tensor& lse, float dloss,
                              const Tensor& dlogits) override {
    const char* op = "cross_entropy_backward";
    check_cross_entropy(op, logits, targets, lse);
    check_elementwise(op, logits, {&dlogits});
    dispatch_float(logits.dtype(), op, [&]<typename T>() {
      cpu::cross_entropy_backward(logits.data<T>(), targets.data<int32_t>(), lse.data<T>(), static_cast<T>(dloss),
                                  dlogits.data<T>(), rows_of(logits), logits.dim(-1));
    });
  }

  void adamw_step(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v,
                  const AdamWHyper& h) override {
    const char* op = "adamw_step";
    check_elementwise(op, param, {&grad, &m, &v});
    LOOM_CHECK(h.step >= 1, op, ": step must be >= 1 (bias correction), got ", h.step);
    const double bias1 = 1.0 - std::pow(static_cast<double>(h.beta1), static_cast<double>(h.step));
    const double bias2 = 1.0 - std::pow(static_cast<double>(h.beta2), static_cast<double>(h.step));
    dispatch_float(param.dtype(), op, [&]<typename T>() {
      cpu::adamw_step<T>(param.data<T>(), grad.data<T>(), m.data<T>(), v.data<T>(), param.numel(), h.lr, h.beta1,
                         h.beta2, h.eps, h.weight_decay, h.grad_scale, static_cast<T>(bias1),
                         static_cast<T>(bias2));
    });
  }

 private:
  struct Dims3 {
    int64_t a, b, c;
  };

  template <typename T>
  static void add_bias_rows(T* c, const T* bias, int64_t rows, int64_t cols) {
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      T* row = c + r * cols;
#pragma omp simd
      for (int64_t j = 0; j < cols; ++j) row[j] += bias[j];
    }
  }

  // Sum of f(x_i) in double over fixed chunks summed in order: bitwise identical for any thread count.
  template <typename F>
  double reduce_fixed_order(const Tensor& x, const char* op, F f) {
    constexpr int64_t kChunks = 64;
    double partial[kChunks] = {};
    const int64_t n = x.numel();
    const int64_t chunk = (n + kChunks - 1) / kChunks;
    dispatch_float(x.dtype(), op, [&]<typename T>() {
      const T* p = x.data<T>();
#pragma omp parallel for schedule(static)
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

  static void check_elementwise(const char* op, const Tensor& x, std::initializer_list<const Tensor*> others) {
    for (const Tensor* t : others) {
      expect_dtype(*t, x.dtype(), op, "operand");
      expect_numel(*t, x.numel(), op, "operand");
    }
  }

  // x (N, C); `same` are (N, C); `per_channel` are (C); `per_row` are (N).
  static void check_row_op(const char* op, const Tensor& x, std::initializer_list<const Tensor*> same,
                           std::initializer_list<const Tensor*> per_channel,
                           std::initializer_list<const Tensor*> per_row) {
    check_elementwise(op, x, same);
    for (const Tensor* t : per_channel) {
      expect_dtype(*t, x.dtype(), op, "per-channel operand");
      expect_numel(*t, x.dim(-1), op, "per-channel operand");
    }
    for (const Tensor* t : per_row) {
      expect_dtype(*t, x.dtype(), op, "per-row statistic");
      expect_numel(*t, rows_of(x), op, "per-row statistic");
    }
  }

  static Dims3 check_embedding(const char* op, const Tensor& tokens, const Tensor& table, const Tensor* positions,
                               const Tensor& activations) {
    expect_dtype(tokens, DTYPE_I32, op, "tokens");
    LOOM_CHECK(tokens.ndim() == 2, op, ": tokens must be (B, T), got ", tokens.describe());
    LOOM_CHECK(table.ndim() == 2, op, ": table must be (V, C), got ", table.describe());
    const int64_t seq_len = tokens.dim(1), channels = table.dim(1);
    expect_dtype(activations, table.dtype(), op, "activations");
    expect_numel(activations, tokens.numel() * channels, op, "activations (B, T, C)");
    if (positions) {
      expect_dtype(*positions, table.dtype(), op, "positions");
      LOOM_CHECK(positions->ndim() == 2 && positions->dim(1) == channels && positions->dim(0) >= seq_len, op,
                 ": positions must be (Tmax >= ", seq_len, ", ", channels, "), got ", positions->describe());
    }
    return {tokens.numel(), seq_len, channels};
  }

  static void check_token_range(const char* op, const Tensor& tokens, int64_t vocab) {
    const int32_t* t = tokens.data<int32_t>();
    for (int64_t i = 0; i < tokens.numel(); ++i) {
      LOOM_CHECK(t[i] >= 0 && t[i] < vocab, op, ": token id ", t[i], " at position ", i, " outside vocab [0, ", vocab,
                 ")");
    }
  }

  static void check_swiglu(const char* op, const Tensor& x, const Tensor& out) {
    expect_dtype(out, x.dtype(), op, "out");
    LOOM_CHECK(x.dim(-1) == 2 * out.dim(-1) && rows_of(x) == rows_of(out), op, ": x must be (N, 2F) for out (N, F); x ",
               x.describe(), ", out ", out.describe());
  }

  void rope(const Tensor& x, int64_t head_dim, int64_t n_heads, float theta, int64_t pos_offset, double direction,
            const char* op) {
    LOOM_CHECK(x.ndim() == 3, op, ": x must be (B, T, W), got ", x.describe());
    LOOM_CHECK(head_dim % 2 == 0 && n_heads * head_dim <= x.dim(2), op, ": ", n_heads, " heads of dim ", head_dim,
               " (even) must fit in width ", x.dim(2));
    dispatch_float(x.dtype(), op, [&]<typename T>() {
      cpu::rope_rotate(x.data<T>(), x.dim(0), x.dim(1), x.dim(2), head_dim, n_heads, static_cast<double>(theta),
                       pos_offset, direction);
    });
  }

  static Dims3 check_attention(const char* op, const Tensor& qkv, const Tensor& out, const Tensor& probs,
                               int64_t n_head, int64_t n_kv_head) {
    LOOM_CHECK(n_head > 0 && n_kv_head > 0 && n_head % n_kv_head == 0, op, ": n_head ", n_head,
               " must be a multiple of n_kv_head ", n_kv_head);
    LOOM_CHECK(qkv.ndim() == 3 && qkv.dim(2) % (n_head + 2 * n_kv_head) == 0, op, ": qkv must be (B, T, (H + 2 KV) hd), got ",
               qkv.describe());
    const int64_t batch = qkv.dim(0), seq_len = qkv.dim(1), head_dim = qkv.dim(2) / (n_head + 2 * n_kv_head);
    expect_dtype(out, qkv.dtype(), op, "out");
    expect_dtype(probs, qkv.dtype(), op, "probs");
    expect_numel(out, batch * seq_len * n_head * head_dim, op, "out (B, T, H hd)");
    expect_numel(probs, batch * n_head * seq_len * seq_len, op, "probs (B, H, T, T)");
    return {batch, seq_len, head_dim};
  }

  static void check_cross_entropy(const char* op, const Tensor& logits, const Tensor& targets, const Tensor& lse) {
    expect_dtype(targets, DTYPE_I32, op, "targets");
    expect_numel(targets, rows_of(logits), op, "targets");
    expect_dtype(lse, logits.dtype(), op, "lse");
    expect_numel(lse, rows_of(logits), op, "lse");
    const int32_t* t = targets.data<int32_t>();
    const int64_t vocab = logits.dim(-1);
    for (int64_t i = 0; i < targets.numel(); ++i) {
      LOOM_CHECK(t[i] >= 0 && t[i] < vocab, op, ": target ", t[i], " at row ", i, " outside vocab [0, ", vocab, ")");
    }
  }

  // Scratch of at least `count` elements of `dtype`, kept and grown across calls, so
  // steady-state steps allocate nothing. Accounted as workspace.
  Tensor workspace(int64_t count, DType dtype) {
    if (!workspace_.defined() || workspace_.dtype() != dtype || workspace_.numel() < count) {
      workspace_ = Tensor();  // release first: peak memory is the larger buffer, not both
      workspace_ = Tensor::empty(allocator_, {count}, dtype, MEM_WORKSPACE);
    }
    return workspace_;
  }

  CpuAllocator allocator_;
  Tensor workspace_;  // see workspace()
};

}  // namespace

std::unique_ptr<Backend> make_cpu_backend() { return std::make_unique<CpuBackend>(); }

}  // namespace loom
