"""The benchmarks' output files (``medusa-bench``, ``medusa-calibrate``): checked before any work,
written whole or not at all."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from medusa_trt.runtime.durable import staged_files
from medusa_trt.runtime.errors import MedusaError


def check_out(raw: str, suffix: str, companions: tuple[str, ...] = ()) -> Path:
    """--out as a file that can be written, checked before any work: its folder exists and takes new
    files, and neither it nor a companion written beside it (``.png``, ...) is a folder."""
    out = Path(raw)
    if raw.endswith(("/", os.sep)) or out.is_dir():
        raise MedusaError(f"--out {raw} is a folder: name the file to write, such as {out / ('report' + suffix)}")
    if out.suffix != suffix:
        raise MedusaError(f"--out {out} must end in {suffix}")
    folder = out.parent
    if not folder.is_dir():
        what = f"{folder} is not a folder" if folder.exists() else f"folder {folder} does not exist"
        raise MedusaError(f"cannot write {out}: {what}; create it or pick another --out")
    for path in (out.with_suffix(c) for c in companions):
        if path.is_dir():
            raise MedusaError(f"cannot write {path} beside --out {out}: it is a folder; pick another --out")
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=f".{out.name}.", suffix=".probe"):
            pass  # the folder takes new files: the temp files of staged() will go there
    except OSError as exc:
        raise MedusaError(f"cannot write {out}: folder {folder} is not writable ({exc.strerror}); pick another --out") from exc
    return out


def staged(*targets: Path):
    """Yield a temp path beside each target (same suffix); when the block succeeds each temp that was
    written is renamed onto its target, whatever happens no temp is left: a reader never sees half a
    file and a failure leaves nothing behind (``runtime/durable.py``'s ``staged_files``)."""
    return staged_files(*targets)
