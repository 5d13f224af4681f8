// The kernels' portability layer: the one header every .cu file of the CUDA backend includes for
// its device code. The same sources build three ways (docs/accelerators.md):
//   nvcc      the CUDA toolkit's cuda_runtime.h, cuda_bf16.h, math_constants.h (the GPU build);
//   g++       the simulator's stand-ins of those headers (sim/include/, LOOM_CUDA_SIM: the CPU
//             runs each GPU thread as a fiber; docs/cuda.md "The simulator");
//   hipcc     ROCm's HIP (<hip/hip_runtime.h>; __HIPCC__, __HIP_PLATFORM_AMD__), for AMD GPUs and
//             Hygon DCUs: LOOM_CUDA_HIP below. The launcher headers' <cuda_runtime_api.h> and
//             cuda_launch.h's <cuda_runtime.h> are then hip/include/'s, which include this file.
// Under HIP this file maps the CUDA names the kernels and launchers use: cudaStream_t,
// cudaError_t, cudaSuccess, cudaGetErrorString, cudaGetLastError, cudaMemsetAsync (HIP Runtime
// API reference: hipStream_t, hipGetLastError, hipMemsetAsync), __nv_bfloat16 with the cvt
// instructions' rounding (ROCm 5.2 has no hip_bf16.h), CUDART_INF_F / CUDART_INF. dim3,
// threadIdx / blockIdx / blockDim / gridDim, __syncthreads(_count), the atomics, the bit casts,
// __fmaf_rn / __fma_rn, float4 / double2 / int4, __launch_bounds__, __restrict__ and __align__
// are HIP's own (HIP Programming Guide, "HIP C++ language extensions"). A kernel launch stays
// kernel<<<grid, block, shared, stream>>>(...) (cuda_launch.h), which hip-clang compiles.
//
// Logical 32-lane warps. Every kernel is written for 32-lane warps: a warp owns a row, lane =
// threadIdx.x % 32, trees of 5 xor shuffles, 32-bit ballots. NVIDIA warps and RDNA's wave32
// (gfx1030) are 32 wide; AMD CDNA (gfx906 / MI50 and the Hygon DCUs built on it, gfx908 / MI100,
// gfx90a / MI200) run 64-wide wavefronts (HIP Programming Guide, "Warp cross-lane functions":
// warpSize is 64 there). On HIP the kernels keep their logical 32-lane warps inside the
// wavefront, so every kernel does the same arithmetic in the same order on both vendors:
//   shfl_xor, shfl_down, shfl   __shfl_xor / __shfl_down / __shfl with width 32 (HIP's width
//                               argument confines the exchange to the aligned 32-lane half of
//                               the wavefront, as CUDA's width does inside a warp); values of 4
//                               or 8 bytes move as 32-bit words (ds_bpermute).
//   ballot                      __ballot (64 bits on wave64) shifted to the logical warp's 32
//                               bits: (ballot >> (__lane_id() & 32)); on wave32 the upper half
//                               is 0 and the shift is 0.
//   all_of                      that 32-bit ballot == 0xffffffff.
//   warp_sync (__syncwarp)      ROCm 5.2 has no __syncwarp: the lanes of a wavefront execute
//                               together, so it is a wavefront-scope release/acquire fence around
//                               __builtin_amdgcn_wave_barrier (which keeps the compiler from
//                               moving shared-memory accesses across it).
// CUDA's *_sync masks: every call in Loom is full-warp (0xffffffff) with every lane of the
// logical warp present, so the HIP forms need no mask. The helpers below are the only shuffles,
// votes and warp barriers of the kernels; an audit of each use (all call sites, by file):
//   cuda_kernels.cu      warp_sum (norms, a warp per row).
//   cuda_loss.cu         the cross-entropy's shfl_down tree of (max, sum) states, per warp and then
//                        over the 16 warps' states in warp 0.
//   cuda_attention.cu    warp_sum / warp_fold (probs-path softmax, dscores, D), group_sum<kG>
//                        (kG = 1..32 consecutive lanes own one flash row: xor offsets < kG stay
//                        inside the group, hence inside the logical warp).
//   cuda_flash_mma.cu    quad_max / quad_sum (xor 1 and 2 inside a group of 4 lanes), warp_sum;
//                        through cuda_mma.h the MMA twin's and the ldmatrix twin's shfl (see below).
//   cuda_mla.cu, cuda_moe.cu, cuda_quant.cu, cuda_parallel.cu, cuda_weights.cu,
//   cuda_optim_factored.cu
//                        warp_sum / warp_max / warp_fold over the 32 lanes; moe's warp_argmax
//                        (two shfl_xor per level); quant's integer maxima (amax, MXFP4: xor 16
//                        .. 1; NVFP4 over the 16 lanes of a half warp: xor 8 .. 1) and MXFP4's
//                        all_of; moe's warp_sync between
//                        the router's shared-memory phases; weights' warp_sync around DoRA's
//                        per-warp shared tile.
//   cuda_compress.cu     1-bit encode: one ballot per 32 elements (the word's bits).
//   cuda_sample.cu       block_min's shfl_xor tree of ints; the block scan's inclusive scan of
//                        64-bit weight sums by shfl from lane - d (lane 0's own value below d).
//   cuda_decode.cu       warp_sum (decode attention's scores, split-KV merges).
// Warp-synchronous code without an exchange: none relies on lockstep. The "one thread adds, the
// other warps stage" kernels (compress's seq_sum and Gram-Schmidt) order through __syncthreads;
// on wave64 warps 0 and 1 share a wavefront and serialize there (correct, less overlap).
// __launch_bounds__(threads, n): CUDA's n is blocks per multiprocessor, HIP's minimum waves per
// execution unit (HIP Programming Guide, "__launch_bounds__"); both are hints, no semantics.
// Inline asm: cuda_mma.h's mma.sync and ldmatrix and cp_async below (PTX) are nvcc-only; HIP
// takes the portable twins (cp.async: a plain copy at issue).
// mul_rn's empty-asm register barrier is the simulator's (x86 g++) only.
//
// Tensor cores (cuda_mma.h): on HIP, mma_m16n8k16_bf16 is the simulator's twin made of 16 full-warp
// shuffles per product (correct, PTX fragment layouts, not fast). The port's next step is an
// MFMA path (__builtin_amdgcn_mfma_f32_16x16x16bf16_1k on gfx90a: a wavefront-wide 16x16x16
// product with its own fragment layout, CDNA2 ISA guide "Matrix Arithmetic Instructions").
//
// Bitwise: the helpers are the ones the .cu files had, one definition each. Sums and maxima keep
// their shuffle order, the math wrappers their functions (exp_of = expf / exp, not scalar_math's
// exp_t), mul_rn / fma_rn their single roundings: __fmul_rn on nvcc, an empty asm on the
// simulator (g++ contracts a * b + c under -ffp-contract=fast), `#pragma clang fp contract(off)`
// on HIP (hip-clang contracts by default: -ffp-contract=fast-honor-pragmas, Clang's "Controlling
// Floating Point Behavior"; HIP's __fmul_rn is a plain a * b in ROCm 5.2).
#pragma once

#if defined(__HIPCC__) || defined(__HIP_PLATFORM_AMD__)
#define LOOM_CUDA_HIP 1
#endif

#include <cstddef>
#include <cstdint>

#if defined(LOOM_CUDA_HIP)
#include <hip/hip_runtime.h>

#include <math.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <optional>
#include <string>
#include <string_view>

#include "loom/core/enum_names.h"
#include "loom/core/error.h"

// ---------------------------------------------------------------- HIP: runtime names
using cudaStream_t = hipStream_t;
using cudaError_t = hipError_t;
inline constexpr cudaError_t cudaSuccess = hipSuccess;
inline const char* cudaGetErrorString(cudaError_t error) { return hipGetErrorString(error); }
inline cudaError_t cudaGetLastError() { return hipGetLastError(); }
inline cudaError_t cudaMemsetAsync(void* ptr, int value, size_t bytes, cudaStream_t stream) {
  return hipMemsetAsync(ptr, value, bytes, stream);
}

// ---------------------------------------------------------------- HIP: math constants
#define CUDART_INF_F __builtin_huge_valf()
#define CUDART_INF __builtin_huge_val()
#define CUDART_NAN_F __builtin_nanf("")
#define CUDART_NAN __builtin_nan("")

// ---------------------------------------------------------------- HIP: cuda_bf16.h
// The part of cuda_bf16.h the kernels use, rounding as NVIDIA's cvt.rn.bf16.f32 (PTX ISA, "cvt"):
// to nearest even, overflow to infinity, NaN to the canonical 0x7fff (the simulator's
// sim/include/cuda_bf16.h rounds the same way). ROCm 5.2's hip_bfloat16 quiets a NaN instead.
struct __nv_bfloat16 {
  uint16_t __x;
};
__host__ __device__ __forceinline__ __nv_bfloat16 __float2bfloat16_rn(float f) {
  uint32_t u = __builtin_bit_cast(uint32_t, f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return __nv_bfloat16{0x7fff};
  u += 0x7fffu + ((u >> 16) & 1u);
  return __nv_bfloat16{static_cast<uint16_t>(u >> 16)};
}
__host__ __device__ __forceinline__ float __bfloat162float(__nv_bfloat16 h) {
  return __builtin_bit_cast(float, static_cast<uint32_t>(h.__x) << 16);
}
__host__ __device__ __forceinline__ unsigned short __bfloat16_as_ushort(__nv_bfloat16 h) { return h.__x; }
__host__ __device__ __forceinline__ __nv_bfloat16 __ushort_as_bfloat16(unsigned short x) { return __nv_bfloat16{x}; }

// The scalar math the kernels share with the CPU's (scalar_math.h: exp, tanh, sigmoid; rope.h:
// RoPE's frequencies; kv_quantize.h: the KV cache's quantizer; sampling_rule.h: the sampling rule) is __host__ __device__ under nvcc,
// where LOOM_HOST_DEVICE keys on __CUDACC__, which hip-clang does not define. Clang's `#pragma clang force_cuda_host_device`
// (Clang's CUDA support, as its own <complex> wrapper uses it) makes the functions declared
// between begin and end both; the headers they include are included above, outside it. So a .cu
// file includes this header (or, through hip/include/, <cuda_runtime_api.h>) before those two.
#pragma clang force_cuda_host_device begin
#include "loom/core/targets.h"
#include "loom/backend/scalar_math.h"
#include "loom/backend/rope.h"
#include "loom/backend/kv_quantize.h"
#include "loom/backend/sampling_rule.h"
#pragma clang force_cuda_host_device end

#else  // nvcc, or the simulator's stand-ins (sim/include/)
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <math_constants.h>

#include <cmath>
#endif

#include <algorithm>

namespace loom::cuda {

// ---------------------------------------------------------------- launch shapes
constexpr int kWarp = 32;                    // lanes of a (logical) warp, on every target
constexpr unsigned kFullMask = 0xffffffffu;  // CUDA's full-warp mask
constexpr int64_t kMaxBlocks = 8192;         // grid cap of grid-stride kernels (H100: 132 SMs x 2048 threads)

// Blocks for `items` work items at `per_block` items per block: at least 1, at most `cap`.
inline unsigned grid_for(int64_t items, int64_t per_block, int64_t cap = kMaxBlocks) {
  const int64_t blocks = (items + per_block - 1) / per_block;
  return static_cast<unsigned>(std::clamp<int64_t>(blocks, 1, cap));
}
// Scratch carving: a size rounded up to a multiple of 256 bytes.
inline size_t align256(size_t bytes) { return (bytes + 255) / 256 * 256; }

// ---------------------------------------------------------------- thread and grid indices
// Grid-stride loops: for (i = thread_index(); i < n; i += thread_count()).
__device__ __forceinline__ int64_t thread_index() {
  return static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}
__device__ __forceinline__ int64_t thread_count() { return static_cast<int64_t>(gridDim.x) * blockDim.x; }
// The lane in the logical warp (1-D blocks, or blocks whose x extent is a multiple of 32).
__device__ __forceinline__ int lane_id() { return static_cast<int>(threadIdx.x) % kWarp; }

// ---------------------------------------------------------------- bf16 bits
// f32 -> bf16 bits as core/dtype.h's f32_to_bf16 (the CPU's, and Backend::cast's): a NaN keeps its
// top bits with the quiet bit set; else add 0x7fff + (the kept half's lsb) and truncate, which
// rounds to nearest, ties to even. bf16_value widens the bits back, exactly.
__device__ __forceinline__ uint16_t bf16_bits(float v) {
  uint32_t u = __float_as_uint(v);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
__device__ __forceinline__ float bf16_value(uint16_t bits) { return __uint_as_float(static_cast<uint32_t>(bits) << 16); }
// f16 bits widened to f32, exactly (IEEE 754 binary16: every value, subnormals included, is an
// f32 one): the value F16C's vcvtph2ps gives on the CPU.
__device__ __forceinline__ float f16_value(uint16_t bits) {
  const uint32_t sign = static_cast<uint32_t>(bits & 0x8000u) << 16, exponent = (bits >> 10) & 0x1fu,
                 mantissa = bits & 0x3ffu;
  if (exponent == 0x1fu) return __uint_as_float(sign | 0x7f800000u | (mantissa << 13));  // inf, NaN
  if (exponent != 0) return __uint_as_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
  const float magnitude = static_cast<float>(mantissa) * 0x1p-24f;  // subnormal: exact
  return sign != 0 ? -magnitude : magnitude;
}

// ---------------------------------------------------------------- exchanges in the logical warp
// Every lane of the logical warp must call each of these together (CUDA's full mask).
#if defined(LOOM_CUDA_HIP)
namespace hip_detail {
// HIP's shuffles take int-sized words: a 4- or 8-byte value moves as one or two of them.
template <typename T, typename Exchange>
__device__ __forceinline__ T exchange_words(T v, Exchange exchange) {
  static_assert(sizeof(T) == 4 || sizeof(T) == 8, "shuffles move 4- or 8-byte values");
  if constexpr (sizeof(T) == 4) {
    return __builtin_bit_cast(T, exchange(__builtin_bit_cast(int, v)));
  } else {
    struct Words {
      int lo, hi;
    };
    Words w = __builtin_bit_cast(Words, v);
    w.lo = exchange(w.lo);
    w.hi = exchange(w.hi);
    return __builtin_bit_cast(T, w);
  }
}
}  // namespace hip_detail
#endif

template <typename T>
__device__ __forceinline__ T shfl_xor(T v, int lane_mask) {
#if defined(LOOM_CUDA_HIP)
  return hip_detail::exchange_words(v, [lane_mask](int x) { return __shfl_xor(x, lane_mask, kWarp); });
#else
  return __shfl_xor_sync(kFullMask, v, lane_mask);
#endif
}
template <typename T>
__device__ __forceinline__ T shfl_down(T v, unsigned delta) {
#if defined(LOOM_CUDA_HIP)
  return hip_detail::exchange_words(v, [delta](int x) { return __shfl_down(x, delta, kWarp); });
#else
  return __shfl_down_sync(kFullMask, v, delta);
#endif
}
// v of lane src_lane (0 <= src_lane < 32) of the logical warp.
template <typename T>
__device__ __forceinline__ T shfl(T v, int src_lane) {
#if defined(LOOM_CUDA_HIP)
  return hip_detail::exchange_words(v, [src_lane](int x) { return __shfl(x, src_lane, kWarp); });
#else
  return __shfl_sync(kFullMask, v, src_lane);
#endif
}
// Bit l: lane l's predicate.
__device__ __forceinline__ uint32_t ballot(bool predicate) {
#if defined(LOOM_CUDA_HIP)
  return static_cast<uint32_t>(__ballot(predicate) >> (__lane_id() & 32u));
#else
  return __ballot_sync(kFullMask, predicate);
#endif
}
__device__ __forceinline__ bool all_of(bool predicate) {
#if defined(LOOM_CUDA_HIP)
  return ballot(predicate) == kFullMask;
#else
  return __all_sync(kFullMask, predicate) != 0;
#endif
}
// Orders the logical warp's shared- and global-memory accesses (__syncwarp).
__device__ __forceinline__ void warp_sync() {
#if defined(LOOM_CUDA_HIP)
  __builtin_amdgcn_fence(__ATOMIC_RELEASE, "wavefront");
  __builtin_amdgcn_wave_barrier();
  __builtin_amdgcn_fence(__ATOMIC_ACQUIRE, "wavefront");
#else
  __syncwarp();
#endif
}

// ---------------------------------------------------------------- asynchronous copies
// cp.async (PTX ISA 9.2, section 9.7.9.25.3 "Data Movement and Conversion Instructions: cp.async"):
// kBytes (4, 8 or 16; both addresses aligned to it) from global to shared memory without a register,
// the copies committed as a group (cp_async_commit) and waited for by group (cp_async_wait<n>:
// every committed group of this thread but the newest n complete); other threads see the bytes
// after a __syncthreads that follows the wait. 16-byte copies bypass L1 (.cg). The simulator
// defers each copy to the wait that completes it (sim/include/cuda_runtime.h); HIP copies at once
// (a plain load and store: the wait is then trivially satisfied).
template <int kBytes>
__device__ __forceinline__ void cp_async(void* shared_dst, const void* global_src) {
  static_assert(kBytes == 4 || kBytes == 8 || kBytes == 16, "cp.async copies 4, 8 or 16 bytes");
#if defined(LOOM_CUDA_SIM)
  ::loom::sim::cp_async(shared_dst, global_src, kBytes);
#elif defined(LOOM_CUDA_HIP)
  if constexpr (kBytes == 16) *static_cast<int4*>(shared_dst) = *static_cast<const int4*>(global_src);
  else if constexpr (kBytes == 8) *static_cast<int2*>(shared_dst) = *static_cast<const int2*>(global_src);
  else *static_cast<int*>(shared_dst) = *static_cast<const int*>(global_src);
#else
  const auto dst = static_cast<uint32_t>(__cvta_generic_to_shared(shared_dst));
  if constexpr (kBytes == 16) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(global_src) : "memory");
  } else {
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2;\n" ::"r"(dst), "l"(global_src), "n"(kBytes) : "memory");
  }
#endif
}
__device__ __forceinline__ void cp_async_commit() {
#if defined(LOOM_CUDA_SIM)
  ::loom::sim::cp_async_commit();
#elif !defined(LOOM_CUDA_HIP)
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}
template <int kNewestPending>
__device__ __forceinline__ void cp_async_wait() {
#if defined(LOOM_CUDA_SIM)
  ::loom::sim::cp_async_wait(kNewestPending);
#elif !defined(LOOM_CUDA_HIP)
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kNewestPending) : "memory");
#endif
}

// ---------------------------------------------------------------- warp reductions
// Butterfly over the kG consecutive lanes of a group (kG a power of two <= 32), offsets kG/2,
// ..., 1: every lane of the group ends with the bitwise same value (each level combines the
// same pair, commutatively).
template <int kG, typename T, typename Op>
__device__ __forceinline__ T group_fold(T v, Op op) {
#pragma unroll
  for (int off = kG / 2; off > 0; off >>= 1) v = op(v, shfl_xor(v, off));
  return v;
}
template <typename T, typename Op>
__device__ __forceinline__ T warp_fold(T v, Op op) {
  return group_fold<kWarp>(v, op);
}
template <int kG, typename T>
__device__ __forceinline__ T group_sum(T v) {
  return group_fold<kG>(v, [](T a, T b) { return a + b; });
}
template <typename T>
__device__ __forceinline__ T warp_sum(T v) {
  return group_sum<kWarp>(v);
}

// Fixed halving tree over the kThreads threads of a block (every thread calls it, and all get
// the result): shared[t] = v, then shared[t] = op(shared[t], shared[t + half]) for half =
// kThreads / 2 .. 1. `shared` holds kThreads values; the first barrier waits for its readers.
template <int kThreads, typename T, typename Op>
__device__ __forceinline__ T block_fold(T v, T* shared, Op op) {
  __syncthreads();  // earlier readers of `shared` are done
  shared[threadIdx.x] = v;
  __syncthreads();
  for (int half = kThreads / 2; half > 0; half >>= 1) {
    if (static_cast<int>(threadIdx.x) < half) shared[threadIdx.x] = op(shared[threadIdx.x], shared[threadIdx.x + half]);
    __syncthreads();
  }
  return shared[0];
}

// ---------------------------------------------------------------- scalar math
// std::max / std::min's choice (a NaN in b is not taken by max_of), as the CPU kernels.
template <typename T>
__device__ __forceinline__ T max_of(T a, T b) {
  return a < b ? b : a;
}
template <typename T>
__device__ __forceinline__ T min_of(T a, T b) {
  return b < a ? b : a;
}
__device__ __forceinline__ int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
// max_of over the 32 lanes.
template <typename T>
__device__ __forceinline__ T warp_max(T v) {
  return warp_fold(v, [](T a, T b) { return max_of(a, b); });
}

// The device's libm (the CPU twins call libm too): expf / exp, logf / log, log1pf / log1p, sqrtf / sqrt.
// scalar_math.h's exp_t / tanh_t / sigmoid_t are another function (the CPU kernels' own exp).
template <typename T>
__device__ __forceinline__ T exp_of(T x) {
  if constexpr (sizeof(T) == 4) return expf(x);
  else return ::exp(x);
}
template <typename T>
__device__ __forceinline__ T log_of(T x) {
  if constexpr (sizeof(T) == 4) return logf(x);
  else return ::log(x);
}
template <typename T>
__device__ __forceinline__ T log1p_of(T x) {
  if constexpr (sizeof(T) == 4) return log1pf(x);
  else return ::log1p(x);
}
template <typename T>
__device__ __forceinline__ T sqrt_of(T x) {
  if constexpr (sizeof(T) == 4) return sqrtf(x);
  else return ::sqrt(x);
}

// mul_rn: a product rounded once, never contracted into a following add or subtract (where the
// CPU rounds it separately). fma_rn: a b + c with one rounding (where the CPU's GCC contracts).
#if defined(LOOM_CUDA_SIM)
template <typename T>
inline T mul_rn(T a, T b) {
  T p = a * b;
#if defined(__x86_64__)
  __asm__("" : "+x"(p));  // g++ cannot see through the register: no contraction
#else
  volatile T barrier = p;
  p = barrier;
#endif
  return p;
}
inline float fma_rn(float a, float b, float c) { return std::fma(a, b, c); }
inline double fma_rn(double a, double b, double c) { return std::fma(a, b, c); }
#elif defined(LOOM_CUDA_HIP)
__device__ __forceinline__ float mul_rn(float a, float b) {
#pragma clang fp contract(off)
  return a * b;
}
__device__ __forceinline__ double mul_rn(double a, double b) {
#pragma clang fp contract(off)
  return a * b;
}
__device__ __forceinline__ float fma_rn(float a, float b, float c) { return __fmaf_rn(a, b, c); }
__device__ __forceinline__ double fma_rn(double a, double b, double c) { return __fma_rn(a, b, c); }
#else
__device__ __forceinline__ float mul_rn(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ double mul_rn(double a, double b) { return __dmul_rn(a, b); }
__device__ __forceinline__ float fma_rn(float a, float b, float c) { return __fmaf_rn(a, b, c); }
__device__ __forceinline__ double fma_rn(double a, double b, double c) { return __fma_rn(a, b, c); }
#endif

}  // namespace loom::cuda
