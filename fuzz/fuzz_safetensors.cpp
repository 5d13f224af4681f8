// libFuzzer target: the bytes of a .safetensors file (checkpoint/safetensors.h). Reading it and
// then every tensor in every way the reader offers must either succeed or throw loom::Error;
// anything else (a crash, an AddressSanitizer or UndefinedBehaviorSanitizer report, a leak, any
// other exception, a tensor whose shape and bytes disagree) is a finding.
#include <cstring>
#include <string>

#include "fuzz_input.h"
#include "json_mutator.h"
#include "loom/checkpoint/safetensors.h"
#include "loom/core/error.h"

using loom::DType;
using loom::Tensor;

namespace {

// One entry read every way; its loom::Errors (a dtype Loom tensors do not hold, ...) are
// allowed and do not stop the others.
void read_entry(const loom::SafetensorsFile& file, const std::string& name, loom::CpuAllocator& alloc) {
  const loom::Shape& shape = file.shape(name);
  const std::string& stored = file.stored_dtype(name);
  try {
    const DType dtype = file.dtype(name);
    const Tensor t = file.tensor(name, alloc, loom::MEM_PARAMETERS);
    loom_fuzz::require(t.shape() == shape && t.dtype() == dtype, "tensor() has the entry's shape and dtype");
    const int64_t n = t.numel();
    if (n > 0) {
      const Tensor last = Tensor::empty(alloc, {1}, dtype, loom::MEM_WORKSPACE);
      file.copy_range_into(name, n - 1, last);
      loom_fuzz::require(std::memcmp(last.raw_data(), static_cast<const char*>(t.raw_data()) + t.nbytes() - last.nbytes(),
                                     last.nbytes()) == 0,
                         "copy_range_into's last element equals tensor()'s");
    }
  } catch (const loom::Error&) {
  }
  if (stored == "F32" || stored == "F16" || stored == "BF16") {
    try {
      const Tensor f = Tensor::empty(alloc, {loom::shape_numel(shape)}, loom::DTYPE_F32, loom::MEM_WORKSPACE);
      file.copy_as_f32(name, f);
    } catch (const loom::Error&) {
    }
  }
}

}  // namespace

extern "C" size_t LLVMFuzzerMutate(uint8_t* data, size_t size, size_t max_size);

// Half of the mutations change the JSON header as JSON and rewrite its length (json_mutator.h).
extern "C" size_t LLVMFuzzerCustomMutator(uint8_t* data, size_t size, size_t max_size, unsigned int seed) {
  static const loom_fuzz::JsonWords words{
      {"dtype", "shape", "data_offsets", "__metadata__", "w", "b"},
      {"F32", "F16", "BF16", "F64", "I32", "I64", "U8", "I8", "BOOL", "U16", "I16", "U32", "U64", "F8_E4M3", "F8_E5M2", "",
       "pt"}};
  uint64_t header = 0;
  if (size >= 8 && seed % 2 == 0) std::memcpy(&header, data, 8);
  if (size >= 8 && seed % 2 == 0 && header <= size - 8) {
    const std::string json(reinterpret_cast<const char*>(data) + 8, header);
    if (const std::optional<std::string> changed = loom_fuzz::mutate_json(json, seed / 2, words)) {
      const uint64_t n = changed->size();
      const size_t rest = size - 8 - header;
      if (8 + n + rest <= max_size) {
        std::memmove(data + 8 + n, data + 8 + header, rest);
        std::memcpy(data, &n, 8);
        std::memcpy(data + 8, changed->data(), n);
        return 8 + n + rest;
      }
    }
  }
  return LLVMFuzzerMutate(data, size, max_size);
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const loom_fuzz::ScratchDir scratch;
  const std::string path = scratch.write("input.safetensors", {reinterpret_cast<const char*>(data), size});
  try {
    const loom::SafetensorsFile file = loom::SafetensorsFile::read(path);
    loom::CpuAllocator alloc;
    for (const std::string& name : file.names()) read_entry(file, name, alloc);
    for (const auto& [key, value] : file.metadata())
      loom_fuzz::require(file.metadata_value(key) == value, "metadata_value");
  } catch (const loom::Error&) {
  }
  return 0;
}
