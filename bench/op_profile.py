#!/usr/bin/python3
"""Where a Loom training step spends its time, per op: a sampling profile of bench/train_bench.

    /usr/bin/python3 bench/op_profile.py [--build build] [--model gpt2-124m --batch 4 --seq 64]
        [--compute f32] [--steps 6] [--warmup 2] [--threads 2] [--freq 1999]

Method. `perf record` (cpu-clock samples at --freq Hz on every thread, no call graphs) runs
train_bench twice: with W warm-up steps and 0 timed ones, and with W warm-up and N timed steps.
The second minus the first, per symbol, is what N training steps cost, with start-up (weight
init, page faults of the first steps, oneDNN's JIT compilation) taken out exactly. Symbols are
grouped into ops: Loom's kernels by function name (templates and OpenMP outlined clones folded
in), oneDNN's JIT-generated code as "GEMM (oneDNN JIT kernels)" (every matmul: the linear layers,
the attention scores and values, the head), libgomp as "OpenMP runtime (fork/join, waits)", the
kernel as "kernel (syscalls, page faults)". CPU time is summed over the threads, so an op's ms
per step is its CPU-ms / threads (the wall time it would take with every thread busy on it).

It prints one row per op: ms per step, share of the step's CPU time, and for the GEMMs their
GFLOP/s (the model's matmul FLOPs per step, 6N + 12LTd per token, over the GEMM time) against
the machine's measured GEMM peak of the dtype (train_bench's gemm_peak_gflops). perf must be
installed (Debian: linux-perf) and allowed (kernel.perf_event_paranoid <= 1, or root).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def op_name(dso: str, sym: str) -> str:
    if dso.startswith("[JIT]"):
        return "GEMM (oneDNN JIT kernels)"
    if "libdnnl" in dso:
        return "oneDNN (GEMM driver, packing)"
    if "libgomp" in dso:
        return "OpenMP runtime (fork/join, waits)"
    if dso.startswith("[kernel"):
        return "kernel (syscalls, page faults)"
    if dso.startswith("libc.so") or dso.startswith("libc-"):
        if "mem" in sym:
            return "memset / memcpy"
        return "libc (malloc, free, ...)"
    if dso.startswith("libm"):
        return "libm (" + re.sub(r"^__|_fma$|_avx.*$", "", sym) + ")"
    s = re.sub(r"\[clone [^\]]*\]", "", sym).replace("(anonymous namespace)::", "")
    s = re.sub(r"\(.*", "", s) if "(" in s and "operator()" not in s else s
    # loom::cpu::layernorm_forward<float> / CpuBackend::fill(...)::{lambda()#1}::operator()<float>
    m = re.search(r"(?:loom::)?(?:cpu::|\(anonymous namespace\)::CpuBackend::)?([A-Za-z_][A-Za-z0-9_]*)(?:<[^()]*>)?(?:\(|$)", s)
    name = m.group(1) if m else s
    for prefix in ("loom::", "cpu::"):
        name = name.replace(prefix, "")
    return f"{name}" if dso.startswith(("train_bench", "libloom")) else f"{name} ({dso})"


def profile(cmd: list[str], env: dict[str, str], freq: int) -> tuple[collections.Counter, dict]:
    with tempfile.TemporaryDirectory() as tmp:
        data = os.path.join(tmp, "perf.data")
        rec = subprocess.run(["perf", "record", "-q", "-F", str(freq), "-o", data, "--"] + cmd, env=env,
                             capture_output=True, text=True)
        if rec.returncode != 0:
            raise SystemExit(f"op_profile: perf record failed ({rec.returncode}): {rec.stderr.strip().splitlines()[-1:]}")
        lines = [line for line in rec.stdout.splitlines() if line.startswith("{")]
        try:
            result = json.loads(lines[-1]) if lines else {}
        except json.JSONDecodeError:  # the 0-step run's tokens/s is nan
            result = {}
        rep = subprocess.run(["perf", "report", "-i", data, "--stdio", "--sort", "dso,sym", "-F", "sample,dso,sym"],
                             capture_output=True, text=True, check=True).stdout
    counts: collections.Counter = collections.Counter()
    for line in rep.splitlines():
        m = re.match(r"\s*(\d+)\s+(\S+(?: tid \d+)?)\s+\[[.k]\]\s+(.*)$", line)
        if m:
            counts[op_name(m.group(2), m.group(3).strip())] += int(m.group(1))
    return counts, result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--build", default=os.path.join(ROOT, "build"))
    ap.add_argument("--model", default="gpt2-124m")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--compute", default="f32")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--freq", type=int, default=1999)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--json", help="also write the table to this file (JSON)")
    args = ap.parse_args()
    loom_bin = os.path.join(args.build, "bench", "train_bench")
    if not os.access(loom_bin, os.X_OK):
        raise SystemExit(f"op_profile: {loom_bin} not found; build first (cmake --build {args.build})")
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    common = [loom_bin, "--model", args.model, "--batch", str(args.batch), "--seq", str(args.seq),
              "--compute", args.compute, "--warmup", str(args.warmup)]
    base, _ = profile(common + ["--steps", "0"], env, args.freq)
    full, result = profile(common + ["--steps", str(args.steps)], env, args.freq)
    diff = {op: (full[op] - base.get(op, 0)) for op in full}
    total = sum(v for v in diff.values() if v > 0)
    if total <= 0:
        raise SystemExit("op_profile: no samples in the timed steps")
    ms_per_sample = 1000.0 / args.freq
    step_cpu_ms = total * ms_per_sample / args.steps
    gemm_ms = diff.get("GEMM (oneDNN JIT kernels)", 0) * ms_per_sample / args.steps / args.threads
    flops_step = result.get("achieved_gflops", 0.0) * 1e9 * result.get("step_ms", 0.0) / 1e3
    peak = result.get("gemm_peak_gflops", 0.0)
    print(f"train_bench {args.model} B={args.batch} T={args.seq} {args.compute}, {args.threads} threads: "
          f"{result.get('step_ms', 0):.1f} ms per step (wall), {step_cpu_ms:.1f} CPU-ms sampled per step, "
          f"{result.get('tokens_per_s', 0):.1f} tokens/s, MFU {100 * result.get('mfu', 0):.1f}% of the {peak:.0f} GFLOP/s "
          f"{result.get('peak_dtype', '')} GEMM peak")
    print(f"{'op':<48}{'ms/step':>9}{'share':>8}  rate")
    rows = []
    for op, samples in sorted(diff.items(), key=lambda kv: -kv[1])[: args.top]:
        if samples <= 0:
            continue
        ms = samples * ms_per_sample / args.steps / args.threads
        rate = ""
        if op.startswith("GEMM") and ms > 0:
            gf = flops_step / (ms / 1e3) / 1e9
            rate = f"{gf:.0f} GFLOP/s, {100 * gf / peak:.0f}% of peak (all model matmul FLOPs over the GEMM time)" if peak else ""
        rows.append({"op": op, "ms_per_step": ms, "share": samples / total, "rate": rate})
        print(f"{op[:47]:<48}{ms:>9.2f}{100 * samples / total:>7.1f}%  {rate}")
    print(f"(GEMM time {gemm_ms:.1f} ms of {result.get('step_ms', 0):.1f}; perf cpu-clock at {args.freq} Hz, "
          f"{args.steps} steps after {args.warmup} warm-up, start-up subtracted)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"result": result, "ops": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
