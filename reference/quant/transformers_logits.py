"""Reference logits from transformers on the exactly dequantised tiny checkpoints (tests/data/quant/).

    DSV4_QUANT_EXPORT_DIR=EXPORT build/tests/dsv4_tests --gtest_filter=QuantE2E.ExportDequantisedForTransformers
    python3 reference/quant/transformers_logits.py EXPORT OUTDIR

EXPORT holds one fp32 checkpoint per quantised variant (nvfp4, nvfp4-all, deepseek: the weights of
`dsv4 quantize` output decoded exactly by the engine's loader, saved as F32 under transformers' saved names) and
the engine's own logits on them (<variant>-engine.npy). For each variant this loads the checkpoint with
DeepseekV4ForCausalLM (transformers 5.17, float32, eager attention; every tensor must be consumed and none
missing), runs one forward over the fixed prompt and writes OUTDIR/<variant>-transformers.npy [12, vocab].
Needs torch + transformers; runs on CPU.
"""
import json
import os
import sys

import numpy as np
import torch

PROMPT = [0, 17, 42, 99, 3, 200, 7, 7, 128, 255, 64, 5]  # = dsv4::testing::quant_test_prompt()
VARIANTS = ["nvfp4", "nvfp4-all", "deepseek"]


@torch.no_grad()
def main(export, outdir):
    from transformers import DeepseekV4ForCausalLM

    os.makedirs(outdir, exist_ok=True)
    report = {}
    for name in VARIANTS:
        d = os.path.join(export, name)
        model, info = DeepseekV4ForCausalLM.from_pretrained(
            d, dtype=torch.float32, attn_implementation="eager", output_loading_info=True)
        bad = {k: v for k, v in info.items() if v}
        assert not bad, f"{name}: loading info {bad}"
        model.eval()
        logits = model(input_ids=torch.tensor([PROMPT])).logits[0].float().numpy()
        np.save(os.path.join(outdir, f"{name}-transformers.npy"), logits.astype(np.float32))
        entry = {"shape": list(logits.shape), "max_abs_logit": float(np.abs(logits).max())}
        engine = os.path.join(export, f"{name}-engine.npy")
        if os.path.exists(engine):
            entry["max_abs_diff_vs_engine"] = float(np.abs(np.load(engine) - logits).max())
        report[name] = entry
        print(name, entry, flush=True)
    with open(os.path.join(outdir, "transformers_report.json"), "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
