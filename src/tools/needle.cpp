#include "tools/needle.h"

#include <algorithm>
#include <chrono>
#include <nlohmann/json.hpp>

#include "serving/sampler.h"
#include "util/error.h"

namespace moesrv {

namespace {

// Varied, neutral filler so the needle is not trivially the only distinct sentence.
const char* const kFiller[] = {
    "The river town kept its ledgers in a stone building by the bridge, and every spring the clerks copied "
    "the old entries into fresh books before the floods could reach the lower shelves.",
    "Early railway timetables were printed weekly, and travellers learned to read the small marks that "
    "showed which trains waited for the mail coach and which left on the minute.",
    "In the orchard the pruning began after the first frost; the gardeners cut back the water shoots and "
    "tied the strongest branches to wires so the fruit would ripen in the sun.",
    "A lighthouse keeper's log recorded wind, visibility and passing ships, and a careful keeper could tell "
    "from the entries alone which winters had been the hardest on the coast.",
    "The library's card catalogue filled three rooms; readers wrote requests on slips that travelled by "
    "pneumatic tube to the stacks, where porters fetched the volumes on trolleys.",
    "Bakers in the old quarter started work at three in the morning, and the smell of rye bread drifted "
    "through the empty streets long before the first tram rattled past.",
    "Mapmakers surveyed the valley with chains and theodolites, marking each benchmark with a brass disc "
    "that hikers still find set into boulders along the ridge.",
    "The weaving mill ran on water power until the canal silted up, after which the owners installed a "
    "steam engine whose chimney became the tallest landmark for miles.",
};

std::string render(const ChatCodec& codec, const std::string& document, const NeedleOptions& o) {
  nlohmann::ordered_json messages = nlohmann::ordered_json::array();
  messages.push_back({{"role", "user"}, {"content", document + "\n\n" + o.question}});
  return codec.render_chat(messages, nullptr, nlohmann::ordered_json::object());
}

}  // namespace

NeedlePrompt build_needle_prompt(const ChatCodec& codec, const NeedleCase& c, const NeedleOptions& o) {
  if (c.depth < 0 || c.depth > 1) fail("needle depth {} outside [0, 1]", c.depth);
  // Token cost of the fixed parts, then fill the rest with whole paragraphs.
  int64_t fixed = int64_t(codec.encode(render(codec, o.needle, o)).size());
  if (fixed >= c.context_tokens)
    fail("needle context {} tokens is smaller than the question itself ({} tokens)", c.context_tokens, fixed);
  std::vector<std::string> paragraphs;
  int64_t budget = c.context_tokens - fixed, used = 0;
  for (size_t i = 0;; ++i) {
    std::string p = kFiller[i % std::size(kFiller)];
    int64_t cost = int64_t(codec.encode(p + "\n\n").size());
    if (used + cost > budget) break;
    paragraphs.push_back(std::move(p));
    used += cost;
  }
  size_t at = size_t(std::lround(c.depth * double(paragraphs.size())));
  std::string before, after;
  for (size_t i = 0; i < paragraphs.size(); ++i) (i < at ? before : after) += paragraphs[i] + "\n\n";
  std::string document = before + o.needle + "\n\n" + after;
  NeedlePrompt p;
  p.tokens = codec.encode(render(codec, document, o));
  // Locate the needle: tokens of the prompt rendered up to the needle's position.
  std::string head = render(codec, before + o.needle, o);
  head = head.substr(0, head.find(o.needle));
  p.needle_token_offset = int64_t(codec.encode(head).size());
  return p;
}

NeedleResult run_needle(Engine& engine, const ChatCodec& codec, const NeedleCase& c, const NeedleOptions& o) {
  NeedleResult r;
  r.c = c;
  NeedlePrompt p = build_needle_prompt(codec, c, o);
  r.prompt_tokens = int64_t(p.tokens.size());
  if (r.prompt_tokens + o.max_new_tokens > engine.max_context())
    fail("needle prompt of {} tokens + {} new exceeds the model context {}", r.prompt_tokens, o.max_new_tokens,
         engine.max_context());
  auto seq = engine.new_sequence();
  auto t0 = std::chrono::steady_clock::now();
  std::vector<float> logits;
  const size_t step = size_t(o.prefill_chunk > 0 ? o.prefill_chunk : std::max<int64_t>(1, engine.prefill_chunk()));
  for (size_t b = 0; b < p.tokens.size(); b += step) {
    std::vector<int32_t> chunk(p.tokens.begin() + long(b),
                               p.tokens.begin() + long(std::min(p.tokens.size(), b + step)));
    logits = engine.forward(*seq, chunk);
  }
  auto t1 = std::chrono::steady_clock::now();
  auto ends = codec.end_of_turn_ids();
  std::string text;
  for (int i = 0; i < o.max_new_tokens; ++i) {
    int32_t next = argmax(logits);
    if (std::find(ends.begin(), ends.end(), next) != ends.end()) break;
    if (!codec.is_special(next)) text += codec.token_bytes(next);
    logits = engine.forward(*seq, {next});
  }
  auto t2 = std::chrono::steady_clock::now();
  r.prefill_seconds = std::chrono::duration<double>(t1 - t0).count();
  r.decode_seconds = std::chrono::duration<double>(t2 - t1).count();
  r.answer = text;
  std::string lower = text, key = o.answer_key;
  std::transform(lower.begin(), lower.end(), lower.begin(), ::tolower);
  std::transform(key.begin(), key.end(), key.begin(), ::tolower);
  r.found = lower.find(key) != std::string::npos;
  return r;
}

}  // namespace moesrv
