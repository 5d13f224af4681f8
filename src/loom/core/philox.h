// Philox4x32-10 counter-based RNG (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3",
// SC'11). A draw is a pure function of (key, counter): init and dropout derive every element's
// numbers from (seed, stream, global element index), so any sharding, recompute or resume draws
// the same values.
//   round: (hi0, lo0) = mulhilo(0xD2511F53, c0); (hi1, lo1) = mulhilo(0xCD9E8D57, c2)
//          c = {hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0};  key += (0x9E3779B9, 0xBB67AE85)
#pragma once
#include <array>
#include <cstdint>

namespace loom {

using PhiloxCounter = std::array<uint32_t, 4>;
using PhiloxKey = std::array<uint32_t, 2>;

PhiloxCounter philox4x32_10(PhiloxCounter counter, PhiloxKey key);

// Uniform in (0, 1): never 0 or 1, so log() is safe.
inline float philox_uniform(uint32_t bits) { return (static_cast<float>(bits >> 8) + 0.5f) * (1.0f / 16777216.0f); }

// Element i of the stream (seed, stream) is normal number i % 4 of the Box-Muller transform of
// block philox(counter = (i/4 lo, i/4 hi, stream, 0), key = (seed lo, seed hi)). `first` is the
// global index of out[0], so a shard fills exactly its part of the full tensor.
void philox_fill_normal(float* out, int64_t count, uint64_t seed, uint32_t stream, int64_t first, float mean,
                        float stddev);
void philox_fill_uniform(float* out, int64_t count, uint64_t seed, uint32_t stream, int64_t first);

}  // namespace loom
