// Operating a training run (docs/operations.md): the run folder's lock and the refusal to
// overwrite a run, preemption signals, the collective watchdog, and the config a resume differs
// in. What `loom train` needs to survive schedulers, failing machines and its own users.
#pragma once
#include <csignal>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <string>
#include <thread>
#include <vector>

#include "loom/core/memory.h"  // available_memory_bytes
#include "loom/comm/communicator.h"

namespace loom {

// `loom train` exits with this code after SIGTERM or SIGINT made it checkpoint and stop (BSD's
// EX_TEMPFAIL: "try again later"); a supervisor relaunches it with --resume. A second signal
// exits at once with 128 + the signal's number.
inline constexpr int kPreemptedExit = 75;

// An exclusive lock on <run>/.lock (flock), held for the process's life: a second `loom train`
// on the same run folder is refused naming the holder's pid instead of racing it.
class RunFolderLock {
 public:
  explicit RunFolderLock(const std::string& run_dir);
  ~RunFolderLock();
  RunFolderLock(const RunFolderLock&) = delete;
  RunFolderLock& operator=(const RunFolderLock&) = delete;

 private:
  int fd_ = -1;
};

// A fresh run (no --resume) into a folder that already holds checkpoints or metrics is refused,
// naming them; --overwrite deletes them first (checkpoints/, metrics.jsonl, logs/, trace/,
// samples.txt). Returns what was deleted ("" if nothing).
std::string prepare_run_folder(const std::string& run_dir, bool resume, bool overwrite);

// SIGTERM, SIGINT and SIGUSR1 (the warning Slurm sends with --signal=USR1@SECONDS before it
// preempts): the first sets the request (the loop checkpoints at the step's end and exits
// kPreemptedExit), a second exits at once. The handlers run on the signal thread of
// core/signals.h, never on a thread that computes; main() installs them for `loom train` before
// that thread starts, so a signal sent while the run is still starting (or re-executing itself)
// is kept for the loop rather than killing it. The handler's flag is the one global besides the
// logger: a signal handler receives no context (POSIX sigaction).
inline constexpr int kStopSignals[] = {SIGTERM, SIGINT, SIGUSR1};
void install_stop_handlers();

class StopSignals {
 public:
  StopSignals();   // installs the handlers (again, for `train`: idempotent); keeps a request already made
  ~StopSignals();  // the default actions again
  StopSignals(const StopSignals&) = delete;
  StopSignals& operator=(const StopSignals&) = delete;
  int requested() const;  // the first signal's number, 0 if none
  static const char* name(int signal);
};

// Ends a job that stopped making progress: every rank's loop calls beat() after each step (and
// after evaluation and saves); when `seconds` pass without one, the rank prints one line naming
// the ranks whose heartbeats (<run>/logs/heartbeat.rank<N>, written by beat) are the oldest — the
// silent ones — and aborts the MPI job. Only the lowest-ranked rank still beating prints.
class Watchdog {
 public:
  Watchdog(double seconds, std::string run_dir, Communicator& job);  // job: the world, which it ends
  ~Watchdog();
  void beat(int64_t step);

 private:
  void run();
  // The ranks whose heartbeats are older than 3 s (with a line naming each), and the lowest rank
  // still beating (this one at worst).
  struct Silence {
    std::vector<int> ranks;
    std::string detail;
    int first_alive = -1;
  };
  Silence listen() const;
  double seconds_;
  std::string run_dir_;
  Communicator& job_;
  int rank_, world_;
  std::atomic<int64_t> last_ns_;
  std::atomic<int64_t> step_{0};
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

// The keys whose values differ between two resolved config texts (config_to_toml's), each
// "key: old -> new", in file order.
std::vector<std::string> config_differences(const std::string& before, const std::string& after);

}  // namespace loom
