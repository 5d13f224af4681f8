#!/usr/bin/python3
"""Generate the Loom reference fixtures.

    /usr/bin/python3 tools/make_fixtures.py --out DIR [--check]

writes DIR/gpt2_tiny.safetensors, DIR/llama_tiny.safetensors,
DIR/llama_tiny_window.safetensors (llama_tiny with model.attn_window = 3) and
DIR/llama_tiny_mla{,_q}.safetensors (llama_tiny with Multi-head Latent Attention, without and
with query compression).  Each holds:

    <param name>   F32   initial parameters (float32 values, see init_params)
    tokens         I32   (B, T) uniform in [0, V)
    targets        I32   (B, T) uniform in [0, V)
    logits         F32   (B, T, V) forward pass at the initial parameters
    loss           F64   (1,)      mean cross-entropy over B*T positions
    grad.<name>    F32   d loss / d param at the initial parameters
    losses         F64   (S,)      loss before each of the S AdamW steps
    final.<name>   F32   parameters after the S steps

and `__metadata__` with the model config, batch, seq_len and optimizer settings
as strings.  All math runs in float64; only storage is float32.  Output is
deterministic (byte-identical across runs).

--check additionally verifies, in float64: vectorised forward == naive loop
forward, autograd == finite differences, hand AdamW == torch.optim.AdamW,
safetensors round trip and byte-identical regeneration.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Dict, Tuple

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import loom_reference as ref  # noqa: E402

SEED = 1234
OPTIM = ref.OptimConfig()  # S=10, max_lr=3e-3, min_lr=3e-4, warmup=3, ...

# name -> (model config, batch B, sequence length T)
FIXTURES: Dict[str, Tuple[ref.ModelConfig, int, int]] = {
    "gpt2_tiny": (
        ref.ModelConfig(arch="gpt2", vocab_size=97, max_seq_len=16, n_layer=2, n_head=4, n_kv_head=4, d_model=32, d_ff=128),
        2,
        13,
    ),
    "llama_tiny": (
        ref.ModelConfig(arch="llama", vocab_size=101, max_seq_len=16, n_layer=2, n_head=6, n_kv_head=2, d_model=48, d_ff=80),
        2,
        11,
    ),
    # llama_tiny with a sliding window of 3 positions, smaller than T = 11.
    "llama_tiny_window": (
        ref.ModelConfig(arch="llama", vocab_size=101, max_seq_len=16, n_layer=2, n_head=6, n_kv_head=2, d_model=48, d_ff=80,
                        attn_window=3),
        2,
        11,
    ),
    # llama_tiny with Multi-head Latent Attention (DeepSeek-V2 §2.1): d_c 16, d_r 4, d_n 8, d_v 8,
    # queries projected directly; the _q variant compresses them too (d_q 12) and adds a window.
    "llama_tiny_mla": (
        ref.ModelConfig(arch="llama", vocab_size=101, max_seq_len=16, n_layer=2, n_head=6, n_kv_head=6, d_model=48, d_ff=80,
                        mla_kv_rank=16, mla_rope_dim=4, mla_nope_dim=8, mla_v_dim=8),
        2,
        11,
    ),
    "llama_tiny_mla_q": (
        ref.ModelConfig(arch="llama", vocab_size=101, max_seq_len=16, n_layer=2, n_head=6, n_kv_head=6, d_model=48, d_ff=80,
                        attn_window=4, mla_kv_rank=16, mla_rope_dim=4, mla_nope_dim=6, mla_v_dim=10, mla_q_rank=12),
        2,
        11,
    ),
}

# Parameters whose gradients --check verifies by finite differences.
FD_PARAMS = {
    "gpt2_tiny": ["wte.weight", "wpe.weight", "h.0.attn.c_attn.weight", "h.0.attn.c_attn.bias",
                  "h.1.ln_2.weight", "h.1.mlp.c_fc.bias", "ln_f.bias"],
    "llama_tiny": ["model.embed_tokens.weight", "model.layers.0.self_attn.qkv_proj.weight",
                   "model.layers.1.input_layernorm.weight", "model.layers.1.mlp.gate_up_proj.weight",
                   "model.norm.weight", "lm_head.weight"],
    "llama_tiny_window": ["model.embed_tokens.weight", "model.layers.0.self_attn.qkv_proj.weight",
                          "model.layers.1.input_layernorm.weight", "model.norm.weight"],
    "llama_tiny_mla": ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.kv_a_proj_with_mqa.weight",
                       "model.layers.0.self_attn.kv_a_layernorm.weight", "model.layers.1.self_attn.kv_b_proj.weight",
                       "model.layers.1.self_attn.o_proj.weight"],
    "llama_tiny_mla_q": ["model.layers.0.self_attn.q_a_proj.weight", "model.layers.0.self_attn.q_a_layernorm.weight",
                         "model.layers.1.self_attn.q_b_proj.weight", "model.layers.0.self_attn.kv_a_proj_with_mqa.weight",
                         "model.layers.1.self_attn.kv_b_proj.weight"],
}


def make_batch(cfg: ref.ModelConfig, B: int, T: int, seed: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """tokens, targets: int32 (B, T), uniform in [0, V), from a fixed generator."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab_size, (B, T), generator=gen, dtype=torch.int64).to(torch.int32)
    targets = torch.randint(0, cfg.vocab_size, (B, T), generator=gen, dtype=torch.int64).to(torch.int32)
    return tokens, targets


def build_fixture(name: str, check: bool = False):
    """Compute every tensor of one fixture. Returns (tensors, metadata)."""
    cfg, B, T = FIXTURES[name]
    params32 = ref.init_params(cfg, seed=SEED)
    params64 = {k: v.to(torch.float64) for k, v in params32.items()}
    tokens, targets = make_batch(cfg, B, T, seed=SEED + 1)

    with torch.no_grad():
        logits = ref.forward(params64, cfg, tokens)
    loss, grads = ref.loss_and_grads(params64, cfg, tokens, targets)
    if check:
        ref.self_check_forward(params64, cfg, tokens, targets)
        ref.self_check_grads(params64, cfg, tokens, targets, FD_PARAMS[name])
        losses, final = ref.self_check_optimizer(params32, cfg, tokens, targets, OPTIM)
    else:
        losses, final = ref.train(params32, cfg, tokens, targets, OPTIM)
    assert abs(losses[0] - float(loss)) < 1e-12

    tensors: Dict[str, torch.Tensor] = dict(params32)
    tensors["tokens"] = tokens
    tensors["targets"] = targets
    tensors["logits"] = logits.to(torch.float32)
    tensors["loss"] = loss.reshape(1).to(torch.float64)
    tensors.update({f"grad.{k}": g.to(torch.float32) for k, g in grads.items()})
    tensors["losses"] = torch.tensor(losses, dtype=torch.float64)
    tensors.update({f"final.{k}": p.to(torch.float32) for k, p in final.items()})

    metadata = cfg.metadata()
    metadata.update({"batch": str(B), "seq_len": str(T)})
    metadata.update(OPTIM.metadata())
    return tensors, metadata


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--check", action="store_true", help="run the float64 self-checks")
    args = ap.parse_args(argv)

    torch.set_num_threads(1)  # fixed reduction order -> byte-identical output
    torch.use_deterministic_algorithms(True)
    os.makedirs(args.out, exist_ok=True)
    if args.check:
        ref.self_check_schedule(OPTIM)

    for name in FIXTURES:
        t0 = time.perf_counter()
        tensors, metadata = build_fixture(name, check=args.check)
        path = os.path.join(args.out, f"{name}.safetensors")
        ref.write_safetensors(path, tensors, metadata)
        if args.check:
            with open(path, "rb") as f:
                blob = f.read()
            ref.self_check_safetensors_roundtrip(tensors, metadata, blob)
            again, again_meta = build_fixture(name)
            assert ref.encode_safetensors(again, again_meta) == blob, f"{name}: regeneration not byte-identical"
        losses = tensors["losses"]
        print(f"{path}: {os.path.getsize(path)} bytes, loss {float(tensors['loss']):.6f}, "
              f"losses[0]={float(losses[0]):.6f} losses[-1]={float(losses[-1]):.6f}, "
              f"{time.perf_counter() - t0:.2f}s" + (" [checks passed]" if args.check else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
