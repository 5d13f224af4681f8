#!/usr/bin/python3
"""What a checkpoint costs the training loop: none, blocking and asynchronous saves, alternating.

Usage: bench/checkpoint_bench.py [path/to/loom] [--rounds 3] [--steps 60] [--every 10]

Trains the default model (configs/default.toml: 5.8M parameters; a checkpoint with AdamW's
moments is ~70 MB) for --steps steps with a checkpoint every --every steps, three ways in each
round: no checkpoints, blocking saves, train.async_checkpoint = true. The loop's time is read from
the run's trace (train.trace: the first step's start to the last step's end), so start-up and the
final save are not counted. Prints per mode the median loop time, the overhead per checkpoint
against no checkpoints, and what the step saw of it (blocking: the save; async: the snapshot, and
the steps slowed while the writer shares the machine). The data is the default corpus (prepared by
scripts/run or the first `loom train`).
"""
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main():
    args = sys.argv[1:]
    loom = args.pop(0) if args and not args[0].startswith("--") else os.path.join(ROOT, "build/bin/loom")
    opts = dict(zip(args[::2], args[1::2]))
    rounds, steps, every = int(opts.get("--rounds", 3)), int(opts.get("--steps", 60)), int(opts.get("--every", 10))
    tmp = tempfile.mkdtemp(prefix="loom_ckpt_bench_")
    modes = {"none": "train.checkpoint_every=0", "blocking": f"train.checkpoint_every={every}",
             "async": f"train.checkpoint_every={every},train.async_checkpoint=true"}
    loop, saved, stepped = {m: [] for m in modes}, {m: [] for m in modes}, {m: [] for m in modes}
    try:
        for r in range(rounds):
            for mode, sets in modes.items():
                name = f"{mode}{r}"
                p = subprocess.run([loom, "train", "--set", f"train.steps={steps},train.eval_every=0,train.trace=true,"
                                    f"sample.max_new_tokens=1,run.dir={tmp},run.name={name},{sets}"],
                                   cwd=ROOT, capture_output=True, text=True)
                if p.returncode != 0:
                    sys.exit(f"loom train failed:\n{p.stdout}\n{p.stderr}")
                with open(os.path.join(tmp, name, "trace", "rank0.json")) as f:
                    events = [e for e in json.load(f)["traceEvents"] if e["ph"] == "X"]
                step = sorted((e for e in events if e["cat"] == "step"), key=lambda e: e["ts"])
                loop[mode].append((step[-1]["ts"] + step[-1]["dur"] - step[0]["ts"]) * 1e-6)
                stepped[mode].append(statistics.median(e["dur"] for e in step) * 1e-3)
                # What the loop waited for: the saves inside the loop (the last step's is after it).
                inside = [e for e in events if e["cat"] == "checkpoint" and e["tid"] == 0 and e["ts"] < step[-1]["ts"]]
                saved[mode].append(statistics.mean(e["dur"] for e in inside) * 1e-3 if inside else 0.0)
                shutil.rmtree(os.path.join(tmp, name), ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    n = steps // every - 1  # checkpoints inside the loop
    base = statistics.median(loop["none"])
    print(f"checkpoint cost, default model, {steps} steps, a checkpoint every {every} ({n} inside the loop), "
          f"{rounds} alternating rounds, medians:")
    print(f"{'mode':>9} {'loop s':>8} {'per ckpt ms':>12} {'ratio':>7} {'step waits ms':>14} {'median step ms':>15}")
    for mode in modes:
        t = statistics.median(loop[mode])
        per = (t - base) / n * 1e3 if mode != "none" else 0.0
        print(f"{mode:>9} {t:8.2f} {per:12.1f} {t / base:7.3f} {statistics.median(saved[mode]):14.1f} "
              f"{statistics.median(stepped[mode]):15.1f}")


if __name__ == "__main__":
    main()
