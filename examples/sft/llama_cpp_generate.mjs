#!/usr/bin/env node
// Greedy generation in llama.cpp (npm node-llama-cpp@3.21.1, its prebuilt CPU build) from a GGUF
// file that `loom convert --to gguf` wrote: for each prompt, the most likely next token fed
// back until the end-of-text token, `tokens` tokens or the context's end. Prints one JSON object
// per prompt: {"prompt", "text"}.
// usage: node examples/sft/llama_cpp_generate.mjs MODEL.gguf TOKENS PROMPT...
import fs from "node:fs";
import path from "node:path";
import {fileURLToPath, pathToFileURL} from "node:url";

const root = path.dirname(path.dirname(path.dirname(fileURLToPath(import.meta.url))));
const modules = process.env.LOOM_NODE_MODULES ?? path.join(root, ".deps", "npm", "node_modules");
const entry = path.join(modules, "node-llama-cpp", "dist", "index.js");
if (process.argv.length < 5 || !fs.existsSync(entry)) {
  console.error(fs.existsSync(entry) ? "usage: node llama_cpp_generate.mjs MODEL.gguf TOKENS PROMPT..."
                                     : `${entry} not found; run scripts/setup (npm node-llama-cpp@3.21.1)`);
  process.exit(2);
}
const {getLlama, LlamaLogLevel} = await import(pathToFileURL(entry).href);
const [modelPath, count, ...prompts] = process.argv.slice(2);
const llama = await getLlama({gpu: false, build: "never", logLevel: LlamaLogLevel.error, maxThreads: 2});
const model = await llama.loadModel({modelPath, gpuLayers: 0});
const contextSize = model.trainContextSize;
const greedy = {temperature: 0};
for (const prompt of prompts) {
  const context = await model.createContext({contextSize: contextSize + 1, sequences: 1, threads: 2});
  const sequence = context.getSequence();
  const tokens = model.tokenize(prompt, false);
  const out = [];
  let next = tokens;
  while (out.length < Number(count) && tokens.length + out.length < contextSize) {
    const input = next.slice(0, -1);
    input.push([next.at(-1), {generateNext: {token: true, options: greedy}}]);
    const token = (await sequence.controlledEvaluate(input)).at(-1).next.token;
    if (token === model.tokens.eos) break;
    out.push(token);
    next = [token];
  }
  console.log(JSON.stringify({prompt, text: model.detokenize(out)}));
  await context.dispose();
}
