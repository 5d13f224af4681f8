#include "loom/compress/quantize_model.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>

#include "loom/core/error.h"

namespace loom {

QuantMethod parse_quant_method(const std::string& name) {
  if (name == "rtn") return QuantMethod::rtn;
  if (name == "gptq") return QuantMethod::gptq;
  if (name == "awq") return QuantMethod::awq;
  if (name == "smoothquant") return QuantMethod::smoothquant;
  if (name == "w8a8") return QuantMethod::w8a8;
  throw Error(str_cat("--method '", name, "' is not a quantization method: expected rtn, gptq, awq, smoothquant or w8a8"));
}

const char* quant_method_name(QuantMethod m) {
  switch (m) {
    case QuantMethod::rtn: return "rtn";
    case QuantMethod::gptq: return "gptq";
    case QuantMethod::awq: return "awq";
    case QuantMethod::smoothquant: return "smoothquant";
    case QuantMethod::w8a8: return "w8a8";
  }
  return "?";
}

bool quant_method_calibrates(QuantMethod m) {
  return m == QuantMethod::gptq || m == QuantMethod::awq || m == QuantMethod::smoothquant;
}

namespace {

std::vector<float> read_host(Backend& backend, const Tensor& t) {
  std::vector<float> v(static_cast<size_t>(t.numel()));
  backend.read(t, v.data());
  return v;
}

Tensor host_tensor(Backend& backend, const std::vector<float>& v, const Shape& shape) {
  Tensor t = Tensor::empty(backend.allocator(), shape, DTYPE_F32, MEM_WORKSPACE);
  backend.write(t, v.data());
  return t;
}

// y (n, rows) = x (n, cols) w^T on the backend, to the host.
std::vector<float> product(Backend& backend, const Tensor& x, const std::vector<float>& w, int64_t rows, int64_t cols) {
  const Tensor wt = host_tensor(backend, w, {rows, cols});
  Tensor y = Tensor::empty(backend.allocator(), {x.dim(0), rows}, DTYPE_F32, MEM_WORKSPACE);
  GemmSpec spec;
  spec.trans_b = true;
  backend.gemm(x, wt, y, spec);
  return read_host(backend, y);
}

double mean_square_diff(const std::vector<float>& a, const std::vector<float>& b) {
  double s = 0.0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double d = static_cast<double>(a[i]) - static_cast<double>(b[i]);
    s += d * d;
  }
  return s / static_cast<double>(std::max<size_t>(a.size(), 1));
}

// w diag(s) (columns scaled).
std::vector<float> scale_columns(const std::vector<float>& w, int64_t cols, const std::vector<float>& s) {
  std::vector<float> out(w.size());
  for (size_t i = 0; i < w.size(); ++i) out[i] = w[i] * s[i % static_cast<size_t>(cols)];
  return out;
}

IntWeight awq_quantize(Backend& backend, const std::vector<float>& w, const InputStats& st, const IntWeightSpec& spec,
                       int grid, double& best_ratio) {
  const int64_t K = spec.cols, S = static_cast<int64_t>(st.sample.size()) / K;
  LOOM_CHECK(S > 0, "awq: no calibration rows");
  const Tensor x = host_tensor(backend, st.sample, {S, K});
  const std::vector<float> reference = product(backend, x, w, spec.rows, K);
  std::vector<float> x_mean(static_cast<size_t>(K));
  for (int64_t j = 0; j < K; ++j) x_mean[static_cast<size_t>(j)] = static_cast<float>(st.abs_sum[static_cast<size_t>(j)] / static_cast<double>(st.rows));
  double best = std::numeric_limits<double>::infinity();
  IntWeight best_q;
  best_ratio = 0.0;
  for (int k = 0; k < grid; ++k) {
    const double ratio = static_cast<double>(k) / grid;
    std::vector<float> s(static_cast<size_t>(K));
    float lo = std::numeric_limits<float>::infinity(), hi = 0.0f;
    for (int64_t j = 0; j < K; ++j) {
      s[static_cast<size_t>(j)] = std::max(static_cast<float>(std::pow(static_cast<double>(x_mean[static_cast<size_t>(j)]), ratio)), 1e-4f);
      lo = std::min(lo, s[static_cast<size_t>(j)]), hi = std::max(hi, s[static_cast<size_t>(j)]);
    }
    const float norm = std::sqrt(hi * lo);
    std::vector<float> inv(static_cast<size_t>(K));
    for (int64_t j = 0; j < K; ++j) s[static_cast<size_t>(j)] /= norm, inv[static_cast<size_t>(j)] = 1.0f / s[static_cast<size_t>(j)];
    IntWeight q = rtn_quantize(scale_columns(w, K, s), spec);
    if (k > 0) q.input_scale = inv;  // ratio 0: s = 1, plain RTN
    const double err = mean_square_diff(product(backend, x, effective_weight(q), spec.rows, K), reference);
    if (err < best) best = err, best_q = std::move(q), best_ratio = ratio;
  }
  return best_q;
}

IntWeight smooth_quantize(const std::vector<float>& w, const InputStats& st, const IntWeightSpec& spec, double alpha) {
  const int64_t K = spec.cols;
  std::vector<float> wmax(static_cast<size_t>(K), 0.0f);
  for (size_t i = 0; i < w.size(); ++i) {
    float& m = wmax[i % static_cast<size_t>(K)];
    m = std::max(m, std::fabs(w[i]));
  }
  std::vector<float> s(static_cast<size_t>(K)), inv(static_cast<size_t>(K));
  for (int64_t j = 0; j < K; ++j) {
    const double xm = std::max(st.abs_max[static_cast<size_t>(j)], 1e-5), wm = std::max(static_cast<double>(wmax[static_cast<size_t>(j)]), 1e-5);
    s[static_cast<size_t>(j)] = static_cast<float>(std::pow(xm, alpha) / std::pow(wm, 1.0 - alpha));
    inv[static_cast<size_t>(j)] = 1.0f / s[static_cast<size_t>(j)];
  }
  IntWeight q = rtn_quantize(scale_columns(w, K, s), spec);
  q.input_scale = inv;
  return q;
}

}  // namespace

std::vector<Transformer::LinearWeight> layer_linear_weights(Transformer& model, int64_t layer) {
  std::vector<Transformer::LinearWeight> all = model.linear_weights();
  if (layer == model.config().n_layer) return {all.back()};
  return {all.begin() + layer * 4, all.begin() + layer * 4 + 4};
}

std::vector<float> effective_weight(const IntWeight& q) {
  std::vector<float> w = int_dequantize(q);
  if (!q.input_scale.empty()) {
    for (size_t i = 0; i < w.size(); ++i) w[i] *= q.input_scale[i % static_cast<size_t>(q.spec.cols)];
  }
  return w;
}

std::map<std::string, InputStats> calibration_stats(Transformer& model, const std::vector<std::vector<int32_t>>& sequences,
                                                    int64_t layer, bool hessian) {
  LOOM_CHECK(!sequences.empty(), "calibration: no sequences");
  Backend& backend = model.backend();
  const int64_t L = model.config().n_layer, T = static_cast<int64_t>(sequences[0].size());
  const std::vector<Transformer::LinearWeight> weights = layer_linear_weights(model, layer);
  std::map<std::string, InputStats> stats;
  for (const Transformer::LinearWeight& lw : weights) {
    const int64_t K = lw.weight.dim(1);
    InputStats& st = stats[lw.name];
    st.abs_sum.assign(static_cast<size_t>(K), 0.0);
    st.abs_max.assign(static_cast<size_t>(K), 0.0);
    st.sq_sum.assign(static_cast<size_t>(K), 0.0);
    if (hessian) st.hessian.assign(static_cast<size_t>(K * K), 0.0);
  }
  constexpr int64_t kBatch = 4;
  const int64_t batches = (static_cast<int64_t>(sequences.size()) + kBatch - 1) / kBatch;
  const int64_t per_batch_sample = std::max<int64_t>(1, InputStats::kSampleRows / batches);
  ActivationStore store;
  for (int64_t b = 0; b < batches; ++b) {
    const int64_t first = b * kBatch, n = std::min<int64_t>(kBatch, static_cast<int64_t>(sequences.size()) - first);
    if (store.batch != n) store = model.allocate_store(n, T);  // once, and again for a shorter last batch
    std::vector<int32_t> tokens(static_cast<size_t>(n * T));
    for (int64_t i = 0; i < n; ++i) {
      LOOM_CHECK(static_cast<int64_t>(sequences[static_cast<size_t>(first + i)].size()) == T, "calibration: sequences of unequal length");
      std::copy(sequences[static_cast<size_t>(first + i)].begin(), sequences[static_cast<size_t>(first + i)].end(), tokens.begin() + i * T);
    }
    backend.write(store.tokens, tokens.data());
    backend.write(store.targets, tokens.data());  // unused (no loss), but valid ids
    model.forward_stage(store, 0, layer < L ? layer + 1 : L, false);
    std::vector<Tensor> inputs;
    if (layer < L) {
      const BlockSaved& s = store.blocks[static_cast<size_t>(layer)];
      inputs = {s.attention.norm.out, s.attention.attn, s.mlp.norm.out, s.mlp.act};
    } else {
      inputs = {store.final_norm};
    }
    for (size_t i = 0; i < weights.size(); ++i) {
      const int64_t K = weights[i].weight.dim(1), rows = n * T;
      const Tensor x = inputs[i].view(0, {rows, K});
      InputStats& st = stats[weights[i].name];
      if (hessian) {  // this batch's x^T x by the f32 GEMM, summed over batches in double (AutoGPTQ sums in f32)
        Tensor h = Tensor::empty(backend.allocator(), {K, K}, DTYPE_F32, MEM_WORKSPACE);
        GemmSpec spec;
        spec.trans_a = true;
        backend.gemm(x, x, h, spec);
        const std::vector<float> part = read_host(backend, h);
        for (size_t e = 0; e < part.size(); ++e) st.hessian[e] += part[e];
      }
      const std::vector<float> host = read_host(backend, x);
      for (int64_t r = 0; r < rows; ++r) {
        const float* row = host.data() + r * K;
        for (int64_t j = 0; j < K; ++j) {
          const double v = row[j];
          st.abs_sum[static_cast<size_t>(j)] += std::fabs(v);
          st.abs_max[static_cast<size_t>(j)] = std::max(st.abs_max[static_cast<size_t>(j)], std::fabs(v));
          st.sq_sum[static_cast<size_t>(j)] += v * v;
        }
      }
      const int64_t take = std::min(per_batch_sample, rows), stride = rows / take;
      for (int64_t k = 0; k < take && static_cast<int64_t>(st.sample.size()) < InputStats::kSampleRows * K; ++k) {
        st.sample.insert(st.sample.end(), host.begin() + k * stride * K, host.begin() + (k * stride + 1) * K);
      }
      st.rows += rows;
    }
  }
  return stats;
}

std::map<std::string, IntWeight> quantize_model(Transformer& model, const std::vector<std::vector<int32_t>>& sequences,
                                                const QuantizeOptions& o,
                                                const std::function<void(const std::string&)>& progress) {
  Backend& backend = model.backend();
  const int64_t L = model.config().n_layer;
  const bool act_int8 = o.method == QuantMethod::smoothquant || o.method == QuantMethod::w8a8;
  LOOM_CHECK(!quant_method_calibrates(o.method) || !sequences.empty(), "--method ", quant_method_name(o.method),
             " needs calibration text (--calib FILE)");
  // Every layer's shape against bits and group before any work.
  for (const Transformer::LinearWeight& lw : model.linear_weights()) {
    (void)int_weight_spec(o.bits, o.group, lw.weight.dim(0), lw.weight.dim(1), act_int8, lw.name);
  }
  std::map<std::string, IntWeight> out;
  for (int64_t layer = 0; layer <= L; ++layer) {
    if (layer == L && !o.head) break;
    std::map<std::string, InputStats> stats;
    if (quant_method_calibrates(o.method)) stats = calibration_stats(model, sequences, layer, o.method == QuantMethod::gptq);
    for (const Transformer::LinearWeight& lw : layer_linear_weights(model, layer)) {
      const int64_t rows = lw.weight.dim(0), cols = lw.weight.dim(1);
      const IntWeightSpec spec = int_weight_spec(o.bits, o.group, rows, cols, act_int8, lw.name);
      const std::vector<float> w = read_host(backend, lw.weight);
      IntWeight q;
      std::string note;
      switch (o.method) {
        case QuantMethod::rtn:
        case QuantMethod::w8a8: q = rtn_quantize(w, spec); break;
        case QuantMethod::gptq: q = gptq_quantize(w, stats.at(lw.name).hessian, spec, o.gptq); break;
        case QuantMethod::awq: {
          double ratio = 0.0;
          q = awq_quantize(backend, w, stats.at(lw.name), spec, o.awq_grid, ratio);
          note = str_cat(", ratio ", ratio);
          break;
        }
        case QuantMethod::smoothquant: q = smooth_quantize(w, stats.at(lw.name), spec, o.alpha); break;
      }
      const std::vector<float> deq = effective_weight(q);
      double num = 0.0, den = 0.0;
      for (size_t i = 0; i < w.size(); ++i) {
        num += (static_cast<double>(deq[i]) - w[i]) * (static_cast<double>(deq[i]) - w[i]);
        den += static_cast<double>(w[i]) * w[i];
      }
      if (layer < L) backend.write(lw.weight, deq.data());  // sequential: later layers calibrate on these
      if (progress) {
        char line[256];
        std::snprintf(line, sizeof line, "%s (%lld x %lld): relative weight error %.4g%s", lw.name.c_str(),
                      static_cast<long long>(rows), static_cast<long long>(cols), std::sqrt(num / std::max(den, 1e-30)),
                      note.c_str());
        progress(line);
      }
      out.emplace(lw.name, std::move(q));
    }
  }
  return out;
}

}  // namespace loom
