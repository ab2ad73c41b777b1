#!/usr/bin/env bash
# Issue 30 item 2's paired comparison on one GPU, most needed first, for a device call chain
# that may be cut short. First the policy delta in frames against one frame (half a minute).
# Then, from one SFT checkpoint: primeflow with dynamic sampling on three vLLM servers; TRL's
# GRPOTrainer; primeflow with the filter on two servers (a pool of its own, started once the
# three-server one has stopped: across sessions two servers looked as fast as three, and three
# swap a policy in ~2.5x as long as one), without the filter (what the filter costs in wall
# time, the pairing `configs/reverse_text/gpu.toml` needs before it ships the filter), and with
# the filter and 384 rollouts in flight (room for the launches' margin). Four servers sampled no
# faster than three (thirteenth session). The GPU tests last. TRL comes as its wheel (no
# package index on the GPU machine): `pip download --no-deps --only-binary=:all:
# --python-version 3.12 trl==1.16.0` here, carried with the call, installed into
# ../shared/gpu-vllm's /tmp/site. Run it through across_calls.sh (call again until it prints
# `ended`):
#   bash tests/bench/e2e/across_calls.sh /tmp/s bash tests/bench/e2e/reference_on_h200.sh \
#     /tmp/s .gpu-trl/trl-1.16.0-py3-none-any.whl
set -uo pipefail
WORK=$1
TRL_WHEEL=$2
python3 -m pip install --no-index --no-deps --target /tmp/site "$TRL_WHEEL" \
  > "$WORK/trl-install.txt" 2>&1 || echo "TRL's install failed: $WORK/trl-install.txt"
python3 -m tests.bench.storage.bench_delta_frames --device cuda > "$WORK/delta-frames.txt" 2>&1
echo "delta frames rc=$?"
FILTER='[{"type":"difficulty"}]'
REFERENCE=(python3 -m tests.bench.e2e.bench_reference --config configs/reverse_text/gpu.toml
  --sft-steps 100 --steps 150 --eval-every 25 --trl-python python3)
THREE=(--inference.num-servers 3 --inference.gpu-ids 0 0 0 --inference.gpu-memory-utilization 0.1)
TWO='--inference.num-servers 2 --inference.gpu-ids 0 0 --inference.gpu-memory-utilization 0.12'
"${REFERENCE[@]}" --workdir "$WORK/ref" --out "$WORK/reference.json" \
  --arm "two-servers=$TWO" --arm 'no-filter=--orchestrator.filters []' \
  --arm 'filter-384=--orchestrator.max-concurrent 384' \
  -- "${THREE[@]}" --orchestrator.filters "$FILTER" --orchestrator.max-concurrent 256
echo "reference rc=$?"
python3 -m pytest -x -q -p no:cacheprovider tests/gpu/test_rl_gpu.py tests/gpu/test_deltas_gpu.py \
  > "$WORK/gpu-tests.txt" 2>&1
echo "gpu tests rc=$?"
