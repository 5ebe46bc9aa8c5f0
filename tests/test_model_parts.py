"""scripts/model_parts.py and gpu_compare.py's checks: SmolLM2's GGUF travels to the GPU machine in parts, each and the
whole checked by sha256, and nothing half-written is left where a part is missing or altered."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import script

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


def _run(name: str, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPTS / name), *map(str, args)], capture_output=True, text=True, timeout=300, check=False)


@pytest.fixture
def parted(tmp_path):
    source = tmp_path / "model.gguf"
    source.write_bytes(bytes(range(256)) * 4001 + b"tail")  # 1,024,260 bytes: parts of unequal last size
    run = _run("model_parts.py", "split", source, "--parts", 3, "--out", tmp_path / "parts")
    assert run.returncode == 0, run.stderr
    return source, tmp_path / "parts"


def test_parts_join_to_the_same_file_and_a_second_join_writes_nothing(parted, tmp_path):
    source, parts = parted
    manifest = json.loads((parts / "parts.json").read_text())
    assert manifest["file"] == "model.gguf" and manifest["size"] == source.stat().st_size
    assert [p["name"] for p in manifest["parts"]] == [f"model.gguf.part{i}of3" for i in (1, 2, 3)]
    assert sum(p["size"] for p in manifest["parts"]) == manifest["size"]
    out = tmp_path / "there" / "model.gguf"
    run = _run("model_parts.py", "join", parts, "--out", out)
    assert run.returncode == 0 and "joined" in run.stdout, run.stderr
    assert out.read_bytes() == source.read_bytes()
    before = out.stat().st_mtime_ns
    run = _run("model_parts.py", "join", parts, "--out", out)
    assert run.returncode == 0 and "already whole" in run.stdout
    assert out.stat().st_mtime_ns == before


@pytest.mark.parametrize("damage", ["missing", "altered", "short", "manifest"])
def test_a_bad_part_is_one_line_and_leaves_nothing(parted, tmp_path, damage):
    _, parts = parted
    second = parts / "model.gguf.part2of3"
    if damage == "missing":
        second.unlink()
    elif damage == "altered":
        data = bytearray(second.read_bytes())
        data[100] ^= 1
        second.write_bytes(bytes(data))
    elif damage == "short":
        second.write_bytes(second.read_bytes()[:-1])
    else:
        (parts / "parts.json").write_text('{"file": "../model.gguf", "size": 1, "sha256": "x", "parts": []}')
    out = tmp_path / "there" / "model.gguf"
    run = _run("model_parts.py", "join", parts, "--out", out)
    assert run.returncode == 2 and run.stdout == ""
    assert len(run.stderr.strip().splitlines()) == 1 and "Traceback" not in run.stderr, run.stderr
    assert ("part2of3" in run.stderr) if damage != "manifest" else ("outside its folder" in run.stderr)
    assert not out.exists() and (not out.parent.exists() or list(out.parent.iterdir()) == [])


def test_a_join_of_parts_that_make_another_file_writes_nothing(parted, tmp_path):
    _, parts = parted
    manifest = json.loads((parts / "parts.json").read_text())
    manifest["sha256"] = "0" * 64  # every part as named, the whole not
    (parts / "parts.json").write_text(json.dumps(manifest))
    out = tmp_path / "there" / "model.gguf"
    run = _run("model_parts.py", "join", parts, "--out", out)
    assert run.returncode == 2 and "sha256 differs" in run.stderr
    assert not out.exists() and list(out.parent.iterdir()) == []


def test_split_of_what_is_not_a_file_or_a_builtin_is_one_line(tmp_path):
    run = _run("model_parts.py", "split", tmp_path / "nothing.gguf", "--out", tmp_path / "parts")
    assert run.returncode == 2 and len(run.stderr.strip().splitlines()) == 1 and "smollm2-135m" in run.stderr
    assert not (tmp_path / "parts").exists()


def test_gpu_compare_without_its_files_is_one_line(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    run = _run("gpu_compare.py", "--dry-run", "--model", tmp_path / "absent.gguf", "--prompts", prompts)
    assert run.returncode == 2 and "prompts.jsonl is missing: make gpu-parts" in run.stderr
    prompts.write_text('{"turns": ["Hello"]}\n')
    run = _run("gpu_compare.py", "--dry-run", "--model", tmp_path / "absent.gguf", "--prompts", prompts)
    assert run.returncode == 2 and "absent.gguf is missing: join the parts first" in run.stderr
    assert "Traceback" not in run.stderr


def test_gpu_compare_finds_the_first_difference_and_reads_first_turns(tmp_path):
    compare = script("gpu_compare")
    assert compare.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert compare.first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert compare.first_difference([1, 2], [1, 2, 7]) == 2  # one stopped where the other went on
    path = tmp_path / "p.jsonl"
    path.write_text('{"turns": ["a", "b"]}\n\n{"prompt": "c"}\n{"turns": ["d"]}\n')
    assert compare.read_prompts(path, 1) == ["a", "c", "d"]
    assert compare.read_prompts(path, 2) == ["a", "d"]


def test_fits_says_what_each_command_carries_and_refuses_past_the_budget(parted):
    _, parts = parted
    run = _run("model_parts.py", "fits", parts, "--budget-mib", 64)
    assert run.returncode == 0 and run.stdout.count("MiB") == 4, run.stderr  # three parts and the budget
    run = _run("model_parts.py", "fits", parts, "--budget-mib", 1)
    assert run.returncode == 2 and "would pass 1 MiB" in run.stderr and len(run.stderr.strip().splitlines()) == 1
