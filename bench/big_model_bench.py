#!/usr/bin/python3
"""Big models on a small machine: a Llama-shaped Hugging Face folder of random bf16 weights, and
what Loom's inference paths cost on it (docs/memory.md "Inference in the checkpoint's dtype").

    /usr/bin/python3 bench/big_model_bench.py --loom build/bin/loom --out /tmp/big --shape 1b

Shapes (Llama 3's vocabulary of 128,256 tokens, untied head, GQA with 8 KV heads):
    8b     Llama-3-8B: 32 layers, d 4096, SwiGLU 14336 (8.0B parameters, 16 GB of bf16; not in CI)
    8b4    Llama-3-8B's widths with 4 layers (1.9B parameters): a streamed quantization's peak equals
           the 8B's (one block at a time), its time is about an eighth of the blocks' share
    1b     Llama-3.2-1B's layers with an untied head (1.5B parameters, 3.0 GB)
    small  4 layers, d 256 (a quick check of the script)
    ci     12 layers, d 256, 4,096 tokens (tests/cli_test.py's memory assertions)

The folder is written once (reused when its config.json matches). Then, for the linear weights
used in place (bf16, the default) and widened to f32 (--f32-weights): `loom bench generate` (one
stream, greedy, 16 prompt + 16 new tokens, 2 requests) under /usr/bin/time, printing peak RSS,
prefill and decode tokens/s, and the ratio of the two paths. A path whose f32 weights would not
fit in the machine's available memory is skipped with the bytes it needs. The folder has a
byte-level tokenizer.json (no merges; its vocabulary padded to the model's) for calibration text.

--quantize rtn|gptq|awq also runs `loom quantize` on the folder (streamed block by block: its
printed plan, measured peak RSS, time and file size) and `bench generate` on its output.
--qlora STEPS also trains QLoRA from the folder (`loom train`, peft.quantize_base: the block
matrices quantized to NF4 while reading, rank 16, full recompute, --qlora-seq tokens a step,
the default corpus in byte tokens): time and peak RSS, the final checkpoint included.
llama.cpp on the same weights (GGUF) is not run yet: `loom convert --to gguf` reads the model in f32.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))
from make_hf_fixtures import write_safetensors  # noqa: E402
from compression_bench import bytes_to_unicode  # noqa: E402  (GPT-2's byte alphabet)

SHAPES = {
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256),
    # Llama-3-8B's widths with 4 of its 32 layers: the same peak as the whole model for a streamed
    # quantization (one block at a time) in an eighth of the time
    "8b4": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=4, num_attention_heads=32,
                num_key_value_heads=8, vocab_size=128256),
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256),
    "small": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=32000),
    # tests/cli_test.py: deep against its vocabulary, so one block is a small part of the model
    "ci": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=12, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=4096),
}


def config_of(shape: str) -> dict:
    s = SHAPES[shape]
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
            "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
            "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False, "bos_token_id": 1,
            "eos_token_id": 2, "torch_dtype": "bfloat16", "transformers_version": "4.44.0", **s}


def write_folder(path: str, cfg: dict) -> int:
    """Writes config.json and one safetensors shard per layer (plus one for the ends); returns the bytes."""
    config_path = os.path.join(path, "config.json")
    if os.path.exists(config_path) and json.load(open(config_path)) == cfg:
        return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".safetensors"))
    os.makedirs(path, exist_ok=True)
    gen = torch.Generator().manual_seed(7)
    d, f, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    hd = d // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * hd

    def rand(*shape):
        return (torch.randn(*shape, generator=gen) * 0.02).to(torch.bfloat16)

    shards = layers + 1
    weight_map, total = {}, 0
    for s in range(shards):
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        if s < layers:
            p = f"model.layers.{s}."
            t = {p + "input_layernorm.weight": torch.ones(d, dtype=torch.bfloat16),
                 p + "post_attention_layernorm.weight": torch.ones(d, dtype=torch.bfloat16),
                 p + "self_attn.q_proj.weight": rand(d, d), p + "self_attn.k_proj.weight": rand(kv, d),
                 p + "self_attn.v_proj.weight": rand(kv, d), p + "self_attn.o_proj.weight": rand(d, d),
                 p + "mlp.gate_proj.weight": rand(f, d), p + "mlp.up_proj.weight": rand(f, d),
                 p + "mlp.down_proj.weight": rand(d, f)}
        else:
            t = {"model.embed_tokens.weight": rand(cfg["vocab_size"], d),
                 "model.norm.weight": torch.ones(d, dtype=torch.bfloat16),
                 "lm_head.weight": rand(cfg["vocab_size"], d)}
        write_safetensors(os.path.join(path, file), t)
        total += os.path.getsize(os.path.join(path, file))
        weight_map.update({n: file for n in t})
        del t
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as fh:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, fh, indent=2)
    write_tokenizer(path, cfg["vocab_size"])
    with open(config_path, "w") as fh:  # last: a folder with its config.json is complete
        json.dump(cfg, fh, indent=2)
    return total


def write_tokenizer(path: str, vocab_size: int) -> None:
    """A byte-level BPE tokenizer.json without merges (every byte its own token) whose vocabulary
    is padded to the model's with unreachable two- and three-character entries and ends with
    <|end_of_text|>, so the random
    folder has a tokenizer (calibration text for gptq/awq, eval --text, generate)."""
    byte_char = bytes_to_unicode()
    alphabet = [byte_char[b] for b in range(256)]
    vocab = {c: i for i, c in enumerate(alphabet)}
    for a in alphabet:
        for b in alphabet:
            for c in [""] + alphabet:
                if len(vocab) >= vocab_size - 1:
                    break
                vocab.setdefault(a + b + c, len(vocab))
    eos = {"id": vocab_size - 1, "content": "<|end_of_text|>", "single_word": False, "lstrip": False, "rstrip": False,
           "normalized": False, "special": True}
    tok = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": [eos], "normalizer": None,
           "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
           "post_processor": None,
           "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
           "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                     "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "vocab": vocab, "merges": []}}
    with open(os.path.join(path, "tokenizer.json"), "w") as fh:
        json.dump(tok, fh)


def available_bytes() -> int:
    with open("/proc/meminfo") as fh:
        for line in fh:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def run_generate(loom: str, folder: str, f32: bool) -> dict:
    cmd = ["/usr/bin/time", "-f", "peak_rss_kib %M", loom, "bench", "generate", "--checkpoint", folder, "--requests", "2",
           "--prompt-tokens", "16", "--new-tokens", "16", "--max-batch", "1"] + (["--f32-weights"] if f32 else [])
    p = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "2"})
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{p.stdout}\n{p.stderr}")
    m = re.search(r"prefill\s+([\d.]+) prompt tokens/s.*decode\s+([\d.]+) tokens/s", p.stdout)
    rss = re.search(r"peak_rss_kib (\d+)", p.stderr)
    return {"prefill": float(m.group(1)), "decode": float(m.group(2)), "peak_rss": int(rss.group(1)) * 1024}


def run_quantize(loom: str, folder: str, out: str, method: str, calib: str, calib_tokens: int, extra: list[str]) -> dict:
    cmd = ["/usr/bin/time", "-f", "peak_rss_kib %M", loom, "quantize", "--checkpoint", folder, "--out", out,
           "--method", method, "--bits", "4"] + extra
    if method in ("gptq", "awq"):
        cmd += ["--calib", calib, "--calib-tokens", str(calib_tokens)]
    p = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "2"})
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{p.stdout}\n{p.stderr}")
    planned = re.search(r"planned peak host memory ([\d.]+) GiB", p.stdout)
    seconds = re.search(r"; ([\d.]+) s\n", p.stdout)
    rss = re.search(r"peak_rss_kib (\d+)", p.stderr)
    size = os.path.getsize(os.path.join(out, "model.safetensors"))
    return {"planned": float(planned.group(1)) * 2**30, "seconds": float(seconds.group(1)),
            "peak_rss": int(rss.group(1)) * 1024, "file": size}


def run_qlora(loom: str, folder: str, out: str, steps: int, seq: int) -> dict:
    """A QLoRA run from the folder: `steps` steps of one sequence of `seq` bytes (byte tokens, the
    default corpus), LoRA rank 16 on every block matrix, full recompute; no checkpoint but the final one."""
    sets = (f"train.init_from={folder},peft.method=lora,peft.rank=16,peft.alpha=32,"
            f"peft.targets=\"q,k,v,o,gate,up,down\",peft.quantize_base=true,train.steps={steps},train.batch_size=1,"
            f"train.seq_len={seq},train.eval_every=0,train.recompute=full,sample.max_new_tokens=0,data.tokenizer={folder},"
            f"data.dir={out}/data,"
            f"run.dir={out}/runs,run.name=qlora")
    if not os.path.exists(os.path.join(out, "data", "meta.json")):
        subprocess.run([loom, "prepare", "--tokenizer", folder, "--out", os.path.join(out, "data")], check=True,
                       capture_output=True)
    cmd = ["/usr/bin/time", "-f", "peak_rss_kib %M", loom, "train", "--overwrite", "--set", sets]
    start = time.time()
    p = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "2"})
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{p.stdout}\n{p.stderr}")
    rss = re.search(r"peak_rss_kib (\d+)", p.stderr)
    head = re.search(r"QLoRA: .*", p.stdout)
    return {"seconds": time.time() - start, "peak_rss": int(rss.group(1)) * 1024, "report": head.group(0) if head else ""}


def baseline_rss(loom: str) -> int:
    """The process's own resident bytes (the binary and its libraries) before any model."""
    p = subprocess.run(["/usr/bin/time", "-f", "peak_rss_kib %M", loom, "quantize", "--help"], capture_output=True, text=True)
    return int(re.search(r"peak_rss_kib (\d+)", p.stderr).group(1)) * 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--loom", default=os.path.join(ROOT, "build", "bin", "loom"))
    ap.add_argument("--out", required=True, help="where the folder is written (reused)")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="1b")
    ap.add_argument("--quantize", default="", help="also quantize the folder: rtn | gptq | awq (4 bits, group 128)")
    ap.add_argument("--calib", default=os.path.join(ROOT, "README.md"), help="calibration text (gptq, awq)")
    ap.add_argument("--calib-tokens", type=int, default=2048)
    ap.add_argument("--compact", action="store_true", help="--scales f16 --symmetric --group 32 (Q4_0's bytes)")
    ap.add_argument("--skip-generate", action="store_true", help="only the quantize run and its folder's decode")
    ap.add_argument("--qlora", type=int, default=0, metavar="STEPS", help="also a QLoRA run of STEPS steps from the folder")
    ap.add_argument("--qlora-seq", type=int, default=512)
    args = ap.parse_args()
    cfg = config_of(args.shape)
    folder = os.path.join(args.out, f"llama_{args.shape}_bf16")
    file_bytes = write_folder(folder, cfg)
    params = file_bytes // 2
    print(f"{folder}: {params / 1e9:.2f}B parameters, {file_bytes / 2**30:.2f} GiB of bf16 safetensors")
    if args.quantize:
        qdir = folder + f"_{args.quantize}" + ("_compact" if args.compact else "")
        extra = ["--scales", "f16", "--symmetric", "--group", "32"] if args.compact else ["--group", "128"]
        q = run_quantize(args.loom, folder, qdir, args.quantize, args.calib, args.calib_tokens, extra)
        base = baseline_rss(args.loom)
        g = run_generate(args.loom, qdir, False)
        print(f"\nquantize --method {args.quantize} --bits 4 {' '.join(extra)} (calibration {args.calib_tokens} tokens): "
              f"{q['seconds']:.0f} s, peak RSS {q['peak_rss'] / 2**30:.2f} GiB ({(q['peak_rss'] - base) / 2**30:.2f} above "
              f"the process's own {base / 2**20:.0f} MiB; planned {q['planned'] / 2**30:.2f}), "
              f"model.safetensors {q['file'] / 2**30:.2f} GiB ({q['file'] / file_bytes:.2f} of the bf16 file)")
        print(f"its folder, bench generate: peak RSS {g['peak_rss'] / 2**30:.2f} GiB, prefill {g['prefill']:.1f}, "
              f"decode {g['decode']:.1f} tokens/s")
    if args.qlora:
        r = run_qlora(args.loom, folder, os.path.join(args.out, "qlora"), args.qlora, args.qlora_seq)
        print(f"\nQLoRA, {args.qlora} steps of {args.qlora_seq} tokens (rank 16, full recompute, the final checkpoint "
              f"included): {r['seconds']:.0f} s, peak RSS {r['peak_rss'] / 2**30:.2f} GiB\n  {r['report']}")
    if args.skip_generate:
        return
    rows = []
    for label, f32 in (("bf16 in place", False), ("f32 (--f32-weights)", True)):
        need = params * 4 if f32 else file_bytes
        if need > 0.9 * available_bytes():
            rows.append((label, None, f"skipped: its weights need {need / 2**30:.1f} GiB, "
                                      f"{available_bytes() / 2**30:.1f} GiB available"))
            continue
        rows.append((label, run_generate(args.loom, folder, f32), ""))
    print("\n| linear weights | peak RSS (GiB) | RSS / file | prefill tok/s | decode tok/s |")
    print("|---|---|---|---|---|")
    for label, r, note in rows:
        if r is None:
            print(f"| {label} | {note} | | | |")
        else:
            print(f"| {label} | {r['peak_rss'] / 2**30:.2f} | {r['peak_rss'] / file_bytes:.2f} | {r['prefill']:.1f} | "
                  f"{r['decode']:.1f} |")
    if rows[0][1] and rows[1][1]:
        a, b = rows[0][1], rows[1][1]
        print(f"\nbf16 in place / f32: peak RSS {a['peak_rss'] / b['peak_rss']:.2f}x, decode {a['decode'] / b['decode']:.2f}x, "
              f"prefill {a['prefill'] / b['prefill']:.2f}x")


if __name__ == "__main__":
    main()
