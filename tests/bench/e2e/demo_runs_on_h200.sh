#!/usr/bin/env bash
# The GPU demo's runs at once on one H200 (issue 30: its targets hold on every run): one
# `primeflow pipeline @ configs/reverse_text/gpu.toml --run.seed N` per SEED, under one MPS
# server, against one Prefect server. Only the memory settings differ from the shipped config
# (three pools must share the GPU); each run's wall time, beside two others, bounds the time
# of a run alone. Each run's log is WORK/seedN.log; its printed table and wall time end up in
# WORK/demo.txt. Run it through across_calls.sh (call again until it prints `ended`):
#   bash tests/bench/e2e/across_calls.sh /tmp/demo bash tests/bench/e2e/demo_runs_on_h200.sh \
#     /tmp/demo 0 1 2
set -uo pipefail
WORK=$1
shift
export CUDA_MPS_PIPE_DIRECTORY=$WORK/mps CUDA_MPS_LOG_DIRECTORY=$WORK/mps PRIMEFLOW_HOME=$WORK/home
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$PRIMEFLOW_HOME"
nvidia-cuda-mps-control -d
trap 'echo quit | nvidia-cuda-mps-control; python3 -m flows.cli server stop' EXIT
python3 -m flows.cli server start
for seed in "$@"; do
  (
    began=$(date +%s)
    python3 -m flows.cli pipeline @ configs/reverse_text/gpu.toml --run.seed "$seed" \
      --run.name "demo-seed$seed" --storage.uri "file://$WORK/runs" \
      --inference.gpu-memory-utilization 0.1 --inference.kv-cache-gb 4 > "$WORK/seed$seed.log" 2>&1
    code=$?
    {
      echo "== seed $seed: rc $code, wall $(($(date +%s) - began)) s"
      grep -A4 '^ *policy ' "$WORK/seed$seed.log"
    } >> "$WORK/demo.txt"
  ) &
  sleep 30 # the servers start one after another, so each sizes its memory alone
done
wait
cat "$WORK/demo.txt"
