#!/usr/bin/python3
"""`loom serve` end to end, on loopback: the official `openai` npm client (tools/openai_client.mjs)
for completions, chat, streaming, n > 1 and stop; greedy outputs equal to `loom generate`'s, alone
and under 32 concurrent clients; automatic prefix caching (hits in /metrics, the same tokens);
a client that disconnects is cancelled and its row and blocks freed; a full queue answers 429 with
Retry-After; every bad request is a 400 with OpenAI's error object and the server keeps serving;
SIGTERM drains and exits 0.  Run by ctest: serve_test.py <path to loom>; needs node and
scripts/setup's .deps/npm (openai)."""

from __future__ import annotations

import http.client
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import unittest

LOOM = os.path.abspath(sys.argv[1]) if len(sys.argv) > 1 else "build/bin/loom"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEXT = "/usr/share/common-licenses/GPL-3"
CHATML = os.path.join(ROOT, "examples", "sft", "chatml.jinja")
MODEL = ",".join([
    "model.arch=llama", "model.n_layer=2", "model.n_head=4", "model.n_kv_head=2", "model.d_model=128", "model.d_ff=256",
    "model.max_seq_len=256", "train.seq_len=64", "train.batch_size=8", "optim.warmup_steps=5", "optim.lr=3e-3",
    "optim.min_lr=3e-4", "train.eval_every=0", "train.checkpoint_every=0", "sample.max_new_tokens=8",
])
PROMPTS = ["The GNU General Public License", "You may convey", "Each contributor grants", "THERE IS NO WARRANTY",
           "For example, if you", "The source code", "This License", "An interactive user interface"]
ENV = dict(os.environ, OMP_NUM_THREADS="2")


def run(*args: str) -> subprocess.CompletedProcess:
    p = subprocess.run([LOOM, *args], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=900)
    if p.returncode != 0:
        raise AssertionError(f"loom {' '.join(args)} failed ({p.returncode}):\n{p.stdout}\n{p.stderr}")
    return p


def train_model(tmp: str, steps: int) -> str:
    """MODEL trained `steps` steps on TEXT (byte tokenizer) under tmp; returns its run folder."""
    data = os.path.join(tmp, "data")
    run("prepare", "--input", TEXT, "--tokenizer", "byte", "--out", data, "--val-fraction", "0.05")
    run("train", "--set", f"{MODEL},train.steps={steps},data.dir={data},data.tokenizer=byte,run.dir={tmp}/runs,run.name=m")
    return os.path.join(tmp, "runs", "m")


class Server:
    """`loom serve --port 0 ...` in the background; its port read from the line it prints."""

    def __init__(self, checkpoint: str, *extra: str, env: dict | None = None):
        self.proc = subprocess.Popen([LOOM, "serve", "--checkpoint", checkpoint, "--port", "0", *extra], cwd=ROOT,
                                     env=env or ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        self.port = 0
        ready = threading.Event()

        def read():  # the server's stdout, line by line, until it closes
            for line in self.proc.stdout:
                self.lines.append(line)
                m = re.search(r"listening on http://127\.0\.0\.1:(\d+)", line)
                if m:
                    self.port = int(m.group(1))
                    ready.set()
            ready.set()

        self.reader = threading.Thread(target=read, daemon=True)
        self.reader.start()
        ready.wait(timeout=120)
        if self.port == 0:
            self.proc.kill()
            raise AssertionError(f"loom serve did not start: {''.join(self.lines)} {self.proc.stderr.read()}")

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def request(self, method: str, path: str, body=None, raw: bytes | None = None, timeout: float = 120):
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        c.request(method, path, body=data, headers={"Content-Type": "application/json"})
        r = c.getresponse()
        text = r.read().decode("utf-8")
        headers = dict(r.getheaders())
        c.close()
        return r.status, text, headers

    def complete(self, body) -> dict:
        status, text, _ = self.request("POST", "/v1/completions", body)
        if status != 200:
            raise AssertionError(f"{status}: {text}")
        return json.loads(text)

    def metrics(self) -> dict[str, float]:
        _, text, _ = self.request("GET", "/metrics")
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                key, value = line.rsplit(" ", 1)
                out[key] = float(value)
        return out

    def stop(self, sig=signal.SIGTERM, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
            self.reader.join(timeout=10)
            self.proc.stdout.close()
            self.proc.stderr.close()


class Serve(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="loom_serve_")
        cls.ckpt = train_model(cls.tmp, 60)
        cls.server = Server(cls.ckpt, "--max-batch", "8", "--max-queue", "64", "--chat-template", CHATML)
        # loom generate's greedy texts of PROMPTS (no prefix cache, one engine): the reference.
        prompts = os.path.join(cls.tmp, "prompts.txt")
        with open(prompts, "w") as f:
            f.write("\n".join(PROMPTS) + "\n")
        out = os.path.join(cls.tmp, "generated.jsonl")
        run("generate", "--checkpoint", cls.ckpt, "--prompts", prompts, "--greedy", "--tokens", "40", "--out", out)
        with open(out) as f:
            cls.greedy = [json.loads(line)["text"] for line in f]

    @classmethod
    def tearDownClass(cls):
        code = cls.server.stop()
        shutil.rmtree(cls.tmp, ignore_errors=True)
        assert code == 0, f"loom serve exited {code} after SIGTERM"

    def openai(self, cases: list[dict]) -> list[dict]:
        path = os.path.join(self.tmp, "cases.json")
        with open(path, "w") as f:
            json.dump(cases, f)
        p = subprocess.run(["node", os.path.join(ROOT, "tools", "openai_client.mjs"), self.server.base, "m", path],
                           capture_output=True, text=True, timeout=300)
        self.assertEqual(p.returncode, 0, p.stderr)
        return json.loads(p.stdout)

    def test_official_openai_client(self):
        greedy = {"prompt": PROMPTS[0], "max_tokens": 40, "temperature": 0}
        text = self.greedy[0]
        stop = text[10:13]
        chat = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is free software?"}],
                "max_tokens": 30, "temperature": 0}
        cases = [
            {"kind": "completion", "stream": False, "params": greedy},
            {"kind": "completion", "stream": True, "params": {**greedy, "stream_options": {"include_usage": True}}},
            {"kind": "completion", "stream": False, "params": {**greedy, "stop": [stop, "\u0000never"]}},
            {"kind": "completion", "stream": True, "params": {**greedy, "stop": stop}},
            {"kind": "completion", "stream": False, "params": {"prompt": PROMPTS[1], "max_tokens": 20, "n": 3,
                                                                "temperature": 1.0, "seed": 7}},
            {"kind": "completion", "stream": True, "params": {"prompt": PROMPTS[1], "max_tokens": 20, "n": 3,
                                                               "temperature": 1.0, "seed": 7}},
            {"kind": "chat", "stream": False, "params": chat},
            {"kind": "chat", "stream": True, "params": chat},
            {"kind": "chat", "stream": False, "params": {**chat, "logprobs": True, "top_logprobs": 3, "max_tokens": 5}},
            {"kind": "completion", "stream": False, "params": {"prompt": "x", "max_tokens": 0}},
        ]
        r = self.openai(cases)
        for i, x in enumerate(r[:-1]):
            self.assertTrue(x["ok"], f"case {i}: {x}")
        # Greedy: the text of loom generate, streamed or not, with usage counted.
        self.assertEqual(r[0]["choices"][0]["text"], text)
        self.assertEqual(r[0]["choices"][0]["finish_reason"], "length")
        self.assertEqual(r[0]["usage"]["completion_tokens"], 40)
        self.assertEqual(r[0]["usage"]["prompt_tokens"], len(PROMPTS[0].encode()))
        self.assertEqual(r[1]["choices"][0]["text"], text)
        self.assertEqual(r[1]["usage"], r[0]["usage"])
        self.assertGreaterEqual(r[1]["chunks"], 3)  # text (deltas coalesce when the reader lags), finish, usage
        # stop: the text ends before the stop string's first occurrence, streamed or not.
        self.assertEqual(r[2]["choices"][0]["text"], text[:text.find(stop)])
        self.assertEqual(r[2]["choices"][0]["finish_reason"], "stop")
        self.assertEqual(r[3]["choices"][0]["text"], text[:text.find(stop)])
        self.assertEqual(r[3]["choices"][0]["finish_reason"], "stop")
        # n = 3: three choices, the same when streamed (same seed), not all equal.
        self.assertEqual([c["index"] for c in r[4]["choices"]], [0, 1, 2])
        self.assertEqual([c["text"] for c in r[4]["choices"]], [c["text"] for c in r[5]["choices"]])
        self.assertGreater(len({c["text"] for c in r[4]["choices"]}), 1)
        # Chat through the model's template: an assistant message, the same streamed.
        self.assertEqual(r[6]["choices"][0]["role"], "assistant")
        self.assertTrue(r[6]["choices"][0]["text"])
        self.assertEqual(r[7]["choices"][0]["text"], r[6]["choices"][0]["text"])
        self.assertEqual(r[8]["choices"][0]["text"], r[6]["choices"][0]["text"][:len(r[8]["choices"][0]["text"])])
        content = r[8]["choices"][0]["logprobs"]["content"]
        self.assertEqual(len(content), 5)
        for entry in content:  # greedy: the drawn token is the most likely, its logprob the top one
            self.assertEqual(len(entry["top_logprobs"]), 3)
            self.assertAlmostEqual(entry["logprob"], entry["top_logprobs"][0]["logprob"], places=9)
            self.assertLessEqual(entry["logprob"], 0.0)
        # A 400 reaches the client as an error with the status.
        self.assertFalse(r[-1]["ok"])
        self.assertEqual(r[-1]["status"], 400)
        self.assertIn("max_tokens", r[-1]["error"])

    def test_greedy_equals_generate_alone_and_under_32_clients(self):
        for prompt, text in zip(PROMPTS, self.greedy):
            got = self.server.complete({"prompt": prompt, "max_tokens": 40, "temperature": 0})
            self.assertEqual(got["choices"][0]["text"], text, prompt)
        results: dict[int, str] = {}
        errors: list[str] = []

        def client(i: int):
            try:
                body = {"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": 40, "temperature": 0}
                if i % 2:  # half of them streamed
                    status, text, _ = self.server.request("POST", "/v1/completions", {**body, "stream": True})
                    if status != 200:
                        raise AssertionError(f"{status} {text}")
                    events = [line[6:] for line in text.split("\n") if line.startswith("data: ")]
                    assert events[-1] == "[DONE]", events[-1]
                    results[i] = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])
                else:
                    results[i] = self.server.complete(body)["choices"][0]["text"]
            except Exception as e:  # noqa: BLE001 (reported below)
                errors.append(f"client {i}: {e}")

        threads = [threading.Thread(target=client, args=(i,)) for i in range(32)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self.assertEqual(errors, [])
        for i in range(32):
            self.assertEqual(results[i], self.greedy[i % len(PROMPTS)], f"client {i}")

    def test_a_draft_model_keeps_the_greedy_texts(self):
        """--draft (the served model as its own draft: nearly every draft kept): the greedy texts of
        loom generate alone, streamed or not; /metrics counts the drafts, the rate and the draft's time."""
        server = Server(self.ckpt, "--max-batch", "4", "--draft", self.ckpt, "--speculate", "3")
        try:
            for i, (prompt, text) in enumerate(zip(PROMPTS, self.greedy)):
                body = {"prompt": prompt, "max_tokens": 40, "temperature": 0}
                if i % 2:
                    status, raw, _ = server.request("POST", "/v1/completions", {**body, "stream": True})
                    self.assertEqual(status, 200, raw)
                    events = [line[6:] for line in raw.split("\n") if line.startswith("data: ")]
                    got = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])
                else:
                    got = server.complete(body)["choices"][0]["text"]
                self.assertEqual(got, text, prompt)
            m = server.metrics()
            self.assertGreater(m["loom_spec_draft_tokens_total"], 0)
            self.assertGreaterEqual(m["loom_spec_acceptance_rate"], 0.9)
            self.assertAlmostEqual(m["loom_spec_acceptance_rate"],
                                   m["loom_spec_accepted_tokens_total"] / m["loom_spec_draft_tokens_total"], places=5)
            self.assertGreater(m["loom_spec_draft_seconds_total"], 0)
            self.assertLess(m["loom_spec_draft_seconds_total"], m["loom_engine_seconds_total"])
        finally:
            self.assertEqual(server.stop(), 0)

    def test_prefix_cache_reuses_blocks_and_keeps_the_tokens(self):
        shared = "This License applies to any program or other work which contains a notice placed by the copyright holder"
        before = self.server.metrics()
        texts = [self.server.complete({"prompt": shared + tail, "max_tokens": 24, "temperature": 0})["choices"][0]["text"]
                 for tail in (" saying", " stating", " saying")]
        after = self.server.metrics()
        hits = after["loom_prefix_cache_hit_tokens_total"] - before["loom_prefix_cache_hit_tokens_total"]
        # The second and third prompts take the first's full blocks of 16: 96 of its 106 bytes each.
        self.assertGreaterEqual(hits, 2 * 96)
        self.assertGreater(after["loom_prefix_cache_blocks"], 0)
        self.assertGreater(after["loom_prefix_cache_hit_rate"], 0)
        # The same tokens as loom generate (no cache).
        prompts = os.path.join(self.tmp, "prefix.txt")
        with open(prompts, "w") as f:
            f.write(shared + " saying\n" + shared + " stating\n")
        out = os.path.join(self.tmp, "prefix.jsonl")
        run("generate", "--checkpoint", self.ckpt, "--prompts", prompts, "--greedy", "--tokens", "24", "--out", out)
        with open(out) as f:
            want = [json.loads(line)["text"] for line in f]
        self.assertEqual(texts, [want[0], want[1], want[0]])

    def test_disconnected_client_is_cancelled_and_frees_its_row(self):
        before = self.server.metrics()
        s = socket.create_connection(("127.0.0.1", self.server.port))
        body = json.dumps({"prompt": "A", "max_tokens": 250, "temperature": 0, "stream": True}).encode()
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        received = b""
        while b"data: " not in received:  # the stream began
            chunk = s.recv(4096)
            self.assertTrue(chunk, received)
            received += chunk
        s.close()
        m = self.cancelled_since(before)
        # Its blocks are back: only the prefix cache's remain.
        self.assertEqual(m["loom_kv_blocks_used"], m["loom_prefix_cache_blocks"])
        self.assertLess(m["loom_generation_tokens_total"] - before["loom_generation_tokens_total"], 250)

    def cancelled_since(self, before: dict) -> dict:
        """Waits (30 s at most) until one more request was cancelled and none runs; the metrics."""
        deadline = time.time() + 30
        while time.time() < deadline:
            m = self.server.metrics()
            if m["loom_requests_cancelled_total"] > before["loom_requests_cancelled_total"] and m["loom_running_requests"] == 0:
                break
            time.sleep(0.05)
        m = self.server.metrics()
        self.assertEqual(m["loom_requests_cancelled_total"], before["loom_requests_cancelled_total"] + 1)
        self.assertEqual(m["loom_running_requests"], 0)
        return m

    def test_disconnected_client_of_a_whole_response_is_cancelled(self):
        # Not streamed: nothing is written before the result (its status is the result's), and
        # the server still sees the client go and ends the request.
        before = self.server.metrics()
        s = socket.create_connection(("127.0.0.1", self.server.port))
        body = json.dumps({"prompt": "B", "max_tokens": 250, "temperature": 0}).encode()
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        deadline = time.time() + 30
        while time.time() < deadline and self.server.metrics()["loom_running_requests"] == before["loom_running_requests"]:
            time.sleep(0.02)  # it runs
        s.close()
        m = self.cancelled_since(before)
        self.assertLess(m["loom_generation_tokens_total"] - before["loom_generation_tokens_total"], 250)

    def test_bad_requests_are_400s_and_the_server_keeps_serving(self):
        long_prompt = "x" * 300
        cases = [
            ("/v1/completions", b'{"prompt": "a",', None),
            ("/v1/completions", b'{"prompt": "\xff\xfe"}', None),
            ("/v1/completions", None, {"prompt": "a", "max_tokens": 0}),
            ("/v1/completions", None, {"prompt": "a", "max_tokens": "ten"}),
            ("/v1/completions", None, {"prompt": "a", "temperature": "hot"}),
            ("/v1/completions", None, {"prompt": "a", "n": 9}),
            ("/v1/completions", None, {"prompt": long_prompt}),
            ("/v1/completions", None, {"prompt": "a", "stop": 5}),
            ("/v1/completions", None, {"prompt": ["a", 3]}),
            ("/v1/chat/completions", None, {"messages": "hi"}),
            ("/v1/chat/completions", None, {"messages": [{"role": 1, "content": "x"}]}),
        ]
        for path, raw, body in cases:
            status, text, _ = self.server.request("POST", path, body, raw=raw)
            self.assertEqual(status, 400, f"{raw or body}: {text}")
            error = json.loads(text)["error"]
            self.assertEqual(error["type"], "invalid_request_error")
            self.assertTrue(error["message"])
        status, text, _ = self.server.request("GET", "/v1/nothing")
        self.assertEqual(status, 404)
        self.assertIn("no route", json.loads(text)["error"]["message"])
        # A model this server does not serve: 404 naming the one it does (as OpenAI and vLLM).
        status, text, _ = self.server.request("POST", "/v1/completions", {"prompt": "a", "model": "gpt-4o"})
        self.assertEqual(status, 404, text)
        self.assertEqual(json.loads(text)["error"]["param"], "model")
        self.assertIn("'m'", json.loads(text)["error"]["message"])
        status, text, _ = self.server.request("GET", "/health")
        self.assertEqual((status, json.loads(text)["status"]), (200, "ok"))
        self.assertEqual(self.server.complete({"prompt": PROMPTS[0], "max_tokens": 40, "temperature": 0})["choices"][0]["text"],
                         self.greedy[0])
        status, text, _ = self.server.request("GET", "/v1/models")
        self.assertEqual(json.loads(text)["data"][0]["id"], "m")

    def test_metrics_are_prometheus_text(self):
        self.server.complete({"prompt": PROMPTS[2], "max_tokens": 5})
        _, text, headers = self.server.request("GET", "/metrics")
        self.assertTrue(headers["Content-Type"].startswith("text/plain"))
        for name in ("loom_requests_total", "loom_queue_length", "loom_batch_occupancy", "loom_kv_blocks_used",
                     "loom_kv_blocks_free", "loom_time_to_first_token_seconds", "loom_inter_token_latency_seconds",
                     "loom_prefix_cache_hit_rate"):
            self.assertIn(f"# TYPE {name} ", text)
        m = self.server.metrics()
        self.assertGreaterEqual(m['loom_requests_total{endpoint="/v1/completions",status="200"}'], 1)
        self.assertEqual(m['loom_time_to_first_token_seconds_bucket{le="+Inf"}'], m["loom_time_to_first_token_seconds_count"])
        self.assertGreater(m["loom_inter_token_latency_seconds_count"], 0)
        self.assertEqual(m["loom_kv_blocks_used"] + m["loom_kv_blocks_free"], 8 * 16)  # 8 rows x 256 / 16


class Limits(unittest.TestCase):
    """A full queue answers 429 with Retry-After, and SIGTERM drains: its own small server."""

    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="loom_serve_limits_")
        cls.ckpt = train_model(cls.tmp, 2)

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def test_full_queue_answers_429_and_loses_nothing_below_it(self):
        server = Server(self.ckpt, "--max-batch", "1", "--max-queue", "2")
        try:
            statuses: list[tuple[int, str, dict]] = []
            lock = threading.Lock()

            def client():
                got = server.request("POST", "/v1/completions", {"prompt": "a", "max_tokens": 250, "temperature": 0})
                with lock:
                    statuses.append(got)

            threads = [threading.Thread(target=client) for _ in range(10)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            codes = sorted(s for s, _, _ in statuses)
            self.assertEqual(len(codes), 10)
            self.assertTrue(set(codes) <= {200, 429}, codes)
            self.assertGreaterEqual(codes.count(200), 2)   # the queue's two at least
            self.assertGreaterEqual(codes.count(429), 1)
            for status, text, headers in statuses:
                if status == 429:
                    self.assertEqual(headers.get("Retry-After"), "1")
                    self.assertEqual(json.loads(text)["error"]["type"], "rate_limit_error")
                else:
                    self.assertEqual(json.loads(text)["choices"][0]["finish_reason"], "length")
        finally:
            self.assertEqual(server.stop(), 0)

    def refused_and_counted(self, server: Server, body: dict, status: int, words: str) -> None:
        """`body` is answered `status` with `words` in its message, counted under that status in
        /metrics, and the server serves on."""
        key = f'loom_requests_total{{endpoint="/v1/completions",status="{status}"}}'
        before = server.metrics().get(key, 0)
        got, text, _ = server.request("POST", "/v1/completions", body)
        self.assertEqual(got, status, text)
        self.assertIn(words, json.loads(text)["error"]["message"])
        self.assertEqual(server.metrics().get(key, 0), before + 1)
        self.assertEqual(len(server.complete({"prompt": "a", "max_tokens": 5})["choices"]), 1)

    def test_an_engine_failure_after_acceptance_is_a_500_not_a_200(self):
        # The engine fails while the request runs (injected at its third step): a non-streamed
        # client gets the failure's status (the heartbeat used to commit a 200 first).
        server = Server(self.ckpt, env=dict(ENV, LOOM_SERVE_FAIL_AT_STEP="2"))
        try:
            self.refused_and_counted(server, {"prompt": "a", "max_tokens": 20}, 500, "injected engine failure")
        finally:
            self.assertEqual(server.stop(), 0)

    def test_a_request_the_kv_pool_cannot_hold_is_a_400(self):
        # Refused before any work (4 blocks of 16 positions < 1 + 100), naming the blocks.
        server = Server(self.ckpt, "--kv-blocks", "4")
        try:
            self.refused_and_counted(server, {"prompt": "a", "max_tokens": 100}, 400, "KV blocks")
        finally:
            self.assertEqual(server.stop(), 0)

    def test_sigterm_drains_running_requests_then_exits_0(self):
        server = Server(self.ckpt, "--max-batch", "2", "--drain-timeout", "60")
        got: dict[str, object] = {}

        def long_request():
            got["response"] = server.request("POST", "/v1/completions",
                                             {"prompt": "a", "max_tokens": 250, "temperature": 0, "stream": True})

        t = threading.Thread(target=long_request)
        t.start()
        deadline = time.time() + 30
        while time.time() < deadline and server.metrics()["loom_running_requests"] == 0:
            time.sleep(0.002)
        server.proc.send_signal(signal.SIGTERM)
        time.sleep(0.05)
        try:
            status, text, _ = server.request("POST", "/v1/completions", {"prompt": "a", "max_tokens": 5})
            self.assertEqual(status, 503, text)
        except OSError:
            pass  # already closed: also no admission
        t.join(timeout=60)
        code = server.proc.wait(timeout=60)  # it exits by itself once drained
        server.stop()
        self.assertEqual(code, 0)
        status, text, _ = got["response"]
        self.assertEqual(status, 200)
        events = [line[6:] for line in text.split("\n") if line.startswith("data: ")]
        self.assertEqual(events[-1], "[DONE]")
        finishes = [json.loads(e)["choices"][0]["finish_reason"] for e in events[:-1]]
        self.assertEqual(finishes[-1], "length")  # it ran to its end: drained, not cut


if __name__ == "__main__":
    unittest.main(argv=[sys.argv[0], *sys.argv[2:]], verbosity=2)
