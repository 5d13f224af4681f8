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
  const std::vector<RangeSet> units = layout_units(c, layout);
  const bool calibrates = quant_method_calibrates(o.method), gptq = o.method == QuantMethod::gptq;
  const bool row_wise = !calibrates || gptq;
  int64_t block = 0, embedding = 0, head = 0;
  for (size_t u = 1; u < units.size(); ++u) block = std::max(block, units[u].size() * 4);
  for (const ParamSpec& p : layout.params) {
    if (p.role == ROLE_EMBEDDING) embedding += p.numel * 4;
    if (p.role == ROLE_HEAD) head += p.numel * 4;
  }
  if (c.tied_head()) head = embedding;
  QuantizeMemory m;
  m.streamed = source.hf;
  if (!m.streamed) m.weights = layout.total * 4;
  else m.weights = std::max(block + (calibrates ? embedding : 0), o.head ? head : 0);
  // The largest weight's work: its f32 rows, their dequantized copy, codes (one per element
  // before packing) and, for GPTQ, the rows in double and the layer's factor U (K x K double,
  // with the Hessian's copy while it is factored); row-wise methods take 4096 rows at a time.
  const int64_t C = c.d_model;
  const std::string head_name = c.tied_head() ? embedding_param_name(c) : "lm_head.weight";
  for (const ParamSpec& p : layout.params) {
    const bool quantized = p.role == ROLE_HIDDEN || (o.head && p.name == head_name);
    if (p.shape.size() != 2 || !quantized) continue;
    const int64_t R = p.shape[0], K = p.shape[1], rows = row_wise ? std::min<int64_t>(R, 4096) : R;
    int64_t work = rows * K * (4 + 4 + 1) + R * K / 2;  // + the packed codes gathered so far
    if (gptq) work += rows * K * 8 + 2 * K * K * 8;
    if (o.method == QuantMethod::awq) work += 3 * R * K * 4 + 2 * InputStats::kSampleRows * R * 4;
    m.work = std::max(m.work, work);
  }
  if (calibrates) {
    // One block's statistics: per linear input K, three K-vectors in double, a 512-row sample,
    // and for GPTQ the Hessian in double plus one batch's in f32 (device and host copies).
    const int64_t inputs[] = {C, c.n_head * c.head_dim(), C, c.d_ff};
    int64_t stats = 0;
    for (int64_t K : inputs) stats += K * 3 * 8 + InputStats::kSampleRows * K * 4 + (gptq ? K * K * 8 : 0);
    if (gptq) stats += 2 * c.d_ff * c.d_ff * 4;
    m.statistics = std::max(stats, C * 3 * 8 + InputStats::kSampleRows * C * 4 + (gptq ? C * C * 8 : 0));
    const int64_t T = o.calib_seq_len, tokens = calib_sequences * T, batch = std::min<int64_t>(4, calib_sequences) * T;
    // Hidden states (two copies), and one batch's block store: its input, norms, qkv, attention
    // probabilities and outputs, the MLP's hidden activations, and the backward scratch sized with it.
    const int64_t store = batch * (8 * C + 3 * c.qkv_width() + 4 * c.d_ff) + std::min<int64_t>(4, calib_sequences) * c.n_head * T * T;
    m.hidden = 2 * tokens * C * 4 + 2 * store * 4;
  }
  return m;
}

std::string describe(const QuantizeMemory& m) {
  const auto gib = [](int64_t b) { return static_cast<double>(b) / (1 << 30); };
  char line[400];
  std::snprintf(line, sizeof line, "planned peak host memory %.3f GiB: f32 weights %.3f GiB (%s), quantization work %.3f, "
                "statistics %.3f, calibration hidden states %.3f (beyond the process's own)", gib(m.total()), gib(m.weights),
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
    const auto d = plan.plain_dtype.find(name);
    Tensor t;
    if (stream) {
      t = Tensor::empty(host, spec.shape, d == plan.plain_dtype.end() ? DTYPE_F32 : d->second, MEM_WORKSPACE);
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
