// CPU implementation of the op interface: validates shapes and dtypes, then dispatches to the
// templated kernels of cpu_kernels.h (f32 for training, f64 for reference checks) and to oneDNN
// for f32 GEMMs. One OpenMP thread pool serves our kernels and oneDNN alike.
#include <cmath>
#include <cstring>

#include "loom/backend/backend.h"
#include "loom/backend/checks.h"
#include "loom/backend/cpu/cpu_compress.h"
#include "loom/backend/cpu/cpu_flash.h"
#include "loom/backend/cpu/cpu_gemm.h"
#include "loom/backend/cpu/cpu_kernels.h"
#include "loom/backend/cpu/cpu_moe_ops.h"
#include "loom/backend/cpu/cpu_parallel_ops.h"
#include "loom/backend/cpu/cpu_quant_ops.h"
#include "loom/backend/cpu/cpu_optim_ops.h"
#include "loom/core/error.h"

namespace loom {
namespace {

using checks::check_attention;
using checks::check_attention_backward;
using checks::check_cross_entropy;
using checks::check_elementwise;
using checks::check_embedding;
using checks::check_row_op;
using checks::check_swiglu;
using checks::dispatch_float;
using checks::expect_dtype;
using checks::expect_numel;
using checks::rows_of;

constexpr const char* kBackend = "CPU";  // in dtype errors

class CpuBackend final : public Backend {
 public:
  std::string_view name() const override { return "cpu"; }
  // Host code reads CPU memory directly: every feature runs.
  BackendCapabilities capabilities() const override { return kEveryCapability; }
  std::string gemm_kernels(DType dtype) const override { return cpu::gemm_kernels(dtype == DTYPE_BF16); }
  Allocator& allocator() override { return allocator_; }

  void write(const Tensor& dst, const void* host) override { std::memcpy(dst.raw_data(), host, dst.nbytes()); }
  void read(const Tensor& src, void* host) override { std::memcpy(host, src.raw_data(), src.nbytes()); }

  void gemm(const Tensor& a, const Tensor& b, const Tensor& c, const GemmSpec& spec, const Tensor* bias) override {
    const checks::GemmDims d = checks::check_gemm(a, b, c, spec, bias);
    const bool bf16_in = a.dtype() == DTYPE_BF16;
    const int64_t batch = spec.batch, m = d.m, n = d.n, k = d.k;
    const int64_t a_rows = d.a_rows, a_cols = d.a_cols, b_rows = d.b_rows, b_cols = d.b_cols;
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

  void fill(const Tensor& x, double value) override {
    dispatch_float(x.dtype(), "fill", kBackend, [&]<typename T>() {
      T* p = x.data<T>();
      const int64_t n = x.numel();
#pragma omp parallel for simd schedule(dynamic, cpu::kStreamChunk) if (n > cpu::kStreamChunk)
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

  void add(const Tensor& a, const Tensor& b, const Tensor& out) override {
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

  void add_inplace(const Tensor& acc, const Tensor& x) override { add(acc, x, acc); }

  void scale_inplace(const Tensor& x, double factor) override {
    dispatch_float(x.dtype(), "scale_inplace", kBackend, [&]<typename T>() {
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
    dispatch_float(dout.dtype(), "bias_backward", kBackend, [&]<typename T>() {
      cpu::column_sums_accumulate(dout.data<T>(), rows_of(dout), dout.dim(-1), dbias.data<T>());
    });
  }

  void embedding_forward(const Tensor& tokens, const Tensor& table, const Tensor* positions,
                         const Tensor& out) override {
    const char* op = "embedding_forward";
    const auto [n_tokens, seq_len, channels] = check_embedding(op, tokens, table, positions, out);
    check_token_range(op, tokens, table.dim(0));
    dispatch_float(table.dtype(), op, kBackend, [&]<typename T>() {
      cpu::embedding_forward(tokens.data<int32_t>(), table.data<T>(), positions ? positions->data<T>() : nullptr,
                             out.data<T>(), n_tokens, seq_len, channels);
    });
  }

  void embedding_backward(const Tensor& tokens, const Tensor& dout, const Tensor& dtable,
                          const Tensor* dpositions) override {
    const char* op = "embedding_backward";
    const auto [n_tokens, seq_len, channels] = check_embedding(op, tokens, dtable, dpositions, dout);
    check_token_range(op, tokens, dtable.dim(0));
    dispatch_float(dtable.dtype(), op, kBackend, [&]<typename T>() {
      cpu::embedding_backward(tokens.data<int32_t>(), dout.data<T>(), dtable.data<T>(),
                              dpositions ? dpositions->data<T>() : nullptr, n_tokens, seq_len, channels);
    });
  }

  void layernorm_forward(const Tensor& x, const Tensor& weight, const Tensor& bias, const Tensor& out,
                         const Tensor& mean, const Tensor& rstd, float eps) override {
    const char* op = "layernorm_forward";
    const int64_t rows = rows_of(x), channels = x.dim(-1);
    check_row_op(op, x, {&out}, {&weight, &bias}, {&mean, &rstd});
    dispatch_float(x.dtype(), op, kBackend, [&]<typename T>() {
      cpu::layernorm_forward(x.data<T>(), weight.data<T>(), bias.data<T>(), out.data<T>(), mean.data<T>(),
                             rstd.data<T>(), rows, channels, static_cast<T>(eps));
    });
  }

  void layernorm_backward(const Tensor& dout, const Tensor& x, const Tensor& weight, const Tensor& mean,
                          const Tensor& rstd, const Tensor& dx, const Tensor& dweight, const Tensor& dbias) override {
    const char* op = "layernorm_backward";
    check_row_op(op, x, {&dout, &dx}, {&weight, &dweight, &dbias}, {&mean, &rstd});
    dispatch_float(x.dtype(), op, kBackend, [&]<typename T>() {
      cpu::layernorm_backward(dout.data<T>(), x.data<T>(), weight.data<T>(), mean.data<T>(), rstd.data<T>(),
                              dx.data<T>(), dweight.data<T>(), dbias.data<T>(), rows_of(x), x.dim(-1));
    });
  }

  void rmsnorm_forward(const Tensor& x, const Tensor& weight, const Tensor& out, const Tensor& rstd,
                       float eps) override {
    const char* op = "rmsnorm_forward";
    check_row_op(op, x, {&out}, {&weight}, {&rstd});
    dispatch_float(x.dtype(), op, kBackend, [&]<typename T>() {
      cpu::rmsnorm_forward(x.data<T>(), weight.data<T>(), out.data<T>(), rstd.data<T>(), rows_of(x), x.dim(-1),
                           static_cast<T>(eps));
    });
  }

  void rmsnorm_backward(const Tensor& dout, const Tensor& x, const Tensor& weight, const Tensor& rstd,
                        const Tensor& dx, const Tensor& dweight) override {
    const char* op = "rmsnorm_backward";
    check_row_op(op, x, {&dout, &dx}, {&weight, &dweight}, {&rstd});
    dispatch_float(x.dtype(), op, kBackend, [&]<typename T>() {
      cpu::rmsnorm_backward(dout.data<T>(), x.data<T>(), weight.data<T>(), rstd.data<T>(), dx.data<T>(),
                            dweight.data<T>(), rows_of(x), x.dim(-1));
    });
  }

  void head_rmsnorm_forward(const Tensor& x, const Tensor& weight, int64_t first, int64_t n, int64_t hd, float eps,
                            const Tensor& in, const Tensor& rstd) override {
    const char* op = "head_rmsnorm_forward";
    checks::check_head_rows(op, x, weight, first, n, hd, in, rstd);
    dispatch_float(x.dtype(), op, kBackend, [&]<typename T>() {
      cpu::head_rmsnorm_forward(x.data<T>(), weight.data<T>(), in.data<T>(), rstd.data<T>(), rows_of(x), x.dim(-1),
                                first, n, hd, static_cast<T>(eps));
    });
  }

  void head_rmsnorm_backward(const Tensor& dx, const Tensor& in, const Tensor& weight, const Tensor& rstd, int64_t first,
                             int64_t n, int64_t hd, const Tensor& dweight) override {
    const char* op = "head_rmsnorm_backward";
    checks::check_head_rows(op, dx, weight, first, n, hd, in, rstd);
    LOOM_CHECK(dweight.shape() == weight.shape() && dweight.dtype() == weight.dtype(), op, ": dweight ",
               dweight.describe(), " must match weight ", weight.describe());
    dispatch_float(dx.dtype(), op, kBackend, [&]<typename T>() {
      cpu::head_rmsnorm_backward(dx.data<T>(), in.data<T>(), weight.data<T>(), rstd.data<T>(), dweight.data<T>(),
                                 rows_of(dx), dx.dim(-1), first, n, hd);
    });
  }

  void gelu_forward(const Tensor& x, const Tensor& out) override {
    check_elementwise("gelu_forward", x, {&out});
    dispatch_float(x.dtype(), "gelu_forward", kBackend,
                   [&]<typename T>() { cpu::gelu_forward(x.data<T>(), out.data<T>(), x.numel()); });
  }

  void gelu_backward(const Tensor& x, const Tensor& dout, const Tensor& dx) override {
    check_elementwise("gelu_backward", x, {&dout, &dx});
    dispatch_float(x.dtype(), "gelu_backward", kBackend, [&]<typename T>() {
      cpu::gelu_backward(x.data<T>(), dout.data<T>(), dx.data<T>(), x.numel());
    });
  }

  void swiglu_forward(const Tensor& x, const Tensor& out) override {
    const char* op = "swiglu_forward";
    check_swiglu(op, x, out);
    dispatch_float(x.dtype(), op, kBackend, [&]<typename T>() {
      cpu::swiglu_forward(x.data<T>(), out.data<T>(), rows_of(out), out.dim(-1));
    });
  }

  void swiglu_backward(const Tensor& x, const Tensor& dout, const Tensor& dx) override {
    const char* op = "swiglu_backward";
    check_swiglu(op, x, dout);
    check_elementwise(op, x, {&dx});
    dispatch_float(x.dtype(), op, kBackend, [&]<typename T>() {
      cpu::swiglu_backward(x.data<T>(), dout.data<T>(), dx.data<T>(), rows_of(dout), dout.dim(-1));
    });
  }

  void rope_forward(const Tensor& x, int64_t head_dim, int64_t n_heads, const RopeSpec& rope_spec,
                    int64_t pos_offset) override {
    rope(x, head_dim, n_heads, rope_spec, pos_offset, 1.0, "rope_forward");
  }

  void rope_backward(const Tensor& dx, int64_t head_dim, int64_t n_heads, const RopeSpec& rope_spec,
                     int64_t pos_offset) override {
    rope(dx, head_dim, n_heads, rope_spec, pos_offset, -1.0, "rope_backward");
  }

  void attention_forward(const Tensor& qkv, const Tensor& out, const Tensor& probs, int64_t n_head,
                         int64_t n_kv_head, int64_t window) override {
    const char* op = "attention_forward";
    const auto [batch, seq_len, head_dim] = check_attention(op, qkv, out, probs, n_head, n_kv_head, window, false);
    dispatch_float(qkv.dtype(), op, kBackend, [&]<typename T>() {
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
    const auto [batch, seq_len, head_dim] =
        check_attention_backward(op, dout, qkv, out, probs, dqkv, n_head, n_kv_head, window, false);
    const bool windowed = window > 0 && window < seq_len;
    const int64_t tile = cpu::window_tile_rows(window);
    // The windowed backward's dS tile (Bq x (Bq + W - 1)); the full one's T x T per thread.
    const Tensor scratch = workspace(windowed ? tile * (tile + window - 1) : omp_get_max_threads() * seq_len * seq_len,
                                     qkv.dtype());
    dispatch_float(qkv.dtype(), op, kBackend, [&]<typename T>() {
      if (windowed) {
        cpu::attention_backward_window(dout.data<T>(), qkv.data<T>(), out.data<T>(), probs.data<T>(), dqkv.data<T>(),
                                       scratch.data<T>(), batch, seq_len, n_head, n_kv_head, head_dim, window);
      } else {
        cpu::attention_backward(dout.data<T>(), qkv.data<T>(), out.data<T>(), probs.data<T>(), dqkv.data<T>(),
                                scratch.data<T>(), batch, seq_len, n_head, n_kv_head, head_dim);
      }
    });
  }

  void attention_forward_bf16(const Tensor& qkv, const Tensor& out, const Tensor& probs, int64_t n_head,
                              int64_t n_kv_head) override {
    const char* op = "attention_forward_bf16";
    const auto [batch, seq_len, head_dim] = check_attention(op, qkv, out, probs, n_head, n_kv_head, 0, false);
    expect_dtype(qkv, DTYPE_F32, op, "qkv");
    const Tensor scratch = workspace(omp_get_max_threads() * cpu::attention_bf16_scratch(seq_len, head_dim), DTYPE_F32);
    cpu::attention_forward_bf16(qkv.data<float>(), out.data<float>(), probs.data<float>(), scratch.data<float>(), batch,
                                seq_len, n_head, n_kv_head, head_dim);
  }

  void attention_backward_bf16(const Tensor& dout, const Tensor& qkv, const Tensor& out, const Tensor& probs,
                               const Tensor& dqkv, int64_t n_head, int64_t n_kv_head) override {
    const char* op = "attention_backward_bf16";
    const auto [batch, seq_len, head_dim] =
        check_attention_backward(op, dout, qkv, out, probs, dqkv, n_head, n_kv_head, 0, false);
    expect_dtype(qkv, DTYPE_F32, op, "qkv");
    const Tensor scratch = workspace(omp_get_max_threads() * cpu::attention_bf16_scratch(seq_len, head_dim), DTYPE_F32);
    cpu::attention_backward_bf16(dout.data<float>(), qkv.data<float>(), out.data<float>(), probs.data<float>(),
                                 dqkv.data<float>(), scratch.data<float>(), batch, seq_len, n_head, n_kv_head, head_dim);
  }

  // FlashAttention-2 (cpu_flash.h): tasks over (batch, head) / (batch, kv head), one tile
  // scratch per thread from the workspace.
  void flash_attention_forward(const Tensor& qkv, const Tensor& out, const Tensor& lse, int64_t n_head,
                               int64_t n_kv_head, int64_t window) override {
    const char* op = "flash_attention_forward";
    const auto [batch, seq_len, head_dim] = check_attention(op, qkv, out, lse, n_head, n_kv_head, window, true);
    const int threads = omp_get_max_threads();
    const cpu::FlashTiles tiles;
    const Tensor scratch = workspace(threads * cpu::flash_forward_scratch(tiles, head_dim), qkv.dtype());
    dispatch_float(qkv.dtype(), op, kBackend, [&]<typename T>() {
      cpu::flash_attention_forward(qkv.data<T>(), out.data<T>(), lse.data<T>(), scratch.data<T>(), threads, batch,
                                   seq_len, n_head, n_kv_head, head_dim, window, tiles);
    });
  }
  void flash_attention_backward(const Tensor& dout, const Tensor& qkv, const Tensor& out, const Tensor& lse,
                                const Tensor& dqkv, int64_t n_head, int64_t n_kv_head, int64_t window) override {
    const char* op = "flash_attention_backward";
    const auto [batch, seq_len, head_dim] =
        check_attention_backward(op, dout, qkv, out, lse, dqkv, n_head, n_kv_head, window, true);
    const int threads = omp_get_max_threads();
    const cpu::FlashTiles tiles;
    const Tensor scratch = workspace(threads * cpu::flash_backward_scratch(tiles), qkv.dtype());
    dispatch_float(qkv.dtype(), op, kBackend, [&]<typename T>() {
      cpu::flash_attention_backward(dout.data<T>(), qkv.data<T>(), out.data<T>(), lse.data<T>(), dqkv.data<T>(),
                                    scratch.data<T>(), threads, batch, seq_len, n_head, n_kv_head, head_dim, window,
                                    tiles);
    });
  }

  void cross_entropy_forward(const Tensor& logits, const Tensor& targets, const Tensor& losses,
                             const Tensor& lse) override {
    const char* op = "cross_entropy_forward";
    check_cross_entropy(op, logits, targets, lse);
    check_target_range(op, logits, targets);
    expect_dtype(losses, logits.dtype(), op, "losses");
    expect_numel(losses, rows_of(logits), op, "losses");
    dispatch_float(logits.dtype(), op, kBackend, [&]<typename T>() {
      cpu::cross_entropy_forward(logits.data<T>(), targets.data<int32_t>(), losses.data<T>(), lse.data<T>(),
                                 rows_of(logits), logits.dim(-1));
    });
  }

  void cross_entropy_backward(const Tensor& logits, const Tensor& targets, const Tensor& lse, float dloss,
                              const Tensor& dlogits) override {
    const char* op = "cross_entropy_backward";
    check_cross_entropy(op, logits, targets, lse);
    check_target_range(op, logits, targets);
    check_elementwise(op, logits, {&dlogits});
    dispatch_float(logits.dtype(), op, kBackend, [&]<typename T>() {
      cpu::cross_entropy_backward(logits.data<T>(), targets.data<int32_t>(), lse.data<T>(), static_cast<T>(dloss),
                                  dlogits.data<T>(), rows_of(logits), logits.dim(-1));
    });
  }

  void cross_entropy_loss_and_grad(const Tensor& logits, const Tensor& targets, const Tensor& losses, const Tensor& lse,
                                   float dloss, const Tensor& dlogits) override {
    const char* op = "cross_entropy_loss_and_grad";
    check_cross_entropy(op, logits, targets, lse);
    check_target_range(op, logits, targets);
    expect_dtype(losses, logits.dtype(), op, "losses");
    expect_numel(losses, rows_of(logits), op, "losses");
    expect_numel(dlogits, logits.numel(), op, "dlogits");
    if (dlogits.dtype() == DTYPE_BF16 && logits.dtype() == DTYPE_F32) {
      cpu::cross_entropy_loss_and_grad(logits.data<float>(), targets.data<int32_t>(), losses.data<float>(),
                                       lse.data<float>(), dloss, dlogits.data<bf16>(), rows_of(logits), logits.dim(-1));
      return;
    }
    LOOM_CHECK(dlogits.raw_data() == logits.raw_data() && dlogits.dtype() == logits.dtype(), op,
               ": dlogits is the logits (in place) or bf16, got ", dlogits.describe(), " for logits ", logits.describe());
    dispatch_float(logits.dtype(), op, kBackend, [&]<typename T>() {
      cpu::cross_entropy_loss_and_grad(logits.data<T>(), targets.data<int32_t>(), losses.data<T>(), lse.data<T>(),
                                       static_cast<T>(dloss), logits.data<T>(), rows_of(logits), logits.dim(-1));
    });
  }

  // Gradient compression: cpu_compress.cpp.
  void topk_extract(const Tensor& acc, const Tensor& idx, const Tensor& val, const Tensor& scratch) override {
    cpu::topk_extract(acc, idx, val, scratch);
  }
  void scatter_add(const Tensor& idx, const Tensor& val, const Tensor& out) override { cpu::scatter_add(idx, val, out); }
  void scatter_zero(const Tensor& idx, const Tensor& x) override { cpu::scatter_zero(idx, x); }
  void dgc_accumulate(const Tensor& g, const Tensor& u, const Tensor& v, float momentum, double clip) override {
    cpu::dgc_accumulate(g, u, v, momentum, clip);
  }
  void onebit_encode(const Tensor& acc, const Tensor& words, const Tensor& scale) override {
    cpu::onebit_encode(acc, words, scale);
  }
  void onebit_decode_add(const Tensor& words, const Tensor& scales, const Tensor& out) override {
    cpu::onebit_decode_add(words, scales, out);
  }
  void qsgd_encode(const Tensor& g, const Tensor& codes, const Tensor& norm, const QsgdSpec& spec) override {
    cpu::qsgd_encode(g, codes, norm, spec);
  }
  void qsgd_decode_add(const Tensor& codes, const Tensor& norms, int levels, const Tensor& out) override {
    cpu::qsgd_decode_add(codes, norms, levels, out);
  }
  void lowrank_project(const Tensor& m, const Tensor& q, const Tensor& out, bool transpose) override {
    cpu::lowrank_project(m, q, out, transpose);
  }
  void orthonormalize_columns(const Tensor& p) override { cpu::orthonormalize_columns(p); }
  void lowrank_expand(const Tensor& p, const Tensor& q, const Tensor& out, float alpha, float beta) override {
    cpu::lowrank_expand(p, q, out, alpha, beta);
  }

  // Model parallelism: cpu_parallel_ops.cpp.
  void vocab_embedding_forward(const Tensor& tokens, const Tensor& weight, int64_t begin, int64_t valid,
                               const Tensor& out) override {
    cpu::vocab_embedding_forward(tokens, weight, begin, valid, out);
  }
  void vocab_embedding_backward(const Tensor& tokens, const Tensor& dout, const Tensor& dweight, int64_t begin,
                                int64_t valid) override {
    cpu::vocab_embedding_backward(tokens, dout, dweight, begin, valid);
  }
  void add_positions(const Tensor& out, const Tensor& positions, int64_t first) override {
    cpu::add_positions(out, positions, first);
  }
  void positions_backward(const Tensor& dout, const Tensor& dpositions, int64_t first) override {
    cpu::positions_backward(dout, dpositions, first);
  }
  void vocab_ce_partials(const Tensor& logits, const Tensor& targets, int64_t begin, int64_t valid,
                         const Tensor& max, const Tensor& target) override {
    cpu::vocab_ce_partials(logits, targets, begin, valid, max, target);
  }
  void vocab_ce_sums(const Tensor& logits, const Tensor& max, int64_t valid, const Tensor& sums) override {
    cpu::vocab_ce_sums(logits, max, valid, sums);
  }
  void vocab_ce_finish(const Tensor& targets, const Tensor& lse, const Tensor& sums, const Tensor& losses) override {
    cpu::vocab_ce_finish(targets, lse, sums, losses);
  }
  void vocab_ce_backward(const Tensor& logits, const Tensor& targets, const Tensor& lse, int64_t begin, int64_t valid,
                         float scale, const Tensor& dlogits) override {
    cpu::vocab_ce_backward(logits, targets, lse, begin, valid, scale, dlogits);
  }
  void ring_attention_merge(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& m,
                            const Tensor& l, const Tensor& scratch, const RingBlock& block) override {
    cpu::ring_attention_merge(q, k, v, out, m, l, scratch, block);
  }
  void ring_attention_finish(const Tensor& out, const Tensor& lse, const Tensor& l, int64_t n_head) override {
    cpu::ring_attention_finish(out, lse, l, n_head);
  }
  void attention_row_dot(const Tensor& dout, const Tensor& out, const Tensor& D, int64_t n_head) override {
    cpu::attention_row_dot(dout, out, D, n_head);
  }
  void ring_attention_block_backward(const Tensor& q, const Tensor& dout, const Tensor& lse, const Tensor& D,
                                     const Tensor& k, const Tensor& v, const Tensor& dq, const Tensor& dk,
                                     const Tensor& dv, const RingBlock& block) override {
    cpu::ring_attention_block_backward(q, dout, lse, D, k, v, dq, dk, dv, block);
  }
  // Model-parallel slicing (cpu_parallel_ops.cpp).
  void copy_block(const Tensor& src, const Tensor& dst, const BlockCopy& block) override {
    cpu::copy_block(src, dst, block);
  }

  // Mixture of experts and latent attention: cpu_moe_ops.cpp, cpu_mla_ops.cpp.
  void moe_route(const Tensor& logits, const Tensor& bias, const Tensor& scores, const Tensor& expert,
                 const Tensor& gates, const Tensor& scratch, const MoeRouting& routing) override {
    cpu::moe_route(logits, bias, scores, expert, gates, scratch, routing);
  }
  void moe_assign(const Tensor& expert, int64_t capacity, const Tensor& row, const Tensor& token,
                  const Tensor& counts) override {
    cpu::moe_assign(expert, capacity, row, token, counts);
  }
  void moe_dispatch(const Tensor& x, const Tensor& token, const Tensor& rows) override {
    cpu::moe_dispatch(x, token, rows);
  }
  void moe_combine(const Tensor& rows, const Tensor& row, const Tensor& gates, const Tensor& out) override {
    cpu::moe_combine(rows, row, gates, out);
  }
  void moe_combine_backward(const Tensor& dout, const Tensor& row, const Tensor& gates, const Tensor& drows) override {
    cpu::moe_combine_backward(dout, row, gates, drows);
  }
  void moe_balance_stats(const Tensor& logits, const Tensor& scores, const Tensor& expert, const Tensor& counts,
                         const Tensor& stats, const Tensor& scratch, const MoeRouting& routing) override {
    cpu::moe_balance_stats(logits, scores, expert, counts, stats, scratch, routing);
  }
  void moe_router_backward(const Tensor& logits, const Tensor& scores, const Tensor& expert, const Tensor& row,
                           const Tensor& ye, const Tensor& dy, const Tensor& counts, const Tensor& dlogits,
                           const Tensor& scratch, const MoeRouting& routing) override {
    cpu::moe_router_backward(logits, scores, expert, row, ye, dy, counts, dlogits, scratch, routing);
  }
  void mla_rope(const Tensor& x, int64_t heads, int64_t stride, int64_t offset, int64_t rope_dim, const RopeSpec& rope_spec,
                int64_t pos_offset, bool inverse) override {
    cpu::mla_rope(x, heads, stride, offset, rope_dim, rope_spec, pos_offset, inverse);
  }
  void mla_attention_forward(const Tensor& q, const Tensor& kr, const Tensor& kv, const Tensor& probs,
                             const Tensor& out, const MlaDims& dims) override {
    cpu::mla_attention_forward(q, kr, kv, probs, out, dims);
  }
  void mla_attention_backward(const Tensor& q, const Tensor& kr, const Tensor& kv, const Tensor& probs,
                              const Tensor& dout, const Tensor& dq, const Tensor& dkv, const Tensor& dkr,
                              const Tensor& dp_row, const MlaDims& dims) override {
    cpu::mla_attention_backward(q, kr, kv, probs, dout, dq, dkv, dkr, dp_row, dims);
  }
  void mla_attend_latents(const Tensor& q, const Tensor& latents, const Tensor& kv_b, const Tensor& out,
                          const MlaDims& dims) override {
    cpu::mla_attend_latents(q, latents, kv_b, out, dims);
  }
  // Optimizers: cpu_optim_ops.cpp, cpu_optim_factored.cpp.
  void sgd_step(const Tensor& p, const Tensor& g, const Tensor& buf, const OptimHyper& h) override { cpu::sgd_step(p, g, buf, h); }
  void adagrad_step(const Tensor& p, const Tensor& g, const Tensor& sum, const OptimHyper& h) override {
    cpu::adagrad_step(p, g, sum, h);
  }
  void rmsprop_step(const Tensor& p, const Tensor& g, const Tensor& square, const Tensor& avg, const Tensor& buf,
                    const OptimHyper& h) override {
    cpu::rmsprop_step(p, g, square, avg, buf, h);
  }
  void adam_step(const Tensor& p, const Tensor& g, const Tensor& m, const Tensor& v, const Tensor& vmax,
                 const OptimHyper& h) override {
    cpu::adam_step(p, g, m, v, vmax, h);
  }
  void lion_step(const Tensor& p, const Tensor& g, const Tensor& m, const OptimHyper& h) override { cpu::lion_step(p, g, m, h); }
  void adam_mini_step(const Tensor& p, const Tensor& g, const Tensor& m, const Tensor& v, const OptimHyper& h) override {
    cpu::adam_mini_step(p, g, m, v, h);
  }
  void adafactor_step(const Tensor& p, const Tensor& g, const Tensor& state, const Tensor& m, const Tensor& u,
                      const OptimHyper& h) override {
    cpu::adafactor_step(p, g, state, m, u, h);
  }
  void sm3_step(const Tensor& p, const Tensor& g, const Tensor& acc, const OptimHyper& h) override { cpu::sm3_step(p, g, acc, h); }
  void came_step(const Tensor& p, const Tensor& g, const Tensor& state, const Tensor& m, const Tensor& res, const Tensor& u,
                 const OptimHyper& h) override {
    cpu::came_step(p, g, state, m, res, u, h);
  }
  void scale_transpose(const Tensor& src, const Tensor& dst, float scale, bool transpose) override {
    cpu::scale_transpose(src, dst, scale, transpose);
  }
  void axpy(const Tensor& y, const Tensor& x, float alpha) override { cpu::axpy(y, x, alpha); }
  void muon_momentum(const Tensor& g, const Tensor& buf, const Tensor& u, const OptimHyper& h) override {
    cpu::muon_momentum(g, buf, u, h);
  }
  void newton_schulz_normalize(const Tensor& u, const Tensor& x) override { cpu::newton_schulz_normalize(u, x); }
  void decayed_update(const Tensor& p, const Tensor& u, float decay, float step) override {
    cpu::decayed_update(p, u, decay, step);
  }
  void leading_eigenvectors(const Tensor& s, const Tensor& p) override { cpu::leading_eigenvectors(s, p); }
  void gram_schmidt(const Tensor& y, const Tensor& fallback, const Tensor& p) override { cpu::gram_schmidt(y, fallback, p); }
  void ldadam_rotate(const Tensor& p, const Tensor& prev, const Tensor& m, const Tensor& v, const Tensor& mt,
                     const Tensor& vt, const OptimHyper& h) override {
    cpu::ldadam_rotate(p, prev, m, v, mt, vt, h);
  }
  void ldadam_adam(const Tensor& m, const Tensor& v, const Tensor& mt, const Tensor& vt, const Tensor& gh,
                   const OptimHyper& h) override {
    cpu::ldadam_adam(m, v, mt, vt, gh, h);
  }
  void ldadam_apply(const Tensor& p, const Tensor& g, const Tensor& d, const Tensor& e, bool transpose,
                    const OptimHyper& h) override {
    cpu::ldadam_apply(p, g, d, e, transpose, h);
  }

  void adamw_step(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v,
                  const AdamWHyper& h) override {
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

  // Low precision: cpu_quant_ops.cpp.
  float amax(const Tensor& x) override { return cpu::amax(x); }
  void fake_quant(const Tensor& x, const Tensor& out, const NumberGrid& grid, float scale, float post) override {
    cpu::fake_quant(x, out, grid, scale, post);
  }
  void quant_codes_bf16(const Tensor& x, const Tensor& out, const NumberGrid& grid, float scale) override {
    cpu::quant_codes_bf16(x, out, grid, scale);
  }
  void fake_quant_blocks(const Tensor& x, const Tensor& out, const NumberGrid& grid, int64_t block_rows,
                         int64_t block_cols) override {
    cpu::fake_quant_blocks(x, out, grid, block_rows, block_cols);
  }
  void fake_quant_mxfp4(const Tensor& x, const Tensor& out) override { cpu::fake_quant_mxfp4(x, out); }
  void fake_quant_nvfp4(const Tensor& x, const Tensor& out) override { cpu::fake_quant_nvfp4(x, out); }
  void nf4_dequantize(const Tensor& codes, const Tensor& absmax_codes, const Tensor& absmax_steps, const Nf4Spec& spec,
                      int64_t first, const Tensor& out) override {
    cpu::nf4_dequantize(codes, absmax_codes, absmax_steps, spec, first, out);
  }
  void soft_target_loss(const Tensor& logits, const Tensor& teacher, float temperature, float grad_scale, const Tensor& losses,
                        const Tensor& grad) override {
    cpu::soft_target_loss(logits, teacher, temperature, grad_scale, losses, grad);
  }
  void int_linear(const Tensor& x, const Tensor& codes, const Tensor& scales, const Tensor& zeros,
                  const IntWeightSpec& spec, const Tensor* input_scale, const Tensor& y, float beta, const Tensor* bias) override {
    cpu::int_linear(x, codes, scales, zeros, spec, input_scale, y, beta, bias);
  }
  void int_dequantize(const Tensor& codes, const Tensor& scales, const Tensor& zeros, const IntWeightSpec& spec,
                      const Tensor* input_scale, const Tensor& out) override {
    cpu::int_dequantize(codes, scales, zeros, spec, input_scale, out);
  }
  void dropout(const Tensor& x, const Tensor& out, float p, const RoundingDraw& draw) override {
    cpu::dropout(x, out, p, draw);
  }
  void round_bf16(const Tensor& x, bool stochastic, const RoundingDraw& draw) override {
    cpu::round_bf16(x, stochastic, draw);
  }
  void row_norms(const Tensor& x, const Tensor& norms) override { cpu::row_norms(x, norms); }
  void dora_weight(const Tensor& merged, const Tensor& base, const Tensor& magnitude, const Tensor& norms,
                   const Tensor& out) override {
    cpu::dora_weight(merged, base, magnitude, norms, out);
  }
  void dora_backward(const Tensor& grad, const Tensor& merged, const Tensor& magnitude, const Tensor& norms,
                     const Tensor& dmagnitude) override {
    cpu::dora_backward(grad, merged, magnitude, norms, dmagnitude);
  }

 private:
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




  static void check_token_range(const char* op, const Tensor& tokens, int64_t vocab) {
    const int32_t* t = tokens.data<int32_t>();
    for (int64_t i = 0; i < tokens.numel(); ++i) {
      LOOM_CHECK(t[i] >= 0 && t[i] < vocab, op, ": token id ", t[i], " at position ", i, " outside vocab [0, ", vocab,
                 ")");
    }
  }


  void rope(const Tensor& x, int64_t head_dim, int64_t n_heads, const RopeSpec& rope_spec, int64_t pos_offset, double direction,
            const char* op) {
    checks::check_rope(op, x, head_dim, n_heads);
    dispatch_float(x.dtype(), op, kBackend, [&]<typename T>() {
      cpu::rope_rotate(x.data<T>(), x.dim(0), x.dim(1), x.dim(2), head_dim, n_heads, rope_spec,
                       pos_offset, direction);
    });
  }


  static void check_target_range(const char* op, const Tensor& logits, const Tensor& targets) {
    const int32_t* t = targets.data<int32_t>();
    const int64_t vocab = logits.dim(-1);
    for (int64_t i = 0; i < targets.numel(); ++i) {
      LOOM_CHECK((t[i] >= 0 && t[i] < vocab) || t[i] == kIgnoreTarget, op, ": target ", t[i], " at row ", i,
                 " outside vocab [0, ", vocab, ") and not kIgnoreTarget (", kIgnoreTarget, ")");
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
