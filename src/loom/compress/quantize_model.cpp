#include "loom/compress/quantize_model.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <optional>

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
                       int grid, const IntStorage& storage, double& best_ratio) {
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
    IntWeight q = rtn_quantize(scale_columns(w, K, s), spec, storage);
    q.input_scale = inv;  // ratio 0: s = 1, plain RTN (kept, so every AWQ weight has one)
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

// Rows appended to a weight quantized in row chunks (codes, scales and zeros are row-major).
void append_rows(IntWeight& q, IntWeight&& part) {
  if (q.codes.empty()) {
    q = std::move(part);
    return;
  }
  q.codes.insert(q.codes.end(), part.codes.begin(), part.codes.end());
  q.scales.insert(q.scales.end(), part.scales.begin(), part.scales.end());
  q.zeros.insert(q.zeros.end(), part.zeros.begin(), part.zeros.end());
}

constexpr int64_t kRowChunk = 4096;  // rows a row-wise method quantizes at once

}  // namespace

std::vector<float> effective_weight(const IntWeight& q) {
  std::vector<float> w = int_dequantize(q);
  if (!q.input_scale.empty()) {
    for (size_t i = 0; i < w.size(); ++i) w[i] *= q.input_scale[i % static_cast<size_t>(q.spec.cols)];
  }
  return w;
}

std::vector<std::vector<std::string>> quantize_load_units(const ModelConfig& config, const ParamLayout& layout) {
  const int64_t L = config.n_layer;
  const std::vector<RangeSet> units = layout_units(config, layout);
  std::vector<std::vector<std::string>> out(static_cast<size_t>(L + 3));
  for (const ParamSpec& p : layout.params) {
    const RangeSet own = RangeSet::span(p.offset, p.offset + p.numel);
    size_t unit = 0;
    while (unit < units.size() && own.intersect(units[unit]).empty()) ++unit;
    LOOM_CHECK(unit < units.size(), p.name, ": in no unit of the layout");
    if (unit > 0) out[unit].push_back(p.name);
    else if (p.role == ROLE_EMBEDDING) out[0].push_back(p.name);
    else if (p.role == ROLE_HEAD) out[static_cast<size_t>(L + 2)].push_back(p.name);
    else out[static_cast<size_t>(L + 1)].push_back(p.name);
  }
  return out;
}

std::map<std::string, IntWeight> quantize_model(Transformer& model, const std::vector<std::vector<int32_t>>& sequences,
                                                const QuantizeOptions& o,
                                                const std::function<void(const std::string&)>& progress,
                                                const QuantizeStream& stream) {
  Backend& backend = model.backend();
  const int64_t L = model.config().n_layer;
  const bool act_int8 = o.method == QuantMethod::smoothquant || o.method == QuantMethod::w8a8;
  const bool calibrates = quant_method_calibrates(o.method);
  LOOM_CHECK(!calibrates || !sequences.empty(), "--method ", quant_method_name(o.method),
             " needs calibration text (--calib FILE)");
  LOOM_CHECK(!act_int8 || o.storage == IntStorage{}, "--method ", quant_method_name(o.method),
             " stores int8 weights with f32 per-row scales: drop --scales f16 and --symmetric");
  // Every layer's shape against bits and group before any work.
  for (const Transformer::LinearWeight& lw : model.linear_weights()) {
    (void)int_weight_spec(o.bits, o.group, lw.weight.dim(0), lw.weight.dim(1), act_int8, lw.name);
  }
  const std::vector<std::vector<std::string>> units = quantize_load_units(model.config(), model.layout());
  const size_t final_norm = static_cast<size_t>(L + 1), head = model.config().tied_head() ? 0 : static_cast<size_t>(L + 2);
  auto load = [&](size_t unit) {
    if (stream.load && !units[unit].empty()) stream.load(units[unit]);
  };
  auto release = [&](size_t unit) {
    if (stream.release && !units[unit].empty()) stream.release(units[unit]);
  };
  std::optional<SequentialCalibration> calibration;
  if (calibrates) {
    calibration.emplace(model, sequences, o.method == QuantMethod::gptq);
    load(0);  // block 0's forward starts with the embedding
  }
  GptqOptions gptq = o.gptq;
  gptq.storage = o.storage;
  std::map<std::string, IntWeight> out;
  for (int64_t layer = 0; layer <= L; ++layer) {
    if (layer == L && !o.head) break;
    const bool last_block = layer == L - 1;
    load(layer < L ? static_cast<size_t>(layer + 1) : head);
    if (calibrates && last_block) load(final_norm);  // the last block's forward ends with the final norm
    std::map<std::string, InputStats> stats;
    if (calibrates) stats = calibration->stats(layer);
    for (const Transformer::LinearWeight& lw : layer_linear_weights(model, layer)) {
      const int64_t rows = lw.weight.dim(0), cols = lw.weight.dim(1);
      const IntWeightSpec spec = int_weight_spec(o.bits, o.group, rows, cols, act_int8, lw.name);
      std::string note;
      double num = 0.0, den = 0.0;  // |deq - w|^2, |w|^2
      IntWeight q;
      std::optional<GptqFactor> factor;
      if (o.method == QuantMethod::gptq) {
        factor = gptq_factor(stats.at(lw.name).hessian, cols, gptq);
        std::vector<double>().swap(stats.at(lw.name).hessian);  // U replaces it
      }
      // Row-wise methods (rtn, w8a8, gptq) run on chunks of rows, so a large weight (a 128k
      // head) never has its whole f32, dequantized and double copies at once; AWQ and
      // SmoothQuant choose per-column scales from the whole weight.
      const bool row_wise = o.method == QuantMethod::rtn || o.method == QuantMethod::w8a8 || o.method == QuantMethod::gptq;
      const int64_t chunk = row_wise ? kRowChunk : rows;
      for (int64_t r0 = 0; r0 < rows; r0 += chunk) {
        const int64_t n = std::min(chunk, rows - r0);
        const Tensor view = lw.weight.view(r0 * cols, {n, cols});
        const std::vector<float> w = read_host(backend, view);
        IntWeightSpec part = spec;
        part.rows = n;
        IntWeight p;
        switch (o.method) {
          case QuantMethod::rtn:
          case QuantMethod::w8a8: p = rtn_quantize(w, part, o.storage); break;
          case QuantMethod::gptq: p = gptq_quantize_rows(w, *factor, part, gptq); break;
          case QuantMethod::awq: {
            double ratio = 0.0;
            p = awq_quantize(backend, w, stats.at(lw.name), part, o.awq_grid, o.storage, ratio);
            note = str_cat(", ratio ", ratio);
            break;
          }
          case QuantMethod::smoothquant: p = smooth_quantize(w, stats.at(lw.name), part, o.alpha); break;
        }
        check_stored_scales(p, lw.name);
        const std::vector<float> deq = effective_weight(p);
        for (size_t i = 0; i < w.size(); ++i) {
          num += (static_cast<double>(deq[i]) - w[i]) * (static_cast<double>(deq[i]) - w[i]);
          den += static_cast<double>(w[i]) * w[i];
        }
        if (layer < L) backend.write(view, deq.data());  // sequential: later layers calibrate on these
        append_rows(q, std::move(p));
      }
      q.spec = spec;
      if (progress) {
        char line[256];
        std::snprintf(line, sizeof line, "%s (%lld x %lld): relative weight error %.4g%s", lw.name.c_str(),
                      static_cast<long long>(rows), static_cast<long long>(cols), std::sqrt(num / std::max(den, 1e-30)),
                      note.c_str());
        progress(line);
      }
      if (stream.emit) stream.emit(lw.name, std::move(q));
      else out.emplace(lw.name, std::move(q));
    }
    if (layer == L) {
      release(head);
      break;
    }
    if (calibrates && (!last_block || o.head)) calibration->advance(layer);  // the next block's inputs (the head's)
    if (calibrates && layer == 0) release(0);
    if (calibrates && last_block) release(final_norm);
    release(static_cast<size_t>(layer + 1));
  }
  return out;
}

}  // namespace loom
