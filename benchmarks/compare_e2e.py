"""End-to-end save/load comparison of pyckpt against DCP in one run (same as `pyckpt bench`).

    python benchmarks/compare_e2e.py --workload llm --size-gib 2 --repeats 3 --json llm.json
    python benchmarks/compare_e2e.py --workload minilm
"""

from __future__ import annotations

import argparse
import sys

from pyckpt import bench

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    bench.add_arguments(parser)
    sys.exit(bench.run_cli(parser.parse_args()))
