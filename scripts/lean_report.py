"""Lean install (no extras) against the full install: disk, import time, peak memory (not a test).

    .venv/bin/python scripts/lean_report.py --engine build/smollm2-135m-medusa

Builds a venv holding only ``pip install <this checkout>`` (no extras; reused when ``--venv``
names one that exists), then, for the lean venv and the full one (``.venv``):
  * site-packages size on disk (pip and setuptools not counted);
  * import time of the ONNX path (``medusa_trt.runtime``, its ONNX Runtime backend and the
    libraries they load lazily: onnxruntime, tokenizers, jinja2), median over fresh processes;
  * peak RSS (``ru_maxrss``, and the anonymous part at the end) of a fresh process after those
    imports, and of one that builds ``MedusaRuntime(engine)`` and generates ``--tokens`` tokens
    (greedy; lean and full must decode the same tokens).
The full install also gets one row for importing the torch path (torch + transformers), for scale.
Writes JSON (``docs/results/lean-report.json``) and prints a markdown table.

The engine: ``make build/smollm2-135m-medusa`` (or any ``medusa-export --out X``).
Needs the pip of the interpreter running this (>= 22.3, for ``pip --python``) and PyPI access.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
NOT_COUNTED = ("pip", "setuptools", "pkg_resources", "_distutils_hack", "wheel", "__pycache__")

# Each probe runs in a fresh interpreter of the venv under test and prints one JSON line. Memory:
# peak RSS (ru_maxrss), and the anonymous part of the RSS at the end (heap: what the process
# allocated). The file-backed rest maps shared libraries and depends on the page cache's state (a
# venv installed a minute ago maps more of its freshly written .so files), not on the install.
MEMORY = r"""
import resource
def memory():
    status = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return {"peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "rss_anon_mib": int(status["RssAnon"].split()[0]) / 1024, "rss_file_mib": int(status["RssFile"].split()[0]) / 1024}
"""
IMPORT_PROBE = (
    MEMORY
    + r"""
import json, sys, time
start = time.perf_counter()
import medusa_trt.runtime
import medusa_trt.runtime.backends.onnx_backend
import onnxruntime, tokenizers, jinja2.sandbox
seconds = time.perf_counter() - start
print(json.dumps({"seconds": seconds, **memory(), "modules": len(sys.modules), "onnxruntime": onnxruntime.__version__}))
"""
)
TORCH_PROBE = (
    MEMORY
    + r"""
import json, time
start = time.perf_counter()
import medusa_trt.exporter, torch, transformers
seconds = time.perf_counter() - start
print(json.dumps({"seconds": seconds, **memory()}))
"""
)
GENERATE_PROBE = (
    MEMORY
    + r"""
import json, sys, time
engine, prompt, tokens, max_batch = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
start = time.perf_counter()
from medusa_trt.runtime import MedusaRuntime
runtime = MedusaRuntime(engine, max_batch=max_batch)
ready = time.perf_counter() - start
result = runtime.generate(prompt, max_new_tokens=tokens)
heavy = sorted({m.partition(".")[0] for m in sys.modules} & {"torch", "transformers", "onnx", "tensorrt"})
print(json.dumps({"load_seconds": ready, "tokens_per_s": result.stats.tokens_per_second, "token_ids": result.token_ids,
                  **memory(), "heavy_modules": heavy}))
"""
)


class LeanInstallError(RuntimeError):
    """pip could not build or install the lean venv; ``output`` holds what pip said."""

    def __init__(self, message: str, output: str):
        super().__init__(message)
        self.output = output


def clean_env() -> dict[str, str]:
    """The environment minus anything that would point a venv's Python back at another install."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONSTARTUP")}
    env["PYTHONNOUSERSITE"] = "1"
    return env


def setuptools_table() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]


def copy_checkout(dest: Path) -> Path:
    """pyproject.toml, README.md and the package folders pyproject maps: what the wheel is built
    from. Building from a copy keeps pip's in-tree build out of the checkout's build/."""
    folders = {d.split("/")[0] for d in setuptools_table()["package-dir"].values()}
    dest.mkdir(parents=True)
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy2(REPO / name, dest / name)
    for folder in sorted(folders):
        shutil.copytree(REPO / folder, dest / folder, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info"))
    return dest


def build_lean_venv(venv: Path) -> Path:
    """``python -m venv`` + a wheel built from a copy of the checkout, installed with no extras.
    Returns the venv's python. pip's cache is used; pip itself is not put into the venv."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    with tempfile.TemporaryDirectory(prefix="medusa-trt-src-") as tmp:
        wheel = build_wheel(Path(tmp))
        proc = subprocess.run(
            [sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet", "--retries", "2", *constraint_args(), str(wheel)],
            capture_output=True,
            text=True,
            timeout=900,
            env=clean_env(),
        )
    if proc.returncode != 0:
        raise LeanInstallError(f"pip install {wheel.name} (no extras) into {venv} failed", proc.stdout + proc.stderr)
    return python


def constraint_args() -> list[str]:
    """``-c constraints.txt`` (the tested versions, as ``make`` installs them), or the file named by
    $MEDUSA_TRT_CONSTRAINTS; nothing where that is set empty (``make install CONSTRAINTS=``: newer releases)."""
    name = os.environ.get("MEDUSA_TRT_CONSTRAINTS", "constraints.txt")
    return ["-c", str(REPO / name)] if name else []


def build_wheel(tmp: Path) -> Path:
    """The wheel of a copy of the checkout (``pip wheel --no-deps``), built in ``tmp``; the tree
    presets come from the shared folder beside the checkout, as setup.py packages them."""
    source = copy_checkout(tmp / "src")
    env = clean_env()
    env.setdefault("MEDUSA_TRT_SHARED", str(REPO.parent / "shared"))
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--retries", "2", "-w", str(tmp / "dist"), str(source)],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
    )
    wheels = sorted((tmp / "dist").glob("medusa_trt-*.whl"))
    if proc.returncode != 0 or not wheels:
        raise LeanInstallError(f"pip wheel {REPO} failed", proc.stdout + proc.stderr)
    return wheels[0]


def site_packages(python: Path) -> Path:
    out = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
        env=clean_env(),
    )
    return Path(out.stdout.strip())


def disk_mib(path: Path) -> float:
    """Bytes on disk (allocated blocks, as ``du`` counts), files and folders under ``path``."""
    if path.is_file() or path.is_symlink():
        return path.lstat().st_blocks * 512 / 2**20
    total = 0
    for root, _, files in os.walk(path):
        total += sum(os.lstat(os.path.join(root, f)).st_blocks * 512 for f in files)
    return total / 2**20


def sizes(site: Path) -> dict:
    """Per top-level entry of site-packages (a package and its .dist-info counted together)."""
    groups: dict[str, float] = {}
    for entry in site.iterdir():
        name = entry.name.split("-")[0].removesuffix(".libs").removesuffix(".dist-info").lower()
        if name.removeprefix("_") in NOT_COUNTED or name in NOT_COUNTED:
            continue
        groups[name] = groups.get(name, 0.0) + disk_mib(entry)
    largest = dict(sorted(groups.items(), key=lambda kv: -kv[1])[:8])
    return {"site_packages_mib": sum(groups.values()), "largest_mib": largest}


def probe(python: Path, code: str, *args: str) -> dict:
    proc = subprocess.run(
        [str(python), "-c", code, *args], capture_output=True, text=True, timeout=600, env=clean_env(), cwd=tempfile.gettempdir()
    )
    if proc.returncode != 0:
        raise SystemExit(f"lean_report: {python} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def measure(python: Path, args) -> dict:
    imports = [probe(python, IMPORT_PROBE) for _ in range(args.repeats)]
    run = probe(python, GENERATE_PROBE, str(args.engine), args.prompt, str(args.tokens), str(args.max_batch))
    return {
        "python": str(python),
        **sizes(site_packages(python)),
        "onnxruntime": imports[0]["onnxruntime"],
        "import_seconds": statistics.median(p["seconds"] for p in imports),
        "import_seconds_all": [p["seconds"] for p in imports],
        "import_peak_rss_mib": statistics.median(p["peak_rss_mib"] for p in imports),
        "import_rss_anon_mib": statistics.median(p["rss_anon_mib"] for p in imports),
        "modules_after_import": imports[0]["modules"],
        "generate": run,
    }


def table(report: dict) -> str:
    lean, full = report["lean"], report["full"]
    gen = f"build `MedusaRuntime` + {report['tokens']} tokens: peak RSS (anonymous part)"

    def mem(peak: float, anon: float) -> str:
        return f"{peak:.0f} MiB ({anon:.0f})"

    rows = [
        (
            "site-packages on disk (pip, setuptools not counted)",
            f"{lean['site_packages_mib']:.0f} MiB",
            f"{full['site_packages_mib']:.0f} MiB",
        ),
        (
            f"import runtime + ONNX backend (median of {report['repeats']} fresh processes)",
            f"{lean['import_seconds'] * 1000:.0f} ms",
            f"{full['import_seconds'] * 1000:.0f} ms",
        ),
        (
            "peak RSS after that import (anonymous part)",
            mem(lean["import_peak_rss_mib"], lean["import_rss_anon_mib"]),
            mem(full["import_peak_rss_mib"], full["import_rss_anon_mib"]),
        ),
        (
            gen,
            mem(lean["generate"]["peak_rss_mib"], lean["generate"]["rss_anon_mib"]),
            mem(full["generate"]["peak_rss_mib"], full["generate"]["rss_anon_mib"]),
        ),
        ("engine load (import + sessions)", f"{lean['generate']['load_seconds']:.2f} s", f"{full['generate']['load_seconds']:.2f} s"),
        (
            "decoding speed (one run, for reference)",
            f"{lean['generate']['tokens_per_s']:.1f} tok/s",
            f"{full['generate']['tokens_per_s']:.1f} tok/s",
        ),
    ]
    torch_path = report.get("full_torch_import")
    if torch_path:
        rows.append(
            (
                "import the torch path (exporter, torch, transformers)",
                "not installed",
                f"{torch_path['seconds'] * 1000:.0f} ms, {mem(torch_path['peak_rss_mib'], torch_path['rss_anon_mib'])} peak RSS",
            )
        )
    lines = ["| | lean (`pip install medusa-trt`) | full (`.[all]`) |", "| --- | --- | --- |"]
    lines += [f"| {a} | {b} | {c} |" for a, b, c in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", type=Path, default=REPO / "build" / "smollm2-135m-medusa", help="an exported engine (folder or .onnx)")
    p.add_argument(
        "--venv",
        type=Path,
        default=REPO / "build" / "lean-venv",
        help="the lean venv: reused as it is if it exists (delete it after changing the package), else built here",
    )
    p.add_argument("--full", type=Path, default=REPO / ".venv" / "bin" / "python", help="python of the full install")
    p.add_argument("--tokens", type=int, default=64, help="new tokens to generate")
    p.add_argument("--prompt", default="Explain how a rainbow forms, in a short paragraph.")
    p.add_argument("--max-batch", type=int, default=1, help="runtime max_batch (sizes the KV cache)")
    p.add_argument("--repeats", type=int, default=5, help="fresh processes per import measurement")
    p.add_argument("--out", type=Path, default=REPO / "docs" / "results" / "lean-report.json")
    args = p.parse_args(argv)
    if not args.engine.exists():
        raise SystemExit(
            f"lean_report: engine {args.engine} missing: `make build/smollm2-135m-medusa` exports the SmolLM2 one "
            f"(or medusa-export --model ... --heads ... --out {args.engine})"
        )
    lean_python = args.venv / "bin" / "python"
    if not lean_python.exists():
        try:
            build_lean_venv(args.venv)
        except LeanInstallError as exc:
            raise SystemExit(f"lean_report: {exc}\n{exc.output[-3000:]}") from exc
    report = {
        "engine": str(args.engine),
        "prompt": args.prompt,
        "tokens": args.tokens,
        "max_batch": args.max_batch,
        "repeats": args.repeats,
        "python": platform.python_version(),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "lean": measure(lean_python, args),
        "full": measure(args.full, args),
    }
    report["full_torch_import"] = probe(args.full, TORCH_PROBE)
    report["same_tokens"] = report["lean"]["generate"]["token_ids"] == report["full"]["generate"]["token_ids"]
    for side in ("lean", "full"):
        if report[side]["generate"]["heavy_modules"]:
            print(f"warning: the {side} ONNX path imported {report[side]['generate']['heavy_modules']}", file=sys.stderr)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(table(report))
    print(
        f"\nlean and full decode the same tokens: {report['same_tokens']}; lean's largest: "
        + ", ".join(f"{k} {v:.0f}" for k, v in report["lean"]["largest_mib"].items())
        + " MiB"
    )
    print(f"wrote {args.out}")
    return 0 if report["same_tokens"] else 1


if __name__ == "__main__":
    sys.exit(main())
