"""MTP golden for tests/data/golden/tiny-mtp (reference/make_tiny_mtp.py builds the checkpoint).

Runs dsv4_ref's main forward over a fixed sequence with fp32 numerics and no KV / indexer rounding (kv f32,
indexer f32), then its MTP block on the pairs (X_i, ids[i+1]), and writes
  mtp_logits.npy      float32 [S-1, vocab]: row i = the MTP block's logits after the pair of position i
  mtp_logits_f64.npy  the same computed in float64 (the fp32 rounding the engine may show against it)
  mtp_ids.npy         int32 [S] the sequence
Needs torch + numpy (the GPU machine's Python). Run from the repository root: python3 reference/mtp_golden.py
"""
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dsv4_ref  # noqa: E402

DIR = "tests/data/golden/tiny-mtp"
# 150 tokens: past the 128-slot window of the MTP block; the same ids as the C++ MTP tests ((i * 37 + 11) % 1000).
IDS = [(i * 37 + 11) % 1000 for i in range(150)]


def main():
    model = dsv4_ref.load(DIR)
    for dtype, name in ((torch.float32, "mtp_logits"), (torch.float64, "mtp_logits_f64")):
        num = dsv4_ref.Numerics(dtype, "f32", "f32")
        _, X = dsv4_ref.forward(model, IDS, num, streams=True)
        logits = dsv4_ref.mtp_forward(model, X[:-1], IDS[1:], num)
        np.save(os.path.join(DIR, name + ".npy"), logits.float().numpy())
    np.save(os.path.join(DIR, "mtp_ids.npy"), np.array(IDS, dtype=np.int32))
    print(f"{DIR}: MTP logits {tuple(logits.shape)}")


if __name__ == "__main__":
    main()
