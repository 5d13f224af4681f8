// The CUDA backend's kernel launchers: plain device pointers and sizes in, work enqueued on
// `stream`, nothing synchronized. The backend (cuda_backend.cpp) validates shapes and dtypes
// with the same checks as the CPU backend, then calls these. Semantics are exactly those of
// backend.h and of the CPU kernels (cpu/cpu_kernels.h); T is float or double (double for the
// reference checks of the op tests). Every launcher checks its launch (LOOM_CUDA_CHECK_LAUNCH).
//
// Determinism: no launcher uses floating-point atomics. Accumulations (+=) into parameter
// gradients reduce per-block partials in a fixed order, so two runs are bitwise equal.
// Launchers that need scratch take `scratch` of at least the matching *_scratch_bytes().
#pragma once
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "loom/backend/cuda/cuda_blas.h"  // cublasHandle_t
#include "loom/backend/activation.h"
#include "loom/backend/rope.h"

namespace loom::cuda {

// ---------------------------------------------------------------- elementwise (cuda_kernels.cu)
template <typename T>
void fill(T* x, int64_t n, double value, cudaStream_t stream);
// Round to nearest even (f32 -> bf16; NaN stays NaN), exact widening (bf16 -> f32), f32 <-> f64.
void cast_f32_to_bf16(const float* src, uint16_t* dst, int64_t n, cudaStream_t stream);
void cast_bf16_to_f32(const uint16_t* src, float* dst, int64_t n, cudaStream_t stream);
void cast_f32_to_f64(const float* src, double* dst, int64_t n, cudaStream_t stream);
void cast_f64_to_f32(const double* src, float* dst, int64_t n, cudaStream_t stream);
template <typename T>
void add(const T* a, const T* b, T* out, int64_t n, cudaStream_t stream);  // out may alias a or b
template <typename T>
void scale(T* x, int64_t n, double factor, cudaStream_t stream);

// Sum of x (squares = false) or x^2 (squares = true) in double: writes kReducePartials partial
// sums to `partials` (device); the caller copies them back and adds them in index order, so the
// result is the same on every run. Each partial is a fixed-order reduction.
constexpr int kReducePartials = 256;
template <typename T>
void reduce_partials(const T* x, int64_t n, bool squares, double* partials, cudaStream_t stream);

// c (rows, cols) += bias (cols) on every row.
template <typename T>
void add_bias_rows(T* c, const T* bias, int64_t rows, int64_t cols, cudaStream_t stream);
// out (rows, cols) = acc + bias16 (widened; may be null) on every row, rounded to bf16 bits as
// cast_f32_to_bf16: a bf16 GEMM output from its fp32 product (Backend::gemm with a bf16 C).
void round_rows_bf16(const float* acc, const uint16_t* bias16, uint16_t* out, int64_t rows, int64_t cols,
                     cudaStream_t stream);
// acc (cols) += column sums of x (rows, cols), deterministic.
size_t column_sums_scratch_bytes(int64_t rows, int64_t cols, size_t elem_bytes);
template <typename T>
void column_sums_accumulate(const T* x, int64_t rows, int64_t cols, T* acc, void* scratch, cudaStream_t stream);
// The same over bf16 x (bits), widened exactly, summed in f32 in the same order; the same scratch.
void column_sums_accumulate_bf16(const uint16_t* x, int64_t rows, int64_t cols, float* acc, void* scratch,
                                 cudaStream_t stream);

// ---------------------------------------------------------------- embedding
// Ids outside [0, vocab) are not read or written: the launcher records the lowest such position
// with atomicMin into *bad_position (the caller sets it to INT64_MAX before, reads it after).
// out (n_tokens, C) = table[tokens] (+ positions[t], t = i % seq_len).
template <typename T>
void embedding_forward(const int32_t* tokens, const T* table, const T* positions, T* out, int64_t n_tokens,
                       int64_t seq_len, int64_t channels, int64_t vocab, unsigned long long* bad_position,
                       cudaStream_t stream);
// The same from a bf16 table (raw bits), widened exactly into f32.
void embedding_forward_bf16(const int32_t* tokens, const uint16_t* table, const float* positions, float* out,
                            int64_t n_tokens, int64_t seq_len, int64_t channels, int64_t vocab,
                            unsigned long long* bad_position, cudaStream_t stream);
// dtable[tokens[i]] += dout[i]; dpositions[i % seq_len] += dout[i] (when not null). Deterministic.
size_t embedding_backward_scratch_bytes(int64_t n_tokens, int64_t seq_len, int64_t channels, int64_t vocab,
                                        size_t elem_bytes);
template <typename T>
void embedding_backward(const int32_t* tokens, const T* dout, T* dtable, T* dpositions, int64_t n_tokens,
                        int64_t seq_len, int64_t channels, int64_t vocab, void* scratch,
                        unsigned long long* bad_position, cudaStream_t stream);

// ---------------------------------------------------------------- norms (rows, C)
// The forward ops' out is T, or bf16 bits (O = uint16_t, T = float): the output rounded to nearest
// even as cast_f32_to_bf16 rounds it, so the same bits as the f32 op followed by the cast.
template <typename T, typename O>
void layernorm_forward(const T* x, const T* w, const T* b, O* out, T* mean, T* rstd, int64_t rows, int64_t channels,
                       double eps, cudaStream_t stream);
size_t norm_backward_scratch_bytes(int64_t rows, int64_t channels, size_t elem_bytes);
// dx overwritten (or accumulated: dx + the input gradient, bitwise a separate add); dw, db accumulated (+=).
// dx16: null, or (T = float) dx's values rounded to bf16 bits as cast_f32_to_bf16, in the same store.
template <typename T>
void layernorm_backward(const T* dout, const T* x, const T* w, const T* mean, const T* rstd, T* dx, uint16_t* dx16,
                        T* dw, T* db, int64_t rows, int64_t channels, void* scratch, bool accumulate,
                        cudaStream_t stream);
template <typename T, typename O>
void rmsnorm_forward(const T* x, const T* w, O* out, T* rstd, int64_t rows, int64_t channels, double eps,
                     cudaStream_t stream);
template <typename T>
void rmsnorm_backward(const T* dout, const T* x, const T* w, const T* rstd, T* dx, uint16_t* dx16, T* dw, int64_t rows,
                      int64_t channels, void* scratch, bool accumulate, cudaStream_t stream);

// ---------------------------------------------------------------- activations
// x may be bf16 bits (S = uint16_t, T = float: a bf16 GEMM output), each element widened exactly.
template <typename T, typename O, typename S = T>
void gelu_forward(const S* x, O* out, int64_t n, cudaStream_t stream);
template <typename T, typename O, typename S = T>
void gelu_backward(const S* x, const T* dout, O* dx, int64_t n, cudaStream_t stream);
// x (rows, 2F) = [gate | up]; out (rows, F) = act(gate) * up. The backwards' dx may be bf16 bits
// (O = uint16_t, T = float), rounded as the forwards' out; x bf16 bits as above.
template <typename T, typename O, typename S = T>
void glu_forward(const S* x, O* out, int64_t rows, int64_t hidden, GateActivation act, cudaStream_t stream);
template <typename T, typename O, typename S = T>
void glu_backward(const S* x, const T* dout, O* dx, int64_t rows, int64_t hidden, GateActivation act,
                  cudaStream_t stream);
// In place on x (batch, seq_len, width), the first n_heads * head_dim columns; direction +1
// forward, -1 backward (the inverse rotation). Angles computed in double as on the CPU.
template <typename T>
void rope_rotate(T* x, int64_t batch, int64_t seq_len, int64_t width, int64_t head_dim, int64_t n_heads, const RopeSpec& rope,
                 int64_t pos_offset, double direction, cudaStream_t stream);
// Decoding's rows (Backend::rope_rows_forward): row r of x (rows.n, width) rotated forward at
// position rows.pos[r], bitwise rope_rotate's (batch 1, seq_len 1, pos_offset rows.pos[r]); `rope`
// already holds the rows' span (longrope: rows of one span per call). One launch for up to
// kRopeRows rows, their positions in the kernel's parameters (no copy).
constexpr int kRopeRows = 64;
struct RopeRows {
  int64_t n = 0;
  int64_t pos[kRopeRows] = {};
};
template <typename T>
void rope_rows(T* x, const RopeRows& rows, int64_t width, int64_t head_dim, int64_t n_heads, const RopeSpec& rope,
               cudaStream_t stream);

// ---------------------------------------------------------------- optimizer
// AdamW with the CPU kernel's exact formula; bias1 = 1 - beta1^t, bias2 = 1 - beta2^t.
template <typename T>
void adamw_step(T* p, const T* grad, T* m, T* v, int64_t n, double lr, double beta1, double beta2, double eps,
                double weight_decay, double grad_scale, double bias1, double bias2, cudaStream_t stream);

// ---------------------------------------------------------------- attention (cuda_attention.cu)
// Causal attention with grouped KV heads and an optional sliding window, exactly backend.h's
// attention_forward / attention_backward: qkv (B, T, (H + 2KV) hd), out (B, T, H hd),
// probs (B, H, T, T) saved (0 above the diagonal and outside the window). `cublas` is a handle
// bound to `stream`.
size_t attention_backward_scratch_bytes(int64_t batch, int64_t seq_len, int64_t n_head, int64_t head_dim,
                                        size_t elem_bytes);
template <typename T>
void attention_forward(cublasHandle_t cublas, const T* qkv, T* out, T* probs, int64_t batch, int64_t seq_len,
                       int64_t n_head, int64_t n_kv_head, int64_t head_dim, int64_t window, cudaStream_t stream);
template <typename T>
void attention_backward(cublasHandle_t cublas, const T* dout, const T* qkv, const T* out, const T* probs, T* dqkv,
                        void* scratch, int64_t batch, int64_t seq_len, int64_t n_head, int64_t n_kv_head,
                        int64_t head_dim, int64_t window, cudaStream_t stream);

// FlashAttention-2 (Dao 2023): the same attention without storing probabilities. Forward keeps
// lse (B, H, T) = log-sum-exp of each query row's scaled scores; backward recomputes P from it
// and uses D_i = dO_i . O_i. O(T) extra memory. dqkv overwritten.
size_t flash_attention_backward_scratch_bytes(int64_t batch, int64_t seq_len, int64_t n_head, int64_t n_kv_head,
                                              int64_t head_dim, size_t elem_bytes);
template <typename T>
void flash_attention_forward(const T* qkv, T* out, T* lse, int64_t batch, int64_t seq_len, int64_t n_head,
                             int64_t n_kv_head, int64_t head_dim, int64_t window, cudaStream_t stream);
template <typename T>
void flash_attention_backward(const T* dout, const T* qkv, const T* out, const T* lse, T* dqkv, void* scratch,
                              int64_t batch, int64_t seq_len, int64_t n_head, int64_t n_kv_head, int64_t head_dim,
                              int64_t window, cudaStream_t stream);

// Attention sinks (backend.h attention_sink_forward / _backward) on flash attention's out (B, T,
// H hd) and lse (B, H, T): the forward scales each row by g = sigmoid(lse - s_h); the backward
// turns dout into g dout and adds -sum over rows (1 - g) dO.O to dsinks (H), the rows' partials
// in `scratch` (attention_sink_backward_scratch_bytes) summed per head in a fixed order.
size_t attention_sink_backward_scratch_bytes(int64_t batch, int64_t seq_len, int64_t n_head, size_t elem_bytes);
template <typename T>
void attention_sink_forward(T* out, const T* lse, const T* sinks, int64_t batch, int64_t seq_len, int64_t n_head,
                            int64_t head_dim, cudaStream_t stream);
template <typename T>
void attention_sink_backward(T* dout, const T* out, const T* lse, const T* sinks, T* dsinks, void* scratch,
                             int64_t batch, int64_t seq_len, int64_t n_head, int64_t head_dim, cudaStream_t stream);

}  // namespace loom::cuda
