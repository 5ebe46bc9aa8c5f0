"""Read an ONNX file's ``metadata_props`` from the protobuf wire format, without the onnx package.

ONNX Runtime would load every weight to answer; this skips the other top-level fields (the
graph) by their length, so it reads a few bytes of even a multi-GB model.
"""

from __future__ import annotations

import io
import os
from pathlib import Path

from medusa_trt.runtime.errors import EngineError

_MODEL_METADATA_PROPS = 14  # ModelProto.metadata_props: repeated StringStringEntryProto {key = 1, value = 2}


def onnx_metadata_props(path: Path) -> dict[str, str]:
    """ModelProto.metadata_props of an .onnx file; the other top-level fields (the graph) are
    skipped by their length, so this reads a few bytes of even a multi-GB model."""
    props = {}
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        while f.tell() < size:
            field, wire = divmod(_varint(f, path), 8)
            if wire == 2:
                length = _varint(f, path)
                if field == _MODEL_METADATA_PROPS:
                    entry = f.read(length)
                    if len(entry) < length:
                        raise EngineError(f"{path} is truncated ({size} bytes): copy it again or export again")
                    props.update([_string_entry(entry, path)])
                else:
                    f.seek(length, os.SEEK_CUR)
            elif wire == 0:
                _varint(f, path)
            elif wire in (1, 5):  # fixed 64 / 32 bits
                f.seek(8 if wire == 1 else 4, os.SEEK_CUR)
            else:
                raise EngineError(f"{path} is not an ONNX file (protobuf wire type {wire}): pass the .onnx medusa-export wrote")
        if f.tell() > size:
            raise EngineError(f"{path} is truncated ({size} bytes): copy it again or export again")
    return props


def _varint(f, path: Path) -> int:
    value = shift = 0
    while True:
        byte = f.read(1)
        if not byte or shift > 63:
            raise EngineError(f"{path} is truncated or not an ONNX file: copy it again or export again")
        value |= (byte[0] & 0x7F) << shift
        shift += 7
        if not byte[0] & 0x80:
            return value


def _string_entry(data: bytes, path: Path) -> tuple[str, str]:
    """A StringStringEntryProto's (key, value)."""
    buf, fields = io.BytesIO(data), {1: b"", 2: b""}
    while buf.tell() < len(data):
        field, wire = divmod(_varint(buf, path), 8)
        if wire != 2:
            raise EngineError(f"{path}: malformed metadata entry: export the engine again")
        fields[field] = buf.read(_varint(buf, path))
    return fields[1].decode("utf-8", "replace"), fields[2].decode("utf-8", "replace")
