// The server's scheduler: one thread owns the generation engine (infer/engine.h) and steps it
// while any request is waiting or running; HTTP threads hand it Jobs and read their progress.
//
// A Job is one HTTP request: its prompts x n choices, each an engine request. The scheduler
// thread admits new jobs between steps (they join the running batch), and from the engine's
// callbacks appends each drawn token to its choice, decodes the choice's text, cuts it at the
// first stop string (then cancels the engine request: its row and blocks are free at the next
// step), keeps the log-probabilities asked for, and wakes the job's reader. Text is published
// only up to a whole UTF-8 character and, while a stop string could still begin in it, held back
// by the longest stop string's length less one byte, so a stream never shows part of a stop
// string or of a character.
//
// A job whose client went away is cancelled (Job::cancel); the scheduler ends its engine
// requests at once. The queue is bounded: submit refuses (ApiError 429) when max_queue jobs wait
// for rows, and (503) once draining began.
#pragma once
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <vector>

#include "loom/infer/engine.h"
#include "loom/serve/metrics.h"
#include "loom/serve/openai.h"

namespace loom::serve {

class Job {
 public:
  struct Choice {
    std::vector<int32_t> tokens;          // drawn (stop tokens included)
    std::string text;                      // published text (see the header comment)
    std::vector<TokenLogprob> logprobs;    // of the tokens in `text`'s span, as drawn
    std::string finish_reason;             // set once done
    bool done = false;
    int64_t first_id = -1;                 // the engine request
    std::chrono::steady_clock::time_point last_token;
  };

  Job(ParsedRequest request, std::chrono::steady_clock::time_point received)
      : request_(std::move(request)), received_(received) {}

  const ParsedRequest& request() const { return request_; }
  std::chrono::steady_clock::time_point received() const { return received_; }

  // The reader's side: waits until something changed since `seen` (a counter) or `timeout`
  // passed; returns the new counter.
  uint64_t wait(uint64_t seen, std::chrono::milliseconds timeout);
  // A consistent copy of the choices, and whether every one is done, and the error if any.
  struct Snapshot {
    std::vector<Choice> choices;
    bool done = false;
    std::string error;
    int error_status = 500;  // the HTTP status of `error`: 400 the request cannot run, 500 the server failed
    int64_t prompt_tokens = 0;
  };
  Snapshot snapshot() const;
  // The client went away: the scheduler ends the job's engine requests.
  void cancel() { cancelled_ = true; }
  bool cancelled() const { return cancelled_; }

 private:
  friend class Scheduler;
  void fail(const std::string& error, int status = 500);  // the job ends with `error`; its reader wakes
  ParsedRequest request_;
  std::chrono::steady_clock::time_point received_;
  mutable std::mutex mutex_;
  std::condition_variable changed_;
  uint64_t version_ = 0;
  std::vector<Choice> choices_;
  int64_t prompt_tokens_ = 0;
  std::string error_;
  int error_status_ = 500;
  std::atomic<bool> cancelled_{false};
  bool ended_ = false;  // the scheduler cancelled its engine requests (scheduler thread only)
};

struct SchedulerConfig {
  int64_t max_queue = 64;  // jobs waiting for rows before submit answers 429
};

class Scheduler {
 public:
  // The engine and tokenizer are used by the scheduler thread only (after start()).
  Scheduler(GenerationEngine& engine, const Tokenizer& tokenizer, const ModelInfo& model, Metrics& metrics,
            SchedulerConfig config);
  ~Scheduler();  // stops the thread

  void start();
  // Queues a job; throws ApiError 429 (queue full), 503 (draining) or 400 (the engine refuses the
  // request: more KV blocks than the pool, ...).
  void submit(const std::shared_ptr<Job>& job);
  // No more jobs are admitted (submit answers 503); waits until the running ones finished or the
  // deadline passed, then cancels what is left and stops the thread. Returns the jobs cancelled.
  int64_t drain(std::chrono::steady_clock::time_point deadline);
  bool draining() const { return draining_; }

  EngineGauges gauges() const;

 private:
  void loop();
  void admit(const std::shared_ptr<Job>& job);
  void on_logits(int64_t id, const float* logits, int64_t vocab);
  void on_token(int64_t id, int32_t token);
  void on_finish(int64_t id, GenerationResult&& result);
  // Decodes choice `c`'s tokens and publishes its text (and, when `final`, all of it).
  void publish(Job& job, Job::Choice& c, bool final);
  // `token` ends the job's choices (an end-of-text token, unless ignore_eos).
  bool is_stop(const Job& job, int32_t token) const;
  void update_gauges();

  GenerationEngine& engine_;
  const Tokenizer& tokenizer_;
  const ModelInfo& model_;
  Metrics& metrics_;
  SchedulerConfig config_;

  std::mutex mutex_;  // guards inbox_, stop_
  std::condition_variable wake_;
  std::deque<std::shared_ptr<Job>> inbox_;
  bool stop_ = false;
  std::atomic<bool> draining_{false};
  std::atomic<int64_t> queued_{0};  // inbox + jobs waiting in the engine

  // The scheduler thread's own state.
  struct Route {
    std::shared_ptr<Job> job;
    size_t choice = 0;
  };
  std::unordered_map<int64_t, Route> routes_;       // engine id -> choice
  std::vector<std::shared_ptr<Job>> jobs_;         // admitted, unfinished
  std::unordered_map<int64_t, TokenLogprob> pending_logprob_;  // id -> the logits' entry awaiting its token
  const float* pending_logits_ = nullptr;  // those logits (the engine's buffer, valid until its on_token)
  uint64_t next_seed_ = 0x5EED;
  // Tests inject an engine failure: with LOOM_SERVE_FAIL_AT_STEP=k in the environment the
  // engine's step k (from 0) throws as a failing engine would (tests/serve_test.py checks the
  // statuses clients then get); -1, the default, never.
  int64_t fail_at_step_ = -1, steps_ = 0;

  mutable std::mutex gauges_mutex_;
  EngineGauges gauges_;
  std::thread thread_;
};

}  // namespace loom::serve
