#include "loom/core/dtype.h"

namespace loom {

namespace {
struct DTypeInfo {
  size_t size;
  std::string_view name;
};
constexpr DTypeInfo kDTypeInfo[] = {{4, "f32"}, {2, "bf16"}, {8, "f64"}, {4, "i32"}, {1, "u8"}, {2, "f16"}};
static_assert(sizeof(kDTypeInfo) / sizeof(kDTypeInfo[0]) == DTYPE_COUNT);
}  // namespace

size_t dtype_size(DType dtype) { return kDTypeInfo[dtype].size; }
std::string_view dtype_name(DType dtype) { return kDTypeInfo[dtype].name; }

}  // namespace loom
