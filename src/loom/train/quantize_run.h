// loom quantize's run (docs/compression.md): a model source (a Hugging Face folder, streamed;
// or a Loom checkpoint) quantized block by block into a quantized model folder. From a Hugging
// Face folder the model's f32 parameters are lazy pages (Tensor::zeros_lazy): each block's
// weights are read (widened) just before it is calibrated and quantized and released after, the
// embedding while block 0 runs, the head at the end; every quantized weight is written to the
// folder as it is made (QuantizedModelWriter) and every plain parameter straight from the
// source, in the source's dtype when it is BF16 (the token embedding and an unquantized head).
// So the peak is about one block's f32 weights and its quantization work, the calibration
// hidden states and the head, not the model (quantize_memory_estimate states it before any work).
// A Loom checkpoint (f32 parameters) loads whole, as before.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "loom/compress/quantize_model.h"
#include "loom/train/model_source.h"

namespace loom {

// The host bytes a quantize run holds at its peak, by part: those of its largest phase (measuring
// a block's inputs, quantizing one of its weights, quantizing the head).
struct QuantizeMemory {
  int64_t weights = 0;      // f32 weights resident (one block; block 0 + the embedding; the head)
  int64_t work = 0;         // the weight's quantization work (its f32 copies, GPTQ's double copies, codes)
  int64_t statistics = 0;   // calibration statistics held (GPTQ's Hessians in double)
  int64_t hidden = 0;       // the calibration sequences' hidden states (two copies) and one batch's block store
  int64_t total() const { return weights + work + statistics + hidden; }
  bool streamed = false;    // false: a Loom checkpoint, loaded whole
};
QuantizeMemory quantize_memory_estimate(const ModelSource& source, const QuantizeOptions& options, int64_t calib_sequences);
// "planned peak host memory X GiB: ..." (one line; loom quantize and loom memory --quantize print it).
std::string describe(const QuantizeMemory& m);

struct QuantizeRunResult {
  int64_t quantized_params = 0, total_params = 0;
  int64_t stored_bytes = 0;        // the quantized weights' codes, scales, zeros and input scales in the file
  int64_t plain_bytes = 0;         // the plain parameters' bytes in the file
  uint64_t file_bytes = 0;         // model.safetensors
  double seconds = 0.0;
};
// Writes the quantized model folder `out` (an existing folder is replaced only if it is a
// quantized model). `progress` gets one line per weight.
QuantizeRunResult quantize_to_folder(const ModelSource& source, const QuantizeOptions& options,
                                     const std::vector<std::vector<int32_t>>& sequences, const std::string& out,
                                     const std::function<void(const std::string&)>& progress);

}  // namespace loom
