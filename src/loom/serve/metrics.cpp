#include "loom/serve/metrics.h"

#include <algorithm>
#include <sstream>

namespace loom::serve {

void Histogram::observe(double value) {
  const size_t bucket = static_cast<size_t>(std::lower_bound(bounds_.begin(), bounds_.end(), value) - bounds_.begin());
  ++counts_[bucket];
  sum_ += value;
  ++count_;
}

std::string Histogram::render(const std::string& name) const {
  std::ostringstream out;
  int64_t cumulative = 0;
  for (size_t i = 0; i < bounds_.size(); ++i) {
    cumulative += counts_[i];
    out << name << "_bucket{le=\"" << bounds_[i] << "\"} " << cumulative << "\n";
  }
  cumulative += counts_.back();
  out << name << "_bucket{le=\"+Inf\"} " << cumulative << "\n";
  out << name << "_sum " << sum_ << "\n" << name << "_count " << count_ << "\n";
  return out.str();
}

double Histogram::quantile(double q) const {
  if (count_ == 0) return 0;
  const double target = q * static_cast<double>(count_);
  int64_t cumulative = 0;
  for (size_t i = 0; i < bounds_.size(); ++i) {
    cumulative += counts_[i];
    if (static_cast<double>(cumulative) >= target) return bounds_[i];
  }
  return bounds_.back();
}

namespace {
std::vector<double> latency_bounds() {
  return {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 1.5, 2, 3, 5, 10, 20, 30, 60};
}
}  // namespace

Metrics::Metrics() : ttft_(latency_bounds()), itl_(latency_bounds()), latency_(latency_bounds()) {}

void Metrics::request(const std::string& endpoint, int status) {
  std::lock_guard lock(mutex_);
  ++requests_[{endpoint, status}];
}

void Metrics::tokens(int64_t prompt, int64_t generated) {
  std::lock_guard lock(mutex_);
  prompt_tokens_ += prompt;
  generated_tokens_ += generated;
}

void Metrics::time_to_first_token(double seconds) {
  std::lock_guard lock(mutex_);
  ttft_.observe(seconds);
}

void Metrics::inter_token_latency(double seconds) {
  std::lock_guard lock(mutex_);
  itl_.observe(seconds);
}

void Metrics::request_latency(double seconds) {
  std::lock_guard lock(mutex_);
  latency_.observe(seconds);
}

void Metrics::cancelled() {
  std::lock_guard lock(mutex_);
  ++cancelled_;
}

std::string Metrics::render(const EngineGauges& e) const {
  std::lock_guard lock(mutex_);
  std::ostringstream out;
  const auto metric = [&](const char* name, const char* type, const char* help) {
    out << "# HELP " << name << " " << help << "\n# TYPE " << name << " " << type << "\n";
  };
  metric("loom_requests_total", "counter", "HTTP requests answered, by endpoint and status code.");
  for (const auto& [key, count] : requests_) {
    out << "loom_requests_total{endpoint=\"" << key.first << "\",status=\"" << key.second << "\"} " << count << "\n";
  }
  metric("loom_requests_cancelled_total", "counter", "Requests whose client went away before they finished.");
  out << "loom_requests_cancelled_total " << cancelled_ << "\n";
  metric("loom_prompt_tokens_total", "counter", "Prompt tokens of finished requests.");
  out << "loom_prompt_tokens_total " << prompt_tokens_ << "\n";
  metric("loom_generation_tokens_total", "counter", "Tokens generated.");
  out << "loom_generation_tokens_total " << generated_tokens_ << "\n";
  metric("loom_queue_length", "gauge", "Requests waiting for a batch row.");
  out << "loom_queue_length " << e.queued << "\n";
  metric("loom_running_requests", "gauge", "Requests (samples) in the running batch.");
  out << "loom_running_requests " << e.running << "\n";
  metric("loom_batch_occupancy", "gauge", "Running samples / batch rows (--max-batch).");
  out << "loom_batch_occupancy " << (e.max_batch > 0 ? static_cast<double>(e.running) / static_cast<double>(e.max_batch) : 0.0) << "\n";
  metric("loom_kv_blocks_used", "gauge", "KV cache blocks holding positions (running requests and the prefix cache).");
  out << "loom_kv_blocks_used " << e.kv_blocks_used << "\n";
  metric("loom_kv_blocks_free", "gauge", "KV cache blocks free.");
  out << "loom_kv_blocks_free " << e.kv_blocks_free << "\n";
  metric("loom_prefix_cache_blocks", "gauge", "KV blocks held by the prefix cache.");
  out << "loom_prefix_cache_blocks " << e.kv_blocks_cached << "\n";
  metric("loom_prefix_cache_query_tokens_total", "counter", "Prompt tokens looked up in the prefix cache (whole blocks).");
  out << "loom_prefix_cache_query_tokens_total " << e.prefix_query_tokens << "\n";
  metric("loom_prefix_cache_hit_tokens_total", "counter", "Prompt tokens served from the prefix cache.");
  out << "loom_prefix_cache_hit_tokens_total " << e.prefix_hit_tokens << "\n";
  metric("loom_prefix_cache_hit_rate", "gauge", "hit tokens / query tokens since the start.");
  out << "loom_prefix_cache_hit_rate "
      << (e.prefix_query_tokens > 0 ? static_cast<double>(e.prefix_hit_tokens) / static_cast<double>(e.prefix_query_tokens) : 0.0)
      << "\n";
  metric("loom_engine_steps_total", "counter", "Engine steps (one position of every running request).");
  out << "loom_engine_steps_total " << e.steps << "\n";
  metric("loom_engine_step_rows_total", "counter", "Rows run, summed over steps (mean batch = rows / steps).");
  out << "loom_engine_step_rows_total " << e.step_rows << "\n";
  metric("loom_spec_draft_tokens_total", "counter", "Speculative draft tokens verified (--speculate).");
  out << "loom_spec_draft_tokens_total " << e.drafted << "\n";
  metric("loom_spec_accepted_tokens_total", "counter", "Speculative draft tokens the model agreed with and kept.");
  out << "loom_spec_accepted_tokens_total " << e.accepted << "\n";
  metric("loom_spec_acceptance_rate", "gauge", "Accepted / draft tokens since the start (0 without drafts).");
  out << "loom_spec_acceptance_rate " << (e.drafted > 0 ? static_cast<double>(e.accepted) / static_cast<double>(e.drafted) : 0.0) << "\n";
  metric("loom_engine_seconds_total", "counter", "Seconds spent in engine steps.");
  out << "loom_engine_seconds_total " << e.step_seconds << "\n";
  metric("loom_spec_draft_seconds_total", "counter", "Seconds of the engine steps spent in the draft model (--draft).");
  out << "loom_spec_draft_seconds_total " << e.draft_seconds << "\n";
  metric("loom_time_to_first_token_seconds", "histogram", "Request received to its first token.");
  out << ttft_.render("loom_time_to_first_token_seconds");
  metric("loom_inter_token_latency_seconds", "histogram", "Time between consecutive tokens of a sample.");
  out << itl_.render("loom_inter_token_latency_seconds");
  metric("loom_request_latency_seconds", "histogram", "Request received to its last token.");
  out << latency_.render("loom_request_latency_seconds");
  return out.str();
}

}  // namespace loom::serve
