#!/usr/bin/env bash
# Issue 30 item 2's paired comparison on one GPU, from one SFT checkpoint: primeflow with
# dynamic sampling on three vLLM servers, and TRL's GRPOTrainer, both under NVIDIA MPS, so that
# the trainer and the three servers share the GPU at once instead of taking turns (in the
# fifteenth session, without MPS, 43 of 149 trainer steps took 0.16-0.22 s against a median of
# 0.127 s, with the same tokens). TRL is one process (its vLLM in the trainer's), which MPS
# leaves as it was.
# Every primeflow arm polls every 10 ms. The launch margin (`orchestrator.launch-margin-sd 2`)
# is no longer run: 0.87x the filter arm's time, but two of its three runs fell hard once and
# the third ended lowest (docs/benchmarks.md). TRL comes as its wheel (no package index on the
# GPU machine): `pip download --no-deps --only-binary=:all: --python-version 3.12 trl==1.16.0`
# here, carried with the call, installed into ../shared/gpu-vllm's /tmp/site. Run it through
# across_calls.sh (call again until it prints `ended`):
#   bash tests/bench/e2e/across_calls.sh /tmp/s bash tests/bench/e2e/reference_on_h200.sh \
#     /tmp/s .gpu-trl/trl-1.16.0-py3-none-any.whl
set -uo pipefail
WORK=$1
TRL_WHEEL=$2
python3 -m pip install --no-index --no-deps --target /tmp/site "$TRL_WHEEL" \
  > "$WORK/trl-install.txt" 2>&1 || echo "TRL's install failed: $WORK/trl-install.txt"
REFERENCE=(python3 -m tests.bench.e2e.bench_reference --config configs/reverse_text/gpu.toml
  --sft-steps 100 --steps 150 --eval-every 25 --trl-python python3)
# The trainer's wait for a batch and the orchestrator's for a policy version are both on the
# loop's latency chain (half a poll each on average: ~25 ms a step at the default 0.05 s); on
# a local store a poll is a stat or a listing.
RECIPE=(--inference.num-servers 3 --inference.gpu-ids 0 0 0 --inference.gpu-memory-utilization 0.1
  --trainer.poll-interval-s 0.01 --orchestrator.poll-interval-s 0.01
  --orchestrator.filters '[{"type":"difficulty"}]' --orchestrator.max-concurrent 256)
export CUDA_MPS_PIPE_DIRECTORY=$WORK/mps CUDA_MPS_LOG_DIRECTORY=$WORK/mps
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY"
nvidia-cuda-mps-control -d
trap 'echo quit | nvidia-cuda-mps-control' EXIT
"${REFERENCE[@]}" --workdir "$WORK/ref" --out "$WORK/reference.json" -- "${RECIPE[@]}"
echo "reference rc=$?"
