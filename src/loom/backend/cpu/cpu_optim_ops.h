// The CPU kernels of the optimizer ops (Backend::sgd_step ... ldadam_apply; the contracts are in
// backend.h, the rules in docs/optimizers.md): the element loops, reductions and small matrix steps
// of optim/*.cpp. Each validates its operands. Reductions run in double in a fixed order, or under
// OpenMP's static schedule where the optimizer always did (Adafactor's and CAME's RMS).
#pragma once
#include "loom/backend/backend.h"

namespace loom::cpu {

void sgd_step(const Tensor& param, const Tensor& grad, const Tensor& buf, const OptimHyper& h);
void adagrad_step(const Tensor& param, const Tensor& grad, const Tensor& sum, const OptimHyper& h);
void rmsprop_step(const Tensor& param, const Tensor& grad, const Tensor& square, const Tensor& avg, const Tensor& buf,
                  const OptimHyper& h);
void adam_step(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v, const Tensor& vmax,
               const OptimHyper& h);
void lion_step(const Tensor& param, const Tensor& grad, const Tensor& m, const OptimHyper& h);
void adam_mini_step(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v, const OptimHyper& h);
void adafactor_step(const Tensor& param, const Tensor& grad, const Tensor& state, const Tensor& m, const Tensor& u,
                    const OptimHyper& h);
void sm3_step(const Tensor& param, const Tensor& grad, const Tensor& acc, const OptimHyper& h);
void came_step(const Tensor& param, const Tensor& grad, const Tensor& state, const Tensor& m, const Tensor& res,
               const Tensor& u, const OptimHyper& h);
void scale_transpose(const Tensor& src, const Tensor& dst, float scale, bool transpose);
void axpy(const Tensor& y, const Tensor& x, float alpha);
void muon_momentum(const Tensor& grad, const Tensor& buf, const Tensor& u, const OptimHyper& h);
void newton_schulz_normalize(const Tensor& u, const Tensor& x);
void decayed_update(const Tensor& param, const Tensor& u, float decay, float step);
void leading_eigenvectors(const Tensor& s, const Tensor& p);
void gram_schmidt(const Tensor& y, const Tensor& fallback, const Tensor& p);
void ldadam_rotate(const Tensor& p, const Tensor& prev, const Tensor& m, const Tensor& v, const Tensor& mt,
                   const Tensor& vt, const OptimHyper& h);
void ldadam_adam(const Tensor& m, const Tensor& v, const Tensor& mt, const Tensor& vt, const Tensor& gh,
                 const OptimHyper& h);
void ldadam_apply(const Tensor& param, const Tensor& grad, const Tensor& d, const Tensor& e, bool transpose,
                  const OptimHyper& h);

}  // namespace loom::cpu
