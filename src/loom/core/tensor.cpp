#include "loom/core/tensor.h"

#include <sys/mman.h>

#include <cstdlib>
#include <cstring>
#include <new>

#include "loom/core/error.h"

namespace loom {

void Shape::push_back(int64_t d) {
  LOOM_CHECK(size_ < kMaxDims, "a tensor shape has at most ", kMaxDims, " dims");
  dims_[size_++] = d;
}

bool Shape::operator==(const Shape& other) const {
  if (size_ != other.size_) return false;
  for (size_t i = 0; i < size_; ++i) {
    if (dims_[i] != other.dims_[i]) return false;
  }
  return true;
}

int64_t shape_numel(const Shape& shape) {
  int64_t n = 1;
  for (int64_t d : shape) {
    // A shape from a file (a config's widths, a tensor header) may not fit: refused, not wrapped.
    if (__builtin_mul_overflow(n, d, &n)) {
      throw Error(str_cat("shape ", shape_str(shape), " has more elements than an int64 holds"));
    }
  }
  return n;
}

void transpose_into(const float* src, float* dst, int64_t rows, int64_t cols) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) dst[c * rows + r] = src[r * cols + c];
  }
}

std::string shape_str(const Shape& shape) {
  std::string out = "(";
  for (size_t i = 0; i < shape.size(); ++i) out += (i ? ", " : "") + std::to_string(shape[i]);
  return out + ")";
}

// Buffers of 2 MiB and more are 2 MiB aligned and asked to be backed by transparent huge
// pages: first touch then faults once per 2 MiB instead of once per 4 KiB, which on a VM is
// the difference between seconds and milliseconds for a GPT-2's parameters and optimizer state.
void* CpuAllocator::raw_allocate(size_t bytes) {
  constexpr size_t kHugePage = size_t{2} << 20;
  const size_t alignment = bytes >= kHugePage ? kHugePage : 64;
  const size_t rounded = bytes == 0 ? alignment : (bytes + alignment - 1) / alignment * alignment;
  void* ptr = std::aligned_alloc(alignment, rounded);
  if (ptr == nullptr) throw Error(str_cat("out of host memory allocating ", format_bytes(bytes)));
  if (alignment == kHugePage) ::madvise(ptr, rounded, MADV_HUGEPAGE);  // advisory: ignored where unsupported
  return ptr;
}

void CpuAllocator::raw_release(void* ptr, size_t) { std::free(ptr); }

void* CpuAllocator::raw_allocate_lazy(size_t bytes) {
  void* ptr = ::mmap(nullptr, bytes == 0 ? 1 : bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                     -1, 0);
  if (ptr == MAP_FAILED) throw Error(str_cat("out of host address space reserving ", format_bytes(bytes)));
  ::madvise(ptr, bytes == 0 ? 1 : bytes, MADV_NOHUGEPAGE);  // sparse writes: one 4 KiB page each, not 2 MiB
  return ptr;
}

void CpuAllocator::raw_release_lazy(void* ptr, size_t bytes) { ::munmap(ptr, bytes == 0 ? 1 : bytes); }
void CpuAllocator::raw_zero(void* ptr, size_t bytes) { std::memset(ptr, 0, bytes); }

Storage::Storage(Allocator& owner, size_t size, MemCategory cat, bool lazy_pages)
    : allocator(&owner),
      host_accessible(owner.host_accessible()),
      data(lazy_pages ? owner.raw_allocate_lazy(size) : owner.raw_allocate(size)),
      bytes(size),
      category(cat),
      lazy(lazy_pages) {
  allocator->tracker().on_allocate(category, bytes);
}

Storage::~Storage() {
  allocator->tracker().on_release(category, bytes);
  if (lazy) allocator->raw_release_lazy(data, bytes);
  else allocator->raw_release(data, bytes);
}

void Tensor::move_to_category(MemCategory category) const {
  LOOM_CHECK(defined(), "move_to_category of an undefined tensor");
  if (storage_->category == category) return;
  storage_->allocator->tracker().on_move(storage_->category, category, storage_->bytes);
  storage_->category = category;
}

Tensor Tensor::empty(Allocator& allocator, Shape shape, DType dtype, MemCategory category) {
  for (int64_t d : shape) LOOM_CHECK(d >= 0, "tensor shape ", shape_str(shape), " has a negative dim");
  Tensor t;
  t.shape_ = std::move(shape);
  t.dtype_ = dtype;
  t.storage_ = std::make_shared<Storage>(allocator, t.nbytes(), category);
  return t;
}

Tensor Tensor::zeros(Allocator& allocator, Shape shape, DType dtype, MemCategory category) {
  Tensor t = empty(allocator, std::move(shape), dtype, category);
  t.zero_();
  return t;
}

Tensor Tensor::zeros_lazy(Allocator& allocator, Shape shape, DType dtype, MemCategory category) {
  for (int64_t d : shape) LOOM_CHECK(d >= 0, "tensor shape ", shape_str(shape), " has a negative dim");
  Tensor t;
  t.shape_ = std::move(shape);
  t.dtype_ = dtype;
  t.storage_ = std::make_shared<Storage>(allocator, t.nbytes(), category, true);
  return t;
}

int64_t Tensor::dim(int axis) const {
  const int n = ndim();
  const int a = axis < 0 ? axis + n : axis;
  LOOM_CHECK(a >= 0 && a < n, "dim ", axis, " out of range for tensor ", describe());
  return shape_[a];
}

std::string Tensor::describe() const { return std::string(dtype_name(dtype_)) + shape_str(shape_); }

Tensor Tensor::view(int64_t offset, Shape shape) const {
  const int64_t n = shape_numel(shape);
  LOOM_CHECK(offset >= 0 && offset + n <= numel(), "view of ", n, " elements at offset ", offset,
             " exceeds tensor ", describe());
  Tensor t = *this;
  t.offset_bytes_ = offset_bytes_ + static_cast<size_t>(offset) * dtype_size(dtype_);
  t.shape_ = std::move(shape);
  return t;
}

Tensor Tensor::slice0(int64_t begin, int64_t end) const {
  LOOM_CHECK(ndim() >= 1 && begin >= 0 && begin <= end && end <= shape_[0], "slice [", begin, ", ", end,
             ") out of range for tensor ", describe());
  Shape shape = shape_;
  shape[0] = end - begin;
  return view(begin * (numel() / (shape_[0] == 0 ? 1 : shape_[0])), shape);
}

void Tensor::zero_() const { storage_->allocator->raw_zero(device_ptr(), nbytes()); }

void Tensor::refuse_host_access() const {
  throw Error(str_cat("host access to tensor ", describe(), " in ", device() == DEVICE_CUDA ? "GPU" : "device",
                      " memory: copy it with Backend::read / Backend::write"));
}

void Tensor::check_dtype(DType expected) const {
  LOOM_CHECK(dtype_ == expected, "tensor ", describe(), " accessed as ", dtype_name(expected));
}

}  // namespace loom
