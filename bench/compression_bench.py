#!/usr/bin/python3
"""The compression table of docs/compression.md, measured on models Loom trained.

    /usr/bin/python3 bench/compression_bench.py --loom build/bin/loom --out /tmp/cb RUN [RUN ...]

For each RUN (a run folder trained on data/fortunes): the held-out text is the dataset's
validation split decoded back to text (the tokens the model never trained on), the calibration
text the last 60k tokens of the training split. Then, for f32 and every method and bit width:

    loom quantize / loom prune   the compressed model
    loom eval --text             perplexity on the held-out text (windows of train.seq_len)
    bytes                        model.safetensors of the result (codes, scales, zeros and the
                                 f32 parameters kept: embeddings, norms, biases)
    loom bench generate          single-stream prefill and decode tokens/s (4 requests of 64
                                 prompt + 64 new tokens, greedy, one at a time)

and llama.cpp (npm node-llama-cpp, tools/llama_speed.mjs, 2 threads) on the f32 model exported
to GGUF f32 / q8_0 / q4_0 in the same run, against Loom's f32 / int8 / int4 decode. Prints a
Markdown table per model and writes OUT/results.json. SmoothQuant is also run on a copy of the
model with injected activation outliers (--outliers: 4 channels of every block's first norm
scaled by 100 and the matching qkv columns by 1/100, a function-preserving change), where naive
W8A8 breaks and SmoothQuant should not.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import struct
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import loom_reference as ref  # noqa: E402


def bytes_to_unicode() -> dict:
    """GPT-2's reversible byte <-> printable character map (its encoder.json keys use it)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\u00a1"), ord("\u00ac") + 1)) + \
        list(range(ord("\u00ae"), ord("\u00ff") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, [chr(c) for c in cs]))


def shard_tokens(path: str) -> list:
    with open(path, "rb") as f:
        head = f.read(64)
        assert head[:8] == b"LOOMTOK\0", path
        dtype, = struct.unpack("<I", head[12:16])
        count, = struct.unpack("<Q", head[24:32])
        width = 2 if dtype == 1 else 4
        data = f.read(count * width)
    return list(struct.unpack(f"<{count}{'H' if width == 2 else 'I'}", data))


def decode(tokens: list, tokenizer_dir: str) -> str:
    with open(os.path.join(tokenizer_dir, "encoder.json")) as f:
        encoder = json.load(f)
    inverse = {v: k for k, v in encoder.items()}
    byte_of = {c: b for b, c in bytes_to_unicode().items()}
    out = bytearray()
    for t in tokens:
        piece = inverse.get(t, "")
        if piece.startswith("<|"):  # the end-of-text between documents
            out += b"\n"
            continue
        out += bytes(byte_of[c] for c in piece)
    return out.decode("utf-8", errors="replace")


def loom(args, *cmd, check=True):
    p = subprocess.run([args.loom, *cmd], capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="2"))
    if check and p.returncode != 0:
        sys.exit(f"loom {' '.join(cmd)} failed: {p.stderr}")
    return p.stdout


def perplexity(args, path, text, seq_len):
    out = json.loads(loom(args, "eval", "--checkpoint", path, "--text", text, "--seq-len", str(seq_len), "--batch", "8",
                          "--json"))
    return out["perplexity"]


def speed(args, path):
    out = loom(args, "bench", "generate", "--checkpoint", path, "--requests", "4", "--prompt-tokens", "64",
               "--new-tokens", "64", "--max-batch", "1")
    m = re.search(r"prefill\s+([\d.]+) prompt tokens/s.*decode\s+([\d.]+) tokens/s", out)
    return float(m.group(1)), float(m.group(2))


def model_bytes(path):
    for root, _, files in os.walk(path):
        if "model.safetensors" in files:
            return os.path.getsize(os.path.join(root, "model.safetensors"))
    raise FileNotFoundError(path)


def inject_outliers(run_dir, out_dir):
    """A copy of the run's newest checkpoint with 4 outlier channels per block (function-preserving)."""
    steps = sorted(d for d in os.listdir(os.path.join(run_dir, "checkpoints")) if d.startswith("step_") and "." not in d)
    src = os.path.join(run_dir, "checkpoints", steps[-1])
    hf = out_dir + "_hf"
    shutil.rmtree(hf, ignore_errors=True)
    subprocess.run([ARGS.loom, "convert", "--to", "hf", "--checkpoint", src, "--out", hf], check=True, capture_output=True)
    tensors, meta = ref.read_safetensors(os.path.join(hf, "model.safetensors"))
    layer = 0
    while f"h.{layer}.ln_1.weight" in tensors:
        ln_w, ln_b = tensors[f"h.{layer}.ln_1.weight"], tensors[f"h.{layer}.ln_1.bias"]
        w = tensors[f"h.{layer}.attn.c_attn.weight"]  # Conv1D (in, out)
        for c in (3, 17, 101, 200):
            ln_w[c] *= 100.0
            ln_b[c] *= 100.0
            w[c, :] /= 100.0
        layer += 1
    ref.write_safetensors(os.path.join(hf, "model.safetensors"), tensors, meta)
    shutil.rmtree(out_dir, ignore_errors=True)
    subprocess.run([ARGS.loom, "convert", "--to", "loom", "--checkpoint", hf, "--out", out_dir], check=True, capture_output=True)
    return out_dir


def llama_cpp(args, run_dir, work, seq_prompt):
    out = {}
    files = []
    for t in ("f32", "q8_0", "q4_0"):
        f = os.path.join(work, f"model_{t}.gguf")
        loom(args, "convert", "--to", "gguf", "--type", t, "--checkpoint", run_dir, "--out", f)
        files.append(f)
    spec = os.path.join(work, "llama_spec.json")
    with open(spec, "w") as f:
        json.dump({"files": files, "prompt": seq_prompt, "new": 64, "runs": 3}, f)
    p = subprocess.run(["node", os.path.join(ROOT, "tools", "llama_speed.mjs"), spec], capture_output=True, text=True)
    if p.returncode != 0:
        print(f"llama.cpp: {p.stderr.strip()}", file=sys.stderr)
        return out
    for r in json.loads(p.stdout.strip().splitlines()[-1]):
        t = r["file"].split("_", 1)[1].split(".")[0]
        out[t] = (r["prompt_tokens_per_s"], r["decode_tokens_per_s"], os.path.getsize(os.path.join(work, r["file"])))
    return out


QUANT = [("rtn", 8), ("rtn", 4), ("rtn", 3), ("gptq", 8), ("gptq", 4), ("gptq", 3), ("awq", 4), ("awq", 3),
         ("smoothquant", 8), ("w8a8", 8)]
PRUNE = [("magnitude", "0.5"), ("wanda", "0.5"), ("sparsegpt", "0.5"), ("magnitude", "2:4"), ("wanda", "2:4"),
         ("sparsegpt", "2:4")]


def bench_run(args, run_dir):
    name = os.path.basename(os.path.normpath(run_dir))
    work = os.path.join(args.out, name)
    os.makedirs(work, exist_ok=True)
    with open(os.path.join(run_dir, "config.toml")) as f:
        cfg = f.read()
    seq_len = int(re.search(r"^seq_len = (\d+)", cfg, re.M).group(1))
    data = os.path.join(ROOT, "data", "fortunes")
    heldout = os.path.join(work, "heldout.txt")
    calib = os.path.join(work, "calib.txt")
    with open(heldout, "w") as f:
        f.write(decode(shard_tokens(os.path.join(data, "val_000000.bin")), os.path.join(data, "tokenizer")))
    with open(calib, "w") as f:
        f.write(decode(shard_tokens(os.path.join(data, "train_000000.bin"))[-60000:], os.path.join(data, "tokenizer")))
    rows = []
    done = {}
    cache = os.path.join(work, "rows.jsonl")
    if os.path.exists(cache) and args.reuse:
        with open(cache) as f:
            for line in f:
                r = json.loads(line)
                done[r["method"]] = r

    def measure(label, path, kind):
        if label in done:
            rows.append(done[label])
            return
        ppl = perplexity(args, path, heldout, seq_len)
        prefill, dec = speed(args, path) if kind != "prune" else (None, None)
        rows.append({"model": name, "method": label, "kind": kind, "perplexity": ppl, "bytes": model_bytes(path),
                     "prefill_tok_s": prefill, "decode_tok_s": dec})
        print(json.dumps(rows[-1]), flush=True)
        with open(cache, "a") as f:
            f.write(json.dumps(rows[-1]) + "\n")

    measure("f32", run_dir, "f32")
    for method, bits in QUANT:
        out = os.path.join(work, f"{method}{bits}")
        extra = ["--calib", calib, "--calib-tokens", str(args.calib_tokens)] if method in ("gptq", "awq", "smoothquant") else []
        if f"{method} {bits}-bit" not in done:
            loom(args, "quantize", "--checkpoint", run_dir, "--method", method, "--bits", str(bits), "--out", out, *extra)
        measure(f"{method} {bits}-bit", out, "quant")
    for method, amount in PRUNE:
        out = os.path.join(work, f"prune_{method}_{amount.replace(':', '-')}")
        how = ["--pattern", amount] if ":" in amount else ["--sparsity", amount]
        extra = ["--calib", calib, "--calib-tokens", str(args.calib_tokens)] if method != "magnitude" else []
        if f"prune {method} {amount}" not in done:
            loom(args, "prune", "--checkpoint", run_dir, "--method", method, *how, "--out", out, *extra)
        measure(f"prune {method} {amount}", out, "prune")
    # Activation outliers: naive W8A8 against SmoothQuant.
    outl = inject_outliers(run_dir, os.path.join(work, "outliers"))
    measure("f32, outliers injected", outl, "prune")
    for method in ("w8a8", "smoothquant"):
        out = os.path.join(work, f"outliers_{method}")
        extra = ["--calib", calib, "--calib-tokens", str(args.calib_tokens)] if method == "smoothquant" else []
        loom(args, "quantize", "--checkpoint", outl, "--method", method, "--out", out, *extra)
        measure(f"{method} 8-bit, outliers injected", out, "prune")
    for method in ("magnitude", "wanda"):  # Wanda keeps the small weights of the large-input channels
        out = os.path.join(work, f"outliers_prune_{method}")
        extra = ["--calib", calib, "--calib-tokens", str(args.calib_tokens)] if method == "wanda" else []
        if f"prune {method} 0.5, outliers injected" not in done:
            loom(args, "prune", "--checkpoint", outl, "--method", method, "--sparsity", "0.5", "--out", out, *extra)
        measure(f"prune {method} 0.5, outliers injected", out, "prune")
    prompt = shard_tokens(os.path.join(data, "val_000000.bin"))[:64]
    llama = llama_cpp(args, run_dir, work, prompt) if not args.no_llama else {}
    return rows, llama


def table(rows, llama):
    f32 = next(r for r in rows if r["method"] == "f32")
    lines = ["| method | perplexity | change | weight file (MiB) | prefill tok/s | decode tok/s | decode vs f32 |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        speed_cols = ("-", "-", "-") if r["decode_tok_s"] is None else (
            f"{r['prefill_tok_s']:.0f}", f"{r['decode_tok_s']:.0f}", f"{r['decode_tok_s'] / f32['decode_tok_s']:.2f}x")
        lines.append(f"| {r['method']} | {r['perplexity']:.3f} | {100 * (r['perplexity'] / f32['perplexity'] - 1):+.1f}% | "
                     f"{r['bytes'] / 2**20:.2f} | {speed_cols[0]} | {speed_cols[1]} | {speed_cols[2]} |")
    if llama:
        loom_of = {"f32": "f32", "q8_0": "rtn 8-bit", "q4_0": "rtn 4-bit"}
        lines += ["", "| llama.cpp GGUF | file (MiB) | prefill tok/s | decode tok/s | Loom's (same bits) decode | Loom / llama.cpp |",
                  "|---|---|---|---|---|---|"]
        for t, (pp, dec, size) in llama.items():
            mine = next(r for r in rows if r["method"] == loom_of[t])
            lines.append(f"| {t} | {size / 2**20:.2f} | {pp:.0f} | {dec:.0f} | {mine['decode_tok_s']:.0f} ({loom_of[t]}) | "
                         f"{mine['decode_tok_s'] / dec:.2f}x |")
    return "\n".join(lines)


def main():
    global ARGS
    parser = argparse.ArgumentParser()
    parser.add_argument("--loom", default=os.path.join(ROOT, "build", "bin", "loom"))
    parser.add_argument("--out", required=True)
    parser.add_argument("--calib-tokens", type=int, default=16384)
    parser.add_argument("--no-llama", action="store_true")
    parser.add_argument("--reuse", action="store_true", help="reuse the rows OUT/<model>/rows.jsonl already holds")
    parser.add_argument("runs", nargs="+")
    ARGS = args = parser.parse_args()
    results = {}
    for run_dir in args.runs:
        rows, llama = bench_run(args, run_dir)
        results[run_dir] = {"rows": rows, "llama": llama}
        print(f"\n### {run_dir}\n\n{table(rows, llama)}\n", flush=True)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()


def speed_rounds(loom_bin: str, paths: dict, rounds: int = 3) -> dict:
    """Decode and prefill tokens/s of each model in `paths` (label -> checkpoint), alternating over
    `rounds` rounds so that a busy moment of the machine hits one round, not one format; returns
    label -> list of (prefill, decode) per round."""
    class A:
        loom = loom_bin
    out = {label: [] for label in paths}
    for _ in range(rounds):
        for label, path in paths.items():
            out[label].append(speed(A, path))
    return out
