#include "loom/train/quantize_run.h"

#include <algorithm>
#include <chrono>
#include <cstdio>

#include "loom/arch/param_layout.h"
#include "loom/checkpoint/checkpoint.h"
#include "loom/checkpoint/hf_model.h"
#include "loom/core/error.h"
#include "loom/core/pages.h"
#include "loom/data/tokenizer_files.h"
#include "loom/train/config.h"

namespace loom {

namespace {

bool act_int8(QuantMethod m) { return m == QuantMethod::smoothquant || m == QuantMethod::w8a8; }

void check_source(const ModelSource& source) {
  LOOM_CHECK(!source.quantized, source.path, " is already quantized: quantize the checkpoint it was made from");
  LOOM_CHECK(!source.config.model.lora() && source.adapter.empty(), source.path,
             " has LoRA adapters: merge them first (loom convert --to hf)");
  LOOM_CHECK(source.config.model.moe_experts == 0 && !source.config.model.mla(), source.path,
             ": loom quantize takes dense models (no MoE or MLA layers)");
}

nlohmann::json quantization_json(const QuantizeOptions& o, int64_t calib_tokens, const std::string& source) {
  return {{"method", quant_method_name(o.method)},
          {"bits", o.bits},
          {"group", o.group},
          {"activations", act_int8(o.method) ? "int8" : "f32"},
          {"act_order", o.gptq.act_order},
          {"damp", o.gptq.damp},
          {"alpha", o.alpha},
          {"calib_tokens", calib_tokens},
          {"source", source}};
}

}  // namespace

QuantizeMemory quantize_memory_estimate(const ModelSource& source, const QuantizeOptions& o, int64_t calib_sequences) {
  check_source(source);
  const ModelConfig& c = source.config.model;
  const ParamLayout layout = build_param_layout(c);
  const bool calibrates = quant_method_calibrates(o.method), gptq = o.method == QuantMethod::gptq;
  const bool row_wise = !calibrates || gptq;
  const int64_t L = c.n_layer, C = c.d_model, T = o.calib_seq_len;
  int64_t embedding = 0, head = 0;
  for (const ParamSpec& p : layout.params) {
    if (p.role == ROLE_EMBEDDING) embedding += p.numel * 4;
    if (p.role == ROLE_HEAD) head += p.numel * 4;
  }
  if (c.tied_head()) head = embedding;
  // The calibration hidden states (two copies while a block advances) and one batch's block
  // store: its input, norms, qkv, attention output and probabilities, the MLP's hidden
  // activations (the backward scratch allocated with it is never written: no pages).
  int64_t hidden = 0;
  if (calibrates) {
    const int64_t batch = std::min<int64_t>(4, calib_sequences), rows = batch * T;
    const int64_t store = rows * (5 * C + c.qkv_width() + 3 * c.d_ff) + batch * c.n_head * T * T;
    hidden = 2 * calib_sequences * T * C * 4 + store * 4;
  }
  // Quantizing one weight: the f32 rows it reads (4,096 at a time for row-wise methods), their
  // dequantized copy and codes, the packed codes and scales gathered so far; GPTQ first computes
  // its factor U from a damped copy of the Hessian (two K x K doubles besides the Hessian), then
  // holds U (the Hessian freed) with the rows in double.
  auto rows_work = [&](int64_t R, int64_t K) {
    const int64_t rows = row_wise ? std::min<int64_t>(R, 4096) : R;
    int64_t w = rows * K * (4 + 4 + 1) + R * K * o.bits / 8 + R * (K / std::max<int64_t>(o.group, 32)) * 5;
    if (gptq) w += rows * K * 8 + K * K * 8;
    if (o.method == QuantMethod::awq) w += 3 * R * K * 4 + 2 * InputStats::kSampleRows * R * 4;
    return w;
  };
  // A linear input's statistics: three K-vectors in double, a 512-row sample, GPTQ's Hessian.
  auto stats = [&](int64_t K) { return K * 3 * 8 + InputStats::kSampleRows * K * 4 + (gptq ? K * K * 8 : 0); };
  QuantizeMemory peak;
  peak.streamed = source.hf;
  auto consider = [&](int64_t weights, int64_t w, int64_t st) {
    QuantizeMemory m{peak.streamed ? weights : layout.total * 4, w, st, hidden, peak.streamed};
    if (m.total() > peak.total()) peak = m;
  };
  const std::vector<std::vector<std::string>> units = quantize_load_units(c, layout);
  for (int64_t l = 0; l < L; ++l) {
    std::vector<std::pair<int64_t, int64_t>> linear;  // (rows, cols) in linear_weights() order
    int64_t resident = calibrates && l == 0 ? embedding : 0;
    for (const std::string& name : units[static_cast<size_t>(l + 1)]) {
      const ParamSpec& p = layout.find(name);
      resident += p.numel * 4;
      if (p.role == ROLE_HIDDEN && p.shape.size() == 2) linear.emplace_back(p.shape[0], p.shape[1]);
    }
    if (calibrates) {  // measuring the block: every input's statistics, one batch's x^T x in f32 (device and host)
      int64_t all = 0, widest = 0;
      for (const auto& [R, K] : linear) all += stats(K), widest = std::max(widest, K);
      consider(resident, 0, all + (gptq ? 2 * widest * widest * 4 : 0));
    }
    for (size_t i = 0; i < linear.size(); ++i) {  // quantizing weight i: the statistics not yet consumed
      const auto [R, K] = linear[i];
      int64_t left = 0;
      for (size_t j = i; j < linear.size() && calibrates; ++j) left += stats(linear[j].second);
      if (gptq) consider(resident, 2 * K * K * 8, left);                      // its factor
      consider(resident, rows_work(R, K), gptq ? left - K * K * 8 : left);    // its rows
    }
  }
  if (o.head) {
    if (gptq) consider(head, 2 * C * C * 8, stats(C));
    consider(head, rows_work(c.vocab_size, C), calibrates ? stats(C) - (gptq ? C * C * 8 : 0) : 0);
  }
  return peak;
}

std::string describe(const QuantizeMemory& m) {
  const auto gib = [](int64_t b) { return static_cast<double>(b) / (1 << 30); };
  char line[400];
  std::snprintf(line, sizeof line, "planned peak host memory %.3f GiB: f32 weights %.3f GiB (%s), quantization work %.3f, "
                "statistics %.3f, calibration hidden states and store %.3f (beyond the process's own)", gib(m.total()), gib(m.weights),
                m.streamed ? "streamed: one block, the embedding or the head at once" : "the whole checkpoint", gib(m.work),
                gib(m.statistics), gib(m.hidden));
  return line;
}

QuantizeRunResult quantize_to_folder(const ModelSource& source, const QuantizeOptions& o,
                                     const std::vector<std::vector<int32_t>>& sequences, const std::string& out,
                                     const std::function<void(const std::string&)>& progress) {
  check_source(source);
  const auto start = std::chrono::steady_clock::now();
  const LoomConfig& config = source.config;
  const ModelConfig& c = config.model;
  auto backend = make_cpu_backend();
  const bool stream = source.hf;
  // Streamed: lazy f32 pages, each unit read when quantize_model asks for it and released after.
  Transformer model(*backend, c, ModelUse{.gradients = false, .lazy_params = stream});
  std::unique_ptr<HfWeightReader> reader;
  if (stream) reader = std::make_unique<HfWeightReader>(source.path, c);
  else load_weights(source, model.params());
  const ParamLayout& layout = model.layout();

  QuantizedModelPlan plan;
  plan.model = c;
  plan.storage = o.storage;
  const std::vector<Transformer::LinearWeight> linears = model.linear_weights();
  const size_t quantized_count = o.head ? linears.size() : linears.size() - 1;
  const bool input_scales = o.method == QuantMethod::awq || o.method == QuantMethod::smoothquant;
  for (size_t i = 0; i < quantized_count; ++i) {
    const Transformer::LinearWeight& lw = linears[i];
    plan.quantized[lw.name] = {int_weight_spec(o.bits, o.group, lw.weight.dim(0), lw.weight.dim(1), act_int8(o.method), lw.name),
                               input_scales};
  }
  if (c.tied_head() && o.head) plan.also_plain.insert(linears.back().name);  // the embedding still looks tokens up
  // The token embedding (and a head left unquantized) stay in the source's dtype when it is BF16.
  if (stream) {
    for (const ParamSpec& p : layout.params) {
      const bool kept = p.name == embedding_param_name(c) || (p.role == ROLE_HEAD && !o.head);
      if (kept && reader->stored_as_bf16(p.name)) plan.plain_dtype[p.name] = DTYPE_BF16;
    }
  }
  plan.quantization = quantization_json(o, static_cast<int64_t>(sequences.size()) * o.calib_seq_len, source.path);
  QuantizedModelWriter writer(out, plan);

  QuantizeRunResult result;
  result.total_params = layout.total;
  CpuAllocator host;
  for (const std::string& name : writer.plain_params()) {
    const ParamSpec& spec = layout.find(name);
    Tensor t;
    if (stream) {
      t = Tensor::empty(host, spec.shape, plan.plain_type(name), MEM_WORKSPACE);
      reader->read(name, t);
    } else {
      t = model.params().view(spec.offset, spec.shape);
    }
    writer.write_plain(name, t);
    result.plain_bytes += t.nbytes();
  }
  QuantizeStream feed;
  if (stream) {
    feed.load = [&](const std::vector<std::string>& names) {
      for (const std::string& name : names) reader->read(name, model.param(name));
    };
    feed.release = [&](const std::vector<std::string>& names) {
      for (const std::string& name : names) {
        const ParamSpec& spec = layout.find(name);
        release_elements(model.params(), spec.offset, spec.offset + spec.numel);
      }
    };
  }
  feed.emit = [&](const std::string& name, IntWeight q) {
    result.quantized_params += q.spec.rows * q.spec.cols;
    result.stored_bytes += q.stored_bytes();
    writer.write_weight(name, q);
  };
  quantize_model(model, sequences, o, progress, feed);
  writer.commit(config_to_toml(config), tokenizer_attachments(config.data.tokenizer));
  result.file_bytes = writer.model_file_bytes();
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return result;
}

}  // namespace loom
