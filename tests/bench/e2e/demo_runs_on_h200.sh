#!/usr/bin/env bash
# The GPU demo's runs at once on one H200 (issue 30: its targets hold on every run): one
# `primeflow pipeline @ configs/reverse_text/gpu.toml --run.seed N` per SEED, through
# pipelines_on_h200.sh (one MPS server, one Prefect server, only the memory settings lowered).
# Each run's log is WORK/demo-seedN.log; the printed tables and wall times end up in
# WORK/pipelines.txt. Run it through across_calls.sh (call again until it prints `ended`):
#   bash tests/bench/e2e/across_calls.sh /tmp/demo bash tests/bench/e2e/demo_runs_on_h200.sh \
#     /tmp/demo 0 1 2
set -uo pipefail
WORK=$1
shift
runs=()
for seed in "$@"; do
  runs+=("demo-seed$seed" "@ configs/reverse_text/gpu.toml --run.seed $seed")
done
exec bash "$(dirname "$0")/pipelines_on_h200.sh" "$WORK" "${runs[@]}"
