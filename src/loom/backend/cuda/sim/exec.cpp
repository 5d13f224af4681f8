// The CUDA simulator's kernel execution (docs/cuda.md "The simulator"): launches, the threads of
// a block on fibers, barriers, warp exchanges, atomics, and the checks of compute-sanitizer.
//
// A launch is checked as a GPU checks it (threads per block, block and grid dimensions, dynamic
// shared memory against 48 KB or the kernel's opt-in, at most 227 KB) and enqueued on its stream.
// The worker runs the grid's blocks one after another in a random order drawn from
// LOOM_SIM_SEED and the launch's number. A block's threads are fibers (Boost.Context) of the
// worker, run round robin: a thread runs until it waits at __syncthreads or in a warp exchange
// (shuffle, vote, __syncwarp), which releases when every thread of the block, or every lane of
// the mask, has arrived. Nothing else switches threads, so a block is deterministic.
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
// synccheck is the scheduler's: a __syncthreads that not every thread reaches (one exited, or
// they wait at different ones), a warp exchange whose mask leaves out the caller or names lanes
// that never arrive or read a lane outside it. The first report of a launch stops its grid and
// makes the error sticky (cudaErrorIllegalAddress for memory, cudaErrorLaunchFailure otherwise).
#include <dlfcn.h>
#include <link.h>
#include <sys/mman.h>

#include <boost/context/fiber.hpp>
#include <boost/context/stack_context.hpp>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <numeric>
#include <sstream>
#include <string>
#include <vector>

#include "loom/backend/cuda/sim/sim_internal.h"
#include "loom/backend/cuda/sim/sim_launch.h"
#include "loom/backend/cuda/sim/sim_runtime.h"

namespace loom::sim {

namespace ctx = boost::context;

struct GridLaunch {
  LaunchSpec spec;
  std::string name;
  std::shared_ptr<void> args;
  void (*run)(void*);
  uint64_t serial;
};

namespace {

constexpr int kWarp = 32;
constexpr size_t kStackBytes = 64 * 1024;
constexpr size_t kSharedDefault = 48 * 1024, kSharedOptIn = 227 * 1024;

std::mutex g_attr_mu;
std::map<const void*, int> g_max_dynamic_shared;  // cudaFuncAttributeMaxDynamicSharedMemorySize
std::atomic<uint64_t> g_launches{0};

// ---------------------------------------------------------------- fiber stacks
// Stacks of kStackBytes below a guard page, reused: a block of 1024 threads needs 1024 of them.
struct StackPool {
  std::vector<void*> free;
  ~StackPool() {
    for (void* base : free) munmap(base, kStackBytes + 4096);
  }
};
thread_local StackPool t_stacks;

struct PooledStack {
  ctx::stack_context allocate() {
    void* base;
    if (!t_stacks.free.empty()) {
      base = t_stacks.free.back();
      t_stacks.free.pop_back();
    } else {
      base = mmap(nullptr, kStackBytes + 4096, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
      if (base == MAP_FAILED) throw std::bad_alloc();
      mprotect(base, 4096, PROT_NONE);  // overflow faults instead of corrupting
    }
    ctx::stack_context sc;
    sc.size = kStackBytes;
    sc.sp = static_cast<char*>(base) + 4096 + kStackBytes;
    return sc;
  }
  void deallocate(ctx::stack_context& sc) {
    t_stacks.free.push_back(static_cast<char*>(sc.sp) - kStackBytes - 4096);
  }
};

// ---------------------------------------------------------------- block state
enum class State : uint8_t { kReady, kBarrier, kInWarp, kDone };

struct SimThread {
  ctx::fiber fiber;   // the thread (empty once it finished)
  ctx::fiber back;    // the scheduler, while the thread runs
  uint3 idx{};
  int linear = 0;
  State state = State::kReady;
  int result = 0;      // a barrier's reduction
  uint64_t exchanged = 0;
};

struct WarpState {
  unsigned pending = 0;   // the mask of the exchange in progress (0: none)
  unsigned arrived = 0;
  const char* kind = nullptr;
  uint64_t offer[kWarp]{};
  int source[kWarp]{};
  uint32_t syncs = 0;     // completed exchanges (warp-level ordering for racecheck)
};

struct Block {
  GridLaunch* launch = nullptr;
  uint3 idx{};
  dim3 dim, grid;
  int size = 0;
  std::vector<SimThread> threads;
  std::vector<WarpState> warps;
  uint32_t epoch = 0;                  // completed __syncthreads
  int at_barrier = 0, done = 0, reduce_acc = 0;  // reduce_acc: set by a barrier's first arrival
  const char* barrier_file = nullptr;
  int barrier_line = 0;
  bool failed = false;                 // a check fired: stop
};

thread_local Block* t_block = nullptr;
thread_local SimThread* t_thread = nullptr;

// Shared memory = this worker's static TLS block (where `static thread_local` __shared__
// variables live), and its racecheck shadow: one word per 4 bytes.
struct SharedWord {
  uint64_t block = 0;         // which block's accesses these are (a block serial)
  uint32_t write_epoch = ~0u, read_epoch = ~0u;
  int32_t writer = -1, reader = -1;  // reader -2: several
  uint32_t writer_syncs = 0, reader_syncs = 0;
};
struct SharedRange {
  uintptr_t lo = 0, hi = 0;
  std::vector<SharedWord> words;
  uint64_t block_serial = 0;
  bool known = false;
};
thread_local SharedRange t_shared;
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

std::string dims(uint3 v) {
  char text[48];
  std::snprintf(text, sizeof text, "(%u,%u,%u)", v.x, v.y, v.z);
  return text;
}
std::string dims(dim3 v) { return dims(uint3{v.x, v.y, v.z}); }
std::string thread_name(const Block& b, const SimThread& t) {
  return "thread " + dims(t.idx) + " of block " + dims(b.idx);
}
std::string hex(unsigned v) {
  char text[16];
  std::snprintf(text, sizeof text, "0x%08x", v);
  return text;
}

std::string hex_address(uintptr_t a) {
  char text[24];
  std::snprintf(text, sizeof text, "0x%llx", static_cast<unsigned long long>(a));
  return text;
}

// A check fired inside the running block: report, stop the grid, make the error sticky.
void violation(const char* check, const std::string& what, cudaError_t error) {
  Block* b = t_block;
  if (b == nullptr || b->failed) return;
  b->failed = true;
  record_report(check, what + " (" + kernel_position() + ")");
  set_sticky(error);
}

void yield_to_scheduler() {
  SimThread* t = t_thread;
  t->back = std::move(t->back).resume();
  // Resumed by the scheduler: t_thread and t_block were set before the switch.
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

namespace {

// ---------------------------------------------------------------- the scheduler
void finish_barrier(Block& b) {
  for (SimThread& t : b.threads) {
    if (t.state == State::kBarrier) {
      t.state = State::kReady;
      t.result = b.reduce_acc;
    }
  }
  b.at_barrier = 0;
  b.barrier_file = nullptr;
  ++b.epoch;
}

// Every live thread waits and none can run: name what never arrives.
void report_deadlock(Block& b) {
  for (size_t w = 0; w < b.warps.size(); ++w) {
    const WarpState& ws = b.warps[w];
    if (ws.pending == 0) continue;
    for (int lane = 0; lane < kWarp; ++lane) {
      if (!(ws.pending & (1u << lane)) || (ws.arrived & (1u << lane))) continue;
      const size_t linear = w * kWarp + static_cast<size_t>(lane);
      std::string why = linear >= b.threads.size()                      ? "does not exist (the block is smaller)"
                        : b.threads[linear].state == State::kDone       ? "has exited"
                                                                        : "waits at __syncthreads";
      t_thread = nullptr;
      violation("synccheck", std::string(ws.kind) + " with mask " + hex(ws.pending) + " in warp " + std::to_string(w) +
                                 ": lane " + std::to_string(lane) + " named by the mask " + why,
                cudaErrorLaunchFailure);
      return;
    }
  }
  if (b.at_barrier > 0) {
    t_thread = nullptr;
    violation("synccheck", "__syncthreads at " + std::string(b.barrier_file ? b.barrier_file : "?") + ":" +
                               std::to_string(b.barrier_line) + " reached by " + std::to_string(b.at_barrier) + " of " +
                               std::to_string(b.size) + " threads; " + std::to_string(b.done) +
                               " exited without reaching it (a divergent barrier)",
              cudaErrorLaunchFailure);
  }
}

void run_block(GridLaunch& launch, Block& b, uint3 idx) {
  b.idx = idx;
  b.epoch = 0;
  b.at_barrier = b.done = 0;
  b.barrier_file = nullptr;
  for (WarpState& w : b.warps) w = WarpState{};
  ++t_shared.block_serial;
  t_block = &b;
  for (int i = 0; i < b.size; ++i) {
    SimThread& t = b.threads[static_cast<size_t>(i)];
    t.linear = i;
    t.idx = uint3{static_cast<unsigned>(i) % b.dim.x, (static_cast<unsigned>(i) / b.dim.x) % b.dim.y,
                  static_cast<unsigned>(i) / (b.dim.x * b.dim.y)};
    t.state = State::kReady;
    t.fiber = ctx::fiber(std::allocator_arg, PooledStack{}, [&launch, &t](ctx::fiber&& back) {
      t.back = std::move(back);
      launch.run(launch.args.get());
      t.state = State::kDone;
      return std::move(t.back);
    });
  }
  bool progress = true;
  while (progress && b.done < b.size && !b.failed) {
    progress = false;
    for (SimThread& t : b.threads) {
      if (t.state != State::kReady || b.failed) continue;
      t_thread = &t;
      t.fiber = std::move(t.fiber).resume();
      t_thread = nullptr;
      progress = true;
      if (t.state == State::kDone) {
        ++b.done;
        if (b.at_barrier > 0 && b.at_barrier + b.done == b.size) {
          t_thread = &t;
          violation("synccheck", "thread exited while " + std::to_string(b.at_barrier) + " threads wait at __syncthreads (" +
                                     std::string(b.barrier_file) + ":" + std::to_string(b.barrier_line) +
                                     "): a divergent barrier",
                    cudaErrorLaunchFailure);
          t_thread = nullptr;
        }
      }
    }
    if (!progress && b.done < b.size && !b.failed) report_deadlock(b);
  }
  // Threads left waiting (after a report) are unwound by their fibers' destructors.
  for (SimThread& t : b.threads) {
    t_thread = &t;
    t.fiber = ctx::fiber();
  }
  t_thread = nullptr;
  t_block = nullptr;
}

uint64_t splitmix(uint64_t& x) {
  uint64_t z = (x += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

}  // namespace

void run_grid(GridLaunch& launch) {
  locate_shared();
  const dim3 g = launch.spec.grid, bd = launch.spec.block;
  const uint64_t blocks = uint64_t{g.x} * g.y * g.z;
  std::vector<uint64_t> order(blocks);
  std::iota(order.begin(), order.end(), uint64_t{0});
  uint64_t state = block_order_seed() * 0x100000001b3ull ^ launch.serial;
  for (uint64_t i = blocks; i > 1; --i) std::swap(order[i - 1], order[splitmix(state) % i]);
  Block b;
  b.launch = &launch;
  b.dim = bd;
  b.grid = g;
  b.size = static_cast<int>(bd.x * bd.y * bd.z);
  b.threads.resize(static_cast<size_t>(b.size));
  b.warps.resize(static_cast<size_t>((b.size + kWarp - 1) / kWarp));
  for (uint64_t k : order) {
    const uint3 idx{static_cast<unsigned>(k % g.x), static_cast<unsigned>((k / g.x) % g.y),
                    static_cast<unsigned>(k / (uint64_t{g.x} * g.y))};
    run_block(launch, b, idx);
    if (b.failed) return;
  }
}

std::string kernel_position() {
  if (t_block == nullptr) return "";
  return "kernel " + t_block->launch->name + ", " +
         (t_thread ? thread_name(*t_block, *t_thread) : "block " + dims(t_block->idx));
}

void launch_erased(const LaunchSpec& spec, std::shared_ptr<void> args, void (*run)(void*)) {
  ensure_init();
  const std::string name(spec.name);
  const auto refuse = [&](cudaError_t error, const std::string& why) {
    record_report("launch", "launch of " + name + " with grid " + dims(spec.grid) + " and block " + dims(spec.block) +
                                " refused: " + why);
    set_last_error(error);
  };
  const dim3 b = spec.block, g = spec.grid;
  const uint64_t threads = uint64_t{b.x} * b.y * b.z;
  if (b.x == 0 || b.y == 0 || b.z == 0 || g.x == 0 || g.y == 0 || g.z == 0) {
    return refuse(cudaErrorInvalidConfiguration, "a dimension is 0");
  }
  if (threads > 1024) {
    return refuse(cudaErrorInvalidConfiguration, std::to_string(threads) + " threads per block, the limit is 1024");
  }
  if (b.x > 1024 || b.y > 1024 || b.z > 64) {
    return refuse(cudaErrorInvalidConfiguration, "block dimensions above (1024, 1024, 64)");
  }
  if (g.x > 2147483647u || g.y > 65535 || g.z > 65535) {
    return refuse(cudaErrorInvalidConfiguration, "grid dimensions above (2^31 - 1, 65535, 65535)");
  }
  int opt_in = 0;
  {
    std::lock_guard<std::mutex> lock(g_attr_mu);
    auto it = g_max_dynamic_shared.find(spec.kernel);
    if (it != g_max_dynamic_shared.end()) opt_in = it->second;
  }
  const size_t allowed = std::max<size_t>(kSharedDefault, static_cast<size_t>(opt_in));
  if (spec.shared_bytes > allowed) {
    return refuse(cudaErrorInvalidValue,
                  std::to_string(spec.shared_bytes) + " bytes of dynamic shared memory, above " + std::to_string(allowed) +
                      (opt_in == 0 ? " without cudaFuncAttributeMaxDynamicSharedMemorySize (48 KB is the limit without "
                                     "the opt-in)"
                                   : " (the kernel's cudaFuncAttributeMaxDynamicSharedMemorySize)"));
  }
  if (sticky_error() != cudaSuccess) return;
  auto grid = std::make_shared<GridLaunch>(GridLaunch{spec, name, std::move(args), run, ++g_launches});
  enqueue(spec.stream, "kernel", [grid] { run_grid(*grid); });
}

// ---------------------------------------------------------------- the kernel language
const uint3& thread_idx() { return t_thread->idx; }
const uint3& block_idx() { return t_block->idx; }
const dim3& block_dim() { return t_block->dim; }
const dim3& grid_dim() { return t_block->grid; }
int lane_id() { return t_thread->linear % kWarp; }

int block_barrier(int predicate, int reduce, const char* file, int line) {
  Block& b = *t_block;
  SimThread& t = *t_thread;
  if (b.failed) {
    yield_to_scheduler();  // never resumed: the block is unwound
    return 0;
  }
  if (b.at_barrier == 0) {
    if (b.done > 0) {
      violation("synccheck", "__syncthreads at " + std::string(file) + ":" + std::to_string(line) + " after " +
                                 std::to_string(b.done) + " threads of the block exited: a divergent barrier",
                cudaErrorLaunchFailure);
      yield_to_scheduler();
      return 0;
    }
    b.barrier_file = file;
    b.barrier_line = line;
    b.reduce_acc = reduce == 2 ? 1 : 0;
  } else if (b.barrier_line != line || std::strcmp(b.barrier_file, file) != 0) {
    violation("synccheck", "threads wait at different __syncthreads: " + std::string(b.barrier_file) + ":" +
                               std::to_string(b.barrier_line) + " and " + file + ":" + std::to_string(line),
              cudaErrorLaunchFailure);
    yield_to_scheduler();
    return 0;
  }
  if (reduce == 1) b.reduce_acc += predicate;
  if (reduce == 2) b.reduce_acc &= predicate;
  if (reduce == 3) b.reduce_acc |= predicate;
  t.state = State::kBarrier;
  if (++b.at_barrier == b.size) {
    finish_barrier(b);
    return t.result;
  }
  yield_to_scheduler();
  return t.result;
}

uint64_t warp_exchange(unsigned mask, uint64_t bits, int source, const char* kind) {
  Block& b = *t_block;
  SimThread& t = *t_thread;
  const int lane = t.linear % kWarp;
  WarpState& w = b.warps[static_cast<size_t>(t.linear / kWarp)];
  if (b.failed) {
    yield_to_scheduler();
    return bits;
  }
  if (!(mask & (1u << lane))) {
    violation("synccheck", std::string(kind) + " with mask " + hex(mask) + " called by lane " + std::to_string(lane) +
                               ", which the mask does not include",
              cudaErrorLaunchFailure);
    yield_to_scheduler();
    return bits;
  }
  if (w.pending == 0) {
    w.pending = mask;
    w.kind = kind;
  } else if (w.pending != mask) {
    violation("synccheck", std::string(kind) + " with mask " + hex(mask) + " while lanes of the warp wait in " + w.kind +
                               " with mask " + hex(w.pending),
              cudaErrorLaunchFailure);
    yield_to_scheduler();
    return bits;
  }
  w.offer[lane] = bits;
  w.source[lane] = source;
  w.arrived |= 1u << lane;
  if (w.arrived != mask) {
    t.state = State::kInWarp;
    yield_to_scheduler();
    return t.exchanged;
  }
  // The last lane: every lane's result, then release them.
  const size_t first = static_cast<size_t>(t.linear - lane);
  uint32_t ballot = 0;
  for (int l = 0; l < kWarp; ++l) {
    if ((mask & (1u << l)) && w.source[l] == -2 && w.offer[l] != 0) ballot |= 1u << l;
  }
  for (int l = 0; l < kWarp; ++l) {
    if (!(mask & (1u << l))) continue;
    SimThread& other = b.threads[first + static_cast<size_t>(l)];
    const int src = w.source[l];
    uint64_t value = w.offer[l];
    if (src == -2) {
      value = ballot;
    } else if (src >= 0) {
      if (!(mask & (1u << src))) {  // reported as the reading lane's
        t_thread = &other;
        violation("synccheck", std::string(kind) + " with mask " + hex(mask) + ": lane " + std::to_string(l) +
                                   " reads lane " + std::to_string(src) + ", which the mask does not include",
                  cudaErrorLaunchFailure);
        t_thread = &t;
      }
      value = w.offer[src];
    }
    other.exchanged = value;
    if (other.state == State::kInWarp) other.state = State::kReady;
  }
  w.pending = w.arrived = 0;
  ++w.syncs;
  return t.exchanged;
}

unsigned warp_vote(unsigned mask, int predicate, const char* kind) {
  return static_cast<unsigned>(warp_exchange(mask, predicate ? 1 : 0, -2, kind));
}
void warp_sync(unsigned mask) { (void)warp_exchange(mask, 0, -1, "__syncwarp"); }

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

// The dynamic shared memory a kernel may ask for beyond 48 KB (Hopper: at most 227 KB).
extern "C" cudaError_t cudaFuncSetAttribute(const void* func, cudaFuncAttribute attr, int value) {
  using namespace loom::sim;
  if (func == nullptr || value < 0) {
    set_last_error(cudaErrorInvalidValue);
    return cudaErrorInvalidValue;
  }
  if (attr == cudaFuncAttributeMaxDynamicSharedMemorySize) {
    if (static_cast<size_t>(value) > kSharedOptIn) {
      set_last_error(cudaErrorInvalidValue);
      return cudaErrorInvalidValue;
    }
    std::lock_guard<std::mutex> lock(g_attr_mu);
    g_max_dynamic_shared[func] = value;
  }
  return cudaSuccess;
}

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
