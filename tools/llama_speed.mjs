#!/usr/bin/env node
// llama.cpp's single-stream speed for bench/serve_bench.py, bench/compression_bench.py and
// bench/big_model_bench.py: node-llama-cpp's prebuilt llama.cpp (CPU, SPEC's "threads" threads,
// default 2) runs each GGUF file on the same prompt tokens, greedy, and prints one JSON object per
// file: {file, prompt_tokens_per_s, decode_tokens_per_s, runs, threads}.
//   prompt: P tokens evaluated in one batch until the first new token is drawn (as a server's
//           time to first token counts it): P / t_first;
//   decode: the next N - 1 tokens, one forward each: (N - 1) / (t_last - t_first).
// The best of `runs` repetitions (fresh context each), as llama-bench reports steady state.
// usage: node tools/llama_speed.mjs SPEC.json
//        SPEC = {"files": [...], "prompt": [ids], "new": N, "runs": R, "threads": T (optional, default 2)}
import fs from "node:fs";
import path from "node:path";
import {fileURLToPath, pathToFileURL} from "node:url";

const root = path.dirname(path.dirname(fileURLToPath(import.meta.url)));
const modules = process.env.LOOM_NODE_MODULES ?? path.join(root, ".deps", "npm", "node_modules");
const entry = path.join(modules, "node-llama-cpp", "dist", "index.js");
if (!fs.existsSync(entry)) {
  console.error(`llama_speed: ${entry} not found; run scripts/setup (npm node-llama-cpp@3.21.1)`);
  process.exit(1);
}
const {getLlama, LlamaLogLevel} = await import(pathToFileURL(entry).href);
const spec = JSON.parse(fs.readFileSync(process.argv[2], "utf8"));
const threads = spec.threads ?? 2;
if (!Number.isInteger(threads) || threads < 1) {
  console.error(`llama_speed: "threads" must be a positive integer, got ${JSON.stringify(spec.threads)}`);
  process.exit(1);
}
const llama = await getLlama({gpu: false, build: "never", logLevel: LlamaLogLevel.error, maxThreads: threads});

const results = [];
for (const file of spec.files) {
  const model = await llama.loadModel({modelPath: file, gpuLayers: 0});
  let best = {prompt: 0, decode: 0};
  for (let run = 0; run < spec.runs; ++run) {
    const context = await model.createContext({contextSize: spec.prompt.length + spec.new + 2, batchSize: spec.prompt.length,
                                               sequences: 1, threads});
    const sequence = context.getSequence();
    const start = performance.now();
    let first = 0, last = 0, count = 0;
    for await (const token of sequence.evaluate(spec.prompt, {temperature: 0, yieldEogToken: true})) {
      void token;
      const now = performance.now();
      if (count === 0) first = now;
      last = now;
      if (++count >= spec.new) break;
    }
    await context.dispose();
    const prompt = spec.prompt.length / ((first - start) / 1000);
    const decode = count > 1 ? (count - 1) / ((last - first) / 1000) : 0;
    best = {prompt: Math.max(best.prompt, prompt), decode: Math.max(best.decode, decode)};
  }
  results.push({file: path.basename(file), prompt_tokens_per_s: best.prompt, decode_tokens_per_s: best.decode, runs: spec.runs,
                threads});
  await model.dispose();
}
console.log(JSON.stringify(results));
await llama.dispose();
