#!/usr/bin/python3
"""Loom vs PyTorch training throughput on this machine, measured in the same run.

    /usr/bin/python3 bench/compare_train.py [--build build] [--steps 6] [--warmup 2] [--threads 2]

For each shape of the acceptance criterion -- GPT-2 124M (B=4, T=64) and a small GPT-2
(6 layers, d=384, B=4, T=256) -- runs:
  * Loom: build/bench/train_bench (fp32, AdamW, clipping), which also measures the GEMM peak
    of its library in-process and reports MFU against it;
  * PyTorch as shipped: bench/torch_train_bench.py with Debian's torch and this machine's
    environment unchanged;
  * PyTorch at its best: the same with OPENBLAS_CORETYPE unset, OMP_WAIT_POLICY=PASSIVE and
    tcmalloc preloaded (Loom's rule: compare against PyTorch at its best, not as shipped).
and prints tokens/s, the ratios Loom / PyTorch, and MFU. Runs are sequential, never concurrent.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"
SHAPES = [("gpt2-124m", 4, 64), ("gpt2-small", 4, 256)]


def run_json(cmd: list[str], env: dict[str, str]) -> dict:
    """Runs cmd and returns the last JSON line it printed."""
    out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
    lines = [line for line in out.splitlines() if line.startswith("{")]
    if not lines:
        raise SystemExit(f"compare_train: no JSON result from {' '.join(cmd)}")
    return json.loads(lines[-1])


def torch_env(best: bool, threads: int) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    if best:
        env.pop("OPENBLAS_CORETYPE", None)
        env["OMP_WAIT_POLICY"] = "PASSIVE"
        env["LD_PRELOAD"] = TCMALLOC
    return env


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--build", default=os.path.join(ROOT, "build"))
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--skip-shipped", action="store_true", help="skip the slow as-shipped PyTorch run")
    args = ap.parse_args()

    loom_bin = os.path.join(args.build, "bench", "train_bench")
    if not os.access(loom_bin, os.X_OK):
        raise SystemExit(f"compare_train: {loom_bin} not found; build first (cmake --build {args.build})")
    rows = []
    for model, batch, seq in SHAPES:
        common = ["--model", model, "--batch", str(batch), "--seq", str(seq), "--steps", str(args.steps),
                  "--warmup", str(args.warmup)]
        loom = run_json([loom_bin] + common, dict(os.environ, OMP_NUM_THREADS=str(args.threads)))
        torch_cmd = [sys.executable, os.path.join(HERE, "torch_train_bench.py")] + common + ["--threads", str(args.threads)]
        best = run_json(torch_cmd, torch_env(True, args.threads))
        shipped = None if args.skip_shipped else run_json(torch_cmd, torch_env(False, args.threads))
        rows.append((model, batch, seq, loom, best, shipped))
        print(json.dumps({"model": model, "loom": loom, "pytorch_best": best, "pytorch_shipped": shipped}), flush=True)

    print()
    print(f"{'shape':<26}{'Loom tok/s':>11}{'PT best':>9}{'PT shipped':>11}{'x best':>8}{'x shipped':>10}{'MFU':>7}{'GEMM peak':>11}")
    for model, batch, seq, loom, best, shipped in rows:
        shipped_tps = shipped["tokens_per_s"] if shipped else float("nan")
        print(f"{model + f' B={batch} T={seq}':<26}{loom['tokens_per_s']:>11.1f}{best['tokens_per_s']:>9.1f}"
              f"{shipped_tps:>11.1f}{loom['tokens_per_s'] / best['tokens_per_s']:>8.2f}"
              f"{loom['tokens_per_s'] / shipped_tps:>10.2f}{100 * loom['mfu']:>6.1f}%{loom['gemm_peak_gflops']:>8.0f} GF/s")
    print("MFU = 6N + 12LCT FLOPs per token x tokens/s, over the fp32 GEMM peak measured in the same process.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
