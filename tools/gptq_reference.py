#!/usr/bin/python3
"""GPTQ in PyTorch (float64), written independently of Loom's C++ from the algorithm stated in
src/loom/precision/gptq.h (Frantar et al. 2022, "GPTQ", Algorithm 1, with groups and the
act-order heuristic) and the integer format of src/loom/precision/int_quant.h.

    /usr/bin/python3 tools/gptq_reference.py --out DIR

writes DIR/gptq.safetensors with, for each case,

    <case>.w          F32 (R, K)  the weight
    <case>.x          F32 (N, K)  calibration inputs (H = x^T x in float64)
    <case>.q          F32 (R, K)  the GPTQ weight, dequantized (s (q - z))
    <case>.codes      U8  (R, K)  the integer codes, one per byte, natural column order
    <case>.error      F64 (1,)    ||x w^T - x q^T||^2 / ||x w^T||^2
    <case>.rtn_error  F64 (1,)    the same for round-to-nearest with the same groups

and metadata "<case>": "bits,group,act_order,block". Where the C++ loops over rows, this
updates whole column blocks with matrix operations; the Cholesky factors are torch.linalg's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import loom_reference as ref  # noqa: E402

DAMP = 0.01


def group_params(x: torch.Tensor, bits: int):
    """Per row of x (R, G): the f32 scale and the zero point (int_quant.h)."""
    lo = torch.clamp(x.min(dim=1).values, max=0.0)
    hi = torch.clamp(x.max(dim=1).values, min=0.0)
    top = float(2 ** bits - 1)
    flat = hi == lo
    scale = ((hi - lo) / top).float().double()  # stored as f32
    scale = torch.where(flat, torch.ones_like(scale), scale)
    zero = torch.clamp(torch.round(-lo / scale), 0.0, top)
    zero = torch.where(flat, torch.zeros_like(zero), zero)
    return scale, zero


def quant(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int):
    q = torch.clamp(torch.round(w / scale) + zero, 0.0, float(2 ** bits - 1))
    return q, scale * (q - zero)


def gptq(w: torch.Tensor, h: torch.Tensor, bits: int, group: int, act_order: bool, block: int):
    W = w.double().clone()
    H = h.clone()
    R, K = W.shape
    dead = torch.diag(H) == 0
    H[dead, dead] = 1.0
    W[:, dead] = 0.0
    perm = torch.argsort(torch.diag(H), descending=True, stable=True) if act_order else torch.arange(K)
    G = K // group
    scales = torch.zeros(R, G, dtype=torch.float64)
    zeros = torch.zeros(R, G, dtype=torch.float64)
    if act_order:  # static groups, from the weight in natural order
        for g in range(G):
            scales[:, g], zeros[:, g] = group_params(W[:, g * group:(g + 1) * group], bits)
    W = W[:, perm]
    H = H[perm][:, perm]
    H = H + DAMP * torch.mean(torch.diag(H)) * torch.eye(K, dtype=torch.float64)
    U = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)
    codes = torch.zeros(R, K, dtype=torch.float64)
    Q = torch.zeros(R, K, dtype=torch.float64)
    for i1 in range(0, K, block):
        i2 = min(i1 + block, K)
        err = torch.zeros(R, i2 - i1, dtype=torch.float64)
        for i in range(i1, i2):
            col = int(perm[i])
            g = col // group
            if not act_order and i % group == 0:
                scales[:, g], zeros[:, g] = group_params(W[:, i:i + group], bits)
            q, deq = quant(W[:, i], scales[:, g], zeros[:, g], bits)
            codes[:, col] = q
            Q[:, col] = deq
            e = (W[:, i] - deq) / U[i, i]
            err[:, i - i1] = e
            W[:, i + 1:i2] -= torch.outer(e, U[i, i + 1:i2])
        W[:, i2:] -= err @ U[i1:i2, i2:]
    return Q, codes


def rtn(w: torch.Tensor, bits: int, group: int):
    W = w.double()
    R, K = W.shape
    Q = torch.zeros_like(W)
    for g in range(K // group):
        s, z = group_params(W[:, g * group:(g + 1) * group], bits)
        _, Q[:, g * group:(g + 1) * group] = quant(W[:, g * group:(g + 1) * group], s[:, None], z[:, None], bits)
    return Q


def rel_error(x: torch.Tensor, w: torch.Tensor, q: torch.Tensor) -> float:
    y = x.double() @ w.double().T
    return float(((y - x.double() @ q.T) ** 2).sum() / (y ** 2).sum())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    gen = torch.Generator().manual_seed(24)
    # name: (R, K, N, bits, group, act_order, block, dead column)
    cases = {
        "g32": (64, 128, 512, 4, 32, False, 128, None),
        "g64_act": (48, 192, 384, 3, 64, True, 64, None),
        "row8_dead": (32, 96, 256, 8, 96, False, 32, 5),
        "g128_blocks": (40, 256, 600, 4, 128, False, 128, None),
    }
    tensors, meta = {}, {}
    for name, (R, K, N, bits, group, act_order, block, dead) in cases.items():
        w = torch.randn(R, K, generator=gen, dtype=torch.float32) * 0.05
        col_scale = torch.exp(torch.randn(K, generator=gen, dtype=torch.float32))  # uneven channel energy
        x = torch.randn(N, K, generator=gen, dtype=torch.float32) * col_scale
        x = x + 0.5 * torch.roll(x, 1, dims=1)  # correlated columns
        if dead is not None:
            x[:, dead] = 0.0
        h = x.double().T @ x.double()
        q, codes = gptq(w, h, bits, group, act_order, block)
        tensors[f"{name}.w"] = w
        tensors[f"{name}.x"] = x
        tensors[f"{name}.q"] = q.float()
        tensors[f"{name}.codes"] = codes.to(torch.uint8)
        tensors[f"{name}.error"] = torch.tensor([rel_error(x, w, q)], dtype=torch.float64)
        tensors[f"{name}.rtn_error"] = torch.tensor([rel_error(x, w, rtn(w, bits, group))], dtype=torch.float64)
        meta[name] = f"{bits},{group},{int(act_order)},{block}"
    ref.write_safetensors(os.path.join(args.out, "gptq.safetensors"), tensors, meta)
    print(json.dumps({k: float(v) for k, v in tensors.items() if k.endswith("error")}))


if __name__ == "__main__":
    main()
