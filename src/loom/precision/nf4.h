// NF4 with double quantization: the storage format of QLoRA's frozen base weights (Dettmers et
// al. 2023, "QLoRA: Efficient Finetuning of Quantized LLMs", sec. 3 "4-bit NormalFloat" and
// "Double Quantization"; docs/finetune.md "QLoRA's NF4 storage").
//
// Codes. NF4 is 16 values in [-1, 1]: the quantiles of N(0, 1) normalised to absmax 1, with 8
// positive values, 7 negative ones and an exact 0 (sec. 3: 2^(k-1) quantiles for the negative
// side and 2^(k-1) + 1 for the positive side, one of the two zeros removed). kNf4Codes is the
// table as the paper's Appendix E and bitsandbytes print it; nf4_construct_codes rebuilds it.
//
// Quantization of a tensor of n elements, flat in row-major order:
//   - blocks of 64 consecutive elements (the last one shorter when 64 does not divide n: the
//     tail block, with its own absmax over its own elements); block b's absmax c_b = max |x|
//     (f32), and each element's normalised value v = x / c_b (IEEE f32 division; v = 0 when
//     c_b = 0) goes to the nearest code, a tie to the lower code (exact distances: v against
//     the exact midpoints of neighbouring codes). The block's largest element is +-1 exactly, a
//     zero is the 0 code exactly.
//   - 2 codes per byte: byte i holds element 2i in its high nibble and 2i + 1 in its low one
//     (bitsandbytes' order); when n is odd the last low nibble is 0 and never read.
// Double quantization of the B = ceil(n / 64) absmax values c_b (sec. 3 "Double Quantization":
// the first-level constants are quantized again, with blocks of 256, after subtracting their
// mean, since they are positive):
//   - mean = f32(sum_b c_b / B), the sum in double in block order (one mean per tensor, as
//     bitsandbytes' nested statistics; 0 when n = 0);
//   - per group g of 256 consecutive blocks (the last one shorter): d_b = c_b - mean (f32),
//     step_g = max_b |d_b| / 127 (f32), q_b = rint(d_b / step_g) (ties to even, in [-127, 127];
//     q_b = 0 when step_g = 0) stored as int8;
//   - c^_b = f32(q_b step_g + mean) computed in double (backend.h nf4_block_absmax): the scale
//     the elements are dequantized with, x^ = code[k] c^_b (one f32 product).
// The 8-bit code is symmetric int8 absmax with a per-group f32 step, not the FP8 / dynamic
// 8-bit map of the paper and bitsandbytes: simple and exactly specified, so that an independent
// PyTorch implementation (tools/nf4_reference.py) matches it bit for bit. The error it adds to a
// scale is at most step_g / 2 (plus the final f32 rounding).
//
// Storage: ceil(n / 2) code bytes + B int8 scale codes + 4 ceil(B / 256) bytes of steps + 4 of
// the mean; for n a multiple of 64 x 256, bits per parameter = 4 + 8/64 + 32/(64 256) + 32/n
// ~= 4.127 (the paper's 0.127 bits of overhead; 4.5 without double quantization).
#pragma once
#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "loom/backend/backend.h"

namespace loom {

// The NF4 code values, ascending (QLoRA Appendix E; bitsandbytes' NF4 table), as float32.
inline constexpr std::array<float, 16> kNf4Codes = {
    -1.0f,
    -0.6961928009986877f,
    -0.5250730514526367f,
    -0.39491748809814453f,
    -0.28444138169288635f,
    -0.18477343022823334f,
    -0.09105003625154495f,
    0.0f,
    0.07958029955625534f,
    0.16093020141124725f,
    0.24611230194568634f,
    0.33791524171829224f,
    0.44070982933044434f,
    0.5626170039176941f,
    0.7229568362236023f,
    1.0f};
inline constexpr int kNf4ZeroCode = 7;  // kNf4Codes[7] == 0

// The inverse of the standard normal CDF, Phi^-1(p) for 0 < p < 1, in double (Newton's method
// on Phi(x) = erfc(-x / sqrt 2) / 2).
double normal_quantile(double p);

// The codes built from the quantiles (sec. 3): with delta = 0.9677083 (the mean of 1 - 1/(2 15)
// and 1 - 1/(2 16), the outermost probabilities of 15 and 16 quantiles, to 7 digits as
// bitsandbytes uses it), 9 probabilities evenly spaced from delta down to 1/2 give the 8
// positive values Phi^-1(p) (1/2, giving 0, dropped), 8 of them give the 7 negative values
// -Phi^-1(p), plus 0, all divided by Phi^-1(delta). The table was computed with the
// probabilities in float32 (torch.linspace's: from each end toward the middle) and the values
// rounded to float32 before the division; done the same way this gives kNf4Codes bit for bit.
std::array<float, 16> nf4_construct_codes();

// The index of the code nearest to v, a tie going to the lower code (v in [-1, 1]).
int nf4_nearest_code(float v);

// A weight in NF4 with double-quantized scales.
struct Nf4Tensor {
  int64_t rows = 0, cols = 0;             // the weight's row-major shape
  std::vector<uint8_t> codes;             // ceil(n / 2): element 2i high nibble, 2i + 1 low nibble
  std::vector<int8_t> absmax_codes;       // q_b, one per block of 64
  std::vector<float> absmax_steps;        // step_g, one per 256 blocks
  float absmax_mean = 0.0f;               // the offset subtracted before the 8-bit quantization

  int64_t numel() const { return rows * cols; }
  // Bytes stored: codes + scale codes + steps + the mean (nf4_bytes(numel())).
  size_t bytes() const;
  double bits_per_parameter() const;  // 8 bytes() / numel()
  // c^_b, the dequantized absmax of block b.
  float block_absmax(int64_t block) const;
  // The backend op's constants (Backend::nf4_dequantize).
  Nf4Spec spec() const;
};

// The storage formula: ceil(n / 2) + B + 4 ceil(B / 256) + 4 bytes, B = ceil(n / 64).
size_t nf4_bytes(int64_t numel);

// First level: codes (ceil(n / 2) bytes) and each block's f32 absmax (ceil(n / 64)). An Error
// when x holds inf or NaN. OpenMP over blocks.
void nf4_encode(std::span<const float> x, std::span<uint8_t> codes, std::span<float> absmax);

// Second level: the absmax values' int8 codes, steps and mean.
struct Nf4Scales {
  std::vector<int8_t> codes;
  std::vector<float> steps;
  float mean = 0.0f;
};
Nf4Scales nf4_double_quantize(std::span<const float> absmax);

// Both levels: x (rows, cols) row-major.
Nf4Tensor nf4_quantize(std::span<const float> x, int64_t rows, int64_t cols);

// Elements [first, first + out.size()) of the flat weight, from the codes and f32 block scales
// (the single-quantized form: nf4_encode's absmax, or the c^_b of double quantization).
void nf4_decode(std::span<const uint8_t> codes, std::span<const float> absmax, int64_t first, std::span<float> out);
// Elements [first, first + out.size()) of t (the whole tensor: first 0, numel() elements);
// rows [row0, row0 + out.size() / cols) with first = row0 cols, the on-the-fly use.
void nf4_dequantize(const Nf4Tensor& t, int64_t first, std::span<float> out);

// The absmax and codes of t in tensors of `backend` (u8, u8, f32), for Backend::nf4_dequantize.
struct Nf4Device {
  Tensor codes, absmax_codes, absmax_steps;
  Nf4Spec spec;
};
Nf4Device nf4_to_backend(const Nf4Tensor& t, Backend& backend, MemCategory category);

}  // namespace loom
