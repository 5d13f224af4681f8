#include "loom/train/metrics_log.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>

#include "loom/core/error.h"
#include "loom/core/file_io.h"

namespace loom {

MetricsLog::MetricsLog(const std::string& path, int64_t resume_step) : path_(path) {
  std::error_code ec;
  if (std::filesystem::exists(path, ec)) {
    // Keep every complete line that parses and is not a later step's; a torn last line goes.
    const std::string text = read_text_file(path, uint64_t{4} << 30, "metrics.jsonl's limit");
    std::string kept;
    size_t begin = 0;
    bool changed = false;
    while (begin < text.size()) {
      const size_t end = text.find('\n', begin);
      if (end == std::string::npos) {  // no newline: a record cut short
        changed = true;
        ++dropped_;
        break;
      }
      const std::string line = text.substr(begin, end - begin);
      begin = end + 1;
      const nlohmann::json j = nlohmann::json::parse(line, nullptr, false);
      const bool later = resume_step >= 0 && j.is_object() && j.contains("step") && j["step"].is_number() &&
                         j["step"].get<int64_t>() > resume_step;
      if (j.is_discarded() || later) {
        changed = true;
        ++dropped_;
        continue;
      }
      kept += line + "\n";
    }
    if (changed) write_file_atomic(path, kept);
  }
  fd_ = ::open(path.c_str(), O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
  LOOM_CHECK(fd_ >= 0, path, ": cannot open for appending: ", std::strerror(errno));
  size_ = static_cast<int64_t>(::lseek(fd_, 0, SEEK_END));
}

MetricsLog::~MetricsLog() {
  if (fd_ >= 0) ::close(fd_);
}

void MetricsLog::write(const nlohmann::json& record) {
  const std::string line = record.dump() + "\n";
  size_t done = 0;
  while (done < line.size()) {
    const ssize_t n = ::write(fd_, line.data() + done, line.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    done += static_cast<size_t>(n);
  }
  if (done == line.size()) {
    size_ += static_cast<int64_t>(done);
    return;
  }
  const int error = errno;
  // What part of the line reached the file is cut off again: the file ends with a whole record.
  const bool cut = ::ftruncate(fd_, size_) == 0;
  if (lost_++ == 0) {
    std::fprintf(stderr, "loom train: warning: %s: cannot append a metrics record (%s); %s, later records are tried "
                 "again and the records lost are counted at the end\n", path_.c_str(), std::strerror(error),
                 cut ? "the file keeps its complete records" : "cannot cut the partial record off either");
  }
}

// Bytes per collective this rank sent and received so far (comm/communicator.h's ring volumes).
nlohmann::json ledger_json(const ByteLedger& ledger) {
  nlohmann::json j = nlohmann::json::object();
  for (int c = 0; c < COLL_COUNT; ++c) {
    if (ledger.calls[c] == 0) continue;
    j[collective_name(static_cast<Collective>(c))] = {{"calls", ledger.calls[c]}, {"sent", ledger.sent[c]},
                                                      {"received", ledger.received[c]}};
  }
  return j;
}

// Each MoE layer's routing over the step (nn/moe.h): the expert load histogram, its max
// violation (max / mean - 1), the router entropy, dropped assignments and the auxiliary losses.
nlohmann::json moe_json(const std::vector<MoeLayerStats>& stats) {
  nlohmann::json j = nlohmann::json::array();
  for (const MoeLayerStats& s : stats) {
    j.push_back({{"layer", s.layer}, {"load", s.load}, {"max_violation", s.max_violation}, {"entropy", s.entropy},
                 {"tokens", s.tokens}, {"dropped", s.dropped}, {"aux", s.aux}, {"seq_aux", s.seq_aux}, {"z", s.z}});
  }
  return j;
}

nlohmann::json memory_json(const MemoryTracker& mem) {
  nlohmann::json j;
  for (int c = 0; c < MEM_CATEGORY_COUNT; ++c) {
    const auto cat = static_cast<MemCategory>(c);
    j[std::string(mem_category_name(cat))] = {{"current", mem.current(cat)}, {"peak", mem.peak(cat)}};
  }
  return j;
}


}  // namespace loom
