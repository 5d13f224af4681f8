// FlashAttention-2 on the CPU (backend/cpu/cpu_flash.h) against the probabilities kernels
// (attention_forward / attention_backward, cpu_kernels.h) in the same run: the median time of
// each over --reps runs (and the fastest run: on a shared machine another job's time slices
// fall on the threads-inside-GEMM probabilities kernels hardest), their ratio, the largest difference of the outputs, and the bytes each
// keeps for the backward (probs (B,H,T,T) against lse (B,H,T)). --tiles lists further tile
// sizes (Br x Bc) of the flash kernels to time beside the backend's default.
//   build/bench/flash_attention_bench [--batch 4] [--seq 1024] [--heads 12] [--kv-heads 12]
//                                     [--head-dim 64] [--window 0] [--reps 5] [--tiles 64x64,128x256]
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "loom/backend/backend.h"
#include "loom/backend/cpu/cpu_flash.h"
#include "loom/core/error.h"

namespace {

using namespace loom;

struct Args {
  int64_t batch = 4, seq = 1024, heads = 12, kv_heads = 12, head_dim = 64, window = 0, reps = 5;
  std::vector<cpu::FlashTiles> tiles;
};

std::vector<cpu::FlashTiles> parse_tiles(const std::string& list) {
  std::vector<cpu::FlashTiles> out;
  size_t at = 0;
  while (at < list.size()) {
    const size_t comma = std::min(list.find(',', at), list.size());
    const std::string item = list.substr(at, comma - at);
    const size_t x = item.find('x');
    LOOM_CHECK(x != std::string::npos, "--tiles: expected ROWSxCOLS, got '", item, "'");
    out.push_back({std::stoll(item.substr(0, x)), std::stoll(item.substr(x + 1))});
    at = comma + 1;
  }
  return out;
}

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string key = argv[i], value = argv[i + 1];
    if (key == "--batch") a.batch = std::stoll(value);
    else if (key == "--seq") a.seq = std::stoll(value);
    else if (key == "--heads") a.heads = std::stoll(value);
    else if (key == "--kv-heads") a.kv_heads = std::stoll(value);
    else if (key == "--head-dim") a.head_dim = std::stoll(value);
    else if (key == "--window") a.window = std::stoll(value);
    else if (key == "--reps") a.reps = std::stoll(value);
    else if (key == "--tiles") a.tiles = parse_tiles(value);
    else throw Error("unknown option " + key + " (expected --batch, --seq, --heads, --kv-heads, --head-dim, --window, "
                     "--reps, --tiles)");
  }
  return a;
}

void fill_uniform(const Tensor& t, uint64_t seed) {
  float* p = t.data<float>();
  uint64_t state = seed;
  for (int64_t i = 0; i < t.numel(); ++i) {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    p[i] = static_cast<float>(static_cast<double>(state >> 40) / static_cast<double>(1ull << 24)) * 2.0f - 1.0f;
  }
}

struct Timing {
  double median = 0, best = 0;  // seconds
};

// `reps` runs of f after one warm-up run.
Timing time_runs(int64_t reps, const std::function<void()>& f) {
  f();
  std::vector<double> s;
  for (int64_t r = 0; r < reps; ++r) {
    const auto start = std::chrono::steady_clock::now();
    f();
    s.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  std::sort(s.begin(), s.end());
  return {s[s.size() / 2], s.front()};
}

void print_row(const char* what, Timing probs, Timing flash) {
  std::printf("  %-20s %9.2f %9.2f %6.2f   %9.2f %9.2f %6.2f\n", what, 1e3 * probs.median, 1e3 * flash.median,
              probs.median / flash.median, 1e3 * probs.best, 1e3 * flash.best, probs.best / flash.best);
}

double max_abs_diff(const Tensor& a, const Tensor& b) {
  double d = 0.0;
  for (int64_t i = 0; i < a.numel(); ++i) d = std::max(d, std::abs(static_cast<double>(a.data<float>()[i]) - b.data<float>()[i]));
  return d;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const Args a = parse(argc, argv);
    auto backend = make_cpu_backend();
    Allocator& alloc = backend->allocator();
    const int64_t B = a.batch, T = a.seq, H = a.heads, KV = a.kv_heads, hd = a.head_dim;
    auto make = [&](Shape shape) { return Tensor::empty(alloc, std::move(shape), DTYPE_F32, MEM_WORKSPACE); };
    const Tensor qkv = make({B, T, (H + 2 * KV) * hd}), dout = make({B, T, H * hd});
    const Tensor out = make({B, T, H * hd}), flash_out = make({B, T, H * hd});
    const Tensor probs = make({B, H, T, T}), lse = make({B, H, T});
    const Tensor dqkv = make({B, T, (H + 2 * KV) * hd}), flash_dqkv = make({B, T, (H + 2 * KV) * hd});
    fill_uniform(qkv, 1);
    fill_uniform(dout, 2);
    const int64_t w = a.window;
    const Timing fwd = time_runs(a.reps, [&] { backend->attention_forward(qkv, out, probs, H, KV, w); });
    const Timing bwd = time_runs(a.reps, [&] { backend->attention_backward(dout, qkv, out, probs, dqkv, H, KV, w); });
    const Timing ffwd = time_runs(a.reps, [&] { backend->flash_attention_forward(qkv, flash_out, lse, H, KV, w); });
    const Timing fbwd =
        time_runs(a.reps, [&] { backend->flash_attention_backward(dout, qkv, flash_out, lse, flash_dqkv, H, KV, w); });
    std::printf("attention B=%lld T=%lld H=%lld KV=%lld hd=%lld window=%lld, %d threads, %lld runs\n",
                static_cast<long long>(B), static_cast<long long>(T), static_cast<long long>(H),
                static_cast<long long>(KV), static_cast<long long>(hd), static_cast<long long>(w), omp_get_max_threads(),
                static_cast<long long>(a.reps));
    std::printf("  %-20s %9s %9s %6s   %9s %9s %6s\n", "median | fastest", "probs ms", "flash ms", "ratio", "probs ms",
                "flash ms", "ratio");
    print_row("forward", fwd, ffwd);
    print_row("backward", bwd, fbwd);
    print_row("forward + backward", {fwd.median + bwd.median, fwd.best + bwd.best},
              {ffwd.median + fbwd.median, ffwd.best + fbwd.best});
    const cpu::FlashTiles def;
    const double saved_probs = 4.0 * static_cast<double>(probs.numel()), saved_lse = 4.0 * static_cast<double>(lse.numel());
    std::printf("  kept for the backward: probs %.1f MiB, lse %.3f MiB (%.0fx less); flash scratch %.2f MiB\n",
                saved_probs / (1 << 20), saved_lse / (1 << 20), saved_probs / saved_lse,
                4.0 * omp_get_max_threads() *
                    std::max(cpu::flash_forward_scratch(def, hd), cpu::flash_backward_scratch(def)) / (1 << 20));
    std::printf("  max |flash - probs|: out %.3g, dqkv %.3g\n", max_abs_diff(flash_out, out),
                max_abs_diff(flash_dqkv, dqkv));
    const int threads = omp_get_max_threads();
    for (const cpu::FlashTiles t : a.tiles) {
      std::vector<float> scratch(static_cast<size_t>(
          threads * std::max(cpu::flash_forward_scratch(t, hd), cpu::flash_backward_scratch(t))));
      const Timing tf = time_runs(a.reps, [&] {
        cpu::flash_attention_forward(qkv.data<float>(), flash_out.data<float>(), lse.data<float>(), scratch.data(),
                                     threads, B, T, H, KV, hd, w, t);
      });
      const Timing tb = time_runs(a.reps, [&] {
        cpu::flash_attention_backward(dout.data<float>(), qkv.data<float>(), flash_out.data<float>(), lse.data<float>(),
                                      flash_dqkv.data<float>(), scratch.data(), threads, B, T, H, KV, hd, w, t);
      });
      std::printf("  tiles %4lldx%-4lld flash ms (median | fastest): forward %.2f | %.2f, backward %.2f | %.2f\n",
                  static_cast<long long>(t.rows), static_cast<long long>(t.cols), 1e3 * tf.median, 1e3 * tf.best,
                  1e3 * tb.median, 1e3 * tb.best);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "flash_attention_bench: %s\n", e.what());
    return 1;
  }
  return 0;
}
