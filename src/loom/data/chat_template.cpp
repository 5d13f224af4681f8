// Chat templates (chat_template.h): the conversation as template variables, and the loader.
#include "loom/data/chat_template.h"

#include <algorithm>
#include <cmath>
#include <new>

#include "loom/core/error.h"
#include "loom/data/jinja.h"
#include "loom/data/jinja_runtime.h"
#include "loom/data/special_tokens.h"

namespace loom {
namespace {

jinja::Value from_json(const nlohmann::ordered_json& j) {
  using jinja::Value;
  switch (j.type()) {
    case nlohmann::ordered_json::value_t::null: return Value::null();
    case nlohmann::ordered_json::value_t::boolean: return Value::boolean(j.get<bool>());
    case nlohmann::ordered_json::value_t::number_integer:
    case nlohmann::ordered_json::value_t::number_unsigned: return Value::integer(j.get<double>());
    case nlohmann::ordered_json::value_t::number_float: {
      const double d = j.get<double>();
      return std::isfinite(d) && std::floor(d) == d ? Value::integer(d) : Value::floating(d);
    }
    case nlohmann::ordered_json::value_t::string: return Value::string(j.get<std::string>());
    case nlohmann::ordered_json::value_t::array: {
      jinja::List items;
      for (const auto& x : j) items.push_back(from_json(x));
      return Value::array(std::move(items));
    }
    case nlohmann::ordered_json::value_t::object: {
      Value obj = Value::object({});
      for (const auto& [k, x] : j.items()) obj.set(k, from_json(x));
      return obj;
    }
    default: throw Error("chat template: a template variable holds binary data");
  }
}

jinja::Dict globals_of(const nlohmann::ordered_json& variables) {
  jinja::Dict globals;
  try {
    if (variables.is_object())
      for (const auto& [k, v] : variables.items()) globals.emplace_back(k, from_json(v));
  } catch (const jinja::RuntimeError& e) {
    throw Error(str_cat("chat template: the variables: ", e.what()));
  }
  return globals;
}

// The ranges of the generation blocks of `text`: `tmpl` rendered again with each block's tags
// left as marks in the output (jinja::tokenize), the marks paired and taken out; what is left must
// be `text` itself (else a block's output went through something other than the output).
std::vector<TextRange> generation_ranges(const std::string& tmpl, const nlohmann::ordered_json& variables,
                                         const std::string& text) {
  LOOM_CHECK(text.find_first_of(std::string{jinja::kGenerationBegin, jinja::kGenerationEnd}) == std::string::npos,
             "chat template: the rendering holds a byte 0xFE or 0xFF (not UTF-8): the {% generation %} blocks' ranges "
             "cannot be told");
  const jinja::AstPtr marked = jinja::parse(jinja::tokenize(tmpl, true), tmpl);
  const std::string with_marks = jinja::render(*marked, tmpl, globals_of(variables));
  std::vector<TextRange> ranges;
  std::vector<size_t> open;
  std::string plain;
  plain.reserve(text.size());
  for (const char c : with_marks) {
    if (c == jinja::kGenerationBegin) {
      open.push_back(plain.size());
    } else if (c == jinja::kGenerationEnd) {
      LOOM_CHECK(!open.empty(), "chat template: an {% endgeneration %} without its {% generation %} (at byte ",
                 plain.size(), " of the rendering)");
      ranges.push_back({open.back(), plain.size()});
      open.pop_back();
    } else {
      plain.push_back(c);
    }
  }
  LOOM_CHECK(open.empty(), "chat template: a {% generation %} block without its {% endgeneration %} (from byte ",
             open.empty() ? 0 : open.back(), " of the rendering)");
  LOOM_CHECK(plain == text, "chat template: a {% generation %} block's output is not written out as it is (captured by "
             "{% set %}, filtered or measured): its range in the rendering cannot be told");
  std::sort(ranges.begin(), ranges.end(),
            [](const TextRange& a, const TextRange& b) { return a.begin != b.begin ? a.begin < b.begin : a.end > b.end; });
  return ranges;
}

}  // namespace

bool has_generation_blocks(const std::string& tmpl) { return jinja::count_generation_tags(tmpl) > 0; }

std::string render_jinja(const std::string& tmpl, const nlohmann::ordered_json& variables, const std::string& source,
                         std::vector<TextRange>* generation) {
  const std::string named = source.empty() ? "" : source + ": ";
  try {
    LOOM_CHECK(variables.is_object() || variables.is_null(), "chat template: the variables must be a JSON object");
    const std::vector<jinja::Token> tokens = jinja::tokenize(tmpl);
    const jinja::AstPtr program = jinja::parse(tokens, tmpl);
    std::string text = jinja::render(*program, tmpl, globals_of(variables));
    if (generation != nullptr)
      *generation = has_generation_blocks(tmpl) ? generation_ranges(tmpl, variables, text) : std::vector<TextRange>{};
    return text;
  } catch (const Error& e) {
    if (source.empty()) throw;
    throw Error(named + e.what());
  } catch (const std::bad_alloc&) {
    throw Error(named + "chat template: out of memory while rendering");
  }
}

std::string render_chat_template(const std::string& tmpl, const std::vector<ChatMessage>& messages,
                                 const ChatTemplateOptions& options, std::vector<TextRange>* generation) {
  nlohmann::ordered_json vars = nlohmann::ordered_json::object();
  nlohmann::ordered_json list = nlohmann::ordered_json::array();
  for (const ChatMessage& m : messages) list.push_back({{"role", m.role}, {"content", m.content}});
  vars["messages"] = std::move(list);
  vars["bos_token"] = options.bos_token;
  vars["eos_token"] = options.eos_token;
  vars["add_generation_prompt"] = options.add_generation_prompt;
  if (!options.extra.is_null()) {
    LOOM_CHECK(options.extra.is_object(), "chat template: extra variables must be a JSON object");
    for (const auto& [k, v] : options.extra.items()) vars[k] = v;
  }
  return render_jinja(tmpl, vars, options.source, generation);
}

std::string load_chat_template(const std::string& config_path, const std::string& name) {
  const nlohmann::json root = read_json_file(config_path);
  const JsonFile file{config_path};
  const nlohmann::json& tmpl = file.at(root, "", "chat_template");
  if (tmpl.is_string()) return tmpl.get<std::string>();
  if (!tmpl.is_array()) file.fail("chat_template", "expected a string or a list of {name, template}");
  for (size_t i = 0; i < tmpl.size(); ++i) {
    const std::string where = "chat_template[" + std::to_string(i) + "]";
    if (file.string_at(tmpl[i], where, "name") == name) return file.string_at(tmpl[i], where, "template");
  }
  file.fail("chat_template", "no template named \"" + name + "\"");
}

}  // namespace loom
