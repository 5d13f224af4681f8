#!/usr/bin/python3
"""PyTorch CPU training-throughput baseline for Loom.

    /usr/bin/python3 bench/torch_train_bench.py --model {gpt2-124m,gpt2-small} \
        --batch B --seq T --steps N --warmup W --threads 2

Trains the GPT-2 definition from tools/loom_reference.py in float32 on random
tokens (one fixed batch): forward, mean cross-entropy, backward, global-norm
clipping to 1.0, torch.optim.AdamW (decay 0.1 on dim >= 2 parameters only).
Attention is masked softmax via matmul (torch 1.13 has no
F.scaled_dot_product_attention); LayerNorm/GELU/cross-entropy use the
torch.nn.functional kernels.  After W untimed warm-up steps, N steps are timed
with time.perf_counter and one JSON line is printed:

    {"impl": "pytorch", "model": ..., "tokens_per_s": B*T*N/elapsed,
     "step_ms": 1000*elapsed/N, "threads": ..., "torch_version": ..., ...}

On Debian's torch 1.13 (OpenBLAS + glibc malloc) the environment matters a lot;
for a fair baseline run it as
    env -u OPENBLAS_CORETYPE OMP_WAIT_POLICY=PASSIVE \
        LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 /usr/bin/python3 ...
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools"))
import loom_reference as ref  # noqa: E402

MODELS = {
    "gpt2-124m": ref.ModelConfig(arch="gpt2", vocab_size=50257, max_seq_len=1024, n_layer=12, n_head=12,
                                 n_kv_head=12, d_model=768, d_ff=3072),
    "gpt2-small": ref.ModelConfig(arch="gpt2", vocab_size=50257, max_seq_len=256, n_layer=6, n_head=6,
                             n_kv_head=6, d_model=384, d_ff=1536),
}


def make_optimizer(params, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    """torch.optim.AdamW, non-fused (`fused` is only passed where this torch knows it)."""
    kwargs = {"lr": lr, "betas": (0.9, 0.95), "eps": 1e-8}
    if "fused" in inspect.signature(torch.optim.AdamW.__init__).parameters:
        kwargs["fused"] = False
    return torch.optim.AdamW(ref.param_groups(params, weight_decay), **kwargs)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="PyTorch CPU training benchmark")
    ap.add_argument("--model", choices=sorted(MODELS), required=True)
    ap.add_argument("--batch", type=int, required=True)
    ap.add_argument("--seq", type=int, required=True)
    ap.add_argument("--steps", type=int, required=True, help="timed steps N")
    ap.add_argument("--warmup", type=int, default=2, help="untimed warm-up steps W")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    cfg = MODELS[args.model]
    if not 0 < args.seq <= cfg.max_seq_len:
        ap.error(f"--seq must be in [1, {cfg.max_seq_len}]")
    if args.steps < 1 or args.warmup < 0:
        ap.error("--steps must be >= 1 and --warmup >= 0")
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    P = {k: v.requires_grad_(True) for k, v in ref.init_params(cfg, seed=args.seed, dtype=torch.float32).items()}
    params = list(P.values())
    opt = make_optimizer(params, lr=3e-4, weight_decay=0.1)
    data = torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1))
    tokens, targets = data[:, :-1].contiguous(), data[:, 1:].contiguous()

    def train_step() -> float:
        opt.zero_grad(set_to_none=True)
        loss = ref.loss_fn(P, cfg, tokens, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        return float(loss)  # forces completion of the step

    for _ in range(args.warmup):
        train_step()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        loss = train_step()
    elapsed = time.perf_counter() - t0

    print(json.dumps({
        "impl": "pytorch",
        "model": args.model,
        "tokens_per_s": args.batch * args.seq * args.steps / elapsed,
        "step_ms": 1000.0 * elapsed / args.steps,
        "threads": args.threads,
        "torch_version": torch.__version__,
        "batch": args.batch,
        "seq": args.seq,
        "steps": args.steps,
        "warmup": args.warmup,
        "final_loss": loss,
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
