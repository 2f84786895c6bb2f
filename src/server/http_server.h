// The OpenAI-compatible HTTP server: /v1/chat/completions, /v1/completions, /v1/models, /health, /metrics.
// One request uses the engine at a time (Scheduler); the rest queue. Start on port 0 for an ephemeral port.
#pragma once
#include <cstdint>
#include <memory>
#include <string>

#include "runtime/engine.h"
#include "server/chat_codec.h"

namespace moesrv {

struct ServerOptions {
  std::string host = "127.0.0.1";
  int port = 8080;
  int64_t ctx = 0;                  // 0: the engine's max_context()
  int64_t reasoning_budget = 4096;  // tokens inside <think> before "</think>" is forced; 0: unlimited
  bool strict_tools = false;
  size_t queue_max = 16;            // waiting requests beyond the running one
  double queue_timeout_s = 600;
  size_t prefix_cache_mb = 4096;    // 0: off
  std::string served_name;          // "": the engine's name()
  int64_t prefill_chunk = 512;
  int reattach_turns = 4;           // re-attach dropped reasoning on this many last tool-calling turns
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
