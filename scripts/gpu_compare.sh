#!/usr/bin/env bash
# The GPU check's second command (make gpu-compare, after make gpu-check; docs/testing.md): SmolLM2's GGUF joined
# from the parts make gpu-parts wrote here (the first part carried by the first command, the second by this one; each
# part and the whole file checked by sha256), then the real model beside transformers (scripts/gpu_compare.py) and
# heads trained for it on the GPU against the CPU (scripts/gpu_train_check.py --model), the report in
# ${OUT:-build}/gpu-check/. Extra arguments go to gpu_compare.py (--dry-run: both on the CPU, as make gpu-check-dry
# runs them).
set -uo pipefail
cd "$(dirname "$0")/.."
report=${OUT:-build}/gpu-check
mkdir -p "$report"
py=${PYTHON:-python3}
. scripts/gpu_env.sh
gpu_env /tmp/medusa-src /tmp/medusa-site || exit 2
export PYTHONUNBUFFERED=1
model=build/gpu-model/SmolLM2-135M-Instruct.Q4_1.gguf
train_args=""
case " $* " in *" --dry-run "*) train_args=--dry-run ;; esac  # the training check's CPU stand-in too
{
  echo "== $(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null)"
  echo "== SmolLM2's GGUF from its parts, checked by sha256"
  $py scripts/model_parts.py join build/gpu-parts --out "$model"
  joined=$?
  compared=not-run
  trained=not-run
  if [ "$joined" = 0 ]; then
    echo "== the real model beside transformers"
    $py scripts/gpu_compare.py --model "$model" --prompts build/gpu-parts/prompts.jsonl --out "$report/gpu-compare.json" "$@"
    compared=$?
    echo "== heads for the real model: trained on the GPU, then the same steps on the CPU"
    $py scripts/gpu_train_check.py --model "$model" --out "$report/gpu-train-real.json" $train_args
    trained=$?
  fi
  echo "== exit: join $joined, compare $compared, train $trained"
} 2>&1 | tee "$report/gpu-compare.txt"
grep -q "== exit: join 0, compare 0, train 0$" "$report/gpu-compare.txt"
