// The CUDA engine's MTP block (speculative decoding): an engine of its own over the one-layer MTP spec, as
// cpu/mtp_forward.cpp runs it: x = eh_proj(concat(enorm(embed(t_{p+1})), hnorm(h_p))) with the embedding zeroed at
// position 0, the decoder layer (its own caches, plain residual), then shared_head.norm; that normed row is both
// the head's input and the hidden state the next chained step reads. A draft step (one position) replays a graph.
// The model's forward_hidden and its rollback points are in cuda_engine.cpp (Impl::forward).
#if defined(MOESRV_HAS_CUDA) && MOESRV_HAS_CUDA
#include <algorithm>
#include <cstring>

#include "backend/cuda/cuda_sequence.h"

namespace moesrv {

using namespace moesrv::cuda;

namespace {

// The MTP block as a one-layer model: the layer's weights move out of the model's (whose forward never reads
// them), the embedding is the model's, shared_head.norm is the final norm, shared_head.head (if any) the head.
std::unique_ptr<ModelWeights> mtp_weights(ModelWeights& w) {
  MtpWeights& m = *w.mtp_block;
  auto out = std::make_unique<ModelWeights>();
  out->package = w.package;
  out->config = w.config.mtp_block();
  out->embed = w.embed;
  out->final_norm = m.head_norm;
  out->lm_head = std::move(m.head);
  out->layers.push_back(std::move(m.layer));
  out->root = w.root;
  return out;
}

}  // namespace

namespace cuda {
DevLinear view_of(const DevLinear& l) {
  auto view = [](const DeviceBuffer& b) { return DeviceBuffer::view(b.as<void>(), b.bytes()); };
  DevLinear v;
  v.w = view(l.w), v.bias = view(l.bias);
  v.in = l.in, v.out = l.out;
  v.x3 = l.x3;
  v.parts.tab = view(l.parts.tab), v.parts.ids = view(l.parts.ids), v.parts.count = l.parts.count;
  return v;
}
}  // namespace cuda

CudaEngine::Impl::Impl(Impl& m, MtpTag)
    : opt(m.opt),
      weights(mtp_weights(*m.weights)),
      c(weights->config),
      name(m.name),
      use_graph(m.use_graph),
      model(&m) {
  opt.layer_begin = 0, opt.layer_end = -1;
  opt.placement.clear(), opt.cache_slots_per_layer.clear();
  opt.plan_placement = nullptr;
  opt.prefill_chunk = std::min<int64_t>(m.rows, 512);  // the block's share of a prompt: rows of 512 at most
  opt.prefill_group = 1;
  opt.mtp = false;
  device_mu = m.device_mu;
  budget = m.budget;
  up.budget = budget;
  open_device();
  set_geometry();
  upload_weights();
  const MtpWeights& w = *m.weights->mtp_block;
  mtp_in.emplace();
  mtp_in->enorm = up.norm(w.enorm);
  mtp_in->hnorm = up.norm(w.hnorm);
  mtp_in->eh_proj = up.linear({w.eh_proj.get()}, "MTP eh_proj");
  mtp_in->eh = DeviceBuffer(budget, size_t(rows * 2 * c.hidden_size) * 4, "MTP input");
  allocate_scratch();
  allocate_exl3_scratch();
}

std::vector<float> CudaEngine::Impl::mtp_forward(SequenceState& seq_base, const std::vector<int32_t>& next,
                                                 const std::vector<float>& hidden, std::vector<float>& hidden_out) {
  CudaSequence& seq = own_sequence(*this, seq_base, "mtp_forward");
  const int64_t n = int64_t(next.size()), D = c.hidden_size, V = c.vocab_size, pos0 = seq.length();
  if (n == 0 || int64_t(hidden.size()) != n * D)
    fail("mtp_forward: {} tokens with {} hidden values (hidden size {})", n, hidden.size(), D);
  check_tokens(pos0, next.data(), n);
  const float eps = float(c.rms_eps);
  float* eh = mtp_in->eh.as<float>();
  MOESRV_CUDA_OK(cudaStreamSynchronize(stream));
  seq.begin_forward(0);
  bind_sequence(*this, seq);
  int64_t last = 0;
  for_each_pass(pass_policy(), seq, pos0, n, false, [&](const Pass& p) {  // the one pass loop (pass_plan.h)
    const int64_t c0 = p.offset, m = p.rows;
    MOESRV_CUDA_OK(cudaStreamSynchronize(stream));  // pinned staging is free again
    *h_pos0.as<int32_t>() = int32_t(pos0 + c0);
    std::memcpy(h_tokens.as<int32_t>(), next.data() + c0, size_t(m) * 4);
    MOESRV_CUDA_OK(cudaMemcpyAsync(d_pos0.as<void>(), h_pos0.as<void>(), 4, cudaMemcpyHostToDevice, stream));
    MOESRV_CUDA_OK(
        cudaMemcpyAsync(d_tokens.as<void>(), h_tokens.as<void>(), size_t(m) * 4, cudaMemcpyHostToDevice, stream));
    MOESRV_CUDA_OK(
        cudaMemcpyAsync(s.h.as<void>(), hidden.data() + c0 * D, size_t(m * D) * 4, cudaMemcpyHostToDevice, stream));
    const bool first = pos0 + c0 == 0;
    auto body = [&] {  // enorm(embed(t)) | hnorm(h) per row, then eh_proj into the residual, then the layer
      embed_gather(embed.as<uint16_t>(), d_tokens.as<int32_t>(), int(m), int(D), s.y.as<float>(), stream);
      if (first) MOESRV_CUDA_OK(cudaMemsetAsync(s.y.as<void>(), 0, size_t(D) * 4, stream));
      rms_norm(s.y.as<float>(), D, mtp_in->enorm.w.as<float>(), int(m), int(D), eps, eh, 2 * D, stream);
      rms_norm(s.h.as<float>(), D, mtp_in->hnorm.w.as<float>(), int(m), int(D), eps, eh + D, 2 * D, stream);
      linear(mtp_in->eh_proj, eh, m, s.x.as<float>());
      run_block_layers(m);
    };
    if (m == 1 && !first && graph_ok())  // a draft step: one graph per MTP sequence (or one, without fixed state)
      replay(seq.has_fixed_state() ? sequence_graphs->get(rows_graph_key(seq.id, 1)) : graphs[0], body);
    else body();
    last = m - 1;
  });
  const float* row = s.h.as<float>() + last * D;  // the last row, normed: the head's input and the next step's h
  linear(lm_head, row, 1, s.logits.as<float>());
  hidden_out.resize(size_t(D));
  std::vector<float> logits(static_cast<size_t>(V));
  MOESRV_CUDA_OK(cudaMemcpyAsync(hidden_out.data(), row, size_t(D) * 4, cudaMemcpyDeviceToHost, stream));
  MOESRV_CUDA_OK(
      cudaMemcpyAsync(h_logits.as<float>(), s.logits.as<float>(), size_t(V) * 4, cudaMemcpyDeviceToHost, stream));
  MOESRV_CUDA_OK(cudaStreamSynchronize(stream));
  std::memcpy(logits.data(), h_logits.as<float>(), size_t(V) * 4);
  return logits;
}

MtpEngine* CudaEngine::mtp() { return impl_->mtp ? this : nullptr; }
int64_t CudaEngine::hidden_size() const { return impl_->c.hidden_size; }

std::vector<float> CudaEngine::forward_hidden(SequenceState& seq, const std::vector<int32_t>& tokens, bool all_logits,
                                              bool rollback, std::vector<float>& hidden) {
  const Impl::DeviceLock lock(*impl_->device_mu);
  const DeviceGuard on(impl_->opt.device);
  return impl_->forward(seq, tokens, all_logits, nullptr, rollback, &hidden);
}

std::unique_ptr<SequenceState> CudaEngine::new_mtp_sequence() const {
  if (!impl_->mtp) fail("{}: the MTP block is not loaded (CudaEngineOptions::mtp)", impl_->name);
  const DeviceGuard on(impl_->opt.device);
  return std::make_unique<CudaSequence>(*impl_->mtp);
}

std::vector<float> CudaEngine::mtp_forward(SequenceState& mtp_seq, const std::vector<int32_t>& next,
                                           const std::vector<float>& hidden, std::vector<float>& hidden_out) {
  if (!impl_->mtp) fail("{}: the MTP block is not loaded (CudaEngineOptions::mtp)", impl_->name);
  const Impl::DeviceLock lock(*impl_->device_mu);
  const DeviceGuard on(impl_->opt.device);
  return impl_->mtp->mtp_forward(mtp_seq, next, hidden, hidden_out);
}

}  // namespace moesrv
#endif  // MOESRV_HAS_CUDA
