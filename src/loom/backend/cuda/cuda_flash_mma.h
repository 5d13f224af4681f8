// FlashAttention-2 (Dao 2023) on tensor cores: mma.sync m16n8k16 with bf16 operands and fp32
// accumulation (cuda_mma.h). Same layout and semantics as flash_attention_forward / _backward
// of cuda_kernels.h for float, causal, without a sliding window:
//   qkv (B, T, (H + 2 KV) hd) f32, out (B, T, H hd) f32, lse (B, H, T) f32, dout like out,
//   dqkv like qkv (overwritten). Query head h reads kv head h / (H / KV).
// Numerics: Q, K, V (and dO in the backward) are rounded to bf16 (nearest even) when loaded;
// S = Q K^T accumulates in fp32 and is scaled by 1 / sqrt(hd); the online softmax is fp32; the
// unnormalized P is rounded to bf16 for P V; O accumulates in fp32 and is divided by l at the
// end; lse = m + log(l). The backward recomputes P = exp(S - lse) in fp32 and rounds each MMA
// operand (P, dS, Q, K, V, dO) to bf16, accumulating in fp32; D = rowsum(dO o O) in fp32.
// Deterministic: no atomics; dK/dV and dQ are two separate passes with fixed summation orders.
// head_dim must be 64 or 128; window must be 0. Anything else is refused with one line.
// The _as forms take each tensor in f32 or bf16 (its bits as uint16_t): qkv and dout (In) as
// the producing GEMM wrote them (a bf16 input is read as it is, the same bits as rounding its
// f32 source; D then sums the bf16 dO), out (O) and dqkv (G) rounded to nearest even as they are
// stored. qkv and dout must be 16-byte aligned (the kernels read 16-byte chunks); bf16 inputs
// are causal only.
#pragma once
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace loom::cuda {

// causal = false gives full (bidirectional) attention; the tests use it as the broken variant
// of the causal kernels (a missing mask).
void flash_mma_attention_forward(const float* qkv, float* out, float* lse, int64_t batch, int64_t seq_len,
                                 int64_t n_head, int64_t n_kv_head, int64_t head_dim, int64_t window,
                                 cudaStream_t stream, bool causal = true);

// The same with O in bf16 (out, and the backward's out, as bf16 bits): O rounded to nearest even as
// it is stored, D = rowsum(dO o O) of the bf16 O (as autocast's attention computes it from its
// bf16 output). Causal.
template <typename In, typename O>
void flash_mma_attention_forward_as(const In* qkv, O* out, float* lse, int64_t batch, int64_t seq_len, int64_t n_head,
                                    int64_t n_kv_head, int64_t head_dim, int64_t window, cudaStream_t stream,
                                    bool causal = true);
// Scratch of the backward: D (B, H, T) f32.
size_t flash_mma_attention_backward_scratch_bytes(int64_t batch, int64_t seq_len, int64_t n_head, int64_t n_kv_head,
                                                  int64_t head_dim);
void flash_mma_attention_backward(const float* dout, const float* qkv, const float* out, const float* lse,
                                  float* dqkv, void* scratch, int64_t batch, int64_t seq_len, int64_t n_head,
                                  int64_t n_kv_head, int64_t head_dim, int64_t window, cudaStream_t stream,
                                  bool causal = true);
// The backward with O, dqkv or both in bf16 (bits; O = uint16_t: D from the bf16 O; G = uint16_t:
// dQ, dK, dV rounded to nearest even as they are stored, for a bf16 GEMM that reads them as they
// are). Causal. Instantiated for (uint16_t, float), (float, uint16_t), (uint16_t, uint16_t).
template <typename In, typename O, typename G>
void flash_mma_attention_backward_as(const In* dout, const In* qkv, const O* out, const float* lse, G* dqkv,
                                     void* scratch, int64_t batch, int64_t seq_len, int64_t n_head, int64_t n_kv_head,
                                     int64_t head_dim, int64_t window, cudaStream_t stream, bool causal = true);

}  // namespace loom::cuda
