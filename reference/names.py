"""Tensor-name mapping between the three namings a DeepSeek-V4 checkpoint can carry.

* official   - DeepSeek's own files (inference/model.py): `layers.3.attn.kv_norm.weight`, no prefix.
* saved      - what transformers 5.17 `save_pretrained` writes: the official names with a `model.`
               prefix, except `head.weight` (no prefix), `model.embed_tokens.weight`,
               `model.hc_head.hc_{fn,base,scale}` (in-memory style) and `attn.norm.weight` for the KV norm.
* in-memory  - transformers' module names (`model.state_dict()`): `model.layers.3.self_attn.kv_norm.weight`,
               routed experts fused as `mlp.experts.gate_up_proj [E, 2I, D]` (gate rows first) and
               `mlp.experts.down_proj [E, D, I]`.
`canonical()` maps any of them to the official name; fused experts are split by `split_fused()`.
"""
import re

# in-memory (after stripping "model.") -> official; applied in order, first match of each rule.
_HF_RULES = [
    (r"^embed_tokens\.weight$", "embed.weight"),
    (r"^lm_head\.weight$", "head.weight"),
    (r"^hc_head\.hc_(fn|base|scale)$", r"hc_head_\1"),
    (r"\.input_layernorm\.", ".attn_norm."),
    (r"\.post_attention_layernorm\.", ".ffn_norm."),
    (r"\.attn_hc\.(fn|base|scale)$", r".hc_attn_\1"),
    (r"\.ffn_hc\.(fn|base|scale)$", r".hc_ffn_\1"),
    (r"\.self_attn\.compressor\.indexer\.scorer\.weights_proj\.", ".attn.indexer.weights_proj."),
    (r"\.self_attn\.compressor\.indexer\.q_b_proj\.", ".attn.indexer.wq_b."),
    (r"\.self_attn\.compressor\.indexer\.", ".attn.indexer.compressor."),
    (r"\.self_attn\.", ".attn."),
    (r"\.mlp\.", ".ffn."),
    (r"\.sinks$", ".attn_sink"),
    (r"\.q_a_proj\.", ".wq_a."),
    (r"\.q_a_norm\.", ".q_norm."),
    (r"\.q_b_proj\.", ".wq_b."),
    (r"\.kv_proj\.", ".wkv."),
    (r"\.gate_proj\.weight$", ".wgate.weight"),  # compressor gate (shared expert handled before)
    (r"\.o_a_proj\.", ".wo_a."),
    (r"\.o_b_proj\.", ".wo_b."),
    (r"\.position_bias$", ".ape"),
    (r"\.compressor\.kv_norm\.", ".compressor.norm."),
    (r"\.gate\.e_score_correction_bias$", ".gate.bias"),
]
_SHARED = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


def canonical(name):
    """Official DeepSeek name of a tensor given its saved or in-memory transformers name."""
    n = name[len("model."):] if name.startswith("model.") else name
    m = re.search(r"\.(?:mlp|ffn)\.shared_experts\.(gate_proj|up_proj|down_proj)\.weight$", n)
    if m:
        return n[: m.start()] + f".ffn.shared_experts.{_SHARED[m.group(1)]}.weight"
    hf_style = any(k in n for k in (".self_attn.", ".mlp.", "embed_tokens", "lm_head", "hc_head.",
                                    "layernorm", "_hc."))
    if hf_style:
        for pat, rep in _HF_RULES:
            n = re.sub(pat, rep, n)
    else:
        n = re.sub(r"\.attn\.norm\.weight$", ".attn.kv_norm.weight", n)  # save_pretrained's KV-norm name
    return n


def split_fused(name, tensor):
    """Fused in-memory expert tensors -> {official per-expert name: tensor}; other tensors pass through."""
    c = canonical(name)
    if c.endswith(".ffn.experts.gate_up_proj"):
        base = c[: -len("gate_up_proj")]
        inter = tensor.shape[1] // 2
        out = {}
        for e in range(tensor.shape[0]):
            out[f"{base}{e}.w1.weight"] = tensor[e, :inter]
            out[f"{base}{e}.w3.weight"] = tensor[e, inter:]
        return out
    if c.endswith(".ffn.experts.down_proj"):
        base = c[: -len("down_proj")]
        return {f"{base}{e}.w2.weight": tensor[e] for e in range(tensor.shape[0])}
    return {c: tensor}


def saved_name(official):
    """Name transformers 5.17 save_pretrained gives the tensor with this official name."""
    if official == "head.weight":
        return official
    if official == "embed.weight":
        return "model.embed_tokens.weight"
    m = re.match(r"^hc_head_(fn|base|scale)$", official)
    if m:
        return f"model.hc_head.hc_{m.group(1)}"
    return "model." + re.sub(r"\.attn\.kv_norm\.weight$", ".attn.norm.weight", official)
