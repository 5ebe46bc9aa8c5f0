"""Write an engine folder (``medusa-export --out DIR``): the files beside the graphs, and the swap.

The layout and ``config.json`` are described in ``runtime/engine_folder.py``. ``export_onnx``
stages the graphs and tokenizer in a hidden folder beside ``DIR``; ``write_folder_files`` adds
``config.json``, ``generation_config.json`` and ``drafting.json`` there; ``swap_folder`` puts
the staged folder in place (``runtime/durable.py``: an earlier engine folder of the same name,
one whose files.json lists every file in it, is replaced whole and removed only once the new one
is in place; a reader sees the old folder or the new one, never a mix or neither).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from medusa_trt.runtime import durable
from medusa_trt.runtime.engine import EngineFiles, EngineMeta
from medusa_trt.runtime.engine_folder import DRAFTING_FILE, GENERATION_CONFIG, FolderConfig, write_folder_config

log = logging.getLogger(__name__)


def graph_io(path: Path) -> dict:
    """{"inputs": {name: {"dtype", "shape"}}, "outputs": {...}} of an ONNX graph (weights not loaded);
    symbolic dimensions by their names, as in onnxruntime-genai's genai_config."""
    import onnx
    from onnx import helper

    graph = onnx.load(str(path), load_external_data=False).graph

    def describe(values) -> dict:
        out = {}
        for v in values:
            t = v.type.tensor_type
            dims = [d.dim_param or (d.dim_value if d.HasField("dim_value") else "?") for d in t.shape.dim]
            out[v.name] = {"dtype": helper.tensor_dtype_to_np_dtype(t.elem_type).name, "shape": dims}
        return out

    return {"inputs": describe(graph.input), "outputs": describe(graph.output)}


def write_folder_files(
    model,
    staged: EngineFiles,
    meta: EngineMeta,
    *,
    step_cost: dict | None = None,
    backend: str = "onnxruntime",
    heads_cost: float | None = None,
    exactness=None,
    choice=None,
) -> None:
    """config.json, generation_config.json and drafting.json of a staged engine folder (``exactness``:
    a ``runtime.exactness.Exactness`` measured on it, recorded as drafting.json's ``exactness``; ``choice``: the
    ``backend_choice.BackendChoice`` that chose ``backend``, recorded as its ``backend_choice``)."""
    folder = staged.folder
    _write_json(folder / GENERATION_CONFIG, generation_config(model, meta))
    # the heads template is config.json's (EngineMeta.tree); the drafters MedusaRuntime(DIR) runs are the runtime's to
    # decide (runtime/drafting: every one this engine supports, where drafting pays at this step cost)
    drafting = {"step_cost": None if step_cost is None else {str(k): float(v) for k, v in sorted(step_cost.items())}}
    if heads_cost is not None:  # the heads call after a step, relative to a one-token step (runtime/step_cost.py)
        drafting["heads_cost"] = float(heads_cost)
    if exactness is not None:
        drafting["exactness"] = exactness.to_json()
    if choice is not None:
        drafting["backend_choice"] = choice.to_json()
    _write_json(folder / DRAFTING_FILE, drafting)
    write_folder_config(folder, folder_config(folder, meta, backend))


def folder_config(folder: Path, meta: EngineMeta, backend: str) -> FolderConfig:
    """What config.json says of the files now in ``folder``."""
    onnx = EngineFiles.in_folder(folder)
    plan = EngineFiles.in_folder(folder, ".plan")
    names = {
        "step": onnx.step.name,
        "heads": onnx.heads.name if onnx.heads.is_file() else None,
        "step_plan": plan.step.name if plan.step.is_file() else None,
        "heads_plan": plan.heads.name if plan.heads.is_file() else None,
        "tokenizer": "tokenizer.json",
        "generation_config": GENERATION_CONFIG,
        "drafting": DRAFTING_FILE,
    }
    graphs = {"step": graph_io(onnx.step)}
    if onnx.heads.is_file():
        graphs["heads"] = graph_io(onnx.heads)
    return FolderConfig(backend=backend, meta=meta, files=names, graphs=graphs)


def generation_config(model, meta: EngineMeta) -> dict:
    """The base model's generation defaults (transformers' generation_config.json), EOS ids as exported."""
    config = getattr(getattr(model, "base", None), "generation_config", None)
    raw = config.to_diff_dict() if config is not None else {}  # the values that differ from transformers defaults
    raw = {k: v for k, v in raw.items() if not k.startswith("_") and _jsonable(v)}
    raw["eos_token_id"] = list(meta.eos_token_ids) if len(meta.eos_token_ids) != 1 else meta.eos_token_ids[0]
    return raw


def _jsonable(value) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


def record_step_cost(folder: str | os.PathLike, step_ms: dict[int, float], heads_ms: float = 0.0) -> Path:
    """Write an engine folder's measured step cost into its drafting.json (relative to the one-token
    step) and re-record the manifest: the folder is staged (its files hard-linked, those two written
    anew) and swapped in whole, so a kill never leaves a drafting.json its manifest does not list.
    Returns drafting.json's path."""
    from medusa_trt.runtime.engine_folder import read_drafting
    from medusa_trt.runtime.manifest import engine_file_list, write_manifest

    folder = Path(folder)
    one = step_ms[min(step_ms)]
    drafting = read_drafting(folder) | {
        "step_cost": {str(k): float(v / one) for k, v in sorted(step_ms.items())},
        "heads_cost": float(heads_ms / one),
    }
    durable.check_folder_ours(folder, kind="engine", flag="--engine")
    with durable.staged_folder(folder) as tmp:
        durable.link_files(engine_file_list(EngineFiles.locate(folder)), folder, tmp)
        _write_json(tmp / DRAFTING_FILE, drafting)  # a new file over the link: the live folder's is untouched
        write_manifest(EngineFiles.locate(tmp))
    return folder / DRAFTING_FILE


def _write_json(path: Path, data) -> None:
    durable.write_text(path, json.dumps(data, indent=1, sort_keys=True))


def swap_folder(staged: Path, out: Path) -> None:
    """Put the staged folder at ``out`` (``durable.replace_folder``); an earlier engine folder there
    is checked to be ours once more (a file may have been added while the engine was built) and
    removed only once the new one is in place."""
    durable.check_folder_ours(out, kind="engine")
    durable.replace_folder(staged, out)


def read_step_cost(path: str | os.PathLike) -> dict[int, float]:
    """``--step-cost FILE``: a medusa-calibrate report (its measured ``step_ms`` per tokens per step),
    or a JSON object of tokens per step -> cost; returned relative to the smallest size's cost."""
    from medusa_trt.exporter.errors import ExportError

    path = Path(path)
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        raise ExportError(f"--step-cost {path} cannot be read as JSON ({exc}): pass a medusa-calibrate report (.report.json)") from exc
    table = raw.get("step_ms", raw) if isinstance(raw, dict) else None
    try:
        costs = {int(k): float(v) for k, v in table.items()}
        assert costs and all(k >= 1 and v > 0 for k, v in costs.items())
    except (AttributeError, TypeError, ValueError, AssertionError) as exc:
        raise ExportError(
            f"--step-cost {path} must hold step_ms (a medusa-calibrate report) or map tokens per step (>= 1) to positive costs"
        ) from exc
    base = costs[min(costs)]
    return {k: v / base for k, v in sorted(costs.items())}
