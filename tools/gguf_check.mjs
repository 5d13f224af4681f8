#!/usr/bin/env node
// llama.cpp's side of tests/gguf_test.py: loads a GGUF file written by `loom convert --to gguf`
// with node-llama-cpp (its prebuilt llama.cpp, CPU only) and prints, as one JSON object,
//   prompts[i]: {prompt, tokens (llama.cpp's tokenization, special tokens as text),
//               tokens_special (the same with special tokens parsed), continuation (greedy: the most
//               likely next token, fed back, `tokens` times or until end of text),
//               next_logprobs (log-probabilities of every vocabulary token after the prompt)}
//   text_tokens: llama.cpp's tokenization of the text, cut to context + 1 tokens
//   mean_nll:    the mean next-token loss over them, evaluated from position 0
// usage: node tools/gguf_check.mjs MODEL.gguf SPEC.json
//   SPEC = {"prompts": [...], "tokens": N, "text": "...", "context": max_seq_len, "vocab": V}
// The probabilities are llama.cpp's softmax of the logits (temperature 1, no top-k / top-p /
// min-p cut), the KV cache is f32, so an f32 file's numbers differ from Loom's only by rounding.
// node-llama-cpp comes from .deps/npm (scripts/setup) or the folder LOOM_NODE_MODULES names.
import fs from "node:fs";
import path from "node:path";
import {fileURLToPath, pathToFileURL} from "node:url";

const root = path.dirname(path.dirname(fileURLToPath(import.meta.url)));
const modules = process.env.LOOM_NODE_MODULES ?? path.join(root, ".deps", "npm", "node_modules");
const entry = path.join(modules, "node-llama-cpp", "dist", "index.js");
if (process.argv.length !== 4) {
  console.error("usage: node tools/gguf_check.mjs MODEL.gguf SPEC.json");
  process.exit(2);
}
if (!fs.existsSync(entry)) {
  console.error(`gguf_check: ${entry} not found; run scripts/setup (npm node-llama-cpp@3.21.1)`);
  process.exit(1);
}
const {getLlama, LlamaLogLevel} = await import(pathToFileURL(entry).href);
const [modelPath, specPath] = process.argv.slice(2);
const spec = JSON.parse(fs.readFileSync(specPath, "utf8"));

const llama = await getLlama({gpu: false, build: "never", logLevel: LlamaLogLevel.error, maxThreads: 2});
const model = await llama.loadModel({modelPath, gpuLayers: 0});
const eos = model.tokens.eos;
const wholeDistribution = {temperature: 1, topK: spec.vocab, topP: 1, minP: 0, seed: 1};

// One cell more than the text needs: node-llama-cpp keeps a cell free, and when a sequence would
// fill the context it erases the beginning (context shift) before evaluating the rest.
async function withSequence(fn) {
  const context = await model.createContext({
    contextSize: spec.context + 1, batchSize: spec.context, sequences: 1, threads: 2,
    experimentalKvCacheKeyType: "F32", experimentalKvCacheValueType: "F32",
  });
  try {
    return await fn(context.getSequence());
  } finally {
    await context.dispose();
  }
}

// Feeds `tokens` and returns the next-token distribution after the last one, as log-probabilities.
async function evaluateLast(sequence, tokens) {
  const input = tokens.slice(0, -1);
  input.push([tokens.at(-1), {generateNext: {probabilities: true, options: wholeDistribution}}]);
  const result = await sequence.controlledEvaluate(input);
  return logProbs(result.at(-1).next.probabilities);
}

function logProbs(probabilities) {
  const out = new Array(spec.vocab).fill(-Infinity);
  for (const [token, p] of probabilities) out[token] = Math.log(p);
  return out;
}

function argmax(values) {
  let best = 0;
  for (let i = 1; i < values.length; ++i) if (values[i] > values[best]) best = i;
  return best;
}

const prompts = [];
for (const prompt of spec.prompts) {
  const tokens = model.tokenize(prompt, false);
  const result = await withSequence(async (sequence) => {
    const nextLogprobs = await evaluateLast(sequence, tokens);
    const continuation = [];
    let logprobs = nextLogprobs;
    while (continuation.length < spec.tokens && tokens.length + continuation.length < spec.context) {
      const token = argmax(logprobs);
      continuation.push(token);
      if (token === eos) break;
      logprobs = await evaluateLast(sequence, [token]);
    }
    return {prompt, tokens, tokens_special: model.tokenize(prompt, true), continuation,
            next_logprobs: nextLogprobs.map((x) => (isFinite(x) ? x : -1e30))};
  });
  prompts.push(result);
}

const text = model.tokenize(spec.text, false).slice(0, spec.context + 1);
const meanNll = await withSequence(async (sequence) => {
  const input = text.slice(0, -1).map((token) => [token, {generateNext: {probabilities: true, options: wholeDistribution}}]);
  const result = await sequence.controlledEvaluate(input);
  let nll = 0;
  for (let t = 0; t + 1 < text.length; ++t) nll -= Math.log(result[t].next.probabilities.get(text[t + 1]) ?? 1e-45);
  return nll / (text.length - 1);
});

console.log(JSON.stringify({prompts, text_tokens: text, mean_nll: meanNll}));
await model.dispose();
await llama.dispose();
