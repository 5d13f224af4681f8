#!/usr/bin/env python3
"""PyTorch reference of Loom's mixture-of-experts blocks (src/loom/nn/moe.h), in float64.

Writes DIR/moe_llama_tiny.safetensors and DIR/moe_gpt2_tiny.safetensors for tests/test_moe.cpp:
every parameter, a batch, the logits, the cross-entropy, the auxiliary losses' sum, the dropped
assignments, and the gradient of (cross-entropy + auxiliary losses) for every parameter.

The MoE math (docs/moe.md), for the block's second-norm output x (N, C):
  u = x Wr^T; s = softmax(u) or sigmoid(u); selection scores s + b (b: routing bias);
  groups (G > 1): a group's score is the sum of its two best selection scores, the top
  `topk_groups` groups are eligible; top-k of the eligible selection scores, best first;
  gates g_j = s_{i_j} (/ sum of the selected s if renorm) * route_scale (never b);
  capacity (factor > 0): ceil(k N / E * factor) per expert in priority (choice j, token t) order;
  y = x_res + sum_{kept j} g_j E_{i_j}(x) + shared(x).
Losses with q = s / sum(s): Switch alpha E sum f_i P_i (f_i = assignments / (k N), P_i = mean q);
DeepSeek sequence-wise alpha' mean_b sum_i (E / (k T) count_bi) (mean_t q_bti); z-loss
c_z mean (logsumexp u)^2. Selections and capacity are not differentiable (indices only).

A seed is accepted only when every top-k and group choice wins by at least 1e-6 (so Loom's
float32 routing picks the same experts as this float64 one).
"""
from __future__ import annotations

import argparse
import math
import os
import sys
from dataclasses import dataclass, field
from typing import Dict, List, Tuple

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import loom_reference as ref  # noqa: E402


@dataclass(frozen=True)
class MoeConfig:
    experts: int
    top_k: int
    d_ff: int
    shared: int = 0
    dense_layers: int = 0
    sigmoid: bool = False
    renorm: bool = True
    route_scale: float = 1.0
    groups: int = 1
    topk_groups: int = 1
    capacity_factor: float = 0.0
    aux_alpha: float = 0.0
    seq_aux_alpha: float = 0.0
    z_alpha: float = 0.0

    def metadata(self) -> Dict[str, str]:
        return {"moe_" + k: (repr(float(v)) if isinstance(v, float) else str(int(v)))
                for k, v in self.__dict__.items()}


def moe_specs(cfg: ref.ModelConfig, moe: MoeConfig) -> List[Tuple[str, Tuple[int, ...], str]]:
    """Parameter specs in Loom's layout order (src/loom/arch/param_layout.cpp)."""
    C, Fe, S = cfg.d_model, moe.d_ff, moe.shared * moe.d_ff
    llama = cfg.arch == "llama"
    out = []
    for name, shape, kind in ref.param_specs(cfg):
        layer = name.split(".")[2] if llama and name.startswith("model.layers.") else (
            name.split(".")[1] if not llama and name.startswith("h.") else None)
        is_mlp = ".mlp." in name
        if layer is not None and int(layer) >= moe.dense_layers and is_mlp:
            if name.endswith(("mlp.down_proj.weight", "mlp.c_proj.bias")):  # the block's last MLP tensor
                p = name[: name.index("mlp.")]
                out.append((p + ("mlp.gate.weight" if llama else "mlp.router.weight"), (moe.experts, C), "matrix"))
                out.append((p + ("mlp.gate.e_score_correction_bias" if llama else "mlp.router.bias_correction"),
                            (moe.experts,), "routing_bias"))
                for e in range(moe.experts):
                    x = f"{p}mlp.experts.{e}."
                    if llama:
                        out += [(x + "gate_up_proj.weight", (2 * Fe, C), "matrix"), (x + "down_proj.weight", (C, Fe), "matrix")]
                    else:
                        out += [(x + "c_fc.weight", (Fe, C), "matrix"), (x + "c_proj.weight", (C, Fe), "matrix")]
                if S > 0:
                    if llama:
                        out += [(p + "mlp.shared_experts.gate_up_proj.weight", (2 * S, C), "matrix"),
                                (p + "mlp.shared_experts.down_proj.weight", (C, S), "matrix")]
                    else:
                        out += [(p + "mlp.shared_experts.c_fc.weight", (S, C), "matrix"),
                                (p + "mlp.shared_experts.c_proj.weight", (C, S), "matrix")]
            continue
        out.append((name, shape, kind))
    return out


def init_params(cfg, moe, seed):
    gen = torch.Generator().manual_seed(seed)
    P = {}
    for name, shape, kind in moe_specs(cfg, moe):
        z = torch.randn(shape, generator=gen, dtype=torch.float32)
        if kind == "norm":
            w = 1.0 + 0.1 * z
        elif kind == "routing_bias":
            w = 0.05 * z  # non-zero: it must change the selection and never the gates
        elif name.endswith(("gate.weight", "router.weight")):
            w = 0.3 * z  # a router with some conviction: clear top-k margins
        else:
            w = 0.02 * z
        P[name] = w.to(torch.float64)
    return P


@dataclass
class Routing:
    aux: torch.Tensor
    dropped: int
    margin: float  # the smallest winning margin of any selection


def route(x, wr, bias, moe: MoeConfig, T: int, stats: List[Routing]):
    """Selected experts (N, k), gates (N, k) with autograd, kept mask (N, k); appends stats."""
    N, E, K = x.shape[0], moe.experts, moe.top_k
    u = x @ wr.T
    s = torch.sigmoid(u) if moe.sigmoid else torch.softmax(u, dim=-1)
    sel = (s + bias).detach()
    margin = math.inf
    if moe.groups > 1:
        per = E // moe.groups
        g = sel.view(N, moe.groups, per)
        top2 = g.topk(min(2, per), dim=-1).values.sum(-1)  # (N, G)
        order = top2.sort(dim=-1, descending=True, stable=True)
        vals = order.values
        margin = min(margin, float((vals[:, moe.topk_groups - 1] - vals[:, moe.topk_groups]).min()))
        keep = torch.zeros(N, moe.groups, dtype=torch.bool)
        keep.scatter_(1, order.indices[:, : moe.topk_groups], True)
        sel = sel.masked_fill(~keep.repeat_interleave(per, dim=1), -math.inf)
    order = sel.sort(dim=-1, descending=True, stable=True)
    idx = order.indices[:, :K]
    vals = order.values
    finite = vals[:, K] if K < E else None
    if finite is not None:
        m = vals[:, K - 1] - vals[:, K]
        margin = min(margin, float(m[torch.isfinite(m)].min()) if torch.isfinite(m).any() else math.inf)
    for j in range(K - 1):
        margin = min(margin, float((vals[:, j] - vals[:, j + 1]).min()))
    picked = s.gather(1, idx)
    gates = picked / picked.sum(-1, keepdim=True) if moe.renorm else picked
    gates = gates * moe.route_scale
    # Capacity in (choice, token) priority order.
    kept = torch.ones(N, K, dtype=torch.bool)
    dropped = 0
    if moe.capacity_factor > 0:
        cap = math.ceil(K * N / E * moe.capacity_factor - 1e-9)
        count = [0] * E
        for j in range(K):
            for t in range(N):
                e = int(idx[t, j])
                if count[e] < cap:
                    count[e] += 1
                else:
                    kept[t, j] = False
                    dropped += 1
    # Losses.
    q = s / s.sum(-1, keepdim=True)
    onehot = torch.zeros(N, E, dtype=x.dtype).scatter_add_(1, idx, torch.ones(N, K, dtype=x.dtype))
    aux = torch.zeros((), dtype=x.dtype)
    if moe.aux_alpha > 0:
        f = onehot.sum(0) / (K * N)
        aux = aux + moe.aux_alpha * E * (f * q.mean(0)).sum()
    if moe.seq_aux_alpha > 0:
        B = N // T
        fb = onehot.view(B, T, E).sum(1) * (E / (K * T))
        Pb = q.view(B, T, E).mean(1)
        aux = aux + moe.seq_aux_alpha * (fb * Pb).sum(-1).mean()
    if moe.z_alpha > 0:
        aux = aux + moe.z_alpha * (torch.logsumexp(u, dim=-1) ** 2).mean()
    stats.append(Routing(aux, dropped, margin))
    return idx, gates, kept


def expert_mlp(x, w1, w2, llama):
    if llama:
        gate, up = (x @ w1.T).chunk(2, dim=-1)
        return (F.silu(gate) * up) @ w2.T
    return ref.gelu_tanh(x @ w1.T) @ w2.T


def moe_mlp(x, P, p, cfg, moe, T, stats):
    """x (B, T, C) -> the MoE output (B, T, C)."""
    llama = cfg.arch == "llama"
    B, _, C = x.shape
    xs = x.reshape(-1, C)
    wr = P[p + ("mlp.gate.weight" if llama else "mlp.router.weight")]
    bias = P[p + ("mlp.gate.e_score_correction_bias" if llama else "mlp.router.bias_correction")]
    idx, gates, kept = route(xs, wr, bias, moe, T, stats)
    y = torch.zeros_like(xs)
    for e in range(moe.experts):
        x_ = f"{p}mlp.experts.{e}."
        w1 = P[x_ + ("gate_up_proj.weight" if llama else "c_fc.weight")]
        w2 = P[x_ + ("down_proj.weight" if llama else "c_proj.weight")]
        mask = (idx == e) & kept  # (N, K)
        tokens, choice = mask.nonzero(as_tuple=True)
        if tokens.numel() == 0:
            continue
        out = expert_mlp(xs[tokens], w1, w2, llama) * gates[tokens, choice].unsqueeze(-1)
        y = y.index_add(0, tokens, out)
    if moe.shared > 0:
        w1 = P[p + ("mlp.shared_experts.gate_up_proj.weight" if llama else "mlp.shared_experts.c_fc.weight")]
        w2 = P[p + ("mlp.shared_experts.down_proj.weight" if llama else "mlp.shared_experts.c_proj.weight")]
        y = y + expert_mlp(xs, w1, w2, llama)
    return y.view(B, -1, C)


def forward(P, cfg: ref.ModelConfig, moe: MoeConfig, tokens, stats):
    """Logits (B, T, V) of the model whose blocks from moe.dense_layers on are MoE blocks."""
    B, T = tokens.shape
    C, eps = cfg.d_model, cfg.norm_eps
    if cfg.arch == "llama":
        x = P["model.embed_tokens.weight"][tokens.long()]
        cos, sin = ref.rope_cos_sin(T, cfg.head_dim, cfg.rope_theta, x.dtype)
        H, KVH, hd = cfg.n_head, cfg.n_kv_head, cfg.head_dim
        for i in range(cfg.n_layer):
            p = f"model.layers.{i}."
            h = ref.rms_norm(x, P[p + "input_layernorm.weight"], eps)
            q, k, v = ref.linear(h, P[p + "self_attn.qkv_proj.weight"]).split([H * hd, KVH * hd, KVH * hd], dim=-1)
            q = ref.apply_rope(ref.split_heads(q, H), cos, sin)
            k = ref.apply_rope(ref.split_heads(k, KVH), cos, sin).repeat_interleave(H // KVH, dim=1)
            v = ref.split_heads(v, KVH).repeat_interleave(H // KVH, dim=1)
            x = x + ref.linear(ref.merge_heads(ref.causal_attention(q, k, v)), P[p + "self_attn.o_proj.weight"])
            h = ref.rms_norm(x, P[p + "post_attention_layernorm.weight"], eps)
            if i >= moe.dense_layers:
                x = x + moe_mlp(h, P, p, cfg, moe, T, stats)
            else:
                gate, up = ref.linear(h, P[p + "mlp.gate_up_proj.weight"]).split(cfg.d_ff, dim=-1)
                x = x + ref.linear(F.silu(gate) * up, P[p + "mlp.down_proj.weight"])
        x = ref.rms_norm(x, P["model.norm.weight"], eps)
        return ref.linear(x, P["lm_head.weight"])
    x = P["wte.weight"][tokens.long()] + P["wpe.weight"][:T]
    for i in range(cfg.n_layer):
        p = f"h.{i}."
        h = ref.layer_norm(x, P[p + "ln_1.weight"], P[p + "ln_1.bias"], eps)
        qkv = ref.linear(h, P[p + "attn.c_attn.weight"], P[p + "attn.c_attn.bias"])
        q, k, v = (ref.split_heads(t, cfg.n_head) for t in qkv.split(C, dim=-1))
        x = x + ref.linear(ref.merge_heads(ref.causal_attention(q, k, v)), P[p + "attn.c_proj.weight"],
                           P[p + "attn.c_proj.bias"])
        h = ref.layer_norm(x, P[p + "ln_2.weight"], P[p + "ln_2.bias"], eps)
        if i >= moe.dense_layers:
            x = x + moe_mlp(h, P, p, cfg, moe, T, stats)
        else:
            h = ref.gelu_tanh(ref.linear(h, P[p + "mlp.c_fc.weight"], P[p + "mlp.c_fc.bias"]))
            x = x + ref.linear(h, P[p + "mlp.c_proj.weight"], P[p + "mlp.c_proj.bias"])
    x = ref.layer_norm(x, P["ln_f.weight"], P["ln_f.bias"], eps)
    return ref.linear(x, P["wte.weight"])


FIXTURES = {
    # Llama blocks, softmax router, top-2 of 4 renormalised and scaled, a shared expert, the
    # first layer dense, all three losses, dropless.
    "moe_llama_tiny": (
        ref.ModelConfig("llama", 101, 16, 2, 6, 2, 48, 80),
        MoeConfig(experts=4, top_k=2, d_ff=32, shared=1, dense_layers=1, route_scale=1.5,
                  aux_alpha=1e-2, seq_aux_alpha=1e-2, z_alpha=1e-3),
    ),
    # GPT-2 blocks, sigmoid router (DeepSeek-V3), 8 experts in 4 groups with 2 eligible, top-2,
    # capacity factor 1 (drops), every layer MoE.
    "moe_gpt2_tiny": (
        ref.ModelConfig("gpt2", 97, 16, 2, 4, 4, 32, 128),
        MoeConfig(experts=8, top_k=2, d_ff=24, groups=4, topk_groups=2, sigmoid=True, capacity_factor=1.0,
                  aux_alpha=1e-2, z_alpha=1e-3),
    ),
}


def build(name: str):
    cfg, moe = FIXTURES[name]
    B, T = 2, 8
    for seed in range(100):
        P = init_params(cfg, moe, seed)
        gen = torch.Generator().manual_seed(1000 + seed)
        tokens = torch.randint(0, cfg.vocab_size, (B, T), generator=gen, dtype=torch.int32)
        targets = torch.randint(0, cfg.vocab_size, (B, T), generator=gen, dtype=torch.int32)
        leaves = {k: v.detach().clone().requires_grad_(True) for k, v in P.items()}
        stats: List[Routing] = []
        logits = forward(leaves, cfg, moe, tokens, stats)
        if min(r.margin for r in stats) < 1e-6:
            continue  # a near tie: float32 might route differently
        ce = ref.cross_entropy(logits, targets)
        aux = sum(r.aux for r in stats)
        grads = torch.autograd.grad(ce + aux, list(leaves.values()), allow_unused=True)
        tensors = {k: v.to(torch.float32) for k, v in P.items()}
        tensors["tokens"], tensors["targets"] = tokens, targets
        tensors["logits"] = logits.detach().to(torch.float32)
        tensors["loss"] = ce.detach().reshape(1).to(torch.float32)
        tensors["aux"] = torch.tensor([float(aux)], dtype=torch.float32)
        tensors["dropped"] = torch.tensor([float(r.dropped) for r in stats], dtype=torch.float32)
        for k, g in zip(leaves.keys(), grads):
            tensors["grad." + k] = (torch.zeros_like(P[k]) if g is None else g).to(torch.float32)
        metadata = cfg.metadata()
        metadata.update(moe.metadata())
        metadata.update({"batch": str(B), "seq_len": str(T), "seed": str(seed),
                         "min_margin": repr(min(r.margin for r in stats))})
        return tensors, metadata
    raise RuntimeError(f"{name}: no seed without near ties")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    for name in FIXTURES:
        tensors, metadata = build(name)
        path = os.path.join(args.out, name + ".safetensors")
        ref.write_safetensors(path, tensors, metadata)
        print(f"{path}: seed {metadata['seed']}, smallest routing margin {float(metadata['min_margin']):.2e}, "
              f"dropped {[int(d) for d in tensors['dropped'].tolist()]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
