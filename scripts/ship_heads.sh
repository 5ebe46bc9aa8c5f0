#!/usr/bin/env bash
# The figures behind the shipped SmolLM2 heads, after they are copied into assets/ (issue 15):
#   1. the demo engine folder (`make` target: shipped heads, heads template, int8 heads graph)
#   2. medusa-bench, one run on it: every 3rd dev prompt, 128 tokens, greedy, rows plain / heads /
#      lookup / heads+lookup / every drafter (docs/bench-v2.json)
#   3. medusa-calibrate on it: head accuracy along real greedy decoding of the held-out
#      calibration prompts, step costs, the calibrated tree (assets/smollm2-135m-tree.*)
#   4. an int8 engine of the same heads and template, and its medusa-bench run: plain and every
#      drafter (docs/bench-v2-int8.json)
#   5. medusa-bench at temperature 0.7, top-p 0.9, lossless and typical (docs/bench-v2-t0.7.json)
# Usage: bash scripts/ship_heads.sh [STEP ...]   (default: every step; a step's outputs are
# replaced whole, so a rerun after a stop starts that step again)
set -euo pipefail
cd "$(dirname "$0")/.."
V=.venv/bin
ENGINE=build/smollm2-135m-medusa
INT8=build/smollm2-135m-int8
HEADS=assets/smollm2-135m-medusa
TEMPLATE=assets/smollm2-135m-medusa/template.json
DEV=../shared/data/spec_bench_dev.jsonl
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(engine bench calibrate int8 bench-int8 sampling)

for step in "${steps[@]}"; do
  echo "== $step $(date -u +%H:%M:%S)"
  case "$step" in
    engine) rm -rf "$ENGINE" && make "$ENGINE" ;;
    calibrate) $V/medusa-calibrate --engine "$ENGINE" --prompts assets/calibration_prompts.jsonl --max-new-tokens 96 \
                 --threads 2 --out assets/smollm2-135m-tree.json ;;
    int8) $V/medusa-export --model smollm2-135m --heads "$HEADS" --tree "$TEMPLATE" --quantize int8 --draft-vocab 16384 --out "$INT8" \
            --max-batch 4 --max-context 1024 ;;
    bench) $V/medusa-bench --engine "$ENGINE" --prompts "$DEV" --every 3 --max-new-tokens 128 \
             --draft heads --draft lookup --draft heads,lookup --draft heads,lookup,recycle --no-hf --threads 2 \
             --out docs/bench-v2.json ;;
    bench-int8) $V/medusa-bench --engine "$INT8" --prompts "$DEV" --every 3 --max-new-tokens 128 --no-hf --threads 2 \
                  --out docs/bench-v2-int8.json ;;
    sampling) $V/medusa-bench --engine "$ENGINE" --prompts "$DEV" --every 6 --max-new-tokens 128 --temperature 0.7 --top-p 0.9 \
                --acceptance lossless --acceptance typical --no-hf --threads 2 --out docs/bench-v2-t0.7.json ;;
    *) echo "unknown step $step (engine, bench, calibrate, int8, bench-int8, sampling)" >&2; exit 2 ;;
  esac
done
echo "== done $(date -u +%H:%M:%S)"
