// The CUDA inference engine: every dense op on the GPU (bf16 weights, or EXL3 weights kept in their trellis form;
// fp32 accumulation), routed experts in VRAM, in a per-layer LRU VRAM cache fed over PCIe from host memory, or on
// the CPU (hybrid; streamed through the LRU slots instead when a pass routes them many tokens).
// Plain C++ header (no CUDA types) so CPU-only code can include it; the engine exists only in CUDA builds.
#pragma once
#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "backend/engine.h"
#include "backend/expert_plan.h"
#include "backend/stage_activations.h"
#include "format/package.h"

namespace moesrv {

struct ModelSpec;

// True when this build has the CUDA backend and a CUDA device is visible (always false in CPU builds).
bool cuda_available();
// Linear-attention key head sizes the CUDA delta-rule kernel is instantiated for (linear_attention.cu).
constexpr bool cuda_delta_rule_supports(int64_t dk) {
  return dk == 32 || dk == 64 || dk == 96 || dk == 128 || dk == 192 || dk == 256;
}
// Visible CUDA devices (0 in CPU builds).
int cuda_device_count();

// LRU slots a prefill pass streams cold experts through (each miss recycles the pass's own last admissions).
constexpr int32_t kPrefillStreamSlots = 4;

struct CudaEngineOptions {
  std::string served_name;
  // The package's config, already parsed (ModelSpec::from_json(pkg->config())); null: the engine parses it.
  std::shared_ptr<const ModelSpec> spec;
  int device = 0;
  int64_t max_ctx = 0;           // tokens per sequence the KV cache holds; 0: min(max_position, 32768)
  int64_t prefill_chunk = 8192;  // tokens per prefill pass
  // Passes per prefill group: a prompt's passes run layer by layer in groups of this many (the mixers pass by pass,
  // everything per token over the whole group, so the MoE reads, dequantizes or streams each expert once per group
  // instead of once per pass). Costs the group's residual streams and MoE rows in VRAM (GLM-5.3-Flash: ~105 KB per
  // token). 1: off. MOESRV_PREFILL_GROUP=N overrides.
  int64_t prefill_group = 1;
  bool use_graph = true;         // replay single-token decode from one CUDA graph
  bool kv_q8 = false;            // attention cache as int8 with a per-token scale (else bf16)
  double vram_budget_gib = 0;    // 0: the device's free memory; every allocation is accounted against it
  // [layer][expert] placement; empty (or a layer's empty) and no plan_placement: VRAM while the budget allows, then
  // the CPU (fill_in_order in backend/expert_plan.h; the engines the factory opens always take the runtime's plan).
  std::vector<std::vector<ExpertPlacement>> placement;
  // Called once the engine's own memory is allocated (dense weights, activations and scratch for prefill_chunk
  // tokens, the reserved sequences: `engine_bytes`), before the experts are placed, with the engine's budget
  // (vram_budget_gib, else the device's free memory): it may set placement, cache_slots, cache_slots_per_layer (the
  // runtime planner, runtime/engine_factory.h, which then plans with the engine's true workspace).
  std::function<void(size_t engine_bytes, size_t budget_bytes, CudaEngineOptions& options)> plan_placement;
  int cache_slots = 4;           // LRU slots per MoE layer that has Cache experts
  std::vector<int> cache_slots_per_layer;  // overrides cache_slots where given (> 0)
  int64_t reserve_sequences = 1; // KV caches of max_ctx the automatic plan keeps room for
  // Cold experts: a Cpu-placed EXL3 expert that is not in a slot either runs on the CPU or is copied over PCIe (as
  // stored) into the layer's LRU slots and runs on the GPU, chosen per pass by split_cold (backend/cold_split.h)
  // from the pass's tokens per expert and the rates below (a prefill streams nearly all; a decode step balances
  // the link against the CPU). false: Cpu experts always run on the CPU.
  bool stream_cold = true;
  // Decode (<= 8 tokens a pass) reads the EXL3 experts that are not in VRAM in place from the page-locked host
  // weights, inside the grouped GEMVs over PCIe (zero copy): no routing round trip to the host per layer, the step
  // replays as one CUDA graph; the LRU slots then serve prefill passes only. Layers whose host experts cannot be
  // read so (bf16, a trellis not 16-byte aligned in the package) keep the host-planned path. Off until measured on
  // a GPU; MOESRV_ZERO_COPY=1 turns it on.
  bool zero_copy_cold = false;
  // Decode passes (<= 8 tokens) under a budget: each MoE layer also routes its input through the next MoE layer's
  // router and starts copying up to this many of those picks that are not in VRAM or a slot yet (the most picked
  // first) into that layer's LRU slots, behind its own misses on the copy stream, so the link works while the GPU
  // computes. 1 (the highest-scored pick: 70-79% used, +6-10% decode at 22 / 44 GiB on an H100; 3 gained nothing:
  // docs/perf-cuda.md, sixteenth round); 0: off. MOESRV_PREFETCH_EXPERTS=N overrides.
  int prefetch_experts = 1;
  // Decode passes under a budget whose experts all run on the GPU and whose slot experts fit the layer's slots at
  // once: the EXL3 experts (in VRAM or in a slot) through the grouped GEMVs as all-VRAM decode does (~8 launches per
  // layer instead of ~7 per expert), those ready first while the link copies the rest. false (or
  // MOESRV_HYBRID_GROUPED=0): an expert at a time.
  bool grouped_hybrid_decode = true;
  // Host-planned passes of more tokens (prefill under a budget): the EXL3 experts with GEMM-sized row counts that
  // need no copy (in VRAM or already in a slot) run on this many more streams (lanes: each with its own cuBLAS handle
  // and EXL3 scratch, allocated before the expert plan so the plan counts it, at most an eighth of the budget's room),
  // so the link's copies and the resident experts' GEMMs overlap instead of queueing behind each other. 0: one
  // stream. MOESRV_HYBRID_LANES=N overrides.
  int hybrid_lanes = 2;
  // The copied ones too: every such expert runs on the least loaded of the main stream and the lanes (by rows), after
  // its own copy, so the copied experts' GEMMs overlap each other as well. false (or MOESRV_LANES_COPIED=0): the
  // resident ones on the lanes, the copied ones on the main stream in copy order.
  bool hybrid_lanes_copied = true;
  // Prefill passes stream their cache misses through this many of the layer's LRU slots (recycled in turn; all of
  // them when it has fewer): copies run at most this many experts ahead of the GPU. MOESRV_STREAM_WINDOW=N overrides.
  int stream_window = 16;
  // Under a budget or placement: forwards of at most 32 tokens (decode, verifies, batched steps) run on pass buffers
  // of their own size, and the large pass buffers' memory (residual streams, hidden rows, the mixers' buffers of a
  // prefill pass: ~7 GB for GLM-5.3-Flash at 8K-token passes x 4) serves meanwhile as more LRU expert slots, shared
  // out equally over the MoE layers with experts outside VRAM. A longer forward takes it back (their experts become
  // misses). false (or MOESRV_LEND_ARENA=0): the slots the plan gives only.
  bool lend_pass_arena = true;
  // LRU slots outside a prefill's streaming: the victim is the least routed (decayed lookup counts) of this many least
  // recently used experts (ExpertCache::set_victim_window; 1: plain LRU, --cache-policy lru; 16, the default: decode
  // +12% at 22 GiB and +10% at 44 GiB on an H100, docs/perf-cuda.md "Eighteenth round"). MOESRV_CACHE_VICTIM_WINDOW=N
  // overrides.
  static constexpr int kLfuVictimWindow = 16;
  int cache_victim_window = kLfuVictimWindow;
  // Shares the arena is cut into (0: this engine's MoE layers with experts outside VRAM). A slice of a larger model
  // gives the whole model's count, so each of its layers gets the lent slots it would get in the whole model.
  int lend_share_layers = 0;
  // Only an arena of at least this size is lent (a smaller one holds few experts, and the small set costs memory).
  double lend_min_gib = 1.0;
  // Under a budget or placement: the token embedding table stays in mapped page-locked host memory (a pass reads its
  // tokens' rows over PCIe: 8 KB a token for GLM-5.3-Flash), so its VRAM (1.2 GiB there) holds experts instead.
  // false (or MOESRV_HOST_EMBED=0), or no page-locked memory to spare (a line on stderr): in VRAM.
  bool host_embedding = true;
  // Rates of that split; 0: measured when the engine starts (a timed expert copy, a timed CPU expert at 1 and 8
  // tokens), and the CPU ones updated from every CPU expert run.
  double pcie_gbps = 0, cpu_expert_ms = 0, cpu_token_ms = 0;
  // Decode passes through the grouped GEMVs under a budget (grouped_hybrid_decode) with experts to copy: the CPU
  // computes the first intermediate rows of the last one to cross the link (whole blocks of 128; cpu::ExpertRows
  // slices), as many as the rates above say it finishes while the link carries the rest, and only the rest crosses
  // before the GPU computes it; the skipped rows follow once the GPU has read the slot (HostExperts::top_up), off
  // this layer's critical path. The CPU's share joins y in the final combine. MOESRV_CPU_SLICES=0/1 overrides;
  // cpu_slice_blocks > 0 (tests) fixes the blocks the CPU takes whatever the rates say.
  bool cpu_expert_slices = false;
  int cpu_slice_blocks = 0;
  // false (or MOESRV_CPU_SLICE_TOPUP=0): no top-up; the sliced expert leaves its slot instead (a miss next time), so
  // its skipped rows never cross the link.
  bool cpu_slice_top_up = true;
  // true (or MOESRV_CPU_SLICE_GATEUP_WHOLE=1): gate's and up's trellises cross whole (contiguous copies) and only
  // down's rows are skipped; false: gate's and up's columns of the CPU's rows are skipped too (strided copies).
  bool cpu_slice_gate_up_whole = false;
  // MLA decode (<= 8 tokens a pass) through the key-split kernel (mla_split.cu: each key tile shared by 8 heads)
  // instead of attention()'s block per (token, head), which re-reads every key row per head (876 us vs tens of us per
  // MLA layer at 2,048 selected keys on an H200). false: the per-head kernel (tests compare the two).
  bool mla_split_decode = true;
  // MLA of more tokens (prefill) on tensor cores (mla_prefill.cu: the 16 heads of a block share each staged key tile;
  // fp16 MMA inputs) where the shapes allow (bf16 cache, widths multiples of 8); false: attention().
  bool mla_tc_prefill = true;
  // forward_argmax picks the id on the device (an argmax kernel; 4 bytes back, the row fetched only on demand);
  // false: Engine's default (the 620 KB row of GLM-5.3-Flash comes back, std::max_element on the host).
  // MOESRV_DEVICE_ARGMAX=0 / 1 overrides it (comparisons).
  bool device_argmax = true;
  // Decode overlaps (MOESRV_KPOOL_SIDE / MOESRV_SHARED_SIDE = 0 or 1 override them): the k-pool indexer's query right
  // after the q_a norm and its pools and selection on the projection side stream beside q_b and the query absorption;
  // the shared expert (when it has the routed experts' EXL3 shapes) on that side stream beside the router and the
  // routed experts. Default since session 42 (docs/perf-cuda.md, "Thirty-third round").
  bool kpool_beside_query = true, shared_expert_beside_router = true;
  // Forwards of 2..4 tokens (MTP verifies, batched steps) with EXL3 weights: linears through the R-row GEMV (the
  // decoded weights shared by the rows, fp32-accurate inputs; 2.2-2.4x faster than the fp16-input batch kernel on an
  // H100, docs/perf-cuda.md "Tenth round"); false (or MOESRV_EXL3_GEMV_ROWS=0): the batch kernel.
  bool row_gemv = true;
  // Their grouped MoE with the entries that pick the same expert merged (each expert read once for its tokens). Off:
  // slower than one entry per pick unless the tokens share many experts (same measurement; again on the H100 in
  // docs/perf-cuda.md "Thirty-second round": slower at random picks, 2-5% faster where they share half).
  // MOESRV_EXL3_MERGE_ROWS=1 turns it on.
  bool merge_expert_rows = false;
  // The layers this engine holds, [layer_begin, layer_end) (layer_end < 0: to the last layer): a pipeline stage
  // uploads only their weights, experts and caches; the embedding only with layer 0, the final norm and lm_head
  // only with the last layer. forward() needs the whole model; a stage runs through the entry points below.
  int64_t layer_begin = 0, layer_end = -1;
  // Loads the checkpoint's MTP block (when it has one) for speculative decoding (CudaEngine::mtp(), --speculative):
  // its layer's dense weights and scratch before the model's experts are placed, its experts after them (VRAM while
  // the budget allows, else host memory).
  bool mtp = false;
  // Device time per block kind of every pass of more than one token (events between the blocks, read back at the
  // end of the pass) into CudaEngineStats::phase_s: a measuring aid for prefill, off by default.
  bool time_phases = false;
  // Sorted expert rows per wave of a host-planned MoE pass (tests: small values cut experts across waves); 0 or
  // more than the expert buffers hold: their height.
  int64_t moe_wave_rows = 0;
  // All-VRAM EXL3 prefill experts: pieces of at most this many sorted rows go through the grouped EXL3 GEMM (the
  // trellis decoded per tile of exl3_gemm_tile_rows()), larger ones through dequantization + cuBLAS (decoded once per
  // piece), both within one wave. -1: MOESRV_EXL3_GROUPED_GEMM (0: none, 1: every piece, N: at most N rows), else
  // kExl3GroupedRowsDefault. (H100, 8K slice: experts phase 0.953 s at 512 rows, 1.086 with none; docs/perf-cuda.md.)
  static constexpr int64_t kExl3GroupedRowsDefault = 512;
  int64_t exl3_grouped_rows = -1;
};

// Block kinds of CudaEngineStats::phase_s. Residual: embedding, norms, mHC enter/leave; AttnProj: attention's
// linears and norms; AttnAbsorb: MLA's per-head query / output absorption; AttnCore: rope, attention;
// LinearProj / LinearCore: a linear-attention layer's projections, conv, gates, output norm / the delta rule; Router:
// router GEMM, routing, the host plan of a hybrid pass; Experts: shared and routed experts and their combine.
enum class CudaPhase : int {
  Residual,
  AttnProj,
  Indexer,
  AttnAbsorb,
  AttnCore,
  LinearProj,
  LinearCore,
  Router,
  Experts,
  Mlp,
  Count
};
const char* cuda_phase_name(CudaPhase p);

// Counters for tests and benchmarks.
struct CudaEngineStats {
  int64_t graph_replays = 0, graph_captures = 0;
  int64_t graph_nodes = 0;  // nodes of the last captured decode graph
  int64_t cache_hits = 0, cache_misses = 0;
  int64_t placement_moved = 0;  // VRAM experts of the given placement moved to host memory to fit the budget
  int64_t cpu_expert_tokens = 0;
  // Host-planned MoE passes (hybrid placements; the all-in-VRAM path is not counted): token-expert selections,
  // those served from VRAM (resident or already-cached experts), expert bytes copied over PCIe on misses and
  // expert bytes the CPU read (once per expert per pass).
  int64_t routed_selections = 0, vram_selections = 0;
  double fetched_bytes = 0, cpu_expert_bytes = 0;  // fetched_bytes: prefetches included
  // Experts copied ahead of their layer's routing (prefetch_experts), and those of them the routing then picked.
  int64_t prefetched_experts = 0, prefetch_hits = 0;
  int64_t grouped_hybrid_passes = 0;  // host-planned passes through the grouped GEMVs (grouped_hybrid_decode)
  int64_t hybrid_passes = 0;          // host-planned passes (moe_hybrid), every path
  // cpu_expert_slices: the passes whose last copied expert the CPU computed a slice of, and the rows it computed.
  int64_t cpu_slices = 0, cpu_slice_rows = 0;
  double cpu_slice_s = 0;      // the CPU's wall time on them (add_routed_experts), summed
  double cpu_slice_scale = 0;  // the last slice's decayed ratio of measured to estimated CPU time
  // The cold split's rates as the engine started with them (given or measured; 0: none).
  double cold_pcie_gbps = 0, cold_cpu_expert_ms = 0, cpu_slice_fixed_ms = 0;
  int64_t laned_expert_runs = 0;      // host-planned expert runs on the hybrid lanes (hybrid_lanes)
  // All-VRAM EXL3 prefill expert pieces through the grouped GEMM and through dequantization + cuBLAS
  // (CudaEngineOptions::exl3_grouped_rows).
  int64_t grouped_gemm_pieces = 0, dequant_gemm_pieces = 0;
  // The hybrid settings in effect (options and their environment overrides): lanes made (0: none), whether the copied
  // experts use them, the prefill copy window.
  int hybrid_lanes = 0, stream_window = 0;
  bool hybrid_lanes_copied = false;
  // lend_pass_arena: the lent slots made (all layers), and the forwards that switched between lending the arena and
  // taking it back.
  int64_t lent_slots = 0, arena_switches = 0;
  size_t host_embedding_bytes = 0;  // the embedding table kept in host memory (CudaEngineOptions::host_embedding)
  // zero_copy_cold: layers that read their host experts in place, and the selections of those experts (counted on
  // the device, every pass, read when stats() is called) with their bytes.
  int64_t zero_copy_layers = 0, zero_copy_selections = 0;
  double zero_copy_bytes = 0;
  size_t vram_used = 0, vram_budget = 0;
  size_t weight_bytes = 0;       // device weights (dense + VRAM experts), as uploaded
  size_t exl3_weight_bytes = 0;  // of which EXL3 linears kept as stored (trellis | suh | svh)
  std::array<double, size_t(CudaPhase::Count)> phase_s{};  // seconds per block kind (options.time_phases)
};

class CudaEngine : public Engine, public MtpEngine {
 public:
  CudaEngine(std::shared_ptr<ModelPackage> pkg, const CudaEngineOptions& opt);
  ~CudaEngine() override;

  std::string name() const override;
  int64_t vocab_size() const override;
  int64_t max_context() const override;
  // Tokens per forward call a prompt should come in: a prefill group's, prefill_chunk x prefill_group.
  int64_t prefill_chunk() const override;
  std::unique_ptr<SequenceState> new_sequence() const override;
  // Sequences may be created, cloned, truncated and freed on other threads while a forward runs (each of those waits
  // until the forward is done; the server's --max-batch). Decode steps of several sequences run one after another.
  bool concurrent_sequence_ops() const override { return true; }
  // Device bytes of one sequence whatever its length (its caches hold the whole context from the start), with its
  // checkpoints, rollback points and (with the MTP block) the block's own sequence: what --state-memory-mb counts.
  uint64_t sequence_bytes(int64_t tokens) const override;
  std::vector<float> forward(SequenceState& seq, const std::vector<int32_t>& tokens, bool all_logits = false) override;
  // With CudaEngineOptions::device_argmax: the argmax on the device after the decode graph, 4 bytes back, the row
  // stays on the device until the next forward; else Engine's default.
  int32_t forward_argmax(SequenceState& seq, const std::vector<int32_t>& tokens) override;
  std::vector<float> argmax_logits() override;
  // One decode step of several sequences: up to 4 at a time in one pass (the weights read once for their rows, the
  // attention and recurrence per row; a graph per set of sequences when all experts are in VRAM); logits as each
  // sequence's forward gives them, within the suites' tolerances. MOESRV_CUDA_BATCH=0: one forward per sequence.
  std::vector<std::vector<float>> forward_batch(const std::vector<SequenceState*>& seqs,
                                                const std::vector<int32_t>& tokens) override;

  // Routed-expert selections counted on the device so far (for pinning hot experts at the next start).
  const UsageStats* expert_usage() const override;
  // Speculative decoding with the MTP block (CudaEngineOptions::mtp): this engine, or null without the block. A
  // verify (forward_hidden with rollback; it needs no MTP block) runs as one pass of at most 4 tokens, replayed from a
  // graph per sequence and row count when all experts are in VRAM, and leaves the fixed-size state after each token
  // on the device (truncate() puts one back).
  MtpEngine* mtp() override;
  int64_t hidden_size() const override;
  std::vector<float> forward_hidden(SequenceState& seq, const std::vector<int32_t>& tokens, bool all_logits,
                                    bool rollback, std::vector<float>& hidden) override;
  std::unique_ptr<SequenceState> new_mtp_sequence() const override;
  std::vector<float> mtp_forward(SequenceState& mtp_seq, const std::vector<int32_t>& next,
                                 const std::vector<float>& hidden, std::vector<float>& hidden_out) override;
  CudaEngineStats stats() const;
  void set_use_graph(bool on);
  // The placement in effect (after automatic planning).
  const std::vector<std::vector<ExpertPlacement>>& placement() const;

  // Pipeline stage entry points (runtime/pipeline_cuda_stage.h): each sets this engine's device, copies the
  // activations in from host memory and out again. embed (needs layer 0): a.hidden = the embeddings of the
  // a.tokens tokens, [S, stream_width].
  void embed(const std::vector<int32_t>& tokens, StageActivations& a);
  // Layers [begin, end) of this engine's range on a.hidden in place, appending to seq (length a.pos0 + a.tokens
  // afterwards). a.selection as the CPU stage: read when the range starts with a shared-indexer layer, replaced
  // when the range runs an indexer.
  void forward_layers(SequenceState& seq, StageActivations& a, int64_t begin, int64_t end);
  // Final norm + lm_head over the last `rows` tokens of a.hidden (needs the last layer): [rows, vocab].
  std::vector<float> logits(const StageActivations& a, int64_t rows);
  int64_t num_layers() const;
  int64_t layer_begin() const;
  int64_t layer_end() const;
  int64_t stream_width() const;  // floats per token in StageActivations::hidden

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

// Defined only in CUDA builds (MOESRV_HAS_CUDA); check cuda_available() first.
std::unique_ptr<Engine> make_cuda_engine(std::shared_ptr<ModelPackage> pkg, const CudaEngineOptions& opt);

}  // namespace moesrv
