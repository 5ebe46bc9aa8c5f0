"""Where a step's time goes: ONNX Runtime's own per-node trace of engines' steps, by kind of op, against the
weights' memory floor, in one run on one machine (not a test).

    .venv/bin/python scripts/step_profile.py --engine build/smollm2-135m-medusa --engine build/smollm2-int4 \\
        --out docs/results/step-profile.json

For each engine (its step graph on the ONNX Runtime backend the loop uses, batch 1) it commits
``--context`` tokens, then:

  * times ``--rounds`` steps of each ``--tokens`` size (chained tokens) with the plain backend, median and best;
  * runs as many again with ONNX Runtime's profiler on (a second session: the trace costs time of its own) and
    splits the traced step into kinds of op: weight matmuls (the matmul kernels: ``MatMul``, ``MatMulNBits``,
    ``MatMulInteger``, ...), cache and layout copies (the per-layer cache ``Gather``, ``Transpose``, ``Reshape``,
    ``ScatterElements``, ``Split``, ...), attention, the rest (norms, rotary, activations, the argmax / top-k, and
    int8-channel's per-row activation quantizers, built of elementwise ops) and the time between kernels (the
    executor: the traced run's length less its kernels). The trace has a cost of its own in every node, some of
    it inside the kernels' times: it is printed (a traced step less a plain one, a node), and the shares of
    graphs of many small nodes are read with it in mind;
  * the one-token step against its floor: the bytes of the weights the step reads whole (initializers read
    by any op but a row lookup, ``Gather``: the embedding table reads one row a token) over the memory
    bandwidth ``--threads`` threads read here (``step_graph_report.bandwidth``).

The CPU's name and the load average at the start and end are printed: on a shared machine, compare
engines within one run, as ratios.
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from step_graph_report import bandwidth, cpu_name, prefill, write_report

KINDS = {  # op type -> kind of work; anything not named is "other"
    **dict.fromkeys(
        ("MatMul", "Gemm", "MatMulNBits", "MatMulInteger", "MatMulIntegerToFloat", "DynamicQuantizeLinear", "DynamicQuantizeMatMul"),
        "weight matmuls",
    ),
    **dict.fromkeys(
        ("Gather", "Transpose", "Reshape", "ScatterElements", "ScatterND", "Split", "Concat", "Unsqueeze", "Squeeze", "Expand", "Slice"),
        "cache and layout copies",
    ),
    **dict.fromkeys(("Attention", "MultiHeadAttention", "GroupQueryAttention", "Softmax"), "attention"),
}
ORDER = ("weight matmuls", "cache and layout copies", "attention", "other", "between kernels")


def streamed_bytes(step: Path) -> int:
    """Bytes of the initializers a step reads whole: every initializer some op other than ``Gather`` reads (a
    ``Gather`` of a table, the embedding, reads one row a token). Sizes from the external-data records or the
    tensor itself; nothing is loaded."""
    import onnx
    from onnx import helper, numpy_helper

    from medusa_trt.exporter.logits_gate import node_reads

    model = onnx.load(str(step), load_external_data=False)
    readers = collections.defaultdict(set)
    for node in model.graph.node:
        for name in node_reads(node):  # an If's branches too: the logits gate's lm_head (exporter/logits_gate.py)
            readers[name].add(node.op_type)
    total = 0
    for init in model.graph.initializer:
        if not readers[init.name] - {"Gather"}:
            continue
        record = {e.key: e.value for e in init.external_data}
        if "length" in record:
            total += int(record["length"])
        elif init.data_location != onnx.TensorProto.EXTERNAL:
            total += numpy_helper.to_array(init).nbytes
        else:  # external without a length: its element count times the element size
            total += int(np.prod(init.dims)) * np.dtype(helper.tensor_dtype_to_np_dtype(init.data_type)).itemsize
    return total


def chain(t: int, context: int, vocab: int) -> tuple:
    ids = (np.arange(t, dtype=np.int64) * 131 + 7)[None] % vocab  # (1, T)
    return ids, (context + np.arange(t))[None], np.tri(t, dtype=bool)[None], np.array([context])


def open_engine(path: Path, threads: int, context: int, profile: str | None = None):
    from medusa_trt.runtime.backends.onnx_backend import OnnxBackend

    backend = OnnxBackend(path, max_batch=1, threads=threads, profile=profile)
    prefill(backend, (np.arange(context, dtype=np.int64) * 7919 + 11) % backend.meta.vocab_size)
    return backend


def timed(backend, sizes, context: int, rounds: int) -> dict[int, list[float]]:
    """{T: [seconds]} of ``rounds`` chain steps of each size, after one warm-up step each."""
    calls = {t: chain(t, context, backend.meta.vocab_size) for t in sizes}
    for call in calls.values():
        backend.step(*call)
    times = {t: [] for t in sizes}
    for _ in range(rounds):
        for t in sizes:
            start = time.perf_counter()
            backend.step(*calls[t])
            times[t].append(time.perf_counter() - start)
    return times


def traced(path: Path, threads: int, context: int, rounds: int, tokens: int, work: Path) -> dict:
    """ONNX Runtime's trace of ``rounds`` steps of ``tokens`` tokens: {kind: ms a step}, {op type: ms a step} and
    the nodes a step runs."""
    backend = open_engine(path, threads, context, profile=str(work / "trace"))
    call = chain(tokens, context, backend.meta.vocab_size)
    backend.step(*call)  # warm-up, traced too: skipped below by time
    for _ in range(rounds):
        backend.step(*call)
    trace = json.loads(Path(backend.session.end_profiling()).read_text())
    runs = sorted((e for e in trace if e.get("name") == "model_run"), key=lambda e: e["ts"])[-rounds:]
    first = runs[0]["ts"]
    kernels = [e for e in trace if e.get("cat") == "Node" and e["name"].endswith("_kernel_time") and e["ts"] >= first]
    by_op, count = collections.Counter(), collections.Counter()
    for e in kernels:
        by_op[e["args"]["op_name"]] += e["dur"]
        count[KINDS.get(e["args"]["op_name"], "other")] += 1
    by_kind = collections.Counter()
    for op, us in by_op.items():
        by_kind[KINDS.get(op, "other")] += us
    by_kind["between kernels"] = max(0, sum(r["dur"] for r in runs) - sum(by_op.values()))
    per = len(runs) * 1e3  # us summed over the runs -> ms a step
    return {
        "run_ms": sum(r["dur"] for r in runs) / per,
        "kinds_ms": {k: by_kind[k] / per for k in ORDER},
        "ops_ms": {op: us / per for op, us in by_op.most_common()},
        "nodes": round(len(kernels) / len(runs)),
        "kind_nodes": {k: round(count[k] / len(runs)) for k in ORDER if k != "between kernels"},
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", type=Path, action="append", required=True, help="an engine folder or step graph (repeat)")
    p.add_argument("--context", type=int, default=300, help="committed tokens before each step")
    p.add_argument("--tokens", type=int, action="append", help="tokens a timed step scores (repeat; default 1 and 8)")
    p.add_argument("--rounds", type=int, default=30, help="steps of each size, timed and then traced")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--bandwidth", type=float, help="GB/s for the floor, measured elsewhere (default: measured here)")
    p.add_argument("--out", type=Path, help="also write the figures as JSON here")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    sizes = tuple(args.tokens or (1, 8))
    for engine in args.engine:
        if not engine.exists():
            p.error(f"{engine} does not exist: pass an engine folder medusa-export wrote")

    load_start = os.getloadavg()
    read = args.bandwidth * 1e9 if args.bandwidth else bandwidth(args.threads)
    report = {}
    with tempfile.TemporaryDirectory(prefix="step-profile-") as tmp:
        for engine in args.engine:
            from medusa_trt.runtime.engine import EngineFiles

            step = EngineFiles.locate(engine).onnx.step
            backend = open_engine(engine, args.threads, args.context)
            times = timed(backend, sizes, args.context, args.rounds)
            del backend
            work = Path(tmp) / engine.name
            work.mkdir()
            trace = {t: traced(engine, args.threads, args.context, args.rounds, t, work) for t in sizes}
            floor, first = streamed_bytes(step), trace[sizes[0]]
            report[str(engine)] = {
                "median_ms": {t: statistics.median(v) * 1e3 for t, v in times.items()},
                "best_ms": {t: min(v) * 1e3 for t, v in times.items()},
                "trace": trace,
                # what the trace adds a node: a traced step less a plain one, over its nodes (the smallest size)
                "trace_us_per_node": (first["run_ms"] - statistics.median(times[sizes[0]]) * 1e3) * 1e3 / first["nodes"],
                "streamed_bytes": floor,
                "floor_ms": floor / read * 1e3,
            }
    load_end = os.getloadavg()

    load = f"load average {load_start[0]:.2f} at the start, {load_end[0]:.2f} at the end"
    print(f"\n{cpu_name()}, {args.threads} threads, {os.cpu_count()} CPUs; {load}")
    print(f"memory bandwidth read here: {read / 1e9:.1f} GB/s; {args.context} cached tokens; {args.rounds} steps a size\n")
    head = "| engine | tokens | step ms (median / best) | traced ms | " + " | ".join(ORDER) + " | nodes |"
    print(head + "\n|" + " --- |" * (head.count("|") - 1))
    for engine, r in report.items():
        for t in sizes:
            tr = r["trace"][t]
            nodes = {**tr["kind_nodes"], "between kernels": tr["nodes"]}
            shares = " | ".join(f"{tr['kinds_ms'][k]:.1f} ({100 * tr['kinds_ms'][k] / tr['run_ms']:.0f} %, {nodes[k]})" for k in ORDER)
            step = f"{r['median_ms'][t]:.1f} / {r['best_ms'][t]:.1f}"
            print(f"| {Path(engine).name} | {t} | {step} | {tr['run_ms']:.1f} | {shares} | {tr['nodes']} |")
    print("\n(ms a traced step (share, nodes); the trace's own cost a node, in the kinds and between them:", end="")
    print(",".join(f" {Path(e).name} {r['trace_us_per_node']:.1f} us" for e, r in report.items()) + ")\n")
    for engine, r in report.items():
        if 1 in sizes:
            print(
                f"{Path(engine).name}: floor {r['streamed_bytes'] / 1e6:.0f} MB streamed a step = {r['floor_ms']:.1f} ms; "
                f"one-token step {r['median_ms'][1] / r['floor_ms']:.2f}x it (median), {r['best_ms'][1] / r['floor_ms']:.2f}x (best)"
            )
    if args.out:
        write_report(
            args.out, args.threads, (load_start[0], load_end[0]), argv, context=args.context, bytes_per_second=read, engines=report
        )  # whole or not at all
    return 0


if __name__ == "__main__":
    sys.exit(main())
