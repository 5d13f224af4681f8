#include "loom/checkpoint/param_reader.h"

#include <algorithm>
#include <cmath>

#include "loom/core/dtype.h"
#include "loom/core/error.h"
#include "loom/core/memory.h"

namespace loom {

namespace {

class FlatParamReader final : public ParamReader {
 public:
  FlatParamReader(const ModelConfig& config, std::span<const float> params)
      : config_(config), layout_(build_param_layout(config)), params_(params) {
    LOOM_CHECK(static_cast<int64_t>(params.size()) == layout_.total, "flat_param_reader: ", params.size(),
               " parameters for a model of ", layout_.total);
  }
  const ModelConfig& config() const override { return config_; }
  std::span<const float> read(const std::string& name) override {
    const ParamSpec& p = layout_.find(name);
    return params_.subspan(static_cast<size_t>(p.offset), static_cast<size_t>(p.numel));
  }

 private:
  ModelConfig config_;
  ParamLayout layout_;
  std::span<const float> params_;
};

}  // namespace

BufferedParamReader::BufferedParamReader(const ModelConfig& config, std::string path)
    : config_(config), layout_(build_param_layout(config)), path_(std::move(path)),
      host_(std::make_unique<CpuAllocator>()) {}

BufferedParamReader::~BufferedParamReader() = default;

std::span<const float> BufferedParamReader::read(const std::string& name) {
  if (name != last_) {
    last_.clear();
    const ParamSpec& spec = layout_.find(name);
    buffer_ = Tensor();  // the previous parameter's buffer freed first
    buffer_ = Tensor::empty(*host_, spec.shape, DTYPE_F32, MEM_WORKSPACE);
    fill(spec, buffer_);
    check_finite_param(path_, name, {buffer_.data<float>(), static_cast<size_t>(buffer_.numel())});
    last_ = name;
  }
  return {buffer_.data<float>(), static_cast<size_t>(buffer_.numel())};
}

namespace {

// The index of the first element for which bad(i) holds, or n: blocks of elements are tested
// without a branch (the loop vectorizes) and only a block holding one is searched, so a whole
// model (an 8B folder's 16 GB at load) is checked at memory speed.
template <class Bad>
size_t first_where(size_t n, const Bad& bad) {
  constexpr size_t kBlock = 4096;
  for (size_t i0 = 0; i0 < n; i0 += kBlock) {
    const size_t i1 = std::min(n, i0 + kBlock);
    bool any = false;
    for (size_t i = i0; i < i1; ++i) any |= bad(i);
    if (!any) continue;
    for (size_t i = i0; i < i1; ++i) {
      if (bad(i)) return i;
    }
  }
  return n;
}

[[noreturn]] void refuse_non_finite(const std::string& path, const std::string& name, float value, size_t at) {
  throw Error(str_cat(path, ": weight ", name, " holds ", value, " at element ", at,
                      " (a diverged or corrupted model); refusing to use non-finite weights"));
}

}  // namespace

void check_finite_param(const std::string& path, const std::string& name, std::span<const float> values) {
  const size_t at = first_where(values.size(), [&](size_t i) { return !std::isfinite(values[i]); });
  if (at < values.size()) refuse_non_finite(path, name, values[at], at);
}

void check_finite_param(const std::string& path, const std::string& name, std::span<const bf16> values) {
  const size_t at = first_where(values.size(), [&](size_t i) { return (values[i].bits & 0x7f80u) == 0x7f80u; });
  if (at < values.size()) refuse_non_finite(path, name, bf16_to_f32(values[at]), at);
}

std::unique_ptr<ParamReader> flat_param_reader(const ModelConfig& config, std::span<const float> params) {
  return std::make_unique<FlatParamReader>(config, params);
}

}  // namespace loom
