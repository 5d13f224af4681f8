#!/usr/bin/python3
"""Behaviour baseline of `loom train`: small runs over the configurations the engine supports (every
objective, precision recipes, PEFT, MoE and MLA, stateful optimizers, anomaly policies, resume,
and the parallel layouts over mpirun), each reduced to what must not change when the code is
restructured: the metrics records without their timings, the checkpoints' bytes, the sample.

  train_baseline.py record LOOM OUT.json [NAME...]   run the configurations with LOOM, write OUT.json
  train_baseline.py compare A.json B.json            every difference, exit 1 if there is one

Used before and after a refactoring (issue 43: bitwise the same losses, gradient norms, samples,
checkpoints and metrics.jsonl records). What is measured (MEASURED below) is dropped; everything
else is compared exactly. stdlib only."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEXT = "/usr/share/common-licenses/GPL-3"
TINY = ("model.n_layer=2,model.n_head=2,model.n_kv_head=2,model.d_model=32,model.d_ff=64,model.max_seq_len=32,"
        "train.seq_len=32,train.batch_size=4,optim.warmup_steps=2,optim.lr=3e-3,optim.min_lr=3e-4,train.eval_every=3,"
        "train.eval_batches=2,train.checkpoint_every=3,train.keep_checkpoints=9,sample.max_new_tokens=12,"
        "sample.prompt=\"The \",train.steps=6,data.tokenizer=byte")
LLAMA = "model.arch=llama"
MOE = "model.arch=llama,model.moe_experts=4,model.moe_top_k=2,model.moe_d_ff=16,model.moe_shared=1"
MLA = "model.arch=llama,model.mla_kv_rank=16,model.mla_rope_dim=8,model.mla_v_dim=8,model.mla_q_rank=16"
LORA = 'peft.method=lora,peft.rank=4,peft.targets="q,k,v,o,up,down"'
PAIRS = os.path.join(ROOT, "examples", "dpo", "arithmetic_pairs.jsonl")
PROMPTS = os.path.join(ROOT, "examples", "grpo", "arithmetic_prompts.jsonl")
PREF = (f"model.max_seq_len=96,train.seq_len=96,train.batch_size=8,data.format=preference-jsonl,data.input={PAIRS},"
        "train.eval_every=3")
GRPO = (f"train.batch_size=8,data.format=prompt-jsonl,data.input={PROMPTS},train.objective=grpo,grpo.group=4,"
        "grpo.max_new_tokens=4,train.steps=3,optim.lr=1e-3")

# name -> (ranks, extra --set, extra arguments). {data}, {runs} and {sft} are filled in.
CONFIGS: dict[str, tuple[int, str, list[str]]] = {
    "gpt2": (1, "", []),
    "llama": (1, LLAMA, []),
    "bf16": (1, f"{LLAMA},precision.compute=bf16", []),
    "fp8_delayed": (1, "precision.compute=fp8-delayed,precision.fp8_amax_history=3", []),
    "fp16_scaled": (1, "precision.compute=fp16,precision.loss_scaling=true", []),
    "recompute_flash": (1, f"{LLAMA},train.recompute=full,train.flash_attention=true", []),
    "lora": (1, f"{LLAMA},{LORA}", []),
    "dora": (1, f"{LLAMA},{LORA},peft.dora=true", []),
    "qlora": (1, f"{LORA},peft.quantize_base=true", []),
    "moe": (1, MOE, []),
    "mla": (1, MLA, []),
    "muon": (1, "optim.name=muon", []),
    "adafactor": (1, "optim.name=adafactor", []),
    "ldadam": (1, "optim.name=ldadam,optim.rank=4", []),
    "accum_skip": (1, "train.grad_accum=2,train.on_anomaly=skip,train.inject_fault_step=2,train.inject_fault=nan", []),
    "documents_async": (1, f"{LLAMA},data.document_mask=true,train.async_checkpoint=true", []),
    "sft": (1, "data.dir={sft}", []),
    "dp2_zero2": (2, "parallel.zero_stage=2", []),
    "tp2_sp": (2, f"{LLAMA},parallel.tp=2,parallel.sequence_parallel=true", []),
    "pp2": (2, "parallel.pp=2,train.grad_accum=2", []),
    "cp2": (2, f"{LLAMA},parallel.cp=2", []),
    "dpo": (1, f"{PREF},train.objective=dpo", []),
    "ipo_live": (1, f"{PREF},train.objective=dpo,dpo.loss=ipo,dpo.reference=live", []),
    "simpo_lora": (1, f"{PREF},train.objective=dpo,dpo.loss=simpo,dpo.beta=2.0,{LORA}", []),
    "grpo": (1, GRPO, []),
    "distill": (1, "train.objective=distill,distill.teacher={runs}/gpt2", []),
    "orpo": (1, f"{PREF},train.objective=orpo", []),
    "kto": (1, f"{PREF},train.objective=kto", []),
}
# Measured, not computed: dropped before comparing. Besides the timings: resident pages (mincore;
# under mpirun a page more or less from one run to the next) and the workspace's peak (the GEMM peak
# probe allocates it only when the machine's peak cache misses).
MEASURED = {"seconds", "tokens_per_s", "mfu", "mfu_peak_gflops", "datasheet_peak_gflops", "rollout_seconds",
            "train_seconds", "resident_bytes", "workspace"}


def strip(record):
    if isinstance(record, dict):
        return {k: strip(v) for k, v in record.items() if k not in MEASURED}
    if isinstance(record, list):
        return [strip(v) for v in record]
    return record


def digest(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def run_one(loom: str, name: str, tmp: str) -> dict:
    ranks, sets, extra = CONFIGS[name]
    runs = os.path.join(tmp, "runs")
    sets = sets.format(runs=runs, sft=os.path.join(tmp, "sft"))
    all_sets = f"{TINY},data.dir={tmp}/data,run.dir={runs},run.name={name}" + (f",{sets}" if sets else "")
    command = [loom, "train", "--set", all_sets, *extra]
    if ranks > 1:
        command = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", str(ranks), "--bind-to", "none",
                   "-x", "OMP_NUM_THREADS=1", *command]
    env = dict(os.environ, OMP_NUM_THREADS="1" if ranks > 1 else "2")
    p = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    out: dict = {"exit": p.returncode}
    if p.returncode != 0:
        out["error"] = p.stderr.strip().splitlines()[-1:] if p.stderr.strip() else []
        return out
    folder = os.path.join(runs, name)
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        out["metrics"] = [strip(json.loads(line)) for line in f]
    with open(os.path.join(folder, "samples.txt")) as f:
        out["sample"] = f.read()
    checkpoints = os.path.join(folder, "checkpoints")
    out["checkpoints"] = {}
    for step in sorted(os.listdir(checkpoints)) if os.path.isdir(checkpoints) else []:
        for root, _, files in os.walk(os.path.join(checkpoints, step)):
            for file in sorted(files):
                path = os.path.join(root, file)
                if file.endswith(".safetensors") or file.endswith(".bin"):
                    out["checkpoints"][os.path.relpath(path, checkpoints)] = digest(path)
    return out


def record(loom: str, out_path: str, names: list[str]):
    tmp = tempfile.mkdtemp(prefix="loom_baseline_")
    try:
        subprocess.run([loom, "prepare", "--input", TEXT, "--tokenizer", "byte", "--out", os.path.join(tmp, "data"),
                        "--val-fraction", "0.1"], check=True, capture_output=True, cwd=ROOT)
        subprocess.run([loom, "prepare", "--format", "chat-jsonl", "--input",
                        os.path.join(ROOT, "examples", "sft", "arithmetic_chat.jsonl"), "--tokenizer", "byte",
                        "--chat-template", os.path.join(ROOT, "examples", "sft", "chatml.jinja"), "--out",
                        os.path.join(tmp, "sft")], check=True, capture_output=True, cwd=ROOT)
        results = {}
        for name in names or list(CONFIGS):
            results[name] = run_one(loom, name, tmp)
            r = results[name]
            print(f"{name}: exit {r['exit']}, {len(r.get('metrics', []))} records, {len(r.get('checkpoints', {}))} "
                  f"checkpoint files{'  ' + str(r.get('error')) if r['exit'] else ''}", flush=True)
        with open(out_path, "w") as f:
            json.dump(results, f, indent=1, sort_keys=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def compare(a_path: str, b_path: str) -> int:
    with open(a_path) as f:
        a = json.load(f)
    with open(b_path) as f:
        b = json.load(f)
    differences = 0
    for name in sorted(set(a) | set(b)):
        if name not in a or name not in b:
            print(f"{name}: only in {'the first' if name in a else 'the second'}")
            continue
        for key in sorted(set(a[name]) | set(b[name])):
            if a[name].get(key) != b[name].get(key):
                differences += 1
                print(f"{name}: {key} differs")
                if key == "metrics":
                    for i, (x, y) in enumerate(zip(a[name].get(key, []), b[name].get(key, []))):
                        if x != y:
                            print(f"  record {i}: {json.dumps(x)[:300]}\n        vs: {json.dumps(y)[:300]}")
                            break
    same = sum(1 for n in a if n in b and a[n] == b[n])
    print(f"{same} of {len(set(a) | set(b))} configurations identical; {differences} differences")
    return 1 if differences else 0


if __name__ == "__main__":
    if len(sys.argv) >= 4 and sys.argv[1] == "record":
        record(os.path.abspath(sys.argv[2]), sys.argv[3], sys.argv[4:])
    elif len(sys.argv) == 4 and sys.argv[1] == "compare":
        sys.exit(compare(sys.argv[2], sys.argv[3]))
    else:
        sys.exit(__doc__)
