// The CUDA implementation of the op interface: validates with the checks every backend shares
// (backend/checks.h), then enqueues kernels (cuda_kernels.cu, cuda_loss.cu, cuda_attention.cu) and cuBLASLt /
// cuBLAS GEMMs on one stream. Nothing synchronizes but the ops that return a host value (sum,
// sum_squares), read/write and synchronize; the id checks of embedding and cross-entropy are
// read there, all in one small copy (so a bad token id is a one-line error, never a silent wrong
// answer, without a wait inside the step: claim_flag / check_pending).
//
// GEMMs are in cuda_gemm.cpp, the other ops in the op files (cuda_backend_internal.h lists them).
#include "loom/backend/cuda/cuda_backend.h"
#include "loom/backend/cuda/cuda_backend_internal.h"

#include <cublasLt.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <utility>
#include <vector>

#include "loom/backend/block_cache.h"
#include "loom/backend/checks.h"
#include "loom/backend/cuda/cuda_check.h"
#include "loom/backend/cuda/cuda_flash_mma.h"
#include "loom/backend/cuda/cuda_kernels.h"
#include "loom/backend/cuda/cuda_loss.h"
#include "loom/core/env.h"
#include "loom/core/error.h"


namespace loom {
namespace cuda_backend_detail {

using checks::check_attention;
using checks::check_attention_backward;
using checks::check_attention_sinks;
using checks::check_bias_backward;
using checks::check_cross_entropy;
using checks::check_elementwise;
using checks::check_embedding;
using checks::check_output;
using checks::check_row_op;
using checks::dispatch_float;
using checks::expect_dtype;
using checks::expect_numel;
using checks::rows_of;

CudaAllocator::CudaAllocator(int device, cudaStream_t stream)
    : stream_(stream),
      cache_(str_cat("CUDA device ", device),
             [](size_t bytes) -> void* {
               void* ptr = nullptr;
               if (cudaMalloc(&ptr, bytes) != cudaSuccess) {
                 (void)cudaGetLastError();  // clear the sticky out-of-memory status
                 return nullptr;
               }
               return ptr;
             },
             [](void* ptr) { (void)cudaFree(ptr); }) {}

CudaBackend::CudaBackend(int device) : device_(device) {
  // The knobs first: a malformed value throws before any handle exists.
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
  panel_limits_.panel_bytes = static_cast<size_t>(
      env_integer("LOOM_CUDA_GEMM_PANEL_BYTES", static_cast<int64_t>(panel_limits_.panel_bytes), 0, kMax));
  panel_limits_.min_flops = static_cast<double>(
      env_integer("LOOM_CUDA_GEMM_PANEL_MIN_FLOPS", static_cast<int64_t>(panel_limits_.min_flops), 0, kMax));
  LOOM_CUDA_CHECK(cudaSetDevice(device_));
  LOOM_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  allocator_ = std::make_unique<CudaAllocator>(device_, stream_);
  LOOM_CUBLAS_STATUS(cublasLtCreate(&lt_));
  LOOM_CUBLAS_STATUS(cublasCreate(&cublas_));
  LOOM_CUBLAS_STATUS(cublasSetStream(cublas_, stream_));
  lt_workspace_ = Tensor::empty(*allocator_, {kLtWorkspaceBytes / 8}, DTYPE_F64, MEM_WORKSPACE);  // bytes
  LOOM_CUBLAS_STATUS(cublasSetWorkspace(cublas_, lt_workspace_.device_ptr(), kLtWorkspaceBytes));
  flags_ = Tensor::empty(*allocator_, {kFlagSlots}, DTYPE_F64, MEM_WORKSPACE);  // unsigned long longs
  partials_ = Tensor::empty(*allocator_, {cuda::kReducePartials}, DTYPE_F64, MEM_WORKSPACE);
}

CudaBackend::~CudaBackend() {
  abort_step_graph();
  (void)cudaStreamSynchronize(stream_);
  destroy_graphs();
  pending_.clear();  // a check nobody synchronized for is dropped with the backend
  workspace_ = Tensor();
  lt_workspace_ = Tensor();
  flags_ = Tensor();
  partials_ = Tensor();
  if (cublas_) (void)cublasDestroy(cublas_);
  if (lt_) (void)cublasLtDestroy(lt_);
  allocator_.reset();
  if (stream_) (void)cudaStreamDestroy(stream_);
}

BackendCapabilities CudaBackend::capabilities() const {
  BackendCapabilities caps;
  caps.zero_sharding = true;  // ZeRO's shard bookkeeping is fill / scale_inplace views and NCCL's collectives
  caps.every_optimizer = optim_ops_complete() && optim_factored_ops_complete();
  caps.model_parallel = parallel_ops_complete();
  caps.head_norm = head_norm_ops_complete();
  caps.mixture_of_experts = moe_ops_complete();
  caps.latent_attention = mla_ops_complete();
  caps.low_precision = quant_ops_complete();
  caps.bf16_attention = bf16_attention_ops_complete();
  caps.gradient_compression = compress_ops_complete();
  caps.dora = dora_ops_complete();
  caps.nf4 = nf4_ops_complete();
  caps.int_weights = int_weight_ops_complete();
  caps.compact_int_weights = caps.int_weights;  // the same kernels read f16 scales and missing zeros
  caps.kv_cache = decode_ops_complete();
  return caps;
}

void CudaBackend::write(const Tensor& dst, const void* host) {
  check_pending();  // before new ids may overwrite the ones a pending check names
  if (dst.nbytes() == 0) return;
  LOOM_CUDA_CHECK(cudaMemcpyAsync(dst.device_ptr(), host, dst.nbytes(), cudaMemcpyHostToDevice, stream_));
  LOOM_CUDA_CHECK(cudaStreamSynchronize(stream_));  // the host buffer may be reused on return
}

void CudaBackend::read(const Tensor& src, void* host) {
  unsigned long long bad[kFlagSlots];
  const bool checks = enqueue_pending_flags(bad);  // read in this same wait
  if (src.nbytes() > 0) {
    LOOM_CUDA_CHECK(cudaMemcpyAsync(host, src.device_ptr(), src.nbytes(), cudaMemcpyDeviceToHost, stream_));
  }
  if (src.nbytes() > 0 || checks) LOOM_CUDA_CHECK(cudaStreamSynchronize(stream_));
  if (checks) throw_pending(bad);
}

void CudaBackend::synchronize() {
  unsigned long long bad[kFlagSlots];
  const bool checks = enqueue_pending_flags(bad);
  LOOM_CUDA_CHECK(cudaStreamSynchronize(stream_));
  if (checks) throw_pending(bad);
}

void CudaBackend::fill(const Tensor& x, double value) {
  dispatch_float(x.dtype(), "fill", kBackend, [&]<typename T>() { cuda::fill<T>(dptr<T>(x), x.numel(), value, stream_); });
}

void CudaBackend::copy(const Tensor& src, const Tensor& dst) {
  expect_dtype(dst, src.dtype(), "copy", "dst");
  expect_numel(dst, src.numel(), "copy", "dst");
  if (src.nbytes() == 0) return;
  LOOM_CUDA_CHECK(
      cudaMemcpyAsync(dst.device_ptr(), src.device_ptr(), src.nbytes(), cudaMemcpyDeviceToDevice, stream_));
}

void CudaBackend::cast(const Tensor& src, const Tensor& dst) {
  expect_numel(dst, src.numel(), "cast", "dst");
  const int64_t n = src.numel();
  if (src.dtype() == dst.dtype()) return copy(src, dst);
  if (src.dtype() == DTYPE_F32 && dst.dtype() == DTYPE_BF16) {
    cuda::cast_f32_to_bf16(dptr<float>(src), dptr<uint16_t>(dst), n, stream_);
  } else if (src.dtype() == DTYPE_BF16 && dst.dtype() == DTYPE_F32) {
    cuda::cast_bf16_to_f32(dptr<uint16_t>(src), dptr<float>(dst), n, stream_);
  } else if (src.dtype() == DTYPE_F32 && dst.dtype() == DTYPE_F64) {
    cuda::cast_f32_to_f64(dptr<float>(src), dptr<double>(dst), n, stream_);
  } else if (src.dtype() == DTYPE_F64 && dst.dtype() == DTYPE_F32) {
    cuda::cast_f64_to_f32(dptr<double>(src), dptr<float>(dst), n, stream_);
  } else {
    throw Error(str_cat("cast: not supported from ", dtype_name(src.dtype()), " to ", dtype_name(dst.dtype())));
  }
}

void CudaBackend::add(const Tensor& a, const Tensor& b, const Tensor& out) {
  expect_dtype(b, a.dtype(), "add", "b");
  expect_dtype(out, a.dtype(), "add", "out");
  expect_numel(b, a.numel(), "add", "b");
  expect_numel(out, a.numel(), "add", "out");
  dispatch_float(a.dtype(), "add", kBackend,
                 [&]<typename T>() { cuda::add<T>(dptr<T>(a), dptr<T>(b), dptr<T>(out), a.numel(), stream_); });
}

void CudaBackend::scale_inplace(const Tensor& x, double factor) {
  dispatch_float(x.dtype(), "scale_inplace", kBackend,
                 [&]<typename T>() { cuda::scale<T>(dptr<T>(x), x.numel(), factor, stream_); });
}

void CudaBackend::bias_backward(const Tensor& dout, const Tensor& dbias) {
  const int64_t rows = rows_of(dout), cols = dout.dim(-1);
  if (check_bias_backward(dout, dbias)) {  // a bf16 dout, summed widened into an f32 dbias
    void* scratch = workspace(cuda::column_sums_scratch_bytes(rows, cols, sizeof(float)));
    cuda::column_sums_accumulate_bf16(dptr<uint16_t>(dout), rows, cols, dptr<float>(dbias), scratch, stream_);
    return;
  }
  dispatch_float(dout.dtype(), "bias_backward", kBackend, [&]<typename T>() {
    void* scratch = workspace(cuda::column_sums_scratch_bytes(rows, cols, sizeof(T)));
    cuda::column_sums_accumulate<T>(dptr<T>(dout), rows, cols, dptr<T>(dbias), scratch, stream_);
  });
}

void CudaBackend::embedding_forward(const Tensor& tokens, const Tensor& table, const Tensor* positions,
                       const Tensor& out) {
  const char* op = "embedding_forward";
  const auto [n_tokens, seq_len, channels] = check_embedding(op, tokens, table, positions, out);
  unsigned long long* bad = claim_flag();
  if (table.dtype() == DTYPE_BF16) {
    cuda::embedding_forward_bf16(dptr<int32_t>(tokens), static_cast<const uint16_t*>(table.device_ptr()),
                                 positions ? dptr<float>(*positions) : nullptr, dptr<float>(out), n_tokens, seq_len,
                                 channels, table.dim(0), bad, stream_);
  } else {
    dispatch_float(table.dtype(), op, kBackend, [&]<typename T>() {
      cuda::embedding_forward<T>(dptr<int32_t>(tokens), dptr<T>(table), positions ? dptr<T>(*positions) : nullptr,
                                 dptr<T>(out), n_tokens, seq_len, channels, table.dim(0), bad, stream_);
    });
  }
  defer_check(op, "token id", "position", tokens, table.dim(0));
}

void CudaBackend::embedding_backward(const Tensor& tokens, const Tensor& dout, const Tensor& dtable,
                        const Tensor* dpositions) {
  const char* op = "embedding_backward";
  const auto [n_tokens, seq_len, channels] = check_embedding(op, tokens, dtable, dpositions, dout);
  unsigned long long* bad = claim_flag();
  dispatch_float(dtable.dtype(), op, kBackend, [&]<typename T>() {
    void* scratch =
        workspace(cuda::embedding_backward_scratch_bytes(n_tokens, seq_len, channels, dtable.dim(0), sizeof(T)));
    cuda::embedding_backward<T>(dptr<int32_t>(tokens), dptr<T>(dout), dptr<T>(dtable),
                                dpositions ? dptr<T>(*dpositions) : nullptr, n_tokens, seq_len, channels,
                                dtable.dim(0), scratch, bad, stream_);
  });
  defer_check(op, "token id", "position", tokens, dtable.dim(0));
}

void CudaBackend::layernorm_forward(const Tensor& x, const Tensor& weight, const Tensor& bias, const Tensor& out,
                       const Tensor& mean, const Tensor& rstd, float eps) {
  const char* op = "layernorm_forward";
  check_row_op(op, x, {}, {&weight, &bias}, {&mean, &rstd});
  if (check_output(op, x, out, x.numel())) {  // a bf16 out: rounded as cast rounds
    cuda::layernorm_forward(dptr<float>(x), dptr<float>(weight), dptr<float>(bias), dptr<uint16_t>(out),
                            dptr<float>(mean), dptr<float>(rstd), rows_of(x), x.dim(-1), eps, stream_);
    return;
  }
  dispatch_float(x.dtype(), op, kBackend, [&]<typename T>() {
    cuda::layernorm_forward(dptr<T>(x), dptr<T>(weight), dptr<T>(bias), dptr<T>(out), dptr<T>(mean),
                               dptr<T>(rstd), rows_of(x), x.dim(-1), eps, stream_);
  });
}

void CudaBackend::layernorm_backward(const Tensor& dout, const Tensor& x, const Tensor& weight, const Tensor& mean,
                        const Tensor& rstd, const Tensor& dx, const Tensor& dweight, const Tensor& dbias,
                        bool accumulate, const Tensor& dx16) {
  const char* op = "layernorm_backward";
  check_row_op(op, x, {&dout, &dx}, {&weight, &dweight, &dbias}, {&mean, &rstd});
  uint16_t* rounded = checks::check_rounded_copy(op, x, dx, dx16) ? dptr<uint16_t>(dx16) : nullptr;
  dispatch_float(x.dtype(), op, kBackend, [&]<typename T>() {
    void* scratch = workspace(cuda::norm_backward_scratch_bytes(rows_of(x), x.dim(-1), sizeof(T)));
    cuda::layernorm_backward<T>(dptr<T>(dout), dptr<T>(x), dptr<T>(weight), dptr<T>(mean), dptr<T>(rstd),
                                dptr<T>(dx), rounded, dptr<T>(dweight), dptr<T>(dbias), rows_of(x), x.dim(-1), scratch,
                                accumulate, stream_);
  });
}

void CudaBackend::rmsnorm_forward(const Tensor& x, const Tensor& weight, const Tensor& out, const Tensor& rstd,
                     float eps) {
  const char* op = "rmsnorm_forward";
  check_row_op(op, x, {}, {&weight}, {&rstd});
  if (check_output(op, x, out, x.numel())) {
    cuda::rmsnorm_forward(dptr<float>(x), dptr<float>(weight), dptr<uint16_t>(out), dptr<float>(rstd), rows_of(x),
                          x.dim(-1), eps, stream_);
    return;
  }
  dispatch_float(x.dtype(), op, kBackend, [&]<typename T>() {
    cuda::rmsnorm_forward(dptr<T>(x), dptr<T>(weight), dptr<T>(out), dptr<T>(rstd), rows_of(x), x.dim(-1), eps,
                             stream_);
  });
}

void CudaBackend::rmsnorm_backward(const Tensor& dout, const Tensor& x, const Tensor& weight, const Tensor& rstd,
                      const Tensor& dx, const Tensor& dweight, bool accumulate, const Tensor& dx16) {
  const char* op = "rmsnorm_backward";
  check_row_op(op, x, {&dout, &dx}, {&weight, &dweight}, {&rstd});
  uint16_t* rounded = checks::check_rounded_copy(op, x, dx, dx16) ? dptr<uint16_t>(dx16) : nullptr;
  dispatch_float(x.dtype(), op, kBackend, [&]<typename T>() {
    void* scratch = workspace(cuda::norm_backward_scratch_bytes(rows_of(x), x.dim(-1), sizeof(T)));
    cuda::rmsnorm_backward<T>(dptr<T>(dout), dptr<T>(x), dptr<T>(weight), dptr<T>(rstd), dptr<T>(dx), rounded,
                              dptr<T>(dweight), rows_of(x), x.dim(-1), scratch, accumulate, stream_);
  });
}

namespace {
// fn(x's elements, out's elements) for an activation whose x or out is bf16 (checks::ActivationIo):
// bf16 bits or floats each.
template <typename Fn>
void with_mixed_io(const Tensor& x, const Tensor& out, checks::ActivationIo io, Fn&& fn) {
  if (io.x_bf16 && io.out_bf16) fn(dptr<uint16_t>(x), dptr<uint16_t>(out));
  else if (io.x_bf16) fn(dptr<uint16_t>(x), dptr<float>(out));
  else fn(dptr<float>(x), dptr<uint16_t>(out));
}
}  // namespace

void CudaBackend::gelu_forward(const Tensor& x, const Tensor& out) {
  const checks::ActivationIo io = checks::check_activation("gelu_forward", x, out, x.numel());
  if (io.mixed()) {
    with_mixed_io(x, out, io, [&](const auto* xs, auto* o) { cuda::gelu_forward<float>(xs, o, x.numel(), stream_); });
    return;
  }
  dispatch_float(x.dtype(), "gelu_forward", kBackend,
                 [&]<typename T>() { cuda::gelu_forward<T>(dptr<T>(x), dptr<T>(out), x.numel(), stream_); });
}

void CudaBackend::gelu_backward(const Tensor& x, const Tensor& dout, const Tensor& dx) {
  const checks::ActivationIo io = checks::check_activation("gelu_backward", x, dx, x.numel(), &dout, x.numel());
  if (io.mixed()) {
    with_mixed_io(x, dx, io, [&](const auto* xs, auto* d) {
      cuda::gelu_backward<float>(xs, dptr<float>(dout), d, x.numel(), stream_);
    });
    return;
  }
  dispatch_float(x.dtype(), "gelu_backward", kBackend, [&]<typename T>() {
    cuda::gelu_backward<T>(dptr<T>(x), dptr<T>(dout), dptr<T>(dx), x.numel(), stream_);
  });
}

void CudaBackend::glu_forward(const Tensor& x, const Tensor& out, GateActivation act) {
  const char* op = "glu_forward";
  checks::check_glu_shapes(op, x, out);
  const checks::ActivationIo io = checks::check_activation(op, x, out, out.numel());
  if (io.mixed()) {
    with_mixed_io(x, out, io, [&](const auto* xs, auto* o) {
      cuda::glu_forward<float>(xs, o, rows_of(out), out.dim(-1), act, stream_);
    });
    return;
  }
  dispatch_float(x.dtype(), op, kBackend, [&]<typename T>() {
    cuda::glu_forward<T>(dptr<T>(x), dptr<T>(out), rows_of(out), out.dim(-1), act, stream_);
  });
}

void CudaBackend::glu_backward(const Tensor& x, const Tensor& dout, const Tensor& dx, GateActivation act) {
  const char* op = "glu_backward";
  checks::check_glu_shapes(op, x, dout);
  const checks::ActivationIo io = checks::check_activation(op, x, dx, x.numel(), &dout, x.numel() / 2);
  if (io.mixed()) {
    with_mixed_io(x, dx, io, [&](const auto* xs, auto* d) {
      cuda::glu_backward<float>(xs, dptr<float>(dout), d, rows_of(dout), dout.dim(-1), act, stream_);
    });
    return;
  }
  dispatch_float(x.dtype(), op, kBackend, [&]<typename T>() {
    cuda::glu_backward<T>(dptr<T>(x), dptr<T>(dout), dptr<T>(dx), rows_of(dout), dout.dim(-1), act, stream_);
  });
}

void CudaBackend::rope_forward(const Tensor& x, int64_t head_dim, int64_t n_heads, const RopeSpec& rope_spec,
                  int64_t pos_offset) {
  rope(x, head_dim, n_heads, rope_spec, pos_offset, 1.0, "rope_forward");
}

void CudaBackend::rope_backward(const Tensor& dx, int64_t head_dim, int64_t n_heads, const RopeSpec& rope_spec,
                   int64_t pos_offset) {
  rope(dx, head_dim, n_heads, rope_spec, pos_offset, -1.0, "rope_backward");
}

// A decoding step's rows in launches of up to kRopeRows rows of one span (longrope chooses its
// factors by the row's context: a step whose rows straddle original_context takes two groups).
void CudaBackend::rope_rows_forward(const Tensor& x, int64_t head_dim, int64_t n_heads, const RopeSpec& rope_spec,
                                   const std::vector<int64_t>& positions) {
  checks::check_rope_rows(x, head_dim, n_heads, positions);
  const int64_t n = x.dim(0), W = x.dim(2);
  dispatch_float(x.dtype(), "rope_rows_forward", kBackend, [&]<typename T>() {
    for (int64_t r = 0; r < n;) {
      const RopeSpec span = rope_span(rope_spec, positions[static_cast<size_t>(r)] + 1);
      cuda::RopeRows rows;
      const int64_t first = r;
      while (r < n && rows.n < cuda::kRopeRows &&
             rope_span(rope_spec, positions[static_cast<size_t>(r)] + 1).long_span == span.long_span) {
        rows.pos[rows.n++] = positions[static_cast<size_t>(r++)];
      }
      cuda::rope_rows<T>(dptr<T>(x) + first * W, rows, W, head_dim, n_heads, span, stream_);
    }
  });
}

void CudaBackend::attention_forward(const Tensor& qkv, const Tensor& out, const Tensor& probs, int64_t n_head,
                       int64_t n_kv_head, int64_t window) {
  const char* op = "attention_forward";
  const auto [batch, seq_len, head_dim] = check_attention(op, qkv, out, probs, n_head, n_kv_head, window, false);
  dispatch_float(qkv.dtype(), op, kBackend, [&]<typename T>() {
    cuda::attention_forward<T>(cublas_, dptr<T>(qkv), dptr<T>(out), dptr<T>(probs), batch, seq_len, n_head,
                               n_kv_head, head_dim, window, stream_);
  });
}

void CudaBackend::attention_backward(const Tensor& dout, const Tensor& qkv, const Tensor& out, const Tensor& probs,
                        const Tensor& dqkv, int64_t n_head, int64_t n_kv_head, int64_t window) {
  const char* op = "attention_backward";
  const auto [batch, seq_len, head_dim] =
      check_attention_backward(op, dout, qkv, out, probs, dqkv, n_head, n_kv_head, window, false);
  dispatch_float(qkv.dtype(), op, kBackend, [&]<typename T>() {
    void* scratch = workspace(cuda::attention_backward_scratch_bytes(batch, seq_len, n_head, head_dim, sizeof(T)));
    cuda::attention_backward<T>(cublas_, dptr<T>(dout), dptr<T>(qkv), dptr<T>(out), dptr<T>(probs), dptr<T>(dqkv),
                                scratch, batch, seq_len, n_head, n_kv_head, head_dim, window, stream_);
  });
}

void CudaBackend::flash_attention_forward(const Tensor& qkv, const Tensor& out, const Tensor& lse, int64_t n_head,
                             int64_t n_kv_head, int64_t window) {
  const char* op = "flash_attention_forward";
  const auto [batch, seq_len, head_dim] = check_attention(op, qkv, out, lse, n_head, n_kv_head, window, true);
  dispatch_float(qkv.dtype(), op, kBackend, [&]<typename T>() {
    cuda::flash_attention_forward<T>(dptr<T>(qkv), dptr<T>(out), dptr<T>(lse), batch, seq_len, n_head, n_kv_head,
                                     head_dim, window, stream_);
  });
}

void CudaBackend::flash_attention_backward(const Tensor& dout, const Tensor& qkv, const Tensor& out, const Tensor& lse,
                              const Tensor& dqkv, int64_t n_head, int64_t n_kv_head, int64_t window) {
  const char* op = "flash_attention_backward";
  const auto [batch, seq_len, head_dim] =
      check_attention_backward(op, dout, qkv, out, lse, dqkv, n_head, n_kv_head, window, true);
  dispatch_float(qkv.dtype(), op, kBackend, [&]<typename T>() {
    void* scratch = workspace(
        cuda::flash_attention_backward_scratch_bytes(batch, seq_len, n_head, n_kv_head, head_dim, sizeof(T)));
    cuda::flash_attention_backward<T>(dptr<T>(dout), dptr<T>(qkv), dptr<T>(out), dptr<T>(lse), dptr<T>(dqkv),
                                      scratch, batch, seq_len, n_head, n_kv_head, head_dim, window, stream_);
  });
}

void CudaBackend::attention_sink_forward(const Tensor& out, const Tensor& lse, const Tensor& sinks, int64_t n_head) {
  const char* op = "attention_sink_forward";
  const auto [batch, seq_len, head_dim] = check_attention_sinks(op, out, lse, sinks, n_head);
  dispatch_float(out.dtype(), op, kBackend, [&]<typename T>() {
    cuda::attention_sink_forward<T>(dptr<T>(out), dptr<T>(lse), dptr<T>(sinks), batch, seq_len, n_head, head_dim,
                                    stream_);
  });
}

void CudaBackend::attention_sink_backward(const Tensor& dout, const Tensor& out, const Tensor& lse, const Tensor& sinks,
                                          const Tensor& dsinks, int64_t n_head) {
  const char* op = "attention_sink_backward";
  const auto [batch, seq_len, head_dim] = check_attention_sinks(op, out, lse, sinks, n_head, &dout, &dsinks);
  dispatch_float(out.dtype(), op, kBackend, [&]<typename T>() {
    void* scratch = workspace(cuda::attention_sink_backward_scratch_bytes(batch, seq_len, n_head, sizeof(T)));
    cuda::attention_sink_backward<T>(dptr<T>(dout), dptr<T>(out), dptr<T>(lse), dptr<T>(sinks), dptr<T>(dsinks),
                                     scratch, batch, seq_len, n_head, head_dim, stream_);
  });
}

namespace {
bool aligned16(const Tensor& t) { return reinterpret_cast<uintptr_t>(t.device_ptr()) % 16 == 0; }
}  // namespace

// The tensor-core kernels read qkv and dout both f32 or both bf16, 16-byte aligned; an f32 input
// beside a bf16 one, or one not aligned, is read from a bf16 copy (the bits the kernels round it to).
Tensor CudaBackend::flash_input_bf16(const Tensor& x) {
  if (x.dtype() == DTYPE_BF16 && aligned16(x)) return x;
  const Tensor copy = Tensor::empty(allocator(), x.shape(), DTYPE_BF16, MEM_WORKSPACE);
  cast(x, copy);
  return copy;
}

void CudaBackend::flash_attention_forward_bf16(const Tensor& qkv, const Tensor& out, const Tensor& lse, int64_t n_head,
                                               int64_t n_kv_head) {
  const char* op = "flash_attention_forward_bf16";
  const auto [batch, seq_len, head_dim] = check_attention(op, qkv, out, lse, n_head, n_kv_head, 0, true, true);
  if ((qkv.dtype() != DTYPE_F32 && qkv.dtype() != DTYPE_BF16) || (head_dim != 64 && head_dim != 128)) {
    return Backend::flash_attention_forward_bf16(qkv, out, lse, n_head, n_kv_head);
  }
  const auto run = [&](const auto* in) {
    if (out.dtype() == DTYPE_BF16) {  // O kept in bf16 (precision.activations = bf16): rounded as stored
      cuda::flash_mma_attention_forward_as(in, dptr<uint16_t>(out), dptr<float>(lse), batch, seq_len, n_head,
                                           n_kv_head, head_dim, 0, stream_);
    } else {
      cuda::flash_mma_attention_forward_as(in, dptr<float>(out), dptr<float>(lse), batch, seq_len, n_head, n_kv_head,
                                           head_dim, 0, stream_);
    }
  };
  if (qkv.dtype() == DTYPE_F32 && aligned16(qkv)) run(dptr<float>(qkv));
  else run(dptr<uint16_t>(flash_input_bf16(qkv)));
}

void CudaBackend::flash_attention_backward_bf16(const Tensor& dout, const Tensor& qkv, const Tensor& out,
                                                const Tensor& lse, const Tensor& dqkv, int64_t n_head,
                                                int64_t n_kv_head) {
  const char* op = "flash_attention_backward_bf16";
  const auto [batch, seq_len, head_dim] =
      check_attention_backward(op, dout, qkv, out, lse, dqkv, n_head, n_kv_head, 0, true, true);
  if ((qkv.dtype() != DTYPE_F32 && qkv.dtype() != DTYPE_BF16) || (head_dim != 64 && head_dim != 128)) {
    return Backend::flash_attention_backward_bf16(dout, qkv, out, lse, dqkv, n_head, n_kv_head);
  }
  void* scratch = workspace(cuda::flash_mma_attention_backward_scratch_bytes(batch, seq_len, n_head, n_kv_head, head_dim));
  const bool o16 = out.dtype() == DTYPE_BF16, g16 = dqkv.dtype() == DTYPE_BF16;  // O kept, dqkv wanted, in bf16
  const auto run = [&](const auto* d_out, const auto* in) {
    const auto with = [&](const auto* o, auto* g) {
      cuda::flash_mma_attention_backward_as(d_out, in, o, dptr<float>(lse), g, scratch, batch, seq_len, n_head,
                                            n_kv_head, head_dim, 0, stream_);
    };
    if (o16 && g16) with(dptr<uint16_t>(out), dptr<uint16_t>(dqkv));
    else if (o16) with(dptr<uint16_t>(out), dptr<float>(dqkv));
    else if (g16) with(dptr<float>(out), dptr<uint16_t>(dqkv));
    else with(dptr<float>(out), dptr<float>(dqkv));
  };
  if (qkv.dtype() == DTYPE_F32 && dout.dtype() == DTYPE_F32 && aligned16(qkv) && aligned16(dout)) {
    run(dptr<float>(dout), dptr<float>(qkv));
  } else {
    run(dptr<uint16_t>(flash_input_bf16(dout)), dptr<uint16_t>(flash_input_bf16(qkv)));
  }
}

void CudaBackend::cross_entropy_forward(const Tensor& logits, const Tensor& targets, const Tensor& losses,
                           const Tensor& lse) {
  const char* op = "cross_entropy_forward";
  check_cross_entropy(op, logits, targets, lse);
  expect_dtype(losses, logits.dtype(), op, "losses");
  expect_numel(losses, rows_of(logits), op, "losses");
  unsigned long long* bad = claim_flag();
  dispatch_float(logits.dtype(), op, kBackend, [&]<typename T>() {
    cuda::cross_entropy_forward<T>(dptr<T>(logits), dptr<int32_t>(targets), dptr<T>(losses), dptr<T>(lse),
                                   rows_of(logits), logits.dim(-1), bad, stream_);
  });
  defer_check(op, "target", "row", targets, logits.dim(-1));
}

void CudaBackend::cross_entropy_backward(const Tensor& logits, const Tensor& targets, const Tensor& lse, float dloss,
                            const Tensor& dlogits) {
  const char* op = "cross_entropy_backward";
  check_cross_entropy(op, logits, targets, lse);
  check_elementwise(op, logits, {&dlogits});
  // The forward on the same targets has validated them.
  dispatch_float(logits.dtype(), op, kBackend, [&]<typename T>() {
    cuda::cross_entropy_backward<T>(dptr<T>(logits), dptr<int32_t>(targets), dptr<T>(lse), dloss, dptr<T>(dlogits),
                                    rows_of(logits), logits.dim(-1), stream_);
  });
}

void CudaBackend::cross_entropy_loss_and_grad(const Tensor& logits, const Tensor& targets, const Tensor& losses,
                                              const Tensor& lse, float dloss, const Tensor& dlogits) {
  loss_and_grad("cross_entropy_loss_and_grad", false, logits, targets, losses, lse, dloss, dlogits);
}

bool CudaBackend::logits_by_columns(int64_t rows, int64_t vocab) const {
  return !row_aligned(vocab, 2) && row_aligned(rows, 2);
}

void CudaBackend::cross_entropy_loss_and_grad_columns(const Tensor& logits, const Tensor& targets,
                                                      const Tensor& losses, const Tensor& lse, float dloss,
                                                      const Tensor& dlogits) {
  loss_and_grad("cross_entropy_loss_and_grad_columns", true, logits, targets, losses, lse, dloss, dlogits);
}

void CudaBackend::loss_and_grad(const char* op, bool by_columns, const Tensor& logits, const Tensor& targets,
                                const Tensor& losses, const Tensor& lse, float dloss, const Tensor& dlogits) {
  const checks::LossGradOut out = checks::check_loss_and_grad(op, logits, targets, losses, lse, dlogits, by_columns);
  const int64_t rows = targets.numel(), vocab = by_columns ? logits.dim(0) : logits.dim(-1);
  unsigned long long* bad = claim_flag();
  const auto run = [&]<typename T, typename L, typename D>(D* d) {
    (by_columns ? cuda::cross_entropy_loss_and_grad_columns<T, L, D> : cuda::cross_entropy_loss_and_grad<T, L, D>)(
        dptr<L>(logits), dptr<int32_t>(targets), dptr<T>(losses), dptr<T>(lse), dloss, d, rows, vocab, bad, stream_);
  };
  if (out == checks::LossGradOut::to_bf16) {
    run.template operator()<float, float>(dptr<uint16_t>(dlogits));
  } else if (out == checks::LossGradOut::bf16_in_place) {
    run.template operator()<float, uint16_t>(dptr<uint16_t>(logits));
  } else {
    dispatch_float(logits.dtype(), op, kBackend, [&]<typename T>() { run.template operator()<T, T>(dptr<T>(logits)); });
  }
  defer_check(op, "target", "row", targets, vocab);
}

void CudaBackend::adamw_step(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v,
                const AdamWHyper& h) {
  const char* op = "adamw_step";
  check_elementwise(op, param, {&grad, &m, &v});
  LOOM_CHECK(h.step >= 1, op, ": step must be >= 1 (bias correction), got ", h.step);
  const double bias1 = 1.0 - std::pow(static_cast<double>(h.beta1), static_cast<double>(h.step));
  const double bias2 = 1.0 - std::pow(static_cast<double>(h.beta2), static_cast<double>(h.step));
  dispatch_float(param.dtype(), op, kBackend, [&]<typename T>() {
    cuda::adamw_step<T>(dptr<T>(param), dptr<T>(grad), dptr<T>(m), dptr<T>(v), param.numel(), h.lr, h.beta1,
                        h.beta2, h.eps, h.weight_decay, h.grad_scale, static_cast<T>(bias1), static_cast<T>(bias2),
                        stream_);
  });
}

double CudaBackend::reduce(const Tensor& x, bool squares, const char* op) {
  dispatch_float(x.dtype(), op, kBackend, [&]<typename T>() {
    cuda::reduce_partials<T>(dptr<T>(x), x.numel(), squares, dptr<double>(partials_), stream_);
  });
  std::vector<double> host(cuda::kReducePartials);
  read(partials_, host.data());
  double total = 0;
  for (double v : host) total += v;
  return total;
}

void CudaBackend::rope(const Tensor& x, int64_t head_dim, int64_t n_heads, const RopeSpec& rope_spec, int64_t pos_offset, double direction,
          const char* op) {
  checks::check_rope(op, x, head_dim, n_heads);
  dispatch_float(x.dtype(), op, kBackend, [&]<typename T>() {
    cuda::rope_rotate<T>(dptr<T>(x), x.dim(0), x.dim(1), x.dim(2), head_dim, n_heads,
                         rope_span(rope_spec, pos_offset + x.dim(1)), pos_offset, direction, stream_);
  });
}

void* CudaBackend::workspace(size_t bytes) {
  const int64_t want = static_cast<int64_t>((bytes + 7) / 8);  // 8-byte words
  if (!workspace_.defined() || workspace_.numel() < want) {
    workspace_ = Tensor();
    workspace_ = Tensor::empty(*allocator_, {std::max<int64_t>(want, 1)}, DTYPE_F64, MEM_WORKSPACE);
  }
  return workspace_.device_ptr();
}

}  // namespace cuda_backend_detail

namespace {

using cuda_backend_detail::CudaBackend;

CudaBackend& as_cuda(Backend& backend) {
  auto* cuda = dynamic_cast<CudaBackend*>(&backend);
  LOOM_CHECK(cuda != nullptr, "backend \"", backend.name(), "\" is not the CUDA backend");
  return *cuda;
}

}  // namespace

std::unique_ptr<Backend> make_cuda_backend() {
  int count = 0;
  const cudaError_t status = cudaGetDeviceCount(&count);
  LOOM_CHECK(status == cudaSuccess && count > 0, "device = \"cuda\": no CUDA device is visible (",
             status == cudaSuccess ? "cudaGetDeviceCount found 0" : cudaGetErrorString(status), ")");
  // Under mpirun, each rank on a node takes its own GPU: local rank modulo the visible GPUs.
  int device = 0;
  LOOM_CUDA_CHECK(cudaGetDevice(&device));
  for (const char* var : {"OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID"}) {
    if (const char* v = std::getenv(var); v != nullptr && *v != '\0') {
      device = static_cast<int>(env_integer(var, 0, 0, kMaxLaunchRanks - 1) % count);
      break;
    }
  }
  return std::make_unique<CudaBackend>(device);
}

cudaStream_t cuda_stream(Backend& backend) { return as_cuda(backend).stream(); }
int cuda_device(Backend& backend) { return as_cuda(backend).device(); }
size_t cuda_reserved_bytes(Backend& backend) { return as_cuda(backend).reserved_bytes(); }
int64_t cuda_panel_gemms(Backend& backend) { return as_cuda(backend).panel_gemms(); }
int64_t cuda_gelu_epilogue_gemms(Backend& backend) { return as_cuda(backend).gelu_epilogue_gemms(); }

}  // namespace loom
