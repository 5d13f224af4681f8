// Packed documents (data.document_mask, docs/finetune.md "Packing"): a micro-batch row holds
// several documents one after another, each ended by the dataset's end-of-text token. With
// document masking a position attends only to the earlier positions of its own document
// (block-diagonal causal attention) and its position (RoPE's angle, a learned position
// embedding) restarts at 0 where the document starts, so a packed row computes exactly what its
// documents would alone -- as Megatron-LM's reset_attention_mask / reset_position_ids and
// FlashAttention's variable-length ("cu_seqlens") interface do. The attention sub-layer runs
// once per span, on views of the row's positions (nn/attention.cpp).
#pragma once
#include <cstdint>
#include <vector>

namespace loom {

// Row `row`'s positions [begin, begin + length) are one document (or the part of one the row holds).
struct DocumentSpan {
  int64_t row = 0, begin = 0, length = 0;
  bool operator==(const DocumentSpan&) const = default;
};
using DocumentSpans = std::vector<DocumentSpan>;

// The spans of tokens (B, T), row-major: a document starts at position 0 of each row and after
// each `separator` (the separator is the last position of the document it ends). Every
// position is in exactly one span; spans are in row, then position, order. Empty when every
// row is a single span (nothing to mask: the plain causal computation).
inline DocumentSpans document_spans(const int32_t* tokens, int64_t batch, int64_t seq_len, int32_t separator) {
  DocumentSpans spans;
  bool split = false;
  for (int64_t b = 0; b < batch; ++b) {
    int64_t begin = 0;
    for (int64_t t = 0; t + 1 < seq_len; ++t) {
      if (tokens[b * seq_len + t] != separator) continue;
      spans.push_back({b, begin, t + 1 - begin});
      begin = t + 1;
      split = true;
    }
    spans.push_back({b, begin, seq_len - begin});
  }
  if (!split) spans.clear();
  return spans;
}

}  // namespace loom
