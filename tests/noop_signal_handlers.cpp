// Preloaded into `loom` by tests/signal_test.py (LD_PRELOAD): installs handlers that do nothing
// for SIGUSR1, SIGUSR2, SIGCHLD, SIGPROF and SIGWINCH before main runs, as a profiler, a
// language runtime or any library a user links may. Such a handler running on a thread inside
// oneDNN's JIT GEMM corrupted the heap (issue 41; src/loom/core/signals.h).
#include <signal.h>

#include <initializer_list>

namespace {

extern "C" void do_nothing(int) {}

__attribute__((constructor)) void install() {
  struct sigaction action = {};
  action.sa_handler = do_nothing;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART;
  for (const int s : {SIGUSR1, SIGUSR2, SIGCHLD, SIGPROF, SIGWINCH}) sigaction(s, &action, nullptr);
}

}  // namespace
