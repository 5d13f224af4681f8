#!/bin/bash
# GRPO on arithmetic, the example of docs/finetune.md "GRPO": a small Llama trained on sums written
# as text ("12 + 7 = 19"), then GRPO on the prompts of examples/grpo/arithmetic_prompts.jsonl
# ("12 + 7 =", answer "19"): 8 completions per prompt sampled from the current weights, the
# built-in exact-answer reward, group-normalised advantages, the clipped objective with a KL
# term to the starting weights. Prints the held-out prompts' greedy reward along the way.
# usage: examples/grpo/run.sh [WORK_DIR]   (build/bin/loom must exist: see the README)
set -euo pipefail
cd "$(dirname "$0")/../.."
LOOM=${LOOM:-build/bin/loom}
W=${1:-/tmp/loom_grpo_example}
rm -rf "$W" && mkdir -p "$W"

echo "== 1. a base model: 6000 sums of two numbers below 50 as text, a 2-layer Llama, 2000 steps"
awk 'BEGIN { srand(7); for (i = 0; i < 6000; i++) { a = int(rand() * 50); b = int(rand() * 50); print a " + " b " = " a + b } }' > "$W/sums.txt"
$LOOM prepare --input "$W/sums.txt" --tokenizer byte --out "$W/sums" --val-fraction 0.05
$LOOM train --set "model.arch=llama,model.n_layer=2,model.n_head=4,model.n_kv_head=2,model.d_model=64,model.d_ff=128,model.max_seq_len=64,train.seq_len=64,train.batch_size=16,train.steps=2000,optim.lr=3e-3,train.eval_every=0,data.dir=$W/sums,data.tokenizer=byte,run.dir=$W/runs,run.name=base,sample.max_new_tokens=8" | tail -1

echo "== 2. GRPO: 4 prompts x 8 completions a step, 100 steps; the greedy reward of 50 held-out prompts every 20"
$LOOM train --set "train.init_from=$W/runs/base,train.objective=grpo,data.format=prompt-jsonl,data.input=examples/grpo/arithmetic_prompts.jsonl,data.tokenizer=byte,data.val_fraction=0.25,train.seq_len=64,train.batch_size=32,grpo.group=8,grpo.max_new_tokens=4,train.steps=100,optim.lr=1e-4,optim.min_lr=1e-5,optim.warmup_steps=2,train.eval_every=20,train.log_every=20,run.dir=$W/runs,run.name=grpo,sample.max_new_tokens=8" \
  | grep -E "grpo|reward|done"
