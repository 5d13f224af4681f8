// Shared between the simulator's kernel execution (exec.cpp: launches, the threads of a block on
// fibers, barriers, warp exchanges) and its access checks (exec_checks.cpp: memcheck, initcheck,
// racecheck, the atomics, -fsanitize=thread's hooks): the running block and thread, and shared
// memory's racecheck shadow. Not for callers.
#pragma once
#include <cuda_runtime.h>

#include <boost/context/fiber.hpp>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "loom/backend/cuda/sim/sim_internal.h"

namespace loom::sim {

namespace ctx = boost::context;

constexpr int kWarp = 32;

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
  // cp.async copies issued and not yet complete (exec_checks.cpp), and the groups committed.
  struct AsyncCopy {
    void* dst;
    unsigned char bytes[16];
    int size;
    uint32_t group;
  };
  std::vector<AsyncCopy> async;
  uint32_t async_groups = 0;
};
// Writes the running thread's pending cp.async copies (it exits).
void finish_async_copies();

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

inline thread_local Block* t_block = nullptr;
inline thread_local SimThread* t_thread = nullptr;

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
extern thread_local SharedRange t_shared;
// Finds this worker's shared memory (exec_checks.cpp).
void locate_shared();

// "(x,y,z)" in reports (exec.cpp).
std::string dims(uint3 v);
std::string dims(dim3 v);
// A check fired inside the running block: report, stop the grid, make the error sticky.
void violation(const char* check, const std::string& what, cudaError_t error);

}  // namespace loom::sim
