// The decode loop shared by the chat and completion endpoints: prefix-cache lookup, chunked prefill,
// sample/force/mask per step via hooks, and the final state handed back to the prefix cache.
#pragma once
#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <vector>

#include "backend/engine.h"
#include "serving/prefix_cache.h"
#include "serving/sampler.h"
#include "serving/speculative.h"

namespace moesrv {

class DecodeHooks {
 public:
  virtual ~DecodeHooks() = default;
  // A token to emit without sampling (e.g. "</think>" when the reasoning budget is spent).
  virtual std::optional<int32_t> forced_token() { return std::nullopt; }
  // Allowed-token mask for the next sample (nullptr: unconstrained).
  virtual const std::vector<uint8_t>* allowed_tokens() { return nullptr; }
  // Called for each generated token (sampled or forced) with the logits it was chosen from, before on_token. The
  // span is empty when wants_logits() said false and the engine picked a greedy token itself.
  virtual void on_sampled(std::span<const float> logits, int32_t id) {}
  // Whether on_sampled needs the logits (e.g. for logprobs); if not, greedy decoding lets the engine pick the argmax
  // where the logits are (Engine::forward_argmax) and fetches them only when a mask rejects its pick.
  virtual bool wants_logits() const { return true; }
  // Called for each generated token; return false to stop (end of turn, stop string, client gone).
  virtual bool on_token(int32_t id) = 0;
  // Called between prefill chunks; return false to abandon (client gone). Default: calls prefill_ping.
  virtual bool on_prefill_progress(int64_t done, int64_t total) { return prefill_ping ? prefill_ping() : true; }
  std::function<bool()> prefill_ping;
  // Polled after every forward call (prefill chunk or token); false: the client is gone, stop now.
  std::function<bool()> client_alive;
};

struct GenerationResult {
  enum class Finish { kStopped, kLength, kCancelled } finish = Finish::kStopped;
  int64_t prompt_tokens = 0, cached_tokens = 0, completion_tokens = 0;
  double prefill_seconds = 0, decode_seconds = 0;
  SpeculativeStats speculative;  // MTP drafting (config.speculative > 0)
};

struct GeneratorConfig {
  // Tokens per forward call during prefill (cancellation and progress granularity); 0: engine.prefill_chunk().
  int64_t prefill_chunk = 0;
  // > 0: speculative decoding, the engine's MTP block drafts up to this many tokens per step (lossless). The prefix
  // cache keeps the MTP block's state beside the model's (SpeculativeSequence).
  int speculative = 0;
  // With speculative > 0: picks 0..speculative drafts per step from measured costs and acceptance (shared by the
  // requests of one server, so it keeps learning); null: always `speculative` drafts.
  std::shared_ptr<DraftPolicy> draft_policy;
};

// Runs one generation. `max_new_tokens` bounds the generated tokens (forced ones included).
GenerationResult generate(Engine& engine, PrefixCache* cache, const std::vector<int32_t>& prompt,
                          int64_t max_new_tokens, Sampler& sampler, DecodeHooks& hooks, GeneratorConfig config = {});

}  // namespace moesrv
