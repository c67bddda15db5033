#!/usr/bin/env bash
# Quick start 2: set up, then run the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
# Slurm and munge for tests/test_slurm_cluster.py and the tests on its cluster; where they
# cannot be installed those tests skip, saying why (PERSIA_SLURM_UNAVAILABLE).
if ! slurm_missing=$(bash scripts/install_slurm.sh); then
  export PERSIA_SLURM_UNAVAILABLE="$slurm_missing"
  echo "the Slurm tests will skip: $slurm_missing" >&2
fi
# Most tests start processes that import persia_py: compiled once here, they read its
# bytecode instead of each compiling the sources again where PYTHONDONTWRITEBYTECODE is
# set (docs/benchmarks.md#test-suite).
.venv/bin/python -m compileall -q persia_py servers workers examples benchmarks >/dev/null
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@" tests
