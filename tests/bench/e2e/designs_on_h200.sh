#!/usr/bin/env bash
# Demo designs side by side on the H200 (issue 30: a task where RL visibly adds to SFT): every
# line of DESIGNS is a task with its own SFT, then the arms of ARMS run RL from it, all under one
# MPS server so that every design's pools share the GPU at once. Each design is one
# bench_learning run in WORK/NAME, its JSON and figure in WORK/NAME.json and .png, where
# across_calls.sh collects them when WORK is its WORKDIR. Run it through across_calls.sh (call
# again until it prints `ended`):
#   bash tests/bench/e2e/across_calls.sh /tmp/designs bash tests/bench/e2e/designs_on_h200.sh \
#     /tmp/designs tests/bench/e2e/grids/gpu_demo_designs.txt tests/bench/e2e/grids/one_arm.txt
# A DESIGNS line: NAME CONFIG SFT_STEPS [FLAGS ...] (FLAGS go to the design's SFT and arms).
set -uo pipefail
WORK=$1
DESIGNS=$2
ARMS=$3
STEPS=${STEPS:-250}
export CUDA_MPS_PIPE_DIRECTORY=$WORK/mps CUDA_MPS_LOG_DIRECTORY=$WORK/mps
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY"
nvidia-cuda-mps-control -d
trap 'echo quit | nvidia-cuda-mps-control' EXIT
arms=$(grep -cv '^\(#\|$\)' "$ARMS")
while read -r name config sft_steps flags; do
  case $name in '#'* | '') continue ;; esac
  # shellcheck disable=SC2086  # FLAGS are words, as on a command line
  python3 -m tests.bench.e2e.bench_learning --config "$config" --sft-steps "$sft_steps" \
    --steps "$STEPS" --arms-file "$ARMS" --parallel "$arms" --workdir "$WORK/$name" \
    --out "$WORK/$name.json" -- --trainer.micro-batch-tokens 6656 \
    --inference.gpu-memory-utilization 0.04 --inference.kv-cache-gb 1 \
    --inference.extra-args '["--enforce-eager"]' $flags > "$WORK/$name.log" 2>&1 &
  sleep 10
done < "$DESIGNS"
wait
for json in "$WORK"/*.json; do echo "== $json"; done
