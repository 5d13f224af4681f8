// Durable file writes: every file Loom writes for a user (shards, tokenizers, checkpoints,
// configs, weights) goes to <path>.<pid>.tmp, is fsynced, renamed into place, and its folder
// fsynced, so a crash leaves the old file or the new one, never a torn one. Errors are one
// line naming the path.
#pragma once
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <span>
#include <string>
#include <string_view>

namespace loom {

struct ByteRange {
  const void* data;
  size_t size;
};

// write(2) until done (retrying EINTR); throws naming `path`.
void write_all(int fd, const void* data, size_t bytes, const std::string& path);

// Writes the ranges back to back into <path>.<pid>.tmp and fsyncs it; returns that name. On
// failure the temporary file is removed.
std::string write_temp_synced(const std::string& path, std::span<const ByteRange> parts);
// Renames `tmp` to `path` (removing tmp on failure); the caller fsyncs the folder.
void rename_into_place(const std::string& tmp, const std::string& path);
// A rename or a new entry is durable only once its folder is fsynced.
void fsync_directory(const std::string& dir);

// A file written piece by piece with the same guarantee (a file too big to hold, such as an
// exported model, written one tensor at a time): write() appends to <path>.<pid>.tmp, commit()
// fsyncs it, renames it into place and fsyncs the folder; destroyed uncommitted (an error on the
// way), the temporary file is removed and nothing is left at `path`.
class AtomicFile {
 public:
  explicit AtomicFile(std::string path);
  ~AtomicFile();
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;
  void write(const void* data, size_t bytes);
  void commit();

 private:
  std::string path_, tmp_;
  int fd_ = -1;
};

// An AtomicFile of the ranges: the same as write_temp_synced + rename_into_place + fsync of the
// parent folder.
void write_file_atomic(const std::string& path, std::span<const ByteRange> parts);
void write_file_atomic(const std::string& path, std::string_view bytes);

// The whole file's bytes; a loom::Error "<path>: cannot open for reading" / "read failed", or,
// past max_bytes (a device such as /dev/zero never ends), one naming the limit and `what` sets it.
inline constexpr uint64_t kDefaultReadLimit = uint64_t{256} << 20;
std::string read_text_file(const std::string& path, uint64_t max_bytes = kDefaultReadLimit,
                           const std::string& what = "a text file's limit");
// std::getline with a bound: the next line of `in` (without its '\n') into `line`; false at the
// end. A line longer than max_bytes is an Error naming `where`.
bool read_line_limited(std::istream& in, std::string& line, size_t max_bytes, const std::string& where);

// Writes `text` to `path` and fsyncs it (the caller fsyncs the folder).
void write_text_synced(const std::string& path, const std::string& text);
// Deletes a file or folder tree; an error names the path.
void remove_tree(const std::filesystem::path& path);

// A file's size and XXH64 (seed 0) checksum, read in 1 MiB chunks.
struct FileDigest {
  uint64_t bytes = 0;
  uint64_t xxh64 = 0;
};
FileDigest digest_file(const std::string& path);
std::string hex64(uint64_t v);  // 16 lower-case hex digits

}  // namespace loom
