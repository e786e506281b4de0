"""Diagnostic (device): where does transformers' cached decode diverge from a full re-forward?
Builds tiny-flash exactly as make_goldens does, then for one prompt compares per-layer attention/MLP
outputs of the incremental path against the full forward, and repeats with index_topk large (no binding)."""
import os, sys, json, copy
import torch
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_goldens as mg, dsv4_ref
from tiny_configs import MODELS
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM


def build(name, **over):
    kw = dict(MODELS[name], **over)
    cfg = DeepseekV4Config(**kw)
    gen = torch.Generator().manual_seed(mg.SEEDS[name])
    torch.manual_seed(mg.SEEDS[name])
    m = DeepseekV4ForCausalLM(cfg).float().eval()
    mg.randomize(m, cfg, gen)
    m.config._attn_implementation = "eager"
    return m, cfg


def capture(model):
    rec = {}
    hs = []
    for i, layer in enumerate(model.model.layers):
        def mk(key):
            def h(mod, inp, out):
                o = out[0] if isinstance(out, tuple) else out
                rec.setdefault(key, []).append(o.detach().clone())
            return h
        hs.append(layer.self_attn.register_forward_hook(mk(f"attn{i}")))
        hs.append(layer.mlp.register_forward_hook(mk(f"mlp{i}")))
    return rec, hs


@torch.no_grad()
def compare(model, name, L, n_new):
    g = torch.Generator().manual_seed(mg.SEEDS[name] * 1000 + L)
    prompt = torch.randint(0, model.config.vocab_size, (L,), generator=g).tolist()
    out_ids, inc = mg.hf_greedy(model, prompt, n_new)
    seq = prompt + out_ids[:-1]
    full = model(input_ids=torch.tensor([seq])).logits[0]
    rowdiff = (full - inc).abs().amax(-1)
    bad = (rowdiff > 1e-4).nonzero().flatten().tolist()
    res = {"L": L, "max": float(rowdiff.max()), "bad_rows": bad[:20]}
    w = {}
    for k, v in model.state_dict().items():
        if "inv_freq" not in k:
            w.update(dsv4_ref.split_fused(k, v))
    ref = dsv4_ref.Model(dsv4_ref.Config(model.config.to_dict()), w)
    r = dsv4_ref.forward(ref, seq, dsv4_ref.Numerics(torch.float64, "f32", "f32")).float()
    res["ref64_vs_full"] = float((r - full).abs().max())
    res["ref64_vs_inc"] = float((r - inc).abs().max())
    if bad:
        t = bad[0]
        rec_f, hs = capture(model)
        model(input_ids=torch.tensor([seq]))
        for h in hs: h.remove()
        rec_i, hs = capture(model)
        o = model(input_ids=torch.tensor([seq[:L]]), use_cache=True); pkv = o.past_key_values
        for p in range(L, t + 1):
            o = model(input_ids=torch.tensor([[seq[p]]]), past_key_values=pkv, use_cache=True); pkv = o.past_key_values
        for h in hs: h.remove()
        first = []
        for k in rec_f:
            a = rec_f[k][0][0, t]
            b = rec_i[k][-1][0, -1] if t >= L else rec_i[k][0][0, t]
            first.append((k, float((a - b).abs().max())))
        res["first_bad_row_layer_diffs"] = first
    return res


out = {}
m, cfg = build("tiny-flash")
for L in (5, 36, 37, 40, 127, 129):
    out[f"flash p{L}"] = compare(m, "tiny-flash", L, 8)
    print(json.dumps(out[f"flash p{L}"]), flush=True)
m2, _ = build("tiny-flash", index_topk=1000)
for L in (127, 129):
    out[f"flash-notopk p{L}"] = compare(m2, "tiny-flash", L, 8)
    print("notopk", json.dumps(out[f"flash-notopk p{L}"]), flush=True)
m3, _ = build("tiny-pro")
for L in (2, 17, 40, 70):
    out[f"pro p{L}"] = compare(m3, "tiny-pro", L, 12)
    print("pro", json.dumps(out[f"pro p{L}"]), flush=True)
