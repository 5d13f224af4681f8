#!/usr/bin/python3
"""`loom convert --to gguf` checked by llama.cpp itself (node-llama-cpp's prebuilt llama.cpp,
tools/gguf_check.mjs): a tiny GPT-2 and a tiny Llama (GQA) trained a few steps on a learned
512-token BPE are exported as f32, f16, bf16, q8_0 and q4_0, and llama.cpp must tokenize the prompts and
a text as Loom does, continue the prompts greedily with Loom's tokens (f32, f16; a continuation may part only at a
near-tie, where Loom's pick leads the runner-up by less than the log-probability tolerance), give Loom's
next-token log-probabilities (f32 within 1e-3, f16 within 2e-2) and Loom's mean loss on the text;
the quantized files' loss change is printed and only bounded. Two more tiny Llamas are trained
with Hugging Face tokenizers, a Llama-3-style tokenizer.json (Llama 3's regex, ignore_merges,
BOS/EOS added tokens, a non-special added token and an id hole) and a Llama-2-style SentencePiece
tokenizer.model, written as Hugging Face folders (`convert --to hf`) and exported from those
folders as f32 and f16, with the same checks on more prompts: spaces, tabs, newlines, digits, CJK,
emoji, special tokens written in the text (as text, and parsed). It fails (never skips) without
node or node-llama-cpp (scripts/setup installs them into .deps/npm).
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
TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0")
# Questions as examples/sft/chatml.jinja renders them for the assistant's reply.
CHAT_PROMPTS = [f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n"
                for q in ("What is 12 plus 7?", "Compute 30 - 4.", "6 * 7 = ?", "What is 21 times 3?")]
HF_TYPES = ("f32", "f16")
# For the Hugging Face tokenizers: ASCII, runs of spaces, a tab, newlines and \r\n, digits, CJK
# and Korean, emoji with a skin tone and ZWJ, special tokens of both tokenizers written in the
# text, and the tokenizer.json's non-special added token <tool_call>. Each is at most 48 tokens,
# so that its 16-token continuation fits the context.
HF_PROMPTS = PROMPTS + [
    "  two spaces,   three,\tand a tab ",
    "Version 3, 29 June 2007: 1234567 copies at 3.14159 each",
    "中文，日本語、한국어",
    "emoji 👍🏽 and 👨\u200d👩\u200d👧 family 😀",
    "as text: <|begin_of_text|>x <|end_of_text|>",
    "<s> </s>y <|endoftext|>",
    "call <tool_call> now<tool_call>",
    "line one\nline two\r\n\n    indented\n",
]


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
        cls.text_file = os.path.join(cls.tmp, "text.txt")
        with open(cls.text_file, "w", encoding="utf-8") as f:
            f.write(cls.text)
        cls.results = {}
        for arch, sets in ARCHS.items():
            cls.results[arch] = cls.check(arch, cls.data, cls.tokenizer, sets, PROMPTS, TYPES)
        # The fine-tuning example of docs/finetune.md: the llama run exported to a Hugging Face
        # folder, LoRA SFT on the chat jsonl shipped in examples/sft (only the assistant's tokens
        # count), merged by `convert --to gguf`; Loom's side is the adapted model, llama.cpp's the
        # merged file, prompted as the template renders a question.
        base_hf = os.path.join(cls.tmp, "llama_base_hf")
        run(LOOM, "convert", "--to", "hf", "--checkpoint", os.path.join(cls.tmp, "runs", "llama"), "--out", base_hf)
        sft = os.path.join(cls.tmp, "sft_data")
        run(LOOM, "prepare", "--format", "chat-jsonl", "--input", os.path.join(ROOT, "examples", "sft", "arithmetic_chat.jsonl"),
            "--tokenizer", base_hf, "--chat-template", os.path.join(ROOT, "examples", "sft", "chatml.jinja"), "--out", sft,
            "--val-fraction", "0.1")
        cls.results["llama + LoRA SFT, merged"] = cls.check(
            "llama + LoRA SFT, merged", sft, base_hf,
            ARCHS["llama"] + f',train.init_from={base_hf},peft.method=lora,peft.rank=8,peft.alpha=16,'
            'peft.targets="q,k,v,o,gate,up,down",optim.lr=1e-2', CHAT_PROMPTS, TYPES)
        if "merged the LoRA adapters" not in cls.results["llama + LoRA SFT, merged"]["convert"]["f32"]:
            raise AssertionError("loom convert did not merge the LoRA run's adapters")
        # Llama 3.1 / 3.2's shape: llama3 RoPE scaling (written as rope_freqs; an original context of
        # 16 so that the 64 positions use the rescaled frequencies) and a head tied to the embedding
        # (no output.weight: llama.cpp reads token_embd).
        cls.results["llama 3.1 rope, tied"] = cls.check(
            "llama 3.1 rope, tied", cls.data, cls.tokenizer,
            ARCHS["llama"] + ",model.rope_scaling=llama3,model.rope_factor=8,model.rope_original_context=16,"
            "model.tie_embeddings=true", PROMPTS, HF_TYPES)
        # Qwen2's shape: q/k/v biases and a tied head, written as llama.cpp's qwen2 (NEOX RoPE).
        cls.results["qwen2 biases, tied"] = cls.check(
            "qwen2 biases, tied", cls.data, cls.tokenizer, ARCHS["llama"] + ",model.qkv_bias=true,model.tie_embeddings=true",
            PROMPTS, HF_TYPES)
        # Qwen3's shape: per-head q/k norms, written as llama.cpp's qwen3.
        cls.results["qwen3 qk norm"] = cls.check(
            "qwen3 qk norm", cls.data, cls.tokenizer, ARCHS["llama"] + ",model.qk_norm=true",
            PROMPTS, HF_TYPES)
        # SmolLM3's shape: RoPE skipped on every 4th layer (4 layers: the last unrotated), written as
        # llama.cpp's smollm3 (its n_no_rope_layer_step is 4), with the tied head SmolLM3 has.
        cls.results["smollm3 nope, tied"] = cls.check(
            "smollm3 nope, tied", cls.data, cls.tokenizer,
            ARCHS["llama"] + ",model.n_layer=4,model.nope_interval=4,model.tie_embeddings=true", PROMPTS, HF_TYPES)
        # OLMo 2's shape: output norms and no input norms, q/k norms over all heads (64 and 32
        # wide), written as llama.cpp's olmo2.
        cls.results["olmo2 post-norms"] = cls.check(
            "olmo2 post-norms", cls.data, cls.tokenizer,
            ARCHS["llama"] + ",model.post_norm=true,model.qk_norm=true,model.qk_norm_whole=true", PROMPTS, HF_TYPES)
        # Gemma 3's shape: pre and post norms, per-head q/k norms, GeGLU, the embedding times
        # sqrt(64) = 8, a tied head, layers 0-4 within a window of 8 (RoPE base 10000) and layer 5
        # global, written as llama.cpp's gemma3 (its pattern of 6 and local base are fixed there).
        cls.results["gemma3 sandwich, swa"] = cls.check(
            "gemma3 sandwich, swa", cls.data, cls.tokenizer,
            ARCHS["llama"] + ",model.n_layer=6,model.sandwich_norm=true,model.qk_norm=true,"
            "model.gate_activation=gelu_tanh,model.embed_scale=8,model.tie_embeddings=true,model.attn_window=8,"
            "model.window_pattern=6,model.rope_local_theta=10000", PROMPTS, HF_TYPES)
        # Phi-3's LongRoPE shape: fused attn_qkv and ffn_up, the short and long factors (16 pairs) as
        # rope_factors_short / _long, written as llama.cpp's phi3. The run's name must not hold
        # "phi3": llama.cpp then sets attributes on Phi-3's own tokens (</s>, <|endoftext|>), which a
        # Loom BPE lacks ("_Map_base::at"). An original context of 4096 keeps both sides on the short
        # factors (llama.cpp picks by its context, Loom by a forward's span). Attention factor 1: at
        # 1.19 (Phi-3-mini-128k's) the prompts' log-probabilities part by 1.3e-3 in f32 while the text's
        # mean loss agrees to 9e-7 (measured 2026-12-06; float32 rounding of the larger scores).
        sf = ",".join(str(1.0 + 0.25 * j) for j in range(16))
        lf = ",".join(str(1.0 + 2.0 * j) for j in range(16))
        cls.results["longrope fused"] = cls.check(
            "longrope fused", cls.data, cls.tokenizer,
            ARCHS["llama"] + ",model.rope_scaling=longrope,model.rope_original_context=4096,model.rope_attention_factor=1,"
            f'model.rope_short_factors="{sf}",model.rope_long_factors="{lf}"', PROMPTS, HF_TYPES)
        # MoE as llama.cpp's stacked experts (ffn_gate_inp, ffn_{gate,up,down}_exps): Mixtral's shape
        # (4 experts, top 2, softmax renormalised over them) as its llama; with q/k norms as qwen3moe.
        moe = ",model.moe_experts=4,model.moe_top_k=2,model.moe_d_ff=64"
        cls.results["mixtral moe"] = cls.check("mixtral moe", cls.data, cls.tokenizer, ARCHS["llama"] + moe, PROMPTS,
                                               HF_TYPES)
        cls.results["qwen3moe qk norm"] = cls.check("qwen3moe qk norm", cls.data, cls.tokenizer,
                                                    ARCHS["llama"] + moe + ",model.qk_norm=true", PROMPTS, HF_TYPES)
        # GPT-OSS's shape: attention sinks, q/k/v and o_proj biases, layer 0 within a window of 8 and
        # layer 1 global, MoE with router and expert biases and the clamped SwiGLU, written as
        # llama.cpp's gpt-oss (its sinks in the softmax, its experts' biases by ggml_add_id).
        cls.results["gpt-oss sinks, moe, swa"] = cls.check(
            "gpt-oss sinks, moe, swa", cls.data, cls.tokenizer,
            ARCHS["llama"] + moe + ",model.attn_sinks=true,model.qkv_bias=true,model.attn_out_bias=true,"
            "model.gate_activation=swiglu_oai,model.moe_router_bias=true,model.moe_expert_bias=true,"
            "model.attn_window=8,model.window_pattern=2", PROMPTS, HF_TYPES)
        # Qwen3-Next's shape: layer 0 a gated DeltaNet block (1 key head, 2 value heads of 16, a conv of 4
        # taps), layer 1 gated attention (per-head q/k norms, RoPE on half of each head), MoE with a
        # gated shared expert, written as llama.cpp's qwen3next (its chunked delta rule and conv state).
        # Initialised at std 0.1: llama.cpp's l2 norm of q and k divides by max(|x|, eps) where
        # transformers (and Loom) multiply by rsqrt(|x|^2 + 1e-6), which differ when |x| is ~1e-2, as
        # the conv's outputs are in a barely trained model at std 0.02 (there the log-probabilities
        # part by 1.1e-3; measured 2026-12-06).
        cls.results["qwen3next linear attention"] = cls.check(
            "qwen3next linear attention", cls.data, cls.tokenizer,
            ARCHS["llama"] + moe + ",model.linear_interval=2,model.linear_key_heads=1,model.linear_value_heads=2,"
            "model.linear_key_dim=16,model.linear_value_dim=16,model.attn_output_gate=true,model.qk_norm=true,"
            "model.rope_fraction=0.5,model.moe_shared=1,model.moe_shared_gate=true,model.init_std=0.1", PROMPTS, HF_TYPES)
        for name, tokenizer in (("hf llama, tokenizer.json", cls.llama3_style_tokenizer()),
                                ("hf llama, tokenizer.model", cls.sentencepiece_tokenizer())):
            data = os.path.join(cls.tmp, "data_" + os.path.basename(tokenizer))
            run(LOOM, "prepare", "--input", TEXT, "--tokenizer", tokenizer, "--out", data, "--val-fraction", "0.1")
            cls.results[name] = cls.check(name, data, tokenizer, ARCHS["llama"], HF_PROMPTS, HF_TYPES, hf=True)

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    @classmethod
    def llama3_style_tokenizer(cls) -> str:
        """A Llama-3-style tokenizer.json on the learned BPE: its tokens but <|endoftext|> (ids
        0..n-1), its merges, Llama 3's Split regex + ByteLevel, ignore_merges, <|begin_of_text|> n
        and <|end_of_text|> n+1 (special; BOS by TemplateProcessing, EOS by tokenizer_config.json),
        no token n+2, the non-special <tool_call> n+3."""
        with open(os.path.join(cls.tokenizer, "encoder.json"), encoding="utf-8") as f:
            encoder = json.load(f)
        with open(os.path.join(cls.tokenizer, "vocab.bpe"), encoding="utf-8") as f:
            merges = [line for line in f.read().split("\n")[1:] if line]
        vocab = {t: i for t, i in encoder.items() if t != "<|endoftext|>"}
        n = len(vocab)
        assert sorted(vocab.values()) == list(range(n))
        added = [(n, "<|begin_of_text|>", True), (n + 1, "<|end_of_text|>", True), (n + 3, "<tool_call>", False)]
        regex = ("(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|"
                 "\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+")
        byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}
        bos = {"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 0}}
        tokenizer = {
            "version": "1.0", "truncation": None, "padding": None,
            "added_tokens": [{"id": i, "content": c, "single_word": False, "lstrip": False, "rstrip": False,
                              "normalized": False, "special": special} for i, c, special in added],
            "normalizer": None,
            "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False}, byte_level]},
            "post_processor": {"type": "Sequence", "processors": [byte_level, {
                "type": "TemplateProcessing", "single": [bos, {"Sequence": {"id": "A", "type_id": 0}}],
                "pair": [bos, {"Sequence": {"id": "A", "type_id": 0}}, bos, {"Sequence": {"id": "B", "type_id": 1}}],
                "special_tokens": {"<|begin_of_text|>": {"id": "<|begin_of_text|>", "ids": [n],
                                                         "tokens": ["<|begin_of_text|>"]}}}]},
            "decoder": byte_level,
            "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                      "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": True,
                      "vocab": vocab, "merges": merges},
        }
        out = os.path.join(cls.tmp, "tokenizer_json")
        os.makedirs(out)
        with open(os.path.join(out, "tokenizer.json"), "w", encoding="utf-8") as f:
            json.dump(tokenizer, f, ensure_ascii=False)
        with open(os.path.join(out, "tokenizer_config.json"), "w", encoding="utf-8") as f:
            json.dump({"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"}, f)
        return out

    @classmethod
    def sentencepiece_tokenizer(cls) -> str:
        """A Llama-2-style SentencePiece BPE (byte fallback, identity normalization, dummy prefix)
        of 800 pieces trained on the text by python3-sentencepiece, with Llama 2's
        tokenizer_config.json (BOS added)."""
        out = os.path.join(cls.tmp, "tokenizer_model")
        run(sys.executable, os.path.join(ROOT, "tools", "sentencepiece_reference.py"), "train", out, f"input={TEXT}",
            "vocab_size=800")
        with open(os.path.join(out, "tokenizer_config.json"), "w", encoding="utf-8") as f:
            json.dump({"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True, "add_eos_token": False}, f)
        return out

    @classmethod
    def check(cls, name: str, data: str, tokenizer: str, sets: str, prompts: list, types: tuple, hf: bool = False):
        """Trains `name`, probes Loom's side and runs llama.cpp on each exported type. With `hf`
        the run is written as a Hugging Face folder first, and the probe and the exports read that."""
        run_name = name.replace(" ", "_").replace(",", "").replace(".", "_")
        run(LOOM, "train", "--set", f"{SETS},{sets},data.dir={data},data.tokenizer={tokenizer},"
            f"run.dir={cls.tmp}/runs,run.name={run_name}")
        weights = os.path.join(cls.tmp, "runs", run_name, "checkpoints", "step_00000040")
        if hf:
            hf_dir = os.path.join(cls.tmp, "hf_" + run_name)
            run(LOOM, "convert", "--to", "hf", "--checkpoint", weights, "--out", hf_dir)
            expected = {"config.json", "model.safetensors", "tokenizer_config.json"} | (
                set(os.listdir(tokenizer)) & {"tokenizer.json", "tokenizer.model"})
            if set(os.listdir(hf_dir)) != expected:  # the run's tokenizer files go along
                raise AssertionError(f"{hf_dir} holds {sorted(os.listdir(hf_dir))}, expected {sorted(expected)}")
            weights = tokenizer = hf_dir
        prompts_file = os.path.join(cls.tmp, f"prompts_{run_name}.json")
        with open(prompts_file, "w", encoding="utf-8") as f:
            json.dump(prompts, f, ensure_ascii=False)
        loom = json.loads(run(PROBE, weights, tokenizer, str(CONTINUATION), prompts_file, cls.text_file))
        out = {"loom": loom, "types": types, "prompts": prompts, "convert": {}}
        spec = os.path.join(cls.tmp, "spec.json")
        with open(spec, "w", encoding="utf-8") as f:
            json.dump({"prompts": prompts, "tokens": CONTINUATION, "text": cls.text, "context": CONTEXT,
                       "vocab": len(loom["prompts"][0]["next_logprobs"])}, f)
        for t in types:
            gguf = os.path.join(cls.tmp, f"{run_name}_{t}.gguf")
            out["convert"][t] = run(LOOM, "convert", "--to", "gguf", "--type", t, "--checkpoint", weights, "--out", gguf)
            print(out["convert"][t].strip())
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
        for name, r in self.results.items():
            compared = 0
            for t in r["types"]:
                for a, b in zip(r["loom"]["prompts"], r[t]["prompts"], strict=True):
                    self.assertEqual(a["tokens"], b["tokens"], f"{name} {t}: {a['prompt']!r}")
                    self.assertEqual(a["tokens_special"], b["tokens_special"], f"{name} {t}: {a['prompt']!r}, special "
                                     "tokens parsed")
                    compared += len(a["tokens"]) + len(a["tokens_special"])
                self.assertEqual(r["loom"]["text_tokens"], r[t]["text_tokens"], f"{name} {t}: the text")
                compared += len(r["loom"]["text_tokens"])
            print(f"{name}: {len(r['prompts'])} prompts (plain and with special tokens parsed) and the text, "
                  f"{compared} tokens over {len(r['types'])} files: identical")

    def test_placeholder_is_reported(self):
        out = self.results["hf llama, tokenizer.json"]["convert"]["f32"]
        self.assertIn("gives no token for 1 id(s) below its size (513)", out)
        self.assertNotIn("note:", self.results["hf llama, tokenizer.model"]["convert"]["f32"])

    def test_greedy_continuations_and_logprobs_agree(self):
        for name, r in self.results.items():
            for t, tolerance in (("f32", 1e-3), ("f16", 2e-2)):
                same = sum(a["continuation"] == b["continuation"] for a, b in zip(r["loom"]["prompts"], r[t]["prompts"]))
                diff = self.max_logprob_diff(r["loom"], r[t])  # a difference below is a near-tie (assert_same_continuation)
                nll = r[t]["mean_nll"] - r["loom"]["mean_nll"]
                print(f"{name} {t}: {same}/{len(r['prompts'])} greedy continuations of {CONTINUATION} tokens identical, "
                      f"max |log p diff| {diff:.2e}, mean loss llama.cpp {r[t]['mean_nll']:.5f} vs Loom "
                      f"{r['loom']['mean_nll']:.5f} ({nll:+.2e})")
                for a, b in zip(r["loom"]["prompts"], r[t]["prompts"], strict=True):
                    self.assert_same_continuation(a, b, tolerance, f"{name} {t}: {a['prompt']!r}")
                self.assertLess(diff, tolerance, f"{name} {t}")
                self.assertLess(abs(nll), tolerance, f"{name} {t}")

    def assert_same_continuation(self, loom: dict, llama: dict, tolerance: float, what: str):
        """The greedy continuations agree up to their first difference, and there Loom's pick led
        the runner-up by less than the log-probability tolerance (a near-tie llama.cpp's rounding
        may break the other way); anything else is a failure."""
        a, b = loom["continuation"], llama["continuation"]
        first = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if first is None:
            self.assertEqual(len(a), len(b), what)
            return
        margin = loom["continuation_margins"][first]
        self.assertLess(margin, tolerance, f"{what}: continuations differ at token {first} ({a} vs {b}) where "
                        f"Loom's pick leads by {margin:.2e}, not a near-tie")
        print(f"  {what}: a near-tie at token {first} (Loom's pick leads by {margin:.1e}); the tokens before agree")

    def test_quantized_loss_change_is_bounded(self):
        for name, r in self.results.items():
            base = r["f32"]["mean_nll"]
            for t, bound in (("f16", 0.01), ("bf16", 0.02), ("q8_0", 0.05), ("q4_0", 0.5)):
                if t not in r["types"]:
                    continue
                change = r[t]["mean_nll"] - base
                same = sum(a["continuation"] == b["continuation"] for a, b in zip(r["loom"]["prompts"], r[t]["prompts"]))
                print(f"{name} {t}: mean loss {r[t]['mean_nll']:.4f} vs f32 {base:.4f} ({change:+.4f} nats, perplexity "
                      f"x{math.exp(change):.4f}), {same}/{len(r['prompts'])} greedy continuations as Loom's")
                self.assertTrue(math.isfinite(r[t]["mean_nll"]), f"{name} {t}")
                self.assertLess(abs(change), bound, f"{name} {t}")


if __name__ == "__main__":
    unittest.main(argv=[sys.argv[0], "-v"])
