#!/usr/bin/env bash
# The GPU check's first command (make gpu-check; the second is make gpu-compare, docs/testing.md): every GPU test,
# a short GPU benchmark, a short CUDA training run of the heads (scripts/gpu_train_check.py: positions/s), then SmolLM2 built as TensorRT plans in both attention forms with greedy
# tokens checked against ONNX Runtime and torch (scripts/gpu_trt_check.py; where TensorRT or SmolLM2 is absent it
# says so in one line and counts as not-run, not failed), one report folder. make gpu-check-dry runs it without a GPU.
# Runs on a fresh GPU machine with PyTorch, Triton, CUDA and transformers but no network: the
# package is made importable from the checkout without installing, and missing pure-Python
# wheels (gguf) are taken from .whl/ when present. Shared test data comes from
# $MEDUSA_TRT_SHARED (default ../shared).
set -uo pipefail
cd "$(dirname "$0")/.."
report=${OUT:-build}/gpu-check
mkdir -p "$report"
py=${PYTHON:-python3}
. scripts/gpu_env.sh
gpu_env /tmp/medusa-src /tmp/medusa-site || exit 2
export PYTHONUNBUFFERED=1
shared=${MEDUSA_TRT_SHARED:-../shared}
export MEDUSA_TRT_TREE_PRESETS=${MEDUSA_TRT_TREE_PRESETS:-$shared/trees/medusa_choices.json}
{
  echo "== $(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null)"
  $py -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, 'cuda', torch.cuda.is_available())"
  echo "== preflight: every module the check imports"
  $py scripts/gpu_preflight.py
  preflight=$?
  echo "== GPU tests"
  $py -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py tests/test_gpu_kernel.py -rs
  tests=$?
  echo "== GPU benchmark"
  $py scripts/gpu_bench.py --out "$report/gpu-bench.json"
  bench=$?
  echo "== GPU training"
  $py scripts/gpu_train_check.py --out "$report/gpu-train.json"
  train=$?
  echo "== TensorRT: SmolLM2, both attention forms, greedy tokens against ONNX Runtime and torch"
  $py scripts/gpu_trt_check.py --out "$report/gpu-trt.json"
  trt=$?
  [ "$trt" = 77 ] && trt=not-run  # TensorRT (or SmolLM2) absent here: said in one line above
  echo "== exit: preflight $preflight, tests $tests, benchmark $bench, training $train, tensorrt $trt"
} 2>&1 | tee "$report/gpu-report.txt"
grep -qE "== exit: preflight 0, tests 0, benchmark 0, training 0, tensorrt (0|not-run)$" "$report/gpu-report.txt"
