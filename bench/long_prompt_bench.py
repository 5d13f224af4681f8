#!/usr/bin/python3
"""A long prompt served in bounded memory (issue: chunked prefill), on a Llama-3.2-1B-shaped
Hugging Face folder of random bf16 weights (bench/big_model_bench.py's "1b" shape: 16 layers,
d 2048, GQA 32/8, the real 128,256-token vocabulary, untied head; its config.json given Llama
3.2's 131,072 positions and `rope_scaling` llama3). Not in CI: the folder is 2.8 GB and a
32k prompt takes tens of minutes on 2 cores.

1. The same greedy tokens from a --check-tokens prompt (default 1,536) prefilled in one forward
   (`--prefill-chunk 0`) and in chunks of 512.
2. `loom serve --max-batch 1 --kv-blocks B` (B: the blocks of the prompt and its new tokens),
   one non-streamed completion of --prompt-tokens (default 32,768) random token ids, 4 new tokens:
   the server's peak RSS (VmHWM) against the sum of what it states at start: the weights (the
   folder's safetensors bytes: bf16 used in place), its KV pool and its step workspace, plus
   the process's own bytes (the binary and its libraries: the peak RSS of `loom quantize --help`,
   big_model_bench.baseline_rss).

usage: bench/long_prompt_bench.py --folder /tmp/big/1b-long [--prompt-tokens 32768] [--loom build/bin/loom]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
from big_model_bench import baseline_rss, config_of, folder_bytes, write_folder  # noqa: E402

ENV = dict(os.environ, OMP_NUM_THREADS="2")
UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}


def parse_bytes(text: str) -> int:
    m = re.match(r"([0-9.]+) (B|KiB|MiB|GiB)", text)
    return int(float(m.group(1)) * UNITS[m.group(2)])


def status(pid: int, key: str) -> int:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def serve(loom: str, folder: str, *extra: str):
    proc = subprocess.Popen([loom, "serve", "--checkpoint", folder, "--port", "0", *extra], cwd=ROOT, env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    banner, port = "", 0
    for line in proc.stdout:
        banner += line
        m = re.search(r"listening on http://127\.0\.0\.1:(\d+)", line)
        if m:
            port = int(m.group(1))
            break
    if port == 0:
        sys.exit(f"loom serve did not start: {banner}{proc.stderr.read()}")
    return proc, port, banner


def complete(port: int, prompt: list[int], new: int) -> dict:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=7200)
    c.request("POST", "/v1/completions", body=json.dumps({"prompt": prompt, "max_tokens": new, "temperature": 0,
                                                          "ignore_eos": True, "logprobs": 0}),
              headers={"Content-Type": "application/json"})
    r = c.getresponse()
    body = json.loads(r.read())
    c.close()
    assert r.status == 200, body
    return body


def tokens_of(body: dict) -> list:
    return body["choices"][0]["logprobs"]["tokens"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--loom", default=os.path.join(ROOT, "build", "bin", "loom"))
    ap.add_argument("--folder", required=True, help="where the 1B-shaped folder is written (reused)")
    ap.add_argument("--prompt-tokens", type=int, default=32768)
    ap.add_argument("--check-tokens", type=int, default=1536)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--out", default="long_prompt_bench.json")
    args = ap.parse_args()
    cfg = config_of("1b")
    cfg["max_position_embeddings"] = 131072
    cfg["rope_scaling"] = {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                           "original_max_position_embeddings": 8192, "rope_type": "llama3"}
    write_folder(args.folder, cfg)
    weights = folder_bytes(args.folder)
    rng = random.Random(3)
    out = {"folder": args.folder, "weights_bytes": weights}

    # 1. whole-prompt prefill against chunks: the same greedy tokens
    check = [rng.randrange(cfg["vocab_size"] - 1) for _ in range(args.check_tokens)]
    got = {}
    for chunk in (0, args.chunk):
        proc, port, _ = serve(args.loom, args.folder, "--max-batch", "1", "--prefill-chunk", str(chunk),
                              "--kv-memory", "1GiB")
        got[chunk] = tokens_of(complete(port, check, 8))
        proc.terminate(), proc.wait()
    out["same_tokens"] = got[0] == got[args.chunk]
    print(f"{args.check_tokens}-token prompt, 8 greedy tokens: whole prefill {got[0]}, chunks of {args.chunk} "
          f"{got[args.chunk]}: {'the same' if out['same_tokens'] else 'DIFFERENT'}")

    # 2. the long prompt's peak
    base = baseline_rss(args.loom)
    new = 4
    blocks = (args.prompt_tokens + new + 15) // 16 + 1
    proc, port, banner = serve(args.loom, args.folder, "--max-batch", "1", "--prefill-chunk", str(args.chunk),
                               "--kv-blocks", str(blocks), "--no-prefix-cache")
    kv = parse_bytes(re.search(r"blocks of \d+ \(([^)]+)\)", banner).group(1))
    workspace = parse_bytes(re.search(r"step workspace ([0-9.]+ [KMG]?i?B)", banner).group(1))
    loaded = status(proc.pid, "VmRSS")
    prompt = [rng.randrange(cfg["vocab_size"] - 1) for _ in range(args.prompt_tokens)]
    t0 = time.perf_counter()
    body = complete(port, prompt, new)
    seconds = time.perf_counter() - t0
    peak = status(proc.pid, "VmHWM")
    proc.terminate(), proc.wait()
    planned = weights + kv + workspace + base
    out.update({"prompt_tokens": args.prompt_tokens, "chunk": args.chunk, "seconds": seconds, "peak_rss": peak,
                "rss_after_load": loaded, "kv_bytes": kv, "workspace_bytes": workspace, "process_bytes": base,
                "planned_bytes": planned, "ratio": peak / planned, "tokens": tokens_of(body),
                "usage": body["usage"]})
    g = 1 << 30
    print(f"{args.prompt_tokens}-token prompt, chunks of {args.chunk}: {seconds:.0f} s "
          f"({args.prompt_tokens / seconds:.1f} prompt tokens/s); peak RSS {peak / g:.2f} GiB against weights "
          f"{weights / g:.2f} + KV {kv / g:.2f} + step workspace {workspace / g:.2f} + process {base / g:.2f} = "
          f"{planned / g:.2f} GiB (measured / stated {peak / planned:.2f}); RSS after loading {loaded / g:.2f} GiB")
    with open(args.out, "w") as fh:
        json.dump(out, fh, indent=2)


if __name__ == "__main__":
    main()
