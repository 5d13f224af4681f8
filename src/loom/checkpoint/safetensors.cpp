#include "loom/checkpoint/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
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
    case DTYPE_U8: return "U8";
    case DTYPE_F16:  // read widened (read_as_f32), never loaded or written as it is
    case DTYPE_COUNT: break;
  }
  return nullptr;
}

// The dtypes the format names with whole-byte elements, and their sizes.
struct StoredType {
  const char* name;
  size_t size;
};
constexpr StoredType kStoredTypes[] = {{"BOOL", 1}, {"U8", 1},  {"I8", 1},  {"F8_E5M2", 1}, {"F8_E4M3", 1},
                                       {"I16", 2},  {"U16", 2}, {"F16", 2}, {"BF16", 2},    {"I32", 4},
                                       {"U32", 4},  {"F32", 4}, {"F64", 8}, {"I64", 8},     {"U64", 8}};

size_t stored_size(const std::string& dtype, const std::string& path, const std::string& name) {
  for (const StoredType& t : kStoredTypes) {
    if (dtype == t.name) return t.size;
  }
  throw Error(str_cat(path, ": tensor '", name, "' has dtype '", dtype, "', which is not a safetensors dtype Loom reads "
                      "(F32, F16, BF16, F64, I32, I64, ...)"));
}

std::optional<DType> loom_dtype(const std::string& stored) {
  for (int d = 0; d < DTYPE_COUNT; ++d) {
    const char* name = safetensors_dtype(static_cast<DType>(d));
    if (name != nullptr && stored == name) return static_cast<DType>(d);
  }
  return std::nullopt;
}

// A non-negative integer of the header, or an error naming the tensor and field.
uint64_t header_uint(const nlohmann::json& v, const std::string& path, const std::string& name, const char* field) {
  LOOM_CHECK(v.is_number_unsigned() || (v.is_number_integer() && v.get<int64_t>() >= 0), path, ": tensor '", name, "' ",
             field, " must hold non-negative integers");
  return v.get<uint64_t>();
}

}  // namespace

struct SafetensorsFile::Mapping {
  void* addr = nullptr;
  size_t size = 0;
  Mapping() = default;
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  ~Mapping() {
    if (addr != nullptr) ::munmap(addr, size);
  }
  const char* data() const { return static_cast<const char*>(addr); }
};

SafetensorsFile SafetensorsFile::read(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  LOOM_CHECK(fd >= 0, path, ": cannot open safetensors file (", std::strerror(errno), ")");
  struct stat st {};
  const bool regular = ::fstat(fd, &st) == 0 && S_ISREG(st.st_mode);
  const auto size = static_cast<uint64_t>(regular ? st.st_size : 0);
  auto map = std::make_shared<Mapping>();
  if (regular && size >= 8) {
    void* addr = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
    if (addr != MAP_FAILED) map->addr = addr, map->size = size;
  }
  const int mmap_errno = errno;
  ::close(fd);
  LOOM_CHECK(regular, path, ": not a regular file");
  LOOM_CHECK(size >= 8, path, ": truncated safetensors file (", size, " bytes, expected at least 8)");
  LOOM_CHECK(map->addr != nullptr, path, ": cannot map the file (", std::strerror(mmap_errno), ")");
  uint64_t header_bytes = 0;
  std::memcpy(&header_bytes, map->data(), 8);  // little-endian, as the hosts Loom runs on
  LOOM_CHECK(header_bytes <= kMaxHeaderBytes && header_bytes <= size - 8, path, ": header size ", header_bytes,
             " exceeds the file (", size, " bytes)");
  LOOM_CHECK(header_bytes >= 2 && map->data()[8] == '{', path, ": the header must be a JSON object beginning with '{'");
  SafetensorsFile file;
  file.path_ = path;
  file.data_offset_ = 8 + header_bytes;
  const size_t data_size = size - file.data_offset_;

  nlohmann::json json;
  try {
    json = nlohmann::json::parse(map->data() + 8, map->data() + 8 + header_bytes);
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
    LOOM_CHECK(value.is_object() && value.contains("dtype") && value["dtype"].is_string() && value.contains("shape") &&
                   value.contains("data_offsets") && value["data_offsets"].is_array() &&
                   value["data_offsets"].size() == 2 && value["shape"].is_array(),
               path, ": tensor '", name, "' needs dtype, shape and data_offsets [begin, end]");
    Entry e;
    e.stored = value["dtype"].get<std::string>();
    e.dtype = loom_dtype(e.stored);
    uint64_t bytes = stored_size(e.stored, path, name);
    for (const auto& d : value["shape"]) {
      const uint64_t dim = header_uint(d, path, name, "shape");
      LOOM_CHECK(dim == 0 || bytes <= data_size / dim, path, ": tensor '", name, "' of shape ", value["shape"].dump(),
                 " holds more bytes than the ", data_size, "-byte data section");
      bytes *= dim;
      e.shape.push_back(static_cast<int64_t>(dim));
    }
    e.begin = header_uint(value["data_offsets"][0], path, name, "data_offsets");
    e.end = header_uint(value["data_offsets"][1], path, name, "data_offsets");
    LOOM_CHECK(e.begin <= e.end && e.end <= data_size && e.end - e.begin == bytes, path, ": tensor '", name,
               "' data_offsets [", e.begin, ", ", e.end, ") do not hold its ", bytes, " bytes inside the ", data_size,
               "-byte data section (truncated file?)");
    file.entries_.emplace(name, std::move(e));
  }
  // The tensors tile the data section: no hole, no overlap, no trailing bytes.
  std::vector<std::pair<size_t, const std::string*>> order;
  for (const auto& [name, e] : file.entries_) order.push_back({e.begin, &name});
  std::sort(order.begin(), order.end(), [&](const auto& a, const auto& b) {
    const Entry &x = file.entries_.at(*a.second), &y = file.entries_.at(*b.second);
    return x.begin != y.begin ? x.begin < y.begin : x.end < y.end;
  });
  size_t covered = 0;
  for (const auto& [begin, name] : order) {
    const Entry& e = file.entries_.at(*name);
    LOOM_CHECK(e.begin == covered, path, ": tensor '", *name, "' begins at data offset ", e.begin, " but the tensors before it end at ",
               covered, e.begin < covered ? " (overlapping tensors)" : " (bytes no tensor covers)");
    covered = e.end;
  }
  LOOM_CHECK(covered == data_size, path, ": ", data_size - covered, " bytes after the last tensor (the data section is ",
             data_size, " bytes, the tensors cover ", covered, ")");
  file.map_ = std::move(map);
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

const char* SafetensorsFile::bytes(const Entry& e) const { return map_->data() + data_offset_ + e.begin; }

DType SafetensorsFile::dtype(const std::string& name) const {
  const Entry& e = entry(name);
  LOOM_CHECK(e.dtype.has_value(), path_, ": tensor '", name, "' is stored as ", e.stored,
             ", which Loom tensors do not hold as it is (F32, BF16, F64, I32)");
  return *e.dtype;
}
const std::string& SafetensorsFile::stored_dtype(const std::string& name) const { return entry(name).stored; }
const Shape& SafetensorsFile::shape(const std::string& name) const { return entry(name).shape; }

Tensor SafetensorsFile::tensor(const std::string& name, Allocator& allocator, MemCategory category) const {
  Tensor t = Tensor::empty(allocator, shape(name), dtype(name), category);
  copy_into(name, t);
  return t;
}

const char* SafetensorsFile::whole_source(const std::string& name, const Tensor& dst) const {
  const Entry& e = entry(name);
  LOOM_CHECK(e.dtype == dst.dtype() && dst.numel() == shape_numel(e.shape), path_, ": tensor '", name, "' is ", e.stored,
             shape_str(e.shape), ", destination is ", dst.describe());
  return bytes(e);
}

void SafetensorsFile::copy_into(const std::string& name, const Tensor& dst) const {
  const char* src = whole_source(name, dst);
  LOOM_CHECK(dst.device() == DEVICE_CPU, path_, ": tensor '", name, "' must be copied into host memory");
  std::memcpy(dst.raw_data(), src, dst.nbytes());
  drop_pages(entry(name));
}

void SafetensorsFile::copy_into(const std::string& name, const Tensor& dst, Backend& backend) const {
  backend.write(dst, whole_source(name, dst));
}

void SafetensorsFile::copy_range_into(const std::string& name, int64_t first, const Tensor& dst) const {
  const Entry& e = entry(name);
  LOOM_CHECK(e.dtype == dst.dtype() && first >= 0 && first + dst.numel() <= shape_numel(e.shape), path_, ": tensor '",
             name, "' is ", e.stored, shape_str(e.shape), ", cannot supply elements [", first, ", ", first + dst.numel(),
             ") as ", dst.describe());
  LOOM_CHECK(dst.device() == DEVICE_CPU, path_, ": tensor '", name, "' must be copied into host memory");
  const size_t elem = dtype_size(dst.dtype());
  std::memcpy(dst.raw_data(), bytes(e) + static_cast<size_t>(first) * elem, dst.nbytes());
}

void SafetensorsFile::copy_as_f32(const std::string& name, const Tensor& dst) const {
  const Entry& e = entry(name);
  const int64_t n = shape_numel(e.shape);
  LOOM_CHECK(dst.dtype() == DTYPE_F32 && dst.numel() == n && dst.device() == DEVICE_CPU, path_, ": tensor '", name, "' is ",
             e.stored, shape_str(e.shape), ", destination is ", dst.describe(), " (expected f32 host memory)");
  const char* src = bytes(e);
  float* out = dst.data<float>();
  LOOM_CHECK(e.stored == "F32" || e.stored == "F16" || e.stored == "BF16", path_, ": tensor '", name, "' is stored as ",
             e.stored, "; expected F32, F16 or BF16 weights");
  const size_t size = e.stored == "F32" ? 4 : 2;
  const bool half = e.stored == "F16";
  // In chunks, each one's whole pages of the mapping dropped once converted: a 1 GB tensor never
  // has all of its mapped pages resident beside its f32 copy.
  constexpr int64_t kChunk = int64_t{16} << 20;  // elements
  for (int64_t first = 0; first < n; first += kChunk) {
    const int64_t count = std::min(kChunk, n - first);
    const char* from = src + static_cast<size_t>(first) * size;
    if (size == 4) {
      std::memcpy(out + first, from, static_cast<size_t>(count) * 4);
    } else {
      for (int64_t i = 0; i < count; ++i) {
        uint16_t bits = 0;
        std::memcpy(&bits, from + 2 * i, 2);  // the mapping gives no alignment guarantee beyond the header's
        out[first + i] = half ? f16_to_f32(bits) : bf16_to_f32(bf16{bits});
      }
    }
    drop_bytes(from, static_cast<size_t>(count) * size);
  }
}

void SafetensorsFile::copy_as_bf16(const std::string& name, const Tensor& dst) const {
  const Entry& e = entry(name);
  const int64_t n = shape_numel(e.shape);
  LOOM_CHECK(e.stored == "BF16", path_, ": tensor '", name, "' is stored as ", e.stored, ", expected BF16 to use it in place");
  LOOM_CHECK(dst.dtype() == DTYPE_BF16 && dst.numel() == n && dst.device() == DEVICE_CPU, path_, ": tensor '", name,
             "' is ", e.stored, shape_str(e.shape), ", destination is ", dst.describe(), " (expected bf16 host memory)");
  constexpr size_t kChunk = size_t{32} << 20;  // bytes, each chunk's pages dropped once copied
  const size_t total = static_cast<size_t>(n) * 2;
  for (size_t first = 0; first < total; first += kChunk) {
    const size_t count = std::min(kChunk, total - first);
    std::memcpy(static_cast<char*>(dst.raw_data()) + first, bytes(e) + first, count);
    drop_bytes(bytes(e) + first, count);
  }
}

void SafetensorsFile::drop_pages(const Entry& e) const { drop_bytes(bytes(e), e.end - e.begin); }

void SafetensorsFile::drop_bytes(const char* p, size_t n) const {
  const uintptr_t page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  const auto lo = reinterpret_cast<uintptr_t>(p), hi = lo + n;
  const uintptr_t first = (lo + page - 1) / page * page, last = hi / page * page;
  if (first < last) ::madvise(reinterpret_cast<void*>(first), last - first, MADV_DONTNEED);  // advisory
}

namespace {

// The header of `entries` laid out back to back in their order, padded so the data starts
// 8-byte aligned; sizes[i] = entry i's bytes (write_safetensors and SafetensorsWriter).
std::string layout_header(const std::vector<SafetensorsWriter::Entry>& entries,
                          const std::map<std::string, std::string>& metadata, const std::string& path,
                          std::vector<uint64_t>& sizes) {
  nlohmann::json header = nlohmann::json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  uint64_t offset = 0;
  sizes.clear();
  for (const SafetensorsWriter::Entry& e : entries) {
    LOOM_CHECK(!header.contains(e.name), path, ": tensor '", e.name, "' declared twice");
    uint64_t bytes = stored_size(e.dtype, path, e.name);
    for (int64_t d : e.shape) bytes *= static_cast<uint64_t>(d);
    header[e.name] = {{"dtype", e.dtype}, {"shape", e.shape}, {"data_offsets", {offset, offset + bytes}}};
    sizes.push_back(bytes);
    offset += bytes;
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  return text;
}

}  // namespace

void write_safetensors(const std::string& path, const std::vector<std::pair<std::string, Tensor>>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  std::vector<SafetensorsWriter::Entry> entries;
  for (const auto& [name, t] : tensors) {
    LOOM_CHECK(t.device() == DEVICE_CPU, path, ": tensor '", name, "' must be in host memory to be written");
    const char* dtype = safetensors_dtype(t.dtype());
    LOOM_CHECK(dtype != nullptr, path, ": tensor '", name, "' is ", dtype_name(t.dtype()), ", which Loom does not write");
    entries.push_back({name, dtype, t.shape()});
  }
  std::vector<uint64_t> sizes;
  const std::string text = layout_header(entries, metadata, path, sizes);
  const uint64_t header_bytes = text.size();

  std::vector<ByteRange> parts{{&header_bytes, 8}, {text.data(), text.size()}};
  for (const auto& [name, t] : tensors) parts.push_back({t.raw_data(), t.nbytes()});
  write_file_atomic(path, parts);
}

}  // namespace loom

namespace loom {

namespace {

void pwrite_all(int fd, const void* data, size_t n, uint64_t at, const std::string& path, const std::string& what) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t w = ::pwrite(fd, p, n, static_cast<off_t>(at));
    LOOM_CHECK(w > 0 || errno == EINTR, path, ": writing ", what, " failed (", std::strerror(errno), ")");
    if (w > 0) p += w, n -= static_cast<size_t>(w), at += static_cast<uint64_t>(w);
  }
}

}  // namespace

SafetensorsWriter::SafetensorsWriter(std::string path, const std::vector<Entry>& entries,
                                     const std::map<std::string, std::string>& metadata)
    : path_(std::move(path)) {
  std::vector<uint64_t> sizes;
  const std::string text = layout_header(entries, metadata, path_, sizes);
  const uint64_t header_bytes = text.size();
  uint64_t offset = 8 + header_bytes;
  for (size_t i = 0; i < entries.size(); ++i) {
    slots_[entries[i].name] = Slot{offset, sizes[i], false};
    offset += sizes[i];
  }
  file_bytes_ = offset;
  fd_ = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  LOOM_CHECK(fd_ >= 0, path_, ": cannot create (", std::strerror(errno), ")");
  pwrite_all(fd_, &header_bytes, 8, 0, path_, "the header");
  pwrite_all(fd_, text.data(), text.size(), 8, path_, "the header");
}

SafetensorsWriter::~SafetensorsWriter() {
  if (fd_ >= 0) ::close(fd_);
}

void SafetensorsWriter::write(const std::string& name, const void* data, size_t bytes) {
  auto it = slots_.find(name);
  LOOM_CHECK(it != slots_.end(), path_, ": tensor '", name, "' was not declared");
  Slot& slot = it->second;
  LOOM_CHECK(!slot.written, path_, ": tensor '", name, "' written twice");
  LOOM_CHECK(bytes == slot.bytes, path_, ": tensor '", name, "' is ", slot.bytes, " bytes, got ", bytes);
  pwrite_all(fd_, data, bytes, slot.offset, path_, str_cat("tensor '", name, "'"));
  slot.written = true;
}

void SafetensorsWriter::close() {
  for (const auto& [name, slot] : slots_) LOOM_CHECK(slot.written, path_, ": tensor '", name, "' was never written");
  LOOM_CHECK(::fsync(fd_) == 0, path_, ": fsync failed (", std::strerror(errno), ")");
  LOOM_CHECK(::close(fd_) == 0, path_, ": close failed (", std::strerror(errno), ")");
  fd_ = -1;
}

}  // namespace loom
