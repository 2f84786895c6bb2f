#include <gtest/gtest.h>

#include <filesystem>
#include <unistd.h>

#include "format/lock.h"
#include "format/safetensors.h"
#include "test_lock_helpers.h"
#include "tools/preflight.h"
#include "util/error.h"

using namespace moesrv;
using namespace moesrv::testutil;
using json = nlohmann::json;

namespace {

const std::string kTiny = std::string(MOESRV_TESTDATA) + "/hf-tiny/";
constexpr uint64_t GiB = 1ull << 30;

json config(const std::string& model) { return read_json_file(kTiny + model + "/config.json"); }
json info_config(const std::string& name) { return read_json_file(kTiny + "info/" + name); }

HostInfo host(uint64_t ram_avail, std::vector<GpuInfo> gpus = {}) {
  HostInfo h;
  h.mem = {ram_avail * 2, ram_avail};
  h.gpus = std::move(gpus);
  return h;
}

// A package of `dense` and `experts` bytes of F32 tensors, with a small GQA config.
void make_sized_package(const std::string& dir, int64_t dense_floats, int64_t expert_floats) {
  write_file(dir + "/config.json", R"({"model_type":"toy","num_hidden_layers":2,"num_attention_heads":4,
    "num_key_value_heads":2,"head_dim":16,"hidden_size":64,"max_position_embeddings":1024})");
  write_shard(dir + "/model.safetensors", {{"model.embed_tokens.weight", {dense_floats}},
                                            {"model.layers.0.mlp.experts.0.up_proj.weight", {expert_floats}}});
}

}  // namespace

TEST(Preflight, KvCacheMla) {
  KvCacheSpec k = kv_cache_spec(config("deepseek_v3"));
  EXPECT_EQ(k.kind, "MLA");
  EXPECT_EQ(k.attention_layers, 4);
  EXPECT_EQ(k.kv_bytes_per_token, uint64_t((32 + 8) * 2 * 4));
  EXPECT_EQ(k.indexer_bytes_per_token, 0u);
  // Full-size config (GLM MoE DSA, 78 layers): MLA 512+64 plus a 128-dim indexer key per layer.
  KvCacheSpec big = kv_cache_spec(info_config("cfg_glm_moe_dsa.json"));
  EXPECT_EQ(big.kv_bytes_per_token, uint64_t((512 + 64) * 2 * 78));
  EXPECT_EQ(big.indexer_bytes_per_token, uint64_t(128 * 2 * 78));
  // text_config nesting (Kimi K2.5: DeepSeek-V3 text model, 61 layers).
  EXPECT_EQ(kv_cache_spec(info_config("cfg_kimi_k25.json")).kv_bytes_per_token, uint64_t((512 + 64) * 2 * 61));
  // fp8 cache halves it.
  EXPECT_EQ(kv_cache_spec(config("deepseek_v3"), 1).kv_bytes_per_token, uint64_t(40 * 4));
}

TEST(Preflight, KvCacheDsaIndexerFollowsIndexerTypes) {
  KvCacheSpec k = kv_cache_spec(config("glm_moe_dsa"));
  EXPECT_EQ(k.kind, "MLA");
  EXPECT_EQ(k.indexer_layers, 3);  // "full", "full", "shared", "full"
  EXPECT_EQ(k.indexer_bytes_per_token, uint64_t(16 * 2 * 3));
  EXPECT_EQ(k.bytes_per_token(), uint64_t(40 * 2 * 4 + 16 * 2 * 3));
}

TEST(Preflight, KvCacheGqaAndHybridLinearAttention) {
  KvCacheSpec g = kv_cache_spec(config("glm4_moe"));
  EXPECT_EQ(g.kind, "GQA");
  EXPECT_EQ(g.kv_bytes_per_token, uint64_t(2 * 2 * 32 * 2 * 4));
  KvCacheSpec q = kv_cache_spec(config("qwen3_next"));  // 3 linear + 1 full attention layer
  EXPECT_EQ(q.attention_layers, 1);
  EXPECT_EQ(q.linear_layers, 3);
  EXPECT_EQ(q.kv_bytes_per_token, uint64_t(2 * 2 * 32 * 2));
  // recurrent state 32 v-heads x 128 x 128 fp32 + the conv's last kernel-1 = 3 inputs of (2*16*128 + 32*128)
  // channels, fp32 (what the engines keep, model/state.h), per linear layer
  EXPECT_EQ(q.linear_state_bytes, uint64_t(3 * (32 * 128 * 128 * 4 + 3 * (2 * 16 * 128 + 32 * 128) * 4)));
}

// GLM-5.3-Flash (the published config's shape): KV only on the 11 MLA layers (latent 512, NoPE), pooled
// indexer keys one per index_kpool tokens, and a fixed KDA + conv + open-pool state per sequence.
TEST(Preflight, KvCacheGlm5NextCountsMlaLayersAndFixedState) {
  nlohmann::json c = read_json_file(std::string(MOESRV_TESTDATA) + "/hf-tiny/info/cfg_glm5_next.json");
  KvCacheSpec k = kv_cache_spec(c, 2);
  EXPECT_EQ(k.attention_layers, 11);
  EXPECT_EQ(k.linear_layers, 34);
  EXPECT_EQ(k.kv_bytes_per_token, uint64_t(11 * 512 * 2));
  const int64_t kpool = c["text_config"]["index_kpool"].get<int64_t>();
  EXPECT_EQ(k.indexer_bytes_per_token, uint64_t((11 * 128 * 2 + kpool - 1) / kpool));
  const uint64_t kda = 64 * 128 * 128 * 4 + 3 * (3 * 64 * 128) * 4, open_pool = 2 * kpool * 128 * 4;  // room for kpool
  EXPECT_EQ(k.linear_state_bytes, 34 * kda + 11 * open_pool);
}

// A folder with only the published config: parameters estimated from the manifest (EXL3 3.05 bpw), KV + state
// at 8K / 128K / 256K.
TEST(Preflight, ConfigOnlyFolderEstimatesGlm5NextFootprint) {
  const fs::path dir = fs::temp_directory_path() / ("moesrv_pf_cfg_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  fs::copy_file(kTiny + "info/cfg_glm5_next.json", dir / "config.json", fs::copy_options::overwrite_existing);
  PreflightOptions o;
  o.assume_bits = 3.05;
  o.vram_budget_gib = 22;
  HostInfo host;
  host.mem.total = host.mem.available = uint64_t(128) << 30;
  PreflightReport r = run_preflight(dir.string(), o, host);
  EXPECT_TRUE(r.estimated);
  // 288 experts x 3 x 2048 x 4096 weights in each of the 42 MoE layers, at 3.05 bits.
  const double experts = 42.0 * 288 * 3 * 2048 * 4096;
  EXPECT_EQ(r.params.expert_params, uint64_t(experts));
  EXPECT_NEAR(double(r.params.experts), experts * 3.05 / 8, 1e6);
  ASSERT_EQ(r.kv_by_ctx.size(), 3u);
  EXPECT_EQ(r.kv_by_ctx[2].first, 262144);
  EXPECT_EQ(r.kv_by_ctx[2].second, r.kv.bytes_per_token() * 262144 + r.kv.linear_state_bytes);
  EXPECT_TRUE(r.fits) << r.verdict;
  EXPECT_NE(r.text().find("ctx 262144"), std::string::npos);
  // The usual budgets (no GPU detected: 22 and 44 GiB only): dense + KV + workspace first, then experts; the 22 GiB
  // that 44 adds all go to experts, and what is left of the experts sits in RAM (128 GiB: fits at both).
  ASSERT_EQ(r.by_budget.size(), 2u);
  const auto &b22 = r.by_budget[0], &b44 = r.by_budget[1];
  EXPECT_TRUE(b22.dense_fits && b44.dense_fits);
  EXPECT_EQ(b22.vram_used, uint64_t(22) << 30);
  EXPECT_EQ(b44.experts_on_gpu - b22.experts_on_gpu, uint64_t(22) << 30);
  EXPECT_EQ(b22.experts_on_gpu + b22.ram_needed, r.params.experts);
  EXPECT_EQ(b22.vram_used - b22.experts_on_gpu, r.params.dense + r.kv_bytes + r.overhead);
  EXPECT_TRUE(b22.fits && b44.fits);
  EXPECT_NE(r.text().find("at 44 GiB"), std::string::npos);
  fs::remove_all(dir);
}

TEST(Preflight, ParameterBytesSplitDenseAndExperts) {
  auto pkg = ModelPackage::open(kTiny + "glm4_moe");
  ParamBytes p = count_parameter_bytes(*pkg);
  auto f = SafetensorsFile::open(kTiny + "glm4_moe/model.safetensors");
  uint64_t experts = 0, all = 0;
  for (const auto& [n, t] : f->tensors()) {
    all += t.nbytes;
    if (n.find(".mlp.experts.") != std::string::npos) experts += t.nbytes;
  }
  EXPECT_GT(experts, 0u);
  EXPECT_EQ(p.experts, experts);
  EXPECT_EQ(p.total(), all);
  EXPECT_EQ(p.dense_params + p.expert_params, all / 2);  // bf16
}

TEST(Preflight, HardwareParsers) {
  MemInfo m = parse_meminfo("MemTotal:       65536000 kB\nMemFree:  100 kB\nMemAvailable:   32768000 kB\n");
  EXPECT_EQ(m.total, 65536000ull * 1024);
  EXPECT_EQ(m.available, 32768000ull * 1024);
  auto gpus = parse_nvidia_smi("NVIDIA GeForce RTX 4090, 24564 MiB, 1024 MiB\nNVIDIA H200, 143771, 0\n");
  ASSERT_EQ(gpus.size(), 2u);
  EXPECT_EQ(gpus[0].name, "NVIDIA GeForce RTX 4090");
  EXPECT_EQ(gpus[0].total, 24564ull << 20);
  EXPECT_EQ(gpus[0].free(), (24564ull - 1024) << 20);
  EXPECT_EQ(gpus[1].total, 143771ull << 20);
  EXPECT_TRUE(parse_nvidia_smi("").empty());
  CpuInfo c = parse_cpuinfo(
      "processor\t: 0\nmodel name\t: Test CPU\nphysical id\t: 0\ncore id\t: 0\nflags\t\t: fpu avx2 fma avx512f\n\n"
      "processor\t: 1\nmodel name\t: Test CPU\nphysical id\t: 0\ncore id\t: 0\nflags\t\t: fpu avx2 fma avx512f\n");
  EXPECT_EQ(c.model, "Test CPU");
  EXPECT_EQ(c.logical_cores, 2);
  EXPECT_EQ(c.physical_cores, 1);
  EXPECT_TRUE(c.avx2 && c.fma && c.avx512f);
  EXPECT_FALSE(c.avx512_bf16);
  CpuInfo real = probe_cpu();
  EXPECT_GT(real.logical_cores, 0);
  EXPECT_GT(probe_memory().total, 0u);
}

TEST(Preflight, VerdictCpuOnly) {
  TempDir d;
  make_sized_package(d.str(), 1 << 20, 3 << 20);  // 4 MiB dense, 12 MiB experts
  PreflightOptions o;
  o.ctx = 1000;
  o.overhead_gib = 0;
  PreflightReport r = run_preflight(d.str(), o, host(GiB));
  EXPECT_EQ(r.params.dense, 4u << 20);
  EXPECT_EQ(r.params.experts, 12u << 20);
  EXPECT_EQ(r.kv.bytes_per_token(), uint64_t(2 * 2 * 16 * 2 * 2));
  EXPECT_EQ(r.kv_bytes, 1000u * 256);
  EXPECT_TRUE(r.fits) << r.verdict;
  EXPECT_NE(r.verdict.find("fits CPU-only"), std::string::npos) << r.verdict;

  uint64_t need = (16u << 20) + 256000;
  PreflightReport small = run_preflight(d.str(), o, host(need - (1u << 20)));  // 1 MiB short
  EXPECT_FALSE(small.fits);
  EXPECT_EQ(small.ram_needed, need);
  EXPECT_NE(small.verdict.find("needs 0.00 GiB more RAM"), std::string::npos) << small.verdict;
  EXPECT_NE(small.text().find("Verdict  does not fit"), std::string::npos);
}

TEST(Preflight, VerdictWithGpu) {
  constexpr uint64_t MiB = 1 << 20;
  TempDir d;
  make_sized_package(d.str(), 1 << 20, 3 << 20);  // 4 MiB dense, 12 MiB experts
  PreflightOptions o;
  o.ctx = 1024;  // 256 KiB of KV cache
  o.overhead_gib = 0;
  o.vram_budget_gib = 8.0 / 1024;  // dense + KV fit, 3.75 MiB of experts on the GPU too
  PreflightReport r = run_preflight(d.str(), o, host(GiB, {{"Test GPU", 24 * GiB, 0}}));
  EXPECT_TRUE(r.fits) << r.verdict;
  EXPECT_EQ(r.vram_used, 8 * MiB);
  EXPECT_EQ(r.ram_needed, 12 * MiB - (8 * MiB - 4 * MiB - 256 * 1024));
  EXPECT_NE(r.verdict.find("on GPU"), std::string::npos) << r.verdict;

  // Same plan, RAM 1 MiB short of the experts left over.
  PreflightReport short_ram = run_preflight(d.str(), o, host(r.ram_needed - MiB, {{"Test GPU", 24 * GiB, 0}}));
  EXPECT_FALSE(short_ram.fits);
  EXPECT_NE(short_ram.verdict.find("more RAM"), std::string::npos) << short_ram.verdict;

  // Budget below dense + KV, and too little RAM to run CPU-only: the VRAM and RAM shortfalls are stated.
  o.vram_budget_gib = 2.0 / 1024;
  PreflightReport v = run_preflight(d.str(), o, host(10 * MiB, {{"Test GPU", 24 * GiB, 0}}));
  EXPECT_FALSE(v.fits);
  EXPECT_NE(v.verdict.find("more VRAM"), std::string::npos) << v.verdict;
  EXPECT_NE(v.verdict.find("more RAM for the experts"), std::string::npos) << v.verdict;

  // Default budget = free VRAM of the detected GPUs.
  o.vram_budget_gib = -1;
  PreflightReport g = run_preflight(d.str(), o, host(GiB, {{"A", 2 * GiB, GiB / 2}, {"B", GiB, 0}}));
  EXPECT_EQ(g.vram_budget, GiB * 5 / 2);
  EXPECT_TRUE(g.fits);
  EXPECT_EQ(g.ram_needed, 0u);
}

TEST(Preflight, FilesCheckedAgainstTheLock) {
  TempDir d;
  copy_package(kTiny + "glm_moe_dsa", d.str());
  HashOptions ho;
  ho.progress = false;
  write_package_lock(d.str(), ho);
  PreflightOptions o;
  PreflightReport ok = run_preflight(d.str(), o, host(GiB));
  EXPECT_TRUE(ok.has_lock);
  EXPECT_TRUE(ok.lock_ok);
  fs::resize_file(d / "reference.safetensors", 100);
  flip_byte(d / "model.safetensors", 1000000);
  PreflightReport bad = run_preflight(d.str(), o, host(GiB));
  EXPECT_FALSE(bad.lock_ok);
  bool saw_truncated = false;
  for (const auto& f : bad.files) saw_truncated |= f.path == "reference.safetensors" && f.status == "truncated";
  EXPECT_TRUE(saw_truncated) << bad.text();
  o.hash = true;
  PreflightReport hashed = run_preflight(d.str(), o, host(GiB));
  bool saw_hash = false;
  for (const auto& f : hashed.files) saw_hash |= f.path == "model.safetensors" && f.status == "sha256 mismatch";
  EXPECT_TRUE(saw_hash) << hashed.text();
}

TEST(Preflight, JsonReport) {
  PreflightOptions o;
  o.ctx = 2048;
  PreflightReport r = run_preflight(kTiny + "glm_moe_dsa", o, host(2 * GiB));
  json j = r.to_json();
  EXPECT_EQ(j["model_type"], "glm_moe_dsa");
  EXPECT_EQ(j["kv_cache"]["bytes_per_token"], 416);
  EXPECT_EQ(j["kv_cache"]["total_bytes"], 416 * 2048);
  EXPECT_EQ(j["params"]["total_bytes"], r.params.total());
  EXPECT_EQ(j["fits"], true);
  EXPECT_FALSE(j["lock"]["present"].get<bool>());
  EXPECT_EQ(j["files"].size(), 4u);
}

TEST(Preflight, CliJsonAndExitCode) {
  std::string bin = std::string(MOESRV_BINARY_DIR) + "/moesrv";
  if (!fs::exists(bin)) GTEST_SKIP() << "moesrv binary not built";
  TempDir d;
  std::string cmd = bin + " preflight --model " + kTiny + "glm4_moe --ctx 100 --json >" + (d / "out.json");
  ASSERT_EQ(std::system(cmd.c_str()), 0);
  json j = json::parse(read_file(d / "out.json"));
  EXPECT_EQ(j["kv_cache"]["total_bytes"], 1024 * 100);
  // A 0-byte VRAM budget and an absurd context cannot fit: exit status 2.
  int rc = std::system((bin + " preflight --model " + kTiny + "glm4_moe --ctx 1000000000000 >/dev/null").c_str());
  EXPECT_EQ(WEXITSTATUS(rc), 2);
}
