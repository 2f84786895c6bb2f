// Times every kernel of one GLM-5.3-Flash (glm5_next) decode step (1 token) at the model's real shapes, through
// the engine's public launchers (kernels.h, glm5_next_kernels.h, exl3_ops.h) and cuBLAS. Each entry's launches are
// captured 32x into one CUDA graph over rotating weight copies (KV caches, states, expert ids), and the L2 is
// flushed (untimed read kernel) before every replay, so weights stream from HBM as in a real decode. Reported per
// call: median us of 20 replays / 32, graph nodes / 32, and GB/s of the bytes the call must read from HBM (weights
// as stored, recurrent state read + write, selected latent rows, pooled keys). Last come the composite rows: the
// whole launch chain of one KDA+MoE and one MLA+MoE decode layer in the engine's order (cuda_engine.cpp
// CudaBlocks / attention_mla, linear_attention_engine.cpp, expert_executor.cpp, exl3_engine.cpp).
// Inputs and weights are random with a fixed seed (any trellis bits are valid EXL3 weights; MUL1 codebook).
// Usage: .gpu/cuda_kernel_bench [--bits 4] [--quick] [--only NAME,...] [--json out.json] [--split-sweep
// default,2x16,...]
//   (--split-sweep: the selected rows again under each MOESRV_EXL3_GEMV1_SPLIT value, "default" = unset)
// Per-node profile of one decode layer (each selected entry's call once, as a graph, inside cudaProfilerStart/Stop):
//   ncu --profile-from-start off --graph-profiling node --clock-control none --metrics gpu__time_duration.sum \
//       .gpu/cuda_kernel_bench --profile --only "decode layer (KDA+MoE)"
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_profiler_api.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <numeric>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "backend/cuda/exl3_ops.h"
#include "backend/cuda/glm5_next_kernels.h"
#include "backend/cuda/kernel_util.cuh"  // env_flag: the engine's opt-in switches
#include "backend/cuda/kernels.h"

using namespace moesrv::cuda;

namespace {

[[noreturn]] void die(const char* what, const char* err, int line) {
  std::fprintf(stderr, "%s failed at line %d: %s\n", what, line, err);
  std::exit(1);
}
#define CK(x)                                                                               \
  do {                                                                                      \
    if (cudaError_t e_ = (x); e_ != cudaSuccess) die(#x, cudaGetErrorString(e_), __LINE__); \
  } while (0)
#define CB(x)                                                                                    \
  do {                                                                                           \
    if (cublasStatus_t s_ = (x); s_ != CUBLAS_STATUS_SUCCESS) die(#x, "cuBLAS error", __LINE__); \
  } while (0)

// ---- glm5_next shapes
constexpr int D = 4096, NS = 4, HC_ITERS = 20;  // hidden, mHC streams
constexpr float HC_EPS = 1e-6f, RMS_EPS = 1e-5f;
constexpr int KH = 64, KD = 128, KHD = KH * KD, KC = 3 * KHD, KCONV = 4;   // KDA
constexpr int MH = 64, QL = 2048, R = 512, DN = 256, DV = 256;             // MLA (NoPE: qk_rope 0)
constexpr int IH = 32, ID = 128, KPOOL = 4, TOPK_KEYS = 2048;              // k-pool indexer
constexpr int BUDGET = TOPK_KEYS / KPOOL, SELW = TOPK_KEYS + KPOOL;        // pools kept, selection row width
constexpr int E = 288, TOPK = 8, KK = TOPK + 1, I = 2048, VOCAB = 154880;  // MoE (KK: shared + routed), head
constexpr int kHostExperts = 16;  // distinct routed experts in pinned host memory (zero-copy row), ~200 MB at K=4
constexpr size_t kYrFloats = size_t(kExl3GemvScratchParts) * VOCAB;  // EXL3 GEMV output, K parts included
constexpr size_t kTickets = VOCAB / 128 + 1024;  // exl3_gemv_out's counters: the head's row or the grouped rows
constexpr float LIMIT = 10.0f, MLA_SCALE = 1.0f / 16, ROUTED_SCALING = 2.5f;
constexpr int kCalls = 32;                     // calls per graph
constexpr size_t kRotate = size_t(256) << 20;  // rotating copies of a weight span >= this

// ---- device memory, random fills
cudaStream_t g_st = nullptr;
cublasHandle_t g_blas = nullptr;
double g_alloc_bytes = 0, g_bytes = 0;  // g_bytes: HBM bytes of the call being measured (added by the helpers)
uint64_t g_seed = 20240601;
int g_bits = 4;

__host__ __device__ inline uint64_t mix64(uint64_t z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

enum Fill { kF32, kBf16, kBits32, kSignF16 };

// fp32 / bf16: mean + scale * N(0,1) (Box-Muller); bits: random 32-bit words; sign-f16: ±scale as fp16.
__global__ void fill_kernel(void* p, size_t n, uint64_t seed, int kind, float scale, float mean) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const uint64_t r = mix64(seed ^ mix64(i));
    if (kind == kBits32) {
      static_cast<uint32_t*>(p)[i] = uint32_t(r);
    } else if (kind == kSignF16) {
      static_cast<uint16_t*>(p)[i] = uint16_t(__half_as_ushort(__float2half(scale)) | ((r & 1) << 15));
    } else {
      const float u1 = (float((r >> 40) & 0xFFFFFF) + 1.0f) / 16777217.0f, u2 = float(r & 0xFFFFFF) / 16777216.0f;
      const float v = mean + scale * sqrtf(-2.0f * logf(u1)) * cospif(2.0f * u2);
      if (kind == kF32) static_cast<float*>(p)[i] = v;
      else static_cast<uint16_t*>(p)[i] = __bfloat16_as_ushort(__float2bfloat16_rn(v));
    }
  }
}

__global__ void empty_kernel() {}

// Reads n uint4 (evicts the L2 with clean lines; also the HBM read reference row).
__global__ void read_kernel(const uint4* __restrict__ p, size_t n, unsigned* sink) {
  unsigned acc = 0;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const uint4 v = p[i];
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x9E3779B9u) *sink = acc;  // keeps the loads
}

template <class T>
T* dalloc(size_t n) {
  void* p = nullptr;
  const size_t bytes = std::max<size_t>(n * sizeof(T), 256);
  CK(cudaMalloc(&p, bytes));  // freed at exit
  g_alloc_bytes += double(bytes);
  return static_cast<T*>(p);
}
void fill(void* p, size_t n, Fill kind, float scale, float mean = 0) {
  fill_kernel<<<2048, 256, 0, g_st>>>(p, n, mix64(++g_seed), int(kind), scale, mean);
  CK(cudaGetLastError());
}
template <class T>
T* filled(size_t n, Fill kind, float scale, float mean = 0) {
  T* p = dalloc<T>(n);
  fill(p, n, kind, scale, mean);
  return p;
}
float* randf(size_t n, float scale, float mean = 0) { return filled<float>(n, kF32, scale, mean); }
uint16_t* randbf16(size_t n, float scale) { return filled<uint16_t>(n, kBf16, scale); }
uint16_t* signf16(size_t n, float mag) { return filled<uint16_t>(n, kSignF16, mag); }
template <class T>
T* upload(const std::vector<T>& v) {  // (synchronous)
  T* d = dalloc<T>(v.size());
  CK(cudaMemcpy(d, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
  return d;
}

// Copies of one weight; call i uses copy i % n. Enough copies that one replay's set spans kRotate bytes.
template <class T>
struct Pool {
  std::vector<T> v;
  const T& operator[](int i) const { return v[size_t(i) % v.size()]; }
};
int copies(double bytes) { return int(std::clamp(std::ceil(double(kRotate) / bytes), 2.0, double(kCalls))); }

// A random EXL3 linear (out x in, K = --bits, MUL1): suh ±1, svh ±0.02 (the bf16 model's weight scale).
Exl3Dev exl3_weight(int out, int in) {
  Exl3Dev w;
  w.K = g_bits, w.cb = 2, w.in_pad = w.in = in, w.out_pad = w.out = out;
  void* t = dalloc<uint8_t>(w.trellis_bytes());
  fill(t, w.trellis_bytes() / 4, kBits32, 0);
  w.trellis = t, w.suh = signf16(size_t(in), 1.0f), w.svh = signf16(size_t(out), 0.02f);
  return w;
}
// The same with its trellis in pinned host memory, read by the kernels over PCIe (the engine's zero-copy cold experts).
Exl3Dev exl3_weight_host(int out, int in) {
  Exl3Dev w;
  w.K = g_bits, w.cb = 2, w.in_pad = w.in = in, w.out_pad = w.out = out;
  void *h = nullptr, *t = nullptr;
  CK(cudaHostAlloc(&h, w.trellis_bytes(), cudaHostAllocMapped));  // freed at exit
  CK(cudaHostGetDevicePointer(&t, h, 0));
  fill(t, w.trellis_bytes() / 4, kBits32, 0);
  w.trellis = t, w.suh = signf16(size_t(in), 1.0f), w.svh = signf16(size_t(out), 0.02f);
  return w;
}
template <class Make>
auto make_pool(double bytes, Make&& make) {
  Pool<decltype(make())> p;
  for (int c = copies(bytes); c > 0; --c) p.v.push_back(make());
  return p;
}
Pool<Exl3Dev> exl3_pool(int out, int in) {
  return make_pool(double(in) * out * g_bits / 8, [=] { return exl3_weight(out, in); });
}
Pool<float*> f32_pool(size_t n, float scale, float mean = 0) {
  return make_pool(double(n) * 4, [=] { return randf(n, scale, mean); });
}
Pool<uint16_t*> bf16_pool(size_t n, float scale) {
  return make_pool(double(n) * 2, [=] { return randbf16(n, scale); });
}

// ---- weights, state and activations of one layer of each kind (the engine's DevLayer / s.* for 1 token)
struct Weights {
  Pool<float*> hc_fn;  // [(2+n)*n][n*D], both mHC sites
  float *hc_scale, *hc_base, *norm_w, *final_norm;
  Pool<Exl3Dev> qkv[3], f_a, f_b, g_a, g_b, o_kda;  // KDA (q, k, v: three EXL3 parts of one linear)
  Pool<const Exl3Dev*> fg_a, fg_b;                  // device {f_a, g_a} / {f_b, g_b}: decode runs them as pairs
  Pool<const Exl3Dev*> qkv_tab;                     // device {q, k, v}: decode runs the parts as one group
  Pool<uint16_t*> b;
  Pool<float*> conv_w, conv_state, rec_state;
  float *dt_bias, *a_log, *o_norm;
  Pool<Exl3Dev> q_a, q_b, kv_a, o_mla;  // MLA
  Pool<uint16_t*> w_uk, w_uv;
  float *q_a_norm, *kv_a_norm;
  Pool<uint16_t*> wq_b, wk, pool_gate, weights_proj;  // indexer (bf16: the converter keeps .indexer. exact)
  float *k_norm_w, *k_norm_b, *ape, *open;
  Pool<float*> router;  // MoE: fp32 router, EXL3 experts
  float* router_bias;
  Exl3Dev expert_shape[3];
  const Exl3Dev* tab;           // device [3][E + 1]: entry E is the shared expert
  const Exl3Dev* tab_host;      // the same, the routed experts kHostExperts distinct ones in pinned host memory
  Pool<Exl3Dev> shared_sep[3];  // routed experts' weights as separate linears (the unfused shared-expert path)
  const Exl3Dev* shared_gu;     // device [2]: the shared expert's gate, up (its DevLinear::parts)
  Exl3Dev shared_down;
  Pool<Exl3Dev> lm_head;
} W;

struct Buffers {
  float *x, *h, *y, *post, *comb, *hc_part, *step_part, *xh, *yr, *xh_side, *yr_side;
  uint16_t* xb;
  float *lraw, *lqkv, *low, *g, *beta, *o, *gate;
  float *q_lat, *q, *kv, *qcat, *olat, *attn_out, *part;
  float *iq, *ik, *ig, *ihw;
  int32_t* sel;
  float *logits_r, *route_part, *w, *gu, *act, *mgu, *ysorted, *logits;
  int32_t *ids, *pair_ids, *tri_ids,
      *rand_ids;  // rand_ids [kCalls][KK]: the shared expert E, then 8 distinct random experts
  uint32_t *counts, *tokens, *route_ticket;
  unsigned *tickets, *tickets_side;  // exl3_gemv_out's counters (kTickets each, zero)
} B;

// One context length: latent caches (rotating copies), pooled keys, random selections, position ctx - 1.
struct Ctx {
  int ctx = 0, max_pools = 0, ncache = 0;
  std::string label;
  DeviceLayerCache* lc = nullptr;  // device [ncache]
  Pool<float*> pool_k;             // [max_pools][ID]
  int32_t* pos0 = nullptr;
  int32_t* sel = nullptr;   // [kCalls][SELW]: 512 random pools x 4 positions, ascending, -1 padded
  float* scores = nullptr;  // kpool_select scratch
};

Ctx make_ctx(int ctx, const char* label, std::mt19937& rng) {
  Ctx c;
  c.ctx = ctx, c.label = label, c.max_pools = ctx / KPOOL + 1;
  c.ncache = copies(double(ctx) * R * 2);
  std::vector<DeviceLayerCache> tab(size_t(c.ncache));
  for (auto& t : tab) t.kv = randbf16(size_t(ctx) * R, 1.0f);
  c.lc = upload(tab);
  c.pool_k = f32_pool(size_t(c.max_pools) * ID, 1.0f);
  c.pos0 = upload(std::vector<int32_t>{ctx - 1});
  std::vector<int32_t> sel(size_t(kCalls) * SELW, -1), pools(size_t(ctx / KPOOL));
  for (int i = 0; i < kCalls; ++i) {
    std::iota(pools.begin(), pools.end(), 0);
    for (size_t j = 0; j < size_t(BUDGET); ++j) std::swap(pools[j], pools[j + rng() % (pools.size() - j)]);
    std::sort(pools.begin(), pools.begin() + BUDGET);
    for (int j = 0; j < BUDGET; ++j)
      for (int t = 0; t < KPOOL; ++t) sel[size_t(i) * SELW + size_t(j * KPOOL + t)] = pools[size_t(j)] * KPOOL + t;
  }
  c.sel = upload(sel);
  c.scores = dalloc<float>(kpool_select_scratch(1, c.max_pools, BUDGET));  // + the split top-k's candidates
  return c;
}

void setup(std::mt19937& rng) {
  W.hc_fn = f32_pool(size_t((2 + NS) * NS) * NS * D, 0.01f);
  W.hc_scale = randf(3, 0.1f, 1.0f), W.hc_base = randf((2 + NS) * NS, 0.5f);
  W.norm_w = randf(D, 0.1f, 1.0f), W.final_norm = randf(D, 0.1f, 1.0f);
  for (auto& p : W.qkv) p = exl3_pool(KHD, D);
  W.f_a = exl3_pool(KD, D), W.f_b = exl3_pool(KHD, KD), W.g_a = exl3_pool(KD, D), W.g_b = exl3_pool(KHD, KD);
  W.o_kda = exl3_pool(D, KHD);
  for (size_t c = 0; c < W.qkv[0].v.size(); ++c)
    W.qkv_tab.v.push_back(upload(std::vector<Exl3Dev>{W.qkv[0].v[c], W.qkv[1].v[c], W.qkv[2].v[c]}));
  for (size_t c = 0; c < W.f_a.v.size(); ++c) W.fg_a.v.push_back(upload(std::vector<Exl3Dev>{W.f_a.v[c], W.g_a.v[c]}));
  for (size_t c = 0; c < W.f_b.v.size(); ++c) W.fg_b.v.push_back(upload(std::vector<Exl3Dev>{W.f_b.v[c], W.g_b.v[c]}));
  W.b = bf16_pool(size_t(KH) * D, 0.02f);
  W.conv_w = f32_pool(size_t(KC) * KCONV, 0.5f);
  W.conv_state = f32_pool(size_t(KCONV - 1) * KC, 1.0f);
  W.rec_state = f32_pool(size_t(KH) * KD * KD, 0.05f);
  W.dt_bias = randf(KHD, 0.5f), W.a_log = randf(KH, 0.5f), W.o_norm = randf(KD, 0.1f, 1.0f);
  W.q_a = exl3_pool(QL, D), W.q_b = exl3_pool(MH * DN, QL), W.kv_a = exl3_pool(R, D), W.o_mla = exl3_pool(D, MH * DV);
  W.w_uk = bf16_pool(size_t(MH) * DN * R, 0.05f), W.w_uv = bf16_pool(size_t(MH) * DV * R, 0.05f);
  W.q_a_norm = randf(QL, 0.1f, 1.0f), W.kv_a_norm = randf(R, 0.1f, 1.0f);
  W.wq_b = bf16_pool(size_t(IH) * ID * QL, 0.02f), W.wk = bf16_pool(size_t(ID) * D, 0.02f);
  W.pool_gate = bf16_pool(size_t(ID) * D, 0.02f), W.weights_proj = bf16_pool(size_t(IH) * D, 0.02f);
  W.k_norm_w = randf(ID, 0.1f, 1.0f), W.k_norm_b = randf(ID, 0.1f), W.ape = randf(size_t(KPOOL) * ID, 0.5f);
  W.open = randf(size_t(2) * KPOOL * ID, 1.0f);
  W.router = f32_pool(size_t(E) * D, 0.02f), W.router_bias = randf(E, 0.01f);
  const int shapes[3][2] = {{I, D}, {I, D}, {D, I}};  // gate, up, down (out x in)
  std::vector<Exl3Dev> tab(size_t(3) * (E + 1));
  for (int p = 0; p < 3; ++p) {
    for (int e = 0; e <= E; ++e) tab[size_t(p * (E + 1) + e)] = exl3_weight(shapes[p][0], shapes[p][1]);
    W.expert_shape[p] = tab[size_t(p * (E + 1))];
    for (int e = 0; e < kCalls; ++e) W.shared_sep[p].v.push_back(tab[size_t(p * (E + 1) + e)]);
  }
  W.tab = upload(tab);
  std::vector<Exl3Dev> host(size_t(3) * kHostExperts);
  for (int p = 0; p < 3; ++p)
    for (int e = 0; e < kHostExperts; ++e)
      host[size_t(p * kHostExperts + e)] = exl3_weight_host(shapes[p][0], shapes[p][1]);
  for (int p = 0; p < 3; ++p)
    for (int e = 0; e < E; ++e) tab[size_t(p * (E + 1) + e)] = host[size_t(p * kHostExperts + e % kHostExperts)];
  W.tab_host = upload(tab);
  W.shared_gu = upload(std::vector<Exl3Dev>{tab[size_t(E)], tab[size_t(2 * E + 1)]});
  W.shared_down = tab[size_t(3 * E + 2)];
  W.lm_head = exl3_pool(VOCAB, D);

  B.x = randf(size_t(NS) * D, 1.0f), B.h = randf(D, 1.0f), B.y = randf(D, 1.0f);
  B.post = randf(NS, 0.5f, 1.0f), B.comb = randf(NS * NS, 0.1f, 0.25f);
  B.hc_part = randf(hyper_enter_scratch(1, NS), 1.0f);
  B.step_part = dalloc<float>(hyper_step_scratch(NS));
  CK(cudaMemset(B.step_part, 0, hyper_step_scratch(NS) * 4));  // hyper_step's counters
  B.xh = dalloc<float>(size_t(16) * 16384), B.yr = dalloc<float>(kYrFloats);
  B.xh_side = dalloc<float>(size_t(16) * 16384), B.yr_side = dalloc<float>(kYrFloats);
  B.tickets = dalloc<unsigned>(kTickets), B.tickets_side = dalloc<unsigned>(kTickets);
  CK(cudaMemset(B.tickets, 0, kTickets * sizeof(unsigned)));
  CK(cudaMemset(B.tickets_side, 0, kTickets * sizeof(unsigned)));
  B.xb = dalloc<uint16_t>(size_t(MH) * DV);
  B.lraw = randf(KC, 1.0f), B.lqkv = randf(KC, 0.1f), B.low = randf(2 * KD, 1.0f), B.g = randf(2 * KHD, 1.0f);
  B.beta = randf(KH, 1.0f), B.o = randf(KHD, 1.0f), B.gate = randf(KHD, 1.0f);
  B.q_lat = randf(QL, 1.0f), B.q = randf(size_t(MH) * DN, 1.0f), B.kv = randf(R, 1.0f);
  B.qcat = randf(size_t(MH) * R, 1.0f), B.olat = randf(size_t(MH) * R, 1.0f), B.attn_out = randf(size_t(MH) * DV, 1.0f);
  B.part = dalloc<float>(mla_split_floats(1, MH, R));
  B.iq = randf(size_t(IH) * ID, 1.0f), B.ik = randf(ID, 1.0f), B.ig = randf(ID, 1.0f), B.ihw = randf(IH, 0.2f);
  B.sel = dalloc<int32_t>(SELW);
  B.logits_r = randf(E, 1.0f), B.w = randf(KK, 0.1f, 0.3f), B.gu = randf(size_t(2) * I, 1.0f), B.act = randf(I, 1.0f);
  B.mgu = randf(size_t(KK) * 2 * I, 1.0f), B.ysorted = randf(size_t(KK) * D, 1.0f), B.logits = dalloc<float>(VOCAB);
  std::vector<int32_t> ids(size_t(kCalls) * KK), perm(E);
  for (int i = 0; i < kCalls; ++i) {
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    ids[size_t(i) * KK] = E;
    for (int j = 0; j < TOPK; ++j) ids[size_t(i) * KK + 1 + size_t(j)] = perm[size_t(j)];
  }
  B.pair_ids = upload(std::vector<int32_t>{0, 1}), B.tri_ids = upload(std::vector<int32_t>{0, 1, 2});
  B.rand_ids = upload(ids), B.ids = upload(std::vector<int32_t>(ids.begin(), ids.begin() + KK));
  B.counts = upload(std::vector<uint32_t>(E + 1, 0)), B.tokens = upload(std::vector<uint32_t>(1, 0));
  B.route_part = dalloc<float>(route_fused_floats(1, E, D)), B.route_ticket = upload(std::vector<uint32_t>(1, 0));
}

// ---- the engine's launch sequences (same order and arguments as its decode path)
// The GEMV with its input rotation and the output rotation (summing the GEMV's K parts), fused where it can be.
void exl3_chain(const Exl3Dev& shape, Exl3Group g, Exl3Src src, int n, float* y, int64_t y_ld) {
  exl3_gemv_out(shape, g, src, n, B.xh, B.yr, kYrFloats, Exl3Tickets{B.tickets, kTickets}, y, y_ld, nullptr, g_st);
}
void exl3_linear(const Exl3Dev& w, const float* x, float* y, int64_t y_ld) {  // Impl::exl3_forward, n = 1
  g_bytes += double(w.bytes());
  exl3_chain(w, {}, Exl3Src{x, w.in}, 1, y, y_ld);
}
// Impl::linear over bf16 weights: bf16_gemv for n <= kBf16GemvMaxRows, else (cublas) to_bf16 + cublasGemmEx.
void bf16_linear(const uint16_t* w, int out, int in, const float* x, float* y, bool cublas = false) {
  g_bytes += double(out) * in * 2;
  if (!cublas) return bf16_gemv(w, out, in, x, 1, nullptr, y, g_st);
  const float one = 1.0f, zero = 0.0f;
  to_bf16(x, in, B.xb, g_st);
  CB(cublasGemmEx(g_blas, CUBLAS_OP_T, CUBLAS_OP_N, out, 1, in, &one, w, CUDA_R_16BF, in, B.xb, CUDA_R_16BF, in, &zero,
                  y, CUDA_R_32F, out, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

// Impl::exl3_group of two: two linears of one shape in one grouped call, rows 0 and 1 of y (y_ld apart).
void exl3_pair(const Exl3Dev& shape, const Exl3Dev* tab, Exl3Src src, float* y, int64_t y_ld) {
  g_bytes += 2.0 * double(shape.bytes());
  exl3_chain(shape, Exl3Group{tab, B.pair_ids}, src, 2, y, y_ld);
}
// Impl::linear for one token over parts of one shape (DevLinear::parts): q | k | v as one grouped call.
void qkv_group(int i) {
  const Exl3Dev& shape = W.qkv[0][i];
  g_bytes += 3.0 * double(shape.bytes());
  exl3_chain(shape, Exl3Group{W.qkv_tab[i], B.tri_ids}, Exl3Src{B.h, D, nullptr, 3}, 3, B.lraw, KHD);
}
void fg_pairs(int i) {  // low rows 0, 1 = f_a x, g_a x; then g = f_b low0 (row 0), gate = g_b low1 (row 1)
  exl3_pair(W.f_a[i], W.fg_a[i], Exl3Src{B.h, D, nullptr, 2}, B.low, KD);
  exl3_pair(W.f_b[i], W.fg_b[i], Exl3Src{B.low, KD}, B.g, KHD);
}

// As the engine (Impl::on_proj_side): decode projections that read only h on a side stream, each EXL3 call there
// through its own scratch; join_side() before their outputs are read.
HyperSide g_pside;
bool g_pside_pending = false;
bool switch_default_on(const char* name) {  // an engine default that the variable set to 0 turns off
  const char* v = std::getenv(name);
  return !v || std::atoi(v) != 0;
}
bool proj_side_off() { return !switch_default_on("MOESRV_PROJ_SIDE"); }  // MOESRV_PROJ_SIDE=0, as the engine
template <class F>
void on_side(F&& f) {
  if (proj_side_off()) return f();
  CK(cudaEventRecord(g_pside.fork, g_st));
  CK(cudaStreamWaitEvent(g_pside.stream, g_pside.fork, 0));
  auto flip = [] {
    std::swap(g_st, g_pside.stream);
    std::swap(B.xh, B.xh_side);
    std::swap(B.yr, B.yr_side);
    std::swap(B.tickets, B.tickets_side);
  };
  flip();
  f();
  flip();
  g_pside_pending = true;
}
void join_side() {
  if (!g_pside_pending) return;
  CK(cudaEventRecord(g_pside.join, g_pside.stream));
  CK(cudaStreamWaitEvent(g_st, g_pside.join, 0));
  g_pside_pending = false;
}

// As the engine: the Sinkhorn weights on a side stream, joined before the leave reads them.
HyperSide g_side;
bool g_side_pending = false;
void hc_join() {
  if (g_side_pending) CK(cudaStreamWaitEvent(g_st, g_side.join, 0));
  g_side_pending = false;
}
void hc_enter(int i) {
  g_bytes += double((2 + NS) * NS) * NS * D * 4;
  g_side_pending = hyper_enter(B.x, 1, NS, D, W.hc_fn[i], W.hc_scale, W.hc_base, W.norm_w, RMS_EPS, HC_EPS, HC_ITERS,
                               B.h, B.post, B.comb, B.hc_part, g_st, nullptr, &g_side);
}
void hc_leave() {
  hc_join();
  hyper_leave(B.x, B.y, B.post, B.comb, 1, NS, D, g_st);
}
// Prefill mHC sites (--only prefill): kHcTokens tokens through the engine's calls, hyper_enter with cuBLAS (the
// logits GEMM, the X . X dots, the per-token weights and h) and hyper_leave; GB/s of the bytes a fused site must move
// (enter: x read once, h written; leave: x read and written, y read).
constexpr int kHcTokens = 2048;
struct HcPrefill {
  float *x = nullptr, *y = nullptr, *h = nullptr, *post = nullptr, *comb = nullptr;
} HP;
void hc_prefill_setup() {
  if (HP.x) return;
  HP.x = randf(size_t(kHcTokens) * NS * D, 1.0f), HP.y = randf(size_t(kHcTokens) * D, 1.0f);
  HP.h = dalloc<float>(size_t(kHcTokens) * D);
  HP.post = randf(size_t(kHcTokens) * NS, 0.5f, 1.0f), HP.comb = randf(size_t(kHcTokens) * NS * NS, 0.05f, 0.2f);
}
void hc_prefill_enter(int i) {
  g_bytes += double(kHcTokens) * (NS + 1) * D * 4;
  hyper_enter(HP.x, kHcTokens, NS, D, W.hc_fn[i], W.hc_scale, W.hc_base, W.norm_w, RMS_EPS, HC_EPS, HC_ITERS, HP.h,
              HP.post, HP.comb, nullptr, g_st, g_blas);
}
void hc_prefill_leave() {
  g_bytes += double(kHcTokens) * (2 * NS + 1) * D * 4;
  hyper_leave(HP.x, HP.y, HP.post, HP.comb, kHcTokens, NS, D, g_st);
}
void hc_step(int i) {  // the previous site's leave and this site's enter (CudaBlocks' decode path)
  if (!hyper_step_supported(1, NS, D)) return hc_leave(), hc_enter(i);  // MOESRV_MHC_UNFUSED=1
  hc_join();
  g_bytes += double((2 + NS) * NS) * NS * D * 4;
  g_side_pending = hyper_step(B.x, B.y, 1, NS, D, W.hc_fn[i], W.hc_scale, W.hc_base, W.norm_w, RMS_EPS, HC_EPS,
                              HC_ITERS, B.h, B.post, B.comb, B.step_part, g_st, &g_side);
}

void delta(int i) {
  DeltaRuleArgs a;
  a.T = 1, a.heads = KH, a.dk = KD, a.dv = KD, a.per_channel_decay = true;
  a.q = B.lqkv, a.k = B.lqkv + KHD, a.qk_stride = KC, a.v = B.lqkv + 2 * KHD, a.v_stride = KC;
  a.g = B.g, a.beta = B.beta, a.state = W.rec_state[i], a.out = B.o;
  g_bytes += 2.0 * KH * KD * KD * 4;  // state read + write
  delta_rule(a, g_st);
}
// A prefill's recurrence over kDeltaT tokens (the engine's linear_core phase per KDA layer).
// form: 0 the recurrence; else the chunked form with scratch as the engine lends it (the pre-conv rows, 2/3 of the
// run per launch pair): 1 whole, 2 its chunk-local kernels alone, 3 its state kernels alone.
constexpr int kDeltaT = 1024;
void delta_prefill(int i, int form) {
  static float *qkv = randf(size_t(kDeltaT) * KC, 0.05f), *g = randf(size_t(kDeltaT) * KHD, 0.02f, -0.05f),
               *beta = randf(size_t(kDeltaT) * KH, 0.1f, 0.5f), *out = dalloc<float>(size_t(kDeltaT) * KHD),
               *scratch = dalloc<float>(size_t(kDeltaT) * KC);
  DeltaRuleArgs a;
  if (form) a.chunk_scratch = scratch, a.chunk_scratch_floats = int64_t(kDeltaT) * KC;
  a.T = kDeltaT, a.heads = KH, a.dk = KD, a.dv = KD, a.per_channel_decay = true;
  a.q = qkv, a.k = qkv + KHD, a.qk_stride = KC, a.v = qkv + 2 * KHD, a.v_stride = KC;
  a.g = g, a.beta = beta, a.state = W.rec_state[i], a.out = out;
  g_bytes += 2.0 * KH * KD * KD * 4 + double(kDeltaT) * (KC + KHD + KH + KHD) * 4;
  if (form >= 1) delta_rule_chunked(a, g_st, form - 1);
  else delta_rule(a, g_st);
}
void l2norms() {
  l2norm_rows(B.lqkv, 1, KH, KC, KD, 1e-6f, 1.0f / std::sqrt(float(KD)), g_st);
  l2norm_rows(B.lqkv + KHD, 1, KH, KC, KD, 1e-6f, 1.0f, g_st);
}
void kda_fused(int i) {  // conv .. output norm in one launch (kda_decode.cu)
  KdaDecodeArgs a;
  a.heads = KH, a.dk = KD, a.dv = KD, a.conv_k = KCONV;
  a.qkv = B.lraw, a.conv_w = W.conv_w[i], a.conv_state = W.conv_state[i];
  a.g = B.g, a.dt_bias = W.dt_bias, a.a_log = W.a_log, a.lower_bound_set = true, a.lower_bound = -5.0f;
  a.beta = B.beta, a.state = W.rec_state[i], a.gate = B.g + KHD, a.norm_w = W.o_norm;
  a.l2_eps = 1e-6f, a.q_scale = 1.0f / std::sqrt(float(KD)), a.norm_eps = RMS_EPS, a.out = B.o;
  g_bytes += 2.0 * KH * KD * KD * 4;  // state read + write
  kda_decode(a, g_st);
}
void kda(int i) {  // Impl::kda for S = 1 (its decode path: EXL3 pairs, one fused kernel between the linears)
  if (!kda_decode_supported(KD, KD, KCONV)) throw std::runtime_error("kda_decode does not support d=128, conv 4");
  on_side([i] {
    bf16_linear(W.b[i], KH, D, B.h, B.beta);
    fg_pairs(i);
  });
  qkv_group(i);
  join_side();
  kda_fused(i);
  exl3_linear(W.o_kda[i], B.o, B.y, D);
}

void kpool_sel(int i, const Ctx& c) {
  g_bytes += double(c.ctx / KPOOL) * ID * 4;  // the completed pools' keys
  kpool_select(B.iq, B.ihw, c.pool_k[i], 1, IH, ID, KPOOL, BUDGET, true, c.pos0, c.max_pools, c.scores,
               kpool_select_scratch(1, c.max_pools, BUDGET), B.sel, SELW, g_st, 1.0f / std::sqrt(float(IH)));
}
void kpool_keys(int i) {  // Impl::kpool_indexer_keys
  bf16_linear(W.wk[i], ID, D, B.h, B.ik);
  bf16_linear(W.pool_gate[i], ID, D, B.h, B.ig);
  bf16_linear(W.weights_proj[i], IH, D, B.h, B.ihw);
  layer_norm(B.ik, W.k_norm_w, W.k_norm_b, 1, ID, 1e-6f, B.ik, g_st);
}
// Impl::kpool_indexer (after kpool_keys): the pools and the selection after the keys, on the side stream (beside)
// or after joining it.
void kpool_indexer(int i, const Ctx& c, bool beside) {
  bf16_linear(W.wq_b[i], IH * ID, QL, B.q_lat, B.iq);
  auto pools = [i, &c] {
    kpool_append(B.ik, B.ig, W.ape, 1, ID, KPOOL, c.pos0, c.pool_k[i], W.open, W.open + KPOOL * ID, g_st);
    kpool_sel(i, c);
  };
  if (beside) return on_side(pools);
  join_side();
  pools();
}
void mla_query_call(int i) {
  g_bytes += double(MH) * DN * R * 2;
  mla_query(B.q, W.w_uk[i], 1, MH, DN, 0, R, B.qcat, g_st);
}
void mla_output_call(int i) {
  g_bytes += double(MH) * DV * R * 2;
  mla_output(B.olat, W.w_uv[i], 1, MH, DV, R, B.attn_out, g_st);
}
void mla_attend(int i, const Ctx& c, bool split, const int32_t* sel) {
  AttentionArgs a;
  a.q = B.qcat, a.S = 1, a.H = MH, a.q_dim = R, a.v_dim = R, a.mla = true;
  a.lc = c.lc + i % c.ncache, a.selection = sel, a.sel_k = SELW, a.pos0 = c.pos0, a.scale = MLA_SCALE, a.out = B.olat;
  g_bytes += double(TOPK_KEYS) * R * 2;  // selected latent rows
  if (!split) return attention(a, g_st);
  if (!mla_split_supported(a)) throw std::runtime_error("mla_split_attention: shape not supported");
  mla_split_attention(a, B.part, g_st);
}
void mla(int i, const Ctx& c) {  // Impl::attention_mla (rope is a no-op at qk_rope 0; mla_split_decode on)
  on_side([i, &c] {
    exl3_linear(W.kv_a[i], B.h, B.kv, R);
    rms_norm(B.kv, R, W.kv_a_norm, 1, R, 1e-6f, B.kv, R, g_st);
    cache_write(B.kv, R, 1, R, c.lc + i % c.ncache, CacheField::Kv, false, c.pos0, g_st);
    kpool_keys(i);
  });
  static const bool kpool_early = switch_default_on("MOESRV_KPOOL_SIDE");  // the indexer before q_b, beside it
  exl3_linear(W.q_a[i], B.h, B.q_lat, QL);
  rms_norm(B.q_lat, QL, W.q_a_norm, 1, QL, 1e-6f, B.q_lat, QL, g_st);
  if (kpool_early) kpool_indexer(i, c, true);
  exl3_linear(W.q_b[i], B.q_lat, B.q, MH * DN);
  if (!kpool_early) kpool_indexer(i, c, false);
  mla_query_call(i);
  join_side();
  mla_attend(i, c, true, B.sel);
  mla_output_call(i);
  exl3_linear(W.o_mla[i], B.attn_out, B.y, D);
}

void router(int i) {
  g_bytes += double(E) * D * 4;
  const float one = 1.0f, zero = 0.0f;
  CB(cublasSgemm(g_blas, CUBLAS_OP_T, CUBLAS_OP_N, E, 1, D, &one, W.router[i], D, B.h, D, &zero, B.logits_r, E));
}
RouterArgs router_args(bool shared = true) {
  RouterArgs ra;
  ra.E = E, ra.groups = 1, ra.topk_groups = 1, ra.k = TOPK, ra.norm_topk = true, ra.softmax = false;
  ra.scaling = ROUTED_SCALING, ra.shared_id = shared ? E : -1, ra.counts = B.counts, ra.tokens = B.tokens;
  return ra;
}
void route_call() { route(B.logits_r, W.router_bias, 1, router_args(), B.ids, B.w, g_st); }
void route_fused_call(int i, bool shared = true) {  // Impl::moe for decode: the logits and the routing in one launch
  g_bytes += double(E) * D * 4;
  route_fused(W.router[i], B.h, W.router_bias, 1, D, router_args(shared), B.route_part, B.route_ticket, B.ids, B.w,
              g_st);
}
// One grouped projection over M entries (expert ids[r]; the tab holds E + 1 per projection). Down reads the SwiGLU
// of the gate|up rows while rotating its input (Impl::moe_exl3_grouped).
void experts_part(int p, const int32_t* ids, int M, const Exl3Dev* tab = W.tab) {
  const Exl3Dev& shape = W.expert_shape[p];
  const Exl3Group g{tab + p * (E + 1), ids};
  const Exl3Src src = p < 2 ? Exl3Src{B.h, D, nullptr, M} : Exl3Src{B.mgu, 2 * I, nullptr, 1, true, LIMIT};
  g_bytes += double(M) * double(shape.bytes());
  if (p < 2) exl3_chain(shape, g, src, M, B.mgu + p * I, 2 * I);
  else exl3_chain(shape, g, src, M, B.ysorted, D);
}
// gate and up as the two parts of one grouped call, as the engine runs them when their shapes match.
void experts_gate_up(const int32_t* ids, int M, const Exl3Dev* tab = W.tab) {
  const Exl3Dev& shape = W.expert_shape[0];
  g_bytes += 2.0 * double(M) * double(shape.bytes());
  exl3_chain(shape, Exl3Group{tab, ids, M, E + 1, I}, Exl3Src{B.h, D, nullptr, M}, 2 * M, B.mgu, 2 * I);
}
void experts(const int32_t* ids, int M, const Exl3Dev* tab = W.tab) {
  experts_gate_up(ids, M, tab);
  experts_part(2, ids, M, tab);
}
// Impl::shared_expert_exl3: gate | up as one grouped call of the shared expert's two parts, then down over their
// SwiGLU, into y. (Every call uses the same shared expert, entry E, as the grouped path's rows do.)
void shared_expert() {
  g_bytes += 3.0 * double(W.shared_down.bytes());
  exl3_chain(W.expert_shape[0], Exl3Group{W.shared_gu, B.pair_ids}, Exl3Src{B.h, D, nullptr, 2}, 2, B.gu, I);
  exl3_chain(W.shared_down, {}, Exl3Src{B.gu, 2 * I, nullptr, 1, true, LIMIT}, 1, B.y, D);
}
void moe(int i) {  // Impl::moe, all experts in VRAM
  static const bool side = switch_default_on("MOESRV_SHARED_SIDE") && !proj_side_off();
  if (side) {  // the shared expert on the side stream beside the router and the routed experts
    on_side([] { shared_expert(); });
    route_fused_call(i, false);
    experts(B.ids, TOPK);
    join_side();
    moe_combine(B.y, B.ysorted, nullptr, B.w, nullptr, 1, TOPK, D, g_st);
    return;
  }
  route_fused_call(i);  // (default) the shared expert grouped with the routed ones
  experts(B.ids, KK);
  moe_combine(B.y, B.ysorted, nullptr, B.w, nullptr, 1, KK, D, g_st, true);
}
// Prefill experts (issue 20): 16 experts x 192 rows through the gate projection (2048x4096, fp16 rotated input), the
// grouped GEMM (tiles of exl3_gemm_tile_rows()) vs each expert's dequantization + cuBLAS (the engine's other path);
// form 4 also with 512 rows per expert (kPrefillRowsMax).
constexpr int kPrefillExperts = 16, kPrefillRows = 192, kPrefillRowsMax = 512;
using TileCache = std::vector<std::pair<int, std::pair<Exl3GemmTile*, int>>>;  // key -> device tiles, their count
struct PrefillBufs {
  uint16_t *xh = nullptr, *w16 = nullptr;
  float *yr = nullptr, *y = nullptr;
  TileCache tiles;  // per tile rows x rows per expert
} P;
void prefill_setup() {
  if (P.xh) return;
  std::mt19937 rng(7);
  std::normal_distribution<float> nd;
  std::vector<uint16_t> x(size_t(kPrefillExperts) * kPrefillRowsMax * D);
  for (auto& v : x) v = __half_as_ushort(__float2half_rn(nd(rng)));
  P.xh = upload(x);
  P.yr = dalloc<float>(size_t(kPrefillExperts) * kPrefillRowsMax * I), P.w16 = dalloc<uint16_t>(size_t(I) * D);
  P.y = dalloc<float>(size_t(kPrefillExperts) * kPrefillRowsMax * I);
}
// The device tiles cached under `key` in `cache`, made by build() (host tiles) the first time.
template <typename Build>
std::pair<Exl3GemmTile*, int> cached_tiles(TileCache& cache, int key, Build build) {
  for (const auto& [k, t] : cache)
    if (k == key) return t;
  const std::vector<Exl3GemmTile> tiles = build();
  cache.push_back({key, {tiles.empty() ? nullptr : upload(tiles), int(tiles.size())}});
  return cache.back().second;
}
std::pair<Exl3GemmTile*, int> prefill_tiles(int tile_rows, int rows) {
  return cached_tiles(P.tiles, tile_rows | (rows << 12), [&] {
    std::vector<Exl3GemmTile> tiles;
    for (int e = 0; e < kPrefillExperts; ++e)
      for (int r = 0; r < rows; r += tile_rows) tiles.push_back({e, e * rows + r, std::min(tile_rows, rows - r), 0});
    return tiles;
  });
}
// tile_rows 0: the form's (exl3_gemm_form_rows)
void prefill_grouped(int form, bool rotate_out = false, int tile_rows = 0, int rows = kPrefillRows) {
  g_bytes += double(kPrefillExperts) * double(W.expert_shape[0].bytes());
  if (!tile_rows) tile_rows = exl3_gemm_form_rows(form < 0 ? exl3_gemm_form() : form);
  const auto [tiles, n_tiles] = prefill_tiles(tile_rows, rows);
  exl3_grouped_gemm(W.expert_shape[0], W.tab, tiles, n_tiles, P.xh, P.yr, g_st, tile_rows, form,
                    rotate_out ? P.y : nullptr, I);
}
void prefill_cublas(int rows = kPrefillRows) {
  g_bytes += double(kPrefillExperts) * double(W.expert_shape[0].bytes());
  for (int e = 0; e < kPrefillExperts; ++e)
    exl3_gemm_rotated(W.shared_sep[0][e], P.xh + size_t(e) * rows * D, rows, P.yr + size_t(e) * rows * I, P.w16,
                      size_t(I) * D, false, g_blas, g_st);
}

// A prefill's dense EXL3 linear as the engine runs it for 2,048 rows (exl3_forward's row block), one row per step:
// input rotation (fp32 -> fp16 rows), W_hat dequantized into the slab, cuBLAS, output rotation. KDA's q (8192x4096).
constexpr int kDenseRows = 2048;
struct DenseBufs {
  float *x = nullptr, *yr = nullptr, *y = nullptr;
  uint16_t *xh = nullptr, *w16 = nullptr;
} DN_;
void dense_setup() {
  if (DN_.x) return;
  DN_.x = randf(size_t(kDenseRows) * D, 1.0f), DN_.xh = dalloc<uint16_t>(size_t(kDenseRows) * D);
  DN_.yr = dalloc<float>(size_t(kDenseRows) * KHD), DN_.y = dalloc<float>(size_t(kDenseRows) * KHD);
  DN_.w16 = dalloc<uint16_t>(size_t(KHD) * D);
}
void dense_step(int step) {
  const Exl3Dev& w = W.qkv[0][0];
  switch (step) {
    case 0: exl3_rotate_in(w, {}, Exl3Src{DN_.x, D}, kDenseRows, DN_.xh, true, g_st); break;
    case 1: exl3_dequant_rotated(w, 0, w.out_pad / 16, DN_.w16, g_st); break;
    case 2: exl3_gemm_rotated(w, DN_.xh, kDenseRows, DN_.yr, DN_.w16, size_t(KHD) * D, true, g_blas, g_st); break;
    default: exl3_rotate_out(w, {}, DN_.yr, kDenseRows, DN_.y, KHD, nullptr, g_st); break;
  }
}

// Skewed prefill pieces, as skewed routing leaves them in a wave (a few hot experts with long pieces, many short):
// 16 experts of 1024, 1024, 512, 512, 4 x 128 and 8 x 32 rows (3,840 rows). Pieces of at most `grouped_max` rows go
// through one grouped GEMM launch, the others each through dequantization + cuBLAS, all on one stream (the engine
// runs those beside the grouped launch on its expert lanes).
constexpr int kSkewRows[kPrefillExperts] = {1024, 1024, 512, 512, 128, 128, 128, 128, 32, 32, 32, 32, 32, 32, 32, 32};
struct SkewBufs {
  uint16_t* xh = nullptr;
  float* yr = nullptr;
  int row0[kPrefillExperts + 1] = {};
  TileCache tiles;  // per grouped_max x tile rows
} SK;
void prefill_skewed(int grouped_max, int form = -1) {
  if (!SK.xh) {
    for (int e = 0; e < kPrefillExperts; ++e) SK.row0[e + 1] = SK.row0[e] + kSkewRows[e];
    std::mt19937 rng(9);
    std::normal_distribution<float> nd;
    std::vector<uint16_t> x(size_t(SK.row0[kPrefillExperts]) * D);
    for (auto& v : x) v = __half_as_ushort(__float2half_rn(nd(rng)));
    SK.xh = upload(x), SK.yr = dalloc<float>(size_t(SK.row0[kPrefillExperts]) * I);
  }
  const int tr = form >= 0 ? exl3_gemm_form_rows(form) : exl3_gemm_tile_rows();
  const auto [tiles, n_tiles] = cached_tiles(SK.tiles, grouped_max ^ (tr << 24), [&] {
    std::vector<Exl3GemmTile> t;
    for (int e = 0; e < kPrefillExperts; ++e)
      if (kSkewRows[e] <= grouped_max)
        for (int r = 0; r < kSkewRows[e]; r += tr) t.push_back({e, SK.row0[e] + r, std::min(tr, kSkewRows[e] - r), 0});
    return t;
  });
  g_bytes += double(kPrefillExperts) * double(W.expert_shape[0].bytes());
  if (n_tiles) exl3_grouped_gemm(W.expert_shape[0], W.tab, tiles, n_tiles, SK.xh, SK.yr, g_st, tr, form, nullptr, I);
  for (int e = 0; e < kPrefillExperts; ++e)
    if (kSkewRows[e] > grouped_max)
      exl3_gemm_rotated(W.shared_sep[0][e], SK.xh + size_t(SK.row0[e]) * D, kSkewRows[e],
                        SK.yr + size_t(SK.row0[e]) * I, P.w16, size_t(I) * D, false, g_blas, g_st);
}

// Prefill attention and indexer (issue 20): kPrefillQueries query rows ending at the context's last position, as the
// engine's pass calls them (mla_prefill_attention; kpool_select's tensor-core scores and top-k), each query with its
// own random selection of 512 visible pools.
constexpr int kPrefillQueries = 512;
struct PrefillCtx {
  int32_t *pos0 = nullptr, *sel = nullptr, *sel_out = nullptr;
  float* scores = nullptr;
  size_t scratch = 0;
};
struct PrefillQ {
  float *q = nullptr, *out = nullptr, *iq = nullptr, *ihw = nullptr;
} PQ;
const PrefillCtx& prefill_ctx(const Ctx& c) {
  static std::vector<std::pair<int, PrefillCtx>> made;
  for (const auto& [ctx, p] : made)
    if (ctx == c.ctx) return p;
  if (!PQ.q) {
    PQ.q = randf(size_t(kPrefillQueries) * MH * R, 1.0f), PQ.out = dalloc<float>(size_t(kPrefillQueries) * MH * R);
    PQ.iq = randf(size_t(kPrefillQueries) * IH * ID, 1.0f), PQ.ihw = randf(size_t(kPrefillQueries) * IH, 1.0f);
  }
  std::mt19937 rng(uint32_t(c.ctx));
  PrefillCtx p;
  const int first = c.ctx - kPrefillQueries;
  p.pos0 = upload(std::vector<int32_t>{first});
  std::vector<int32_t> sel(size_t(kPrefillQueries) * SELW, -1), pools;
  for (int s = 0; s < kPrefillQueries; ++s) {
    pools.resize(size_t((first + s + 1) / KPOOL));
    std::iota(pools.begin(), pools.end(), 0);
    for (size_t j = 0; j < size_t(BUDGET); ++j) std::swap(pools[j], pools[j + rng() % (pools.size() - j)]);
    std::sort(pools.begin(), pools.begin() + BUDGET);
    for (int j = 0; j < BUDGET; ++j)
      for (int t = 0; t < KPOOL; ++t) sel[size_t(s) * SELW + size_t(j * KPOOL + t)] = pools[size_t(j)] * KPOOL + t;
  }
  p.sel = upload(sel), p.sel_out = dalloc<int32_t>(sel.size());
  p.scratch = kpool_select_scratch(kPrefillQueries, c.max_pools, BUDGET);
  p.scores = dalloc<float>(p.scratch);
  made.emplace_back(c.ctx, p);
  return made.back().second;
}
void prefill_mla(int i, const Ctx& c) {
  const PrefillCtx& p = prefill_ctx(c);
  AttentionArgs a;
  a.q = PQ.q, a.S = kPrefillQueries, a.H = MH, a.q_dim = R, a.v_dim = R, a.mla = true;
  a.lc = c.lc + i % c.ncache, a.selection = p.sel, a.sel_k = SELW, a.pos0 = p.pos0, a.scale = MLA_SCALE;
  a.out = PQ.out;
  g_bytes += double(kPrefillQueries) * TOPK_KEYS * R * 2;  // selected latent rows, once per query
  mla_prefill_attention(a, g_st);
}
void prefill_kpool(int i, const Ctx& c) {
  const PrefillCtx& p = prefill_ctx(c);
  g_bytes += double(c.ctx / KPOOL) * ID * 4;  // the pooled keys, once
  kpool_select(PQ.iq, PQ.ihw, c.pool_k[i], kPrefillQueries, IH, ID, KPOOL, BUDGET, true, p.pos0, c.max_pools, p.scores,
               p.scratch, p.sel_out, SELW, g_st, 1.0f / std::sqrt(float(IH)));
}

// ---- forwards of a few tokens (MTP verifies, batched steps): the engine's default batch path (rotate, the fp16-input
// batch GEMV, rotate out; grouped experts one entry per token and pick) against CudaEngineOptions::row_gemv's (the
// R-row GEMV; entries that share an expert merged). S tokens' inputs: RowsB::x.
constexpr int kRowsMax = kExl3SetRows;
constexpr size_t kRowsYr = size_t(kExl3GemvScratchParts) * 2 * kRowsMax * KK * I;
struct RowsB {
  float *x, *y, *xh, *yr, *mgu, *ys;
  int32_t *ids_rand, *ids_half;  // [kRowsMax][KK]: shared, then 8 picks; random, or half of them token 0's
  Exl3RowSet* sets;
} V;
void rows_setup(std::mt19937& rng) {
  V.x = randf(size_t(kRowsMax) * 16384, 1.0f), V.y = dalloc<float>(size_t(kRowsMax) * 16384);
  V.xh = dalloc<float>(size_t(2) * kRowsMax * KK * 16384), V.yr = dalloc<float>(kRowsYr);
  V.mgu = randf(size_t(kRowsMax) * KK * 2 * I, 1.0f), V.ys = dalloc<float>(size_t(kRowsMax) * KK * D);
  V.sets = dalloc<Exl3RowSet>(size_t(kRowsMax) * KK);
  std::vector<int32_t> rnd(size_t(kRowsMax) * KK), half(rnd.size()), perm(E);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  for (int t = 0; t < kRowsMax; ++t) {
    rnd[size_t(t) * KK] = half[size_t(t) * KK] = E;
    for (int j = 0; j < TOPK; ++j) {
      rnd[size_t(t) * KK + 1 + size_t(j)] = perm[size_t(t * TOPK + j)];
      half[size_t(t) * KK + 1 + size_t(j)] = j < TOPK / 2 ? perm[size_t(j)] : perm[size_t(t * TOPK + j)];
    }
  }
  V.ids_rand = upload(rnd), V.ids_half = upload(half);
}
void rows_linear(const Exl3Dev& w, int n, bool rows) {  // Impl::exl3_forward of n tokens
  g_bytes += double(w.bytes());
  if (!rows) {
    exl3_gemv_out(w, {}, Exl3Src{V.x, w.in}, n, V.xh, V.yr, kRowsYr, Exl3Tickets{B.tickets, kTickets}, V.y, w.out,
                  nullptr, g_st);
    return;
  }
  exl3_gemv_rows_out(w, {}, nullptr, n, Exl3Src{V.x, w.in}, n, V.xh, V.yr, V.y, w.out, nullptr, g_st);
}
void rows_experts(const int32_t* ids, int S, bool merged) {  // Impl::moe_exl3_grouped of S tokens (shared in group)
  const int M = S * KK;
  const Exl3Dev &gu = W.expert_shape[0], &down = W.expert_shape[2];
  const Exl3Group g_gu{W.tab, ids, M, E + 1, I}, g_down{W.tab + 2 * (E + 1), ids};
  const Exl3Src in{V.x, D, nullptr, KK}, act{V.mgu, 2 * I, nullptr, 1, true, LIMIT};
  if (!merged) {
    exl3_gemv_out(gu, g_gu, in, 2 * M, V.xh, V.yr, kRowsYr, Exl3Tickets{B.tickets, kTickets}, V.mgu, 2 * I, nullptr,
                  g_st);
    exl3_gemv_out(down, g_down, act, M, V.xh, V.yr, kRowsYr, Exl3Tickets{B.tickets, kTickets}, V.ys, D, nullptr, g_st);
    return;
  }
  exl3_row_sets(ids, M, V.sets, g_st);
  exl3_gemv_rows_out(gu, g_gu, V.sets, S, in, 2 * M, V.xh, V.yr, V.mgu, 2 * I, nullptr, g_st);
  exl3_gemv_rows_out(down, g_down, V.sets, S, act, M, V.xh, V.yr, V.ys, D, nullptr, g_st);
}

void shared_unfused(int i) {  // Impl::mlp over EXL3 gate|up (two parts), clamped SwiGLU, down
  exl3_linear(W.shared_sep[0][i], B.h, B.gu, 2 * I);
  exl3_linear(W.shared_sep[1][i], B.h, B.gu + I, 2 * I);
  silu_mul_clamped(B.gu, 1, I, LIMIT, B.act, g_st);
  exl3_linear(W.shared_sep[2][i], B.act, B.y, D);
}

// ---- timing
struct Row {
  std::string name;
  double us, nodes, gbps;  // per call
};
std::vector<Row> g_rows;
int g_reps = 20, g_warm = 3;
uint4* g_flush = nullptr;
size_t g_flush_n = 0;
unsigned* g_sink = nullptr;
cudaEvent_t g_ev[2];
int g_sms = 132;

void read_launch(const uint4* p, size_t n) {
  read_kernel<<<g_sms * 8, 256, 0, g_st>>>(p, n, g_sink);
  CK(cudaGetLastError());
}

// fn(i) queues call i on g_st. Eager call first (argument checks, cuBLAS set-up), then the 32-call graph.
const char* g_only = nullptr;  // --only: comma-separated name fragments; other rows are skipped

bool selected(const std::string& name) {
  if (!g_only) return true;
  const std::string list = g_only;
  for (size_t b = 0; b <= list.size();) {
    size_t e = list.find(',', b);
    if (e == std::string::npos) e = list.size();
    if (e > b && name.find(list.substr(b, e - b)) != std::string::npos) return true;
    b = e + 1;
  }
  return false;
}

std::string g_suffix;    // appended to the row names (--split-sweep)
bool g_profile = false;  // --profile: each selected entry once, as a one-call graph between cudaProfilerStart/Stop

template <class Fn>
void bench(const std::string& name, Fn&& fn) {
  if (!selected(name)) return;
  if (g_profile) {  // for ncu --profile-from-start off --graph-profiling node: one call's nodes
    fn(0);
    hc_join();
    CK(cudaStreamSynchronize(g_st));
    cudaGraph_t graph = nullptr;
    CK(cudaStreamBeginCapture(g_st, cudaStreamCaptureModeThreadLocal));
    fn(1);
    hc_join();  // (the last mHC site's side branch)
    CK(cudaStreamEndCapture(g_st, &graph));
    cudaGraphExec_t exec = nullptr;
    CK(cudaGraphInstantiate(&exec, graph, 0));
    CK(cudaProfilerStart());
    CK(cudaGraphLaunch(exec, g_st));
    CK(cudaStreamSynchronize(g_st));
    CK(cudaProfilerStop());
    std::fprintf(stderr, "  profiled %s\n", name.c_str());
    CK(cudaGraphExecDestroy(exec));
    CK(cudaGraphDestroy(graph));
    return;
  }
  g_bytes = 0;
  fn(0);
  hc_join();
  const double bytes = g_bytes;
  CK(cudaStreamSynchronize(g_st));
  CK(cudaGetLastError());
  cudaGraph_t graph = nullptr;
  CK(cudaStreamBeginCapture(g_st, cudaStreamCaptureModeThreadLocal));
  for (int i = 0; i < kCalls; ++i) fn(i);
  hc_join();  // (the last mHC site's side branch)
  CK(cudaStreamEndCapture(g_st, &graph));
  size_t nodes = 0;
  CK(cudaGraphGetNodes(graph, nullptr, &nodes));
  cudaGraphExec_t exec = nullptr;
  CK(cudaGraphInstantiate(&exec, graph, 0));
  std::vector<float> ms;
  for (int r = 0; r < g_warm + g_reps; ++r) {
    read_launch(g_flush, g_flush_n);  // L2 holds none of the replay's data (untimed)
    CK(cudaEventRecord(g_ev[0], g_st));
    CK(cudaGraphLaunch(exec, g_st));
    CK(cudaEventRecord(g_ev[1], g_st));
    CK(cudaEventSynchronize(g_ev[1]));
    float v = 0;
    CK(cudaEventElapsedTime(&v, g_ev[0], g_ev[1]));
    if (r >= g_warm) ms.push_back(v);
  }
  std::sort(ms.begin(), ms.end());
  const double us = double(ms[ms.size() / 2]) * 1e3 / kCalls;
  g_rows.push_back({name + g_suffix, us, double(nodes) / kCalls, bytes > 0 ? bytes / (us * 1e-6) / 1e9 : 0.0});
  std::fprintf(stderr, "  %-50s %10.2f us\n", name.c_str(), us);
  CK(cudaGraphExecDestroy(exec));
  CK(cudaGraphDestroy(graph));
}

void run_all(const std::vector<Ctx>& ctxs) {
  bench("empty kernel (graph node floor)", [](int) {
    empty_kernel<<<1, 32, 0, g_st>>>();
    CK(cudaGetLastError());
  });
  bench("HBM read 256 MiB (reference)", [](int i) {
    const size_t n = kRotate / 16;
    g_bytes += double(kRotate);
    read_launch(g_flush + (size_t(i) % (g_flush_n / n)) * n, n);
  });
  bench("mHC hyper_enter n=4 D=4096 sinkhorn 20 (joined)", [](int i) { hc_enter(i), hc_join(); });
  bench("mHC hyper_leave", [](int) { hc_leave(); });
  bench("mHC hyper_step (leave + enter, joined)", [](int i) { hc_step(i), hc_join(); });

  bench("KDA EXL3 q|k|v grouped 3x 8192x4096", [](int i) { qkv_group(i); });
  bench("KDA EXL3 q|k|v 3x 8192x4096 (separate)", [](int i) {
    for (int p = 0; p < 3; ++p) exl3_linear(W.qkv[p][i], B.h, B.lraw + p * KHD, KC);
  });
  bench("KDA causal_conv1d_silu C=24576 K=4",
        [](int i) { causal_conv1d_silu(B.lraw, KC, 1, KC, W.conv_w[i], KCONV, W.conv_state[i], B.lqkv, g_st); });
  bench("KDA l2norm_rows q, k", [](int) { l2norms(); });
  bench("KDA EXL3 f_a 128x4096 (single)", [](int i) { exl3_linear(W.f_a[i], B.h, B.low, KD); });
  bench("KDA EXL3 f_b 8192x128 (single)", [](int i) { exl3_linear(W.f_b[i], B.low, B.g, KHD); });
  bench("KDA EXL3 f_a|g_a, f_b|g_b (2 pairs)", [](int i) { fg_pairs(i); });
  bench("KDA kda_gates", [](int) { kda_gates(B.g, W.dt_bias, W.a_log, 1, KH, KD, true, -5.0f, B.beta, g_st); });
  bench("KDA delta_rule H=64 d=128", [](int i) { delta(i); });
  bench("KDA delta_rule prefill 1024 tokens (recurrence)", [](int i) { delta_prefill(i, 0); });
  bench("KDA delta_rule prefill 1024 tokens (chunked)", [](int i) { delta_prefill(i, 1); });
  bench("KDA delta_rule prefill 1024 tokens (chunked: chunk-local kernels)", [](int i) { delta_prefill(i, 2); });
  bench("KDA delta_rule prefill 1024 tokens (chunked: state kernels)", [](int i) { delta_prefill(i, 3); });
  setenv("MOESRV_DELTA_RULE_FACTOR", "0", 1);
  bench("KDA delta_rule prefill 1024 tokens (chunked: chunk-local kernels, exps direct)",
        [](int i) { delta_prefill(i, 2); });
  unsetenv("MOESRV_DELTA_RULE_FACTOR");
  setenv("MOESRV_DELTA_RULE_OVERLAP", "0", 1);
  bench("KDA delta_rule prefill 1024 tokens (chunked: state kernels, copies not overlapped)",
        [](int i) { delta_prefill(i, 3); });
  unsetenv("MOESRV_DELTA_RULE_OVERLAP");
  bench("KDA kda_output_norm", [](int) { kda_output_norm(B.o, B.gate, W.o_norm, KH, KD, RMS_EPS, g_st); });
  if (kda_decode_supported(KD, KD, KCONV)) bench("KDA kda_decode (fused conv..norm)", [](int i) { kda_fused(i); });
  bench("KDA EXL3 o 4096x8192", [](int i) { exl3_linear(W.o_kda[i], B.o, B.y, D); });

  const Ctx& c8 = ctxs[0];
  bench("MLA EXL3 q_a 2048x4096", [](int i) { exl3_linear(W.q_a[i], B.h, B.q_lat, QL); });
  bench("MLA rms_norm 2048", [](int) { rms_norm(B.q_lat, QL, W.q_a_norm, 1, QL, 1e-6f, B.q_lat, QL, g_st); });
  bench("MLA EXL3 q_b 16384x2048", [](int i) { exl3_linear(W.q_b[i], B.q_lat, B.q, MH * DN); });
  bench("MLA EXL3 kv_a 512x4096", [](int i) { exl3_linear(W.kv_a[i], B.h, B.kv, R); });
  bench("MLA rms_norm 512", [](int) { rms_norm(B.kv, R, W.kv_a_norm, 1, R, 1e-6f, B.kv, R, g_st); });
  bench("MLA cache_write 512 bf16",
        [&](int i) { cache_write(B.kv, R, 1, R, c8.lc + i % c8.ncache, CacheField::Kv, false, c8.pos0, g_st); });
  bench("MLA mla_query H=64 256->512", [](int i) { mla_query_call(i); });
  for (const Ctx& c : ctxs)
    bench("MLA attention per-head, 2048 keys, ctx " + c.label,
          [&](int i) { mla_attend(i, c, false, c.sel + size_t(i) * SELW); });
  for (const Ctx& c : ctxs)
    bench("MLA mla_split_attention, 2048 keys, ctx " + c.label,
          [&](int i) { mla_attend(i, c, true, c.sel + size_t(i) * SELW); });
  bench("MLA mla_output H=64 512->256", [](int i) { mla_output_call(i); });
  bench("MLA EXL3 o 4096x16384", [](int i) { exl3_linear(W.o_mla[i], B.attn_out, B.y, D); });

  for (bool cublas : {false, true}) {  // the bf16 linears: bf16_gemv (the engine's decode), cuBLAS for comparison
    const std::string how = cublas ? " cuBLAS" : " bf16_gemv";
    bench("KDA b 64x4096" + how, [=](int i) { bf16_linear(W.b[i], KH, D, B.h, B.beta, cublas); });
    bench("IDX wq_b 4096x2048" + how, [=](int i) { bf16_linear(W.wq_b[i], IH * ID, QL, B.q_lat, B.iq, cublas); });
    bench("IDX wk 128x4096 (pool_gate alike)" + how, [=](int i) { bf16_linear(W.wk[i], ID, D, B.h, B.ik, cublas); });
    bench("IDX weights_proj 32x4096" + how, [=](int i) { bf16_linear(W.weights_proj[i], IH, D, B.h, B.ihw, cublas); });
  }
  bench("IDX layer_norm 128 + cublasSscal 32", [](int) {
    layer_norm(B.ik, W.k_norm_w, W.k_norm_b, 1, ID, 1e-6f, B.ik, g_st);
    const float head_scale = 1.0f / std::sqrt(float(IH));
    CB(cublasSscal(g_blas, IH, &head_scale, B.ihw, 1));
  });
  bench("IDX kpool_append", [&](int i) {
    kpool_append(B.ik, B.ig, W.ape, 1, ID, KPOOL, c8.pos0, c8.pool_k[i], W.open, W.open + KPOOL * ID, g_st);
  });
  for (const Ctx& c : ctxs) bench("IDX kpool_select, ctx " + c.label, [&](int i) { kpool_sel(i, c); });

  bench("MoE cuBLAS Sgemm router 288x4096 fp32", [](int i) { router(i); });
  bench("MoE route sigmoid top-8 + shared + counts", [](int) { route_call(); });
  bench("MoE router + route fused (one launch)", [](int i) { route_fused_call(i); });
  bench("MoE EXL3 experts gate, 9x 2048x4096", [](int i) { experts_part(0, B.rand_ids + size_t(i) * KK, KK); });
  if (!g_only || std::strstr(g_only, "prefill")) {  // (--only "prefill MLA" runs that row alone)
    prefill_setup();
    bench("prefill EXL3 grouped GEMM, 16 experts x 192 rows, gate 2048x4096", [](int) { prefill_grouped(-1); });
    for (int form : {0, 1, 2, 3, 4})  // (exl3_gemm_form: 1 = register B, the default; 2 = at 5 blocks / SM; 3 =
                                      // paired register B, 128-row tiles; 4 = wgmma; 0 = session 12's)
      if (form != 4 || exl3_gemm_wgmma_built())
        bench("prefill EXL3 grouped GEMM form " + std::to_string(form) + ", 16 experts x 192 rows, gate 2048x4096",
              [form](int) { prefill_grouped(form); });
    bench("prefill EXL3 grouped GEMM form 1 + output rotation, 16 experts x 192 rows, gate 2048x4096",
          [](int) { prefill_grouped(1, true); });
    if (exl3_gemm_wgmma_built())
      for (int rows : {128, 256})
        for (int per : {kPrefillRows, kPrefillRowsMax}) {
          const std::string what = "prefill EXL3 grouped GEMM form 4, tiles of " + std::to_string(rows) +
                                   ", 16 experts x " + std::to_string(per) + " rows, gate 2048x4096";
          bench(what, [rows, per](int) { prefill_grouped(4, false, rows, per); });
          bench(what + " + output rotation", [rows, per](int) { prefill_grouped(4, true, rows, per); });
        }
    bench("prefill EXL3 dequant + cuBLAS, 16 experts x 192 rows, gate 2048x4096", [](int) { prefill_cublas(); });
    bench("prefill EXL3 dequant + cuBLAS, 16 experts x 512 rows, gate 2048x4096",
          [](int) { prefill_cublas(kPrefillRowsMax); });
    for (int most : {0, 128, 512, 1 << 30})  // (CudaEngineOptions::exl3_grouped_rows)
      bench("prefill EXL3 skewed 16 experts (32-1024 rows), pieces <= " +
                (most > 1024 ? std::string("all") : std::to_string(most)) + " rows grouped, gate 2048x4096",
            [most](int) { prefill_skewed(most); });
    if (exl3_gemm_wgmma_built())
      for (int most : {512, 1 << 30})
        bench("prefill EXL3 skewed 16 experts (32-1024 rows), form 4, pieces <= " +
                  (most > 1024 ? std::string("all") : std::to_string(most)) + " rows grouped, gate 2048x4096",
              [most](int) { prefill_skewed(most, 4); });
    dense_setup();
    const char* dense_steps[] = {"input rotation", "dequant W_hat", "cuBLAS", "output rotation"};
    for (int step = 0; step < 4; ++step)
      bench(std::string("prefill EXL3 dense 8192x4096, 2048 rows: ") + dense_steps[step],
            [step](int) { dense_step(step); });
    hc_prefill_setup();
    bench("prefill mHC hyper_enter, 2048 tokens (GEMM, dots, weights + h)", [](int i) { hc_prefill_enter(i); });
    bench("prefill mHC hyper_leave, 2048 tokens", [](int) { hc_prefill_leave(); });
    for (const Ctx& c : ctxs) {
      bench("prefill MLA attention, 512 queries x 2048 keys, ctx " + c.label, [&](int i) { prefill_mla(i, c); });
      bench("prefill IDX kpool_select, 512 queries, ctx " + c.label, [&](int i) { prefill_kpool(i, c); });
    }
  }
  bench("MoE EXL3 experts gate|up, 2x 9x 2048x4096", [](int i) { experts_gate_up(B.rand_ids + size_t(i) * KK, KK); });
  bench("MoE EXL3 experts down, 9x 4096x2048 (SwiGLU in)",
        [](int i) { experts_part(2, B.rand_ids + size_t(i) * KK, KK); });
  bench("MoE EXL3 experts 8 routed (gate, up, down)", [](int i) { experts(B.rand_ids + size_t(i) * KK + 1, TOPK); });
  bench("MoE EXL3 experts 1 shared + 8 routed", [](int i) { experts(B.rand_ids + size_t(i) * KK, KK); });
  // Zero copy (docs/perf-cuda.md, "Thirteenth round"): the routed experts read over PCIe (GB/s: of the link).
  bench("MoE EXL3 experts 8 routed, host memory (zero copy)",
        [](int i) { experts(B.rand_ids + size_t(i) * KK + 1, TOPK, W.tab_host); });
  bench("MoE moe_combine k=9", [](int) { moe_combine(B.y, B.ysorted, nullptr, B.w, nullptr, 1, KK, D, g_st, true); });
  bench("MoE shared expert unfused (gate|up, SwiGLU, down)", [](int i) { shared_unfused(i); });

  bench("head hyper_collapse_mean + rms_norm", [](int) {
    hyper_collapse_mean(B.x, 1, NS, D, B.h, g_st);
    rms_norm(B.h, D, W.final_norm, 1, D, RMS_EPS, B.h, D, g_st);
  });
  bench("head EXL3 lm_head 154880x4096", [](int i) { exl3_linear(W.lm_head[i], B.h, B.logits, VOCAB); });

  if (selected("rows")) {  // few-token forwards: --only rows
    static std::mt19937 rng(7);
    rows_setup(rng);
    for (int n : {2, 4})
      for (bool rows : {false, true}) {
        const std::string tag = "rows " + std::to_string(n) + (rows ? " R-row" : " batch");
        bench(tag + " EXL3 o 4096x8192", [=](int i) { rows_linear(W.o_kda[i], n, rows); });
        bench(tag + " EXL3 q_b 16384x2048", [=](int i) { rows_linear(W.q_b[i], n, rows); });
        bench(tag + " EXL3 experts, random picks", [=](int) { rows_experts(V.ids_rand, n, rows); });
        bench(tag + " EXL3 experts, half token 0's picks", [=](int) { rows_experts(V.ids_half, n, rows); });
      }
  }

  // One decoder layer as CudaBlocks runs it: the previous layer's last leave with the attention enter, the attention
  // block, its leave with the MoE enter, the MoE (its leave goes with the next layer's first enter).
  bench("decode layer (KDA+MoE)", [](int i) {
    hc_step(2 * i), kda(i);
    hc_step(2 * i + 1), moe(i);
  });
  for (const Ctx& c : ctxs)
    bench("decode layer (MLA+MoE), ctx " + c.label, [&](int i) {
      hc_step(2 * i), mla(i, c);
      hc_step(2 * i + 1), moe(i);
    });
}

void report(const char* device, const char* json_path) {
  std::printf("\n%-52s %10s %10s %9s\n", "kernel (1 token, EXL3 K bits as above)", "us/call", "nodes/call", "GB/s");
  for (const Row& r : g_rows) {
    char gb[32] = "-";
    if (r.gbps > 0) std::snprintf(gb, sizeof gb, "%.0f", r.gbps);
    std::printf("%-52s %10.2f %10.1f %9s\n", r.name.c_str(), r.us, r.nodes, gb);
  }
  if (!json_path) return;
  FILE* f = std::fopen(json_path, "w");
  if (!f) die("fopen", json_path, __LINE__);
  std::fprintf(f,
               "{\"device\": \"%s\", \"bits\": %d, \"gemv_blocks_per_sm\": %d, \"calls_per_graph\": %d, \"rows\": [\n",
               device, g_bits, exl3_gemv_blocks_per_sm(), kCalls);
  for (size_t i = 0; i < g_rows.size(); ++i) {
    const Row& r = g_rows[i];
    char gb[32] = "null";
    if (r.gbps > 0) std::snprintf(gb, sizeof gb, "%.1f", r.gbps);
    std::fprintf(f, "  {\"kernel\": \"%s\", \"us\": %.3f, \"nodes\": %.2f, \"gbps\": %s}%s\n", r.name.c_str(), r.us,
                 r.nodes, gb, i + 1 < g_rows.size() ? "," : "");
  }
  std::fprintf(f, "]}\n");
  if (std::fclose(f) != 0) die("fclose", json_path, __LINE__);
}

}  // namespace

int main(int argc, char** argv) {
  const char* json_path = nullptr;
  std::string sweep;  // --split-sweep default,2x16,...: the selected rows again under each one-row GEMV split
  for (int a = 1; a < argc; ++a) {
    const bool arg = a + 1 < argc;
    if (!std::strcmp(argv[a], "--bits") && arg) g_bits = std::atoi(argv[++a]);
    else if (!std::strcmp(argv[a], "--json") && arg) json_path = argv[++a];
    else if (!std::strcmp(argv[a], "--quick")) g_reps = 5, g_warm = 1;
    else if (!std::strcmp(argv[a], "--only") && arg) g_only = argv[++a];
    else if (!std::strcmp(argv[a], "--profile")) g_profile = true;
    else if (!std::strcmp(argv[a], "--split-sweep") && arg) sweep = argv[++a];
    else g_bits = 0;
  }
  if (g_bits < 1 || g_bits > 8) {
    std::fprintf(stderr,
                 "usage: %s [--bits K (1..8, default 4)] [--quick] [--only NAME,...] [--profile] [--json PATH] "
                 "[--split-sweep default,WKxTPW,...]\n",
                 argv[0]);
    return 2;
  }
  try {
    cudaDeviceProp prop;
    CK(cudaSetDevice(0));
    CK(cudaGetDeviceProperties(&prop, 0));
    g_sms = prop.multiProcessorCount;
    std::printf(
        "device: %s, %d SMs, L2 %d MB, %.0f GiB; glm5_next decode, EXL3 K=%d (MUL1), GEMV %d blocks/SM, %d "
        "calls/graph\n",
        prop.name, prop.multiProcessorCount, prop.l2CacheSize >> 20, double(prop.totalGlobalMem) / (1 << 30), g_bits,
        exl3_gemv_blocks_per_sm(), kCalls);
    CK(cudaStreamCreateWithFlags(&g_st, cudaStreamNonBlocking));
    CK(cudaStreamCreateWithFlags(&g_side.stream, cudaStreamNonBlocking));
    CK(cudaStreamCreateWithFlags(&g_pside.stream, cudaStreamNonBlocking));
    CK(cudaEventCreateWithFlags(&g_pside.fork, cudaEventDisableTiming));
    CK(cudaEventCreateWithFlags(&g_pside.join, cudaEventDisableTiming));
    CK(cudaEventCreateWithFlags(&g_side.fork, cudaEventDisableTiming));
    CK(cudaEventCreateWithFlags(&g_side.join, cudaEventDisableTiming));
    CB(cublasCreate(&g_blas));
    CB(cublasSetStream(g_blas, g_st));
    const size_t ws = size_t(32) << 20;  // set after the stream (setting a stream resets the workspace)
    CB(cublasSetWorkspace(g_blas, dalloc<uint8_t>(ws), ws));
    exl3_sm_count();  // read before any capture
    CK(cudaEventCreate(&g_ev[0]));
    CK(cudaEventCreate(&g_ev[1]));
    const size_t flush_bytes = std::max(size_t(4) * kRotate, size_t(prop.l2CacheSize) * 8);
    g_flush_n = flush_bytes / 16;
    g_flush = dalloc<uint4>(g_flush_n);
    fill(g_flush, flush_bytes / 4, kBits32, 0);
    g_sink = dalloc<unsigned>(1);

    std::mt19937 rng(20240601);
    setup(rng);
    std::vector<Ctx> ctxs;  // 8K, 32K, 131K tokens
    for (int k : {8, 32, 128}) ctxs.push_back(make_ctx(k << 10, k == 128 ? "131K" : k == 8 ? "8K" : "32K", rng));
    CK(cudaDeviceSynchronize());
    std::fprintf(stderr, "%.1f GiB of weights, caches and buffers ready; timing (stderr: progress)\n",
                 g_alloc_bytes / double(1 << 30));
    if (sweep.empty()) run_all(ctxs);
    for (size_t b = 0; b < sweep.size();) {  // MOESRV_EXL3_GEMV1_SPLIT per entry ("default": unset), rows suffixed
      size_t e = sweep.find(',', b);
      if (e == std::string::npos) e = sweep.size();
      const std::string split = sweep.substr(b, e - b);
      if (split == "default") unsetenv("MOESRV_EXL3_GEMV1_SPLIT");
      else setenv("MOESRV_EXL3_GEMV1_SPLIT", split.c_str(), 1);
      g_suffix = " [split " + split + "]";
      run_all(ctxs);
      b = e + 1;
    }
    report(prop.name, json_path);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  return 0;
}
