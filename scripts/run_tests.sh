#!/usr/bin/env bash
# Quick start 2: set up, then run the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
# Most tests start processes that import persia_py: compiled once here, they read its
# bytecode instead of each compiling the sources again where PYTHONDONTWRITEBYTECODE is
# set (docs/benchmarks.md#test-suite).
.venv/bin/python -m compileall -q persia_py examples benchmarks >/dev/null
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@" tests
