"""Builds the tiny random DeepSeek-V4 checkpoints and their golden logits (tests/data/golden/).

Run on a machine with torch + transformers 5.17.0 (the lent GPU machine; everything runs on its CPU in fp32):
    python3 reference/make_goldens.py OUTDIR
Writes OUTDIR/<model>/{config.json, model*.safetensors, runs.json, *.npy} for tiny-flash, tiny-pro and
tiny-flash-hfnames, plus OUTDIR/report.json (all measured diffs and statistics) and OUTDIR/names.json.

Per model:
  1. DeepseekV4ForCausalLM(config) in float32, every parameter and persistent buffer overwritten with seeded
     random values (no zeros / ones anywhere), saved with save_pretrained and reloaded (bit-identical check).
  2. source "transformers": per prompt, prefill logits + cached incremental greedy decode (DynamicCache);
     asserts that one full re-forward of the whole sequence reproduces every row.
  3. dsv4_ref (reference/dsv4_ref.py, kv f32 / indexer f32) on the same sequences: max |diff| vs transformers.
  4. source "dsv4_ref": greedy decode with the engine's default numerics (kv fp8, indexer fp4) in float32;
     the same sequence re-run in float64 gives the fp32-rounding tolerance scale.
"""
import collections
import json
import math
import os
import sys
import time
import traceback

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dsv4_ref  # noqa: E402
from tiny_configs import MODELS  # noqa: E402

torch.set_num_threads(min(16, os.cpu_count() or 1))

_TopK = collections.namedtuple("topk", "values indices")


def _stable_topk(self, k, dim=-1, largest=True, sorted=True):
    """Tensor.topk with the engine's tie rule: equal values -> lower index first (stable sort).
    transformers' indexer calls Tensor.topk on scores that tie exactly at 0 (all heads' ReLU(q.k) = 0);
    torch's own topk then picks tie members in a length-dependent order, which breaks prefill causality
    and prefill/decode agreement. Patched for the whole script (the routers call torch.topk, unaffected)."""
    idx = torch.sort(self, dim=dim, descending=largest, stable=True).indices.narrow(dim, 0, k)
    return _TopK(self.gather(dim, idx), idx)


torch.Tensor.topk = _stable_topk

PROMPTS = {  # model -> [(prompt length, decode tokens)]
    "tiny-flash": [(n, 8) for n in (1, 3, 4, 5, 127, 128, 129, 513)],
    "tiny-pro": [(n, 12) for n in (2, 17, 40, 70)],
}
SEEDS = {"tiny-flash": 1234, "tiny-pro": 5678}
ROUTED_GAIN = 1.0  # routed experts' gate/up pre-activations ~ N(0, 1): the clamp at 2.0 bites on ~2-5%
SHARED_GAIN = 0.8  # transformers 5.17 clamps the shared expert too, so it may bite there as well
LM_GAIN = 4.0  # logits ~ N(0, 16): well separated top-2
HFNAMES_RUNS = ("p5", "p129")


def randomize(model, cfg, gen):
    """Overwrites every parameter and persistent buffer with seeded random values scaled for O(1) activations."""
    D = cfg.hidden_size
    inter = cfg.moe_intermediate_size

    def rn(shape, std):
        return torch.randn(tuple(shape), generator=gen, dtype=torch.float64).float() * std

    done = []
    buffers = [(n, b) for n, b in model.named_buffers() if "inv_freq" not in n]
    for name, t in list(model.named_parameters()) + buffers:
        s = t.shape
        with torch.no_grad():
            if name.endswith("tid2eid"):  # [vocab, top_k], distinct valid expert ids per row
                rows = [torch.randperm(cfg.n_routed_experts, generator=gen)[: s[1]] for _ in range(s[0])]
                t.copy_(torch.stack(rows))
            elif name.endswith("e_score_correction_bias"):
                t.copy_(rn(s, 0.2))
            elif t.dim() == 1 and name.endswith(".weight"):  # every RMSNorm weight
                t.copy_(1.0 + rn(s, 0.1))
            elif name.endswith(("_hc.fn", "hc_head.hc_fn")):
                t.copy_(rn(s, 1.0 / math.sqrt(s[1])))
            elif name.endswith(("_hc.base", "hc_head.hc_base")):
                t.copy_(rn(s, 0.5))
            elif name.endswith(("_hc.scale", "hc_head.hc_scale")):
                t.copy_(0.5 + torch.rand(tuple(s), generator=gen))
            elif name.endswith("sinks"):
                t.copy_(rn(s, 0.5))
            elif name.endswith("position_bias"):  # compressor ape
                t.copy_(rn(s, 0.5))
            elif name.endswith("embed_tokens.weight"):
                t.copy_(rn(s, 1.0))
            elif name.endswith("lm_head.weight"):
                t.copy_(rn(s, LM_GAIN / math.sqrt(D)))
            elif name.endswith("experts.gate_up_proj"):
                t.copy_(rn(s, ROUTED_GAIN / math.sqrt(D)))
            elif name.endswith("experts.down_proj"):
                t.copy_(rn(s, 1.0 / math.sqrt(inter)))
            elif name.endswith(("shared_experts.gate_proj.weight", "shared_experts.up_proj.weight")):
                t.copy_(rn(s, SHARED_GAIN / math.sqrt(D)))
            elif name.endswith(".weight") and t.dim() == 2:  # every other linear: unit gain
                t.copy_(rn(s, 1.0 / math.sqrt(s[1])))
            else:
                raise RuntimeError(f"no randomisation rule for {name} {tuple(s)}")
        done.append(name)
    for name, t in list(model.named_parameters()) + buffers:
        if t.is_floating_point():
            assert not (t == 0).any() and not (t == 1).any(), f"{name} holds an exact 0 or 1"
    assert not torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)
    return done


class ClampStats:
    """Counts SwiGLU clamp hits inside transformers' routed experts and shared expert (forward hooks)."""

    def __init__(self, model, limit):
        self.limit, self.on, self.c = limit, False, {}
        for layer in model.model.layers:
            layer.mlp.experts.register_forward_pre_hook(self.routed)
            layer.mlp.shared_experts.gate_proj.register_forward_hook(lambda m, i, o: self.shared("gate", o))
            layer.mlp.shared_experts.up_proj.register_forward_hook(lambda m, i, o: self.shared("up", o))

    def add(self, k, v):
        self.c[k] = self.c.get(k, 0) + int(v)

    def routed(self, module, args):
        if not self.on:
            return
        x, idx = args[0], args[1]
        gu = torch.einsum("td,tkid->tki", x, module.gate_up_proj[idx])
        g, u = gu.chunk(2, dim=-1)
        self.add("routed_values", g.numel())
        self.add("routed_gate_clamped", (g > self.limit).sum())
        self.add("routed_up_clamped", (u.abs() > self.limit).sum())

    def shared(self, which, out):
        if not self.on:
            return
        hit = (out > self.limit) if which == "gate" else (out.abs() > self.limit)
        self.add(f"shared_{which}_clamped", hit.sum())
        if which == "gate":
            self.add("shared_values", out.numel())


@torch.no_grad()
def hf_greedy(model, prompt, n_new):
    """Prefill forward + cached incremental decode. Returns (output_ids, logits [L+n_new-1, V])."""
    out = model(input_ids=torch.tensor([prompt]), use_cache=True)
    pkv, rows = out.past_key_values, [out.logits[0]]
    ids = [int(torch.argmax(rows[-1][-1]))]
    for _ in range(n_new - 1):
        out = model(input_ids=torch.tensor([[ids[-1]]]), past_key_values=pkv, use_cache=True)
        pkv = out.past_key_values
        rows.append(out.logits[0])
        ids.append(int(torch.argmax(rows[-1][-1])))
    return ids, torch.cat(rows).float()


@torch.no_grad()
def hf_greedy_full(model, prompt, n_new):
    """Greedy decode by re-running transformers' full (prefill) forward at every step."""
    seq, ids = list(prompt), []
    for _ in range(n_new):
        logits = model(input_ids=torch.tensor([seq])).logits[0].float()
        ids.append(int(torch.argmax(logits[-1])))
        seq.append(ids[-1])
    return ids, logits


def margins(logits):
    top2 = torch.topk(logits.double(), 2, dim=-1).values
    return float((top2[:, 0] - top2[:, 1]).min())


def run_entry(name, prompt, out_ids, logits, source, kv, idx):
    return {"name": name, "prompt_ids": list(map(int, prompt)), "output_ids": list(map(int, out_ids)),
            "logits": f"{name}.npy", "source": source, "kv_dtype": kv, "indexer_dtype": idx,
            "max_abs_logit": float(logits.abs().max()), "min_top2_margin": margins(logits)}


def build(model_name, outdir, report):
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    t0 = time.time()
    kw = MODELS[model_name]
    cfg = DeepseekV4Config(**kw)
    gen = torch.Generator().manual_seed(SEEDS[model_name])
    torch.manual_seed(SEEDS[model_name])
    model = DeepseekV4ForCausalLM(cfg).float().eval()
    randomize(model, cfg, gen)
    d = os.path.join(outdir, model_name)
    if model_name == "tiny-pro":
        model.save_pretrained(d, max_shard_size="2MB")  # sharded: model.safetensors.index.json + shards
    else:
        model.save_pretrained(d)
    hf = DeepseekV4ForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="eager").eval()
    sd, sd2 = model.state_dict(), hf.state_dict()
    assert sd.keys() == sd2.keys() and all(torch.equal(sd[k], sd2[k]) for k in sd), "save/load round trip"
    del model
    clamp = ClampStats(hf, cfg.swiglu_limit)
    rep = report[model_name] = {"runs": {}, "files": sorted(os.listdir(d))}
    try:
        ref = dsv4_ref.load(d)  # loads the saved safetensors through its own name mapping
    except Exception:
        ref, rep["dsv4_ref_load_error"] = None, traceback.format_exc()
    runs = []
    f32 = dsv4_ref.Numerics(torch.float32, "f32", "f32")
    dflt32 = dsv4_ref.Numerics(torch.float32, "fp8", "fp4")
    dflt64 = dsv4_ref.Numerics(torch.float64, "fp8", "fp4")
    ref_stats_f32, ref_stats_q = {}, {}
    for L, n_new in PROMPTS[model_name]:
        g = torch.Generator().manual_seed(SEEDS[model_name] * 1000 + L)
        prompt = torch.randint(0, cfg.vocab_size, (L,), generator=g).tolist()
        name = f"p{L}"
        out_ids, inc = hf_greedy(hf, prompt, n_new)
        seq = prompt + out_ids[:-1]
        clamp.on = True
        with torch.no_grad():
            full = hf(input_ids=torch.tensor([seq])).logits[0].float()
        clamp.on = False
        row_diff = (full - inc).abs().amax(-1)
        d_full = float(row_diff.max())
        entry = rep["runs"][name] = {"transformers_full_vs_incremental": d_full}
        if d_full < 1e-4:
            mode, ids, logits = "incremental", out_ids, inc
        else:  # transformers' cached decode disagrees with its own prefill: record it, use the prefill path
            bad = (row_diff > 1e-4).nonzero().flatten().tolist()
            entry["incremental_bad_rows"] = [bad[0], bad[-1], len(bad)]
            ids, logits = hf_greedy_full(hf, prompt, n_new)
            mode = "full-reforward"
            entry["full_reforward_same_ids_as_incremental"] = ids == out_ids
        entry.update(transformers_decode=mode, max_abs_logit=float(logits.abs().max()), min_top2_margin=margins(logits))
        np.save(os.path.join(d, f"{name}.npy"), logits.numpy().astype(np.float32))
        runs.append(dict(run_entry(name, prompt, ids, logits, "transformers", "f32", "f32"), transformers_decode=mode))
        try:
            r32 = dsv4_ref.forward(ref, prompt + ids[:-1], f32, ref_stats_f32).float()
            entry["dsv4_ref_f32_vs_transformers"] = float((r32 - logits).abs().max())
            entry["dsv4_ref_f32_argmax_agrees"] = bool(torch.equal(r32.argmax(-1), logits.argmax(-1)))
            if mode != "incremental":
                r_inc = dsv4_ref.forward(ref, seq, f32).float()
                entry["dsv4_ref_f32_vs_transformers_incremental"] = float((r_inc - inc).abs().max())
                entry["dsv4_ref_f32_vs_transformers_full_same_seq"] = float((r_inc - full).abs().max())
            q_ids, q32 = dsv4_ref.greedy(ref, prompt, n_new, dflt32)
            dflt64.stats = entry["fp8fp4_rounding_near_ties"] = {}
            q64 = dsv4_ref.forward(ref, prompt + q_ids[:-1], dflt64, ref_stats_q)
            dflt64.stats = None
            dq = (q32.double() - q64).abs().amax(-1)
            entry["dsv4_ref_fp8fp4_fp32_vs_fp64"] = float(dq.max())
            entry["dsv4_ref_fp8fp4_fp32_vs_fp64_rows_over_1e-3"] = int((dq > 1e-3).sum())
            entry["dsv4_ref_fp8fp4_fp32_vs_fp64_median_row"] = float(dq.median())
            entry["dsv4_ref_fp8fp4_same_ids_as_transformers"] = q_ids == ids
            entry["dsv4_ref_fp8fp4_vs_transformers_prompt_rows"] = float((q32[:L] - logits[:L]).abs().max())
            entry["fp8_min_top2_margin"] = margins(q32)
            q_name = f"{name}-fp8"
            np.save(os.path.join(d, f"{q_name}.npy"), q32.numpy().astype(np.float32))
            runs.append(dict(run_entry(q_name, prompt, q_ids, q32, "dsv4_ref", "fp8", "fp4"),
                             fp32_vs_fp64_max_abs_diff=float(dq.max()),
                             fp32_vs_fp64_row_max_abs_diff=[float(f"{v:.3g}") for v in dq.tolist()]))
        except Exception:  # keep the transformers goldens of this call even if the transcription breaks
            entry["dsv4_ref_error"] = traceback.format_exc()
        print(model_name, name, json.dumps(rep["runs"][name]), flush=True)
    with open(os.path.join(d, "runs.json"), "w") as f:
        json.dump(runs, f, indent=1)
    rep["transformers_clamp"] = clamp.c
    rep["dsv4_ref_f32_stats"] = ref_stats_f32
    rep["dsv4_ref_fp8fp4_stats"] = ref_stats_q
    rep["seconds"] = time.time() - t0
    return hf, runs


def write_hfnames(hf, runs, outdir, report):
    """tiny-flash weights under transformers' in-memory names (loader test), with a subset of its runs."""
    from safetensors.torch import save_file

    src, d = os.path.join(outdir, "tiny-flash"), os.path.join(outdir, "tiny-flash-hfnames")
    os.makedirs(d, exist_ok=True)
    save_file({k: v.detach().contiguous().clone() for k, v in hf.state_dict().items()},
              os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(src, "config.json")) as f:
        cfg_text = f.read()
    with open(os.path.join(d, "config.json"), "w") as f:
        f.write(cfg_text)
    keep = [r for r in runs if r["name"] in HFNAMES_RUNS]
    for r in keep:
        with open(os.path.join(src, r["logits"]), "rb") as fi, open(os.path.join(d, r["logits"]), "wb") as fo:
            fo.write(fi.read())
    with open(os.path.join(d, "runs.json"), "w") as f:
        json.dump(keep, f, indent=1)
    a, b = dsv4_ref.load(src), dsv4_ref.load(d)
    same = a.w.keys() == b.w.keys() and all(torch.equal(a.w[k], b.w[k]) for k in a.w)
    report["tiny-flash-hfnames"] = {"files": sorted(os.listdir(d)), "same_weights_as_tiny-flash": same}


def write_quantizers(outdir):
    """Unit goldens for the rounding simulations (float32 in, float32 out), tests/data/golden/quantizers/."""
    d = os.path.join(outdir, "quantizers")
    os.makedirs(d, exist_ok=True)
    g = torch.Generator().manual_seed(99)
    mag = torch.exp(torch.randn(64, 1, generator=g) * 4)  # per-row magnitudes over ~14 binades
    mag[:4] = torch.tensor([[1e-7], [3e-6], [2e-5], [1e-4]])  # amax below the 1e-4 floor, subnormal e4m3 codes
    x = (torch.randn(64, 448, generator=g) * mag).float()
    files = {"fp8sim64_in": x, "fp8sim64_out": dsv4_ref.fp8sim(x)}
    y = (torch.randn(64, 128, generator=g) * mag).float()
    files.update(fp4sim32_in=y, fp4sim32_out=dsv4_ref.fp4sim(y))
    h = torch.randn(16, 128, generator=g).float()
    files.update(hadamard128_in=h, hadamard128_out=dsv4_ref.hadamard(h),
                 hadamard_fp4sim_out=dsv4_ref.fp4sim(dsv4_ref.hadamard(h)))
    b = (torch.randn(4096, generator=g) * torch.exp(torch.randn(4096, generator=g) * 4)).float()
    files.update(bf16_in=b, bf16_out=dsv4_ref.round_bf16(b))
    for k, v in files.items():
        np.save(os.path.join(d, f"{k}.npy"), v.numpy().astype(np.float32))
    with open(os.path.join(d, "README.md"), "w") as f:
        f.write("Rounding-simulation goldens from reference/dsv4_ref.py (float32): fp8sim64 = FP8sim_64 per row "
                "(7 blocks of 64), fp4sim32 = FP4sim_32 (4 blocks of 32), hadamard128 = x times the orthonormal "
                "Sylvester Hadamard matrix (butterflies then * 128^-0.5), hadamard_fp4sim = FP4sim_32(hadamard128), "
                "bf16 = round-to-nearest-even to bfloat16. fp8/fp4/bf16 outputs are exact (compare bit for bit); "
                "hadamard to ~1e-6 relative (summation order).\n")


def main():
    outdir = sys.argv[1]
    os.makedirs(outdir, exist_ok=True)
    import transformers
    from safetensors import safe_open

    report = {"transformers": transformers.__version__, "torch": torch.__version__, "threads": torch.get_num_threads()}
    try:
        dsv4_ref.selftest()
        report["dsv4_ref_selftest"] = "ok"
    except Exception:
        report["dsv4_ref_selftest"] = traceback.format_exc()
    report["transformers_indexer_topk"] = "Tensor.topk patched to a stable sort (ties -> lower index)"
    write_quantizers(outdir)
    hf_flash, flash_runs = build("tiny-flash", outdir, report)
    build("tiny-pro", outdir, report)
    try:
        write_hfnames(hf_flash, flash_runs, outdir, report)
    except Exception:
        report["hfnames_error"] = traceback.format_exc()
    # names of tiny-flash as saved and as in memory (for reference/tensor_names.md)
    d = os.path.join(outdir, "tiny-flash")
    saved = {}
    with safe_open(os.path.join(d, "model.safetensors"), "pt") as fh:
        for k in fh.keys():
            t = fh.get_tensor(k)
            saved[k] = [list(t.shape), str(t.dtype)]
    sd = {k: [list(v.shape), str(v.dtype)] for k, v in hf_flash.state_dict().items()}
    with open(os.path.join(outdir, "names.json"), "w") as f:
        json.dump({"saved": saved, "state_dict": sd}, f, indent=1)
    with open(os.path.join(outdir, "report.json"), "w") as f:
        json.dump(report, f, indent=1)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
