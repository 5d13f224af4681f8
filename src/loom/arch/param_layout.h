// Where every parameter lives in the flat parameter (and gradient, and optimizer-state)
// buffers. Derived once from the config; forward, backward, optimizer and checkpoint I/O all
// use these offsets. Names follow Hugging Face's where the layout allows (GPT-2: wte.weight,
// h.{i}.attn.c_attn.weight, ...; Llama: model.layers.{i}.self_attn.qkv_proj.weight, ...);
// every linear weight is stored (out_features, in_features). An MoE block's MLP is its router
// (E, C), its routing bias (E), expert e's two matrices (mlp.experts.{e}.*) and the shared
// experts' (one MLP of moe_shared x moe_d_ff), in that order: each expert contiguous.
#pragma once
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "loom/core/range_set.h"
#include "loom/core/tensor.h"
#include "loom/arch/config.h"

namespace loom {

enum ParamInit : uint8_t { INIT_NORMAL, INIT_ZEROS, INIT_ONES, INIT_COUNT };

// What a parameter is, for optimizers that treat kinds differently (Muon and LDAdam act on
// hidden matrices only; Adam-mini partitions by role).
enum ParamRole : uint8_t {
  ROLE_EMBEDDING,  // token / position embedding (V, C): one row per token
  ROLE_HIDDEN,     // a linear weight inside a block (out, in)
  ROLE_HEAD,       // the output projection (V, C) when untied
  ROLE_VECTOR,     // norm weights and biases
  ROLE_BUFFER,     // state kept with the weights but not trained (the MoE routing bias): learning rate 0
};

// A row range of a parameter that a PyTorch model would hold as its own matrix: Loom fuses
// Q/K/V and gate/up, the optimizer still sees the separate matrices. block_rows is the height
// of an Adam-mini block (Zhang et al. 2024): head_dim for Q and K (one block per head), 1 for
// every other matrix (one per output neuron or token). A 1-D parameter is one segment of 1 row.
struct ParamSegment {
  int64_t rows = 1;
  int64_t block_rows = 1;
};

struct ParamSpec {
  std::string name;
  Shape shape;
  int64_t offset = 0;   // into the flat buffer, in elements
  int64_t numel = 0;
  ParamRole role = ROLE_VECTOR;
  std::vector<ParamSegment> segments;  // rows sum to shape[0] (1 for a 1-D parameter)
  ParamInit init = INIT_NORMAL;
  float init_std = 0.0f;
};

struct ParamLayout {
  std::vector<ParamSpec> params;  // [param], in buffer order
  int64_t total = 0;

  const ParamSpec& find(const std::string& name) const;  // throws naming the parameter
};

ParamLayout build_param_layout(const ModelConfig& config);

// LoRA (config.lora()): one adapter per targeted linear layer of a block. It adds s B A x to
// the columns [out_begin, out_begin + out_count) of the layer's output; its parameters are
// `module`.lora_A.weight (r, in) and `module`.lora_B.weight (out_count, r), PEFT's names for
// the Hugging Face module it adapts (GPT-2: h.N.attn.c_attn; Llama: model.layers.N.self_attn.q_proj),
// and with DoRA (peft.dora) `module`.lora_magnitude_vector (out_count), PEFT's saved name.
// They follow every base parameter in the flat layout (block by block, in LoraTarget order),
// so the base keeps its offsets and initialisation and is the one range [0, lora_begin).
enum LoraLinear : uint8_t { LORA_ON_QKV, LORA_ON_PROJ, LORA_ON_FC, LORA_ON_FC2 };
struct LoraSite {
  LoraLinear linear = LORA_ON_QKV;
  std::string module;
  std::string weight;  // the base parameter it adds to (Loom's fused qkv_proj / gate_up_proj for q, k, v, gate, up)
  int64_t in = 0, out_begin = 0, out_count = 0;
};
std::vector<LoraSite> lora_sites(const ModelConfig& config, int64_t layer);
// The first adapter element (layout.total without adapters).
int64_t lora_begin(const ModelConfig& config, const ParamLayout& layout);

// The token embedding's parameter ("wte.weight", "model.embed_tokens.weight") and the output
// head's (the embedding's when the head is tied, else "lm_head.weight").
const char* embedding_param_name(const ModelConfig& config);
const char* head_param_name(const ModelConfig& config);

// GPT-2's four Conv1D matrices of a block (h.N.attn.c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj
// .weight): Hugging Face's GPT2LMHeadModel stores them (in, out), Loom (out, in).
bool is_gpt2_conv1d_weight(const std::string& name);

// The layout's units of parameter use, as flat ranges: [0] the embeddings and the final norm
// (+ untied head), two ranges; [l + 1] block l, one range (two with LoRA: its adapters). Pipeline stages own whole units.
std::vector<RangeSet> layout_units(const ModelConfig& config, const ParamLayout& layout);

}  // namespace loom
