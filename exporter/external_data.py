"""Graph files whose weights live beside them: ``model.onnx`` + ``model.onnx.data``.

A protobuf message is capped at 2 GiB, so an ONNX file cannot hold the weights of a model of
real size (a 1.5B model is 3 GB in bf16). Such weights go to one external data file named after
the graph (``<graph name>.data``, what ONNX Runtime, ``onnx.load`` and TensorRT's parser resolve
beside the graph, so a folder that holds both moves or copies as a whole). ``onnx_export._save``
decides for the graphs it traces (``EXTERNAL_DATA_BYTES``); every pass that loads a graph and
writes it again (``exporter/quantize.py``) keeps the choice the graph came with, through
:func:`save_graph`, and never writes a file over the cap.
"""

from __future__ import annotations

from pathlib import Path

PROTOBUF_LIMIT = 2**31 - 1  # bytes: the largest protobuf message, so the largest .onnx file holding its weights
HEADROOM = 2**26  # bytes kept free under the limit for the nodes, names and metadata beside the weights
INLINE_BYTES = 1024  # tensors this small stay inside the graph (onnx's own default): shapes, scalars


def data_path(path: str | Path) -> Path:
    """``model.onnx`` -> ``model.onnx.data``: the one external data file of a graph."""
    path = Path(path)
    return path.with_name(path.name + ".data")


def weight_bytes(proto) -> int:
    """Bytes of the weights held in the proto (initializers with their data loaded)."""
    return sum(len(t.raw_data) for t in proto.graph.initializer)


def has_external_data(path: str | Path) -> bool:
    """The graph at ``path`` keeps (some of) its weights in an external data file."""
    import onnx
    from onnx.external_data_helper import uses_external_data

    proto = onnx.load(str(path), load_external_data=False)
    return any(uses_external_data(t) for t in proto.graph.initializer)


def save_graph(proto, path: str | Path, *, external: bool) -> None:
    """Write ``proto`` to ``path``, its weights to ``data_path(path)`` when ``external`` or when they
    would not fit one protobuf message; an earlier data file of that name is replaced, not appended to."""
    import onnx

    path = Path(path)
    data = data_path(path)
    data.unlink(missing_ok=True)  # onnx appends to an existing data file
    if external or weight_bytes(proto) > PROTOBUF_LIMIT - HEADROOM:
        onnx.save_model(
            proto, str(path), save_as_external_data=True, all_tensors_to_one_file=True, location=data.name, size_threshold=INLINE_BYTES
        )
    else:
        onnx.save_model(proto, str(path))
