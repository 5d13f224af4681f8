// int_linear_bench: the quantized-weight products (Backend::int_linear, docs/compression.md)
// against Loom's f32 GEMM on the same shapes, in the same run: the decoding shapes of a GPT-2
// 124M-shaped block (d = 768, d_ff = 3072) and a 4096-token head, at 1, 4 and 16 input rows.
// Prints, per shape and format, the best time of repeated calls (microseconds), the weight bytes
// read per second, and the speed-up over f32. Decoding reads every weight once per token from
// memory (a model is larger than the caches), so each call takes the next of enough copies of
// the weight to fill 256 MiB (f32) and the time is per call.
//
// --shapes llama8b: Llama-3-8B's block (qkv 4096->6144, o, gate/up 4096->28672, down 14336->4096)
// instead, --group G the weights' group (default 128; int8s / int4s: symmetric groups with f16
// scales, as ggml's q8_0 / q4_0 at group 32), --rows N only that row count; bf16 rows
// (Backend::bf16_weight_linear, a bf16 checkpoint's weights used in place) are printed too.
//
// Usage: int_linear_bench [--seconds S] [--shapes gpt2|llama8b] [--group G] [--rows N]   (default 0.2 s per case)
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "loom/backend/backend.h"
#include "loom/core/dtype.h"
#include "loom/core/philox.h"
#include "loom/precision/int_quant.h"

using namespace loom;

namespace {

double best_seconds(double budget, const std::function<void()>& f) {
  f();  // warm-up
  double best = 1e30, spent = 0.0;
  int runs = 0;
  while (spent < budget || runs < 5) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = std::min(best, s), spent += s, ++runs;
  }
  return best;
}

}  // namespace

int main(int argc, char** argv) {
  double budget = 0.2;
  std::string shape_set = "gpt2";
  int64_t group = 128, only_rows = 0;
  for (int i = 1; i + 1 < argc; ++i) {
    if (std::string(argv[i]) == "--seconds") budget = std::stod(argv[i + 1]);
    if (std::string(argv[i]) == "--shapes") shape_set = argv[i + 1];
    if (std::string(argv[i]) == "--group") group = std::stoll(argv[i + 1]);
    if (std::string(argv[i]) == "--rows") only_rows = std::stoll(argv[i + 1]);
  }
  auto backend = make_cpu_backend();
  Allocator& a = backend->allocator();
  struct Shape2 {
    const char* name;
    int64_t out, in;
  };
  const std::vector<Shape2> shapes =
      shape_set == "llama8b"
          ? std::vector<Shape2>{{"qkv 4096->6144", 6144, 4096}, {"o 4096->4096", 4096, 4096},
                                {"gate_up 4096->28672", 28672, 4096}, {"down 14336->4096", 4096, 14336}}
          : std::vector<Shape2>{{"qkv 768->2304", 2304, 768}, {"proj 768->768", 768, 768}, {"fc 768->3072", 3072, 768},
                                {"fc2 3072->768", 768, 3072}, {"head 768->4096", 4096, 768}};
  struct Format {
    const char* name;
    int bits;
    bool act_int8;
    IntStorage storage;
  };
  // int8s / int4s: ggml's q8_0 / q4_0 layout (symmetric groups, f16 scales: loom quantize --scales f16 --symmetric)
  const Format formats[] = {{"int8", 8, false, {}},          {"int4", 4, false, {}},  {"int3", 3, false, {}},
                            {"int8s", 8, false, {true, true}}, {"int4s", 4, false, {true, true}}, {"w8a8", 8, true, {}}};
  std::printf("%-16s %4s %-6s %10s %10s %8s\n", "shape", "rows", "format", "us", "GB/s", "vs f32");
  for (const Shape2& sh : shapes) {
    std::vector<float> w(static_cast<size_t>(sh.out * sh.in));
    philox_fill_normal(w.data(), sh.out * sh.in, 1, 0, 0, 0.0f, 0.05f);
    const int64_t copies = (256ll << 20) / (sh.out * sh.in * 4) + 1;
    std::vector<Tensor> wts;
    for (int64_t k = 0; k < copies; ++k) {
      wts.push_back(Tensor::empty(a, {sh.out, sh.in}, DTYPE_F32, MEM_PARAMETERS));
      backend->write(wts.back(), w.data());
    }
    std::vector<Tensor> w16s;  // the same weights rounded to bf16
    std::vector<uint16_t> w16(w.size());
    for (size_t i = 0; i < w.size(); ++i) w16[i] = f32_to_bf16(w[i]).bits;
    for (int64_t k = 0; k < copies; ++k) {
      w16s.push_back(Tensor::empty(a, {sh.out, sh.in}, DTYPE_BF16, MEM_PARAMETERS));
      backend->write(w16s.back(), w16.data());
    }
    for (int64_t n : {1, 4, 16}) {
      if (only_rows > 0 && n != only_rows) continue;
      Tensor x = Tensor::empty(a, {n, sh.in}, DTYPE_F32, MEM_WORKSPACE), y = Tensor::empty(a, {n, sh.out}, DTYPE_F32, MEM_WORKSPACE);
      std::vector<float> xv(static_cast<size_t>(n * sh.in));
      philox_fill_normal(xv.data(), n * sh.in, 2, 0, 0, 0.0f, 1.0f);
      backend->write(x, xv.data());
      GemmSpec spec;
      spec.trans_b = true;
      const double f32 = best_seconds(budget, [&] {
        for (const Tensor& wt : wts) backend->gemm(x, wt, y, spec);
      }) / static_cast<double>(copies);
      std::printf("%-16s %4lld %-6s %10.1f %10.1f %8s\n", sh.name, static_cast<long long>(n), "f32", f32 * 1e6,
                  static_cast<double>(sh.out * sh.in * 4) / f32 / 1e9, "1.00x");
      const double b16 = best_seconds(budget, [&] {
        for (const Tensor& wt : w16s) backend->bf16_weight_linear(x, wt, y, 0.0f, nullptr);
      }) / static_cast<double>(copies);
      std::printf("%-16s %4lld %-6s %10.1f %10.1f %7.2fx\n", sh.name, static_cast<long long>(n), "bf16", b16 * 1e6,
                  static_cast<double>(sh.out * sh.in * 2) / b16 / 1e9, f32 / b16);
      for (const Format& f : formats) {
        const IntWeight q = rtn_quantize(w, int_weight_spec(f.bits, f.act_int8 ? 0 : group, sh.out, sh.in, f.act_int8, sh.name), f.storage);
        std::vector<IntWeightDevice> ds;
        for (int64_t k = 0; k < copies; ++k) ds.push_back(int_weight_to_backend(q, *backend, MEM_PARAMETERS));
        const IntWeightDevice& d = ds[0];
        const double s = best_seconds(budget, [&] {
          for (const IntWeightDevice& dk : ds) backend->int_linear(x, dk.codes, dk.scales, dk.zeros, dk.spec, nullptr, y, 0.0f, nullptr);
        }) / static_cast<double>(copies);
        std::printf("%-16s %4lld %-6s %10.1f %10.1f %7.2fx\n", sh.name, static_cast<long long>(n), f.name, s * 1e6,
                    static_cast<double>(d.bytes) / s / 1e9, f32 / s);
      }
    }
  }
  return 0;
}
