// The safetensors format (Hugging Face, https://github.com/huggingface/safetensors, "Format"):
// u64 little-endian header size N, N bytes of UTF-8 JSON beginning with '{' (may be padded with
// spaces),
//   {"__metadata__": {str: str}, name: {"dtype": "F32", "shape": [...], "data_offsets": [b, e]}}
// then the raw little-endian tensor bytes, offsets relative to the end of the header. The
// tensors must cover the data section exactly: sorted by offset, each begins where the previous
// one ends, the first at 0 and the last at the end of the file (no holes, no overlaps, no
// trailing bytes), and each holds exactly numel x dtype size bytes.
//
// A file is memory-mapped, not read: a tensor's bytes are copied once, from the mapping into
// the destination, so a model larger than free memory loads tensor by tensor. Every dtype the
// format names is recognised; Loom tensors hold F32, BF16, F64 and I32 as they are, and
// copy_as_f32 widens F16 and BF16 (exactly) for imported models.
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "loom/backend/backend.h"
#include "loom/core/tensor.h"

namespace loom {

class SafetensorsFile {
 public:
  // Maps and validates the file; errors name the file and the offending entry.
  static SafetensorsFile read(const std::string& path);

  const std::string& path() const { return path_; }
  bool has(const std::string& name) const { return entries_.count(name) != 0; }
  std::vector<std::string> names() const;  // sorted
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  const std::string& metadata_value(const std::string& key) const;  // throws naming file and key
  // The Loom dtype of an entry; an entry stored as a dtype Loom tensors do not hold (F16, I64,
  // ...) is an error naming it (copy_as_f32 reads F16).
  DType dtype(const std::string& name) const;
  const std::string& stored_dtype(const std::string& name) const;  // the file's name: "F16", "BF16", ...
  const Shape& shape(const std::string& name) const;
  // A new tensor holding the entry's data.
  Tensor tensor(const std::string& name, Allocator& allocator, MemCategory category) const;
  // Copies the entry into `dst`, which must have the entry's dtype and element count.
  void copy_into(const std::string& name, const Tensor& dst) const;
  // The same into a tensor of `backend` (a GPU's too), through Backend::write.
  void copy_into(const std::string& name, const Tensor& dst, Backend& backend) const;
  // Copies elements [first, first + dst.numel()) of the entry (any shape, flat order) into dst.
  void copy_range_into(const std::string& name, int64_t first, const Tensor& dst) const;
  // Copies an F32, F16 or BF16 entry into the f32 host tensor dst of the same element count,
  // widening exactly; any other stored dtype is an error naming the tensor.
  void copy_as_f32(const std::string& name, const Tensor& dst) const;
  // Copies a BF16 entry as it is into the bf16 host tensor dst of the same element count (a
  // weight used in place, train/model_source.h open_inference_model); any other stored dtype is
  // an error naming the tensor. copy_as_f32 and copy_as_bf16 drop the entry's pages from this
  // process as they go (in chunks; they stay in the page cache), as copy_into into host memory
  // does after its copy, so loading a model holds one copy of it.
  void copy_as_bf16(const std::string& name, const Tensor& dst) const;

 private:
  struct Entry {
    std::string stored;            // the file's dtype name
    std::optional<DType> dtype;    // when a Loom tensor holds it as stored
    Shape shape;
    size_t begin = 0, end = 0;     // into the data section
  };
  struct Mapping;
  const Entry& entry(const std::string& name) const;
  const char* bytes(const Entry& e) const;
  void drop_pages(const Entry& e) const;  // madvise(MADV_DONTNEED) of the whole pages inside it
  void drop_bytes(const char* p, size_t n) const;  // the same for bytes [p, p + n) of the mapping
  // The entry's bytes after checking that dst has its dtype and element count.
  const char* whole_source(const std::string& name, const Tensor& dst) const;

  std::string path_;
  std::map<std::string, Entry> entries_;
  std::map<std::string, std::string> metadata_;
  std::shared_ptr<const Mapping> map_;  // the whole file, read-only
  size_t data_offset_ = 0;              // 8 + N
};

// A safetensors file written entry by entry (a quantized model made block by block, holding
// only the tensor being written): every entry (name, the format's dtype name, shape) is declared
// up front, so the header and each entry's offset are fixed before any data; write() puts one
// entry's bytes at its offset; close() checks every entry was written once and fsyncs. The
// file is written where it will stay (the caller's folder is temporary and committed whole);
// an unclosed writer leaves an incomplete file that no reader accepts (its data is short).
class SafetensorsWriter {
 public:
  struct Entry {
    std::string name;
    std::string dtype;  // "F32", "F16", "BF16", "U8", ...
    Shape shape;
  };
  SafetensorsWriter(std::string path, const std::vector<Entry>& entries, const std::map<std::string, std::string>& metadata);
  ~SafetensorsWriter();
  SafetensorsWriter(const SafetensorsWriter&) = delete;
  SafetensorsWriter& operator=(const SafetensorsWriter&) = delete;
  // The entry's bytes (exactly its size; once).
  void write(const std::string& name, const void* data, size_t bytes);
  void close();
  uint64_t file_bytes() const { return file_bytes_; }

 private:
  struct Slot {
    uint64_t offset = 0, bytes = 0;
    bool written = false;
  };
  std::string path_;
  int fd_ = -1;
  std::map<std::string, Slot> slots_;
  uint64_t file_bytes_ = 0;
};

// Writes host tensors atomically: a temporary file in the same folder, fsync, rename.
void write_safetensors(const std::string& path, const std::vector<std::pair<std::string, Tensor>>& tensors,
                       const std::map<std::string, std::string>& metadata);

}  // namespace loom
