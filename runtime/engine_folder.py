"""An engine folder's ``config.json``: what the folder holds, readable without loading a graph.

``medusa-export --out DIR`` writes one folder (like optimum's and onnxruntime-genai's model folders,
which ``hf upload``, container mounts and Triton repositories expect)::

  DIR/config.json             this file: format, backend, EngineMeta, file names, graph inputs/outputs
  DIR/model.onnx (+ .data)    the step graph (docs/architecture.md, the step contract)
  DIR/heads.onnx              the heads graph (absent without heads)
  DIR/tokenizer.json ...      the tokenizer files, chat template included
  DIR/generation_config.json  the base model's generation defaults (EOS ids)
  DIR/drafting.json           the drafting budget: step cost, heads cost, exactness and backend choice measured at export
  DIR/model.plan, heads.plan  TensorRT engines built from the ONNX graphs (backend "tensorrt")
  DIR/files.json              size and sha256 of every file above (``runtime/manifest.py``)

``config.json``::

  {"format": "medusa-trt-engine", "version": 1, "backend": "onnxruntime" | "openvino" | "native" | "tensorrt",
   "engine": {EngineMeta fields},
   "files": {"step": "model.onnx", "heads": "heads.onnx" | null, "step_plan": ..., "heads_plan": ...,
             "tokenizer": "tokenizer.json", "generation_config": ..., "drafting": "drafting.json"},
   "graphs": {"step": {"inputs": {NAME: {"dtype": "int64", "shape": ["batch", "tokens"]}}, "outputs": {...}},
              "heads": {...}}}

Shapes name their symbolic dimensions as the graph does. The graphs carry the same metadata in
their ``metadata_props``; the backends check that the two agree. numpy-free, json only.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path

from medusa_trt.runtime.contract import BACKENDS
from medusa_trt.runtime.durable import write_text
from medusa_trt.runtime.engine_meta import EngineMeta
from medusa_trt.runtime.errors import EngineError

FOLDER_CONFIG = "config.json"
FOLDER_FORMAT = "medusa-trt-engine"
FOLDER_VERSION = 1
DRAFTING_FILE = "drafting.json"
GENERATION_CONFIG = "generation_config.json"


@dataclass(frozen=True)
class FolderConfig:
    backend: str  # onnxruntime | openvino | native | tensorrt: which backend MedusaRuntime(DIR) runs (tensorrt: the plans)
    meta: EngineMeta
    files: dict  # role -> file name in the folder (None: absent)
    graphs: dict  # "step" / "heads" -> {"inputs": {name: {"dtype", "shape"}}, "outputs": {...}}

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise EngineError(f"engine folder backend {self.backend!r} is not one of {', '.join(BACKENDS)}: export it again")

    def to_json(self) -> str:
        return json.dumps(
            {
                "format": FOLDER_FORMAT,
                "version": FOLDER_VERSION,
                "backend": self.backend,
                "engine": dataclasses.asdict(self.meta),
                "files": self.files,
                "graphs": self.graphs,
            },
            indent=1,
            sort_keys=True,
        )

    @classmethod
    def from_json(cls, text: str, *, source: str) -> FolderConfig:
        try:
            raw = json.loads(text)
        except ValueError as exc:
            raise EngineError(f"{source} is not valid JSON ({exc}): export the engine folder again") from exc
        if not isinstance(raw, dict) or raw.get("format") != FOLDER_FORMAT:
            raise EngineError(
                f'{source} is not a medusa-trt engine config (no "format": "{FOLDER_FORMAT}"): pass a folder medusa-export wrote'
            )
        if raw.get("version") != FOLDER_VERSION:
            raise EngineError(f"{source}: engine folder version {raw.get('version')}, this runtime reads {FOLDER_VERSION}: export it again")
        for key, kind in (("engine", dict), ("files", dict), ("graphs", dict), ("backend", str)):
            if not isinstance(raw.get(key), kind):
                raise EngineError(f"{source} lacks a valid {key!r} entry: export the engine folder again")
        meta = EngineMeta.from_json(json.dumps(raw["engine"]), source=source)
        return cls(backend=raw["backend"], meta=meta, files=raw["files"], graphs=raw["graphs"])


def read_folder_config(folder: str | os.PathLike) -> FolderConfig:
    """The ``config.json`` of an engine folder, with errors naming what is wrong and the fix."""
    folder = Path(folder)
    path = folder / FOLDER_CONFIG
    if not path.is_file():
        raise EngineError(
            f"{folder} is a folder but holds no {FOLDER_CONFIG}, so it is not an engine folder: "
            f"export one with medusa-export --out {folder}, or pass the engine's .onnx / .plan file"
        )
    return FolderConfig.from_json(path.read_text(encoding="utf-8", errors="replace"), source=str(path))


def write_folder_config(folder: Path, config: FolderConfig) -> Path:
    """Write ``config.json`` (through a temporary file: a reader never sees half of it)."""
    return write_text(folder / FOLDER_CONFIG, config.to_json())


def read_drafting(folder: str | os.PathLike) -> dict:
    """The folder's ``drafting.json`` ({} when absent): the ``step_cost`` table, ``heads_cost``, ``exactness``, ``backend_choice``."""
    path = Path(folder) / DRAFTING_FILE
    if not path.is_file():
        return {}
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
        assert isinstance(raw, dict)
    except (ValueError, AssertionError, UnicodeDecodeError) as exc:
        raise EngineError(f"{path} is not a JSON object: export the engine folder again") from exc
    return raw


def step_cost_table(raw) -> dict[int, float] | None:
    """A drafting.json ``step_cost`` ({"1": 1.0, "2": 1.02, ...}) as {tokens: cost}; None when absent."""
    if raw is None:
        return None
    try:
        return {int(k): float(v) for k, v in raw.items()}
    except (AttributeError, TypeError, ValueError) as exc:
        raise EngineError(f"drafting.json step_cost {raw!r} must map tokens per step to costs: export the engine folder again") from exc
