#include "loom/core/file_io.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>

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
  rename_into_place(write_temp_synced(path, parts), path);
  const std::string dir = std::filesystem::path(path).parent_path().string();
  fsync_directory(dir.empty() ? "." : dir);
}

void write_file_atomic(const std::string& path, std::string_view bytes) {
  const ByteRange part{bytes.data(), bytes.size()};
  write_file_atomic(path, std::span<const ByteRange>(&part, 1));
}

}  // namespace loom
