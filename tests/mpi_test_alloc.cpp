// A training step allocates nothing (train/trainer.h): for every layout the distributed tests
// build, steps 2..4 make no operator-new call and no allocation through the backend's
// allocator on any rank. Step 1 may still allocate (first-use buffers).
//
// operator new is replaced in this binary: every variant counts while counting is on.
// LOOM_ALLOC_TRACE=1 prints each counted call's stack (addr2line turns the offsets into lines).
#include <execinfo.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <new>

#include "mpi_layout.h"

namespace {

std::atomic<bool> g_counting{false};
std::atomic<int64_t> g_news{0};
bool g_trace = false;
thread_local bool t_tracing = false;

void note_new() {
  if (!g_counting.load(std::memory_order_relaxed)) return;
  g_news.fetch_add(1, std::memory_order_relaxed);
  if (g_trace && !t_tracing) {
    t_tracing = true;
    void* frames[32];
    const int depth = backtrace(frames, 32);
    backtrace_symbols_fd(frames, depth, STDERR_FILENO);
    (void)!write(STDERR_FILENO, "--\n", 3);
    t_tracing = false;
  }
}

void* allocate(std::size_t bytes, std::size_t alignment) {
  note_new();
  const std::size_t align = alignment < sizeof(void*) ? sizeof(void*) : alignment;
  const std::size_t rounded = bytes == 0 ? align : (bytes + align - 1) / align * align;
  void* p = alignment <= alignof(std::max_align_t) ? std::malloc(rounded) : std::aligned_alloc(align, rounded);
  if (p == nullptr) throw std::bad_alloc();
  return p;
}

void* allocate_nothrow(std::size_t bytes, std::size_t alignment) noexcept {
  try {
    return allocate(bytes, alignment);
  } catch (...) {
    return nullptr;
  }
}

// The operator-new calls between start() and stop() on any thread of this process.
class NewCounter {
 public:
  NewCounter() {
    g_news.store(0);
    g_counting.store(true);
  }
  int64_t stop() {
    g_counting.store(false);
    return g_news.load();
  }
  ~NewCounter() { g_counting.store(false); }
};

}  // namespace

constexpr std::size_t kPlain = alignof(std::max_align_t);
void* operator new(std::size_t n) { return allocate(n, kPlain); }
void* operator new[](std::size_t n) { return allocate(n, kPlain); }
void* operator new(std::size_t n, const std::nothrow_t&) noexcept { return allocate_nothrow(n, kPlain); }
void* operator new[](std::size_t n, const std::nothrow_t&) noexcept { return allocate_nothrow(n, kPlain); }
void* operator new(std::size_t n, std::align_val_t a) { return allocate(n, static_cast<std::size_t>(a)); }
void* operator new[](std::size_t n, std::align_val_t a) { return allocate(n, static_cast<std::size_t>(a)); }
void* operator new(std::size_t n, std::align_val_t a, const std::nothrow_t&) noexcept {
  return allocate_nothrow(n, static_cast<std::size_t>(a));
}
void* operator new[](std::size_t n, std::align_val_t a, const std::nothrow_t&) noexcept {
  return allocate_nothrow(n, static_cast<std::size_t>(a));
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t) noexcept { std::free(p); }
void operator delete(void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete(void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }
void operator delete(void* p, const std::nothrow_t&) noexcept { std::free(p); }
void operator delete[](void* p, const std::nothrow_t&) noexcept { std::free(p); }
void operator delete(void* p, std::align_val_t, const std::nothrow_t&) noexcept { std::free(p); }
void operator delete[](void* p, std::align_val_t, const std::nothrow_t&) noexcept { std::free(p); }

namespace loom {
namespace {

// Trains steps 1..4 of the layout and expects steps 2..4 to allocate nothing on this rank.
void check(Communicator& world, const RunLayout& lay) {
  LayoutRun run(world, lay);
  const MemoryTracker& tracker = run.backend->allocator().tracker();
  run.trainer->train_step(*run.data);
  for (int step = 2; step <= 4; ++step) {
    const size_t tracked = tracker.allocations();
    NewCounter counter;
    run.trainer->train_step(*run.data);
    const int64_t news = counter.stop();
    EXPECT_EQ(news, 0) << lay.name() << ": operator new calls in step " << step << " on rank " << world.rank();
    EXPECT_EQ(tracker.allocations() - tracked, 0u)
        << lay.name() << ": backend allocations in step " << step << " on rank " << world.rank();
  }
}

// Data parallelism and ZeRO over every rank, and tensor parallelism without sequence
// parallelism (with data parallelism on 4 ranks), beside the model-parallel layouts.
std::vector<RunLayout> alloc_layouts(int n) {
  std::vector<RunLayout> layouts;
  for (const char* preset : {"gpt2-tiny", "llama-tiny"}) {
    for (int zero = 0; zero <= 3; ++zero) {
      RunLayout l;
      l.preset = preset, l.dp = n, l.zero = zero, l.grad_accum = 2;
      layouts.push_back(l);
    }
    RunLayout tp;
    tp.preset = preset, tp.dp = n / 2, tp.tp = 2;
    layouts.push_back(tp);
  }
  RunLayout moe;
  moe.preset = "moe-tiny", moe.dp = n / 2, moe.ep = 2, moe.moe_losses = true, moe.grad_accum = 2;
  layouts.push_back(moe);
  for (const RunLayout& l : model_parallel_layouts(n)) layouts.push_back(l);
  return layouts;
}

TEST(MpiAllocation, TrainingStepsAfterTheFirstAllocateNothing) {
  g_trace = std::getenv("LOOM_ALLOC_TRACE") != nullptr;
  if (g_trace) {
    void* frame;
    (void)backtrace(&frame, 1);  // loads the unwinder now, not inside a counted call
  }
  auto world = make_mpi_communicator();
  const int n = world->size();
  if (n != 2 && n != 4) GTEST_SKIP() << "runs under np 2 and 4";
  for (const RunLayout& lay : alloc_layouts(n)) check(*world, lay);
}

}  // namespace
}  // namespace loom
