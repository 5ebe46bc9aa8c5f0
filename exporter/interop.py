"""Heads and trees in the formats other Medusa runtimes read: the FasterDecoding/Medusa layout and
a plain ``medusa_choices`` list.

A FasterDecoding heads folder (what FasterDecoding's ``MedusaModel``, TensorRT-LLM's
``convert_checkpoint.py --medusa_model_dir`` and TGI read; :func:`exporter.heads.load_heads` reads it too)::

    config.json                  medusa_num_heads, medusa_num_layers, base_model_name_or_path,
                                 hidden_size, vocab_size
    medusa_lm_head.safetensors   {k}.{l}.linear.weight [H, H], {k}.{l}.linear.bias [H]  (block l of head k)
                                 {k}.{L}.weight [V, H]                                  (head k's projection)
    medusa_choices.json          optional: the tree as a list of paths (see medusa_choices_json)

Every head carries its own projection: TensorRT-LLM and TGI's first loader read ``{k}.{L}.weight``
for each head. ``config.json`` has no ``architectures`` key: TGI's newer loader takes a config
with one for another speculator and silently drops the heads. vLLM's Medusa drafter reads the
same ``config.json`` fields (hidden_size, vocab_size, and medusa_num_heads / medusa_num_layers
as num_heads / num_hidden_layers) but its own weight names, without block biases.

What the format cannot carry, refused with :class:`InteropError`: heads that read the next
token's embedding (``head_input = "hidden+next"``) and heads on an intermediate decoder layer
(``head_layer``): every reader feeds the heads the final normed hidden state only.

Imports no torch until a heads function runs: ``medusa_choices_json`` serves the lean install
(``medusa-calibrate --engine``).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

from medusa_trt.runtime import durable
from medusa_trt.runtime.errors import MedusaError
from medusa_trt.runtime.manifest import write_folder_manifest

if TYPE_CHECKING:
    import torch

    from medusa_trt.exporter.heads import HeadsConfig, MedusaHeads

log = logging.getLogger(__name__)

FD_CONFIG = "config.json"
FD_WEIGHTS = "medusa_lm_head.safetensors"
MEDUSA_CHOICES = "medusa_choices.json"
FD_FILES = (FD_CONFIG, FD_WEIGHTS, MEDUSA_CHOICES)  # what save_fasterdecoding writes for FasterDecoding's readers (+ files.json)
FD_TOP_K = 10  # proposals per head that FasterDecoding's reference code (TOPK) and TGI's trees index into
FORMATS = ("fasterdecoding",)  # what convert_heads writes


class InteropError(MedusaError):
    """The heads or tree cannot be written in the requested format; the message says what to do."""


def check_fasterdecoding(config: HeadsConfig) -> None:
    """Raise InteropError unless heads of ``config`` mean the same thing in the FasterDecoding layout."""
    if config.reads_next:
        raise InteropError(
            f"these heads read the next token's embedding (head_input {config.head_input!r}), and the FasterDecoding format has no "
            "next-token input: no reader of it (TensorRT-LLM, vLLM, TGI) could run them. Train heads with --head-input hidden "
            "to export to it"
        )
    if config.head_layer is not None:
        raise InteropError(
            f"these heads read decoder layer {config.head_layer}, and the FasterDecoding format has no such field: its readers "
            "feed the heads the final hidden state. Train heads without --head-layer to export to it"
        )


def fasterdecoding_config(heads: MedusaHeads, base_model: str | None = None) -> dict:
    """``config.json`` of the FasterDecoding folder; ``base_model`` (a Hugging Face id or folder)
    overrides the name the heads recorded (readers load the base model from it)."""
    cfg = heads.config
    name = base_model if base_model is not None else cfg.base_model
    if not name:
        log.warning(
            "the heads record no base model: config.json gets base_model_name_or_path '', which TGI and "
            "FasterDecoding need to find the base model; pass base_model (--base-model) with its Hugging Face id"
        )
    elif _medusa_trt_only(name):
        log.warning(
            "base_model_name_or_path %r is a name only medusa-trt knows: pass base_model (--base-model) with the "
            "base model's Hugging Face id or folder for other readers",
            name,
        )
    return {
        "medusa_num_heads": cfg.num_heads,
        "medusa_num_layers": cfg.num_layers,
        "base_model_name_or_path": name,
        "hidden_size": cfg.hidden_size,
        "vocab_size": cfg.vocab_size,
    }


def _medusa_trt_only(name: str) -> bool:
    """A built-in model name or a GGUF file: nothing another runtime can load as a base model."""
    from medusa_trt.exporter.models import BUILTIN_MODELS

    return name in BUILTIN_MODELS or name.endswith(".gguf")


def fasterdecoding_state(heads: MedusaHeads, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The weights under FasterDecoding names, each its own contiguous CPU tensor (``dtype``: cast,
    None keeps the heads' own). Heads that share the base model's ``lm_head`` get a copy of its
    weight as each head's projection ``{k}.{L}.weight``: the format has no shared projection that
    TensorRT-LLM reads, so the file grows by n * V * H values."""
    check_fasterdecoding(heads.config)
    cfg = heads.config
    state = {k.removeprefix("heads."): v.detach() for k, v in heads.state_dict().items()}
    if cfg.shared_lm_head:
        lm_head = heads.base_lm_head  # the base model's module, held outside the heads' module tree
        if getattr(lm_head, "bias", None) is not None:
            raise InteropError(
                "the base model's lm_head has a bias, which the FasterDecoding format cannot carry (each head's projection is weight-only)"
            )
        weight = lm_head.weight.detach()  # (V, H)
        if tuple(weight.shape) != (cfg.vocab_size, cfg.hidden_size):
            raise InteropError(f"the shared lm_head is {tuple(weight.shape)} but the heads expect ({cfg.vocab_size}, {cfg.hidden_size})")
        for k in range(cfg.num_heads):
            state[f"{k}.{cfg.num_layers}.weight"] = weight
    # clone: safetensors refuses tensors that share storage (the copies of one lm_head)
    return {k: v.to(device="cpu", dtype=dtype or v.dtype).clone().contiguous() for k, v in sorted(state.items())}


def medusa_choices(tree) -> list[list[int]]:
    """A tree (CompiledTree or a list of paths) as a ``medusa_choices`` list: sorted by (length,
    path), so every parent comes before its children, as FasterDecoding sorts it before use."""
    from medusa_trt.runtime.tree import CompiledTree, compile_tree

    compiled = tree if isinstance(tree, CompiledTree) else compile_tree(tree)
    choices = [list(p) for p in compiled.paths]
    deepest = max((max(p) for p in choices), default=0)  # 0-based rank
    if deepest >= FD_TOP_K:
        log.warning(
            "tree %r uses proposals up to rank %d: FasterDecoding/Medusa's reference code and TGI take only the top %d of each head",
            compiled.name,
            deepest,
            FD_TOP_K,
        )
    return choices


def medusa_choices_json(tree) -> str:
    """``medusa_choices`` as one line of JSON, ``[[0], [1], [0, 0]]``: also a Python literal, as
    TensorRT-LLM's ``--medusa_choices`` takes it. ``load_tree`` reads it back (top_k is inferred
    as the largest rank + 1, which is what a calibrated tree records)."""
    return json.dumps(medusa_choices(tree))


def write_medusa_choices(tree, path: str | os.PathLike) -> Path:
    """Write ``medusa_choices_json(tree)`` to ``path`` whole or not at all (``runtime/durable.py``)."""
    return durable.write_text(Path(path), medusa_choices_json(tree) + "\n")


def check_out_folder(folder: str | os.PathLike) -> Path:
    """``folder`` as a place for a FasterDecoding export, checked before any work: its parent
    exists, and it is new, empty, or an earlier export of ours (its files.json lists every file in
    it, ``runtime/durable.py``): nothing else is replaced, a FasterDecoding folder from elsewhere neither."""
    folder = Path(folder)
    if not folder.parent.is_dir():
        raise InteropError(f"cannot write {folder}: folder {folder.parent} does not exist; create it or pick another output folder")
    if folder.exists() and not folder.is_dir():
        raise InteropError(f"cannot write {folder}: it is a file; pick a folder name")
    durable.check_folder_ours(folder, kind="fasterdecoding")
    return folder


def save_fasterdecoding(
    heads: MedusaHeads, folder: str | os.PathLike, *, base_model: str | None = None, tree=None, dtype: torch.dtype | None = None
) -> Path:
    """Write ``heads`` as a FasterDecoding folder (and ``tree``, a CompiledTree or list of paths, as
    its ``medusa_choices.json``) with a ``files.json`` manifest, whole: staged beside it, then swapped
    in (``runtime/durable.py``); an earlier export of ours there is removed only once the new one is in place.

    Shared-lm_head heads are written with the base ``lm_head`` weight copied into every head (see
    :func:`fasterdecoding_state`): for SmolLM2-135M (V = 49152, H = 576) that is 113 MB per head in
    float32. ``dtype`` casts the weights (torch.float16 halves that). Refuses next-token-aware and
    intermediate-layer heads (:func:`check_fasterdecoding`) before writing anything."""
    from safetensors.torch import save_file

    from medusa_trt.runtime.tree import CompiledTree, compile_tree

    check_fasterdecoding(heads.config)
    folder = check_out_folder(folder)
    if tree is not None:
        tree = tree if isinstance(tree, CompiledTree) else compile_tree(tree)
        if tree.depth_max > heads.config.num_heads:
            raise InteropError(
                f"tree {tree.name!r} is {tree.depth_max} deep but there are only {heads.config.num_heads} heads: "
                "pick a tree at most that deep"
            )
    state = fasterdecoding_state(heads, dtype)
    config = fasterdecoding_config(heads, base_model)
    with durable.staged_folder(folder) as tmp:
        save_file(state, str(tmp / FD_WEIGHTS), metadata={"format": "pt"})
        (tmp / FD_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
        if tree is not None:
            (tmp / MEDUSA_CHOICES).write_text(medusa_choices_json(tree) + "\n")
        write_folder_manifest(tmp, "fasterdecoding")
        check_out_folder(folder)  # once more: a file may have been added meanwhile
    log.info("wrote FasterDecoding heads %s: %d heads, %d layers", folder, heads.config.num_heads, heads.config.num_layers)
    return folder


def _saved_config(path: Path) -> dict | None:
    """Our heads.json beside ``path`` (a heads folder or a file in one), or None for other folders."""
    from medusa_trt.exporter import heads as heads_mod

    folder = path.parent if path.is_file() else path
    config = folder / heads_mod.HEADS_CONFIG
    return heads_mod._read_json(config) if config.is_file() else None


def convert_heads(
    heads_path: str | os.PathLike,
    out: str | os.PathLike,
    *,
    to: str = "fasterdecoding",
    model: str | None = None,
    tree=None,
    base_model: str | None = None,
    dtype: torch.dtype | None = None,
) -> Path:
    """Read heads (any format :func:`load_heads` reads) and write them as ``to`` in folder ``out``.

    ``model`` (what ``load_base_model`` takes) checks the heads against the base model, and is
    needed for heads that share its lm_head (its weight is written into each head); a Hub id
    passed there also names the base model in config.json unless ``base_model`` is given.
    ``tree``: a tree spec (``load_tree``) written as medusa_choices.json. Nothing is written
    unless everything checks out."""
    from medusa_trt.exporter.heads import HeadsConfig, HeadsFormatError, load_heads
    from medusa_trt.exporter.models import is_hub_id, load_base_model
    from medusa_trt.runtime.tree import load_tree

    if to not in FORMATS:
        raise InteropError(f"unknown format {to!r}: choose one of {', '.join(FORMATS)}")
    heads_path = Path(heads_path)
    if not heads_path.exists():
        raise HeadsFormatError(f"heads path {heads_path} does not exist")
    check_out_folder(out)
    compiled = load_tree(tree) if tree is not None else None  # a bad spec fails before any model loads
    raw = _saved_config(heads_path)
    if raw is not None:
        fields = {k: v for k, v in raw.items() if k in HeadsConfig.__dataclass_fields__}
        try:
            check_fasterdecoding(HeadsConfig(**fields))
        except TypeError:
            pass  # an incomplete heads.json: load_heads names what is wrong with it
    if model is not None:
        base = load_base_model(model)
        cfg = base.model.config
        heads = load_heads(
            heads_path,
            hidden_size=cfg.hidden_size,
            vocab_size=cfg.vocab_size,
            lm_head=base.model.get_output_embeddings(),
            num_decoder_layers=cfg.num_hidden_layers,
            embed=base.model.get_input_embeddings(),
        )
        if base_model is None and is_hub_id(model):
            base_model = model
    else:
        if raw is None:
            raise InteropError(f"{heads_path} holds no heads.json to read the heads' sizes from: pass the base model (--model)")
        if raw.get("shared_lm_head"):
            raise InteropError(
                "these heads share the base model's lm_head, which the FasterDecoding format writes into every "
                "head: pass the base model they were trained on (--model)"
            )
        heads = load_heads(heads_path, hidden_size=raw.get("hidden_size"), vocab_size=raw.get("vocab_size"), lm_head=None)
    return save_fasterdecoding(heads, out, base_model=base_model, tree=compiled, dtype=dtype)
