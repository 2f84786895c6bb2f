#include "format/exl3_encode.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>

#include "format/exl3_hadamard.h"
#include "format/exl3_tile.h"
#include "util/error.h"
#include "util/numeric.h"
#include "util/thread_pool.h"

namespace moesrv {

namespace {

constexpr float kCodebookRms = 1.24371088f;  // exllamav3's codebook_scale: rows are normalised to this RMS
constexpr float kInf = std::numeric_limits<float>::infinity();

// m[q] = min over the K dropped high bits h of cost[h << (16-K) | q]; bt[q] = the minimising h.
void min_over_dropped_bits(const float* cost, int K, float* m, int32_t* arg, uint8_t* bt) {
  const int nq = 1 << (16 - K), nh = 1 << K;
#if defined(__AVX512F__)
  (void)arg;
  for (int q = 0; q < nq; q += 16) {
    __m512 best = _mm512_loadu_ps(cost + q);
    __m512i besth = _mm512_setzero_si512();
    for (int h = 1; h < nh; ++h) {
      __m512 c = _mm512_loadu_ps(cost + (size_t(h) << (16 - K)) + q);
      __mmask16 lt = _mm512_cmp_ps_mask(c, best, _CMP_LT_OQ);
      best = _mm512_mask_blend_ps(lt, best, c);
      besth = _mm512_mask_blend_epi32(lt, besth, _mm512_set1_epi32(h));
    }
    _mm512_storeu_ps(m + q, best);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(bt + q), _mm512_cvtepi32_epi8(besth));
  }
#else
  std::memcpy(m, cost, size_t(nq) * sizeof(float));
  std::fill(arg, arg + nq, 0);
  for (int h = 1; h < nh; ++h) {
    const float* c = cost + (size_t(h) << (16 - K));
    for (int q = 0; q < nq; ++q) {
      bool lt = c[q] < m[q];
      m[q] = lt ? c[q] : m[q];
      arg[q] = lt ? h : arg[q];
    }
  }
  for (int q = 0; q < nq; ++q) bt[q] = uint8_t(arg[q]);
#endif
}

// next[s] = m[s >> K] + (v - table[s])^2
void add_step_error(const float* m, int K, const float* table, float v, float* next) {
#if defined(__AVX512F__)
  const __m512 vv = _mm512_set1_ps(v);
  if (K >= 4) {
    for (int q = 0; q < (1 << (16 - K)); ++q) {
      const __m512 mq = _mm512_set1_ps(m[q]);
      for (int j = 0; j < (1 << K); j += 16) {
        int s = (q << K) + j;
        __m512 d = _mm512_sub_ps(vv, _mm512_loadu_ps(table + s));
        _mm512_storeu_ps(next + s, _mm512_fmadd_ps(d, d, mq));
      }
    }
  } else {
    const __m512i lane_q = _mm512_srli_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), K);
    for (int s = 0; s < 65536; s += 16) {
      __m512 mv = _mm512_permutexvar_ps(lane_q, _mm512_loadu_ps(m + (s >> K)));  // reads up to 16 q's, uses 16>>K
      __m512 d = _mm512_sub_ps(vv, _mm512_loadu_ps(table + s));
      _mm512_storeu_ps(next + s, _mm512_fmadd_ps(d, d, mv));
    }
  }
#else
  for (int s = 0; s < 65536; ++s) {
    float d = v - table[s];
    next[s] = m[s >> K] + d * d;
  }
#endif
}

// One Viterbi pass. pinned < 0: free start and end; else state_0 >> K == pinned and state_255 & low == pinned.
double viterbi(const float* target, int steps, int K, const float* table, int pinned, uint16_t* states,
               std::vector<float>& cost, std::vector<float>& next, std::vector<float>& m, std::vector<int32_t>& arg,
               std::vector<uint8_t>& back) {
  const int nq = 1 << (16 - K);
  const uint32_t low = uint32_t(nq - 1);
  for (int s = 0; s < 65536; ++s) {
    float d = target[0] - table[s];
    cost[size_t(s)] = (pinned < 0 || (s >> K) == pinned) ? d * d : kInf;
  }
  for (int t = 1; t < steps; ++t) {
    uint8_t* bt = back.data() + size_t(t) * size_t(nq);
    min_over_dropped_bits(cost.data(), K, m.data(), arg.data(), bt);
    add_step_error(m.data(), K, table, target[t], next.data());
    std::swap(cost, next);
  }
  int best = -1;
  float best_cost = kInf;
  for (int s = 0; s < 65536; ++s)
    if ((pinned < 0 || int(s & low) == pinned) && cost[size_t(s)] < best_cost) {
      best_cost = cost[size_t(s)];
      best = s;
    }
  MOESRV_CHECK(best >= 0, "exl3 encoder: no finite trellis path (non-finite weights?)");
  uint32_t s = uint32_t(best);
  for (int t = steps - 1; t >= 0; --t) {
    states[t] = uint16_t(s);
    if (t > 0) {
      uint32_t q = s >> K;
      s = uint32_t(back[size_t(t) * size_t(nq) + q]) << (16 - K) | q;
    }
  }
  return best_cost;
}

}  // namespace

double exl3_quantize_tile(const float* target, int K, Exl3Codebook cb, uint16_t states[256]) {
  MOESRV_CHECK(K >= 1 && K <= kExl3MaxK, "exl3 encoder: K={} (supported: 1..8)", K);
  const float* table = exl3_codebook_table(cb);
  thread_local std::vector<float> cost(65536), next(65536), m(65536);
  thread_local std::vector<int32_t> arg(65536);
  thread_local std::vector<uint8_t> back;
  back.resize(size_t(256) << (16 - K));
  // Pass 1 only has to guess the state at t = 255: a free-start search over the last 64 steps suffices.
  viterbi(target + 192, 64, K, table, -1, states, cost, next, m, arg, back);
  int pinned = int(states[63] & ((1u << (16 - K)) - 1));
  return viterbi(target, 256, K, table, pinned, states, cost, next, m, arg, back);
}

namespace {

void gather_tile(const std::vector<float>& wr, int64_t ld, int64_t kt, int64_t nt, float* tgt) {
  for (int t = 0; t < 256; ++t) {
    int p = exl3_tile_pos(t);
    tgt[t] = wr[size_t((kt * 16 + p / 16) * ld + nt * 16 + p % 16)];
  }
}

// Global scale minimising the tile error on a few sample tiles (coarse grid, then a finer one).
float search_scale(const std::vector<float>& wr, int64_t kp, int64_t np, const Exl3EncodeOptions& opt) {
  const int64_t tk = kp / 16, tn = np / 16;
  std::vector<std::vector<float>> samples;
  for (int64_t i = 0; i < std::min<int64_t>(8, std::max(tk, tn)); ++i) {
    samples.emplace_back(256);
    gather_tile(wr, np, (i * 7) % tk, (i * 3 + i / tk) % tn, samples.back().data());
  }
  auto err = [&](float g) {
    std::vector<double> e(samples.size());
    ThreadPool::global().parallel_for(int64_t(samples.size()), [&](int64_t b, int64_t en) {
      float tgt[256];
      uint16_t st[256];
      for (int64_t i = b; i < en; ++i) {
        for (int t = 0; t < 256; ++t) tgt[t] = samples[size_t(i)][size_t(t)] * g;
        e[size_t(i)] = exl3_quantize_tile(tgt, opt.K, opt.codebook, st) / double(g) / double(g);
      }
    });
    double s = 0;
    for (double v : e) s += v;
    return s;
  };
  float best = 1.0f;
  double best_e = err(1.0f);
  for (float g : {0.6f, 0.75f, 0.9f, 1.1f, 1.25f}) {
    double e = err(g);
    if (e < best_e) { best_e = e; best = g; }
  }
  float center = best;
  for (float d : {-0.06f, -0.03f, 0.03f, 0.06f}) {
    double e = err(center + d);
    if (e < best_e) { best_e = e; best = center + d; }
  }
  return best;
}

double codebook_rms(Exl3Codebook cb) {
  const float* t = exl3_codebook_table(cb);
  double sq = 0;
  for (int s = 0; s < 65536; ++s) sq += double(t[s]) * t[s];
  return std::sqrt(sq / 65536.0);
}

std::vector<float> from_f16(const std::vector<uint16_t>& h) {
  std::vector<float> f(h.size());
  for (size_t i = 0; i < h.size(); ++i) f[i] = f16_to_f32(h[i]);
  return f;
}

}  // namespace

Exl3Encoded exl3_encode(const float* w, int64_t out_features, int64_t in_features, const Exl3EncodeOptions& opt) {
  MOESRV_CHECK(opt.K >= 1 && opt.K <= kExl3MaxK, "exl3 encoder: K={} (supported: 1..8)", opt.K);
  MOESRV_CHECK(out_features > 0 && in_features > 0, "exl3 encoder: empty weight {}x{}", out_features, in_features);
  const int64_t kp = (in_features + 127) / 128 * 128, np = (out_features + 127) / 128 * 128;
  std::mt19937_64 rng(opt.seed);
  auto sign = [&] { return (rng() & 1) ? -1.0f : 1.0f; };
  std::vector<float> su(static_cast<size_t>(kp)), sv(static_cast<size_t>(np));
  for (auto& s : su) s = sign();
  for (auto& s : sv) s = sign();

  // wr = W^T (in x out), zero padded
  std::vector<float> wr(size_t(kp * np), 0.0f);
  for (int64_t o = 0; o < out_features; ++o)
    for (int64_t i = 0; i < in_features; ++i) wr[size_t(i * np + o)] = w[o * in_features + i];

  // Output channels: sign x RMS (normalised to mean 1); all-zero channels get svh = 0
  std::vector<double> col_sq(size_t(np), 0.0);
  for (int64_t i = 0; i < kp; ++i)
    for (int64_t o = 0; o < np; ++o) col_sq[size_t(o)] += double(wr[size_t(i * np + o)]) * wr[size_t(i * np + o)];
  double mean_rms = 0;
  for (auto& c : col_sq) mean_rms += (c = std::sqrt(c / double(kp)));
  mean_rms /= double(np);
  std::vector<bool> zero_col(static_cast<size_t>(np));
  for (int64_t o = 0; o < np; ++o) {
    double sc = mean_rms > 1e-30 ? col_sq[size_t(o)] / mean_rms : 0.0;
    zero_col[size_t(o)] = sc < 1e-30;
    if (opt.out_scales) sv[size_t(o)] *= float(zero_col[size_t(o)] ? 0.1 : sc);
    sv[size_t(o)] = f16_to_f32(f32_to_f16(sv[size_t(o)]));  // stored as fp16: fold the rounding in
  }
  for (int64_t i = 0; i < kp; ++i)
    for (int64_t o = 0; o < np; ++o) wr[size_t(i * np + o)] /= sv[size_t(o)];
  for (int64_t o = 0; o < np; ++o)
    if (zero_col[size_t(o)]) sv[size_t(o)] = 0.0f;
  for (int64_t i = 0; i < kp; ++i) exl3_hadamard128(wr.data() + i * np, np);  // right H

  // Input channels: sign x row RMS / codebook RMS
  for (int64_t i = 0; i < kp; ++i) {
    double sq = 0;
    for (int64_t o = 0; o < np; ++o) sq += double(wr[size_t(i * np + o)]) * wr[size_t(i * np + o)];
    double rms = std::sqrt(sq / double(np));
    su[size_t(i)] *= float((rms < 1e-30 ? 0.1 : rms) / kCodebookRms);
  }
  // Left H over the input dimension, per output column (the global scale is applied to su afterwards)
  {
    std::vector<float> col(static_cast<size_t>(kp));
    for (int64_t o = 0; o < np; ++o) {
      for (int64_t i = 0; i < kp; ++i) col[size_t(i)] = wr[size_t(i * np + o)] / su[size_t(i)];
      exl3_hadamard128(col.data(), kp);
      for (int64_t i = 0; i < kp; ++i) wr[size_t(i * np + o)] = col[size_t(i)];
    }
  }
  // Rows now have exllamav3's RMS 1.2437 (3INST's codebook RMS); match the chosen codebook's RMS, then refine.
  float g = float(codebook_rms(opt.codebook) / kCodebookRms);
  for (auto& v : wr) v *= g;
  if (opt.scale_search) {
    float g2 = search_scale(wr, kp, np, opt);
    for (auto& v : wr) v *= g2;
    g *= g2;
  }

  Exl3Encoded enc;
  enc.in_features = in_features;
  enc.out_features = out_features;
  enc.suh_f16.resize(size_t(kp));
  enc.svh_f16.resize(size_t(np));
  for (int64_t i = 0; i < kp; ++i) enc.suh_f16[size_t(i)] = f32_to_f16(su[size_t(i)] / g);
  for (int64_t o = 0; o < np; ++o) enc.svh_f16[size_t(o)] = f32_to_f16(sv[size_t(o)]);

  const int64_t tk = kp / 16, tn = np / 16, words = 16 * opt.K;
  enc.trellis = std::make_shared<std::vector<uint16_t>>(size_t(tk * tn * words));
  std::vector<double> err(size_t(tk * tn));
  ThreadPool::global().parallel_for(tk * tn, [&](int64_t b, int64_t e) {
    float tgt[256];
    uint16_t st[256];
    for (int64_t idx = b; idx < e; ++idx) {
      gather_tile(wr, np, idx / tn, idx % tn, tgt);
      err[size_t(idx)] = exl3_quantize_tile(tgt, opt.K, opt.codebook, st);
      bool ok = exl3_pack_tile(st, opt.K, enc.trellis->data() + idx * words);
      MOESRV_CHECK(ok, "exl3 encoder: internal error, non-cyclic trellis path");
    }
  });
  double e_sum = 0, w_sum = 0;
  for (double v : err) e_sum += v;
  for (float v : wr) w_sum += double(v) * v;
  enc.rotated_rel_mse = w_sum > 0 ? e_sum / w_sum : 0.0;

  Exl3Weights& ew = enc.weights;
  ew.K = opt.K;
  ew.codebook = opt.codebook;
  ew.in_pad = kp;
  ew.out_pad = np;
  ew.trellis = enc.trellis->data();
  ew.owner = enc.trellis;
  ew.suh = from_f16(enc.suh_f16);
  ew.svh = from_f16(enc.svh_f16);
  enc.marker = opt.codebook == Exl3Codebook::Mcg ? kExl3McgMult : opt.codebook == Exl3Codebook::Mul1 ? kExl3Mul1Mult : 0;
  return enc;
}

std::vector<TensorView> Exl3Encoded::tensor_views(const std::string& prefix) const {
  auto view = [](std::string name, DType dt, std::vector<int64_t> shape, const void* data, size_t nbytes) {
    TensorView v;
    v.name = std::move(name);
    v.dtype = dt;
    v.shape = std::move(shape);
    v.data = static_cast<const uint8_t*>(data);
    v.nbytes = nbytes;
    return v;
  };
  std::vector<TensorView> out;
  out.push_back(view(prefix + ".trellis", DType::I16, {weights.in_pad / 16, weights.out_pad / 16, 16 * int64_t(weights.K)},
                     trellis->data(), trellis->size() * 2));
  out.push_back(view(prefix + ".suh", DType::F16, {weights.in_pad}, suh_f16.data(), suh_f16.size() * 2));
  out.push_back(view(prefix + ".svh", DType::F16, {weights.out_pad}, svh_f16.data(), svh_f16.size() * 2));
  if (weights.codebook != Exl3Codebook::Inst3)
    out.push_back(view(prefix + (weights.codebook == Exl3Codebook::Mcg ? ".mcg" : ".mul1"), DType::I32, {}, &marker, 4));
  return out;
}

}  // namespace moesrv
