#include "loom/checkpoint/safetensors.h"


#include <cstdio>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>

#include "loom/core/error.h"
#include "loom/core/file_io.h"

namespace loom {

namespace {
constexpr uint64_t kMaxHeaderBytes = 100u << 20;  // the reference implementation's limit

const char* safetensors_dtype(DType dtype) {
  switch (dtype) {
    case DTYPE_F32: return "F32";
    case DTYPE_BF16: return "BF16";
    case DTYPE_F64: return "F64";
    case DTYPE_I32: return "I32";
    case DTYPE_COUNT: break;
  }
  throw Error("safetensors: unsupported dtype");
}

DType parse_dtype(const std::string& s, const std::string& path, const std::string& name) {
  for (int d = 0; d < DTYPE_COUNT; ++d) {
    if (s == safetensors_dtype(static_cast<DType>(d))) return static_cast<DType>(d);
  }
  throw Error(str_cat(path, ": tensor '", name, "' has dtype ", s, ", expected one of F32, BF16, F64, I32"));
}

}  // namespace

SafetensorsFile SafetensorsFile::read(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  LOOM_CHECK(in, path, ": cannot open safetensors file");
  in.seekg(0, std::ios::end);
  const auto size = static_cast<uint64_t>(in.tellg());
  in.seekg(0);
  LOOM_CHECK(size >= 8, path, ": truncated safetensors file (", size, " bytes, expected at least 8)");
  uint64_t header_bytes = 0;
  in.read(reinterpret_cast<char*>(&header_bytes), 8);
  LOOM_CHECK(header_bytes <= kMaxHeaderBytes && header_bytes <= size - 8, path, ": header size ", header_bytes,
             " exceeds the file (", size, " bytes)");
  std::string header(header_bytes, '\0');
  in.read(header.data(), static_cast<std::streamsize>(header_bytes));
  SafetensorsFile file;
  file.path_ = path;
  file.data_.resize(size - 8 - header_bytes);
  in.read(file.data_.data(), static_cast<std::streamsize>(file.data_.size()));
  LOOM_CHECK(in, path, ": read failed");

  nlohmann::json json;
  try {
    json = nlohmann::json::parse(header);
  } catch (const nlohmann::json::exception& e) {
    throw Error(str_cat(path, ": header is not valid JSON (", e.what(), ")"));
  }
  LOOM_CHECK(json.is_object(), path, ": header must be a JSON object");
  for (const auto& [name, value] : json.items()) {
    if (name == "__metadata__") {
      LOOM_CHECK(value.is_object(), path, ": __metadata__ must be an object of strings");
      for (const auto& [k, v] : value.items()) {
        LOOM_CHECK(v.is_string(), path, ": __metadata__ value '", k, "' must be a string");
        file.metadata_[k] = v.get<std::string>();
      }
      continue;
    }
    LOOM_CHECK(value.is_object() && value.contains("dtype") && value.contains("shape") &&
                   value.contains("data_offsets") && value["data_offsets"].is_array() &&
                   value["data_offsets"].size() == 2 && value["shape"].is_array(),
               path, ": tensor '", name, "' needs dtype, shape and data_offsets [begin, end]");
    Entry e;
    e.dtype = parse_dtype(value["dtype"].get<std::string>(), path, name);
    for (const auto& d : value["shape"]) {
      LOOM_CHECK(d.is_number_unsigned(), path, ": tensor '", name, "' has a non-integer dim");
      e.shape.push_back(d.get<int64_t>());
    }
    e.begin = value["data_offsets"][0].get<size_t>();
    e.end = value["data_offsets"][1].get<size_t>();
    const size_t expected = static_cast<size_t>(shape_numel(e.shape)) * dtype_size(e.dtype);
    LOOM_CHECK(e.begin <= e.end && e.end <= file.data_.size() && e.end - e.begin == expected, path, ": tensor '", name,
               "' data_offsets [", e.begin, ", ", e.end, ") do not hold ", expected, " bytes inside the ",
               file.data_.size(), "-byte data section (truncated file?)");
    file.entries_.emplace(name, std::move(e));
  }
  return file;
}

std::vector<std::string> SafetensorsFile::names() const {
  std::vector<std::string> out;
  for (const auto& [name, e] : entries_) out.push_back(name);
  return out;
}

const std::string& SafetensorsFile::metadata_value(const std::string& key) const {
  const auto it = metadata_.find(key);
  LOOM_CHECK(it != metadata_.end(), path_, ": missing metadata key '", key, "'");
  return it->second;
}

const SafetensorsFile::Entry& SafetensorsFile::entry(const std::string& name) const {
  const auto it = entries_.find(name);
  LOOM_CHECK(it != entries_.end(), path_, ": no tensor named '", name, "'");
  return it->second;
}

DType SafetensorsFile::dtype(const std::string& name) const { return entry(name).dtype; }
const Shape& SafetensorsFile::shape(const std::string& name) const { return entry(name).shape; }

Tensor SafetensorsFile::tensor(const std::string& name, Allocator& allocator, MemCategory category) const {
  const Entry& e = entry(name);
  Tensor t = Tensor::empty(allocator, e.shape, e.dtype, category);
  copy_into(name, t);
  return t;
}

void SafetensorsFile::copy_into(const std::string& name, const Tensor& dst) const {
  const Entry& e = entry(name);
  LOOM_CHECK(dst.dtype() == e.dtype && dst.numel() == shape_numel(e.shape), path_, ": tensor '", name, "' is ",
             dtype_name(e.dtype), shape_str(e.shape), ", destination is ", dst.describe());
  LOOM_CHECK(dst.device() == DEVICE_CPU, path_, ": tensor '", name, "' must be copied into host memory");
  std::memcpy(dst.raw_data(), data_.data() + e.begin, e.end - e.begin);
}

void SafetensorsFile::copy_into(const std::string& name, const Tensor& dst, Backend& backend) const {
  const Entry& e = entry(name);
  LOOM_CHECK(dst.dtype() == e.dtype && dst.numel() == shape_numel(e.shape), path_, ": tensor '", name, "' is ",
             dtype_name(e.dtype), shape_str(e.shape), ", destination is ", dst.describe());
  backend.write(dst, data_.data() + e.begin);
}

void SafetensorsFile::copy_range_into(const std::string& name, int64_t first, const Tensor& dst) const {
  const Entry& e = entry(name);
  LOOM_CHECK(dst.dtype() == e.dtype && first >= 0 && first + dst.numel() <= shape_numel(e.shape), path_, ": tensor '",
             name, "' is ", dtype_name(e.dtype), shape_str(e.shape), ", cannot supply elements [", first, ", ",
             first + dst.numel(), ") as ", dst.describe());
  LOOM_CHECK(dst.device() == DEVICE_CPU, path_, ": tensor '", name, "' must be copied into host memory");
  const size_t elem = dtype_size(e.dtype);
  std::memcpy(dst.raw_data(), data_.data() + e.begin + static_cast<size_t>(first) * elem, dst.nbytes());
}

void write_safetensors(const std::string& path, const std::vector<std::pair<std::string, Tensor>>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  nlohmann::json header = nlohmann::json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  size_t offset = 0;
  for (const auto& [name, t] : tensors) {
    LOOM_CHECK(t.device() == DEVICE_CPU, path, ": tensor '", name, "' must be in host memory to be written");
    header[name] = {{"dtype", safetensors_dtype(t.dtype())}, {"shape", t.shape()}, {"data_offsets", {offset, offset + t.nbytes()}}};
    offset += t.nbytes();
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // data starts 8-byte aligned
  const uint64_t header_bytes = text.size();

  std::vector<ByteRange> parts{{&header_bytes, 8}, {text.data(), text.size()}};
  for (const auto& [name, t] : tensors) parts.push_back({t.raw_data(), t.nbytes()});
  write_file_atomic(path, parts);
}

}  // namespace loom
