#include "loom/data/sft.h"

#include <algorithm>
#include <fstream>
#include <functional>
#include <optional>
#include <string_view>

#include <nlohmann/json.hpp>

#include "loom/core/error.h"
#include "loom/core/file_io.h"
#include "loom/core/targets.h"
#include "loom/data/chat_template.h"

namespace loom {

namespace {

void append(SftStream& out, const std::vector<int32_t>& ids, uint8_t counts) {
  out.tokens.insert(out.tokens.end(), ids.begin(), ids.end());
  out.mask.insert(out.mask.end(), ids.size(), counts);
  if (counts) out.counted += static_cast<int64_t>(ids.size());
}

const std::string& string_field(const nlohmann::json& j, const char* key, const std::string& where) {
  LOOM_CHECK(j.is_object() && j.contains(key) && j.at(key).is_string(), where, ": expected a string \"", key, "\"");
  return j.at(key).get_ref<const std::string&>();
}

}  // namespace

ChatTemplateOptions chat_template_options(const Tokenizer& tok) {
  ChatTemplateOptions options;
  if (tok.bos_token()) options.bos_token = tok.decode(std::vector<int32_t>{*tok.bos_token()});
  if (tok.eos_token()) options.eos_token = tok.decode(std::vector<int32_t>{*tok.eos_token()});
  return options;
}

namespace {

using Spans = std::vector<std::pair<size_t, size_t>>;  // assistant spans [begin, end) in characters of `full`

// A conversation's renderer: render(list, generation) of any list of its messages, errors
// naming the line.
struct ChatRenderer {
  const std::string& tmpl;
  ChatTemplateOptions options;
  const std::string& where;

  std::string operator()(const std::vector<ChatMessage>& list, bool generation,
                         std::vector<TextRange>* ranges = nullptr) const {
    ChatTemplateOptions o = options;
    o.add_generation_prompt = generation;
    try {
      return render_chat_template(tmpl, list, o, ranges);
    } catch (const Error& e) {
      throw Error(str_cat(where, ": the chat template does not render this conversation (", e.what(), ")"));
    }
  }
  std::string prefix(const std::vector<ChatMessage>& messages, size_t n, bool generation) const {
    return (*this)(std::vector<ChatMessage>(messages.begin(), messages.begin() + static_cast<std::ptrdiff_t>(n)), generation);
  }
};

// Assistant message i's span by definition: between render(messages[:i], add_generation_prompt)
// and render(messages[:i+1]), each a prefix of the next and of `full`. Two renders of a prefix per
// assistant message: quadratic in the conversation's length.
std::pair<size_t, size_t> exact_span(const ChatRenderer& render, const std::vector<ChatMessage>& messages, size_t i,
                                     const std::string& full) {
  const std::string before = render.prefix(messages, i, true), through = render.prefix(messages, i + 1, false);
  LOOM_CHECK(through.compare(0, before.size(), before) == 0 && full.compare(0, through.size(), through) == 0,
             render.where, ": the chat template does not render the conversation up to message ", i,
             " as a prefix of the whole (the assistant's tokens cannot be told apart)");
  return {before.size(), through.size()};
}

size_t common_prefix(std::string_view a, std::string_view b) {
  const size_t n = std::min(a.size(), b.size());
  size_t k = 0;
  while (k < n && a[k] == b[k]) ++k;
  return k;
}

// Assistant message i's span in `full` when the definition's renderings are not prefixes of it
// (Qwen3 renders a reasoning block on the last assistant message only and drops earlier turns'
// reasoning; DeepSeek's generation prompt may hold more than the turn rendered; Llama 3.1 and
// DeepSeek move system messages). With P = render(messages[:i], add_generation_prompt),
// T = render(messages[:i+1]) and R = render(messages[:i]):
//   - the turn's text is T past R (where T parts from R), and the assistant's part of it starts
//     where T parts from P (the generation prompt before it, not counting: P's text is given at
//     inference, not generated). A second T with the content replaced by "\x01" guards that start
//     against a content whose first characters equal the prompt's next ones. The turn's text
//     before that is the header h, after it the body b (the content and the end-of-turn marker);
//   - in `full`, the body starts at the same place as in T when `full` agrees with T up to there
//     (and that is past the previous assistant's span); else just after the first occurrence of
//     h past the previous span (if h is empty: the body is searched for whole);
//   - the span is the longest end of b that `full` has there: all of b where the whole rendering
//     writes the turn as T does, less what the whole rendering leaves out of its start (Qwen3:
//     the reasoning block of a turn before the last user message).
// Nothing found (no h, no end of b there) is an Error naming the line and message.
std::pair<size_t, size_t> located_span(const ChatRenderer& render, const std::vector<ChatMessage>& messages, size_t i,
                                       const std::string& full, const std::string& prompt, const std::string& through,
                                       size_t from) {
  const std::string before = render.prefix(messages, i, false);
  const size_t turn = common_prefix(before, through);
  size_t start = common_prefix(prompt, through);
  std::vector<ChatMessage> probe(messages.begin(), messages.begin() + static_cast<std::ptrdiff_t>(i + 1));
  probe.back().content = "\x01";
  try {
    start = std::min(start, common_prefix(prompt, render(probe, false)));
  } catch (const Error&) {
    // (a template that refuses the probe: the prompt's common part stands)
  }
  start = std::max(start, turn);
  const std::string_view header = std::string_view(through).substr(turn, start - turn);
  const std::string_view body = std::string_view(through).substr(start);
  size_t at = std::string::npos;
  if (start >= from && full.compare(0, start, through, 0, start) == 0) {
    at = start;
  } else if (!header.empty()) {
    const size_t q = full.find(header, from);
    if (q != std::string::npos) at = q + header.size();
  } else {
    const size_t q = body.empty() ? std::string::npos : full.find(body, from);
    if (q != std::string::npos) return {q, q + body.size()};
  }
  if (at != std::string::npos) {
    for (size_t length = body.size(); length > 0; --length) {
      if (full.compare(at, length, body, body.size() - length, length) == 0) return {at, at + length};
    }
  }
  throw Error(str_cat(render.where, ": messages[", i, "] (assistant): its text cannot be found in the chat template's "
                      "rendering of the conversation (neither as render(messages[:", i, "], add_generation_prompt) to "
                      "render(messages[:", i + 1, "]) nor after the previous reply; docs/finetune.md)"));
}

// Every assistant message's span, in order: the definition (exact_span) where its renderings are
// prefixes of `full` past the previous span, else located in `full` (located_span).
Spans message_spans(const ChatRenderer& render, const std::vector<ChatMessage>& messages, const std::string& full) {
  Spans spans;
  for (size_t i = 0; i < messages.size(); ++i) {
    if (messages[i].role != "assistant") continue;
    const size_t from = spans.empty() ? 0 : spans.back().second;
    const std::string prompt = render.prefix(messages, i, true), through = render.prefix(messages, i + 1, false);
    if (through.compare(0, prompt.size(), prompt) == 0 && full.compare(0, through.size(), through) == 0 &&
        prompt.size() >= from) {
      spans.emplace_back(prompt.size(), through.size());
    } else {
      spans.push_back(located_span(render, messages, i, full, prompt, through, from));
    }
  }
  return spans;
}

// The same spans in time linear in the conversation, for the templates where each message's text
// depends only on the first kHead messages, the kContext (or kContext + 1) messages before it,
// the parity of its index and itself (every chat template of a released model we know of). Message
// k's text (render(messages[:k+1]) past render(messages[:k])) is rendered from a window: the
// first kHead messages, then messages[s:k+1] with s - kHead even (so loop.index0 % 2 is the same,
// as Gemma's and Mistral's role checks need). The texts must concatenate to exactly `full`, and
// each assistant's generation prompt must be a prefix of its text; nullopt otherwise (or when a
// window does not render), and the caller renders every prefix instead.
constexpr size_t kHead = 2, kContext = 2;

std::optional<Spans> windowed_spans(const ChatRenderer& render, const std::vector<ChatMessage>& messages,
                                    const std::string& full) {
  const size_t n = messages.size(), first = kHead + kContext;  // prefixes of up to `first` messages: whole
  if (n <= first + 2) return std::nullopt;  // short: the exact spans cost as much
  Spans spans;
  try {
    for (size_t i = 0; i < first; ++i) {
      if (messages[i].role == "assistant") spans.push_back(exact_span(render, messages, i, full));
    }
  } catch (const Error&) {
    return std::nullopt;  // the caller's exact spans give the error
  }
  try {
    const std::string head = render.prefix(messages, first, false);
    if (full.compare(0, head.size(), head) != 0) return std::nullopt;
    size_t at = head.size();
    std::vector<ChatMessage> window;
    size_t cached_start = 0, cached_end = 0;  // `cached` = render(head + messages[cached_start:cached_end])
    std::string cached;
    for (size_t k = first; k < n; ++k) {
      size_t s = k - kContext;
      if ((s - kHead) % 2 != 0) --s;
      window.assign(messages.begin(), messages.begin() + static_cast<std::ptrdiff_t>(kHead));
      window.insert(window.end(), messages.begin() + static_cast<std::ptrdiff_t>(s),
                    messages.begin() + static_cast<std::ptrdiff_t>(k));
      const std::string before = cached_start == s && cached_end == k ? std::move(cached) : render(window, false);
      window.push_back(messages[k]);
      std::string through = render(window, false);
      if (through.compare(0, before.size(), before) != 0) return std::nullopt;
      const size_t length = through.size() - before.size();
      if (full.compare(at, length, through, before.size(), length) != 0) return std::nullopt;
      if (messages[k].role == "assistant") {
        window.pop_back();
        const std::string prompted = render(window, true);
        if (prompted.compare(0, before.size(), before) != 0 || through.compare(0, prompted.size(), prompted) != 0)
          return std::nullopt;
        spans.emplace_back(at + prompted.size() - before.size(), at + length);
      }
      at += length;
      cached = std::move(through), cached_start = s, cached_end = k + 1;
    }
    if (at != full.size()) return std::nullopt;
  } catch (const Error&) {
    return std::nullopt;
  }
  return spans;
}

// `text` tokenized whole (special tokens written in it parsed, nothing added: the template writes
// BOS itself), as transformers' apply_chat_template tokenizes the rendering; a token counts when
// it holds a byte of a span: for each span, the tokens from the one holding its first character
// to the one holding its last (transformers' return_assistant_tokens_mask: char_to_token(start) to
// char_to_token(end - 1)), so a token straddling a span's edge counts. Each token's bytes come
// from decoding it alone; a tokenizer whose tokens do not decode to `text` piece by piece (a
// SentencePiece one with its dummy prefix) has each piece between span edges tokenized on its own
// instead, so that an edge is a token edge.
void append_marked(SftStream& out, const std::string& text, const Spans& spans, const Tokenizer& tok) {
  EncodeOptions special;
  special.parse_special_tokens = true;
  const std::vector<int32_t> ids = tok.encode(text, special);
  std::vector<size_t> starts;  // [token]: its first byte in `text`
  starts.reserve(ids.size());
  size_t at = 0;
  for (const int32_t id : ids) {
    const std::string piece = tok.decode(std::span<const int32_t>(&id, 1));
    if (text.compare(at, piece.size(), piece) != 0) break;
    starts.push_back(at);
    at += piece.size();
  }
  if (starts.size() != ids.size() || at != text.size()) {
    at = 0;
    for (const auto& [begin, end] : spans) {
      if (begin < at) continue;  // (overlapping generation blocks: the outer one is taken)
      append(out, tok.encode(std::string_view(text).substr(at, begin - at), special), 0);
      append(out, tok.encode(std::string_view(text).substr(begin, end - begin), special), 1);
      at = end;
    }
    append(out, tok.encode(std::string_view(text).substr(at), special), 0);
    return;
  }
  std::vector<uint8_t> mask(ids.size(), 0);
  const auto token_at = [&](size_t byte) {  // the token holding `byte`
    return static_cast<size_t>(std::upper_bound(starts.begin(), starts.end(), byte) - starts.begin()) - 1;
  };
  for (const auto& [begin, end] : spans) {
    if (end <= begin || ids.empty()) continue;
    size_t last = end - 1;  // the first byte of the span's last character (transformers counts characters)
    while (last > begin && (static_cast<unsigned char>(text[last]) & 0xC0) == 0x80) --last;
    for (size_t t = token_at(begin), e = token_at(last); t <= e; ++t) mask[t] = 1;
  }
  out.tokens.insert(out.tokens.end(), ids.begin(), ids.end());
  out.mask.insert(out.mask.end(), mask.begin(), mask.end());
  out.counted += std::count(mask.begin(), mask.end(), uint8_t{1});
}

// One conversation: the rendered text, its tokens counting where they hold an assistant span:
// the chat template's {% generation %} blocks where it has them (TRL's assistant_only_loss), else
// each assistant message's span by the definition or located (message_spans).
void add_conversation(SftStream& out, const nlohmann::json& line, const Tokenizer& tok, const std::string& tmpl,
                      const std::string& template_source, const std::string& where) {
  LOOM_CHECK(line.is_object() && line.contains("messages") && line.at("messages").is_array(), where,
             ": expected {\"messages\": [{\"role\": ..., \"content\": ...}, ...]}");
  std::vector<ChatMessage> messages;
  for (size_t i = 0; i < line.at("messages").size(); ++i) {
    const nlohmann::json& m = line.at("messages")[i];
    const std::string at = str_cat(where, ": messages[", i, "]");
    messages.push_back({string_field(m, "role", at), string_field(m, "content", at)});
  }
  LOOM_CHECK(std::any_of(messages.begin(), messages.end(), [](const ChatMessage& m) { return m.role == "assistant"; }),
             where, ": the conversation has no assistant message (nothing to learn)");
  ChatTemplateOptions options = chat_template_options(tok);
  options.source = template_source;  // named first in the template's errors
  const ChatRenderer render{tmpl, options, where};
  Spans spans;
  std::string full;
  if (has_generation_blocks(tmpl)) {
    std::vector<TextRange> ranges;
    full = render(messages, false, &ranges);
    for (const TextRange& r : ranges) {
      if (r.end > r.begin) spans.emplace_back(r.begin, r.end);
    }
    LOOM_CHECK(!spans.empty(), where, ": the chat template's {% generation %} blocks mark no text of this conversation "
               "(nothing to learn)");
  } else {
    full = render(messages, false);
    std::optional<Spans> windowed = windowed_spans(render, messages, full);
    spans = windowed ? std::move(*windowed) : message_spans(render, messages, full);
  }
  append_marked(out, full, spans, tok);
}

// The prompt (BOS first where the tokenizer's files ask for it) not counting, then the
// completion and the end-of-sequence token counting.
void add_completion(SftStream& out, const nlohmann::json& line, const char* completion_key, const Tokenizer& tok,
                    const std::string& where) {
  EncodeOptions prompt;
  prompt.add_special_tokens = true;
  append(out, tok.encode(string_field(line, "prompt", where), prompt), 0);
  const std::string& completion = string_field(line, completion_key, where);
  LOOM_CHECK(!completion.empty(), where, ": the ", completion_key, " is empty (nothing to learn)");
  append(out, tok.encode(completion), 1);
  append(out, {tok.eos_token().value_or(tok.eot_token())}, 1);  // learning to stop
}

// f(line, "path:number") for each non-blank line of a jsonl file, parsed; returns the count.
int64_t for_each_json_line(const std::string& path, const char* what,
                           const std::function<void(const nlohmann::json&, const std::string&)>& f) {
  std::ifstream in(path);
  LOOM_CHECK(in, path, ": cannot open the ", what, " file");
  int64_t examples = 0;
  std::string text;
  // One example per line; a line past 64 MiB is no example (a device such as /dev/zero has no end).
  for (int64_t number = 1; read_line_limited(in, text, size_t{64} << 20, str_cat(path, ":", number)); ++number) {
    if (text.find_first_not_of(" \t\r") == std::string::npos) continue;  // blank lines
    const std::string where = str_cat(path, ":", number);
    nlohmann::json line;
    try {
      line = nlohmann::json::parse(text);
    } catch (const nlohmann::json::exception& e) {
      throw Error(str_cat(where, ": not valid JSON (", e.what(), ")"));
    }
    f(line, where);
    ++examples;
  }
  LOOM_CHECK(examples > 0, path, ": no examples (one JSON object per line)");
  return examples;
}

}  // namespace

SftStream read_sft_file(const std::string& path, SftFormat format, const Tokenizer& tokenizer,
                        const std::string& chat_template, const std::string& template_source) {
  LOOM_CHECK(format != SftFormat::text, "read_sft_file: ", path, " is plain text, not supervised data");
  LOOM_CHECK(format != SftFormat::preference_jsonl, path, ": data.format = preference-jsonl holds preference pairs: "
             "loom train reads them itself from data.input (no loom prepare; docs/finetune.md)");
  LOOM_CHECK(format != SftFormat::prompt_jsonl, path, ": data.format = prompt-jsonl holds prompts with answers: "
             "loom train reads them itself from data.input (no loom prepare; docs/finetune.md)");
  LOOM_CHECK(format != SftFormat::unpaired_preference_jsonl, path, ": data.format = unpaired-preference-jsonl holds "
             "labelled completions: loom train reads them itself from data.input (no loom prepare; docs/finetune.md)");
  LOOM_CHECK(format != SftFormat::chat_jsonl || !chat_template.empty(), path, ": data.format = chat-jsonl needs a chat "
             "template: the tokenizer folder's tokenizer_config.json has none; give one with --chat-template FILE");
  SftStream out;
  out.examples = for_each_json_line(path, "supervised data", [&](const nlohmann::json& line, const std::string& where) {
    if (format == SftFormat::chat_jsonl) add_conversation(out, line, tokenizer, chat_template, template_source, where);
    else add_completion(out, line, "completion", tokenizer, where);
    append(out, {tokenizer.eot_token()}, 0);
  });
  return out;
}

void write_completion_row(std::span<const int32_t> seq, int64_t counted_from, int64_t T, int32_t pad, int32_t* x,
                          int32_t* y) {
  const auto n = static_cast<int64_t>(seq.size());
  LOOM_CHECK(n <= T + 1, "write_completion_row: ", n, " tokens for a row of ", T, " positions");
  for (int64_t t = 0; t < T; ++t) {
    x[t] = t < n ? seq[static_cast<size_t>(t)] : pad;
    y[t] = t + 1 < n && t + 1 >= counted_from ? seq[static_cast<size_t>(t + 1)] : kIgnoreTarget;
  }
}

std::vector<PromptExample> read_prompt_file(const std::string& path, const Tokenizer& tokenizer) {
  std::vector<PromptExample> prompts;
  for_each_json_line(path, "prompt data", [&](const nlohmann::json& line, const std::string& where) {
    PromptExample& p = prompts.emplace_back();
    p.text = string_field(line, "prompt", where);
    p.answer = string_field(line, "answer", where);
    EncodeOptions options;
    options.add_special_tokens = true;
    p.prompt = tokenizer.encode(p.text, options);
    LOOM_CHECK(!p.prompt.empty(), where, ": the prompt is empty");
    p.line = where;
  });
  return prompts;
}

std::vector<PreferencePair> read_preference_file(const std::string& path, const Tokenizer& tokenizer) {
  std::vector<PreferencePair> pairs;
  for_each_json_line(path, "preference data", [&](const nlohmann::json& line, const std::string& where) {
    PreferencePair& p = pairs.emplace_back();
    add_completion(p.chosen, line, "chosen", tokenizer, where);
    add_completion(p.rejected, line, "rejected", tokenizer, where);
    p.line = where;
  });
  return pairs;
}

std::vector<UnpairedExample> read_unpaired_preference_file(const std::string& path, const Tokenizer& tokenizer) {
  std::vector<UnpairedExample> examples;
  for_each_json_line(path, "unpaired preference data", [&](const nlohmann::json& line, const std::string& where) {
    UnpairedExample& e = examples.emplace_back();
    add_completion(e.sequence, line, "completion", tokenizer, where);
    LOOM_CHECK(line.contains("label") && line.at("label").is_boolean(), where,
               ": expected a boolean \"label\" (true: the completion is desirable, false: undesirable)");
    e.desirable = line.at("label").get<bool>();
    e.line = where;
  });
  return examples;
}

std::vector<UnpairedExample> unpair_preferences(std::vector<PreferencePair> pairs) {
  std::vector<UnpairedExample> examples;
  examples.reserve(2 * pairs.size());
  for (PreferencePair& p : pairs) {
    examples.push_back({std::move(p.chosen), true, p.line});
    examples.push_back({std::move(p.rejected), false, std::move(p.line)});
  }
  return examples;
}

}  // namespace loom
