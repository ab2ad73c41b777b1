#!/usr/bin/env bash
# Issue 30 item 2's paired comparison on one GPU, from one SFT checkpoint: primeflow with
# dynamic sampling on three vLLM servers under PPO's clipped surrogate, and TRL's GRPOTrainer.
# The filter's arm under AIPO dipped by step 25 in earlier sessions: its surplus groups landed a
# batch late, two versions behind the trainer (117 of 150 steps in the sixteenth session),
# weighted by AIPO's ratio with no trust region. On the CPU demo PPO's clip raised greedy more
# than AIPO on three seeds of three (2026-12-07); here the recipe keeps the late groups
# (`max_off_policy_steps` 8) under PPO's clip, which gives a token past the clip in its
# advantage's direction no more gradient. Beside two pipelines on the card (2026-12-07) that
# took the dip away; this runs it alone. Another arm on the same checkpoint is `--arm
# 'NAME=FLAGS'` before `--` (it runs after the recipe and TRL).
# The recipe ran under MPS in the sixteenth session without a clear gain, so it runs without.
# Every primeflow arm polls every 10 ms. TRL comes as its wheel (no package index on the GPU
# machine): `pip download --no-deps --only-binary=:all: --python-version 3.12 trl==1.16.0`
# here, carried with the call, installed into ../shared/gpu-vllm's /tmp/site. Run it through
# across_calls.sh (call again until it prints `ended`):
#   bash tests/bench/e2e/across_calls.sh /tmp/s bash tests/bench/e2e/reference_on_h200.sh \
#     /tmp/s .gpu-trl/trl-1.16.0-py3-none-any.whl
set -uo pipefail
WORK=$1
TRL_WHEEL=$2
python3 -m pip install --no-index --no-deps --target /tmp/site "$TRL_WHEEL" \
  > "$WORK/trl-install.txt" 2>&1 || echo "TRL's install failed: $WORK/trl-install.txt"
# The trainer's wait for a batch and the orchestrator's for a policy version are both on the
# loop's latency chain (half a poll each on average: ~25 ms a step at the default 0.05 s); on
# a local store a poll is a stat or a listing.
python3 -m tests.bench.e2e.bench_reference --config configs/reverse_text/gpu.toml \
  --sft-steps 100 --steps 150 --eval-every 25 --trl-python python3 \
  --workdir "$WORK/ref" --out "$WORK/reference.json" \
  -- --trainer.loss.type ppo_clip --inference.num-servers 3 --inference.gpu-ids 0 0 0 --inference.gpu-memory-utilization 0.1 \
  --trainer.poll-interval-s 0.01 --orchestrator.poll-interval-s 0.01 \
  --orchestrator.filters '[{"type":"difficulty"}]' --orchestrator.max-concurrent 256
echo "reference rc=$?"
