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

void philox_fill_normal(float* out, int64_t count, uint64_t seed, uint32_t stream, int64_t first, float mean,
                        float stddev) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < count; ++i) {
    const int64_t g = first + i;
    const PhiloxCounter bits = block_for(g, seed, stream);
    const int pair = static_cast<int>((g % 4) / 2);
    const double u1 = philox_uniform(bits[2 * pair]);
    const double u2 = philox_uniform(bits[2 * pair + 1]);
    const double radius = std::sqrt(-2.0 * std::log(u1));
    const double angle = 2.0 * M_PI * u2;
    const double z = (g % 2 == 0) ? radius * std::cos(angle) : radius * std::sin(angle);
    out[i] = mean + stddev * static_cast<float>(z);
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
