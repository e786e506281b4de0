"""Pure-Python (no torch/numpy) re-implementation of the rounding simulations, checked against
tests/data/golden/quantizers/*.npy. Usage: python3 reference/check_quantizers.py [golden_dir]"""
import ast, math, os, struct, sys

d = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "../tests/data/golden/quantizers")


def load(name):
    with open(os.path.join(d, name), "rb") as f:
        f.read(8)
        n = struct.unpack("<H", f.read(2))[0]
        ast.literal_eval(f.read(n).decode())
        data = f.read()
    return list(struct.unpack(f"<{len(data) // 4}f", data))


def f32(x):
    return struct.unpack("<f", struct.pack("<f", x))[0]


def pow2ceil(t):
    m, e = math.frexp(t)
    return math.ldexp(1, e - 1 if m == 0.5 else e)


def e4m3(v):  # round half to even (Python round) on the e4m3 grid incl. subnormals
    if v == 0:
        return 0.0
    m, e = math.frexp(v)
    q = math.ldexp(1, max(e - 1, -6) - 3)
    return round(v / q) * q


def e2m1(v):
    a = abs(v)
    q = 0.5 if a < 2 else (1.0 if a < 4 else 2.0)
    return math.copysign(round(a / q) * q, v)


def bf16(v):
    if v == 0:
        return 0.0
    m, e = math.frexp(v)
    q = math.ldexp(1, e - 8)
    return round(v / q) * q


def blocksim(x, block, floor, qmax, fn):
    out = []
    for i in range(0, len(x), block):
        b = x[i:i + block]
        s = pow2ceil(f32(max(max(abs(v) for v in b), floor) / qmax))  # scale computed in float32
        out += [fn(min(max(v / s, -qmax), qmax)) * s for v in b]
    return out


def mismatches(a, b):
    return sum(1 for u, v in zip(a, b) if f32(u) != v)


fails = 0
for name, got in [("fp8sim64", blocksim(load("fp8sim64_in.npy"), 64, f32(1e-4), 448.0, e4m3)),
                  ("fp4sim32", blocksim(load("fp4sim32_in.npy"), 32, f32(6 * 2 ** -126), 6.0, e2m1)),
                  ("bf16", [bf16(v) for v in load("bf16_in.npy")])]:
    bad = mismatches(got, load(f"{name}_out.npy"))
    fails += bad
    print(f"{name}: {bad} mismatches")
x, y = load("hadamard128_in.npy"), load("hadamard128_out.npy")
H = [[1]]
while len(H) < 128:
    H = [r + r for r in H] + [r + [-v for v in r] for r in H]
err = max(abs(sum(x[i * 128 + k] * H[k][j] for k in range(128)) / math.sqrt(128) - y[i * 128 + j])
          for i in range(len(x) // 128) for j in range(128))
print(f"hadamard128: max abs err {err:.2e} vs exact float64 product")
sys.exit(1 if fails or err > 1e-5 else 0)
