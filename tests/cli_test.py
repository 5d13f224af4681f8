#!/usr/bin/python3
"""End-to-end tests of the `loom` command line: a tiny run on a small text, bitwise resume,
KV-cache generation, and every bad input of issue 3 (one clear line, non-zero exit, no lost
data).  Run by ctest: cli_test.py <path to loom> ; stdlib only."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import unittest

import torch

LOOM = os.path.abspath(sys.argv[1]) if len(sys.argv) > 1 else "build/bin/loom"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEXT = "/usr/share/common-licenses/GPL-3"  # real English text present on every Debian system

TINY = ",".join([
    "model.n_layer=2", "model.n_head=2", "model.n_kv_head=2", "model.d_model=32", "model.d_ff=64",
    "model.max_seq_len=32", "train.seq_len=32", "train.batch_size=4", "optim.warmup_steps=2",
    "optim.lr=3e-3", "optim.min_lr=3e-4", "train.eval_every=4", "train.eval_batches=2",
    "train.checkpoint_every=4", "train.keep_checkpoints=3", "sample.max_new_tokens=16",
    "sample.prompt=\"The \"",
])


def run(*args: str, expect_ok: bool = True, cwd: str = ROOT, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = env if env is not None else dict(os.environ, OMP_NUM_THREADS="2")
    p = subprocess.run([LOOM, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    if expect_ok and p.returncode != 0:
        raise AssertionError(f"loom {' '.join(args)} failed ({p.returncode}):\n{p.stdout}\n{p.stderr}")
    return p


class LoomCase(unittest.TestCase):
    """A temporary folder with a byte-level dataset of TEXT (cli_test.py, ops_test.py)."""
    prefix = "loom_cli_"

    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix=cls.prefix)
        cls.data = os.path.join(cls.tmp, "data")
        run("prepare", "--input", TEXT, "--tokenizer", "byte", "--out", cls.data, "--val-fraction", "0.1")

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def assert_one_line_error(self, p: subprocess.CompletedProcess, *needles: str):
        self.assertNotEqual(p.returncode, 0, p.stdout + p.stderr)
        # (warnings, e.g. a resume's changed config keys, are lines of their own)
        lines = [line for line in p.stderr.splitlines() if line.strip() and ": warning: " not in line]
        self.assertEqual(len(lines), 1, p.stderr)
        for needle in needles:
            self.assertIn(needle, lines[0])


class Cli(LoomCase):

    def train(self, name: str, *extra: str, expect_ok: bool = True, steps: int = 8):
        sets = f"{TINY},train.steps={steps},data.dir={self.data},data.tokenizer=byte,run.dir={self.tmp}/runs,run.name={name}"
        return run("train", "--set", sets, *extra, expect_ok=expect_ok)

    def ckpt(self, name: str, step: int) -> str:
        return os.path.join(self.tmp, "runs", name, "checkpoints", f"step_{step:08d}")

    def assert_bad_input_line(self, sets: str, good: str, text: str, needle: str):
        """Training on `text` in place of the data.input file `good` fails naming the file and line."""
        bad = os.path.join(self.tmp, "bad_input.jsonl")
        with open(bad, "w") as f:
            f.write(text)
        p = run("train", "--set", sets.replace(good, bad), expect_ok=False)
        self.assert_one_line_error(p, bad + needle)

    # ---------------------------------------------------------------- the happy path

    def test_train_writes_run_folder_metrics_checkpoints_and_sample(self):
        p = self.train("happy")
        run_dir = os.path.join(self.tmp, "runs", "happy")
        for f in ("config.toml", "metrics.jsonl", "samples.txt"):
            self.assertTrue(os.path.exists(os.path.join(run_dir, f)), f)
        self.assertTrue(os.path.exists(os.path.join(self.ckpt("happy", 8), "manifest.json")))
        self.assertIn("validation loss", p.stdout)
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            self.assertGreaterEqual(sum(1 for _ in f), 8)

    def test_resume_is_bitwise_identical(self):
        self.train("straight")
        stopped = self.train("resumed", "--stop-at-step", "4")
        self.assertIn("stopped after step 4", stopped.stdout)
        self.assertFalse(os.path.exists(self.ckpt("resumed", 8)))
        resumed = self.train("resumed", "--resume")
        self.assertIn("resumed from", resumed.stdout)
        for f in ("model.safetensors", "optimizer.safetensors"):
            with open(os.path.join(self.ckpt("straight", 8), f), "rb") as a, open(os.path.join(self.ckpt("resumed", 8), f), "rb") as b:
                self.assertEqual(a.read(), b.read(), f)

    def test_resume_is_bitwise_for_stateful_optimizers(self):
        # LDAdam keeps error feedback in the gradient buffer, Muon two kinds of state, Adafactor factors.
        for opt in ("ldadam", "muon", "adafactor", "sgd"):  # plain SGD: no state at all
            sets = ("--set", f"optim.name={opt},optim.rank=4")
            self.train(f"straight_{opt}", *sets)
            self.train(f"resumed_{opt}", *sets, "--stop-at-step", "4")
            self.train(f"resumed_{opt}", *sets, "--resume")
            for f in ("model.safetensors", "optimizer.safetensors"):
                with open(os.path.join(self.ckpt(f"straight_{opt}", 8), f), "rb") as a, \
                        open(os.path.join(self.ckpt(f"resumed_{opt}", 8), f), "rb") as b:
                    self.assertEqual(a.read(), b.read(), f"{opt} {f}")

    def test_resume_is_bitwise_for_low_precision_recipes(self):
        # FP8 delayed scaling resumes its amax histories; stochastic rounding of bf16 master
        # weights draws from (seed, step); fp16 resumes its loss scaler.
        for name, sets in (("fp8d", "precision.compute=fp8-delayed,precision.fp8_amax_history=3"),
                           ("srb", "precision.compute=bf16,precision.master=bf16,precision.stochastic_rounding=true"),
                           ("fp16", "precision.compute=fp16,precision.loss_scaling=true")):
            self.train(f"straight_{name}", "--set", sets)
            self.train(f"resumed_{name}", "--set", sets, "--stop-at-step", "4")
            self.train(f"resumed_{name}", "--set", sets, "--resume")
            for f in ("model.safetensors", "optimizer.safetensors"):
                with open(os.path.join(self.ckpt(f"straight_{name}", 8), f), "rb") as a, \
                        open(os.path.join(self.ckpt(f"resumed_{name}", 8), f), "rb") as b:
                    self.assertEqual(a.read(), b.read(), f"{name} {f}")

    # ---------------------------------------------------------------- data parallel (mpirun)
    def mpirun(self, np: int, name: str, *extra: str, steps: int = 6, background: bool = False):
        sets = f"{TINY},train.steps={steps},data.dir={self.data},data.tokenizer=byte,run.dir={self.tmp}/runs,run.name={name}"
        env = dict(os.environ, OMP_NUM_THREADS="1", OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
        cmd = ["mpirun", "--oversubscribe", "-np", str(np), LOOM, "train", "--set", sets, *extra]
        if background:
            return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)

    def losses(self, name: str, key: str = "loss") -> list[float]:
        with open(os.path.join(self.tmp, "runs", name, "metrics.jsonl")) as f:
            return [r[key] for r in map(json.loads, f) if key in r]

    def assert_same_curve(self, reference: str, name: str, steps: int | None, key: str = "loss"):
        """Run `name`'s values of `key` equal `reference`'s within 1e-5 relative (and number `steps`)."""
        ref, other = self.losses(reference, key), self.losses(name, key)
        if steps is not None:
            self.assertEqual((len(ref), len(other)), (steps, steps), (reference, name))
        for a, b in zip(ref, other):
            self.assertLess(abs(a - b) / a, 1e-5, (name, key, ref, other))

    def test_mpirun_data_parallel_matches_one_process(self):
        self.train("dp_single", "--set", "train.batch_size=4,train.checkpoint_every=0", steps=6)
        p = self.mpirun(2, "dp_two", "--set", "train.batch_size=2,train.checkpoint_every=0")
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        self.assertIn("data parallel: 2 ranks", p.stdout)
        self.assert_same_curve("dp_single", "dp_two", 6)
        with open(os.path.join(self.tmp, "runs", "dp_two", "logs", "rank1.log")) as f:
            self.assertIn("data parallel", f.read())  # rank 1 logs to its own file, not stdout

    def test_dpo_data_parallel_and_resumed_match_one_process(self):
        pairs = os.path.join(ROOT, "examples", "dpo", "arithmetic_pairs.jsonl")
        dpo = (f"model.max_seq_len=96,train.seq_len=96,data.format=preference-jsonl,data.input={pairs},"
               "train.objective=dpo,train.eval_every=0,train.checkpoint_every=0")
        self.train("dpo_one", "--set", dpo + ",train.batch_size=8", steps=6)
        p = self.mpirun(2, "dpo_two", "--set", dpo + ",train.batch_size=4,parallel.zero_stage=1")
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        self.assert_same_curve("dpo_one", "dpo_two", 6)
        # Stopped and resumed: the reference comes from the initial weights again, the pairs
        # continue where they stopped.
        self.train("dpo_resumed", "--set", dpo + ",train.batch_size=8", "--stop-at-step", "3", steps=6)
        self.train("dpo_resumed", "--set", dpo + ",train.batch_size=8", "--resume", steps=6)
        self.assert_same_curve("dpo_one", "dpo_resumed", 6)

    def test_zero1_checkpoint_from_two_ranks_resumes_on_one(self):
        self.train("z_single", "--set", "train.batch_size=4", steps=8)
        p = self.mpirun(2, "z_sharded", "--set", "train.batch_size=2,parallel.zero_stage=1", "--stop-at-step", "4", steps=8)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        self.train("z_sharded", "--set", "train.batch_size=4", "--resume", steps=8)  # one process, whole state
        self.assert_same_curve("z_single", "z_sharded", 8)
        bad = self.mpirun(2, "z_lion", "--set", "optim.name=adafactor,parallel.zero_stage=1", steps=2)
        self.assertNotEqual(bad.returncode, 0)
        self.assertIn("element-wise optimizer", bad.stderr)

    def test_lora_checkpoints_from_two_ranks_resume_on_one(self):
        # LoRA under ZeRO-1, 2 and 3, tensor parallelism (with sp) and a pipeline: the checkpoint
        # holds one process's state (the adapters' optimizer state, the whole base), so a run
        # stopped on two ranks resumes on one.
        lora = 'peft.method=lora,peft.rank=4,peft.targets="q,k,v,o,up,down"'
        self.train("lz_single", "--set", lora + ",train.batch_size=4", steps=8)
        layouts = {f"lz_zero{z}": f"train.batch_size=2,parallel.zero_stage={z}" for z in (1, 2, 3)}
        layouts["lz_tp"] = "train.batch_size=4,parallel.tp=2,parallel.sequence_parallel=true"
        layouts["lz_pp"] = "train.batch_size=2,train.grad_accum=2,parallel.pp=2"
        for name, layout in layouts.items():
            p = self.mpirun(2, name, "--set", f"{lora},{layout}", "--stop-at-step", "4", steps=8)
            self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
            self.train(name, "--set", lora + ",train.batch_size=4", "--resume", steps=8)
            self.assert_same_curve("lz_single", name, 8)

    def test_zero3_checkpoint_from_four_ranks_resumes_on_two_and_on_one(self):
        # Global batch 4 throughout: 4 ranks x 1, then 2 x 2, then 1 x 4; the loss curve is the
        # single-process one (fp32, 1e-5) across both reshardings.
        self.train("r_single", "--set", "train.batch_size=4", steps=8)
        p = self.mpirun(4, "r_shard", "--set", "train.batch_size=1,parallel.zero_stage=3", "--stop-at-step", "4", steps=8)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        shard_files = sorted(f for f in os.listdir(self.ckpt("r_shard", 4)) if f.startswith("shard_"))
        self.assertEqual(shard_files, [f"shard_0000{r}_of_00004.safetensors" for r in range(4)])
        shutil.copytree(os.path.join(self.tmp, "runs", "r_shard"), os.path.join(self.tmp, "runs", "r_one"))
        self.train("r_one", "--set", "train.batch_size=4", "--resume", steps=8)  # 4 ranks -> 1 process directly
        p = self.mpirun(2, "r_shard", "--set", "train.batch_size=2,parallel.zero_stage=2", "--resume", "--stop-at-step",
                        "6", steps=8)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        self.assertIn("resumed from", p.stdout)
        self.train("r_shard", "--set", "train.batch_size=4", "--resume", steps=8)
        for name in ("r_shard", "r_one"):
            self.assert_same_curve("r_single", name, 8)
        # A sharded checkpoint is a checkpoint like any other for evaluation.
        e = run("eval", "--checkpoint", self.ckpt("r_shard", 6), "--data", self.data, "--batches", "2")
        self.assertIn("loss", e.stdout)

    def test_tensor_parallel_training_matches_one_process_and_resumes_on_one(self):
        self.train("tp_single", "--set", "train.batch_size=4", steps=8)
        p = self.mpirun(2, "tp_two", "--set", "train.batch_size=4,parallel.tp=2", "--stop-at-step", "4", steps=8)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        self.assertIn("mesh pp=1 x dp=1 x cp=1 x tp=2", p.stdout)
        self.train("tp_two", "--set", "train.batch_size=4", "--resume", steps=8)  # the whole-model checkpoint
        p = self.mpirun(4, "tp_four", "--set", "train.batch_size=2,parallel.tp=2,parallel.sequence_parallel=true",
                        steps=8)  # dp=2 x tp=2, sequence parallel
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        self.assertIn("sample", p.stdout)
        for name in ("tp_two", "tp_four"):
            self.assert_same_curve("tp_single", name, 8)

    def test_context_parallel_training_matches_one_process(self):
        self.train("cp_single", "--set", "train.batch_size=4", steps=6)
        for attention in ("ring", "ulysses"):
            p = self.mpirun(2, "cp_" + attention, "--set", "train.batch_size=4,parallel.cp=2,parallel.cp_attention=" +
                            attention, steps=6)
            self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
            self.assertIn("mesh pp=1 x dp=1 x cp=2 x tp=1", p.stdout)
            self.assert_same_curve("cp_single", "cp_" + attention, 6)
        # ZeRO shards over dp x cp (the ranks that average gradients); its sharded checkpoint resumes in one process.
        p = self.mpirun(2, "cp_zero", "--set", "train.batch_size=4,parallel.cp=2,parallel.zero_stage=2", "--stop-at-step",
                        "3", steps=6)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        self.assertIn("ZeRO-2 over 2 ranks", p.stdout)
        self.train("cp_zero", "--set", "train.batch_size=4", "--resume", steps=6)
        self.assert_same_curve("cp_single", "cp_zero", 6)

    def test_pipeline_parallel_training_matches_one_process_and_resumes_on_one(self):
        four = "model.n_layer=4,train.grad_accum=4,train.batch_size=2"
        self.train("pp_single", "--set", four, steps=6)
        p = self.mpirun(2, "pp_two", "--set", four + ",parallel.pp=2,parallel.schedule=1f1b", "--stop-at-step", "3",
                        steps=6)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        self.assertIn("mesh pp=2 x dp=1 x cp=1 x tp=1", p.stdout)
        self.train("pp_two", "--set", four, "--resume", steps=6)  # the whole model and optimizer state
        p = self.mpirun(2, "pp_inter", "--set", four + ",parallel.pp=2,parallel.schedule=interleaved,"
                        "parallel.virtual_stages=2", steps=6)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        self.assertIn("sample", p.stdout)
        for name in ("pp_two", "pp_inter"):
            self.assert_same_curve("pp_single", name, 6)
        self.assertTrue(self.losses("pp_inter", "val_loss"))
        self.assert_same_curve("pp_single", "pp_inter", None, "val_loss")  # evaluation runs through the stages too
        bad = self.mpirun(2, "pp_bad", "--set", four + ",parallel.pp=2,parallel.schedule=zigzag", steps=2)
        self.assertNotEqual(bad.returncode, 0)
        self.assertIn("parallel.schedule", bad.stderr)

    def test_zero_on_the_dp_dimension_of_tp_and_pp_resumes_on_one(self):
        # dp=2 x tp=2 with ZeRO-3 and dp=2 x pp=2 with ZeRO-1 (np 4): the one-process curve, and
        # their checkpoints (written whole) resume in one process.
        four = "model.n_layer=4,train.grad_accum=4,train.batch_size=2"
        self.train("zc_single", "--set", four, steps=6)
        p = self.mpirun(4, "zc_tp", "--set", "model.n_layer=4,train.grad_accum=4,train.batch_size=1,parallel.tp=2,"
                        "parallel.zero_stage=3", "--stop-at-step", "3", steps=6)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        self.assertIn("mesh pp=1 x dp=2 x cp=1 x tp=2", p.stdout)
        self.assertIn("ZeRO-3", p.stdout)
        self.train("zc_tp", "--set", four, "--resume", steps=6)
        p = self.mpirun(4, "zc_pp", "--set", "model.n_layer=4,train.grad_accum=4,train.batch_size=1,parallel.pp=2,"
                        "parallel.zero_stage=1", "--stop-at-step", "3", steps=6)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        self.assertIn("mesh pp=2 x dp=2 x cp=1 x tp=1", p.stdout)
        self.train("zc_pp", "--set", four, "--resume", steps=6)
        for name in ("zc_tp", "zc_pp"):
            self.assert_same_curve("zc_single", name, 6)
        bad = self.mpirun(4, "zc_bad", "--set", four + ",parallel.pp=2,parallel.zero_stage=2", steps=2)
        self.assertNotEqual(bad.returncode, 0)
        self.assertIn("use zero_stage 0 or 1", bad.stderr)

    def test_moe_resumes_bitwise_and_expert_parallel_matches_one_process(self):
        moe = ("model.moe_experts=4,model.moe_top_k=2,model.moe_d_ff=16,model.moe_shared=1,model.moe_bias_gamma=1e-2,"
               "model.moe_seq_aux_alpha=1e-2,model.moe_z_alpha=1e-3")
        self.train("moe_straight", "--set", moe)
        self.train("moe_resumed", "--set", moe, "--stop-at-step", "4")
        self.train("moe_resumed", "--set", moe, "--resume")  # the routing bias is in the weights
        for f in ("model.safetensors", "optimizer.safetensors"):
            with open(os.path.join(self.ckpt("moe_straight", 8), f), "rb") as a, \
                    open(os.path.join(self.ckpt("moe_resumed", 8), f), "rb") as b:
                self.assertEqual(a.read(), b.read(), f)
        with open(os.path.join(self.tmp, "runs", "moe_straight", "metrics.jsonl")) as f:
            routing = [r["moe"] for r in map(json.loads, f) if "moe" in r]
        self.assertEqual(len(routing), 8)
        self.assertEqual(len(routing[-1]), 2)  # both layers are MoE layers
        self.assertEqual(sum(routing[-1][0]["load"]), 2 * 4 * 32)  # top-2 of every token of the batch
        # ep = 2 over the two data-parallel ranks: the one-process curve; its checkpoint resumes in one process.
        p = self.mpirun(2, "moe_ep", "--set", moe + ",train.batch_size=2,parallel.ep=2", "--stop-at-step", "4", steps=8)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        self.assertIn("ep=2", p.stdout)
        self.train("moe_ep", "--set", moe, "--resume")
        self.assert_same_curve("moe_straight", "moe_ep", 8)
        bad = self.train("moe_bad", "--set", "parallel.ep=2", expect_ok=False)
        self.assert_one_line_error(bad, "parallel.ep")

    def test_mla_trains_resumes_and_pipelines_and_refuses_what_it_does_not_support(self):
        mla = "model.arch=llama,model.mla_kv_rank=16,model.mla_rope_dim=8,model.mla_v_dim=8,model.mla_q_rank=16"
        p = self.train("mla_straight", "--set", mla)
        self.assertIn("sample", p.stdout)  # decoded through the latent KV cache
        prompts = os.path.join(self.tmp, "mla_prompts.txt")
        with open(prompts, "w") as f:
            f.write("The \nA\n")
        g = run("generate", "--checkpoint", os.path.join(self.tmp, "runs", "mla_straight"), "--prompts", prompts,
                "--tokens", "6", "--kv", "int8")
        self.assertEqual(len(g.stdout.splitlines()), 2)
        self.train("mla_resumed", "--set", mla, "--stop-at-step", "4")
        self.train("mla_resumed", "--set", mla, "--resume")  # the MLA dimensions are in the checkpoint
        with open(os.path.join(self.ckpt("mla_straight", 8), "model.safetensors"), "rb") as a, \
                open(os.path.join(self.ckpt("mla_resumed", 8), "model.safetensors"), "rb") as b:
            self.assertEqual(a.read(), b.read())
        # Two pipeline stages, zero-bubble schedule (split backward): the one-process curve.
        p = self.mpirun(2, "mla_pp", "--set", mla + ",parallel.pp=2,parallel.schedule=zb-h1", steps=8)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        self.assert_same_curve("mla_straight", "mla_pp", 8)
        for extra, key in (("parallel.tp=2", "parallel.tp"), ("train.recompute=full", "train.recompute"),
                           ("precision.attn_qkv=bf16", "precision.attn_qkv"), ("model.arch=gpt2", "model.arch")):
            bad = self.train("mla_bad", "--set", mla + "," + extra, expect_ok=False, steps=2)
            self.assert_one_line_error(bad, "model.mla_kv_rank", key)

    def test_recompute_trains_bitwise_the_same_losses(self):
        self.train("rc_none", steps=4)
        for policy in ("selective", "full", "every:2"):
            p = self.train("rc_" + policy.replace(":", ""), "--set", "train.recompute=" + policy, steps=4)
            self.assertIn("recompute " + policy, p.stdout)
            self.assertEqual(self.losses("rc_none"), self.losses("rc_" + policy.replace(":", "")), policy)
        p = self.train("rc_budget", "--set", "train.recompute=budget,train.recompute_budget_mb=0.3", steps=4)
        self.assertIn("measured recompute", p.stdout)
        self.assertEqual(self.losses("rc_none"), self.losses("rc_budget"))
        bad = self.train("rc_bad", "--set", "train.recompute=sometimes", expect_ok=False)
        self.assert_one_line_error(bad, "train.recompute")

    def test_plan_ranks_the_layouts_that_fit_a_cluster(self):
        hw = os.path.join(ROOT, "configs", "hardware", "h100_8nodes.toml")
        p = run("plan", "--hardware", hw, "--config", os.path.join(ROOT, "configs", "llama3_70b.toml"), "--set",
                "train.seq_len=4096,precision.param=bf16,precision.reduce=bf16", "--global-batch", "512", "--top", "3")
        self.assertIn("8 nodes x 8 devices", p.stdout)
        rows = [line.split() for line in p.stdout.splitlines() if re.match(r"^ +[0-9]+  dp ", line)]
        self.assertEqual([r[0] for r in rows], ["1", "2", "3"], p.stdout)
        self.assertIn("across nodes", p.stdout)
        # The pipeline schedule mode is unchanged.
        self.assertIn("bubble fraction", run("plan", "--schedule", "1f1b", "--pp", "2", "--micro", "4").stdout)
        bad = os.path.join(self.tmp, "bad_hw.toml")
        with open(bad, "w") as f:
            f.write("[hardware]\nnodes = 2\ngpus = 8\n")
        self.assert_one_line_error(run("plan", "--hardware", bad, expect_ok=False), "hardware.gpus")
        with open(bad, "w") as f:
            f.write("[hardware]\nmemory_gib = -1\n")
        self.assert_one_line_error(run("plan", "--hardware", bad, expect_ok=False), "hardware.memory_gib")

    def test_memory_reproduces_the_zero_example_and_measures_itself(self):
        p = run("memory", "--set", "precision.param=bf16,precision.reduce=bf16,model.vocab_size=50257", "--ranks", "64",
                "--params", "7.5e9")
        self.assertIn("stage 0 120.0 GB | stage 1 (os) 31.4 GB | stage 2 (os+g) 16.6 GB | stage 3 (os+g+p) 1.9 GB", p.stdout)
        sets = f"{TINY},data.dir={self.data},data.tokenizer=byte,model.vocab_size=0,train.recompute=selective"
        p = run("memory", "--set", sets, "--measure")
        rows = [line.split() for line in p.stdout.splitlines() if line.startswith("  ") and len(line.split()) == 6]
        self.assertEqual([r[0] for r in rows], ["parameters", "gradients", "optimizer_state", "activations"], p.stdout)
        for r in rows:
            self.assertLess(abs(float(r[5]) - 1.0), 0.10, r)
        # LoRA with precision.param = bf16: the frozen block matrices and head in bf16 only, and the
        # f32 scratch their widened copies share, estimated and measured alike.
        # (256 wide: each matrix spans many pages, so released pages are the estimate's bytes; the
        # measured workspace also holds what the estimate leaves out.)
        lora = (f'{sets},model.d_model=256,model.n_head=4,model.n_kv_head=4,model.d_ff=1024,peft.method=lora,'
                'peft.rank=4,peft.targets="q,k,v,o,gate,up,down",model.arch=llama')
        p = run("memory", "--set", lora + ",precision.param=bf16", "--measure")
        rows = {line.split()[0]: line.split() for line in p.stdout.splitlines() if line.startswith("  ") and len(line.split()) == 6}
        self.assertLess(abs(float(rows["parameters"][5]) - 1.0), 0.02, p.stdout)
        self.assertGreater(float(rows["workspace"][5]), 1.0, p.stdout)
        units = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}
        f32 = re.search(r"parameters +([0-9.]+) (\w+)", run("memory", "--set", lora + ",precision.param=f32").stdout)
        self.assertLess(float(rows["parameters"][1]) * units[rows["parameters"][2]], float(f32.group(1)) * units[f32.group(2)])
        # Model-parallel layouts are estimated (the largest pipeline rank), not measured.
        p = run("memory", "--config", os.path.join(ROOT, "configs", "llama3_70b.toml"), "--set",
                "parallel.tp=8,parallel.pp=4,parallel.sequence_parallel=true,train.grad_accum=8", "--ranks", "4")
        self.assertIn("tp 8 (sequence parallel) x pp 4 (1f1b, 8 micro-batches)", p.stdout)
        self.assertIn("pipeline rank 0 (the largest)", p.stdout)
        self.assert_one_line_error(run("memory", "--set", "parallel.pp=2", "--measure", expect_ok=False), "pp")
        # A device budget the optimizer state overflows: refused naming the remedies; trains offloaded.
        big = self.train("budget_bad", "--set", "train.device_budget_mb=1.05", expect_ok=False, steps=2)
        self.assert_one_line_error(big, "train.device_budget_mb", "optim.offload")
        ok = self.train("budget_ok", "--set", "train.device_budget_mb=1.05,optim.offload=true", steps=2)
        self.assertIn("offloaded optimizer state", ok.stdout)

    def test_a_killed_rank_ends_the_whole_job(self):
        p = self.mpirun(2, "dead", "--set", "train.checkpoint_every=2,train.eval_every=0", steps=100000, background=True)
        import time
        log, victim, t0 = os.path.join(self.tmp, "runs", "dead", "logs", "rank1.log"), None, time.time()
        while victim is None and time.time() - t0 < 60:  # rank 1's pid, once it is training
            time.sleep(0.5)
            ck = os.path.join(self.tmp, "runs", "dead", "checkpoints")
            has_ckpt = os.path.isdir(ck) and any(d.startswith("step_") and not d.endswith(".tmp") for d in os.listdir(ck))
            if has_ckpt and os.path.exists(log) and "data parallel" in open(log).read():
                for pid in os.listdir("/proc"):
                    try:
                        with open(f"/proc/{pid}/environ", "rb") as f:
                            env = f.read().split(b"\0")
                        with open(f"/proc/{pid}/cmdline", "rb") as f:
                            cmd = f.read()
                    except OSError:
                        continue
                    if b"OMPI_COMM_WORLD_RANK=1" in env and b"run.name=dead" in cmd and cmd.startswith(LOOM.encode()):
                        victim = int(pid)
        self.assertIsNotNone(victim, "rank 1 never trained to a checkpoint")
        os.kill(victim, 9)
        t1 = time.time()
        out, err = p.communicate(timeout=60)  # raises if the job hangs
        self.assertLess(time.time() - t1, 60)
        self.assertNotEqual(p.returncode, 0)
        self.assertIn("rank 1", out + err)
        # The job resumes from its last complete checkpoint (here: for 2 more steps).
        ckpts = sorted(d for d in os.listdir(os.path.join(self.tmp, "runs", "dead", "checkpoints")) if d.startswith("step_")
                       and not d.endswith(".tmp"))
        self.assertTrue(ckpts, "no checkpoint before the kill")
        last = int(ckpts[-1][len("step_"):])
        r = self.mpirun(2, "dead", "--set", "train.checkpoint_every=2,train.eval_every=0", "--resume", steps=last + 2)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        self.assertIn(f"resumed from", r.stdout)
        self.assertTrue(os.path.isdir(self.ckpt("dead", last + 2)))

    def test_loss_scaler_state_is_checkpointed_and_restored(self):
        sets = ("--set", "precision.loss_scaling=true,precision.growth_interval=3")
        self.train("scaled", *sets, "--stop-at-step", "4")
        with open(os.path.join(self.ckpt("scaled", 4), "trainer.json")) as f:
            state = json.load(f)["extra"]["loss_scaler"]
        self.assertEqual((state["scale"], state["growth_tracker"]), (131072.0, 1))  # grew once at step 3
        self.train("scaled", *sets, "--resume")
        with open(os.path.join(self.ckpt("scaled", 8), "trainer.json")) as f:
            state = json.load(f)["extra"]["loss_scaler"]
        self.assertEqual((state["scale"], state["growth_tracker"]), (262144.0, 2))  # and at step 6

    def test_bf16_compute_trains_and_bad_value_names_the_key(self):
        p = self.train("bf16", "--set", "precision.compute=bf16")
        self.assertIn("validation loss", p.stdout)
        self.assert_one_line_error(self.train("fp7", "--set", "precision.compute=fp7", expect_ok=False), "precision.compute")
        self.assert_one_line_error(self.train("qat", "--set", "precision.qat=int3", expect_ok=False), "precision.qat")

    def test_resume_with_another_optimizer_names_both(self):
        self.train("switch", "--stop-at-step", "4")
        p = self.train("switch", "--resume", "--set", "optim.name=lion", expect_ok=False)
        self.assert_one_line_error(p, "optimizer.safetensors", "'adamw'", "'lion'")

    def test_dry_run_reports_optimizer_state_per_parameter(self):
        expected = {"adamw": "8.000", "lion": "4.000", "sgd": "0.000", "adam-mini": None, "sm3": None}
        for opt, per_param in expected.items():
            p = self.train(f"dry_{opt}", "--dry-run", "--set", f"optim.name={opt}")
            line = [l for l in p.stdout.splitlines() if l.startswith("optimizer state:")][0]
            measured = line.split("=")[1].split()[0]
            formula = line.split("formula:")[1].split(",")[1].split()[0]
            self.assertEqual(measured, formula, line)
            if per_param is not None:
                self.assertEqual(measured, per_param, line)
            self.assertIn("optimizer state", p.stdout)
            self.assertFalse(os.path.exists(os.path.join(self.tmp, "runs", f"dry_{opt}", "checkpoints")))
        self.assertLess(float(measured), 1.0)  # sm3: sublinear state

    def test_generate_is_reproducible_from_the_seed(self):
        self.train("gen")
        args = ("generate", "--checkpoint", os.path.join(self.tmp, "runs", "gen"), "--prompt", "The ", "--tokens", "20", "--seed", "5")
        a, b = run(*args), run(*args)
        self.assertEqual(a.stdout, b.stdout)
        self.assertTrue(a.stdout.startswith("The "))
        greedy = run("generate", "--checkpoint", self.ckpt("gen", 8), "--prompt", "The ", "--tokens", "20", "--greedy")
        self.assertTrue(greedy.stdout.startswith("The "))

    def test_generate_many_prompts_and_bench_generate(self):
        self.train("genmany")
        ckpt = os.path.join(self.tmp, "runs", "genmany")
        prompts = os.path.join(self.tmp, "prompts.txt")
        with open(prompts, "w") as f:
            f.write("The \nA fortune\n\nIt is\nWhy\nOnce upon\n")
        out = os.path.join(self.tmp, "gen.jsonl")
        p = run("generate", "--checkpoint", ckpt, "--prompts", prompts, "--out", out, "--tokens", "12", "--seed", "3",
                "--max-batch", "2", "--kv-block", "4")
        self.assertIn("5 prompts", p.stdout)
        with open(out) as f:
            rows = [json.loads(line) for line in f]
        self.assertEqual([r["prompt"] for r in rows], ["The ", "A fortune", "It is", "Why", "Once upon"])
        for r in rows:
            self.assertIn(r["finish"], ("length", "stop", "context"))
            self.assertGreater(r["tokens"], 0)
        # Each prompt's text does not depend on the others: alone (its seed is 3 + its index) it is the same.
        with open(prompts, "w") as f:
            f.write("The \n")
        alone = run("generate", "--checkpoint", ckpt, "--prompts", prompts, "--tokens", "12", "--seed", "3")
        self.assertEqual(json.loads(alone.stdout.splitlines()[0])["text"], rows[0]["text"])
        quantized = run("generate", "--checkpoint", ckpt, "--prompts", prompts, "--tokens", "12", "--kv", "int8")
        self.assertIn("KV cache int8", quantized.stderr)
        self.assert_one_line_error(run("generate", "--checkpoint", ckpt, "--prompts", prompts, "--kv", "int3",
                                       expect_ok=False), "kivi2")
        b = run("bench", "generate", "--checkpoint", ckpt, "--requests", "4", "--prompt-tokens", "4", "--new-tokens", "6",
                "--max-batch", "4", "--ppl", "fp32,int8", "--ppl-sequences", "2")
        self.assertIn("every request the same tokens: yes", b.stdout)
        self.assertRegex(b.stdout, r"ratio [0-9.]+x")
        self.assertRegex(b.stdout, r"int8 +[0-9.]+ +[0-9.]+")
        # A random model's weights in bf16, used in place as a bf16 folder's are; refused with a
        # checkpoint (its own dtype decides).
        r = run("bench", "generate", "--bf16-weights", "--requests", "2", "--prompt-tokens", "4", "--new-tokens", "6",
                "--set", f"{TINY},data.dir={self.data},data.tokenizer=byte")
        self.assertRegex(r.stdout, r"\([1-9][0-9]* linear weights in bf16 in place\)")
        self.assertIn("every request the same tokens: yes", r.stdout)
        # Sampled requests (each its own seed): batched, each gets the tokens it gets alone; a bad
        # setting is one line naming the key.
        r = run("bench", "generate", "--checkpoint", ckpt, "--requests", "3", "--prompt-tokens", "4", "--new-tokens", "6",
                "--temperature", "1", "--top-p", "0.9")
        self.assertIn("(sampled at temperature 1, top_k 0, top_p 0.9)", r.stdout)
        self.assertIn("every request the same tokens: yes", r.stdout)
        self.assert_one_line_error(run("bench", "generate", "--checkpoint", ckpt, "--top-p", "2", expect_ok=False),
                                   "sample.top_p")
        self.assert_one_line_error(run("bench", "generate", "--checkpoint", ckpt, "--bf16-weights", expect_ok=False),
                                   "--bf16-weights")
        # The decoding team's spin window (core/threads.h): a bad value is one line naming the
        # variable, before any work (here before the model is built; train would not start).
        bad_spin = dict(os.environ, OMP_NUM_THREADS="2", LOOM_SPIN_US="1ms")
        p = run("bench", "generate", "--bf16-weights", "--requests", "1", "--prompt-tokens", "4", "--new-tokens", "2",
                "--set", f"{TINY},data.dir={self.data},data.tokenizer=byte", expect_ok=False, env=bad_spin)
        self.assert_one_line_error(p, "LOOM_SPIN_US", "'1ms'")
        self.assertNotIn("random init", p.stdout)
        self.assert_one_line_error(run("train", "--set", f"{TINY},data.dir={self.data}", expect_ok=False, env=bad_spin),
                                   "LOOM_SPIN_US")

    def test_memory_serve_states_the_pool_and_the_step_workspace(self):
        """loom memory --serve: the KV pool and step workspace `loom serve` states for the same flags;
        the workspace grows with --prefill-chunk and is unbounded without chunks (0); the model's
        measured resident bytes are at least its fp32 parameters."""
        self.train("mem_serve", steps=2)
        ckpt = os.path.join(self.tmp, "runs", "mem_serve")

        def stated(*flags):
            out = run("memory", "--serve", "--checkpoint", ckpt, "--max-batch", "2", "--kv-blocks", "40", *flags).stdout
            m = re.search(r"measured resident\) ([0-9.]+ \w+)\n  KV pool \(reserved\) ([0-9.]+ \w+)\n"
                          r"  step workspace ([^\n]+)\n  total ([^\n]+)", out)
            self.assertIsNotNone(m, out)
            return m.groups()

        _, kv, small, _ = stated("--prefill-chunk", "8")
        loaded, kv2, large, total = stated("--prefill-chunk", "64")
        self.assertEqual(kv, kv2)
        to_bytes = lambda t: float(t.split()[0]) * {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}[t.split()[1]]
        self.assertGreater(to_bytes(large), to_bytes(small))
        # one run's total against the same run's measured resident bytes (two runs' differ by pages)
        self.assertGreater(to_bytes(total), to_bytes(loaded) + to_bytes(kv))
        self.assertIn("unbounded", stated("--prefill-chunk", "0")[3])
        # loom serve's banner states the same pool and workspace for the same flags
        proc = subprocess.Popen([LOOM, "serve", "--checkpoint", ckpt, "--port", "0", "--max-batch", "2", "--kv-blocks",
                                 "40", "--prefill-chunk", "64"], cwd=self.tmp, stdout=subprocess.PIPE, text=True)
        try:
            banner = proc.stdout.readline()
        finally:
            proc.terminate()
            proc.wait()
            proc.stdout.close()
        self.assertIn(f"blocks of 16 ({kv})", banner)
        self.assertIn(f"step workspace {large}", banner)

    def test_generate_with_a_draft_model(self):
        """--draft: a smaller model of the same tokenizer proposes tokens the model verifies: greedy
        texts equal the model's alone (generate --prompts), bench generate reports the drafts kept
        and the draft's time; a draft with a shorter context and --draft-p-min out of range are
        refused naming them."""
        self.train("target", steps=12)
        self.train("draft", "--set", "model.n_layer=1", steps=12)
        self.train("short", "--set", "model.n_layer=1,model.max_seq_len=16,train.seq_len=16", steps=4)
        target, draft = os.path.join(self.tmp, "runs", "target"), os.path.join(self.tmp, "runs", "draft")
        prompts = os.path.join(self.tmp, "draft_prompts.txt")
        with open(prompts, "w") as f:
            f.write("The \nA fortune\nIt is\nWhy\n")
        texts = []
        for extra in ((), ("--draft", draft), ("--draft", draft, "--speculate", "2"), ("--draft", target)):
            out = os.path.join(self.tmp, "draft.jsonl")
            run("generate", "--checkpoint", target, "--prompts", prompts, "--greedy", "--tokens", "12", "--out", out,
                "--max-batch", "2", *extra)
            with open(out) as f:
                texts.append([json.loads(line)["text"] for line in f])
        for t in texts[1:]:
            self.assertEqual(t, texts[0])
        b = run("bench", "generate", "--checkpoint", target, "--draft", target, "--requests", "2", "--prompt-tokens", "4",
                "--new-tokens", "8", "--max-batch", "1")
        m = re.search(r"draft model .*up to 4 drafts\): (\d+) drafted, (\d+) accepted .* s of its [0-9.]+ s in the draft", b.stdout)
        self.assertIsNotNone(m, b.stdout)
        self.assertGreater(int(m.group(1)), 0)
        self.assertGreaterEqual(int(m.group(2)), int(m.group(1)) * 9 // 10)  # its own weights: nearly every draft kept
        self.assertIn("every request the same tokens: yes", b.stdout)
        self.assert_one_line_error(run("generate", "--checkpoint", target, "--prompts", prompts, "--draft",
                                       os.path.join(self.tmp, "runs", "short"), expect_ok=False), "draft model's context", "16")
        self.assert_one_line_error(run("bench", "generate", "--checkpoint", target, "--draft", draft, "--draft-p-min", "2",
                                       "--prompt-tokens", "4", "--new-tokens", "8",
                                       expect_ok=False), "--draft-p-min")

    def test_eval_reports_loss_and_perplexity(self):
        self.train("ev")
        p = run("eval", "--checkpoint", os.path.join(self.tmp, "runs", "ev"))
        self.assertIn("val loss", p.stdout)
        self.assertIn("perplexity", p.stdout)

    def test_convert_to_hf_and_back_is_byte_identical_and_generates_the_same(self):
        for arch in ("gpt2", "llama"):
            name = f"conv_{arch}"
            self.train(name, "--set", f"model.arch={arch}", steps=4)
            hf = os.path.join(self.tmp, f"{name}_hf")
            back = os.path.join(self.tmp, f"{name}_back")
            run("convert", "--to", "hf", "--checkpoint", os.path.join(self.tmp, "runs", name), "--out", hf)
            with open(os.path.join(hf, "config.json")) as f:
                self.assertEqual(json.load(f)["model_type"], arch)
            run("convert", "--to", "loom", "--checkpoint", hf, "--out", back, "--tokenizer", "byte")
            original = os.path.join(self.ckpt(name, 4), "model.safetensors")
            converted = os.path.join(back, "checkpoints", "step_00000000", "model.safetensors")
            with open(original, "rb") as a, open(converted, "rb") as b:
                self.assertEqual(a.read(), b.read(), arch)
            # The same greedy continuation from the run, the Hugging Face folder and the round trip.
            outs = [run("generate", "--checkpoint", c, "--prompt", "The ", "--tokens", "12", "--greedy").stdout
                    for c in (self.ckpt(name, 4), back)]
            self.assertEqual(outs[0], outs[1], arch)
        p = run("convert", "--to", "hf", "--checkpoint", os.path.join(self.tmp, "nowhere"), "--out", hf, expect_ok=False)
        self.assert_one_line_error(p, "nowhere")

    def test_init_from_a_checkpoint_or_its_hf_export_trains_the_same(self):
        self.train("init_src", "--set", "model.arch=llama", steps=4)
        hf = os.path.join(self.tmp, "init_src_hf")
        run("convert", "--to", "hf", "--checkpoint", os.path.join(self.tmp, "runs", "init_src"), "--out", hf)

        def losses(name: str) -> list[float]:
            with open(os.path.join(self.tmp, "runs", name, "metrics.jsonl")) as f:
                return [json.loads(line)["loss"] for line in f if '"loss"' in line]

        a = self.train("init_a", "--set", f"train.init_from={os.path.join(self.tmp, 'runs', 'init_src')}", steps=3)
        self.train("init_b", "--set", f"train.init_from={hf}", steps=3)
        self.train("init_c", steps=3)
        self.assertIn("weights from", a.stdout)
        self.assertIn("llama", a.stdout)  # the model is the weights' (TINY says gpt2)
        self.assertEqual(losses("init_a"), losses("init_b"))
        self.assertNotEqual(losses("init_a")[0], losses("init_c")[0])
        p = self.train("init_bad", "--set", f"train.init_from={os.path.join(self.tmp, 'nowhere')}", expect_ok=False)
        self.assert_one_line_error(p, "nowhere")

    def test_lora_fine_tuning_exports_adapters_and_merged_weights(self):
        # A base model exported to Hugging Face layout, LoRA-fine-tuned from there (train.init_from
        # + peft.*), its adapters written in PEFT's layout and merged into a Hugging Face folder.
        self.train("lora_base", "--set", "model.arch=llama", steps=4)
        hf = os.path.join(self.tmp, "lora_base_hf")
        run("convert", "--to", "hf", "--checkpoint", os.path.join(self.tmp, "runs", "lora_base"), "--out", hf,
            "--tokenizer", "byte")
        peft = f"train.init_from={hf},peft.method=lora,peft.rank=4,peft.alpha=8,peft.targets=\"q,k,v,o,gate,up,down\""
        p = self.train("lora_ft", "--set", peft + ",optim.lr=0.01", steps=6)
        self.assertIn("LoRA: rank 4, alpha 8 (scale 2), targets q,k,v,o,gate,up,down", p.stdout)
        self.assertIn("the base is frozen", p.stdout)
        ft = os.path.join(self.tmp, "runs", "lora_ft")
        adapter, merged = os.path.join(self.tmp, "lora_adapter"), os.path.join(self.tmp, "lora_merged")
        run("convert", "--to", "peft", "--checkpoint", ft, "--out", adapter)
        with open(os.path.join(adapter, "adapter_config.json")) as f:
            cfg = json.load(f)
        self.assertEqual((cfg["peft_type"], cfg["r"], cfg["lora_alpha"]), ("LORA", 4, 8))
        self.assertEqual(cfg["target_modules"], ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
        p = run("convert", "--to", "hf", "--checkpoint", ft, "--out", merged, "--tokenizer", "byte")
        self.assertIn("merged the LoRA adapters", p.stdout)
        text = os.path.join(self.tmp, "lora_eval.txt")
        with open(text, "w") as f:
            f.write("The quick brown fox jumps over the lazy dog. " * 6)

        def loss(*source: str) -> float:
            return json.loads(run("eval", *source, "--text", text, "--seq-len", "32", "--json").stdout)["loss"]

        # The byte tokenizer has no files: the Hugging Face folders go back to Loom checkpoints to
        # be evaluated (the base's round trip is bitwise, test_convert_...).
        base, merged_loom = os.path.join(self.tmp, "lora_base_loom"), os.path.join(self.tmp, "lora_merged_loom")
        for src, dst in ((hf, base), (merged, merged_loom)):
            run("convert", "--to", "loom", "--checkpoint", src, "--out", dst, "--tokenizer", "byte")
        tuned = loss("--checkpoint", ft)
        self.assertEqual(loss("--checkpoint", base, "--adapter", adapter), tuned)  # the same computation
        self.assertLess(abs(loss("--checkpoint", merged_loom) - tuned), 1e-5 * tuned)  # W + s B A, fp32
        self.assertNotEqual(loss("--checkpoint", base), tuned)  # the adapters were trained
        outs = [run("generate", "--checkpoint", c, "--prompt", "The ", "--tokens", "10", "--greedy", *extra).stdout
                for c, extra in ((ft, ()), (base, ("--adapter", adapter)))]
        self.assertEqual(outs[0], outs[1])
        # Bad peft.* keys: one line naming the key.
        p = self.train("lora_bad", "--set", peft.replace("q,k,v,o,gate,up,down", "q,x"), expect_ok=False)
        self.assert_one_line_error(p, "peft.targets", "'x' matches no layer")
        p = self.train("lora_bad", "--set", peft.replace("peft.rank=4", "peft.rank=100000"), expect_ok=False)
        self.assert_one_line_error(p, "peft.rank = 100000 is larger than")
        p = run("convert", "--to", "peft", "--checkpoint", hf, "--out", adapter + "_none", expect_ok=False)
        self.assert_one_line_error(p, "has no LoRA adapters")
        # DoRA (peft.dora): the same path with trained magnitudes; PEFT's use_dora layout, the
        # merged export equal to the adapted model.
        p = self.train("dora_ft", "--set", peft + ",peft.dora=true,optim.lr=0.01", steps=6)
        self.assertIn("DoRA (LoRA with trained magnitudes): rank 4", p.stdout)
        ft = os.path.join(self.tmp, "runs", "dora_ft")
        adapter, merged = os.path.join(self.tmp, "dora_adapter"), os.path.join(self.tmp, "dora_merged")
        run("convert", "--to", "peft", "--checkpoint", ft, "--out", adapter)
        with open(os.path.join(adapter, "adapter_config.json")) as f:
            self.assertTrue(json.load(f)["use_dora"])
        run("convert", "--to", "hf", "--checkpoint", ft, "--out", merged, "--tokenizer", "byte")
        merged_loom = merged + "_loom"
        run("convert", "--to", "loom", "--checkpoint", merged, "--out", merged_loom, "--tokenizer", "byte")
        tuned = loss("--checkpoint", ft)
        self.assertEqual(loss("--checkpoint", base, "--adapter", adapter), tuned)
        self.assertLess(abs(loss("--checkpoint", merged_loom) - tuned), 1e-5 * tuned)  # m (W + s B A) / ||.||
        self.assertNotEqual(loss("--checkpoint", base), tuned)
        p = self.train("dora_bad", "--set", peft + ",peft.dora=true,peft.quantize_base=true", expect_ok=False)
        self.assert_one_line_error(p, "peft.dora with peft.quantize_base")

    def test_sft_chat_data_trains_on_the_assistant_tokens_and_bad_lines_are_named(self):
        chats = os.path.join(ROOT, "examples", "sft", "arithmetic_chat.jsonl")
        template = os.path.join(ROOT, "examples", "sft", "chatml.jinja")
        sft = os.path.join(self.tmp, "sft_data")
        p = run("prepare", "--format", "chat-jsonl", "--input", chats, "--tokenizer", "byte", "--chat-template", template,
                "--out", sft, "--val-fraction", "0.1")
        self.assertIn("240 chat-jsonl examples", p.stdout)
        with open(os.path.join(sft, "meta.json")) as f:
            self.assertIn("mask_shards", json.load(f)["splits"]["train"])
        sets = f"{TINY},train.steps=6,data.dir={sft},data.tokenizer=byte,run.dir={self.tmp}/runs,run.name=sft"
        run("train", "--set", sets)
        e = run("eval", "--checkpoint", os.path.join(self.tmp, "runs", "sft"), "--data", sft).stdout
        self.assertIn("of them counted (loss mask)", e)
        # Packed conversations attending only within themselves: the same data, another computation
        # (windows of 256 tokens hold whole conversations).
        long = sets.replace("train.steps=6", "train.steps=2") + ",model.max_seq_len=256,train.seq_len=256,train.eval_every=0"
        run("train", "--set", long.replace("run.name=sft", "run.name=sft_long"))
        run("train", "--set", long.replace("run.name=sft", "run.name=sft_docs") + ",data.document_mask=true")
        plain, docs = self.losses("sft_long"), self.losses("sft_docs")
        self.assertEqual(len(docs), 2)
        self.assertNotEqual(plain[0], docs[0])
        e = run("eval", "--checkpoint", os.path.join(self.tmp, "runs", "sft_docs"), "--data", sft).stdout
        self.assertIn("of them counted (loss mask)", e)
        # Bad input: one line naming the file and line, a non-zero exit, no dataset written.
        good = '{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}\n'
        cases = ((good + '{"messages": [\n', ":2: not valid JSON"),
                 ('{"messages": [{"role": "user", "content": "a"}]}\n', ":1: the conversation has no assistant message"),
                 (good + '{"messages": [{"role": "user", "content": 3}]}\n', ':2: messages[0]: expected a string "content"'))
        for i, (text, needle) in enumerate(cases):
            bad = os.path.join(self.tmp, f"bad_{i}.jsonl")
            with open(bad, "w") as f:
                f.write(text)
            out = os.path.join(self.tmp, f"bad_sft_{i}")
            p = run("prepare", "--format", "chat-jsonl", "--input", bad, "--tokenizer", "byte", "--chat-template", template,
                    "--out", out, expect_ok=False)
            self.assert_one_line_error(p, bad + needle)
            self.assertFalse(os.path.exists(os.path.join(out, "meta.json")))
        p = run("prepare", "--format", "chat-jsonl", "--input", chats, "--tokenizer", "byte", "--out", sft + "_x",
                expect_ok=False)
        self.assert_one_line_error(p, "needs a chat template")

    def test_dpo_trains_on_preference_pairs_and_refuses_bad_input(self):
        pairs = os.path.join(ROOT, "examples", "dpo", "arithmetic_pairs.jsonl")
        model = TINY.replace("model.max_seq_len=32", "model.max_seq_len=96").replace("train.seq_len=32", "train.seq_len=96")
        sets = (f"{model},train.steps=12,train.batch_size=8,data.tokenizer=byte,data.format=preference-jsonl,"
                f"data.input={pairs},train.objective=dpo,optim.lr=3e-3,run.dir={self.tmp}/runs,run.name=dpo")
        p = run("train", "--set", sets)
        self.assertIn("dpo (sigmoid, beta 0.1): 152 training pairs, 8 held out", p.stdout)
        self.assertIn("validation dpo loss", p.stdout)
        with open(os.path.join(self.tmp, "runs", "dpo", "metrics.jsonl")) as f:
            records = [json.loads(line) for line in f]
        steps = [r["dpo"] for r in records if "dpo" in r]
        self.assertEqual(len(steps), 12)
        # Step 1: the policy is the reference (the initial weights): log 2 whatever the pairs.
        self.assertAlmostEqual(steps[0]["loss"], math.log(2.0), places=5)
        self.assertAlmostEqual(steps[0]["margin"], 0.0, places=5)
        self.assertEqual(steps[0]["pairs"], 4)
        held = [r["val_dpo"] for r in records if "val_dpo" in r]
        self.assertEqual(held[-1]["pairs"], 8)  # each held-out pair once
        self.assertTrue(0.0 <= held[-1]["accuracy"] <= 1.0)
        # SimPO: no reference pass.
        p = run("train", "--set", sets.replace("run.name=dpo", "run.name=simpo").replace("train.steps=12", "train.steps=2")
                + ",dpo.loss=simpo,dpo.beta=2.0")
        self.assertIn("no reference model", p.stdout)
        # A live reference (a frozen copy of the initial weights): the same first step.
        p = run("train", "--set", sets.replace("run.name=dpo", "run.name=dpo_live").replace("train.steps=12", "train.steps=2")
                + ",dpo.reference=live")
        self.assertIn("reference live: a frozen copy of the initial weights", p.stdout)
        self.assertAlmostEqual(self.losses("dpo_live")[0], steps[0]["loss"], places=6)
        # Bad input: one line naming the key or the file and line.
        p = run("train", "--set", sets.replace("train.batch_size=8", "train.batch_size=7"), expect_ok=False)
        self.assert_one_line_error(p, "train.batch_size (7)", "must be even")
        p = run("train", "--set", sets.replace("data.format=preference-jsonl", "data.format=jsonl"), expect_ok=False)
        self.assert_one_line_error(p, "train.objective = dpo reads preference pairs")
        p = run("train", "--set", sets.replace("train.objective=dpo", "train.objective=lm"), expect_ok=False)
        self.assert_one_line_error(p, "data.format = preference-jsonl holds preference pairs")
        self.assert_bad_input_line(sets, pairs, '{"prompt": "1+1=", "chosen": "2", "rejected": "3"}\n{"prompt": "1+2=", "chosen": "3"}\n',
                                   ':2: expected a string "rejected"')
        p = run("train", "--set", sets.replace("model.max_seq_len=96", "model.max_seq_len=32").replace("train.seq_len=96", "train.seq_len=32"),
                "--overwrite", expect_ok=False)
        self.assert_one_line_error(p, pairs + ":1: the prompt and the chosen completion are", "train.seq_len + 1 = 33")

    def test_orpo_and_kto_train_on_preference_data_through_their_registry_rows(self):
        pairs = os.path.join(ROOT, "examples", "dpo", "arithmetic_pairs.jsonl")
        model = TINY.replace("model.max_seq_len=32", "model.max_seq_len=96").replace("train.seq_len=32", "train.seq_len=96")
        base = (f"{model},train.steps=4,train.batch_size=8,data.tokenizer=byte,data.format=preference-jsonl,"
                f"data.input={pairs},optim.lr=3e-3,run.dir={self.tmp}/runs")
        p = run("train", "--set", base + ",train.objective=orpo,run.name=orpo")
        self.assertIn("orpo (beta 0.1): 152 training pairs, 8 held out; no reference model", p.stdout)
        self.assertIn("validation orpo loss", p.stdout)
        with open(os.path.join(self.tmp, "runs", "orpo", "metrics.jsonl")) as f:
            records = [json.loads(line) for line in f]
        steps = [r["orpo"] for r in records if "orpo" in r]
        self.assertEqual([s["pairs"] for s in steps], [4, 4, 4, 4])
        for s in steps:  # the loss is the chosen NLL plus beta times the odds-ratio term
            self.assertGreater(s["loss"], s["nll_loss"])
            self.assertTrue(0.0 <= s["accuracy"] <= 1.0)
        self.assertEqual(len([r for r in records if "val_orpo" in r]), 1)  # at step 4 (train.eval_every = 4)
        # KTO: the pairs unpaired (one desirable and one undesirable example each); at the first step
        # the policy is the reference, so z0 = 0 and every example's loss is 1 - sigmoid(0) = 0.5.
        p = run("train", "--set", base + ",train.objective=kto,run.name=kto")
        self.assertIn("kto (beta 0.1, desirable weight 1, undesirable weight 1)", p.stdout)
        with open(os.path.join(self.tmp, "runs", "kto", "metrics.jsonl")) as f:
            steps = [r["kto"] for r in map(json.loads, f) if "kto" in r]
        self.assertEqual(len(steps), 4)
        self.assertAlmostEqual(steps[0]["loss"], 0.5, places=6)
        self.assertAlmostEqual(steps[0]["kl"], 0.0, places=6)
        # Refusals by name: KTO runs on one process, ORPO reads pairs.
        p = run("train", "--set", base + ",train.objective=orpo,run.name=orpo_bad,data.format=prompt-jsonl", expect_ok=False)
        self.assert_one_line_error(p, "train.objective = orpo")
        p = run("train", "--set", base + ",train.objective=kto,run.name=kto_tp,parallel.tp=2", expect_ok=False)
        self.assert_one_line_error(p, "train.objective = kto does not run with tensor, pipeline or context parallelism")

    def test_qlora_trains_over_an_nf4_base_resumes_and_exports(self):
        sets = 'peft.method=lora,peft.rank=4,peft.targets="q,k,v,o,up,down",peft.quantize_base=true,train.checkpoint_every=3'
        p = self.train("qlora", "--set", sets, steps=6)
        m = re.search(r"QLoRA: the base's (\d+) block-matrix parameters in NF4 with double-quantized scales: .* = ([0-9.]+) "
                      r"bits per parameter", p.stdout)
        self.assertIsNotNone(m, p.stdout)
        self.assertEqual(int(m.group(1)), 2 * (32 * 96 + 32 * 32 + 64 * 32 + 32 * 64))  # TINY: qkv, proj, fc, fc2 per layer
        self.assertGreater(float(m.group(2)), 4.1)
        self.assertLess(float(m.group(2)), 4.6)
        # Stopped at step 3 and resumed: the curve of the straight run (the checkpoint holds the
        # dequantized base, quantized again identically).
        self.train("qlora_resumed", "--set", sets, "--stop-at-step", "3", steps=6)
        self.train("qlora_resumed", "--set", sets, "--resume", steps=6)
        self.assert_same_curve("qlora", "qlora_resumed", 6)
        run("eval", "--checkpoint", os.path.join(self.tmp, "runs", "qlora"), "--data", self.data)
        run("convert", "--to", "hf", "--checkpoint", os.path.join(self.tmp, "runs", "qlora"), "--out",
            os.path.join(self.tmp, "qlora_hf"))
        p = self.train("qlora_bad", "--set", "peft.quantize_base=true", expect_ok=False, steps=2)
        self.assert_one_line_error(p, "peft.quantize_base (QLoRA) needs peft.method = lora")

    def test_save_checkpoints_false_writes_none(self):
        # train.save_checkpoints=false (a benchmark's run, HF Trainer's save_strategy "no"): neither
        # the periodic, the stopping nor the last checkpoint; rollback, which needs one, is refused.
        p = self.train("nosave", "--set", "train.save_checkpoints=false,train.checkpoint_every=1", "--stop-at-step", "2",
                       steps=3)
        self.assertIn("stopped after step 2 (--stop-at-step); checkpoint (not saved)", p.stdout)
        ckpt = os.path.join(self.tmp, "runs", "nosave", "checkpoints")
        self.assertEqual(os.listdir(ckpt) if os.path.isdir(ckpt) else [], [])
        self.train("nosave", "--set", "train.save_checkpoints=false", "--overwrite", steps=2)
        self.assertEqual(os.listdir(ckpt) if os.path.isdir(ckpt) else [], [])
        self.assertEqual(len(self.losses("nosave")), 2)
        p = self.train("nosave_bad", "--set", "train.save_checkpoints=false,train.on_anomaly=rollback,train.checkpoint_every=1",
                       expect_ok=False, steps=2)
        self.assert_one_line_error(p, "train.save_checkpoints = true")

    def test_lora_over_a_bf16_folder_keeps_its_base_in_bf16_only(self):
        # LoRA with precision.param = bf16 from a bf16 Hugging Face folder: the block matrices and
        # the untied head are read one at a time into the bf16 copy the layers read, never into
        # fp32 (model/frozen_base.h load_bf16). The folder's values are exact in bf16, so the run
        # keeping an fp32 base (precision.param = f32) computes the same: equal losses and equal
        # checkpoints (the bf16 base written through its fp32 elements one matrix at a time).
        self.train("bsrc", "--set", "model.arch=llama", steps=3)
        hf = os.path.join(self.tmp, "bsrc_hf")
        run("convert", "--to", "hf", "--type", "bf16", "--checkpoint", os.path.join(self.tmp, "runs", "bsrc"), "--out", hf)
        sets = f'peft.method=lora,peft.rank=4,peft.targets="q,k,v,o,gate,up,down",optim.lr=0.01,train.init_from={hf}'
        a = self.train("b_f32", "--set", f"{sets},precision.param=f32,train.checkpoint_every=2", steps=4)
        b = self.train("b_bf16", "--set", f"{sets},precision.param=bf16,train.checkpoint_every=2", steps=4)
        self.assertNotIn("LoRA base in bf16 only", a.stdout)
        m = re.search(r"LoRA base in bf16 only: (\d+) frozen block-matrix and head parameters .* never held: read one "
                      r"matrix at a time from the folder", b.stdout)
        self.assertIsNotNone(m, b.stdout)
        self.assertEqual(int(m.group(1)), 2 * (32 * 96 + 32 * 32 + 3 * 64 * 32) + 257 * 32)  # TINY llama; head: 257 byte-level tokens
        self.assertEqual(self.losses("b_f32"), self.losses("b_bf16"))
        final = [os.path.join(self.tmp, "runs", n, "checkpoints", "step_00000004", "model.safetensors")
                 for n in ("b_f32", "b_bf16")]
        with open(final[0], "rb") as f0, open(final[1], "rb") as f1:
            self.assertEqual(f0.read(), f1.read())
        # Stopped and resumed: the straight run's curve.
        self.train("b_bf16_resumed", "--set", f"{sets},precision.param=bf16,train.checkpoint_every=2", "--stop-at-step", "2",
                   steps=4)
        self.train("b_bf16_resumed", "--set", f"{sets},precision.param=bf16,train.checkpoint_every=2", "--resume", steps=4)
        self.assert_same_curve("b_bf16", "b_bf16_resumed", 4)
        run("eval", "--checkpoint", os.path.join(self.tmp, "runs", "b_bf16"), "--data", self.data)

    def test_qlora_from_a_folder_quantizes_while_loading(self):
        # A Hugging Face folder's block matrices go to NF4 one at a time, never into the fp32
        # parameters (Transformer::load_quantized_base); a Loom checkpoint of the same weights takes
        # the load-then-quantize path. Same NF4 base, same adapters' start: the same losses, bit
        # for bit. A run stopped and resumed continues the straight run's curve.
        self.train("qsrc", "--set", "model.arch=llama", steps=4)
        src, hf = os.path.join(self.tmp, "runs", "qsrc"), os.path.join(self.tmp, "qsrc_hf")
        run("convert", "--to", "hf", "--checkpoint", src, "--out", hf)
        sets = 'peft.method=lora,peft.rank=4,peft.targets="q,k,v,o,gate,up,down",peft.quantize_base=true,optim.lr=0.01'
        a = self.train("q_ckpt", "--set", f"{sets},train.init_from={src}", steps=5)
        b = self.train("q_hf", "--set", f"{sets},train.init_from={hf},train.checkpoint_every=3", steps=5)
        self.assertNotIn("never held", a.stdout)
        self.assertIn("never held: quantized one matrix at a time while reading the folder", b.stdout)
        self.assertEqual(self.losses("q_ckpt"), self.losses("q_hf"))
        self.assertEqual(len(self.losses("q_hf")), 5)
        # Each checkpoint holds the dequantized base, written one matrix at a time (ModelState::pages):
        # the same file from both paths, and the base's block matrices are not all zeros.
        final = [os.path.join(self.tmp, "runs", n, "checkpoints", "step_00000005", "model.safetensors") for n in ("q_ckpt", "q_hf")]
        with open(final[0], "rb") as f0, open(final[1], "rb") as f1:
            a_bytes, b_bytes = f0.read(), f1.read()
        self.assertEqual(a_bytes, b_bytes)
        header = json.loads(a_bytes[8:8 + int.from_bytes(a_bytes[:8], "little")])
        begin, end = header["model.layers.0.mlp.down_proj.weight"]["data_offsets"]
        data = a_bytes[8 + int.from_bytes(a_bytes[:8], "little"):][begin:end]
        self.assertGreater(sum(1 for i in range(0, len(data), 4) if data[i:i + 4] != b"\0\0\0\0"), len(data) // 8)
        self.train("q_hf_resumed", "--set", f"{sets},train.init_from={hf},train.checkpoint_every=3", "--stop-at-step", "3",
                   steps=5)
        self.train("q_hf_resumed", "--set", f"{sets},train.init_from={hf},train.checkpoint_every=3", "--resume", steps=5)
        self.assert_same_curve("q_hf", "q_hf_resumed", 5)
        run("eval", "--checkpoint", os.path.join(self.tmp, "runs", "q_hf"), "--data", self.data)
        # Merged export, one weight at a time (train/model_export.h): W_NF4 + s B A as Hugging Face
        # bf16 and f32 folders; the f32 one evaluates as the adapted run does (fp32 sums differ).
        text = os.path.join(self.tmp, "q_eval.txt")
        with open(text, "w") as f:
            f.write("The quick brown fox jumps over the lazy dog. " * 6)

        def loss(path: str) -> float:
            return json.loads(run("eval", "--checkpoint", path, "--text", text, "--seq-len", "32", "--json").stdout)["loss"]
        q_run = os.path.join(self.tmp, "runs", "q_hf")
        for t in ("f32", "bf16"):
            out = os.path.join(self.tmp, f"q_merged_{t}")
            p = run("convert", "--to", "hf", "--type", t, "--checkpoint", q_run, "--out", out, "--tokenizer", "byte")
            self.assertIn("merged the LoRA adapters", p.stdout)
            self.assertIn(f"model.safetensors, {t},", p.stdout)
            run("convert", "--to", "loom", "--checkpoint", out, "--out", out + "_loom", "--tokenizer", "byte")
        tuned = loss(q_run)
        self.assertLess(abs(loss(os.path.join(self.tmp, "q_merged_f32_loom")) - tuned), 1e-5 * tuned)
        self.assertLess(abs(loss(os.path.join(self.tmp, "q_merged_bf16_loom")) - tuned), 1e-2 * tuned)
        self.assertNotEqual(loss(hf), tuned)  # the adapters (and NF4) changed the model
        run("convert", "--to", "peft", "--checkpoint", q_run, "--out", os.path.join(self.tmp, "q_peft"))
        p = run("convert", "--to", "peft", "--type", "bf16", "--checkpoint", q_run, "--out", os.path.join(self.tmp, "q_x"),
                expect_ok=False)
        self.assert_one_line_error(p, "--type sets the weights' type of --to gguf and --to hf")
        p = run("convert", "--to", "hf", "--type", "q4_0", "--checkpoint", q_run, "--out", os.path.join(self.tmp, "q_x"),
                expect_ok=False)
        self.assert_one_line_error(p, "--to hf: --type must be f32 or bf16, got 'q4_0'")
        self.assertTrue(os.path.exists(os.path.join(self.tmp, "q_peft", "adapter_model.safetensors")))

    def test_grpo_rolls_out_rewards_and_refuses_bad_input(self):
        prompts = os.path.join(ROOT, "examples", "grpo", "arithmetic_prompts.jsonl")
        sets = (f"{TINY},train.steps=3,train.batch_size=8,data.tokenizer=byte,data.format=prompt-jsonl,"
                f"data.input={prompts},train.objective=grpo,grpo.group=4,grpo.max_new_tokens=4,train.eval_every=0,"
                f"optim.lr=1e-3,run.dir={self.tmp}/runs,run.name=grpo")
        p = run("train", "--set", sets)
        self.assertIn("grpo: 190 training prompts, 10 held out; 4 completions per prompt", p.stdout)
        with open(os.path.join(self.tmp, "runs", "grpo", "metrics.jsonl")) as f:
            records = [json.loads(line) for line in f]
        steps = [r["grpo"] for r in records if "grpo" in r]
        self.assertEqual(len(steps), 3)
        self.assertEqual(steps[0]["completions"], 8)
        self.assertAlmostEqual(steps[0]["kl"], 0.0, places=6)  # the reference is the initial policy
        self.assertGreater(steps[0]["rollout_seconds"], 0.0)
        vals = [r["val_reward"] for r in records if "val_reward" in r]
        self.assertEqual(len(vals), 2)  # before the first step and at the end
        # A reward command: every completion gets 1 (a constant reward: zero advantages).
        p = run("train", "--set", sets.replace("run.name=grpo", "run.name=grpo_cmd") + ",grpo.reward_command=\"awk '{print 1}'\"")
        with open(os.path.join(self.tmp, "runs", "grpo_cmd", "metrics.jsonl")) as f:
            self.assertEqual([r["grpo"]["reward"] for r in map(json.loads, f) if "grpo" in r], [1.0, 1.0, 1.0])
        # Bad input: one line naming the key, or the file and line.
        p = run("train", "--set", sets.replace("train.batch_size=8", "train.batch_size=6"), expect_ok=False)
        self.assert_one_line_error(p, "train.batch_size (6) must be a multiple of grpo.group (4)")
        p = run("train", "--set", sets + ",grpo.reward_command=\"echo oops\"", "--overwrite", expect_ok=False)
        self.assert_one_line_error(p, "grpo.reward_command: line 1 of its output is 'oops")
        self.assert_bad_input_line(sets, prompts, '{"prompt": "1 + 1 =", "answer": "2"}\n{"prompt": "2 + 2 ="}\n',
                                   ':2: expected a string "answer"')
        p = run("train", "--set", sets.replace("grpo.max_new_tokens=4", "grpo.max_new_tokens=30"), "--overwrite", expect_ok=False)
        self.assert_one_line_error(p, prompts + ":1: the prompt", "do not fit train.seq_len + 1 = 33")

    def test_eval_text_reports_perplexity_over_windows(self):
        self.train("evtext")
        text = os.path.join(self.tmp, "eval.txt")
        body = "The quick brown fox jumps over the lazy dog. " * 9 + "\u00e9t\u00e9 \U0001F600\n"
        with open(text, "w", encoding="utf-8") as f:
            f.write(body)
        n_bytes = len(body.encode("utf-8"))  # the byte tokenizer: one token per byte
        ckpt = os.path.join(self.tmp, "runs", "evtext")
        one = json.loads(run("eval", "--checkpoint", ckpt, "--text", text, "--seq-len", "32", "--json").stdout)
        self.assertEqual(one["tokens"], n_bytes)
        self.assertEqual(one["windows"], n_bytes // 32)
        self.assertAlmostEqual(one["perplexity"], math.exp(one["loss"]), places=9)
        self.assertTrue(2.0 < one["loss"] < 8.0, one)
        batched = json.loads(run("eval", "--checkpoint", ckpt, "--text", text, "--seq-len", "32", "--batch", "3",
                                 "--json").stdout)
        self.assertAlmostEqual(batched["loss"], one["loss"], delta=1e-6 * one["loss"])
        # Windows longer than --chunk + 1 tokens are fed --chunk positions a forward through a KV
        # cache (infer/score.h): the whole forward's loss within 1e-5.
        self.assertFalse(one["chunked"])
        for chunk in ("1", "7"):
            chunked = json.loads(run("eval", "--checkpoint", ckpt, "--text", text, "--seq-len", "32", "--chunk", chunk,
                                     "--json").stdout)
            self.assertTrue(chunked["chunked"])
            self.assertAlmostEqual(chunked["loss"], one["loss"], delta=1e-5 * one["loss"])
        self.assertIn("fed 7 positions a forward", run("eval", "--checkpoint", ckpt, "--text", text, "--seq-len", "32",
                                                       "--chunk", "7").stdout)
        self.assert_one_line_error(run("eval", "--checkpoint", ckpt, "--text", text, "--chunk", "0", expect_ok=False), "--chunk")
        human = run("eval", "--checkpoint", ckpt, "--text", text, "--seq-len", "32").stdout
        self.assertRegex(human, r"loss \d+\.\d{9}, perplexity")
        p = run("eval", "--checkpoint", ckpt, "--text", text, "--seq-len", "100000", expect_ok=False)
        self.assert_one_line_error(p, "--seq-len")

    # ---------------------------------------------------------------- compression (docs/compression.md)

    def tensors(self, step_dir: str) -> dict:
        sys.path.insert(0, os.path.join(ROOT, "tools"))
        import loom_reference as ref  # noqa: E402
        tensors, _ = ref.read_safetensors(os.path.join(step_dir, "model.safetensors"))
        return tensors

    def test_quantize_methods_evaluate_generate_and_refuse_bad_input(self):
        self.train("cq", steps=24)
        ckpt = os.path.join(self.tmp, "runs", "cq")
        text = os.path.join(self.tmp, "heldout.txt")
        with open(TEXT) as f:
            body = f.read()
        with open(text, "w") as f:
            f.write(body[-6000:])
        def loss(path):
            return json.loads(run("eval", "--checkpoint", path, "--text", text, "--seq-len", "32", "--batch", "8",
                                  "--json").stdout)["loss"]
        base = loss(ckpt)
        q = lambda name: os.path.join(self.tmp, "q_" + name)
        cases = {"rtn8": ["--method", "rtn", "--bits", "8", "--group", "32"],
                 "rtn4": ["--method", "rtn", "--bits", "4", "--group", "32"],
                 "gptq4": ["--method", "gptq", "--bits", "4", "--group", "32", "--calib", TEXT, "--calib-tokens", "4096"],
                 "gptq3act": ["--method", "gptq", "--bits", "3", "--group", "32", "--act-order", "--calib", TEXT,
                              "--calib-tokens", "2048"],
                 "awq4": ["--method", "awq", "--bits", "4", "--group", "32", "--calib", TEXT, "--calib-tokens", "2048"],
                 "sq": ["--method", "smoothquant", "--calib", TEXT, "--calib-tokens", "2048"],
                 "w8a8": ["--method", "w8a8"]}
        losses = {}
        for name, extra in cases.items():
            out = run("quantize", "--checkpoint", ckpt, "--out", q(name), *extra).stdout
            self.assertRegex(out, r"wrote .*parameters quantized")
            with open(os.path.join(q(name), "manifest.json")) as f:
                manifest = json.load(f)
            self.assertEqual(manifest["kind"], "quantized")
            losses[name] = loss(q(name))
        # 8 bits are within 1% of f32; every method stays within 15% of f32 on this 24-step model.
        self.assertLess(abs(losses["rtn8"] - base), 0.01 * base, losses)
        self.assertLess(abs(losses["sq"] - base), 0.02 * base, losses)
        for name, value in losses.items():
            self.assertLess(abs(value - base), 0.15 * base, (name, losses, base))
        # The packed codes are in the file under their stated names and sizes.
        t = self.tensors(q("rtn4"))
        self.assertEqual(t["h.0.attn.c_attn.weight.qweight"].dtype, torch.uint8)
        self.assertEqual(list(t["h.0.attn.c_attn.weight.qweight"].shape), [96, 16])  # 32 columns at 4 bits
        self.assertEqual(list(t["h.0.attn.c_attn.weight.scales"].shape), [96, 1])
        self.assertNotIn("h.0.attn.c_attn.weight", t)
        self.assertIn("h.0.attn.c_attn.weight.input_scale", self.tensors(q("awq4")))
        # generate and bench generate load it; training refuses it.
        self.assertTrue(run("generate", "--checkpoint", q("gptq4"), "--prompt", "The ", "--tokens", "8").stdout)
        self.assertIn("single stream", run("bench", "generate", "--checkpoint", q("rtn4"), "--requests", "2",
                                           "--prompt-tokens", "8", "--new-tokens", "4").stdout)
        p = run("convert", "--to", "hf", "--checkpoint", q("rtn4"), "--out", os.path.join(self.tmp, "qhf"), expect_ok=False)
        self.assert_one_line_error(p, q("rtn4"), "is a quantized model")
        # Bad input: one line naming the key or the file.
        bad = [(["--method", "rtn", "--bits", "5"], "--bits 5"),
               (["--method", "rtn", "--bits", "4", "--group", "48"], "--group 48"),
               (["--method", "rtn", "--bits", "4", "--group", "128"], "--group 128"),
               (["--method", "smoothquant", "--bits", "4", "--calib", TEXT], "--bits 4"),
               (["--method", "gptq", "--bits", "4", "--group", "32"], "--calib FILE"),
               (["--method", "gptq", "--group", "32", "--calib", text, "--calib-tokens", "100000"], text),
               (["--method", "fancy"], "--method 'fancy'"),
               (["--method", "rtn", "--group", "32", "--scales", "f8"], "--scales 'f8'"),
               (["--method", "w8a8", "--symmetric"], "drop --scales and --symmetric")]
        for extra, needle in bad:
            p = run("quantize", "--checkpoint", ckpt, "--out", q("bad"), *extra, expect_ok=False)
            self.assert_one_line_error(p, needle)
            self.assertFalse(os.path.exists(q("bad")))

    def test_quantize_streams_a_bf16_folder_in_bounded_memory(self):
        """issue 46: loom quantize reads a Hugging Face folder block by block. On a 12-layer bf16
        folder (bench/big_model_bench.py's "ci" shape), above the process's own memory: rtn holds
        under a quarter of the f32 model (every weight resident, as before streaming: the
        broken variant), gptq stays within the plan it prints (+10%, + the runtime's buffers); the int4 folder (f16
        scales, symmetric, bf16 embedding) is smaller than the bf16 file, and bench generate on
        it holds no more than its bytes plus the KV cache's reservation."""
        sys.path.insert(0, os.path.join(ROOT, "bench"))
        import big_model_bench as bench  # noqa: E402
        folder = os.path.join(self.tmp, "llama_ci_bf16")
        file_bytes = bench.write_folder(folder, bench.config_of("ci"))
        f32_bytes = 2 * file_bytes
        base = bench.baseline_rss(LOOM)
        r = bench.run_quantize(LOOM, folder, os.path.join(self.tmp, "ci_rtn"), "rtn", TEXT, 0, ["--group", "32"])
        self.assertLess(r["peak_rss"] - base, f32_bytes / 4, (r, base, f32_bytes))
        q = bench.run_quantize(LOOM, folder, os.path.join(self.tmp, "ci_gptq"), "gptq", TEXT, 2048,
                               ["--scales", "f16", "--symmetric", "--group", "32"])
        # (+ 48 MiB the plan does not model: OpenBLAS's and oneDNN's buffers, the threads' stacks)
        self.assertLess(q["peak_rss"] - base, 1.1 * q["planned"] + (48 << 20), (q, base))
        # int4 in 18-byte blocks for the linear weights, the bf16 embedding, the f32 norms
        self.assertLess(q["file"], 0.6 * file_bytes, (q, file_bytes))
        g = bench.run_generate(LOOM, os.path.join(self.tmp, "ci_gptq"), False)
        self.assertLess(g["peak_rss"] - base, q["file"] + (40 << 20), (g, base, q))
        self.assertGreater(g["decode"], 0.0)

    def test_export_streams_a_bf16_folder_in_bounded_memory(self):
        """issue 46: loom convert --to gguf|hf reads a Hugging Face folder one tensor at a time
        (checkpoint/param_reader.h). On the 12-layer bf16 "ci" folder (46 MB in f32), above the
        process's own memory, each export holds less than the bf16 file (measured: 14 MB, its
        largest tensor in f32 and encoded, and the tokenizer; reading the model whole, as before,
        held 60 MB: the broken variant); a bf16 folder written back as bf16 keeps every value (its
        GGUF is the source's, byte for byte)."""
        sys.path.insert(0, os.path.join(ROOT, "bench"))
        import big_model_bench as bench  # noqa: E402
        folder = os.path.join(self.tmp, "llama_ci_bf16")
        f32_bytes = 2 * bench.write_folder(folder, bench.config_of("ci"))
        base = bench.baseline_rss(LOOM)

        def peak(*args: str) -> int:
            p = subprocess.run(["/usr/bin/time", "-f", "peak_rss_kib %M", LOOM, "convert", *args], capture_output=True,
                               text=True)
            self.assertEqual(p.returncode, 0, p.stderr)
            return int(re.search(r"peak_rss_kib (\d+)", p.stderr).group(1)) * 1024
        for t in ("bf16", "q4_0"):
            rss = peak("--to", "gguf", "--type", t, "--name", "ci", "--checkpoint", folder, "--out",
                       os.path.join(self.tmp, f"ci_{t}.gguf"))
            self.assertLess(rss - base, f32_bytes / 2, (t, rss, base, f32_bytes))
        back = os.path.join(self.tmp, "ci_back")
        rss = peak("--to", "hf", "--type", "bf16", "--checkpoint", folder, "--out", back)
        self.assertLess(rss - base, f32_bytes / 2, (rss, base, f32_bytes))
        shutil.copy(os.path.join(folder, "tokenizer.json"), back)
        peak("--to", "gguf", "--type", "bf16", "--name", "ci", "--checkpoint", back, "--out", os.path.join(self.tmp, "ci_back.gguf"))
        with open(os.path.join(self.tmp, "ci_bf16.gguf"), "rb") as a, open(os.path.join(self.tmp, "ci_back.gguf"), "rb") as b:
            self.assertEqual(a.read(), b.read())

    def test_prune_and_merge(self):
        self.train("cp", steps=12)
        self.train("cp2", "--set", "train.seed=7", steps=12)
        a, b = os.path.join(self.tmp, "runs", "cp"), os.path.join(self.tmp, "runs", "cp2")
        step = lambda d: os.path.join(d, "checkpoints", "step_00000000")
        out = run("prune", "--checkpoint", a, "--method", "magnitude", "--sparsity", "0.5",
                  "--out", os.path.join(self.tmp, "pm")).stdout
        self.assertIn("(50.00%", out)
        t = self.tensors(step(os.path.join(self.tmp, "pm")))
        w = t["h.1.mlp.c_fc.weight"]
        self.assertEqual(int((w == 0).sum()), w.numel() // 2)
        run("prune", "--checkpoint", a, "--method", "wanda", "--pattern", "2:4", "--calib", TEXT, "--calib-tokens", "1024",
            "--out", os.path.join(self.tmp, "pw"))
        w = self.tensors(step(os.path.join(self.tmp, "pw")))["h.0.attn.c_proj.weight"]  # (in, out) in the file
        groups = (w.T.reshape(-1, 4) == 0).sum(dim=1)
        self.assertTrue(bool((groups == 2).all()))
        run("prune", "--checkpoint", a, "--method", "sparsegpt", "--sparsity", "0.5", "--calib", TEXT,
            "--calib-tokens", "1024", "--out", os.path.join(self.tmp, "ps"))
        p = run("prune", "--checkpoint", a, "--method", "wanda", "--out", os.path.join(self.tmp, "px"), expect_ok=False)
        self.assert_one_line_error(p, "--calib FILE")
        # The average of identical models is the model; task arithmetic with weight 0 is the base.
        ta = self.tensors(self.ckpt("cp", 12))
        run("merge", "--method", "average", "--out", os.path.join(self.tmp, "avg"), a, a)
        for name, value in self.tensors(step(os.path.join(self.tmp, "avg"))).items():
            self.assertTrue(torch.equal(value, ta[name]), name)
        run("merge", "--method", "task-arithmetic", "--base", a, "--weights", "0", "--out", os.path.join(self.tmp, "ta0"), b)
        for name, value in self.tensors(step(os.path.join(self.tmp, "ta0"))).items():
            self.assertTrue(torch.equal(value, ta[name]), name)
        for method in ("ties", "dare"):
            run("merge", "--method", method, "--base", a, "--out", os.path.join(self.tmp, method), a, b)
            self.assertIn("perplexity", run("eval", "--checkpoint", os.path.join(self.tmp, method), "--batches", "1").stdout)
        # Different shapes or tokenizers are refused, naming the key or the tokenizer.
        self.train("cwide", "--set", "model.d_ff=128", steps=4)
        p = run("merge", "--method", "average", "--out", os.path.join(self.tmp, "mx"), a,
                os.path.join(self.tmp, "runs", "cwide"), expect_ok=False)
        self.assert_one_line_error(p, "model.d_ff = 128")
        p = run("merge", "--method", "task-arithmetic", "--out", os.path.join(self.tmp, "mx"), a, expect_ok=False)
        self.assert_one_line_error(p, "--base PATH")

    def test_prepare_can_learn_its_own_bpe_and_train_uses_it(self):
        data = os.path.join(self.tmp, "d_bpe")
        run("prepare", "--input", TEXT, "--tokenizer", "bpe:300", "--out", data)
        self.assertTrue(os.path.exists(os.path.join(data, "tokenizer", "vocab.bpe")))
        p = run("train", "--set", f"{TINY},train.steps=2,data.dir={data},run.dir={self.tmp}/runs,run.name=bpe")
        self.assertIn("sample", p.stdout)
        with open(os.path.join(self.tmp, "runs", "bpe", "config.toml")) as f:
            self.assertIn(os.path.join(data, "tokenizer"), f.read())
        # The checkpoint carries its tokenizer: moved away from the data (and its folder gone), it
        # generates the same text from another working directory.
        step = self.ckpt("bpe", 2)
        self.assertTrue(os.path.exists(os.path.join(step, "tokenizer", "vocab.bpe")))
        before = run("generate", "--checkpoint", step, "--prompt", "The ", "--tokens", "10", "--greedy").stdout
        moved = os.path.join(self.tmp, "moved_step")
        shutil.copytree(step, moved)
        shutil.move(data, data + "_gone")
        try:
            after = run("generate", "--checkpoint", moved, "--prompt", "The ", "--tokens", "10", "--greedy", cwd="/").stdout
        finally:
            shutil.move(data + "_gone", data)
        self.assertEqual(before, after)

    def test_tokenize_prints_ids_or_pieces_of_stdin(self):
        def tokenize(*args: str, text: bytes) -> subprocess.CompletedProcess:
            return subprocess.run([LOOM, "tokenize", *args], cwd=ROOT, input=text, capture_output=True, timeout=60)
        p = tokenize("--tokenizer", "gpt2", "--ids", text=b"Hello world\n")
        self.assertEqual((p.returncode, p.stdout), (0, b"15496 995 198\n"))
        p = tokenize("--tokenizer", "gpt2", text=b"Hello world\n")
        self.assertEqual(p.stdout.decode(), "Hello\n\u0120world\n\u010a\n")
        p = tokenize("--tokenizer", "byte", "--ids", text=b"a\xff")
        self.assertEqual(p.stdout, b"97 255\n")
        p = tokenize("--tokenizer", "gpt2", "--ids", text=b"")
        self.assertEqual((p.returncode, p.stdout), (0, b"\n"))
        p = tokenize("--ids", text=b"x")
        self.assert_one_line_error(subprocess.CompletedProcess(p.args, p.returncode, p.stdout.decode(), p.stderr.decode()),
                                   "loom tokenize: error:", "--tokenizer PATH")
        p = tokenize("--tokenizer", os.path.join(self.tmp, "nowhere"), text=b"x")
        self.assert_one_line_error(subprocess.CompletedProcess(p.args, p.returncode, p.stdout.decode(), p.stderr.decode()),
                                   "nowhere")
        # A checkpoint's (and a run folder's) own tokenizer: this run's is the byte tokenizer.
        self.train("tok_ckpt", steps=2)
        p = tokenize("--checkpoint", os.path.join(self.tmp, "runs", "tok_ckpt"), "--ids", text=b"a\xff")
        self.assertEqual((p.returncode, p.stdout), (0, b"97 255\n"))

    def test_every_command_has_help(self):
        for cmd in ("prepare", "train", "eval", "generate", "tokenizer", "tokenize", "plan", "memory", "bench", "quantize",
                    "prune", "merge"):
            p = run(cmd, "--help")
            self.assertIn("usage: loom", p.stdout)

    def test_options_take_key_equals_value_and_repeat_in_order(self):
        sets = f"{TINY},train.steps=8,data.dir={self.data},data.tokenizer=byte,run.dir={self.tmp}/runs,run.name=eq"
        p = run("train", f"--set={sets}", "--stop-at-step=2")
        self.assertIn("stopped after step 2", p.stdout)
        # Every --set is applied, in order: the last one wins.
        p = run("config", "--set", "run.name=first,train.steps=7", "--set=run.name=second")
        self.assertIn("name = 'second'", p.stdout)
        self.assertIn("steps = 7", p.stdout)

    def test_help_anywhere_on_the_line_lists_the_options(self):
        p = run("train", "--set", "train.steps=3", "--resume", "-h")
        self.assertEqual(p.stderr, "")
        self.assertIn("usage: loom train", p.stdout)
        for option in ("--config FILE", "--set KEY=VALUE", "--resume", "--stop-at-step N", "--dry-run", "-h, --help"):
            self.assertIn(option, p.stdout)
        # train's help lists every config key with its type, default and meaning, by section.
        self.assertRegex(p.stdout, r"\n\[optim\]\n")
        self.assertRegex(p.stdout, r"train\.batch_size +int +4 +sequences per micro-batch")
        self.assertRegex(p.stdout, r"parallel\.cp_attention +string +'ring' +with cp > 1: ring \| ulysses")
        for args, option in ((("tokenizer", "train", "--input", TEXT, "--help"), "--vocab-size N"),
                             (("bench", "generate", "--requests", "2", "-h"), "--ppl-sequences S"),
                             (("generate", "--checkpoint", "nowhere", "--help"), "--top-p P"),
                             (("memory", "--measure", "-h"), "--ranks N")):
            p = run(*args)
            self.assertIn("usage: loom", p.stdout)
            self.assertIn(option, p.stdout)
        self.assertIn("train", run("-h").stdout)
        self.assertIn("generate", run("--help").stdout)

    def test_version(self):
        for args in (("--version",), ("version",)):
            self.assertRegex(run(*args).stdout, r"^loom [0-9]+\.[0-9]+\.[0-9]+\n$")

    def test_config_markdown_is_docs_config_md(self):
        with open(os.path.join(ROOT, "docs", "config.md")) as f:
            self.assertEqual(run("config", "--markdown").stdout, f.read())

    # ---------------------------------------------------------------- bad input

    def test_bad_options_are_one_line_naming_them(self):
        p = run("train", "--set", "train.steps=1", "--bogus", "3", expect_ok=False)
        self.assert_one_line_error(p, "loom train: error:", "'--bogus'", "--stop-at-step N", "--help")
        self.assert_one_line_error(run("train", "--bogus=3", expect_ok=False), "'--bogus'")
        self.assert_one_line_error(run("train", "stray", expect_ok=False), "'stray'")
        self.assert_one_line_error(run("train", "--stop-at-step", expect_ok=False), "--stop-at-step", "value")
        self.assert_one_line_error(run("train", "--stop-at-step=x", expect_ok=False), "--stop-at-step", "integer", "'x'")
        self.assert_one_line_error(run("train", "--resume=yes", expect_ok=False), "--resume")
        self.assert_one_line_error(run("prepare", "--val-fraction", "lots", "--out", os.path.join(self.tmp, "d_x"),
                                       expect_ok=False), "--val-fraction", "number")
        self.assert_one_line_error(run("tokenizer", "train", "--input", TEXT, "--vocab", "300", expect_ok=False),
                                   "'--vocab'", "--vocab-size N")
        self.assert_one_line_error(run("bench", "generate", "--kv-blocks", "4", expect_ok=False), "'--kv-blocks'")
        self.assert_one_line_error(run("tokenizer", "learn", expect_ok=False), "'learn'", "train")
        self.assert_one_line_error(run("frobnicate", expect_ok=False), "'frobnicate'", "train")

    def test_unknown_config_key_names_the_key(self):
        self.assert_one_line_error(self.train("bad", "--set", "train.lrr=1", expect_ok=False), "train.lrr")

    def test_device_key_is_checked_in_one_line(self):
        # No GPU on a CI machine: device = "cuda" says which part is missing (the build or the device).
        p = self.train("gpu", "--set", "device=cuda", expect_ok=False)
        self.assertEqual(len(p.stderr.strip().splitlines()), 1, p.stderr)
        self.assertTrue("no CUDA device is visible" in p.stderr or "has no CUDA backend" in p.stderr, p.stderr)
        self.assert_one_line_error(self.train("tpu", "--set", "device=tpu", expect_ok=False), "device", "tpu")

    def test_wrong_config_type_names_the_key(self):
        self.assert_one_line_error(self.train("bad", "--set", "train.steps=many", expect_ok=False), "train.steps", "integer")

    def test_bad_config_file_names_file_and_key(self):
        path = os.path.join(self.tmp, "bad.toml")
        with open(path, "w") as f:
            f.write("[model]\nlayers = 3\n")
        p = run("train", "--config", path, expect_ok=False)
        self.assert_one_line_error(p, path, "model.layers")

    def corrupt_data(self, name: str, damage) -> str:
        d = os.path.join(self.tmp, name)
        shutil.copytree(self.data, d)
        damage(os.path.join(d, "train_000000.bin"))
        return d

    def train_on(self, data_dir: str):
        return run("train", "--set", f"{TINY},train.steps=2,data.dir={data_dir},data.tokenizer=byte,run.dir={self.tmp}/runs,run.name=bad",
                   expect_ok=False)

    def test_missing_shard_names_the_file(self):
        d = self.corrupt_data("d_missing", os.remove)
        self.assert_one_line_error(self.train_on(d), "train_000000.bin")

    def test_truncated_shard_names_the_file(self):
        def truncate(path):
            with open(path, "r+b") as f:
                f.truncate(os.path.getsize(path) - 7)
        self.assert_one_line_error(self.train_on(self.corrupt_data("d_trunc", truncate)), "train_000000.bin")

    def test_wrong_magic_names_the_file(self):
        def bad_magic(path):
            with open(path, "r+b") as f:
                f.write(b"NOTLOOM!")
        self.assert_one_line_error(self.train_on(self.corrupt_data("d_magic", bad_magic)), "train_000000.bin", "magic")

    def test_checksum_mismatch_names_the_file(self):
        def flip(path):
            with open(path, "r+b") as f:
                f.seek(100)
                b = f.read(1)
                f.seek(100)
                f.write(bytes([b[0] ^ 1]))
        self.assert_one_line_error(self.train_on(self.corrupt_data("d_sum", flip)), "train_000000.bin", "checksum")

    def test_missing_tokenizer_files_name_the_path(self):
        p = run("prepare", "--input", TEXT, "--tokenizer", os.path.join(self.tmp, "no_tokenizer"),
                "--out", os.path.join(self.tmp, "d_tok"), expect_ok=False)
        self.assert_one_line_error(p, "no_tokenizer")

    def test_corrupt_checkpoint_falls_back_to_the_previous_one(self):
        self.train("fallback")
        model = os.path.join(self.ckpt("fallback", 8), "model.safetensors")
        with open(model, "r+b") as f:
            f.seek(os.path.getsize(model) - 5)
            f.write(b"\x00\x01\x02\x03\x04")
        p = self.train("fallback", "--resume", steps=12)
        self.assertIn("corrupt", p.stderr)
        self.assertIn("step_00000004", p.stderr)
        self.assertIn("resumed from", p.stdout)
        self.assertIn("step_00000004", p.stdout)
        self.assertTrue(os.path.exists(os.path.join(self.ckpt("fallback", 12), "manifest.json")))

    def test_nan_loss_stops_with_a_message_and_keeps_the_last_checkpoint(self):
        self.train("nan", steps=4)
        good = os.path.join(self.ckpt("nan", 4), "model.safetensors")
        with open(good, "rb") as f:
            before = f.read()
        p = self.train("nan", "--resume", "--set", "optim.lr=1e30,optim.min_lr=1e29", steps=8, expect_ok=False)
        self.assert_one_line_error(p, "loss is")
        with open(good, "rb") as f:
            self.assertEqual(f.read(), before)
        self.assertFalse(os.path.exists(self.ckpt("nan", 8)))


if __name__ == "__main__":
    unittest.main(argv=[sys.argv[0], "-v", *sys.argv[2:]])
