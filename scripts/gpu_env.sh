# Sourced by the GPU check's scripts (gpu_check.sh, gpu_compare.sh, and gpu_check_dry.sh in its venv): with $py the
# Python to run, the package made importable from the checkout without installing it (links under $1; kept where
# medusa_trt already imports), and the wheels the GPU image lacks (gguf, and accelerate with psutil, which transformers
# needs to load a GGUF) installed from .whl/ (make gpu-parts downloads them) into $2, each where it does not import. Returns 2 where the package path cannot be built.
gpu_env() {
  local links=$1 site=$2
  if ! $py -c "import medusa_trt.runtime" 2>/dev/null; then
    # every package pyproject.toml maps, linked by the script the dry run (make gpu-check-dry) builds its path with
    $py scripts/gpu_preflight.py --link-into "$links" --links-only || return 2
    export PYTHONPATH="$links${PYTHONPATH:+:$PYTHONPATH}"
  fi
  local wheel missing=()
  for wheel in .whl/*.whl; do  # each wheel whose module (its distribution's name) does not import here
    [ -e "$wheel" ] || continue
    $py -c "import $(basename "$wheel" | cut -d- -f1)" 2>/dev/null || missing+=("$wheel")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    $py -m pip install -q --upgrade --no-index --no-deps --no-compile --target "$site" "${missing[@]}" && export PYTHONPATH="$PYTHONPATH:$site"
  fi
  return 0
}
