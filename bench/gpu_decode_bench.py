#!/usr/bin/env python3
"""Loom vs PyTorch decoding on one GPU: prefill and decode tokens/s at batch 1 and 16, same run.

    python3 bench/gpu_decode_bench.py [--build build-gpu] [--config configs/llama3_8b.toml]
        [--prompt 128] [--new 64] [--kv bf16] [--device cuda] [--tiny] [--eager] [--out FILE]

What it measures, on a Llama-3-8B-shaped model with random weights (configs/llama3_8b.toml; --tiny:
a 2-layer model of the same kind, for a CPU smoke run), greedy, P prompt tokens and M new ones:
  * Loom: BUILD/bin/loom bench generate --config C --device D --requests 16 --prompt-tokens P
    --new-tokens M --max-batch 16 --kv K. Its "single stream" line gives batch 1's prefill
    (prompt / time to first token) and decode (tokens after the first per second) over 16
    requests one at a time; its "continuous batching" line gives the 16 requests together.
    Twice: with fp32 weights, and with --bf16-weights (the weights rounded to bf16 and used in
    place, as a bf16 Hugging Face folder's are: Backend::bf16_weight_linear reads 2 bytes a
    weight; docs/cuda.md "Decoding a Llama-3-8B-shaped model").
  * PyTorch: the same shape written here (RMSNorm, RoPE, GQA with SDPA, SwiGLU; a static KV
    cache of P + M positions, attention masked to the filled ones so every step has one shape),
    bf16 weights, the decode step under torch.compile(mode="reduce-overhead": CUDA graphs,
    PyTorch's best at batch 1), prefill eager; batch 1 and 16.
Prints one table: tokens/s of both at batch 1 (prefill, decode) and 16 (decode), and Loom /
PyTorch; the predicted figures are docs/cuda.md's. Writes the numbers as JSON to --out.
Exit status 1 when either side failed (the other still runs).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def shape(args) -> dict:
    if args.tiny:
        return dict(n_layer=2, d_model=256, n_head=8, n_kv_head=2, d_ff=512, vocab=1024, theta=500000.0, eps=1e-5)
    return dict(n_layer=32, d_model=4096, n_head=32, n_kv_head=8, d_ff=14336, vocab=128256, theta=500000.0, eps=1e-5)


def run_loom(args, s: dict, bf16: bool) -> dict:
    sets = ",".join([f"model.n_layer={s['n_layer']}", f"model.d_model={s['d_model']}", f"model.n_head={s['n_head']}",
                     f"model.n_kv_head={s['n_kv_head']}", f"model.d_ff={s['d_ff']}", f"model.vocab_size={s['vocab']}",
                     f"model.max_seq_len={max(256, args.prompt + args.new)}"])
    cmd = [os.path.join(args.build, "bin", "loom"), "bench", "generate", "--config", args.config, "--set", sets,
           "--device", args.device, "--requests", "16", "--prompt-tokens", str(args.prompt), "--new-tokens",
           str(args.new), "--max-batch", "16", "--kv", args.kv] + (["--bf16-weights"] if bf16 else [])
    print("loom:", " ".join(cmd), flush=True)
    start = time.time()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    print(f"loom: exit {p.returncode} after {time.time() - start:.1f} s", flush=True)
    for line in (p.stdout.splitlines() + p.stderr.splitlines()[-5:]):
        print("  " + line, flush=True)
    if p.returncode != 0:
        return {"error": (p.stderr or p.stdout).strip().splitlines()[-5:]}
    out = p.stdout
    single = re.search(r"prefill\s+([\d.]+) prompt tokens/s.*decode\s+([\d.]+) tokens/s", out)
    batched = re.search(r"continuous batching:\s+([\d.]+) new tokens/s", out)
    if not single or not batched:
        return {"error": ["unexpected output"] + out.splitlines()[-5:]}
    return {"prefill_b1": float(single.group(1)), "decode_b1": float(single.group(2)),
            "decode_b16": float(batched.group(1)), "output": out.splitlines()}


def run_torch(args, s: dict) -> dict:
    try:
        import torch
        import torch.nn.functional as F
    except ImportError as e:
        return {"error": [f"no torch: {e}"]}
    dev = args.device
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    torch.manual_seed(0)
    L, d, H, G, ff, V = s["n_layer"], s["d_model"], s["n_head"], s["n_kv_head"], s["d_ff"], s["vocab"]
    hd = d // H
    T = args.prompt + args.new

    def w(*dims):
        return (torch.randn(*dims, device=dev, dtype=dtype) * 0.02)

    layers = [dict(an=torch.ones(d, device=dev, dtype=dtype), q=w(H * hd, d), k=w(G * hd, d), v=w(G * hd, d),
                   o=w(d, H * hd), mn=torch.ones(d, device=dev, dtype=dtype), g=w(ff, d), u=w(ff, d), dn=w(d, ff))
              for _ in range(L)]
    emb, head, fn = w(V, d), w(V, d), torch.ones(d, device=dev, dtype=dtype)
    inv = 1.0 / (s["theta"] ** (torch.arange(0, hd, 2, device=dev, dtype=torch.float32) / hd))
    ang = torch.outer(torch.arange(T, device=dev, dtype=torch.float32), inv)
    cos, sin = ang.cos().to(dtype), ang.sin().to(dtype)
    positions = torch.arange(T, device=dev)

    def rms(x, weight):
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + s["eps"])).to(dtype) * weight

    def rope(x, pos):  # x (B, heads, n, hd), Llama's rotate-half
        c, sn = cos[pos][None, None], sin[pos][None, None]
        x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
        return torch.cat([x1 * c - x2 * sn, x2 * c + x1 * sn], dim=-1)

    def forward(tokens, pos, kc, vc):  # tokens (B, n); pos (n,) positions; caches (L, B, G, T, hd)
        B, n = tokens.shape
        x = emb[tokens]
        for i, ly in enumerate(layers):
            h = rms(x, ly["an"])
            q = (h @ ly["q"].T).view(B, n, H, hd).transpose(1, 2)
            k = (h @ ly["k"].T).view(B, n, G, hd).transpose(1, 2)
            v = (h @ ly["v"].T).view(B, n, G, hd).transpose(1, 2)
            q, k = rope(q, pos), rope(k, pos)
            kc[i][:, :, pos] = k
            vc[i][:, :, pos] = v
            keys = kc[i].repeat_interleave(H // G, dim=1)  # every position; the mask hides the empty ones
            vals = vc[i].repeat_interleave(H // G, dim=1)
            mask = positions[None, :] <= pos[:, None]
            a = sdpa(q, keys, vals, mask)
            x = x + a.transpose(1, 2).reshape(B, n, H * hd) @ ly["o"].T
            h = rms(x, ly["mn"])
            x = x + (F.silu(h @ ly["g"].T) * (h @ ly["u"].T)) @ ly["dn"].T
        return rms(x[:, -1], fn) @ head.T

    def sdpa(q, k, v, mask):  # PyTorch's fused attention; by hand where it has none (Debian's 1.x)
        if hasattr(F, "scaled_dot_product_attention"):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(hd)
        return torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1) @ v

    def sync():
        if dev == "cuda":
            torch.cuda.synchronize()

    step = forward
    if dev == "cuda" and not args.eager:
        step = torch.compile(forward, mode="reduce-overhead", dynamic=False)

    def generate(B):
        kc = torch.zeros(L, B, G, T, hd, device=dev, dtype=dtype)
        vc = torch.zeros_like(kc)
        prompt = torch.randint(0, V, (B, args.prompt), device=dev)
        with torch.inference_mode():
            sync()
            t0 = time.perf_counter()
            nxt = forward(prompt, torch.arange(args.prompt, device=dev), kc, vc).argmax(-1)
            sync()
            t1 = time.perf_counter()
            for i in range(args.new - 1):
                p = torch.tensor([args.prompt + i], device=dev)
                nxt = step(nxt[:, None], p, kc, vc).argmax(-1)
            sync()
            t2 = time.perf_counter()
        return B * args.prompt / (t1 - t0), B * (args.new - 1) / (t2 - t1)

    try:
        generate(1)  # warm-up, compiles
        prefill_b1, decode_b1 = generate(1)
        generate(16)
        _, decode_b16 = generate(16)
    except Exception as e:  # noqa: BLE001 -- report whatever failed, the table still prints
        return {"error": [f"{type(e).__name__}: {e}"[:400]]}
    return {"prefill_b1": prefill_b1, "decode_b1": decode_b1, "decode_b16": decode_b16,
            "compiled": step is not forward}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--build", default=os.path.join(ROOT, "build-gpu"))
    ap.add_argument("--config", default=os.path.join(ROOT, "configs", "llama3_8b.toml"))
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--kv", default="bf16")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="a 2-layer model (a CPU smoke run)")
    ap.add_argument("--eager", action="store_true", help="PyTorch without torch.compile")
    ap.add_argument("--timeout", type=float, default=420)
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "gpu_decode_bench.json"))
    args = ap.parse_args()
    s = shape(args)
    loom32 = run_loom(args, s, False)
    loom = run_loom(args, s, True)
    torch_r = run_torch(args, s)
    print(f"\nLlama-3-8B-shaped{' (tiny)' if args.tiny else ''}, {args.prompt} prompt + {args.new} new tokens, "
          f"device {args.device}, Loom's KV cache {args.kv}, greedy")
    print(f"{'tokens/s':28} {'Loom f32':>10} {'Loom bf16':>10} {'PyTorch':>10} {'bf16 / PyTorch':>15}")
    for key, label in (("prefill_b1", "prefill, batch 1"), ("decode_b1", "decode, batch 1"), ("decode_b16", "decode, batch 16")):
        f, a, b = loom32.get(key), loom.get(key), torch_r.get(key)
        ratio = f"{a / b:15.2f}" if a and b else "              -"
        nan = float("nan")
        print(f"{label:28} {f if f else nan:10.1f} {a if a else nan:10.1f} {b if b else nan:10.1f} {ratio}")
    for name, r in (("loom f32", loom32), ("loom bf16", loom), ("pytorch", torch_r)):
        if "error" in r:
            print(f"{name} failed:", *r["error"], sep="\n  ")
    with open(args.out, "w") as f:
        json.dump({"shape": s, "loom_f32": loom32, "loom_bf16": loom, "pytorch": torch_r, "args": vars(args)}, f,
                  indent=1)
    return 1 if "error" in loom32 or "error" in loom or "error" in torch_r else 0


if __name__ == "__main__":
    sys.exit(main())
