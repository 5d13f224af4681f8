#!/usr/bin/python3
"""`loom plan --hardware` against published layouts: the Llama 3 405B runs (Llama Team 2024,
"The Llama 3 Herd of Models", Table 4) and Megatron-LM's weak-scaling table (Narayanan et al.
2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", SC21,
Table 1). For each published row it runs

    loom plan --hardware configs/hardware/<cluster>.toml --config configs/published/<model>.toml \
        --global-batch <sequences> --all --top 100000

parses every layout the planner lists, finds the published layout among them and prints one
Markdown table (docs/memory.md, "The planner against published layouts"). Standard library
only:

    tools/planner_vs_published.py [--loom PATH] [--rows llama|megatron|all]

(--loom defaults to build/bin/loom in the repository; 20-30 s on 2 cores).

Columns:
  published          the paper's TFLOP/s per GPU and % of peak, as printed
  pub. MFU           the published rate in Loom's FLOP count (arch/config.h train_flops_per_token:
                     6 x matmul parameters + 12 L d T per token, no recompute). Megatron's
                     TFLOP/s count 96 B s l h^2 (1 + s/6h + V/16lh) per step (the recompute
                     forward included), so they are scaled by Loom's count over that one; Llama
                     3's is its TFLOP/s over the peak (430 / 989 = 43.5%, printed 43%).
  planner's pick     the planner's first layout that fits (dp x tp x pp x cp, schedule) and its MFU;
                     when nothing fits, the fastest layout ignoring memory, marked "(no fit)"
  published layout   the planner's best-ranked variant of the published dp x tp x pp x cp (the
                     schedule, ZeRO stage and recompute policy the row states where the planner
                     can express them), its bytes per device and whether they fit
  rank               its rank among the layouts that fit ("-" when it does not fit), and among
                     distinct dp x tp x pp x cp shapes, each by its fastest variant: the shapes
                     that fit when the published layout fits, else all of them (memory ignored)
  step vs pick       its estimated step time over the pick's, less 1
  predicted          the planner's MFU for the published layout, and over the published MFU
"""
import argparse
import os
import re
import subprocess
import sys
import tomllib

# One published row: the cluster file, the model config, sequences per step, the layout, the
# published rate, and what the paper states about schedule / ZeRO / recompute.
#   recompute: the policies to look for, in order (the first one the planner lists is used)
#   zero: ZeRO stages allowed (None = any)
#   schedule: pipeline schedules allowed (None = any)
ROWS = [
    # Llama 3 405B, Table 4. FSDP shards gradients and optimizer state (ZeRO-2 like); the planner
    # composes at most ZeRO-1 with pp > 1, so any stage is accepted. Interleaved pipeline
    # schedule; no activation checkpointing at 8K (section 3.3.2).
    dict(group="llama", name="Llama 3 405B, 8K, 8,192 GPUs", hw="h100_llama3_8192gpus", cfg="llama3_405b",
         batch=2048, tp=8, pp=16, cp=1, dp=64, tflops=430, pct=43, recompute=["none"], zero=None,
         schedule=["interleaved"]),
    dict(group="llama", name="Llama 3 405B, 8K, 16,384 GPUs", hw="h100_llama3_16384gpus", cfg="llama3_405b",
         batch=2048, tp=8, pp=16, cp=1, dp=128, tflops=400, pct=41, recompute=["none"], zero=None,
         schedule=["interleaved"]),
    dict(group="llama", name="Llama 3 405B, 128K, 16,384 GPUs", hw="h100_llama3_16384gpus", cfg="llama3_405b_131k",
         batch=128, tp=8, pp=16, cp=16, dp=8, tflops=380, pct=38, recompute=["none", "selective", "full"], zero=None,
         schedule=["interleaved"]),
]
# Megatron-LM Table 1: (params B, GPUs, batch, t, p, TFLOP/s, % of peak). No ZeRO in 2021's
# Megatron. Its FLOP count includes the recompute forward of full activation recomputation, which
# the planner refuses with tp or pp > 1 (memory/estimate.cpp check_plan), so every row is taken
# without recompute, alike (the 1.7B row's recompute-full variant is quoted in docs/memory.md).
# The schedule is not stated in the table: any.
for params, gpus, batch, t, p, tflops, pct in [
        ("1.7", 32, 512, 1, 1, 137, 44), ("3.6", 64, 512, 2, 1, 138, 44), ("7.5", 128, 512, 4, 1, 142, 46),
        ("18.4", 256, 1024, 8, 1, 135, 43), ("39.1", 512, 1536, 8, 2, 138, 44), ("76.1", 1024, 1792, 8, 4, 140, 45),
        ("145.6", 1536, 2304, 8, 8, 148, 47), ("310.1", 1920, 2160, 8, 16, 155, 50),
        ("529.6", 2520, 2520, 8, 35, 163, 52), ("1008", 3072, 3072, 8, 64, 163, 52)]:
    ROWS.append(dict(group="megatron", name=f"Megatron GPT {params}B, {gpus:,} GPUs", hw=f"selene_a100_{gpus}gpus",
                     cfg=f"megatron_gpt_{params}b", batch=batch, tp=t, pp=p, cp=1, dp=gpus // (t * p), tflops=tflops,
                     pct=pct, recompute=["none"], zero=[0], schedule=None))

ROW_RE = re.compile(
    r"^\s*(?P<rank>\d+)\s+dp (?P<dp>\d+) x tp (?P<tp>\d+)(?:\+sp)? x pp (?P<pp>\d+)"
    r"(?: \((?P<sched>[\w-]+)(?: v(?P<v>\d+))?\))? x cp (?P<cp>\d+)(?: x ep (?P<ep>\d+))?, ZeRO-(?P<zero>\d), "
    r"recompute (?P<recompute>\S+), (?P<micro>\d+) micro-batch(?:es)?\s+(?P<mem>[\d.]+) (?P<unit>[KMGT]?i?B)\s+"
    r"(?P<step>[\d.e+-]+)\s+(?P<tps>[\d.e+-]+)\s+(?P<mfu>[\d.]+)%")
FIT_RE = re.compile(r"^(\d+) of (\d+) layouts fit")
UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}


def die(msg):
    print(f"planner_vs_published.py: error: {msg}", file=sys.stderr)
    sys.exit(2)


def run_plan(loom, row):
    hw = f"configs/hardware/{row['hw']}.toml"
    cfg = f"configs/published/{row['cfg']}.toml"
    cmd = [loom, "plan", "--hardware", hw, "--config", cfg, "--global-batch", str(row["batch"]), "--all",
           "--top", "100000"]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        die(f"{' '.join(cmd)} exited {out.returncode}: {(out.stderr or out.stdout).strip().splitlines()[-1:]}")
    fits = total = None
    layouts = []
    for line in out.stdout.splitlines():
        if (m := FIT_RE.match(line)):
            fits, total = int(m.group(1)), int(m.group(2))
        elif (m := ROW_RE.match(line)):
            d = m.groupdict()
            layouts.append(dict(rank=int(d["rank"]), dp=int(d["dp"]), tp=int(d["tp"]), pp=int(d["pp"]),
                                cp=int(d["cp"]), sched=d["sched"] or "-", v=int(d["v"] or 1), zero=int(d["zero"]),
                                recompute=d["recompute"], micro=int(d["micro"]),
                                mem_gib=float(d["mem"]) * UNITS[d["unit"]] / 2**30, step=float(d["step"]),
                                mfu=float(d["mfu"])))
    if fits is None:
        die(f"could not parse the output of {' '.join(cmd)}")
    if len(layouts) != total:
        die(f"{' '.join(cmd)}: parsed {len(layouts)} of {total} layouts")
    for i, l in enumerate(layouts):
        l["fits"] = i < fits
    return fits, total, layouts


def loom_flops_per_token(cfg):
    """arch/config.cpp train_flops_per_token for a dense model without a window."""
    m = cfg["model"]
    C, L, T, V = m["d_model"], m["n_layer"], cfg["train"]["seq_len"], m["vocab_size"]
    hd = C // m["n_head"]
    kv = m.get("n_kv_head", m["n_head"])
    gated = m.get("arch") == "llama"
    attention = C * (C + 2 * kv * hd) + C * C
    mlp = (2 if gated else 1) * m["d_ff"] * C + m["d_ff"] * C
    return 6.0 * (V * C + L * (attention + mlp)) + 12.0 * L * C * T


def megatron_flops_per_token(cfg):
    """Narayanan et al. 2021, eq. 3 over B s: 96 l h^2 (1 + s/(6h) + V/(16 l h))."""
    m = cfg["model"]
    h, l, s, V = m["d_model"], m["n_layer"], cfg["train"]["seq_len"], m["vocab_size"]
    return 96.0 * l * h * h * (1 + s / (6 * h) + V / (16 * l * h))


def shape(l):
    return (l["dp"], l["tp"], l["pp"], l["cp"])


def describe(l):
    s = f"tp {l['tp']} x pp {l['pp']} x dp {l['dp']}"
    if l["cp"] > 1:
        s += f" x cp {l['cp']}"
    if l["pp"] > 1:
        s += f", {l['sched']}" + (f" v{l['v']}" if l["v"] > 1 else "")
    if l["recompute"] != "none":
        s += f", recompute {l['recompute']}"
    return s


def published_variant(row, layouts):
    cands = [l for l in layouts if shape(l) == (row["dp"], row["tp"], row["pp"], row["cp"])]
    if row["zero"] is not None:
        cands = [l for l in cands if l["zero"] in row["zero"]]
    if row["schedule"] is not None and row["pp"] > 1:
        cands = [l for l in cands if l["sched"] in row["schedule"]]
    for policy in row["recompute"]:
        hit = [l for l in cands if l["recompute"] == policy]
        if hit:
            return hit[0], policy != row["recompute"][0]  # the planner's order: fitting first, by step time
    return None, False


def analyse(row, loom):
    with open(f"configs/published/{row['cfg']}.toml", "rb") as f:
        cfg = tomllib.load(f)
    with open(f"configs/hardware/{row['hw']}.toml", "rb") as f:
        peak = tomllib.load(f)["hardware"]["peak_tflops"]
    fits, total, layouts = run_plan(loom, row)
    r = dict(row=row, fits=fits, total=total)
    if row["group"] == "megatron":
        r["pub_mfu"] = 100.0 * row["tflops"] * loom_flops_per_token(cfg) / megatron_flops_per_token(cfg) / peak
    else:
        r["pub_mfu"] = 100.0 * row["tflops"] / peak
    if fits:
        r["pick"], r["pick_fits"] = layouts[0], True
    elif layouts:
        r["pick"], r["pick_fits"] = min(layouts, key=lambda l: l["step"]), False
    else:
        r["pick"] = None
    pub, fallback = published_variant(row, layouts)
    r["pub"], r["fallback"] = pub, fallback
    if pub is not None:
        # Shapes (dp x tp x pp x cp) by their fastest variant: among the layouts that fit when the
        # published one fits, else among all, memory ignored.
        shapes = {}
        for l in layouts:
            if l["fits"] or not pub["fits"]:
                shapes[shape(l)] = min(shapes.get(shape(l), 1e300), l["step"])
        r["rank_fit"] = pub["rank"] if pub["fits"] else None
        r["shape_rank"] = 1 + sum(1 for s, t in shapes.items() if s != shape(pub) and t < pub["step"])
        r["shapes"] = len(shapes)
        r["peak"] = peak
    return r


def table(results):
    out = ["| published row | published: TFLOP/s per GPU (% of peak) | pub. MFU, Loom FLOPs | layouts fit / listed "
           "| planner's pick (MFU) | published layout in the planner (memory per device) | rank: layouts / shapes "
           "| its step vs the pick's | predicted MFU (TFLOP/s) | predicted / published |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        row = r["row"]
        lay = f"tp {row['tp']} x pp {row['pp']} x dp {row['dp']}" + (f" x cp {row['cp']}" if row["cp"] > 1 else "")
        pub_txt = f"{row['tflops']} ({row['pct']}%)"
        if r["pick"] is None:
            pick = "nothing listed"
        else:
            pick = f"{describe(r['pick'])} ({r['pick']['mfu']:.1f}%)" + ("" if r["pick_fits"] else " (no fit)")
        p = r["pub"]
        if p is None:
            cells = [f"{lay}: not listed", "-", "-", "-", "-"]
        else:
            mem = f"{p['mem_gib']:.0f} GiB" + (", fits" if p["fits"] else ", does not fit")
            note = " (recompute refused with tp/pp: none)" if r["fallback"] else ""
            rank_fit = f"{r['rank_fit']} of {r['fits']}" if r["rank_fit"] else "-"
            pool = "" if p["fits"] else " (memory ignored)"
            cells = [f"{describe(p)}{note} ({mem})", f"{rank_fit} / {r['shape_rank']} of {r['shapes']}{pool}",
                     f"{100 * (p['step'] / r['pick']['step'] - 1):+.1f}%",
                     f"{p['mfu']:.1f}% ({p['mfu'] * r['peak'] / 100:.0f})", f"{p['mfu'] / r['pub_mfu']:.2f}"]
        out.append(f"| {row['name']}, {lay}, {row['batch']} x {row_seq(row)} | {pub_txt} | {r['pub_mfu']:.1f}% | "
                   f"{r['fits']} / {r['total']} | {pick} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def row_seq(row):
    with open(f"configs/published/{row['cfg']}.toml", "rb") as f:
        return tomllib.load(f)["train"]["seq_len"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--loom", default=None, help="the loom binary (default: build/bin/loom in the repository)")
    ap.add_argument("--rows", default="all", choices=["all", "llama", "megatron"], help="which published rows")
    args = ap.parse_args()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    loom = os.path.abspath(args.loom) if args.loom else os.path.join(root, "build", "bin", "loom")
    if not (os.path.isfile(loom) and os.access(loom, os.X_OK)):
        die(f"no loom binary at {loom} (build it, or pass --loom PATH)")
    os.chdir(root)  # the configs' paths are the repository's
    results = [analyse(row, loom) for row in ROWS if args.rows in ("all", row["group"])]
    print(table(results))


if __name__ == "__main__":
    main()
