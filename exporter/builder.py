"""``build``: what ``medusa-export`` runs, callable from Python (``medusa_trt.exporter.build``).

    from medusa_trt.exporter import BuildConfig, build
    built = build(BuildConfig(model="smollm2-135m", heads="assets/smollm2-135m-medusa", out="build/smollm2"))

One engine from a base model and its heads: the ONNX graphs (``onnx_export``), checked against torch,
then with ``out`` ending in ``.plan`` (or an engine folder with ``backend="tensorrt"``) the TensorRT
plans built from them (``tensorrt_build``). What the config leaves open (tree, draft vocabulary,
quantization) comes from the heads folder's export.json (``export_defaults``). The TensorRT and
quantization rules are checked before any model loads; nothing is left on disk on failure.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from medusa_trt.exporter.options import GraphOptions, graph_options
from medusa_trt.runtime.backends import BACKENDS  # an engine folder's runtime: tensorrt also builds the plans into it

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BuildConfig(GraphOptions):
    """The choices of one ``medusa-export`` (each flag's help says more); the graph's shape and checks are
    ``GraphOptions``'s, passed to the export as they are."""

    model: str  # smollm2-135m, a Hugging Face folder, or a .gguf file
    out: str | Path  # an engine folder (no suffix), model.onnx (ONNX Runtime) or engine.plan (TensorRT; engine.onnx beside it)
    heads: str | None = None  # Medusa heads folder; None (and no untrained_heads): plain decoding only
    untrained_heads: int | None = None  # N untrained heads (identity blocks + shared lm_head)
    head_layer: int | None = None  # decoder layer whose output feeds the heads
    # engine folder only: one of BACKENDS; None: the export chooses (native where exact and faster here, else onnxruntime,
    # exporter/backend_choice.py); for a file the suffix decides
    backend: str | None = None
    step_cost: str | None = None  # engine folder only: a medusa-calibrate report whose step_ms the drafting budget reads
    tree: str | None = None  # None: the heads folder's export.json, else a chain over the heads
    key_slots: bool = True  # ONNX Runtime engines with standard attention: a verify step equals a plain step bit for bit
    gate_logits: bool = True  # ONNX Runtime engines with standard attention: the lm_head behind an If (exporter/logits_gate.py)
    draft_vocab: int | None = None  # None: the heads folder's export.json, else the whole vocabulary
    quantize: str | None = None  # a quantize.MODES mode or "none"; None: the heads folder's export.json, else none
    block_size: int | None = None  # quantize int4 / int8-block: weights per block (None: quantize.DEFAULT_BLOCK_SIZE)
    accuracy_level: int | None = None  # quantize int4 / int8-block: MatMulNBits compute type (None: quantize.DEFAULT_ACCURACY_LEVEL)
    timing_cache: str | None = None  # TensorRT timing cache (None: timing.cache beside the .plan)
    # the weights read from the checkpoint one tensor at a time as the engine is written (exporter/streamed.py); None:
    # where the model's fp32 weights exceed half the memory available
    stream_weights: bool | None = None

    def __post_init__(self):
        from medusa_trt.exporter.errors import ExportError

        if self.untrained_heads is not None and self.untrained_heads < 0:
            raise ExportError(f"--untrained-heads {self.untrained_heads} is negative: pass 1 or more (0 or none: a plain engine)")
        if self.backend not in (None, *BACKENDS):
            raise ExportError(f"--backend {self.backend} is not one of {', '.join(BACKENDS)}")


@dataclass(frozen=True)
class BuildPlan:
    """Where a ``BuildConfig`` writes and what it takes from the heads folder, resolved before any work."""

    onnx_out: Path  # what export_onnx writes: the folder, model.onnx, or engine.onnx beside engine.plan
    tensorrt: object | None  # tensorrt_build.TensorRTConfig of the plans; None: ONNX Runtime only
    defaults: object  # export_defaults.ExportDefaults: the tree, draft vocabulary and quantization to export with
    taken: dict  # {setting: value} taken from defaults_file (for the user)
    defaults_file: Path | None  # the heads folder's export.json


@dataclass(frozen=True)
class Built:
    """Progress of a ``build``: each stage's result once it is done."""

    plan: BuildPlan
    onnx: object | None = None  # onnx_export.ExportResult
    tensorrt: object | None = None  # runtime.engine.EngineFiles of the plans
    comparisons: tuple = ()  # trt_compare.PlanComparison of each plan against its ONNX graph

    @property
    def engine(self) -> Path:
        """What the runtime opens: the engine folder, else the step .plan, else the step .onnx."""
        files = self.tensorrt if self.tensorrt is not None else self.onnx.files
        return files.folder or files.step


def build(config: BuildConfig, report: Callable[[Built], None] | None = None) -> Built:
    """Export (and build) the engine; ``report`` sees the progress after each stage: the plan, the
    ONNX engine, the TensorRT plans. Raises ``MedusaError`` subclasses a user can act on."""
    from medusa_trt.exporter.onnx_export import DTYPES, export_onnx
    from medusa_trt.exporter.streamed import check_streamable, should_stream
    from medusa_trt.exporter.wrapper import load_medusa

    report = report or _log
    built = Built(plan(config))
    report(built)
    onnx_config = export_config(config, built.plan)
    streamed = should_stream(config.model, config.stream_weights)  # the checkpoint to read one tensor at a time, or None
    if streamed is not None:  # what it cannot stream, before the model loads
        check_streamable(onnx_config.quantize.mode if onnx_config.quantize else None, config.dtype)
    # loaded in the engine's dtype: the export then converts nothing (and copies nothing)
    model = load_medusa(
        config.model,
        config.heads,
        untrained_heads=config.untrained_heads,
        head_layer=config.head_layer,
        dtype=DTYPES[config.dtype],
        device="cpu",
        weights=streamed is None,
    )
    built = dataclasses.replace(built, onnx=export_onnx(model, onnx_config, streamed))
    report(built)
    if built.plan.tensorrt is None:
        return built
    from medusa_trt.exporter.tensorrt_build import build_engines

    compared = []  # each plan's PlanComparison against its ONNX graph
    tensorrt = dataclasses.replace(built.plan.tensorrt, verify=config.verify, report=compared.append)
    files = build_engines(built.engine, tensorrt)
    built = dataclasses.replace(built, tensorrt=files, comparisons=tuple(compared))
    report(built)
    return built


def plan(config: BuildConfig) -> BuildPlan:
    """Where the engine goes and which defaults the heads folder adds; checks the TensorRT and
    quantization rules and that the output can be written. Loads no model, writes nothing."""
    from medusa_trt.exporter.errors import ExportError
    from medusa_trt.exporter.export_defaults import EXPORT_DEFAULTS, read_export_defaults
    from medusa_trt.exporter.onnx_export import check_output_path, is_folder_out
    from medusa_trt.exporter.tensorrt_build import TensorRTConfig, check_plan_out, onnx_beside

    out = Path(config.out)
    folder = is_folder_out(out)
    if not folder and (config.backend or config.step_cost):
        flag = "backend" if config.backend else "step-cost"
        raise ExportError(f"--{flag} is for engine folders: pass --out DIR (no .onnx / .plan suffix)")
    if out.suffix == ".plan":
        tensorrt = TensorRTConfig(plan=out, timing_cache=config.timing_cache)
    elif folder and config.backend == "tensorrt":
        tensorrt = TensorRTConfig(plan=out / "model.plan", timing_cache=config.timing_cache or out.parent / "timing.cache")
    else:
        tensorrt = None
    onnx_out = out if folder else onnx_beside(out) if tensorrt else out
    native_quantizers = (None, "none", "int8-channel", "int4", "int8-block")
    wrong = [f"--dtype {config.dtype}"] * (config.dtype != "fp32") + [f"--quantize {config.quantize}"] * (
        config.quantize not in native_quantizers
    )
    if config.backend == "native" and wrong:  # only what is wrong is named
        raise ExportError(
            f"--backend native runs fp32 step graphs, plain or quantized int8-channel, int4 or int8-block, not {' with '.join(wrong)}: "
            "drop it (--quantize int8-channel or int4 for a smaller engine), or choose --backend onnxruntime"
        )
    if config.backend == "native" and config.accuracy_level not in (None, 4):
        raise ExportError(
            f"--backend native computes MatMulNBits at accuracy level 4 (int8 activations), not --accuracy-level "
            f"{config.accuracy_level}: drop --accuracy-level, or choose --backend onnxruntime"
        )
    if tensorrt is None and config.dtype == "bf16":
        raise ExportError(
            "--dtype bf16 is for TensorRT engines (--out *.plan): ONNX Runtime's CPU provider has no bf16 kernels; use fp32 or fp16"
        )
    if tensorrt is not None and config.quantize not in (None, "none"):
        raise ExportError(
            f"--quantize {config.quantize} makes a graph of ONNX Runtime's quantized ops, which TensorRT does not build: "
            "drop it for a .plan"
        )
    check_output_path(onnx_out)
    if tensorrt is not None:  # an installed TensorRT too old for this graph, or without AOT plugins: before any work
        from medusa_trt.exporter.tensorrt_build import preflight

        preflight(config.attention, config.opset)
    if out.suffix == ".plan":  # the plan's own set (engine.plan, engine.heads.plan, engine.plan.json, ...), before any work
        check_plan_out(out)
    quantizable = tensorrt is None and config.attention == "onnx" and config.dtype == "fp32"
    defaults, taken = read_export_defaults(config.heads).under(config.tree, config.draft_vocab, config.quantize, quantizable=quantizable)
    defaults_file = Path(config.heads) / EXPORT_DEFAULTS if config.heads else None
    return BuildPlan(onnx_out, tensorrt, defaults, taken, defaults_file)


def export_config(config: BuildConfig, plan: BuildPlan):
    """The ONNX stage's ``ExportConfig``: the config's choices, the heads folder's defaults, the plan's target."""
    from medusa_trt.exporter.engine_folder import read_step_cost
    from medusa_trt.exporter.onnx_export import ExportConfig
    from medusa_trt.exporter.quantize import QuantizeConfig

    chosen, onnx_runtime = plan.defaults, plan.tensorrt is None
    return ExportConfig(
        **graph_options(config),
        out=plan.onnx_out,
        tree=chosen.tree,
        quantize=QuantizeConfig.from_options(chosen.quantize, config.block_size, config.accuracy_level),
        step_cost=read_step_cost(config.step_cost) if config.step_cost else None,
        draft_vocab=chosen.draft_vocab,
        key_slots=onnx_runtime and config.attention == "onnx" and config.key_slots,
        gate_logits=onnx_runtime and config.attention == "onnx" and config.gate_logits,  # TensorRT: the plans from the ungated graph
        measure_cost=onnx_runtime,
        backend=config.backend if onnx_runtime else "onnxruntime",  # None: the export chooses
    )


def _log(built: Built) -> None:
    """The default ``report``: one log line per stage."""
    if built.tensorrt is not None:
        log.info("built %s", built.tensorrt.step)
    elif built.onnx is not None:
        log.info("exported %s", built.onnx.files.folder or built.onnx.files.step)
    elif built.plan.taken:
        log.info("from %s: %s", built.plan.defaults_file, ", ".join(f"{k} {v}" for k, v in built.plan.taken.items()))
