// The CPU backend's attention ops (the class is cpu_backend_internal.h's): the reference
// attention of cpu_kernels.h, its windowed and bf16 forms, and FlashAttention-2 (cpu_flash.h),
// with their scratch from the backend's workspace.
#include "loom/backend/checks.h"
#include "loom/backend/cpu/cpu_backend_internal.h"
#include "loom/backend/cpu/cpu_flash.h"
#include "loom/backend/cpu/cpu_kernels.h"

namespace loom::cpu_backend_detail {

void CpuBackend::attention_forward(const Tensor& qkv, const Tensor& out, const Tensor& probs, int64_t n_head,
                                   int64_t n_kv_head, int64_t window) {
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

void CpuBackend::attention_backward(const Tensor& dout, const Tensor& qkv, const Tensor& out, const Tensor& probs,
                                    const Tensor& dqkv, int64_t n_head, int64_t n_kv_head, int64_t window) {
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

void CpuBackend::attention_forward_bf16(const Tensor& qkv, const Tensor& out, const Tensor& probs, int64_t n_head,
                                        int64_t n_kv_head) {
  const char* op = "attention_forward_bf16";
  const auto [batch, seq_len, head_dim] = check_attention(op, qkv, out, probs, n_head, n_kv_head, 0, false);
  expect_dtype(qkv, DTYPE_F32, op, "qkv");
  const Tensor scratch = workspace(omp_get_max_threads() * cpu::attention_bf16_scratch(seq_len, head_dim), DTYPE_F32);
  cpu::attention_forward_bf16(qkv.data<float>(), out.data<float>(), probs.data<float>(), scratch.data<float>(), batch,
                              seq_len, n_head, n_kv_head, head_dim);
}

void CpuBackend::attention_backward_bf16(const Tensor& dout, const Tensor& qkv, const Tensor& out, const Tensor& probs,
                                         const Tensor& dqkv, int64_t n_head, int64_t n_kv_head) {
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
void CpuBackend::flash_attention_forward(const Tensor& qkv, const Tensor& out, const Tensor& lse, int64_t n_head,
                                         int64_t n_kv_head, int64_t window) {
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

void CpuBackend::flash_attention_backward(const Tensor& dout, const Tensor& qkv, const Tensor& out, const Tensor& lse,
                                          const Tensor& dqkv, int64_t n_head, int64_t n_kv_head, int64_t window) {
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

// Scratch of at least `count` elements of `dtype`, kept and grown across calls, so
// steady-state steps allocate nothing. Accounted as workspace.
Tensor CpuBackend::workspace(int64_t count, DType dtype) {
  if (!workspace_.defined() || workspace_.dtype() != dtype || workspace_.numel() < count) {
    workspace_ = Tensor();  // release first: peak memory is the larger buffer, not both
    workspace_ = Tensor::empty(allocator_, {count}, dtype, MEM_WORKSPACE);
  }
  return workspace_;
}

}  // namespace loom::cpu_backend_detail
