#include "loom/checkpoint/gguf.h"

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <memory>
#include <span>

#include "loom/core/dtype.h"
#include "loom/core/error.h"
#include "loom/core/file_io.h"
#include "loom/precision/formats.h"
#include "loom/precision/ggml_blocks.h"

namespace loom {

namespace {

constexpr uint32_t kMagic = 0x46554747;  // "GGUF" read as a little-endian u32
constexpr uint32_t kVersion = 3;
constexpr uint32_t kMaxDims = 4;  // GGML_MAX_DIMS

uint64_t align_up(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }

// Little-endian appends (the hosts Loom runs on are little-endian, as GGUF is).
template <class T>
void put_raw(std::string& out, T v) {
  static_assert(std::is_trivially_copyable_v<T>);
  char bytes[sizeof(T)];
  std::memcpy(bytes, &v, sizeof(T));
  out.append(bytes, sizeof(T));
}

void put_string(std::string& out, const std::string& s) {
  put_raw<uint64_t>(out, s.size());
  out += s;
}

void put_value_body(std::string& out, const GgufValue& v) {
  switch (v.type) {
    case GgufValueType::U8: put_raw(out, static_cast<uint8_t>(v.i)); break;
    case GgufValueType::I8: put_raw(out, static_cast<int8_t>(v.i)); break;
    case GgufValueType::U16: put_raw(out, static_cast<uint16_t>(v.i)); break;
    case GgufValueType::I16: put_raw(out, static_cast<int16_t>(v.i)); break;
    case GgufValueType::U32: put_raw(out, static_cast<uint32_t>(v.i)); break;
    case GgufValueType::I32: put_raw(out, static_cast<int32_t>(v.i)); break;
    case GgufValueType::F32: put_raw(out, static_cast<float>(v.f)); break;
    case GgufValueType::BOOL: put_raw(out, static_cast<uint8_t>(v.i != 0 ? 1 : 0)); break;
    case GgufValueType::STRING: put_string(out, v.s); break;
    case GgufValueType::ARRAY:
      put_raw(out, static_cast<uint32_t>(v.element));
      put_raw<uint64_t>(out, v.array.size());
      for (const GgufValue& e : v.array) put_value_body(out, e);
      break;
    case GgufValueType::U64: put_raw(out, static_cast<uint64_t>(v.i)); break;
    case GgufValueType::I64: put_raw(out, v.i); break;
    case GgufValueType::F64: put_raw(out, v.f); break;
  }
}

// Reads a GGUF image; every read is bounds-checked and an overrun names the file and the field.
class Cursor {
 public:
  Cursor(const std::string& bytes, const std::string& path) : bytes_(bytes), path_(path) {}
  template <class T>
  T raw(const char* what) {
    need(sizeof(T), what);
    T v;
    std::memcpy(&v, bytes_.data() + pos_, sizeof(T));
    pos_ += sizeof(T);
    return v;
  }
  std::string string(const char* what) {
    const auto n = raw<uint64_t>(what);
    need(n, what);
    std::string s = bytes_.substr(pos_, n);
    pos_ += n;
    return s;
  }
  GgufValue value(GgufValueType type, const std::string& key, int depth = 0);
  uint64_t pos() const { return pos_; }

 private:
  void need(uint64_t n, const char* what) const {
    LOOM_CHECK(n <= bytes_.size() - pos_, path_, ": truncated GGUF file: ", what, " at byte ", pos_, " needs ", n,
               " bytes, ", bytes_.size() - pos_, " left");
  }
  const std::string& bytes_;
  const std::string& path_;
  uint64_t pos_ = 0;
};

// The fewest bytes a value of `type` takes in the file (a string: its length, an array: its
// element type and count).
uint64_t min_value_bytes(GgufValueType type) {
  switch (type) {
    case GgufValueType::U8:
    case GgufValueType::I8:
    case GgufValueType::BOOL: return 1;
    case GgufValueType::U16:
    case GgufValueType::I16: return 2;
    case GgufValueType::U32:
    case GgufValueType::I32:
    case GgufValueType::F32: return 4;
    case GgufValueType::ARRAY: return 12;
    default: return 8;
  }
}

GgufValue Cursor::value(GgufValueType type, const std::string& key, int depth) {
  GgufValue v;
  v.type = type;
  switch (type) {
    case GgufValueType::U8: v.i = raw<uint8_t>(key.c_str()); break;
    case GgufValueType::I8: v.i = raw<int8_t>(key.c_str()); break;
    case GgufValueType::U16: v.i = raw<uint16_t>(key.c_str()); break;
    case GgufValueType::I16: v.i = raw<int16_t>(key.c_str()); break;
    case GgufValueType::U32: v.i = raw<uint32_t>(key.c_str()); break;
    case GgufValueType::I32: v.i = raw<int32_t>(key.c_str()); break;
    case GgufValueType::F32: v.f = raw<float>(key.c_str()); break;
    case GgufValueType::BOOL: v.i = raw<uint8_t>(key.c_str()); break;
    case GgufValueType::STRING: v.s = string(key.c_str()); break;
    case GgufValueType::U64: v.i = static_cast<int64_t>(raw<uint64_t>(key.c_str())); break;
    case GgufValueType::I64: v.i = raw<int64_t>(key.c_str()); break;
    case GgufValueType::F64: v.f = raw<double>(key.c_str()); break;
    case GgufValueType::ARRAY: {
      LOOM_CHECK(depth < 8, path_, ": metadata key ", key, ": arrays nested too deeply");
      v.element = static_cast<GgufValueType>(raw<uint32_t>(key.c_str()));
      LOOM_CHECK(static_cast<uint32_t>(v.element) <= 12, path_, ": metadata key ", key, ": unknown array element type ",
                 static_cast<uint32_t>(v.element));
      const auto n = raw<uint64_t>(key.c_str());
      // Each element takes at least this many bytes of the file: a count the file cannot hold is
      // refused before anything is reserved for it.
      const uint64_t least = min_value_bytes(v.element);
      LOOM_CHECK(n <= (bytes_.size() - pos_) / least, path_, ": metadata key ", key, ": array of ", n,
                 " elements past the end");
      v.array.reserve(std::min<uint64_t>(n, 1 << 16));
      for (uint64_t k = 0; k < n; ++k) v.array.push_back(value(v.element, key, depth + 1));
      break;
    }
    default: throw Error(str_cat(path_, ": metadata key ", key, ": unknown value type ", static_cast<uint32_t>(type)));
  }
  return v;
}

GgufValue scalar(GgufValueType type) {
  GgufValue v;
  v.type = type;
  return v;
}

// An array of `element` values, one made by `make` from each of `v`.
template <class T, class Make>
GgufValue array_of(GgufValueType element, const std::vector<T>& v, Make make) {
  GgufValue g = scalar(GgufValueType::ARRAY);
  g.element = element;
  g.array.reserve(v.size());
  for (const T& x : v) g.array.push_back(make(x));
  return g;
}

// The element count of a ggml shape (checked against the file's size where it is read).
uint64_t ne_elements(const std::vector<uint64_t>& ne) {
  uint64_t elements = 1;
  for (uint64_t d : ne) elements *= d;
  return elements;
}

}  // namespace

const char* ggml_type_name(GgmlType type) {
  switch (type) {
    case GgmlType::F32: return "F32";
    case GgmlType::F16: return "F16";
    case GgmlType::Q4_0: return "Q4_0";
    case GgmlType::Q8_0: return "Q8_0";
    case GgmlType::BF16: return "BF16";
  }
  return "?";
}

uint64_t ggml_tensor_bytes(GgmlType type, uint64_t elements) {
  switch (type) {
    case GgmlType::F32: return 4 * elements;
    case GgmlType::F16:
    case GgmlType::BF16: return 2 * elements;
    case GgmlType::Q4_0: return ggml_blocks_size(GgmlBlock::Q4_0, static_cast<int64_t>(elements));
    case GgmlType::Q8_0: return ggml_blocks_size(GgmlBlock::Q8_0, static_cast<int64_t>(elements));
  }
  throw Error(str_cat("unknown ggml type ", static_cast<uint32_t>(type)));
}

GgufValue GgufValue::u32(uint32_t v) { GgufValue g = scalar(GgufValueType::U32); g.i = v; return g; }
GgufValue GgufValue::i32(int32_t v) { GgufValue g = scalar(GgufValueType::I32); g.i = v; return g; }
GgufValue GgufValue::u64(uint64_t v) { GgufValue g = scalar(GgufValueType::U64); g.i = static_cast<int64_t>(v); return g; }
GgufValue GgufValue::f32(float v) { GgufValue g = scalar(GgufValueType::F32); g.f = v; return g; }
GgufValue GgufValue::boolean(bool v) { GgufValue g = scalar(GgufValueType::BOOL); g.i = v ? 1 : 0; return g; }
GgufValue GgufValue::string(std::string v) { GgufValue g = scalar(GgufValueType::STRING); g.s = std::move(v); return g; }

GgufValue GgufValue::strings(const std::vector<std::string>& v) { return array_of(GgufValueType::STRING, v, string); }
GgufValue GgufValue::i32s(const std::vector<int32_t>& v) { return array_of(GgufValueType::I32, v, i32); }
GgufValue GgufValue::f32s(const std::vector<float>& v) { return array_of(GgufValueType::F32, v, f32); }

GgufWriter::GgufWriter(uint32_t alignment) : alignment_(alignment) {
  LOOM_CHECK(alignment > 0 && (alignment & (alignment - 1)) == 0, "GGUF alignment must be a power of two, got ",
             alignment);
  put("general.alignment", GgufValue::u32(alignment));
}

void GgufWriter::put(const std::string& key, GgufValue value) {
  for (const auto& kv : kvs_) LOOM_CHECK(kv.first != key, "GGUF metadata key ", key, " given twice");
  kvs_.emplace_back(key, std::move(value));
}

void GgufWriter::add_tensor(const std::string& name, std::vector<uint64_t> ne, GgmlType type, std::vector<uint8_t> data) {
  auto held = std::make_shared<std::vector<uint8_t>>(std::move(data));
  const uint64_t elements = ne_elements(ne);
  LOOM_CHECK(held->size() == ggml_tensor_bytes(type, elements), "GGUF tensor ", name, ": ", held->size(),
             " bytes for ", elements, " ", ggml_type_name(type), " elements");
  add_tensor(name, std::move(ne), type, [held] { return std::move(*held); });
}

void GgufWriter::add_tensor(const std::string& name, std::vector<uint64_t> ne, GgmlType type, GgufTensorBytes make) {
  LOOM_CHECK(!ne.empty() && ne.size() <= kMaxDims, "GGUF tensor ", name, ": ", ne.size(), " dimensions (1 to 4)");
  const uint64_t elements = ne_elements(ne);
  for (const GgufTensorInfo& t : infos_) LOOM_CHECK(t.name != name, "GGUF tensor ", name, " added twice");
  const uint64_t bytes = ggml_tensor_bytes(type, elements);
  infos_.push_back({name, std::move(ne), type, data_size_});
  data_size_ = align_up(data_size_ + bytes, alignment_);
  data_.push_back(std::move(make));
}

void GgufWriter::write(const std::string& path) const {
  std::string head;
  put_raw(head, kMagic);
  put_raw(head, kVersion);
  put_raw<uint64_t>(head, infos_.size());
  put_raw<uint64_t>(head, kvs_.size());
  for (const auto& [key, value] : kvs_) {
    put_string(head, key);
    put_raw(head, static_cast<uint32_t>(value.type));
    put_value_body(head, value);
  }
  for (const GgufTensorInfo& t : infos_) {
    put_string(head, t.name);
    put_raw<uint32_t>(head, static_cast<uint32_t>(t.ne.size()));
    for (uint64_t d : t.ne) put_raw(head, d);
    put_raw(head, static_cast<uint32_t>(t.type));
    put_raw(head, t.offset);
  }
  head.resize(align_up(head.size(), alignment_), '\0');
  const std::string zeros(alignment_, '\0');
  AtomicFile file(path);
  file.write(head.data(), head.size());
  for (size_t k = 0; k < infos_.size(); ++k) {
    const GgufTensorInfo& t = infos_[k];
    const uint64_t elements = ne_elements(t.ne);
    const std::vector<uint8_t> d = data_[k]();
    LOOM_CHECK(d.size() == ggml_tensor_bytes(t.type, elements), "GGUF tensor ", t.name, ": ", d.size(), " bytes for ",
               elements, " ", ggml_type_name(t.type), " elements");
    file.write(d.data(), d.size());
    const size_t pad = align_up(d.size(), alignment_) - d.size();
    if (pad > 0) file.write(zeros.data(), pad);
  }
  file.commit();
}

GgufFile GgufFile::read(const std::string& path) {
  GgufFile f;
  f.path_ = path;
  // A regular file, read by its size (a device or FIFO, which could be endless, is refused).
  std::error_code ec;
  LOOM_CHECK(std::filesystem::is_regular_file(path, ec), path, ": not a regular file (a GGUF file is read whole)");
  const uint64_t size = std::filesystem::file_size(path, ec);
  LOOM_CHECK(!ec, path, ": cannot read the GGUF file's size (", ec.message(), ")");
  f.bytes_ = read_text_file(path, size, "the size the file had when it was opened");
  Cursor c(f.bytes_, path);
  LOOM_CHECK(c.raw<uint32_t>("magic") == kMagic, path, ": not a GGUF file (bad magic)");
  f.version = c.raw<uint32_t>("version");
  LOOM_CHECK(f.version == kVersion, path, ": GGUF version ", f.version, ", expected ", kVersion);
  const auto n_tensors = c.raw<uint64_t>("tensor count");
  const auto n_kvs = c.raw<uint64_t>("metadata count");
  for (uint64_t k = 0; k < n_kvs; ++k) {
    std::string key = c.string("metadata key");
    const auto type = static_cast<GgufValueType>(c.raw<uint32_t>(key.c_str()));
    f.kvs.emplace_back(key, c.value(type, key));
  }
  if (f.has("general.alignment")) f.alignment = static_cast<uint32_t>(f.get("general.alignment").i);
  LOOM_CHECK(f.alignment > 0 && (f.alignment & (f.alignment - 1)) == 0, path, ": general.alignment ", f.alignment,
             " is not a power of two");
  for (uint64_t k = 0; k < n_tensors; ++k) {
    GgufTensorInfo t;
    t.name = c.string("tensor name");
    const auto dims = c.raw<uint32_t>(t.name.c_str());
    LOOM_CHECK(dims >= 1 && dims <= kMaxDims, path, ": tensor ", t.name, " has ", dims, " dimensions");
    for (uint32_t d = 0; d < dims; ++d) t.ne.push_back(c.raw<uint64_t>(t.name.c_str()));
    const auto type = c.raw<uint32_t>(t.name.c_str());
    LOOM_CHECK(type == 0 || type == 1 || type == 2 || type == 8 || type == 30, path, ": tensor ", t.name,
               " has ggml type ", type, " (Loom reads F32, F16, BF16, Q4_0, Q8_0)");
    t.type = static_cast<GgmlType>(type);
    t.offset = c.raw<uint64_t>(t.name.c_str());
    LOOM_CHECK(t.offset % f.alignment == 0, path, ": tensor ", t.name, " offset ", t.offset, " is not aligned");
    f.tensors.push_back(std::move(t));
  }
  f.data_offset = align_up(c.pos(), f.alignment);
  // Every tensor inside the file: its element count (each type takes at least half a byte an
  // element) and its bytes checked without overflow before anything is sized by them.
  const uint64_t file_bytes = f.bytes_.size();
  LOOM_CHECK(f.data_offset <= file_bytes || f.tensors.empty(), path, ": the data section starts at byte ",
             f.data_offset, ", past the end of the file (", file_bytes, ")");
  for (const GgufTensorInfo& t : f.tensors) {
    uint64_t elements = 1;
    for (uint64_t d : t.ne) {
      if (d != 0 && elements > 2 * file_bytes / d) {
        std::string shape;
        for (uint64_t e : t.ne) shape += (shape.empty() ? "" : ", ") + std::to_string(e);
        throw Error(str_cat(path, ": tensor ", t.name, " of ", t.ne.size(), " dimensions [", shape,
                            "] has more elements than the ", file_bytes, "-byte file can hold"));
      }
      elements *= d;
    }
    LOOM_CHECK((t.type != GgmlType::Q4_0 && t.type != GgmlType::Q8_0) || t.ne[0] % 32 == 0, path, ": tensor ", t.name,
               " is ", ggml_type_name(t.type), " with rows of ", t.ne[0], " elements, not a multiple of its 32-element blocks");
    const uint64_t bytes = ggml_tensor_bytes(t.type, elements);
    LOOM_CHECK(t.offset <= file_bytes - f.data_offset && bytes <= file_bytes - f.data_offset - t.offset, path, ": tensor ",
               t.name, " (", bytes, " bytes at data offset ", t.offset, ") ends past the end of the file (", file_bytes,
               " bytes)");
  }
  return f;
}

bool GgufFile::has(const std::string& key) const {
  for (const auto& kv : kvs) {
    if (kv.first == key) return true;
  }
  return false;
}

const GgufValue& GgufFile::get(const std::string& key) const {
  for (const auto& kv : kvs) {
    if (kv.first == key) return kv.second;
  }
  throw Error(str_cat(path_, ": no metadata key ", key));
}

const GgufTensorInfo& GgufFile::tensor(const std::string& name) const {
  for (const GgufTensorInfo& t : tensors) {
    if (t.name == name) return t;
  }
  throw Error(str_cat(path_, ": no tensor ", name));
}

std::vector<uint8_t> GgufFile::tensor_data(const std::string& name) const {
  const GgufTensorInfo& t = tensor(name);
  const uint64_t elements = ne_elements(t.ne);
  const char* begin = bytes_.data() + data_offset + t.offset;
  return {begin, begin + ggml_tensor_bytes(t.type, elements)};
}

std::vector<float> GgufFile::tensor_f32(const std::string& name) const {
  const GgufTensorInfo& t = tensor(name);
  const std::vector<uint8_t> raw = tensor_data(name);
  const uint64_t elements = ne_elements(t.ne);
  std::vector<float> out(elements);
  switch (t.type) {
    case GgmlType::F32: std::memcpy(out.data(), raw.data(), raw.size()); break;
    case GgmlType::F16:
      for (uint64_t k = 0; k < elements; ++k) out[k] = decode(FMT_FP16, raw[2 * k] | (raw[2 * k + 1] << 8));
      break;
    case GgmlType::BF16:
      for (uint64_t k = 0; k < elements; ++k) {
        out[k] = bf16_to_f32(bf16{static_cast<uint16_t>(raw[2 * k] | (raw[2 * k + 1] << 8))});
      }
      break;
    case GgmlType::Q8_0: ggml_dequantize(GgmlBlock::Q8_0, raw, out); break;
    case GgmlType::Q4_0: ggml_dequantize(GgmlBlock::Q4_0, raw, out); break;
  }
  return out;
}

}  // namespace loom
