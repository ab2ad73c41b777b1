#!/usr/bin/env bash
# The learning grid (tests/bench/e2e/bench_learning.py) on the H200 machine, across device calls:
# the first call starts the grid in a session of its own (it outlives the call while the machine
# stays warm); every call, the first too, then waits up to $WAIT_S seconds (default 540) and
# copies what the arms committed so far into $OUT: grid.json, grid.png, the grid's log and each
# arm's log tail. Run it again in the next call until the log says the grid ended. A trainer of
# the recipe peaks at 13.8 GiB with one 26,624-token micro-batch: four of 6,656 train the same
# step in ~4 GiB, so $PARALLEL (default 7) arms and their servers fit in the H200's memory.
#   bash tests/bench/e2e/grid_on_h200.sh [ARMS_FILE] [extra bench_learning flags ...]
set -uo pipefail
OUT=${OUT:-/tmp/primeflow-grid-out}
WORK=${WORK:-/tmp/grid}
mkdir -p "$OUT" "$WORK"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
ARMS=${1:-tests/bench/e2e/grids/reverse_text_gpu.txt}
shift || true
if [ ! -f "$WORK/started" ]; then
  touch "$WORK/started"
  setsid nohup python3 -m tests.bench.e2e.bench_learning --config configs/reverse_text/gpu.toml \
    --mps --arms-file "$ARMS" --parallel "${PARALLEL:-7}" --workdir "$WORK" \
    --out "$WORK/grid.json" "$@" -- --trainer.micro-batch-tokens 6656 \
    --inference.gpu-memory-utilization 0.04 --inference.kv-cache-gb 1 \
    --inference.extra-args '["--enforce-eager"]' \
    > "$WORK/grid.log" 2>&1 < /dev/null &
fi
deadline=$(( $(date +%s) + ${WAIT_S:-540} ))
while [ "$(date +%s)" -lt "$deadline" ] && ! grep -q '^| arm ' "$WORK/grid.log" 2>/dev/null; do
  sleep 10
done
cp "$WORK/grid.json" "$WORK/grid.png" "$OUT/" 2>/dev/null
cp "$WORK/grid.log" "$OUT/grid.log"
for log in "$WORK"/arm-*.log; do tail -n 20 "$log"; done > "$OUT/arm-tails.log" 2>/dev/null
tail -n 30 "$WORK/grid.log"
nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv; uptime
