// SPDX-License-Identifier: MIT
// dsv4_gemv_bench: measures device-to-device copy bandwidth, then the skinny GEMM for every format / decode shape /
// m in {1, 8, 32} and every split_k, against that copy bandwidth. Weight sets rotate through >= 256 MB so no
// launch reads from L2 (60 MB); each timing is the median of 15 graph replays measured with events.
// Usage: dsv4_gemv_bench [--md FILE] [--pdl] [--quick]   (FILE gets the markdown table for docs/perf.md)
// FP4 / FP8 rows (and the W4A8 rows) are also timed with the weights through the copy engine (set_gemv_bulk):
// "bulk" gives its time at the heuristic's split and its best split, next to the register kernel's in the same run;
// "tiles" the register kernel's on fp4 weights in the tile layout (GemvLayout::Tiles; random bytes, so only timing),
// "tiles-bulk" the copy-engine kernel's on them.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <functional>
#include <string>
#include <tuple>
#include <vector>

#include "bench_util.cuh"
#include "cuda/bandwidth.h"
#include "cuda/device.h"
#include "cuda/gemv.h"
#include "cuda/gemv_launch.h"
#include "cuda/ops.h"

namespace {

using namespace dsv4;
using bench::check, bench::fill, bench::time_steps;

struct Shape {
  const char* name;
  int n, k;
  int count;  // matrices per step (6 routed experts one after another)
};

struct Format {
  const char* name;
  GemvWeight w;
  GemvScale s;
};

size_t weight_bytes(const Format& f, int n, int k) {
  switch (f.w) {
    case GemvWeight::BF16: return size_t(n) * k * 2;
    case GemvWeight::FP8_BLOCK: return size_t(n) * k;
    default: return size_t(n) * k / 2;
  }
}
size_t scale_bytes(const Format& f, int n, int k) {
  switch (f.w) {
    case GemvWeight::BF16: return 0;
    case GemvWeight::FP8_BLOCK: return size_t((n + 127) / 128) * ((k + 127) / 128) * (f.s == GemvScale::F32 ? 4 : 1);
    case GemvWeight::MXFP4: return size_t(n) * (k / 32);
    case GemvWeight::NVFP4: return size_t(n) * (k / 16);
  }
  return 0;
}
size_t round_up(size_t v, size_t a) { return (v + a - 1) / a * a; }

}  // namespace

// --one FORMAT N K M: 20 plain launches of one configuration (for ncu / compute-sanitizer), no timing.
int run_one(const std::string& fmt, int n, int k, int m) {
  GemvParams p;
  p.m = m, p.n = n, p.k = k, p.out = GemvOut::BF16, p.w_scale_2 = 0.5f;
  p.weight = fmt == "bf16" ? GemvWeight::BF16 : fmt == "mxfp4" ? GemvWeight::MXFP4 : fmt == "nvfp4" ? GemvWeight::NVFP4
                                                                                                    : GemvWeight::FP8_BLOCK;
  const size_t wb = p.weight == GemvWeight::BF16 ? size_t(n) * k * 2 : p.weight == GemvWeight::FP8_BLOCK ? size_t(n) * k
                                                                                                         : size_t(n) * k / 2;
  DeviceBuffer w(wb), s(size_t(n) * k / 8 + 4096), x(size_t(m) * k * 2), y(size_t(m) * n * 4);
  fill(w.data(), wb, 3, p.weight == GemvWeight::FP8_BLOCK ? 0xBFBFBFBFu : ~0u, 0);
  check(cudaMemset(s.data(), p.weight == GemvWeight::NVFP4 ? 0x38 : 120, s.size()), "memset");
  fill(x.data(), x.size(), 7, 0x807F807Fu, 0x3F003F00u);
  p.x = x.data(), p.w = w.data(), p.w_scale = s.data(), p.y = y.data();
  for (int i = 0; i < 20; ++i) gemv(p);
  check(cudaDeviceSynchronize(), "sync");
  std::printf("ran %s %dx%d m=%d split=%d\n", fmt.c_str(), n, k, m, gemv_default_split_k(p, device_info(0).sm_count));
  return 0;
}

int main(int argc, char** argv) {
  std::string md_path;
  bool quick = false;  // --quick: m = 1 and 8 only, no W4A8, no fp8 with f32 scales
  bool pdl = false;  // --pdl: consecutive launches overlap as in the forward pass (default: one kernel alone)
  for (int i = 1; i < argc; ++i) {
    if (std::string(argv[i]) == "--md" && i + 1 < argc) md_path = argv[++i];
    if (std::string(argv[i]) == "--pdl") pdl = true;
    if (std::string(argv[i]) == "--quick") quick = true;
  }
  gpu::set_dependent_launch(pdl);
  set_gemv_tiled_min_rows(kGemvMaxM + 1);  // this bench times the skinny kernels: m <= 64 stays on them
  if (!cuda_available()) {
    std::fprintf(stderr, "no CUDA device\n");
    return 1;
  }
  if (argc == 6 && std::string(argv[1]) == "--one") {
    try {
      return run_one(argv[2], std::atoi(argv[3]), std::atoi(argv[4]), std::atoi(argv[5]));
    } catch (const std::exception& e) {
      std::fprintf(stderr, "error: %s\n", e.what());
      return 1;
    }
  }
  try {
    const DeviceInfo info = device_info(0);
    std::printf("device: %s, %d SMs, L2 %.0f MB; launches %s\n", info.name.c_str(), info.sm_count,
                double(info.l2_bytes) / 1e6, pdl ? "overlapped (--pdl)" : "serialised");

    constexpr size_t kRotateBytes = size_t(256) << 20;
    DeviceBuffer big_src(size_t(1) << 30), big_dst(size_t(1) << 30);
    fill(big_src.data(), big_src.size(), 1, ~0u, 0);
    // Warm-up: the card idles at low clocks; half a second of copies brings it to its working clocks first.
    for (int i = 0; i < 600; ++i)
      check(cudaMemcpyAsync(big_dst.data(), big_src.data(), big_src.size(), cudaMemcpyDeviceToDevice), "copy");
    check(cudaDeviceSynchronize(), "sync");
    const double t_big = time_steps(
        [&](cudaStream_t s, int) {
          check(cudaMemcpyAsync(big_dst.data(), big_src.data(), big_src.size(), cudaMemcpyDeviceToDevice, s), "copy");
        },
        5);
    const double memcpy_bw = 2.0 * double(big_src.size()) / t_big;  // bytes read + written
    const double t_kernel = time_steps(
        [&](cudaStream_t s, int) {
          launch_copy_kernel(big_src.data(), big_dst.data(), big_src.size(), s);  // the copy ceiling of plain loads
        },
        5);
    const double kernel_bw = 2.0 * double(big_src.size()) / t_kernel;
    const double copy_bw = std::max(memcpy_bw, kernel_bw);
    std::printf("copy bandwidth (1 GiB, read+write): cudaMemcpy D2D %.0f GB/s, copy kernel %.0f GB/s; 'vs copy' uses %.0f\n\n",
                memcpy_bw / 1e9, kernel_bw / 1e9, copy_bw / 1e9);
    big_src = DeviceBuffer(), big_dst = DeviceBuffer();

    DeviceBuffer x(size_t(64) * 16384 * 2), y(size_t(64) * 129280 * 4);
    fill(x.data(), x.size(), 7, 0x807F807Fu, 0x3F003F00u);  // bf16 +-[0.5, 1)

    const Format formats[] = {{"bf16", GemvWeight::BF16, GemvScale::E8M0},
                              {"fp8_e8m0", GemvWeight::FP8_BLOCK, GemvScale::E8M0},
                              {"fp8_f32s", GemvWeight::FP8_BLOCK, GemvScale::F32},
                              {"mxfp4", GemvWeight::MXFP4, GemvScale::E8M0},
                              {"nvfp4", GemvWeight::NVFP4, GemvScale::E8M0}};
    const Shape shapes[] = {{"32768x1024", 32768, 1024, 1},
                            {"4096x8192", 4096, 8192, 1},
                            {"2048x4096 x6", 2048, 4096, 6},
                            {"129280x4096", 129280, 4096, 1}};
    std::string md =
        "| format | shape (n x k) | m | split | us / step | weight GB/s | vs 1 GiB copy | vs same-size copy | best split "
        "(frac) |\n|---|---|---|---|---|---|---|---|---|\n";
    // Fixed cost of one launch: the same rows with k = 256 move 1/16 - 1/32 of the bytes, so their time is the
    // launch, ramp and epilogue a launch pays whatever its size (docs/perf.md, "fixed cost per GEMV launch").
    std::printf("fixed cost per launch (k = 256, m = 1, graph of back-to-back launches):");
    for (const auto& [f, n] : {std::pair{formats[0], 4096}, {formats[4], 4096}, {formats[4], 32768}}) {
      const int k = 256;
      const size_t wb = weight_bytes(f, n, k), sb = scale_bytes(f, n, k);
      DeviceBuffer w(wb), sc(std::max<size_t>(sb, 16));
      fill(w.data(), wb, 5, f.w == GemvWeight::BF16 ? 0x807F807Fu : ~0u, f.w == GemvWeight::BF16 ? 0x3C003C00u : 0);
      check(cudaMemset(sc.data(), 0x38, sc.size()), "memset");
      const double t = time_steps(
          [&](cudaStream_t s, int) {
            GemvParams p;
            p.m = 1, p.n = n, p.k = k, p.x = x.data(), p.y = y.data(), p.w = w.data(), p.w_scale = sc.data();
            p.weight = f.w, p.out = GemvOut::BF16, p.stream = s;
            gemv(p);
          },
          64);
      std::printf("  %s %dx%d %.2f us", f.name, n, k, t * 1e6);
    }
    std::printf("\n\n");
    std::printf("m 1a8: act fp8 (the W4A8 kernel); otherwise bf16 activations (W4A16)\n");
    std::printf("%-9s %-13s %5s %5s %10s %9s %8s %8s  %s\n", "format", "shape", "m", "split", "us/step", "GB/s",
                "vs copy", "vs same", "best split (frac)");
    for (const Shape& sh : shapes) {
      for (const Format& f : formats) {
        const bool lm_head = sh.n == 129280;
        if (lm_head && f.w != GemvWeight::BF16) continue;  // the lm_head is bf16
        if (f.s == GemvScale::F32 && (sh.n != 32768 || quick)) continue;  // f32 scales: one shape is enough
        const size_t wb = weight_bytes(f, sh.n, sh.k), sb = scale_bytes(f, sh.n, sh.k);
        const size_t stride = round_up(wb, 256) + round_up(sb, 256);
        const int n_sets = int(std::max<size_t>(size_t(sh.count), (kRotateBytes + stride - 1) / stride));
        DeviceBuffer sets(stride * n_sets);
        const uint32_t and_mask = f.w == GemvWeight::FP8_BLOCK ? 0xBFBFBFBFu : f.w == GemvWeight::BF16 ? 0x807F807Fu : ~0u;
        const uint32_t or_mask = f.w == GemvWeight::BF16 ? 0x3C003C00u : 0u;
        for (int i = 0; i < n_sets; ++i) {
          char* base = sets.as<char>() + size_t(i) * stride;
          fill(base, wb, 100 + i, and_mask, or_mask);
          if (sb) {
            if (f.w == GemvWeight::FP8_BLOCK && f.s == GemvScale::F32)
              fill(base + round_up(wb, 256), round_up(sb, 4), 0, 0, 0x3C23D70Au);  // 0.01f
            else
              check(cudaMemset(base + round_up(wb, 256), f.w == GemvWeight::NVFP4 ? 0x38 : 120, sb), "memset");
          }
        }
        const size_t step_bytes = (wb + sb) * sh.count;
        const int steps = std::max(20, 2 * n_sets / sh.count);
        // Same-size copy: the same source rotation, into a destination rotation of >= 256 MB.
        const size_t dst_stride = round_up(wb + sb, 256);
        const int n_dst = int(std::max<size_t>(1, kRotateBytes / dst_stride));
        DeviceBuffer dst(dst_stride * n_dst);
        const double t_copy = time_steps(
            [&](cudaStream_t s, int step) {
              for (int e = 0; e < sh.count; ++e) {
                const int i = step * sh.count + e;
                check(cudaMemcpyAsync(dst.as<char>() + size_t(i % n_dst) * dst_stride,
                                      sets.as<char>() + size_t(i % n_sets) * stride, wb + sb,
                                      cudaMemcpyDeviceToDevice, s), "copy");
              }
            },
            steps);
        const double same_bw = 2.0 * double(step_bytes) / t_copy;
        const bool fp4 = f.w == GemvWeight::MXFP4 || f.w == GemvWeight::NVFP4;
        for (const auto& [m, act] : {std::pair{1, GemvAct::BF16}, {1, GemvAct::FP8}, {8, GemvAct::BF16},
                                     {32, GemvAct::BF16}}) {
          if (act == GemvAct::FP8 && !fp4) continue;  // W4A8: fp4 weights only
          if (quick && (act == GemvAct::FP8 || m == 32)) continue;
          GemvParams p;
          p.m = m, p.n = sh.n, p.k = sh.k, p.x = x.data(), p.y = y.data();
          p.weight = f.w, p.fp8_scale = f.s, p.w_scale_2 = 0.5f, p.out = GemvOut::BF16, p.act = act;
          const int auto_split = gemv_default_split_k(p, info.sm_count);
          auto time_split = [&](int split) {
            return time_steps(
                [&](cudaStream_t s, int step) {
                  for (int e = 0; e < sh.count; ++e) {
                    const int set = (step * sh.count + e) % n_sets;
                    GemvParams q = p;
                    q.w = sets.as<char>() + size_t(set) * stride;
                    q.w_scale = sb ? sets.as<char>() + size_t(set) * stride + round_up(wb, 256) : nullptr;
                    q.split_k = split, q.stream = s;
                    gemv(q);
                  }
                },
                steps);
          };
          // Every split: the heuristic's time, the best time and its split.
          struct Sweep {
            double t_auto = 0, t_best = 1e30;
            int best_split = 0;
          };
          auto sweep = [&] {
            Sweep w;
            for (int split : {1, 2, 4, 8}) {
              const double t = time_split(split);
              if (split == auto_split) w.t_auto = t;
              if (t < w.t_best) w.t_best = t, w.best_split = split;
            }
            return w;
          };
          const auto [t_auto, t_best, best_split] = sweep();
          std::string bulk_note;
          GemvParams probe = p;
          probe.w = sets.data(), probe.w_scale = sb ? sets.as<char>() + round_up(wb, 256) : nullptr;
          set_gemv_bulk(true);
          if (detail::gemv_bulk_supported(probe) || detail::gemv_w4a8_bulk_supported(probe)) {
            const Sweep b = sweep();
            char buf[160];
            std::snprintf(buf, sizeof buf, "  bulk %.2f us %.3f, best %d (%.3f)", b.t_auto * 1e6,
                          double(step_bytes) / b.t_auto / copy_bw, b.best_split,
                          double(step_bytes) / b.t_best / copy_bw);
            bulk_note = buf;
          }
          set_gemv_bulk(false);
          if (fp4 && act == GemvAct::BF16) {  // the same kernel on weights in the tile layout (weight_tiles.h)
            p.layout = GemvLayout::Tiles;
            const Sweep t = sweep();
            p.layout = GemvLayout::Rows;
            char buf[160];
            std::snprintf(buf, sizeof buf, "  tiles %.2f us %.3f, best %d (%.3f)", t.t_auto * 1e6,
                          double(step_bytes) / t.t_auto / copy_bw, t.best_split,
                          double(step_bytes) / t.t_best / copy_bw);
            bulk_note += buf;
            set_gemv_bulk(true);  // tiles through the copy engine: one weight and one scale copy per stage
            probe.layout = GemvLayout::Tiles;
            if (detail::gemv_bulk_supported(probe)) {
              p.layout = GemvLayout::Tiles;
              const Sweep tb = sweep();
              p.layout = GemvLayout::Rows;
              std::snprintf(buf, sizeof buf, "  tiles-bulk %.2f us %.3f, best %d (%.3f)", tb.t_auto * 1e6,
                            double(step_bytes) / tb.t_auto / copy_bw, tb.best_split,
                            double(step_bytes) / tb.t_best / copy_bw);
              bulk_note += buf;
            }
            set_gemv_bulk(false);
          }
          const double bw = double(step_bytes) / t_auto;
          char line[512];
          std::snprintf(line, sizeof line, "%-9s %-13s %3d%s %5d %10.2f %9.0f %8.3f %8.3f  %d (%.3f)%s\n", f.name,
                        sh.name, m, act == GemvAct::FP8 ? "a8" : "  ", auto_split, t_auto * 1e6, bw / 1e9, bw / copy_bw,
                        bw / same_bw, best_split, double(step_bytes) / t_best / copy_bw, bulk_note.c_str());
          std::fputs(line, stdout);
          std::fflush(stdout);
          std::snprintf(line, sizeof line, "| %s | %s | %d%s | %d | %.2f | %.0f | %.3f | %.3f | %d (%.3f) |\n", f.name,
                        sh.name, m, act == GemvAct::FP8 ? " (W4A8)" : "", auto_split, t_auto * 1e6, bw / 1e9, bw / copy_bw, bw / same_bw, best_split,
                        double(step_bytes) / t_best / copy_bw);
          md += line;
        }
      }
    }
    // Grouped decode shapes: one token's 7 pairs (6 routed + shared) on 33 experts of one layer, w1 with w3 as the
    // second projection, then w2; the steps rotate over slot sets so the experts do not stay in L2.
    std::printf("\ngrouped decode (7 of 33 experts, one launch per projection set; frac of copy bandwidth):\n");
    for (const auto& [f, act] : {std::pair{formats[0], GemvAct::BF16}, {formats[3], GemvAct::BF16},
                                 {formats[3], GemvAct::FP8}, {formats[4], GemvAct::BF16}, {formats[4], GemvAct::FP8}}) {
      if (quick && act == GemvAct::FP8) continue;
      for (const auto& [name, n, k, second] : {std::tuple{"w1+w3 2048x4096", 2048, 4096, true},
                                              std::tuple{"w2 4096x2048", 4096, 2048, false}}) {
        const int E = 33, picks = 7, sets = 24;
        const size_t wb = weight_bytes(f, n, k), sb = scale_bytes(f, n, k);
        DeviceBuffer w(wb * E * 2), sc(std::max<size_t>(sb * E * 2, 16)), s2(E * 2 * 4), ids(sets * picks * 4),
            count(sets * 4), expert(sets * E * 4), offset(sets * (E + 1) * 4), order(sets * picks * 4);
        fill(w.data(), w.size(), 11, f.w == GemvWeight::BF16 ? 0x807F807Fu : ~0u, f.w == GemvWeight::BF16 ? 0x3C003C00u : 0);
        check(cudaMemset(sc.data(), f.w == GemvWeight::NVFP4 ? 0x38 : 120, sc.size()), "memset");
        std::vector<float> ones(E * 2, 0.5f);
        s2.upload(ones.data(), ones.size() * 4);
        std::vector<int32_t> h_ids(sets * picks);
        for (int st = 0; st < sets; ++st)
          for (int i = 0; i < picks; ++i) h_ids[st * picks + i] = (st * picks + i) % E;  // distinct within a set
        ids.upload(h_ids.data(), h_ids.size() * 4);
        std::vector<MoeSlots> slots(sets);
        for (int st = 0; st < sets; ++st) {
          slots[st] = {count.as<int32_t>() + st, expert.as<int32_t>() + st * E, offset.as<int32_t>() + st * (E + 1),
                       order.as<int32_t>() + st * picks};
          MoeSlotsParams mp;
          mp.ids = ids.as<int32_t>() + st * picks, mp.n = 1, mp.k = picks, mp.experts = E, mp.slots = slots[st];
          moe_slots(mp);
        }
        const double bytes = double(wb + sb) * picks * (second ? 2 : 1);
        const bool fp4 = f.w == GemvWeight::MXFP4 || f.w == GemvWeight::NVFP4;
        // register kernel, copy engine, register kernel on tiled weights, copy engine on tiled weights
        for (const int mode : {0, 1, 2, 3}) {
        const bool bulk = mode == 1 || mode == 3, tiles = mode >= 2;
        if ((bulk || tiles) && !fp4) continue;
        if (tiles && act == GemvAct::FP8) continue;  // the W4A8 kernel reads rows
        set_gemv_bulk(bulk);
        std::printf("  %-9s %-4s %-16s%s", f.name, act == GemvAct::FP8 ? "a8" : "a16", name,
                    mode == 3 ? " tiles-bulk" : bulk ? " bulk      " : tiles ? " tiles     " : "           ");
        for (int split : {0, 1, 2, 4, 8}) {  // 0: the heuristic (7 active slots)
            const double t = time_steps(
                [&](cudaStream_t st_, int step) {
                  GemvGroupedParams g;
                  g.base.m = 1, g.base.n = n, g.base.k = k, g.base.x = x.data(), g.base.y = y.data();
                  g.base.w = w.data(), g.base.w_scale = sb ? sc.data() : nullptr, g.base.weight = f.w;
                  g.base.out = GemvOut::F32, g.base.split_k = split, g.base.act = act;
                  g.base.layout = tiles ? GemvLayout::Tiles : GemvLayout::Rows;
                  g.base.stream = st_;
                  g.w_expert_stride = wb, g.scale_expert_stride = sb, g.scale_2 = s2.as<float>();
                  g.max_slots = E, g.active_slots_hint = picks, g.slots = slots[step % sets], g.x_row_div = picks;
                  if (second) {
                    g.second.w = w.as<char>() + wb * E;
                    g.second.w_scale = sb ? sc.as<char>() + sb * E : nullptr;
                    g.second.scale_2 = s2.as<float>() + E;
                    g.second.y = y.as<float>() + size_t(picks) * n;
                  }
                  gemv_grouped(g);
                },
                48);
            std::printf("  %s%d %.3f (%.1f us)", split ? "split " : "auto ", split, bytes / t / copy_bw, t * 1e6);
          }
        std::printf("\n");
        std::fflush(stdout);
        set_gemv_bulk(false);
        }
      }
    }

    char tail[300];
    std::snprintf(tail, sizeof tail,
                  "\ncopy bandwidth (1 GiB, read+write) on %s: cudaMemcpy D2D %.0f GB/s, copy kernel %.0f GB/s\n",
                  info.name.c_str(), memcpy_bw / 1e9, kernel_bw / 1e9);
    md += tail;
    if (!md_path.empty()) {
      FILE* fp = std::fopen(md_path.c_str(), "w");
      if (fp) std::fputs(md.c_str(), fp), std::fclose(fp);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  return 0;
}
