// Chat templates: the `chat_template` of a Hugging Face tokenizer_config.json rendered for a
// conversation, byte for byte as Hugging Face's JavaScript implementation @huggingface/jinja
// renders it (the Jinja subset in jinja.h; docs/tokenizers.md lists what is supported).
// Independent of the tokenizers: it only reads the file.
//
// A template that does not parse, a runtime error (an unknown filter, an operation on an
// undefined value) and raise_exception(...) are one-line loom::Errors naming the line and
// column of the template, and the template's file when the caller names it (`source`). A
// rendering runs within limits (data/jinja_runtime.h; docs/tokenizers.md): 200 nested macro
// calls, 10^7 loop iterations and macro calls, 16 MiB per string (the output too), 2^20 items per
// list, 200 levels of nested values and 2^30 units of work; each one passed is such an Error
// naming the limit.
#pragma once
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace loom {

struct ChatMessage {
  std::string role;     // "system", "user", "assistant", "tool", ...
  std::string content;
};

struct ChatTemplateOptions {
  std::string bos_token;             // the template variables bos_token and eos_token
  std::string eos_token;
  bool add_generation_prompt = false;
  // More variables (tools, date_string, ...): a JSON object, null for none.
  nlohmann::ordered_json extra = nullptr;
  // Where the template comes from (its file: a tokenizer_config.json, a --chat-template file),
  // named first in every error; "" for none.
  std::string source;
};

// Bytes [begin, end) of a rendering.
struct TextRange {
  size_t begin = 0, end = 0;
  bool operator==(const TextRange&) const = default;
};

// Renders `tmpl` with messages = [{"role": ..., "content": ...}], bos_token, eos_token,
// add_generation_prompt and the `extra` variables. With `generation`: also the ranges of the text
// rendered inside {% generation %} ... {% endgeneration %} blocks, in order of their beginning
// (see render_jinja).
std::string render_chat_template(const std::string& tmpl, const std::vector<ChatMessage>& messages,
                                 const ChatTemplateOptions& options, std::vector<TextRange>* generation = nullptr);

// Renders `tmpl` with `variables`, a JSON object (numbers with an integral value are integers,
// as in JavaScript). `source`: the template's file, named first in errors ("" for none).
// {% generation %} and {% endgeneration %} render their body unchanged (the tags are removed with
// the whitespace around them, as @huggingface/jinja removes them). With `generation`, the ranges
// of the text each block rendered are returned as well, transformers' semantics
// (apply_chat_template's return_assistant_tokens_mask: each block's output, in characters of the
// whole rendering; here in bytes of the same text): nested blocks give a range each, and a block
// whose output the template does not write out as it is (captured by {% set %}, filtered,
// measured) or unbalanced tags are an Error, as is a rendering that holds the bytes 0xFE or 0xFF
// (the marks of the blocks; never in UTF-8 text). Costs a second rendering when the template has
// such tags; without `generation` nothing changes.
std::string render_jinja(const std::string& tmpl, const nlohmann::ordered_json& variables, const std::string& source = "",
                         std::vector<TextRange>* generation = nullptr);

// Whether `tmpl` holds {% generation %} / {% endgeneration %} tags (TRL's training templates do).
bool has_generation_blocks(const std::string& tmpl);

// The chat template of a tokenizer_config.json: `chat_template` as a string, or as a list of
// {"name", "template"} objects, of which the one named `name` ("default" unless given).
std::string load_chat_template(const std::string& config_path, const std::string& name = "default");

}  // namespace loom
