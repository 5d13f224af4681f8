// The safetensors format (Hugging Face): u64 little-endian header size N, N bytes of JSON
//   {"__metadata__": {str: str}, name: {"dtype": "F32", "shape": [...], "data_offsets": [b, e]}}
// then the raw little-endian tensor bytes (offsets relative to the end of the header). Any
// safetensors reader opens what we write; we read what any writer produces for our dtypes.
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "loom/backend/backend.h"
#include "loom/core/tensor.h"

namespace loom {

class SafetensorsFile {
 public:
  // Reads and validates the whole file; errors name the file and the offending entry.
  static SafetensorsFile read(const std::string& path);

  bool has(const std::string& name) const { return entries_.count(name) != 0; }
  std::vector<std::string> names() const;  // sorted
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  const std::string& metadata_value(const std::string& key) const;  // throws naming file and key
  DType dtype(const std::string& name) const;
  const Shape& shape(const std::string& name) const;
  // A new tensor holding the entry's data.
  Tensor tensor(const std::string& name, Allocator& allocator, MemCategory category) const;
  // Copies the entry into `dst`, which must have the entry's dtype and element count.
  void copy_into(const std::string& name, const Tensor& dst) const;
  // The same into a tensor of `backend` (a GPU's too), through Backend::write.
  void copy_into(const std::string& name, const Tensor& dst, Backend& backend) const;
  // Copies elements [first, first + dst.numel()) of the entry (any shape, flat order) into dst.
  void copy_range_into(const std::string& name, int64_t first, const Tensor& dst) const;

 private:
  struct Entry {
    DType dtype;
    Shape shape;
    size_t begin, end;  // into data_
  };
  const Entry& entry(const std::string& name) const;

  std::string path_;
  std::map<std::string, Entry> entries_;
  std::map<std::string, std::string> metadata_;
  std::vector<char> data_;
};

// Writes host tensors atomically: a temporary file in the same folder, fsync, rename.
void write_safetensors(const std::string& path, const std::vector<std::pair<std::string, Tensor>>& tensors,
                       const std::map<std::string, std::string>& metadata);

}  // namespace loom
