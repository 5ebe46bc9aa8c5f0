"""Engine folders (``medusa-export --out DIR``): layout, loading, replacing, serving references."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import CUSTOM_TREE, STORY_PROMPTS, TREES, medusa_model

from medusa_trt.runtime import MedusaRuntime
from medusa_trt.runtime.engine import EngineError, EngineFiles, engine_meta, read_meta

NEW_TOKENS = 24
TREE = "mc_sim_7b_63" if TREES.is_file() else CUSTOM_TREE


@pytest.fixture(scope="module")
def stories_model(stories_base, stories_fitted):
    return medusa_model(stories_base, stories_fitted)


@pytest.fixture(scope="module")
def engines(stories_model, tmp_path_factory):
    """The same model exported twice: as an engine folder and as loose files."""
    from medusa_trt.exporter.onnx_export import ExportConfig, export_onnx

    root = tmp_path_factory.mktemp("folder-engines")
    (root / "loose").mkdir()
    config = ExportConfig(out=root / "stories", tree=TREE, max_batch=4, max_context=256, backend="onnxruntime")
    folder = export_onnx(stories_model, config).files
    loose = export_onnx(stories_model, ExportConfig(out=root / "loose" / "model.onnx", tree=TREE, max_batch=4, max_context=256)).files
    return folder, loose


def test_folder_layout_and_config(engines, stories_model):
    folder, loose = engines
    root = folder.folder
    assert folder == EngineFiles.in_folder(root) and EngineFiles.locate(root) == folder
    names = {p.name for p in root.iterdir()}
    assert {
        "config.json",
        "model.onnx",
        "heads.onnx",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
        "drafting.json",
        "files.json",
    } <= names
    assert not [n for n in names if n.startswith(".")], "no staging leftovers in the folder"
    config = json.loads((root / "config.json").read_text())
    assert config["format"] == "medusa-trt-engine" and config["version"] == 1 and config["backend"] == "onnxruntime"
    assert config["engine"] == json.loads(read_meta(loose.step).to_json()) | {"model": config["engine"]["model"]}
    assert engine_meta(root) == read_meta(folder.step)  # the graph's metadata and config.json agree
    step = config["graphs"]["step"]
    inputs = {"input_ids", "position_ids", "tree_mask", "cache_lengths", "past_key", "past_value", "key_slots", "logits_wanted"}
    assert set(step["inputs"]) == inputs
    assert step["inputs"]["logits_wanted"] == {"dtype": "bool", "shape": []}  # the gate of exporter/logits_gate.py
    assert step["inputs"]["input_ids"] == {"dtype": "int64", "shape": ["batch", "tokens"]}
    assert {"logits", "hidden", "new_key", "new_value"} <= set(step["outputs"])
    assert set(config["graphs"]["heads"]["inputs"]) == {"hidden"}
    assert config["files"]["step"] == "model.onnx" and config["files"]["heads"] == "heads.onnx" and config["files"]["step_plan"] is None
    generation = json.loads((root / "generation_config.json").read_text())
    eos = generation["eos_token_id"]
    assert sorted(eos if isinstance(eos, list) else [eos]) == sorted(stories_model.eos_token_ids)
    drafting = json.loads((root / "drafting.json").read_text())
    assert "heads_template" not in drafting and "drafters" not in drafting  # the tree is config.json's; the drafters the runtime's
    assert MedusaRuntime(root).drafting.names == ("heads", "lookup", "recycle")
    assert drafting["step_cost"]["1"] == 1.0 and drafting["heads_cost"] > 0  # the engine's own cost, timed at export
    listed = set(json.loads((root / "files.json").read_text())["files"])
    assert listed == names - {"files.json"}, "the manifest covers every file but itself"


def test_folder_decodes_like_the_loose_engine_and_plain(engines):
    folder, loose = engines
    got = MedusaRuntime(folder.folder).generate(STORY_PROMPTS, max_new_tokens=NEW_TOKENS)
    want = MedusaRuntime(loose.step).generate(STORY_PROMPTS, max_new_tokens=NEW_TOKENS)
    plain = MedusaRuntime(folder.folder, drafters=()).generate(STORY_PROMPTS, max_new_tokens=NEW_TOKENS)
    assert [r.token_ids for r in got] == [r.token_ids for r in want] == [r.token_ids for r in plain]
    assert [r.text for r in got] == [r.text for r in want]
    assert np.mean([r.stats.steps for r in got]) < np.mean([r.stats.steps for r in plain])  # the drafters run on a folder engine too


def test_medusa_run_takes_a_folder(engines, capsys):
    from medusa_trt.cli.run import main

    folder, _ = engines
    assert main(["--engine", str(folder.folder), "--prompt", STORY_PROMPTS[0], "--max-new-tokens", "8", "--json"]) == 0
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert line["token_ids"] == MedusaRuntime(folder.folder).generate(STORY_PROMPTS[0], max_new_tokens=8).token_ids


def test_a_folder_without_config_or_with_a_foreign_graph_is_refused(engines, tmp_path):
    folder, loose = engines
    with pytest.raises(EngineError, match="holds no config.json"):
        MedusaRuntime(tmp_path)
    with pytest.raises(EngineError, match="does not exist"):
        MedusaRuntime(tmp_path / "missing")
    copy = tmp_path / "copy"
    shutil.copytree(folder.folder, copy)
    config = json.loads((copy / "config.json").read_text())
    config["engine"]["max_context"] = 128  # says something the graph does not
    (copy / "config.json").write_text(json.dumps(config))
    (copy / "files.json").unlink()  # so the manifest is not what refuses it
    with pytest.raises(EngineError, match="does not describe model.onnx"):
        MedusaRuntime(copy)
    (copy / "config.json").write_text('{"format": "something-else"}')
    with pytest.raises(EngineError, match="not a medusa-trt engine config"):
        MedusaRuntime(copy)


def test_a_truncated_file_in_a_folder_is_named(engines, tmp_path):
    folder, _ = engines
    copy = tmp_path / "copy"
    shutil.copytree(folder.folder, copy)
    with open(copy / "heads.onnx", "r+b") as f:
        f.truncate(100)
    with pytest.raises(EngineError, match=r"heads\.onnx has 100 bytes"):
        MedusaRuntime(copy)


def test_export_replaces_an_engine_folder_and_refuses_other_folders(stories_model, tmp_path, capsys):
    from medusa_trt.cli.export import main
    from medusa_trt.exporter.onnx_export import ExportConfig, export_onnx

    out = tmp_path / "eng"
    export_onnx(stories_model, ExportConfig(out=out, tree="chain-2", max_batch=1, max_context=64, verify=False, backend="onnxruntime"))
    first = engine_meta(out)
    export_onnx(stories_model, ExportConfig(out=out, tree="chain-3", max_batch=2, max_context=64, verify=False, backend="onnxruntime"))
    assert engine_meta(out).tree_name == "chain-3" and first.tree_name == "chain-2"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["eng"], "no staging or old folder left beside it"
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    code = main(["--model", "../shared/models/stories260K.gguf", "--untrained-heads", "2", "--out", str(mine), "--no-verify"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and f"{mine}/notes.txt is not a file medusa-trt wrote" in err[0]
    assert sorted(p.name for p in mine.iterdir()) == ["notes.txt"]
    code = main(["--model", "../shared/models/stories260K.gguf", "--out", str(tmp_path / "m.onnx"), "--step-cost", "x.json"])
    assert code == 2 and "for engine folders" in capsys.readouterr().err


def test_step_cost_from_a_calibrate_report_is_the_folder_budget(stories_model, tmp_path):
    from medusa_trt.cli.export import main

    report = tmp_path / "tree.report.json"
    report.write_text(json.dumps({"step_ms": {"1": 20.0, "2": 20.0, "4": 24.0, "8": 30.0, "16": 40.0, "32": 80.0, "64": 160.0}}))
    out = tmp_path / "eng"
    assert (
        main(
            [
                "--model",
                "../shared/models/stories260K.gguf",
                "--untrained-heads",
                "2",
                "--out",
                str(out),
                "--no-verify",
                "--max-batch",
                "1",
                "--max-context",
                "64",
                "--step-cost",
                str(report),
            ]
        )
        == 0
    )
    assert json.loads((out / "drafting.json").read_text())["step_cost"] == {
        "1": 1.0,
        "2": 1.0,
        "4": 1.2,
        "8": 1.5,
        "16": 2.0,
        "32": 4.0,
        "64": 8.0,
    }
    runtime = MedusaRuntime(out)
    assert runtime.drafting.config.cost.table == {1: 1.0, 2: 1.0, 4: 1.2, 8: 1.5, 16: 2.0, 32: 4.0, 64: 8.0}
    assert not runtime.drafting.config.learn_cost
    other = MedusaRuntime(out, step_cost={1: 1.0, 64: 2.0})  # an explicit table still wins
    assert other.drafting.config.cost.table == {1: 1.0, 64: 2.0}
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]")
    from medusa_trt.cli.export import main as export_main

    assert export_main(["--model", "../shared/models/stories260K.gguf", "--out", str(tmp_path / "e2"), "--step-cost", str(bad)]) == 2


def _engine_param(model_folder: Path) -> str:
    text = (model_folder / "config.pbtxt").read_text()
    start = text.index('key: "engine"')
    return json.loads(text[text.index("string_value:", start) + len("string_value:") :].split("}")[0].strip())


@pytest.mark.parametrize("form", ["folder", "file"])
def test_triton_repo_references_the_engine_relatively(engines, tmp_path, form):
    """No absolute path: the repository and the engine move together and still resolve, the way
    the Triton model resolves it (relative to the model's folder)."""
    from medusa_trt.serving.triton_repo import TritonRepoConfig, write_triton_repo

    folder, loose = engines
    engine = folder.folder if form == "folder" else loose.step
    place = tmp_path / "place"
    shutil.copytree(engine if form == "folder" else engine.parent, place / "engines" / (engine.name if form == "folder" else "loose"))
    moved_engine = place / "engines" / (engine.name if form == "folder" else "loose/model.onnx")
    model = write_triton_repo(TritonRepoConfig(engine=moved_engine, repo=place / "repo"))
    ref = _engine_param(model)
    assert not os.path.isabs(ref) and (model / ref).resolve() == moved_engine.resolve()
    elsewhere = tmp_path / "elsewhere"
    shutil.move(str(place), str(elsewhere))  # move both together
    resolved = elsewhere / "repo" / "medusa" / ref
    assert (
        MedusaRuntime(resolved).generate(STORY_PROMPTS[0], max_new_tokens=8).token_ids
        == MedusaRuntime(engine).generate(STORY_PROMPTS[0], max_new_tokens=8).token_ids
    )


@pytest.mark.parametrize("form", ["folder", "file"])
def test_triton_repo_can_copy_the_engine_in(engines, tmp_path, form):
    from medusa_trt.cli.serve import repo_main

    folder, loose = engines
    engine = folder.folder if form == "folder" else loose.step
    assert repo_main(["--engine", str(engine), "--out", str(tmp_path / "repo"), "--copy-engine"]) == 0
    model = tmp_path / "repo" / "medusa"
    ref = _engine_param(model)
    assert ref == ("engine" if form == "folder" else "engine/model.onnx")
    copied = model / ref
    from medusa_trt.runtime.manifest import check_manifest

    assert check_manifest(EngineFiles.locate(copied), checksums=True)  # every file, byte for byte
    shutil.move(str(tmp_path / "repo"), str(tmp_path / "repo2"))
    assert (
        MedusaRuntime(tmp_path / "repo2" / "medusa" / ref).generate(STORY_PROMPTS[1], max_new_tokens=8).token_ids
        == MedusaRuntime(engine).generate(STORY_PROMPTS[1], max_new_tokens=8).token_ids
    )


def test_tensorrt_build_into_a_folder_stages_and_swaps(stories_model, tmp_path, monkeypatch):
    """The folder plumbing of a TensorRT build, with the builder itself replaced (no TensorRT
    here): the plans land beside the ONNX graphs, config.json says tensorrt, the manifest covers
    the plans, the ONNX files are shared (hard links), and a failed build leaves the folder as it was."""
    from medusa_trt.exporter import tensorrt_build
    from medusa_trt.exporter.onnx_export import ExportConfig, export_onnx
    from medusa_trt.runtime.engine_folder import read_folder_config

    # TensorRT builds take the appended layout and the ungated graph, no ONNX Runtime timing (what medusa-export does for them)
    plan_form = dict(tree=TREE, max_batch=4, max_context=256, key_slots=False, measure_cost=False, backend="onnxruntime")
    folder = export_onnx(stories_model, ExportConfig(out=tmp_path / "src", gate_logits=False, **plan_form)).files
    work = tmp_path / "eng"
    shutil.copytree(folder.folder, work)
    with pytest.raises(tensorrt_build.TensorRTBuildError, match="--no-key-slots"):
        keyed = ExportConfig(out=tmp_path / "keyed", tree=TREE, max_context=256, measure_cost=False, backend="onnxruntime")
        keyed = export_onnx(stories_model, keyed).files
        monkeypatch.setattr(tensorrt_build, "require_tensorrt", lambda path=None: object())
        tensorrt_build.build_engines(keyed.folder, tensorrt_build.TensorRTConfig(plan=keyed.folder / "model.plan"))
    shutil.rmtree(tmp_path / "keyed")
    with pytest.raises(tensorrt_build.TensorRTBuildError, match="--no-logits-gate"):
        gated = export_onnx(stories_model, ExportConfig(out=tmp_path / "gated", **plan_form)).files
        tensorrt_build.build_engines(gated.folder, tensorrt_build.TensorRTConfig(plan=gated.folder / "model.plan"))
    shutil.rmtree(tmp_path / "gated")
    built = []

    def fake_build(trt, onnx_path, target, profile, config, precisions):
        built.append((onnx_path.name, target.name, sorted(profile)))
        target.write_bytes(b"plan of " + onnx_path.name.encode())

    class FakeTrt:
        __version__ = "10.16.test"  # new enough for the graph's ops (tensorrt_ops)

    monkeypatch.setattr(tensorrt_build, "require_tensorrt", lambda path=None: FakeTrt)
    monkeypatch.setattr(tensorrt_build, "_build_one", fake_build)
    before = sorted(p.name for p in work.iterdir())
    files = tensorrt_build.build_engines(work, tensorrt_build.TensorRTConfig(plan=work / "model.plan"))
    assert files == EngineFiles.in_folder(work, ".plan") == EngineFiles.locate(work)
    assert [b[:2] for b in built] == [("model.onnx", "model.plan"), ("heads.onnx", "heads.plan")]
    assert sorted(p.name for p in work.iterdir()) == sorted(before + ["model.plan", "heads.plan"])
    config = read_folder_config(work)
    assert config.backend == "tensorrt" and config.files["step_plan"] == "model.plan" and config.files["heads_plan"] == "heads.plan"
    assert config.meta == engine_meta(folder.folder)
    assert config.meta.min_tensorrt == "10.15" and engine_meta(folder.folder).min_tensorrt is None  # the plans' need, not the graph's
    import types

    from medusa_trt.runtime.backends.tensorrt_backend import TensorRTBackend

    with monkeypatch.context() as older:  # the folder's plans under a TensorRT older than their graph needs: one line
        older.setitem(sys.modules, "tensorrt", types.SimpleNamespace(__version__="10.14.1.48"))
        with pytest.raises(EngineError, match=r"model.plan needs TensorRT 10.15 or newer \(its graph's ops\), this is TensorRT 10.14.1.48"):
            TensorRTBackend(work)
    listed = json.loads((work / "files.json").read_text())["files"]
    assert {"model.plan", "heads.plan", "model.onnx", "config.json"} <= set(listed)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["eng", "src"]
    from medusa_trt.runtime.backends.onnx_backend import OnnxBackend

    assert OnnxBackend(work).files == EngineFiles.in_folder(work)  # ONNX Runtime still runs the folder's ONNX graphs

    def failing_build(trt, onnx_path, target, profile, config, precisions):
        raise tensorrt_build.TensorRTBuildError("no engine")

    monkeypatch.setattr(tensorrt_build, "_build_one", failing_build)
    again = tmp_path / "again"
    shutil.copytree(folder.folder, again)
    with pytest.raises(tensorrt_build.TensorRTBuildError):
        tensorrt_build.build_engines(again, tensorrt_build.TensorRTConfig(plan=again / "model.plan"))
    assert sorted(p.name for p in again.iterdir()) == before and read_folder_config(again).backend == "onnxruntime"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["again", "eng", "src"]


def test_export_cli_writes_a_folder(tmp_path):
    """The one-line summary names the folder; the subprocess leaves only the folder."""
    out = tmp_path / "cli-engine"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "medusa_trt.cli.export",
            "--model",
            "../shared/models/stories260K.gguf",
            "--untrained-heads",
            "2",
            "--out",
            str(out),
            "--max-batch",
            "1",
            "--max-context",
            "64",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"wrote {out}/ (config.json, model.onnx, heads.onnx" in proc.stdout and "verified against torch" in proc.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cli-engine"]
    assert MedusaRuntime(out).generate("Once upon a time", max_new_tokens=4).token_ids


@pytest.mark.parametrize("backend", [None, "onnxruntime", "native"])
def test_a_runtime_reads_its_folder_once(engines, monkeypatch, backend):
    """MedusaRuntime(DIR) reads config.json once and drafting.json at most once (runtime/engine.EngineSource: where
    the runtime asks for it) and chooses the backend in one place (runtime/backends.backend_name), whichever backend
    then opens the folder's graphs."""
    from medusa_trt.runtime import engine

    reads = []
    for name in ("read_folder_config", "read_drafting"):
        monkeypatch.setattr(engine, name, lambda folder, read=getattr(engine, name), name=name: reads.append(name) or read(folder))
    folder = engines[0].folder
    runtime = MedusaRuntime(folder, backend=backend)
    assert reads.count("read_folder_config") == 1 and reads.count("read_drafting") <= 1 and reads[0] == "read_folder_config", reads
    assert runtime.backend.name == (backend or json.loads((folder / "config.json").read_text())["backend"])
