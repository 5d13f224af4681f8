#!/usr/bin/python3
"""`loom report` on synthetic runs (tests/ops_test.py calls check_report(LOOM, tmp)): resumed steps,
torn lines, escaping, point counts, one-line errors. Standalone: report_check.py <path to loom>; stdlib only."""

from __future__ import annotations

import html
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET

SVG = "{http://www.w3.org/2000/svg}"


def _expect(ok: bool, message: str):
    if not ok:  # not `assert`: python -O would drop it
        raise AssertionError(message)


def _header(parameters: int) -> dict:
    return {"loss_scaling": False, "optimizer": "adamw", "optimizer_state_bytes": 8 * parameters,
            "parameters": parameters,
            "precision": "attn_qkv=f32 attn_out=f32 mlp_in=f32 mlp_out=f32 head=f32 param=f32 reduce=f32 master=f32",
            "schedule": "cosine", "state_bytes_per_param": 8.0}


def _step(step: int, loss: float, mfu: bool = True) -> dict:
    r = {"comm": {}, "comm_bytes_received": 0, "comm_bytes_sent": 0, "grad_norm": 1.0 + 1.0 / step, "loss": loss,
         "loss_scale": 1.0, "lr": 1e-3 * min(1.0, step / 5), "memory_bytes": 100_000_000 + step, "moe": [], "ranks": 1,
         "seconds": 0.5, "skipped": False, "step": step, "tokens": 2048, "tokens_per_s": 4096.0 + step}
    if mfu:
        r["mfu"] = 0.25 + 0.001 * step
    return r


def _val(step: int, loss: float) -> dict:
    memory = {c: {"current": 1 << 20, "peak": (2 << 20) * (i + 1)}
              for i, c in enumerate(("activations", "gradients", "optimizer_state", "parameters", "workspace"))}
    memory["kv_cache"] = {"current": 0, "peak": 0}
    return {"memory": memory, "step": step, "val_loss": loss}


def _lines(records: list) -> list[str]:
    return [json.dumps(r) for r in records]


def check_report(loom: str, tmp: str):
    """Two synthetic runs: `alpha` was killed during step 13 and resumed from its step-10 checkpoint
    (steps 11-13 recorded twice; the cut record shares its line with the resumed run's header),
    then killed mid-write again (a cut-short last line). `beta&<b>` has no MFU and a best
    validation loss before its last. A third run's corrupt middle line is skipped with a warning."""
    env = dict(os.environ, OMP_NUM_THREADS="2")

    def report(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([loom, "report", *args], env=env, capture_output=True, text=True, timeout=120)

    alpha = os.path.join(tmp, "report_runs", "alpha")
    beta = os.path.join(tmp, "report_runs", "beta&<b>")
    out = os.path.join(tmp, "report_out")
    for d in (alpha, beta):
        os.makedirs(d, exist_ok=True)

    new_loss = {s: 5.0 - 0.05 * s for s in range(1, 21)}
    lines = _lines([_header(5_820_416)] + [_step(s, new_loss[s]) for s in range(1, 11)] + [_val(10, 4.25)])
    lines += _lines([_step(s, 99.0) for s in (11, 12)])                # before the kill: replaced below
    lines.append(json.dumps(_step(13, 99.0))[:40] + json.dumps(_header(5_820_416)))  # cut, then --resume's header
    lines += _lines([_step(s, new_loss[s]) for s in range(11, 21)] + [_val(20, 3.87654)])
    alpha_cut_line = len(lines) + 1
    with open(os.path.join(alpha, "metrics.jsonl"), "w") as f:
        f.write("\n".join(lines) + "\n" + json.dumps(_step(21, 1.0))[:50])  # killed mid-write: no newline

    beta_val = {5: 4.0, 10: 3.5, 15: 3.2, 20: 3.3}
    records = [_header(27_382_784)]
    for s in range(1, 21):
        records.append(_step(s, 6.0 - 0.1 * s, mfu=False))
        if s in beta_val:
            records.append(_val(s, beta_val[s]))
    with open(os.path.join(beta, "metrics.jsonl"), "w") as f:
        f.write("\n".join(_lines(records)) + "\n")

    p = report(alpha, beta, "--out", out)
    _expect(p.returncode == 0, f"loom report failed ({p.returncode}):\n{p.stdout}\n{p.stderr}")
    _expect(f"{alpha}/metrics.jsonl:{alpha_cut_line}" in p.stdout + p.stderr,
            f"no warning for the cut last line:\n{p.stderr}")

    with open(os.path.join(out, "index.html")) as f:
        page = f.read()
    _expect(page.startswith("<!DOCTYPE html>"), page[:100])
    _expect("alpha" in page and html.escape("beta&<b>") in page, "run names missing or unescaped")
    _expect("beta&<b>" not in page, "a run name written unescaped")
    final_train = sum(new_loss[s] for s in range(11, 21)) / 10  # the resumed records, not the 99s they replace
    expected = [f"{final_train:.4f}", "3.8765", f"{math.exp(3.87654):.2f}",  # alpha: final train loss, val loss, ppl
                "3.2000", f"{math.exp(3.2):.2f}", "3.3000", f"{math.exp(3.3):.2f}"]  # beta: best and final val
    for number in expected:
        _expect(number in page, f"{number} not in index.html")

    images = re.findall(r'<img src="([^"]+)"', page)
    _expect("loss.svg" in images and "mfu.svg" in images, images)
    _expect(not os.path.exists(os.path.join(out, "reward.svg")), "a chart of a series no run recorded")
    curves = {}
    for name in images:
        _expect(not os.path.isabs(name) and "/" not in name, f"not a relative path: {name}")
        root = ET.parse(os.path.join(out, name)).getroot()  # each SVG is well-formed XML
        _expect(root.tag == SVG + "svg", root.tag)
        for line in root.iter(SVG + "polyline"):
            title = line.find(SVG + "title")
            curves[(name, title.text if title is not None else "")] = len(line.get("points").split())
    _expect(curves.get(("loss.svg", "alpha: training loss")) == 20, curves)  # steps 11-13 once each
    _expect(curves.get(("loss.svg", "alpha: validation loss")) == 2, curves)
    _expect(curves.get(("loss.svg", "beta&<b>: training loss")) == 20, curves)
    _expect(curves.get(("loss.svg", "beta&<b>: validation loss")) == 4, curves)
    _expect(curves.get(("mfu.svg", "alpha: MFU")) == 20, curves)
    _expect(("mfu.svg", "beta&<b>: MFU") not in curves, "beta records no MFU: no curve for it")

    bad = os.path.join(tmp, "report_runs", "corrupt")
    os.makedirs(bad, exist_ok=True)
    with open(os.path.join(bad, "metrics.jsonl"), "w") as f:
        f.write("\n".join(_lines([_header(1000), _step(1, 5.0)]) + ['{"step": 2, "loss": oops}'] +
                          _lines([_step(3, 4.0)])) + "\n")
    p = report(beta, bad, "--out", os.path.join(tmp, "report_bad"))
    _expect(p.returncode == 0, f"a corrupt middle line refused the report:\n{p.stdout}\n{p.stderr}")
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    _expect(len(lines) == 1 and f"{bad}/metrics.jsonl:3: not valid JSON" in lines[0] and "skipped" in lines[0],
            f"not one warning naming the file and line:\n{p.stderr}")
    root = ET.parse(os.path.join(tmp, "report_bad", "loss.svg")).getroot()
    points = [len(line.get("points").split()) for line in root.iter(SVG + "polyline")
              if (line.find(SVG + "title") is not None and line.find(SVG + "title").text == "corrupt: training loss")]
    _expect(points == [2], f"steps 1 and 3 around the skipped line: {points}")
    p = report(os.path.join(tmp, "report_runs", "nowhere"), "--out", os.path.join(tmp, "report_none"))
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    _expect(p.returncode != 0 and len(lines) == 1 and "nowhere" in lines[0],
            f"not one line naming the missing run:\n{p.stderr}")


if __name__ == "__main__":
    with tempfile.TemporaryDirectory(prefix="loom_report_") as tmp_dir:
        check_report(os.path.abspath(sys.argv[1]) if len(sys.argv) > 1 else "build/bin/loom", tmp_dir)
    print("ok")
