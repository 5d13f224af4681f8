// LoRA adapters on a linear layer (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large
// Language Models", eq. 3): the layer's output y = W x gains s B (A x) in the columns the
// adapter covers, with A (r, in), B (out, r) and s = alpha / r (alpha / sqrt(r) with rsLoRA,
// Kalajdzievski 2023). The frozen W is untouched: its gradient is not computed, only A's, B's
// and the input's. Llama-family layers fuse q/k/v and gate/up, so an adapter names its first
// output column (arch/param_layout.h lora_sites).
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "loom/arch/config.h"
#include "loom/backend/backend.h"
#include "loom/nn/linear.h"

namespace loom {

struct LoraAdapter {
  Tensor a, b;            // (r, in), (out_count, r): parameters, or their gradients
  int64_t out_begin = 0;  // first output column it adds to
  Tensor m;               // DoRA (peft.dora): the magnitude (out_count), or its gradient; else undefined
};
using LoraAdapters = std::vector<LoraAdapter>;

// peft.dropout: the adapters' input dropped out (PEFT's lora_dropout: y += s B A dropout(x)),
// each adapter of a site with its own mask, draw.stream + its index; p = 0: none (evaluation,
// decoding). The backward regenerates the masks from the same draw.
inline constexpr uint64_t kLoraDropoutSeed = 0x4C6F5241;  // "LoRA": the masks' Philox key

struct LoraDropout {
  float p = 0.0f;
  RoundingDraw draw;
  bool off = false;  // the pass skips the adapters: the base alone (ActivationStore::adapters_off)
  // The same pass's masks for the site `site` (0..3: q/k/v, o, gate/up, down) of a block: its
  // own streams, 4 apart (a site holds at most 3 adapters).
  LoraDropout at_site(uint32_t site) const {
    LoraDropout d = *this;
    d.draw.stream += 4 * site;
    return d;
  }
};

// y (.., W) += s B (A x) for each adapter, x (.., in). The scratch (A x, and an adapter's columns
// of a fused output) is the model's LinearWorkspace, slots A and C, free between linear layers'
// calls, so a training step allocates nothing; without one (a model used before set_precision)
// it is allocated per call.
//
// DoRA (Liu et al. 2024, "DoRA: Weight-Decomposed Low-Rank Adaptation", eq. 5, with the norm
// held constant in the backward as their sec. 4.3 and PEFT do): an adapter with a magnitude m
// makes its rows of the layer m_j V_j / ||V_j||, V = W + s B A, W the rows of the base weight
// `w` (out, in) it covers. As PEFT's DoRA layer, the base output stays and the adapter adds
// x_d C^T with C = g V - W, g_j = m_j / ||V_j|| (x_d: x, or its dropped-out copy), i.e.
// (g - 1) x_d W^T + g s B A x_d. With B = 0 and m = ||W|| (the initialisation) C is exactly 0,
// so the model starts as the base bit for bit. Scratch: slots C, D, E (V), F (C), G (norms).
void lora_forward(Backend& backend, const Tensor& x, const LoraAdapters& adapters, float scale, const Tensor& y,
                  LinearWorkspace* ws, const LoraDropout& dropout = {}, const Tensor& w = {}, bool dora_merged = false);
// With dy (.., W) the layer's output gradient: grads' b += s dy_cols^T (A x), grads' a += d^T x
// and dx (.., in) += d A, where d = s dy_cols B. A x is recomputed (r columns: cheap). Scratch:
// slots A, B and C of ws, as above. DoRA: dx += dy_cols C, dC = dy_cols^T x_d (slot B), then
// dm_j += dC_j . V_j / ||V_j||, dV = g dC, grads' b += s dV A^T and a += s B^T dV.
void lora_backward(Backend& backend, const Tensor& x, const LoraAdapters& params, const LoraAdapters& grads,
                   float scale, const Tensor& dy, const Tensor& dx, LinearWorkspace* ws, const LoraDropout& dropout = {},
                   const Tensor& w = {}, bool dora_merged = false);

// The weight a layer with DoRA adapters computes with (training passes): without dropout, and
// without a bf16 weight copy the layer would read instead, the whole merged weight -- W with each
// DoRA adapter's rows replaced by g V (workspace slot H) -- so the layer's own GEMMs give the
// adapted output and input gradient and the adapters add nothing in forward (dora_merged: pass
// it to lora_forward and lora_backward, whose backward then computes only the adapters'
// gradients). Otherwise w itself, and the adapters add their correction (above).
struct LoraWeight {
  Tensor w;
  bool dora_merged = false;
};
LoraWeight lora_layer_weight(Backend& backend, const Tensor& w, const Tensor& w16, const LoraAdapters& adapters,
                             float scale, const LoraDropout& dropout, LinearWorkspace* ws);

// One linear layer's adapters, their scale and this pass's dropout, as the layer helpers of
// nn/layer.h take them. adapters null: none.
struct LoraTerm {
  const LoraAdapters* adapters = nullptr;
  float scale = 0.0f;
  LoraDropout dropout;
};

// Merging (Hu et al. 2021, sec. 4.1: no inference latency): `merged` (the base layout's
// lora_begin elements) = the base weights of `params` with each adapted weight's rows
// W[out_begin : out_begin + out_count] += s B A (DoRA: then row j scaled by m_j / its norm). `params` itself is not changed: the unmerged
// model is the base, bit for bit.
void lora_merge(Backend& backend, const ModelConfig& config, const Tensor& params, const Tensor& merged);
// The same for one base weight: `w` (its shape, holding W) gets the merge of every adapter on
// it, `adapter` giving an adapter parameter (lora_A, lora_B, the magnitude) by its layout name.
// What an export merging one weight at a time uses (train/model_export.h).
void lora_merge_weight(Backend& backend, const ModelConfig& config, const std::string& weight,
                       const std::function<Tensor(const std::string&)>& adapter, const Tensor& w);
// The base weights that carry adapters (each once), in layer order.
std::vector<std::string> lora_merged_weights(const ModelConfig& config);
// DoRA's initial magnitudes: each adapter's m = the norms of the base rows it covers (so the
// adapted model starts as the base), from the base weights of `params` (the whole layout).
void dora_init_magnitudes(Backend& backend, const ModelConfig& config, const Tensor& params);
// The model config without its adapters (peft.method = none): the merged model's.
ModelConfig lora_base_config(const ModelConfig& config);

}  // namespace loom
