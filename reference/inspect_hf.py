"""Device-side introspection of the installed transformers DeepSeek-V4 code (first device call).

Dumps the installed modeling/config sources, builds tiny-flash with default init, saves it, and
writes reference/tensor_names.md material (saved names vs state_dict names, config.json).
Usage: python3 reference/inspect_hf.py OUTDIR
"""
import inspect, json, os, sys, shutil
import torch, transformers
from safetensors import safe_open
sys.path.insert(0, os.path.dirname(__file__))
from tiny_configs import MODELS

out = sys.argv[1]
os.makedirs(out, exist_ok=True)
import transformers.models.deepseek_v4 as pkg
src_dir = os.path.dirname(pkg.__file__)
os.makedirs(f"{out}/hfsrc", exist_ok=True)
for f in os.listdir(src_dir):
    if f.endswith(".py"):
        shutil.copy(os.path.join(src_dir, f), f"{out}/hfsrc/{f}")
from transformers import modeling_rope_utils, cache_utils, masking_utils
for m in (modeling_rope_utils, cache_utils, masking_utils):
    shutil.copy(m.__file__, f"{out}/hfsrc/{os.path.basename(m.__file__)}")
try:
    from transformers import conversion_mapping
    shutil.copy(conversion_mapping.__file__, f"{out}/hfsrc/conversion_mapping.py")
except Exception as e:
    print("no conversion_mapping", e)
print("transformers", transformers.__version__, "torch", torch.__version__)

from transformers import DeepseekV4Config, DeepseekV4ForCausalLM
for name, kw in MODELS.items():
    cfg = DeepseekV4Config(**kw)
    print(name, "layer_types", cfg.layer_types, "mlp", cfg.mlp_layer_types, "rope", cfg.rope_parameters,
          "compress_rates", cfg.compress_rates)
    torch.manual_seed(0)
    model = DeepseekV4ForCausalLM(cfg).float().eval()
    sd = model.state_dict()
    d = f"{out}/{name}"
    model.save_pretrained(d)
    shutil.copy(f"{d}/config.json", f"{out}/{name}.config.json")
    files = sorted(f for f in os.listdir(d) if f.endswith(".safetensors"))
    saved = {}
    for f in files:
        with safe_open(f"{d}/{f}", "pt") as fh:
            for k in fh.keys():
                t = fh.get_tensor(k)
                saved[k] = (list(t.shape), str(t.dtype))
    with open(f"{out}/{name}.names.json", "w") as fh:
        json.dump({"saved": saved, "state_dict": {k: (list(v.shape), str(v.dtype)) for k, v in sd.items()},
                   "params": [k for k, _ in model.named_parameters()],
                   "buffers": [k for k, _ in model.named_buffers()]}, fh, indent=1)
    print(name, "saved", len(saved), "state_dict", len(sd), "files", files)
    # round trip + prefill vs decode smoke test
    m2 = DeepseekV4ForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="eager").eval()
    sd2 = m2.state_dict()
    bad = [k for k in sd if k not in sd2 or not torch.equal(sd[k].float(), sd2[k].float())]
    print(name, "roundtrip mismatches", bad[:10], len(bad))
    ids = torch.randint(0, 256, (1, 10))
    with torch.no_grad():
        full = m2(ids).logits[0]
        o = m2(ids[:, :7], use_cache=True)
        pkv = o.past_key_values
        rows = [o.logits[0]]
        for t in range(7, 10):
            o = m2(ids[:, t:t + 1], past_key_values=pkv, use_cache=True)
            pkv = o.past_key_values
            rows.append(o.logits[0])
        inc = torch.cat(rows)
    print(name, "full vs incremental", (full - inc).abs().max().item(), "cache", type(pkv).__name__,
          [type(l).__name__ for l in pkv.layers])
