#!/usr/bin/env python3
"""`loom train` with device = "cuda" on the CUDA simulator (build/bin/loom-sim; docs/cuda.md "The
simulator") against the same run on the CPU (build/bin/loom): one process; data parallelism with
ZeRO-1 and ZeRO-2 over the simulated NCCL under `mpirun -np 2`; the fine-tuning runs (LoRA, DoRA,
QLoRA, DPO, GRPO), MoE and MLA models, and tensor and pipeline parallelism at np 2 through the
layout's own wiring. The losses of every step agree within the fp32 tolerance stated in
docs/cuda.md (5e-6 relative to the largest value; the GEMMs and the long sums add in another
order), each final weight tensor in relative L2 norm (2e-5 for the plain runs, 1e-4 for the
others: assert_same_run, same_on_both), and no simulator check fires. Inference with `--device cuda`: `generate`
(one prompt, and a batch through the engine with an int8 and a KIVI cache), `eval` (a split and
--text) and `serve` (an OpenAI completion over HTTP) of a CPU-trained GPT-2 and Llama (GQA) give
the CPU's greedy tokens and losses within 5e-6.

    tests/cuda_sim_train_test.py build/bin/loom build/bin/loom-sim
"""

from __future__ import annotations

import json
import re
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import unittest
import urllib.request

LOOM = os.path.abspath(sys.argv[1]) if len(sys.argv) > 1 else "build/bin/loom"
LOOM_SIM = os.path.abspath(sys.argv[2]) if len(sys.argv) > 2 else "build/bin/loom-sim"
TEXT = "/usr/share/common-licenses/GPL-3"
TOLERANCE = 5e-6
# optim.eps=1e-6 (AdamW's default is 1e-8): an element whose gradient is rounding noise in exact
# arithmetic (a GELU unit that no token switches on) gets lr-sized steps of the noise's sign, so
# its value after 8 steps depends on each device's order of sums, not on its arithmetic. On an
# AVX2-only CPU (oneDNN's AVX2 GEMMs sum in another order than its AVX-512 ones) one element of
# h.1.mlp.c_fc.weight ended 8.6e-4 of the tensor's largest away from the simulator's at eps 1e-8
# (the tensor 6.3e-5 in L2, the next element 2.1e-5); at 1e-6 the worst tensor is 9.6e-7.
TINY = ",".join([
    "model.n_layer=2", "model.n_head=2", "model.n_kv_head=2", "model.d_model=32", "model.d_ff=64",
    "model.max_seq_len=32", "train.seq_len=32", "train.batch_size=4", "optim.warmup_steps=2",
    "optim.lr=3e-3", "optim.min_lr=3e-4", "train.eval_every=0", "train.checkpoint_every=8",
    "sample.max_new_tokens=4", "train.steps=8", "data.tokenizer=byte",
    "optim.eps=1e-6",
])
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LLAMA = "model.arch=llama"
LORA = 'peft.method=lora,peft.rank=4,peft.targets="q,k,v,o,up,down"'
PAIRS = os.path.join(ROOT, "examples", "dpo", "arithmetic_pairs.jsonl")
PROMPTS = os.path.join(ROOT, "examples", "grpo", "arithmetic_prompts.jsonl")
PREF = (f"model.max_seq_len=96,train.seq_len=96,train.batch_size=8,data.format=preference-jsonl,data.input={PAIRS},"
        "train.objective=dpo")
GRPO = (f"train.batch_size=8,data.format=prompt-jsonl,data.input={PROMPTS},train.objective=grpo,grpo.group=4,"
        "grpo.max_new_tokens=4,optim.lr=1e-3")
MPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1", "OMP_NUM_THREADS": "1",
           "OMPI_MCA_rmaps_base_oversubscribe": "1"}


def tensors(path: str) -> dict[str, list[float]]:
    """The f32 tensors of a safetensors file (its JSON header, then little-endian data)."""
    with open(path, "rb") as f:
        size = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(size))
        data = f.read()
    out = {}
    for name, info in header.items():
        if name == "__metadata__" or info["dtype"] != "F32":
            continue
        begin, end = info["data_offsets"]
        out[name] = list(struct.unpack(f"<{(end - begin) // 4}f", data[begin:end]))
    return out


def l2_rel(a: list[float], b: list[float]) -> float:
    """||a - b||_2 / ||b||_2."""
    norm = sum(x * x for x in b) ** 0.5
    return (sum((x - y) ** 2 for x, y in zip(a, b)) ** 0.5) / max(norm, 1e-30)


def max_rel(a: list[float], b: list[float]) -> float:
    scale = max(max((abs(x) for x in b), default=0.0), 1e-30)
    return max((abs(x - y) for x, y in zip(a, b)), default=0.0) / scale


class CudaSimTrain(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="loom_cuda_sim_")
        cls.data = os.path.join(cls.tmp, "data")
        subprocess.run([LOOM, "prepare", "--input", TEXT, "--tokenizer", "byte", "--out", cls.data, "--val-fraction",
                        "0.1"], check=True, capture_output=True)

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def train(self, binary: str, name: str, device: str, ranks: int, extra: str = "",
              *args: str) -> subprocess.CompletedProcess:
        sets = f"{TINY},device={device},data.dir={self.data},run.dir={self.tmp}/runs,run.name={name}"
        cmd = [binary, "train", "--set", sets + (f",{extra}" if extra else ""), *args]
        env = dict(os.environ, OMP_NUM_THREADS="2")
        if ranks > 1:
            cmd = ["mpirun", "--oversubscribe", "-np", str(ranks), *cmd]
            env.update(MPI_ENV)
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
        self.assertEqual(p.returncode, 0, f"{' '.join(cmd)}\n{p.stdout}\n{p.stderr}")
        self.assertNotIn("loom-sim:", p.stderr, "a simulator check fired")
        return p

    def losses(self, name: str) -> list[float]:
        with open(os.path.join(self.tmp, "runs", name, "metrics.jsonl")) as f:
            return [r["loss"] for r in map(json.loads, f) if "loss" in r and "step" in r]

    def weights(self, name: str) -> dict[str, list[float]]:
        """The step-8 checkpoint's tensors: model.safetensors, or a ZeRO run's shards (rank:name)."""
        step = os.path.join(self.tmp, "runs", name, "checkpoints", "step_00000008")
        if os.path.exists(os.path.join(step, "model.safetensors")):
            return tensors(os.path.join(step, "model.safetensors"))
        out = {}
        for f in sorted(os.listdir(step)):
            if f.startswith("shard_"):
                out.update({f"{f}:{k}": v for k, v in tensors(os.path.join(step, f)).items()})
        self.assertTrue(out, f"no model.safetensors or shards in {step}")
        return out

    def assert_same_run(self, cuda: str, cpu: str, weights_tolerance: float = TOLERANCE * 4):
        a, b = self.losses(cuda), self.losses(cpu)
        self.assertEqual(len(a), 8)
        self.assertTrue(all(x == x for x in a), a)  # no NaN
        self.assertLess(max_rel(a, b), TOLERANCE, (a, b))
        wa, wb = self.weights(cuda), self.weights(cpu)
        self.assertEqual(sorted(wa), sorted(wb))
        # The key part of attn.c_attn.bias has a zero gradient in exact arithmetic (softmax does not
        # see a constant added to every score), so AdamW turns each device's rounding noise into
        # lr-sized steps of either sign: it is left out (seen: 3e-4 relative). Each other tensor in
        # relative L2 norm, as same_on_both below and for its reason: an element whose gradient was
        # of AdamW's eps at an early step moves by noise the tensor's largest element does not
        # bound. Measured when the loss pass began keeping GPT-2's logits by columns (another order
        # of the head's sums): one element of h.1.mlp.c_fc.weight 9.5e-5 of the largest, the other
        # 2,047 within 3.1e-6, its Adam moments within 4e-7 of the CPU's; the tensor 6.9e-6 in L2.
        worst, name = max((l2_rel(wa[k], wb[k]), k) for k in wa if not k.endswith("attn.c_attn.bias"))
        self.assertLess(worst, weights_tolerance, f"final weights ({name})")
        print(f"{cuda}: losses within {max_rel(a, b):.1e}, weights within {worst:.1e} in L2 ({name}) of the CPU run",
              flush=True)

    def test_one_process(self):
        p = self.train(LOOM_SIM, "cuda_1", "cuda", 1)
        self.assertIn("cuda", p.stdout + p.stderr)
        self.train(LOOM, "cpu_1", "cpu", 1)
        self.assert_same_run("cuda_1", "cpu_1")

    def test_data_parallel_with_zero_over_nccl_at_np2(self):
        for stage in (1, 2):
            self.train(LOOM_SIM, f"cuda_zero{stage}", "cuda", 2, f"parallel.zero_stage={stage}")
            self.train(LOOM, f"cpu_zero{stage}", "cpu", 2, f"parallel.zero_stage={stage}")
            self.assert_same_run(f"cuda_zero{stage}", f"cpu_zero{stage}")
        # The sharded checkpoint written from device memory resumes on the device: 4 more steps.
        p = self.train(LOOM_SIM, "cuda_zero1", "cuda", 2, "parallel.zero_stage=1,train.steps=12", "--resume")
        self.assertIn("(step 8)", p.stdout)
        self.train(LOOM, "cpu_zero1", "cpu", 2, "parallel.zero_stage=1,train.steps=12", "--resume")
        a, b = self.losses("cuda_zero1"), self.losses("cpu_zero1")
        self.assertEqual(len(a), 12)
        self.assertLess(max_rel(a, b), TOLERANCE, (a, b))

    # The fine-tuning, MoE, MLA, Muon and model-parallel runs: every loss within 5e-6 (measured
    # <= 1e-8), and each final weight tensor but GPT-2's c_attn bias (see assert_same_run) within
    # 1e-4 in relative L2 norm (measured up to 2.0e-5, the MLA run's down_proj; 1.1e-5 a lora_B).
    # Not element by element: AdamW's m / sqrt(v) divides an element's rounding noise by its own
    # gradient scale, so a weight whose gradient is small (LoRA's B, which starts at 0; an expert
    # few tokens chose) moves by noise its largest element does not bound (measured up to 2.8e-4
    # of the largest element after 8 steps).
    def same_on_both(self, name: str, extra: str, ranks: int = 1):
        self.train(LOOM_SIM, f"cuda_{name}", "cuda", ranks, extra)
        self.train(LOOM, f"cpu_{name}", "cpu", ranks, extra)
        a, b = self.losses(f"cuda_{name}"), self.losses(f"cpu_{name}")
        self.assertEqual(len(a), 8)
        self.assertLess(max_rel(a, b), TOLERANCE, (a, b))
        wa, wb = self.weights(f"cuda_{name}"), self.weights(f"cpu_{name}")
        self.assertEqual(sorted(wa), sorted(wb))
        worst, tensor = max((l2_rel(wa[k], wb[k]), k) for k in wa if not k.endswith("attn.c_attn.bias"))
        self.assertLess(worst, 1e-4, f"final weights ({tensor})")
        print(f"cuda_{name}: losses within {max_rel(a, b):.1e}, weights within {worst:.1e} in L2 ({tensor})",
              flush=True)

    def test_fine_tuning(self):
        self.same_on_both("lora", f"{LLAMA},{LORA}")
        self.same_on_both("dora", f"{LLAMA},{LORA},peft.dora=true")
        self.same_on_both("qlora", f"{LORA},peft.quantize_base=true")
        self.same_on_both("dpo", PREF)
        self.grpo_same_rollouts()

    # GRPO samples its rollouts from the model being trained: the first step's come from the same
    # initial weights on both devices, so the same completions and the same mean reward; after
    # that a completion whose token sits at a sampling boundary can flip with the weights' last
    # bits, and the runs part (measured: losses of order 1e-5 differing 2x by step 8). The
    # CUDA run's losses must stay finite throughout.
    def grpo_same_rollouts(self):
        self.train(LOOM_SIM, "cuda_grpo", "cuda", 1, GRPO)
        self.train(LOOM, "cpu_grpo", "cpu", 1, GRPO)

        def rewards(name: str) -> list[float]:
            with open(os.path.join(self.tmp, "runs", name, "metrics.jsonl")) as f:
                return [r["grpo"]["reward"] for r in map(json.loads, f) if "grpo" in r]

        a, b = rewards("cuda_grpo"), rewards("cpu_grpo")
        self.assertEqual(len(a), 8)
        self.assertEqual(a[0], b[0], (a, b))
        losses = self.losses("cuda_grpo")
        self.assertTrue(all(x == x and abs(x) < 1e30 for x in losses), losses)
        print(f"cuda_grpo: step 1's mean reward {a[0]} as on the CPU; rewards {a} vs {b}", flush=True)

    def test_moe_mla_and_optimizers(self):
        self.same_on_both("moe", "model.arch=llama,model.moe_experts=4,model.moe_top_k=2,model.moe_d_ff=16,"
                                 "model.moe_shared=1")
        self.same_on_both("mla", "model.arch=llama,model.mla_kv_rank=16,model.mla_rope_dim=8,model.mla_v_dim=8,"
                                 "model.mla_q_rank=16")
        self.same_on_both("muon", "optim.name=muon")

    def test_model_parallel_over_nccl_at_np2(self):
        self.same_on_both("tp2", f"{LLAMA},parallel.tp=2,parallel.sequence_parallel=true", 2)
        self.same_on_both("pp2", "parallel.pp=2,train.grad_accum=4", 2)
        self.same_on_both("cp2", f"{LLAMA},parallel.cp=2", 2)

    def run_cli(self, binary: str, *args: str) -> str:
        p = subprocess.run([binary, *args], capture_output=True, text=True, timeout=900,
                           env=dict(os.environ, OMP_NUM_THREADS="2"))
        self.assertEqual(p.returncode, 0, f"{binary} {' '.join(args)}\n{p.stdout}\n{p.stderr}")
        self.assertNotIn("loom-sim:", p.stderr, "a simulator check fired")
        return p.stdout

    def serve_completion(self, binary: str, checkpoint: str, device: str, prompt: str) -> str:
        """One greedy completion from `binary serve --device DEVICE` over HTTP."""
        proc = subprocess.Popen([binary, "serve", "--checkpoint", checkpoint, "--port", "0", "--device", device,
                                 "--max-batch", "2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=dict(os.environ, OMP_NUM_THREADS="2"))
        try:
            line = proc.stdout.readline()
            while line and "listening on" not in line:
                line = proc.stdout.readline()
            self.assertIn("listening on", line, proc.stderr.read() if proc.poll() is not None else "")
            url = line.split("listening on ")[1].strip()
            body = json.dumps({"prompt": prompt, "max_tokens": 12, "temperature": 0}).encode()
            req = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=600) as r:
                self.assertEqual(r.status, 200)
                return json.loads(r.read())["choices"][0]["text"]
        finally:
            proc.terminate()
            proc.communicate(timeout=60)

    def test_inference_on_cuda_gives_the_cpu_tokens_and_losses(self):
        prompts = os.path.join(self.tmp, "prompts.txt")
        with open(prompts, "w") as f:
            f.write("The GNU General\nYou may convey\nfree software\n")
        for name, extra in [("inf_gpt2", ""), ("inf_llama", f"{LLAMA},model.n_kv_head=1")]:
            self.train(LOOM, name, "cpu", 1, f"train.steps=60,train.checkpoint_every=60,{extra}".strip(","))
            ckpt = os.path.join(self.tmp, "runs", name)
            on = {"cpu": (LOOM, "cpu"), "cuda": (LOOM_SIM, "cuda")}
            out = {}
            for dev, (binary, device) in on.items():
                run = lambda *a: self.run_cli(binary, *a, "--checkpoint", ckpt, "--device", device)
                # Greedy, and sampled with a seed: the same draws pick the same tokens while the
                # probabilities agree to rounding (a tiny model's greedy text is mostly one letter).
                gen = [run("generate", *how, "--prompt", "The GNU", "--tokens", "24")
                       for how in (["--greedy"], ["--temperature", "1", "--seed", "7"])]
                batch = [[{k: r[k] for k in ("id", "text", "tokens", "finish")} for r in map(json.loads, run(
                    "generate", "--temperature", "1", "--seed", "11", "--prompts", prompts, "--kv", kv, "--max-batch",
                    "2", "--tokens", "16").splitlines())] for kv in ("int8", "kivi4")]
                split = float(run("eval", "--data", self.data, "--batches", "2").split(" loss ")[1].split(",")[0])
                text = json.loads(run("eval", "--text", TEXT, "--windows", "4", "--seq-len", "32", "--json").splitlines()[0])
                served = self.serve_completion(binary, ckpt, device, "The GNU General")
                # Each decoding step as one CUDA graph (a simulator graph: captured, updated in place,
                # launched): the same tokens as without, on the CPU they are plain steps.
                graphs = [{k: r[k] for k in ("id", "text", "tokens", "finish")} for r in map(json.loads, run(
                    "generate", "--temperature", "1", "--seed", "11", "--prompts", prompts, "--kv", "int8", "--max-batch",
                    "2", "--tokens", "16", "--step-graphs").splitlines())]
                self.assertEqual(graphs, batch[0], f"{dev}: --step-graphs changed the tokens")
                bench = run("bench", "generate", "--requests", "3", "--prompt-tokens", "4", "--new-tokens", "8",
                            "--max-batch", "2", "--step-graphs")
                steps = re.search(r"step graphs: (\d+) of the batched run's (\d+) steps", bench)
                self.assertIsNotNone(steps, bench)
                if dev == "cuda":
                    self.assertGreater(int(steps.group(1)), 0, bench)
                else:
                    self.assertEqual(int(steps.group(1)), 0, bench)
                self.assertIn("every request the same tokens: yes", bench)
                out[dev] = (gen, batch, split, text["loss"], served)
            a, b = out["cuda"], out["cpu"]
            self.assertEqual(a[0], b[0], "generate (greedy, sampled)")
            self.assertEqual(a[1], b[1], "generate --prompts (int8 and kivi4 caches)")
            self.assertGreater(len(set(b[0][1])), 12, f"a degenerate sample proves little: {b[0][1]!r}")
            self.assertLess(abs(a[2] - b[2]) / b[2], TOLERANCE, (a[2], b[2]))
            self.assertLess(abs(a[3] - b[3]) / b[3], TOLERANCE, (a[3], b[3]))
            self.assertEqual(a[4], b[4], "serve")
            print(f"{name} on cuda: greedy and sampled tokens as on the CPU ({b[0][1].strip()!r}, 6 batched samples, a served "
                  f"completion); eval loss {a[2]:.9f} vs {b[2]:.9f}, --text {a[3]:.9f} vs {b[3]:.9f}", flush=True)


if __name__ == "__main__":
    unittest.main(argv=[sys.argv[0], "-v", *sys.argv[3:]])
