// safetensors I/O: round trip, metadata, and clear errors on damaged files.
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <fstream>

#include "loom/checkpoint/safetensors.h"
#include "loom/core/error.h"
#include "test_util.h"

namespace loom {
namespace {

std::string temp_path(const std::string& name) {
  return (std::filesystem::temp_directory_path() / ("loom_test_" + name)).string();
}

TEST(SafetensorsTest, RoundTripsTensorsAndMetadata) {
  CpuAllocator alloc;
  Tensor a = test::random_tensor(alloc, {3, 5}, DTYPE_F32, 1);
  Tensor b = test::random_tokens(alloc, {7}, 100, 2);
  const std::string path = temp_path("roundtrip.safetensors");
  write_safetensors(path, {{"a", a}, {"b", b}}, {{"arch", "gpt2"}});
  const SafetensorsFile f = SafetensorsFile::read(path);
  EXPECT_EQ(f.metadata_value("arch"), "gpt2");
  EXPECT_EQ(f.shape("a"), (Shape{3, 5}));
  EXPECT_EQ(f.dtype("b"), DTYPE_I32);
  Tensor a2 = f.tensor("a", alloc, MEM_WORKSPACE);
  EXPECT_EQ(test::values(a2), test::values(a));
  EXPECT_FALSE(std::filesystem::exists(path + ".tmp"));
  std::remove(path.c_str());
}

TEST(SafetensorsTest, TruncatedFileIsAnErrorNamingTheFile) {
  CpuAllocator alloc;
  const std::string path = temp_path("truncated.safetensors");
  write_safetensors(path, {{"a", test::random_tensor(alloc, {64}, DTYPE_F32, 1)}}, {});
  std::filesystem::resize_file(path, std::filesystem::file_size(path) - 10);
  try {
    SafetensorsFile::read(path);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("'a'"), std::string::npos) << e.what();
  }
  std::remove(path.c_str());
}

TEST(SafetensorsTest, GarbageHeaderIsAnError) {
  const std::string path = temp_path("garbage.safetensors");
  std::ofstream(path, std::ios::binary) << std::string("\x05\0\0\0\0\0\0\0{abc}", 13);
  EXPECT_THROW(SafetensorsFile::read(path), Error);
  std::remove(path.c_str());
}

}  // namespace
}  // namespace loom
