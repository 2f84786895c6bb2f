// bench_glm5_next_cpu: GLM-5.3-Flash (glm5_next) at real width on the CPU engine, layer by layer: prefill and decode
// tok/s, seconds per layer kind, per-sequence state (KDA constant, MLA growing), projected to the 45-layer model.
// See docs/perf-cpu-glm5-next.md.
#include <CLI/CLI.hpp>
#include <cstdio>

#include "bench/bench.h"
#include "util/error.h"

int main(int argc, char** argv) {
  using namespace moesrv;
  CLI::App app{"bench_glm5_next_cpu: synthetic glm5_next slice at real width on the CPU (markdown + JSON)"};
  CpuLayerBenchOptions o;
  int64_t vocab = 154880;
  std::string json_out, md_out;
  bool no_check = false;
  app.add_option("--prefill", o.prefill, "prompt lengths, each followed by decode at that context")->delimiter(',');
  app.add_option("--contexts", o.extra_contexts, "further decode contexts (state tiled from the longest prefill)")
      ->delimiter(',');
  app.add_option("--decode-tokens", o.decode_tokens, "decode steps timed per context (after one warm-up step)");
  app.add_option("--distinct-experts", o.synthetic.distinct_experts, "routed experts with their own weights (0: all)");
  app.add_option("--vocab", vocab, "vocabulary size");
  app.add_option("--seed", o.synthetic.seed, "synthetic weight seed");
  app.add_flag("--no-self-check", no_check, "skip the check that the timed forward equals CpuEngine::forward");
  app.add_option("--json", json_out, "write the JSON report here");
  app.add_option("--markdown", md_out, "write the markdown report here");
  CLI11_PARSE(app, argc, argv);
  try {
    o.self_check = !no_check;
    o.config = glm5_next_config(4, vocab);
    o.config["mlp_layer_types"] = {"dense", "sparse", "sparse", "sparse"};
    run_cpu_layer_bench(o).write(json_out, md_out);
  } catch (const Error& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  return 0;
}
