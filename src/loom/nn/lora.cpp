#include "loom/nn/lora.h"

#include <algorithm>
#include <functional>

#include "loom/arch/param_layout.h"
#include "loom/core/error.h"

namespace loom {

namespace {

Tensor rows_of(const Tensor& t) {
  const int64_t w = t.dim(-1);
  return t.view(0, {t.numel() / w, w});
}

Tensor scratch(Backend& backend, LinearWorkspace* ws, LinearWorkspace::Slot slot, int64_t rows, int64_t cols) {
  if (ws != nullptr) return ws->f32(slot, {rows, cols});
  return Tensor::empty(backend.allocator(), {rows, cols}, DTYPE_F32, MEM_WORKSPACE);
}

GemmSpec spec(bool trans_a, bool trans_b, float alpha, float beta) {
  GemmSpec s;
  s.trans_a = trans_a, s.trans_b = trans_b, s.alpha = alpha, s.beta = beta;
  return s;
}

// DoRA: V = W_rows + s B A into slot E, its row norms into slot G and C = g V - W_rows into
// slot F (nn/lora.h).
struct DoraRows {
  Tensor merged, norms, weight;
};
DoraRows dora_rows(Backend& backend, const LoraAdapter& ad, const Tensor& w, float scale, LinearWorkspace* ws,
                   bool correction = true) {
  const int64_t width = ad.b.dim(0), in = ad.a.dim(1);
  LOOM_CHECK(w.defined() && w.numel() >= (ad.out_begin + width) * in && ad.m.numel() == width, "DoRA adapter at row ",
             ad.out_begin, " (", width, " x ", in, ", magnitude ", ad.m.describe(), ") does not fit the base weight ",
             w.describe());
  const Tensor rows = w.view(ad.out_begin * in, {width, in});
  DoraRows d{scratch(backend, ws, LinearWorkspace::E, width, in), scratch(backend, ws, LinearWorkspace::G, width, 1),
             scratch(backend, ws, LinearWorkspace::F, width, in)};
  d.norms = d.norms.view(0, {width});
  backend.copy(rows, d.merged);
  backend.gemm(ad.b, ad.a, d.merged, spec(false, false, scale, 1.0f));  // V = W + s B A
  backend.row_norms(d.merged, d.norms);
  if (correction) backend.dora_weight(d.merged, rows, ad.m, d.norms, d.weight);  // C = g V - W
  return d;
}

}  // namespace

// The adapter's input: x, or x dropped out with adapter `index`'s mask into slot D.
Tensor adapter_input(Backend& backend, const Tensor& x2, const LoraDropout& dropout, size_t index, LinearWorkspace* ws) {
  if (dropout.p <= 0.0f) return x2;
  const Tensor xd = scratch(backend, ws, LinearWorkspace::D, x2.dim(0), x2.dim(1));
  RoundingDraw draw = dropout.draw;
  draw.stream += static_cast<uint32_t>(index);
  backend.dropout(x2, xd, dropout.p, draw);
  return xd;
}

void lora_forward(Backend& backend, const Tensor& x, const LoraAdapters& adapters, float scale, const Tensor& y,
                  LinearWorkspace* ws, const LoraDropout& dropout, const Tensor& w, bool dora_merged) {
  if (adapters.empty() || dropout.off) return;
  const Tensor x2 = rows_of(x), y2 = rows_of(y);
  const int64_t N = x2.dim(0), W = y2.dim(1);
  for (size_t index = 0; index < adapters.size(); ++index) {
    const LoraAdapter& ad = adapters[index];
    const int64_t r = ad.a.dim(0), width = ad.b.dim(0);
    LOOM_CHECK(ad.a.dim(1) == x2.dim(1) && ad.b.dim(1) == r && ad.out_begin + width <= W && y2.dim(0) == N,
               "lora_forward: adapter A ", ad.a.describe(), ", B ", ad.b.describe(), " at column ", ad.out_begin,
               " does not fit x ", x.describe(), " -> y ", y.describe());
    if (ad.m.defined() && dora_merged) continue;  // in the layer's merged weight already
    if (ad.m.defined()) {  // DoRA: y += x_d C^T
      const DoraRows d = dora_rows(backend, ad, w, scale, ws);
      const Tensor xi = adapter_input(backend, x2, dropout, index, ws);
      if (width == W) {
        backend.gemm(xi, d.weight, y2, spec(false, true, 1.0f, 1.0f));
      } else {
        const Tensor cols = scratch(backend, ws, LinearWorkspace::C, N, width);
        copy_columns(backend, y2, ad.out_begin, cols, false);
        backend.gemm(xi, d.weight, cols, spec(false, true, 1.0f, 1.0f));
        copy_columns(backend, y2, ad.out_begin, cols, true);
      }
      continue;
    }
    const Tensor t = scratch(backend, ws, LinearWorkspace::A, N, r);
    backend.gemm(adapter_input(backend, x2, dropout, index, ws), ad.a, t, spec(false, true, 1.0f, 0.0f));  // t = x A^T
    if (width == W) {
      backend.gemm(t, ad.b, y2, spec(false, true, scale, 1.0f));  // y += s t B^T
    } else {  // the adapter's columns of a fused output, out and back
      const Tensor cols = scratch(backend, ws, LinearWorkspace::C, N, width);
      copy_columns(backend, y2, ad.out_begin, cols, false);
      backend.gemm(t, ad.b, cols, spec(false, true, scale, 1.0f));
      copy_columns(backend, y2, ad.out_begin, cols, true);
    }
  }
}

namespace {

// One DoRA adapter's backward (nn/lora.h): dy_cols (N, width) its columns of the output gradient.
void dora_backward(Backend& backend, const Tensor& x2, const LoraAdapter& p, const LoraAdapter& g, float scale,
                   const Tensor& dcols, const Tensor& dx2, LinearWorkspace* ws, const LoraDropout& dropout, size_t index,
                   const Tensor& w, bool merged) {
  const int64_t N = x2.dim(0), width = p.b.dim(0), in = x2.dim(1);
  const DoraRows d = dora_rows(backend, p, w, scale, ws, !merged);
  const Tensor xi = adapter_input(backend, x2, dropout, index, ws);
  const Tensor dc = scratch(backend, ws, LinearWorkspace::B, width, in);
  backend.gemm(dcols, xi, dc, spec(true, false, 1.0f, 0.0f));          // dC = dy^T x_d
  if (merged) {
    // The layer's merged weight gave dx; y = x (g V)^T with g held: dV = g dy^T x, dm as below.
  } else if (dropout.p <= 0.0f) {
    backend.gemm(dcols, d.weight, dx2, spec(false, false, 1.0f, 1.0f));  // dx += dy C
  } else {
    const Tensor e = scratch(backend, ws, LinearWorkspace::D, N, in);  // (x_d no longer read)
    backend.gemm(dcols, d.weight, e, spec(false, false, 1.0f, 0.0f));
    RoundingDraw draw = dropout.draw;
    draw.stream += static_cast<uint32_t>(index);
    backend.dropout(e, e, dropout.p, draw);                             // through x_d's mask
    backend.add_inplace(dx2, e);
  }
  backend.dora_backward(dc, d.merged, p.m, d.norms, g.m);              // dm, and dC -> dV = g dC
  backend.gemm(dc, p.a, g.b, spec(false, true, scale, 1.0f));           // dB += s dV A^T
  backend.gemm(p.b, dc, g.a, spec(true, false, scale, 1.0f));           // dA += s B^T dV
}

}  // namespace

void lora_backward(Backend& backend, const Tensor& x, const LoraAdapters& params, const LoraAdapters& grads,
                   float scale, const Tensor& dy, const Tensor& dx, LinearWorkspace* ws, const LoraDropout& dropout,
                   const Tensor& w, bool dora_merged) {
  LOOM_CHECK(params.size() == grads.size(), "lora_backward: ", params.size(), " adapters, ", grads.size(), " gradients");
  if (params.empty()) return;
  const Tensor x2 = rows_of(x), dy2 = rows_of(dy), dx2 = rows_of(dx);
  const int64_t N = x2.dim(0), W = dy2.dim(1);
  for (size_t i = 0; i < params.size(); ++i) {
    const LoraAdapter& p = params[i];
    const LoraAdapter& g = grads[i];
    const int64_t r = p.a.dim(0), width = p.b.dim(0);
    Tensor dcols = dy2;
    if (width != W) {
      dcols = scratch(backend, ws, LinearWorkspace::C, N, width);
      copy_columns(backend, dy2, p.out_begin, dcols, false);
    }
    if (p.m.defined()) {
      dora_backward(backend, x2, p, g, scale, dcols, dx2, ws, dropout, i, w, dora_merged);
      continue;
    }
    const Tensor t = scratch(backend, ws, LinearWorkspace::A, N, r), d = scratch(backend, ws, LinearWorkspace::B, N, r);
    const Tensor xi = adapter_input(backend, x2, dropout, i, ws);     // x, or its dropped-out copy
    backend.gemm(xi, p.a, t, spec(false, true, 1.0f, 0.0f));          // t = x A^T
    backend.gemm(dcols, t, g.b, spec(true, false, scale, 1.0f));      // dB += s dy^T t
    backend.gemm(dcols, p.b, d, spec(false, false, scale, 0.0f));     // d = s dy B
    backend.gemm(d, xi, g.a, spec(true, false, 1.0f, 1.0f));          // dA += d^T x
    if (dropout.p <= 0.0f) {
      backend.gemm(d, p.a, dx2, spec(false, false, 1.0f, 1.0f));      // dx += d A
      continue;
    }
    const Tensor e = scratch(backend, ws, LinearWorkspace::D, N, x2.dim(1));  // (x's dropped-out copy no longer read)
    backend.gemm(d, p.a, e, spec(false, false, 1.0f, 0.0f));          // e = d A
    RoundingDraw draw = dropout.draw;
    draw.stream += static_cast<uint32_t>(i);
    backend.dropout(e, e, dropout.p, draw);                           // through the same mask
    backend.add_inplace(dx2, e);                                      // dx += mask (d A) / (1 - p)
  }
}

ModelConfig lora_base_config(const ModelConfig& config) {
  ModelConfig base = config;
  base.peft_method = PeftMethod::none;
  base.lora_rank = ModelConfig{}.lora_rank, base.lora_alpha = ModelConfig{}.lora_alpha;
  base.lora_rslora = false, base.lora_targets = ModelConfig{}.lora_targets;
  base.lora_quantize_base = false, base.lora_dropout = 0.0f, base.lora_dora = false;
  return base;
}

void lora_merge_weight(Backend& backend, const ModelConfig& config, const std::string& weight,
                       const std::function<Tensor(const std::string&)>& adapter, const Tensor& w) {
  const float scale = config.lora_scale();
  for (int64_t l = 0; l < config.n_layer; ++l) {
    for (const LoraSite& site : lora_sites(config, l)) {
      if (site.weight != weight) continue;
      LOOM_CHECK(w.numel() >= (site.out_begin + site.out_count) * site.in, "lora_merge_weight: ", weight, " is ",
                 w.describe(), ", its adapter covers rows to ", site.out_begin + site.out_count, " of ", site.in);
      const Tensor rows = w.view(site.out_begin * site.in, {site.out_count, site.in});
      backend.gemm(adapter(site.module + ".lora_B.weight"), adapter(site.module + ".lora_A.weight"), rows,
                   spec(false, false, scale, 1.0f));
      if (!config.lora_dora) continue;
      const Tensor norms = Tensor::empty(backend.allocator(), {site.out_count}, DTYPE_F32, MEM_WORKSPACE);
      backend.row_norms(rows, norms);  // rows = g (W + s B A), g = m / ||W + s B A||
      backend.dora_weight(rows, Tensor{}, adapter(site.module + ".lora_magnitude_vector"), norms, rows);
    }
  }
}

std::vector<std::string> lora_merged_weights(const ModelConfig& config) {
  std::vector<std::string> names;
  for (int64_t l = 0; l < config.n_layer; ++l) {
    for (const LoraSite& site : lora_sites(config, l)) {
      if (std::find(names.begin(), names.end(), site.weight) == names.end()) names.push_back(site.weight);
    }
  }
  return names;
}

void lora_merge(Backend& backend, const ModelConfig& config, const Tensor& params, const Tensor& merged) {
  const ParamLayout layout = build_param_layout(config);
  const int64_t base = lora_begin(config, layout);
  LOOM_CHECK(config.lora() && params.numel() == layout.total && merged.numel() == base, "lora_merge: ",
             params.describe(), " -> ", merged.describe(), " for a model of ", layout.total, " parameters (",
             base, " without adapters)");
  backend.copy(params.view(0, {base}), merged.view(0, {base}));
  const auto adapter = [&](const std::string& name) {
    const ParamSpec& p = layout.find(name);
    return params.view(p.offset, p.shape);
  };
  for (const std::string& weight : lora_merged_weights(config)) {
    const ParamSpec& w = layout.find(weight);  // a base parameter: the same offset in `merged`
    lora_merge_weight(backend, config, weight, adapter, merged.view(w.offset, w.shape));
  }
}

void dora_init_magnitudes(Backend& backend, const ModelConfig& config, const Tensor& params) {
  if (!config.lora_dora) return;
  const ParamLayout layout = build_param_layout(config);
  LOOM_CHECK(params.numel() == layout.total, "dora_init_magnitudes: ", params.describe(), " for a model of ",
             layout.total, " parameters");
  for (int64_t l = 0; l < config.n_layer; ++l) {
    for (const LoraSite& site : lora_sites(config, l)) {
      const ParamSpec& w = layout.find(site.weight);
      const ParamSpec& m = layout.find(site.module + ".lora_magnitude_vector");
      backend.row_norms(params.view(w.offset + site.out_begin * site.in, {site.out_count, site.in}),
                        params.view(m.offset, m.shape));
    }
  }
}

LoraWeight lora_layer_weight(Backend& backend, const Tensor& w, const Tensor& w16, const LoraAdapters& adapters,
                             float scale, const LoraDropout& dropout, LinearWorkspace* ws) {
  bool dora = false;
  for (const LoraAdapter& ad : adapters) dora = dora || ad.m.defined();
  if (!dora || dropout.p > 0.0f || dropout.off || w16.defined() || ws == nullptr) return {w, false};
  const Tensor merged = ws->f32(LinearWorkspace::H, w.shape());
  backend.copy(w, merged);
  for (const LoraAdapter& ad : adapters) {
    if (!ad.m.defined()) continue;
    const int64_t width = ad.b.dim(0), in = ad.a.dim(1);
    const DoraRows d = dora_rows(backend, ad, w, scale, ws, false);  // V and its norms
    backend.dora_weight(d.merged, Tensor{}, ad.m, d.norms, merged.view(ad.out_begin * in, {width, in}));  // g V
  }
  return {merged, true};
}

}  // namespace loom
