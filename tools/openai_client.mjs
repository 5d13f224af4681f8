// The official OpenAI client (npm `openai`, installed by scripts/setup into .deps/npm) against a
// running `loom serve`: tests/serve_test.py starts the server and checks what this prints.
//   node tools/openai_client.mjs BASE_URL MODEL cases.json > results.json
// cases.json: [{"kind": "completion" | "chat", "stream": bool, "params": {...}}, ...], params as
// the client's create() takes them (model added). results.json: one entry per case,
//   {"ok": true, "choices": [{"index", "text", "finish_reason"}], "usage": {...} | null,
//    "chunks": N (streamed)}  or  {"ok": false, "status": S, "error": "..."}.
// Streamed choices are the concatenated deltas, as a client assembles them.
import { readFileSync } from "node:fs";
import { createRequire } from "node:module";
import path from "node:path";
import { fileURLToPath } from "node:url";

const repo = path.resolve(path.dirname(fileURLToPath(import.meta.url)), "..");
const modules = process.env.LOOM_NODE_MODULES || path.join(repo, ".deps", "npm", "node_modules");
let OpenAI;
try {
  OpenAI = createRequire(path.join(modules, "noop.js"))("openai").default;
} catch (e) {
  console.error(`openai_client.mjs: cannot load the openai package from ${modules}: run scripts/setup (${e.message})`);
  process.exit(2);
}

const [baseURL, model, casesFile] = process.argv.slice(2);
const client = new OpenAI({ baseURL, apiKey: "none", maxRetries: 0, timeout: 120000 });
const cases = JSON.parse(readFileSync(casesFile, "utf8"));

async function run(c) {
  const params = { model, ...c.params };
  const api = c.kind === "chat" ? client.chat.completions : client.completions;
  if (!c.stream) {
    const r = await api.create(params);
    return {
      ok: true,
      object: r.object,
      choices: r.choices.map((x) => ({
        index: x.index,
        text: c.kind === "chat" ? x.message.content : x.text,
        role: c.kind === "chat" ? x.message.role : undefined,
        finish_reason: x.finish_reason,
        logprobs: x.logprobs ?? null,
      })),
      usage: r.usage ?? null,
    };
  }
  const stream = await api.create({ ...params, stream: true });
  const choices = new Map();
  let usage = null;
  let chunks = 0;
  for await (const chunk of stream) {
    chunks += 1;
    if (chunk.usage) usage = chunk.usage;
    for (const x of chunk.choices) {
      const got = choices.get(x.index) ?? { index: x.index, text: "", finish_reason: null };
      got.text += c.kind === "chat" ? (x.delta?.content ?? "") : (x.text ?? "");
      if (x.finish_reason) got.finish_reason = x.finish_reason;
      choices.set(x.index, got);
    }
  }
  return { ok: true, choices: [...choices.values()].sort((a, b) => a.index - b.index), usage, chunks };
}

const results = [];
for (const c of cases) {
  try {
    results.push(await run(c));
  } catch (e) {
    results.push({ ok: false, status: e.status ?? null, error: String(e.message ?? e) });
  }
}
process.stdout.write(JSON.stringify(results));
