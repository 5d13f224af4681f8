// One function per subcommand; argv holds the arguments after the subcommand's name.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace loom::cli {

int prepare_main(int argc, char** argv);
int train_main(int argc, char** argv);
int eval_main(int argc, char** argv);
int generate_main(int argc, char** argv);
int tokenizer_main(int argc, char** argv);
int tokenize_main(int argc, char** argv);
int plan_main(int argc, char** argv);
int memory_main(int argc, char** argv);
int bench_main(int argc, char** argv);
int serve_main(int argc, char** argv);
int config_main(int argc, char** argv);
int convert_main(int argc, char** argv);
int quantize_main(int argc, char** argv);
int prune_main(int argc, char** argv);
int merge_main(int argc, char** argv);
int report_main(int argc, char** argv);
int supervise_main(int argc, char** argv);
// Runs `command` (argv form) and relaunches it with --resume when it dies, up to `restarts`
// times, waiting `backoff` seconds doubled each time (cmd_supervise.cpp); returns its last status.
int supervise(std::vector<std::string> command, int64_t restarts, double backoff);

}  // namespace loom::cli
