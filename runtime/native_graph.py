"""Reading a step graph's weights: the ONNX graph indexed by producer and consumer, its weight matmuls read as
``Linear``s (fp32 MatMul or Gemm, int8-channel's row-quantized chain, MatMulNBits' blocks), and the error a graph native
cannot run raises. ``native_weights`` (the layers) and ``native_experts`` (routed experts) walk graphs with these."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from medusa_trt.runtime.errors import EngineError


@dataclass(frozen=True)
class Linear:
    """One weight matmul, (K, N): fp32; int8 columns with per-row uint8 activations (an int8-channel engine's
    ``rows_int8_graph`` form: a row's scale is max(max |x|, tiny) / divisor, its zero point 128); or MatMulNBits' 4- or
    8-bit blocks at accuracy level 4 (an int4 or int8-block engine's: weight (value - zero) x scale per block of
    ``block`` inputs and output; activations quantized to int8 a block at a time)."""

    weight: np.ndarray  # (K, N) float32, or int8; nbits: MatMulNBits' bytes as stored, (N, blocks, block x bits / 8)
    scale: np.ndarray | None = None  # int8: (N) float32 column scales; nbits: (blocks, N) float32 block scales
    tiny: float = 0.0  # int8: the floor of a row's max |x|
    divisor: float = 127.0  # int8
    zero: np.ndarray | None = None  # nbits: (blocks, N) uint8 zero points
    block: int = 0  # nbits: inputs a block
    bits: int = 0  # nbits: 4 or 8 (0: not nbits)
    bias: np.ndarray | None = None  # (N): a Gemm's bias, read only where its reader asks (``linear_at(bias=True)``)
    k: int = 0  # nbits: K (its bytes hold whole blocks, the last one past K unread)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.k, self.weight.shape[0]) if self.bits else self.weight.shape

    @classmethod
    def nbits_of(cls, values: np.ndarray, scale: np.ndarray, zero: np.ndarray, block: int, bits: int) -> Linear:
        """An nbits linear of (K, N) values below 2**bits, (blocks, N) scales and zero points, its bytes as MatMulNBits
        stores them: a 4-bit byte holds inputs 2j (low nibble) and 2j + 1 of one output (tests, and hand-made linears)."""
        k, n = values.shape
        blocks = scale.shape[0]
        rows = np.zeros((n, blocks * block), dtype=np.uint8)
        rows[:, :k] = values.T
        if bits == 4:
            rows = rows[:, 0::2] | (rows[:, 1::2] << 4)
        return cls(rows.reshape(n, blocks, -1), scale, zero=zero, block=block, bits=bits, k=k)

    def outputs(self, index) -> Linear:
        """Outputs ``index`` (a slice, or positions in their order) as a linear of their own: exact, each output's sums
        are its own."""
        take = lambda x: None if x is None else np.ascontiguousarray(x[..., index])  # noqa: E731
        weight = np.ascontiguousarray(self.weight[index]) if self.bits else take(self.weight)
        return Linear(weight, take(self.scale), self.tiny, self.divisor, take(self.zero), self.block, self.bits, k=self.k)

    @property
    def int8(self) -> bool:
        return self.weight.dtype == np.int8 and not self.bits


class NativeCannotRun(EngineError):
    """The native step does not run this engine (a graph other than the pattern, weights it cannot read here); ``what``
    says why in a few words. Where native was an engine folder's choice, not the user's, the runtime falls back to
    onnxruntime on it (``runtime/backends/__init__.py``)."""

    def __init__(self, message: str, what: str | None = None):
        super().__init__(message)
        self.what = what or message


def read_tensor(tensor, step: Path, to_array) -> np.ndarray:
    """One initializer's values: from the external data file beside ``step`` (its bytes read into a new array, no
    more), else from the graph (``to_array``). A graph's weights are so read one at a time, never the whole file at
    once as ``onnx.load`` reads it: a 7B engine's loading holds its weights once, not twice."""
    from onnx import TensorProto, helper

    if tensor.data_location != TensorProto.EXTERNAL:
        return to_array(tensor)
    fields = {e.key: e.value for e in tensor.external_data}
    location, dims = fields.get("location", ""), tuple(tensor.dims)
    file = step.parent / location
    if not location or Path(location).name != location or not file.is_file():
        raise malformed(step, f"weight {tensor.name} lies in {location!r}, not a data file beside the graph")
    dtype = np.dtype(helper.tensor_dtype_to_np_dtype(tensor.data_type))
    count = int(np.prod(dims, dtype=np.int64))
    offset, length = int(fields.get("offset", 0)), int(fields.get("length", count * dtype.itemsize))
    if length != count * dtype.itemsize or offset < 0 or offset + length > file.stat().st_size:
        raise malformed(step, f"weight {tensor.name} ({length} bytes at {offset}) does not fit {dtype}{list(dims)} in {location}")
    return np.fromfile(file, dtype=dtype, count=count, offset=offset).reshape(dims)


def unsupported(path: Path, what: str) -> NativeCannotRun:
    return NativeCannotRun(f"backend native cannot run {path}: {what}; use backend onnxruntime for this engine", what)


def malformed(path: Path, what: str) -> NativeCannotRun:
    return NativeCannotRun(
        f"backend native cannot run {path}: {what}; the file is not one medusa-export writes: export the engine again", what
    )


class Graph:
    """The step graph's nodes, producers, consumers and initializers (arrays read on demand)."""

    def __init__(self, path: Path):
        try:
            import onnx
            from onnx import numpy_helper
        except ImportError as exc:
            raise NativeCannotRun(
                f"backend native reads the engine's weights with the onnx package ({exc}): pip install 'medusa-trt[native]'",
                "no onnx package to read its weights with",
            ) from exc

        self.path = path
        model = onnx.load(str(path), load_external_data=False)  # each external weight read when asked (read_tensor)
        self.init = {t.name: t for t in model.graph.initializer}
        self.to_array = lambda t: read_tensor(t, path, numpy_helper.to_array)
        self.outputs = {o.name for o in model.graph.output}
        self._index(list(model.graph.node))

    def branch(self, nodes) -> Graph:
        """The same graph's initializers over a subgraph's nodes (an If branch)."""
        sub = object.__new__(Graph)
        sub.path, sub.init, sub.to_array, sub.outputs = self.path, self.init, self.to_array, set()
        sub._index(list(nodes))
        sub.producer = self.producer | sub.producer  # the branch reads outer values (a tied lm_head's Transpose)
        return sub

    def _index(self, nodes) -> None:
        self.nodes = nodes
        self.consumers: dict[str, list] = {}
        self.producer = {}
        for node in self.nodes:
            for name in node.input:
                self.consumers.setdefault(name, []).append(node)
            for name in node.output:
                self.producer[name] = node

    def array(self, name: str) -> np.ndarray:
        if name not in self.init:
            raise unsupported(self.path, f"{name} is computed, not a weight")
        return self.to_array(self.init[name])

    def only(self, tensor: str, op: str):
        """The one node that reads ``tensor``, which must be an ``op``."""
        readers = [n for n in self.consumers.get(tensor, []) if n.op_type != "Identity"]
        if len(readers) != 1 or readers[0].op_type != op:
            found = ", ".join(n.op_type for n in readers) or "nothing"
            raise unsupported(self.path, f"{tensor} is read by {found} where the pattern has one {op}")
        return readers[0]

    def weight_of(self, node) -> np.ndarray:
        """A MatMul's (K, N) weight: its second input, an initializer or the Transpose of one (a tied lm_head)."""
        name = node.input[1]
        source = self.producer.get(name)
        if source is not None and source.op_type == "Transpose" and list(attr(source, "perm", [])) == [1, 0]:
            return np.ascontiguousarray(self.array(source.input[0]).T)
        return self.array(name)  # its dtype as stored: check_weights refuses all but float32 and int8

    def nbits(self, node) -> Linear:
        return read_nbits(self, node)

    def slice_args(self, node) -> tuple:
        """A Slice's constant starts, ends, axes and steps, each a list (None where the input is absent)."""
        given = list(node.input[1:5]) + [""] * (5 - len(node.input))
        return tuple(self.array(a).reshape(-1).tolist() if a else None for a in given)

    def scalar(self, name: str) -> float:
        return float(self.array(name).reshape(-1)[0])

    def linear(self, x: str, *, beside: tuple[str, ...] = ()) -> tuple[Linear, str]:
        """The one weight matmul reading ``x`` and its output (``linear_at``). ``beside``: ops that may read ``x`` too
        (a residual's Add)."""
        skip = ("Identity", *beside)
        readers = sorted((n for n in self.consumers.get(x, []) if n.op_type not in skip), key=lambda n: n.op_type)
        kinds = [n.op_type for n in readers]
        if kinds not in (["MatMul"], ["Gemm"], ["MatMulNBits"], ["Abs", "QuantizeLinear"]):
            raise unsupported(self.path, f"{x} is read by {', '.join(kinds) or 'nothing'} where the pattern has a weight matmul")
        return self.linear_at(x, readers[0])

    def linears(self, x: str, *, bias: bool = False) -> list[tuple[Linear, str]]:
        """Every weight matmul reading ``x`` (several linears of one input: a router and a shared expert's), in graph
        order: each MatMul, Gemm and MatMulNBits, and each int8 chain (its Abs; its QuantizeLinear is found from it).
        ``bias``: as ``linear_at``'s."""
        readers = [n for n in self.consumers.get(x, []) if n.op_type in ("MatMul", "Gemm", "MatMulNBits", "Abs")]
        return [self.linear_at(x, n, bias=bias) for n in readers]

    def linear_at(self, x: str, node, *, bias: bool = False) -> tuple[Linear, str]:
        """The weight matmul ``node`` starts on ``x``, and its output: a MatMul; a Gemm x @ B (or B.T) without a bias
        (with one where ``bias``: in the Linear's ``bias``); a MatMulNBits; or (``node`` its Abs) the int8 row quantizer
        chain of exporter/quantize.py (Abs, ReduceMax, Max, Div; QuantizeLinear; MatMulInteger; Cast; Mul; Mul)."""
        if node.op_type in ("MatMul", "Gemm"):
            added = None
            if node.op_type == "Gemm":
                form = tuple(attr(node, a, d) for a, d in (("transA", 0), ("alpha", 1.0), ("beta", 1.0)))
                has_bias = len(node.input) > 2 and bool(node.input[2])
                if form != (0, 1.0, 1.0) or (has_bias and not (bias and node.input[2] in self.init)) or node.input[0] != x:
                    raise unsupported(self.path, f"{x} is read by a Gemm other than x @ W (a bias, a scale or a transposed x)")
                weight = self.array(node.input[1])
                weight = np.ascontiguousarray(weight.T) if attr(node, "transB", 0) and weight.ndim == 2 else weight
                added = np.ascontiguousarray(self.array(node.input[2]).reshape(-1), dtype=np.float32) if has_bias else None
            else:
                weight = self.weight_of(node)
            if weight.ndim != 2:
                raise unsupported(self.path, f"{x} is multiplied by a {weight.ndim}-D weight {weight.shape}, not a (K, N) matrix")
            return Linear(weight, bias=added), node.output[0]
        if node.op_type == "MatMulNBits":
            return self.nbits(node), node.output[0]
        if node.op_type != "Abs":
            raise unsupported(self.path, f"{x} is read by {node.op_type} where the pattern has a weight matmul")
        top = self.only(self.only(node.output[0], "ReduceMax").output[0], "Max")
        div = self.only(top.output[0], "Div")
        quants = [n for n in self.consumers.get(x, []) if n.op_type == "QuantizeLinear" and n.input[1] == div.output[0]]
        if len(quants) != 1 or list(self.array(self.producer[top.input[0]].input[1]).reshape(-1)) != [-1]:
            raise unsupported(self.path, f"{x}'s quantizer is not one scale a row")
        quant = quants[0]
        zero = self.producer.get(quant.input[2]) if len(quant.input) > 2 else None
        zero_value = attr(zero, "value") if zero is not None and zero.op_type == "ConstantOfShape" else None
        matmul = self.only(quant.output[0], "MatMulInteger")
        if zero_value is None or int(self.to_array(zero_value).reshape(-1)[0]) != 128 or self.scalar(matmul.input[2]) != 128:
            raise unsupported(self.path, f"{x}'s quantizer has another zero point than 128")
        weight = self.array(matmul.input[1])
        cast = self.only(matmul.output[0], "Cast")
        row = self.only(cast.output[0], "Mul")
        column = self.only(row.output[0], "Mul")
        if weight.dtype != np.int8 or weight.ndim != 2 or div.output[0] not in row.input:
            raise unsupported(self.path, f"{x}'s int8 matmul is not int8 columns times row-scaled rows")
        scale = self.array(column.input[1]).reshape(-1)
        return Linear(weight, scale, self.scalar(top.input[1]), self.scalar(div.input[1])), column.output[0]


def biased(g: Graph, out: str) -> tuple[np.ndarray | None, str]:
    """The bias a linear's output ``out`` is added to (one Add of it and one initializer) and the sum; (None, out)
    where ``out`` is read otherwise."""
    readers = [n for n in g.consumers.get(out, []) if n.op_type != "Identity"]
    if len(readers) != 1 or readers[0].op_type != "Add":
        return None, out
    constant = [x for x in readers[0].input if x != out]
    if len(constant) != 1 or constant[0] not in g.init:
        return None, out
    return np.ascontiguousarray(g.array(constant[0]).reshape(-1), dtype=np.float32), readers[0].output[0]


def read_nbits(g: Graph, node) -> Linear:
    """A MatMulNBits node's weight: B (N, blocks, block x bits / 8) uint8 kept as stored (two 4-bit values a byte, low
    nibble first: a 7B int4 engine opens holding its weights' bytes once, not unpacked to a byte a value), block scales
    and zero points as (blocks, N); zero points packed the same way (absent: the middle of the range). Accuracy level 4
    only (int8 activations, what the C kernel computes)."""
    k, n, bits, block = (int(attr(node, a, 0)) for a in ("K", "N", "bits", "block_size"))
    level = int(attr(node, "accuracy_level", 0))
    if bits not in (4, 8) or block < 16 or block & (block - 1):
        raise unsupported(g.path, f"a MatMulNBits of {bits} bits in blocks of {block}")
    if level != 4:
        raise unsupported(g.path, f"MatMulNBits at accuracy level {level} (native computes level 4: int8 activations)")
    if len(node.input) > 4 and any(node.input[4:]):
        raise unsupported(g.path, "a MatMulNBits with group indices or a bias")
    blocks = -(-k // block) if k > 0 else 0
    packed = g.array(node.input[1])
    scale = g.array(node.input[2]).astype(np.float32, copy=False).reshape(-1)
    if packed.dtype != np.uint8 or packed.shape != (n, blocks, block * bits // 8) or scale.size != n * blocks or k <= 0:
        raise malformed(g.path, f"a MatMulNBits of K {k}, N {n} with data {packed.dtype} {packed.shape} and {scale.size} scales")
    if len(node.input) > 3 and node.input[3]:
        zp = g.array(node.input[3])
        if zp.dtype != np.uint8:
            raise unsupported(g.path, f"MatMulNBits zero points of {zp.dtype} (native reads packed uint8)")
        zp = zp.reshape(n, -1)
        if bits == 4:
            zp = np.stack([zp & 0x0F, zp >> 4], axis=-1).reshape(n, -1)
        if zp.shape[1] < blocks:
            raise malformed(g.path, f"MatMulNBits zero points {zp.shape} for {blocks} blocks")
        zero = zp[:, :blocks]
    else:
        zero = np.full((n, blocks), 1 << (bits - 1), dtype=np.uint8)
    scale, zero = np.ascontiguousarray(scale.reshape(n, blocks).T), np.ascontiguousarray(zero.T)
    return Linear(np.ascontiguousarray(packed), scale, zero=zero, block=block, bits=bits, k=k)


def attr(node, name: str, default=None):
    from onnx import helper

    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


def gate_of(g: Graph, step: Path, layer: int, gate: str) -> tuple[str, str]:
    """The MLP gate's activation (``native_step.ACTIVATIONS``) and its output: SiLU as Sigmoid and Mul, or Gelu."""
    readers = {n.op_type: n for n in g.consumers.get(gate, []) if n.op_type != "Identity"}
    if sorted(readers) == ["Gelu"]:
        approximate = attr(readers["Gelu"], "approximate", b"none")
        approximate = approximate.decode() if isinstance(approximate, bytes) else approximate
        if approximate not in ("none", "tanh"):
            raise unsupported(step, f"layer {layer}'s MLP gate is GELU of approximation {approximate!r}")
        return ("gelu_tanh" if approximate == "tanh" else "gelu"), readers["Gelu"].output[0]
    sig, silu = readers.get("Sigmoid"), readers.get("Mul")
    if sorted(readers) != ["Mul", "Sigmoid"] or sig.output[0] not in silu.input or len(g.consumers[gate]) != 2:
        raise unsupported(step, f"layer {layer}'s MLP gate is {sorted(readers) or 'nothing'}, not SiLU or GELU")
    return "silu", silu.output[0]
