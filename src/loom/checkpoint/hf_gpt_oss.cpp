#include "loom/checkpoint/hf_gpt_oss.h"

#include <span>
#include <vector>

#include "loom/core/dtype.h"
#include "loom/core/error.h"
#include "loom/precision/formats.h"

namespace loom {

namespace {

bool is_weight(GptOssPart p) { return p == GptOssPart::gate_up || p == GptOssPart::down; }

// Expert e's slab of the plain fused tensor (its elements after the leading E), widened to f32.
std::vector<float> plain_slab(const SafetensorsFile& file, const std::string& stored, int64_t e, int64_t n) {
  CpuAllocator host;
  const DType dt = file.dtype(stored);
  LOOM_CHECK(dt == DTYPE_F32 || dt == DTYPE_BF16, file.path(), ": tensor '", stored, "' is ", file.stored_dtype(stored),
             ", expected F32 or BF16");
  const Tensor t = Tensor::empty(host, {n}, dt, MEM_WORKSPACE);
  file.copy_range_into(stored, e * n, t);
  std::vector<float> out(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) out[i] = dt == DTYPE_F32 ? t.data<float>()[i] : bf16_to_f32(t.data<bf16>()[i]);
  return out;
}

// Expert e's rows x cols matrix (W^T) of the MXFP4 blocks and scales.
std::vector<float> mxfp4_slab(const SafetensorsFile& blocks_file, const std::string& blocks,
                              const SafetensorsFile& scales_file, const std::string& scales, int64_t e, int64_t rows,
                              int64_t cols) {
  CpuAllocator host;
  const int64_t groups = rows * (cols / 32);
  const Tensor b = Tensor::empty(host, {groups * 16}, DTYPE_U8, MEM_WORKSPACE);
  const Tensor s = Tensor::empty(host, {groups}, DTYPE_U8, MEM_WORKSPACE);
  blocks_file.copy_range_into(blocks, e * groups * 16, b);
  scales_file.copy_range_into(scales, e * groups, s);
  std::vector<uint8_t> codes(static_cast<size_t>(groups * 32));
  for (int64_t i = 0; i < groups * 16; ++i) {  // two E2M1 codes a byte, the low nibble first
    const uint8_t byte = b.data<uint8_t>()[i];
    codes[static_cast<size_t>(2 * i)] = byte & 0x0F, codes[static_cast<size_t>(2 * i + 1)] = byte >> 4;
  }
  std::vector<float> out(static_cast<size_t>(rows * cols));
  mxfp4_dequantize(codes, std::span<const uint8_t>(s.data<uint8_t>(), static_cast<size_t>(groups)), out);
  return out;
}

}  // namespace

std::optional<GptOssExpertRef> gpt_oss_expert_ref(const std::string& n) {
  const size_t at = n.find(".mlp.experts.");
  if (at == std::string::npos) return std::nullopt;
  const size_t first = at + 13, dot = n.find('.', first);
  if (dot == std::string::npos || dot == first) return std::nullopt;
  const std::string index = n.substr(first, dot - first), rest = n.substr(dot + 1);
  if (index.find_first_not_of("0123456789") != std::string::npos || index.size() > 9) return std::nullopt;
  GptOssExpertRef r;
  r.expert = std::stoll(index);
  const std::string fused = n.substr(0, at) + ".mlp.experts.";
  if (rest == "gate_up_proj.weight") r.part = GptOssPart::gate_up, r.folder = fused + "gate_up_proj";
  else if (rest == "gate_up_proj.bias") r.part = GptOssPart::gate_up_bias, r.folder = fused + "gate_up_proj_bias";
  else if (rest == "down_proj.weight") r.part = GptOssPart::down, r.folder = fused + "down_proj";
  else if (rest == "down_proj.bias") r.part = GptOssPart::down_bias, r.folder = fused + "down_proj_bias";
  else return std::nullopt;
  return r;
}

Shape gpt_oss_folder_shape(const ModelConfig& c, GptOssPart part) {
  const int64_t E = c.moe_experts, C = c.d_model, F = c.expert_ff();
  switch (part) {
    case GptOssPart::gate_up: return {E, C, 2 * F};
    case GptOssPart::gate_up_bias: return {E, 2 * F};
    case GptOssPart::down: return {E, F, C};
    case GptOssPart::down_bias: return {E, C};
  }
  return {};
}

Shape gpt_oss_blocks_shape(const ModelConfig& c, GptOssPart part) {
  const int64_t E = c.moe_experts, C = c.d_model, F = c.expert_ff();
  return part == GptOssPart::gate_up ? Shape{E, 2 * F, C / 32, 16} : Shape{E, C, F / 32, 16};
}

std::set<std::string> gpt_oss_stored_names(const FolderLookup& find, const GptOssExpertRef& ref) {
  std::string stored;
  if (find(ref.folder, &stored) != nullptr || !is_weight(ref.part)) return {stored.empty() ? ref.folder : stored};
  std::set<std::string> out;
  for (const char* suffix : {"_blocks", "_scales"}) {
    if (find(ref.folder + suffix, &stored) != nullptr) out.insert(stored);
  }
  return out;
}

void read_gpt_oss_expert(const FolderLookup& find, const ModelConfig& c, const GptOssExpertRef& ref, float* dst,
                         std::set<std::string>& used) {
  const int64_t C = c.d_model, F = c.expert_ff(), e = ref.expert;
  const Shape want = gpt_oss_folder_shape(c, ref.part);
  std::string stored;
  const SafetensorsFile* plain = find(ref.folder, &stored);
  std::vector<float> slab;
  bool transposed = true;  // the plain layout holds W (in, out); MXFP4 holds W^T (out, in)
  if (plain != nullptr) {
    LOOM_CHECK(plain->shape(stored) == want, plain->path(), ": tensor '", stored, "' has shape ",
               shape_str(plain->shape(stored)), ", expected ", shape_str(want));
    slab = plain_slab(*plain, stored, e, shape_numel(want) / c.moe_experts);
    used.insert(stored);
  } else {
    LOOM_CHECK(is_weight(ref.part), "the folder's safetensors files: tensor '", ref.folder, "' is missing");
    std::string blocks, scales;
    const SafetensorsFile* bf = find(ref.folder + "_blocks", &blocks);
    const SafetensorsFile* sf = find(ref.folder + "_scales", &scales);
    LOOM_CHECK(bf != nullptr && sf != nullptr, "the folder's safetensors files: tensor '", ref.folder, "' is missing (nor ",
               "are its MXFP4 _blocks and _scales there)");
    const Shape bshape = gpt_oss_blocks_shape(c, ref.part);
    const Shape sshape{bshape[0], bshape[1], bshape[2]};
    LOOM_CHECK(bf->shape(blocks) == bshape && bf->stored_dtype(blocks) == "U8", bf->path(), ": tensor '", blocks,
               "' is ", bf->stored_dtype(blocks), " ", shape_str(bf->shape(blocks)), ", expected U8 ", shape_str(bshape));
    LOOM_CHECK(sf->shape(scales) == sshape && sf->stored_dtype(scales) == "U8", sf->path(), ": tensor '", scales,
               "' is ", sf->stored_dtype(scales), " ", shape_str(sf->shape(scales)), ", expected U8 ", shape_str(sshape));
    slab = mxfp4_slab(*bf, blocks, *sf, scales, e, bshape[1], bshape[2] * 32);
    used.insert(blocks), used.insert(scales);
    transposed = false;
  }
  switch (ref.part) {
    case GptOssPart::gate_up:  // Loom (2F, C): gate rows (the folder's even columns), then up (odd)
      for (int64_t j = 0; j < 2 * F; ++j) {
        const int64_t from = j < F ? 2 * j : 2 * (j - F) + 1;
        for (int64_t k = 0; k < C; ++k) dst[j * C + k] = transposed ? slab[k * 2 * F + from] : slab[from * C + k];
      }
      return;
    case GptOssPart::gate_up_bias:
      for (int64_t j = 0; j < 2 * F; ++j) dst[j] = slab[j < F ? 2 * j : 2 * (j - F) + 1];
      return;
    case GptOssPart::down:  // Loom (C, F)
      for (int64_t r = 0; r < C; ++r) {
        for (int64_t k = 0; k < F; ++k) dst[r * F + k] = transposed ? slab[k * C + r] : slab[r * F + k];
      }
      return;
    case GptOssPart::down_bias:
      for (int64_t r = 0; r < C; ++r) dst[r] = slab[r];
      return;
  }
}

void write_gpt_oss_expert(const ModelConfig& c, const GptOssExpertRef& ref, const float* src, float* folder) {
  const int64_t C = c.d_model, F = c.expert_ff(), e = ref.expert;
  const int64_t per = shape_numel(gpt_oss_folder_shape(c, ref.part)) / c.moe_experts;
  float* slab = folder + e * per;
  switch (ref.part) {
    case GptOssPart::gate_up:  // (C, 2F), gate and up interleaved
      for (int64_t j = 0; j < 2 * F; ++j) {
        const int64_t to = j < F ? 2 * j : 2 * (j - F) + 1;
        for (int64_t k = 0; k < C; ++k) slab[k * 2 * F + to] = src[j * C + k];
      }
      return;
    case GptOssPart::gate_up_bias:
      for (int64_t j = 0; j < 2 * F; ++j) slab[j < F ? 2 * j : 2 * (j - F) + 1] = src[j];
      return;
    case GptOssPart::down:  // (F, C)
      for (int64_t r = 0; r < C; ++r) {
        for (int64_t k = 0; k < F; ++k) slab[k * C + r] = src[r * F + k];
      }
      return;
    case GptOssPart::down_bias:
      for (int64_t r = 0; r < C; ++r) slab[r] = src[r];
      return;
  }
}

}  // namespace loom
