"""Weights made when they are written: the graph passes of an export whose fp32 weights do not fit in memory.

A 7B model's fp32 weights are 27 GB; its int8 engine is 7 GB. ``exporter/streamed.py`` traces such a model without
its weights and gives each large initializer a *recipe* instead of bytes: a function of no arguments that returns
the array (read one tensor from the checkpoint, say). In a graph a lazy weight is a ``TensorProto`` whose external
data location is ``LAZY`` and whose offset is its recipe's index in the ``LazyWeights`` the export holds.

The passes read weights through :func:`array` and make new ones through :func:`derived` (``lean.fuse_matmuls_by_input``,
``quantize.fold_weight_transposes``, ``quantize.rows_int8_graph``): a weight derived from a lazy one is lazy too (a
fused Q / K / V weight is the recipe "these three side by side"), one derived from eager weights is eager, as it
always was. Quantized weights are made at once (int8 is a quarter of fp32), so memory holds the final weights once
plus the group being made. :func:`save` writes every weight into the graph's data file one tensor at a time, each
recipe run once, in the graph's order. With no ``LazyWeights`` active the passes see eager weights only: an export
of a model that fits is what it always was.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

LAZY = "medusa-lazy"  # external data location of a weight whose bytes its recipe makes
ALIGN = 4096  # each weight in the data file starts on a page (a reader may map it)

_ACTIVE: contextvars.ContextVar[LazyWeights | None] = contextvars.ContextVar("medusa_lazy_weights", default=None)


@dataclass(frozen=True)
class Recipe:
    shape: tuple[int, ...]
    dtype: np.dtype
    make: Callable[[], np.ndarray]


class LazyWeights:
    """The recipes of one export's lazy weights; active (what :func:`array` reads) inside ``with``."""

    def __init__(self):
        self._recipes: list[Recipe] = []
        self._token = None

    def __enter__(self) -> LazyWeights:
        self._token = _ACTIVE.set(self)
        return self

    def __exit__(self, *exc) -> None:
        _ACTIVE.reset(self._token)

    def add(self, shape: Sequence[int], dtype, make: Callable[[], np.ndarray]) -> int:
        """A recipe's index (its tensors' external data offset)."""
        self._recipes.append(Recipe(tuple(int(d) for d in shape), np.dtype(dtype), make))
        return len(self._recipes) - 1

    def proto(self, name: str, shape: Sequence[int], dtype, make: Callable[[], np.ndarray]):
        """A lazy ``TensorProto`` named ``name`` that ``make`` fills when it is written."""
        from onnx import TensorProto, helper

        index = self.add(shape, dtype, make)
        t = TensorProto(name=name, dims=list(shape), data_type=helper.np_dtype_to_tensor_dtype(np.dtype(dtype)))
        t.data_location = TensorProto.EXTERNAL
        for key, value in (("location", LAZY), ("offset", str(index)), ("length", str(self.nbytes(index)))):
            t.external_data.add(key=key, value=value)
        return t

    def ir_tensor(self, name: str, shape: Sequence[int], dtype, make: Callable[[], np.ndarray]):
        """The same as an onnx_ir tensor: serialised, it is the lazy ``TensorProto`` (nothing is read)."""
        import onnx_ir as ir

        index = self.add(shape, dtype, make)
        return ir.ExternalTensor(LAZY, index, self.nbytes(index), ir.DataType.from_numpy(np.dtype(dtype)), shape=ir.Shape(shape), name=name)

    def recipe(self, index: int) -> Recipe:
        """The recipe at ``index`` (a lazy tensor's offset)."""
        return self._recipes[index]

    def nbytes(self, index: int) -> int:
        recipe = self._recipes[index]
        return int(np.prod(recipe.shape, dtype=np.int64)) * recipe.dtype.itemsize

    def make(self, tensor) -> np.ndarray:
        """The array of the lazy ``tensor``, made now (checked against its recipe's shape and dtype)."""
        recipe = self._recipes[_offset(tensor)]
        out = np.asarray(recipe.make())
        if out.shape != recipe.shape or out.dtype != recipe.dtype:
            raise ValueError(f"{tensor.name}: its recipe made {out.dtype}{list(out.shape)}, not {recipe.dtype}{list(recipe.shape)}")
        return out


def active() -> LazyWeights | None:
    return _ACTIVE.get()


def _offset(tensor) -> int:
    return int(next(e.value for e in tensor.external_data if e.key == "offset"))


def is_lazy(tensor) -> bool:
    """``tensor`` (a ``TensorProto``) is made by a recipe when it is written."""
    from onnx import TensorProto

    return tensor.data_location == TensorProto.EXTERNAL and any(e.key == "location" and e.value == LAZY for e in tensor.external_data)


def array(tensor) -> np.ndarray:
    """The weight's values: its recipe's where it is lazy (the active ``LazyWeights``), else its own."""
    from onnx import numpy_helper

    if not is_lazy(tensor):
        return numpy_helper.to_array(tensor)
    store = active()
    if store is None:
        raise RuntimeError(f"{tensor.name} is a lazy weight, read outside the export that made it")
    return store.make(tensor)


def derived(name: str, sources: Sequence, make: Callable[..., np.ndarray], shape: Sequence[int], dtype=np.float32):
    """The ``TensorProto`` ``name`` = ``make(*arrays of sources)``, of ``shape`` and ``dtype``: lazy where a source
    is (made when written), else made now."""
    from onnx import numpy_helper

    store = active()
    if store is not None and any(is_lazy(s) for s in sources):
        return store.proto(name, shape, dtype, lambda: make(*(array(s) for s in sources)))
    return numpy_helper.from_array(np.ascontiguousarray(make(*(array(s) for s in sources)), dtype=dtype), name)


def save(proto, path: str | Path, *, inline_bytes: int = 1024) -> int:
    """Write ``proto`` to ``path`` and its weights over ``inline_bytes`` (lazy ones made now, one at a time) to
    ``external_data.data_path(path)``; each written weight's bytes leave memory. Returns the data file's size."""
    import onnx
    from onnx import TensorProto

    from medusa_trt.exporter.external_data import data_path

    path = Path(path)
    data = data_path(path)
    with open(data, "wb") as f:
        for t in _initializers(proto.graph):
            if is_lazy(t):
                raw = array(t).tobytes()
            elif t.data_location != TensorProto.EXTERNAL and t.HasField("raw_data") and len(t.raw_data) > inline_bytes:
                raw = t.raw_data
            else:
                continue
            at = -f.tell() % ALIGN + f.tell()
            f.seek(at)
            f.write(raw)
            t.ClearField("raw_data")
            del t.external_data[:]
            t.data_location = TensorProto.EXTERNAL
            for key, value in (("location", data.name), ("offset", str(at)), ("length", str(len(raw)))):
                t.external_data.add(key=key, value=value)
            del raw
        size = f.tell()
    onnx.save_model(proto, str(path))
    return size


def _initializers(graph):
    """The graph's initializers, then those of its subgraphs (an If's branches)."""
    yield from graph.initializer
    for node in graph.node:
        for a in node.attribute:
            for g in [a.g] if a.HasField("g") else a.graphs:
                yield from _initializers(g)
