#!/usr/bin/env bash
# The GPU check (make gpu-check): every GPU test, a short GPU benchmark, then a short CUDA training
# run of the heads (scripts/gpu_train_check.py: positions/s), one report folder.
# Runs on a fresh GPU machine with PyTorch, Triton, CUDA and transformers but no network: the
# package is made importable from the checkout without installing, and missing pure-Python
# wheels (gguf) are taken from .whl/ when present. Shared test data comes from
# $MEDUSA_TRT_SHARED (default ../shared).
set -uo pipefail
cd "$(dirname "$0")/.."
report=${OUT:-build}/gpu-check
mkdir -p "$report"
py=${PYTHON:-python3}
if ! $py -c "import medusa_trt.runtime" 2>/dev/null; then
  mkdir -p /tmp/medusa-src/medusa_trt
  for d in cli exporter runtime plugins training serving bench; do ln -sfn "$PWD/$d" "/tmp/medusa-src/medusa_trt/$d"; done
  export PYTHONPATH="/tmp/medusa-src${PYTHONPATH:+:$PYTHONPATH}"
fi
if compgen -G ".whl/*.whl" >/dev/null && ! $py -c "import gguf" 2>/dev/null; then
  $py -m pip install -q --no-index --no-deps --no-compile --target /tmp/medusa-site .whl/*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/medusa-site"
fi
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
  echo "== exit: preflight $preflight, tests $tests, benchmark $bench, training $train"
} 2>&1 | tee "$report/gpu-report.txt"
grep -q "== exit: preflight 0, tests 0, benchmark 0, training 0" "$report/gpu-report.txt"
