"""Peak memory of parsing large safetensors headers: pyckpt's parser vs ``safetensors.safe_open``.

Generates synthetic files whose header is large (data sections stay tiny: zero-element tensors
or 1-byte tensors), then parses each in a fresh process and reports its peak RSS growth.

Usage: python benchmarks/st_header_memory.py [--dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import subprocess
import sys
import tempfile

__all__ = ["make_header_file", "main"]

CASES = {
    # ~96 MB header: 400k tensors with 180-character names and rank-4 shapes.
    "96MB_long_names": dict(n=400_000, name_len=180, rank=4),
    # 1M tensors with short names (the parser's tensor cap is 2**20).
    "1M_tensors": dict(n=1_000_000, name_len=12, rank=1),
}


def make_header_file(path: str, n: int, name_len: int, rank: int) -> int:
    """Writes a valid safetensors file of `n` U8 tensors of one byte; returns the header size."""
    parts = ['{"__metadata__":{"format":"pt"}']
    shape = json.dumps([1] * rank, separators=(",", ":"))
    for i in range(n):
        name = f"t{i:0{name_len - 1}d}"
        parts.append(f',"{name}":{{"dtype":"U8","shape":{shape},"data_offsets":[{i},{i + 1}]}}')
    parts.append("}")
    header = "".join(parts).encode()
    header += b" " * (-len(header) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header)))
        f.write(header)
        f.write(bytes(n))
    return len(header)


_CHILD = """
import resource, sys
sys.path.insert(0, sys.argv[3])
which, path = sys.argv[1], sys.argv[2]
if which == "pyckpt":
    from pyckpt import _C
    parse = lambda p: len(_C.read_safetensors_header(p)["tensors"])
else:
    from safetensors import safe_open
    def parse(p):
        with safe_open(p, framework="numpy") as f:
            return len(f.keys())
def hwm_kib():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
# ru_maxrss is inherited across fork/exec, so the peak is reset here (Linux >= 4.0) and read back.
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
before = hwm_kib()
try:
    n = parse(path)
except Exception as e:
    n = type(e).__name__
print((hwm_kib() - before) / 1024, n)
"""


def _measure(which: str, path: str, root: str) -> tuple[float, str]:
    out = subprocess.run([sys.executable, "-c", _CHILD, which, path, root], check=True,
                         capture_output=True, text=True).stdout.split()
    return float(out[0]), out[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=None, help="where to write the synthetic files")
    args = ap.parse_args()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        print(f"{'case':<18} {'header MB':>9} {'pyckpt MiB':>11} {'safetensors MiB':>16}  tensors")
        for name, spec in CASES.items():
            path = os.path.join(d, name + ".safetensors")
            hlen = make_header_file(path, **spec)
            ours, n1 = _measure("pyckpt", path, root)
            ref, n2 = _measure("safetensors", path, root)
            print(f"{name:<18} {hlen / 1e6:>9.1f} {ours:>11.0f} {ref:>16.0f}  {n1} / {n2}")
            os.unlink(path)


if __name__ == "__main__":
    main()
