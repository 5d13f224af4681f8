#include "loom/nn/attention.h"

#include "loom/core/error.h"
#include "loom/nn/context_parallel.h"

namespace loom {

namespace {

// Context parallel: q, k and v of this rank's positions as separate (B, T/cp, width) buffers.
struct SplitQkv {
  Tensor q, k, v;
};
SplitQkv split_views(const ContextParallel& cp, const ModelConfig& c, int64_t B, int64_t Tl, bool grads) {
  const int64_t H = c.n_head, KV = c.n_kv_head, hd = c.head_dim();
  const Tensor& q = grads ? cp.dq : cp.q;
  const Tensor& k = grads ? cp.dk : cp.k;
  const Tensor& v = grads ? cp.dv : cp.v;
  return {q.view(0, {B, Tl, H * hd}), k.view(0, {B, Tl, KV * hd}), v.view(0, {B, Tl, KV * hd})};
}

void split_qkv(Backend& backend, const Tensor& qkv, const SplitQkv& out, const ModelConfig& c, bool into_wide) {
  const int64_t H = c.n_head, KV = c.n_kv_head, hd = c.head_dim();
  copy_columns(backend, qkv, 0, out.q, into_wide);
  copy_columns(backend, qkv, H * hd, out.k, into_wide);
  copy_columns(backend, qkv, (H + KV) * hd, out.v, into_wide);
}

}  // namespace

void attention_forward(Backend& backend, const LayerPlan& plan, const ModelConfig& c, ContextParallel* cp, BlockSaved& s) {
  const int64_t H = c.n_head, KV = c.n_kv_head;
  switch (plan.attention) {
    case AttentionKind::mha:
      backend.attention_forward(s.qkv, s.attn, s.probs, H, KV, plan.window);
      return;
    case AttentionKind::flash:
      backend.flash_attention_forward(s.qkv, s.attn, s.lse, H, KV, plan.window);
      return;
    case AttentionKind::ring:
    case AttentionKind::ulysses: {
      LOOM_CHECK(cp != nullptr, "context-parallel attention without a cp group");
      const SplitQkv x = split_views(*cp, c, s.qkv.dim(0), s.qkv.dim(1), false);
      split_qkv(backend, s.qkv, x, c, false);
      if (plan.attention == AttentionKind::ulysses) ulysses_attention_forward(backend, *cp->comm, x.q, x.k, x.v, s.attn, s.ulysses, H, KV, &cp->work);
      else ring_attention_forward(backend, *cp->comm, x.q, x.k, x.v, s.attn, s.lse, H, KV, &cp->work);
      return;
    }
    case AttentionKind::mla:
      break;
  }
  throw Error("attention_forward: MLA runs its own module (nn/mla.h)");
}

void attention_backward(Backend& backend, const LayerPlan& plan, const ModelConfig& c, ContextParallel* cp,
                        const BlockSaved& s, BlockScratch& k) {
  const int64_t H = c.n_head, KV = c.n_kv_head;
  switch (plan.attention) {
    case AttentionKind::mha:
      backend.attention_backward(k.d_attn, s.qkv, s.attn, s.probs, k.d_qkv, H, KV, plan.window);
      return;
    case AttentionKind::flash:
      backend.flash_attention_backward(k.d_attn, s.qkv, s.attn, s.lse, k.d_qkv, H, KV, plan.window);
      return;
    case AttentionKind::ring:
    case AttentionKind::ulysses: {
      LOOM_CHECK(cp != nullptr, "context-parallel attention without a cp group");
      const int64_t B = s.qkv.dim(0), Tl = s.qkv.dim(1);
      const SplitQkv d = split_views(*cp, c, B, Tl, true);
      if (plan.attention == AttentionKind::ulysses) {
        ulysses_attention_backward(backend, *cp->comm, k.d_attn, s.ulysses, d.q, d.k, d.v, H, KV, &cp->work);
      } else {
        const SplitQkv x = split_views(*cp, c, B, Tl, false);
        split_qkv(backend, s.qkv, x, c, false);
        ring_attention_backward(backend, *cp->comm, k.d_attn, x.q, x.k, x.v, s.attn, s.lse, d.q, d.k, d.v, H, KV, &cp->work);
      }
      split_qkv(backend, k.d_qkv, d, c, true);
      return;
    }
    case AttentionKind::mla:
      break;
  }
  throw Error("attention_backward: MLA runs its own module (nn/mla.h)");
}

}  // namespace loom
