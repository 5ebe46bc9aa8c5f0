"""The engine folder's backend when the export is not told (exporter/backend_choice.py): native where it runs the engine,
exactly and faster than ONNX Runtime here, else onnxruntime, with the reason in one printed line and in drafting.json;
a folder that says native opens on onnxruntime, with one warning, where native cannot run (and raises when asked for
by name). The timing is replaced where a test needs one outcome: which backend is faster on a shared machine is not
the test's to decide."""

from __future__ import annotations

import dataclasses
import json
import logging
import re

import pytest
from conftest import STORIES, medusa_model

from medusa_trt.exporter import backend_choice
from medusa_trt.runtime import MedusaRuntime, native_library, native_weights
from medusa_trt.runtime.engine import EngineError, EngineFiles
from medusa_trt.runtime.engine_folder import read_drafting, read_folder_config, write_folder_config
from medusa_trt.runtime.manifest import write_manifest

FIGURES = r"one-token step [\d.]+ ms vs [\d.]+ ms on onnxruntime, 3-token step [\d.]+ ms vs [\d.]+ ms"  # a chain-2 tree: 3 tokens
CHOICE = re.compile(rf"^backend (native: exact, {FIGURES}|onnxruntime: native is exact but not faster here \({FIGURES}\))$")


def _timed(native_ms: float, onnxruntime_ms: float):
    """A stand-in for ``backend_choice.time_backends``: each width costs these (times the width's square root)."""

    def time_backends(backends, width, *, rounds=backend_choice.ROUNDS):
        assert set(backends) == {"native", "onnxruntime"} and rounds == backend_choice.ROUNDS
        sizes = sorted({1, width})
        return {"native": {t: native_ms * t**0.5 for t in sizes}, "onnxruntime": {t: onnxruntime_ms * t**0.5 for t in sizes}}

    return time_backends


def _export(model, out, **overrides):
    from medusa_trt.exporter.onnx_export import ExportConfig, export_onnx

    return export_onnx(model, ExportConfig(out=out, **(dict(tree="chain-2", max_batch=2, max_context=128) | overrides)))


def _rewrite_backend(folder, backend: str) -> None:
    """config.json saying ``backend``, the manifest recorded anew (as a folder copied from elsewhere would hold)."""
    write_folder_config(folder, dataclasses.replace(read_folder_config(folder), backend=backend))
    write_manifest(EngineFiles.in_folder(folder))


@pytest.fixture(scope="module")
def native_folder(stories_base, stories_fitted, tmp_path_factory):
    """The stories engine exported with no backend, native timed faster: (folder, ExportResult)."""
    out = tmp_path_factory.mktemp("auto") / "stories"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(backend_choice, "time_backends", _timed(1.0, 2.0))
        result = _export(medusa_model(stories_base, stories_fitted), out)
    return out, result


def test_an_export_left_to_choose_records_native_where_exact_and_faster(native_folder):
    folder, result = native_folder
    assert read_folder_config(folder).backend == "native"
    said = "backend native: exact, one-token step 1.00 ms vs 2.00 ms on onnxruntime, 3-token step 1.73 ms vs 3.46 ms"
    assert result.backend_choice.summary() == said
    drafting = read_drafting(folder)
    assert drafting["backend_choice"] == {
        "backend": "native",
        "reason": result.backend_choice.reason,
        "step_ms": {"native": {"1": 1.0, "3": 1.732}, "onnxruntime": {"1": 2.0, "3": 3.464}},
    }
    # the step cost and the exactness the folder records were measured on native
    assert drafting["exactness"]["verify_equals_plain"] is True and drafting["step_cost"]["1"] == 1.0
    runtime = MedusaRuntime(folder, threads=2)
    assert runtime.backend.name == "native" and runtime._folder_step_cost is not None
    assert re.fullmatch(r"native \(\w+, 2 threads\)", runtime.backend.describe())


def test_an_export_where_native_is_slower_records_onnxruntime(stories_base, stories_fitted, tmp_path, monkeypatch):
    monkeypatch.setattr(backend_choice, "time_backends", _timed(3.0, 2.0))
    result = _export(medusa_model(stories_base, stories_fitted), tmp_path / "stories", verify=False)
    folder = result.files.folder
    assert read_folder_config(folder).backend == "onnxruntime"
    assert result.backend_choice.summary() == (
        "backend onnxruntime: native is exact but not faster here "
        "(one-token step 3.00 ms vs 2.00 ms on onnxruntime, 3-token step 5.20 ms vs 3.46 ms)"
    )
    drafting = read_drafting(folder)
    assert drafting["backend_choice"]["backend"] == "onnxruntime" and drafting["step_cost"]["1"] == 1.0
    assert MedusaRuntime(folder, threads=2).backend.name == "onnxruntime"


def test_an_engine_too_large_for_a_second_copy_records_native_untimed(stories_base, stories_fitted, tmp_path, monkeypatch):
    """Where ONNX Runtime's copy of the weights would not fit beside native's (a streamed export of a model larger
    than half the memory), the two are never open together: native, exact, is chosen without timing."""
    from medusa_trt.exporter import streamed

    def never(*_, **__):
        raise AssertionError("timed with two engines open")

    monkeypatch.setattr(backend_choice, "time_backends", never)
    monkeypatch.setattr(streamed, "available_memory", lambda: 1 << 20)  # 1 MiB left
    result = _export(medusa_model(stories_base, stories_fitted), tmp_path / "stories", verify=False)
    assert read_folder_config(result.files.folder).backend == "native"
    assert result.backend_choice.summary().startswith("backend native: exact; not timed against onnxruntime: a second copy")
    assert result.backend_choice.step_ms == {} and result.backend_choice.exactness.exact
    assert read_drafting(result.files.folder)["exactness"]["verify_equals_plain"] is True


def test_an_engine_native_cannot_run_records_onnxruntime_and_why(tiny_model_dir, tmp_path, monkeypatch, caplog):
    """Tiny Helium, its model type taken off native's list: onnxruntime, the reason naming the model type;
    rewritten to say native (a folder of an older or newer medusa-trt), it still opens, on onnxruntime, with one
    warning; asked for by name, native raises."""
    from medusa_trt.exporter import load_base_model
    from tests.conftest import off_native_list, random_heads

    def never(*args, **kwargs):
        raise AssertionError("nothing is timed when native cannot run the engine")

    monkeypatch.setattr(backend_choice, "time_backends", never)
    off_native_list(monkeypatch)
    helium = load_base_model(tiny_model_dir("helium"))
    result = _export(medusa_model(helium, random_heads(helium)), tmp_path / "helium", verify=False)
    folder = result.files.folder
    assert read_folder_config(folder).backend == "onnxruntime"
    why = f"native cannot run this engine (model type 'helium' is not one of {', '.join(native_weights.MODEL_TYPES)})"
    assert result.backend_choice.summary() == f"backend onnxruntime: {why}"
    assert read_drafting(folder)["backend_choice"]["step_ms"] == {}
    _rewrite_backend(folder, "native")
    with caplog.at_level(logging.WARNING, logger="medusa_trt"):
        assert MedusaRuntime(folder, threads=2).backend.name == "onnxruntime"
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    warned = [w for w in warned if "native" in w]  # (ONNX Runtime's attention may also warn it is not exact here)
    assert len(warned) == 1 and "names backend native, which cannot run it here" in warned[0] and "model type 'helium'" in warned[0]
    with pytest.raises(EngineError, match="backend native cannot run .*model type 'helium'"):
        MedusaRuntime(folder, backend="native", threads=2)


def test_a_native_folder_where_the_library_cannot_load_opens_on_onnxruntime(native_folder, monkeypatch, caplog):
    """No library for this CPU (NativeUnavailable): the folder's choice falls back with one warning naming why; asked
    for by name, native is an error."""
    folder, _ = native_folder

    def unavailable(cap=None):
        raise native_library.NativeUnavailable("this CPU runs none of avx2, baseline")

    monkeypatch.setattr(native_library, "load", unavailable)
    with caplog.at_level(logging.WARNING, logger="medusa_trt"):
        runtime = MedusaRuntime(folder, threads=2)
    assert runtime.backend.name == "onnxruntime"
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    why = "this CPU runs none of avx2, baseline"
    assert warned == [f"{folder} names backend native, which cannot run it here ({why}): running it on onnxruntime"]
    assert runtime._folder_step_cost is None  # native's table is not onnxruntime's: it learns its own
    assert runtime.generate("Once upon a time", max_new_tokens=4).token_ids
    with pytest.raises(native_library.NativeUnavailable, match="this CPU runs none of"):
        MedusaRuntime(folder, backend="native", threads=2)


def test_medusa_export_says_which_backend_and_why_in_one_line(tmp_path, capsys):
    """Timed for real: whichever backend wins here, one line says it with the figures, and drafting.json agrees."""
    from medusa_trt.cli.export import main

    out = tmp_path / "engine"
    argv = ["--model", str(STORIES), "--untrained-heads", "2", "--tree", "chain-2", "--max-batch", "1", "--max-context", "64"]
    assert main([*argv, "--out", str(out), "--no-verify"]) == 0
    said = [line for line in capsys.readouterr().out.splitlines() if line.startswith("backend ")]
    assert len(said) == 1 and CHOICE.match(said[0]), said
    choice = read_drafting(out)["backend_choice"]
    assert said[0] == f"backend {choice['backend']}: {choice['reason']}" and read_folder_config(out).backend == choice["backend"]
    native, onnxruntime = choice["step_ms"]["native"], choice["step_ms"]["onnxruntime"]
    assert set(native) == set(onnxruntime) == {"1", "3"}
    assert (choice["backend"] == "native") == all(native[t] < onnxruntime[t] for t in native)


def test_medusa_demo_names_the_backend(native_folder, tmp_path, capsys):
    from medusa_trt.cli.demo import main

    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps({"prompts": [{"name": "story", "prompt": "Once upon a time"}]}))
    folder, _ = native_folder
    assert main(["--engine", str(folder), "--prompts", str(prompts), "--max-new-tokens", "8", "--threads", "2"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith(f"medusa-demo: {folder}, backend native (") and ", 2 threads), heads template chain-2" in first, first


def test_an_explicit_backend_is_recorded_without_a_choice(stories_base, stories_fitted, tmp_path, monkeypatch):
    def never(*args, **kwargs):
        raise AssertionError("an export told its backend times nothing to choose one")

    monkeypatch.setattr(backend_choice, "choose_backend", never)
    result = _export(medusa_model(stories_base, stories_fitted), tmp_path / "told", verify=False, backend="onnxruntime")
    assert result.backend_choice is None and read_folder_config(result.files.folder).backend == "onnxruntime"
    assert "backend_choice" not in read_drafting(result.files.folder)
