#!/usr/bin/env bash
# Quick start 1: set up, then train the bundled Criteo-shaped example on a local cluster
# (2 parameter servers, 1 embedding worker, 2 NN-worker ranks, 1 data loader).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
ex=examples/criteo_synthetic
exec .venv/bin/persia-launcher local \
  --nn-worker "$ex/train.py" --data-loader "$ex/data_loader.py" \
  --embedding-config "$ex/embedding_config.yml" --global-config "$ex/global_config.yml" \
  --num-ps 2 --num-embedding-workers 1 --nproc-per-node 2 --num-data-loaders 1 "$@"
