// Writing KV-cache rows in their storage formats (the formats, their byte layout and reading
// them back: backend/kv_format.h). m is rounded down and s up to fp16 through precision/formats.h.
#pragma once
#include <cstdint>

#include "loom/backend/kv_format.h"

namespace loom {

// x (tokens, width) fp32 -> out (kv_tile_bytes(spec, tokens) bytes), in the layout of
// backend/kv_format.h. Throws for non-finite values or values outside fp16's range.
void kv_quantize_tile(const KvQuantSpec& spec, const float* x, int64_t tokens, uint8_t* out);

}  // namespace loom
