"""Reading a `loom train` run folder's metrics.jsonl (shared by the bench/ comparison scripts)."""

from __future__ import annotations

import json
import math
import os


def read_metrics(path: str) -> tuple[dict, list[dict], list[dict]]:
    """(header, step records, evaluation records) of a metrics.jsonl; empty if it is missing."""
    header, steps, evals = {}, [], []
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                try:
                    r = json.loads(line)
                except ValueError:
                    continue  # a line cut short by an interrupted run
                if "val_loss" in r:
                    evals.append(r)
                elif "loss" in r:
                    steps.append(r)
                elif "optimizer" in r:
                    header = r
    return header, steps, evals


def finite(x) -> float | None:
    """x if it is a finite number, else None (loom writes NaN as null)."""
    return x if isinstance(x, (int, float)) and math.isfinite(x) else None
