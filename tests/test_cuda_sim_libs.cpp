// The CUDA simulator's libraries (src/loom/backend/cuda/sim/cublas.cpp, cub.cpp) against naive
// references computed on the host: cuBLAS's strided-batched GEMMs (f32, bf16 and f64 inputs, every
// transpose combination, leading dimensions above the row count, batches, beta 0 over NaN and beta
// 1), cuBLASLt's heuristic and matmul (the same products, plus the rules that make a real call
// fail: leading dimensions that are not multiples of 16 bytes, pointers less aligned than the
// preference promised, layouts that disagree), and CUB's SortPairs (stability, bit ranges, the
// temporary storage size). Data moves only through the CUDA API: host code here never touches
// device memory.
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <cub/device/device_radix_sort.cuh>
#include <limits>
#include <numbers>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "loom/backend/cuda/sim/sim_runtime.h"

namespace {

// ------------------------------------------------------------------------------------ helpers

size_t type_size(cudaDataType type) { return type == CUDA_R_64F ? 8 : type == CUDA_R_32F ? 4 : 2; }

// Host values are doubles; encode() stores them as `type` (f32, f64 or bf16: the upper half of a
// float, truncated: the tests only encode values that are already bf16).
std::vector<unsigned char> encode(const std::vector<double>& values, cudaDataType type) {
  std::vector<unsigned char> bytes(values.size() * type_size(type));
  for (size_t i = 0; i < values.size(); ++i) {
    unsigned char* out = bytes.data() + i * type_size(type);
    if (type == CUDA_R_64F) {
      std::memcpy(out, &values[i], 8);
    } else {
      const float f = static_cast<float>(values[i]);
      if (type == CUDA_R_32F) {
        std::memcpy(out, &f, 4);
      } else {
        uint32_t bits;
        std::memcpy(&bits, &f, 4);
        const uint16_t half = static_cast<uint16_t>(bits >> 16);
        std::memcpy(out, &half, 2);
      }
    }
  }
  return bytes;
}

double decode(const std::vector<unsigned char>& bytes, cudaDataType type, size_t i) {
  const unsigned char* in = bytes.data() + i * type_size(type);
  if (type == CUDA_R_64F) {
    double d;
    std::memcpy(&d, in, 8);
    return d;
  }
  float f;
  if (type == CUDA_R_32F) {
    std::memcpy(&f, in, 4);
  } else {
    uint16_t half;
    std::memcpy(&half, in, 2);
    const uint32_t bits = static_cast<uint32_t>(half) << 16;
    std::memcpy(&f, &bits, 4);
  }
  return f;
}

// Random values in [-1, 1] that `type` holds exactly.
std::vector<double> random_values(size_t n, cudaDataType type, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<double> dist(-1.0, 1.0);
  std::vector<double> v(n);
  for (double& x : v) x = dist(rng);
  const std::vector<unsigned char> bytes = encode(v, type);
  for (size_t i = 0; i < n; ++i) v[i] = decode(bytes, type, i);
  return v;
}

// A device allocation, filled and read back with cudaMemcpy.
class DeviceBytes {
 public:
  explicit DeviceBytes(size_t bytes) : bytes_(bytes) { EXPECT_EQ(cudaMalloc(&ptr_, bytes_), cudaSuccess); }
  explicit DeviceBytes(const std::vector<unsigned char>& host) : DeviceBytes(host.size()) { upload(host); }
  ~DeviceBytes() { (void)cudaFree(ptr_); }
  DeviceBytes(const DeviceBytes&) = delete;
  DeviceBytes& operator=(const DeviceBytes&) = delete;

  void* get() const { return ptr_; }
  void upload(const std::vector<unsigned char>& host) {
    ASSERT_LE(host.size(), bytes_);
    ASSERT_EQ(cudaMemcpy(ptr_, host.data(), host.size(), cudaMemcpyHostToDevice), cudaSuccess);
  }
  std::vector<unsigned char> download() const {
    std::vector<unsigned char> host(bytes_);
    EXPECT_EQ(cudaMemcpy(host.data(), ptr_, bytes_, cudaMemcpyDeviceToHost), cudaSuccess);
    return host;
  }

 private:
  void* ptr_ = nullptr;
  size_t bytes_;
};

template <typename T>
std::vector<unsigned char> as_bytes(const std::vector<T>& v) {
  std::vector<unsigned char> bytes(v.size() * sizeof(T));
  std::memcpy(bytes.data(), v.data(), bytes.size());
  return bytes;
}

template <typename T>
std::vector<T> from_bytes(const std::vector<unsigned char>& bytes, size_t n) {
  std::vector<T> v(n);
  std::memcpy(v.data(), bytes.data(), n * sizeof(T));
  return v;
}

// ------------------------------------------------------------------------------------ GEMM shapes

// A strided-batched column-major product C_p = alpha op(A_p) op(B_p) + beta C_p, with leading
// dimensions and batch strides (elements) that leave gaps the call must not touch.
struct GemmShape {
  bool trans_a = false, trans_b = false;
  int m = 6, n = 5, k = 7, batch = 3;
  int lda = 0, ldb = 0, ldc = 0;
  long long stride_a = 0, stride_b = 0, stride_c = 0;

  int a_rows() const { return trans_a ? k : m; }
  int a_cols() const { return trans_a ? m : k; }
  int b_rows() const { return trans_b ? n : k; }
  int b_cols() const { return trans_b ? k : n; }
  size_t a_elems() const { return static_cast<size_t>(stride_a * (batch - 1) + lda * a_cols()); }
  size_t b_elems() const { return static_cast<size_t>(stride_b * (batch - 1) + ldb * b_cols()); }
  size_t c_elems() const { return static_cast<size_t>(stride_c * (batch - 1) + ldc * n); }
};

int round_up(int x, int multiple) { return (x + multiple - 1) / multiple * multiple; }

// Leading dimensions `pad` elements above the row count and batch strides a column above the
// matrix, all rounded up to `multiple` elements (cuBLASLt's 16-byte rule).
GemmShape make_shape(bool trans_a, bool trans_b, int pad, int multiple) {
  GemmShape s;
  s.trans_a = trans_a;
  s.trans_b = trans_b;
  s.lda = round_up(s.a_rows() + pad, multiple);
  s.ldb = round_up(s.b_rows() + pad, multiple);
  s.ldc = round_up(s.m + pad, multiple);
  s.stride_a = round_up(s.lda * (s.a_cols() + 1), multiple);
  s.stride_b = round_up(s.ldb * (s.b_cols() + 1), multiple);
  s.stride_c = round_up(s.ldc * (s.n + 1), multiple);
  return s;
}

// The expected C over its whole allocation: the product where a batch matrix covers it, the old
// value elsewhere; `bound` is the magnitude the rounding error scales with (0 outside).
struct Expected {
  std::vector<double> value;
  std::vector<double> bound;
  std::vector<bool> written;
};

Expected reference_gemm(const GemmShape& s, const std::vector<double>& a, const std::vector<double>& b,
                        const std::vector<double>& c, double alpha, double beta) {
  Expected e{c, std::vector<double>(c.size(), 0.0), std::vector<bool>(c.size(), false)};
  for (int p = 0; p < s.batch; ++p) {
    for (int j = 0; j < s.n; ++j) {
      for (int i = 0; i < s.m; ++i) {
        double sum = 0, magnitude = 0;
        for (int q = 0; q < s.k; ++q) {
          const double x = a[p * s.stride_a + (s.trans_a ? q + i * s.lda : i + q * s.lda)];
          const double y = b[p * s.stride_b + (s.trans_b ? j + q * s.ldb : q + j * s.ldb)];
          sum += x * y;
          magnitude += std::fabs(x * y);
        }
        const size_t at = static_cast<size_t>(p * s.stride_c + i + j * s.ldc);
        const double old = beta == 0 ? 0.0 : c[at];  // beta == 0: C is not read
        e.value[at] = alpha * sum + beta * old;
        e.bound[at] = std::fabs(alpha) * magnitude + std::fabs(beta * old);
        e.written[at] = true;
      }
    }
  }
  return e;
}

// `after` (C or D downloaded, `type`) against the reference: within the relative tolerance where
// written, and byte for byte what it was (`before`) everywhere else.
void expect_matches(const Expected& e, const std::vector<unsigned char>& before,
                    const std::vector<unsigned char>& after, cudaDataType type, double tolerance,
                    const std::string& label) {
  const size_t esize = type_size(type);
  int mismatches = 0;
  for (size_t i = 0; i < e.value.size() && mismatches < 5; ++i) {
    if (e.written[i]) {
      const double got = decode(after, type, i);
      const double allowed = tolerance * e.bound[i] + (type == CUDA_R_16BF ? std::fabs(e.value[i]) / 256 : 0.0);
      if (!(std::fabs(got - e.value[i]) <= allowed)) {
        ADD_FAILURE() << label << ": element " << i << " is " << got << ", expected " << e.value[i] << " +- "
                      << allowed;
        ++mismatches;
      }
    } else if (std::memcmp(before.data() + i * esize, after.data() + i * esize, esize) != 0) {
      ADD_FAILURE() << label << ": element " << i << " outside every output matrix was changed";
      ++mismatches;
    }
  }
}

const char* op_name(bool trans) { return trans ? "T" : "N"; }

// ------------------------------------------------------------------------------------ fixture

class CudaSimLibs : public ::testing::Test {
 protected:
  void SetUp() override {
    loom::sim::clear_error();
    ASSERT_EQ(cudaStreamCreate(&stream_), cudaSuccess);
    ASSERT_EQ(cublasCreate(&blas_), CUBLAS_STATUS_SUCCESS);
    ASSERT_EQ(cublasSetStream(blas_, stream_), CUBLAS_STATUS_SUCCESS);
    ASSERT_EQ(cublasLtCreate(&lt_), CUBLAS_STATUS_SUCCESS);
  }
  void TearDown() override {
    EXPECT_EQ(cudaStreamSynchronize(stream_), cudaSuccess) << loom::sim::last_report();
    EXPECT_EQ(cublasLtDestroy(lt_), CUBLAS_STATUS_SUCCESS);
    EXPECT_EQ(cublasDestroy(blas_), CUBLAS_STATUS_SUCCESS);
    EXPECT_EQ(cudaStreamDestroy(stream_), cudaSuccess);
  }

  void sync() { ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess) << loom::sim::last_report(); }

  // A call that must fail with a simulator report: the report names `words`; the sticky error is
  // then cleared so the test can go on.
  void expect_report(const std::vector<std::string>& words) {
    const std::string report = loom::sim::last_report();
    for (const std::string& w : words)
      EXPECT_NE(report.find(w), std::string::npos) << "'" << w << "' not in: " << report;
    loom::sim::clear_error();
  }

  // cublasGemmStridedBatchedEx on fresh random data; checks C against the reference.
  void check_gemm_ex(const GemmShape& s, cudaDataType in_type, cudaDataType c_type, cublasComputeType_t compute,
                     double beta, double tolerance) {
    const std::string label = std::string("GemmStridedBatchedEx op(A)=") + op_name(s.trans_a) +
                              " op(B)=" + op_name(s.trans_b) + " beta=" + std::to_string(beta);
    const std::vector<double> a = random_values(s.a_elems(), in_type, 1);
    const std::vector<double> b = random_values(s.b_elems(), in_type, 2);
    std::vector<double> c = random_values(s.c_elems(), c_type, 3);
    if (beta == 0) std::fill(c.begin(), c.end(), std::numeric_limits<double>::quiet_NaN());
    const double alpha = 1.5;
    DeviceBytes da(encode(a, in_type)), db(encode(b, in_type)), dc(encode(c, c_type));
    const bool fp64 = compute == CUBLAS_COMPUTE_64F || compute == CUBLAS_COMPUTE_64F_PEDANTIC;
    const float alpha32 = static_cast<float>(alpha), beta32 = static_cast<float>(beta);
    const void* alpha_ptr = fp64 ? static_cast<const void*>(&alpha) : &alpha32;
    const void* beta_ptr = fp64 ? static_cast<const void*>(&beta) : &beta32;
    ASSERT_EQ(cublasGemmStridedBatchedEx(blas_, s.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N,
                                         s.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, s.m, s.n, s.k, alpha_ptr, da.get(),
                                         in_type, s.lda, s.stride_a, db.get(), in_type, s.ldb, s.stride_b, beta_ptr,
                                         dc.get(), c_type, s.ldc, s.stride_c, s.batch, compute, CUBLAS_GEMM_DEFAULT),
              CUBLAS_STATUS_SUCCESS)
        << label;
    sync();
    expect_matches(reference_gemm(s, a, b, c, alpha, beta), encode(c, c_type), dc.download(), c_type, tolerance, label);
  }

  cudaStream_t stream_ = nullptr;
  cublasHandle_t blas_ = nullptr;
  cublasLtHandle_t lt_ = nullptr;
};

// ------------------------------------------------------------------------------------ cuBLAS

TEST_F(CudaSimLibs, GemmStridedBatchedExF32AllTransposes) {
  for (bool ta : {false, true}) {
    for (bool tb : {false, true}) {
      for (double beta : {0.0, 1.0}) {
        check_gemm_ex(make_shape(ta, tb, 3, 1), CUDA_R_32F, CUDA_R_32F, CUBLAS_COMPUTE_32F_PEDANTIC, beta, 1e-6);
      }
    }
  }
}

TEST_F(CudaSimLibs, GemmStridedBatchedExBf16Inputs) {
  for (bool ta : {false, true}) {
    for (bool tb : {false, true}) {
      for (double beta : {0.0, 1.0}) {
        check_gemm_ex(make_shape(ta, tb, 2, 1), CUDA_R_16BF, CUDA_R_32F, CUBLAS_COMPUTE_32F, beta, 1e-6);
      }
    }
  }
  // bf16 output: rounded to nearest from the float result.
  check_gemm_ex(make_shape(false, true, 1, 1), CUDA_R_16BF, CUDA_R_16BF, CUBLAS_COMPUTE_32F, 1.0, 1e-6);
}

TEST_F(CudaSimLibs, GemmStridedBatchedExF64) {
  for (bool ta : {false, true}) {
    for (bool tb : {false, true}) {
      check_gemm_ex(make_shape(ta, tb, 1, 1), CUDA_R_64F, CUDA_R_64F, CUBLAS_COMPUTE_64F_PEDANTIC, 1.0, 1e-14);
    }
  }
}

// 32F compute is one fmaf per product in k order: bit-exact against the same chain on the host.
TEST_F(CudaSimLibs, SgemmAccumulatesWithFmaInKOrder) {
  const int m = 3, n = 4, k = 33;
  const std::vector<double> a = random_values(static_cast<size_t>(m * k), CUDA_R_32F, 4);
  const std::vector<double> b = random_values(static_cast<size_t>(k * n), CUDA_R_32F, 5);
  DeviceBytes da(encode(a, CUDA_R_32F)), db(encode(b, CUDA_R_32F)), dc(static_cast<size_t>(m * n) * 4);
  const float alpha = 1.0f, beta = 0.0f;
  ASSERT_EQ(cublasSgemm(blas_, CUBLAS_OP_N, CUBLAS_OP_N, m, n, k, &alpha, static_cast<const float*>(da.get()), m,
                        static_cast<const float*>(db.get()), k, &beta, static_cast<float*>(dc.get()), m),
            CUBLAS_STATUS_SUCCESS);
  sync();
  const std::vector<float> c = from_bytes<float>(dc.download(), static_cast<size_t>(m * n));
  for (int j = 0; j < n; ++j) {
    for (int i = 0; i < m; ++i) {
      float acc = 0.0f;
      for (int q = 0; q < k; ++q) {
        acc = std::fma(static_cast<float>(a[i + q * m]), static_cast<float>(b[q + j * k]), acc);
      }
      EXPECT_EQ(c[i + j * m], acc) << "C(" << i << ", " << j << ")";
    }
  }
}

TEST_F(CudaSimLibs, DgemmStridedBatched) {
  for (bool ta : {false, true}) {
    for (bool tb : {false, true}) {
      for (double beta : {0.0, 1.0}) {
        const GemmShape s = make_shape(ta, tb, 2, 1);
        const std::vector<double> a = random_values(s.a_elems(), CUDA_R_64F, 6);
        const std::vector<double> b = random_values(s.b_elems(), CUDA_R_64F, 7);
        std::vector<double> c = random_values(s.c_elems(), CUDA_R_64F, 8);
        if (beta == 0) std::fill(c.begin(), c.end(), std::numeric_limits<double>::quiet_NaN());
        const double alpha = -0.75;
        DeviceBytes da(as_bytes(a)), db(as_bytes(b)), dc(as_bytes(c));
        ASSERT_EQ(cublasDgemmStridedBatched(blas_, ta ? CUBLAS_OP_T : CUBLAS_OP_N, tb ? CUBLAS_OP_T : CUBLAS_OP_N, s.m,
                                            s.n, s.k, &alpha, static_cast<const double*>(da.get()), s.lda, s.stride_a,
                                            static_cast<const double*>(db.get()), s.ldb, s.stride_b, &beta,
                                            static_cast<double*>(dc.get()), s.ldc, s.stride_c, s.batch),
                  CUBLAS_STATUS_SUCCESS);
        sync();
        expect_matches(reference_gemm(s, a, b, c, alpha, beta), as_bytes(c), dc.download(), CUDA_R_64F, 1e-14,
                       std::string("Dgemm ") + op_name(ta) + op_name(tb));
      }
    }
  }
}

// alpha and beta in device memory (CUBLAS_POINTER_MODE_DEVICE) are read by the work on the stream.
TEST_F(CudaSimLibs, GemmExDevicePointerMode) {
  const GemmShape s = make_shape(false, false, 0, 1);
  const std::vector<double> a = random_values(s.a_elems(), CUDA_R_32F, 9);
  const std::vector<double> b = random_values(s.b_elems(), CUDA_R_32F, 10);
  const std::vector<double> c = random_values(s.c_elems(), CUDA_R_32F, 11);
  DeviceBytes da(encode(a, CUDA_R_32F)), db(encode(b, CUDA_R_32F)), dc(encode(c, CUDA_R_32F));
  DeviceBytes scalars(as_bytes(std::vector<float>{2.0f, 0.5f}));
  const float* alpha = static_cast<const float*>(scalars.get());
  ASSERT_EQ(cublasSetPointerMode(blas_, CUBLAS_POINTER_MODE_DEVICE), CUBLAS_STATUS_SUCCESS);
  ASSERT_EQ(cublasGemmStridedBatchedEx(blas_, CUBLAS_OP_N, CUBLAS_OP_N, s.m, s.n, s.k, alpha, da.get(), CUDA_R_32F,
                                       s.lda, s.stride_a, db.get(), CUDA_R_32F, s.ldb, s.stride_b, alpha + 1, dc.get(),
                                       CUDA_R_32F, s.ldc, s.stride_c, s.batch, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
            CUBLAS_STATUS_SUCCESS);
  sync();
  ASSERT_EQ(cublasSetPointerMode(blas_, CUBLAS_POINTER_MODE_HOST), CUBLAS_STATUS_SUCCESS);
  expect_matches(reference_gemm(s, a, b, c, 2.0, 0.5), encode(c, CUDA_R_32F), dc.download(), CUDA_R_32F, 1e-6,
                 "device pointer mode");
}

TEST_F(CudaSimLibs, CublasHandleState) {
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cublasGetStream(blas_, &stream), CUBLAS_STATUS_SUCCESS);
  EXPECT_EQ(stream, stream_);
  cublasPointerMode_t mode = CUBLAS_POINTER_MODE_DEVICE;
  ASSERT_EQ(cublasGetPointerMode(blas_, &mode), CUBLAS_STATUS_SUCCESS);
  EXPECT_EQ(mode, CUBLAS_POINTER_MODE_HOST);
  DeviceBytes workspace(1 << 12);
  EXPECT_EQ(cublasSetWorkspace(blas_, workspace.get(), 1 << 12), CUBLAS_STATUS_SUCCESS);
  EXPECT_EQ(cublasSetWorkspace(blas_, static_cast<char*>(workspace.get()) + 16, 256), CUBLAS_STATUS_INVALID_VALUE);
  EXPECT_STREQ(cublasGetStatusName(CUBLAS_STATUS_NOT_SUPPORTED), "CUBLAS_STATUS_NOT_SUPPORTED");
  EXPECT_STRNE(cublasGetStatusString(CUBLAS_STATUS_INVALID_VALUE), "");
  EXPECT_EQ(cublasCreate(nullptr), CUBLAS_STATUS_INVALID_VALUE);
}

TEST_F(CudaSimLibs, GemmExArgumentErrors) {
  const GemmShape s = make_shape(false, false, 0, 1);
  DeviceBytes da(s.a_elems() * 4), db(s.b_elems() * 4), dc(s.c_elems() * 4);
  const float one = 1.0f;
  // Everything valid except what `change` alters.
  const auto call = [&](auto change) {
    cublasHandle_t handle = blas_;
    cublasOperation_t ta = CUBLAS_OP_N;
    int m = s.m, n = s.n, k = s.k, lda = s.lda, ldb = s.ldb, ldc = s.ldc, batch = s.batch;
    cudaDataType atype = CUDA_R_32F, btype = CUDA_R_32F, ctype = CUDA_R_32F;
    cublasComputeType_t compute = CUBLAS_COMPUTE_32F;
    const float* alpha = &one;
    const void* a = da.get();
    change(handle, ta, m, n, k, lda, ldb, ldc, batch, atype, btype, ctype, compute, alpha, a);
    return cublasGemmStridedBatchedEx(handle, ta, CUBLAS_OP_N, m, n, k, alpha, a, atype, lda, s.stride_a, db.get(),
                                      btype, ldb, s.stride_b, &one, dc.get(), ctype, ldc, s.stride_c, batch, compute,
                                      CUBLAS_GEMM_DEFAULT);
  };
  using H = cublasHandle_t&;
  using Op = cublasOperation_t&;
  using T = cudaDataType&;
  using Cmp = cublasComputeType_t&;
  using P = const float*&;
  using V = const void*&;
  // Write the whole of A, B and C once so the later successful-looking calls read initialized memory.
  ASSERT_EQ(cudaMemset(da.get(), 0, s.a_elems() * 4), cudaSuccess);
  ASSERT_EQ(cudaMemset(db.get(), 0, s.b_elems() * 4), cudaSuccess);
  ASSERT_EQ(cudaMemset(dc.get(), 0, s.c_elems() * 4), cudaSuccess);

  EXPECT_EQ(call([](H h, Op, int&, int&, int&, int&, int&, int&, int&, T, T, T, Cmp, P, V) { h = nullptr; }),
            CUBLAS_STATUS_NOT_INITIALIZED);
  EXPECT_EQ(call([](H, Op, int& m, int&, int&, int&, int&, int&, int&, T, T, T, Cmp, P, V) { m = -1; }),
            CUBLAS_STATUS_INVALID_VALUE);
  EXPECT_EQ(call([](H, Op, int&, int&, int& k, int&, int&, int&, int&, T, T, T, Cmp, P, V) { k = -1; }),
            CUBLAS_STATUS_INVALID_VALUE);
  EXPECT_EQ(call([](H, Op, int&, int&, int&, int&, int&, int&, int& batch, T, T, T, Cmp, P, V) { batch = -1; }),
            CUBLAS_STATUS_INVALID_VALUE);
  EXPECT_EQ(call([&](H, Op, int&, int&, int&, int& lda, int&, int&, int&, T, T, T, Cmp, P, V) { lda = s.m - 1; }),
            CUBLAS_STATUS_INVALID_VALUE);
  // op(A) = A^T: A is stored k x m, so lda must be at least k.
  EXPECT_EQ(call([&](H, Op ta, int&, int&, int&, int& lda, int&, int&, int&, T, T, T, Cmp, P, V) {
              ta = CUBLAS_OP_T;
              lda = s.k - 1;
            }),
            CUBLAS_STATUS_INVALID_VALUE);
  EXPECT_EQ(call([&](H, Op, int&, int&, int&, int&, int& ldb, int&, int&, T, T, T, Cmp, P, V) { ldb = s.k - 1; }),
            CUBLAS_STATUS_INVALID_VALUE);
  EXPECT_EQ(call([&](H, Op, int&, int&, int&, int&, int&, int& ldc, int&, T, T, T, Cmp, P, V) { ldc = s.m - 1; }),
            CUBLAS_STATUS_INVALID_VALUE);
  EXPECT_EQ(call([](H, Op ta, int&, int&, int&, int&, int&, int&, int&, T, T, T, Cmp, P, V) {
              ta = static_cast<cublasOperation_t>(7);
            }),
            CUBLAS_STATUS_INVALID_VALUE);
  EXPECT_EQ(call([](H, Op, int&, int&, int&, int&, int&, int&, int&, T, T, T, Cmp, P alpha, V) { alpha = nullptr; }),
            CUBLAS_STATUS_INVALID_VALUE);
  // Type combinations cuBLAS has no kernel for.
  EXPECT_EQ(
      call([](H, Op, int&, int&, int&, int&, int&, int&, int&, T, T btype, T, Cmp, P, V) { btype = CUDA_R_16BF; }),
      CUBLAS_STATUS_NOT_SUPPORTED);
  EXPECT_EQ(
      call([](H, Op, int&, int&, int&, int&, int&, int&, int&, T a, T b, T c, Cmp, P, V) { a = b = c = CUDA_R_64F; }),
      CUBLAS_STATUS_NOT_SUPPORTED);  // f64 data with 32F compute
  EXPECT_EQ(call([](H, Op, int&, int&, int&, int&, int&, int&, int&, T, T, T, Cmp compute, P, V) {
              compute = CUBLAS_COMPUTE_64F;
            }),
            CUBLAS_STATUS_NOT_SUPPORTED);  // f32 data with 64F compute
  // Empty products are valid and do nothing.
  EXPECT_EQ(call([](H, Op, int& m, int&, int&, int&, int&, int&, int&, T, T, T, Cmp, P, V) { m = 0; }),
            CUBLAS_STATUS_SUCCESS);
  EXPECT_EQ(call([](H, Op, int&, int&, int&, int&, int&, int&, int& batch, T, T, T, Cmp, P, V) { batch = 0; }),
            CUBLAS_STATUS_SUCCESS);
  sync();
  EXPECT_EQ(loom::sim::last_report(), "");
}

// A, B and C must be device memory over every batch the call addresses.
TEST_F(CudaSimLibs, GemmExPointersOutsideDeviceMemory) {
  const GemmShape s = make_shape(false, false, 0, 1);
  DeviceBytes da(s.a_elems() * 4), db(s.b_elems() * 4), dc(s.c_elems() * 4);
  std::vector<float> host(s.c_elems());
  const float one = 1.0f;
  const auto gemm = [&](const void* a, const void* b, void* c, int batch) {
    return cublasGemmStridedBatchedEx(blas_, CUBLAS_OP_N, CUBLAS_OP_N, s.m, s.n, s.k, &one, a, CUDA_R_32F, s.lda,
                                      s.stride_a, b, CUDA_R_32F, s.ldb, s.stride_b, &one, c, CUDA_R_32F, s.ldc,
                                      s.stride_c, batch, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
  };
  EXPECT_EQ(gemm(host.data(), db.get(), dc.get(), s.batch), CUBLAS_STATUS_INVALID_VALUE);
  expect_report({"cublasGemmStridedBatchedEx", "matrix A"});
  EXPECT_EQ(gemm(da.get(), db.get(), host.data(), s.batch), CUBLAS_STATUS_INVALID_VALUE);
  expect_report({"cublasGemmStridedBatchedEx", "matrix C"});
  // One batch more than the allocations hold: the last batch's A is past the end of A's.
  EXPECT_EQ(gemm(da.get(), db.get(), dc.get(), s.batch + 1), CUBLAS_STATUS_INVALID_VALUE);
  expect_report({"cublasGemmStridedBatchedEx", "matrix A", "batch 3"});
}

// beta == 0 does not read C: C may be memory nothing has written yet.
TEST_F(CudaSimLibs, GemmExBetaZeroDoesNotReadC) {
  const GemmShape s = make_shape(false, false, 0, 1);
  const std::vector<double> a = random_values(s.a_elems(), CUDA_R_32F, 12);
  const std::vector<double> b = random_values(s.b_elems(), CUDA_R_32F, 13);
  DeviceBytes da(encode(a, CUDA_R_32F)), db(encode(b, CUDA_R_32F)), dc(s.c_elems() * 4);
  const float alpha = 1.0f, beta = 0.0f;
  ASSERT_EQ(cublasGemmStridedBatchedEx(blas_, CUBLAS_OP_N, CUBLAS_OP_N, s.m, s.n, s.k, &alpha, da.get(), CUDA_R_32F,
                                       s.lda, s.stride_a, db.get(), CUDA_R_32F, s.ldb, s.stride_b, &beta, dc.get(),
                                       CUDA_R_32F, s.ldc, s.stride_c, s.batch, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
            CUBLAS_STATUS_SUCCESS);
  sync();
  EXPECT_EQ(loom::sim::last_report(), "");
}

// A read of A that nothing wrote is initcheck's report, from the work on the stream.
TEST_F(CudaSimLibs, GemmExReadingUnwrittenMemoryIsReported) {
  const GemmShape s = make_shape(false, false, 0, 1);
  const std::vector<double> b = random_values(s.b_elems(), CUDA_R_32F, 14);
  DeviceBytes da(s.a_elems() * 4), db(encode(b, CUDA_R_32F)), dc(s.c_elems() * 4);
  const float alpha = 1.0f, beta = 0.0f;
  ASSERT_EQ(cublasGemmStridedBatchedEx(blas_, CUBLAS_OP_N, CUBLAS_OP_N, s.m, s.n, s.k, &alpha, da.get(), CUDA_R_32F,
                                       s.lda, s.stride_a, db.get(), CUDA_R_32F, s.ldb, s.stride_b, &beta, dc.get(),
                                       CUDA_R_32F, s.ldc, s.stride_c, s.batch, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
            CUBLAS_STATUS_SUCCESS);
  EXPECT_NE(cudaStreamSynchronize(stream_), cudaSuccess);
  EXPECT_EQ(loom::sim::last_check(), "initcheck");
  expect_report({"cublasGemmStridedBatchedEx A", "never written"});
}

// ------------------------------------------------------------------------------------ cuBLASLt

// The descriptors of one cublasLtMatmul, destroyed with it.
struct LtProblem {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;  // C's layout is D's too
  cublasLtMatmulPreference_t pref = nullptr;

  LtProblem(const GemmShape& s, cudaDataType in_type, cudaDataType out_type, cublasComputeType_t compute) {
    const cudaDataType scale = compute == CUBLAS_COMPUTE_64F ? CUDA_R_64F : CUDA_R_32F;
    EXPECT_EQ(cublasLtMatmulDescCreate(&desc, compute, scale), CUBLAS_STATUS_SUCCESS);
    const int32_t op_a = s.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, op_b = s.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
    EXPECT_EQ(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_a, sizeof op_a),
              CUBLAS_STATUS_SUCCESS);
    EXPECT_EQ(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_b, sizeof op_b),
              CUBLAS_STATUS_SUCCESS);
    a = layout(in_type, s.a_rows(), s.a_cols(), s.lda, s.batch, s.stride_a);
    b = layout(in_type, s.b_rows(), s.b_cols(), s.ldb, s.batch, s.stride_b);
    c = layout(out_type, s.m, s.n, s.ldc, s.batch, s.stride_c);
    EXPECT_EQ(cublasLtMatmulPreferenceCreate(&pref), CUBLAS_STATUS_SUCCESS);
    const uint64_t workspace = 1 << 20;
    EXPECT_EQ(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace,
                                                   sizeof workspace),
              CUBLAS_STATUS_SUCCESS);
  }
  ~LtProblem() {
    cublasLtMatmulPreferenceDestroy(pref);
    cublasLtMatrixLayoutDestroy(a);
    cublasLtMatrixLayoutDestroy(b);
    cublasLtMatrixLayoutDestroy(c);
    cublasLtMatmulDescDestroy(desc);
  }
  LtProblem(const LtProblem&) = delete;
  LtProblem& operator=(const LtProblem&) = delete;

  static cublasLtMatrixLayout_t layout(cudaDataType type, int rows, int cols, int ld, int batch, long long stride) {
    cublasLtMatrixLayout_t l = nullptr;
    EXPECT_EQ(cublasLtMatrixLayoutCreate(&l, type, static_cast<uint64_t>(rows), static_cast<uint64_t>(cols), ld),
              CUBLAS_STATUS_SUCCESS);
    const int32_t count = batch;
    const int64_t offset = stride;
    EXPECT_EQ(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count, sizeof count),
              CUBLAS_STATUS_SUCCESS);
    EXPECT_EQ(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &offset, sizeof offset),
              CUBLAS_STATUS_SUCCESS);
    return l;
  }

  cublasStatus_t heuristic(cublasLtHandle_t lt, cublasLtMatmulHeuristicResult_t* result, int* found) const {
    return cublasLtMatmulAlgoGetHeuristic(lt, desc, a, b, c, c, pref, 1, result, found);
  }
};

class CudaSimLt : public CudaSimLibs {
 protected:
  // Heuristic then cublasLtMatmul on random data, D separate from C or in place; checks D.
  void check_lt(const GemmShape& s, cudaDataType in_type, cudaDataType out_type, cublasComputeType_t compute,
                double beta, bool in_place, double tolerance) {
    const std::string label = std::string("cublasLtMatmul op(A)=") + op_name(s.trans_a) +
                              " op(B)=" + op_name(s.trans_b) + " beta=" + std::to_string(beta) +
                              (in_place ? " in place" : "");
    LtProblem lt(s, in_type, out_type, compute);
    cublasLtMatmulHeuristicResult_t result{};
    int found = 0;
    ASSERT_EQ(lt.heuristic(lt_, &result, &found), CUBLAS_STATUS_SUCCESS) << label;
    ASSERT_EQ(found, 1) << label;
    EXPECT_EQ(result.state, CUBLAS_STATUS_SUCCESS);

    const std::vector<double> a = random_values(s.a_elems(), in_type, 21);
    const std::vector<double> b = random_values(s.b_elems(), in_type, 22);
    std::vector<double> c = random_values(s.c_elems(), out_type, 23);
    if (beta == 0) std::fill(c.begin(), c.end(), std::numeric_limits<double>::quiet_NaN());
    const std::vector<double> d_before(s.c_elems(), -7.0);
    DeviceBytes da(encode(a, in_type)), db(encode(b, in_type)), dc(encode(c, out_type)), dd(encode(d_before, out_type));
    void* d = in_place ? dc.get() : dd.get();
    DeviceBytes workspace(1 << 20);
    const double alpha = 0.5;
    const float alpha32 = static_cast<float>(alpha), beta32 = static_cast<float>(beta);
    const bool fp64 = compute == CUBLAS_COMPUTE_64F;
    const void* alpha_ptr = fp64 ? static_cast<const void*>(&alpha) : &alpha32;
    const void* beta_ptr = fp64 ? static_cast<const void*>(&beta) : &beta32;
    ASSERT_EQ(cublasLtMatmul(lt_, lt.desc, alpha_ptr, da.get(), lt.a, db.get(), lt.b, beta_ptr, dc.get(), lt.c, d, lt.c,
                             &result.algo, workspace.get(), 1 << 20, stream_),
              CUBLAS_STATUS_SUCCESS)
        << label;
    sync();
    const Expected e = reference_gemm(s, a, b, c, alpha, beta);
    if (in_place) {
      expect_matches(e, encode(c, out_type), dc.download(), out_type, tolerance, label);
    } else {
      Expected on_d = e;  // outside the matrices D keeps its own old values
      for (size_t i = 0; i < on_d.value.size(); ++i) {
        if (!on_d.written[i]) on_d.value[i] = d_before[i];
      }
      expect_matches(on_d, encode(d_before, out_type), dd.download(), out_type, tolerance, label);
      EXPECT_EQ(dc.download(), encode(c, out_type)) << label << ": C changed";
    }
  }
};

TEST_F(CudaSimLt, F32AllTransposes) {
  for (bool ta : {false, true}) {
    for (bool tb : {false, true}) {
      for (double beta : {0.0, 1.0}) {
        for (bool in_place : {true, false}) {
          check_lt(make_shape(ta, tb, 3, 4), CUDA_R_32F, CUDA_R_32F, CUBLAS_COMPUTE_32F, beta, in_place, 1e-6);
        }
      }
    }
  }
}

TEST_F(CudaSimLt, Bf16Inputs) {
  for (bool ta : {false, true}) {
    for (bool tb : {false, true}) {
      for (double beta : {0.0, 1.0}) {
        check_lt(make_shape(ta, tb, 1, 8), CUDA_R_16BF, CUDA_R_32F, CUBLAS_COMPUTE_32F, beta, true, 1e-6);
      }
    }
  }
  check_lt(make_shape(true, false, 1, 8), CUDA_R_16BF, CUDA_R_16BF, CUBLAS_COMPUTE_32F, 1.0, false, 1e-6);
}

TEST_F(CudaSimLt, F64) {
  check_lt(make_shape(true, true, 1, 2), CUDA_R_64F, CUDA_R_64F, CUBLAS_COMPUTE_64F, 1.0, false, 1e-14);
}

// cuBLASLt's heuristic has no algorithm for leading dimensions (or batch offsets) that are not
// multiples of 16 bytes.
TEST_F(CudaSimLt, HeuristicDeclinesUnalignedLeadingDimensions) {
  GemmShape s = make_shape(false, false, 0, 4);
  s.lda = s.a_rows() + 1;  // 7 floats: 28 bytes
  {
    LtProblem lt(s, CUDA_R_32F, CUDA_R_32F, CUBLAS_COMPUTE_32F);
    cublasLtMatmulHeuristicResult_t result{};
    int found = -1;
    EXPECT_EQ(lt.heuristic(lt_, &result, &found), CUBLAS_STATUS_NOT_SUPPORTED);
    EXPECT_EQ(found, 0);
  }
  s = make_shape(false, false, 0, 4);
  s.stride_c += 1;
  {
    LtProblem lt(s, CUDA_R_32F, CUDA_R_32F, CUBLAS_COMPUTE_32F);
    cublasLtMatmulHeuristicResult_t result{};
    int found = -1;
    EXPECT_EQ(lt.heuristic(lt_, &result, &found), CUBLAS_STATUS_NOT_SUPPORTED);
    EXPECT_EQ(found, 0);
  }
  // Types cuBLASLt has no kernel for: no algorithm either.
  {
    LtProblem lt(make_shape(false, false, 0, 4), CUDA_R_32F, CUDA_R_64F, CUBLAS_COMPUTE_32F);
    cublasLtMatmulHeuristicResult_t result{};
    int found = -1;
    EXPECT_EQ(lt.heuristic(lt_, &result, &found), CUBLAS_STATUS_NOT_SUPPORTED);
    EXPECT_EQ(found, 0);
  }
}

// The algo assumes the alignment the preference promised (256 bytes by default): A 4 bytes past
// a cudaMalloc'd (256-aligned) start is refused; with the promise lowered to 4 bytes it runs.
TEST_F(CudaSimLt, MatmulRefusesPointersLessAlignedThanPromised) {
  const GemmShape s = make_shape(false, false, 0, 4);
  const std::vector<double> a = random_values(s.a_elems() + 1, CUDA_R_32F, 31);
  const std::vector<double> b = random_values(s.b_elems(), CUDA_R_32F, 32);
  // C is written whole first: the check downloads all of it, gaps included.
  DeviceBytes da(encode(a, CUDA_R_32F)), db(encode(b, CUDA_R_32F)),
      dc(encode(std::vector<double>(s.c_elems()), CUDA_R_32F));
  const void* a_offset = static_cast<const char*>(da.get()) + 4;
  const float alpha = 1.0f, beta = 0.0f;
  LtProblem lt(s, CUDA_R_32F, CUDA_R_32F, CUBLAS_COMPUTE_32F);
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  ASSERT_EQ(lt.heuristic(lt_, &result, &found), CUBLAS_STATUS_SUCCESS);
  EXPECT_EQ(cublasLtMatmul(lt_, lt.desc, &alpha, a_offset, lt.a, db.get(), lt.b, &beta, dc.get(), lt.c, dc.get(), lt.c,
                           &result.algo, nullptr, 0, stream_),
            CUBLAS_STATUS_NOT_SUPPORTED);
  // No algo: the implicit heuristic assumes the default 256 bytes too.
  EXPECT_EQ(cublasLtMatmul(lt_, lt.desc, &alpha, a_offset, lt.a, db.get(), lt.b, &beta, dc.get(), lt.c, dc.get(), lt.c,
                           nullptr, nullptr, 0, stream_),
            CUBLAS_STATUS_NOT_SUPPORTED);

  const uint32_t four = 4;
  ASSERT_EQ(
      cublasLtMatmulPreferenceSetAttribute(lt.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &four, sizeof four),
      CUBLAS_STATUS_SUCCESS);
  ASSERT_EQ(lt.heuristic(lt_, &result, &found), CUBLAS_STATUS_SUCCESS);
  ASSERT_EQ(cublasLtMatmul(lt_, lt.desc, &alpha, a_offset, lt.a, db.get(), lt.b, &beta, dc.get(), lt.c, dc.get(), lt.c,
                           &result.algo, nullptr, 0, stream_),
            CUBLAS_STATUS_SUCCESS);
  sync();
  const std::vector<double> a_seen(a.begin() + 1, a.end());
  const std::vector<double> c_nan(s.c_elems(), std::numeric_limits<double>::quiet_NaN());
  const Expected e = reference_gemm(s, a_seen, b, c_nan, 1.0, 0.0);
  const std::vector<unsigned char> after = dc.download();
  for (size_t i = 0; i < e.value.size(); ++i) {
    if (e.written[i]) {
      EXPECT_NEAR(decode(after, CUDA_R_32F, i), e.value[i], 1e-6 * e.bound[i]) << i;
    }
  }
}

TEST_F(CudaSimLt, MismatchedLayoutsAreInvalid) {
  const GemmShape s = make_shape(false, false, 0, 4);
  DeviceBytes da(s.a_elems() * 4), db(s.b_elems() * 4), dc(s.c_elems() * 4);
  const float alpha = 1.0f, beta = 0.0f;
  LtProblem lt(s, CUDA_R_32F, CUDA_R_32F, CUBLAS_COMPUTE_32F);
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  ASSERT_EQ(lt.heuristic(lt_, &result, &found), CUBLAS_STATUS_SUCCESS);
  const auto matmul = [&] {
    return cublasLtMatmul(lt_, lt.desc, &alpha, da.get(), lt.a, db.get(), lt.b, &beta, dc.get(), lt.c, dc.get(), lt.c,
                          &result.algo, nullptr, 0, stream_);
  };
  // B's rows no longer match A's columns (k).
  const uint64_t rows = static_cast<uint64_t>(s.k - 1);
  ASSERT_EQ(cublasLtMatrixLayoutSetAttribute(lt.b, CUBLASLT_MATRIX_LAYOUT_ROWS, &rows, sizeof rows),
            CUBLAS_STATUS_SUCCESS);
  EXPECT_EQ(lt.heuristic(lt_, &result, &found), CUBLAS_STATUS_INVALID_VALUE);
  EXPECT_EQ(matmul(), CUBLAS_STATUS_INVALID_VALUE);
  // Transposing A (k x m stored as m x k) breaks the shapes too.
  const uint64_t k_rows = static_cast<uint64_t>(s.k);
  ASSERT_EQ(cublasLtMatrixLayoutSetAttribute(lt.b, CUBLASLT_MATRIX_LAYOUT_ROWS, &k_rows, sizeof k_rows),
            CUBLAS_STATUS_SUCCESS);
  const int32_t op_t = CUBLAS_OP_T;
  ASSERT_EQ(cublasLtMatmulDescSetAttribute(lt.desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_t, sizeof op_t),
            CUBLAS_STATUS_SUCCESS);
  EXPECT_EQ(matmul(), CUBLAS_STATUS_INVALID_VALUE);
  const int32_t op_n = CUBLAS_OP_N;
  ASSERT_EQ(cublasLtMatmulDescSetAttribute(lt.desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_n, sizeof op_n),
            CUBLAS_STATUS_SUCCESS);
  // Batch counts that differ.
  const int32_t two = 2;
  ASSERT_EQ(cublasLtMatrixLayoutSetAttribute(lt.a, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &two, sizeof two),
            CUBLAS_STATUS_SUCCESS);
  EXPECT_EQ(matmul(), CUBLAS_STATUS_INVALID_VALUE);
  const int32_t batch = s.batch;
  ASSERT_EQ(cublasLtMatrixLayoutSetAttribute(lt.a, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &batch, sizeof batch),
            CUBLAS_STATUS_SUCCESS);
  // A leading dimension below the row count.
  const int64_t small_ld = s.m - 1;
  ASSERT_EQ(cublasLtMatrixLayoutSetAttribute(lt.c, CUBLASLT_MATRIX_LAYOUT_LD, &small_ld, sizeof small_ld),
            CUBLAS_STATUS_SUCCESS);
  EXPECT_EQ(matmul(), CUBLAS_STATUS_INVALID_VALUE);
  // Attribute sizes must match exactly; a null handle is NOT_INITIALIZED.
  const int64_t wide = CUBLAS_OP_T;
  EXPECT_EQ(cublasLtMatmulDescSetAttribute(lt.desc, CUBLASLT_MATMUL_DESC_TRANSA, &wide, sizeof wide),
            CUBLAS_STATUS_INVALID_VALUE);
  EXPECT_EQ(cublasLtMatmul(nullptr, lt.desc, &alpha, da.get(), lt.a, db.get(), lt.b, &beta, dc.get(), lt.c, dc.get(),
                           lt.c, &result.algo, nullptr, 0, stream_),
            CUBLAS_STATUS_NOT_INITIALIZED);
  sync();
  EXPECT_EQ(loom::sim::last_report(), "");
}

TEST_F(CudaSimLt, AttributesReadBack) {
  LtProblem lt(make_shape(true, false, 0, 4), CUDA_R_32F, CUDA_R_32F, CUBLAS_COMPUTE_32F);
  size_t size = 0;
  ASSERT_EQ(cublasLtMatmulDescGetAttribute(lt.desc, CUBLASLT_MATMUL_DESC_TRANSA, nullptr, 0, &size),
            CUBLAS_STATUS_SUCCESS);
  EXPECT_EQ(size, sizeof(int32_t));
  int32_t op = -1;
  ASSERT_EQ(cublasLtMatmulDescGetAttribute(lt.desc, CUBLASLT_MATMUL_DESC_TRANSA, &op, sizeof op, &size),
            CUBLAS_STATUS_SUCCESS);
  EXPECT_EQ(op, CUBLAS_OP_T);
  int32_t compute = -1;
  ASSERT_EQ(
      cublasLtMatmulDescGetAttribute(lt.desc, CUBLASLT_MATMUL_DESC_COMPUTE_TYPE, &compute, sizeof compute, nullptr),
      CUBLAS_STATUS_SUCCESS);
  EXPECT_EQ(compute, CUBLAS_COMPUTE_32F);
  EXPECT_EQ(cublasLtMatmulDescGetAttribute(lt.desc, CUBLASLT_MATMUL_DESC_TRANSA, nullptr, 0, nullptr),
            CUBLAS_STATUS_INVALID_VALUE);
  uint32_t alignment = 0;
  ASSERT_EQ(cublasLtMatmulPreferenceGetAttribute(lt.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &alignment,
                                                 sizeof alignment, nullptr),
            CUBLAS_STATUS_SUCCESS);
  EXPECT_EQ(alignment, 256u);
}

// CUBLASLT_EPILOGUE_BIAS adds a vector of D's row count to every column.
TEST_F(CudaSimLt, BiasEpilogue) {
  GemmShape s = make_shape(false, false, 0, 4);
  s.batch = 1;
  const std::vector<double> a = random_values(s.a_elems(), CUDA_R_32F, 41);
  const std::vector<double> b = random_values(s.b_elems(), CUDA_R_32F, 42);
  const std::vector<double> bias = random_values(static_cast<size_t>(s.m), CUDA_R_32F, 43);
  DeviceBytes da(encode(a, CUDA_R_32F)), db(encode(b, CUDA_R_32F)), dbias(encode(bias, CUDA_R_32F)),
      dc(encode(std::vector<double>(s.c_elems()), CUDA_R_32F));
  LtProblem lt(s, CUDA_R_32F, CUDA_R_32F, CUBLAS_COMPUTE_32F);
  const uint32_t epilogue = CUBLASLT_EPILOGUE_BIAS;
  const void* bias_ptr = dbias.get();
  ASSERT_EQ(cublasLtMatmulDescSetAttribute(lt.desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue, sizeof epilogue),
            CUBLAS_STATUS_SUCCESS);
  ASSERT_EQ(cublasLtMatmulDescSetAttribute(lt.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias_ptr, sizeof bias_ptr),
            CUBLAS_STATUS_SUCCESS);
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  ASSERT_EQ(lt.heuristic(lt_, &result, &found), CUBLAS_STATUS_SUCCESS);
  const float alpha = 1.0f, beta = 0.0f;
  ASSERT_EQ(cublasLtMatmul(lt_, lt.desc, &alpha, da.get(), lt.a, db.get(), lt.b, &beta, dc.get(), lt.c, dc.get(), lt.c,
                           &result.algo, nullptr, 0, stream_),
            CUBLAS_STATUS_SUCCESS);
  sync();
  const std::vector<double> c_zero(s.c_elems(), 0.0);
  Expected e = reference_gemm(s, a, b, c_zero, 1.0, 0.0);
  const std::vector<unsigned char> after = dc.download();
  for (int j = 0; j < s.n; ++j) {
    for (int i = 0; i < s.m; ++i) {
      const size_t at = static_cast<size_t>(i + j * s.ldc);
      EXPECT_NEAR(decode(after, CUDA_R_32F, at), e.value[at] + bias[i], 1e-6 * (e.bound[at] + 1)) << i << ", " << j;
    }
  }
}

// CUBLASLT_EPILOGUE_GELU_AUX_BIAS writes the GELU's input (the product plus the bias) to the
// auxiliary matrix and its GELU (tanh form) to D; CUBLASLT_EPILOGUE_DGELU reads that matrix and
// writes the product times GELU'. Against double references from the formulas (f32 here: within
// 1e-5 of the sum's magnitude). The auxiliary matrix needs a leading dimension that is a multiple
// of 8 and at least D's rows (the heuristic's INVALID_VALUE), and a pointer (the matmul's).
TEST_F(CudaSimLt, GeluEpilogues) {
  GemmShape s = make_shape(false, false, 0, 4);
  s.batch = 1;
  const int64_t aux_ld = round_up(s.m, 8);
  std::vector<double> a = random_values(s.a_elems(), CUDA_R_32F, 51), b = random_values(s.b_elems(), CUDA_R_32F, 52);
  for (double& v : a) v *= 2.0;  // sums over k = 7 of about U(-2, 2)^2: GELU's tails and minimum
  const std::vector<double> bias = random_values(static_cast<size_t>(s.m), CUDA_R_32F, 53);
  DeviceBytes da(encode(a, CUDA_R_32F)), db(encode(b, CUDA_R_32F)), dbias(encode(bias, CUDA_R_32F)),
      dd(encode(std::vector<double>(s.c_elems()), CUDA_R_32F)),
      daux(encode(std::vector<double>(static_cast<size_t>(aux_ld * s.n)), CUDA_R_32F));
  const auto run = [&](uint32_t epilogue, int64_t ld, const void* aux, const void* bias_ptr, cublasStatus_t* heuristic) {
    LtProblem lt(s, CUDA_R_32F, CUDA_R_32F, CUBLAS_COMPUTE_32F);
    EXPECT_EQ(cublasLtMatmulDescSetAttribute(lt.desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue, sizeof epilogue),
              CUBLAS_STATUS_SUCCESS);
    if (bias_ptr != nullptr) {
      EXPECT_EQ(cublasLtMatmulDescSetAttribute(lt.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias_ptr, sizeof bias_ptr),
                CUBLAS_STATUS_SUCCESS);
    }
    EXPECT_EQ(cublasLtMatmulDescSetAttribute(lt.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &aux, sizeof aux),
              CUBLAS_STATUS_SUCCESS);
    EXPECT_EQ(cublasLtMatmulDescSetAttribute(lt.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &ld, sizeof ld),
              CUBLAS_STATUS_SUCCESS);
    cublasLtMatmulHeuristicResult_t result{};
    int found = 0;
    *heuristic = lt.heuristic(lt_, &result, &found);
    if (*heuristic != CUBLAS_STATUS_SUCCESS) return *heuristic;
    const float alpha = 1.0f, beta = 0.0f;
    const cublasStatus_t status = cublasLtMatmul(lt_, lt.desc, &alpha, da.get(), lt.a, db.get(), lt.b, &beta, dd.get(),
                                                 lt.c, dd.get(), lt.c, &result.algo, nullptr, 0, stream_);
    sync();
    return status;
  };
  cublasStatus_t heuristic = CUBLAS_STATUS_SUCCESS;
  ASSERT_EQ(run(CUBLASLT_EPILOGUE_GELU_AUX_BIAS, aux_ld, daux.get(), dbias.get(), &heuristic), CUBLAS_STATUS_SUCCESS);
  const Expected e = reference_gemm(s, a, b, std::vector<double>(s.c_elems(), 0.0), 1.0, 0.0);
  const double kScale = std::sqrt(2.0 / std::numbers::pi);
  const auto tanh_u = [&](double x) { return std::tanh(kScale * (x + 0.044715 * x * x * x)); };
  const std::vector<unsigned char> act = dd.download(), pre = daux.download();
  std::vector<double> x(static_cast<size_t>(s.m * s.n));
  double seen_min = 0, seen_max = 0;
  for (int j = 0; j < s.n; ++j) {
    for (int i = 0; i < s.m; ++i) {
      const size_t at = static_cast<size_t>(i + j * s.ldc);
      const double tol = 1e-5 * (e.bound[at] + 1);
      x[i + j * s.m] = e.value[at] + bias[i];
      seen_min = std::min(seen_min, x[i + j * s.m]), seen_max = std::max(seen_max, x[i + j * s.m]);
      EXPECT_NEAR(decode(pre, CUDA_R_32F, static_cast<size_t>(i + j * aux_ld)), x[i + j * s.m], tol) << i << ", " << j;
      EXPECT_NEAR(decode(act, CUDA_R_32F, at), 0.5 * x[i + j * s.m] * (1 + tanh_u(x[i + j * s.m])), tol) << i << ", " << j;
    }
  }
  EXPECT_LT(seen_min, -2.0);  // the inputs reach GELU's tail and its minimum (-0.75)
  EXPECT_GT(seen_max, 2.0);
  // DGELU: the same product times GELU' of the auxiliary matrix just written (no bias).
  ASSERT_EQ(run(CUBLASLT_EPILOGUE_DGELU, aux_ld, daux.get(), nullptr, &heuristic), CUBLAS_STATUS_SUCCESS);
  const std::vector<unsigned char> dx = dd.download();
  for (int j = 0; j < s.n; ++j) {
    for (int i = 0; i < s.m; ++i) {
      const size_t at = static_cast<size_t>(i + j * s.ldc);
      const double v = decode(pre, CUDA_R_32F, static_cast<size_t>(i + j * aux_ld)), t = tanh_u(v);
      const double slope = 0.5 * (1 + t) + 0.5 * v * (1 - t * t) * kScale * (1 + 3 * 0.044715 * v * v);
      EXPECT_NEAR(decode(dx, CUDA_R_32F, at), e.value[at] * slope, 1e-5 * (e.bound[at] + 1)) << i << ", " << j;
    }
  }
  // The auxiliary matrix's rules.
  EXPECT_EQ(run(CUBLASLT_EPILOGUE_DGELU, aux_ld + 4, daux.get(), nullptr, &heuristic), CUBLAS_STATUS_INVALID_VALUE);
  EXPECT_EQ(heuristic, CUBLAS_STATUS_INVALID_VALUE) << "an aux leading dimension that is not a multiple of 8";
  EXPECT_EQ(run(CUBLASLT_EPILOGUE_GELU_AUX, 0, daux.get(), nullptr, &heuristic), CUBLAS_STATUS_INVALID_VALUE);
  EXPECT_EQ(run(CUBLASLT_EPILOGUE_GELU_AUX, aux_ld, nullptr, nullptr, &heuristic), CUBLAS_STATUS_INVALID_VALUE);
  EXPECT_EQ(heuristic, CUBLAS_STATUS_SUCCESS) << "the heuristic does not read the pointer";
}

TEST_F(CudaSimLt, PointersOutsideDeviceMemory) {
  const GemmShape s = make_shape(false, false, 0, 4);
  DeviceBytes da(s.a_elems() * 4), db(s.b_elems() * 4), dc(s.c_elems() * 4);
  LtProblem lt(s, CUDA_R_32F, CUDA_R_32F, CUBLAS_COMPUTE_32F);
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  ASSERT_EQ(lt.heuristic(lt_, &result, &found), CUBLAS_STATUS_SUCCESS);
  // A host buffer aligned as the algo needs, so only the memory check can refuse it.
  std::vector<float> host(s.b_elems() + 64);
  void* host_aligned = reinterpret_cast<void*>((reinterpret_cast<uintptr_t>(host.data()) + 255) / 256 * 256);
  const float alpha = 1.0f, beta = 0.0f;
  EXPECT_EQ(cublasLtMatmul(lt_, lt.desc, &alpha, da.get(), lt.a, host_aligned, lt.b, &beta, dc.get(), lt.c, dc.get(),
                           lt.c, &result.algo, nullptr, 0, stream_),
            CUBLAS_STATUS_INVALID_VALUE);
  expect_report({"cublasLtMatmul", "matrix B"});
}

// ------------------------------------------------------------------------------------ cub

class CudaSimCub : public CudaSimLibs {
 protected:
  // SortPairs of `keys` with values 0, 1, 2, ...; returns the sorted keys and values.
  template <typename Key>
  std::pair<std::vector<Key>, std::vector<uint32_t>> sort(const std::vector<Key>& keys, int begin_bit, int end_bit) {
    const size_t n = keys.size();
    std::vector<uint32_t> values(n);
    std::iota(values.begin(), values.end(), 0u);
    DeviceBytes keys_in(as_bytes(keys)), values_in(as_bytes(values));
    DeviceBytes keys_out(n * sizeof(Key)), values_out(n * sizeof(uint32_t));
    size_t temp_bytes = 0;
    EXPECT_EQ(cub::DeviceRadixSort::SortPairs(nullptr, temp_bytes, static_cast<const Key*>(nullptr),
                                              static_cast<Key*>(nullptr), static_cast<const uint32_t*>(nullptr),
                                              static_cast<uint32_t*>(nullptr), static_cast<int>(n), begin_bit, end_bit),
              cudaSuccess);
    DeviceBytes temp(temp_bytes);
    EXPECT_EQ(cub::DeviceRadixSort::SortPairs(
                  temp.get(), temp_bytes, static_cast<const Key*>(keys_in.get()), static_cast<Key*>(keys_out.get()),
                  static_cast<const uint32_t*>(values_in.get()), static_cast<uint32_t*>(values_out.get()),
                  static_cast<int>(n), begin_bit, end_bit, stream_),
              cudaSuccess);
    sync();
    return {from_bytes<Key>(keys_out.download(), n), from_bytes<uint32_t>(values_out.download(), n)};
  }

  // The expected result: a stable sort of the indices by `digit(key)`.
  template <typename Key, typename Digit>
  void expect_stable_sort(const std::vector<Key>& keys, int begin_bit, int end_bit, Digit digit) {
    std::vector<uint32_t> order(keys.size());
    std::iota(order.begin(), order.end(), 0u);
    std::stable_sort(order.begin(), order.end(),
                     [&](uint32_t x, uint32_t y) { return digit(keys[x]) < digit(keys[y]); });
    const auto [sorted_keys, sorted_values] = sort(keys, begin_bit, end_bit);
    ASSERT_EQ(sorted_values.size(), keys.size());
    for (size_t i = 0; i < keys.size(); ++i) {
      EXPECT_EQ(sorted_values[i], order[i]) << "position " << i;
      EXPECT_EQ(std::memcmp(&sorted_keys[i], &keys[order[i]], sizeof(Key)), 0) << "position " << i;
    }
  }
};

TEST_F(CudaSimCub, SortPairsIsStable) {
  std::mt19937 rng(51);
  std::vector<uint32_t> keys(3000);
  for (uint32_t& k : keys) k = rng() % 50;  // many equal keys
  expect_stable_sort(keys, 0, 32, [](uint32_t k) { return k; });
  for (uint32_t& k : keys) k = rng();  // all 32 bits
  expect_stable_sort(keys, 0, 32, [](uint32_t k) { return k; });
}

TEST_F(CudaSimCub, SortPairsHonoursTheBitRange) {
  std::mt19937 rng(52);
  std::vector<uint32_t> keys(1000);
  for (uint32_t& k : keys) k = rng();
  expect_stable_sort(keys, 4, 12, [](uint32_t k) { return (k >> 4) & 0xFF; });
  expect_stable_sort(keys, 0, 7, [](uint32_t k) { return k & 0x7F; });
  expect_stable_sort(keys, 5, 5, [](uint32_t) { return 0; });  // no bits: a stable copy
}

TEST_F(CudaSimCub, SortPairsOrdersSignedAndFloatKeys) {
  std::mt19937 rng(53);
  std::vector<int32_t> ints(500);
  for (int32_t& k : ints) k = static_cast<int32_t>(rng() % 2001) - 1000;
  expect_stable_sort(ints, 0, 32, [](int32_t k) { return k; });

  std::vector<float> floats = {3.5f, -0.0f, 0.0f, -2.0f, 1e-30f, -1e30f, 0.0f, -0.0f, 7.0f, -2.0f};
  for (int i = 0; i < 200; ++i) floats.push_back(std::uniform_real_distribution<float>(-10.0f, 10.0f)(rng));
  // -0.0 and +0.0 are the same key (CUB's documented treatment), so they keep their input order.
  expect_stable_sort(floats, 0, 32, [](float k) { return k == 0.0f ? 0.0f : k; });

  std::vector<double> doubles = {2.0, -1.0, -0.0, 0.0, -1e300, 1e-300, -1.0};
  expect_stable_sort(doubles, 0, 64, [](double k) { return k == 0.0 ? 0.0 : k; });
}

TEST_F(CudaSimCub, SortPairsTemporaryStorage) {
  size_t small = 0, large = 0;
  ASSERT_EQ(cub::DeviceRadixSort::SortPairs(nullptr, small, static_cast<const uint32_t*>(nullptr),
                                            static_cast<uint32_t*>(nullptr), static_cast<const uint32_t*>(nullptr),
                                            static_cast<uint32_t*>(nullptr), 10),
            cudaSuccess);
  ASSERT_EQ(cub::DeviceRadixSort::SortPairs(nullptr, large, static_cast<const uint32_t*>(nullptr),
                                            static_cast<uint32_t*>(nullptr), static_cast<const uint32_t*>(nullptr),
                                            static_cast<uint32_t*>(nullptr), 100000),
            cudaSuccess);
  EXPECT_GT(small, 0u);
  EXPECT_GT(large, small);

  // Too small a temporary storage: cudaErrorInvalidValue and the outputs are untouched.
  const size_t n = 100;
  std::vector<uint32_t> keys(n), sentinel(n, 0xDEADBEEF);
  std::iota(keys.rbegin(), keys.rend(), 0u);
  DeviceBytes keys_in(as_bytes(keys)), values_in(as_bytes(keys)), keys_out(as_bytes(sentinel)),
      values_out(as_bytes(sentinel));
  size_t need = 0;
  ASSERT_EQ(cub::DeviceRadixSort::SortPairs(nullptr, need, static_cast<const uint32_t*>(nullptr),
                                            static_cast<uint32_t*>(nullptr), static_cast<const uint32_t*>(nullptr),
                                            static_cast<uint32_t*>(nullptr), static_cast<int>(n)),
            cudaSuccess);
  DeviceBytes temp(need);
  size_t too_small = need - 1;
  const auto* kin = static_cast<const uint32_t*>(keys_in.get());
  const auto* vin = static_cast<const uint32_t*>(values_in.get());
  auto* kout = static_cast<uint32_t*>(keys_out.get());
  auto* vout = static_cast<uint32_t*>(values_out.get());
  EXPECT_EQ(
      cub::DeviceRadixSort::SortPairs(temp.get(), too_small, kin, kout, vin, vout, static_cast<int>(n), 0, 32, stream_),
      cudaErrorInvalidValue);
  // A bit range outside the key.
  EXPECT_EQ(
      cub::DeviceRadixSort::SortPairs(temp.get(), need, kin, kout, vin, vout, static_cast<int>(n), 0, 33, stream_),
      cudaErrorInvalidValue);
  EXPECT_EQ(cub::DeviceRadixSort::SortPairs(temp.get(), need, kin, kout, vin, vout, static_cast<int>(n), 9, 8, stream_),
            cudaErrorInvalidValue);
  sync();
  EXPECT_EQ(keys_out.download(), as_bytes(sentinel));
  EXPECT_EQ(values_out.download(), as_bytes(sentinel));

  // The sort itself, with exactly the size asked for.
  ASSERT_EQ(
      cub::DeviceRadixSort::SortPairs(temp.get(), need, kin, kout, vin, vout, static_cast<int>(n), 0, 32, stream_),
      cudaSuccess);
  sync();
  const std::vector<uint32_t> sorted = from_bytes<uint32_t>(keys_out.download(), n);
  EXPECT_TRUE(std::is_sorted(sorted.begin(), sorted.end()));
}

TEST_F(CudaSimCub, SortPairsChecksItsBuffers) {
  const size_t n = 64;
  std::vector<uint32_t> keys(n, 1);
  DeviceBytes keys_in(as_bytes(keys)), values_in(as_bytes(keys)), out(2 * n * 4);
  size_t need = 0;
  ASSERT_EQ(cub::DeviceRadixSort::SortPairs(nullptr, need, static_cast<const uint32_t*>(nullptr),
                                            static_cast<uint32_t*>(nullptr), static_cast<const uint32_t*>(nullptr),
                                            static_cast<uint32_t*>(nullptr), static_cast<int>(n)),
            cudaSuccess);
  DeviceBytes temp(need);
  const auto* kin = static_cast<const uint32_t*>(keys_in.get());
  const auto* vin = static_cast<const uint32_t*>(values_in.get());
  auto* kout = static_cast<uint32_t*>(out.get());
  auto* vout = kout + n;
  // Host memory as an output.
  std::vector<uint32_t> host(n);
  EXPECT_EQ(cub::DeviceRadixSort::SortPairs(temp.get(), need, kin, host.data(), vin, vout, static_cast<int>(n), 0, 32,
                                            stream_),
            cudaErrorIllegalAddress);
  expect_report({"SortPairs", "d_keys_out"});
  // Output keys overlapping the input keys.
  EXPECT_EQ(cub::DeviceRadixSort::SortPairs(temp.get(), need, kin, const_cast<uint32_t*>(kin), vin, vout,
                                            static_cast<int>(n), 0, 32, stream_),
            cudaErrorInvalidValue);
  expect_report({"SortPairs", "d_keys_in", "d_keys_out", "overlaps"});
}

}  // namespace
