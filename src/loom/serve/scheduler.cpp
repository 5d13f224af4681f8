#include "loom/serve/scheduler.h"

#include <cstdlib>

#include <algorithm>
#include <cmath>
#include <limits>

#include "loom/core/env.h"
#include "loom/core/error.h"
#include "loom/core/utf8.h"

namespace loom::serve {

uint64_t Job::wait(uint64_t seen, std::chrono::milliseconds timeout) {
  std::unique_lock lock(mutex_);
  changed_.wait_for(lock, timeout, [&] { return version_ != seen; });
  return version_;
}

void Job::fail(const std::string& error, int status) {
  std::lock_guard lock(mutex_);
  error_ = error;
  error_status_ = status;
  ++version_;
  changed_.notify_all();
}

Job::Snapshot Job::snapshot() const {
  std::lock_guard lock(mutex_);
  Snapshot s;
  s.choices = choices_;
  s.error = error_;
  s.error_status = error_status_;
  s.prompt_tokens = prompt_tokens_;
  s.done = !error_.empty() || (!choices_.empty() && std::all_of(choices_.begin(), choices_.end(), [](const Job::Choice& c) { return c.done; }));
  return s;
}

namespace {

// The engine requests of a job (one per prompt, each with its n samples); seeds set by the caller.
std::vector<GenerationRequest> engine_requests(const ParsedRequest& p, const ModelInfo& model) {
  std::vector<GenerationRequest> out;
  for (const std::vector<int32_t>& prompt : p.prompts) {
    GenerationRequest r;
    r.prompt = prompt;
    r.sampling = p.sampling;
    r.logits = p.logprobs >= 0;  // on_logits computes logprobs only
    r.max_new_tokens = p.max_tokens;
    if (!p.ignore_eos) r.stop_tokens = model.stop_tokens;
    r.n = p.n;
    out.push_back(std::move(r));
  }
  return out;
}

uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

}  // namespace

Scheduler::Scheduler(GenerationEngine& engine, const Tokenizer& tokenizer, const ModelInfo& model, Metrics& metrics,
                     SchedulerConfig config)
    : engine_(engine), tokenizer_(tokenizer), model_(model), metrics_(metrics), config_(config) {
  fail_at_step_ = env_integer("LOOM_SERVE_FAIL_AT_STEP", -1, 0, std::numeric_limits<int64_t>::max());
  engine_.set_on_logits([this](int64_t id, const float* logits, int64_t vocab) { on_logits(id, logits, vocab); });
  engine_.set_on_token([this](int64_t id, int32_t token) { on_token(id, token); });
  engine_.set_on_finish([this](int64_t id, GenerationResult&& r) { on_finish(id, std::move(r)); });
  update_gauges();
}

Scheduler::~Scheduler() {
  {
    std::lock_guard lock(mutex_);
    stop_ = true;
  }
  wake_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void Scheduler::start() { thread_ = std::thread([this] { loop(); }); }

void Scheduler::submit(const std::shared_ptr<Job>& job) {
  for (const GenerationRequest& r : engine_requests(job->request(), model_)) {
    try {
      engine_.check(r);  // reads the engine's configuration only
    } catch (const Error& e) {
      throw ApiError(400, e.what());
    }
  }
  {
    std::lock_guard lock(mutex_);
    if (draining_) throw ApiError(503, "the server is shutting down and admits no new requests");
    if (queued_ >= config_.max_queue) {
      throw ApiError(429, str_cat("the queue is full (", config_.max_queue, " requests waiting, --max-queue); retry later"));
    }
    inbox_.push_back(job);
    ++queued_;
  }
  wake_.notify_all();
}

int64_t Scheduler::drain(std::chrono::steady_clock::time_point deadline) {
  draining_ = true;
  int64_t cancelled = 0;
  while (true) {
    const EngineGauges g = gauges();
    if (g.queued == 0 && g.running == 0) break;
    if (std::chrono::steady_clock::now() >= deadline) {
      cancelled = g.queued + g.running;
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  {
    std::lock_guard lock(mutex_);
    stop_ = true;
  }
  wake_.notify_all();
  if (thread_.joinable()) thread_.join();
  return cancelled;
}

void Scheduler::admit(const std::shared_ptr<Job>& job) {
  const ParsedRequest& p = job->request();
  std::vector<GenerationRequest> requests = engine_requests(p, model_);
  {
    std::lock_guard lock(job->mutex_);
    job->choices_.assign(requests.size() * static_cast<size_t>(p.n), Job::Choice{});
  }
  for (size_t i = 0; i < requests.size(); ++i) {
    GenerationRequest& r = requests[i];
    if (!p.seeded) r.sampling.seed = splitmix64(next_seed_++);
    int64_t first = 0;
    try {
      first = engine_.submit(std::move(r));
    } catch (const Error& e) {  // the engine cannot admit it (more KV blocks than its pool, ...)
      job->fail(e.what(), 400);
      return;
    }
    for (int64_t k = 0; k < p.n; ++k) {
      const size_t choice = i * static_cast<size_t>(p.n) + static_cast<size_t>(k);
      routes_[first + k] = Route{job, choice};
      job->choices_[choice].first_id = first + k;  // the scheduler thread alone writes it
    }
  }
  jobs_.push_back(job);
}

void Scheduler::on_logits(int64_t id, const float* logits, int64_t vocab) {
  const auto route = routes_.find(id);
  if (route == routes_.end() || route->second.job->request().logprobs < 0) return;
  // log-softmax of the raw logits: log p_t = z_t - (max + log sum exp(z - max)).
  double max = logits[0];
  for (int64_t v = 1; v < vocab; ++v) max = std::max(max, static_cast<double>(logits[v]));
  double sum = 0;
  for (int64_t v = 0; v < vocab; ++v) sum += std::exp(static_cast<double>(logits[v]) - max);
  const double lse = max + std::log(sum);
  TokenLogprob entry;
  const auto k = static_cast<size_t>(std::min<int64_t>(route->second.job->request().logprobs, vocab));
  std::vector<int32_t> order(static_cast<size_t>(vocab));
  for (int64_t v = 0; v < vocab; ++v) order[static_cast<size_t>(v)] = static_cast<int32_t>(v);
  std::partial_sort(order.begin(), order.begin() + static_cast<std::ptrdiff_t>(k), order.end(),
                    [&](int32_t a, int32_t b) { return logits[a] > logits[b] || (logits[a] == logits[b] && a < b); });
  for (size_t i = 0; i < k; ++i) entry.top.emplace_back(order[i], static_cast<double>(logits[order[i]]) - lse);
  // The drawn token's value: the engine calls on_token for this id next, from the same logits.
  entry.logprob = lse;  // replaced by z_token - lse in on_token
  pending_logits_ = logits;
  pending_logprob_[id] = std::move(entry);
}

void Scheduler::on_token(int64_t id, int32_t token) {
  const auto route = routes_.find(id);
  if (route == routes_.end()) return;
  Job& job = *route->second.job;
  const auto now = std::chrono::steady_clock::now();
  std::lock_guard lock(job.mutex_);
  Job::Choice& c = job.choices_[route->second.choice];
  if (c.done) return;  // ended by a stop string; the engine retires it at the next step
  if (c.tokens.empty()) metrics_.time_to_first_token(std::chrono::duration<double>(now - job.received_).count());
  else metrics_.inter_token_latency(std::chrono::duration<double>(now - c.last_token).count());
  c.last_token = now;
  c.tokens.push_back(token);
  const bool stop_token = is_stop(job, token);
  if (const auto p = pending_logprob_.find(id); p != pending_logprob_.end()) {
    if (!stop_token) {
      p->second.token = token;
      p->second.logprob = static_cast<double>(pending_logits_[token]) - p->second.logprob;
      c.logprobs.push_back(std::move(p->second));
    }
    pending_logprob_.erase(p);
  }
  publish(job, c, false);
  ++job.version_;
  job.changed_.notify_all();
}

bool Scheduler::is_stop(const Job& job, int32_t token) const {
  return !job.request_.ignore_eos &&
         std::find(model_.stop_tokens.begin(), model_.stop_tokens.end(), token) != model_.stop_tokens.end();
}

void Scheduler::publish(Job& job, Job::Choice& c, bool final) {
  std::vector<int32_t> shown = c.tokens;
  if (!shown.empty() && is_stop(job, shown.back())) shown.pop_back();
  std::string full = tokenizer_.decode(shown);
  size_t cut = std::string::npos, hold = 0;
  for (const std::string& s : job.request_.stop) {
    cut = std::min(cut, full.find(s));
    hold = std::max(hold, s.size() - 1);
  }
  if (cut != std::string::npos) {  // a stop string: the text ends before it, the engine request ends
    full.resize(cut);
    c.finish_reason = "stop";
    c.done = true;
    engine_.cancel(c.first_id);
    final = true;
  }
  size_t length = full.size();
  if (!final) length = complete_utf8_prefix(std::string_view(full).substr(0, full.size() > hold ? full.size() - hold : 0));
  c.text = valid_utf8(std::string_view(full).substr(0, length));
}

void Scheduler::on_finish(int64_t id, GenerationResult&& result) {
  const auto route = routes_.find(id);
  if (route == routes_.end()) return;
  const std::shared_ptr<Job> job = route->second.job;
  const size_t index = route->second.choice;
  routes_.erase(route);
  pending_logprob_.erase(id);
  metrics_.tokens(index % static_cast<size_t>(job->request_.n) == 0 ? result.prompt_tokens : 0,
                  static_cast<int64_t>(result.tokens.size()));
  std::lock_guard lock(job->mutex_);
  if (index % static_cast<size_t>(job->request_.n) == 0) job->prompt_tokens_ += result.prompt_tokens;
  Job::Choice& c = job->choices_[index];
  if (!c.done) {
    c.done = true;
    c.finish_reason = result.finish == "stop" ? "stop" : result.finish == "cancelled" ? "cancelled" : "length";
    publish(*job, c, true);
  }
  ++job->version_;
  job->changed_.notify_all();
}

void Scheduler::update_gauges() {
  EngineGauges g;
  {
    std::lock_guard lock(mutex_);
    g.queued = static_cast<int64_t>(inbox_.size()) + engine_.waiting();
    queued_ = g.queued;
  }
  g.running = engine_.active();
  g.max_batch = model_.max_n;
  const KvCache& cache = engine_.cache();
  g.kv_blocks_used = cache.blocks_in_use();
  g.kv_blocks_free = cache.free_blocks();
  if (const PrefixCache* prefix = engine_.prefix_cache()) {
    g.kv_blocks_cached = prefix->entries();
    g.prefix_query_tokens = prefix->stats().query_tokens;
    g.prefix_hit_tokens = prefix->stats().hit_tokens;
  }
  g.steps = engine_.stats().steps;
  g.step_rows = engine_.stats().rows;
  g.drafted = engine_.stats().drafted, g.accepted = engine_.stats().accepted;
  g.step_seconds = engine_.stats().seconds, g.draft_seconds = engine_.stats().draft_seconds;
  std::lock_guard lock(gauges_mutex_);
  gauges_ = g;
}

EngineGauges Scheduler::gauges() const {
  std::lock_guard lock(gauges_mutex_);
  return gauges_;
}

void Scheduler::loop() {
  while (true) {
    std::deque<std::shared_ptr<Job>> fresh;
    bool stopping = false;
    {
      std::unique_lock lock(mutex_);
      wake_.wait_for(lock, std::chrono::milliseconds(100), [&] { return stop_ || !inbox_.empty() || !jobs_.empty(); });
      stopping = stop_;
      fresh.swap(inbox_);
    }
    for (const auto& job : fresh) {
      if (stopping) {
        job->fail("the server is shutting down");
        continue;
      }
      admit(job);
    }
    // Jobs whose client went away (or all, when stopping) end now: rows and blocks free at the next step.
    for (const auto& job : jobs_) {
      if (!(job->cancelled() || stopping) || job->ended_) continue;
      job->ended_ = true;
      if (job->cancelled()) metrics_.cancelled();
      for (const Job::Choice& c : job->choices_) engine_.cancel(c.first_id);
    }
    if (!jobs_.empty()) {
      try {
        if (steps_++ == fail_at_step_) throw Error("an injected engine failure (LOOM_SERVE_FAIL_AT_STEP)");
        engine_.step();
      } catch (const Error& e) {  // the engine failed: every running job gets the error
        for (const auto& job : jobs_) {
          job->fail(e.what());
          for (const Job::Choice& c : job->choices_) engine_.cancel(c.first_id);
        }
      }
    }
    // Finished jobs leave (their routes went with the engine's finish callbacks).
    std::erase_if(jobs_, [&](const std::shared_ptr<Job>& job) {
      std::lock_guard lock(job->mutex_);
      const bool over = !job->error_.empty() ||
                        std::all_of(job->choices_.begin(), job->choices_.end(), [](const Job::Choice& c) { return c.done; });
      const bool engine_done = std::none_of(job->choices_.begin(), job->choices_.end(), [&](const Job::Choice& c) {
        return routes_.contains(c.first_id);
      });
      if (over && engine_done) {
        metrics_.request_latency(std::chrono::duration<double>(std::chrono::steady_clock::now() - job->received_).count());
        return true;
      }
      return false;
    });
    update_gauges();
    if (stopping && jobs_.empty()) break;
  }
}

}  // namespace loom::serve
