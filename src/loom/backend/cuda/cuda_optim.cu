// CUDA kernels of the elementwise optimizers, Muon's steps and the soft-target loss (launchers in
// cuda_optim.h, contracts in backend.h, CPU twins in cpu/cpu_optim_ops.cpp and cpu_soft_target.cpp).
// Each element gets exactly the CPU kernel's float arithmetic: the same expressions in the same
// order, with the constants (lr, decay, step_size, ...) computed by the caller as the CPU computes
// them. f32 throughout (the ops are f32 only).
//
// Roofline (per element; B: bytes through device memory, each operand read once and the state
// written once; F: FLOPs, an fma counted as 2; fp32 unless said):
//   sgd_step        d = g gs + wd p; buf = first ? d : mu buf + (1-damp) d; d = nesterov ? d + mu buf : buf;
//                   p -= lr d ..................................... B 12 (20 with buf), F 5 (10 with buf)
//   adagrad_step    d = g gs + wd p; sum += d^2; p -= lr d / (sqrt(sum) + eps) ................ B 20, F 10
//   rmsprop_step    sq = a sq + (1-a) d^2; [avg = a avg + (1-a) d; den = sqrt(sq - avg^2) + eps]
//                   [buf = mu buf + d / den; p -= lr buf] else p -= lr d / den ..... B 20 to 36, F 12 to 19
//   adam_step       d = g gs + l2 p; m, v EMAs; [vmax = max(vmax, v)];
//                   p = p decay - step_size m / (sqrt(v or vmax) / sqrt(1-b2^t) + eps) .. B 28 (36), F 18
//   lion_step       c = b1 m + (1-b1) g; p = p decay - lr sign(c); m = b2 m + (1-b2) g ........ B 20, F 12
//   adam_mini_step  v_b = b2 v_b + (1-b2) mean_b((g gs)^2) (double, in order); m = b1 m + (1-b1) g;
//                   p = p decay - lr (m / bias1) / denom_b ..... B 24 (g read twice; 28 with the ordered
//                   fallback), F 10 + 2 fp64
//   scale_transpose dst = scale src, or dst = scale src^T through a 32 x 33 shared tile ........ B 8, F 1
//   axpy            y += alpha x ............................................................ B 12, F 2
//   muon_momentum   buf = mu buf + (1-mu) g; u = nesterov ? (1-mu) g + mu buf : buf ............ B 16, F 7
//   newton_schulz   x = u / (||u|| + 1e-7), ||u||^2 in double in order (reduce_partials of
//   _normalize      cuda_kernels.h, then the bound check below), then scale_transpose ......... B 12
//                   (16 with the ordered fallback), F 2 fp64 + 1
//   decayed_update  p = p decay - step u ................................................... B 12, F 3
//   soft_target     two passes per row: online max / sum-exp of s/T and t/T (fp64), then
//                   kl += p_t (log p_t - log p_s), grad = gs T (p_s - p_t) .... B 20, F 4 exp + ~14 fp64
// All of them are memory-bound on an H100 (3.35 TB/s, 67 TFLOP/s fp32, 34 fp64): the elementwise
// ops at about 3 ns per million elements per byte; the soft-target loss's fp64 exps keep it near
// the balance point.
//
// Launch shapes. The elementwise ops (all but adam_mini, inverse_norm, scale_transpose with
// transpose, soft_target) run one kernel template, elementwise_kernel<Op, N>: kBlock = 256 threads,
// grid-stride, at most kMaxBlocks blocks; 16-byte (float4) loads and stores of every operand when
// all of them are 16-byte aligned (then n / 4 vectors plus a scalar tail), else scalar.
// adam_mini: one block of 256 threads per Adam-mini block (grid-stride over blocks). inverse_norm:
// reduce_partials' 256 blocks, a one-thread check, a one-block ordered sum that returns at once
// when the check decided. transpose: (32, 8) threads per 32 x 32 tile. soft_target: one block of
// 256 per row.
//
// Ordered sums. backend.h asks for two sums "in double, in order": Adam-mini's per-block mean of
// g^2 and Newton-Schulz's ||u||^2, and the op tests compare their results bitwise with the CPU's.
// A sequential double sum cannot be split: ordered_sum below is one thread's chain of additions
// (the block computes the terms in parallel, coalesced, into one of two shared tiles while thread
// 0 adds up the other), one dependent fp64 add per element, a few ns each: milliseconds for a
// large matrix. So a sum over more than one tile is first done as a tree, and its rounding error
// bound decides the op's float result whenever it can (see sum_bound): the chain runs only when
// the bound straddles a float rounding boundary (for n elements of random data, with probability
// about n 2^-28) or the terms hold a NaN or overflow. Sums of at most one tile (1024 terms) are
// always done in order.
//
// The soft-target loss's "sums in double per row" are fixed trees here (per-thread partials in
// index order, then a halving tree), as the other long sums of this backend: deterministic, but not
// the CPU's sequential order, so its op test compares with the CPU within a tolerance.
//
// Determinism and the CPU's bits: no atomics at all; the optimizer ops spell out which products
// are fused (mul, fma_ below), as the CPU twins' object code has them, so the GPU and the
// simulator compute the CPU's float operations one for one (nvcc's divisions and sqrtf are IEEE
// by default; -use_fast_math would break this).

#include "loom/backend/cuda/cuda_device.h"  // first: the portability layer (docs/accelerators.md)
#include "loom/backend/cuda/cuda_optim.h"

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "loom/backend/cuda/cuda_check.h"
#include "loom/backend/cuda/cuda_kernels.h"
#include "loom/backend/cuda/cuda_launch.h"

namespace loom::cuda {
namespace {

// ---------------------------------------------------------------- launch shapes
// (kMaxBlocks, grid_for, thread_index / thread_count, mul_rn / fma_rn: cuda_device.h)
constexpr int kBlock = 256;           // threads per block of the 1-D kernels
constexpr int kTile = 4 * kBlock;     // terms per shared tile of ordered_sum
constexpr int kTransposeTile = 32;    // transpose: 32 x 32 tiles, (32, 8) threads
constexpr int kTransposeRows = 8;

// ---------------------------------------------------------------- the elementwise template
// Op holds the scalars and `__device__ void operator()(float* x) const` updates one element, x[j]
// the element of operand j (0 for an absent optional operand); Op::kWrites is the mask of operands
// it writes back.
template <int N>
struct Operands {
  float* p[N];
};

// The operands an op reads (bit j: operand j): kReads where it states one, else all of them (an
// output that is only written is not read, so it need not be initialized).
template <typename Op>
__host__ __device__ constexpr unsigned reads_of() {
  if constexpr (requires { Op::kReads; }) {
    return Op::kReads;
  } else {
    return ~0u;
  }
}

template <typename Op, int N>
__global__ void __launch_bounds__(kBlock) elementwise_kernel(Op op, Operands<N> ops, int64_t n, bool vectors) {
  int64_t tail = 0;
  if (vectors) {
    const int64_t n4 = n / 4;
    for (int64_t k = thread_index(); k < n4; k += thread_count()) {
      float x[4][N];
#pragma unroll
      for (int j = 0; j < N; ++j) {
        float4 t = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (ops.p[j] != nullptr && ((reads_of<Op>() >> j) & 1u) != 0) t = reinterpret_cast<const float4*>(ops.p[j])[k];
        x[0][j] = t.x, x[1][j] = t.y, x[2][j] = t.z, x[3][j] = t.w;
      }
#pragma unroll
      for (int l = 0; l < 4; ++l) op(x[l]);
#pragma unroll
      for (int j = 0; j < N; ++j) {
        if (((Op::kWrites >> j) & 1u) != 0 && ops.p[j] != nullptr) {
          reinterpret_cast<float4*>(ops.p[j])[k] = make_float4(x[0][j], x[1][j], x[2][j], x[3][j]);
        }
      }
    }
    tail = n4 * 4;
  }
  for (int64_t i = tail + thread_index(); i < n; i += thread_count()) {
    float x[N];
#pragma unroll
    for (int j = 0; j < N; ++j) x[j] = ops.p[j] != nullptr && ((reads_of<Op>() >> j) & 1u) != 0 ? ops.p[j][i] : 0.0f;
    op(x);
#pragma unroll
    for (int j = 0; j < N; ++j) {
      if (((Op::kWrites >> j) & 1u) != 0 && ops.p[j] != nullptr) ops.p[j][i] = x[j];
    }
  }
}

// The operands' order is the Op's; const inputs are passed as float* and never written.
template <typename Op, int N>
void run_elementwise(const Op& op, const Operands<N>& ops, int64_t n, cudaStream_t stream) {
  if (n <= 0) return;
  bool vectors = true;
  for (int j = 0; j < N; ++j) vectors = vectors && reinterpret_cast<uintptr_t>(ops.p[j]) % 16 == 0;
  launch<elementwise_kernel<Op, N>>(grid_for(vectors ? std::max<int64_t>(n / 4, 1) : n, kBlock), kBlock, 0, stream,
                                    op, ops, n, vectors);
  LOOM_CUDA_CHECK_LAUNCH();
}

// ---------------------------------------------------------------- spelled-out arithmetic
// The CPU twins are compiled by GCC with -ffp-contract=fast on an FMA target: in `a * b + c * d`
// it fuses the left product, fma(a, b, c * d), and in `x + a * b` fma(a, b, x) (read off
// cpu_optim_ops.cpp's object code). nvcc contracts by rules of its own, and GCC compiling this file
// for the simulator would pair the products of the Op structs below differently again. So every
// product that the CPU rounds is mul_rn() (never fused: __fmul_rn on the GPU; on the simulator an
// empty asm hides it from GCC's contraction; on HIP the contraction is off inside it), and every
// fused one is fma_rn() (one rounding); both are cuda_device.h's.

// ---------------------------------------------------------------- the optimizers' elements
// Each is the CPU loop's body (cpu/cpu_optim_ops.cpp) on x[] instead of the arrays, with its
// contractions spelled out (the CPU's expression in the comment).

struct SgdOp {  // x: p, grad, buf
  static constexpr unsigned kWrites = 0b101;
  float mu, damp, eta, wd, gs;
  bool nesterov, first, has_buf;
  __device__ void operator()(float* x) const {
    float d = fma_rn(x[1], gs, mul_rn(wd, x[0]));  // g gs + wd p
    if (has_buf) {
      x[2] = first ? d : fma_rn(mu, x[2], mul_rn(1.0f - damp, d));  // mu b + (1 - damp) d
      d = nesterov ? fma_rn(mu, x[2], d) : x[2];                // d + mu b
    }
    x[0] = fma_rn(-eta, d, x[0]);  // p -= eta d
  }
};

struct AdagradOp {  // x: p, grad, sum
  static constexpr unsigned kWrites = 0b101;
  float eps, clr, wd, gs;
  __device__ void operator()(float* x) const {
    const float d = fma_rn(x[1], gs, mul_rn(wd, x[0]));
    x[2] = fma_rn(d, d, x[2]);                          // s += d d
    x[0] = x[0] - mul_rn(clr, d) / (sqrtf(x[2]) + eps);  // p -= clr d / (sqrt(s) + eps)
  }
};

struct RmspropOp {  // x: p, grad, square, avg, buf
  static constexpr unsigned kWrites = 0b11101;
  float a, eps, mu, eta, wd, gs;
  bool has_avg, has_buf;
  __device__ void operator()(float* x) const {
    const float d = fma_rn(x[1], gs, mul_rn(wd, x[0]));
    x[2] = fma_rn(a, x[2], mul_rn(mul_rn(1.0f - a, d), d));  // a s + (1 - a) d d
    float den;
    if (has_avg) {
      x[3] = fma_rn(a, x[3], mul_rn(1.0f - a, d));      // a avg + (1 - a) d
      den = sqrtf(fma_rn(-x[3], x[3], x[2])) + eps;  // sqrt(s - avg avg) + eps
    } else {
      den = sqrtf(x[2]) + eps;
    }
    if (has_buf) {
      x[4] = fma_rn(mu, x[4], d / den);  // mu b + d / den
      x[0] = fma_rn(-eta, x[4], x[0]);   // p -= eta b
    } else {
      x[0] = x[0] - mul_rn(eta, d) / den;  // p -= eta d / den
    }
  }
};

struct AdamOp {  // x: p, grad, m, v, vmax
  static constexpr unsigned kWrites = 0b11101;
  float step_size, l2, decay, gs, b1, b2, eps, bias2_sqrt;
  bool has_vmax;
  __device__ void operator()(float* x) const {
    const float d = fma_rn(x[1], gs, mul_rn(l2, x[0]));   // g gs + l2 p
    x[2] = fma_rn(b1, x[2], mul_rn(1.0f - b1, d));        // b1 m + (1 - b1) d
    x[3] = fma_rn(b2, x[3], mul_rn(mul_rn(1.0f - b2, d), d));  // b2 v + (1 - b2) d d
    float denom_v = x[3];
    if (has_vmax) {
      x[4] = x[4] < x[3] ? x[3] : x[4];  // std::max(vmax, v)
      denom_v = x[4];
    }
    // p *= decay; p -= step_size m / (sqrt(v) / bias2_sqrt + eps): p decay is rounded (not fused).
    x[0] = mul_rn(x[0], decay) - mul_rn(step_size, x[2]) / (sqrtf(denom_v) / bias2_sqrt + eps);
  }
};

struct LionOp {  // x: p, grad, m
  static constexpr unsigned kWrites = 0b101;
  float b1, b2, eta, decay, gs;
  __device__ void operator()(float* x) const {
    const float d = mul_rn(x[1], gs);
    const float c = fma_rn(b1, x[2], mul_rn(1.0f - b1, d));  // b1 m + (1 - b1) d
    const float sign = c > 0.0f ? 1.0f : (c < 0.0f ? -1.0f : 0.0f);
    x[0] = fma_rn(x[0], decay, -mul_rn(eta, sign));  // p decay - eta sign
    x[2] = fma_rn(b2, x[2], mul_rn(1.0f - b2, d));   // b2 m + (1 - b2) d
  }
};

struct ScaleOp {  // x: dst, src; the scale from device memory when scale_dev is set
  static constexpr unsigned kReads = 0b10;  // dst is only written
  static constexpr unsigned kWrites = 0b01;
  float scale;
  const float* scale_dev;
  __device__ void operator()(float* x) const { x[0] = mul_rn(x[1], scale_dev != nullptr ? *scale_dev : scale); }
};

struct AxpyOp {  // x: y, x
  static constexpr unsigned kWrites = 0b01;
  float alpha;
  __device__ void operator()(float* x) const { x[0] = fma_rn(alpha, x[1], x[0]); }  // y += alpha x
};

struct MuonMomentumOp {  // x: grad, buf, u
  static constexpr unsigned kReads = 0b011;  // u is only written
  static constexpr unsigned kWrites = 0b110;
  float mu, gs;
  bool nesterov;
  __device__ void operator()(float* x) const {
    const float d = mul_rn(x[0], gs);
    const float gd = mul_rn(1.0f - mu, d);  // rounded once, used twice (so the CPU fuses mu b in both)
    x[1] = fma_rn(mu, x[1], gd);                 // mu b + (1 - mu) d
    x[2] = nesterov ? fma_rn(mu, x[1], gd) : x[1];  // (1 - mu) d + mu b
  }
};

struct DecayedUpdateOp {  // x: p, u
  static constexpr unsigned kWrites = 0b01;
  float decay, step;
  __device__ void operator()(float* x) const { x[0] = fma_rn(x[0], decay, -mul_rn(step, x[1])); }  // p decay - step u
};

// ---------------------------------------------------------------- ordered sums
// sum over i in [0, n) of term(i), in double and in index order: the block evaluates the terms in
// parallel into tiles[t % 2] while thread 0 adds up tile t - 1, one barrier per tile. The value is
// thread 0's; every thread of the block must call it (it has barriers).
template <typename Term>
__device__ double ordered_sum(int64_t n, const Term& term, double (*tiles)[kTile]) {
  const int64_t n_tiles = (n + kTile - 1) / kTile;
  double acc = 0.0;
  for (int64_t t = 0; t <= n_tiles; ++t) {
    if (t < n_tiles) {
      const int64_t first = t * kTile, count = min(static_cast<int64_t>(kTile), n - first);
      for (int64_t k = threadIdx.x; k < count; k += blockDim.x) tiles[t & 1][k] = term(first + k);
    }
    if (threadIdx.x == 0 && t > 0) {
      const int64_t count = min(static_cast<int64_t>(kTile), n - (t - 1) * kTile);
      const double* tile = tiles[(t - 1) & 1];
#pragma unroll 1
      for (int64_t k = 0; k < count; ++k) acc += tile[k];
    }
    __syncthreads();
  }
  return acc;
}

// The fast path around ordered_sum. A sum of n >= 0 terms in any order (a tree, chains, partials)
// is within gamma_(n-1) = (n-1) u / (1 - (n-1) u) (u = 2^-53) of the exact sum S, relative
// (Higham 2002, section 4.2). So for St the terms summed in any order, the ordered sum lies in
// [St (1 - e), St (1 + e)] with e = 2 gamma / (1 - gamma) <= 2.01 n u for n < 2^40, plus 2^-50
// for the rounding of e and of St (1 -+ e): sum_bound(n). The op's result is a function f of the
// sum made of correctly rounded monotone operations (a product by a constant, an fma's addend, a
// sqrt, a reciprocal, a cast to float), hence monotone itself: when f(St (1 - e)) and
// f(St (1 + e)) are the same float, f(ordered sum) is that float, and the serial chain is not
// needed. It runs when they differ: a NaN or an overflow among the terms, or, for random data,
// with probability about n 2^-28 (2.5% for Newton-Schulz on a 1536 x 6144 matrix, 0.03% for an
// Adam-mini block of 50,000).
__device__ __forceinline__ double sum_bound(int64_t n) { return 2.01 * static_cast<double>(n) * 0x1p-53 + 0x1p-50; }

struct ScaledSquare {  // (double)(g[i] gs)^2, exact in double
  const float* g;
  float gs;
  __device__ double operator()(int64_t i) const {
    const double d = static_cast<double>(mul_rn(g[i], gs));
    return d * d;
  }
};

// v_b of Adam-mini from its sum of squares (monotone in sq): b2 v + (1 - b2) (sq / bn), in double.
__device__ __forceinline__ float adam_mini_v(double sq, float v_old, int64_t bn, double b2) {
  return static_cast<float>(fma_rn(b2, static_cast<double>(v_old), mul_rn(1.0 - b2, sq / static_cast<double>(bn))));
}

// Adam-mini: block j of the grid-stride loop owns the Adam-mini block [j bn, (j + 1) bn). Its sum
// of squares is a tree sum (each thread's terms in order, then a halving tree) checked against
// the bound above; the ordered sum only where the check cannot decide.
__global__ void __launch_bounds__(kBlock) adam_mini_kernel(float* p0, const float* g0, float* m0, float* vb,
                                                           int64_t nblocks, int64_t bn, float eta, float decay,
                                                           float gs, float b1, float eps, float bias1, double b2,
                                                           double bias2) {
  __shared__ double tiles[2][kTile];
  __shared__ double red[kBlock];
  __shared__ float v_shared, denom_shared;
  __shared__ int decided;
  const int tid = static_cast<int>(threadIdx.x);
  for (int64_t j = blockIdx.x; j < nblocks; j += gridDim.x) {
    const int64_t offset = j * bn;
    const ScaledSquare term{g0 + offset, gs};
    if (bn > kTile) {  // uniform; a block of one tile is summed in order straight away (a few us)
      double part = 0.0;
      for (int64_t i = tid; i < bn; i += kBlock) part += term(i);
      red[tid] = part;
      __syncthreads();
      for (int half = kBlock / 2; half > 0; half >>= 1) {
        if (tid < half) red[tid] += red[tid + half];
        __syncthreads();
      }
      if (tid == 0) {
        const double e = sum_bound(bn);
        const float lo = adam_mini_v(red[0] * (1.0 - e), vb[j], bn, b2);
        const float hi = adam_mini_v(red[0] * (1.0 + e), vb[j], bn, b2);
        decided = lo == hi ? 1 : 0;
        v_shared = lo;
      }
    } else if (tid == 0) {
      decided = 0;
    }
    __syncthreads();
    if (decided == 0) {  // uniform across the block
      const double sq = ordered_sum(bn, term, tiles);
      if (tid == 0) v_shared = adam_mini_v(sq, vb[j], bn, b2);
    }
    if (tid == 0) {
      vb[j] = v_shared;
      denom_shared = static_cast<float>(::sqrt(static_cast<double>(v_shared) / bias2)) + eps;
    }
    __syncthreads();
    const float denom = denom_shared;
    for (int64_t i = offset + tid; i < offset + bn; i += kBlock) {
      const float d = mul_rn(g0[i], gs);
      const float mi = fma_rn(b1, m0[i], mul_rn(1.0f - b1, d));          // b1 m + (1 - b1) d
      m0[i] = mi;
      p0[i] = fma_rn(p0[i], decay, -(mul_rn(eta, mi / bias1) / denom));  // p decay - eta (m / bias1) / denom
    }
    __syncthreads();  // the shared values are rewritten for the next block
  }
}

struct Square {  // (double)u[i]^2, exact in double
  const float* u;
  __device__ double operator()(int64_t i) const { return static_cast<double>(u[i]) * u[i]; }
};

__device__ __forceinline__ float inverse_norm_of(double sq) { return static_cast<float>(1.0 / (::sqrt(sq) + 1e-7)); }

// One thread: the kReducePartials partials of reduce_partials (cuda_kernels.h) added in index
// order, checked against the bound; *inv written and *serial = 0 when decided, else *serial = 1.
__global__ void inverse_norm_check_kernel(const double* partials, int64_t n, float* inv, int* serial) {
  double st = 0.0;
  for (int k = 0; k < kReducePartials; ++k) st += partials[k];
  const double e = sum_bound(n);
  const float lo = inverse_norm_of(st * (1.0 + e)), hi = inverse_norm_of(st * (1.0 - e));
  *inv = lo;
  *serial = lo == hi ? 0 : 1;
}

// One block: *inv = f32(1 / (sqrt(ordered sum of u^2) + 1e-7)), unless *serial is 0 (decided).
__global__ void __launch_bounds__(kBlock) inverse_norm_kernel(const float* u, int64_t n, float* inv,
                                                              const int* serial) {
  __shared__ double tiles[2][kTile];
  if (serial != nullptr && *serial == 0) return;  // the same for every thread: before any barrier
  const double norm = ordered_sum(n, Square{u}, tiles);
  if (threadIdx.x == 0) *inv = inverse_norm_of(norm);
}

// ---------------------------------------------------------------- transpose
// dst (cols, rows) = scale src^T: block (32, 8) moves the 32 x 32 tile at (blockIdx.y, blockIdx.x)
// through shared memory (one column of padding: no bank conflicts), both sides coalesced.
__global__ void __launch_bounds__(kTransposeTile * kTransposeRows) transpose_kernel(const float* src, float* dst,
                                                                                  int64_t rows, int64_t cols,
                                                                                  float scale, const float* scale_dev) {
  __shared__ float tile[kTransposeTile][kTransposeTile + 1];
  const float s = scale_dev != nullptr ? *scale_dev : scale;
  for (int64_t by = blockIdx.y; by * kTransposeTile < rows; by += gridDim.y) {
    for (int64_t bx = blockIdx.x; bx * kTransposeTile < cols; bx += gridDim.x) {
      const int64_t r0 = by * kTransposeTile, c0 = bx * kTransposeTile;
      for (int k = threadIdx.y; k < kTransposeTile; k += kTransposeRows) {
        const int64_t r = r0 + k, c = c0 + threadIdx.x;
        if (r < rows && c < cols) tile[k][threadIdx.x] = src[r * cols + c];
      }
      __syncthreads();
      for (int k = threadIdx.y; k < kTransposeTile; k += kTransposeRows) {
        const int64_t c = c0 + k, r = r0 + threadIdx.x;  // dst row c, column r
        if (r < rows && c < cols) dst[c * rows + r] = tile[threadIdx.x][k] * s;
      }
      __syncthreads();  // the tile is refilled by the next iteration
    }
  }
}

// ---------------------------------------------------------------- soft-target loss
// One block per row (grid-stride over rows). Pass 1: each thread keeps a running (max, sum of
// exp(x - max)) of s/T and t/T over its elements v = tid, tid + 256, ... (online softmax), merged
// by a halving tree: lse = max + log(sum). Pass 2: the gradient of each element, and kl summed
// per thread then by a halving tree. Sums and the log-sum-exps in double, as the CPU's.
constexpr int kRowBlock = 256;

__device__ __forceinline__ void online_add(double& m, double& z, double x) {
  if (x > m) {
    z = z * ::exp(m - x) + 1.0;  // m = -inf: z = 0
    m = x;
  } else if (m != -CUDART_INF) {
    z += ::exp(x - m);
  }
}
__device__ __forceinline__ void online_merge(double& m, double& z, double m2, double z2) {
  const double mm = ::fmax(m, m2);
  const double a = m == -CUDART_INF ? 0.0 : z * ::exp(m - mm);
  const double b = m2 == -CUDART_INF ? 0.0 : z2 * ::exp(m2 - mm);
  m = mm;
  z = a + b;
}

__global__ void __launch_bounds__(kRowBlock) soft_target_kernel(const float* s, const float* t, float* losses,
                                                                float* grad, int64_t rows, int64_t vocab, double T,
                                                                float grad_scale) {
  __shared__ double red[4][kRowBlock];
  const int tid = static_cast<int>(threadIdx.x);
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const float* si = s + row * vocab;
    const float* ti = t + row * vocab;
    float* gi = grad + row * vocab;
    double ms = -CUDART_INF, zs = 0.0, mt = -CUDART_INF, zt = 0.0;
    for (int64_t v = tid; v < vocab; v += kRowBlock) {
      online_add(ms, zs, si[v] / T);
      online_add(mt, zt, ti[v] / T);
    }
    red[0][tid] = ms, red[1][tid] = zs, red[2][tid] = mt, red[3][tid] = zt;
    __syncthreads();
    for (int half = kRowBlock / 2; half > 0; half >>= 1) {
      if (tid < half) {
        online_merge(red[0][tid], red[1][tid], red[0][tid + half], red[1][tid + half]);
        online_merge(red[2][tid], red[3][tid], red[2][tid + half], red[3][tid + half]);
      }
      __syncthreads();
    }
    const double lse_s = red[0][0] + ::log(red[1][0]), lse_t = red[2][0] + ::log(red[3][0]);
    __syncthreads();  // red is reused below
    double kl = 0.0;
    for (int64_t v = tid; v < vocab; v += kRowBlock) {
      const double log_ps = si[v] / T - lse_s, log_pt = ti[v] / T - lse_t, pt = ::exp(log_pt);
      kl += pt * (log_pt - log_ps);
      gi[v] = static_cast<float>(grad_scale * T * (::exp(log_ps) - pt));
    }
    red[0][tid] = kl;
    __syncthreads();
    for (int half = kRowBlock / 2; half > 0; half >>= 1) {
      if (tid < half) red[0][tid] += red[0][tid + half];
      __syncthreads();
    }
    if (tid == 0) losses[row] = static_cast<float>(T * T * red[0][0]);
    __syncthreads();  // red[0][0] is rewritten by the next row
  }
}

}  // namespace

// ================================================================ launchers

void sgd_step(float* p, const float* grad, float* buf, int64_t n, float lr, float wd, float gs, float mu, float damp,
              bool nesterov, bool first, cudaStream_t stream) {
  const SgdOp op{mu, damp, lr, wd, gs, nesterov, first, buf != nullptr};
  run_elementwise(op, Operands<3>{{p, const_cast<float*>(grad), buf}}, n, stream);
}

void adagrad_step(float* p, const float* grad, float* sum, int64_t n, float lr, float wd, float gs, float eps,
                  cudaStream_t stream) {
  const AdagradOp op{eps, lr, wd, gs};
  run_elementwise(op, Operands<3>{{p, const_cast<float*>(grad), sum}}, n, stream);
}

void rmsprop_step(float* p, const float* grad, float* square, float* avg, float* buf, int64_t n, float lr, float wd,
                  float gs, float a, float eps, float mu, cudaStream_t stream) {
  const RmspropOp op{a, eps, mu, lr, wd, gs, avg != nullptr, buf != nullptr};
  run_elementwise(op, Operands<5>{{p, const_cast<float*>(grad), square, avg, buf}}, n, stream);
}

void adam_step(float* p, const float* grad, float* m, float* v, float* vmax, int64_t n, float step_size, float l2,
               float decay, float gs, float b1, float b2, float eps, float bias2_sqrt, cudaStream_t stream) {
  const AdamOp op{step_size, l2, decay, gs, b1, b2, eps, bias2_sqrt, vmax != nullptr};
  run_elementwise(op, Operands<5>{{p, const_cast<float*>(grad), m, v, vmax}}, n, stream);
}

void lion_step(float* p, const float* grad, float* m, int64_t n, float lr, float decay, float gs, float b1, float b2,
               cudaStream_t stream) {
  const LionOp op{b1, b2, lr, decay, gs};
  run_elementwise(op, Operands<3>{{p, const_cast<float*>(grad), m}}, n, stream);
}

void adam_mini_step(float* p, const float* grad, float* m, float* v, int64_t nblocks, int64_t bn, float lr, float decay,
                    float gs, float b1, float eps, float bias1, double b2, double bias2, cudaStream_t stream) {
  if (nblocks <= 0 || bn <= 0) return;
  launch<adam_mini_kernel>(grid_for(nblocks, 1), kBlock, 0, stream, p, grad, m, v, nblocks, bn, lr, decay, gs, b1, eps,
                           bias1, b2, bias2);
  LOOM_CUDA_CHECK_LAUNCH();
}

void scale_transpose(const float* src, float* dst, int64_t rows, int64_t cols, float scale, const float* scale_dev,
                     bool transpose, cudaStream_t stream) {
  if (rows <= 0 || cols <= 0) return;
  if (!transpose) {
    run_elementwise(ScaleOp{scale, scale_dev}, Operands<2>{{dst, const_cast<float*>(src)}}, rows * cols, stream);
    return;
  }
  const int64_t tiles_x = (cols + kTransposeTile - 1) / kTransposeTile;
  const int64_t tiles_y = (rows + kTransposeTile - 1) / kTransposeTile;
  const dim3 grid(static_cast<unsigned>(std::min<int64_t>(tiles_x, kMaxBlocks)),
                  static_cast<unsigned>(std::min<int64_t>(tiles_y, 65535)));
  launch<transpose_kernel>(grid, dim3(kTransposeTile, kTransposeRows), 0, stream, src, dst, rows, cols, scale,
                           scale_dev);
  LOOM_CUDA_CHECK_LAUNCH();
}

void axpy(float* y, const float* x, int64_t n, float alpha, cudaStream_t stream) {
  run_elementwise(AxpyOp{alpha}, Operands<2>{{y, const_cast<float*>(x)}}, n, stream);
}

void muon_momentum(const float* grad, float* buf, float* u, int64_t n, float mu, float gs, bool nesterov,
                   cudaStream_t stream) {
  run_elementwise(MuonMomentumOp{mu, gs, nesterov}, Operands<3>{{const_cast<float*>(grad), buf, u}}, n, stream);
}

size_t inverse_norm_scratch_bytes() { return kReducePartials * sizeof(double) + sizeof(int); }

void inverse_norm(const float* u, int64_t n, float* inv, void* scratch, cudaStream_t stream) {
  n = std::max<int64_t>(n, 0);
  const int* serial = nullptr;
  if (n > kTile) {  // a tree sum over the grid, then the bound check; else only the ordered sum
    double* partials = static_cast<double*>(scratch);
    int* flag = reinterpret_cast<int*>(partials + kReducePartials);
    reduce_partials<float>(u, n, true, partials, stream);
    launch<inverse_norm_check_kernel>(1, 1, 0, stream, partials, n, inv, flag);
    LOOM_CUDA_CHECK_LAUNCH();
    serial = flag;
  }
  launch<inverse_norm_kernel>(1, kBlock, 0, stream, u, n, inv, serial);
  LOOM_CUDA_CHECK_LAUNCH();
}

void decayed_update(float* p, const float* u, int64_t n, float decay, float step, cudaStream_t stream) {
  run_elementwise(DecayedUpdateOp{decay, step}, Operands<2>{{p, const_cast<float*>(u)}}, n, stream);
}

void soft_target_loss(const float* logits, const float* teacher, float* losses, float* grad, int64_t rows,
                      int64_t vocab, double temperature, float grad_scale, cudaStream_t stream) {
  if (rows <= 0 || vocab <= 0) return;
  launch<soft_target_kernel>(grid_for(rows, 1), kRowBlock, 0, stream, logits, teacher, losses, grad, rows, vocab,
                             temperature, grad_scale);
  LOOM_CUDA_CHECK_LAUNCH();
}

}  // namespace loom::cuda
