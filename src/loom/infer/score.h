// Scoring a long sequence in bounded memory (`loom eval --text` with windows longer than a
// chunk): the next-token loss at every position, with the positions fed `chunk` at a time through
// Transformer::forward_rows (as the generation engine prefills a long prompt, infer/engine.h
// "Chunked prefill"), each chunk's rows attending to the sequence's earlier positions through a
// one-sequence fp32 KV cache and to the chunk's rows up to themselves (a sliding window's visible
// positions only): per kv head and tile of keys two GEMMs, the scores of the chunk's queries over
// the tile's keys (masked, an online softmax in fp32) and their product with the values
// (infer/chunk_attention.h). Logits are computed for one chunk's rows at a time. Memory: the
// cache (2 x layers x T x n_kv_head x head_dim floats), the attention's scratch (the chunk's
// queries and outputs, one tile's scores) and one chunk's rows of activations and logits,
// whatever T is; the whole-sequence forward holds every position's activations and T x
// vocab logits. llama.cpp's perplexity tool feeds n_batch tokens a decode the same way.
#pragma once
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "loom/model/transformer.h"

namespace loom {

struct SequenceLoss {
  double sum = 0.0;   // sum over the scored positions of -log p(token t+1 | tokens ..t), nats
  int64_t count = 0;  // positions scored: tokens.size() - 1
};

// Whether score_tokens runs this model: MHA / GQA / MQA blocks (MLA's latent cache is the
// engine's), not a tensor-parallel slice.
bool can_score_in_chunks(const ModelConfig& config);

// The loss of tokens[t + 1] given tokens[0 .. t] for every t < tokens.size() - 1 (at least two
// tokens, at most model.max_seq_len + 1), `chunk` >= 1 positions a forward.
SequenceLoss score_tokens(Transformer& model, std::span<const int32_t> tokens, int64_t chunk);

// `loom eval --text`: the mean next-token loss over the consecutive windows of T tokens of `ids`
// (as llama.cpp's perplexity tool: the text cut into windows, each scored from its own start).
// Windows of at most chunk + 1 tokens run the whole forward, B windows at once; longer ones
// (where can_score_in_chunks) go through score_tokens, one window at a time. `what` names the
// text in errors.
struct WindowsLoss {
  double loss = 0.0;  // the mean over windows of each window's mean loss
  int64_t tokens = 0, windows = 0, window = 0;
  bool chunked = false;  // through score_tokens
};
WindowsLoss score_windows(Transformer& model, const std::vector<int32_t>& ids, int64_t T, int64_t B, int64_t chunk,
                          const std::string& what);

// The bytes score_tokens holds beside the weights and the model's store of `chunk` rows (its
// activations, ActivationStore's allocation, in the backend's tracker) for a sequence of
// `tokens`: its KV cache, the host copy of a chunk's logits and the attention's scratch.
struct ScoreBytes {
  int64_t kv = 0, logits = 0, scores = 0;
  int64_t total() const { return kv + logits + scores; }
};
ScoreBytes score_bytes(const ModelConfig& config, int64_t tokens, int64_t chunk);

}  // namespace loom
