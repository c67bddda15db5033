#!/usr/bin/env bash
# Regenerate persia_py/proto/*_pb2*.py from proto/ (the generated code is committed).
set -euo pipefail
cd "$(dirname "$0")/.."
python -m grpc_tools.protoc -Iproto --python_out=. --pyi_out=. --grpc_python_out=. proto/persia_py/proto/*.proto
