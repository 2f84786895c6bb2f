#!/usr/bin/env bash
# Runs on the GPU machine, from the repo root, after `scripts/gpu_carry.sh` here and
# `tar -cf - .gpu | xz -T1 --lzma2=preset=6,dict=256MiB > .gpurun/gpu.tar.xz` (~49 MB: the test binaries' identical
# CUDA fatbins deduplicate within the 256 MiB window; `xz -9`'s 64 MiB window gives ~62 MiB, over the 64 MiB carry
# limit with the tree) (carry .gpurun): the CUDA suites and, with BENCH=1, the real-width glm5_next slice whose JSON
# lands in $OUT/glm5-next-h200.json (copy it to docs/perf/). Logs go to $OUT; a summary is printed.
#   scripts/gpu_suite.sh            kernels + MTP + batch + engine + pipeline + EXL3 suites (~45 s on an H100)
#   KBENCH=1 scripts/gpu_suite.sh   + the per-kernel decode bench (cuda_kernel_bench; $OUT/kernels.json);
#                                   GEMV_SWEEP="8 16 16tc" also times the EXL3 rows at those GEMV blocks per SM (tc: tensor cores at 1 row)
#   BENCH=1 scripts/gpu_suite.sh    + the glm5_next EXL3 bench (loads 4- and 12-layer real-width slices), + the
#                                   pipeline hand-off overhead per decode token
#   The bench's matrix comes from the environment (defaults: contexts 8192,32768, budget all, uniform routing), e.g.
#   MOESRV_BENCH_BUDGETS=all,44,22 MOESRV_BENCH_ROUTING=skewed,uniform MOESRV_BENCH_CONTEXTS=8192,32768,131072
#   BENCH_TIMEOUT=540 BENCH=1 scripts/gpu_suite.sh   (split it over calls: one call runs for at most 600 s);
#   MOESRV_BENCH_MLA_SPLIT=0 decodes MLA with the per-head kernel instead of the key-split default.
#   INT8_GEMV=1 scripts/gpu_suite.sh   + the one-row GEMV's variant 4 (MUL1 on integer tensor cores) against the
#                                   default variant 2 in one run (~4 min): exl3_cuda_bench's checks and the EXL3
#                                   engine suite under it, the kernel bench's EXL3 / decode rows at K=3 and 4, the
#                                   all-VRAM slice (8K).
#   OVERLAP_AB=1 scripts/gpu_suite.sh  + the decode overlaps (default since session 42) against the serial order in
#                                   one run (~6 min): the kernel bench's decode-layer rows and the all-VRAM slice (8K,
#                                   131K) with each of MOESRV_KPOOL_SIDE=0, MOESRV_SHARED_SIDE=0 (kernel bench) and
#                                   with both plus MOESRV_DEVICE_ARGMAX=0 (slice), each beside the default.
#   ROTATE_FUSED=1 scripts/gpu_suite.sh + the output rotation inside the one-row GEMV (MOESRV_EXL3_ROTATE_FUSED=1,
#                                   opt-in: passes, no gain on an H100; ~3 min): the EXL3 suite and exl3_cuda_bench's
#                                   checks under it, the kernel bench's EXL3 / decode rows (K=3), the slice both ways.
#   SPLIT_SWEEP=1 scripts/gpu_suite.sh + the one-row GEMV's K split (MOESRV_EXL3_GEMV1_SPLIT) swept over the decode
#                                   shapes at K=3 (cuda_kernel_bench --split-sweep, ~1 min)
#   ROWS=1 scripts/gpu_suite.sh     + few-token forwards (~4 min): the EXL3 suite with merged expert entries
#                                   (MOESRV_EXL3_MERGE_ROWS=1), the kernel bench's few-token rows (--only rows, K=3),
#                                   the all-VRAM slice's MTP verify rows with the batch kernel (MOESRV_EXL3_GEMV_ROWS=0),
#                                   the R-row GEMV (default) and merged experts.
#   MTP=1 scripts/gpu_suite.sh      + the all-VRAM slice at 8K (~2.5 min): decode and the MTP verify rows (forward_hidden
#                                   with rollback points, graphs of up to 4 rows, then a cut back to the first token).
#   STREAMS=1 scripts/gpu_suite.sh  + the all-VRAM slice at 8K with 1, 2 and 4 streams, forward_batch as one pass and as one
#                                   forward per stream (MOESRV_CUDA_BATCH=0), ~5 min.
#   PGROUPS="8192x1 8192x4" scripts/gpu_suite.sh + the slice at 131K under 22 GiB (PGROUP_CONTEXTS,
#                                   PGROUP_BUDGETS override) per prefill pass x prefill group (MOESRV_BENCH_PREFILL_CHUNK,
#                                   MOESRV_PREFILL_GROUP), one JSON each ($OUT/group_PASSxGROUP.json); ~1.5 min each.
#   ZERO_COPY=1 scripts/gpu_suite.sh + the kernel bench's expert rows (VRAM, and 8 routed read from host memory: the
#                                   PCIe rate the GEMV reaches), the slice under 22 GiB at 8K (ZC_BUDGETS, ZC_CONTEXTS override) with the host
#                                   experts copied into LRU slots (default) and read in place by the decode GEMVs
#                                   (MOESRV_ZERO_COPY=1), one JSON each ($OUT/zero_copy[01].json); ~2 min each.
#   HL_RUNS="4:0 4:2" scripts/gpu_suite.sh + the slice at 131K under 22 GiB (HL_CONTEXTS, HL_BUDGETS override) per
#                                   prefill stream window : hybrid lanes (MOESRV_STREAM_WINDOW, MOESRV_HYBRID_LANES;
#                                   $OUT/hl_W_L.json); ~2 min each.
#   PF_BUDGETS="22 44" scripts/gpu_suite.sh + the slice at 8K (PF_CONTEXTS) under each budget per PF_RUNS entry
#                                   N:G (default "0:0 0:1 3:1": MOESRV_PREFETCH_EXPERTS=N experts of the next layer
#                                   copied ahead, MOESRV_HYBRID_GROUPED=G grouped launches), one JSON each
#                                   ($OUT/pf_BUDGET_N_G.json); ~2 min each. SUITES=0 skips the suites.
#   LEND_BUDGETS="22 44" scripts/gpu_suite.sh + the slice at 8K (LEND_CONTEXTS) under each budget with the lent pass
#                                   arena on and off (LEND_RUNS, default "1 0": MOESRV_LEND_ARENA), $OUT/lend_BUDGET_F.json
#   VW_BUDGETS="22 44" scripts/gpu_suite.sh + the slice at 8K (VW_CONTEXTS) under each budget per LRU victim window
#                                   (VW_RUNS, default "16 1": MOESRV_CACHE_VICTIM_WINDOW), $OUT/vw_BUDGET_W.json
#   WAVE_RUNS="1 0" scripts/gpu_suite.sh + the all-VRAM slice (8K, 131K; WAVE_CONTEXTS) with the EXL3 experts of a
#                                   prefill in grouped waves (1) and one by one on lanes (0) (MOESRV_EXL3_WAVES), $OUT/wave_F.json
#   GEMM=1 scripts/gpu_suite.sh     + the prefill experts' grouped EXL3 GEMM (~5 min): exl3_cuda_bench's checks (both
#                                   kernel forms), the EXL3 suite with every prefill expert through it
#                                   (MOESRV_EXL3_GROUPED_GEMM=1), the kernel bench's prefill rows at K=3 and 4 (64- and
#                                   128-row tiles), the EXL3 suite with form 3, the all-VRAM slice (GEMM_CONTEXTS,
#                                   default 8K) with pieces of <= 512 rows grouped and the rest through cuBLAS (the
#                                   default), every piece grouped (forms 1, 3) and every piece through dequantization
#                                   + cuBLAS ($OUT/gemm_NAME.json).
#   WGMMA=1 scripts/gpu_suite.sh    + form 4 of the grouped EXL3 GEMM (wgmma, sm_90a; ~6 min): exl3_cuda_bench's checks,
#                                   the EXL3 suite with every prefill expert through form 4, the kernel bench's prefill
#                                   rows at K=3 and 4, the all-VRAM slice (WGMMA_CONTEXTS, default 8K) with form 1,
#                                   form 4 with pieces of <= 512 rows grouped and with every piece grouped (tiles of
#                                   128 rows, and of 256) ($OUT/wg_NAME.json).
#   PREFILL_AB=1 scripts/gpu_suite.sh + the all-VRAM slice (PAB_CONTEXTS, default 8K) with the default prefill kernels,
#                                   with q one fp16 value in the MLA scores (MOESRV_MLA_Q_SPLIT=0, opt-in), the router's
#                                   logits on TF32 (MOESRV_ROUTER_TF32=1, opt-in), the wide MLA form instead of the
#                                   warpgroup-MMA one (MOESRV_MLA_WGMMA=0), the TF32 absorption (MOESRV_MLA_ABSORB=1) and
#                                   expert pieces of up to 1024 rows through the grouped GEMM (default 512),
#                                   $OUT/pab_NAME.json (8 files come back from a call); ~5 min.
#   MLA_V2=1 scripts/gpu_suite.sh   + the warpgroup-MMA MLA prefill's V2 (the default; MOESRV_MLA_WGMMA_V2=0: the first form; ~1 min): its
#                                   kernel test, the kernel bench's MLA rows with V2 off / on, q split and not.
#   PREFILL_NCU=1 SUITES=0 scripts/gpu_suite.sh  an all-VRAM prefill's device time kernel by kernel (issue 20; ~3-5
#                                   min): ncu durations of the slice's first NCU_LAUNCHES launches (default 3500: setup
#                                   and the 4-layer slice's prefill at NCU_CONTEXT, default 8192) summed by kernel name
#                                   (scripts/ncu_by_kernel.py) into $OUT/ncu_by_kernel.txt; raw rows $OUT/ncu_raw.csv.
#   CPU_EXPERTS=1 scripts/gpu_suite.sh + the host CPU's EXL3 expert kernels (issue 21; ~5 min, no GPU): every GEMV path
#                                   one thread per strip (exl3_strip_bench) and experts at 1, 8 and 16 threads
#                                   (exl3_expert_bench, with the opt-in avx512-int8 path's column), 16 threads again
#                                   without the thread pool's polling; docs/perf.md.
set -uo pipefail
OUT=${OUT:-/tmp/gpu_out}
mkdir -p "$OUT"
[[ -d .gpu ]] || tar -xJf .gpurun/gpu.tar.xz
mkdir -p /work/shared && cp -r .gpu/testdata /work/shared/
export LD_LIBRARY_PATH=$PWD/.gpu/lib
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
summary() { grep -E "FAILED|PASSED|tests ran|exception|Failure|perf" "$1" | grep -v "^\[       OK" | head -60; }
# The glm5_next slice all in VRAM, skewed routing: slice NAME CONTEXTS TIMEOUT [VAR=value ...] ($OUT/slice_NAME.log)
slice() {
  local name=$1 contexts=$2 limit=$3
  shift 3
  env MOESRV_CUDA_BENCH=1 MOESRV_BENCH_CONTEXTS="$contexts" MOESRV_BENCH_ROUTING=skewed MOESRV_BENCH_BUDGETS=all \
    MOESRV_BENCH_STREAMS=0 "$@" timeout "$limit" .gpu/test_cuda_exl3_synthetic --gtest_filter='*Glm5Next*' \
    >"$OUT/slice_$name.log" 2>&1
  echo "slice $name rc=$?:"; grep -E "perf \] (glm5_next 45|MTP)" "$OUT/slice_$name.log" | head -8
}
# Named slices: slices PREFIX CONTEXTS TIMEOUT "NAME VAR=value ..." ... ($OUT/slice_PREFIXNAME.log, PREFIXNAME.json)
slices() {
  local prefix=$1 contexts=$2 limit=$3 run name
  shift 3
  for run in "$@"; do
    set -- $run
    name=$prefix$1
    shift
    slice "$name" "$contexts" "$limit" "$@" MOESRV_BENCH_JSON="$OUT/$name.json"
    grep -E "perf \] prefill device" "$OUT/slice_$name.log" | head -2
  done
}
if [[ ${SUITES:-1} == 1 ]]; then  # SUITES=0: measurements only
  timeout 60 .gpu/test_cuda_glm5_next_kernels >"$OUT/kernels.log" 2>&1; summary "$OUT/kernels.log"
  timeout 200 .gpu/test_cuda_mtp >"$OUT/mtp.log" 2>&1; summary "$OUT/mtp.log"
  timeout 200 .gpu/test_cuda_batch >"$OUT/batch.log" 2>&1; summary "$OUT/batch.log"
  timeout 200 .gpu/test_cuda_engine >"$OUT/engine.log" 2>&1; summary "$OUT/engine.log"
  timeout 200 .gpu/test_cuda_pipeline >"$OUT/pipeline.log" 2>&1; summary "$OUT/pipeline.log"
  MOESRV_EXL3_CACHE=.gpu/testdata/exl3 timeout 120 .gpu/test_cuda_exl3_engine >"$OUT/exl3.log" 2>&1
  summary "$OUT/exl3.log"
fi
if [[ ${KBENCH:-0} == 1 ]]; then  # every decode kernel at the real shapes (docs/perf-cuda.md)
  timeout 300 .gpu/cuda_kernel_bench --json "$OUT/kernels.json" >"$OUT/kernel_bench.log" 2>"$OUT/kernel_bench.err"
  echo "kernel bench rc=$?"; cat "$OUT/kernel_bench.log"
  for v in ${GEMV_SWEEP:-}; do  # blocks per SM (MOESRV_EXL3_GEMV_BLOCKS), "tc" suffix: tensor cores for one row
    b=${v%tc}; tc=0; [[ $v == *tc ]] && tc=1
    MOESRV_EXL3_GEMV_BLOCKS=$b MOESRV_EXL3_GEMV_TC=$tc timeout 120 .gpu/cuda_kernel_bench --quick --only EXL3,decode \
      >"$OUT/kernel_bench_$v.log" 2>/dev/null
    echo "GEMV $v:"; grep -E "EXL3|decode" "$OUT/kernel_bench_$v.log" | head -24
  done
fi
if [[ ${BENCH:-0} == 1 ]]; then
  MOESRV_CUDA_BENCH=1 MOESRV_BENCH_JSON="$OUT/glm5-next-h200.json" timeout "${BENCH_TIMEOUT:-300}" .gpu/test_cuda_exl3_synthetic \
    --gtest_filter='*Glm5Next*' >"$OUT/bench.log" 2>&1
  summary "$OUT/bench.log"
  MOESRV_CUDA_BENCH=1 timeout 120 .gpu/test_cuda_pipeline --gtest_filter='CudaPipelineBench.*' >"$OUT/pipeline_bench.log" 2>&1
  summary "$OUT/pipeline_bench.log"
fi
if [[ ${OVERLAP_AB:-0} == 1 ]]; then  # docs/perf-cuda.md, "Eighth round"
  kb() {  # $1: name; rest: env
    local name=$1; shift
    env "$@" timeout 120 .gpu/cuda_kernel_bench --only "decode layer" >"$OUT/kb_$name.log" 2>/dev/null
    echo "kernel bench $name rc=$?:"; grep -E "^decode layer" "$OUT/kb_$name.log"
  }
  kb default; kb nokpool MOESRV_KPOOL_SIDE=0; kb noshared MOESRV_SHARED_SIDE=0; kb serial MOESRV_KPOOL_SIDE=0 MOESRV_SHARED_SIDE=0
  slice default 8192,131072 200
  slice serial 8192,131072 200 MOESRV_KPOOL_SIDE=0 MOESRV_SHARED_SIDE=0 MOESRV_DEVICE_ARGMAX=0
  slice default2 8192,131072 200
fi
if [[ ${INT8_GEMV:-0} == 1 ]]; then  # docs/perf-cuda.md, "Eighth round"
  MOESRV_EXL3_GEMV1_VARIANT=4 timeout 200 .gpu/exl3_cuda_bench --quick >"$OUT/exl3_bench_v4.log" 2>&1
  echo "exl3_cuda_bench variant 4 rc=$?:"; grep -E "FAIL|checks|one-row" "$OUT/exl3_bench_v4.log" | head -20
  MOESRV_EXL3_GEMV1_VARIANT=4 MOESRV_EXL3_CACHE=.gpu/testdata/exl3 timeout 120 .gpu/test_cuda_exl3_engine \
    >"$OUT/exl3_v4.log" 2>&1
  echo "EXL3 suite variant 4:"; summary "$OUT/exl3_v4.log"
  for bits in 3 4; do
    for v in 2 4; do
      MOESRV_EXL3_GEMV1_VARIANT=$v timeout 120 .gpu/cuda_kernel_bench --bits $bits --only "EXL3,decode layer,lm_head" \
        >"$OUT/kb_k${bits}_v$v.log" 2>/dev/null
      echo "kernel bench K=$bits variant $v rc=$?:"; grep -E "^(KDA EXL3 q|MoE EXL3 experts|head EXL3|decode layer)" \
        "$OUT/kb_k${bits}_v$v.log"
    done
  done
  for v in 2 4; do slice "v$v" 8192 150 MOESRV_EXL3_GEMV1_VARIANT=$v; done
fi
if [[ ${ROTATE_FUSED:-0} == 1 ]]; then  # docs/perf-cuda.md, "Ninth round"
  MOESRV_EXL3_ROTATE_FUSED=1 MOESRV_EXL3_CACHE=.gpu/testdata/exl3 timeout 120 .gpu/test_cuda_exl3_engine \
    >"$OUT/exl3_fused.log" 2>&1
  echo "EXL3 suite, rotation fused:"; summary "$OUT/exl3_fused.log"
  MOESRV_EXL3_ROTATE_FUSED=1 timeout 200 .gpu/exl3_cuda_bench --quick >"$OUT/exl3_bench_fused.log" 2>&1
  echo "exl3_cuda_bench, rotation fused rc=$?:"; grep -E "FAIL|checks" "$OUT/exl3_bench_fused.log" | head -20
  for f in 0 1 0; do
    MOESRV_EXL3_ROTATE_FUSED=$f timeout 120 .gpu/cuda_kernel_bench --bits 3 --only "EXL3,decode layer" \
      >"$OUT/kb_fused$f.log" 2>/dev/null
    echo "kernel bench K=3 fused=$f rc=$?:"; grep -E "^(KDA EXL3|MLA EXL3|MoE EXL3 experts 1|head EXL3|decode layer)" \
      "$OUT/kb_fused$f.log"
  done
  for f in 0 1; do slice "fused$f" 8192,131072 150 MOESRV_EXL3_ROTATE_FUSED=$f; done
fi
if [[ ${SPLIT_SWEEP:-0} == 1 ]]; then
  timeout 120 .gpu/cuda_kernel_bench --bits 3 --quick \
    --split-sweep default,1x32,2x8,2x12,2x16,2x20,2x24,2x32,4x4,4x8,4x16 \
    --only "KDA EXL3 q|k|v grouped,KDA EXL3 o,MoE EXL3 experts gate|up,MoE EXL3 experts down,MLA EXL3 q_b,MLA EXL3 o" \
    >"$OUT/split_sweep.log" 2>&1
  echo "split sweep rc=$?:"; grep -E "split" "$OUT/split_sweep.log" | grep -v "^  "
fi
if [[ ${MTP:-0} == 1 ]]; then slice mtp 8192 200; fi  # docs/perf-cuda.md, "Eleventh round"
if [[ ${STREAMS:-0} == 1 ]]; then  # decode of 1, 2, 4 streams: one pass each step, then one forward per stream
  for f in MOESRV_CUDA_BATCH=1 MOESRV_CUDA_BATCH=0; do
    slice "$f" 8192 200 "$f" MOESRV_BENCH_STREAMS=1,2,4
    grep -E "perf \] [0-9]+ streams" "$OUT/slice_$f.log"
  done
fi
if [[ ${ROWS:-0} == 1 ]]; then  # docs/perf-cuda.md, "Tenth round"
  MOESRV_EXL3_MERGE_ROWS=1 MOESRV_EXL3_CACHE=.gpu/testdata/exl3 timeout 120 .gpu/test_cuda_exl3_engine \
    >"$OUT/exl3_merge.log" 2>&1
  echo "EXL3 suite, merged expert entries:"; summary "$OUT/exl3_merge.log"
  timeout 120 .gpu/cuda_kernel_bench --bits 3 --only rows >"$OUT/kb_rows.log" 2>/dev/null
  echo "kernel bench rows rc=$?:"; grep -E "^rows" "$OUT/kb_rows.log"
  for f in MOESRV_EXL3_GEMV_ROWS=0 MOESRV_EXL3_GEMV_ROWS=1 MOESRV_EXL3_MERGE_ROWS=1; do slice "$f" 8192 150 "$f"; done
fi
if [[ ${ZERO_COPY:-0} == 1 ]]; then  # docs/perf-cuda.md, "Thirteenth round"
  timeout 120 .gpu/cuda_kernel_bench --bits 3 --only "MoE EXL3 experts" >"$OUT/kb_zero_copy.log" 2>/dev/null
  echo "kernel bench, experts in VRAM and in host memory rc=$?:"; grep -E "^MoE EXL3 experts" "$OUT/kb_zero_copy.log"
  for z in 0 1; do
    slice "zero_copy$z" "${ZC_CONTEXTS:-8192}" 240 MOESRV_BENCH_BUDGETS="${ZC_BUDGETS:-22}" MOESRV_ZERO_COPY=$z \
      MOESRV_BENCH_JSON="$OUT/zero_copy$z.json"
  done
fi
for g in ${PGROUPS:-}; do  # docs/perf-cuda.md, "Thirteenth round"
  slice "group_$g" "${PGROUP_CONTEXTS:-131072}" "${PGROUP_TIMEOUT:-240}" MOESRV_BENCH_BUDGETS="${PGROUP_BUDGETS:-22}" \
    MOESRV_BENCH_PREFILL_CHUNK="${g%x*}" MOESRV_PREFILL_GROUP="${g#*x}" MOESRV_BENCH_JSON="$OUT/group_$g.json"
  grep -E "perf \] (plan|glm5_next 8 layers|prefill device)" "$OUT/slice_group_$g.log" | head -8
done
for b in ${PF_BUDGETS:-}; do  # docs/perf-cuda.md, "Fifteenth round": hybrid decode, prefetch x grouped launches
  for r in ${PF_RUNS:-0:0 0:1 3:1}; do
    slice "pf_${b}_${r/:/_}" "${PF_CONTEXTS:-8192}" "${PF_TIMEOUT:-200}" MOESRV_BENCH_BUDGETS="$b" \
      MOESRV_PREFETCH_EXPERTS="${r%:*}" MOESRV_HYBRID_GROUPED="${r#*:}" MOESRV_BENCH_JSON="$OUT/pf_${b}_${r/:/_}.json"
    grep -E "perf \] prefetch" "$OUT/slice_pf_${b}_${r/:/_}.log" | head -2
  done
done
for r in ${HL_RUNS:-}; do  # docs/perf-cuda.md, "Sixteenth round": hybrid prefill, stream window : hybrid lanes
  slice "hl_${r/:/_}" "${HL_CONTEXTS:-131072}" "${HL_TIMEOUT:-240}" MOESRV_BENCH_BUDGETS="${HL_BUDGETS:-22}" \
    MOESRV_STREAM_WINDOW="${r%:*}" MOESRV_HYBRID_LANES="${r#*:}" MOESRV_BENCH_JSON="$OUT/hl_${r/:/_}.json"
  grep -E "perf \] (plan|glm5_next 8 layers|prefill device)" "$OUT/slice_hl_${r/:/_}.log" | head -8
done
for b in ${LEND_BUDGETS:-}; do  # docs/perf-cuda.md, "Seventeenth round": decode with the lent pass arena, on / off
  for f in ${LEND_RUNS:-1 0}; do
    slice "lend_${b}_$f" "${LEND_CONTEXTS:-8192}" "${LEND_TIMEOUT:-200}" MOESRV_BENCH_BUDGETS="$b" MOESRV_LEND_ARENA=$f \
      MOESRV_BENCH_JSON="$OUT/lend_${b}_$f.json"
    grep -E "perf \] (plan|.*lent slots|prefetch)" "$OUT/slice_lend_${b}_$f.log" | head -4
  done
done
for b in ${VW_BUDGETS:-}; do  # docs/perf-cuda.md, "Seventeenth round": decode with the LRU's victim window, n vs 1
  for w in ${VW_RUNS:-16 1}; do
    slice "vw_${b}_$w" "${VW_CONTEXTS:-8192}" "${VW_TIMEOUT:-200}" MOESRV_BENCH_BUDGETS="$b" MOESRV_CACHE_VICTIM_WINDOW=$w \
      MOESRV_BENCH_JSON="$OUT/vw_${b}_$w.json"
  done
done
for f in ${WAVE_RUNS:-}; do  # all-VRAM prefill: MOESRV_EXL3_WAVES=f (1: grouped waves, 0: experts one by one on lanes)
  slice "wave_$f" "${WAVE_CONTEXTS:-8192,131072}" "${WAVE_TIMEOUT:-200}" MOESRV_EXL3_WAVES=$f \
    MOESRV_BENCH_JSON="$OUT/wave_$f.json"
  grep -E "perf \] prefill device" "$OUT/slice_wave_$f.log" | head -2
done
if [[ ${GEMM:-0} == 1 ]]; then  # docs/perf-cuda.md, nineteenth round
  timeout 200 .gpu/exl3_cuda_bench --quick >"$OUT/exl3_bench_gemm.log" 2>&1
  echo "exl3_cuda_bench rc=$?:"; grep -E "FAIL|checks|grouped GEMM" "$OUT/exl3_bench_gemm.log" | head -20
  MOESRV_EXL3_GROUPED_GEMM=1 MOESRV_EXL3_CACHE=.gpu/testdata/exl3 timeout 150 .gpu/test_cuda_exl3_engine \
    >"$OUT/exl3_gemm.log" 2>&1
  echo "EXL3 suite, grouped GEMM:"; summary "$OUT/exl3_gemm.log"
  for bits in 3 4; do
    for rows in 64 128; do
      MOESRV_EXL3_GEMM_ROWS=$rows timeout 120 .gpu/cuda_kernel_bench --bits $bits --only prefill \
        >"$OUT/kb_gemm_${bits}_$rows.log" 2>/dev/null
      echo "kernel bench K=$bits tiles of $rows rc=$?:"; grep -E "^prefill EXL3" "$OUT/kb_gemm_${bits}_$rows.log"
    done
  done
  MOESRV_EXL3_GROUPED_GEMM=1 MOESRV_EXL3_GEMM_FORM=3 MOESRV_EXL3_CACHE=.gpu/testdata/exl3 timeout 150 \
    .gpu/test_cuda_exl3_engine >"$OUT/exl3_gemm3.log" 2>&1
  echo "EXL3 suite, grouped GEMM form 3:"; summary "$OUT/exl3_gemm3.log"
  slices gemm_ "${GEMM_CONTEXTS:-8192}" "${GEMM_TIMEOUT:-150}" "mix MOESRV_EXL3_GROUPED_GEMM=512" \
    "g1 MOESRV_EXL3_GROUPED_GEMM=1" "g3 MOESRV_EXL3_GROUPED_GEMM=1 MOESRV_EXL3_GEMM_FORM=3" \
    "cublas MOESRV_EXL3_GROUPED_GEMM=0"
fi
if [[ ${WGMMA:-0} == 1 ]]; then  # docs/perf-cuda.md, twenty-fourth round
  timeout 200 .gpu/exl3_cuda_bench --quick >"$OUT/exl3_bench_wg.log" 2>&1
  echo "exl3_cuda_bench rc=$?:"; grep -E "FAIL|checks|form 4" "$OUT/exl3_bench_wg.log" | head -24
  for rows in 128 256; do
    MOESRV_EXL3_GROUPED_GEMM=1 MOESRV_EXL3_GEMM_FORM=4 MOESRV_EXL3_GEMM_ROWS=$rows MOESRV_EXL3_CACHE=.gpu/testdata/exl3 \
      timeout 150 .gpu/test_cuda_exl3_engine >"$OUT/exl3_wg$rows.log" 2>&1
    echo "EXL3 suite, every prefill expert through form 4, $rows-row tiles:"; summary "$OUT/exl3_wg$rows.log"
  done
  for bits in ${WGMMA_BITS:-3 4}; do
    timeout 120 .gpu/cuda_kernel_bench --bits $bits --only prefill >"$OUT/kb_wg_$bits.log" 2>/dev/null
    echo "kernel bench K=$bits rc=$?:"; grep -E "^prefill EXL3" "$OUT/kb_wg_$bits.log"
  done
  slices wg_ "${WGMMA_CONTEXTS:-8192}" "${WGMMA_TIMEOUT:-150}" "f1 MOESRV_EXL3_GEMM_FORM=1" \
    "f4 MOESRV_EXL3_GEMM_FORM=4" "f4all MOESRV_EXL3_GEMM_FORM=4 MOESRV_EXL3_GROUPED_GEMM=1" \
    "f4all256 MOESRV_EXL3_GEMM_FORM=4 MOESRV_EXL3_GROUPED_GEMM=1 MOESRV_EXL3_GEMM_ROWS=256" \
    "f4r256 MOESRV_EXL3_GEMM_FORM=4 MOESRV_EXL3_GEMM_ROWS=256"
fi
if [[ ${CPU_EXPERTS:-0} == 1 ]]; then  # docs/perf.md, "CPU EXL3 experts"
  lscpu | grep -E "Model name|^CPU\(s\)|Thread|MHz|L2|L3" >"$OUT/cpu_experts.log"
  grep -o -E "avx512[a-z_0-9]*|amx[a-z_0-9]*|avx_vnni" /proc/cpuinfo | sort -u | tr '\n' ' ' >>"$OUT/cpu_experts.log"
  timeout 120 .gpu/exl3_strip_bench >>"$OUT/cpu_experts.log" 2>&1
  timeout 300 .gpu/exl3_expert_bench --pool-mb 4096 --threads 1,8,16 >>"$OUT/cpu_experts.log" 2>&1
  echo "cpu experts rc=$?:"; cat "$OUT/cpu_experts.log"
  echo "== the same at 16 threads without the pool's polling (MOESRV_POOL_SPIN_US=0)" >>"$OUT/cpu_experts.log"
  MOESRV_POOL_SPIN_US=0 timeout 150 .gpu/exl3_expert_bench --pool-mb 4096 --threads 16 >>"$OUT/cpu_experts.log" 2>&1
  tail -7 "$OUT/cpu_experts.log"
fi
if [[ ${PREFILL_AB:-0} == 1 ]]; then  # docs/perf-cuda.md, "Twenty-sixth round"
  slices pab_ "${PAB_CONTEXTS:-8192}" 150 "new" "q0 MOESRV_MLA_Q_SPLIT=0" "router MOESRV_ROUTER_TF32=1" \
    "wide MOESRV_MLA_WGMMA=0" "tf32 MOESRV_MLA_ABSORB=1" "g1024 MOESRV_EXL3_GROUPED_GEMM=1024"
fi
if [[ ${MLA_V2:-0} == 1 ]]; then  # docs/perf-cuda.md, "Twenty-sixth round"
  MOESRV_MLA_WGMMA_V2=1 timeout 60 .gpu/test_cuda_glm5_next_kernels --gtest_filter='*TensorCorePrefill*' \
    >"$OUT/mla_v2.log" 2>&1
  echo "MLA kernel test, V2:"; grep -E "D 512 H 64|FAILED|PASSED" "$OUT/mla_v2.log"
  for v in 0 1; do
    for q in 1 0; do
      echo "MLA rows, V2 $v, q split $q:"
      MOESRV_MLA_WGMMA_V2=$v MOESRV_MLA_Q_SPLIT=$q timeout 60 .gpu/cuda_kernel_bench --bits 3 --quick \
        --only "prefill MLA" 2>/dev/null | grep "^prefill MLA"
    done
  done
fi
if [[ ${PREFILL_NCU:-0} == 1 ]]; then  # docs/perf-cuda.md, "Twenty-third round"
  NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu)
  env MOESRV_CUDA_BENCH=1 MOESRV_BENCH_CONTEXTS="${NCU_CONTEXT:-8192}" MOESRV_BENCH_ROUTING=skewed MOESRV_BENCH_BUDGETS=all \
    MOESRV_BENCH_STREAMS=0 MOESRV_BENCH_PREFILL_RUNS=1 timeout "${NCU_LIMIT:-300}" "$NCU" --csv \
    --metrics gpu__time_duration.sum --launch-count "${NCU_LAUNCHES:-3500}" .gpu/test_cuda_exl3_synthetic \
    --gtest_filter='*Glm5Next*' >"$OUT/ncu_raw.csv" 2>"$OUT/ncu_err.log"
  echo "prefill ncu rc=$? lines $(wc -l <"$OUT/ncu_raw.csv")"
  python3 scripts/ncu_by_kernel.py "$OUT/ncu_raw.csv" | tee "$OUT/ncu_by_kernel.txt"
fi
