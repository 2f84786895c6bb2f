// CUDA engine on EXL3-converted hf-tiny models (weights kept as trellis on the GPU) vs the CPU engine on the same
// package; skipped without CUDA or a device. Conversions (test encoder) are cached in $MOESRV_EXL3_CACHE
// (default: the temp dir) so later runs reuse them.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>

#include "backend/cpu/cpu_engine.h"
#include "backend/cuda/cuda_engine.h"
#include "engine_test_util.h"
#include "format/exl3_convert.h"
#include "format/safetensors.h"
#include "model/exl3_selection.h"
#include "reference_util.h"

namespace moesrv {
namespace {

namespace fs = std::filesystem;

#define SKIP_WITHOUT_CUDA() \
  if (!cuda_available()) GTEST_SKIP() << "no CUDA backend or device"

std::string tiny(const std::string& model) {
  const char* dir = std::getenv("MOESRV_TESTDATA_DIR");
  return std::string(dir ? dir : MOESRV_TESTDATA) + "/hf-tiny/" + model;
}

struct Variant {
  const char* model;
  int bits, head_bits;
  Exl3Codebook cb;
};
// deepseek_v3: MLA, padded projections (experts 32x128 -> 128x128); glm4_moe: GQA with q/k/v biases.
// glm5_next_clamp: KDA, NoPE MLA with the k-pool indexer, mHC, clamped SwiGLU (tensors chosen by the manifest).
// qwen3_next: Gated DeltaNet, gated GQA, softmax router with a gated shared expert.
const Variant kVariants[] = {{"deepseek_v3", 2, 4, Exl3Codebook::Mul1},
                             {"glm4_moe", 2, 3, Exl3Codebook::Inst3},
                             {"glm5_next_clamp", 4, 6, Exl3Codebook::Mul1},
                             {"qwen3_next", 4, 6, Exl3Codebook::Mul1}};

int layer_of(const std::string& name) {  // model.layers.N. or model.language_model.layers.N.
  for (const char* p : {"model.layers.", "model.language_model.layers."})
    if (name.starts_with(p)) return std::atoi(name.c_str() + std::strlen(p));
  return -1;
}

// The EXL3 package of a variant: every projection the converter takes, except the MTP layers the engines skip.
std::string exl3_tiny(const Variant& v) {
  const char* cache = std::getenv("MOESRV_EXL3_CACHE");
  const fs::path dir = fs::path(cache ? cache : fs::temp_directory_path().string()) /
                       fmt::format("moesrv_exl3_{}_k{}_h{}_{}", v.model, v.bits, v.head_bits, exl3_codebook_name(v.cb));
  if (fs::exists(dir / "converted")) return dir.string();
  const int64_t layers = ModelSpec::from_json(ModelPackage::open(tiny(v.model))->config()).num_layers;
  Exl3ConvertOptions opt;
  opt.bits = v.bits;
  opt.head_bits = v.head_bits;
  opt.codebook = v.cb;
  opt.filter = [layers](const std::string& n) { return layer_of(n) < layers; };
  auto t0 = std::chrono::steady_clock::now();
  exl3_convert_package(tiny(v.model), dir.string(), opt);
  std::printf("[ info ] converted %s to EXL3 K=%d in %.1f s\n", v.model, v.bits,
              std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  std::ofstream(dir / "converted") << "ok\n";
  return dir.string();
}

// Converts the variants into $MOESRV_EXL3_CACHE ahead of a GPU run (scripts/gpu_carry.sh does, so the GPU machine
// spends no time in the encoder); skipped unless the variable is set.
TEST(CudaExl3Prepare, ConvertModels) {
  if (!std::getenv("MOESRV_EXL3_CACHE")) GTEST_SKIP() << "set MOESRV_EXL3_CACHE";
  for (const Variant& v : kVariants) EXPECT_TRUE(fs::exists(fs::path(exl3_tiny(v)) / "converted"));
}

#if defined(MOESRV_HAS_CUDA) && MOESRV_HAS_CUDA

std::vector<int32_t> ids(const std::string& model, const char* name) {
  auto f = SafetensorsFile::open(tiny(model) + "/reference.safetensors");
  std::vector<int32_t> v;
  for (float x : f->find(name)->to_f32()) v.push_back(int32_t(x));
  return v;
}

double rel_row_error(const float* a, const float* ref, int64_t n) { return testing::max_rel_row_error(a, ref, 1, n); }

int32_t argmax(const float* v, int64_t n) { return int32_t(std::max_element(v, v + n) - v); }

// Rows within `tol` of the reference (relative to its row norm) must be >= 95%, every row within 5e-2: a
// near-tied expert choice may flip under fp16 activations and move its rows further.
void expect_close(const std::vector<float>& out, const std::vector<float>& ref, int64_t V, double tol,
                  const char* what) {
  ASSERT_EQ(out.size(), ref.size()) << what;
  const int64_t rows = int64_t(ref.size()) / V;
  int64_t ok = 0;
  double worst = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const double e = rel_row_error(out.data() + r * V, ref.data() + r * V, V);
    worst = std::max(worst, e);
    ok += e <= tol;
  }
  std::printf("[ info ] %s: %ld rows, worst rel error %.2e, %.0f%% within %.0e\n", what, long(rows), worst,
              100.0 * double(ok) / double(rows), tol);
  EXPECT_GE(double(ok) / double(rows), 0.95) << what;
  EXPECT_LE(worst, 5e-2) << what;
}

std::unique_ptr<CudaEngine> gpu(const std::string& dir, CudaEngineOptions opt = {}) {
  return std::make_unique<CudaEngine>(ModelPackage::open(dir), opt);
}

class CudaExl3 : public ::testing::TestWithParam<Variant> {};

TEST_P(CudaExl3, PrefillAndGreedyDecodeMatchCpu) {
  SKIP_WITHOUT_CUDA();
  const Variant& v = GetParam();
  const std::string dir = exl3_tiny(v);
  auto cpu = CpuEngine::open(dir);
  auto g = gpu(dir);
  const int64_t V = g->vocab_size();
  auto in = ids(v.model, "input_ids");
  auto cs = cpu->new_sequence();
  auto gs = g->new_sequence();
  expect_close(g->forward(*gs, in, true), cpu->forward(*cs, in, true), V, 1e-2, "EXL3 prefill vs cpu");

  // A DSA / k-pool indexer picks keys by a discrete top-k: bf16 activations move its near-ties (and the GPU breaks
  // exact ties toward lower positions, the CPU in torch.topk's order), so decode rows may part where a pick flips,
  // as test_cuda_engine allows for glm_moe_dsa and glm5_next.
  const bool selects_keys = ModelSpec::from_json(ModelPackage::open(dir)->config()).dsa;
  auto all = ids(v.model, "gen_ids");
  std::vector<int32_t> prompt(all.begin(), all.begin() + 40);
  cs = cpu->new_sequence();
  gs = g->new_sequence();
  auto cl = cpu->forward(*cs, prompt);
  auto gl = g->forward(*gs, prompt);
  int same = 0;
  double worst = 0;
  for (int step = 0; step < 16; ++step) {
    const int32_t a = argmax(cl.data(), V), b = argmax(gl.data(), V);
    worst = std::max(worst, rel_row_error(gl.data(), cl.data(), V));
    same += a == b;
    if (!selects_keys) {
      EXPECT_EQ(a, b) << "step " << step;
    }
    cl = cpu->forward(*cs, {a});
    gl = g->forward(*gs, {a});  // both continue from the CPU's token
  }
  std::printf("[ info ] %s EXL3 K=%d: %d/16 greedy tokens equal, worst decode rel error %.2e, graph replays %ld\n",
              v.model, v.bits, same, worst, long(g->stats().graph_replays));
  if (selects_keys) {
    EXPECT_GE(same, 12);  // measured on the H200: 14/16, worst decode row 3.7e-2 (glm_moe_dsa in bf16: 14/16)
  } else {
    EXPECT_LE(worst, 1e-2);
  }
  EXPECT_GT(g->stats().graph_replays, 0);
}

TEST_P(CudaExl3, GraphEagerAndChunkedAgree) {
  SKIP_WITHOUT_CUDA();
  const std::string dir = exl3_tiny(GetParam());
  auto g = gpu(dir);
  const int64_t V = g->vocab_size();
  auto all = ids(GetParam().model, "gen_ids");
  std::vector<int32_t> prompt(all.begin(), all.begin() + 20);
  auto a = g->new_sequence();
  auto b = g->new_sequence();
  g->forward(*a, prompt);
  g->forward(*b, prompt);
  for (int i = 20; i < 28; ++i) {
    g->set_use_graph(true);
    auto la = g->forward(*a, {all[size_t(i)]});
    g->set_use_graph(false);
    auto lb = g->forward(*b, {all[size_t(i)]});
    EXPECT_LE(rel_row_error(la.data(), lb.data(), V), 1e-5) << "step " << i;
  }
  EXPECT_EQ(g->stats().graph_captures, 1);
  // 7-token chunks take the GEMV paths (tensor-core variant for 2..7 rows), one pass the dequant + GEMM path.
  CudaEngineOptions small;
  small.prefill_chunk = 7;
  auto g7 = gpu(dir, small);
  auto s1 = g->new_sequence();
  auto s7 = g7->new_sequence();
  expect_close(g7->forward(*s7, all, true), g->forward(*s1, all, true), V, 1e-2, "EXL3 7-token chunks vs one pass");
  // The planned MoE pass in waves of 7 sorted rows: an expert cut across waves may run a piece of <= 8 rows through
  // the fp32 GEMV instead of the fp16 GEMM, hence the chunked tolerance.
  CudaEngineOptions waves;
  waves.moe_wave_rows = 7;
  auto gw = gpu(dir, waves);
  auto sw = gw->new_sequence();
  s1 = g->new_sequence();
  expect_close(gw->forward(*sw, all, true), g->forward(*s1, all, true), V, 1e-2, "EXL3 MoE waves of 7 rows vs one");
}

// All-VRAM prefill experts through dequantization + cuBLAS (0), the grouped EXL3 GEMM (every piece) and both in one
// wave (pieces of at most 8 .. 24 rows grouped, the rest apart on the expert lanes; hf-tiny: 16 experts, top-4, so
// ~14 rows per expert per layer): the same logits within the fp16 GEMMs' rounding (both multiply fp16 rows by the
// exact fp16 weights with fp32 sums; 1e-2 as the chunked runs above). Some threshold must split a wave both ways.
TEST_P(CudaExl3, GroupedAndDequantGemmsAgree) {
  SKIP_WITHOUT_CUDA();
  const std::string dir = exl3_tiny(GetParam());
  const auto all = ids(GetParam().model, "gen_ids");
  std::vector<float> none;
  bool mixed = false;
  for (int64_t rows :
       {int64_t(0), int64_t(8), int64_t(12), int64_t(16), int64_t(24), std::numeric_limits<int64_t>::max()}) {
    CudaEngineOptions o;
    o.exl3_grouped_rows = rows;
    auto g = gpu(dir, o);
    auto sq = g->new_sequence();
    auto out = g->forward(*sq, all, true);
    const CudaEngineStats st = g->stats();
    std::printf("[ info ] grouped rows <= %ld: %ld pieces grouped, %ld apart\n", long(std::min<int64_t>(rows, 1 << 30)),
                long(st.grouped_gemm_pieces), long(st.dequant_gemm_pieces));
    if (rows == 0) {
      if (st.dequant_gemm_pieces == 0) GTEST_SKIP() << "this model's prefill experts do not run in EXL3 waves";
      EXPECT_EQ(st.grouped_gemm_pieces, 0);
      none = std::move(out);
      continue;
    }
    if (rows > 1000) {
      EXPECT_GT(st.grouped_gemm_pieces, 0);
      EXPECT_EQ(st.dequant_gemm_pieces, 0);
    }
    mixed |= st.grouped_gemm_pieces > 0 && st.dequant_gemm_pieces > 0;
    expect_close(out, none, g->vocab_size(), 1e-2, "EXL3 prefill experts grouped vs dequantized");
  }
  EXPECT_TRUE(mixed) << "no threshold split a wave between the two paths";
}

// The decode overlaps (CudaEngineOptions::kpool_beside_query, shared_expert_beside_router; the default): the same rows
// as the serial order on the prefill and on graph-replayed decode steps. The k-pool order changes no arithmetic; the
// shared expert beside the router runs as its own GEMVs (another K split than the grouped launch's), so rows may move
// by float rounding (~1e-6; 1e-3 leaves room for a k-pool near-tie that rounding flips, while a wrong or missing shared
// expert moves rows by far more).
TEST_P(CudaExl3, DecodeOverlapsMatchTheDefaultOrder) {
  SKIP_WITHOUT_CUDA();
  const std::string dir = exl3_tiny(GetParam());
  CudaEngineOptions serial, overlaps;
  serial.kpool_beside_query = serial.shared_expert_beside_router = false;
  overlaps.kpool_beside_query = overlaps.shared_expert_beside_router = true;
  auto g = gpu(dir, serial), o = gpu(dir, overlaps);
  const int64_t V = g->vocab_size();
  auto all = ids(GetParam().model, "gen_ids");
  std::vector<int32_t> prompt(all.begin(), all.begin() + 24);
  auto a = g->new_sequence(), b = o->new_sequence();
  auto la = g->forward(*a, prompt), lb = o->forward(*b, prompt);
  EXPECT_LE(rel_row_error(lb.data(), la.data(), V), 1e-3) << "prefill";
  for (int i = 24; i < 32; ++i) {
    la = g->forward(*a, {all[size_t(i)]});
    lb = o->forward(*b, {all[size_t(i)]});
    EXPECT_LE(rel_row_error(lb.data(), la.data(), V), 1e-3) << "step " << i;
  }
  EXPECT_GT(o->stats().graph_replays, 0);
}

// CudaEngineOptions::row_gemv (default) / merge_expert_rows: chunks of 2..4 tokens take the R-row GEMV (fp32-accurate
// inputs), with or without the MoE entries that share an expert merged, so their rows match one-token forwards (the
// one-row kernel) to float rounding, where the batch kernel's fp16 inputs move them by ~1e-3 (measured on an H100:
// <= 4.7e-6). 1e-3 with the 95% rule leaves room for a near-tied expert or key choice that rounding flips; a wrong
// row, input or merged entry moves rows by far more.
TEST_P(CudaExl3, RowGemvMatchesOneTokenForwards) {
  SKIP_WITHOUT_CUDA();
  const std::string dir = exl3_tiny(GetParam());
  auto all = ids(GetParam().model, "gen_ids");
  CudaEngineOptions one;
  one.prefill_chunk = 1;
  auto g1 = gpu(dir, one);
  const int64_t V = g1->vocab_size();
  auto s1 = g1->new_sequence();
  const std::vector<float> ref = g1->forward(*s1, all, true);
  for (bool merge : {false, true})
    for (int64_t chunk : {2, 3, 4}) {
      CudaEngineOptions rows;
      rows.prefill_chunk = chunk;
      rows.row_gemv = true;
      rows.merge_expert_rows = merge;
      auto gr = gpu(dir, rows);
      auto sr = gr->new_sequence();
      const std::string what = std::string("EXL3 row GEMV") + (merge ? ", experts merged" : "") + ", chunks of " +
                               std::to_string(chunk) + " vs one token a pass";
      expect_close(gr->forward(*sr, all, true), ref, V, 1e-3, what.c_str());
    }
}

// forward_batch: 4 sequences at different lengths decode 3 steps as one pass each (R-row projections, grouped MoE of
// the 4 tokens, per-row recurrence and attention) and match each sequence's own forwards; all in VRAM (a graph per
// set of sequences) and with the experts mixed over VRAM, an LRU cache and the CPU (eager, host-planned MoE).
TEST_P(CudaExl3, ForwardBatchMatchesEachSequenceAlone) {
  SKIP_WITHOUT_CUDA();
  const std::string dir = exl3_tiny(GetParam());
  auto in = ids(GetParam().model, "gen_ids");
  for (int variant = 0; variant < 2; ++variant) {
    CudaEngineOptions opt;
    auto e = gpu(dir);
    if (variant == 1) {
      opt.cache_slots = 2;
      opt.stream_cold = false;
      opt.placement = e->placement();
      for (auto& layer : opt.placement)
        for (size_t x = 0; x < layer.size(); ++x) layer[x] = ExpertPlacement(x % 3);
      e = gpu(dir, opt);
    }
    const int64_t V = e->vocab_size();
    std::vector<std::unique_ptr<SequenceState>> seqs, alone;
    std::vector<SequenceState*> ptrs;
    std::vector<int32_t> next;
    for (size_t i = 0; i < 4; ++i) {
      seqs.push_back(e->new_sequence());
      e->forward(*seqs.back(), std::vector<int32_t>(in.begin(), in.begin() + long(9 + 6 * i)));
      alone.push_back(seqs.back()->clone());
      ptrs.push_back(seqs.back().get());
      next.push_back(in[9 + 6 * i]);
    }
    std::vector<float> got, ref;
    for (int step = 0; step < 3; ++step) {
      auto out = e->forward_batch(ptrs, next);
      for (size_t i = 0; i < 4; ++i) {
        auto r = e->forward(*alone[i], {next[i]});
        got.insert(got.end(), out[i].begin(), out[i].end());
        ref.insert(ref.end(), r.begin(), r.end());
        next[i] = argmax(r.data(), V);
      }
    }
    expect_close(got, ref, V, 1e-3, variant == 0 ? "EXL3 forward_batch vs alone" : "EXL3 forward_batch, mixed experts");
  }
}

// Device weight bytes: EXL3 linears exactly as stored, everything else as the bf16 engine uploads it.
TEST_P(CudaExl3, WeightBytesAreStoredBytes) {
  SKIP_WITHOUT_CUDA();
  const Variant& v = GetParam();
  const std::string dir = exl3_tiny(v);
  auto q = gpu(dir);
  auto bf = gpu(tiny(v.model));
  auto qpkg = ModelPackage::open(dir);
  auto opkg = ModelPackage::open(tiny(v.model));
  size_t stored = 0, bf16_of_same = 0;
  for (const std::string& n : qpkg->names()) {
    for (const char* piece : {".trellis", ".suh", ".svh"})
      if (n.ends_with(piece)) stored += qpkg->require(n).nbytes;
    if (n.ends_with(".trellis")) bf16_of_same += opkg->require(n.substr(0, n.size() - 8) + ".weight").nbytes;
  }
  const CudaEngineStats sq = q->stats(), sb = bf->stats();
  std::printf(
      "[ info ] %s EXL3 K=%d: device weights %zu B (EXL3 %zu B, stored %zu B) vs bf16 engine %zu B; those "
      "linears in bf16 %zu B; VRAM in use %zu vs %zu B\n",
      v.model, v.bits, sq.weight_bytes, sq.exl3_weight_bytes, stored, sb.weight_bytes, bf16_of_same, sq.vram_used,
      sb.vram_used);
  EXPECT_EQ(sq.exl3_weight_bytes, stored);
  EXPECT_EQ(sb.exl3_weight_bytes, 0u);
  EXPECT_EQ(sq.weight_bytes - sq.exl3_weight_bytes, sb.weight_bytes - bf16_of_same);
  EXPECT_LT(sq.weight_bytes, sb.weight_bytes);
}

// All experts behind a 2-slot LRU cache (their stored bytes copied per miss), or mixed VRAM/cache/CPU, equal the
// all-VRAM engine; a budget for half the experts' EXL3 bytes keeps about half of them in VRAM.
// The reference engine's placement with every expert in host memory (variant 0: behind the LRU cache) or mixed
// (variant 1: VRAM, cache and CPU by id % 3).
std::vector<std::vector<ExpertPlacement>> hybrid_placement(const CudaEngine& ref, int variant) {
  std::vector<std::vector<ExpertPlacement>> p = ref.placement();
  for (auto& layer : p)
    for (size_t e = 0; e < layer.size(); ++e) layer[e] = variant == 0 ? ExpertPlacement::Cache : ExpertPlacement(e % 3);
  return p;
}

// The all-VRAM engine and its logits over the first 40 reference ids and 8 decode steps after them: what the
// placement tests compare against.
struct AllVramReference {
  std::unique_ptr<CudaEngine> engine;
  int64_t V = 0;
  std::vector<int32_t> prompt, steps;
  std::vector<float> logits;
};
AllVramReference all_vram_reference(const std::string& dir, const char* model) {
  AllVramReference r;
  r.engine = gpu(dir);
  r.V = r.engine->vocab_size();
  const auto in = ids(model, "gen_ids");
  r.prompt.assign(in.begin(), in.begin() + 40), r.steps.assign(in.begin() + 40, in.begin() + 48);
  r.logits = test::prefill_then_steps(*r.engine, r.prompt, r.steps);
  return r;
}

TEST_P(CudaExl3, HybridPlacementsAndBudget) {
  SKIP_WITHOUT_CUDA();
  const std::string dir = exl3_tiny(GetParam());
  auto ref_engine = gpu(dir);
  const int64_t V = ref_engine->vocab_size();
  auto in = ids(GetParam().model, "gen_ids");
  std::vector<int32_t> prompt(in.begin(), in.begin() + 40), steps(in.begin() + 40, in.begin() + 48);
  auto run = [&](CudaEngine& e) { return test::prefill_then_steps(e, prompt, steps); };
  const auto ref = run(*ref_engine);
  for (int variant = 0; variant < 2; ++variant) {
    CudaEngineOptions opt;
    opt.cache_slots = 2;
    opt.stream_cold = false;  // CPU experts stay on the CPU (streaming: below)
    opt.placement = hybrid_placement(*ref_engine, variant);
    auto e = gpu(dir, opt);
    expect_close(run(*e), ref, V, 1e-2, variant == 0 ? "EXL3 all-cache vs all-VRAM" : "EXL3 mixed vs all-VRAM");
    EXPECT_GT(e->stats().cache_misses, 2);
    EXPECT_EQ(e->stats().graph_replays, 0);
  }
  // Every expert on the CPU, streamed through 2 LRU slots from the host weights as the per-pass split decides, with
  // fixed rates (no timing): a slow CPU streams everything; a slow link but a CPU that is cheap for one token and
  // dear for more streams the prefill's multi-token experts and runs the 1-token ones (all of decode but those
  // left in a slot) on the CPU.
  struct Rates {
    const char* name;
    double pcie_gbps, cpu_expert_ms, cpu_token_ms;
    bool all_streamed;
  };
  for (const Rates& r :
       {Rates{"all streamed", 1e6, 1e6, 0, true}, Rates{"multi-token streamed", 1e-3, 1e-3, 1e6, false}}) {
    CudaEngineOptions opt;
    opt.pcie_gbps = r.pcie_gbps;
    opt.cpu_expert_ms = r.cpu_expert_ms;
    opt.cpu_token_ms = r.cpu_token_ms;
    opt.placement = ref_engine->placement();
    for (auto& layer : opt.placement) std::fill(layer.begin(), layer.end(), ExpertPlacement::Cpu);
    auto e = gpu(dir, opt);
    expect_close(run(*e), ref, V, 1e-2, (std::string("EXL3 ") + r.name + " vs all-VRAM").c_str());
    const CudaEngineStats st = e->stats();
    std::printf("[ info ] %s %s: misses %ld, fetched %.2f MiB, cpu expert tokens %ld\n", GetParam().model, r.name,
                long(st.cache_misses), st.fetched_bytes / double(1 << 20), long(st.cpu_expert_tokens));
    EXPECT_GT(st.fetched_bytes, 0.0) << r.name;
    if (r.all_streamed) EXPECT_EQ(st.cpu_expert_tokens, 0);
    else EXPECT_GT(st.cpu_expert_tokens, 0);
    EXPECT_GT(st.routed_selections, 0);
    EXPECT_LE(st.vram_selections, st.routed_selections);
  }
  // Budget: everything but half of the routed experts' bytes.
  size_t expert_bytes = 0;
  auto pkg = ModelPackage::open(dir);
  for (const std::string& n : pkg->names())
    if (n.find(".mlp.experts.") != std::string::npos &&
        (n.ends_with(".trellis") || n.ends_with(".suh") || n.ends_with(".svh")))
      expert_bytes += pkg->require(n).nbytes;
  // What the plan reserves per sequence: its caches and, with recurrent state, the most checkpoints it keeps (one per
  // multi-token forward). Under a budget the embedding table stays in host memory (CudaEngineOptions::host_embedding).
  const double table = double(V) * double(ref_engine->hidden_size()) * 2;
  const double used = double(ref_engine->stats().vram_used) - table;
  auto largest = ref_engine->new_sequence();
  for (size_t i = 0; i + 2 <= 16; i += 2)
    ref_engine->forward(*largest, std::vector<int32_t>(prompt.begin() + int64_t(i), prompt.begin() + int64_t(i) + 2));
  CudaEngineOptions part;
  part.max_ctx = ref_engine->max_context();
  part.stream_cold = false;  // no streaming slots reserved: the budget is split between VRAM and CPU experts only
  part.vram_budget_gib = (used + double(largest->bytes()) - 0.5 * double(expert_bytes)) / double(1ull << 30);
  auto e = gpu(dir, part);
  EXPECT_EQ(double(e->stats().host_embedding_bytes), table);
  int cpu = 0, vram = 0;
  for (auto& l : e->placement())
    for (auto p : l) (p == ExpertPlacement::Cpu ? cpu : vram)++;
  std::printf("[ info ] %s EXL3 budget %.2f MiB: %d experts in VRAM, %d on the CPU\n", GetParam().model,
              part.vram_budget_gib * 1024, vram, cpu);
  EXPECT_GT(cpu, 0);
  EXPECT_GE(vram, (vram + cpu) * 2 / 5);  // bf16-sized accounting would fit far fewer at K = 2
  auto seq = e->new_sequence();
  EXPECT_EQ(e->forward(*seq, prompt).size(), size_t(V));
  EXPECT_LE(e->stats().vram_used, e->stats().vram_budget);
}

// Zero copy (CudaEngineOptions::zero_copy_cold): decode reads the experts that are not in VRAM in place from the
// page-locked host weights (unaligned trellises from an aligned pinned copy) inside the grouped GEMVs, replayed from
// graphs, so it computes what the all-VRAM engine computes; prefill keeps the host-planned path. Every expert in host
// memory, and a mixed placement (VRAM, cache, CPU with host copies).
TEST_P(CudaExl3, ZeroCopyExpertsMatchAllVram) {
  SKIP_WITHOUT_CUDA();
  const std::string dir = exl3_tiny(GetParam());
  const AllVramReference r = all_vram_reference(dir, GetParam().model);
  int64_t moe_layers = 0;
  for (const auto& l : r.engine->placement()) moe_layers += !l.empty();
  for (int variant = 0; variant < 2; ++variant) {
    CudaEngineOptions opt;
    opt.zero_copy_cold = true;
    opt.cache_slots = 2;
    opt.placement = hybrid_placement(*r.engine, variant);
    const char* what = variant == 0 ? "EXL3 zero copy, all in host memory" : "EXL3 zero copy, mixed";
    auto e = gpu(dir, opt);
    const auto out = test::prefill_then_steps(*e, r.prompt, r.steps);
    const CudaEngineStats st = e->stats();
    std::printf("[ info ] %s %s: %ld of %ld MoE layers read in place, %ld selections (%.2f MiB), graph replays %ld\n",
                GetParam().model, what, long(st.zero_copy_layers), long(moe_layers), long(st.zero_copy_selections),
                st.zero_copy_bytes / double(1 << 20), long(st.graph_replays));
    EXPECT_EQ(st.zero_copy_layers, moe_layers) << what;
    EXPECT_GT(st.zero_copy_selections, 0) << what;
    EXPECT_GT(st.graph_replays, 0) << what;  // decode as one graph per step
    expect_close(out, r.logits, r.V, 1e-2, what);
  }
}

// Decode under a budget (prefetch_experts, grouped_hybrid_decode): each host-planned decode layer routes its input
// through the next layer's router and starts copying those picks into that layer's slots; passes whose slot experts
// fit the slots run through the grouped GEMVs. Where an expert runs does not change (Cache experts run on the GPU
// either way; without streaming, CPU experts have no host copy to prefetch), only when its copy starts and which
// launches compute it: the logits stay within summation-order differences of on-demand copies an expert at a time,
// with few slots (mostly an expert at a time) and with enough for every pass to go grouped.
TEST_P(CudaExl3, PrefetchAndGroupedHybridMatchOnDemandCopies) {
  SKIP_WITHOUT_CUDA();
  const std::string dir = exl3_tiny(GetParam());
  const AllVramReference r = all_vram_reference(dir, GetParam().model);
  struct Mode {
    int prefetch;
    bool grouped;
  };
  for (int slots : {2, 16})
    for (int variant = 0; variant < 2; ++variant) {
      std::vector<float> one_by_one;
      for (Mode mode : {Mode{0, false}, Mode{4, false}, Mode{0, true}, Mode{4, true}}) {
        CudaEngineOptions opt;
        opt.cache_slots = slots;
        opt.stream_cold = false;
        opt.prefetch_experts = mode.prefetch;
        opt.grouped_hybrid_decode = mode.grouped;
        opt.placement = hybrid_placement(*r.engine, variant);
        auto e = gpu(dir, opt);
        const auto out = test::prefill_then_steps(*e, r.prompt, r.steps);
        const CudaEngineStats st = e->stats();
        const std::string what = std::string(variant == 0 ? "all cache" : "mixed") + ", " + std::to_string(slots) +
                                 " slots, prefetch " + std::to_string(mode.prefetch) +
                                 (mode.grouped ? ", grouped" : ", one by one");
        std::printf("[ info ] %s %s: misses %ld, prefetched %ld, used %ld, grouped passes %ld, fetched %.2f MiB\n",
                    GetParam().model, what.c_str(), long(st.cache_misses), long(st.prefetched_experts),
                    long(st.prefetch_hits), long(st.grouped_hybrid_passes), st.fetched_bytes / double(1 << 20));
        expect_close(out, r.logits, r.V, 1e-2, what.c_str());
        // (16 slots hold every expert of these tiny layers after the first steps: nothing left to prefetch)
        if (mode.prefetch == 0) {
          EXPECT_EQ(st.prefetched_experts, 0) << what;
        } else if (slots == 2) {
          EXPECT_GT(st.prefetched_experts, 0) << what;
        }
        EXPECT_LE(st.prefetch_hits, st.prefetched_experts) << what;
        if (!mode.grouped) {
          EXPECT_EQ(st.grouped_hybrid_passes, 0) << what;
        } else if (slots == 16 && variant == 0) {
          EXPECT_GT(st.grouped_hybrid_passes, 0) << what;
        }
        if (mode.prefetch == 0 && !mode.grouped) {
          one_by_one = out;
          continue;
        }
        if (!mode.grouped) {  // the same launches per expert, only the copies start earlier
          ASSERT_EQ(out.size(), one_by_one.size()) << what;
          for (size_t i = 0; i < out.size(); ++i) ASSERT_EQ(out[i], one_by_one[i]) << what << ", value " << i;
        } else {  // the grouped GEMVs split K by their row count: the same products summed in another order
          ASSERT_EQ(out.size(), one_by_one.size()) << what;
          const double worst =
              testing::max_rel_row_error(out.data(), one_by_one.data(), int64_t(out.size()) / r.V, r.V);
          std::printf("[ info ] %s against an expert at a time: worst rel error %.2e\n", what.c_str(), worst);
          EXPECT_LE(worst, 1e-4) << what;
        }
      }
    }
}

// Host-planned prefill passes with the resident experts (then also the copied ones) on the hybrid lanes (their own
// streams, cuBLAS handles and scratch) against one stream: a 40-token prompt (copies queued ahead) and a 96-token one
// (a streaming pass through the window), experts in VRAM, in LRU slots and on the CPU or streamed; 4 decode steps after
// each.
TEST_P(CudaExl3, HybridLanesMatchOneStream) {
  SKIP_WITHOUT_CUDA();
  const std::string dir = exl3_tiny(GetParam());
  const AllVramReference r = all_vram_reference(dir, GetParam().model);
  const auto in = ids(GetParam().model, "gen_ids");
  std::vector<int32_t> long_prompt;
  while (long_prompt.size() < 96) long_prompt.insert(long_prompt.end(), in.begin(), in.end());
  long_prompt.resize(96);
  const std::vector<int32_t> steps(r.steps.begin(), r.steps.begin() + 4);
  int64_t laned = 0;
  const std::vector<int32_t>* prompts[] = {&r.prompt, &long_prompt};
  for (const std::vector<int32_t>* prompt : prompts) {
    const auto ref = test::prefill_then_steps(*r.engine, *prompt, steps);
    for (int variant = 0; variant < 2; ++variant)
      for (bool stream_cold : {false, true}) {
        std::vector<float> one_stream;
        for (int mode : {0, 1, 2}) {  // no lanes, 2 lanes for the resident experts, 2 lanes for all of them
          const int lanes = mode == 0 ? 0 : 2;
          CudaEngineOptions opt;
          opt.cache_slots = 4;
          opt.stream_cold = stream_cold;
          opt.hybrid_lanes = lanes;
          opt.hybrid_lanes_copied = mode == 2;
          if (stream_cold) {  // fixed rates (a slow CPU): every run splits alike, all cold experts over the link
            opt.pcie_gbps = 25;
            opt.cpu_expert_ms = opt.cpu_token_ms = 1e3;
          }
          opt.placement = hybrid_placement(*r.engine, variant);
          auto e = gpu(dir, opt);
          const auto out = test::prefill_then_steps(*e, *prompt, steps);
          const std::string what = std::to_string(prompt->size()) + " tokens, " +
                                   (variant == 0 ? "all cache" : "mixed") + (stream_cold ? ", streamed" : "") + ", " +
                                   std::to_string(lanes) + " lanes" + (mode == 2 ? " (copied too)" : "");
          expect_close(out, ref, r.V, 1e-2, what.c_str());
          const int64_t runs = e->stats().laned_expert_runs;
          if (lanes == 0) {
            EXPECT_EQ(runs, 0) << what;
            one_stream = out;
            continue;
          }
          laned += runs;
          ASSERT_EQ(out.size(), one_stream.size()) << what;
          // the same kernels per expert; cuBLAS may pick another algorithm per handle
          const double worst =
              testing::max_rel_row_error(out.data(), one_stream.data(), int64_t(out.size()) / r.V, r.V);
          std::printf("[ info ] %s %s: %ld expert runs on lanes, worst rel error against one stream %.2e\n",
                      GetParam().model, what.c_str(), long(runs), worst);
          EXPECT_LE(worst, 1e-4) << what;
        }
      }
  }
  EXPECT_GT(laned, 0);
}

// Lent pass arena: with 2 LRU slots per layer, decode steps also hold experts in the large pass buffers' memory
// (lent slots), and a prompt after them takes it back. A 40-token prompt, 4 steps, the 40 tokens again, 4 steps:
// the logits as without lending (and as all in VRAM), more cache hits, every switch counted.
TEST_P(CudaExl3, LentSlotsServeDecode) {
  SKIP_WITHOUT_CUDA();
  const std::string dir = exl3_tiny(GetParam());
  const AllVramReference r = all_vram_reference(dir, GetParam().model);
  const std::vector<int32_t> steps(r.steps.begin(), r.steps.begin() + 4);
  auto run = [&](Engine& e) {
    auto seq = e.new_sequence();
    std::vector<float> out;
    for (int round = 0; round < 2; ++round) {
      const std::vector<float> p = e.forward(*seq, r.prompt, true);
      out.insert(out.end(), p.begin(), p.end());
      for (int32_t t : steps) {
        const std::vector<float> l = e.forward(*seq, {t});
        out.insert(out.end(), l.begin(), l.end());
      }
    }
    return out;
  };
  const std::vector<float> ref = run(*r.engine);
  std::vector<float> plain;
  int64_t plain_hits = 0;
  for (bool lend : {false, true}) {
    CudaEngineOptions opt;
    opt.cache_slots = 2;
    opt.stream_cold = false;
    opt.lend_pass_arena = lend;
    opt.lend_min_gib = 0;  // the tiny models' arenas are a few MiB
    opt.placement = hybrid_placement(*r.engine, 0);
    auto e = gpu(dir, opt);
    const std::vector<float> out = run(*e);
    const CudaEngineStats st = e->stats();
    const char* what = lend ? "lent slots" : "plan slots only";
    expect_close(out, ref, r.V, 1e-2, what);
    std::printf("[ info ] %s %s: %ld lent slots, %ld arena switches, cache hits %ld misses %ld\n", GetParam().model,
                what, long(st.lent_slots), long(st.arena_switches), long(st.cache_hits), long(st.cache_misses));
    if (!lend) {
      EXPECT_EQ(st.lent_slots, 0);
      EXPECT_EQ(st.arena_switches, 0);
      plain = out, plain_hits = st.cache_hits;
      continue;
    }
    EXPECT_GT(st.lent_slots, 0);
    EXPECT_EQ(st.arena_switches, 4);  // prompt, steps, prompt, steps (the engine starts lending)
    EXPECT_GT(st.cache_hits, plain_hits);
    ASSERT_EQ(out.size(), plain.size());
    EXPECT_LE(testing::max_rel_row_error(out.data(), plain.data(), int64_t(out.size()) / r.V, r.V), 1e-4)
        << "lent slots against plan slots only";
  }
}

INSTANTIATE_TEST_SUITE_P(HfTiny, CudaExl3, ::testing::ValuesIn(kVariants),
                         [](const ::testing::TestParamInfo<Variant>& i) { return std::string(i.param.model); });

#else

TEST(CudaExl3, SkippedWithoutCudaBuild) {
  EXPECT_FALSE(cuda_available());
  GTEST_SKIP() << "built without MOESRV_CUDA";
}

#endif

}  // namespace
}  // namespace moesrv
