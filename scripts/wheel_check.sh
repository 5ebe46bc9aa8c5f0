#!/usr/bin/env bash
# The wheel runs the native step where no C compiler is (make wheel-check; CI runs it). Builds the wheel with
# `python -m build`, installs it with its [native] extra into a fresh venv (build/wheel-check/venv), exports the
# stories260K engine with the checkout's .venv, then runs it from the fresh venv with a PATH that holds only that venv's
# bin (no cc, gcc or clang), once at this CPU's best instruction set and once capped at every other set this CPU runs
# (MEDUSA_TRT_CPU_ISA): each run checks the library loaded is the set asked for and that drafted output equals plain
# output. Exit status 0 only when every run passes.
set -euo pipefail
cd "$(dirname "$0")/.."
out=build/wheel-check
py=.venv/bin/python
rm -rf "$out" && mkdir -p "$out"
$py -m build --wheel --outdir "$out/dist" . > "$out/build.log" 2>&1 || { tail -20 "$out/build.log"; exit 1; }
wheel=$(ls "$out"/dist/medusa_trt-*.whl)
echo "built $(basename "$wheel")"
${PYTHON:-python3.11} -m venv "$out/venv"
"$out/venv/bin/pip" install -q ${MEDUSA_TRT_CONSTRAINTS:+-c "$MEDUSA_TRT_CONSTRAINTS"} "$wheel[native]"
shared=${MEDUSA_TRT_SHARED:-../shared}
.venv/bin/medusa-export --model "$shared/models/stories260K.gguf" --untrained-heads 3 --out "$out/engine" \
  --max-batch 2 --max-context 256 --backend native > "$out/export.log" 2>&1 || { tail -5 "$out/export.log"; exit 1; }
cat > "$out/check.py" <<'EOF'
import os, shutil, sys
from medusa_trt.runtime import MedusaRuntime, native_library
assert not any(shutil.which(c) for c in ("cc", "gcc", "clang")), "a C compiler is on PATH"
want = os.environ.get("MEDUSA_TRT_CPU_ISA") or None
runtime = MedusaRuntime(sys.argv[1], backend="native", threads=2, max_batch=2, max_context=256)
isa = runtime.backend.kernel.isa
assert want is None or isa == want, f"asked {want}, loaded {isa}"
assert native_library.load().path.parent.name == "runtime", native_library.load().path  # the wheel's own library
prompts = ["Once upon a time", "Tim had a red ball"]
drafted = runtime.generate(prompts, max_new_tokens=32)
plain = runtime.plain().generate(prompts, max_new_tokens=32)
same = [d.token_ids == p.token_ids for d, p in zip(drafted, plain)]
print(f"{isa}: {sum(same)}/{len(same)} drafted = plain, {sum(d.stats.mean_accepted for d in drafted) / len(drafted):.2f} tokens a step")
sys.exit(0 if all(same) else 1)
EOF
engine=$(realpath "$out/engine")
isas=$("$out/venv/bin/python" -c "
import platform
from medusa_trt.runtime import native_isa, native_library
print(' '.join(i.name for i in native_isa.for_machine(platform.machine()) if native_library.load(i.name).isa == i.name))")
status=0
for isa in "" $isas; do
  (cd "$out" && env -i HOME="$HOME" PATH="$(realpath venv/bin)" ${isa:+MEDUSA_TRT_CPU_ISA=$isa} venv/bin/python check.py "$engine") || status=1
done
echo "== wheel check: $([ $status = 0 ] && echo passed || echo FAILED) (sets this CPU runs: $isas)"
exit $status
