// The benchmarks' library (src/bench/; their programs are bench/*.cpp). `bench`: measures the engine on a model
// (synthetic by default) at several contexts, calibrates the cost model on this host (memcpy, CPU expert GEMV/GEMM),
// and projects placements to the full layer count: all experts in VRAM, hybrid (VRAM budget, LRU + CPU/PCIe split)
// and a GPU-dense + all-CPU-experts baseline, each next to the physical floor (bytes moved per token / bandwidth).
// Measured and modeled numbers are labelled as such. Pieces: calibration, measure (engine runs), projection,
// report, run_bench (the sequence); cpu_layer_timing + cpu_layer_bench for `bench_glm5_next_cpu`.
#pragma once
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "model/synthetic_model.h"

namespace moesrv {

struct BenchOptions {
  std::string model_dir;            // empty: synthetic model from synthetic_config
  nlohmann::json synthetic_config;  // default: glm5_config(1)
  SyntheticOptions synthetic{1, 0.02f, 16};
  std::vector<int64_t> contexts = {512, 2048};                  // measured on the engine
  std::vector<int64_t> model_contexts = {8192, 32768, 131072};  // projected
  int64_t decode_tokens = 4;
  int64_t full_layers = 78;       // layers of the projected model (0: the model's own)
  int64_t full_dense_layers = 3;  // leading dense layers of the projected model (-1: keep the config's)
  double vram_budget_gib = 22;
  double hbm_gbps = 1000, pcie_gbps = 25, gpu_tflops = 150;  // device numbers (flags until the GPU run measures)
  double host_mem_gbps = 0, cpu_gflops = 0;                  // 0: measured here
  int64_t prefill_chunk = 2048;
  double workspace_gib = 1;
  double expert_bits = 0, dense_bits = 0;  // storage of the projected model (0: as loaded / 16)
  int kv_elem_bytes = 2;                   // KV cache element size of the projection (1: fp8)
  double usage_zipf = 0;                   // > 0 and no usage file: model skewed routing with this Zipf exponent
  std::string usage_path;                  // expert usage for pinning (default: the model's, if any)
  bool measure_engine = true;
};

struct BenchResult {
  nlohmann::json json;
  std::string markdown;
  // The markdown to stdout, and the JSON / markdown to these files when named (fails naming a file it cannot write).
  void write(const std::string& json_path, const std::string& markdown_path) const;
};

BenchResult run_bench(const BenchOptions& opt);

// `bench_glm5_next_cpu`: a synthetic model at real width on the CPU engine, timed layer by layer. Prefill and decode
// tok/s; seconds per layer kind (mixer + feed-forward: KDA+dense, KDA+MoE, MLA+MoE, ...) and for lm_head; the
// per-sequence state of each layer kind (model/state.h; KDA constant in context, MLA growing), checked against the
// engine's buffers; everything projected to a full-size config by counting its layers of each kind.
struct CpuLayerBenchOptions {
  nlohmann::json config;       // default: glm5_next_config(4) with every layer kind of the full model: KDA+dense,
                               // 2 x KDA+MoE, MLA+MoE
  nlohmann::json full_config;  // the projected model (default: glm5_next_config(45), first 3 layers dense)
  SyntheticOptions synthetic{1, 0.02f, 8};
  std::vector<int64_t> prefill = {512, 2048};  // prompt lengths (each followed by decode at that context)
  // Decode contexts beyond the longest prefill run on a state extended by tiling that prefill's growing buffers
  // (MLA latent, indexer keys): same sizes, hence the same work, as a real prefill of that length.
  std::vector<int64_t> extra_contexts = {8192, 32768};
  int64_t decode_tokens = 4;
  bool self_check = true;  // first: timing the steps keeps CpuEngine::forward exact on a tiny model
};

BenchResult run_cpu_layer_bench(const CpuLayerBenchOptions& opt);

// Host memcpy bandwidth (bytes copied per second / 1e9) over `bytes`-sized buffers.
double measure_memcpy_gbps(size_t bytes = size_t(256) << 20, int reps = 5);
// One copy of `bytes` (a multiple of 1 MiB) from src to dst, every core of the pool copying a share: the pattern
// measure_memcpy_gbps times.
void parallel_host_copy(char* dst, const char* src, size_t bytes);

}  // namespace moesrv
