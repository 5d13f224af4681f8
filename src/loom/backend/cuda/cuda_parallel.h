// Launchers of the CUDA backend's model-parallel ops and per-head RMSNorm (cuda_parallel.cu):
// plain device pointers and sizes in, work enqueued on `stream`, nothing synchronized. The op
// file (cuda_parallel_ops.cpp) validates the operands first; the semantics are those of
// backend.h and of the CPU twins (cpu/cpu_parallel_ops.cpp, cpu/cpu_kernels.h head_rmsnorm_*).
// T is float or double where the CPU dispatches on the dtype, float where it takes f32 only.
// No launcher uses floating-point atomics: every accumulation has one writer per element and a
// fixed order, so two runs are bitwise equal.
#pragma once
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace loom::cuda {

// ---------------------------------------------------------------- vocabulary-parallel ends
// out (n, C) = weight[tok - begin] for tok - begin in [0, valid), else 0.
void vocab_embedding_forward(const int32_t* tokens, const float* weight, float* out, int64_t n, int64_t channels,
                             int64_t begin, int64_t valid, cudaStream_t stream);
// dweight[tok - begin] += dout's row for tok - begin in [0, valid); through embedding_backward's
// sort (cuda_kernels.h), so each row's sum has one writer and a fixed order.
size_t vocab_embedding_backward_scratch_bytes(int64_t n, int64_t channels, int64_t valid);
void vocab_embedding_backward(const int32_t* tokens, const float* dout, float* dweight, int64_t n, int64_t channels,
                              int64_t begin, int64_t valid, void* scratch, cudaStream_t stream);
// out (B, T, C) += positions rows [first, first + T) (positions already offset by first rows).
void add_positions(float* out, const float* positions, int64_t batch, int64_t seq_len, int64_t channels,
                   cudaStream_t stream);
// dpositions rows (offset by first) += dout summed over b = 0, 1, ... in order (the CPU's bits).
void positions_backward(const float* dout, float* dpositions, int64_t batch, int64_t seq_len, int64_t channels,
                        cudaStream_t stream);
// Per row of logits (rows, V): max of the first `valid`, and the logit of targets[r] - begin (0 outside).
void vocab_ce_partials(const float* logits, const int32_t* targets, float* max, float* target, int64_t rows, int64_t V,
                       int64_t begin, int64_t valid, cudaStream_t stream);
// sums[r] = sum_{v < valid} exp(logits[r, v] - max[r]) in f32 (a fixed tree per row).
void vocab_ce_sums(const float* logits, const float* max, float* sums, int64_t rows, int64_t V, int64_t valid,
                   cudaStream_t stream);
// lse = max + log(sums); losses = lse - target, 0 for kIgnoreTarget rows. In place.
void vocab_ce_finish(const int32_t* targets, float* lse, const float* sums, float* losses, int64_t rows,
                     cudaStream_t stream);
// dlogits = scale (exp(logits - lse) - onehot) over valid columns, 0 elsewhere; may alias logits.
void vocab_ce_backward(const float* logits, const int32_t* targets, const float* lse, float* dlogits, int64_t rows,
                       int64_t V, int64_t begin, int64_t valid, float scale, cudaStream_t stream);

// ---------------------------------------------------------------- ring attention
// One local shard: q (B, Tl, H hd), k / v (B, Tl, KV hd), per-row stats (B, H, Tl); the zig-zag
// layout of nn/context_parallel.h (rank, world) with the K/V block of `owner`. hd <= kRingMaxHeadDim.
struct RingShape {
  int64_t B = 0, Tl = 0, H = 0, KV = 0, hd = 0;
  int rank = 0, world = 1, owner = 0;
};
constexpr int64_t kRingMaxHeadDim = 256;  // 8 accumulators per lane of a warp

template <typename T>
void ring_attention_merge(const T* q, const T* k, const T* v, T* out, T* m, T* l, const RingShape& s,
                          cudaStream_t stream);
template <typename T>
void ring_attention_finish(T* out, T* lse, const T* l, int64_t B, int64_t Tl, int64_t H, int64_t hd,
                           cudaStream_t stream);
template <typename T>
void attention_row_dot(const T* dout, const T* out, T* D, int64_t B, int64_t Tl, int64_t H, int64_t hd,
                       cudaStream_t stream);
// dq += (one warp per query row); dk, dv += (one warp per key row). No scratch.
template <typename T>
void ring_attention_block_backward(const T* q, const T* dout, const T* lse, const T* D, const T* k, const T* v, T* dq,
                                   T* dk, T* dv, const RingShape& s, cudaStream_t stream);

// ---------------------------------------------------------------- copy_block
// rows x row_bytes bytes: row i from src + i src_stride_bytes to dst + i dst_stride_bytes (the
// pointers already at the block's first element), in the widest word (16, 8, 4, 2 or 1 bytes)
// that divides every pointer, stride and row length.
void copy_block(const void* src, void* dst, int64_t rows, int64_t row_bytes, int64_t src_stride_bytes,
                int64_t dst_stride_bytes, cudaStream_t stream);

// ---------------------------------------------------------------- per-head RMSNorm
// Row r = (token r / n, head first + r % n) of x (tokens, width), hd wide: in[r] = the row,
// rstd[r] = 1 / sqrt(mean(row^2) + eps), row = row rstd w (in place).
template <typename T>
void head_rmsnorm_forward(T* x, const T* w, T* in, T* rstd, int64_t tokens, int64_t width, int64_t first, int64_t n,
                          int64_t hd, double eps, cudaStream_t stream);
// dw += sum_r d(out)_r in_r rstd_r (fixed-order column sums), then d(out) -> d(in) in place.
size_t head_rmsnorm_backward_scratch_bytes(int64_t tokens, int64_t n, int64_t hd, size_t elem_bytes);
template <typename T>
void head_rmsnorm_backward(T* dx, const T* in, const T* w, const T* rstd, T* dw, int64_t tokens, int64_t width,
                           int64_t first, int64_t n, int64_t hd, void* scratch, cudaStream_t stream);

}  // namespace loom::cuda
