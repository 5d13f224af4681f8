// OpenAI's HTTP API (https://platform.openai.com/docs/api-reference: Completions, Chat
// Completions, Models) as Loom reads and writes it: request bodies parsed and checked into a
// ParsedRequest, the response objects and stream chunks built from what the engine produced,
// and errors in OpenAI's shape {"error": {"message", "type", "param", "code"}}. No I/O here:
// serve/http_server.h puts it behind HTTP, serve/scheduler.h behind the engine.
//
// Accepted fields (others are ignored, as OpenAI's own server ignores unknown ones):
//   both:        model, max_tokens (chat also max_completion_tokens), temperature [0, 2], top_p
//                (0, 1], top_k (>= 0, 0 = off; an extension vLLM and llama.cpp accept), seed, n
//                [1, max n], stop (a string or up to 4 strings), presence_penalty and
//                frequency_penalty [-2, 2], stream, stream_options.include_usage, ignore_eos (vLLM's
//                extension: generate max_tokens whatever the model draws; benchmarks use it)
//   completions: prompt (a string, an array of strings, or an array of token ids), logprobs
//                (0..5: the top alternatives per token), echo (false only)
//   chat:        messages [{role, content}] (content a string or text parts), logprobs (bool),
//                top_logprobs (0..20)
// A field of the wrong type or out of range, a prompt longer than the model's context, malformed
// JSON and invalid UTF-8 are ApiErrors with status 400 naming the field.
#pragma once
#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "loom/data/chat_template.h"
#include "loom/data/tokenizer.h"
#include "loom/infer/sampler.h"

namespace loom::serve {

// An error answered to the client: HTTP status, OpenAI's error type, the offending field.
class ApiError : public std::runtime_error {
 public:
  ApiError(int status, const std::string& message, std::string param = "", std::string type = "")
      : std::runtime_error(message), status_(status), param_(std::move(param)),
        type_(type.empty() ? default_type(status) : std::move(type)) {}
  int status() const { return status_; }
  const std::string& param() const { return param_; }
  const std::string& type() const { return type_; }
  // {"error": {"message", "type", "param", "code"}}
  nlohmann::json body() const;
  // body() as text; bytes of the message that are not UTF-8 (echoed input) become U+FFFD.
  std::string text() const;

 private:
  static std::string default_type(int status);
  int status_;
  std::string param_, type_;
};

enum class Endpoint { completions, chat };

// What the server knows of its model, for checking requests.
struct ModelInfo {
  std::string id;                // the name clients pass as "model"
  int64_t context = 0;           // model.max_seq_len
  int64_t max_n = 1;             // the most samples a request may ask for (rows of the batch)
  int64_t created = 0;           // unix time the server started
  std::vector<int32_t> stop_tokens;  // end of text / end of sequence
  std::string chat_template;     // "" : chat completions answer 400
  ChatTemplateOptions chat_options;  // bos / eos strings
};

struct ParsedRequest {
  Endpoint endpoint = Endpoint::completions;
  std::vector<std::vector<int32_t>> prompts;  // chat: one, the rendered conversation
  int64_t max_tokens = 16;
  SamplingConfig sampling;
  bool seeded = false;             // "seed" given (else the server picks one)
  int64_t n = 1;
  std::vector<std::string> stop;
  bool stream = false, include_usage = false;
  bool ignore_eos = false;         // no stop tokens (vLLM's extension)
  int64_t logprobs = -1;           // -1: none; else the number of top alternatives per token
};

// Parses and checks a request body; throws ApiError.
ParsedRequest parse_request(Endpoint endpoint, const std::string& body, const Tokenizer& tokenizer,
                            const ModelInfo& model);

// One generated token's log-probability (natural log, of the model's distribution before
// temperature and penalties) and the most likely alternatives.
struct TokenLogprob {
  int32_t token = 0;
  double logprob = 0;
  std::vector<std::pair<int32_t, double>> top;
};

// What one choice produced.
struct ChoiceOutput {
  std::string text;
  std::string finish_reason;       // "stop" or "length" (empty while streaming)
  std::vector<TokenLogprob> logprobs;
};

// The objects of a finished request.
nlohmann::json completion_response(const std::string& id, const ModelInfo& model, Endpoint endpoint,
                                   const std::vector<ChoiceOutput>& choices, int64_t prompt_tokens,
                                   int64_t completion_tokens, bool with_logprobs, const Tokenizer& tokenizer);
// One streamed chunk: `delta` text of choice `index` (with its logprobs), or its finish reason.
nlohmann::json stream_chunk(const std::string& id, const ModelInfo& model, Endpoint endpoint, int64_t index,
                            const std::string& delta, const std::string& finish_reason, bool first,
                            const std::vector<TokenLogprob>* logprobs, const Tokenizer& tokenizer);
// The last chunk when stream_options.include_usage: no choices, the usage.
nlohmann::json usage_chunk(const std::string& id, const ModelInfo& model, Endpoint endpoint, int64_t prompt_tokens,
                           int64_t completion_tokens);
// GET /v1/models
nlohmann::json models_response(const ModelInfo& model);

}  // namespace loom::serve
