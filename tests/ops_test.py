#!/usr/bin/env python3
"""Operations end to end (docs/operations.md): preemption, chaos kills, rollback, async
checkpoints, full disks, locks, the watchdog, launch detection, hostile inputs and reports.

Usage: ops_test.py path/to/loom [unittest args]. Runs Loom as a user and a failing machine would:
signals at random moments, a tmpfs that fills up, a rank that stops. Needs root for the tmpfs
(the disk-full tests are skipped, saying so, without it) and mpirun for the multi-rank ones.
"""
import hashlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cli_test import LOOM, ROOT, TEXT, TINY, LoomCase, run  # noqa: E402  (the same binary and tiny model)
from report_check import check_report  # noqa: E402

# The chaos and preemption runs: long enough to be interrupted many times, validation only at the end.
STEPS = 1500
QUIET = "train.eval_every=0,sample.max_new_tokens=4"


def rank_pids(name: str, rank: int | None = None) -> list[int]:
    """The pids of `loom train` processes of run `name` (under mpirun: of OpenMPI rank `rank`)."""
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            continue
        args = cmd.split(b"\0")
        if args[0] != LOOM.encode() or len(args) < 2 or args[1] != b"train" or f"run.name={name},".encode() not in cmd + b",":
            continue  # (not `loom supervise ... -- loom train`, whose line names the run too)
        if rank is None or f"OMPI_COMM_WORLD_RANK={rank}".encode() in env:
            out.append(int(pid))
    return out


class Ops(LoomCase):
    prefix = "loom_ops_"

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.reference = {}

    @classmethod
    def tearDownClass(cls):
        subprocess.run(["umount", os.path.join(cls.tmp, "full")], capture_output=True)
        super().tearDownClass()

    def sets(self, name: str, steps: int, extra: str = "", runs: str = "") -> str:
        return (f"{TINY},train.steps={steps},data.dir={self.data},data.tokenizer=byte,"
                f"run.dir={runs or os.path.join(self.tmp, 'runs')},run.name={name}" + (f",{extra}" if extra else ""))

    def train(self, name: str, *args: str, steps: int = 8, extra: str = "", expect_ok: bool = True, runs: str = "",
              env: dict[str, str] | None = None):
        return run("train", "--set", self.sets(name, steps, extra, runs), *args, expect_ok=expect_ok, env=env)

    def start(self, name: str, *args: str, steps: int, extra: str = "", np: int = 1) -> subprocess.Popen:
        cmd = [LOOM, "train", "--set", self.sets(name, steps, extra), *args]
        env = dict(os.environ, OMP_NUM_THREADS="1" if np > 1 else "2")
        if np > 1:
            env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
            cmd = ["mpirun", "--oversubscribe", "-np", str(np), *cmd]
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def run_dir(self, name: str) -> str:
        return os.path.join(self.tmp, "runs", name)

    def ckpt(self, name: str, step: int) -> str:
        return os.path.join(self.run_dir(name), "checkpoints", f"step_{step:08d}")

    def state(self, name: str, step: int) -> dict[str, bytes]:
        """The final weights and optimizer state: the bytes of the checkpoint's tensors."""
        out = {}
        for f in ("model.safetensors", "optimizer.safetensors"):
            with open(os.path.join(self.ckpt(name, step), f), "rb") as fh:
                out[f] = fh.read()
        return out

    def records(self, name: str) -> list[dict]:
        with open(os.path.join(self.run_dir(name), "metrics.jsonl")) as f:
            return [json.loads(line) for line in f]

    def steps_done(self, name: str) -> int:
        path = os.path.join(self.run_dir(name), "metrics.jsonl")
        if not os.path.exists(path):
            return 0
        with open(path) as f:
            return sum(1 for line in f if '"loss_scale"' in line)

    def uninterrupted(self, np: int = 1) -> dict[str, bytes]:
        """The reference: the same STEPS-step run without interruption (one per rank count)."""
        if np not in self.reference:
            name = f"reference{np}"
            p = self.start(name, steps=STEPS, extra=QUIET, np=np)
            out, err = p.communicate(timeout=600)
            self.assertEqual(p.returncode, 0, out + err)
            self.reference[np] = self.state(name, STEPS)
        return self.reference[np]

    # ------------------------------------------------------------------ preemption and chaos

    def test_sigterm_checkpoints_exits_75_and_resumes_bitwise(self):
        p = self.start("term", steps=STEPS, extra=QUIET)
        t0 = time.time()
        while self.steps_done("term") < 50 and time.time() - t0 < 120:
            time.sleep(0.05)
        p.send_signal(signal.SIGTERM)
        t1 = time.time()
        out, err = p.communicate(timeout=60)
        self.assertEqual(p.returncode, 75, out + err)
        self.assertLess(time.time() - t1, 30)  # one step plus one checkpoint (generous for a loaded machine)
        m = re.search(r"stopped by SIGTERM after step (\d+); checkpoint (\S+);", out)
        self.assertIsNotNone(m, out)
        stopped = int(m.group(1))
        self.assertLess(stopped, STEPS)
        self.assertTrue(os.path.exists(os.path.join(m.group(2), "manifest.json")))
        r = self.train("term", "--resume", steps=STEPS, extra=QUIET)
        self.assertIn(f"(step {stopped})", r.stdout)
        self.assertEqual(self.state("term", STEPS), self.uninterrupted())

    def test_a_second_signal_exits_at_once_keeping_the_last_checkpoint(self):
        p = self.start("twice", steps=100000, extra=QUIET + ",train.checkpoint_every=20")
        t0 = time.time()
        while not os.path.isdir(self.ckpt("twice", 40)) and time.time() - t0 < 120:
            time.sleep(0.05)
        p.send_signal(signal.SIGINT)
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=60)
        self.assertIn(p.returncode, (75, 128 + signal.SIGINT), out + err)
        e = run("eval", "--checkpoint", self.run_dir("twice"), "--batches", "1")  # the newest valid checkpoint
        self.assertNotIn("corrupt", e.stderr)

    def test_chaos_sigkill_at_50_random_moments_resumes_bitwise(self):
        rng = random.Random(25)
        extra = QUIET + ",train.checkpoint_every=1"
        # 50 random points of the run (so the test does not depend on the machine's speed), each
        # reached and then a random 0-30 ms more: mid-step, mid-save, between the two.
        last = -1
        for target in sorted(rng.sample(range(1, STEPS - 20), 50)):
            p = self.start("chaos", "--resume", steps=STEPS, extra=extra)
            t0 = time.time()
            while self.steps_done("chaos") < target and p.poll() is None and time.time() - t0 < 120:
                time.sleep(0.001)
            time.sleep(rng.uniform(0.0, 0.03))
            p.kill()
            out, err = p.communicate(timeout=60)
            self.assertNotEqual(p.returncode, 0, "the run finished before its kill at step %d" % target)
            self.assertNotIn("corrupt", err)  # every checkpoint the kills left is whole
            m = re.search(r"resumed from \S+ \(step (\d+)\)", out)
            if m is not None:
                self.assertGreaterEqual(int(m.group(1)), last)  # never back before an earlier resume
                last = int(m.group(1))
        self.assertGreater(last, 0)
        r = self.train("chaos", "--resume", steps=STEPS, extra=extra)
        self.assertNotIn("corrupt", r.stderr)
        self.assertEqual(self.state("chaos", STEPS), self.uninterrupted())

    def test_chaos_one_rank_of_two_killed_10_times_resumes_bitwise(self):
        rng = random.Random(26)
        extra = QUIET + ",train.checkpoint_every=5"
        # The kills land at 10 random steps (in order), whichever moment of the step that is.
        for target in sorted(rng.sample(range(20, STEPS - 50), 10)):
            p = self.start("chaos_mpi", "--resume", steps=STEPS, extra=extra, np=2)
            victim, t0 = rng.randrange(2), time.time()
            while time.time() - t0 < 120 and p.poll() is None:
                pids = rank_pids("chaos_mpi", victim)
                if pids and self.steps_done("chaos_mpi") >= target:
                    os.kill(pids[0], signal.SIGKILL)
                    break
                time.sleep(0.002)
            out, err = p.communicate(timeout=120)  # the job ends: no rank waits forever
            self.assertNotEqual(p.returncode, 0, "the job finished before rank %d was killed" % victim)
            self.assertNotIn("corrupt", err)
        r = self.start("chaos_mpi", "--resume", steps=STEPS, extra=extra, np=2)
        out, err = r.communicate(timeout=600)
        self.assertEqual(r.returncode, 0, out + err)
        self.assertEqual(self.state("chaos_mpi", STEPS), self.uninterrupted(np=2))

    def test_resume_path_truncates_metrics_and_names_changed_keys(self):
        self.train("path", steps=12)
        r = self.train("path", "--resume", self.ckpt("path", 4), steps=12, extra="train.eval_batches=3")
        self.assertIn("resumed from", r.stdout)
        self.assertIn("(step 4)", r.stdout)
        self.assertIn("train.eval_batches: 2 -> 3", r.stderr)
        self.assertIn("metrics.jsonl: dropped", r.stderr)
        steps = [rec["step"] for rec in self.records("path") if "loss_scale" in rec]
        self.assertEqual(steps, list(range(1, 13)))  # each step once: 1-4 from the first run, 5-12 resumed
        self.assertEqual([rec["event"] for rec in self.records("path") if "event" in rec], ["start", "resume"])

    # ------------------------------------------------------------------ the run folder

    def test_a_run_folder_with_checkpoints_is_not_overwritten_without_asking(self):
        self.train("exists", steps=4)
        before = self.state("exists", 4)
        p = self.train("exists", steps=4, expect_ok=False)
        self.assert_one_line_error(p, "already holds a run", "--resume", "--overwrite")
        self.assertEqual(self.state("exists", 4), before)
        o = self.train("exists", "--overwrite", steps=2)
        self.assertIn("--overwrite: deleted checkpoints, metrics.jsonl", o.stdout)
        self.assertFalse(os.path.exists(self.ckpt("exists", 4)))
        self.assertEqual(len([r for r in self.records("exists") if "loss_scale" in r]), 2)

    def test_two_trainings_on_one_run_folder_the_second_is_refused(self):
        p = self.start("locked", steps=100000, extra=QUIET)
        t0 = time.time()
        while self.steps_done("locked") < 5 and time.time() - t0 < 120:
            time.sleep(0.05)
        q = self.train("locked", "--resume", steps=100000, expect_ok=False)
        p.kill()
        p.communicate()
        self.assert_one_line_error(q, "is in use by another loom train", f"pid {p.pid}")

    # ------------------------------------------------------------------ anomalies

    def test_nan_and_spike_policies(self):
        stop = self.train("anomaly", steps=12, extra="train.inject_fault_step=5", expect_ok=False)
        self.assert_one_line_error(stop, "loss is nan at step 5")
        skip = self.train("anomaly", "--overwrite", steps=12, extra="train.inject_fault_step=5,train.on_anomaly=skip")
        self.assertIn("step 6: loss nan is not finite; the batch at data position epoch 0, window 20 skipped", skip.stderr)
        rec = [r for r in self.records("anomaly") if "anomaly" in r]
        self.assertEqual([(r["step"], r["anomaly"], r["batch"]["index"]) for r in rec], [(6, "nonfinite", 20)])
        done = [r for r in self.records("anomaly") if "loss_scale" in r]
        self.assertEqual(len(done), 11)  # the skipped step has no step record
        roll = self.train("anomaly", "--overwrite", steps=40,
                          extra="train.inject_fault_step=30,train.inject_fault=spike,train.spike_zscore=6,"
                                "train.spike_window=10,train.on_anomaly=rollback")
        self.assertRegex(roll.stderr, r"step 31: loss \S+ is a spike \(z-score \S+\); the batch at data position epoch 0, "
                                      r"window 120 skipped; rolled back to the checkpoint of step 28")
        rec = [r for r in self.records("anomaly") if "anomaly" in r]
        self.assertEqual([(r["anomaly"], r["next_step"]) for r in rec], [("spike", 29)])
        losses = [r["loss"] for r in self.records("anomaly") if "loss_scale" in r]
        self.assertTrue(all(x < 10 for x in losses), losses)  # the spike never reached the weights
        self.assertTrue(os.path.exists(os.path.join(self.ckpt("anomaly", 40), "manifest.json")))

    # ------------------------------------------------------------------ asynchronous checkpoints

    def test_async_checkpoints_write_the_files_a_blocking_save_writes(self):
        self.train("blocking", steps=12, extra="train.checkpoint_every=3,train.keep_checkpoints=5")
        self.train("async", steps=12, extra="train.checkpoint_every=3,train.keep_checkpoints=5,train.async_checkpoint=true")
        for step in (3, 6, 9, 12):
            for f in ("model.safetensors", "optimizer.safetensors"):
                with open(os.path.join(self.ckpt("blocking", step), f), "rb") as a, \
                        open(os.path.join(self.ckpt("async", step), f), "rb") as b:
                    self.assertEqual(a.read(), b.read(), f"step {step} {f}")
            # trainer.json: the same but for the config text, which names train.async_checkpoint.
            with open(os.path.join(self.ckpt("blocking", step), "trainer.json")) as a, \
                    open(os.path.join(self.ckpt("async", step), "trainer.json")) as b:
                ja, jb = json.load(a), json.load(b)
            self.assertEqual(ja["config_text"].replace("async_checkpoint = false", "async_checkpoint = true")
                             .replace("name = 'blocking'", "name = 'async'"), jb["config_text"])
            ja.pop("config_text"), jb.pop("config_text")
            self.assertEqual(ja, jb)

    # ------------------------------------------------------------------ full disks

    def mount_tmpfs(self, kib: int) -> str:
        path = os.path.join(self.tmp, "full")
        subprocess.run(["umount", path], capture_output=True)
        os.makedirs(path, exist_ok=True)
        p = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={kib}k", "tmpfs", path], capture_output=True, text=True)
        if p.returncode != 0:
            self.skipTest(f"cannot mount a tmpfs (needs root): {p.stderr.strip()}")
        self.addCleanup(lambda: subprocess.run(["umount", path], capture_output=True))
        return path

    def test_disk_full_during_a_save_keeps_the_previous_checkpoint(self):
        full = self.mount_tmpfs(1200)  # a checkpoint of the tiny model is ~330 KB: the fourth does not fit
        extra = "train.checkpoint_every=4,train.keep_checkpoints=5"
        p = self.train("full", steps=40, extra=extra, runs=full, expect_ok=False)
        self.assertNotEqual(p.returncode, 0)
        self.assertIn(os.path.join(full, "full", "checkpoints"), p.stderr)
        self.assertIn("No space left on device", p.stderr)
        kept = sorted(d for d in os.listdir(os.path.join(full, "full", "checkpoints")) if not d.endswith(".tmp"))
        self.assertTrue(kept)
        e = run("eval", "--checkpoint", os.path.join(full, "full"), "--data", self.data, "--batches", "1")
        self.assertNotIn("corrupt", e.stderr)
        with open(os.path.join(full, "full", "metrics.jsonl")) as f:
            for line in f:
                json.loads(line)
        # Configured to keep training: the failed saves are reported, the run ends its steps.
        shutil.rmtree(os.path.join(full, "full"))
        k = self.train("full", steps=40, extra=extra + ",train.stop_on_save_error=false", runs=full, expect_ok=False)
        self.assertIn("checkpoint not saved", k.stderr)
        self.assertIn("training goes on", k.stderr)
        with open(os.path.join(full, "full", "metrics.jsonl")) as f:
            lines = f.read().split("\n")
        self.assertEqual(lines[-1], "")
        for line in lines[:-1]:
            json.loads(line)  # whole records only, whatever the disk did
        self.assertIn("step 40/40", k.stdout)  # it trained to the end

    # ------------------------------------------------------------------ hostile users

    def test_hostile_inputs_get_one_line_errors(self):
        good = self.train("hostile", steps=2)
        self.assertEqual(good.returncode, 0)
        ck = self.run_dir("hostile")
        self.assert_one_line_error(run("train", "--config", self.tmp, expect_ok=False), self.tmp, "not a config file")
        self.assert_one_line_error(run("train", "--config", "/dev/zero", expect_ok=False), "/dev/zero", "not a config file")
        self.assert_one_line_error(self.train("h2", extra="optim.lr=inf", expect_ok=False), "optim.lr", "finite")
        for n in ("0", "-3"):
            self.assert_one_line_error(run("eval", "--checkpoint", ck, "--batches", n, expect_ok=False), "--batches")
        self.assert_one_line_error(run("prepare", "--input", TEXT, "--tokenizer", "byte", "--out",
                                       os.path.join(self.tmp, "d0"), "--val-fraction", "0", expect_ok=False),
                                   "--val-fraction")
        self.assert_one_line_error(run("prepare", "--input", "/dev/zero", "--tokenizer", "byte", "--max-input-mb", "1",
                                       "--out", os.path.join(self.tmp, "dz"), expect_ok=False), "/dev/zero", "1048576")
        self.assert_one_line_error(run("generate", "--checkpoint", ck, "--prompt-file", "/dev/zero", expect_ok=False),
                                   "/dev/zero", "--prompt-file")
        # Non-finite weights are refused by name (a Hugging Face folder with a NaN written into it).
        hf = os.path.join(self.tmp, "nan_hf")
        run("convert", "--checkpoint", ck, "--to", "hf", "--out", hf)
        weights = os.path.join(hf, "model.safetensors")
        with open(weights, "r+b") as f:
            header = int.from_bytes(f.read(8), "little")
            meta = json.loads(f.read(header))
            name = sorted(k for k in meta if k != "__metadata__")[0]
            f.seek(8 + header + meta[name]["data_offsets"][0])
            f.write(b"\x00\x00\xc0\x7f")  # a float32 NaN
        self.assert_one_line_error(run("eval", "--checkpoint", hf, "--data", self.data, expect_ok=False),
                                   "holds nan", "non-finite", hf)

    def test_launches_that_cannot_be_wired_are_refused(self):
        env = dict(os.environ, WORLD_SIZE="2", RANK="1", LOCAL_RANK="1", MASTER_ADDR="127.0.0.1")
        p = subprocess.run([LOOM, "train", "--set", self.sets("torchrun", 2)], env=env, capture_output=True, text=True)
        self.assert_one_line_error(p, "WORLD_SIZE=2", "mpirun -np 2")
        env = dict(os.environ, SLURM_STEP_NUM_TASKS="4", SLURM_PROCID="3")
        p = subprocess.run([LOOM, "train", "--set", self.sets("srun", 2)], env=env, capture_output=True, text=True)
        self.assert_one_line_error(p, "srun started 4 tasks", "--mpi=pmix")
        self.assertFalse(os.path.exists(self.run_dir("torchrun")))

    def test_a_run_that_cannot_fit_in_memory_is_refused_before_allocating(self):
        p = run("train", "--set", f"train.batch_size=16384,run.dir={self.tmp}/runs,run.name=huge", expect_ok=False)
        self.assert_one_line_error(p, "needs an estimated", "available", "train.batch_size")

    def test_the_watchdog_names_a_stopped_rank(self):
        p = self.start("stopped", steps=100000, extra=QUIET + ",train.watchdog_seconds=4", np=2)
        t0 = time.time()
        while self.steps_done("stopped") < 20 and time.time() - t0 < 120:
            time.sleep(0.1)
        victim = rank_pids("stopped", 1)
        self.assertTrue(victim)
        os.kill(victim[0], signal.SIGSTOP)
        t1 = time.time()
        try:
            out, err = p.communicate(timeout=60)
        finally:
            for pid in rank_pids("stopped"):
                os.kill(pid, signal.SIGKILL)
        self.assertNotEqual(p.returncode, 0)
        self.assertLess(time.time() - t1, 60)
        line = [x for x in err.splitlines() if "no progress" in x]
        self.assertEqual(len(line), 1, err)
        self.assertIn("rank 0: no progress", line[0])
        self.assertIn("silent: rank 1", line[0])

    def test_quiet_prints_the_summary_and_verbose_every_step(self):
        q = self.train("quiet", "--quiet", steps=4)
        lines = [x for x in q.stdout.splitlines() if x.strip()]
        self.assertEqual(len(lines), 1, q.stdout)
        self.assertTrue(lines[0].startswith("done: 4 steps"), lines[0])
        v = self.train("verbose", "--verbose", steps=4)
        self.assertEqual(len(re.findall(r"^  step \d: grad norm \S+, 128 tokens in", v.stdout, re.M)), 4, v.stdout)

    # ------------------------------------------------------------------ MFU peak, OpenMP waits

    def test_mfu_is_against_the_compute_dtypes_peak_measured_once_and_cached(self):
        cache = os.path.join(self.tmp, "peak_cache")
        # LOOM_PEAK_BUSY_CHECK=0: this test is about the cache, which a busy machine (the suite's
        # own other tests, a second build) would otherwise leave empty; the check is the next test's.
        env = dict(os.environ, OMP_NUM_THREADS="2", LOOM_CACHE_DIR=cache, LOOM_PEAK_BUSY_CHECK="0")
        env.pop("OMP_WAIT_POLICY", None)
        env.pop("GOMP_SPINCOUNT", None)

        def train(name: str, extra: str = "", **more: str) -> tuple[str, dict]:
            p = self.train(name, steps=2, extra=extra, env=dict(env, **more))
            return p.stdout + p.stderr, self.records(name)[0]

        first, rec = train("peak_f32")
        self.assertRegex(first, r"f32 GEMM peak: \d+ GFLOP/s measured, \d+ datasheet-style \(2 threads x [\d.]+ GHz x \d+ FLOP/cycle\)")
        self.assertNotIn("cached", first)
        self.assertIn("threads: 2 per rank, OpenMP waits PASSIVE", first)  # the default, set by re-executing
        with open(os.path.join(cache, "gemm_peak.json")) as f:
            stored = json.load(f)
        (key, entry), = stored.items()
        # The key names the kernels measured (the backend's gemm_kernels), which the header states.
        self.assertRegex(key, r"^cpu \| .+ \| 2 threads \| f32 \| oneDNN sgemm, .+ \(cpu gemm r\d+\)$")
        kernels = key.split(" | f32 | ", 1)[1]
        self.assertIn(f"; kernels: {kernels}", first)
        self.assertEqual(rec["mfu_peak_dtype"], "f32")
        self.assertEqual(rec["mfu_peak_gflops"], entry["gflops"])
        self.assertGreater(rec["datasheet_peak_gflops"], 0)
        # The second run reads the same number instead of measuring it again.
        second, rec2 = train("peak_f32b", OMP_WAIT_POLICY="ACTIVE")
        self.assertIn(f"(cached in {cache}/gemm_peak.json)", second)
        self.assertIn("OpenMP waits ACTIVE", second)  # the user's choice is kept
        self.assertEqual(rec2["mfu_peak_gflops"], entry["gflops"])
        # A bf16 recipe is stated against the bf16 peak, added beside the f32 one.
        third, rec3 = train("peak_bf16", "precision.compute=bf16")
        self.assertRegex(third, r"bf16 GEMM peak: \d+ GFLOP/s measured, \d+ datasheet-style \(2 threads x [\d.]+ GHz x \d+ FLOP/cycle\)")
        self.assertEqual(rec3["mfu_peak_dtype"], "bf16")
        with open(os.path.join(cache, "gemm_peak.json")) as f:
            self.assertEqual(len(json.load(f)), 2)
        # mfu = tokens/s x FLOPs per token / peak: the same model's FLOPs per token from both runs
        # agree only if each divided by its own dtype's peak.
        def flops_per_token(name: str, peak: float) -> float:
            step = [r for r in self.records(name) if "mfu" in r][-1]
            return step["mfu"] * peak * 1e9 / step["tokens_per_s"]
        self.assertAlmostEqual(flops_per_token("peak_bf16", rec3["mfu_peak_gflops"]) /
                               flops_per_token("peak_f32", rec["mfu_peak_gflops"]), 1.0, places=6)
        # A peak cached for other kernels (an older Loom's GEMM path) is not this one's: measured again.
        with open(os.path.join(cache, "gemm_peak.json"), "w") as f:
            stale = key.rsplit("(cpu gemm r", 1)[0] + "(cpu gemm r0)"
            json.dump({stale: {"gflops": 1.0, "clock_ghz": 1.0, "gemm": "old"}}, f)
        _, rec_stale = train("peak_stale")
        self.assertGreater(rec_stale["mfu_peak_gflops"], 1.0)
        with open(os.path.join(cache, "gemm_peak.json")) as f:
            self.assertEqual(sorted(json.load(f)), sorted([stale, key]))
        # A cached peak below what the run reaches (measured while the machine was slower): the
        # run says so once, naming the file, and keeps the cached figure.
        with open(os.path.join(cache, "gemm_peak.json"), "w") as f:
            json.dump({key: {"gflops": 0.001, "clock_ghz": entry["clock_ghz"], "gemm": entry["gemm"]}}, f)
        low, rec_low = train("peak_low")
        self.assertEqual(rec_low["mfu_peak_gflops"], 0.001)
        self.assertEqual(low.count(f"is above the cached f32 GEMM peak (0 GFLOP/s in {cache}/gemm_peak.json)"), 1, low)
        # The measured peak warns only when a step's MFU exceeds it. Whether one does is timing: the
        # suite's other tests can make the measurement low (the busy check is off here), so assert
        # the implication, not the absence (once seen: 8 GFLOP/s cached, a step at 651%).
        step_mfus = [float(m) for m in re.findall(r"\| MFU ([\d.]+)% \|", second)]
        self.assertTrue(step_mfus, second)
        if any(m > 100.0 for m in step_mfus):
            self.assertIn("is above the cached f32 GEMM peak", second)
        # A corrupt cache is a warning and a new measurement, never a failed run.
        with open(os.path.join(cache, "gemm_peak.json"), "w") as f:
            f.write("{not json")
        fourth, _ = train("peak_bad")
        self.assertIn("warning", fourth)
        self.assertIn("measured,", fourth)
        with open(os.path.join(cache, "gemm_peak.json")) as f:
            self.assertIn("f32", "".join(json.load(f)))

    def test_one_two_and_four_threads_train_to_the_same_bits(self):
        # d_ff = 1024 > 768: the MLP's down projection is an A x B^T GEMM whose K oneDNN sums
        # differently on one thread (cpu_gemm.cpp slices it); 4 threads on 2 cores as well.
        extra = "model.d_model=256,model.n_head=4,model.n_kv_head=4,model.d_ff=1024,train.checkpoint_every=3"
        states = {}
        for threads in (1, 2, 4):
            name = f"threads{threads}"
            self.train(name, steps=3, extra=extra, env=dict(os.environ, OMP_NUM_THREADS=str(threads)))
            losses = [(r["loss"], r["grad_norm"]) for r in self.records(name) if "loss" in r]
            digests = {f: hashlib.sha256(b).hexdigest() for f, b in self.state(name, 3).items()}
            states[threads] = (losses, digests)  # digests: a failing assertEqual prints them, not megabytes
        self.assertEqual(len(states[1][0]), 3)
        self.assertEqual(states[1], states[2])
        self.assertEqual(states[1], states[4])

    # ------------------------------------------------------------------ two hosts

    def two_hosts(self) -> list[str]:
        """Two network namespaces joined by veth pairs to a bridge (10.78.0.1, .2; mpirun at .254), and
        mpirun's arguments to run one rank in each over TCP: OpenMPI's rsh launcher with an agent that
        runs its daemon through `ip netns exec`, shared memory off."""
        if os.geteuid() != 0 or shutil.which("ip") is None:
            self.skipTest("network namespaces need root and iproute2")
        def sh(*cmd):
            return subprocess.run(list(cmd), capture_output=True, text=True)
        def teardown():
            for i in (1, 2):
                sh("ip", "netns", "del", f"loomt{i}")
                sh("ip", "link", "del", f"loomtv{i}")
            sh("ip", "link", "del", "loomtbr")
        teardown()
        self.addCleanup(teardown)
        steps = [["ip", "link", "add", "loomtbr", "type", "bridge"], ["ip", "addr", "add", "10.78.0.254/24", "dev", "loomtbr"],
                 ["ip", "link", "set", "loomtbr", "up"]]
        for i in (1, 2):
            ns = ["ip", "netns", "exec", f"loomt{i}"]
            steps += [["ip", "netns", "add", f"loomt{i}"],
                      ["ip", "link", "add", f"loomtv{i}", "type", "veth", "peer", "name", "eth0", "netns", f"loomt{i}"],
                      ["ip", "link", "set", f"loomtv{i}", "master", "loomtbr", "up"],
                      ns + ["ip", "addr", "add", f"10.78.0.{i}/24", "dev", "eth0"], ns + ["ip", "link", "set", "eth0", "up"],
                      ns + ["ip", "link", "set", "lo", "up"]]
        for cmd in steps:
            p = sh(*cmd)
            if p.returncode != 0:
                self.skipTest(f"cannot build the namespaces ({' '.join(cmd)}: {p.stderr.strip()})")
        self.wait_for_the_bridge()
        agent, hosts = os.path.join(self.tmp, "netns_agent.sh"), os.path.join(self.tmp, "netns_hosts")
        # OpenMPI's plm_rsh_agent: "agent [options] HOST COMMAND...". Each "host" keeps its daemon's
        # session directory apart (orte_tmpdir_base): both have the same hostname, so they would
        # otherwise share /tmp/ompi.HOST.UID/jf.N, and one daemon's clean-up removed the other's
        # directory in a CI run ("A call to mkdir was unable to create the desired directory").
        with open(agent, "w") as f:
            f.write('#!/bin/sh\nwhile [ "${1#-}" != "$1" ]; do shift; done\nhost=$1; shift\n'
                    f'dir={self.tmp}/orte_${{host##*.}}; mkdir -p "$dir"\n'
                    'exec ip netns exec "loomt${host##*.}" env OMPI_MCA_orte_tmpdir_base="$dir" sh -c "$*"\n')
        os.chmod(agent, 0o755)
        with open(hosts, "w") as f:
            f.write("10.78.0.1 slots=1\n10.78.0.2 slots=1\n")
        net = "10.78.0.0/24"
        return ["--hostfile", hosts, "--mca", "plm_rsh_agent", agent, "--mca", "oob_tcp_if_include", net,
                "--mca", "btl", "tcp,self", "--mca", "btl_tcp_if_include", net, "-x", "OMP_NUM_THREADS"]

    def wait_for_the_bridge(self, seconds: float = 30.0):
        """Until a TCP connection from each namespace reaches mpirun's address (10.78.0.254): a
        daemon's first connection back to mpirun failed in one CI run on a busy machine."""
        import socket
        server = socket.socket()
        server.bind(("10.78.0.254", 0))
        server.listen(8)
        port = server.getsockname()[1]
        probe = f"import socket; socket.create_connection(('10.78.0.254', {port}), timeout=1).close()"
        try:
            for i in (1, 2):
                t0 = time.time()
                while True:
                    p = subprocess.run(["ip", "netns", "exec", f"loomt{i}", sys.executable, "-c", probe],
                                       capture_output=True, text=True)
                    if p.returncode == 0:
                        break
                    if time.time() - t0 > seconds:
                        self.fail(f"namespace loomt{i} cannot reach 10.78.0.254 after {seconds:.0f} s: {p.stderr.strip()}")
                    time.sleep(0.2)
        finally:
            server.close()

    def mpirun(self, launch: list[str], name: str, steps: int, extra: str, *args: str, background: bool = False):
        # rtc_hwloc_vmhole=none: the daemons do not share their hwloc topology through a shared-memory
        # mapping placed in a "hole" of the address space. The resumed run's second daemon crashed
        # there about one time in three (SIGSEGV in hwloc_shmem_topology_write, in orted, before
        # any rank starts), after the cut run's daemon on that host had died.
        env = dict(os.environ, OMP_NUM_THREADS="1", OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
                   OMPI_MCA_rtc_hwloc_vmhole="none")
        cmd = ["mpirun", *launch, "-np", "2", LOOM, "train", "--set", self.sets(name, steps, extra), *args]
        p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        return p if background else (p, *p.communicate(timeout=300))

    def test_two_hosts_over_network_namespaces(self):
        net = self.two_hosts()
        # DDP and tensor parallel over TCP between the "hosts" equal the same layouts on one host.
        for layout, extra in (("dp", ""), ("tp", "parallel.tp=2")):
            p, out, err = self.mpirun(net, f"hosts_{layout}", 20, extra)
            self.assertEqual(p.returncode, 0, out + err)
            q, out, err = self.mpirun(["--oversubscribe"], f"host_{layout}", 20, extra)
            self.assertEqual(q.returncode, 0, out + err)
            self.assertEqual(self.state(f"hosts_{layout}", 20), self.state(f"host_{layout}", 20), layout)
            losses = [[r["loss"] for r in self.records(n) if "loss_scale" in r] for n in (f"hosts_{layout}", f"host_{layout}")]
            self.assertEqual(losses[0], losses[1])
        # A link taken down mid-run: the job ends (the watchdog), and resumes once the link is back.
        extra = QUIET + ",train.checkpoint_every=25,train.watchdog_seconds=5"
        p = self.mpirun(net, "cut", 100000, extra, background=True)
        t0 = time.time()
        while not os.path.isdir(self.ckpt("cut", 50)) and time.time() - t0 < 120:
            time.sleep(0.05)
        subprocess.run(["ip", "link", "set", "loomtv2", "down"], check=True)
        t1 = time.time()
        try:  # both ranks end (the watchdog); mpirun itself reports once it reaches host 2's daemon again
            while rank_pids("cut") and time.time() - t1 < 60:
                time.sleep(0.2)
            self.assertEqual(rank_pids("cut"), [], "a rank outlived the cut link by 60 s")
        finally:
            subprocess.run(["ip", "link", "set", "loomtv2", "up"], check=True)
        out, err = p.communicate(timeout=120)
        self.assertNotEqual(p.returncode, 0)
        self.assertIn("no progress for", err)
        done = sorted(int(d[5:]) for d in os.listdir(os.path.join(self.run_dir("cut"), "checkpoints")) if not d.endswith(".tmp"))
        r, out, err = self.mpirun(net, "cut", done[-1] + 10, extra, "--resume")
        self.assertEqual(r.returncode, 0, out + err)
        self.assertIn(f"(step {done[-1]})", out)

    # ------------------------------------------------------------------ restarts

    def test_supervise_relaunches_a_killed_training_that_resumes_bitwise(self):
        cmd = [LOOM, "supervise", "--restarts", "2", "--backoff", "0.2", "--", LOOM, "train", "--set",
               self.sets("sup", STEPS, QUIET + ",train.checkpoint_every=50")]
        p = subprocess.Popen(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="2"), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
        t0 = time.time()
        while self.steps_done("sup") < 300 and time.time() - t0 < 120:
            time.sleep(0.02)
        victims = rank_pids("sup")
        self.assertEqual(len(victims), 1)
        os.kill(victims[0], signal.SIGKILL)
        out, err = p.communicate(timeout=300)
        self.assertEqual(p.returncode, 0, out + err)
        self.assertIn("exited with status 137; restart 1 of 2", err)
        self.assertIn("resumed from", out)
        self.assertEqual(self.state("sup", STEPS), self.uninterrupted())

    def test_supervise_gives_up_after_n_restarts(self):
        p = run("supervise", "--restarts", "2", "--backoff", "0", "--", LOOM, "train", "--set",
                self.sets("giveup", 12, "train.inject_fault_step=5"), expect_ok=False)
        self.assertEqual(p.returncode, 1)
        self.assertEqual(p.stderr.count("loss is nan at step 5"), 3)  # the first run and two restarts
        self.assertIn("failed 3 times (last exit status 1); giving up after 2 restarts", p.stderr)
        t = run("train", "--restarts", "1", "--set", self.sets("giveup2", 12, "train.inject_fault_step=5"),
                expect_ok=False)
        self.assertIn("restart 1 of 1", t.stderr)
        self.assertIn("failed 2 times", t.stderr)

    # ------------------------------------------------------------------ reports and traces

    def test_report_of_synthetic_and_real_runs(self):
        check_report(LOOM, self.tmp)
        self.train("reported", steps=8)
        p = run("report", self.run_dir("reported"))
        self.assertIn("report of 1 run", p.stdout)
        out = os.path.join(self.run_dir("reported"), "report")
        with open(os.path.join(out, "index.html")) as f:
            page = f.read()
        val = [r["val_loss"] for r in self.records("reported") if "val_loss" in r]
        self.assertIn(f"{val[-1]:.4f}", page)
        for svg in ("loss.svg", "lr.svg", "tokens_per_s.svg"):
            self.assertIn(svg, page)
            self.assertTrue(os.path.getsize(os.path.join(out, svg)) > 0)

    def test_trace_of_a_dp2_x_tp2_run_matches_the_ledger_and_step_times(self):
        p = self.start("traced", steps=4, extra="parallel.tp=2,train.trace=true,train.eval_every=2", np=4)
        out, err = p.communicate(timeout=300)
        self.assertEqual(p.returncode, 0, out + err)
        for rank in range(4):
            with open(os.path.join(self.run_dir("traced"), "trace", f"rank{rank}.json")) as f:
                trace = json.load(f)
            # The Chrome trace event format as Perfetto reads it.
            self.assertEqual(set(trace), {"traceEvents", "displayTimeUnit"})
            events = trace["traceEvents"]
            for e in events:
                self.assertIn(e["ph"], ("X", "M"), e)
                self.assertIsInstance(e["name"], str)
                self.assertEqual(e["pid"], rank)
                self.assertIsInstance(e["tid"], int)
                self.assertIsInstance(e["args"], dict)
                if e["ph"] == "X":
                    self.assertIsInstance(e["cat"], str)
                    self.assertGreaterEqual(e["ts"], 0)
                    self.assertGreaterEqual(e["dur"], 0)
            x = [e for e in events if e["ph"] == "X"]
            steps = sorted((e for e in x if e["cat"] == "step"), key=lambda e: e["ts"])
            self.assertEqual(len(steps), 4)
            for name in ("forward", "backward", "optimizer", "data", "gradient sync"):
                inside = [e for e in x if e["name"] == name]
                self.assertTrue(inside, name)
                for e in inside:  # each within a step
                    self.assertTrue(any(s["ts"] <= e["ts"] + 1e-3 and e["ts"] + e["dur"] <= s["ts"] + s["dur"] + 1e-3
                                        for s in steps), (name, e))
            comm = [e for e in x if e["cat"] == "comm"]
            self.assertEqual({e["args"]["group"] for e in comm} >= {"tp", "dp"}, True, {e["args"]["group"] for e in comm})
            # The collectives' bytes up to the end of the last step = the ledger in that step's record.
            metrics = os.path.join(self.run_dir("traced"), "metrics.jsonl" if rank == 0 else f"logs/metrics.rank{rank}.jsonl")
            with open(metrics) as f:
                records = [r for r in map(json.loads, f) if "loss_scale" in r]
            end = steps[-1]["ts"] + steps[-1]["dur"]
            sent = sum(e["args"]["sent"] for e in comm if e["ts"] + e["dur"] <= end + 1e-3)
            self.assertEqual(sent, records[-1]["comm_bytes_sent"])
            self.assertGreater(sent, 0)
            # The step events time what the metrics' seconds time (the trainer's step), and a little more.
            traced = sum(s["dur"] for s in steps) * 1e-6
            measured = sum(r["seconds"] for r in records)
            self.assertGreaterEqual(traced, measured * 0.999)
            self.assertLess(traced, measured * 1.05 + 0.01)
            parts = sum(e["dur"] for e in x if e["name"] in ("forward", "backward", "optimizer", "data")) * 1e-6
            self.assertLessEqual(parts, traced)


if __name__ == "__main__":
    unittest.main(argv=[sys.argv[0], "-v", *sys.argv[2:]])
