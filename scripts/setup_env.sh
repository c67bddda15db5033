#!/usr/bin/env bash
# Create (or refresh) the project's virtual environment in .venv with persia_py installed
# in editable mode, its test tools, and the CPU build of torch. Safe to run repeatedly.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${PERSIA_VENV:-.venv}"
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check \
  -c requirements/cpu-constraints.txt -e ".[test]" 2>&1 | grep -v "^WARNING: Location" || true
"$venv/bin/python" -c "import persia_py.servers, persia_py.workers, torch" >/dev/null
