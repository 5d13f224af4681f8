#include "loom/serve/http_server.h"

#include <httplib.h>

#include <algorithm>
#include <cstring>

#include "loom/core/error.h"

namespace loom::serve {

namespace {

// httplib's view of one complete request (serve/connection_gate.h): reads come from the bytes
// the gate buffered, exactly one request's, then end (0); writes go to the socket under the
// gate's write timeout.
class ExchangeStream final : public httplib::Stream {
 public:
  explicit ExchangeStream(Exchange& exchange) : exchange_(exchange) {}
  bool is_readable() const override { return offset_ < exchange_.request().size(); }
  bool is_writable() const override { return exchange_.writable(); }
  ssize_t read(char* ptr, size_t size) override {
    const std::string& request = exchange_.request();
    const size_t n = std::min(size, request.size() - offset_);
    std::memcpy(ptr, request.data() + offset_, n);
    offset_ += n;
    return static_cast<ssize_t>(n);
  }
  ssize_t write(const char* ptr, size_t size) override {
    return exchange_.write(ptr, size) ? static_cast<ssize_t>(size) : -1;
  }
  void get_remote_ip_and_port(std::string& ip, int& port) const override {
    ip = exchange_.peer_ip(), port = exchange_.peer_port();
  }
  void get_local_ip_and_port(std::string& ip, int& port) const override {
    ip = exchange_.local_ip(), port = exchange_.local_port();
  }
  socket_t socket() const override { return exchange_.socket(); }

 private:
  Exchange& exchange_;
  size_t offset_ = 0;
};

// The exchange the calling worker answers (Router::answer), for a handler that watches its client.
thread_local const Exchange* current_exchange = nullptr;

// httplib's server without its listener and thread pool: the routes, the request parser and the
// response writer, run by a gate worker on one request (Server::process_request is protected).
class Router final : public httplib::Server {
 public:
  // `listening` stands for the server's socket, which httplib's content providers compare with
  // INVALID_SOCKET to tell whether the server is shutting down.
  void serving(socket_t listening) { svr_sock_ = listening; }
  bool answer(Exchange& exchange) {
    ExchangeStream stream(exchange);
    bool closed = false;
    current_exchange = &exchange;
    const bool written = process_request(stream, exchange.last(), closed, nullptr);
    current_exchange = nullptr;
    return written && !closed;
  }
};

}  // namespace

struct HttpServer::Impl {
  Scheduler& scheduler;
  const ModelInfo& model;
  const Tokenizer& tokenizer;
  Metrics& metrics;
  HttpOptions options;
  Router server;
  ConnectionGate gate;
  std::atomic<uint64_t> next_id{1};

  Impl(Scheduler& s, const ModelInfo& m, const Tokenizer& t, Metrics& mt, HttpOptions o)
      : scheduler(s), model(m), tokenizer(t), metrics(mt), options(o),
        gate(std::move(o), [this](Exchange& exchange) { return server.answer(exchange); }) {}

  void error(httplib::Response& res, const ApiError& e, const std::string& endpoint) {
    res.status = e.status();
    if (e.status() == 429) res.set_header("Retry-After", "1");
    res.set_content(e.text(), "application/json");
    metrics.request(endpoint, e.status());
  }

  void generate(const httplib::Request& req, httplib::Response& res, Endpoint endpoint);
  void install();
};

namespace {

// One server-sent event.
std::string event(const nlohmann::json& data) {
  return "data: " + data.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n\n";
}

}  // namespace

void HttpServer::Impl::generate(const httplib::Request& req, httplib::Response& res, Endpoint endpoint) {
  const auto received = std::chrono::steady_clock::now();
  const std::string name = endpoint == Endpoint::chat ? "/v1/chat/completions" : "/v1/completions";
  std::shared_ptr<Job> job;
  try {
    job = std::make_shared<Job>(parse_request(endpoint, req.body, tokenizer, model), received);
    scheduler.submit(job);
  } catch (const ApiError& e) {
    error(res, e, name);
    return;
  } catch (const Error& e) {  // a tokenizer or template failure on this input
    error(res, ApiError(400, e.what()), name);
    return;
  }
  const std::string id = (endpoint == Endpoint::chat ? "chatcmpl-" : "cmpl-") + std::to_string(next_id++);
  const ParsedRequest& request = job->request();
  if (request.stream) {
    const auto releaser = [job](bool success) {
      if (!success) job->cancel();
    };
    metrics.request(name, 200);  // the event stream's status is written first; a failure is an event
    res.set_header("Cache-Control", "no-cache");
    res.set_chunked_content_provider(
        "text/event-stream",
        [this, job, id, endpoint](size_t, httplib::DataSink& sink) {
          const ParsedRequest& r = job->request();
          std::vector<size_t> sent_text, sent_logprobs;
          std::vector<bool> finished;
          uint64_t seen = 0;
          const auto write = [&](const std::string& data) {
            if (!sink.write(data.data(), data.size())) {
              job->cancel();  // the client went away
              return false;
            }
            return true;
          };
          while (true) {
            seen = job->wait(seen, std::chrono::milliseconds(200));
            const Job::Snapshot s = job->snapshot();
            if (!s.error.empty()) {
              write(event(ApiError(500, s.error, "", "server_error").body()));
              write("data: [DONE]\n\n");
              sink.done();
              return true;
            }
            sent_text.resize(s.choices.size(), 0), sent_logprobs.resize(s.choices.size(), 0);
            finished.resize(s.choices.size(), false);
            for (size_t i = 0; i < s.choices.size(); ++i) {
              const Job::Choice& c = s.choices[i];
              const bool first = sent_text[i] == 0 && sent_logprobs[i] == 0;
              if (c.text.size() > sent_text[i]) {
                std::vector<TokenLogprob> lps(c.logprobs.begin() + static_cast<std::ptrdiff_t>(sent_logprobs[i]), c.logprobs.end());
                if (!write(event(stream_chunk(id, model, endpoint, static_cast<int64_t>(i), c.text.substr(sent_text[i]), "",
                                              first, r.logprobs >= 0 ? &lps : nullptr, tokenizer)))) {
                  return false;
                }
                sent_text[i] = c.text.size(), sent_logprobs[i] = c.logprobs.size();
              }
              if (c.done && !finished[i]) {
                finished[i] = true;
                if (!write(event(stream_chunk(id, model, endpoint, static_cast<int64_t>(i), "", c.finish_reason,
                                              first && sent_text[i] == 0, nullptr, tokenizer)))) {
                  return false;
                }
              }
            }
            if (s.done) {
              if (r.include_usage) {
                int64_t generated = 0;
                for (const Job::Choice& c : s.choices) generated += static_cast<int64_t>(c.tokens.size());
                if (!write(event(usage_chunk(id, model, endpoint, s.prompt_tokens, generated)))) return false;
              }
              if (!write("data: [DONE]\n\n")) return false;
              sink.done();
              return true;
            }
          }
        },
        releaser);
    return;
  }
  // Not streamed: nothing is written before the result, so its status is the result's (a failure
  // is a 4xx / 5xx, not a 200 with an error body); the client is watched without writing.
  const Exchange* exchange = current_exchange;
  uint64_t seen = 0;
  while (true) {
    seen = job->wait(seen, std::chrono::milliseconds(200));
    const Job::Snapshot s = job->snapshot();
    if (s.done) {
      if (!s.error.empty()) {
        error(res, ApiError(s.error_status, s.error), name);  // 400 invalid_request_error, 500 server_error
        return;
      }
      std::vector<ChoiceOutput> choices;
      int64_t generated = 0;
      for (const Job::Choice& c : s.choices) {
        choices.push_back({c.text, c.finish_reason, c.logprobs});
        generated += static_cast<int64_t>(c.tokens.size());
      }
      res.set_content(completion_response(id, model, endpoint, choices, s.prompt_tokens, generated,
                                          job->request().logprobs >= 0, tokenizer)
                          .dump(-1, ' ', false, nlohmann::json::error_handler_t::replace),
                      "application/json");
      metrics.request(name, 200);
      return;
    }
    if (exchange != nullptr && exchange->peer_closed()) {  // the client went away: no answer
      job->cancel();
      res.status = 499;  // nginx's "client closed request", for the log; nothing reaches the client
      return;
    }
  }
}

void HttpServer::Impl::install() {
  // The gate enforces the limits; httplib's settings here only shape what it writes (the
  // Keep-Alive header) and stay consistent with them.
  server.set_payload_max_length(options.max_body_bytes);
  server.set_keep_alive_max_count(static_cast<size_t>(options.keepalive_requests));
  server.set_keep_alive_timeout(static_cast<time_t>(options.keepalive_timeout));
  server.Post("/v1/completions", [this](const httplib::Request& req, httplib::Response& res) { generate(req, res, Endpoint::completions); });
  server.Post("/v1/chat/completions", [this](const httplib::Request& req, httplib::Response& res) { generate(req, res, Endpoint::chat); });
  server.Get("/v1/models", [this](const httplib::Request&, httplib::Response& res) {
    res.set_content(models_response(model).dump(), "application/json");
    metrics.request("/v1/models", 200);
  });
  server.Get("/health", [this](const httplib::Request&, httplib::Response& res) {
    const bool draining = scheduler.draining();
    res.status = draining ? 503 : 200;
    res.set_content(nlohmann::json{{"status", draining ? "draining" : "ok"}}.dump(), "application/json");
  });
  server.Get("/metrics", [this](const httplib::Request&, httplib::Response& res) {
    res.set_content(metrics.render(scheduler.gauges()), "text/plain; version=0.0.4");
  });
  server.set_error_handler([](const httplib::Request& req, httplib::Response& res) {
    if (!res.body.empty()) return;
    const std::string message = res.status == 404 ? str_cat("no route ", req.method, " ", req.path)
                                : res.status == 413 ? std::string("the request body is too large")
                                                    : str_cat("HTTP status ", res.status);
    res.set_content(ApiError(res.status, message).text(), "application/json");
  });
  server.set_exception_handler([](const httplib::Request&, httplib::Response& res, std::exception_ptr ep) {
    std::string message = "internal error";
    try {
      std::rethrow_exception(ep);
    } catch (const std::exception& e) {
      message = e.what();
    } catch (...) {
    }
    res.status = 500;
    res.set_content(ApiError(500, message).text(), "application/json");
  });
}

HttpServer::HttpServer(Scheduler& scheduler, const ModelInfo& model, const Tokenizer& tokenizer, Metrics& metrics,
                       HttpOptions options)
    : impl_(std::make_unique<Impl>(scheduler, model, tokenizer, metrics, std::move(options))) {
  impl_->install();
}

HttpServer::~HttpServer() = default;

int HttpServer::bind() {
  const int port = impl_->gate.bind();
  impl_->server.serving(impl_->gate.listening_socket());
  return port;
}

int64_t HttpServer::max_connections() const { return impl_->gate.max_connections(); }

void HttpServer::serve() { impl_->gate.run(); }

void HttpServer::drain() { impl_->gate.drain(); }

void HttpServer::stop(std::chrono::steady_clock::time_point deadline) { impl_->gate.stop(deadline); }

}  // namespace loom::serve
