#!/usr/bin/python3
"""Load test of `loom serve` on loopback, and single-stream speed against llama.cpp, in one run.

1. Load: a server on a model Loom trained (the default small model's shape, a few steps on the
   default corpus, unless --checkpoint) and clients of our own (threads, streamed completions with
   usage) at 1, 4, 16 and 64 concurrent clients: throughput (new tokens/s, requests/s), time to
   first token and inter-token latency p50 / p99, failed or lost requests (any non-200 below the
   queue limit counts). Inter-token latency is per request: (t_last - t_first) / (tokens - 1),
   as the client sees it; events may carry several tokens when the reader lags.
2. Soak (--soak S, default 600): 16 clients for S seconds; the server's RSS (VmRSS) every 10 s,
   first and last reported.
3. Against llama.cpp: a GPT-2 124M-shaped model (random weights: speed only) served by Loom and
   converted to GGUF f32 / f16 / q8_0 / q4_0 (`loom convert --to gguf`), run by node-llama-cpp's
   prebuilt llama.cpp (tools/llama_speed.mjs, 2 threads) on the same prompt token ids: prompt
   tokens/s (P / time to first token) and decode tokens/s ((N - 1) / (t_last - t_first)), best of
   3, and Loom / llama.cpp for the format Loom serves (f32 weights).
4. A long prompt among streaming decodes (--long-prompt P, default 8192; --long-chunk C, the
   server's --prefill-chunk, default 8; --only-long runs this part alone): 8 greedy decodes
   stream while one P-token prompt is prefilled in chunks beside them; every gap between a
   decode's consecutive events inside the prefill's window, p50 / p99, against the same decodes
   without the prompt, three rounds alternating which runs first, and the median ratio of p99s.
Prints tables and writes every figure to --out (JSON).

usage: bench/serve_bench.py [--loom build/bin/loom] [--checkpoint PATH] [--levels 1,4,16,64]
                            [--soak 600] [--out bench_serve.json] [--skip-llama]
                            [--long-prompt 8192] [--long-chunk 8] [--only-long]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, OMP_NUM_THREADS="2")


def loom(binary: str, *args: str) -> str:
    p = subprocess.run([binary, *args], cwd=ROOT, env=ENV, capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"loom {' '.join(args)} failed:\n{p.stdout}\n{p.stderr}")
    return p.stdout


class Server:
    def __init__(self, binary: str, checkpoint: str, *extra: str):
        self.proc = subprocess.Popen([binary, "serve", "--checkpoint", checkpoint, "--port", "0", *extra], cwd=ROOT,
                                     env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.port = 0
        for line in self.proc.stdout:
            m = re.search(r"listening on http://127\.0\.0\.1:(\d+)", line)
            if m:
                self.port = int(m.group(1))
                break
        if self.port == 0:
            sys.exit(f"loom serve did not start: {self.proc.stderr.read()}")
        threading.Thread(target=lambda: [None for _ in self.proc.stdout], daemon=True).start()

    def rss(self) -> int:
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        return 0

    def stream(self, body: dict) -> dict:
        """One streamed completion: status, times of the first and last text event, tokens."""
        start = time.perf_counter()
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)
        c.request("POST", "/v1/completions", body=json.dumps({**body, "stream": True,
                                                              "stream_options": {"include_usage": True}}),
                  headers={"Content-Type": "application/json"})
        r = c.getresponse()
        out = {"status": r.status, "first": None, "last": None, "tokens": 0, "done": False, "times": []}
        if r.status != 200:
            r.read()
            c.close()
            return out
        while True:
            line = r.readline()
            if not line:
                break
            if not line.startswith(b"data: "):
                continue
            data = line[6:].strip()
            if data == b"[DONE]":
                out["done"] = True
                break
            chunk = json.loads(data)
            now = time.perf_counter() - start
            if chunk.get("usage"):
                out["tokens"] = chunk["usage"]["completion_tokens"]
            elif chunk["choices"] and chunk["choices"][0].get("text"):
                out["first"] = out["first"] if out["first"] is not None else now
                out["last"] = now
                out["times"].append(start + now)  # absolute (perf_counter), to place each gap in time
        c.close()
        return out

    def stop(self):
        self.proc.terminate()
        self.proc.wait(timeout=120)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def load_level(server: Server, clients: int, requests: int, prompts: list[str], new: int) -> dict:
    results: list[dict] = []
    lock = threading.Lock()
    counter = iter(range(requests))

    def client(k: int):
        while True:
            with lock:
                i = next(counter, None)
            if i is None:
                return
            got = server.stream({"prompt": prompts[i % len(prompts)], "max_tokens": new, "temperature": 0.8,
                                 "seed": i, "ignore_eos": True})
            with lock:
                results.append(got)

    start = time.perf_counter()
    threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    ok = [r for r in results if r["status"] == 200 and r["done"]]
    ttft = [r["first"] for r in ok if r["first"] is not None]
    itl = [(r["last"] - r["first"]) / (r["tokens"] - 1) for r in ok if r["first"] is not None and r["tokens"] > 1]
    tokens = sum(r["tokens"] for r in ok)
    return {"clients": clients, "requests": requests, "ok": len(ok), "failed": len(results) - len(ok),
            "lost": requests - len(results), "wall_s": wall, "tokens_per_s": tokens / wall, "requests_per_s": len(ok) / wall,
            "ttft_p50_s": percentile(ttft, 0.5), "ttft_p99_s": percentile(ttft, 0.99),
            "itl_p50_s": percentile(itl, 0.5), "itl_p99_s": percentile(itl, 0.99)}


def soak(server: Server, seconds: float, prompts: list[str], new: int) -> dict:
    stop = time.perf_counter() + seconds
    samples: list[tuple[float, int]] = [(0.0, server.rss())]
    failures = [0]
    done = [0]
    lock = threading.Lock()

    def client(k: int):
        i = k
        while time.perf_counter() < stop:
            got = server.stream({"prompt": prompts[i % len(prompts)], "max_tokens": new, "temperature": 0.8, "seed": i,
                                 "ignore_eos": True})
            with lock:
                done[0] += 1
                failures[0] += 0 if got["status"] == 200 and got["done"] else 1
            i += 16

    threads = [threading.Thread(target=client, args=(k,)) for k in range(16)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    while time.perf_counter() < stop:
        time.sleep(min(10.0, max(0.0, stop - time.perf_counter())))
        samples.append((time.perf_counter() - start, server.rss()))
    for t in threads:
        t.join()
    samples.append((time.perf_counter() - start, server.rss()))
    return {"seconds": seconds, "requests": done[0], "failed": failures[0], "rss_start": samples[0][1],
            "rss_after_first_10s": samples[1][1] if len(samples) > 1 else samples[0][1], "rss_end": samples[-1][1],
            "rss_max": max(s[1] for s in samples), "samples": samples}


def single_stream(server: Server, prompt_ids: list[int], new: int, runs: int = 3) -> dict:
    best = {"prompt_tokens_per_s": 0.0, "decode_tokens_per_s": 0.0}
    for _ in range(runs):
        r = server.stream({"prompt": prompt_ids, "max_tokens": new, "temperature": 0, "ignore_eos": True})
        assert r["status"] == 200 and r["tokens"] == new, r
        best["prompt_tokens_per_s"] = max(best["prompt_tokens_per_s"], len(prompt_ids) / r["first"])
        best["decode_tokens_per_s"] = max(best["decode_tokens_per_s"], (r["tokens"] - 1) / (r["last"] - r["first"]))
    return best


def long_prompt_interference(binary: str, tmp: str, prompt_tokens: int, chunk: int, decoders: int = 8,
                             rounds: int = 3) -> dict:
    """One long prompt arriving among `decoders` streaming decodes (issue: chunked prefill in the
    scheduler). A Llama-shaped model (8 layers, d 512, GQA 8/2, context 16,384; random weights:
    latency only) served with --prefill-chunk `chunk`; the decodes run greedy, each long enough
    to outlast the prompt's prefill. Inter-token latency here is each gap between consecutive
    streamed events of a decode (not a request's mean), p50 / p99 over every decode's gaps: alone
    (no long prompt) and while the long prompt is being prefilled (its submission to its first
    token). Rounds alternate the two; the ratio of the p99s is taken per round."""
    shape = ("model.arch=llama,model.n_layer=8,model.n_head=8,model.n_kv_head=2,model.d_model=512,model.d_ff=1536,"
             "model.max_seq_len=16384,train.steps=1,train.batch_size=1,train.seq_len=64,train.eval_every=0,"
             "train.checkpoint_every=0")
    loom(binary, "train", "--set", f"{shape},run.dir={tmp}/runs,run.name=long")
    checkpoint = os.path.join(tmp, "runs", "long")
    vocab = json.load(open(os.path.join(ROOT, "data", "fortunes", "meta.json")))["vocab_size"]
    rng = random.Random(1)
    long_prompt = [rng.randrange(vocab) for _ in range(prompt_tokens)]
    server = Server(binary, checkpoint, "--max-batch", str(decoders + 1), "--prefill-chunk", str(chunk), "--no-prefix-cache")
    steps = prompt_tokens // chunk + 1
    new = steps + 96  # the decodes outlast the prefill (one chunk a step) by 96 tokens

    def run(with_long: bool) -> dict:
        results: list[dict] = [{} for _ in range(decoders)]
        started = threading.Barrier(decoders + 1)
        long: dict = {}

        def decode(k: int):
            started.wait()
            results[k] = server.stream({"prompt": [rng.randrange(vocab) for _ in range(16)], "max_tokens": new,
                                        "temperature": 0, "ignore_eos": True})

        threads = [threading.Thread(target=decode, args=(k,)) for k in range(decoders)]
        for t in threads:
            t.start()
        started.wait()
        time.sleep(1.0)  # every decode admitted and streaming
        window = [time.perf_counter(), None]
        if with_long:
            r = server.stream({"prompt": long_prompt, "max_tokens": 1, "ignore_eos": True})
            long.update(r)
            window[1] = window[0] + r["first"]
        for t in threads:
            t.join()
        if window[1] is None:  # alone: the same length of window, from the same moment
            window[1] = window[0] + 20.0
        gaps = []
        for r in results:
            assert r["status"] == 200 and r["done"], r
            ts = r["times"]
            gaps += [b - a for a, b in zip(ts, ts[1:]) if window[0] <= b <= window[1]]
        return {"gaps": len(gaps), "itl_p50_s": percentile(gaps, 0.5), "itl_p99_s": percentile(gaps, 0.99),
                "long_ttft_s": long.get("first")}

    server.stream({"prompt": [1, 2, 3], "max_tokens": 4})  # warm-up
    out = {"prompt_tokens": prompt_tokens, "chunk": chunk, "decoders": decoders, "decode_tokens": new, "rounds": []}
    for i in range(rounds):
        pair = {}
        for with_long in ((False, True) if i % 2 == 0 else (True, False)):
            pair["with" if with_long else "alone"] = run(with_long)
        pair["ratio_p99"] = pair["with"]["itl_p99_s"] / pair["alone"]["itl_p99_s"]
        out["rounds"].append(pair)
        a, w = pair["alone"], pair["with"]
        print(f"round {i + 1}: decodes alone ITL p50 {a['itl_p50_s'] * 1e3:.1f} ms, p99 {a['itl_p99_s'] * 1e3:.1f} ms "
              f"({a['gaps']} gaps); with the {prompt_tokens}-token prompt p50 {w['itl_p50_s'] * 1e3:.1f} ms, p99 "
              f"{w['itl_p99_s'] * 1e3:.1f} ms ({w['gaps']} gaps; its first token after {w['long_ttft_s']:.1f} s): "
              f"p99 ratio {pair['ratio_p99']:.2f}x", flush=True)
    server.stop()
    out["median_ratio_p99"] = statistics.median(r["ratio_p99"] for r in out["rounds"])
    print(f"median p99 ratio {out['median_ratio_p99']:.2f}x (--prefill-chunk {chunk})")
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--loom", default=os.path.join(ROOT, "build", "bin", "loom"))
    ap.add_argument("--checkpoint", help="the model of the load test (default: the default shape, trained 40 steps)")
    ap.add_argument("--levels", default="1,4,16,64")
    ap.add_argument("--new", type=int, default=64, help="tokens per request")
    ap.add_argument("--soak", type=float, default=600)
    ap.add_argument("--skip-llama", action="store_true")
    ap.add_argument("--long-prompt", type=int, default=8192,
                    help="tokens of the prompt arriving among 8 streaming decodes (0: skip that part)")
    ap.add_argument("--long-chunk", type=int, default=8, help="--prefill-chunk of that server")
    ap.add_argument("--only-long", action="store_true", help="run the long-prompt part alone")
    ap.add_argument("--out", default="bench_serve.json")
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="loom_serve_bench_")
    report: dict = {}
    try:
        if args.long_prompt > 0:
            if not os.path.exists(os.path.join(ROOT, "data", "fortunes", "meta.json")):
                loom(args.loom, "prepare")
            print(f"long prompt among streaming decodes: {args.long_prompt} tokens, --prefill-chunk {args.long_chunk}")
            report["long_prompt"] = long_prompt_interference(args.loom, tmp, args.long_prompt, args.long_chunk)
        if args.only_long:
            with open(args.out, "w") as f:
                json.dump(report, f, indent=1)
            return
        checkpoint = args.checkpoint
        if checkpoint is None:
            if not os.path.exists(os.path.join(ROOT, "data", "fortunes", "meta.json")):
                loom(args.loom, "prepare")
            loom(args.loom, "train", "--set", f"train.steps=40,train.eval_every=0,train.checkpoint_every=0,"
                 f"run.dir={tmp}/runs,run.name=small")
            checkpoint = os.path.join(tmp, "runs", "small")
        prompts = [line.strip() for line in open("/usr/share/common-licenses/GPL-3") if len(line.strip()) > 40][:200]
        server = Server(args.loom, checkpoint, "--max-batch", "16", "--max-queue", "256")
        print(f"load test: {checkpoint}, {args.new} new tokens per request, prompts: GPL-3 lines")
        print(f"{'clients':>7} {'requests':>8} {'failed':>6} {'lost':>4} {'tokens/s':>9} {'req/s':>6} "
              f"{'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} {'ITL p99':>8}")
        report["load"] = []
        server.stream({"prompt": prompts[0], "max_tokens": 8})  # warm-up: threads and buffers start once
        for clients in [int(x) for x in args.levels.split(",")]:
            level = load_level(server, clients, max(16, 2 * clients), prompts, args.new)
            report["load"].append(level)
            print(f"{clients:>7} {level['requests']:>8} {level['failed']:>6} {level['lost']:>4} {level['tokens_per_s']:>9.1f} "
                  f"{level['requests_per_s']:>6.2f} {level['ttft_p50_s'] * 1e3:>7.1f}ms {level['ttft_p99_s'] * 1e3:>7.1f}ms "
                  f"{level['itl_p50_s'] * 1e3:>6.2f}ms {level['itl_p99_s'] * 1e3:>6.2f}ms", flush=True)
        if args.soak > 0:
            s = soak(server, args.soak, prompts, args.new)
            report["soak"] = s
            print(f"soak: 16 clients for {s['seconds']:.0f} s: {s['requests']} requests, {s['failed']} failed; server RSS "
                  f"{s['rss_start'] / 2**20:.1f} MiB at the start, {s['rss_after_first_10s'] / 2**20:.1f} MiB after 10 s, "
                  f"{s['rss_end'] / 2**20:.1f} MiB at the end (max {s['rss_max'] / 2**20:.1f} MiB)", flush=True)
        server.stop()

        if not args.skip_llama:
            shape = ("model.n_layer=12,model.n_head=12,model.n_kv_head=12,model.d_model=768,model.d_ff=3072,"
                     "model.max_seq_len=256,train.steps=1,train.batch_size=1,train.seq_len=64,train.eval_every=0,"
                     "train.checkpoint_every=0")
            if not os.path.exists(os.path.join(ROOT, "data", "fortunes", "meta.json")):
                loom(args.loom, "prepare")
            loom(args.loom, "train", "--set", f"{shape},run.dir={tmp}/runs,run.name=big")
            big = os.path.join(tmp, "runs", "big")
            files = []
            for t in ("f32", "f16", "q8_0", "q4_0"):
                out = os.path.join(tmp, f"big-{t}.gguf")
                loom(args.loom, "convert", "--to", "gguf", "--checkpoint", big, "--out", out, "--type", t)
                files.append(out)
            rng = random.Random(0)
            vocab = json.load(open(os.path.join(ROOT, "data", "fortunes", "meta.json")))["vocab_size"]
            prompt = [rng.randrange(vocab) for _ in range(32)]
            server = Server(args.loom, big, "--max-batch", "1", "--no-prefix-cache")  # every run a cold prompt, as llama.cpp's
            spec = os.path.join(tmp, "spec.json")
            json.dump({"files": files, "prompt": prompt, "new": args.new, "runs": 3}, open(spec, "w"))
            # Rounds alternate Loom and llama.cpp, so a busy moment of this shared machine hits one
            # round, not one engine; the ratio is taken per round, and the median reported.
            rounds = []
            for _ in range(3):
                ours = single_stream(server, prompt, args.new)
                p = subprocess.run(["node", os.path.join(ROOT, "tools", "llama_speed.mjs"), spec], capture_output=True,
                                   text=True)
                if p.returncode != 0:
                    sys.exit(f"llama_speed.mjs failed: {p.stderr}")
                theirs = json.loads(p.stdout)
                rounds.append({"loom_f32": ours, "llama_cpp": theirs,
                               "ratio_f32": {"prompt": ours["prompt_tokens_per_s"] / theirs[0]["prompt_tokens_per_s"],
                                             "decode": ours["decode_tokens_per_s"] / theirs[0]["decode_tokens_per_s"]}})
            server.stop()
            report["single_stream"] = {"rounds": rounds, "model": f"GPT-2 124M shape (d 768, 12 layers), vocab {vocab}",
                                       "prompt_tokens": len(prompt), "new_tokens": args.new}
            print(f"\nsingle stream, GPT-2 124M shape (vocab {vocab}), {len(prompt)} prompt tokens, {args.new} new; "
                  "3 rounds alternating Loom and llama.cpp, each the best of 3 runs:")
            print(f"{'engine':<22} " + " ".join(f"{'prompt tok/s':>12} {'decode tok/s':>12}" for _ in rounds))
            print(f"{'loom serve f32':<22} " + " ".join(f"{r['loom_f32']['prompt_tokens_per_s']:>12.1f} "
                                                   f"{r['loom_f32']['decode_tokens_per_s']:>12.1f}" for r in rounds))
            for i, t in enumerate(rounds[0]["llama_cpp"]):
                name = "llama.cpp " + t["file"].split("-")[-1][:-5]
                print(f"{name:<22} " + " ".join(f"{r['llama_cpp'][i]['prompt_tokens_per_s']:>12.1f} "
                                              f"{r['llama_cpp'][i]['decode_tokens_per_s']:>12.1f}" for r in rounds))
            prompt_ratios = sorted(r["ratio_f32"]["prompt"] for r in rounds)
            decode_ratios = sorted(r["ratio_f32"]["decode"] for r in rounds)
            report["single_stream"]["median_ratio_f32"] = {"prompt": prompt_ratios[1], "decode": decode_ratios[1]}
            print("Loom / llama.cpp at f32 per round: prompt " + ", ".join(f"{x:.2f}x" for x in prompt_ratios) +
                  "; decode " + ", ".join(f"{x:.2f}x" for x in decode_ratios) +
                  f" (median {prompt_ratios[1]:.2f}x and {decode_ratios[1]:.2f}x). Loom serves f32 weights only; "
                  "the other formats are llama.cpp's alone.")
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
        print(f"\nwrote {args.out}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
