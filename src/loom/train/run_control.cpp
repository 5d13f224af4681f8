#include "loom/train/run_control.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>

#include "loom/comm/communicator.h"
#include "loom/core/error.h"
#include "loom/core/file_io.h"

namespace loom {

namespace fs = std::filesystem;

RunFolderLock::RunFolderLock(const std::string& run_dir) {
  const std::string path = (fs::path(run_dir) / ".lock").string();
  fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  LOOM_CHECK(fd_ >= 0, path, ": cannot open the run folder's lock: ", std::strerror(errno));
  if (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
    char pid[32] = {};
    const ssize_t n = ::pread(fd_, pid, sizeof pid - 1, 0);
    ::close(fd_);
    fd_ = -1;
    throw Error(str_cat(run_dir, " is in use by another loom train (pid ", n > 0 ? std::string(pid, static_cast<size_t>(n)) : "?",
                        ", holding ", path, "): wait for it to finish or choose another run.name"));
  }
  const std::string mine = std::to_string(::getpid());
  if (::ftruncate(fd_, 0) == 0) (void)!::pwrite(fd_, mine.data(), mine.size(), 0);
}

RunFolderLock::~RunFolderLock() {
  if (fd_ >= 0) ::close(fd_);  // releases the flock
}

std::string prepare_run_folder(const std::string& run_dir, bool resume, bool overwrite) {
  const fs::path dir(run_dir), checkpoints = dir / "checkpoints", metrics = dir / "metrics.jsonl";
  std::error_code ec;
  int64_t steps = 0;
  if (fs::is_directory(checkpoints, ec)) {
    for (const auto& entry : fs::directory_iterator(checkpoints, ec)) steps += entry.is_directory() ? 1 : 0;
  }
  const bool has_metrics = fs::exists(metrics, ec) && fs::file_size(metrics, ec) > 0;
  if (resume || (steps == 0 && !has_metrics)) return "";
  LOOM_CHECK(overwrite, run_dir, " already holds a run (", steps, " checkpoint folder", steps == 1 ? "" : "s",
             has_metrics ? ", metrics.jsonl" : "", "): continue it with --resume, start over with --overwrite (which "
             "deletes them), or choose another run.name");
  std::string removed;
  for (const char* name : {"checkpoints", "metrics.jsonl", "logs", "trace", "samples.txt", "report"}) {
    if (!fs::exists(dir / name, ec)) continue;
    remove_tree(dir / name);
    removed += std::string(removed.empty() ? "" : ", ") + name;
  }
  fsync_directory(run_dir);
  return removed;
}

// ---- Signals -----------------------------------------------------------------------------------

namespace {

// The handler's only state (see StopSignals). It runs on core/signals.h's signal thread and the
// loop reads it on the main thread: an atomic, lock-free and so async-signal-safe.
std::atomic<int> g_stop_signal{0};
static_assert(std::atomic<int>::is_always_lock_free);

extern "C" void on_stop_signal(int signal) {
  if (g_stop_signal.load() != 0) _exit(128 + signal);  // the second signal: at once (checkpoints are atomic)
  g_stop_signal.store(signal);
}

}  // namespace

void install_stop_handlers() {
  struct sigaction action = {};
  action.sa_handler = on_stop_signal;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART;  // a signal does not fail the step's reads and writes
  for (const int s : kStopSignals) sigaction(s, &action, nullptr);
}

StopSignals::StopSignals() { install_stop_handlers(); }

StopSignals::~StopSignals() {
  for (const int s : kStopSignals) std::signal(s, SIG_DFL);
}

int StopSignals::requested() const { return g_stop_signal.load(); }

const char* StopSignals::name(int signal) {
  return signal == SIGTERM ? "SIGTERM" : signal == SIGINT ? "SIGINT" : signal == SIGUSR1 ? "SIGUSR1" : "a signal";
}

// ---- Watchdog ----------------------------------------------------------------------------------

namespace {

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

int64_t wall_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::system_clock::now().time_since_epoch()).count();
}

std::string heartbeat_path(const std::string& run_dir, int rank) {
  return (fs::path(run_dir) / "logs" / ("heartbeat.rank" + std::to_string(rank))).string();
}

}  // namespace

Watchdog::Watchdog(double seconds, std::string run_dir, Communicator& job)
    : seconds_(seconds), run_dir_(std::move(run_dir)), job_(job), rank_(job.rank()), world_(job.size()), last_ns_(now_ns()) {
  if (seconds_ <= 0.0 || world_ <= 1) return;  // one process has no peer to wait for
  std::error_code ec;
  fs::create_directories(fs::path(run_dir_) / "logs", ec);
  beat(-1);  // (-1: no step finished yet)
  thread_ = std::thread([this] { run(); });
}

Watchdog::~Watchdog() {
  stop_ = true;
  if (thread_.joinable()) thread_.join();
}

void Watchdog::beat(int64_t step) {
  last_ns_ = now_ns();
  step_ = step;
}

Watchdog::Silence Watchdog::listen() const {
  Silence out;
  for (int r = 0; r < world_; ++r) {
    std::ifstream in(heartbeat_path(run_dir_, r));
    int64_t step = 0, wall = 0;
    in >> step >> wall;
    const double age = static_cast<double>(wall_ns() - wall) * 1e-9;
    if (r == rank_ || (in && age <= 3.0)) {
      if (out.first_alive < 0) out.first_alive = r;
      continue;
    }
    out.ranks.push_back(r);
    out.detail += str_cat(out.detail.empty() ? "" : ", ", "rank ", r,
                          in ? str_cat(" (silent for ", static_cast<int64_t>(age), " s, last finished step ", step + 1, ")")
                             : std::string(" (never reported)"));
  }
  return out;
}

void Watchdog::run() {
  // Every second this thread writes "<last finished step> <wall-clock ns>" to its heartbeat file
  // (one folder every rank sees). A rank blocked in a collective keeps writing; a stopped
  // (SIGSTOP) or dead one does not: its heartbeat goes stale, and that names it.
  int64_t written = 0;
  auto heartbeat = [&] {
    if (now_ns() - written < 1'000'000'000) return;
    written = now_ns();
    const std::string path = heartbeat_path(run_dir_, rank_), tmp = path + ".tmp";
    {
      std::ofstream out(tmp, std::ios::trunc);
      out << step_.load() << " " << wall_ns() << "\n";
    }
    std::error_code ec;
    fs::rename(tmp, path, ec);
  };
  while (!stop_) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    heartbeat();
    const double idle = static_cast<double>(now_ns() - last_ns_.load()) * 1e-9;
    if (idle < seconds_ || stop_) continue;
    // A heartbeat older than 3 s (three missed writes) is a silent rank. A rank stopped just now
    // is not stale yet: look again for a few seconds before concluding that every rank is alive.
    Silence silence = listen();
    for (int look = 1; look < 8 && silence.ranks.empty(); ++look) {
      std::this_thread::sleep_for(std::chrono::seconds(1));
      heartbeat();  // (still alive while looking: the others must not take this rank for silent)
      silence = listen();
    }
    if (silence.first_alive == rank_) {  // the lowest-ranked rank still alive prints
      std::fprintf(stderr, "loom train: error: rank %d: no progress for %.0f s in step %lld (train.watchdog_seconds = "
                   "%g): %s; ending the job\n", rank_, idle, static_cast<long long>(step_.load() + 2), seconds_,
                   silence.ranks.empty() ? "every rank is alive but none progresses (a hang inside a collective, or "
                                           "the network between ranks is down)"
                                         : str_cat("silent: ", silence.detail, " (stopped, dead or unreachable)").c_str());
      std::fflush(stderr);
    } else {
      std::this_thread::sleep_for(std::chrono::seconds(3));  // the reporting rank ends the job first
    }
    job_.abort_job(3);
    _exit(3);
  }
}

// ---- Config differences ------------------------------------------------------------------------

std::vector<std::string> config_differences(const std::string& before, const std::string& after) {
  // config_to_toml writes "[section]" lines and "key = value" lines, one key per line.
  auto keys = [](const std::string& text) {
    std::vector<std::pair<std::string, std::string>> out;
    std::istringstream in(text);
    std::string section, line;
    while (std::getline(in, line)) {
      if (line.empty()) continue;
      if (line.front() == '[') {
        section = line.substr(1, line.find(']') - 1);
        continue;
      }
      const size_t eq = line.find(" = ");
      if (eq == std::string::npos) continue;
      out.emplace_back(section.empty() ? line.substr(0, eq) : section + "." + line.substr(0, eq), line.substr(eq + 3));
    }
    return out;
  };
  std::map<std::string, std::string> old_values;
  for (auto& [k, v] : keys(before)) old_values[k] = v;
  std::vector<std::string> out;
  for (auto& [k, v] : keys(after)) {
    const auto it = old_values.find(k);
    if (it == old_values.end()) out.push_back(str_cat(k, ": (absent) -> ", v));
    else if (it->second != v) out.push_back(str_cat(k, ": ", it->second, " -> ", v));
  }
  return out;
}

}  // namespace loom
