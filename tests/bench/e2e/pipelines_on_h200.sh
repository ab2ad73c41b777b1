#!/usr/bin/env bash
# Several pipelines at once on one H200: `primeflow pipeline ARGS` for each NAME ARGS pair, under
# one MPS server, against one Prefect server, each with the memory settings lowered so that the
# pools fit beside each other (a run's wall time, beside the others, bounds its time alone). Each
# run's log is WORK/NAME.log; its printed table and wall time end up in WORK/pipelines.txt, its
# evaluations' summaries and first answers in WORK/NAME-samples.json (`eval_samples`), its RL
# steps' health and training rollouts in WORK/NAME-steps.txt (`step_health`), its report's
# reward figure in WORK/NAME-reward.png. Run
# it through across_calls.sh (call again until it prints `ended`), e.g. the agentic examples:
#   bash tests/bench/e2e/across_calls.sh /tmp/a bash tests/bench/e2e/pipelines_on_h200.sh /tmp/a \
#     tool-math "@ configs/agentic/tool_math.toml @ configs/agentic/on_gpu.toml" \
#     wordle "@ configs/agentic/wordle.toml @ configs/agentic/on_gpu.toml"
# Beside a grid (grid_on_h200.sh, WORK /tmp/grid), under its MPS server: prefix the command with
#   CUDA_MPS_PIPE_DIRECTORY=/tmp/grid/mps CUDA_MPS_LOG_DIRECTORY=/tmp/grid/mps
set -uo pipefail
WORK=$1
shift
export PRIMEFLOW_HOME=$WORK/home
mkdir -p "$PRIMEFLOW_HOME"
# Join the MPS server named by CUDA_MPS_PIPE_DIRECTORY where one runs there (a grid's, so both
# share the card at once: two MPS servers on one card would time-slice it); else start one.
if [ -n "${CUDA_MPS_PIPE_DIRECTORY:-}" ] && echo get_server_list | nvidia-cuda-mps-control > /dev/null 2>&1; then
  trap 'python3 -m flows.cli server stop' EXIT
else
  export CUDA_MPS_PIPE_DIRECTORY=$WORK/mps CUDA_MPS_LOG_DIRECTORY=$WORK/mps
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY"
  nvidia-cuda-mps-control -d
  trap 'echo quit | nvidia-cuda-mps-control; python3 -m flows.cli server stop' EXIT
fi
python3 -m flows.cli server start
while [ $# -ge 2 ]; do
  name=$1 args=$2
  shift 2
  (
    began=$(date +%s)
    # shellcheck disable=SC2086 # ARGS is a list of words
    python3 -m flows.cli pipeline $args --run.name "$name" --storage.uri "file://$WORK/runs" \
      --inference.gpu-memory-utilization 0.1 --inference.kv-cache-gb 4 > "$WORK/$name.log" 2>&1
    code=$?
    {
      echo "== $name: rc $code, wall $(($(date +%s) - began)) s"
      grep -A8 '^ *policy ' "$WORK/$name.log"
    } >> "$WORK/pipelines.txt"
    # What the policies answered, beside their rewards (across_calls.sh brings WORK/*.json back)
    python3 -m tests.bench.e2e.eval_samples "$WORK/runs/$name" "$WORK/$name-samples.json"
    # Its health step by step and what it wrote in training (where a collapse starts)
    python3 -m tests.bench.e2e.step_health "$WORK/runs/$name" "$WORK/$name-steps.txt"
    cp "$WORK/runs/$name/report/reward.png" "$WORK/$name-reward.png"
  ) &
  sleep 30 # the servers start one after another, so each sizes its memory alone
done
wait
cat "$WORK/pipelines.txt"
