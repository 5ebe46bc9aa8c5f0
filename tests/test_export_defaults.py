"""A heads folder's export.json (defaults that are the best settings): ``medusa-export --model M
--heads H --out DIR`` with nothing else builds the engine the heads were tuned for; the command line wins."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import random_heads

from medusa_trt.cli.export import main as export_main
from medusa_trt.exporter.export_defaults import (
    EXPORT_DEFAULTS,
    ExportDefaults,
    ExportDefaultsError,
    read_export_defaults,
    write_export_defaults,
)
from medusa_trt.exporter.heads import save_heads
from medusa_trt.runtime.engine_folder import read_folder_config
from medusa_trt.runtime.tree import load_tree

REPO = Path(__file__).resolve().parents[1]
SHIPPED = REPO / "assets" / "smollm2-135m-medusa"
TEMPLATE = {"name": "tuned-template", "top_k": 3, "paths": [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]]}


@pytest.fixture(scope="module")
def heads_dir(tmp_path_factory, tiny_model_dir):
    from medusa_trt.exporter import load_base_model

    base = load_base_model(tiny_model_dir("llama"))
    folder = save_heads(random_heads(base, 3), tmp_path_factory.mktemp("heads") / "heads")
    (folder / "template.json").write_text(json.dumps(TEMPLATE))
    write_export_defaults(folder, tree="template.json", draft_vocab=256, quantize="heads-int8")
    return folder


def test_the_shipped_heads_carry_the_settings_they_were_tuned_with():
    found = read_export_defaults(SHIPPED)
    assert found == ExportDefaults(str(SHIPPED / "template.json"), 16384, "heads-int8")
    assert load_tree(found.tree).num_nodes > 1
    make = (REPO / "Makefile").read_text()
    line = next(x for x in make.splitlines() if "medusa-export" in x and "$(HEADS)" in x)
    assert "--tree" not in line and "--draft-vocab" not in line and "--quantize" not in line  # the demo engine is the default export


def test_a_plain_export_takes_the_heads_defaults(heads_dir, tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "engine"
    assert export_main(["--model", str(tiny_model_dir("llama")), "--heads", str(heads_dir), "--out", str(out), "--max-context", "64"]) == 0
    said = capsys.readouterr().out
    assert f"from {heads_dir / EXPORT_DEFAULTS}: tree {heads_dir / 'template.json'}, draft vocabulary 256, quantize heads-int8" in said
    meta = read_folder_config(out).meta
    assert (meta.tree_name, meta.tree, meta.top_k) == ("tuned-template", TEMPLATE["paths"], 3)
    assert (meta.draft_vocab, meta.quantization) == (256, "heads-int8")


def test_the_command_line_wins(heads_dir, tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "engine"
    assert (
        export_main(
            [
                "--model",
                str(tiny_model_dir("llama")),
                "--heads",
                str(heads_dir),
                "--out",
                str(out),
                "--max-context",
                "64",
                "--tree",
                "chain-2",
                "--quantize",
                "none",
            ]
        )
        == 0
    )
    assert "draft vocabulary 256" in capsys.readouterr().out  # the one setting left to the heads folder
    meta = read_folder_config(out).meta
    assert (meta.tree_name, meta.draft_vocab, meta.quantization) == ("chain-2", 256, "none")


def test_heads_without_export_json_export_as_before(heads_dir, tmp_path):
    bare = shutil.copytree(heads_dir, tmp_path / "bare")
    (bare / EXPORT_DEFAULTS).unlink()
    assert read_export_defaults(bare) == ExportDefaults() == read_export_defaults(None)


@pytest.mark.parametrize(
    "text, message",
    [
        ("{", "is not valid JSON"),
        ('{"version": 2}', 'must be an object with "version": 1'),
        ('{"version": 1, "trees": "x"}', 'and only "tree", "draft_vocab", "quantize"'),
        ('{"version": 1, "tree": 3}', '"tree" must be a file name in the heads folder'),
        ('{"version": 1, "tree": "gone.json"}', "which does not exist: copy the whole heads folder"),
        ('{"version": 1, "draft_vocab": 0}', '"draft_vocab" must be a whole number >= 1 or null'),
        ('{"version": 1, "quantize": "int3"}', '"quantize" must be one of'),
    ],
)
def test_a_bad_export_json_is_one_line_naming_it(tmp_path, capsys, tiny_model_dir, text, message):
    (tmp_path / EXPORT_DEFAULTS).write_text(text)
    with pytest.raises(ExportDefaultsError, match=message):
        read_export_defaults(tmp_path)
    out = tmp_path / "engine"
    assert export_main(["--model", str(tiny_model_dir("llama")), "--heads", str(tmp_path), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("medusa-export: ") and str(tmp_path / EXPORT_DEFAULTS) in err and len(err.splitlines()) == 1
    assert not out.exists()


def test_a_bad_value_is_refused_before_anything_is_written(tmp_path):
    with pytest.raises(ExportDefaultsError, match='"quantize" must be one of'):
        write_export_defaults(tmp_path, quantize="int3")
    assert list(tmp_path.iterdir()) == []


def test_heads_retrained_into_their_folder_keep_its_export_json(heads_dir, tiny_model_dir, tmp_path):
    from medusa_trt.exporter import load_base_model

    folder = shutil.copytree(heads_dir, tmp_path / "heads")
    save_heads(random_heads(load_base_model(tiny_model_dir("llama")), 3, seed=9), folder)
    assert (folder / EXPORT_DEFAULTS).read_bytes() == (heads_dir / EXPORT_DEFAULTS).read_bytes()
    assert json.loads((folder / "template.json").read_text()) == TEMPLATE
    assert read_export_defaults(folder).draft_vocab == 256


def test_the_heads_quantization_applies_to_standard_fp32_graphs_only():
    found = ExportDefaults("chain-2", 64, "heads-int8")
    assert found.under(None, None, None, quantizable=False) == (
        ExportDefaults("chain-2", 64, None),
        {"tree": "chain-2", "draft vocabulary": 64},
    )
    assert found.under("chain-1", 32, "none", quantizable=True) == (ExportDefaults("chain-1", 32, None), {})
    assert found.under(None, None, None, quantizable=True)[0] == found


def test_the_torch_backend_runs_the_heads_own_template(heads_dir, tiny_model_dir):
    """``medusa-run --model M --heads H`` (the torch backend) drafts with the template H's export.json names, as the
    engine exported from them does, not a chain over the heads."""
    from medusa_trt.exporter import load_medusa
    from medusa_trt.runtime import MedusaRuntime
    from medusa_trt.runtime.tree import load_tree

    model = load_medusa(str(tiny_model_dir("llama")), heads=heads_dir)
    runtime = MedusaRuntime(model, max_batch=1, max_context=64)
    want = load_tree(str(heads_dir / "template.json"))
    assert runtime.tree.paths == want.paths and runtime.tree.name == want.name
