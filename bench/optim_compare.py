#!/usr/bin/python3
"""Loom's 14 optimizers compared on the default model, each at a tuned learning rate.

    /usr/bin/python3 bench/optim_compare.py [--steps 150] [--optimizers adamw,lion,...]
                                            [--lrs-per-opt 3] [--out runs/optim_compare] [--quick]

Trains the default small GPT-2 (configs/default.toml: 6 layers, d=256, fortunes, 16 x 128
tokens a step) once per (optimizer, learning rate) of the grid LR_GRID below, every run with the
same token budget (--steps), cosine schedule with steps/20 warmup steps and min_lr = lr/10, the
optimizer's published default weight decay and betas (optim.weight_decay = beta1 = beta2 = -1;
Adafactor with relative_step = scale_parameter = false so the lr is used), and one evaluation at the
end. The learning rate with the lowest final validation loss is each optimizer's tuned one; a run
that diverges (loom exits non-zero) counts as validation loss inf. Measures, per optimizer:
final validation loss, training loss (mean of the last 10 steps), optimizer state in bytes per
parameter, median step time and tokens/s, and the training loss curve.

Runs are sequential and resumable: run folders are <out>/<optimizer>_lr<lr>, and a run whose
metrics.jsonl already holds the final validation loss (or that diverged before) is not rerun.
Checkpoints are deleted after each run to save disk. Writes <out>/results.json (every run),
<out>/table.md (printed at the end) and <out>/loss_curves.svg. The defaults (14 optimizers x
3 learning rates x 150 steps) take about 35 minutes on 2 cores; --quick (10 steps, one learning
rate each) is a smoke test.
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

# Learning rates tried per optimizer: values around a sensible center for this model (the
# middle one is run first; with --lrs-per-opt 1 only it runs). A fourth value was added where
# the best of the first three sat at the edge of the grid, a fifth where it still did (the
# published table ran --lrs-per-opt 5). Muon uses Moonshot's
# RMS-matched update scale, so one Adam-like lr serves its matrix and its AdamW parts.
LR_GRID = {
    "sgd": [0.1, 0.3, 1.0],
    "momentum": [0.03, 0.1, 0.3],
    "nesterov": [0.03, 0.1, 0.3],
    "adagrad": [0.001, 0.003, 0.01, 0.03, 0.1],
    "rmsprop": [1e-4, 3e-4, 1e-3, 3e-3],
    "adam": [5e-4, 1e-3, 2e-3, 4e-3],
    "adamw": [5e-4, 1e-3, 2e-3, 4e-3],
    "adafactor": [5e-4, 1e-3, 2e-3, 4e-3],
    "sm3": [0.001, 0.003, 0.01, 0.03, 0.1],
    "lion": [1.5e-4, 3e-4, 6e-4, 1.2e-3],
    "adam-mini": [5e-4, 1e-3, 2e-3, 4e-3],
    "came": [2.5e-4, 5e-4, 1e-3, 2e-3, 4e-3],
    "ldadam": [1e-3, 2e-3, 4e-3, 8e-3],
    "muon": [1e-3, 2e-3, 4e-3, 8e-3, 1.6e-2],
}
COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
          "#7f7f7f", "#bcbd22", "#17becf", "#000000", "#aec7e8", "#98df8a", "#ff9896"]


def lr_order(grid: list[float], n: int) -> list[float]:
    """The middle value first, then the others (low, high), n of them."""
    mid = len(grid) // 2
    return ([grid[mid]] + grid[:mid] + grid[mid + 1:])[:n]


def final_val(evals: list[dict], steps: int) -> float | None:
    vals = [finite(e["val_loss"]) for e in evals if e["step"] == steps]
    return vals[-1] if vals else None


def train(loom: str, out: str, opt: str, lr: float, steps: int) -> dict:
    name = f"{opt}_lr{lr:g}"
    run = os.path.join(out, name)
    metrics, failed = os.path.join(run, "metrics.jsonl"), os.path.join(run, "diverged.json")
    _, recs, evals = read_metrics(metrics)
    val, error, wall, cached = final_val(evals, steps), None, None, True
    if val is None and os.path.exists(failed):
        with open(failed) as f:
            prior = json.load(f)
        if prior["steps"] == steps:
            error, wall = prior["error"], prior["seconds"]
    if val is None and error is None:  # (re)run from scratch: loom appends to metrics.jsonl
        cached = False
        for path in (metrics, failed):
            if os.path.exists(path):
                os.remove(path)
        sets = {"optim.name": opt, "optim.lr": f"{lr:g}", "optim.min_lr": f"{lr / 10:g}",
                "optim.weight_decay": -1, "optim.beta1": -1, "optim.beta2": -1, "train.steps": steps, "train.eval_every": steps,
                "train.checkpoint_every": 0, "optim.warmup_steps": steps // 20,
                "run.dir": out, "run.name": name}
        if opt == "adafactor":
            sets["optim.relative_step"] = "false"  # the schedule's lr, as for the others
            sets["optim.scale_parameter"] = "false"
        cmd = [loom, "train", "--set", ",".join(f"{k}={v}" for k, v in sets.items())]
        t0 = time.time()
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        wall = time.time() - t0
        _, recs, evals = read_metrics(metrics)
        val = final_val(evals, steps)
        if p.returncode != 0 or val is None:
            lines = (p.stderr.strip() or p.stdout.strip() or f"exit status {p.returncode}").splitlines()
            error, val = lines[-1], None
            os.makedirs(run, exist_ok=True)
            with open(failed, "w") as f:
                json.dump({"steps": steps, "error": error, "seconds": wall}, f)
        shutil.rmtree(os.path.join(run, "checkpoints"), ignore_errors=True)
    if wall is None:
        wall = sum(r["seconds"] for r in recs)
    header, recs, _ = read_metrics(metrics)
    timed = recs[5:] or recs
    last = [x for x in (finite(r.get("loss")) for r in recs[-10:]) if x is not None]
    return {"optimizer": opt, "lr": lr, "run": name, "val_loss": val, "error": error,
            "seconds": round(wall, 2), "cached": cached,
            "train_loss": statistics.fmean(last) if last else None,
            "state_bytes_per_param": header.get("state_bytes_per_param"),
            "step_ms": statistics.median(r["seconds"] for r in timed) * 1e3 if timed else None,
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in timed) if timed else None,
            "losses": [finite(r.get("loss")) for r in recs]}


def smooth(xs: list[float | None], w: int = 9) -> list[float]:
    """Centered moving average (the window shrinks at the ends; missing values are skipped)."""
    h, out = w // 2, []
    for i in range(len(xs)):
        win = [x for x in xs[max(0, i - h):i + h + 1] if x is not None]
        out.append(statistics.fmean(win) if win else math.nan)
    return out


def ticks(lo: float, hi: float, n: int = 6) -> list[float]:
    raw = (hi - lo) / n
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    return [k * step for k in range(math.ceil(lo / step - 1e-9), math.floor(hi / step + 1e-9) + 1)]


def svg_plot(best: list[dict], path: str) -> None:
    curves = [(r["optimizer"], smooth(r["losses"])) for r in best if any(x is not None for x in r["losses"])]
    if not curves:
        return
    nmax = max(len(c) for _, c in curves)
    ok = lambda c: [y for y in c if y == y]  # y == y: not NaN
    ylo = min(min(ok(c)) for _, c in curves) - 0.1
    # top: the smoothed loss at step 10, which hides the steep start (all of it on short runs)
    yhi = max(((ok(c[9:10]) if len(c) >= 50 else []) or [max(ok(c))])[0] for _, c in curves)
    yhi = yhi if yhi > ylo else ylo + 1
    W, H, L, R, T, B = 900, 520, 70, 170, 30, 55
    pw, ph = W - L - R, H - T - B
    sx = lambda s: L + (s - 1) / max(1, nmax - 1) * pw
    sy = lambda y: T + (yhi - y) / (yhi - ylo) * ph
    o = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" '
         f'font-size="12"><rect width="{W}" height="{H}" fill="white"/>',
         f'<clipPath id="plot"><rect x="{L}" y="{T}" width="{pw}" height="{ph}"/></clipPath>',
         f'<text x="{L + pw / 2}" y="18" text-anchor="middle" font-size="14">Training loss (moving '
         f'average of 9 steps), best learning rate per optimizer</text>']
    for x in ticks(1, nmax):
        o.append(f'<line x1="{sx(x):.1f}" y1="{T}" x2="{sx(x):.1f}" y2="{T + ph}" stroke="#eee"/>'
                 f'<text x="{sx(x):.1f}" y="{T + ph + 16}" text-anchor="middle">{x:g}</text>')
    for y in ticks(ylo, yhi, 8):
        o.append(f'<line x1="{L}" y1="{sy(y):.1f}" x2="{L + pw}" y2="{sy(y):.1f}" stroke="#eee"/>'
                 f'<text x="{L - 6}" y="{sy(y) + 4:.1f}" text-anchor="end">{y:g}</text>')
    o.append(f'<rect x="{L}" y="{T}" width="{pw}" height="{ph}" fill="none" stroke="black"/>'
             f'<text x="{L + pw / 2}" y="{H - 12}" text-anchor="middle">step</text>'
             f'<text transform="translate(18 {T + ph / 2}) rotate(-90)" text-anchor="middle">'
             f'training loss</text>')
    for i, (opt, c) in enumerate(curves):  # legend in table order; one fixed colour per optimizer
        color = COLORS[list(LR_GRID).index(opt)]
        pts = " ".join(f"{sx(s + 1):.1f},{sy(y):.1f}" for s, y in enumerate(c) if y == y)
        o.append(f'<polyline points="{pts}" fill="none" stroke="{color}" stroke-width="1.5" '
                 f'clip-path="url(#plot)"/>')
        ly = T + 10 + 18 * i
        o.append(f'<line x1="{L + pw + 12}" y1="{ly}" x2="{L + pw + 36}" y2="{ly}" stroke="{color}" '
                 f'stroke-width="3"/><text x="{L + pw + 42}" y="{ly + 4}">{opt}</text>')
    o.append("</svg>\n")
    with open(path, "w") as f:
        f.write("\n".join(o))


def fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def table(best: list[dict], steps: int) -> str:
    rows = ["| optimizer | tuned lr | final val loss | train loss (last 10) | state bytes/param "
            "| median step ms | tokens/s |", "|---|---|---|---|---|---|---|"]
    for r in best:
        grid = LR_GRID[r["optimizer"]]
        edge = "*" if r["val_loss"] is not None and r["tried"] > 1 and r["lr"] in (grid[0], grid[-1]) else ""
        val = fmt(r["val_loss"], ".4f") if r["val_loss"] is not None else "diverged"
        rows.append(f"| {r['optimizer']} | {r['lr']:g}{edge} | {val} | {fmt(r['train_loss'], '.4f')} "
                    f"| {fmt(r['state_bytes_per_param'], '.2f')} | {fmt(r['step_ms'], '.1f')} "
                    f"| {fmt(r['tokens_per_s'], '.0f')} |")
    note = (f"\n{steps} steps of the default model per run; lr tuned over LR_GRID by final validation "
            "loss (* = best lr at the edge of the grid tried: the optimum may lie beyond it).\n")
    return "\n".join(rows) + "\n" + note


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--out", default=os.path.join(ROOT, "runs", "optim_compare"))
    ap.add_argument("--loom", default=os.path.join(ROOT, "build", "bin", "loom"))
    ap.add_argument("--optimizers", default=",".join(LR_GRID))
    ap.add_argument("--lrs-per-opt", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="10 steps, one lr per optimizer (smoke test)")
    args = ap.parse_args()
    if args.quick:
        args.steps, args.lrs_per_opt = 10, 1
    opts = [o.strip() for o in args.optimizers.split(",") if o.strip()]
    unknown = [o for o in opts if o not in LR_GRID]
    if unknown:
        raise SystemExit(f"optim_compare: unknown optimizer(s) {', '.join(unknown)}; known: {', '.join(LR_GRID)}")
    loom, out = os.path.abspath(args.loom), os.path.abspath(args.out)
    if not os.access(loom, os.X_OK):
        raise SystemExit(f"optim_compare: {loom} is not an executable; build it or pass --loom")
    os.makedirs(out, exist_ok=True)

    results, best = [], []
    for opt in opts:
        runs = []
        for lr in lr_order(LR_GRID[opt], args.lrs_per_opt):
            r = train(loom, out, opt, lr, args.steps)
            runs.append(r)
            val = f"{r['val_loss']:.4f}" if r["val_loss"] is not None else f"inf ({r['error']})"
            print(f"{opt:10s} lr {lr:<8g} val loss {val}  {r['seconds']:.1f} s"
                  + ("  (cached)" if r["cached"] else ""), flush=True)
        results += runs
        b = min(runs, key=lambda r: r["val_loss"] if r["val_loss"] is not None else math.inf)
        best.append(dict(b, tried=len(runs)))
    best.sort(key=lambda r: (r["val_loss"] is None, r["val_loss"] or 0.0))

    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump({"steps": args.steps, "lr_grid": LR_GRID, "runs": results,
                   "best": {r["optimizer"]: r["run"] for r in best}}, f, indent=1)
    text = table(best, args.steps)
    with open(os.path.join(out, "table.md"), "w") as f:
        f.write(text)
    svg_plot([r for r in best if r["val_loss"] is not None], os.path.join(out, "loss_curves.svg"))
    print("\n" + text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
