"""Weight quantization of exported graphs for ONNX Runtime's CPU provider, in place.

``QuantizeConfig.mode`` picks the pass; each rewrites a graph file and carries the engine
metadata over:

  int8          the step graph's weight matmuls as dynamic int8 (``quantize_dynamic``): int8
                weights with one scale per tensor, one activation scale per call; the heads as
                in heads-int8. Output differs from fp32, and a row's output depends on its batch.
  heads-int8    only the heads graph: int8 weights with one scale per output column, one
                activation scale per row (``rows_int8_graph``). The heads propose drafts and never
                decide a token, so output stays identical to fp32.
  int4          ONNX Runtime's ``MatMulNBits``: 4-bit weights in blocks of ``block_size`` along
                the input axis, one scale and zero point per block, on the step graph and the
                heads graph alike. ``accuracy_level`` is the kernel's compute type: 0 / 1 fp32 on
                dequantized weights, 2 fp16, 3 bf16, 4 int8 activations (quantized per block
                and row, the fastest on AVX-512 VNNI CPUs).
  int8-channel  ``rows_int8_graph`` on both graphs: int8 weights with one scale per output column,
                activations with one scale per row (per token), so a row's output never
                depends on its batch neighbours.
  int8-block    ``MatMulNBits`` with 8-bit weights (as int4, ``block_size`` / ``accuracy_level``
                alike): int8 activations per block and row at level 4, so also batch-independent,
                in one fused kernel instead of int8-channel's chain of small ops.

The tied embedding of a model whose ``lm_head`` shares it stays a float ``Gather`` (one row a
token, nothing to gain); the ``lm_head`` matmul reads it through a ``Transpose`` in the step
graph, which is folded into its own constant first so that matmul is quantized too.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from medusa_trt.exporter import lazy_weights
from medusa_trt.exporter.external_data import data_path, has_external_data, save_graph
from medusa_trt.exporter.lean import fuse_matmuls_by_input
from medusa_trt.runtime.engine import META_KEY, EngineFiles, EngineMeta

log = logging.getLogger(__name__)

MODES = ("int8", "heads-int8", "int4", "int8-channel", "int8-block")
BLOCKWISE = ("int4", "int8-block")  # modes that take block_size / accuracy_level (MatMulNBits)
NBITS = {"int4": 4, "int8-block": 8}  # MatMulNBits' weight bits per mode
DEFAULT_BLOCK_SIZE = 32  # weights per int4 block (MatMulNBits' block_size); 128 is faster but not exact (docs/exactness.md)
MIN_BLOCK_SIZE = 16  # MatMulNBits' smallest block; block sizes are powers of two
ACCURACY_LEVELS = range(0, 5)  # MatMulNBits' accuracy_level: 0 unset (fp32), 1 fp32, 2 fp16, 3 bf16, 4 int8
# int8 activations: 1.5x level 1's speed at 1 token a step, 1.7x at 8 (SmolLM2 step graph); the price is
# drafted output that can differ from the engine's plain output (docs/benchmarks.md, int4 / int8 engines)
DEFAULT_ACCURACY_LEVEL = 4


@dataclass(frozen=True)
class QuantizeConfig:
    mode: str  # one of MODES
    block_size: int | None = None  # int4 only: weights per block along the input axis; None: DEFAULT_BLOCK_SIZE
    accuracy_level: int | None = None  # int4 only: MatMulNBits compute type (ACCURACY_LEVELS); None: DEFAULT_ACCURACY_LEVEL

    def __post_init__(self):
        from medusa_trt.exporter.errors import ExportError

        if self.mode not in MODES:
            raise ExportError(f"--quantize {self.mode} is not supported: use one of {', '.join(MODES)}")
        given = [f"--{n.replace('_', '-')}" for n in ("block_size", "accuracy_level") if getattr(self, n) is not None]
        if self.mode not in BLOCKWISE:
            if given:
                raise ExportError(
                    f"{' / '.join(given)} {'applies' if len(given) == 1 else 'apply'} to --quantize int4 / int8-block only: "
                    f"drop it, or pass --quantize int4"
                )
            return
        block = DEFAULT_BLOCK_SIZE if self.block_size is None else self.block_size
        level = DEFAULT_ACCURACY_LEVEL if self.accuracy_level is None else self.accuracy_level
        if not isinstance(block, int) or block < MIN_BLOCK_SIZE or block & (block - 1):
            raise ExportError(
                f"--block-size {block} is not a power of two >= {MIN_BLOCK_SIZE}: pass 16, 32, 64, 128, ... (default {DEFAULT_BLOCK_SIZE})"
            )
        if not isinstance(level, int) or level not in ACCURACY_LEVELS:
            raise ExportError(
                f"--accuracy-level {level} is out of range: pass {ACCURACY_LEVELS.start}..{ACCURACY_LEVELS.stop - 1} "
                f"(0 / 1 fp32, 4 int8 activations; default {DEFAULT_ACCURACY_LEVEL})"
            )
        object.__setattr__(self, "block_size", block)
        object.__setattr__(self, "accuracy_level", level)

    @classmethod
    def from_options(cls, mode: str | None, block_size: int | None = None, accuracy_level: int | None = None) -> QuantizeConfig | None:
        """The command line's --quantize / --block-size / --accuracy-level; None when none is given."""
        if mode is None and (block_size is not None or accuracy_level is not None):
            from medusa_trt.exporter.errors import ExportError

            flag = "--block-size" if block_size is not None else "--accuracy-level"
            raise ExportError(f"{flag} applies to --quantize int4 / int8-block only: add --quantize int4, or drop {flag}")
        return None if mode is None else cls(mode, block_size, accuracy_level)

    @property
    def lossless(self) -> bool:
        """Only the heads are quantized: every token is the fp32 step graph's (verification holds it to the tolerance)."""
        return self.mode == "heads-int8"

    @property
    def loose(self) -> tuple[str, ...]:
        """Verified outputs reported but not held to the tolerance in a lossless engine."""
        return ("head logits",) if self.lossless else ()


def quantize_engine(files: EngineFiles, meta: EngineMeta, config: QuantizeConfig) -> None:
    """Quantize the graphs of a staged engine in place as ``config`` says (the heads graph when there is one). A
    gated step graph (exporter/logits_gate.py: an engine quantized after its export) is quantized ungated, then
    gated again: the quantizers do not read into an If's branches."""
    from medusa_trt.exporter.logits_gate import gate_logits_file, ungate_logits_file

    logging.getLogger("onnxruntime.quantization").setLevel(logging.WARNING)  # it logs every node it skips at INFO
    gated = ungate_logits_file(files.step)
    if config.mode == "int8":
        dynamic_int8(files.step, meta)
    elif config.mode != "heads-int8":  # heads-int8: the step graph stays fp32
        quantize_file(files.step, meta, config, step=True)
    if gated:
        gate_logits_file(files.step)
    if Path(files.heads).is_file():  # else a plain engine
        quantize_file(files.heads, meta, config, step=False)


def quantize_file(path: Path, meta: EngineMeta, config: QuantizeConfig, *, step: bool) -> None:
    """``quantize_graph`` on the graph file at ``path``, in place; metadata carried over."""
    import onnx

    proto = quantize_graph(onnx.load(str(path)), config, step=step)
    if config.mode in NBITS:
        count = sum(n.op_type == "MatMulNBits" for n in proto.graph.node)
        log.info("%s: %d weight matmuls as %d-bit MatMulNBits (block %d, accuracy level %d)", path.name, count, NBITS[config.mode],
                 config.block_size, config.accuracy_level)  # fmt: skip
    _replace_graph(path, proto, meta)


def dynamic_int8(path: Path, meta: EngineMeta) -> None:
    """Dynamic int8 quantization of the weight matmuls, in place; metadata carried over.

    One activation scale per call spans every row and token of it, so a row's output depends on
    the other rows of the batch (the step graph of ``--quantize int8``; the heads use ``rows_int8_graph``).
    The tied ``lm_head`` (a ``Transpose`` of the embedding, not a constant) stays fp32."""
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    quantized = path.with_name(path.stem + ".int8.onnx")
    try:
        quantize_dynamic(
            str(path),
            str(quantized),
            weight_type=QuantType.QInt8,
            op_types_to_quantize=["MatMul"],
            use_external_data_format=has_external_data(path),  # a graph over 2 GiB cannot be written whole
            extra_options={"MatMulConstBOnly": True},
        )
        proto = onnx.load(str(quantized))
    finally:
        quantized.unlink(missing_ok=True)
        data_path(quantized).unlink(missing_ok=True)
    _replace_graph(path, proto, meta)


def nbits_graph(proto, config: QuantizeConfig):
    """Every weight matmul (``Gemm`` of a ``Linear`` first turned into ``MatMul``) of a loaded graph (a ``ModelProto``)
    as ``MatMulNBits``: 4- or 8-bit weights (``NBITS``), asymmetric, in blocks of ``config.block_size`` input rows with
    one fp32 scale and zero point per block and output column; the graph it writes. A lazy weight
    (``exporter/lazy_weights.py``) is made for its own matmul's quantization only, so the float weights are never
    all in memory at once."""
    from onnx import numpy_helper
    from onnxruntime.quantization import matmul_nbits_quantizer as nbits_module
    from onnxruntime.quantization.onnx_model import ONNXModel

    model = ONNXModel(proto)
    fold_weight_transposes(model.model.graph)
    model.replace_gemm_with_matmul()  # Linear layers export as Gemm: MatMul (+ Add for a bias)
    fuse_matmuls_by_input(model.model.graph)
    quantizer = nbits_module.MatMulNBitsQuantizer(
        model.model,
        bits=NBITS[config.mode],
        block_size=config.block_size,
        is_symmetric=False,
        accuracy_level=config.accuracy_level,
        op_types_to_quantize=("MatMul",),
    )
    found = nbits_module.get_initializer

    def made(name: str, graph_stack):  # a lazy weight as a tensor of its own, freed once its node is quantized
        tensor, graph = found(name, graph_stack)
        if tensor is not None and lazy_weights.is_lazy(tensor):
            tensor = numpy_helper.from_array(lazy_weights.array(tensor), name)
        return tensor, graph

    # never the graph's own tensor filled in: protobuf keeps a message's old bytes in the graph's arena until the
    # whole graph goes, so each float weight would stay in memory
    nbits_module.get_initializer = made
    try:
        quantizer.process()  # the lazy float weights, unused now, dropped by its clean-up
    finally:
        nbits_module.get_initializer = found
    return quantizer.model.model


def quantize_graph(proto, config: QuantizeConfig, *, step: bool):
    """``quantize_engine``'s rewrite of one loaded graph, the step graph (``step``) or the heads graph, its weights
    possibly lazy (a streamed export): the graph it writes. ``--quantize int8``'s step graph (a file pass of ONNX
    Runtime's, ``dynamic_int8``) is not one of them."""
    if config.mode in NBITS:
        return nbits_graph(proto, config)
    if config.mode == "int8-channel" or not step:  # the heads of int8, heads-int8 and int8-channel alike
        return rows_int8_graph(proto)
    if config.mode == "heads-int8":  # the step graph stays fp32
        return proto
    raise ValueError(f"--quantize {config.mode}'s step graph is a pass over its file (dynamic_int8)")


def fold_weight_transposes(graph) -> int:
    """Replace each ``MatMul`` weight computed as ``Transpose`` of a 2-D constant (the tied
    ``lm_head`` reading the embedding) with the transposed constant, so quantizers see a constant
    weight; the embedding itself stays for its ``Gather``. Transposes left unused go. Returns how
    many matmuls were rewritten."""
    from onnx import helper

    weights = {t.name: t for t in graph.initializer}
    producer = {out: n for n in graph.node for out in n.output}
    folded: dict[str, str] = {}  # transpose output -> constant name
    count = 0
    for node in graph.node:
        source = producer.get(node.input[1]) if node.op_type == "MatMul" and len(node.input) == 2 else None
        if source is None or source.op_type != "Transpose" or source.input[0] not in weights:
            continue
        weight = weights[source.input[0]]
        perm = next((list(a.ints) for a in source.attribute if a.name == "perm"), [1, 0])
        if len(weight.dims) != 2 or perm != [1, 0]:
            continue
        if source.output[0] not in folded:
            name = f"{weight.name}_transposed"
            dtype = helper.tensor_dtype_to_np_dtype(weight.data_type)
            graph.initializer.append(lazy_weights.derived(name, [weight], lambda w: w.T, weight.dims[::-1], dtype))  # (K, N)
            folded[source.output[0]] = name
        node.input[1] = folded[source.output[0]]
        count += 1
    used = {i for n in graph.node for i in n.input} | {o.name for o in graph.output}
    dead = [n for n in graph.node if n.op_type == "Transpose" and n.output[0] in folded and n.output[0] not in used]
    for n in dead:
        graph.node.remove(n)
    return count


def rows_int8_graph(proto):
    """Int8 weight matmuls with one activation scale per row (per hidden vector or token) in a loaded graph (a
    ``ModelProto``, its lazy weights read one at a time): the graph it writes.

    Weights: symmetric int8, one scale per output column. Activations: each row x scaled by
    max|x| / 127 and offset to uint8 (zero point 128, ONNX Runtime's fast u8 x s8 kernels), so
    the integer product is exact and every output row depends on its own input row only: a
    sequence gets the same logits solo and in any batch. The heads of heads-int8 / int8 and both
    graphs of int8-channel. On the SmolLM2 step graph as fast as ``quantize_dynamic`` with
    per-channel weights (one scale per call for the activations), closer to fp32 and more often
    the same tokens drafted as plain (docs/benchmarks.md, int4 / int8 engines)."""
    from onnx import numpy_helper
    from onnxruntime.quantization.onnx_model import ONNXModel

    model = ONNXModel(proto)
    fold_weight_transposes(model.model.graph)
    model.replace_gemm_with_matmul()  # Linear layers export as Gemm: MatMul (+ Add for a bias)
    graph = model.model.graph
    fuse_matmuls_by_input(graph)
    weights = {t.name: t for t in graph.initializer}
    leading = _leading_dims(graph)
    nodes, quantized, zero_points = [], {}, {}  # zero_points: leading dims -> the uint8 128 tensor of that shape
    for node in graph.node:
        weight = weights.get(node.input[1]) if node.op_type == "MatMul" else None
        if weight is None or len(weight.dims) != 2:
            nodes.append(node)
            continue
        if weight.name not in quantized:
            values, scale = int8_columns(lazy_weights.array(weight))
            made = (numpy_helper.from_array(values, weight.name + "_int8"), numpy_helper.from_array(scale, weight.name + "_int8_scale"))
            graph.initializer.extend(made)  # copies: only the names are kept here (a 7B engine's weights held once)
            quantized[weight.name] = tuple(t.name for t in made)
            del values, scale, made
        rows = leading.get(node.input[0])  # None: not known, so this quantizer makes its own zero point
        made = row_int8_matmul(node, *quantized[weight.name], k=weight.dims[0], zero_point=zero_points.get(rows))
        if rows is not None and rows not in zero_points:
            zero_points[rows] = next(n.output[0] for n in made if n.op_type == "ConstantOfShape")
        nodes += made
    graph.initializer.extend(row_constants())
    del graph.node[:]
    graph.node.extend(nodes)
    model.remove_unused_constant()  # the float weights
    return model.model


def int8_columns(weight):
    """A float weight (K, N) as int8 values (K, N) and one fp32 scale per column (N,)."""
    import numpy as np

    w = weight.astype(np.float32)
    scale = np.maximum(np.abs(w).max(axis=0), np.finfo(np.float32).tiny) / 127.0  # (N,)
    return np.clip(np.rint(w / scale), -127, 127).astype(np.int8), scale.astype(np.float32)


def row_constants() -> list:
    """The scalars every ``row_int8_matmul`` shares."""
    import numpy as np
    from onnx import numpy_helper

    values = {
        "rowq_127": np.float32(127.0),
        # the floor of a row's max|x|: its scale (/ 127) stays a normal float, which runtimes that flush subnormals
        # to zero (OpenVINO) do not turn into 0 / 0 on an all-zero row
        "rowq_tiny": np.float32(np.finfo(np.float32).tiny * 127),
        "rowq_zero_point": np.uint8(128),
        "rowq_last_axis": np.array([-1], dtype=np.int64),
    }
    return [numpy_helper.from_array(np.asarray(v), k) for k, v in values.items()]


def _leading_dims(graph) -> dict[str, tuple]:
    """{tensor: its dims but the last} for the graph's tensors whose every dim is named or known (value_info, inputs):
    row quantizers whose inputs share them share one zero-point tensor (a (..., 1) uint8 128 a row)."""
    out = {}
    for info in [*graph.input, *graph.value_info]:
        dims = info.type.tensor_type.shape.dim
        known = [d.dim_param or d.dim_value for d in dims]
        if len(dims) > 1 and all(known):
            out[info.name] = tuple(known[:-1])
    return out


def row_int8_matmul(node, weight: str, weight_scale: str, k: int, zero_point: str | None = None) -> list:
    """y = x @ W for x (..., K): per-row scale s = max(max|x|, 127 * float32 tiny) / 127, xq = round(x / s) + 128 (uint8),
    y = (xq - 128) @ Wq * s * w_scale, the integer product exact in int32. The rounding is one
    ``QuantizeLinear`` with a block of K (a row): the same bytes as Div, Round, Add 128 and Cast,
    which it replaced, in one pass instead of four (0.2-0.5x their time on 64 rows; 8 rows 0.7-0.8x). Its zero point is
    ``zero_point`` where another quantizer of the same rows made one, else made here."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    x, y = node.input[0], node.output[0]
    prefix = f"{node.name or y}_rowq"

    def n(name: str) -> str:
        return y if name == "y" else f"{prefix}_{name}"

    def op(kind: str, inputs: list[str], name: str, **attrs):
        return helper.make_node(kind, inputs, [n(name)], name=f"{prefix}_{name}", **attrs)

    scale = [
        op("Abs", [x], "abs"),
        op("ReduceMax", [n("abs"), "rowq_last_axis"], "max", keepdims=1),  # (..., 1)
        op("Max", [n("max"), "rowq_tiny"], "max_safe"),
        op("Div", [n("max_safe"), "rowq_127"], "scale"),  # (..., 1): the row's scale
    ]
    if zero_point is None:  # (..., 1) uint8 128, made here (else another quantizer's, of the same rows)
        value = numpy_helper.from_array(np.array([128], dtype=np.uint8))
        scale += [op("Shape", [n("scale")], "scale_shape"), op("ConstantOfShape", [n("scale_shape")], "zero_point", value=value)]
        zero_point = n("zero_point")
    return scale + [
        # one block a row: round(x / s) (ties to even) + 128, in [1, 255]
        op("QuantizeLinear", [x, n("scale"), zero_point], "xq", axis=-1, block_size=k),
        op("MatMulInteger", [n("xq"), weight, "rowq_zero_point"], "acc"),  # (..., N) int32, exact
        op("Cast", [n("acc")], "acc_float", to=TensorProto.FLOAT),
        op("Mul", [n("acc_float"), n("scale")], "row_scaled"),
        op("Mul", [n("row_scaled"), weight_scale], "y"),
    ]


def _replace_graph(path: Path, proto, meta: EngineMeta) -> None:
    """Write ``proto`` over the graph at ``path`` (and its external data), metadata carried over; weights
    that lay in an external data file stay in one (``exporter/external_data.py``)."""
    del proto.metadata_props[:]
    proto.metadata_props.add(key=META_KEY, value=meta.to_json())
    external = has_external_data(path)
    for f in path.parent.glob(path.name + "*"):
        f.unlink()
    save_graph(proto, path, external=external)
