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
#include "backend/state_buffers.h"

namespace moesrv::cuda {

// One sequence's state on the device, max_ctx tokens, allocated against the engine's budget: per softmax-attention
// layer its KV (or latent) cache and indexer keys (per token, or pooled with the k-pool indexer and its open
// pool), per linear-attention layer its conv and recurrent state. Fixed-size state cannot be rewound per token:
// it is checkpointed (device copies) where the pass plan says (pass_plan.h), and truncate() goes back to those.
class CudaSequence : public SequenceState {
 public:
  explicit CudaSequence(const CudaEngine::Impl& e)
      : owner(&e),
        id(next_id()),
        graphs_(e.sequence_graphs),
        mu_(e.device_mu),
        layout_(state_layout(e.c, StateStore::Device, e.opt.kv_q8)) {
    const CudaEngine::Impl::DeviceLock lock(*mu_);
    const DeviceGuard on(e.opt.device);
    const ModelSpec& c = e.c;
    resume_.pool = std::max<int64_t>(1, c.index_kpool);
    layers.resize(size_t(c.num_layers));
    steps_.resize(size_t(c.num_layers));
    table.resize(size_t(c.num_layers));
    for (int64_t l = e.layer_begin; l < e.layer_end; ++l) {  // a pipeline stage's layers only
      auto& L = layers[size_t(l)];
      for_each_slot(layout_[size_t(l)], [&](size_t i, const SlotShape& s) {
        const int64_t rows = s.growth == Growth::PerToken ? e.max_ctx : s.growth == Growth::PerPool ? e.max_pools() : 1;
        L.buf[i] = DeviceBuffer(e.budget, size_t(rows * s.width * s.elem_bytes), s.what);
        if (s.growth != Growth::Fixed) return;
        MOESRV_CUDA_OK(cudaMemsetAsync(L.buf[i].as<void>(), 0, L.buf[i].bytes(), e.stream));
        resume_.fixed_state = true;
        resume_.recurrent |= StateSlot(i) != StateSlot::Open && StateSlot(i) != StateSlot::OpenG;
      });
      table[size_t(l)] = {L[StateSlot::Kv].as<void>(), L[StateSlot::KvScale].as<float>(), L[StateSlot::V].as<void>(),
                          L[StateSlot::VScale].as<float>(), L[StateSlot::IndexK].as<uint16_t>()};
    }
    MOESRV_CUDA_OK(cudaStreamSynchronize(e.stream));  // the zeroed state is visible to every stream
  }
  ~CudaSequence() override {
    const CudaEngine::Impl::DeviceLock lock(*mu_);
    layers.clear();  // device memory freed under the lock
    steps_.clear();
    checkpoints_.drop_after(-1);
    if (!resume_.fixed_state) return;
    for (int64_t n = 1; n <= CudaEngine::Impl::kMaxGraphRows; ++n) {
      graphs_->drop(CudaEngine::Impl::rows_graph_key(id, n));
      graphs_->drop(CudaEngine::Impl::rows_graph_key(id, n) | CudaEngine::Impl::kRollbackGraph);
    }
    graphs_->drop(id | CudaEngine::Impl::kStageGraph);
  }
  int64_t length() const override { return length_; }
  int64_t resume_point(int64_t n) const override {
    return resume_.point(n, length_, steps_from_, steps_rows_ > 1 ? steps_from_ + steps_rows_ : steps_from_,
                         checkpoints_);
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
    if (resume_.fixed_state) {
      const DeviceGuard on(owner->opt.device);
      if (resume_point(n) != n)
        fail("truncate({}): the recurrent state can only resume at a checkpoint (nearest: {})", n, resume_point(n));
      const FixedState* cp = checkpoints_.at(n);  // none: n == 0, or a pool boundary of a k-pool-only sequence
      for (size_t l = 0; l < layers.size(); ++l) cut_to(store(), layout_[l], layers[l], n, cp ? &(*cp)[l] : nullptr);
      checkpoints_.drop_after(n);
    }
    length_ = n;  // later positions are overwritten by the next forward
  }
  // A device copy of the fixed-size state at the current length (the prefix cache can resume here).
  void checkpoint() override {
    if (!resume_.fixed_state || !checkpoints_.wants(length_)) return;
    const CudaEngine::Impl::DeviceLock lock(*mu_);
    const DeviceGuard on(owner->opt.device);
    checkpoints_.make_room();  // the oldest copy's memory is freed before the next is allocated
    auto cp = std::make_shared<FixedState>(layers.size());
    for (size_t l = 0; l < layers.size(); ++l) (*cp)[l] = save_fixed(store(), layout_[l], layers[l]);
    checkpoints_.push(length_, std::move(cp));
  }
  std::unique_ptr<SequenceState> clone() const override {
    const CudaEngine::Impl::DeviceLock lock(*mu_);
    const DeviceGuard on(owner->opt.device);
    auto s = std::make_unique<CudaSequence>(*owner);
    for (size_t l = 0; l < layers.size(); ++l) copy_state(store(), layout_[l], layers[l], s->layers[l], length_);
    s->checkpoints_ = checkpoints_;  // immutable: shared with the clone
    MOESRV_CUDA_OK(cudaStreamSynchronize(owner->stream));
    s->length_ = length_;
    return s;
  }
  size_t bytes() const override {
    size_t b = 0;
    for (size_t l = 0; l < layers.size(); ++l) b += layer_bytes(store(), layers[l]) + layer_bytes(store(), steps_[l]);
    checkpoints_.for_each([&](int64_t, const FixedState& cp) {
      for (const Layer& L : cp) b += layer_bytes(store(), L);
    });
    return b;
  }
  // Raw pointers of the fixed-size and pooled state for the engine's pass (with the rollback points' buffers when
  // `steps`).
  CudaEngine::Impl::LayerState state(size_t l, bool steps = false) const {
    const Layer &L = layers[l], &P = steps_[l];
    CudaEngine::Impl::LayerState st{L[StateSlot::Conv].as<float>(), L[StateSlot::Recurrent].as<float>(),
                                    L[StateSlot::PoolK].as<float>(), L[StateSlot::Open].as<float>()};
    if (steps)
      st.conv_steps = P[StateSlot::Conv].as<float>(), st.rec_steps = P[StateSlot::Recurrent].as<float>(),
      st.open_steps = P[StateSlot::Open].as<float>();
    return st;
  }
  bool has_fixed_state() const override { return resume_.fixed_state; }
  // A rollback forward of S tokens starts (S > 1 with fixed-size state: the kernels leave the state after each of its
  // first S - 1 tokens in the step buffers, allocated on first use) or a plain one does (S = 0): the previous
  // forward's rollback points are gone either way.
  bool begin_forward(int64_t S) {
    steps_rows_ = 0;
    if (!resume_.fixed_state || S < 2) return false;
    if (S > CudaEngine::Impl::kMaxRollbackRows)
      fail("forward: rollback points for {} tokens (at most {})", S, CudaEngine::Impl::kMaxRollbackRows);
    const DeviceGuard on(owner->opt.device);
    const size_t steps = size_t(CudaEngine::Impl::kMaxRollbackRows - 1);
    for (size_t l = 0; l < layers.size(); ++l)
      for_each_slot(layout_[l], [&](size_t i, const SlotShape& s) {
        const DeviceBuffer& of = layers[l].buf[i];
        DeviceBuffer& steps_buf = steps_[l].buf[i];
        if (s.growth == Growth::Fixed && of.bytes() && !steps_buf.bytes())
          steps_buf = DeviceBuffer(owner->budget, steps * of.bytes(), "rollback points");
      });
    return true;
  }
  void end_forward(int64_t pos0, int64_t S, bool rollback) {
    if (rollback && resume_.fixed_state && S > 1) steps_from_ = pos0, steps_rows_ = S;
  }

  using Layer = LayerBuffers<DeviceBuffer>;  // by slot: state_layout(StateStore::Device)
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
  using FixedState = std::vector<Layer>;  // per layer, its fixed buffers
  // The device storage of state_buffers.h's operations, on the engine's stream.
  struct Store {
    const CudaEngine::Impl* e;
    using Buffer = DeviceBuffer;
    void keep(Buffer&, size_t) const {}  // later rows are overwritten by the next forward
    void assign(Buffer& to, const Buffer& from) const {
      if (to.bytes()) copy(to, from, from.bytes());
    }
    void zero(Buffer& b) const {
      if (b.bytes()) MOESRV_CUDA_OK(cudaMemsetAsync(b.as<void>(), 0, b.bytes(), e->stream));
    }
    Buffer saved(const Buffer& b) const {
      if (!b.bytes()) return {};
      DeviceBuffer c(e->budget, b.bytes(), "state checkpoint");
      copy(c, b, b.bytes());
      return c;
    }
    void copy(Buffer& to, const Buffer& from, size_t bytes) const {
      if (from.bytes())
        MOESRV_CUDA_OK(cudaMemcpyAsync(to.as<void>(), from.as<void>(), bytes, cudaMemcpyDeviceToDevice, e->stream));
    }
    size_t bytes(const Buffer& b) const { return b.bytes(); }
  };
  Store store() const { return {owner}; }
  // Lengths a rollback forward left points for: (steps_from_, steps_from_ + steps_rows_).
  bool in_steps(int64_t n) const { return steps_rows_ > 1 && n > steps_from_ && n < steps_from_ + steps_rows_; }
  // The fixed-size state after token t of the last rollback forward back in place.
  void restore_step(int64_t t) {
    const ModelSpec& c = owner->c;
    const LinearAttnDims& la = c.linear;
    for (size_t l = 0; l < layers.size(); ++l)
      for_each_slot(layout_[l], [&](size_t i, const SlotShape& s) {
        DeviceBuffer& to = layers[l].buf[i];
        if (s.growth != Growth::Fixed || !to.bytes()) return;
        const char* from = steps_[l].buf[i].as<char>() + size_t(t) * to.bytes();
        if (StateSlot(i) == StateSlot::Recurrent)  // the steps hold delta_rule's layout
          state_from_step(reinterpret_cast<const float*>(from), int(la.v_heads), int(la.dk), int(la.dv), to.as<float>(),
                          owner->stream);
        else MOESRV_CUDA_OK(cudaMemcpyAsync(to.as<void>(), from, to.bytes(), cudaMemcpyDeviceToDevice, owner->stream));
      });
  }
  std::shared_ptr<SequenceGraphs> graphs_;    // the engine's, kept alive by the sequence
  std::shared_ptr<std::recursive_mutex> mu_;  // the engine's device lock (CudaEngine::Impl::device_mu)
  std::vector<LayerLayout> layout_;           // state_layout(StateStore::Device, kv_q8)
  std::vector<Layer> steps_;                  // rollback points of the fixed buffers (begin_forward)
  ResumeRule resume_;                         // where the fixed-size state can resume (checkpoint_list.h)
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
