#!/usr/bin/env bash
# The learning grid (tests/bench/e2e/bench_learning.py) on the H200 machine, across device calls
# (across_calls.sh: call it again until it prints `ended`). A trainer of the recipe peaks at
# 13.8 GiB with one 26,624-token micro-batch: four of 6,656 train the same step in ~4 GiB, so
# $PARALLEL (default 7) arms and their servers fit in the H200's memory (an H100's too: a server
# holds 1 GiB of KV cache). The servers capture CUDA graphs: the first grid ran them eager to fit
# 13 arms at once and sampled ~600 tokens/s a server, which set its pace.
#   bash tests/bench/e2e/grid_on_h200.sh [ARMS_FILE] [extra bench_learning flags ...]
set -uo pipefail
WORK=${WORK:-/tmp/grid}
ARMS=${1:-tests/bench/e2e/grids/reverse_text_gpu.txt}
shift || true
exec bash "$(dirname "$0")/across_calls.sh" "$WORK" python3 -m tests.bench.e2e.bench_learning \
  --config configs/reverse_text/gpu.toml --mps --arms-file "$ARMS" --parallel "${PARALLEL:-7}" \
  --workdir "$WORK" --out "$WORK/grid.json" "$@" -- --trainer.micro-batch-tokens 6656 \
  --inference.gpu-memory-utilization 0.05 --inference.kv-cache-gb 1
