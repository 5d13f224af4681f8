// Reference renderer for the chat template tests (tests/test_chat_template.cpp): renders each
// case with Hugging Face's @huggingface/jinja (installed by scripts/setup into .deps/npm).
//   node tools/jinja_render.mjs cases.json > results.json
// cases.json: [{"template": "...", "variables": {...}}, ...]; results.json: one entry per case,
// {"ok": true, "text": "..."} or {"ok": false, "error": "..."}. The package directory is
// .deps/npm/node_modules beside this repository, or $LOOM_JINJA_MODULES when set.
import { readFileSync } from "node:fs";
import { createRequire } from "node:module";
import path from "node:path";
import { fileURLToPath } from "node:url";

const repo = path.resolve(path.dirname(fileURLToPath(import.meta.url)), "..");
const modules = process.env.LOOM_JINJA_MODULES || path.join(repo, ".deps", "npm", "node_modules");
let Template;
try {
  ({ Template } = createRequire(path.join(modules, "noop.js"))("@huggingface/jinja"));
} catch (e) {
  console.error(`jinja_render.mjs: cannot load @huggingface/jinja from ${modules}: run scripts/setup (${e.message})`);
  process.exit(2);
}
const cases = JSON.parse(readFileSync(process.argv[2], "utf8"));
const results = cases.map(({ template, variables }) => {
  try {
    return { ok: true, text: new Template(template).render(variables) };
  } catch (e) {
    return { ok: false, error: String(e && e.message) };
  }
});
process.stdout.write(JSON.stringify(results));
