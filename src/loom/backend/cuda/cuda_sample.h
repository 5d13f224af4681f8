// Backend::sample_rows on the GPU (cuda_sample.cu): the sampling rule of backend/sampling_rule.h,
// the same token as the host reference.
#pragma once
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "loom/backend/sampling_rule.h"

namespace loom::cuda {

// The workspace of one call: the rows' settings (`rows` RowSampling) and the penalties
// (SamplePenalty), copied there by the caller in stream order as one table [rows_at, max_at), each
// row's largest logit and weight sum, two key and two value arrays of rows x V words, the radix
// sort's temporary storage.
struct SampleLayout {
  size_t rows_at = 0, penalties_at = 0, max_at = 0, sums_at = 0, keys_a = 0, vals_a = 0, keys_b = 0, vals_b = 0;
  size_t temp_at = 0, temp_bytes = 0, bytes = 0;
};
SampleLayout sample_layout(int64_t rows, int64_t V, int64_t penalties);

// logits (rows, V) minus the penalties, in place, then out[r] = the rule's token for row r,
// enqueued on `stream`; rows * V < 2^31.
void sample_rows(void* ws, const SampleLayout& at, float* logits, int64_t rows, int64_t V, int64_t penalties,
                 int32_t* out, cudaStream_t stream);

}  // namespace loom::cuda
