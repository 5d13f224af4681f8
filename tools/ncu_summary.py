#!/usr/bin/env python3
"""Where a GPU program's time goes, from Nsight Compute's CSV (scripts/gpu_check's `profile` step).

    ncu --clock-control none --metrics gpu__time_duration.sum --csv --log-file run.csv PROGRAM ...
    python3 tools/ncu_summary.py run.csv [--top 25] [--per N]

Sums gpu__time_duration.sum per kernel (name and grid: the same kernel at another shape is
another line), largest first: total microseconds, share, launches, microseconds per launch.
--per N divides the totals by N (the steps or tokens the run covered). ncu serialises the
kernels, so the total is the GPU's busy time without overlap or launch gaps, not wall time.
"""

from __future__ import annotations

import argparse
import collections
import csv
import sys

UNITS = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3, "s": 1e6, "second": 1e6}


def kernel_times(path: str) -> tuple[dict[str, float], collections.Counter]:
    with open(path, newline="") as f:
        lines = [line for line in f if line.startswith('"')]  # ncu's own messages are not CSV rows
    total: dict[str, float] = collections.defaultdict(float)
    count: collections.Counter = collections.Counter()
    for row in csv.DictReader(lines):
        if row.get("Metric Name") != "gpu__time_duration.sum":
            continue
        unit = row["Metric Unit"]
        if unit not in UNITS:
            sys.exit(f"ncu_summary: {path}: unknown time unit '{unit}' in kernel {row['Kernel Name'][:60]}")
        key = f"{row['Kernel Name'][:100]} grid {row['Grid Size']}"
        total[key] += float(row["Metric Value"].replace(",", "")) * UNITS[unit]
        count[key] += 1
    if not total:
        sys.exit(f"ncu_summary: {path}: no gpu__time_duration.sum rows (was ncu run with --metrics gpu__time_duration.sum --csv?)")
    return total, count


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--per", type=float, default=1.0, help="divide the totals by this (steps, tokens)")
    args = ap.parse_args()
    total, count = kernel_times(args.csv)
    busy = sum(total.values())
    print(f"{args.csv}: {sum(count.values())} launches, GPU busy {busy / args.per / 1e3:.2f} ms"
          f"{f' per {args.per:g}' if args.per != 1 else ''} (ncu serialises kernels: no overlap, no launch gaps)")
    print(f"{'us':>10} {'share':>6} {'launches':>8} {'us/launch':>10}  kernel")
    for key, us in sorted(total.items(), key=lambda kv: -kv[1])[: args.top]:
        print(f"{us / args.per:10.0f} {100 * us / busy:5.1f}% {count[key] / args.per:8.0f} {us / count[key]:10.1f}  {key}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
