#!/usr/bin/python3
"""Tiny Hugging Face model folders and their PyTorch logits, for Loom's import tests.

    /usr/bin/python3 tools/make_hf_fixtures.py --out build/fixtures/hf

Writes one folder per case, in transformers' `save_pretrained` layout (config.json plus
model.safetensors, or shards and model.safetensors.index.json), with tensors named as the
transformers modeling code names them, and expected.json: the tokens, PyTorch's logits of
every position and the mean next-token loss, computed here in float64 from the stored
weights with each family's formulas as transformers writes them:

  gpt2     GPT2LMHeadModel: learned positions, LayerNorm, Conv1D weights (in, out), gelu_new,
           tied head; with and without the "transformer." prefix and the attention-mask buffers
  llama    LlamaForCausalLM: RMSNorm (x * rsqrt(mean x^2 + eps)) * w, rotate-half RoPE with
           inv_freq = theta^(-2i/d), GQA, SiLU-gated MLP, untied head (bf16, sharded)
  mistral  MistralForCausalLM: llama's formulas plus a sliding window (keys j > i - W), f16
  qwen2    Qwen2ForCausalLM: llama's formulas plus q/k/v biases, the head tied to the embedding

Nothing here imports transformers (not in Debian); the formulas are written from the model
papers and the modeling files' definitions. safetensors files are written by hand (the format:
u64 header length, JSON header, little-endian data), as tools/loom_reference.py does.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import struct

import torch

_DTYPES = {torch.float32: ("F32", torch.int32), torch.float16: ("F16", torch.int16), torch.bfloat16: ("BF16", torch.int16)}


def write_safetensors(path: str, tensors: dict[str, torch.Tensor]) -> None:
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    chunks, offset = [], 0
    for name, t in tensors.items():
        st, bits = _DTYPES[t.dtype]
        data = t.contiguous().view(bits).numpy().tobytes()
        header[name] = {"dtype": st, "shape": list(t.shape), "data_offsets": [offset, offset + len(data)]}
        chunks.append(data)
        offset += len(data)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(chunks))


def save_folder(path: str, config: dict, tensors: dict[str, torch.Tensor], shards: int = 1) -> None:
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    if shards == 1:
        write_safetensors(os.path.join(path, "model.safetensors"), tensors)
        return
    names = list(tensors)
    weight_map = {}
    for s in range(shards):
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = names[s::shards]
        write_safetensors(os.path.join(path, file), {n: tensors[n] for n in part})
        weight_map.update({n: file for n in part})
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": 0}, "weight_map": weight_map}, f, indent=2)


def gelu_new(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x.pow(3))))


def causal_attention(q, k, v, window: int = 0):
    """q (H, T, d), k/v (H, T, d): softmax(q k^T / sqrt d) v over keys j <= i (and j > i - W)."""
    T = q.shape[1]
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    i = torch.arange(T).unsqueeze(1)
    j = torch.arange(T).unsqueeze(0)
    visible = j <= i
    if window > 0:
        visible &= j > i - window
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def gpt2_logits(cfg: dict, w: dict[str, torch.Tensor], tokens: torch.Tensor) -> torch.Tensor:
    g = {k: v.double() for k, v in w.items()}
    C, H, T = cfg["n_embd"], cfg["n_head"], tokens.numel()
    eps = cfg["layer_norm_epsilon"]
    ln = lambda x, p: torch.nn.functional.layer_norm(x, (C,), g[p + ".weight"], g[p + ".bias"], eps)
    x = g["wte.weight"][tokens] + g["wpe.weight"][:T]
    for layer in range(cfg["n_layer"]):
        p = f"h.{layer}."
        qkv = ln(x, p + "ln_1") @ g[p + "attn.c_attn.weight"] + g[p + "attn.c_attn.bias"]
        q, k, v = (t.reshape(T, H, C // H).transpose(0, 1) for t in qkv.split(C, dim=-1))
        y = causal_attention(q, k, v).transpose(0, 1).reshape(T, C)
        x = x + y @ g[p + "attn.c_proj.weight"] + g[p + "attn.c_proj.bias"]
        h = gelu_new(ln(x, p + "ln_2") @ g[p + "mlp.c_fc.weight"] + g[p + "mlp.c_fc.bias"])
        x = x + h @ g[p + "mlp.c_proj.weight"] + g[p + "mlp.c_proj.bias"]
    return ln(x, "ln_f") @ g["wte.weight"].T


def rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate-half RoPE on (H, T, d): angle[t, i] = t theta^(-2i/d), duplicated over both halves."""
    T, d = x.shape[1], x.shape[2]
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    angle = torch.arange(T, dtype=torch.float64).unsqueeze(1) * inv_freq.unsqueeze(0)
    angle = torch.cat([angle, angle], dim=-1)
    rotated = torch.cat([-x[..., d // 2:], x[..., : d // 2]], dim=-1)
    return x * angle.cos() + rotated * angle.sin()


def llama_logits(cfg: dict, w: dict[str, torch.Tensor], tokens: torch.Tensor) -> torch.Tensor:
    g = {k: v.double() for k, v in w.items()}
    C, H, KV, T = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], tokens.numel()
    d, eps, window = C // H, cfg["rms_norm_eps"], cfg.get("sliding_window") or 0
    rms = lambda x, p: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * g[p]
    x = g["model.embed_tokens.weight"][tokens]
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        h = rms(x, p + "input_layernorm.weight")
        proj = lambda name: h @ g[p + f"self_attn.{name}.weight"].T + g.get(p + f"self_attn.{name}.bias", 0.0)
        q = proj("q_proj").reshape(T, H, d).transpose(0, 1)
        k = proj("k_proj").reshape(T, KV, d).transpose(0, 1)
        v = proj("v_proj").reshape(T, KV, d).transpose(0, 1)
        q, k = rope(q, cfg["rope_theta"]), rope(k, cfg["rope_theta"])
        k, v = k.repeat_interleave(H // KV, dim=0), v.repeat_interleave(H // KV, dim=0)
        y = causal_attention(q, k, v, window).transpose(0, 1).reshape(T, C)
        x = x + y @ g[p + "self_attn.o_proj.weight"].T
        h = rms(x, p + "post_attention_layernorm.weight")
        gate = h @ g[p + "mlp.gate_proj.weight"].T
        x = x + (torch.nn.functional.silu(gate) * (h @ g[p + "mlp.up_proj.weight"].T)) @ g[p + "mlp.down_proj.weight"].T
    head = g["model.embed_tokens.weight"] if cfg.get("tie_word_embeddings") else g["lm_head.weight"]
    return rms(x, "model.norm.weight") @ head.T


def gpt2_case(gen: torch.Generator) -> tuple[dict, dict[str, torch.Tensor]]:
    C, F, L, V, P = 32, 128, 2, 96, 32
    cfg = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": V, "n_positions": P,
           "n_ctx": P, "n_embd": C, "n_layer": L, "n_head": 4, "n_inner": None, "layer_norm_epsilon": 1e-5,
           "activation_function": "gelu_new", "resid_pdrop": 0.1, "embd_pdrop": 0.1, "attn_pdrop": 0.1,
           "initializer_range": 0.02, "bos_token_id": 0, "eos_token_id": 0, "torch_dtype": "float32",
           "transformers_version": "4.44.0", "use_cache": True}
    r = lambda *shape, s=0.2: torch.randn(*shape, generator=gen) * s
    w = {"wte.weight": r(V, C), "wpe.weight": r(P, C, s=0.05)}
    for layer in range(L):
        p = f"h.{layer}."
        w.update({p + "ln_1.weight": 1 + r(C, s=0.1), p + "ln_1.bias": r(C, s=0.1),
                  p + "attn.c_attn.weight": r(C, 3 * C), p + "attn.c_attn.bias": r(3 * C, s=0.05),
                  p + "attn.c_proj.weight": r(C, C), p + "attn.c_proj.bias": r(C, s=0.05),
                  p + "ln_2.weight": 1 + r(C, s=0.1), p + "ln_2.bias": r(C, s=0.1),
                  p + "mlp.c_fc.weight": r(C, F), p + "mlp.c_fc.bias": r(F, s=0.05),
                  p + "mlp.c_proj.weight": r(F, C), p + "mlp.c_proj.bias": r(C, s=0.05)})
    w.update({"ln_f.weight": 1 + r(C, s=0.1), "ln_f.bias": r(C, s=0.1)})
    return cfg, w


def llama_case(gen: torch.Generator, mistral: bool, qwen2: bool = False) -> tuple[dict, dict[str, torch.Tensor]]:
    C, F, L, V, H, KV = 32, 48, 2, 96, 4, 2
    d = C // H
    cfg = {"architectures": ["MistralForCausalLM" if mistral else "LlamaForCausalLM"],
           "model_type": "mistral" if mistral else "llama", "vocab_size": V, "hidden_size": C,
           "intermediate_size": F, "num_hidden_layers": L, "num_attention_heads": H, "num_key_value_heads": KV,
           "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "rope_theta": 1e6 if mistral else 500000.0,
           "hidden_act": "silu", "initializer_range": 0.02, "tie_word_embeddings": False, "attention_bias": False,
           "attention_dropout": 0.0, "rope_scaling": None, "bos_token_id": 1, "eos_token_id": 2,
           "torch_dtype": "float16" if mistral else "bfloat16", "transformers_version": "4.44.0", "use_cache": True}
    if qwen2:
        cfg.update({"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "tie_word_embeddings": True,
                    "use_sliding_window": False, "sliding_window": 32, "max_window_layers": 2, "rope_theta": 1e6,
                    "torch_dtype": "bfloat16"})
        for key in ("attention_bias",):
            cfg.pop(key)
    elif mistral:
        cfg["sliding_window"] = 5
    else:
        cfg.update({"mlp_bias": False, "pretraining_tp": 1, "head_dim": d})
    r = lambda *shape, s=0.2: torch.randn(*shape, generator=gen) * s
    w = {"model.embed_tokens.weight": r(V, C)}
    for layer in range(L):
        p = f"model.layers.{layer}."
        w.update({p + "input_layernorm.weight": 1 + r(C, s=0.1), p + "self_attn.q_proj.weight": r(H * d, C),
                  p + "self_attn.k_proj.weight": r(KV * d, C), p + "self_attn.v_proj.weight": r(KV * d, C),
                  p + "self_attn.o_proj.weight": r(C, H * d), p + "post_attention_layernorm.weight": 1 + r(C, s=0.1),
                  p + "mlp.gate_proj.weight": r(F, C), p + "mlp.up_proj.weight": r(F, C),
                  p + "mlp.down_proj.weight": r(C, F)})
    w.update({"model.norm.weight": 1 + r(C, s=0.1), "lm_head.weight": r(V, C)})
    if qwen2:
        del w["lm_head.weight"]
        for layer in range(L):
            p = f"model.layers.{layer}.self_attn."
            w.update({p + "q_proj.bias": r(H * d, s=0.1), p + "k_proj.bias": r(KV * d, s=0.1),
                      p + "v_proj.bias": r(KV * d, s=0.1)})
    return cfg, w


def write_case(out: str, name: str, cfg: dict, stored: dict[str, torch.Tensor], weights: dict[str, torch.Tensor],
               logits_fn, tokens: torch.Tensor, shards: int = 1) -> None:
    path = os.path.join(out, name)
    save_folder(path, cfg, stored, shards)
    logits = logits_fn(cfg, weights, tokens)
    loss = torch.nn.functional.cross_entropy(logits[:-1], tokens[1:]).item()
    with open(os.path.join(path, "expected.json"), "w") as f:
        json.dump({"tokens": tokens.tolist(), "loss": loss, "logits": logits[:-1].flatten().tolist()}, f)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    out = ap.parse_args().out
    gen = torch.Generator().manual_seed(1234)
    tokens = torch.randint(0, 96, (17,), generator=gen)

    cfg, w = gpt2_case(gen)
    # As GPT2LMHeadModel's state dict: "transformer." prefix, the mask buffers, the tied head.
    stored = {"transformer." + k: v for k, v in w.items()}
    for layer in range(cfg["n_layer"]):
        stored[f"transformer.h.{layer}.attn.bias"] = torch.tril(torch.ones(32, 32)).view(1, 1, 32, 32)
    stored["lm_head.weight"] = w["wte.weight"].clone()
    write_case(out, "gpt2", cfg, stored, w, gpt2_logits, tokens)
    # As the original GPT-2 release: no prefix, no lm_head.
    write_case(out, "gpt2_plain", cfg, dict(w), w, gpt2_logits, tokens)

    for name, mistral, dtype, shards in (("llama", False, torch.bfloat16, 2), ("mistral", True, torch.float16, 1)):
        cfg, w = llama_case(gen, mistral)
        stored = {k: v.to(dtype) for k, v in w.items()}
        write_case(out, name, cfg, stored, {k: v.float() for k, v in stored.items()}, llama_logits, tokens, shards)
    cfg, w = llama_case(gen, False, qwen2=True)
    write_case(out, "qwen2", cfg, dict(w), w, llama_logits, tokens)


if __name__ == "__main__":
    main()
