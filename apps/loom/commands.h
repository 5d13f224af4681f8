// One function per subcommand; argv holds the arguments after the subcommand's name.
#pragma once

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

}  // namespace loom::cli
