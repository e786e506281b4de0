"""Builds tests/data/golden/tiny-mtp: models/tiny plus an MTP block (spec 5), for the MTP tests and goldens.

Pure Python (no torch / numpy), so it runs anywhere:
  * config.json            models/tiny's, with num_nextn_predict_layers = 1
  * model.safetensors      a symlink to models/tiny's weights (unchanged)
  * mtp.safetensors        the MTP block under the official names with the saved-checkpoint "model." prefix:
                           layer 0's attention and hc_attn (sliding window), layer 3's gated MoE and hc_ffn, the
                           main model's final collapse as its hc_head_*, e_proj / h_proj of reproducible random
                           values (xorshift64*, uniform in [-0.25, 0.25)), enorm / hnorm / norm of ones
  * model.safetensors.index.json   the weight map over both files
Run from the repository root: python3 reference/make_tiny_mtp.py
"""
import json
import os
import struct

SRC = "models/tiny"
OUT = "tests/data/golden/tiny-mtp"


def read_safetensors(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    header.pop("__metadata__", None)
    return {k: (v["dtype"], v["shape"], data[v["data_offsets"][0]:v["data_offsets"][1]]) for k, v in header.items()}


def write_safetensors(path, tensors):
    header, offset, blobs = {}, 0, []
    for name in sorted(tensors):
        dtype, shape, blob = tensors[name]
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(blob)]}
        offset += len(blob)
        blobs.append(blob)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def main():
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(SRC, "config.json")) as f:
        config = json.load(f)
    config["num_nextn_predict_layers"] = 1
    with open(os.path.join(OUT, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
    link = os.path.join(OUT, "model.safetensors")
    if not os.path.lexists(link):
        os.symlink("../../../../models/tiny/model.safetensors", link)

    main_tensors = read_safetensors(os.path.join(SRC, "model.safetensors"))
    mtp = {}
    for name, t in main_tensors.items():
        for src, keep in (("model.layers.0.", "attn"), ("model.layers.3.", "ffn")):
            if name.startswith(src) and keep in name:
                mtp["model.mtp.0." + name[len(src):]] = t
        if name.startswith("model.hc_head.hc_"):
            mtp["model.mtp.0.hc_head_" + name[len("model.hc_head.hc_"):]] = t
    D = config["hidden_size"]
    state = 12345

    def uniform():
        nonlocal state
        state ^= state >> 12
        state ^= (state << 25) & 0xFFFFFFFFFFFFFFFF
        state ^= state >> 27
        return ((state * 0x2545F4914F6CDD1D) & 0xFFFFFFFFFFFFFFFF) / 2.0 ** 64 - 0.5

    for proj in ("e_proj", "h_proj"):
        mtp[f"model.mtp.0.{proj}.weight"] = ("F32", [D, D], struct.pack(f"<{D * D}f", *[uniform() * 0.5 for _ in range(D * D)]))
    for norm in ("enorm", "hnorm", "norm"):
        mtp[f"model.mtp.0.{norm}.weight"] = ("F32", [D], struct.pack(f"<{D}f", *([1.0] * D)))
    write_safetensors(os.path.join(OUT, "mtp.safetensors"), mtp)

    weight_map = {name: "model.safetensors" for name in main_tensors}
    weight_map.update({name: "mtp.safetensors" for name in mtp})
    with open(os.path.join(OUT, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=1)
        f.write("\n")
    print(f"{OUT}: {len(mtp)} MTP tensors next to {len(main_tensors)} of models/tiny")


if __name__ == "__main__":
    main()
