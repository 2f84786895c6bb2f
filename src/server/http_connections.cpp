#include "server/http_connections.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <vector>

#include "server/api_error.h"
#include "util/error.h"

namespace moesrv {

namespace {

using Clock = std::chrono::steady_clock;

thread_local int t_socket = -1;          // the connection the current handler serves
thread_local bool t_over_limit = false;  // that connection is beyond max_connections

constexpr size_t kMaxHead = 64 << 10;   // request line + headers; more: 431
constexpr size_t kOverLimitSpare = 64;  // connections kept beyond the limit (each gets one answer)
constexpr int kInlinePerTurn = 16;      // pipelined requests answered on the reception thread per turn

bool wait_fd(int fd, short events, int ms) {
  pollfd p{fd, events, 0};
  int r;
  do r = poll(&p, 1, ms);
  while (r < 0 && errno == EINTR);
  return r > 0;
}

void addr_of(const sockaddr_storage& a, std::string& ip, int& port) {
  char buf[INET6_ADDRSTRLEN] = {};
  if (a.ss_family == AF_INET) {
    auto* in = reinterpret_cast<const sockaddr_in*>(&a);
    inet_ntop(AF_INET, &in->sin_addr, buf, sizeof buf);
    port = ntohs(in->sin_port);
  } else if (a.ss_family == AF_INET6) {
    auto* in = reinterpret_cast<const sockaddr_in6*>(&a);
    inet_ntop(AF_INET6, &in->sin6_addr, buf, sizeof buf);
    port = ntohs(in->sin6_port);
  }
  ip = buf;
}

bool iequals(std::string_view a, std::string_view b) {
  return a.size() == b.size() &&
         std::equal(a.begin(), a.end(), b.begin(), [](char x, char y) { return std::tolower(x) == std::tolower(y); });
}

std::string_view trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
  return s;
}

// A whole response for errors the reception thread gives itself (no httplib request behind them).
std::string raw_error(int status, const char* reason, const std::string& message, const char* code) {
  std::string body = ApiError(status, message, "invalid_request_error", "", code).to_json().dump();
  return fmt::format(
      "HTTP/1.1 {} {}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{}", status,
      reason, body.size(), body);
}

// A thread per queued task, reusing idle threads; at most `cap` threads, then tasks wait. Runs every task
// queued before shutdown().
class ElasticPool {
 public:
  explicit ElasticPool(size_t cap) : cap_(cap) {}
  ~ElasticPool() { shutdown(); }
  void enqueue(std::function<void()> fn) {
    std::lock_guard lock(mu_);
    jobs_.push_back(std::move(fn));
    if (jobs_.size() > idle_ && threads_.size() < cap_) threads_.emplace_back([this] { work(); });
    else cv_.notify_one();
  }
  void shutdown() {
    {
      std::lock_guard lock(mu_);
      if (stop_) return;
      stop_ = true;
    }
    cv_.notify_all();
    for (auto& t : threads_) t.join();
  }

 private:
  void work() {
    std::unique_lock lock(mu_);
    for (;;) {
      ++idle_;
      cv_.wait(lock, [&] { return stop_ || !jobs_.empty(); });
      --idle_;
      if (jobs_.empty()) return;
      auto fn = std::move(jobs_.front());
      jobs_.pop_front();
      lock.unlock();
      fn();
      lock.lock();
    }
  }
  size_t cap_, idle_ = 0;
  bool stop_ = false;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> jobs_;
  std::vector<std::thread> threads_;
};

}  // namespace

// One connection and the bytes of its next request(s) received so far.
struct ConnectionServer::Conn {
  int fd = -1;
  std::string buf;              // received, not yet consumed (may hold the start of the following request)
  size_t scanned = 0;           // the search for the end of the head resumes here
  size_t head = 0;              // length of the request line + headers once complete (0: not yet)
  size_t need = 0;              // bytes of the whole request (head + Content-Length body) once the head is in
  bool body_by_worker = false;  // chunked, Expect: 100-continue or over the size limit: httplib reads the body
  bool health = false;          // GET /health
  bool over_limit = false;      // beyond max_connections: one answer, /health or 503, then closed
  bool eof = false;             // the peer shut down its sending side
  size_t served = 0;
  uint64_t order = 0;                    // when it began to wait, as a count (ties in time are common)
  Clock::time_point since, first, last;  // waiting since; the request's first byte; its last byte
  void next_request(Clock::time_point now, uint64_t n) {
    scanned = head = need = 0;
    body_by_worker = health = false;
    since = first = last = now;
    order = n;
  }
};

namespace {

// The request bytes the reception thread buffered, then (on a worker) the socket itself. Inline (on the
// reception thread) it never blocks: the request is all buffered, and a response that does not fit the socket
// buffer at once fails.
class ConnStream : public httplib::Stream {
 public:
  ConnStream(ConnectionServer::Conn& c, bool inline_only, int read_ms, int write_ms)
      : c_(c), inline_(inline_only), read_ms_(read_ms), write_ms_(write_ms) {}
  bool is_readable() const override { return pos_ < c_.buf.size() || (!inline_ && wait_fd(c_.fd, POLLIN, read_ms_)); }
  bool is_writable() const override { return wait_fd(c_.fd, POLLOUT, inline_ ? 0 : write_ms_); }
  ssize_t read(char* ptr, size_t size) override {
    if (pos_ < c_.buf.size()) {
      size_t n = std::min(size, c_.buf.size() - pos_);
      std::memcpy(ptr, c_.buf.data() + pos_, n);
      pos_ += n;
      return ssize_t(n);
    }
    if (inline_) return 0;
    if (!wait_fd(c_.fd, POLLIN, read_ms_)) return -1;
    ssize_t n;
    do n = recv(c_.fd, ptr, size, 0);
    while (n < 0 && errno == EINTR);
    return n;
  }
  ssize_t write(const char* ptr, size_t size) override {
    if (!is_writable()) return -1;
    ssize_t n;
    do n = send(c_.fd, ptr, size, MSG_NOSIGNAL | (inline_ ? MSG_DONTWAIT : 0));
    while (n < 0 && errno == EINTR);
    return n;
  }
  void get_remote_ip_and_port(std::string& ip, int& port) const override {
    sockaddr_storage a{};
    socklen_t len = sizeof a;
    if (getpeername(c_.fd, reinterpret_cast<sockaddr*>(&a), &len) == 0) addr_of(a, ip, port);
  }
  void get_local_ip_and_port(std::string& ip, int& port) const override {
    sockaddr_storage a{};
    socklen_t len = sizeof a;
    if (getsockname(c_.fd, reinterpret_cast<sockaddr*>(&a), &len) == 0) addr_of(a, ip, port);
  }
  socket_t socket() const override { return c_.fd; }
  void consume() {  // drops what httplib read; the rest is the next request's start
    c_.buf.erase(0, pos_);
    pos_ = 0;
  }

 private:
  ConnectionServer::Conn& c_;
  bool inline_;
  int read_ms_, write_ms_;
  size_t pos_ = 0;
};

}  // namespace

// The reception thread and the workers.
struct ConnectionServer::Reception {
  ConnectionServer& srv;
  const ConnectionLimits lim;
  int wake[2] = {-1, -1};
  std::mutex mu;  // guards the three below
  bool stopping = false;
  std::vector<int> accepted;
  std::vector<std::unique_ptr<Conn>> returned;
  std::atomic<bool> stop_flag{false};
  std::atomic<size_t> open{0};                           // connections open: in `conns` or on a worker
  size_t over = 0;                                       // of `conns`, those over the limit (reception thread only)
  uint64_t waits = 0;                                    // numbers the waits (Conn::order; reception thread only)
  std::unordered_map<int, std::unique_ptr<Conn>> conns;  // reception thread only
  std::vector<int> ready;  // connections with more buffered requests to answer next turn (reception thread only)
  std::vector<char> scratch = std::vector<char>(64 << 10);
  ElasticPool workers;
  std::thread thread;

  // A worker runs a request of a connection within the limit: never more than max_connections at once.
  Reception(ConnectionServer& s, ConnectionLimits l) : srv(s), lim(l), workers(l.max_connections) {
    MOESRV_CHECK(pipe2(wake, O_CLOEXEC | O_NONBLOCK) == 0, "pipe2 failed: {}", std::strerror(errno));
    thread = std::thread([this] { run(); });
  }
  ~Reception() {
    stop();
    close(wake[0]);
    close(wake[1]);
  }

  void notify() {
    char b = 1;
    [[maybe_unused]] auto n = ::write(wake[1], &b, 1);  // a full pipe already wakes the thread
  }
  static void close_fd(int fd) {
    ::shutdown(fd, SHUT_RDWR);
    ::close(fd);
  }

  // From httplib's accept loop.
  void accept(int fd) {
    {
      std::lock_guard lock(mu);
      if (!stopping) {
        accepted.push_back(fd);
        fd = -1;
      }
    }
    if (fd >= 0) close_fd(fd);
    else notify();
  }

  void stop() {
    {
      std::lock_guard lock(mu);
      if (stopping) return;
      stopping = true;
    }
    stop_flag = true;
    notify();
    if (thread.joinable()) thread.join();
    workers.shutdown();  // requests in progress finish; their connections are closed
  }

  // On a worker: one request, then the connection goes back to the reception thread (or is closed).
  void work(std::unique_ptr<Conn> c) {
    if (srv.serve(*c, false)) {
      std::lock_guard lock(mu);
      if (!stopping) {
        returned.push_back(std::move(c));
        notify();
        return;
      }
    }
    close_fd(c->fd);
    --open;
  }

  void drop(int fd) {
    auto it = conns.find(fd);
    if (it == conns.end()) return;
    if (it->second->over_limit) --over;
    conns.erase(it);
    close_fd(fd);
    --open;
  }
  void reject(int fd, int status, const char* reason, const std::string& message, const char* code) {
    std::string r = raw_error(status, reason, message, code);
    [[maybe_unused]] auto n = send(fd, r.data(), r.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
    drop(fd);
  }

  // The connection that has waited longest without a complete request, among those over the limit or not.
  int oldest(bool over_limit) const {
    int fd = -1;
    uint64_t first = UINT64_MAX;
    for (auto& [f, c] : conns)
      if (c->over_limit == over_limit && c->order < first) fd = f, first = c->order;
    return fd;
  }

  void admit(int fd, Clock::time_point now) {
    auto c = std::make_unique<Conn>();
    c->fd = fd;
    c->next_request(now, ++waits);
    // Make room: a waiting connection may give way; one running a request never does.
    while (open - over >= lim.max_connections) {
      int victim = oldest(false);
      if (victim < 0) break;
      drop(victim);
    }
    if (open - over >= lim.max_connections) {
      c->over_limit = true;
      while (over >= kOverLimitSpare) {
        int victim = oldest(true);
        if (victim < 0) break;
        drop(victim);
      }
      ++over;
    }
    ++open;
    conns[fd] = std::move(c);
  }

  void parse_head(Conn& c, size_t head_len) {
    c.head = head_len;
    std::string_view h(c.buf.data(), head_len - 2);  // lines ending in \r\n
    size_t eol = h.find("\r\n");
    std::string_view line = h.substr(0, eol);
    size_t sp1 = line.find(' '), sp2 = line.find(' ', sp1 == line.npos ? line.size() : sp1 + 1);
    std::string_view method = line.substr(0, sp1);
    std::string_view target = sp1 == line.npos ? "" : line.substr(sp1 + 1, sp2 - sp1 - 1);
    c.health = (method == "GET" || method == "HEAD") && (target == "/health" || target.starts_with("/health?"));
    uint64_t length = 0;
    bool worker = false;
    for (size_t pos = eol; pos != h.npos && pos + 2 < h.size();) {
      size_t end = h.find("\r\n", pos + 2);
      std::string_view field = h.substr(pos + 2, end == h.npos ? h.npos : end - pos - 2);
      pos = end;
      size_t colon = field.find(':');
      if (colon == field.npos) continue;
      std::string_view name = trim(field.substr(0, colon)), value = trim(field.substr(colon + 1));
      if (iequals(name, "Content-Length")) {
        auto [p, ec] = std::from_chars(value.data(), value.data() + value.size(), length);
        if (ec != std::errc() || p != value.data() + value.size()) worker = true;  // httplib answers 400
      } else if (iequals(name, "Transfer-Encoding") || iequals(name, "Expect")) {
        worker = true;
      }
    }
    c.body_by_worker = worker || length > lim.max_body;
    c.need = head_len + (c.body_by_worker ? 0 : size_t(length));
  }

  // Moves the connection on as far as its buffered bytes allow: a complete request is answered here (/health,
  // or anything over the limit) or handed to a worker.
  void advance(int fd, Clock::time_point now) {
    for (int answered = 0;; ++answered) {
      auto it = conns.find(fd);
      if (it == conns.end()) return;
      Conn& c = *it->second;
      if (!c.head) {
        size_t pos = c.buf.find("\r\n\r\n", c.scanned > 3 ? c.scanned - 3 : 0);
        if (pos == std::string::npos) {
          c.scanned = c.buf.size();
          if (c.buf.size() > kMaxHead)
            return reject(fd, 431, "Request Header Fields Too Large",
                          fmt::format("The request line and headers exceed {} bytes.", kMaxHead), "headers_too_large");
          if (c.eof) drop(fd);
          return;
        }
        parse_head(c, pos + 4);
      }
      if (!c.body_by_worker && c.buf.size() < c.need) {
        if (c.eof) drop(fd);
        return;
      }
      if (answered == kInlinePerTurn) return ready.push_back(fd);  // others get their turn first
      if (!c.health && !c.over_limit) {
        std::unique_ptr<Conn> own = std::move(it->second);
        conns.erase(it);
        workers.enqueue([this, raw = own.release()] { work(std::unique_ptr<Conn>(raw)); });
        return;
      }
      if (!srv.serve(c, true)) return drop(fd);
      c.next_request(now, ++waits);
    }
  }

  void receive(int fd, Clock::time_point now) {
    auto it = conns.find(fd);
    if (it == conns.end()) return;
    Conn& c = *it->second;
    for (int i = 0; i < 16; ++i) {  // up to 1 MiB per turn, so one fast sender cannot hold up the others
      ssize_t n = recv(fd, scratch.data(), scratch.size(), MSG_DONTWAIT);
      if (n > 0) {
        if (c.buf.empty()) c.first = now;
        c.buf.append(scratch.data(), size_t(n));
        c.last = now;
        if (size_t(n) < scratch.size()) break;
      } else if (n == 0) {
        c.eof = true;
        break;
      } else if (errno != EINTR) {
        if (errno == EAGAIN || errno == EWOULDBLOCK) break;
        return drop(fd);
      }
    }
    advance(fd, now);
  }

  // When the connection's current wait runs out.
  Clock::time_point deadline(const Conn& c) const {
    using std::chrono::milliseconds;
    if (c.buf.empty()) return c.since + milliseconds(lim.keep_alive_ms);
    if (!c.head) return c.first + milliseconds(lim.read_ms);  // the whole head, however it trickles in
    return c.last + milliseconds(lim.read_ms);                // the body: no pause longer than this
  }

  void expire(Clock::time_point now) {
    std::vector<int> late;
    for (auto& [fd, c] : conns)
      if (deadline(*c) <= now) late.push_back(fd);
    for (int fd : late) {
      if (conns.at(fd)->buf.empty()) {
        drop(fd);  // idle: closed quietly, like any keep-alive timeout
        continue;
      }
      double s = lim.read_ms / 1000.0;
      reject(fd, 408, "Request Timeout",
             fmt::format("The request did not arrive in time: its line and headers must arrive within {} s of its "
                         "first byte, and its body may not pause longer than that (--read-timeout).",
                         s),
             "request_timeout");
    }
  }

  int poll_timeout(Clock::time_point now) const {
    if (conns.empty()) return -1;
    auto next = Clock::time_point::max();
    for (auto& [fd, c] : conns) next = std::min(next, deadline(*c));
    auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(next - now).count() + 1;
    return int(std::clamp<int64_t>(ms, 0, 60000));
  }

  void run() {
    std::vector<pollfd> fds;
    std::vector<int> new_fds;
    std::vector<std::unique_ptr<Conn>> back;
    for (;;) {
      fds.clear();
      fds.push_back({wake[0], POLLIN, 0});
      for (auto& [fd, c] : conns) fds.push_back({fd, POLLIN, 0});
      int r = poll(fds.data(), fds.size(), ready.empty() ? poll_timeout(Clock::now()) : 0);
      if (r < 0 && errno != EINTR) std::this_thread::sleep_for(std::chrono::milliseconds(1));
      auto now = Clock::now();
      if (fds[0].revents) {
        char b[256];
        while (::read(wake[0], b, sizeof b) > 0) {
        }
      }
      {
        std::lock_guard lock(mu);
        if (stopping) break;
        new_fds.swap(accepted);
        back.swap(returned);
      }
      // Bytes that arrived are read before new connections may make room by closing waiting ones.
      std::vector<int> again;
      again.swap(ready);  // what receive() defers now waits for the next turn
      for (size_t i = 1; i < fds.size(); ++i)
        if (fds[i].revents) receive(fds[i].fd, now);
      for (int fd : again) advance(fd, now);
      for (auto& c : back) {
        int fd = c->fd;
        c->next_request(now, ++waits);
        conns[fd] = std::move(c);
        advance(fd, now);  // a pipelined request may be buffered already
      }
      back.clear();
      for (int fd : new_fds) admit(fd, now);
      new_fds.clear();
      expire(now);
    }
    std::lock_guard lock(mu);
    for (int fd : accepted) close_fd(fd);
    for (auto& c : returned) close_fd(c->fd), --open;
    accepted.clear();
    returned.clear();
    for (auto& [fd, c] : conns) close_fd(fd), --open;
    conns.clear();
  }
};

namespace {

// httplib's accept loop hands each connection to a TaskQueue; this one passes it straight to the reception.
class ToReception : public httplib::TaskQueue {
 public:
  explicit ToReception(ConnectionServer::Reception& r) : r_(r) {}
  void enqueue(std::function<void()> fn) override { fn(); }  // process_and_close_socket: returns at once
  void shutdown() override { r_.stop(); }

 private:
  ConnectionServer::Reception& r_;
};

}  // namespace

ConnectionServer::ConnectionServer() {
  new_task_queue = [this] {
    reception_ = std::make_unique<Reception>(*this, limits);
    return new ToReception(*reception_);
  };
}

ConnectionServer::~ConnectionServer() {
  if (reception_) reception_->stop();
}

void ConnectionServer::widen_backlog() { ::listen(svr_sock_, SOMAXCONN); }

int ConnectionServer::current_socket() { return t_socket; }
bool ConnectionServer::current_over_limit() { return t_over_limit; }

bool ConnectionServer::process_and_close_socket(socket_t sock) {
  reception_->accept(sock);
  return true;
}

bool ConnectionServer::serve(Conn& c, bool inline_only) {
  ConnStream strm(c, inline_only, limits.read_ms, limits.write_ms);
  bool last = c.over_limit || c.eof || ++c.served >= limits.keep_alive_requests || reception_->stop_flag;
  bool closed = false;
  t_socket = c.fd;
  t_over_limit = c.over_limit;
  bool ok = process_request(strm, last, closed, nullptr);
  t_socket = -1;
  t_over_limit = false;
  strm.consume();
  return ok && !closed && !last;
}

bool socket_gone(int fd) {
  if (fd < 0) return false;
  pollfd p{fd, short(POLLIN | POLLRDHUP), 0};
  if (poll(&p, 1, 0) <= 0) return false;
  if (p.revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL)) return true;
  if (p.revents & POLLIN) {
    char c;
    return recv(fd, &c, 1, MSG_PEEK | MSG_DONTWAIT) == 0;
  }
  return false;
}

}  // namespace moesrv
