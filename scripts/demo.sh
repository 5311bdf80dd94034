#!/usr/bin/env bash
# One command from a fresh Debian/Ubuntu checkout: set everything up, then run the demo.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/python examples/demo.py "$@"
