// Launchers of the elementwise optimizers, Muon's steps and the soft-target loss (cuda_optim.cu),
// called by cuda_optim_ops.cpp after it has validated the operands. Plain device pointers and
// sizes in, work enqueued on `stream`, nothing synchronized; every launcher checks its launch
// (LOOM_CUDA_CHECK_LAUNCH). f32 only, as the ops. The scalars are the CPU kernels'
// (cpu/cpu_optim_ops.cpp) own constants, computed by the caller in the same precision and order,
// so each element gets the CPU's arithmetic. An optional state pointer is null when the rule keeps
// none. No floating-point atomics: every result is the same bytes on every run.
#pragma once
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace loom::cuda {

// SGD: d = g gs + wd p; with buf, buf = first ? d : mu buf + (1 - damp) d, d = nesterov ? d + mu buf : buf; p -= lr d.
void sgd_step(float* p, const float* grad, float* buf, int64_t n, float lr, float wd, float gs, float mu, float damp,
              bool nesterov, bool first, cudaStream_t stream);
// Adagrad: d = g gs + wd p; sum += d^2; p -= lr d / (sqrt(sum) + eps).
void adagrad_step(float* p, const float* grad, float* sum, int64_t n, float lr, float wd, float gs, float eps,
                  cudaStream_t stream);
// RMSprop (alpha = a), avg (centered) and buf (momentum) optional.
void rmsprop_step(float* p, const float* grad, float* square, float* avg, float* buf, int64_t n, float lr, float wd,
                  float gs, float a, float eps, float mu, cudaStream_t stream);
// Adam / AdamW / AMSGrad (vmax optional): step_size = lr / (1 - b1^t), l2 and decay as the CPU's.
void adam_step(float* p, const float* grad, float* m, float* v, float* vmax, int64_t n, float step_size, float l2,
               float decay, float gs, float b1, float b2, float eps, float bias2_sqrt, cudaStream_t stream);
// Lion: c = b1 m + (1-b1) g; p = p decay - lr sign(c); m = b2 m + (1-b2) g.
void lion_step(float* p, const float* grad, float* m, int64_t n, float lr, float decay, float gs, float b1, float b2,
               cudaStream_t stream);
// Adam-mini over nblocks blocks of bn consecutive elements, v one value per block; each block's
// sum of squares gives the result of the ordered sum (cuda_optim.cu, "Ordered sums").
void adam_mini_step(float* p, const float* grad, float* m, float* v, int64_t nblocks, int64_t bn, float lr, float decay,
                    float gs, float b1, float eps, float bias1, double b2, double bias2, cudaStream_t stream);
// dst = scale src, or dst (cols, rows) = scale src^T for src (rows, cols). When scale_dev is not
// null the scale is read from it (device memory: newton_schulz_normalize's 1 / ||u||).
void scale_transpose(const float* src, float* dst, int64_t rows, int64_t cols, float scale, const float* scale_dev,
                     bool transpose, cudaStream_t stream);
// y += alpha x.
void axpy(float* y, const float* x, int64_t n, float alpha, cudaStream_t stream);
// Muon's momentum: buf = mu buf + (1 - mu) g; u = nesterov ? (1 - mu) g + mu buf : buf.
void muon_momentum(const float* grad, float* buf, float* u, int64_t n, float mu, float gs, bool nesterov,
                   cudaStream_t stream);
// *inv = f32(1 / (sqrt(sum u^2) + 1e-7)), the sum in double and in index order (cuda_optim.cu,
// "Ordered sums": a tree sum whose bound decides the result, else one block's serial sum).
// scratch: inverse_norm_scratch_bytes() of device memory.
size_t inverse_norm_scratch_bytes();
void inverse_norm(const float* u, int64_t n, float* inv, void* scratch, cudaStream_t stream);
// p = p decay - step u.
void decayed_update(float* p, const float* u, int64_t n, float decay, float step, cudaStream_t stream);
// The soft-target loss of backend.h per row of logits / teacher (rows, vocab): losses (rows) and
// grad (rows, vocab) overwritten. One block per row, its sums in double (fixed trees).
void soft_target_loss(const float* logits, const float* teacher, float* losses, float* grad, int64_t rows,
                      int64_t vocab, double temperature, float grad_scale, cudaStream_t stream);

}  // namespace loom::cuda
