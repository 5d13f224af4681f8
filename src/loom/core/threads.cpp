#include "loom/core/threads.h"

#include <fcntl.h>
#include <immintrin.h>
#include <linux/futex.h>
#include <sched.h>
#include <omp.h>
#include <strings.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <thread>
#include <vector>

#include "loom/core/env.h"
#include "loom/core/error.h"
#include "loom/core/signals.h"

namespace loom {

void use_passive_omp_waits(char** argv) {
  if (std::getenv("OMP_WAIT_POLICY") != nullptr || std::getenv("GOMP_SPINCOUNT") != nullptr) return;
  if (setenv("OMP_WAIT_POLICY", "PASSIVE", 1) != 0) return;
  keep_original_signal_mask_across_exec();  // blocked signals stay pending through the exec
  execv("/proc/self/exe", argv);
  // execv returned: /proc is not mounted or the binary is gone. The runtime keeps its default;
  // the variables are cleared so that child processes see what this one runs under.
  unsetenv("OMP_WAIT_POLICY");
  unsetenv("LOOM_ORIGINAL_SIGMASK");
}

std::string omp_wait_policy() {
  if (const char* policy = std::getenv("OMP_WAIT_POLICY")) return policy;
  if (const char* spins = std::getenv("GOMP_SPINCOUNT")) return std::string("GOMP_SPINCOUNT=") + spins;
  return "default";
}

namespace {

constexpr int64_t kMaxSpinMicros = 10'000'000;

int64_t spin_micros() {  // microseconds
  static const int64_t micros = env_integer("LOOM_SPIN_US", kDefaultSpinMicros, 0, kMaxSpinMicros);
  return micros;
}

// Spins until done() or until `micros` have passed; returns done().
template <class Done>
bool spin_until(Done done, int64_t micros) {
  if (micros <= 0) return done();
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::microseconds(micros);
  for (;;) {
    for (int i = 0; i < 64; ++i) {
      if (done()) return true;
      _mm_pause();
    }
    if (std::chrono::steady_clock::now() >= deadline) return done();
  }
}

// [begin, end) of part `index` of `parts` over [0, count), as schedule(static) splits: the first
// count % parts parts one longer.
void run_part(int64_t count, int index, int parts, RangeFn fn, void* ctx) {
  const int64_t q = count / parts, r = count % parts;
  const int64_t begin = index * q + std::min<int64_t>(index, r);
  const int64_t end = begin + q + (index < r ? 1 : 0);
  if (begin < end) fn(ctx, begin, end);
}

std::atomic<int64_t> g_threads_started{0};

}  // namespace

int runnable_threads(const char* loadavg) {
  // "0.52 0.58 0.59 3/250 12345": the fourth field is runnable / existing scheduling entities.
  const char* p = loadavg;
  for (int field = 0; field < 3; ++field) {
    p = std::strchr(p, ' ');
    if (p == nullptr) return -1;
    ++p;
  }
  char* end = nullptr;
  const long n = std::strtol(p, &end, 10);
  return end != p && *end == '/' && n >= 0 && n <= INT32_MAX ? static_cast<int>(n) : -1;
}

namespace {

// Whether another process wants the cores: more threads runnable on the machine than this
// process may use CPUs (its affinity), read from /proc/loadavg at most every kSampleMicros by the
// team's caller right after it publishes a run (so the team's own threads, working, spinning or
// just woken, are counted). Contended from the first such sample until kCleanSamples in a row are
// not. Unreadable: never contended.
class Contention {
 public:
  static constexpr int64_t kSampleMicros = 10'000;
  static constexpr int kCleanSamples = 3;

  Contention() : fd_(::open("/proc/loadavg", O_RDONLY | O_CLOEXEC)) {
    cpu_set_t set;
    CPU_ZERO(&set);
    cpus_ = sched_getaffinity(0, sizeof(set), &set) == 0 ? CPU_COUNT(&set) : 1;
  }
  ~Contention() {
    if (fd_ >= 0) ::close(fd_);
  }
  Contention(const Contention&) = delete;
  Contention& operator=(const Contention&) = delete;

  bool contended() {
    if (fd_ < 0) return false;
    const auto now = std::chrono::steady_clock::now();
    if (now < next_) return clean_ < kCleanSamples;
    next_ = now + std::chrono::microseconds(kSampleMicros);
    char text[128];
    const ssize_t n = ::pread(fd_, text, sizeof(text) - 1, 0);
    const int runnable = n > 0 ? (text[n] = '\0', runnable_threads(text)) : -1;
    clean_ = runnable > cpus_ ? 0 : std::min(clean_ + 1, kCleanSamples);
    return clean_ < kCleanSamples;
  }

 private:
  int fd_;
  int cpus_ = 1;
  int clean_ = kCleanSamples;
  std::chrono::steady_clock::time_point next_{};
};

// Sleeps while *word == expected (FUTEX_WAIT: the kernel compares and sleeps atomically, so a
// change just before the call returns at once); spurious returns are the callers' loops' concern.
void futex_wait(std::atomic<uint32_t>& word, uint32_t expected) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAIT_PRIVATE, expected, nullptr, nullptr, 0);
}
void futex_wake_all(std::atomic<uint32_t>& word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAKE_PRIVATE, INT32_MAX, nullptr, nullptr, 0);
}

// The caller and size - 1 workers. A run publishes its work and bumps `generation_`; each worker
// runs its part and counts `remaining_` down; the caller returns when it reaches 0, so the next
// run cannot overwrite work a worker has not read. Waits spin for spin_micros() (not at all while
// another process wants the cores: Contention) and then sleep on a futex, counted in `sleepers_`
// so that a wake costs a system call only when someone sleeps: a sleeper counts itself before it
// checks the word, the waker changes the word before it reads the count (both sequentially
// consistent), so one of them sees the other. (std::atomic's notify cannot tell whether anyone
// sleeps on this word: libstdc++ 12 counts waiters per slot of a 16-slot table keyed by address,
// so a waiter on any word sharing the slot makes every notify a system call.)
class Team {
 public:
  explicit Team(int size) : size_(size) {
    for (int i = 1; i < size; ++i) {
      workers_.emplace_back([this, i] { work(i); });
      g_threads_started.fetch_add(1);
    }
  }
  ~Team() {
    stopping_.store(true);
    publish(generation_);
    for (std::thread& t : workers_) t.join();
  }
  int size() const { return size_; }

  void run(int64_t count, RangeFn fn, void* ctx) {
    count_ = count, fn_ = fn, ctx_ = ctx;
    remaining_.store(static_cast<uint32_t>(size_ - 1), std::memory_order_relaxed);
    publish(generation_);
    spin_.store(spin_micros() > 0 && contention_.contended() ? 0 : spin_micros(), std::memory_order_relaxed);
    run_part(count, 0, size_, fn, ctx);
    wait_until(remaining_, [this] { return remaining_.load(std::memory_order_acquire) == 0; });
  }

 private:
  void work(int index) {
    uint32_t seen = 0;  // the generation before the first run
    for (;;) {
      wait_until(generation_, [&] { return generation_.load(std::memory_order_acquire) != seen; });
      seen = generation_.load(std::memory_order_acquire);
      if (stopping_.load()) return;
      run_part(count_, index, size_, fn_, ctx_);
      if (remaining_.fetch_sub(1, std::memory_order_seq_cst) == 1 && sleepers_.load(std::memory_order_seq_cst) > 0) {
        futex_wake_all(remaining_);
      }
    }
  }

  // generation_ + 1, waking whoever sleeps on it.
  void publish(std::atomic<uint32_t>& word) {
    word.fetch_add(1, std::memory_order_seq_cst);
    if (sleepers_.load(std::memory_order_seq_cst) > 0) futex_wake_all(word);
  }

  // Spins until done(), then sleeps on `word` until done().
  template <class Done>
  void wait_until(std::atomic<uint32_t>& word, Done done) {
    if (spin_until(done, spin_.load(std::memory_order_relaxed))) return;
    sleepers_.fetch_add(1, std::memory_order_seq_cst);
    for (;;) {
      const uint32_t seen = word.load(std::memory_order_seq_cst);
      if (done()) break;
      futex_wait(word, seen);
    }
    sleepers_.fetch_sub(1, std::memory_order_seq_cst);
  }

  const int size_;
  std::vector<std::thread> workers_;
  int64_t count_ = 0;
  RangeFn fn_ = nullptr;
  void* ctx_ = nullptr;
  std::atomic<bool> stopping_{false};
  Contention contention_;
  std::atomic<int64_t> spin_{0};  // the waits' spin window: spin_micros(), or 0 while contended
  alignas(64) std::atomic<uint32_t> generation_{0};
  alignas(64) std::atomic<uint32_t> remaining_{0};
  alignas(64) std::atomic<int> sleepers_{0};
};

std::mutex g_team_mutex;   // held by the thread running the team
Team* g_team = nullptr;    // rebuilt when the thread count changes; left to the process's exit

// Whether OpenMP's threads sleep as soon as they wait: only then is the team used. Where they
// spin (OMP_WAIT_POLICY=ACTIVE, GOMP_SPINCOUNT, the runtime's default) a region wakes no one, and
// the team's threads would take the cores the spinning ones hold (1.5B bf16 decoding with ACTIVE:
// 6.1 tokens/s with the team, 16 without).
bool omp_waits_passive() {
  static const bool passive = [] {
    const char* policy = std::getenv("OMP_WAIT_POLICY");
    return policy != nullptr && strcasecmp(policy, "passive") == 0 && std::getenv("GOMP_SPINCOUNT") == nullptr;
  }();
  return passive;
}

}  // namespace

void run_short_region(int64_t count, RangeFn fn, void* ctx) {
  spin_micros();  // a bad LOOM_SPIN_US is refused at the first region, on the caller's thread
  if (count <= 0) return;
  const int threads = omp_get_max_threads();
  if (threads <= 1 || omp_in_parallel()) {
    fn(ctx, 0, count);
    return;
  }
  std::unique_lock<std::mutex> lock(g_team_mutex, std::defer_lock);
  if (!omp_waits_passive() || !lock.try_lock()) {  // OpenMP's threads spin, or another thread runs the team
#pragma omp parallel num_threads(threads)
    run_part(count, omp_get_thread_num(), omp_get_num_threads(), fn, ctx);
    return;
  }
  if (g_team == nullptr || g_team->size() != threads) {
    delete g_team;
    g_team = nullptr;
    g_team = new Team(threads);
  }
  g_team->run(count, fn, ctx);
}

int64_t short_region_spin_micros() { return spin_micros(); }

int64_t short_region_threads_started() { return g_threads_started.load(); }

}  // namespace loom
