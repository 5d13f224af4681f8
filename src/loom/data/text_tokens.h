// A text file's tokens, read with a bound: calibration text (loom quantize / prune --calib),
// evaluation text (loom eval --text). The file is read in chunks and tokenized piece by piece
// as it is read, so only what the tokens asked for need is read (the first --calib-tokens of a
// 200 MB file read about 1 MiB of it), and an endless input (/dev/zero, a FIFO) stops at a
// stated limit with one line naming the file and the option that sets it.
//
// Pieces: text is cut about every kTextPieceBytes bytes, before a space that follows a
// non-space byte (a boundary of GPT-2's, Llama 3's and Qwen's pre-tokenizers, and of the
// UTF-8 characters), or, in a stretch of kTextPieceBytes with no such space, at the last UTF-8
// character boundary. A text shorter than one piece is encoded whole, exactly as
// Tokenizer::encode encodes it; BOS / EOS (EncodeOptions::add_special_tokens) are added once,
// around the whole text. A SentencePiece tokenizer adds its dummy-prefix space again at each
// cut (one more token per MiB of text).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "loom/data/tokenizer.h"

namespace loom {

inline constexpr size_t kTextPieceBytes = size_t{1} << 20;

struct TextTokensOptions {
  int64_t max_tokens = -1;   // stop once this many tokens are read (-1: the whole text)
  uint64_t max_bytes = 0;    // reading more bytes than this is an error (0: no limit)
  std::string what;          // how the user named the input, for errors: "--calib", "eval --text"
  std::string limit;         // what sets max_bytes, for errors: "--max-input-mb 256"
  EncodeOptions encode;      // add_special_tokens, parse_special_tokens
};

struct TextTokens {
  std::vector<int32_t> ids;  // at most max_tokens (when set) of the text's tokens
  uint64_t bytes = 0;        // bytes read
  bool whole = false;        // the whole text was read (else max_tokens stopped it)
};

// The tokens of the text file at `path`. Errors (loom::Error, one line naming `what` and the
// path): a folder, a file that cannot be read, more than max_bytes read before the end or
// before max_tokens (a regular file larger than max_bytes is refused before reading when the
// whole text is asked for), and running out of memory.
TextTokens read_text_tokens(const std::string& path, const Tokenizer& tokenizer, const TextTokensOptions& options);

// The same over bytes already in memory (the pieces and the special tokens as above).
TextTokens text_tokens(std::string_view text, const Tokenizer& tokenizer, const TextTokensOptions& options);

// Where read_text_tokens cuts `text` (which goes on past it) into a first piece: the length of
// that piece, > 0 for a non-empty text.
size_t text_piece_end(std::string_view text);

// "256 MiB" (whole MiB), else bytes: how limits are written in errors.
std::string byte_limit_text(uint64_t bytes);

}  // namespace loom
