// Supervised fine-tuning data (docs/finetune.md): examples tokenized with a loss mask, 1 where
// the token is a target that counts (the assistant's replies, a completion), 0 elsewhere.
//   chat-jsonl  one conversation per line, OpenAI's shape: {"messages": [{"role": "system" |
//               "user" | "assistant" | ..., "content": "..."}, ...]}, rendered once with the
//               model's chat template (data/chat_template.h); the tokens of the assistant's spans
//               of that rendering count, as TRL's assistant_only_loss counts them:
//               - a template with {% generation %} blocks: exactly the text they render (TRL's rule);
//               - else each assistant message i by the definition where it holds, the text
//                 between render(messages[:i], add_generation_prompt) and render(messages[:i+1])
//                 (its end-of-turn marker included, the generation prompt not), each a prefix of
//                 the next and of the whole; where it does not (Qwen3 drops earlier reasoning),
//                 the reply located in the whole rendering (sft.cpp, located_span).
//               The definition's spans are found in time linear in the conversation where the
//               template allows (each message's text rendered from a window: the first two
//               messages, the two or three before it, itself; the texts must concatenate to
//               exactly the whole), else prefix by prefix (quadratic: long conversations are slow).
//               The rendering is tokenized whole; a token counts when it holds a byte of a span
//               (transformers' char_to_token rule: a token straddling a span's edge counts).
//   jsonl       {"prompt": "...", "completion": "..."} per line: the completion (and the
//               end-of-text token after it) counts; each piece tokenized on its own.
// Examples follow one another in the stream, each followed by the end-of-text token (mask 0). Bad
// input is one line naming the file and line: malformed JSON, a missing or mistyped key, a
// conversation without an assistant message, a template that does not render, an assistant
// message whose text cannot be found in the rendering (naming messages[i]).
#pragma once
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "loom/core/enum_names.h"
#include "loom/data/chat_template.h"
#include "loom/data/tokenizer.h"

namespace loom {

enum class SftFormat : uint8_t { text, chat_jsonl, jsonl, preference_jsonl, prompt_jsonl, unpaired_preference_jsonl };
template <>
struct EnumNames<SftFormat> {  // data.format
  static constexpr std::array<std::string_view, 6> names{"text", "chat-jsonl", "jsonl", "preference-jsonl",
                                                         "prompt-jsonl", "unpaired-preference-jsonl"};
};

struct SftStream {
  std::vector<int32_t> tokens;
  std::vector<uint8_t> mask;  // [token]: 1 where predicting this token counts
  int64_t examples = 0, counted = 0;
};

// The chat template's bos_token and eos_token variables: the text of the tokenizer's BOS and
// EOS tokens, where its files name them (add_generation_prompt and extra left as they are).
ChatTemplateOptions chat_template_options(const Tokenizer& tokenizer);

// Reads `path` (chat-jsonl or jsonl) into one token stream with its mask. chat_template: the
// Jinja source (needed for chat-jsonl); template_source: its file, named in the template's errors.
SftStream read_sft_file(const std::string& path, SftFormat format, const Tokenizer& tokenizer,
                        const std::string& chat_template, const std::string& template_source = "");

// Preference data (the preference objectives' data.format, train/objective.h): {"prompt": "...", "chosen": "...",
// "rejected": "..."} per line, TRL's standard preference format. Each side is one sequence as a
// jsonl example is: the prompt (not counting), the completion and the end-of-sequence token
// (counting); no end-of-text token after it. Errors name the file and line.
struct PreferencePair {
  SftStream chosen, rejected;
  std::string line;  // "path:number", for errors
};
std::vector<PreferencePair> read_preference_file(const std::string& path, const Tokenizer& tokenizer);

// Unpaired preference data (labelled completions, train/objective.h): {"prompt": "...", "completion":
// "...", "label": true | false} per line, TRL's unpaired preference format: label true where the
// completion is desirable. The sequence is a jsonl example's (the prompt not counting, the
// completion and the end-of-sequence token counting; no end-of-text token after it). Errors name
// the file and line.
struct UnpairedExample {
  SftStream sequence;
  bool desirable = true;
  std::string line;  // "path:number", for errors
};
std::vector<UnpairedExample> read_unpaired_preference_file(const std::string& path, const Tokenizer& tokenizer);
// Preference pairs as unpaired examples, as TRL's unpair_preference_dataset makes them: a pair's
// chosen sequence desirable (label true), its rejected one not; pair i gives examples 2i, 2i + 1.
std::vector<UnpairedExample> unpair_preferences(std::vector<PreferencePair> pairs);

// One row of a batch of whole sequences (preference pairs, rollouts): x (T) = seq padded with
// `pad`; y (T) = the next token where it is at index counted_from or later (the completion),
// kIgnoreTarget elsewhere (the prompt, the padding). seq holds at most T + 1 tokens.
void write_completion_row(std::span<const int32_t> seq, int64_t counted_from, int64_t T, int32_t pad, int32_t* x,
                          int32_t* y);

// Prompts with a verifiable answer (for rollouts with a reward, train/objective.h): {"prompt": "...",
// "answer": "..."} per line; the prompt tokenized as a jsonl example's (BOS where the tokenizer's
// files ask for it). Errors name the file and line.
struct PromptExample {
  std::vector<int32_t> prompt;
  std::string text, answer;
  std::string line;  // "path:number"
};
std::vector<PromptExample> read_prompt_file(const std::string& path, const Tokenizer& tokenizer);

}  // namespace loom
