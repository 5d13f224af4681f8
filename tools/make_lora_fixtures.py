#!/usr/bin/python3
"""LoRA adapters in Hugging Face PEFT's layout and their PyTorch reference, for Loom's LoRA tests.

    /usr/bin/python3 tools/make_lora_fixtures.py --out build/fixtures/lora

For a tiny GPT-2 and a tiny Llama (the shapes of tools/make_hf_fixtures.py), writes
  <case>/base/           the Hugging Face model folder (config.json, model.safetensors)
  <case>/adapter/        adapter_config.json and adapter_model.safetensors as PEFT's
                         `save_pretrained` writes them: base_model.model.<module>.lora_A.weight
                         (r, in) and .lora_B.weight (out, r), both nonzero here
  <case>/expected.json   the tokens, the adapted model's logits and mean next-token loss, and the
                         gradient of that loss with respect to every adapter tensor

computed in float64 with autograd from the LoRA formula (Hu et al. 2021, eq. 3) as PEFT's
LoraLayer applies it: y = base(x) + s B (A x), s = lora_alpha / r, or lora_alpha / sqrt(r) with
use_rslora (Kalajdzievski 2023). The *_dora cases add PEFT's DoRA (use_dora: Liu et al. 2024,
.lora_magnitude_vector (out) per module), the row norm detached as PEFT's DoraLinearLayer does.
GPT-2's Conv1D keeps its weight (in, out); PEFT's A and B are
the same (r, in) and (out, r) matrices there. Nothing here imports peft or transformers (not in
Debian): the layout is written from PEFT's documented names.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_hf_fixtures import (causal_attention, gelu_new, gpt2_case, llama_case, rope,  # noqa: E402
                              save_folder, write_safetensors)

PREFIX = "base_model.model."


def lora_term(x: torch.Tensor, adapters: dict, module: str, scale: float, w: torch.Tensor):
    """The adapter's addition to the base output x w^T (w: the base weight, (out, in))."""
    a = adapters.get(PREFIX + module + ".lora_A.weight")
    if a is None:
        return 0.0
    b = adapters[PREFIX + module + ".lora_B.weight"]
    m = adapters.get(PREFIX + module + ".lora_magnitude_vector")
    if m is None:
        return scale * ((x @ a.T) @ b.T)
    # DoRA (Liu et al. 2024, eq. 5) as PEFT's DoraLinearLayer: the row norm of W + s B A is
    # detached, and the base output stays: (g - 1) x W^T + g s B A x with g = m / ||W + s B A||.
    norm = (w + scale * (b @ a)).norm(p=2, dim=1).detach()
    gain = m / norm
    return (gain - 1) * (x @ w.T) + gain * (scale * ((x @ a.T) @ b.T))


def gpt2_logits(cfg, g, adapters, scale, tokens):
    C, H, T = cfg["n_embd"], cfg["n_head"], tokens.numel()
    eps = cfg["layer_norm_epsilon"]
    ln = lambda x, p: torch.nn.functional.layer_norm(x, (C,), g[p + ".weight"], g[p + ".bias"], eps)
    conv = lambda x, p: (x @ g[p + ".weight"] + g[p + ".bias"] +
                         lora_term(x, adapters, "transformer." + p, scale, g[p + ".weight"].T))
    x = g["wte.weight"][tokens] + g["wpe.weight"][:T]
    for layer in range(cfg["n_layer"]):
        p = f"h.{layer}."
        qkv = conv(ln(x, p + "ln_1"), p + "attn.c_attn")
        q, k, v = (t.reshape(T, H, C // H).transpose(0, 1) for t in qkv.split(C, dim=-1))
        y = causal_attention(q, k, v).transpose(0, 1).reshape(T, C)
        x = x + conv(y, p + "attn.c_proj")
        x = x + conv(gelu_new(conv(ln(x, p + "ln_2"), p + "mlp.c_fc")), p + "mlp.c_proj")
    return ln(x, "ln_f") @ g["wte.weight"].T


def llama_logits(cfg, g, adapters, scale, tokens):
    C, H, KV, T = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], tokens.numel()
    d, eps = C // H, cfg["rms_norm_eps"]
    rms = lambda x, p: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * g[p]
    lin = lambda x, m: x @ g[m + ".weight"].T + lora_term(x, adapters, m, scale, g[m + ".weight"])
    x = g["model.embed_tokens.weight"][tokens]
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        h = rms(x, p + "input_layernorm.weight")
        q = rope(lin(h, p + "self_attn.q_proj").reshape(T, H, d).transpose(0, 1), cfg)
        k = rope(lin(h, p + "self_attn.k_proj").reshape(T, KV, d).transpose(0, 1), cfg)
        v = lin(h, p + "self_attn.v_proj").reshape(T, KV, d).transpose(0, 1)
        k, v = k.repeat_interleave(H // KV, dim=0), v.repeat_interleave(H // KV, dim=0)
        x = x + lin(causal_attention(q, k, v).transpose(0, 1).reshape(T, H * d), p + "self_attn.o_proj")
        h = rms(x, p + "post_attention_layernorm.weight")
        m = p + "mlp."
        x = x + lin(torch.nn.functional.silu(lin(h, m + "gate_proj")) * lin(h, m + "up_proj"), m + "down_proj")
    return rms(x, "model.norm.weight") @ g["lm_head.weight"].T


def base_weight(g, module):
    """The (out, in) base weight a module adapts (GPT-2's Conv1D keeps (in, out))."""
    if module.startswith("transformer."):
        return g[module[len("transformer."):] + ".weight"].T
    return g[module + ".weight"]


def write_case(out, name, cfg, weights, stored, modules, adapter_cfg, logits_fn, tokens, gen):
    base = os.path.join(out, name, "base")
    save_folder(base, cfg, stored)
    r = adapter_cfg["r"]
    scale = adapter_cfg["lora_alpha"] / (math.sqrt(r) if adapter_cfg["use_rslora"] else r)
    g = {k: v.double() for k, v in weights.items()}
    adapters = {}
    for module, n_in, n_out in modules:
        adapters[PREFIX + module + ".lora_A.weight"] = (torch.randn(r, n_in, generator=gen) * 0.2).double()
        adapters[PREFIX + module + ".lora_B.weight"] = (torch.randn(n_out, r, generator=gen) * 0.2).double()
        if adapter_cfg["use_dora"]:  # a trained magnitude: the base rows' norms, perturbed
            w = base_weight(g, module)
            adapters[PREFIX + module + ".lora_magnitude_vector"] = (
                w.norm(p=2, dim=1) * (1 + 0.2 * torch.randn(n_out, generator=gen).double()))
    for t in adapters.values():
        t.requires_grad_(True)
    logits = logits_fn(cfg, g, adapters, scale, tokens)
    loss = torch.nn.functional.cross_entropy(logits[:-1], tokens[1:])
    loss.backward()
    adapter_dir = os.path.join(out, name, "adapter")
    os.makedirs(adapter_dir, exist_ok=True)
    write_safetensors(os.path.join(adapter_dir, "adapter_model.safetensors"),
                      {k: v.detach().float() for k, v in adapters.items()})
    with open(os.path.join(adapter_dir, "adapter_config.json"), "w") as f:
        json.dump(adapter_cfg, f, indent=2)
    with open(os.path.join(out, name, "expected.json"), "w") as f:
        json.dump({"tokens": tokens.tolist(), "loss": loss.item(), "scale": scale,
                   "logits": logits[:-1].detach().flatten().tolist(),
                   "grads": {k: v.grad.flatten().tolist() for k, v in adapters.items()}}, f)


def peft_config(r, alpha, rslora, targets, fan_in_fan_out, dora=False):
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": r, "lora_alpha": alpha, "lora_dropout": 0.05,
            "use_rslora": rslora, "use_dora": dora, "bias": "none", "fan_in_fan_out": fan_in_fan_out,
            "target_modules": targets, "modules_to_save": None, "layers_to_transform": None, "rank_pattern": {},
            "alpha_pattern": {}, "init_lora_weights": True, "inference_mode": True,
            "base_model_name_or_path": "tiny", "revision": None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    out = ap.parse_args().out
    gen = torch.Generator().manual_seed(4321)
    tokens = torch.randint(0, 96, (17,), generator=gen)

    cfg, w = llama_case(gen, False)
    L, C, F = cfg["num_hidden_layers"], cfg["hidden_size"], cfg["intermediate_size"]
    d = C // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    llama_shapes = {"self_attn.q_proj": (C, q), "self_attn.k_proj": (C, kv), "self_attn.v_proj": (C, kv),
                    "self_attn.o_proj": (q, C), "mlp.gate_proj": (C, F), "mlp.up_proj": (C, F),
                    "mlp.down_proj": (F, C)}
    modules = [(f"model.layers.{l}.{m}", i, o) for l in range(L) for m, (i, o) in llama_shapes.items()]
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    write_case(out, "llama", cfg, w, dict(w), modules, peft_config(4, 8, False, targets, False), llama_logits,
               tokens, gen)
    # Only q and v (PEFT's default for Llama), rsLoRA.
    cfg, w = llama_case(gen, False)
    modules = [(f"model.layers.{l}.self_attn.{m}", C, q if m == "q_proj" else kv) for l in range(L)
               for m in ("q_proj", "v_proj")]
    write_case(out, "llama_qv", cfg, w, dict(w), modules, peft_config(2, 4, True, ["q_proj", "v_proj"], False),
               llama_logits, tokens, gen)

    cfg, w = gpt2_case(gen)
    C, F, L = cfg["n_embd"], 4 * cfg["n_embd"], cfg["n_layer"]
    stored = {"transformer." + k: v for k, v in w.items()}
    shapes = {"attn.c_attn": (C, 3 * C), "attn.c_proj": (C, C), "mlp.c_fc": (C, F), "mlp.c_proj": (F, C)}
    modules = [(f"transformer.h.{l}.{m}", i, o) for l in range(L) for m, (i, o) in shapes.items()]
    write_case(out, "gpt2", cfg, w, stored, modules, peft_config(4, 16, True, ["c_attn", "c_proj", "c_fc"], True),
               gpt2_logits, tokens, gen)
    # DoRA (use_dora): every linear layer of both models, trained magnitudes.
    write_case(out, "gpt2_dora", cfg, w, stored, modules,
               peft_config(4, 8, False, ["c_attn", "c_proj", "c_fc"], True, dora=True), gpt2_logits, tokens, gen)
    cfg, w = llama_case(gen, False)
    L = cfg["num_hidden_layers"]
    modules = [(f"model.layers.{l}.{m}", i, o) for l in range(L) for m, (i, o) in llama_shapes.items()]
    write_case(out, "llama_dora", cfg, w, dict(w), modules, peft_config(4, 8, False, targets, False, dora=True),
               llama_logits, tokens, gen)


if __name__ == "__main__":
    main()
