// The CUDA engine's softmax-attention blocks: MLA (absorbed latent attention, the plain DSA indexer or the k-pool
// one for the selected keys) and GQA, over the kernels of kernels.h / glm5_next_kernels.h and the engine's linears.
// Same steps as the CPU blocks (src/backend/cpu/attention_mla.cpp, attention_gqa.cpp).
#if defined(MOESRV_HAS_CUDA) && MOESRV_HAS_CUDA
#include <algorithm>
#include <cmath>
#include <cstdlib>

#include "backend/cuda/cuda_blocks.h"

namespace moesrv {

using namespace moesrv::cuda;

void CudaEngine::Impl::dsa_indexer(const DevIndexer& ix, int64_t l, int64_t S) {
  const int nh = int(c.index_n_heads), d = int(c.index_head_dim);
  const bool inter = c.index_rope_layout == RopeLayout::Interleaved;
  float *iq = s.iq.as<float>(), *ik = s.ik.as<float>(), *ihw = s.ihw.as<float>();
  linear(ix.wq_b, s.q_lat.as<float>(), S, iq);
  linear(ix.wk, s.h.as<float>(), S, ik);
  linear(ix.weights_proj, s.h.as<float>(), S, ihw);
  layer_norm(ik, ix.k_norm.w.as<float>(), ix.k_norm.b.as<float>(), int(S), d, 1e-6f, ik, stream);
  rope(ik, int(S), 1, d, d, 0, int(c.rope.dim), inter, cos_sin.as<float>(), d_pos0.as<int32_t>(), stream);
  cache_write(ik, d, int(S), d, layer_cache(l), CacheField::IndexK, false, d_pos0.as<int32_t>(), stream);
  rope(iq, int(S), nh, int64_t(nh) * d, d, 0, int(c.rope.dim), inter, cos_sin.as<float>(), d_pos0.as<int32_t>(),
       stream);
  for (int64_t s0 = 0; s0 < S; s0 += dsa_rows)
    dsa_topk(iq, ihw, layer_cache(l), int(s0), int(std::min(dsa_rows, S - s0)), nh, d, int(c.index_topk),
             d_pos0.as<int32_t>(), max_ctx, s.dsa_scores.as<float>(), s.sel.as<int32_t>(), stream);
}

void CudaEngine::Impl::attention_mla(int64_t l, int64_t S, IndexerKind indexer, const BatchRows* batch) {
  const DevAttention& a = layers[size_t(l)].attn;
  const int H = int(c.num_heads), dn = int(c.qk_nope_dim), dr = int(c.qk_rope_dim), r = int(c.kv_lora_rank);
  const int qk = dn + dr, dv = int(c.v_head_dim), lat = r + dr;
  const bool inter = c.rope.layout == RopeLayout::Interleaved;
  float *q = s.q.as<float>(), *kv = s.kv.as<float>(), *h = s.h.as<float>();
  phase(CudaPhase::AttnProj);
  if (indexer == IndexerKind::Own && !a.indexer) fail("layer {}: the DSA indexer's weights are missing", l);
  const bool kpool = indexer == IndexerKind::Own && c.index_kpool > 1;
  auto kv_latent = [&] {  // kv = rms_norm(kv_a h) over the latent part, the rope part as projected
    linear(a.kv_a, h, S, kv);
    rms_norm(kv, lat, a.kv_a_norm.w.as<float>(), int(S), r, 1e-6f, kv, lat, stream);
  };
  auto q_latent = [&] {  // q_lat = rms_norm(q_a h)
    linear(a.q_a, h, S, s.q_lat.as<float>());
    rms_norm(s.q_lat.as<float>(), c.q_lora_rank, a.q_a_norm.w.as<float>(), int(S), int(c.q_lora_rank), 1e-6f,
             s.q_lat.as<float>(), c.q_lora_rank, stream);
  };
  // Attention of n query rows (absorbed, in s.qcat) at the positions from `pos`, with the selection at row s0 of
  // s.sel, into s.olat.
  auto attend = [&](int n, int64_t s0, const int32_t* pos) {
    AttentionArgs args;
    args.q = s.qcat.as<float>();
    args.S = n;
    args.H = H;
    args.q_dim = lat;
    args.v_dim = r;
    args.mla = true;
    args.q8 = opt.kv_q8;
    args.lc = layer_cache(l);
    if (indexer != IndexerKind::None) {
      args.selection = s.sel.as<int32_t>() + s0 * sel_width();
      args.sel_k = int(sel_width());
    }
    args.pos0 = pos;
    args.scale = float(c.softmax_scale);
    args.out = s.olat.as<float>();
    if (opt.mla_split_decode && mla_split_supported(args)) mla_split_attention(args, s.mla_part.as<float>(), stream);
    else if (opt.mla_tc_prefill && n > kMlaSplitMaxTokens && mla_prefill_supported(args))
      mla_prefill_attention(args, stream);
    else attention(args, stream);
  };
  // Forwards of 2-4 rows (proj_side_rows_ok): the latent key rows and the k-pool's key projections beside the
  // query's projections, as one-token decode does.
  const bool rows_side = proj_side_rows_ok(S);
  if (batch) {  // S sequences' decode steps: the projections over all rows, then each row at its position
    on_side_if(rows_side, [&] {
      kv_latent();
      if (kpool) kpool_indexer_keys(*a.indexer, S);
    });
    if (a.q_a.out) {
      q_latent();
      linear(a.q_b, s.q_lat.as<float>(), S, q);
    } else {
      linear(a.q, h, S, q);
    }
    join_proj_side();
    for (int64_t b = 0; b < S; ++b) {
      const BatchRow row(*this, *batch, b);
      float *kv_b = kv + b * lat, *q_b = q + b * H * qk;
      rope(kv_b, 1, 1, lat, lat, r, dr, inter, cos_sin.as<float>(), d_pos0.as<int32_t>(), stream);
      cache_write(kv_b, lat, 1, lat, layer_cache(l), CacheField::Kv, opt.kv_q8, d_pos0.as<int32_t>(), stream);
      if (indexer == IndexerKind::Own) {
        if (kpool) kpool_indexer(*a.indexer, l, 1, false);
        else dsa_indexer(*a.indexer, l, 1);
      }
      rope(q_b, 1, H, int64_t(H) * qk, qk, dn, dr, inter, cos_sin.as<float>(), d_pos0.as<int32_t>(), stream);
      mla_query(q_b, a.w_uk.as<uint16_t>(), 1, H, dn, dr, r, s.qcat.as<float>(), stream);
      attend(1, 0, d_pos0.as<int32_t>());  // (s.sel: the row's)
      mla_output(s.olat.as<float>(), a.w_uv.as<uint16_t>(), 1, H, dv, r, s.attn_out.as<float>() + b * H * dv, stream);
    }
    linear(a.o, s.attn_out.as<float>(), S, s.y.as<float>());
    return;
  }
  on_side_if(proj_side_ok(S) || rows_side, [&] {  // the latent key rows (into the cache), k-pool keys beside q
    kv_latent();
    rope(kv, int(S), 1, lat, lat, r, dr, inter, cos_sin.as<float>(), d_pos0.as<int32_t>(), stream);
    cache_write(kv, lat, int(S), lat, layer_cache(l), CacheField::Kv, opt.kv_q8, d_pos0.as<int32_t>(), stream);
    if (kpool) kpool_indexer_keys(*a.indexer, S);
  });
  // kpool_beside_query: the indexer's query reads q_lat, so it can go before q_b and, in decode, the pools' scores
  // and selection run on proj_side beside q_b and the query absorption.
  static const SwitchOverride kpool_side_env("MOESRV_KPOOL_SIDE");
  const bool kpool_early = kpool && kpool_side_env(opt.kpool_beside_query) && a.q_a.out;
  bool indexed = indexer != IndexerKind::Own;  // the selection in s.sel is the current one once this is set
  if (a.q_a.out) {
    q_latent();
    if (kpool_early) {
      phase(CudaPhase::Indexer);
      kpool_indexer(*a.indexer, l, S, true);
      phase(CudaPhase::AttnProj);
      indexed = true;
    }
    linear(a.q_b, s.q_lat.as<float>(), S, q);
  } else {
    linear(a.q, h, S, q);
  }
  if (!indexed) {
    phase(CudaPhase::Indexer);
    if (kpool) kpool_indexer(*a.indexer, l, S, false);
    else join_proj_side(), dsa_indexer(*a.indexer, l, S);
  }
  if (!kpool_early) join_proj_side();
  phase(CudaPhase::AttnCore);
  rope(q, int(S), H, int64_t(H) * qk, qk, dn, dr, inter, cos_sin.as<float>(), d_pos0.as<int32_t>(), stream);
  for (int64_t s0 = 0; s0 < S; s0 += attn_rows) {
    const int n = int(std::min(attn_rows, S - s0));
    const int32_t* pos = slice_pos0(s0);
    // Absorption: per-head kernels for a few tokens (graph-captured decode), per-head fp32 GEMMs for more (prefill).
    const bool gemm = n > kMlaSplitMaxTokens;
    const float one = 1.0f, zero = 0.0f;
    phase(CudaPhase::AttnAbsorb);
    // The absorption GEMMs run per head over the n tokens (MOESRV_MLA_ABSORB picks the form, for comparisons):
    //   2 (default where the scratch fits): one bf16 GEMM over a doubled K, [W | W] . [x_hi ; x_lo] (split_bf16x2: x
    //     to ~16 bits, the weights are bf16 already): 8K slice attn_absorb 0.030 vs 0.053 s for 1 (H200, session 34);
    //   1: two TF32 GEMMs, W (exact in TF32) times x's TF32 part, then times its remainder (split_tf32);
    //   0: fp32 in cuBLAS's SIMT kernels.
    // w: the bf16 weights, `reps` rows of `row` values per head-batch layout (the copies for 2 go to w_absorb);
    // x: n x H rows of k values, x_stride apart (x_ld between tokens); xs: the split's scratch (n H k floats).
    static const int absorb_form = [] {
      const char* v = std::getenv("MOESRV_MLA_ABSORB");
      const int f = v && v[0] ? std::atoi(v) : 2;
      return f >= 0 && f <= 2 ? f : 2;
    }();
    auto absorb = [&](cublasOperation_t op_w, int m, int k, const uint16_t* w, int64_t reps, int64_t row, int ldw,
                      int64_t w_stride, float* x, int ldx, int64_t x_stride, float* xs, size_t xs_bytes, float* out,
                      int ldo, int64_t o_stride) {
      const int form = xs_bytes >= size_t(n) * H * k * 4 ? absorb_form : 0;
      if (form == 2) {
        uint16_t* w2 = s.w_absorb.as<uint16_t>();  // each row of `row` values twice: [W | W] along K
        for (int half = 0; half < 2; ++half)
          MOESRV_CUDA_OK(cudaMemcpy2DAsync(w2 + half * row, size_t(2 * row) * 2, w, size_t(row) * 2, size_t(row) * 2,
                                           size_t(reps), cudaMemcpyDeviceToDevice, stream));
        uint16_t* x2 = reinterpret_cast<uint16_t*>(xs);
        split_bf16x2(x, int64_t(n) * H, k, x_stride, x2, stream);
        MOESRV_CUBLAS_OK(cublasGemmStridedBatchedEx(cublas, op_w, CUBLAS_OP_N, m, n, 2 * k, &one, w2, CUDA_R_16BF,
                                                    op_w == CUBLAS_OP_N ? ldw : 2 * ldw, 2 * w_stride, x2, CUDA_R_16BF,
                                                    H * 2 * k, 2 * k, &zero, out, CUDA_R_32F, ldo, o_stride, H,
                                                    CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
        return;
      }
      float* wf = s.w_absorb.as<float>();
      from_bf16(w, int64_t(H) * w_stride, wf, stream);
      if (form == 0) {
        MOESRV_CUBLAS_OK(cublasSgemmStridedBatched(cublas, op_w, CUBLAS_OP_N, m, n, k, &one, wf, ldw, w_stride, x, ldx,
                                                   x_stride, &zero, out, ldo, o_stride, H));
        return;
      }
      split_tf32(x, int64_t(n) * H, k, x_stride, x, x_stride, xs, k, stream);
      for (int part = 0; part < 2; ++part)
        MOESRV_CUBLAS_OK(cublasGemmStridedBatchedEx(cublas, op_w, CUBLAS_OP_N, m, n, k, &one, wf, CUDA_R_32F, ldw,
                                                    w_stride, part ? xs : x, CUDA_R_32F, part ? H * k : ldx,
                                                    part ? k : x_stride, part ? &one : &zero, out, CUDA_R_32F, ldo,
                                                    o_stride, H, CUBLAS_COMPUTE_32F_FAST_TF32, CUBLAS_GEMM_DEFAULT));
    };
    if (gemm) {  // qcat[t][h][:r] = q[t][h][:dn] . W_uk[h] ([dn][r]); the rope part copied
      // the split's scratch: olat (free until attend writes it); the rope part is copied before the split
      if (dr > 0)
        MOESRV_CUDA_OK(cudaMemcpy2DAsync(s.qcat.as<float>() + r, size_t(lat) * 4, q + s0 * H * qk + dn, size_t(qk) * 4,
                                         size_t(dr) * 4, size_t(n) * H, cudaMemcpyDeviceToDevice, stream));
      absorb(CUBLAS_OP_N, r, dn, a.w_uk.as<uint16_t>(), H, int64_t(dn) * r, r, int64_t(dn) * r, q + s0 * H * qk, H * qk,
             qk, s.olat.as<float>(), s.olat.bytes(), s.qcat.as<float>(), H * lat, lat);
    } else {
      mla_query(q + s0 * H * qk, a.w_uk.as<uint16_t>(), n, H, dn, dr, r, s.qcat.as<float>(), stream);
    }
    phase(CudaPhase::AttnCore);
    join_proj_side();  // kpool_early: the latent row in the cache and the selection, made beside the query
    attend(n, s0, pos);
    phase(CudaPhase::AttnAbsorb);
    if (gemm) {  // out[t][h] = W_uv[h] ([dv][r]) . olat[t][h]
      // the split's scratch: qcat (attend has read it)
      absorb(CUBLAS_OP_T, dv, r, a.w_uv.as<uint16_t>(), int64_t(H) * dv, r, r, int64_t(dv) * r, s.olat.as<float>(),
             H * r, r, s.qcat.as<float>(), s.qcat.bytes(), s.attn_out.as<float>() + s0 * H * dv, H * dv, dv);
    } else {
      mla_output(s.olat.as<float>(), a.w_uv.as<uint16_t>(), n, H, dv, r, s.attn_out.as<float>() + s0 * H * dv, stream);
    }
  }
  phase(CudaPhase::AttnProj);
  linear(a.o, s.attn_out.as<float>(), S, s.y.as<float>());
}

void CudaEngine::Impl::attention_gqa(int64_t l, int64_t S) {
  const DevAttention& a = layers[size_t(l)].attn;
  const int H = int(c.num_heads), KV = int(c.num_kv_heads), hd = int(c.head_dim);
  float *q = s.q.as<float>(), *k = s.k.as<float>(), *v = s.v.as<float>(), *h = s.h.as<float>();
  float* qg = s.qgate.as<float>();  // attn_output_gate: q_proj rows per head [query | gate]
  linear(a.gq, h, S, c.attn_output_gate ? qg : q);
  linear(a.gk, h, S, k);
  linear(a.gv, h, S, v);
  if (c.qk_norm) {  // the query half of qg's heads is normalised into q
    const float* qin = c.attn_output_gate ? qg : q;
    rms_norm(qin, c.attn_output_gate ? 2 * hd : hd, a.q_norm.w.as<float>(), int(S) * H, hd, float(c.rms_eps), q, hd,
             stream);
    rms_norm(k, hd, a.k_norm.w.as<float>(), int(S) * KV, hd, float(c.rms_eps), k, hd, stream);
  } else if (c.attn_output_gate) {
    MOESRV_CUDA_OK(cudaMemcpy2DAsync(q, size_t(hd) * 4, qg, size_t(2 * hd) * 4, size_t(hd) * 4, size_t(S * H),
                                     cudaMemcpyDeviceToDevice, stream));
  }
  const bool inter = c.rope.layout == RopeLayout::Interleaved;
  rope(q, int(S), H, int64_t(H) * hd, hd, 0, int(c.rope.dim), inter, cos_sin.as<float>(), d_pos0.as<int32_t>(), stream);
  rope(k, int(S), KV, int64_t(KV) * hd, hd, 0, int(c.rope.dim), inter, cos_sin.as<float>(), d_pos0.as<int32_t>(),
       stream);
  cache_write(k, int64_t(KV) * hd, int(S), KV * hd, layer_cache(l), CacheField::Kv, opt.kv_q8, d_pos0.as<int32_t>(),
              stream);
  cache_write(v, int64_t(KV) * hd, int(S), KV * hd, layer_cache(l), CacheField::V, opt.kv_q8, d_pos0.as<int32_t>(),
              stream);
  AttentionArgs args;
  args.q = q;
  args.S = int(S);
  args.H = H;
  args.q_dim = hd;
  args.v_dim = hd;
  args.kv_heads = KV;
  args.q8 = opt.kv_q8;
  args.lc = layer_cache(l);
  args.pos0 = d_pos0.as<int32_t>();
  args.scale = float(c.softmax_scale);
  args.out = s.attn_out.as<float>();
  attention(args, stream);
  if (c.attn_output_gate) sigmoid_gate_rows(s.attn_out.as<float>(), qg + hd, 2 * hd, int(S) * H, hd, stream);
  linear(a.o, s.attn_out.as<float>(), S, s.y.as<float>());
}

}  // namespace moesrv
#endif  // MOESRV_HAS_CUDA
