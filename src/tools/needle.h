// Needle-in-a-haystack check: hide a fact at a chosen depth of a long filler document, ask for it back, and
// score whether the model's answer contains it. Runs against any Engine + ChatCodec.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "backend/engine.h"
#include "server/chat_codec.h"

namespace moesrv {

struct NeedleCase {
  int64_t context_tokens = 8192;  // prompt size to aim for (the rendered chat prompt stays within it)
  double depth = 0.5;             // 0 = needle at the start of the document, 1 = at the end
};

struct NeedleOptions {
  std::string needle = "The secret passphrase for the vault is amber-falcon-7319.";
  std::string question = "What is the secret passphrase for the vault? Answer with the passphrase only.";
  std::string answer_key = "amber-falcon-7319";
  int max_new_tokens = 32;
  int64_t prefill_chunk = 0;  // prompt tokens per forward call; 0: engine.prefill_chunk()
};

struct NeedlePrompt {
  std::vector<int32_t> tokens;
  int64_t needle_token_offset = 0;  // where the needle starts in `tokens`
};

struct NeedleResult {
  NeedleCase c;
  int64_t prompt_tokens = 0;
  bool found = false;
  std::string answer;
  double prefill_seconds = 0, decode_seconds = 0;
};

// Builds the chat prompt: filler paragraphs with the needle inserted at `depth`, then the question.
NeedlePrompt build_needle_prompt(const ChatCodec& codec, const NeedleCase& c, const NeedleOptions& o);

// Runs one case greedily and scores it (answer contains answer_key, case-insensitive).
NeedleResult run_needle(Engine& engine, const ChatCodec& codec, const NeedleCase& c, const NeedleOptions& o);

}  // namespace moesrv
