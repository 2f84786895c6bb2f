// Gated delta rule (KDA: per-key-channel decay; Gated DeltaNet: per-head scalar decay) on fp32, CPU.
// Per head, state S is [dk, dv] row-major; per token t (q, k already L2-normalised, q already scaled):
//   S = diag(exp(g_t)) S;  delta = beta_t (v_t - S^T k_t);  S += k_t delta^T;  o_t = S^T q_t.
// Matches transformers' recurrent/chunk_kimi_delta_attention (glm5_next) and torch_*_gated_delta_rule (qwen3_next).
#pragma once
#include <cstdint>

namespace moesrv::cpu {

struct DeltaRuleShape {
  int64_t heads, dk, dv;
  bool per_channel_decay;  // true (KDA): g is [T, H, dk]; false (GDN): g is [T, H]
};

// q, k: [T, H, dk]; v: [T, H, dv]; g: log decays (<= 0); beta: [T, H]; state: [H, dk, dv] in/out; out: [T, H, dv].
// All dense row-major. Token-by-token recurrence: the decode path (any T; cache-blocked over dv columns).
void delta_rule_recurrent(const DeltaRuleShape& s, int64_t T, const float* q, const float* k, const float* v,
                          const float* g, const float* beta, float* state, float* out);
// Chunked (WY) form, chunks of 64 tokens: the prefill path. Same result as the recurrence to fp32 rounding.
void delta_rule_chunked(const DeltaRuleShape& s, int64_t T, const float* q, const float* k, const float* v,
                        const float* g, const float* beta, float* state, float* out);

// Causal depthwise conv over time + SiLU. x [T, C]; w [C, K] (taps oldest..newest, torch conv1d weight [C,1,K]);
// state [K-1, C]: the K-1 inputs before x (zeros at sequence start), updated to the last K-1 inputs. y [T, C]
// (y may not alias x). Any T >= 0, including T < K-1.
void causal_conv1d_silu(const float* x, int64_t T, int64_t C, const float* w, int64_t K, float* state, float* y);

// In place: each row of n values x /= sqrt(sum(x^2) + eps) (FLA's l2norm: + eps, not max).
void l2_normalize_rows(float* x, int64_t rows, int64_t n, float eps = 1e-6f);

}  // namespace moesrv::cpu
