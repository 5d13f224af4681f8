// The op interface: every computation a model, optimizer or trainer needs, forward and backward.
// CPU and CUDA implement it and pass the same tests. Shapes in comments use the legend
//   B batch, T time (sequence), C d_model, V vocab, H query heads, KV key/value heads,
//   hd head dim, F MLP hidden, N rows (B*T).
// Invariants: activation gradients (dx) are overwritten; parameter gradients (dweight, dbias,
// dtable) are accumulated with +=, so micro-batches accumulate without extra passes.
// Float ops accept f32 and, for reference checks, f64 (all operands of one call share a dtype).
#pragma once
#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "loom/backend/kv_attention.h"
#include "loom/backend/kv_store.h"
#include "loom/backend/activation.h"
#include "loom/backend/rope.h"
#include "loom/backend/sampling.h"
#include "loom/core/tensor.h"

namespace loom {

struct GemmSpec {
  bool trans_a = false;
  bool trans_b = false;
  float alpha = 1.0f;
  float beta = 0.0f;   // 1.0 accumulates into C
  int64_t batch = 1;   // operands hold `batch` matrices back to back
  // With beta != 0, the C that beta scales is read from here, and C is only written: C = alpha AB
  // + beta c_in (+ bias), c_in of C's shape and dtype (a residual stream added by the output
  // GEMM without a copy: cuBLASLt's separate C and D). Bitwise copy(c_in, C) then the GEMM.
  const Tensor* c_in = nullptr;
};

struct AdamWHyper {
  float lr = 0.0f;
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  float weight_decay = 0.0f;  // decoupled: p -= lr * weight_decay * p
  float grad_scale = 1.0f;    // g is read as grad * grad_scale (gradient clipping fused in)
  int64_t step = 1;           // 1-based, for bias correction
};

// Where QSGD's random numbers come from: element i of a call uses lane i % 4 of
// Philox4x32-10(counter {offset + 4 floor(i / 4), stream, draw, 0x9597}, key {seed lo, seed hi}).
struct QsgdSpec {
  int levels = 127;     // s, 1..127
  uint64_t seed = 0;
  uint32_t stream = 0;  // the rank
  uint32_t draw = 0;    // the compressor's call count
  int64_t offset = 0;   // the bucket's flat offset
};

// Ring attention's block (nn/context_parallel.h): this rank's zig-zag shard of a sequence of
// 2 world chunks holds chunks rank and 2 world - 1 - rank; the K/V block is rank owner's shard.
struct RingBlock {
  int64_t n_head = 1, n_kv_head = 1;  // query heads H, kv heads KV (H a multiple of KV)
  int rank = 0, world = 1, owner = 0;
};

// A strided 2-D block of elements (Backend::copy_block): rows x cols, at (row, col) of a tensor
// viewed as rows of `stride` elements, on each side.
struct BlockCopy {
  int64_t rows = 0, cols = 0;
  int64_t src_row = 0, src_col = 0, src_stride = 0;
  int64_t dst_row = 0, dst_col = 0, dst_stride = 0;
};

// ---- Mixture of experts and latent attention (nn/moe.h, nn/mla.h): the ops' parameters.
// A router's configuration (ModelConfig's moe_* keys), as the MoE ops read it: E experts in G
// groups (the tokens choose among the topk_groups best), top_k of them per token.
struct MoeRouting {
  int64_t experts = 1, top_k = 1, groups = 1, topk_groups = 1;
  bool sigmoid = false;         // scores: softmax (false) or sigmoid of the logits
  bool renorm = true;           // gates renormalised over the selected experts
  float route_scale = 1.0f;     // gates' factor
  float aux_alpha = 0.0f, seq_aux_alpha = 0.0f, z_alpha = 0.0f;  // the balance losses' coefficients
  int64_t seq_len = 1;          // rows of one sequence (the sequence-wise loss)
  float loss_weight = 1.0f;     // the backward's weight of the losses (the cross-entropy's)
};
// MLA's dimensions (nn/mla.h): H heads, d_n non-RoPE and d_r RoPE query/key widths, d_v value
// width, d_c latent width; the sliding window (0: full causal); the scores' scale is
// score_scale / sqrt(d_n + d_r) (DeepSeek's YaRN multiplies it by mscale^2).
struct MlaDims {
  int64_t n_head = 1, nope = 0, rope = 0, v = 0, latent = 0, window = 0;
  double score_scale = 1.0;
};

// The gated delta rule's two forms (Backend::delta_rule_forward): token by token, or in chunks
// of `chunk` positions through the WY representation. kDeltaRuleChunk is the usual chunk (FLA's,
// transformers').
enum class DeltaRuleForm { recurrent, chunked };
inline constexpr int64_t kDeltaRuleChunk = 64;

// Low precision: a binary floating-point format's grid of values, as data (precision/formats.h
// builds it from the format's table: IEEE fp16, OCP FP8 E4M3 / E5M2, FP4 E2M1). Its values are
// k 2^(e - man_bits) with e = max(floor(log2 |v|), emin), magnitudes up to max; a value that
// rounds above max becomes overflow (max when saturating, else inf or NaN), keeping its sign.
struct NumberGrid {
  int man_bits = 0;
  int emin = 0;
  float max = 0.0f;
  float overflow = 0.0f;
};

// Stochastic rounding's random numbers: element i uses lane i % 4 of Philox4x32-10(counter
// {floor(i / 4) lo, hi, stream, draw}, key {seed lo, seed hi}) (Salmon et al. 2011).
struct RoundingDraw {
  uint64_t seed = 0;
  uint32_t stream = 0;
  uint32_t draw = 0;
};

// QLoRA's NF4 weights as the dequantizing op reads them (Dettmers et al. 2023, sec. 3;
// precision/nf4.h quantizes them and states the layout): 4-bit codes in blocks of kNf4Block
// elements, each block's absmax double-quantized to an int8 code with one f32 step per
// kNf4ScaleBlock blocks, around the tensor's mean absmax.
inline constexpr int64_t kNf4Block = 64, kNf4ScaleBlock = 256;
struct Nf4Spec {
  std::array<float, 16> values{};  // the code values (precision/nf4.h kNf4Codes)
  float absmax_mean = 0.0f;        // the double quantization's offset
};
// Block b's absmax from its int8 code q and its group's step: f32(q step + mean). The product is
// exact in double, so a fused multiply-add gives the same number on every backend.
inline float nf4_block_absmax(int8_t q, float step, float mean) {
  return static_cast<float>(static_cast<double>(q) * static_cast<double>(step) + static_cast<double>(mean));
}

// A post-training-quantized weight (rows = out, cols = in) as Backend::int_linear reads it
// (precision/int_quant.h states the packing): b-bit codes per group of `group` columns with an
// f32 scale and a u8 zero point, w = s (q - z). A backend with compact_int_weights also takes
// f16 scales, and an undefined zeros tensor meaning z = 2^(b - 1) for every group (symmetric). act_int8 (SmoothQuant's W8A8, bits 8, one group
// per row, z = 128): the input is quantized per row to symmetric int8 and the products summed
// in int32.
struct IntWeightSpec {
  int bits = 4;
  int64_t group = 128, rows = 0, cols = 0;
  bool act_int8 = false;
};

// ---------------------------------------------------------------- optimizer ops (optim/*.cpp)
// The hyper-parameters of one optimizer op call: one parameter (or one segment of it) at one step,
// as optim.* (docs/optimizers.md). lr is the parameter's rate (the schedule's lr times its
// lr_scale); Adafactor's op reads it as its relative or absolute base rate.
struct OptimHyper {
  double lr = 0.0;
  float weight_decay = 0.0f;
  float grad_scale = 1.0f;  // g is read as grad * grad_scale (gradient clipping fused in)
  int64_t step = 1;         // 1-based
  double beta1 = 0.9, beta2 = 0.999, beta3 = 0.9999;  // beta2: RMSprop's alpha, Adafactor's beta2_t
  double eps = 1e-8, eps2 = 1e-3;
  double momentum = 0.0, dampening = 0.0;
  double clip_threshold = 1.0;   // Adafactor, CAME: the update's RMS is clipped to it
  bool nesterov = false;         // SGD, Muon
  bool decoupled = true;         // Adam: decoupled decay (AdamW), else L2 added to the gradient
  bool scale_parameter = true;   // Adafactor: the rate times max(eps2, RMS(p))
  bool factored = false;         // Adafactor, SM3, CAME: a matrix segment (grad's shape is rows x cols)
};

// What a backend runs, stated as data. Some features still compute on the host (loops over
// tensor memory outside this interface); a backend whose memory host code cannot read lacks
// them until their computation moves behind it. The training layout (train/layout.h) refuses a
// configuration that needs a missing capability, naming the key and the backend.
struct BackendCapabilities {
  bool model_parallel = false;   // parallel.tp / pp / cp / ep (the vocab, ring attention and copy_block ops)
  bool mixture_of_experts = false;  // model.moe_experts > 0 (routing, dispatch, combine)
  bool latent_attention = false;    // model.mla_kv_rank > 0 (MLA)
  bool zero_sharding = false;       // parallel.zero_stage > 0 (shard bookkeeping, page release)
  bool gradient_compression = false;  // parallel.compression
  bool low_precision = false;       // fp16 / fp8 recipes, QAT, bf16 master weights or reduction
  bool every_optimizer = false;     // otherwise only plain adamw (Backend::adamw_step)
  bool head_norm = false;           // model.qk_norm (Backend::head_rmsnorm_*)
  bool nf4 = false;                 // peft.quantize_base (QLoRA: Backend::nf4_dequantize in the linear layers)
  bool dora = false;                // peft.dora (Backend::row_norms, dora_weight, dora_backward)
  bool int_weights = false;         // quantized checkpoints (Backend::int_linear, int_dequantize)
  bool bf16_attention = false;      // precision.attention = bf16 (Backend::attention_forward_bf16 / _backward_bf16)
  bool kv_cache = false;            // a KV cache in the backend's memory (Backend::kv_attention)
  // int_linear / int_dequantize also take compact group parameters: f16 scales, and no zeros
  // tensor for symmetric groups (int_weight_to_backend uploads a checkpoint's compact storage as
  // it is; otherwise it widens to f32 scales and u8 zeros).
  bool compact_int_weights = false;
};
class Backend;
// The ops of a scope recorded as one step graph when `on` and the backend has graphs
// (Backend::begin_step_graph): launch() ends and launches it; a scope left without launch() (an
// exception) drops the recording.
class StepGraphScope {
 public:
  StepGraphScope(Backend& backend, bool on, int64_t key);
  ~StepGraphScope();
  StepGraphScope(const StepGraphScope&) = delete;
  StepGraphScope& operator=(const StepGraphScope&) = delete;
  void launch();
  bool recording() const { return on_; }

 private:
  Backend& backend_;
  int64_t key_;
  bool on_;
};

inline constexpr BackendCapabilities kEveryCapability{true, true, true, true, true, true, true,
                                                      true, true, true, true, true, true, true};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string_view name() const = 0;
  // Default: none of the host-computed features (a backend states what it adds).
  virtual BackendCapabilities capabilities() const { return {}; }
  // Which kernels run this backend's GEMM with inputs of `dtype` (f32, or bf16 into f32), in
  // words, with a revision that changes whenever their speed may: the run header states it, and
  // the cached GEMM peak (train/throughput.h) is kept per description, so a peak measured with
  // other kernels is measured again. "" where not stated.
  virtual std::string gemm_kernels(DType dtype) const { return {}; }
  virtual Allocator& allocator() = 0;

  // Host memory <-> a tensor of this backend (dst.nbytes() / src.nbytes() bytes). On the CPU a
  // memcpy; on a device a blocking copy that first waits for the work queued before it. Host
  // code reads and writes backend tensors only through these (Tensor::data() refuses tensors
  // that are not host-accessible).
  virtual void write(const Tensor& dst, const void* host) = 0;
  virtual void read(const Tensor& src, void* host) = 0;
  // Blocks until every op queued so far has finished (a no-op on the CPU, whose ops are synchronous).
  virtual void synchronize() {}

  // C[b] = alpha * op(A[b]) @ op(B[b]) + beta * C[b] (+ bias[n] added to every row of C).
  // A, B and C share a dtype (f32, f64), or A and B are bf16 and C (and bias) f32: bf16
  // products accumulated in fp32. Or A, B and C bf16 (beta 0; the bias f32): the fp32 sum plus
  // the bias rounded to bf16 (autocast's linear casts its bias; cuBLASLt's bias epilogue reads it
  // in D's type), rounded to bf16 as cast() rounds: a GEMM writing an autocast-style bf16 output.
  // A matrix's cols are its tensor's last dim; rows = numel / (batch * cols).
  virtual void gemm(const Tensor& a, const Tensor& b, const Tensor& c, const GemmSpec& spec,
                    const Tensor* bias = nullptr) = 0;

  virtual void fill(const Tensor& x, double value) = 0;
  virtual void copy(const Tensor& src, const Tensor& dst) = 0;
  virtual void cast(const Tensor& src, const Tensor& dst) = 0;                 // f32 <-> bf16 (RNE) and f32 <-> f64
  virtual void add(const Tensor& a, const Tensor& b, const Tensor& out) = 0;   // out = a + b (residual)
  virtual void add_inplace(const Tensor& acc, const Tensor& x) = 0;            // acc += x
  virtual void scale_inplace(const Tensor& x, double factor) = 0;              // x *= factor
  virtual double sum_squares(const Tensor& x) = 0;                             // sum x^2, in double
  virtual double sum(const Tensor& x) = 0;                                     // sum x, in double
  // dbias (N) += column sums of dout (.., N); dout may be bf16 with an f32 dbias (widened, summed in f32).
  virtual void bias_backward(const Tensor& dout, const Tensor& dbias) = 0;

  // A token id or target outside [0, V) is a one-line Error naming the op, the id and its position
  // (embedding_*, cross_entropy_forward). The CPU throws from the op; a device backend from its
  // next host synchronisation (read, write, synchronize, an op that returns a host value), so the
  // check costs no wait inside a step. The kernels skip a bad id's row meanwhile.
  // out[b,t] = table[tokens[b,t]] (+ positions[t]). tokens (B,T) i32, table (V,C), positions (Tmax,C) or null.
  // A bf16 table (a checkpoint's embedding used in place) is widened exactly into f32 out and positions.
  virtual void embedding_forward(const Tensor& tokens, const Tensor& table, const Tensor* positions,
                                 const Tensor& out) = 0;
  virtual void embedding_backward(const Tensor& tokens, const Tensor& dout, const Tensor& dtable,
                                  const Tensor* dpositions) = 0;

  // The forward norms' and activations' `out` (layernorm, rmsnorm, gelu, glu), and the activations'
  // backward dx, has x's dtype, or is bf16 for an f32 x: the output computed in f32 and rounded to
  // nearest even in the same kernel, the bits cast() would give (precision.activations = bf16
  // writes the saved fields so, and the MLP's first GEMM's output gradient: LayerPlan::mlp_in_dy_bf16).
  // LayerNorm over the last dim C: out = (x - mean) * rstd * weight + bias; saves mean, rstd (N).
  virtual void layernorm_forward(const Tensor& x, const Tensor& weight, const Tensor& bias, const Tensor& out,
                                 const Tensor& mean, const Tensor& rstd, float eps) = 0;
  // The backwards overwrite dx, or with accumulate add the input gradient into it (dx += ..., the
  // residual stream's gradient: bitwise the op into a scratch then add_inplace); dweight and dbias
  // accumulate. dx16, when defined (bf16, dx's size, an f32 x), also gets dx's final values (the
  // sum, with accumulate) rounded to nearest even: the bits cast(dx, dx16) would give, one 2-byte
  // store an element more (the residual stream's gradient for the bf16 GEMMs of the layer whose
  // output gradient it is: LayerPlan::proj_dy_bf16 / fc2_dy_bf16).
  virtual void layernorm_backward(const Tensor& dout, const Tensor& x, const Tensor& weight, const Tensor& mean,
                                  const Tensor& rstd, const Tensor& dx, const Tensor& dweight,
                                  const Tensor& dbias, bool accumulate = false, const Tensor& dx16 = Tensor{}) = 0;
  // RMSNorm (Zhang & Sennrich 2019): out = x * rstd * weight, rstd = 1/sqrt(mean(x^2) + eps).
  virtual void rmsnorm_forward(const Tensor& x, const Tensor& weight, const Tensor& out, const Tensor& rstd,
                               float eps) = 0;
  virtual void rmsnorm_backward(const Tensor& dout, const Tensor& x, const Tensor& weight, const Tensor& rstd,
                                const Tensor& dx, const Tensor& dweight, bool accumulate = false,
                                const Tensor& dx16 = Tensor{}) = 0;

  // Per-head RMSNorm (Qwen3's q_norm / k_norm) in place on heads [first, first + n) of x
  // (B,T,W), each hd wide: in (B,T,n hd) = the heads before, rstd (B,T,n), head = head * rstd
  // * weight (hd). The backward turns d(out) in those columns of dx into d(in) in place and
  // accumulates dweight. The defaults throw (model.qk_norm on a backend without them).
  virtual void head_rmsnorm_forward(const Tensor& x, const Tensor& weight, int64_t first, int64_t n, int64_t hd,
                                    float eps, const Tensor& in, const Tensor& rstd);
  virtual void head_rmsnorm_backward(const Tensor& dx, const Tensor& in, const Tensor& weight, const Tensor& rstd,
                                     int64_t first, int64_t n, int64_t hd, const Tensor& dweight);

  // GELU, tanh approximation: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
  virtual void gelu_forward(const Tensor& x, const Tensor& out) = 0;
  virtual void gelu_backward(const Tensor& x, const Tensor& dout, const Tensor& dx) = 0;
  // The MLP's first GEMM with its GELU (the tanh form above) in one op, for a backend whose GEMM
  // can apply it in its epilogue: pre = op(A) op(B) (+ bias), written as gemm() writes it (beta 0),
  // and act = gelu(pre). The default runs gemm() then gelu_forward(pre, act): act is the GELU of
  // pre as rounded. CUDA with bf16 A, B, pre and act takes it in cuBLASLt's epilogue
  // (CUBLASLT_EPILOGUE_GELU_AUX_BIAS: pre is its auxiliary output) from the unrounded fp32 sum, so
  // act may differ from the default's by what one rounding of pre moves it (a bf16 step of act).
  virtual void gemm_gelu(const Tensor& a, const Tensor& b, const Tensor& pre, const Tensor& act, const GemmSpec& spec,
                         const Tensor* bias = nullptr);
  // Its backward through the next GEMM: dx = gelu'(pre) o (op(A) op(B)) (beta 0, no bias), gelu'
  // as gelu_backward's. The default computes the product into `scratch` (f32, dx's shape), then
  // gelu_backward(pre, scratch, dx); CUDA with bf16 A, B, pre and dx applies gelu' in cuBLASLt's
  // epilogue (CUBLASLT_EPILOGUE_DGELU, pre its auxiliary input) and leaves scratch unwritten.
  virtual void gemm_dgelu(const Tensor& a, const Tensor& b, const Tensor& pre, const Tensor& scratch, const Tensor& dx,
                          const GemmSpec& spec);
  // Gated MLP activation (backend/activation.h; Shazeer 2020): x (N, 2F) = [gate | up]; out (N, F)
  // = act(gate) * up: SwiGLU (silu) or GeGLU (gelu_tanh).
  virtual void glu_forward(const Tensor& x, const Tensor& out, GateActivation act) = 0;
  virtual void glu_backward(const Tensor& x, const Tensor& dout, const Tensor& dx, GateActivation act) = 0;

  // ---- The gated delta rule (Gated DeltaNet: Yang, Kautz & Hatamizadeh 2024, "Gated Delta
  // Networks: Improving Mamba2 with Delta Rule", arXiv 2412.06464), the linear attention of
  // Qwen3-Next's linear-attention layers. Per batch row b and head h, a state S (d_k x d_v)
  // starts at initial_state (zeros when undefined) and for t = 0 .. T-1:
  //   S_t = exp(g_t) S_{t-1} + k_t (beta_t (v_t - (exp(g_t) S_{t-1})^T k_t))^T,   o_t = S_t^T q_t
  // (transformers' torch_recurrent_gated_delta_rule, qwen3_next; FLA's fused_recurrent). g_t is
  // a log-decay (<= 0; not checked: g > 0 computes, but exp(G_i - G_j) may overflow), beta_t the
  // write strength in (0, 1). q and k arrive already L2-normalised and q already scaled by
  // 1/sqrt(d_k): the normalisation and the scale are the caller's, outside the op.
  // Grouped heads: q and k have Hk heads, v, g, beta, out and the states Hv (a multiple of Hk);
  // value head h reads q/k head h / (Hv / Hk), as transformers' qwen3_next repeats q and k
  // (repeat_interleave(num_v_heads // num_k_heads, dim=2)) but without materialising the copies.
  // The backward's dq, dk sum over the Hv / Hk value heads sharing a key head (in value-head
  // order, on one thread: deterministic). Hk == Hv is the plain one-to-one case.
  // Layout (row-major, all one dtype, f32 or f64): q, k (B, T, Hk, d_k); v (B, T, Hv, d_v);
  // g, beta (B, T, Hv); out (B, T, Hv, d_v); initial_state, final_state (B, Hv, d_k, d_v).
  // initial_state undefined: zeros; final_state undefined: not written (a training pass without
  // context parallelism or a cache needs no state). A rank of a context-parallel split, or a
  // decoding step, starts from the previous piece's final_state and gets exactly the whole run's
  // numbers.
  // Forms (they agree to rounding: fp32 within 1e-5 in tests/test_delta_rule.cpp):
  //  - recurrent: the recurrence above, O(T d_k d_v) per head, one state in memory (decoding).
  //  - chunked: positions in chunks of `chunk` (>= 1; the last may be shorter). With G the
  //    chunk's cumulative sum of g (G_i = g_1 + .. + g_i), gamma_i = exp(G_i), Gamma_ij =
  //    exp(G_i - G_j) (j <= i), S0 the state before the chunk, the chunk's deltas
  //    delta_i = beta_i (v_i - (exp(g_i) S_{i-1})^T k_i) solve (I + A) Delta = diag(beta) V -
  //    diag(beta gamma) K S0 with A_ij = beta_i Gamma_ij k_i.k_j (j < i, strictly lower): the UT
  //    transform T = (I + A)^-1 (forward substitution) gives the WY representation
  //    W = T diag(beta gamma) K, U = T diag(beta) V, Delta = U - W S0 (the paper's chunkwise
  //    algorithm; W and U do not depend on S0); then O = diag(gamma) Q S0 + ((Q K^T) .* Gamma, lower) Delta and
  //    S_L = gamma_L S0 + K^T diag(Gamma_Lj) Delta. O(T (C (d_k + d_v) + d_k d_v)) per head.
  // The backward takes d(out) (dout) and d(final state) (dfinal_state; undefined: zeros) and
  // overwrites dq, dk, dv, dg, dbeta and, when defined, dinitial_state (d of the initial state,
  // the previous context-parallel rank's dfinal_state). Strategy: a forward sweep keeps the state
  // at the start of every chunk of `chunk` positions (checkpoints), then the chunks run in reverse,
  // each recomputing its inside from its checkpoint and turning d(state at its end) into d(state
  // at its start): the chunked form differentiates the WY equations above (dR = T^T dDelta,
  // dA = -dR Delta^T, ...), the recurrent form runs the reverse-time recurrence token by token
  // over the chunk's recomputed states (`chunk` is then only the checkpoint interval). Chosen
  // because storing every S_t is O(T d_k d_v) per head, and recomputing from the very start per
  // step is O(T^2): the checkpoints cost ceil(T / chunk) d_k d_v per head in flight, the
  // recurrent form's recomputed states (chunk + 1) d_k d_v, about one extra forward of work.
  // Memory: the CPU backend's workspace, per thread (one (b, h) head per thread at a time; the
  // backward runs a key head's Hv / Hk value heads one after another on its thread), never all
  // heads at once. The CUDA backend runs the recurrent form whichever is asked
  // (cuda_linear_attention.cu); the defaults throw.
  virtual void delta_rule_forward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                                  const Tensor& beta, const Tensor& initial_state, const Tensor& out,
                                  const Tensor& final_state, DeltaRuleForm form, int64_t chunk);
  virtual void delta_rule_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                                   const Tensor& beta, const Tensor& initial_state, const Tensor& dout,
                                   const Tensor& dfinal_state, const Tensor& dq, const Tensor& dk, const Tensor& dv,
                                   const Tensor& dg, const Tensor& dbeta, const Tensor& dinitial_state,
                                   DeltaRuleForm form, int64_t chunk);
  // Causal depthwise convolution with SiLU (Qwen3NextGatedDeltaNet's conv1d + F.silu): x (B, T, C),
  // weight (C, K); y[b, t, c] = silu(sum_i weight[c, i] x'[b, t - K + 1 + i, c]) where x' is x
  // preceded by initial (B, K-1, C) (the K-1 inputs before position 0: a decoding or
  // context-parallel continuation; zeros when undefined); the last tap multiplies the current
  // input. final (B, K-1, C), when defined, gets the last K-1 rows of x' (the next call's initial).
  // The backward recomputes the pre-activation, overwrites dx (and dinitial when defined) and
  // accumulates dweight.
  virtual void causal_conv1d_silu_forward(const Tensor& x, const Tensor& weight, const Tensor& initial, const Tensor& y,
                                          const Tensor& final_state);
  virtual void causal_conv1d_silu_backward(const Tensor& x, const Tensor& weight, const Tensor& initial,
                                           const Tensor& dy, const Tensor& dx, const Tensor& dweight,
                                           const Tensor& dinitial);
  // The gated delta rule's gates (Qwen3NextGatedDeltaNet): ba (N, 2H) = [b | a] per row, a_log and
  // dt_bias (H); beta = sigmoid(b), g = -exp(a_log) softplus(a + dt_bias) (softplus(x) = x above
  // 20, as torch's), each (N, H). The backward overwrites dba and accumulates da_log, ddt_bias.
  virtual void delta_gates_forward(const Tensor& ba, const Tensor& a_log, const Tensor& dt_bias, const Tensor& g,
                                   const Tensor& beta);
  virtual void delta_gates_backward(const Tensor& ba, const Tensor& a_log, const Tensor& dt_bias, const Tensor& dg,
                                    const Tensor& dbeta, const Tensor& dba, const Tensor& da_log,
                                    const Tensor& ddt_bias);

  // ---- Attention sinks (GPT-OSS; Xiao et al. 2023, "Efficient Streaming Language Models with
  // Attention Sinks", as a learned per-head logit): head h's sink s_h joins every row's softmax
  // denominator with no value, p_ij = exp(x_ij) / (sum_j exp(x_ij) + exp(s_h)). Given a plain
  // attention's output O' and its rows' log-sum-exp lse (flash attention's), that is
  // O = g O' with g = sigmoid(lse - s_h). Layout: out (B, T, H hd) in place, lse (B, H, T),
  // sinks (H), one dtype (f32 or f64).
  // The backward takes the true output O and d(O) and turns dout into d(O') = g dO in place,
  // which the plain attention's backward, given O (not O'), turns into the exact gradients:
  // its D = rowsum(dO' o O) = g^2 dO.O' = dO'.O' - g (1 - g) dO.O' is D' less d(lse) (the
  // sink's share of the softmax); and adds d(s_h) = -sum over rows (1 - g) dO.O to dsinks.
  // The defaults throw (a backend without the kernels).
  virtual void attention_sink_forward(const Tensor& out, const Tensor& lse, const Tensor& sinks, int64_t n_head);
  virtual void attention_sink_backward(const Tensor& dout, const Tensor& out, const Tensor& lse, const Tensor& sinks,
                                       const Tensor& dsinks, int64_t n_head);

  // RoPE (Su et al. 2021), rotate-half convention, in place on the first n_heads * head_dim
  // columns of x (B,T,W): pairs (j, j + hd/2) rotate by angle (pos_offset + t) * inv_freq(j)
  // (backend/rope.h: theta^(-2j/hd), rescaled by rope.scaling), computed in double; cos and sin
  // times rope.amplitude. The backward applies the transpose (the inverse rotation times the
  // amplitude) to the gradient.
  virtual void rope_forward(const Tensor& x, int64_t head_dim, int64_t n_heads, const RopeSpec& rope,
                            int64_t pos_offset) = 0;
  virtual void rope_backward(const Tensor& dx, int64_t head_dim, int64_t n_heads, const RopeSpec& rope,
                             int64_t pos_offset) = 0;
  // Decoding's rows, each at its own position: row r of x (n, 1, width) rotated as
  // rope_forward(that row, ..., positions[r]) rotates it (longrope's span by the row's own context),
  // bitwise. One call for a step's rows; the default calls rope_forward row by row.
  virtual void rope_rows_forward(const Tensor& x, int64_t head_dim, int64_t n_heads, const RopeSpec& rope,
                                 const std::vector<int64_t>& positions);

  // Causal self-attention with grouped KV heads: qkv (B,T,(H+2KV)*hd) = [q heads | k heads | v heads];
  // query head h reads kv head h / (H/KV); scale 1/sqrt(hd). out (B,T,H*hd); probs (B,H,T,T) saved.
  // window W > 0 (sliding window, Beltagy et al. 2020; Jiang et al. 2023): query i attends to keys
  // i - W < j <= i only, the others are skipped (O(T W) work) and their probs are 0; W = 0 or
  // W >= T is full causal attention, computed exactly as without a window.
  virtual void attention_forward(const Tensor& qkv, const Tensor& out, const Tensor& probs, int64_t n_head,
                                 int64_t n_kv_head, int64_t window) = 0;
  // Needs the forward's out for D_i = dO_i . O_i (FlashAttention-2's rowsum trick). dqkv overwritten.
  // window: the forward's.
  virtual void attention_backward(const Tensor& dout, const Tensor& qkv, const Tensor& out, const Tensor& probs,
                                  const Tensor& dqkv, int64_t n_head, int64_t n_kv_head, int64_t window) = 0;
  // The same attention (no window) with bf16 GEMMs (precision.attention = bf16): the operands of
  // S = Q K^T and O = P V, and of the backward's dP = dO V^T, dQ = dS K, dK = dS^T Q and
  // dV = P^T dO, rounded to bf16 (RNE) with fp32 accumulation, as autocast's attention; the
  // softmax, D and dS are computed and probs saved in fp32. Optional (capabilities().bf16_attention).
  virtual void attention_forward_bf16(const Tensor& qkv, const Tensor& out, const Tensor& probs, int64_t n_head,
                                      int64_t n_kv_head);
  virtual void attention_backward_bf16(const Tensor& dout, const Tensor& qkv, const Tensor& out, const Tensor& probs,
                                       const Tensor& dqkv, int64_t n_head, int64_t n_kv_head);
  // FlashAttention-2 (Dao 2023): the same attention (same qkv, out, window) without the
  // probabilities: lse (B,H,T) = log-sum-exp of each query row's scaled scores is saved instead,
  // and the backward recomputes P = exp(S - lse) tile by tile. O(T) extra memory.
  virtual void flash_attention_forward(const Tensor& qkv, const Tensor& out, const Tensor& lse, int64_t n_head,
                                       int64_t n_kv_head, int64_t window) = 0;
  virtual void flash_attention_backward(const Tensor& dout, const Tensor& qkv, const Tensor& out, const Tensor& lse,
                                        const Tensor& dqkv, int64_t n_head, int64_t n_kv_head, int64_t window) = 0;
  // The same flash attention (causal, no window) multiplying in bf16 (precision.attention = bf16
  // with train.flash_attention): every product's operands (Q, K, V, dO, and P, dS where a
  // backend rounds them) are bf16 (RNE), the softmax and every sum fp32, lse saved as above. The
  // CUDA backend runs it on tensor cores (mma.sync, cuda_flash_mma.cu) for head_dim 64 and 128.
  // The default rounds copies of qkv and dout to bf16 (two casts each) and runs the fp32 flash
  // ops on them; backends agree within bf16's rounding, not bitwise. out may be bf16 for an f32
  // qkv (precision.activations = bf16 keeps O so for the output projection): O rounded to nearest
  // even as it is written, and the backward's D = rowsum(dO o O) from that bf16 O.
  virtual void flash_attention_forward_bf16(const Tensor& qkv, const Tensor& out, const Tensor& lse, int64_t n_head,
                                            int64_t n_kv_head);
  virtual void flash_attention_backward_bf16(const Tensor& dout, const Tensor& qkv, const Tensor& out,
                                             const Tensor& lse, const Tensor& dqkv, int64_t n_head, int64_t n_kv_head);

  // Fused softmax + cross-entropy. logits (N,V), targets (N) i32. losses[n] = lse[n] - logits[n, t_n];
  // lse (N) saved; probabilities are never stored. A target of kIgnoreTarget (a loss mask:
  // prompt tokens in supervised fine-tuning) gives loss 0 and a zero gradient row (its lse is
  // not read: the CPU computes it, the CUDA kernels write 0 without reading the row).
  virtual void cross_entropy_forward(const Tensor& logits, const Tensor& targets, const Tensor& losses,
                                     const Tensor& lse) = 0;
  // dlogits = dloss * (softmax(logits) - onehot(targets)); dlogits may alias logits.
  virtual void cross_entropy_backward(const Tensor& logits, const Tensor& targets, const Tensor& lse, float dloss,
                                      const Tensor& dlogits) = 0;
  // Both in one call, for a training pass whose loss weight is known at the loss: losses and lse
  // as cross_entropy_forward, dlogits as cross_entropy_backward with dloss, bitwise. dlogits is
  // the logits themselves (in place), or a bf16 tensor of their shape: the fp32 gradient rounded
  // as cast() rounds it (the logits may then be overwritten or not). Or the logits are bf16 (a
  // bf16 head's output, precision.activations = bf16) with f32 losses and lse, and dlogits is the
  // logits: bitwise the op on the logits widened to f32 with a bf16 dlogits. The default runs the
  // two ops and the cast (f32 or f64 logits); a backend may fuse them (the CPU's: one row at a
  // time, while it is in cache).
  virtual void cross_entropy_loss_and_grad(const Tensor& logits, const Tensor& targets, const Tensor& losses,
                                           const Tensor& lse, float dloss, const Tensor& dlogits);
  // Whether a training step's loss pass over `rows` positions of a `vocab`-wide head should keep
  // its logits by columns, (V, rows) = W x^T, rather than by rows: a device whose GEMMs want rows
  // of 16 bytes says so where the vocabulary's rows are not and the positions' are (the head's
  // three GEMMs then read and write only aligned rows). Default: false.
  virtual bool logits_by_columns(int64_t rows, int64_t vocab) const { return false; }
  // cross_entropy_loss_and_grad of logits kept by columns: logits (V, N), targets / losses / lse
  // (N), dlogits (V, N): the logits in place or bf16. Each column's values are those of the row
  // op on the transposed logits (the CPU's bitwise: it runs the same row functions; a device within
  // the row op's tolerance: another summation order).
  virtual void cross_entropy_loss_and_grad_columns(const Tensor& logits, const Tensor& targets, const Tensor& losses,
                                                   const Tensor& lse, float dloss, const Tensor& dlogits);

  // AdamW (Loshchilov & Hutter 2019) on a flat range, g = grad_scale * grad: p -= lr*wd*p; m = b1 m + (1-b1) g;
  // v = b2 v + (1-b2) g^2; p -= lr * (m/(1-b1^t)) / (sqrt(v/(1-b2^t)) + eps).
  virtual void adamw_step(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v,
                          const AdamWHyper& hyper) = 0;

  // Gradient compression (parallel/compress.h): the element loops of the compressors, f32 values,
  // i32 indices and packed codes. Reductions stated "in order" run sequentially in double, so
  // every backend gives the same bits. The defaults throw (the backend lacks
  // capabilities().gradient_compression); the CPU and the strict test backend implement them.
  // Top-K (Lin et al. 2018): idx (i32, ascending) and val get the k = idx.numel() entries of acc
  // with the largest |acc| (ties: the lower index), which are then zeroed in acc; scratch: i32 of acc's numel.
  virtual void topk_extract(const Tensor& acc, const Tensor& idx, const Tensor& val, const Tensor& scratch);
  // out[idx[j]] += val[j], j = 0, 1, ... in order (decodes gathered sparse vectors rank by rank).
  virtual void scatter_add(const Tensor& idx, const Tensor& val, const Tensor& out);
  // x[idx[j]] = 0 for every j (DGC's momentum factor masking).
  virtual void scatter_zero(const Tensor& idx, const Tensor& x);
  // DGC: if clip > 0 and ||g||_2 (in order) > clip, g *= f32(clip / ||g||_2); then u = m u + g, v += u.
  virtual void dgc_accumulate(const Tensor& g, const Tensor& u, const Tensor& v, float momentum, double clip);
  // 1-bit (Seide et al. 2014): scale[0] = f32(sum |acc| (in order) / n); bit i % 32 of words[i / 32]
  // (i32, ceil(n / 32), unused bits 0) = acc[i] < 0; acc -= that bit ? -scale : scale (the residual).
  virtual void onebit_encode(const Tensor& acc, const Tensor& words, const Tensor& scale);
  // out[i] += bit i of words[r] ? -scales[r] : scales[r] for r = 0 .. R - 1 in order; words (R x w), scales (R).
  virtual void onebit_decode_add(const Tensor& words, const Tensor& scales, const Tensor& out);
  // QSGD (Alistarh et al. 2017): norm[0] = f32(||g||_2, in order); byte i of codes (i32, ceil(n / 4),
  // unused bytes 0) = sign(g_i) (l + [u_i < x - l]), x = |g_i| s / norm, l = floor(x); all 0 when norm = 0.
  virtual void qsgd_encode(const Tensor& g, const Tensor& codes, const Tensor& norm, const QsgdSpec& spec);
  // out[i] = fma(norms[r] / s, byte i of codes[r], out[i]) for r = 0 .. R - 1 in order; codes (R x w), norms (R).
  virtual void qsgd_decode_add(const Tensor& codes, const Tensor& norms, int levels, const Tensor& out);
  // PowerSGD (Vogels et al. 2019), m (rows, cols): out (rows, r) = m q (q: cols x r), or with
  // transpose out (cols, r) = m^T q (q: rows x r); each entry accumulated in double, in order.
  virtual void lowrank_project(const Tensor& m, const Tensor& q, const Tensor& out, bool transpose);
  // p (rows, r): its columns orthonormalized by modified Gram-Schmidt in double, twice; a column
  // of squared norm <= 1e-30 becomes 0.
  virtual void orthonormalize_columns(const Tensor& p);
  // out (rows, cols) = alpha f32(p q^T) + beta out (beta = 0: overwritten); p (rows, r), q (cols, r),
  // each entry of p q^T accumulated in double.
  virtual void lowrank_expand(const Tensor& p, const Tensor& q, const Tensor& out, float alpha, float beta);

  // Model parallelism (nn/vocab_parallel.h, nn/context_parallel.h): the element loops of the
  // vocabulary-parallel ends and of ring attention. The defaults throw (the backend lacks
  // capabilities().model_parallel); the CPU and the strict test backend implement them.
  // The vocab slice [begin, begin + valid) in weight (Vs >= valid, C) f32: out (B,T,C) = weight[tok - begin]
  // for the tokens in the slice, 0 for the others.
  virtual void vocab_embedding_forward(const Tensor& tokens, const Tensor& weight, int64_t begin, int64_t valid,
                                       const Tensor& out);
  // dweight[tok - begin] += dout's row of tok for the tokens in the slice, tokens in order.
  virtual void vocab_embedding_backward(const Tensor& tokens, const Tensor& dout, const Tensor& dweight,
                                        int64_t begin, int64_t valid);
  // out (B,T,C) f32 += positions rows first .. first + T - 1, positions (Tmax, C).
  virtual void add_positions(const Tensor& out, const Tensor& positions, int64_t first);
  // dpositions rows first .. first + T - 1 += dout (B,T,C) summed over b = 0, 1, ... in order.
  virtual void positions_backward(const Tensor& dout, const Tensor& dpositions, int64_t first);
  // logits (N, Vs) f32, targets (N) i32: max[n] = max of row n's first `valid` logits; target[n] =
  // logits[n, targets[n] - begin] when that column is in [0, valid), else 0.
  virtual void vocab_ce_partials(const Tensor& logits, const Tensor& targets, int64_t begin, int64_t valid,
                                 const Tensor& max, const Tensor& target);
  // sums[n] = sum over v < valid, in order, of exp(logits[n, v] - max[n]) in f32.
  virtual void vocab_ce_sums(const Tensor& logits, const Tensor& max, int64_t valid, const Tensor& sums);
  // In place, per row: lse (the max on entry) = max + log(sums); losses (the target logit on entry) =
  // lse - target, and 0 for a row whose target is kIgnoreTarget (a loss mask).
  virtual void vocab_ce_finish(const Tensor& targets, const Tensor& lse, const Tensor& sums, const Tensor& losses);
  // dlogits[n, v] = scale (exp(logits[n, v] - lse[n]) - [v = targets[n] - begin]) for v < valid, 0
  // for the padding columns and for a row whose target is kIgnoreTarget; dlogits may alias logits.
  virtual void vocab_ce_backward(const Tensor& logits, const Tensor& targets, const Tensor& lse, int64_t begin,
                                 int64_t valid, float scale, const Tensor& dlogits);
  // The online-softmax merge of one K/V block, k, v (B,Tl,KV hd), into the running state of the
  // local queries q (B,Tl,H hd): with the causally visible scores s_j, m' = max(m, max s_j);
  // l = e^{m - m'} l + sum_j e^{s_j - m'}; out = e^{m - m'} out + sum_j e^{s_j - m'} v_j; m, l (B,H,Tl);
  // scratch: at least (threads, Tl) elements.
  virtual void ring_attention_merge(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                                    const Tensor& m, const Tensor& l, const Tensor& scratch, const RingBlock& block);
  // out (B,Tl,H hd) /= l and lse (the running max on entry) += log l, per (b, h, i); l (B,H,Tl).
  virtual void ring_attention_finish(const Tensor& out, const Tensor& lse, const Tensor& l, int64_t n_head);
  // D (B,H,Tl) = dout . out per query head row (FlashAttention-2's rowsum); dout, out (B,Tl,H hd).
  virtual void attention_row_dot(const Tensor& dout, const Tensor& out, const Tensor& D, int64_t n_head);
  // One K/V block's gradient terms, P = exp(scale q.k - lse) on the visible keys: dv += P dout;
  // dS = P (dout.v - D); dq += scale dS k; dk += scale dS q. dq (as q); dk, dv (as k) accumulate.
  virtual void ring_attention_block_backward(const Tensor& q, const Tensor& dout, const Tensor& lse, const Tensor& D,
                                             const Tensor& k, const Tensor& v, const Tensor& dq, const Tensor& dk,
                                             const Tensor& dv, const RingBlock& block);

  // ---- Model-parallel slicing (parallel/tensor_parallel.cpp, nn/sequence_parallel.cpp,
  // nn/context_parallel.cpp, nn/attention.cpp): a rank's row / column slices of weights, a
  // sequence shard and Ulysses' head groups are strided 2-D blocks of a tensor. The default
  // throws (the backend lacks capabilities().model_parallel).
  // dst's block = src's block, exactly: rows x cols elements; block row i is the `cols` elements
  // at src_row + i, src_col of src viewed as rows of src_stride elements, into dst_row + i,
  // dst_col of dst viewed with dst_stride. src and dst share a dtype (any) and do not overlap.
  virtual void copy_block(const Tensor& src, const Tensor& dst, const BlockCopy& block);

  // ---- Mixture of experts (nn/moe.h, docs/moe.md): routing, dispatch, combine and their
  // backwards (Shazeer et al. 2017; GShard, Lepikhin et al. 2021; Switch, Fedus et al. 2022;
  // DeepSeekMoE / DeepSeek-V3 2024). N tokens, E experts, k = top_k, R expert rows, C width. The
  // defaults throw (the backend lacks capabilities().mixture_of_experts).
  // Router: per token t (rows of logits (N,E) f32) scores s = softmax(u) (max-shifted, summed in
  // double) or sigmoid(u); selection scores s + bias (E); groups > 1: group g scores the sum of its
  // two best selection scores (its best alone with one expert a group), the topk_groups best
  // groups (ties: the lower group) keep their experts, the others drop out; expert (N,k) i32 = the
  // top-k selection scores, best first, ties to the lower index; gates (N,k) f32 = s_e (/ sum of
  // the k selected s in double when renorm) x route_scale. scratch f32: at least
  // omp threads x (E + 2 G) elements (each thread's selection and group scores).
  virtual void moe_route(const Tensor& logits, const Tensor& bias, const Tensor& scores, const Tensor& expert,
                         const Tensor& gates, const Tensor& scratch, const MoeRouting& routing);
  // Capacity (GShard): assignments (t, j) in priority order (every token's choice j before any
  // choice j + 1, tokens in order) take a row of their expert while it has fewer than `capacity`;
  // the others are dropped (row -1). counts (3E + 1) i32 = [load | kept | offsets]: assignments per
  // expert, rows kept per expert, their prefix sums (expert e's rows are [offsets[e], offsets[e+1]));
  // row (N,k) i32 = the assignment's expert row; token[r] (i32, >= R entries) = the token of row r.
  virtual void moe_assign(const Tensor& expert, int64_t capacity, const Tensor& row, const Tensor& token,
                          const Tensor& counts);
  // Dispatch: rows (R, C) f32, rows[r] = x[token[r]] for r < R (token i32, R entries).
  virtual void moe_dispatch(const Tensor& x, const Tensor& token, const Tensor& rows);
  // Combine: out[t] (N, C) += sum over j = 0 .. k-1 with row[t,j] >= 0, in order, of
  // gates[t,j] rows[row[t,j]]; gates undefined: weight 1 (the backward of moe_dispatch: dx[t] +=
  // the gradients of its rows).
  virtual void moe_combine(const Tensor& rows, const Tensor& row, const Tensor& gates, const Tensor& out);
  // Combine's backward for the rows: drows[row[t,j]] = gates[t,j] dout[t] for the kept (t, j).
  virtual void moe_combine_backward(const Tensor& dout, const Tensor& row, const Tensor& gates, const Tensor& drows);
  // The balance losses' values, stats (4) f64 = [aux, seq_aux, z, entropy], q = s / sum_e s:
  //   aux = aux_alpha E sum_e f_e P_e, f_e = load_e / (k N), P_e = mean_t q_te (Switch);
  //   seq_aux = mean over sequences of seq_aux_alpha sum_e (E/(k T) count_e) (mean_t q_te) over its
  //             T = seq_len tokens (DeepSeek-V3);
  //   z = z_alpha mean_t (logsumexp_e u_te)^2 (ST-MoE, Zoph et al. 2022); entropy = mean_t -sum_e q log q.
  // Sums in double in token order; load from counts (moe_assign's). scratch f64: at least 3E.
  virtual void moe_balance_stats(const Tensor& logits, const Tensor& scores, const Tensor& expert,
                                 const Tensor& counts, const Tensor& stats, const Tensor& scratch,
                                 const MoeRouting& routing);
  // Router backward: dlogits (N,E) f32 (overwritten) from the gates' gradients dg_j = dy_t .
  // ye[row] (double; 0 for a dropped choice) through g = scale s / S (renorm) or scale s, plus
  // loss_weight x the balance losses' and the z-loss's gradients, through softmax or sigmoid.
  // ye (R, C), dy (N, C), counts: moe_assign's. scratch f64: at least (1 + N / seq_len + omp
  // threads) E elements.
  virtual void moe_router_backward(const Tensor& logits, const Tensor& scores, const Tensor& expert,
                                   const Tensor& row, const Tensor& ye, const Tensor& dy, const Tensor& counts,
                                   const Tensor& dlogits, const Tensor& scratch, const MoeRouting& routing);

  // ---- Multi-head latent attention (nn/mla.h; DeepSeek-V2, DeepSeek-AI 2024, §2.1). The
  // defaults throw (the backend lacks capabilities().latent_attention).
  // Rotate-half RoPE (Su et al. 2021) on d_r = rope_dim wide slices of x (B,T,W) f32: row (b, t)'s
  // `heads` slices start at columns offset + h stride, pairs (j, j + d_r/2) turn by
  // sign (pos_offset + t) inv_freq(j) (backend/rope.h, over d_r), sign -1 when inverse (the
  // backward); angles in double.
  virtual void mla_rope(const Tensor& x, int64_t heads, int64_t stride, int64_t offset, int64_t rope_dim,
                        const RopeSpec& rope, int64_t pos_offset, bool inverse);
  // Attention: q (B,T,H (d_n+d_r)) = [q_n | q_r] per head, kr (B,T,d_r), kv (B,T,H (d_n+d_v)) =
  // [k_n | v] per head; s(i,j) = (q_n . k_n(j) + q_r . k_r(j)) / sqrt(d_n + d_r) for the visible
  // j (causal, window); probs (B,H,T,T) = softmax (0 where masked), out (B,T,H d_v) = sum_j p v(j).
  virtual void mla_attention_forward(const Tensor& q, const Tensor& kr, const Tensor& kv, const Tensor& probs,
                                     const Tensor& out, const MlaDims& dims);
  // Its backward: dv(j) += p dout; dp = dout . v(j); ds = p (dp - sum_j p dp) / sqrt(d_n + d_r);
  // dq += ds k(j), dk_n(j) += ds q_n, dkr(j) += ds q_r summed over the heads. dq, dkv, dkr
  // accumulate (shaped as q, kv, kr); dp_row: T f32 of scratch.
  virtual void mla_attention_backward(const Tensor& q, const Tensor& kr, const Tensor& kv, const Tensor& probs,
                                      const Tensor& dout, const Tensor& dq, const Tensor& dkv, const Tensor& dkr,
                                      const Tensor& dp_row, const MlaDims& dims);
  // Decoding over cached latents (count, d_c + d_r) = [c' | k_r], all visible, W_uk absorbed:
  // per head q~ = W_uk^T q_n, s(j) = (q~ . c'(j) + q_r . k_r(j)) / sqrt(d_n + d_r), p = softmax,
  // out_h (d_v) = W_uv (sum_j p(j) c'(j)). q (H (d_n + d_r)), kv_b (H (d_n + d_v), d_c), out (H d_v).
  virtual void mla_attend_latents(const Tensor& q, const Tensor& latents, const Tensor& kv_b, const Tensor& out,
                                  const MlaDims& dims);

  // Low precision (nn/linear.h, the trainer's bf16 master weights; docs/precision.md): the
  // quantizers of the fp16 / fp8 recipes and QAT, f32 operands. Q_g(v) rounds v to nearest, ties
  // to even, onto grid g (NaN stays NaN). The defaults throw (the backend lacks
  // capabilities().low_precision); the CPU and the strict test backend implement them.
  // max |x[i]| (the amax of FP8 delayed / current scaling, Micikevicius et al. 2022); NaN if any is NaN.
  virtual float amax(const Tensor& x);
  // out[i] = Q_g(x[i] * scale) * post (fp16 rounding, FP8 fake quantization); out may alias x.
  virtual void fake_quant(const Tensor& x, const Tensor& out, const NumberGrid& grid, float scale, float post);
  // out (bf16) = Q_g(x * scale): exact as bf16 for a grid of at most 7 mantissa bits (FP8, FP4),
  // so a bf16 GEMM over these codes is the FP8 GEMM.
  virtual void quant_codes_bf16(const Tensor& x, const Tensor& out, const NumberGrid& grid, float scale);
  // Block scaling (DeepSeek-V3 2024, sec. 3.3.2): x viewed as (rows, last dim) in block_rows x
  // block_cols blocks (edge blocks smaller); s = max(amax_block, 1e-4) / g.max in f32 and
  // out = Q_g(x / s) * s.
  virtual void fake_quant_blocks(const Tensor& x, const Tensor& out, const NumberGrid& grid, int64_t block_rows,
                                 int64_t block_cols);
  // MXFP4 (OCP Microscaling Formats v1.0, sec. 5.3 and 6.3) along the last dim: each run of 32
  // (the last shorter) gets X = 2^(floor(log2 amax) - 2) (0 -> 2^-127) and out = E2M1(x / X) X,
  // saturating; a block with inf or NaN gives NaN.
  virtual void fake_quant_mxfp4(const Tensor& x, const Tensor& out);
  // NVFP4 (NVIDIA TransformerEngine): tensor scale s = amax / (448 * 6) (1 for a zero tensor);
  // per run of 16 along the last dim, S = E4M3((amax_block / 6) / s) s and out = E2M1(x / S) S
  // (0 when S = 0); a tensor with inf or NaN gives NaN everywhere.
  virtual void fake_quant_nvfp4(const Tensor& x, const Tensor& out);
  // x rounded in place to bf16 values kept in f32: nearest even, or stochastic (Gupta et al.
  // 2015): add the 16 high bits of the element's random number below bf16's last place and
  // truncate; inf and NaN stay.
  virtual void round_bf16(const Tensor& x, bool stochastic, const RoundingDraw& draw);
  // Inverted dropout (Srivastava et al. 2014) with a mask the draw regenerates (LoRA's
  // peft.dropout): out[i] = x[i] / (1 - p) where element i is kept, else 0; it is kept when
  // u_i >= p, u_i the (i mod 4)-th word of Philox4x32-10(counter = (i / 4 lo, i / 4 hi,
  // draw.stream, draw.draw), key = draw.seed) over 2^32. The same draw on a tensor of the same size
  // gives the same mask, so the backward applies it to the gradient. out may alias x; p in [0, 1).
  virtual void dropout(const Tensor& x, const Tensor& out, float p, const RoundingDraw& draw);
  // DoRA's row ops (Liu et al. 2024, eq. 5; nn/lora.h), on f32 (rows, cols) matrices and (rows)
  // vectors; the defaults throw (capabilities().dora). Each row's sum is taken in double, in
  // order, so the result does not depend on the thread count.
  // norms[j] = ||x_j||_2.
  virtual void row_norms(const Tensor& x, const Tensor& norms);
  // out_j = g_j merged_j - base_j, g_j = magnitude_j / norms_j (0 where norms_j = 0); base
  // undefined reads as 0. out may alias merged.
  virtual void dora_weight(const Tensor& merged, const Tensor& base, const Tensor& magnitude, const Tensor& norms,
                           const Tensor& out);
  // The norm held constant (PEFT detaches it): with grad = dL/d(out) of dora_weight,
  // dmagnitude_j += (grad_j . merged_j) / norms_j (0 where norms_j = 0), then grad_j *= g_j in
  // place, giving dL/d(merged).
  virtual void dora_backward(const Tensor& grad, const Tensor& merged, const Tensor& magnitude, const Tensor& norms,
                             const Tensor& dmagnitude);
  // NF4 dequantization on the fly (QLoRA's frozen base weights; the default throws): elements
  // [first, first + out.numel()) of the flat weight into out (f32, or bf16 rounded to nearest
  // even). codes (u8): element e's code in byte e / 2, the high nibble for even e; absmax_codes
  // (u8 holding int8 q_b) one per block b = e / 64; absmax_steps (f32) one per 256 blocks.
  // c_b = f32(q_b step_{b / 256} + absmax_mean) (in double) and out = values[code_e] c_{e / 64}.
  virtual void nf4_dequantize(const Tensor& codes, const Tensor& absmax_codes, const Tensor& absmax_steps,
                              const Nf4Spec& spec, int64_t first, const Tensor& out);
  // y (N, rows) = beta y + x (N, cols) @ W^T (+ bias), W the quantized weight of `spec` (codes u8
  // (rows, row_bytes), scales f32 and zeros u8 (rows, cols / group); with compact_int_weights
  // scales may be f16 and zeros undefined, IntWeightSpec). Weight-only formats: the
  // codes are dequantized in registers and multiplied in f32 (the result equals
  // int_dequantize-then-gemm up to the order of the f32 sums). act_int8: each input row is
  // quantized to q_x = round(x / s_x), s_x = max |x| / 127, and y = s_x s_w sum q_x (q_w - 128)
  // exactly in int32.
  virtual void int_linear(const Tensor& x, const Tensor& codes, const Tensor& scales, const Tensor& zeros,
                          const IntWeightSpec& spec, const Tensor* input_scale, const Tensor& y, float beta, const Tensor* bias);
  // W in f32 (rows, cols) into out.
  virtual void int_dequantize(const Tensor& codes, const Tensor& scales, const Tensor& zeros, const IntWeightSpec& spec,
                              const Tensor* input_scale, const Tensor& out);
  // y (N, rows) = beta y + x (N, cols) @ W^T (+ bias), W bf16 (rows, cols): a bf16 checkpoint's
  // weight used where it lies (Transformer::set_bf16_weights). Each element of W is widened
  // exactly and the products and sums are f32, so the result is gemm's with W widened to f32 up
  // to the order of the sums; decoding (small N) reads 2 bytes a weight instead of 4. x, y and
  // bias f32. The default widens W into a temporary f32 copy (cast) and runs gemm.
  virtual void bf16_weight_linear(const Tensor& x, const Tensor& w, const Tensor& y, float beta, const Tensor* bias);

  // ---------------------------------------------------------------- optimizer ops
  // The element loops, reductions and small matrix steps of the optimizers (optim/*.cpp; the
  // rules, defaults and state sizes in docs/optimizers.md), f32 tensors throughout; an optional
  // state operand is an undefined Tensor when the rule keeps none. The defaults throw (the backend
  // lacks capabilities().every_optimizer); the CPU and the strict test backend implement them.
  // Notation: g = grad_scale * grad, d = g + weight_decay * p (L2 decay), lr and wd from OptimHyper.
  // SGD (Robbins & Monro 1951; heavy ball, Polyak 1964; Nesterov in Sutskever et al. 2013's form,
  // as torch.optim.SGD): with buf, buf = d at step 1, else momentum buf + (1 - dampening) d;
  // d = nesterov ? d + momentum buf : buf. p -= lr d.
  virtual void sgd_step(const Tensor& param, const Tensor& grad, const Tensor& buf, const OptimHyper& hyper);
  // Adagrad (Duchi et al. 2011): sum += d^2; p -= lr d / (sqrt(sum) + eps) (lr: the decayed rate).
  virtual void adagrad_step(const Tensor& param, const Tensor& grad, const Tensor& sum, const OptimHyper& hyper);
  // RMSprop (Hinton 2012; centered, Graves 2013), a = beta2: sq = a sq + (1 - a) d^2; with avg
  // (centered) avg = a avg + (1 - a) d and den = sqrt(sq - avg^2) + eps, else den = sqrt(sq) + eps;
  // with buf, buf = momentum buf + d / den, p -= lr buf, else p -= lr d / den.
  virtual void rmsprop_step(const Tensor& param, const Tensor& grad, const Tensor& square, const Tensor& avg,
                            const Tensor& buf, const OptimHyper& hyper);
  // Adam (Kingma & Ba 2015) with L2 decay, or AdamW (Loshchilov & Hutter 2019) when decoupled
  // (p *= 1 - lr wd, d = g), with AMSGrad (Reddi et al. 2018) when vmax is given:
  // m = b1 m + (1-b1) d; v = b2 v + (1-b2) d^2; vmax = max(vmax, v);
  // p -= (lr / (1-b1^t)) m / (sqrt(vmax or v) / sqrt(1-b2^t) + eps).
  virtual void adam_step(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v, const Tensor& vmax,
                         const OptimHyper& hyper);
  // Lion (Chen et al. 2023): c = b1 m + (1-b1) g; p = p (1 - lr wd) - lr sign(c); m = b2 m + (1-b2) g.
  virtual void lion_step(const Tensor& param, const Tensor& grad, const Tensor& m, const OptimHyper& hyper);
  // Adam-mini (Zhang et al. 2024): v holds one second moment per block of param.numel() / v.numel()
  // consecutive elements: v_b = b2 v_b + (1-b2) mean_b(g^2) (in double, in order);
  // m = b1 m + (1-b1) g; p = p (1 - lr wd) - lr (m / (1-b1^t)) / (f32(sqrt(v_b / (1-b2^t))) + eps).
  virtual void adam_mini_step(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v,
                              const OptimHyper& hyper);
  // Adafactor (Shazeer & Stern 2018, the Hugging Face semantics) on one segment, beta2 = beta2_t:
  // V^ = EMA of g^2 + eps (factored: state = row means R (rows) then column means C (cols), V^_ij =
  // R_i / mean(R) C_j; else state = V per element); U = g / sqrt(V^) (into u, the segment's size);
  // rate = lr (scale_parameter: times max(eps2, RMS(p))); U *= rate / max(1, RMS(U) / clip_threshold);
  // with m, m = b1 m + (1-b1) U, U = m; p = p (1 - wd rate) - U. RMS sums in double.
  virtual void adafactor_step(const Tensor& param, const Tensor& grad, const Tensor& state, const Tensor& m,
                              const Tensor& u, const OptimHyper& hyper);
  // SM3-II (Anil et al. 2019) on one segment: factored, acc = row maxima (rows) then column maxima
  // (cols), nu_ij = min(row_i, col_j) + g_ij^2, then acc = the row and column maxima of nu; else
  // acc += g^2, nu = acc. p = p (1 - lr wd) - lr (nu > 0 ? g / (sqrt(nu) + eps) : 0).
  virtual void sm3_step(const Tensor& param, const Tensor& grad, const Tensor& acc, const OptimHyper& hyper);
  // CAME (Luo et al. 2023) on one segment: U as Adafactor's (beta2, eps, clip_threshold, no rate);
  // m = b1 m + (1-b1) U; factored: the residual's factored EMA (beta3, state res = R then C) of
  // (U - m)^2 + eps2 gives S^, p = p (1 - lr wd) - lr m / sqrt(S^); else p = p (1 - lr wd) - lr m.
  virtual void came_step(const Tensor& param, const Tensor& grad, const Tensor& state, const Tensor& m,
                         const Tensor& res, const Tensor& u, const OptimHyper& hyper);
  // dst = scale * src, or (transpose) dst (cols, rows) = scale * src^T; src (rows, cols).
  virtual void scale_transpose(const Tensor& src, const Tensor& dst, float scale, bool transpose);
  // y += alpha * x.
  virtual void axpy(const Tensor& y, const Tensor& x, float alpha);
  // The soft-target loss (Hinton, Vinyals, Dean 2015) per row of logits (N, V) f32 against a
  // teacher's logits (N, V) at temperature T: p_s = softmax(logits / T), p_t = softmax(teacher / T),
  // losses[i] = T^2 KL(p_t || p_s) (f32, N), grad = grad_scale T (p_s - p_t) (overwritten; the
  // gradient of grad_scale losses[i]). Sums in double per row.
  virtual void soft_target_loss(const Tensor& logits, const Tensor& teacher, float temperature, float grad_scale,
                                const Tensor& losses, const Tensor& grad);
  // Decode attention over a KV cache in this backend's memory (backend/kv_attention.h states the
  // plan and the formula): q and out (rows, n_head * head_dim) f32, pool u8 (the cache's tiles),
  // rings f32 (its fp32 windows; undefined when no row reads one). Checked by check_kv_attention.
  virtual void kv_attention(const KvAttendPlan& plan, const Tensor& q, const Tensor& pool, const Tensor& rings,
                            const Tensor& out);
  // Stores rows into a KV cache in this backend's memory (backend/kv_store.h states the plan):
  // sources f32, pool u8, rings f32 (undefined when no job touches them), status i32 (set, never
  // cleared, when an integer group cannot be stored). Checked by check_kv_store.
  virtual void kv_store(const KvStorePlan& plan, const std::vector<Tensor>& sources, const Tensor& pool,
                        const Tensor& rings, const Tensor& status);
  // Greedy decoding's pick: out[i] (i32, n) = the first index of the largest value of row i of x
  // (f32, (n, V)), std::max_element's choice (rows without NaN). Part of capabilities().kv_cache.
  virtual void argmax_rows(const Tensor& x, const Tensor& out);
  // A decoding step as one graph (CUDA graphs from stream capture): between begin_step_graph()
  // and end_step_graph(key) the ops are recorded, not run, and end_step_graph launches them as one
  // graph. The executable graph kept for `key` (the step's shape) takes the new step's parameters
  // in place when its operations have the same kinds in the same order (cudaGraphExecUpdate), else
  // it is made anew. Between the two no op may wait for the device or move bytes to or from
  // pageable host memory (read, write, the ops that return a host value). begin_step_graph()
  // returns false on a backend without graphs (the ops then run as they come);
  // abort_step_graph() drops a recording an exception cut short (nothing of it runs).
  virtual bool begin_step_graph() { return false; }
  virtual void end_step_graph(int64_t key) { (void)key; }
  virtual void abort_step_graph() {}
  struct StepGraphCounts {
    int64_t made = 0;      // graphs instantiated
    int64_t updated = 0;   // launches that updated a kept graph in place
    int64_t launched = 0;  // step graphs launched
  };
  virtual StepGraphCounts step_graph_counts() const { return {}; }
  // Sampled decoding's pick: out[i] (i32, n) = the token the sampling rule (backend/sampling_rule.h:
  // temperature, top-k, top-p, a Philox draw) gives row i of logits (f32, (n, V)) under rows[i],
  // after the penalties (OpenAI's presence and frequency, SamplePenalty) are subtracted from the
  // logits in place; the same token on every backend. Checked by check_sample_rows. Part of
  // capabilities().kv_cache.
  virtual void sample_rows(const Tensor& logits, const std::vector<RowSampling>& rows,
                           const std::vector<SamplePenalty>& penalties, const Tensor& out);
  // Muon (Jordan et al. 2024): buf = momentum buf + (1 - momentum) g;
  // u = nesterov ? (1 - momentum) g + momentum buf : buf.
  virtual void muon_momentum(const Tensor& grad, const Tensor& buf, const Tensor& u, const OptimHyper& hyper);
  // Muon's Newton-Schulz start: x = u / (||u||_2 + 1e-7) (norm in double, in order), u (rows, cols)
  // transposed into x when rows > cols.
  virtual void newton_schulz_normalize(const Tensor& u, const Tensor& x);
  // p = p decay - step u (Muon's update, the orthogonalized direction u).
  virtual void decayed_update(const Tensor& param, const Tensor& u, float decay, float step);
  // LDAdam (Robert et al. 2024, arXiv 2410.16103). The r leading eigenvectors (by descending
  // eigenvalue) of the symmetric s (n, n), computed in double (LAPACK dsyevd), as the columns of p (n, r).
  virtual void leading_eigenvectors(const Tensor& s, const Tensor& p);
  // The columns of y (n, r) orthonormalized by modified Gram-Schmidt in double into p; a column
  // whose squared norm after projection is <= 1e-60 takes fallback's column instead.
  virtual void gram_schmidt(const Tensor& y, const Tensor& fallback, const Tensor& p);
  // The moments carried into the new subspace: Q = P^T prev (r, r; 0 at step 1), mt = Q m, and
  // vt = (1-b2^(t-1)) |Q.^2 (v / (1-b2^(t-1)) - m.^2 / (1-b1^(t-1))^2) + mt.^2 / (1-b1^(t-1))^2|
  // (0 at step 1), all in double; p, prev (M, r); m, v, mt, vt (r, N).
  virtual void ldadam_rotate(const Tensor& p, const Tensor& prev, const Tensor& m, const Tensor& v, const Tensor& mt,
                             const Tensor& vt, const OptimHyper& hyper);
  // Adam in the subspace: m = b1 mt + (1-b1) gh; v = b2 vt + (1-b2) gh^2;
  // mt = (m / (1-b1^t)) / (sqrt(v / (1-b2^t)) + eps) (the direction).
  virtual void ldadam_adam(const Tensor& m, const Tensor& v, const Tensor& mt, const Tensor& vt, const Tensor& gh,
                           const OptimHyper& hyper);
  // p (rows, cols) = p (1 - lr wd) - lr D and grad = E, D and E (rows, cols), or (cols, rows)
  // read transposed when transpose (the error feedback goes back into the gradient buffer).
  virtual void ldadam_apply(const Tensor& param, const Tensor& grad, const Tensor& d, const Tensor& e, bool transpose,
                            const OptimHyper& hyper);
};

// Model-parallel slicing through Backend::copy_block: columns [first, first + narrow's width) of
// every row of `wide` (rows, W) <-> the contiguous narrow (rows, w), one dtype: into_wide copies
// narrow into those columns, else out of them.
void copy_columns(Backend& backend, const Tensor& wide, int64_t first, const Tensor& narrow, bool into_wide);

std::unique_ptr<Backend> make_cpu_backend();
// "cpu" or "cuda" (the config key `device`). "cuda" needs a build with the CUDA toolkit and a
// visible GPU; otherwise a one-line error says which is missing.
std::unique_ptr<Backend> make_backend(std::string_view device);
std::unique_ptr<Backend> make_backend(DeviceType device);
// True when this program was linked with a CUDA backend: the nvcc build's (the toolkit was found
// at configure time) or the simulator's (-DLOOM_CUDA=SIM, and the cuda_sim tests). The library
// itself is the same either way; the backend is one of three object sets linked into the program
// (backend/cuda/cuda_link.cpp with the nvcc or the simulated kernels, or backend/cuda_none.cpp).
bool cuda_backend_built();
// The CUDA backend of the program (throws one line when none is linked or no device is visible).
std::unique_ptr<Backend> make_cuda_backend();

}  // namespace loom
