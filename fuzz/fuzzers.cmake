# Coverage-guided fuzzing of Loom's readers of files a user hands it (fuzz/, docs/fuzzing.md):
# safetensors, tokenizer.json, GPT-2's encoder.json + vocab.bpe, token shards and their dataset,
# checkpoint step folders, and the TOML config with its --set overrides. Included by the
# top-level CMakeLists.txt. libFuzzer needs clang (Debian's clang and libclang-rt-14-dev,
# installed by scripts/setup), so the targets are their own project, fuzz/,
# configured and built by an ExternalProject with clang++ into build/fuzz; the g++ build of Loom
# is untouched. ctest runs each target for LOOM_FUZZ_SECONDS (label `fuzz`); a crash, a sanitizer
# report, a leak or a broken invariant fails the test and leaves the input in build/fuzz/.
option(LOOM_FUZZ "Build the libFuzzer targets (needs clang with -fsanitize=fuzzer)" ON)
set(LOOM_FUZZ_TARGETS safetensors tokenizer_json gpt2_bpe token_shards checkpoint config)
# Seconds per target: 10 keeps `ctest -L fuzz` at about a minute for the six. A build folder
# configured when the default was 30 (two targets) is moved to the new default once.
if(LOOM_FUZZ_SECONDS STREQUAL "30" AND NOT LOOM_FUZZ_SECONDS_DEFAULT_10)
  unset(LOOM_FUZZ_SECONDS CACHE)
endif()
set(LOOM_FUZZ_SECONDS_DEFAULT_10 ON CACHE INTERNAL "")
set(LOOM_FUZZ_SECONDS 10 CACHE STRING "How long ctest runs each fuzz target")
if(NOT LOOM_FUZZ)
  return()
endif()

find_program(LOOM_FUZZ_CXX NAMES clang++ clang++-14 clang++-15 clang++-16 clang++-17 clang++-18 clang++-19
  DOC "clang++ with libFuzzer (-fsanitize=fuzzer)")
if(NOT LOOM_FUZZ_CXX)
  message(FATAL_ERROR "LOOM_FUZZ: clang++ not found. Run scripts/setup (Debian's clang and libclang-rt-14-dev), "
    "or configure with -DLOOM_FUZZ=OFF")
endif()
# One link of an empty target proves libFuzzer and the sanitizer runtimes are installed.
if(NOT LOOM_FUZZ_CXX_WORKS STREQUAL LOOM_FUZZ_CXX)
  set(probe ${CMAKE_BINARY_DIR}/CMakeFiles/loom_fuzz_probe)
  file(WRITE ${probe}.cpp "extern \"C\" int LLVMFuzzerTestOneInput(const unsigned char*, unsigned long) { return 0; }\n")
  execute_process(COMMAND ${LOOM_FUZZ_CXX} -fsanitize=fuzzer,address,undefined ${probe}.cpp -o ${probe}
    RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "LOOM_FUZZ: ${LOOM_FUZZ_CXX} cannot link -fsanitize=fuzzer,address,undefined (is "
      "libclang-rt-14-dev installed? run scripts/setup), or configure with -DLOOM_FUZZ=OFF:\n${out}")
  endif()
  set(LOOM_FUZZ_CXX_WORKS ${LOOM_FUZZ_CXX} CACHE INTERNAL "")
endif()
message(STATUS "Loom fuzz targets: ${LOOM_FUZZ_CXX}")

include(ExternalProject)
set(LOOM_FUZZ_DIR ${CMAKE_BINARY_DIR}/fuzz)
set(fuzz_binaries ${LOOM_FUZZ_TARGETS})
list(TRANSFORM fuzz_binaries PREPEND ${LOOM_FUZZ_DIR}/fuzz_)
ExternalProject_Add(loom_fuzzers
  SOURCE_DIR ${PROJECT_SOURCE_DIR}/fuzz
  BINARY_DIR ${LOOM_FUZZ_DIR}
  CMAKE_ARGS -DCMAKE_CXX_COMPILER=${LOOM_FUZZ_CXX} -DLOOM_WERROR=${LOOM_WERROR} -DLOOM_SOURCE_DIR=${PROJECT_SOURCE_DIR}
  BUILD_ALWAYS ON  # the inner build tracks the sources itself
  INSTALL_COMMAND ""
  BUILD_BYPRODUCTS ${fuzz_binaries})

# Each run starts from the checked-in seeds (fuzz/seeds/<target>, read only) and adds what it
# finds to build/fuzz/corpus/<target>, which later runs on this machine start from as well.
foreach(target ${LOOM_FUZZ_TARGETS})
  file(MAKE_DIRECTORY ${LOOM_FUZZ_DIR}/corpus/${target})
  add_test(NAME fuzz_${target}
    COMMAND ${LOOM_FUZZ_DIR}/fuzz_${target} -max_total_time=${LOOM_FUZZ_SECONDS} -rss_limit_mb=2048 -timeout=10
      -print_final_stats=1 -artifact_prefix=${LOOM_FUZZ_DIR}/${target}- -dict=${PROJECT_SOURCE_DIR}/fuzz/${target}.dict
      ${LOOM_FUZZ_DIR}/corpus/${target} ${PROJECT_SOURCE_DIR}/fuzz/seeds/${target})
  math(EXPR limit "${LOOM_FUZZ_SECONDS} + 120")
  set_tests_properties(fuzz_${target} PROPERTIES LABELS fuzz TIMEOUT ${limit})
endforeach()
