// What `loom train` prints: the run's observer (train/run.h). The progress line (rewritten on a
// terminal, a line per logged step otherwise), --quiet (standard output silenced until the summary
// line), --verbose (every step with its gradient norm and bytes per communicator), the other
// ranks' output in <run>/logs/rank<N>.log, the header, the dry run's memory bill, the sample and
// the summary. Every number is measured and labelled.
#pragma once
#include <string>

#include "loom/train/run.h"

namespace loom::cli {

class TrainPrinter final : public RunObserver {
 public:
  TrainPrinter(bool quiet, bool verbose);
  ~TrainPrinter() override;
  void starting(int rank) override;
  void folder_ready(const std::string& dir, int rank) override;
  void line(const std::string& text) override;
  void warning(const std::string& text) override;
  void dry_run(const TrainingRun& run) override;
  void started(const TrainingRun& run) override;
  void step(const StepReport& report) override;
  void sample(const TrainingRun& run, const std::string& text) override;
  void finished(const TrainingRun& run) override;

 private:
  void restore_stdout();
  bool quiet_, verbose_, terminal_;
  int saved_stdout_ = -1;  // --quiet: the real standard output while it goes to /dev/null
};

}  // namespace loom::cli
