// Tensor: a handle to shared storage with a dtype, a shape and a device. Contiguous row-major;
// views (flat-buffer ranges, outer-dim slices, reshapes) share storage. No hidden copies, no
// implicit dtype promotion. Storage is allocated through an Allocator that records the bytes in
// its MemoryTracker under the tensor's category.
#pragma once
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "loom/core/enum_names.h"
#include "loom/core/dtype.h"
#include "loom/core/memory.h"

namespace loom {

enum DeviceType : uint8_t { DEVICE_CPU, DEVICE_CUDA, DEVICE_COUNT };
template <>
struct EnumNames<DeviceType> {  // the config key `device`
  static constexpr std::array<std::string_view, DEVICE_COUNT> names{"cpu", "cuda"};
};

// A tensor's dims, kept inline (at most kMaxDims): making, copying and viewing tensors then
// never touches the heap, so a training step's views allocate nothing.
class Shape {
 public:
  static constexpr size_t kMaxDims = 8;
  using value_type = int64_t;
  using iterator = int64_t*;
  using const_iterator = const int64_t*;

  Shape() = default;
  Shape(std::initializer_list<int64_t> dims) : Shape(dims.begin(), dims.end()) {}
  template <typename It>
  Shape(It first, It last) {
    for (; first != last; ++first) push_back(static_cast<int64_t>(*first));
  }

  size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  int64_t& operator[](size_t i) { return dims_[i]; }
  int64_t operator[](size_t i) const { return dims_[i]; }
  int64_t back() const { return dims_[size_ - 1]; }
  int64_t* data() { return dims_; }
  const int64_t* data() const { return dims_; }
  iterator begin() { return dims_; }
  iterator end() { return dims_ + size_; }
  const_iterator begin() const { return dims_; }
  const_iterator end() const { return dims_ + size_; }
  void push_back(int64_t d);  // throws beyond kMaxDims
  bool operator==(const Shape& other) const;

 private:
  int64_t dims_[kMaxDims] = {};
  size_t size_ = 0;
};
int64_t shape_numel(const Shape& shape);
std::string shape_str(const Shape& shape);  // "(2, 3, 4)"
// Host f32: dst (cols, rows) = src (rows, cols) transposed.
void transpose_into(const float* src, float* dst, int64_t rows, int64_t cols);

class Allocator {
 public:
  virtual ~Allocator() = default;
  virtual DeviceType device() const = 0;
  virtual void* raw_allocate(size_t bytes) = 0;
  virtual void raw_release(void* ptr, size_t bytes) = 0;
  virtual void raw_zero(void* ptr, size_t bytes) = 0;
  // Zeroed memory whose pages cost memory only once written, released by raw_release_lazy: on
  // the host an anonymous mapping without swap reservation (MAP_NORESERVE), whose untouched
  // pages read as zeros and hold nothing; elsewhere raw_allocate + raw_zero. For a buffer most
  // of which is never written: an inference model's f32 parameters whose linear weights are
  // used in bf16 where a checkpoint holds them (Tensor::zeros_lazy).
  virtual void* raw_allocate_lazy(size_t bytes) {
    void* ptr = raw_allocate(bytes);
    raw_zero(ptr, bytes);
    return ptr;
  }
  virtual void raw_release_lazy(void* ptr, size_t bytes) { raw_release(ptr, bytes); }
  // Whether host code may dereference this allocator's memory (Tensor::data). A GPU's is not.
  virtual bool host_accessible() const { return device() == DEVICE_CPU; }
  MemoryTracker& tracker() { return tracker_; }
  const MemoryTracker& tracker() const { return tracker_; }

 private:
  MemoryTracker tracker_;
};

// Host memory, 64-byte aligned (one cache line, one AVX-512 vector).
class CpuAllocator final : public Allocator {
 public:
  DeviceType device() const override { return DEVICE_CPU; }
  void* raw_allocate(size_t bytes) override;
  void raw_release(void* ptr, size_t bytes) override;
  void raw_zero(void* ptr, size_t bytes) override;
  void* raw_allocate_lazy(size_t bytes) override;
  void raw_release_lazy(void* ptr, size_t bytes) override;
};

struct Storage {
  Storage(Allocator& allocator, size_t bytes, MemCategory category, bool lazy = false);
  ~Storage();
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;

  Allocator* allocator;
  bool host_accessible;  // allocator->host_accessible(), read once
  void* data;
  size_t bytes;
  MemCategory category;
  bool lazy;  // from raw_allocate_lazy
};

template <typename T>
constexpr DType dtype_of();
template <> constexpr DType dtype_of<float>() { return DTYPE_F32; }
template <> constexpr DType dtype_of<double>() { return DTYPE_F64; }
template <> constexpr DType dtype_of<bf16>() { return DTYPE_BF16; }
template <> constexpr DType dtype_of<int32_t>() { return DTYPE_I32; }
template <> constexpr DType dtype_of<uint8_t>() { return DTYPE_U8; }

class Tensor {
 public:
  Tensor() = default;
  static Tensor empty(Allocator& allocator, Shape shape, DType dtype, MemCategory category);
  static Tensor zeros(Allocator& allocator, Shape shape, DType dtype, MemCategory category);
  // Zeros whose host pages hold memory only once written (Allocator::raw_allocate_lazy). The
  // tracker counts the whole size; resident_bytes (core/pages.h) measures what is held.
  static Tensor zeros_lazy(Allocator& allocator, Shape shape, DType dtype, MemCategory category);

  bool defined() const { return storage_ != nullptr; }
  DType dtype() const { return dtype_; }
  DeviceType device() const { return storage_->allocator->device(); }
  MemCategory category() const { return storage_->category; }
  // Whether host code may read and write the elements (data()); false for a GPU's memory.
  bool host_accessible() const { return storage_->host_accessible || host_alias_; }
  const Shape& shape() const { return shape_; }
  int ndim() const { return static_cast<int>(shape_.size()); }
  int64_t dim(int axis) const;  // negative counts from the end
  int64_t numel() const { return shape_numel(shape_); }
  size_t nbytes() const { return static_cast<size_t>(numel()) * dtype_size(dtype_); }
  std::string describe() const;  // "f32(2, 3)"

  // Host pointers to the elements. They throw for memory host code cannot read (a GPU's):
  // move such data with Backend::read / Backend::write instead.
  void* raw_data() const {
    if (!storage_->host_accessible && !host_alias_) refuse_host_access();
    return device_ptr();
  }
  template <typename T>
  T* data() const {
    check_dtype(dtype_of<T>());
    return static_cast<T*>(raw_data());
  }
  // The elements' address in the memory of the tensor's device, unchecked: for backends and
  // communicators, which hand it to device kernels and collectives.
  void* device_ptr() const { return static_cast<char*>(storage_->data) + offset_bytes_; }
  // The same tensor, readable from the host: only for a backend whose device memory is in fact
  // host memory (the strict test backend, which checks that model code never reads it directly).
  Tensor host_alias() const {
    Tensor t = *this;
    t.host_alias_ = true;
    return t;
  }

  // A contiguous range of elements [offset, offset + numel(shape)) viewed with `shape`.
  Tensor view(int64_t offset, Shape shape) const;
  Tensor reshape(Shape shape) const { return view(0, std::move(shape)); }
  // Rows [begin, end) of the outermost dim.
  Tensor slice0(int64_t begin, int64_t end) const;
  void zero_() const;
  // Accounts the whole storage under `category` from now on (the tracker's bytes move): a buffer
  // offloaded to host memory. On the CPU backend host and device memory are the same RAM, so
  // only the accounting moves; a device backend copies it out instead.
  void move_to_category(MemCategory category) const;

 private:
  void check_dtype(DType expected) const;
  [[noreturn]] void refuse_host_access() const;

  std::shared_ptr<Storage> storage_;
  size_t offset_bytes_ = 0;
  Shape shape_;
  DType dtype_ = DTYPE_F32;
  bool host_alias_ = false;  // see host_alias()
};

}  // namespace loom
