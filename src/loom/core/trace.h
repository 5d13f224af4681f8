// A timeline of one rank's work, written as a Chrome trace (the "Trace Event Format": a JSON
// object whose "traceEvents" are complete events {"name", "cat", "ph": "X", "ts", "dur" in
// microseconds, "pid", "tid", "args"}), which Perfetto (ui.perfetto.dev) and chrome://tracing
// open. train.trace = true gives each rank one: pid = the rank, tid 0 the training thread, tid 1
// the checkpoint writer. Categories: "compute" (forward, backward, optimizer), "comm" (one event
// per collective, from issue to completion, with its bytes), "data", "checkpoint", "eval",
// "step" (a whole step; what its children leave uncovered is idle).
// Events are kept in memory (a few per layer per step) and written once, at the end.
#pragma once
#include <chrono>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

namespace loom {

class Tracer {
 public:
  explicit Tracer(int pid) : pid_(pid) {}
  static int64_t now_ns() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
        .count();
  }
  // One complete event from start_ns to now. name and cat must outlive the tracer (literals).
  // bytes / sent >= 0 go into args (a collective's buffer and the bytes it sends).
  void complete(const char* name, const char* cat, int64_t start_ns, int tid = 0, int64_t bytes = -1,
                int64_t sent = -1, const char* group = nullptr);
  // The Chrome trace JSON, written atomically to `path`.
  void write(const std::string& path) const;
  size_t size() const;

 private:
  struct Event {
    const char* name;
    const char* cat;
    const char* group;
    int64_t start_ns, dur_ns, bytes, sent;
    int tid;
  };
  int pid_;
  mutable std::mutex mutex_;  // the checkpoint writer's thread records too
  std::vector<Event> events_;
};

// Records [construction, destruction) as one event when tracer is non-null.
class TraceSpan {
 public:
  TraceSpan(Tracer* tracer, const char* name, const char* cat, int tid = 0)
      : tracer_(tracer), name_(name), cat_(cat), tid_(tid), start_(tracer != nullptr ? Tracer::now_ns() : 0) {}
  ~TraceSpan() {
    if (tracer_ != nullptr) tracer_->complete(name_, cat_, start_, tid_);
  }
  TraceSpan(const TraceSpan&) = delete;
  TraceSpan& operator=(const TraceSpan&) = delete;

 private:
  Tracer* tracer_;
  const char* name_;
  const char* cat_;
  int tid_;
  int64_t start_;
};

}  // namespace loom
