#include "loom/core/file_io.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <memory>
#include <sstream>
#include <vector>

#include <xxhash.h>

#include "loom/core/error.h"

namespace loom {

namespace {
// Closes a file descriptor on every path out of a scope.
struct FdGuard {
  int fd;
  ~FdGuard() {
    if (fd >= 0) ::close(fd);
  }
};
}  // namespace

void write_all(int fd, const void* data, size_t bytes, const std::string& path) {
  const char* p = static_cast<const char*>(data);
  while (bytes > 0) {
    const ssize_t n = ::write(fd, p, bytes);
    if (n < 0 && errno == EINTR) continue;
    LOOM_CHECK(n >= 0, path, ": write failed: ", std::strerror(errno));
    p += n;
    bytes -= static_cast<size_t>(n);
  }
}

std::string write_temp_synced(const std::string& path, std::span<const ByteRange> parts) {
  const std::string tmp = str_cat(path, ".", ::getpid(), ".tmp");
  FdGuard out{::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644)};
  LOOM_CHECK(out.fd >= 0, tmp, ": cannot create: ", std::strerror(errno));
  try {
    for (const ByteRange& part : parts) write_all(out.fd, part.data, part.size, tmp);
    LOOM_CHECK(::fsync(out.fd) == 0, tmp, ": fsync failed: ", std::strerror(errno));
  } catch (...) {
    ::unlink(tmp.c_str());
    throw;
  }
  return tmp;
}

AtomicFile::AtomicFile(std::string path) : path_(std::move(path)), tmp_(str_cat(path_, ".", ::getpid(), ".tmp")) {
  fd_ = ::open(tmp_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  LOOM_CHECK(fd_ >= 0, tmp_, ": cannot create: ", std::strerror(errno));
}

AtomicFile::~AtomicFile() {
  if (fd_ < 0) return;
  ::close(fd_);
  ::unlink(tmp_.c_str());
}

void AtomicFile::write(const void* data, size_t bytes) {
  LOOM_CHECK(fd_ >= 0, path_, ": written after it was committed");
  write_all(fd_, data, bytes, tmp_);
}

void AtomicFile::commit() {
  LOOM_CHECK(fd_ >= 0, path_, ": committed twice");
  LOOM_CHECK(::fsync(fd_) == 0, tmp_, ": fsync failed: ", std::strerror(errno));
  ::close(fd_);
  fd_ = -1;
  rename_into_place(tmp_, path_);
  const std::string dir = std::filesystem::path(path_).parent_path().string();
  fsync_directory(dir.empty() ? "." : dir);
}

void rename_into_place(const std::string& tmp, const std::string& path) {
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    throw Error(str_cat(path, ": rename from ", tmp, " failed: ", std::strerror(err)));
  }
}

void fsync_directory(const std::string& dir) {
  FdGuard d{::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC)};
  LOOM_CHECK(d.fd >= 0, dir, ": cannot open folder to fsync: ", std::strerror(errno));
  LOOM_CHECK(::fsync(d.fd) == 0, dir, ": fsync of folder failed: ", std::strerror(errno));
}

void write_file_atomic(const std::string& path, std::span<const ByteRange> parts) {
  AtomicFile file(path);
  for (const ByteRange& part : parts) file.write(part.data, part.size);
  file.commit();
}

void write_file_atomic(const std::string& path, std::string_view bytes) {
  const ByteRange part{bytes.data(), bytes.size()};
  write_file_atomic(path, std::span<const ByteRange>(&part, 1));
}

void write_text_synced(const std::string& path, const std::string& text) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  LOOM_CHECK(fd >= 0, path, ": cannot create: ", std::strerror(errno));
  try {
    write_all(fd, text.data(), text.size(), path);
    LOOM_CHECK(::fsync(fd) == 0, path, ": fsync failed: ", std::strerror(errno));
  } catch (...) {
    ::close(fd);
    throw;
  }
  ::close(fd);
}

void remove_tree(const std::filesystem::path& path) {
  std::error_code ec;
  std::filesystem::remove_all(path, ec);
  LOOM_CHECK(!ec, path.string(), ": cannot delete: ", ec.message());
}

FileDigest digest_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  LOOM_CHECK(in, path, ": cannot open");
  std::unique_ptr<XXH64_state_t, decltype(&XXH64_freeState)> state(XXH64_createState(), &XXH64_freeState);
  LOOM_CHECK(state != nullptr && XXH64_reset(state.get(), 0) == XXH_OK, path, ": cannot start XXH64");
  std::vector<char> buffer(size_t{1} << 20);
  FileDigest digest;
  while (in) {
    in.read(buffer.data(), static_cast<std::streamsize>(buffer.size()));
    const auto n = static_cast<size_t>(in.gcount());
    XXH64_update(state.get(), buffer.data(), n);
    digest.bytes += n;
  }
  LOOM_CHECK(in.eof(), path, ": read failed");
  digest.xxh64 = XXH64_digest(state.get());
  return digest;
}

std::string hex64(uint64_t v) {
  std::ostringstream out;
  out << std::hex << std::setw(16) << std::setfill('0') << v;
  return out.str();
}

std::string read_text_file(const std::string& path, uint64_t max_bytes, const std::string& what) {
  std::error_code ec;
  LOOM_CHECK(!std::filesystem::is_directory(path, ec), path, ": is a directory, not a file");
  std::ifstream in(path, std::ios::binary);
  LOOM_CHECK(in, path, ": cannot open for reading");
  std::string text;
  constexpr size_t kChunk = 64 << 10;
  const std::unique_ptr<char[]> chunk(new char[kChunk]);  // (not zeroed: read fills it)
  while (in) {
    in.read(chunk.get(), static_cast<std::streamsize>(kChunk));
    const auto got = static_cast<size_t>(in.gcount());
    LOOM_CHECK(text.size() + got <= max_bytes, path, ": more than ", max_bytes, " bytes (", what, ")");
    text.append(chunk.get(), got);
  }
  LOOM_CHECK(!in.bad(), path, ": read failed");
  return text;
}

bool read_line_limited(std::istream& in, std::string& line, size_t max_bytes, const std::string& where) {
  line.clear();
  std::streambuf* buffer = in.rdbuf();
  for (;;) {
    const int c = buffer->sbumpc();
    if (c == std::char_traits<char>::eof()) {
      in.setstate(std::ios::eofbit);
      return !line.empty();
    }
    if (c == '\n') return true;
    LOOM_CHECK(line.size() < max_bytes, where, ": a line longer than ", max_bytes, " bytes");
    line.push_back(static_cast<char>(c));
  }
}

}  // namespace loom
