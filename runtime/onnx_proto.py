"""A small hand-written ONNX protobuf writer: one-op graphs built at run time without the ``onnx``
package (the ONNX Runtime backend's cache ops, ``ort_buffers``; the key-slot lane probe, ``key_slots``).
Field numbers are ONNX's (onnx.proto); each function names the ones it writes."""

from __future__ import annotations

import numpy as np

IR_VERSION, OPSET = 8, 17  # ONNX Runtime 1.20+ runs both
FLOAT, INT64, FLOAT16 = 1, 7, 10  # TensorProto.DataType
ELEM_TYPES = {np.dtype(np.float32): FLOAT, np.dtype(np.float16): FLOAT16, np.dtype(np.int64): INT64}


def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1  # int64 fields: two's complement
    out = bytearray()
    while True:
        low, n = n & 0x7F, n >> 7
        out.append(low | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _int(field: int, n: int) -> bytes:  # wire type 0
    return _varint(field << 3) + _varint(n)


def _msg(field: int, payload: bytes | str) -> bytes:  # wire type 2: bytes, string, sub-message
    data = payload.encode() if isinstance(payload, str) else payload
    return _varint(field << 3 | 2) + _varint(len(data)) + data


def tensor(name: str, elem: int, dims: tuple) -> bytes:
    """ValueInfoProto: name=1, type=2 (TypeProto.tensor_type=1: elem_type=1, shape=2 (dim=1: dim_value=1 | dim_param=2))."""
    shape = b"".join(_msg(1, _int(1, d) if isinstance(d, int) else _msg(2, d)) for d in dims)
    return _msg(1, name) + _msg(2, _msg(1, _int(1, elem) + _msg(2, shape)))


def node(op: str, inputs: tuple, outputs: tuple, **ints) -> bytes:
    """NodeProto: input=1, output=2, op_type=4, attribute=5 (AttributeProto: name=1, i=3, ints=8, type=20 (INT=2, INTS=7));
    an attribute given as a tuple is INTS."""

    def attr(k, v) -> bytes:
        if isinstance(v, tuple):
            return _msg(1, k) + b"".join(_int(8, x) for x in v) + _int(20, 7)
        return _msg(1, k) + _int(3, v) + _int(20, 2)

    attrs = b"".join(_msg(5, attr(k, v)) for k, v in ints.items())
    return b"".join(_msg(1, i) for i in inputs) + b"".join(_msg(2, o) for o in outputs) + _msg(4, op) + attrs


def model(
    name: str, nodes: list[bytes], inputs: list[bytes], outputs: list[bytes], *, opset: int = OPSET, ir_version: int = IR_VERSION
) -> bytes:
    """ModelProto: ir_version=1, producer_name=2, graph=7 (node=1, name=2, input=11, output=12), opset_import=8 (version=2)."""
    graph = (
        b"".join(_msg(1, n) for n in nodes) + _msg(2, name) + b"".join(_msg(11, i) for i in inputs) + b"".join(_msg(12, o) for o in outputs)
    )
    return _int(1, ir_version) + _msg(2, "medusa-trt") + _msg(7, graph) + _msg(8, _int(2, opset))
