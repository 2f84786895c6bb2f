#include "backend/cpu/expert_batch.h"

#include <algorithm>
#include <utility>

#include "backend/cpu/cpu_layers.h"
#include "backend/cpu/exl3_gemv.h"
#include "backend/cpu/exl3_linear.h"
#include "backend/cpu/ops.h"
#include "format/exl3_hadamard.h"
#include "util/error.h"
#include "util/thread_pool.h"

namespace moesrv::cpu {

namespace {

constexpr int64_t kBlock = 128;  // Hadamard block: rotations work block by block

// An expert on the batched path, with its slices of the scratch buffer (rotated basis, padded shapes).
struct Exl3Mlp {
  const ExpertRows* job;
  const Exl3Linear *gate, *up, *down;
  Exl3GemvPath path_gate, path_up, path_down;  // exl3_gemv_path_for each linear (down: of down_w)
  float *xs_gate, *xs_up, *xs_down;            // activations as the path reads them, [n][exl3_activation_floats]
  float *yr_gate, *yr_up, *yr_down;            // rotated-basis outputs, [n][out_pad]
  int64_t b0 = 0, b1 = 0;                      // the intermediate blocks computed, [b0, b1) of 128
  // down's trellis rows of those blocks (the whole matrix unless sliced; no scales: the strips read none)
  Exl3Weights down_w;
};

int64_t activation_floats(Exl3GemvPath path, const Exl3Linear& l) {
  return exl3_activation_floats(path, l.weights().in_pad);
}

const Exl3Linear* as_exl3(const Linear* l) { return dynamic_cast<const Exl3Linear*>(l); }

// Gate and up read the same input and feed down block for block (same padded intermediate size).
bool batchable(const MlpWeights& e, int64_t n, Exl3GemvPath path) {
  const Exl3Linear *g = as_exl3(e.gate.get()), *u = as_exl3(e.up.get()), *d = as_exl3(e.down.get());
  if (!g || !u || !d || n < 1 || n > exl3_gemv_fast_rows(path)) return false;
  return g->in_features() == u->in_features() && g->weights().in_pad == u->weights().in_pad &&
         g->out_features() == u->out_features() && u->out_features() == d->in_features() &&
         g->weights().out_pad == u->weights().out_pad && u->weights().out_pad == d->weights().in_pad;
}

// Rows [b0 * 128, b1 * 128) of w: the matrix the strips of those inputs read (trellis, shape and code only).
Exl3Weights input_rows(const Exl3Weights& w, int64_t b0, int64_t b1) {
  Exl3Weights v;
  v.K = w.K;
  v.codebook = w.codebook;
  v.in_pad = (b1 - b0) * kBlock;
  v.out_pad = w.out_pad;
  v.trellis = w.tile(b0 * (kBlock / 16), 0);
  return v;
}

// One parallel_for over every expert's items: fn(expert, item) for item < count(expert).
template <typename Count, typename Fn>
void parallel_items(const std::vector<Exl3Mlp>& ms, Count count, Fn fn) {
  std::vector<int64_t> start(ms.size() + 1, 0);
  for (size_t e = 0; e < ms.size(); ++e) start[e + 1] = start[e] + count(ms[e]);
  ThreadPool::global().parallel_for(start.back(), [&](int64_t b, int64_t end) {
    size_t e = size_t(std::upper_bound(start.begin(), start.end(), b) - start.begin() - 1);
    for (int64_t i = b; i < end; ++i) {
      while (i >= start[e + 1]) ++e;
      fn(ms[e], i - start[e]);
    }
  });
}

// Block b of row r of a linear's input: x ⊙ suh (zero past in_features), Hadamard, as the path reads it (as
// forward()).
void rotate_in_block(const Exl3Linear& l, Exl3GemvPath path, const float* x, int64_t r, int64_t b, float* xs) {
  const Exl3Weights& w = l.weights();
  float v[kBlock];
  for (int64_t i = 0; i < kBlock; ++i) {
    const int64_t k = b * kBlock + i;
    v[i] = k < l.in_features() ? x[r * l.in_features() + k] * w.suh[size_t(k)] : 0.0f;
  }
  exl3_hadamard128(v, kBlock);
  exl3_prepare_activation_block(path, v, b, xs + r * activation_floats(path, l));
}

// Block b of row r of a linear's output: Hadamard, ⊙ svh, + bias, for the outputs of the block below out_features.
// Returns how many.
int64_t rotate_out_block(const Exl3Linear& l, const float* yr, int64_t r, int64_t b, float* out) {
  const Exl3Weights& w = l.weights();
  float v[kBlock];
  std::copy_n(yr + r * w.out_pad + b * kBlock, kBlock, v);
  exl3_hadamard128(v, kBlock);
  const int64_t cnt = std::clamp<int64_t>(l.out_features() - b * kBlock, 0, kBlock);
  const std::vector<float>& bias = l.bias();
  for (int64_t i = 0; i < cnt; ++i) {
    const int64_t o = b * kBlock + i;
    out[i] = v[i] * w.svh[size_t(o)] + (bias.empty() ? 0.0f : bias[size_t(o)]);
  }
  return cnt;
}

// Gate and up outputs of block b, the clamped SwiGLU (as mlp_forward), and down's rotated input of that block.
void swiglu_block(const Exl3Mlp& m, int64_t r, int64_t b) {
  float g[kBlock], u[kBlock], a[kBlock];
  const int64_t cnt = rotate_out_block(*m.gate, m.yr_gate, r, b, g);
  rotate_out_block(*m.up, m.yr_up, r, b, u);
  const float limit = m.job->expert->limit;
  if (limit > 0)
    for (int64_t i = 0; i < cnt; ++i) {
      g[i] = std::min(g[i], limit);
      u[i] = std::clamp(u[i], -limit, limit);
    }
  silu_mul(g, u, cnt, a);
  const int64_t in = m.down->in_features();
  const Exl3Weights& w = m.down->weights();
  float v[kBlock];
  for (int64_t i = 0; i < kBlock; ++i) {
    const int64_t k = b * kBlock + i;
    v[i] = k < in ? a[i] * w.suh[size_t(k)] : 0.0f;
  }
  exl3_hadamard128(v, kBlock);
  exl3_prepare_activation_block(m.path_down, v, b - m.b0,
                                m.xs_down + r * exl3_activation_floats(m.path_down, m.down_w.in_pad));
}

}  // namespace

void experts_forward(const std::vector<ExpertRows>& jobs) {
  const Exl3GemvPath path = exl3_gemv_default_path();
  std::vector<Exl3Mlp> ms;
  size_t floats = 0;
  for (const ExpertRows& j : jobs) {
    if (j.n <= 0) continue;
    const bool sliced = j.inter1 != 0;
    if (!batchable(*j.expert, j.n, path)) {
      if (sliced) fail("expert slice: the expert does not run on the batched EXL3 path for {} rows", j.n);
      mlp_forward(*j.expert, j.x, j.n, j.y);
      continue;
    }
    const MlpWeights& e = *j.expert;
    Exl3Mlp m{&j, as_exl3(e.gate.get()), as_exl3(e.up.get()), as_exl3(e.down.get())};
    const int64_t inter = m.down->weights().in_pad;
    m.b0 = j.inter0 / kBlock;
    m.b1 = (sliced ? j.inter1 : inter) / kBlock;
    if (sliced && (j.inter0 % kBlock || j.inter1 % kBlock || j.inter0 < 0 || j.inter1 <= j.inter0 || j.inter1 > inter ||
                   !m.down->bias().empty()))
      fail("expert slice [{}, {}) of an intermediate size of {}: not whole blocks of {} inside it, or a down bias",
           j.inter0, j.inter1, inter, kBlock);
    m.down_w = input_rows(m.down->weights(), m.b0, m.b1);
    m.path_gate = exl3_gemv_path_for(path, m.gate->weights());
    m.path_up = exl3_gemv_path_for(path, m.up->weights());
    m.path_down = exl3_gemv_path_for(path, m.down_w);
    floats += size_t(j.n * (activation_floats(m.path_gate, *m.gate) + activation_floats(m.path_up, *m.up) +
                            2 * m.gate->weights().out_pad + exl3_activation_floats(m.path_down, m.down_w.in_pad) +
                            m.down->weights().out_pad));
    ms.push_back(m);
  }
  if (ms.empty()) return;
  std::vector<float> scratch(floats);
  float* p = scratch.data();
  auto take = [&](int64_t count) { return std::exchange(p, p + count); };
  for (Exl3Mlp& m : ms) {
    const int64_t n = m.job->n;
    m.xs_gate = take(n * activation_floats(m.path_gate, *m.gate));
    m.xs_up = take(n * activation_floats(m.path_up, *m.up));
    m.yr_gate = take(n * m.gate->weights().out_pad);
    m.yr_up = take(n * m.up->weights().out_pad);
    m.xs_down = take(n * exl3_activation_floats(m.path_down, m.down_w.in_pad));
    m.yr_down = take(n * m.down->weights().out_pad);
  }
  // Inputs of gate and up, rotated: one item per (linear, row, block).
  parallel_items(
      ms, [](const Exl3Mlp& m) { return 2 * m.job->n * m.gate->weights().in_pad / kBlock; },
      [](const Exl3Mlp& m, int64_t i) {
        const int64_t per = m.job->n * m.gate->weights().in_pad / kBlock, blocks = m.gate->weights().in_pad / kBlock;
        const bool up = i >= per;
        const int64_t r = (i % per) / blocks, b = (i % per) % blocks;
        if (up) rotate_in_block(*m.up, m.path_up, m.job->x, r, b, m.xs_up);
        else rotate_in_block(*m.gate, m.path_gate, m.job->x, r, b, m.xs_gate);
      });
  // Every gate and up strip of every expert (of its slice).
  constexpr int64_t kStrips = kBlock / 16;  // strips per block
  parallel_items(
      ms, [](const Exl3Mlp& m) { return 2 * (m.b1 - m.b0) * kStrips; },
      [](const Exl3Mlp& m, int64_t i) {
        const int64_t strips = (m.b1 - m.b0) * kStrips;
        const bool up = i >= strips;
        const Exl3Weights& w = up ? m.up->weights() : m.gate->weights();
        exl3_gemv_strip(up ? m.path_up : m.path_gate, w, up ? m.xs_up : m.xs_gate, m.job->n,
                        m.b0 * kStrips + i % strips, up ? m.yr_up : m.yr_gate, w.out_pad);
      });
  // Activation and down's rotated input: one item per (row, block).
  parallel_items(
      ms, [](const Exl3Mlp& m) { return m.job->n * (m.b1 - m.b0); },
      [](const Exl3Mlp& m, int64_t i) {
        const int64_t blocks = m.b1 - m.b0;
        swiglu_block(m, i / blocks, m.b0 + i % blocks);
      });
  // Every down strip (over the slice's input rows).
  parallel_items(
      ms, [](const Exl3Mlp& m) { return m.down_w.tiles_n(); },
      [](const Exl3Mlp& m, int64_t i) {
        exl3_gemv_strip(m.path_down, m.down_w, m.xs_down, m.job->n, i, m.yr_down, m.down_w.out_pad);
      });
  // Outputs: one item per (row, block).
  parallel_items(
      ms, [](const Exl3Mlp& m) { return m.job->n * m.down->weights().out_pad / kBlock; },
      [](const Exl3Mlp& m, int64_t i) {
        const int64_t blocks = m.down->weights().out_pad / kBlock, r = i / blocks, b = i % blocks;
        const int64_t out = m.down->out_features();
        float v[kBlock];
        const int64_t cnt = rotate_out_block(*m.down, m.yr_down, r, b, v);
        std::copy_n(v, cnt, m.job->y + r * out + b * kBlock);
      });
}

bool expert_slices_supported(const MlpWeights& expert, int64_t n, int64_t* inter) {
  if (!batchable(expert, n, exl3_gemv_default_path())) return false;
  const Exl3Linear* d = as_exl3(expert.down.get());
  if (!d->bias().empty()) return false;
  if (inter) *inter = d->weights().in_pad;
  return true;
}

void add_routed_experts(const std::vector<RoutedRows>& jobs, const float* x, int64_t D, float* out) {
  const int64_t few = exl3_gemv_fast_rows(exl3_gemv_default_path());
  int64_t rows = 0;
  for (const RoutedRows& j : jobs) {
    if (!j.expert || j.tokens.size() != j.weights.size()) fail("routed experts: malformed job");
    if (j.expert->down->out_features() != D)
      fail("routed experts: expert output {} != hidden {}", j.expert->down->out_features(), D);
    if (int64_t(j.tokens.size()) <= few) rows += int64_t(j.tokens.size());
  }
  auto gather = [&](const RoutedRows& j, float* dst) {
    for (size_t i = 0; i < j.tokens.size(); ++i) std::copy_n(x + j.tokens[i] * D, D, dst + int64_t(i) * D);
  };
  std::vector<float> xs(size_t(rows * D)), ys(size_t(rows * D));
  std::vector<ExpertRows> batch;
  std::vector<const float*> out_of(jobs.size(), nullptr);  // job j's output rows, when computed in the batch
  int64_t row = 0;
  for (size_t b = 0; b < jobs.size(); ++b) {
    const int64_t n = int64_t(jobs[b].tokens.size());
    if (n == 0 || n > few) continue;
    gather(jobs[b], xs.data() + row * D);
    batch.push_back({jobs[b].expert, xs.data() + row * D, n, ys.data() + row * D, jobs[b].inter0, jobs[b].inter1});
    out_of[b] = ys.data() + row * D;
    row += n;
  }
  experts_forward(batch);
  std::vector<float> xl, yl;
  for (size_t b = 0; b < jobs.size(); ++b) {
    const RoutedRows& j = jobs[b];
    const int64_t n = int64_t(j.tokens.size());
    if (n == 0) continue;
    const float* y = out_of[b];
    if (!y && j.inter1 != 0) fail("expert slice: {} rows are more than the batched path takes", n);
    if (!y) {
      xl.resize(size_t(n * D));
      yl.resize(size_t(n * D));
      gather(j, xl.data());
      mlp_forward(*j.expert, xl.data(), n, yl.data());
      y = yl.data();
    }
    for (int64_t i = 0; i < n; ++i) axpy(j.weights[size_t(i)], y + i * D, D, out + j.tokens[size_t(i)] * D);
  }
}

}  // namespace moesrv::cpu
