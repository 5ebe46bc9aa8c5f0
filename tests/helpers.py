"""What the tests share beside conftest's fixtures: a prompts file, a medusa-bench run, story openings for
heads to learn on, and a script of scripts/ loaded as a module."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"

# openings the TinyStories model (stories260K) continues: its continuations are what its heads can learn
STORY_STARTS = [
    "Once upon a time",
    "One day, a little girl",
    "Tom and his dog",
    "The sun was shining and",
    "Lily found a",
    "There was a big",
    "Max wanted to",
    "In the park, the kids",
    "Sue had a red",
    "The cat saw a",
    "Mom said to Ben",
    "A bird sat on",
    "The little boat",
    "Anna liked to",
    "The old man had",
    "Tim was sad because",
]


def prompts_file(folder: Path, texts: list[str]) -> Path:
    """``folder/p.jsonl``: one Spec-Bench record (``turns[0]``) per text."""
    path = folder / "p.jsonl"
    path.write_text("\n".join(json.dumps({"turns": [t]}) for t in texts))
    return path


def run_bench(folder: Path, engines: list, texts: list[str], *args: str, new_tokens: int = 24) -> dict:
    """medusa-bench over ``texts`` on ``engines`` with ``args`` more, its report written to ``folder/bench.json``: the report."""
    from medusa_trt.cli.bench import main

    out = folder / "bench.json"
    argv = [a for e in engines for a in ("--engine", str(e))]
    argv += ["--prompts", str(prompts_file(folder, texts)), "--max-new-tokens", str(new_tokens), "--out", str(out), *args]
    assert main(argv) == 0, "medusa-bench failed: its error is in the captured stderr"
    return json.loads(out.read_text())


def script(name: str):
    """scripts/NAME.py as a module (the scripts are checkout tooling, not package modules), with scripts/ on the
    import path while it loads, as when it is run: a script may import the one beside it."""
    sys.path.insert(0, str(SCRIPTS))
    try:
        spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(SCRIPTS))
    return module
