// Internals of the CUDA engine shared by its .cpp files (CUDA builds only): budgeted device memory,
// uploaded weights (bf16, or EXL3 trellis blocks), scratch, and the engine state.
#pragma once
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <array>
#include <cstdlib>
#include <deque>
#include <functional>
#include <initializer_list>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <utility>
#include <vector>

#include "backend/cold_split.h"
#include "backend/cuda/cuda_engine.h"
#include "backend/cuda/exl3_ops.h"
#include "backend/cuda/glm5_next_kernels.h"
#include "backend/cuda/host_experts.h"
#include "backend/cuda/kernels.h"
#include "backend/expert_cache.h"
#include "backend/expert_pass.h"
#include "backend/expert_plan.h"
#include "backend/pass_plan.h"
#include "backend/usage_stats.h"
#include "model/weights.h"
#include "util/error.h"

namespace moesrv {
class Exl3Linear;
namespace cpu {
struct RoutedRows;  // backend/cpu/expert_batch.h
}
}

namespace moesrv::cuda {

struct BatchRows;    // cuda_blocks.h
struct GroupPasses;  // cuda_blocks.h

#define MOESRV_CUDA_OK(expr)                                                                      \
  do {                                                                                            \
    cudaError_t err_ = (expr);                                                                    \
    if (err_ != cudaSuccess) {                                                                    \
      (void)cudaGetLastError(); /* a failed call is reported once, not again by the next check */ \
      ::moesrv::fail("CUDA error in {}: {}", #expr, cudaGetErrorString(err_));                    \
    }                                                                                             \
  } while (0)
#define MOESRV_CUBLAS_OK(expr)                                                              \
  do {                                                                                      \
    cublasStatus_t st_ = (expr);                                                            \
    if (st_ != CUBLAS_STATUS_SUCCESS) ::moesrv::fail("cuBLAS error {} in {}", int(st_), #expr); \
  } while (0)

// Every device allocation goes through here and counts against the VRAM budget (on `device` when >= 0, whichever
// device is current).
class DeviceBudget {
 public:
  explicit DeviceBudget(size_t limit, int device = -1) : limit_(limit), device_(device) {}
  void* alloc(size_t bytes, const char* what);
  void release(void* p, size_t bytes);
  size_t used() const { return used_; }
  size_t limit() const { return limit_; }
  size_t left() const { return used_ >= limit_ ? 0 : limit_ - used_; }

 private:
  std::mutex mu_;
  size_t limit_, used_ = 0;
  int device_ = -1;
};

class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(std::shared_ptr<DeviceBudget> b, size_t bytes, const char* what);
  // A view of `bytes` at p inside another buffer (not owned, not counted; that buffer must outlive it).
  static DeviceBuffer view(void* p, size_t bytes) {
    DeviceBuffer v;
    v.ptr_ = p, v.bytes_ = bytes;
    return v;
  }
  ~DeviceBuffer() { reset(); }
  DeviceBuffer(DeviceBuffer&& o) noexcept { *this = std::move(o); }
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept;
  void reset();
  template <typename T>
  T* as() const { return static_cast<T*>(ptr_); }
  size_t bytes() const { return bytes_; }

 private:
  std::shared_ptr<DeviceBudget> budget_;
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

// Makes `device` current for a scope and restores the previous one (stages of one host thread on several GPUs).
class DeviceGuard {
 public:
  explicit DeviceGuard(int device);
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int prev_ = -1;
};

// Pinned host memory (cudaHostAlloc), freed on destruction.
class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  // `mapped`: kernels may read it in place, at device() (zero copy over PCIe).
  explicit PinnedBuffer(size_t bytes, bool mapped = false);
  ~PinnedBuffer();
  PinnedBuffer(PinnedBuffer&& o) noexcept : ptr_(o.ptr_), dev_(o.dev_), bytes_(o.bytes_) { o.ptr_ = nullptr; }
  PinnedBuffer& operator=(PinnedBuffer&& o) noexcept;
  template <typename T>
  T* as() const { return static_cast<T*>(ptr_); }
  void* device() const { return dev_; }  // nullptr unless mapped
  size_t bytes() const { return bytes_; }

 private:
  void* ptr_ = nullptr;
  void* dev_ = nullptr;
  size_t bytes_ = 0;
};

uint16_t f32_to_bf16_host(float f);
// W rows of a stored linear (any format) as bf16, appended to `out`.
void append_bf16_rows(const Linear& l, std::vector<uint16_t>& out);
// Exl3Dev with pointers that are offsets into a block, moved onto the block's device copy.
Exl3Dev rebase(const Exl3Dev& off, const void* base);
struct DevLinear;
// A linear that uses another's device memory (views; that linear must outlive it).
DevLinear view_of(const DevLinear& l);

// An EXL3 part of a device linear: its output columns start at col0 of the linear's output rows.
struct Exl3Part {
  Exl3Dev w;
  int64_t col0 = 0;
};
// EXL3 weights of one shape and code (no bias) run for one token as one grouped GEMV over `count` rows: row r
// through weight r (3 launches instead of 3 per weight). Empty when they do not qualify.
struct DevGroup {
  DeviceBuffer tab;  // Exl3Dev [count]
  DeviceBuffer ids;  // int32 0 .. count-1
  int count = 0;
  explicit operator bool() const { return count > 0; }
};
struct DevLinear {  // bf16 weight [out][in], or EXL3 parts (trellis | suh | svh each) in `w`; optional fp32 bias
  DeviceBuffer w, bias;
  int64_t in = 0, out = 0;
  std::vector<Exl3Part> x3;  // empty: bf16
  DevGroup parts;            // several EXL3 parts of one shape (q|k|v): one token's parts as one grouped call
};
struct DevNorm {
  DeviceBuffer w, b;
};
struct DevMlp {  // gate and up fused: [2I][D]
  DevLinear gate_up, down;
  int64_t inter = 0;
  float limit = 0;  // > 0: clamped SwiGLU
};
struct DevIndexer {
  DevLinear wq_b, wk, weights_proj;
  DevNorm k_norm;
  DevLinear pool_gate;    // k-pool only
  DeviceBuffer pool_ape;  // fp32 [kpool][d]
};
// KDA linear attention (q, k, v fused into one linear: rows [q | k | v]); fp32 conv taps, decay and norm.
struct DevKda {
  DevLinear qkv, f_a, f_b, b, g_a, g_b, o;
  DevGroup fg_a, fg_b;  // f_a | g_a and f_b | g_b (decode)
  DeviceBuffer conv, dt_bias, a_log;
  DevNorm o_norm;
};
// Gated DeltaNet (Qwen3-Next): qkvz and ba as stored (grouped per key head), fp32 conv taps over q | k | v, decay
// parameters and the SiLU-gated output norm.
struct DevGatedDelta {
  DevLinear qkvz, ba, out;
  DeviceBuffer conv, dt_bias, a_log;
  DevNorm norm;
};
// mHC weights of one residual site, fp32.
struct DevHyper {
  DeviceBuffer fn, base, scale;
};
struct DevAttention {
  DevLinear q_a, q_b, q, kv_a, o;  // MLA (q only without q_lora)
  DevNorm q_a_norm, kv_a_norm;
  DeviceBuffer w_uk, w_uv;  // bf16 [H][dn][r], [H][dv][r]
  std::optional<DevIndexer> indexer;
  DevLinear gq, gk, gv;  // GQA (o shared with MLA's)
  DevNorm q_norm, k_norm;
};

// Routed experts of one MoE layer with their placement. Expert weights are one block: gate|up [2I][D], down [D][I].
// Which expert a slot holds is the engine's ExpertCache's bookkeeping (backend/expert_cache.h, shared with the
// runtime's planner and tests); a slot here is the device memory and the events that order its reuse.
struct CacheSlot {
  DeviceBuffer mem;
  cudaEvent_t ready = nullptr, free = nullptr;  // copy finished / last compute use finished
};
// EXL3 experts: each expert's block is gate | up | down as trellis | suh | svh; x3_off[e] holds the three with
// pointers relative to the block start (rebase() them onto a VRAM copy or a cache slot).
struct DevMoe {
  DeviceBuffer router, router_bias;  // fp32 [E][D], [E]
  std::optional<DevMlp> shared;
  DeviceBuffer shared_gate;  // fp32 [D] (empty: ungated): shared output scaled by sigmoid(x . shared_gate)
  std::vector<ExpertPlacement> placement;
  std::vector<DeviceBuffer> vram;         // per expert, empty unless Vram
  std::vector<size_t> block_bytes;        // per expert: device bytes of its block (bf16 or EXL3)
  DeviceBuffer gate_up_ptrs, down_ptrs;   // bf16: device pointer tables [E] (Vram experts; others null)
  std::vector<const uint16_t*> h_gate_up, h_down;
  bool exl3 = false, x3_grouped = false;  // grouped: each projection has one shape/K/codebook over the experts
  std::vector<std::array<Exl3Dev, 3>> x3_off;
  // Exl3Dev [3][x3_stride] of the Vram experts (grouped decode); with shared_grouped, entry E is the shared expert,
  // which then runs in the same grouped launches as the routed ones (ids [S][1 + k], the shared first, weight 1).
  DeviceBuffer x3_tab;
  int64_t x3_stride = 0;
  // >= 0: entries x3_slot_base + i of x3_tab are LRU slot i (host experts of one block layout), else none.
  int64_t x3_slot_base = -1;
  bool shared_grouped = false;
  bool all_vram = true;
  // zero_copy_cold: x3_tab's entries of the experts not in VRAM point at their host weights (HostExperts::
  // mapped_parts), so decode takes the grouped path as if all were in VRAM. x3_tab_host: the table while it may be.
  bool zero_copy = false;
  std::vector<Exl3Dev> x3_tab_host;
  float limit = 0;                        // routed experts' SwiGLU clamp (> 0)
  std::unique_ptr<HostExperts> host;      // what a slot is filled from: Cache experts (+ streamable Cpu ones)
  std::vector<CacheSlot> slots;           // LRU slots of this layer (ExpertCache says which expert is where)
  int64_t lent_from = 0;                  // slots [lent_from, size) are lent ones (views of the pass arena)
};

// Uploads host weights against the budget, counting weight bytes (and the EXL3 bytes among them).
struct WeightUploader {
  std::shared_ptr<DeviceBudget> budget;
  size_t weight_bytes = 0, exl3_bytes = 0;
  DeviceBuffer raw(const void* data, size_t bytes, const char* what);
  template <typename T>
  DeviceBuffer vec(const std::vector<T>& v, const char* what) {
    return raw(v.data(), v.size() * sizeof(T), what);
  }
  DevLinear linear(std::initializer_list<const Linear*> parts, const char* what);  // EXL3 when every part is
  DevNorm norm(const NormWeights& n);
  DevMlp mlp(const MlpWeights& m, const char* what);
  // The group of EXL3 weights (empty unless all are of one shape and code).
  DevGroup group(const std::vector<Exl3Dev>& w);
  DevGroup pair(const DevLinear& a, const DevLinear& b);  // single-part, no bias
};
// True when every routed expert's gate, up and down are EXL3.
bool exl3_experts(const MoeWeights& m);
// One expert's device block: bf16 gate|up [2I][D] then down [D][I]; or (exl3) gate | up | down as EXL3 parts
// with their layout (offsets into the block) in *off. Returns its bytes; fills *blob when given.
size_t expert_block(const MlpWeights& m, bool exl3, std::array<Exl3Dev, 3>* off, std::vector<uint8_t>* blob);
// The EXL3 linear behind `l`, or null when it is stored otherwise.
const Exl3Linear* as_exl3(const Linear* l);

// Decode graphs of sequences with fixed-size state, keyed by sequence id (never reused), the most recent kMax. kMax
// covers the sequences one caller decodes in turn (forward_batch, the bench's streams): with 4, eight streams
// re-captured a graph every step (49.9 tok/s aggregate against 109 for one to four streams, H200 slice).
struct SequenceGraphs {
  static constexpr size_t kMax = 16;
  std::mutex mu;
  std::map<uint64_t, cudaGraphExec_t> graphs;  // node references stay valid until that id is dropped or evicted
  std::deque<uint64_t> order;                  // least recently used first
  cudaGraphExec_t& get(uint64_t id);           // the entry (null until captured), created if missing
  // Decode steps of several sequences (CudaEngine::Impl::forward_rows), keyed by their ids (or {0, rows} when no
  // sequence has fixed-size state), the most recent kMax.
  std::map<std::vector<uint64_t>, cudaGraphExec_t> batches;
  std::deque<std::vector<uint64_t>> batch_order;
  cudaGraphExec_t& batch(const std::vector<uint64_t>& key);
  void drop(uint64_t id);  // a sequence is gone (with every batch graph it is in)
  void clear();            // the engine is gone
};

struct DevLayer {
  DevNorm input_norm, post_norm;
  DevAttention attn;
  std::optional<DevKda> kda;
  std::optional<DevGatedDelta> gated_delta;
  DevHyper attn_hc, ffn_hc;  // residual.hyper
  std::optional<DevMlp> mlp;
  std::optional<DevMoe> moe;
};

}  // namespace moesrv::cuda

namespace moesrv {

// Events between the blocks of a pass (CudaEngineOptions::time_phases): mark(p) starts phase p where the previous
// one ends; finish() waits for the last event and adds each interval to its phase.
class PhaseClock {
 public:
  PhaseClock() = default;
  PhaseClock(const PhaseClock&) = delete;
  PhaseClock& operator=(const PhaseClock&) = delete;
  ~PhaseClock() {
    for (cudaEvent_t e : events_) cudaEventDestroy(e);
  }
  bool active = false;   // inside a timed pass
  void begin(bool on) {  // a pass starts (marks of a pass cut short by an error are dropped)
    used_ = 0, phases_.clear(), active = on;
  }
  void mark(CudaPhase p, cudaStream_t st) {
    if (!active) return;
    if (used_ == events_.size()) {
      events_.emplace_back();
      MOESRV_CUDA_OK(cudaEventCreate(&events_.back()));
    }
    MOESRV_CUDA_OK(cudaEventRecord(events_[used_++], st));
    phases_.push_back(p);
  }
  void finish(std::array<double, size_t(CudaPhase::Count)>& acc) {
    if (used_ > 0) {
      MOESRV_CUDA_OK(cudaEventSynchronize(events_[used_ - 1]));
      for (size_t i = 0; i + 1 < used_; ++i) {
        float ms = 0;
        MOESRV_CUDA_OK(cudaEventElapsedTime(&ms, events_[i], events_[i + 1]));
        acc[size_t(phases_[i])] += double(ms) * 1e-3;
      }
    }
    used_ = 0, phases_.clear(), active = false;
  }

 private:
  std::vector<cudaEvent_t> events_;
  std::vector<CudaPhase> phases_;
  size_t used_ = 0;
};

struct CudaEngine::Impl {
  CudaEngineOptions opt;
  // A budget, a given placement or a planner: experts may live outside VRAM (hybrid lanes, the lent pass arena, the
  // embedding table in host memory).
  bool hybrid_options() const { return opt.vram_budget_gib > 0 || !opt.placement.empty() || bool(opt.plan_placement); }
  std::unique_ptr<ModelWeights> weights;  // host weights: CPU experts and upload source
  // Page-locked host expert weights (declared before `layers`, so it outlives every HostExperts using it).
  std::unique_ptr<cuda::HostRegistration> host_registration = std::make_unique<cuda::HostRegistration>();
  ModelSpec c;
  std::string name;
  int64_t layer_begin = 0, layer_end = 0;  // the layers held (CudaEngineOptions); the whole model by default
  std::shared_ptr<cuda::DeviceBudget> budget;
  cudaStream_t stream = nullptr, copy_stream = nullptr;
  // A long host-planned pass: its routing's copy to the host is done (the host plans while the GPU runs the shared
  // expert queued behind it; moe_hybrid).
  cudaEvent_t routing_copied = nullptr;
  cuda::HyperSide mhc_side;   // decode mHC: the Sinkhorn weights on their own stream (hyper_enter)
  cuda::HyperSide proj_side;  // decode: projections that read only s.h, beside the main chain (on_proj_side)
  // Prefill: a wave's per-expert EXL3 GEMMs (dequant slab + cuBLAS) spread round-robin over `stream` and these
  // lanes, each with its own stream, cuBLAS handle and slab (MOESRV_EXPERT_LANES, default 4 in all; 1 = none).
  // Made after the expert plan, only when every MoE layer runs all-VRAM grouped waves and the budget has room
  // beyond `reserve_bytes` (the sequences' share). Hybrid placements make theirs before the plan (hybrid_lanes),
  // with rotated input and output scratch too (xh, yr), for the host-planned passes' experts (on_lane); the waves
  // then use those.
  struct ExpertLane {
    cudaStream_t stream = nullptr;
    cublasHandle_t blas = nullptr;
    cudaEvent_t join = nullptr;
    cuda::DeviceBuffer w16, xh, yr;
  };
  std::vector<ExpertLane> expert_lanes;
  cudaEvent_t lanes_fork = nullptr;
  bool lanes_have_scratch = false;  // expert_lanes have xh / yr (allocate_hybrid_lanes)
  void make_expert_lanes(size_t n, size_t w16_bytes, size_t xh_bytes, size_t yr_bytes);
  // Runs f's launches on `lane` (its stream, cuBLAS handle and EXL3 scratch in place of the main ones). f must not
  // use the one-row GEMV's tickets (exl3_forward of more than kExl3MaxGemvRows rows only).
  template <class F>
  void on_lane(ExpertLane& lane, F&& f);
  cublasHandle_t cublas = nullptr;
  cuda::DeviceBuffer cublas_workspace;

  cuda::DeviceBuffer embed, cos_sin;  // embed: a view of embed_host when the table is kept in host memory
  cuda::PinnedBuffer embed_host;
  cuda::DevNorm final_norm;
  cuda::DevLinear lm_head;
  std::vector<cuda::DevLayer> layers;
  cuda::WeightUploader up;  // weight uploads and their byte counts
  std::vector<std::vector<ExpertPlacement>> placement;

  // Geometry.
  int64_t max_ctx = 0, rows = 0;        // rows: tokens per pass (prefill chunk)
  // Passes per prefill group (CudaEngineOptions::prefill_group; 1 for pipeline stages and the MTP block): the
  // group's rows share the residual streams, s.h / s.y, the DSA selection and the MoE's host-planned pass.
  int64_t group_passes = 1;
  int64_t group_rows() const { return rows * group_passes; }
  int64_t attn_rows = 0, moe_rows = 0, dsa_rows = 0, lm_rows = 0;
  // Host-planned MoE: tokens per planned pass (the whole pass; MOESRV_MOE_PASS_ROWS sets fewer, for comparisons),
  // sorted rows per wave through the expert buffers (their height).
  int64_t moe_pass_rows = 0, moe_wave_rows = 0;
  // Cache misses of a host-planned pass of at least kStreamPassTokens tokens (prefill: it walks all the layer's
  // experts) recycle the pass's own last stream_window_slots() admissions, not the LRU (ExpertCache::admit); 0
  // otherwise.
  static constexpr int64_t kStreamPassTokens = 64;
  int32_t stream_window = 0;
  int32_t stream_window_slots() const;
  bool lanes_copied_on() const;         // hybrid_lanes_copied, unless MOESRV_LANES_COPIED=0
  static bool exl3_waves_on();          // all-VRAM EXL3 prefill in grouped waves, unless MOESRV_EXL3_WAVES=0
  int64_t kv_row = 0, v_row = 0;        // cache values per token (kv: MLA latent|rope or GQA keys)
  size_t seq_bytes = 0;                 // device bytes of one sequence's caches and state checkpoints
  static constexpr size_t kMaxCheckpoints = 4;  // fixed-size state copies a sequence keeps (resume points)
  // Passes of a forward (pass_plan.h): `rows` each; recurrent models cut and checkpoint at multiples of `rows`.
  PassPolicy pass_policy() const { return pass_policy_for(c.has_recurrent_layers(), rows, int64_t(kMaxCheckpoints)); }

  // Per-pass device state: positions, tokens, the current sequence's cache table; a prefill group's pass positions.
  cuda::DeviceBuffer d_pos0, d_slice_pos, d_tokens, d_layer_cache, d_group_pos;
  cuda::PinnedBuffer h_group_pos;
  // forward_argmax: d_argmax = the id (4 bytes, then 12 free) + argmax's scratch; h_argmax its pinned copy;
  // argmax_row: the device row it was picked from (s.logits), null after a plain forward.
  cuda::DeviceBuffer d_argmax;
  cuda::PinnedBuffer h_argmax;
  const float* argmax_row = nullptr;
  // CudaEngine::forward and forward_argmax: with best set, no logits come back (an empty vector), *best = the last
  // row's argmax. MtpEngine::forward_hidden: with `rollback`, the sequence keeps rollback points after each token (one
  // pass of at most kMaxRollbackRows tokens); `hidden` (when given) receives every token's head input [S, D].
  std::vector<float> forward(SequenceState& seq, const std::vector<int32_t>& tokens, bool all_logits, int32_t* best,
                             bool rollback = false, std::vector<float>* hidden = nullptr);
  // Engine::forward_batch: one decode step of 2..kMaxBatchRows distinct sequences (one token each, validated by the
  // caller) as one pass: embedding, mHC, feed-forward and head over all rows (the weights read once), the mixers
  // row by row with each row's caches, position and state (cuda_blocks.h); a graph per set of sequences when every
  // expert is in VRAM. Returns each row's logits.
  static constexpr int64_t kMaxBatchRows = 4;
  std::vector<std::vector<float>> forward_rows(const std::vector<SequenceState*>& seqs,
                                               const std::vector<int32_t>& tokens);
  cuda::DeviceBuffer d_batch_pos, d_batch_tables;  // [kMaxBatchRows], [kMaxBatchRows][layers]
  cuda::PinnedBuffer h_batch_pos, h_batch_tables;
  cuda::PinnedBuffer h_pos0, h_tokens, h_layer_cache;
  // Scratch.
  struct Scratch {
    cuda::DeviceBuffer x, h, y, xb;                             // residual, normed, layer output, bf16 input
    cuda::DeviceBuffer q_lat, q, kv, qcat, olat, attn_out;      // attention
    cuda::DeviceBuffer mla_part;                                // split MLA decode's partial softmax states
    cuda::DeviceBuffer w_absorb;                                // fp32 W_uk / W_uv (prefill absorption)
    cuda::DeviceBuffer k, v;                                    // GQA keys/values of the pass
    cuda::DeviceBuffer qgate;                                   // GQA q_proj rows [H][query | gate] (output gate)
    cuda::DeviceBuffer iq, ik, ihw, sel, dsa_scores;            // DSA
    cuda::DeviceBuffer ig;                                      // k-pool gate logits
    cuda::DeviceBuffer post, comb, hc_part;                     // mHC mixing of the current site, decode sums
    cuda::DeviceBuffer hc_step;  // hyper_step's scratch (its barrier counters: zeroed once, never shared)
    cuda::DeviceBuffer lraw, lqkv, lg, lbeta, lo, lfa, lgate;   // KDA, Gated DeltaNet
    cuda::DeviceBuffer gu, act;                                 // dense MLP
    cuda::DeviceBuffer logits_r, ids, w, mgu, mact, mactb, ysorted, xs, rowmap, sorted_tok, extra;  // MoE
    cuda::DeviceBuffer row_expert;  // expert of each sorted row of a planned pass (grouped EXL3 waves)
    cuda::DeviceBuffer wave_tok;    // a planned pass's tokens per wave, the waves one after another (moe_combine)
    cuda::DeviceBuffer gemm_tiles;  // Exl3GemmTile of a pass's grouped EXL3 waves (gemm_tiles_used of them so far)
    cuda::DeviceBuffer route_ticket;  // route_fused's block counter (zeroed once; each launch leaves it at zero)
    cuda::DeviceBuffer pred_ids, pred_w;  // the next MoE layer's picks for prefetching (predict_next_layer)
    cuda::DeviceBuffer logits;                                  // [lm_rows][V]
    // EXL3 (models with EXL3 linears only): rotated inputs (fp32 GEMV rows or fp16 GEMM rows), rotated outputs,
    // fp16 W_hat slabs of the GEMM path.
    cuda::DeviceBuffer x3_xh, x3_yr, x3_w16;
    cuda::DeviceBuffer x3_tickets;  // exl3_gemv_out's counters (zeroed once; each call leaves them zero)
    cuda::DeviceBuffer x3_sets;     // moe_exl3_grouped's row sets of a few tokens (Exl3RowSet)
    cuda::DeviceBuffer x3_xh_side, x3_yr_side, x3_tickets_side;  // the same for one-token calls on proj_side
    // The pass buffers (make_pass_buffers: x, h, y, xb, gu, act, then the attention group (q_lat .. dsa_scores but
    // sel) and the linear-attention group (lraw .. lgate) over the same bytes: a layer runs one of the two) as views.
    cuda::DeviceBuffer pass_arena;
  } s;
  // Lent pass arena (CudaEngineOptions::lend_pass_arena): forwards of at most kLendRows tokens (decode steps,
  // verifies, batched steps, short prompts) run on a second set of pass buffers sized for kLendRows, and meanwhile the
  // MoE layers' lent slots (ExpertCache::lend) hold cold experts in the large set's arena; a longer forward takes the
  // arena back first (pass_mode). `parked` holds the set not in use, pass_members the members the sets swap.
  static constexpr int64_t kLendRows = 32;
  static constexpr int64_t kWholeSet = std::numeric_limits<int64_t>::max();  // pass_mode: the large set, whatever S
  bool lending = false, pass_big = true;
  Scratch parked;
  std::vector<cuda::DeviceBuffer Scratch::*> pass_members;
  int64_t parked_attn_rows = 0, parked_dsa_rows = 0;
  char* lend_base = nullptr;                              // the large set's arena
  size_t lend_bytes = 0, lend_each = 0, lend_cursor = 0;  // its size, each MoE layer's share, the bytes handed out
  // Whether this engine lends its arena of `arena_bytes`: a budget or placement, a whole model, not the MTP block,
  // at least lend_min_gib.
  bool lend_on(size_t arena_bytes) const;
  void add_slot(cuda::DevMoe& m, cuda::DeviceBuffer mem);  // a free slot over `mem`, appended to m's
  // Pass buffers for passes of R rows (groups of RG) in one arena: into t, with their row counts.
  void make_pass_buffers(int64_t R, int64_t RG, Scratch& t, int64_t& t_attn_rows, int64_t& t_dsa_rows);
  void swap_pass_buffers();
  void pass_mode(int64_t S);  // before a forward of S tokens: the set it needs, lending or taking back the arena
  int64_t lend_slots(int64_t l, int64_t want, size_t slot_bytes);  // appends layer l's lent slots
  cuda::PinnedBuffer h_ids, h_w, h_pred, h_h, h_extra, h_rowmap, h_sorted_tok, h_row_expert, h_wave_tok, h_logits,
      h_gemm_tiles;
  int64_t gemm_tiles_used = 0;  // of s.gemm_tiles in the current pass (each wave's tiles stay until the pass syncs)
  // Routed-expert usage counted on the device ([layers][E] and [layers] tokens), drained into `usage`.
  cuda::DeviceBuffer d_usage, d_usage_tokens;
  mutable std::unique_ptr<UsageStats> usage;
  const UsageStats* drain_usage() const;
  mutable int64_t zero_copy_selections = 0;  // drained from the device counters (CudaEngineStats)
  mutable double zero_copy_bytes = 0;
  void map_host_experts();  // zero_copy_cold: after the host registration's commit

  // Decode graphs (all experts in VRAM), per row count 1 .. graph_rows(): forwards of that many tokens replay them
  // (one token: decode; a few: an MTP verify). Models with fixed-size state keep them per sequence (its pointers are
  // baked in): sequence_graphs, keyed rows_graph_key(id, n), shared with the sequences so one that outlives the
  // engine is safe.
  static constexpr int64_t kMaxGraphRows = 8;
  std::array<cudaGraphExec_t, kMaxGraphRows> graphs{};
  static uint64_t rows_graph_key(uint64_t id, int64_t n) { return id | (uint64_t(n - 1) << 56); }
  static constexpr uint64_t kRollbackGraph = uint64_t(1) << 62;  // | rows_graph_key: a rollback forward's graph
  // Forwards of up to this many tokens run as graphs: MOESRV_CUDA_GRAPH_ROWS (1 .. 8, default 1: decode only; at most
  // the lm_head's rows), read once.
  int64_t graph_rows() const;
  // A stage's decode graph (its layer range, no embedding or head); with fixed-size state per sequence, keyed
  // id | kStageGraph in sequence_graphs. h_stage / h_stage_sel: pinned staging of the hand-off (allocated on use).
  cudaGraphExec_t stage_graph = nullptr;
  static constexpr uint64_t kStageGraph = uint64_t(1) << 63;
  cuda::PinnedBuffer h_stage, h_stage_sel;
  std::shared_ptr<cuda::SequenceGraphs> sequence_graphs = std::make_shared<cuda::SequenceGraphs>();
  // Held by every call that queues device work or frees device memory (forwards, the pipeline entry points, sequence
  // create / clone / truncate / checkpoint / free), so that sequence operations on other threads (the server's
  // --max-batch: request threads and the prefix cache) never run inside a forward or its graph capture. Shared with
  // the sequences (which may outlive the engine) and with the MTP block's engine.
  std::shared_ptr<std::recursive_mutex> device_mu = std::make_shared<std::recursive_mutex>();
  using DeviceLock = std::lock_guard<std::recursive_mutex>;
  bool use_graph = true;
  CudaEngineStats stats;
  PhaseClock clock;
  void phase(CudaPhase p) { clock.mark(p, stream); }
  // Decode (one token): f's launches go to proj_side.stream, forked from `stream` here (f may only read what the
  // stream made so far), its EXL3 calls through their own scratch; join_proj_side() makes `stream` wait for them.
  // Without EXL3 side scratch, for S > 1 or with MOESRV_PROJ_SIDE=0, f runs on `stream`. on_side_if(side, f): the
  // same where `side` says so (proj_side_ok or proj_side_rows_ok).
  template <class F>
  void on_proj_side(int64_t S, F&& f);
  template <class F>
  void on_side_if(bool side, F&& f);
  bool proj_side_ok(int64_t S) const;  // whether on_proj_side(S, f) runs f on the side stream
  // Forwards of 2..kExl3SetRows rows (MTP verifies, batched steps; MOESRV_PROJ_SIDE_ROWS=0: in line): the KDA
  // layers' small projections (b, f_a, f_b, g_a, g_b) beside q|k|v, the MLA layers' latent key rows and k-pool key
  // projections beside the query's. The side scratch holds them: the R-row GEMV's 4 rows in and out, the batch
  // kernel's up to 8. On the H100, 2 streams ran 12% faster with it (docs/perf-cuda.md, thirty-second round).
  bool proj_side_rows_ok(int64_t S) const;
  void join_proj_side();
  bool proj_side_pending = false;

  Impl(std::shared_ptr<ModelPackage> pkg, const CudaEngineOptions& o);
  ~Impl();

  // Speculative decoding (mtp_engine.cpp; CudaEngineOptions::mtp): the checkpoint's MTP block as an engine of its own
  // over the model's one-layer MTP spec (plain residual), made by the model's engine before it places its experts.
  // It shares the model's budget, embedding, rope table and (without a head of its own) lm_head.
  struct MtpTag {};
  Impl(Impl& model, MtpTag);
  std::unique_ptr<Impl> mtp;    // the model's engine: its MTP block's
  const Impl* model = nullptr;  // the MTP block's engine: the model's
  struct MtpInput {             // x = eh_proj(concat(enorm(embed(t)), hnorm(h)))
    cuda::DevNorm enorm, hnorm;
    cuda::DevLinear eh_proj;
    cuda::DeviceBuffer eh;  // [rows, 2 * hidden]
  };
  std::optional<MtpInput> mtp_in;  // the MTP block's engine
  // MtpEngine::mtp_forward on the MTP block's engine.
  std::vector<float> mtp_forward(SequenceState& seq, const std::vector<int32_t>& next, const std::vector<float>& hidden,
                                 std::vector<float>& hidden_out);
  void open_device();   // streams, cuBLAS, side streams (both constructors)
  void set_geometry();  // layer range, context, pass rows, cache rows, sequence bytes (both constructors)

  // Setup (cuda_engine_setup.cpp).
  void upload_weights();
  ExpertLayer expert_layer(int64_t l, std::vector<ExpertPlacement> placement) const;
  std::vector<ExpertLayer> given_expert_layers() const;
  void plan_experts(size_t reserve_bytes);
  void upload_moe(int64_t layer);
  void allocate_scratch();

  // Ops.
  void linear(const cuda::DevLinear& l, const float* x, int64_t n, float* y);
  void gemm_bf16(const uint16_t* w, int64_t out, int64_t in, const uint16_t* xb, int64_t n, float* y);
  void mlp(const cuda::DevMlp& m, const float* x, int64_t n, float* y);
  // EXL3 (exl3_engine.cpp): y[n][w.out] (rows y_ld apart) = rows of src through w (+ bias): GEMV for <= 8 rows (2..4
  // through the R-row kernel with row_gemv_on()), else row blocks through fp16 W_hat slabs + cuBLAS.
  void exl3_forward(const cuda::Exl3Dev& w, cuda::Exl3Src src, int64_t n, float* y, int64_t y_ld, const float* bias);
  cuda::Exl3Tickets x3_tickets() { return {s.x3_tickets.as<unsigned>(), s.x3_tickets.bytes() / 4}; }
  bool row_gemv_on() const;           // opt.row_gemv, MOESRV_EXL3_GEMV_ROWS=0 / 1 over it (comparisons)
  bool merge_expert_rows_on() const;  // opt.merge_expert_rows or MOESRV_EXL3_MERGE_ROWS=1
  // One token through a DevGroup: src row r through weight r into y + r * y_ld, r < g.count.
  void exl3_group(const cuda::DevGroup& g, const cuda::Exl3Dev& shape, cuda::Exl3Src src, float* y, int64_t y_ld);
  void allocate_exl3_scratch();
  void allocate_expert_lanes(size_t reserve_bytes);
  void allocate_hybrid_lanes(size_t reserve_bytes);
  // All-VRAM EXL3 experts, S <= 8 tokens, graph safe; with_shared: the shared expert as entry 0 of each token's rows.
  void moe_exl3_grouped(cuda::DevMoe& m, int64_t S, bool with_shared);
  void moe_exl3_sorted_rows(cuda::DevMoe& m, int64_t a, int64_t rows);
  // One expert over `cnt` sorted rows from row0: inputs h rows through sorted_tok[row0..], out s.ysorted rows from
  // buf0 (the row's place in the current wave).
  void expert_exl3(cuda::DevMoe& m, int e, const void* block, const float* h, int64_t row0, int64_t buf0, int64_t cnt);
  // A wave of sorted rows [a, a + rows) of an all-VRAM EXL3 layer whose experts share shapes: each projection's input
  // and output rotations run once for the wave (s.row_expert picks each row's signs from the expert table), the
  // dequantization and GEMM per expert piece (expert, first sorted row, rows).
  struct ExpertPiece {
    int e;
    int64_t row0, cnt;
  };
  void moe_exl3_wave(cuda::DevMoe& m, int64_t a, int64_t rows, const std::vector<ExpertPiece>& pieces);
  int64_t exl3_wave_rows(const cuda::DevMoe& m) const;  // rows such a wave may hold (the EXL3 scratch's height)
  // Decode with shared_grouped and CudaEngineOptions::shared_expert_beside_router: the shared expert of h into y on
  // proj_side (expert_executor.cpp), beside the router and the routed experts.
  void shared_expert_exl3(const cuda::DevMoe& m, const float* h, float* y);
  // With `batch` (a decode step of S sequences), the projections run over all rows and the position-dependent part
  // (rope, cache write, indexer, attention) per row.
  void attention_mla(int64_t l, int64_t S, IndexerKind indexer, const cuda::BatchRows* batch = nullptr);
  void attention_gqa(int64_t l, int64_t S);
  void dsa_indexer(const cuda::DevIndexer& ix, int64_t l, int64_t S);
  // The k-pool indexer (linear_attention_engine.cpp): kpool_indexer_keys (wk, pool_gate, weights_proj from s.h, the
  // key norm) first, then kpool_indexer (wq_b from s.q_lat, the scale, the pools, the selection into s.sel).
  void kpool_indexer_keys(const cuda::DevIndexer& ix, int64_t S);
  // beside: in decode its pools and selection go to proj_side (the caller joins it before the attention).
  void kpool_indexer(const cuda::DevIndexer& ix, int64_t l, int64_t S, bool beside);
  // (linear_attention_engine.cpp) With `batch`, the S rows are a decode step of S sequences (cuda_blocks.h): the
  // projections run over all rows, the fused decode kernel per row with that row's state.
  void kda(int64_t l, int64_t S, const cuda::BatchRows* batch = nullptr);
  void gated_delta(int64_t l, int64_t S);                                // (linear_attention_engine.cpp)
  // The current sequence's fixed-size and pooled state of layer l (set by forward()).
  // In a rollback forward (speculative verify of 2..kMaxRollbackRows tokens) also where the kernels leave the state
  // after each token but the last: conv_steps [rows-1][K-1][C], rec_steps (delta_rule's steps), open_steps
  // (kpool_open_steps'); null otherwise.
  struct LayerState {
    float *conv = nullptr, *recurrent = nullptr, *pool_k = nullptr, *open = nullptr;
    float *conv_steps = nullptr, *rec_steps = nullptr, *open_steps = nullptr;
  };
  static constexpr int64_t kMaxRollbackRows = 4;  // tokens of a rollback forward (MTP: k + 1 <= 4)
  std::vector<LayerState> cur_state;
  void moe(int64_t l, int64_t S);                     // (expert_executor.cpp)
  // Host-planned experts for tokens [s0, s0+n); shared_rows > 0: first s.y = the shared expert of that many rows.
  void moe_hybrid(int64_t l, int64_t s0, int64_t n, int64_t shared_rows);
  void shared_expert_into_y(const cuda::DevMoe& m, int64_t S);
  struct IntUpload {
    int32_t* dst;
    const int32_t* host;
    int64_t n;
  };
  void upload_ints(std::initializer_list<IntUpload> arrays);
  // A decode pass's expert whose intermediate rows [0, skip) the CPU computes (cpu_expert_slices); skip 0: none.
  struct CpuSlice {
    int32_t expert = -1;
    int64_t skip = 0;
    int64_t inter = 1;  // the expert's padded intermediate size (what skip counts in)
  };
  CpuSlice plan_cpu_slice(int64_t l, const ExpertPass& pass, const std::vector<int>& run_home) const;
  double slice_fixed_s = 20e-6;  // a slice's CPU cost beyond its share of the expert (measure_cold_rates, if on)
  double slice_scale = 1.0;      // slices' measured CPU time over the estimate (decayed mean)
  bool cpu_slices_on() const;
  bool slice_top_up() const;
  bool slice_gate_up_whole() const;
  void moe_slot_grouped(int64_t l, const ExpertPass& pass, const std::vector<int>& run_home, int64_t n,
                        int64_t shared_rows, int64_t prefetch_layer, CpuSlice slice);
  // out[t] += the CPU jobs' rows (host rows h_h, pinned), uploaded and added to y (n rows) on the stream; seconds.
  double cpu_rows_into_y(const std::vector<cpu::RoutedRows>& jobs, int64_t n, float* y);
  ColdRates cold_rates;       // the per-pass cold-expert split's costs (options, else measured)
  void measure_cold_rates();  // at start, from one streamable expert
  void update_cpu_rate(int64_t tokens, double seconds);
  // Expert e's block of layer l in VRAM or a cache slot (*slot; -1 for a VRAM expert). A miss is admitted and its
  // copy queued on copy_stream at once; reading a slot waits for its copy (wait_slot on `stream`). `hold`: the slot
  // stays retained (never a victim) until release_held(), for passes that admit all their experts before computing
  // any (otherwise a later admission of the same pass could pick an earlier one's slot, whose `free` event still
  // marks its previous read: the copy would overwrite weights the pass has yet to read).
  // skip (in/out): on a miss, the intermediate rows [0, *skip) are left out of the copy (HostExperts::copy); set to 0
  // when the expert was in VRAM or a slot already.
  const void* expert_weights(int64_t l, int e, int* slot, bool hold = false, int64_t* skip = nullptr);
  std::vector<std::pair<int32_t, int32_t>> held_experts;  // (layer, expert) retained by expert_weights(hold)
  void release_held();
  void fill_slot(int64_t l, int e, const Admission& a, int64_t skip = 0);
  void wait_slot(const cuda::DevMoe& m, int slot);
  // Decode under a budget: the next MoE layer's router applied to this layer's input picks the experts whose copies
  // start while this layer computes (CudaEngineOptions::prefetch_experts). predicted_layer: the layer whose picks
  // the current pass launched into s.pred_ids (-1: none); prefetched[l][e]: copied ahead, not used yet.
  int64_t prefetch_limit = 0;
  int64_t predicted_layer = -1;
  std::vector<std::vector<uint8_t>> prefetched;
  int64_t next_moe_layer(int64_t l) const;  // the first MoE layer after l with experts to copy, or -1
  void predict_next_layer(int64_t l, int64_t S, const cuda::RouterArgs& ra);
  void route_rows(const cuda::DevMoe& m, int64_t S, const cuda::RouterArgs& ra, int32_t* ids, float* weights);
  void prefetch_experts(int64_t l, const int32_t* picks, int64_t n);
  std::unique_ptr<ExpertCache> expert_cache;          // slot bookkeeping of every layer's Cache experts
  // Embedding .. final norm over S rows, device-only when all VRAM; with `group`, the passes of a prefill group.
  void run_layers(int64_t S, const cuda::GroupPasses* group = nullptr);
  void run_block_layers(int64_t S);  // every layer from the residual in s.x, then the final norm (the MTP block)
  void lm_head_rows(int64_t row0, int64_t n, float* host_out);
  bool graph_ok() const;
  // Fails naming the problem unless the n tokens fit after pos0 (the context) and are vocabulary ids.
  void check_tokens(int64_t pos0, const int32_t* tokens, int64_t n) const;
  // Replays `graph` on `stream`, first capturing `body` (the kernels it queues on `stream`) into it when empty.
  void replay(cudaGraphExec_t& graph, const std::function<void()>& body);
  // The device position of row s0 of the pass: d_pos0 itself, or d_pos0 + s0 written to d_slice_pos (stream order).
  const int32_t* slice_pos0(int64_t s0);
  // Selection row width: index_topk positions, + the open pool's tail with a k-pool indexer.
  int64_t sel_width() const { return selection_width(c); }
  int64_t max_pools() const { return max_ctx / std::max<int64_t>(1, c.index_kpool) + 1; }
  const cuda::DeviceLayerCache* layer_cache(int64_t l) const {
    return d_layer_cache.as<cuda::DeviceLayerCache>() + l;
  }
};

// Comparison switches (environment variables): switch_on is on unless set to 0, switch_set only when set nonzero.
inline bool switch_on(const char* name) {
  const char* v = std::getenv(name);
  return !(v && std::atoi(v) == 0);
}
inline bool switch_set(const char* name) {
  const char* v = std::getenv(name);
  return v && std::atoi(v) != 0;
}
// An option that the switch `name` overrides either way: 0 turns it off, nonzero on, unset leaves the option. Read
// once where it is held in a static: `static const SwitchOverride env("NAME"); ... env(opt.x)`.
struct SwitchOverride {
  bool off, on;
  explicit SwitchOverride(const char* name) : off(!switch_on(name)), on(switch_set(name)) {}
  bool operator()(bool option) const { return option ? !off : on; }
};

inline bool CudaEngine::Impl::row_gemv_on() const {
  static const SwitchOverride env("MOESRV_EXL3_GEMV_ROWS");
  return env(opt.row_gemv);
}
inline bool CudaEngine::Impl::merge_expert_rows_on() const {
  static const bool on = switch_set("MOESRV_EXL3_MERGE_ROWS");
  return opt.merge_expert_rows || on;
}

inline bool CudaEngine::Impl::proj_side_ok(int64_t S) const {
  static const bool on = switch_on("MOESRV_PROJ_SIDE");  // 0: everything on `stream` (comparisons)
  return on && S == 1 && proj_side.stream && !(s.x3_yr.bytes() && !s.x3_yr_side.bytes());
}

template <class F>
void CudaEngine::Impl::on_lane(ExpertLane& lane, F&& f) {
  struct Swap {  // the lane's stream, handle and scratch in place of the main ones for f's launches, also on a throw
    Impl& m;
    ExpertLane& l;
    Swap(Impl& e, ExpertLane& x) : m(e), l(x) { flip(); }
    ~Swap() { flip(); }
    void flip() {
      std::swap(m.stream, l.stream);
      std::swap(m.cublas, l.blas);
      std::swap(m.s.x3_xh, l.xh);
      std::swap(m.s.x3_yr, l.yr);
      std::swap(m.s.x3_w16, l.w16);
    }
  } swap(*this, lane);
  f();
}

inline bool CudaEngine::Impl::proj_side_rows_ok(int64_t S) const {
  static const bool on = switch_on("MOESRV_PROJ_SIDE_ROWS");
  return on && S >= 2 && S <= cuda::kExl3SetRows && proj_side_ok(1);  // (the side's switch, stream and scratch)
}

template <class F>
void CudaEngine::Impl::on_proj_side(int64_t S, F&& f) {
  on_side_if(proj_side_ok(S), std::forward<F>(f));
}

template <class F>
void CudaEngine::Impl::on_side_if(bool side, F&& f) {
  if (!side) return f();
  MOESRV_CUDA_OK(cudaEventRecord(proj_side.fork, stream));
  MOESRV_CUDA_OK(cudaStreamWaitEvent(proj_side.stream, proj_side.fork, 0));
  struct Swap {  // the side's stream and scratch in place of the main ones for f's launches, also on a throw
    Impl& m;
    explicit Swap(Impl& e) : m(e) { flip(); }
    ~Swap() { flip(); }
    void flip() {
      std::swap(m.stream, m.proj_side.stream);
      std::swap(m.s.x3_xh, m.s.x3_xh_side);
      std::swap(m.s.x3_yr, m.s.x3_yr_side);
      std::swap(m.s.x3_tickets, m.s.x3_tickets_side);
    }
  } swap(*this);
  f();
  proj_side_pending = true;
}

inline void CudaEngine::Impl::join_proj_side() {
  if (!proj_side_pending) return;
  MOESRV_CUDA_OK(cudaEventRecord(proj_side.join, proj_side.stream));
  MOESRV_CUDA_OK(cudaStreamWaitEvent(stream, proj_side.join, 0));
  proj_side_pending = false;
}

}  // namespace moesrv
