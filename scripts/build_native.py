"""Build the native step's libraries into a folder of one's own, as setup.py builds them into the package.

For the builds the package does not ship: the sanitizer build (``make test-sanitize``: ``--flags
"-fsanitize=address,undefined ..."``, then the native tests with ``MEDUSA_TRT_NATIVE_DIR`` pointing at the folder)
and the Arm cross-compile (``--machine aarch64 --cc aarch64-linux-gnu-gcc``, which CI runs to prove the NEON code
compiles and links). Every library gets the instruction-set flags and defines ``runtime/native_isa.py`` gives it.

    python scripts/build_native.py --out build/native-asan --flags "-fsanitize=address,undefined -g"
    python scripts/build_native.py --out build/native-arm --machine aarch64 --cc aarch64-linux-gnu-gcc
"""

from __future__ import annotations

import argparse
import logging
import platform
import shlex
import subprocess
import sys
from pathlib import Path

from medusa_trt.runtime import native_isa

log = logging.getLogger("build_native")


def build(out: Path, machine: str, cc: str, flags: list[str]) -> list[Path]:
    """One library per instruction set of ``machine`` into ``out``; raises CalledProcessError on a failed compile."""
    isas = native_isa.for_machine(machine)
    if not isas:
        raise SystemExit(f"build_native: error: no instruction sets for machine {machine!r}: pass x86_64 or aarch64")
    out.mkdir(parents=True, exist_ok=True)
    built = []
    for isa in isas:
        target = out / f"{native_isa.library_stem(isa)}.so"
        sources = [str(native_isa.HERE / name) for name in native_isa.SOURCES]
        command = [cc, *native_isa.COMPILE, *isa.flags, *native_isa.defines(isa), *flags, "-shared", "-o", str(target), *sources]
        command += list(native_isa.LINK)
        log.info("%s", shlex.join(command))
        subprocess.run(command, check=True)
        built.append(target)
    return built


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="folder to write the libraries into")
    p.add_argument("--machine", default=platform.machine(), help="x86_64 or aarch64 (default: this machine's)")
    p.add_argument("--cc", default="cc", help="the C compiler (default cc)")
    p.add_argument("--flags", default="", help="extra compiler flags, one string (e.g. the sanitizers)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        built = build(args.out, args.machine, args.cc, shlex.split(args.flags))
    except (subprocess.CalledProcessError, FileNotFoundError) as exc:
        print(f"build_native: error: {exc}", file=sys.stderr)
        return 2
    print(f"built {len(built)} libraries into {args.out}: {', '.join(p.name for p in built)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
