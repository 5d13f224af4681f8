// A Loom model as a GGUF file llama.cpp runs (docs/gguf.md): architecture metadata under
// llama.cpp's keys, the tensors under its names and layouts, and the tokenizer inside the file.
// The names and keys follow llama.cpp's gguf-py/gguf/constants.py (MODEL_ARCH.GPT2 / LLAMA,
// Keys.LLM / Keys.Attention / Keys.Rope / Keys.Tokenizer, MODEL_TENSOR names) and the layouts
// its convert_hf_to_gguf.py writes for Hugging Face GPT-2 and Llama:
//   - every linear weight is (out, in) row-major, ggml ne = [in, out]. Loom keeps (out, in) for
//     GPT-2's Conv1D matrices too, so none is transposed (Hugging Face's (in, out) Conv1D are
//     transposed by the converter to this same layout);
//   - GPT-2 keeps the fused [q | k | v] projection (blk.N.attn_qkv) and ties the head to
//     token_embd (no output.weight; llama.cpp falls back to token_embd);
//   - Llama's fused qkv_proj is split into attn_q / attn_k / attn_v and gate_up_proj into
//     ffn_gate / ffn_up. Loom's RoPE rotates the pairs (j, j + hd/2) of a head (rotate-half, as
//     Hugging Face's Llama), llama.cpp's LLM_ARCH_LLAMA (rope type NORM) the pairs (2j, 2j + 1),
//     so q and k rows are permuted per head: GGUF row 2j + c = Loom row c hd/2 + j (c = 0, 1),
//     the permutation convert_hf_to_gguf.py applies to Hugging Face checkpoints.
// Refused, naming the key: MoE and MLA models, sliding-window attention, q/k/v biases, a head
// width other than d_model / n_head for GPT-2, a tokenizer whose size differs from model.vocab_size.
#pragma once
#include <array>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "loom/arch/config.h"
#include "loom/checkpoint/gguf_vocab.h"  // GgufVocabulary, gguf_vocabulary: the tokenizer inside the file
#include "loom/checkpoint/param_reader.h"
#include "loom/core/enum_names.h"

namespace loom {

// The tensor type of the file's matrices (1-D tensors, norms and biases, stay f32, as
// convert_hf_to_gguf.py keeps them; so does a matrix whose rows are not a multiple of 32 wide).
enum class GgufExportType : uint8_t { F32, F16, BF16, Q8_0, Q4_0 };
template <>
struct EnumNames<GgufExportType> {
  static constexpr std::array<std::string_view, 5> names{"f32", "f16", "bf16", "q8_0", "q4_0"};
};

struct GgufExportSummary {
  std::string architecture;  // general.architecture: gpt2, llama or qwen2
  int64_t tensors = 0;
  int64_t converted = 0;  // matrices stored in the requested type
  uint64_t bytes = 0;     // file size
};

// Writes the parameters of `params` (its config's, read one tensor at a time while the file is
// written: the peak is one parameter in f32 and its encoded bytes) as `path`, atomically.
GgufExportSummary export_gguf(ParamReader& params, const GgufVocabulary& vocab, GgufExportType type,
                              const std::string& name, const std::string& path);
// The same from `params`, the flat f32 buffer of `config` (ParamLayout order).
GgufExportSummary export_gguf(const ModelConfig& config, std::span<const float> params, const GgufVocabulary& vocab,
                              GgufExportType type, const std::string& name, const std::string& path);

}  // namespace loom
