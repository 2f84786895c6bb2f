// One sequence's state on the device for the CUDA engine (and its MTP block's engine): caches, fixed-size state,
// checkpoints and a verify's rollback points. CUDA builds only.
#pragma once
#include <algorithm>
#include <atomic>
#include <cstring>
#include <memory>
#include <vector>

#include "backend/checkpoint_list.h"
#include "backend/cuda/engine_internal.h"

namespace moesrv::cuda {

// One sequence's state on the device, max_ctx tokens, allocated against the engine's budget: per softmax-attention
// layer its KV (or latent) cache and indexer keys (per token, or pooled with the k-pool indexer and its open
// pool), per linear-attention layer its conv and recurrent state. Fixed-size state cannot be rewound per token:
// it is checkpointed (device copies) where the pass plan says (pass_plan.h), and truncate() goes back to those.
class CudaSequence : public SequenceState {
 public:
  explicit CudaSequence(const CudaEngine::Impl& e)
      : owner(&e), id(next_id()), graphs_(e.sequence_graphs), mu_(e.device_mu) {
    const CudaEngine::Impl::DeviceLock lock(*mu_);
    const DeviceGuard on(e.opt.device);
    const ModelSpec& c = e.c;
    const size_t elem = e.opt.kv_q8 ? 1 : 2, T = size_t(e.max_ctx);
    layers.resize(size_t(c.num_layers));
    table.resize(size_t(c.num_layers));
    for (int64_t l = e.layer_begin; l < e.layer_end; ++l) {  // a pipeline stage's layers only
      const LayerSpec& spec = c.layers[size_t(l)];
      auto& L = layers[size_t(l)];
      if (spec.recurrent()) {
        L.conv = fixed(e, size_t((c.linear.conv_kernel - 1) * c.linear.conv_channels()), "conv state");
        L.recurrent = fixed(e, size_t(c.linear.state_floats()), "recurrent state");
      } else {
        L.kv = DeviceBuffer(e.budget, T * size_t(e.kv_row) * elem, "KV cache");
        if (e.opt.kv_q8) L.kv_scale = DeviceBuffer(e.budget, T * 4, "KV cache scales");
        if (e.v_row) {
          L.v = DeviceBuffer(e.budget, T * size_t(e.v_row) * elem, "KV cache");
          if (e.opt.kv_q8) L.v_scale = DeviceBuffer(e.budget, T * 4, "KV cache scales");
        }
      }
      if (spec.indexer == IndexerKind::Own) {
        if (c.index_kpool > 1) {
          L.pool_k = DeviceBuffer(e.budget, size_t(e.max_pools() * c.index_head_dim) * 4, "indexer pooled keys");
          L.open = fixed(e, size_t(2 * c.index_kpool * c.index_head_dim), "indexer open pool");
        } else {
          L.index_k = DeviceBuffer(e.budget, T * size_t(c.index_head_dim) * 2, "indexer key cache");
        }
      }
      table[size_t(l)] = {L.kv.as<void>(), L.kv_scale.as<float>(), L.v.as<void>(), L.v_scale.as<float>(),
                          L.index_k.as<uint16_t>()};
      fixed_state_ |= bool(L.conv.bytes()) || bool(L.open.bytes());
    }
    MOESRV_CUDA_OK(cudaStreamSynchronize(e.stream));  // the zeroed state is visible to every stream
  }
  ~CudaSequence() override {
    const CudaEngine::Impl::DeviceLock lock(*mu_);
    layers.clear();  // device memory freed under the lock
    checkpoints_.drop_after(-1);
    if (!fixed_state_) return;
    for (int64_t n = 1; n <= CudaEngine::Impl::kMaxGraphRows; ++n) {
      graphs_->drop(CudaEngine::Impl::rows_graph_key(id, n));
      graphs_->drop(CudaEngine::Impl::rows_graph_key(id, n) | CudaEngine::Impl::kRollbackGraph);
    }
    graphs_->drop(id | CudaEngine::Impl::kStageGraph);
  }
  int64_t length() const override { return length_; }
  int64_t resume_point(int64_t n) const override {
    n = std::min(n, length_);
    if (!fixed_state_ || n == length_ || in_steps(n)) return n;
    return checkpoints_.latest_at_or_before(n);
  }
  void truncate(int64_t n) override {
    if (n < 0 || n > length_) fail("truncate({}) outside sequence of length {}", n, length_);
    if (n == length_) return;
    const CudaEngine::Impl::DeviceLock lock(*mu_);
    if (in_steps(n)) {  // back to a rollback point of the last forward
      const DeviceGuard on(owner->opt.device);
      restore_step(n - steps_from_ - 1);
      checkpoints_.drop_after(n);
      steps_rows_ = 0;
      length_ = n;
      return;
    }
    steps_rows_ = 0;
    if (fixed_state_) {
      const DeviceGuard on(owner->opt.device);
      if (resume_point(n) != n)
        fail("truncate({}): the recurrent state can only resume at a checkpoint (nearest: {})", n, resume_point(n));
      const FixedState* cp = checkpoints_.at(n);
      for (size_t l = 0; l < layers.size(); ++l)
        for (auto [buf, i] : fixed_buffers(l)) {
          if (!buf->bytes()) continue;
          if (cp) copy((*cp)[l * 3 + i], *buf);
          else MOESRV_CUDA_OK(cudaMemsetAsync(buf->as<void>(), 0, buf->bytes(), owner->stream));
        }
      checkpoints_.drop_after(n);
    }
    length_ = n;  // later positions are overwritten by the next forward
  }
  // A device copy of the fixed-size state at the current length (the prefix cache can resume here).
  void checkpoint() override {
    if (!fixed_state_ || !checkpoints_.wants(length_)) return;
    const CudaEngine::Impl::DeviceLock lock(*mu_);
    const DeviceGuard on(owner->opt.device);
    checkpoints_.make_room();  // the oldest copy's memory is freed before the next is allocated
    auto cp = std::make_shared<FixedState>(layers.size() * 3);
    for (size_t l = 0; l < layers.size(); ++l)
      for (auto [buf, i] : fixed_buffers(l)) {
        if (!buf->bytes()) continue;
        (*cp)[l * 3 + i] = DeviceBuffer(owner->budget, buf->bytes(), "state checkpoint");
        copy(*buf, (*cp)[l * 3 + i]);
      }
    checkpoints_.push(length_, std::move(cp));
  }
  std::unique_ptr<SequenceState> clone() const override {
    const CudaEngine::Impl::DeviceLock lock(*mu_);
    const DeviceGuard on(owner->opt.device);
    auto s = std::make_unique<CudaSequence>(*owner);
    const size_t T = size_t(owner->max_ctx), n = size_t(length_);
    auto rows = [&](const DeviceBuffer& from, DeviceBuffer& to) {  // per-token caches: the first n rows
      if (from.bytes())
        MOESRV_CUDA_OK(cudaMemcpyAsync(to.as<void>(), from.as<void>(), from.bytes() / T * n, cudaMemcpyDeviceToDevice,
                                       owner->stream));
    };
    for (size_t l = 0; l < layers.size(); ++l) {
      rows(layers[l].kv, s->layers[l].kv);
      rows(layers[l].kv_scale, s->layers[l].kv_scale);
      rows(layers[l].v, s->layers[l].v);
      rows(layers[l].v_scale, s->layers[l].v_scale);
      rows(layers[l].index_k, s->layers[l].index_k);
      if (layers[l].pool_k.bytes()) copy(layers[l].pool_k, s->layers[l].pool_k);
      for (auto [buf, i] : fixed_buffers(l)) copy(*buf, *s->fixed_buffers(l)[size_t(i)].first);
    }
    s->checkpoints_ = checkpoints_;  // immutable: shared with the clone
    MOESRV_CUDA_OK(cudaStreamSynchronize(owner->stream));
    s->length_ = length_;
    return s;
  }
  size_t bytes() const override {
    size_t b = 0;
    for (const auto& L : layers)
      b += L.kv.bytes() + L.kv_scale.bytes() + L.v.bytes() + L.v_scale.bytes() + L.index_k.bytes() + L.pool_k.bytes() +
           L.open.bytes() + L.conv.bytes() + L.recurrent.bytes() + L.conv_steps.bytes() + L.rec_steps.bytes() +
           L.open_steps.bytes();
    checkpoints_.for_each([&b](int64_t, const FixedState& cp) {
      for (const auto& f : cp) b += f.bytes();
    });
    return b;
  }
  // Raw pointers of the fixed-size and pooled state for the engine's pass (with the rollback points' buffers when
  // `steps`).
  CudaEngine::Impl::LayerState state(size_t l, bool steps = false) const {
    const Layer& L = layers[l];
    CudaEngine::Impl::LayerState st{L.conv.as<float>(), L.recurrent.as<float>(), L.pool_k.as<float>(),
                                    L.open.as<float>()};
    if (steps)
      st.conv_steps = L.conv_steps.as<float>(), st.rec_steps = L.rec_steps.as<float>(),
      st.open_steps = L.open_steps.as<float>();
    return st;
  }
  bool has_fixed_state() const override { return fixed_state_; }
  // A rollback forward of S tokens starts (S > 1 with fixed-size state: the kernels leave the state after each of its
  // first S - 1 tokens in the step buffers, allocated on first use) or a plain one does (S = 0): the previous
  // forward's rollback points are gone either way.
  bool begin_forward(int64_t S) {
    steps_rows_ = 0;
    if (!fixed_state_ || S < 2) return false;
    if (S > CudaEngine::Impl::kMaxRollbackRows)
      fail("forward: rollback points for {} tokens (at most {})", S, CudaEngine::Impl::kMaxRollbackRows);
    const DeviceGuard on(owner->opt.device);
    const size_t steps = size_t(CudaEngine::Impl::kMaxRollbackRows - 1);
    for (Layer& L : layers) {
      auto make = [&](const DeviceBuffer& of, DeviceBuffer& steps_buf) {
        if (of.bytes() && !steps_buf.bytes())
          steps_buf = DeviceBuffer(owner->budget, steps * of.bytes(), "rollback points");
      };
      make(L.conv, L.conv_steps);
      make(L.recurrent, L.rec_steps);
      make(L.open, L.open_steps);
    }
    return true;
  }
  void end_forward(int64_t pos0, int64_t S, bool rollback) {
    if (rollback && fixed_state_ && S > 1) steps_from_ = pos0, steps_rows_ = S;
  }

  struct Layer {
    DeviceBuffer kv, kv_scale, v, v_scale, index_k;  // per token
    DeviceBuffer pool_k;                             // per completed pool (fp32)
    DeviceBuffer open, conv, recurrent;              // fixed size (fp32)
    DeviceBuffer conv_steps, rec_steps, open_steps;  // rollback points (begin_forward)
  };
  const CudaEngine::Impl* owner;
  const uint64_t id;  // never reused: keys the sequence's decode graph
  std::vector<Layer> layers;
  std::vector<DeviceLayerCache> table;
  int64_t length_ = 0;

 private:
  static uint64_t next_id() {
    static std::atomic<uint64_t> n{0};
    return ++n;
  }
  using FixedState = std::vector<DeviceBuffer>;  // [layer * 3 + i]: open, conv, recurrent (empty where none)
  static DeviceBuffer fixed(const CudaEngine::Impl& e, size_t floats, const char* what) {
    DeviceBuffer b(e.budget, floats * 4, what);
    MOESRV_CUDA_OK(cudaMemsetAsync(b.as<void>(), 0, b.bytes(), e.stream));
    return b;
  }
  // Lengths a rollback forward left points for: (steps_from_, steps_from_ + steps_rows_).
  bool in_steps(int64_t n) const { return steps_rows_ > 1 && n > steps_from_ && n < steps_from_ + steps_rows_; }
  // The fixed-size state after token t of the last rollback forward back in place.
  void restore_step(int64_t t) {
    const ModelSpec& c = owner->c;
    const LinearAttnDims& la = c.linear;
    for (Layer& L : layers) {
      auto from = [&](const DeviceBuffer& steps, const DeviceBuffer& of) {
        return reinterpret_cast<const char*>(steps.as<void>()) + size_t(t) * of.bytes();
      };
      if (L.conv.bytes())
        MOESRV_CUDA_OK(cudaMemcpyAsync(L.conv.as<void>(), from(L.conv_steps, L.conv), L.conv.bytes(),
                                       cudaMemcpyDeviceToDevice, owner->stream));
      if (L.open.bytes())
        MOESRV_CUDA_OK(cudaMemcpyAsync(L.open.as<void>(), from(L.open_steps, L.open), L.open.bytes(),
                                       cudaMemcpyDeviceToDevice, owner->stream));
      if (L.recurrent.bytes())
        state_from_step(reinterpret_cast<const float*>(from(L.rec_steps, L.recurrent)), int(la.v_heads), int(la.dk),
                        int(la.dv), L.recurrent.as<float>(), owner->stream);
    }
  }
  void copy(const DeviceBuffer& from, DeviceBuffer& to) const {
    if (from.bytes())
      MOESRV_CUDA_OK(
          cudaMemcpyAsync(to.as<void>(), from.as<void>(), from.bytes(), cudaMemcpyDeviceToDevice, owner->stream));
  }
  std::array<std::pair<DeviceBuffer*, int>, 3> fixed_buffers(size_t l) const {
    Layer& L = const_cast<Layer&>(layers[l]);
    return {{{&L.open, 0}, {&L.conv, 1}, {&L.recurrent, 2}}};
  }
  std::shared_ptr<SequenceGraphs> graphs_;    // the engine's, kept alive by the sequence
  std::shared_ptr<std::recursive_mutex> mu_;  // the engine's device lock (CudaEngine::Impl::device_mu)
  bool fixed_state_ = false;
  int64_t steps_from_ = -1, steps_rows_ = 0;  // the last forward's rollback points (rows 0: none)
  CheckpointList<FixedState> checkpoints_{CudaEngine::Impl::kMaxCheckpoints};
};

// The sequence's caches and state for the kernels of the next passes (as forward() binds them).
inline void bind_sequence(CudaEngine::Impl& m, const CudaSequence& seq, bool steps = false) {
  m.cur_state.resize(seq.layers.size());
  for (size_t l = 0; l < seq.layers.size(); ++l) m.cur_state[l] = seq.state(l, steps);
  std::memcpy(m.h_layer_cache.as<void>(), seq.table.data(), seq.table.size() * sizeof(DeviceLayerCache));
  MOESRV_CUDA_OK(cudaMemcpyAsync(m.d_layer_cache.as<void>(), m.h_layer_cache.as<void>(),
                                 seq.table.size() * sizeof(DeviceLayerCache), cudaMemcpyHostToDevice, m.stream));
}

// `s` as this engine's sequence (`what` names the call in the error).
inline CudaSequence& own_sequence(const CudaEngine::Impl& m, SequenceState& s, const char* what) {
  auto* seq = dynamic_cast<CudaSequence*>(&s);
  if (!seq || seq->owner != &m) fail("{}: sequence state was not created by this engine", what);
  return *seq;
}

}  // namespace moesrv::cuda
