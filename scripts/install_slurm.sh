#!/usr/bin/env bash
# Installs what the Slurm tests need (tests/slurm_cluster.py: Debian's slurm-wlm and munge)
# where it is missing. It never fails the caller: where it cannot install (not root, no
# apt-get, apt unreachable) it prints why on stdout and exits 1, and scripts/run_tests.sh
# hands that reason to the tests, which skip with it. Silent and quick when all is there.
set -uo pipefail

# tests/slurm_cluster.py's COMMANDS
needed=(munged slurmctld slurmd sbatch srun scontrol sinfo scancel)
missing=()
for cmd in "${needed[@]}"; do
  command -v "$cmd" >/dev/null 2>&1 || missing+=("$cmd")
done
[ ${#missing[@]} -eq 0 ] && exit 0

if [ "$(id -u)" != 0 ]; then
  echo "not installed (${missing[*]} missing) and not root: apt-get install slurm-wlm munge as root"
  exit 1
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "not installed (${missing[*]} missing) and no apt-get to install slurm-wlm and munge with"
  exit 1
fi
log=$(mktemp)
trap 'rm -f "$log"' EXIT
export DEBIAN_FRONTEND=noninteractive
# bounded: an unreachable mirror must not hold the test suite for long
if ! timeout 300 apt-get update -qq >"$log" 2>&1 \
    || ! timeout 600 apt-get install -y -qq --no-install-recommends slurm-wlm munge \
      >>"$log" 2>&1; then
  echo "apt-get could not install slurm-wlm and munge: $(tail -n 3 "$log" | tr '\n' ' ')"
  exit 1
fi
for cmd in "${missing[@]}"; do
  if ! command -v "$cmd" >/dev/null 2>&1; then
    echo "slurm-wlm and munge installed, yet $cmd is missing"
    exit 1
  fi
done
echo "installed slurm-wlm and munge for the Slurm tests" >&2
