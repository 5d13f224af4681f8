#!/usr/bin/python3
"""PyTorch training-throughput baseline for Loom, on the CPU (default) or a CUDA GPU.

    /usr/bin/python3 bench/torch_train_bench.py --model {gpt2-124m,gpt2-small} \
        --batch B --seq T --steps N --warmup W --threads 2
    python3 bench/torch_train_bench.py --device cuda --model gpt2-124m --batch 16 --seq 1024 \
        --steps 20 --warmup 5 [--compile 1] [--flash-only 1] [--peak-tflops 989.4]

Trains the GPT-2 definition from tools/loom_reference.py (same parameters, same init) on random
tokens (one fixed batch): forward, mean cross-entropy, backward, global-norm clipping to 1.0,
torch.optim.AdamW (lr 3e-4, betas (0.9, 0.95), eps 1e-8, decay 0.1 on dim >= 2 parameters only).

--device cpu (default; unchanged from the CPU benchmark): float32, non-fused AdamW; with
--cpu-bf16 1 the forward (and so its backward) runs under torch.autocast(device_type="cpu",
dtype=torch.bfloat16): linear and matmul in bf16 through oneDNN, the rest fp32 (PyTorch's CPU AMP).
Attention is masked softmax via matmul (torch 1.13 has no F.scaled_dot_product_attention);
LayerNorm/GELU/cross-entropy use the torch.nn.functional kernels.  After W untimed warm-up
steps, N steps are timed with time.perf_counter and one JSON line is printed:

    {"impl": "pytorch", "model": ..., "tokens_per_s": B*T*N/elapsed,
     "step_ms": 1000*elapsed/N, "threads": ..., "torch_version": ..., ...}

On Debian's torch 1.13 (OpenBLAS + glibc malloc) the environment matters a lot;
for a fair baseline run it as
    env -u OPENBLAS_CORETYPE OMP_WAIT_POLICY=PASSIVE \
        LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 /usr/bin/python3 ...

--device cuda (PyTorch at its best on a GPU, torch >= 2.3): float32 master weights, the forward
under torch.autocast(device_type="cuda", dtype=torch.bfloat16); the model is an nn.Module
compiled with torch.compile (--compile 1, the default on cuda; inductor's default mode), its
loss included; attention is F.scaled_dot_product_attention(q, k, v, is_causal=True), and with
--flash-only 1 (the default on cuda) only the FlashAttention backend is allowed
(torch.nn.attention.sdpa_kernel([SDPBackend.FLASH_ATTENTION])): a probe step first asserts it
is available at this shape, and every step runs inside that context, so a fallback to another
kernel is an error, not a silent slowdown. Optimizer: torch.optim.AdamW(fused=True); clipping:
torch.nn.utils.clip_grad_norm_ (foreach). The W warm-up steps include compilation;
torch.cuda.synchronize() brackets the N timed steps (no host sync inside them), and the
peak-memory counter is reset after warm-up.
The JSON line adds: "device": "cuda", "gpu" (torch.cuda.get_device_name()), "mfu", "peak_tflops",
"achieved_tflops", "flops_per_token", "params", "matmul_params", "max_memory_allocated",
"max_memory_reserved" (bytes, timed steps), "warmup_s", "compile", "flash_only", "cuda_version".

Training FLOPs per token (the same as Loom's train_flops_per_token in
src/loom/arch/config.cpp; Kaplan et al. 2020, PaLM appendix B):

    flops_per_token = 6 N + 12 L T d

N: the parameters that take part in matmuls (matmul_param_count in config.cpp): the token
embedding / head counted once (GPT-2's head is tied to it), every block's QKV, attention output
and two MLP weight matrices; biases, LayerNorms and the position embedding are not counted.
For GPT-2 (MHA): N = V d + L (4 d^2 + 2 d F). 12 L T d counts attention scores and values over
all T keys (non-causal, as PaLM states MFU). GPT-2 124M at T = 1024: N = 123,532,032,
6N + 12LTd = 854,438,400 FLOPs per token.
    MFU = flops_per_token * tokens_per_s / (peak_tflops * 1e12)
against the stated peak (default 989.4 TFLOP/s: H100 SXM, dense bf16).
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import os
import sys
import time
import types

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools"))
try:
    import loom_reference as ref  # noqa: E402
except ModuleNotFoundError as e:
    # loom_reference imports numpy for its safetensors helpers only, which this benchmark never
    # calls; a GPU machine's pip torch may come without numpy. The stand-in is removed right
    # after the import so torch itself still sees numpy as absent.
    if e.name != "numpy":
        raise
    sys.modules["numpy"] = types.ModuleType("numpy")
    try:
        import loom_reference as ref  # noqa: E402
    finally:
        del sys.modules["numpy"]

MODELS = {
    "gpt2-124m": ref.ModelConfig(arch="gpt2", vocab_size=50257, max_seq_len=1024, n_layer=12, n_head=12,
                                 n_kv_head=12, d_model=768, d_ff=3072),
    "gpt2-small": ref.ModelConfig(arch="gpt2", vocab_size=50257, max_seq_len=256, n_layer=6, n_head=6,
                             n_kv_head=6, d_model=384, d_ff=1536),
}
H100_SXM_BF16_DENSE_TFLOPS = 989.4


def matmul_param_count(cfg: ref.ModelConfig) -> int:
    """Loom's matmul_param_count (src/loom/arch/config.cpp) for MHA/GQA models without MoE/MLA:
    V d (embedding = tied head, counted once) + L (qkv + attention output + MLP matrices)."""
    assert not cfg.mla, "MLA FLOPs are not mirrored here"
    C, hd = cfg.d_model, cfg.head_dim
    attention = (cfg.n_head + 2 * cfg.n_kv_head) * hd * C + C * cfg.n_head * hd
    mlp_in = 2 * cfg.d_ff if cfg.arch == "llama" else cfg.d_ff  # SwiGLU [gate | up] or GELU
    return cfg.vocab_size * C + cfg.n_layer * (attention + mlp_in * C + C * cfg.d_ff)


def train_flops_per_token(cfg: ref.ModelConfig, seq_len: int) -> float:
    """Loom's train_flops_per_token: 6 N + 12 L d min(T, window)."""
    span = min(seq_len, cfg.attn_window) if cfg.attn_window > 0 else seq_len
    return 6.0 * matmul_param_count(cfg) + 12.0 * cfg.n_layer * cfg.d_model * span


def make_optimizer(params, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    """torch.optim.AdamW, non-fused (`fused` is only passed where this torch knows it)."""
    kwargs = {"lr": lr, "betas": (0.9, 0.95), "eps": 1e-8}
    if "fused" in inspect.signature(torch.optim.AdamW.__init__).parameters:
        kwargs["fused"] = False
    return torch.optim.AdamW(ref.param_groups(params, weight_decay), **kwargs)


# --------------------------------------------------------------------------------------------
# CUDA: the reference GPT-2 with SDPA attention, as a module for torch.compile
# --------------------------------------------------------------------------------------------


def _gpt2_block_sdpa(x: torch.Tensor, P, i: int, cfg: ref.ModelConfig) -> torch.Tensor:
    """ref._gpt2_block with F.scaled_dot_product_attention(is_causal=True) for the attention."""
    p, C, eps = f"h.{i}.", cfg.d_model, cfg.norm_eps
    h = ref.layer_norm(x, P[p + "ln_1.weight"], P[p + "ln_1.bias"], eps)
    qkv = ref.linear(h, P[p + "attn.c_attn.weight"], P[p + "attn.c_attn.bias"])
    q, k, v = [ref.split_heads(t, cfg.n_head) for t in qkv.split(C, dim=-1)]
    att = ref.merge_heads(torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True))
    x = x + ref.linear(att, P[p + "attn.c_proj.weight"], P[p + "attn.c_proj.bias"])
    h = ref.layer_norm(x, P[p + "ln_2.weight"], P[p + "ln_2.bias"], eps)
    h = ref.gelu_tanh(ref.linear(h, P[p + "mlp.c_fc.weight"], P[p + "mlp.c_fc.bias"]))
    return x + ref.linear(h, P[p + "mlp.c_proj.weight"], P[p + "mlp.c_proj.bias"])


class GPT2SDPA(torch.nn.Module):
    """ref.gpt2_forward + ref.cross_entropy with SDPA attention; the parameters are those of
    ref.init_params (same names with '.' -> '__', same order, same values)."""

    def __init__(self, cfg: ref.ModelConfig, P) -> None:
        super().__init__()
        assert cfg.arch == "gpt2" and cfg.attn_window == 0
        self.cfg = cfg
        self.names = [(name, name.replace(".", "__")) for name in P]
        for name, attr in self.names:
            self.register_parameter(attr, torch.nn.Parameter(P[name]))

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        P = {name: getattr(self, attr) for name, attr in self.names}
        cfg, T = self.cfg, tokens.shape[1]
        x = torch.nn.functional.embedding(tokens, P["wte.weight"]) + P["wpe.weight"][:T]  # = wte[tok] + wpe[pos]
        for i in range(cfg.n_layer):
            x = _gpt2_block_sdpa(x, P, i, cfg)
        x = ref.layer_norm(x, P["ln_f.weight"], P["ln_f.bias"], cfg.norm_eps)
        return ref.cross_entropy(ref.linear(x, P["wte.weight"]), targets)  # tied head


def assert_flash_available(cfg: ref.ModelConfig, seq: int) -> None:
    """Runs one bf16 causal SDPA forward + backward at the benchmark's head shape with only the
    FlashAttention backend allowed; exits with the reason if it is not available."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    shape = (1, cfg.n_head, seq, cfg.head_dim)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    try:
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
        torch.cuda.synchronize()
    except RuntimeError as e:
        raise SystemExit(f"torch_train_bench: the FlashAttention SDPA backend is not available "
                         f"(shape {shape}, bf16, causal) on {torch.cuda.get_device_name()}: {e}")


def run_cuda(args, cfg: ref.ModelConfig) -> dict:
    if not torch.cuda.is_available():
        raise SystemExit("torch_train_bench: --device cuda but torch.cuda.is_available() is False "
                         f"(torch {torch.__version__}, built with CUDA {torch.version.cuda})")
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:
        raise SystemExit(f"torch_train_bench: --device cuda needs torch >= 2.3 (torch.nn.attention), "
                         f"this is {torch.__version__}") from None
    torch.manual_seed(args.seed)
    if args.flash_only:
        assert_flash_available(cfg, args.seq)

    dev = torch.device("cuda")
    P = ref.init_params(cfg, seed=args.seed, dtype=torch.float32)
    model = GPT2SDPA(cfg, P).to(dev)
    params = list(model.parameters())
    opt = torch.optim.AdamW(ref.param_groups(params, 0.1), lr=3e-4, betas=(0.9, 0.95), eps=1e-8, fused=True)
    step_model = torch.compile(model) if args.compile else model
    data = torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1))  # same tokens as on the CPU
    tokens, targets = data[:, :-1].to(dev), data[:, 1:].to(dev)

    def train_step() -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
            loss = step_model(tokens, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        return loss.detach()  # no host sync: read after the timed steps

    attention = sdpa_kernel([SDPBackend.FLASH_ATTENTION]) if args.flash_only else contextlib.nullcontext()
    with attention:
        t0 = time.perf_counter()
        for _ in range(args.warmup):
            train_step()
        torch.cuda.synchronize()
        warmup_s = time.perf_counter() - t0
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            loss = train_step()
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0

    tokens_per_s = args.batch * args.seq * args.steps / elapsed
    flops_per_token = train_flops_per_token(cfg, args.seq)
    achieved = flops_per_token * tokens_per_s
    return {
        "impl": "pytorch",
        "device": "cuda",
        "gpu": torch.cuda.get_device_name(),
        "model": args.model,
        "compute": "bf16-autocast",
        "tokens_per_s": tokens_per_s,
        "step_ms": 1000.0 * elapsed / args.steps,
        "mfu": achieved / (args.peak_tflops * 1e12),
        "peak_tflops": args.peak_tflops,
        "achieved_tflops": achieved / 1e12,
        "flops_per_token": flops_per_token,
        "params": sum(p.numel() for p in params),
        "matmul_params": matmul_param_count(cfg),
        "max_memory_allocated": torch.cuda.max_memory_allocated(),
        "max_memory_reserved": torch.cuda.max_memory_reserved(),
        "warmup_s": warmup_s,
        "compile": bool(args.compile),
        "flash_only": bool(args.flash_only),
        "torch_version": torch.__version__,
        "cuda_version": torch.version.cuda,
        "batch": args.batch,
        "seq": args.seq,
        "steps": args.steps,
        "warmup": args.warmup,
        "final_loss": float(loss),
    }


def add_lora(P, cfg: ref.ModelConfig, r: int, dora: bool = False) -> list:
    """LoRA (Hu et al. 2021) on each block's four linear layers (GPT-2: c_attn, attn.c_proj, c_fc,
    mlp.c_proj), as PEFT's LoraLayer computes it: y = W x + b + s B (A x), s = 2r / r = 2, A
    Kaiming-uniform, B zero; the base frozen. With dora, PEFT's DoraLinearLayer (Liu et al. 2024):
    a magnitude m = ||W_j|| per row and y = W x + b + (g - 1) W x + g s B A x, g = m / ||W + s B A||
    (the norm detached; W x reused from the base output, as PEFT does without dropout).
    Installed by wrapping the reference model's `linear`. Returns the adapters (what the optimizer
    updates)."""
    adapters, params = {}, []
    for name, w in P.items():
        if name.startswith("h.") and name.endswith((".c_attn.weight", ".c_proj.weight", ".c_fc.weight")):
            a = torch.empty(r, w.shape[1])
            torch.nn.init.kaiming_uniform_(a, a=5 ** 0.5)
            b = torch.zeros(w.shape[0], r)
            m = w.detach().norm(p=2, dim=1).requires_grad_(True) if dora else None
            adapters[w.data_ptr()] = (a.requires_grad_(True), b.requires_grad_(True), m)
            params += [a, b] + ([m] if dora else [])
    base = ref.linear

    def lora_linear(x, w, bias=None):
        y = base(x, w, bias)
        ab = adapters.get(w.data_ptr())
        if ab is None:
            return y
        lora = torch.nn.functional.linear(torch.nn.functional.linear(x, ab[0]), ab[1])
        if ab[2] is None:
            return y + 2.0 * lora
        gain = ab[2] / (w + 2.0 * (ab[1] @ ab[0])).norm(p=2, dim=1).detach()
        base_out = y - bias if bias is not None else y
        return y + (gain - 1) * base_out + gain * (2.0 * lora)

    ref.linear = lora_linear
    return params


def max_rss_bytes() -> int:
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# --------------------------------------------------------------------------------------------
# CPU: float32, as the CPU benchmark has always measured it
# --------------------------------------------------------------------------------------------


def run_cpu(args, cfg: ref.ModelConfig) -> dict:
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    P = {k: v.requires_grad_(args.lora == 0) for k, v in ref.init_params(cfg, seed=args.seed, dtype=torch.float32).items()}
    params = list(P.values())
    if args.lora > 0:  # LoRA as PEFT computes it: y = W x + s B (A x) on every block linear, W frozen
        params = add_lora(P, cfg, args.lora, args.dora)
    opt = make_optimizer(params, lr=3e-4, weight_decay=0.1)
    data = torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1))
    tokens, targets = data[:, :-1].contiguous(), data[:, 1:].contiguous()

    autocast = (torch.autocast(device_type="cpu", dtype=torch.bfloat16) if args.cpu_bf16
                else contextlib.nullcontext())

    def train_step() -> float:
        opt.zero_grad(set_to_none=True)
        with autocast:
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

    return {
        "impl": "pytorch",
        "model": args.model,
        "compute": "bf16-autocast" if args.cpu_bf16 else "f32",
        "tokens_per_s": args.batch * args.seq * args.steps / elapsed,
        "step_ms": 1000.0 * elapsed / args.steps,
        "threads": args.threads,
        "torch_version": torch.__version__,
        "batch": args.batch,
        "seq": args.seq,
        "steps": args.steps,
        "warmup": args.warmup,
        "final_loss": loss,
        "lora": args.lora,
        "max_rss": max_rss_bytes(),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="PyTorch training benchmark (CPU or CUDA)")
    ap.add_argument("--model", choices=sorted(MODELS), required=True)
    ap.add_argument("--batch", type=int, required=True)
    ap.add_argument("--seq", type=int, required=True)
    ap.add_argument("--steps", type=int, required=True, help="timed steps N")
    ap.add_argument("--warmup", type=int, default=2, help="untimed warm-up steps W (on cuda they include compilation)")
    ap.add_argument("--threads", type=int, default=2, help="CPU threads (--device cpu)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lora", type=int, default=0, help="> 0: LoRA of this rank on the block linears, the base frozen (cpu)")
    ap.add_argument("--dora", type=int, default=0, help="1: with --lora, DoRA's magnitudes (PEFT's use_dora)")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--cpu-bf16", type=int, choices=[0, 1], default=0,
                    help="cpu: the forward under torch.autocast(device_type='cpu', dtype=torch.bfloat16)")
    ap.add_argument("--compile", type=int, choices=[0, 1], default=None,
                    help="torch.compile the model (cuda only; default 1 on cuda)")
    ap.add_argument("--flash-only", type=int, choices=[0, 1], default=None,
                    help="allow only the FlashAttention SDPA backend and assert it is available "
                         "(cuda only; default 1 on cuda)")
    ap.add_argument("--peak-tflops", type=float, default=None,
                    help=f"peak TFLOP/s that MFU is stated against (cuda only; default "
                         f"{H100_SXM_BF16_DENSE_TFLOPS}, H100 SXM dense bf16)")
    args = ap.parse_args(argv)

    cfg = MODELS[args.model]
    if not 0 < args.seq <= cfg.max_seq_len:
        ap.error(f"--seq must be in [1, {cfg.max_seq_len}]")
    if args.steps < 1 or args.warmup < 0:
        ap.error("--steps must be >= 1 and --warmup >= 0")
    if args.device == "cpu":
        if args.compile or args.flash_only or args.peak_tflops is not None:
            ap.error("--compile, --flash-only and --peak-tflops apply to --device cuda only")
        result = run_cpu(args, cfg)
    else:
        args.compile = 1 if args.compile is None else args.compile
        args.flash_only = 1 if args.flash_only is None else args.flash_only
        args.peak_tflops = H100_SXM_BF16_DENSE_TFLOPS if args.peak_tflops is None else args.peak_tflops
        if args.peak_tflops <= 0:
            ap.error("--peak-tflops must be > 0")
        result = run_cuda(args, cfg)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
