// `moesrv needle`: needle-in-a-haystack retrieval check over context lengths and depths.
#include <fmt/format.h>

#include <nlohmann/json.hpp>
#include <sstream>

#include "cli/commands.h"
#include "runtime/engine_factory.h"
#include "server/tokenizer_codec.h"
#include "tools/needle.h"
#include "util/error.h"

namespace moesrv::cli {

namespace {

struct NeedleArgs {
  std::string model, tokenizer, chat_format = "auto", contexts = "4096", depths = "0,0.25,0.5,0.75,1";
  NeedleOptions options;
  bool json = false;
  EngineOptions engine;
};

template <typename T>
std::vector<T> parse_list(const std::string& s, const char* what) {
  std::vector<T> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) {
    try {
      out.push_back(T(std::stod(item)));
    } catch (const std::exception&) {
      fail("--{}: '{}' is not a number", what, item);
    }
  }
  if (out.empty()) fail("--{} is empty", what);
  return out;
}

void run(const NeedleArgs& a) {
  auto engine = open_engine(a.model, a.engine);
  TokenizerCodec codec(a.tokenizer.empty() ? a.model : a.tokenizer, a.model, parse_chat_format(a.chat_format));
  nlohmann::json report = nlohmann::json::array();
  int found = 0, total = 0;
  if (!a.json) fmt::print("{:>9} {:>6} {:>8} {:>10} {:>9}  answer\n", "context", "depth", "tokens", "prefill/s", "found");
  for (auto ctx : parse_list<int64_t>(a.contexts, "contexts"))
    for (auto depth : parse_list<double>(a.depths, "depths")) {
      NeedleResult r = run_needle(*engine, codec, {ctx, depth}, a.options);
      found += r.found;
      ++total;
      if (a.json)
        report.push_back({{"context", ctx}, {"depth", depth}, {"prompt_tokens", r.prompt_tokens}, {"found", r.found},
                          {"answer", r.answer}, {"prefill_seconds", r.prefill_seconds}, {"decode_seconds", r.decode_seconds}});
      else
        fmt::print("{:>9} {:>6.2f} {:>8} {:>10.1f} {:>9}  {:?}\n", ctx, depth, r.prompt_tokens,
                   double(r.prompt_tokens) / r.prefill_seconds, r.found ? "yes" : "no", r.answer.substr(0, 60));
    }
  if (a.json) fmt::print("{}\n", nlohmann::json{{"found", found}, {"total", total}, {"cases", report}}.dump(2));
  else fmt::print("found {} of {}\n", found, total);
}

}  // namespace

void add_needle_command(CLI::App& app) {
  auto a = std::make_shared<NeedleArgs>();
  auto* cmd = app.add_subcommand("needle", "Needle-in-a-haystack retrieval check over context lengths and depths");
  cmd->add_option("--model", a->model, "Model directory")->required();
  cmd->add_option("--tokenizer", a->tokenizer, "Directory with tokenizer.json (default: the model directory)");
  cmd->add_option("--chat-format", a->chat_format, "auto | jinja | glm45 | glm47")->capture_default_str();
  cmd->add_option("--contexts", a->contexts, "Comma-separated prompt sizes in tokens")->capture_default_str();
  cmd->add_option("--depths", a->depths, "Comma-separated needle depths in [0, 1]")->capture_default_str();
  cmd->add_option("--max-new-tokens", a->options.max_new_tokens, "Answer length limit")->capture_default_str();
  cmd->add_option("--prefill-chunk", a->options.prefill_chunk,
                  "Prompt tokens per forward call (0: the engine's pass length)")
      ->capture_default_str();
  cmd->add_flag("--json", a->json, "Print JSON");
  add_engine_options(cmd, a->engine);
  cmd->callback([a] { run(*a); });
}

}  // namespace moesrv::cli
