// Continuous batching (--max-batch > 1) with the real pieces: the CPU engine on hf-tiny models and the tiny GLM
// tokenizer. Requests that run together give exactly what each gives alone (on a --max-batch 1 server without a
// prefix cache); a client that leaves stops only its own generation; /metrics shows the running and waiting
// sequences; admission reserves each request's sequence state. Plus the Scheduler's batch admission alone.
#include <gtest/gtest.h>
#include <httplib.h>

#include <csignal>
#include <filesystem>
#include <future>
#include <thread>

#include "backend/cpu/cpu_engine.h"
#include "server/http_server.h"
#include "server/tokenizer_codec.h"
#include "server_test_client.h"
#include "server_test_node.h"
#include "serving/scheduler.h"

using namespace moesrv;
using namespace moesrv::testing;
using nlohmann::json;
namespace fs = std::filesystem;
using namespace std::chrono_literals;

namespace {

const std::string kTokenizer = std::string(MOESRV_SOURCE_DIR) + "/tests/fixtures/server/tiny_glm_tokenizer";
std::string model_dir(const std::string& m) { return std::string(MOESRV_TESTDATA) + "/hf-tiny/" + m; }

// A server over `engine` for the test's lifetime.
struct Served {
  Served(Engine& engine, const ChatCodec& codec, ServerOptions opt) : server(engine, codec, with_port(opt)) {
    port = server.start();
  }
  static ServerOptions with_port(ServerOptions o) {
    o.port = 0;
    return o;
  }
  httplib::Client client(time_t read_s = 300) const {
    httplib::Client c("127.0.0.1", port);
    c.set_read_timeout(read_s, 0);
    return c;
  }
  json post(const std::string& path, const json& body, int* status = nullptr) const {
    auto c = client();
    auto res = c.Post(path, body.dump(), "application/json");
    if (!res) return {{"transport_error", true}};
    if (status) *status = res->status;
    return json::parse(res->body);
  }
  // The value of a metric line "name value" on /metrics (-1: absent).
  double metric(const std::string& name) const {
    auto c = client();
    auto res = c.Get("/metrics");
    if (!res) return -1;
    const std::string& b = res->body;
    for (size_t at = b.find(name + " "); at != std::string::npos; at = b.find(name + " ", at + 1))
      if (at == 0 || b[at - 1] == '\n') return std::stod(b.substr(at + name.size() + 1));
    return -1;
  }
  // Polls `name` until it reads `value` on 5 reads in a row, 5 ms apart (a streamed answer's slot is freed just
  // after its last bytes), or 10 s; returns its last read.
  double settle(const std::string& name, double value) const {
    int in_a_row = 0;
    for (auto t0 = std::chrono::steady_clock::now(); std::chrono::steady_clock::now() - t0 < 10s;) {
      in_a_row = metric(name) == value ? in_a_row + 1 : 0;
      if (in_a_row == 5) break;
      std::this_thread::sleep_for(5ms);
    }
    return metric(name);
  }
  HttpServer server;
  int port = 0;
};

// A deterministic token-id prompt of `n` ids below 1000 (every hf-tiny vocabulary has 1024).
std::vector<int32_t> id_prompt(size_t n, int salt) {
  std::vector<int32_t> p(n);
  for (size_t i = 0; i < n; ++i) p[i] = int32_t((i * 131 + size_t(salt) * 977 + 7) % 1000);
  return p;
}

json completion(const std::vector<int32_t>& prompt, int max_tokens) {
  return {{"prompt", prompt}, {"max_tokens", max_tokens}, {"temperature", 0}, {"logprobs", 1}};
}

json chat(const std::string& text, int max_tokens, bool stream) {
  return {{"messages", {{{"role", "user"}, {"content", text}}}},
          {"max_tokens", max_tokens},
          {"temperature", 0},
          {"stream", stream},
          {"response_format", {{"type", "json_object"}}}};
}

// What a request produced, comparable between servers: text and logprobs, or the chat message (joined deltas
// when streamed), and the finish reason.
json outcome(const Served& s, const std::string& path, const json& body) {
  if (body.value("stream", false)) {
    auto c = s.client();
    auto r = post_stream(c, path, body);
    std::string finish;
    json msg = join_chat_deltas(r.events, &finish);
    return {{"status", r.status}, {"message", msg}, {"finish", finish}, {"done", r.done}};
  }
  int status = 0;
  json r = s.post(path, body, &status);
  if (status != 200) return {{"status", status}, {"body", r}};
  json ch = r["choices"][0];
  ch.erase("index");
  return {{"status", status}, {"choice", ch}, {"completion_tokens", r["usage"]["completion_tokens"]}};
}

// Test doubles for the long requests of the cancellation and gauge tests, so that they outlast their clients: the
// codec names no end-of-turn token (a completion runs to max_tokens), the engine pauses before each call (the real
// engine's results, later).
struct EndlessCodec : ChatCodec {
  explicit EndlessCodec(const ChatCodec& c) : inner(c) {}
  int64_t vocab_size() const override { return inner.vocab_size(); }
  std::vector<int32_t> encode(const std::string& text) const override { return inner.encode(text); }
  std::string token_bytes(int32_t id) const override { return inner.token_bytes(id); }
  bool is_special(int32_t id) const override { return inner.is_special(id); }
  std::optional<int32_t> special_id(const std::string& text) const override { return inner.special_id(text); }
  std::vector<int32_t> end_of_turn_ids() const override { return {}; }
  std::string render_chat(const nlohmann::ordered_json& m, const nlohmann::ordered_json& t,
                          const nlohmann::ordered_json& k) const override {
    return inner.render_chat(m, t, k);
  }
  const ChatCodec& inner;
};

struct PacedEngine : Engine {
  explicit PacedEngine(Engine& e) : inner(e) {}
  std::string name() const override { return inner.name(); }
  int64_t vocab_size() const override { return inner.vocab_size(); }
  int64_t max_context() const override { return inner.max_context(); }
  std::unique_ptr<SequenceState> new_sequence() const override { return inner.new_sequence(); }
  uint64_t sequence_bytes(int64_t tokens) const override { return inner.sequence_bytes(tokens); }
  bool concurrent_sequence_ops() const override { return concurrent; }
  std::vector<float> forward(SequenceState& seq, const std::vector<int32_t>& tokens, bool all_logits) override {
    std::this_thread::sleep_for(1ms);
    return inner.forward(seq, tokens, all_logits);
  }
  std::vector<std::vector<float>> forward_batch(const std::vector<SequenceState*>& seqs,
                                                const std::vector<int32_t>& tokens) override {
    std::this_thread::sleep_for(1ms);
    return inner.forward_batch(seqs, tokens);
  }
  Engine& inner;
  bool concurrent = true;
};

struct Request {
  std::string path;
  json body;
};

class ServerBatch : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    std::signal(SIGPIPE, SIG_IGN);
    if (!fs::exists(model_dir(GetParam()) + "/model.safetensors")) MOESRV_E2E_SKIP("no hf-tiny " << GetParam());
    engine = CpuEngine::open(model_dir(GetParam()));
    codec = std::make_unique<TokenizerCodec>(kTokenizer, model_dir(GetParam()));
  }
  // Each request alone on a server that runs one at a time, without a prefix cache unless `warm` requests fill it
  // first (prompts in calls of `prefill_chunk` tokens, as on the batch server: a recurrent state's chunked prefill
  // rounds per chunk, so a cold run and one resumed from a cached prefix differ in the last bits).
  std::vector<json> alone(Engine& e, const ChatCodec& c, const std::vector<Request>& reqs, int64_t prefill_chunk = 0,
                          const std::vector<Request>& warm = {}) {
    Served single(e, c, {.prefix_cache_mb = warm.empty() ? size_t(0) : size_t(64), .prefill_chunk = prefill_chunk});
    for (const auto& r : warm) outcome(single, r.path, r.body);
    std::vector<json> out;
    for (const auto& r : reqs) out.push_back(outcome(single, r.path, r.body));
    return out;
  }
  std::unique_ptr<CpuEngine> engine;
  std::unique_ptr<TokenizerCodec> codec;
};

std::vector<json> concurrently(const Served& s, const std::vector<Request>& reqs) {
  std::vector<std::future<json>> running;
  for (const auto& r : reqs)
    running.push_back(std::async(std::launch::async, [&] { return outcome(s, r.path, r.body); }));
  std::vector<json> out;
  for (auto& f : running) out.push_back(f.get());
  return out;
}

// B = 2, 3, 4 greedy requests at once (completions with logprobs; chat, streamed or not, under a JSON grammar) give
// what each gives alone, token for token and logprob for logprob. Prompts are prefilled in 16-token chunks between
// the others' decode steps; later rounds repeat earlier prompts, so their sequences fork from prefix-cache entries.
TEST_P(ServerBatch, ConcurrentRequestsMatchEachAlone) {
  const std::vector<Request> reqs = {
      {"/v1/completions", completion(id_prompt(7, 1), 40)},
      {"/v1/completions", completion(id_prompt(45, 2), 24)},
      {"/v1/chat/completions", chat("Give me a JSON object.", 32, true)},
      {"/v1/completions", completion(id_prompt(90, 3), 32)},
      {"/v1/chat/completions", chat("Another one, please.", 28, false)},
  };
  const std::vector<json> want = alone(*engine, *codec, reqs, 16);
  for (const json& w : want) ASSERT_EQ(w["status"], 200) << w.dump();

  Served batch(*engine, *codec, {.max_batch = 4, .prefill_chunk = 16});
  for (size_t n : {size_t(2), size_t(3), size_t(4), size_t(5)}) {
    // n = 5: one more than --max-batch, so one request queues and joins when a place frees.
    const std::vector<Request> round(reqs.begin(), reqs.begin() + long(n));
    const std::vector<json> got = concurrently(batch, round);
    for (size_t i = 0; i < n; ++i) EXPECT_EQ(got[i], want[i]) << "request " << i << " of " << n;
  }
  EXPECT_GT(batch.metric("moesrv_prefix_cache_hit_tokens_total"), 0);
  const double steps = batch.metric("moesrv_batch_decode_steps_total");
  const double rows = batch.metric("moesrv_batch_decode_rows_total");
  EXPECT_GT(steps, 0);
  EXPECT_GT(rows, steps) << "no decode step ran more than one sequence";
  EXPECT_EQ(batch.settle("moesrv_sequences_running", 0), 0);
  EXPECT_EQ(batch.metric("moesrv_max_batch"), 4);
}

// Two requests at once that extend one cached prompt each fork their own sequence from the cached entry (a clone
// each, resumed at the cached prompt's end) and continue as each does alone after the same cached prompt.
TEST_P(ServerBatch, ConcurrentForksOfACachedPrefixMatchAlone) {
  const std::vector<int32_t> base = id_prompt(40, 7);
  auto extended = [&](size_t n, int salt) {
    std::vector<int32_t> p = base;
    for (int32_t t : id_prompt(n, salt)) p.push_back(t);
    return p;
  };
  const std::vector<Request> forks = {{"/v1/completions", completion(extended(9, 8), 20)},
                                      {"/v1/completions", completion(extended(13, 9), 24)}};
  const Request warm{"/v1/completions", completion(base, 6)};  // caches base (+ its answer)
  const std::vector<json> want = alone(*engine, *codec, forks, 16, {warm});
  Served batch(*engine, *codec, {.max_batch = 4, .prefill_chunk = 16});
  ASSERT_EQ(outcome(batch, warm.path, warm.body)["status"], 200);
  std::vector<std::future<json>> running;
  for (const auto& r : forks)
    running.push_back(std::async(std::launch::async, [&] { return batch.post(r.path, r.body); }));
  for (size_t i = 0; i < forks.size(); ++i) {
    json r = running[i].get();
    EXPECT_GE(r["usage"]["prompt_tokens_details"]["cached_tokens"].get<int64_t>(), int64_t(base.size())) << r.dump();
    json ch = r["choices"][0];
    ch.erase("index");
    EXPECT_EQ(ch, want[i]["choice"]) << "fork " << i;
  }
}

// A client that hangs up mid-generation stops its own request only: the others finish as they would alone.
TEST_P(ServerBatch, ACancelledRequestLeavesTheOthersIdentical) {
  const std::vector<Request> reqs = {
      {"/v1/completions", completion(id_prompt(20, 4), 160)},
      {"/v1/chat/completions", chat("Keep going.", 120, true)},
  };
  PacedEngine paced(*engine);
  EndlessCodec endless(*codec);
  const std::vector<json> want = alone(paced, endless, reqs);
  Served batch(paced, endless, {.max_batch = 3});
  auto leaver = std::async(std::launch::async, [&] {
    auto c = batch.client();
    c.set_read_timeout(0, 300000);  // gives up after 0.3 s and closes the connection
    return bool(c.Post("/v1/completions", completion(id_prompt(33, 5), 3000).dump(), "application/json"));
  });
  std::this_thread::sleep_for(50ms);
  const std::vector<json> got = concurrently(batch, reqs);
  EXPECT_FALSE(leaver.get());
  for (size_t i = 0; i < reqs.size(); ++i) EXPECT_EQ(got[i], want[i]) << "request " << i;
  EXPECT_EQ(batch.settle("moesrv_sequences_running", 0), 0);
  EXPECT_EQ(batch.metric("moesrv_requests_cancelled_total"), 1);
}

INSTANTIATE_TEST_SUITE_P(Models, ServerBatch, ::testing::Values("deepseek_v3", "glm5_next", "qwen3_next"));

// /metrics: with --max-batch 2 and three long requests, two run and one waits; all gone once the clients leave.
TEST(ServerBatchGauges, RunningAndWaitingSequences) {
  std::signal(SIGPIPE, SIG_IGN);
  const std::string dir = model_dir("deepseek_v3");
  if (!fs::exists(dir + "/model.safetensors")) MOESRV_E2E_SKIP("no hf-tiny deepseek_v3");
  auto engine = CpuEngine::open(dir);
  PacedEngine paced(*engine);
  TokenizerCodec codec(kTokenizer, dir);
  EndlessCodec endless(codec);
  Served batch(paced, endless, {.max_batch = 2});
  std::vector<std::future<bool>> clients;
  for (int i = 0; i < 3; ++i)
    clients.push_back(std::async(std::launch::async, [&, i] {
      auto c = batch.client();
      c.set_read_timeout(1, 500000);  // leaves after 1.5 s
      return bool(c.Post("/v1/completions", completion(id_prompt(10, 10 + i), 4000).dump(), "application/json"));
    }));
  bool seen = false;
  for (auto t0 = std::chrono::steady_clock::now(); !seen && std::chrono::steady_clock::now() - t0 < 1200ms;) {
    seen = batch.metric("moesrv_sequences_running") == 2 && batch.metric("moesrv_sequences_waiting") == 1;
    std::this_thread::sleep_for(5ms);
  }
  EXPECT_TRUE(seen) << "never saw 2 running and 1 waiting";
  EXPECT_GT(batch.metric("moesrv_reserved_state_bytes"), 0);
  for (auto& c : clients) EXPECT_FALSE(c.get());
  // The waiting request first: until it leaves the queue, freed slots may admit it (running 0 -> 1 -> 0).
  EXPECT_EQ(batch.settle("moesrv_sequences_waiting", 0), 0);
  EXPECT_EQ(batch.settle("moesrv_sequences_running", 0), 0);
  EXPECT_EQ(batch.metric("moesrv_reserved_state_bytes"), 0);
}

// An engine whose sequence states must not be touched during a forward (a device engine today) runs one request
// at a time whatever --max-batch says.
TEST(ServerBatchGauges, AnEngineWithoutConcurrentSequenceOpsRunsOneAtATime) {
  const std::string dir = model_dir("deepseek_v3");
  if (!fs::exists(dir + "/model.safetensors")) MOESRV_E2E_SKIP("no hf-tiny deepseek_v3");
  auto engine = CpuEngine::open(dir);
  PacedEngine device_like(*engine);
  device_like.concurrent = false;
  TokenizerCodec codec(kTokenizer, dir);
  Served batch(device_like, codec, {.max_batch = 4});
  EXPECT_EQ(batch.metric("moesrv_max_batch"), 1);
  Served cpu(*engine, codec, {.max_batch = 4});
  EXPECT_EQ(cpu.metric("moesrv_max_batch"), 4);
}

// A request whose state (prompt + max_tokens) exceeds --state-memory-mb alone is refused with a clear error; a
// smaller one runs.
TEST(ServerBatchGauges, StateBudgetRefusesARequestThatCannotFit) {
  std::signal(SIGPIPE, SIG_IGN);
  const std::string dir = model_dir("deepseek_v3");
  if (!fs::exists(dir + "/model.safetensors")) MOESRV_E2E_SKIP("no hf-tiny deepseek_v3");
  auto engine = CpuEngine::open(dir);
  TokenizerCodec codec(kTokenizer, dir);
  ASSERT_GT(engine->sequence_bytes(4000), uint64_t(1) << 20);  // the whole context does not fit 1 MiB
  ASSERT_LT(engine->sequence_bytes(200), uint64_t(1) << 20);
  Served batch(*engine, codec, {.max_batch = 2, .state_memory_mb = 1});
  int status = 0;
  json r = batch.post("/v1/completions", completion(id_prompt(10, 1), 3900), &status);
  EXPECT_EQ(status, 400) << r.dump();
  EXPECT_EQ(r["error"]["code"], "state_memory_exceeded");
  r = batch.post("/v1/completions", completion(id_prompt(10, 1), 8), &status);
  EXPECT_EQ(status, 200) << r.dump();
}

// The Scheduler alone: max_running places, a state budget that queues what does not fit yet, FIFO order.
TEST(SchedulerBatch, PlacesAndStateBudget) {
  Scheduler s(4, 2000ms, 2, 100);
  std::unique_ptr<Scheduler::Slot> a, b, c, d;
  EXPECT_EQ(s.acquire(a, nullptr, 50ms, 40), Scheduler::Admission::kGranted);
  EXPECT_EQ(s.acquire(b, nullptr, 50ms, 40), Scheduler::Admission::kGranted);
  EXPECT_EQ(s.running(), 2u);
  EXPECT_EQ(s.reserved_bytes(), 80u);
  EXPECT_EQ(s.acquire(d, nullptr, 50ms, 101), Scheduler::Admission::kTooLarge);
  // Places are full: c waits until one frees; then 40 + 60 fits the budget.
  auto waiter = std::async(std::launch::async, [&] { return s.acquire(c, nullptr, 50ms, 60); });
  std::this_thread::sleep_for(50ms);
  EXPECT_EQ(s.waiting(), 1u);
  a.reset();
  EXPECT_EQ(waiter.get(), Scheduler::Admission::kGranted);
  EXPECT_EQ(s.reserved_bytes(), 100u);
  // A place is free but the budget is not: d waits for bytes, not places.
  b.reset();
  EXPECT_EQ(s.running(), 1u);
  auto bytes_waiter = std::async(std::launch::async, [&] { return s.acquire(d, nullptr, 50ms, 50); });
  std::this_thread::sleep_for(50ms);
  EXPECT_EQ(s.waiting(), 1u);
  c.reset();
  EXPECT_EQ(bytes_waiter.get(), Scheduler::Admission::kGranted);
  EXPECT_EQ(s.reserved_bytes(), 50u);
  d.reset();
  EXPECT_EQ(s.running(), 0u);
  EXPECT_EQ(s.reserved_bytes(), 0u);
}

}  // namespace
