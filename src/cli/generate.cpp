// `moesrv generate`: run the model on token ids (or text with --tokenizer) and print the continuation.
#include <fmt/format.h>

#include <chrono>
#include <sstream>

#include "cli/commands.h"
#include "runtime/engine_factory.h"
#include "serving/sampler.h"
#include "serving/speculative.h"
#include "tokenizer/tokenizer.h"
#include "util/error.h"
#include "util/timing.h"

namespace moesrv::cli {

namespace {

struct GenerateOptions {
  std::string model, prompt_ids, prompt, tokenizer, speculative;
  int max_tokens = 16;
  float temperature = 0.0f;
  uint64_t seed = 0;
  EngineOptions engine;
};

std::vector<int32_t> parse_ids(const std::string& text) {
  std::vector<int32_t> ids;
  std::stringstream ss(text);
  std::string tok;
  while (std::getline(ss, tok, ',')) {
    if (tok.find_first_not_of(" \t") == std::string::npos) continue;
    try {
      size_t used = 0;
      long v = std::stol(tok, &used);
      if (tok.find_first_not_of(" \t", used) != std::string::npos) throw std::invalid_argument(tok);
      ids.push_back(int32_t(v));
    } catch (const std::exception&) {
      fail("--prompt-ids: '{}' is not an integer token id", tok);
    }
  }
  return ids;
}

void run_generate(const GenerateOptions& o) {
  EngineOptions eo = o.engine;
  const SpeculativeOption speculative = parse_speculative(o.speculative);
  eo.mtp = speculative.k > 0;
  auto engine = open_engine(o.model, eo);
  std::optional<Tokenizer> tok;
  if (!o.tokenizer.empty()) tok = Tokenizer::load(o.tokenizer + "/tokenizer.json");
  std::vector<int32_t> prompt;
  if (!o.prompt_ids.empty()) prompt = parse_ids(o.prompt_ids);
  else if (!o.prompt.empty()) {
    if (!tok) fail("--prompt needs --tokenizer DIR (or pass --prompt-ids)");
    prompt = tok->encode(o.prompt);
  }
  if (prompt.empty()) fail("give a prompt: --prompt-ids 1,2,3 or --prompt TEXT --tokenizer DIR");

  SamplingParams sp;
  sp.temperature = o.temperature;
  sp.seed = o.seed;
  Sampler sampler(sp);
  if (const int k = speculative.k) {
    SpeculativeStats stats;
    auto t0 = std::chrono::steady_clock::now();
    auto out = generate_speculative(*engine, prompt, o.max_tokens, sampler, k, &stats, {}, speculative.policy());
    double s = seconds_since(t0);
    fmt::print("{}\n", fmt::join(out, ","));
    if (tok) fmt::print("{}\n", tok->decode(out));
    fmt::print(stderr,
               "prompt {} tokens + generated {} tokens in {:.3f} s; speculative mtp:{}: {} verify steps ({} without "
               "drafts), {} of {} drafts accepted ({:.1f}%), {:.2f} tokens per step\n",
               prompt.size(), out.size(), s, k, stats.steps, stats.plain, stats.accepted, stats.drafted,
               100.0 * stats.acceptance_rate(), stats.tokens_per_step());
    return;
  }
  auto seq = engine->new_sequence();
  auto t0 = std::chrono::steady_clock::now();
  auto logits = engine->forward(*seq, prompt);
  auto t1 = std::chrono::steady_clock::now();
  std::vector<int32_t> out;
  for (int i = 0; i < o.max_tokens; ++i) {
    int32_t next = sampler.sample(logits);
    out.push_back(next);
    if (i + 1 < o.max_tokens) logits = engine->forward(*seq, {next});
  }
  auto t2 = std::chrono::steady_clock::now();
  double prefill_s = std::chrono::duration<double>(t1 - t0).count();
  double decode_s = std::chrono::duration<double>(t2 - t1).count();
  fmt::print("{}\n", fmt::join(out, ","));
  if (tok) fmt::print("{}\n", tok->decode(out));
  fmt::print(stderr, "prompt {} tokens in {:.3f} s ({:.1f} tok/s); generated {} tokens in {:.3f} s ({:.1f} tok/s)\n",
             prompt.size(), prefill_s, double(prompt.size()) / prefill_s, out.size(), decode_s,
             double(out.size() > 1 ? out.size() - 1 : 1) / std::max(decode_s, 1e-9));
}

}  // namespace

void add_generate_command(CLI::App& app) {
  auto opts = std::make_shared<GenerateOptions>();
  auto* cmd = app.add_subcommand("generate", "Generate a continuation of a prompt (token ids or text)");
  cmd->add_option("--model", opts->model, "Model package directory (config.json + safetensors)")->required();
  cmd->add_option("--prompt-ids", opts->prompt_ids, "Comma-separated prompt token ids");
  cmd->add_option("--prompt", opts->prompt, "Prompt text (needs --tokenizer)");
  cmd->add_option("--tokenizer", opts->tokenizer, "Directory with tokenizer.json");
  cmd->add_option("--max-tokens", opts->max_tokens, "Tokens to generate")->check(CLI::Range(1, 1 << 20));
  cmd->add_option("--temperature", opts->temperature, "0 = greedy")->check(CLI::Range(0.0, 100.0));
  cmd->add_option("--seed", opts->seed, "Sampling seed");
  cmd->add_option("--speculative", opts->speculative,
                  "mtp:K: speculative decoding, the model's MTP block drafts up to K tokens (1-3) per step, as many "
                  "as commit the most tokens per second (mtp:K:fixed: always K; CPU engine, one-GPU CUDA engine)");
  add_engine_options(cmd, opts->engine);
  cmd->callback([opts] { run_generate(*opts); });
}

}  // namespace moesrv::cli
