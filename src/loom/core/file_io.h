// Durable file writes: every file Loom writes for a user (shards, tokenizers, checkpoints,
// configs, weights) goes to <path>.<pid>.tmp, is fsynced, renamed into place, and its folder
// fsynced, so a crash leaves the old file or the new one, never a torn one. Errors are one
// line naming the path.
#pragma once
#include <cstddef>
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

// write_temp_synced + rename_into_place + fsync of the parent folder.
void write_file_atomic(const std::string& path, std::span<const ByteRange> parts);
void write_file_atomic(const std::string& path, std::string_view bytes);

}  // namespace loom
