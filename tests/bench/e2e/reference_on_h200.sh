#!/usr/bin/env bash
# Issue 30 item 2's paired comparison on one GPU, most needed first, for a device call chain
# that may be cut short: the reference (primeflow with dynamic sampling and room in flight for
# the groups it drops, on two vLLM servers, then TRL's GRPOTrainer from the same SFT
# checkpoint); the GPU tests; then, from that SFT checkpoint, primeflow without the filter, with
# it and 256 rollouts in flight (the twelfth session's paired run sampled slower with 512 than
# the tenth's unpaired one with 256), and with it on three servers. TRL comes as its wheel (no
# package index on the GPU machine): `pip download --no-deps --only-binary=:all:
# --python-version 3.12 trl==1.16.0` here, carried with the call, installed into
# ../shared/gpu-vllm's /tmp/site. Run it through
# across_calls.sh (call again until it prints `ended`):
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
FILTERED=(--inference.num-servers 2 --inference.gpu-ids 0 0 --inference.gpu-memory-utilization 0.12
  --orchestrator.filters "$FILTER" --orchestrator.max-concurrent 512)
"${REFERENCE[@]}" --workdir "$WORK/ref" --out "$WORK/reference.json" -- "${FILTERED[@]}"
echo "reference rc=$?"
python3 -m pytest -x -q -p no:cacheprovider tests/gpu/test_rl_gpu.py tests/gpu/test_deltas_gpu.py \
  > "$WORK/gpu-tests.txt" 2>&1
echo "gpu tests rc=$?"
SFT=$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["sft_checkpoint"])' \
  "$WORK/reference.json")
"${REFERENCE[@]}" --sft-checkpoint "$SFT" --skip-reference --workdir "$WORK/arms" \
  --out "$WORK/arms.json" \
  --arm 'filter-256=--orchestrator.filters '"$FILTER"' --orchestrator.max-concurrent 256' \
  --arm 'three-servers=--inference.num-servers 3 --inference.gpu-ids 0 0 0 --orchestrator.filters '"$FILTER"' --orchestrator.max-concurrent 512' \
  -- "${FILTERED[@]}" --orchestrator.filters '[]' --orchestrator.max-concurrent 256
echo "arms rc=$?"
