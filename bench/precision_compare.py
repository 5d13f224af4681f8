#!/usr/bin/python3
"""Loom's precision recipes compared on the default model with the same token budget.

    /usr/bin/python3 bench/precision_compare.py [--steps 600] [--rows fp32,bf16,...]
                                                [--out runs/precision_compare] [--quick]

Trains the default small GPT-2 (configs/default.toml: 6 layers, d=256, fortunes, 16 x 128 tokens a
step, AdamW, cosine schedule) once per precision recipe of ROWS, every run the same --steps (the
schedule and its warmup scale with it: warmup = steps / 20), seed and data order. Measures, per
recipe: final validation loss (16 batches) and its relative gap to fp32, the mean training loss of
the last 10 steps, skipped steps (fp16 loss scaling), median step time and its ratio to fp32 (the
same script on the same machine; the emulated formats pay for their quantizers, see
docs/precision.md), and memory by category at the end. Runs are sequential and resumable: a run
whose metrics.jsonl already holds the final validation loss is not rerun. Writes <out>/results.json
and <out>/table.md (printed at the end). The defaults take about 30 minutes on 2 cores; --quick
(10 steps) is a smoke test.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from runlog import finite, read_metrics  # noqa: E402

# name -> precision.* overrides (the rest is configs/default.toml).
ROWS = {
    "fp32": {},
    "bf16": {"precision.compute": "bf16"},
    "fp16+scaling": {"precision.compute": "fp16", "precision.loss_scaling": "true"},
    "fp8-delayed": {"precision.compute": "fp8-delayed"},
    "fp8-current": {"precision.compute": "fp8-current"},
    "fp8-block": {"precision.compute": "fp8-block"},
    "mxfp4-qat": {"precision.compute": "bf16", "precision.qat": "mxfp4"},
    "nvfp4-qat": {"precision.compute": "bf16", "precision.qat": "nvfp4"},
    "bf16-no-master": {"precision.compute": "bf16", "precision.master": "bf16"},
    "bf16-no-master-sr": {"precision.compute": "bf16", "precision.master": "bf16",
                          "precision.stochastic_rounding": "true"},
}
MEM = ["parameters", "gradients", "optimizer_state", "activations", "workspace"]


def train(loom: str, out: str, name: str, sets: dict, steps: int) -> dict:
    run = os.path.join(out, name)
    metrics = os.path.join(run, "metrics.jsonl")
    _, recs, evals = read_metrics(metrics)
    done = [e for e in evals if e["step"] == steps]
    error = None
    if not done:
        if os.path.exists(metrics):
            os.remove(metrics)
        base = {"train.steps": steps, "train.eval_every": steps, "train.checkpoint_every": 0,
                "optim.warmup_steps": max(1, steps // 20), "run.dir": out, "run.name": name}
        cmd = [loom, "train", "--set", ",".join(f"{k}={v}" for k, v in {**base, **sets}.items())]
        print("running", name, flush=True)
        t0 = time.time()
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        print(f"  {time.time() - t0:.0f} s", flush=True)
        if p.returncode != 0:
            error = (p.stderr.strip() or p.stdout.strip() or f"exit status {p.returncode}").splitlines()[-1]
            print("  failed:", error, flush=True)
        shutil.rmtree(os.path.join(run, "checkpoints"), ignore_errors=True)
        _, recs, evals = read_metrics(metrics)
        done = [e for e in evals if e["step"] == steps]
    header, recs, _ = read_metrics(metrics)
    timed = recs[5:] or recs
    last = [x for x in (finite(r.get("loss")) for r in recs[-10:]) if x is not None]
    mem = done[-1].get("memory", {}) if done else {}  # "current" at the end: the peak includes the GEMM-peak probe
    return {"name": name, "sets": sets, "error": error, "precision": header.get("precision"),
            "val_loss": finite(done[-1]["val_loss"]) if done else None,
            "train_loss": statistics.fmean(last) if last else None,
            "skipped": sum(1 for r in recs if r.get("skipped")),
            "step_ms": statistics.median(r["seconds"] for r in timed) * 1e3 if timed else None,
            "memory": {k: mem.get(k, {}).get("current") for k in MEM}}


def mib(b) -> str:
    return f"{b / 2**20:.1f}" if isinstance(b, (int, float)) else "-"


def table(results: list[dict], steps: int) -> str:
    base = next((r for r in results if r["name"] == "fp32"), None)
    lines = [f"Default model, {steps} steps x 2048 tokens each, same seed and data; memory: MiB by category at the end of the run.", "",
             "| recipe | val loss | gap to fp32 | train loss (last 10) | skipped | step ms | x fp32 time | "
             + " | ".join(MEM) + " |",
             "|---|---|---|---|---|---|---|" + "---|" * len(MEM)]
    for r in results:
        v, b = r["val_loss"], base and base["val_loss"]
        gap = f"{100 * (v - b) / b:+.2f}%" if v is not None and b else "-"
        ratio = f"{r['step_ms'] / base['step_ms']:.2f}" if r["step_ms"] and base and base["step_ms"] else "-"
        cells = [r["name"], f"{v:.4f}" if v is not None else f"failed ({r['error']})", gap,
                 f"{r['train_loss']:.4f}" if r["train_loss"] is not None else "-", str(r["skipped"]),
                 f"{r['step_ms']:.0f}" if r["step_ms"] else "-", ratio] + [mib(r["memory"][k]) for k in MEM]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--rows", default=",".join(ROWS))
    ap.add_argument("--out", default=os.path.join(ROOT, "runs", "precision_compare"))
    ap.add_argument("--loom", default=os.path.join(ROOT, "build", "bin", "loom"))
    ap.add_argument("--quick", action="store_true", help="10 steps: a smoke test")
    a = ap.parse_args()
    steps = 10 if a.quick else a.steps
    names = [n for n in a.rows.split(",") if n]
    unknown = [n for n in names if n not in ROWS]
    if unknown:
        print(f"unknown row(s) {unknown}; expected some of {list(ROWS)}", file=sys.stderr)
        return 2
    os.makedirs(a.out, exist_ok=True)
    results = [train(a.loom, a.out, n, ROWS[n], steps) for n in names]
    with open(os.path.join(a.out, "results.json"), "w") as f:
        json.dump({"steps": steps, "results": results}, f, indent=1)
    t = table(results, steps)
    with open(os.path.join(a.out, "table.md"), "w") as f:
        f.write(t)
    print(t)
    return 0 if all(r["val_loss"] is not None for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
