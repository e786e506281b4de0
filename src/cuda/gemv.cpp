// SPDX-License-Identifier: MIT
// Host side of the skinny GEMM: argument checks (messages name the field and what was expected), the split-k
// heuristic, and error reporting. The kernels are in gemv.cu.
#include "cuda/gemv.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "core/env.h"
#include "cuda/cuda_check.h"
#include "cuda/device.h"
#include "cuda/gemv_launch.h"
#include "cuda/switches.h"
#include "spdlog/spdlog.h"

namespace dsv4 {
namespace {


bool aligned(const void* p, uintptr_t a) { return reinterpret_cast<uintptr_t>(p) % a == 0; }

// m > kGemvMaxM without the tiled kernel (FP8 block weights with f32 scales): the skinny kernel on 64-row pieces.
bool untiled_rows(const GemvParams& p) {
  if (p.m <= kGemvMaxM || detail::gemv_tiled_supported(p)) return false;
  static bool logged = false;
  if (!logged) {
    logged = true;
    spdlog::info("gemv: fp8_block weights with f32 scales run m = {} rows as skinny 64-row pieces (the tiled "
                 "tensor-core kernel covers the other formats)", p.m);
  }
  return true;
}

// fn(piece) for the rows of p in pieces of kGemvMaxM, each with x and y advanced to its first row (y keeps p's row
// stride).
template <class Fn>
void for_row_pieces(const GemvParams& p, Fn&& fn) {
  const int64_t ldy = p.ldy ? p.ldy : p.n, y_bytes = p.out == GemvOut::BF16 ? 2 : 4;
  for (int r0 = 0; r0 < p.m; r0 += kGemvMaxM) {
    GemvParams piece = p;
    piece.m = std::min(kGemvMaxM, p.m - r0);
    piece.x = static_cast<const uint16_t*>(p.x) + int64_t(r0) * p.k;
    piece.y = static_cast<char*>(p.y) + int64_t(r0) * ldy * y_bytes;
    piece.ldy = ldy;
    fn(piece);
  }
}

int forced_split = 0;  // set_gemv_forced_split

// The split_k of a launch: the caller's, else the tests' forced one, else the heuristic for `shape` (all the rows
// that share the grid).
int launch_split(int requested, const GemvParams& shape) {
  return requested ? requested : forced_split ? forced_split : gemv_default_split_k(shape, current_sm_count());
}

// The weight stream of fp4 / fp8 skinny launches (a GemvBulk, set_gemv_bulk); -1 = not yet read from the environment.
int bulk_mode = -1;
int w4a8_mode = -1;  // set_gemv_w4a8; -1 = not yet read from the environment

// Says once which kernel streams fp4 / fp8 weights, and once when the copy-engine kernel was asked for but cannot
// take a call (the register kernel runs it and every later call like it).
void note_bulk_choice(const GemvParams& p, bool taken, bool grouped = false) {
  if (p.weight == GemvWeight::BF16 || p.m > kGemvMaxM || !gemv_bulk_enabled()) return;
  if (grouped && gemv_bulk_mode() == GemvBulk::Dense) return;  // the register kernel by choice
  if (detail::gemv_w4a8_supported(p)) taken = detail::gemv_w4a8_bulk_supported(p);  // the W4A8 kernel's own variant
  static bool said_taken = false, said_not = false;
  if (taken && !said_taken) {
    said_taken = true;
    spdlog::info("gemv: fp4 / fp8 weights stream through the copy engine (DSV4_GEMV_BULK / set_gemv_bulk)");
  } else if (!taken && !said_not) {
    said_not = true;
    spdlog::info("gemv: the copy-engine kernel cannot take {} n = {} k = {} (needs k a multiple of 512 for fp4 or "
                 "256 for fp8, and 16-byte aligned weights, fp4 scales and expert strides); the register kernel runs "
                 "it and others like it",
                 gemv_weight_name(p.weight), p.n, p.k);
  }
}

}  // namespace

void set_gemv_bulk(GemvBulk mode) { bulk_mode = int(mode); }

void set_gemv_forced_split(int split) {
  DSV4_CHECK(split == 0 || (split > 0 && split <= detail::kGemvWarps && (split & (split - 1)) == 0),
             "set_gemv_forced_split: {} is not 0 or a power of two up to {}", split, detail::kGemvWarps);
  forced_split = split;
}

void set_gemv_w4a8(bool on) { w4a8_mode = on ? 1 : 0; }

namespace {
int tiled_min_rows = -1;  // set_gemv_tiled_min_rows; -1 = not yet read from the environment
int tiled_min_blocks_per_sm = kGemvTiledMinBlocksPerSm;
int clamp_tiled_min_rows(int rows) { return std::clamp(rows, 2, kGemvMaxM + 1); }
}  // namespace

void set_gemv_tiled_min_rows(int rows, int min_blocks_per_sm) {
  DSV4_CHECK(min_blocks_per_sm >= 0, "set_gemv_tiled_min_rows: min_blocks_per_sm = {} is negative", min_blocks_per_sm);
  tiled_min_rows = clamp_tiled_min_rows(rows);
  tiled_min_blocks_per_sm = min_blocks_per_sm;
}

int gemv_tiled_min_blocks_per_sm() { return tiled_min_blocks_per_sm; }

int gemv_tiled_min_rows() {
  if (tiled_min_rows < 0) {
    const char* v = std::getenv("DSV4_GEMV_TILED_MIN_M");
    tiled_min_rows = clamp_tiled_min_rows(v && *v ? std::atoi(v) : kGemvTiledMinRowsDefault);
    if (tiled_min_rows != kGemvTiledMinRowsDefault)
      spdlog::info("gemv: the tiled tensor-core kernel runs from m = {} rows (DSV4_GEMV_TILED_MIN_M)", tiled_min_rows);
  }
  return tiled_min_rows;
}

int wgmma_mode = -1;  // set_gemv_wgmma; -1 = not yet read from the environment

void set_gemv_wgmma(bool on) { wgmma_mode = on ? 1 : 0; }

bool gemv_wgmma_enabled() {
  if (wgmma_mode < 0) wgmma_mode = env_switch("DSV4_GEMV_WGMMA").value_or(kGemvWgmmaDefault) ? 1 : 0;
  if (wgmma_mode == 0) return false;
  if (current_cc_major() == 9) return true;
  static bool logged = false;
  if (!logged) {
    logged = true;
    spdlog::info("gemv: no wgmma on compute capability {}.x: fp4 weights in 64-row tiles run the mma.sync kernel",
                 current_cc_major());
  }
  return false;
}

int wgmma_ws_mode = -1;  // set_gemv_wgmma_ws; -1 = not yet read from the environment

void set_gemv_wgmma_ws(bool on) { wgmma_ws_mode = on ? 1 : 0; }

// A process-wide switch: *mode from `variable` (else `fallback`) at the first call, logged when that is not the
// default; set_* calls overwrite *mode.
static bool switch_enabled(int& mode, const char* variable, bool fallback, const char* what) {
  if (mode < 0) {
    mode = env_switch(variable).value_or(fallback) ? 1 : 0;
    if (mode != int(fallback)) spdlog::info("gemv: {} {} ({})", what, mode ? "on" : "off", variable);
  }
  return mode == 1;
}

bool gemv_wgmma_ws_enabled() {
  return switch_enabled(wgmma_ws_mode, "DSV4_GEMV_WGMMA_WS", kGemvWgmmaWsDefault,
                        "the wgmma kernel's warp-specialised form");
}

int wgmma_persistent_mode = -1;  // set_gemv_wgmma_persistent; -1 = not yet read from the environment

void set_gemv_wgmma_persistent(bool on) { wgmma_persistent_mode = on ? 1 : 0; }

bool gemv_wgmma_persistent_enabled() {
  return switch_enabled(wgmma_persistent_mode, "DSV4_GEMV_WGMMA_PERSISTENT", kGemvWgmmaPersistentDefault,
                        "the warp-specialised wgmma kernel's persistent blocks");
}

bool gemv_over_gemm = true;  // set_gemv_over_gemm

void set_gemv_over_gemm(bool on) { gemv_over_gemm = on; }

bool gemv_beats_decode_and_gemm(const GemvParams& p) {
  if (!gemv_over_gemm) return false;
  const bool fp4 = p.weight == GemvWeight::NVFP4 || p.weight == GemvWeight::MXFP4;
  if (!fp4 || p.act != GemvAct::BF16 || p.m <= kGemvMaxM || p.m >= 1024) return false;
  if (!gemv_wgmma_enabled() || !gemv_wgmma_ws_enabled()) return false;
  return detail::gemv_wgmma_rule_shape(p.m, p.n, 1) != 0;
}

namespace detail {

int wgmma_shape = -1;
int wgmma_walk_blocks = 0;

int wgmma_forced_shape() {
  if (wgmma_shape < 0) {
    const char* shape = std::getenv("DSV4_GEMV_WGMMA_SHAPE");
    wgmma_shape = shape && *shape ? std::clamp(std::atoi(shape), 0, 5) : 0;
    if (wgmma_shape)
      spdlog::info("gemv: the wgmma kernel's block shape forced to {} (DSV4_GEMV_WGMMA_SHAPE)", wgmma_shape);
  }
  return wgmma_shape;
}

}  // namespace detail

bool gemv_w4a8_enabled() {
  if (w4a8_mode < 0) w4a8_mode = env_switch("DSV4_GEMV_W4A8").value_or(kGemvW4a8Default) ? 1 : 0;
  return w4a8_mode == 1;
}

GemvBulk gemv_bulk_mode() {
  if (bulk_mode < 0) {
    const char* v = std::getenv("DSV4_GEMV_BULK");
    bulk_mode = int(v && std::string_view(v) == "dense"        ? GemvBulk::Dense
                    : env_switch("DSV4_GEMV_BULK").value_or(false) ? GemvBulk::All
                                                                   : GemvBulk::Off);
  }
  return GemvBulk(bulk_mode);
}

int gemv_k_multiple(GemvWeight w) {
  switch (w) {
    case GemvWeight::BF16: return 8;
    case GemvWeight::FP8_BLOCK: return 16;
    case GemvWeight::MXFP4:
    case GemvWeight::NVFP4: return 32;
  }
  return 1;
}

bool gemv_tiles_fit(GemvWeight w, int64_t n, int64_t k) {
  return (w == GemvWeight::MXFP4 || w == GemvWeight::NVFP4) && n % 16 == 0 && k % 128 == 0;
}

const char* gemv_weight_name(GemvWeight w) {
  switch (w) {
    case GemvWeight::BF16: return "bf16";
    case GemvWeight::FP8_BLOCK: return "fp8_block";
    case GemvWeight::MXFP4: return "mxfp4";
    case GemvWeight::NVFP4: return "nvfp4";
  }
  return "?";
}

int64_t gemv_weight_bytes(GemvWeight w, int64_t n, int64_t k) {
  switch (w) {
    case GemvWeight::BF16: return n * k * 2;
    case GemvWeight::FP8_BLOCK: return n * k;
    case GemvWeight::MXFP4:
    case GemvWeight::NVFP4: return n * k / 2;
  }
  return 0;
}

int64_t gemv_scale_bytes(GemvWeight w, int64_t n, int64_t k, GemvScale fp8_scale) {
  switch (w) {
    case GemvWeight::BF16: return 0;
    case GemvWeight::FP8_BLOCK: return (n + 127) / 128 * ((k + 127) / 128) * (fp8_scale == GemvScale::F32 ? 4 : 1);
    case GemvWeight::MXFP4: return n * (k / 32);
    case GemvWeight::NVFP4: return n * (k / 16);
  }
  return 0;
}

int gemv_default_split_k(const GemvParams& p, int sm_count) {
  // From the split sweeps of dsv4_gemv_bench (docs/perf.md): a warp wants at least 16 chunks of k to itself
  // (4 load groups; 32 for fp4 weights, whose grouped expert launches ran 2-6 % faster at split 1 than 2 with 32
  // chunks per warp; 64 when m > 16, where each chunk carries more arithmetic), then the grid wants at least one
  // block per multiprocessor, and no warp may be left without a chunk.
  const int64_t tiles = (int64_t(p.n) + 15) / 16;
  const bool fp4 = p.weight == GemvWeight::MXFP4 || p.weight == GemvWeight::NVFP4;
  const int per_chunk = p.weight == GemvWeight::BF16 ? 32 : p.weight == GemvWeight::FP8_BLOCK ? 64 : 128;
  const int n_chunks = (p.k + per_chunk - 1) / per_chunk;
  const int min_chunks_per_warp = p.m > 16 ? 64 : fp4 ? 32 : 16;
  auto blocks = [&](int split) { return (tiles * split + detail::kGemvWarps - 1) / detail::kGemvWarps; };
  int split = detail::kGemvWarps;
  while (split > 1 && n_chunks < min_chunks_per_warp * split) split /= 2;
  while (split < detail::kGemvWarps && blocks(split) < sm_count) split *= 2;
  while (split > 1 && n_chunks < split) split /= 2;
  return split;
}

namespace {

// Checks every field of p; returns false when there is nothing to do (m == 0 or n == 0).
bool check_gemv_params(const GemvParams& p, const char* what) {
  const char* fmt_name = gemv_weight_name(p.weight);
  DSV4_CHECK(p.m >= 0 && p.m <= kGemvMaxRows, "{}: m = {} is outside [0, {}]", what, p.m, kGemvMaxRows);
  DSV4_CHECK(p.n >= 0 && p.k > 0, "{}: expected n >= 0 and k > 0, got n = {}, k = {}", what, p.n, p.k);
  DSV4_CHECK(p.k % gemv_k_multiple(p.weight) == 0, "{} ({}): k = {} must be a multiple of {}", what, fmt_name, p.k,
             gemv_k_multiple(p.weight));
  DSV4_CHECK(p.w_row0 >= 0 && (p.weight != GemvWeight::FP8_BLOCK || p.w_row0 % 16 == 0),
             "{}: w_row0 = {} must be >= 0 (and a multiple of 16 for fp8_block)", what, p.w_row0);
  DSV4_CHECK(p.ldy == 0 || p.ldy >= p.n, "{}: ldy = {} is smaller than n = {}", what, p.ldy, p.n);
  if (p.m == 0 || p.n == 0) return false;
  DSV4_CHECK(p.x && p.w && p.y, "{} ({}): x, w and y must be device pointers, got x={} w={} y={}", what, fmt_name,
             p.x, p.w, p.y);
  DSV4_CHECK(p.weight == GemvWeight::BF16 || p.w_scale, "{} ({}): w_scale is required", what, fmt_name);
  DSV4_CHECK(aligned(p.x, 16) && aligned(p.w, 16), "{} ({}): x and w must be 16-byte aligned", what, fmt_name);
  DSV4_CHECK(p.weight != GemvWeight::NVFP4 || aligned(p.w_scale, 2), "{} (nvfp4): w_scale must be 2-byte aligned",
             what);
  DSV4_CHECK(p.weight != GemvWeight::FP8_BLOCK || p.fp8_scale != GemvScale::F32 || aligned(p.w_scale, 4),
             "{} (fp8_block): f32 w_scale must be 4-byte aligned", what);
  DSV4_CHECK(p.layout == GemvLayout::Rows || (gemv_tiles_fit(p.weight, p.n, p.k) && p.w_row0 % 16 == 0),
             "{} ({}): the tile layout needs mxfp4 / nvfp4 weights, n and w_row0 multiples of 16 and k a multiple of "
             "128 (got n = {}, w_row0 = {}, k = {})", what, fmt_name, p.n, p.w_row0, p.k);
  DSV4_CHECK(p.split_k == 0 || p.split_k == 1 || p.split_k == 2 || p.split_k == 4 || p.split_k == 8,
             "{}: split_k = {} must be 0 (auto), 1, 2, 4 or 8", what, p.split_k);
  return true;
}

// act FP8 outside the W4A8 kernel: quantise `rows` rows of x into act_scratch and return the params that read it.
GemvParams with_quantised_x(const GemvParams& p, int rows, const char* what) {
  if (p.act != GemvAct::FP8 || detail::gemv_w4a8_supported(p)) return p;
  DSV4_CHECK(p.act_scratch && aligned(p.act_scratch, 16),
             "{} ({}, m = {}): act fp8 needs a 16-byte aligned act_scratch here (only m = 1 with fp4 weights "
             "quantises inside the kernel)", what, gemv_weight_name(p.weight), p.m);
  DSV4_CHECK(rows >= 0, "{}: x_rows = {} must be set for act fp8", what, rows);
  DSV4_CUDA_CHECK(detail::act_quant_launch(static_cast<const uint16_t*>(p.x), static_cast<uint16_t*>(p.act_scratch),
                                           rows, p.k, p.stream));
  GemvParams q = p;
  q.x = p.act_scratch;
  return q;
}

}  // namespace

bool gemv_uses_w4a8(const GemvParams& p) { return detail::gemv_w4a8_supported(p); }

void act_quant_fp8(const void* x, void* y, int rows, int k, cudaStream_t stream) {
  DSV4_CHECK(rows >= 0 && k > 0 && (rows == 0 || (x && y)), "act_quant_fp8: rows = {}, k = {}, x={} y={}", rows, k,
             x, y);
  DSV4_CUDA_CHECK(detail::act_quant_launch(static_cast<const uint16_t*>(x), static_cast<uint16_t*>(y), rows, k,
                                           stream));
}

void gemv(const GemvParams& p) {
  if (!check_gemv_params(p, "gemv")) return;
  const GemvParams q = with_quantised_x(p, p.m, "gemv");
  if (untiled_rows(q)) {
    for_row_pieces(q, [](GemvParams piece) {
      piece.act = GemvAct::BF16;  // x is quantised already
      gemv(piece);
    });
    return;
  }
  const int split = launch_split(q.split_k, q);
  note_bulk_choice(q, detail::gemv_bulk_supported(q));
  DSV4_CUDA_CHECK(detail::gemv_launch(q, split));
}

void gemv_batched(const GemvBatchedParams& b) {
  if (!check_gemv_params(b.base, "gemv_batched") || b.batch == 0) return;
  DSV4_CHECK(b.base.act == GemvAct::BF16, "gemv_batched: act must be bf16 (got fp8)");
  DSV4_CHECK(b.batch > 0 && b.batch <= 65535, "gemv_batched: batch = {} is outside [0, 65535]", b.batch);
  DSV4_CHECK(b.base.weight != GemvWeight::FP8_BLOCK || b.base.n % 16 == 0,
             "gemv_batched (fp8_block): n = {} must be a multiple of 16 (each batch starts a 16-row tile)", b.base.n);
  DSV4_CHECK(b.x_batch_stride >= 0 && b.x_batch_stride % 8 == 0,
             "gemv_batched: x_batch_stride = {} must be >= 0 and keep x 16-byte aligned (a multiple of 8)",
             b.x_batch_stride);
  DSV4_CHECK(b.y_batch_stride >= 0, "gemv_batched: y_batch_stride = {} must be >= 0", b.y_batch_stride);
  if (untiled_rows(b.base)) {  // each batch's rows in the same pieces (x rows at the same offset in every batch)
    for_row_pieces(b.base, [&](const GemvParams& rows) {
      GemvBatchedParams piece = b;
      piece.base = rows;
      gemv_batched(piece);
    });
    return;
  }
  // The split is chosen for all batches' rows together: they share the grid.
  GemvParams whole = b.base;
  whole.n = b.base.n * b.batch;
  const int split = launch_split(b.base.split_k, whole);
  note_bulk_choice(b.base, detail::gemv_bulk_supported(b.base));
  DSV4_CUDA_CHECK(detail::gemv_batched_launch(b, split));
}

bool gemv_grouped_reads_slots_early(const GemvGroupedParams& g) {
  const detail::GroupedKernel kernel = detail::grouped_kernel(g);
  return kernel == detail::GroupedKernel::Register || kernel == detail::GroupedKernel::Bulk;
}

int gemv_grouped(const GemvGroupedParams& g) {
  if (!check_gemv_params(g.base, "gemv_grouped") || g.max_slots == 0) return 0;
  DSV4_CHECK(g.max_slots > 0 && g.max_slots <= 65535, "gemv_grouped: max_slots = {} is outside [0, 65535]",
             g.max_slots);
  DSV4_CHECK(g.slots.count && g.slots.expert && g.slots.offset && g.slots.row_order,
             "gemv_grouped: slots.count, expert, offset and row_order must be device pointers");
  DSV4_CHECK(g.x_row_div > 0, "gemv_grouped: x_row_div = {} must be positive", g.x_row_div);
  DSV4_CHECK(g.w_expert_stride % 16 == 0, "gemv_grouped: w_expert_stride = {} must keep 16-byte alignment",
             g.w_expert_stride);
  DSV4_CHECK(g.base.weight != GemvWeight::NVFP4 || g.scale_expert_stride % 2 == 0,
             "gemv_grouped (nvfp4): scale_expert_stride = {} must be even", g.scale_expert_stride);
  DSV4_CHECK(g.base.weight != GemvWeight::FP8_BLOCK || g.base.fp8_scale != GemvScale::F32 ||
                 g.scale_expert_stride % 4 == 0,
             "gemv_grouped (fp8_block): f32 scale_expert_stride = {} must be a multiple of 4", g.scale_expert_stride);
  if (g.second.w)
    DSV4_CHECK(g.second.y && aligned(g.second.w, 16) && (g.base.weight == GemvWeight::BF16 || g.second.w_scale),
               "gemv_grouped: the second projection needs y, 16-byte aligned w and (unless bf16) w_scale");
  const gpu::SwigluParams& sw = g.swiglu;
  if (sw.h)
    DSV4_CHECK(g.second.w && g.base.out == GemvOut::F32 && sw.gate == g.base.y && sw.up == g.second.y &&
                   sw.ld == (g.base.ldy ? g.base.ldy : g.base.n) && sw.inter == g.base.n && sw.rows > 0 &&
                   g.slot_tickets,
               "gemv_grouped: the swiglu must read the fp32 outputs of both projections (ld = their row stride, "
               "inter = n) and needs slot tickets");
  // After a kernel that did not compute it: the SwiGLU's own launch.
  auto finish = [&](bool swiglu_done) {
    if (!sw.h || swiglu_done) return 1;
    gpu::swiglu(sw, g.base.stream);
    return 2;
  };
  // The split is chosen for all active matrices together (slots x projections share the grid): at decode, 7
  // slots x 2 projections already fill the GPU at split 1, which dsv4_gemv_bench measured 1.15-1.45x faster for
  // fp4 than the split 8 one expert alone would take (docs/perf.md).
  GemvParams all = g.base;
  const int active = g.active_slots_hint > 0 ? std::min(g.active_slots_hint, g.max_slots) : g.max_slots;
  all.n = int(std::min<int64_t>(int64_t(g.base.n) * active * (g.second.w ? 2 : 1), 1 << 30));
  const int split = launch_split(g.base.split_k, all);
  if (g.base.act == GemvAct::FP8 && !detail::gemv_w4a8_supported(g.base)) {
    DSV4_CHECK(g.x_rows > 0, "gemv_grouped: act fp8 without the W4A8 kernel needs x_rows (got {})", g.x_rows);
    GemvGroupedParams q = g;
    q.base = with_quantised_x(g.base, g.x_rows, "gemv_grouped");
    note_bulk_choice(q.base, detail::gemv_bulk_grouped_supported(q), true);
    bool done = false;
    DSV4_CUDA_CHECK(detail::gemv_grouped_launch(q, split, &done));
    return finish(done);
  }
  note_bulk_choice(g.base, detail::gemv_bulk_grouped_supported(g), true);
  bool done = false;
  DSV4_CUDA_CHECK(detail::gemv_grouped_launch(g, split, &done));
  return finish(done);
}

namespace {
std::atomic<int> slots_by_warps_mode{-1};  // set_moe_slots_by_warps; -1 = not yet read from the environment
}

void set_moe_slots_by_warps(bool on) { slots_by_warps_mode.store(on ? 1 : 0, std::memory_order_relaxed); }

bool moe_slots_by_warps() {
  return gpu::read_once(slots_by_warps_mode, "DSV4_MOE_SLOTS_BY_WARPS", 0, 1, "moe_slots: pairs placed by one warp",
                        true) == 1;
}

void moe_slots(const MoeSlotsParams& p) {
  const int pairs = p.n * (p.k + (p.shared_expert >= 0 ? 1 : 0));
  DSV4_CHECK(p.n >= 0 && p.k > 0 && p.experts > 0 && p.experts <= 4096 && pairs <= kMoeSlotsMaxPairs,
             "moe_slots: n = {}, k = {}, experts = {} (experts in [1, 4096], pairs at most {})", p.n, p.k, p.experts,
             kMoeSlotsMaxPairs);
  DSV4_CHECK(p.shared_expert < p.experts, "moe_slots: shared_expert {} is not one of the {} experts", p.shared_expert,
             p.experts);
  DSV4_CHECK(p.ids && p.slots.count && p.slots.expert && p.slots.offset && p.slots.row_order,
             "moe_slots: every pointer must be a device pointer");
  DSV4_CHECK(p.shared_expert < 0 || (p.weights && p.pair_weights),
             "moe_slots: a shared expert needs weights and pair_weights");
  DSV4_CUDA_CHECK(detail::moe_slots_launch(p, moe_slots_by_warps()));
}

namespace {

// What the one-block router + placement (moe_route_and_slots and the fused gate) needs of its params.
void check_route_and_slots(const gpu::RouterParams& r, const MoeSlotsParams& p, const char* what) {
  DSV4_CHECK(r.n >= 1 && r.n <= 64, "{}: {} tokens (a decode step: 1 .. 64)", what, r.n);
  DSV4_CHECK(r.k > 0 && r.k <= 16 && r.k <= r.experts && r.experts <= 512,
             "{}: {} of {} experts per token (at most 16 of 512)", what, r.k, r.experts);
  DSV4_CHECK(p.ids == r.ids && p.n == r.n && p.k == r.k && (p.shared_expert < 0 || p.weights == r.weights),
             "{}: the slots must place the router's picks", what);
  DSV4_CHECK(p.experts > 0 && p.experts <= 4096 && p.shared_expert < p.experts, "{}: {} expert slots, shared expert {}",
             what, p.experts, p.shared_expert);
  DSV4_CHECK(r.logits && r.ids && r.weights && p.slots.count && p.slots.expert && p.slots.offset && p.slots.row_order,
             "{}: every pointer must be a device pointer", what);
  DSV4_CHECK(!r.tid2eid || r.tokens, "{}: hash routing needs the token ids", what);
  DSV4_CHECK(p.shared_expert < 0 || p.pair_weights, "{}: a shared expert needs pair_weights", what);
}

}  // namespace

void moe_route_and_slots(const gpu::RouterParams& r, const MoeSlotsParams& p) {
  check_route_and_slots(r, p, "moe_route_and_slots");
  DSV4_CUDA_CHECK(detail::moe_route_and_slots_launch(r, p));
}

bool moe_gate_fits(const gpu::LinearF32Params& gate) {
  auto aligned16 = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  return gate.m >= 1 && gate.m <= kMoeGateMaxTokens && gate.n >= 1 && gate.n <= 512 && gate.k > 0 &&
         gate.k % 4 == 0 && aligned16(gate.x) && aligned16(gate.w);
}

void moe_gate_route_and_slots(const gpu::LinearF32Params& gate, const gpu::RouterParams& r, const MoeSlotsParams& p,
                              uint32_t* ticket) {
  DSV4_CHECK(moe_gate_fits(gate), "moe_gate_route_and_slots: gate of {} x {} x {} (needs 1 .. {} tokens, <= 512 "
             "experts, k % 4 == 0, 16-byte aligned x and W)", gate.m, gate.n, gate.k, kMoeGateMaxTokens);
  DSV4_CHECK(gate.y == r.logits && gate.m == r.n && gate.n == r.experts && ticket,
             "moe_gate_route_and_slots: the router must read the gate's logits, and a ticket is needed");
  check_route_and_slots(r, p, "moe_gate_route_and_slots");
  DSV4_CUDA_CHECK(detail::moe_gate_launch(gate, r, p, ticket));
}

}  // namespace dsv4
