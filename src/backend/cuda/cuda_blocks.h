// The CUDA engine's executor of the decoder loop's blocks (model/decoder.h), shared by its forwards: a pass of S
// tokens of one sequence, the MTP block's layer, or a decode step of several sequences (one token each: a
// BatchRows binding), whose mixers (attention, linear attention) run row by row with each row's caches, position and
// state while everything else runs over all rows at once. CUDA builds only.
#pragma once
#include <vector>

#include "backend/cuda/engine_internal.h"
#include "model/decoder.h"

namespace moesrv::cuda {

// A decode step of several sequences: row b is sequence b's token at its own position d_pos[b], with its caches
// d_tables[b * layers ..] and fixed-size state states[b] (CudaEngine::Impl::forward_rows).
struct BatchRows {
  std::vector<std::vector<CudaEngine::Impl::LayerState>> states;  // [row][layer]
  int32_t* d_pos = nullptr;                                       // [rows], device
  DeviceLayerCache* d_tables = nullptr;                           // [rows][layers], device
};

// Views standing in for whole engine buffers while this object lives (each whole buffer restored on destruction).
class BufferViews {
 public:
  BufferViews() = default;
  BufferViews(const BufferViews&) = delete;
  BufferViews& operator=(const BufferViews&) = delete;
  ~BufferViews() {
    for (auto it = kept_.rbegin(); it != kept_.rend(); ++it) *it->first = std::move(it->second);
  }
  // `live`, rows of `width` 4-byte elements, becomes its rows [r0, r0 + n) (an empty buffer stays empty).
  void rows(DeviceBuffer& live, int64_t width, int64_t r0, int64_t n) {
    if (live.bytes()) replace(live, live.as<char>() + size_t(r0 * width) * 4, size_t(n * width) * 4);
  }
  // `live` becomes a view of `bytes` at p.
  void replace(DeviceBuffer& live, void* p, size_t bytes) {
    kept_.emplace_back(&live, std::move(live));
    live = DeviceBuffer::view(p, bytes);
  }

 private:
  std::vector<std::pair<DeviceBuffer*, DeviceBuffer>> kept_;  // each replaced buffer and its whole
};

// The pass buffers every mixer reads and writes (s.h, s.y, the DSA selection) as their rows [r0, r0 + n), and the
// pass position d_pos0 as the device int at pos.
inline void view_pass(BufferViews& v, CudaEngine::Impl& m, int64_t r0, int64_t n, int32_t* pos) {
  v.rows(m.s.h, m.c.hidden_size, r0, n);
  v.rows(m.s.y, m.c.hidden_size, r0, n);
  v.rows(m.s.sel, m.sel_width(), r0, n);
  v.replace(m.d_pos0, pos, 4);
}

// While it lives, the engine's pass buffers a mixer reads and writes (s.h, s.y, the DSA selection, the MLA query
// latent and the indexer's key projections) are row b's, and so are the position, cache table and state the kernels
// take: the mixer (or its position-dependent part) runs as a pass of one token.
class BatchRow {
 public:
  BatchRow(CudaEngine::Impl& m, const BatchRows& r, int64_t b) : m_(m) {
    const ModelSpec& c = m.c;
    view_pass(views_, m, b, 1, r.d_pos + b);
    views_.rows(m.s.q_lat, c.q_lora_rank, b, 1);
    views_.rows(m.s.ik, c.index_head_dim, b, 1);
    views_.rows(m.s.ig, c.index_head_dim, b, 1);
    views_.rows(m.s.ihw, c.index_n_heads, b, 1);
    views_.replace(m.d_layer_cache, r.d_tables + b * c.num_layers, size_t(c.num_layers) * sizeof(DeviceLayerCache));
    state_ = r.states[size_t(b)];
    m.cur_state.swap(state_);
  }
  ~BatchRow() { m_.cur_state.swap(state_); }
  BatchRow(const BatchRow&) = delete;
  BatchRow& operator=(const BatchRow&) = delete;

 private:
  CudaEngine::Impl& m_;
  BufferViews views_;
  std::vector<CudaEngine::Impl::LayerState> state_;
};

// A prefill group (CudaEngine::Impl::forward): consecutive passes of one sequence run layer by layer; pass i holds
// the group's rows [parts[i].first, + parts[i].second) at the device position d_pos[i].
struct GroupPasses {
  std::vector<std::pair<int64_t, int64_t>> parts;
  int32_t* d_pos = nullptr;
};

// While it lives, s.h, s.y and the DSA selection are pass i's rows of the group and d_pos0 its position: a mixer
// runs as that pass alone, in its turn (its caches and state see the group's passes in order).
class GroupPass {
 public:
  GroupPass(CudaEngine::Impl& m, const GroupPasses& g, size_t i) {
    view_pass(views_, m, g.parts[i].first, g.parts[i].second, g.d_pos + i);
  }

 private:
  BufferViews views_;
};

// The CUDA engine's blocks for the decoder loop (model/decoder.h): activations stay on the device. A plain
// residual's x += y is deferred into the next norm (one fused add_rms_norm); mHC mixes its streams at every site.
// With `batch`, the S rows are a decode step of S sequences (BatchRows): the mixers run row by row.
class CudaBlocks final : public BlockExecutor {
 public:
  CudaBlocks(CudaEngine::Impl& m, int64_t S, const BatchRows* batch = nullptr, const GroupPasses* group = nullptr)
      : m_(m),
        S_(S),
        D_(int(m.c.hidden_size)),
        n_(int(m.c.residual.streams)),
        hyper_(m.c.residual.hyper),
        batch_(batch),
        group_(group) {}

  void enter(int64_t l, Site site) override {
    const DevLayer& L = m_.layers[size_t(l)];
    const DevNorm& norm = site == Site::Attention ? L.input_norm : L.post_norm;
    m_.phase(CudaPhase::Residual);
    if (!hyper_) return add_pending_and_norm(norm);
    const DevHyper& hc = site == Site::Attention ? L.attn_hc : L.ffn_hc;
    const ResidualSpec& r = m_.c.residual;
    join_side();
    if (step_) {  // the pending leave and this enter in one launch
      side_pending_ =
          hyper_step(x(), pending_ ? y() : nullptr, int(S_), n_, D_, hc.fn.as<float>(), hc.scale.as<float>(),
                     hc.base.as<float>(), norm.w.as<float>(), eps(), float(r.eps), int(r.sinkhorn_iters), h(),
                     m_.s.post.as<float>(), m_.s.comb.as<float>(), m_.s.hc_step.as<float>(), m_.stream, &m_.mhc_side);
      pending_ = false;
      return;
    }
    side_pending_ =
        hyper_enter(x(), int(S_), n_, D_, hc.fn.as<float>(), hc.scale.as<float>(), hc.base.as<float>(),
                    norm.w.as<float>(), eps(), float(r.eps), int(r.sinkhorn_iters), h(), m_.s.post.as<float>(),
                    m_.s.comb.as<float>(), m_.s.hc_part.as<float>(), m_.stream, m_.cublas, &m_.mhc_side);
  }
  void leave(int64_t, Site) override {
    m_.phase(CudaPhase::Residual);
    if (!hyper_ || step_) return void(pending_ = true);  // (mHC decode: folded into the next enter)
    leave_now();
  }
  void mla(int64_t l, IndexerKind indexer) override {  // (a batch: the projections over all rows)
    if (batch_) return m_.attention_mla(l, S_, indexer, batch_);
    mixer([&](int64_t S) { m_.attention_mla(l, S, indexer); });
  }
  void gqa(int64_t l) override {
    m_.phase(CudaPhase::AttnCore);
    mixer([&](int64_t S) { m_.attention_gqa(l, S); });
  }
  void kda(int64_t l) override {  // (a batch: the projections over all rows, the recurrence per row)
    if (batch_) return m_.kda(l, S_, batch_);
    mixer([&](int64_t S) { m_.kda(l, S); });
  }
  void gated_delta(int64_t l) override {
    m_.phase(CudaPhase::LinearProj);
    mixer([&](int64_t S) { m_.gated_delta(l, S); });
  }
  void mlp(int64_t l) override {
    m_.phase(CudaPhase::Mlp);
    m_.mlp(*m_.layers[size_t(l)].mlp, h(), S_, y());
  }
  void moe(int64_t l) override { m_.moe(l, S_); }

  // Token embeddings (gathered on the device from d_tokens) into every residual stream.
  void embed() {
    embed_gather(m_.embed.as<uint16_t>(), m_.d_tokens.as<int32_t>(), int(S_), D_, !hyper_ ? x() : h(), m_.stream);
    if (hyper_) hyper_expand(h(), int(S_), n_, D_, x(), m_.stream);
  }
  // A pipeline stage's end: the pending sub-layer output folded into x (any norm: s.h is scratch here).
  void flush(const DevNorm& any_norm) {
    if (pending_ && hyper_) leave_now();
    else if (pending_) add_pending_and_norm(any_norm);
  }
  // The residual after the last layer run (mean over the streams), normalised with `norm` into s.h.
  void final_norm(const DevNorm& norm) {
    if (!hyper_) return add_pending_and_norm(norm);
    if (pending_) leave_now();
    hyper_collapse_mean(x(), int(S_), n_, D_, h(), m_.stream);
    rms_norm(h(), D_, norm.w.as<float>(), int(S_), D_, eps(), h(), D_, m_.stream);
  }

 private:
  // A mixer over the pass's rows, or over each pass of a group in turn, or (a batch) over each row alone.
  template <class F>
  void mixer(F&& f) {
    if (group_) {
      for (size_t i = 0; i < group_->parts.size(); ++i) {
        const GroupPass pass(m_, *group_, i);
        f(group_->parts[i].second);
      }
      return;
    }
    if (!batch_) return f(S_);
    for (int64_t b = 0; b < S_; ++b) {
      const BatchRow row(m_, *batch_, b);
      f(1);
    }
  }
  void join_side() {  // post and comb made on the side stream: before they are read or rewritten
    if (side_pending_) MOESRV_CUDA_OK(cudaStreamWaitEvent(m_.stream, m_.mhc_side.join, 0));
    side_pending_ = false;
  }
  void leave_now() {  // mHC: the sub-layer output y into the streams
    join_side();
    hyper_leave(x(), y(), m_.s.post.as<float>(), m_.s.comb.as<float>(), int(S_), n_, D_, m_.stream);
    pending_ = false;
  }
  // Plain residual: x += the pending sub-layer output (if any), then h = rms_norm(x) with `norm`.
  void add_pending_and_norm(const DevNorm& norm) {
    add_rms_norm(x(), pending_ ? y() : nullptr, norm.w.as<float>(), int(S_), D_, eps(), h(), m_.stream);
    pending_ = false;
  }
  float* x() const { return m_.s.x.as<float>(); }
  float* h() const { return m_.s.h.as<float>(); }
  float* y() const { return m_.s.y.as<float>(); }
  float eps() const { return float(m_.c.rms_eps); }
  CudaEngine::Impl& m_;
  const int64_t S_;
  const int D_, n_;
  const bool hyper_;
  const BatchRows* batch_;
  const GroupPasses* group_;  // a prefill group: the mixers pass by pass, the rest over all S_ rows
  // mHC decode: each leave folded into the next enter (hyper_step)
  const bool step_ =
      hyper_ && hyper_step_supported(int(S_), n_, D_) && m_.s.hc_step.bytes() >= hyper_step_scratch(n_) * 4;
  bool pending_ = false;       // a sub-layer's output in y not yet in x (plain: the next norm adds it; mHC: leave)
  bool side_pending_ = false;  // post and comb being made on m_.mhc_side: join it before they are read
};

}  // namespace moesrv::cuda
