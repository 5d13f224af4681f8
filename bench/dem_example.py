#!/usr/bin/python3
"""The DEM-style merging example of docs/compression.md (Ram et al. 2024, "DEM: Distribution Edited
Model": train one base on separate data, merge the results).

    /usr/bin/python3 bench/dem_example.py --base runs/default --out /tmp/dem [--steps 200]

Splits Debian's fortune files into two disjoint slices by file (A: the first half of the files in
name order, B: the rest; the last 10% of each slice held out), continues training the base on A,
on B, and on the union A+B for the same number of steps each (train.init_from, the base's
tokenizer), merges the A and B runs (average, task arithmetic with weights 1, TIES), and prints the
held-out perplexity of every model on A, on B and on both, as a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FORTUNES = "/usr/share/games/fortunes"


def loom(args, *cmd):
    p = subprocess.run([args.loom, *cmd], capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="2"))
    if p.returncode != 0:
        sys.exit(f"loom {' '.join(cmd)} failed: {p.stderr}")
    return p.stdout


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--loom", default=os.path.join(ROOT, "build", "bin", "loom"))
    parser.add_argument("--base", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    files = sorted(f for f in os.listdir(FORTUNES) if "." not in f and os.path.isfile(os.path.join(FORTUNES, f)))
    half = len(files) // 2
    slices = {"A": files[:half], "B": files[half:]}
    texts, held = {}, {}
    for name, names in slices.items():
        body = "".join(open(os.path.join(FORTUNES, f), encoding="utf-8", errors="replace").read() for f in names)
        cut = int(len(body) * 0.9)
        texts[name], held[name] = body[:cut], body[cut:]
    texts["AB"] = texts["A"] + texts["B"]
    held["AB"] = held["A"] + held["B"]
    tokenizer = os.path.join(ROOT, "data", "fortunes", "tokenizer")
    for name in ("A", "B", "AB"):
        with open(os.path.join(args.out, f"train_{name}.txt"), "w") as f:
            f.write(texts[name])
        with open(os.path.join(args.out, f"held_{name}.txt"), "w") as f:
            f.write(held[name])
        data = os.path.join(args.out, f"data_{name}")
        loom(args, "prepare", "--input", os.path.join(args.out, f"train_{name}.txt"), "--tokenizer", tokenizer, "--out", data,
             "--val-fraction", "0.02")
        loom(args, "train", "--set", f"train.init_from={args.base},data.dir={data},data.tokenizer={tokenizer},"
             f"train.steps={args.steps},train.eval_every=0,train.checkpoint_every={args.steps},optim.lr=5e-4,"
             f"optim.min_lr=5e-5,optim.warmup_steps=10,run.dir={args.out}/runs,run.name=on_{name}")
    runs = os.path.join(args.out, "runs")
    loom(args, "merge", "--method", "average", "--out", os.path.join(runs, "merge_average"),
         os.path.join(runs, "on_A"), os.path.join(runs, "on_B"))
    loom(args, "merge", "--method", "task-arithmetic", "--base", args.base, "--out", os.path.join(runs, "merge_task"),
         os.path.join(runs, "on_A"), os.path.join(runs, "on_B"))
    loom(args, "merge", "--method", "ties", "--base", args.base, "--density", "0.5", "--out", os.path.join(runs, "merge_ties"),
         os.path.join(runs, "on_A"), os.path.join(runs, "on_B"))
    models = [("base", args.base), ("trained on A", os.path.join(runs, "on_A")), ("trained on B", os.path.join(runs, "on_B")),
              ("average(A, B)", os.path.join(runs, "merge_average")),
              ("task arithmetic(A, B)", os.path.join(runs, "merge_task")),
              ("TIES(A, B), density 0.5", os.path.join(runs, "merge_ties")),
              ("trained on A+B", os.path.join(runs, "on_AB"))]
    print(f"| model ({args.steps} steps per training run) | held-out A | held-out B | held-out A+B |")
    print("|---|---|---|---|")
    for label, path in models:
        ppl = []
        for name in ("A", "B", "AB"):
            out = json.loads(loom(args, "eval", "--checkpoint", path, "--text", os.path.join(args.out, f"held_{name}.txt"),
                                  "--seq-len", "128", "--batch", "8", "--json"))
            ppl.append(out["perplexity"])
        print(f"| {label} | {ppl[0]:.2f} | {ppl[1]:.2f} | {ppl[2]:.2f} |", flush=True)


if __name__ == "__main__":
    main()
