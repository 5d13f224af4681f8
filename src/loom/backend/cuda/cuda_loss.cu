// The cross-entropy kernels (cuda_loss.h): the formula of the CPU's (cpu/cpu_kernels.h),
//   lse = max + log(sum exp(x - max)); loss = lse - x[target]; dx = dloss (exp(x - lse) - [v == target])
// in T (float, or double for reference checks), with exp from backend/scalar_math.h.
//
// One block of kCeBlock threads per row, grid-stride over rows. The log-sum-exp is an online
// (max, sum) state (Milakov & Gimelshein 2018) that thread t folds over v = t, t + kCeBlock, ...
// in that order, then a fixed shuffle tree per warp and a fixed tree over the warps' states: the
// same bits on every run. Each thread keeps kCeLoads loads in flight and folds them in the order
// of the plain loop (one load at a time left 2 KB in flight per block, far below what the memory
// needs to stream; Little's law at 3.35 TB/s and ~0.7 us is ~17 KB per multiprocessor).
//
// The fused kernel (the training step's loss and d(logits)) reads a row for its log-sum-exp and
// again for the gradient right after: with the rows in flight held under kCeRowBytesInFlight (the
// grid's cap) the second read comes from L2 (50 MB on an H100), so the logits cross the memory
// bus once, against three times (forward, backward in place, the cast to bf16) for the separate
// ops, plus the bf16 gradient written once. The columns kernel (further down) does the same for
// logits kept by columns (V, N), a training step's layout where the vocabulary's rows are odd.

#include "loom/backend/cuda/cuda_device.h"  // first: the portability layer (docs/accelerators.md)
#include "loom/backend/cuda/cuda_loss.h"

#include <algorithm>
#include <cfloat>
#include <cstdint>

#include "loom/backend/cuda/cuda_check.h"
#include "loom/backend/cuda/cuda_launch.h"
#include "loom/backend/scalar_math.h"
#include "loom/core/targets.h"

namespace loom::cuda {
namespace {

using math::exp_t;

constexpr int kCeBlock = 512;  // threads per row
constexpr int kCeWarps = kCeBlock / kWarp;
constexpr int kCeLoads = 8;    // loads in flight per thread
// The fused kernel's grid: at most this many bytes of rows in flight (so the gradient's second
// read of a row finds it in L2), but at least kCeMinBlocks rows (an H100's 132 multiprocessors).
constexpr int64_t kCeRowBytesInFlight = int64_t{32} << 20;
constexpr int64_t kCeMinBlocks = 132;

// The start of a max: the lowest finite T, so -inf logits add exp(-inf) as on the CPU and never
// form inf - inf.
template <typename T>
__device__ __forceinline__ T lowest_finite() {
  return sizeof(T) == 4 ? T(-FLT_MAX) : T(-DBL_MAX);
}

// Combining two states: the larger max wins, the other sum is rescaled by exp(max2 - max). A state
// with sum 0 (no element yet) contributes nothing; the combine is commutative bitwise.
template <typename T>
__device__ __forceinline__ void lse_combine(T& max, T& sum, T max2, T sum2) {
  if (max2 > max) {
    const T m = max, s = sum;
    max = max2;
    sum = sum2;
    max2 = m;
    sum2 = s;
  }
  if (sum2 != T(0)) sum += sum2 * exp_t<T>(max2 - max);
}

template <typename T>
__device__ __forceinline__ void lse_fold(T& max, T& sum, T xv) {
  if (xv > max) {
    sum = sum * exp_t<T>(max - xv) + T(1);
    max = xv;
  } else {
    sum += exp_t<T>(xv - max);
  }
}

// A logit as T: stored as T, or bf16 bits (L = uint16_t, a bf16 head's output) widened exactly.
template <typename T, typename L>
__device__ __forceinline__ T logit(L x) {
  if constexpr (sizeof(L) == 2) return bf16_value(x);
  else return x;
}

// fn(v, x[v * stride]) for v = first, first + step, ... below vocab in that order, with kCeLoads
// loads in flight (each batch loaded before fn sees it: fn may overwrite the elements it is given).
template <typename T, typename L, typename Fn>
__device__ __forceinline__ void for_strided(const L* x, int64_t stride, int64_t first, int64_t step, int64_t vocab,
                                            Fn&& fn) {
  int64_t v = first;
  for (; v + (kCeLoads - 1) * step < vocab; v += kCeLoads * step) {
    L xs[kCeLoads];
#pragma unroll
    for (int i = 0; i < kCeLoads; ++i) xs[i] = x[(v + i * step) * stride];
#pragma unroll
    for (int i = 0; i < kCeLoads; ++i) fn(v + i * step, logit<T>(xs[i]));
  }
  for (; v < vocab; v += step) fn(v, logit<T>(x[v * stride]));
}
// A row's elements: this thread's v = t, t + kCeBlock, ...
template <typename T, typename L, typename Fn>
__device__ __forceinline__ void for_row(const L* x, int64_t vocab, Fn&& fn) {
  for_strided<T>(x, 1, threadIdx.x, kCeBlock, vocab, static_cast<Fn&&>(fn));
}

// The warp's states combined into lane 0's by a fixed shuffle tree.
template <typename T>
__device__ __forceinline__ void warp_lse_combine(T& max, T& sum) {
  for (int offset = kWarp / 2; offset > 0; offset >>= 1) {
    const T max2 = shfl_down(max, offset);
    const T sum2 = shfl_down(sum, offset);
    lse_combine(max, sum, max2, sum2);
  }
}

// The block's log-sum-exp of row x, valid in thread 0. Every thread of the block calls it; the
// shared states may be rewritten only after a barrier.
template <typename T, typename L>
__device__ T row_lse(const L* x, int64_t vocab, T* warp_max, T* warp_sums) {
  const int lane = static_cast<int>(threadIdx.x) % kWarp, warp = static_cast<int>(threadIdx.x) / kWarp;
  T max = lowest_finite<T>(), sum = T(0);
  for_row<T>(x, vocab, [&](int64_t, T xv) { lse_fold(max, sum, xv); });
  warp_lse_combine(max, sum);
  if (lane == 0) {
    warp_max[warp] = max;
    warp_sums[warp] = sum;
  }
  __syncthreads();
  if (warp == 0) {
    max = lane < kCeWarps ? warp_max[lane] : lowest_finite<T>();
    sum = lane < kCeWarps ? warp_sums[lane] : T(0);
    warp_lse_combine(max, sum);
  }
  return max + log_of(sum);
}

// One gradient element, the one expression both the backward and the fused kernel evaluate.
template <typename T>
__device__ __forceinline__ T ce_grad(T x, T l, T dloss, bool target) {
  T value = dloss * exp_t<T>(x - l);
  if (target) value -= dloss;
  return value;
}
template <typename D, typename T>
__device__ __forceinline__ D grad_out(T v) {
  if constexpr (sizeof(D) == 2) return bf16_bits(v);  // D = uint16_t: rounded as the cast
  else return v;
}

// d = the gradient of row x (each element read and written by one thread: d may alias x), or
// zeros for a row without a loss.
template <typename T, typename L, typename D>
__device__ void row_grad(const L* x, D* d, int64_t vocab, T l, T dloss, int32_t target) {
  for_row<T>(x, vocab, [&](int64_t v, T xv) { d[v] = grad_out<D>(ce_grad(xv, l, dloss, v == target)); });
}
template <typename D>
__device__ void row_zeros(D* d, int64_t vocab) {
  for (int64_t v = threadIdx.x; v < vocab; v += kCeBlock) d[v] = D(0);
}

// A masked row (kIgnoreTarget: loss 0) or a bad target (recorded, the row skipped): block-uniform.
template <typename T>
__device__ bool row_without_loss(int32_t target, int64_t r, int64_t vocab, T* losses, T* lse,
                                 unsigned long long* bad_row) {
  if (target != kIgnoreTarget && target >= 0 && target < vocab) return false;
  if (threadIdx.x == 0) {
    if (target != kIgnoreTarget) atomicMin(bad_row, static_cast<unsigned long long>(r));
    losses[r] = lse[r] = T(0);
  }
  return true;
}

template <typename T>
__global__ void __launch_bounds__(kCeBlock) cross_entropy_forward_kernel(const T* logits, const int32_t* targets,
                                                                         T* losses, T* lse, int64_t rows,
                                                                         int64_t vocab,
                                                                         unsigned long long* bad_row) {
  __shared__ T warp_max[kCeWarps], warp_sums[kCeWarps];
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    if (row_without_loss(targets[r], r, vocab, losses, lse, bad_row)) continue;
    const T* x = logits + r * vocab;
    const T l = row_lse(x, vocab, warp_max, warp_sums);
    if (threadIdx.x == 0) {
      lse[r] = l;
      losses[r] = l - x[targets[r]];
    }
    __syncthreads();  // warp_max / warp_sums are rewritten by the next row
  }
}

// A row with a bad target is written 0.
template <typename T>
__global__ void __launch_bounds__(kCeBlock) cross_entropy_backward_kernel(const T* logits, const int32_t* targets,
                                                                          const T* lse, T dloss, T* dlogits,
                                                                          int64_t rows, int64_t vocab) {
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const int32_t target = targets[r];
    if (target < 0 || target >= vocab) row_zeros(dlogits + r * vocab, vocab);
    else row_grad(logits + r * vocab, dlogits + r * vocab, vocab, lse[r], dloss, target);
  }
}

template <typename T, typename L, typename D>
__global__ void __launch_bounds__(kCeBlock)
    cross_entropy_loss_and_grad_kernel(const L* logits, const int32_t* targets, T* losses, T* lse, T dloss,
                                       D* dlogits, int64_t rows, int64_t vocab, unsigned long long* bad_row) {
  __shared__ T warp_max[kCeWarps], warp_sums[kCeWarps], row_l[1];
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const int32_t target = targets[r];
    D* d = dlogits + r * vocab;
    if (row_without_loss(target, r, vocab, losses, lse, bad_row)) {
      row_zeros(d, vocab);
      continue;
    }
    const L* x = logits + r * vocab;
    const T l = row_lse(x, vocab, warp_max, warp_sums);
    if (threadIdx.x == 0) {
      lse[r] = l;
      losses[r] = l - logit<T>(x[target]);  // read before any thread overwrites the row in place
      row_l[0] = l;
    }
    __syncthreads();
    row_grad(x, d, vocab, row_l[0], dloss, target);
    __syncthreads();  // row_l, warp_max and warp_sums are rewritten by the next row
  }
}

// Logits kept by columns (vocab, cols): a block owns kColLanes consecutive columns (a warp's
// lanes, so each load of a warp is one 128-byte row segment) and splits their rows over its
// kColWarps warps (warp w: rows w, w + kColWarps, ...). Each thread folds its column's rows; warp 0
// combines the warps' states in warp order, writes loss and lse; then every thread writes the
// gradient of its rows. A column's masked or bad target (per lane here) is not read: loss 0 and a
// zero gradient column, a bad one recorded. The rows are read twice from memory (a block's columns
// span all V rows: no L2 reuse), so this kernel moves 10 bytes an f32 logit (4 + 4 + 2) where the
// row kernel moves 6; it pays where it spares the head's GEMMs their staged panels (16).
constexpr int kColLanes = kWarp;
constexpr int kColWarps = 16;

template <typename T, typename L, typename D>
__global__ void __launch_bounds__(kColLanes * kColWarps)
    cross_entropy_columns_kernel(const L* logits, const int32_t* targets, T* losses, T* lse, T dloss, D* dlogits,
                                 int64_t cols, int64_t vocab, unsigned long long* bad_col) {
  __shared__ T part_max[kColWarps][kColLanes], part_sum[kColWarps][kColLanes], col_l[kColLanes];
  const int lane = static_cast<int>(threadIdx.x) % kWarp, warp = static_cast<int>(threadIdx.x) / kWarp;
  for (int64_t c0 = static_cast<int64_t>(blockIdx.x) * kColLanes; c0 < cols;
       c0 += static_cast<int64_t>(gridDim.x) * kColLanes) {
    const int64_t n = c0 + lane;
    const int32_t target = n < cols ? targets[n] : kIgnoreTarget;
    const bool live = n < cols && target >= 0 && target < vocab;
    T max = lowest_finite<T>(), sum = T(0);
    if (live) for_strided<T>(logits + n, cols, warp, kColWarps, vocab, [&](int64_t, T xv) { lse_fold(max, sum, xv); });
    part_max[warp][lane] = max;
    part_sum[warp][lane] = sum;
    __syncthreads();
    if (warp == 0) {
      max = part_max[0][lane];
      sum = part_sum[0][lane];
      for (int w = 1; w < kColWarps; ++w) lse_combine(max, sum, part_max[w][lane], part_sum[w][lane]);
      const T l = max + log_of(sum);
      col_l[lane] = l;
      if (live) {
        lse[n] = l;
        losses[n] = l - logit<T>(logits[target * cols + n]);  // read before any thread overwrites the column in place
      } else if (n < cols) {
        if (target != kIgnoreTarget) atomicMin(bad_col, static_cast<unsigned long long>(n));
        losses[n] = lse[n] = T(0);
      }
    }
    __syncthreads();
    if (live) {
      const T l = col_l[lane];
      D* d = dlogits + n;
      for_strided<T>(logits + n, cols, warp, kColWarps, vocab,
                     [&](int64_t v, T xv) { d[v * cols] = grad_out<D>(ce_grad(xv, l, dloss, v == target)); });
    } else if (n < cols) {
      for (int64_t v = warp; v < vocab; v += kColWarps) dlogits[v * cols + n] = D(0);
    }
    __syncthreads();  // part_max, part_sum and col_l are rewritten by the next columns
  }
}

}  // namespace

template <typename T, typename L, typename D>
void cross_entropy_loss_and_grad_columns(const L* logits, const int32_t* targets, T* losses, T* lse, double dloss,
                                         D* dlogits, int64_t cols, int64_t vocab, unsigned long long* bad_col,
                                         cudaStream_t stream) {
  if (cols <= 0) return;
  launch<cross_entropy_columns_kernel<T, L, D>>(grid_for(cols, kColLanes), kColLanes * kColWarps, 0, stream, logits,
                                             targets, losses, lse, static_cast<T>(dloss), dlogits, cols, vocab,
                                             bad_col);
  LOOM_CUDA_CHECK_LAUNCH();
}

template <typename T>
void cross_entropy_forward(const T* logits, const int32_t* targets, T* losses, T* lse, int64_t rows, int64_t vocab,
                           unsigned long long* bad_row, cudaStream_t stream) {
  if (rows <= 0) return;
  launch<cross_entropy_forward_kernel<T>>(grid_for(rows, 1), kCeBlock, 0, stream, logits, targets, losses, lse, rows,
                                          vocab, bad_row);
  LOOM_CUDA_CHECK_LAUNCH();
}

template <typename T>
void cross_entropy_backward(const T* logits, const int32_t* targets, const T* lse, double dloss, T* dlogits,
                            int64_t rows, int64_t vocab, cudaStream_t stream) {
  if (rows <= 0) return;
  launch<cross_entropy_backward_kernel<T>>(grid_for(rows, 1), kCeBlock, 0, stream, logits, targets, lse,
                                           static_cast<T>(dloss), dlogits, rows, vocab);
  LOOM_CUDA_CHECK_LAUNCH();
}

template <typename T, typename L, typename D>
void cross_entropy_loss_and_grad(const L* logits, const int32_t* targets, T* losses, T* lse, double dloss,
                                 D* dlogits, int64_t rows, int64_t vocab, unsigned long long* bad_row,
                                 cudaStream_t stream) {
  if (rows <= 0) return;
  const int64_t row_bytes = std::max<int64_t>(vocab, 1) * static_cast<int64_t>(sizeof(L));
  const int64_t cap = std::max(kCeMinBlocks, kCeRowBytesInFlight / row_bytes);
  launch<cross_entropy_loss_and_grad_kernel<T, L, D>>(grid_for(rows, 1, cap), kCeBlock, 0, stream, logits, targets,
                                                   losses, lse, static_cast<T>(dloss), dlogits, rows, vocab, bad_row);
  LOOM_CUDA_CHECK_LAUNCH();
}

#define LOOM_CUDA_LOSS_INSTANTIATE(T)                                                                                 \
  template void cross_entropy_forward<T>(const T*, const int32_t*, T*, T*, int64_t, int64_t, unsigned long long*,    \
                                         cudaStream_t);                                                              \
  template void cross_entropy_backward<T>(const T*, const int32_t*, const T*, double, T*, int64_t, int64_t,          \
                                          cudaStream_t);

#define LOOM_CUDA_FUSED_LOSS_INSTANTIATE(T, L, D)                                                                     \
  template void cross_entropy_loss_and_grad<T, L, D>(const L*, const int32_t*, T*, T*, double, D*, int64_t, int64_t, \
                                                     unsigned long long*, cudaStream_t);                             \
  template void cross_entropy_loss_and_grad_columns<T, L, D>(const L*, const int32_t*, T*, T*, double, D*, int64_t,  \
                                                             int64_t, unsigned long long*, cudaStream_t);

LOOM_CUDA_LOSS_INSTANTIATE(float)
LOOM_CUDA_LOSS_INSTANTIATE(double)
LOOM_CUDA_FUSED_LOSS_INSTANTIATE(float, float, float)
LOOM_CUDA_FUSED_LOSS_INSTANTIATE(double, double, double)
LOOM_CUDA_FUSED_LOSS_INSTANTIATE(float, float, uint16_t)     // f32 logits, the gradient rounded to bf16
LOOM_CUDA_FUSED_LOSS_INSTANTIATE(float, uint16_t, uint16_t)  // bf16 logits, the bf16 gradient in place

}  // namespace loom::cuda
