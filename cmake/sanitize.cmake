# The sanitizer build (docs/operations.md "Sanitizers"): this same project configured with
# LOOM_SANITIZE=ON (g++ -fsanitize=address,undefined, -O1) in build/sanitize, as an
# ExternalProject so that `cmake --build build` makes it and ctest runs its tests. Only what those
# tests run is built: the CLI (the signal test and the hostile-input tests drive it), the unit
# tests chosen in tests/CMakeLists.txt (LOOM_SANITIZE_UNIT_TESTS) and the preloaded no-op signal
# handlers. CUDA, the benchmarks and the fuzz targets (already sanitized, with clang) are left out.
option(LOOM_SANITIZE_BUILD "Build and test the AddressSanitizer + UBSan build in build/sanitize" ON)
if(NOT LOOM_SANITIZE_BUILD)
  return()
endif()
include(ExternalProject)
set(LOOM_SANITIZE_DIR ${CMAKE_BINARY_DIR}/sanitize)
ExternalProject_Add(loom_sanitize
  SOURCE_DIR ${PROJECT_SOURCE_DIR}
  BINARY_DIR ${LOOM_SANITIZE_DIR}
  CMAKE_GENERATOR Ninja
  CMAKE_ARGS -DLOOM_SANITIZE=ON -DLOOM_WERROR=${LOOM_WERROR} -DCMAKE_BUILD_TYPE=Release -DLOOM_CUDA=OFF -DLOOM_FUZZ=OFF
  # Two jobs: the outer build and the fuzz targets' compile beside it on CI's 2 cores; more would
  # only hold more compilers (about 1 GB each with the sanitizers) in memory at once.
  BUILD_COMMAND ${CMAKE_COMMAND} --build ${LOOM_SANITIZE_DIR} --parallel 2 --target loom_cli loom_sanitize_tests
    loom_noop_handlers
  BUILD_ALWAYS ON  # the inner build tracks the sources itself
  INSTALL_COMMAND ""
  BUILD_BYPRODUCTS ${LOOM_SANITIZE_DIR}/bin/loom ${LOOM_SANITIZE_DIR}/tests/loom_sanitize_tests)
