// loom config: the resolved configuration of a run, or the reference of every config key
// (docs/config.md is this command's --markdown output).
#include <cstdio>

#include "cli.h"
#include "commands.h"

namespace loom::cli {

namespace {
const char* kHelp =
    "usage: loom config [--config FILE] [--set key=value,...]\n"
    "       loom config --markdown\n"
    "\n"
    "Prints the configuration a run with these options would use, as TOML: the code's defaults,\n"
    "then configs/default.toml, then FILE, then every --set, validated (model.vocab_size = 0 stays\n"
    "0: a run takes the dataset's). --markdown prints every config key's type,\n"
    "default and meaning as Markdown instead: docs/config.md is\n"
    "`build/bin/loom config --markdown > docs/config.md`.\n";
}  // namespace

int config_main(int argc, char** argv) {
  const Args args(argc, argv, "config", kHelp,
                  {{"config", "FILE", "a TOML config applied after configs/default.toml"},
                   {"set", "KEY=VALUE,...", "config overrides, applied last (comma-separated; repeatable)"},
                   {"markdown", "", "print the reference of every config key (docs/config.md)"}});
  if (args.has("markdown")) {
    std::fputs(config_markdown().c_str(), stdout);
    return 0;
  }
  const LoomConfig config = load_config(args);
  LoomConfig checked = config;
  if (checked.model.vocab_size == 0) checked.model.vocab_size = 1;  // the dataset's, at run time
  checked.validate();
  std::fputs(config_to_toml(config).c_str(), stdout);
  return 0;
}

}  // namespace loom::cli
