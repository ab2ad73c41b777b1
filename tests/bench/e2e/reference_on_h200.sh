#!/usr/bin/env bash
# Issue 30 item 2's paired comparison on one GPU, most needed first, for a device call chain
# that may be cut short. From one SFT checkpoint: primeflow with dynamic sampling on three vLLM
# servers; TRL's GRPOTrainer; the same primeflow with the launch margin
# (`orchestrator.launch_margin_sd 2`: 0.87x the filter arm's time in the fifteenth session,
# its surplus trained two versions behind; two of its three runs fell hard once); then both
# again on another seed (`run.seed 1`: other prompts, other samples), since one run per arm
# could not tell 0.008 of held-out greedy apart, nor whether the falls are the margin's. The GPU tests and the arm without the
# filter ran in the fifteenth session (4 passed; the filter ahead per step and per second, the
# second pairing to say so). Two servers were no faster than three (fourteenth session), four
# no faster than three (thirteenth). TRL comes as its wheel (no package index on
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
# The trainer's wait for a batch and the orchestrator's for a policy version are both on the
# loop's latency chain (half a poll each on average: ~25 ms a step at the default 0.05 s); on
# a local store a poll is a stat or a listing.
POLL=(--trainer.poll-interval-s 0.01 --orchestrator.poll-interval-s 0.01)
"${REFERENCE[@]}" --workdir "$WORK/ref" --out "$WORK/reference.json" \
  --arm 'margin-2=--orchestrator.launch-margin-sd 2' \
  --arm 'seed-1=--run.seed 1' \
  --arm 'margin-2-seed-1=--orchestrator.launch-margin-sd 2 --run.seed 1' \
  -- "${THREE[@]}" "${POLL[@]}" --orchestrator.filters "$FILTER" --orchestrator.max-concurrent 256
echo "reference rc=$?"
