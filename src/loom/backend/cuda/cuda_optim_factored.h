// Launchers of the factored optimizers' kernels (cuda_optim_factored.cu): Adafactor, SM3, CAME and
// LDAdam's device steps. Plain device pointers and sizes in, work enqueued on `stream`, nothing
// synchronized. The backend (cuda_optim_factored_ops.cpp) validates the operands with the CPU's
// checks first. Semantics and operation order are those of cpu/cpu_optim_factored.cpp and
// cpu/cpu_optim_ops.cpp (the contracts in backend.h). Launchers that need scratch take `scratch`
// (device, 256-byte aligned) of at least the matching *_scratch_bytes(). No floating-point atomics.
#pragma once
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace loom::cuda {

// The scalars of one factored-optimizer step, as the CPU kernel reads them from OptimHyper.
struct FactoredHyper {
  double lr = 0.0;             // Adafactor: the base rate; CAME, SM3: eta = f32(lr)
  float weight_decay = 0.0f;
  float grad_scale = 1.0f;
  double beta1 = 0.9, beta2 = 0.999, beta3 = 0.9999;
  double eps = 1e-30, eps2 = 1e-3;
  double clip_threshold = 1.0;
  bool scale_parameter = true;
};

// Adafactor on one m x n segment (factored: state = R (m) then C (n); else m = 1, state (n)).
// M may be null (no momentum); U (m n) receives the preconditioned gradient g / sqrt(V^).
size_t adafactor_scratch_bytes(int64_t m, int64_t n);
void adafactor_step(float* p, const float* g, float* state, float* M, float* U, int64_t m, int64_t n, bool factored,
                    const FactoredHyper& h, void* scratch, cudaStream_t stream);

// SM3-II on one m x n segment (factored: acc = row maxima (m) then column maxima (n)).
size_t sm3_scratch_bytes(int64_t m, int64_t n);
void sm3_step(float* p, const float* g, float* acc, int64_t m, int64_t n, bool factored, const FactoredHyper& h,
              void* scratch, cudaStream_t stream);

// CAME on one m x n segment; res (m + n) is used only when factored.
size_t came_scratch_bytes(int64_t m, int64_t n);
void came_step(float* p, const float* g, float* state, float* M, float* res, float* U, int64_t m, int64_t n,
               bool factored, const FactoredHyper& h, void* scratch, cudaStream_t stream);

// Modified Gram-Schmidt of y's columns (n, r) in double into p (n, r); a column whose squared
// norm after projection is <= 1e-60 takes fallback's column.
size_t gram_schmidt_scratch_bytes(int64_t n, int64_t r);
void gram_schmidt(const float* y, const float* fallback, float* p, int64_t n, int64_t r, void* scratch,
                  cudaStream_t stream);

// LDAdam: Q = P^T prev (r, r; 0 at step 1), mt = Q m, vt the projection-aware second moment.
// bc1_prev = 1 - b1^(t-1), bc2_prev = 1 - b2^(t-1) (computed on the host as the CPU does).
size_t ldadam_rotate_scratch_bytes(int64_t r);
void ldadam_rotate(const float* P, const float* prev, const float* m, const float* v, float* mt, float* vt, int64_t M,
                   int64_t r, int64_t N, int64_t step, double bc1_prev, double bc2_prev, void* scratch,
                   cudaStream_t stream);
// m = b1 mt + (1-b1) gh; v = b2 vt + (1-b2) gh^2; mt = (m / bc1) / (sqrt(v / bc2) + eps), all f32.
void ldadam_adam(float* m, float* v, float* mt, const float* vt, const float* gh, int64_t n, float b1, float b2,
                 float bc1, float bc2, float eps, cudaStream_t stream);
// p (rows, cols) = p decay - eta D; grad = E; D, E (rows, cols) or, transposed, (cols, rows).
void ldadam_apply(float* p, float* grad, const float* d, const float* e, int64_t rows, int64_t cols, bool transpose,
                  float eta, float decay, cudaStream_t stream);

}  // namespace loom::cuda
