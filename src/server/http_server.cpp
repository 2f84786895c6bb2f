#include "server/http_server.h"

#include <httplib.h>

#include <chrono>
#include <ctime>
#include <thread>

#include "server/api_error.h"
#include "server/chat_request.h"
#include "server/chat_turn_decoder.h"
#include "server/http_connections.h"
#include "server/metrics.h"
#include "server/openai_shapes.h"
#include "server/reasoning_store.h"
#include "server/text_decoder.h"
#include "server/turn_grammar.h"
#include "serving/batch_runner.h"
#include "serving/prefix_cache.h"
#include "serving/scheduler.h"
#include "util/error.h"

namespace moesrv {

using nlohmann::json;

namespace {

void send_json(httplib::Response& res, int status, const json& body) {
  res.status = status;
  res.set_content(body.dump(-1, ' ', false, json::error_handler_t::replace), "application/json");
}

nlohmann::ordered_json parse_body(const httplib::Request& req) {
  auto body = nlohmann::ordered_json::parse(req.body, nullptr, false);
  if (body.is_discarded()) throw bad_request("We could not parse the JSON body of your request.", "", "invalid_json");
  if (!body.is_object()) throw bad_request("The request body must be a JSON object.", "", "invalid_json");
  return body;
}

// Strings written to an SSE stream; false once the client is gone.
struct SseWriter {
  httplib::DataSink& sink;
  bool ok = true;
  bool write(const std::string& s) {
    if (ok) ok = sink.write(s.data(), s.size());
    return ok;
  }
};

}  // namespace

struct HttpServer::Impl {
  Engine& engine;
  const ChatCodec& codec;
  ServerOptions opt;
  ConnectionServer http;
  Scheduler scheduler;
  std::unique_ptr<BatchRunner> runner;  // max_batch > 1: the requests' engine calls, batched
  std::unique_ptr<PrefixCache> cache;
  std::shared_ptr<DraftPolicy> draft_policy;  // speculative decoding's drafts per step, learnt across requests
  ServerMetrics metrics;
  ReasoningStore reasoning;
  VocabText vocab;
  TurnMarkers markers;
  std::vector<uint8_t> tokenizer_ids;  // 1 for every id the tokenizer knows (the model's vocabulary may be padded)
  std::string model;
  int64_t ctx;
  std::thread thread;

  Impl(Engine& e, const ChatCodec& c, ServerOptions o)
      : engine(e),
        codec(c),
        opt(std::move(o)),
        scheduler(opt.queue_max, std::chrono::milliseconds(int64_t(opt.queue_timeout_s * 1000)), batch_size(opt, e),
                  uint64_t(opt.state_memory_mb) << 20),
        vocab(c),
        markers(TurnMarkers::detect(c)) {
    if (scheduler.max_running() > 1) runner = std::make_unique<BatchRunner>(engine, scheduler.max_running());
    if (opt.prefix_cache_mb) cache = std::make_unique<PrefixCache>(opt.prefix_cache_mb << 20);
    if (opt.speculative > 0 && opt.speculative_adaptive) draft_policy = std::make_shared<DraftPolicy>(opt.speculative);
    tokenizer_ids.assign(size_t(codec.vocab_size()), 1);
    model = opt.served_name.empty() ? engine.name() : opt.served_name;
    ctx = opt.ctx > 0 ? std::min(opt.ctx, engine.max_context()) : engine.max_context();
    routes();
  }

  // MTP speculative decoding runs one request at a time, and so does an engine whose sequence states must not be
  // touched during a forward (see Engine::concurrent_sequence_ops).
  static size_t batch_size(const ServerOptions& o, const Engine& e) {
    return o.speculative > 0 || !e.concurrent_sequence_ops() ? 1 : std::max<size_t>(1, o.max_batch);
  }

  // One generation, through the batch runner when several requests may run at once.
  GenerationResult run_generation(const std::vector<int32_t>& prompt, int64_t max_new, Sampler& sampler,
                                  DecodeHooks& hooks) {
    const GeneratorConfig config{opt.prefill_chunk, opt.speculative, draft_policy};
    if (!runner) return generate(engine, cache.get(), prompt, max_new, sampler, hooks, config);
    auto member = runner->join();
    return generate(*member, cache.get(), prompt, max_new, sampler, hooks, config);
  }

  template <class F>
  httplib::Server::Handler guarded(F f) {
    return [this, f](const httplib::Request& req, httplib::Response& res) {
      try {
        f(req, res);
      } catch (const ApiError& e) {
        fail(res, e);
      } catch (const std::exception& e) {
        fail(res, ApiError(500, e.what(), "server_error"));
      }
    };
  }

  void fail(httplib::Response& res, const ApiError& e) {
    ++metrics.errors;
    send_json(res, e.status, e.to_json());
  }

  // Waits for a running place for a request of `tokens` tokens (prompt + new), reserving its sequence state.
  std::unique_ptr<Scheduler::Slot> admit(int64_t tokens) {
    std::unique_ptr<Scheduler::Slot> slot;
    int fd = ConnectionServer::current_socket();
    const uint64_t bytes = engine.sequence_bytes(std::min(tokens, ctx));
    auto gone = [fd] { return socket_gone(fd); };
    switch (scheduler.acquire(slot, gone, std::chrono::milliseconds(50), bytes)) {
      case Scheduler::Admission::kGranted: return slot;
      case Scheduler::Admission::kTooLarge:
        throw bad_request(fmt::format("This request needs {} MiB of sequence state for {} tokens (prompt and "
                                      "max_tokens), more than the server's limit of {} MiB. Lower max_tokens.",
                                      (bytes + (1 << 20) - 1) >> 20, std::min(tokens, ctx), opt.state_memory_mb),
                          "max_tokens", "state_memory_exceeded");
      case Scheduler::Admission::kQueueFull:
        ++metrics.rejected_queue_full;
        throw ApiError(429,
                       fmt::format("The server is busy: {} requests are already queued (the limit is {}). Retry later.",
                                   scheduler.waiting(), opt.queue_max),
                       "rate_limit_error", "", "queue_full");
      case Scheduler::Admission::kTimedOut:
        ++metrics.rejected_timeout;
        throw ApiError(
            503,
            fmt::format("Timed out after {} s waiting for the model to become free. Retry later.", opt.queue_timeout_s),
            "server_error", "", "queue_timeout");
      case Scheduler::Admission::kAbandoned:
        ++metrics.cancelled;
        throw ApiError(499, "The client closed the connection while the request was queued.", "invalid_request_error",
                       "", "client_closed");
    }
    return slot;
  }

  bool known_model(const std::string& name) const {
    return name == model || std::find(opt.aliases.begin(), opt.aliases.end(), name) != opt.aliases.end();
  }
  void check_model(const std::optional<std::string>& name) const {
    if (name && !known_model(*name))
      throw ApiError(404, fmt::format("The model '{}' does not exist. This server serves '{}'.", *name, model),
                     "invalid_request_error", "model", "model_not_found");
  }
  // The prompt leaves the model inside reasoning: its last non-whitespace token opens it.
  bool ends_in_reasoning(const std::vector<int32_t>& prompt) const {
    if (markers.think_open < 0) return false;
    for (size_t i = prompt.size(); i-- > 0;) {
      int32_t t = prompt[i];
      if (t == markers.think_open) return true;
      if (codec.is_special(t)) return false;
      for (char c : vocab.bytes[size_t(t)])
        if (c != ' ' && c != '\n' && c != '\t' && c != '\r') return false;
    }
    return false;
  }

  openai::ResponseHeader header(const char* prefix) { return {openai::random_id(prefix), model, int64_t(std::time(nullptr))}; }

  int64_t budget_new_tokens(int64_t prompt_len, const GenerationOptions& g) {
    if (prompt_len >= ctx)
      throw bad_request(fmt::format("This model's maximum context length is {} tokens. However, your messages resulted in {} tokens.",
                                    ctx, prompt_len), "messages", "context_length_exceeded");
    int64_t room = ctx - prompt_len;
    return g.max_tokens ? std::min(*g.max_tokens, room) : room;
  }

  void account(const GenerationResult& r, int64_t reasoning_tokens) {
    metrics.prompt_tokens += uint64_t(r.prompt_tokens);
    metrics.completion_tokens += uint64_t(r.completion_tokens);
    metrics.cached_tokens += uint64_t(r.cached_tokens);
    metrics.reasoning_tokens += uint64_t(reasoning_tokens);
    metrics.speculative_steps += uint64_t(r.speculative.steps);
    metrics.speculative_drafted += uint64_t(r.speculative.drafted);
    metrics.speculative_accepted += uint64_t(r.speculative.accepted);
    metrics.speculative_plain += uint64_t(r.speculative.plain);
    if (draft_policy) metrics.speculative_draft_choice = draft_policy->choice();
    if (r.finish == GenerationResult::Finish::kCancelled) ++metrics.cancelled;
    metrics.record_timing(uint64_t(r.prompt_tokens - r.cached_tokens), r.prefill_seconds, uint64_t(r.completion_tokens),
                          r.decode_seconds);
  }

  // ---- /v1/chat/completions ----
  struct ChatJob {
    ChatCompletionRequest req;
    std::vector<int32_t> prompt;
    int64_t max_new = 0;
    bool start_in_reasoning = false;
    int socket = -1;
    std::unique_ptr<Scheduler::Slot> slot;
    openai::ResponseHeader head;
  };

  struct ChatOutcome {
    GenerationResult gen;
    std::string finish_reason;
    openai::Usage usage;
    bool cancelled = false;
  };

  ChatOutcome run_chat(ChatJob& job, ChatTurnDecoder& dec) {
    Sampler sampler(job.req.gen.sampling);
    ChatOutcome out;
    int fd = job.socket;
    dec.client_alive = [fd] { return !socket_gone(fd); };
    out.gen = run_generation(job.prompt, job.max_new, sampler, dec);
    dec.finish();
    out.cancelled = dec.cancelled() || out.gen.finish == GenerationResult::Finish::kCancelled;
    if (out.cancelled) out.gen.finish = GenerationResult::Finish::kCancelled;
    auto calls = dec.complete_calls();
    bool truncated = out.gen.finish == GenerationResult::Finish::kLength && !dec.stop_hit();
    out.finish_reason = truncated ? "length" : !calls.empty() && !dec.stop_hit() ? "tool_calls" : "stop";
    out.usage = {out.gen.prompt_tokens, out.gen.completion_tokens, out.gen.cached_tokens, dec.reasoning_tokens()};
    account(out.gen, dec.reasoning_tokens());
    if (dec.budget_forced()) ++metrics.reasoning_budget_forced;
    if (!calls.empty()) reasoning.remember(dec.content(), calls, dec.parser().reasoning());
    return out;
  }

  ChatTurnConfig turn_config(const ChatJob& job) {
    return {opt.reasoning_budget, opt.strict_tools, job.start_in_reasoning, job.max_new};
  }

  void handle_chat(const httplib::Request& http_req, httplib::Response& res) {
    ++metrics.requests;
    auto job = std::make_shared<ChatJob>();
    job->req = parse_chat_request(parse_body(http_req));
    check_model(job->req.model);
    job->socket = ConnectionServer::current_socket();
    metrics.reasoning_reattached += uint64_t(reasoning.reattach(job->req.messages, opt.reattach_turns));
    // Tools stay in the prompt even for tool_choice "none" (the <tool_call> token is masked instead), so the
    // prompt prefix — and the prefix cache — is the same as for the agent's other turns.
    const auto& tools = job->req.tools;
    std::string text;
    try {
      text = codec.render_chat(job->req.messages, tools, job->req.template_kwargs);
    } catch (const std::exception& e) {
      throw bad_request(std::string("could not apply the chat template: ") + e.what(), "messages");
    }
    job->prompt = codec.encode(text);
    if (job->prompt.empty()) throw bad_request("the prompt is empty", "messages");
    job->max_new = budget_new_tokens(int64_t(job->prompt.size()), job->req.gen);
    job->start_in_reasoning = ends_in_reasoning(job->prompt);
    job->head = header("chatcmpl-");
    job->slot = admit(int64_t(job->prompt.size()) + job->max_new);

    if (!job->req.gen.stream) {
      ChatTurnDecoder dec(codec, vocab, markers, job->req, turn_config(*job), [](const ChatDelta&) { return true; });
      ChatOutcome out = run_chat(*job, dec);
      job->slot.reset();
      if (out.cancelled)
        throw ApiError(499, "The client closed the connection.", "invalid_request_error", "", "client_closed");
      json msg = openai::chat_message(dec.content(), dec.parser().reasoning(), dec.complete_calls());
      json lp = job->req.logprobs.enabled ? json(dec.logprobs()) : json(nullptr);
      send_json(res, 200, openai::chat_completion(job->head, msg, out.finish_reason, out.usage, lp));
      return;
    }
    res.set_header("Cache-Control", "no-cache");
    res.set_header("X-Accel-Buffering", "no");
    res.set_chunked_content_provider("text/event-stream", [this, job](size_t, httplib::DataSink& sink) {
      bool ok = stream_chat(*job, sink);
      job->slot.reset();  // free the engine before the connection is torn down
      return ok;
    });
  }

  bool stream_chat(ChatJob& job, httplib::DataSink& sink) {
    SseWriter w{sink};
    bool usage_field = job.req.gen.include_usage;
    w.write(openai::sse(openai::chat_chunk(job.head, {{"role", "assistant"}, {"content", ""}}, nullptr, usage_field)));
    ChatTurnDecoder dec(codec, vocab, markers, job.req, turn_config(job), [&](const ChatDelta& d) {
      return w.write(
          openai::sse(openai::chat_chunk(job.head, openai::chat_delta(d), nullptr, usage_field, d.logprobs)));
    });
    dec.prefill_ping = [&] { return w.write(": prefill\n\n"); };
    try {
      ChatOutcome out = run_chat(job, dec);
      if (out.cancelled || !w.ok) return false;
      w.write(openai::sse(openai::chat_chunk(job.head, json::object(), out.finish_reason, usage_field)));
      if (usage_field) {
        json last = openai::chat_chunk(job.head, json::object(), nullptr, true);
        last["choices"] = json::array();
        last["usage"] = out.usage.to_json();
        w.write(openai::sse(last));
      }
    } catch (const std::exception& e) {
      ++metrics.errors;
      w.write(openai::sse(ApiError(500, e.what(), "server_error").to_json()));
    }
    w.write("data: [DONE]\n\n");
    if (w.ok) sink.done();
    return w.ok;
  }

  // ---- /v1/completions ----
  struct TextJob {
    CompletionRequest req;
    std::vector<int32_t> prompt;
    int64_t max_new = 0;
    int socket = -1;
    std::unique_ptr<Scheduler::Slot> slot;
    openai::ResponseHeader head;
  };

  openai::Usage run_text(TextJob& job, TextDecoder& dec, std::string& finish_reason) {
    Sampler sampler(job.req.gen.sampling);
    if (engine.vocab_size() > codec.vocab_size()) dec.restrict_to(&tokenizer_ids);
    int fd = job.socket;
    dec.client_alive = [fd] { return !socket_gone(fd); };
    GenerationResult r = run_generation(job.prompt, job.max_new, sampler, dec);
    dec.finish();
    if (dec.cancelled()) r.finish = GenerationResult::Finish::kCancelled;
    if (r.finish == GenerationResult::Finish::kCancelled && !dec.cancelled()) dec.cancel();
    finish_reason = r.finish == GenerationResult::Finish::kLength && !dec.stop_hit() ? "length" : "stop";
    account(r, 0);
    return {r.prompt_tokens, r.completion_tokens, r.cached_tokens, 0};
  }

  void handle_completion(const httplib::Request& http_req, httplib::Response& res) {
    ++metrics.requests;
    auto job = std::make_shared<TextJob>();
    job->req = parse_completion_request(parse_body(http_req));
    check_model(job->req.model);
    job->socket = ConnectionServer::current_socket();
    if (job->req.prompt_text) {
      job->prompt = codec.encode(*job->req.prompt_text);
    } else {
      job->prompt = job->req.prompt_ids;
      for (int32_t t : job->prompt)
        if (t >= engine.vocab_size()) throw bad_request(fmt::format("token id {} is out of range", t), "prompt");
    }
    if (job->prompt.empty()) throw bad_request("the prompt is empty", "prompt");
    job->max_new = budget_new_tokens(int64_t(job->prompt.size()), job->req.gen);
    if (!job->req.gen.max_tokens) job->max_new = std::min<int64_t>(job->max_new, 16);  // OpenAI default
    job->head = header("cmpl-");
    job->slot = admit(int64_t(job->prompt.size()) + job->max_new);

    int lp = job->req.logprobs.enabled ? job->req.logprobs.top : -1;
    if (!job->req.gen.stream) {
      TextDecoder dec(
          codec, job->req.gen.stop, [](const std::string&, const json&) { return true; }, lp);
      std::string finish;
      openai::Usage u = run_text(*job, dec, finish);
      job->slot.reset();
      if (dec.cancelled())
        throw ApiError(499, "The client closed the connection.", "invalid_request_error", "", "client_closed");
      json lps = lp >= 0 ? dec.logprobs().to_json() : json(nullptr);
      send_json(res, 200,
                openai::text_completion(job->head, openai::text_choice(dec.text(), finish, lps), u.to_json()));
      return;
    }
    res.set_header("Cache-Control", "no-cache");
    res.set_chunked_content_provider("text/event-stream", [this, job, lp](size_t, httplib::DataSink& sink) {
      SseWriter w{sink};
      bool usage_field = job->req.gen.include_usage;
      TextDecoder dec(
          codec, job->req.gen.stop,
          [&](const std::string& s, const json& lps) {
            return w.write(
                openai::sse(openai::text_completion(job->head, openai::text_choice(s, nullptr, lps), json())));
          },
          lp);
      dec.prefill_ping = [&] { return w.write(": prefill\n\n"); };
      try {
        std::string finish;
        openai::Usage u = run_text(*job, dec, finish);
        if (dec.cancelled() || !w.ok) return job->slot.reset(), false;
        w.write(openai::sse(openai::text_completion(job->head, openai::text_choice("", finish), nullptr)));
        if (usage_field) {
          json last = openai::text_completion(job->head, json(), u.to_json());
          last["choices"] = json::array();
          w.write(openai::sse(last));
        }
      } catch (const std::exception& e) {
        ++metrics.errors;
        w.write(openai::sse(ApiError(500, e.what(), "server_error").to_json()));
      }
      job->slot.reset();
      w.write("data: [DONE]\n\n");
      if (w.ok) sink.done();
      return w.ok;
    });
  }

  json model_object(const std::string& id) const {
    return {{"id", id}, {"object", "model"}, {"created", 0}, {"owned_by", "moesrv"}, {"max_model_len", ctx}};
  }

  void routes() {
    http.Post("/v1/chat/completions", guarded([this](auto& q, auto& r) { handle_chat(q, r); }));
    http.Post("/v1/completions", guarded([this](auto& q, auto& r) { handle_completion(q, r); }));
    http.Post("/chat/completions", guarded([this](auto& q, auto& r) { handle_chat(q, r); }));
    http.Get("/v1/models", guarded([this](auto&, auto& r) {
               json data = json::array({model_object(model)});
               for (auto& a : opt.aliases) data.push_back(model_object(a));
               send_json(r, 200, {{"object", "list"}, {"data", data}});
             }));
    http.Get(R"(/v1/models/(.+))", guarded([this](auto& q, auto& r) {
               std::string id = q.matches[1].str();
               check_model(id);
               send_json(r, 200, model_object(id));
             }));
    http.Get("/health", guarded([this](auto&, auto& r) {
      send_json(r, 200, {{"status", "ok"}, {"model", model}, {"busy", scheduler.busy()}, {"queued", scheduler.waiting()}});
    }));
    http.Get("/metrics", guarded([this](auto&, auto& r) {
               ServerMetrics::Gauges g{scheduler.waiting(), scheduler.busy(), cache ? cache->bytes() : 0,
                                       cache ? cache->entries() : 0};
               g.running = scheduler.running();
               g.max_running = scheduler.max_running();
               g.reserved_state_bytes = scheduler.reserved_bytes();
               if (runner) g.batch_steps = runner->stats().decode_steps, g.batch_rows = runner->stats().decode_rows;
               r.set_content(metrics.render(g), "text/plain; version=0.0.4");
             }));
    size_t max_body = opt.max_body_mb << 20;
    http.set_error_handler([max_body](const httplib::Request& q, httplib::Response& r) {
      if (!r.body.empty()) return;
      std::string message = "request failed", code;
      if (r.status == 404) message = fmt::format("Unknown endpoint {} {}", q.method, q.path), code = "unknown_url";
      if (r.status == 413) {
        std::string len = q.get_header_value("Content-Length");
        message = len.empty() ? fmt::format("The request body exceeds the limit of {} bytes ({} MiB).", max_body,
                                            max_body >> 20)
                              : fmt::format("The request body is {} bytes; the limit is {} bytes ({} MiB).", len,
                                            max_body, max_body >> 20);
        code = "request_too_large";
      }
      ApiError e(r.status, message, "invalid_request_error", "", code);
      r.set_content(e.to_json().dump(), "application/json");
    });
    // Beyond max_connections a connection gets /health and nothing else.
    http.set_pre_routing_handler([this](const httplib::Request& q, httplib::Response& r) {
      if (!ConnectionServer::current_over_limit() || q.path == "/health")
        return httplib::Server::HandlerResponse::Unhandled;
      ApiError e(503, fmt::format("Too many open connections (the limit is {}). Retry later.", opt.max_connections),
                 "server_error", "", "too_many_connections");
      send_json(r, 503, e.to_json());
      return httplib::Server::HandlerResponse::Handled;
    });
    http.limits.max_connections = std::max<size_t>(opt.max_connections, 1);
    http.limits.keep_alive_ms = int(opt.keep_alive_timeout_s * 1000);
    http.limits.read_ms = int(opt.read_timeout_s * 1000);
    http.limits.max_body = max_body;
    http.set_payload_max_length(max_body);
  }
};

HttpServer::HttpServer(Engine& engine, const ChatCodec& codec, ServerOptions options)
    : impl_(std::make_unique<Impl>(engine, codec, std::move(options))) {}

HttpServer::~HttpServer() { stop(); }

int HttpServer::start() {
  int port = impl_->opt.port;
  if (port == 0) {
    port = impl_->http.bind_to_any_port(impl_->opt.host);
    MOESRV_CHECK(port > 0, "cannot bind to {}", impl_->opt.host);
  } else {
    MOESRV_CHECK(impl_->http.bind_to_port(impl_->opt.host, port), "cannot listen on {}:{}", impl_->opt.host, port);
  }
  impl_->http.widen_backlog();
  impl_->thread = std::thread([this] { impl_->http.listen_after_bind(); });
  for (int i = 0; i < 5000 && !impl_->http.is_running(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  MOESRV_CHECK(impl_->http.is_running(), "the HTTP server did not start");
  return port;
}

void HttpServer::wait() {
  if (impl_->thread.joinable()) impl_->thread.join();
}

void HttpServer::stop() {
  if (!impl_) return;
  impl_->http.stop();
  wait();
}

}  // namespace moesrv
