// Next-token sampling as OpenAI documents it: greedy at temperature 0 or top_p 0 (and top_k 1), otherwise
// temperature / top-k / top-p with a seeded RNG (the same seed and inputs give the same tokens).
// An optional mask (1 = allowed) restricts the candidates, e.g. for constrained tool-call decoding.
#pragma once
#include <cstdint>
#include <optional>
#include <random>
#include <span>
#include <vector>

namespace moesrv {

struct SamplingParams {
  float temperature = 1.0f;      // 0: greedy
  float top_p = 1.0f;            // nucleus mass kept, [0, 1]; 0: greedy
  int top_k = 0;                 // 0: all tokens
  std::optional<uint64_t> seed;  // unset: random
};

class Sampler {
 public:
  explicit Sampler(SamplingParams params);
  // Picks a token from `logits`; `allowed` (non-zero = allowed; ids past its end are not) filters first.
  // Falls back to the unmasked argmax if the mask allows nothing.
  int32_t sample(std::span<const float> logits, const std::vector<uint8_t>* allowed = nullptr);
  // Speculative decoding's acceptance rule for a deterministic draft token (its distribution q is one-hot): with p
  // the distribution sample() draws from, returns `draft` with probability min(1, p(draft) / q(draft)) = p(draft),
  // else a token drawn from norm(max(0, p - q)), i.e. p without the draft. Either way the result is distributed as
  // p. Greedy: the argmax (the draft exactly when it is the argmax).
  int32_t accept_draft(std::span<const float> logits, int32_t draft, const std::vector<uint8_t>* allowed = nullptr);
  const SamplingParams& params() const { return params_; }
  // Whether sample() returns the (masked) argmax: temperature 0, top_p 0 or top_k 1.
  bool greedy() const { return params_.temperature <= 0.0f || params_.top_p <= 0.0f || params_.top_k == 1; }

 private:
  // Fills candidates_ with (unnormalised probability, id) of the tokens sample() may draw; returns their total
  // mass, or 0 when the choice is the argmax (greedy, or no candidates).
  double distribution(std::span<const float> logits, const std::vector<uint8_t>* allowed);

  SamplingParams params_;
  std::mt19937_64 rng_;
  std::vector<std::pair<float, int32_t>> candidates_;  // reused scratch
};

int32_t argmax(std::span<const float> logits, const std::vector<uint8_t>* allowed = nullptr);

// Log-probabilities under the model's distribution (log-softmax of the raw logits, before temperature or masks):
// the chosen token's and the `top` most likely tokens' (most likely first, ties by lower id).
struct TokenLogprobs {
  float logprob = 0;
  std::vector<std::pair<int32_t, float>> top;
};
TokenLogprobs token_logprobs(std::span<const float> logits, int32_t token, int top);

}  // namespace moesrv
