#!/bin/bash
# The fine-tuning example of docs/finetune.md, end to end on 2 cores in a few minutes:
#   a small Llama trained by Loom on the GPL text and exported to Hugging Face layout (the
#   "imported model") -> LoRA SFT on examples/sft/arithmetic_chat.jsonl (only the assistant's
#   tokens count) -> eval before and after -> the adapters in PEFT's layout -> merged GGUF ->
#   greedy answers from Loom and from llama.cpp (npm node-llama-cpp, scripts/setup).
# usage: examples/sft/run.sh [WORK_DIR]   (build/bin/loom must exist: see the README)
set -euo pipefail
cd "$(dirname "$0")/../.."
LOOM=${LOOM:-build/bin/loom}
W=${1:-/tmp/loom_sft_example}
rm -rf "$W" && mkdir -p "$W"
MODEL="model.arch=llama,model.n_layer=4,model.n_head=4,model.n_kv_head=2,model.d_model=128,model.d_ff=256,model.max_seq_len=128"
RUN="run.dir=$W/runs,train.seq_len=128,train.batch_size=8,train.eval_every=0,train.checkpoint_every=0,sample.max_new_tokens=8"

echo "== 1. a base model: byte-level BPE of 512 tokens and a small Llama trained on the GPL text"
$LOOM prepare --input /usr/share/common-licenses/GPL-3 --tokenizer bpe:512 --out "$W/text" --val-fraction 0.05
$LOOM train --set "$MODEL,$RUN,data.dir=$W/text,data.tokenizer=$W/text/tokenizer,run.name=base,train.steps=300,optim.lr=3e-3"
$LOOM convert --to hf --checkpoint "$W/runs/base" --out "$W/base_hf"

echo "== 2. the chat data, rendered with a ChatML template; only the assistant's tokens count"
$LOOM prepare --format chat-jsonl --input examples/sft/arithmetic_chat.jsonl --tokenizer "$W/base_hf" \
  --chat-template examples/sft/chatml.jinja --out "$W/chat" --val-fraction 0.1
$LOOM eval --checkpoint "$W/base_hf" --data "$W/chat"

echo "== 3. LoRA SFT from the Hugging Face folder: rank 8 on every linear layer, the base frozen"
$LOOM train --set "$RUN,data.dir=$W/chat,data.tokenizer=$W/base_hf,run.name=sft,train.steps=200,optim.lr=3e-3,train.init_from=$W/base_hf,peft.method=lora,peft.rank=8,peft.alpha=16,peft.targets=\"q,k,v,o,gate,up,down\""
$LOOM eval --checkpoint "$W/runs/sft" --data "$W/chat"

echo "== 4. out: the adapters in PEFT's layout, and the merged model as GGUF"
$LOOM convert --to peft --checkpoint "$W/runs/sft" --out "$W/adapter"
$LOOM convert --to gguf --checkpoint "$W/runs/sft" --out "$W/sft.gguf"
ls -l "$W/adapter" "$W/sft.gguf"

echo "== 5. greedy answers: Loom (the adapted model) and llama.cpp (the merged GGUF)"
PROMPTS=("What is 12 plus 7?" "Compute 30 - 4." "6 * 7 = ?" "What is 21 times 3?")
ARGS=()
for q in "${PROMPTS[@]}"; do
  p=$'<|im_start|>user\n'"$q"$'<|im_end|>\n<|im_start|>assistant\n'
  ARGS+=("$p")
  printf 'loom:      %-22s -> %s\n' "$q" "$($LOOM generate --checkpoint "$W/runs/sft" --prompt "$p" --tokens 8 --greedy | tail -n +1 | tr '\n' ' ')"
done
node examples/sft/llama_cpp_generate.mjs "$W/sft.gguf" 8 "${ARGS[@]}"
