"""Prints a markdown summary of OUTDIR/report.json written by make_goldens.py (no torch needed)."""
import json, sys

rep = json.load(open(sys.argv[1]))
print(f"transformers {rep['transformers']}, torch {rep['torch']}, selftest: {rep.get('dsv4_ref_selftest', '?')[:60]}")
keys = ["transformers_decode", "transformers_full_vs_incremental", "dsv4_ref_f32_vs_transformers",
        "dsv4_ref_fp8fp4_fp32_vs_fp64", "dsv4_ref_fp8fp4_fp32_vs_fp64_rows_over_1e-3", "min_top2_margin",
        "fp8_min_top2_margin"]
short = ["decode", "hf full-inc", "ref32-hf", "fp8 32-64", "rows>1e-3", "margin", "fp8 margin"]
for model in ("tiny-flash", "tiny-pro"):
    if model not in rep:
        continue
    m = rep[model]
    print(f"\n### {model}\n")
    print("| run | " + " | ".join(short) + " | near ties (fp8/fp4/scale) |")
    print("|---" * (len(short) + 2) + "|")
    for name, e in m["runs"].items():
        vals = []
        for k in keys:
            v = e.get(k, "-")
            vals.append(f"{v:.3g}" if isinstance(v, float) else str(v))
        t = e.get("fp8fp4_rounding_near_ties", {})
        ties = f"{t.get('fp8_near_ties', '-')}/{t.get('fp4_near_ties', '-')}/" \
               f"{t.get('fp8_near_scale_boundary', 0) + t.get('fp4_near_scale_boundary', 0) if t else '-'}"
        print(f"| {name} | " + " | ".join(vals) + f" | {ties} |")
        for k, v in e.items():
            if "error" in k or "bad_rows" in k or k.startswith("full_reforward") or "incremental" in k and k != "transformers_full_vs_incremental":
                print(f"  - {k}: {str(v)[:300]}")
    for k in ("transformers_clamp", "dsv4_ref_f32_stats", "dsv4_ref_fp8fp4_stats", "seconds", "files"):
        print(f"- {k}: {m.get(k)}")
for k in ("tiny-flash-hfnames", "hfnames_error"):
    if k in rep:
        print(f"- {k}: {str(rep[k])[:500]}")
