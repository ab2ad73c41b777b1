#!/usr/bin/env bash
# Issue 30 item 2's paired comparison on one GPU, most needed first, for a device call chain
# that may be cut short. From one SFT checkpoint: primeflow with dynamic sampling on three vLLM
# servers; TRL's GRPOTrainer; the same primeflow with the launch margin
# (`orchestrator.launch_margin_sd 2`: faster in the loop's model, but its surplus lands two
# versions behind the trainer, and both arms with it fell hard once in the fourteenth session);
# and without the filter (what the filter costs in wall time, the pairing
# `configs/reverse_text/gpu.toml` needs before it ships the filter), after the GPU tests. Two servers were no faster than three (fourteenth
# session), four no faster than three (thirteenth). TRL comes as its wheel (no package index on
# the GPU machine): `pip download --no-deps --only-binary=:all: --python-version 3.12
# trl==1.16.0` here, carried with the call, installed into ../shared/gpu-vllm's /tmp/site. Run
# it through across_calls.sh (call again until it prints `ended`):
#   bash tests/bench/e2e/across_calls.sh /tmp/s bash tests/bench/e2e/reference_on_h200.sh \
#     /tmp/s .gpu-trl/trl-1.16.0-py3-none-any.whl
set -uo pipefail
WORK=$1
TRL_WHEEL=$2
python3 -m pip install --no-index --no-deps --target /tmp/site "$TRL_WHEEL" \
  > "$WORK/trl-install.txt" 2>&1 || echo "TRL's install failed: $WORK/trl-install.txt"
FILTER='[{"type":"difficulty"}]'
REFERENCE=(python3 -m tests.bench.e2e.bench_reference --config configs/reverse_text/gpu.toml
  --sft-steps 100 --steps 150 --eval-every 25 --trl-python python3)
THREE=(--inference.num-servers 3 --inference.gpu-ids 0 0 0 --inference.gpu-memory-utilization 0.1)
"${REFERENCE[@]}" --workdir "$WORK/ref" --out "$WORK/reference.json" \
  --arm 'margin-2=--orchestrator.launch-margin-sd 2' \
  -- "${THREE[@]}" --orchestrator.filters "$FILTER" --orchestrator.max-concurrent 256
echo "reference rc=$?"
python3 -m pytest -x -q -p no:cacheprovider tests/gpu/test_rl_gpu.py tests/gpu/test_deltas_gpu.py \
  > "$WORK/gpu-tests.txt" 2>&1
echo "gpu tests rc=$?"
"${REFERENCE[@]}" --workdir "$WORK/no-filter" --out "$WORK/no-filter.json" --skip-reference \
  --sft-checkpoint "file://$WORK/ref/sft/sft/checkpoints/step_000100" \
  -- "${THREE[@]}" --orchestrator.filters '[]' --orchestrator.max-concurrent 256
echo "no-filter rc=$?"
