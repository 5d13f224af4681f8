// Shared by the PyTorch parity tests: the model config a tools/ fixture's metadata names.
#pragma once
#include <string>

#include "loom/arch/config.h"
#include "loom/checkpoint/safetensors.h"

namespace loom::test {

inline ModelConfig config_from(const SafetensorsFile& f) {
  ModelConfig c;
  auto i64 = [&](const char* key) { return std::stoll(f.metadata_value(key)); };
  c.arch = arch_from_name(f.metadata_value("arch"));
  c.vocab_size = i64("vocab_size");
  c.max_seq_len = i64("max_seq_len");
  c.n_layer = i64("n_layer");
  c.n_head = i64("n_head");
  c.n_kv_head = i64("n_kv_head");
  c.d_model = i64("d_model");
  c.d_ff = i64("d_ff");
  c.norm_eps = std::stof(f.metadata_value("norm_eps"));
  c.rope_theta = std::stof(f.metadata_value("rope_theta"));
  if (f.metadata().count("attn_window") != 0) c.attn_window = i64("attn_window");  // sliding-window fixtures only
  if (f.metadata().count("mla_kv_rank") != 0) {  // MLA fixtures only
    c.mla_kv_rank = i64("mla_kv_rank"), c.mla_rope_dim = i64("mla_rope_dim"), c.mla_nope_dim = i64("mla_nope_dim");
    c.mla_v_dim = i64("mla_v_dim"), c.mla_q_rank = i64("mla_q_rank");
  }
  return c;
}

}  // namespace loom::test
