// The CUDA simulator catches what a GPU and compute-sanitizer would (docs/cuda.md "The
// simulator"): each check has a deliberately broken kernel or host program here, reported by the
// right check naming the kernel and the thread, and its unbroken twin, reported by none.
//
// The kernels below are compiled like the backend's (-fsanitize=thread instrumentation, launched
// through loom::cuda::launch). After the whole suite, a listener checks that no test outside
// CudaSimChecks left a report: the backend's real kernels trigger no check.
#include <gtest/gtest.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "loom/backend/cuda/cuda_device.h"
#include "loom/backend/cuda/cuda_launch.h"
#include "loom/backend/cuda/sim/sim_runtime.h"
#include "loom/core/dtype.h"

namespace loom {
namespace {

using cuda::launch;

// ---------------------------------------------------------------- kernels, each with its broken twin
// memcheck: thread i writes x[i] for i < n; the broken one lets thread n write x[n].
template <bool kBroken>
__global__ void write_indices(float* x, int n) {
  const int i = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  if (kBroken ? i <= n : i < n) x[i] = static_cast<float>(i);
}

// racecheck / synccheck: a block's sum of 256 values by a halving tree in shared memory; the broken
// one has no __syncthreads.
template <bool kBroken>
__global__ void block_sum(const float* x, float* out) {
  __shared__ float sums[256];
  const unsigned t = threadIdx.x;
  sums[t] = x[t];
  if (!kBroken) __syncthreads();
  for (unsigned half = 128; half > 0; half >>= 1) {
    if (t < half) sums[t] += sums[t + half];
    if (!kBroken) __syncthreads();
  }
  if (t == 0) *out = sums[0];
}

// synccheck: a warp's butterfly sum; the broken one names only lanes 0-15 in its mask.
template <bool kBroken>
__global__ void warp_sum(const float* x, float* out) {
  const unsigned mask = kBroken ? 0x0000ffffu : 0xffffffffu;
  float v = x[threadIdx.x];
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(mask, v, offset);
  out[threadIdx.x] = v;
}

// synccheck: the broken one calls __syncthreads in half of the block only.
template <bool kBroken>
__global__ void half_barrier(float* x) {
  if (!kBroken || threadIdx.x < 16) __syncthreads();
  x[threadIdx.x] = 1.0f;
}

// synccheck: lanes 16-31 leave before the shuffle whose full mask names them.
template <bool kBroken>
__global__ void early_exit_shuffle(float* out) {
  if (kBroken && threadIdx.x >= 16) return;
  out[threadIdx.x] = __shfl_down_sync(0xffffffffu, static_cast<float>(threadIdx.x), 1);
}

// memcheck: a float4 load must be 16-byte aligned; the broken one loads at a 4-byte offset.
template <bool kBroken>
__global__ void load_float4(const float* in, float* out) {
  const float4 v = *reinterpret_cast<const float4*>(in + (kBroken ? 1 : 0));
  out[threadIdx.x] = v.x + v.y + v.z + v.w;
}

// cp.async (cuda_device.h): each of 32 threads copies two 16-byte rows into its shared slots, in two
// groups, and records slot values before any wait (the old zeros: the simulator lands a copy at
// the wait that completes its group), after wait<1> (group 0 only), after wait<0>, and, after a
// barrier, its neighbour's slot. The broken twin reads the neighbour's slot without the barrier.
template <bool kBroken>
__global__ void async_copies(const float* in, float* out) {
  __shared__ __align__(16) float slots[64][4];
  const int t = static_cast<int>(threadIdx.x);
  for (int k = 0; k < 4; ++k) slots[t][k] = slots[32 + t][k] = 0.0f;
  cuda::cp_async<16>(slots[t], in + 4 * t);
  cuda::cp_async_commit();
  cuda::cp_async<16>(slots[32 + t], in + 4 * (32 + t));
  cuda::cp_async_commit();
  out[5 * t] = slots[t][0] + slots[32 + t][0];
  cuda::cp_async_wait<1>();
  out[5 * t + 1] = slots[t][0];
  out[5 * t + 2] = slots[32 + t][0];
  cuda::cp_async_wait<0>();
  out[5 * t + 3] = slots[32 + t][0];
  if (!kBroken) __syncthreads();
  out[5 * t + 4] = slots[(t + 1) % 32][1];
}

__global__ void copy_kernel(const float* in, float* out, int n) {
  const int i = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  if (i < n) out[i] = in[i];
}

// ---------------------------------------------------------------- the fixture
class CudaSimChecks : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess) << sim::last_report();
    sim::clear_error();
  }
  void TearDown() override {
    for (void* p : allocations_) (void)cudaFree(p);
    sim::clear_error();  // the broken variants' sticky errors
  }
  float* device_floats(size_t n) {
    void* p = nullptr;
    EXPECT_EQ(cudaMalloc(&p, n * sizeof(float)), cudaSuccess);
    allocations_.push_back(p);
    return static_cast<float*>(p);
  }
  float* device_values(const std::vector<float>& values) {
    float* p = device_floats(values.size());
    EXPECT_EQ(cudaMemcpy(p, values.data(), values.size() * sizeof(float), cudaMemcpyHostToDevice), cudaSuccess);
    return p;
  }
  // The check that fired (after the device finished), and its report.
  std::string fired() {
    (void)cudaDeviceSynchronize();
    return sim::last_check();
  }
  std::vector<void*> allocations_;
};

TEST_F(CudaSimChecks, MemcheckNamesTheKernelTheThreadAndTheAllocation) {
  float* x = device_floats(64);
  launch<write_indices<false>>(1, 65, 0, nullptr, x, 64);
  EXPECT_EQ(fired(), "") << sim::last_report();
  launch<write_indices<true>>(1, 65, 0, nullptr, x, 64);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaErrorIllegalAddress);
  EXPECT_EQ(fired(), "memcheck");
  const std::string report = sim::last_report();
  EXPECT_NE(report.find("write_indices<true>"), std::string::npos) << report;
  EXPECT_NE(report.find("thread (64,0,0) of block (0,0,0)"), std::string::npos) << report;
  EXPECT_NE(report.find("0 bytes past the end of the allocation"), std::string::npos) << report;
  EXPECT_NE(report.find("of 256 bytes"), std::string::npos) << report;
  // The error is sticky, as a GPU's illegal address is.
  EXPECT_EQ(cudaMemset(x, 0, 4), cudaErrorIllegalAddress);
}

TEST_F(CudaSimChecks, RacecheckFindsTheMissingSyncthreads) {
  std::vector<float> values(256);
  for (int i = 0; i < 256; ++i) values[static_cast<size_t>(i)] = static_cast<float>(i % 7);
  const float* x = device_values(values);
  float* out = device_floats(1);
  launch<block_sum<false>>(1, 256, 0, nullptr, x, out);
  EXPECT_EQ(fired(), "") << sim::last_report();
  float sum = 0;
  ASSERT_EQ(cudaMemcpy(&sum, out, 4, cudaMemcpyDeviceToHost), cudaSuccess);
  float expected = 0;
  for (float v : values) expected += v;
  EXPECT_EQ(sum, expected);
  launch<block_sum<true>>(1, 256, 0, nullptr, x, out);
  EXPECT_EQ(fired(), "racecheck");
  const std::string report = sim::last_report();
  EXPECT_NE(report.find("block_sum<true>"), std::string::npos) << report;
  EXPECT_NE(report.find("shared memory hazard"), std::string::npos) << report;
  EXPECT_NE(report.find("thread ("), std::string::npos) << report;
}

TEST_F(CudaSimChecks, CpAsyncLandsAtTheWaitOfItsGroupAndRacecheckSeesIt) {
  std::vector<float> values(256);
  for (int i = 0; i < 256; ++i) values[static_cast<size_t>(i)] = static_cast<float>(i + 1);
  const float* in = device_values(values);
  float* out = device_floats(5 * 32);
  launch<async_copies<false>>(1, 32, 0, nullptr, in, out);
  EXPECT_EQ(fired(), "") << sim::last_report();
  std::vector<float> got(5 * 32);
  ASSERT_EQ(cudaMemcpy(got.data(), out, got.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
  for (int t = 0; t < 32; ++t) {
    EXPECT_EQ(got[5 * t], 0.0f) << "thread " << t << ": a copy landed before its wait";
    EXPECT_EQ(got[5 * t + 1], values[4 * t]) << "thread " << t << ": group 0 not complete after wait<1>";
    EXPECT_EQ(got[5 * t + 2], 0.0f) << "thread " << t << ": group 1 complete after wait<1>";
    EXPECT_EQ(got[5 * t + 3], values[4 * (32 + t)]) << "thread " << t;
    EXPECT_EQ(got[5 * t + 4], values[4 * ((t + 1) % 32) + 1]) << "thread " << t;
  }
  launch<async_copies<true>>(1, 32, 0, nullptr, in, out);
  EXPECT_EQ(fired(), "racecheck");
  EXPECT_NE(sim::last_report().find("async_copies<true>"), std::string::npos) << sim::last_report();
}

TEST_F(CudaSimChecks, SynccheckFindsAShuffleMaskThatMissesLanes) {
  std::vector<float> values(32, 1.0f);
  const float* x = device_values(values);
  float* out = device_floats(32);
  launch<warp_sum<false>>(1, 32, 0, nullptr, x, out);
  EXPECT_EQ(fired(), "") << sim::last_report();
  std::vector<float> sums(32);
  ASSERT_EQ(cudaMemcpy(sums.data(), out, 32 * 4, cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(sums, std::vector<float>(32, 32.0f));
  launch<warp_sum<true>>(1, 32, 0, nullptr, x, out);
  EXPECT_EQ(fired(), "synccheck");
  const std::string report = sim::last_report();
  EXPECT_NE(report.find("warp_sum<true>"), std::string::npos) << report;
  // Lanes 0-15 complete the first exchange among themselves; lane 0 reads lane 16 (offset 16).
  EXPECT_NE(report.find("__shfl_xor_sync with mask 0x0000ffff: lane 0 reads lane 16, which the mask does not include"),
            std::string::npos)
      << report;
  EXPECT_NE(report.find("thread (0,0,0) of block (0,0,0)"), std::string::npos) << report;
}

TEST_F(CudaSimChecks, SynccheckFindsADivergentBarrier) {
  float* x = device_floats(32);
  launch<half_barrier<false>>(1, 32, 0, nullptr, x);
  EXPECT_EQ(fired(), "") << sim::last_report();
  launch<half_barrier<true>>(1, 32, 0, nullptr, x);
  EXPECT_EQ(fired(), "synccheck");
  EXPECT_NE(sim::last_report().find("half_barrier<true>"), std::string::npos) << sim::last_report();
  EXPECT_NE(sim::last_report().find("divergent barrier"), std::string::npos) << sim::last_report();
}

TEST_F(CudaSimChecks, SynccheckFindsAShuffleMaskNamingLanesThatExited) {
  float* out = device_floats(32);
  launch<early_exit_shuffle<false>>(1, 32, 0, nullptr, out);
  EXPECT_EQ(fired(), "") << sim::last_report();
  launch<early_exit_shuffle<true>>(1, 32, 0, nullptr, out);
  EXPECT_EQ(fired(), "synccheck");
  EXPECT_NE(sim::last_report().find("__shfl_down_sync with mask 0xffffffff in warp 0: lane 16 named by the mask has exited"),
            std::string::npos)
      << sim::last_report();
  EXPECT_NE(sim::last_report().find("early_exit_shuffle<true>"), std::string::npos) << sim::last_report();
}

TEST_F(CudaSimChecks, MemcheckFindsAMisalignedVectorLoad) {
  const float* in = device_values(std::vector<float>(8, 1.0f));
  float* out = device_floats(1);
  launch<load_float4<false>>(1, 1, 0, nullptr, in, out);
  EXPECT_EQ(fired(), "") << sim::last_report();
  launch<load_float4<true>>(1, 1, 0, nullptr, in, out);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaErrorMisalignedAddress);
  EXPECT_EQ(fired(), "memcheck");
  EXPECT_NE(sim::last_report().find("misaligned read of 16 bytes"), std::string::npos) << sim::last_report();
  EXPECT_NE(sim::last_report().find("thread (0,0,0) of block (0,0,0)"), std::string::npos) << sim::last_report();
}

TEST_F(CudaSimChecks, ALaunchOf2048ThreadsPerBlockFailsAsOnAGpu) {
  float* x = device_floats(4096);
  launch<write_indices<false>>(2, 2048, 0, nullptr, x, 4096);
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidConfiguration);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);  // not sticky
  EXPECT_EQ(fired(), "launch");
  EXPECT_NE(sim::last_report().find("write_indices<false>"), std::string::npos) << sim::last_report();
  EXPECT_NE(sim::last_report().find("2048 threads per block, the limit is 1024"), std::string::npos);
  sim::clear_error();
  launch<write_indices<false>>(4, 1024, 0, nullptr, x, 4096);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  EXPECT_EQ(fired(), "");
}

TEST_F(CudaSimChecks, DynamicSharedMemoryAbove48KbNeedsTheOptIn) {
  float* x = device_floats(32);
  launch<half_barrier<false>>(1, 32, 100 * 1024, nullptr, x);
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidValue);
  EXPECT_EQ(fired(), "launch");
  EXPECT_NE(sim::last_report().find("102400 bytes of dynamic shared memory"), std::string::npos) << sim::last_report();
  EXPECT_NE(sim::last_report().find("without cudaFuncAttributeMaxDynamicSharedMemorySize"), std::string::npos);
  sim::clear_error();
  ASSERT_EQ(cudaFuncSetAttribute(half_barrier<false>, cudaFuncAttributeMaxDynamicSharedMemorySize, 100 * 1024),
            cudaSuccess);
  launch<half_barrier<false>>(1, 32, 100 * 1024, nullptr, x);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  EXPECT_EQ(fired(), "");
  // Above Hopper's 227 KB even the opt-in is refused.
  EXPECT_EQ(cudaFuncSetAttribute(half_barrier<false>, cudaFuncAttributeMaxDynamicSharedMemorySize, 228 * 1024),
            cudaErrorInvalidValue);
}

TEST_F(CudaSimChecks, InitcheckFindsAReadOfNeverWrittenMemory) {
  float* in = device_floats(64);
  float* out = device_floats(64);
  ASSERT_EQ(cudaMemset(in, 0, 32 * sizeof(float)), cudaSuccess);  // the first half only
  launch<copy_kernel>(1, 64, 0, nullptr, in, out, 32);
  EXPECT_EQ(fired(), "") << sim::last_report();
  launch<copy_kernel>(1, 64, 0, nullptr, in, out, 64);
  EXPECT_EQ(fired(), "initcheck");
  const std::string report = sim::last_report();
  EXPECT_NE(report.find("copy_kernel"), std::string::npos) << report;
  EXPECT_NE(report.find("thread (32,0,0)"), std::string::npos) << report;
  EXPECT_NE(report.find("128 bytes into the allocation"), std::string::npos) << report;
}

TEST_F(CudaSimChecks, AHostReadAfterAnAsyncCopyWithoutSynchronizationIsStale) {
  const std::vector<float> values(1024, 3.0f);
  const float* x = device_values(values);
  float* pinned = nullptr;
  ASSERT_EQ(cudaMallocHost(reinterpret_cast<void**>(&pinned), 1024 * sizeof(float)), cudaSuccess);
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  // Synchronized: no report, the values arrived.
  ASSERT_EQ(cudaMemcpyAsync(pinned, x, 1024 * sizeof(float), cudaMemcpyDeviceToHost, stream), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  EXPECT_EQ(pinned[1023], 3.0f);
  EXPECT_EQ(fired(), "");
  // Not synchronized: the read is reported (and may see the old value).
  ASSERT_EQ(cudaMemcpyAsync(pinned, x, 1024 * sizeof(float), cudaMemcpyDeviceToHost, stream), cudaSuccess);
  volatile float seen = pinned[0];
  (void)seen;
  EXPECT_EQ(sim::last_check(), "stale-read");
  EXPECT_NE(sim::last_report().find("before the asynchronous copy into it was synchronized"), std::string::npos);
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  EXPECT_EQ(cudaStreamDestroy(stream), cudaSuccess);
  EXPECT_EQ(cudaFreeHost(pinned), cudaSuccess);
}

// CUDA graphs from stream capture: a captured stream runs nothing until the graph is launched,
// and each launch runs the recorded operations again (a copy from pinned memory reads it at the
// launch); cudaGraphExecUpdate takes a graph of the same operations' kinds (the new parameters
// then run) and refuses another shape; a wait for the device or a copy to the host while
// capturing is refused (reported "capture"), invalidates the capture, and its end says so.
TEST_F(CudaSimChecks, StreamCaptureRecordsAGraphThatLaunchesReplayAndUpdate) {
  float* in = device_values(std::vector<float>(64, 1.0f));
  float* out = device_floats(64);
  float* pinned = nullptr;
  ASSERT_EQ(cudaMallocHost(reinterpret_cast<void**>(&pinned), 64 * sizeof(float)), cudaSuccess);
  for (int i = 0; i < 64; ++i) pinned[i] = 2.0f;
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  const auto capture = [&](bool with_second_copy) {
    EXPECT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeRelaxed), cudaSuccess);
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    EXPECT_EQ(cudaStreamIsCapturing(stream, &status), cudaSuccess);
    EXPECT_EQ(status, cudaStreamCaptureStatusActive);
    EXPECT_EQ(cudaMemcpyAsync(in, pinned, 64 * sizeof(float), cudaMemcpyHostToDevice, stream), cudaSuccess);
    launch<copy_kernel>(1, 64, 0, stream, in, out, 64);
    if (with_second_copy) launch<copy_kernel>(1, 64, 0, stream, in, out, 32);
    cudaGraph_t graph = nullptr;
    EXPECT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
    return graph;
  };
  const auto out0 = [&] {
    float v = 0.0f;
    EXPECT_EQ(cudaMemcpy(&v, out, sizeof v, cudaMemcpyDeviceToHost), cudaSuccess);
    return v;
  };
  cudaGraph_t graph = capture(false);
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  float unwritten = 0.0f;  // nothing ran at the capture: `out` was never written
  (void)cudaMemcpy(&unwritten, out, sizeof unwritten, cudaMemcpyDeviceToHost);
  EXPECT_EQ(fired(), "initcheck");
  sim::clear_error();
  cudaGraphExec_t exec = nullptr;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  EXPECT_EQ(out0(), 2.0f);
  for (int i = 0; i < 64; ++i) pinned[i] = 5.0f;  // the next launch copies the pinned bytes anew
  ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  EXPECT_EQ(out0(), 5.0f);
  cudaGraph_t same = capture(false), other = capture(true);
  cudaGraphExecUpdateResultInfo info{};
  EXPECT_EQ(cudaGraphExecUpdate(exec, same, &info), cudaSuccess);
  EXPECT_EQ(info.result, cudaGraphExecUpdateSuccess);
  EXPECT_EQ(cudaGraphExecUpdate(exec, other, &info), cudaErrorGraphExecUpdateFailure);
  EXPECT_EQ(info.result, cudaGraphExecUpdateErrorTopologyChanged);
  (void)cudaGetLastError();
  EXPECT_EQ(fired(), "");
  // Refused in a capture: a stream synchronization, a copy to the host.
  for (int refused = 0; refused < 2; ++refused) {
    ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeRelaxed), cudaSuccess);
    launch<copy_kernel>(1, 64, 0, stream, in, out, 64);
    float host[64];
    EXPECT_EQ(refused == 0 ? cudaStreamSynchronize(stream)
                           : cudaMemcpyAsync(host, out, sizeof host, cudaMemcpyDeviceToHost, stream),
              cudaErrorStreamCaptureUnsupported);
    EXPECT_EQ(sim::last_check(), "capture");
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    EXPECT_EQ(cudaStreamIsCapturing(stream, &status), cudaSuccess);
    EXPECT_EQ(status, cudaStreamCaptureStatusInvalidated);
    cudaGraph_t broken = nullptr;
    EXPECT_EQ(cudaStreamEndCapture(stream, &broken), cudaErrorStreamCaptureInvalidated);
    EXPECT_EQ(broken, nullptr);
    (void)cudaGetLastError();
    sim::clear_error();
  }
  for (cudaGraph_t g : {graph, same, other}) EXPECT_EQ(cudaGraphDestroy(g), cudaSuccess);
  EXPECT_EQ(cudaGraphExecDestroy(exec), cudaSuccess);
  EXPECT_EQ(cudaStreamDestroy(stream), cudaSuccess);
  EXPECT_EQ(cudaFreeHost(pinned), cudaSuccess);
}

using CudaSimDeathTest = CudaSimChecks;

TEST_F(CudaSimDeathTest, AHostReadOfDeviceMemoryIsAFault) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  const std::vector<float> values(16, 1.0f);
  const float* x = device_values(values);
  float copy = 0;
  ASSERT_EQ(cudaMemcpy(&copy, x, 4, cudaMemcpyDeviceToHost), cudaSuccess);  // through the runtime: fine
  EXPECT_EQ(copy, 1.0f);
  EXPECT_DEATH(
      {
        volatile float v = x[3];  // host code dereferencing a device pointer
        (void)v;
      },
      "host-access: host code accessed device memory at 0x[0-9a-f]+: device memory is not addressable from the host");
}

// __float2half and __float2bfloat16 round as the hardware's cvt.rn: against GCC's _Float16 (IEEE
// round to nearest even, subnormals and overflow included) and Loom's own bf16 (core/dtype.h)
// on every 61st float bit pattern (70 million); .rz never rounds up; widening is exact.
TEST(CudaSimRuntime, HalfAndBfloat16ConversionsRoundAsTheHardware) {
  int64_t wrong_half = 0, wrong_bf16 = 0, wrong_rz = 0;
  for (uint64_t i = 0; i < (uint64_t{1} << 32); i += 61) {
    const uint32_t u = static_cast<uint32_t>(i);
    float f;
    std::memcpy(&f, &u, 4);
    if (std::isnan(f)) {
      wrong_half += __half_as_ushort(__float2half(f)) != 0x7fff;
      wrong_bf16 += __bfloat16_as_ushort(__float2bfloat16(f)) != 0x7fff;
      continue;
    }
    const _Float16 reference = static_cast<_Float16>(f);
    uint16_t bits;
    std::memcpy(&bits, &reference, 2);
    wrong_half += __half_as_ushort(__float2half(f)) != bits;
    wrong_bf16 += __bfloat16_as_ushort(__float2bfloat16(f)) != f32_to_bf16(f).bits;
    const float rz = __half2float(__float2half_rz(f)), rz16 = __bfloat162float(__float2bfloat16_rz(f));
    wrong_rz += std::abs(rz) > std::abs(f) || std::abs(rz16) > std::abs(f);
  }
  EXPECT_EQ(wrong_half, 0);
  EXPECT_EQ(wrong_bf16, 0);
  EXPECT_EQ(wrong_rz, 0);
  for (uint32_t h = 0; h < 65536; ++h) {  // every half widens exactly
    _Float16 reference;
    const uint16_t bits = static_cast<uint16_t>(h);
    std::memcpy(&reference, &bits, 2);
    const float a = static_cast<float>(reference), b = __half2float(__ushort_as_half(bits));
    if (!std::isnan(a)) {
      ASSERT_EQ(std::memcmp(&a, &b, 4), 0) << h;
    }
  }
  EXPECT_EQ(__half_as_ushort(__float2half(65520.0f)), 0x7c00);   // rounds to infinity
  EXPECT_EQ(__half_as_ushort(__float2half_rz(65520.0f)), 0x7bff);  // the largest finite
  EXPECT_EQ(__half_as_ushort(__float2half(2.9802322e-8f)), 0x0000);  // 2^-25: a tie, to even (zero)
  EXPECT_EQ(__half_as_ushort(__float2half(4.4703484e-8f)), 0x0001);  // 1.5 * 2^-25 rounds up
}

TEST(CudaSimRuntime, BlocksRunInASeededOrderAndTheDevicePropertiesAreAnH100s) {
  cudaDeviceProp prop{};
  ASSERT_EQ(cudaGetDeviceProperties(&prop, 0), cudaSuccess);
  EXPECT_EQ(prop.major, 9);
  EXPECT_EQ(prop.multiProcessorCount, 132);
  EXPECT_EQ(prop.sharedMemPerBlockOptin, 227u * 1024u);
  EXPECT_EQ(sim::block_order_seed(), 1u);  // LOOM_SIM_SEED unset in the test
}

// No check fired outside CudaSimChecks: the backend's kernels trigger none.
class NoReportsListener : public ::testing::EmptyTestEventListener {
  void OnTestEnd(const ::testing::TestInfo& info) override {
    const std::string suite = info.test_suite_name();
    if (suite.rfind("CudaSim", 0) == 0) return;
    (void)cudaDeviceSynchronize();
    const std::string report = sim::last_report();
    if (!report.empty()) {
      std::fprintf(stderr, "a simulator check fired in %s.%s: %s\n", info.test_suite_name(), info.name(), report.c_str());
      failures_ += 1;
      sim::clear_error();
    }
  }

 public:
  static int failures_;
};
int NoReportsListener::failures_ = 0;

class NoReportsEnvironment : public ::testing::Environment {
  void SetUp() override { ::testing::UnitTest::GetInstance()->listeners().Append(new NoReportsListener); }
  void TearDown() override { EXPECT_EQ(NoReportsListener::failures_, 0) << "simulator checks fired (see above)"; }
};
const auto* const kNoReports = ::testing::AddGlobalTestEnvironment(new NoReportsEnvironment);

}  // namespace
}  // namespace loom
