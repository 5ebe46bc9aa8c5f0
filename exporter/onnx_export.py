"""Export a ``MedusaModel`` to ONNX: the step graph, the heads graph, metadata and tokenizer.

Files written for ``--out build/model.onnx`` (all first into a hidden staging folder beside it,
then swapped in as one set by ``runtime/durable.py``: earlier files of that set are set aside and
removed only once the new ones are in place, the step graph last; a failed export leaves nothing
behind, and what an export killed outright left is rolled back or removed by the next export to
the same name). An existing ``build/model.onnx`` or sibling is replaced only when the manifest
beside it lists it (an earlier export); a file this project did not write is refused by name:

  build/model.onnx            step graph (docs/architecture.md, the step contract), metadata under ``medusa_trt``
  build/model.onnx.data       its weights, when they are large
  build/model.heads.onnx      hidden [B, H] -> head_topk [B, n, K], head_logits [B, n, N] (N = --draft-vocab, else V)
  build/model.tokenizer/      tokenizer files (chat template included)
  build/model.onnx.files.json size and sha256 of each file above (``runtime/manifest.py``)

Then the graphs are checked: the ONNX checker, and ONNX Runtime against the torch model on a
prefill and a tree step, with the max abs difference printed and a stated tolerance enforced.

``attention="plugin"`` exports each layer's attention as one ``medusa_trt::TreeAttention`` node
(``plugins/tree_attention/spec.py``) for TensorRT's plugin, with the node's CPU fallback attached
as a model-local function (``plugins/tree_attention/onnx_fallback.py``), so ONNX Runtime runs and
verifies that graph too. ``attention="onnx"`` (the default) keeps standard ops only.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
import shutil
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from medusa_trt.exporter.cancel import checkpoint
from medusa_trt.exporter.errors import ExportError
from medusa_trt.exporter.options import GraphOptions
from medusa_trt.exporter.quantize import MODES as _QUANTIZE_MODES
from medusa_trt.exporter.quantize import QuantizeConfig, quantize_engine
from medusa_trt.exporter.tokenizer_files import check_engine_tokenizer, write_engine_tokenizer
from medusa_trt.exporter.wrapper import ATTENTION_FORMS, HeadsGraph, MedusaModel
from medusa_trt.runtime import durable, key_slots
from medusa_trt.runtime.backends import BACKENDS
from medusa_trt.runtime.config import DEFAULT_MAX_CONTEXT, DEFAULT_OPSET, default_tree
from medusa_trt.runtime.contract import (
    HEADS_INPUTS,
    HEADS_OUTPUTS,
    KEY_SLOTS_INPUT,
    MAX_SUCCESSORS,
    NEXT_INPUT,
    STEP_INPUTS,
    STEP_OUTPUTS,
    SUCCESSORS_OUTPUT,
)
from medusa_trt.runtime.drafting.sequential import expansion
from medusa_trt.runtime.engine import ENGINE_SUFFIXES, FORMAT_VERSION, META_KEY, EngineFiles, EngineMeta
from medusa_trt.runtime.engine_meta import precision_name
from medusa_trt.runtime.manifest import manifest_path, write_manifest
from medusa_trt.runtime.tree import CompiledTree, load_tree

log = logging.getLogger(__name__)

# None: fp32 throughout; the modes of exporter/quantize.py: "int8" (dynamic int8 step graph), "heads-int8"
# (the heads graph only: output identical to fp32), "int4" / "int8-block" (MatMulNBits, both graphs), "int8-channel"
# (int8 weights with one scale per output column, both graphs)
QUANTIZE_MODES = (None, *_QUANTIZE_MODES)
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}  # bf16: for TensorRT builds
# max abs logit difference of the graph vs torch in the same dtype (exporter/verify.py: ONNX Runtime for fp32 / fp16,
# ONNX's reference evaluator for bf16, which ONNX Runtime's CPU provider has no kernels for). bf16 keeps 8 significant
# bits (a step of 0.03 at logits 4-8): tiny random models differ by 0.1 there, a few such steps, and 0.2 at most
TOLERANCE = {"fp32": 1e-3, "fp16": 5e-2, "bf16": 2e-1}
EXTERNAL_DATA_BYTES = 256 * 2**20  # weights above this go to a .data file beside the graph
OPSETS = range(18, DEFAULT_OPSET + 1)  # torch's ONNX exporter starts at 18; the default is the newest checked with ONNX Runtime
MIN_CONTEXT = 2  # a prompt token and one generated one (the runtime's floor too)
STAGING_OWNER = durable.LEGACY_OWNER  # staging folders of earlier versions: "pid host" of the exporting process


@dataclass(frozen=True)
class ExportConfig(GraphOptions):
    """What ``export_onnx`` writes; the graph's shape and checks are ``GraphOptions``'s."""

    out: Path  # the step graph's path, ending in .onnx; any other path: an engine folder (runtime/engine_folder.py)
    tree: str | list | None = None  # the engine's default tree; None: a chain over the heads
    quantize: QuantizeConfig | str | None = None  # weight quantization (exporter/quantize.py); a mode name: QuantizeConfig(mode)
    step_cost: dict | None = None  # an engine folder's drafting budget (tokens per step -> relative cost); None: the runtime's default
    draft_vocab: int | None = None  # the heads project onto the first N token ids only (HeadsGraph); None: the whole vocabulary
    # the step graph takes key_slots (runtime/key_slots.py): a verify step equals a plain step bit for bit on ONNX
    # Runtime; None: yes for the standard attention (the plugin appends the new keys itself)
    key_slots: bool | None = None
    # an engine folder without step_cost: time the exported engine here (runtime/step_cost.py) and record its own curve
    measure_cost: bool = True
    # an engine folder's runtime (its config.json "backend"): what MedusaRuntime(DIR) runs and what the cost is timed on;
    # None: the export chooses, native where it runs the engine exactly and faster here, else onnxruntime (exporter/backend_choice.py)
    backend: str | None = None
    # the standard-form step graph rewritten by exporter/lean.py (shared rotary tables, fused weight matmuls): the same
    # outputs bit for bit, fewer ops; False keeps the graph as traced (the "before" of scripts/step_graph_report.py)
    lean: bool = True
    # the lm_head behind an If on a logits_wanted input (exporter/logits_gate.py), so prompt chunks whose
    # logits no one reads skip it; None: yes for the standard attention in fp32 / fp16 (a .plan's build passes False)
    gate_logits: bool | None = None

    def __post_init__(self):
        if not isinstance(self.successors, int) or not 0 <= self.successors <= MAX_SUCCESSORS:
            raise ExportError(f"--successors {self.successors} is out of range: pass 0 (no output) to {MAX_SUCCESSORS}")
        _check_out_suffix(Path(self.out))
        if Path(self.out).suffix == ".plan":
            raise ExportError(f"--out {self.out}: a .plan is built from the ONNX engine (tensorrt_build); export to .onnx or a folder")
        if self.backend is not None and self.backend not in BACKENDS:
            raise ExportError(f"--backend {self.backend} is not one of {', '.join(BACKENDS)} (or leave it out: the export chooses)")
        if self.attention not in ATTENTION_FORMS:
            raise ExportError(f"--attention {self.attention} is not one of {', '.join(ATTENTION_FORMS)}")
        if self.dtype not in DTYPES:
            raise ExportError(f"--dtype {self.dtype} is not one of {', '.join(DTYPES)}")
        if isinstance(self.quantize, str):
            object.__setattr__(self, "quantize", QuantizeConfig(self.quantize))  # an unknown mode fails here
        if self.key_slots is None:
            object.__setattr__(self, "key_slots", self.attention == "onnx")
        if self.gate_logits is None:  # bf16 graphs are for TensorRT plans, which build from the ungated graph
            object.__setattr__(self, "gate_logits", self.attention == "onnx" and self.dtype != "bf16")
        if self.key_slots and self.attention != "onnx":
            raise ExportError("key slots are a form of the standard attention: drop --attention plugin or --key-slots")
        if self.quantize and self.attention != "onnx":
            raise ExportError(f"--quantize {self.quantize.mode} quantizes the standard graph for ONNX Runtime: drop --attention plugin")
        if self.quantize and self.dtype != "fp32":
            raise ExportError(f"--quantize {self.quantize.mode} starts from fp32 weights: drop --dtype {self.dtype}")
        for name, least in (("max_batch", 1), ("max_context", MIN_CONTEXT), ("max_tokens", 1)):
            value = getattr(self, name)
            if value is not None and value < least:
                raise ExportError(f"--{name.replace('_', '-')} {value} is too small: it must be >= {least}")
        vocab = self.draft_vocab
        if vocab is not None and (isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < 1):
            raise ExportError(f"--draft-vocab {self.draft_vocab} must be a whole number >= 1 (leave it out for the whole vocabulary)")
        if self.opset not in OPSETS:
            raise ExportError(f"--opset {self.opset} is not supported: use {OPSETS.start}..{OPSETS.stop - 1} (default {DEFAULT_OPSET})")


# suffixes of files, never of an engine folder: --out model.txt is a mistake, not a folder to create
# (a folder may still have a dot in its name: SmolLM2-1.7B)
FILE_SUFFIXES = (".txt", ".json", ".bin", ".pt", ".pth", ".safetensors", ".gguf", ".engine", ".trt", ".data", ".zip", ".gz", ".tar")


def is_folder_out(out: str | os.PathLike) -> bool:
    """``--out DIR`` (no .onnx / .plan suffix) writes an engine folder."""
    return Path(out).suffix not in ENGINE_SUFFIXES


def _check_out_suffix(out: Path) -> None:
    if out.suffix.lower() in FILE_SUFFIXES:
        raise ExportError(f"--out {out} must end in .onnx or .plan, or name an engine folder (no file suffix such as {out.suffix})")


def check_output_path(out: Path) -> None:
    """Fail before any work if the engine cannot be written there (a real write probe: root
    passes permission checks that a read-only file system still refuses); an engine folder may
    replace only an earlier engine folder or an empty folder, never a user's files."""
    out = Path(out)
    parent = out.parent
    _check_out_suffix(out)
    if out.suffix == ".plan":
        raise ExportError(f"--out {out}: export the ONNX engine (.onnx or a folder) first; the .plan is built from it")
    if is_folder_out(out) and out.exists():
        if not out.is_dir():
            raise ExportError(
                f"--out {out} exists and is a file: an engine folder needs a new or empty folder, or pass a path ending in .onnx"
            )
        durable.check_folder_ours(out, kind="engine")  # an earlier engine folder, every file listed in its files.json
    elif not is_folder_out(out) and parent.is_dir():
        if out.is_dir():
            raise ExportError(f"--out {out} is a folder: pass a path ending in .onnx, or the folder's name without the suffix")
        final = EngineFiles.beside(out)
        durable.check_set_ours(parent, loose_names(final), manifest_path(final).name, main=out.name)
    if not parent.is_dir():
        raise ExportError(f"cannot write {out}: folder {parent} does not exist; create it first")
    try:
        with tempfile.TemporaryFile(dir=parent):
            pass
    except OSError as exc:
        raise ExportError(f"cannot write {out}: folder {parent} is not writable ({exc.strerror})") from exc


def loose_names(final: EngineFiles) -> list[str]:
    """The names of a loose engine's set beside its step graph, all of which an export (or build)
    writes or removes: X.onnx, X.onnx.data, X.heads.onnx, X.heads.onnx.data, X.tokenizer/,
    X.onnx.files.json (and a plan's sidecar X.plan.json)."""
    paths = [final.step, final.step.with_name(final.step.name + ".data"), final.heads, final.heads.with_name(final.heads.name + ".data")]
    paths += [final.tokenizer, manifest_path(final)] + ([final.sidecar] if final.is_plan else [])
    return [p.name for p in paths]


def _example_inputs(model: MedusaModel, batch: int, tokens: int, past: int, key_slots: bool = False) -> tuple[torch.Tensor, ...]:
    """Step inputs with a cache of ``past`` committed slots; with ``key_slots`` the view holds them
    and the new tokens' slots after them (past + tokens slots)."""
    spec, device = model.kv_spec, model.device
    gen = torch.Generator().manual_seed(0)
    kv_shape = (past + tokens if key_slots else past, spec.num_layers, batch, spec.num_kv_heads, spec.head_dim)
    positions = (past + torch.arange(tokens)).expand(batch, tokens).contiguous().to(device)
    inputs = (
        torch.randint(0, model.vocab_size, (batch, tokens), generator=gen).to(device),
        positions,
        torch.tril(torch.ones(tokens, tokens, dtype=torch.bool)).expand(batch, tokens, tokens).contiguous().to(device),
        torch.full((batch,), past, dtype=torch.int64).to(device),
        torch.randn(kv_shape, generator=gen).to(device, spec.dtype),
        torch.randn(kv_shape, generator=gen).to(device, spec.dtype),
    )
    return (*inputs, positions.clone()) if key_slots else inputs


class _WithSuccessors(torch.nn.Module):
    """The step graph plus ``next_topk`` (B, T, k): the base model's top-k after every node, which
    the recycle drafter learns from, so greedy decoding never needs the logits on the host."""

    def __init__(self, model: MedusaModel, k: int):
        super().__init__()
        self.model, self.k = model, k

    # the step contract's inputs (STEP_INPUTS, then KEY_SLOTS_INPUT)
    def forward(self, input_ids, position_ids, tree_mask, cache_lengths, past_key, past_value, key_slots=None):
        logits, hidden, next_ids, new_key, new_value = self.model(
            input_ids, position_ids, tree_mask, cache_lengths, past_key, past_value, key_slots
        )
        return logits, hidden, next_ids, new_key, new_value, logits.topk(self.k, dim=-1).indices


def _export_step(model: MedusaModel, config: ExportConfig, streamed=None):
    """``config.max_context`` is resolved (an int) here. ``streamed``: (checkpoint, LazyWeights) of a weightless model,
    whose weights ``streamed.stream_weights`` takes from the checkpoint before the graph is optimized."""
    batch = torch.export.Dim("batch", min=1, max=max(config.max_batch, 2))
    tokens = torch.export.Dim("tokens", min=1, max=max(config.max_tokens, 3))
    past = torch.export.Dim("past", min=0, max=config.max_context + key_slots.slack(config.max_tokens))
    dynamic = (
        {0: batch, 1: tokens},
        {0: batch, 1: tokens},
        {0: batch, 1: tokens, 2: tokens},
        {0: batch},
        {0: past, 2: batch},
        {0: past, 2: batch},
    )
    names_in = list(STEP_INPUTS)
    if config.key_slots:
        dynamic, names_in = (*dynamic, {0: batch, 1: tokens}), [*names_in, KEY_SLOTS_INPUT]
    table = None
    if config.attention == "plugin":
        from medusa_trt.plugins.tree_attention.torch_op import onnx_translation_table

        table = onnx_translation_table()
    traced = model.in_form(config.attention)  # the caller's model keeps its own form
    k = min(config.successors, model.vocab_size)
    graph, names = (_WithSuccessors(traced, k), [*STEP_OUTPUTS, SUCCESSORS_OUTPUT]) if k else (traced, list(STEP_OUTPUTS))
    program = torch.onnx.export(
        graph,
        _example_inputs(model, 2, 3, min(5, config.max_context), config.key_slots),
        dynamo=True,
        dynamic_shapes=dynamic,
        opset_version=config.opset,
        input_names=names_in,
        output_names=names,
        verbose=False,
        custom_translation_table=table,
        optimize=False,  # _optimized: exact no-op rules
    )
    return _optimized(_streamed(program, model, streamed))


def _streamed(program, model: MedusaModel, streamed):
    """``program`` with its weights taken from the checkpoint (``exporter/streamed.py``) where ``streamed`` is given."""
    if streamed is not None:
        from medusa_trt.exporter.streamed import stream_weights

        stream_weights(program.model, model, *streamed)
    return program


def _export_heads(model: MedusaModel, tree: CompiledTree, config: ExportConfig, streamed=None):
    plan = expansion(tree.paths) if model.heads.config.reads_path else None  # sequential heads expand the template in the graph
    graph = HeadsGraph(model.heads, tree.top_k, config.draft_vocab, plan).eval()
    hidden = torch.randn(2, model.base.config.hidden_size, dtype=model.kv_spec.dtype, device=model.device)
    batch = torch.export.Dim("batch", min=1, max=max(config.max_batch, 2))
    inputs, names, dynamic = (hidden,), list(HEADS_INPUTS), ({0: batch},)
    if model.heads.config.reads_next:  # next-token-aware heads: the next tree's root as a second input
        inputs, names, dynamic = (hidden, torch.tensor([1, 2], device=model.device)), [*HEADS_INPUTS, NEXT_INPUT], ({0: batch}, {0: batch})
    program = torch.onnx.export(
        graph,
        inputs,
        dynamo=True,
        dynamic_shapes=dynamic,
        opset_version=config.opset,
        input_names=names,
        output_names=list(HEADS_OUTPUTS),
        verbose=False,
        optimize=False,
    )
    return _optimized(_streamed(program, model, streamed))


def _optimized(program):
    """``program`` with its graph optimized as ``torch.onnx.export`` would, no-ops removed only where exact
    (``exporter/onnx_optimize.py``: torch's optimizer takes ``x + 1e-8`` for ``x + 0``)."""
    from medusa_trt.exporter.onnx_optimize import optimize

    optimize(program.model)
    return program


def engine_meta(model: MedusaModel, tree: CompiledTree, config: ExportConfig) -> EngineMeta:
    spec, cfg = model.kv_spec, model.base.config
    name = model.name if not Path(model.name).exists() else str(Path(model.name).resolve())
    return EngineMeta(
        format_version=FORMAT_VERSION,
        model=name,
        architecture=cfg.model_type,
        dtype=config.dtype,
        vocab_size=model.vocab_size,
        hidden_size=cfg.hidden_size,
        num_layers=spec.num_layers,
        num_kv_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        num_heads=model.num_heads,
        top_k=tree.top_k,
        tree=[list(p) for p in tree.paths],
        tree_name=tree.name,
        max_batch=config.max_batch,
        max_context=config.max_context,
        max_tokens=config.max_tokens,
        eos_token_ids=list(model.eos_token_ids),
        is_chat=bool(model.is_chat),
        quantization=config.quantize.mode if config.quantize else "none",
        attention=config.attention,
        successors=min(config.successors, model.vocab_size),
        head_input=model.head_input,
        draft_vocab=config.draft_vocab,
        key_slots=bool(config.key_slots),
    )


def _save(program, path: Path, meta: EngineMeta) -> None:
    program.model.metadata_props[META_KEY] = meta.to_json()
    size = sum(v.const_value.nbytes for v in program.model.graph.initializers.values() if v.const_value is not None)
    program.save(str(path), external_data=size > EXTERNAL_DATA_BYTES)


def _save_streamed(program, path: Path, meta: EngineMeta, config: ExportConfig, *, step: bool) -> None:
    """A streamed graph (lazy weights, ``exporter/lazy_weights.py``) through the passes a saved graph takes (lean,
    the quantizer, the logits gate for the step graph), in memory, then written one weight at a time."""
    import onnx_ir as ir

    from medusa_trt.exporter import lazy_weights
    from medusa_trt.exporter.quantize import quantize_graph

    program.model.metadata_props[META_KEY] = meta.to_json()
    proto = ir.serde.serialize_model(program.model)
    if step and config.lean and config.attention == "onnx":
        from medusa_trt.exporter.lean import lean_graph

        log.info(lean_graph(proto).describe())
    if config.quantize:  # one weight at a time (streamed.check_streamable refused what cannot be)
        proto = quantize_graph(proto, config.quantize, step=step)
    if step and config.gate_logits:
        from medusa_trt.exporter.logits_gate import gate_logits

        gate_logits(proto)
    lazy_weights.save(proto, path)


@dataclass(frozen=True)
class ExportResult:
    files: EngineFiles
    diffs: dict[str, float]  # max abs difference ONNX Runtime vs torch per checked output (empty: not verified)
    tolerance: float
    loose: tuple[str, ...] = ()  # outputs in diffs reported but not held to the tolerance (int8 head logits)
    model: str = ""  # what was exported: the architecture and its attention (AttentionPlan.describe)
    backend_choice: object | None = None  # backend_choice.BackendChoice of a folder whose backend the export chose (None: told, a file)
    # the diffs were held to the tolerance (False: a lossy quantization, whose error is reported, never called verified)
    strict: bool = True
    top1: float | None = None  # how often the step graph's top-1 token is torch's (fp32) at the checked positions
    backend: str | None = None  # what MedusaRuntime(out) runs: a folder's recorded backend (None: a file, the runtime decides)
    precision: str = "fp32"  # the engine's quantization, else its dtype: "int8-channel", "int4", "fp32", "bf16"


def export_onnx(model: MedusaModel, config: ExportConfig, weights_from=None) -> ExportResult:
    """Export, check and put the engine files in place. ``weights_from``: a ``streamed.Checkpoint`` that the model
    (loaded weightless) takes its weights from, one tensor at a time (``exporter/streamed.py``)."""
    out = Path(config.out)
    check_output_path(out)
    config = _fit_to_model(model, config)
    model.check_form(config.attention)  # a feature the chosen attention form lacks is refused, never dropped
    if model.num_heads == 0 and config.tree not in (None, "chain-0"):
        raise ExportError("the model has no Medusa heads, so only the tree chain-0 fits: pass --heads or drop --tree")
    tree = load_tree(config.tree if config.tree is not None else default_tree(model.num_heads), max_depth=model.num_heads)
    if tree.num_nodes > config.max_tokens:
        raise ExportError(f"tree {tree.name} has {tree.num_nodes} nodes but --max-tokens is {config.max_tokens}: raise it")
    config = _fit_draft_vocab(model, tree, config)
    meta = engine_meta(model, tree, config)
    if config.backend == "native":  # a model type native never runs: refused before the export's work
        from medusa_trt.runtime.native_weights import check_architecture

        check_architecture(out, meta.architecture)
    folder = is_folder_out(out)
    final = EngineFiles.in_folder(out) if folder else EngineFiles.beside(out)
    if not folder:
        log.info("--out %s also writes beside it: %s", out, ", ".join(n for n in loose_names(final) if n != out.name))
    _import_exporters()
    tmp = make_staging(out)
    staged = EngineFiles.in_folder(tmp) if folder else EngineFiles.beside(tmp / out.name)
    stages = ["step graph", "heads graph", "tokenizer", "int8", "verify"]
    diffs: dict[str, float] = {}
    top1 = None
    strict = not config.quantize or config.quantize.lossless
    choice = None  # the backend the export chose for a folder (backend_choice.BackendChoice)
    loose = config.quantize.loose if config.quantize else ()  # heads-int8 drafts: reported, not held to the tolerance
    streamed = None
    if weights_from is not None:
        from medusa_trt.exporter.lazy_weights import LazyWeights
        from medusa_trt.exporter.streamed import check_streamable

        check_streamable(config.quantize.mode if config.quantize else None, config.dtype)
        streamed = (weights_from, LazyWeights())
    try:
        if model.kv_spec.dtype != DTYPES[config.dtype]:  # never convert the caller's model in place (nn.Module.to is)
            log.info("exporting a %s copy of the model, which stays %s", config.dtype, model.kv_spec.dtype)
            model = copy.deepcopy(model).to(DTYPES[config.dtype])
        model = model.eval()
        # the exporter logs every op library it skips (torchvision's, say) as a warning
        logging.getLogger("torch.onnx._internal.exporter._registration").setLevel(logging.ERROR)
        with tqdm(total=len(stages), desc="medusa-export", unit="stage", disable=None) as bar, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            bar.set_postfix_str("tracing the step graph")
            if streamed is not None:
                with streamed[1]:
                    _export_streamed(model, tree, config, meta, staged, streamed, bar)
            else:
                _export_graphs(model, tree, config, meta, staged, bar)
            bar.set_postfix_str("checking the tokenizer")
            write_engine_tokenizer(model.tokenizer, model.tokenizer_files, staged.tokenizer)  # a folder's tokenizer files lie at its top
            check_engine_tokenizer(model.tokenizer, model.tokenizer_files, staged.tokenizer, model.vocab_size, shown=final.tokenizer)
            bar.update()
            if config.quantize and streamed is None:
                bar.set_postfix_str(f"quantizing {config.quantize.mode}")
                quantize_engine(staged, meta, config.quantize)
            if config.gate_logits and streamed is None:  # after every rewrite of the graph: the gate moves their final nodes
                from medusa_trt.exporter.logits_gate import gate_logits_file

                gate_logits_file(staged.step)
            bar.update()
            if config.verify and streamed is not None:
                log.info(
                    "not checked against torch: a streamed export never holds the model's weights "
                    "(the engine's own exactness probe still runs)"
                )
            elif config.verify:
                bar.set_postfix_str("verifying")
                from medusa_trt.exporter.verify import verify_engine

                checked = verify_engine(
                    model,
                    staged,
                    tree,
                    strict=strict,
                    loose=loose,
                    tolerance=TOLERANCE[config.dtype],
                    max_tokens=config.max_tokens,
                    draft_vocab=config.draft_vocab,
                )
                diffs, top1 = checked.diffs, checked.top1
            bar.update()
        if folder:
            choice = _write_folder(model, staged, meta, tree, config, out)
        write_manifest(staged)
        checkpoint()  # an interrupt whose exception was swallowed: commit nothing
        if folder:
            from medusa_trt.exporter.engine_folder import swap_folder

            swap_folder(tmp, out)
        else:
            _move_into_place(staged, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("wrote %s", final.step)
    precision = precision_name(config.dtype, config.quantize.mode if config.quantize else "none")
    backend = None if not folder else (choice.backend if choice is not None else config.backend)
    return ExportResult(final, diffs, TOLERANCE[config.dtype], loose, model.describe(), choice, strict, top1, backend, precision)


def _export_graphs(model: MedusaModel, tree: CompiledTree, config: ExportConfig, meta: EngineMeta, staged: EngineFiles, bar) -> None:
    """The step graph (lean where the attention is standard) and the heads graph, saved into ``staged``."""
    step = _export_step(model, config)
    if config.attention == "plugin":
        from medusa_trt.plugins.tree_attention.onnx_fallback import attach_fallback

        attach_fallback(step.model)  # ONNX Runtime inlines it; the TensorRT build strips it
    _save(step, staged.step, meta)
    if config.lean and config.attention == "onnx":
        from medusa_trt.exporter.lean import lean_step_file

        # --quantize int8 scales each weight tensor as a whole: fused, one scale would span Q, K and V
        lean_step_file(staged.step, fuse=not (config.quantize and config.quantize.mode == "int8"))
    bar.update()
    if model.num_heads:
        bar.set_postfix_str("tracing the heads graph")
        _save(_export_heads(model, tree, config), staged.heads, meta)
    bar.update()


def _export_streamed(
    model: MedusaModel, tree: CompiledTree, config: ExportConfig, meta: EngineMeta, staged: EngineFiles, streamed, bar
) -> None:
    """``_export_graphs`` for a weightless model: each graph's weights from the checkpoint, through the passes in
    memory and written one at a time (``_save_streamed``), quantized and gated already."""
    _save_streamed(_export_step(model, config, streamed), staged.step, meta, config, step=True)
    bar.update()
    if model.num_heads:
        bar.set_postfix_str("tracing the heads graph")
        _save_streamed(_export_heads(model, tree, config, streamed), staged.heads, meta, config, step=False)
    bar.update()


def _write_folder(model: MedusaModel, staged: EngineFiles, meta: EngineMeta, tree: CompiledTree, config: ExportConfig, out: Path):
    """config.json, generation_config.json and drafting.json of the staged folder: the backend chosen where the config
    names none (``backend_choice``), the step cost and exactness measured on that backend unless the config gives the
    cost. Returns the ``BackendChoice`` (None where the config named the backend). A folder told ``native`` whose graph
    native cannot run is refused, naming ``out`` (nothing is written there)."""
    from medusa_trt.exporter.backend_choice import FALLBACK, NATIVE, choose_backend
    from medusa_trt.exporter.engine_folder import write_folder_files
    from medusa_trt.runtime.backends import ONNX_BACKENDS, open_onnx_backend
    from medusa_trt.runtime.config import RuntimeConfig

    if config.backend == NATIVE:
        from medusa_trt.runtime.native_weights import NativeCannotRun, read_weights

        try:
            read_weights(staged.step, meta.architecture)
        except NativeCannotRun as exc:
            raise NativeCannotRun(f"backend native cannot run {out}: {exc.what}; use --backend onnxruntime for it", exc.what) from None
    write_folder_files(model, staged, meta, step_cost=config.step_cost, backend=config.backend or FALLBACK)  # what backends open
    choice, backend = None, None
    if config.backend is None:
        log.info("choosing the engine folder's backend: native where it runs this engine exactly and faster, else onnxruntime")
        choice, backend = choose_backend(staged.folder, tree.num_nodes)  # backend: the chosen one, where it was opened
        log.info("%s", choice.summary())
    name = choice.backend if choice else config.backend
    cost, exactness = None, choice.exactness if choice and name == NATIVE else None  # native's probe: the folder's own
    if config.step_cost is None and config.measure_cost and config.dtype in ("fp32", "fp16"):
        asked = name if name in ONNX_BACKENDS else None  # tensorrt: its graphs timed on onnxruntime
        backend = backend or open_onnx_backend(staged.folder, RuntimeConfig(max_batch=1, backend=asked))
        cost, exactness = _measure_cost(backend, exactness)
    if choice or cost:
        write_folder_files(
            model,
            staged,
            meta,
            step_cost=cost.table if cost else config.step_cost,
            heads_cost=cost.heads if cost else None,
            exactness=exactness,
            backend=name,
            choice=choice,
        )
    return choice


def _measure_cost(backend, exactness=None):
    """The staged engine's own step-cost curve on this machine (``backend`` at batch 1, the one its config.json names),
    and whether its verify steps give each token its plain-step logits bit for bit (``runtime/exactness.py``; probed
    unless ``exactness`` already holds it)."""
    from medusa_trt.runtime.exactness import probe
    from medusa_trt.runtime.step_cost import measure

    log.info("timing the engine's verify steps for the drafting budget (drafting.json step_cost)")
    cost = measure(backend, top_k=backend.meta.top_k)
    exactness = exactness or probe(backend)
    if exactness.exact:
        log.info("verify steps equal plain steps bit for bit (%d tokens probed): drafted output is plain output", exactness.tokens)
    else:
        log.warning(
            "this engine's verify steps do not give a token its plain-step logits (max difference %.3g): drafted output "
            "can differ from this engine's plain output. Its kernels depend on the step's width; export it with the "
            "defaults (--quantize int8-channel, or int4 / int8-block at --block-size 32) for an exact engine",
            exactness.max_diff,
        )
    return cost, exactness


def _fit_to_model(model: MedusaModel, config: ExportConfig) -> ExportConfig:
    """The config with ``max_context`` resolved against the model's positions; a head layer checked."""
    positions = model.max_positions
    if config.max_context is None:
        config = dataclasses.replace(config, max_context=min(DEFAULT_MAX_CONTEXT, positions or DEFAULT_MAX_CONTEXT))
    elif positions and config.max_context > positions:
        raise ExportError(f"--max-context {config.max_context} exceeds the model's {positions} positions: pass at most {positions}")
    layers, layer = model.base.config.num_hidden_layers, model.head_layer
    if layer is not None and not 0 <= layer < layers:
        raise ExportError(f"--head-layer {layer} is not a decoder layer of the model: pass 0..{layers - 1}")
    return config


def _fit_draft_vocab(model: MedusaModel, tree: CompiledTree, config: ExportConfig) -> ExportConfig:
    """The config with ``draft_vocab`` checked against the tree's top-k and the vocabulary (None
    where it is the whole vocabulary or there are no heads)."""
    vocab = config.draft_vocab
    if vocab is not None and model.num_heads and not tree.top_k <= vocab <= model.vocab_size:
        raise ExportError(
            f"--draft-vocab {vocab} must lie between the tree's top-{tree.top_k} and the model's "
            f"vocabulary of {model.vocab_size} tokens: pass a value in that range, or leave it out for the whole vocabulary"
        )
    if vocab == model.vocab_size or not model.num_heads:
        config = dataclasses.replace(config, draft_vocab=None)  # the whole vocabulary, said the usual way
    return config


def _import_exporters() -> None:
    """Import what ``torch.onnx.export`` and the checks load lazily, before any file is staged. A
    Ctrl-C that lands inside a C extension's module init (protobuf's, under onnxscript) can crash
    the interpreter, which would leave the staging folder to the next export's sweep."""
    import onnx  # noqa: F401
    import onnxruntime  # noqa: F401
    import onnxscript  # noqa: F401
    from torch.onnx._internal.exporter import _compat  # noqa: F401  torch.onnx.export(dynamo=True) imports it on first use


def make_staging(out: Path) -> Path:
    """A fresh hidden folder beside ``out`` for the files of one export (or build), named after this
    process (``runtime/durable.py``); what killed exports to the same name left is handled first."""
    try:
        return durable.make_staging(out)
    except OSError as exc:
        raise ExportError(f"cannot write {out}: folder {out.parent} is not writable ({exc.strerror})") from exc


def sweep_stale_staging(out: Path) -> list[Path]:
    """Handle what exports to ``out`` killed before their cleanup ran (SIGKILL, a crash) left: only
    leftovers whose process no longer runs on this host (``durable.recover``). Returns them."""
    return durable.recover(out)


def _move_into_place(staged: EngineFiles, final: EngineFiles) -> None:
    """The staged set (step graph, heads graph, external data, tokenizer, manifest) replaces the
    earlier one of that name as a whole, the step graph last (``durable.replace_set``); members of
    the earlier set without a successor go with it. ``check_output_path`` proved them ours."""
    names = loose_names(final)
    names += sorted(p.name for p in staged.step.parent.iterdir() if p.name not in names)  # any other file it staged
    durable.check_set_ours(final.step.parent, names, manifest_path(final).name, main=final.step.name)
    durable.replace_set(staged.step.parent, final.step.parent, names, final.step.name)
