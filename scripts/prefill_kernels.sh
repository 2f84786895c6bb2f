#!/usr/bin/env bash
# Where an all-VRAM glm5_next prefill's device time goes, kernel by kernel (issue 20): ncu's duration of each of the
# first LAUNCHES launches (default 3500: the engine's setup and the 4-layer slice's 8K prefill) of the real-width
# slice, summed by kernel name, plus the time per window of 500 launches (to see where the prefill ends). Runs on the
# GPU machine from a scripts/gpu_carry.sh build (carry .gpurun, as scripts/gpu_suite.sh); ~3-5 min.
#   scripts/prefill_kernels.sh                     -> $OUT/ncu_by_kernel.txt (raw: $OUT/ncu_raw.csv)
#   CONTEXT=32768 LAUNCHES=6000 NCU_LIMIT=500 scripts/prefill_kernels.sh
set -uo pipefail
OUT=${OUT:-/tmp/gpu_out}
mkdir -p "$OUT"
[[ -d .gpu ]] || tar -xJf .gpurun/gpu.tar.xz
mkdir -p /work/shared && cp -r .gpu/testdata /work/shared/
export LD_LIBRARY_PATH=$PWD/.gpu/lib
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu)
env MOESRV_CUDA_BENCH=1 MOESRV_BENCH_CONTEXTS="${CONTEXT:-8192}" MOESRV_BENCH_ROUTING=skewed MOESRV_BENCH_BUDGETS=all \
  MOESRV_BENCH_STREAMS=0 MOESRV_BENCH_PREFILL_RUNS=1 timeout "${NCU_LIMIT:-300}" "$NCU" --csv \
  --metrics gpu__time_duration.sum --launch-count "${LAUNCHES:-3500}" .gpu/test_cuda_exl3_synthetic \
  --gtest_filter='*Glm5Next*' >"$OUT/ncu_raw.csv" 2>"$OUT/ncu_err.log"
echo "ncu rc=$? lines $(wc -l <"$OUT/ncu_raw.csv")"
python3 - "$OUT/ncu_raw.csv" <<'PY' | tee "$OUT/ncu_by_kernel.txt"
import collections, csv, sys
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
head = rows[0]
name_i, value_i, unit_i, id_i = (head.index(k) for k in ("Kernel Name", "Metric Value", "Metric Unit", "ID"))
total, count, order = collections.defaultdict(float), collections.Counter(), []
for r in rows[1:]:
    try:
        us = float(r[value_i].replace(",", "")) * {"nsecond": 1e-3, "usecond": 1.0, "msecond": 1e3}.get(r[unit_i], 1.0)
    except ValueError:
        continue
    name = r[name_i].split("(")[0][:90]
    total[name] += us
    count[name] += 1
    order.append(us)
all_us = sum(total.values()) or 1.0
print(f"launches {len(order)}, total {all_us / 1e3:.2f} ms")
for name, us in sorted(total.items(), key=lambda x: -x[1])[:45]:
    print(f"{us / 1e3:9.3f} ms {100 * us / all_us:5.1f}% {count[name]:6d}x  {name}")
for w in range(0, len(order), 500):
    print("launches", w, f"{sum(order[w:w + 500]) / 1e3:.2f} ms")
PY
tail -3 "$OUT/ncu_err.log"
