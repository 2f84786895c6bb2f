// Connection handling for the HTTP server (cpp-httplib does the HTTP parsing and routing).
//
// One "reception" thread owns every connection that is not running a request: fresh and keep-alive sockets and
// requests still arriving. It polls them all, reads what arrives without blocking, and only when a request is
// complete (head and Content-Length body) hands the connection to a worker thread, which runs it through
// httplib and gives the connection back for the next keep-alive request. So idle or slow sockets cost a file
// descriptor and a buffer, never a thread, and cannot delay anyone:
//   - a request's head must be complete within the read timeout of its first byte (slowloris); a body must
//     keep arriving (no pause longer than the read timeout); then 408 and close. Idle sockets close after the
//     keep-alive timeout.
//   - beyond `max_connections` open connections, the one that has waited longest without a complete request
//     (idle or still arriving) is closed to make room for a new one. Only when every other connection is running
//     a request is the new one "over the limit": it gets one answer, /health or 503, from the reception thread.
//   - GET /health is always answered by the reception thread itself, never waiting for a worker.
// Chunked bodies, `Expect: 100-continue` and bodies over the size limit are read by the worker (httplib), as
// before, with the read timeout per pause.
#pragma once
#include <httplib.h>

#include <atomic>
#include <cstddef>
#include <memory>

namespace moesrv {

struct ConnectionLimits {
  size_t max_connections = 256;
  int keep_alive_ms = 5000, read_ms = 10000, write_ms = 30000;
  size_t keep_alive_requests = 1000;   // requests per connection, then it is closed
  size_t max_body = size_t(64) << 20;  // a larger body is left to httplib (413)
};

class ConnectionServer : public httplib::Server {
 public:
  ConnectionServer();
  ~ConnectionServer() override;
  ConnectionLimits limits;
  // httplib listens with a backlog of 5: a burst of connections then waits for SYN retransmits (1 s, 3 s, ...).
  void widen_backlog();

  // For request handlers: the socket of the request being handled (-1 outside one) and whether its connection is
  // beyond the connection limit.
  static int current_socket();
  static bool current_over_limit();

  struct Conn;
  struct Reception;

 private:
  friend struct Reception;
  bool process_and_close_socket(socket_t sock) override;  // called by httplib's accept loop for each connection
  bool serve(Conn& c, bool inline_only);                  // one request through httplib; false: close
  std::unique_ptr<Reception> reception_;
};

// True once the peer has closed its side (or the connection broke). Never blocks. A peer that only shut down
// its sending side (half-close) counts as gone: TCP cannot tell that from a client that left.
bool socket_gone(int fd);

}  // namespace moesrv
