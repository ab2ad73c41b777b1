#!/usr/bin/env bash
# The trainer's GPU runs on an H200 machine (see docs/benchmarks.md, "Trainer").
#   attention: attention kernels on the benchmark's shape
#   bench: the 1-GPU benchmark (variants in $VARIANTS, default all), then primeflow on 2 GPUs
#   scaling: primeflow on 1 GPU then on $GPUS (default 2), $REPEATS times (default 3), shape
#            $SHAPE (0.6b); each pair's efficiency = N-GPU tokens/s ÷ (N × 1-GPU tokens/s)
#   tests: tests/gpu (2-GPU NCCL equivalence, bf16 + compile, FA2 varlen)
# Logs and JSON go to ${OUT:-/tmp/primeflow-bench}.
set -uo pipefail
OUT=${OUT:-/tmp/primeflow-bench}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.device_count(), 'GPUs')"
for stage in "$@"; do
  case "$stage" in
    attention)
      CUDA_VISIBLE_DEVICES=0 timeout 60 python3 -m tests.bench.trainer.bench_attention 2>&1 | tee "$OUT/attention.log" ;;
    bench)
      CUDA_VISIBLE_DEVICES=0 timeout 330 python3 -m tests.bench.trainer.bench_trainer \
        ${VARIANTS:+--variants "$VARIANTS"} --json "$OUT/bench_1gpu.json" 2>&1 \
        | tee "$OUT/bench_1gpu.log" | grep -v -i warn | tail -12
      if [ "$(python3 -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then
        timeout 180 torchrun --standalone --nproc-per-node 2 -m tests.bench.trainer.bench_trainer \
          --variants primeflow --json "$OUT/bench_2gpu.json" 2>&1 | tee "$OUT/bench_2gpu.log" \
          | grep -v -i warn | tail -8
      fi ;;
    scaling)
      for i in $(seq "${REPEATS:-3}"); do
        CUDA_VISIBLE_DEVICES=0 timeout 200 python3 -m tests.bench.trainer.bench_trainer --variants primeflow \
          --shape "${SHAPE:-0.6b}" --json "$OUT/scaling_1gpu_$i.json" > "$OUT/scaling_1gpu_$i.log" 2>&1
        timeout 200 torchrun --standalone --nproc-per-node "${GPUS:-2}" -m tests.bench.trainer.bench_trainer \
          --variants primeflow --shape "${SHAPE:-0.6b}" --json "$OUT/scaling_ngpu_$i.json" \
          > "$OUT/scaling_ngpu_$i.log" 2>&1
      done
      python3 -m tests.bench.trainer.scaling $(for i in $(seq "${REPEATS:-3}"); do
        echo "$OUT/scaling_1gpu_$i.json" "$OUT/scaling_ngpu_$i.json"; done) | tee "$OUT/scaling.txt" ;;
    tests)
      timeout 300 python3 -m pytest -q -p no:cacheprovider tests/gpu 2>&1 | tee "$OUT/gpu_tests.log" | tail -25 ;;
  esac
done
