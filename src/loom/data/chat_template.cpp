// Chat templates (chat_template.h): the conversation as template variables, and the loader.
#include "loom/data/chat_template.h"

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

}  // namespace

std::string render_jinja(const std::string& tmpl, const nlohmann::ordered_json& variables, const std::string& source) {
  const std::string named = source.empty() ? "" : source + ": ";
  try {
    LOOM_CHECK(variables.is_object() || variables.is_null(), "chat template: the variables must be a JSON object");
    const std::vector<jinja::Token> tokens = jinja::tokenize(tmpl);
    const jinja::AstPtr program = jinja::parse(tokens, tmpl);
    jinja::Dict globals;
    try {
      if (variables.is_object())
        for (const auto& [k, v] : variables.items()) globals.emplace_back(k, from_json(v));
    } catch (const jinja::RuntimeError& e) {
      throw Error(str_cat("chat template: the variables: ", e.what()));
    }
    return jinja::render(*program, tmpl, globals);
  } catch (const Error& e) {
    if (source.empty()) throw;
    throw Error(named + e.what());
  } catch (const std::bad_alloc&) {
    throw Error(named + "chat template: out of memory while rendering");
  }
}

std::string render_chat_template(const std::string& tmpl, const std::vector<ChatMessage>& messages,
                                 const ChatTemplateOptions& options) {
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
  return render_jinja(tmpl, vars, options.source);
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
