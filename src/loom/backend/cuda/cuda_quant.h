// Launchers of the CUDA backend's low-precision kernels (cuda_quant.cu): the quantizers of the
// fp16 / fp8 / MXFP4 / NVFP4 recipes and QAT, bf16 rounding (nearest and stochastic), dropout and
// the bf16 attention. Plain device pointers and sizes in, work enqueued on `stream`, nothing
// synchronized; the backend (cuda_quant_ops.cpp) validates the operands first. Semantics are
// exactly backend.h's and the CPU kernels' (cpu/cpu_quant_ops.cpp, cpu/cpu_kernels.h), bit for
// bit for every op but the attention (whose GEMMs sum in cuBLAS's order). Every launcher checks
// its launches (LOOM_CUDA_CHECK_LAUNCH).
#pragma once
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "loom/backend/cuda/cuda_blas.h"  // cublasHandle_t

namespace loom::cuda {

// backend.h's NumberGrid, as the kernels take it (overflow's bits are copied as they are).
struct QuantGrid {
  int man_bits;
  int emin;
  float max;
  float overflow;
};

// The three uint32 words every kernel below that draws from Philox4x32-10 needs (backend.h's
// RoundingDraw): key (seed lo, seed hi), counter words 2 and 3 (stream, draw).
struct PhiloxDraw {
  uint32_t key0, key1, stream, draw;
};

// *result (device, one uint32) = the bits of max |x[i]| over n elements: the largest magnitude's
// bits, or a NaN's (> 0x7F800000) if any x is NaN; 0 for n = 0.
void amax_bits(const float* x, int64_t n, uint32_t* result, cudaStream_t stream);

// out[i] = Q_g(x[i] * scale) * post; out may alias x.
void fake_quant(const float* x, float* out, int64_t n, const QuantGrid& grid, float scale, float post,
                cudaStream_t stream);
// out[i] = the upper half of Q_g(x[i] * scale)'s f32 bits (bf16 bits).
void quant_codes_bf16(const float* x, uint16_t* out, int64_t n, const QuantGrid& grid, float scale,
                      cudaStream_t stream);
// DeepSeek-V3 block scaling over x (rows, cols) in block_rows x block_cols blocks.
void fake_quant_blocks(const float* x, float* out, int64_t rows, int64_t cols, int64_t block_rows,
                       int64_t block_cols, const QuantGrid& grid, cudaStream_t stream);
// MXFP4 along the rows of x (rows, cols), runs of 32.
void fake_quant_mxfp4(const float* x, float* out, int64_t rows, int64_t cols, cudaStream_t stream);
// NVFP4 along the rows of x (rows, cols), runs of 16; `scratch` holds 4 bytes (the tensor's amax).
void fake_quant_nvfp4(const float* x, float* out, int64_t rows, int64_t cols, void* scratch, cudaStream_t stream);

// In place: x[i] to bf16 (as f32), to nearest even, or stochastically with `draw`.
void round_bf16(float* x, int64_t n, bool stochastic, const PhiloxDraw& draw, cudaStream_t stream);
// Inverted dropout: out[i] = x[i] * keep where word i % 4 of Philox(i / 4) >= threshold, else 0.
// out may alias x.
void dropout(const float* x, float* out, int64_t n, uint64_t threshold, float keep, const PhiloxDraw& draw,
             cudaStream_t stream);

// bf16 attention (backend.h attention_forward_bf16 / _backward_bf16): causal, GQA, no window;
// qkv (B, T, (H + 2 KV) hd), out and dout (B, T, H hd), probs (B, H, T, T) f32. The GEMM operands
// are bf16 copies (cuBLAS GemmStridedBatchedEx, CUDA_R_16BF in, f32 out, CUBLAS_COMPUTE_32F);
// `cublas` is bound to `stream`. Scratch: at least the matching *_scratch_bytes.
size_t attention_bf16_forward_scratch_bytes(int64_t batch, int64_t seq_len, int64_t n_head, int64_t n_kv_head,
                                            int64_t head_dim);
size_t attention_bf16_backward_scratch_bytes(int64_t batch, int64_t seq_len, int64_t n_head, int64_t n_kv_head,
                                             int64_t head_dim);
void attention_forward_bf16(cublasHandle_t cublas, const float* qkv, float* out, float* probs, void* scratch,
                            int64_t batch, int64_t seq_len, int64_t n_head, int64_t n_kv_head, int64_t head_dim,
                            cudaStream_t stream);
void attention_backward_bf16(cublasHandle_t cublas, const float* dout, const float* qkv, const float* out,
                             const float* probs, float* dqkv, void* scratch, int64_t batch, int64_t seq_len,
                             int64_t n_head, int64_t n_kv_head, int64_t head_dim, cudaStream_t stream);

}  // namespace loom::cuda
