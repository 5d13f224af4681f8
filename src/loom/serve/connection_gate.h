// `loom serve`'s connection front: one thread owns the listening socket and every connection
// that is between requests, and hands a worker only a request that has arrived whole.
//
// cpp-httplib (0.11.4) gives each connection a pool thread from accept on, and its read timeout
// restarts with every byte: 200 clients trickling a byte every 5 s held all 88 threads and kept a
// normal request waiting over a minute, and SIGTERM could not stop the server while they did.
// Here the readers cost no thread. The event loop (epoll) accepts non-blocking connections and
// reads each request's header block and body under limits taken from nginx:
//   - one total deadline for the header block and the body (nginx's client_header_timeout and
//     client_body_timeout, as a single budget that no trickle restarts): `request_timeout`
//     seconds from accept (or from the first byte of a kept-alive connection's next request);
//     past it the client gets 408 and the connection closes;
//   - connections open at once, in all and per client address (nginx's worker_connections and
//     limit_conn): one more is answered 503 and closed at once;
//   - keep-alive: `keepalive_timeout` idle seconds between requests, at most
//     `keepalive_requests` requests on a connection (nginx's keepalive_timeout and
//     keepalive_requests);
//   - a header block of at most `max_header_bytes` (431), a body of at most `max_body_bytes`
//     (413) and at most `max_buffered_body_bytes` of bodies held at once (503), its length given by one valid Content-Length (RFC 9110 section 8.6: 1*DIGIT; RFC
//     9112 section 6.3: an invalid one is answered 400 and the connection closed), no
//     Transfer-Encoding (411: send a Content-Length; RFC 9110 section 15.5.12).
// An error the gate answers itself is OpenAI's error object, after which it stops writing, reads
// and discards what the client still sends for up to 2 s and closes (nginx's lingering close, so
// that the client reads the answer instead of a reset).
//
// A complete request goes to one of `threads` workers with its connection (`Exchange`: the
// request's bytes, and writes to the socket that fail after `write_timeout` seconds without
// progress, nginx's send_timeout). When the handler returns, the connection goes back to the
// event loop for its next request, or is closed.
//
// Stopping: drain() makes every later response the connection's last and closes the idle
// kept-alive connections (new connections are still accepted, so that /health can say
// "draining"). stop(deadline) stops accepting and closes every connection being read, lets the
// workers finish their requests until the deadline, then shuts the remaining sockets down so that
// blocked writes fail and the workers return, whatever the clients do.
#pragma once
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace loom::serve {

struct GateOptions {
  std::string host = "127.0.0.1";
  int port = 8080;                          // 0..65535; 0: any free port
  int threads = 64;                         // workers that answer complete requests
  int64_t max_connections = 1024;           // open at once, in all (nginx: worker_connections)
  int64_t max_connections_per_client = 128; // open at once from one address (nginx: limit_conn)
  double request_timeout = 10;              // seconds for a request's header block and body, in all
  double keepalive_timeout = 5;             // idle seconds between two requests; 0: no keep-alive
  int64_t keepalive_requests = 1000;        // requests on one connection (nginx's default)
  double write_timeout = 30;                // seconds a response's write may make no progress
                                            // (nginx: send_timeout)
  size_t max_header_bytes = 64u << 10;      // request line and header fields
  size_t max_body_bytes = 8u << 20;         // Content-Length
  // Request bodies held at once, from their header block until their worker returns: the
  // readers cost no thread, so without it 1024 connections could make the server hold 8 GiB.
  size_t max_buffered_body_bytes = 256u << 20;
};

// Throws naming the flag (--port, --threads, --request-timeout, ...) and what it expects.
void check_gate_options(const GateOptions& options);

// One complete request and the connection it came on, held by a worker while it answers.
class Exchange {
 public:
  // Exactly one request: its request line, header fields and body (bytes the client pipelined
  // after it stay with the connection).
  const std::string& request() const { return request_; }
  const std::string& peer_ip() const { return peer_ip_; }
  int peer_port() const { return peer_port_; }
  const std::string& local_ip() const { return local_ip_; }
  int local_port() const { return local_port_; }
  int socket() const { return fd_; }
  // The connection closes after this response (the last of keepalive_requests, no keep-alive,
  // or the server is draining): the response should say `Connection: close`.
  bool last() const { return last_; }
  // Writes all `size` bytes; false when the client went away, `write_timeout` passed without
  // progress, or the server stopped.
  bool write(const char* data, size_t size);
  // Whether a write could make progress within `write_timeout`.
  bool writable() const;
  // Whether the client closed the connection (or reset it), seen without writing: a read of the
  // socket would return end of file or an error now. A client that shuts down only its sending
  // side after the request counts as gone too (TCP cannot tell the two apart without a write;
  // uvicorn's disconnect, which vLLM's servers watch, reads it the same way).
  bool peer_closed() const;

 private:
  friend class ConnectionGate;
  std::string request_, peer_ip_, local_ip_;
  int peer_port_ = 0, local_port_ = 0;
  int fd_ = -1;
  bool last_ = false;
  double write_timeout_ = 30;
  const std::atomic<bool>* stopped_ = nullptr;
};

class ConnectionGate {
 public:
  // Answers one request; returns whether the connection may carry another (the response was
  // written whole and neither side asked to close). Runs on a worker thread.
  using Handler = std::function<bool(Exchange&)>;

  ConnectionGate(GateOptions options, Handler handler);
  ~ConnectionGate();  // stop(now) if still running
  ConnectionGate(const ConnectionGate&) = delete;
  ConnectionGate& operator=(const ConnectionGate&) = delete;

  // Binds and listens; throws naming the host and port when it cannot. Returns the bound port.
  // Raises the open-file limit as far as max_connections needs (the hard limit at most).
  int bind();
  // The listening socket (after bind()).
  int listening_socket() const { return listen_fd_; }
  // max_connections, or less where the open-file limit could not be raised far enough.
  int64_t max_connections() const { return options_.max_connections; }
  // The event loop and the workers, on the calling thread until stop().
  void run();
  void drain();
  void stop(std::chrono::steady_clock::time_point deadline);

 private:
  struct Connection;
  enum class Parse { more, complete, failed };

  void loop();
  void work();
  void accept_all();
  void on_readable(Connection& c);
  Parse parse(Connection& c);
  void dispatch(int fd);
  void resume(std::unique_ptr<Connection> c);
  void answer_and_close(Connection& c, int status, const std::string& message);
  void close_connection(int fd);
  void expire(std::chrono::steady_clock::time_point now);
  void wake();

  GateOptions options_;
  Handler handler_;
  int listen_fd_ = -1;
  int epoll_fd_ = -1;
  int wake_fd_ = -1;  // eventfd: a worker returned a connection, or drain() / stop()

  // The event loop's own state.
  std::unordered_map<int, std::unique_ptr<Connection>> open_;  // connections the loop holds
  std::unordered_map<std::string, int64_t> per_client_;         // open connections by address
  int64_t connections_ = 0;                                     // open, the workers' included
  size_t buffered_body_bytes_ = 0;                              // the bodies announced, until answered
  std::chrono::steady_clock::time_point accept_paused_until_{};
  bool drain_seen_ = false;

  // Shared with the workers (mutex_).
  std::mutex mutex_;
  std::condition_variable work_ready_, work_done_;
  std::deque<std::unique_ptr<Connection>> ready_;     // complete requests for the workers
  std::vector<std::unique_ptr<Connection>> returned_; // answered, back to the loop
  std::unordered_set<int> working_;                   // sockets the workers hold
  bool loop_running_ = false, stopping_ = false, quit_ = false;
  std::vector<std::thread> workers_;

  std::atomic<bool> draining_{false};
  std::atomic<bool> stopped_{false};  // past stop()'s deadline: writes fail at once
};

}  // namespace loom::serve
