// Chat templates (loom/data/chat_template.h) against Hugging Face's JavaScript implementation
// @huggingface/jinja, run by tools/jinja_render.mjs: the real templates of Llama 3.1 Instruct,
// Qwen2.5 Instruct, Mistral v0.1 / v0.3 Instruct and ChatML (tests/fixtures/chat_templates/)
// over a set of conversations, and small templates for each feature, compared byte for byte (or
// both failing). The reference needs node and the package (scripts/setup installs it into
// .deps/npm): without them the tests fail, naming the command.
#include <gtest/gtest.h>

#include <chrono>
#include <random>

#include "loom/core/error.h"
#include "loom/data/chat_template.h"
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

struct TemplateFile {
  std::string name, bos, eos;
};
const std::vector<TemplateFile> kTemplates = {
    {"llama3_1_instruct", "<|begin_of_text|>", "<|eot_id|>"},
    {"qwen2_5_instruct", "", "<|im_end|>"},
    {"mistral_v0_3_instruct", "<s>", "</s>"},
    {"mistral_v0_1_instruct", "<s>", "</s>"},
    {"chatml", "<s>", "<|im_end|>"},
};

std::string fixture(const std::string& name) {
  return (source_dir() / "tests" / "fixtures" / "chat_templates" / (name + ".json")).string();
}

std::vector<Case> template_cases() {
  std::vector<Case> cases;
  for (const TemplateFile& t : kTemplates) {
    const std::string tmpl = load_chat_template(fixture(t.name));
    for (const Conversation& c : conversations())
      for (const bool gen : {false, true})
        cases.push_back({t.name + " / " + c.label + (gen ? " / generation prompt" : ""), tmpl,
                         variables_of(c.messages, t.bos, t.eos, gen)});
  }
  // The tool branches with JSON tools and other variables.
  const ojson tools = ojson::parse(R"([{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
      "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}}])");
  const std::vector<ChatMessage> ask = {{"system", "sys"}, {"user", "Weather in Paris?"}};
  for (const TemplateFile& t : kTemplates) {
    ojson v = variables_of(ask, t.bos, t.eos, true);
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

// Byte for byte, or both failing; returns how many outputs (not errors) matched.
size_t expect_same(const std::vector<Case>& cases, size_t* errors) {
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
    if (got.ok == expected[i].ok && (!got.ok || got.text == expected[i].text)) {
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
  const size_t same = expect_same(cases, &errors);
  std::printf("[ chat templates ] %zu cases: %zu identical outputs, %zu errors on both sides\n", cases.size(), same, errors);
  EXPECT_GE(cases.size(), 200u);
  EXPECT_GE(errors, 12u);  // Mistral's raise_exception on bad alternation
}

TEST(ChatTemplate, FeaturesMatchTheReference) {
  const std::vector<Case> cases = feature_cases();
  size_t errors = 0;
  const size_t same = expect_same(cases, &errors);
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
      render_jinja(t, vars);
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
