#!/usr/bin/python3
"""A tiny Qwen3-Next model folder and its float64 PyTorch logits, for Loom's import tests.

    /usr/bin/python3 tools/make_qwen3_next_fixture.py --out build/fixtures/hf

Writes DIR/qwen3_next/ in transformers' `save_pretrained` layout: config.json (the key set of
Qwen/Qwen3-Next-80B-A3B-Instruct's config.json, tests/fixtures/hub_configs/), model.safetensors
(float32, tensors named as the Hub checkpoint names them) and expected.json: the tokens, the
logits of every position but the last, the mean next-token loss, the hidden state after each
decoder layer (flattened, T x hidden, before the final norm) and the largest difference between
the recurrent and the chunked gated delta rule. Everything is computed here in float64 from the
stored float32 weights. Nothing imports transformers; the formulas are written from
transformers' src/transformers/models/qwen3_next/{modeling,modular,configuration}_qwen3_next.py
(Qwen3NextForCausalLM, model_type "qwen3_next"):

Qwen3NextConfig
  layer_types[i] = "linear_attention" if (i + 1) % full_attention_interval else "full_attention"
  (default interval 4; here 2: layers 0, 2 linear, 1, 3 full). Layer i's MLP is the sparse MoE
  block unless i is in mlp_only_layers or (i + 1) % decoder_sparse_step != 0 (then the dense
  Qwen3NextMLP of intermediate_size). partial_rotary_factor defaults to 0.25 (even when absent);
  tie_word_embeddings defaults to false; head_dim defaults to 256 (not hidden / heads).

Qwen3NextRMSNorm (input_layernorm, post_attention_layernorm, model.norm, q_norm, k_norm):
  zero-centred: y = x * rsqrt(mean(x^2) + eps) * (1 + w); transformers initialises w to 0.
Qwen3NextRMSNormGated (linear_attn.norm, over each value head, eps = rms_norm_eps):
  y = w * (x * rsqrt(mean(x^2) + eps)) * silu(z); plain w (initialised to 1).

Qwen3NextAttention (self_attn), h (T, C) the normed input, d = head_dim, H, KV heads:
  q_proj (H * 2d, C): q_proj(h).view(T, H, 2d) chunked on the last dim: per head the first d
    are the query, the next d the gate (rows [2d*i, 2d*i + d) = query of head i,
    [2d*i + d, 2d*(i+1)) = its gate); gate.reshape(T, H*d).
  q = q_norm(query) per head, k = k_norm(k_proj(h).view(T, KV, d)), v = v_proj(h).view(T, KV, d).
  apply_rotary_pos_emb: rotate-half RoPE on the first r = int(d * partial_rotary_factor) dims
    of each head (inv_freq[i] = theta^(-2i/r), angle = pos * inv_freq duplicated over both
    halves of those r dims: x_rot * cos + rotate_half(x_rot) * sin); the last d - r dims pass.
  eager_attention_forward: GQA (query head i reads kv head i // (H / KV)), scores scaled by
    d^-1/2 (the full head_dim), causal softmax.
  out = o_proj(attn.reshape(T, H*d) * sigmoid(gate)).

Qwen3NextGatedDeltaNet (linear_attn), nk / nv key / value heads, dk / dv their dims, r = nv / nk:
  in_proj_qkvz (2 nk dk + 2 nv dv, C), in_proj_ba (2 nv, C).
  fix_query_key_value_ordering: the outputs are grouped by key head: qkvz.view(T, nk,
    2 dk + 2 r dv) split per group into q (dk), k (dk), v (r dv), z (r dv); ba.view(T, nk, 2r)
    split into b (r), a (r). So value head j = g r + m (group g, m < r) is group g's m-th slice,
    and b, a of head j likewise.
  mixed = cat(q (T, nk dk), k (T, nk dk), v (T, nv dv)) -- channels [q | k | v], conv_dim
    = 2 nk dk + nv dv; conv1d: depthwise (groups = conv_dim), no bias, weight (conv_dim, 1, K),
    padding K - 1, the first T outputs kept, i.e. causal:
      out[c, t] = sum_{j<K} w[c, 0, j] * x[c, t - (K-1) + j]   (w[c, 0, K-1] weighs the current
    token), then SiLU (torch fallback `F.silu(self.conv1d(mixed)[:, :, :seq_len])`).
  beta = sigmoid(b); g = -exp(A_log) * softplus(a + dt_bias)   (per token, per value head).
  q, k heads repeat_interleave'd r times (value head j reads key head j // r).
  torch_chunk_gated_delta_rule(..., use_qk_l2norm_in_kernel=True): q, k = l2norm (x *
    rsqrt(sum x^2 + 1e-6)), q *= dk^-1/2, then per head with state S (dk, dv) from 0
    (torch_recurrent_gated_delta_rule's loop):
      S = exp(g_t) S;  delta = beta_t (v_t - S^T k_t);  S = S + k_t delta^T;  o_t = S^T q_t.
    The chunked form (chunk C = 64, as transformers' prefill path; written here from the math):
    in a chunk with cumulative decays G_i = g_1 + ... + g_i and start state S0,
      (I + A) U = beta * V - (beta exp(G) K) S0,  A_ij = beta_i exp(G_i - G_j) k_i.k_j for j < i,
      o_i = exp(G_i) S0^T q_i + sum_{j<=i} exp(G_i - G_j) (q_i.k_j) U_j,
      S_end = exp(G_C) S0 + sum_j exp(G_C - G_j) k_j U_j^T,
    (U_j = delta_j of the recurrence). Both are computed here and must agree to 1e-10.
  y = norm(o per value head, z per value head) (Qwen3NextRMSNormGated), out_proj(y.reshape(T,
    nv dv)).

Qwen3NextSparseMoeBlock (mlp), E experts, top k:
  p = softmax(gate(h)) over E (mlp.gate.weight (E, C)); the k largest p, divided by their sum
  when norm_topk_prob; routed = sum_k p_e * down_e(silu(gate_e(h)) * up_e(h));
  out = routed + sigmoid(shared_expert_gate(h)) * shared_expert(h)   (shared_expert_gate:
  Linear(C, 1), no bias; shared_expert: a SiLU MLP of shared_expert_intermediate_size).
  The Hub checkpoint stores experts one by one (mlp.experts.E.{gate,up,down}_proj.weight);
  transformers 5 fuses them on load (conversion_mapping "qwen3_next" = qwen2_moe's:
  gate_up_proj (E, 2I, C) = cat(gate, up) per expert, down_proj (E, C, I)).

Qwen3NextDecoderLayer: x += mixer(input_layernorm(x)); x += mlp(post_attention_layernorm(x)).
Qwen3NextForCausalLM: logits = lm_head(norm(x)) with an untied lm_head.weight (V, C); MTP weights
(mtp.*) of the release are ignored on load and none are written here.

safetensors is written by hand (u64 header length, JSON header, little-endian data), as
tools/make_hf_fixtures.py does.
"""

from __future__ import annotations

import argparse
import json
import math
import os

import torch
import torch.nn.functional as F

from make_hf_fixtures import write_safetensors  # (tools/: the script's own folder is on sys.path)

CHUNK = 64  # transformers' torch_chunk_gated_delta_rule default


# --- the formulas -------------------------------------------------------------------------


def rms_zero_centred(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3NextRMSNorm: x * rsqrt(mean x^2 + eps) * (1 + w)."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w)


def rms_gated(x: torch.Tensor, z: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3NextRMSNormGated: w * (x * rsqrt(mean x^2 + eps)) * silu(z)."""
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)) * F.silu(z)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """transformers' l2norm (FLA's): x * rsqrt(sum x^2 + eps)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def layer_types(cfg: dict) -> list[str]:
    if cfg.get("layer_types"):
        return list(cfg["layer_types"])
    n = cfg.get("full_attention_interval", 4)
    return ["linear_attention" if (i + 1) % n else "full_attention" for i in range(cfg["num_hidden_layers"])]


def is_moe_layer(cfg: dict, i: int) -> bool:
    return (i not in (cfg.get("mlp_only_layers") or [])) and cfg["num_experts"] > 0 and \
        (i + 1) % cfg.get("decoder_sparse_step", 1) == 0


def swiglu(g: dict, p: str, h: torch.Tensor) -> torch.Tensor:
    """Qwen3NextMLP: down(silu(gate(h)) * up(h))."""
    return (F.silu(h @ g[p + "gate_proj.weight"].T) * (h @ g[p + "up_proj.weight"].T)) @ g[p + "down_proj.weight"].T


def rope_partial(x: torch.Tensor, cfg: dict) -> torch.Tensor:
    """apply_rotary_pos_emb with Qwen3NextRotaryEmbedding: rotate-half on the first
    int(head_dim * partial_rotary_factor) dims of each head of x (T, heads, d), the rest pass."""
    T, d = x.shape[0], x.shape[-1]
    r = int(d * cfg.get("partial_rotary_factor", 0.25))
    inv_freq = 1.0 / (cfg["rope_theta"] ** (torch.arange(0, r, 2, dtype=torch.float64) / r))
    angle = torch.arange(T, dtype=torch.float64).unsqueeze(1) * inv_freq.unsqueeze(0)
    angle = torch.cat([angle, angle], dim=-1).unsqueeze(1).to(x.dtype)  # (T, 1, r)
    x_rot, x_pass = x[..., :r], x[..., r:]
    rotated = torch.cat([-x_rot[..., r // 2:], x_rot[..., : r // 2]], dim=-1)
    return torch.cat([x_rot * angle.cos() + rotated * angle.sin(), x_pass], dim=-1)


def full_attention(cfg: dict, g: dict, p: str, h: torch.Tensor) -> torch.Tensor:
    """Qwen3NextAttention on h (T, C)."""
    T = h.shape[0]
    H, KV = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d, eps = cfg.get("head_dim") or cfg["hidden_size"] // H, cfg["rms_norm_eps"]
    a = p + "self_attn."
    qg = (h @ g[a + "q_proj.weight"].T).view(T, H, 2 * d)
    query, gate = qg[..., :d], qg[..., d:].reshape(T, H * d)
    q = rms_zero_centred(query, g[a + "q_norm.weight"], eps)
    k = rms_zero_centred((h @ g[a + "k_proj.weight"].T).view(T, KV, d), g[a + "k_norm.weight"], eps)
    v = (h @ g[a + "v_proj.weight"].T).view(T, KV, d)
    q, k = rope_partial(q, cfg), rope_partial(k, cfg)
    q, k, v = q.transpose(0, 1), k.repeat_interleave(H // KV, dim=1).transpose(0, 1), \
        v.repeat_interleave(H // KV, dim=1).transpose(0, 1)
    scores = q @ k.transpose(-1, -2) * d ** -0.5
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    y = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1) @ v  # (H, T, d)
    y = y.transpose(0, 1).reshape(T, H * d)
    return (y * torch.sigmoid(gate)) @ g[a + "o_proj.weight"].T


def delta_rule_recurrent(q, k, v, g, beta):
    """torch_recurrent_gated_delta_rule (after l2norm and the q scale): q, k (T, N, dk),
    v (T, N, dv), g, beta (T, N). Returns o (T, N, dv) and the final state (N, dk, dv)."""
    T, N, dk = k.shape
    S = torch.zeros(N, dk, v.shape[-1], dtype=v.dtype)
    out = torch.zeros_like(v)
    for t in range(T):
        S = S * g[t].exp()[:, None, None]
        kv_mem = torch.einsum("nkv,nk->nv", S, k[t])
        delta = (v[t] - kv_mem) * beta[t][:, None]
        S = S + k[t][:, :, None] * delta[:, None, :]
        out[t] = torch.einsum("nkv,nk->nv", S, q[t])
    return out, S


def delta_rule_chunked(q, k, v, g, beta, chunk: int = CHUNK):
    """The chunked (WY) form of the same recurrence, as torch_chunk_gated_delta_rule computes it,
    written from the math (see the module docstring); the sequence zero-padded to a multiple of
    the chunk (padded steps have beta = 0, g = 0 and touch nothing before them)."""
    T, N, dk = k.shape
    dv = v.shape[-1]
    pad = (chunk - T % chunk) % chunk
    q, k, v = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (F.pad(x, (0, 0, 0, pad)) for x in (g, beta))
    S = torch.zeros(N, dk, dv, dtype=v.dtype)
    out = torch.zeros_like(v)
    lower = torch.ones(chunk, chunk, dtype=torch.bool).tril()  # j <= i
    strict = torch.ones(chunk, chunk, dtype=torch.bool).tril(-1)  # j < i
    eye = torch.eye(chunk, dtype=v.dtype)
    for c0 in range(0, T + pad, chunk):
        sl = slice(c0, c0 + chunk)
        qc, kc, vc = (x[sl].transpose(0, 1) for x in (q, k, v))  # (N, C, d)
        bc, G = beta[sl].T, g[sl].T.cumsum(-1)  # (N, C)
        diff = G[:, :, None] - G[:, None, :]  # G_i - G_j
        decay = torch.where(lower, diff, torch.full_like(diff, -math.inf)).exp()  # exp(G_i - G_j), j <= i
        A = torch.where(strict, bc[:, :, None] * decay * (kc @ kc.transpose(-1, -2)), torch.zeros_like(diff))
        rhs = bc[:, :, None] * vc - (bc * G.exp())[:, :, None] * (kc @ S)
        U = torch.linalg.solve_triangular(eye + A, rhs, upper=False, unitriangular=True)  # (N, C, dv)
        o = G.exp()[:, :, None] * (qc @ S) + (decay * (qc @ kc.transpose(-1, -2))) @ U
        out[sl] = o.transpose(0, 1)
        tail = (G[:, -1:] - G).exp()  # exp(G_C - G_j)
        S = G[:, -1].exp()[:, None, None] * S + (kc * tail[:, :, None]).transpose(-1, -2) @ U
    return out[:T], S


def causal_depthwise_conv(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x (T, ch), w (ch, 1, K): out[t, c] = sum_j w[c, 0, j] x[t - (K-1) + j, c] (zeros before 0)."""
    T, K = x.shape[0], w.shape[-1]
    xp = torch.cat([torch.zeros(K - 1, x.shape[1], dtype=x.dtype), x])
    out = sum(w[:, 0, j] * xp[j:j + T] for j in range(K))
    # The same as transformers' torch fallback: F.conv1d(groups=ch, padding=K-1)[..., :T].
    ref = F.conv1d(x.T.unsqueeze(0), w, padding=K - 1, groups=x.shape[1])[0, :, :T].T
    assert x.dtype != torch.float64 or torch.allclose(out, ref, rtol=0, atol=1e-13)
    return out


def gated_delta_net(cfg: dict, g: dict, p: str, h: torch.Tensor, diffs: list[float]) -> torch.Tensor:
    """Qwen3NextGatedDeltaNet on h (T, C) (no cache, no padding mask)."""
    T = h.shape[0]
    nk, nv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv, r = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"], nv // nk
    a_ = p + "linear_attn."
    qkvz = (h @ g[a_ + "in_proj_qkvz.weight"].T).view(T, nk, 2 * dk + 2 * r * dv)
    ba = (h @ g[a_ + "in_proj_ba.weight"].T).view(T, nk, 2 * r)
    q, k, v, z = torch.split(qkvz, [dk, dk, r * dv, r * dv], dim=-1)
    b, a = torch.split(ba, [r, r], dim=-1)
    v, z = v.reshape(T, nv, dv), z.reshape(T, nv, dv)
    b, a = b.reshape(T, nv), a.reshape(T, nv)
    mixed = torch.cat([q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1)], dim=-1)
    mixed = F.silu(causal_depthwise_conv(mixed, g[a_ + "conv1d.weight"]))
    q, k, v = torch.split(mixed, [nk * dk, nk * dk, nv * dv], dim=-1)
    q, k, v = q.reshape(T, nk, dk), k.reshape(T, nk, dk), v.reshape(T, nv, dv)
    beta = torch.sigmoid(b)
    decay = -g[a_ + "A_log"].exp() * F.softplus(a + g[a_ + "dt_bias"])
    q, k = q.repeat_interleave(r, dim=1), k.repeat_interleave(r, dim=1)
    q, k = l2norm(q) * dk ** -0.5, l2norm(k)
    o, s_rec = delta_rule_recurrent(q, k, v, decay, beta)
    for chunk in (CHUNK, 4, 5) if o.dtype == torch.float64 else ():  # the fixture's one chunk, and several chunks with a carried state
        o_c, s_c = delta_rule_chunked(q, k, v, decay, beta, chunk)
        diff = max((o - o_c).abs().max().item(), (s_rec - s_c).abs().max().item())
        assert diff < 1e-10, f"{p}: chunked (C={chunk}) and recurrent gated delta rules differ by {diff}"
        diffs.append((chunk, diff))
    y = rms_gated(o, z, g[a_ + "norm.weight"], cfg["rms_norm_eps"]).reshape(T, nv * dv)
    return y @ g[a_ + "out_proj.weight"].T


def sparse_moe(cfg: dict, g: dict, p: str, h: torch.Tensor) -> torch.Tensor:
    """Qwen3NextSparseMoeBlock (Qwen3NextTopKRouter + experts + gated shared expert)."""
    m = p + "mlp."
    probs = torch.softmax(h @ g[m + "gate.weight"].T, dim=-1)
    weight, idx = probs.topk(cfg["num_experts_per_tok"], dim=-1)
    if cfg["norm_topk_prob"]:
        weight = weight / weight.sum(-1, keepdim=True)
    out = torch.zeros_like(h)
    for t in range(h.shape[0]):
        for j in range(idx.shape[1]):
            out[t] += weight[t, j] * swiglu(g, m + f"experts.{int(idx[t, j])}.", h[t:t + 1])[0]
    shared = torch.sigmoid(h @ g[m + "shared_expert_gate.weight"].T) * swiglu(g, m + "shared_expert.", h)
    return out + shared


def qwen3_next_forward(cfg: dict, w: dict[str, torch.Tensor], tokens: torch.Tensor, g: dict | None = None):
    """Returns (logits (T, V), [hidden state after each layer (T, C)], [(chunk, diff)]); g: the
    float64 weights to use (leaves whose gradients the caller wants), else w widened."""
    g = g if g is not None else {k: v.double() for k, v in w.items()}
    eps = cfg["rms_norm_eps"]
    x = g["model.embed_tokens.weight"][tokens]
    hidden, diffs = [], []
    for i, kind in enumerate(layer_types(cfg)):
        p = f"model.layers.{i}."
        h = rms_zero_centred(x, g[p + "input_layernorm.weight"], eps)
        x = x + (gated_delta_net(cfg, g, p, h, diffs) if kind == "linear_attention" else full_attention(cfg, g, p, h))
        h = rms_zero_centred(x, g[p + "post_attention_layernorm.weight"], eps)
        x = x + (sparse_moe(cfg, g, p, h) if is_moe_layer(cfg, i) else swiglu(g, p + "mlp.", h))
        hidden.append(x.clone())
    head = g["model.embed_tokens.weight"] if cfg.get("tie_word_embeddings", False) else g["lm_head.weight"]
    return rms_zero_centred(x, g["model.norm.weight"], eps) @ head.T, hidden, diffs


# --- the case -------------------------------------------------------------------------------


def qwen3_next_case(gen: torch.Generator) -> tuple[dict, dict[str, torch.Tensor]]:
    C, L, V, H, KV, d = 32, 4, 96, 4, 2, 16
    nk, nv, dk, dv, K = 2, 4, 8, 8, 4
    E, Fe, Fs, Fd = 4, 16, 16, 48
    # The key set of Qwen3-Next-80B-A3B-Instruct's config.json, in its order, at fixture size.
    cfg = {"architectures": ["Qwen3NextForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1,
           "decoder_sparse_step": 1, "eos_token_id": 2, "full_attention_interval": 2, "head_dim": d,
           "hidden_act": "silu", "hidden_size": C, "initializer_range": 0.02, "intermediate_size": Fd,
           "linear_conv_kernel_dim": K, "linear_key_head_dim": dk, "linear_num_key_heads": nk,
           "linear_num_value_heads": nv, "linear_value_head_dim": dv, "max_position_embeddings": 64,
           "mlp_only_layers": [], "model_type": "qwen3_next", "moe_intermediate_size": Fe,
           "norm_topk_prob": True, "num_attention_heads": H, "num_experts": E, "num_experts_per_tok": 2,
           "num_hidden_layers": L, "num_key_value_heads": KV, "output_router_logits": False,
           "partial_rotary_factor": 0.25, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 10000.0,
           "router_aux_loss_coef": 0.001, "shared_expert_intermediate_size": Fs, "tie_word_embeddings": False,
           "torch_dtype": "float32", "transformers_version": "4.57.0.dev0", "use_cache": True,
           "use_sliding_window": False, "vocab_size": V}
    r = lambda *shape, s=0.2: torch.randn(*shape, generator=gen) * s
    conv_dim = 2 * nk * dk + nv * dv
    w = {"model.embed_tokens.weight": r(V, C)}
    for i, kind in enumerate(layer_types(cfg)):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = r(C, s=0.1)
        if kind == "linear_attention":
            a = p + "linear_attn."
            w.update({a + "in_proj_qkvz.weight": r(2 * nk * dk + 2 * nv * dv, C),
                      a + "in_proj_ba.weight": r(2 * nv, C),
                      a + "conv1d.weight": r(conv_dim, 1, K, s=0.3),
                      # A = exp(A_log) ~ uniform(0, 16) as Qwen3NextPreTrainedModel._init_weights draws it
                      # (here layer 2 gets a head with A = 0.055: a slow decay, so the state
                      # carries token 0 to the last position); dt_bias near -1 (init: ones).
                      a + "dt_bias": r(nv, s=0.3) - 1.0,
                      a + "A_log": (16.0 * torch.rand(nv, generator=gen)).log(),
                      a + "norm.weight": 1 + r(dv, s=0.1),
                      a + "out_proj.weight": r(C, nv * dv)})
        else:
            a = p + "self_attn."
            w.update({a + "q_proj.weight": r(H * d * 2, C), a + "k_proj.weight": r(KV * d, C),
                      a + "v_proj.weight": r(KV * d, C), a + "o_proj.weight": r(C, H * d),
                      a + "q_norm.weight": r(d, s=0.3), a + "k_norm.weight": r(d, s=0.3)})
        w[p + "post_attention_layernorm.weight"] = r(C, s=0.1)
        m = p + "mlp."
        if is_moe_layer(cfg, i):
            w[m + "gate.weight"] = r(E, C, s=0.5)
            for e in range(E):
                x = m + f"experts.{e}."
                w.update({x + "gate_proj.weight": r(Fe, C), x + "up_proj.weight": r(Fe, C),
                          x + "down_proj.weight": r(C, Fe)})
            w.update({m + "shared_expert.gate_proj.weight": r(Fs, C), m + "shared_expert.up_proj.weight": r(Fs, C),
                      m + "shared_expert.down_proj.weight": r(C, Fs), m + "shared_expert_gate.weight": r(1, C)})
        else:
            w.update({m + "gate_proj.weight": r(Fd, C), m + "up_proj.weight": r(Fd, C), m + "down_proj.weight": r(C, Fd)})
    w.update({"model.norm.weight": r(C, s=0.1), "lm_head.weight": r(V, C)})
    return cfg, w


def loom_gradients(cfg: dict, grads: dict[str, torch.Tensor]) -> dict[str, list[float]]:
    """The loss's gradients in Loom's parameter layout (arch/param_layout.cpp), written here from
    the folder layouts of the module docstring, independently of Loom's import code: q/k/v fused
    (the queries from q_proj's per-head [query | gate], the gates in gate_proj), in_proj_qkvz as
    [q | k | v | z] and in_proj_ba as [b | a] from their key-head groups, conv1d.weight (ch, K),
    each expert's gate_up_proj = [gate | up], the shared expert's likewise under shared_experts.
    A (1 + w) norm's gradient w.r.t. w is the gradient w.r.t. Loom's factor 1 + w."""
    H, KV, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    nk, nv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv, r = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"], nv // nk
    out: dict[str, torch.Tensor] = {}
    for name, grad in grads.items():
        if name.endswith("self_attn.q_proj.weight"):
            qg = grad.view(H, 2 * d, -1)
            a = name[: -len("q_proj.weight")]
            out[a + "qkv_proj.weight"] = torch.cat([qg[:, :d].reshape(H * d, -1), grads[a + "k_proj.weight"],
                                                    grads[a + "v_proj.weight"]])
            out[a + "gate_proj.weight"] = qg[:, d:].reshape(H * d, -1)
        elif name.endswith(("self_attn.k_proj.weight", "self_attn.v_proj.weight")):
            continue
        elif name.endswith("in_proj_qkvz.weight"):
            x = grad.view(nk, 2 * dk + 2 * r * dv, -1)
            out[name] = torch.cat([x[:, :dk].reshape(-1, x.shape[-1]), x[:, dk:2 * dk].reshape(-1, x.shape[-1]),
                                   x[:, 2 * dk:2 * dk + r * dv].reshape(-1, x.shape[-1]),
                                   x[:, 2 * dk + r * dv:].reshape(-1, x.shape[-1])])
        elif name.endswith("in_proj_ba.weight"):
            x = grad.view(nk, 2 * r, -1)
            out[name] = torch.cat([x[:, :r].reshape(-1, x.shape[-1]), x[:, r:].reshape(-1, x.shape[-1])])
        elif name.endswith("conv1d.weight"):
            out[name] = grad[:, 0, :]
        elif ".shared_expert." in name:
            base = name[: name.index(".shared_expert.")] + ".shared_experts."
            if name.endswith("gate_proj.weight"):
                out[base + "gate_up_proj.weight"] = torch.cat([grad, grads[name.replace("gate_proj", "up_proj")]])
            elif name.endswith("down_proj.weight"):
                out[base + "down_proj.weight"] = grad
        elif name.endswith("mlp.gate_proj.weight") or (".experts." in name and name.endswith("gate_proj.weight")):
            out[name.replace("gate_proj", "gate_up_proj")] = torch.cat([grad, grads[name.replace("gate_proj", "up_proj")]])
        elif name.endswith("up_proj.weight"):
            continue
        else:
            out[name] = grad
    return {k: v.flatten().tolist() for k, v in out.items()}


def float32_errors(cfg: dict, w: dict[str, torch.Tensor], tokens: torch.Tensor, grads64: dict[str, list[float]],
                   logits64: torch.Tensor) -> dict:
    """The same model run by PyTorch in float32 (the recurrent delta rule), against the float64
    reference: its logits' and each gradient's max |diff| / max |reference|, the floor an fp32
    implementation of this (deliberately long-memory) fixture reaches; Loom's own fp32 errors
    are judged against it."""
    leaves = {k: v.float().requires_grad_(True) for k, v in w.items()}
    logits, _, _ = qwen3_next_forward(cfg, w, tokens, leaves)
    F.cross_entropy(logits[:-1], tokens[1:]).backward()
    g32 = loom_gradients(cfg, {k: v.grad.double() for k, v in leaves.items()})
    rel = lambda a, b: (a - b).abs().max().item() / b.abs().max().item()
    return {"logits": rel(logits[:-1].detach().double().flatten(), logits64[:-1].flatten()),
            "grads": {k: rel(torch.tensor(g32[k]), torch.tensor(v)) for k, v in grads64.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    out = ap.parse_args().out
    gen = torch.Generator().manual_seed(1234)
    tokens = torch.randint(0, 96, (17,), generator=gen)  # the same tokens as make_hf_fixtures.py

    cfg, w = qwen3_next_case(gen)
    path = os.path.join(out, "qwen3_next")
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    write_safetensors(os.path.join(path, "model.safetensors"), w)
    leaves = {k: v.double().requires_grad_(True) for k, v in w.items()}
    logits, hidden, diffs = qwen3_next_forward(cfg, w, tokens, leaves)
    loss_t = F.cross_entropy(logits[:-1], tokens[1:])
    loss_t.backward()
    grads = loom_gradients(cfg, {k: v.grad for k, v in leaves.items()})
    logits, hidden = logits.detach(), [x.detach() for x in hidden]
    loss = loss_t.item()
    f32 = float32_errors(cfg, w, tokens, grads, logits)
    max_diff = max(dd for _, dd in diffs)
    with open(os.path.join(path, "expected.json"), "w") as f:
        json.dump({"tokens": tokens.tolist(), "loss": loss, "logits": logits[:-1].flatten().tolist(),
                   "layer_types": layer_types(cfg),
                   "hidden_states": [x.flatten().tolist() for x in hidden],
                   "delta_rule_chunk": CHUNK, "grads": grads, "float32_errors": f32,
                   "delta_rule_chunked_vs_recurrent_max_abs_diff": max_diff}, f)
    print(f"{path}: PyTorch float32 vs float64: logits {f32['logits']:.2e}, worst gradient "
          f"{max(f32['grads'].values()):.2e}")
    print(f"{path}: loss {loss:.6f}; chunked vs recurrent gated delta rule max |diff| "
          + ", ".join(f"C={c}: {dd:.3e}" for c, dd in diffs))


if __name__ == "__main__":
    main()
