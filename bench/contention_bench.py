#!/usr/bin/python3
"""Training speed on a shared machine: Loom and tuned PyTorch, idle and beside a busy process.

    /usr/bin/python3 bench/contention_bench.py [--build build] [--rounds 3] [--steps 4] [--threads 2]
        [--shape gpt2-124m,4,64] [--shape gpt2-small,8,256] [--busy-core 0]

For each shape, each round runs, one after another (never two benchmarks at once):
  * Loom (build/bench/train_bench) as it starts by default (passive OpenMP waits: core/threads.h),
  * Loom with OMP_WAIT_POLICY=ACTIVE (libgomp's spinning waits, Loom's behaviour before),
  * PyTorch at its best (bench/torch_train_bench.py: passive waits, tcmalloc, no OpenBLAS core cap),
each once on the idle machine and once beside a busy process: a shell loop spinning on one core
(taskset -c BUSY_CORE), started before and killed after the run. It prints each run's tokens/s,
then per implementation the median idle and busy tokens/s and the slowdown busy / idle. The
acceptance criterion (issue 26): Loom's slowdown is no worse than PyTorch's under the same load.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

from compare_train import run_json, torch_env

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def tokens_per_s(cmd: list[str], env: dict[str, str], busy_core: int | None) -> float:
    busy = None
    if busy_core is not None:
        busy = subprocess.Popen(["taskset", "-c", str(busy_core), "sh", "-c", "while :; do :; done"])
    try:
        return float(run_json(cmd, env)["tokens_per_s"])
    finally:
        if busy is not None:
            busy.kill()
            busy.wait()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--build", default=os.path.join(ROOT, "build"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--busy-core", type=int, default=0)
    ap.add_argument("--shape", action="append", help="MODEL,BATCH,SEQ (default: gpt2-124m,4,64 and gpt2-small,8,256)")
    args = ap.parse_args()
    shapes = [s.split(",") for s in (args.shape or ["gpt2-124m,4,64", "gpt2-small,8,256"])]
    loom_bin = os.path.join(args.build, "bench", "train_bench")
    if not os.access(loom_bin, os.X_OK):
        raise SystemExit(f"contention_bench: {loom_bin} not found; build first (cmake --build {args.build})")

    base = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    for key in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):
        base.pop(key, None)
    tuned_torch = torch_env(True, args.threads)  # compare_train's PyTorch at its best
    tuned_torch.pop("GOMP_SPINCOUNT", None)
    summary = []
    for model, batch, seq in shapes:
        common = ["--model", model, "--batch", batch, "--seq", seq, "--steps", str(args.steps), "--warmup", str(args.warmup)]
        impls = {
            "loom (default: passive)": ([loom_bin, "--peak-tflops", "1"] + common, base),
            "loom OMP_WAIT_POLICY=ACTIVE": ([loom_bin, "--peak-tflops", "1"] + common, dict(base, OMP_WAIT_POLICY="ACTIVE")),
            "pytorch (tuned)": ([sys.executable, os.path.join(HERE, "torch_train_bench.py")] + common +
                                ["--threads", str(args.threads)], tuned_torch),
        }
        results = {name: {"idle": [], "busy": []} for name in impls}
        for r in range(args.rounds):
            for name, (cmd, env) in impls.items():
                for load in ("idle", "busy"):
                    tps = tokens_per_s(cmd, env, args.busy_core if load == "busy" else None)
                    results[name][load].append(tps)
                    print(json.dumps({"shape": f"{model} B={batch} T={seq}", "round": r, "impl": name, "load": load,
                                      "tokens_per_s": round(tps, 2)}), flush=True)
        for name, res in results.items():
            idle, busy = statistics.median(res["idle"]), statistics.median(res["busy"])
            summary.append((f"{model} B={batch} T={seq}", name, idle, busy, busy / idle))
    print()
    print(f"{'shape':<24}{'implementation':<30}{'idle tok/s':>11}{'busy tok/s':>11}{'busy/idle':>10}")
    for shape, name, idle, busy, ratio in summary:
        print(f"{shape:<24}{name:<30}{idle:>11.1f}{busy:>11.1f}{ratio:>10.2f}")
    print(f"busy: one shell loop spinning on core {args.busy_core}; medians of {args.rounds} alternating rounds; "
          f"{args.threads} threads each.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
