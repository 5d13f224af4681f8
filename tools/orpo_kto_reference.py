#!/usr/bin/python3
"""PyTorch references of ORPO and KTO as TRL computes them, for Loom's tests (tests/test_orpo_kto.cpp).

    /usr/bin/python3 tools/orpo_kto_reference.py --out tests/fixtures/orpo_kto

For a tiny GPT-2 and a tiny Llama (loom_reference.py's models), writes <arch>.safetensors holding

    <param name>            F32  the policy's parameters (init_params below, seed SEED)
    reference.<param name>  F32  a second initialisation (seed SEED + 1): KTO's reference model
    orpo.tokens, .targets   I32  (4, T)  Loom's rows: pair 0's chosen and rejected sequences, then
                                 pair 1's; a prompt's targets and a row's padding are -100
    loss.orpo               F64  (1,)  ORPO's loss (beta = metadata orpo.beta)
    grad.orpo.<name>        F32  its gradient with respect to each parameter
    metrics.orpo            F64  (7,)  nll_loss, rewards chosen, rejected, margin, accuracy,
                                 log_odds_ratio, log_odds_chosen (TRL's metric means)
    loss.orpo.summed        F64  (1,)  the same loss with summed instead of averaged
                                 log-probabilities: a broken variant the test must tell apart
    kto.tokens, .targets    I32  (8, T)  rows 0..3 the examples, rows 4..7 the mismatched
                                 sequences (example i's prompt, example i - 1's completion)
    kto.labels              I32  (4,)  1: desirable
    loss.<v>                F64  (1,)  KTO's loss, for v = kto (policy: the parameters, reference:
                                 reference.*) and kto_swapped (the two exchanged)
    grad.<v>.<name>         F32  its gradient with respect to each policy parameter
    kto.<v>.z0              F64  (2,)  the KL estimate before and after the clamp at 0
    loss.<v>.noclamp        F64  (1,)  the loss with z0 not clamped: a broken variant

with beta and the weights in the metadata. Everything is computed in float64 with autograd, the
batches laid out and the losses written from TRL's formulas (ORPOTrainer's odds_ratio_loss and
get_batch_logps with average_log_prob=True; KTOTrainer's loss_type "kto"): nothing imports trl.
Each TRL batch holds input ids and labels of length T + 1 and shifts them inside, as TRL does;
Loom's rows are the same batch shifted once (tokens = ids[:, :T], targets = labels[:, 1:]).

One difference from TRL is kept on purpose, as Loom implements it (train/orpo.h): ORPO's NLL is
the cross-entropy of the chosen completions' tokens, where TRL's also counts the prompt's.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import loom_reference as ref  # noqa: E402

SEED = 11  # chosen so that z0 < 0 before the clamp for `kto` in both models (and > 0 for kto_swapped)
SPREAD = 10.0  # init_params' widening of loom_reference's initialisation
T = 12  # Loom's row length; TRL's sequences are T + 1 tokens
PAD = 0
MODELS = {
    "gpt2": ref.ModelConfig(arch="gpt2", vocab_size=61, max_seq_len=16, n_layer=2, n_head=2, n_kv_head=2, d_model=16,
                            d_ff=32),
    "llama": ref.ModelConfig(arch="llama", vocab_size=67, max_seq_len=16, n_layer=2, n_head=4, n_kv_head=2, d_model=16,
                             d_ff=24),
}
# ORPO: two pairs (prompt, chosen, rejected) of these lengths (a completion's tokens count its end).
ORPO_PAIRS = [(3, 6, 4), (5, 4, 7)]
ORPO_BETA = 0.1  # TRL ORPOConfig's default
# KTO: four examples (prompt, completion, desirable); the mismatched sequences fit T + 1 tokens.
KTO_EXAMPLES = [(3, 5, True), (4, 3, False), (2, 7, False), (5, 4, True)]
KTO_BETA, KTO_DESIRABLE, KTO_UNDESIRABLE = 0.1, 1.0, 1.25


def sequences(gen: torch.Generator, vocab: int, lengths):
    """Random token lists of the given lengths (ids 1 .. vocab - 1: 0 is the padding)."""
    return [torch.randint(1, vocab, (n,), generator=gen).tolist() for n in lengths]


def trl_rows(prompts, completions):
    """TRL's padded batch: input ids and labels (B, T + 1), the prompt and the padding -100 in the labels."""
    ids = torch.full((len(prompts), T + 1), PAD, dtype=torch.int64)
    labels = torch.full((len(prompts), T + 1), -100, dtype=torch.int64)
    for r, (p, c) in enumerate(zip(prompts, completions)):
        seq = p + c
        assert len(seq) <= T + 1, "a sequence longer than the fixture's rows"
        ids[r, : len(seq)] = torch.tensor(seq)
        labels[r, len(p) : len(seq)] = torch.tensor(c)
    return ids, labels


def loom_rows(ids, labels):
    """The same batch as Loom's rows: tokens (B, T) and next-token targets (B, T)."""
    return ids[:, :T].to(torch.int32), labels[:, 1:].to(torch.int32)


def batch_logps(logits, labels, average: bool):
    """TRL's get_batch_logps: shift, mask -100, sum (or average over the counted labels)."""
    labels = labels[:, 1:]
    logits = logits[:, :-1, :]
    mask = labels != -100
    picked = torch.log_softmax(logits, dim=-1).gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    summed = (picked * mask).sum(-1)
    return summed / mask.sum(-1) if average else summed


def log1mexp(x):
    """log(1 - exp(x)) for x < 0, split at -ln 2 as TRL's log1mexp."""
    return torch.where(x < -0.6931471805599453, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def orpo_loss(params, cfg, ids, labels, n_pairs: int, average: bool = True):
    """ORPO over TRL's concatenated batch (the chosen rows, then the rejected ones): loss and metrics."""
    logits = ref.forward(params, cfg, ids)
    chosen_logits, chosen_labels = logits[:n_pairs], labels[:n_pairs]
    # The chosen completions' NLL: one cross-entropy over every counted chosen label (TRL's
    # CrossEntropyLoss over the chosen rows; TRL's labels there also count the prompt, Loom's not).
    nll = F.cross_entropy(chosen_logits[:, :-1].reshape(-1, cfg.vocab_size), chosen_labels[:, 1:].reshape(-1),
                          ignore_index=-100)
    logps = batch_logps(logits, labels, average)
    lw, ll = logps[:n_pairs], logps[n_pairs:]
    log_odds = (lw - ll) - (log1mexp(lw) - log1mexp(ll))  # eqs. 4 and 7
    ratio = F.logsigmoid(log_odds)
    loss = nll - (ORPO_BETA * ratio).mean()
    rw, rl = ORPO_BETA * lw.detach(), ORPO_BETA * ll.detach()
    metrics = torch.stack([nll.detach(), rw.mean(), rl.mean(), (rw - rl).mean(), (rw > rl).double().mean(),
                           ratio.detach().mean(), log_odds.detach().mean()])
    return loss, metrics


def kto_loss(policy, reference, cfg, ids, labels, desirable, n: int, clamp: bool = True):
    """KTO (loss_type "kto") over the examples (rows < n) and their mismatched sequences (rows >= n)."""
    logps = batch_logps(ref.forward(policy, cfg, ids[:n]), labels[:n], False)
    with torch.no_grad():  # TRL: the mismatched sequences' policy log-probabilities, and every reference one
        kl_logps = batch_logps(ref.forward(policy, cfg, ids[n:]), labels[n:], False)
        ref_logps = batch_logps(ref.forward(reference, cfg, ids[:n]), labels[:n], False)
        ref_kl_logps = batch_logps(ref.forward(reference, cfg, ids[n:]), labels[n:], False)
    raw = (kl_logps - ref_kl_logps).mean().detach()
    z0 = raw.clamp(min=0) if clamp else raw
    ratio = logps - ref_logps
    chosen = KTO_DESIRABLE * (1 - torch.sigmoid(KTO_BETA * (ratio[desirable] - z0)))
    rejected = KTO_UNDESIRABLE * (1 - torch.sigmoid(KTO_BETA * (z0 - ratio[~desirable])))
    return torch.cat([chosen, rejected]).mean(), torch.stack([raw, raw.clamp(min=0)])


def init_params(cfg: ref.ModelConfig, seed: int):
    """loom_reference's initialisation with the matrices and biases SPREAD times wider (std 0.2): the
    tiny models' distributions are then far from uniform, so the two models' log-probabilities, and
    the pairs' and examples' terms, differ by more than a rounding."""
    params = ref.init_params(cfg, seed=seed)
    kinds = {name: kind for name, _, kind in ref.param_specs(cfg)}
    return {k: v * SPREAD if kinds[k] != "norm" else v for k, v in params.items()}


def with_grad(params32):
    return {k: v.to(torch.float64).requires_grad_(True) for k, v in params32.items()}


def build(cfg: ref.ModelConfig):
    policy32 = init_params(cfg, SEED)
    reference32 = init_params(cfg, SEED + 1)
    gen = torch.Generator().manual_seed(SEED)
    tensors = dict(policy32)
    tensors.update({f"reference.{k}": v for k, v in reference32.items()})
    metadata = cfg.metadata()

    # ORPO: TRL's batch is [chosen 0, chosen 1, rejected 0, rejected 1]; Loom's rows interleave them.
    prompts = sequences(gen, cfg.vocab_size, [p for p, _, _ in ORPO_PAIRS])
    chosen = sequences(gen, cfg.vocab_size, [c for _, c, _ in ORPO_PAIRS])
    rejected = sequences(gen, cfg.vocab_size, [r for _, _, r in ORPO_PAIRS])
    ids, labels = trl_rows(prompts + prompts, chosen + rejected)
    n_pairs = len(ORPO_PAIRS)
    order = [i // 2 + (i % 2) * n_pairs for i in range(2 * n_pairs)]  # Loom's row r is TRL's row order[r]
    tensors["orpo.tokens"], tensors["orpo.targets"] = loom_rows(ids[order], labels[order])
    params = with_grad(policy32)
    loss, metrics = orpo_loss(params, cfg, ids, labels, n_pairs)
    grads = torch.autograd.grad(loss, list(params.values()))
    tensors["loss.orpo"] = loss.detach().reshape(1)
    tensors["metrics.orpo"] = metrics
    tensors.update({f"grad.orpo.{k}": g.to(torch.float32) for k, g in zip(params, grads)})
    with torch.no_grad():
        summed = orpo_loss(with_grad(policy32), cfg, ids, labels, n_pairs, average=False)[0]
    tensors["loss.orpo.summed"] = summed.reshape(1)
    metadata["orpo.beta"] = repr(ORPO_BETA)

    # KTO: the examples, then each one's mismatched sequence (TRL's rotation of the completions by one).
    n = len(KTO_EXAMPLES)
    prompts = sequences(gen, cfg.vocab_size, [p for p, _, _ in KTO_EXAMPLES])
    completions = sequences(gen, cfg.vocab_size, [c for _, c, _ in KTO_EXAMPLES])
    rotated = [completions[-1]] + completions[:-1]
    ids, labels = trl_rows(prompts + prompts, completions + rotated)
    desirable = torch.tensor([d for _, _, d in KTO_EXAMPLES])
    tensors["kto.tokens"], tensors["kto.targets"] = loom_rows(ids, labels)
    tensors["kto.labels"] = desirable.to(torch.int32)
    for variant, (pol32, ref32) in {"kto": (policy32, reference32), "kto_swapped": (reference32, policy32)}.items():
        params = with_grad(pol32)
        reference = {k: v.to(torch.float64) for k, v in ref32.items()}
        loss, z0 = kto_loss(params, reference, cfg, ids, labels, desirable, n)
        grads = torch.autograd.grad(loss, list(params.values()))
        tensors[f"loss.{variant}"] = loss.detach().reshape(1)
        tensors[f"kto.{variant}.z0"] = z0
        tensors.update({f"grad.{variant}.{k}": g.to(torch.float32) for k, g in zip(params, grads)})
        with torch.no_grad():
            broken = kto_loss(with_grad(pol32), reference, cfg, ids, labels, desirable, n, clamp=False)[0]
        tensors[f"loss.{variant}.noclamp"] = broken.reshape(1)
    metadata.update({"kto.beta": repr(KTO_BETA), "kto.desirable_weight": repr(KTO_DESIRABLE),
                     "kto.undesirable_weight": repr(KTO_UNDESIRABLE)})
    return tensors, metadata


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="output directory (the committed fixtures: tests/fixtures/orpo_kto)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    os.makedirs(args.out, exist_ok=True)
    for name, cfg in MODELS.items():
        tensors, metadata = build(cfg)
        path = os.path.join(args.out, f"{name}.safetensors")
        ref.write_safetensors(path, tensors, metadata)
        value = lambda key: f"{float(tensors[key][0]):.6f}"  # noqa: E731
        line = f"{path}: orpo loss {value('loss.orpo')} (summed {value('loss.orpo.summed')})"
        for v in ("kto", "kto_swapped"):
            z0 = [round(float(x), 4) for x in tensors[f"kto.{v}.z0"]]
            line += f", {v} loss {value('loss.' + v)} (no clamp {value('loss.' + v + '.noclamp')}, z0 {z0})"
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
