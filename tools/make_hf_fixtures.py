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
  llama32  LlamaForCausalLM with rope_scaling "llama3" (Llama 3.1 / 3.2), a tied head, wide heads
  qwen3    Qwen3ForCausalLM: llama's formulas plus RMSNorm of each q and k head before RoPE
  mixtral  MixtralForCausalLM: every MLP a softmax top-2 of 4 experts (block_sparse_moe, w1/w3/w2)
  qwen3_moe  Qwen3MoeForCausalLM: qwen3 attention, softmax top-2 experts renormalised
  smollm3  SmolLM3ForCausalLM: llama's formulas without RoPE on every no_rope_layer_interval-th layer
  phi3     Phi3ForCausalLM: llama's formulas with a sliding window, q/k/v and gate/up stored fused
  olmo2    Olmo2ForCausalLM: RMSNorm of the attention and MLP outputs before the residual add (no
           input norms), q/k RMSNorm over all heads at once, in bf16
  gemma3   Gemma3ForCausalLM: (1 + w) RMSNorms before and after attention and MLP, per-head q/k
           norms, GeGLU (gelu_pytorch_tanh), the embedding times sqrt(hidden_size), sliding and
           global layers (sliding_window_pattern) with their own RoPE (local base, unscaled; global
           base with linear scaling), MQA, wide heads, a tied head, in bf16
  deepseek_v2 / deepseek_v3  DeepseekV2/V3ForCausalLM (bf16): MLA with DeepSeek's interleaved RoPE
           pairs, a dense first layer, MoE with a shared expert (V2: softmax greedy, scaled; V3:
           compressed queries, sigmoid group-limited routing with the correction bias,
           renormalised and scaled, plus a multi-token-prediction layer that Loom skips)

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

_DTYPES = {torch.float32: ("F32", torch.int32), torch.float16: ("F16", torch.int16), torch.bfloat16: ("BF16", torch.int16),
           torch.uint8: ("U8", torch.uint8)}


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


def causal_attention(q, k, v, window: int = 0, scale: float = 1.0):
    """q (H, T, d), k/v (H, T, d): softmax(scale q k^T / sqrt d) v over keys j <= i (and j > i - W)."""
    T = q.shape[1]
    scores = q @ k.transpose(-1, -2) * scale / math.sqrt(q.shape[-1])
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


def rope_inv_freq(cfg: dict, d: int, seq_len: int = 0) -> torch.Tensor:
    """theta^(-2i/d), rescaled as config.json's rope_scaling says: "linear" divides by factor;
    "llama3" (Llama 3.1) keeps wavelengths 2 pi / f below L / high_freq_factor, divides those above
    L / low_freq_factor by factor and blends the ones between (L: original_max_position_embeddings);
    "longrope" (Phi-3 128k) divides pair i by long_factor[i] when the sequence is longer than
    original_max_position_embeddings, else by short_factor[i] (transformers' _compute_longrope_parameters)."""
    inv_freq = 1.0 / (cfg["rope_theta"] ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    s = cfg.get("rope_scaling")
    if not s:
        return inv_freq
    kind = s.get("rope_type", s.get("type"))
    if kind == "longrope":
        original = cfg.get("original_max_position_embeddings", cfg["max_position_embeddings"])
        factors = s["long_factor"] if seq_len > original else s["short_factor"]
        return inv_freq / torch.tensor(factors, dtype=torch.float64)
    if kind == "linear":
        return inv_freq / s["factor"]
    if kind == "yarn":  # transformers' _compute_yarn_parameters (truncate = True)
        base, factor, L = cfg["rope_theta"], s["factor"], s.get("original_max_position_embeddings", cfg["max_position_embeddings"])
        corr = lambda rot: (d * math.log(L / (rot * 2 * math.pi))) / (2 * math.log(base))
        low, high = max(math.floor(corr(s.get("beta_fast", 32))), 0), min(math.ceil(corr(s.get("beta_slow", 1))), d - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(d // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
        extrapolation = 1 - ramp
        return (inv_freq / factor) * (1 - extrapolation) + inv_freq * extrapolation
    assert kind == "llama3"
    factor, low, high, L = s["factor"], s["low_freq_factor"], s["high_freq_factor"], s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > L / low, inv_freq / factor, inv_freq)
    smooth = (L / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < L / high) & ~(wavelen > L / low)
    return torch.where(medium, smoothed, scaled)


def yarn_mscale(scale: float, m: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def rope_amplitude(cfg: dict) -> float:
    """YaRN's factor on cos and sin: attention_factor, else mscale(f, mscale) / mscale(f, mscale_all_dim)
    when both are set, else mscale(f) (transformers; DeepSeek's code gives the same for its configs)."""
    s = cfg.get("rope_scaling")
    if s and s.get("rope_type", s.get("type")) == "longrope":  # sqrt(1 + ln f / ln L), f = max / original
        if s.get("attention_factor") is not None:
            return s["attention_factor"]
        original = cfg.get("original_max_position_embeddings", cfg["max_position_embeddings"])
        f = cfg["max_position_embeddings"] / original
        return 1.0 if f <= 1 else math.sqrt(1 + math.log(f) / math.log(original))
    if not s or s.get("rope_type", s.get("type")) != "yarn":
        return 1.0
    if s.get("attention_factor") is not None:
        return s["attention_factor"]
    if s.get("mscale") and s.get("mscale_all_dim"):
        return yarn_mscale(s["factor"], s["mscale"]) / yarn_mscale(s["factor"], s["mscale_all_dim"])
    return yarn_mscale(s["factor"])


def rope(x: torch.Tensor, cfg: dict) -> torch.Tensor:
    """Rotate-half RoPE on (H, T, d): angle[t, i] = t inv_freq[i], duplicated over both halves."""
    T, d = x.shape[1], x.shape[2]
    inv_freq = rope_inv_freq(cfg, d, T)
    angle = torch.arange(T, dtype=torch.float64).unsqueeze(1) * inv_freq.unsqueeze(0)
    angle = torch.cat([angle, angle], dim=-1)
    rotated = torch.cat([-x[..., d // 2:], x[..., : d // 2]], dim=-1)
    a = rope_amplitude(cfg)
    return x * (angle.cos() * a) + rotated * (angle.sin() * a)


def swiglu(g: dict, p: str, h: torch.Tensor, names=("gate_proj", "up_proj", "down_proj")) -> torch.Tensor:
    gate, up, down = (g[p + n + ".weight"] for n in names)
    return (torch.nn.functional.silu(h @ gate.T) * (h @ up.T)) @ down.T


def moe(cfg: dict, g: dict, p: str, h: torch.Tensor) -> torch.Tensor:
    """The MoE MLPs as each family's modeling code routes (T tokens of h (T, C)):
    mixtral     softmax over the router logits, top-k, renormalised (softmax of the top-k logits);
    qwen3_moe   softmax, top-k, renormalised when norm_topk_prob;
    deepseek_v2 softmax, greedy top-k; renormalised when norm_topk_prob and k > 1, else scaled by
                routed_scaling_factor; plus the shared experts (one MLP);
    deepseek_v3 sigmoid; selection by scores + e_score_correction_bias inside the topk_group best of
                n_group groups (a group scores the sum of its two best), gates = the sigmoid scores,
                renormalised when norm_topk_prob and k > 1, then scaled by routed_scaling_factor."""
    family, k = cfg["model_type"], cfg["num_experts_per_tok"]
    if family == "mixtral":
        gate, experts, names = p + "block_sparse_moe.gate.weight", p + "block_sparse_moe.experts.", ("w1", "w3", "w2")
    else:
        gate, experts, names = p + "mlp.gate.weight", p + "mlp.experts.", ("gate_proj", "up_proj", "down_proj")
    logits = h @ g[gate].T
    if family == "deepseek_v3":
        scores = torch.sigmoid(logits)
        choice = scores + g[p + "mlp.gate.e_score_correction_bias"]
        G = cfg["n_group"]
        group_scores = choice.view(h.shape[0], G, -1).topk(2, dim=-1)[0].sum(-1)
        keep = torch.zeros_like(group_scores).scatter_(1, group_scores.topk(cfg["topk_group"], dim=-1)[1], 1)
        keep = keep.unsqueeze(-1).expand(-1, G, choice.shape[1] // G).reshape(h.shape[0], -1)
        idx = choice.masked_fill(keep == 0, 0.0).topk(k, dim=-1)[1]
        weight = scores.gather(1, idx)
    else:
        scores = torch.softmax(logits, dim=-1)
        weight, idx = scores.topk(k, dim=-1)
    renorm = {"mixtral": True, "qwen3_moe": cfg.get("norm_topk_prob", False)}.get(family, cfg.get("norm_topk_prob") and k > 1)
    if renorm:
        weight = weight / weight.sum(-1, keepdim=True)
    if family == "deepseek_v3" or (family == "deepseek_v2" and not renorm):
        weight = weight * cfg["routed_scaling_factor"]
    out = torch.zeros_like(h)
    for t in range(h.shape[0]):
        for j in range(k):
            out[t] += weight[t, j] * swiglu(g, experts + f"{int(idx[t, j])}.", h[t:t + 1], names)[0]
    if p + "mlp.shared_experts.gate_proj.weight" in g:
        out = out + swiglu(g, p + "mlp.shared_experts.", h)
    return out


def deepseek_rope(x: torch.Tensor, cfg: dict) -> torch.Tensor:
    """DeepSeek's RoPE on (..., T, d_r): the interleaved pairs (2i, 2i+1) regrouped into halves
    (x.view(d/2, 2).transpose), then rotate-half, as its modeling code does."""
    *lead, T, d = x.shape
    x = x.reshape(*lead, T, d // 2, 2).transpose(-1, -2).reshape(*lead, T, d)
    return rope(x.reshape(-1, T, d), cfg).reshape(*lead, T, d)


def mla(cfg: dict, g: dict, p: str, h: torch.Tensor, rms) -> torch.Tensor:
    """DeepSeek-V2's multi-head latent attention on h (T, C), as its modeling code writes it."""
    T, H = h.shape[0], cfg["num_attention_heads"]
    dn, dr, dv, dc = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"], cfg["kv_lora_rank"]
    a = p + "self_attn."
    if cfg.get("q_lora_rank"):
        q = rms(h @ g[a + "q_a_proj.weight"].T, a + "q_a_layernorm.weight") @ g[a + "q_b_proj.weight"].T
    else:
        q = h @ g[a + "q_proj.weight"].T
    q = q.view(T, H, dn + dr).transpose(0, 1)
    ckv = h @ g[a + "kv_a_proj_with_mqa.weight"].T
    kv = rms(ckv[:, :dc], a + "kv_a_layernorm.weight") @ g[a + "kv_b_proj.weight"].T
    kv = kv.view(T, H, dn + dv).transpose(0, 1)
    k_pe = deepseek_rope(ckv[:, dc:].unsqueeze(0), cfg).expand(H, T, dr)
    query = torch.cat([q[..., :dn], deepseek_rope(q[..., dn:], cfg)], dim=-1)
    key = torch.cat([kv[..., :dn], k_pe], dim=-1)
    s = cfg.get("rope_scaling") or {}
    # DeepSeek's YaRN: softmax_scale times mscale(factor, mscale_all_dim)^2.
    scale = yarn_mscale(s["factor"], s["mscale_all_dim"]) ** 2 if s.get("mscale_all_dim") else 1.0
    y = causal_attention(query, key, kv[..., dn:], scale=scale)  # scale / sqrt(dn + dr)
    return y.transpose(0, 1).reshape(T, H * dv) @ g[a + "o_proj.weight"].T


def llama_logits(cfg: dict, w: dict[str, torch.Tensor], tokens: torch.Tensor) -> torch.Tensor:
    g = {k: v.double() for k, v in w.items()}
    C, H, KV, T = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], tokens.numel()
    d, eps, window = cfg.get("head_dim", C // H), cfg["rms_norm_eps"], cfg.get("sliding_window") or 0
    rms = lambda x, p: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * g[p]
    x = g["model.embed_tokens.weight"][tokens]
    olmo2 = cfg["model_type"] == "olmo2"  # post-norms on the sub-layers' outputs, q/k norms over all heads
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        h = x if olmo2 else rms(x, p + "input_layernorm.weight")
        if "kv_lora_rank" in cfg:
            x = x + mla(cfg, g, p, h, rms)
            h = rms(x, p + "post_attention_layernorm.weight")
            x = x + (swiglu(g, p + "mlp.", h) if layer < cfg.get("first_k_dense_replace", 0) else moe(cfg, g, p, h))
            continue
        proj = lambda name: h @ g[p + f"self_attn.{name}.weight"].T + g.get(p + f"self_attn.{name}.bias", 0.0)
        q = proj("q_proj").reshape(T, H, d)
        k = proj("k_proj").reshape(T, KV, d)
        if olmo2:  # Olmo2Attention: q_norm(q_proj(h)) over H d, k_norm over KV d, then the heads
            q = rms(proj("q_proj"), p + "self_attn.q_norm.weight").reshape(T, H, d)
            k = rms(proj("k_proj"), p + "self_attn.k_norm.weight").reshape(T, KV, d)
        elif p + "self_attn.q_norm.weight" in g:  # Qwen3: RMSNorm over each head before RoPE
            q, k = rms(q, p + "self_attn.q_norm.weight"), rms(k, p + "self_attn.k_norm.weight")
        q, k = q.transpose(0, 1), k.transpose(0, 1)
        v = proj("v_proj").reshape(T, KV, d).transpose(0, 1)
        if cfg.get("no_rope_layers", [1] * (layer + 1))[layer]:  # SmolLM3: 0 = a NoPE layer
            q, k = rope(q, cfg), rope(k, cfg)
        k, v = k.repeat_interleave(H // KV, dim=0), v.repeat_interleave(H // KV, dim=0)
        y = causal_attention(q, k, v, window).transpose(0, 1).reshape(T, H * d)
        y = y @ g[p + "self_attn.o_proj.weight"].T
        if olmo2:  # Olmo2DecoderLayer: x + norm(attn(x)), then h + norm(mlp(h))
            x = x + rms(y, p + "post_attention_layernorm.weight")
            x = x + rms(swiglu(g, p + "mlp.", x), p + "post_feedforward_layernorm.weight")
            continue
        x = x + y
        h = rms(x, p + "post_attention_layernorm.weight")
        x = x + (moe(cfg, g, p, h) if cfg["model_type"] in ("mixtral", "qwen3_moe") else swiglu(g, p + "mlp.", h))
    tied = cfg.get("tie_word_embeddings", cfg["model_type"] == "smollm3")  # SmolLM3Config's default: tied
    head = g["model.embed_tokens.weight"] if tied else g["lm_head.weight"]
    return rms(x, "model.norm.weight") @ head.T


def gemma3_logits(cfg: dict, w: dict[str, torch.Tensor], tokens: torch.Tensor) -> torch.Tensor:
    """Gemma3ForCausalLM (transformers' modeling_gemma3 / modular_gemma3): Gemma3RMSNorm scales by
    (1 + w); the embedding is multiplied by sqrt(hidden_size) (a float32 scalar); layer i is a
    sliding layer unless (i + 1) % sliding_window_pattern == 0, sliding layers rotating with
    rope_local_base_freq and no scaling, full ones with rope_theta and rope_scaling; scores scale
    by query_pre_attn_scalar^-1/2; out = x + post_norm(attn(input_norm(x))), then
    + post_ff_norm(mlp(pre_ff_norm(.))); the MLP is gelu_tanh(gate) * up."""
    g = {k: v.double() for k, v in w.items()}
    C, H, KV, T = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], tokens.numel()
    d, eps, W, N = cfg["head_dim"], cfg["rms_norm_eps"], cfg["sliding_window"], cfg["sliding_window_pattern"]
    rms = lambda x, p: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + g[p])
    local_cfg = dict(cfg, rope_theta=cfg["rope_local_base_freq"], rope_scaling=None)
    scale = math.sqrt(d) / math.sqrt(cfg["query_pre_attn_scalar"])  # causal_attention divides by sqrt(d)
    x = g["model.embed_tokens.weight"][tokens] * float(torch.tensor(C ** 0.5, dtype=torch.float32))
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        sliding = (layer + 1) % N != 0
        h = rms(x, p + "input_layernorm.weight")
        proj = lambda name: h @ g[p + f"self_attn.{name}.weight"].T
        q = rms(proj("q_proj").reshape(T, H, d), p + "self_attn.q_norm.weight").transpose(0, 1)
        k = rms(proj("k_proj").reshape(T, KV, d), p + "self_attn.k_norm.weight").transpose(0, 1)
        v = proj("v_proj").reshape(T, KV, d).transpose(0, 1)
        q, k = rope(q, local_cfg if sliding else cfg), rope(k, local_cfg if sliding else cfg)
        k, v = k.repeat_interleave(H // KV, dim=0), v.repeat_interleave(H // KV, dim=0)
        y = causal_attention(q, k, v, W if sliding else 0, scale).transpose(0, 1).reshape(T, H * d)
        x = x + rms(y @ g[p + "self_attn.o_proj.weight"].T, p + "post_attention_layernorm.weight")
        h = rms(x, p + "pre_feedforward_layernorm.weight")
        gate, up = h @ g[p + "mlp.gate_proj.weight"].T, h @ g[p + "mlp.up_proj.weight"].T
        m = (gelu_new(gate) * up) @ g[p + "mlp.down_proj.weight"].T
        x = x + rms(m, p + "post_feedforward_layernorm.weight")
    return rms(x, "model.norm.weight") @ g["model.embed_tokens.weight"].T


def gemma3_case(gen: torch.Generator) -> tuple[dict, dict[str, torch.Tensor]]:
    """gemma-3-1b-it's keys (MQA, head_dim != hidden / heads) in small: 4 layers, every 2nd global."""
    C, F, L, V, H, KV, d = 32, 48, 4, 96, 4, 1, 16
    cfg = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "attention_bias": False,
           "attention_dropout": 0.0, "attn_logit_softcapping": None, "bos_token_id": 2, "cache_implementation": "hybrid",
           "eos_token_id": [1, 106], "final_logit_softcapping": None, "head_dim": d,
           "hidden_activation": "gelu_pytorch_tanh", "hidden_size": C, "initializer_range": 0.02,
           "intermediate_size": F, "max_position_embeddings": 64, "num_attention_heads": H, "num_hidden_layers": L,
           "num_key_value_heads": KV, "pad_token_id": 0, "query_pre_attn_scalar": d, "rms_norm_eps": 1e-6,
           "rope_local_base_freq": 10000.0, "rope_scaling": {"rope_type": "linear", "factor": 8.0},
           "rope_theta": 1000000.0, "sliding_window": 5, "sliding_window_pattern": 2, "torch_dtype": "bfloat16",
           "transformers_version": "4.52.4", "use_cache": True, "vocab_size": V}
    r = lambda *shape, s=0.2: torch.randn(*shape, generator=gen) * s
    w = {"model.embed_tokens.weight": r(V, C), "model.norm.weight": r(C, s=0.1)}
    for layer in range(L):
        p = f"model.layers.{layer}."
        w.update({p + "input_layernorm.weight": r(C, s=0.1), p + "self_attn.q_proj.weight": r(H * d, C),
                  p + "self_attn.k_proj.weight": r(KV * d, C), p + "self_attn.v_proj.weight": r(KV * d, C),
                  p + "self_attn.q_norm.weight": r(d, s=0.3), p + "self_attn.k_norm.weight": r(d, s=0.3),
                  p + "self_attn.o_proj.weight": r(C, H * d), p + "post_attention_layernorm.weight": r(C, s=0.1),
                  p + "pre_feedforward_layernorm.weight": r(C, s=0.1), p + "mlp.gate_proj.weight": r(F, C),
                  p + "mlp.up_proj.weight": r(F, C), p + "mlp.down_proj.weight": r(C, F),
                  p + "post_feedforward_layernorm.weight": r(C, s=0.1)})
    return cfg, w


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


def llama_case(gen: torch.Generator, mistral: bool, qwen2: bool = False,
               head_dim: int = 0, layers: int = 2) -> tuple[dict, dict[str, torch.Tensor]]:
    C, F, L, V, H, KV = 32, 48, layers, 96, 4, 2
    d = head_dim or C // H
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


def moe_case(gen: torch.Generator, family: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """Mixtral (every layer MoE, w1/w3/w2 experts) or Qwen3-MoE (q/k norm, mlp.experts)."""
    qwen = family == "qwen3_moe"
    cfg, w = llama_case(gen, False, qwen2=qwen, head_dim=16 if qwen else 0)
    C, L, E, F = cfg["hidden_size"], cfg["num_hidden_layers"], 4, 24
    r = lambda *shape, s=0.2: torch.randn(*shape, generator=gen) * s
    for layer in range(L):
        p = f"model.layers.{layer}."
        for name in ("gate_proj", "up_proj", "down_proj"):
            del w[p + f"mlp.{name}.weight"]
        if qwen:
            for name in ("q_proj.bias", "k_proj.bias", "v_proj.bias"):
                del w[p + "self_attn." + name]
            w[p + "self_attn.q_norm.weight"] = 1 + r(16, s=0.3)
            w[p + "self_attn.k_norm.weight"] = 1 + r(16, s=0.3)
            w[p + "mlp.gate.weight"] = r(E, C, s=0.5)
            for e in range(E):
                w.update({p + f"mlp.experts.{e}.gate_proj.weight": r(F, C), p + f"mlp.experts.{e}.up_proj.weight": r(F, C),
                          p + f"mlp.experts.{e}.down_proj.weight": r(C, F)})
        else:
            w[p + "block_sparse_moe.gate.weight"] = r(E, C, s=0.5)
            for e in range(E):
                x = p + f"block_sparse_moe.experts.{e}."
                w.update({x + "w1.weight": r(48, C), x + "w3.weight": r(48, C), x + "w2.weight": r(C, 48)})
    if qwen:
        cfg.update({"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "head_dim": 16,
                    "attention_bias": False, "num_experts": E, "num_experts_per_tok": 2, "moe_intermediate_size": F,
                    "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
                    "output_router_logits": False, "router_aux_loss_coef": 0.001, "tie_word_embeddings": False})
        w["lm_head.weight"] = r(cfg["vocab_size"], C)
    else:
        cfg.update({"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "num_local_experts": E,
                    "num_experts_per_tok": 2, "router_jitter_noise": 0.0, "output_router_logits": False,
                    "router_aux_loss_coef": 0.02, "sliding_window": None, "rope_theta": 1e6})
        for key in ("mlp_bias", "pretraining_tp", "head_dim"):
            cfg.pop(key)
    return cfg, w


def deepseek_case(gen: torch.Generator, v3: bool) -> tuple[dict, dict[str, torch.Tensor]]:
    """DeepSeek-V2 (queries projected from the input, softmax greedy routing scaled without
    renormalisation) or V3 (compressed queries, sigmoid group-limited routing with the correction
    bias, renormalised and scaled, one multi-token-prediction layer to skip): MLA in every layer, a
    dense first layer, MoE with one shared expert after."""
    C, L, V, H, E = 32, 2, 96, 4, 8 if v3 else 4
    dc, dq, dr, dn, dv, F, Fe = 16, 12, 4, 8, 8, 48, 16
    cfg = {"architectures": ["DeepseekV3ForCausalLM" if v3 else "DeepseekV2ForCausalLM"],
           "model_type": "deepseek_v3" if v3 else "deepseek_v2", "vocab_size": V, "hidden_size": C,
           "intermediate_size": F, "moe_intermediate_size": Fe, "num_hidden_layers": L, "num_attention_heads": H,
           "num_key_value_heads": H, "n_shared_experts": 1, "n_routed_experts": E, "num_experts_per_tok": 2,
           "routed_scaling_factor": 2.5 if v3 else 1.5, "kv_lora_rank": dc, "q_lora_rank": dq if v3 else None,
           "qk_rope_head_dim": dr, "v_head_dim": dv, "qk_nope_head_dim": dn,
           "topk_method": "noaux_tc" if v3 else "greedy", "n_group": 4 if v3 else 1, "topk_group": 2 if v3 else 1,
           "moe_layer_freq": 1, "first_k_dense_replace": 1, "norm_topk_prob": v3,
           "scoring_func": "sigmoid" if v3 else "softmax", "aux_loss_alpha": 0.001, "seq_aux": True, "ep_size": 1,
           "hidden_act": "silu", "max_position_embeddings": 64, "initializer_range": 0.02, "rms_norm_eps": 1e-6,
           "use_cache": True, "tie_word_embeddings": False, "rope_theta": 10000.0, "rope_scaling": None,
           "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 0, "eos_token_id": 1,
           "torch_dtype": "bfloat16", "transformers_version": "4.46.0"}
    # YaRN as the released configs set it (V2-Lite: mscale 0.707 both; V3: 1.0 both), with a small
    # original context so that the 4-wide RoPE part has pairs on both sides of the ramp.
    m = 1.0 if v3 else 0.707
    cfg["rope_scaling"] = {"type": "yarn", "factor": 40 if v3 else 8, "original_max_position_embeddings": 16,
                           "beta_fast": 32, "beta_slow": 1, "mscale": m, "mscale_all_dim": m}
    if v3:
        cfg["num_nextn_predict_layers"] = 1
    r = lambda *shape, s=0.2: torch.randn(*shape, generator=gen) * s
    w = {"model.embed_tokens.weight": r(V, C)}
    for layer in range(L + (1 if v3 else 0)):
        p = f"model.layers.{layer}."
        a = p + "self_attn."
        w.update({p + "input_layernorm.weight": 1 + r(C, s=0.1), p + "post_attention_layernorm.weight": 1 + r(C, s=0.1),
                  a + "kv_a_proj_with_mqa.weight": r(dc + dr, C), a + "kv_a_layernorm.weight": 1 + r(dc, s=0.1),
                  a + "kv_b_proj.weight": r(H * (dn + dv), dc), a + "o_proj.weight": r(C, H * dv)})
        if v3:
            w.update({a + "q_a_proj.weight": r(dq, C), a + "q_a_layernorm.weight": 1 + r(dq, s=0.1),
                      a + "q_b_proj.weight": r(H * (dn + dr), dq)})
        else:
            w[a + "q_proj.weight"] = r(H * (dn + dr), C)
        if layer == 0:
            w.update({p + "mlp.gate_proj.weight": r(F, C), p + "mlp.up_proj.weight": r(F, C), p + "mlp.down_proj.weight": r(C, F)})
            continue
        w[p + "mlp.gate.weight"] = r(E, C, s=0.5)
        if v3:
            w[p + "mlp.gate.e_score_correction_bias"] = r(E, s=0.05)
        for e in range(E):
            x = p + f"mlp.experts.{e}."
            w.update({x + "gate_proj.weight": r(Fe, C), x + "up_proj.weight": r(Fe, C), x + "down_proj.weight": r(C, Fe)})
        x = p + "mlp.shared_experts."
        w.update({x + "gate_proj.weight": r(Fe, C), x + "up_proj.weight": r(Fe, C), x + "down_proj.weight": r(C, Fe)})
    w.update({"model.norm.weight": 1 + r(C, s=0.1), "lm_head.weight": r(V, C)})
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
    # Llama 3.2 1B's shape in small: llama3 rope_scaling (L = 64 so that the 16-wide heads have
    # pairs in all three bands: kept, blended, divided), a tied head, head_dim != hidden / heads.
    cfg, w = llama_case(gen, False, head_dim=16)
    cfg.update({"rope_theta": 10000.0, "tie_word_embeddings": True,
                "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                 "original_max_position_embeddings": 64}})
    del w["lm_head.weight"]
    write_case(out, "llama32", cfg, dict(w), w, llama_logits, tokens)
    # Qwen3: per-head q/k RMSNorm, no biases, head_dim 16 of hidden 32 (as Qwen3-0.6B: 128 of 1024).
    cfg, w = llama_case(gen, False, qwen2=True, head_dim=16)
    cfg.update({"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "head_dim": 16, "attention_bias": False,
                "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}})
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}.self_attn."
        for name in ("q_proj.bias", "k_proj.bias", "v_proj.bias"):
            del w[p + name]
        w[p + "q_norm.weight"] = 1 + torch.randn(16, generator=gen) * 0.3
        w[p + "k_norm.weight"] = 1 + torch.randn(16, generator=gen) * 0.3
    write_case(out, "qwen3", cfg, dict(w), w, llama_logits, tokens)
    for family in ("mixtral", "qwen3_moe"):
        cfg, w = moe_case(gen, family)
        write_case(out, family, cfg, dict(w), w, llama_logits, tokens)
    for name, v3 in (("deepseek_v2", False), ("deepseek_v3", True)):
        cfg, w = deepseek_case(gen, v3)
        stored = {k: v.to(torch.bfloat16) for k, v in w.items()}
        write_case(out, name, cfg, stored, {k: v.float() for k, v in stored.items()}, llama_logits, tokens)
    # SmolLM3: llama with RoPE skipped on every no_rope_layer_interval-th layer (here 2 of 4 layers:
    # 1 and 3), a tied head (by the config class's default), and the keys its real config.json carries (pretraining_tp 2, the
    # sliding-window keys off, layer_types), in bf16.
    cfg, w = llama_case(gen, False, layers=4)
    del w["lm_head.weight"]
    cfg.pop("tie_word_embeddings")  # absent, as in SmolLM3-3B's file: SmolLM3Config ties by default
    cfg.update({"architectures": ["SmolLM3ForCausalLM"], "model_type": "smollm3",
                "pretraining_tp": 2, "rope_theta": 5000000.0, "no_rope_layer_interval": 2,
                "no_rope_layers": [1, 0, 1, 0], "use_sliding_window": False, "sliding_window": None,
                "max_window_layers": 4, "layer_types": ["full_attention"] * 4})
    cfg.pop("head_dim")
    stored = {k: v.to(torch.bfloat16) for k, v in w.items()}
    write_case(out, "smollm3", cfg, stored, {k: v.float() for k, v in stored.items()}, llama_logits, tokens)
    # Phi-3 (mini-4k's keys): llama's formulas with a sliding window (transformers masks j <= i - W),
    # q/k/v stored fused as self_attn.qkv_proj (rows q, k, v) and gate/up as mlp.gate_up_proj (the
    # first half gates, as Phi3MLP chunks it).
    cfg, w = llama_case(gen, False)
    for key in ("mlp_bias", "pretraining_tp", "head_dim"):
        cfg.pop(key)
    cfg.update({"architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "sliding_window": 5, "embd_pdrop": 0.0,
                "resid_pdrop": 0.0, "original_max_position_embeddings": 64, "rope_theta": 10000.0,
                "_name_or_path": "Phi-3-mini-4k-instruct", "pad_token_id": 32000})
    stored = dict(w)
    for layer in range(cfg["num_hidden_layers"]):
        a, m = f"model.layers.{layer}.self_attn.", f"model.layers.{layer}.mlp."
        stored[a + "qkv_proj.weight"] = torch.cat([stored.pop(a + n + "_proj.weight") for n in ("q", "k", "v")])
        stored[m + "gate_up_proj.weight"] = torch.cat([stored.pop(m + n + "_proj.weight") for n in ("gate", "up")])
    write_case(out, "phi3", cfg, stored, w, llama_logits, tokens)
    # Phi-3-mini-128k's LongRoPE in small: per-pair short and long factors (4 pairs of the 8-wide
    # heads), an original context of 8 < the 17 positions, so the long factors apply, and the
    # attention factor sqrt(1 + ln(64 / 8) / ln 8) from max / original.
    cfg = dict(cfg, _name_or_path="Phi-3-mini-128k-instruct", original_max_position_embeddings=8,
               rope_scaling={"long_factor": [1.0, 1.5, 4.0, 9.5], "short_factor": [1.0, 1.05, 1.2, 1.6], "type": "longrope"})
    write_case(out, "phi3_longrope", cfg, stored, w, llama_logits, tokens)
    # OLMo 2 (OLMo-2-0425-1B's keys): no input norms; post_attention_layernorm and
    # post_feedforward_layernorm on the sub-layers' outputs; q_norm over all query heads (H d) and
    # k_norm over all key heads (KV d); untied head; in bf16.
    cfg, w = llama_case(gen, False)
    for key in ("mlp_bias", "pretraining_tp", "head_dim"):
        cfg.pop(key)
    cfg.update({"architectures": ["Olmo2ForCausalLM"], "model_type": "olmo2", "rope_theta": 500000,
                "pad_token_id": 100277, "eos_token_id": 100257, "bos_token_id": None})
    C, H, KV, d = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], 8
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        w[p + "post_feedforward_layernorm.weight"] = w.pop(p + "post_attention_layernorm.weight")
        w[p + "post_attention_layernorm.weight"] = w.pop(p + "input_layernorm.weight")
        w[p + "self_attn.q_norm.weight"] = 1 + torch.randn(H * d, generator=gen) * 0.3
        w[p + "self_attn.k_norm.weight"] = 1 + torch.randn(KV * d, generator=gen) * 0.3
    stored = {k: v.to(torch.bfloat16) for k, v in w.items()}
    write_case(out, "olmo2", cfg, stored, {k: v.float() for k, v in stored.items()}, llama_logits, tokens)
    cfg, w = gemma3_case(gen)
    stored = {k: v.to(torch.bfloat16) for k, v in w.items()}
    write_case(out, "gemma3", cfg, stored, {k: v.float() for k, v in stored.items()}, gemma3_logits, tokens)


if __name__ == "__main__":
    main()
