#!/usr/bin/python3
"""PyTorch references of the preference losses, for Loom's DPO tests (tests/test_dpo_parity.cpp).

    /usr/bin/python3 tools/make_dpo_fixtures.py --out build/fixtures/dpo

For the tiny GPT-2 and Llama of tools/make_fixtures.py, writes <case>.safetensors holding

    <param name>          F32  the policy's parameters (loom_reference.init_params)
    tokens, targets       I32  (4, T): pair 0's chosen and rejected rows, then pair 1's; a prompt's
                               targets and a row's padding are -100 (not counted)
    reference             F64  (4,)  each row's reference log-probability: the sum over its counted
                               targets of log softmax, from a second initialisation (seed + 1)
    lengths               I32  (4,)  each row's counted targets (SimPO's |y|)
    loss.<variant>        F64  (1,)  the mean over the two pairs of the variant's loss
    grad.<variant>.<name> F32  its gradient with respect to each parameter

for the variants sigmoid (DPO, Rafailov et al. 2023, eq. 7), ipo (Azar et al. 2023, eq. 17) and
simpo (Meng et al. 2024, eq. 6), with the beta (and SimPO's gamma) in the metadata. Everything is
computed in float64 with autograd from the formulas as written in the papers; nothing imports trl.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import loom_reference as ref  # noqa: E402
from make_fixtures import FIXTURES  # noqa: E402

SEED = 2022
T = 12
PROMPTS = [3, 3, 5, 5]    # prompt targets (not counted) of each row
COUNTED = [6, 4, 7, 2]    # counted targets after them; the rest of the row is padding
VARIANTS = {"sigmoid": (0.5, 0.0), "ipo": (0.1, 0.0), "simpo": (2.0, 0.5)}  # beta, gamma


def row_log_probs(params, cfg, tokens, targets) -> torch.Tensor:
    logits = ref.forward(params, cfg, tokens)  # (B, T, V)
    logp = torch.log_softmax(logits, dim=-1)
    counted = targets != -100
    picked = logp.gather(-1, targets.clamp(min=0).long().unsqueeze(-1)).squeeze(-1)
    return (picked * counted).sum(dim=-1)


def pair_loss(variant: str, lp, ref_lp, lengths) -> torch.Tensor:
    beta, gamma = VARIANTS[variant]
    lw, ll, rw, rl = lp[0::2], lp[1::2], ref_lp[0::2], ref_lp[1::2]
    if variant == "sigmoid":
        return -torch.nn.functional.logsigmoid(beta * ((lw - rw) - (ll - rl))).mean()
    if variant == "ipo":
        return (((lw - rw) - (ll - rl)) - 1.0 / (2.0 * beta)).pow(2).mean()
    z = beta * lw / lengths[0::2] - beta * ll / lengths[1::2] - gamma
    return -torch.nn.functional.logsigmoid(z).mean()


def build(name: str):
    cfg = FIXTURES[name][0]
    params32 = ref.init_params(cfg, seed=SEED)
    other = {k: v.to(torch.float64) for k, v in ref.init_params(cfg, seed=SEED + 1).items()}
    gen = torch.Generator().manual_seed(SEED)
    tokens = torch.randint(0, cfg.vocab_size, (4, T), generator=gen, dtype=torch.int64).to(torch.int32)
    targets = torch.randint(0, cfg.vocab_size, (4, T), generator=gen, dtype=torch.int64).to(torch.int32)
    for r in range(4):
        targets[r, :PROMPTS[r]] = -100
        targets[r, PROMPTS[r] + COUNTED[r]:] = -100
    lengths = torch.tensor(COUNTED, dtype=torch.float64)
    with torch.no_grad():
        reference = row_log_probs(other, cfg, tokens, targets)
    tensors = dict(params32)
    tensors.update({"tokens": tokens, "targets": targets, "reference": reference,
                    "lengths": torch.tensor(COUNTED, dtype=torch.int32)})
    metadata = cfg.metadata()
    for variant, (beta, gamma) in VARIANTS.items():
        params = {k: v.to(torch.float64).requires_grad_(True) for k, v in params32.items()}
        loss = pair_loss(variant, row_log_probs(params, cfg, tokens, targets), reference, lengths)
        grads = torch.autograd.grad(loss, list(params.values()))
        tensors[f"loss.{variant}"] = loss.detach().reshape(1)
        tensors.update({f"grad.{variant}.{k}": g.to(torch.float32) for k, g in zip(params, grads)})
        metadata[f"beta.{variant}"] = repr(beta)
        metadata[f"gamma.{variant}"] = repr(gamma)
    return tensors, metadata


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="output directory")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    os.makedirs(args.out, exist_ok=True)
    for name in ("gpt2_tiny", "llama_tiny"):
        tensors, metadata = build(name)
        path = os.path.join(args.out, f"{name}.safetensors")
        ref.write_safetensors(path, tensors, metadata)
        print(f"{path}: " + ", ".join(f"{v} loss {float(tensors['loss.' + v]):.6f}" for v in VARIANTS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
