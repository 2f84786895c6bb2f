#include "model/decoder.h"

#include "util/error.h"

namespace moesrv {

void run_decoder_layers(const ModelSpec& spec, BlockExecutor& ex, int64_t begin, int64_t end) {
  if (begin < 0 || end > spec.num_layers || begin > end)
    fail("decoder: layer range [{}, {}) outside {} layers", begin, end, spec.num_layers);
  for (int64_t l = begin; l < end; ++l) {
    const LayerSpec& L = spec.layers[size_t(l)];
    ex.enter(l, Site::Attention);
    switch (L.mixer) {
      case Mixer::Mla: ex.mla(l, L.indexer); break;
      case Mixer::Gqa: ex.gqa(l); break;
      case Mixer::Kda: ex.kda(l); break;
      case Mixer::GatedDelta: ex.gated_delta(l); break;
    }
    ex.leave(l, Site::Attention);
    ex.enter(l, Site::Ffn);
    if (L.ffn == FfnKind::Moe) ex.moe(l);
    else ex.mlp(l);
    ex.leave(l, Site::Ffn);
  }
}

}  // namespace moesrv
