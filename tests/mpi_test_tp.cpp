// Tensor parallelism under mpirun: tp = 2 (np 2) and dp = 2 x tp = 2 (np 4) reproduce the
// single-process losses and gradients of the same model and global batch (fp32, 10 steps),
// for GPT-2 (tied head, vocabulary 97: the last slice padded) and Llama (GQA, SwiGLU).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <vector>

#include "loom/comm/communicator.h"
#include "loom/comm/device_mesh.h"
#include "loom/memory/estimate.h"
#include "loom/parallel/tensor_parallel.h"
#include "loom/train/trainer.h"
#include "mpi_fixture.h"

namespace loom {
namespace {


TrainConfig train_config(int64_t batch, const char* optimizer) {
  TrainConfig tc;
  tc.batch_size = batch, tc.seq_len = 16, tc.grad_accum = 2, tc.steps = 10, tc.schedule.warmup = 3;
  tc.schedule.max_lr = 1e-2;
  tc.optim.name = optimizer;
  return tc;
}

Curve single(const ModelConfig& config, int64_t batch, const char* optimizer, bool masked = false) {
  return train_single(config, train_config(batch, optimizer), 10, masked);
}

Curve tensor_parallel(Communicator& world, const ModelConfig& config, int tp_size, int64_t batch, const char* optimizer,
                      bool sequence_parallel, int64_t* activation_bytes, int zero_stage = 0, bool masked = false) {
  const DeviceMesh mesh(world.size(), {{"dp", 0}, {"tp", tp_size}});
  auto tp = mesh_group(world, mesh, "tp");
  auto dp = mesh_group(world, mesh, "dp");
  auto backend = make_cpu_backend();
  Transformer whole(*backend, config);  // the whole model's init, sliced: identical on every layout
  whole.init_weights(7);
  const ModelConfig local = tp_local_config(config, tp_size);
  Transformer model(*backend, local);
  tp_copy(*backend, config, whole.params(), local, model.params(), tp->rank(), tp_size, true);
  const VocabRange vocab = tp_vocab_range(config, tp->rank(), tp_size);
  model.set_tensor_parallel(tp.get(), vocab.begin, vocab.valid, sequence_parallel);
  DdpConfig ddp;
  ddp.zero_stage = zero_stage;
  Trainer trainer(*backend, model, train_config(batch, optimizer), dp->size() > 1 ? dp.get() : nullptr, ddp);
  RankData rows(backend->allocator(), config, dp->rank(), dp->size(), batch, masked);
  BatchSource& data = rows.source();
  *activation_bytes = static_cast<int64_t>(backend->allocator().tracker().current(MEM_ACTIVATIONS));
  Curve c;
  for (int s = 0; s < 10; ++s) {
    tp->reset_ledger();
    const StepStats st = trainer.train_step(data);
    c.losses.push_back(st.loss);
    c.norms.push_back(st.grad_norm);
    if (s == 0) c.tp_bytes = tp->ledger().total_sent();
    whole.grads().zero_();  // every slice's gradients put back in the whole layout, summed over the group
    tp_copy(*backend, config, whole.grads(), local, model.grads(), tp->rank(), tp_size, false, tp->rank() == 0);
    tp->all_reduce(whole.grads());
    const float* g = whole.grads().data<float>();
    c.grads.emplace_back(g, g + whole.grads().numel());
  }
  return c;
}

void compare(const Curve& tp, const Curve& ref, const char* what, int rank, double* worst_loss, double* worst_grad) {
  for (size_t s = 0; s < ref.losses.size(); ++s) {
    const double rel = std::abs(tp.losses[s] - ref.losses[s]) / std::abs(ref.losses[s]);
    *worst_loss = std::max(*worst_loss, rel);
    EXPECT_LT(rel, 1e-5) << what << " step " << s << ": " << tp.losses[s] << " vs " << ref.losses[s];
    const double grel = gradient_rel_diff(tp.grads[s].data(), ref.grads[s]);
    *worst_grad = std::max(*worst_grad, grel);
    EXPECT_LT(grel, 1e-5) << what << " step " << s << " gradient (rank " << rank << ")";
  }
}

// tp = 2, and tp = 2 with sequence parallelism (np 2; dp = 2 x tp = 2 at np 4).
TEST(MpiTensorParallel, ReproducesTheSingleProcessLossesAndGradients) {
  auto world = make_mpi_communicator();
  const int n = world->size(), tp_size = 2, dp_size = n / tp_size;
  for (const char* preset : {"gpt2-tiny", "llama-tiny"}) {
    const ModelConfig config = model_preset(preset);
    int64_t activations[2] = {0, 0};  // [sequence parallel]
    for (const bool sp : {false, true}) {
      // SGD keeps two runs' weights within rounding of each other, so each step's gradients
      // compare; AdamW (sqrt(v) amplifies rounding where a gradient is ~0) is compared by loss.
      for (const char* optimizer : {"sgd", "adamw"}) {
        const Curve ref = single(config, 2 * dp_size, optimizer);
        const Curve tp = tensor_parallel(*world, config, tp_size, 2, optimizer, sp, &activations[sp]);
        double worst_loss = 0.0, worst_grad = 0.0;
        if (std::string(optimizer) == "sgd") {
          compare(tp, ref, preset, world->rank(), &worst_loss, &worst_grad);
        } else {
          Curve tp_losses = tp, ref_losses = ref;
          for (auto& g : tp_losses.grads) g.assign(1, 1.0f);
          for (auto& g : ref_losses.grads) g.assign(1, 1.0f);
          compare(tp_losses, ref_losses, preset, world->rank(), &worst_loss, &worst_grad);
        }
        // Bytes over the tp group per step. Per micro-batch, in units of B T C floats:
        //   tp:    all-reduces (2 (t-1)/t each) of the embedding output, 2 per layer forward (g)
        //          and 2 backward (f), d(final norm): 2 + 4L;
        //   tp+sp: all-gathers and reduce-scatters ((t-1)/t each): forward the embedding's
        //          reduce-scatter, per layer 2 gathers + 2 reduce-scatters, the final norm's gather;
        //          backward the head's reduce-scatter, per layer 4 gathers (2 gradients, 2 norm
        //          inputs again) + 2 reduce-scatters, the embedding's gather: 4 + 10L.
        // Both: the cross-entropy's 3 all-reduces of B T floats; per step the gradient norm's f64
        // and (sp) the all-reduce of the norms' and positions' partial gradients.
        const int64_t B = 2, T = 16, C = config.d_model, L = config.n_layer, accum = 2, t = tp_size;
        const int64_t btc = 4 * B * T * C, ce = accum * 3 * 4 * B * T;
        int64_t partial = 0;  // sp: the norms' (and GPT-2's positions') gradient floats
        for (const ParamSpec& p : build_param_layout(config).params) {
          const bool norm = p.role == ROLE_VECTOR && p.name.find("attn.c_proj.bias") == std::string::npos &&
                            p.name.find("mlp.c_proj.bias") == std::string::npos &&
                            p.name.find("c_attn.bias") == std::string::npos && p.name.find("c_fc.bias") == std::string::npos;
          if (norm || p.name == "wpe.weight") partial += p.numel;
        }
        const int64_t expected = sp ? accum * (4 + 10 * L) * (t - 1) * btc / t + 2 * (t - 1) * (ce + 4 * partial + 8) / t
                                    : 2 * (t - 1) * (accum * (2 + 4 * L) * btc + ce + 8) / t;
        EXPECT_EQ(tp.tp_bytes, expected) << preset << (sp ? " sp" : "");
        if (world->rank() == 0) {
          std::printf("%s dp=%d x tp=%d%s, %s: 10 steps, worst loss rel diff %.2e, worst gradient rel diff %.2e; "
                      "%lld bytes sent per rank per step over the tp group (formula %lld)\n", preset, dp_size, tp_size,
                      sp ? " + sp" : "", optimizer, worst_loss, worst_grad, static_cast<long long>(tp.tp_bytes),
                      static_cast<long long>(expected));
        }
      }
    }
    // Sequence parallel keeps less: the residual stream and the norms on half the sequence.
    EXPECT_LT(activations[1], activations[0]);
    // loom memory's estimate (memory/estimate.h) of a tp rank's activation store, to the byte.
    MemoryPlan plan;
    plan.model = config, plan.batch = 2, plan.seq_len = 16, plan.tp = tp_size, plan.ranks = dp_size;
    EXPECT_EQ(estimate_memory(plan).bytes[MEM_ACTIVATIONS], activations[0]) << preset;
    if (world->rank() == 0) {
      std::printf("%s tp=%d: activation bytes per rank %lld, with sequence parallel %lld (%.3f)\n", preset, tp_size,
                  static_cast<long long>(activations[0]), static_cast<long long>(activations[1]),
                  static_cast<double>(activations[1]) / static_cast<double>(activations[0]));
    }
  }
}

// Qwen3-Next's hybrid blocks (qwen3-next-tiny: a gated DeltaNet block split by heads, 1 of 2 key
// heads and 2 of 4 value heads a rank, its output projection row-parallel; a gated-attention block
// with its gate projection column-parallel; MoE with a gated shared expert, replicated): tp = 2
// (dp 2 x tp 2 at np 4) reproduces the single-process losses and gradients within 1e-5.
TEST(MpiTensorParallel, LinearAttentionSplitByHeadsReproducesTheSingleProcessRun) {
  auto world = make_mpi_communicator();
  const int n = world->size(), tp_size = 2, dp_size = n / tp_size;
  const ModelConfig config = model_preset("qwen3-next-tiny");
  for (const char* optimizer : {"sgd", "adamw"}) {
    const Curve ref = single(config, 2 * dp_size, optimizer);
    int64_t activations = 0;
    Curve tp = tensor_parallel(*world, config, tp_size, 2, optimizer, false, &activations);
    double worst_loss = 0.0, worst_grad = 0.0;
    Curve ref_cmp = ref;
    if (std::string(optimizer) != "sgd") {  // AdamW: by loss
      for (auto& g : tp.grads) g.assign(1, 1.0f);
      for (auto& g : ref_cmp.grads) g.assign(1, 1.0f);
    }
    compare(tp, ref_cmp, "qwen3-next-tiny", world->rank(), &worst_loss, &worst_grad);
    if (world->rank() == 0) {
      std::printf("qwen3-next-tiny dp=%d x tp=%d, %s: 10 steps, worst loss rel diff %.2e, worst gradient rel diff %.2e\n",
                  dp_size, tp_size, optimizer, worst_loss, worst_grad);
    }
  }
}

// Loss masks (supervised data) through the vocabulary-parallel cross-entropy: a masked row gets
// loss 0 and no gradient on every vocabulary slice, so tp = 2 (with sp too) gives the
// single-process masked loss and gradients.
TEST(MpiTensorParallel, LossMasksGiveTheSingleProcessLossesAndGradients) {
  auto world = make_mpi_communicator();
  const int n = world->size(), tp_size = 2, dp_size = n / tp_size;
  for (const char* preset : {"gpt2-tiny", "llama-tiny"}) {
    const ModelConfig config = model_preset(preset);
    const Curve ref = single(config, 2 * dp_size, "sgd", true);
    for (const bool sp : {false, true}) {
      int64_t activations = 0;
      const Curve tp = tensor_parallel(*world, config, tp_size, 2, "sgd", sp, &activations, 0, true);
      double worst_loss = 0.0, worst_grad = 0.0;
      compare(tp, ref, preset, world->rank(), &worst_loss, &worst_grad);
      if (world->rank() == 0) {
        std::printf("%s masked, dp=%d x tp=%d%s: 10 steps, losses %.6f .. %.6f, worst loss rel diff %.2e, worst "
                    "gradient rel diff %.2e\n", preset, dp_size, tp_size, sp ? " + sp" : "", ref.losses.front(),
                    ref.losses.back(), worst_loss, worst_grad);
      }
    }
  }
}

// LoRA on every linear layer under tp = 2 (with sp too; dp 2 x tp 2 at np 4): the adapters are
// sliced as their layers (B's rows of q/k/v and gate/up, A's columns of o and down), the
// row-parallel layers' terms summed with their partial outputs, and the replicated matrices'
// partial gradients summed over tp: the one-process losses and gradients (SGD, masked targets
// too).
TEST(MpiTensorParallel, LoraReproducesTheSingleProcessLossesAndGradients) {
  auto world = make_mpi_communicator();
  const int n = world->size(), tp_size = 2, dp_size = n / tp_size;
  for (const char* preset : {"gpt2-tiny", "llama-tiny"}) {
    ModelConfig config = model_preset(preset);
    config.peft_method = PeftMethod::lora, config.lora_rank = 4, config.lora_alpha = 8.0f;
    config.lora_targets = config.arch == ARCH_GPT2 ? "q,k,v,o,up,down" : "q,k,v,o,gate,up,down";
    for (const bool sp : {false, true}) {
      for (const bool masked : {false, true}) {
        const Curve ref = single(config, 2 * dp_size, "sgd", masked);
        int64_t activations = 0;
        const Curve tp = tensor_parallel(*world, config, tp_size, 2, "sgd", sp, &activations, 0, masked);
        double worst_loss = 0.0, worst_grad = 0.0;
        compare(tp, ref, preset, world->rank(), &worst_loss, &worst_grad);
        if (world->rank() == 0) {
          std::printf("%s LoRA%s, dp=%d x tp=%d%s: 10 steps, losses %.6f .. %.6f, worst loss rel diff %.2e, worst "
                      "gradient rel diff %.2e\n", preset, masked ? " masked" : "", dp_size, tp_size, sp ? " + sp" : "",
                      ref.losses.front(), ref.losses.back(), worst_loss, worst_grad);
        }
      }
    }
  }
}

// ZeRO stages 1-3 on the dp dimension of dp = 2 x tp = 2 (np 4): the losses and gradient norms
// of one process (stage 1 also every gradient; stages 2 and 3 keep only their shard's).
TEST(MpiTensorParallel, ZeroOnTheDataParallelDimension) {
  auto world = make_mpi_communicator();
  if (world->size() != 4) GTEST_SKIP() << "runs under np 4";
  for (const char* preset : {"gpt2-tiny", "llama-tiny"}) {
    const ModelConfig config = model_preset(preset);
    for (const int stage : {1, 2, 3}) {
      for (const char* optimizer : {"sgd", "adamw"}) {
        const Curve ref = single(config, 4, optimizer);
        int64_t activations = 0;
        Curve got = tensor_parallel(*world, config, 2, 2, optimizer, false, &activations, stage);
        double worst_loss = 0.0, worst_norm = 0.0, worst_grad = 0.0;
        for (size_t s = 0; s < ref.losses.size(); ++s) {
          worst_loss = std::max(worst_loss, std::abs(got.losses[s] - ref.losses[s]) / ref.losses[s]);
          if (std::string(optimizer) == "sgd") {
            worst_norm = std::max(worst_norm, std::abs(got.norms[s] - ref.norms[s]) / ref.norms[s]);
          }
        }
        EXPECT_LT(worst_loss, 1e-5) << preset << " ZeRO-" << stage << " " << optimizer;
        EXPECT_LT(worst_norm, 1e-5) << preset << " ZeRO-" << stage << " " << optimizer << " gradient norm";
        if (stage == 1 && std::string(optimizer) == "sgd") compare(got, ref, preset, world->rank(), &worst_loss, &worst_grad);
        if (world->rank() == 0) {
          std::printf("%s ZeRO-%d dp=2 x tp=2, %s: worst loss rel diff %.2e, gradient norm %.2e\n", preset, stage,
                      optimizer, worst_loss, worst_norm);
        }
      }
    }
  }
}

}  // namespace
}  // namespace loom
