#include "loom/core/trace.h"

#include <nlohmann/json.hpp>

#include "loom/core/file_io.h"

namespace loom {

void Tracer::complete(const char* name, const char* cat, int64_t start_ns, int tid, int64_t bytes, int64_t sent,
                      const char* group) {
  const int64_t end = now_ns();
  const std::lock_guard<std::mutex> lock(mutex_);
  events_.push_back({name, cat, group, start_ns, end - start_ns, bytes, sent, tid});
}

size_t Tracer::size() const {
  const std::lock_guard<std::mutex> lock(mutex_);
  return events_.size();
}

void Tracer::write(const std::string& path) const {
  const std::lock_guard<std::mutex> lock(mutex_);
  const int64_t origin = events_.empty() ? 0 : events_.front().start_ns;
  int64_t first = origin;
  for (const Event& e : events_) first = std::min(first, e.start_ns);
  nlohmann::json events = nlohmann::json::array();
  // Metadata events name the process and threads in the viewer.
  events.push_back({{"name", "process_name"}, {"ph", "M"}, {"pid", pid_}, {"tid", 0},
                    {"args", {{"name", "rank " + std::to_string(pid_)}}}});
  events.push_back({{"name", "thread_name"}, {"ph", "M"}, {"pid", pid_}, {"tid", 0}, {"args", {{"name", "training"}}}});
  events.push_back({{"name", "thread_name"}, {"ph", "M"}, {"pid", pid_}, {"tid", 1}, {"args", {{"name", "checkpoint writer"}}}});
  for (const Event& e : events_) {
    nlohmann::json args = nlohmann::json::object();
    if (e.bytes >= 0) args["bytes"] = e.bytes;
    if (e.sent >= 0) args["sent"] = e.sent;
    if (e.group != nullptr) args["group"] = e.group;
    // Microseconds since the first event, with nanosecond resolution kept as fractions.
    events.push_back({{"name", e.name}, {"cat", e.cat}, {"ph", "X"}, {"ts", static_cast<double>(e.start_ns - first) * 1e-3},
                      {"dur", static_cast<double>(e.dur_ns) * 1e-3}, {"pid", pid_}, {"tid", e.tid}, {"args", args}});
  }
  const nlohmann::json trace = {{"traceEvents", events}, {"displayTimeUnit", "ms"}};
  write_file_atomic(path, trace.dump());
}

}  // namespace loom
