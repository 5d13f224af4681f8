#!/usr/bin/python3
"""`loom convert --to gguf` checked by llama.cpp itself (node-llama-cpp's prebuilt llama.cpp,
tools/gguf_check.mjs): a tiny GPT-2 and a tiny Llama (GQA) trained a few steps on a learned
512-token BPE are exported as f32, f16, q8_0 and q4_0, and llama.cpp must tokenize the prompts and
a text as Loom does, continue the prompts greedily with Loom's tokens (f32, f16), give Loom's
next-token log-probabilities (f32 within 1e-3, f16 within 2e-2) and Loom's mean loss on the text;
the quantized files' loss change is printed and only bounded. It fails (never skips) without node
or node-llama-cpp (scripts/setup installs them into .deps/npm).
Run by ctest: gguf_test.py <path to loom> <path to loom_gguf_probe>; stdlib only."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import unittest

LOOM = os.path.abspath(sys.argv[1]) if len(sys.argv) > 1 else "build/bin/loom"
PROBE = os.path.abspath(sys.argv[2]) if len(sys.argv) > 2 else "build/tests/loom_gguf_probe"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEXT = "/usr/share/common-licenses/GPL-3"
MODULES = os.environ.get("LOOM_NODE_MODULES", os.path.join(ROOT, ".deps", "npm", "node_modules"))
PROMPTS = ["The GNU General Public License", "you may", "This program is free software", "Each version"]
CONTINUATION = 16
CONTEXT = 64
SETS = ",".join([
    "model.n_layer=2", "model.n_head=2", "model.d_model=64", "model.d_ff=128", f"model.max_seq_len={CONTEXT}",
    f"train.seq_len={CONTEXT}", "train.batch_size=8", "train.steps=40", "optim.warmup_steps=4", "optim.lr=3e-3",
    "optim.min_lr=3e-4", "train.eval_every=0", "train.checkpoint_every=40", "sample.max_new_tokens=4",
])
ARCHS = {"gpt2": "model.arch=gpt2,model.n_kv_head=2", "llama": "model.arch=llama,model.n_kv_head=1"}
TYPES = ("f32", "f16", "q8_0", "q4_0")


def run(*cmd: str, env_extra: dict | None = None) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="2", **(env_extra or {}))
    p = subprocess.run(list(cmd), cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    if p.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({p.returncode}):\n{p.stdout}\n{p.stderr}")
    return p.stdout


class Gguf(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        node = shutil.which("node")
        entry = os.path.join(MODULES, "node-llama-cpp", "dist", "index.js")
        if node is None or not os.path.exists(entry):
            raise AssertionError(f"llama.cpp check needs node and {entry}: run scripts/setup (npm node-llama-cpp@3.21.1)")
        cls.tmp = tempfile.mkdtemp(prefix="loom_gguf_")
        cls.data = os.path.join(cls.tmp, "data")
        run(LOOM, "prepare", "--input", TEXT, "--tokenizer", "bpe:512", "--out", cls.data, "--val-fraction", "0.1")
        cls.tokenizer = os.path.join(cls.data, "tokenizer")
        with open(TEXT, encoding="utf-8") as f:
            cls.text = f.read()[20000:24000]
        cls.prompts_file = os.path.join(cls.tmp, "prompts.txt")
        cls.text_file = os.path.join(cls.tmp, "text.txt")
        with open(cls.prompts_file, "w", encoding="utf-8") as f:
            f.write("\n".join(PROMPTS) + "\n")
        with open(cls.text_file, "w", encoding="utf-8") as f:
            f.write(cls.text)
        cls.results = {}
        for arch, sets in ARCHS.items():
            cls.results[arch] = cls.check_arch(arch, sets)

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    @classmethod
    def check_arch(cls, arch: str, sets: str) -> dict:
        run(LOOM, "train", "--set", f"{SETS},{sets},data.dir={cls.data},data.tokenizer={cls.tokenizer},"
            f"run.dir={cls.tmp}/runs,run.name={arch}")
        step = os.path.join(cls.tmp, "runs", arch, "checkpoints", "step_00000040")
        loom = json.loads(run(PROBE, step, cls.tokenizer, str(CONTINUATION), cls.prompts_file, cls.text_file))
        out = {"loom": loom}
        spec = os.path.join(cls.tmp, "spec.json")
        with open(spec, "w", encoding="utf-8") as f:
            json.dump({"prompts": PROMPTS, "tokens": CONTINUATION, "text": cls.text, "context": CONTEXT,
                       "vocab": len(loom["prompts"][0]["next_logprobs"])}, f)
        for t in TYPES:
            gguf = os.path.join(cls.tmp, f"{arch}_{t}.gguf")
            print(run(LOOM, "convert", "--to", "gguf", "--type", t, "--checkpoint", step, "--out", gguf).strip())
            out[t] = json.loads(run("node", os.path.join(ROOT, "tools", "gguf_check.mjs"), gguf, spec,
                                    env_extra={"LOOM_NODE_MODULES": MODULES}))
        return out

    def max_logprob_diff(self, loom: dict, llama: dict) -> float:
        diff = 0.0
        for a, b in zip(loom["prompts"], llama["prompts"]):
            for x, y in zip(a["next_logprobs"], b["next_logprobs"]):
                if x > -30:  # tokens below e^-30 are outside float32 softmax's useful range
                    diff = max(diff, abs(x - y))
        return diff

    def test_tokenizers_agree(self):
        for arch, r in self.results.items():
            for t in TYPES:
                for a, b in zip(r["loom"]["prompts"], r[t]["prompts"]):
                    self.assertEqual(a["tokens"], b["tokens"], f"{arch} {t}: {a['prompt']!r}")
                self.assertEqual(r["loom"]["text_tokens"], r[t]["text_tokens"], f"{arch} {t}: the text")

    def test_greedy_continuations_and_logprobs_agree(self):
        for arch, r in self.results.items():
            for t, tolerance in (("f32", 1e-3), ("f16", 2e-2)):
                same = sum(a["continuation"] == b["continuation"] for a, b in zip(r["loom"]["prompts"], r[t]["prompts"]))
                diff = self.max_logprob_diff(r["loom"], r[t])
                nll = r[t]["mean_nll"] - r["loom"]["mean_nll"]
                print(f"{arch} {t}: {same}/{len(PROMPTS)} greedy continuations of {CONTINUATION} tokens identical, "
                      f"max |log p diff| {diff:.2e}, mean loss llama.cpp {r[t]['mean_nll']:.5f} vs Loom "
                      f"{r['loom']['mean_nll']:.5f} ({nll:+.2e})")
                for a, b in zip(r["loom"]["prompts"], r[t]["prompts"]):
                    self.assertEqual(a["continuation"], b["continuation"], f"{arch} {t}: {a['prompt']!r}")
                self.assertLess(diff, tolerance, f"{arch} {t}")
                self.assertLess(abs(nll), tolerance, f"{arch} {t}")

    def test_quantized_loss_change_is_bounded(self):
        for arch, r in self.results.items():
            base = r["f32"]["mean_nll"]
            for t, bound in (("f16", 0.01), ("q8_0", 0.05), ("q4_0", 0.5)):
                change = r[t]["mean_nll"] - base
                same = sum(a["continuation"] == b["continuation"] for a, b in zip(r["loom"]["prompts"], r[t]["prompts"]))
                print(f"{arch} {t}: mean loss {r[t]['mean_nll']:.4f} vs f32 {base:.4f} ({change:+.4f} nats, perplexity "
                      f"x{math.exp(change):.4f}), {same}/{len(PROMPTS)} greedy continuations as Loom's")
                self.assertTrue(math.isfinite(r[t]["mean_nll"]), f"{arch} {t}")
                self.assertLess(abs(change), bound, f"{arch} {t}")


if __name__ == "__main__":
    unittest.main(argv=[sys.argv[0], "-v"])
