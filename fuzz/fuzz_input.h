// The fuzz targets' inputs as files: the readers under test take a path (safetensors maps the
// file, tokenizer.json is read with its tokenizer_config.json beside it), so each input is
// written to a private folder made once per process (mkdtemp under $TMPDIR or /tmp) and removed
// at exit.
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <string_view>

namespace loom_fuzz {

class ScratchDir {
 public:
  ScratchDir() {
    const char* tmp = std::getenv("TMPDIR");
    std::string pattern = std::string(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp") + "/loom_fuzz.XXXXXX";
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

 private:
  std::filesystem::path dir_;
};

// An invariant the reader promises: a violation is a finding (abort, so libFuzzer keeps the input).
inline void require(bool ok, const char* what) {
  if (!ok) {
    std::fprintf(stderr, "loom fuzz: invariant violated: %s\n", what);
    std::abort();
  }
}

}  // namespace loom_fuzz
