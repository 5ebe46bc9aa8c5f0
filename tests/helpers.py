"""What the tests share beside conftest's fixtures: a prompts file, a medusa-bench run, story openings for
heads to learn on, and a script of scripts/ loaded as a module."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"

# openings the TinyStories model (stories260K) continues: its continuations are what its heads can learn
STORY_STARTS = [
    "Once upon a time",
    "One day, a little girl",
    "Tom and his dog",
    "The sun was shining and",
    "Lily found a",
    "There was a big",
    "Max wanted to",
    "In the park, the kids",
    "Sue had a red",
    "The cat saw a",
    "Mom said to Ben",
    "A bird sat on",
    "The little boat",
    "Anna liked to",
    "The old man had",
    "Tim was sad because",
]


def prompts_file(folder: Path, texts: list[str]) -> Path:
    """``folder/p.jsonl``: one Spec-Bench record (``turns[0]``) per text."""
    path = folder / "p.jsonl"
    path.write_text("\n".join(json.dumps({"turns": [t]}) for t in texts))
    return path


def run_bench(folder: Path, engines: list, texts: list[str], *args: str, new_tokens: int = 24) -> dict:
    """medusa-bench over ``texts`` on ``engines`` with ``args`` more, its report written to ``folder/bench.json``: the report."""
    from medusa_trt.cli.bench import main

    out = folder / "bench.json"
    argv = [a for e in engines for a in ("--engine", str(e))]
    argv += ["--prompts", str(prompts_file(folder, texts)), "--max-new-tokens", str(new_tokens), "--out", str(out), *args]
    assert main(argv) == 0, "medusa-bench failed: its error is in the captured stderr"
    return json.loads(out.read_text())


def script(name: str):
    """scripts/NAME.py as a module (the scripts are checkout tooling, not package modules), with scripts/ on the
    import path while it loads, as when it is run: a script may import the one beside it. Registered in sys.modules
    while it loads, as an imported module is (its dataclasses look their module up there)."""
    sys.path.insert(0, str(SCRIPTS))
    try:
        spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(SCRIPTS))
    return module


def step_feeds(meta, tokens: int, *, tree: bool, seed: int) -> dict:
    """Step graph inputs for a batch of 2 over 9 / 6 cached tokens (random cache): a prompt chunk (causal), or
    with ``tree`` a branching tree of 6 nodes; key slots right after the cache."""
    import numpy as np

    rng = np.random.default_rng(seed)
    batch, past = 2, 9
    mask = np.tri(tokens, dtype=bool)
    if tree:  # node 2 a sibling of node 1, node 3 its child, node 5 below node 4
        mask = np.eye(tokens, dtype=bool)
        for i, parent in enumerate([-1, 0, 0, 2, 1, 4]):
            if parent >= 0:
                mask[i] |= mask[parent]
    depth = mask.sum(axis=1) - 1
    slots = past + tokens  # the view holds the committed slots and the new keys' (key_slots after them)
    shape = (slots, meta.num_layers, batch, meta.num_kv_heads, meta.head_dim)
    return {
        "input_ids": rng.integers(0, meta.vocab_size, (batch, tokens)),
        "position_ids": np.broadcast_to(past + depth, (batch, tokens)).copy(),
        "tree_mask": np.broadcast_to(mask, (batch, tokens, tokens)).copy(),
        "cache_lengths": np.array([past, past - 3]),
        "past_key": rng.standard_normal(shape, dtype=np.float32),
        "past_value": rng.standard_normal(shape, dtype=np.float32),
        "key_slots": np.broadcast_to(past + np.arange(tokens), (batch, tokens)).copy(),
    }


def graph_nodes(graph) -> list:
    """A step graph's nodes and those of the logits gate's then branch (its lm_head: exporter/logits_gate.py)."""
    then = [n for node in graph.node for a in node.attribute if a.name == "then_branch" for n in a.g.node]
    return [*graph.node, *then]


def row_int8_model(k: int, n: int, seed: int):
    """(ONNX model, reference): one float ``x`` (B, T, k) @ a random (k, n) weight, quantized as ``rows_int8_graph``
    quantizes a weight matmul (exporter/quantize.py), and ``reference(x)``, its formula in numpy float32."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    from medusa_trt.exporter.quantize import int8_columns, row_constants, row_int8_matmul

    rng = np.random.default_rng(seed)
    values, scale = int8_columns(rng.standard_normal((k, n)).astype(np.float32))  # (k, n) int8, (n,)
    nodes = row_int8_matmul(helper.make_node("MatMul", ["x", "w"], ["y"], name="mm"), "w_int8", "w_int8_scale", k=k)
    inits = [numpy_helper.from_array(values, "w_int8"), numpy_helper.from_array(scale, "w_int8_scale"), *row_constants()]
    graph = helper.make_graph(
        nodes,
        "row_int8",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "tokens", k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "tokens", n])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])

    def reference(x):
        floor = np.float32(np.finfo(np.float32).tiny * 127)  # a normal scale on an all-zero row
        s = np.maximum(np.abs(x).max(axis=-1, keepdims=True), floor) / np.float32(127)  # (B, T, 1)
        xq = (np.rint(x / s) + np.float32(128)).astype(np.uint8)  # ties to even, as ONNX Round and QuantizeLinear
        acc = (xq.astype(np.int32) - 128) @ values.astype(np.int32)  # (B, T, n) exact
        return acc.astype(np.float32) * s * scale

    return model, reference


def nbits_model(path, k: int, n: int, bits: int, block: int, seed: int, accuracy_level: int = 4):
    """A one-MatMul ONNX model of ``x`` (B, T, k) @ a random (k, n) weight saved at ``path``, its weight quantized to
    ``bits``-bit MatMulNBits blocks as exporter/quantize.py's int4 / int8-block modes quantize one; returns ``path``."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    rng = np.random.default_rng(seed)
    weight = numpy_helper.from_array(rng.standard_normal((k, n)).astype(np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")],
        "nbits",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "tokens", k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "tokens", n])],
        [weight],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    quantizer = MatMulNBitsQuantizer(model, bits=bits, block_size=block, is_symmetric=False, accuracy_level=accuracy_level)
    quantizer.process()
    onnx.save(quantizer.model.model, str(path))
    return path
