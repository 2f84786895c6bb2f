// One EXL3-quantized linear as stored: trellis tiles + input/output sign-and-scale vectors.
// Stored layout is W (in x out) = diag(suh) . H . W_hat . H . diag(svh), in/out padded to multiples of 128,
// W_hat decoded from trellis[in/16][out/16][16*K] (see exl3_tile.h, exl3_codebook.h).
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "format/exl3_codebook.h"
#include "format/package.h"

namespace moesrv {

struct Exl3Weights {
  int K = 0;                                    // bits per weight, 1..8
  Exl3Codebook codebook = Exl3Codebook::Inst3;
  int64_t in_pad = 0, out_pad = 0;              // stored shape, multiples of 128
  const uint16_t* trellis = nullptr;            // [in_pad/16][out_pad/16][16*K]
  std::vector<float> suh, svh;                  // [in_pad], [out_pad]
  std::shared_ptr<const void> owner;            // keeps `trellis` alive when it is not in a mapped package

  int64_t tiles_k() const { return in_pad / 16; }
  int64_t tiles_n() const { return out_pad / 16; }
  const uint16_t* tile(int64_t kt, int64_t nt) const { return trellis + (kt * tiles_n() + nt) * 16 * K; }
  size_t trellis_bytes() const { return size_t(in_pad / 16) * size_t(out_pad / 16) * 32 * size_t(K); }
  const float* table() const { return exl3_codebook_table(codebook); }
};

// Reads `<prefix>.trellis` with `.suh`/`.svh` (or legacy packed-sign `.su`/`.sv`) and the codebook marker
// (`.mcg`, `.mul1`, neither = 3INST). Throws naming the tensor when a piece is missing or shapes disagree.
Exl3Weights load_exl3_weights(const ModelPackage& pkg, const std::string& prefix);

// Legacy packed signs: bit j of int16 word i is element 16*i + j, set = -1.
std::vector<float> exl3_unpack_signs(const uint16_t* words, int64_t n_elems);

// Rotated-basis weights W_hat[:, n0:n1) (n0, n1 multiples of 16) -> out, row-major [in_pad][n1 - n0].
void exl3_decode_rotated(const Exl3Weights& w, int64_t n0, int64_t n1, float* out);

// Original-basis weights transposed, rows [o0, o1) of W^T (out x in), first `in_cols` inputs of each row:
// out[(o - o0) * in_cols + i] = W[i][o].
void exl3_dequant_out_rows(const Exl3Weights& w, int64_t o0, int64_t o1, int64_t in_cols, float* out);

}  // namespace moesrv
