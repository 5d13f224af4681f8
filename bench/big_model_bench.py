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
--lora-base bf16 makes that run LoRA over the base kept in bf16 only (precision.param = bf16: read
into the layers' bf16 copy one matrix at a time), without a checkpoint (train.save_checkpoints=false).
--llama-cpp compares decode speed with llama.cpp (node-llama-cpp's prebuilt CPU build through
tools/llama_speed.mjs) on the same weights. The folder is exported to GGUF (`loom convert --to gguf
--type T` for T in GGUF_TYPES: bf16, q8_0, q4_0; f16 where convert does not know bf16 yet) under
/usr/bin/time -v, printing each export's peak RSS and time (streamed: far below the model's size),
and Loom's same-bits models are made with `loom quantize --method rtn --group 32 --scales f16
--symmetric` (--bits 8 and 4: ggml's q8_0 and q4_0 are symmetric groups of 32 with f16 scales).
Existing GGUF files and quantized folders are reused. Then --rounds rounds, each running every
pair (Loom's bf16 folder in place / the bf16 GGUF, int8 / q8_0, int4 / q4_0) at every --threads
count, the two engines one after the other (their order swapped every round): Loom's single-stream
decode tokens/s and peak RSS from `bench generate` (16 prompt + --new-tokens tokens,
OMP_NUM_THREADS), llama.cpp's from the same 16 prompt token ids, greedy, one run. Printed: a table
of the medians per thread count and the best Loom / best llama.cpp ratio, with the CPU's model
name and whether it has AVX-512; every round's figures go to OUT/llama_cpp_results.json.
--skip-generate skips the bf16 / f32 table only (--quantize, --qlora and --llama-cpp still run).
--loom-base BIN adds another Loom binary (a build from before a change) to every round, as the
engine "loom base".
--busy-core C runs every --llama-cpp run beside a busy process (a shell loop pinned to core C,
started before and killed after each run, as bench/contention_bench.py does for training).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import statistics
import subprocess
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))
from make_hf_fixtures import write_safetensors  # noqa: E402
from compression_bench import bytes_to_unicode, shard_tokens  # noqa: E402  (GPT-2's byte alphabet)

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


PROMPT_TOKENS = 16  # bench generate's prompt here, and llama.cpp's in --llama-cpp


def available_bytes() -> int:
    with open("/proc/meminfo") as fh:
        for line in fh:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def run_generate(loom: str, folder: str, f32: bool, threads: int = 2, new_tokens: int = 16, wait: str = "") -> dict:
    cmd = ["/usr/bin/time", "-f", "peak_rss_kib %M", loom, "bench", "generate", "--checkpoint", folder, "--requests", "2",
           "--prompt-tokens", str(PROMPT_TOKENS), "--new-tokens", str(new_tokens), "--max-batch", "1"] + \
        (["--f32-weights"] if f32 else [])
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    if wait == "nospin":  # passive OpenMP waits, and the decoding team sleeps at once (core/threads.h)
        env.update(OMP_WAIT_POLICY="PASSIVE", LOOM_SPIN_US="0")
    elif wait:  # OpenMP's wait policy (Loom's default: PASSIVE, docs/performance.md)
        env["OMP_WAIT_POLICY"] = wait.upper()
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{p.stdout}\n{p.stderr}")
    m = re.search(r"prefill\s+([\d.]+) prompt tokens/s.*decode\s+([\d.]+) tokens/s", p.stdout)
    rss = re.search(r"peak_rss_kib (\d+)", p.stderr)
    return {"prefill": float(m.group(1)), "decode": float(m.group(2)), "peak_rss": int(rss.group(1)) * 1024}


def run_quantize(loom: str, folder: str, out: str, method: str, calib: str, calib_tokens: int, extra: list[str],
                 bits: int = 4) -> dict:
    cmd = ["/usr/bin/time", "-f", "peak_rss_kib %M", loom, "quantize", "--checkpoint", folder, "--out", out,
           "--method", method, "--bits", str(bits)] + extra
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


def run_qlora(loom: str, folder: str, out: str, steps: int, seq: int, base: str = "nf4") -> dict:
    """A QLoRA run from the folder: `steps` steps of one sequence of `seq` bytes (byte tokens, the
    default corpus), LoRA rank 16 on every block matrix, full recompute; no checkpoint but the final one.
    base = "bf16": LoRA over the base kept in bf16 only (precision.param = bf16), without a
    checkpoint (train.save_checkpoints = false: an 8B LoRA checkpoint holds the base in fp32, 32 GB)."""
    kind = "peft.quantize_base=true" if base == "nf4" else "precision.param=bf16,train.save_checkpoints=false"
    sets = (f"train.init_from={folder},peft.method=lora,peft.rank=16,peft.alpha=32,"
            f"peft.targets=\"q,k,v,o,gate,up,down\",{kind},train.steps={steps},train.batch_size=1,"
            f"train.seq_len={seq},train.eval_every=0,train.eval_batches=1,train.recompute=full,sample.max_new_tokens=0,"
            f"data.tokenizer={folder},"
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
    head = re.search(r"QLoRA: .*" if base == "nf4" else r"LoRA base in bf16 only: .*", p.stdout)
    return {"seconds": time.time() - start, "peak_rss": int(rss.group(1)) * 1024, "report": head.group(0) if head else ""}


# --llama-cpp: llama.cpp's GGUF types, each against Loom's model of the same bits (the bf16 folder
# itself, or `loom quantize --method rtn --bits B` + COMPACT: ggml's symmetric blocks of 32, f16 scales).
GGUF_TYPES = ["bf16", "q8_0", "q4_0"]
LOOM_OF_GGUF = {"bf16": ("bf16 in place", 0), "q8_0": ("rtn int8", 8), "q4_0": ("rtn int4", 4)}
COMPACT = ["--group", "32", "--scales", "f16", "--symmetric"]


def time_v(cmd: list[str], env: dict | None = None) -> tuple[subprocess.CompletedProcess, int, float]:
    """Runs cmd under /usr/bin/time -v: the process, its peak RSS in bytes and its wall seconds."""
    start = time.time()
    p = subprocess.run(["/usr/bin/time", "-v"] + cmd, capture_output=True, text=True, env=env)
    seconds = time.time() - start
    rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", p.stderr)
    return p, int(rss.group(1)) * 1024 if rss else 0, seconds


def fmt_bytes(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def folder_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".safetensors"))


def export_gguf(loom: str, folder: str, out_dir: str, gguf_type: str) -> dict:
    """`loom convert --to gguf --type gguf_type` of the folder into out_dir/model_TYPE.gguf, reused when
    it exists; bf16 falls back to f16 while convert does not know it. Returns what was written and measured."""
    os.makedirs(out_dir, exist_ok=True)
    tried = [gguf_type] + (["f16"] if gguf_type == "bf16" else [])
    for i, t in enumerate(tried):
        out = os.path.join(out_dir, f"model_{t}.gguf")
        if os.path.exists(out) and os.path.getsize(out) > 0:
            return {"asked": gguf_type, "type": t, "file": out, "bytes": os.path.getsize(out), "reused": True}
        cmd = [loom, "convert", "--to", "gguf", "--checkpoint", folder, "--out", out, "--type", t, "--tokenizer", folder]
        p, rss, seconds = time_v(cmd)
        if p.returncode == 0:
            return {"asked": gguf_type, "type": t, "file": out, "bytes": os.path.getsize(out), "reused": False,
                    "peak_rss": rss, "seconds": seconds}
        said = (p.stdout + p.stderr).lower()
        if i + 1 < len(tried) and t in said:  # convert does not accept this --type yet: the next one
            print(f"  convert --type {t} refused ({p.stderr.strip().splitlines()[0] if p.stderr.strip() else p.returncode}); "
                  f"{tried[i + 1]} instead")
            continue
        raise SystemExit(f"{' '.join(cmd)} failed:\n{p.stdout}\n{p.stderr}")
    raise AssertionError("unreachable")


def prompt_ids(vocab_size: int, length: int) -> tuple[list[int], str]:
    """The first prompt `loom bench generate` uses (apps/loom/cmd_bench.cpp, window(0, L)): the first L
    validation tokens of data.dir (data/fortunes, relative to the working directory) when its vocabulary
    is the model's, else token t = t * 2654435761 mod the vocabulary."""
    data = "data/fortunes"
    try:
        meta = json.load(open(os.path.join(data, "meta.json")))
        if meta.get("vocab_size") == vocab_size:
            text = []
            for shard in meta["splits"]["val"]["shards"]:
                text += shard_tokens(os.path.join(data, shard["file"]))
                if len(text) >= length:
                    return text[:length], f"{data}'s first {length} validation tokens"
    except (OSError, KeyError, ValueError, AssertionError):
        pass
    return [(t * 2654435761) % vocab_size for t in range(length)], f"t * 2654435761 mod {vocab_size}"


@contextlib.contextmanager
def busy_core(core: int | None):
    """A shell loop spinning on one core for the duration (nothing when core is None)."""
    busy = None if core is None else subprocess.Popen(["taskset", "-c", str(core), "sh", "-c", "while :; do :; done"])
    try:
        yield
    finally:
        if busy is not None:
            busy.kill()
            busy.wait()


def run_llama_speed(gguf: str, prompt: list[int], new_tokens: int, threads: int, work: str) -> dict:
    spec = os.path.join(work, "llama_spec.json")
    with open(spec, "w") as f:
        json.dump({"files": [gguf], "prompt": prompt, "new": new_tokens, "runs": 1, "threads": threads}, f)
    cmd = ["node", os.path.join(ROOT, "tools", "llama_speed.mjs"), spec]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{p.stdout}\n{p.stderr}")
    r = json.loads(p.stdout.strip().splitlines()[-1])[0]
    return {"prefill": r["prompt_tokens_per_s"], "decode": r["decode_tokens_per_s"]}


def cpu_info() -> tuple[str, list[str]]:
    name, flags = "unknown", []
    with open("/proc/cpuinfo") as fh:
        for line in fh:
            key, _, value = line.partition(":")
            if key.strip() == "model name" and name == "unknown":
                name = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = value.split()
    return name, sorted(f for f in flags if f.startswith("avx512"))


def llama_cpp_compare(args, folder: str, cfg: dict, file_bytes: int) -> None:
    threads = [int(t) for t in args.threads.split(",") if t.strip()]
    types = [t for t in GGUF_TYPES if t in args.formats.split(",")]
    if not types:
        raise SystemExit(f"--formats {args.formats!r}: expected some of {','.join(GGUF_TYPES)}")
    work = os.path.join(args.out, f"gguf_{args.shape}")  # exports are reused: one folder per shape
    base = baseline_rss(args.loom)
    print(f"\nGGUF export of {folder} (loom convert --to gguf, /usr/bin/time -v; the process's own RSS before any "
          f"model {fmt_bytes(base)}):")
    exports = {}
    for t in types:
        e = exports[t] = export_gguf(args.loom, folder, work, t)
        if e["reused"]:
            print(f"  {e['type']}: {e['file']} exists ({fmt_bytes(e['bytes'])}), reused")
        else:
            print(f"  {e['type']}: {fmt_bytes(e['bytes'])} in {e['seconds']:.1f} s, peak RSS {fmt_bytes(e['peak_rss'])} "
                  f"({e['peak_rss'] / file_bytes:.2f} of the {fmt_bytes(file_bytes)} bf16 safetensors; "
                  f"{fmt_bytes(e['peak_rss'] - base)} above the process's own)")
    models = {}
    for t in types:
        label, bits = LOOM_OF_GGUF[t]
        if bits == 0:
            models[t] = folder
            continue
        qdir = folder + ("_rtn_compact" if bits == 4 else f"_rtn{bits}_compact")  # _rtn_compact: --quantize rtn --compact
        models[t] = qdir
        if os.path.exists(os.path.join(qdir, "model.safetensors")):
            print(f"loom quantize {label}: {qdir} exists, reused")
            continue
        q = run_quantize(args.loom, folder, qdir, "rtn", args.calib, args.calib_tokens, COMPACT, bits=bits)
        print(f"loom quantize --method rtn --bits {bits} {' '.join(COMPACT)}: {q['seconds']:.0f} s, peak RSS "
              f"{fmt_bytes(q['peak_rss'])}, model.safetensors {fmt_bytes(q['file'])}")
    prompt, origin = prompt_ids(cfg["vocab_size"], PROMPT_TOKENS)
    print(f"prompt: {PROMPT_TOKENS} tokens ({origin}), {args.new_tokens} new, greedy; threads {threads}; "
          f"{args.rounds} rounds" + (f"; beside a busy loop on core {args.busy_core}" if args.busy_core is not None else ""))
    avail = 0.9 * available_bytes()
    waits = [w.strip() for w in args.loom_wait.split(",") if w.strip()]
    looms = {("loom" if w == "passive" else f"loom {w}"): (args.loom, w) for w in waits}
    if args.loom_base:  # another build of Loom (say, before a change) in the same rounds, default waits
        looms["loom base"] = (args.loom_base, "passive")
    raw = []
    for rnd in range(args.rounds):
        for t in types:
            gguf, loom_dir = exports[t]["file"], models[t]
            for n in threads:
                engines = list(looms) + ["llama.cpp"]
                for engine in (engines if rnd % 2 == 0 else engines[::-1]):
                    rec = {"round": rnd, "format": t, "engine": engine, "threads": n}
                    size = folder_bytes(loom_dir) if engine in looms else os.path.getsize(gguf)
                    if size > avail:
                        rec["skipped"] = f"{fmt_bytes(size)} of weights, {fmt_bytes(avail / 0.9)} available"
                    elif engine in looms:
                        with busy_core(args.busy_core):
                            binary, wait = looms[engine]
                            rec.update(model=loom_dir, **run_generate(binary, loom_dir, False, threads=n,
                                                                      new_tokens=args.new_tokens, wait=wait))
                    else:
                        with busy_core(args.busy_core):
                            rec.update(model=gguf, **run_llama_speed(gguf, prompt, args.new_tokens, n, work))
                    raw.append(rec)
                    print(f"  round {rnd + 1} {t:5s} {engine:11s} {n} threads: " +
                          (rec["skipped"] if "skipped" in rec else
                           f"decode {rec['decode']:.1f} tok/s, prefill {rec['prefill']:.1f} tok/s" +
                           (f", peak RSS {fmt_bytes(rec['peak_rss'])}" if engine in looms else "")), flush=True)

    def median(fmt, engine, n, key="decode"):
        xs = [r[key] for r in raw if r["format"] == fmt and r["engine"] == engine and r["threads"] == n and key in r]
        return statistics.median(xs) if xs else None

    cpu, avx512 = cpu_info()
    print(f"\nCPU: {cpu}; AVX-512: {'yes (' + ' '.join(avx512) + ')' if avx512 else 'no'}; {os.cpu_count()} logical CPUs")
    print(f"decode tokens/s, median of {args.rounds} rounds ({PROMPT_TOKENS} prompt + {args.new_tokens} new tokens, one "
          f"stream, greedy); Loom's peak RSS the median over its runs\n")
    head = ["format (Loom, its OpenMP wait / llama.cpp)"] + [f"Loom {n}t" for n in threads] + \
        [f"llama.cpp {n}t" for n in threads] + ["best Loom / best llama.cpp", "Loom peak RSS"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    summary = []
    for t, engine in [(t, e) for t in types for e in looms]:
        label = f"{LOOM_OF_GGUF[t][0]} ({engine}, {looms[engine][1]}) / {exports[t]['type']}"
        loom_m = [median(t, engine, n) for n in threads]
        llama_m = [median(t, "llama.cpp", n) for n in threads]
        rss = [r["peak_rss"] for r in raw if r["format"] == t and r["engine"] == engine and "peak_rss" in r]
        best_loom = max((x for x in loom_m if x is not None), default=None)
        best_llama = max((x for x in llama_m if x is not None), default=None)
        ratio = best_loom / best_llama if best_loom and best_llama else None
        cell = lambda x: f"{x:.1f}" if x is not None else "skipped"  # noqa: E731
        print(f"| {label} | " + " | ".join(cell(x) for x in loom_m + llama_m) + " | " +
              (f"{ratio:.2f}x" if ratio is not None else "-") + " | " +
              (fmt_bytes(statistics.median(rss)) if rss else "-") + " |")
        summary.append({"format": t, "gguf_type": exports[t]["type"], "loom_model": models[t], "loom": engine, "loom_binary": looms[engine][0],
                        "loom_wait": looms[engine][1],
                        "loom_decode_median": dict(zip(map(str, threads), loom_m)),
                        "llama_cpp_decode_median": dict(zip(map(str, threads), llama_m)),
                        "best_loom_over_best_llama_cpp": ratio})
    out = os.path.join(args.out, "llama_cpp_results.json")
    with open(out, "w") as fh:
        json.dump({"folder": folder, "shape": args.shape, "cpu": cpu, "avx512": avx512, "threads": threads,
                   "rounds": args.rounds, "busy_core": args.busy_core, "prompt_tokens": PROMPT_TOKENS, "prompt": prompt, "new_tokens": args.new_tokens,
                   "exports": exports, "summary": summary, "raw": raw}, fh, indent=2)
    print(f"\nevery round's figures: {out}")


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
    ap.add_argument("--skip-generate", action="store_true",
                    help="skip the bf16 / f32 bench generate table (--quantize, --qlora and --llama-cpp still run)")
    ap.add_argument("--qlora", type=int, default=0, metavar="STEPS", help="also a QLoRA run of STEPS steps from the folder")
    ap.add_argument("--qlora-seq", type=int, default=512)
    ap.add_argument("--lora-base", choices=["nf4", "bf16"], default="nf4",
                    help="--qlora's base: NF4 (QLoRA) or bf16 only (LoRA with precision.param = bf16)")
    ap.add_argument("--llama-cpp", action="store_true",
                    help="compare decode speed with llama.cpp on GGUF exports (bf16, q8_0, q4_0) of the folder")
    ap.add_argument("--loom-wait", default="passive",
                    help="--llama-cpp: OMP_WAIT_POLICY values for Loom's runs, each its own row (default passive, "
                         "Loom's own; llama.cpp's threads spin), or nospin: passive with LOOM_SPIN_US=0 (the decoding "
                         "team sleeps at once, as every wait did before it)")
    ap.add_argument("--loom-base", default="", metavar="BIN",
                    help="--llama-cpp: also run this Loom binary (say, a build from before a change) in every round")
    ap.add_argument("--busy-core", type=int, default=None,
                    help="--llama-cpp: run every engine beside a shell loop spinning on this core")
    ap.add_argument("--formats", default=",".join(GGUF_TYPES),
                    help="--llama-cpp: comma-separated GGUF types to compare (default bf16,q8_0,q4_0)")
    ap.add_argument("--threads", default="1,2", help="--llama-cpp: comma-separated thread counts (default 1,2)")
    ap.add_argument("--rounds", type=int, default=3, help="--llama-cpp: rounds of every run (default 3; medians printed)")
    ap.add_argument("--new-tokens", type=int, default=32, help="--llama-cpp: new tokens per request (default 32)")
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
        r = run_qlora(args.loom, folder, os.path.join(args.out, "qlora"), args.qlora, args.qlora_seq, args.lora_base)
        print(f"\n{'QLoRA' if args.lora_base == 'nf4' else 'LoRA over the bf16 base'}, {args.qlora} steps of {args.qlora_seq} tokens (rank 16, full recompute, the final checkpoint "
              f"included): {r['seconds']:.0f} s, peak RSS {r['peak_rss'] / 2**30:.2f} GiB\n  {r['report']}")
    if args.llama_cpp:
        llama_cpp_compare(args, folder, cfg, file_bytes)
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
