// The fuzz targets' inputs as files: the readers under test take a path (safetensors maps the
// file, tokenizer.json is read with its tokenizer_config.json beside it, a dataset or checkpoint
// is a folder of files), so each input is written to a private folder made once per process
// (mkdtemp under $TMPDIR, /dev/shm or /tmp) and removed at exit. An input that is a folder is a
// FileSet (below).
#pragma once
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <string_view>
#include <vector>

namespace loom_fuzz {

class ScratchDir {
 public:
  ScratchDir() {
    // $TMPDIR, else /dev/shm where there is one: in memory, where the readers' and writers'
    // fsyncs cost nothing (they are not what is fuzzed), else /tmp.
    const char* tmp = std::getenv("TMPDIR");
    std::error_code ec;
    const std::string base = tmp != nullptr && *tmp != '\0'                        ? tmp
                             : std::filesystem::is_directory("/dev/shm", ec) ? "/dev/shm"
                                                                             : "/tmp";
    std::string pattern = base + "/loom_fuzz.XXXXXX";
    if (::mkdtemp(pattern.data()) == nullptr) {
      std::perror("loom fuzz: mkdtemp");
      std::abort();
    }
    dir_ = pattern;
  }
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;
  ~ScratchDir() {
    std::error_code ignored;
    std::filesystem::remove_all(dir_, ignored);
  }

  // Writes `bytes` to <dir>/<name> (replacing it) and returns the path.
  std::string write(const std::string& name, std::string_view bytes) const {
    const std::string path = (dir_ / name).string();
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    out.close();
    if (!out) {
      std::fprintf(stderr, "loom fuzz: cannot write %s\n", path.c_str());
      std::abort();
    }
    return path;
  }
  void remove(const std::string& name) const {
    std::error_code ignored;
    std::filesystem::remove(dir_ / name, ignored);
  }
  // Removes everything in the folder (the previous input's files), keeping the folder.
  void clear() const {
    std::error_code ec;
    std::vector<std::filesystem::path> entries;
    for (const auto& entry : std::filesystem::directory_iterator(dir_, ec)) entries.push_back(entry.path());
    for (const std::filesystem::path& p : entries) std::filesystem::remove_all(p, ec);
  }
  std::string path() const { return dir_.string(); }

 private:
  std::filesystem::path dir_;
};

// Several files in one input (a dataset folder, a checkpoint's step folder): the first file's
// bytes, then each further file after a banner line "==> NAME <==" (as `head` separates files),
// NAME being 1 to 64 characters of [A-Za-z0-9._-] other than "." and "..", so a name cannot leave
// the folder. A banner that is not one of these is part of the file before it. A name given
// twice: the last one wins, as writing the files in order does.
struct NamedFile {
  std::string name;
  std::string bytes;
};
using FileSet = std::vector<NamedFile>;

inline constexpr std::string_view kBannerStart = "\n==> ", kBannerEnd = " <==\n";

inline bool is_plain_name(std::string_view name) {
  if (name.empty() || name.size() > 64 || name == "." || name == "..") return false;
  for (const char c : name) {
    const bool ok =
        (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' || c == '_' || c == '-';
    if (!ok) return false;
  }
  return true;
}

inline FileSet split_files(std::string_view input, const std::string& first_name) {
  FileSet files{{first_name, {}}};
  size_t from = 0;  // start of the current file's bytes
  size_t search = 0;
  while (true) {
    const size_t banner = input.find(kBannerStart, search);
    if (banner == std::string_view::npos) break;
    const size_t name_begin = banner + kBannerStart.size();
    const size_t end = input.find(kBannerEnd, name_begin);
    if (end == std::string_view::npos) break;
    const std::string_view name = input.substr(name_begin, end - name_begin);
    if (!is_plain_name(name)) {
      search = banner + 1;
      continue;
    }
    files.back().bytes = input.substr(from, banner - from);
    files.push_back({std::string(name), {}});
    from = end + kBannerEnd.size();
    search = from;
  }
  files.back().bytes = input.substr(from);
  return files;
}

// The inverse of split_files for a set whose files hold no banner themselves.
inline std::string join_files(const FileSet& files) {
  std::string out;
  for (size_t i = 0; i < files.size(); ++i) {
    if (i > 0) out.append(kBannerStart).append(files[i].name).append(kBannerEnd);
    out += files[i].bytes;
  }
  return out;
}

// Writes every file of the set into the (cleared) scratch folder, in order.
inline void write_files(const ScratchDir& dir, const FileSet& files) {
  dir.clear();
  for (const NamedFile& f : files) dir.write(f.name, f.bytes);
}

// Copies `bytes` into libFuzzer's buffer when they fit; returns the new size, or 0 when not.
inline size_t emit(const std::string& bytes, uint8_t* data, size_t max_size) {
  if (bytes.empty() || bytes.size() > max_size) return 0;
  std::copy(bytes.begin(), bytes.end(), data);
  return bytes.size();
}

// An invariant the reader promises: a violation is a finding (abort, so libFuzzer keeps the input).
inline void require(bool ok, const char* what) {
  if (!ok) {
    std::fprintf(stderr, "loom fuzz: invariant violated: %s\n", what);
    std::abort();
  }
}

}  // namespace loom_fuzz
