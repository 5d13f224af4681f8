// loom supervise: relaunches a training job that died, resuming from its newest valid checkpoint
// (docs/operations.md "Restarts"). The job is any command line — `loom train ...` or `mpirun -np
// N loom train ...` — so one process or a whole MPI job is restarted; `loom train --restarts N`
// supervises itself the same way.
#include <sys/wait.h>
#include <unistd.h>

#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "cli.h"
#include "commands.h"
#include "loom/core/error.h"
#include "loom/core/signals.h"
#include "loom/train/run_control.h"

namespace loom::cli {

namespace {

const char* kHelp =
    "usage: loom supervise [--restarts N] [--backoff SECONDS] -- COMMAND [ARGS...]\n"
    "\n"
    "Runs COMMAND (e.g. loom train ... or mpirun -np 4 loom train ...) and, when it dies — a crash,\n"
    "a killed process or rank, any non-zero exit other than a preemption's 75 — runs it again with\n"
    "--resume added (once), so it continues from the newest valid checkpoint. Waits SECONDS before\n"
    "the first restart, doubling up to 60 s, and gives up after N restarts with the last exit status.\n"
    "SIGTERM, SIGINT and SIGUSR1 are passed to COMMAND (loom train checkpoints and exits 75);\n"
    "after one, supervise restarts nothing and exits with COMMAND's status (the scheduler's call).\n";

// The signal handler's state (it runs on core/signals.h's signal thread): the running command, to
// which it forwards, and the first signal received, after which nothing is restarted.
std::atomic<pid_t> g_child{0};
std::atomic<int> g_received{0};
constexpr int kForwarded[] = {SIGTERM, SIGINT, SIGUSR1};

extern "C" void forward_signal(int signal) {
  int none = 0;
  g_received.compare_exchange_strong(none, signal);
  if (const pid_t child = g_child.load(); child > 0) ::kill(child, signal);
}

// The exit status a shell would report: the code, or 128 + the signal.
int status_code(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return 1;
}

}  // namespace

int supervise(std::vector<std::string> command, int64_t restarts, double backoff) {
  LOOM_CHECK(!command.empty(), "loom supervise needs a command after --");
  LOOM_CHECK(restarts >= 0, "--restarts must be >= 0, got ", restarts);
  LOOM_CHECK(backoff >= 0.0, "--backoff must be >= 0, got ", backoff);
  struct sigaction action = {};
  action.sa_handler = forward_signal;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART;
  for (const int s : kForwarded) sigaction(s, &action, nullptr);
  int code = 0;
  for (int64_t attempt = 0;; ++attempt) {
    std::vector<char*> argv;
    for (std::string& a : command) argv.push_back(a.data());
    argv.push_back(nullptr);
    std::fflush(stdout);
    std::fflush(stderr);
    const pid_t pid = ::fork();
    LOOM_CHECK(pid >= 0, "loom supervise: fork failed: ", std::strerror(errno));
    if (pid == 0) {
      for (const int s : kForwarded) std::signal(s, SIG_DFL);
      pthread_sigmask(SIG_SETMASK, &original_signal_mask(), nullptr);  // the command gets the signals loom blocks
      ::execvp(argv[0], argv.data());
      std::fprintf(stderr, "loom supervise: error: cannot run %s: %s\n", argv[0], std::strerror(errno));
      _exit(127);
    }
    g_child.store(pid);
    if (const int s = g_received.load(); s != 0) ::kill(pid, s);  // one that came while it was starting
    int status = 0;
    while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
    }
    g_child.store(0);
    code = status_code(status);
    if (g_received.load() != 0) {
      std::fprintf(stderr, "loom supervise: received %s: %s exited with status %d; not restarting\n",
                   StopSignals::name(g_received.load()), command[0].c_str(), code);
      break;
    }
    if (code == 0 || code == kPreemptedExit || code == 127) break;  // done, preempted, or not runnable
    if (attempt >= restarts) {
      std::fprintf(stderr, "loom supervise: error: %s failed %lld time%s (last exit status %d%s); giving up after "
                   "%lld restart%s\n", command[0].c_str(), static_cast<long long>(attempt + 1), attempt == 0 ? "" : "s",
                   code, code > 128 ? str_cat(": signal ", code - 128).c_str() : "", static_cast<long long>(restarts),
                   restarts == 1 ? "" : "s");
      break;
    }
    const double wait = std::min(60.0, backoff * static_cast<double>(int64_t{1} << std::min<int64_t>(attempt, 20)));
    std::fprintf(stderr, "loom supervise: %s exited with status %d; restart %lld of %lld in %.1f s, resuming from the "
                 "newest valid checkpoint\n", command[0].c_str(), code, static_cast<long long>(attempt + 1),
                 static_cast<long long>(restarts), wait);
    const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(wait);
    while (g_received.load() == 0 && std::chrono::steady_clock::now() < until) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    if (const int s = g_received.load(); s != 0) {
      std::fprintf(stderr, "loom supervise: received %s while waiting to restart; not restarting\n", StopSignals::name(s));
      break;
    }
    if (std::find(command.begin(), command.end(), "--resume") == command.end()) command.push_back("--resume");
  }
  for (const int s : kForwarded) std::signal(s, SIG_DFL);
  return code;
}

int supervise_main(int argc, char** argv) {
  std::vector<char*> options;
  std::vector<std::string> command;
  int i = 0;
  for (; i < argc && std::strcmp(argv[i], "--") != 0; ++i) options.push_back(argv[i]);
  for (++i; i < argc; ++i) command.emplace_back(argv[i]);
  const Args args(static_cast<int>(options.size()), options.data(), "supervise", kHelp,
                  {{"restarts", "N", "restarts before giving up (default 3)"},
                   {"backoff", "SECONDS", "wait before the first restart, doubled each time up to 60 s (default 1)"}});
  return supervise(command, args.get_int("restarts", 3), args.get_double("backoff", 1.0));
}

}  // namespace loom::cli
