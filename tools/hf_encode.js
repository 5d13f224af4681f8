#!/usr/bin/env node
// Reference ids for tests/test_tokenizer_hf.cpp: encodes each string of a JSON array with an
// implementation no one here wrote, and prints a JSON array of id arrays.
//
//   node tools/hf_encode.js hf TOKENIZER_DIR STRINGS.json     Hugging Face's JavaScript port
//        @huggingface/tokenizers loading TOKENIZER_DIR/tokenizer.json (+ tokenizer_config.json),
//        encode(text) with its defaults: special tokens parsed, the post-processor's BOS added
//   node tools/hf_encode.js llama3 - STRINGS.json             llama3-tokenizer-js, encode(text,
//        {bos: false, eos: false}): special tokens parsed, nothing added
'use strict';
const fs = require('fs');
const path = require('path');

const npm = path.join(path.dirname(__dirname), '.deps', 'npm', 'node_modules');
const [kind, dir, stringsFile] = process.argv.slice(2);
if (!stringsFile || !['hf', 'llama3'].includes(kind)) {
  process.stderr.write('usage: node tools/hf_encode.js hf|llama3 TOKENIZER_DIR|- STRINGS.json\n');
  process.exit(2);
}
const strings = JSON.parse(fs.readFileSync(stringsFile, 'utf-8'));
let encode;
if (kind === 'hf') {
  const { Tokenizer } = require(path.join(npm, '@huggingface', 'tokenizers', 'dist', 'tokenizers.cjs'));
  const json = JSON.parse(fs.readFileSync(path.join(dir, 'tokenizer.json'), 'utf-8'));
  const configPath = path.join(dir, 'tokenizer_config.json');
  const config = fs.existsSync(configPath) ? JSON.parse(fs.readFileSync(configPath, 'utf-8')) : {};
  const tokenizer = new Tokenizer(json, config);
  encode = (text) => tokenizer.encode(text).ids;
} else {
  const module = require(path.join(npm, 'llama3-tokenizer-js', 'bundle', 'commonjs-llama3-tokenizer-with-baked-data.cjs'));
  const llama = module.llama3Tokenizer;
  encode = (text) => llama.encode(text, { bos: false, eos: false });
}
process.stdout.write(JSON.stringify(strings.map((s) => Array.from(encode(s), Number))) + '\n');
