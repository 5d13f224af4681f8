#!/usr/bin/env python3
"""Writes the fuzz targets' seed inputs (fuzz/seeds/<target>/), small valid files that reach
every supported branch of the readers. The seeds are checked in; run this again after changing it:
    python3 fuzz/make_seeds.py [--loom build/bin/loom]
The checkpoint seeds are real step folders written by `loom train` (a tiny model on a
byte-level dataset; a quantized model folder needs widths of 32 and more, too big for a seed);
without a loom binary they are left as they are. Seeds named regress-* are inputs that once
failed (docs/fuzzing.md): they are kept, never rewritten.
"""
import argparse
import ctypes
import ctypes.util
import json
import os
import shutil
import struct
import subprocess
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))


def safetensors(tensors, metadata=None):
    """tensors: [(name, dtype, shape, raw bytes)] -> the bytes of a .safetensors file."""
    header, offset = {}, 0
    if metadata:
        header["__metadata__"] = metadata
    for name, dtype, shape, raw in tensors:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(raw)]}
        offset += len(raw)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + b"".join(raw for *_, raw in tensors)


def byte_level_alphabet():
    """GPT-2's byte -> printable character table (the ByteLevel pre-tokenizer's alphabet)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def tokenizer(pre_tokenizer, normalizer=None, merges_as_pairs=False, ignore_merges=False, post_processor=None):
    alphabet = byte_level_alphabet()
    vocab = {alphabet[b]: b for b in range(256)}
    merged = [("h", "e"), ("l", "l"), ("he", "ll"), ("\u0120", "w")]
    for a, b in merged:
        vocab[a + b] = len(vocab)
    added = [{"id": len(vocab), "content": "<|endoftext|>", "special": True},
             {"id": len(vocab) + 1, "content": "<s>", "special": True},
             {"id": len(vocab) + 2, "content": "<tool>", "special": False, "normalized": True}]
    return {"version": "1.0", "added_tokens": added, "normalizer": normalizer, "pre_tokenizer": pre_tokenizer,
            "post_processor": post_processor, "decoder": {"type": "ByteLevel"},
            "model": {"type": "BPE", "dropout": None, "ignore_merges": ignore_merges, "byte_fallback": False,
                      "vocab": vocab, "merges": [list(m) if merges_as_pairs else " ".join(m) for m in merged]}}


def write(path, data):
    os.makedirs(os.path.dirname(os.path.join(HERE, "seeds", path)), exist_ok=True)
    with open(os.path.join(HERE, "seeds", path), "wb") as f:
        f.write(data)


def files(first, *rest):
    """A FileSet input (fuzz_input.h): the first file's bytes, then each (name, bytes) after a
    banner line "==> name <==" as `head` separates files."""
    return first + b"".join(b"\n==> " + name.encode() + b" <==\n" + data for name, data in rest)


_xxhash = ctypes.CDLL(ctypes.util.find_library("xxhash") or "libxxhash.so.0")
_xxhash.XXH64.restype = ctypes.c_uint64
_xxhash.XXH64.argtypes = [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_uint64]


def shard(tokens, vocab_size, dtype=None):
    """A token shard (src/loom/data/shard.h): the 64-byte little-endian header, then the tokens,
    u16 when the vocabulary fits (dtype 1) else u32 (dtype 2); the payload's XXH64 (seed 0) via
    libxxhash, the library Loom uses."""
    dtype = dtype or (1 if vocab_size <= 65536 else 2)
    payload = struct.pack("<%d%s" % (len(tokens), "H" if dtype == 1 else "I"), *tokens)
    header = b"LOOMTOK\0" + struct.pack("<IIQQQ", 1, dtype, vocab_size, len(tokens),
                                         _xxhash.XXH64(payload, len(payload), 0))
    return header + b"\0" * 24 + payload


def dataset(vocab_size, splits, tokenizer="byte"):
    """A dataset folder as a FileSet: meta.json (as write_dataset writes it) and its shards.
    splits: {"train": {"tokens": [shard 0's tokens, ...], "mask": [mask shard 0, ...]}, "val": ...}."""
    meta = {"format": "loom-token-dataset", "version": 1, "tokenizer": tokenizer, "vocab_size": vocab_size,
            "val_fraction": 0.1, "shard_tokens": 64, "splits": {}}
    shards = []
    for name, parts in splits.items():
        entry = {"tokens": sum(len(p) for p in parts.get("tokens", [])), "shards": []}
        for i, tokens in enumerate(parts.get("tokens", [])):
            shards.append(("%s_%06d.bin" % (name, i), shard(tokens, vocab_size)))
            entry["shards"].append({"file": shards[-1][0], "tokens": len(tokens)})
        if "mask" in parts:  # supervised data: one 0/1 per token, shards of a 2-token vocabulary
            entry["mask_shards"] = []
            for i, bits in enumerate(parts["mask"]):
                shards.append(("%s_mask_%06d.bin" % (name, i), shard(bits, 2)))
                entry["mask_shards"].append({"file": shards[-1][0], "tokens": len(bits)})
        meta["splits"][name] = entry
    return files(json.dumps(meta, indent=2).encode(), *shards)


def gpt2_files(merges, extra=()):
    """encoder.json + NUL + vocab.bpe: GPT-2's byte tokens, the merges' results, <|endoftext|>."""
    alphabet = byte_level_alphabet()
    vocab = {alphabet[b]: b for b in range(256)}
    for m in merges:
        vocab.setdefault(m.replace(" ", ""), len(vocab))
    for token in extra:
        vocab.setdefault(token, len(vocab))
    vocab["<|endoftext|>"] = len(vocab)
    merges_text = "#version: 0.2\n" + "\n".join(merges) + "\n"
    return json.dumps(vocab, ensure_ascii=False).encode() + b"\0" + merges_text.encode()


def loom_seeds(loom):
    """Seeds written by Loom itself: a BPE tokenizer learned by `loom prepare`, and checkpoints of
    a tiny model (1 layer, d_model 4, the 257 byte-level tokens) by `loom train`."""
    tiny = ("data.dir=d,data.tokenizer=byte,model.vocab_size=0,model.n_layer=1,model.d_model=4,model.d_ff=8,"
            "model.max_seq_len=8,train.seq_len=8,train.batch_size=2,train.steps=1,train.eval_every=0,"
            "train.eval_batches=1,train.checkpoint_every=0,run.dir=runs,sample.prompt=a,sample.max_new_tokens=1")
    with tempfile.TemporaryDirectory() as tmp:
        def run(*args):
            subprocess.run([loom, *args], cwd=tmp, check=True, stdout=subprocess.DEVNULL)

        with open(os.path.join(tmp, "in.txt"), "w") as f:
            f.write("hello world, hello fuzz. the quick brown fox jumps over the lazy dog's back.\n" * 40)
        run("prepare", "--set", "data.input=in.txt,data.dir=bpe,data.tokenizer=bpe:300,data.val_fraction=0.1")
        with open(os.path.join(tmp, "bpe/tokenizer/encoder.json"), "rb") as e, \
                open(os.path.join(tmp, "bpe/tokenizer/vocab.bpe"), "rb") as v:
            write("gpt2_bpe/learned_bpe_300.bin", e.read() + b"\0" + v.read())

        run("prepare", "--set", "data.input=in.txt,data.dir=d,data.tokenizer=byte,data.val_fraction=0.1")
        run("train", "--set", tiny + ",run.name=gpt2,optim.name=sgd,model.n_head=1,model.n_kv_head=1")
        run("train", "--set", tiny + ",run.name=llama,optim.name=sgd,model.arch=llama,model.n_head=2,model.n_kv_head=1,"
            "model.tie_embeddings=true,model.qk_norm=true")
        mpirun = shutil.which("mpirun")
        if mpirun:  # ZeRO-1 over 2 ranks: a sharded checkpoint
            subprocess.run([mpirun, "--allow-run-as-root", "--oversubscribe", "-np", "2", loom, "train", "--set",
                            tiny + ",run.name=zero,optim.name=adamw,model.n_head=1,model.n_kv_head=1,"
                            "parallel.zero_stage=1"],
                           cwd=tmp, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for name, step in (("gpt2_sgd", "runs/gpt2/checkpoints/step_00000001"),
                           ("llama_tied_qk_norm_sgd", "runs/llama/checkpoints/step_00000001"),
                           ("zero1_two_shards", "runs/zero/checkpoints/step_00000001")):
            folder = os.path.join(tmp, step)
            if not os.path.isdir(folder):
                continue
            rest = []
            for file in sorted(os.listdir(folder)):
                if file != "manifest.json" and os.path.isfile(os.path.join(folder, file)):
                    with open(os.path.join(folder, file), "rb") as f:
                        rest.append((file, f.read()))
            with open(os.path.join(folder, "manifest.json"), "rb") as f:
                write("checkpoint/%s.bin" % name, files(f.read(), *rest))


def main():
    f32 = struct.pack("<4f", 1.0, -2.5, 0.0, 3.25)
    write("safetensors/f32_bf16_metadata.safetensors",
          safetensors([("w", "F32", [2, 2], f32), ("b", "BF16", [3], struct.pack("<3H", 0x3F80, 0xC000, 0x7F80))],
                      {"format": "pt", "step": "3"}))
    write("safetensors/every_kind.safetensors",
          safetensors([("half", "F16", [2], struct.pack("<2H", 0x3C00, 0xFC00)), ("ids", "I64", [1], struct.pack("<q", -7)),
                       ("empty", "U8", [0, 4], b""), ("scalar", "F64", [], struct.pack("<d", 0.5)),
                       ("counts", "I32", [1, 2], struct.pack("<2i", 5, -6))]))
    write("safetensors/empty.safetensors", safetensors([]))

    alphabet = byte_level_alphabet()
    gpt2 = tokenizer({"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
                     post_processor={"type": "ByteLevel", "trim_offsets": True})
    write("tokenizer_json/gpt2_style.json", json.dumps(gpt2, ensure_ascii=False).encode())
    split = {"type": "Split", "pattern": {"Regex": r"(?i:'s|'t|'re)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"},
             "behavior": "Isolated", "invert": False}
    bos = {"type": "TemplateProcessing",
           "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
           "special_tokens": {"<s>": {"id": "<s>", "ids": [261], "tokens": ["<s>"]}}}
    llama3 = tokenizer({"type": "Sequence", "pretokenizers": [split, {"type": "ByteLevel", "add_prefix_space": False, "use_regex": False}]},
                       normalizer={"type": "NFC"}, merges_as_pairs=True, ignore_merges=True,
                       post_processor={"type": "Sequence", "processors": [{"type": "ByteLevel"}, bos]})
    assert llama3["added_tokens"][1]["id"] == 261 and alphabet[ord("h")] == "h"
    config = {"bos_token": "<s>", "eos_token": {"content": "<|endoftext|>", "special": True}, "add_bos_token": True}
    write("tokenizer_json/llama3_style_with_config.json",
          json.dumps(llama3, ensure_ascii=False).encode() + b"\0" + json.dumps(config).encode())
    literal = tokenizer({"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"String": " "}, "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": True, "use_regex": True}]})
    write("tokenizer_json/string_split.json", json.dumps(literal).encode())

    # gpt2_bpe: encoder.json NUL vocab.bpe.
    write("gpt2_bpe/hello_merges.bin", gpt2_files(["h e", "l l", "he ll", "\u0120 w", "o r", "\u0120w or"]))
    write("gpt2_bpe/digits_and_unused_token.bin", gpt2_files(["1 2", "12 3", "' s", "\u0120 \u0120"], extra=["xyz"]))

    # token_shards: meta.json and its shards.
    text = list(b"the quick brown fox jumps over the lazy dog")
    write("token_shards/u16_train_val.bin",
          dataset(257, {"train": {"tokens": [text[:30]]}, "val": {"tokens": [text[30:]]}}))
    write("token_shards/u32_two_train_shards.bin",
          dataset(70000, {"train": {"tokens": [[0, 69999, 65536], [1, 2]]}, "val": {"tokens": [[65535]]}}, "gpt2"))
    write("token_shards/sft_with_masks.bin",
          dataset(300, {"train": {"tokens": [[5, 6, 7, 299]], "mask": [[0, 0, 1, 1]]},
                        "val": {"tokens": [[1, 2]], "mask": [[1, 0]]}}, "bpe:300"))
    write("token_shards/empty_val.bin", dataset(10, {"train": {"tokens": [[9, 0, 1]]}, "val": {}}))

    # config: a TOML file, then after a NUL one --set per line.
    for name in ("moe.toml", "llama3_8b.toml"):
        with open(os.path.join(HERE, "..", "configs", name), "rb") as f:
            write("config/configs_" + name, f.read())
    write("config/llama_sets.bin", b'[model]\narch = "llama"\nn_kv_head = 2\n[optim]\nname = "muon"\n'
          b'schedule = "wsd"\nnesterov = -1\n[precision]\ncompute = "bf16"\nmaster = "bf16"\n\0'
          b'parallel.tp=2,parallel.sequence_parallel=true\ntrain.recompute=every:2,optim.no_decay="*.bias,*norm*"\n'
          b'data.dir=data/x,run.name=nan')
    write("config/dpo_objective.bin", b'device = "cpu"\n[train]\nobjective = "dpo"\nbatch_size = 4\n'
          b'[data]\nformat = "preference-jsonl"\ninput = "pairs.jsonl"\n[dpo]\nloss = "ipo"\nbeta = 0.5\n')


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--loom", default=os.path.join(HERE, "..", "build", "bin", "loom"),
                        help="the loom binary that writes the checkpoint and learned-BPE seeds")
    args = parser.parse_args()
    main()
    if os.access(args.loom, os.X_OK):
        loom_seeds(os.path.abspath(args.loom))
    else:
        print("no loom binary at %s: the checkpoint and learned-BPE seeds are left as they are" % args.loom)
