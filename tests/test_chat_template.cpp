// Chat templates (loom/data/chat_template.h) against Hugging Face's JavaScript implementation
// @huggingface/jinja, run by tools/jinja_render.mjs: the real templates of Llama 3 / 3.1 / 3.2
// Instruct, Qwen2 / 2.5 Instruct, Mistral v0.1 / v0.3 / Nemo and Mixtral Instruct and ChatML
// (tests/fixtures/chat_templates/, each naming its sources) over a set of conversations, and small templates for each feature, compared byte for byte (or
// both failing). The reference needs node and the package (scripts/setup installs it into
// .deps/npm): without them the tests fail, naming the command.
#include <gtest/gtest.h>

#include <chrono>
#include <random>

#include "loom/core/error.h"
#include "loom/data/chat_template.h"
#include "test_util.h"
#include "tokenizer_test_util.h"

namespace loom {
namespace {

using namespace tokenizer_test;  // NOLINT
using ojson = nlohmann::ordered_json;

struct Case {
  std::string label;
  std::string tmpl;
  ojson variables;
};

struct Conversation {
  std::string label;
  std::vector<ChatMessage> messages;
};

const std::vector<Conversation>& conversations() {
  static const std::vector<Conversation> list = {
      {"user", {{"user", "Hello!"}}},
      {"system+user", {{"system", "You are a helpful assistant."}, {"user", "What is 2+2?"}}},
      {"multi-turn", {{"user", "Hi"}, {"assistant", "Hello! How can I help?"}, {"user", "Tell me a joke."}}},
      {"system+multi-turn",
       {{"system", "Be brief."}, {"user", "A"}, {"assistant", "B"}, {"user", "C"}, {"assistant", "D"}, {"user", "E"}}},
      {"ends with assistant", {{"user", "Question?"}, {"assistant", "Answer."}}},
      {"unicode",
       {{"system", "Réponds en français 🇫🇷."}, {"user", "日本語のテキスト, 한국어, русский, العربية 👨‍👩‍👧"}, {"assistant", "Ελληνικά — ∑ x²"}}},
      {"empty content", {{"user", ""}, {"assistant", ""}, {"user", ""}}},
      {"empty system", {{"system", ""}, {"user", "hi"}}},
      {"whitespace", {{"system", "  padded system  \n"}, {"user", "\n\n  indented\tline  \n"}, {"assistant", " \t answer \n "}}},
      {"special characters",
       {{"user", "{{ not a tag }} {% if %} {# x #} <|im_end|> [INST] </s> <s> \\ \" ' `"}, {"assistant", "<|eot_id|>json: {\"a\": [1, 2]}"}}},
      {"newlines", {{"user", "line1\nline2\r\nline3\n"}, {"assistant", "\n"}}},
      {"long", {{"user", std::string(2000, 'x') + " end"}}},
      {"control characters", {{"user", std::string("tab\there\x01\x1f del\x7f")}}},
      {"nbsp and bom", {{"system", "\u00a0sys\u00a0"}, {"user", "\ufeffbom\u2028sep\u3000"}}},
      {"two users (Mistral raises)", {{"user", "one"}, {"user", "two"}}},
      {"starts with assistant (Mistral raises)", {{"assistant", "I speak first"}, {"user", "ok"}}},
      {"two assistants (Mistral raises)", {{"user", "q"}, {"assistant", "a1"}, {"assistant", "a2"}}},
      {"system in the middle", {{"user", "q"}, {"system", "mid"}, {"assistant", "a"}}},
      {"tool message", {{"user", "What is the weather?"}, {"tool", "{\"temp\": 21}"}}},
      {"two systems", {{"system", "first"}, {"system", "second"}, {"user", "q"}}},
      {"empty conversation", {}},
      {"only system", {{"system", "Just a system prompt."}}},
      {"quotes and braces", {{"system", "{'a': \"b\"}"}, {"user", "}}{{%}%{#}"}}},
      {"eight turns",
       {{"user", "1"}, {"assistant", "2"}, {"user", "3"}, {"assistant", "4"}, {"user", "5"}, {"assistant", "6"}, {"user", "7"}, {"assistant", "8"}}},
  };
  return list;
}

ojson variables_of(const std::vector<ChatMessage>& messages, const std::string& bos, const std::string& eos, bool gen) {
  ojson list = ojson::array();
  for (const ChatMessage& m : messages) list.push_back({{"role", m.role}, {"content", m.content}});
  return {{"messages", list}, {"bos_token", bos}, {"eos_token", eos}, {"add_generation_prompt", gen}};
}

// Each fixture is the `chat_template` of a real model's tokenizer_config.json, byte for byte, with
// the public copies it was taken from and checked against in its "source" list (docs/tokenizers.md):
//   llama3_instruct             Meta-Llama-3-8B-Instruct: YJiangcm/WebR's copy of the file, Ollama's
//                               template/index.json, huggingface.js ollama-utils' automap
//   llama3_1_instruct           Llama-3.1-8B-Instruct: huggingface.js packages/jinja/test/e2e.test.js,
//                               Ollama, the automap
//   llama3_2_instruct           Llama-3.2-3B-Instruct: the automap, llama.cpp models/templates/
//   qwen2_instruct              Qwen2-0.5B-Instruct: the automap, Ollama
//   qwen2_5_instruct            Qwen2.5-7B-Instruct: e2e.test.js, the automap
//   mistral_v0_1_instruct       Mistral-7B-Instruct-v0.1: e2e.test.js (then and now), the automap, Ollama
//   mixtral_8x7b_instruct_v0_1  Mixtral-8x7B-Instruct-v0.1: e2e.test.js, Ollama
//   mistral_v0_3_instruct_2024_05  Mistral-7B-Instruct-v0.3 as e2e.test.js has it (an earlier revision)
//   mistral_nemo_instruct_2407  Mistral-Nemo-Instruct-2407: e2e.test.js
//   chatml                      transformers' default ChatML template: e2e.test.js, the automap, Ollama
// mistral_v0_3_instruct (the later revision of v0.3's template, with system messages and tool call
// ids) was written from memory: no copy of the Hub file was found to check it against.
struct TemplateFile {
  std::string name, bos, eos;
  ojson extra = ojson::object();  // more variables for every conversation
  bool tools = true;              // also rendered with a `tools` list
};
const std::vector<TemplateFile> kTemplates = {
    {"llama3_instruct", "<|begin_of_text|>", "<|eot_id|>"},
    {"llama3_1_instruct", "<|begin_of_text|>", "<|eot_id|>"},
    // Without date_string it prints today's date (strftime_now): fixed, so that a render on each side
    // of midnight cannot differ.
    {"llama3_2_instruct", "<|begin_of_text|>", "<|eot_id|>", {{"date_string", "26 Nov 2026"}}},
    {"qwen2_instruct", "", "<|im_end|>"},
    {"qwen2_5_instruct", "", "<|im_end|>"},
    {"mistral_v0_1_instruct", "<s>", "</s>"},
    {"mixtral_8x7b_instruct_v0_1", "<s>", "</s>"},
    {"mistral_v0_3_instruct", "<s>", "</s>"},
    {"mistral_v0_3_instruct_2024_05", "<s>", "</s>"},
    {"mistral_nemo_instruct_2407", "<s>", "</s>"},
    {"chatml", "<s>", "<|im_end|>"},
    // More real templates, for the statements the ones above do not use: macros (Qwen3.5,
    // MiniCPM3 with a call block, Jamba with *args, LFM2.5 with {% generation %}), reasoning blocks.
    {"qwen3_0_6b", "", "<|im_end|>"},
    {"qwen3_5_4b", "", "<|im_end|>"},
    {"deepseek_r1", "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"},
    {"llama3_2_11b_vision_instruct", "<|begin_of_text|>", "<|eot_id|>", {{"date_string", "26 Nov 2026"}}},
    {"minicpm3_4b", "<s>", "<|im_end|>"},
    {"ai21_jamba_large_1_6", "<|startoftext|>", "<|endoftext|>"},
    // With tools it prints today's date (strftime_now, no date_string): no tools case.
    {"lfm2_5_vl_450m", "<|startoftext|>", "<|im_end|>", ojson::object(), false},
    // DeepSeek-V3's real template (the automap's deepseek-v3:671b), TRL's training templates as
    // TRL ships them (huggingface/trl trl/chat_templates/, with {% generation %} blocks) and the
    // real Qwen3 / DeepSeek templates with generation blocks placed as TRL places them
    // (tests/test_loss_mask.cpp's TRL masks): the tags change nothing in the text.
    {"deepseek_v3", "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"},
    {"trl_llama3_training", "<|begin_of_text|>", "<|eot_id|>"},
    {"trl_qwen3_training", "", "<|im_end|>"},
    {"trl_deepseekv3", "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"},
    {"trl_deepseekv3_training", "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"},
    {"qwen3_0_6b_generation", "", "<|im_end|>"},
    {"deepseek_r1_generation", "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"},
    {"deepseek_v3_generation", "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"},
};

std::string fixture(const std::string& name) {
  return (source_dir() / "tests" / "fixtures" / "chat_templates" / (name + ".json")).string();
}

std::vector<Case> template_cases() {
  std::vector<Case> cases;
  for (const TemplateFile& t : kTemplates) {
    const std::string tmpl = load_chat_template(fixture(t.name));
    for (const Conversation& c : conversations())
      for (const bool gen : {false, true}) {
        ojson v = variables_of(c.messages, t.bos, t.eos, gen);
        v.update(t.extra);
        cases.push_back({t.name + " / " + c.label + (gen ? " / generation prompt" : ""), tmpl, v});
      }
  }
  // The tool branches with JSON tools and other variables.
  const ojson tools = ojson::parse(R"([{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
      "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}}])");
  const std::vector<ChatMessage> ask = {{"system", "sys"}, {"user", "Weather in Paris?"}};
  for (const TemplateFile& t : kTemplates) {
    if (!t.tools) continue;
    ojson v = variables_of(ask, t.bos, t.eos, true);
    v.update(t.extra);
    v["tools"] = tools;
    cases.push_back({t.name + " / tools", load_chat_template(fixture(t.name)), v});
    v["tools_in_user_message"] = false;
    v["date_string"] = "01 Jan 2025";
    cases.push_back({t.name + " / tools in system", load_chat_template(fixture(t.name)), v});
  }
  return cases;
}

// Small templates for single features, each rendered with the same variables.
std::vector<Case> feature_cases() {
  const ojson vars = ojson::parse(R"({"messages": [{"role": "user", "content": "  Hi There  "}, {"role": "assistant", "content": "ok"}],
      "name": "Ünïcode wörld", "n": 7, "f": 2.5, "z": 0, "flag": true, "nothing": null, "list": [3, 1, 2], "words": "a b  c",
      "obj": {"b": 1, "a": [1, "x", null, true], "c": {"d": 1.5}}, "bos_token": "<s>", "eos_token": "</s>", "add_generation_prompt": true})");
  const std::vector<std::string> templates = {
      "{{ name|upper }}|{{ name|lower }}|{{ name|length }}|{{ name.upper() }}|{{ 'hello world'|title }}|{{ 'hello'|capitalize }}",
      "{{ messages[0].content|trim }}|{{ messages[0]['content'].strip() }}|{{ messages[0].content.lstrip() }}|{{ messages[0].content.rstrip() }}.",
      "{{ words.split() }}|{{ words.split(' ') }}|{{ words.split(' ', 1) }}|{{ 'a,b,,c'.split(',') }}",
      "{{ 'abc'.startswith('a') }}{{ 'abc'.endswith('bc') }}{{ 'abc'.startswith(('x', 'ab')) }}{{ 'abc'.replace('b', 'BB') }}{{ 'aaa'.replace('a', 'b', 2) }}",
      "{% for m in messages %}{{ loop.index0 }}{{ loop.index }}{{ loop.first }}{{ loop.last }}{{ loop.length }}{{ loop.revindex }}:{{ m.role }};{% endfor %}",
      "{% for x in list if x > 1 %}{{ x }}{% else %}none{% endfor %}|{% for x in [] %}{{ x }}{% else %}empty{% endfor %}",
      "{% for k, v in obj|items %}{{ k }}={{ v }};{% endfor %}|{% for k in obj %}{{ k }}{% endfor %}|{% for k, v in obj.items() %}{{ k }}{% endfor %}",
      "{% if n > 5 %}big{% elif n > 2 %}mid{% else %}small{% endif %}|{% if z %}z{% elif not flag %}f{% else %}else{% endif %}",
      "{% set ns = namespace(count=0, s='') %}{% for m in messages %}{% set ns.count = ns.count + 1 %}{% set ns.s = ns.s ~ m.role %}{% endfor %}{{ ns.count }}{{ ns.s }}",
      "{% set x = 1 %}{% for i in range(3) %}{% set x = x + i %}{{ x }}{% endfor %}{{ x }}",
      "{{ 1 + 2 }}|{{ 7 // 2 }}|{{ 7 / 2 }}|{{ 7 % 3 }}|{{ -7 % 3 }}|{{ 2 ** 10 }}|{{ 2 ** -1 }}|{{ f * 2 }}|{{ 1.0 }}|{{ n - 0.5 }}|{{ 10 / 4 * 2 }}",
      "{{ 'a' ~ 1 ~ 2.0 ~ true ~ list }}|{{ 'a' + 'b' }}|{{ 'x' + 1 }}|{{ [1] + [2, 3] }}",
      "{{ 1 == 1.0 }}{{ 'a' != 'b' }}{{ 1 < 2 }}{{ 2 >= 3 }}{{ 'a' in 'cat' }}{{ 2 in list }}{{ 'a' in obj }}{{ 'q' not in obj }}{{ nothing == none }}{{ undefined_var in list }}",
      "{{ true and 'x' }}|{{ false or 'y' }}|{{ not flag }}|{{ z or 'zero' }}|{{ list and 1 }}|{{ 'yes' if flag else 'no' }}|{{ 'sel' if z }}.",
      "{{ x is defined }}{{ n is defined }}{{ nothing is none }}{{ name is string }}{{ n is number }}{{ n is integer }}{{ f is integer }}{{ obj is mapping }}{{ list is iterable }}{{ n is odd }}{{ n is not even }}{{ 'ab' is lower }}",
      "{{ list|length }}|{{ list|first }}|{{ list|last }}|{{ list|sort }}|{{ list|reverse }}|{{ list|join('-') }}|{{ list|string }}|{{ [1, 1, 2]|unique }}",
      "{{ obj|tojson }}|{{ obj|tojson(indent=2) }}|{{ list|tojson }}|{{ name|tojson }}|{{ name|tojson(ensure_ascii=true) }}|{{ obj|tojson(sort_keys=true) }}|{{ obj|tojson(separators=(',', ':')) }}",
      "{{ undefined_var|default('dflt') }}|{{ ''|default('e', true) }}|{{ n|default(1) }}|{{ nothing|tojson }}|{{ nothing }}|{{ undefined_var }}.",
      "{{ messages[1:]|length }}|{{ list[::-1] }}|{{ list[1] }}|{{ list[-1] }}|{{ name[0] }}|{{ name[1:4] }}|{{ name[::2] }}|{{ list[5] }}.",
      "{{ obj.get('b') }}{{ obj.get('q', 'no') }}|{{ obj.keys() }}|{{ obj.values()|length }}|{{ obj['c'].d }}|{{ obj.c['d'] }}",
      "{{ messages|selectattr('role', 'equalto', 'user')|list|length }}|{{ messages|rejectattr('role', 'equalto', 'user')|map(attribute='content')|join }}",
      "  {% if flag %}\n    line\n  {% endif %}\n{%- if flag -%}   trimmed   {%- endif -%}\n  {# comment #}\n{{- ' x ' -}}\n  end  ",
      "{%- for m in messages -%}\n  {{ m.role }}\n{% endfor %}\n\n{% set y %}block {{ n }}{% endset %}{{ y }}\n",
      "{% for i in range(10) %}{% if i == 2 %}{% continue %}{% endif %}{% if i == 5 %}{% break %}{% endif %}{{ i }}{% endfor %}",
      "{{ bos_token }}{% if add_generation_prompt %}gen{% endif %}{{ eos_token }}{{ raise_exception('boom') if z else 'no raise' }}",
      "{{ '\\n\\t\\'\\\"\\\\\\u00e9\\x41' }}|{{ \"adj\" 'acent' }}|{{ (1, 2)|length }}|{{ {'k': 'v', 'n': [1]}|tojson }}",
      "{{ 5|string ~ 2.5|string ~ true|string }}|{{ '42'|int + 1 }}|{{ '4.5x'|float }}|{{ 3.7|int }}|{{ -3|abs }}|{{ 'x'|int }}",
      "{{ 'line1\\nline2\\n\\nline4'|indent }}|{{ 'a\\nb'|indent(2, true) }}",
      "{{ raise_exception('custom failure') }}",
      "{{ undefined_var + 1 }}",
      "{{ nothing.attr }}|{{ undefined_var.attr }}|{{ n.attr }}.",
      "{{ 'a' < 'b' }}",
      "{% for x in 5 %}{% endfor %}",
      "{{ list|nosuchfilter }}",
      "{{ n is nosuchtest }}",
      "{% if %}",
      "{{ 'unterminated }}",
      "{% for m in messages %}",
      "{{ messages[0].content|trim|upper|replace('HI', 'Hey')|lower }}{{ (n + 3) * 2 }}{{ -n }}{{ +f }}",
      // Macros (defaults, keywords, kwargs / varargs, recursion, the caller's scope), call blocks,
      // filter blocks, {% generation %} tags and *list / **dict arguments, as real templates use them.
      "{% macro greet(who, punct='!') %}Hello {{ who }}{{ punct }}{% endmacro %}{{ greet('a') }}|{{ greet('b', '?') }}|{{ greet(punct='.', who='c') }}|{{ greet() }}.",
      "{% macro m(a, b=a ~ '2', c=none) %}[{{ a }},{{ b }},{{ c }}]{% endmacro %}{{ m(1) }}{{ m(1, c=3) }}{{ m(b=5, a=4) }}",
      "{% macro kw(a) %}{{ a }}:{{ kwargs|tojson }}:{{ varargs|tojson }}{% endmacro %}{{ kw(1, 2, 3, x=4, y='z') }}|{{ kw() }}",
      "{% macro fact(k) %}{% if k <= 1 %}1{% else %}{{ k }}*{{ fact(k - 1) }}{% endif %}{% endmacro %}{{ fact(5) }}",
      "{% macro uses_outer() %}{{ n }}{{ inner }}{% endmacro %}{% set inner = 'I' %}{{ uses_outer() }}{% for inner in ['L'] %}{{ uses_outer() }}{% endfor %}",
      "{% macro two(a) %}{{ a }}{% endmacro %}{{ two(1, 2) }}",
      "{% macro two(a) %}{{ a }}{% endmacro %}{{ two(b=1) }}",
      "{% macro m() %}{% set x = 5 %}{{ x }}{% endmacro %}{% set x = 1 %}{{ m() }}{{ x }}{{ m is defined }}{{ m is callable }}",
      "{%- macro render(item) -%}\n  <{{ item }}>\n{%- endmacro -%}\n{%- for x in list -%}\n  {{ render(x) }}\n{%- endfor %}",
      "{% macro wrap(tag) %}<{{ tag }}>{{ caller() }}</{{ tag }}>{% endmacro %}{% call wrap('b') %}inside {{ n }}{% endcall %}",
      "{% macro each(items) %}{% for i in items %}{{ caller(i, loop.index) }};{% endfor %}{% endmacro %}{% call(x, k) each(list) %}{{ k }}={{ x }}{% endcall %}",
      "{% macro noargs() %}{{ caller() }}{% endmacro %}{% call noargs() %}{% call noargs() %}nested{% endcall %}{% endcall %}",
      "{% filter upper %}hello {{ name }}{% endfilter %}|{% filter replace('l', 'L') %}hello{% endfilter %}|{% filter indent(2, true) %}a\nb{% endfilter %}",
      "{% filter trim %}   padded   {% endfilter %}|{% filter length %}abc{% endfilter %}",
      "a  {% generation %}  b  {% endgeneration %}  c",
      "a  {%- generation -%}  b  {%- endgeneration %}  c\n{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}\n{% endfor %}",
      "{%generation%}x{%endgeneration%}|{% if true %}\n  {% generation %}\n  y\n  {% endgeneration %}\n{% endif %}",
      "{% macro f(a, b, c) %}{{ a }}{{ b }}{{ c }}{% endmacro %}{{ f(*list) }}|{{ f(1, *[2, 3]) }}|{{ f(**{'a': 'x', 'b': 'y', 'c': 'z'}) }}|{{ f(*[1], c=3, **{'b': 2}) }}",
      "{{ range(*[1, 4]) }}|{{ 'a-b-c'.split(*['-', 1]) }}",
      "{% macro f(a) %}{{ a }}{% endmacro %}{{ f(*5) }}",
      "{% macro f(a) %}{{ a }}{% endmacro %}{{ f(**list) }}",
      "{% macro f(a) %}{{ a }}{% endmacro %}{{ f(a=1, **{'a': 2}) }}",
      "{% macro m(a, a) %}{% endmacro %}",
      "{% macro m(a=1, b) %}{% endmacro %}",
      "{% macro m() %}x{% endmacro %}{{ m() ~ m() }}|{{ (m() + 'y')|upper }}|{{ m()|length }}",
  };
  std::vector<Case> cases;
  for (size_t i = 0; i < templates.size(); ++i) cases.push_back({"feature " + std::to_string(i), templates[i], vars});
  return cases;
}

struct Rendered {
  bool ok = false;
  std::string text;  // the output, or the error
};

Rendered render_loom(const Case& c) {
  try {
    return {true, render_jinja(c.tmpl, c.variables)};
  } catch (const Error& e) {
    return {false, e.what()};
  }
}

// The reference's results: tools/jinja_render.mjs over all cases at once.
std::vector<Rendered> render_reference(const std::vector<Case>& cases) {
  TempDir io("chat_templates");
  ojson input = ojson::array();
  for (const Case& c : cases) input.push_back({{"template", c.tmpl}, {"variables", c.variables}});
  write_file(io / "cases.json", input.dump());
  const std::string command = "node \"" + (source_dir() / "tools" / "jinja_render.mjs").string() + "\" \"" +
                              (io / "cases.json").string() + "\" > \"" + (io / "results.json").string() + "\"";
  if (!run_command(command)) {
    ADD_FAILURE() << "tools/jinja_render.mjs failed: run scripts/setup (it installs @huggingface/jinja into .deps/npm)";
    return {};
  }
  std::vector<Rendered> out;
  for (const auto& r : ojson::parse(read_file(io / "results.json")))
    out.push_back({r.at("ok").get<bool>(), r.at("ok").get<bool>() ? r.at("text").get<std::string>() : r.at("error").get<std::string>()});
  return out;
}

// Byte for byte, or both failing (with the reference's message in Loom's error when
// `same_messages`); returns how many outputs (not errors) matched.
size_t expect_same(const std::vector<Case>& cases, size_t* errors, bool same_messages) {
  const std::vector<Rendered> expected = render_reference(cases);
  if (expected.size() != cases.size()) {
    ADD_FAILURE() << "the reference gave " << expected.size() << " results for " << cases.size() << " cases";
    return 0;
  }
  size_t same = 0, differences = 0;
  *errors = 0;
  for (size_t i = 0; i < cases.size(); ++i) {
    const Rendered got = render_loom(cases[i]);
    if (!got.ok) {
      EXPECT_EQ(got.text.find('\n'), std::string::npos) << "a multi-line error: " << got.text;
    }
    // Both failing agree only for the same reason where asked: Loom's error holds the reference's
    // message (a raise_exception text, "Cannot perform operation ...").
    const bool same_failure = !same_messages || got.text.find(expected[i].text) != std::string::npos;
    if (got.ok == expected[i].ok && (got.ok ? got.text == expected[i].text : same_failure)) {
      (got.ok ? same : *errors) += 1;
      continue;
    }
    if (++differences <= 8)
      ADD_FAILURE() << cases[i].label << " " << shown(cases[i].tmpl.substr(0, 200)) << "\n  reference: "
                    << (expected[i].ok ? "" : "error ") << shown(expected[i].text) << "\n  loom:      " << (got.ok ? "" : "error ")
                    << shown(got.text);
  }
  EXPECT_EQ(differences, 0u) << differences << " of " << cases.size() << " cases differ";
  return same;
}

TEST(ChatTemplate, RealTemplatesMatchTheReference) {
  const std::vector<Case> cases = template_cases();
  size_t errors = 0;
  const size_t same = expect_same(cases, &errors, true);
  std::printf("[ chat templates ] %zu cases: %zu identical outputs, %zu errors on both sides\n", cases.size(), same, errors);
  EXPECT_GE(cases.size(), 880u);
  EXPECT_GE(errors, 40u);  // the raise_exception of Mistral's templates on roles out of order
}

TEST(ChatTemplate, FeaturesMatchTheReference) {
  const std::vector<Case> cases = feature_cases();
  size_t errors = 0;
  const size_t same = expect_same(cases, &errors, false);
  std::printf("[ chat templates ] %zu feature templates: %zu identical outputs, %zu errors on both sides\n", cases.size(), same,
              errors);
}

TEST(ChatTemplate, RendersChatMessages) {
  const std::string tmpl = load_chat_template(fixture("chatml"));
  ChatTemplateOptions options;
  options.add_generation_prompt = true;
  EXPECT_EQ(render_chat_template(tmpl, {{"user", "Hi"}}, options), "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
  options.extra = {{"date_string", "02 Feb 2025"}};
  const std::string llama = render_chat_template(load_chat_template(fixture("llama3_1_instruct")), {{"user", "x"}}, options);
  EXPECT_NE(llama.find("Today Date: 02 Feb 2025"), std::string::npos) << llama;
}

// A call block's caller kept past the block (its scope gone) is refused rather than run; the
// reference, whose scopes are garbage-collected, still renders it.
TEST(ChatTemplate, CallerKeptPastItsBlockIsRefused) {
  const std::string tmpl =
      "{% set ns = namespace(f=none) %}{% macro keep() %}{% set ns.f = caller %}{% endmacro %}"
      "{% call keep() %}body{% endcall %}{{ ns.f() }}";
  try {
    render_jinja(tmpl, ojson::object());
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("caller() used after its call block ended"), std::string::npos) << e.what();
  }
}

TEST(ChatTemplate, LoadsTokenizerConfigForms) {
  TempDir dir("chat_config");
  write_file(dir / "list.json", R"({"chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]})");
  EXPECT_EQ(load_chat_template((dir / "list.json").string()), "D");
  EXPECT_EQ(load_chat_template((dir / "list.json").string(), "tool_use"), "T");
  EXPECT_THROW(load_chat_template((dir / "list.json").string(), "rag"), Error);
  write_file(dir / "none.json", R"({"bos_token": "<s>"})");
  EXPECT_THROW(load_chat_template((dir / "none.json").string()), Error);
  write_file(dir / "bad.json", R"({"chat_template": 3})");
  EXPECT_THROW(load_chat_template((dir / "bad.json").string()), Error);
}

TEST(ChatTemplate, ErrorsNameThePosition) {
  try {
    render_jinja("line one\n{{ 1 +* 2 }}", ojson::object());
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("line 2"), std::string::npos) << e.what();
  }
  try {
    render_chat_template(load_chat_template(fixture("mistral_v0_3_instruct")), {{"user", "a"}, {"user", "b"}}, {});
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("roles must alternate"), std::string::npos) << e.what();
  }
}

// {% generation %} ... {% endgeneration %} (transformers' marker of the assistant's text, TRL's
// training templates): the text is the one rendered without asking for the ranges (the tags
// removed with the whitespace their '-' takes, as @huggingface/jinja removes them: the real
// templates above agree with it), and each block's output is a range, as transformers'
// AssistantTracker records it (the length rendered before the block, plus the block's output).
TEST(ChatTemplate, GenerationBlocksGiveTheRangesTheyRender) {
  const auto ranges_of = [](const std::string& tmpl, const ojson& vars = ojson::object()) {
    std::vector<TextRange> ranges;
    const std::string text = render_jinja(tmpl, vars, "", &ranges);
    EXPECT_EQ(text, render_jinja(tmpl, vars)) << tmpl;
    std::vector<std::string> parts;
    for (const TextRange& r : ranges) parts.push_back(text.substr(r.begin, r.end - r.begin));
    return std::pair{text, parts};
  };
  using Parts = std::vector<std::string>;
  EXPECT_EQ(ranges_of("a{% generation %}b{% endgeneration %}c"), std::pair(std::string("abc"), Parts{"b"}));
  // Whitespace: a tag without '-' keeps the whitespace on its sides; '-' drops that side's.
  EXPECT_EQ(ranges_of("x {% generation %} y {% endgeneration %} z"), std::pair(std::string("x  y  z"), Parts{" y "}));
  EXPECT_EQ(ranges_of("x {%- generation -%} y {%- endgeneration %} z"), std::pair(std::string("xy z"), Parts{"y"}));
  // Other tags' whitespace control sees through the tags, as if they were not there.
  EXPECT_EQ(ranges_of("{{ 'a' }}  {% generation %}  {{- 'b' }}{% endgeneration %}"), std::pair(std::string("ab"), Parts{"b"}));
  EXPECT_EQ(ranges_of("{{ 'a' -}}  {% generation %}  b{% endgeneration %}"), std::pair(std::string("ab"), Parts{"b"}));
  EXPECT_EQ(ranges_of("{% if true -%}\n {% generation %} \n{%- endif %}c{% endgeneration %}"),
            std::pair(std::string("c"), Parts{"c"}));
  // Nested blocks give a range each (outer first); blocks in loops and macros, empty blocks.
  EXPECT_EQ(ranges_of("{% generation %}a{% generation %}b{% endgeneration %}{% endgeneration %}"),
            std::pair(std::string("ab"), Parts({"ab", "b"})));
  EXPECT_EQ(ranges_of("{% for m in messages %}<{{ m.role }}>{% if m.role == 'assistant' %}{% generation %}{{ m.content }}.{% endgeneration %}"
                      "{% else %}{{ m.content }}{% endif %}{% endfor %}",
                      {{"messages", {{{"role", "user"}, {"content", "q"}}, {{"role", "assistant"}, {"content", "a"}},
                                     {{"role", "user"}, {"content", "r"}}, {{"role", "assistant"}, {"content", "b"}}}}}),
            std::pair(std::string("<user>q<assistant>a.<user>r<assistant>b."), Parts({"a.", "b."})));
  EXPECT_EQ(ranges_of("{% macro m(x) %}{% generation %}{{ x }}{% endgeneration %}{% endmacro %}1{{ m('2') }}3"),
            std::pair(std::string("123"), Parts{"2"}));
  EXPECT_EQ(ranges_of("a{% generation %}{% endgeneration %}b"), std::pair(std::string("ab"), Parts{""}));
  // No tags: no ranges.
  EXPECT_FALSE(has_generation_blocks("{{ x }}"));
  EXPECT_TRUE(has_generation_blocks("{%- generation %}"));
  EXPECT_EQ(ranges_of("plain"), std::pair(std::string("plain"), Parts{}));
  // A real template with the tags (LFM2.5): each assistant reply with its end-of-turn marker.
  const std::string lfm = load_chat_template(fixture("lfm2_5_vl_450m"));
  std::vector<TextRange> ranges;
  ChatTemplateOptions options;
  options.bos_token = "<|startoftext|>";
  const std::string text = render_chat_template(lfm, {{"user", "Hi"}, {"assistant", "Hello!"}, {"user", "Bye"}, {"assistant", "Ciao."}},
                                                options, &ranges);
  EXPECT_EQ(text, "<|startoftext|><|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n"
                  "<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\nCiao.<|im_end|>\n");
  EXPECT_EQ(ranges, std::vector<TextRange>({{67, 84}, {137, 153}}));  // 15 + 30 + 22 = 67; 84 + 53 = 137
  EXPECT_EQ(text.substr(67, 17), "Hello!<|im_end|>\n");
  EXPECT_EQ(text.substr(137, 16), "Ciao.<|im_end|>\n");
  // Asked for, ranges that cannot be told are an Error; not asked for, the text renders as before.
  const auto error = [](const std::string& tmpl, const ojson& vars = ojson::object()) {
    std::vector<TextRange> r;
    return test::error_of([&] { render_jinja(tmpl, vars, "t.jinja", &r); });
  };
  EXPECT_NE(error("{% set x %}{% generation %}ab{% endgeneration %}{% endset %}{{ x|length }}").find("t.jinja: chat template: a "
                  "{% generation %} block's output is not written out as it is"), std::string::npos);
  EXPECT_EQ(render_jinja("{% set x %}{% generation %}ab{% endgeneration %}{% endset %}{{ x|length }}", ojson::object()), "2");
  EXPECT_NE(error("{% generation %}a").find("without its {% endgeneration %}"), std::string::npos);
  EXPECT_NE(error("a{% endgeneration %}").find("without its {% generation %}"), std::string::npos);
  EXPECT_EQ(render_jinja("{% generation %}a", ojson::object()), "a");
  EXPECT_NE(error("{{ x }}{% generation %}{% endgeneration %}", {{"x", std::string("\xff")}}).find("0xFE or 0xFF"),
            std::string::npos);
}

// Hostile templates (issue 41): recursion, endless loops and growing strings or lists stop at a
// stated limit, quickly and within bounded memory, with a one-line Error naming the template's
// file (ChatTemplateOptions::source) and the limit.
TEST(ChatTemplateLimits, HostileTemplatesStopAtANamedLimit) {
  struct Hostile {
    const char* label;
    const char* tmpl;
    const char* limit;
  };
  const Hostile cases[] = {
      {"a macro calling itself twice, 25 levels deep",
       "{% macro f(n) %}{% if n > 0 %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(25) }}",
       "the chat template's step limit"},
      {"endless recursion", "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}",
       "macro calls nested more than 200 deep (the chat template's recursion limit)"},
      {"nested loops", "{% for i in range(1000000) %}{% for j in range(1000000) %}{% endfor %}{% endfor %}",
       "the chat template's step limit"},
      {"string doubling",
       "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}",
       "a string of more than 16 MiB"},
      {"string + string", "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
       "a string of more than 16 MiB"},
      {"replace growth",
       "{% set ns = namespace(s='abcdefgh') %}{% for i in range(40) %}{% set ns.s = ns.s.replace('a', 'aaaa') %}"
       "{% endfor %}{{ ns.s }}",
       "a string of more than 16 MiB"},
      {"replace filter growth",
       "{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s|replace('a', 'aaa') %}{% endfor %}",
       "a string of more than 16 MiB"},
      {"tojson indent", "{{ range(100000)|list|tojson(indent=1000000) }}", "a string of more than 16 MiB"},
      {"list doubling", "{% set ns = namespace(l=[1]) %}{% for i in range(25) %}{% set ns.l = ns.l + ns.l %}{% endfor %}",
       "the chat template's step limit"},
      {"a long split",
       "{% set ns = namespace(s=',') %}{% for i in range(21) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s.split(',')|length }}",
       "a list or dict of more than 2^20 items (the limit of a chat template's lists)"},
      {"a long range", "{{ range(3000000)|length }}", "range() of more than 2^20 numbers"},
      {"join growth", "{% set ns = namespace(s='xxxxxxxx') %}{% for i in range(30) %}{% set ns.s = ns.s|join(ns.s) %}{% endfor %}",
       "a string of more than 16 MiB"},
      {"indent growth",
       "{% set ns = namespace(s='a\\nb') %}{% for i in range(30) %}{% set ns.s = (ns.s ~ '\\n' ~ ns.s)|indent(1000) %}"
       "{% endfor %}",
       "a string of more than 16 MiB"},
      {"lists nested in a loop", "{% set ns = namespace(l=[]) %}{% for i in range(1000) %}{% set ns.l = [ns.l] %}{% endfor %}",
       "nested more than 200 deep"},
      {"a namespace holding itself", "{% set ns = namespace() %}{% set ns.me = ns %}{{ ns|tojson }}", "nested more than 200 deep"},
      {"a long output",
       "{% set ns = namespace(s='x') %}{% for i in range(10) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}"
       "{% for i in range(20000) %}{{ ns.s }}{% endfor %}",
       "a string of more than 16 MiB"},
  };
  ChatTemplateOptions options;
  options.source = "/models/evil/tokenizer_config.json";
  for (const Hostile& h : cases) {
    const auto start = std::chrono::steady_clock::now();
    std::string msg;
    try {
      render_chat_template(h.tmpl, {{"user", "hi"}}, options);
    } catch (const Error& e) {
      msg = e.what();
    }
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    EXPECT_EQ(msg.rfind(std::string(options.source) + ": chat template: line 1, column ", 0), 0u) << h.label << ": " << msg;
    EXPECT_NE(msg.find(h.limit), std::string::npos) << h.label << ": " << msg;
    EXPECT_EQ(msg.find('\n'), std::string::npos) << h.label << ": " << msg;
    // (No timed assertion: the step budget bounds the work, whatever the machine's speed.)
    std::printf("[ chat templates ] %s: stopped after %.2f s\n", h.label, seconds);
  }
  // Within the limits, the same constructs render: 2^19 characters, 2^14 items, 150 levels.
  const std::string ok = render_jinja(
      "{% set ns = namespace(s='x', l=[1], d=[]) %}{% for i in range(19) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}"
      "{% for i in range(14) %}{% set ns.l = ns.l + ns.l %}{% endfor %}{% for i in range(150) %}{% set ns.d = [ns.d] %}"
      "{% endfor %}{{ ns.s|length }} {{ ns.l|length }} {{ ns.d|tojson|length }}",
      ojson::object());
  EXPECT_EQ(ok, "524288 16384 302");
  // Without a source the error names no file, as before.
  try {
    render_jinja("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", ojson::object());
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()).rfind("chat template: line 1, column ", 0), 0u) << e.what();
  }
}

// Mutations of the real templates (deleted, duplicated and inserted pieces, truncation) render
// or fail with a loom::Error, never anything else; a fixed seed and a bounded count.
TEST(ChatTemplateFuzz, MutatedTemplatesNeverCrash) {
  const std::vector<std::string> pieces = {"{%", "%}", "{{", "}}", "{#", "#}", "-", "'", "\"", "(", ")", "[", "]", "{", "}",
                                           "|", ".", ",", ":", "~", "+", "*", "**", "/", "//", "%", "=", "==", " if ", " in ",
                                           " not ", "endif", "endfor", "for ", "set ", "loop", "\\", "\n", " is ", "none", "0",
                                           "-1", "1.5", "messages", "ns", "range(3)", "namespace(", "[::-1]", "|tojson", "|items"};
  std::vector<std::string> bases;
  for (const TemplateFile& t : kTemplates) bases.push_back(load_chat_template(fixture(t.name)));
  const ojson vars = variables_of(conversations()[3].messages, "<s>", "</s>", true);
  std::mt19937 rng(20250602);
  size_t rendered = 0, failed = 0;
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < 400; ++i) {
    std::string t = bases[rng() % bases.size()];
    for (int m = 0, n = 1 + static_cast<int>(rng() % 4); m < n && !t.empty(); ++m) {
      const size_t at = rng() % t.size();
      const size_t len = 1 + rng() % 12;
      switch (rng() % 4) {
        case 0: t.erase(at, len); break;
        case 1: t.insert(at, pieces[rng() % pieces.size()]); break;
        case 2: t.insert(at, t.substr(rng() % t.size(), len)); break;
        default: t.resize(at); break;
      }
    }
    try {
      std::vector<TextRange> ranges;  // every other one with the generation blocks' ranges
      render_jinja(t, vars, "", i % 2 == 0 ? &ranges : nullptr);
      ++rendered;
    } catch (const Error& e) {
      ++failed;
      EXPECT_EQ(std::string(e.what()).find('\n'), std::string::npos) << e.what();
    }
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("[ chat templates ] 400 mutated templates: %zu rendered, %zu loom::Error, %.2f s\n", rendered, failed, seconds);
  EXPECT_LT(seconds, 30.0);
}

}  // namespace
}  // namespace loom
