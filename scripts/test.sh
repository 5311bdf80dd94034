#!/usr/bin/env bash
# Sets up (idempotently, see scripts/setup.sh) and runs the whole test suite, then a smoke run of
# the benchmarks (timings disabled). Extra arguments go to the test pytest run.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
# .venv/bin/pytest (not "python -m pytest", which puts the checkout on sys.path) imports the
# installed package, never the source tree.
export PYTHONDEVMODE=1 HYPOTHESIS_PROFILE=${HYPOTHESIS_PROFILE:-ci}
.venv/bin/pytest -p no:cacheprovider --rootdir=. -c pyproject.toml tests "$@"
.venv/bin/pytest -p no:cacheprovider --rootdir=. -c pyproject.toml benchmarks \
  --benchmark-disable -q -o testpaths=benchmarks
