// Gradient compression on the DDP path (docs/parallel.md): a hook that replaces a bucket's
// all-reduce. Top-K with error feedback (Stich et al. 2018; Lin et al., DGC, 2018 without the
// momentum correction): each rank adds its residual to the bucket's gradient, sends the k
// entries of largest magnitude (k = ratio x n, at least 1) as (index, value) pairs by
// all-gather, keeps the rest as the new residual, and every rank sums the N sparse vectors into
// the bucket (DDP then divides by N). Invariant, per rank and element: sent + residual after =
// gradient + residual before, so over any number of steps sum(sent) + residual = sum(gradients).
// Wire bytes per rank: (N-1)/N x N x k x 8 (an i32 index and an f32 value per entry).
//
// Every element loop runs as a Backend op (backend.h: topk_extract, onebit_encode, ...); this
// file only orders the ops and the communication. The buffers a bucket needs (codes, gathered
// codes, P and Q) are allocated by prepare(), which DataParallel calls for every bucket at
// construction, so a training step allocates nothing; reduce() on a bucket nobody prepared
// prepares it first.
#pragma once
#include <cstdint>
#include <memory>

#include "loom/backend/backend.h"
#include "loom/comm/communicator.h"
#include "loom/arch/param_layout.h"
#include "loom/core/enum_names.h"

namespace loom {

// parallel.compression: the hook that replaces each bucket's all-reduce (none: the all-reduce).
enum class Compression { none, topk, dgc, onebit, qsgd, powersgd };
template <>
struct EnumNames<Compression> {
  static constexpr std::array<std::string_view, 6> names{"none", "topk", "dgc", "onebit", "qsgd", "powersgd"};
};

class GradCompressor {
 public:
  virtual ~GradCompressor() = default;
  // bucket = the sum over ranks of what each rank transmits for [offset, offset + n) of the
  // flat gradient (its compressed gradient). Blocking.
  virtual void reduce(Communicator& comm, const Tensor& bucket, int64_t offset) = 0;
  // Allocates the buffers of the bucket of n elements at `offset` for `world` ranks.
  virtual void prepare(int world, int64_t offset, int64_t n) = 0;
  // The error-feedback residual over the whole flat gradient (checkpointable state).
  virtual const Tensor& residual() const = 0;
  // Momentum kept by the compressor over the whole flat gradient (DGC), or nullptr.
  virtual const Tensor* momentum() const { return nullptr; }
};

// Top-K with error feedback over a flat gradient of `total` elements (the residual lives here).
std::unique_ptr<GradCompressor> make_topk_compressor(Backend& backend, int64_t total, double ratio);

// Deep Gradient Compression (Lin, Han, Mao, Wang, Dally, "Deep Gradient Compression: Reducing
// the Communication Bandwidth for Distributed Training", ICLR 2018; Algorithm 1 with momentum
// correction, local gradient clipping, momentum factor masking and sparsity warm-up). Per rank
// and bucket of n elements at `offset`, with t = how many times reduce() has been called for
// this offset before (a per-offset counter, so every bucket follows the same schedule):
//   clip:  g <- g min(1, c_b / ||g||_2), c_b = clip_norm sqrt(n / (N total)): the paper's
//          threshold scaled by N^-1/2, times the bucket's share sqrt(n / total) of the flat
//          gradient (a bucket sees only its own part; the squared shares sum to clip_norm^2 / N,
//          so the clipped local gradient's whole norm is <= clip_norm N^-1/2; with one bucket
//          covering the whole gradient it is exactly the paper's local clipping). Off if <= 0.
//   u <- m u + g            (momentum correction: u and v live here, for the whole flat gradient)
//   v <- v + u              (accumulation)
//   send the k entries of largest |v|, k = max(1, floor(d_t n)), as (index, value) pairs by
//   all-gather, exactly as Top-K (ties by lower index; the paper estimates the threshold by
//   sampling, this selection is exact); bucket = the sum of the N sparse vectors
//   v <- 0, u <- 0 at the sent entries (momentum factor masking)
// Sparsity warm-up (the paper's 75%, 93.75%, 98.4375%, 99.6%, then 1 - ratio): with S = the
// number of s >= 1 with 4^-s > ratio (S = 4 at ratio 0.001) and W = warmup_steps,
//   d_t = 4^-(1 + floor(t S / W)) for t < W, else ratio   (W = 0 or S = 0: always ratio),
// so the W steps are cut into S equal stages (W = 4 epochs of steps at ratio 0.001 is the paper's
// schedule). Invariant, per rank and element: sum(sent) + v = sum over steps of u (after
// clipping and before masking). At momentum 0, no clipping and no warm-up it is Top-K exactly.
// The momentum is already applied: the optimizer must be plain SGD (no momentum of its own).
// residual() is v, momentum() is u; the per-offset step counters are not part of residual().
// Wire bytes per rank: (N-1)/N x N x k x 8, as Top-K.
struct DgcOptions {
  double ratio = 0.001;        // final density k / n, in (0, 1]
  double momentum = 0.9;       // m, in [0, 1)
  double clip_norm = 0.0;      // <= 0: off; local clipping threshold of the whole flat gradient (before N^-1/2)
  int64_t warmup_steps = 0;    // W: reduce() calls per bucket spent in the sparsity warm-up
};
std::unique_ptr<GradCompressor> make_dgc_compressor(Backend& backend, int64_t total, const DgcOptions& options);

// 1-bit with error feedback (Seide et al. 2014; Karimireddy et al., "Error Feedback Fixes
// SignSGD", ICML 2019): each rank sends p = (||a||_1 / n) sign(a) of a = gradient + residual
// (signs packed 32 to an i32 word, plus the f32 scale), keeps a - p as the residual, and all
// ranks sum the N decoded vectors. sign(0) = +1. Wire bytes per rank per bucket:
// (N-1)/N x N x (4 ceil(n/32) + 4), about 1/32 of the fp32 gradient.
std::unique_ptr<GradCompressor> make_onebit_compressor(Backend& backend, int64_t total);

// QSGD (Alistarh et al., NeurIPS 2017) with s levels (1..127): each rank sends ||v||_2 and, per
// element, sign(v_i) xi_i with xi_i = l + 1 with probability |v_i| s / ||v|| - l, else l
// (l = floor(|v_i| s / ||v||)); the decoded value ||v|| sign(v_i) xi_i / s is unbiased. The
// random numbers are Philox(seed, stream = rank, draw = call count, element). No error
// feedback (it is unbiased). Wire bytes per rank per bucket: (N-1)/N x N x (n + 4), one signed
// byte per element packed 4 to a word, plus the norm.
std::unique_ptr<GradCompressor> make_qsgd_compressor(Backend& backend, int64_t total, int levels, uint64_t seed);

// PowerSGD (Vogels et al., NeurIPS 2019) of rank r with error feedback: each 2-D parameter M
// (rows x cols, plus this rank's residual) is approximated by one power iteration warm-started
// from the previous step's Q (cols x r; first Q from Philox(seed), equal on every rank):
// P = M Q, all-reduce P, orthonormalize P (Gram-Schmidt), Q = M^T P, all-reduce Q; every rank
// then holds P Q^T = P P^T (sum of M) and keeps M - P P^T M_own as its residual. 1-D parameters
// are all-reduced uncompressed. At r = min(rows, cols) the result is the exact sum. Wire bytes
// per matrix: two all-reduces of (rows + cols) r floats instead of rows x cols.
std::unique_ptr<GradCompressor> make_powersgd_compressor(Backend& backend, const ParamLayout& layout, int rank,
                                                         uint64_t seed);

}  // namespace loom
