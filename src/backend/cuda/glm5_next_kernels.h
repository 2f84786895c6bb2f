// Launch wrappers of the GLM-5.3-Flash (glm5_next) block kernels: KDA linear attention (short conv + SiLU, l2norm,
// gates, the gated delta rule, gated output norm), mHC hyper-connections, and the k-pool DSA indexer. fp32 device
// pointers throughout; each matches the CPU reference in src/backend/cpu/ (delta_rule.h, kda.cpp, residual.cpp,
// kpool_indexer.cpp) to fp32 rounding. Position-dependent kernels read the first new position from device memory
// (`pos0`) so that a captured decode graph can be replayed.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace moesrv::cuda {

// ---- KDA / Gated DeltaNet

// Causal depthwise conv over time + SiLU (cpu::causal_conv1d_silu). x [T, C] (rows x_stride apart, x_stride >= C);
// w [C, K] (taps oldest..newest); state [K-1, C]: the K-1 inputs before x, updated in place to the last K-1 inputs
// (taken from the old state when T < K-1). y [T, C] contiguous, must not alias x or state. T >= 0.
void causal_conv1d_silu(const float* x, int64_t x_stride, int T, int C, const float* w, int K, float* state, float* y,
                        cudaStream_t st);

// In place over tokens x heads rows of n values, row (t, h) at x + t * token_stride + h * n:
// x = x / sqrt(sum(x^2) + eps) * scale (FLA's l2norm, then the query scale d^-0.5 when scale != 1).
void l2norm_rows(float* x, int tokens, int heads, int64_t token_stride, int n, float eps, float scale, cudaStream_t st);

// KDA gates, in place. g [S, H*d] holds f_b(f_a x) on entry; on exit the log decay
// g = lower_bound * sigmoid(exp(a_log[h]) * (f + dt_bias)) when lower_bound_set, else -exp(a_log[h]) * softplus(f +
// dt_bias). beta [S*H] (may be null): beta = sigmoid(beta).
void kda_gates(float* g, const float* dt_bias, const float* a_log, int S, int H, int d, bool lower_bound_set,
               float lower_bound, float* beta, cudaStream_t st);

// Gated delta rule recurrence over T tokens (any T >= 0), fp32 state in device memory (cpu::delta_rule_recurrent):
// per head, S = diag(exp(g_t)) S; delta = beta_t (v_t - S^T k_t); S += k_t delta^T; o_t = S^T q_t.
// q, k [T, H, dk] (l2-normalised, q scaled); v [T, H, dv]; g [T, H, dk] (per_channel_decay, KDA) or [T, H] (Gated
// DeltaNet); beta [T, H]; state [H, dk, dv] in/out; out [T, H, dv]. dk a multiple of 32, <= 256.
void delta_rule(int T, int H, int dk, int dv, bool per_channel_decay, const float* q, const float* k, const float* v,
                const float* g, const float* beta, float* state, float* out, cudaStream_t st);
// The same over operands in place in a conv output row (strides) and with q/k heads shared by qk_group value heads
// (Gated DeltaNet: v_heads / k_heads): value head h reads q/k head h / qk_group.
struct DeltaRuleArgs {
  int T = 0, heads = 0, dk = 0, dv = 0;  // heads: value heads (= state heads)
  int qk_group = 1;
  bool per_channel_decay = true;
  const float* q = nullptr;  // [T][qk_stride]: head hk at hk * dk
  const float* k = nullptr;
  int64_t qk_stride = 0;        // 0: contiguous (heads / qk_group) * dk
  const float* v = nullptr;     // [T][v_stride]: head h at h * dv
  int64_t v_stride = 0;         // 0: contiguous heads * dv
  const float* g = nullptr;     // [T, heads, dk] (per_channel_decay) or [T, heads], contiguous
  const float* beta = nullptr;  // [T, heads]
  float* state = nullptr;       // [heads, dk, dv]
  float* out = nullptr;         // [T, heads, dv], contiguous
  // Rollback points (speculative verify, T <= 32): the state after each token t < T - 1 at steps + t * heads * dk *
  // dv, transposed per head ([heads][dv][dk]: a column's dk values contiguous); state_from_step() puts one back.
  float* steps = nullptr;
  // Scratch for the chunked form (runs of >= kDeltaRuleChunkMinTokens tokens, dk == dv in {32, 64, 128}, no steps):
  // at least delta_rule_chunk_floats() floats, more take more chunks per launch pair; null: the recurrence.
  float* chunk_scratch = nullptr;
  int64_t chunk_scratch_floats = 0;
};
void delta_rule(const DeltaRuleArgs& a, cudaStream_t st);
// The chunked (WY) form, chunks of 64 tokens (delta_rule_chunked.cu; cpu::delta_rule_chunked): false when `a` does
// not qualify or a block cannot have its shared memory (dk 64 / 128 on a 99 KB RTX 3090 / 4090); then nothing ran.
// delta_rule() tries it first for runs of >= kDeltaRuleChunkMinTokens tokens unless MOESRV_DELTA_RULE_CHUNKED=0 (read
// per long run; comparisons: the recurrence).
// only (the kernel bench): 1 = the chunk-local kernels alone, 2 = the state kernels alone (over the scratch as left).
constexpr int kDeltaRuleChunkMinTokens = 64;
bool delta_rule_chunked_on();
bool delta_rule_chunked(const DeltaRuleArgs& a, cudaStream_t st, int only = 0);
// Scratch floats per 64-token chunk for `heads` heads (0: dk / dv not supported by the chunked form).
int64_t delta_rule_chunk_floats(int heads, int dk, int dv);
// state [H, dk, dv] = one of delta_rule's steps ([H, dv, dk]).
void state_from_step(const float* step, int H, int dk, int dv, float* state, cudaStream_t st);
// Rollback points of causal_conv1d_silu (call it before, while `state` is the state before x): steps [T-1][K-1][C],
// step t = the conv state after input row t.
void conv_state_steps(const float* x, int64_t x_stride, int T, int C, int K, const float* state, float* steps,
                      cudaStream_t st);

// KDA output: per (token, head) row of d values, o = rms_norm(o) * w * sigmoid(gate) (eps inside the sqrt, mean
// over d). o, gate: [rows, d] (rows = S * H); o in place.
void kda_output_norm(float* o, const float* gate, const float* w, int rows, int d, float eps, cudaStream_t st);

// KDA decode of one token in one launch (kda_decode.cu): causal_conv1d_silu over the q | k | v channels (conv
// state updated), l2norm_rows of q (times q_scale) and k, kda_gates and beta = sigmoid(beta), the delta rule, then
// kda_output_norm; the same arithmetic as those kernels. All pointers are one token's rows: qkv [3 * H * dk] raw
// (before the conv; v heads are dv wide), g [H * dk] = f_b(f_a x) raw, beta [H] raw, gate [H * dv] = g_b(g_a x);
// state [H, dk, dv]; out [H * dv].
struct KdaDecodeArgs {
  int heads = 0, dk = 0, dv = 0, conv_k = 0;
  const float* qkv = nullptr;
  const float* conv_w = nullptr;  // [C][conv_k], C = 2 * H * dk + H * dv
  float* conv_state = nullptr;    // [conv_k - 1][C]
  const float *g = nullptr, *dt_bias = nullptr, *a_log = nullptr;
  bool lower_bound_set = false;
  float lower_bound = 0.0f;
  const float* beta = nullptr;
  float* state = nullptr;
  const float *gate = nullptr, *norm_w = nullptr;
  float l2_eps = 1e-6f, q_scale = 1.0f, norm_eps = 1e-6f;
  float* out = nullptr;
};
bool kda_decode_supported(int dk, int dv, int conv_k);
void kda_decode(const KdaDecodeArgs& a, cudaStream_t st);

// ---- Gated DeltaNet (Qwen3-Next) pieces, layouts as cpu::gated_delta_forward; the recurrence is delta_rule above
// with per_channel_decay false and qk_group = r (or q/k expanded per value head).

// qkvz [S, Hk, 2*dk + 2*r*dv] (per key head: q | k | v (r heads) | z (r heads)) -> mixed [S, C] = q (all heads) |
// k | v, C = 2*Hk*dk + Hk*r*dv (the conv input), and z [S, Hk*r*dv].
void gdn_split_qkvz(const float* qkvz, int S, int Hk, int r, int dk, int dv, float* mixed, float* z, cudaStream_t st);
// ba [S, Hk, 2*r] (per key head: b (r) | a (r)) -> beta = sigmoid(b), g = -exp(a_log) * softplus(a + dt_bias),
// both [S, Hk*r]; dt_bias, a_log [Hk*r].
void gdn_gates(const float* ba, const float* dt_bias, const float* a_log, int S, int Hk, int r, float* g, float* beta,
               cudaStream_t st);
// o = rms_norm(o) * w * silu(z) per row of d (rows = S * Hv); o in place.
void gdn_output_norm(float* o, const float* z, const float* w, int rows, int d, float eps, cudaStream_t st);

// (The clamped SwiGLU of the feed-forward blocks, silu_mul_clamped, is in kernels.h beside silu_mul.)

// ---- mHC hyper-connections (n residual streams of D values per token, x [S, n*D])

// Sub-layer entry (cpu::Residual::enter + cpu::hyper_mix): per token, m = fn . x * rsqrt(mean(x^2) + rms_eps);
// pre = sigmoid(m*scale[0] + base) + hc_eps, post = 2 sigmoid(m*scale[1] + base), comb = Sinkhorn(softmax rows
// + hc_eps) with the column-first order; h = rms_norm(sum_i pre_i x_i) * norm_w. fn [(2+n)*n, n*D], base
// [(2+n)*n], scale [3], norm_w [D]: fp32 device. Outputs h [S, D], post [S, n], comb [S, n, n]. n <= 8.
// part (optional, hyper_enter_scratch(S, n) floats): up to 16 tokens take the split decode path (the sums over many
// blocks, h and the Sinkhorn weights in parallel blocks). cublas (a cublasHandle_t, optional): the others get their
// mixing logits from one fp32 GEMM. Without either, one block per token does everything.
// side (optional, split path only): post and comb are made on side->stream (forked from st after the sums, joined by
// recording side->join), so the sub-layer starts without waiting for the Sinkhorn chain; the caller makes st wait for
// side->join before anything reads post, comb or part (hyper_leave, the next hyper_enter).
struct HyperSide {
  cudaStream_t stream = nullptr;
  cudaEvent_t fork = nullptr, join = nullptr;
};
// Returns whether side->join was recorded (the split path ran with a side stream).
bool hyper_enter(const float* x, int S, int n, int D, const float* fn, const float* scale, const float* base,
                 const float* norm_w, float rms_eps, float hc_eps, int sinkhorn_iters, float* h, float* post,
                 float* comb, float* part, cudaStream_t st, void* cublas = nullptr, const HyperSide* side = nullptr);
// Floats of hyper_enter's part scratch for S tokens (0: S takes another path).
size_t hyper_enter_scratch(int S, int n);
// Decode: the previous site's exit (y set: hyper_leave with the post and comb in place) and this site's
// hyper_enter in one launch (blocks own ranges of D and share their sums through a barrier, then each makes h of
// its range); post and comb are overwritten with this site's, on side->stream as hyper_enter's (same contract), or
// by block 0. scratch: hyper_step_scratch(n) floats for any S, its own buffer (not hyper_enter's), zeroed once
// before the first call (it holds the barriers' counters, which every call leaves at zero). Returns whether side->join
// was recorded. Supported: S <= 16, n <= 4, D <= 16384 and S * ceil(D / 128) blocks within the SM count (one resident
// block per SM), unless MOESRV_MHC_UNFUSED=1 (comparisons: hyper_enter and hyper_leave apart).
bool hyper_step_supported(int S, int n, int D);
size_t hyper_step_scratch(int n);
bool hyper_step(float* x, const float* y, int S, int n, int D, const float* fn, const float* scale, const float* base,
                const float* norm_w, float rms_eps, float hc_eps, int sinkhorn_iters, float* h, float* post,
                float* comb, float* scratch, cudaStream_t st, const HyperSide* side = nullptr);
// Sub-layer exit (cpu::Residual::leave): x_j = post_j * y + sum_i comb[i][j] * x_i (old values), in place.
void hyper_leave(float* x, const float* y, const float* post, const float* comb, int S, int n, int D, cudaStream_t st);
// x [S, n*D] = the embedding rows e [S, D] copied to every stream.
void hyper_expand(const float* e, int S, int n, int D, float* x, cudaStream_t st);
// out [S, D] = mean over the n streams of x [S, n*D] (before the final norm).
void hyper_collapse_mean(const float* x, int S, int n, int D, float* out, cudaStream_t st);

// ---- k-pool DSA indexer (cpu::kpool_select). Device state per layer: pool_k [max_pools, d] (one pooled key per
// completed pool), open_k / open_g [kpool, d] (keys and gate logits of the open pool's tokens, slot = pos % kpool).
// The number of completed pools and open tokens is implied by the position: pos / kpool and pos % kpool.

// Appends S tokens at positions *pos0 .. *pos0+S-1: k [S, d] (already LayerNorm'd), g [S, d] gate logits,
// ape [kpool, d]. Every pool completed by the batch gets its key: per channel, softmax over its kpool tokens of
// (g + ape[t]) weights their keys. The tokens of the pool left open are stored in open_k / open_g.
void kpool_append(const float* k, const float* g, const float* ape, int S, int d, int kpool, const int32_t* pos0,
                  float* pool_k, float* open_k, float* open_g, cudaStream_t st);
// Rollback points of kpool_append (call it before, while `open` = open_k | open_g [2][kpool][d] holds the open pool
// before the batch): steps [S-1][2][kpool][d], step t = the open pool after token t as single-token appends leave it
// (each token that does not close its pool in slot pos % kpool; a closed pool's key in pool_k is ignored by positions
// before it, so a cut back needs only the open pool).
void kpool_open_steps(const float* k, const float* g, int S, int d, int kpool, const int32_t* pos0, const float* open,
                      float* steps, cudaStream_t st);

// Selection for queries at positions p = *pos0 + s (s < S), after kpool_append of the same batch:
// score(P) = sum_h hw[s,h] * relu(q[s,h] . pool_k[P] / sqrt(d)) over pools P < (p+1)/kpool; keeps the top `budget`
// pools (ties at the k-th score go to the lower pool index; the CPU follows torch.topk's order instead), expands
// them to their kpool positions, then (select_tail) appends positions kpool*((p+1)/kpool) .. p. sel [S][sel_k]:
// ascending positions, -1 padded; sel_k >= budget*kpool + (select_tail ? kpool-1 : 0). q [S, nh, d]; hw [S, nh]
// times hw_scale (the indexer's nh^-0.5: each weight w * hw_scale, rounded as a separate scaling pass would) are
// the head weights. scratch: scratch_floats >= S * max_pools floats (max_pools = pool_k capacity,
// >= (*pos0+S)/kpool); with kpool_select_scratch(S, max_pools, budget) of them, a few queries split their top-k over
// several blocks (decode).
size_t kpool_select_scratch(int S, int max_pools, int budget);
void kpool_select(const float* q, const float* hw, const float* pool_k, int S, int nh, int d, int kpool, int budget,
                  bool select_tail, const int32_t* pos0, int max_pools, float* scratch, size_t scratch_floats,
                  int32_t* sel, int sel_k, cudaStream_t st, float hw_scale = 1.0f);

}  // namespace moesrv::cuda
