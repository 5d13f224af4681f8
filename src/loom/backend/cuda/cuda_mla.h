// Launchers of the multi-head latent attention kernels (cuda_mla.cu): plain device pointers and
// sizes in, work enqueued on `stream` (cuBLAS through `cublas`, a handle bound to `stream`),
// nothing synchronized. The op file (cuda_mla_ops.cpp) validates the operands with the CPU's
// checks; the semantics are backend.h's mla_* and the CPU's (cpu/cpu_mla_ops.cpp). f32 only.
#pragma once
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "loom/backend/cuda/cuda_blas.h"  // cublasHandle_t
#include "loom/backend/rope.h"

namespace loom::cuda {

// One attention call: B sequences of T, H heads of d_n + d_r query/key and d_v value dims, the
// sliding window (0: full causal) and the scores' scale (score_scale / sqrt(d_n + d_r), in f32
// as the CPU computes it).
struct MlaShape {
  int64_t B = 0, T = 0, H = 1, dn = 0, dr = 0, dv = 1, window = 0;
  float scale = 1.0f;
};

// In place on x (rows, width), rows = B T (t = row % seq_len): the `heads` slices at
// offset + h stride, rope_dim wide, rotate-half RoPE by direction (pos_offset + t) inv_freq(j).
void mla_rope(float* x, int64_t rows, int64_t seq_len, int64_t width, int64_t heads, int64_t stride, int64_t offset,
              int64_t rope_dim, const RopeSpec& rope, int64_t pos_offset, double direction, cudaStream_t stream);

// probs (B, H, T, T) and out (B, T, H d_v) overwritten.
void mla_attention_forward(cublasHandle_t cublas, const float* q, const float* kr, const float* kv, float* probs,
                           float* out, const MlaShape& s, cudaStream_t stream);

// dq, dkv, dkr accumulate. Scratch: mla_attention_backward_scratch_bytes (one sequence's dS).
size_t mla_attention_backward_scratch_bytes(const MlaShape& s);
void mla_attention_backward(cublasHandle_t cublas, const float* q, const float* kr, const float* kv,
                            const float* probs, const float* dout, float* dq, float* dkv, float* dkr, void* scratch,
                            const MlaShape& s, cudaStream_t stream);

// Decoding over `count` cached latents (count, d_c + d_r); out (H d_v) overwritten. Scratch:
// mla_attend_latents_scratch_bytes.
size_t mla_attend_latents_scratch_bytes(int64_t heads, int64_t latent, int64_t count);
void mla_attend_latents(const float* q, const float* latents, const float* kv_b, float* out, int64_t heads,
                        int64_t nope, int64_t rope, int64_t v, int64_t latent, int64_t count, float scale,
                        void* scratch, cudaStream_t stream);

}  // namespace loom::cuda
