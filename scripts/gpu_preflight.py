"""Preflight of the GPU check: can everything it runs be imported here? One line per module that cannot.

``make gpu-check`` runs on a GPU machine unlike CI (another Python, torch and transformers, no gguf, no
project install: the packages are linked from the checkout). This builds the same package path from every
package pyproject.toml maps (not a hand-kept list), then imports each module the GPU check's files import
(read from their source with ``ast``, so a new import is covered without editing this list) and reports
what is missing before any test or benchmark starts. Optional imports (inside ``try``, or the tests'
``pytest.importorskip``) are reported but do not fail. Runs on CPU: ``python scripts/gpu_preflight.py``.

``--link-into DIR --links-only`` only builds the package path: ``scripts/gpu_check.sh`` makes its package path
this way, so the GPU check and its dry run (``make gpu-check-dry``) cannot link different packages.

Exit status: 0 when every required module imports, 2 otherwise.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import sys
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHECKED = (  # every file make gpu-check and make gpu-compare run, and what they import at their top
    "tests/test_gpu.py",
    "tests/test_gpu_kernel.py",
    "tests/conftest.py",
    "scripts/gpu_bench.py",
    "scripts/gpu_train_check.py",
    "scripts/gpu_trt_check.py",
    "scripts/model_parts.py",
    "scripts/gpu_compare.py",
)


def package_path(into: Path) -> Path:
    """``into/medusa_trt/<pkg>`` linked to each folder pyproject.toml maps, as gpu_check.sh does; returns ``into``."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    dirs = config["tool"]["setuptools"]["package-dir"]  # "medusa_trt.bench" -> "bench"
    top = into / "medusa_trt"
    top.mkdir(parents=True, exist_ok=True)
    for name, folder in dirs.items():
        link, target = top / name.split(".", 1)[1], ROOT / folder
        if link.is_symlink() and link.resolve() != target.resolve():  # left by another checkout
            link.unlink()
        if not link.exists():
            link.symlink_to(target, target_is_directory=True)
    return into


def imports_of(path: Path) -> dict[str, bool]:
    """Module -> required? for each absolute import in the file (optional: inside try or importorskip)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found: dict[str, bool] = {}
    optional_lines = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Try):
            for inner in node.body:
                optional_lines.update(range(inner.lineno, (inner.end_lineno or inner.lineno) + 1))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "importorskip" and node.args:
            arg = node.args[0]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                found.setdefault(arg.value, False)
            continue
        else:
            continue
        for name in names:
            if name in ("__future__", "conftest"):
                continue
            required = node.lineno not in optional_lines
            found[name] = found.get(name, False) or required
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--link-into", type=Path, help="folder for the package links (default: a temporary one)")
    parser.add_argument("--links-only", action="store_true", help="build the package path in --link-into and import nothing")
    args = parser.parse_args(argv)
    if args.links_only and args.link_into is None:
        parser.error("--links-only needs --link-into DIR")
    into = package_path(args.link_into or Path(tempfile.mkdtemp(prefix="medusa-src-")))
    if args.links_only:
        return 0
    sys.path.insert(0, str(into))
    sys.path.insert(1, str(ROOT / "tests"))
    wanted: dict[str, bool] = {}
    for name in CHECKED:
        for module, required in imports_of(ROOT / name).items():
            wanted[module] = wanted.get(module, False) or required
    missing = []
    for module, required in sorted(wanted.items()):
        try:
            importlib.import_module(module)
        except Exception as exc:  # noqa: BLE001 - any failure to import is what this reports
            reason = " ".join(str(exc).split())[:160] or type(exc).__name__
            print(f"gpu-preflight: {'missing' if required else 'optional, absent'}: {module} ({reason})")
            if required:
                missing.append(module)
    print(
        f"gpu-preflight: {len(wanted) - len(missing)} of {len(wanted)} modules import"
        + (f"; missing {', '.join(missing)}" if missing else "")
    )
    return 2 if missing else 0


if __name__ == "__main__":
    raise SystemExit(main())
