// Launchers of the gradient compression kernels (cuda_compress.cu), called by
// cuda_compress_ops.cpp after it has validated the operands. Plain device pointers and sizes in,
// work enqueued on `stream`, nothing synchronized; every launcher checks its launches
// (LOOM_CUDA_CHECK_LAUNCH). f32 values, i32 indices and codes (passed as uint32 words), as the
// ops of backend.h. Each launcher gives every element the CPU twin's arithmetic
// (cpu/cpu_compress.cpp) in the same order, so the results are the CPU's bytes. No floating-point
// atomics. Launchers that need scratch take `scratch` of at least the matching *_scratch_bytes().
#pragma once
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace loom::cuda {

// Top-K: idx (ascending) and val get the k entries of acc (n) of largest |acc| (ties: the lower
// index), which are then zeroed in acc. iota: n uint32 of the op's own scratch operand.
size_t topk_scratch_bytes(int64_t n, int64_t k);
void topk_extract(float* acc, int64_t n, int32_t* idx, float* val, int64_t k, uint32_t* iota, void* scratch,
                  cudaStream_t stream);

// out (n)[idx[j]] += val[j] for j = 0 .. m - 1 in order. Indices outside [0, n) are skipped and the
// lowest such j is recorded with atomicMin into *bad_position (the caller resets and reads it).
size_t scatter_add_scratch_bytes(int64_t m, int64_t n);
void scatter_add(const int32_t* idx, const float* val, int64_t m, float* out, int64_t n, void* scratch,
                 unsigned long long* bad_position, cudaStream_t stream);
// x (n)[idx[j]] = 0 for every j; bad indices as scatter_add.
void scatter_zero(const int32_t* idx, int64_t m, float* x, int64_t n, unsigned long long* bad_position,
                  cudaStream_t stream);

// DGC: if clip > 0 and ||g|| (in order, in double) > clip, g *= f32(clip / ||g||); u = m u + g; v += u.
size_t dgc_scratch_bytes();
void dgc_accumulate(float* g, float* u, float* v, int64_t n, float momentum, double clip, void* scratch,
                    cudaStream_t stream);

// 1-bit: scale[0] = f32(sum |acc| (in order) / n); bit i of words = acc[i] < 0; acc -= +-scale.
void onebit_encode(float* acc, int64_t n, uint32_t* words, float* scale, cudaStream_t stream);
// out (n)[i] += bit i of words[r] ? -scales[r] : scales[r], r = 0 .. ranks - 1 in order; w words per rank.
void onebit_decode_add(const uint32_t* words, const float* scales, int64_t ranks, int64_t w, float* out, int64_t n,
                       cudaStream_t stream);

// QSGD: norm[0] = f32(||g||, in order); byte i of codes = sign(g_i) (l + [u_i < x - l]), u_i the
// Philox4x32-10 draw of the CPU (counter (offset + 4 (i / 4), stream, draw, 0x9597), key seed).
void qsgd_encode(const float* g, int64_t n, uint32_t* codes, float* norm, int levels, uint64_t seed,
                 uint32_t stream_id, uint32_t draw, int64_t offset, cudaStream_t stream);
// out (n)[i] = fma(norms[r] / levels, byte i of codes[r], out[i]), r in order; w words per rank.
void qsgd_decode_add(const uint32_t* codes, const float* norms, int64_t ranks, int64_t w, int levels, float* out,
                     int64_t n, cudaStream_t stream);

// PowerSGD, m (rows, cols): out (rows, r) = m q (q: cols x r), or with transpose out (cols, r) =
// m^T q (q: rows x r); every entry accumulated in double in index order.
void lowrank_project(const float* m, const float* q, float* out, int64_t rows, int64_t cols, int64_t r,
                     bool transpose, cudaStream_t stream);
// p (rows, r): modified Gram-Schmidt in double, twice (one block; scratch: rows r doubles).
size_t orthonormalize_scratch_bytes(int64_t rows, int64_t r);
void orthonormalize_columns(float* p, int64_t rows, int64_t r, void* scratch, cudaStream_t stream);
// out (rows, cols) = alpha f32(p q^T) + beta out (beta = 0: overwritten); p (rows, r), q (cols, r).
void lowrank_expand(const float* p, const float* q, float* out, int64_t rows, int64_t cols, int64_t r, float alpha,
                    float beta, cudaStream_t stream);

}  // namespace loom::cuda
