#include "loom/core/philox.h"

#include <cmath>

namespace loom {

namespace {
constexpr uint32_t kMul0 = 0xD2511F53u;
constexpr uint32_t kMul1 = 0xCD9E8D57u;
constexpr uint32_t kBump0 = 0x9E3779B9u;
constexpr uint32_t kBump1 = 0xBB67AE85u;

PhiloxCounter philox_round(PhiloxCounter c, PhiloxKey k) {
  const uint64_t p0 = static_cast<uint64_t>(kMul0) * c[0];
  const uint64_t p1 = static_cast<uint64_t>(kMul1) * c[2];
  const uint32_t hi0 = static_cast<uint32_t>(p0 >> 32), lo0 = static_cast<uint32_t>(p0);
  const uint32_t hi1 = static_cast<uint32_t>(p1 >> 32), lo1 = static_cast<uint32_t>(p1);
  return {hi1 ^ c[1] ^ k[0], lo1, hi0 ^ c[3] ^ k[1], lo0};
}

PhiloxCounter block_for(int64_t index, uint64_t seed, uint32_t stream) {
  const uint64_t block = static_cast<uint64_t>(index) / 4;
  return philox4x32_10({static_cast<uint32_t>(block), static_cast<uint32_t>(block >> 32), stream, 0},
                       {static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32)});
}
}  // namespace

PhiloxCounter philox4x32_10(PhiloxCounter counter, PhiloxKey key) {
  for (int round = 0; round < 10; ++round) {
    if (round > 0) key = {key[0] + kBump0, key[1] + kBump1};
    counter = philox_round(counter, key);
  }
  return counter;
}

// Box-Muller: (u1, u2) -> sqrt(-2 ln u1) (cos 2 pi u2, sin 2 pi u2); one Philox block gives
// two pairs, i.e. the normals of global indices 4b .. 4b+3.
void philox_fill_normal(float* out, int64_t count, uint64_t seed, uint32_t stream, int64_t first, float mean,
                        float stddev) {
  const int64_t first_block = first / 4, last_block = (first + count + 3) / 4;
#pragma omp parallel for schedule(static)
  for (int64_t blk = first_block; blk < last_block; ++blk) {
    const PhiloxCounter bits = block_for(blk * 4, seed, stream);
    float z[4];
    for (int pair = 0; pair < 2; ++pair) {
      const float radius = std::sqrt(-2.0f * std::log(philox_uniform(bits[2 * pair])));
      const float angle = 2.0f * static_cast<float>(M_PI) * philox_uniform(bits[2 * pair + 1]);
      z[2 * pair] = radius * std::cos(angle);
      z[2 * pair + 1] = radius * std::sin(angle);
    }
    for (int j = 0; j < 4; ++j) {
      const int64_t i = blk * 4 + j - first;
      if (i >= 0 && i < count) out[i] = mean + stddev * z[j];
    }
  }
}

void philox_fill_uniform(float* out, int64_t count, uint64_t seed, uint32_t stream, int64_t first) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < count; ++i) {
    const int64_t g = first + i;
    out[i] = philox_uniform(block_for(g, seed, stream)[g % 4]);
  }
}

}  // namespace loom
