#!/usr/bin/env python3
"""SentencePiece reference for tests/test_tokenizer_sp.cpp (Debian's python3-sentencepiece).

  sentencepiece_reference.py train OUT_DIR [KEY=VALUE ...]   trains OUT_DIR/tokenizer.model, a
      Llama-2-style BPE model (byte_fallback, identity normalization, extra whitespace kept, dummy
      prefix) of 2000 pieces on Debian's fortunes plus a few lines of other scripts,
      deterministically. KEY=VALUE replaces a trainer option (vocab_size=800, model_type=unigram,
      user_defined_symbols=<a>,<b>, ...); input=FILE trains on FILE's non-empty lines instead.
  sentencepiece_reference.py encode MODEL STRINGS.json   prints the ids of each string as JSON
"""
import glob
import json
import os
import sys

import sentencepiece as spm

EXTRA = [
    "中文的文本，日本語のテキスト、한국어 텍스트。",
    "Ελληνικά русский текст עברית العربية हिन्दी ไทย",
    "def f(x):\n    return x ** 2  # code\n\tif (a && b) { c[i] = 0; }",
    "café naïve Straße 1,000,000 3.14159 ½ ² €100 👍🏽 👨‍👩‍👧",
]


def corpus_lines():
    lines = []
    for path in sorted(glob.glob("/usr/share/games/fortunes/*")):
        if path.endswith((".dat", ".u8")) or os.path.isdir(path):
            continue
        with open(path, "rb") as f:
            text = f.read().decode("utf-8", errors="ignore")
        lines += [line for line in text.splitlines() if line.strip() and line.strip() != "%"]
    return lines + EXTRA * 50


def train(out_dir, overrides):
    os.makedirs(out_dir, exist_ok=True)
    options = dict(model_type="bpe", vocab_size=2000, byte_fallback=True, normalization_rule_name="identity",
                   remove_extra_whitespaces=False, add_dummy_prefix=True, character_coverage=0.9995,
                   split_digits=True, num_threads=1, input_sentence_size=0, minloglevel=2,
                   unk_id=0, bos_id=1, eos_id=2, pad_id=-1)
    lines = None
    for item in overrides:
        key, _, value = item.partition("=")
        if key == "input":
            with open(value, encoding="utf-8") as f:
                lines = [line for line in f.read().splitlines() if line.strip()]
        else:
            options[key] = value
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines or corpus_lines()),
                                   model_prefix=os.path.join(out_dir, "tokenizer"), **options)


def encode(model, strings_file):
    processor = spm.SentencePieceProcessor(model_file=model)
    with open(strings_file, encoding="utf-8") as f:
        strings = json.load(f)
    print(json.dumps([processor.encode(s) for s in strings]))


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "train":
        train(sys.argv[2], sys.argv[3:])
    elif len(sys.argv) == 4 and sys.argv[1] == "encode":
        encode(sys.argv[2], sys.argv[3])
    else:
        sys.exit(__doc__)
