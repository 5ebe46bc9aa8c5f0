"""Would ONNX Runtime's ``GroupQueryAttention`` keep a verify step a plain step bit for bit? One layer's attention
on this machine's CPU kernels (not a test).

    .venv/bin/python scripts/gqa_exactness.py --out docs/results/gqa-exactness.json

``com.microsoft.GroupQueryAttention`` is the attention ONNX Runtime's own LLM exports run on a CPU: the step's keys
and values are appended to a cache buffer that its past and present outputs share (written in place: no
per-layer copy), and an ``attention_bias`` input can carry a tree's visibility. Here one node (SmolLM2's 9 query
heads, 3 key/value heads, head dimension 64) scores a tree of ``--tree`` parents in one step over a random cache of
each ``--context`` committed tokens, and then every node again the way plain decoding reaches it: its path one
token a step, each step's key committed before the next. Reported per case: the tree step against a float64
reference (largest difference), and how many nodes' outputs equal their plain-step outputs bit for bit, with
plain steps of one query row (what a plain step is) and padded to two (a masked second row).

What it shows on ONNX Runtime 1.32: the node is right and writes in place, but it appends a step's keys at the
cache length plus the node's index, where key slots cannot move them (``runtime/key_slots.py``), and a one-row
step takes another product path than a wider one. So a tree's nodes are exact only where their index is their
depth, and with one-row plain steps not even a chain is. The exporter keeps its own attention form.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import numpy as np

from medusa_trt.runtime.host_attention import cpu_name

log = logging.getLogger("gqa_exactness")

HQ, HKV, D = 9, 3, 64  # SmolLM2-135M's attention
TREE = (-1, 0, 0, 1, 1, 2, 3, 0, 6)  # parents, node 0 the root: a tree of 9 nodes, depths 0..4


def gqa_model(max_len: int) -> bytes:
    """One GroupQueryAttention node: query / key / value (1, S, H * D), caches (1, Hkv, max_len, D) shared with
    the present outputs, a float bias (1, 1, S, L) for visibility."""
    from onnx import TensorProto, helper

    f, i32 = TensorProto.FLOAT, TensorProto.INT32
    inputs = [
        helper.make_tensor_value_info("query", f, [1, "S", HQ * D]),
        helper.make_tensor_value_info("key", f, [1, "S", HKV * D]),
        helper.make_tensor_value_info("value", f, [1, "S", HKV * D]),
        helper.make_tensor_value_info("past_key", f, [1, HKV, max_len, D]),
        helper.make_tensor_value_info("past_value", f, [1, HKV, max_len, D]),
        helper.make_tensor_value_info("seqlens_k", i32, [1]),
        helper.make_tensor_value_info("total_sequence_length", i32, []),
        helper.make_tensor_value_info("attention_bias", f, [1, 1, "S", "L"]),
    ]
    names = [v.name for v in inputs[:7]] + ["", "", "", "attention_bias"]  # no rotary tables, no position ids
    node = helper.make_node(
        "GroupQueryAttention", names, ["output", "present_key", "present_value"], domain="com.microsoft",
        num_heads=HQ, kv_num_heads=HKV, scale=D**-0.5,
    )  # fmt: skip
    outputs = [helper.make_tensor_value_info(n, f, None) for n in node.output]
    graph = helper.make_graph([node], "gqa", inputs, outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
    return model.SerializeToString()


class Layer:
    """The node in a session; ``run`` appends the step's keys to the caller's cache arrays in place."""

    def __init__(self, max_len: int, threads: int):
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        self.ort = ort
        self.session = ort.InferenceSession(gqa_model(max_len), options, ["CPUExecutionProvider"])

    def run(self, cache_k, cache_v, q, k, v, length: int, bias) -> np.ndarray:
        """q (1, S, Hq * D), k / v (1, S, Hkv * D), bias (1, 1, S, length + S) -> output (1, S, Hq * D)."""
        total = length + q.shape[1]
        io = self.session.io_binding()
        keys, values = (self.ort.OrtValue.ortvalue_from_numpy(c) for c in (cache_k, cache_v))  # cache_k's own memory
        for name, array in (("query", q), ("key", k), ("value", v), ("attention_bias", bias)):
            io.bind_cpu_input(name, np.ascontiguousarray(array, dtype=np.float32))
        io.bind_cpu_input("seqlens_k", np.array([total - 1], np.int32))
        io.bind_cpu_input("total_sequence_length", np.array(total, np.int32))
        io.bind_ortvalue_input("past_key", keys)
        io.bind_ortvalue_input("past_value", values)
        io.bind_output("output", "cpu")
        io.bind_ortvalue_output("present_key", keys)  # the same buffer: appended in place
        io.bind_ortvalue_output("present_value", values)
        self.session.run_with_iobinding(io)
        return io.get_outputs()[0].numpy()


def visibility(parents, length: int) -> np.ndarray:
    """(S, length + S) bool: the cache, then each node's ancestors and itself."""
    s = len(parents)
    seen = np.zeros((s, length + s), dtype=bool)
    seen[:, :length] = True
    for i, p in enumerate(parents):
        seen[i, length + i] = True
        while p >= 0:
            seen[i, length + p] = True
            p = parents[p]
    return seen


def reference(q, cache_k, cache_v, seen) -> np.ndarray:
    """float64 attention of q (S, Hq, D) over the first seen.shape[1] cache slots -> (S, Hq, D)."""
    total = seen.shape[1]
    out = np.zeros(q.shape, np.float64)
    for h in range(HQ):
        kv = h // (HQ // HKV)
        scores = q[:, h].astype(np.float64) @ cache_k[0, kv, :total].T.astype(np.float64) * D**-0.5
        scores = np.where(seen, scores, -np.inf)
        p = np.exp(scores - scores.max(axis=1, keepdims=True))
        out[:, h] = (p / p.sum(axis=1, keepdims=True)) @ cache_v[0, kv, :total]
    return out


def case(layer: Layer, parents, length: int, max_len: int, rng) -> dict:
    s = len(parents)
    cache_k, cache_v = (np.zeros((1, HKV, max_len, D), np.float32) for _ in range(2))
    for c in (cache_k, cache_v):
        c[:, :, :length] = rng.standard_normal((1, HKV, length, D), dtype=np.float32)
    q = rng.standard_normal((1, s, HQ * D), dtype=np.float32)
    k, v = (rng.standard_normal((1, s, HKV * D), dtype=np.float32) for _ in range(2))
    seen = visibility(parents, length)
    tree_k, tree_v = cache_k.copy(), cache_v.copy()
    tree = layer.run(tree_k, tree_v, q, k, v, length, np.where(seen, 0.0, -np.inf)[None, None])[0]  # (S, Hq * D)
    written = bool(np.array_equal(tree_k[0, :, length : length + s], k[0].reshape(s, HKV, D).transpose(1, 0, 2)))
    error = float(np.abs(tree.reshape(s, HQ, D) - reference(q[0].reshape(s, HQ, D), tree_k, tree_v, seen)).max())
    equal = {}
    for rows in (1, 2):  # a plain step as it is, and padded with a masked second query row
        same = 0
        for i in range(s):
            path = [i]
            while parents[path[-1]] >= 0:
                path.append(parents[path[-1]])
            plain_k, plain_v = cache_k.copy(), cache_v.copy()
            for depth, node in enumerate(reversed(path)):
                at = length + depth
                bias = np.zeros((1, 1, rows, at + rows), np.float32)
                bias[0, 0, 0, at + 1 :] = -np.inf  # row 0 never sees the padding row's key
                pick = [node] * rows
                out = layer.run(plain_k, plain_v, q[:, pick], k[:, pick], v[:, pick], at, bias)[0, 0]
            same += int(np.array_equal(out, tree[i]))
        equal[rows] = same
    return {"context": length, "nodes": s, "appended_in_place": written, "max_abs_error_vs_float64": error,
            "equal_one_row_plain": equal[1], "equal_two_row_plain": equal[2]}  # fmt: skip


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--context", type=int, action="append", help="committed tokens before the step (repeat; default 0, 5, 37, 300)")
    p.add_argument("--tree", default=",".join(map(str, TREE)), help="the tree's parents, comma-separated, -1 for the root")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, help="also write the figures as JSON here")
    args = p.parse_args(argv)
    try:
        parents = [int(x) for x in args.tree.split(",")]
    except ValueError:
        p.error(f"--tree {args.tree!r}: comma-separated integers (a parent index each, -1 for the root)")
    if parents[0] != -1 or any(not -1 <= q < i for i, q in enumerate(parents)) or parents.count(-1) != 1:
        p.error(f"--tree {args.tree}: node 0 is the root (-1) and every other node's parent comes before it")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    import onnxruntime

    contexts = args.context or [0, 5, 37, 300]
    chain = list(range(-1, len(parents) - 1))
    max_len = max(contexts) + len(parents) + 2
    layer = Layer(max_len, args.threads)
    rng = np.random.default_rng(0)
    rows = [
        {"layout": name, **case(layer, tree, c, max_len, rng)} for c in contexts for name, tree in (("chain", chain), ("tree", parents))
    ]
    log.info("%s, ONNX Runtime %s, %d threads; GroupQueryAttention, %d query / %d key-value heads, head dim %d",
             cpu_name(), onnxruntime.__version__, args.threads, HQ, HKV, D)  # fmt: skip
    log.info("\n| layout | cached | in place | max error vs float64 | = one-row plain steps | = two-row plain steps |")
    log.info("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        n = r["nodes"]
        log.info(f"| {r['layout']} | {r['context']} | {r['appended_in_place']} | {r['max_abs_error_vs_float64']:.1e} | "
                 f"{r['equal_one_row_plain']}/{n} | {r['equal_two_row_plain']}/{n} |")  # fmt: skip
    if args.out:
        report = {"cpu": cpu_name(), "onnxruntime": onnxruntime.__version__, "threads": args.threads, "tree": parents, "cases": rows}
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
