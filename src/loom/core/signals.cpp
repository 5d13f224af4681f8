#include "loom/core/signals.h"

#include <pthread.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <thread>

namespace loom {

namespace {

sigset_t g_original;        // the mask before block_async_signals (written once, before any thread)
bool g_blocked = false;

// Every signal but the synchronous ones a thread raises on itself (a fault in the code it runs,
// abort(), a write to a closed pipe): those must reach the thread that caused them.
sigset_t async_signals() {
  sigset_t set;
  sigfillset(&set);
  for (const int sync : {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGTRAP, SIGSYS, SIGABRT, SIGPIPE}) sigdelset(&set, sync);
  return set;
}

}  // namespace

// The original mask crosses a re-execution (core/threads.h) in the environment: the signals stay
// blocked through execv, so that one that arrives meanwhile stays pending instead of taking its
// default action, and the new image must not take that blocked mask for the original.
constexpr const char* kMaskVariable = "LOOM_ORIGINAL_SIGMASK";

void block_async_signals() {
  if (g_blocked) return;
  const sigset_t set = async_signals();
  pthread_sigmask(SIG_BLOCK, &set, &g_original);
  g_blocked = true;
}

namespace {

// The original mask as the environment gives it after a re-execution (once, on the main thread,
// after the C library's initialization; block_async_signals may run before it).
void adopt_mask_from_environment() {
  static bool done = false;
  if (done) return;
  done = true;
  const char* saved = std::getenv(kMaskVariable);
  if (saved == nullptr) return;
  const unsigned long long bits = std::strtoull(saved, nullptr, 16);
  sigemptyset(&g_original);
  for (int s = 1; s < 64; ++s) {
    if ((bits >> s) & 1ULL) sigaddset(&g_original, s);
  }
  unsetenv(kMaskVariable);
}

}  // namespace

void keep_original_signal_mask_across_exec() {
  unsigned long long bits = 0;
  for (int s = 1; s < 64; ++s) {
    if (sigismember(&original_signal_mask(), s) == 1) bits |= 1ULL << s;
  }
  char text[32];
  std::snprintf(text, sizeof text, "%llx", bits);
  setenv(kMaskVariable, text, 1);
}

void start_signal_thread() {
  static bool started = false;
  if (!g_blocked || started) return;
  adopt_mask_from_environment();
  started = true;
  std::thread([] {
    const sigset_t set = async_signals();
    pthread_sigmask(SIG_UNBLOCK, &set, nullptr);
    for (;;) ::pause();  // handlers run here; the thread ends with the process
  }).detach();
}

const sigset_t& original_signal_mask() {
  if (!g_blocked) pthread_sigmask(SIG_SETMASK, nullptr, &g_original);
  adopt_mask_from_environment();
  return g_original;
}

OriginalSignalMask::OriginalSignalMask() { pthread_sigmask(SIG_SETMASK, &original_signal_mask(), &saved_); }

OriginalSignalMask::~OriginalSignalMask() { pthread_sigmask(SIG_SETMASK, &saved_, nullptr); }

}  // namespace loom
