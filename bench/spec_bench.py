#!/usr/bin/python3
"""Speculative decoding with a draft model: decode tokens/s at batch 1, the target alone against
the target with the draft (`loom bench generate --draft`), alternating, in one script.

    /usr/bin/python3 bench/spec_bench.py --loom build/bin/loom --draft runs/default --out /tmp/spec

The pair. --draft is a trained checkpoint (default: the default run's GPT-2, 6 layers, d 256,
5.8M parameters, on the fortunes corpus). The target is built from it, five times its size: the
draft's embeddings and 6 trained blocks followed by --extra blocks (default 30: 29.4M
parameters) of GPT-2's random initialisation (N(0, 0.02)) whose two output projections
(attention c_proj and MLP c_proj) are scaled by --perturb (default 1.5), so every block runs (the
target's forward costs what a trained 36-layer model's does) and changes the logits: the draft
agrees often but not always, as a draft distilled from its target does. The acceptance rate is
measured and printed, never assumed; docs/serving.md gives the speed-up against it.

Each round runs `loom bench generate` on the target (greedy, --max-batch 1, --requests prompts of
--prompt-tokens validation tokens + --new-tokens new ones) twice, with and without `--draft
--speculate K`, the order swapped every round; printed: the single-stream decode tokens/s of each
(after the first token), their median ratio, the acceptance rate and the draft's share of the
time. Then `loom generate --prompts` on --prompts prompts (default 50: the first lines of Debian's
fortunes, greedy, 48 tokens) with and without the draft: the texts must be the same, prompt by
prompt (the script exits non-zero otherwise).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))
from make_hf_fixtures import write_safetensors  # noqa: E402
from loom_reference import read_safetensors  # noqa: E402


def build_target(draft_hf: str, target: str, extra: int, perturb: float, seed: int) -> tuple[int, int]:
    cfg = json.load(open(os.path.join(draft_hf, "config.json")))
    tensors, _ = read_safetensors(os.path.join(draft_hf, "model.safetensors"))
    n, d, f = cfg["n_layer"], cfg["n_embd"], cfg.get("n_inner") or 4 * cfg["n_embd"]
    g = torch.Generator().manual_seed(seed)
    out = dict(tensors)
    prefix = "transformer." if any(k.startswith("transformer.") for k in tensors) else ""

    def normal(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.02 * scale

    for layer in range(n, n + extra):
        p = f"{prefix}h.{layer}."
        out[p + "ln_1.weight"], out[p + "ln_1.bias"] = torch.ones(d), torch.zeros(d)
        out[p + "ln_2.weight"], out[p + "ln_2.bias"] = torch.ones(d), torch.zeros(d)
        out[p + "attn.c_attn.weight"], out[p + "attn.c_attn.bias"] = normal(d, 3 * d), torch.zeros(3 * d)
        out[p + "attn.c_proj.weight"], out[p + "attn.c_proj.bias"] = normal(d, d, scale=perturb), torch.zeros(d)
        out[p + "mlp.c_fc.weight"], out[p + "mlp.c_fc.bias"] = normal(d, f), torch.zeros(f)
        out[p + "mlp.c_proj.weight"], out[p + "mlp.c_proj.bias"] = normal(f, d, scale=perturb), torch.zeros(d)
    # The final norm must come after the last block: keep the draft's (ln_f), it is already there.
    os.makedirs(target, exist_ok=True)
    cfg["n_layer"] = n + extra
    json.dump(cfg, open(os.path.join(target, "config.json"), "w"), indent=2)
    write_safetensors(os.path.join(target, "model.safetensors"), {k: v.contiguous() for k, v in out.items()})
    for name in os.listdir(draft_hf):
        if name not in ("config.json", "model.safetensors"):
            shutil.copy(os.path.join(draft_hf, name), os.path.join(target, name))
    count = lambda ts: sum(t.numel() for k, t in ts.items() if not k.endswith("attn.bias") and not k.endswith("masked_bias"))
    return count(tensors), count(out)


def bench(loom: str, target: str, draft: str | None, k: int, args) -> dict:
    cmd = [loom, "bench", "generate", "--checkpoint", target, "--max-batch", "1", "--requests", str(args.requests),
           "--prompt-tokens", str(args.prompt_tokens), "--new-tokens", str(args.new_tokens)]
    if draft:
        cmd += ["--draft", draft, "--speculate", str(k), "--draft-p-min", str(args.draft_p_min)]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    if r.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{r.stdout}\n{r.stderr}")
    decode = float(re.search(r"decode\s+([\d.]+) tokens/s", r.stdout).group(1))
    out = {"decode": decode}
    m = re.search(r"(\d+) drafted, (\d+) accepted \(([\d.]+)%\).*?([\d.]+) s of its ([\d.]+) s in the draft", r.stdout)
    if m:
        out.update(drafted=int(m.group(1)), accepted=int(m.group(2)), draft_s=float(m.group(4)), total_s=float(m.group(5)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--loom", default=os.path.join(ROOT, "build/bin/loom"))
    ap.add_argument("--draft", default=os.path.join(ROOT, "runs/default"), help="a trained Loom checkpoint (GPT-2)")
    ap.add_argument("--out", default="/tmp/spec_bench")
    ap.add_argument("--extra", type=int, default=30)
    ap.add_argument("--perturb", type=float, default=1.5)
    ap.add_argument("--draft-p-min", type=float, default=0.0)
    ap.add_argument("--prompts", type=int, default=50)
    ap.add_argument("--speculate", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    if not os.path.isdir(args.draft):
        sys.exit(f"--draft {args.draft}: no such checkpoint (scripts/run trains runs/default)")
    draft_hf, target = os.path.join(args.out, "draft"), os.path.join(args.out, "target")
    shutil.rmtree(args.out, ignore_errors=True)
    os.makedirs(args.out)
    subprocess.run([args.loom, "convert", "--to", "hf", "--checkpoint", args.draft, "--out", draft_hf], check=True,
                   capture_output=True)
    small, big = build_target(draft_hf, target, args.extra, args.perturb, 1)
    print(f"draft {small:,} parameters ({args.draft}), target {big:,} ({big / small:.2f}x: the draft's blocks + "
          f"{args.extra} random blocks, output projections x {args.perturb}); {args.requests} prompts of "
          f"{args.prompt_tokens} validation tokens + {args.new_tokens} greedy, batch 1, {args.threads} threads, "
          f"--speculate {args.speculate}")
    alone, spec, ratios = [], [], []
    for rnd in range(args.rounds):
        pair = [None, draft_hf] if rnd % 2 == 0 else [draft_hf, None]
        results = {d: bench(args.loom, target, d, args.speculate, args) for d in pair}
        a, s = results[None], results[draft_hf]
        alone.append(a["decode"]), spec.append(s["decode"]), ratios.append(s["decode"] / a["decode"])
        print(f"round {rnd + 1}: target alone {a['decode']:.1f} tokens/s, with the draft {s['decode']:.1f} tokens/s "
              f"({ratios[-1]:.2f}x); {s['accepted']} of {s['drafted']} drafts accepted "
              f"({100 * s['accepted'] / max(s['drafted'], 1):.1f}%), {s['draft_s']:.2f} s of {s['total_s']:.2f} s in the draft")
    print(f"median: target alone {statistics.median(alone):.1f}, with the draft {statistics.median(spec):.1f} decode "
          f"tokens/s: {statistics.median(ratios):.2f}x")
    same_greedy(args, target, draft_hf)


def same_greedy(args, target: str, draft: str) -> None:
    lines = []
    for path in sorted(os.listdir("/usr/share/games/fortunes")):
        full = os.path.join("/usr/share/games/fortunes", path)
        if os.path.isfile(full) and not path.endswith(".dat") and not path.endswith(".u8"):
            lines += [x.strip() for x in open(full, errors="replace") if len(x.strip()) > 20 and x.strip() != "%"]
        if len(lines) >= args.prompts:
            break
    prompts = os.path.join(args.out, "prompts.txt")
    open(prompts, "w").write("\n".join(lines[: args.prompts]) + "\n")
    texts = {}
    for d in (None, draft):
        out = os.path.join(args.out, "draft.jsonl" if d else "alone.jsonl")
        cmd = [args.loom, "generate", "--checkpoint", target, "--prompts", prompts, "--greedy", "--tokens", "48", "--out", out]
        if d:
            cmd += ["--draft", d, "--speculate", str(args.speculate)]
        subprocess.run(cmd, check=True, capture_output=True, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS=str(args.threads)))
        texts[d] = [json.loads(x)["text"] for x in open(out)]
    same = sum(a == b for a, b in zip(texts[None], texts[draft]))
    print(f"greedy: {same} of {len(texts[None])} prompts the same text with the draft as without")
    if same != len(texts[None]):
        sys.exit("speculative decoding with the draft changed greedy output")


if __name__ == "__main__":
    main()
