"""torchtitan's checkpoint manager: pyckpt's (PyckptCheckpointManager) vs torchtitan's own,
same job, same run: blocking time per save (``checkpointer.save``, what the training loop waits
for) and bytes on disk per step folder, medians with [min-max] over the saves.

    PYTHONPATH=$PWD python benchmarks/integration_torchtitan.py            # ~1 min on 2 cores
    PYTHONPATH=$PWD python benchmarks/integration_torchtitan.py --dim 512 --saves 5

Two gloo ranks on CPU, the tiny FSDP2 decoder of tests/_torchtitan_workers.py (``--dim`` sets its
width), async_mode "disabled" and "async" (blocking time then excludes the background write).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from typing import Any

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(_ROOT, "tests"))


def _du(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def _worker(rank: int, world: int, tmp: str, saves: int) -> dict[str, Any]:
    import warnings

    warnings.filterwarnings("ignore", category=UserWarning)
    from _torchtitan_workers import Job
    from torchtitan.components.checkpoint import CheckpointManager

    from pyckpt.integrations.torchtitan import PyckptCheckpointManager

    out: dict[str, Any] = {}
    variants = [("torchtitan", CheckpointManager, {}),
                ("pyckpt", PyckptCheckpointManager, {}),
                ("pyckpt+zstd", PyckptCheckpointManager, {"compression": "zstd"})]
    for mode in ("disabled", "async"):
        for name, cls, extra in variants:
            folder = f"{name}-{mode}"
            config = cls.Config(enable=True, folder=folder, interval=1, async_mode=mode,
                                keep_latest_k=0, **extra)
            job = Job(config, tmp)
            times = []
            for step in range(1, saves + 1):
                job.checkpointer.interval = 10**9  # a training step without its save...
                job.train(step)
                job.checkpointer.interval = 1  # ...then the trainer's interval save, timed
                t = time.perf_counter()
                job.checkpointer.save(step)
                times.append(time.perf_counter() - t)
            job.close()
            out[f"{name} {mode}"] = (times, _du(os.path.join(tmp, folder, "step-1")))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--saves", type=int, default=5)
    args = parser.parse_args()
    os.environ["PYCKPT_TT_DIM"] = str(args.dim)
    from dist_utils import run_distributed

    with tempfile.TemporaryDirectory() as tmp:
        results = run_distributed(_worker, 2, tmp, args.saves)
    print(f"torchtitan checkpoint manager, 2 ranks, dim {args.dim}, {args.saves} saves each")
    print(f"{'variant':<26}{'blocking ms, median [min-max]':<34}{'bytes/step':>12}")
    for name, (times, size) in results[0].items():
        ms = [1000 * x for x in times]
        print(f"{name:<26}{statistics.median(ms):8.1f} [{min(ms):.1f}-{max(ms):.1f}]"
              f"{'':<14}{size:>12,}")


if __name__ == "__main__":
    main()
