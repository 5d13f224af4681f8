// Bounded, incremental tokenization of a text file (text_tokens.h).
#include "loom/data/text_tokens.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <new>

#include "loom/core/error.h"

namespace loom {
namespace {

constexpr size_t kReadChunk = size_t{64} << 10;

bool ascii_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f'; }

// Encodes pieces of one text: the tokenizer's BOS/EOS (when asked for) once, around the whole.
class PieceEncoder {
 public:
  PieceEncoder(const Tokenizer& tokenizer, const TextTokensOptions& options) : tok_(tokenizer), options_(options) {
    plain_.parse_special_tokens = options.encode.parse_special_tokens;
    if (!options.encode.add_special_tokens) return;
    // What add_special_tokens adds around a text: the probe's tokens with and without.
    const std::vector<int32_t> bare = tok_.encode("a", plain_), full = tok_.encode("a", options.encode);
    const auto at = std::search(full.begin(), full.end(), bare.begin(), bare.end());
    if (at == full.end() || bare.empty()) {
      whole_options_ = true;  // (no such tokenizer here: each piece then gets them)
      return;
    }
    prefix_.assign(full.begin(), at);
    suffix_.assign(at + static_cast<long>(bare.size()), full.end());
    out_.ids = prefix_;
  }
  // Adds a piece; true once max_tokens tokens are in.
  bool add(std::string_view piece) {
    const std::vector<int32_t> ids = tok_.encode(piece, whole_options_ ? options_.encode : plain_);
    out_.ids.insert(out_.ids.end(), ids.begin(), ids.end());
    return enough();
  }
  bool enough() const { return options_.max_tokens >= 0 && static_cast<int64_t>(out_.ids.size()) >= options_.max_tokens; }
  TextTokens finish(uint64_t bytes, bool whole) {
    if (whole) out_.ids.insert(out_.ids.end(), suffix_.begin(), suffix_.end());
    if (options_.max_tokens >= 0 && static_cast<int64_t>(out_.ids.size()) > options_.max_tokens)
      out_.ids.resize(static_cast<size_t>(options_.max_tokens));
    out_.bytes = bytes;
    out_.whole = whole;
    return std::move(out_);
  }

 private:
  const Tokenizer& tok_;
  const TextTokensOptions& options_;
  EncodeOptions plain_;
  bool whole_options_ = false;
  std::vector<int32_t> prefix_, suffix_;
  TextTokens out_;
};

std::string where(const TextTokensOptions& o, const std::string& path) {
  return o.what.empty() ? path : o.what + " " + path;
}

// Encodes whole pieces off the front of `pending` while more than one piece is there (or, at
// the end, all of it); true once enough tokens are in.
bool encode_pieces(std::string& pending, PieceEncoder& encoder, bool end) {
  size_t first = 0;
  bool enough = false;
  while (!enough && pending.size() - first > kTextPieceBytes) {
    const size_t cut = text_piece_end(std::string_view(pending).substr(first, kTextPieceBytes));
    enough = encoder.add(std::string_view(pending).substr(first, cut));
    first += cut;
  }
  if (!enough && end && first < pending.size()) {
    enough = encoder.add(std::string_view(pending).substr(first));
    first = pending.size();
  }
  pending.erase(0, first);
  return enough;
}

struct Fd {
  int fd = -1;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

// read(2) retrying EINTR; throws naming the input.
size_t read_some(int fd, char* buffer, size_t n, const std::string& name) {
  for (;;) {
    const ssize_t got = ::read(fd, buffer, n);
    if (got >= 0) return static_cast<size_t>(got);
    LOOM_CHECK(errno == EINTR, name, ": read failed (", std::strerror(errno), ")");
  }
}

TextTokens read_tokens(const std::string& path, const Tokenizer& tokenizer, const TextTokensOptions& o, uint64_t& read) {
  const std::string name = where(o, path);
  struct stat st {};
  LOOM_CHECK(::stat(path.c_str(), &st) == 0, name, ": cannot open for reading (", std::strerror(errno), ")");
  LOOM_CHECK(!S_ISDIR(st.st_mode), name, ": is a directory, not a text file");
  Fd file;
  file.fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  LOOM_CHECK(file.fd >= 0, name, ": cannot open for reading (", std::strerror(errno), ")");
  const bool limited = o.max_bytes > 0;
  const std::string limit = str_cat(" (the limit is ", o.limit, ")");
  if (o.max_tokens < 0 && limited) {
    if (S_ISREG(st.st_mode)) {
      LOOM_CHECK(static_cast<uint64_t>(st.st_size) <= o.max_bytes, name, ": ", st.st_size, " bytes, more than ",
                 byte_limit_text(o.max_bytes), limit);
    } else {
      // A device or pipe: its bytes first, up to the limit, so that an endless one (/dev/zero)
      // stops at once instead of after tokenizing the limit's worth.
      std::string text;
      std::vector<char> chunk(kReadChunk);
      for (size_t got; (got = read_some(file.fd, chunk.data(), chunk.size(), name)) > 0;) {
        read += got;
        LOOM_CHECK(read <= o.max_bytes, name, ": more than ", byte_limit_text(o.max_bytes), " without reaching its end", limit);
        text.append(chunk.data(), got);
      }
      return text_tokens(text, tokenizer, o);
    }
  }
  PieceEncoder encoder(tokenizer, o);
  std::string pending;
  std::vector<char> chunk(kReadChunk);
  bool enough = encoder.enough();
  while (!enough) {
    const size_t got = read_some(file.fd, chunk.data(), chunk.size(), name);
    if (got == 0) {
      encode_pieces(pending, encoder, true);
      return encoder.finish(read, true);
    }
    read += got;
    if (limited && read > o.max_bytes) {
      LOOM_CHECK(o.max_tokens >= 0, name, ": more than ", byte_limit_text(o.max_bytes), " without reaching its end", limit);
      throw Error(str_cat(name, ": only ", encoder.finish(read, false).ids.size(), " tokens in the first ",
                          byte_limit_text(o.max_bytes), ", fewer than the ", o.max_tokens, " asked for", limit));
    }
    pending.append(chunk.data(), got);
    enough = encode_pieces(pending, encoder, false);
  }
  return encoder.finish(read, false);
}

}  // namespace

std::string byte_limit_text(uint64_t bytes) {
  constexpr uint64_t kMiB = uint64_t{1} << 20;
  return bytes % kMiB == 0 ? str_cat(bytes / kMiB, " MiB") : str_cat(bytes, " bytes");
}

size_t text_piece_end(std::string_view text) {
  for (size_t p = text.size(); p-- > 1;) {
    if (text[p] == ' ' && !ascii_space(text[p - 1])) return p;
  }
  // No space in the stretch: before its last (perhaps incomplete) UTF-8 character.
  size_t p = text.size() - 1;
  while (p > 0 && text.size() - p < 4 && (static_cast<unsigned char>(text[p]) & 0xC0) == 0x80) --p;
  return p > 0 ? p : text.size();
}

TextTokens text_tokens(std::string_view text, const Tokenizer& tokenizer, const TextTokensOptions& options) {
  PieceEncoder encoder(tokenizer, options);
  size_t first = 0;
  bool enough = encoder.enough();
  while (!enough && text.size() - first > kTextPieceBytes) {
    const size_t cut = text_piece_end(text.substr(first, kTextPieceBytes));
    enough = encoder.add(text.substr(first, cut));
    first += cut;
  }
  if (!enough && first < text.size()) {
    enough = encoder.add(text.substr(first));
    first = text.size();
  }
  return encoder.finish(text.size(), first == text.size());
}

TextTokens read_text_tokens(const std::string& path, const Tokenizer& tokenizer, const TextTokensOptions& options) {
  uint64_t read = 0;
  try {
    return read_tokens(path, tokenizer, options, read);
  } catch (const std::bad_alloc&) {
    throw Error(str_cat(where(options, path), ": out of memory after reading ", read, " bytes",
                        options.limit.empty() ? "" : str_cat(" (a lower ", options.limit, " bounds it)")));
  }
}

}  // namespace loom
