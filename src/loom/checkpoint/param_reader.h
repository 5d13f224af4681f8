// A model's parameters read one at a time as f32, by their ParamLayout names: what an export
// writes from without holding the model (loom convert --to gguf|hf of an 8B model reads 4 bytes
// a parameter of one tensor at a time, not 32 GB). Sources: a flat buffer already in memory, a
// Hugging Face folder (HfWeightReader: each tensor widened from its dtype as it is read, its
// file pages dropped), and an unsharded Loom checkpoint's model.safetensors (memory-mapped, the
// tensor copied and its pages dropped). Every source is checked against the model's layout
// before the first read, and every parameter read is checked finite (a non-finite weight is an
// error naming it, as loading refuses it).
#pragma once
#include <memory>
#include <span>
#include <string>

#include "loom/arch/config.h"
#include "loom/arch/param_layout.h"
#include "loom/core/tensor.h"

namespace loom {

class ParamReader {
 public:
  virtual ~ParamReader() = default;
  virtual const ModelConfig& config() const = 0;
  // The parameter's elements (its ParamLayout shape, row-major), valid until the next call. The
  // same name twice in a row is read once.
  virtual std::span<const float> read(const std::string& name) = 0;
};

// A file source: each parameter read into a host buffer of its shape by fill() (once for the same
// name twice in a row) and checked finite, naming `path`.
class BufferedParamReader : public ParamReader {
 public:
  BufferedParamReader(const ModelConfig& config, std::string path);
  ~BufferedParamReader() override;
  const ModelConfig& config() const override { return config_; }
  std::span<const float> read(const std::string& name) override;

 protected:
  virtual void fill(const ParamSpec& spec, const Tensor& dst) = 0;
  const ParamLayout& layout() const { return layout_; }
  const std::string& path() const { return path_; }

 private:
  ModelConfig config_;
  ParamLayout layout_;
  std::string path_, last_;
  std::unique_ptr<Allocator> host_;
  Tensor buffer_;
};

// `params`: the flat f32 buffer of `config`'s layout (not copied: it must outlive the reader).
std::unique_ptr<ParamReader> flat_param_reader(const ModelConfig& config, std::span<const float> params);
// Readers of files: hf_param_reader (hf_model.h), open_param_reader (weights.h: a Hugging Face
// folder or a Loom checkpoint).

// A non-finite element of a parameter read from `path`: an Error naming both (its first one).
void check_finite_param(const std::string& path, const std::string& name, std::span<const float> values);
void check_finite_param(const std::string& path, const std::string& name, std::span<const bf16> values);

}  // namespace loom
