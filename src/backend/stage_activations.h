// What a pipeline stage hands to the next (runtime/pipeline.h): the residual stream in host memory and the DSA
// selection that a shared-indexer layer at the start of the next stage reuses. Here, below runtime/, so that the
// engines (CpuEngine through its stage, CudaEngine directly) read and write it.
#pragma once
#include <cstdint>
#include <vector>

#include "model/spec.h"

namespace moesrv {

// What travels from stage to stage: the residual stream and, for DSA models, the top-k key selection of the
// last layer that ran its indexer (a "shared" layer at the start of the next stage reuses it).
struct StageActivations {
  int64_t tokens = 0;                           // S
  int64_t pos0 = 0;                             // position of the first token
  std::vector<float> hidden;                    // [S, stream_width] fp32 (the residual streams)
  std::vector<std::vector<int32_t>> selection;  // DSA top-k per token; empty: none yet / dense attention
};

// A device engine's DSA selection row: `width` int32 per token, the token's key positions in order, then -1. The
// width is index_topk, plus the open pool's tail with a k-pool indexer.
int64_t selection_width(const ModelSpec& c);
// Rows [row0, row0 + n) of `sel` into `out` [n][width] (fails when a list is longer than `width`).
void pack_selection(const std::vector<std::vector<int32_t>>& sel, int64_t row0, int64_t n, int64_t width, int32_t* out);
// `rows` [n][width] back into sel[row0 .. row0 + n) (each list: the entries before the first -1); sel must hold them.
void unpack_selection(const int32_t* rows, int64_t n, int64_t width, int64_t row0,
                      std::vector<std::vector<int32_t>>& sel);

}  // namespace moesrv
