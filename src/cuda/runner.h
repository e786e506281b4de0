// SPDX-License-Identifier: MIT
// The CUDA backend's SequenceRunner: the whole DeepSeek-V4 forward pass on one GPU.
//   weights   uploaded once: linear layers as bf16 (the gemv() kernels; the mHC mixes, router gate and indexer
//             weight projection stay fp32 like the reference), norms / hc / sink / ape fp32, embedding bf16.
//   state     preallocated from max_context with the CPU layout and sizes of model/state.h (window ring,
//             compressed KV, indexer keys, compressor partial states), fp32.
//   forward   a prompt in chunks of CudaRunnerOptions::prefill_chunk tokens (spec 3.11 makes chunking exact;
//             above 64 rows the linear layers run gemv's tiled tensor-core kernel). Every activation lives in
//             preallocated workspaces; only token ids go up and logits come back (every row's logits through a
//             kCudaMaxChunk-row buffer, one synchronisation per 64 rows). Decoding one token allocates nothing and
//             synchronises once (the logits copy).
//   batches   CudaRunnerOptions::sequences independent sequences share the weights, each with its own state;
//             cuda_runner_decode_batch advances sequences 0..B-1 by one token each in one step (one chunk of B
//             rows: every linear layer reads its weights once for the B tokens; the state-bound kernels, i.e.
//             compressors, indexer, attention and window store, run once over all rows, each row reaching its
//             sequence's state through device pointer tables).
//   MTP       a model loaded with its MTP block gets it on the GPU too (layers_[n_layers] plus e_proj / h_proj, its
//             norms and head collapse): each forward keeps its final streams by position, mtp_draft runs the block on
//             the pending pairs (direct launches) and draws its greedy guess on the device.
//   drawing   forward_draw / cuda_runner_decode_batch_draw can draw the next tokens on the device after the lm_head
//             (CudaRunnerOptions::draw_on_device): the draw parameters go up with the tokens, 4 bytes per row come
//             back, all inside the captured decode graph.
#pragma once
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "cuda/gemv.h"
#include "model/runner.h"

namespace dsv4 {

constexpr int kCudaMaxChunk = 64;       // rows of a decode batch, and of the logits buffers
// Default tokens per prefill chunk: each chunk streams the weights of every expert it touches, and the grouped
// experts get more rows per tile (H100, docs/perf.md: 2048 against 512 +17 % at 8K and 32K, 4096 against 2048 +6 %).
// Lowered to fit the GPU's memory (fit_prefill_chunk, logged).
constexpr int kCudaPrefillChunk = 4096;
// With the MTP block: the main model's final streams kept per sequence for it (its mtp_pending() never exceeds this;
// older positions are skipped, which SequenceRunner allows).
constexpr int kMtpRows = kCudaMaxChunk;

struct CudaRunnerOptions {
  // Capture the 1-token decode step (token and position uploads, every kernel, the logits copy) once as a CUDA
  // graph and replay it; positions reach the kernels through device memory. DSV4_CUDA_GRAPH=0 in the
  // environment turns it off (A/B timing).
  bool graph_decode = true;
  // Benchmarks only (dsv4 bench): every linear-layer weight whose Matrix has no data (shape only) is created on
  // the device with random codes of this format (values ~U(-1/sqrt(k), 1/sqrt(k)) once decoded) instead of being
  // uploaded. Small fp32 tensors (norms, mHC, router gate, indexer weights_proj, ape, sinks) still come from the
  // host. The embedding and lm_head are synthetic bf16 when empty.
  std::optional<GemvWeight> synthetic_format;
  uint64_t synthetic_seed = 1;
  // Sequences held, each with its own state sized by max_context (1 .. kCudaMaxChunk).
  int sequences = 1;
  // Tokens per prefill chunk: a multiple of 64 in [64, 4096]. The runner lowers it (logged) so that the routed pairs
  // of a chunk fit moe_slots (kMoeSlotsMaxPairs) and the indexer's score scratch [chunk, max_context / ratio] stays
  // within 256 MiB. Larger chunks read the weights fewer times (each chunk streams every expert it touches).
  int prefill_chunk = kCudaPrefillChunk;
  // forward_draw / cuda_runner_decode_batch_draw draw the next token on the device (gpu::draw_tokens, the host
  // Sampler's contract) and bring back 4 bytes per row instead of the logits. Off: they draw on the host from the
  // logits. DSV4_DEVICE_DRAW=1 / 0 in the environment sets it.
  bool draw_on_device = false;
  // Decode-sized chunks (<= kCudaMaxChunk rows, hc = 4): each mHC post also computes the next sublayer's mix
  // (gpu::hc_post_mix) and hc_pre adds its partials, so the mix kernel no longer runs on its own (86 launches fewer
  // per Flash step). Off until it is measured on a GPU; DSV4_FUSED_MHC=1 / 0 in the environment sets it.
  bool fuse_mhc_mix = false;
  // Decode-sized chunks: the router and moe_slots in one launch (moe_route_and_slots; experts <= 512), 43 launches
  // fewer per Flash step. Off until measured; DSV4_FUSED_ROUTING=1 / 0 sets it.
  bool fuse_moe_routing = false;
  // Decode-sized chunks (< 64 rows, experts <= 512): the router gate, the router and moe_slots in one launch
  // (moe_gate_route_and_slots: the gate's blocks, then the last one to finish routes), two launches fewer per MoE
  // layer on the critical path; the same bits. Takes precedence over fuse_moe_routing. Off: measured 0.9-1 % slower at
  // batch 1, 8 and 32 on the H100 (docs/perf.md sixteenth round); DSV4_FUSED_GATE=1 / 0 sets it.
  bool fuse_moe_gate = false;
  // Each mHC post but a stage's last runs inside the next sublayer's hc_pre (HcPreParams::prev_out: the cluster
  // collapse of decode-sized chunks updates its columns of the streams as it loads them; other chunks launch hc_post
  // first), one launch fewer per sublayer at decode; the same bits. On: +2.2 % at batch 1 on the H100, level at 8
  // and 32 (docs/perf.md sixteenth round); DSV4_FUSED_POST=1 / 0 sets it.
  bool fuse_mhc_post = true;
  // Chunks of at least this many rows: the routed experts' SwiGLU inside the grouped w1 + w3 launch
  // (GemvGroupedParams::swiglu; the same bits). Prefill chunks on the wgmma kernel compute w1 and w3 of the same
  // columns in each block and store only h, so neither projection's fp32 output goes through memory and the SwiGLU
  // has no launch of its own; at decode the register kernel's last block of each slot computes it (one launch fewer,
  // but measured 1.8 % slower at batch 1 and 8 / 13 % at 8 / 32 on the H100: that block computes the slot's pairs
  // alone, docs/perf.md sixteenth round); other kernels are followed by the swiglu launch. Prefill-sized chunks
  // only by default (+2.5 % at 8K and 32K on the H100, docs/perf.md twenty-fourth round); DSV4_FUSED_SWIGLU=1 / 0:
  // every chunk / none.
  int swiglu_in_w1_w3_rows = kCudaMaxChunk + 1;
  // The routed experts' w2 launch reads its slots and issues its first weight loads before it waits for the SwiGLU
  // (GemvGroupedParams::slots_settled; the SwiGLU lets it start only after its own wait, when moe_slots is long
  // done); the same bits. Register kernel only (decode batches below the tiled kernel's rows). Not where the SwiGLU
  // runs inside w1 + w3 (swiglu_in_w1_w3_rows).
  // DSV4_EARLY_W2=1 / 0 sets it.
  bool early_w2_weights = true;
  // Independent chains on a second stream (parallel branches of the captured graph), same arithmetic and results:
  // hc_pre's post + comb (the Sinkhorn) beside each sublayer (hc_pre then runs as two launches: 2 per layer more);
  // in attention blocks with compressors, the compressors, their entry finishing and the indexer's weights_proj
  // beside the q-side projection and the q norms (they meet before the indexer scores); in every FFN whose shared
  // expert is not grouped (group_shared_expert below), the shared expert beside the router and the routed experts
  // (not under act fp8). On: +2.5 % and +3.1 % at batch 1 on the Flash shape (two H100 runs, docs/perf.md); the
  // same bits as one stream. DSV4_OVERLAP=1 / 0 in the environment sets it. Profiled steps run everything on one
  // stream.
  bool overlap_branches = true;
  // Chunks of at least this many rows: the attention kernel applies q's per-head norm and RoPE while it loads q
  // (AttentionParams::q_norm_rope; head dims 512 and 128) instead of a row op that reads and writes all of q first.
  // Same arithmetic as the row op. Prefill-sized chunks only by default: +7 % at 8K on the Flash shape, while decode
  // steps lost ~1 % with it (H100, docs/perf.md). DSV4_FUSED_QNORM=1 / 0: every chunk / none.
  int q_norm_in_attention_rows = kCudaMaxChunk + 1;
  static constexpr int kNever = std::numeric_limits<int>::max();
  // Decided at construction: the shared expert as one more expert of the grouped launches when its shape and
  // encoding match the routed ones' (the default: one launch fewer per projection), or apart, through its own
  // gemvs (which overlap_branches can run beside the routing). DSV4_GROUP_SHARED=0 / 1 sets it.
  bool group_shared_expert = true;
  // MXFP4 / NVFP4 linears in the tile layout on the GPU (GemvLayout::Tiles, cuda/weight_tiles.h: each warp load of
  // the skinny GEMV is contiguous instead of 8 pieces a row apart), permuted at upload; same values, same bits. Act
  // fp8 then quantises x before the bf16-activation kernel (no W4A8 kernel). On: +7 / +10 / +6 % at batch 1 / 8 /
  // 32 on the Flash shape (H100, docs/perf.md fourteenth round); DSV4_GEMV_TILES=0 / 1 in the environment sets it.
  bool fp4_tiles = true;
  // Layers split over GPUs (a pipeline, docs/multi_gpu.md): stage i runs on devices[i] a contiguous range of layers
  // with its own weights, per-sequence state, workspaces and streams, and hands each row's hc·D fp32 streams to the
  // next stage (a peer copy, 64 KB a token for Flash). The first stage holds the embedding, the last the head (and
  // the MTP block, with a copy of the embedding for it). Empty: the current device alone. A device may appear more
  // than once (tests split one GPU). DSV4_CUDA_DEVICES=0,1 in the environment sets it when it is empty.
  std::vector<int> devices;
  // The first layer of each stage after the first: devices.size() - 1 increasing layers in (0, n_layers). Empty:
  // chosen so the stages hold about equal weight bytes (cuda_pipeline_stages).
  std::vector<int> stage_first_layers;
};

// One stage of a runner: layers [layer_begin, layer_end) on `device`; weight_bytes as cuda_memory_need counts them.
struct CudaStage {
  int device = 0, layer_begin = 0, layer_end = 0;
  size_t weight_bytes = 0;
  bool first() const { return layer_begin == 0; }
};
// The stages a runner of `model` makes from options.devices and options.stage_first_layers (host arithmetic, no GPU
// needed; `current_device` is the one stage when devices is empty). Without stage_first_layers the layers are split
// where the running sum of weight bytes (embedding with the first stage, head and MTP block with the last) crosses
// i / stages of the total, every stage keeping at least one layer. Throws dsv4::Error for more stages than layers,
// a negative device, or first layers that are not increasing inside (0, n_layers).
std::vector<CudaStage> cuda_pipeline_stages(const Model& model, const CudaRunnerOptions& options,
                                            int current_device = 0);
// "0,1" -> {0, 1} (--gpus, DSV4_CUDA_DEVICES); throws dsv4::Error for anything but comma-separated ordinals.
std::vector<int> parse_cuda_devices(std::string_view list);

// The prefill chunk a runner settles on (host arithmetic, no GPU needed): `requested` (a multiple of 64 in
// [64, 4096], else throws) lowered to a multiple of 64 so that a chunk's routed pairs (pairs_per_token each) fit
// moe_slots' kMoeSlotsMaxPairs, the indexer's score scratch [chunk, max_entries] fp32 stays within 256 MiB, and no
// chunk is longer than the context rounded up to 64; never below 64.
int cuda_prefill_chunk(int requested, int pairs_per_token, int max_entries, int max_context);

// What a runner needs on the device at least, from the host model alone (no GPU): the linear weights in the
// encodings the runner uploads (a checkpoint's packed bytes, bf16 for fp32 values, the synthetic format for shape-only
// matrices; the embedding and lm_head bf16), the fp32 matrices and vectors, and each sequence's state (window ring,
// compressed KV, indexer keys, compressor partials), and the largest workspaces of a stage (they scale with the
// prefill chunk: the routed pairs' gate / up / down buffers, the streams, the indexer scores, the logits rows): a
// lower bound of what the runner allocates after the upload (CudaRunnerStats::workspace_bytes).
struct CudaMemoryNeed {
  size_t weights = 0, state_per_sequence = 0, workspaces = 0;
  int sequences = 1;
  int prefill_chunk = 0;  // the chunk the workspaces are sized for (cuda_prefill_chunk of the options)
  size_t total() const { return weights + workspaces + state_per_sequence * size_t(sequences); }
};
CudaMemoryNeed cuda_memory_need(const Model& model, int max_context, const CudaRunnerOptions& options);
// The same for the stage holding layers [layer_begin, layer_end): the embedding when layer_begin is 0, the head, final
// norm and MTP block (with its own embedding copy unless layer_begin is 0) when layer_end is n_layers.
CudaMemoryNeed cuda_memory_need(const Model& model, int max_context, const CudaRunnerOptions& options, int layer_begin,
                                int layer_end);
// The check make_cuda_runner does before uploading anything: throws dsv4::Error, with the sizes and what to change,
// when `need` exceeds `free_bytes` (so a checkpoint larger than the GPU fails in a second, not after the upload).
void check_cuda_memory(const CudaMemoryNeed& need, size_t free_bytes, size_t total_bytes, int max_context);
// The prefill chunk make_cuda_runner uses on a GPU with free_bytes: `requested` while need_at(requested) fits, else
// halved (multiples of kCudaMaxChunk, not below kCudaMinFitChunk) until the workspaces fit next to the weights and
// state. Unchanged when the weights and state alone do not fit (check_cuda_memory then says what to change).
constexpr int kCudaMinFitChunk = 512;
int fit_prefill_chunk(int requested, size_t free_bytes, const std::function<CudaMemoryNeed(int chunk)>& need_at);

// Throws dsv4::Error when no CUDA device is usable, the model does not fit its free memory (check_cuda_memory; with
// several stages, each device against the stages it holds) or has a shape the kernels do not support.
std::unique_ptr<SequenceRunner> make_cuda_runner(const Model& model, int max_context, CudaRunnerOptions options = {});

struct CudaRunnerStats {
  int64_t launches_last_forward = 0;  // kernels (or graph replays) enqueued by the last forward() call
  int64_t graph_kernels = 0;          // kernel nodes in the captured decode graph (0 until captured)
  bool last_forward_replayed_graph = false;
  int64_t cublas_linears = 0;         // dense linears run through cuBLASLt so far (prefill chunks of >= 256 rows)
  int64_t side_stream_kernels = 0;    // kernels enqueued on the second stream so far (overlap_branches)
  size_t weight_bytes = 0, workspace_bytes = 0;
  int stages = 1;               // GPUs (pipeline stages) the layers are split over
  int64_t stage_copies = 0;     // streams handed from one stage to the next so far (one per chunk and boundary)
};
// Stats of a runner made by make_cuda_runner (throws for other runners).
CudaRunnerStats cuda_runner_stats(const SequenceRunner& runner);
// The stages of a runner made by make_cuda_runner, weight_bytes as uploaded (throws for other runners).
std::vector<CudaStage> cuda_runner_stages(const SequenceRunner& runner);

// Several sequences on a runner made with options.sequences > 1 (all throw for other runners and bad indices).
// forward() / reset() / n_tokens() act on the selected sequence (0 at construction).
void cuda_runner_select_sequence(SequenceRunner& runner, int sequence);
// tokens[b] is the next token of sequence b (b < tokens.size() <= sequences); returns next-token logits
// [tokens.size(), vocab]. With graph_decode, each batch size is captured once and replayed.
std::vector<float> cuda_runner_decode_batch(SequenceRunner& runner, std::span<const int32_t> tokens);
// The same step, each sequence's next token drawn by draws[b] (formats/token_draw.h): returns the ids
// [tokens.size()] (on the device with CudaRunnerOptions::draw_on_device, else from the logits on the host, the rows
// in parallel: draw_rows).
std::vector<int32_t> cuda_runner_decode_batch_draw(SequenceRunner& runner, std::span<const int32_t> tokens,
                                                   std::span<const TokenDraw> draws);
// Whether forward_draw / cuda_runner_decode_batch_draw draw on the device (CudaRunnerOptions::draw_on_device), and
// switching it (benchmarks: the captured graphs of both kinds are kept apart).
bool cuda_runner_draws_on_device(const SequenceRunner& runner);
void cuda_runner_set_draw_on_device(SequenceRunner& runner, bool on);
// The options the runner holds (after the environment's overrides), and a change of the ones it reads at every
// step: draw_on_device, fuse_mhc_mix, fuse_moe_routing, fuse_moe_gate, fuse_mhc_post, swiglu_in_w1_w3_rows,
// early_w2_weights, overlap_branches and q_norm_in_attention_rows (the others of `switches` are ignored). Drops the
// captured decode graphs. For A/B timing in one process (dsv4 bench --switches).
CudaRunnerOptions cuda_runner_options(const SequenceRunner& runner);
void cuda_runner_set_step_switches(SequenceRunner& runner, const CudaRunnerOptions& switches);
// The MTP block (a runner of a model loaded with it) on the selected sequence's next next_tokens.size() pending pairs,
// as mtp_draft feeds them, returning their logits [n, vocab] instead of a guess (tests).
std::vector<float> cuda_runner_mtp_logits(SequenceRunner& runner, std::span<const int32_t> next_tokens);
// Sequence `to` becomes a copy of sequence `from` (state and length), on the device (benchmarks: B sequences at
// one context without B prefills).
void cuda_runner_copy_sequence(SequenceRunner& runner, int from, int to);

// Destroys the captured decode graphs; the next decode steps capture anew (graphs keep the launch modes they were
// captured with: gpu::set_dependent_launch).
void cuda_runner_drop_graphs(SequenceRunner& runner);

// One launch site of a profiled decode step: `kernels` kernels enqueued together, `us` the GPU time from the
// previous site's end to this one's (CUDA events; the launch gap is included, host launch time is not).
struct LaunchTiming {
  std::string site;  // e.g. "attn: attention", "ffn: grouped gemv w1"
  int layer = -1;    // -1 outside the layers (embedding, head)
  int kernels = 1;
  double us = 0;
};
// Decodes one step with direct launches (no graph) and an event after every launch site, for dsv4 bench
// --profile: one token advances the selected sequence like forward({token}, true), more advance sequences
// 0..n-1 like cuda_runner_decode_batch; with CudaRunnerOptions::draw_on_device the step also draws its tokens on the
// device (temperature 1), so the draw is one of the sites. Throws for non-CUDA runners.
std::vector<LaunchTiming> cuda_runner_profile_step(SequenceRunner& runner, std::span<const int32_t> tokens);
// The same for a prefill of `tokens` on the selected sequence (its chunks as forward(tokens, true) runs them).
std::vector<LaunchTiming> cuda_runner_profile_prefill(SequenceRunner& runner, std::span<const int32_t> tokens);
// Tokens per prefill chunk the runner settled on (CudaRunnerOptions::prefill_chunk after its limits).
int cuda_runner_prefill_chunk(const SequenceRunner& runner);

}  // namespace dsv4
