// Gated delta rule kernels (KDA / Gated DeltaNet), short causal conv and l2norm; see delta_rule.h.
#include "backend/cpu/delta_rule.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <utility>
#include <vector>

#include "util/thread_pool.h"

#if defined(__SSE__)
#include <xmmintrin.h>
#endif

namespace moesrv::cpu {
namespace {

// 16 floats: GCC/Clang map it to one AVX-512 register (two AVX2 ones elsewhere), whatever the auto-vectoriser prefers.
using vf = float __attribute__((vector_size(64)));
constexpr int VL = 16;
constexpr int64_t CH = 64;        // chunk length
constexpr int64_t SB = 16;        // sub-block of a chunk: the decay reference moves every SB rows
// exp(-span) times a small key component must stay a normal float (FTZ is on): at 85 a 1e-4 component
// underflows to 0 while its partner factor exp(+85) is finite, so the product was lost; 40 leaves 1e-17 headroom.
constexpr float kMaxSpan = 40.f;

inline vf ld(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void st(float* p, vf v) { std::memcpy(p, &v, sizeof v); }
inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// exp(x) to ~1 ulp (Cephes polynomial); branch-free so loops over it vectorise. x is clamped to [-86, 88].
inline float fexp(float x) {
  x = std::min(std::max(x, -86.f), 88.f);
  const float n = (x * 1.44269504f + 12582912.f) - 12582912.f;  // round to nearest integer
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = p * r * r + r + 1.f;
  return std::bit_cast<float>(std::bit_cast<int32_t>(y) + (int32_t(n) << 23));
}

// Decays drive values toward zero; denormal arithmetic is slow on x86, and these values are negligible anyway.
struct FlushDenormals {
#if defined(__SSE__)
  unsigned saved = _mm_getcsr();
  FlushDenormals() { _mm_setcsr(saved | 0x8040); }  // FTZ | DAZ
  ~FlushDenormals() { _mm_setcsr(saved); }
#endif
};

// Inputs are [T, H, d]: one head's token rows are H*d apart, too far for the hardware prefetchers.
inline void prefetch(const float* p, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) __builtin_prefetch(p + i);
}
inline void prefetch_w(float* p, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) __builtin_prefetch(p + i, 1);
}

float dot(const float* a, const float* b, int64_t n) {
  vf acc{};
  int64_t i = 0;
  for (; i + VL <= n; i += VL) acc += ld(a + i) * ld(b + i);
  float s = 0;
  for (int l = 0; l < VL; ++l) s += acc[l];
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

float* scratch(int64_t n) {
  thread_local std::vector<float> buf;
  if (int64_t(buf.size()) < n) buf.resize(size_t(n));
  return buf.data();
}

// ---- small GEMM: C[m, n] = (acc ? C : 0) + op(A)[m, k] B[k, n]; B, C row-major, n a multiple of 16.
// op(A) is A[m, k] row-major (lda) or, with TA, A stored [k, m] (lda). lower: op(A)[i][p] == 0 for p > i.
template <int MR, int NV, bool TA>
void micro(int64_t k, const float* A, int64_t lda, const float* B, int64_t ldb, float* C, int64_t ldc, bool acc) {
  vf c[MR][NV];
  for (int i = 0; i < MR; ++i)
    for (int v = 0; v < NV; ++v) c[i][v] = acc ? ld(C + i * ldc + v * VL) : vf{};
  for (int64_t p = 0; p < k; ++p) {
    vf b[NV];
    for (int v = 0; v < NV; ++v) b[v] = ld(B + p * ldb + v * VL);
    for (int i = 0; i < MR; ++i) {
      const float a = TA ? A[p * lda + i] : A[i * lda + p];
      for (int v = 0; v < NV; ++v) c[i][v] += a * b[v];
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int v = 0; v < NV; ++v) st(C + i * ldc + v * VL, c[i][v]);
}

template <int NV, bool TA>
void gemm_panel(int64_t m, int64_t k, const float* A, int64_t lda, const float* B, int64_t ldb, float* C, int64_t ldc,
                bool acc, bool lower) {
  constexpr int MR = 8;
  int64_t i = 0;
  for (; i + MR <= m; i += MR)
    micro<MR, NV, TA>(lower ? std::min(k, i + MR) : k, TA ? A + i : A + i * lda, lda, B, ldb, C + i * ldc, ldc, acc);
  for (; i < m; ++i)
    micro<1, NV, TA>(lower ? std::min(k, i + 1) : k, TA ? A + i : A + i * lda, lda, B, ldb, C + i * ldc, ldc, acc);
}

template <bool TA = false>
void gemm(int64_t m, int64_t n, int64_t k, const float* A, int64_t lda, const float* B, int64_t ldb, float* C,
          int64_t ldc, bool acc, bool lower = false) {
  // Each 32-column panel of B is packed contiguously first: rows ldb apart would crowd into few L1 sets.
  thread_local std::vector<float> pack;
  if (int64_t(pack.size()) < k * 2 * VL) pack.resize(size_t(k * 2 * VL));
  int64_t j = 0;
  for (; j + 2 * VL <= n; j += 2 * VL) {
    for (int64_t p = 0; p < k; ++p) std::memcpy(pack.data() + p * 2 * VL, B + p * ldb + j, 2 * VL * sizeof(float));
    gemm_panel<2, TA>(m, k, A, lda, pack.data(), 2 * VL, C + j, ldc, acc, lower);
  }
  for (; j < n; j += VL) gemm_panel<1, TA>(m, k, A, lda, B + j, ldb, C + j, ldc, acc, lower);
}

// ---- chunked form, one head over all T tokens. Padded widths kp, vp (multiples of 16); padding is zero.
struct ChunkBufs {
  int64_t kp, vp, ldr;
  float *S, *K, *Q, *G, *Rk, *Rq, *Qe, *KT, *GT, *CT, *A, *Aqk, *RHS, *UW, *O, *bt, *ref;
  ChunkBufs(int64_t dk, int64_t dv) : kp(round_up(dk, VL)), vp(round_up(dv, VL)), ldr(kp + vp) {
    float* p = scratch(kp * vp + 9 * CH * kp + 2 * CH * CH + 2 * CH * ldr + CH * vp + CH + kp);
    auto take = [&p](int64_t n) { return std::exchange(p, p + n); };
    S = take(kp * vp);
    for (float** b : {&K, &Q, &G, &Rk, &Rq, &Qe, &KT, &GT, &CT}) *b = take(CH * kp);
    A = take(CH * CH), Aqk = take(CH * CH), RHS = take(CH * ldr), UW = take(CH * ldr);
    O = take(CH * vp), bt = take(CH), ref = take(kp);
  }
};

// dst[c][s] = src[s][c] for s < rows, c < cols (multiples of 16), by 16x16 tiles that stay in L1.
void transpose(const float* src, int64_t lds, int64_t rows, int64_t cols, float* dst, int64_t ldd) {
  for (int64_t s0 = 0; s0 < rows; s0 += 16)
    for (int64_t c0 = 0; c0 < cols; c0 += 16)
      for (int64_t c = c0; c < c0 + 16; ++c)
        for (int64_t s = s0; s < s0 + 16; ++s) dst[c * ldd + s] = src[s * lds + c];
}

void chunked_head(const DeltaRuleShape& sh, int64_t T, int64_t h, const float* q, const float* k, const float* v,
                  const float* g, const float* beta, float* state, float* out) {
  const int64_t H = sh.heads, dk = sh.dk, dv = sh.dv;
  ChunkBufs w(dk, dv);
  const int64_t kp = w.kp, vp = w.vp, ldr = w.ldr;
  const bool padded = kp != dk || vp != dv;  // else S and O work in place on state and out
  float *S = padded ? w.S : state, *K = w.K, *Q = w.Q, *G = w.G, *A = w.A, *Aqk = w.Aqk, *RHS = w.RHS, *UW = w.UW;
  float* bt = w.bt;
  if (padded) {
    std::fill(S, S + kp * vp, 0.f);
    for (int64_t c = 0; c < dk; ++c) std::copy_n(state + c * dv, dv, S + c * vp);
  }

  for (int64_t t0 = 0; t0 < T; t0 += CH) {
    const int64_t n = std::min(CH, T - t0), nr = round_up(n, SB);
    // Gather the chunk (rows n..nr are zero tokens) and the cumulative log decay G.
    for (int64_t r = 0; r < nr; ++r) {
      float *Kr = K + r * kp, *Qr = Q + r * kp, *Gr = G + r * kp, *Vr = RHS + r * ldr;
      std::fill(Kr + dk, Kr + kp, 0.f), std::fill(Qr + dk, Qr + kp, 0.f), std::fill(Vr + dv, Vr + vp, 0.f);
      std::fill(Gr + dk, Gr + kp, 0.f);
      if (r >= n) {
        bt[r] = 0;
        std::fill(Kr, Kr + dk, 0.f), std::fill(Qr, Qr + dk, 0.f), std::fill(Vr, Vr + dv, 0.f);
        std::copy_n(Gr - kp, dk, Gr);
        continue;
      }
      const int64_t ti = (t0 + r) * H + h;
      std::copy_n(k + ti * dk, dk, Kr), std::copy_n(q + ti * dk, dk, Qr);
      const float b = bt[r] = beta[ti];
      for (int64_t j = 0; j < dv; ++j) Vr[j] = b * v[ti * dv + j];
      if (sh.per_channel_decay) std::copy_n(g + ti * dk, dk, Gr);
      else std::fill(Gr, Gr + dk, g[ti]);
      if (r)
        for (int64_t c = 0; c < dk; ++c) Gr[c] += Gr[c - kp];
    }
    // Inter-chunk factors: Qe = q exp(G); RHS right half = -beta k exp(G) (so T RHS gives -W).
    for (int64_t r = 0; r < nr; ++r) {
      const float *Kr = K + r * kp, *Qr = Q + r * kp, *Gr = G + r * kp;
      float *Qe = w.Qe + r * kp, *Wr = RHS + r * ldr + vp;
      const float nb = -bt[r];
      for (int64_t c = 0; c < kp; ++c) {
        const float e = fexp(Gr[c]);
        Qe[c] = Qr[c] * e;
        Wr[c] = nb * Kr[c] * e;
      }
    }
    transpose(K, kp, nr, kp, w.KT, CH), transpose(G, kp, nr, kp, w.GT, CH);

    // Intra-chunk A (keys) and Aqk (queries) by sub-blocks of SB rows. With ref = G just before the sub-block,
    // exp(G_r - G_s) = exp(G_r - ref) * exp(ref - G_s): the row factor is <= 1, the column factor is <= 1 for
    // earlier sub-blocks and <= exp(span) within this one; a span > kMaxSpan falls back to direct exps there.
    std::fill(A, A + nr * CH, 0.f), std::fill(Aqk, Aqk + nr * CH, 0.f);
    for (int64_t b0 = 0; b0 < nr; b0 += SB) {
      for (int64_t tn = t0 + CH + b0; tn < std::min(T, t0 + CH + b0 + SB); ++tn) {  // prefetch the next chunk
        const int64_t ti = tn * H + h;
        prefetch(q + ti * dk, dk), prefetch(k + ti * dk, dk), prefetch(v + ti * dv, dv);
        if (sh.per_channel_decay) prefetch(g + ti * dk, dk);
      }
      const int64_t ncol = b0 + SB;
      float* ref = w.ref;
      for (int64_t c = 0; c < kp; ++c) ref[c] = b0 ? G[(b0 - 1) * kp + c] : 0.f;
      float span = 0;
      for (int64_t c = 0; c < kp; ++c) span = std::max(span, ref[c] - G[(b0 + SB - 1) * kp + c]);
      for (int64_t r = b0; r < b0 + SB; ++r)
        for (int64_t c = 0; c < kp; ++c) {
          const float e = fexp(G[r * kp + c] - ref[c]);
          w.Rk[r * kp + c] = K[r * kp + c] * e;
          w.Rq[r * kp + c] = Q[r * kp + c] * e;
        }
      for (int64_t c = 0; c < kp; ++c) {
        const float *kt = w.KT + c * CH, *gt = w.GT + c * CH;
        float* ct = w.CT + c * CH;
        for (int64_t s = 0; s < ncol; ++s) ct[s] = kt[s] * fexp(ref[c] - gt[s]);
      }
      gemm(SB, ncol, kp, w.Rk + b0 * kp, kp, w.CT, CH, A + b0 * CH, CH, false);
      gemm(SB, ncol, kp, w.Rq + b0 * kp, kp, w.CT, CH, Aqk + b0 * CH, CH, false);
      if (span > kMaxSpan) {
        for (int64_t r = b0; r < b0 + SB; ++r)
          for (int64_t s = b0; s <= r; ++s) {
            float ak = 0, aq = 0;
            for (int64_t c = 0; c < dk; ++c) {
              const float e = K[s * kp + c] * fexp(G[r * kp + c] - G[s * kp + c]);
              ak += K[r * kp + c] * e;
              aq += Q[r * kp + c] * e;
            }
            A[r * CH + s] = ak, Aqk[r * CH + s] = aq;
          }
      }
      for (int64_t r = b0; r < b0 + SB; ++r) {
        for (int64_t s = 0; s < ncol; ++s) {
          A[r * CH + s] = s < r ? -bt[r] * A[r * CH + s] : 0.f;
          if (s > r) Aqk[r * CH + s] = 0.f;
        }
      }
    }
    // T = (I - A)^-1 by forward substitution, in place (rows of A strictly lower, like transformers' loop).
    // Row m is zero from column m on, so whole 16-wide vectors can be added.
    for (int64_t i = 1; i < nr; ++i) {
      float* Ai = A + i * CH;
      for (int64_t m = 1; m < i; ++m) {
        const float a = Ai[m];
        const float* Am = A + m * CH;
        for (int64_t s = 0; s < m; s += VL) st(Ai + s, ld(Ai + s) + a * ld(Am + s));
      }
    }
    for (int64_t i = 0; i < nr; ++i) A[i * CH + i] = 1.f;

    // [U | -W] = T [beta v | -beta k exp(G)];  Vn = U - W S;  O = Qe S + Aqk Vn.
    gemm(nr, ldr, nr, A, CH, RHS, ldr, UW, ldr, false, true);
    gemm(nr, vp, kp, UW + vp, ldr, S, vp, UW, ldr, true);
    float* O = padded ? w.O : out + (t0 * H + h) * dv;
    const int64_t ldo = padded ? vp : H * dv;
    gemm(n, vp, kp, w.Qe, kp, S, vp, O, ldo, false);
    gemm(n, vp, nr, Aqk, CH, UW, ldr, O, ldo, true, true);
    if (padded)
      for (int64_t r = 0; r < n; ++r) std::copy_n(w.O + r * vp, dv, out + ((t0 + r) * H + h) * dv);

    // S = diag(exp(G_last)) S + (k exp(G_last - G))^T Vn.
    const float* Gl = G + (nr - 1) * kp;
    for (int64_t s = 0; s < nr; ++s)
      for (int64_t c = 0; c < kp; ++c) w.Rk[s * kp + c] = K[s * kp + c] * fexp(Gl[c] - G[s * kp + c]);
    for (int64_t c = 0; c < kp; ++c) {
      const float e = fexp(Gl[c]);
      for (int64_t j = 0; j < vp; ++j) S[c * vp + j] *= e;
    }
    gemm<true>(kp, vp, nr, w.Rk, kp, UW, ldr, S, vp, true);
  }
  if (padded)
    for (int64_t c = 0; c < dk; ++c) std::copy_n(S + c * vp, dv, state + c * dv);
}

// ---- recurrence, one head. Columns of S evolve independently, so a block of columns runs through a tile of
// tokens while it stays in L1. Per token: u = S^T (e k), o' = S^T (e q) from the old S in one read pass,
// then S = diag(e) S + k delta^T in one read-write pass, and o = o' + (k.q) delta.
struct Tile {
  const float *e, *ek, *eq, *k, *beta, *kq;  // per token: [dk] x4, scalars x2
  int64_t n, dk;
};

template <int NV, typename Pf>
void rec_cols(const Tile& t, float* S, int64_t lds, const float* V, int64_t ldv, float* O, int64_t ldo, Pf&& pf) {
  const int64_t dk = t.dk;
  for (int64_t i = 0; i < t.n; ++i) {
    pf(i);
    const float *e = t.e + i * dk, *ek = t.ek + i * dk, *eq = t.eq + i * dk, *kk = t.k + i * dk;
    vf u[2][NV] = {}, o[2][NV] = {}, d[NV];  // even / odd rows: twice the independent FMA chains
    int64_t c = 0;
    for (; c + 2 <= dk; c += 2)
      for (int r = 0; r < 2; ++r)
        for (int v = 0; v < NV; ++v) {
          const vf s = ld(S + (c + r) * lds + v * VL);
          u[r][v] += ek[c + r] * s;
          o[r][v] += eq[c + r] * s;
        }
    for (; c < dk; ++c)
      for (int v = 0; v < NV; ++v) {
        const vf s = ld(S + c * lds + v * VL);
        u[0][v] += ek[c] * s;
        o[0][v] += eq[c] * s;
      }
    for (int v = 0; v < NV; ++v) u[0][v] += u[1][v], o[0][v] += o[1][v];
    for (int v = 0; v < NV; ++v) d[v] = t.beta[i] * (ld(V + i * ldv + v * VL) - u[0][v]);
    for (int64_t c = 0; c < dk; ++c) {
      const vf ec = vf{} + e[c], kc = vf{} + kk[c];  // before the stores, which might alias them
      for (int v = 0; v < NV; ++v) {
        float* p = S + c * lds + v * VL;
        st(p, ld(p) * ec + kc * d[v]);
      }
    }
    for (int v = 0; v < NV; ++v) st(O + i * ldo + v * VL, o[0][v] + t.kq[i] * d[v]);
  }
}

void recurrent_head(const DeltaRuleShape& sh, int64_t T, int64_t h, const float* q, const float* k, const float* v,
                    const float* g, const float* beta, float* S, float* out) {
  const int64_t H = sh.heads, dk = sh.dk, dv = sh.dv, TT = std::min<int64_t>(T, CH);
  float* p = scratch(4 * TT * dk + 2 * TT + dk * VL + 2 * TT * VL + dk * 4 * VL);
  float *E = p, *EK = E + TT * dk, *EQ = EK + TT * dk, *KK = EQ + TT * dk, *B = KK + TT * dk, *KQ = B + TT;
  float *St = KQ + TT, *Vt = St + dk * VL, *Ot = Vt + TT * VL;  // tail columns (dv % 16), zero-padded
  float* Pk = Ot + TT * VL;                                     // a packed 64-column block
  for (int64_t t0 = 0; t0 < T; t0 += TT) {
    const int64_t n = std::min(TT, T - t0);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t ti = (t0 + i) * H + h;
      const float *qi = q + ti * dk, *ki = k + ti * dk;
      float *e = E + i * dk, *ek = EK + i * dk, *eq = EQ + i * dk;
      if (sh.per_channel_decay)
        for (int64_t c = 0; c < dk; ++c) e[c] = fexp(g[ti * dk + c]);
      else std::fill(e, e + dk, fexp(g[ti]));
      for (int64_t c = 0; c < dk; ++c) ek[c] = e[c] * ki[c], eq[c] = e[c] * qi[c];
      std::copy_n(ki, dk, KK + i * dk);
      B[i] = beta[ti], KQ[i] = dot(ki, qi, dk);
    }
    const Tile tile{E, EK, EQ, KK, B, KQ, n, dk};
    const float* V = v + (t0 * H + h) * dv;
    float* O = out + (t0 * H + h) * dv;
    const int64_t ld = H * dv;
    // While the first column block runs, prefetch the next tile's token rows.
    auto pf = [&](int64_t i) {
      if (const int64_t t = t0 + TT + i; t < T) {
        const int64_t ti = t * H + h;
        prefetch(q + ti * dk, dk), prefetch(k + ti * dk, dk), prefetch(v + ti * dv, dv);
        prefetch_w(out + ti * dv, dv);
        if (sh.per_channel_decay) prefetch(g + ti * dk, dk);
      }
    };
    auto none = [](int64_t) {};
    bool first = true;
    int64_t j = 0;
    for (; j + 4 * VL <= dv; j += 4 * VL, first = false) {
      if (n >= 4) {  // pack the column block: rows dv apart can crowd into few cache sets
        constexpr int64_t w = 4 * VL;
        for (int64_t c = 0; c < dk; ++c) std::copy_n(S + c * dv + j, w, Pk + c * w);
        first ? rec_cols<4>(tile, Pk, w, V + j, ld, O + j, ld, pf)
              : rec_cols<4>(tile, Pk, w, V + j, ld, O + j, ld, none);
        for (int64_t c = 0; c < dk; ++c) std::copy_n(Pk + c * w, w, S + c * dv + j);
      } else {
        rec_cols<4>(tile, S + j, dv, V + j, ld, O + j, ld, none);
      }
    }
    if (j + 2 * VL <= dv) rec_cols<2>(tile, S + j, dv, V + j, ld, O + j, ld, none), j += 2 * VL;
    if (j + VL <= dv) rec_cols<1>(tile, S + j, dv, V + j, ld, O + j, ld, none), j += VL;
    if (const int64_t wt = dv - j; wt > 0) {
      std::fill(St, St + dk * VL, 0.f), std::fill(Vt, Vt + n * VL, 0.f);
      for (int64_t c = 0; c < dk; ++c) std::copy_n(S + c * dv + j, wt, St + c * VL);
      for (int64_t i = 0; i < n; ++i) std::copy_n(V + i * ld + j, wt, Vt + i * VL);
      rec_cols<1>(tile, St, VL, Vt, VL, Ot, VL, none);
      for (int64_t c = 0; c < dk; ++c) std::copy_n(St + c * VL, wt, S + c * dv + j);
      for (int64_t i = 0; i < n; ++i) std::copy_n(Ot + i * VL, wt, O + i * ld + j);
    }
  }
}

template <typename Fn>
void over_heads(int64_t H, Fn&& fn) {
  ThreadPool::global().parallel_for(H, [&](int64_t b, int64_t e) {
    FlushDenormals ftz;
    for (int64_t h = b; h < e; ++h) fn(h);
  });
}

}  // namespace

void delta_rule_recurrent(const DeltaRuleShape& s, int64_t T, const float* q, const float* k, const float* v,
                          const float* g, const float* beta, float* state, float* out) {
  if (T <= 0) return;
  over_heads(s.heads, [&](int64_t h) { recurrent_head(s, T, h, q, k, v, g, beta, state + h * s.dk * s.dv, out); });
}

void delta_rule_chunked(const DeltaRuleShape& s, int64_t T, const float* q, const float* k, const float* v,
                        const float* g, const float* beta, float* state, float* out) {
  if (T <= 0) return;
  over_heads(s.heads, [&](int64_t h) { chunked_head(s, T, h, q, k, v, g, beta, state + h * s.dk * s.dv, out); });
}

void causal_conv1d_silu(const float* x, int64_t T, int64_t C, const float* w, int64_t K, float* state, float* y) {
  if (T <= 0) return;
  const int64_t P = K - 1;
  std::vector<float> wt(size_t(K * C));  // taps transposed to [K, C] so the channel loop is contiguous
  for (int64_t c = 0; c < C; ++c)
    for (int64_t j = 0; j < K; ++j) wt[size_t(j * C + c)] = w[c * K + j];
  ThreadPool::global().parallel_for(
      T,
      [&](int64_t b, int64_t e) {
        for (int64_t t = b; t < e; ++t) {
          float* yt = y + t * C;
          std::fill(yt, yt + C, 0.f);
          for (int64_t j = 0; j < K; ++j) {
            const int64_t i = t - P + j;  // input row; < 0 reads the carried state
            const float *xr = i < 0 ? state + (P + i) * C : x + i * C, *wj = wt.data() + j * C;
            for (int64_t c = 0; c < C; ++c) yt[c] += wj[c] * xr[c];
          }
          for (int64_t c = 0; c < C; ++c) yt[c] = yt[c] / (1.f + fexp(-yt[c]));
        }
      },
      std::max<int64_t>(1, 16384 / std::max<int64_t>(1, C * K)));
  if (P <= 0) return;
  if (T >= P) {
    std::memcpy(state, x + (T - P) * C, size_t(P * C) * sizeof(float));
  } else {
    std::memmove(state, state + T * C, size_t((P - T) * C) * sizeof(float));
    std::memcpy(state + (P - T) * C, x, size_t(T * C) * sizeof(float));
  }
}

void l2_normalize_rows(float* x, int64_t rows, int64_t n, float eps) {
  ThreadPool::global().parallel_for(
      rows,
      [&](int64_t b, int64_t e) {
        for (int64_t r = b; r < e; ++r) {
          float* p = x + r * n;
          vf acc{};
          int64_t i = 0;
          for (; i + VL <= n; i += VL) acc += ld(p + i) * ld(p + i);
          float ss = 0;
          for (int l = 0; l < VL; ++l) ss += acc[l];
          for (; i < n; ++i) ss += p[i] * p[i];
          const float d = std::sqrt(ss + eps);
          for (i = 0; i < n; ++i) p[i] /= d;
        }
      },
      std::max<int64_t>(1, 16384 / std::max<int64_t>(1, n)));
}

}  // namespace moesrv::cpu
