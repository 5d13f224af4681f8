#!/usr/bin/env node
// Reference GPT-2 encoder for tests/test_tokenizer.cpp: prints the token ids of a UTF-8 text
// file as a JSON array, using the npm package gpt-3-encoder (installed by scripts/setup).
//
//   node tools/gpt2_encode.js input.txt > ids.json
//
// gpt-3-encoder's encode() concatenates its result array once per pre-token (quadratic in the
// output), so a large text is encoded in pieces cut after a newline that has a non-space on
// both sides. GPT-2's regex always ends a match there ("\n" before a non-space is matched
// alone by \s+, and no match runs from a non-space into the newline), so the ids are exactly
// those of encoding the whole text at once.
'use strict';
const fs = require('fs');
const path = require('path');

const repoRoot = path.dirname(__dirname);
const { encode } = require(path.join(repoRoot, '.deps', 'npm', 'node_modules', 'gpt-3-encoder'));

if (process.argv.length !== 3) {
  process.stderr.write('usage: node tools/gpt2_encode.js <utf-8 text file>\n');
  process.exit(2);
}
const text = fs.readFileSync(process.argv[2], 'utf-8');
const ids = [];
for (const piece of text.split(/(?<=\S\n)(?=\S)/u)) {
  for (const id of encode(piece)) ids.push(id);
}
process.stdout.write(JSON.stringify(ids) + '\n');
