#!/usr/bin/env bash
# The GPU check's dry run (make gpu-check-dry; CI runs it): what `make gpu-check` runs, without a GPU, in a venv
# holding only what the GPU machine's image holds (torch, triton, transformers, onnxruntime on the CPU, numpy,
# pytest; no gguf, no project install). Here torch is the CPU build of the version the suite pins
# (torch==2.13.0, from this disk: never a range, which could pull a CUDA build), and the rest is pinned by
# constraints.txt. The venv is build/gpu-venv, made once and reused while constraints.txt and the package list
# below are unchanged. Then, on the package path gpu_check.sh builds (scripts/gpu_preflight.py --link-into):
#   1. every module the GPU tests, gpu_bench.py and gpu_train_check.py import, imported (gpu_preflight.py);
#   2. the GPU tests run: without CUDA each must skip cleanly (none may fail or error at collection);
#   3. gpu_bench.py --dry-run: the benchmark on the CPU at toy sizes, up to its first CUDA call;
#   4. gpu_trt_check.py: without TensorRT or CUDA it must say so in one line and exit 77 (not run), as on the GPU machine;
#   5. the second command (gpu_compare.sh --dry-run): SmolLM2's GGUF joined from the parts make gpu-parts wrote and
#      checked by sha256, the gguf wheel installed from .whl/ as there, then the real model beside transformers on the
#      CPU (float32, 3 prompts x 12 tokens).
# Report in build/gpu-check-dry/. Exit status 0 only when all five pass.
set -uo pipefail
cd "$(dirname "$0")/.."
report=build/gpu-check-dry
venv=build/gpu-venv
py=$venv/bin/python
# Python 3.11 here, where the GPU machine has 3.12: the CPU torch wheel on this disk is built for 3.11 (for 3.12
# pip would take PyPI's CUDA build, gigabytes). Syntax newer than 3.11 would slip through; nothing else differs.
python=${PYTHON:-python3.11}
torch=torch==2.13.0
packages="transformers onnxruntime numpy pytest"  # the GPU image's, besides torch and triton
stamp=$venv/.installed
want=$( (cat constraints.txt; echo "$python $torch $packages triton") | sha256sum | cut -d' ' -f1)
mkdir -p "$report"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "gpu-check-dry: making $venv (once; reused while constraints.txt and the package list are unchanged)"
  rm -rf "$venv"
  "$python" -m venv "$venv" || exit 2
  $py -m pip install -q --upgrade pip || exit 2
  $py -m pip install -q -c constraints.txt $torch || exit 2
  $py -m pip install -q -c constraints.txt $packages || exit 2
  # the GPU image has triton; pinned by constraints.txt. Where it cannot be installed the kernel's GPU tests skip
  # here as they would without CUDA, and the report says so
  $py -m pip install -q -c constraints.txt triton || echo "gpu-check-dry: triton could not be installed here: its imports are not checked"
  echo "$want" >"$stamp"
fi
if $py -c "import medusa_trt" 2>/dev/null; then
  echo "gpu-check-dry: $venv can import medusa_trt without the package path: it must hold only the GPU image's packages" >&2
  exit 2
fi
src=$report/src
rm -rf "$src"
export PYTHONPATH="$PWD/$src" PYTHONUNBUFFERED=1
shared=${MEDUSA_TRT_SHARED:-../shared}
export MEDUSA_TRT_TREE_PRESETS=${MEDUSA_TRT_TREE_PRESETS:-$shared/trees/medusa_choices.json}
{
  echo "== $(date -u +%FT%TZ) dry run of the GPU check, no GPU"
  $py -c "import sys, torch, transformers, onnxruntime; print('python', sys.version.split()[0], 'torch', torch.__version__, 'transformers', transformers.__version__, 'onnxruntime', onnxruntime.__version__, 'cuda', torch.cuda.is_available())"
  $py -c "import triton; print('triton', triton.__version__)" 2>/dev/null || echo "triton: not installed"
  echo "== preflight: every module the check imports, on the package path gpu_check.sh builds"
  $py scripts/gpu_preflight.py --link-into "$src"
  preflight=$?
  echo "== GPU tests: each skips cleanly without CUDA"
  $py -m pytest -q -p no:cacheprovider --basetemp "$report/pytest" -m gpu tests/test_gpu.py tests/test_gpu_kernel.py -rs
  tests=$?
  echo "== GPU benchmark, --dry-run"
  $py scripts/gpu_bench.py --dry-run --out "$report/gpu-bench.json"
  bench=$?
  echo "== TensorRT step: not run without TensorRT and CUDA, in one line"
  $py scripts/gpu_trt_check.py --out "$report/gpu-trt.json"
  trt=$?
  [ "$trt" = 77 ] && trt=not-run
  echo "== the second command, --dry-run: the GGUF from its parts, the real model beside transformers on the CPU"
  PYTHON=$py OUT=$report bash scripts/gpu_compare.sh --dry-run
  compare=$?
  echo "== exit: preflight $preflight, tests $tests, benchmark $bench, tensorrt $trt, compare $compare"
} 2>&1 | tee "$report/report.txt"
grep -q "== exit: preflight 0, tests 0, benchmark 0, tensorrt not-run, compare 0$" "$report/report.txt"
