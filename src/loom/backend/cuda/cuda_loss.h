// The cross-entropy kernels of the CUDA backend (cuda_loss.cu): the loss, its gradient, and both
// in one pass over the logits (Backend::cross_entropy_loss_and_grad).
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

namespace loom::cuda {

// Targets outside [0, vocab) are recorded like embedding ids (lowest row) and their row skipped.
template <typename T>
void cross_entropy_forward(const T* logits, const int32_t* targets, T* losses, T* lse, int64_t rows, int64_t vocab,
                           unsigned long long* bad_row, cudaStream_t stream);
// dlogits may alias logits.
template <typename T>
void cross_entropy_backward(const T* logits, const int32_t* targets, const T* lse, double dloss, T* dlogits,
                            int64_t rows, int64_t vocab, cudaStream_t stream);
// The forward and the backward in one kernel, bitwise theirs: losses and lse as the forward,
// dlogits as the backward with dloss (D = T: dlogits may alias logits), or that gradient rounded to
// bf16 bits as cast_f32_to_bf16 rounds it (D = uint16_t, T = float). L is the logits' storage: T,
// or bf16 bits (L = D = uint16_t, T = float: each logit widened exactly, the rounded gradient
// written in place). A bad target's row: as the forward records it, with a zero gradient.
template <typename T, typename L, typename D>
void cross_entropy_loss_and_grad(const L* logits, const int32_t* targets, T* losses, T* lse, double dloss,
                                 D* dlogits, int64_t rows, int64_t vocab, unsigned long long* bad_row,
                                 cudaStream_t stream);

// The same on logits kept by columns (vocab, cols) (Backend::cross_entropy_loss_and_grad_columns):
// within the row kernel's tolerance (another summation order), deterministic.
template <typename T, typename L, typename D>
void cross_entropy_loss_and_grad_columns(const L* logits, const int32_t* targets, T* losses, T* lse, double dloss,
                                         D* dlogits, int64_t cols, int64_t vocab, unsigned long long* bad_col,
                                         cudaStream_t stream);

}  // namespace loom::cuda
