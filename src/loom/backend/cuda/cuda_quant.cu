// CUDA kernels of the low-precision ops (launchers in cuda_quant.h; contracts in backend.h; CPU
// twins in cpu/cpu_quant_ops.cpp and, for the bf16 attention, cpu/cpu_kernels.h). Every op but
// the attention is bitwise the CPU's: the same float operations in the same order per element,
// the same NaN bits (see "NaN bits" below), and maxima, which do not depend on the order.
//
// Math (Q_g(v): v rounded to nearest even onto grid g, round_grid below, the CPU's formula:
// e = clamp(exponent(v), emin, 127), rint(|v| 2^(m - e)) 2^(e - m), above max -> overflow, sign kept):
//   amax             max |x_i| (its bits: the max of (bits & 0x7FFFFFFF) as integers, which is the
//                    largest magnitude, or a NaN's bits when any x is NaN)
//   fake_quant       out = Q_g(x scale) post
//   quant_codes_bf16 out = upper 16 bits of Q_g(x scale)
//   fake_quant_blocks s = max(amax_block, 1e-4) / g.max; out = Q_g(x / s) s   (block_rows x block_cols)
//   fake_quant_mxfp4 per 32 along a row: X = 2^clamp(floor(log2 amax) - 2, -127, 127) (2^-127 for a
//                    zero block); out = Q_E2M1(x / X) X; a block holding inf or NaN -> NaN
//   fake_quant_nvfp4 s = amax / 2688 (1 for a zero tensor); per 16 along a row:
//                    S = Q_E4M3((amax_block / 6) / s) s; out = S == 0 ? 0 : Q_E2M1(x / S) S;
//                    a tensor holding inf or NaN -> NaN everywhere
//   round_bf16       nearest: f32_to_bf16 (u + 0x7FFF + lsb, truncated; NaN quieted);
//                    stochastic: u + (philox word >> 16), truncated; inf and NaN stay
//   dropout          out = word >= floor(p 2^32) ? x / (1 - p) : 0
//   Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC'11): element i
//   uses word i % 4 of philox(counter = (i/4 lo, i/4 hi, stream, draw), key = (seed lo, seed hi)),
//   core/philox.h's, through cuda_philox.h (its device twin).
//   bf16 attention   qkv, dout rounded to bf16 into head-major copies; S = scale Qb Kb^T (cuBLAS, f32);
//                    P = causal softmax(S) in f32 (scalar_math's exp, as the CPU), saved, and
//                    rounded to Pb; O = Pb Vb. Backward: dP = dOb Vb^T; D_i = dO_i . O_i (f32);
//                    dS = scale P (dP - D) rounded to dSb; dQ = dSb Kb; dK = sum_h dSb^T Qb;
//                    dV = sum_h Pb^T dOb (the group's heads in order, beta 0 then 1).
//
// Roofline (per element unless said; H100 SXM: 3.35 TB/s, 989 TFLOP/s bf16 dense), launch shapes:
//   amax             4 B read, 1 integer max; min(n/1024, 1024) blocks x 256, float4 loads, one
//                    integer atomicMax per block (order-free: max is exact) -> 4 bytes
//   fake_quant       8 B (read + write), ~6 FLOPs (mul, rint, 2 mul, compare, mul)
//   quant_codes_bf16 6 B, ~5 FLOPs
//   round_bf16       8 B, a few integer ops; stochastic: + one Philox4x32-10 (10 rounds of 2
//                    32x32->64 multiplies and 4 xors) per 4 elements, ~20 integer ops per element
//   dropout          8 B, Philox as above, 1 FLOP
//     (the elementwise kernels: one thread per group of 4 elements, float4 loads and stores when
//      the pointers are 16-byte aligned, 256 threads, at most 8192 blocks, grid-stride)
//   fake_quant_blocks 8 B from DRAM (the second read of x in the same block hits L1 / L2), ~8 FLOPs;
//                    one 256-thread block per tile of whole quant blocks (a tile is 256 / block_cols
//                    quant blocks side by side, or one wider quant block), one thread per column:
//                    every row of the tile is read coalesced
//   fake_quant_mxfp4 8 B, ~8 FLOPs; one warp per block of 32 (coalesced 128-byte rows), shuffle max
//   fake_quant_nvfp4 12 B (the amax pass, then read + write), ~10 FLOPs; a half-warp per block of 16
//   attention fwd    per (b, h): 4 T^2 hd FLOPs on tensor cores (S and O over the full T x T, the
//                    upper triangle included); per T^2 element ~16 B (S written 4, softmax reads 4,
//                    writes P 4 and Pb 2, O's GEMM reads Pb 2): memory-bound (hd / 4 FLOP/B), the
//                    floor being probs' own 4 B; per qkv element 4 B read + 2 B copy
//   attention bwd    per (b, h): 8 T^2 hd FLOPs (dP, dQ, dK, dV); per T^2 element ~22 B (dP 4 + 4,
//                    probs 4, dSb 2 + 4, Pb 2 + 2)
//     (row kernels: one warp per row of T, 8 rows per block; the softmax keeps its row in registers
//      for T <= 1024)
//
// NaN bits. The CPU is x86, where an arithmetic result with a NaN operand is that NaN quieted and
// an invalid operation (0 inf, inf / inf) gives the default NaN 0xFFC00000; a GPU returns its
// canonical 0x7FFFFFFF instead. The tests compare the CPU's bits, so every multiply and divide
// that may see a NaN goes through mul_x86 / div_x86, and rint of a NaN keeps it.
//
// Determinism: no floating-point atomics; the only atomic is amax's integer max. The attention's
// sums are each inside one cuBLAS call or a fixed shuffle tree; the group sums of dK and dV run
// in the order h = g G, g G + 1, ... as on the CPU.
#include "loom/backend/cuda/cuda_device.h"  // first: the portability layer (docs/accelerators.md)
#include "loom/backend/cuda/cuda_quant.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>

#include "loom/backend/cuda/cuda_blas.h"
#include "loom/backend/cuda/cuda_check.h"
#include "loom/backend/cuda/cuda_launch.h"
#include "loom/backend/cuda/cuda_philox.h"
#include "loom/backend/scalar_math.h"
#include "loom/core/error.h"

namespace loom::cuda {
namespace {

// ---------------------------------------------------------------- launch shapes
// (kWarp, kMaxBlocks, grid_for, thread_index / thread_count, warp_sum / warp_max, shfl_xor,
// all_of: cuda_device.h; the GEMMs: cuda_blas.h)
constexpr int kBlock = 256;
constexpr int64_t kAmaxMaxBlocks = 1024;  // an H100 holds ~1056 resident blocks of 256
constexpr int kRowWarps = kBlock / kWarp;

bool aligned(const void* p, uintptr_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

// ---------------------------------------------------------------- float bits, x86 NaNs
constexpr uint32_t kDefaultNan = 0x7FC00000u;  // the NAN macro's bits, which the CPU kernels store
constexpr uint32_t kX86Invalid = 0xFFC00000u;  // x86's default NaN from an invalid operation

__device__ __forceinline__ bool is_nan(float v) { return (__float_as_uint(v) & 0x7FFFFFFFu) > 0x7F800000u; }
__device__ __forceinline__ bool is_finite(float v) { return (__float_as_uint(v) & 0x7F800000u) != 0x7F800000u; }
__device__ __forceinline__ float quiet(float v) { return __uint_as_float(__float_as_uint(v) | 0x00400000u); }

// r = a op b with x86's NaN: a NaN operand quieted (a first), else the default NaN if r is NaN.
__device__ __forceinline__ float x86_nan(float r, float a, float b) {
  if (!is_nan(r)) return r;
  if (is_nan(a)) return quiet(a);
  if (is_nan(b)) return quiet(b);
  return __uint_as_float(kX86Invalid);
}
__device__ __forceinline__ float mul_x86(float a, float b) { return x86_nan(a * b, a, b); }
__device__ __forceinline__ float div_x86(float a, float b) { return x86_nan(a / b, a, b); }

// 2^k for k in [-126, 127], from its bits (the CPU's pow2).
__device__ __forceinline__ float pow2(int k) { return __uint_as_float(static_cast<uint32_t>(k + 127) << 23); }

// The CPU's round_grid: exact scaling by powers of two, rint (half to even), overflow, sign by
// bits. A NaN comes back quieted with its sign, as there.
__device__ __forceinline__ float round_grid(float v, const QuantGrid& g) {
  const uint32_t bits = __float_as_uint(v);
  if (is_nan(v)) return quiet(v);
  const float a = __uint_as_float(bits & 0x7FFFFFFFu);
  int e = static_cast<int>((bits >> 23) & 0xFFu) - 127;
  e = e < g.emin ? g.emin : e;
  e = e > 127 ? 127 : e;
  const float r0 = rintf(a * pow2(g.man_bits - e)) * pow2(e - g.man_bits);
  const float r = r0 > g.max ? g.overflow : r0;
  return __uint_as_float(__float_as_uint(r) | (bits & 0x80000000u));
}


// The grids of the block formats' element (E2M1) and scale (E4M3) types, as the CPU's.
// (Functions: a namespace-scope constant is not visible in device code.)
__device__ __forceinline__ QuantGrid e2m1() { return QuantGrid{1, 0, 6.0f, 6.0f}; }
__device__ __forceinline__ QuantGrid e4m3() { return QuantGrid{3, -6, 448.0f, 448.0f}; }

// ---------------------------------------------------------------- Philox4x32-10 (cuda_philox.h)
// Element i's word: i % 4 of the block at counter (i / 4 lo, i / 4 hi, stream, draw).
__device__ __forceinline__ Philox4 philox(int64_t group, const PhiloxDraw& d) {
  const uint64_t q = static_cast<uint64_t>(group);
  return philox4x32_10(static_cast<uint32_t>(q), static_cast<uint32_t>(q >> 32), d.stream, d.draw, d.key0, d.key1);
}

// ---------------------------------------------------------------- groups of four
// The elementwise kernels walk groups of 4 elements (Philox's unit): one float4 when `vec` (the
// pointers 16-byte aligned) and the group is whole, else element by element.
struct Four {
  float v[4];
};

__device__ __forceinline__ Four load4(const float* x, int64_t base, int64_t n, bool vec) {
  Four f;
  if (vec && base + 4 <= n) {
    const float4 t = *reinterpret_cast<const float4*>(x + base);
    f.v[0] = t.x, f.v[1] = t.y, f.v[2] = t.z, f.v[3] = t.w;
  } else {
#pragma unroll
    for (int j = 0; j < 4; ++j) f.v[j] = base + j < n ? x[base + j] : 0.0f;
  }
  return f;
}

__device__ __forceinline__ void store4(float* out, int64_t base, int64_t n, bool vec, const Four& f) {
  if (vec && base + 4 <= n) {
    *reinterpret_cast<float4*>(out + base) = make_float4(f.v[0], f.v[1], f.v[2], f.v[3]);
  } else {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      if (base + j < n) out[base + j] = f.v[j];
    }
  }
}

// ---------------------------------------------------------------- amax
// Each thread takes the integer max of |x| bits over its groups; a shuffle tree and shared memory
// make the block's, and one thread folds it into *result with atomicMax (max is order-free).
__global__ void __launch_bounds__(kBlock) amax_kernel(const float* x, int64_t n, bool vec, uint32_t* result) {
  __shared__ uint32_t warp_max[kRowWarps];
  uint32_t m = 0;
  for (int64_t q = thread_index(); q < (n + 3) / 4; q += thread_count()) {
    const Four f = load4(x, 4 * q, n, vec);
#pragma unroll
    for (int j = 0; j < 4; ++j) m = max(m, __float_as_uint(f.v[j]) & 0x7FFFFFFFu);  // past n: 0
  }
#pragma unroll
  for (int off = kWarp / 2; off > 0; off >>= 1) m = max(m, shfl_xor(m, off));
  if (threadIdx.x % kWarp == 0) warp_max[threadIdx.x / kWarp] = m;
  __syncthreads();
  if (threadIdx.x == 0) {
    uint32_t b = 0;
    for (int w = 0; w < kRowWarps; ++w) b = max(b, warp_max[w]);
    atomicMax(result, b);
  }
}

// ---------------------------------------------------------------- elementwise quantizers
__global__ void __launch_bounds__(kBlock)
    fake_quant_kernel(const float* x, float* out, int64_t n, bool vec, QuantGrid g, float scale, float post) {
  for (int64_t q = thread_index(); q < (n + 3) / 4; q += thread_count()) {
    Four f = load4(x, 4 * q, n, vec);
#pragma unroll
    for (int j = 0; j < 4; ++j) f.v[j] = mul_x86(round_grid(mul_x86(f.v[j], scale), g), post);
    store4(out, 4 * q, n, vec, f);
  }
}

// vec: x 16-byte and out 8-byte aligned; four codes go out as one 8-byte store.
__global__ void __launch_bounds__(kBlock)
    quant_codes_bf16_kernel(const float* x, uint16_t* out, int64_t n, bool vec, QuantGrid g, float scale) {
  for (int64_t q = thread_index(); q < (n + 3) / 4; q += thread_count()) {
    const int64_t base = 4 * q;
    const Four f = load4(x, base, n, vec);
    uint32_t c[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) c[j] = __float_as_uint(round_grid(mul_x86(f.v[j], scale), g)) >> 16;
    if (vec && base + 4 <= n) {
      int2 packed;
      packed.x = static_cast<int>(c[0] | (c[1] << 16));
      packed.y = static_cast<int>(c[2] | (c[3] << 16));
      *reinterpret_cast<int2*>(out + base) = packed;
    } else {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        if (base + j < n) out[base + j] = static_cast<uint16_t>(c[j]);
      }
    }
  }
}

// ---------------------------------------------------------------- block scaling (DeepSeek-V3)
// Tiles of whole quant blocks along one block row: `tile` columns (a multiple of block_cols when
// block_cols <= 256, else one quant block). Thread t owns columns c0 + t + k 256 of the tile, all
// in quant block t / per (per = min(block_cols, 256) threads per quant block); it takes their max
// |x| over the block row's rows, then one thread per quant block folds its `per` column maxima,
// and every thread quantizes its columns. Max ignores NaN, as std::max(amax, NaN) does.
__global__ void __launch_bounds__(kBlock)
    fake_quant_blocks_kernel(const float* x, float* out, int64_t rows, int64_t cols, int64_t block_rows,
                             int64_t block_cols, int64_t tile, int64_t tiles_per_row, QuantGrid g) {
  __shared__ float col_max[kBlock];
  __shared__ float block_scale[kBlock];
  const int per = block_cols < kBlock ? static_cast<int>(block_cols) : kBlock;
  const int64_t block_rows_count = (rows + block_rows - 1) / block_rows;
  const int t = static_cast<int>(threadIdx.x);
  for (int64_t tid = blockIdx.x; tid < block_rows_count * tiles_per_row; tid += gridDim.x) {
    const int64_t r0 = (tid / tiles_per_row) * block_rows, r1 = r0 + block_rows < rows ? r0 + block_rows : rows;
    const int64_t c0 = (tid % tiles_per_row) * tile, c1 = c0 + tile < cols ? c0 + tile : cols;
    float m = 0.0f;
    for (int64_t c = c0 + t; c < c1; c += kBlock) {
      for (int64_t r = r0; r < r1; ++r) {
        const float a = fabsf(x[r * cols + c]);
        m = a > m ? a : m;
      }
    }
    col_max[t] = m;
    __syncthreads();
    if (t < kBlock / per) {
      float amax = 0.0f;
      for (int k = t * per; k < (t + 1) * per; ++k) amax = col_max[k] > amax ? col_max[k] : amax;
      block_scale[t] = (amax < 1e-4f ? 1e-4f : amax) / g.max;
    }
    __syncthreads();
    const float s = block_scale[t / per];
    for (int64_t c = c0 + t; c < c1; c += kBlock) {
      for (int64_t r = r0; r < r1; ++r) {
        out[r * cols + c] = mul_x86(round_grid(div_x86(x[r * cols + c], s), g), s);
      }
    }
  }
}

// ---------------------------------------------------------------- MXFP4
// Warp w (grid-stride) owns block w of rows x ceil(cols / 32): row w / nblk, columns
// 32 (w % nblk) + lane.
__global__ void __launch_bounds__(kBlock)
    fake_quant_mxfp4_kernel(const float* x, float* out, int64_t rows, int64_t cols) {
  const int64_t nblk = (cols + 31) / 32, total = rows * nblk;
  const int lane = static_cast<int>(threadIdx.x % kWarp);
  const int64_t warps = thread_count() / kWarp;
  for (int64_t w = thread_index() / kWarp; w < total; w += warps) {
    const int64_t r = w / nblk, c = (w % nblk) * 32 + lane;
    const bool valid = c < cols;
    const float v = valid ? x[r * cols + c] : 0.0f;
    const bool finite = all_of(is_finite(v));
    uint32_t m = __float_as_uint(v) & 0x7FFFFFFFu;
#pragma unroll
    for (int off = kWarp / 2; off > 0; off >>= 1) m = max(m, shfl_xor(m, off));
    if (!valid) continue;
    if (!finite) {
      out[r * cols + c] = __uint_as_float(kDefaultNan);
      continue;
    }
    const float amax = __uint_as_float(m);
    int e = -127;
    if (amax > 0.0f) e = min(max(ilogbf(amax) - 2, -127), 127);  // floor(log2 amax) - emax(E2M1)
    const float X = e >= -126 ? pow2(e) : __uint_as_float(0x00400000u);  // 2^-127 is subnormal
    out[r * cols + c] = round_grid(v / X, e2m1()) * X;
  }
}

// ---------------------------------------------------------------- NVFP4
// Warp w (grid-stride) owns blocks 2w (lanes 0-15) and 2w + 1 (lanes 16-31) of rows x
// ceil(cols / 16); *amax_bits is the tensor's amax (amax_kernel).
__global__ void __launch_bounds__(kBlock)
    fake_quant_nvfp4_kernel(const float* x, float* out, int64_t rows, int64_t cols, const uint32_t* amax_bits) {
  const int64_t nblk = (cols + 15) / 16, total = rows * nblk;
  const int lane = static_cast<int>(threadIdx.x % kWarp);
  const int64_t warps = thread_count() / kWarp;
  const uint32_t tensor_bits = *amax_bits;
  const bool finite = tensor_bits < 0x7F800000u;
  const float tensor_amax = __uint_as_float(tensor_bits);
  const float global = tensor_amax > 0.0f ? tensor_amax / (448.0f * 6.0f) : 1.0f;
  for (int64_t w = thread_index() / kWarp; w < (total + 1) / 2; w += warps) {
    const int64_t blk = 2 * w + lane / 16;
    const int64_t r = blk / nblk, c = (blk % nblk) * 16 + lane % 16;
    const bool valid = blk < total && c < cols;
    const float v = valid ? x[r * cols + c] : 0.0f;
    uint32_t m = __float_as_uint(v) & 0x7FFFFFFFu;
#pragma unroll
    for (int off = 8; off > 0; off >>= 1) m = max(m, shfl_xor(m, off));  // within the half
    if (!valid) continue;
    if (!finite) {
      out[r * cols + c] = __uint_as_float(kDefaultNan);
      continue;
    }
    const float scale = round_grid((__uint_as_float(m) / 6.0f) / global, e4m3()) * global;
    out[r * cols + c] = scale == 0.0f ? 0.0f : round_grid(v / scale, e2m1()) * scale;
  }
}

// ---------------------------------------------------------------- bf16 rounding, dropout
__global__ void __launch_bounds__(kBlock) round_bf16_kernel(float* x, int64_t n, bool vec, bool stochastic,
                                                            PhiloxDraw draw) {
  for (int64_t q = thread_index(); q < (n + 3) / 4; q += thread_count()) {
    Four f = load4(x, 4 * q, n, vec);
    if (stochastic) {
      const Philox4 r = philox(q, draw);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        if (!is_finite(f.v[j])) continue;
        f.v[j] = __uint_as_float((__float_as_uint(f.v[j]) + (r.v[j] >> 16)) & 0xFFFF0000u);
      }
    } else {
#pragma unroll
      for (int j = 0; j < 4; ++j) f.v[j] = __uint_as_float(static_cast<uint32_t>(bf16_bits(f.v[j])) << 16);
    }
    store4(x, 4 * q, n, vec, f);
  }
}

__global__ void __launch_bounds__(kBlock) dropout_kernel(const float* x, float* out, int64_t n, bool vec,
                                                         uint64_t threshold, float keep, PhiloxDraw draw) {
  for (int64_t q = thread_index(); q < (n + 3) / 4; q += thread_count()) {
    Four f = load4(x, 4 * q, n, vec);
    const Philox4 r = philox(q, draw);
#pragma unroll
    for (int j = 0; j < 4; ++j) f.v[j] = r.v[j] >= threshold ? mul_x86(f.v[j], keep) : 0.0f;
    store4(out, 4 * q, n, vec, f);
  }
}

// ---------------------------------------------------------------- bf16 attention: row kernels
// Rows (nb T) of src (row width (hq + 2 hkv) hd) into head-major bf16 copies: head c < hq of
// sequence b, row t to q[((b hq + c) T + t) hd + d], the next hkv heads to k, the last to v.
// One block per row (grid-stride); four columns per step when vec (hd % 4 == 0, src 16-byte and
// the copies 8-byte aligned).
__global__ void __launch_bounds__(kBlock)
    heads_to_bf16_kernel(const float* src, int64_t rows, int seq_len, int hq, int hkv, int hd, bool vec,
                         uint16_t* q, uint16_t* k, uint16_t* v) {
  const int width = (hq + 2 * hkv) * hd, step = vec ? 4 : 1;
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const int64_t b = row / seq_len, t = row % seq_len;
    for (int col = static_cast<int>(threadIdx.x) * step; col < width; col += kBlock * step) {
      const int c = col / hd, d = col % hd;
      uint16_t* dst;
      if (c < hq) dst = q + ((b * hq + c) * seq_len + t) * hd + d;
      else if (c < hq + hkv) dst = k + ((b * hkv + (c - hq)) * seq_len + t) * hd + d;
      else dst = v + ((b * hkv + (c - hq - hkv)) * seq_len + t) * hd + d;
      const float* s = src + row * width + col;
      if (vec) {
        const float4 x4 = *reinterpret_cast<const float4*>(s);
        int2 packed;
        packed.x = static_cast<int>(static_cast<uint32_t>(bf16_bits(x4.x)) | static_cast<uint32_t>(bf16_bits(x4.y)) << 16);
        packed.y = static_cast<int>(static_cast<uint32_t>(bf16_bits(x4.z)) | static_cast<uint32_t>(bf16_bits(x4.w)) << 16);
        *reinterpret_cast<int2*>(dst) = packed;
      } else {
        *dst = bf16_bits(*s);
      }
    }
  }
}

// In place on probs rows (rows of T; row r is query i = r % T): P[i, j] = exp(S_ij - max) / sum
// over j <= i, exactly 0 after; pb gets P in bf16. exp is scalar_math's, the CPU's. One warp per
// row; lane l owns columns l + 32 k. kPer > 0: the row's kPer values per lane stay in registers
// (T <= 32 kPer); kPer = 0: any T, S read three times.
template <int kPer>
__global__ void __launch_bounds__(kBlock)
    causal_softmax_bf16_kernel(float* probs, uint16_t* pb, int64_t rows, int seq_len) {
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kRowWarps + threadIdx.x / kWarp;
  if (r >= rows) return;  // warp-uniform
  const int lane = static_cast<int>(threadIdx.x % kWarp);
  const int i = static_cast<int>(r % seq_len);
  float* row = probs + r * seq_len;
  uint16_t* brow = pb + r * seq_len;
  if constexpr (kPer > 0) {
    float s[kPer];
    float mx = -INFINITY;
#pragma unroll
    for (int k = 0; k < kPer; ++k) {
      const int j = lane + kWarp * k;
      s[k] = j <= i ? row[j] : 0.0f;
      if (j <= i) mx = s[k] > mx ? s[k] : mx;
    }
    mx = warp_max(mx);
    float sum = 0.0f;
#pragma unroll
    for (int k = 0; k < kPer; ++k) {
      const int j = lane + kWarp * k;
      s[k] = j <= i ? math::exp_t<float>(s[k] - mx) : 0.0f;
      sum += s[k];
    }
    const float inv = 1.0f / warp_sum(sum);
#pragma unroll
    for (int k = 0; k < kPer; ++k) {
      const int j = lane + kWarp * k;
      if (j < seq_len) {
        const float p = j <= i ? s[k] * inv : 0.0f;
        row[j] = p;
        brow[j] = bf16_bits(p);
      }
    }
  } else {
    float mx = -INFINITY;
    for (int j = lane; j <= i; j += kWarp) mx = row[j] > mx ? row[j] : mx;
    mx = warp_max(mx);
    float sum = 0.0f;
    for (int j = lane; j <= i; j += kWarp) sum += math::exp_t<float>(row[j] - mx);
    const float inv = 1.0f / warp_sum(sum);
    for (int j = lane; j < seq_len; j += kWarp) {
      const float p = j <= i ? math::exp_t<float>(row[j] - mx) * inv : 0.0f;
      row[j] = p;
      brow[j] = bf16_bits(p);
    }
  }
}

// For the chunk's rows r = (b, h, i) (nb H T of them): D_i = dO_i . O_i (f32, from dout and out,
// rows of width ow); dS = scale P (dP - D) over all T columns, written as bf16 (dsb), and P as
// bf16 (pb). One warp per row.
__global__ void __launch_bounds__(kBlock)
    attention_dscores_bf16_kernel(const float* dout, const float* out, const float* probs, const float* dp,
                                  uint16_t* dsb, uint16_t* pb, int64_t rows, int seq_len, int n_head, int head_dim,
                                  float scale) {
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kRowWarps + threadIdx.x / kWarp;
  if (r >= rows) return;  // warp-uniform
  const int lane = static_cast<int>(threadIdx.x % kWarp);
  const int64_t bh = r / seq_len, i = r % seq_len, b = bh / n_head, h = bh % n_head;
  const int64_t off = (b * seq_len + i) * n_head * head_dim + h * head_dim;
  float d = 0.0f;
  for (int k = lane; k < head_dim; k += kWarp) d += dout[off + k] * out[off + k];
  d = warp_sum(d);
  const float* prow = probs + r * seq_len;
  const float* dprow = dp + r * seq_len;
  for (int j = lane; j < seq_len; j += kWarp) {
    const float p = prow[j];
    dsb[r * seq_len + j] = bf16_bits(scale * p * (dprow[j] - d));
    pb[r * seq_len + j] = bf16_bits(p);
  }
}

// ---------------------------------------------------------------- bf16 attention: GEMMs
// cuda_blas.h's gemm_rm_bf16: row-major strided-batched C_p (m, n) = alpha op(A_p) op(B_p) +
// beta C_p with A, B bf16 and C f32, fp32 accumulation.

// The scratch of one chunk of nb sequences, each region 256-byte aligned: head-major bf16 copies
// Qb (nb, H, T, hd), Kb and Vb (nb, KV, T, hd), and (T, T) blocks per head: Pb (bf16); backward
// also dOb (nb, H, T, hd), dP (f32) and dSb (bf16).
struct Bf16Scratch {
  size_t q, k, v, pb, dob, dp, dsb, total;
};

size_t round256(size_t bytes) { return (bytes + 255) / 256 * 256; }

Bf16Scratch scratch_layout(int64_t nb, int64_t T, int64_t H, int64_t KV, int64_t hd, bool backward) {
  const auto n = [](int64_t a, int64_t b, int64_t c, int64_t d) {
    return static_cast<size_t>(a) * static_cast<size_t>(b) * static_cast<size_t>(c) * static_cast<size_t>(d);
  };
  Bf16Scratch s{};
  size_t at = 0;
  const auto take = [&at](size_t bytes) {
    const size_t here = at;
    at += round256(bytes);
    return here;
  };
  s.q = take(2 * n(nb, H, T, hd));
  s.k = take(2 * n(nb, KV, T, hd));
  s.v = take(2 * n(nb, KV, T, hd));
  s.pb = take(2 * n(nb, H, T, T));
  if (backward) {
    s.dob = take(2 * n(nb, H, T, hd));
    s.dp = take(4 * n(nb, H, T, T));
    s.dsb = take(2 * n(nb, H, T, T));
  }
  s.total = at;
  return s;
}

// Sequences per chunk: as many as fit kChunkBytes of scratch (at least one), so the scratch
// stays bounded for long sequences while short ones batch every GEMM over the chunk.
constexpr size_t kChunkBytes = size_t{256} << 20;

int64_t chunk_batch(int64_t B, int64_t T, int64_t H, int64_t KV, int64_t hd, bool backward) {
  const size_t one = scratch_layout(1, T, H, KV, hd, backward).total;
  return std::clamp<int64_t>(static_cast<int64_t>(kChunkBytes / std::max<size_t>(one, 1)), 1, std::max<int64_t>(B, 1));
}

struct Bf16Dims {
  int64_t B, T, H, KV, G, hd, W, OW;
};

Bf16Dims bf16_dims(const char* op, int64_t batch, int64_t seq_len, int64_t n_head, int64_t n_kv_head,
                   int64_t head_dim) {
  LOOM_CHECK(n_head > 0 && n_kv_head > 0 && n_head % n_kv_head == 0, op,
             ": n_head must be a positive multiple of n_kv_head, got ", n_head, " and ", n_kv_head);
  const Bf16Dims d{batch, seq_len, n_head, n_kv_head, n_head / n_kv_head, head_dim,
                   (n_head + 2 * n_kv_head) * head_dim, n_head * head_dim};
  LOOM_CHECK(d.W <= INT_MAX && seq_len <= INT_MAX && seq_len * seq_len <= INT_MAX, op, ": row width ", d.W,
             " or seq_len ", seq_len, " exceeds the 32-bit sizes of the kernels and cuBLAS");
  return d;
}

void heads_to_bf16(const float* src, int64_t rows, int64_t T, int64_t hq, int64_t hkv, int64_t hd, uint16_t* q,
                   uint16_t* k, uint16_t* v, cudaStream_t stream) {
  const bool vec = hd % 4 == 0 && aligned(src, 16) && aligned(q, 8) && aligned(k, 8) && aligned(v, 8);
  launch<heads_to_bf16_kernel>(grid_for(rows, 1), kBlock, 0, stream, src, rows, static_cast<int>(T),
                               static_cast<int>(hq), static_cast<int>(hkv), static_cast<int>(hd), vec, q, k, v);
  LOOM_CUDA_CHECK_LAUNCH();
}

unsigned row_blocks(int64_t rows) { return static_cast<unsigned>((rows + kRowWarps - 1) / kRowWarps); }

void causal_softmax_bf16(float* probs, uint16_t* pb, int64_t rows, int64_t T, cudaStream_t stream) {
  const int t = static_cast<int>(T);
  const unsigned grid = row_blocks(rows);
  if (T <= 32) launch<causal_softmax_bf16_kernel<1>>(grid, kBlock, 0, stream, probs, pb, rows, t);
  else if (T <= 64) launch<causal_softmax_bf16_kernel<2>>(grid, kBlock, 0, stream, probs, pb, rows, t);
  else if (T <= 128) launch<causal_softmax_bf16_kernel<4>>(grid, kBlock, 0, stream, probs, pb, rows, t);
  else if (T <= 256) launch<causal_softmax_bf16_kernel<8>>(grid, kBlock, 0, stream, probs, pb, rows, t);
  else if (T <= 512) launch<causal_softmax_bf16_kernel<16>>(grid, kBlock, 0, stream, probs, pb, rows, t);
  else if (T <= 1024) launch<causal_softmax_bf16_kernel<32>>(grid, kBlock, 0, stream, probs, pb, rows, t);
  else launch<causal_softmax_bf16_kernel<0>>(grid, kBlock, 0, stream, probs, pb, rows, t);
  LOOM_CUDA_CHECK_LAUNCH();
}

}  // namespace

// ---------------------------------------------------------------- launchers
void amax_bits(const float* x, int64_t n, uint32_t* result, cudaStream_t stream) {
  LOOM_CUDA_CHECK(cudaMemsetAsync(result, 0, sizeof(uint32_t), stream));
  launch<amax_kernel>(grid_for((n + 3) / 4, kBlock, kAmaxMaxBlocks), kBlock, 0, stream, x, n, aligned(x, 16), result);
  LOOM_CUDA_CHECK_LAUNCH();
}

void fake_quant(const float* x, float* out, int64_t n, const QuantGrid& grid, float scale, float post,
                cudaStream_t stream) {
  if (n == 0) return;
  const bool vec = aligned(x, 16) && aligned(out, 16);
  launch<fake_quant_kernel>(grid_for((n + 3) / 4, kBlock), kBlock, 0, stream, x, out, n, vec, grid, scale, post);
  LOOM_CUDA_CHECK_LAUNCH();
}

void quant_codes_bf16(const float* x, uint16_t* out, int64_t n, const QuantGrid& grid, float scale,
                      cudaStream_t stream) {
  if (n == 0) return;
  const bool vec = aligned(x, 16) && aligned(out, 8);
  launch<quant_codes_bf16_kernel>(grid_for((n + 3) / 4, kBlock), kBlock, 0, stream, x, out, n, vec, grid, scale);
  LOOM_CUDA_CHECK_LAUNCH();
}

void fake_quant_blocks(const float* x, float* out, int64_t rows, int64_t cols, int64_t block_rows,
                       int64_t block_cols, const QuantGrid& grid, cudaStream_t stream) {
  if (rows == 0 || cols == 0) return;
  const int64_t tile = block_cols <= kBlock ? (kBlock / block_cols) * block_cols : block_cols;
  const int64_t tiles_per_row = (cols + tile - 1) / tile;
  const int64_t tiles = (rows + block_rows - 1) / block_rows * tiles_per_row;
  launch<fake_quant_blocks_kernel>(grid_for(tiles, 1), kBlock, 0, stream, x, out, rows, cols, block_rows, block_cols,
                                   tile, tiles_per_row, grid);
  LOOM_CUDA_CHECK_LAUNCH();
}

void fake_quant_mxfp4(const float* x, float* out, int64_t rows, int64_t cols, cudaStream_t stream) {
  if (rows == 0 || cols == 0) return;
  const int64_t warps = rows * ((cols + 31) / 32);
  launch<fake_quant_mxfp4_kernel>(grid_for(warps, kRowWarps), kBlock, 0, stream, x, out, rows, cols);
  LOOM_CUDA_CHECK_LAUNCH();
}

void fake_quant_nvfp4(const float* x, float* out, int64_t rows, int64_t cols, void* scratch, cudaStream_t stream) {
  if (rows == 0 || cols == 0) return;
  auto* amax = static_cast<uint32_t*>(scratch);
  amax_bits(x, rows * cols, amax, stream);
  const int64_t warps = (rows * ((cols + 15) / 16) + 1) / 2;
  launch<fake_quant_nvfp4_kernel>(grid_for(warps, kRowWarps), kBlock, 0, stream, x, out, rows, cols,
                                  static_cast<const uint32_t*>(amax));
  LOOM_CUDA_CHECK_LAUNCH();
}

void round_bf16(float* x, int64_t n, bool stochastic, const PhiloxDraw& draw, cudaStream_t stream) {
  if (n == 0) return;
  launch<round_bf16_kernel>(grid_for((n + 3) / 4, kBlock), kBlock, 0, stream, x, n, aligned(x, 16), stochastic, draw);
  LOOM_CUDA_CHECK_LAUNCH();
}

void dropout(const float* x, float* out, int64_t n, uint64_t threshold, float keep, const PhiloxDraw& draw,
             cudaStream_t stream) {
  if (n == 0) return;
  const bool vec = aligned(x, 16) && aligned(out, 16);
  launch<dropout_kernel>(grid_for((n + 3) / 4, kBlock), kBlock, 0, stream, x, out, n, vec, threshold, keep, draw);
  LOOM_CUDA_CHECK_LAUNCH();
}

// ---------------------------------------------------------------- bf16 attention
// GEMM scheme (per chunk of nb sequences; Qb etc. head-major, so one sequence's head h = g G + r
// sits at ((b KV + g) G + r) T hd and its kv head at (b KV + g) T hd):
//   S and dP: per r, one call batched over the chunk's nb KV (b, g) pairs, into the chunk's
//   (H, T, T) blocks (stride G T T);
//   O, dQ, dK, dV (rows of out / dqkv): per sequence b and r, one call batched over the KV kv heads,
//   dK and dV with beta 0 for r = 0 and 1 after (the group's sum in the order of h).
size_t attention_bf16_forward_scratch_bytes(int64_t batch, int64_t seq_len, int64_t n_head, int64_t n_kv_head,
                                            int64_t head_dim) {
  if (batch == 0 || seq_len == 0) return 0;
  const int64_t nb = chunk_batch(batch, seq_len, n_head, n_kv_head, head_dim, false);
  return scratch_layout(nb, seq_len, n_head, n_kv_head, head_dim, false).total;
}

size_t attention_bf16_backward_scratch_bytes(int64_t batch, int64_t seq_len, int64_t n_head, int64_t n_kv_head,
                                             int64_t head_dim) {
  if (batch == 0 || seq_len == 0) return 0;
  const int64_t nb = chunk_batch(batch, seq_len, n_head, n_kv_head, head_dim, true);
  return scratch_layout(nb, seq_len, n_head, n_kv_head, head_dim, true).total;
}

void attention_forward_bf16(cublasHandle_t cublas, const float* qkv, float* out, float* probs, void* scratch,
                            int64_t batch, int64_t seq_len, int64_t n_head, int64_t n_kv_head, int64_t head_dim,
                            cudaStream_t stream) {
  const char* op = "attention_forward_bf16";
  const Bf16Dims d = bf16_dims(op, batch, seq_len, n_head, n_kv_head, head_dim);
  if (d.B == 0 || d.T == 0) return;
  const BlasHostScalars host_scalars(cublas);
  const float scale = 1.0f / std::sqrt(static_cast<float>(d.hd));  // as the CPU kernel
  const int64_t TT = d.T * d.T, Thd = d.T * d.hd;
  const int64_t chunk = chunk_batch(d.B, d.T, d.H, d.KV, d.hd, false);
  const Bf16Scratch s = scratch_layout(chunk, d.T, d.H, d.KV, d.hd, false);
  char* base = static_cast<char*>(scratch);
  auto* qb = reinterpret_cast<uint16_t*>(base + s.q);
  auto* kb = reinterpret_cast<uint16_t*>(base + s.k);
  auto* vb = reinterpret_cast<uint16_t*>(base + s.v);
  auto* pb = reinterpret_cast<uint16_t*>(base + s.pb);
  for (int64_t b0 = 0; b0 < d.B; b0 += chunk) {
    const int64_t nb = std::min(chunk, d.B - b0);
    float* p = probs + b0 * d.H * TT;
    heads_to_bf16(qkv + b0 * d.T * d.W, nb * d.T, d.T, d.H, d.KV, d.hd, qb, kb, vb, stream);
    for (int64_t r = 0; r < d.G; ++r) {
      // S_h (T, T) = scale Qb_h (T, hd) Kb_g (T, hd)^T, over the chunk's (b, g).
      gemm_rm_bf16(cublas, false, true, d.T, d.T, d.hd, scale, qb + r * Thd, d.hd, d.G * Thd, kb, d.hd, Thd, 0.0f,
                p + r * TT, d.T, d.G * TT, nb * d.KV, "attention_forward_bf16: S = scale Q K^T");
    }
    causal_softmax_bf16(p, pb, nb * d.H * d.T, d.T, stream);
    for (int64_t b = 0; b < nb; ++b) {
      for (int64_t r = 0; r < d.G; ++r) {
        // O_h (T, hd; ld OW) = Pb_h (T, T) Vb_g (T, hd), over g.
        gemm_rm_bf16(cublas, false, false, d.T, d.hd, d.T, 1.0f, pb + (b * d.H + r) * TT, d.T, d.G * TT,
                  vb + b * d.KV * Thd, d.hd, Thd, 0.0f, out + (b0 + b) * d.T * d.OW + r * d.hd, d.OW, d.G * d.hd,
                  d.KV, "attention_forward_bf16: O = P V");
      }
    }
  }
}

void attention_backward_bf16(cublasHandle_t cublas, const float* dout, const float* qkv, const float* out,
                             const float* probs, float* dqkv, void* scratch, int64_t batch, int64_t seq_len,
                             int64_t n_head, int64_t n_kv_head, int64_t head_dim, cudaStream_t stream) {
  const char* op = "attention_backward_bf16";
  const Bf16Dims d = bf16_dims(op, batch, seq_len, n_head, n_kv_head, head_dim);
  if (d.B == 0 || d.T == 0) return;
  const BlasHostScalars host_scalars(cublas);
  const float scale = 1.0f / std::sqrt(static_cast<float>(d.hd));
  const int64_t TT = d.T * d.T, Thd = d.T * d.hd;
  const int64_t chunk = chunk_batch(d.B, d.T, d.H, d.KV, d.hd, true);
  const Bf16Scratch s = scratch_layout(chunk, d.T, d.H, d.KV, d.hd, true);
  char* base = static_cast<char*>(scratch);
  auto* qb = reinterpret_cast<uint16_t*>(base + s.q);
  auto* kb = reinterpret_cast<uint16_t*>(base + s.k);
  auto* vb = reinterpret_cast<uint16_t*>(base + s.v);
  auto* pb = reinterpret_cast<uint16_t*>(base + s.pb);
  auto* dob = reinterpret_cast<uint16_t*>(base + s.dob);
  auto* dp = reinterpret_cast<float*>(base + s.dp);
  auto* dsb = reinterpret_cast<uint16_t*>(base + s.dsb);
  for (int64_t b0 = 0; b0 < d.B; b0 += chunk) {
    const int64_t nb = std::min(chunk, d.B - b0);
    heads_to_bf16(qkv + b0 * d.T * d.W, nb * d.T, d.T, d.H, d.KV, d.hd, qb, kb, vb, stream);
    heads_to_bf16(dout + b0 * d.T * d.OW, nb * d.T, d.T, d.H, 0, d.hd, dob, nullptr, nullptr, stream);
    for (int64_t r = 0; r < d.G; ++r) {
      // dP_h (T, T) = dOb_h (T, hd) Vb_g (T, hd)^T, over the chunk's (b, g).
      gemm_rm_bf16(cublas, false, true, d.T, d.T, d.hd, 1.0f, dob + r * Thd, d.hd, d.G * Thd, vb, d.hd, Thd, 0.0f,
                dp + r * TT, d.T, d.G * TT, nb * d.KV, "attention_backward_bf16: dP = dO V^T");
    }
    const int64_t rows = nb * d.H * d.T;
    launch<attention_dscores_bf16_kernel>(row_blocks(rows), kBlock, 0, stream, dout + b0 * d.T * d.OW,
                                          out + b0 * d.T * d.OW, probs + b0 * d.H * TT, static_cast<const float*>(dp),
                                          dsb, pb, rows, static_cast<int>(d.T), static_cast<int>(d.H),
                                          static_cast<int>(d.hd), scale);
    LOOM_CUDA_CHECK_LAUNCH();
    for (int64_t b = 0; b < nb; ++b) {
      float* drow = dqkv + (b0 + b) * d.T * d.W;
      for (int64_t r = 0; r < d.G; ++r) {
        const float beta = r == 0 ? 0.0f : 1.0f;
        const int64_t h0 = b * d.H + r;  // head r of kv head 0 of sequence b; g steps by G
        // dQ_h (T, hd; ld W) = dSb_h (T, T) Kb_g (T, hd).
        gemm_rm_bf16(cublas, false, false, d.T, d.hd, d.T, 1.0f, dsb + h0 * TT, d.T, d.G * TT, kb + b * d.KV * Thd, d.hd,
                  Thd, 0.0f, drow + r * d.hd, d.W, d.G * d.hd, d.KV, "attention_backward_bf16: dQ = dS K");
        // dK_g (T, hd; ld W) (+)= dSb_h^T Qb_h.
        gemm_rm_bf16(cublas, true, false, d.T, d.hd, d.T, 1.0f, dsb + h0 * TT, d.T, d.G * TT, qb + h0 * Thd, d.hd,
                  d.G * Thd, beta, drow + d.H * d.hd, d.W, d.hd, d.KV, "attention_backward_bf16: dK += dS^T Q");
        // dV_g (T, hd; ld W) (+)= Pb_h^T dOb_h.
        gemm_rm_bf16(cublas, true, false, d.T, d.hd, d.T, 1.0f, pb + h0 * TT, d.T, d.G * TT, dob + h0 * Thd, d.hd,
                  d.G * Thd, beta, drow + (d.H + d.KV) * d.hd, d.W, d.hd, d.KV, "attention_backward_bf16: dV += P^T dO");
      }
    }
  }
}

}  // namespace loom::cuda
