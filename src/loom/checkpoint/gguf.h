// GGUF v3, the file format of llama.cpp / ggml: writing (export) and reading back (checks).
// The specification is ggml's docs/gguf.md (https://github.com/ggml-org/ggml/blob/master/docs/gguf.md);
// every number is little-endian:
//   header       u32 magic 0x46554747 ("GGUF" as bytes), u32 version = 3, u64 tensor count,
//                u64 metadata key-value count
//   metadata     per pair: string key, u32 value type, the value. A string is u64 length + UTF-8
//                bytes (no terminator); an array is u32 element type, u64 count, the elements
//                (arrays of arrays are allowed by the spec, not written here)
//   tensor infos per tensor: string name, u32 n_dims (<= 4), u64 ne[n_dims] (ggml order: ne[0]
//                is the innermost, contiguous dimension, so a row-major (rows, cols) matrix is
//                ne = [cols, rows]), u32 ggml type, u64 offset into the data section (a multiple
//                of the alignment)
//   padding      zeros up to a multiple of the alignment (`general.alignment`, u32, default 32)
//   data         each tensor's bytes at its offset, zero-padded to the alignment
// Value types: 0 u8, 1 i8, 2 u16, 3 i16, 4 u32, 5 i32, 6 f32, 7 bool (one byte 0/1), 8 string,
// 9 array, 10 u64, 11 i64, 12 f64. ggml tensor types (ggml.h enum ggml_type): 0 F32, 1 F16,
// 2 Q4_0, 8 Q8_0 (precision/ggml_blocks.h: 32-element blocks, so ne[0] % 32 == 0), 30 BF16.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace loom {

enum class GgufValueType : uint32_t {
  U8 = 0, I8 = 1, U16 = 2, I16 = 3, U32 = 4, I32 = 5, F32 = 6, BOOL = 7, STRING = 8, ARRAY = 9,
  U64 = 10, I64 = 11, F64 = 12,
};

enum class GgmlType : uint32_t { F32 = 0, F16 = 1, Q4_0 = 2, Q8_0 = 8, BF16 = 30 };

const char* ggml_type_name(GgmlType type);  // "F32", "F16", "Q4_0", "Q8_0", "BF16"
// Bytes of a tensor of `elements` elements of `type` (blocks for the quantized types).
uint64_t ggml_tensor_bytes(GgmlType type, uint64_t elements);

// A metadata value: the integer kinds and bool in `i`, f32/f64 in `f`, a string in `s`, an
// array's element type and elements in `element` and `array`.
struct GgufValue {
  GgufValueType type = GgufValueType::U32;
  int64_t i = 0;
  double f = 0.0;
  std::string s;
  GgufValueType element = GgufValueType::U32;
  std::vector<GgufValue> array;

  static GgufValue u32(uint32_t v);
  static GgufValue i32(int32_t v);
  static GgufValue u64(uint64_t v);
  static GgufValue f32(float v);
  static GgufValue boolean(bool v);
  static GgufValue string(std::string v);
  static GgufValue strings(const std::vector<std::string>& v);
  static GgufValue i32s(const std::vector<int32_t>& v);
  static GgufValue f32s(const std::vector<float>& v);
};

struct GgufTensorInfo {
  std::string name;
  std::vector<uint64_t> ne;  // ggml order: ne[0] innermost
  GgmlType type = GgmlType::F32;
  uint64_t offset = 0;       // into the data section
};

// A tensor's bytes made when the file is written (ggml_tensor_bytes of its type and shape).
using GgufTensorBytes = std::function<std::vector<uint8_t>()>;

// Collects metadata and tensors in order, then writes the file atomically (a temporary file in
// the same folder, fsync, rename, fsync of the folder: core/file_io.h). Every tensor's size is
// known from its type and shape, so the header (with each tensor's offset) is written first and
// the data after it, one tensor at a time: a tensor given as a GgufTensorBytes is made only
// then, so a model bigger than memory is written holding one tensor's bytes.
class GgufWriter {
 public:
  // Writes `general.alignment` = alignment first (a power of two).
  explicit GgufWriter(uint32_t alignment = 32);
  void put(const std::string& key, GgufValue value);  // a key given twice is an Error
  // `data` holds ggml_tensor_bytes(type, product of ne) bytes.
  void add_tensor(const std::string& name, std::vector<uint64_t> ne, GgmlType type, std::vector<uint8_t> data);
  // The same with the bytes made by `make` while write() runs (called once, in order).
  void add_tensor(const std::string& name, std::vector<uint64_t> ne, GgmlType type, GgufTensorBytes make);
  void write(const std::string& path) const;
  uint64_t data_bytes() const { return data_size_; }  // the data section, padding included

 private:
  uint32_t alignment_;
  std::vector<std::pair<std::string, GgufValue>> kvs_;
  std::vector<GgufTensorInfo> infos_;
  std::vector<GgufTensorBytes> data_;
  uint64_t data_size_ = 0;
};

// A GGUF file read back whole (for checks and tests; not memory-mapped). Errors name the path
// and what is wrong (bad magic, an unsupported version, a truncated field, a tensor outside the
// data section, an unknown type).
class GgufFile {
 public:
  static GgufFile read(const std::string& path);

  uint32_t version = 0;
  uint32_t alignment = 32;
  uint64_t data_offset = 0;  // where the data section starts in the file
  std::vector<std::pair<std::string, GgufValue>> kvs;
  std::vector<GgufTensorInfo> tensors;

  const GgufValue& get(const std::string& key) const;          // an Error naming the key if absent
  bool has(const std::string& key) const;
  const GgufTensorInfo& tensor(const std::string& name) const;  // an Error naming the tensor
  // The tensor's bytes (ggml_tensor_bytes of its type and shape).
  std::vector<uint8_t> tensor_data(const std::string& name) const;
  // The tensor widened to f32 (F32, F16, BF16, Q8_0, Q4_0).
  std::vector<float> tensor_f32(const std::string& name) const;

 private:
  std::string path_;
  std::string bytes_;
};

}  // namespace loom
