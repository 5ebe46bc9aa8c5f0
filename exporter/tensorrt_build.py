"""Build TensorRT engines (``.plan``) from the exported ONNX graphs.

``medusa-export ... --out build/engine.plan`` first exports ``build/engine.onnx`` (and its heads
graph and tokenizer, ``onnx_export``), then builds into a hidden staging folder, and swaps the
set in (``runtime/durable.py``: an earlier set is replaced only when its manifest lists it, and
removed only once the new one is in place), the step engine last:

  build/engine.heads.plan   heads engine (absent without heads)
  build/engine.plan.json    the runtime's metadata (``EngineMeta``): a plan carries none of its own
  build/engine.plan.files.json size and sha256 of the plans, the sidecar and the tokenizer files
                            (``runtime/manifest.py``; the ONNX export beside it keeps its own)
  build/engine.plan         step engine
  build/timing.cache        TensorRT's tactic timing cache, read and extended by every build there

How (polygraphy's loaders over the TensorRT API):

* Strongly typed networks: the precision comes from the graph, which is exported in the engine's
  dtype (fp32, fp16 or bf16). TensorRT 10.12 deprecated the builder's precision flags and 11
  removed them; int8 and fp8 come from Q/DQ nodes in the graph (explicit quantization, e.g.
  NVIDIA ModelOpt on the exported ONNX), checked against the GPU before the build.
* One optimization profile per engine. Step: batch 1..max_batch, new tokens 1..max_tokens (a tree
  or a prefill chunk), cache slots 0..max_context; the heads: batch 1..max_batch.
* A plugin-form graph (``--attention plugin``) is parsed from a copy without the CPU fallback
  function (``onnx_fallback.strip_fallback``; the parser would otherwise inline it) whose spec
  nodes carry ``plugin_namespace`` / ``plugin_version``, the attributes TensorRT's ONNX parser
  looks plugins up by (it ignores the node's domain; the version is the one ``tensorrt.plugin`` gives
  every creator, ``aot.TRT_PLUGIN_VERSION``). Importing
  ``medusa_trt.plugins.tree_attention.trt_plugin`` registers the plugin first.
* Standard-form ``Attention`` nodes carry ``TRT_decomposable = 1``: without it (the parser's default
  0) TensorRT must find one fused kernel, and none is certain for fp32 or small head sizes.
* The TensorRT release the graph needs is read from its ops (``tensorrt_ops.required_tensorrt``: the
  parser imports ``Attention`` from 10.14, ``RMSNormalization`` / ``RotaryEmbedding`` from 10.15, AOT
  plugins from 10.9); an older TensorRT is refused in one line before anything is built, and the plans'
  metadata records it (``EngineMeta.min_tensorrt``), which the TensorRT backend checks when it loads them.

After each build, before anything is moved into place, the plan is compared with its ONNX graph on
the same inputs (``trt_compare``: polygraphy's Comparator, ONNX Runtime runner against TensorRT
runner, a tolerance per output); a plan beyond it raises ``PlanMismatchError``. ``verify=False``
(``medusa-export --no-verify``) skips it.

Without TensorRT, polygraphy or a CUDA GPU the build stops with ``TensorRTUnavailableError``, after
the ONNX files are written and before any ``.plan`` is.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from medusa_trt.exporter.cancel import checkpoint
from medusa_trt.exporter.errors import ExportError, TensorRTBuildError
from medusa_trt.exporter.onnx_export import make_staging
from medusa_trt.exporter.tensorrt_ops import OP_MIN_TENSORRT, Requirement, required_tensorrt
from medusa_trt.plugins.tree_attention.aot import TRT_PLUGIN_VERSION
from medusa_trt.plugins.tree_attention.spec import TREE_ATTENTION
from medusa_trt.runtime import durable
from medusa_trt.runtime.contract import HEADS_INPUTS, INPUT_IDS, LOGITS_WANTED_INPUT, NEXT_INPUT, step_shapes
from medusa_trt.runtime.engine import META_KEY, TENSORRT_BASELINE, EngineFiles, EngineMeta, tensorrt_release
from medusa_trt.runtime.manifest import engine_file_list, manifest_path, write_manifest

log = logging.getLogger(__name__)

ENGINE_DTYPES = ("fp32", "fp16", "bf16")  # the graph's dtype, which a strongly typed network keeps
# Oldest GPU (compute capability) each precision builds for; TensorRT 10 itself needs Turing (7.5).
MIN_CAPABILITY = {"fp32": (7, 5), "fp16": (7, 5), "int8": (7, 5), "bf16": (8, 0), "fp8": (8, 9)}
INSTALL_HINT = "install TensorRT 10+ and polygraphy (pip install tensorrt polygraphy) on a machine with an NVIDIA GPU and CUDA"
PLUGIN_MODULE = "medusa_trt.plugins.tree_attention.trt_plugin"
TIMING_CACHE = "timing.cache"


class TensorRTUnavailableError(ExportError):
    """TensorRT, polygraphy or a CUDA GPU is missing; the message says what to install."""


@dataclass(frozen=True)
class ShapeRange:
    """One input's shapes in an optimization profile."""

    min: tuple[int, ...]
    opt: tuple[int, ...]  # the shape TensorRT tunes its tactics for
    max: tuple[int, ...]


@dataclass(frozen=True)
class TensorRTConfig:
    plan: Path  # the step engine's path, ending in .plan
    timing_cache: Path | None = None  # None: timing.cache beside the plan
    workspace_gib: float | None = None  # builder scratch memory limit; None: TensorRT's default (the GPU's memory)
    optimization_level: int = 3  # 0..5: builder time against engine speed; 3 is TensorRT's default
    verify: bool = True  # compare each built plan with its ONNX graph (trt_compare); medusa-export --no-verify: False
    report: Callable | None = field(default=None, compare=False)  # called with each plan's PlanComparison (the CLI prints it)

    def __post_init__(self):
        if Path(self.plan).suffix != ".plan":
            raise ExportError(f"--out {self.plan} must end in .plan for a TensorRT engine")
        if not 0 <= self.optimization_level <= 5:
            raise ExportError(f"optimization level {self.optimization_level} is not in 0..5")

    @property
    def cache_path(self) -> Path:
        return Path(self.timing_cache) if self.timing_cache is not None else Path(self.plan).parent / TIMING_CACHE


def onnx_beside(plan: str | os.PathLike) -> Path:
    """Where ``medusa-export --out engine.plan`` writes the ONNX graph it builds from: engine.onnx."""
    return Path(plan).with_suffix(".onnx")


# ----------------------------------------------------------------------------- pure shape logic


def step_profile(meta: EngineMeta) -> dict[str, ShapeRange]:
    """The step engine's one optimization profile, from the export's limits.

    Tuned (opt) for a verify step of the default tree over all sequences; a plugin-form engine
    is always bound the whole cache (the plugin reads only committed slots), a standard one the
    slots in use, so its opt context is half the maximum."""
    batch, tokens, slots = meta.max_batch, meta.max_tokens, meta.max_context
    tree_nodes = min(len(meta.tree) + 1, tokens)  # root + one node per path
    opt_slots = slots if meta.attention == "plugin" else max(slots // 2, 1)
    kv = (meta.num_layers, meta.num_kv_heads, meta.head_dim)
    low, opt, high = step_shapes(1, 1, 0, kv), step_shapes(batch, tree_nodes, opt_slots, kv), step_shapes(batch, tokens, slots, kv)
    return {name: ShapeRange(low[name], opt[name], high[name]) for name in high}


def heads_profile(meta: EngineMeta) -> dict[str, ShapeRange]:
    """The heads engine's profile: one hidden state per sequence (and its next token, for heads that read it)."""
    profile = {HEADS_INPUTS[0]: ShapeRange((1, meta.hidden_size), (meta.max_batch, meta.hidden_size), (meta.max_batch, meta.hidden_size))}
    if meta.reads_roots:
        profile[NEXT_INPUT] = ShapeRange((1,), (meta.max_batch,), (meta.max_batch,))
    return profile


def check_precision(precision: str, capability: tuple[int, int], tensorrt_version: str) -> None:
    """Raise ``TensorRTBuildError`` if this GPU / TensorRT cannot build ``precision``."""
    if tensorrt_release(tensorrt_version) < TENSORRT_BASELINE:  # the graph's ops may need more: check_tensorrt_version
        need = ".".join(map(str, TENSORRT_BASELINE))
        raise TensorRTUnavailableError(f"TensorRT {tensorrt_version} is too old (need {need}+): {INSTALL_HINT}")
    need = MIN_CAPABILITY[precision]
    if tuple(capability) < need:
        fix = {"bf16": "export with --dtype fp16", "fp8": "quantize the graph to int8 instead, or build on an Ada / Hopper GPU"}
        raise TensorRTBuildError(
            f"{precision} needs a GPU of compute capability {need[0]}.{need[1]} or newer, this one is {capability[0]}.{capability[1]}: "
            + fix.get(precision, "TensorRT 10 builds for Turing (7.5) and newer GPUs only")
        )


def graph_precisions(proto, dtype: str) -> list[str]:
    """The engine dtype plus int8 / fp8 where the graph carries Q/DQ nodes of those types."""
    from onnx import TensorProto

    found = [dtype]
    inits = {t.name: t.data_type for t in proto.graph.initializer}
    for node in proto.graph.node:
        if node.op_type != "QuantizeLinear":
            continue
        zero_type = inits.get(node.input[2]) if len(node.input) > 2 else None
        attr = next((a.i for a in node.attribute if a.name == "output_dtype"), None)
        kind = attr or zero_type or TensorProto.UINT8
        name = "fp8" if kind in (TensorProto.FLOAT8E4M3FN, TensorProto.FLOAT8E5M2) else "int8"
        if name not in found:
            found.append(name)
    return found


def prepare_for_tensorrt(proto) -> int:
    """In place: drop the CPU fallback, tag each spec node for the parser's plugin lookup, let
    TensorRT decompose standard ``Attention`` nodes where it has no fused kernel. Returns the number
    of plugin nodes."""
    from onnx import helper

    from medusa_trt.plugins.tree_attention.onnx_fallback import count_nodes, strip_fallback

    strip_fallback(proto)
    spec = TREE_ATTENTION
    for node in proto.graph.node:
        if (node.domain, node.op_type) == (spec.domain, spec.op_type):
            names = {a.name for a in node.attribute}
            if "plugin_namespace" not in names:
                node.attribute.append(helper.make_attribute("plugin_namespace", spec.domain))
            if "plugin_version" not in names:
                node.attribute.append(helper.make_attribute("plugin_version", TRT_PLUGIN_VERSION))
        elif node.op_type == "Attention" and node.domain in ("", "ai.onnx"):
            if "TRT_decomposable" not in {a.name for a in node.attribute}:
                node.attribute.append(helper.make_attribute("TRT_decomposable", 1))
    return count_nodes(proto)


def check_tensorrt_version(tensorrt_version: str, *protos) -> Requirement:
    """Refuse (``TensorRTUnavailableError``, one line) a TensorRT older than the prepared graphs' ops need;
    returns what they need (recorded as ``EngineMeta.min_tensorrt``)."""
    need = required_tensorrt(*protos)
    if tensorrt_release(tensorrt_version) < need.version:
        raise TensorRTUnavailableError(
            f"TensorRT {tensorrt_version} cannot parse this graph: it needs TensorRT {need.describe()}; "
            "install a newer TensorRT (pip install --upgrade tensorrt)"
        )
    return need


# ----------------------------------------------------------------------------- TensorRT

NATIVE_OPS_OPSET = 23  # from this opset the exporter writes these nodes (the plugin form all but Attention)
NATIVE_OPS = ("Attention", "RMSNormalization", "RotaryEmbedding")


def preflight(attention: str, opset: int) -> None:
    """Before any export: an installed TensorRT that cannot build this form is one line, with nothing written.

    Without TensorRT nothing is checked here: the export writes the ONNX graph a GPU machine builds the plan
    from (``require_tensorrt`` says so after it). The floor taken here is the newest release any graph of this
    form and opset may need (``tensorrt_ops``: 10.15 from opset 23, 10.9 for the plugin's AOT node); the exact
    graph is checked again before the build (``check_tensorrt_version``)."""
    try:
        import tensorrt as trt
    except (ImportError, OSError):
        return
    native = max(OP_MIN_TENSORRT["", op] for op in NATIVE_OPS) if opset >= NATIVE_OPS_OPSET else TENSORRT_BASELINE
    aot = OP_MIN_TENSORRT[TREE_ATTENTION.domain, TREE_ATTENTION.op_type] if attention == "plugin" else TENSORRT_BASELINE
    floor = max(native, aot)
    version = str(getattr(trt, "__version__", "0"))
    release = tensorrt_release(version)
    if release < floor:
        older = f" or export with --opset {NATIVE_OPS_OPSET - 1}" if opset >= NATIVE_OPS_OPSET and release >= (10, 9) else ""
        raise TensorRTUnavailableError(
            f"TensorRT {version} is older than the {'.'.join(map(str, floor))} this export's graph needs (opset {opset}, "
            f"--attention {attention}): install a newer TensorRT (pip install --upgrade tensorrt){older}"
        )
    if attention == "plugin":
        _register_plugin()  # no AOT support in this tensorrt.plugin: one line, before the export


def require_tensorrt(onnx_path: Path | None = None):
    """Import TensorRT and polygraphy and check for a CUDA GPU; returns the tensorrt module."""
    written = f"the ONNX graph is written to {onnx_path}; " if onnx_path is not None else ""
    try:
        import tensorrt as trt
    except (ImportError, OSError) as exc:  # the PyPI stub raises either when the libraries are missing
        raise TensorRTUnavailableError(f"TensorRT is not installed ({_reason(exc)}): {written}to build a .plan {INSTALL_HINT}") from exc
    try:
        importlib.import_module("polygraphy.backend.trt")
    except ImportError as exc:
        raise TensorRTUnavailableError(f"polygraphy is not installed ({_reason(exc)}): {written}to build a .plan {INSTALL_HINT}") from exc
    import torch

    if not torch.cuda.is_available():
        raise TensorRTUnavailableError(f"no CUDA GPU is visible to torch: {written}to build a .plan {INSTALL_HINT}")
    return trt


def _reason(exc: BaseException, limit: int = 160) -> str:
    return " ".join(str(exc).split())[:limit] or type(exc).__name__


def _register_plugin() -> None:
    """Import the plugin module (registering the plugin); each way it can fail is one line."""
    from medusa_trt.plugins.tree_attention import errors

    try:
        importlib.import_module(PLUGIN_MODULE)
    except ModuleNotFoundError as exc:
        if exc.name != PLUGIN_MODULE:
            raise TensorRTUnavailableError(
                f"the TensorRT plugin cannot be imported ({_reason(exc)}): export with --attention onnx"
            ) from exc
        raise TensorRTBuildError(
            f"the plugin-form graph needs the TensorRT plugin ({PLUGIN_MODULE}), which this install lacks: export with --attention onnx"
        ) from exc
    except errors.TensorRTUnavailableError as exc:  # no TensorRT, one older than AOT plugins, no AOT support
        raise TensorRTUnavailableError(_reason(exc, 400)) from exc
    except (ValueError, AttributeError, TypeError) as exc:  # tensorrt.plugin's validators, an API it lacks
        raise TensorRTBuildError(
            f"tensorrt.plugin refused the {TREE_ATTENTION.qualified_name} plugin ({_reason(exc, 300)}): "
            "this TensorRT's plugin API differs from the one it was written for; export with --attention onnx"
        ) from exc


def _plugin_errors() -> list[str]:
    """What the plugin's build-time calls raised (TensorRT only logs a plugin's exception)."""
    import sys

    module = sys.modules.get(PLUGIN_MODULE)
    return list(getattr(module, "BUILD_ERRORS", []))


def _build_one(trt, onnx_path: Path, target: Path, profile: dict[str, ShapeRange], config: TensorRTConfig, precisions: list[str]) -> None:
    """Parse ``onnx_path`` (fallback stripped, in a sibling copy so external weights still resolve)
    and write the serialized engine to ``target``."""
    import onnx
    import torch
    from polygraphy.backend.trt import CreateConfig, Profile, engine_bytes_from_network, network_from_onnx_path

    capability = torch.cuda.get_device_capability()
    for precision in precisions:
        check_precision(precision, capability, trt.__version__)
    proto = onnx.load(str(onnx_path), load_external_data=False)  # weights stay in the .data file beside it
    plugins = prepare_for_tensorrt(proto)
    if plugins:
        _register_plugin()
    parse_path = onnx_path.with_name(f".{onnx_path.stem}.tensorrt.onnx")  # beside the original: same external data
    onnx.save(proto, str(parse_path))
    try:
        trt_profile = Profile()
        for name, shapes in profile.items():
            trt_profile.add(name, min=shapes.min, opt=shapes.opt, max=shapes.max)
        pools = {trt.MemoryPoolType.WORKSPACE: int(config.workspace_gib * 2**30)} if config.workspace_gib else None
        cache = config.cache_path
        build_config = CreateConfig(
            profiles=[trt_profile],
            load_timing_cache=str(cache) if cache.is_file() else None,
            memory_pool_limits=pools,
            builder_optimization_level=config.optimization_level,
        )
        log.info(
            "building %s from %s (%s, %d plugin nodes, profile %s)",
            target.name,
            onnx_path.name,
            "/".join(precisions),
            plugins,
            {k: (v.min, v.opt, v.max) for k, v in profile.items()},
        )
        known = len(_plugin_errors())
        try:
            network = network_from_onnx_path(str(parse_path), strongly_typed=True)
            serialized = engine_bytes_from_network(network, config=build_config, save_timing_cache=str(cache))
        except Exception as exc:
            raise TensorRTBuildError(
                f"TensorRT could not build {target.name} from {onnx_path.name}: {_plugin_reason(known) or _reason(exc)}"
            ) from exc
        if serialized is None:
            reason = _plugin_reason(known) or "run with -v for the builder log"
            raise TensorRTBuildError(f"TensorRT returned no engine for {onnx_path.name}: {reason}")
        target.write_bytes(bytes(serialized))
        if config.verify:  # before the plan is moved into place: one that disagrees is never written
            _compare(target, onnx_path, proto, "step" if INPUT_IDS in profile else "heads", config)
    finally:
        parse_path.unlink(missing_ok=True)


def _plugin_reason(known: int) -> str:
    """The first plugin error raised since ``known`` were, as the reason of a failed build ("" if none)."""
    errors = _plugin_errors()[known:]
    return f"the {TREE_ATTENTION.qualified_name} plugin failed: {errors[0]}" if errors else ""


def _compare(plan: Path, onnx_path: Path, proto, graph: str, config: TensorRTConfig) -> None:
    from medusa_trt.exporter.trt_compare import compare_plan

    meta = EngineMeta.from_json({p.key: p.value for p in proto.metadata_props}[META_KEY], source=str(onnx_path))
    result = compare_plan(plan, onnx_path, meta, graph=graph)  # raises PlanMismatchError beyond tolerance
    if config.report is not None:
        config.report(result)


def _plan_names(final: EngineFiles, *, tokenizer: bool) -> list[str]:
    """The loose plan's set: engine.plan, its heads plan, sidecar, manifest (and engine.tokenizer/
    unless the plan shares it with the ONNX engine beside it)."""
    from medusa_trt.exporter.onnx_export import loose_names

    return [n for n in loose_names(final) if tokenizer or n != final.tokenizer.name]


def check_plan_out(plan: Path, *, tokenizer: bool = False) -> None:
    """Refuse (``NotOursError``) a loose plan's set that holds a file its manifest does not list;
    ``tokenizer``: the plan has its own engine.tokenizer/ (not shared with the ONNX engine beside it)."""
    final = EngineFiles.beside(plan)
    durable.check_set_ours(final.step.parent, _plan_names(final, tokenizer=tokenizer), manifest_path(final).name, main=final.step.name)


def _move_plans_into_place(staged: EngineFiles, final: EngineFiles, *, tokenizer: bool) -> None:
    """The staged plans, sidecar and manifest (and tokenizer) replace the earlier set as a whole,
    the step plan last (``durable.replace_set``); a stale heads plan of an earlier build goes with it."""
    names = _plan_names(final, tokenizer=tokenizer)
    durable.check_set_ours(final.step.parent, names, manifest_path(final).name, main=final.step.name)
    durable.replace_set(staged.step.parent, final.step.parent, names, final.step.name)


def _build_into_folder(trt, src: EngineFiles, meta: EngineMeta, proto, config: TensorRTConfig) -> EngineFiles:
    """An engine folder's plans: the folder is staged whole (its ONNX files hard-linked, the plans
    built beside them, config.json switched to backend "tensorrt", the manifest rewritten) and
    swapped in for the ONNX-only folder; a failed build leaves that folder as it was."""
    import onnx

    from medusa_trt.exporter.engine_folder import folder_config, swap_folder
    from medusa_trt.runtime.durable import link_files
    from medusa_trt.runtime.engine_folder import write_folder_config

    folder = src.folder
    tmp = make_staging(folder)
    try:
        link_files(engine_file_list(src), folder, tmp)
        staged, linked = EngineFiles.in_folder(tmp, ".plan"), EngineFiles.in_folder(tmp)
        # parsed from the staged links: the graph copy _build_one writes beside them never enters the live folder
        _build_one(trt, linked.step, staged.step, step_profile(meta), config, graph_precisions(proto, meta.dtype))
        if meta.num_heads:
            heads_proto = onnx.load(str(src.heads), load_external_data=False)
            _build_one(trt, linked.heads, staged.heads, heads_profile(meta), config, graph_precisions(heads_proto, meta.dtype))
        write_folder_config(tmp, folder_config(tmp, meta, "tensorrt"))
        write_manifest(staged)
        checkpoint()
        swap_folder(tmp, folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("wrote %s/%s (TensorRT %s)", folder, staged.step.name, trt.__version__)
    return EngineFiles.in_folder(folder, ".plan")


def _check_graph_needs(trt, src: EngineFiles, proto, meta: EngineMeta) -> EngineMeta:
    """The TensorRT release the step (and heads) graph's ops need, against the one installed; and the
    plugin registered (``--attention plugin``), so either failure is one line before any build. Returns
    ``meta`` with that release as ``min_tensorrt``: the plans' metadata records it, the backend checks it."""
    import onnx

    graphs = [proto] + ([onnx.load(str(src.heads), load_external_data=False)] if meta.num_heads else [])
    prepared = []
    for graph in graphs:
        copy = onnx.ModelProto()
        copy.CopyFrom(graph)
        prepare_for_tensorrt(copy)  # what the parser sees: fallback stripped
        prepared.append(copy)
    need = check_tensorrt_version(trt.__version__, *prepared)
    if meta.attention == "plugin":
        _register_plugin()
    return dataclasses.replace(meta, min_tensorrt=need.release)


def build_engines(onnx_path: str | os.PathLike, config: TensorRTConfig) -> EngineFiles:
    """Build the step (and heads) engines of an exported ONNX engine; write the metadata sidecar.

    ``onnx_path`` is what ``export_onnx`` wrote (its metadata is read from the graph): an .onnx file,
    or an engine folder, which gets model.plan / heads.plan beside its ONNX graphs. Files are
    staged in a hidden folder beside the plan (swept by a later build if this one is killed), the
    manifest written over the staged files, and moved into place, the step plan last."""
    import onnx

    onnx_path = Path(onnx_path)
    trt = require_tensorrt(onnx_path)
    src = EngineFiles.locate(onnx_path).onnx  # model.onnx and its siblings, or an engine folder's graphs
    proto = onnx.load(str(src.step), load_external_data=False)
    props = {p.key: p.value for p in proto.metadata_props}
    if META_KEY not in props:
        raise ExportError(f"{onnx_path} is not a medusa-trt ONNX engine (no '{META_KEY}' metadata): export it with medusa-export")
    meta = EngineMeta.from_json(props[META_KEY], source=str(onnx_path))
    if meta.quantization != "none":
        raise TensorRTBuildError(
            f"{onnx_path.name} holds ONNX Runtime's dynamic {meta.quantization} graph, which TensorRT does not build: "
            "export without --quantize (int8 / fp8 engines come from Q/DQ nodes, e.g. NVIDIA ModelOpt on the exported ONNX)"
        )
    if meta.key_slots:
        raise TensorRTBuildError(
            f"{onnx_path.name} takes key slots (ONNX Runtime's exact key layout), which the TensorRT backend does not "
            "feed: export it again with --no-key-slots (medusa-export does so for a .plan)"
        )
    if any(i.name == LOGITS_WANTED_INPUT for i in proto.graph.input):
        raise TensorRTBuildError(
            f"{onnx_path.name} has the logits gate (an If on {LOGITS_WANTED_INPUT}, exporter/logits_gate.py), which the "
            "TensorRT backend does not feed: export it again with --no-logits-gate (medusa-export does so for a .plan)"
        )
    if meta.dtype not in ENGINE_DTYPES:
        raise TensorRTBuildError(f"engine dtype {meta.dtype} is not one of {', '.join(ENGINE_DTYPES)}")
    meta = _check_graph_needs(trt, src, proto, meta)  # before anything is staged or built
    if src.folder is not None:
        return _build_into_folder(trt, src, meta, proto, config)
    final = EngineFiles.beside(config.plan)  # engine.plan, engine.heads.plan, engine.tokenizer/, .sidecar engine.plan.json
    check_plan_out(final.step, tokenizer=final.tokenizer != src.tokenizer)  # before the build
    tmp = make_staging(final.step)
    try:
        staged = EngineFiles.beside(tmp / final.step.name)
        _build_one(trt, src.step, staged.step, step_profile(meta), config, graph_precisions(proto, meta.dtype))
        if meta.num_heads:
            heads_proto = onnx.load(str(src.heads), load_external_data=False)
            _build_one(trt, src.heads, staged.heads, heads_profile(meta), config, graph_precisions(heads_proto, meta.dtype))
        staged.sidecar.write_text(meta.to_json())
        shutil.copytree(src.tokenizer, staged.tokenizer)  # staged with the plans so the manifest covers it
        write_manifest(staged)
        checkpoint()
        _move_plans_into_place(staged, final, tokenizer=final.tokenizer != src.tokenizer)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("wrote %s (TensorRT %s)", final.step, trt.__version__)
    return final
