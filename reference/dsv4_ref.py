"""dsv4_ref: a plain PyTorch transcription of the DeepSeek-V4 forward pass (shared/spec/dsv4-architecture.md
sections 2-4) for tiny checkpoints, written from the spec and NOT calling transformers' modules.

Full-sequence (prefill) forward only: `forward(model, ids)` returns next-token logits for every position
(causal); greedy decoding re-runs the full forward. Because a prefill of S tokens must equal S decode steps
(spec 3.11), this is also the oracle for the engine's incremental path.

Numerics (class Numerics):
  dtype         torch.float32 (the engine's arithmetic) or torch.float64 (to measure fp32 rounding).
                No bf16 rounding of activations anywhere; weights are used as stored.
  kv_dtype      'f32' | 'bf16' | 'fp8'. fp8: every KV vector written to a cache (window kv after kv_norm+RoPE,
                each compressed main-KV entry after norm+RoPE) gets FP8sim_64 on its nope dims and bf16
                rounding on its rope dims (spec 3.3, 3.5, 8.1). bf16: whole vector to bf16.
  indexer_dtype 'f32' | 'bf16' | 'fp4'. fp4: indexer queries (after RoPE) and indexer-compressor entries
                (after norm+RoPE) are rotated by the orthonormal Sylvester Hadamard matrix, then FP4sim_32
                (spec 3.6, 8.1). bf16: q and k rounded to bf16, no rotation.
Indexer top-k ties: higher score first, equal scores -> lower entry index first (stable descending sort).
The shared expert gets the SwiGLU clamp too (official current revision, spec 4.2).

Usage as a library: `m = load("tests/data/golden/tiny-flash")`, `forward(m, ids, Numerics(...))`.
`python3 reference/dsv4_ref.py --selftest` checks the rounding helpers against torch's own casts.
"""
import glob
import json
import math
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from names import split_fused  # noqa: E402

SWA, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"


# ----------------------------------------------------------------------------------------------------------
# Configuration
class Config:
    """The hyper-parameters the forward pass reads, from a transformers-written config.json (or legacy keys)."""

    def __init__(self, d):
        self.vocab = d["vocab_size"]
        self.dim = d["hidden_size"]
        self.n_layers = d["num_hidden_layers"]
        self.n_heads = d["num_attention_heads"]
        self.head_dim = d["head_dim"]
        self.rope_dim = d.get("qk_rope_head_dim") or int(self.head_dim * d["partial_rotary_factor"])
        self.q_lora = d["q_lora_rank"]
        self.o_groups = d["o_groups"]
        self.o_lora = d["o_lora_rank"]
        self.window = d["sliding_window"]
        if d.get("layer_types"):
            self.layer_types = list(d["layer_types"])
        else:
            self.layer_types = [{0: SWA, 4: CSA, 128: HCA}[r] for r in d["compress_ratios"][: self.n_layers]]
        rates = d.get("compress_rates") or {CSA: 4, HCA: 128}
        self.ratios = [0 if t == SWA else rates[t] for t in self.layer_types]
        if d.get("mlp_layer_types"):
            self.hash_layer = [t == "hash_moe" for t in d["mlp_layer_types"]]
        else:
            self.hash_layer = [i < d.get("num_hash_layers", 0) for i in range(self.n_layers)]
        self.index_heads = d["index_n_heads"]
        self.index_dim = d["index_head_dim"]
        self.index_topk = d["index_topk"]
        self.n_experts = d["n_routed_experts"]
        self.top_k = d["num_experts_per_tok"]
        self.norm_topk = d.get("norm_topk_prob", True)
        self.route_scale = d["routed_scaling_factor"]
        self.swiglu_limit = d["swiglu_limit"]
        self.hc = d["hc_mult"]
        self.sinkhorn_iters = d["hc_sinkhorn_iters"]
        self.hc_eps = d["hc_eps"]
        self.eps = d["rms_norm_eps"]
        assert d.get("scoring_func", "sqrtsoftplus") == "sqrtsoftplus"
        assert d.get("n_shared_experts", 1) == 1
        rp = d.get("rope_parameters") or {}
        if isinstance(rp.get("main"), dict):
            main, comp = rp["main"], rp["compress"]
        else:  # legacy flat keys
            main = {"rope_theta": d.get("rope_theta", 10000.0)}
            comp = dict(d.get("rope_scaling") or {}, rope_theta=d.get("compress_rope_theta", 160000.0))
        self.main_theta = main["rope_theta"]
        self.comp_theta = comp["rope_theta"]
        self.yarn = comp.get("rope_type", comp.get("type")) == "yarn"
        if self.yarn:
            self.yarn_factor = comp["factor"]
            self.yarn_orig = comp["original_max_position_embeddings"]
            self.beta_fast = comp.get("beta_fast", 32)
            self.beta_slow = comp.get("beta_slow", 1)


class Model:
    def __init__(self, cfg, w):
        self.cfg, self.w = cfg, w


def load(path):
    """Loads config.json and every *.safetensors in `path` (any of the three namings, see names.py)."""
    from safetensors.torch import load_file

    with open(os.path.join(path, "config.json")) as f:
        cfg = Config(json.load(f))
    w = {}
    for file in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        for name, t in load_file(file).items():
            for k, v in split_fused(name, t).items():
                assert k not in w, f"duplicate tensor {k} in {path}"
                w[k] = v
    _take_mtp_block(cfg, w)
    model = Model(cfg, w)
    _check_inventory(model)
    return model


_MTP_OWN = ("e_proj.weight", "h_proj.weight", "enorm.weight", "hnorm.weight", "norm.weight", "hc_head_fn",
            "hc_head_base", "hc_head_scale")


def _take_mtp_block(cfg, w):
    """The MTP block ("mtp.0.*", spec 5) becomes layer n_layers (sliding window, gated MoE) and its own tensors
    "mtp.<name>"; cfg.has_mtp tells whether the checkpoint has one."""
    cfg.has_mtp = any(k.startswith("mtp.0.") for k in w)
    if not cfg.has_mtp:
        return
    for lst in (cfg.layer_types, cfg.ratios, cfg.hash_layer):  # configs may list the MTP block already
        del lst[cfg.n_layers:]
    for k in [k for k in w if k.startswith("mtp.0.")]:
        rest = k[len("mtp.0."):]
        w[("mtp." if rest in _MTP_OWN else f"layers.{cfg.n_layers}.") + rest] = w.pop(k)
    cfg.layer_types.append(SWA)
    cfg.ratios.append(0)
    cfg.hash_layer.append(False)


def _check_inventory(model):
    """Every tensor the forward reads exists, and every stored tensor is read."""
    c = model.cfg
    need = {"embed.weight", "head.weight", "norm.weight", "hc_head_fn", "hc_head_base", "hc_head_scale"}
    if c.has_mtp:
        need |= {"mtp." + n for n in _MTP_OWN}
    for i in range(c.n_layers + int(c.has_mtp)):
        p = f"layers.{i}."
        need |= {p + n for n in ["attn_norm.weight", "ffn_norm.weight"]}
        need |= {p + f"hc_{s}_{k}" for s in ("attn", "ffn") for k in ("fn", "base", "scale")}
        need |= {p + "attn." + n for n in ["wq_a.weight", "q_norm.weight", "wq_b.weight", "wkv.weight",
                                           "kv_norm.weight", "wo_a.weight", "wo_b.weight", "attn_sink"]}
        if c.ratios[i]:
            need |= {p + "attn.compressor." + n for n in ["wkv.weight", "wgate.weight", "ape", "norm.weight"]}
        if c.layer_types[i] == CSA:
            need |= {p + "attn.indexer." + n for n in ["wq_b.weight", "weights_proj.weight", "compressor.wkv.weight",
                                                       "compressor.wgate.weight", "compressor.ape",
                                                       "compressor.norm.weight"]}
        need |= {p + "ffn.gate.weight", p + ("ffn.gate.tid2eid" if c.hash_layer[i] else "ffn.gate.bias")}
        need |= {p + f"ffn.shared_experts.w{j}.weight" for j in (1, 2, 3)}
        need |= {p + f"ffn.experts.{e}.w{j}.weight" for e in range(c.n_experts) for j in (1, 2, 3)}
    have = set(model.w)
    assert not need - have, f"missing tensors: {sorted(need - have)[:10]}"
    assert not have - need, f"unused tensors: {sorted(have - need)[:10]}"


# ----------------------------------------------------------------------------------------------------------
# Rounding simulations (exact in float32 and float64: every step is a power-of-two scaling or an RNE round)
def _pow2_ceil(t):
    """2^ceil(log2 t) for t > 0, exactly."""
    m, e = torch.frexp(t)  # t = m * 2^e, 0.5 <= m < 1
    e = torch.where(m == 0.5, e - 1, e)
    return torch.ldexp(torch.ones_like(t), e)


def round_bf16(x):
    """Round to the nearest bfloat16 value (ties to even), kept in x's dtype."""
    m, e = torch.frexp(x)
    q = torch.ldexp(torch.ones_like(x), e - 8)  # 8 significant bits
    return torch.round(x / q) * q


def round_e4m3(v):
    """Round |v| <= 448 to the float8_e4m3fn grid, ties to even, subnormals included."""
    m, e = torch.frexp(v)
    e = torch.clamp(e - 1, min=-6)  # exponent of the leading bit; subnormal range shares 2^-6
    q = torch.ldexp(torch.ones_like(v), e - 3)  # 3 mantissa bits
    return torch.round(v / q) * q


def round_e2m1(v):
    """Round |v| <= 6 to the e2m1 grid {0, .5, 1, 1.5, 2, 3, 4, 6}, ties to the even code."""
    a = v.abs()
    q = torch.where(a < 2, 0.5, torch.where(a < 4, 1.0, 2.0)).to(v.dtype)
    return torch.sign(v) * torch.round(a / q) * q


def _count_near_ties(stats, key, t, v, q):
    """Diagnostics: values within 1e-5 quanta of a rounding midpoint, and scales within 1e-6 (relative)
    of a power-of-two boundary. Such values may round differently under another summation order."""
    if stats is None:
        return
    frac = (v / q).abs()
    near = ((frac - torch.floor(frac)) - 0.5).abs() < 1e-5
    m, _ = torch.frexp(t)
    near_scale = ((m - 0.5).abs() < 5e-7) | ((1 - m).abs() < 1e-6)
    stats[key + "_values"] = stats.get(key + "_values", 0) + v.numel()
    stats[key + "_near_ties"] = stats.get(key + "_near_ties", 0) + int(near.sum())
    stats[key + "_near_scale_boundary"] = stats.get(key + "_near_scale_boundary", 0) + int(near_scale.sum())


def fp8sim(x, block=64, stats=None):
    """FP8sim_64: per block of 64 along the last dim, s = 2^ceil(log2(max(amax,1e-4)/448)), e4m3(x/s)*s."""
    xb = x.unflatten(-1, (x.shape[-1] // block, block))
    amax = xb.abs().amax(-1, keepdim=True)
    t = torch.clamp(amax, min=1e-4) / 448.0
    s = _pow2_ceil(t)
    v = torch.clamp(xb / s, -448.0, 448.0)
    if stats is not None:
        m, e = torch.frexp(v)
        _count_near_ties(stats, "fp8", t, v, torch.ldexp(torch.ones_like(v), torch.clamp(e - 1, min=-6) - 3))
    return (round_e4m3(v) * s).flatten(-2)


def fp4sim(x, block=32, stats=None):
    """FP4sim_32: per block of 32, s = 2^ceil(log2(max(amax, 6*2^-126)/6)), e2m1(x/s)*s."""
    xb = x.unflatten(-1, (x.shape[-1] // block, block))
    amax = xb.abs().amax(-1, keepdim=True)
    t = torch.clamp(amax, min=6.0 * 2.0 ** -126) / 6.0
    s = _pow2_ceil(t)
    v = torch.clamp(xb / s, -6.0, 6.0)
    if stats is not None:
        a = v.abs()
        _count_near_ties(stats, "fp4", t, v, torch.where(a < 2, 0.5, torch.where(a < 4, 1.0, 2.0)).to(v.dtype))
    return (round_e2m1(v) * s).flatten(-2)


def hadamard(x):
    """x times the orthonormal Sylvester Hadamard matrix H_n/sqrt(n) along the last dim (butterflies, then scale)."""
    n = x.shape[-1]
    assert n & (n - 1) == 0, "Hadamard size must be a power of two"
    lead = x.shape[:-1]
    y, h = x, 1
    while h < n:
        y = y.reshape(*lead, n // (2 * h), 2, h)
        a, b = y[..., 0, :], y[..., 1, :]
        y = torch.stack((a + b, a - b), dim=-2)
        h *= 2
    return y.reshape(*lead, n) * (n ** -0.5)


class Numerics:
    def __init__(self, dtype=torch.float32, kv_dtype="fp8", indexer_dtype="fp4"):
        assert kv_dtype in ("f32", "bf16", "fp8") and indexer_dtype in ("f32", "bf16", "fp4")
        self.dtype, self.kv_dtype, self.indexer_dtype = dtype, kv_dtype, indexer_dtype
        self.stats = None  # set to a dict to count near-ties of the rounding simulations

    def kv(self, x, rope_dim):
        """Rounding of a KV vector written to a cache: nope dims FP8sim_64, rope dims bf16 (fp8)."""
        if self.kv_dtype == "f32":
            return x
        if self.kv_dtype == "bf16":
            return round_bf16(x)
        nope = x.shape[-1] - rope_dim
        return torch.cat([fp8sim(x[..., :nope], stats=self.stats), round_bf16(x[..., nope:])], dim=-1)

    def index(self, x):
        """Rounding of an indexer query head / key entry."""
        if self.indexer_dtype == "f32":
            return x
        if self.indexer_dtype == "bf16":
            return round_bf16(x)
        return fp4sim(hadamard(x), stats=self.stats)


# ----------------------------------------------------------------------------------------------------------
# Building blocks
def rms_norm(x, weight, eps):
    y = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)
    return y if weight is None else y * weight


def rope_inv_freq(cfg, compressed, dtype):
    """Inverse frequencies of one layer: SWA layers theta=rope_theta plain; CSA/HCA compress theta + YaRN."""
    rd = cfg.rope_dim
    theta = cfg.comp_theta if compressed else cfg.main_theta
    f = 1.0 / (theta ** (torch.arange(0, rd, 2, dtype=dtype) / rd))
    if compressed and cfg.yarn:
        def corr(n_rot):
            return rd * math.log(cfg.yarn_orig / (n_rot * 2 * math.pi)) / (2 * math.log(theta))
        low = max(math.floor(corr(cfg.beta_fast)), 0)
        high = min(math.ceil(corr(cfg.beta_slow)), rd - 1)
        if low == high:
            high += 0.001
        ramp = torch.clamp((torch.arange(rd // 2, dtype=dtype) - low) / (high - low), 0, 1)
        f = f / cfg.yarn_factor * ramp + f * (1 - ramp)  # no attention-magnitude (mscale) factor
    return f


def apply_rope(x, positions, inv_freq, inverse=False):
    """Interleaved RoPE on the last 2*len(inv_freq) dims of x [..., S, (heads,) d]; positions [S]."""
    rd = 2 * inv_freq.shape[0]
    ang = positions.to(inv_freq.dtype)[:, None] * inv_freq[None, :]  # [S, rd/2]
    cos, sin = torch.cos(ang), torch.sin(ang)
    if inverse:
        sin = -sin
    if x.dim() == 3:  # [S, H, d]
        cos, sin = cos[:, None, :], sin[:, None, :]
    pairs = x[..., -rd:].unflatten(-1, (rd // 2, 2))
    a, b = pairs[..., 0], pairs[..., 1]
    rot = torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)
    return torch.cat([x[..., :-rd], rot], dim=-1)


def compress(x, wkv, wgate, ape, norm_w, ratio, overlap, eps):
    """KV compressor (spec 3.5) over a full sequence x [S, D]: entries 0..S//ratio-1, each [d_c],
    before RoPE/rounding. Overlapped (CSA): entry b pools block b-1's A half and block b's B half."""
    S = x.shape[0]
    nb = S // ratio
    d_c = wkv.shape[0] // (2 if overlap else 1)
    if nb == 0:
        return x.new_zeros((0, d_c))
    u = (x[: nb * ratio] @ wkv.T).view(nb, ratio, -1)
    g = (x[: nb * ratio] @ wgate.T).view(nb, ratio, -1) + ape[None]  # ape[t mod r]
    if overlap:
        ua = torch.zeros((nb, ratio, d_c), dtype=x.dtype)
        ga = torch.full((nb, ratio, d_c), float("-inf"), dtype=x.dtype)  # block -1 absent: weight 0
        ua[1:], ga[1:] = u[:-1, :, :d_c], g[:-1, :, :d_c]
        u = torch.cat([ua, u[:, :, d_c:]], dim=1)  # [nb, 2r, d_c]
        g = torch.cat([ga, g[:, :, d_c:]], dim=1)
    c = (torch.softmax(g, dim=1) * u).sum(dim=1)  # per-channel softmax over the pooled rows
    return rms_norm(c, norm_w, eps)


def hc_pre(X, fn, scale, base, cfg):
    """mHC pre-mapping (spec 2.3): X [S, hc, D] -> (a [S, D], post [S, hc], comb [S, hc, hc])."""
    S, hc, D = X.shape
    xf = X.reshape(S, hc * D)
    rs = torch.rsqrt(xf.square().mean(-1, keepdim=True) + cfg.eps)
    m = (xf @ fn.T) * rs
    pre = torch.sigmoid(m[:, :hc] * scale[0] + base[:hc]) + cfg.hc_eps
    post = 2 * torch.sigmoid(m[:, hc:2 * hc] * scale[1] + base[hc:2 * hc])
    comb = m[:, 2 * hc:].view(S, hc, hc) * scale[2] + base[2 * hc:].view(hc, hc)
    comb = torch.softmax(comb, dim=-1) + cfg.hc_eps
    comb = comb / (comb.sum(-2, keepdim=True) + cfg.hc_eps)
    for _ in range(cfg.sinkhorn_iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + cfg.hc_eps)
        comb = comb / (comb.sum(-2, keepdim=True) + cfg.hc_eps)
    a = (pre[:, :, None] * X).sum(1)
    return a, post, comb


def hc_post(o, X, post, comb):
    """X_new[k] = post_k * o + sum_j comb[j, k] * X[j]  (contraction over the FIRST index of comb)."""
    return post[:, :, None] * o[:, None, :] + torch.einsum("sjk,sjd->skd", comb, X)


def hc_head(X, fn, scale, base, cfg):
    S, hc, D = X.shape
    xf = X.reshape(S, hc * D)
    rs = torch.rsqrt(xf.square().mean(-1, keepdim=True) + cfg.eps)
    pre = torch.sigmoid((xf @ fn.T) * rs * scale[0] + base) + cfg.hc_eps
    return (pre[:, :, None] * X).sum(1)


# ----------------------------------------------------------------------------------------------------------
# Attention (spec 3)
def attention(model, i, x, num, stats):
    cfg, w = model.cfg, model.w
    p = f"layers.{i}.attn."
    W = lambda n: w[p + n].to(num.dtype)  # noqa: E731
    S = x.shape[0]
    H, hd, rd = cfg.n_heads, cfg.head_dim, cfg.rope_dim
    ratio = cfg.ratios[i]
    pos = torch.arange(S)
    inv_freq = rope_inv_freq(cfg, ratio > 0, num.dtype)

    # query path (3.2)
    qr = rms_norm(x @ W("wq_a.weight").T, W("q_norm.weight"), cfg.eps)
    q = (qr @ W("wq_b.weight").T).view(S, H, hd)
    q = rms_norm(q, None, cfg.eps)
    q = apply_rope(q, pos, inv_freq)

    # window KV (3.3); K = V
    kv = rms_norm(x @ W("wkv.weight").T, W("kv_norm.weight"), cfg.eps)
    kv = num.kv(apply_rope(kv, pos, inv_freq), rd)
    j = torch.arange(S)
    mask = (j[None, :] <= pos[:, None]) & (j[None, :] > pos[:, None] - cfg.window)  # [S, S]
    keys = kv

    if ratio:
        overlap = cfg.layer_types[i] == CSA
        comp = compress(x, W("compressor.wkv.weight"), W("compressor.wgate.weight"), W("compressor.ape"),
                        W("compressor.norm.weight"), ratio, overlap, cfg.eps)
        nb = comp.shape[0]
        comp_pos = torch.arange(nb) * ratio  # RoPE at the first token of each block
        comp = num.kv(apply_rope(comp, comp_pos, inv_freq), rd)
        visible = torch.arange(nb)[None, :] < ((pos + 1) // ratio)[:, None]  # [S, nb]
        if overlap:
            visible = indexer(model, i, x, qr, pos, inv_freq, visible, num, stats)
        keys = torch.cat([kv, comp], dim=0)
        mask = torch.cat([mask, visible], dim=1)

    # core attention with sink (3.8)
    logits = torch.einsum("shd,kd->shk", q, keys) * hd ** -0.5
    logits = logits.masked_fill(~mask[:, None, :], float("-inf"))
    sink = W("attn_sink")[None, :, None]
    m = torch.maximum(logits.amax(-1, keepdim=True), sink)
    prob = torch.exp(logits - m)
    denom = prob.sum(-1, keepdim=True) + torch.exp(sink - m)
    o = torch.einsum("shk,kd->shd", prob, keys) / denom
    o = apply_rope(o, pos, inv_freq, inverse=True)  # V carries RoPE: de-rotate at the query position

    # grouped low-rank output projection (3.9)
    G = cfg.o_groups
    o = o.reshape(S, G, H // G * hd)
    wo_a = W("wo_a.weight").view(G, cfg.o_lora, H // G * hd)
    z = torch.einsum("sgi,goi->sgo", o, wo_a).reshape(S, G * cfg.o_lora)
    return z @ W("wo_b.weight").T


def indexer(model, i, x, qr, pos, inv_freq, visible, num, stats):
    """Lightning indexer (3.6): returns the [S, nb] mask of compressed entries each query attends to."""
    cfg, w = model.cfg, model.w
    p = f"layers.{i}.attn.indexer."
    W = lambda n: w[p + n].to(num.dtype)  # noqa: E731
    S = x.shape[0]
    nI, dI, r = cfg.index_heads, cfg.index_dim, cfg.ratios[i]
    q = (qr @ W("wq_b.weight").T).view(S, nI, dI)
    q = num.index(apply_rope(q, pos, inv_freq))
    k = compress(x, W("compressor.wkv.weight"), W("compressor.wgate.weight"), W("compressor.ape"),
                 W("compressor.norm.weight"), r, True, cfg.eps)
    nb = k.shape[0]
    k = num.index(apply_rope(k, torch.arange(nb) * r, inv_freq))
    weights = (x @ W("weights_proj.weight").T) * (dI ** -0.5 * nI ** -0.5)  # [S, nI]
    scores = torch.einsum("sh,shn->sn", weights, torch.relu(torch.einsum("shd,nd->shn", q, k)))
    scores = scores.masked_fill(~visible, float("-inf"))
    n_vis = visible.sum(-1)
    keep = torch.clamp(n_vis, max=cfg.index_topk)  # k = min(index_topk, #visible entries)
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices  # ties: lower index first
    rank_ok = torch.arange(nb)[None, :] < keep[:, None]
    selected = torch.zeros_like(visible)
    selected.scatter_(1, order, rank_ok)
    if stats is not None:
        binds = n_vis > cfg.index_topk
        stats["topk_binding_queries"] = stats.get("topk_binding_queries", 0) + int(binds.sum())
        if binds.any():
            sorted_scores = scores.gather(1, order)
            rows = binds.nonzero()[:, 0]
            kth = sorted_scores[rows, keep[rows] - 1]
            nxt = sorted_scores[rows, keep[rows]]
            stats["topk_boundary_ties"] = stats.get("topk_boundary_ties", 0) + int((kth == nxt).sum())
            gap = (kth - nxt).min().item()
            stats["topk_min_boundary_gap"] = min(stats.get("topk_min_boundary_gap", float("inf")), gap)
    return selected


# ----------------------------------------------------------------------------------------------------------
# MoE (spec 4)
def moe(model, i, x, ids, num, stats):
    cfg, w = model.cfg, model.w
    p = f"layers.{i}.ffn."
    dt = num.dtype
    S = x.shape[0]
    L = cfg.swiglu_limit
    scores = torch.sqrt(F.softplus(x @ w[p + "gate.weight"].to(dt).T))  # [S, E], softplus threshold 20
    if cfg.hash_layer[i]:
        idx = w[p + "gate.tid2eid"].long()[ids]
    else:
        biased = scores + w[p + "gate.bias"].to(dt)  # bias for selection only
        idx = torch.sort(biased, dim=-1, descending=True, stable=True).indices[:, : cfg.top_k]
    wt = scores.gather(1, idx)
    if cfg.norm_topk:
        wt = wt / wt.sum(-1, keepdim=True)
    wt = wt * cfg.route_scale
    dense = torch.zeros((S, cfg.n_experts), dtype=dt).scatter(1, idx, wt)
    sel = torch.zeros((S, cfg.n_experts), dtype=torch.bool).scatter(1, idx, True)

    W1 = torch.stack([w[p + f"experts.{e}.w1.weight"] for e in range(cfg.n_experts)]).to(dt)  # [E, I, D]
    W3 = torch.stack([w[p + f"experts.{e}.w3.weight"] for e in range(cfg.n_experts)]).to(dt)
    W2 = torch.stack([w[p + f"experts.{e}.w2.weight"] for e in range(cfg.n_experts)]).to(dt)  # [E, D, I]
    g = torch.einsum("sd,eid->sei", x, W1)
    u = torch.einsum("sd,eid->sei", x, W3)
    sg, su = w[p + "shared_experts.w1.weight"].to(dt), w[p + "shared_experts.w3.weight"].to(dt)
    gs, us = x @ sg.T, x @ su.T
    if stats is not None:
        hit_g = (g > L) & sel[:, :, None]
        hit_u = (u.abs() > L) & sel[:, :, None]
        add = {"routed_values": int(sel.sum()) * g.shape[-1],
               "routed_gate_clamped": int(hit_g.sum()), "routed_up_clamped": int(hit_u.sum()),
               "routed_pairs": int(sel.sum()), "routed_pairs_clamped": int((hit_g | hit_u).any(-1).sum()),
               "shared_values": gs.numel(), "shared_gate_clamped": int((gs > L).sum()),
               "shared_up_clamped": int((us.abs() > L).sum())}
        for k, v in add.items():
            stats[k] = stats.get(k, 0) + v
    g, u = torch.clamp(g, max=L), torch.clamp(u, -L, L)  # gate: upper only; up: both sides
    h = F.silu(g) * u * dense[:, :, None]  # routing weight applied before the down projection
    routed = torch.einsum("sei,edi->sd", h, W2)
    gs, us = torch.clamp(gs, max=L), torch.clamp(us, -L, L)  # shared expert: clamped too (current revision)
    shared = (F.silu(gs) * us) @ w[p + "shared_experts.w2.weight"].to(dt).T
    return routed + shared


# ----------------------------------------------------------------------------------------------------------
# Whole model
def block(model, i, X, ids, num, stats):
    """Block i (layer n_layers: the MTP block) on the streams X [S, hc, D]: mHC around attention, then the MoE."""
    cfg, w = model.cfg, model.w
    p = f"layers.{i}."
    W = lambda n: w[p + n].to(num.dtype)  # noqa: E731
    a, post, comb = hc_pre(X, W("hc_attn_fn"), W("hc_attn_scale"), W("hc_attn_base"), cfg)
    o = attention(model, i, rms_norm(a, W("attn_norm.weight"), cfg.eps), num, stats)
    X = hc_post(o, X, post, comb)
    a, post, comb = hc_pre(X, W("hc_ffn_fn"), W("hc_ffn_scale"), W("hc_ffn_base"), cfg)
    o = moe(model, i, rms_norm(a, W("ffn_norm.weight"), cfg.eps), ids, num, stats)
    return hc_post(o, X, post, comb)


def head(model, X, prefix, num):
    """Final collapse, norm and the shared head: logits [S, vocab]; prefix "" (the model) or "mtp." (MTP)."""
    cfg, w = model.cfg, model.w
    W = lambda n: w[prefix + n].to(num.dtype)  # noqa: E731
    y = hc_head(X, W("hc_head_fn"), W("hc_head_scale"), W("hc_head_base"), cfg)
    y = rms_norm(y, W("norm.weight"), cfg.eps)
    return y @ w["head.weight"].to(num.dtype).T


def forward(model, ids, num=None, stats=None, streams=False):
    """Next-token logits [S, vocab] (num.dtype) for every prefix of ids (a list or 1-D tensor of token ids);
    streams: (logits, the final residual streams X [S, hc, D]), the MTP block's input."""
    num = num or Numerics()
    cfg, w = model.cfg, model.w
    ids = torch.as_tensor(ids, dtype=torch.long)
    S = ids.shape[0]
    X = w["embed.weight"].to(num.dtype)[ids][:, None, :].expand(S, cfg.hc, cfg.dim).clone()
    for i in range(cfg.n_layers):
        X = block(model, i, X, ids, num, stats)
    logits = head(model, X, "", num)
    return (logits, X) if streams else logits


def mtp_forward(model, X, next_ids, num=None):
    """The MTP block (spec 5) on the pairs (X[i], next_ids[i]) at positions 0..S-1: X the main model's final
    streams [S, hc, D] (forward(..., streams=True)), next_ids[i] the token after position i. Returns its logits
    [S, vocab]: row i guesses the token after next_ids[i]."""
    num = num or Numerics()
    cfg, w = model.cfg, model.w
    assert cfg.has_mtp, "the checkpoint has no MTP block"
    W = lambda n: w["mtp." + n].to(num.dtype)  # noqa: E731
    next_ids = torch.as_tensor(next_ids, dtype=torch.long)
    e = rms_norm(w["embed.weight"].to(num.dtype)[next_ids], W("enorm.weight"), cfg.eps)  # [S, D]
    h = rms_norm(X, W("hnorm.weight"), cfg.eps)  # per stream
    Y = (e @ W("e_proj.weight").T)[:, None, :] + h @ W("h_proj.weight").T  # [S, hc, D]
    Y = block(model, cfg.n_layers, Y, next_ids, num, None)
    return head(model, Y, "mtp.", num)


def greedy(model, prompt, n_new, num=None, stats=None):
    """Greedy continuation by re-running the full forward. Returns (output_ids, logits
    [len(prompt)+n_new-1, vocab]): row i = logits after the first i+1 tokens of prompt+output."""
    seq = list(prompt)
    out = []
    logits = None
    for step in range(n_new):
        logits = forward(model, seq, num, stats if step == n_new - 1 else None)
        out.append(int(torch.argmax(logits[-1])))
        seq.append(out[-1])
    return out, logits


# ----------------------------------------------------------------------------------------------------------
def selftest():
    torch.manual_seed(0)
    x = torch.randn(100000) * torch.exp(torch.randn(100000) * 3)
    assert torch.equal(round_bf16(x), x.to(torch.bfloat16).float()), "bf16 rounding"
    v = torch.clamp(torch.randn(100000) * torch.exp(torch.randn(100000) * 3), -448, 448)
    v = torch.cat([v, torch.tensor([0.0, 2.0 ** -9, 3 * 2.0 ** -10, 2.0 ** -10, 432.0, 17.0, 19.0, -0.0])])
    assert torch.equal(round_e4m3(v), v.to(torch.float8_e4m3fn).float()), "e4m3 rounding"
    assert torch.equal(round_e4m3(v.double()), round_e4m3(v).double()), "e4m3 rounding in float64"
    t = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -5.0, 0.2, 0.3, 5.1, 6.0])
    want = torch.tensor([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 0.0, -4.0, 0.0, 0.5, 6.0, 6.0])
    assert torch.equal(round_e2m1(t), want), round_e2m1(t)
    n = 128
    Hm = torch.ones(1, 1, dtype=torch.float64)
    while Hm.shape[0] < n:
        Hm = torch.cat([torch.cat([Hm, Hm], 1), torch.cat([Hm, -Hm], 1)], 0)
    y = torch.randn(5, n, dtype=torch.float64)
    assert torch.allclose(hadamard(y), y @ Hm / math.sqrt(n), atol=1e-12), "hadamard"
    z = torch.randn(7, 64) * 3
    q = fp8sim(z)
    s = _pow2_ceil(z.abs().amax(-1, keepdim=True) / 448)
    assert torch.equal(q, (z / s).to(torch.float8_e4m3fn).float() * s), "fp8sim"
    print("selftest ok")


if __name__ == "__main__":
    if "--selftest" in sys.argv:
        selftest()
