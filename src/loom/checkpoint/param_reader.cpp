#include "loom/checkpoint/param_reader.h"

#include <cmath>

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

void check_finite_param(const std::string& path, const std::string& name, std::span<const float> values) {
  for (size_t i = 0; i < values.size(); ++i) {
    LOOM_CHECK(std::isfinite(values[i]), path, ": weight ", name, " holds ", values[i], " at element ", i,
               " (a diverged or corrupted model); refusing to use non-finite weights");
  }
}

std::unique_ptr<ParamReader> flat_param_reader(const ModelConfig& config, std::span<const float> params) {
  return std::make_unique<FlatParamReader>(config, params);
}

}  // namespace loom
