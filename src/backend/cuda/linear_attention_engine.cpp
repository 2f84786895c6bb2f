// The CUDA engine's linear-attention blocks, KDA (GLM-5.3-Flash) and Gated DeltaNet (Qwen3-Next), and the k-pool
// DSA indexer, over the kernels of glm5_next_kernels.h and the engine's linears (bf16 or EXL3). Same steps as
// src/backend/cpu/kda.cpp, gated_delta.cpp and kpool_indexer.cpp, fp32 throughout.
#if defined(MOESRV_HAS_CUDA) && MOESRV_HAS_CUDA
#include <cmath>

#include "backend/cuda/cuda_blocks.h"

namespace moesrv {

using namespace moesrv::cuda;

void CudaEngine::Impl::kda(int64_t l, int64_t S, const BatchRows* batch) {
  const DevKda& w = *layers[size_t(l)].kda;
  const LayerState& st = cur_state[size_t(l)];
  const LinearAttnDims& la = c.linear;
  const int H = int(la.v_heads), d = int(la.dk), Hd = H * d, C = 3 * Hd, K = int(la.conv_kernel);
  const float* h = s.h.as<float>();
  float *qkv = s.lqkv.as<float>(), *g = s.lg.as<float>(), *beta = s.lbeta.as<float>(), *o = s.lo.as<float>();
  float *low = s.lfa.as<float>(), *gate = s.lgate.as<float>();
  phase(CudaPhase::LinearProj);

  auto decode_args = [&](const LayerState& state, int64_t row, const float* gate_row) {
    KdaDecodeArgs a;
    a.heads = H, a.dk = d, a.dv = d, a.conv_k = K;
    a.qkv = s.lraw.as<float>() + row * C, a.conv_w = w.conv.as<float>(), a.conv_state = state.conv;
    a.g = g + row * Hd, a.dt_bias = w.dt_bias.as<float>(), a.a_log = w.a_log.as<float>();
    a.lower_bound_set = la.lower_bound_set, a.lower_bound = float(la.lower_bound);
    a.beta = beta + row * H, a.state = state.recurrent, a.gate = gate_row, a.norm_w = w.o_norm.w.as<float>();
    a.l2_eps = 1e-6f, a.q_scale = 1.0f / std::sqrt(float(d)), a.norm_eps = float(c.rms_eps);
    a.out = o + row * Hd;
    return a;
  };
  if (batch && !kda_decode_supported(d, d, K)) {  // S sequences' decode steps, each alone
    for (int64_t b = 0; b < S; ++b) {
      const BatchRow row(*this, *batch, b);
      kda(l, 1);
    }
    return;
  }
  // The small projections of S rows (they read only h; their outputs beta, g, gate and the low rank scratch are
  // touched by nothing else before the gates): beside q|k|v where proj_side_rows_ok, else in line first.
  const bool rows_side = proj_side_rows_ok(S);
  auto small_projections = [&] {
    linear(w.b, h, S, beta);
    linear(w.f_a, h, S, low);
    linear(w.f_b, low, S, g);
    linear(w.g_a, h, S, low);
    linear(w.g_b, low, S, gate);
  };
  if (batch) {  // S sequences' decode steps: the projections over all rows, the recurrence per row
    on_side_if(rows_side, small_projections);
    linear(w.qkv, h, S, s.lraw.as<float>());
    join_proj_side();
    for (int64_t b = 0; b < S; ++b)
      kda_decode(decode_args(batch->states[size_t(b)][size_t(l)], b, gate + b * Hd), stream);
    linear(w.o, o, S, s.y.as<float>());
    return;
  }
  if (S == 1 && kda_decode_supported(d, d, K)) {  // decode: everything between the linears in one launch
    const bool fg = w.fg_a && w.fg_b && rows >= 2;
    if (fg) gate = g + Hd;
    on_proj_side(S, [&] {  // the small projections beside q|k|v
      linear(w.b, h, S, beta);
      if (fg) {  // f_a | g_a, then f_b | g_b: low rows 0, 1 -> g = lg row 0, gate = row 1
        exl3_group(w.fg_a, w.f_a.x3[0].w, Exl3Src{h, c.hidden_size, nullptr, 2}, low, d);
        exl3_group(w.fg_b, w.f_b.x3[0].w, Exl3Src{low, d}, g, Hd);
      } else {
        linear(w.f_a, h, S, low);
        linear(w.f_b, low, S, g);
        linear(w.g_a, h, S, low);
        linear(w.g_b, low, S, gate);
      }
    });
    linear(w.qkv, h, S, s.lraw.as<float>());
    join_proj_side();
    kda_decode(decode_args(st, 0, gate), stream);
    linear(w.o, o, S, s.y.as<float>());
    return;
  }
  on_side_if(rows_side, small_projections);  // (joined before the gates)
  linear(w.qkv, h, S, s.lraw.as<float>());   // [S, q | k | v] before the conv
  if (st.conv_steps) conv_state_steps(s.lraw.as<float>(), C, int(S), C, K, st.conv, st.conv_steps, stream);
  causal_conv1d_silu(s.lraw.as<float>(), C, int(S), C, w.conv.as<float>(), K, st.conv, qkv, stream);
  // q and k normalised in place inside the conv output rows; the delta rule reads all three operands from there.
  l2norm_rows(qkv, int(S), H, C, d, 1e-6f, 1.0f / std::sqrt(float(d)), stream);
  l2norm_rows(qkv + Hd, int(S), H, C, d, 1e-6f, 1.0f, stream);

  join_proj_side();
  kda_gates(g, w.dt_bias.as<float>(), w.a_log.as<float>(), int(S), H, d, la.lower_bound_set, float(la.lower_bound),
            beta, stream);
  DeltaRuleArgs dr;
  dr.T = int(S), dr.heads = H, dr.dk = d, dr.dv = d, dr.per_channel_decay = true;
  dr.q = qkv, dr.k = qkv + Hd, dr.qk_stride = C, dr.v = qkv + 2 * Hd, dr.v_stride = C;
  dr.g = g, dr.beta = beta, dr.state = st.recurrent, dr.out = o, dr.steps = st.rec_steps;
  dr.chunk_scratch = s.lraw.as<float>(), dr.chunk_scratch_floats = int64_t(s.lraw.bytes() / 4);  // (conv consumed it)
  phase(CudaPhase::LinearCore);
  delta_rule(dr, stream);
  phase(CudaPhase::LinearProj);

  kda_output_norm(o, gate, w.o_norm.w.as<float>(), int(S) * H, d, float(c.rms_eps), stream);
  linear(w.o, o, S, s.y.as<float>());
}

// Gated DeltaNet (cpu::gated_delta_forward): qkvz regrouped into the conv channels q | k | v (key heads) and z, the
// conv + SiLU, q/k l2-normalised per key head in the conv output, the delta rule with q/k shared by r = Hv / Hk
// value heads and a per-head decay, the SiLU(z)-gated RMSNorm, out_proj.
void CudaEngine::Impl::gated_delta(int64_t l, int64_t S) {
  const DevGatedDelta& w = *layers[size_t(l)].gated_delta;
  const LayerState& st = cur_state[size_t(l)];
  const LinearAttnDims& la = c.linear;
  const int Hk = int(la.k_heads), Hv = int(la.v_heads), dk = int(la.dk), dv = int(la.dv), r = Hv / Hk;
  const int QK = Hk * dk, C = int(la.conv_channels()), K = int(la.conv_kernel);
  const float* h = s.h.as<float>();
  float *raw = s.lraw.as<float>(), *mixed = s.lqkv.as<float>(), *z = s.lgate.as<float>(), *ba = s.lfa.as<float>();
  float *g = s.lg.as<float>(), *beta = s.lbeta.as<float>(), *o = s.lo.as<float>();

  linear(w.qkvz, h, S, raw);  // [S, Hk, q | k | v (r heads) | z (r heads)]
  gdn_split_qkvz(raw, int(S), Hk, r, dk, dv, mixed, z, stream);
  linear(w.ba, h, S, ba);
  gdn_gates(ba, w.dt_bias.as<float>(), w.a_log.as<float>(), int(S), Hk, r, g, beta, stream);
  if (st.conv_steps) conv_state_steps(mixed, C, int(S), C, K, st.conv, st.conv_steps, stream);
  causal_conv1d_silu(mixed, C, int(S), C, w.conv.as<float>(), K, st.conv, raw, stream);  // qkvz is consumed
  l2norm_rows(raw, int(S), Hk, C, dk, 1e-6f, 1.0f / std::sqrt(float(dk)), stream);
  l2norm_rows(raw + QK, int(S), Hk, C, dk, 1e-6f, 1.0f, stream);
  DeltaRuleArgs dr;
  dr.T = int(S), dr.heads = Hv, dr.dk = dk, dr.dv = dv, dr.qk_group = r, dr.per_channel_decay = false;
  dr.q = raw, dr.k = raw + QK, dr.qk_stride = C, dr.v = raw + 2 * QK, dr.v_stride = C;
  dr.g = g, dr.beta = beta, dr.state = st.recurrent, dr.out = o, dr.steps = st.rec_steps;
  dr.chunk_scratch = mixed, dr.chunk_scratch_floats = int64_t(s.lqkv.bytes() / 4);  // (conv consumed it)
  delta_rule(dr, stream);
  gdn_output_norm(o, z, w.norm.w.as<float>(), int(S) * Hv, dv, float(c.rms_eps), stream);
  linear(w.out, o, S, s.y.as<float>());
}

void CudaEngine::Impl::kpool_indexer_keys(const DevIndexer& ix, int64_t S) {
  const int d = int(c.index_head_dim);
  float *ik = s.ik.as<float>(), *ig = s.ig.as<float>(), *ihw = s.ihw.as<float>();
  linear(ix.wk, s.h.as<float>(), S, ik);
  linear(ix.pool_gate, s.h.as<float>(), S, ig);
  linear(ix.weights_proj, s.h.as<float>(), S, ihw);
  layer_norm(ik, ix.k_norm.w.as<float>(), ix.k_norm.b.as<float>(), int(S), d, 1e-6f, ik, stream);
}

void CudaEngine::Impl::kpool_indexer(const DevIndexer& ix, int64_t l, int64_t S, bool beside) {
  const LayerState& st = cur_state[size_t(l)];
  const int nh = int(c.index_n_heads), d = int(c.index_head_dim), kp = int(c.index_kpool);
  float *iq = s.iq.as<float>(), *ik = s.ik.as<float>(), *ig = s.ig.as<float>(), *ihw = s.ihw.as<float>();
  linear(ix.wq_b, s.q_lat.as<float>(), S, iq);
  // The pools and the selection read kpool_indexer_keys' outputs: `beside`, in decode, they run on proj_side after
  // those (the caller joins before the attention); otherwise here, after any pending side work.
  beside = beside && proj_side_ok(S);
  if (!beside) join_proj_side();
  auto pools = [&] {
    const float head_scale = 1.0f / std::sqrt(float(nh));  // applied to the head weights inside kpool_select
    if (st.open_steps) kpool_open_steps(ik, ig, int(S), d, kp, d_pos0.as<int32_t>(), st.open, st.open_steps, stream);
    kpool_append(ik, ig, ix.pool_ape.as<float>(), int(S), d, kp, d_pos0.as<int32_t>(), st.pool_k, st.open,
                 st.open + int64_t(kp) * d, stream);
    const int W = int(sel_width());
    for (int64_t s0 = 0; s0 < S; s0 += dsa_rows) {
      const int n = int(std::min(dsa_rows, S - s0));
      const int32_t* pos = slice_pos0(s0);
      kpool_select(iq + s0 * nh * d, ihw + s0 * nh, st.pool_k, n, nh, d, kp, int(c.index_topk / kp),
                   c.index_select_tail, pos, int(max_pools()), s.dsa_scores.as<float>(), s.dsa_scores.bytes() / 4,
                   s.sel.as<int32_t>() + s0 * W, W, stream, head_scale);
    }
  };
  if (beside) on_proj_side(S, pools);
  else pools();
}

}  // namespace moesrv
#endif  // MOESRV_HAS_CUDA
