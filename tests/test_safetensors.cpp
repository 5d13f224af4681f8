// safetensors I/O: round trip, metadata, F16 / BF16 widening, and clear errors on damaged files:
// the tensors must tile the data section exactly (the format's rule), so overlapping offsets,
// bytes inserted before the data and trailing bytes are refused, naming the file and tensor.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <cstring>
#include <fstream>
#include <random>

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
  Tensor c = Tensor::empty(alloc, {5}, DTYPE_U8, MEM_WORKSPACE);  // packed codes (NF4)
  for (int i = 0; i < 5; ++i) c.data<uint8_t>()[i] = static_cast<uint8_t>(60 * i + 7);
  const std::string path = temp_path("roundtrip.safetensors");
  write_safetensors(path, {{"a", a}, {"b", b}, {"c", c}}, {{"arch", "gpt2"}});
  const SafetensorsFile f = SafetensorsFile::read(path);
  EXPECT_EQ(f.metadata_value("arch"), "gpt2");
  EXPECT_EQ(f.shape("a"), (Shape{3, 5}));
  EXPECT_EQ(f.dtype("b"), DTYPE_I32);
  EXPECT_EQ(f.stored_dtype("c"), "U8");
  Tensor a2 = f.tensor("a", alloc, MEM_WORKSPACE);
  EXPECT_EQ(test::values(a2), test::values(a));
  const Tensor c2 = f.tensor("c", alloc, MEM_WORKSPACE);
  EXPECT_EQ(std::vector<uint8_t>(c2.data<uint8_t>(), c2.data<uint8_t>() + 5),
            std::vector<uint8_t>(c.data<uint8_t>(), c.data<uint8_t>() + 5));
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

// A file written byte by byte as the format defines it: u64 header length, the JSON, the data.
std::string raw_file(const std::string& header, const std::string& data) {
  std::string out(8, '\0');
  const uint64_t n = header.size();
  std::memcpy(out.data(), &n, 8);
  return out + header + data;
}

std::string write_raw(const std::string& name, const std::string& bytes) {
  const std::string path = temp_path(name);
  std::ofstream(path, std::ios::binary) << bytes;
  return path;
}

std::string error_reading(const std::string& name, const std::string& bytes) {
  const std::string path = write_raw(name, bytes);
  const std::string message = test::error_of([&] { SafetensorsFile::read(path); });
  std::remove(path.c_str());
  return message;
}

TEST(SafetensorsTest, HalfAndBfloat16AreWidenedExactly) {
  // F16 bits: 1.0, -2.5, 65504 (max), 2^-24 (smallest subnormal), -0, inf; BF16: 1.0, -3.0.
  const uint16_t f16[] = {0x3c00, 0xc100, 0x7bff, 0x0001, 0x8000, 0x7c00};
  const uint16_t b16[] = {0x3f80, 0xc040};
  std::string data(reinterpret_cast<const char*>(f16), sizeof f16);
  data.append(reinterpret_cast<const char*>(b16), sizeof b16);
  const std::string path = write_raw("half.safetensors", raw_file(R"({"h":{"dtype":"F16","shape":[2,3],"data_offsets":[0,12]},)"
                                                                 R"("b":{"dtype":"BF16","shape":[2],"data_offsets":[12,16]}})",
                                                                 data));
  const SafetensorsFile f = SafetensorsFile::read(path);
  CpuAllocator alloc;
  Tensor h = Tensor::empty(alloc, {6}, DTYPE_F32, MEM_WORKSPACE), b = Tensor::empty(alloc, {2}, DTYPE_F32, MEM_WORKSPACE);
  f.copy_as_f32("h", h);
  f.copy_as_f32("b", b);
  EXPECT_EQ(test::values(h), (std::vector<double>{1.0, -2.5, 65504.0, std::ldexp(1.0, -24), 0.0, INFINITY}));
  EXPECT_TRUE(std::signbit(h.data<float>()[4]));
  EXPECT_EQ(test::values(b), (std::vector<double>{1.0, -3.0}));
  EXPECT_EQ(f.stored_dtype("h"), "F16");
  EXPECT_EQ(f.dtype("b"), DTYPE_BF16);
  EXPECT_NE(test::error_of([&] { f.dtype("h"); }).find("tensor 'h' is stored as F16"), std::string::npos);
  std::remove(path.c_str());
}

TEST(SafetensorsTest, TensorsMustTileTheDataSectionExactly) {
  const std::string two = R"("a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)";
  // Overlapping offsets: b starts inside a.
  EXPECT_NE(error_reading("overlap.safetensors", raw_file("{" + two + R"("b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
                                                           std::string(8, '\0')))
                .find("overlapping tensors"),
            std::string::npos);
  // Bytes inserted before the data: every tensor would be read 4 bytes off.
  const std::string shifted = error_reading("shifted.safetensors",
                                            raw_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})", std::string(12, '\0')));
  EXPECT_NE(shifted.find("tensor 'a' begins at data offset 4"), std::string::npos) << shifted;
  EXPECT_NE(shifted.find("bytes no tensor covers"), std::string::npos) << shifted;
  // Trailing bytes after the last tensor.
  const std::string trailing = error_reading("trailing.safetensors",
                                             raw_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", std::string(9, '\0')));
  EXPECT_NE(trailing.find("1 bytes after the last tensor"), std::string::npos) << trailing;
  // The size the shape needs must be the offsets' span.
  EXPECT_NE(error_reading("span.safetensors", raw_file(R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", std::string(16, '\0')))
                .find("tensor 'a' data_offsets [0, 8) do not hold its 12 bytes"),
            std::string::npos);
}

TEST(SafetensorsTest, MalformedHeadersNameTheFileAndEntry) {
  const std::string data(8, '\0');
  const std::string unknown = error_reading("dtype.safetensors", raw_file(R"({"a":{"dtype":"F7","shape":[2],"data_offsets":[0,8]}})", data));
  EXPECT_NE(unknown.find("tensor 'a' has dtype 'F7'"), std::string::npos) << unknown;
  std::string huge = raw_file("{}", "");
  const uint64_t big = uint64_t{1} << 60;
  std::memcpy(huge.data(), &big, 8);
  EXPECT_NE(error_reading("huge.safetensors", huge).find("header size 1152921504606846976 exceeds the file"), std::string::npos);
  EXPECT_NE(error_reading("brace.safetensors", raw_file(R"(  {"a":{}})", "")).find("beginning with '{'"), std::string::npos);
  EXPECT_NE(error_reading("negative.safetensors", raw_file(R"({"a":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", data))
                .find("tensor 'a' shape must hold non-negative integers"),
            std::string::npos);
  EXPECT_NE(error_reading("overflow.safetensors",
                          raw_file(R"({"a":{"dtype":"F64","shape":[4611686018427387904,4],"data_offsets":[0,8]}})", data))
                .find("holds more bytes than the 8-byte data section"),
            std::string::npos);
  EXPECT_NE(error_reading("short.safetensors", std::string(5, '\0')).find("truncated safetensors file (5 bytes"), std::string::npos);
}

// Mutated headers of a valid file: each either loads (and then its tensors tile the data, so
// a load reads exactly the bytes written) or is refused with a loom::Error; never a crash.
TEST(SafetensorsTest, MutatedHeadersLoadCorrectlyOrAreRefused) {
  CpuAllocator alloc;
  Tensor a = test::random_tensor(alloc, {3, 4}, DTYPE_F32, 1), b = test::random_tensor(alloc, {5}, DTYPE_F32, 2);
  const std::string path = temp_path("mutate_src.safetensors");
  write_safetensors(path, {{"a", a}, {"b", b}}, {{"k", "v"}});
  std::ifstream in(path, std::ios::binary);
  const std::string original((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  uint64_t header = 0;
  std::memcpy(&header, original.data(), 8);
  std::mt19937 rng(7);
  const char alphabet[] = "0123456789[]{}\",:-eE .FIUB";
  int loaded = 0, refused = 0;
  for (int trial = 0; trial < 300; ++trial) {
    std::string bytes = original;
    const int edits = 1 + static_cast<int>(rng() % 3);
    for (int k = 0; k < edits; ++k) bytes[8 + rng() % header] = alphabet[rng() % (sizeof alphabet - 1)];
    const std::string mutated = write_raw("mutate.safetensors", bytes);
    try {
      const SafetensorsFile f = SafetensorsFile::read(mutated);
      for (const std::string& name : f.names()) {
        if (f.stored_dtype(name) != "F32") continue;
        Tensor t = Tensor::empty(alloc, {shape_numel(f.shape(name))}, DTYPE_F32, MEM_WORKSPACE);
        f.copy_as_f32(name, t);
      }
      ++loaded;
    } catch (const Error&) {
      ++refused;
    }
    std::remove(mutated.c_str());
  }
  EXPECT_EQ(loaded + refused, 300);
  EXPECT_GT(refused, 0);
  std::remove(path.c_str());
}

}  // namespace
}  // namespace loom
