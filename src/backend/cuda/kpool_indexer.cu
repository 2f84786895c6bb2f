// k-pool DSA indexer of GLM-5.3-Flash (cpu::kpool_select): the pooled-key state update (every kpool tokens close
// a pool whose key is a per-channel softmax-weighted sum of its tokens' keys) and the per-query selection (ReLU-head
// scores over the completed pools visible to the query, exact top-`budget` by radix select, expanded to positions,
// plus the open pool's visible tail). Positions come from device memory (pos0) so a decode graph can be replayed.
#include <algorithm>
#include <cmath>
#include <string>

#include "backend/cuda/glm5_next_kernels.h"
#include "backend/cuda/kernel_util.cuh"
#include "backend/cuda/pdl.cuh"
#include "backend/cuda/radix_topk.cuh"

namespace moesrv::cuda {

namespace {

constexpr int kThreads = kTopkThreads, kWarps = kTopkWarps;
constexpr int kPoolsPerBlock = 64;  // scoring: pools per block (kPoolsPerBlock / kWarps per warp)
constexpr int kLanePools = 32, kHeadGroups = 8;  // kpool_score_lanes_kernel: pools per block (one per lane), warps
constexpr int kSelectThreads = 1024;             // the top-k: passes over up to max_pools scores
constexpr int kSelectSmemPools = 48 * 1024;      // ... staged in shared memory first when this many or fewer (and
                                                 // they fit the device's shared memory)
constexpr int kSplitQueries = 8;                 // up to this many queries (decode) split each row's top-k

// Pool P's key from its kpool tokens: those before p0 in open_k/open_g (slot t), the rest in the batch rows k/g.
// The block's threads split the channels.
__device__ void close_pool(const float* k, const float* g, const float* ape, int d, int kpool, int64_t P, int64_t p0,
                           float* pool_k, const float* open_k, const float* open_g) {
  for (int c = threadIdx.x; c < d; c += blockDim.x) {
    auto key = [&](int t) {
      const int64_t pos = P * kpool + t;
      return pos < p0 ? open_k[int64_t(t) * d + c] : k[(pos - p0) * d + c];
    };
    auto logit = [&](int t) {
      const int64_t pos = P * kpool + t;
      return (pos < p0 ? open_g[int64_t(t) * d + c] : g[(pos - p0) * d + c]) + ape[int64_t(t) * d + c];
    };
    float mx = -INFINITY;
    for (int t = 0; t < kpool; ++t) mx = fmaxf(mx, logit(t));
    float sum = 0.0f, acc = 0.0f;
    for (int t = 0; t < kpool; ++t) sum += expf(logit(t) - mx);
    for (int t = 0; t < kpool; ++t) acc += expf(logit(t) - mx) / sum * key(t);
    pool_k[P * d + c] = acc;
  }
}

// Closes every pool that the batch completes: block b handles pool pos0/kpool + b. One thread per channel.
__global__ void kpool_close_kernel(const float* k, const float* g, const float* ape, int S, int d, int kpool,
                                   const int32_t* pos0, float* pool_k, const float* open_k, const float* open_g) {
  pdl_enter();
  const int64_t p0 = *pos0;
  const int64_t P = p0 / kpool + blockIdx.x;
  if ((P + 1) * kpool > p0 + S) return;  // not completed by this batch
  close_pool(k, g, ape, d, kpool, P, p0, pool_k, open_k, open_g);
}

// One token (decode): it either completes its pool (which closes; nothing stays open) or joins the open pool.
__global__ void kpool_append_one_kernel(const float* k, const float* g, const float* ape, int d, int kpool,
                                        const int32_t* pos0, float* pool_k, float* open_k, float* open_g) {
  pdl_enter();
  const int64_t p0 = *pos0;
  if ((p0 + 1) % kpool == 0) return close_pool(k, g, ape, d, kpool, p0 / kpool, p0, pool_k, open_k, open_g);
  const int64_t slot = p0 % kpool;
  for (int c = threadIdx.x; c < d; c += blockDim.x) open_k[slot * d + c] = k[c], open_g[slot * d + c] = g[c];
}

// Stores the batch tokens of the pool left open after the batch (positions >= kpool * ((pos0+S)/kpool)).
__global__ void kpool_open_kernel(const float* k, const float* g, int S, int d, int kpool, const int32_t* pos0,
                                  float* open_k, float* open_g) {
  pdl_enter();
  const int64_t p0 = *pos0, pos = p0 + blockIdx.x;
  const int64_t open_start = (p0 + S) / kpool * kpool;
  if (pos < open_start) return;
  const int64_t slot = pos % kpool;
  for (int c = threadIdx.x; c < d; c += blockDim.x) {
    open_k[slot * d + c] = k[int64_t(blockIdx.x) * d + c];
    open_g[slot * d + c] = g[int64_t(blockIdx.x) * d + c];
  }
}

// Block t: step t = the open pool (open_k | open_g) with the batch's tokens 0..t that do not close their pool in
// their slots, in token order.
__global__ void kpool_open_steps_kernel(const float* k, const float* g, int d, int kpool, const int32_t* pos0,
                                        const float* open, float* steps) {
  pdl_enter();
  const int t = blockIdx.x;
  const int64_t p0 = *pos0, W = int64_t(kpool) * d;
  float* out = steps + int64_t(t) * 2 * W;
  for (int64_t i = threadIdx.x; i < 2 * W; i += blockDim.x) out[i] = open[i];
  for (int i = 0; i <= t; ++i) {
    __syncthreads();  // a later token may take an earlier one's slot
    const int64_t pos = p0 + i;
    if ((pos + 1) % kpool == 0) continue;
    const int64_t slot = pos % kpool;
    for (int c = threadIdx.x; c < d; c += blockDim.x)
      out[slot * d + c] = k[int64_t(i) * d + c], out[W + slot * d + c] = g[int64_t(i) * d + c];
  }
}

// scores[s][P] for the pools P < (p+1)/kpool of query s (p = pos0 + s). Block (x, s): pools
// [x*kPoolsPerBlock, (x+1)*kPoolsPerBlock); one warp per pool at a time.
__global__ void __launch_bounds__(kThreads)
    kpool_score_kernel(const float* q, const float* hw, float hw_scale, const float* pool_k, int nh, int d, int kpool,
                       const int32_t* pos0, int max_pools, float* scores) {
  pdl_enter();
  extern __shared__ float smem[];  // q [nh*d] | hw [nh] | per-warp pool key [kWarps][d]
  const int s = blockIdx.y, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int64_t p = int64_t(*pos0) + s;
  const int64_t pools = min((p + 1) / kpool, int64_t(max_pools));
  const int P_begin = blockIdx.x * kPoolsPerBlock;
  if (P_begin >= pools) return;  // uniform over the block
  float* q_s = smem;
  float* w_s = q_s + nh * d;
  float* pk_s = w_s + nh + warp * d;
  for (int i = tid; i < nh * d; i += kThreads) q_s[i] = q[int64_t(s) * nh * d + i];
  for (int i = tid; i < nh; i += kThreads) w_s[i] = hw[int64_t(s) * nh + i] * hw_scale;
  __syncthreads();
  const float scale = 1.0f / sqrtf(float(d));
  const int P_end = int(min(pools, int64_t(P_begin + kPoolsPerBlock)));
  for (int P = P_begin + warp; P < P_end; P += kWarps) {
    for (int c = lane; c < d; c += 32) pk_s[c] = pool_k[int64_t(P) * d + c];
    __syncwarp();
    float acc = 0.0f;
    for (int h = 0; h < nh; ++h) {
      float dot = 0.0f;
      for (int c = lane; c < d; c += 32) dot += q_s[h * d + c] * pk_s[c];
      dot = warp_sum(dot);
      acc += w_s[h] * fmaxf(dot * scale, 0.0f);
    }
    if (lane == 0) scores[int64_t(s) * max_pools + P] = acc;
    __syncwarp();
  }
}

// The same scores with one pool per lane: block (x, s) scores pools [32 x, 32 x + 32), staged in shared memory (rows
// d + 4 floats apart); warp w runs heads w, w + kHeadGroups, ... over every lane's key with float4 reads (the query
// broadcast), and the warps' sums meet in shared memory in warp order. No cross-lane reduction. d % 4 == 0.
__global__ void __launch_bounds__(32 * kHeadGroups)
    kpool_score_lanes_kernel(const float* q, const float* hw, float hw_scale, const float* pool_k, int nh, int d,
                             int kpool, const int32_t* pos0, int max_pools, float* scores) {
  pdl_enter();
  extern __shared__ __align__(16) float lsm[];  // q [nh*d] | hw [nh, padded to 4] | keys [32][d + 4]
  __shared__ float part[kHeadGroups][kLanePools];
  const int s = blockIdx.y, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, ks = d + 4;
  const int64_t p = int64_t(*pos0) + s;
  const int pools = int(min((p + 1) / kpool, int64_t(max_pools)));
  const int P0 = blockIdx.x * kLanePools;
  if (P0 >= pools) return;  // uniform over the block
  float* q_s = lsm;
  float* w_s = q_s + nh * d;
  float* k_s = w_s + (nh + 3) / 4 * 4;
  for (int i = tid; i < nh * d; i += blockDim.x) q_s[i] = q[int64_t(s) * nh * d + i];
  for (int i = tid; i < nh; i += blockDim.x) w_s[i] = hw[int64_t(s) * nh + i] * hw_scale;
  for (int i = tid; i < kLanePools * d; i += blockDim.x) {  // coalesced: row by row
    const int r = i / d, c = i % d;
    k_s[r * ks + c] = P0 + r < pools ? pool_k[int64_t(P0 + r) * d + c] : 0.0f;
  }
  __syncthreads();
  const float scale = 1.0f / sqrtf(float(d));
  const float4* kr = reinterpret_cast<const float4*>(k_s + lane * ks);
  float acc = 0.0f;
  for (int h = warp; h < nh; h += kHeadGroups) {
    const float dot = dot_float4(reinterpret_cast<const float4*>(q_s + h * d), kr, d / 4);
    acc += w_s[h] * fmaxf(dot * scale, 0.0f);
  }
  part[warp][lane] = acc;
  __syncthreads();
  if (warp != 0 || P0 + lane >= pools) return;
  float sum = 0.0f;
  for (int w = 0; w < kHeadGroups; ++w) sum += part[w][lane];
  scores[int64_t(s) * max_pools + P0 + lane] = sum;
}

// The same scores for a prefill batch on tensor cores: block (x, y) scores pools [128 x, 128 x + 128) for queries
// [32 y, 32 y + 32); warp w owns 16 pools (the MMA's rows, their keys split into fp16 value + remainder and held in
// registers for every head) and runs heads 0.. in order over the block's 4 groups of 8 queries (the MMA's columns,
// split the same way once per block and head into shared memory, the next head's query rows loaded while this one
// runs): q . key as hi.hi + hi.lo + lo.hi products (~2^-21 relative), then ReLU, the head weight and the sum over
// heads in fp32. d = 16 * kSteps (kpool_mma_dim). (The first form gave each block 8 queries and had every warp load
// and split them from global memory itself: bound by L1 traffic, 2.1x slower at 131K; issue 20.)
constexpr int kMmaPools = 128, kMmaQueries = 8, kMmaWarps = kMmaPools / 16;
constexpr int kMmaGroups = 4, kMmaBlockQueries = kMmaGroups * kMmaQueries;  // prefill: queries per block
constexpr bool kpool_mma_dim(int d) { return d == 16 || d == 32 || d == 64 || d == 128 || d == 256; }
// Shared memory of the prefill kernel: two heads' B words ([group][step][lane] x {b0 hi, b1 hi, b0 lo, b1 lo}) and
// head weights.
constexpr size_t kpool_prefill_smem(int steps) {
  return size_t(2) * (kMmaGroups * steps * 32 * 16 + kMmaBlockQueries * 4);
}
// The keys of pools P0 + g and P0 + g + 8 (zero from `pools` on) as the A fragments of kSteps m16n8k16 products over
// dims 16 j .., split into fp16 value (a_hi) and remainder (a_lo). d = 16 kSteps.
template <int kSteps>
__device__ __forceinline__ void load_pool_keys(const float* pool_k, int P0, int pools, int g, int t,
                                               uint32_t (&a_hi)[kSteps][4], uint32_t (&a_lo)[kSteps][4]) {
  constexpr int d = 16 * kSteps;
#pragma unroll
  for (int j = 0; j < kSteps; ++j) {
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int P = P0 + g + 8 * (r & 1), c = 16 * j + 2 * t + 8 * (r >> 1);
      const float2 v = P < pools ? *reinterpret_cast<const float2*>(pool_k + int64_t(P) * d + c) : make_float2(0, 0);
      split_half2(v.x, v.y, a_hi[j][r], a_lo[j][r]);
    }
  }
}
// c += A . B for one 16-dim step in ~fp32 precision: B's words (b0: rows 2t, 2t + 1; b1: rows 2t + 8, 2t + 9) split
// like A into hi and lo, then lo.hi + hi.lo + hi.hi on fp16 tensor cores (~2^-21 relative).
__device__ __forceinline__ void mma_split3(float (&c)[4], const uint32_t (&ah)[4], const uint32_t (&al)[4],
                                           uint32_t b0h, uint32_t b1h, uint32_t b0l, uint32_t b1l) {
  mma_m16n8k16_f16(c, al[0], al[1], al[2], al[3], b0h, b1h);
  mma_m16n8k16_f16(c, ah[0], ah[1], ah[2], ah[3], b0l, b1l);
  mma_m16n8k16_f16(c, ah[0], ah[1], ah[2], ah[3], b0h, b1h);
}
__device__ __forceinline__ void mma_split3(float (&c)[4], const uint32_t (&ah)[4], const uint32_t (&al)[4], float2 v0,
                                           float2 v1) {
  uint32_t b0h, b0l, b1h, b1l;
  split_half2(v0.x, v0.y, b0h, b0l);
  split_half2(v1.x, v1.y, b1h, b1l);
  mma_split3(c, ah, al, b0h, b1h, b0l, b1l);
}

template <int kSteps>
__global__ void __launch_bounds__(kMmaWarps * 32, kSteps <= 8 ? 2 : 1)
    kpool_score_mma_kernel(const float* q, const float* hw, float hw_scale, const float* pool_k, int S, int nh,
                           int kpool, const int32_t* pos0, int max_pools, float* scores) {
  pdl_enter();
  constexpr int d = 16 * kSteps, kEntries = kMmaGroups * kSteps * 32, kThreads = kMmaWarps * 32;
  constexpr int kPer = (kEntries + kThreads - 1) / kThreads;  // B entries (lane words of one step) a thread splits
  extern __shared__ __align__(16) unsigned char smem_raw[];
  uint4* bw = reinterpret_cast<uint4*>(smem_raw);            // [2][kEntries]
  float* w_s = reinterpret_cast<float*>(bw + 2 * kEntries);  // [2][kMmaBlockQueries]
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int s0 = blockIdx.y * kMmaBlockQueries, P0 = blockIdx.x * kMmaPools + warp * 16;
  const int last = min(S, s0 + kMmaBlockQueries) - 1;
  const int pools = int(min((int64_t(*pos0) + last + 1) / kpool, int64_t(max_pools)));  // the most any query sees
  if (blockIdx.x * kMmaPools >= pools) return;                                          // uniform over the block
  const bool active = P0 < pools;                                                       // uniform over the warp
  uint32_t a_hi[kSteps][4], a_lo[kSteps][4];  // keys of pools P0 + g (rows g) and P0 + g + 8, dims 16 j ..
  if (active) load_pool_keys<kSteps>(pool_k, P0, pools, g, t, a_hi, a_lo);
  // entry e = (group, step, lane): query s0 + 8 group + lane / 4 (clamped rows are computed, not stored), dims
  // 16 step + 2 (lane % 4) + {0, 1, 8, 9}
  float4 raw[kPer];
  float w_raw = 0.0f;
  auto load = [&](int h) {
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      const int e = tid + kThreads * i, el = e & 31, j = (e >> 5) % kSteps, grp = (e >> 5) / kSteps;
      if (e >= kEntries) break;
      const int sq = min(s0 + 8 * grp + (el >> 2), S - 1);
      const float* qh = q + (int64_t(sq) * nh + h) * d + 16 * j + 2 * (el & 3);
      const float2 v0 = *reinterpret_cast<const float2*>(qh), v1 = *reinterpret_cast<const float2*>(qh + 8);
      raw[i] = make_float4(v0.x, v0.y, v1.x, v1.y);
    }
    if (tid < kMmaBlockQueries) w_raw = hw[int64_t(min(s0 + tid, S - 1)) * nh + h] * hw_scale;
  };
  auto stage = [&](int buf) {
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      const int e = tid + kThreads * i;
      if (e >= kEntries) break;
      uint32_t b0h, b0l, b1h, b1l;
      split_half2(raw[i].x, raw[i].y, b0h, b0l);
      split_half2(raw[i].z, raw[i].w, b1h, b1l);
      bw[buf * kEntries + e] = make_uint4(b0h, b1h, b0l, b1l);
    }
    if (tid < kMmaBlockQueries) w_s[buf * kMmaBlockQueries + tid] = w_raw;
  };
  load(0);
  stage(0);
  __syncthreads();
  const float scale = 1.0f / sqrtf(float(d));
  float acc[kMmaGroups][4] = {};
  for (int h = 0; h < nh; ++h) {
    const int buf = h & 1;
    if (h + 1 < nh) load(h + 1);  // in flight while this head runs
    if (active) {
      const uint4* b = bw + buf * kEntries + lane;
      const float* w = w_s + buf * kMmaBlockQueries;
      float c[kMmaGroups][4] = {};  // the groups' products as independent chains (each in step order)
#pragma unroll
      for (int j = 0; j < kSteps; ++j)
#pragma unroll
        for (int grp = 0; grp < kMmaGroups; ++grp) {
          const uint4 v = b[(grp * kSteps + j) * 32];
          mma_split3(c[grp], a_hi[j], a_lo[j], v.x, v.y, v.z, v.w);
        }
#pragma unroll
      for (int grp = 0; grp < kMmaGroups; ++grp) {  // c: pools g / g + 8 (rows) x queries 8 grp + 2t / + 1 (columns)
        const float wa = w[8 * grp + 2 * t], wb = w[8 * grp + 2 * t + 1];
        acc[grp][0] += wa * fmaxf(c[grp][0] * scale, 0.0f);
        acc[grp][1] += wb * fmaxf(c[grp][1] * scale, 0.0f);
        acc[grp][2] += wa * fmaxf(c[grp][2] * scale, 0.0f);
        acc[grp][3] += wb * fmaxf(c[grp][3] * scale, 0.0f);
      }
    }
    if (h + 1 < nh) stage(buf ^ 1);  // the other buffer: read by no warp since the barrier after head h - 1
    __syncthreads();
  }
  if (!active) return;
#pragma unroll
  for (int grp = 0; grp < kMmaGroups; ++grp)
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int sq_r = s0 + 8 * grp + 2 * t + (r & 1), P = P0 + g + 8 * (r >> 1);
      if (sq_r < S && P < max_pools) scores[int64_t(sq_r) * max_pools + P] = acc[grp][r];
    }
}

// Decode scores (a few queries) on tensor cores with the heads as the MMA's columns: block (x, s) scores pools
// [128 x, 128 x + 128) for query s; warp w owns 16 pools (the A rows: keys split into fp16 value + remainder, in
// registers, as above) and runs the heads 8 at a time (the B columns: the query's head rows, split the same way). Each
// lane then holds pools g and g + 8 for heads 2t and 2t + 1 of the tile: ReLU and head weight in fp32, and the 4
// lanes of a pool summed by shuffles. The lanes kernel re-read each key from shared memory for every head.
template <int kSteps>
__global__ void __launch_bounds__(kMmaWarps * 32)
    kpool_score_heads_mma_kernel(const float* q, const float* hw, float hw_scale, const float* pool_k, int nh,
                                 int kpool, const int32_t* pos0, int max_pools, float* scores) {
  pdl_enter();
  constexpr int d = 16 * kSteps;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3, s = blockIdx.y;
  const int P0 = blockIdx.x * kMmaPools + warp * 16;
  const int pools = int(min((int64_t(*pos0) + s + 1) / kpool, int64_t(max_pools)));
  if (P0 >= pools) return;  // uniform over the warp
  uint32_t a_hi[kSteps][4], a_lo[kSteps][4];
  load_pool_keys<kSteps>(pool_k, P0, pools, g, t, a_hi, a_lo);
  const float scale = 1.0f / sqrtf(float(d));
  const float* qs = q + int64_t(s) * nh * d;
  const float* ws = hw + int64_t(s) * nh;
  float acc[2] = {0.0f, 0.0f};  // pools g, g + 8
  for (int n0 = 0; n0 < nh; n0 += 8) {
    float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    const bool col = n0 + g < nh;  // this lane's B column (head n0 + g)
    const float* qh = qs + int64_t(col ? n0 + g : 0) * d + 2 * t;
#pragma unroll
    for (int j = 0; j < kSteps; ++j) {
      float2 v0 = *reinterpret_cast<const float2*>(qh + 16 * j), v1 = *reinterpret_cast<const float2*>(qh + 16 * j + 8);
      if (!col) v0 = v1 = make_float2(0.0f, 0.0f);
      mma_split3(c, a_hi[j], a_lo[j], v0, v1);
    }
    // c: pools g / g + 8 (rows) x heads n0 + 2t / n0 + 2t + 1 (columns)
    const int ha = n0 + 2 * t;
    const float wa = ha < nh ? ws[ha] * hw_scale : 0.0f, wb = ha + 1 < nh ? ws[ha + 1] * hw_scale : 0.0f;
    acc[0] += wa * fmaxf(c[0] * scale, 0.0f) + wb * fmaxf(c[1] * scale, 0.0f);
    acc[1] += wa * fmaxf(c[2] * scale, 0.0f) + wb * fmaxf(c[3] * scale, 0.0f);
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    acc[r] += __shfl_xor_sync(0xffffffffu, acc[r], 1);
    acc[r] += __shfl_xor_sync(0xffffffffu, acc[r], 2);
    const int P = P0 + g + 8 * r;
    if (t == 0 && P < pools) scores[int64_t(s) * max_pools + P] = acc[r];
  }
}

// Decode rows of many pools: the top-k runs in two steps. kpool_topk_split_kernel, grid (kTopkSplit, S): block c keeps
// the best `budget` pools of its chunk (all of them when fewer), in ascending pool order, as candidates (score, pool)
// at [s][c * budget ...); kpool_topk_kernel then selects among the candidates. Exact: each pool of the final top-k
// (score descending, then pool ascending) is in its chunk's top-k by the same order, and the candidates keep pool
// order, so ties again go to the lower pool.
constexpr int kTopkSplit = 8;

__device__ __forceinline__ int visible_pools(const int32_t* pos0, int s, int kpool, int max_pools) {
  return min((*pos0 + s + 1) / kpool, max_pools);  // max_pools: the caller's bound (the scratch row)
}
__device__ __forceinline__ int split_chunk(int pools) { return (pools + kTopkSplit - 1) / kTopkSplit; }
// staged[0, n) = src[0, n) by the whole block, the loads in flight together; then a block barrier.
__device__ __forceinline__ void stage_scores(float* staged, const float* __restrict__ src, int n) {
#pragma unroll 8
  for (int i = threadIdx.x; i < n; i += blockDim.x) staged[i] = __ldg(src + i);
  __syncthreads();
}

// The top-k of the selection kernels: binned (radix_topk.cuh), or the radix select alone (MOESRV_KPOOL_RADIX=1).
template <typename Emit>
__device__ __forceinline__ void select_topk(const float* sc, int n, int k, bool radix, Emit emit) {
  if (radix) block_radix_topk<kSelectThreads>(sc, n, k, emit);
  else block_binned_topk<kSelectThreads>(sc, n, k, emit);
}

__global__ void __launch_bounds__(kSelectThreads)
    kpool_topk_split_kernel(const float* __restrict__ scores, int kpool, int budget, const int32_t* pos0, int max_pools,
                            bool radix, float* cand_score, int32_t* cand_pool) {
  pdl_enter();
  extern __shared__ float staged[];
  const int c = blockIdx.x, s = blockIdx.y, tid = threadIdx.x;
  const int pools = visible_pools(pos0, s, kpool, max_pools);
  if (pools <= budget) return;  // kpool_topk_kernel takes them all
  const int chunk = split_chunk(pools), lo = min(pools, c * chunk), len = min(pools, lo + chunk) - lo;
  const float* sc = scores + int64_t(s) * max_pools + lo;
  float* cs = cand_score + (int64_t(s) * kTopkSplit + c) * budget;
  int32_t* cp = cand_pool + (int64_t(s) * kTopkSplit + c) * budget;
  if (len <= budget) {
    for (int i = tid; i < len; i += kSelectThreads) cs[i] = sc[i], cp[i] = lo + i;
    return;
  }
  stage_scores(staged, sc, len);
  select_topk(staged, len, budget, radix, [&](int t, int slot) { cs[slot] = staged[t], cp[slot] = lo + t; });
}

// One block per query: top `budget` of the visible pools' scores (radix_topk.cuh; ties at the k-th score go to the
// lower pool index), written as ascending positions, then the tail, then -1. The scores are staged in shared memory
// first (all loads in flight; up to smem_floats of them), so the five passes over them do not wait on L2 one load at
// a time. With candidates (cand_pool set), the row is kpool_topk_split_kernel's candidates instead.
__global__ void __launch_bounds__(kSelectThreads)
    kpool_topk_kernel(const float* __restrict__ scores, int kpool, int budget, bool select_tail, const int32_t* pos0,
                      int max_pools, int smem_floats, bool radix, const float* cand_score, const int32_t* cand_pool,
                      int32_t* sel, int sel_k) {
  pdl_enter();
  extern __shared__ float staged[];
  const int s = blockIdx.x, tid = threadIdx.x, p = *pos0 + s;
  const int pools = visible_pools(pos0, s, kpool, max_pools);
  const float* sc = scores + int64_t(s) * max_pools;
  int n = pools;                                    // scores to select from
  const int32_t* pool_of = nullptr;                 // their pools (candidates), else the identity
  if (budget > 0 && pools > budget && cand_pool) {  // block-uniform: gather the chunks' candidates in pool order
    int32_t* ids = reinterpret_cast<int32_t*>(staged + kTopkSplit * budget);
    const int chunk = split_chunk(pools);
    n = 0;
    for (int c = 0; c < kTopkSplit; ++c) {
      const int lo = min(pools, c * chunk), len = min(budget, min(pools, lo + chunk) - lo);
      const int64_t at = (int64_t(s) * kTopkSplit + c) * budget;
      for (int i = tid; i < len; i += kSelectThreads)
        staged[n + i] = cand_score[at + i], ids[n + i] = cand_pool[at + i];
      n += len;
    }
    __syncthreads();
    sc = staged, pool_of = ids;
  } else if (budget > 0 && pools > budget && pools <= smem_floats) {
    stage_scores(staged, sc, pools);
    sc = staged;
  }
  int32_t* out = sel + int64_t(s) * sel_k;
  int written = 0;  // pools written
  if (budget <= 0) {
    // nothing but the tail
  } else if (pools <= budget) {
    for (int i = tid; i < pools * kpool; i += kSelectThreads) out[i] = i;
    written = pools;
  } else {
    select_topk(sc, n, budget, radix, [&](int t, int slot) {
      const int P = pool_of ? pool_of[t] : t;
      for (int j = 0; j < kpool; ++j) out[slot * kpool + j] = P * kpool + j;
    });
    written = budget;
  }
  int m = written * kpool;
  if (select_tail) {
    const int tail = min(p + 1 - pools * kpool, sel_k - m);  // positions pools*kpool .. p
    for (int i = tid; i < tail; i += kSelectThreads) out[m + i] = pools * kpool + i;
    m += tail;
  }
  for (int i = m + tid; i < sel_k; i += kSelectThreads) out[i] = -1;
}

}  // namespace

void kpool_append(const float* k, const float* g, const float* ape, int S, int d, int kpool, const int32_t* pos0,
                  float* pool_k, float* open_k, float* open_g, cudaStream_t st) {
  if (S <= 0) return;
  if (kpool < 1) throw std::runtime_error("kpool_append: kpool " + std::to_string(kpool));
  const int threads = std::min(256, ceil_div(d, 32) * 32);
  if (S == 1) {  // decode: one launch
    launch(kpool_append_one_kernel, 1, threads, 0, st, k, g, ape, d, kpool, pos0, pool_k, open_k, open_g);
    MOESRV_CUDA_LAUNCH_CHECK();
    return;
  }
  // The batch completes at most S/kpool + 1 pools (the first may have started before pos0). Pool keys first: they
  // read the open slots that the open-pool store then overwrites.
  launch(kpool_close_kernel, S / kpool + 1, threads, 0, st, k, g, ape, S, d, kpool, pos0, pool_k, open_k, open_g);
  MOESRV_CUDA_LAUNCH_CHECK();
  launch(kpool_open_kernel, S, threads, 0, st, k, g, S, d, kpool, pos0, open_k, open_g);
  MOESRV_CUDA_LAUNCH_CHECK();
}

void kpool_open_steps(const float* k, const float* g, int S, int d, int kpool, const int32_t* pos0, const float* open,
                      float* steps, cudaStream_t st) {
  if (S <= 1) return;
  if (kpool < 1) throw std::runtime_error("kpool_open_steps: kpool " + std::to_string(kpool));
  launch(kpool_open_steps_kernel, S - 1, 256, 0, st, k, g, d, kpool, pos0, open, steps);
  MOESRV_CUDA_LAUNCH_CHECK();
}

// MOESRV_KPOOL_LANES=1: decode scores by the fp32 lanes kernel instead of tensor cores (comparisons), read once.
static bool kpool_lanes_forced() {
  static const bool on = env_flag("MOESRV_KPOOL_LANES");
  return on;
}
// MOESRV_KPOOL_RADIX=1: the top-k by the radix select alone (comparisons), read once.
static bool kpool_radix_forced() {
  static const bool on = env_flag("MOESRV_KPOOL_RADIX");
  return on;
}

size_t kpool_select_scratch(int S, int max_pools, int budget) {
  return size_t(S) * max_pools + (S <= kSplitQueries ? size_t(S) * 2 * kTopkSplit * std::max(budget, 0) : 0);
}

void kpool_select(const float* q, const float* hw, const float* pool_k, int S, int nh, int d, int kpool, int budget,
                  bool select_tail, const int32_t* pos0, int max_pools, float* scratch, size_t scratch_floats,
                  int32_t* sel, int sel_k, cudaStream_t st, float hw_scale) {
  if (S <= 0) return;
  if (kpool < 1 || budget < 0) throw std::runtime_error("kpool_select: kpool " + std::to_string(kpool));
  if (sel_k < budget * kpool + (select_tail ? kpool - 1 : 0))
    throw std::runtime_error("kpool_select: selection width " + std::to_string(sel_k) + " < " +
                             std::to_string(budget * kpool + (select_tail ? kpool - 1 : 0)));
  const size_t smem = size_t(nh * d + nh + kWarps * d) * sizeof(float);
  const size_t lane_smem = size_t(nh * d + (nh + 3) / 4 * 4 + kLanePools * (d + 4)) * sizeof(float);
  const bool lanes = d % 4 == 0 && lane_smem <= size_t(200) << 10;
  if (!lanes && smem > 48 * 1024)
    throw std::runtime_error("kpool_select: indexer query of " + std::to_string(nh * d) +
                             " floats exceeds shared memory");
  if (max_pools > 0 && S > kMmaQueries && kpool_mma_dim(d)) {  // prefill: tensor cores
    const dim3 grid(unsigned(ceil_div(max_pools, kMmaPools)), unsigned(ceil_div(S, kMmaBlockQueries)));
    const auto kernel = d == 16    ? kpool_score_mma_kernel<1>
                        : d == 32  ? kpool_score_mma_kernel<2>
                        : d == 64  ? kpool_score_mma_kernel<4>
                        : d == 128 ? kpool_score_mma_kernel<8>
                                   : kpool_score_mma_kernel<16>;
    const size_t smem = kpool_prefill_smem(d / 16);
    reserve_dynamic_smem(kernel, smem, "kpool_select");
    launch(kernel, grid, kMmaWarps * 32, smem, st, q, hw, hw_scale, pool_k, S, nh, kpool, pos0, max_pools, scratch);
    MOESRV_CUDA_LAUNCH_CHECK();
  } else if (max_pools > 0 && S <= kSplitQueries && kpool_mma_dim(d) && d <= 128 && !kpool_lanes_forced()) {
    const dim3 grid(unsigned(ceil_div(max_pools, kMmaPools)), unsigned(S));
    const auto kernel = d == 16   ? kpool_score_heads_mma_kernel<1>
                        : d == 32 ? kpool_score_heads_mma_kernel<2>
                        : d == 64 ? kpool_score_heads_mma_kernel<4>
                                  : kpool_score_heads_mma_kernel<8>;
    launch(kernel, grid, kMmaWarps * 32, 0, st, q, hw, hw_scale, pool_k, nh, kpool, pos0, max_pools, scratch);
    MOESRV_CUDA_LAUNCH_CHECK();
  } else if (max_pools > 0 && lanes) {
    reserve_dynamic_smem(kpool_score_lanes_kernel, lane_smem, "kpool_select");
    const dim3 grid(unsigned(ceil_div(max_pools, kLanePools)), unsigned(S));
    launch(kpool_score_lanes_kernel, grid, 32 * kHeadGroups, lane_smem, st, q, hw, hw_scale, pool_k, nh, d, kpool, pos0,
           max_pools, scratch);
    MOESRV_CUDA_LAUNCH_CHECK();
  } else if (max_pools > 0) {
    const dim3 grid(unsigned(ceil_div(max_pools, kPoolsPerBlock)), unsigned(S));
    launch(kpool_score_kernel, grid, kThreads, smem, st, q, hw, hw_scale, pool_k, nh, d, kpool, pos0, max_pools,
           scratch);
    MOESRV_CUDA_LAUNCH_CHECK();
  }
  // Few queries over long rows: the top-k split over kTopkSplit blocks per query, when the candidates fit the
  // scratch after the S score rows and one chunk fits shared memory.
  // (shared memory: at most the device's opt-in bound, 99 KB on an RTX 3090 / 4090, 227 KB on an H100 / H200)
  const size_t optin = device_block_smem_limit();
  if (!optin) throw std::runtime_error("kpool_select: cannot read the device's shared memory size");
  // (the top-k kernels' static shared memory, the selection's bins and lists, comes out of the same bound)
  cudaFuncAttributes fa_split{}, fa_topk{};
  if (cudaFuncGetAttributes(&fa_split, kpool_topk_split_kernel) != cudaSuccess ||
      cudaFuncGetAttributes(&fa_topk, kpool_topk_kernel) != cudaSuccess)
    throw std::runtime_error("kpool_select: cannot read the top-k kernels' attributes");
  const size_t fixed = std::max(fa_split.sharedSizeBytes, fa_topk.sharedSizeBytes);
  // Both top-k kernels may take all the dynamic shared memory their static part leaves (an upper bound only: each
  // launch asks for what it stages; above 48 KB in all, a kernel must be allowed more explicitly).
  const size_t dynamic_max = size_t(optin) - std::min<size_t>(optin, fixed);
  reserve_dynamic_smem(kpool_topk_split_kernel, dynamic_max, "kpool_select");
  reserve_dynamic_smem(kpool_topk_kernel, dynamic_max, "kpool_select");
  const size_t smem_floats = std::min<size_t>(kSelectSmemPools, dynamic_max / 4);
  const bool radix = kpool_radix_forced();
  const size_t cand = size_t(kTopkSplit) * budget, chunk = (size_t(max_pools) + kTopkSplit - 1) / kTopkSplit;
  const bool split = budget > 0 && S <= kSplitQueries && size_t(max_pools) > 4 * cand && chunk <= smem_floats &&
                     2 * cand <= smem_floats && kpool_select_scratch(S, max_pools, budget) <= scratch_floats;
  float* cand_score = split ? scratch + int64_t(S) * max_pools : nullptr;
  int32_t* cand_pool = split ? reinterpret_cast<int32_t*>(cand_score + int64_t(S) * cand) : nullptr;
  if (split) {
    launch(kpool_topk_split_kernel, dim3(kTopkSplit, unsigned(S)), kSelectThreads, chunk * sizeof(float), st, scratch,
           kpool, budget, pos0, max_pools, radix, cand_score, cand_pool);
    MOESRV_CUDA_LAUNCH_CHECK();
  }
  const size_t staged = split ? cand * 8 : budget > 0 ? std::min<size_t>(max_pools, smem_floats) * 4 : 0;
  launch(kpool_topk_kernel, S, kSelectThreads, staged, st, scratch, kpool, budget, select_tail, pos0, max_pools,
         int(staged / 4), radix, cand_score, cand_pool, sel, sel_k);
  MOESRV_CUDA_LAUNCH_CHECK();
}

}  // namespace moesrv::cuda
