// The CUDA simulator's access checks, those of compute-sanitizer (docs/cuda.md "The simulator"),
// and the atomics of kernel code, checked as accesses too (exec.cpp runs the kernels' threads).
//
// The accesses of kernel code are seen through GCC's -fsanitize=thread instrumentation, which
// calls __tsan_readN / __tsan_writeN before every load and store of the instrumented files (the
// CUDA backend's .cu files in this build). This file defines those functions (no ThreadSanitizer
// runtime is linked), and checks:
//   memcheck   a device address whose shadow byte is unallocated (past an allocation, freed);
//   initcheck  a device byte read before anything wrote it;
//   racecheck  shared memory (the worker's static TLS block, where __shared__ variables live)
//              written by one thread and read or written by another with no __syncthreads
//              between (threads of one warp after a warp exchange are ordered);
//   host-access instrumented host code touching device memory outside the runtime.
// A check that fires reports through exec.cpp's violation(), which stops the grid.
#include <link.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

#include "loom/backend/cuda/sim/exec_internal.h"
#include "loom/backend/cuda/sim/sim_internal.h"
#include "loom/backend/cuda/sim/sim_runtime.h"

namespace loom::sim {

thread_local SharedRange t_shared;

namespace {

thread_local char t_tls_probe;  // in the same TLS block: checks the range below

size_t g_tls_bytes = 0, g_tls_align = 1;
int find_tls(dl_phdr_info* info, size_t, void*) {
  for (int i = 0; i < info->dlpi_phnum; ++i) {
    if (info->dlpi_phdr[i].p_type == PT_TLS) {
      g_tls_bytes = info->dlpi_phdr[i].p_memsz;
      g_tls_align = std::max<size_t>(info->dlpi_phdr[i].p_align, 1);
    }
  }
  return 1;  // the first object is the executable
}

}  // namespace

// The executable's static TLS block sits just below the thread pointer (x86-64, TLS variant II).
void locate_shared() {
  if (t_shared.known) return;
  static std::once_flag once;
  std::call_once(once, [] { dl_iterate_phdr(find_tls, nullptr); });
  const uintptr_t tp = reinterpret_cast<uintptr_t>(__builtin_thread_pointer());
  const size_t span = (g_tls_bytes + g_tls_align - 1) / g_tls_align * g_tls_align + g_tls_align;
  t_shared.lo = tp - span;
  t_shared.hi = tp;
  const uintptr_t probe = reinterpret_cast<uintptr_t>(&t_tls_probe);
  if (probe < t_shared.lo || probe >= t_shared.hi) t_shared.lo = t_shared.hi = 0;  // not where expected: no racecheck
  t_shared.words.assign((t_shared.hi - t_shared.lo) / 4 + 1, SharedWord{});
  t_shared.known = true;
}

namespace {

std::string hex_address(uintptr_t a) {
  char text[24];
  std::snprintf(text, sizeof text, "0x%llx", static_cast<unsigned long long>(a));
  return text;
}

// ---------------------------------------------------------------- accesses
void device_access(uintptr_t a, size_t n, bool write) {
  if (t_thread == nullptr) {  // host code: fatal, as the same access is on a GPU machine
    if (t_runtime_access > 0) return;
    record_report("host-access", "host code accessed device memory at " + hex_address(a) +
                                     ": device memory is not addressable from the host (copy it with cudaMemcpy); " +
                                     (write ? "a write of " : "a read of ") + std::to_string(n) + " bytes: " +
                                     describe_address(reinterpret_cast<void*>(a)));
    std::abort();
  }
  uint8_t* s = shadow_of(a);
  for (size_t i = 0; i < n; ++i) {
    if (s[i] == kUnallocated) {
      violation("memcheck", std::string("invalid __global__ ") + (write ? "write" : "read") + " of " + std::to_string(n) +
                                " bytes: " + describe_address(reinterpret_cast<void*>(a)),
                cudaErrorIllegalAddress);
      return;
    }
  }
  if (write) {
    std::memset(s, kWritten, n);
  } else {
    for (size_t i = 0; i < n; ++i) {
      if (s[i] != kWritten) {
        violation("initcheck", "uninitialized __global__ memory read of " + std::to_string(n) + " bytes: " +
                                   describe_address(reinterpret_cast<void*>(a + i)) + " was never written",
                  cudaErrorIllegalAddress);
        return;
      }
    }
  }
}

void shared_access(uintptr_t a, size_t n, bool write) {
  Block& b = *t_block;
  SimThread& t = *t_thread;
  const int warp = t.linear / kWarp;
  const uint32_t syncs = b.warps[static_cast<size_t>(warp)].syncs;
  for (uintptr_t w = (a - t_shared.lo) / 4; w <= (a + n - 1 - t_shared.lo) / 4; ++w) {
    SharedWord& s = t_shared.words[w];
    if (s.block != t_shared.block_serial) s = SharedWord{t_shared.block_serial};
    // Another thread's access since the last barrier conflicts, unless both are lanes of one
    // warp and a warp exchange came between.
    const auto conflicts = [&](int32_t other, uint32_t other_syncs) {
      if (other == t.linear) return false;
      if (other >= 0 && other / kWarp == warp && syncs > other_syncs) return false;
      return true;
    };
    const auto report = [&](const char* kind, int32_t other) {
      const std::string by = other >= 0 ? "thread " + dims(b.threads[static_cast<size_t>(other)].idx) : "other threads";
      violation("racecheck",
                std::string("shared memory hazard (") + kind + "): " + (write ? "write" : "read") + " of " +
                    std::to_string(n) + " bytes at shared offset " + std::to_string(a - t_shared.lo) + ", accessed by " +
                    by + " since the last __syncthreads",
                cudaErrorLaunchFailure);
    };
    if (s.write_epoch == b.epoch && conflicts(s.writer, s.writer_syncs)) {
      return report(write ? "write after write" : "read after write", s.writer);
    }
    if (write) {
      if (s.read_epoch == b.epoch && (s.reader == -2 || conflicts(s.reader, s.reader_syncs))) {
        return report("write after read", s.reader);
      }
      s.write_epoch = b.epoch;
      s.writer = t.linear;
      s.writer_syncs = syncs;
    } else {
      if (s.read_epoch != b.epoch) {
        s.read_epoch = b.epoch;
        s.reader = t.linear;
        s.reader_syncs = syncs;
      } else if (s.reader != t.linear) {
        s.reader = -2;
      }
    }
  }
}

// Whether a is in this worker's shared memory (its static TLS block).
inline bool in_shared(uintptr_t a) { return a - t_shared.lo < t_shared.hi - t_shared.lo; }

inline void access(void* p, size_t n, bool write) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  if (in_arena(a)) return device_access(a, n, write);
  if (t_thread != nullptr && in_shared(a) && !t_block->failed) shared_access(a, n, write);
}

// An access the compiler emits as naturally aligned (a float4 load is one 16-byte access): a GPU
// faults on a misaligned one (cudaErrorMisalignedAddress).
inline void aligned_access(void* p, size_t n, bool write) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  if ((a & (n - 1)) != 0 && t_thread != nullptr && (in_arena(a) || in_shared(a))) {
    return violation("memcheck", std::string("misaligned ") + (write ? "write" : "read") + " of " + std::to_string(n) +
                                     " bytes: " + describe_address(p) + " is not a multiple of " + std::to_string(n),
                     cudaErrorMisalignedAddress);
  }
  access(p, n, write);
}

}  // namespace

void vector_access(const void* p, size_t bytes, bool write) { aligned_access(const_cast<void*>(p), bytes, write); }

// ---------------------------------------------------------------- cp.async
namespace {
void complete_async(SimThread& t, uint32_t below) {  // the copies of groups < below, in issue order
  size_t kept = 0;
  for (SimThread::AsyncCopy& c : t.async) {
    if (c.group < below) {
      aligned_access(c.dst, static_cast<size_t>(c.size), true);
      std::memcpy(c.dst, c.bytes, static_cast<size_t>(c.size));
    } else {
      t.async[kept++] = c;
    }
  }
  t.async.resize(kept);
}
}  // namespace

void cp_async(void* shared_dst, const void* global_src, int bytes) {
  SimThread& t = *t_thread;
  if (!(bytes == 4 || bytes == 8 || bytes == 16) || !in_shared(reinterpret_cast<uintptr_t>(shared_dst)) ||
      !in_arena(reinterpret_cast<uintptr_t>(global_src))) {
    return violation("memcheck", "cp.async of " + std::to_string(bytes) + " bytes from " +
                                     hex_address(reinterpret_cast<uintptr_t>(global_src)) +
                                     ": needs 4, 8 or 16 bytes from global to shared memory",
                     cudaErrorIllegalAddress);
  }
  void* src = const_cast<void*>(global_src);
  aligned_access(src, static_cast<size_t>(bytes), false);
  aligned_access(shared_dst, static_cast<size_t>(bytes), true);
  if (t_block->failed) return;
  SimThread::AsyncCopy c{shared_dst, {}, bytes, t.async_groups};
  std::memcpy(c.bytes, src, static_cast<size_t>(bytes));
  t.async.push_back(c);
}
void cp_async_commit() { ++t_thread->async_groups; }
void cp_async_wait(int newest_pending) {
  SimThread& t = *t_thread;
  const uint32_t n = static_cast<uint32_t>(std::max(newest_pending, 0));
  complete_async(t, t.async_groups > n ? t.async_groups - n : 0);
}
void finish_async_copies() {
  SimThread& t = *t_thread;
  for (const SimThread::AsyncCopy& c : t.async) std::memcpy(c.dst, c.bytes, static_cast<size_t>(c.size));
  t.async.clear();
}

// ---------------------------------------------------------------- atomics
namespace {
template <typename T>
void atomic_check(T* p) {
  access(p, sizeof(T), false);
  access(p, sizeof(T), true);
}
template <typename T>
T atomic_op(T* p, T v, int op) {
  atomic_check(p);
  T old = __atomic_load_n(p, __ATOMIC_RELAXED);
  for (;;) {
    T next = old;
    switch (op) {
      case kAtomicAdd: next = old + v; break;
      case kAtomicMin: next = std::min(old, v); break;
      case kAtomicMax: next = std::max(old, v); break;
      case kAtomicExch: next = v; break;
      case kAtomicAnd: next = old & v; break;
      case kAtomicOr: next = old | v; break;
      default: break;
    }
    if (__atomic_compare_exchange_n(p, &old, next, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) return old;
  }
}
template <typename F, typename U>
F atomic_float_add(F* p, F v) {
  atomic_check(p);
  U* u = reinterpret_cast<U*>(p);
  U old = __atomic_load_n(u, __ATOMIC_RELAXED);
  for (;;) {
    F f;
    std::memcpy(&f, &old, sizeof f);
    const F sum = f + v;
    U next;
    std::memcpy(&next, &sum, sizeof next);
    if (__atomic_compare_exchange_n(u, &old, next, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) return f;
  }
}
}  // namespace

unsigned long long atomic_u64(unsigned long long* p, unsigned long long v, int op) { return atomic_op(p, v, op); }
unsigned atomic_u32(unsigned* p, unsigned v, int op) { return atomic_op(p, v, op); }
int atomic_i32(int* p, int v, int op) { return atomic_op(p, v, op); }
float atomic_f32_add(float* p, float v) { return atomic_float_add<float, uint32_t>(p, v); }
double atomic_f64_add(double* p, double v) { return atomic_float_add<double, uint64_t>(p, v); }
unsigned long long atomic_cas_u64(unsigned long long* p, unsigned long long expected, unsigned long long desired) {
  atomic_check(p);
  __atomic_compare_exchange_n(p, &expected, desired, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
  return expected;
}
int atomic_cas_i32(int* p, int expected, int desired) {
  atomic_check(p);
  __atomic_compare_exchange_n(p, &expected, desired, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
  return expected;
}

}  // namespace loom::sim

// ---------------------------------------------------------------- -fsanitize=thread's hooks
// GCC's instrumentation of the simulated files calls these; they are the simulator's checks, not
// ThreadSanitizer (whose runtime is not linked).
extern "C" {
void __tsan_init() {}
void __tsan_func_entry(void*) {}
void __tsan_func_exit() {}
#define LOOM_SIM_ACCESS(n)                                                       \
  void __tsan_read##n(void* p) { loom::sim::aligned_access(p, n, false); }       \
  void __tsan_write##n(void* p) { loom::sim::aligned_access(p, n, true); }       \
  void __tsan_unaligned_read##n(void* p) { loom::sim::access(p, n, false); }     \
  void __tsan_unaligned_write##n(void* p) { loom::sim::access(p, n, true); }     \
  void __tsan_volatile_read##n(void* p) { loom::sim::access(p, n, false); }      \
  void __tsan_volatile_write##n(void* p) { loom::sim::access(p, n, true); }
LOOM_SIM_ACCESS(1)
LOOM_SIM_ACCESS(2)
LOOM_SIM_ACCESS(4)
LOOM_SIM_ACCESS(8)
LOOM_SIM_ACCESS(16)
#undef LOOM_SIM_ACCESS
void __tsan_read_range(void* p, unsigned long n) { loom::sim::access(p, n, false); }
void __tsan_write_range(void* p, unsigned long n) { loom::sim::access(p, n, true); }
void __tsan_vptr_update(void**, void*) {}
void __tsan_vptr_read(void**) {}
// Atomics of the instrumented files' host code (shared_ptr counts, libstdc++): done as written,
// sequentially consistent, unchecked (kernels reach the simulator's own atomics, above).
#define LOOM_SIM_ATOMIC(bits, type)                                                                            \
  type __tsan_atomic##bits##_load(const volatile type* a, int) { return __atomic_load_n(a, __ATOMIC_SEQ_CST); } \
  void __tsan_atomic##bits##_store(volatile type* a, type v, int) { __atomic_store_n(a, v, __ATOMIC_SEQ_CST); } \
  type __tsan_atomic##bits##_exchange(volatile type* a, type v, int) {                                        \
    return __atomic_exchange_n(a, v, __ATOMIC_SEQ_CST);                                                        \
  }                                                                                                            \
  type __tsan_atomic##bits##_fetch_add(volatile type* a, type v, int) {                                       \
    return __atomic_fetch_add(a, v, __ATOMIC_SEQ_CST);                                                         \
  }                                                                                                            \
  type __tsan_atomic##bits##_fetch_sub(volatile type* a, type v, int) {                                       \
    return __atomic_fetch_sub(a, v, __ATOMIC_SEQ_CST);                                                         \
  }                                                                                                            \
  type __tsan_atomic##bits##_fetch_and(volatile type* a, type v, int) {                                       \
    return __atomic_fetch_and(a, v, __ATOMIC_SEQ_CST);                                                         \
  }                                                                                                            \
  type __tsan_atomic##bits##_fetch_or(volatile type* a, type v, int) {                                        \
    return __atomic_fetch_or(a, v, __ATOMIC_SEQ_CST);                                                          \
  }                                                                                                            \
  int __tsan_atomic##bits##_compare_exchange_strong(volatile type* a, type* c, type v, int, int) {            \
    return __atomic_compare_exchange_n(a, c, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);                    \
  }                                                                                                            \
  int __tsan_atomic##bits##_compare_exchange_weak(volatile type* a, type* c, type v, int, int) {              \
    return __atomic_compare_exchange_n(a, c, v, true, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);                     \
  }                                                                                                            \
  type __tsan_atomic##bits##_compare_exchange_val(volatile type* a, type c, type v, int, int) {               \
    __atomic_compare_exchange_n(a, &c, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);                         \
    return c;                                                                                                  \
  }
LOOM_SIM_ATOMIC(8, char)
LOOM_SIM_ATOMIC(16, short)
LOOM_SIM_ATOMIC(32, int)
LOOM_SIM_ATOMIC(64, long)
#undef LOOM_SIM_ATOMIC
void __tsan_atomic_thread_fence(int) { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
void __tsan_atomic_signal_fence(int) { __atomic_signal_fence(__ATOMIC_SEQ_CST); }
}
