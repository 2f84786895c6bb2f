// The MoE layer on the GPU and its expert-execution seam. Routing always runs on the device. Small batches
// whose experts are all in VRAM run as grouped GEMVs (bf16, or EXL3 decoding the trellis) with no host
// involvement (CUDA-graph safe). Otherwise the routing comes back to the host, which plans per placement: VRAM
// experts and LRU-cached experts (their stored bytes copied from host memory on the copy stream, host_experts.h,
// ordered by events) run over their tokens in expert order (bf16: cuBLAS GEMMs; EXL3: GEMV or dequant + GEMM),
// while CPU experts run on the host thread pool from the stored weights (EXL3: the trellis, decoded on the fly),
// overlapped with the GPU work; their weighted sum is uploaded and added in the final combine. A CPU expert that
// a pass routes many tokens (prefill) is streamed through the LRU slots and runs on the GPU instead.
#if defined(MOESRV_HAS_CUDA) && MOESRV_HAS_CUDA
#include <algorithm>
#include <chrono>
#include <cstring>
#include <iterator>

#include "backend/cpu/cpu_layers.h"
#include "backend/cpu/expert_batch.h"
#include "backend/cpu/ops.h"
#include "backend/cuda/engine_internal.h"
#include "backend/expert_pass.h"
#include "util/timing.h"

namespace moesrv {

using namespace moesrv::cuda;

void CudaEngine::Impl::moe(int64_t l, int64_t S) {
  DevMoe& m = *layers[size_t(l)].moe;
  const int64_t D = c.hidden_size, E = c.n_routed_experts, k = c.experts_per_token, I = c.moe_intermediate_size;
  float *h = s.h.as<float>(), *y = s.y.as<float>();
  phase(CudaPhase::Router);
  RouterArgs ra;
  ra.E = int(E);
  ra.groups = int(c.n_group);
  ra.topk_groups = int(c.topk_group);
  ra.k = int(k);
  ra.norm_topk = c.norm_topk_prob;
  ra.softmax = c.router == RouterKind::Softmax;
  ra.scaling = float(c.routed_scaling_factor);
  ra.counts = d_usage.as<uint32_t>() + l * E;
  ra.tokens = d_usage_tokens.as<uint32_t>() + l;
  static const SwitchOverride shared_side_env("MOESRV_SHARED_SIDE");
  const bool shared_side_on = shared_side_env(opt.shared_expert_beside_router);
  const bool grouped = (m.all_vram || m.zero_copy) && S <= 8 && (!m.exl3 || m.x3_grouped);
  // Decode with shared_expert_beside_router: the shared expert on proj_side, beside the router and the routed experts
  // (it reads only h); else shared and routed experts in the same grouped launches: routing rows [shared | k picks].
  const bool shared_side = grouped && m.shared_grouped && shared_side_on && proj_side_ok(S);
  const bool shared_in_group = grouped && m.shared_grouped && !shared_side;
  if (shared_in_group) ra.shared_id = int(E);
  if (shared_side) on_proj_side(S, [&] { shared_expert_exl3(m, h, y); });
  route_rows(m, S, ra, s.ids.as<int32_t>(), s.w.as<float>());
  if (!grouped) predict_next_layer(l, S, ra);  // host-planned: the next layer's likely experts, for prefetching
  if (shared_in_group) {  // the combine writes y (shared first, weight 1)
    phase(CudaPhase::Experts);
    moe_exl3_grouped(m, S, true);
    moe_combine(y, s.ysorted.as<float>(), nullptr, s.w.as<float>(), nullptr, int(S), int(k + 1), int(D), stream, true);
    return;
  }
  if (shared_side) {  // the combine adds the routed experts to the shared expert's y
    phase(CudaPhase::Experts);
    moe_exl3_grouped(m, S, false);
    join_proj_side();
    moe_combine(y, s.ysorted.as<float>(), nullptr, s.w.as<float>(), nullptr, int(S), int(k), int(D), stream);
    return;
  }
  if (grouped) {
    phase(CudaPhase::Experts);
    shared_expert_into_y(m, S);
    if (m.exl3) moe_exl3_grouped(m, S, false);
    else
      moe_gemv(h, s.ids.as<int32_t>(), int(S), int(k), int(D), int(I), m.gate_up_ptrs.as<const uint16_t*>(),
               m.down_ptrs.as<const uint16_t*>(), s.mgu.as<float>(), s.mact.as<float>(), s.ysorted.as<float>(), stream,
               m.limit);
    moe_combine(y, s.ysorted.as<float>(), nullptr, s.w.as<float>(), nullptr, int(S), int(k), int(D), stream);
    return;
  }
  for (int64_t s0 = 0; s0 < S; s0 += moe_pass_rows) {
    phase(CudaPhase::Router);  // the routing copy and the host plan
    moe_hybrid(l, s0, std::min(moe_pass_rows, S - s0), s0 == 0 ? S : 0);
  }
}

// y (S rows) = the shared expert's output of s.h, or zeros without one: what the routed experts' combines add to.
void CudaEngine::Impl::shared_expert_into_y(const DevMoe& m, int64_t S) {
  const int64_t D = c.hidden_size;
  const float* h = s.h.as<float>();
  float* y = s.y.as<float>();
  if (m.shared) {
    mlp(*m.shared, h, S, y);
    if (m.shared_gate.bytes()) shared_expert_gate(h, m.shared_gate.as<float>(), int(S), int(D), y, stream);
  } else {
    MOESRV_CUDA_OK(cudaMemsetAsync(y, 0, size_t(S * D) * 4, stream));
  }
}

// One token through the shared expert of a shared_grouped layer (its parts have the routed experts' shapes and
// codes): gate | up as one grouped call into s.gu, then down over their clamped SwiGLU (read while rotating its
// input) into y.
void CudaEngine::Impl::shared_expert_exl3(const DevMoe& m, const float* h, float* y) {
  const DevMlp& sh = *m.shared;
  const int64_t I = c.moe_intermediate_size;
  float* gu = s.gu.as<float>();
  linear(sh.gate_up, h, 1, gu);
  const Exl3Dev& down = sh.down.x3[0].w;
  exl3_gemv_out(down, {}, Exl3Src{gu, 2 * I, nullptr, 1, true, m.limit}, 1, s.x3_xh.as<void>(), s.x3_yr.as<float>(),
                s.x3_yr.bytes() / 4, x3_tickets(), y, c.hidden_size, nullptr, stream);
}

const void* CudaEngine::Impl::expert_weights(int64_t l, int e, int* slot, bool hold, int64_t* skip) {
  DevMoe& m = *layers[size_t(l)].moe;
  *slot = -1;
  if (m.placement[size_t(e)] == ExpertPlacement::Vram) {
    if (skip) *skip = 0;
    return m.vram[size_t(e)].as<void>();
  }
  const int32_t L = int32_t(l);
  if (std::optional<int32_t> hit = hold ? expert_cache->acquire(L, e) : expert_cache->lookup(L, e)) {
    *slot = *hit;
    if (skip) *skip = 0;
    if (std::exchange(prefetched[size_t(l)][size_t(e)], uint8_t(0))) ++stats.prefetch_hits;
  } else {
    // Unless held, a slot is not retained: the `free` events order its reuse after the GPU's last read of it.
    std::optional<Admission> a = expert_cache->admit(L, e, stream_window);
    if (!a) fail("layer {}: no expert cache slot for expert {}", l, e);
    *slot = a->slot;
    if (hold) expert_cache->retain(L, e);
    fill_slot(l, e, *a, skip ? *skip : 0);
  }
  if (hold) held_experts.emplace_back(L, e);
  return m.slots[size_t(*slot)].mem.as<void>();
}

void CudaEngine::Impl::release_held() {
  for (const auto& [l, e] : held_experts) expert_cache->release(l, e);
  held_experts.clear();
}

// Copies expert e's stored block into the slot it was just admitted to, on copy_stream, after the GPU's last read of
// the slot (the evicted expert's); the slot's `ready` event marks the end of the copy.
void CudaEngine::Impl::fill_slot(int64_t l, int e, const Admission& a, int64_t skip) {
  DevMoe& m = *layers[size_t(l)].moe;
  if (a.evicted >= 0) prefetched[size_t(l)][size_t(a.evicted)] = 0;
  CacheSlot& cs = m.slots[size_t(a.slot)];
  MOESRV_CUDA_OK(cudaStreamWaitEvent(copy_stream, cs.free, 0));
  stats.fetched_bytes +=
      double(m.host->copy(e, cs.mem.as<void>(), copy_stream, skip, skip > 0 && slice_gate_up_whole()));
  MOESRV_CUDA_OK(cudaEventRecord(cs.ready, copy_stream));
}

// The slices' options, each overridden by its environment variable either way (as row_gemv_on).
bool CudaEngine::Impl::cpu_slices_on() const {
  static const SwitchOverride env("MOESRV_CPU_SLICES");
  return env(opt.cpu_expert_slices);
}
bool CudaEngine::Impl::slice_top_up() const {
  static const SwitchOverride env("MOESRV_CPU_SLICE_TOPUP");
  return env(opt.cpu_slice_top_up);
}
bool CudaEngine::Impl::slice_gate_up_whole() const {
  static const SwitchOverride env("MOESRV_CPU_SLICE_GATEUP_WHOLE");
  return env(opt.cpu_slice_gate_up_whole);
}

// The pass's last expert to cross the link (run_home 2, the copy order) and the intermediate blocks of it the CPU
// takes: b blocks cost the CPU b * cpu_block + slice_fixed_s (its parallel_fors, measured at start), both times
// slice_scale (the slices' measured time over that estimate: the start's timing reads one expert from cache, a
// decode pass's from memory), and save the link b * link_block, so the CPU finishes with the link at
// b = (link_s - fixed) / (link_block + cpu_block).
CudaEngine::Impl::CpuSlice CudaEngine::Impl::plan_cpu_slice(int64_t l, const ExpertPass& pass,
                                                            const std::vector<int>& run_home) const {
  CpuSlice slice;
  const DevMoe& m = *layers[size_t(l)].moe;
  if (!cpu_slices_on() || !m.exl3 || !m.host) return slice;
  double link_s = 0;
  int32_t e = -1;
  for (size_t q = 0; q < pass.gpu_runs.size(); ++q)
    if (run_home[q] == 2) {
      e = pass.gpu_runs[q].first;
      link_s += cold_rates.fetch_s(double(m.block_bytes[size_t(e)]));
    }
  if (e < 0) return slice;
  const int64_t tokens = int64_t(pass.by_expert[size_t(e)].size());
  int64_t inter = 0;
  if (!cpu::expert_slices_supported(weights->layers[size_t(l)].moe->experts[size_t(e)], tokens, &inter) ||
      !m.host->can_skip(int(e), cpu::kExpertSliceAlign))
    return slice;
  const int64_t blocks = inter / cpu::kExpertSliceAlign;
  int64_t b = opt.cpu_slice_blocks;
  if (b <= 0) {
    if (cold_rates.pcie_bytes_s <= 0 || cold_rates.cpu_first_s <= 0) return slice;
    const double link_block =
        cold_rates.fetch_s(double(m.block_bytes[size_t(e)])) / double(blocks) / (slice_gate_up_whole() ? 3.0 : 1.0);
    const double cpu_block = slice_scale * cold_rates.cpu_s(tokens) / double(blocks);
    b = int64_t((link_s - slice_scale * slice_fixed_s) / (link_block + cpu_block));
  }
  slice.skip = std::clamp<int64_t>(b, 0, blocks - 1) * cpu::kExpertSliceAlign;
  if (slice.skip > 0) slice.expert = e, slice.inter = inter;
  return slice;
}

double CudaEngine::Impl::cpu_rows_into_y(const std::vector<cpu::RoutedRows>& jobs, int64_t n, float* y) {
  const int64_t D = c.hidden_size, k = c.experts_per_token;
  if (h_extra.bytes() < size_t(n * D) * 4) h_extra = PinnedBuffer(size_t(group_rows() * D) * 4);
  float* out = h_extra.as<float>();
  std::fill(out, out + n * D, 0.0f);
  const auto t0 = std::chrono::steady_clock::now();
  cpu::add_routed_experts(jobs, h_h.as<float>(), D, out);
  const double seconds = seconds_since(t0);
  for (int64_t r0 = 0; r0 < n; r0 += moe_rows) {
    const int64_t cnt = std::min(moe_rows, n - r0);
    MOESRV_CUDA_OK(
        cudaMemcpyAsync(s.extra.as<void>(), out + r0 * D, size_t(cnt * D) * 4, cudaMemcpyHostToDevice, stream));
    moe_combine(y + r0 * D, nullptr, nullptr, nullptr, s.extra.as<float>(), int(cnt), int(k), int(D), stream, false, 0,
                0);
  }
  return seconds;
}

int32_t CudaEngine::Impl::stream_window_slots() const {
  static const int env = [] {
    const char* v = std::getenv("MOESRV_STREAM_WINDOW");
    return v && v[0] ? std::atoi(v) : 0;
  }();
  return std::max(1, env > 0 ? env : opt.stream_window);
}

bool CudaEngine::Impl::lanes_copied_on() const {
  static const bool env = switch_on("MOESRV_LANES_COPIED");
  return opt.hybrid_lanes_copied && env;
}

void CudaEngine::Impl::wait_slot(const DevMoe& m, int slot) {
  MOESRV_CUDA_OK(cudaStreamWaitEvent(stream, m.slots[size_t(slot)].ready, 0));
}

int64_t CudaEngine::Impl::next_moe_layer(int64_t l) const {
  for (int64_t n = l + 1; n < int64_t(layers.size()); ++n) {
    if (!layers[size_t(n)].moe) continue;
    const DevMoe& m = *layers[size_t(n)].moe;
    return m.host && !m.slots.empty() && !m.all_vram && !m.zero_copy ? n : -1;
  }
  return -1;
}

// ids / weights of s.h's S rows through layer m's router. The logits are fp32 (expert choice is sensitive to
// rounding); for decode, logits and routing in one launch.
void CudaEngine::Impl::route_rows(const DevMoe& m, int64_t S, const RouterArgs& ra, int32_t* ids, float* weights) {
  const int64_t D = c.hidden_size, E = c.n_routed_experts;
  const float *router = m.router.as<float>(), *h = s.h.as<float>();
  if (route_fused_supported(int(S), int(E), int(D), router, h)) {
    route_fused(router, h, m.router_bias.as<float>(), int(S), int(D), ra, s.logits_r.as<float>(),
                s.route_ticket.as<unsigned>(), ids, weights, stream);
    return;
  }
  const float one = 1.0f, zero = 0.0f;
  float* logits = s.logits_r.as<float>();
  // Many rows (prefill): fp32 accuracy on TF32 tensor cores, as W_lo h_hi + W_hi h_lo + W_hi h_hi (split_tf32; the
  // dropped W_lo h_lo is ~2^-22 of the logit), the parts in ysorted (free until the experts run), h in slices of
  // the rows that fit. Opt-in (MOESRV_ROUTER_TF32=1): it passes every suite but does not win (8K slice router phase
  // 0.0249 vs 0.0238 s, H200, session 34); else one fp32 GEMM (cuBLAS's SIMT kernels).
  static const bool tf32_env = switch_set("MOESRV_ROUTER_TF32");
  const int64_t room = int64_t(s.ysorted.bytes() / 4) - 2 * E * D, slice = std::min(S, room / (2 * D));
  if (tf32_env && S >= 16 && slice >= 16) {  // (16: the tiny models' 40-token prefills take it too)
    float *wh = s.ysorted.as<float>(), *wl = wh + E * D, *hh = wl + E * D, *hl = hh + slice * D;
    split_tf32(router, E, int(D), D, wh, D, wl, D, stream);
    for (int64_t r0 = 0; r0 < S; r0 += slice) {
      const int64_t rows = std::min(slice, S - r0);
      split_tf32(h + r0 * D, rows, int(D), D, hh, D, hl, D, stream);
      const float* parts[3][2] = {{wl, hh}, {wh, hl}, {wh, hh}};
      for (int p = 0; p < 3; ++p)
        MOESRV_CUBLAS_OK(cublasGemmEx(cublas, CUBLAS_OP_T, CUBLAS_OP_N, int(E), int(rows), int(D), &one, parts[p][0],
                                      CUDA_R_32F, int(D), parts[p][1], CUDA_R_32F, int(D), p ? &one : &zero,
                                      logits + r0 * E, CUDA_R_32F, int(E), CUBLAS_COMPUTE_32F_FAST_TF32,
                                      CUBLAS_GEMM_DEFAULT));
    }
  } else {
    MOESRV_CUBLAS_OK(cublasSgemm(cublas, CUBLAS_OP_T, CUBLAS_OP_N, int(E), int(S), int(D), &one, router, int(D), h,
                                 int(D), &zero, logits, int(E)));
  }
  route(logits, m.router_bias.as<float>(), int(S), ra, ids, weights, stream);
}

// Routes this layer's MoE input (s.h, S <= kRouteFusedMaxTokens rows) through the next MoE layer's router into
// s.pred_ids, without counting usage; moe_hybrid brings the picks back with its own and prefetches them once this
// layer's experts are queued.
void CudaEngine::Impl::predict_next_layer(int64_t l, int64_t S, const RouterArgs& ra) {
  predicted_layer = -1;
  if (prefetch_limit <= 0 || S > kRouteFusedMaxTokens) return;
  const int64_t next = next_moe_layer(l);
  if (next < 0) return;
  const DevMoe& m = *layers[size_t(next)].moe;
  RouterArgs pa = ra;
  pa.counts = nullptr, pa.tokens = nullptr, pa.shared_id = -1;
  route_rows(m, S, pa, s.pred_ids.as<int32_t>(), s.pred_w.as<float>());
  predicted_layer = next;
}

// Starts the copies of layer l's predicted experts (picks [n][k]) that are neither in VRAM nor in a slot, into its
// LRU slots, behind the copies already queued: they cross the link while the GPU computes.
void CudaEngine::Impl::prefetch_experts(int64_t l, const int32_t* picks, int64_t n) {
  const DevMoe& m = *layers[size_t(l)].moe;
  auto fetchable = [&](int32_t e) {
    return e < int32_t(m.placement.size()) && m.placement[size_t(e)] != ExpertPlacement::Vram && m.host->has(e) &&
           !expert_cache->peek(int32_t(l), e);
  };
  for (int32_t e : plan_prefetch(picks, n, c.experts_per_token, prefetch_limit, fetchable)) {
    std::optional<Admission> a = expert_cache->admit(int32_t(l), e);
    if (!a) break;
    fill_slot(l, e, *a);
    prefetched[size_t(l)][size_t(e)] = 1;
    ++stats.prefetched_experts;
  }
}

// A host-planned decode pass (moe_hybrid: slot_grouped) through the grouped GEMVs over its sorted rows, whose runs
// come in home order: the slot experts' copies queued first (then the next layer's prefetch, then the shared expert),
// the rows of the experts in VRAM or already in a slot computed while the link copies, then the copied experts' rows.
void CudaEngine::Impl::moe_slot_grouped(int64_t l, const ExpertPass& pass, const std::vector<int>& run_home, int64_t n,
                                        int64_t shared_rows, int64_t prefetch_layer, CpuSlice slice) {
  DevMoe& m = *layers[size_t(l)].moe;
  const int64_t D = c.hidden_size, k = c.experts_per_token;
  const auto& runs = pass.gpu_runs;
  const int64_t rows_total = int64_t(pass.sorted_tok.size());
  int32_t* row_expert = h_row_expert.as<int32_t>();
  std::vector<int> slot_of(runs.size(), -1);
  int slice_slot = -1;
  int64_t ready_rows = 0;  // rows of the resident runs, which come first
  for (size_t q = 0; q < runs.size(); ++q) {
    const auto [e, row0] = runs[q];
    const int64_t cnt = int64_t(pass.by_expert[size_t(e)].size());
    if (e == slice.expert) {  // a miss (planned so) copied but for the CPU's rows
      expert_weights(l, e, &slot_of[q], true, &slice.skip);
      slice_slot = slot_of[q];
    } else {
      expert_weights(l, e, &slot_of[q], true);  // a miss is admitted and its copy queued
    }
    std::fill_n(row_expert + row0, cnt, int32_t(slot_of[q] < 0 ? e : m.x3_slot_base + slot_of[q]));
    stats.routed_selections += cnt;
    if (run_home[q] < 2) stats.vram_selections += cnt, ready_rows = row0 + cnt;
  }
  upload_ints({{s.rowmap.as<int32_t>(), h_rowmap.as<int32_t>(), n * k},
               {s.sorted_tok.as<int32_t>(), h_sorted_tok.as<int32_t>(), rows_total},
               {s.row_expert.as<int32_t>(), row_expert, rows_total}});
  if (prefetch_layer >= 0) prefetch_experts(prefetch_layer, h_pred.as<int32_t>(), n);
  if (shared_rows > 0) shared_expert_into_y(m, shared_rows);
  const float* d_w = s.w.as<float>();
  for (int phase_rows : {0, 1}) {  // 0: rows [0, ready_rows), 1: the rest
    const int64_t a = phase_rows ? ready_rows : 0, b = phase_rows ? rows_total : ready_rows;
    if (a >= b) continue;
    for (size_t q = 0; q < runs.size(); ++q)
      if (slot_of[q] >= 0 && (run_home[q] == 2) == bool(phase_rows)) wait_slot(m, slot_of[q]);
    moe_exl3_sorted_rows(m, a, b - a);
    moe_combine(s.y.as<float>(), s.ysorted.as<float>() + a * D, s.rowmap.as<int32_t>(), d_w, nullptr, int(n), int(k),
                int(D), stream, false, int(a), int(b));
  }
  for (size_t q = 0; q < runs.size(); ++q)
    if (slot_of[q] >= 0) MOESRV_CUDA_OK(cudaEventRecord(m.slots[size_t(slot_of[q])].free, stream));
  release_held();
  if (slice.skip <= 0 || slice_slot < 0) return;
  // The skipped rows cross once the GPU has read the slot (behind the next layer's prefetch on the link); the slot's
  // `ready` then marks the whole expert for later passes. Or, without top-ups, the expert leaves the cache. Meanwhile
  // the CPU computes them for this pass's tokens.
  if (slice_top_up()) {
    CacheSlot& cs = m.slots[size_t(slice_slot)];
    MOESRV_CUDA_OK(cudaStreamWaitEvent(copy_stream, cs.free, 0));
    stats.fetched_bytes +=
        double(m.host->top_up(slice.expert, cs.mem.as<void>(), copy_stream, slice.skip, slice_gate_up_whole()));
    MOESRV_CUDA_OK(cudaEventRecord(cs.ready, copy_stream));
  } else if (!expert_cache->forget(int32_t(l), slice.expert)) {
    fail("layer {}: expert {}, sliced with the CPU, could not leave its slot", l, slice.expert);
  }
  const MlpWeights& ew = weights->layers[size_t(l)].moe->experts[size_t(slice.expert)];
  std::vector<cpu::RoutedRows> jobs(1);
  cpu::RoutedRows& job = jobs[0];
  job.expert = &ew;
  job.inter0 = 0, job.inter1 = slice.skip;
  const float* wts = h_w.as<float>();
  for (const int32_t entry : pass.by_expert[size_t(slice.expert)])
    job.tokens.push_back(int32_t(entry / k)), job.weights.push_back(wts[entry]);
  const double seconds = cpu_rows_into_y(jobs, n, s.y.as<float>());
  const double part = double(slice.skip) / double(slice.inter);
  stats.cpu_slice_s += seconds;
  if (cold_rates.cpu_first_s > 0) {  // the estimate plan_cpu_slice made (scale 1), against the time it took
    const double est = slice_fixed_s + cold_rates.cpu_s(int64_t(job.tokens.size())) * part;
    slice_scale = std::clamp(0.8 * slice_scale + 0.2 * seconds / est, 0.25, 8.0);
    stats.cpu_slice_scale = slice_scale;
  }
  ++stats.cpu_slices;
  stats.cpu_slice_rows += slice.skip;
  stats.cpu_expert_bytes += part * double(ew.gate->stored_bytes() + ew.up->stored_bytes() + ew.down->stored_bytes());
}

// Host arrays (pinned) to the device on `stream`: by value through one kernel when they are small (a decode pass's),
// so they never wait for a copy engine busy with expert copies; else one copy each.
void CudaEngine::Impl::upload_ints(std::initializer_list<IntUpload> arrays) {
  IntWrites w;
  int64_t total = 0;
  for (const IntUpload& u : arrays) total += u.n;
  const bool by_value = total <= kIntWritesMax && arrays.size() <= std::size(w.dst);
  int a = 0, off = 0;
  for (const IntUpload& u : arrays) {
    if (!by_value) {
      MOESRV_CUDA_OK(cudaMemcpyAsync(u.dst, u.host, size_t(u.n) * 4, cudaMemcpyHostToDevice, stream));
      continue;
    }
    std::copy_n(u.host, u.n, w.v + off);
    w.dst[a] = u.dst, w.n[a] = int(u.n);
    off += int(u.n), ++a;
  }
  if (by_value) write_ints(w, stream);
}

// Rates of the per-pass cold split: given, else measured now on one streamable expert (timed copies into a slot,
// a timed CPU run at 1 and 8 tokens). Without a streamable expert the split never runs.
void CudaEngine::Impl::measure_cold_rates() {
  if (!opt.stream_cold) return;
  cold_rates.pcie_bytes_s = opt.pcie_gbps * 1e9;
  cold_rates.cpu_first_s = opt.cpu_expert_ms * 1e-3;
  cold_rates.cpu_token_s = opt.cpu_token_ms * 1e-3;
  for (int64_t l = 0; l < int64_t(layers.size()); ++l) {
    if (!layers[size_t(l)].moe || !layers[size_t(l)].moe->host || layers[size_t(l)].moe->slots.empty()) continue;
    DevMoe& m = *layers[size_t(l)].moe;
    int e = 0;
    while (e < int(m.placement.size()) && !(m.placement[size_t(e)] == ExpertPlacement::Cpu && m.host->has(e))) ++e;
    if (e == int(m.placement.size())) continue;
    if (cold_rates.pcie_bytes_s <= 0) {
      // Nothing is admitted yet: slot 0's memory is free to overwrite.
      cudaEvent_t a = nullptr, b = nullptr;
      MOESRV_CUDA_OK(cudaEventCreate(&a));
      MOESRV_CUDA_OK(cudaEventCreate(&b));
      float best_ms = 1e30f;
      for (int i = 0; i < 3; ++i) {
        MOESRV_CUDA_OK(cudaEventRecord(a, copy_stream));
        m.host->copy(e, m.slots[0].mem.as<void>(), copy_stream);
        MOESRV_CUDA_OK(cudaEventRecord(b, copy_stream));
        MOESRV_CUDA_OK(cudaEventSynchronize(b));
        float ms = 0;
        MOESRV_CUDA_OK(cudaEventElapsedTime(&ms, a, b));
        best_ms = std::min(best_ms, ms);
      }
      cudaEventDestroy(a);
      cudaEventDestroy(b);
      cold_rates.pcie_bytes_s = double(m.block_bytes[size_t(e)]) / (std::max(best_ms, 1e-3f) * 1e-3);
    }
    if (cold_rates.cpu_first_s <= 0) {
      const MlpWeights& w = weights->layers[size_t(l)].moe->experts[size_t(e)];
      const int64_t D = c.hidden_size;
      std::vector<float> x(size_t(8 * D), 0.01f), y(size_t(8 * D));
      double t[2] = {1e30, 1e30};
      for (int rep = 0; rep < 2; ++rep)
        for (int j = 0; j < 2; ++j) {
          const auto t0 = std::chrono::steady_clock::now();
          cpu::mlp_forward(w, x.data(), j ? 8 : 1, y.data());
          t[j] = std::min(t[j], seconds_since(t0));
        }
      cold_rates.cpu_first_s = t[0];
      cold_rates.cpu_token_s = std::max(0.0, (t[1] - t[0]) / 7);
      // With cpu_expert_slices: what a slice of one block costs beyond its share of the whole expert.
      int64_t inter = 0;
      if (cpu_slices_on() && cpu::expert_slices_supported(w, 1, &inter) && inter >= 2 * cpu::kExpertSliceAlign) {
        double t1 = 1e30;
        for (int rep = 0; rep < 2; ++rep) {
          const auto t0 = std::chrono::steady_clock::now();
          cpu::experts_forward({{&w, x.data(), 1, y.data(), 0, cpu::kExpertSliceAlign}});
          t1 = std::min(t1, seconds_since(t0));
        }
        slice_fixed_s = std::max(0.0, t1 - t[0] * double(cpu::kExpertSliceAlign) / double(inter));
      }
    }
    stats.cold_pcie_gbps = cold_rates.pcie_bytes_s * 1e-9;
    stats.cold_cpu_expert_ms = cold_rates.cpu_first_s * 1e3;
    stats.cpu_slice_fixed_ms = slice_fixed_s * 1e3;
    return;
  }
}

// Measured CPU experts keep the split's CPU costs current (not when the options fixed them).
void CudaEngine::Impl::update_cpu_rate(int64_t tokens, double seconds) {
  if (opt.cpu_expert_ms > 0) return;
  constexpr double kKeep = 0.9;
  if (tokens <= 1) cold_rates.cpu_first_s = kKeep * cold_rates.cpu_first_s + (1 - kKeep) * seconds;
  else
    cold_rates.cpu_token_s = kKeep * cold_rates.cpu_token_s +
                             (1 - kKeep) * std::max(0.0, (seconds - cold_rates.cpu_first_s) / double(tokens - 1));
}

// Tokens [s0, s0 + n) of the pass (the whole pass unless MOESRV_MOE_PASS_ROWS cuts it): s.h rows in, s.y rows
// accumulated. The first pass (shared_rows = the forward's rows) first writes s.y with the shared expert, after the
// routing round trip and the copies of its misses are queued, so the GPU computes it while the link copies and the
// host does not wait for it. One routing copy and host plan per pass, so each GPU expert runs once over all its rows
// (one dequantization of an EXL3 expert per pass, a cold expert crossing PCIe once); the sorted rows go through the
// expert buffers in waves of their height, each wave combined into s.y on its own.
void CudaEngine::Impl::moe_hybrid(int64_t l, int64_t s0, int64_t n, int64_t shared_rows) {
  DevMoe& m = *layers[size_t(l)].moe;
  const MoeWeights& hw = *weights->layers[size_t(l)].moe;
  const int64_t D = c.hidden_size, E = c.n_routed_experts, k = c.experts_per_token, I = c.moe_intermediate_size;
  const float* h = s.h.as<float>() + s0 * D;
  float* y = s.y.as<float>() + s0 * D;
  const int32_t* d_ids = s.ids.as<int32_t>() + s0 * k;
  const float* d_w = s.w.as<float>() + s0 * k;
  release_held();  // (left by a pass that failed)
  ++stats.hybrid_passes;
  bool any_cpu = false;
  for (auto p : m.placement) any_cpu |= p == ExpertPlacement::Cpu;
  MOESRV_CUDA_OK(cudaMemcpyAsync(h_ids.as<void>(), d_ids, size_t(n * k) * 4, cudaMemcpyDeviceToHost, stream));
  MOESRV_CUDA_OK(cudaMemcpyAsync(h_w.as<void>(), d_w, size_t(n * k) * 4, cudaMemcpyDeviceToHost, stream));
  // The next layer's picks of this pass's tokens (a prediction is made only for forwards of at most
  // kRouteFusedMaxTokens tokens, so they are all in this first pass).
  const int64_t prefetch_layer = std::exchange(predicted_layer, -1);
  if (prefetch_layer >= 0)
    MOESRV_CUDA_OK(
        cudaMemcpyAsync(h_pred.as<void>(), s.pred_ids.as<void>(), size_t(n * k) * 4, cudaMemcpyDeviceToHost, stream));
  // The pass's rows for CPU experts: with the routing when the pass is short (decode: a few KB in the same round
  // trip), after the plan and only if it has CPU experts when it is long (a prefill pass streams its cold experts to
  // the GPU, so it rarely has any, and its rows are n x D floats: 128 MB for 8K GLM-5.3-Flash tokens).
  auto copy_rows = [&] {
    if (h_h.bytes() < size_t(n * D) * 4) h_h = PinnedBuffer(size_t(group_rows() * D) * 4);  // on first use
    MOESRV_CUDA_OK(cudaMemcpyAsync(h_h.as<void>(), h, size_t(n * D) * 4, cudaMemcpyDeviceToHost, stream));
  };
  const bool rows_early = (any_cpu || cpu_slices_on()) && n < kStreamPassTokens;
  if (rows_early) copy_rows();
  // A long pass (prefill) queues its shared expert behind the routing's copy and plans while the GPU runs it: the
  // host plan of a 32K-token group (262K sorted rows) took the GPU's time in the router phase before.
  // (MOESRV_SHARED_BEFORE_PLAN=0: after the plan, as before, for comparisons)
  static const bool shared_early_on = switch_on("MOESRV_SHARED_BEFORE_PLAN");
  bool shared_pending = shared_rows > 0;
  if (shared_pending && n >= kStreamPassTokens && shared_early_on) {
    MOESRV_CUDA_OK(cudaEventRecord(routing_copied, stream));
    phase(CudaPhase::Experts);
    shared_expert_into_y(m, shared_rows);
    shared_pending = false;
    MOESRV_CUDA_OK(cudaEventSynchronize(routing_copied));
  } else {
    MOESRV_CUDA_OK(cudaStreamSynchronize(stream));
  }

  // Plan (backend/expert_pass.h): VRAM experts and those already in a slot run on the GPU, Cache experts too
  // (fetched on a miss); a CPU expert with a host copy for the GPU is split between the PCIe link and the CPU for
  // this pass's tokens; the rest run on the CPU.
  std::vector<ExpertWhere> where(size_t(E), ExpertWhere::Gpu);
  for (int64_t e = 0; e < E; ++e)
    if (m.placement[size_t(e)] == ExpertPlacement::Cpu)
      where[size_t(e)] = !m.host || !m.host->has(int(e))              ? ExpertWhere::Cpu
                         : expert_cache->peek(int32_t(l), int32_t(e)) ? ExpertWhere::Gpu
                                                                      : ExpertWhere::Cold;
  ExpertPass pass = plan_expert_pass(
      h_ids.as<int32_t>(), n, k, where,
      [&](int32_t e, int64_t tokens) {
        return ColdCost{e, cold_rates.fetch_s(double(m.block_bytes[size_t(e)])), cold_rates.cpu_s(tokens)};
      },
      !m.slots.empty());
  // 0: in VRAM, 1: in a slot before this pass, 2: copied by this pass.
  auto home = [&](int32_t e) {
    return m.placement[size_t(e)] == ExpertPlacement::Vram ? 0 : expert_cache->peek(int32_t(l), e) ? 1 : 2;
  };
  // Decode through the grouped GEMVs (moe_exl3_sorted_rows) when no expert runs on the CPU and the pass's slot
  // experts fit the layer's slots at once: ~8 launches for the pass instead of ~7 per expert.
  static const bool slot_grouped_env = switch_on("MOESRV_HYBRID_GROUPED");
  const bool slot_grouped_on = opt.grouped_hybrid_decode && slot_grouped_env;
  int64_t in_slots = 0;
  for (const auto& run : pass.gpu_runs) in_slots += home(run.first) > 0;
  const bool slot_grouped = slot_grouped_on && m.exl3 && m.x3_slot_base >= 0 && pass.cpu_experts.empty() &&
                            n <= kExl3MaxGemvRows && s0 == 0 && in_slots <= expert_cache->usable_slots(int32_t(l));
  if (slot_grouped) order_gpu_runs(pass, k, home);  // the experts ready to run first, the copied ones last
  if (!rows_early && !pass.cpu_experts.empty()) {   // (nothing of this pass is queued yet: the copy alone)
    copy_rows();
    MOESRV_CUDA_OK(cudaStreamSynchronize(stream));
  }
  const auto& by_expert = pass.by_expert;
  const auto& gpu_runs = pass.gpu_runs;
  const auto& cpu_experts = pass.cpu_experts;
  const int64_t rows_total = int64_t(pass.sorted_tok.size());
  int32_t* rowmap = h_rowmap.as<int32_t>();
  int32_t* sorted_tok = h_sorted_tok.as<int32_t>();
  std::copy(pass.rowmap.begin(), pass.rowmap.end(), rowmap);
  std::copy(pass.sorted_tok.begin(), pass.sorted_tok.end(), sorted_tok);
  if (!slot_grouped)  // (that path uploads them with its expert table ids)
    upload_ints({{s.rowmap.as<int32_t>(), rowmap, n * k}, {s.sorted_tok.as<int32_t>(), sorted_tok, rows_total}});
  phase(CudaPhase::Experts);
  // Each GPU run's home before this pass (a fetched expert is cached for its later waves).
  std::vector<int> run_home(gpu_runs.size());
  for (size_t r = 0; r < gpu_runs.size(); ++r) run_home[r] = home(gpu_runs[r].first);
  if (slot_grouped) {
    ++stats.grouped_hybrid_passes;
    moe_slot_grouped(l, pass, run_home, n, shared_rows, prefetch_layer, plan_cpu_slice(l, pass, run_home));
    return;
  }
  // All-VRAM EXL3 experts of one shape: rotations once per wave over every row (expert table), 6 launches per expert.
  const bool grouped = m.exl3 && m.x3_grouped && m.all_vram && cpu_experts.empty() && exl3_waves_on();
  if (grouped) {
    int32_t* row_expert = h_row_expert.as<int32_t>();
    for (const auto& [e, row0] : gpu_runs) std::fill_n(row_expert + row0, by_expert[size_t(e)].size(), int32_t(e));
    MOESRV_CUDA_OK(
        cudaMemcpyAsync(s.row_expert.as<void>(), row_expert, size_t(rows_total) * 4, cudaMemcpyHostToDevice, stream));
  }
  const int64_t wave = grouped ? exl3_wave_rows(m) : moe_wave_rows;
  if (wave < 1) fail("layer {}: MoE wave of no rows", l);
  stream_window = n >= kStreamPassTokens ? stream_window_slots() : 0;
  gemm_tiles_used = 0;  // the copies of the previous pass's tiles are done (synchronised above)
  // Each wave's combine visits only the tokens with an entry in it (listed here; a pass of n tokens in W waves would
  // otherwise launch n blocks per wave, most of which find nothing): the lists of the pass, one after another.
  std::vector<int64_t> token_wave(size_t(n), -1);
  int64_t wave_tok_used = 0;
  std::vector<ExpertPiece> pieces;
  struct GpuJob {
    int e = 0;
    int64_t lo = 0, cnt = 0;
    int order = 0;  // its run_home
  };
  std::vector<GpuJob> gpu_jobs;
  auto run_shared = [&] {
    if (std::exchange(shared_pending, false)) shared_expert_into_y(m, shared_rows);
  };
  // The next layer's predicted experts cross the link right behind this layer's own copies.
  int64_t prefetch_pending = prefetch_layer;
  auto run_prefetch = [&] {
    const int64_t next = std::exchange(prefetch_pending, -1);
    if (next >= 0) prefetch_experts(next, h_pred.as<int32_t>(), n);
  };
  size_t r = 0;  // first run that may reach into the wave
  for (int64_t a = 0; a < rows_total; a += wave) {
    const int64_t b = std::min(rows_total, a + wave);
    pieces.clear();
    gpu_jobs.clear();
    if (!m.exl3) gather_rows_bf16(h, s.sorted_tok.as<int32_t>() + a, int(b - a), int(D), s.xs.as<uint16_t>(), stream);
    for (size_t q = r; q < gpu_runs.size(); ++q) {
      const int e = gpu_runs[q].first;
      const int64_t first = gpu_runs[q].second, end = first + int64_t(by_expert[size_t(e)].size());
      if (first >= b) break;
      if (end <= b) r = q + 1;
      const int64_t lo = std::max(first, a), cnt = std::min(end, b) - lo;
      stats.routed_selections += cnt;
      if (run_home[q] < 2) stats.vram_selections += cnt;
      if (grouped) {
        pieces.push_back({e, lo, cnt});
        continue;
      }
      gpu_jobs.push_back({e, lo, cnt, run_home[q]});
    }
    if (grouped) {
      run_shared();
      moe_exl3_wave(m, a, b - a, pieces);
    } else {
      // Decode: when the wave's slot experts fit the layer's slots, every miss's copy is queued before any compute
      // (the link starts at once) and the GPU runs the experts in VRAM first, then those already in a slot, then the
      // copied ones in copy order. Otherwise (and for prefill's streaming window) each expert is fetched right before
      // its compute, so a slot is never refilled before the expert in it has run.
      const int64_t in_slots =
          std::count_if(gpu_jobs.begin(), gpu_jobs.end(), [](const GpuJob& j) { return j.order > 0; });
      const bool ahead = stream_window == 0 && in_slots <= expert_cache->usable_slots(int32_t(l));
      std::vector<int> slot_of(gpu_jobs.size(), -1);
      std::vector<const void*> block_of(gpu_jobs.size(), nullptr);
      if (ahead) {
        std::stable_sort(gpu_jobs.begin(), gpu_jobs.end(),
                         [](const GpuJob& x, const GpuJob& y) { return x.order < y.order; });
        for (size_t j = 0; j < gpu_jobs.size(); ++j) block_of[j] = expert_weights(l, gpu_jobs[j].e, &slot_of[j], true);
        run_prefetch();
      }
      // Hybrid lanes (EXL3, experts with GEMM-sized row counts): with hybrid_lanes_copied (the default) each runs on
      // the least loaded of this stream and the lanes (by rows), waiting only for its own copy; without, the ones
      // resident before this pass run on the lanes and this stream runs the copied ones in copy order. Either way the
      // link's copies never wait behind a resident expert's GEMMs (a window slot is free once the expert copied into
      // it has run, on whichever stream), and the experts' dequantizations and GEMMs overlap each other.
      const bool lanes_on = m.exl3 && lanes_have_scratch, lanes_copied = lanes_copied_on();
      auto may_lane = [&](const GpuJob& job) {
        return lanes_on && job.cnt > kExl3MaxGemvRows && (job.order < 2 || lanes_copied);
      };
      std::vector<int64_t> load(expert_lanes.size() + 1, 0);  // rows per stream: 0 = this one, then the lanes
      auto stream_for = [&](const GpuJob& job) -> size_t {    // (without lanes_copied this one keeps the copy chain)
        if (!may_lane(job)) return 0;
        return size_t(std::min_element(load.begin() + (lanes_copied ? 0 : 1), load.end()) - load.begin());
      };
      const bool any_laned = std::any_of(gpu_jobs.begin(), gpu_jobs.end(), may_lane);
      if (any_laned) {  // the lanes start from here, not behind the shared expert
        MOESRV_CUDA_OK(cudaEventRecord(lanes_fork, stream));
        for (ExpertLane& lane : expert_lanes) MOESRV_CUDA_OK(cudaStreamWaitEvent(lane.stream, lanes_fork, 0));
      }
      run_shared();
      for (size_t j = 0; j < gpu_jobs.size(); ++j) {
        const GpuJob& job = gpu_jobs[j];
        if (!ahead) block_of[j] = expert_weights(l, job.e, &slot_of[j]);
        const size_t where = stream_for(job);
        load[where] += job.cnt;
        auto run = [&] {
          if (slot_of[j] >= 0) wait_slot(m, slot_of[j]);
          if (m.exl3) {
            expert_exl3(m, job.e, block_of[j], h, job.lo, job.lo - a, job.cnt);
            return;
          }
          const uint16_t* w = static_cast<const uint16_t*>(block_of[j]);
          const int64_t b0 = job.lo - a;
          float* gu = s.mgu.as<float>() + b0 * 2 * I;
          gemm_bf16(w, 2 * I, D, s.xs.as<uint16_t>() + b0 * D, job.cnt, gu);
          silu_mul_clamped(gu, int(job.cnt), int(I), m.limit, s.mact.as<float>() + b0 * I, stream);
          to_bf16(s.mact.as<float>() + b0 * I, job.cnt * I, s.mactb.as<uint16_t>() + b0 * I, stream);
          gemm_bf16(w + 2 * I * D, D, I, s.mactb.as<uint16_t>() + b0 * I, job.cnt, s.ysorted.as<float>() + b0 * D);
        };
        cudaStream_t on = stream;
        if (where == 0) {
          run();
        } else {
          ExpertLane& lane = expert_lanes[where - 1];
          on = lane.stream;
          ++stats.laned_expert_runs;
          on_lane(lane, run);
        }
        if (slot_of[j] >= 0) MOESRV_CUDA_OK(cudaEventRecord(m.slots[size_t(slot_of[j])].free, on));
      }
      release_held();  // (every slot's last read of this wave is ordered by its `free` event now)
      if (any_laned)
        for (ExpertLane& lane : expert_lanes) {
          MOESRV_CUDA_OK(cudaEventRecord(lane.join, lane.stream));
          MOESRV_CUDA_OK(cudaStreamWaitEvent(stream, lane.join, 0));
        }
    }
    int32_t* wave_tok = h_wave_tok.as<int32_t>() + wave_tok_used;
    int64_t n_tok = 0;
    for (int64_t row = a; row < b; ++row)
      if (const int32_t t = sorted_tok[row]; std::exchange(token_wave[size_t(t)], a) != a) wave_tok[n_tok++] = t;
    int32_t* d_wave_tok = s.wave_tok.as<int32_t>() + wave_tok_used;
    MOESRV_CUDA_OK(cudaMemcpyAsync(d_wave_tok, wave_tok, size_t(n_tok) * 4, cudaMemcpyHostToDevice, stream));
    wave_tok_used += n_tok;
    moe_combine(y, s.ysorted.as<float>(), s.rowmap.as<int32_t>(), d_w, nullptr, int(n), int(k), int(D), stream, false,
                int(a), int(b), d_wave_tok, int(n_tok));
  }
  run_shared();    // (no GPU expert in this pass)
  run_prefetch();  // (copies fetched expert by expert above)
  if (stream_window) expert_cache->end_stream(int32_t(l));
  stream_window = 0;
  // CPU experts while the GPU works through the queue above; their sum joins s.y in slices of moe_rows tokens.
  if (cpu_experts.empty()) return;
  const float* wts = h_w.as<float>();
  // All CPU experts in one call (cpu::add_routed_experts: few-row experts share parallel_fors), so only the whole
  // batch can be timed (its gather and weighted adds included): update_cpu_rate gets the batch time split evenly over
  // its experts, each counted with the batch's mean token count (rounded), the cost model's cost of one typical expert.
  std::vector<cpu::RoutedRows> jobs;
  int64_t total = 0;
  for (int e : cpu_experts) {
    const auto& entries = by_expert[size_t(e)];
    cpu::RoutedRows& j = jobs.emplace_back();
    j.expert = &hw.experts[size_t(e)];
    for (const int32_t entry : entries) j.tokens.push_back(int32_t(entry / k)), j.weights.push_back(wts[entry]);
    total += int64_t(entries.size());
    stats.routed_selections += int64_t(entries.size());
    stats.cpu_expert_tokens += int64_t(entries.size());
    const MlpWeights& ew = hw.experts[size_t(e)];
    stats.cpu_expert_bytes += double(ew.gate->stored_bytes() + ew.up->stored_bytes() + ew.down->stored_bytes());
  }
  const double seconds = cpu_rows_into_y(jobs, n, y);
  const int64_t experts = int64_t(cpu_experts.size());
  for (int64_t i = 0; i < experts; ++i)
    update_cpu_rate(std::max<int64_t>(1, (total + experts / 2) / experts), seconds / double(experts));
}

}  // namespace moesrv
#endif  // MOESRV_HAS_CUDA
