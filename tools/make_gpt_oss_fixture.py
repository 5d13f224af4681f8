#!/usr/bin/python3
"""A tiny GPT-OSS model folder and its float64 PyTorch logits and gradients, for Loom's import tests.

    /usr/bin/python3 tools/make_gpt_oss_fixture.py --out build/fixtures/hf

Writes DIR/gpt_oss/ (experts in transformers' bf16-checkpoint layout, float32) and
DIR/gpt_oss_mxfp4/ (the same model with its experts stored as the release stores them: MXFP4
blocks and scales), each with config.json (the key set of openai/gpt-oss-20b's config.json at
fixture size), model.safetensors and expected.json: the tokens, the logits of every position but
the last, the mean next-token loss, and the loss's gradient w.r.t. every parameter in Loom's
layout (mapped here, independently of Loom's import code). Everything is computed in float64
from the stored weights (for the MXFP4 folder: the dequantized experts). Nothing imports
transformers; the formulas are written from transformers'
src/transformers/models/gpt_oss/{modeling,configuration}_gpt_oss.py (GptOssForCausalLM):

GptOssRMSNorm: x rsqrt(mean x^2 + eps) w (eps = rms_norm_eps).
GptOssAttention (h the normed input (T, C); H heads, KV heads of d = head_dim):
  q, k, v = q_proj(h), k_proj(h), v_proj(h)   (all with biases: attention_bias = true)
  RoPE rotate-half over the whole head with YaRN (rope_scaling "yarn", truncate = false: the
  correction range's ends are not rounded); cos and sin times attention_factor =
  0.1 ln(factor) + 1.
  scores = q k^T d^-1/2, causal; layer_types[i] == "sliding_attention": keys j > i - sliding_window.
  Attention sinks: each head's learned logit s_h joins the softmax's denominator (a column with
  no value): p_ij = exp(x_ij) / (sum_j exp(x_ij) + exp(s_h)).
  out = o_proj(p v) (with bias).
GptOssMLP: router logits l = h Wr^T + br over E experts; the top k of l, softmax over those k
  (the same as the softmax over E renormalised over the top k); per chosen expert e:
  gu = h W_gu[e] + b_gu[e] (W_gu (C, 2F): gate and up interleaved, gate = gu[..., ::2],
  up = gu[..., 1::2]); gate = min(gate, limit); up = clamp(up, -limit, limit);
  y_e = ((up + 1) * gate * sigmoid(alpha gate)) W_d[e] + b_d[e]  (alpha 1.702, limit 7);
  out = sum_k p_k y_{e_k}.
Decoder layer: x += attn(norm1(x)); x += mlp(norm2(x)); logits = lm_head(norm(x)) (untied).

MXFP4 (OCP Microscaling FP4; the release's *_blocks / *_scales): gate_up_proj_blocks (E, 2F,
C/32, 16) u8 and gate_up_proj_scales (E, 2F, C/32) u8 hold W_gu^T (E, 2F, C): each byte two E2M1
codes, low nibble first, values [0, .5, 1, 1.5, 2, 3, 4, 6] with bit 3 the sign, each block of 32
scaled by 2^(scale - 127); down_proj_blocks (E, C, F/32, 16) and scales likewise hold W_d^T (E, C,
F). The MXFP4 folder's experts are the float32 ones rounded to that grid.
"""

from __future__ import annotations

import argparse
import json
import math
import os

import torch
import torch.nn.functional as F

from make_hf_fixtures import write_safetensors  # (tools/: the script's own folder is on sys.path)

FP4_VALUES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
ALPHA, LIMIT = 1.702, 7.0


def yarn_inv_freq(cfg: dict, d: int) -> tuple[torch.Tensor, float]:
    """transformers' _compute_yarn_parameters with truncate = false."""
    rs = cfg["rope_scaling"]
    base, factor = float(cfg["rope_theta"]), float(rs["factor"])
    L = float(rs["original_max_position_embeddings"])
    beta_fast, beta_slow = float(rs["beta_fast"]), float(rs["beta_slow"])
    attention_factor = 0.1 * math.log(factor) + 1.0
    dim_of = lambda rot: (d * math.log(L / (rot * 2 * math.pi))) / (2 * math.log(base))
    low, high = max(dim_of(beta_fast), 0.0), min(dim_of(beta_slow), d - 1.0)
    if low == high:
        high += 0.001
    pos_freqs = base ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    ramp = ((torch.arange(d // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    extrapolation_factor = 1 - ramp
    return interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor, attention_factor


def rope(x: torch.Tensor, cfg: dict) -> torch.Tensor:
    """x (T, heads, d): rotate-half with YaRN's frequencies and amplitude."""
    T, d = x.shape[0], x.shape[-1]
    inv_freq, amp = yarn_inv_freq(cfg, d)
    angle = torch.arange(T, dtype=torch.float64)[:, None] * inv_freq[None, :]
    cos, sin = (angle.cos() * amp).unsqueeze(1).to(x.dtype), (angle.sin() * amp).unsqueeze(1).to(x.dtype)
    a, b = x[..., : d // 2], x[..., d // 2:]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def attention(cfg: dict, g: dict, p: str, h: torch.Tensor, sliding: bool) -> torch.Tensor:
    T = h.shape[0]
    H, KV, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    a = p + "self_attn."
    lin = lambda name, x: x @ g[a + name + ".weight"].T + g[a + name + ".bias"]
    q = rope(lin("q_proj", h).view(T, H, d), cfg)
    k = rope(lin("k_proj", h).view(T, KV, d), cfg)
    v = lin("v_proj", h).view(T, KV, d)
    k, v = k.repeat_interleave(H // KV, dim=1), v.repeat_interleave(H // KV, dim=1)
    scores = torch.einsum("ihd,jhd->hij", q, k) * d ** -0.5
    i = torch.arange(T)[:, None]
    j = torch.arange(T)[None, :]
    keep = (j <= i) & ((j > i - cfg["sliding_window"]) if sliding else torch.ones_like(j <= i))
    scores = scores.masked_fill(~keep, float("-inf"))
    sinks = g[a + "sinks"].view(H, 1, 1).expand(H, T, 1)
    combined = torch.cat([scores, sinks], dim=-1)
    probs = torch.softmax(combined - combined.max(-1, keepdim=True).values, dim=-1)[..., :-1]
    y = torch.einsum("hij,jhd->ihd", probs, v).reshape(T, H * d)
    return lin("o_proj", y)


def moe(cfg: dict, g: dict, p: str, h: torch.Tensor) -> torch.Tensor:
    m = p + "mlp."
    logits = h @ g[m + "router.weight"].T + g[m + "router.bias"]
    top, idx = logits.topk(cfg["num_experts_per_tok"], dim=-1)
    weights = torch.softmax(top, dim=-1)
    out = torch.zeros_like(h)
    for t in range(h.shape[0]):
        for kk in range(idx.shape[1]):
            e = int(idx[t, kk])
            gu = h[t] @ g[m + "experts.gate_up_proj"][e] + g[m + "experts.gate_up_proj_bias"][e]
            gate, up = gu[::2].clamp(max=LIMIT), gu[1::2].clamp(-LIMIT, LIMIT)
            y = ((up + 1) * gate * torch.sigmoid(gate * ALPHA)) @ g[m + "experts.down_proj"][e] + \
                g[m + "experts.down_proj_bias"][e]
            out[t] = out[t] + weights[t, kk] * y
    return out


def forward(cfg: dict, g: dict, tokens: torch.Tensor) -> torch.Tensor:
    eps = cfg["rms_norm_eps"]
    x = g["model.embed_tokens.weight"][tokens]
    for i, kind in enumerate(cfg["layer_types"]):
        p = f"model.layers.{i}."
        x = x + attention(cfg, g, p, rms(x, g[p + "input_layernorm.weight"], eps), kind == "sliding_attention")
        x = x + moe(cfg, g, p, rms(x, g[p + "post_attention_layernorm.weight"], eps))
    return rms(x, g["model.norm.weight"], eps) @ g["lm_head.weight"].T


def loom_gradients(cfg: dict, grads: dict[str, torch.Tensor]) -> dict[str, list[float]]:
    """The gradients in Loom's layout (arch/param_layout.cpp): q/k/v weights and biases fused
    (qkv_proj), per expert gate_up_proj (2F, C) = [gate rows | up rows] (the folder's interleaved
    columns split, transposed) with its bias likewise, down_proj (C, F) transposed, the router as
    mlp.gate.weight / mlp.gate.bias."""
    out: dict[str, torch.Tensor] = {}
    E = cfg["num_local_experts"]
    for name, grad in grads.items():
        if ".self_attn.q_proj." in name:
            a, kind = name.split(".self_attn.q_proj.")
            a += ".self_attn."
            out[a + "qkv_proj." + kind] = torch.cat([grad, grads[a + "k_proj." + kind], grads[a + "v_proj." + kind]])
        elif ".self_attn.k_proj." in name or ".self_attn.v_proj." in name:
            continue
        elif name.endswith("mlp.router.weight"):
            out[name.replace("mlp.router.weight", "mlp.gate.weight")] = grad
        elif name.endswith("mlp.router.bias"):
            out[name.replace("mlp.router.bias", "mlp.gate.bias")] = grad
        elif name.endswith("experts.gate_up_proj"):
            base = name[: -len("gate_up_proj")]
            for e in range(E):
                w, b = grad[e], grads[name + "_bias"][e]  # (C, 2F), (2F)
                out[f"{base}{e}.gate_up_proj.weight"] = torch.cat([w[:, ::2].T, w[:, 1::2].T])
                out[f"{base}{e}.gate_up_proj.bias"] = torch.cat([b[::2], b[1::2]])
        elif name.endswith("experts.down_proj"):
            base = name[: -len("down_proj")]
            for e in range(E):
                out[f"{base}{e}.down_proj.weight"] = grad[e].T
                out[f"{base}{e}.down_proj.bias"] = grads[name + "_bias"][e]
        elif name.endswith("_bias"):
            continue
        else:
            out[name] = grad
    return {k: v.flatten().tolist() for k, v in out.items()}


def mxfp4_encode(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w (..., rows, cols) with cols % 32 == 0 -> (blocks (..., rows, cols/32, 16) u8, scales
    (..., rows, cols/32) u8, the dequantized w). Each block's scale 2^(ceil(log2(amax / 6))),
    values rounded to the nearest E2M1 code (ties to the even code)."""
    *lead, rows, cols = w.shape
    x = w.reshape(*lead, rows, cols // 32, 32).double()
    amax = x.abs().amax(-1, keepdim=True).clamp(min=2.0 ** -126)
    exp = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    scaled = x / torch.pow(2.0, exp)
    grid = torch.tensor(FP4_VALUES, dtype=torch.float64)
    dist = (scaled.abs().unsqueeze(-1) - grid).abs()
    mag = dist.argmin(-1)  # the first minimum: ties go to the smaller code, whose mantissa bit is even
    codes = mag | ((scaled < 0) & (mag > 0)).long() << 3
    deq = grid[mag] * torch.sign(scaled) * torch.pow(2.0, exp)
    pairs = codes.reshape(*lead, rows, cols // 32, 16, 2)
    blocks = (pairs[..., 0] | (pairs[..., 1] << 4)).to(torch.uint8)
    scales = (exp.squeeze(-1) + 127).to(torch.uint8)
    return blocks, scales, deq.reshape(*lead, rows, cols).float()


def gpt_oss_case(gen: torch.Generator) -> tuple[dict, dict[str, torch.Tensor]]:
    C, L, V, H, KV, d, E, Fe = 64, 2, 96, 4, 2, 16, 4, 32
    # The key set of openai/gpt-oss-20b's config.json, in its order, at fixture size.
    cfg = {"architectures": ["GptOssForCausalLM"], "attention_bias": True, "attention_dropout": 0.0,
           "eos_token_id": 2, "experts_per_token": 2, "head_dim": d, "hidden_act": "silu", "hidden_size": C,
           "initial_context_length": 16, "initializer_range": 0.02, "intermediate_size": Fe,
           "layer_types": ["sliding_attention", "full_attention"], "max_position_embeddings": 64,
           "model_type": "gpt_oss", "num_attention_heads": H, "num_experts_per_tok": 2, "num_hidden_layers": L,
           "num_key_value_heads": KV, "num_local_experts": E, "output_router_logits": False, "pad_token_id": 1,
           "rms_norm_eps": 1e-05,
           "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 4.0, "original_max_position_embeddings": 16,
                            "rope_type": "yarn", "truncate": False},
           "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 5, "swiglu_limit": 7.0,
           "tie_word_embeddings": False, "torch_dtype": "float32", "transformers_version": "4.55.0.dev0",
           "use_cache": True, "vocab_size": V}
    r = lambda *shape, s=0.2: torch.randn(*shape, generator=gen) * s
    w = {"model.embed_tokens.weight": r(V, C)}
    for i in range(L):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        w[p + "input_layernorm.weight"] = 1 + r(C, s=0.1)
        w.update({a + "q_proj.weight": r(H * d, C), a + "q_proj.bias": r(H * d, s=0.1),
                  a + "k_proj.weight": r(KV * d, C), a + "k_proj.bias": r(KV * d, s=0.1),
                  a + "v_proj.weight": r(KV * d, C), a + "v_proj.bias": r(KV * d, s=0.1),
                  a + "o_proj.weight": r(C, H * d), a + "o_proj.bias": r(C, s=0.1),
                  a + "sinks": r(H, s=1.0)})
        w[p + "post_attention_layernorm.weight"] = 1 + r(C, s=0.1)
        m = p + "mlp."
        # Larger gate/up pre-activations than the rest, so that the clamps at +-7 bind somewhere.
        w.update({m + "router.weight": r(E, C, s=0.5), m + "router.bias": r(E, s=0.5),
                  m + "experts.gate_up_proj": r(E, C, 2 * Fe, s=0.6), m + "experts.gate_up_proj_bias": r(E, 2 * Fe, s=1.0),
                  m + "experts.down_proj": r(E, Fe, C, s=0.1), m + "experts.down_proj_bias": r(E, C, s=0.1)})
    w.update({"model.norm.weight": 1 + r(C, s=0.1), "lm_head.weight": r(V, C)})
    return cfg, w


def write_case(out: str, name: str, cfg: dict, stored: dict[str, torch.Tensor], w: dict[str, torch.Tensor],
               tokens: torch.Tensor) -> None:
    path = os.path.join(out, name)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    write_safetensors(os.path.join(path, "model.safetensors"), stored)
    leaves = {k: v.double().requires_grad_(True) for k, v in w.items()}
    logits = forward(cfg, leaves, tokens)
    loss = F.cross_entropy(logits[:-1], tokens[1:])
    loss.backward()
    grads = loom_gradients(cfg, {k: v.grad for k, v in leaves.items()})
    # How often the clamps bind (the fixture must exercise them): fraction of gate / up values past 7.
    with open(os.path.join(path, "expected.json"), "w") as f:
        json.dump({"tokens": tokens.tolist(), "loss": loss.item(), "logits": logits[:-1].detach().flatten().tolist(),
                   "grads": grads}, f)
    print(f"{path}: loss {loss.item():.6f}, {len(grads)} gradients")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    out = ap.parse_args().out
    gen = torch.Generator().manual_seed(1234)
    tokens = torch.randint(0, 96, (17,), generator=gen)  # the same tokens as make_hf_fixtures.py
    cfg, w = gpt_oss_case(gen)
    write_case(out, "gpt_oss", cfg, w, w, tokens)
    # The release's layout: the experts in MXFP4 (W^T blocks), everything else as it is.
    stored, deq = {}, dict(w)
    for name, t in w.items():
        if name.endswith("experts.gate_up_proj") or name.endswith("experts.down_proj"):
            blocks, scales, dq = mxfp4_encode(t.transpose(1, 2).contiguous())  # (E, out, in)
            stored[name + "_blocks"], stored[name + "_scales"] = blocks, scales
            deq[name] = dq.transpose(1, 2).contiguous()
        else:
            stored[name] = t
    cfg_q = dict(cfg, quantization_config={"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                                     "model.embed_tokens", "lm_head"],
                                           "quant_method": "mxfp4"})
    write_case(out, "gpt_oss_mxfp4", cfg_q, stored, deq, tokens)


if __name__ == "__main__":
    main()
