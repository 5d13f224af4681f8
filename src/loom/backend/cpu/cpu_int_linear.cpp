// The CPU kernels of Backend::int_linear and int_dequantize (the contract in backend.h, the
// packing in precision/int_quant.h). Every format multiplies with the input quantized to int8 per
// row and group (q_x = round(x / s_x), s_x = max |x| / 127, as llama.cpp's q8_0 activations), and
// sums code times input code in int32, exactly:
// - on CPUs with AVX512-VNNI (Zen 4/5, Ice Lake and later) with vpdpbusd, 32 codes at a time
//   (weight_only_vnni; int4_vnni_blocks, 128 at a time, for 4-bit groups of 32 or multiples of 128);
// - elsewhere with AVX2 (x86-64-v3, Loom's baseline; weight_only_avx2, and int4_avx2_pairs, 64
//   codes at a time, for 4-bit groups of 32): _mm256_maddubs_epi16 of the u8 codes and the s8
//   inputs, then _mm256_madd_epi16 to int32. maddubs adds pairs in int16 with saturation, which
//   4- and 3-bit codes cannot reach (2 x 15 x 127 < 2^15); 8-bit codes are taken as c - 128 in s8
//   and multiplied as |c - 128| times the input with c - 128's sign (2 x 128 x 127 < 2^15;
//   llama.cpp's q8_0 dot product does the same), the 128 going into the zero point's term.
//   Before, the AVX2 kernel widened the codes to f32 and ran FMAs: compute-bound at 4 bits
//   (docs/compression.md and docs/performance.md give the figures on an AVX2-only CPU).
// Per group: acc += s_w s_x (sum_c q_x q_w) and, outside the loop, y -= s_w z s_x sum_c q_x, the
// zero point's term from each input row's group sums. The sums are in a fixed order per output,
// so results do not depend on the thread count.
//
// With an input scale (AWQ, SmoothQuant) int_linear multiplies a copy of x by it and
// int_dequantize multiplies the weight's columns by it. W8A8 (SmoothQuant) is the 8-bit format
// with one group per row. OpenMP splits the output rows (static schedule), or a decoding step's
// short-region team.
//
// Group parameters are f32 scales and u8 zero points, or compact as the checkpoint stores them
// (BackendCapabilities::compact_int_weights): f16 scales, widened one row at a time into the
// thread's buffer before the row's kernel runs (F16C), and no zeros for symmetric weights, whose
// zero point is 2^(b - 1) in every group. Both give the same numbers bit for bit; the compact
// ones read 2 bytes a group instead of 5 (8B at 4 bits, groups of 32: 18 bytes per 32 codes
// instead of 21).
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "loom/backend/cpu/cpu_avx2.h"
#include "loom/backend/cpu/cpu_math.h"
#include "loom/backend/cpu/cpu_quant_ops.h"
#include "loom/core/error.h"
#include "loom/core/threads.h"

namespace loom::cpu {
namespace {

constexpr int kRowBlock = 4;  // input rows multiplied with one decoded chunk of codes
constexpr int64_t kShortRegionRows = 16;  // input rows up to which a call is a short region (decoding)

int64_t row_bytes(int bits, int64_t cols) { return bits == 8 ? cols : (bits == 4 ? cols / 2 : cols / 8 * 3); }

inline __m256 u8_to_f32(__m128i bytes8) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes8)); }

// Each row's codes are fetched this many bytes ahead of the loads (_mm_prefetch never faults, past
// the row it fetches the next one's): the hardware prefetcher alone stops at page boundaries.
// Measured on a Llama-3.2-1B-shaped int4 model (group 32, f16 scales), 2-core AMD EPYC with
// AVX512-VNNI, decode tokens/s: 1 thread 36-39 -> 41-43 (2 KiB: 38-40), 2 threads 42-43 -> 48.
constexpr int64_t kCodePrefetch = 4096;

// The 32 codes of columns [c, c + 32) as two vectors of 16 bytes (columns c .. c + 15 and
// c + 16 .. c + 31). 3 bits: BMI2's pdep spreads each 24-bit group of 8 codes into 8 bytes.
template <int BITS>
inline void chunk_codes(const uint8_t* row, int64_t c, __m128i& lo, __m128i& hi) {
  _mm_prefetch(reinterpret_cast<const char*>(row + c * BITS / 8 + kCodePrefetch), _MM_HINT_T0);
  if constexpr (BITS == 8) {
    lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + c));
    hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + c + 16));
  } else if constexpr (BITS == 4) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + c / 2));
    const __m128i mask = _mm_set1_epi8(0x0F);
    lo = _mm_and_si128(b, mask), hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
  } else {
    const uint8_t* chunk = row + c / 8 * 3;
    uint64_t v[4];
    for (int k = 0; k < 4; ++k) {
      const uint32_t bits24 = chunk[3 * k] | (uint32_t{chunk[3 * k + 1]} << 8) | (uint32_t{chunk[3 * k + 2]} << 16);
      v[k] = _pdep_u64(bits24, 0x0707070707070707ull);
    }
    lo = _mm_set_epi64x(static_cast<int64_t>(v[1]), static_cast<int64_t>(v[0]));
    hi = _mm_set_epi64x(static_cast<int64_t>(v[3]), static_cast<int64_t>(v[2]));
  }
}

// A row's zero points: u8 per group, or one value for every group (p == nullptr); the kernels
// whose sums are of c - offset rather than of the codes c take z - offset.
struct ZeroPoints {
  const uint8_t* p;
  float z;
  float offset = 0.0f;
};

// A weight's group parameters as the kernels read them, one output row at a time.
struct GroupRows {
  const float* f32 = nullptr;      // f32 scales (rows, groups), or
  const uint16_t* f16 = nullptr;   // f16 scales
  const uint8_t* zeros = nullptr;  // u8 zero points (rows, groups), or none: every group's is `zero`
  float zero = 0.0f;
  int64_t groups = 0;

  // Row o's scales in f32: the tensor's own, or the f16 row widened into buf (groups floats).
  const float* scales(int64_t o, float* buf) const {
    if (f32 != nullptr) return f32 + o * groups;
    const uint16_t* h = f16 + o * groups;
    int64_t g = 0;
    for (; g + 8 <= groups; g += 8) _mm256_storeu_ps(buf + g, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + g))));
    for (; g < groups; ++g) buf[g] = _cvtsh_ss(h[g]);
    return buf;
  }
  ZeroPoints zero_points(int64_t o) const { return {zeros != nullptr ? zeros + o * groups : nullptr, zero}; }
};

// The zero points' term of one output row against NR input rows: out[r] = sum_g s_g z_g u_{r,g},
// u = t q (t: the input's per-group scale, q its codes' group sum; int_linear forms u once per
// call, rows `groups` apart). Four accumulators of 8 groups each: one chained the FMA's latency
// (in an 8B model's int4 decoding this loop was a sixth of the kernel's time, waiting on it).
// Every group's z - offset 0 (symmetric 8-bit codes under the AVX2 kernel) makes each term 0:
// none is read. A constant z multiplies the sum once.
template <int NR>
void zero_terms(int64_t groups, const float* scales, ZeroPoints zeros, const float* u_all, int64_t n0, float* out) {
  if (zeros.p == nullptr && zeros.z == zeros.offset) {
    for (int r = 0; r < NR; ++r) out[r] = 0.0f;
    return;
  }
  const auto rows = [&](auto per_group) {  // per_group: u8 zero points, else one z for every group
    const __m256 offset = _mm256_set1_ps(zeros.offset);
    const auto weight = [&](int64_t g) {  // s_g (z_g - offset), or s_g for a constant z
      const __m256 s = _mm256_loadu_ps(scales + g);
      if constexpr (!decltype(per_group)::value) return s;
      const __m128i z8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(zeros.p + g));
      return _mm256_mul_ps(s, _mm256_sub_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(z8)), offset));
    };
    for (int r = 0; r < NR; ++r) {
      const float* u = u_all + (n0 + r) * groups;
      __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
      int64_t g = 0;
      for (; g + 32 <= groups; g += 32) {
        for (int k = 0; k < 4; ++k) acc[k] = _mm256_fmadd_ps(weight(g + 8 * k), _mm256_loadu_ps(u + g + 8 * k), acc[k]);
      }
      for (; g + 8 <= groups; g += 8) acc[0] = _mm256_fmadd_ps(weight(g), _mm256_loadu_ps(u + g), acc[0]);
      float sum = hsum(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])));
      for (; g < groups; ++g) {  // std::fma: the same rounding in every inlined copy
        const float w = decltype(per_group)::value ? scales[g] * (static_cast<float>(zeros.p[g]) - zeros.offset) : scales[g];
        sum = std::fma(w, u[g], sum);
      }
      out[r] = decltype(per_group)::value ? sum : sum * (zeros.z - zeros.offset);
    }
  };
  if (zeros.p != nullptr) rows(std::true_type{});
  else rows(std::false_type{});
}

// sum_c code_c q_c over 32 columns into acc's 8 int32 lanes, AVX2 (see the top of the file): for
// 4 and 3 bits the codes themselves, for 8 bits c - 128 (the caller's zero points take the 128).
template <int BITS>
inline __m256i dot32_avx2(__m256i acc, __m256i codes, __m256i xq) {
  __m256i pairs;
  if constexpr (BITS == 8) {
    const __m256i w = _mm256_xor_si256(codes, _mm256_set1_epi8(static_cast<char>(0x80)));  // c - 128 as s8
    pairs = _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(xq, w));
  } else {
    pairs = _mm256_maddubs_epi16(codes, xq);
  }
  return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}

template <int BITS, int NR>
inline void avx2_group(const int8_t* xq, int64_t K, int64_t n0, const uint8_t* row, const float* scales, const float* xs,
                       int64_t group, int64_t groups, int64_t g, __m256 (&total)[NR]) {
  __m256i acc[NR];
  for (int r = 0; r < NR; ++r) acc[r] = _mm256_setzero_si256();
  for (int64_t c = g * group; c < (g + 1) * group; c += 32) {
    __m128i lo, hi;
    chunk_codes<BITS>(row, c, lo, hi);
    const __m256i codes = _mm256_set_m128i(hi, lo);
    for (int r = 0; r < NR; ++r) {
      acc[r] = dot32_avx2<BITS>(acc[r], codes, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + (n0 + r) * K + c)));
    }
  }
  for (int r = 0; r < NR; ++r) {
    total[r] = _mm256_fmadd_ps(_mm256_set1_ps(scales[g] * xs[(n0 + r) * groups + g]), _mm256_cvtepi32_ps(acc[r]), total[r]);
  }
}

// One output row o against NR input rows [n0, n0 + NR), AVX2: out[r] = sum_g s_w s_x (sum_c q_x q_w
// - z sum_c q_x). Four groups in flight, as weight_only_vnni below.
template <int BITS, int NR>
void weight_only_avx2(const int8_t* xq, int64_t K, int64_t n0, const uint8_t* row, const float* scales, ZeroPoints zeros,
                      int64_t group, const float* xs, const float* xu, float* out) {
  const int64_t groups = K / group;
  __m256 t0[NR], t1[NR], t2[NR], t3[NR];
  for (int r = 0; r < NR; ++r) t0[r] = t1[r] = t2[r] = t3[r] = _mm256_setzero_ps();
  int64_t g = 0;
  for (; g + 4 <= groups; g += 4) {
    avx2_group<BITS, NR>(xq, K, n0, row, scales, xs, group, groups, g, t0);
    avx2_group<BITS, NR>(xq, K, n0, row, scales, xs, group, groups, g + 1, t1);
    avx2_group<BITS, NR>(xq, K, n0, row, scales, xs, group, groups, g + 2, t2);
    avx2_group<BITS, NR>(xq, K, n0, row, scales, xs, group, groups, g + 3, t3);
  }
  for (; g < groups; ++g) avx2_group<BITS, NR>(xq, K, n0, row, scales, xs, group, groups, g, t0);
  if constexpr (BITS == 8) zeros.offset = 128.0f;
  float zero_term[NR];
  zero_terms<NR>(groups, scales, zeros, xu, n0, zero_term);
  for (int r = 0; r < NR; ++r) {
    out[r] = hsum(_mm256_add_ps(_mm256_add_ps(t0[r], t1[r]), _mm256_add_ps(t2[r], t3[r]))) - zero_term[r];
  }
}

// 4-bit codes in groups of 32, 64 columns at a time (AVX2: one 32-byte load of 2 chunks), K a
// multiple of 64. The input's int8 codes are stored permuted per block of 64 columns
// (input_block 64) so that the low nibbles of the 32 bytes meet its first 32 bytes and the high
// nibbles its second: two maddubs (pairs at most 2 x 15 x 127, their sum at most 7,620: int16
// holds it) and one madd give the two groups' sums in the two 128-bit lanes, scaled by their
// s_w s_x at once. About 16 instructions per 64 codes where avx2_group spends about 13 per 32.
template <int NR>
void int4_avx2_pairs(const int8_t* xp, int64_t K, int64_t n0, const uint8_t* row, const float* scales, ZeroPoints zeros,
                     int64_t group, const float* xs, const float* xu, float* out) {
  const int64_t groups = K / group;
  const __m256i mask = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  const __m256i spread = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
  __m256 t0[NR], t1[NR];
  for (int r = 0; r < NR; ++r) t0[r] = t1[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < K; b += 64) {
    _mm_prefetch(reinterpret_cast<const char*>(row + b / 2 + kCodePrefetch), _MM_HINT_T0);
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + b / 2));
    const __m256i lo = _mm256_and_si256(v, mask), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
    const int64_t g = b / 32;  // the block's two groups
    for (int r = 0; r < NR; ++r) {
      const int8_t* xb = xp + (n0 + r) * K + b;
      const float* xsr = xs + (n0 + r) * groups;
      const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb))),
                                         _mm256_maddubs_epi16(hi, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb + 32))));
      const __m128 f2 = _mm_mul_ps(_mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(scales + g))),
                                   _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(xsr + g))));
      const __m256 f = _mm256_permutevar8x32_ps(_mm256_zextps128_ps256(f2), spread);
      const __m256 sums = _mm256_cvtepi32_ps(_mm256_madd_epi16(p, ones));
      if ((b / 64) % 2 == 0) t0[r] = _mm256_fmadd_ps(f, sums, t0[r]);
      else t1[r] = _mm256_fmadd_ps(f, sums, t1[r]);
    }
  }
  float zero_term[NR];
  zero_terms<NR>(groups, scales, zeros, xu, n0, zero_term);
  for (int r = 0; r < NR; ++r) out[r] = hsum(_mm256_add_ps(t0[r], t1[r])) - zero_term[r];
}

// The same with AVX512-VNNI: sum_c q_x q_w runs in int32 with vpdpbusd (u8 codes times s8 inputs,
// 32 per instruction, no intermediate saturation);
// out += s_w s_x (sum q_x q_w - z sum q_x) per group. Four groups are in flight at a time, each
// scaled into its own f32 accumulator: one group after the other chained the vpdpbusd latency
// (5 cycles) and the FMA's (4), so the loop ran at a chunk of 32 codes per 4-6 cycles, half
// llama.cpp's q4_0 speed on one core.
template <int BITS, int NR>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,bmi2"), always_inline)) inline void vnni_group(
    const int8_t* xq, int64_t K, int64_t n0, const uint8_t* row, const float* scales, const float* xs, int64_t group,
    int64_t groups, int64_t g, __m256 (&total)[NR]) {
  __m256i acc[NR];
  for (int r = 0; r < NR; ++r) acc[r] = _mm256_setzero_si256();
  for (int64_t c = g * group; c < (g + 1) * group; c += 32) {
    __m128i lo, hi;
    chunk_codes<BITS>(row, c, lo, hi);
    const __m256i codes = _mm256_set_m128i(hi, lo);
    for (int r = 0; r < NR; ++r) {
      acc[r] = _mm256_dpbusd_epi32(acc[r], codes, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + (n0 + r) * K + c)));
    }
  }
  for (int r = 0; r < NR; ++r) {
    total[r] = _mm256_fmadd_ps(_mm256_set1_ps(scales[g] * xs[(n0 + r) * groups + g]), _mm256_cvtepi32_ps(acc[r]), total[r]);
  }
}

template <int BITS, int NR>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,bmi2"))) void weight_only_vnni(
    const int8_t* xq, int64_t K, int64_t n0, const uint8_t* row, const float* scales, ZeroPoints zeros, int64_t group,
    const float* xs, const float* xu, float* out) {
  const int64_t groups = K / group;
  __m256 t0[NR], t1[NR], t2[NR], t3[NR];
  for (int r = 0; r < NR; ++r) t0[r] = t1[r] = t2[r] = t3[r] = _mm256_setzero_ps();
  int64_t g = 0;
  for (; g + 4 <= groups; g += 4) {
    vnni_group<BITS, NR>(xq, K, n0, row, scales, xs, group, groups, g, t0);
    vnni_group<BITS, NR>(xq, K, n0, row, scales, xs, group, groups, g + 1, t1);
    vnni_group<BITS, NR>(xq, K, n0, row, scales, xs, group, groups, g + 2, t2);
    vnni_group<BITS, NR>(xq, K, n0, row, scales, xs, group, groups, g + 3, t3);
  }
  for (; g < groups; ++g) vnni_group<BITS, NR>(xq, K, n0, row, scales, xs, group, groups, g, t0);
  float zero_term[NR];
  zero_terms<NR>(groups, scales, zeros, xu, n0, zero_term);
  for (int r = 0; r < NR; ++r) {
    out[r] = hsum(_mm256_add_ps(_mm256_add_ps(t0[r], t1[r]), _mm256_add_ps(t2[r], t3[r]))) - zero_term[r];
  }
}

// 4-bit codes 128 columns at a time (AVX-512: one 64-byte load of 4 chunks), for groups of 32 or a
// multiple of 128 and K a multiple of 128. The input's int8 codes are stored permuted per block of
// 128 columns (input_block 128), so that the low nibbles of the 64 bytes meet its first half and
// the high nibbles its second: two vpdpbusd give the 4 chunks' sums in the 4 lanes of 128 bits,
// scaled by their groups' s_w s_x at once. About 14 instructions per 128 codes where the 32-column
// kernel spends about 16 per 32 (measured on Llama-3-8B's shapes, one core: 13 GB/s of codes
// before, int_linear_bench).
// (GCC 12 warns of the _mm512_undefined_ps inside its own AVX-512 intrinsics' headers.)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
template <int NR>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,bmi2"))) void int4_vnni_blocks(
    const int8_t* xp, int64_t K, int64_t n0, const uint8_t* row, const float* scales, ZeroPoints zeros,
    int64_t group, const float* xs, const float* xu, float* out) {
  const int64_t groups = K / group;
  const __m512i mask = _mm512_set1_epi8(0x0F);
  const __m512i spread = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
  __m512 t0[NR], t1[NR];
  for (int r = 0; r < NR; ++r) t0[r] = t1[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < K; b += 128) {
    _mm_prefetch(reinterpret_cast<const char*>(row + b / 2 + kCodePrefetch), _MM_HINT_T0);
    const __m512i v = _mm512_loadu_si512(row + b / 2);
    const __m512i lo = _mm512_and_si512(v, mask), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), mask);
    const int64_t g = b / group;  // the block's first group (groups of 32: its 4 groups from here)
    for (int r = 0; r < NR; ++r) {
      const int8_t* xb = xp + (n0 + r) * K + b;
      const float* xsr = xs + (n0 + r) * groups;
      const __m128 f4 = group == 32 ? _mm_mul_ps(_mm_loadu_ps(scales + g), _mm_loadu_ps(xsr + g))
                                    : _mm_set1_ps(scales[g] * xsr[g]);
      __m512i acc = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, _mm512_loadu_si512(xb));
      acc = _mm512_dpbusd_epi32(acc, hi, _mm512_loadu_si512(xb + 64));
      const __m512 f = _mm512_permutexvar_ps(spread, _mm512_zextps128_ps512(f4));
      if ((b / 128) % 2 == 0) t0[r] = _mm512_fmadd_ps(f, _mm512_cvtepi32_ps(acc), t0[r]);
      else t1[r] = _mm512_fmadd_ps(f, _mm512_cvtepi32_ps(acc), t1[r]);
    }
  }
  float zero_term[NR];
  zero_terms<NR>(groups, scales, zeros, xu, n0, zero_term);
  for (int r = 0; r < NR; ++r) out[r] = _mm512_reduce_add_ps(_mm512_add_ps(t0[r], t1[r])) - zero_term[r];
}
#pragma GCC diagnostic pop

// Whether int4_vnni_blocks runs this weight.
bool int4_blocks(const IntWeightSpec& s) {
  return s.bits == 4 && !s.act_int8 && s.cols % 128 == 0 && (s.group == 32 || s.group % 128 == 0);
}

using VnniKernel = void (*)(const int8_t*, int64_t, int64_t, const uint8_t*, const float*, ZeroPoints, int64_t,
                            const float*, const float*, float*);

template <int BITS>
VnniKernel vnni_kernel(int nr) {
  switch (nr) {
    case 1: return weight_only_vnni<BITS, 1>;
    case 2: return weight_only_vnni<BITS, 2>;
    case 3: return weight_only_vnni<BITS, 3>;
    default: return weight_only_vnni<BITS, 4>;
  }
}

VnniKernel int4_block_kernel(int nr) {
  switch (nr) {
    case 1: return int4_vnni_blocks<1>;
    case 2: return int4_vnni_blocks<2>;
    case 3: return int4_vnni_blocks<3>;
    default: return int4_vnni_blocks<4>;
  }
}

VnniKernel int4_pair_kernel(int nr) {
  switch (nr) {
    case 1: return int4_avx2_pairs<1>;
    case 2: return int4_avx2_pairs<2>;
    case 3: return int4_avx2_pairs<3>;
    default: return int4_avx2_pairs<4>;
  }
}

template <int BITS>
VnniKernel avx2_kernel(int nr) {
  switch (nr) {
    case 1: return weight_only_avx2<BITS, 1>;
    case 2: return weight_only_avx2<BITS, 2>;
    case 3: return weight_only_avx2<BITS, 3>;
    default: return weight_only_avx2<BITS, 4>;
  }
}

bool has_vnni() {
  static const bool vnni = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
  return vnni;
}

// Whether int4_avx2_pairs runs this weight (a CPU without VNNI).
bool int4_pairs(const IntWeightSpec& s) { return s.bits == 4 && !s.act_int8 && s.cols % 64 == 0 && s.group == 32; }

// The block of B columns within which the row kernel reads the input's codes permuted, or 0 for
// in order: the 4-bit block kernels (B = 128 int4_vnni_blocks, 64 int4_avx2_pairs) read chunk j
// of 32 columns (j < B / 32) as its first 16 codes at 16 j and its last 16 at B / 2 + 16 j, so
// that the low nibbles of B / 2 code bytes meet the first half and the high nibbles the second.
int64_t input_block(const IntWeightSpec& s) {
  if (has_vnni()) return int4_blocks(s) ? 128 : 0;
  return int4_pairs(s) ? 64 : 0;
}

// The kernel of one output row against nr input rows.
VnniKernel row_kernel(const IntWeightSpec& s, int nr) {
  if (!has_vnni()) {
    if (int4_pairs(s)) return int4_pair_kernel(nr);
    return s.bits == 8 ? avx2_kernel<8>(nr) : (s.bits == 4 ? avx2_kernel<4>(nr) : avx2_kernel<3>(nr));
  }
  if (int4_blocks(s)) return int4_block_kernel(nr);
  return s.bits == 8 ? vnni_kernel<8>(nr) : (s.bits == 4 ? vnni_kernel<4>(nr) : vnni_kernel<3>(nr));
}

void check_operands(const Tensor& x, const Tensor& codes, const Tensor& scales, const Tensor& zeros,
                    const IntWeightSpec& s) {
  LOOM_CHECK(s.bits == 8 || s.bits == 4 || s.bits == 3, "int_linear: ", s.bits, " bits, expected 8, 4 or 3");
  LOOM_CHECK(s.cols % 32 == 0 && s.group % 32 == 0 && s.cols % s.group == 0 && (!s.act_int8 || (s.bits == 8 && s.group == s.cols)),
             "int_linear: group ", s.group, " and ", s.cols, " columns do not fit the packed format");
  LOOM_CHECK(codes.dtype() == DTYPE_U8 && codes.numel() == s.rows * row_bytes(s.bits, s.cols), "int_linear: codes ",
             codes.describe(), " for (", s.rows, ", ", s.cols, ") at ", s.bits, " bits");
  LOOM_CHECK((scales.dtype() == DTYPE_F32 || scales.dtype() == DTYPE_F16) && scales.numel() == s.rows * (s.cols / s.group) &&
                 (!zeros.defined() || (zeros.dtype() == DTYPE_U8 && zeros.numel() == scales.numel())),
             "int_linear: scales ", scales.describe(), " / zeros ", zeros.defined() ? zeros.describe() : "(none)",
             " for (", s.rows, ", ", s.cols / s.group, ") groups");
  LOOM_CHECK(!x.defined() || (x.dtype() == DTYPE_F32 && x.numel() % s.cols == 0), "int_linear: x ", x.describe(),
             " for ", s.cols, " columns");
}

// fn(o, row o's f32 scales) for every output row o, the rows split over the threads (static),
// each thread with its own buffer for widened f16 scales. A decoding step's few input rows make
// a short region: those run on the short-region team (core/threads.h).
template <class Fn>
void each_output_row(int64_t rows, const GroupRows& params, bool short_region_rows, Fn&& fn) {
  const auto part = [&](int64_t begin, int64_t end) {
    std::vector<float> row_scales(static_cast<size_t>(params.groups));
    for (int64_t o = begin; o < end; ++o) fn(o, params.scales(o, row_scales.data()));
  };
  if (short_region_rows) {
    short_region(rows, part);
    return;
  }
#pragma omp parallel
  {
    std::vector<float> row_scales(static_cast<size_t>(params.groups));
#pragma omp for schedule(static)
    for (int64_t o = 0; o < rows; ++o) fn(o, params.scales(o, row_scales.data()));
  }
}

// One group of the input to int8 (n a multiple of 32): q = round(x / s) to nearest even (as
// nearbyint), clamped to [-127, 127], s = max |x| / 127 (1 for a group of zeros); returns s and
// writes the codes and their sum. A NaN is left out of the maximum and becomes -127. The group
// starts at element `at` of the input (rows K apart, K a multiple of `block`), and its codes go
// to q[at ...] in order, or in input_block's order.
float quantize_group(const float* x, int64_t n, int64_t at, int64_t block, int8_t* q, int32_t& sum) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 m = _mm256_setzero_ps();
  for (int64_t c = 0; c < n; c += 8) m = _mm256_max_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(x + c)), m);
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  const float amax = _mm_cvtss_f32(_mm_max_ss(h, _mm_shuffle_ps(h, h, 1)));
  const float scale = amax > 0.0f ? amax / 127.0f : 1.0f;
  const __m256 sv = _mm256_set1_ps(scale), lo = _mm256_set1_ps(-127.0f), hi = _mm256_set1_ps(127.0f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // undoes packs' interleaving of 128-bit lanes
  __m256i total = _mm256_setzero_si256();
  for (int64_t c = 0; c < n; c += 32) {
    __m256i v[4];
    for (int k = 0; k < 4; ++k) {
      const __m256 r = _mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(x + c + 8 * k), sv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      v[k] = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(r, lo), hi));
      total = _mm256_add_epi32(total, v[k]);
    }
    const __m256i bytes = _mm256_permutevar8x32_epi32(
        _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3])), order);
    const int64_t a = at + c;  // a chunk of 32 columns
    const int64_t first = block == 0 ? a : (a & ~(block - 1)) + 16 * ((a & (block - 1)) / 32);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + first), _mm256_castsi256_si128(bytes));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + first + (block == 0 ? 16 : block / 2)), _mm256_extracti128_si256(bytes, 1));
  }
  const __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
  const __m128i s2 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
  sum = _mm_cvtsi128_si32(_mm_add_epi32(s2, _mm_shuffle_epi32(s2, 0xB1)));
  return scale;
}

GroupRows group_rows(const Tensor& scales, const Tensor& zeros, const IntWeightSpec& s) {
  GroupRows p;
  if (scales.dtype() == DTYPE_F32) p.f32 = scales.data<float>();
  else p.f16 = static_cast<const uint16_t*>(scales.raw_data());
  if (zeros.defined()) p.zeros = zeros.data<uint8_t>();
  p.zero = static_cast<float>(1 << (s.bits - 1));
  p.groups = s.cols / s.group;
  return p;
}

}  // namespace

void int_linear(const Tensor& x, const Tensor& codes, const Tensor& scales, const Tensor& zeros, const IntWeightSpec& s,
                const Tensor* input_scale, const Tensor& y, float beta, const Tensor* bias) {
  check_operands(x, codes, scales, zeros, s);
  const int64_t K = s.cols, O = s.rows, N = x.numel() / K, groups = K / s.group, rb = row_bytes(s.bits, K);
  LOOM_CHECK(y.dtype() == DTYPE_F32 && y.numel() == N * O, "int_linear: y ", y.describe(), " for (", N, ", ", O, ")");
  LOOM_CHECK(bias == nullptr || (bias->dtype() == DTYPE_F32 && bias->numel() == O), "int_linear: bias for ", O, " rows");
  LOOM_CHECK(input_scale == nullptr || (input_scale->dtype() == DTYPE_F32 && input_scale->numel() == K),
             "int_linear: input scale for ", K, " columns");
  const float* xp = x.data<float>();
  std::vector<float> scaled;  // x diag(input_scale)
  if (input_scale != nullptr) {
    scaled.resize(static_cast<size_t>(N * K));
    const float* v = input_scale->data<float>();
    for (int64_t n = 0; n < N; ++n) {
      for (int64_t c = 0; c < K; ++c) scaled[static_cast<size_t>(n * K + c)] = xp[n * K + c] * v[c];
    }
    xp = scaled.data();
  }
  float* yp = y.data<float>();
  const float* bp = bias != nullptr ? bias->data<float>() : nullptr;
  const uint8_t* cp = codes.data<uint8_t>();
  const GroupRows params = group_rows(scales, zeros, s);
  auto store = [&](int64_t n, int64_t o, float v) {
    if (bp != nullptr) v += bp[o];
    float& dst = yp[n * O + o];
    dst = beta == 0.0f ? v : beta * dst + v;
  };
  // Each row's groups (W8A8: the whole row) to int8: scale t, codes, and t times the codes' sum
  // (the zero points' terms read it).
  std::vector<int8_t> qx(static_cast<size_t>(N * K));
  std::vector<float> sx(static_cast<size_t>(N * groups)), xu(static_cast<size_t>(N * groups));
  const int64_t block = input_block(s);
#pragma omp parallel for schedule(static) if (N * K >= kParallelMinElements)
  for (int64_t ng = 0; ng < N * groups; ++ng) {  // rows are K = groups x group long: group ng starts at ng x group
    int32_t sum = 0;
    const float t = quantize_group(xp + ng * s.group, s.group, ng * s.group, block, qx.data(), sum);
    sx[static_cast<size_t>(ng)] = t;
    xu[static_cast<size_t>(ng)] = t * static_cast<float>(sum);
  }
  VnniKernel kernels[kRowBlock + 1];  // by the number of input rows a call of it multiplies
  for (int nr = 1; nr <= kRowBlock; ++nr) kernels[nr] = row_kernel(s, nr);
  each_output_row(O, params, N <= kShortRegionRows, [&](int64_t o, const float* so) {
    for (int64_t n0 = 0; n0 < N; n0 += kRowBlock) {
      const int nr = static_cast<int>(std::min<int64_t>(kRowBlock, N - n0));
      float out[kRowBlock];
      kernels[nr](qx.data(), K, n0, cp + o * rb, so, params.zero_points(o), s.group, sx.data(), xu.data(), out);
      for (int r = 0; r < nr; ++r) store(n0 + r, o, out[r]);
    }
  });
}

void int_dequantize(const Tensor& codes, const Tensor& scales, const Tensor& zeros, const IntWeightSpec& s,
                    const Tensor* input_scale, const Tensor& out) {
  check_operands(Tensor{}, codes, scales, zeros, s);
  LOOM_CHECK(out.dtype() == DTYPE_F32 && out.numel() == s.rows * s.cols, "int_dequantize: out ", out.describe(), " for (",
             s.rows, ", ", s.cols, ")");
  const int64_t K = s.cols, rb = row_bytes(s.bits, K);
  const uint8_t* cp = codes.data<uint8_t>();
  const GroupRows params = group_rows(scales, zeros, s);
  float* op = out.data<float>();
  LOOM_CHECK(input_scale == nullptr || (input_scale->dtype() == DTYPE_F32 && input_scale->numel() == K),
             "int_dequantize: input scale for ", K, " columns");
  const float* in = input_scale != nullptr ? input_scale->data<float>() : nullptr;
  each_output_row(s.rows, params, false, [&](int64_t o, const float* so) {
    const ZeroPoints zo = params.zero_points(o);
    for (int64_t c = 0; c < K; c += 32) {
      const int64_t g = c / s.group;
      const __m256 sv = _mm256_set1_ps(so[g]), zv = _mm256_set1_ps(zo.p != nullptr ? static_cast<float>(zo.p[g]) : zo.z);
      __m128i lo, hi;
      if (s.bits == 8) chunk_codes<8>(cp + o * rb, c, lo, hi);
      else if (s.bits == 4) chunk_codes<4>(cp + o * rb, c, lo, hi);
      else chunk_codes<3>(cp + o * rb, c, lo, hi);
      const __m256 w[4] = {u8_to_f32(lo), u8_to_f32(_mm_srli_si128(lo, 8)), u8_to_f32(hi), u8_to_f32(_mm_srli_si128(hi, 8))};
      for (int k = 0; k < 4; ++k) _mm256_storeu_ps(op + o * K + c + 8 * k, _mm256_mul_ps(sv, _mm256_sub_ps(w[k], zv)));
    }
    if (in != nullptr) {  // W diag(input_scale): the same product as scaling the input
      for (int64_t c = 0; c < K; ++c) op[o * K + c] *= in[c];
    }
  });
}

}  // namespace loom::cpu
