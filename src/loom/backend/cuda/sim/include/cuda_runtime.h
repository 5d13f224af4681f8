// The CUDA simulator's cuda_runtime.h: the runtime API plus the kernel language, so that the
// CUDA backend's .cu files compile with g++ as ordinary C++ (docs/cuda.md "The simulator").
//
// - __global__ / __device__ / __host__ / __forceinline__ / __launch_bounds__ vanish: a kernel is
//   an ordinary function that the simulator runs once per thread, each thread on its own fiber.
// - __shared__ is `static thread_local`: every block runs on one worker thread of the simulator,
//   all its threads on fibers of that worker, so the block's threads share one copy and two
//   workers never share one. The racecheck knows the worker's static TLS block as "shared memory".
// - threadIdx, blockIdx, blockDim and gridDim are the running fiber's (sim/exec.cpp).
// - __syncthreads, the warp shuffles and votes, and the atomics call the simulator, which
//   schedules the fibers (a barrier is a real barrier; a warp's lanes exchange in lockstep) and
//   checks them (synccheck).
#pragma once
#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "library_types.h"

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline __attribute__((always_inline))
#define __launch_bounds__(...)
#define __shared__ static thread_local
#define __constant__ static
#define __align__(n) __attribute__((aligned(n)))
#define __restrict__ __restrict

struct uint3 {
  unsigned int x, y, z;
};
struct dim3 {
  unsigned int x, y, z;
  constexpr dim3(unsigned int vx = 1, unsigned int vy = 1, unsigned int vz = 1) : x(vx), y(vy), z(vz) {}
  constexpr dim3(uint3 v) : x(v.x), y(v.y), z(v.z) {}
};

namespace loom::sim {
// A vector type's whole load or store (ld.global.v4 on a GPU): checked for its alignment (a GPU
// faults on a misaligned one) and as an access of its size.
void vector_access(const void* p, size_t bytes, bool write);
}  // namespace loom::sim

// Vector types with the alignment CUDA gives them. Copying one from or to memory is one access
// of its whole size, as the hardware's vector load and store are; the compiler may split the
// struct's copy into its members, so the copy operations report the whole access themselves.
#define LOOM_SIM_VECTOR(name, type, align, ...)                                                  \
  struct __attribute__((aligned(align))) name {                                                   \
    type __VA_ARGS__;                                                                             \
    name() = default;                                                                             \
    name(const name& o) {                                                                         \
      ::loom::sim::vector_access(&o, sizeof(name), false);                                        \
      std::memcpy(static_cast<void*>(this), &o, sizeof(name));                                     \
    }                                                                                             \
    name& operator=(const name& o) {                                                              \
      ::loom::sim::vector_access(&o, sizeof(name), false);                                        \
      ::loom::sim::vector_access(this, sizeof(name), true);                                       \
      std::memcpy(static_cast<void*>(this), &o, sizeof(name));                                     \
      return *this;                                                                               \
    }                                                                                             \
  };
LOOM_SIM_VECTOR(float2, float, 8, x, y)
LOOM_SIM_VECTOR(float4, float, 16, x, y, z, w)
LOOM_SIM_VECTOR(double2, double, 16, x, y)
LOOM_SIM_VECTOR(int2, int, 8, x, y)
LOOM_SIM_VECTOR(int4, int, 16, x, y, z, w)
LOOM_SIM_VECTOR(uint4, unsigned, 16, x, y, z, w)
#undef LOOM_SIM_VECTOR
inline float2 make_float2(float x, float y) {
  float2 v;
  v.x = x, v.y = y;
  return v;
}
inline float4 make_float4(float x, float y, float z, float w) {
  float4 v;
  v.x = x, v.y = y, v.z = z, v.w = w;
  return v;
}
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) {
  uint4 v;
  v.x = x, v.y = y, v.z = z, v.w = w;
  return v;
}
inline double2 make_double2(double x, double y) {
  double2 v;
  v.x = x, v.y = y;
  return v;
}

// CUDA's min and max of two numbers (math_functions.h), for the types Loom uses.
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }
inline long min(long a, long b) { return a < b ? a : b; }
inline long max(long a, long b) { return a > b ? a : b; }
inline float min(float a, float b) { return std::fmin(a, b); }
inline float max(float a, float b) { return std::fmax(a, b); }
inline double min(double a, double b) { return std::fmin(a, b); }
inline double max(double a, double b) { return std::fmax(a, b); }

namespace loom::sim {
// The running thread's coordinates (out of line: the simulator's state is not instrumented).
const uint3& thread_idx();
const uint3& block_idx();
const dim3& block_dim();
const dim3& grid_dim();
// __syncthreads and its reductions; `site` names the call in synccheck reports.
int block_barrier(int predicate, int reduce, const char* file, int line);  // reduce: 0 none, 1 count, 2 and, 3 or
// One lockstep exchange among the lanes of `mask`: every lane offers `bits`; returns the bits of
// lane `source` (the caller's own when `source` is -1). kind names the intrinsic in reports.
uint64_t warp_exchange(unsigned mask, uint64_t bits, int source, const char* kind);
unsigned warp_vote(unsigned mask, int predicate, const char* kind);  // the ballot of the lanes in mask
void warp_sync(unsigned mask);
int lane_id();
// cp.async (PTX: cp.async.{ca,cg}.shared.global of 4, 8 or 16 bytes; cp.async.commit_group;
// cp.async.wait_group n): the source is checked and read at issue, the shared destination checked
// as a write at issue (a copy into a tile other threads may still read is a hazard then) and
// written only when a wait completes its group, so a read before the wait finds the old bytes,
// as it may on a GPU. Copies a thread leaves pending land when it exits.
void cp_async(void* shared_dst, const void* global_src, int bytes);
void cp_async_commit();
void cp_async_wait(int newest_pending);  // completes every committed group but the newest n
// Atomics on device or shared memory: checked like any access, then done atomically.
unsigned long long atomic_u64(unsigned long long* p, unsigned long long v, int op);
unsigned atomic_u32(unsigned* p, unsigned v, int op);
int atomic_i32(int* p, int v, int op);
float atomic_f32_add(float* p, float v);
double atomic_f64_add(double* p, double v);
enum AtomicOp { kAtomicAdd, kAtomicMin, kAtomicMax, kAtomicExch, kAtomicAnd, kAtomicOr };
unsigned long long atomic_cas_u64(unsigned long long* p, unsigned long long expected, unsigned long long desired);
int atomic_cas_i32(int* p, int expected, int desired);
}  // namespace loom::sim

#define threadIdx (::loom::sim::thread_idx())
#define blockIdx (::loom::sim::block_idx())
#define blockDim (::loom::sim::block_dim())
#define gridDim (::loom::sim::grid_dim())
#define warpSize 32
#define __syncthreads() ((void)::loom::sim::block_barrier(0, 0, __FILE__, __LINE__))
#define __syncthreads_count(p) ::loom::sim::block_barrier((p) ? 1 : 0, 1, __FILE__, __LINE__)
#define __syncthreads_and(p) ::loom::sim::block_barrier((p) ? 1 : 0, 2, __FILE__, __LINE__)
#define __syncthreads_or(p) ::loom::sim::block_barrier((p) ? 1 : 0, 3, __FILE__, __LINE__)

// ---------------------------------------------------------------- warp intrinsics
namespace loom::sim::detail {
template <typename T>
inline uint64_t to_bits(T v) {
  static_assert(sizeof(T) <= 8 && std::is_trivially_copyable_v<T>, "shuffles move values of at most 8 bytes");
  uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof(T));
  return bits;
}
template <typename T>
inline T from_bits(uint64_t bits) {
  T v;
  std::memcpy(&v, &bits, sizeof(T));
  return v;
}
// The source lane of each shuffle (CUDA C++ Programming Guide, "Warp Shuffle Functions"): lanes
// are in groups of `width`; a source outside the caller's group gives the caller's own value (-1).
inline int shfl_source(int lane, int src, int width) { return (lane & ~(width - 1)) + (src % width); }
inline int shfl_up_source(int lane, unsigned delta, int width) {
  return (lane % width) < static_cast<int>(delta) ? -1 : lane - static_cast<int>(delta);
}
inline int shfl_down_source(int lane, unsigned delta, int width) {
  return (lane % width) + static_cast<int>(delta) >= width ? -1 : lane + static_cast<int>(delta);
}
inline int shfl_xor_source(int lane, int lane_mask, int width) {
  const int src = lane ^ lane_mask;
  return (src & ~(width - 1)) > (lane & ~(width - 1)) ? -1 : src;
}
}  // namespace loom::sim::detail

template <typename T>
inline T __shfl_sync(unsigned mask, T var, int src_lane, int width = 32) {
  namespace d = ::loom::sim::detail;
  return d::from_bits<T>(::loom::sim::warp_exchange(
      mask, d::to_bits(var), d::shfl_source(::loom::sim::lane_id(), src_lane, width), "__shfl_sync"));
}
template <typename T>
inline T __shfl_up_sync(unsigned mask, T var, unsigned delta, int width = 32) {
  namespace d = ::loom::sim::detail;
  return d::from_bits<T>(::loom::sim::warp_exchange(
      mask, d::to_bits(var), d::shfl_up_source(::loom::sim::lane_id(), delta, width), "__shfl_up_sync"));
}
template <typename T>
inline T __shfl_down_sync(unsigned mask, T var, unsigned delta, int width = 32) {
  namespace d = ::loom::sim::detail;
  return d::from_bits<T>(::loom::sim::warp_exchange(
      mask, d::to_bits(var), d::shfl_down_source(::loom::sim::lane_id(), delta, width), "__shfl_down_sync"));
}
template <typename T>
inline T __shfl_xor_sync(unsigned mask, T var, int lane_mask, int width = 32) {
  namespace d = ::loom::sim::detail;
  return d::from_bits<T>(::loom::sim::warp_exchange(
      mask, d::to_bits(var), d::shfl_xor_source(::loom::sim::lane_id(), lane_mask, width), "__shfl_xor_sync"));
}
inline unsigned __ballot_sync(unsigned mask, int predicate) {
  return ::loom::sim::warp_vote(mask, predicate, "__ballot_sync");
}
inline int __all_sync(unsigned mask, int predicate) {
  return (::loom::sim::warp_vote(mask, predicate, "__all_sync") & mask) == mask;
}
inline int __any_sync(unsigned mask, int predicate) {
  return (::loom::sim::warp_vote(mask, predicate, "__any_sync") & mask) != 0;
}
inline void __syncwarp(unsigned mask = 0xffffffffu) { ::loom::sim::warp_sync(mask); }

// ---------------------------------------------------------------- atomics
inline unsigned long long atomicMin(unsigned long long* p, unsigned long long v) {
  return ::loom::sim::atomic_u64(p, v, ::loom::sim::kAtomicMin);
}
inline unsigned long long atomicMax(unsigned long long* p, unsigned long long v) {
  return ::loom::sim::atomic_u64(p, v, ::loom::sim::kAtomicMax);
}
inline unsigned long long atomicAdd(unsigned long long* p, unsigned long long v) {
  return ::loom::sim::atomic_u64(p, v, ::loom::sim::kAtomicAdd);
}
inline unsigned long long atomicExch(unsigned long long* p, unsigned long long v) {
  return ::loom::sim::atomic_u64(p, v, ::loom::sim::kAtomicExch);
}
inline unsigned long long atomicCAS(unsigned long long* p, unsigned long long expected, unsigned long long desired) {
  return ::loom::sim::atomic_cas_u64(p, expected, desired);
}
inline unsigned atomicAdd(unsigned* p, unsigned v) { return ::loom::sim::atomic_u32(p, v, ::loom::sim::kAtomicAdd); }
inline unsigned atomicMin(unsigned* p, unsigned v) { return ::loom::sim::atomic_u32(p, v, ::loom::sim::kAtomicMin); }
inline unsigned atomicMax(unsigned* p, unsigned v) { return ::loom::sim::atomic_u32(p, v, ::loom::sim::kAtomicMax); }
inline unsigned atomicOr(unsigned* p, unsigned v) { return ::loom::sim::atomic_u32(p, v, ::loom::sim::kAtomicOr); }
inline unsigned atomicAnd(unsigned* p, unsigned v) { return ::loom::sim::atomic_u32(p, v, ::loom::sim::kAtomicAnd); }
inline int atomicAdd(int* p, int v) { return ::loom::sim::atomic_i32(p, v, ::loom::sim::kAtomicAdd); }
inline int atomicMin(int* p, int v) { return ::loom::sim::atomic_i32(p, v, ::loom::sim::kAtomicMin); }
inline int atomicMax(int* p, int v) { return ::loom::sim::atomic_i32(p, v, ::loom::sim::kAtomicMax); }
inline int atomicExch(int* p, int v) { return ::loom::sim::atomic_i32(p, v, ::loom::sim::kAtomicExch); }
inline int atomicCAS(int* p, int expected, int desired) { return ::loom::sim::atomic_cas_i32(p, expected, desired); }
inline float atomicAdd(float* p, float v) { return ::loom::sim::atomic_f32_add(p, v); }
inline double atomicAdd(double* p, double v) { return ::loom::sim::atomic_f64_add(p, v); }

// ---------------------------------------------------------------- bit casts and math intrinsics
inline unsigned int __float_as_uint(float x) {
  unsigned int u;
  std::memcpy(&u, &x, 4);
  return u;
}
inline float __uint_as_float(unsigned int u) {
  float x;
  std::memcpy(&x, &u, 4);
  return x;
}
inline int __float_as_int(float x) { return static_cast<int>(__float_as_uint(x)); }
inline float __int_as_float(int i) { return __uint_as_float(static_cast<unsigned>(i)); }
inline long long __double_as_longlong(double x) {
  long long u;
  std::memcpy(&u, &x, 8);
  return u;
}
inline double __longlong_as_double(long long u) {
  double x;
  std::memcpy(&x, &u, 8);
  return x;
}
// The hardware's sqrt, division and fma are IEEE round-to-nearest (nvcc's defaults, -prec-sqrt
// and -prec-div true): the host's are the same operations. rsqrtf and the fast intrinsics
// (__expf, __logf) are approximations on the GPU (2 ulp and more); here they are the exact
// functions, so a result that depends on their error is not reproduced.
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline double rsqrt(double x) { return 1.0 / std::sqrt(x); }
inline float __expf(float x) { return std::exp(x); }
inline float __logf(float x) { return std::log(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float __saturatef(float x) { return x < 0.0f ? 0.0f : (x > 1.0f ? 1.0f : x); }
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz(static_cast<unsigned>(x)); }
inline int __ffs(int x) { return __builtin_ffs(x); }

// cudaFuncSetAttribute for a kernel (the runtime API takes its address).
template <typename... Params>
inline cudaError_t cudaFuncSetAttribute(void (*kernel)(Params...), cudaFuncAttribute attr, int value) {
  return cudaFuncSetAttribute(reinterpret_cast<const void*>(kernel), attr, value);
}
