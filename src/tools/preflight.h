// Preflight: will this model package run on this machine? Host hardware, package files (vs the lock),
// parameter bytes split dense / routed experts, KV cache bytes per token, and a fits / needs-more verdict.
#pragma once
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "format/package.h"
#include "tools/hardware.h"

namespace moesrv {

struct ParamBytes {
  uint64_t dense = 0, experts = 0;               // bytes as stored (EXL3: trellis + scales); experts = *.mlp.experts.*
  uint64_t dense_params = 0, expert_params = 0;  // weights (an EXL3 trellis counts its in x out)
  size_t tensors = 0;
  uint64_t total() const { return dense + experts; }
};
// Every tensor in every shard of the package (indexed or not).
ParamBytes count_parameter_bytes(const ModelPackage& pkg);
// A folder with only config.json: every tensor of the model's manifest, matrices at `bits` per weight (EXL3
// at 3.05 bpw, say) and everything else at bf16.
ParamBytes estimate_parameter_bytes(const nlohmann::json& config, double bits);

struct KvCacheSpec {
  std::string kind;                      // "MLA", "GQA" or "none"
  int attention_layers = 0;              // layers with a per-token cache
  int linear_layers = 0;                 // linear-attention layers (constant-size state)
  int indexer_layers = 0;                // DSA layers with their own indexer key cache
  uint64_t kv_bytes_per_token = 0;       // all attention layers
  uint64_t indexer_bytes_per_token = 0;  // DSA indexer keys, all layers
  uint64_t linear_state_bytes = 0;       // per sequence, independent of context
  std::string formula;                   // how the numbers were derived
  uint64_t bytes_per_token() const { return kv_bytes_per_token + indexer_bytes_per_token; }
};
// From a HF config (text_config is used when present). dtype_bytes: KV cache element size.
KvCacheSpec kv_cache_spec(const nlohmann::json& config, int dtype_bytes = 2);

struct HostInfo {
  CpuInfo cpu;
  MemInfo mem;
  std::vector<GpuInfo> gpus;
  DiskInfo disk;
};
HostInfo probe_host(const std::string& model_dir);

struct PreflightOptions {
  double vram_budget_gib = -1;  // <0: free VRAM of all detected GPUs
  int64_t ctx = 0;              // 0: min(max_position_embeddings, 32768)
  int kv_dtype_bytes = 2;
  double overhead_gib = 1.0;  // workspace/activations reserve on the device that runs attention
  bool hash = false;          // SHA-256 every file against the lock (slow); default: sizes only
  double assume_bits = 16;    // config-only folder: bits per matrix weight for the estimate
};

struct PackageFileStatus {
  std::string path;
  uint64_t size = 0;
  std::string status;  // "ok (size)", "ok (sha256)", "truncated", "size mismatch", "sha256 mismatch", "missing",
                       // "not in lock", "no lock"
  bool problem = false;
};

struct PreflightReport {
  std::string dir, model_type;
  HostInfo host;
  std::vector<PackageFileStatus> files;
  bool has_lock = false, lock_ok = true;
  ParamBytes params;
  KvCacheSpec kv;
  int64_t ctx = 0;
  uint64_t kv_bytes = 0;                                // at ctx, plus linear state
  std::vector<std::pair<int64_t, uint64_t>> kv_by_ctx;  // KV + state bytes at 8K / 128K / 256K (within max position)
  bool estimated = false;  // no weights in the folder: parameter bytes from the manifest at assume_bits
  uint64_t overhead = 0;
  // Plan: dense weights + KV cache + overhead on the GPU, then as many experts as fit; the rest in RAM.
  uint64_t vram_budget = 0, vram_used = 0, ram_needed = 0;
  bool fits = false;
  std::string verdict;
  // The same plan at the usual budgets: 22 GiB (one 24 GB card), 44 GiB (two), and the detected GPUs' free VRAM.
  struct BudgetPlan {
    std::string label;
    uint64_t budget = 0, vram_used = 0, experts_on_gpu = 0, ram_needed = 0;
    bool dense_fits = false, fits = false;
  };
  std::vector<BudgetPlan> by_budget;
  nlohmann::json by_budget_json() const;
  std::string text() const;
  nlohmann::json to_json() const;
};

PreflightReport run_preflight(const std::string& dir, const PreflightOptions& opt);
PreflightReport run_preflight(const std::string& dir, const PreflightOptions& opt, const HostInfo& host);

}  // namespace moesrv
