"""NVIDIA's real ``tensorrt.plugin`` package over a small recording stand-in for TensorRT's compiled core.

``tensorrt.plugin`` (the quickly deployable plugin API: ``register``, ``autotune``, ``aot_impl`` and their
validators in ``_validate.py``) is pure Python. It ships inside the ``tensorrt-cu12-bindings`` wheel as
``tensorrt_bindings/plugin/``; the wheel installs from PyPI (``make install`` does, ``--no-deps``, pinned to
``BINDINGS``), only ``libnvinfer`` behind ``tensorrt.so`` is missing on machines without NVIDIA's libraries.
This module builds a ``tensorrt`` module holding only the names that package touches (enums, plugin fields,
the plugin registry, the quick-plugin interface base classes, dimension expressions and their builder), puts
the wheel's ``plugin/`` folder on its ``__path__`` and imports ``tensorrt.plugin`` from there, so the
project's ``trt_plugin.py`` registers through NVIDIA's own decorators and validators.

The stand-in records what TensorRT would be handed: the creators registered (name, namespace, version,
fields), and the plugin's answers to the calls TensorRT's builder makes (output types and shapes, the
supported type/format combinations, AOT launch parameters, kernel name and PTX). ``drive_aot`` makes those
calls in the builder's order with the arguments the ONNX parser gives, as far as the documented interface
says; what the compiled builder does beyond that (kernel loading, launching) cannot run here.

Run as a script (``python tests/tensorrt_stand_in.py ARGS``) it drives the AOT plugin for one case and
prints a JSON report: the AOT compile needs a process without ``TRITON_INTERPRET``.
"""

from __future__ import annotations

import contextlib
import enum
import importlib
import importlib.util
import json
import sys
import types
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

BINDINGS = "tensorrt-cu12-bindings==11.4.0.106"  # the wheel whose tensorrt.plugin the tests run (the Makefile installs it)
VERSION = BINDINGS.split("==")[1]
PLUGIN_MODULE = "medusa_trt.plugins.tree_attention.trt_plugin"


def bindings_plugin_dir() -> Path | None:
    """The wheel's ``tensorrt_bindings`` folder (holding ``plugin/``), found without importing it (that needs libnvinfer)."""
    spec = importlib.util.find_spec("tensorrt_bindings")
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = Path(list(spec.submodule_search_locations)[0])
    return folder if (folder / "plugin" / "_validate.py").is_file() else None


MISSING = None if bindings_plugin_dir() else f"tensorrt.plugin is not installed: pip install --no-deps {BINDINGS} (make install does)"


# ----------------------------------------------------------------------------- the core's names


class DataType(enum.Enum):
    FLOAT = 0
    HALF = 1
    INT8 = 2
    INT32 = 3
    BOOL = 4
    UINT8 = 5
    FP8 = 6
    BF16 = 7
    INT64 = 8
    INT4 = 9


class TensorFormat(enum.Enum):
    LINEAR = 0
    CHW2 = 1
    HWC8 = 2
    CHW4 = 3
    CHW16 = 4
    CHW32 = 5
    HWC = 8


class PluginFieldType(enum.Enum):
    FLOAT16 = 0
    FLOAT32 = 1
    FLOAT64 = 2
    INT8 = 3
    INT16 = 4
    INT32 = 5
    CHAR = 6
    DIMS = 7
    UNKNOWN = 8
    BF16 = 9
    INT64 = 10


FIELD_DTYPES = {
    PluginFieldType.FLOAT16: np.float16,
    PluginFieldType.FLOAT32: np.float32,
    PluginFieldType.FLOAT64: np.float64,
    PluginFieldType.INT8: np.int8,
    PluginFieldType.INT16: np.int16,
    PluginFieldType.INT32: np.int32,
    PluginFieldType.INT64: np.int64,
}


class DimensionOperation(enum.Enum):
    SUM = 0
    PROD = 1
    MAX = 2
    MIN = 3
    SUB = 4
    EQUAL = 5
    LESS = 6
    FLOOR_DIV = 7
    CEIL_DIV = 8


class TensorRTPhase(enum.Enum):
    BUILD = 0
    RUNTIME = 1


class QuickPluginCreationRequest(enum.Enum):
    UNKNOWN = 0
    PREFER_JIT = 1
    PREFER_AOT = 2
    STRICT_JIT = 3
    STRICT_AOT = 4


class PluginArgType(enum.Enum):
    INT = 0


class PluginArgDataType(enum.Enum):
    INT8 = 0
    INT16 = 1
    INT32 = 2


@dataclass
class PluginField:
    name: str
    data: object = None
    type: PluginFieldType = PluginFieldType.UNKNOWN


class PluginFieldCollection(list):
    pass


class Logger:
    INTERNAL_ERROR, ERROR, WARNING, INFO, VERBOSE = range(5)
    Severity = types.SimpleNamespace(INTERNAL_ERROR=0, ERROR=1, WARNING=2, INFO=3, VERBOSE=4)
    messages: list = []

    def __init__(self, severity=WARNING):
        self.severity = severity

    def log(self, severity, message):
        Logger.messages.append((severity, message))


class Dims(tuple):
    MAX_DIMS = 8

    def __new__(cls, dims=()):
        return super().__new__(cls, [0] * dims if isinstance(dims, int) else dims)


class DimsExprs(list):
    def __init__(self, length: int = 0):
        super().__init__([None] * length)


_OPS = {
    DimensionOperation.SUM: lambda a, b: a + b,
    DimensionOperation.PROD: lambda a, b: a * b,
    DimensionOperation.MAX: max,
    DimensionOperation.MIN: min,
    DimensionOperation.SUB: lambda a, b: a - b,
    DimensionOperation.EQUAL: lambda a, b: int(a == b),
    DimensionOperation.LESS: lambda a, b: int(a < b),
    DimensionOperation.FLOOR_DIV: lambda a, b: a // b,
    DimensionOperation.CEIL_DIV: lambda a, b: -(-a // b),
}


class IDimensionExpr:
    """A dimension expression: a constant, a named run-time size, or an operation of two; ``evaluate``
    gives its value for concrete sizes (what TensorRT computes at enqueue)."""

    def __init__(self, value: int | None = None, name: str | None = None, op=None, args=()):
        self.value, self.name, self.op, self.args = value, name, op, args

    def is_constant(self) -> bool:
        return self.value is not None

    def get_constant_value(self) -> int:
        assert self.value is not None, "not a build-time constant"
        return self.value

    def is_size_tensor(self) -> bool:
        return False

    def evaluate(self, sizes: dict[str, int]) -> int:
        if self.value is not None:
            return self.value
        if self.name is not None:
            return sizes[self.name]
        return _OPS[self.op](*(a.evaluate(sizes) for a in self.args))

    def __repr__(self):
        return str(self.value) if self.value is not None else self.name or f"{self.op.name}{self.args}"


class IExprBuilder:
    def constant(self, value: int) -> IDimensionExpr:
        return IDimensionExpr(value=int(value))

    def operation(self, op: DimensionOperation, first: IDimensionExpr, second: IDimensionExpr) -> IDimensionExpr:
        if first.is_constant() and second.is_constant():
            return IDimensionExpr(value=_OPS[op](first.value, second.value))
        return IDimensionExpr(op=op, args=(first, second))


class PluginTensorDesc:
    def __init__(self, dims=(), type=DataType.FLOAT, format=TensorFormat.LINEAR, scale=1.0):
        self.dims, self.type, self.format, self.scale = Dims(dims), type, format, scale


class DynamicPluginTensorDesc:
    def __init__(self, desc: PluginTensorDesc | None = None, min=(), opt=(), max=()):
        self.desc = desc or PluginTensorDesc()
        self.min, self.opt, self.max = Dims(min), Dims(opt), Dims(max)


class ITensor:
    pass


class _Interface:
    def __init__(self):
        pass


class IPluginCreatorV3Quick(_Interface):
    pass


class IPluginV3(_Interface):
    pass


class IPluginV3QuickCore(_Interface):
    pass


class IPluginV3QuickBuild(_Interface):
    pass


class IPluginV3QuickRuntime(_Interface):
    pass


class IPluginV3QuickAOTBuild(_Interface):
    pass


class ISymExpr(_Interface):
    pass


@dataclass
class PluginRegistry:
    """Records each creator registered and answers ``get_creator`` by (name, version, namespace), as TensorRT's does."""

    creators: list = field(default_factory=list)

    def register_creator(self, creator, namespace: str = "") -> bool:
        self.creators.append((creator, namespace))
        return True

    def get_creator(self, name: str, version: str, namespace: str = ""):
        for creator, _ in self.creators:
            if (creator.name, creator.plugin_version, creator.plugin_namespace) == (name, version, namespace):
                return creator
        return None


_NPTYPES = {
    DataType.FLOAT: np.float32,
    DataType.HALF: np.float16,
    DataType.INT8: np.int8,
    DataType.INT32: np.int32,
    DataType.INT64: np.int64,
    DataType.BOOL: np.bool_,
    DataType.UINT8: np.uint8,
}


def make_core(*, version: str = VERSION, aot: bool = True) -> types.ModuleType:
    """The stand-in ``tensorrt`` module. ``aot=False``: a release without AOT plugins (no
    ``QuickPluginCreationRequest``, so ``tensorrt.plugin`` defines no ``KernelLaunchParams``)."""
    core = types.ModuleType("tensorrt")
    names = dict(
        __version__=version,
        DataType=DataType,
        TensorFormat=TensorFormat,
        PluginFieldType=PluginFieldType,
        PluginField=PluginField,
        PluginFieldCollection=PluginFieldCollection,
        DimensionOperation=DimensionOperation,
        TensorRTPhase=TensorRTPhase,
        PluginArgType=PluginArgType,
        PluginArgDataType=PluginArgDataType,
        Logger=Logger,
        Dims=Dims,
        DimsExprs=DimsExprs,
        IDimensionExpr=IDimensionExpr,
        IExprBuilder=IExprBuilder,
        PluginTensorDesc=PluginTensorDesc,
        DynamicPluginTensorDesc=DynamicPluginTensorDesc,
        ITensor=ITensor,
        IPluginCreatorV3Quick=IPluginCreatorV3Quick,
        IPluginV3=IPluginV3,
        IPluginV3QuickCore=IPluginV3QuickCore,
        IPluginV3QuickBuild=IPluginV3QuickBuild,
        IPluginV3QuickRuntime=IPluginV3QuickRuntime,
        IPluginV3QuickAOTBuild=IPluginV3QuickAOTBuild,
        ISymExpr=ISymExpr,
        nptype=lambda dtype: _NPTYPES[dtype],
        float32=DataType.FLOAT,
        float16=DataType.HALF,
        bfloat16=DataType.BF16,
        int8=DataType.INT8,
        int32=DataType.INT32,
        int64=DataType.INT64,
        bool=DataType.BOOL,
        uint8=DataType.UINT8,
    )
    if aot:
        names["QuickPluginCreationRequest"] = QuickPluginCreationRequest
    for name, value in names.items():
        setattr(core, name, value)
    registry = PluginRegistry()
    core.registry = registry  # the stand-in's own record (TensorRT has no such attribute)
    core.get_plugin_registry = lambda: registry
    core.__path__ = [str(bindings_plugin_dir())]  # `import tensorrt.plugin` finds the wheel's plugin/ folder
    return core


@contextlib.contextmanager
def loaded(*, version: str = VERSION, aot: bool = True) -> Iterator[types.ModuleType]:
    """Within: ``tensorrt`` is the stand-in, ``tensorrt.plugin`` NVIDIA's package over it, and the project's
    plugin module unimported (``import_plugin`` registers it). Every module touched is restored after."""
    if MISSING:
        raise RuntimeError(MISSING)

    def ours(name: str) -> bool:
        return name == "tensorrt" or name.startswith("tensorrt.") or name == PLUGIN_MODULE

    saved = {name: module for name, module in sys.modules.items() if ours(name)}
    for name in saved:
        del sys.modules[name]
    core = make_core(version=version, aot=aot)
    sys.modules["tensorrt"] = core
    try:
        yield core
    finally:
        for name in [n for n in sys.modules if ours(n)]:
            del sys.modules[name]
        sys.modules.update(saved)


def import_plugin():
    """Import the project's TensorRT plugin module (registration runs through ``tensorrt.plugin``)."""
    return importlib.import_module(PLUGIN_MODULE)


def recorded_creator(core, name: str, version: str, namespace: str) -> dict | None:
    """What TensorRT's registry holds for this lookup triple: name, namespace, version and field (name, type)s."""
    creator = core.registry.get_creator(name, version, namespace)
    if creator is None:
        return None
    fields = [(f.name, f.type.name) for f in creator.field_names]
    return dict(name=creator.name, namespace=creator.plugin_namespace, version=creator.plugin_version, fields=fields)


# ----------------------------------------------------------------------------- the builder's calls


def parser_fields(creator, attributes: dict) -> PluginFieldCollection:
    """The fields the ONNX parser's plugin fallback hands ``create_plugin``: each field the creator
    lists, read from the node's attribute of that name and converted to the field's type."""
    fields = PluginFieldCollection()
    for declared in creator.field_names:
        if declared.name not in attributes:
            raise KeyError(f"the node has no attribute {declared.name!r} the creator lists")
        fields.append(PluginField(declared.name, np.array([attributes[declared.name]], dtype=FIELD_DTYPES[declared.type]), declared.type))
    return fields


def drive_aot(
    core,
    node_attributes: dict,
    *,
    lookup: tuple[str, str, str],  # (op_type, plugin_version, plugin_namespace) from the ONNX node
    float_type: DataType,
    heads: tuple[int, int, int],  # Hq, Hkv, D: build-time constants
    layers: int,
    sizes: dict[str, int],  # B, T, S: run-time sizes the symbolic launch parameters are evaluated at
) -> dict:
    """Create the plugin as the parser and builder would and ask it for its AOT kernel; returns what TensorRT
    would receive, with the symbolic launch parameters evaluated at ``sizes``."""
    name, version, namespace = lookup
    creator = core.registry.get_creator(name, version, namespace)
    if creator is None:
        raise LookupError(f"no plugin creator {namespace}::{name} version {version!r} is registered")
    plugin = creator.create_plugin(
        name, namespace, parser_fields(creator, node_attributes), TensorRTPhase.BUILD, QuickPluginCreationRequest.UNKNOWN
    )
    hq, hkv, d = heads
    b, t, s = (IDimensionExpr(name=n) for n in "BTS")
    const = IDimensionExpr
    shapes = [  # spec.TREE_ATTENTION.inputs
        [b, const(hq), t, const(d)],
        [b, const(hkv), t, const(d)],
        [b, const(hkv), t, const(d)],
        [s, const(layers), b, const(hkv), const(d)],
        [s, const(layers), b, const(hkv), const(d)],
        [b, t, t],
        [b],
        [const(hq)],
    ]
    types_ = [float_type] * 5 + [DataType.BOOL, DataType.INT64, float_type]
    out_types = plugin.get_output_data_types(types_, [len(x) for x in shapes])
    builder = IExprBuilder()
    inputs = []
    for dims in shapes:
        exprs = DimsExprs(len(dims))
        for i, dim in enumerate(dims):
            exprs[i] = dim
        inputs.append(exprs)
    out_shapes = plugin.get_output_shapes(inputs, [], builder)

    def concrete(dims):
        return tuple(d.evaluate(sizes) for d in dims)

    in_out = [DynamicPluginTensorDesc(PluginTensorDesc(concrete(dims), dtype)) for dims, dtype in zip(shapes, types_)]
    in_out.append(DynamicPluginTensorDesc(PluginTensorDesc(concrete(out_shapes[0]), out_types[0])))
    combinations = plugin.get_supported_format_combinations(in_out, len(shapes))
    width = len(in_out)
    offered = [tuple((c.type.name, c.format.name) for c in combinations[i : i + width]) for i in range(0, len(combinations), width)]
    plugin.configure_plugin(in_out[: len(shapes)], in_out[len(shapes) :])
    tactics = plugin.get_valid_tactics()
    plugin.set_tactic(0)  # no custom tactics: TensorRT's default one
    launch = types.SimpleNamespace()
    scalars = DimsExprs(0)
    setter = _SymExprSetter(scalars)
    plugin.get_launch_params(inputs, in_out, len(shapes), launch, setter, builder)
    kernel_name, ptx = plugin.get_kernel([x.desc for x in in_out[: len(shapes)]], [x.desc for x in in_out[len(shapes) :]])
    evaluate = {
        k: getattr(launch, k).expr.evaluate(sizes) for k in ("grid_x", "grid_y", "grid_z", "block_x", "block_y", "block_z", "shared_mem")
    }
    return dict(
        output_types=[t.name for t in out_types],
        output_shape=concrete(out_shapes[0]),
        offered=offered,
        tactics=list(tactics),
        launch=evaluate,
        scalars=[(s.dtype.name, s.expr.evaluate(sizes)) for s in setter.exprs],
        kernel_name=kernel_name.decode() if isinstance(kernel_name, bytes) else kernel_name,
        ptx=ptx.decode() if isinstance(ptx, bytes) else ptx,
    )


class _SymExprSetter:
    """TensorRT's ``ISymExprs`` the AOT plugin fills with its scalar arguments."""

    def __init__(self, exprs):
        self.exprs = exprs
        self.nbSymExprs = 0

    def __setattr__(self, name, value):
        if name == "nbSymExprs" and value:
            self.exprs[:] = [None] * value
        object.__setattr__(self, name, value)

    def __setitem__(self, index, value):
        self.exprs[index] = value


def main(argv: list[str]) -> int:
    """``python tensorrt_stand_in.py CAPABILITY JSON``: drive the AOT plugin, built for compute capability
    CAPABILITY (e.g. 90), for each case of the JSON list; prints the reports as one JSON list. A case:
    float_type (FLOAT/HALF/BF16), heads [Hq, Hkv, D], layers, sizes {B, T, S}, attributes {layer, scale,
    window, softcap}, lookup [op_type, plugin_version, plugin_namespace]."""
    capability, cases = int(argv[0]), json.loads(argv[1])
    from triton.backends.compiler import GPUTarget

    reports = []
    with loaded() as core:
        plugin = import_plugin()
        plugin.build_target = lambda: GPUTarget("cuda", capability, 32)  # TensorRT builds for the current GPU; here, any
        for case in cases:
            reports.append(
                drive_aot(
                    core,
                    case["attributes"],
                    lookup=tuple(case["lookup"]),
                    float_type=DataType[case["float_type"]],
                    heads=tuple(case["heads"]),
                    layers=case["layers"],
                    sizes=case["sizes"],
                )
            )
    print(json.dumps(reports))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
