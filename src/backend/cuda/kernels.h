// Launch wrappers of the engine's CUDA kernels (bf16 weights as uint16_t bits, fp32 activations).
// Position-dependent kernels read the first new position from device memory (`pos0`) and the KV cache
// pointers from a device-side DeviceLayerCache, so a captured decode graph serves every step and sequence.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace moesrv::cuda {

// One layer's cache of the current sequence, in device memory. kv: MLA [T][r+dr] (latent | roped key) or
// GQA keys [T][KV*hd]; v: GQA values; bf16, or int8 with a per-token fp32 scale when q8.
struct DeviceLayerCache {
  void* kv = nullptr;
  float* kv_scale = nullptr;
  void* v = nullptr;
  float* v_scale = nullptr;
  uint16_t* index_k = nullptr;  // DSA indexer keys [T][index_head_dim], bf16
};
enum class CacheField { Kv, V, IndexK };

// out = *pos0 + add (positions of a later slice of the batch, kept on the device).
void offset_position(const int32_t* pos0, int add, int32_t* out, cudaStream_t st);
void embed_gather(const uint16_t* table, const int32_t* ids, int S, int D, float* out, cudaStream_t st);
// y = x / rms(x) * w over `rows` rows of length d; rows are `x_stride`/`y_stride` apart (x and y may alias).
void rms_norm(const float* x, int64_t x_stride, const float* w, int rows, int d, float eps, float* y,
              int64_t y_stride, cudaStream_t st);
// x += add (when add != null), then y = rms_norm(x) * w.
void add_rms_norm(float* x, const float* add, const float* w, int rows, int d, float eps, float* y, cudaStream_t st);
void layer_norm(const float* x, const float* w, const float* b, int rows, int d, float eps, float* y, cudaStream_t st);
// Rotates `dim` values at `offset` inside each of `heads` heads (head_stride apart) of token rows
// (tok_stride apart), position pos0 + row. cos_sin: [max_ctx][dim/2][2] with the attention factor applied.
void rope(float* x, int S, int heads, int64_t tok_stride, int head_stride, int offset, int dim, bool interleaved,
          const float* cos_sin, const int32_t* pos0, cudaStream_t st);
// gu rows are [gate(I) | up(I)]; out[r][i] = silu(gate) * up.
void silu_mul(const float* gu, int rows, int I, float* out, cudaStream_t st);
// SwiGLU clamp (swiglu_limit): silu(min(gate, limit)) * clamp(up, -limit, limit); limit <= 0 is plain silu_mul.
void silu_mul_clamped(const float* gu, int rows, int I, float limit, float* out, cudaStream_t st);
// Gated attention output (attn_output_gate): x[r][i] *= sigmoid(gate[r * gate_stride + i]), rows of n values.
void sigmoid_gate_rows(float* x, const float* gate, int64_t gate_stride, int rows, int n, cudaStream_t st);
void to_bf16(const float* x, int64_t n, uint16_t* y, cudaStream_t st);
void from_bf16(const uint16_t* x, int64_t n, float* y, cudaStream_t st);
// x = hi + lo with hi exactly representable in TF32 (10-bit mantissa) and lo = x - hi; rows of `cols` values, x_ld /
// hi_ld / lo_ld apart (hi may be x: in place). A GEMM then runs on TF32 tensor cores at about fp32 accuracy as
// W hi + W lo when W is TF32-exact (bf16 weights), else as W_hi hi + W_hi lo + W_lo hi.
void split_tf32(const float* x, int64_t rows, int cols, int64_t x_ld, float* hi, int64_t hi_ld, float* lo,
                int64_t lo_ld, cudaStream_t st);
// out row r (2 cols bf16 values, rows 2 cols apart) = [hi | lo], hi = bf16(x[r]), lo = bf16(x[r] - hi): x to ~16 bits
// as two bf16 parts, so that W x (W bf16) is one bf16 GEMM over the doubled K against [W | W].
void split_bf16x2(const float* x, int64_t rows, int cols, int64_t x_ld, uint16_t* out, cudaStream_t st);
// y[t][o] = w[o] . x[t] (+ bias[o]) for n <= kBf16GemvMaxRows tokens: bf16 weights [out][in], fp32 inputs, one
// launch (the decode path of bf16 linears; more rows go through cuBLAS).
constexpr int kBf16GemvMaxRows = 8;
void bf16_gemv(const uint16_t* w, int out, int in, const float* x, int n, const float* bias, float* y, cudaStream_t st);
void add_bias(float* y, const float* b, int rows, int cols, cudaStream_t st);
// out[i] = bf16(x[rows[i]]) for i < n (D values per row).
void gather_rows_bf16(const float* x, const int32_t* rows, int n, int D, uint16_t* out, cudaStream_t st);
// Stores S token rows of `row_len` values (src rows src_stride apart) into the cache at positions pos0 + s.
void cache_write(const float* src, int64_t src_stride, int S, int row_len, const DeviceLayerCache* lc,
                 CacheField field, bool q8, const int32_t* pos0, cudaStream_t st);

// *out = the index of the largest of the n values x (NaN skipped, the lowest index among equal maxima; 0 when x[0] or
// every value is NaN: what std::max_element returns). scratch: argmax_scratch_bytes(), zeroed once before the first
// call (its counter is left zero after each).
size_t argmax_scratch_bytes();
void argmax(const float* x, int n, void* scratch, int32_t* out, cudaStream_t st);

// MLA: qcat[s][h] = [W_uk[h]^T q_nope | q_rope] (the query in latent space), w_uk [H][dn][r].
void mla_query(const float* q, const uint16_t* w_uk, int S, int H, int dn, int dr, int r, float* qcat, cudaStream_t st);
// out[s][h*dv + i] = W_uv[h][i] . o_lat[s][h], w_uv [H][dv][r].
void mla_output(const float* o_lat, const uint16_t* w_uv, int S, int H, int dv, int r, float* out, cudaStream_t st);

// Causal attention of S queries (H heads, rows q_dim apart) over the cache, online softmax in key tiles.
// MLA: keys are whole cache rows (r+dr), values their first r values, every head shares them.
// GQA: keys/values are kv-head slices of width q_dim. selection (DSA, optional): [S][sel_k] key positions,
// -1 padded. out: [S][H][v_dim].
struct AttentionArgs {
  const float* q = nullptr;
  int S = 0, H = 0, q_dim = 0, v_dim = 0, kv_heads = 1;
  bool mla = false, q8 = false;
  const DeviceLayerCache* lc = nullptr;
  const int32_t* selection = nullptr;
  int sel_k = 0;
  const int32_t* pos0 = nullptr;
  float scale = 1.0f;
  float* out = nullptr;
};
void attention(const AttentionArgs& a, cudaStream_t st);

// MLA attention of a few tokens (decode; mla_split.cu): attention()'s result for a.mla, with the keys split into
// kMlaSplits ranges over more blocks, each range's partial softmax state in `part` (mla_split_floats() floats), then
// merged. The ranges run on CUDA cores (each key tile shared by 8 heads, fp32 throughout) or, where
// mla_prefill_supported (bf16 cache), on tensor cores (mla_prefill.cu's kernel per range: its fp16 probabilities);
// Auto takes tensor cores unless MOESRV_MLA_SPLIT_TC=0.
constexpr int kMlaSplitMaxTokens = 8, kMlaSplitMaxKeyWidth = 640, kMlaSplits = 32;
enum class MlaSplitPath { Auto, CudaCores, TensorCores };
bool mla_split_supported(const AttentionArgs& a);
size_t mla_split_floats(int S, int H, int v_dim);
void mla_split_attention(const AttentionArgs& a, float* part, cudaStream_t st, MlaSplitPath path = MlaSplitPath::Auto);

// MLA attention of a prefill pass on tensor cores (mla_prefill.cu): attention()'s result for a.mla with a bf16 cache,
// each block one token and 16 heads (32 or 64 where the device gives a block ~187 / ~213 KB: the next key tile
// prefetched) sharing every staged key tile; fp16 MMAs with fp32 accumulation (q split into two fp16 parts, the
// probabilities rounded to fp16). Widths: multiples of 8, v_dim <= min(512, q_dim), q_dim <= 640. max_groups: 16-head
// groups sharing each staged key tile at most (1, 2 or 4; 5: the warpgroup-MMA form where supported; 0: the most the
// shape and device allow, unless MOESRV_MLA_PREFILL_GROUPS caps it); the forms differ only in their scores' summation
// order.
bool mla_prefill_supported(const AttentionArgs& a);  // shapes, and the block's shared memory on this device
size_t mla_prefill_block_smem(int q_dim);            // that shared memory (dynamic + static), bytes
void mla_prefill_attention(const AttentionArgs& a, cudaStream_t st, int max_groups = 0);
// The wide form (mla_prefill_wide.cu, 4 groups: 64 heads per block): q_dim <= 512, v_dim / 16 in {2, 4, 8, 16, 32},
// ~213 KB of shared memory per block (H100 / H200).
bool mla_prefill_wide_supported(const AttentionArgs& a);
void mla_prefill_wide(const AttentionArgs& a, cudaStream_t st);
// The warpgroup-MMA form (mla_prefill_wgmma.cu, sm_90a builds on Hopper; mla_prefill_attention takes it by default,
// not with MOESRV_MLA_WGMMA=0 or max_groups < 5): 64 heads per block, q_dim == v_dim == 512. q_split: 1 = q as fp16
// value + remainder (32-key tiles), 0 = one fp16 value (64-key tiles), -1 = MOESRV_MLA_Q_SPLIT (default 1). v2:
// the kernel's V2 (indices a tile ahead, rescales skipped where exact): 1 / 0, -1 = MOESRV_MLA_WGMMA_V2
// (default 1).
bool mla_prefill_wgmma_supported(const AttentionArgs& a);
void mla_prefill_wgmma(const AttentionArgs& a, cudaStream_t st, int q_split = -1, int v2 = -1);
// The same kernel over key range blockIdx.z of kMlaSplits, leaving mla_split_attention's partial state in `part`.
void mla_prefill_split_ranges(const AttentionArgs& a, float* part, cudaStream_t st);

// DSA lightning indexer top-k for queries [s_begin, s_begin + n): scores over cached keys with ReLU heads,
// exact top-min(K, pos+1), ties to the lower position, written in ascending position order, -1 padded.
// q: [S][nh][d] (roped), hw: [S][nh] head weights; scratch: n * max_ctx floats.
void dsa_topk(const float* q, const float* hw, const DeviceLayerCache* lc, int s_begin, int n, int nh, int d, int K,
              const int32_t* pos0, int64_t max_ctx, float* scratch, int32_t* sel, cudaStream_t st);

// Router (model/router.cpp's route_token), one warp per token: scores are sigmoid(logit) with the correction
// bias added for the choice, or (softmax) the softmax over all E experts with no bias; then group-limited top-k
// (ties to the lower index), weights = scores of the picks, renormalised when norm_topk, times scaling.
struct RouterArgs {
  int E = 0, groups = 1, topk_groups = 1, k = 0;
  bool norm_topk = true;
  bool softmax = false;  // Qwen3-Next: softmax top-k (bias unused)
  float scaling = 1.0f;
  // >= 0: ids / weights rows are [1 + k], entry 0 = shared_id with weight 1 (the shared expert run as one more
  // grouped entry), then the k picks.
  int shared_id = -1;
  // Optional usage counters (graph safe): counts[id] += 1 per pick, tokens[0] += S.
  uint32_t* counts = nullptr;
  uint32_t* tokens = nullptr;
};
void route(const float* logits, const float* bias, int S, const RouterArgs& a, int32_t* ids, float* weights,
           cudaStream_t st);
// The router logits and route() in one launch, for decode: logits[s][e] = router[e] . h[s] (fp32; router [E][D],
// h [S][D], rows 16-byte aligned, D % 4 == 0, S <= kRouteFusedMaxTokens) summed by many blocks per 1024-column slice
// into `part` (route_fused_floats), then the last block to finish routes every token as route() (same picks and
// weights for the same logits; the logits' summation order differs from cuBLAS). ticket: a device counter, zero
// before the first launch; the last block resets it, so launches (and graph replays) follow each other freely on
// one stream, never two at once on one ticket.
constexpr int kRouteFusedMaxTokens = 8;
bool route_fused_supported(int S, int E, int D, const float* router, const float* h);
size_t route_fused_floats(int S, int E, int D);
void route_fused(const float* router, const float* h, const float* bias, int S, int D, const RouterArgs& a, float* part,
                 unsigned* ticket, int32_t* ids, float* weights, cudaStream_t st);

// Small int32 arrays of a host-planned decode pass written by one kernel from values passed by value (up to 4 arrays,
// kIntWritesMax values in all), so no copy engine (busy with expert copies) stands between the plan and its kernels.
constexpr int kIntWritesMax = 448;
struct IntWrites {
  int32_t* dst[4] = {nullptr, nullptr, nullptr, nullptr};
  int n[4] = {0, 0, 0, 0};
  int32_t v[kIntWritesMax];  // the arrays' values one after another
};
void write_ints(const IntWrites& w, cudaStream_t st);

// Gated shared expert (Qwen3-Next): y[s] *= sigmoid(x[s] . w) per token; x, y [S][D], w [D] (fp32).
void shared_expert_gate(const float* x, const float* w, int S, int D, float* y, cudaStream_t st);

// Grouped expert GEMVs for small batches, experts picked on the device: entry i = token i / k, expert ids[i].
// gate_up[e]: [2I][D] bf16, down[e]: [D][I] bf16 (device pointer tables). act: [S*k][I], y: [S*k][D].
void moe_gemv(const float* x, const int32_t* ids, int S, int k, int D, int I, const uint16_t* const* gate_up,
              const uint16_t* const* down, float* gu_scratch, float* act, float* y, cudaStream_t st,
              float limit = 0.0f);  // limit > 0: clamped SwiGLU
// out[s] += sum_j weights[s*k+j] * y[rowmap[s*k+j] - row_lo] (rowmap null: identity) + extra[s], over the entries
// whose row is in [row_lo, row_hi) (rowmap -1: skipped): a pass whose sorted rows run in waves combines each wave
// from its buffer. overwrite: out[s] = that sum (out is not read). tokens (device, n_tokens of them): only those
// tokens s (a wave's, each with an entry in it), instead of all S.
void moe_combine(float* out, const float* y, const int32_t* rowmap, const float* weights, const float* extra, int S,
                 int k, int D, cudaStream_t st, bool overwrite = false, int row_lo = 0, int row_hi = 1 << 30,
                 const int32_t* tokens = nullptr, int n_tokens = 0);

}  // namespace moesrv::cuda
