// Page residency of host buffers, for sharded state (ZeRO-2/3): a flat buffer keeps its full
// address range, so every view into it stays valid, while the elements a rank does not own are
// handed back to the operating system (madvise MADV_DONTNEED: the pages read as zeros and hold
// no memory until written again). The CUDA counterpart is the virtual memory API
// (cuMemAddressReserve + cuMemMap / cuMemUnmap), the mechanism behind PyTorch's expandable
// segments. Residency is measured, not modelled: mincore() reports which pages are present.
#pragma once
#include <cstdint>

#include "loom/core/tensor.h"

namespace loom {

// Zeroes elements [begin, end) of the contiguous host tensor t and returns every whole page
// inside that range to the OS. Transparent huge pages are turned off for the buffer first (so
// a 2 MiB page is never refaulted around one written element).
void release_elements(const Tensor& t, int64_t begin, int64_t end);

// Bytes of t's pages that are resident in memory now (mincore), rounded to whole pages; all of a
// device tensor's bytes (device memory is not paged).
int64_t resident_bytes(const Tensor& t);

}  // namespace loom
