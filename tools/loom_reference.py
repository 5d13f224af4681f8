"""PyTorch reference for the Loom training engine.

Everything the C++ engine is tested against lives here, written from scratch in
plain torch (no `transformers`, no `torch.nn.Module`):

* safetensors I/O by hand (`write_safetensors`, `read_safetensors`);
* GPT-2 and Llama forward passes over a flat dict of named parameter tensors
  (`init_params`, `forward`, `loss_fn`);
* the training step Loom implements: global-norm gradient clipping, a
  warmup + cosine learning-rate schedule and AdamW (`train`);
* self-checks that restate the spec independently and compare (`self_check_*`).

Conventions
-----------
* A Linear weight W is stored (out_features, in_features): y = x @ W.T + b.
* Activations are (B, T, C); heads are split as (B, n_head, T, head_dim) with
  head h occupying features h*hd .. (h+1)*hd of the projection output.
* The functions are dtype-agnostic: they compute in the dtype of the
  parameters (float64 for fixtures, float32 for the benchmark).
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

import numpy as np
import torch
import torch.nn.functional as F

Params = Dict[str, torch.Tensor]

# --------------------------------------------------------------------------
# safetensors
# --------------------------------------------------------------------------

_TORCH_TO_ST = {
    torch.float32: "F32",
    torch.float64: "F64",
    torch.int32: "I32",
    torch.int64: "I64",
    torch.uint8: "U8",
}
_ST_TO_NUMPY = {"F32": "<f4", "F64": "<f8", "I32": "<i4", "I64": "<i8", "U8": "<u1"}
_ALIGN = 8


def encode_safetensors(tensors: Dict[str, torch.Tensor], metadata: Dict[str, str]) -> bytes:
    """Serialise to safetensors bytes.

    Layout: u64 little-endian N | N bytes of JSON header (space padded so that
    8 + N is a multiple of 8) | data section.  Tensors are stored back to back
    in dict order, C-contiguous, little-endian; `data_offsets` are [begin, end)
    byte offsets relative to the start of the data section.
    """
    if any(not isinstance(v, str) for v in metadata.values()):
        raise TypeError("safetensors metadata values must be str")
    header: Dict[str, object] = {"__metadata__": dict(metadata)}
    chunks: List[bytes] = []
    offset = 0
    for name, t in tensors.items():
        if name == "__metadata__":
            raise ValueError("reserved tensor name")
        if t.dtype not in _TORCH_TO_ST:
            raise TypeError(f"{name}: unsupported dtype {t.dtype}")
        st = _TORCH_TO_ST[t.dtype]
        arr = np.ascontiguousarray(t.detach().cpu().numpy().astype(_ST_TO_NUMPY[st], copy=False))
        data = arr.tobytes(order="C")
        header[name] = {"dtype": st, "shape": list(t.shape), "data_offsets": [offset, offset + len(data)]}
        chunks.append(data)
        offset += len(data)
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=True).encode("utf-8")
    text += b" " * (-len(text) % _ALIGN)  # 8 + N aligned <=> N aligned
    return struct.pack("<Q", len(text)) + text + b"".join(chunks)


def decode_safetensors(buf: bytes) -> Tuple[Dict[str, torch.Tensor], Dict[str, str]]:
    """Parse safetensors bytes, validating the layout strictly.

    Returns (tensors in header order, metadata)."""
    if len(buf) < 8:
        raise ValueError("truncated safetensors file")
    (n,) = struct.unpack("<Q", buf[:8])
    if 8 + n > len(buf):
        raise ValueError("header length beyond end of file")
    header = json.loads(buf[8 : 8 + n].decode("utf-8"))
    metadata = header.pop("__metadata__", {})
    if any(not isinstance(v, str) for v in metadata.values()):
        raise ValueError("metadata values must be str")
    data = memoryview(buf)[8 + n :]
    tensors: Dict[str, torch.Tensor] = {}
    expected_begin = 0
    for name, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
        begin, end = info["data_offsets"]
        shape = [int(s) for s in info["shape"]]
        dt = np.dtype(_ST_TO_NUMPY[info["dtype"]])
        if begin != expected_begin or end - begin != dt.itemsize * math.prod(shape):
            raise ValueError(f"{name}: bad data_offsets {info['data_offsets']}")
        arr = np.frombuffer(data[begin:end], dtype=dt).reshape(shape)
        tensors[name] = torch.from_numpy(arr.astype(dt.newbyteorder("="), copy=True))
        expected_begin = end
    if expected_begin != len(data):
        raise ValueError("data section has trailing bytes")
    order = list(header.keys())
    return {k: tensors[k] for k in order}, metadata


def write_safetensors(path: str, tensors: Dict[str, torch.Tensor], metadata: Dict[str, str]) -> None:
    """Write a safetensors file atomically (temp file in the same dir, fsync, os.replace)."""
    blob = encode_safetensors(tensors, metadata)
    path = os.path.abspath(path)
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(blob)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    dir_fd = os.open(os.path.dirname(path), os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def read_safetensors(path: str) -> Tuple[Dict[str, torch.Tensor], Dict[str, str]]:
    """Read a safetensors file; returns (tensors, metadata)."""
    with open(path, "rb") as f:
        return decode_safetensors(f.read())


# --------------------------------------------------------------------------
# Model configuration and parameters
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelConfig:
    """Architecture hyper-parameters. head_dim hd = d_model / n_head."""

    arch: str  # "gpt2" or "llama"
    vocab_size: int  # V
    max_seq_len: int  # Tmax
    n_layer: int  # L
    n_head: int  # H
    n_kv_head: int  # KVH (== H for gpt2)
    d_model: int  # C
    d_ff: int  # F
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    attn_window: int = 0  # 0: full causal attention; W > 0: sliding window, keys i - W < j <= i
    # Multi-head Latent Attention (DeepSeek-V2 §2.1), llama only; mla_kv_rank = 0: MHA / GQA.
    mla_kv_rank: int = 0  # d_c, the KV latent width
    mla_rope_dim: int = 0  # d_r, the decoupled RoPE query/key width per head (one key for all heads)
    mla_nope_dim: int = 0  # d_n, a head's non-RoPE query/key width (0: head_dim)
    mla_v_dim: int = 0  # d_v, a head's value width (0: head_dim)
    mla_q_rank: int = 0  # d_q, the query latent width (0: queries projected from the input)

    @property
    def mla(self) -> bool:
        return self.mla_kv_rank > 0

    @property
    def mla_nope(self) -> int:
        return self.mla_nope_dim or self.head_dim

    @property
    def mla_v(self) -> int:
        return self.mla_v_dim or self.head_dim

    @property
    def head_dim(self) -> int:
        assert self.d_model % self.n_head == 0
        return self.d_model // self.n_head

    def metadata(self) -> Dict[str, str]:
        """String metadata as stored in the fixture files."""
        return {
            "arch": self.arch,
            "vocab_size": str(self.vocab_size),
            "max_seq_len": str(self.max_seq_len),
            "n_layer": str(self.n_layer),
            "n_head": str(self.n_head),
            "n_kv_head": str(self.n_kv_head),
            "d_model": str(self.d_model),
            "d_ff": str(self.d_ff),
            "norm_eps": repr(float(self.norm_eps)),
            "rope_theta": repr(float(self.rope_theta)),
            # written only when set, so the full-attention fixtures keep their bytes
            **({"attn_window": str(self.attn_window)} if self.attn_window > 0 else {}),
            **(
                {
                    "mla_kv_rank": str(self.mla_kv_rank),
                    "mla_rope_dim": str(self.mla_rope_dim),
                    "mla_nope_dim": str(self.mla_nope_dim),
                    "mla_v_dim": str(self.mla_v_dim),
                    "mla_q_rank": str(self.mla_q_rank),
                }
                if self.mla
                else {}
            ),
        }


# kind: "matrix" (Linear weights and embeddings), "norm" (norm gains), "bias".
ParamSpec = Tuple[str, Tuple[int, ...], str]


def _gpt2_specs(c: ModelConfig) -> List[ParamSpec]:
    C, F_, V = c.d_model, c.d_ff, c.vocab_size
    specs: List[ParamSpec] = [("wte.weight", (V, C), "matrix"), ("wpe.weight", (c.max_seq_len, C), "matrix")]
    for i in range(c.n_layer):
        p = f"h.{i}."
        specs += [
            (p + "ln_1.weight", (C,), "norm"),
            (p + "ln_1.bias", (C,), "bias"),
            (p + "attn.c_attn.weight", (3 * C, C), "matrix"),
            (p + "attn.c_attn.bias", (3 * C,), "bias"),
            (p + "attn.c_proj.weight", (C, C), "matrix"),
            (p + "attn.c_proj.bias", (C,), "bias"),
            (p + "ln_2.weight", (C,), "norm"),
            (p + "ln_2.bias", (C,), "bias"),
            (p + "mlp.c_fc.weight", (F_, C), "matrix"),
            (p + "mlp.c_fc.bias", (F_,), "bias"),
            (p + "mlp.c_proj.weight", (C, F_), "matrix"),
            (p + "mlp.c_proj.bias", (C,), "bias"),
        ]
    specs += [("ln_f.weight", (C,), "norm"), ("ln_f.bias", (C,), "bias")]
    return specs


def _mla_specs(c: ModelConfig, p: str) -> List[ParamSpec]:
    """MLA attention weights, Hugging Face DeepSeek-V2 names; rows [q_n | q_r] and [k_n | v] per head."""
    C, H, qk = c.d_model, c.n_head, c.mla_nope + c.mla_rope_dim
    a = p + "self_attn."
    if c.mla_q_rank > 0:
        specs = [
            (a + "q_a_proj.weight", (c.mla_q_rank, C), "matrix"),
            (a + "q_a_layernorm.weight", (c.mla_q_rank,), "norm"),
            (a + "q_b_proj.weight", (H * qk, c.mla_q_rank), "matrix"),
        ]
    else:
        specs = [(a + "q_proj.weight", (H * qk, C), "matrix")]
    return specs + [
        (a + "kv_a_proj_with_mqa.weight", (c.mla_kv_rank + c.mla_rope_dim, C), "matrix"),
        (a + "kv_a_layernorm.weight", (c.mla_kv_rank,), "norm"),
        (a + "kv_b_proj.weight", (H * (c.mla_nope + c.mla_v), c.mla_kv_rank), "matrix"),
        (a + "o_proj.weight", (C, H * c.mla_v), "matrix"),
    ]


def _llama_specs(c: ModelConfig) -> List[ParamSpec]:
    C, F_, V, hd = c.d_model, c.d_ff, c.vocab_size, c.head_dim
    specs: List[ParamSpec] = [("model.embed_tokens.weight", (V, C), "matrix")]
    for i in range(c.n_layer):
        p = f"model.layers.{i}."
        if c.mla:
            attention = _mla_specs(c, p)
        else:
            attention = [
                (p + "self_attn.qkv_proj.weight", ((c.n_head + 2 * c.n_kv_head) * hd, C), "matrix"),
                (p + "self_attn.o_proj.weight", (C, c.n_head * hd), "matrix"),
            ]
        specs += [
            (p + "input_layernorm.weight", (C,), "norm"),
            *attention,
            (p + "post_attention_layernorm.weight", (C,), "norm"),
            (p + "mlp.gate_up_proj.weight", (2 * F_, C), "matrix"),
            (p + "mlp.down_proj.weight", (C, F_), "matrix"),
        ]
    specs += [("model.norm.weight", (C,), "norm"), ("lm_head.weight", (V, C), "matrix")]
    return specs


def param_specs(cfg: ModelConfig) -> List[ParamSpec]:
    """(name, shape, kind) for every parameter, in canonical order."""
    if cfg.arch == "gpt2":
        return _gpt2_specs(cfg)
    if cfg.arch == "llama":
        return _llama_specs(cfg)
    raise ValueError(f"unknown arch {cfg.arch!r}")


def init_params(cfg: ModelConfig, seed: int = 0, dtype: torch.dtype = torch.float32) -> Params:
    """Deterministic initialisation, drawn in float32 from one torch.Generator.

    matrix/embedding: 0.02 * z;  norm gain: 1 + 0.1 * z;  bias: 0.02 * z,  z ~ N(0, 1).
    The values are float32 numbers (exactly representable), then cast to `dtype`.
    """
    gen = torch.Generator().manual_seed(seed)
    out: Params = {}
    for name, shape, kind in param_specs(cfg):
        z = torch.randn(shape, generator=gen, dtype=torch.float32)
        w = 1.0 + 0.1 * z if kind == "norm" else 0.02 * z
        out[name] = w.to(dtype)
    return out


# --------------------------------------------------------------------------
# Building blocks
# --------------------------------------------------------------------------


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ W.T + b with W stored (out, in)."""
    return F.linear(x, w, b)


def layer_norm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, eps: float) -> torch.Tensor:
    """y = (x - mean(x)) / sqrt(var(x) + eps) * w + b, biased variance over the last dim."""
    return F.layer_norm(x, (x.shape[-1],), w, b, eps)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """y = x * rsqrt(mean(x^2) + eps) * w over the last dim."""
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps) * w


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))."""
    return F.gelu(x, approximate="tanh")


def split_heads(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    """(B, T, n*hd) -> (B, n, T, hd); head h = features h*hd .. (h+1)*hd."""
    B, T, D = x.shape
    return x.view(B, T, n_heads, D // n_heads).transpose(1, 2)


def merge_heads(x: torch.Tensor) -> torch.Tensor:
    """(B, n, T, hd) -> (B, T, n*hd)."""
    B, n, T, hd = x.shape
    return x.transpose(1, 2).reshape(B, T, n * hd)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int = 0) -> torch.Tensor:
    """softmax(q k^T / sqrt(hd) + causal mask) v over (B, H, T, hd) tensors.

    Query position t attends to key positions u <= t, and with window W > 0 only to
    t - W < u <= t (sliding window: Beltagy et al. 2020, Longformer; Jiang et al. 2023,
    Mistral 7B).  k and v must already have H heads (GQA expansion is done by the caller)."""
    T, hd = q.shape[-2], q.shape[-1]
    scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hd))
    masked = torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1)
    if window > 0:
        masked |= torch.ones(T, T, dtype=torch.bool, device=q.device).tril(-window)
    scores = scores.masked_fill(masked, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def rope_cos_sin(T: int, hd: int, theta: float, dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables of shape (T, hd): angle[t, j] = t * theta^(-2j/hd) for j < hd/2,
    duplicated for the second half (rotate-half convention). Computed in float64."""
    j = torch.arange(hd // 2, dtype=torch.float64)
    inv_freq = theta ** (-2.0 * j / hd)
    angle = torch.arange(T, dtype=torch.float64)[:, None] * inv_freq[None, :]
    angle = torch.cat([angle, angle], dim=-1)
    return angle.cos().to(dtype), angle.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Hugging Face rotate-half RoPE on (B, n, T, hd), half = hd/2:
    out[j] = x[j] cos - x[j+half] sin;  out[j+half] = x[j+half] cos + x[j] sin."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


# --------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------


def _gpt2_block(x: torch.Tensor, P: Params, i: int, cfg: ModelConfig) -> torch.Tensor:
    """x += c_proj(attn(c_attn(LN1 x)));  x += mlp.c_proj(gelu_tanh(c_fc(LN2 x)))."""
    p, C, eps = f"h.{i}.", cfg.d_model, cfg.norm_eps
    h = layer_norm(x, P[p + "ln_1.weight"], P[p + "ln_1.bias"], eps)
    qkv = linear(h, P[p + "attn.c_attn.weight"], P[p + "attn.c_attn.bias"])
    q, k, v = (split_heads(t, cfg.n_head) for t in qkv.split(C, dim=-1))
    att = merge_heads(causal_attention(q, k, v, cfg.attn_window))
    x = x + linear(att, P[p + "attn.c_proj.weight"], P[p + "attn.c_proj.bias"])
    h = layer_norm(x, P[p + "ln_2.weight"], P[p + "ln_2.bias"], eps)
    h = gelu_tanh(linear(h, P[p + "mlp.c_fc.weight"], P[p + "mlp.c_fc.bias"]))
    return x + linear(h, P[p + "mlp.c_proj.weight"], P[p + "mlp.c_proj.bias"])


def gpt2_forward(P: Params, cfg: ModelConfig, tokens: torch.Tensor) -> torch.Tensor:
    """GPT-2 logits (B, T, V): x = wte[tok] + wpe[pos]; L blocks; ln_f; tied head x @ wte.T."""
    T = tokens.shape[1]
    x = P["wte.weight"][tokens.long()] + P["wpe.weight"][:T]
    for i in range(cfg.n_layer):
        x = _gpt2_block(x, P, i, cfg)
    x = layer_norm(x, P["ln_f.weight"], P["ln_f.bias"], cfg.norm_eps)
    return linear(x, P["wte.weight"])


def mla_attention(h: torch.Tensor, P: Params, p: str, cfg: ModelConfig) -> torch.Tensor:
    """Multi-head Latent Attention (DeepSeek-AI 2024, DeepSeek-V2 §2.1) of the normed input
    h (B, T, C) -> (B, T, H d_v), before o_proj:
      q = W_q h, or W_qb RMSNorm(W_qa h);  per head [q_n (d_n) | q_r (d_r)], RoPE on q_r
      [c | k_r] = kv_a_proj_with_mqa h;  c' = RMSNorm(c);  k_r = RoPE(k_r), one key for all heads
      [k_n | v] per head = kv_b_proj c'
      o_h = softmax((q_n k_n^T + q_r k_r^T) / sqrt(d_n + d_r) + causal mask) v_h."""
    a, eps, H = p + "self_attn.", cfg.norm_eps, cfg.n_head
    dn, dr, dv, dc = cfg.mla_nope, cfg.mla_rope_dim, cfg.mla_v, cfg.mla_kv_rank
    T = h.shape[1]
    if cfg.mla_q_rank > 0:
        q = linear(rms_norm(linear(h, P[a + "q_a_proj.weight"]), P[a + "q_a_layernorm.weight"], eps), P[a + "q_b_proj.weight"])
    else:
        q = linear(h, P[a + "q_proj.weight"])
    q = split_heads(q, H)  # (B, H, T, d_n + d_r)
    cos, sin = rope_cos_sin(T, dr, cfg.rope_theta, h.dtype)
    q_n, q_r = q.split([dn, dr], dim=-1)
    c, k_r = linear(h, P[a + "kv_a_proj_with_mqa.weight"]).split([dc, dr], dim=-1)
    k_r = apply_rope(k_r.unsqueeze(1), cos, sin)  # (B, 1, T, d_r)
    kv = split_heads(linear(rms_norm(c, P[a + "kv_a_layernorm.weight"], eps), P[a + "kv_b_proj.weight"]), H)
    k_n, v = kv.split([dn, dv], dim=-1)
    q = torch.cat([q_n, apply_rope(q_r, cos, sin)], dim=-1)
    k = torch.cat([k_n, k_r.expand(-1, H, -1, -1)], dim=-1)
    return merge_heads(causal_attention(q, k, v, cfg.attn_window))


def _llama_block(x: torch.Tensor, P: Params, i: int, cfg: ModelConfig, cos, sin) -> torch.Tensor:
    """x += o_proj(attn(rope q, rope k, v));  x += down(silu(gate) * up)."""
    p, eps, hd = f"model.layers.{i}.", cfg.norm_eps, cfg.head_dim
    H, KVH, F_ = cfg.n_head, cfg.n_kv_head, cfg.d_ff
    h = rms_norm(x, P[p + "input_layernorm.weight"], eps)
    if cfg.mla:
        x = x + linear(mla_attention(h, P, p, cfg), P[p + "self_attn.o_proj.weight"])
        h = rms_norm(x, P[p + "post_attention_layernorm.weight"], eps)
        gate, up = linear(h, P[p + "mlp.gate_up_proj.weight"]).split(F_, dim=-1)
        return x + linear(F.silu(gate) * up, P[p + "mlp.down_proj.weight"])
    qkv = linear(h, P[p + "self_attn.qkv_proj.weight"])
    q, k, v = qkv.split([H * hd, KVH * hd, KVH * hd], dim=-1)
    q = apply_rope(split_heads(q, H), cos, sin)
    k = apply_rope(split_heads(k, KVH), cos, sin)
    v = split_heads(v, KVH)
    # GQA: query head h reads kv head h // (H / KVH).
    k = k.repeat_interleave(H // KVH, dim=1)
    v = v.repeat_interleave(H // KVH, dim=1)
    x = x + linear(merge_heads(causal_attention(q, k, v, cfg.attn_window)), P[p + "self_attn.o_proj.weight"])
    h = rms_norm(x, P[p + "post_attention_layernorm.weight"], eps)
    gate, up = linear(h, P[p + "mlp.gate_up_proj.weight"]).split(F_, dim=-1)
    return x + linear(F.silu(gate) * up, P[p + "mlp.down_proj.weight"])


def llama_forward(P: Params, cfg: ModelConfig, tokens: torch.Tensor) -> torch.Tensor:
    """Llama logits (B, T, V): x = embed[tok]; L blocks; RMSNorm; untied lm_head."""
    assert cfg.n_head % cfg.n_kv_head == 0
    T = tokens.shape[1]
    x = P["model.embed_tokens.weight"][tokens.long()]
    cos, sin = rope_cos_sin(T, cfg.head_dim, cfg.rope_theta, x.dtype)
    for i in range(cfg.n_layer):
        x = _llama_block(x, P, i, cfg, cos, sin)
    x = rms_norm(x, P["model.norm.weight"], cfg.norm_eps)
    return linear(x, P["lm_head.weight"])


def forward(P: Params, cfg: ModelConfig, tokens: torch.Tensor) -> torch.Tensor:
    """Logits (B, T, V) for either architecture."""
    return {"gpt2": gpt2_forward, "llama": llama_forward}[cfg.arch](P, cfg, tokens)


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """mean over all B*T positions of logsumexp(logits) - logits[target]."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1).long())


def loss_fn(P: Params, cfg: ModelConfig, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return cross_entropy(forward(P, cfg, tokens), targets)


def loss_and_grads(P: Params, cfg: ModelConfig, tokens, targets) -> Tuple[torch.Tensor, Params]:
    """Scalar mean loss and d loss / d p for every parameter (same dtype as P)."""
    leaves = {k: v.detach().clone().requires_grad_(True) for k, v in P.items()}
    loss = loss_fn(leaves, cfg, tokens, targets)
    grads = torch.autograd.grad(loss, list(leaves.values()))
    return loss.detach(), dict(zip(leaves.keys(), grads))


# --------------------------------------------------------------------------
# Optimisation: clipping, schedule, AdamW
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class OptimConfig:
    steps: int = 10  # S
    max_lr: float = 3e-3
    min_lr: float = 3e-4
    warmup: int = 3
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    grad_clip: float = 1.0

    def metadata(self) -> Dict[str, str]:
        return {
            "steps": str(self.steps),
            "max_lr": repr(float(self.max_lr)),
            "min_lr": repr(float(self.min_lr)),
            "warmup": str(self.warmup),
            "beta1": repr(float(self.beta1)),
            "beta2": repr(float(self.beta2)),
            "eps": repr(float(self.eps)),
            "weight_decay": repr(float(self.weight_decay)),
            "grad_clip": repr(float(self.grad_clip)),
        }


def lr_at(t: int, oc: OptimConfig) -> float:
    """max_lr (t+1)/warmup for t < warmup, else
    min_lr + 0.5 (max_lr - min_lr) (1 + cos(pi (t - warmup) / (S - warmup)))."""
    if t < oc.warmup:
        return oc.max_lr * (t + 1) / oc.warmup
    progress = (t - oc.warmup) / (oc.steps - oc.warmup)
    return oc.min_lr + 0.5 * (oc.max_lr - oc.min_lr) * (1.0 + math.cos(math.pi * progress))


def clip_grads_(grads: Params, max_norm: float) -> float:
    """total = sqrt(sum g^2) over all params; g *= min(1, max_norm / (total + 1e-6)).
    Returns the pre-clip total norm."""
    total = math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads.values()))
    coef = min(1.0, max_norm / (total + 1e-6))
    for g in grads.values():
        g.mul_(coef)
    return total


def decays(p: torch.Tensor) -> bool:
    """Weight decay applies to matrices/embeddings (dim >= 2) only."""
    return p.dim() >= 2


class HandAdamW:
    """AdamW as in Loshchilov & Hutter / torch.optim.AdamW, step counter t from 0:

        p -= lr * wd * p            (only if p.dim() >= 2)
        m  = b1 m + (1 - b1) g
        v  = b2 v + (1 - b2) g^2
        p -= lr * (m / (1 - b1^(t+1))) / (sqrt(v / (1 - b2^(t+1))) + eps)
    """

    def __init__(self, params: Params, oc: OptimConfig):
        self.oc = oc
        self.m = {k: torch.zeros_like(v) for k, v in params.items()}
        self.v = {k: torch.zeros_like(v) for k, v in params.items()}

    @torch.no_grad()
    def step(self, params: Params, grads: Params, t: int, lr: float) -> None:
        oc = self.oc
        bc1, bc2 = 1.0 - oc.beta1 ** (t + 1), 1.0 - oc.beta2 ** (t + 1)
        for name, p in params.items():
            g, m, v = grads[name], self.m[name], self.v[name]
            if decays(p):
                p.sub_(lr * oc.weight_decay * p)
            m.mul_(oc.beta1).add_((1.0 - oc.beta1) * g)
            v.mul_(oc.beta2).add_((1.0 - oc.beta2) * g * g)
            p.sub_(lr * (m / bc1) / ((v / bc2).sqrt() + oc.eps))


def train(P: Params, cfg: ModelConfig, tokens, targets, oc: OptimConfig) -> Tuple[List[float], Params]:
    """S steps of (loss, grads) -> clip -> schedule -> HandAdamW on one fixed batch,
    in float64.  Returns (loss before each update, final parameters)."""
    params = {k: v.detach().to(torch.float64).clone() for k, v in P.items()}
    opt = HandAdamW(params, oc)
    losses: List[float] = []
    for t in range(oc.steps):
        loss, grads = loss_and_grads(params, cfg, tokens, targets)
        losses.append(float(loss))
        clip_grads_(grads, oc.grad_clip)
        opt.step(params, grads, t, lr_at(t, oc))
    return losses, params


def param_groups(params: Sequence[torch.Tensor], weight_decay: float) -> List[dict]:
    """torch.optim param groups: decay for dim >= 2, none for norms/biases."""
    return [
        {"params": [p for p in params if decays(p)], "weight_decay": weight_decay},
        {"params": [p for p in params if not decays(p)], "weight_decay": 0.0},
    ]


def train_with_torch_optim(P: Params, cfg: ModelConfig, tokens, targets, oc: OptimConfig):
    """Same loop as `train` but with torch.nn.utils.clip_grad_norm_ and
    torch.optim.AdamW (lr set by hand each step); used to cross-check `train`."""
    params = {k: v.detach().to(torch.float64).clone().requires_grad_(True) for k, v in P.items()}
    opt = torch.optim.AdamW(
        param_groups(list(params.values()), oc.weight_decay),
        lr=oc.max_lr, betas=(oc.beta1, oc.beta2), eps=oc.eps,
    )
    losses: List[float] = []
    for t in range(oc.steps):
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(params, cfg, tokens, targets)
        loss.backward()
        losses.append(float(loss))
        torch.nn.utils.clip_grad_norm_(list(params.values()), oc.grad_clip)
        for group in opt.param_groups:
            group["lr"] = lr_at(t, oc)
        opt.step()
    return losses, {k: v.detach() for k, v in params.items()}


# --------------------------------------------------------------------------
# Self-checks: independent restatements of the spec
# --------------------------------------------------------------------------


def _naive_attention_head(q, k, v, window: int = 0) -> torch.Tensor:
    """One head, (T, hd) each, written per query position; window W > 0 keeps keys t - W < u <= t."""
    T, hd = q.shape
    rows = []
    for t in range(T):
        keys = range(max(0, t - window + 1) if window > 0 else 0, t + 1)
        s = torch.stack([q[t] @ k[u] for u in keys]) / math.sqrt(hd)
        w = torch.exp(s - s.max())
        w = w / w.sum()
        rows.append(sum(w[i] * v[u] for i, u in enumerate(keys)))
    return torch.stack(rows)


def _naive_rope(vec: torch.Tensor, pos: int, theta: float) -> torch.Tensor:
    hd = vec.shape[0]
    half = hd // 2
    out = vec.clone()
    for j in range(half):
        a = pos * theta ** (-2.0 * j / hd)
        c, s = math.cos(a), math.sin(a)
        out[j] = vec[j] * c - vec[j + half] * s
        out[j + half] = vec[j + half] * c + vec[j] * s
    return out


def naive_forward(P: Params, cfg: ModelConfig, tokens: torch.Tensor) -> torch.Tensor:
    """Slow loop-based logits, independent of the vectorised code path (no
    F.layer_norm / F.gelu / split_heads / repeat_interleave).  Self-check only."""
    eps, hd, H, KVH, C = cfg.norm_eps, cfg.head_dim, cfg.n_head, cfg.n_kv_head, cfg.d_model
    B, T = tokens.shape

    def ln(x, w, b):
        mu = x.mean(-1, keepdim=True)
        var = ((x - mu) ** 2).mean(-1, keepdim=True)
        return (x - mu) / torch.sqrt(var + eps) * w + b

    def rms(x, w):
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w

    def gelu(x):
        return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))

    def lin(x, w, b=None):
        y = x @ w.T
        return y if b is None else y + b

    def attention(q, k, v, nq, nkv, rope):
        out = torch.zeros(B, T, nq * hd, dtype=q.dtype)
        for b in range(B):
            for h in range(nq):
                kvh = h // (nq // nkv)
                qh = q[b, :, h * hd : (h + 1) * hd]
                kh = k[b, :, kvh * hd : (kvh + 1) * hd]
                vh = v[b, :, kvh * hd : (kvh + 1) * hd]
                if rope:
                    qh = torch.stack([_naive_rope(qh[t], t, cfg.rope_theta) for t in range(T)])
                    kh = torch.stack([_naive_rope(kh[t], t, cfg.rope_theta) for t in range(T)])
                out[b, :, h * hd : (h + 1) * hd] = _naive_attention_head(qh, kh, vh, cfg.attn_window)
        return out

    tok = tokens.long()
    if cfg.arch == "gpt2":
        x = P["wte.weight"][tok] + P["wpe.weight"][torch.arange(T)]
        for i in range(cfg.n_layer):
            p = f"h.{i}."
            qkv = lin(ln(x, P[p + "ln_1.weight"], P[p + "ln_1.bias"]), P[p + "attn.c_attn.weight"], P[p + "attn.c_attn.bias"])
            a = attention(qkv[..., :C], qkv[..., C : 2 * C], qkv[..., 2 * C :], H, H, rope=False)
            x = x + lin(a, P[p + "attn.c_proj.weight"], P[p + "attn.c_proj.bias"])
            h = gelu(lin(ln(x, P[p + "ln_2.weight"], P[p + "ln_2.bias"]), P[p + "mlp.c_fc.weight"], P[p + "mlp.c_fc.bias"]))
            x = x + lin(h, P[p + "mlp.c_proj.weight"], P[p + "mlp.c_proj.bias"])
        return ln(x, P["ln_f.weight"], P["ln_f.bias"]) @ P["wte.weight"].T
    def mla(h, p):
        a, dn, dr, dv, dc = p + "self_attn.", cfg.mla_nope, cfg.mla_rope_dim, cfg.mla_v, cfg.mla_kv_rank
        if cfg.mla_q_rank > 0:
            q = lin(rms(lin(h, P[a + "q_a_proj.weight"]), P[a + "q_a_layernorm.weight"]), P[a + "q_b_proj.weight"])
        else:
            q = lin(h, P[a + "q_proj.weight"])
        ckr = lin(h, P[a + "kv_a_proj_with_mqa.weight"])
        kv = lin(rms(ckr[..., :dc], P[a + "kv_a_layernorm.weight"]), P[a + "kv_b_proj.weight"])
        out = torch.zeros(B, T, H * dv, dtype=h.dtype)
        for b in range(B):
            kr = torch.stack([_naive_rope(ckr[b, t, dc:], t, cfg.rope_theta) for t in range(T)])
            for hh in range(H):
                qh = q[b, :, hh * (dn + dr) : (hh + 1) * (dn + dr)]
                qh = torch.stack([torch.cat([qh[t, :dn], _naive_rope(qh[t, dn:], t, cfg.rope_theta)]) for t in range(T)])
                kvh = kv[b, :, hh * (dn + dv) : (hh + 1) * (dn + dv)]
                kh = torch.cat([kvh[:, :dn], kr], dim=-1)
                out[b, :, hh * dv : (hh + 1) * dv] = _naive_attention_head(qh, kh, kvh[:, dn:], cfg.attn_window)
        return out

    x = P["model.embed_tokens.weight"][tok]
    for i in range(cfg.n_layer):
        p = f"model.layers.{i}."
        if cfg.mla:
            a = mla(rms(x, P[p + "input_layernorm.weight"]), p)
        else:
            qkv = lin(rms(x, P[p + "input_layernorm.weight"]), P[p + "self_attn.qkv_proj.weight"])
            q, k, v = qkv[..., : H * hd], qkv[..., H * hd : (H + KVH) * hd], qkv[..., (H + KVH) * hd :]
            a = attention(q, k, v, H, KVH, rope=True)
        x = x + lin(a, P[p + "self_attn.o_proj.weight"])
        gu = lin(rms(x, P[p + "post_attention_layernorm.weight"]), P[p + "mlp.gate_up_proj.weight"])
        g, u = gu[..., : cfg.d_ff], gu[..., cfg.d_ff :]
        x = x + lin(g / (1 + torch.exp(-g)) * u, P[p + "mlp.down_proj.weight"])
    return rms(x, P["model.norm.weight"]) @ P["lm_head.weight"].T


def naive_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """mean_i (log sum_j exp(z_ij) - z_i,target_i) with max-subtraction."""
    z = logits.reshape(-1, logits.shape[-1])
    y = targets.reshape(-1).long()
    mx = z.max(-1, keepdim=True).values
    lse = (z - mx).exp().sum(-1).log() + mx[:, 0]
    return (lse - z[torch.arange(z.shape[0]), y]).mean()


def _assert_close(name: str, a: torch.Tensor, b: torch.Tensor, rtol: float, atol: float) -> float:
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    err = float((a - b).abs().max())
    if not torch.allclose(a, b, rtol=rtol, atol=atol):
        raise AssertionError(f"{name}: max abs diff {err:.3e} exceeds rtol={rtol} atol={atol}")
    return err


def self_check_forward(P64: Params, cfg: ModelConfig, tokens, targets) -> None:
    """Vectorised logits/loss == naive loop-based restatement (float64)."""
    with torch.no_grad():
        logits = forward(P64, cfg, tokens)
        _assert_close(f"{cfg.arch} logits vs naive", logits, naive_forward(P64, cfg, tokens), 1e-11, 1e-12)
        _assert_close(f"{cfg.arch} loss vs naive", cross_entropy(logits, targets), naive_cross_entropy(logits, targets), 1e-13, 1e-13)


def self_check_grads(P64: Params, cfg: ModelConfig, tokens, targets, names: Sequence[str], h: float = 1e-5) -> None:
    """Autograd gradient == central finite difference (float64) at the
    largest-|grad| entry and at one fixed entry of each named parameter."""
    _, grads = loss_and_grads(P64, cfg, tokens, targets)
    for name in names:
        flat_g = grads[name].reshape(-1)
        for idx in {int(flat_g.abs().argmax()), flat_g.numel() // 3}:
            def loss_at(delta: float) -> float:
                Q = dict(P64)
                q = P64[name].clone()
                q.view(-1)[idx] += delta
                Q[name] = q
                with torch.no_grad():
                    return float(loss_fn(Q, cfg, tokens, targets))

            fd = (loss_at(h) - loss_at(-h)) / (2 * h)
            ad = float(flat_g[idx])
            if abs(fd - ad) > 1e-6 * abs(ad) + 1e-9:
                raise AssertionError(f"{cfg.arch} grad {name}[{idx}]: autograd {ad:.12e} vs finite diff {fd:.12e}")


def self_check_optimizer(P: Params, cfg: ModelConfig, tokens, targets, oc: OptimConfig) -> Tuple[List[float], Params]:
    """HandAdamW loop == torch.optim.AdamW loop (float64); returns the hand result."""
    losses, final = train(P, cfg, tokens, targets, oc)
    t_losses, t_final = train_with_torch_optim(P, cfg, tokens, targets, oc)
    _assert_close(f"{cfg.arch} losses hand vs torch.optim", torch.tensor(losses), torch.tensor(t_losses), 1e-12, 1e-13)
    for k in final:
        _assert_close(f"{cfg.arch} final {k} hand vs torch.optim", final[k], t_final[k], 1e-9, 1e-12)
    return losses, final


def self_check_schedule(oc: OptimConfig) -> None:
    """Spot values of the schedule."""
    assert math.isclose(lr_at(0, oc), oc.max_lr / oc.warmup)
    assert math.isclose(lr_at(oc.warmup - 1, oc), oc.max_lr)
    assert math.isclose(lr_at(oc.warmup, oc), oc.max_lr)
    assert all(lr_at(t, oc) >= oc.min_lr for t in range(oc.steps))


def self_check_safetensors_roundtrip(tensors: Dict[str, torch.Tensor], metadata: Dict[str, str], blob: bytes) -> None:
    """decode(blob) gives back exactly `tensors` (names, order, dtypes, shapes,
    bits) and `metadata`; header is space-padded to 8-byte alignment."""
    (n,) = struct.unpack("<Q", blob[:8])
    assert (8 + n) % _ALIGN == 0, "data section not 8-byte aligned"
    assert blob[8 : 8 + n].decode("utf-8").rstrip(" ").endswith("}")
    back, meta = decode_safetensors(blob)
    assert meta == metadata, "metadata mismatch"
    assert list(back) == list(tensors), "tensor order mismatch"
    for k, t in tensors.items():
        b = back[k]
        assert b.dtype == t.dtype and b.shape == t.shape, k
        assert torch.equal(b, t.detach().cpu()), f"{k}: data mismatch"
    assert encode_safetensors(back, meta) == blob, "re-encode is not byte identical"
