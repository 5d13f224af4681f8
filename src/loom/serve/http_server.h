// `loom serve`'s HTTP front: OpenAI's routes on cpp-httplib (Debian's libcpp-httplib-dev), in
// front of the scheduler (serve/scheduler.h). Routes:
//   POST /v1/completions, POST /v1/chat/completions   (serve/openai.h; "stream": server-sent
//        events, one `data: {chunk}` per update, ending `data: [DONE]`)
//   GET  /v1/models, GET /health (503 while draining), GET /metrics (Prometheus text)
// Each request runs on one of the library's pool threads, which waits on its job. A streamed
// response writes each update as it comes, so a client that went away fails the write and the
// job is cancelled at once; a non-streamed one is sent as chunks too and writes a single space
// (JSON's leading whitespace) every 200 ms while it waits, for the same check. Errors are
// OpenAI's error objects; a full queue is 429 with Retry-After.
#pragma once
#include <memory>
#include <string>

#include "loom/serve/metrics.h"
#include "loom/serve/openai.h"
#include "loom/serve/scheduler.h"

namespace loom::serve {

struct HttpOptions {
  std::string host = "127.0.0.1";
  int port = 8080;     // 0: any free port (bound_port() says which)
  int threads = 0;     // the pool; 0: max_batch + max_queue + 8 (each waiting request holds one)
  size_t max_body_bytes = 8u << 20;
};

class HttpServer {
 public:
  HttpServer(Scheduler& scheduler, const ModelInfo& model, const Tokenizer& tokenizer, Metrics& metrics,
             HttpOptions options);
  ~HttpServer();
  // Binds; throws naming the host and port when it cannot. Returns the bound port.
  int bind();
  // Serves until stop(); call after bind().
  void serve();
  void stop();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace loom::serve
