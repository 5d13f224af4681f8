#!/usr/bin/python3
"""Loom vs PyTorch training throughput on this machine, measured in the same run.

    /usr/bin/python3 bench/compare_train.py [--build build] [--steps 6] [--warmup 2] [--threads 2]
        [--rounds 2] [--skip-shipped] [--dtypes f32,bf16]

For each shape of the acceptance criterion -- GPT-2 124M (B=4, T=64) and a small GPT-2
(6 layers, d=384, B=8, T=256) -- and each compute dtype (f32; bf16), runs in alternating rounds:
  * Loom: build/bench/train_bench (AdamW, clipping) with --compute f32 / bf16, which reports MFU
    against the GEMM peak of that dtype (measured once per machine and cached:
    src/loom/train/throughput.h) and against the datasheet-style peak;
  * PyTorch at its best: bench/torch_train_bench.py with OPENBLAS_CORETYPE unset,
    OMP_WAIT_POLICY=PASSIVE and tcmalloc preloaded, fp32 and bf16 autocast (--cpu-bf16 1);
  * PyTorch as shipped (fp32, this machine's environment unchanged), unless --skip-shipped.
--dtypes f32 leaves bf16 out: on a CPU without AVX-512 BF16, PyTorch's bf16 autocast ran 3 steps of
GPT-2 124M for over 5 minutes, and Loom's bf16 GEMM widens to fp32 there (its run header says so).
Prints tokens/s (medians over the rounds), the ratios Loom / PyTorch at its best (for bf16 also
against PyTorch's faster recipe), and MFU. Runs are sequential, never concurrent.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"
SHAPES = [("gpt2-124m", 4, 64), ("gpt2-small", 8, 256)]


def run_json(cmd: list[str], env: dict[str, str]) -> dict:
    """Runs cmd and returns the last JSON line it printed."""
    out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
    lines = [line for line in out.splitlines() if line.startswith("{")]
    if not lines:
        raise SystemExit(f"{os.path.basename(sys.argv[0])}: no JSON result from {' '.join(cmd)}")
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
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--skip-shipped", action="store_true", help="skip the slow as-shipped PyTorch run")
    ap.add_argument("--dtypes", default="f32,bf16", help="compute dtypes to compare: f32, bf16 or both")
    args = ap.parse_args()
    dtypes = [d for d in args.dtypes.split(",") if d]
    if not dtypes or any(d not in ("f32", "bf16") for d in dtypes):
        raise SystemExit(f"compare_train: --dtypes {args.dtypes!r}: expected f32, bf16 or f32,bf16")

    loom_bin = os.path.join(args.build, "bench", "train_bench")
    if not os.access(loom_bin, os.X_OK):
        raise SystemExit(f"compare_train: {loom_bin} not found; build first (cmake --build {args.build})")
    loom_env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    rows = []
    for model, batch, seq in SHAPES:
        common = ["--model", model, "--batch", str(batch), "--seq", str(seq), "--steps", str(args.steps),
                  "--warmup", str(args.warmup)]
        torch_cmd = [sys.executable, os.path.join(HERE, "torch_train_bench.py")] + common + ["--threads", str(args.threads)]
        runs = {
            "loom f32": ([loom_bin] + common + ["--compute", "f32"], loom_env),
            "loom bf16": ([loom_bin] + common + ["--compute", "bf16"], loom_env),
            "pt f32": (torch_cmd, torch_env(True, args.threads)),
            "pt bf16": (torch_cmd + ["--cpu-bf16", "1"], torch_env(True, args.threads)),
        }
        runs = {name: v for name, v in runs.items() if name.split()[1] in dtypes}
        if not args.skip_shipped:
            runs["pt shipped"] = (torch_cmd, torch_env(False, args.threads))
        results: dict[str, list[dict]] = {name: [] for name in runs}
        for r in range(args.rounds):
            for name, (cmd, env) in runs.items():
                res = run_json(cmd, env)
                results[name].append(res)
                print(json.dumps({"model": model, "round": r, "run": name, "tokens_per_s": res["tokens_per_s"],
                                  **({"mfu": res["mfu"], "peak_dtype": res["peak_dtype"]} if "mfu" in res else {})}),
                      flush=True)
        med = {name: statistics.median(x["tokens_per_s"] for x in v) for name, v in results.items()}
        mfu = {name: statistics.median(x["mfu"] for x in v) for name, v in results.items() if name.startswith("loom")}
        mfu_ds = {name: statistics.median(x["mfu_datasheet"] for x in v) for name, v in results.items() if name.startswith("loom")}
        peaks = {name: (v[0]["peak_dtype"], v[0]["gemm_peak_gflops"], v[0]["datasheet_peak_gflops"])
                 for name, v in results.items() if name.startswith("loom")}
        rows.append((f"{model} B={batch} T={seq}", med, mfu, mfu_ds, peaks))

    print()
    print(f"{'shape':<24}{'dtype':<6}{'Loom tok/s':>11}{'PT tok/s':>10}{'Loom/PT':>9}{'PT shipped':>11}"
          f"{'MFU':>7}{'peak GF/s':>10}{'MFU (datasheet)':>16}")
    for shape, med, mfu, mfu_ds, peaks in rows:
        for dtype in dtypes:
            loom, pt = med[f"loom {dtype}"], med[f"pt {dtype}"]
            shipped = med.get("pt shipped", float("nan")) if dtype == "f32" else float("nan")
            dt, peak, ds = peaks[f"loom {dtype}"]
            print(f"{shape:<24}{dtype:<6}{loom:>11.1f}{pt:>10.1f}{loom / pt:>9.2f}{shipped:>11.1f}"
                  f"{100 * mfu[f'loom {dtype}']:>6.1f}%{peak:>10.0f}{100 * mfu_ds[f'loom {dtype}']:>9.1f}% of {ds:.0f}")
        if len(dtypes) < 2:
            continue
        best_pt = max(med["pt f32"], med["pt bf16"])
        print(f"{shape:<24}bf16 Loom / PyTorch's faster recipe ({'bf16' if med['pt bf16'] >= med['pt f32'] else 'f32'}): "
              f"{med['loom bf16'] / best_pt:.2f}")
    print(f"Medians of {args.rounds} alternating rounds, {args.threads} threads. MFU = (6N + 12LTd) FLOPs per token x "
          "tokens/s over the GEMM peak of the run's dtype (measured 2048^3, cached per machine); the datasheet-style "
          "peak is threads x measured clock x FLOPs per cycle.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
