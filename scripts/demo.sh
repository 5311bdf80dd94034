#!/usr/bin/env bash
# One command from a fresh Debian/Ubuntu checkout: set everything up, then run the demo
# (examples/train.py: train on 2 "nodes" with CheckpointManager, lose one node, resume from the
# other node's replicas, export).
# Extra arguments go to the demo, e.g. --workdir DIR or --size tiny.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/python examples/train.py "$@"
