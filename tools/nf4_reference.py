#!/usr/bin/python3
"""NF4 with double quantization in PyTorch, written independently of Loom's C++ from the format
stated in src/loom/precision/nf4.h (QLoRA, Dettmers et al. 2023, sec. 3).

    /usr/bin/python3 tools/nf4_reference.py --out DIR

writes DIR/nf4.safetensors with

    table                    F32 (16,)   the NF4 code values built from the normal quantiles
    <case>.weight            F32 (R, C)  the input weight
    <case>.codes             U8          ceil(n / 2) bytes: element 2i high nibble, 2i + 1 low
    <case>.absmax            F32         each 64-block's absmax (first level)
    <case>.absmax_codes      U8          the int8 codes of the double quantization (their bytes)
    <case>.absmax_steps      F32         one step per 256 blocks
    <case>.absmax_mean       F32 (1,)    the mean of the absmax values
    <case>.dequantized       F32 (R, C)  the weight decoded with the double-quantized scales

Where the C++ compares midpoints, this takes the argmin of exact float64 distances (torch's
argmin returns the first, lower, index on ties); where the C++ loops, this uses whole-tensor
operations. Output is deterministic.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import loom_reference as ref  # noqa: E402

BLOCK, SCALE_BLOCK = 64, 256
# QLoRA Appendix E / bitsandbytes' NF4 table.
PRINTED = [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
           -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
           0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
           0.7229568362236023, 1.0]


def nf4_table() -> torch.Tensor:
    """Normal quantiles at float32 probabilities spaced from 0.9677083 to 1/2: 8 positive, 7
    negative, and 0, as float32, divided by the largest."""
    pos = torch.special.ndtri(torch.linspace(0.9677083, 0.5, 9)[:-1].double())
    neg = -torch.special.ndtri(torch.linspace(0.9677083, 0.5, 8)[:-1].double())
    v = torch.cat([pos, neg, torch.zeros(1, dtype=torch.float64)]).float().sort().values
    return v / v.max()


def per_element(per_block: torch.Tensor, block: int, n: int) -> torch.Tensor:
    return per_block.repeat_interleave(block)[:n]


def quantize(w: torch.Tensor, table: torch.Tensor) -> dict:
    x = w.reshape(-1)
    n = x.numel()
    blocks = -(-n // BLOCK)
    absmax = torch.cat([x.abs(), torch.zeros(blocks * BLOCK - n)]).reshape(blocks, BLOCK).amax(dim=1)
    scale = per_element(absmax, BLOCK, n)
    positive = scale > 0
    v = torch.where(positive, x / torch.where(positive, scale, torch.ones_like(scale)), torch.zeros_like(x))
    idx = (v.double()[:, None] - table.double()[None, :]).abs().argmin(dim=1)
    nibbles = torch.cat([idx, torch.zeros(n % 2, dtype=idx.dtype)])
    codes = (nibbles[0::2] * 16 + nibbles[1::2]).to(torch.uint8)

    total = 0.0
    for c in absmax.tolist():  # in block order, in double
        total += c
    mean = torch.tensor(np.float32(total / blocks) if blocks else np.float32(0.0))
    d = absmax - mean
    groups = -(-blocks // SCALE_BLOCK)
    amax2 = torch.cat([d.abs(), torch.zeros(groups * SCALE_BLOCK - blocks)]).reshape(groups, SCALE_BLOCK).amax(dim=1)
    steps = amax2 / torch.full_like(amax2, 127.0)
    step = per_element(steps, SCALE_BLOCK, blocks)
    nonzero = step > 0
    q = torch.where(nonzero, torch.round(d / torch.where(nonzero, step, torch.ones_like(step))), torch.zeros_like(d))
    q = q.clamp(-127, 127).to(torch.int8)
    c_hat = (q.double() * step.double() + mean.double()).float()
    dequantized = table[idx] * per_element(c_hat, BLOCK, n)
    return {"weight": w, "codes": codes, "absmax": absmax, "absmax_codes": q.view(torch.uint8),
            "absmax_steps": steps, "absmax_mean": mean.reshape(1), "dequantized": dequantized.reshape(w.shape)}


def cases(table: torch.Tensor) -> dict:
    g = torch.Generator().manual_seed(1234)
    normal = torch.randn(96, 200, generator=g) * 0.02  # 300 blocks: two scale groups, the second short
    tail = torch.randn(37, 131, generator=g)           # 4847 elements: a tail block of 47, an odd n
    scaled = torch.randn(64, 512, generator=g) * torch.pow(10.0, torch.rand(64, 1, generator=g) * 4 - 3)
    scaled[5] = 0.0                                    # all-zero blocks
    scaled[9] = 0.0
    scaled[9, 100] = -3.0                              # one element: the rest of its block is 0
    # Ties: a block with absmax 1 holding every midpoint of neighbouring codes that float32
    # represents exactly, and the floats on either side of it.
    ties = [1.0]
    for a, b in zip(table[:-1].double().tolist(), table[1:].double().tolist()):
        m = (a + b) / 2
        if float(np.float32(m)) == m:
            ties += [m, float(np.nextafter(np.float32(m), np.float32(-2))), float(np.nextafter(np.float32(m), np.float32(2)))]
    scaled[20, :len(ties)] = torch.tensor(ties, dtype=torch.float32)
    scaled[20, len(ties):64] = 0.0
    return {"normal": normal, "tail": tail, "scaled": scaled, "tiny": torch.randn(1, 37, generator=g)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    table = nf4_table()
    assert table.tolist() == PRINTED, f"the construction gives {table.tolist()}"
    tensors = {"table": table}
    for name, w in cases(table).items():
        for key, t in quantize(w.float().contiguous(), table).items():
            tensors[f"{name}.{key}"] = t.contiguous()
    os.makedirs(args.out, exist_ok=True)
    ref.write_safetensors(os.path.join(args.out, "nf4.safetensors"), tensors, {"format": "nf4, block 64, int8 scales per 256"})


if __name__ == "__main__":
    main()
