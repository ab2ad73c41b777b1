#!/usr/bin/env bash
# A benchmark longer than one device call (10 min), on a machine that stays warm while the next
# call comes at once: the first call starts COMMAND in a session of its own (it outlives the
# call) with its output in WORKDIR/run.log and its exit status in WORKDIR/rc when it ends; every
# call, the first too, then waits up to $WAIT_S seconds (default 540) for it to end and copies
# what it has so far into $OUT as three files: run.log, the last lines of every other log under
# WORKDIR (tails.log), and WORKDIR's *.json, *.png, *.txt and *.tgz in results.tgz (a call
# brings back at most 8 files: two pipelines' outputs alone were more, and the rest stayed
# behind). Call it again (same WORKDIR, any COMMAND) until it prints `ended rc=N`; here,
# `tar xzf results.tgz` in the call's files folder.
#   bash tests/bench/e2e/across_calls.sh WORKDIR COMMAND [ARGS ...]
set -uo pipefail
WORK=$1
shift
OUT=${OUT:-$WORK/out}
mkdir -p "$OUT" "$WORK"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
if [ ! -f "$WORK/started" ]; then
  touch "$WORK/started"
  setsid nohup bash -c '"$@" > "$0/run.log" 2>&1 < /dev/null; echo $? > "$0/rc"' "$WORK" "$@" &
fi
deadline=$(($(date +%s) + ${WAIT_S:-540}))
while [ "$(date +%s)" -lt "$deadline" ] && [ ! -f "$WORK/rc" ]; do
  sleep 5
done
(cd "$WORK" && find . -maxdepth 1 -type f \( -name '*.json' -o -name '*.png' -o -name '*.txt' \
  -o -name '*.tgz' \) -print0 | tar czf "$OUT/results.tgz" --null -T -)
cp "$WORK/run.log" "$OUT/run.log"
find "$WORK" -maxdepth 2 -name '*.log' ! -name run.log ! -path "$OUT/*" -size -64M \
  -exec sh -c 'for f; do echo "== $f"; tail -n 15 "$f"; done' sh {} + > "$OUT/tails.log" 2>/dev/null
tail -n 25 "$WORK/run.log"
if [ -f "$WORK/rc" ]; then echo "ended rc=$(cat "$WORK/rc")"; else echo "still running"; fi
nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv 2>/dev/null
uptime
