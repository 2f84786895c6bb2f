// The gated delta rule over long token runs (prefill) in its chunked (WY) form, chunks of 64 tokens, fp32, as
// cpu::delta_rule_chunked computes it. Per chunk and head, with G the cumulative log decay inside the chunk:
//   A[r][s] = -beta_r sum_c k_r[c] k_s[c] exp(G_r[c] - G_s[c]) (s < r), Aqk[r][s] = the same with q_r (s <= r);
//   [U | -W] = (I - A)^-1 [beta v | -beta k exp(G)];  Vn = U - W S;  O = (q exp(G)) S + Aqk Vn;
//   S = diag(exp(G_last)) S + (k exp(G_last - G))^T Vn.
// Two kernels per segment of chunks: dc_prep_kernel (every chunk and head at once: everything up to U and W, which
// do not depend on the state) into scratch, then dc_state_kernel (per head and 64 state columns, the chunks in
// order: Vn, O and the state update). The recurrence kernels in linear_attention.cu spend a sequential step per
// token; here the sequential part is three small matrix products per 64 tokens.
#include <algorithm>

#include "backend/cuda/glm5_next_kernels.h"
#include "backend/cuda/kernel_util.cuh"
#include "backend/cuda/pdl.cuh"

namespace moesrv::cuda {

namespace {

constexpr int kCh = 64;  // tokens per chunk
constexpr int kDcThreads = 256;

// One (chunk, head)'s scratch, in floats; its first four parts in dc_state_kernel's shared-memory order.
template <int DK, int DV>
struct DcLayout {
  static constexpr int wn = 0;               // WnT [DK][64]: -W, transposed
  static constexpr int qe = wn + DK * kCh;   // QeT [DK][64]: q exp(G), transposed
  static constexpr int kd = qe + DK * kCh;   // Kd [64][DK]: k exp(G_last - G)
  static constexpr int aqk = kd + kCh * DK;  // AqkT [64 s][64 r] (zero where s > r)
  static constexpr int u = aqk + kCh * kCh;  // U [64][DV]
  static constexpr int egl = u + kCh * DV;   // exp(G_last) [DK]
  static constexpr int size = egl + DK;      // a multiple of 4 (16-byte copies)
  static_assert(size % 4 == 0, "16-byte aligned chunk records");
};

constexpr int kSub = 16, kSubs = kCh / kSub;  // sub-blocks of rows for the factorized A
constexpr float kMaxSpan = 80.0f;             // exp(80) ~ 5.5e34: a factor the diagonal sub-blocks may take

// The chunk-local kernel takes the channels in passes of H <= 64 (their shared memory, ~103 KB at dk 128, lets two
// blocks share an SM); the scores accumulate over the passes in registers. After the passes the staged values are
// dead and the solve keeps its columns [64][DV + DK] (xs) where they were.
template <int DK, int DV, bool Factor>
struct DcPrepSmem {
  static constexpr int H = DK < 64 ? DK : 64;  // channels per pass
  static constexpr int P = H + 1;              // k / q / G row pitch (odd: column walks are conflict-free)
  static constexpr int PA = kCh + 4;           // A^T row pitch (rows of 16-byte loads)
  static constexpr int NC = DV + DK;           // the solve's columns
  static constexpr int as = 0, bs = as + kCh * PA, ks = bs + kCh, qs = ks + kCh * P, gs = qs + kCh * P;
  static constexpr int ein = gs + kCh * P, kout = ein + kCh * P, f = kout + kCh * P;  // Factor only
  static constexpr int direct = f + kSubs * (kSubs + 1) / 2 * H;
  static constexpr int xs = ks;
  static constexpr size_t floats = std::max(Factor ? size_t(direct) + kSubs : size_t(ein), size_t(xs + kCh * NC));
};

// A[r][s] (keys, scaled by -beta_r below) and Aqk[r][s] (queries) over the pairs of a 4 x 4 tile, added up over one
// pass's H channels from k / q / G in shared memory. Direct: exp(G_r - G_s) per channel and pair. Factored (Factor):
// with R_b = G at the row before sub-block b (0 for b = 0) and E_b = G at b's last row, exp(G_r - G_s) = Ein_r F Kout_s
// / k_s, where Ein_r = exp(G_r - R_bi) <= 1, Kout_s = k_s exp(E_bj - G_s) <= |k_s|, and F = exp(R_bi - E_bj) <= 1 for
// bj < bi or exp(R_b - E_b) (the sub-block's span, <= exp(kMaxSpan); wider spans take the direct form) on the diagonal.
template <int DK, bool Factor>
__device__ __forceinline__ void dc_tile_scores(const float* sm, int r0, int s0, float (&ak)[4][4], float (&aq)[4][4]) {
  using M = DcPrepSmem<DK, DK, Factor>;
  constexpr int P = M::P, H = M::H;
  const float *Ks = sm + M::ks, *Qs = sm + M::qs, *Gs = sm + M::gs;
  const int bi = r0 / kSub, bj = s0 / kSub;
  if constexpr (Factor) {
    if (bi != bj || sm[M::direct + bi] == 0.0f) {
      const float *Ein = sm + M::ein, *Ko = sm + M::kout, *F = sm + M::f + (bi * (bi + 1) / 2 + bj) * H;
      for (int c = 0; c < H; ++c) {
        float kr[4], qr[4], ts[4];
        const float fc = F[c];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const float e = Ein[(r0 + i) * P + c];
          kr[i] = Ks[(r0 + i) * P + c] * e, qr[i] = Qs[(r0 + i) * P + c] * e;
          ts[i] = Ko[(s0 + i) * P + c] * fc;
        }
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
          for (int j = 0; j < 4; ++j) ak[i][j] += kr[i] * ts[j], aq[i][j] += qr[i] * ts[j];
      }
      return;
    }
  }
  for (int c = 0; c < H; ++c) {
    float kr[4], qr[4], gr[4], ks[4], gs[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      kr[i] = Ks[(r0 + i) * P + c], qr[i] = Qs[(r0 + i) * P + c], gr[i] = Gs[(r0 + i) * P + c];
      ks[i] = Ks[(s0 + i) * P + c], gs[i] = Gs[(s0 + i) * P + c];
    }
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float t = ks[j] * expf(fminf(gr[i] - gs[j], 0.0f));  // (s > r on the diagonal: discarded)
        ak[i][j] += kr[i] * t;
        aq[i][j] += qr[i] * t;
      }
  }
}

// Everything of a chunk that does not depend on the state. Block (chunk, head); 8 warps, two blocks per SM. Each pass
// over H channels stages k / q / G, adds their share of A / Aqk to the tile sums and writes their QeT, Kd, exp(G_last)
// and the W right-hand side (-beta k exp(G), into WnT: the solve reads it back and writes -W over it).
template <int DK, int DV, bool Factor>
__global__ void __launch_bounds__(kDcThreads, 2) dc_prep_kernel(DeltaRuleArgs a, int t_first, float* scratch) {
  using L = DcLayout<DK, DV>;
  using M = DcPrepSmem<DK, DV, Factor>;
  constexpr int H = M::H, P = M::P, PA = M::PA, NC = M::NC;
  static_assert(DK % H == 0, "whole passes");
  static_assert(DK == DV, "dc_tile_scores' layout");
  extern __shared__ __align__(16) float dc_sm[];
  float *Ks = dc_sm + M::ks, *Qs = dc_sm + M::qs, *Gs = dc_sm + M::gs, *As = dc_sm + M::as, *bs = dc_sm + M::bs;
  pdl_enter();
  const int h = blockIdx.y, hk = h / a.qk_group, tid = threadIdx.x;
  const int t0 = t_first + int(blockIdx.x) * kCh, n = min(kCh, a.T - t0);
  float* rec = scratch + (int64_t(blockIdx.x) * a.heads + h) * L::size;
  if (tid < kCh) bs[tid] = tid < n ? a.beta[int64_t(t0 + tid) * a.heads + h] : 0.0f;

  // this thread's 4 x 4 tile of A / Aqk on or below the diagonal (136 tiles, triangular order)
  int ty = 0;
  while ((ty + 1) * (ty + 2) / 2 <= tid) ++ty;
  const int tx = tid - ty * (ty + 1) / 2, tr = 4 * ty, ts = 4 * tx;
  const bool active = tid < 136;
  float ak[4][4] = {}, aq[4][4] = {};

  // Element i = tid + m * kDcThreads of a [64][H] array, m < kPer: the loops below have compile-time trip counts,
  // and the loads go out kBatch at a time before their stores (one global round trip per batch, not per element).
  constexpr int kPer = kCh * H / kDcThreads, kBatch = 8;
  static_assert(kPer % kBatch == 0, "whole batches");
  for (int cb = 0; cb < DK; cb += H) {           // this pass's channels [cb, cb + H)
    if (cb) __syncthreads();                     // the previous pass is done with the staged values
    for (int m0 = 0; m0 < kPer; m0 += kBatch) {  // rows past the end: zero tokens, G stays
      float kv[kBatch], qv[kBatch], gv[kBatch];
#pragma unroll
      for (int m = 0; m < kBatch; ++m) {
        const int i = tid + (m0 + m) * kDcThreads, r = i / H, c = cb + i % H;
        kv[m] = qv[m] = gv[m] = 0.0f;
        if (r < n) {
          const int64_t t = t0 + r, qk = t * a.qk_stride + int64_t(hk) * DK + c, ti = t * a.heads + h;
          kv[m] = a.k[qk], qv[m] = a.q[qk];
          gv[m] = a.per_channel_decay ? a.g[ti * DK + c] : a.g[ti];
        }
      }
#pragma unroll
      for (int m = 0; m < kBatch; ++m) {
        const int i = tid + (m0 + m) * kDcThreads, r = i / H, c = i % H;
        Ks[r * P + c] = kv[m], Qs[r * P + c] = qv[m], Gs[r * P + c] = gv[m];
      }
    }
    __syncthreads();
    for (int c = tid; c < H; c += kDcThreads) {  // G: the cumulative sum over the chunk's rows
      float acc = 0.0f;
      for (int r = 0; r < kCh; ++r) acc = Gs[r * P + c] += acc;
    }
    if constexpr (Factor)
      if (tid < kSubs) dc_sm[M::direct + tid] = 0.0f;
    __syncthreads();
    if constexpr (Factor) {  // Ein, Kout, the sub-block pairs' factors F, the sub-blocks whose span is too wide
      auto R = [&](int b, int c) { return b ? Gs[(kSub * b - 1) * P + c] : 0.0f; };
      auto E = [&](int b, int c) { return Gs[(kSub * b + kSub - 1) * P + c]; };
#pragma unroll 4
      for (int m = 0; m < kPer; ++m) {
        const int i = tid + m * kDcThreads, r = i / H, c = i % H, b = r / kSub;
        dc_sm[M::ein + r * P + c] = expf(Gs[r * P + c] - R(b, c));
        dc_sm[M::kout + r * P + c] = Ks[r * P + c] * expf(E(b, c) - Gs[r * P + c]);
      }
      for (int i = tid; i < kSubs * (kSubs + 1) / 2 * H; i += kDcThreads) {
        const int p = i / H, c = i % H;
        int bi = 0;
        while ((bi + 1) * (bi + 2) / 2 <= p) ++bi;
        const int bj = p - bi * (bi + 1) / 2;
        const float span = R(bi, c) - E(bj, c);
        dc_sm[M::f + i] = expf(fminf(span, kMaxSpan));
        if (bi == bj && span > kMaxSpan) dc_sm[M::direct + bi] = 1.0f;  // (benign race: all write 1)
      }
      __syncthreads();
    }
    if (active) dc_tile_scores<DK, Factor>(dc_sm, tr, ts, ak, aq);

#pragma unroll 4
    for (int m = 0; m < kPer; ++m) {  // QeT and the W right-hand side: consecutive threads, consecutive r
      const int i = tid + m * kDcThreads, c = i / kCh, r = i % kCh;
      const float e = expf(Gs[r * P + c]);
      rec[L::qe + cb * kCh + i] = Qs[r * P + c] * e;
      rec[L::wn + cb * kCh + i] = -bs[r] * Ks[r * P + c] * e;
    }
#pragma unroll 4
    for (int m = 0; m < kPer; ++m) {
      const int i = tid + m * kDcThreads, r = i / H, c = i % H;
      rec[L::kd + r * DK + cb + c] = Ks[r * P + c] * expf(Gs[(kCh - 1) * P + c] - Gs[r * P + c]);
    }
    for (int c = tid; c < H; c += kDcThreads) rec[L::egl + cb + c] = expf(Gs[(kCh - 1) * P + c]);
  }

  if (active)
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int r = tr + i, s = ts + j;
        As[s * PA + r] = s < r ? -bs[r] * ak[i][j] : 0.0f;  // (transposed: A^T)
        rec[L::aqk + s * kCh + r] = s <= r ? aq[i][j] : 0.0f;
      }
  for (int i = tid; i < kCh * kCh; i += kDcThreads) {  // the tiles above the diagonal: zeros
    const int r = i / kCh, s = i % kCh;
    if (s / 4 > r / 4) As[s * PA + r] = 0.0f, rec[L::aqk + s * kCh + r] = 0.0f;
  }
  __syncthreads();  // (also makes the block's W right-hand sides in rec visible to the solving threads)

  // [U | -W]: one column j of [beta v | -beta k exp(G)] per thread, solved through I - A (x_i = rhs_i + sum_{m < i}
  // A[i][m] x_m) in blocks of 16 rows: a block's rows in registers take the earlier blocks' solved rows from xs (the
  // thread's own column: no barriers), then the block's own triangle column by column.
  float* X = dc_sm + M::xs;
  for (int j = tid; j < NC; j += kDcThreads) {
    if (j < DV) {
#pragma unroll 8
      for (int r = 0; r < kCh; ++r)
        X[r * NC + j] = r < n ? bs[r] * a.v[int64_t(t0 + r) * a.v_stride + int64_t(h) * DV + j] : 0.0f;
    } else {  // written by this block's passes above
      const float4* w4 = reinterpret_cast<const float4*>(rec + L::wn + (j - DV) * kCh);
#pragma unroll 4
      for (int r = 0; r < kCh; r += 4) {
        const float4 v = w4[r / 4];
        X[r * NC + j] = v.x, X[(r + 1) * NC + j] = v.y, X[(r + 2) * NC + j] = v.z, X[(r + 3) * NC + j] = v.w;
      }
    }
#pragma unroll 1
    for (int b0 = 0; b0 < kCh; b0 += kSub) {
      float x[kSub];
#pragma unroll
      for (int i = 0; i < kSub; ++i) x[i] = X[(b0 + i) * NC + j];
#pragma unroll 2
      for (int m = 0; m < b0; ++m) {  // the solved rows above the block
        const float xm = X[m * NC + j];
        const float4* a4 = reinterpret_cast<const float4*>(As + m * PA + b0);
#pragma unroll
        for (int q = 0; q < kSub / 4; ++q) {
          const float4 v = a4[q];
          x[4 * q] += v.x * xm, x[4 * q + 1] += v.y * xm, x[4 * q + 2] += v.z * xm, x[4 * q + 3] += v.w * xm;
        }
      }
#pragma unroll
      for (int m = 0; m < kSub - 1; ++m) {  // the block's own triangle (A^T row b0 + m, entries below the diagonal)
        const float* am = As + (b0 + m) * PA + b0;
#pragma unroll
        for (int i = m + 1; i < kSub; ++i) x[i] += am[i] * x[m];
      }
#pragma unroll
      for (int i = 0; i < kSub; ++i) X[(b0 + i) * NC + j] = x[i];
    }
    if (j < DV) {
#pragma unroll 8
      for (int r = 0; r < kCh; ++r) rec[L::u + r * DV + j] = X[r * NC + j];
    } else {
      float4* w4 = reinterpret_cast<float4*>(rec + L::wn + (j - DV) * kCh);
#pragma unroll 4
      for (int r = 0; r < kCh; r += 4)
        w4[r / 4] = make_float4(X[r * NC + j], X[(r + 1) * NC + j], X[(r + 2) * NC + j], X[(r + 3) * NC + j]);
    }
  }
}

template <int DK, int DV, int CW, bool Overlap>
struct DcStateSmem {
  static constexpr int wn = 0, qe = wn + DK * kCh, kd = qe + DK * kCh, aqk = kd + kCh * DK, u = aqk + kCh * kCh;
  static_assert(u == DcLayout<DK, DV>::u, "the record's first parts in this order");
  static constexpr int egl = u + kCh * CW, S = egl + DK, vn = S + DK * CW;
  static constexpr int kd2 = vn + kCh * CW, egl2 = kd2 + kCh * DK;  // Overlap: the next chunk's Kd and exp(G_last)
  static constexpr size_t floats = Overlap ? size_t(egl2) + DK : size_t(kd2);
};

// The chunks of a segment in order for one head and CW state columns: Vn = U + Wn S, O = Qe S + Aqk Vn, then
// S = exp(G_last) S + Kd^T Vn. 8 warps; each thread owns a 4 x CW/16 tile of Vn and O and a DK/16 x CW/16 tile of S.
// Overlap: each part of the next chunk's record is copied as soon as this chunk's last reader of it is done (Wn after
// Vn, Qe / Aqk / U after O), Kd and exp(G_last) into a second buffer right after Vn; without it every copy waits.
template <int DK, int DV, int CW, bool Overlap>
__global__ void __launch_bounds__(kDcThreads)
    dc_state_kernel(DeltaRuleArgs a, int t_first, int chunks, const float* scratch) {
  using L = DcLayout<DK, DV>;
  using M = DcStateSmem<DK, DV, CW, Overlap>;
  constexpr int TC = CW / 16, RS = DK / 16;  // columns per thread; state rows per thread
  static_assert(TC == 2 || TC == 4, "CW 32 or 64");
  extern __shared__ __align__(16) float dc_sm[];
  float *Wn = dc_sm + M::wn, *Qe = dc_sm + M::qe, *Aq = dc_sm + M::aqk, *U = dc_sm + M::u;
  float *S = dc_sm + M::S, *Vn = dc_sm + M::vn;
  const int h = blockIdx.y, j0 = blockIdx.x * CW, tid = threadIdx.x, ty = tid / 16, tx = tid % 16;
  const int r0 = 4 * ty, c0 = RS * ty, jt = TC * tx;
  float* state = a.state + int64_t(h) * DK * DV;
  auto record = [&](int ch) { return scratch + (int64_t(ch) * a.heads + h) * L::size; };
  auto copy = [&](float* dst, const float* src, int n) {
    for (int i = tid * 4; i < n; i += kDcThreads * 4) cp_async16(dst + i, src + i, true);
  };
  auto copy_u = [&](const float* rec) {
    for (int i = tid * 4; i < kCh * CW; i += kDcThreads * 4)
      cp_async16(U + i, rec + L::u + (i / CW) * DV + j0 + i % CW, true);
  };
  auto kd_buf = [&](int ch) { return dc_sm + (Overlap && (ch & 1) ? M::kd2 : M::kd); };
  auto eg_buf = [&](int ch) { return dc_sm + (Overlap && (ch & 1) ? M::egl2 : M::egl); };
  auto wait_copies = [] { asm volatile("cp.async.wait_all;\n" ::: "memory"); };
  pdl_enter();
  for (int i = tid; i < DK * CW; i += kDcThreads) S[i] = state[int64_t(i / CW) * DV + j0 + i % CW];

  for (int ch = 0; ch < chunks; ++ch) {
    const int t0 = t_first + ch * kCh, n = min(kCh, a.T - t0);
    const float* rec = record(ch);
    const bool more = Overlap && ch + 1 < chunks;
    float *Kd = kd_buf(ch), *Eg = eg_buf(ch);
    if (ch == 0 || !Overlap) {
      copy(Wn, rec + L::wn, DK * kCh), copy(Qe, rec + L::qe, DK * kCh), copy(Aq, rec + L::aqk, kCh * kCh);
      copy(Kd, rec + L::kd, kCh * DK), copy(Eg, rec + L::egl, DK), copy_u(rec);
      wait_copies();
      __syncthreads();
    }

    float acc[4][TC];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int j = 0; j < TC; ++j) acc[i][j] = U[(r0 + i) * CW + jt + j];
    for (int c = 0; c < DK; ++c) {  // Vn = U + Wn S
      const float4 w = *reinterpret_cast<const float4*>(Wn + c * kCh + r0);
      float sv[TC];
#pragma unroll
      for (int j = 0; j < TC; ++j) sv[j] = S[c * CW + jt + j];
#pragma unroll
      for (int j = 0; j < TC; ++j) {
        acc[0][j] += w.x * sv[j], acc[1][j] += w.y * sv[j];
        acc[2][j] += w.z * sv[j], acc[3][j] += w.w * sv[j];
      }
    }
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int j = 0; j < TC; ++j) Vn[(r0 + i) * CW + jt + j] = acc[i][j];
    __syncthreads();
    if (more) {
      const float* next = record(ch + 1);
      copy(Wn, next + L::wn, DK * kCh), copy(kd_buf(ch + 1), next + L::kd, kCh * DK);
      copy(eg_buf(ch + 1), next + L::egl, DK);
    }

#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int j = 0; j < TC; ++j) acc[i][j] = 0.0f;
    for (int c = 0; c < DK; ++c) {  // O = Qe S + Aqk Vn
      const float4 q = *reinterpret_cast<const float4*>(Qe + c * kCh + r0);
#pragma unroll
      for (int j = 0; j < TC; ++j) {
        const float sv = S[c * CW + jt + j];
        acc[0][j] += q.x * sv, acc[1][j] += q.y * sv, acc[2][j] += q.z * sv, acc[3][j] += q.w * sv;
      }
    }
    for (int s = 0; s < r0 + 4; ++s) {  // Aqk is zero where s > r
      const float4 q = *reinterpret_cast<const float4*>(Aq + s * kCh + r0);
#pragma unroll
      for (int j = 0; j < TC; ++j) {
        const float vv = Vn[s * CW + jt + j];
        acc[0][j] += q.x * vv, acc[1][j] += q.y * vv, acc[2][j] += q.z * vv, acc[3][j] += q.w * vv;
      }
    }
#pragma unroll
    for (int i = 0; i < 4; ++i)
      if (r0 + i < n)
#pragma unroll
        for (int j = 0; j < TC; ++j) a.out[(int64_t(t0 + r0 + i) * a.heads + h) * DV + j0 + jt + j] = acc[i][j];
    __syncthreads();  // S is read above and written below
    if (more) {
      const float* next = record(ch + 1);
      copy(Qe, next + L::qe, DK * kCh), copy(Aq, next + L::aqk, kCh * kCh), copy_u(next);
    }

    float sa[RS][TC];
#pragma unroll
    for (int i = 0; i < RS; ++i)
#pragma unroll
      for (int j = 0; j < TC; ++j) sa[i][j] = Eg[c0 + i] * S[(c0 + i) * CW + jt + j];
    for (int s = 0; s < kCh; ++s) {  // S = exp(G_last) S + Kd^T Vn
      float kv[RS], vv[TC];
#pragma unroll
      for (int i = 0; i < RS; ++i) kv[i] = Kd[s * DK + c0 + i];
#pragma unroll
      for (int j = 0; j < TC; ++j) vv[j] = Vn[s * CW + jt + j];
#pragma unroll
      for (int i = 0; i < RS; ++i)
#pragma unroll
        for (int j = 0; j < TC; ++j) sa[i][j] += kv[i] * vv[j];
    }
#pragma unroll
    for (int i = 0; i < RS; ++i)
#pragma unroll
      for (int j = 0; j < TC; ++j) S[(c0 + i) * CW + jt + j] = sa[i][j];
    if (more) wait_copies();
    __syncthreads();  // before the next chunk's products (and, without Overlap, its copies)
  }
  for (int i = tid; i < DK * CW; i += kDcThreads) state[int64_t(i / CW) * DV + j0 + i % CW] = S[i];
}

template <int DK, int DV, bool Overlap>
void launch_state(const DeltaRuleArgs& a, int t_first, int chunks, cudaStream_t st) {
  constexpr int CW = DV < 64 ? DV : 64;
  const size_t smem = DcStateSmem<DK, DV, CW, Overlap>::floats * 4;
  reserve_dynamic_smem(dc_state_kernel<DK, DV, CW, Overlap>, smem, "delta_rule_chunked");  // (per device)
  launch(dc_state_kernel<DK, DV, CW, Overlap>, dim3(unsigned(DV / CW), unsigned(a.heads)), kDcThreads, smem, st, a,
         t_first, chunks, static_cast<const float*>(a.chunk_scratch));
}

template <int DK, int DV, bool Factor>
void launch_prep(const DeltaRuleArgs& a, int t_first, int chunks, cudaStream_t st) {
  const size_t smem = DcPrepSmem<DK, DV, Factor>::floats * 4;
  reserve_dynamic_smem(dc_prep_kernel<DK, DV, Factor>, smem, "delta_rule_chunked");
  prefer_max_shared_carveout(dc_prep_kernel<DK, DV, Factor>);  // (two blocks per SM)
  launch(dc_prep_kernel<DK, DV, Factor>, dim3(unsigned(chunks), unsigned(a.heads)), kDcThreads, smem, st, a, t_first,
         a.chunk_scratch);
}

// False when the device's blocks cannot have the kernels' shared memory (the 99 KB of an RTX 3090 / 4090 at dk 128):
// the caller runs the recurrence.
template <int DK, int DV>
bool run_chunked(const DeltaRuleArgs& a, cudaStream_t st, int only) {
  using L = DcLayout<DK, DV>;
  constexpr int CW = DV < 64 ? DV : 64;
  const size_t limit = device_block_smem_limit();
  // Comparison switches, read per call so that one process can time and test both forms: MOESRV_DELTA_RULE_FACTOR=0
  // takes every exp(G_r - G_s) directly, MOESRV_DELTA_RULE_OVERLAP=0 copies each chunk's record before its products.
  const bool factor = env_choice("MOESRV_DELTA_RULE_FACTOR", 0, 1, 1) && DcPrepSmem<DK, DV, true>::floats * 4 <= limit;
  const bool overlap =
      env_choice("MOESRV_DELTA_RULE_OVERLAP", 0, 1, 1) && DcStateSmem<DK, DV, CW, true>::floats * 4 <= limit;
  if (DcPrepSmem<DK, DV, false>::floats * 4 > limit || DcStateSmem<DK, DV, CW, false>::floats * 4 > limit) return false;
  const int64_t per_chunk = int64_t(a.heads) * L::size;
  const int total = ceil_div(a.T, kCh), seg = int(std::min<int64_t>(total, a.chunk_scratch_floats / per_chunk));
  for (int c0 = 0; c0 < total; c0 += seg) {
    const int chunks = std::min(seg, total - c0), t_first = c0 * kCh;
    if (only != 2) {
      if (factor) launch_prep<DK, DV, true>(a, t_first, chunks, st);
      else launch_prep<DK, DV, false>(a, t_first, chunks, st);
    }
    if (only == 1) continue;
    if (overlap) launch_state<DK, DV, true>(a, t_first, chunks, st);
    else launch_state<DK, DV, false>(a, t_first, chunks, st);
  }
  MOESRV_CUDA_LAUNCH_CHECK();
  return true;
}

int64_t chunk_record_floats(int dk, int dv) {
  switch (dk * 1000 + dv) {
    case 32032: return DcLayout<32, 32>::size;
    case 64064: return DcLayout<64, 64>::size;
    case 128128: return DcLayout<128, 128>::size;
    default: return 0;
  }
}

}  // namespace

int64_t delta_rule_chunk_floats(int heads, int dk, int dv) { return int64_t(heads) * chunk_record_floats(dk, dv); }

bool delta_rule_chunked_on() { return env_choice("MOESRV_DELTA_RULE_CHUNKED", 0, 1, 1) != 0; }

bool delta_rule_chunked(const DeltaRuleArgs& a, cudaStream_t st, int only) {
  const int64_t per_chunk = delta_rule_chunk_floats(a.heads, a.dk, a.dv);
  if (a.steps || a.T < kDeltaRuleChunkMinTokens || per_chunk == 0 || !a.chunk_scratch ||
      a.chunk_scratch_floats < per_chunk)
    return false;
  switch (a.dk) {
    case 32: return run_chunked<32, 32>(a, st, only);
    case 64: return run_chunked<64, 64>(a, st, only);
    default: return run_chunked<128, 128>(a, st, only);
  }
}

}  // namespace moesrv::cuda
