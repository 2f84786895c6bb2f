// EXL3 weights in the CUDA engine: linears kept as stored (trellis | suh | svh) run as the EXL3 GEMV for up to 8
// rows (decode) and as fp16 W_hat slabs dequantized into scratch + cuBLAS for more (prefill); routed experts
// in VRAM run as grouped GEMVs over the device expert table (graph safe), cached ones from their slot.
#if defined(MOESRV_HAS_CUDA) && MOESRV_HAS_CUDA
#include <algorithm>
#include <cstdlib>
#include <limits>

#include "backend/cuda/engine_internal.h"

namespace moesrv {

using namespace moesrv::cuda;

namespace {

constexpr int64_t kGemmRowBlock = 2048;         // rows per rotated fp16 input block of the GEMM path
constexpr size_t kW16Elems = size_t(32) << 20;  // fp16 W_hat slab scratch (64 MiB), capped by the largest matrix

struct Exl3Extent {
  int64_t in = 0, out = 0;  // largest in_pad / out_pad
  size_t whole = 0;         // largest in_pad * out_pad
  void see(const Exl3Dev& w) {
    in = std::max<int64_t>(in, w.in_pad);
    out = std::max<int64_t>(out, w.out_pad);
    whole = std::max(whole, size_t(w.in_pad) * size_t(w.out_pad));
  }
  void see(const DevLinear& l) {
    for (const Exl3Part& p : l.x3) see(p.w);
  }
};

// Every routed EXL3 expert matrix of the layers.
Exl3Extent expert_extent(const std::vector<DevLayer>& layers) {
  Exl3Extent x;
  for (const DevLayer& L : layers)
    if (L.moe && L.moe->exl3)
      for (const auto& parts : L.moe->x3_off)
        for (const Exl3Dev& w : parts) x.see(w);
  return x;
}

}  // namespace

void CudaEngine::Impl::allocate_exl3_scratch() {
  Exl3Extent all, head, moe;
  head.see(lm_head);
  if (mtp_in) all.see(mtp_in->eh_proj);
  for (const DevLayer& L : layers) {
    const DevAttention& a = L.attn;
    for (const DevLinear* l : {&a.q_a, &a.q_b, &a.q, &a.kv_a, &a.o, &a.gq, &a.gk, &a.gv}) all.see(*l);
    if (a.indexer)
      for (const DevLinear* l : {&a.indexer->wq_b, &a.indexer->wk, &a.indexer->weights_proj, &a.indexer->pool_gate})
        all.see(*l);
    if (L.kda)
      for (const DevLinear* l : {&L.kda->qkv, &L.kda->f_a, &L.kda->f_b, &L.kda->b, &L.kda->g_a, &L.kda->g_b, &L.kda->o})
        all.see(*l);
    if (L.gated_delta)
      for (const DevLinear* l : {&L.gated_delta->qkvz, &L.gated_delta->ba, &L.gated_delta->out}) all.see(*l);
    if (L.mlp) all.see(L.mlp->gate_up), all.see(L.mlp->down);
    if (!L.moe) continue;
    if (L.moe->shared) all.see(L.moe->shared->gate_up), all.see(L.moe->shared->down);
    if (L.moe->exl3)
      for (const auto& x : L.moe->x3_off)
        for (const Exl3Dev& w : x) moe.see(w), all.see(w);
  }
  if (all.in == 0 && head.in == 0) return;
  exl3_sm_count();  // GEMV geometry, read before any graph capture
  const int64_t rb = std::min(rows, kGemmRowBlock), grouped = 2 * int64_t(kExl3MaxGemvRows) * (c.experts_per_token + 1);
  const int64_t in = std::max(all.in, head.in), out = std::max(all.out, head.out);
  // (a prefill MoE wave's rotated rows, fp16: the waves are as tall as the expert buffers, not rb rows)
  const size_t xh =
      size_t(std::max({rb * in * 2, kExl3MaxGemvRows * in * 4, grouped * moe.in * 4, moe_wave_rows * moe.in * 2}));
  const size_t yr =  // a one-row GEMV leaves up to kExl3MaxGemvParts K parts, as many as fit
      size_t(std::max({rb * all.out, int64_t(kExl3GemvScratchParts) * out, 2 * grouped * moe.out})) * 4;
  const size_t w16 = std::max(std::min(kW16Elems, std::max(all.whole, head.whole)), size_t(in) * 16) * 2;
  s.x3_xh = DeviceBuffer(budget, xh, "EXL3 rotated input");
  s.x3_yr = DeviceBuffer(budget, yr, "EXL3 rotated output");
  // exl3_gemv_out's counters (128 outputs each) for the largest one-row calls: grouped rows or one plain row
  auto tickets = [&](int64_t count, const char* what) {
    DeviceBuffer b(budget, size_t(count) * 4, what);
    MOESRV_CUDA_OK(cudaMemsetAsync(b.as<void>(), 0, b.bytes(), stream));  // (the side forks from stream)
    return b;
  };
  s.x3_tickets = tickets(std::max({out, 2 * grouped * moe.out, int64_t(kExl3MaxGemvRows) * all.out}) / 128,
                         "EXL3 output rotation tickets");
  s.x3_w16 = DeviceBuffer(budget, w16, "EXL3 dequant slab");
  if (moe.in > 0)  // moe_exl3_grouped's entries of a few tokens that share an expert (exl3_row_sets)
    s.x3_sets = DeviceBuffer(budget, size_t(grouped / 2) * sizeof(Exl3RowSet), "EXL3 expert row sets");
  // one-token calls on proj_side (up to two grouped rows), with as many K parts as on the main stream
  if (all.in == 0) return;
  s.x3_xh_side = DeviceBuffer(budget, size_t(2 * kExl3MaxGemvRows * all.in) * 4, "EXL3 side rotated input");
  s.x3_yr_side = DeviceBuffer(budget, size_t(2 * kExl3GemvScratchParts * all.out) * 4, "EXL3 side rotated output");
  s.x3_tickets_side = tickets(2 * kExl3MaxGemvRows * all.out / 128, "EXL3 side output rotation tickets");
}

void CudaEngine::Impl::make_expert_lanes(size_t n, size_t w16_bytes, size_t xh_bytes, size_t yr_bytes) {
  MOESRV_CUDA_OK(cudaEventCreateWithFlags(&lanes_fork, cudaEventDisableTiming));
  expert_lanes.resize(n);
  for (ExpertLane& lane : expert_lanes) {
    MOESRV_CUDA_OK(cudaStreamCreateWithFlags(&lane.stream, cudaStreamNonBlocking));
    MOESRV_CUDA_OK(cudaEventCreateWithFlags(&lane.join, cudaEventDisableTiming));
    MOESRV_CUBLAS_OK(cublasCreate(&lane.blas));
    MOESRV_CUBLAS_OK(cublasSetStream(lane.blas, lane.stream));
    lane.w16 = DeviceBuffer(budget, w16_bytes, "EXL3 expert lane slab");
    if (xh_bytes) lane.xh = DeviceBuffer(budget, xh_bytes, "EXL3 expert lane rotated input");
    if (yr_bytes) lane.yr = DeviceBuffer(budget, yr_bytes, "EXL3 expert lane rotated output");
  }
  lanes_have_scratch = xh_bytes > 0 && yr_bytes > 0;
}

void CudaEngine::Impl::allocate_expert_lanes(size_t reserve_bytes) {
  if (!expert_lanes.empty()) return;  // the hybrid lanes serve the waves too
  for (const DevLayer& L : layers)    // the waves run only all-VRAM grouped
    if (L.moe && (!L.moe->exl3 || !L.moe->x3_grouped || !L.moe->all_vram)) return;
  const size_t whole = expert_extent(layers).whole;  // the largest expert matrix (fp16 elements)
  const char* v = std::getenv("MOESRV_EXPERT_LANES");
  const int lanes = std::clamp(v ? std::atoi(v) : 4, 1, 8);
  if (whole == 0 || rows <= kExl3MaxGemvRows || lanes < 2) return;
  const size_t room = budget->left() > reserve_bytes ? budget->left() - reserve_bytes : 0;
  const size_t n = std::min(size_t(lanes - 1), room / (whole * 2));
  if (n > 0) make_expert_lanes(n, whole * 2, 0, 0);
}

// Before the expert plan of a placement that may leave experts outside VRAM (a budget or a given placement): lanes
// with a slab and row-block scratch for the largest expert matrix, for the host-planned passes (moe_hybrid). They
// take at most an eighth of the budget's room beyond `reserve_bytes` (the sequences' share): the rest is the experts'.
void CudaEngine::Impl::allocate_hybrid_lanes(size_t reserve_bytes) {
  const char* v = std::getenv("MOESRV_HYBRID_LANES");
  const int n = std::clamp(v && v[0] ? std::atoi(v) : opt.hybrid_lanes, 0, 7);
  if (n == 0 || rows <= kExl3MaxGemvRows || !expert_lanes.empty()) return;
  if (!hybrid_options() && exl3_waves_on()) return;
  const Exl3Extent moe = expert_extent(layers);
  if (moe.whole == 0) return;
  const int64_t rb = std::min(rows, kGemmRowBlock);
  const size_t xh = size_t(rb * moe.in) * 2, yr = size_t(rb * moe.out) * 4, lane = moe.whole * 2 + xh + yr;
  const size_t room = budget->left() > reserve_bytes ? budget->left() - reserve_bytes : 0;
  const size_t fit = std::min(size_t(n), room / 8 / lane);
  if (fit > 0) make_expert_lanes(fit, moe.whole * 2, xh, yr);
}

// MOESRV_EXL3_WAVES=0 (comparisons): all-VRAM prefill runs its EXL3 experts one by one on the hybrid lanes, as a
// host-planned pass under a budget does, instead of in grouped waves.
bool CudaEngine::Impl::exl3_waves_on() {
  static const bool on = switch_on("MOESRV_EXL3_WAVES");
  return on;
}

void CudaEngine::Impl::exl3_forward(const Exl3Dev& w, Exl3Src src, int64_t n, float* y, int64_t y_ld,
                                    const float* bias) {
  float* yr = s.x3_yr.as<float>();
  if (n >= 2 && n <= kExl3SetRows && row_gemv_on()) {  // the rows share each decoded weight
    exl3_gemv_rows_out(w, {}, nullptr, int(n), src, int(n), s.x3_xh.as<float>(), yr, y, y_ld, bias, stream);
    return;
  }
  if (n <= kExl3MaxGemvRows) {
    exl3_gemv_out(w, {}, src, int(n), s.x3_xh.as<void>(), yr, s.x3_yr.bytes() / 4, x3_tickets(), y, y_ld, bias, stream);
    return;
  }
  const int64_t blk = std::min(
      {n, int64_t(s.x3_xh.bytes() / (size_t(w.in_pad) * 2)), int64_t(s.x3_yr.bytes() / (size_t(w.out_pad) * 4))});
  if (blk < 1) fail("EXL3 scratch too small for a {}x{} linear", w.out_pad, w.in_pad);
  const size_t w16 = s.x3_w16.bytes() / 2;
  const bool whole = exl3_fits_whole(w, w16);
  for (int64_t r0 = 0; r0 < n; r0 += blk) {
    const int nb = int(std::min(blk, n - r0));
    Exl3Src part = src;
    if (part.rows) part.rows += r0;
    else part.x += r0 * src.ld;
    exl3_rotate_in(w, {}, part, nb, s.x3_xh.as<void>(), true, stream);
    exl3_gemm_rotated(w, s.x3_xh.as<uint16_t>(), nb, yr, s.x3_w16.as<uint16_t>(), w16, whole && r0 > 0, cublas, stream);
    exl3_rotate_out(w, {}, yr, nb, y + r0 * y_ld, y_ld, bias, stream);
  }
}

void CudaEngine::Impl::exl3_group(const DevGroup& grp, const Exl3Dev& w, Exl3Src src, float* y, int64_t y_ld) {
  const Exl3Group g{grp.tab.as<Exl3Dev>(), grp.ids.as<int32_t>()};
  float* yr = s.x3_yr.as<float>();
  exl3_gemv_out(w, g, src, grp.count, s.x3_xh.as<void>(), yr, s.x3_yr.bytes() / 4, x3_tickets(), y, y_ld, nullptr,
                stream);
}

// Entry i = token i / kk with expert ids[i] (kk = k, or 1 + k with the shared expert first): gate and up into s.mgu
// rows [gate | up] (one grouped call when their shapes match), then down over their SwiGLU (computed while rotating
// its input) into s.ysorted. 4 launches (6 when gate and up differ in shape or bits).
void CudaEngine::Impl::moe_exl3_grouped(DevMoe& m, int64_t S, bool with_shared) {
  const int64_t D = c.hidden_size, I = c.moe_intermediate_size;
  const int64_t kk = c.experts_per_token + (with_shared ? 1 : 0);
  const int M = int(S * kk);
  const Exl3Dev* tab = m.x3_tab.as<Exl3Dev>();
  const int32_t* ids = s.ids.as<int32_t>();
  float *xh = s.x3_xh.as<float>(), *yr = s.x3_yr.as<float>(), *gu = s.mgu.as<float>();
  const size_t yr_floats = s.x3_yr.bytes() / 4;
  const Exl3Dev &gate = m.x3_off[0][0], &up = m.x3_off[0][1];
  const bool paired = gate.K == up.K && gate.cb == up.cb && gate.in_pad == up.in_pad && gate.out_pad == up.out_pad;
  if (S >= 2 && S <= kExl3SetRows && merge_expert_rows_on() && s.x3_sets.bytes() >= size_t(M) * sizeof(Exl3RowSet)) {
    // a few tokens (an MTP verify): the entries that share an expert read it once (merge_expert_rows)
    Exl3RowSet* sets = s.x3_sets.as<Exl3RowSet>();
    exl3_row_sets(ids, M, sets, stream);
    const Exl3Src in{s.h.as<float>(), D, nullptr, int(kk)};
    if (paired) {
      exl3_gemv_rows_out(gate, Exl3Group{tab, ids, M, int(m.x3_stride), I}, sets, int(S), in, 2 * M, xh, yr, gu, 2 * I,
                         nullptr, stream);
    } else {
      for (int p = 0; p < 2; ++p)
        exl3_gemv_rows_out(m.x3_off[0][size_t(p)], Exl3Group{tab + p * m.x3_stride, ids}, sets, int(S), in, M, xh, yr,
                           gu + p * I, 2 * I, nullptr, stream);
    }
    exl3_gemv_rows_out(m.x3_off[0][2], Exl3Group{tab + 2 * m.x3_stride, ids}, sets, int(S),
                       Exl3Src{gu, 2 * I, nullptr, 1, true, m.limit}, M, xh, yr, s.ysorted.as<float>(), D, nullptr,
                       stream);
    return;
  }
  if (paired) {
    // gate and up as the two parts of one grouped call (3 launches instead of 6): row r < M is gate, r >= M up
    const Exl3Group g{tab, ids, M, int(m.x3_stride), I};
    exl3_gemv_out(gate, g, Exl3Src{s.h.as<float>(), D, nullptr, int(kk)}, 2 * M, xh, yr, yr_floats, x3_tickets(), gu,
                  2 * I, nullptr, stream);
  }
  for (int p = 0; p < 3; ++p) {
    if (p < 2 && paired) continue;
    const Exl3Dev& shape = m.x3_off[0][size_t(p)];
    const Exl3Group g{tab + p * m.x3_stride, ids};
    const Exl3Src src =
        p < 2 ? Exl3Src{s.h.as<float>(), D, nullptr, int(kk)} : Exl3Src{gu, 2 * I, nullptr, 1, true, m.limit};
    if (p < 2) exl3_gemv_out(shape, g, src, M, xh, yr, yr_floats, x3_tickets(), gu + p * I, 2 * I, nullptr, stream);
    else exl3_gemv_out(shape, g, src, M, xh, yr, yr_floats, x3_tickets(), s.ysorted.as<float>(), D, nullptr, stream);
  }
}

// Sorted rows [a, a + rows) of a host-planned decode pass through the grouped one-row GEMVs: row r runs expert table
// entry s.row_expert[r] (a VRAM expert's or a slot's) on s.h row s.sorted_tok[r]; gate | up into s.mgu rows (one
// grouped call when their shapes match), down over their SwiGLU into s.ysorted rows.
void CudaEngine::Impl::moe_exl3_sorted_rows(DevMoe& m, int64_t a, int64_t rows) {
  const int64_t D = c.hidden_size, I = c.moe_intermediate_size;
  const int M = int(rows);
  const Exl3Dev* tab = m.x3_tab.as<Exl3Dev>();
  const int32_t* ids = s.row_expert.as<int32_t>() + a;
  float *xh = s.x3_xh.as<float>(), *yr = s.x3_yr.as<float>(), *gu = s.mgu.as<float>() + a * 2 * I;
  const size_t yr_floats = s.x3_yr.bytes() / 4;
  const Exl3Src in{s.h.as<float>(), D, s.sorted_tok.as<int32_t>() + a};
  const Exl3Dev &gate = m.x3_off[0][0], &up = m.x3_off[0][1];
  if (gate.K == up.K && gate.cb == up.cb && gate.in_pad == up.in_pad && gate.out_pad == up.out_pad) {
    exl3_gemv_out(gate, Exl3Group{tab, ids, M, int(m.x3_stride), I}, in, 2 * M, xh, yr, yr_floats, x3_tickets(), gu,
                  2 * I, nullptr, stream);
  } else {
    for (int p = 0; p < 2; ++p)
      exl3_gemv_out(m.x3_off[0][size_t(p)], Exl3Group{tab + p * m.x3_stride, ids}, in, M, xh, yr, yr_floats,
                    x3_tickets(), gu + p * I, 2 * I, nullptr, stream);
  }
  exl3_gemv_out(m.x3_off[0][2], Exl3Group{tab + 2 * m.x3_stride, ids}, Exl3Src{gu, 2 * I, nullptr, 1, true, m.limit}, M,
                xh, yr, yr_floats, x3_tickets(), s.ysorted.as<float>() + a * D, D, nullptr, stream);
}

int64_t CudaEngine::Impl::exl3_wave_rows(const DevMoe& m) const {
  int64_t in = 0, out = 0;
  for (const Exl3Dev& w : m.x3_off[0]) in = std::max<int64_t>(in, w.in_pad), out = std::max<int64_t>(out, w.out_pad);
  return std::min(
      {moe_wave_rows, int64_t(s.x3_xh.bytes() / (size_t(in) * 2)), int64_t(s.x3_yr.bytes() / (size_t(out) * 4))});
}

void CudaEngine::Impl::moe_exl3_wave(DevMoe& m, int64_t a, int64_t rows, const std::vector<ExpertPiece>& pieces) {
  const int64_t D = c.hidden_size, I = c.moe_intermediate_size;
  const Exl3Dev* tab = m.x3_tab.as<Exl3Dev>();
  const int32_t* ids = s.row_expert.as<int32_t>() + a;
  uint16_t* xh = s.x3_xh.as<uint16_t>();
  float *yr = s.x3_yr.as<float>(), *gu = s.mgu.as<float>();
  const size_t w16 = s.x3_w16.bytes() / 2;
  // Each piece goes through its own dequantization + cuBLAS (decoded once into an fp16 slab that the GEMM reads
  // back) or the grouped GEMM (one launch per projection over every grouped piece's tiles of exl3_gemm_tile_rows()
  // rows, the trellis decoded per tile; with every piece in it, the output rotation in its epilogue): pieces of at
  // most exl3_grouped_rows rows (CudaEngineOptions) go grouped, so the hot experts' long pieces decode their weights
  // once and the many short ones share launches. Every piece through either path was slower than this mix in the
  // 8K slice (docs/perf-cuda.md, sixth, twelfth, nineteenth and twentieth rounds).
  const int64_t tile_rows = exl3_gemm_tile_rows();
  static const int64_t env_max = [] {
    const char* v = std::getenv("MOESRV_EXL3_GROUPED_GEMM");
    const long long n = v && v[0] ? std::atoll(v) : -1;
    return n == 1 ? std::numeric_limits<int64_t>::max() : int64_t(std::max(-1LL, n));
  }();
  const int64_t grouped_max = opt.exl3_grouped_rows >= 0 ? opt.exl3_grouped_rows
                              : env_max >= 0             ? env_max
                                                         : CudaEngineOptions::kExl3GroupedRowsDefault;
  auto grouped = [&](const ExpertPiece& pc) { return pc.cnt <= grouped_max; };
  int64_t n_tiles = 0;
  for (const ExpertPiece& pc : pieces)
    if (grouped(pc)) n_tiles += (pc.cnt + tile_rows - 1) / tile_rows;
  const int64_t cap = int64_t(s.gemm_tiles.bytes() / sizeof(Exl3GemmTile));
  const bool fused = n_tiles > 0 && gemm_tiles_used + n_tiles <= cap;  // else every piece through cuBLAS
  Exl3GemmTile* d_tiles = s.gemm_tiles.as<Exl3GemmTile>() + gemm_tiles_used;
  std::vector<const ExpertPiece*> apart;  // the pieces through dequantization + cuBLAS
  if (fused) {
    Exl3GemmTile* t = h_gemm_tiles.as<Exl3GemmTile>() + gemm_tiles_used;
    for (const ExpertPiece& pc : pieces)
      if (grouped(pc))
        for (int64_t r = 0; r < pc.cnt; r += tile_rows)
          *t++ = {pc.e, int32_t(pc.row0 - a + r), int32_t(std::min(tile_rows, pc.cnt - r)), 0};
    MOESRV_CUDA_OK(cudaMemcpyAsync(d_tiles, h_gemm_tiles.as<Exl3GemmTile>() + gemm_tiles_used,
                                   size_t(n_tiles) * sizeof(Exl3GemmTile), cudaMemcpyHostToDevice, stream));
    gemm_tiles_used += n_tiles;
  }
  for (const ExpertPiece& pc : pieces)
    if (!fused || !grouped(pc)) apart.push_back(&pc);
  stats.dequant_gemm_pieces += int64_t(apart.size());
  stats.grouped_gemm_pieces += int64_t(pieces.size() - apart.size());
  for (int p = 0; p < 3; ++p) {
    const Exl3Dev& shape = m.x3_off[0][size_t(p)];
    const Exl3Group g{tab + p * m.x3_stride, ids};
    const Exl3Src src = p < 2 ? Exl3Src{s.h.as<float>(), D, s.sorted_tok.as<int32_t>() + a}
                              : Exl3Src{gu, 2 * I, nullptr, 1, true, m.limit};  // SwiGLU of gate | up
    exl3_rotate_in(shape, g, src, int(rows), xh, true, stream);
    // apart piece j on lane j % n (lane 0: the engine's stream, after the grouped GEMM), forked after the rotation,
    // joined before rotate_out
    const size_t n = std::min(apart.size(), expert_lanes.size() + 1);
    if (n > 1) MOESRV_CUDA_OK(cudaEventRecord(lanes_fork, stream));
    for (size_t l = 1; l < n; ++l) MOESRV_CUDA_OK(cudaStreamWaitEvent(expert_lanes[l - 1].stream, lanes_fork, 0));
    // the grouped GEMM (register-B forms) rotates its pieces' outputs into gu / ysorted itself, each apart piece's
    // rotation follows its GEMM on its lane (MOESRV_EXL3_ROTATE_APART=0: every row's rotation after the wave, for
    // comparisons)
    static const bool apart_rotations = switch_on("MOESRV_EXL3_ROTATE_APART");
    float* y_out = p < 2 ? gu + p * I : s.ysorted.as<float>();
    const int64_t y_ld = p < 2 ? 2 * I : D;
    const bool gemm_rotates = fused && exl3_gemm_form() != 0 && (apart.empty() || apart_rotations);
    if (fused)
      exl3_grouped_gemm(shape, tab + p * m.x3_stride, d_tiles, int(n_tiles), xh, yr, stream, int(tile_rows), -1,
                        gemm_rotates ? y_out : nullptr, y_ld);
    for (size_t j = 0; j < apart.size(); ++j) {
      const ExpertPiece& pc = *apart[j];
      const int64_t b0 = pc.row0 - a;
      const Exl3Dev w = rebase(m.x3_off[size_t(pc.e)][size_t(p)], m.vram[size_t(pc.e)].as<void>());
      ExpertLane* lane = j % n ? &expert_lanes[j % n - 1] : nullptr;
      cudaStream_t on = lane ? lane->stream : stream;
      exl3_gemm_rotated(w, xh + b0 * shape.in_pad, int(pc.cnt), yr + b0 * shape.out_pad,
                        lane ? lane->w16.as<uint16_t>() : s.x3_w16.as<uint16_t>(), lane ? lane->w16.bytes() / 2 : w16,
                        false, lane ? lane->blas : cublas, on);
      if (gemm_rotates)
        exl3_rotate_out(shape, Exl3Group{g.tab, ids + b0}, yr + b0 * shape.out_pad, int(pc.cnt), y_out + b0 * y_ld,
                        y_ld, nullptr, on);
    }
    for (size_t l = 1; l < n; ++l) {
      MOESRV_CUDA_OK(cudaEventRecord(expert_lanes[l - 1].join, expert_lanes[l - 1].stream));
      MOESRV_CUDA_OK(cudaStreamWaitEvent(stream, expert_lanes[l - 1].join, 0));
    }
    if (!gemm_rotates) exl3_rotate_out(shape, g, yr, int(rows), y_out, y_ld, nullptr, stream);
  }
}

void CudaEngine::Impl::expert_exl3(DevMoe& m, int e, const void* block, const float* h, int64_t row0, int64_t buf0,
                                   int64_t cnt) {
  const int64_t D = c.hidden_size, I = c.moe_intermediate_size;
  const auto& off = m.x3_off[size_t(e)];
  float* gu = s.mgu.as<float>() + buf0 * 2 * I;
  float* act = s.mact.as<float>() + buf0 * I;
  const Exl3Src in{h, D, s.sorted_tok.as<int32_t>() + row0};
  exl3_forward(rebase(off[0], block), in, cnt, gu, 2 * I, nullptr);
  exl3_forward(rebase(off[1], block), in, cnt, gu + I, 2 * I, nullptr);
  silu_mul_clamped(gu, int(cnt), int(I), m.limit, act, stream);
  exl3_forward(rebase(off[2], block), Exl3Src{act, I}, cnt, s.ysorted.as<float>() + buf0 * D, D, nullptr);
}

}  // namespace moesrv
#endif  // MOESRV_HAS_CUDA
