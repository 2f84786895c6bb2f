// bench: TTFT / prefill / decode throughput of the engine on a synthetic (or real) model, calibrated cost-model
// projections for all-in-VRAM, hybrid and CPU-experts placements, and the physical floors. See docs/perf.md.
#include <CLI/CLI.hpp>
#include <cstdio>

#include "bench/bench.h"
#include "util/error.h"

int main(int argc, char** argv) {
  using namespace moesrv;
  CLI::App app{"bench: measure and project moesrv throughput (markdown table + JSON)"};
  BenchOptions o;
  int64_t layers = 1, vocab = 154880;
  bool tiny = false, show_plan = false;
  std::string json_out, md_out;
  app.add_option("--model", o.model_dir, "model directory (default: synthetic GLM-5-shaped model in memory)");
  app.add_option("--layers", layers, "synthetic model layers (1-4)")->check(CLI::Range(1, 4));
  app.add_flag("--tiny", tiny, "synthetic model at reduced width (hidden 256, 32 experts)");
  app.add_option("--vocab", vocab, "synthetic vocabulary size");
  app.add_option("--distinct-experts", o.synthetic.distinct_experts,
                 "synthetic experts with their own weights (0: all)");
  app.add_option("--seed", o.synthetic.seed, "synthetic weight seed");
  app.add_option("--contexts", o.contexts, "contexts measured on the engine")->delimiter(',');
  app.add_option("--model-contexts", o.model_contexts, "contexts projected by the cost model")->delimiter(',');
  app.add_option("--decode-tokens", o.decode_tokens, "decode steps measured after each prefill");
  app.add_option("--full-layers", o.full_layers, "layers of the projected model (0: as loaded)");
  app.add_option("--full-dense-layers", o.full_dense_layers,
                 "leading dense layers of the projected model (-1: as config)");
  app.add_option("--vram-budget", o.vram_budget_gib, "VRAM budget of the hybrid placement, GiB");
  app.add_option("--hbm-gbps", o.hbm_gbps, "GPU memory bandwidth, GB/s");
  app.add_option("--pcie-gbps", o.pcie_gbps, "host-to-device bandwidth, GB/s");
  app.add_option("--gpu-tflops", o.gpu_tflops, "GPU dense throughput, TFLOP/s");
  app.add_option("--host-gbps", o.host_mem_gbps, "CPU expert GEMV bandwidth, GB/s (default: measured)");
  app.add_option("--cpu-gflops", o.cpu_gflops, "CPU expert GEMM throughput, GFLOP/s (default: measured)");
  app.add_option("--expert-bits", o.expert_bits,
                 "bits per routed-expert weight of the projected model (default: as loaded)");
  app.add_option("--dense-bits", o.dense_bits, "bits per dense weight of the projected model (default 16)");
  app.add_option("--usage", o.usage_path, "expert usage JSON for pinning (default: <model>/.moesrv/expert_usage.json)");
  app.add_option("--zipf", o.usage_zipf, "model skewed routing with this Zipf exponent when no usage file is given");
  app.add_option("--prefill-chunk", o.prefill_chunk, "prefill chunk of the projection, tokens");
  app.add_option("--kv-bytes", o.kv_elem_bytes, "KV cache bytes per element in the projection (2: bf16, 1: fp8)")
      ->check(CLI::Range(1, 4));
  app.add_option("--workspace", o.workspace_gib, "VRAM workspace reserve, GiB");
  bool no_engine = false;
  app.add_flag("--no-engine", no_engine, "skip the engine runs (calibration and projections only)");
  app.add_flag("--plan", show_plan, "print the hybrid placement plan");
  app.add_option("--json", json_out, "write the JSON report here");
  app.add_option("--markdown", md_out, "write the markdown table here");
  CLI11_PARSE(app, argc, argv);
  try {
    o.measure_engine = !no_engine;
    if (o.model_dir.empty()) o.synthetic_config = tiny ? tiny_moe_config(layers) : glm5_config(layers, vocab);
    BenchResult r = run_bench(o);
    r.write(json_out, md_out);
    if (show_plan && r.json.contains("hybrid_plan_summary"))
      std::printf("\n%s", r.json["hybrid_plan_summary"].get<std::string>().c_str());
  } catch (const Error& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  return 0;
}
