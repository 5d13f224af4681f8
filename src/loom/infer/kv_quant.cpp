// KIVI-style asymmetric min/max quantization of KV rows (Liu et al. 2024) on the host: the
// formulas and the byte layout are stated in backend/kv_format.h, the arithmetic is
// backend/kv_quantize.h's (shared with the backends' kv_store, so host and device caches store the
// same bytes): fp16 scales and mins rounded outwards (min down, scale up) so every value stays
// inside its group's grid and the reconstruction error is at most half a step.
#include "loom/infer/kv_quant.h"

#include "loom/backend/kv_quantize.h"
#include "loom/backend/kv_store.h"
#include "loom/core/error.h"

namespace loom {

namespace {

void check_fit(int32_t status) {
  LOOM_CHECK(status != kvq::KV_FIT_NON_FINITE, "kv quantization: a group holds a non-finite value (inf or NaN)");
  LOOM_CHECK(status == kvq::KV_FIT_OK,
             "kv quantization: a group's values do not fit an fp16 scale and min (expected |x| < 65504)");
}

}  // namespace

void kv_quantize_tile(const KvQuantSpec& spec, const float* x, int64_t tokens, uint8_t* out) {
  const kvq::KvStoreFormat f = kv_store_format(spec);
  check_fit(kvq::store_rows(f, [&](int64_t t) { return x + t * f.width; }, tokens, out, 0, 1));
}

}  // namespace loom
