// The MTP block on the CPU (DeepSeek-V3 layout, checked against vLLM's deepseek_mtp.py and glm5next/nvidia/mtp.py):
// x = eh_proj(concat(enorm(embed(t_{p+1})), hnorm(h_p))) with the embedding zeroed at position 0, one decoder layer
// (its own attention cache, plain residual), then shared_head.norm. That normed vector is both the head's input
// (shared_head.head, else the model's lm_head) and the hidden state the next chained MTP step reads, as the main
// model hands over its own head input (after the final norm; for mHC streams, their mean then the norm).
#include "backend/cpu/cpu_blocks.h"
#include "backend/cpu/cpu_engine.h"
#include "backend/cpu/linear.h"
#include "backend/cpu/ops.h"
#include "util/error.h"

namespace moesrv {

std::unique_ptr<SequenceState> CpuEngine::new_mtp_sequence() const {
  if (!weights_->mtp_block) fail("{}: the model has no MTP block", name_);
  return std::make_unique<CpuSequence>(mtp_spec_, &mtp_spec_);
}

std::vector<float> CpuEngine::mtp_forward(SequenceState& mtp_seq, const std::vector<int32_t>& next,
                                          const std::vector<float>& hidden, std::vector<float>& hidden_out) {
  auto* seq = dynamic_cast<CpuSequence*>(&mtp_seq);
  if (!seq || seq->owner != &mtp_spec_) fail("mtp_forward: the state was not made by this engine's new_mtp_sequence");
  const MtpWeights& m = *weights_->mtp_block;
  const ModelSpec& c = weights_->config;
  const int64_t n = int64_t(next.size()), D = c.hidden_size, pos0 = seq->length();
  if (n == 0 || int64_t(hidden.size()) != n * D)
    fail("mtp_forward: {} tokens with {} hidden values (hidden size {})", n, hidden.size(), D);
  if (pos0 + n > c.max_position) fail("context length exceeded: {} + {} tokens > {}", pos0, n, c.max_position);

  std::vector<float> e(size_t(n * D)), h(size_t(n * D)), eh(size_t(2 * n * D)), x(size_t(n * D));
  for (int64_t i = 0; i < n; ++i) {  // the model's embedding (shared), zero at position 0
    const int32_t t = next[size_t(i)];
    if (t < 0 || t >= c.vocab_size) fail("token id {} outside vocabulary [0, {})", t, c.vocab_size);
    if (pos0 + i > 0) weights_->embed->rows_to_f32(t, t + 1, e.data() + i * D);
  }
  cpu::rms_norm(e.data(), m.enorm.weight.data(), n, D, c.rms_eps, e.data());
  cpu::rms_norm(hidden.data(), m.hnorm.weight.data(), n, D, c.rms_eps, h.data());
  for (int64_t i = 0; i < n; ++i) {
    std::copy(e.begin() + i * D, e.begin() + (i + 1) * D, eh.begin() + 2 * i * D);
    std::copy(h.begin() + i * D, h.begin() + (i + 1) * D, eh.begin() + (2 * i + 1) * D);
  }
  m.eh_proj->forward(eh.data(), n, x.data());

  seq->drop_steps();
  cpu::TokenSelection selection;
  cpu::CpuBlocks blocks(mtp_spec_, &m.layer, rope_, seq->layers.data(), x.data(), n, pos0, selection, nullptr);
  run_decoder_layers(mtp_spec_, blocks, 0, 1);
  seq->length_ = pos0 + n;

  hidden_out.assign(x.end() - D, x.end());
  cpu::rms_norm(hidden_out.data(), m.head_norm.weight.data(), 1, D, c.rms_eps, hidden_out.data());
  std::vector<float> logits(size_t(c.vocab_size));
  (m.head ? *m.head : *weights_->lm_head).forward(hidden_out.data(), 1, logits.data());
  return logits;
}

}  // namespace moesrv
