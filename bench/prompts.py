"""Prompt files of the benchmarks (``medusa-bench``, ``medusa-calibrate``): Spec-Bench style JSONL."""

from __future__ import annotations

import json
from pathlib import Path

from medusa_trt.runtime.errors import MedusaError


def read_prompts(path: str, limit: int | None = None) -> list[str]:
    """turns[0] of every record of a Spec-Bench style JSONL file (UTF-8, one JSON object a line, blank lines skipped)."""
    file = Path(path)
    if file.is_dir():
        raise MedusaError(f"prompts file {file} is a folder: pass a .jsonl file")
    if not file.is_file():
        raise MedusaError(f"prompts file {file} does not exist")
    prompts = [_prompt(file, n, raw) for n, raw in enumerate(file.read_bytes().splitlines(), 1) if raw.strip()]
    if not prompts:
        raise MedusaError(f'{file} holds no prompts: write one JSON record a line, such as {{"turns": ["Hello"]}}')
    return prompts[:limit] if limit else prompts


def _prompt(file: Path, n: int, raw: bytes) -> str:
    """The prompt on line n, or an error naming the file, the line and the fix."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise MedusaError(
            f"{file}:{n}: not UTF-8 text (byte 0x{raw[exc.start]:02x} at column {exc.start + 1}): save the file as UTF-8"
        ) from exc
    try:
        record = json.loads(line)
    except ValueError as exc:
        raise MedusaError(
            f'{file}:{n}: not a JSON record ({exc.msg} at column {exc.colno}): write one JSON object a line, such as {{"turns": ["Hello"]}}'
        ) from exc
    turns = record.get("turns") if isinstance(record, dict) else None
    if not isinstance(turns, list) or not turns or not isinstance(turns[0], str) or not turns[0].strip():
        raise MedusaError(f'{file}:{n}: not a Spec-Bench record with turns[0] (a non-empty string): write it as {{"turns": ["Hello"]}}')
    return turns[0]
