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
  static const bool shared_side_env = switch_set("MOESRV_SHARED_SIDE");
  const bool shared_side_on = opt.shared_expert_beside_router || shared_side_env;
  const bool grouped = (m.all_vram || m.zero_copy) && S <= 8 && (!m.exl3 || m.x3_grouped);
  // Decode with shared_expert_beside_router: the shared expert on proj_side, beside the router and the routed experts
  // (it reads only h); else shared and routed experts in the same grouped launches: routing rows [shared | k picks].
  const bool shared_side = grouped && m.shared_grouped && shared_side_on && proj_side_ok(S);
  const bool shared_in_group = grouped && m.shared_grouped && !shared_side;
  if (shared_in_group) ra.shared_id = int(E);
  if (shared_side) on_proj_side(S, [&] { shared_expert_exl3(m, h, y); });
  // Router logits in fp32 (expert choice is sensitive to rounding); for decode, logits and routing in one launch.
  const float* router = m.router.as<float>();
  if (route_fused_supported(int(S), int(E), int(D), router, h)) {
    route_fused(router, h, m.router_bias.as<float>(), int(S), int(D), ra, s.logits_r.as<float>(),
                s.route_ticket.as<unsigned>(), s.ids.as<int32_t>(), s.w.as<float>(), stream);
  } else {
    const float one = 1.0f, zero = 0.0f;
    MOESRV_CUBLAS_OK(cublasSgemm(cublas, CUBLAS_OP_T, CUBLAS_OP_N, int(E), int(S), int(D), &one, router, int(D), h,
                                 int(D), &zero, s.logits_r.as<float>(), int(E)));
    route(s.logits_r.as<float>(), m.router_bias.as<float>(), int(S), ra, s.ids.as<int32_t>(), s.w.as<float>(), stream);
  }
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
  phase(CudaPhase::Experts);
  if (m.shared) {
    mlp(*m.shared, h, S, y);
    if (m.shared_gate.bytes()) shared_expert_gate(h, m.shared_gate.as<float>(), int(S), int(D), y, stream);
  } else {
    MOESRV_CUDA_OK(cudaMemsetAsync(y, 0, size_t(S * D) * 4, stream));
  }
  if (grouped) {
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
    moe_hybrid(l, s0, std::min(moe_pass_rows, S - s0));
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

const void* CudaEngine::Impl::expert_weights(int64_t l, int e, int* slot) {
  DevMoe& m = *layers[size_t(l)].moe;
  *slot = -1;
  if (m.placement[size_t(e)] == ExpertPlacement::Vram) return m.vram[size_t(e)].as<void>();
  if (std::optional<int32_t> hit = expert_cache->lookup(int32_t(l), e)) {
    *slot = *hit;
  } else {
    // No slot is ever retained: the events below order a slot's reuse after the GPU's last read of it.
    std::optional<Admission> a = expert_cache->admit(int32_t(l), e, stream_window);
    if (!a) fail("layer {}: no expert cache slot for expert {}", l, e);
    *slot = a->slot;
    stats.fetched_bytes += double(m.block_bytes[size_t(e)]);
    CacheSlot& cs = m.slots[size_t(*slot)];
    // Overwrite only after the GPU finished with the evicted expert; compute waits for the copy below.
    MOESRV_CUDA_OK(cudaStreamWaitEvent(copy_stream, cs.free, 0));
    m.host->copy(e, cs.mem.as<void>(), copy_stream);
    MOESRV_CUDA_OK(cudaEventRecord(cs.ready, copy_stream));
  }
  CacheSlot& cs = m.slots[size_t(*slot)];
  MOESRV_CUDA_OK(cudaStreamWaitEvent(stream, cs.ready, 0));
  return cs.mem.as<void>();
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
    }
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
// accumulated (the shared expert is already there). One routing copy and host plan per pass, so each GPU expert
// runs once over all its rows (one dequantization of an EXL3 expert per pass, a cold expert crossing PCIe once);
// the sorted rows go through the expert buffers in waves of their height, each wave combined into s.y on its own.
void CudaEngine::Impl::moe_hybrid(int64_t l, int64_t s0, int64_t n) {
  DevMoe& m = *layers[size_t(l)].moe;
  const MoeWeights& hw = *weights->layers[size_t(l)].moe;
  const int64_t D = c.hidden_size, E = c.n_routed_experts, k = c.experts_per_token, I = c.moe_intermediate_size;
  const float* h = s.h.as<float>() + s0 * D;
  float* y = s.y.as<float>() + s0 * D;
  const int32_t* d_ids = s.ids.as<int32_t>() + s0 * k;
  const float* d_w = s.w.as<float>() + s0 * k;
  bool any_cpu = false;
  for (auto p : m.placement) any_cpu |= p == ExpertPlacement::Cpu;
  MOESRV_CUDA_OK(cudaMemcpyAsync(h_ids.as<void>(), d_ids, size_t(n * k) * 4, cudaMemcpyDeviceToHost, stream));
  MOESRV_CUDA_OK(cudaMemcpyAsync(h_w.as<void>(), d_w, size_t(n * k) * 4, cudaMemcpyDeviceToHost, stream));
  if (any_cpu) {
    if (h_h.bytes() < size_t(n * D) * 4) h_h = PinnedBuffer(size_t(group_rows() * D) * 4);  // on first use
    MOESRV_CUDA_OK(cudaMemcpyAsync(h_h.as<void>(), h, size_t(n * D) * 4, cudaMemcpyDeviceToHost, stream));
  }
  MOESRV_CUDA_OK(cudaStreamSynchronize(stream));

  // Plan (backend/expert_pass.h): VRAM experts and those already in a slot run on the GPU, Cache experts too
  // (fetched on a miss); a CPU expert with a host copy for the GPU is split between the PCIe link and the CPU for
  // this pass's tokens; the rest run on the CPU.
  std::vector<ExpertWhere> where(size_t(E), ExpertWhere::Gpu);
  for (int64_t e = 0; e < E; ++e)
    if (m.placement[size_t(e)] == ExpertPlacement::Cpu)
      where[size_t(e)] = !m.host || !m.host->has(int(e))              ? ExpertWhere::Cpu
                         : expert_cache->peek(int32_t(l), int32_t(e)) ? ExpertWhere::Gpu
                                                                      : ExpertWhere::Cold;
  const ExpertPass pass = plan_expert_pass(
      h_ids.as<int32_t>(), n, k, where,
      [&](int32_t e, int64_t tokens) {
        return ColdCost{e, cold_rates.fetch_s(double(m.block_bytes[size_t(e)])), cold_rates.cpu_s(tokens)};
      },
      !m.slots.empty());
  const auto& by_expert = pass.by_expert;
  const auto& gpu_runs = pass.gpu_runs;
  const auto& cpu_experts = pass.cpu_experts;
  const int64_t rows_total = int64_t(pass.sorted_tok.size());
  int32_t* rowmap = h_rowmap.as<int32_t>();
  int32_t* sorted_tok = h_sorted_tok.as<int32_t>();
  std::copy(pass.rowmap.begin(), pass.rowmap.end(), rowmap);
  std::copy(pass.sorted_tok.begin(), pass.sorted_tok.end(), sorted_tok);
  MOESRV_CUDA_OK(cudaMemcpyAsync(s.rowmap.as<void>(), rowmap, size_t(n * k) * 4, cudaMemcpyHostToDevice, stream));
  MOESRV_CUDA_OK(
      cudaMemcpyAsync(s.sorted_tok.as<void>(), sorted_tok, size_t(rows_total) * 4, cudaMemcpyHostToDevice, stream));
  phase(CudaPhase::Experts);
  // Whether each GPU expert was resident before this pass (a fetched one is cached for its later waves).
  std::vector<char> resident(gpu_runs.size());
  for (size_t r = 0; r < gpu_runs.size(); ++r) {
    const int e = gpu_runs[r].first;
    resident[r] = m.placement[size_t(e)] == ExpertPlacement::Vram || expert_cache->peek(int32_t(l), e);
  }
  // All-VRAM EXL3 experts of one shape: rotations once per wave over every row (expert table), 6 launches per expert.
  const bool grouped = m.exl3 && m.x3_grouped && m.all_vram && cpu_experts.empty();
  if (grouped) {
    int32_t* row_expert = h_row_expert.as<int32_t>();
    for (const auto& [e, row0] : gpu_runs) std::fill_n(row_expert + row0, by_expert[size_t(e)].size(), int32_t(e));
    MOESRV_CUDA_OK(
        cudaMemcpyAsync(s.row_expert.as<void>(), row_expert, size_t(rows_total) * 4, cudaMemcpyHostToDevice, stream));
  }
  const int64_t wave = grouped ? exl3_wave_rows(m) : moe_wave_rows;
  if (wave < 1) fail("layer {}: MoE wave of no rows", l);
  stream_window = n >= kStreamPassTokens ? kStreamWindow : 0;
  gemm_tiles_used = 0;  // the copies of the previous pass's tiles are done (synchronised above)
  std::vector<ExpertPiece> pieces;
  size_t r = 0;  // first run that may reach into the wave
  for (int64_t a = 0; a < rows_total; a += wave) {
    const int64_t b = std::min(rows_total, a + wave);
    pieces.clear();
    if (!m.exl3) gather_rows_bf16(h, s.sorted_tok.as<int32_t>() + a, int(b - a), int(D), s.xs.as<uint16_t>(), stream);
    for (size_t q = r; q < gpu_runs.size(); ++q) {
      const int e = gpu_runs[q].first;
      const int64_t first = gpu_runs[q].second, end = first + int64_t(by_expert[size_t(e)].size());
      if (first >= b) break;
      if (end <= b) r = q + 1;
      const int64_t lo = std::max(first, a), cnt = std::min(end, b) - lo;
      if (grouped) {
        pieces.push_back({e, lo, cnt});
        stats.routed_selections += cnt, stats.vram_selections += cnt;
        continue;
      }
      int slot = -1;
      const void* block = expert_weights(l, e, &slot);
      stats.routed_selections += cnt;
      if (resident[q]) stats.vram_selections += cnt;
      if (m.exl3) {
        expert_exl3(m, e, block, h, lo, lo - a, cnt);
      } else {
        const uint16_t* w = static_cast<const uint16_t*>(block);
        const int64_t b0 = lo - a;
        float* gu = s.mgu.as<float>() + b0 * 2 * I;
        gemm_bf16(w, 2 * I, D, s.xs.as<uint16_t>() + b0 * D, cnt, gu);
        silu_mul_clamped(gu, int(cnt), int(I), m.limit, s.mact.as<float>() + b0 * I, stream);
        to_bf16(s.mact.as<float>() + b0 * I, cnt * I, s.mactb.as<uint16_t>() + b0 * I, stream);
        gemm_bf16(w + 2 * I * D, D, I, s.mactb.as<uint16_t>() + b0 * I, cnt, s.ysorted.as<float>() + b0 * D);
      }
      if (slot >= 0) MOESRV_CUDA_OK(cudaEventRecord(m.slots[size_t(slot)].free, stream));
    }
    if (grouped) moe_exl3_wave(m, a, b - a, pieces);
    moe_combine(y, s.ysorted.as<float>(), s.rowmap.as<int32_t>(), d_w, nullptr, int(n), int(k), int(D), stream, false,
                int(a), int(b));
  }
  if (stream_window) expert_cache->end_stream(int32_t(l));
  stream_window = 0;
  // CPU experts while the GPU works through the queue above; their sum joins s.y in slices of moe_rows tokens.
  if (cpu_experts.empty()) return;
  if (h_extra.bytes() < size_t(n * D) * 4) h_extra = PinnedBuffer(size_t(group_rows() * D) * 4);
  float* out = h_extra.as<float>();
  std::fill(out, out + n * D, 0.0f);
  const float* hh = h_h.as<float>();
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
  const auto t0 = std::chrono::steady_clock::now();
  cpu::add_routed_experts(jobs, hh, D, out);
  const double seconds = seconds_since(t0);
  const int64_t experts = int64_t(cpu_experts.size());
  for (int64_t i = 0; i < experts; ++i)
    update_cpu_rate(std::max<int64_t>(1, (total + experts / 2) / experts), seconds / double(experts));
  for (int64_t t0 = 0; t0 < n; t0 += moe_rows) {
    const int64_t cnt = std::min(moe_rows, n - t0);
    MOESRV_CUDA_OK(
        cudaMemcpyAsync(s.extra.as<void>(), out + t0 * D, size_t(cnt * D) * 4, cudaMemcpyHostToDevice, stream));
    moe_combine(y + t0 * D, nullptr, nullptr, nullptr, s.extra.as<float>(), int(cnt), int(k), int(D), stream, false, 0,
                0);
  }
}

}  // namespace moesrv
#endif  // MOESRV_HAS_CUDA
