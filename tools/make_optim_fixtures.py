#!/usr/bin/python3
"""Generate the optimizer golden fixture for Loom's C++ optimizers.

    /usr/bin/python3 tools/make_optim_fixtures.py --out DIR [--check]

writes DIR/optim_golden.safetensors, all tensors F64 of shape (P,):

    params               initial flat parameter vector (float32-representable)
    grad.{k}             raw gradient of step k (k = 0..3; float32-representable)
    {case}.params.{k}    reference parameters after step k+1 of that case

and `__metadata__["spec"]`, a JSON string: total, steps, lrs, grad_scales, the parameter list
(name, shape, offset, numel, segments [{rows, block_rows}], matrix, hidden, weight_decay,
lr_scale) and the cases [{name, set, tolerance}].  `set` is the Loom config override string the
C++ test applies (every hyperparameter of the optimizer spelled out; weight decay is per
parameter and handed over directly).  Step k sees schedule lr lrs[k] and g = grad_scales[k] *
buffer, the buffer holding grad.{k} (plus, for LDAdam's projected segments, the previous step's
error E).  Tolerance: max|cpp - ref| / max|ref| over the flat vector.

The references come from tools/optim_reference.py (float64; torch.optim for the seven torch
rules).  Output is deterministic and byte-identical across runs.

--check verifies properties of the rules in float64 (see `run_checks`) and replays every case in
float32 to show the tolerances leave room for a float32 implementation.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Dict, List, Tuple

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import loom_reference as lref  # noqa: E402  (safetensors writer)
import optim_reference as oref  # noqa: E402

SEED = 20240917
STEPS = 4
LRS = [0.03, 0.02, 0.015, 0.01]
GRAD_SCALES = [1.0, 0.5, 1.0, 0.8]
ZERO_EMB_ROWS = (3, 7)

# (name, shape, segments [(rows, block_rows)], matrix, hidden, weight_decay, lr_scale)
PARAM_TABLE = [
    ("emb", (11, 8), [(11, 1)], True, False, 0.0, 0.5),
    ("qkv", (24, 8), [(8, 4), (8, 4), (8, 1)], True, True, 0.1, 1.0),   # Q, K (head_dim 4), V
    ("qkv_bias", (24,), [(1, 1)], False, False, 0.0, 1.0),
    ("fc", (20, 8), [(20, 1)], True, True, 0.1, 1.0),                   # rows > cols
    ("proj", (8, 20), [(8, 1)], True, True, 0.1, 2.0),                  # rows < cols
    ("norm", (8,), [(1, 1)], False, False, 0.0, 1.0),
]

TOL_TIGHT, TOL_LOOSE = 1e-6, 1e-5

# case name -> (optimizer, hyperparameters, tolerance).  config_set() spells out every
# hyperparameter of the optimizer (these overrides on top of the doc's defaults).
CASES: List[Tuple[str, str, dict, float]] = [
    ("sgd", "sgd", {"momentum": 0.0, "dampening": 0.0, "nesterov": False}, TOL_TIGHT),
    ("momentum", "momentum", {"momentum": 0.9, "dampening": 0.0, "nesterov": False}, TOL_TIGHT),
    ("nesterov", "nesterov", {"momentum": 0.9, "dampening": 0.0, "nesterov": True}, TOL_TIGHT),
    ("adagrad", "adagrad", {"lr_decay": 0.01, "initial_accumulator": 0.1, "eps": 1e-10}, TOL_TIGHT),
    ("rmsprop", "rmsprop", {"beta2": 0.99, "eps": 1e-8, "momentum": 0.0, "centered": False}, TOL_TIGHT),
    ("rmsprop_centered", "rmsprop", {"beta2": 0.99, "eps": 1e-8, "momentum": 0.5, "centered": True}, TOL_TIGHT),
    ("adam", "adam", {"beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "amsgrad": False}, TOL_TIGHT),
    ("adam_amsgrad", "adam", {"beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "amsgrad": True}, TOL_TIGHT),
    ("adamw", "adamw", {"beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "amsgrad": False}, TOL_TIGHT),
    ("adamw_amsgrad", "adamw", {"beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "amsgrad": True}, TOL_TIGHT),
    ("adafactor", "adafactor", {"beta1": 0.0, "eps": 1e-30, "eps2": 1e-3, "clip_threshold": 1.0,
                                "decay_rate": -0.8, "relative_step": True, "scale_parameter": True,
                                "warmup_init": False}, TOL_TIGHT),
    ("adafactor_ext", "adafactor", {"beta1": 0.9, "eps": 1e-30, "eps2": 1e-3, "clip_threshold": 1.0,
                                    "decay_rate": -0.8, "relative_step": False, "scale_parameter": False,
                                    "warmup_init": False}, TOL_TIGHT),
    ("sm3", "sm3", {"eps": 0.0}, TOL_TIGHT),
    ("lion", "lion", {"beta1": 0.9, "beta2": 0.99}, TOL_TIGHT),
    ("adam_mini", "adam-mini", {"beta1": 0.9, "beta2": 0.999, "eps": 1e-8}, TOL_TIGHT),
    ("came", "came", {"beta1": 0.9, "beta2": 0.999, "beta3": 0.9999, "eps": 1e-30, "eps2": 1e-16,
                      "clip_threshold": 1.0}, TOL_TIGHT),
    ("ldadam", "ldadam", {"rank": 3, "rho": 0.908, "beta1": 0.908, "beta2": 0.99, "eps": 1e-8}, TOL_LOOSE),
    ("ldadam_full", "ldadam", {"rank": 8, "rho": 0.908, "beta1": 0.908, "beta2": 0.99, "eps": 1e-8}, TOL_LOOSE),
    ("muon", "muon", {"momentum": 0.95, "nesterov": True, "ns_steps": 5, "muon_scale": "moonshot",
                      "beta1": 0.9, "beta2": 0.95, "eps": 1e-8}, TOL_LOOSE),
    ("muon_keller", "muon", {"momentum": 0.95, "nesterov": True, "ns_steps": 5, "muon_scale": "keller",
                             "beta1": 0.9, "beta2": 0.95, "eps": 1e-8}, TOL_LOOSE),
]


def build_params() -> List[oref.ParamInfo]:
    out, offset = [], 0
    for name, shape, segs, matrix, hidden, wd, scale in PARAM_TABLE:
        numel = int(np.prod(shape))
        out.append(oref.param_info({"name": name, "shape": shape, "offset": offset, "numel": numel,
                                    "segments": segs, "matrix": matrix, "hidden": hidden,
                                    "weight_decay": wd, "lr_scale": scale}))
        offset += numel
    return out


def f32(x: np.ndarray) -> np.ndarray:
    """Round float64 values through float32 (so a float32 engine reads them exactly)."""
    return x.astype(np.float32).astype(np.float64)


def build_inputs(params: List[oref.ParamInfo]) -> Tuple[np.ndarray, List[np.ndarray]]:
    total = sum(p.numel for p in params)
    rng = np.random.default_rng(SEED)
    theta0 = f32(rng.standard_normal(total))
    grads = []
    emb = next(p for p in params if p.name == "emb")
    for _ in range(STEPS):
        g = f32(rng.standard_normal(total))
        for row in ZERO_EMB_ROWS:   # all-zero rows: zero-gradient handling (0/0 guards, sign(0), ...)
            start = emb.offset + row * emb.cols
            g[start:start + emb.cols] = 0.0
        grads.append(g)
    return theta0, grads


def run_case(opt: str, hp: dict, params, theta0, grads, dtype=np.float64, **kw):
    return oref.run_optimizer(opt, hp, params, theta0, grads, LRS, GRAD_SCALES, dtype=dtype, **kw)


def build_fixture() -> Tuple[Dict[str, torch.Tensor], Dict[str, str], dict]:
    params = build_params()
    theta0, grads = build_inputs(params)
    tensors: Dict[str, torch.Tensor] = {"params": torch.from_numpy(theta0.copy())}
    for k, g in enumerate(grads):
        tensors[f"grad.{k}"] = torch.from_numpy(g.copy())
    cases = []
    results = {}
    for name, opt, hp, tol in CASES:
        traj = run_case(opt, hp, params, theta0, grads)
        results[name] = traj
        for k, th in enumerate(traj):
            tensors[f"{name}.params.{k}"] = torch.from_numpy(th.copy())
        cases.append({"name": name, "set": oref.config_set(opt, hp), "tolerance": tol})
    spec = {
        "total": int(theta0.size), "steps": STEPS, "lrs": LRS, "grad_scales": GRAD_SCALES,
        "params": [p.to_dict() for p in params], "cases": cases,
    }
    ctx = {"params": params, "theta0": theta0, "grads": grads, "results": results}
    return tensors, {"spec": json.dumps(spec)}, ctx


# --------------------------------------------------------------------------
# --check
# --------------------------------------------------------------------------


def _rel_err(a: np.ndarray, ref: np.ndarray) -> float:
    return float(np.max(np.abs(a - ref)) / np.max(np.abs(ref)))


def run_checks(ctx: dict, blob: bytes) -> bool:
    params, theta0, grads, results = ctx["params"], ctx["theta0"], ctx["grads"], ctx["results"]
    by = {p.name: p for p in params}
    hp_of = {name: (opt, hp, tol) for name, opt, hp, tol in CASES}
    ok_all = True

    def report(label: str, ok: bool, detail: str) -> None:
        nonlocal ok_all
        ok_all &= ok
        print(f"  [{'ok' if ok else 'FAIL'}] {label}: {detail}")

    def rng_of(p):
        return slice(p.offset, p.offset + p.numel)

    print("checks (float64):")

    # 1. torch Adam, t = 1: theta_1 - theta_0 = -eta * g / (|g| + eps) ~= -eta * sign(g) without decay
    th1 = results["adam"][0]
    worst, worst_bound_ratio = 0.0, 0.0
    for p in params:
        if p.weight_decay != 0.0:
            continue
        r = rng_of(p)
        eta = LRS[0] * p.lr_scale
        g = GRAD_SCALES[0] * grads[0][r]
        dev = np.abs((th1[r] - theta0[r]) + eta * np.sign(g))
        bound = eta * 1e-8 / np.maximum(np.abs(g), 1e-300) + 1e-14   # |eta*g/(|g|+eps) - eta*sign g| <= eta*eps/|g|
        bound[g == 0] = 1e-300
        worst = max(worst, float(dev.max() / eta))
        worst_bound_ratio = max(worst_bound_ratio, float(np.max(dev / bound)))
    report("adam t=1 update == lr*sign(g) (emb, qkv_bias, norm; zero emb rows stay put)",
           worst_bound_ratio <= 1.0, f"max |delta + eta*sign(g)| / eta = {worst:.2e} (within eps/|g| bound)")

    # 2. Lion with lambda = 0: |delta theta| == eta elementwise, every step ('norm')
    p = by["norm"]
    r = rng_of(p)
    traj = [theta0] + results["lion"]
    dev = max(float(np.max(np.abs(np.abs(traj[k + 1][r] - traj[k][r]) - LRS[k] * p.lr_scale))) for k in range(STEPS))
    report("lion |delta theta| == eta on 'norm' (lambda 0), 4 steps", dev <= 1e-12, f"max deviation {dev:.1e}")
    _, lion_opt = run_case("lion", hp_of["lion"][1], params, theta0, grads, return_optimizer=True)
    # sign(c) must not flip under float32 rounding: |c| relative to the size of its two terms
    margin = np.inf
    for tr in lion_opt.trace:
        c = tr["c"]
        nz = c != 0
        if nz.any():
            margin = min(margin, float(np.min(np.abs(c[nz]))))
    report("lion sign margin (no sign flips under float32 rounding)", margin > 1e-5,
           f"min |c| over nonzero c = {margin:.2e} (terms are O(0.1..1); float32 rounding ~1e-7)")

    # 3. Adafactor: RMS of the clipped update <= clip_threshold (before lr scaling)
    for case in ("adafactor", "adafactor_ext"):
        opt, hp, _ = hp_of[case]
        _, af = run_case(opt, hp, params, theta0, grads, return_optimizer=True)
        clip = hp["clip_threshold"]
        mx = max(tr["rms"] for tr in af.trace)
        nclip = sum(tr["rms_pre"] > clip for tr in af.trace)
        report(f"{case} update RMS <= clip {clip:g} (before lr)", mx <= clip * (1 + 1e-12),
               f"max RMS {mx:.15f}; clipping active in {nclip}/{len(af.trace)} segment-steps")

    # 4. Adam-mini: one denominator per block (from the trace, and recovered from the step-1 output)
    opt, hp, _ = hp_of["adam_mini"]
    _, am = run_case(opt, hp, params, theta0, grads, return_optimizer=True)
    spread, nblocks = 0.0, 0
    for tr in am.trace:
        p = by[tr["param"]]
        _start, rows, cols, br = list(p.seg_ranges())[tr["seg"]]
        d = tr["denom"].reshape(rows // br, br * cols)
        spread = max(spread, float(np.max(d.max(axis=1) - d.min(axis=1))))
        nblocks += d.shape[0]
    # step 1 output: theta1 = theta0*(1-eta*l) - eta*g/denom  =>  denom_i = eta*g_i / (theta0_i*(1-eta*l) - theta1_i)
    th1 = results["adam_mini"][0]
    rec_spread = 0.0
    for p in params:
        eta = LRS[0] * p.lr_scale
        for start, rows, cols, br in p.seg_ranges():
            r = slice(start, start + rows * cols)
            g = GRAD_SCALES[0] * grads[0][r]
            step = theta0[r] * (1 - eta * p.weight_decay) - th1[r]
            for blk_g, blk_s in zip(g.reshape(-1, br * cols), step.reshape(-1, br * cols)):
                nz = np.abs(blk_g) > 1e-3
                if nz.sum() < 2:
                    continue
                den = eta * blk_g[nz] / blk_s[nz]
                rec_spread = max(rec_spread, float((den.max() - den.min()) / den.mean()))
    report("adam-mini one denominator per block", spread == 0.0 and rec_spread < 1e-8,
           f"{nblocks} block-steps, in-block spread {spread:g}; recovered from step-1 output: rel spread {rec_spread:.1e}")

    # 5. LDAdam at full rank == AdamW with the LDAdam betas (torch.optim.AdamW)
    opt, hp, _ = hp_of["ldadam_full"]
    ref = run_case("adamw", {"beta1": hp["beta1"], "beta2": hp["beta2"], "eps": hp["eps"], "amsgrad": False},
                   params, theta0, grads)
    err = max(_rel_err(a, b) for a, b in zip(results["ldadam_full"], ref))
    report("ldadam_full == torch AdamW(0.908, 0.99, 1e-8)", err <= 1e-12, f"max rel diff {err:.1e}")
    # LDAdam rank 3: eigen-gap of G G^T at t=1 (conditioning of the initial subspace) and error feedback live
    gaps = []
    for p in params:
        if not p.hidden:
            continue
        for start, rows, cols, _br in p.seg_ranges():
            g = (GRAD_SCALES[0] * grads[0][start:start + rows * cols]).reshape(rows, cols)
            G = g.T if rows > cols else g
            w = np.linalg.eigvalsh(G @ G.T)[::-1]
            rk = hp_of["ldadam"][1]["rank"]
            gaps.append((w[rk - 1] - w[rk]) / w[0])
    report("ldadam rank 3: relative eigen-gap lambda_3 - lambda_4 of G G^T at t=1", min(gaps) > 1e-3,
           "per hidden segment " + ", ".join(f"{x:.3f}" for x in gaps))
    _, ld = run_case("ldadam", hp_of["ldadam"][1], params, theta0, grads, return_optimizer=True)
    P = ld.state[(1, 0)]["P"]
    orth = float(np.max(np.abs(P.T @ P - np.eye(P.shape[1]))))
    report("ldadam projector orthonormal after 4 steps (qkv Q)", orth < 1e-12, f"max |P^T P - I| = {orth:.1e}")

    # 6. Muon: NS5 output singular values in [0.5, 1.5]
    rng = np.random.default_rng(7)
    svs = []
    for shape in ((20, 8), (8, 20)):
        s = np.linalg.svd(oref.newton_schulz(rng.standard_normal(shape), 5), compute_uv=False)
        svs.append((shape, s.min(), s.max()))
    fixture_sv = []
    for p in params:
        if p.hidden:
            for start, rows, cols, _br in p.seg_ranges():
                g = grads[0][start:start + rows * cols].reshape(rows, cols)
                s = np.linalg.svd(oref.newton_schulz(g, 5), compute_uv=False)
                fixture_sv += [s.min(), s.max()]
    report("muon NS5 singular values in [0.5, 1.5]", all(0.5 <= a and b <= 1.5 for _, a, b in svs),
           "; ".join(f"{s[0]}x{s[1]}: [{a:.4f}, {b:.4f}]" for s, a, b in svs)
           + f"; fixture step-1 gradient segments: [{min(fixture_sv):.4f}, {max(fixture_sv):.4f}]")

    # 7. Independent numpy Adam / AdamW / SGD(-momentum) == torch.optim
    for name in ("sgd", "momentum", "nesterov", "adam", "adam_amsgrad", "adamw", "adamw_amsgrad"):
        opt, hp, _ = hp_of[name]
        twin = run_case(opt, hp, params, theta0, grads, backend="numpy")
        err = max(_rel_err(a, b) for a, b in zip(twin, results[name]))
        report(f"numpy {name} == torch.optim", err <= 1e-12, f"max rel diff {err:.1e}")

    # 8. Zero-gradient rows of 'emb' (weight decay 0) never move, in every case
    emb = by["emb"]
    moved = []
    for name, *_ in CASES:
        for row in ZERO_EMB_ROWS:
            r = slice(emb.offset + row * emb.cols, emb.offset + (row + 1) * emb.cols)
            if any(not np.array_equal(th[r], theta0[r]) or not np.all(np.isfinite(th)) for th in results[name]):
                moved.append(name)
    report("emb zero-gradient rows 3, 7 stay exactly put, all values finite, in all cases", not moved,
           f"{len(CASES)} cases" + (f"; moved in {sorted(set(moved))}" if moved else ""))

    # 9. File: round trip, byte-identical regeneration
    tensors, meta = lref.decode_safetensors(blob)
    spec = json.loads(meta["spec"])
    ok = all(t.dtype == torch.float64 and tuple(t.shape) == (spec["total"],) for t in tensors.values())
    ok &= len(tensors) == 1 + STEPS + STEPS * len(CASES)
    report("safetensors round trip (all F64, shape (P,))", ok, f"{len(tensors)} tensors, P = {spec['total']}")
    t2, m2, _ = build_fixture()
    report("byte-identical regeneration", lref.encode_safetensors(t2, m2) == blob, f"{len(blob)} bytes")

    # 10. float32 replay of each case vs its tolerance (what a float32 engine can expect)
    print("float32 replay (max|f32 - f64| / max|f64| over 4 steps, vs tolerance):")
    for name, opt, hp, tol in CASES:
        traj32 = run_case(opt, hp, params, theta0, grads, dtype=np.float32)
        err = max(_rel_err(a.astype(np.float64), b) for a, b in zip(traj32, results[name]))
        report(f"{name:17s}", err <= tol / 3, f"{err:.2e}  (tolerance {tol:g})")
    return ok_all


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--check", action="store_true", help="run the float64 property checks")
    args = ap.parse_args()
    t0 = time.time()
    torch.set_num_threads(1)
    os.makedirs(args.out, exist_ok=True)
    tensors, meta, ctx = build_fixture()
    blob = lref.encode_safetensors(tensors, meta)
    path = os.path.join(args.out, "optim_golden.safetensors")
    lref.write_safetensors(path, tensors, meta)
    print(f"wrote {path}: {os.path.getsize(path)} bytes, {len(tensors)} tensors, "
          f"{len(CASES)} cases x {STEPS} steps, P = {ctx['theta0'].size}")
    ok = True
    if args.check:
        ok = run_checks(ctx, blob)
        print("all checks passed" if ok else "SOME CHECKS FAILED")
    print(f"done in {time.time() - t0:.1f}s (after imports)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
