#include "loom/serve/connection_gate.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cerrno>
#include <cstring>
#include <string_view>
#include <tuple>

#include "loom/core/error.h"
#include "loom/serve/openai.h"

namespace loom::serve {

using Clock = std::chrono::steady_clock;

namespace {

// After an error it answers itself, the gate reads and discards for this long before closing
// (nginx's lingering_timeout is 5 s; the answer is one small write).
constexpr std::chrono::seconds kLingerTime{2};
// Accepting failed for want of file descriptors or memory: try again after this long.
constexpr std::chrono::milliseconds kAcceptPause{100};
// File descriptors kept beside the connections (the model's files, pipes, the epoll set).
constexpr int64_t kSpareDescriptors = 128;

Clock::duration seconds(double s) { return std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(s)); }

const char* reason(int status) {
  switch (status) {
    case 400: return "Bad Request";
    case 408: return "Request Timeout";
    case 411: return "Length Required";
    case 413: return "Content Too Large";  // RFC 9110's name (was Payload Too Large)
    case 431: return "Request Header Fields Too Large";
    case 503: return "Service Unavailable";
    default: return "Error";
  }
}

// A whole response with OpenAI's error object, after which the connection closes.
std::string error_response(int status, const std::string& message) {
  const std::string body = ApiError(status, message, "", status < 500 ? "invalid_request_error" : "").text();
  return str_cat("HTTP/1.1 ", status, " ", reason(status), "\r\nContent-Type: application/json\r\nContent-Length: ",
                 body.size(), status == 503 ? "\r\nRetry-After: 1" : "", "\r\nConnection: close\r\n\r\n", body);
}

// One non-blocking send of a small answer into an empty socket buffer; what does not fit is lost
// (the client is misbehaving, or gone).
void send_now(int fd, const std::string& data) {
  [[maybe_unused]] const ssize_t n = ::send(fd, data.data(), data.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
}

std::pair<std::string, int> address_of(const sockaddr_storage& a) {
  char text[INET6_ADDRSTRLEN] = {};
  if (a.ss_family == AF_INET) {
    const auto& v4 = reinterpret_cast<const sockaddr_in&>(a);
    ::inet_ntop(AF_INET, &v4.sin_addr, text, sizeof text);
    return {text, ntohs(v4.sin_port)};
  }
  if (a.ss_family == AF_INET6) {
    const auto& v6 = reinterpret_cast<const sockaddr_in6&>(a);
    ::inet_ntop(AF_INET6, &v6.sin6_addr, text, sizeof text);
    return {text, ntohs(v6.sin6_port)};
  }
  return {"", 0};
}

bool iequals(std::string_view a, std::string_view b) {
  return a.size() == b.size() &&
         std::equal(a.begin(), a.end(), b.begin(), [](char x, char y) { return std::tolower(static_cast<unsigned char>(x)) == std::tolower(static_cast<unsigned char>(y)); });
}

std::string_view trim(std::string_view s) {  // OWS: spaces and horizontal tabs (RFC 9110 section 5.6.3)
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
  return s;
}

int poll_ms(Clock::duration d) {
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(d).count() + 1;
  return static_cast<int>(std::clamp<int64_t>(ms, 0, 1000));
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Exchange: a worker's writes, with nginx's send_timeout (the time between two writes that make
// progress, not the whole response: a stream may last minutes).

bool Exchange::write(const char* data, size_t size) {
  auto last_progress = Clock::now();
  while (size > 0) {
    if (stopped_ && stopped_->load()) return false;
    const ssize_t n = ::send(fd_, data, size, MSG_NOSIGNAL);
    if (n > 0) {
      data += n, size -= static_cast<size_t>(n);
      last_progress = Clock::now();
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      const auto left = last_progress + seconds(write_timeout_) - Clock::now();
      if (left <= Clock::duration::zero()) return false;
      pollfd p{fd_, POLLOUT, 0};
      // shutdown() by stop() wakes this poll; a second's slice bounds the wait in any case.
      if (::poll(&p, 1, poll_ms(left)) < 0 && errno != EINTR) return false;
      continue;
    }
    return false;  // the client went away (EPIPE, ECONNRESET) or the socket was shut down
  }
  return true;
}

bool Exchange::writable() const {
  if (stopped_ && stopped_->load()) return false;
  pollfd p{fd_, POLLOUT, 0};
  const int r = ::poll(&p, 1, static_cast<int>(write_timeout_ * 1000));
  return r > 0 && (p.revents & (POLLERR | POLLHUP | POLLNVAL)) == 0;
}

bool Exchange::peer_closed() const {
  if (stopped_ && stopped_->load()) return true;
  char byte = 0;
  const ssize_t r = ::recv(fd_, &byte, 1, MSG_PEEK | MSG_DONTWAIT);
  return r == 0 || (r < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR);
}

// ---------------------------------------------------------------------------------------------

struct ConnectionGate::Connection {
  int fd = -1;
  std::string peer_ip, local_ip;
  int peer_port = 0, local_port = 0;
  bool lingering = false;       // answered by the gate: discarding until the client closes
  std::string in;               // received, not yet handed on (a request and what follows it)
  size_t line_start = 0;        // the header line being scanned begins here
  size_t scanned = 0;           // in[0, scanned) holds no end of the header block
  size_t head = 0;              // the header block's length once whole, 0 before
  size_t body = 0;              // Content-Length
  size_t reserved = 0;          // of buffered_body_bytes_: this request's body, until answered
  bool expect_continue = false; // Expect: 100-continue, and the 100 not sent yet
  bool started = false;         // a byte of the current request has arrived
  int64_t served = 0;           // requests handed to the workers
  Clock::time_point deadline;   // of the request being read, the keep-alive wait, or the linger
  std::string request;          // the worker's request
  bool last = false;            // the worker's response is the connection's last
  bool keep = false;            // the worker's verdict: the connection may carry another request
};

void check_gate_options(const GateOptions& o) {
  LOOM_CHECK(o.port >= 0 && o.port <= 65535, "--port must be a port number 0..65535 (0: any free port), got ", o.port);
  LOOM_CHECK(o.threads >= 1, "--threads must be >= 1, got ", o.threads);
  LOOM_CHECK(o.max_connections >= 1, "--max-connections must be >= 1, got ", o.max_connections);
  LOOM_CHECK(o.max_connections_per_client >= 1, "--max-connections-per-client must be >= 1, got ", o.max_connections_per_client);
  // std::isfinite: a NaN passes no comparison, and infinity would overflow the clock.
  LOOM_CHECK(std::isfinite(o.request_timeout) && o.request_timeout > 0 && o.request_timeout <= 86400,
             "--request-timeout must be seconds in (0, 86400], got ", o.request_timeout);
  LOOM_CHECK(std::isfinite(o.keepalive_timeout) && o.keepalive_timeout >= 0 && o.keepalive_timeout <= 86400,
             "--keepalive-timeout must be seconds in [0, 86400] (0: no keep-alive), got ", o.keepalive_timeout);
  LOOM_CHECK(o.keepalive_requests >= 1, "--keepalive-requests must be >= 1, got ", o.keepalive_requests);
  LOOM_CHECK(std::isfinite(o.write_timeout) && o.write_timeout > 0 && o.write_timeout <= 86400,
             "--write-timeout must be seconds in (0, 86400], got ", o.write_timeout);
  LOOM_CHECK(o.max_body_bytes >= 1 && o.max_buffered_body_bytes >= o.max_body_bytes,
             "the body limits must be >= 1 byte, the buffered bodies' at least one body's");
}

ConnectionGate::ConnectionGate(GateOptions options, Handler handler) : options_(std::move(options)), handler_(std::move(handler)) {
  check_gate_options(options_);
}

ConnectionGate::~ConnectionGate() {
  bool started;
  {
    std::lock_guard lock(mutex_);
    started = !workers_.empty() && !quit_;
  }
  if (started) stop(Clock::now());
  for (auto& [fd, c] : open_) ::close(fd);
  if (listen_fd_ >= 0) ::close(listen_fd_);
  if (epoll_fd_ >= 0) ::close(epoll_fd_);
  if (wake_fd_ >= 0) ::close(wake_fd_);
}

int ConnectionGate::bind() {
  // Every connection is a file descriptor: raise the soft limit as far as the cap needs (the hard
  // limit at most), else lower the cap to what the limit allows.
  rlimit limit{};
  if (::getrlimit(RLIMIT_NOFILE, &limit) == 0) {
    const rlim_t need = static_cast<rlim_t>(options_.max_connections + kSpareDescriptors);
    if (limit.rlim_cur != RLIM_INFINITY && limit.rlim_cur < need) {
      rlimit raised = limit;
      raised.rlim_cur = limit.rlim_max == RLIM_INFINITY ? need : std::min(need, limit.rlim_max);
      if (::setrlimit(RLIMIT_NOFILE, &raised) == 0) limit = raised;
      if (limit.rlim_cur < need) {
        options_.max_connections = std::max<int64_t>(1, static_cast<int64_t>(limit.rlim_cur) - kSpareDescriptors);
      }
    }
  }

  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* found = nullptr;
  const std::string port = std::to_string(options_.port);
  const int gai = ::getaddrinfo(options_.host.c_str(), port.c_str(), &hints, &found);
  LOOM_CHECK(gai == 0, "cannot listen on ", options_.host, ":", options_.port, " (", ::gai_strerror(gai), ")");
  int error = 0;
  for (addrinfo* a = found; a != nullptr && listen_fd_ < 0; a = a->ai_next) {
    const int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) {
      error = errno;
      continue;
    }
    const int yes = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof yes);
    // The backlog holds connections between two turns of the event loop (httplib's was 5: a burst
    // of clients waited for SYN retransmissions).
    if (::bind(fd, a->ai_addr, a->ai_addrlen) == 0 && ::listen(fd, SOMAXCONN) == 0) {
      listen_fd_ = fd;
    } else {
      error = errno;
      ::close(fd);
    }
  }
  ::freeaddrinfo(found);
  LOOM_CHECK(listen_fd_ >= 0, "cannot listen on ", options_.host, ":", options_.port, " (", std::strerror(error),
             ")");
  sockaddr_storage bound{};
  socklen_t length = sizeof bound;
  ::getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&bound), &length);

  epoll_fd_ = ::epoll_create1(EPOLL_CLOEXEC);
  wake_fd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  LOOM_CHECK(epoll_fd_ >= 0 && wake_fd_ >= 0, "cannot create the event loop (", std::strerror(errno), ")");
  for (const int fd : {listen_fd_, wake_fd_}) {
    epoll_event e{};
    e.events = EPOLLIN;
    e.data.fd = fd;
    ::epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, fd, &e);
  }
  return address_of(bound).second;
}

void ConnectionGate::wake() {
  const uint64_t one = 1;
  [[maybe_unused]] const ssize_t n = ::write(wake_fd_, &one, sizeof one);
}

void ConnectionGate::run() {
  {
    std::lock_guard lock(mutex_);
    if (stopping_ || epoll_fd_ < 0) return;
    loop_running_ = true;
    for (int i = 0; i < options_.threads; ++i) workers_.emplace_back([this] { work(); });
  }
  loop();
  // Stopped: connections that workers hand back from now on are closed by the workers.
  std::vector<std::unique_ptr<Connection>> back;
  {
    std::lock_guard lock(mutex_);
    loop_running_ = false;
    back.swap(returned_);
  }
  for (const auto& c : back) ::close(c->fd);
  ::close(listen_fd_);
  listen_fd_ = -1;
  for (auto& [fd, c] : open_) ::close(fd);  // requests not complete yet, idle and lingering connections
  open_.clear();
}

void ConnectionGate::drain() {
  draining_ = true;
  wake();
}

void ConnectionGate::stop(Clock::time_point deadline) {
  {
    std::lock_guard lock(mutex_);
    if (quit_) return;
    stopping_ = true;
  }
  if (wake_fd_ >= 0) wake();
  std::vector<std::thread> workers;
  {
    std::unique_lock lock(mutex_);
    // The requests already whole (in the workers, or waiting for one) get until the deadline.
    work_done_.wait_until(lock, deadline, [&] { return ready_.empty() && working_.empty(); });
    // Then whatever the clients do: writes fail at once, blocked ones wake.
    stopped_ = true;
    for (const int fd : working_) ::shutdown(fd, SHUT_RDWR);
    for (const auto& c : ready_) ::close(c->fd);
    ready_.clear();
    quit_ = true;
    workers.swap(workers_);
  }
  work_ready_.notify_all();
  for (std::thread& t : workers) t.join();
}

// ---------------------------------------------------------------------------------------------
// The event loop.

void ConnectionGate::loop() {
  std::vector<epoll_event> events(256);
  while (true) {
    const auto now = Clock::now();
    // Sleep until the first deadline (a second at most; expire() rescans then).
    Clock::time_point wake_at = now + std::chrono::seconds(1);
    for (const auto& [fd, c] : open_) wake_at = std::min(wake_at, c->deadline);
    if (accept_paused_until_ != Clock::time_point{}) wake_at = std::min(wake_at, accept_paused_until_);
    const int n = ::epoll_wait(epoll_fd_, events.data(), static_cast<int>(events.size()), poll_ms(wake_at - now));
    if (n < 0 && errno != EINTR) break;  // the epoll set is broken: stop serving
    for (int i = 0; i < n; ++i) {
      const int fd = events[static_cast<size_t>(i)].data.fd;
      if (fd == listen_fd_) {
        accept_all();
      } else if (fd == wake_fd_) {
        uint64_t count = 0;
        [[maybe_unused]] const ssize_t r = ::read(wake_fd_, &count, sizeof count);
      } else if (const auto it = open_.find(fd); it != open_.end()) {
        on_readable(*it->second);
      }
    }
    std::vector<std::unique_ptr<Connection>> back;
    bool stopping = false;
    {
      std::lock_guard lock(mutex_);
      back.swap(returned_);
      stopping = stopping_;
    }
    if (stopping) {
      for (auto& c : back) open_.emplace(c->fd, std::move(c));  // closed with the rest by run()
      return;
    }
    for (auto& c : back) resume(std::move(c));
    if (draining_ && !drain_seen_) {
      // Draining: idle kept-alive connections close now (nginx closes them on a graceful stop too).
      drain_seen_ = true;
      std::vector<int> idle;
      for (const auto& [fd, c] : open_) {
        if (c->served > 0 && !c->started && !c->lingering) idle.push_back(fd);
      }
      for (const int fd : idle) close_connection(fd);
    }
    if (accept_paused_until_ != Clock::time_point{} && Clock::now() >= accept_paused_until_) {
      accept_paused_until_ = {};
      epoll_event e{};
      e.events = EPOLLIN;
      e.data.fd = listen_fd_;
      ::epoll_ctl(epoll_fd_, EPOLL_CTL_MOD, listen_fd_, &e);
    }
    expire(Clock::now());
  }
}

void ConnectionGate::accept_all() {
  while (true) {
    sockaddr_storage peer{};
    socklen_t length = sizeof peer;
    const int fd = ::accept4(listen_fd_, reinterpret_cast<sockaddr*>(&peer), &length, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EINTR || errno == ECONNABORTED) continue;
      if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
        // Out of descriptors or memory: the pending connection stays in the backlog; stop
        // watching the listener for a moment instead of spinning on it.
        accept_paused_until_ = Clock::now() + kAcceptPause;
        epoll_event e{};
        e.data.fd = listen_fd_;
        ::epoll_ctl(epoll_fd_, EPOLL_CTL_MOD, listen_fd_, &e);
      }
      return;  // EAGAIN: none left
    }
    const auto [ip, port] = address_of(peer);
    int64_t& mine = per_client_[ip];
    if (connections_ >= options_.max_connections || mine >= options_.max_connections_per_client) {
      // Over a cap (nginx's limit_conn answers 503 too): say so and close, without reading.
      const std::string why =
          mine >= options_.max_connections_per_client
              ? str_cat("too many connections from ", ip, " (at most ", options_.max_connections_per_client,
                        ", --max-connections-per-client)")
              : str_cat("too many connections (at most ", options_.max_connections, ", --max-connections)");
      send_now(fd, error_response(503, why));
      ::close(fd);
      if (mine == 0) per_client_.erase(ip);
      continue;
    }
    ++mine, ++connections_;
    // Small writes (a stream's events) leave at once (nginx: tcp_nodelay on).
    const int yes = 1;
    ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &yes, sizeof yes);
    auto c = std::make_unique<Connection>();
    c->fd = fd;
    c->peer_ip = ip, c->peer_port = port;
    sockaddr_storage local{};
    socklen_t local_length = sizeof local;
    if (::getsockname(fd, reinterpret_cast<sockaddr*>(&local), &local_length) == 0) {
      std::tie(c->local_ip, c->local_port) = address_of(local);
    }
    // The first request's deadline runs from accept: a silent connection gets no longer.
    c->deadline = Clock::now() + seconds(options_.request_timeout);
    epoll_event e{};
    e.events = EPOLLIN | EPOLLRDHUP;
    e.data.fd = fd;
    ::epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, fd, &e);
    open_.emplace(fd, std::move(c));
  }
}

void ConnectionGate::on_readable(Connection& c) {
  char buffer[16384];
  while (true) {
    const ssize_t n = ::recv(c.fd, buffer, sizeof buffer, 0);
    if (n > 0) {
      if (c.lingering) continue;  // discarded
      if (!c.started) {
        c.started = true;
        // A kept-alive connection's next request: its deadline runs from its first byte.
        if (c.served > 0) c.deadline = Clock::now() + seconds(options_.request_timeout);
      }
      c.in.append(buffer, static_cast<size_t>(n));
      switch (parse(c)) {
        case Parse::complete: dispatch(c.fd); return;  // c moved to the workers
        case Parse::failed: return;                    // answered; lingering
        case Parse::more: continue;
      }
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
    close_connection(c.fd);  // the client closed (n == 0) or failed: nothing to answer
    return;
  }
}

// Finds the end of the header block and checks the fields that frame the body. httplib parses the
// request again on the worker; the gate only needs to know where the request ends.
ConnectionGate::Parse ConnectionGate::parse(Connection& c) {
  if (c.head == 0) {
    size_t i = c.scanned;
    while (i < c.in.size()) {
      if (c.in[i] != '\n') {
        ++i;
        continue;
      }
      // Lines end with CRLF; a bare LF is accepted too (RFC 9112 section 2.2).
      const size_t end = i > c.line_start && c.in[i - 1] == '\r' ? i - 1 : i;
      if (end == c.line_start) {
        if (c.line_start == 0) {  // empty lines before the request line are ignored (ibid.)
          c.in.erase(0, i + 1);
          i = 0;
          continue;
        }
        c.head = i + 1;
        break;
      }
      c.line_start = ++i;
    }
    c.scanned = i;
    if (c.head == 0 && c.in.size() <= options_.max_header_bytes) return Parse::more;
    if (c.head == 0 || c.head > options_.max_header_bytes) {
      answer_and_close(c, 431, str_cat("the request line and header fields exceed ", options_.max_header_bytes, " bytes"));
      return Parse::failed;
    }

    // The fields that say where the body ends (RFC 9112 section 6).
    std::vector<std::string_view> lengths;
    bool chunked = false;
    size_t expect_begin = 0, expect_end = 0;
    const std::string_view block(c.in.data(), c.head);
    size_t at = block.find('\n') + 1;  // after the request line
    while (at < block.size()) {
      const size_t eol = block.find('\n', at);
      const size_t next = eol + 1;
      std::string_view line = block.substr(at, eol - at);
      if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
      if (line.empty()) break;
      const size_t colon = line.find(':');
      if (colon != std::string_view::npos) {
        const std::string_view name = line.substr(0, colon);
        const std::string_view value = trim(line.substr(colon + 1));
        if (name.empty() || name.find_first_of(" \t") != std::string_view::npos) {
          // RFC 9112 section 5.1: no whitespace between a field name and its colon.
          answer_and_close(c, 400, str_cat("invalid header field name '", std::string(name), "'"));
          return Parse::failed;
        }
        if (iequals(name, "Content-Length")) {
          size_t from = 0;
          while (true) {  // a list of the same value is allowed (RFC 9110 section 8.6)
            const size_t comma = value.find(',', from);
            lengths.push_back(trim(value.substr(from, comma == std::string_view::npos ? comma : comma - from)));
            if (comma == std::string_view::npos) break;
            from = comma + 1;
          }
        } else if (iequals(name, "Transfer-Encoding")) {
          chunked = true;
        } else if (iequals(name, "Expect") && iequals(value, "100-continue")) {
          expect_begin = at, expect_end = next;
        }
      }
      at = next;
    }
    if (chunked) {
      answer_and_close(c, 411, "Transfer-Encoding is not supported: send the body with a Content-Length");
      return Parse::failed;
    }
    if (!lengths.empty()) {
      for (const std::string_view v : lengths) {
        // Content-Length = 1*DIGIT (RFC 9110 section 8.6); anything else, and differing values,
        // cannot frame the message: 400 and close (RFC 9112 section 6.3).
        if (v.empty() || v.find_first_not_of("0123456789") != std::string_view::npos) {
          answer_and_close(c, 400, str_cat("invalid Content-Length '", std::string(v), "': expected a number of bytes"));
          return Parse::failed;
        }
        if (v != lengths.front()) {
          answer_and_close(c, 400, "conflicting Content-Length values");
          return Parse::failed;
        }
      }
      const std::string_view v = lengths.front().substr(std::min(lengths.front().find_first_not_of('0'), lengths.front().size() - 1));
      const size_t limit = options_.max_body_bytes;
      if (v.size() > 18 || std::stoull(std::string(v)) > limit) {
        answer_and_close(c, 413, str_cat("the request body is ", std::string(v), " bytes; at most ", limit, " are accepted"));
        return Parse::failed;
      }
      c.body = std::stoull(std::string(v));
      if (buffered_body_bytes_ + c.body > options_.max_buffered_body_bytes) {
        answer_and_close(c, 503, "the server is receiving too many request bodies at once; retry later");
        return Parse::failed;
      }
      c.reserved = c.body;
      buffered_body_bytes_ += c.reserved;
    }
    if (expect_end > expect_begin) {
      // The gate answers the expectation itself (RFC 9110 section 10.1.1) and takes the field
      // out, so that httplib does not send a second 100 once the body is here.
      c.in.erase(expect_begin, expect_end - expect_begin);
      c.head -= expect_end - expect_begin;
      c.expect_continue = c.body > 0;
    }
  }
  if (c.in.size() >= c.head + c.body) return Parse::complete;
  if (c.expect_continue) {
    send_now(c.fd, "HTTP/1.1 100 Continue\r\n\r\n");
    c.expect_continue = false;
  }
  return Parse::more;
}

void ConnectionGate::dispatch(int fd) {
  const auto it = open_.find(fd);
  std::unique_ptr<Connection> c = std::move(it->second);
  open_.erase(it);
  ::epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, fd, nullptr);
  const size_t length = c->head + c->body;
  c->request.assign(c->in, 0, length);
  c->in.erase(0, length);  // pipelined bytes stay for the next request
  c->line_start = c->scanned = c->head = c->body = 0;
  c->expect_continue = c->started = false;
  ++c->served;
  c->last = draining_ || c->served >= options_.keepalive_requests || options_.keepalive_timeout <= 0;
  {
    std::lock_guard lock(mutex_);
    ready_.push_back(std::move(c));
  }
  work_ready_.notify_one();
}

void ConnectionGate::resume(std::unique_ptr<Connection> c) {
  const int fd = c->fd;
  buffered_body_bytes_ -= c->reserved;
  c->reserved = 0;
  if (!c->keep || c->last || draining_) {
    open_.emplace(fd, std::move(c));
    close_connection(fd);
    return;
  }
  c->request = std::string();
  epoll_event e{};
  e.events = EPOLLIN | EPOLLRDHUP;
  e.data.fd = fd;
  ::epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, fd, &e);
  Connection& kept = *open_.emplace(fd, std::move(c)).first->second;
  if (kept.in.empty()) {
    kept.deadline = Clock::now() + seconds(options_.keepalive_timeout);
    return;
  }
  // A pipelined request began while the last one was answered.
  kept.started = true;
  kept.deadline = Clock::now() + seconds(options_.request_timeout);
  if (parse(kept) == Parse::complete) dispatch(fd);
}

void ConnectionGate::answer_and_close(Connection& c, int status, const std::string& message) {
  send_now(c.fd, error_response(status, message));
  // Lingering close: no more writes, and what the client still sends is read and dropped, so
  // that its kernel does not reset the connection before it reads the answer.
  ::shutdown(c.fd, SHUT_WR);
  c.lingering = true;
  c.in = std::string();
  buffered_body_bytes_ -= c.reserved;
  c.reserved = 0;
  c.deadline = Clock::now() + kLingerTime;
}

void ConnectionGate::close_connection(int fd) {
  const auto it = open_.find(fd);
  if (it == open_.end()) return;
  const auto client = per_client_.find(it->second->peer_ip);
  if (client != per_client_.end() && --client->second <= 0) per_client_.erase(client);
  --connections_;
  buffered_body_bytes_ -= it->second->reserved;
  ::close(fd);  // also leaves the epoll set
  open_.erase(it);
}

void ConnectionGate::expire(Clock::time_point now) {
  std::vector<int> late;
  for (const auto& [fd, c] : open_) {
    if (c->deadline <= now) late.push_back(fd);
  }
  for (const int fd : late) {
    Connection& c = *open_.at(fd);
    if (!c.lingering && c.started) {
      answer_and_close(c, 408, str_cat("the request did not arrive whole within ", options_.request_timeout,
                                        " s (--request-timeout)"));
    } else {
      close_connection(fd);  // idle or silent (nothing to answer), or done lingering
    }
  }
}

// ---------------------------------------------------------------------------------------------
// The workers.

void ConnectionGate::work() {
  while (true) {
    std::unique_ptr<Connection> c;
    {
      std::unique_lock lock(mutex_);
      work_ready_.wait(lock, [&] { return quit_ || !ready_.empty(); });
      if (quit_) return;
      c = std::move(ready_.front());
      ready_.pop_front();
      working_.insert(c->fd);
    }
    Exchange exchange;
    exchange.request_ = std::move(c->request);
    exchange.peer_ip_ = c->peer_ip, exchange.peer_port_ = c->peer_port;
    exchange.local_ip_ = c->local_ip, exchange.local_port_ = c->local_port;
    exchange.fd_ = c->fd;
    exchange.last_ = c->last;
    exchange.write_timeout_ = options_.write_timeout;
    exchange.stopped_ = &stopped_;
    bool keep = false;
    try {
      keep = handler_(exchange);
    } catch (...) {  // the handler answers its own errors; anything else closes the connection
      keep = false;
    }
    c->keep = keep && !stopped_;
    bool to_loop = false;
    {
      std::lock_guard lock(mutex_);
      working_.erase(c->fd);
      if (loop_running_) {
        returned_.push_back(std::move(c));
        to_loop = true;
      } else {
        ::close(c->fd);
      }
    }
    work_done_.notify_all();
    if (to_loop) wake();
  }
}

}  // namespace loom::serve
