// `loom serve`'s HTTP front: OpenAI's routes on cpp-httplib (Debian's libcpp-httplib-dev), in
// front of the scheduler (serve/scheduler.h). Routes:
//   POST /v1/completions, POST /v1/chat/completions   (serve/openai.h; "stream": server-sent
//        events, one `data: {chunk}` per update, ending `data: [DONE]`)
//   GET  /v1/models, GET /health (503 while draining), GET /metrics (Prometheus text)
// Connections are Loom's own (serve/connection_gate.h): one event loop reads every request under
// a total deadline and per-client / total connection caps, and only a complete request reaches a
// worker thread, where httplib's request processing (its parser, routing and response writer)
// runs on the buffered bytes through an httplib::Stream of our own. Each request runs on one
// worker, which waits on its job. A streamed response writes each update as it comes, so a
// client that went away fails the write and the job is cancelled at once; a non-streamed one is
// sent as chunks too and writes a single space (JSON's leading whitespace) every 200 ms while it
// waits, for the same check. Errors are OpenAI's error objects; a full queue is 429 with
// Retry-After.
#pragma once
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include "loom/serve/connection_gate.h"
#include "loom/serve/metrics.h"
#include "loom/serve/openai.h"
#include "loom/serve/scheduler.h"

namespace loom::serve {

// Host and port (0: any free port; bind() says which), the workers (each waiting request holds
// one), the connection limits and timeouts: connection_gate.h.
using HttpOptions = GateOptions;

class HttpServer {
 public:
  HttpServer(Scheduler& scheduler, const ModelInfo& model, const Tokenizer& tokenizer, Metrics& metrics,
             HttpOptions options);
  ~HttpServer();
  // Binds; throws naming the host and port when it cannot. Returns the bound port.
  int bind();
  // The connection cap in effect (lower than asked where the open-file limit is).
  int64_t max_connections() const;
  // Serves until stop(); call after bind().
  void serve();
  // Every later response closes its connection, and idle kept-alive connections close; requests
  // are still read and answered (the scheduler answers 503 to new generations).
  void drain();
  // Stops accepting and reading; the requests already whole get until `deadline` to be answered,
  // then their sockets are shut down. Returns once every worker has returned.
  void stop(std::chrono::steady_clock::time_point deadline);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace loom::serve
