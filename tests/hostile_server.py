#!/usr/bin/python3
"""`loom serve` against hostile clients, on loopback (issue 41, "Hardening III"): one case per
defect the old server (cpp-httplib's own listener and thread pool) had.

  (a) 200 slowloris connections (a header sent a byte every 2 s) do not delay a normal request
      beyond 2 s, and each gets 408 at --request-timeout, however it trickles (a total deadline);
  (b) 100 silent half-sent requests (headers whole, body cut short) do not delay one beyond 2 s;
  (c) SIGTERM with 10 trickling clients and one that pipelines requests without reading the
      responses exits 0 within --drain-timeout 2 plus 1 s;
  (d) Content-Length: -5 and Content-Length: abc are answered 400 (a too large one 413, a chunked
      body 411), and the server keeps serving;
  (e) --port 99999, --port -1, --drain-timeout -5, --threads 0 exit non-zero with one line naming
      the flag;
  (f) one client opening more than --max-connections-per-client is refused the extra ones while
      a normal request from another address succeeds; --max-connections caps them all;
  (g) keep-alive: --keepalive-requests ends a connection after that many responses, and
      --keepalive-timeout closes an idle one;
  (h) the request bodies held at once are capped (256 MiB): the readers no longer cost a thread
      each, so announcing large bodies on many connections is answered 503.

The hostile connections come from other loopback addresses (127.0.0.2 and up: all of 127/8 is
the loopback interface on Linux) so that the per-client cap does not refuse them, and the
normal request from 127.0.0.1.  Standard library only; helpers from serve_test.py.
Run: /usr/bin/python3 tests/hostile_server.py build/bin/loom"""

from __future__ import annotations

import http.client
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serve_test import ENV, LOOM, ROOT, Server, train_model  # noqa: E402  (reads sys.argv[1])

__all__ = ["HostileServer"]  # what tests/hostile_test.py imports (on the sanitizer build)

# A request's beginning: its header block never ends (slowloris) ...
PARTIAL_HEADER = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nX-Slow: "
# ... or its body never does (a silent half-sent request).
PARTIAL_BODY = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: 100\r\n\r\n{\"prompt\": ")


def open_partial(port: int, count: int, data: bytes, first_source: int = 2, per_source: int = 50) -> list[socket.socket]:
    """`count` connections that each sent `data`, `per_source` from each of 127.0.0.<first_source>, ..."""
    socks = []
    for i in range(count):
        source = f"127.0.0.{first_source + i // per_source}"
        s = socket.create_connection(("127.0.0.1", port), timeout=10, source_address=(source, 0))
        s.sendall(data)
        socks.append(s)
    return socks


def close_all(socks: list[socket.socket]):
    for s in socks:
        try:
            s.close()
        except OSError:
            pass


def answered(socks: list[socket.socket]) -> list[socket.socket]:
    """The sockets the server has written to or closed (readable without blocking)."""
    ready, _, _ = select.select(socks, [], [], 0)
    return ready


def read_reply(s: socket.socket, timeout: float = 10) -> bytes:
    """What the server sends until it closes, or `timeout`; a reset ends it too."""
    s.settimeout(timeout)
    out = b""
    try:
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            out += chunk
    except (socket.timeout, ConnectionResetError):
        pass
    return out


class Trickle:
    """Sends one byte to each socket every `interval` seconds, for `bound` seconds at most."""

    def __init__(self, socks: list[socket.socket], interval: float = 2.0, bound: float = 60.0):
        self.socks, self.interval, self.bound = socks, interval, bound
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self):
        end = time.monotonic() + self.bound
        while not self.stopped.wait(self.interval) and time.monotonic() < end:
            for s in self.socks:
                try:
                    s.send(b"a")
                except OSError:
                    pass

    def stop(self):
        self.stopped.set()
        self.thread.join()


def normal_request(port: int, timeout: float = 60) -> tuple[int, dict, float]:
    """A small completion from 127.0.0.1: (status, body, seconds it took)."""
    start = time.monotonic()
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout, source_address=("127.0.0.1", 0))
    c.request("POST", "/v1/completions", body=json.dumps({"prompt": "a", "max_tokens": 2, "temperature": 0}),
              headers={"Content-Type": "application/json"})
    r = c.getresponse()
    body = r.read()
    c.close()
    return r.status, json.loads(body), time.monotonic() - start


def raw_exchange(port: int, data: bytes, timeout: float = 10) -> bytes:
    s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    s.sendall(data)
    out = read_reply(s, timeout)
    s.close()
    return out


class HostileServer(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="loom_hostile_")
        cls.ckpt = train_model(cls.tmp, 2)

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def serve(self, *extra: str) -> Server:
        server = Server(self.ckpt, "--max-batch", "4", *extra)
        self.addCleanup(self.stop_cleanly, server)
        return server

    def stop_cleanly(self, server: Server):
        """SIGTERM, and exit code 0 (on the sanitizer build: no report at exit, leaks included)."""
        code = server.stop(signal.SIGTERM, 60)
        self.assertEqual(code, 0, f"loom serve exited {code} after SIGTERM")

    def test_a_slowloris_does_not_starve_a_normal_request(self):
        # Old server: 200 trickling connections held its 88 pool threads (the read timeout
        # restarts with each byte), and a normal request waited over 60 s.
        server = self.serve("--request-timeout", "5")
        socks = open_partial(server.port, 200, PARTIAL_HEADER)
        self.addCleanup(close_all, socks)
        opened = time.monotonic()
        trickle = Trickle(socks, interval=2.0, bound=60.0)
        self.addCleanup(trickle.stop)
        time.sleep(2.5)  # every connection has trickled a byte
        self.assertEqual(answered(socks), [], "the slowloris connections are held, not refused")
        status, body, seconds = normal_request(server.port)
        print(f"\n  normal request under 200 slowloris connections: {seconds * 1000:.1f} ms", file=sys.stderr)
        self.assertEqual(status, 200, body)
        self.assertEqual(body["choices"][0]["finish_reason"], "length")
        self.assertLess(seconds, 2.0)
        # The deadline is total: trickling does not extend it. Each connection gets 408 at 5 s.
        time.sleep(max(0.0, opened + 6.0 - time.monotonic()))
        trickle.stop()
        replies = [read_reply(s, 10) for s in socks]
        timed_out = sum(r.startswith(b"HTTP/1.1 408 ") for r in replies)
        self.assertEqual(timed_out, len(socks), [r for r in replies if not r.startswith(b"HTTP/1.1 408 ")][:3])

    def test_b_silent_half_sent_requests_do_not_delay_a_normal_one(self):
        # Old server: 100 silent connections held 100 of 88 threads for the 30 s read timeout.
        server = self.serve()
        socks = open_partial(server.port, 100, PARTIAL_BODY)
        self.addCleanup(close_all, socks)
        time.sleep(0.5)
        status, body, seconds = normal_request(server.port)
        print(f"\n  normal request beside 100 silent half-sent requests: {seconds * 1000:.1f} ms", file=sys.stderr)
        self.assertEqual(status, 200, body)
        self.assertLess(seconds, 2.0)
        self.assertEqual(answered(socks), [], "held until --request-timeout, not refused")

    def test_c_sigterm_exits_within_the_drain_timeout_whatever_the_clients_do(self):
        # Old server: with 10 trickling clients, SIGTERM and --drain-timeout 5 did not stop it in
        # 100 s (httplib's stop() waits for the pool threads, each reading a trickle).
        server = self.serve("--drain-timeout", "2", "--keepalive-requests", "5000")
        socks = open_partial(server.port, 10, PARTIAL_HEADER)
        self.addCleanup(close_all, socks)
        trickle = Trickle(socks, interval=0.5, bound=30.0)
        self.addCleanup(trickle.stop)
        # And a client that pipelines 3000 requests for /metrics (6 KB each) and never reads: once
        # the socket buffers are full (4 MiB), its worker's write blocks (--write-timeout 30 s).
        reader = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        reader.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        reader.connect(("127.0.0.1", server.port))
        self.addCleanup(reader.close)
        reader.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n" * 3000)
        time.sleep(1.5)
        start = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        try:
            code = server.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            code = None
        seconds = time.monotonic() - start
        print(f"\n  exit after SIGTERM (--drain-timeout 2): {seconds:.2f} s", file=sys.stderr)
        self.assertEqual(code, 0, f"still running {seconds:.1f} s after SIGTERM" if code is None else "")
        self.assertLess(seconds, 3.0)

    def test_d_invalid_content_length_is_answered_400(self):
        # Old server: Content-Length: -5 closed the connection without a reply.
        server = self.serve()
        for value, status in (("-5", 400), ("abc", 400), ("1e3", 400), ("5, 6", 400), ("", 400),
                              ("99999999999999999999", 413), (str(9 << 20), 413)):
            reply = raw_exchange(server.port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                                 + f"Content-Length: {value}\r\n\r\n".encode() + b'{"prompt": "a"}')
            self.assertTrue(reply.startswith(f"HTTP/1.1 {status} ".encode()), f"Content-Length: {value!r}: {reply[:200]!r}")
            error = json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]
            self.assertEqual(error["type"], "invalid_request_error")
            self.assertIn("Content-Length" if status == 400 else "bytes", error["message"])
        reply = raw_exchange(server.port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                             b"5\r\nhello\r\n0\r\n\r\n")
        self.assertTrue(reply.startswith(b"HTTP/1.1 411 "), reply[:200])
        status, body, _ = normal_request(server.port)
        self.assertEqual(status, 200, body)

    def test_e_invalid_flags_are_one_line_errors(self):
        # Old server: --port 99999 printed that port and listened on 34463 (its low 16 bits);
        # --port -1, --drain-timeout -5 and --threads 0 were accepted too.
        cases = [(["--port", "99999"], "--port"), (["--port", "-1"], "--port"),
                 (["--port", "0", "--drain-timeout", "-5"], "--drain-timeout"), (["--port", "0", "--threads", "0"], "--threads"),
                 (["--port", "0", "--request-timeout", "0"], "--request-timeout"),
                 (["--port", "0", "--max-connections-per-client", "0"], "--max-connections-per-client")]
        for flags, name in cases:
            p = subprocess.Popen([LOOM, "serve", "--checkpoint", self.ckpt, *flags], cwd=ROOT, env=ENV,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            try:
                out, err = p.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
                out, err = p.communicate()
                self.fail(f"{' '.join(flags)}: accepted (still serving after 60 s): {out}")
            lines = [line for line in err.splitlines() if line.strip()]
            self.assertNotEqual(p.returncode, 0, f"{flags}: {out} {err}")
            self.assertEqual(len(lines), 1, f"{flags}: {err}")
            self.assertIn(name, lines[0])
            self.assertNotIn("listening", out)

    def test_f_connection_caps(self):
        # Old server: no cap; every connection took a pool thread.
        server = self.serve("--max-connections-per-client", "4", "--max-connections", "12")
        held = open_partial(server.port, 4, PARTIAL_HEADER, first_source=2)
        self.addCleanup(close_all, held)
        extra = open_partial(server.port, 3, PARTIAL_HEADER, first_source=2)
        self.addCleanup(close_all, extra)
        for s in extra:  # refused: a 503, then closed (or reset)
            reply = read_reply(s, 10)
            self.assertTrue(reply == b"" or reply.startswith(b"HTTP/1.1 503 "), reply[:200])
            if reply:
                self.assertIn(b"--max-connections-per-client", reply)
        self.assertEqual(answered(held), [], "the connections under the cap stay open")
        status, body, _ = normal_request(server.port)
        self.assertEqual(status, 200, body)
        # The total cap: the 4 held and 7 more from two other addresses make 11 of 12; one more
        # fits and the next is refused.
        more = open_partial(server.port, 4, PARTIAL_HEADER, first_source=3) + open_partial(server.port, 3, PARTIAL_HEADER, first_source=4)
        self.addCleanup(close_all, more)
        time.sleep(0.5)
        self.assertEqual(answered(more), [])
        last = open_partial(server.port, 2, PARTIAL_HEADER, first_source=5)
        self.addCleanup(close_all, last)
        self.assertEqual(answered(last[:1]), [])
        reply = read_reply(last[1], 10)
        self.assertTrue(reply == b"" or b"--max-connections)" in reply, reply[:200])

    def test_g_keepalive_limits(self):
        # Old server: a fixed 1000 requests per connection and a 5 s idle wait, no flags.
        server = self.serve("--keepalive-requests", "2", "--keepalive-timeout", "1")
        s = socket.create_connection(("127.0.0.1", server.port), timeout=10)
        self.addCleanup(s.close)
        request = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
        s.sendall(request * 3)  # pipelined: the connection ends after the second response
        reply = read_reply(s, 10)
        self.assertEqual(reply.count(b"HTTP/1.1 200 "), 2, reply)
        self.assertIn(b"Connection: close", reply.split(b"HTTP/1.1 200 ")[2])
        idle = socket.create_connection(("127.0.0.1", server.port), timeout=10)
        self.addCleanup(idle.close)
        idle.sendall(request)
        first = b""
        while not first.endswith(b'{"status":"ok"}'):
            chunk = idle.recv(65536)
            self.assertTrue(chunk, first)
            first += chunk
        self.assertTrue(first.startswith(b"HTTP/1.1 200 "), first)
        self.assertIn(b"Keep-Alive: timeout=1, max=2", first)
        self.assertEqual(read_reply(idle, 10), b"", "closed after the idle timeout")

    def test_h_bodies_held_at_once_are_capped(self):
        # Readers cost no thread now, so what they announce is capped instead: 256 MiB of bodies
        # from header block to answer; 32 announced bodies of 8 MiB (the largest) fill it.
        server = self.serve()
        header = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 8388608\r\n\r\n{"
        held = open_partial(server.port, 32, header, first_source=2, per_source=16)
        self.addCleanup(close_all, held)
        time.sleep(0.5)
        self.assertEqual(answered(held), [])
        one_more = open_partial(server.port, 1, header, first_source=4)
        self.addCleanup(close_all, one_more)
        reply = read_reply(one_more[0], 10)
        self.assertTrue(reply.startswith(b"HTTP/1.1 503 "), reply[:200])
        self.assertIn(b"too many request bodies", reply)
        held.pop().close()  # its 8 MiB are free again
        time.sleep(0.5)
        status, body, _ = normal_request(server.port)
        self.assertEqual(status, 200, body)


if __name__ == "__main__":
    unittest.main(argv=[sys.argv[0], *sys.argv[2:]], verbosity=2)
