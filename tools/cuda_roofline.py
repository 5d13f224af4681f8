#!/usr/bin/env python3
"""Roofline estimate of a training step of Loom's CUDA backend on one H100 SXM, kernel by kernel:
the figures `scripts/gpu_check` is to confirm or refute (docs/cuda.md "Expected speed").

    tools/cuda_roofline.py                 # GPT-2 124M (B 16, T 1024) and a Llama-3-8B layer
    tools/cuda_roofline.py --markdown      # the tables docs/cuda.md shows

Each kernel's time is max(FLOPs / peak, bytes / bandwidth) with the H100 SXM's datasheet figures:
3.35 TB/s HBM3, 989.4 TFLOP/s dense bf16 (tensor cores), 66.9 TFLOP/s fp32 (CUDA cores), 494.7
TFLOP/s tf32. Two derating assumptions, stated because a GPU run has not measured them: a
memory-bound kernel reaches 80% of the bandwidth, a cuBLASLt GEMM 70% of the tensor-core peak
(d_model 768 GEMMs are small for Hopper's 132 SMs), and a CUDA-core kernel 50% of the fp32 peak.
Three designs are estimated:
  built:    what the backend does with precision.compute = bf16 (precision.activations and
            precision.outputs = bf16, the defaults): the residual stream, the GEMM outputs but fc's
            and the logits, and the gradients in fp32; fc's output in bf16; the GEMMs' saved
            inputs (the norms' outputs, the MLP activation) and the MLP's first GEMM's output
            gradient written in bf16 by the kernels that produce them, and the output GEMMs' (the
            residual stream's gradient, kept fp32) rounded to bf16 by the norm backward that
            finalises it (one 2-byte store an element more); GPT-2's GELU in its GEMMs' cuBLASLt
            epilogues (GELU_AUX_BIAS writes the activation beside fc's output, DGELU writes
            d(fc output) from fc2's dX: no GELU kernels; Llama's SwiGLU keeps its two); a bf16
            copy (a cast kernel) of the QKV GEMM's output gradient, and of the
            attention output (fp32 here) for its projection; flash attention on CUDA cores
            (FlashAttention-2's loop in fp32 FMAs), bf16 logits (precision.logits = bf16, the default:
            the head's GEMM writes them rounded, the loss writes d(logits) over them), AdamW reading
            and writing fp32 state;
  built-tc: the same with precision.attention = bf16 (the benchmark's setting): flash attention on
            tensor cores (cuda_flash_mma.cu: mma.sync m16n8k16, fragments by ldmatrix, 16-byte
            tile loads, and for bf16 inputs the next tile's cp.async copies in flight where two buffers fit),
            assumed to reach 150 TFLOP/s, 15% of the dense peak (its author's estimate: 100-200;
            the first form, without ldmatrix, vector loads or pipelining, measured 39 on an H200),
            which writes the attention output in bf16 itself (no copy), reads qkv in bf16 where
            no RoPE sits after the QKV projection (GPT-2: the GEMM writes it so) and dO in bf16
            (the output projection's dX), and writes d(qkv) in bf16 where no RoPE sits before
            the QKV projection (GPT-2);
  target:   bf16 activations end to end, attention on tensor cores tuned (wgmma, TMA) to 50% of the
            peak (FlashAttention-3 reports 60-75% forward on H100), the cross-entropy reading the
            bf16 logits once.
MFU counts the model's FLOPs (6 N per token for the weights' GEMMs plus attention's 6 T d per
token per layer, causal halved as in PaLM's appendix B) against the bf16 peak.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

HBM = 3.35e12
BF16 = 989.4e12
FP32 = 66.9e12
MEM_EFF, GEMM_EFF, CORE_EFF = 0.80, 0.70, 0.50
ATTN_EFF = {"built-tc": 150e12 / BF16, "target": 0.50}  # tensor-core attention's share of the peak


def peak_of(unit: str) -> float:
    if unit.startswith("attn-"):
        return BF16 * ATTN_EFF[unit[5:]]
    return {"tensor": BF16 * GEMM_EFF, "fp32": FP32 * CORE_EFF, "mem": float("inf")}[unit]


@dataclass
class Kernel:
    name: str
    flops: float
    bytes: float
    unit: str  # "tensor", "fp32", "mem", or "attn-<design>" (tensor-core attention)
    count: int = 1  # launches per step

    def seconds(self) -> float:
        peak = peak_of(self.unit)
        return self.count * max(self.flops / peak, self.bytes / (HBM * MEM_EFF))


@dataclass
class Model:
    name: str
    tokens: int  # B * T per step
    seq: int
    d: int
    heads: int
    kv_heads: int
    ff: int  # MLP hidden (SwiGLU: the gate and the up projection each ff wide)
    layers: int
    vocab: int
    swiglu: bool
    params: float  # total parameters (for the optimizer)

    @property
    def hd(self) -> int:
        return self.d // self.heads


def layer_kernels(m: Model, design: str) -> list[Kernel]:
    n, d, ff = m.tokens, m.d, m.ff
    built = design.startswith("built")
    act = 4 if built else 2  # bytes per activation element
    qkv = d + 2 * m.kv_heads * m.hd
    mlp_in = 2 * ff if m.swiglu else ff
    ks: list[Kernel] = []
    # Norms: forward reads x, writes out in bf16 (the GEMM's saved input, every design).
    for which in ("attention norm", "mlp norm"):
        ks.append(Kernel(f"{which} fwd", 8 * n * d, n * d * (act + 2), "mem"))
        # (reads dout and x, adds its dx into the residual stream's gradient: read + write; in the
        # built designs also its bf16 rounding, the output GEMMs' dy: proj's from the MLP's norm, the
        # block before's fc2's from the attention's (the last block's from the final norm, not listed))
        ks.append(Kernel(f"{which} bwd (+= d(residual)" + (", its bf16 copy)" if built else ")"), 12 * n * d,
                         n * d * 4 * act + (2 * n * d if built else 0), "mem"))
    # GEMMs: forward, and the backward's two (dX and dW).
    for name, k, out in (("qkv", d, qkv), ("attention out", d, d), ("mlp in", d, mlp_in), ("mlp out", ff, d)):
        f = 2 * n * k * out
        # (mlp in writes its output in bf16: precision.outputs = bf16, LayerPlan::fc_bf16; so does
        # qkv where the tensor-core flash attention reads it with no RoPE between: qkv_bf16)
        out16 = name == "mlp in" or (name == "qkv" and design == "built-tc" and not m.swiglu)
        io = 2 * (n * k + k * out) + (2 if out16 else act) * n * out
        # The output projections add onto the residual stream: cuBLASLt reads it as C (GemmSpec::c_in)
        residual = act * n * out if name in ("attention out", "mlp out") else 0
        # GELU in the epilogues (LayerPlan::fc_gelu / fc2_dgelu: cuBLASLt's GELU_AUX_BIAS writes the
        # activation beside fc's output; DGELU reads fc's output and writes d(fc output) in bf16)
        gelu_fwd = 2 * n * out if name == "mlp in" and not m.swiglu else 0
        gelu_bwd = 2 * n * k if name == "mlp out" and not m.swiglu else 0
        fwd_name = f"{name} GEMM fwd" + (" (+ the residual)" if residual else "") + (" (+ GELU)" if gelu_fwd else "")
        ks.append(Kernel(fwd_name, f, io + residual + gelu_fwd, "tensor"))
        bwd_name = f"{name} GEMM bwd (dX" + (" through GELU'" if gelu_bwd else "") + ", dW)"
        ks.append(Kernel(bwd_name, 2 * f, 2 * io + 4 * k * out + gelu_bwd, "tensor"))
        # (mlp in's comes from the activation's backward in bf16; qkv's from the tensor-core flash
        # backward where no RoPE sits between them: GPT-2 under built-tc; the output GEMMs' from the
        # norms' backward above: LayerPlan::proj_dy_bf16 / fc2_dy_bf16)
        bf16_dy = name in ("mlp in", "attention out", "mlp out") or (name == "qkv" and design == "built-tc" and not m.swiglu)
        if built and not bf16_dy:  # the fp32 d(output) read, its bf16 copy written, for dX and dW
            ks.append(Kernel(f"{name}: bf16 copy of d(output)", 0, n * out * 6, "mem"))
        if design == "built" and name == "attention out":  # an fp32 O, copied for the forward and for dW
            ks.append(Kernel(f"{name}: bf16 copies of the attention output", 0, 2 * n * k * 6, "mem"))
    # Attention: causal, so half the T x T scores; forward QK^T and PV, backward four products.
    att = 4 * n * m.seq * d / 2
    o_bytes = act if design == "built" else 2  # O in bf16 from the tensor-core kernels
    if design == "built":
        io_flash = act * n * (qkv + d) + o_bytes * n * d
        ks.append(Kernel("flash attention fwd (CUDA cores)", att, io_flash, "fp32"))
        ks.append(Kernel("flash attention bwd (CUDA cores)", 2.5 * att, 2 * io_flash, "fp32"))
    else:  # the mma.sync kernels' backward makes 7 products (dQ in its own pass), FA2's 5
        bwd = 3.5 if design == "built-tc" else 2.5
        qkv_b = 2  # (Llama: RoPE's fp32 staging rounded into the bf16 record, a copy below)
        dqkv_b = act if design == "built-tc" and m.swiglu else 2  # (RoPE's backward reads fp32)
        fwd_io = qkv_b * n * qkv + 2 * n * d  # qkv read, O written in bf16 (and lse)
        bwd_io = qkv_b * n * qkv + 2 * n * d + 2 * n * d + dqkv_b * n * qkv  # qkv, O, dO read; dqkv written
        ks.append(Kernel("flash attention fwd (tensor cores)", att, fwd_io, f"attn-{design}"))
        ks.append(Kernel("flash attention bwd (tensor cores)", bwd * att, bwd_io, f"attn-{design}"))
    if m.swiglu:  # Llama: RoPE on q and k, in place, forward and backward
        ks.append(Kernel("RoPE fwd + bwd", 6 * n * qkv, 4 * act * n * (d + m.kv_heads * m.hd), "mem"))
        if design == "built-tc":  # the rotated fp32 staging rounded into the bf16 record (qkv_bf16)
            ks.append(Kernel("qkv: bf16 copy after RoPE", 0, n * qkv * 6, "mem"))
    # SwiGLU reads fc's bf16 output and writes its own in bf16; its backward reads fc's output again
    # and d(act) (fp32 in the built designs) and writes d(fc output) in bf16. (GELU: in the GEMMs.)
    if m.swiglu:
        ks.append(Kernel("SwiGLU fwd", 10 * n * ff, 2 * n * mlp_in + 2 * n * ff, "mem"))
        ks.append(Kernel("SwiGLU bwd", 20 * n * ff, 2 * n * mlp_in + act * n * ff + 2 * n * mlp_in, "mem"))
    # (the residual adds: the forward's in the output GEMMs, the backward's in the norms' backward)
    return ks


def step_kernels(m: Model, design: str) -> list[Kernel]:
    built = design.startswith("built")
    act = 4 if built else 2
    n, d, v = m.tokens, m.d, m.vocab
    ks: list[Kernel] = []
    for k in layer_kernels(m, design):
        k.count = m.layers
        ks.append(k)
    ks.append(Kernel("embedding fwd + bwd", 0, 3 * act * n * d, "mem"))
    head = 2 * n * d * v
    # The logits and their gradient in bf16 (precision.logits = bf16): written by the head's GEMM,
    # read by the loss, d(logits) written over them and read by the two backward GEMMs.
    ks.append(Kernel("head GEMM fwd", head, 2 * (n * d + d * v) + 2 * n * v, "tensor"))
    ks.append(Kernel("head GEMM bwd (dX, dW)", 2 * head, 2 * (2 * (n * d + d * v) + 2 * n * v), "tensor"))
    # Odd vocabulary rows (GPT-2's 50,257): with the positions' rows aligned the loss pass keeps its
    # logits by columns (Backend::logits_by_columns: (V, rows) = W x^T, every head GEMM on aligned
    # rows) and the cross-entropy reads each column twice from memory (a block's columns span all V
    # rows: no L2 reuse); else the head's GEMMs stage their odd rows through padded panels
    # (backend/gemm_panels.h: the f32 logits copied out, the bf16 d(logits) copied in for dX and
    # again for dW, each read + written).
    by_columns = built and v % 8 != 0 and n % 8 == 0
    if built and v % 8 and not by_columns:
        ks.append(Kernel("head: odd rows staged through padded panels", 0, 2 * (4 + 2 + 2) * n * v, "mem"))
    # Cross-entropy: the fused kernel (cuda_loss.cu) reads the bf16 logits once from memory (by
    # rows, its second read of a row, for the gradient, from L2; by columns, twice) and writes the
    # bf16 gradient over them for the GEMMs.
    ce_bytes = ((2 + 2 + 2) if by_columns else (2 + 2)) * n * v
    ks.append(Kernel("cross-entropy fwd + bwd" + (" (logits by columns)" if by_columns else ""), 6 * n * v, ce_bytes, "mem"))
    ks.append(Kernel("AdamW (p, g, m, v fp32 + the bf16 copy)", 12 * m.params, 30 * m.params, "mem"))
    ks.append(Kernel("gradient norm", 2 * m.params, 4 * m.params, "mem"))
    return ks


def model_flops(m: Model) -> float:
    non_embedding = m.params - m.vocab * m.d  # the head GEMM is counted through the tied table
    per_token = 6 * (non_embedding + m.vocab * m.d) + 6 * m.layers * m.seq * m.d / 2 * 2
    return per_token * m.tokens


GPT2 = Model("GPT-2 124M, B 16, T 1024", 16 * 1024, 1024, 768, 12, 12, 3072, 12, 50257, False, 124.4e6)
LLAMA_LAYER = Model("Llama-3-8B-shaped layer, B 1, T 8192", 8192, 8192, 4096, 32, 8, 14336, 1, 0, True, 218.1e6)


def report(m: Model, design: str, markdown: bool) -> tuple[float, float]:
    ks = step_kernels(m, design) if m.vocab else layer_kernels(m, design)
    if not m.vocab:
        ks.append(Kernel("AdamW (the layer's weights)", 12 * m.params, 30 * m.params, "mem"))
    total = sum(k.seconds() for k in ks)
    flops = model_flops(m) if m.vocab else (6 * m.params + 6 * m.seq * m.d) * m.tokens
    mfu = flops / total / BF16
    if markdown:
        print(f"\n{m.name}, {design}: {total * 1e3:.1f} ms, {m.tokens / total:,.0f} tokens/s, MFU {mfu:.0%}\n")
        print("| kernel | launches | GFLOP each | MB each | bound | ms (all launches) |")
        print("|---|---|---|---|---|---|")
        for k in sorted(ks, key=lambda k: -k.seconds()):
            bound = "compute" if k.flops / peak_of(k.unit) > k.bytes / (HBM * MEM_EFF) else "memory"
            print(f"| {k.name} | {k.count} | {k.flops / 1e9:.2f} | {k.bytes / 1e6:.1f} | {bound} | {k.seconds() * 1e3:.2f} |")
    else:
        print(f"{m.name:40s} {design:7s} {total * 1e3:8.1f} ms  {m.tokens / total:12,.0f} tokens/s  MFU {mfu:5.1%}")
    return total, mfu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args()
    for m in (GPT2, LLAMA_LAYER):
        for design in ("built", "built-tc", "target"):
            report(m, design, args.markdown)


if __name__ == "__main__":
    main()
