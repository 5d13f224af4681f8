"""Float64 reference for Loom's fourteen optimizers (docs/optimizers.md).

docs/optimizers.md is the contract; this module implements it rule by rule:

* sgd, momentum, nesterov, adagrad, rmsprop, adam, adamw run `torch.optim`
  (one torch tensor per Loom parameter, one param group per parameter so each
  has its own lr = schedule lr * lr_scale and its own weight decay);
* adafactor, sm3, lion, adam-mini, came, ldadam, muon are numpy code written
  from the formulas on that page (the papers are cited next to each rule);
* numpy twins of adam / adamw / sgd(-momentum) exist only to cross-check the
  torch harness (`backend="numpy"`); Muon and LDAdam reuse the numpy AdamW for
  their non-hidden parameters.

Entry point: `run_optimizer(name, hp, params, theta0, grads, lrs, grad_scales)`
returns the flat parameter vector after every step.  `hp` uses the config key
names without the `optim.` prefix (beta1, eps, rank, muon_scale, ...); missing
keys take the defaults of the doc's table (`DEFAULTS`).

Gradient buffer semantics (what Loom's trainer does): the buffer starts at 0;
before step k the step's gradient is added into it; the optimizer sees
g = grad_scale * buffer; afterwards the buffer is zeroed, except for LDAdam's
projected segments, whose buffer is replaced by the compression error E
(generalized error feedback), so the next step sees E + next gradient.

Every routine is dtype-generic (float64 for fixtures; float32 to estimate the
error a float32 implementation makes against the tolerances).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch

# --------------------------------------------------------------------------
# Parameters and segments
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class Segment:
    rows: int
    block_rows: int


@dataclass
class ParamInfo:
    """One Loom parameter: the range [offset, offset + numel) of the flat buffers."""

    name: str
    offset: int
    numel: int
    shape: Tuple[int, ...]
    segments: Tuple[Segment, ...]
    matrix: bool
    hidden: bool
    weight_decay: float
    lr_scale: float

    @property
    def total_rows(self) -> int:
        return sum(s.rows for s in self.segments)

    @property
    def cols(self) -> int:
        """Columns of every segment: numel / total rows (a 1-D param: 1 row x numel)."""
        assert self.numel % self.total_rows == 0, self.name
        return self.numel // self.total_rows

    def seg_ranges(self) -> Iterator[Tuple[int, int, int, int]]:
        """Yield (flat start, rows, cols, block_rows) for each segment, in row order."""
        start = self.offset
        for s in self.segments:
            yield start, s.rows, self.cols, s.block_rows
            start += s.rows * self.cols

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "shape": list(self.shape),
            "offset": self.offset,
            "numel": self.numel,
            "segments": [{"rows": s.rows, "block_rows": s.block_rows} for s in self.segments],
            "matrix": self.matrix,
            "hidden": self.hidden,
            "weight_decay": self.weight_decay,
            "lr_scale": self.lr_scale,
        }


def param_info(d) -> ParamInfo:
    """Accept a ParamInfo, or a dict as in the fixture spec (segments as dicts or (rows, block_rows) pairs)."""
    if isinstance(d, ParamInfo):
        return d
    segs = []
    for s in d["segments"]:
        if isinstance(s, dict):
            segs.append(Segment(int(s["rows"]), int(s["block_rows"])))
        else:
            segs.append(Segment(int(s[0]), int(s[1])))
    p = ParamInfo(
        name=d["name"], offset=int(d["offset"]), numel=int(d["numel"]), shape=tuple(int(x) for x in d["shape"]),
        segments=tuple(segs), matrix=bool(d["matrix"]), hidden=bool(d["hidden"]),
        weight_decay=float(d["weight_decay"]), lr_scale=float(d["lr_scale"]),
    )
    assert math.prod(p.shape) == p.numel and p.numel % p.total_rows == 0, p.name
    return p


# --------------------------------------------------------------------------
# Hyperparameters: the defaults column of the doc's table
# --------------------------------------------------------------------------

DEFAULTS: Dict[str, Dict[str, object]] = {
    "sgd": {"momentum": 0.0, "dampening": 0.0, "nesterov": False},
    "momentum": {"momentum": 0.9, "dampening": 0.0, "nesterov": False},
    "nesterov": {"momentum": 0.9, "dampening": 0.0, "nesterov": True},
    "adagrad": {"lr_decay": 0.0, "initial_accumulator": 0.0, "eps": 1e-10},
    "rmsprop": {"beta2": 0.99, "eps": 1e-8, "momentum": 0.0, "centered": False},
    "adam": {"beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "amsgrad": False},
    "adamw": {"beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "amsgrad": False},
    "adafactor": {"beta1": 0.0, "eps": 1e-30, "eps2": 1e-3, "clip_threshold": 1.0, "decay_rate": -0.8,
                  "relative_step": True, "scale_parameter": True, "warmup_init": False},
    "sm3": {"eps": 0.0},
    "lion": {"beta1": 0.9, "beta2": 0.99},
    "adam-mini": {"beta1": 0.9, "beta2": 0.999, "eps": 1e-8},
    "came": {"beta1": 0.9, "beta2": 0.999, "beta3": 0.9999, "eps": 1e-30, "eps2": 1e-16, "clip_threshold": 1.0},
    "ldadam": {"rank": 16, "rho": 0.908, "beta1": 0.908, "beta2": 0.99, "eps": 1e-8},
    "muon": {"momentum": 0.95, "nesterov": True, "ns_steps": 5, "muon_scale": "moonshot",
             "beta1": 0.9, "beta2": 0.95, "eps": 1e-8},
}
OPTIMIZERS = tuple(DEFAULTS)


def resolve_hp(name: str, hp: Optional[dict] = None) -> Dict[str, object]:
    """Defaults of `name` overridden by `hp`; unknown keys are an error (typos would silently do nothing)."""
    if name not in DEFAULTS:
        raise ValueError(f"unknown optimizer {name!r}")
    out = dict(DEFAULTS[name])
    for k, v in (hp or {}).items():
        if k not in out:
            raise KeyError(f"{name}: hyperparameter {k!r} does not apply")
        out[k] = v
    return out


def _fmt(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return v
    if isinstance(v, int) or float(v).is_integer() and abs(v) < 1e15:
        return str(int(v))
    s = repr(float(v))
    if "e" in s:  # 1e-08 -> 1e-8
        mant, exp = s.split("e")
        s = f"{mant}e{int(exp)}"
    return s


def config_set(name: str, hp: Optional[dict] = None) -> str:
    """The Loom config overrides spelling out every hyperparameter of `name`, e.g. 'optim.name=lion,...'."""
    full = resolve_hp(name, hp)
    return ",".join([f"optim.name={name}"] + [f"optim.{k}={_fmt(v)}" for k, v in full.items()])


# --------------------------------------------------------------------------
# Optimizer base: holds per-(param, segment) state, steps the flat buffers
# --------------------------------------------------------------------------


class _Optimizer:
    def __init__(self, hp: dict, params: Sequence[ParamInfo], dtype):
        self.hp = hp
        self.params = list(params)
        self.dtype = np.dtype(dtype)
        self.state: Dict[object, dict] = {}
        self.trace: List[dict] = []  # per-step diagnostics (used by --check)

    def zeros(self, *shape) -> np.ndarray:
        return np.zeros(shape, dtype=self.dtype)

    def step(self, theta: np.ndarray, buf: np.ndarray, lr: float, grad_scale: float, t: int) -> None:
        """One step, in place: theta updated, buf zeroed (or, for LDAdam, set to the error E)."""
        raise NotImplementedError


def _c(x, dtype):
    """A Python scalar as a numpy scalar of the working dtype (keeps float32 runs float32)."""
    return np.asarray(x, dtype=dtype)[()]


# --------------------------------------------------------------------------
# torch.optim harness: sgd, momentum, nesterov, adagrad, rmsprop, adam, adamw
# --------------------------------------------------------------------------

_TORCH_DTYPE = {np.dtype(np.float64): torch.float64, np.dtype(np.float32): torch.float32}


class _TorchOptimizer(_Optimizer):
    def __init__(self, name, hp, params, dtype):
        super().__init__(hp, params, dtype)
        self.tensors: Optional[List[torch.Tensor]] = None
        self.name = name

    def _build(self, theta: np.ndarray) -> None:
        tdt = _TORCH_DTYPE[self.dtype]
        self.tensors = [torch.tensor(theta[p.offset:p.offset + p.numel].reshape(p.shape), dtype=tdt, requires_grad=True)
                        for p in self.params]
        # One group per parameter: its own lr (set before every step) and weight decay.
        groups = [{"params": [x], "lr": 0.0, "weight_decay": p.weight_decay} for x, p in zip(self.tensors, self.params)]
        hp, n = self.hp, self.name
        if n in ("sgd", "momentum", "nesterov"):
            # torch.optim.SGD (Sutskever et al. 2013 for the Nesterov form); dampening 0
            self.opt = torch.optim.SGD(groups, lr=0.0, momentum=float(hp["momentum"]), dampening=float(hp["dampening"]),
                                       nesterov=bool(hp["nesterov"]), foreach=False)
        elif n == "adagrad":
            # torch.optim.Adagrad (Duchi et al. 2011)
            self.opt = torch.optim.Adagrad(groups, lr=0.0, lr_decay=float(hp["lr_decay"]),
                                           initial_accumulator_value=float(hp["initial_accumulator"]),
                                           eps=float(hp["eps"]), foreach=False)
        elif n == "rmsprop":
            # torch.optim.RMSprop (Hinton, lecture 6e; centered form Graves 2013); alpha = beta2
            self.opt = torch.optim.RMSprop(groups, lr=0.0, alpha=float(hp["beta2"]), eps=float(hp["eps"]),
                                           momentum=float(hp["momentum"]), centered=bool(hp["centered"]), foreach=False)
        elif n == "adam":
            # torch.optim.Adam (Kingma & Ba 2015; amsgrad Reddi et al. 2018), L2 decay
            self.opt = torch.optim.Adam(groups, lr=0.0, betas=(float(hp["beta1"]), float(hp["beta2"])),
                                        eps=float(hp["eps"]), amsgrad=bool(hp["amsgrad"]), foreach=False)
        elif n == "adamw":
            # torch.optim.AdamW (Loshchilov & Hutter 2019), decoupled decay
            self.opt = torch.optim.AdamW(groups, lr=0.0, betas=(float(hp["beta1"]), float(hp["beta2"])),
                                         eps=float(hp["eps"]), amsgrad=bool(hp["amsgrad"]), foreach=False)
        else:
            raise ValueError(n)

    def step(self, theta, buf, lr, grad_scale, t):
        if self.tensors is None:
            self._build(theta)
        tdt = _TORCH_DTYPE[self.dtype]
        for x, p, group in zip(self.tensors, self.params, self.opt.param_groups):
            g = _c(grad_scale, self.dtype) * buf[p.offset:p.offset + p.numel]
            x.grad = torch.tensor(g.reshape(p.shape), dtype=tdt)
            group["lr"] = lr * p.lr_scale
        self.opt.step()
        for x, p in zip(self.tensors, self.params):
            theta[p.offset:p.offset + p.numel] = x.detach().numpy().reshape(-1)
        buf[:] = 0


# --------------------------------------------------------------------------
# numpy twins of the torch rules (cross-check only) and the AdamW Muon/LDAdam use
# --------------------------------------------------------------------------


class _AdamNumpy(_Optimizer):
    """Adam (Kingma & Ba 2015) as torch computes it.  decoupled=True is AdamW (Loshchilov & Hutter 2019):
    theta *= 1 - eta*lambda, then Adam without the L2 term; decoupled=False adds lambda*theta to g."""

    def __init__(self, hp, params, dtype, decoupled: bool):
        super().__init__(hp, params, dtype)
        self.decoupled = decoupled

    def update_range(self, key, theta_r: np.ndarray, g: np.ndarray, eta: float, lam: float, t: int) -> None:
        """In-place AdamW/Adam on one contiguous range (theta_r is a view)."""
        dt = self.dtype
        b1, b2, eps = float(self.hp["beta1"]), float(self.hp["beta2"]), float(self.hp["eps"])
        amsgrad = bool(self.hp.get("amsgrad", False))
        st = self.state.setdefault(key, {"m": np.zeros_like(g), "v": np.zeros_like(g), "vmax": np.zeros_like(g)})
        if self.decoupled:
            theta_r *= _c(1.0 - eta * lam, dt)
        elif lam != 0.0:
            g = g + _c(lam, dt) * theta_r
        st["m"] = _c(b1, dt) * st["m"] + _c(1.0 - b1, dt) * g
        st["v"] = _c(b2, dt) * st["v"] + _c(1.0 - b2, dt) * (g * g)
        v = st["v"]
        if amsgrad:
            st["vmax"] = np.maximum(st["vmax"], v)
            v = st["vmax"]
        denom = np.sqrt(v) / _c(math.sqrt(1.0 - b2 ** t), dt) + _c(eps, dt)
        theta_r -= _c(eta / (1.0 - b1 ** t), dt) * (st["m"] / denom)

    def step(self, theta, buf, lr, grad_scale, t):
        for i, p in enumerate(self.params):
            r = slice(p.offset, p.offset + p.numel)
            self.update_range(i, theta[r], _c(grad_scale, self.dtype) * buf[r], lr * p.lr_scale, p.weight_decay, t)
        buf[:] = 0


class _SGDNumpy(_Optimizer):
    """SGD with heavy-ball / Nesterov momentum as torch.optim.SGD computes it (dampening 0)."""

    def step(self, theta, buf, lr, grad_scale, t):
        dt = self.dtype
        mu, nesterov = float(self.hp["momentum"]), bool(self.hp["nesterov"])
        assert float(self.hp["dampening"]) == 0.0
        for i, p in enumerate(self.params):
            r = slice(p.offset, p.offset + p.numel)
            g = _c(grad_scale, dt) * buf[r]
            if p.weight_decay != 0.0:
                g = g + _c(p.weight_decay, dt) * theta[r]
            d = g
            if mu != 0.0:
                b = g.copy() if t == 1 else _c(mu, dt) * self.state[i]["b"] + g
                self.state[i] = {"b": b}
                d = g + _c(mu, dt) * b if nesterov else b
            theta[r] -= _c(lr * p.lr_scale, dt) * d
        buf[:] = 0


# --------------------------------------------------------------------------
# Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms")
# --------------------------------------------------------------------------


class _Lion(_Optimizer):
    def step(self, theta, buf, lr, grad_scale, t):
        dt = self.dtype
        b1, b2 = float(self.hp["beta1"]), float(self.hp["beta2"])
        for i, p in enumerate(self.params):
            r = slice(p.offset, p.offset + p.numel)
            g = _c(grad_scale, dt) * buf[r]
            m = self.state.setdefault(i, {"m": np.zeros_like(g)})["m"]
            eta, lam = lr * p.lr_scale, p.weight_decay
            c = _c(b1, dt) * m + _c(1.0 - b1, dt) * g          # interpolation for the sign (Alg. 2)
            self.trace.append({"param": p.name, "t": t, "c": c.copy()})
            theta[r] = theta[r] * _c(1.0 - eta * lam, dt) - _c(eta, dt) * np.sign(c)   # np.sign(0) = 0
            self.state[i]["m"] = _c(b2, dt) * m + _c(1.0 - b2, dt) * g   # momentum tracks with beta2
        buf[:] = 0


# --------------------------------------------------------------------------
# Adam-mini (Zhang et al. 2024, arXiv 2406.16793): one second moment per block
# --------------------------------------------------------------------------


class _AdamMini(_Optimizer):
    def step(self, theta, buf, lr, grad_scale, t):
        dt = self.dtype
        b1, b2, eps = float(self.hp["beta1"]), float(self.hp["beta2"]), float(self.hp["eps"])
        for i, p in enumerate(self.params):
            eta, lam = lr * p.lr_scale, p.weight_decay
            for j, (start, rows, cols, br) in enumerate(p.seg_ranges()):
                assert rows % br == 0, (p.name, rows, br)
                nb = rows // br
                r = slice(start, start + rows * cols)
                g = (_c(grad_scale, dt) * buf[r]).reshape(nb, br * cols)   # one row per block
                st = self.state.setdefault((i, j), {"m": np.zeros_like(g), "v": self.zeros(nb)})
                st["m"] = _c(b1, dt) * st["m"] + _c(1.0 - b1, dt) * g
                # v_B = b2*v_B + (1-b2) * mean_{i in B} g_i^2
                st["v"] = _c(b2, dt) * st["v"] + _c(1.0 - b2, dt) * np.mean(g * g, axis=1)
                denom = np.sqrt(st["v"] / _c(1.0 - b2 ** t, dt)) + _c(eps, dt)       # one per block
                denom_full = np.broadcast_to(denom[:, None], g.shape)
                self.trace.append({"param": p.name, "seg": j, "t": t, "denom": denom_full.reshape(-1).copy()})
                th = theta[r].reshape(nb, br * cols)
                th = th * _c(1.0 - eta * lam, dt) - _c(eta, dt) * (st["m"] / _c(1.0 - b1 ** t, dt)) / denom_full
                theta[r] = th.reshape(-1)
        buf[:] = 0


# --------------------------------------------------------------------------
# Factored second moments shared by Adafactor and CAME
# --------------------------------------------------------------------------


def _rms(x: np.ndarray):
    return np.sqrt(np.mean(x * x))


def _factored_update(R, C, g, u, beta, dt):
    """R = beta*R + (1-beta)*rowmean(u); C likewise with colmean; returns (R, C, g_ij / sqrt(R_i/mean(R) * C_j))
    (Shazeer & Stern 2018, Alg. 4; the row factor normalised by its mean as in transformers / CAME)."""
    R = _c(beta, dt) * R + _c(1.0 - beta, dt) * np.mean(u, axis=1)
    C = _c(beta, dt) * C + _c(1.0 - beta, dt) * np.mean(u, axis=0)
    U = g / np.sqrt((R / np.mean(R))[:, None] * C[None, :])
    return R, C, U


# --------------------------------------------------------------------------
# Adafactor (Shazeer & Stern 2018), Hugging Face transformers semantics, per segment
# --------------------------------------------------------------------------


class _Adafactor(_Optimizer):
    def step(self, theta, buf, lr, grad_scale, t):
        dt, hp = self.dtype, self.hp
        eps1, eps2 = float(hp["eps"]), float(hp["eps2"])
        beta1, clip = float(hp["beta1"]), float(hp["clip_threshold"])
        beta2t = 1.0 - float(t) ** float(hp["decay_rate"])         # beta2_hat_t = 1 - t^-0.8 (Sec. 7.2)
        for i, p in enumerate(self.params):
            for j, (start, rows, cols, _br) in enumerate(p.seg_ranges()):
                r = slice(start, start + rows * cols)
                g = (_c(grad_scale, dt) * buf[r]).reshape(rows, cols)
                th = theta[r].reshape(rows, cols)
                factored = p.matrix                                  # a 1-D parameter is unfactored
                st = self.state.setdefault((i, j), {
                    "R": self.zeros(rows), "C": self.zeros(cols), "V": np.zeros_like(g), "M": np.zeros_like(g)})
                rms_theta = float(_rms(th))                          # before any change
                # relative step size rho_t = min(1e-2, 1/sqrt(t)) (Sec. 8), warmup_init min(1e-6 t, 1/sqrt(t))
                if hp["relative_step"]:
                    rho = min(1e-6 * t if hp["warmup_init"] else 1e-2, 1.0 / math.sqrt(t))
                    alpha = rho * p.lr_scale
                else:
                    alpha = lr * p.lr_scale
                if hp["scale_parameter"]:
                    alpha *= max(eps2, rms_theta)                    # parameter-scale step (Sec. 8)
                u = g * g + _c(eps1, dt)
                if factored:
                    st["R"], st["C"], U = _factored_update(st["R"], st["C"], g, u, beta2t, dt)
                else:
                    st["V"] = _c(beta2t, dt) * st["V"] + _c(1.0 - beta2t, dt) * u
                    U = g / np.sqrt(st["V"])
                rms_pre = float(_rms(U))
                U = U / _c(max(1.0, rms_pre / clip), dt)             # update clipping (Sec. 6)
                self.trace.append({"param": p.name, "seg": j, "t": t, "rms_pre": rms_pre, "rms": float(_rms(U))})
                U = _c(alpha, dt) * U
                if beta1 > 0.0:
                    st["M"] = _c(beta1, dt) * st["M"] + _c(1.0 - beta1, dt) * U
                    U = st["M"]
                th = th - _c(p.weight_decay * alpha, dt) * th - U
                theta[r] = th.reshape(-1)
        buf[:] = 0


# --------------------------------------------------------------------------
# SM3-II (Anil et al. 2019, "Memory-Efficient Adaptive Optimization"), row and column covers
# --------------------------------------------------------------------------


class _SM3(_Optimizer):
    def step(self, theta, buf, lr, grad_scale, t):
        dt = self.dtype
        eps = float(self.hp["eps"])
        for i, p in enumerate(self.params):
            eta, lam = lr * p.lr_scale, p.weight_decay
            for j, (start, rows, cols, _br) in enumerate(p.seg_ranges()):
                r = slice(start, start + rows * cols)
                g = (_c(grad_scale, dt) * buf[r]).reshape(rows, cols)
                st = self.state.setdefault((i, j), {"mr": self.zeros(rows), "mc": self.zeros(cols),
                                                    "mu": np.zeros_like(g)})
                if p.matrix:
                    nu = np.minimum(st["mr"][:, None], st["mc"][None, :]) + g * g   # nu_ij = min over covers + g^2
                else:
                    nu = st["mu"] + g * g                                          # singleton covers
                denom = np.sqrt(nu) + _c(eps, dt)
                step_dir = np.zeros_like(g)
                np.divide(g, denom, out=step_dir, where=nu > 0)                      # 0 where nu = 0
                th = theta[r].reshape(rows, cols) * _c(1.0 - eta * lam, dt) - _c(eta, dt) * step_dir
                theta[r] = th.reshape(-1)
                if p.matrix:
                    st["mr"], st["mc"] = nu.max(axis=1), nu.max(axis=0)             # mu_r = max_j nu, mu_c = max_i nu
                else:
                    st["mu"] = nu
        buf[:] = 0


# --------------------------------------------------------------------------
# CAME (Luo et al. 2023, "Confidence-guided Adaptive Memory Efficient Optimization"; yangluo7/CAME)
# --------------------------------------------------------------------------


class _CAME(_Optimizer):
    def step(self, theta, buf, lr, grad_scale, t):
        dt, hp = self.dtype, self.hp
        b1, b2, b3 = float(hp["beta1"]), float(hp["beta2"]), float(hp["beta3"])
        eps1, eps2, clip = float(hp["eps"]), float(hp["eps2"]), float(hp["clip_threshold"])
        for i, p in enumerate(self.params):
            eta, lam = lr * p.lr_scale, p.weight_decay
            for j, (start, rows, cols, _br) in enumerate(p.seg_ranges()):
                r = slice(start, start + rows * cols)
                g = (_c(grad_scale, dt) * buf[r]).reshape(rows, cols)
                st = self.state.setdefault((i, j), {
                    "R": self.zeros(rows), "C": self.zeros(cols), "V": np.zeros_like(g), "M": np.zeros_like(g),
                    "Rr": self.zeros(rows), "Cr": self.zeros(cols)})
                u = g * g + _c(eps1, dt)
                if p.matrix:
                    st["R"], st["C"], U = _factored_update(st["R"], st["C"], g, u, b2, dt)
                else:
                    st["V"] = _c(b2, dt) * st["V"] + _c(1.0 - b2, dt) * u
                    U = g / np.sqrt(st["V"])
                U = U / _c(max(1.0, float(_rms(U)) / clip), dt)
                st["M"] = _c(b1, dt) * st["M"] + _c(1.0 - b1, dt) * U
                if p.matrix:
                    # confidence: factored second moment of the instability (U - M)^2 (Alg. 1, lines 11-14)
                    res = (U - st["M"]) ** 2 + _c(eps2, dt)
                    st["Rr"], st["Cr"], D = _factored_update(st["Rr"], st["Cr"], st["M"], res, b3, dt)
                else:
                    D = st["M"]
                th = theta[r].reshape(rows, cols) * _c(1.0 - eta * lam, dt) - _c(eta, dt) * D
                theta[r] = th.reshape(-1)
        buf[:] = 0


# --------------------------------------------------------------------------
# Muon (Jordan et al. 2024; Liu et al. / Moonshot AI 2025, "Muon is scalable for LLM training")
# --------------------------------------------------------------------------

NS_COEFFS = (3.4445, -4.7750, 2.0315)


def newton_schulz(U: np.ndarray, steps: int = 5) -> np.ndarray:
    """Quintic Newton-Schulz orthogonalisation of U (Jordan et al. 2024), in U's dtype."""
    a, b, c = NS_COEFFS
    dt = U.dtype
    X = U / (np.sqrt(np.sum(U * U)) + _c(1e-7, dt))
    transposed = X.shape[0] > X.shape[1]
    if transposed:
        X = X.T
    for _ in range(steps):
        A = X @ X.T
        X = _c(a, dt) * X + (_c(b, dt) * A + _c(c, dt) * (A @ A)) @ X
    return X.T if transposed else X


def muon_scale(rows: int, cols: int, kind: str) -> float:
    if kind == "moonshot":
        return 0.2 * math.sqrt(max(rows, cols))   # matches AdamW's update RMS (Liu et al. 2025)
    if kind == "keller":
        return math.sqrt(max(1.0, rows / cols))   # Jordan et al. 2024
    raise ValueError(f"muon_scale {kind!r}")


class _Muon(_Optimizer):
    def __init__(self, hp, params, dtype):
        super().__init__(hp, params, dtype)
        self.adamw = _AdamNumpy({"beta1": hp["beta1"], "beta2": hp["beta2"], "eps": hp["eps"]}, params, dtype,
                                decoupled=True)

    def step(self, theta, buf, lr, grad_scale, t):
        dt, hp = self.dtype, self.hp
        mu, nesterov = float(hp["momentum"]), bool(hp["nesterov"])
        for i, p in enumerate(self.params):
            eta, lam = lr * p.lr_scale, p.weight_decay
            if not p.hidden:   # embeddings, head, norms, biases: AdamW
                r = slice(p.offset, p.offset + p.numel)
                self.adamw.update_range(i, theta[r], _c(grad_scale, dt) * buf[r], eta, lam, t)
                continue
            for j, (start, rows, cols, _br) in enumerate(p.seg_ranges()):
                r = slice(start, start + rows * cols)
                g = (_c(grad_scale, dt) * buf[r]).reshape(rows, cols)
                st = self.state.setdefault((i, j), {"B": np.zeros_like(g)})
                st["B"] = _c(mu, dt) * st["B"] + _c(1.0 - mu, dt) * g
                U = _c(1.0 - mu, dt) * g + _c(mu, dt) * st["B"] if nesterov else st["B"]
                X = newton_schulz(U, int(hp["ns_steps"]))
                s = muon_scale(rows, cols, str(hp["muon_scale"]))
                th = theta[r].reshape(rows, cols) * _c(1.0 - eta * lam, dt) - _c(eta * s, dt) * X
                theta[r] = th.reshape(-1)
        buf[:] = 0


# --------------------------------------------------------------------------
# LDAdam (Robert et al. 2024, arXiv 2410.16103, "LDAdam: Adaptive Optimization from Low-Dimensional
# Gradient Statistics"): projection-aware moment updates + generalized error feedback
# --------------------------------------------------------------------------


def gram_schmidt(Y: np.ndarray) -> np.ndarray:
    """Q of the thin QR of Y (columns orthonormalised in order, R's diagonal > 0), modified Gram-Schmidt."""
    Q = Y.astype(Y.dtype, copy=True)
    for k in range(Q.shape[1]):
        for i in range(k):
            Q[:, k] -= (Q[:, i] @ Q[:, k]) * Q[:, i]
        Q[:, k] /= np.sqrt(Q[:, k] @ Q[:, k])
    return Q


def leading_eigvecs(G: np.ndarray, r: int) -> np.ndarray:
    """The r leading eigenvectors of G G^T (= left singular vectors of G), largest eigenvalue first."""
    w, V = np.linalg.eigh(G @ G.T)        # ascending
    return V[:, ::-1][:, :r].copy()


class _LDAdam(_Optimizer):
    def __init__(self, hp, params, dtype):
        super().__init__(hp, params, dtype)
        self.adamw = _AdamNumpy({"beta1": hp["beta1"], "beta2": hp["beta2"], "eps": hp["eps"]}, params, dtype,
                                decoupled=True)

    def _segment(self, key, G: np.ndarray, t: int, r: int):
        """Projected step for one m' x n' segment (m' <= n'); returns (direction m' x n', error E)."""
        dt = self.dtype
        b1, b2, rho, eps = (float(self.hp[k]) for k in ("beta1", "beta2", "rho", "eps"))
        st = self.state.get(key)
        if t == 1:
            P = leading_eigvecs(G, r)                          # P_1: left singular vectors of G
            Mt = self.zeros(r, G.shape[1])
            Vt = self.zeros(r, G.shape[1])
        else:
            Pp, M, V = st["P"], st["M"], st["V"]
            bc1p, bc2p = 1.0 - b1 ** (t - 1), 1.0 - b2 ** (t - 1)
            # subspace from a mix of the (debiased) reconstructed momentum and the new gradient (Alg. 1)
            b = _c(rho, dt) * (Pp @ M) / _c(bc1p, dt) + _c(1.0 - rho, dt) * G
            Y = b @ (b.T @ Pp)                                  # one block power iteration, warm start P_{t-1}
            P = gram_schmidt(Y)
            Q = P.T @ Pp                                        # change of basis old -> new subspace
            # projection-aware moment updates (Sec. 3.2)
            Mt = Q @ M
            Vt = _c(bc2p, dt) * np.abs((Q * Q) @ (V / _c(bc2p, dt) - M * M / _c(bc1p ** 2, dt))
                                       + Mt * Mt / _c(bc1p ** 2, dt))
        Gh = P.T @ G
        E = G - P @ Gh                                          # generalized error feedback (Sec. 3.3)
        if t > 1:
            E = E + _c(b1 / (1.0 - b1), dt) * (Pp @ M - P @ Mt)
        M = _c(b1, dt) * Mt + _c(1.0 - b1, dt) * Gh
        V = _c(b2, dt) * Vt + _c(1.0 - b2, dt) * (Gh * Gh)
        self.state[key] = {"P": P, "M": M, "V": V}
        D = P @ ((M / _c(1.0 - b1 ** t, dt)) / (np.sqrt(V / _c(1.0 - b2 ** t, dt)) + _c(eps, dt)))
        return D, E

    def step(self, theta, buf, lr, grad_scale, t):
        dt = self.dtype
        rank = int(self.hp["rank"])
        newbuf = np.zeros_like(buf)                             # everything not projected: zeroed
        for i, p in enumerate(self.params):
            eta, lam = lr * p.lr_scale, p.weight_decay
            if not p.hidden:
                r = slice(p.offset, p.offset + p.numel)
                self.adamw.update_range(i, theta[r], _c(grad_scale, dt) * buf[r], eta, lam, t)
                continue
            for j, (start, rows, cols, _br) in enumerate(p.seg_ranges()):
                r = slice(start, start + rows * cols)
                g = (_c(grad_scale, dt) * buf[r]).reshape(rows, cols)
                transposed = rows > cols                         # project on the smaller side
                G = g.T if transposed else g
                rr = min(rank, G.shape[0])
                if rr == G.shape[0]:                             # full rank: identity projector = AdamW
                    self.adamw.update_range((i, j), theta[r], g.reshape(-1), eta, lam, t)
                    continue
                D, E = self._segment((i, j), np.ascontiguousarray(G), t, rr)
                if transposed:
                    D, E = D.T, E.T
                th = theta[r].reshape(rows, cols) * _c(1.0 - eta * lam, dt) - _c(eta, dt) * D
                theta[r] = th.reshape(-1)
                newbuf[r] = E.reshape(-1)
        buf[:] = newbuf


# --------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------

_TORCH_NAMES = ("sgd", "momentum", "nesterov", "adagrad", "rmsprop", "adam", "adamw")


def make_optimizer(name: str, hp: Optional[dict], params, dtype=np.float64, backend: str = "torch") -> _Optimizer:
    hp = resolve_hp(name, hp)
    params = [param_info(p) for p in params]
    if name in _TORCH_NAMES and backend == "numpy":
        if name in ("adam", "adamw"):
            return _AdamNumpy(hp, params, dtype, decoupled=(name == "adamw"))
        if name in ("sgd", "momentum", "nesterov"):
            return _SGDNumpy(hp, params, dtype)
        raise ValueError(f"no numpy twin for {name}")
    if name in _TORCH_NAMES:
        return _TorchOptimizer(name, hp, params, dtype)
    cls = {"adafactor": _Adafactor, "sm3": _SM3, "lion": _Lion, "adam-mini": _AdamMini, "came": _CAME,
           "ldadam": _LDAdam, "muon": _Muon}[name]
    return cls(hp, params, dtype)


def run_optimizer(name: str, hp: Optional[dict], params, theta0: np.ndarray, grads: Sequence[np.ndarray],
                  lrs: Sequence[float], grad_scales: Sequence[float], dtype=np.float64, backend: str = "torch",
                  return_optimizer: bool = False):
    """Run len(grads) steps of optimizer `name`; return [theta after step 1, ..., after step S].

    params: ParamInfo or spec dicts, covering theta0; grads[k] is step k's raw gradient (flat);
    the optimizer sees g = grad_scales[k] * buffer with buffer = grads[k] (+ LDAdam's error E)."""
    assert len(grads) == len(lrs) == len(grad_scales)
    opt = make_optimizer(name, hp, params, dtype, backend)
    theta = np.array(theta0, dtype=dtype, copy=True)
    buf = np.zeros_like(theta)
    out = []
    for k in range(len(grads)):
        buf += np.asarray(grads[k], dtype=dtype)
        opt.step(theta, buf, float(lrs[k]), float(grad_scales[k]), k + 1)
        out.append(theta.copy())
    return (out, opt) if return_optimizer else out
