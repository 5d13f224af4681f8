// The CUDA simulator's kernel execution (docs/cuda.md "The simulator"): launches, the threads of
// a block on fibers, barriers and warp exchanges (the access checks of compute-sanitizer, and the
// atomics, are exec_checks.cpp's).
//
// A launch is checked as a GPU checks it (threads per block, block and grid dimensions, dynamic
// shared memory against 48 KB or the kernel's opt-in, at most 227 KB) and enqueued on its stream.
// The worker runs the grid's blocks one after another in a random order drawn from
// LOOM_SIM_SEED and the launch's number. A block's threads are fibers (Boost.Context) of the
// worker, run round robin: a thread runs until it waits at __syncthreads or in a warp exchange
// (shuffle, vote, __syncwarp), which releases when every thread of the block, or every lane of
// the mask, has arrived. Nothing else switches threads, so a block is deterministic.
//
// synccheck is the scheduler's: a __syncthreads that not every thread reaches (one exited, or
// they wait at different ones), a warp exchange whose mask leaves out the caller or names lanes
// that never arrive or read a lane outside it. The first report of a launch stops its grid and
// makes the error sticky (cudaErrorIllegalAddress for memory, cudaErrorLaunchFailure otherwise).
#include <sys/mman.h>

#include <boost/context/stack_context.hpp>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <numeric>
#include <string>
#include <vector>

#include "loom/backend/cuda/sim/exec_internal.h"
#include "loom/backend/cuda/sim/sim_internal.h"
#include "loom/backend/cuda/sim/sim_launch.h"
#include "loom/backend/cuda/sim/sim_runtime.h"

namespace loom::sim {

struct GridLaunch {
  LaunchSpec spec;
  std::string name;
  std::shared_ptr<void> args;
  void (*run)(void*);
  uint64_t serial;
};

namespace {

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

std::string thread_name(const Block& b, const SimThread& t) {
  return "thread " + dims(t.idx) + " of block " + dims(b.idx);
}
std::string hex(unsigned v) {
  char text[16];
  std::snprintf(text, sizeof text, "0x%08x", v);
  return text;
}

void yield_to_scheduler() {
  SimThread* t = t_thread;
  t->back = std::move(t->back).resume();
  // Resumed by the scheduler: t_thread and t_block were set before the switch.
}

}  // namespace

std::string dims(uint3 v) {
  char text[48];
  std::snprintf(text, sizeof text, "(%u,%u,%u)", v.x, v.y, v.z);
  return text;
}
std::string dims(dim3 v) { return dims(uint3{v.x, v.y, v.z}); }

// A check fired inside the running block: report, stop the grid, make the error sticky.
void violation(const char* check, const std::string& what, cudaError_t error) {
  Block* b = t_block;
  if (b == nullptr || b->failed) return;
  b->failed = true;
  record_report(check, what + " (" + kernel_position() + ")");
  set_sticky(error);
}

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
    t.async.clear();
    t.async_groups = 0;
    t.fiber = ctx::fiber(std::allocator_arg, PooledStack{}, [&launch, &t](ctx::fiber&& back) {
      t.back = std::move(back);
      launch.run(launch.args.get());
      finish_async_copies();
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

