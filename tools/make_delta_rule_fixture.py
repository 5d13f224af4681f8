#!/usr/bin/python3
"""PyTorch float64 reference of the gated delta rule, for Loom's tests (tests/test_delta_rule.cpp).

    /usr/bin/python3 tools/make_delta_rule_fixture.py --out tests/fixtures/delta_rule

The recurrence is written here from the paper (Yang, Kautz & Hatamizadeh 2024, "Gated Delta
Networks: Improving Mamba2 with Delta Rule", arXiv 2412.06464), token by token, per batch
row b and head h, with S a d_k x d_v state:

    S_t = exp(g_t) S_{t-1} + k_t (beta_t (v_t - (exp(g_t) S_{t-1})^T k_t))^T,    o_t = S_t^T q_t

(the semantics of transformers' torch_recurrent_gated_delta_rule in qwen3_next, given q and k
already L2-normalised and q already scaled by 1/sqrt(d_k), as Loom's op takes them). Gradients
come from float64 autograd of the same loop. Writes delta_rule.safetensors (float64) holding

    q, k            (B, T, H, d_k)   normalised; q times 1/sqrt(d_k)
    v               (B, T, H, d_v)
    g, beta         (B, T, H)        g = -softplus(.) <= 0, beta = sigmoid(.) in (0, 1)
    initial_state   (B, H, d_k, d_v)
    out, final_state                 the rule from initial_state
    out_zero, final_state_zero       the rule from a zero state
    dout, dfinal_state               the weights of the loss sum(out * dout) + sum(final * dfinal)
    dq, dk, dv, dg, dbeta, dinitial_state   that loss's gradients (from initial_state)

with the dimensions in the metadata. About 160 KB.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import loom_reference as ref  # noqa: E402

B, T, H, DK, DV = 2, 40, 2, 16, 8
SEED = 20241206


def gated_delta_rule(q, k, v, g, beta, state):
    """The recurrence over (B, T, H, .) inputs from state (B, H, d_k, d_v); returns (out, final)."""
    outs = []
    for t in range(q.shape[1]):
        q_t, k_t, v_t = q[:, t], k[:, t], v[:, t]                 # (B, H, d)
        decay = torch.exp(g[:, t])[:, :, None, None]                # (B, H, 1, 1)
        state = decay * state                                        # exp(g_t) S_{t-1}
        recall = torch.einsum("bhkv,bhk->bhv", state, k_t)           # (exp(g_t) S_{t-1})^T k_t
        delta = beta[:, t][:, :, None] * (v_t - recall)              # beta_t (v_t - recall)
        state = state + torch.einsum("bhk,bhv->bhkv", k_t, delta)    # + k_t delta^T
        outs.append(torch.einsum("bhkv,bhk->bhv", state, q_t))       # S_t^T q_t
    return torch.stack(outs, dim=1), state


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder to write delta_rule.safetensors into")
    args = parser.parse_args()
    torch.manual_seed(SEED)
    f64 = torch.float64
    q = torch.randn(B, T, H, DK, dtype=f64)
    k = torch.randn(B, T, H, DK, dtype=f64)
    q = q / q.norm(dim=-1, keepdim=True) * DK ** -0.5
    k = k / k.norm(dim=-1, keepdim=True)
    v = torch.randn(B, T, H, DV, dtype=f64)
    g = -torch.nn.functional.softplus(torch.randn(B, T, H, dtype=f64) - 1.0)
    beta = torch.sigmoid(torch.randn(B, T, H, dtype=f64))
    s0 = 0.5 * torch.randn(B, H, DK, DV, dtype=f64)
    dout = torch.randn(B, T, H, DV, dtype=f64)
    dfinal = torch.randn(B, H, DK, DV, dtype=f64)

    inputs = {"q": q, "k": k, "v": v, "g": g, "beta": beta, "initial_state": s0}
    leaves = {name: t.clone().requires_grad_(True) for name, t in inputs.items()}
    out, final = gated_delta_rule(*(leaves[n] for n in ("q", "k", "v", "g", "beta", "initial_state")))
    loss = (out * dout).sum() + (final * dfinal).sum()
    loss.backward()
    with torch.no_grad():
        out_zero, final_zero = gated_delta_rule(q, k, v, g, beta, torch.zeros(B, H, DK, DV, dtype=f64))

    tensors = dict(inputs)
    tensors.update({"out": out.detach(), "final_state": final.detach(), "out_zero": out_zero,
                    "final_state_zero": final_zero, "dout": dout, "dfinal_state": dfinal})
    for name in ("q", "k", "v", "g", "beta"):
        tensors["d" + name] = leaves[name].grad
    tensors["dinitial_state"] = leaves["initial_state"].grad
    tensors = {name: t.contiguous() for name, t in tensors.items()}
    metadata = {"B": str(B), "T": str(T), "H": str(H), "d_k": str(DK), "d_v": str(DV), "seed": str(SEED),
                "loss": "sum(out * dout) + sum(final_state * dfinal_state)"}
    os.makedirs(args.out, exist_ok=True)
    ref.write_safetensors(os.path.join(args.out, "delta_rule.safetensors"), tensors, metadata)


if __name__ == "__main__":
    main()
