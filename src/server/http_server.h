// The OpenAI-compatible HTTP server: /v1/chat/completions, /v1/completions, /v1/models, /health, /metrics.
// Up to max_batch requests generate at once (Scheduler; with more than one, their decode steps run batched,
// serving/batch_runner.h); the rest queue. Start on port 0 for an ephemeral port.
// Idle and slow connections wait on one reception thread, not on threads of their own, and /health is answered
// there (http_connections.h): they cannot hold up requests or /health. A client that goes away, streaming or
// not, stops its generation.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "backend/engine.h"
#include "server/chat_codec.h"

namespace moesrv {

struct ServerOptions {
  std::string host = "127.0.0.1";
  int port = 8080;
  int64_t ctx = 0;                  // 0: the engine's max_context()
  int64_t reasoning_budget = 4096;  // tokens inside <think> before "</think>" is forced; 0: unlimited
  bool strict_tools = false;
  size_t queue_max = 16;       // waiting requests beyond the running ones
  size_t max_batch = 1;        // requests generating at once, decode steps batched (1 with speculative > 0)
  size_t state_memory_mb = 0;  // sequence state the running requests may reserve together (0: unlimited)
  double queue_timeout_s = 600;
  size_t prefix_cache_mb = 4096;    // 0: off
  std::string served_name;          // "": the engine's name()
  std::vector<std::string> aliases;  // more names the model answers to (requests naming others get 404)
  int64_t prefill_chunk = 0;         // prompt tokens per forward call; 0: the engine's pass length
  int speculative = 0;               // most MTP draft tokens per decode step (0: off)
  bool speculative_adaptive = true;  // drafts per step chosen by a DraftPolicy (else always `speculative`)
  int reattach_turns = 4;           // re-attach dropped reasoning on this many last tool-calling turns
  size_t max_connections = 256;     // open connections; beyond, waiting ones make room, else only /health
  double keep_alive_timeout_s = 5;  // an idle keep-alive connection is closed after this
  double read_timeout_s = 10;       // a request's head must arrive within this of its first byte; no body pause longer
  size_t max_body_mb = 64;          // larger request bodies: 413
};

class HttpServer {
 public:
  HttpServer(Engine& engine, const ChatCodec& codec, ServerOptions options);
  ~HttpServer();
  int start();  // binds and serves on a background thread; returns the bound port (throws on failure)
  void wait();  // blocks until stop()
  void stop();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace moesrv
