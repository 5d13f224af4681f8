// The server's counters and latency histograms, rendered in Prometheus' text exposition format
// (https://prometheus.io/docs/instrumenting/exposition_formats/: `# HELP`, `# TYPE`, cumulative
// `_bucket{le="..."}` lines, `_sum`, `_count`). Thread-safe: HTTP threads count requests, the
// scheduler thread counts tokens and latencies.
#pragma once
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

namespace loom::serve {

class Histogram {
 public:
  explicit Histogram(std::vector<double> bounds) : bounds_(std::move(bounds)), counts_(bounds_.size() + 1, 0) {}
  void observe(double value);
  // `name`_bucket / _sum / _count lines (no HELP/TYPE).
  std::string render(const std::string& name) const;
  int64_t count() const { return count_; }
  // The value below which a fraction q of the observations lie, read off the buckets (their
  // upper bounds; +Inf reads as the largest bound).
  double quantile(double q) const;

 private:
  std::vector<double> bounds_;
  std::vector<int64_t> counts_;  // [bucket], not cumulative; the last is +Inf
  double sum_ = 0;
  int64_t count_ = 0;
};

// What the scheduler reports of the engine at a moment.
struct EngineGauges {
  int64_t queued = 0, running = 0, max_batch = 0;
  int64_t kv_blocks_used = 0, kv_blocks_free = 0, kv_blocks_cached = 0;
  int64_t prefix_query_tokens = 0, prefix_hit_tokens = 0;
  int64_t steps = 0, step_rows = 0;
  int64_t drafted = 0, accepted = 0;  // speculative decoding (EngineStats)
  double step_seconds = 0, draft_seconds = 0;  // in engine steps, and of them in the draft model
};

class Metrics {
 public:
  Metrics();
  void request(const std::string& endpoint, int status);  // one answered request
  void tokens(int64_t prompt, int64_t generated);
  void time_to_first_token(double seconds);
  void inter_token_latency(double seconds);
  void request_latency(double seconds);
  void cancelled();
  // The whole exposition, with the engine's gauges of now.
  std::string render(const EngineGauges& engine) const;

 private:
  mutable std::mutex mutex_;
  std::map<std::pair<std::string, int>, int64_t> requests_;
  int64_t prompt_tokens_ = 0, generated_tokens_ = 0, cancelled_ = 0;
  Histogram ttft_, itl_, latency_;
};

}  // namespace loom::serve
