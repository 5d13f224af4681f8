#!/usr/bin/python3
"""Signals at random moments of training, eval and generation (issue 41; docs/operations.md
"Signals"), run by ctest on the AddressSanitizer + UBSan build.

A signal handler that ran on a thread inside oneDNN's JIT GEMM corrupted the heap: the kernel
points the stack pointer into a heap workspace, and the signal frame lands there (oneDNN issue
#4845). Loom blocks asynchronous signals in every thread that computes and takes them on one
signal thread (src/loom/core/signals.h). Here `loom` runs with libloom_noop_handlers.so preloaded
(handlers that do nothing for SIGUSR1, SIGUSR2, SIGCHLD, SIGPROF and SIGWINCH, as a profiler's or
a runtime's would be) and receives such signals every few milliseconds, then a stop signal:
- training (6 runs): SIGCHLD / SIGUSR2 / SIGPROF / SIGWINCH throughout, then one of SIGTERM,
  SIGINT, SIGUSR1 at a random step; each run exits 75 with a checkpoint, and resuming it gives
  bitwise the weights and optimizer state of a run that was never interrupted;
- eval and generate (3 runs each): SIGUSR1 / SIGUSR2 / SIGCHLD / SIGPROF throughout, and in one
  run of each a SIGTERM or SIGINT at a random moment; each exits 0, or by that signal's default
  action, with no sanitizer report.
Over 100 deliveries in all (counted and asserted). Before the fix the same preloaded handlers
aborted a run with "corrupted size vs. prev_size" or "free(): invalid next size".

Usage: signal_test.py path/to/loom path/to/libloom_noop_handlers.so [unittest args]
"""
from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
import unittest

NOOP_LIB = os.path.abspath(sys.argv.pop(2)) if len(sys.argv) > 2 else ""
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cli_test import LOOM, ROOT, TEXT, LoomCase, run  # noqa: E402

# Large enough that the GEMMs are oneDNN's JIT kernels, small enough for a sanitized build.
MODEL = ("model.n_layer=2,model.n_head=4,model.n_kv_head=4,model.d_model=128,model.d_ff=512,model.max_seq_len=64,"
         "train.seq_len=64,train.batch_size=8,optim.warmup_steps=2,optim.lr=1e-3,train.eval_every=0,"
         "train.checkpoint_every=100,train.keep_checkpoints=2,sample.max_new_tokens=4")
STEPS = 40
NOISE = {  # the signals sent throughout, per command (no stop signal among them)
    "train": (signal.SIGCHLD, signal.SIGUSR2, signal.SIGPROF, signal.SIGWINCH),
    "other": (signal.SIGUSR1, signal.SIGUSR2, signal.SIGCHLD, signal.SIGPROF),
}
SANITIZER = re.compile(r"ERROR: (AddressSanitizer|LeakSanitizer)|runtime error:|corrupted|free\(\): invalid")


class Noise:
    """Sends a random signal of `kinds` to `pid` every 2-20 ms until stopped; counts them."""

    def __init__(self, pid: int, kinds: tuple, rng: random.Random):
        self.pid, self.kinds, self.rng, self.sent = pid, kinds, rng, 0
        self.done = threading.Event()
        self.thread = threading.Thread(target=self.loop, daemon=True)
        self.thread.start()

    def caught(self) -> int:
        """The signals the process has handlers for (SigCgt of /proc/PID/status), 0 if it is gone."""
        try:
            with open(f"/proc/{self.pid}/status") as f:
                return next(int(line.split()[1], 16) for line in f if line.startswith("SigCgt:"))
        except (OSError, StopIteration):
            return 0

    def loop(self):
        # From the moment the preloaded handlers are installed: a signal that came before them
        # (between exec and the library's constructor) would take its default action, which is
        # no test of Loom.
        while not self.caught() & (1 << (signal.SIGUSR2 - 1)):
            if self.done.wait(0.001):
                return
        while not self.done.wait(self.rng.uniform(0.002, 0.02)):
            try:
                os.kill(self.pid, self.rng.choice(self.kinds))
                self.sent += 1
            except ProcessLookupError:
                return

    def stop(self) -> int:
        self.done.set()
        self.thread.join()
        return self.sent


class Signals(LoomCase):
    prefix = "loom_signals_"
    delivered = 0

    @classmethod
    def tearDownClass(cls):
        print(f"\nsignal_test: {cls.delivered} signals delivered", file=sys.stderr)
        super().tearDownClass()

    def env(self) -> dict[str, str]:
        # OMP_WAIT_POLICY set: no re-execution (core/threads.h), whose first instants (before main)
        # no program can protect; tests/hostile_test.py sends a SIGTERM just after main starts.
        env = dict(os.environ, OMP_NUM_THREADS="2", OMP_WAIT_POLICY="PASSIVE")
        if NOOP_LIB:
            env["LD_PRELOAD"] = NOOP_LIB
            # the sanitizer runtime is not first in the list when a library is preloaded
            env["ASAN_OPTIONS"] = env.get("ASAN_OPTIONS", "") + ":verify_asan_link_order=0"
        return env

    def sets(self, name: str) -> str:
        return f"{MODEL},train.steps={STEPS},data.dir={self.data},data.tokenizer=byte,run.dir={self.tmp}/runs,run.name={name}"

    def start(self, *args: str) -> subprocess.Popen:
        return subprocess.Popen([LOOM, *args], cwd=ROOT, env=self.env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)

    def final_state(self, name: str) -> dict[str, bytes]:
        step = os.path.join(self.tmp, "runs", name, "checkpoints", f"step_{STEPS:08d}")
        out = {}
        for f in ("model.safetensors", "optimizer.safetensors"):
            with open(os.path.join(step, f), "rb") as fh:
                out[f] = fh.read()
        return out

    def steps_done(self, name: str) -> int:
        try:
            with open(os.path.join(self.tmp, "runs", name, "metrics.jsonl")) as f:
                return sum(1 for line in f if '"loss_scale"' in line)
        except OSError:
            return 0

    def assert_clean(self, p: subprocess.CompletedProcess | subprocess.Popen, out: str, err: str):
        self.assertIsNone(SANITIZER.search(err), err[-4000:])

    def reference(self) -> dict[str, bytes]:
        if not hasattr(Signals, "_reference"):
            run("train", "--set", self.sets("reference"), env=self.env())
            Signals._reference = self.final_state("reference")
        return Signals._reference

    def test_training_stops_with_a_checkpoint_that_resumes_bitwise(self):
        reference = self.reference()
        rng = random.Random(41)
        for trial in range(6):
            name = f"stopped{trial}"
            stop = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)[trial % 3]
            target = rng.randrange(1, STEPS - 5)
            p = self.start("train", "--set", self.sets(name))
            noise = Noise(p.pid, NOISE["train"], rng)
            t0 = time.time()
            while self.steps_done(name) < target and p.poll() is None and time.time() - t0 < 300:
                time.sleep(0.002)
            time.sleep(rng.uniform(0.0, 0.05))  # mid-step, most likely
            sent = noise.stop()
            p.send_signal(stop)
            out, err = p.communicate(timeout=300)
            Signals.delivered += sent + 1
            self.assert_clean(p, out, err)
            self.assertEqual(p.returncode, 75, f"trial {trial} ({stop.name} at step ~{target}, {sent} signals before):\n"
                             f"{out}\n{err[-4000:]}")
            m = re.search(rf"stopped by {stop.name} after step (\d+); checkpoint (\S+);", out)
            self.assertIsNotNone(m, out)
            self.assertTrue(os.path.exists(os.path.join(m.group(2), "manifest.json")), out)
            r = run("train", "--set", self.sets(name), "--resume", env=self.env())
            self.assertIn(f"(step {m.group(1)})", r.stdout)
            self.assertEqual(self.final_state(name), reference, f"trial {trial}: the resumed run differs")

    def signalled(self, args: list[str], stop_at: float | None, seed: int) -> tuple[int, str]:
        """Runs loom `args` under noise, and a SIGTERM or SIGINT after `stop_at` seconds if given."""
        rng = random.Random(seed)
        p = self.start(*args)
        noise = Noise(p.pid, NOISE["other"], rng)
        stop = rng.choice((signal.SIGTERM, signal.SIGINT))
        if stop_at is not None:
            try:
                p.wait(timeout=stop_at)
            except subprocess.TimeoutExpired:
                p.send_signal(stop)
                Signals.delivered += 1
        out, err = p.communicate(timeout=300)
        Signals.delivered += noise.stop()
        self.assert_clean(p, out, err)
        allowed = (0,) if stop_at is None else (0, -stop)
        self.assertIn(p.returncode, allowed, f"{args}: {out}\n{err[-4000:]}")
        return p.returncode, out

    def test_eval_and_generate_under_signals(self):
        self.reference()
        ckpt = os.path.join(self.tmp, "runs", "reference")
        rng = random.Random(42)
        for trial in range(3):
            stop_at = rng.uniform(0.5, 2.0) if trial == 2 else None
            code, out = self.signalled(["eval", "--checkpoint", ckpt, "--text", TEXT], stop_at, 100 + trial)
            if code == 0:
                self.assertRegex(out, r"loss")
            prompts = os.path.join(self.tmp, "prompts.txt")
            with open(prompts, "w") as f:
                f.write("The \nThis License\nYou may \nEach \n")
            code, out = self.signalled(["generate", "--checkpoint", ckpt, "--prompts", prompts, "--tokens", "48"],
                                       stop_at, 200 + trial)
            if code == 0:
                self.assertTrue(out.strip(), out)

    def test_zz_enough_signals_were_delivered(self):  # (unittest runs tests in name order)
        self.assertGreaterEqual(Signals.delivered, 100)


if __name__ == "__main__":
    unittest.main(argv=[sys.argv[0], "-v", *sys.argv[2:]])
