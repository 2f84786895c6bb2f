// The CUDA engine's GLM-5.3-Flash blocks: KDA linear attention and the k-pool DSA indexer, over the kernels of
// glm5_next_kernels.h and the engine's linears (bf16 or EXL3). Same steps as src/backend/cpu/kda.cpp and
// kpool_indexer.cpp, fp32 throughout.
#if defined(MOESRV_HAS_CUDA) && MOESRV_HAS_CUDA
#include <cmath>

#include "backend/cuda/engine_internal.h"

namespace moesrv {

using namespace moesrv::cuda;

void CudaEngine::Impl::kda(int64_t l, int64_t S) {
  const DevKda& w = *layers[size_t(l)].kda;
  const LayerState& st = cur_state[size_t(l)];
  const LinearAttnDims& la = c.linear;
  const int H = int(la.v_heads), d = int(la.dk), Hd = H * d, C = 3 * Hd, K = int(la.conv_kernel);
  const float* h = s.h.as<float>();
  float *qkv = s.lqkv.as<float>(), *q = s.lq.as<float>(), *k = s.lk.as<float>(), *v = s.lv.as<float>();
  float *g = s.lg.as<float>(), *beta = s.lbeta.as<float>(), *o = s.lo.as<float>(), *low = s.lfa.as<float>();
  float* gate = s.lgate.as<float>();

  linear(w.qkv, h, S, s.lraw.as<float>());  // [S, q | k | v] before the conv
  causal_conv1d_silu(s.lraw.as<float>(), C, int(S), C, w.conv.as<float>(), K, st.conv, qkv, stream);
  for (int part = 0; part < 3; ++part)  // split into contiguous [S, H, d] operands
    MOESRV_CUDA_OK(cudaMemcpy2DAsync(part == 0   ? q
                                     : part == 1 ? k
                                                 : v,
                                     size_t(Hd) * 4, qkv + part * Hd, size_t(C) * 4, size_t(Hd) * 4, size_t(S),
                                     cudaMemcpyDeviceToDevice, stream));
  l2norm_rows(q, int(S), H, Hd, d, 1e-6f, 1.0f / std::sqrt(float(d)), stream);
  l2norm_rows(k, int(S), H, Hd, d, 1e-6f, 1.0f, stream);

  linear(w.f_a, h, S, low);
  linear(w.f_b, low, S, g);
  linear(w.b, h, S, beta);
  kda_gates(g, w.dt_bias.as<float>(), w.a_log.as<float>(), int(S), H, d, la.lower_bound_set, float(la.lower_bound),
            beta, stream);
  delta_rule(int(S), H, d, d, /*per_channel_decay=*/true, q, k, v, g, beta, st.recurrent, o, stream);

  linear(w.g_a, h, S, low);
  linear(w.g_b, low, S, gate);
  kda_output_norm(o, gate, w.o_norm.w.as<float>(), int(S) * H, d, float(c.rms_eps), stream);
  linear(w.o, o, S, s.y.as<float>());
}

void CudaEngine::Impl::kpool_indexer(const DevIndexer& ix, int64_t l, int64_t S) {
  const LayerState& st = cur_state[size_t(l)];
  const int nh = int(c.index_n_heads), d = int(c.index_head_dim), kp = int(c.index_kpool);
  float *iq = s.iq.as<float>(), *ik = s.ik.as<float>(), *ig = s.ig.as<float>(), *ihw = s.ihw.as<float>();
  linear(ix.wq_b, s.q_lat.as<float>(), S, iq);
  linear(ix.wk, s.h.as<float>(), S, ik);
  linear(ix.pool_gate, s.h.as<float>(), S, ig);
  linear(ix.weights_proj, s.h.as<float>(), S, ihw);
  layer_norm(ik, ix.k_norm.w.as<float>(), ix.k_norm.b.as<float>(), int(S), d, 1e-6f, ik, stream);
  const float head_scale = 1.0f / std::sqrt(float(nh));
  MOESRV_CUBLAS_OK(cublasSscal(cublas, int(S) * nh, &head_scale, ihw, 1));
  kpool_append(ik, ig, ix.pool_ape.as<float>(), int(S), d, kp, d_pos0.as<int32_t>(), st.pool_k, st.open,
               st.open + int64_t(kp) * d, stream);
  const int W = int(sel_width());
  for (int64_t s0 = 0; s0 < S; s0 += dsa_rows) {
    const int n = int(std::min(dsa_rows, S - s0));
    const int32_t* pos = d_pos0.as<int32_t>();
    if (s0 > 0) {
      offset_position(d_pos0.as<int32_t>(), int(s0), d_slice_pos.as<int32_t>(), stream);
      pos = d_slice_pos.as<int32_t>();
    }
    kpool_select(iq + s0 * nh * d, ihw + s0 * nh, st.pool_k, n, nh, d, kp, int(c.index_topk / kp), c.index_select_tail,
                 pos, int(max_pools()), s.dsa_scores.as<float>(), s.sel.as<int32_t>() + s0 * W, W, stream);
  }
}

}  // namespace moesrv
#endif  // MOESRV_HAS_CUDA
