#!/usr/bin/python3
"""Fine-tuning cost on this machine: full fine-tuning vs LoRA vs QLoRA vs DoRA, Loom vs PyTorch, in the same run.

    /usr/bin/python3 bench/finetune_bench.py [--build build] [--steps 6] [--warmup 2] [--rank 16]

For each shape -- the small GPT-2 (6 layers, d = 384, B = 4, T = 256) and GPT-2 124M (B = 4,
T = 64) -- runs, one after another (never concurrently):
  * Loom full fine-tuning, Loom LoRA (rank R, alpha 2R, every block linear: c_attn, both
    c_proj, c_fc; the base frozen) and Loom QLoRA (the same over a base whose block matrices are
    NF4) and Loom DoRA (LoRA with magnitudes): build/bench/train_bench [--lora R [--qlora 1] [--dora 1]];
  * PyTorch at its best (OPENBLAS_CORETYPE unset, OMP_WAIT_POLICY=PASSIVE, tcmalloc), full,
    LoRA and DoRA with the same formulas as PEFT computes them: bench/torch_train_bench.py
    [--lora R [--dora 1]];
and prints step time, tokens/s, the process's peak resident memory (getrusage, both sides) and
Loom's resident parameter and gradient bytes and optimizer state, then the ratios LoRA / full,
QLoRA / LoRA, DoRA / LoRA and Loom / PyTorch. PyTorch has no QLoRA here (bitsandbytes is not in Debian). The
peak RSS of a Loom QLoRA run still includes the fp32 base it quantizes after initialising it;
its resident parameter bytes after the steps are what training holds.
"""

from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from compare_train import run_json, torch_env  # noqa: E402

SHAPES = [("gpt2-small", 4, 256), ("gpt2-124m", 4, 64)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--build", default=os.path.join(os.path.dirname(HERE), "build"))
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rank", type=int, default=16)
    args = ap.parse_args()
    loom_bin = os.path.join(args.build, "bench", "train_bench")
    if not os.access(loom_bin, os.X_OK):
        raise SystemExit(f"finetune_bench: {loom_bin} not found; build first (cmake --build {args.build})")
    loom_env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    for model, batch, seq in SHAPES:
        common = ["--model", model, "--batch", str(batch), "--seq", str(seq), "--steps", str(args.steps),
                  "--warmup", str(args.warmup)]
        rows = {}
        for lora in (0, args.rank):
            rows[("loom", lora)] = run_json([loom_bin, *common, "--lora", str(lora)], loom_env)
            rows[("pytorch", lora)] = run_json([sys.executable, os.path.join(HERE, "torch_train_bench.py"), *common,
                                                "--threads", str(args.threads), "--lora", str(lora)],
                                               torch_env(True, args.threads))
        rows[("loom", "qlora")] = run_json([loom_bin, *common, "--lora", str(args.rank), "--qlora", "1"], loom_env)
        rows[("loom", "dora")] = run_json([loom_bin, *common, "--lora", str(args.rank), "--dora", "1"], loom_env)
        rows[("pytorch", "dora")] = run_json([sys.executable, os.path.join(HERE, "torch_train_bench.py"), *common,
                                              "--threads", str(args.threads), "--lora", str(args.rank), "--dora", "1"],
                                             torch_env(True, args.threads))
        print(f"\n{model}, B={batch}, T={seq}, {args.threads} threads, {args.steps} timed steps, LoRA rank {args.rank}:")
        print(f"  {'run':<22} {'step ms':>9} {'tokens/s':>10} {'peak RSS':>10}   Loom: parameters, gradients resident; "
              "optimizer state; NF4 bytes")
        for (impl, lora), r in rows.items():
            name = f"{impl} {'QLoRA' if lora == 'qlora' else 'DoRA' if lora == 'dora' else 'LoRA' if lora else 'full'}"
            extra = ""
            if impl == "loom" and lora != "dora":
                extra = (f"   {r['resident_bytes_parameters'] / 2**20:8.1f} MiB, {r['resident_bytes_gradients'] / 2**20:8.1f} MiB; "
                         f"{r['peak_bytes_optimizer_state'] / 2**20:8.1f} MiB; {r['nf4_bytes'] / 2**20:6.1f} MiB")
            print(f"  {name:<22} {r['step_ms']:9.1f} {r['tokens_per_s']:10.1f} {r['max_rss'] / 2**20:8.0f} MiB{extra}")
        q, l = rows[("loom", "qlora")], rows[("loom", args.rank)]
        print(f"  loom: QLoRA / LoRA step time {q['step_ms'] / l['step_ms']:.3f}, resident parameters "
              f"{q['resident_bytes_parameters'] / l['resident_bytes_parameters']:.3f}")
        for impl in ("loom", "pytorch"):
            full, lora = rows[(impl, 0)], rows[(impl, args.rank)]
            print(f"  {impl}: LoRA / full step time {lora['step_ms'] / full['step_ms']:.3f}, "
                  f"peak RSS {lora['max_rss'] / full['max_rss']:.3f}")
        for impl in ("loom", "pytorch"):
            print(f"  {impl}: DoRA / LoRA step time {rows[(impl, 'dora')]['step_ms'] / rows[(impl, args.rank)]['step_ms']:.3f}")
        for lora in (0, args.rank, "dora"):
            l, p = rows[("loom", lora)], rows[("pytorch", lora)]
            name = "DoRA" if lora == "dora" else "LoRA" if lora else "full"
            print(f"  Loom / PyTorch ({name}): tokens/s {l['tokens_per_s'] / p['tokens_per_s']:.3f}, "
                  f"peak RSS {l['max_rss'] / p['max_rss']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
