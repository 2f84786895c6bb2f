// `moesrv serve`: the OpenAI-compatible HTTP server (see docs/serving.md).
#include <fmt/format.h>

#include <csignal>
#include <pthread.h>
#include <thread>

#include "cli/commands.h"
#include "runtime/engine_factory.h"
#include "runtime/usage_placement.h"
#include "server/http_server.h"
#include "server/tokenizer_codec.h"
#include "server/turn_grammar.h"
#include "serving/speculative.h"
#include "util/error.h"

namespace moesrv::cli {

namespace {

struct ServeArgs {
  std::string model, tokenizer, chat_format = "auto", speculative;
  ServerOptions server;
  EngineOptions engine;
  bool save_usage = true;
};

void run_serve(ServeArgs a) {
  // Signals go to a dedicated thread (blocked everywhere else); broken connections must not kill us.
  std::signal(SIGPIPE, SIG_IGN);
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGINT);
  sigaddset(&stop_signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);

  fmt::print(stderr, "loading model from {}\n", a.model);
  a.engine.served_name = a.server.served_name;
  const SpeculativeOption speculative = parse_speculative(a.speculative);
  a.server.speculative = speculative.k;
  a.server.speculative_adaptive = speculative.adaptive;
  a.engine.mtp = a.server.speculative > 0;
  auto engine = open_engine(a.model, a.engine);
  if (a.server.speculative > 0 && !engine->mtp())
    fail("--speculative {}: {} has no MTP block on this engine (the CPU engine and the one-GPU CUDA engine run it)",
         a.speculative, a.model);
  if (a.server.max_batch > 1 && (a.server.speculative > 0 || !engine->concurrent_sequence_ops())) {
    fmt::print(stderr, "{} runs one request at a time: --max-batch {} is ignored\n",
               a.server.speculative > 0 ? "--speculative" : "this engine (a multi-GPU pipeline)", a.server.max_batch);
    a.server.max_batch = 1;
  }
  TokenizerCodec codec(a.tokenizer.empty() ? a.model : a.tokenizer, a.model, parse_chat_format(a.chat_format));
  MOESRV_CHECK(codec.vocab_size() <= engine->vocab_size(), "tokenizer vocab ({}) is larger than the model's ({})",
               codec.vocab_size(), engine->vocab_size());
  HttpServer server(*engine, codec, a.server);
  int port = server.start();
  fmt::print(
      stderr, "serving {} on http://{}:{}/v1 (context {}, reasoning budget {}, strict tools {}, tool format {})\n",
      a.server.served_name.empty() ? engine->name() : a.server.served_name, a.server.host, port,
      a.server.ctx > 0 ? std::min(a.server.ctx, engine->max_context()) : engine->max_context(),
      a.server.reasoning_budget, a.server.strict_tools ? "on" : "off", family_name(TurnMarkers::detect(codec).family));
  std::thread stopper([&] {
    int sig = 0;
    sigwait(&stop_signals, &sig);
    fmt::print(stderr, "stopping\n");
    server.stop();
  });
  stopper.detach();
  server.wait();
  if (a.save_usage) save_engine_usage(a.model, *engine);
}

}  // namespace

void add_serve_command(CLI::App& app) {
  auto a = std::make_shared<ServeArgs>();
  auto* cmd = app.add_subcommand("serve", "OpenAI-compatible HTTP server (chat/completions, completions, models)");
  cmd->add_option("--model", a->model, "Model directory")->required();
  cmd->add_option("--tokenizer", a->tokenizer, "Directory with tokenizer.json (default: the model directory)");
  cmd->add_option("--host", a->server.host, "Address to listen on")->capture_default_str();
  cmd->add_option("--port", a->server.port, "Port (0: any free port)")->capture_default_str();
  cmd->add_option("--ctx", a->server.ctx, "Context length (default: the model's maximum)");
  cmd->add_option("--reasoning-budget", a->server.reasoning_budget,
                  "Tokens of <think> before </think> is forced (0: unlimited)")->capture_default_str();
  cmd->add_flag("--strict-tools", a->server.strict_tools, "Constrain tool calls to the declared tools and schemas");
  cmd->add_option("--queue-max", a->server.queue_max, "Requests that may wait for the engine (more: HTTP 429)")->capture_default_str();
  cmd->add_option("--queue-timeout", a->server.queue_timeout_s, "Seconds a request may wait (then HTTP 503)")->capture_default_str();
  cmd->add_option("--max-batch", a->server.max_batch,
                  "Requests that generate at once, their decode steps batched and new prompts prefilled a chunk at a "
                  "time in between (1: one request at a time; CPU and one-GPU CUDA engines, not --gpus; forced to 1 "
                  "with --speculative)")
      ->capture_default_str()
      ->check(CLI::Range(1, 256));
  cmd->add_option("--state-memory-mb", a->server.state_memory_mb,
                  "Sequence state (KV cache, recurrent state) the running requests may reserve together; a request "
                  "reserves it for prompt + max_tokens at admission and waits until it fits (0: unlimited)")
      ->capture_default_str();
  cmd->add_option("--prefix-cache-mb", a->server.prefix_cache_mb, "Memory for reusable prompt prefixes (0: off)")->capture_default_str();
  cmd->add_option("--served-name", a->server.served_name, "Model id reported by the API (default: from the model)");
  cmd->add_option("--alias", a->server.aliases, "More model ids the server answers to (repeatable; others get 404)");
  cmd->add_option("--max-connections", a->server.max_connections,
                  "Open connections (a new one closes the longest-waiting idle or incomplete one; if all are busy, "
                  "it only gets /health)")
      ->capture_default_str();
  cmd->add_option("--keep-alive-timeout", a->server.keep_alive_timeout_s, "Seconds an idle connection stays open")
      ->capture_default_str();
  cmd->add_option("--read-timeout", a->server.read_timeout_s,
                  "Seconds a request's line and headers may take to arrive (and its body may pause)")
      ->capture_default_str();
  cmd->add_option("--chat-format", a->chat_format, "auto | jinja | glm45 | glm47")->capture_default_str();
  cmd->add_option("--prefill-chunk", a->server.prefill_chunk,
                  "Prompt tokens per forward call (0: the engine's pass length)")
      ->capture_default_str();
  cmd->add_option("--speculative", a->speculative,
                  "mtp:K: speculative decoding, the model's MTP block drafts up to K tokens (1-3) per step, as many "
                  "as commit the most tokens per second by the measured step costs and acceptance (none when "
                  "drafts are rarely accepted); mtp:K:fixed: always K");
  add_engine_options(cmd, a->engine);
  cmd->add_flag("!--no-usage-stats", a->save_usage,
                "Do not save routed-expert usage to <model>/.moesrv/expert_usage.json at exit (used to pin hot experts)");
  cmd->callback([a] { run_serve(*a); });
}

}  // namespace moesrv::cli
