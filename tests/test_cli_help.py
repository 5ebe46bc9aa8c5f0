"""Every option of every command has help text, and --help shows each default the help does not already name."""

from __future__ import annotations

import argparse
import importlib
import tomllib
from pathlib import Path

import pytest

from medusa_trt.cli.common import HelpFormatter

SCRIPTS = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]["scripts"]
PARSERS = {"medusa-triton-repo": "build_repo_parser"}  # else build_parser


def _parsers(name: str):
    """The command's parser and its subcommands' parsers."""
    module = importlib.import_module(SCRIPTS[name].split(":")[0])
    todo, found = [getattr(module, PARSERS.get(name, "build_parser"))()], []
    while todo:
        parser = todo.pop()
        found.append(parser)
        todo += [sub for a in parser._actions if isinstance(a, argparse._SubParsersAction) for sub in a.choices.values()]
    return found


def _options(parser):
    shown = (argparse._HelpAction, argparse._SubParsersAction)
    return [a for a in parser._actions if a.option_strings and not isinstance(a, shown) and a.help != argparse.SUPPRESS]


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_every_option_has_help_and_its_default_shown(name):
    for parser in _parsers(name):
        assert issubclass(parser.formatter_class, HelpFormatter), parser.prog
        text = parser.format_help()
        for action in _options(parser):
            assert action.help and action.help.strip(), f"{parser.prog} {action.option_strings[0]} has no help"
            if action.default not in (None, False):
                shown = parser.formatter_class(parser.prog)._get_help_string(action) % {"default": action.default}
                assert "default" in shown.lower(), f"{parser.prog} {action.option_strings[0]}: default {action.default!r} not shown"
        assert "(default: " in text or not any(a.default not in (None, False) for a in _options(parser)), parser.prog


def test_the_train_help_shows_its_defaults():
    (parser,) = _parsers("medusa-train")
    text = " ".join(parser.format_help().split())
    assert "number of heads (default: 4)" in text and "AdamW learning rate (default 0.001)" in text


def test_a_gguf_bar_says_which_file_it_reads_and_stays_off_the_logs(monkeypatch):
    """transformers' GGUF loader draws its own bar: while a GGUF loads it names the file and is off where stderr is
    not a terminal (a log file, a pipe), as this project's bars are."""
    import transformers.modeling_gguf_pytorch_utils as gguf_utils
    from conftest import STORIES

    from medusa_trt.exporter.models import load_base_model

    seen, drawn = [], gguf_utils.tqdm
    monkeypatch.setattr(gguf_utils, "tqdm", lambda items, **options: seen.append(options) or drawn(items, **options))
    load_base_model(STORIES)
    assert seen == [{"desc": f"loading {STORIES.name}: de-quantizing its GGUF tensors", "disable": None}], seen


def test_medusa_export_defaults_are_the_exports_and_reach_it_as_given(tmp_path):
    """``BuildConfig`` and ``ExportConfig`` inherit the graph's options (``GraphOptions``): one default each, and what
    ``medusa-export`` is given is what ``export_onnx`` gets."""
    from medusa_trt.cli.export import build_config, build_parser
    from medusa_trt.exporter.builder import BuildConfig, BuildPlan, export_config
    from medusa_trt.exporter.export_defaults import ExportDefaults
    from medusa_trt.exporter.onnx_export import ExportConfig
    from medusa_trt.exporter.options import GraphOptions, graph_options

    defaults = graph_options(GraphOptions())
    assert graph_options(BuildConfig(model="m", out="e")) == defaults == graph_options(ExportConfig(out=Path("e")))
    out = tmp_path / "e.onnx"
    plain = build_config(build_parser().parse_args(["--model", "m", "--out", str(out)]))
    assert graph_options(plain) == defaults  # the command line's defaults are the library's
    given = ["--max-batch", "3", "--max-context", "96", "--max-tokens", "12", "--opset", "21", "--successors", "5", "--no-verify"]
    config = build_config(build_parser().parse_args(["--model", "m", "--out", str(out), *given]))
    passed = export_config(config, BuildPlan(out, None, ExportDefaults(), {}, None))
    expected = dict(defaults, max_batch=3, max_context=96, max_tokens=12, opset=21, successors=5, verify=False)
    assert graph_options(config) == graph_options(passed) == expected
