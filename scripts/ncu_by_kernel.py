#!/usr/bin/env python3
"""Sums `ncu --csv --metrics gpu__time_duration.sum` rows (argv[1]) by kernel name: the 45 largest, then the time per
window of 500 launches (to see where a phase ends), then per segment ending at each launch whose name contains
argv[2] (default hyper_leave: the sub-layers of an mHC model) its time and largest kernels. Used by
scripts/gpu_suite.sh's PREFILL_NCU mode."""
import collections, csv, sys
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]  # (ncu's own messages are shorter lines)
if not rows or "Kernel Name" not in rows[0]:
    sys.exit(f"{sys.argv[1]}: no ncu CSV rows (see the ncu log beside it)")
head = rows[0]
name_i, value_i, unit_i = (head.index(k) for k in ("Kernel Name", "Metric Value", "Metric Unit"))
total, count, order = collections.defaultdict(float), collections.Counter(), []
for r in rows[1:]:
    try:
        us = float(r[value_i].replace(",", "")) * {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3}.get(r[unit_i], 1.0)
    except ValueError:
        continue
    name = r[name_i].split("(")[0][:90]
    total[name] += us
    count[name] += 1
    order.append((us, name))
all_us = sum(total.values()) or 1.0
print(f"launches {len(order)}, total {all_us / 1e3:.2f} ms")
for name, us in sorted(total.items(), key=lambda x: -x[1])[:45]:
    print(f"{us / 1e3:9.3f} ms {100 * us / all_us:5.1f}% {count[name]:6d}x  {name}")
for w in range(0, len(order), 500):
    print("launches", w, f"{sum(us for us, _ in order[w:w + 500]) / 1e3:.2f} ms")
mark = sys.argv[2] if len(sys.argv) > 2 else "hyper_leave"
seg, n = collections.Counter(), 0
for us, name in order:
    seg[name.replace("void ", "").replace("moesrv::<unnamed>::", "")[:48]] += us
    if mark in name:
        top = " ".join(f"{k}:{v:.0f}" for k, v in seg.most_common(7))
        print(f"segment {n} {sum(seg.values()):9.0f} us  {top}")
        seg, n = collections.Counter(), n + 1
