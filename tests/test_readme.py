"""The README's commands work as written.

Every command of its shell blocks parses with the command-line parser it names (a flag renamed or dropped fails here),
names make targets the Makefile has and files the repository holds. The Quick start's ``medusa-run`` commands and the
Python API block then run for real on the engine ``make demo`` exports (the folder it left in build/ where there is
one, else the same export made here), with nothing changed but where that folder lies.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import re
import shlex
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
DEMO_ENGINE = "build/smollm2-135m-medusa"  # the Makefile's ENGINE, which the README's commands run
SCRIPTS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]  # medusa-run -> module:function
PARSERS = {"medusa-triton-repo": "build_repo_parser"}  # else build_parser
STANDS_IN = {"$DEV": "../shared/data/spec_bench_dev.jsonl"}  # the README's placeholders


def blocks(text: str, kinds: tuple[str, ...]) -> list[str]:
    """The fenced blocks of ``text`` whose info string is one of ``kinds`` ("" for a bare fence)."""
    return [body for kind, body in re.findall(r"^```(\w*)\n(.*?)^```", text, re.S | re.M) if kind in kinds]


def commands(block: str) -> list[list[str]]:
    """Each command of a shell block as argv: continuation lines joined, comments dropped, ``a && b`` split."""
    joined = re.sub(r"\\\n\s*", " ", block)
    found = []
    for line in joined.splitlines():
        words = [STANDS_IN.get(w, w) for w in shlex.split(line, comments=True)]
        while words:
            cut = words.index("&&") if "&&" in words else len(words)
            found.append(words[:cut])
            words = words[cut + 1 :]
    return [argv for argv in found if argv]


def quick_start() -> str:
    """The Quick start section's shell block."""
    section = README.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    (block,) = blocks(section, ("bash",))
    return block


ALL = [argv for block in blocks(README, ("", "bash", "sh")) for argv in commands(block)]


def parse(argv: list[str]) -> None:
    """``argv`` parsed by the parser of the command it names; a parse error fails with the command."""
    module = importlib.import_module(SCRIPTS[argv[0]].split(":")[0])
    parser = getattr(module, PARSERS.get(argv[0], "build_parser"))()
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            parser.parse_args(argv[1:])
        except SystemExit:
            pytest.fail(f"README command does not parse: {shlex.join(argv)}\n{err.getvalue()}")


def test_the_readme_has_the_commands_it_should():
    names = {argv[0] for argv in ALL}
    assert {"make", "medusa-export", "medusa-run", "medusa-bench", "medusa-serve", "curl"} <= names, names
    assert ALL[:2] == [["make", "demo"], ["make", "test"]]  # its first two commands: the set-up of a fresh machine


@pytest.mark.parametrize("argv", [a for a in ALL if a[0] in SCRIPTS], ids=lambda a: " ".join(a)[:80])
def test_every_medusa_command_parses_as_written(argv):
    parse(argv)
    for word in argv[1:]:  # files of the repository it names are there (build/ is what the commands make)
        if word.startswith(("assets/", "docs/", "scripts/")):
            assert (ROOT / word).exists(), f"{shlex.join(argv)}: {word} does not exist"


def test_a_stale_flag_fails_the_parse_check():
    with pytest.raises(pytest.fail.Exception, match="does not parse: medusa-run --engine e --no-such-flag"):
        parse(["medusa-run", "--engine", "e", "--no-such-flag"])


def test_every_make_target_and_script_exists():
    targets = set(re.findall(r"^([\w./-]+):", (ROOT / "Makefile").read_text(), re.M))
    for argv in ALL:
        if argv[0] == "make":
            assert set(argv[1:]) <= targets, f"{shlex.join(argv)}: no such target in the Makefile"
        scripts = [w for w in argv if w.startswith("scripts/")]
        assert all((ROOT / s).is_file() for s in scripts), shlex.join(argv)


# ----------------------------------------------------------------------------- run as written


@pytest.fixture(scope="module")
def demo_engine(smollm2_base, tmp_path_factory) -> Path:
    """The folder make demo exports: build/'s where make demo left one, else the Makefile's export made here."""
    from medusa_trt.runtime.engine_folder import read_folder_config

    built = ROOT / DEMO_ENGINE
    if (built / "config.json").is_file():
        with contextlib.suppress(Exception):
            read_folder_config(built)
            return built
    recipe = next(line for line in (ROOT / "Makefile").read_text().splitlines() if "medusa-export --model smollm2-135m" in line)
    heads = re.search(r"^HEADS\s*:=\s*(\S+)", (ROOT / "Makefile").read_text(), re.M).group(1)
    out = tmp_path_factory.mktemp("demo") / "smollm2-135m-medusa"
    argv = [w.replace("$(HEADS)", str(ROOT / heads)).replace("$@", str(out)) for w in shlex.split(recipe)[1:]]
    from medusa_trt.cli.export import main

    assert main(argv) == 0
    return out


def _in_place(argv: list[str], engine: Path) -> list[str]:
    """``argv`` with the demo engine where it lies here, and the repository's relative paths from its root."""
    placed = [str(engine) if w == DEMO_ENGINE else w for w in argv]
    return [str(ROOT / w) if w.startswith("assets/") else w for w in placed]


RUNS = [argv for argv in commands(quick_start()) if argv[0] == "medusa-run"]


@pytest.mark.slow
@pytest.mark.parametrize("argv", RUNS, ids=lambda a: " ".join(a[1:])[:80])
def test_the_quick_start_runs_as_written(argv, demo_engine, capsys):
    from medusa_trt.cli.run import main

    if "openvino" in argv:
        pytest.importorskip("openvino")
    assert main(_in_place(argv, demo_engine)[1:]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert re.search(r"^medusa on \S+ \(", out, re.M), out  # the summary names what ran
    if "--compare-plain" in argv:
        assert "drafted = plain: yes, token for token" in out, out


@pytest.mark.slow
def test_the_python_api_block_runs_as_written(demo_engine, capsys):
    (block, *_) = blocks(README.split("## Python API", 1)[1], ("python",))
    code = block.replace(f'"{DEMO_ENGINE}"', repr(str(demo_engine))).replace('"assets/', f'"{ROOT}/assets/')
    exec(compile(code, "README.md (Python API)", "exec"), {})  # noqa: S102 - the README's own code
    printed = capsys.readouterr().out
    assert printed.count("\n") >= 4, printed
