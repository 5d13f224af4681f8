// loom serve: an OpenAI-compatible HTTP server (src/loom/serve/) on the generation engine.
#include <malloc.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <filesystem>
#include <thread>
#include <tuple>
#include <utility>

#include "cli.h"
#include "commands.h"
#include "loom/core/error.h"
#include "loom/core/file_io.h"
#include "loom/core/signals.h"
#include "loom/data/chat_template.h"
#include "loom/data/sft.h"
#include "loom/infer/engine.h"
#include "loom/serve/http_server.h"

namespace loom::cli {

namespace {
int signal_pipe[2] = {-1, -1};  // written by the SIGTERM / SIGINT handler, read by serve_main

const char* kHelp =
    "usage: loom serve --checkpoint PATH [--host 127.0.0.1] [--port 8080] [--kv FORMAT] [--max-batch N]\n"
    "                  [--max-queue N] [--kv-blocks N] [--kv-block N] [--no-prefix-cache]\n"
    "                  [--chat-template FILE] [--model-name NAME] [--drain-timeout S] [--adapter DIR]\n"
    "                  [--threads N] [--request-timeout S] [--keepalive-timeout S] [--keepalive-requests N]\n"
    "                  [--max-connections N] [--max-connections-per-client N] [--write-timeout S]\n"
    "\n"
    "Serves OpenAI's API on the generation engine (continuous batching, paged KV cache with\n"
    "automatic prefix caching): POST /v1/completions, POST /v1/chat/completions (stream: server-sent\n"
    "events), GET /v1/models, GET /health, GET /metrics (Prometheus). Requests join the running batch\n"
    "between steps; at most N rows run (--max-batch, default 16) and N more wait (--max-queue,\n"
    "default 64; then 429 with Retry-After). SIGTERM or SIGINT stops admitting (503), lets running\n"
    "requests finish for up to --drain-timeout seconds (default 30), then closes the connections\n"
    "left, whatever their clients do, and exits 0; a second signal exits at once. --port 0 takes a\n"
    "free port. Prints `listening on http://HOST:PORT` when ready.\n"
    "Each request must arrive whole (header and body) within --request-timeout seconds (default 10;\n"
    "then 408); at most --max-connections connections are open (default 1024), at most\n"
    "--max-connections-per-client from one address (default 128; then 503 and close).\n"
    "docs/serving.md has the API, the flags and measured figures.\n";

// The connection front's flags (serve/connection_gate.h), refused by name before any loading.
serve::HttpOptions http_options(const Args& args, int64_t default_threads) {
  const int64_t port = args.get_int("port", 8080);
  LOOM_CHECK(port >= 0 && port <= 65535, "--port must be a port number 0..65535 (0: any free port), got ", port);
  const int64_t threads = args.get_int("threads", default_threads);
  LOOM_CHECK(threads >= 1 && threads <= 100000, "--threads must be 1..100000, got ", threads);
  serve::HttpOptions ho;
  ho.host = args.get("host", "127.0.0.1");
  ho.port = static_cast<int>(port);
  ho.threads = static_cast<int>(threads);
  ho.request_timeout = args.get_double("request-timeout", ho.request_timeout);
  ho.keepalive_timeout = args.get_double("keepalive-timeout", ho.keepalive_timeout);
  ho.keepalive_requests = args.get_int("keepalive-requests", ho.keepalive_requests);
  ho.max_connections = args.get_int("max-connections", ho.max_connections);
  ho.max_connections_per_client = args.get_int("max-connections-per-client", ho.max_connections_per_client);
  ho.write_timeout = args.get_double("write-timeout", ho.write_timeout);
  serve::check_gate_options(ho);
  return ho;
}

// The chat template (--chat-template, else the tokenizer folder's, else none: chat answers 400)
// and its file, which the template's errors name.
std::pair<std::string, std::string> chat_template_of(const Args& args, const LoomConfig& config) {
  if (args.has("chat-template")) return {read_text_file(args.get("chat-template")), args.get("chat-template")};
  const auto file = std::filesystem::path(config.data.tokenizer) / "tokenizer_config.json";
  if (!std::filesystem::is_regular_file(file)) return {};
  try {
    return {load_chat_template(file.string()), file.string()};
  } catch (const Error&) {
    return {};  // a tokenizer folder without a template
  }
}

// Waits for SIGTERM / SIGINT, then drains: no new requests, the running ones get `drain_timeout`
// seconds, then every socket is shut down whatever the clients do; a second signal exits at once.
// Returns the requests cancelled at the deadline.
int64_t drain_on_signal(serve::HttpServer& http, serve::Scheduler& scheduler, double drain_timeout) {
  const auto next_signal = [] {
    unsigned char byte = 0;
    while (::read(signal_pipe[0], &byte, 1) != 1) {
    }
    return static_cast<int>(byte);
  };
  const int signal_number = next_signal();
  std::printf("loom serve: %s: draining (no new requests; %g s for the running ones)\n",
              signal_number == SIGTERM ? "SIGTERM" : "SIGINT", drain_timeout);
  std::fflush(stdout);
  // A second signal while draining exits at once.
  std::thread second([next_signal] {
    next_signal();
    std::fprintf(stderr, "loom serve: second signal: exiting now\n");
    std::_Exit(1);
  });
  second.detach();
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                                              std::chrono::duration<double>(drain_timeout));
  http.drain();  // no more keep-alive; new requests are still read and answered (503)
  const int64_t cancelled = scheduler.drain(deadline);
  // The workers write the last responses of the finished (or, at the deadline, cancelled) jobs;
  // at the deadline (a moment later if it has passed, for the cancelled jobs' last words) the
  // remaining sockets are shut down, whatever the clients do.
  http.stop(std::max(deadline, std::chrono::steady_clock::now() + std::chrono::milliseconds(300)));
  return cancelled;
}

}  // namespace

int serve_main(int argc, char** argv) {
  ::signal(SIGPIPE, SIG_IGN);  // a client that went away is a failed write, not a signal
  // Each prefill allocates its prompt's activation store, of a size that varies by request. glibc
  // raises its mmap threshold to the largest block freed, so those stores soon come from the
  // heap, whose fragmentation grew the RSS by ~1 KB a request in a soak (bench/serve_bench.py);
  // a fixed threshold keeps blocks of 128 KiB and more in mmap, returned whole when freed (flat).
  ::mallopt(M_MMAP_THRESHOLD, 128 * 1024);
  // SIGTERM / SIGINT: the handler writes the signal's number into a pipe that the main thread
  // reads (it runs on the signal thread of core/signals.h and may only make async-signal-safe
  // calls). The pipe's write end is the one piece of process-wide state here.
  LOOM_CHECK(::pipe(signal_pipe) == 0, "loom serve: cannot create the signal pipe");
  struct sigaction action = {};
  action.sa_handler = [](int signo) {
    const unsigned char byte = static_cast<unsigned char>(signo);
    [[maybe_unused]] const ssize_t n = ::write(signal_pipe[1], &byte, 1);
  };
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART;
  ::sigaction(SIGTERM, &action, nullptr);
  ::sigaction(SIGINT, &action, nullptr);
  start_signal_thread();  // (main leaves it to here: a signal sent while starting finds the handler)
  const Args args(argc, argv, "serve", kHelp,
                  {{"checkpoint", "PATH", "a step folder, a run folder, a checkpoints folder or a Hugging Face folder (required)"},
                   kDeviceOption,
                   kF32WeightsOption,
                   {"adapter", "DIR", "a PEFT LoRA adapter folder applied to the weights"},
                   {"host", "ADDR", "address to listen on (default 127.0.0.1)"},
                   {"port", "N", "port (default 8080; 0: any free port)"},
                   {"kv", "FORMAT", "KV cache format fp32 | bf16 | int8 | int4 | kivi4 | kivi2 (default fp32)"},
                   {"kv-block", "N", "positions per KV block (default 16)"},
                   {"kv-blocks", "N", "blocks in the KV pool (default: max-batch full-length sequences, within --kv-memory)"},
                   {"kv-memory", "BYTES", "the KV pool's budget, e.g. 8GiB (default: 90% of the available memory after loading; --kv-blocks overrides)"},
                   {"max-batch", "N", "rows of continuous batching (default 16); also the largest n"},
                   {"max-queue", "N", "requests waiting for a row before 429 (default 64)"},
                   kDraftOption,
                   kStepGraphsOption,
                   kDraftPMinOption,
                   {"speculate", "K", "requests propose up to K tokens by prompt lookup, verified in one forward: the same greedy tokens, sampled ones distributed the same (default 0: off; needs --kv fp32)"},
                   {"prefill-chunk", "N", "prompts longer than N tokens are fed N a step beside the decoding rows (default 512; 0: each prompt in one forward)"},
                   {"no-prefix-cache", "", "turn automatic prefix caching off"},
                   {"chat-template", "FILE", "a Jinja chat template (default: the tokenizer folder's)"},
                   {"model-name", "NAME", "the model id in /v1/models and responses (default: the checkpoint folder's name)"},
                   {"drain-timeout", "S", "seconds running requests get to finish after SIGTERM (default 30)"},
                   {"threads", "N", "HTTP worker threads (default: max-batch + max-queue + 8)"},
                   {"request-timeout", "S", "seconds for a request's header and body to arrive, in all (default 10; then 408)"},
                   {"keepalive-timeout", "S", "idle seconds a connection is kept between requests (default 5; 0: no keep-alive)"},
                   {"keepalive-requests", "N", "requests on one connection before it closes (default 1000)"},
                   {"max-connections", "N", "connections open at once (default 1024; then 503 and close)"},
                   {"max-connections-per-client", "N", "connections open at once from one address (default 128; then 503)"},
                   {"write-timeout", "S", "seconds a response's write may make no progress before the connection closes (default 30)"}});
  LOOM_CHECK(args.has("checkpoint"), "loom serve needs --checkpoint PATH");
  // The flags that need no model are checked first, so a typo costs no loading time.
  const int64_t max_batch = args.get_int("max-batch", 16);
  LOOM_CHECK(max_batch >= 1, "--max-batch must be >= 1, got ", max_batch);
  serve::SchedulerConfig sc;
  sc.max_queue = args.get_int("max-queue", 64);
  LOOM_CHECK(sc.max_queue >= 0, "--max-queue must be >= 0, got ", sc.max_queue);
  const double drain_timeout = args.get_double("drain-timeout", 30.0);
  LOOM_CHECK(std::isfinite(drain_timeout) && drain_timeout >= 0 && drain_timeout <= 86400,
             "--drain-timeout must be seconds in [0, 86400], got ", drain_timeout);
  const serve::HttpOptions ho = http_options(args, max_batch + sc.max_queue + 8);
  const ModelSource source = model_source(args.get("checkpoint"), args.get("adapter", ""));
  const LoomConfig& config = source.config;
  const auto tokenizer = model_tokenizer(config);

  serve::ModelInfo info;
  const std::filesystem::path checkpoint = std::filesystem::weakly_canonical(args.get("checkpoint"));
  info.id = args.get("model-name", checkpoint.filename().string());
  info.context = config.model.max_seq_len;
  info.created = static_cast<int64_t>(std::time(nullptr));
  info.stop_tokens = {tokenizer->eot_token()};
  if (tokenizer->eos_token() && *tokenizer->eos_token() != tokenizer->eot_token()) info.stop_tokens.push_back(*tokenizer->eos_token());
  info.chat_options = chat_template_options(*tokenizer);
  std::tie(info.chat_template, info.chat_options.source) = chat_template_of(args, config);

  EngineConfig ec = serving_engine_config(args, config.model.head_dim());
  info.max_n = ec.max_batch;

  auto backend = inference_backend(source, args.get("device", ""));
  const std::unique_ptr<Transformer> owned = open_inference_model(source, *backend, args.has("f32-weights"));
  Transformer& model = *owned;
  std::string prefix_note = "off (--no-prefix-cache)";
  if (!args.has("no-prefix-cache")) {
    const std::string why = prefix_cache_unsupported(model, ec);
    ec.prefix_cache = why.empty();
    prefix_note = why.empty() ? "on" : "off: " + why;
  }
  const std::unique_ptr<Transformer> draft = open_draft(args, *backend, ec);
  GenerationEngine engine(model, ec, draft.get());


  serve::Metrics metrics;
  serve::Scheduler scheduler(engine, *tokenizer, info, metrics, sc);
  serve::HttpServer http(scheduler, info, *tokenizer, metrics, ho);
  const int bound_port = http.bind();
  scheduler.start();
  std::thread server([&] { http.serve(); });
  std::printf("loom serve: model %s (%lld parameters, context %lld), KV cache %s paged in %lld blocks of %lld (%s), "
              "step workspace %s, max batch %lld, max queue %lld, prefix cache %s, chat template %s, connections %lld "
              "(%lld per client)\n",
              info.id.c_str(), static_cast<long long>(param_count(config.model)), static_cast<long long>(info.context),
              args.get("kv", "fp32").c_str(), static_cast<long long>(engine.cache().config().num_blocks),
              static_cast<long long>(ec.block_size), format_bytes(static_cast<size_t>(engine.cache().bytes_reserved())).c_str(),
              workspace_note(engine).c_str(), static_cast<long long>(ec.max_batch),
              static_cast<long long>(sc.max_queue), prefix_note.c_str(), info.chat_template.empty() ? "none" : "yes",
              static_cast<long long>(http.max_connections()), static_cast<long long>(ho.max_connections_per_client));
  std::printf("listening on http://%s:%d\n", ho.host.c_str(), bound_port);
  std::fflush(stdout);

  const int64_t cancelled = drain_on_signal(http, scheduler, drain_timeout);
  server.join();
  std::printf("loom serve: stopped (%lld requests cancelled at the deadline)\n", static_cast<long long>(cancelled));
  return 0;
}

}  // namespace loom::cli
