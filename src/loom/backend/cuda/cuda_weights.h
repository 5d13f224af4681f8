// Launchers of the CUDA backend's DoRA row ops, NF4 dequantization and integer-weight kernels
// (cuda_weights.cu; the ops in cuda_weight_ops.cpp, the contracts in backend.h). Plain device
// pointers and sizes in, work enqueued on `stream`, nothing synchronized; every launcher checks
// its launch (LOOM_CUDA_CHECK_LAUNCH). The callers validate dtypes and shapes first.
#pragma once
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace loom::cuda {

// ---------------------------------------------------------------- DoRA (f32 (rows, cols), per-row vectors)
// norms[j] = f32(sqrt(sum_i x[j, i]^2)), the sum in double in column order.
void row_norms(const float* x, float* norms, int64_t rows, int64_t cols, cudaStream_t stream);
// out[j, i] = g_j merged[j, i] - base[j, i] (base may be null: 0), g_j = magnitude_j / norms_j or 0
// where norms_j = 0. out may alias merged.
void dora_weight(const float* merged, const float* base, const float* magnitude, const float* norms, float* out,
                 int64_t rows, int64_t cols, cudaStream_t stream);
// dmagnitude_j += f32((sum_i grad[j, i] merged[j, i], in double in order) / norms_j) where
// norms_j > 0; then grad[j, i] *= g_j in place.
void dora_backward(float* grad, const float* merged, const float* magnitude, const float* norms, float* dmagnitude,
                   int64_t rows, int64_t cols, cudaStream_t stream);

// ---------------------------------------------------------------- NF4 (QLoRA)
// Elements [first, first + n) of the flat NF4 weight into out (f32, or bf16 bits rounded to
// nearest even when `bf16`). values: the 16 code values.
void nf4_dequantize(const uint8_t* codes, const uint8_t* absmax_codes, const float* absmax_steps,
                    const float* values, float absmax_mean, int64_t first, int64_t n, void* out, bool bf16,
                    cudaStream_t stream);

// ---------------------------------------------------------------- integer weights (precision/int_quant.h)
// A weight's group parameters (rows, cols / group): f32 scales, or f16 ones (their bits;
// BackendCapabilities::compact_int_weights), and u8 zero points, or none: every group's zero point
// is 2^(bits - 1) (a symmetric weight stored compact).
struct IntGroups {
  const void* scales = nullptr;
  bool f16 = false;
  const uint8_t* zeros = nullptr;
};
// W (rows, cols) = s (q - z) per group of `group` columns, times input_scale[c] (when not null).
void int_dequantize(const uint8_t* codes, IntGroups params, int bits, int64_t group, int64_t rows, int64_t cols,
                    const float* input_scale, float* out, cudaStream_t stream);
// y (n, rows) = beta y + x (n, cols) diag(input_scale) @ W^T (+ bias). Weight-only (act_int8
// false): the codes are dequantized in registers and multiplied in f32. act_int8 (bits 8, one
// group per row): each input row quantized to int8 (s_x = max |x| / 127) and the products summed
// exactly in int32. `scratch`: at least int_linear_scratch_bytes(n, act_int8) bytes.
size_t int_linear_scratch_bytes(int64_t n, bool act_int8);
void int_linear(const float* x, const uint8_t* codes, IntGroups params, int bits, int64_t group, int64_t rows,
                int64_t cols, bool act_int8, const float* input_scale, float* y, int64_t n, float beta,
                const float* bias, void* scratch, cudaStream_t stream);

// ---------------------------------------------------------------- bf16 weights used in place
// y (n, rows) = beta y + x (n, cols) @ W^T (+ bias), W bf16 (rows, cols) widened exactly, f32
// products and sums in a fixed order. For decoding's few rows (the weight is read once per 16).
void bf16_weight_linear(const float* x, const uint16_t* w, int64_t rows, int64_t cols, float* y, int64_t n, float beta,
                        const float* bias, cudaStream_t stream);

}  // namespace loom::cuda
