#include "loom/serve/openai.h"

#include <algorithm>
#include <cmath>

#include "loom/core/error.h"
#include "loom/core/utf8.h"

namespace loom::serve {

using nlohmann::json;

std::string ApiError::default_type(int status) {
  switch (status) {
    case 400: return "invalid_request_error";
    case 404: return "not_found_error";
    case 429: return "rate_limit_error";
    case 503: return "service_unavailable";
    default: return "server_error";
  }
}

json ApiError::body() const {
  return {{"error", {{"message", what()}, {"type", type_}, {"param", param_.empty() ? json(nullptr) : json(param_)},
                     {"code", nullptr}}}};
}

std::string ApiError::text() const { return body().dump(-1, ' ', false, json::error_handler_t::replace); }

namespace {

[[noreturn]] void bad(const std::string& param, const std::string& message) { throw ApiError(400, message, param); }

// The field's value when present and not null.
const json* field(const json& body, const char* key) {
  const auto it = body.find(key);
  return it == body.end() || it->is_null() ? nullptr : &*it;
}

double number(const json& body, const char* key, double fallback, double lo, double hi) {
  const json* v = field(body, key);
  if (v == nullptr) return fallback;
  if (!v->is_number()) bad(key, str_cat("'", key, "' must be a number, got ", v->type_name()));
  const double x = v->get<double>();
  if (!std::isfinite(x) || x < lo || x > hi) bad(key, str_cat("'", key, "' must be in [", lo, ", ", hi, "], got ", x));
  return x;
}

// The value as the request gave it, for errors: JSON text of a number, the type of anything else.
std::string given(const json& v) { return v.is_number() ? v.dump() : std::string(v.type_name()); }

int64_t integer(const json& body, const char* key, int64_t fallback, int64_t lo, int64_t hi) {
  const json* v = field(body, key);
  if (v == nullptr) return fallback;
  if (!v->is_number_integer()) bad(key, str_cat("'", key, "' must be an integer, got ", given(*v)));
  // nlohmann keeps 2^63 .. 2^64 - 1 unsigned: get<int64_t> would wrap them to negative numbers.
  const bool in_range = v->is_number_unsigned() ? hi >= 0 && v->get<uint64_t>() <= static_cast<uint64_t>(hi) &&
                                                      (lo <= 0 || v->get<uint64_t>() >= static_cast<uint64_t>(lo))
                                                : v->get<int64_t>() >= lo && v->get<int64_t>() <= hi;
  if (!in_range) bad(key, str_cat("'", key, "' must be in [", lo, ", ", hi, "], got ", given(*v)));
  return v->get<int64_t>();
}

bool boolean(const json& body, const char* key, bool fallback) {
  const json* v = field(body, key);
  if (v == nullptr) return fallback;
  if (!v->is_boolean()) bad(key, str_cat("'", key, "' must be a boolean, got ", v->type_name()));
  return v->get<bool>();
}

// A message's content: a string, or an array of parts of which the {"type": "text", "text"} ones count.
std::string content_text(const json& content, const std::string& param) {
  if (content.is_string()) return content.get<std::string>();
  if (content.is_null()) return "";
  if (!content.is_array()) bad(param, str_cat("'", param, "' must be a string or an array of text parts"));
  std::string text;
  for (const json& part : content) {
    if (!part.is_object() || part.value("type", "") != "text" || !part.contains("text") || !part.at("text").is_string()) {
      bad(param, str_cat("'", param, "' parts must be {\"type\": \"text\", \"text\": \"...\"} (only text is supported)"));
    }
    text += part.at("text").get<std::string>();
  }
  return text;
}

std::vector<int32_t> prompt_tokens(const json& prompt, const Tokenizer& tokenizer, const ModelInfo& model,
                                   const std::string& param) {
  std::vector<int32_t> ids;
  if (prompt.is_string()) {
    ids = tokenizer.encode(prompt.get<std::string>());
    if (ids.empty()) ids.push_back(tokenizer.eot_token());  // as loom generate: an empty prompt is end of text
  } else {
    for (const json& t : prompt) {
      if (!t.is_number_integer() || t.get<int64_t>() < 0 || t.get<int64_t>() >= tokenizer.vocab_size()) {
        bad(param, str_cat("'", param, "' token ids must be integers in [0, ", tokenizer.vocab_size(), ")"));
      }
      ids.push_back(t.get<int32_t>());
    }
    if (ids.empty()) bad(param, str_cat("'", param, "' is empty"));
  }
  if (static_cast<int64_t>(ids.size()) >= model.context) {
    bad(param, str_cat("This model's maximum context length is ", model.context, " tokens. However, your prompt has ",
                       ids.size(), " tokens (at most ", model.context - 1, " leave room for one new token)."));
  }
  return ids;
}

}  // namespace

ParsedRequest parse_request(Endpoint endpoint, const std::string& text, const Tokenizer& tokenizer, const ModelInfo& model) {
  json body;
  try {
    body = json::parse(text);
  } catch (const json::exception& e) {
    // nlohmann checks UTF-8 while parsing: ill-formed bytes are a parse error too.
    throw ApiError(400, str_cat("the request body is not valid JSON (", e.what(), ")"));
  }
  if (!body.is_object()) bad("", "the request body must be a JSON object");
  ParsedRequest r;
  r.endpoint = endpoint;
  if (const json* m = field(body, "model"); m != nullptr) {
    if (!m->is_string()) bad("model", "'model' must be a string");
    if (m->get<std::string>() != model.id) {  // as OpenAI and vLLM: 404, naming what is served
      throw ApiError(404, str_cat("The model '", m->get<std::string>(), "' does not exist; this server serves '", model.id,
                                  "' (GET /v1/models)"), "model", "invalid_request_error");
    }
  }
  if (endpoint == Endpoint::completions) {
    const json* p = field(body, "prompt");
    if (p == nullptr) bad("prompt", "'prompt' is required");
    const bool token_array = p->is_array() && !p->empty() && p->front().is_number();
    if (p->is_string() || token_array) {
      r.prompts.push_back(prompt_tokens(*p, tokenizer, model, "prompt"));
    } else if (p->is_array() && !p->empty()) {
      for (const json& one : *p) {
        if (!one.is_string() && !one.is_array()) bad("prompt", "'prompt' must be a string, an array of strings or of token ids");
        r.prompts.push_back(prompt_tokens(one, tokenizer, model, "prompt"));
      }
    } else {
      bad("prompt", "'prompt' must be a string, an array of strings or an array of token ids");
    }
    if (boolean(body, "echo", false)) bad("echo", "'echo' is not supported");
    r.logprobs = integer(body, "logprobs", -1, 0, 5);
    r.max_tokens = integer(body, "max_tokens", 16, 1, model.context);
  } else {
    if (model.chat_template.empty()) {
      throw ApiError(400, "this model has no chat template (serve it with --chat-template FILE, or a tokenizer folder "
                          "whose tokenizer_config.json has one); use /v1/completions", "messages");
    }
    const json* ms = field(body, "messages");
    if (ms == nullptr || !ms->is_array() || ms->empty()) bad("messages", "'messages' must be a non-empty array");
    std::vector<ChatMessage> messages;
    for (size_t i = 0; i < ms->size(); ++i) {
      const json& m = (*ms)[i];
      const std::string param = str_cat("messages[", i, "]");
      if (!m.is_object() || !m.contains("role") || !m.at("role").is_string()) {
        bad(param, str_cat("'", param, "' must be an object with a string 'role'"));
      }
      messages.push_back({m.at("role").get<std::string>(), content_text(m.value("content", json()), param + ".content")});
    }
    ChatTemplateOptions options = model.chat_options;
    options.add_generation_prompt = true;
    std::string rendered;
    try {
      rendered = render_chat_template(model.chat_template, messages, options);
    } catch (const Error& e) {
      bad("messages", str_cat("the chat template does not render these messages (", e.what(), ")"));
    }
    EncodeOptions special;
    special.parse_special_tokens = true;
    r.prompts.push_back(tokenizer.encode(rendered, special));
    if (r.prompts.back().empty()) r.prompts.back().push_back(tokenizer.eot_token());
    if (static_cast<int64_t>(r.prompts.back().size()) >= model.context) {
      bad("messages", str_cat("This model's maximum context length is ", model.context,
                              " tokens. However, your messages resulted in ", r.prompts.back().size(), " tokens."));
    }
    const bool logprobs = boolean(body, "logprobs", false);
    const int64_t top = integer(body, "top_logprobs", 0, 0, 20);
    if (top > 0 && !logprobs) bad("top_logprobs", "'top_logprobs' needs 'logprobs': true");
    r.logprobs = logprobs ? top : -1;
    const int64_t max_completion = integer(body, "max_completion_tokens", -1, 1, model.context);
    r.max_tokens = max_completion > 0 ? max_completion : integer(body, "max_tokens", model.context, 1, model.context);
  }
  r.sampling.temperature = static_cast<float>(number(body, "temperature", 1.0, 0.0, 2.0));
  r.sampling.top_p = static_cast<float>(number(body, "top_p", 1.0, 0.0, 1.0));
  if (r.sampling.top_p <= 0.0f) bad("top_p", "'top_p' must be in (0, 1]");
  r.sampling.top_k = integer(body, "top_k", 0, -1, 1 << 30);
  if (r.sampling.top_k < 0) r.sampling.top_k = 0;  // vLLM's -1: no limit
  r.sampling.presence_penalty = static_cast<float>(number(body, "presence_penalty", 0.0, -2.0, 2.0));
  r.sampling.frequency_penalty = static_cast<float>(number(body, "frequency_penalty", 0.0, -2.0, 2.0));
  if (const json* s = field(body, "seed")) {
    if (!s->is_number_integer()) bad("seed", "'seed' must be an integer");
    r.sampling.seed = s->is_number_unsigned() ? s->get<uint64_t>() : static_cast<uint64_t>(s->get<int64_t>());
    r.seeded = true;
  }
  r.n = integer(body, "n", 1, 1, model.max_n);
  if (const json* s = field(body, "stop")) {
    if (s->is_string()) {
      r.stop.push_back(s->get<std::string>());
    } else if (s->is_array() && s->size() <= 4 && std::all_of(s->begin(), s->end(), [](const json& x) { return x.is_string(); })) {
      for (const json& x : *s) r.stop.push_back(x.get<std::string>());
    } else {
      bad("stop", "'stop' must be a string or an array of at most 4 strings");
    }
    std::erase_if(r.stop, [](const std::string& x) { return x.empty(); });
  }
  r.stream = boolean(body, "stream", false);
  r.ignore_eos = boolean(body, "ignore_eos", false);
  if (const json* o = field(body, "stream_options")) {
    if (!o->is_object()) bad("stream_options", "'stream_options' must be an object");
    r.include_usage = boolean(*o, "include_usage", false);
  }
  return r;
}

namespace {

std::string token_string(const Tokenizer& tokenizer, int32_t token) {
  return valid_utf8(tokenizer.decode(std::vector<int32_t>{token}));
}

json token_bytes(const Tokenizer& tokenizer, int32_t token) {
  json bytes = json::array();
  for (const char c : tokenizer.decode(std::vector<int32_t>{token})) bytes.push_back(static_cast<unsigned char>(c));
  return bytes;
}

// Completions' logprobs object: {tokens, token_logprobs, top_logprobs, text_offset}.
json completion_logprobs(const std::vector<TokenLogprob>& lps, const Tokenizer& tokenizer, int64_t offset) {
  json tokens = json::array(), values = json::array(), tops = json::array(), offsets = json::array();
  for (const TokenLogprob& t : lps) {
    const std::string s = token_string(tokenizer, t.token);
    tokens.push_back(s);
    values.push_back(t.logprob);
    json top = json::object();
    for (const auto& [tok, lp] : t.top) top[token_string(tokenizer, tok)] = lp;
    tops.push_back(top);
    offsets.push_back(offset);
    offset += static_cast<int64_t>(s.size());
  }
  return {{"tokens", tokens}, {"token_logprobs", values}, {"top_logprobs", tops}, {"text_offset", offsets}};
}

// Chat's logprobs object: {content: [{token, logprob, bytes, top_logprobs: [...]}]}.
json chat_logprobs(const std::vector<TokenLogprob>& lps, const Tokenizer& tokenizer) {
  json content = json::array();
  for (const TokenLogprob& t : lps) {
    json top = json::array();
    for (const auto& [tok, lp] : t.top) {
      top.push_back({{"token", token_string(tokenizer, tok)}, {"logprob", lp}, {"bytes", token_bytes(tokenizer, tok)}});
    }
    content.push_back({{"token", token_string(tokenizer, t.token)}, {"logprob", t.logprob},
                       {"bytes", token_bytes(tokenizer, t.token)}, {"top_logprobs", top}});
  }
  return {{"content", content}, {"refusal", nullptr}};
}

json usage(int64_t prompt_tokens, int64_t completion_tokens) {
  return {{"prompt_tokens", prompt_tokens}, {"completion_tokens", completion_tokens},
          {"total_tokens", prompt_tokens + completion_tokens}};
}

const char* object_name(Endpoint e, bool chunk) {
  if (e == Endpoint::chat) return chunk ? "chat.completion.chunk" : "chat.completion";
  return "text_completion";
}

}  // namespace

json completion_response(const std::string& id, const ModelInfo& model, Endpoint endpoint,
                         const std::vector<ChoiceOutput>& choices, int64_t prompt_tokens, int64_t completion_tokens,
                         bool with_logprobs, const Tokenizer& tokenizer) {
  json out_choices = json::array();
  for (size_t i = 0; i < choices.size(); ++i) {
    const ChoiceOutput& c = choices[i];
    json choice = {{"index", i}, {"finish_reason", c.finish_reason}};
    if (endpoint == Endpoint::chat) {
      choice["message"] = {{"role", "assistant"}, {"content", c.text}, {"refusal", nullptr}};
      choice["logprobs"] = with_logprobs ? chat_logprobs(c.logprobs, tokenizer) : json(nullptr);
    } else {
      choice["text"] = c.text;
      choice["logprobs"] = with_logprobs ? completion_logprobs(c.logprobs, tokenizer, 0) : json(nullptr);
    }
    out_choices.push_back(std::move(choice));
  }
  return {{"id", id}, {"object", object_name(endpoint, false)}, {"created", model.created}, {"model", model.id},
          {"system_fingerprint", nullptr}, {"choices", out_choices}, {"usage", usage(prompt_tokens, completion_tokens)}};
}

json stream_chunk(const std::string& id, const ModelInfo& model, Endpoint endpoint, int64_t index, const std::string& delta,
                  const std::string& finish_reason, bool first, const std::vector<TokenLogprob>* logprobs,
                  const Tokenizer& tokenizer) {
  json choice = {{"index", index}, {"finish_reason", finish_reason.empty() ? json(nullptr) : json(finish_reason)}};
  if (endpoint == Endpoint::chat) {
    json d = json::object();
    if (first) d["role"] = "assistant";
    if (!delta.empty() || finish_reason.empty()) d["content"] = delta;
    choice["delta"] = d;
    choice["logprobs"] = logprobs != nullptr ? chat_logprobs(*logprobs, tokenizer) : json(nullptr);
  } else {
    choice["text"] = delta;
    choice["logprobs"] = logprobs != nullptr ? completion_logprobs(*logprobs, tokenizer, 0) : json(nullptr);
  }
  return {{"id", id}, {"object", object_name(endpoint, true)}, {"created", model.created}, {"model", model.id},
          {"system_fingerprint", nullptr}, {"choices", json::array({choice})}};
}

json usage_chunk(const std::string& id, const ModelInfo& model, Endpoint endpoint, int64_t prompt_tokens,
                 int64_t completion_tokens) {
  return {{"id", id}, {"object", object_name(endpoint, true)}, {"created", model.created}, {"model", model.id},
          {"choices", json::array()}, {"usage", usage(prompt_tokens, completion_tokens)}};
}

json models_response(const ModelInfo& model) {
  return {{"object", "list"},
          {"data", json::array({{{"id", model.id}, {"object", "model"}, {"created", model.created}, {"owned_by", "loom"},
                                 {"max_model_len", model.context}}})}};
}

}  // namespace loom::serve
