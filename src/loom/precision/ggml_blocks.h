// ggml's legacy block quantizations Q8_0 and Q4_0, as GGUF files store them (ggml's
// ggml-common.h defines the blocks, ggml-quants.c their reference quantizers; the GGUF
// specification, ggml docs/gguf.md, lists the types). A row of n elements (n a multiple of 32)
// is n / 32 blocks, each:
//   Q8_0 (34 bytes): d (IEEE fp16, little-endian), then 32 int8 q[j]; x[j] = q[j] d.
//        d = amax / 127 over the block, q[j] = round(x[j] / d) (half away from zero).
//   Q4_0 (18 bytes): d (fp16), then 16 bytes; byte j holds element j in its low nibble and
//        element j + 16 in its high nibble; x[j] = (nibble - 8) d.
//        m = the element of largest magnitude (its sign kept, the first one on ties),
//        d = m / -8, nibble = min(15, trunc(x / d + 8.5)), so m itself maps to 0 (-8 d = m).
// The scale is computed in fp32, stored rounded to fp16 (nearest even); quantization divides by
// the fp32 scale, as ggml's reference does, and dequantization multiplies by the stored one.
#pragma once
#include <cstddef>
#include <cstdint>
#include <span>

namespace loom {

enum class GgmlBlock : uint8_t { Q8_0, Q4_0 };

inline constexpr int64_t kGgmlBlockElements = 32;
// Bytes of one block: 34 (Q8_0) or 18 (Q4_0).
size_t ggml_block_bytes(GgmlBlock type);
// Bytes of n elements (n a multiple of 32).
size_t ggml_blocks_size(GgmlBlock type, int64_t n);

// x (n, a multiple of 32; an Error otherwise) -> out (ggml_blocks_size bytes).
void ggml_quantize(GgmlBlock type, std::span<const float> x, std::span<uint8_t> out);
// blocks -> out (n floats, n = 32 x blocks).
void ggml_dequantize(GgmlBlock type, std::span<const uint8_t> blocks, std::span<float> out);

}  // namespace loom
