"""OpenVINO folders of a base model, for ``medusa-bench --peer openvino:DIR``: the model this project
loads (``exporter.models.load_base_model``: the built-in GGUF, dequantized to fp32) saved as a plain
Hugging Face folder, then exported by ``optimum-cli export openvino`` (optimum-intel) per weight format.

    hf = save_hf_folder(load_base_model("smollm2-135m"), Path("build/openvino/smollm2-hf"))
    export_openvino(hf, Path("build/openvino/smollm2-fp32"), "fp32", optimum_cli="build/openvino-venv/bin/optimum-cli")

optimum-intel 2.2.0 needs transformers<5.6, which this project's export pins exclude: it runs from a
venv of its own (``make openvino-models`` makes ``build/openvino-venv``), called as a program here.
Two things a plain call gets wrong (measured, ../shared/README.md): a model ``transformers`` loaded
from a GGUF cannot be ``save_pretrained`` as it is (its config keeps the GGUF's
``quantization_config``), and int4 needs a group size dividing the hidden size (576 is not a
multiple of optimum's default 128) and ``--ratio 1.0`` (else some layers stay int8).
"""

from __future__ import annotations

import copy
import logging
import shutil
import subprocess
from pathlib import Path

from medusa_trt.runtime import durable
from medusa_trt.runtime.errors import MedusaError

log = logging.getLogger(__name__)

FORMATS = ("fp32", "int8", "int4")  # --weight-format of optimum-cli export openvino
INT4_GROUP = 32  # divides SmolLM2's 576 and stories260K's 64
# where make openvino-models installs it, in the checkout (bench/ lies at its root)
DEFAULT_CLI = Path(__file__).resolve().parents[1] / "build" / "openvino-venv" / "bin" / "optimum-cli"


def find_optimum_cli(given: str | Path | None = None) -> Path | None:
    """optimum-cli: ``given``, else build/openvino-venv's, else the one on PATH; None where there is none."""
    for candidate in (given, DEFAULT_CLI, shutil.which("optimum-cli")):
        if candidate and Path(candidate).is_file():
            return Path(candidate)
    return None


def save_hf_folder(base, out: Path) -> Path:
    """``base`` (``exporter.models.BaseModel``) as a plain Hugging Face folder: config, safetensors, tokenizer.
    The weights are rebuilt from the config and its state dict, so no GGUF quantization record follows them."""
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(base.model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the GGUF's: a folder carrying it cannot be loaded (nor saved) as plain weights
    model = AutoModelForCausalLM.from_config(config, dtype=base.model.dtype)
    missing, unexpected = model.load_state_dict(base.model.state_dict(), strict=False)
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    if set(missing) - tied or unexpected:
        raise MedusaError(f"cannot re-save {base.name}: missing weights {sorted(missing)}, unexpected {sorted(unexpected)}")
    if tied:
        model.tie_weights()
    _make_room(out, "config.json")
    with durable.staged_folder(out) as staging:  # whole or not at all; an earlier folder goes once the new one is in
        model.save_pretrained(staging)
        base.tokenizer.save_pretrained(staging)
        if base.model.generation_config is not None:
            base.model.generation_config.save_pretrained(staging)
    return out


def _make_room(out: Path, marker: str) -> None:
    """Check that ``out`` may be written (absent, empty, or a folder this module wrote before: it holds ``marker``),
    then make its parent where missing, for the staging folder that goes beside it."""
    if out.exists() and (not out.is_dir() or any(out.iterdir()) and not (out / marker).is_file()):
        raise MedusaError(f"{out} exists and is not a folder this script wrote (no {marker}): choose another --out, or remove it")
    out.parent.mkdir(parents=True, exist_ok=True)  # a fresh machine has no build/openvino


def export_openvino(hf: Path, out: Path, weight_format: str, *, optimum_cli: Path, group_size: int = INT4_GROUP) -> Path:
    """``optimum-cli export openvino`` of the folder ``hf`` into ``out`` with ``weight_format`` (one of FORMATS)."""
    if weight_format not in FORMATS:
        raise MedusaError(f"weight format {weight_format!r}: pick one of {', '.join(FORMATS)}")
    args = [str(optimum_cli), "export", "openvino", "--model", str(hf), "--task", "text-generation-with-past"]
    args += ["--weight-format", weight_format]
    if weight_format == "int4":  # every layer int4 (ratio 1.0), in groups that divide the hidden size
        args += ["--group-size", str(group_size), "--ratio", "1.0"]
    _make_room(out, "openvino_model.xml")
    with durable.staged_folder(out) as staging:  # a failed export leaves the earlier folder as it was
        log.info("%s", " ".join(args + [str(staging)]))
        proc = subprocess.run(args + [str(staging)], capture_output=True, text=True)
        if proc.returncode != 0 or not (staging / "openvino_model.xml").is_file():
            tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-5:])
            raise MedusaError(f"optimum-cli export openvino ({weight_format}) failed (exit {proc.returncode}):\n{tail}")
    return out
