#!/usr/bin/env python3
"""Writes the fuzz targets' seed inputs (fuzz/seeds/<target>/), small valid files that reach
every supported branch of the readers. The seeds are checked in; run this again after changing it:
    python3 fuzz/make_seeds.py
"""
import json
import os
import struct

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
    with open(os.path.join(HERE, "seeds", path), "wb") as f:
        f.write(data)


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


if __name__ == "__main__":
    main()
