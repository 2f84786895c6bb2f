// EXL3 linear layers on the GPU as separate launches over caller-owned device memory (the engine's budgeted
// buffers; Exl3CudaLinear in exl3_cuda.h is the self-contained wrapper). Plain C++: streams and cuBLAS handles
// are void*. y = (((x ⊙ suh)·H)·W_hat)·H ⊙ svh (+ bias), W_hat decoded from the trellis on the fly (GEMV) or
// into fp16 slabs for cuBLAS (GEMM). Failures throw std::runtime_error.
#pragma once
#include <cstddef>
#include <cstdint>

#include "format/exl3_codebook.h"

namespace moesrv::cuda {

// One EXL3 linear in device memory. Plain data, also stored in device-side tables (grouped expert calls).
struct Exl3Dev {
  const void* trellis = nullptr;  // [in_pad/16][out_pad/16][16K] uint16, 16-byte aligned
  const uint16_t* suh = nullptr;  // fp16 [in_pad]
  const uint16_t* svh = nullptr;  // fp16 [out_pad]
  int K = 0, cb = 0;              // bits per weight; codebook 0 = 3INST, 1 = MCG, 2 = MUL1
  int in_pad = 0, out_pad = 0;    // stored shape (multiples of 128)
  int in = 0, out = 0;            // logical shape (inputs beyond `in` are zero, outputs beyond `out` dropped)
  size_t trellis_bytes() const { return size_t(in_pad / 16) * size_t(out_pad / 16) * 32 * size_t(K); }
  size_t bytes() const { return trellis_bytes() + size_t(in_pad + out_pad) * 2; }  // trellis | suh | svh
};

inline int exl3_cb_index(Exl3Codebook cb) { return cb == Exl3Codebook::Inst3 ? 0 : cb == Exl3Codebook::Mcg ? 1 : 2; }

// Rows of an input batch: row r reads x[src * ld ...], src = rows ? rows[r] : r / div (rows: device array).
// swiglu: the row holds [gate (in) | up (in)] and the input is their SwiGLU, silu(min(gate, limit)) *
// clamp(up, -limit, limit) (limit <= 0: silu(gate) * up), as silu_mul_clamped computes it.
struct Exl3Src {
  const float* x = nullptr;
  int64_t ld = 0;
  const int32_t* rows = nullptr;
  int div = 1;
  bool swiglu = false;
  float limit = 0;
};
// Grouped call: row r uses the weights tab[ids[r]] (device arrays; same shape, K and codebook as the Exl3Dev
// passed alongside, which then only supplies those). Default: every row uses that Exl3Dev.
// With part_rows > 0 the call stacks parts of part_rows rows each (gate and up of the same routed rows): row r uses
// tab[ids[r % part_rows] + (r / part_rows) * part_stride], reads source row r % part_rows, and rotate_out writes it
// to y + (r % part_rows) * y_ld + (r / part_rows) * part_out.
struct Exl3Group {
  const Exl3Dev* tab = nullptr;
  const int32_t* ids = nullptr;
  int part_rows = 0, part_stride = 0;
  int64_t part_out = 0;
};

// Multiprocessors of the current device, read once (first call outside CUDA graph capture).
int exl3_sm_count();
// GEMV blocks per multiprocessor the K split aims at (default 8; MOESRV_EXL3_GEMV_BLOCKS overrides it, for tuning
// runs of the kernel bench), read once.
int exl3_gemv_blocks_per_sm();
// Whether Exl3Gemv::Auto takes the tensor-core kernel for one row too (fp16 input rows; default no, fp32 FMA;
// MOESRV_EXL3_GEMV_TC=1 for tuning runs), read once.
bool exl3_gemv_tc_single();

// The one-row tensor-core GEMV's inner loop (MOESRV_EXL3_GEMV1_VARIANT, default 2), read once: 1 and 2 sum the fp16
// weights (bit-identical results; 2 extracts the states with fewer instructions), 3 sums MUL1 weights unrounded (A
// times the byte-sum values plus C times the inputs' sum): each weight then differs from its fp16 value by at most
// half an fp16 ulp (2^-11 relative), so the product moves up to ~5e-4 (relative, rms) from the fp16-weight one;
// 4 (MUL1 calls with a fused input rotation; others run 2) takes the inputs as int8 hi + lo / 254 of a block scale
// and sums the unrounded MUL1 values on integer tensor cores: each weight's product bytes times the input (no byte
// sum, pairing or fp16 affine per weight); the inputs move by ~2^-15 of the block's largest, the weights as 3's.
int exl3_gemv1_variant();

// Auto: Fp32 for one row per weight, TensorCore for 2..8. Fp32 at one row: the input split into fp16 hi + lo parts
// on tensor cores (fp32-accurate; MOESRV_EXL3_GEMV1_FMA=1: fp32 FMAs instead). Rows: 1..4 plain rows through the
// R-row kernel (exl3_gemv_rows below; fp32-accurate as the one-row kernel).
enum class Exl3Gemv { Auto, TensorCore, Fp32, Rows };
constexpr int kExl3MaxGemvRows = 8;

// xh[n][in_pad] = H(x ⊙ suh), fp32 or (half_out) fp16 bits. zero_yr (optional): also zeroes n rows of out_pad
// floats there, the GEMV output that follows (saves exl3_gemv_rotated's memset node).
void exl3_rotate_in(const Exl3Dev& w, Exl3Group g, Exl3Src src, int n, void* xh, bool half_out, void* stream,
                    float* zero_yr = nullptr);
// yr[n][out_pad] = xh · W_hat for n <= 8 rows per weight (grouped: any n, one row per weight). Zeroes yr first
// unless yr_zeroed (exl3_rotate_in did).
void exl3_gemv_rotated(const Exl3Dev& w, Exl3Group g, const float* xh, int n, float* yr, Exl3Gemv kind, void* stream,
                       bool yr_zeroed = false);
// The GEMV with its input rotation: yr = H(x ⊙ suh) · W_hat for n rows (grouped: one row per weight; else n <= 8).
// One row per weight runs one fused launch whose K split leaves parts (the return value) of the result, part p of
// row r at yr[(p * n + r) * out_pad], as many as yr_floats allow (<= kExl3MaxGemvParts); pass that count to
// exl3_rotate_out. Batches rotate into xh first (1 part).
constexpr int kExl3MaxGemvParts = 64;
// Scratch sizing: callers hold at least this many parts of their largest output (smaller outputs fit more).
constexpr int kExl3GemvScratchParts = 16;
int exl3_gemv_in(const Exl3Dev& w, Exl3Group g, Exl3Src src, int n, void* xh, float* yr, size_t yr_floats,
                 void* stream);
// Counters of exl3_gemv_out's fused output rotation: n * out_pad / 128 of them per call, zero before the first call
// (each call leaves them zero). Calls that may run at once need their own, as they need their own yr.
struct Exl3Tickets {
  unsigned* p = nullptr;
  size_t count = 0;
};
// exl3_gemv_in, then exl3_rotate_out into y (rows y_ld apart, + bias). With MOESRV_EXL3_ROTATE_FUSED=1 (opt-in: it
// passes every check but gained nothing on an H100, docs/perf-cuda.md "Tenth round") in one launch where the GEMV is
// the fused one-row kernel and the tickets suffice: the last block to finish each 128 outputs of a row sums their K
// parts, rotates and scales them. Same arithmetic either way.
void exl3_gemv_out(const Exl3Dev& w, Exl3Group g, Exl3Src src, int n, void* xh, float* yr, size_t yr_floats,
                   Exl3Tickets tickets, float* y, int64_t y_ld, const float* bias, void* stream);
// The R-row GEMV (2..4 rows per weight, as MTP verifies and batched decode steps send): the one-row kernel's
// tensor-core loop with its decoded weights shared by the rows (one product per row, fp16 hi + lo inputs): plain
// rows (CudaEngineOptions::row_gemv) and grouped entries that share weights (CudaEngineOptions::merge_expert_rows)
// through exl3_gemv_rows_out; Exl3Gemv::Rows takes rows already rotated.
// Entries of a grouped call that share weights: set i lists up to kExl3SetRows entries j (i first) with
// ids[j] == ids[i]; the first entry of each run of kExl3SetRows equal ids leads one, the others' sets are empty.
constexpr int kExl3SetRows = 4;
struct Exl3RowSet {
  int32_t count, rows[kExl3SetRows];
};
void exl3_row_sets(const int32_t* ids, int m, Exl3RowSet* sets, void* stream);
// The R-row GEMV with its rotations into y, as exl3_gemv_out writes it (rotate in, GEMV, rotate out: 3 launches);
// xh: n rows of in_pad floats, yr: n rows of out_pad. sets null: n <= kExl3SetRows plain rows share each weight.
// Else a grouped linear of n entries that share weights as `sets` say (no set longer than set_rows <=
// kExl3SetRows): each set's weights are decoded once for its rows.
void exl3_gemv_rows_out(const Exl3Dev& w, Exl3Group g, const Exl3RowSet* sets, int set_rows, Exl3Src src, int n,
                        float* xh, float* yr, float* y, int64_t y_ld, const float* bias, void* stream);
// W_hat columns [16*nt0, 16*(nt0+nts)) as fp16 bits, row-major [in_pad][16*nts].
void exl3_dequant_rotated(const Exl3Dev& w, int nt0, int nts, uint16_t* out, void* stream);
// yr[n][out_pad] = xh16 · W_hat through fp16 slabs of W_hat (at most w16_elems in w16; cuBLAS, fp32 accumulate).
// w16_ready: w16 already holds all of W_hat (fits_whole), skip the dequant.
bool exl3_fits_whole(const Exl3Dev& w, size_t w16_elems);
void exl3_gemm_rotated(const Exl3Dev& w, const uint16_t* xh16, int n, float* yr, uint16_t* w16, size_t w16_elems,
                       bool w16_ready, void* cublas, void* stream);
// Grouped GEMM over expert pieces (prefill): tile i multiplies rows [row0, row0 + rows) of xh16 (fp16 [.][in_pad],
// rows <= tile_rows: 64, 128 or, form 4 only, 256) by W_hat of tab[e] (device table; shape gives K, codebook and sizes,
// shared by all) into the same rows of yr ([.][out_pad], fp32). The trellis is decoded inside the GEMM (no fp16 W_hat,
// one launch).
constexpr int kExl3GemmRows = 256;  // the largest tile (exl3_gemm_form_rows)
struct Exl3GemmTile {
  int32_t e, row0, rows, pad;
};
int exl3_gemm_tile_rows();  // the tile height callers use: exl3_gemm_form_rows of exl3_gemm_form()
// A form's tile height: 64 (MOESRV_EXL3_GEMM_ROWS=128: 128) for forms 0-2, 128 for form 3, 128
// (MOESRV_EXL3_GEMM_ROWS=256: 256) for form 4.
int exl3_gemm_form_rows(int form);
// The kernel (MOESRV_EXL3_GEMM_FORM): 4 (the default where exl3_gemm_wgmma_built(); elsewhere 4 means 1) = Hopper's
// warpgroup MMA with the decoded weights as its register operand (tiles of 128 or 256 rows); 1 (the default
// elsewhere) = each warp decodes the B fragments it multiplies (register B, 4 warps x 32 columns); 2 = the same at 5
// blocks per multiprocessor (fewer registers); 3 = paired register B (8 warps, 128-row tiles only: two warps share
// each decoded tile through shared memory); 0 = session 12's form (8 warps decode a column tile each into shared
// memory).
int exl3_gemm_form();  // for the current device
// Form 4 can run on the current device: an sm_90a build on compute capability 9 (probed once per device by a kernel:
// call it first where no graph is being captured, e.g. while an engine sets up).
bool exl3_gemm_wgmma_built();
// y (forms 1-4): the output rotation as exl3_rotate_out makes it (svh of each tile's expert, no bias) into
// y[row][o], o < shape.out, rows y_ld apart, instead of yr.
void exl3_grouped_gemm(const Exl3Dev& shape, const Exl3Dev* tab, const Exl3GemmTile* tiles, int n_tiles,
                       const uint16_t* xh16, float* yr, void* stream, int tile_rows, int form = -1, float* y = nullptr,
                       int64_t y_ld = 0);
void exl3_grouped_gemm_wgmma(const Exl3Dev& shape, const Exl3Dev* tab, const Exl3GemmTile* tiles, int n_tiles,
                             int tile_rows, const uint16_t* xh16, float* yr, void* stream, float* y,
                             int64_t y_ld);  // (form 4)
// y[r][o] = (H(yr[r]) ⊙ svh)[o] (+ bias[o]) for o < out; y rows y_ld apart. parts: yr holds that many K parts of
// the n rows (exl3_gemv_in), summed in part order.
void exl3_rotate_out(const Exl3Dev& w, Exl3Group g, const float* yr, int n, float* y, int64_t y_ld, const float* bias,
                     void* stream, int parts = 1);

}  // namespace moesrv::cuda
