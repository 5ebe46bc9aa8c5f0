"""What one cache input a layer would save: engines' step graphs as exported (one stacked slot-major cache, a
``Gather`` a layer) against a copy rewritten to take one cache input a layer, in one run (not a test).

    .venv/bin/python scripts/cache_layout_ab.py --engine build/smollm2-135m-medusa --engine build/smollm2-int4 \\
        --out docs/results/cache-layout-ab.json

The step contract binds the cache as one tensor, ``past_key`` (S, layers, B, Hkv, D): the first S slots of the
runtime's buffer, no copy. The graph then copies each layer's slice out with a ``Gather`` (60 a step in
SmolLM2). The rewritten copy (``per_layer``: a graph in ``--work``, beside links to the engine's weights) takes
``past_key.L`` / ``past_value.L`` (S, B, Hkv, D) instead, which a runtime whose buffer is layer-major
(layers, S_max, B, Hkv, D) binds in place as well, and drops the ``Gather`` s; nothing else changes, so its
outputs must be the original's bit for bit (checked on the first step of each case; exit 1 if not). Each graph
runs in a plain ONNX Runtime session with the step session's options (``onnx_backend``; inputs bound in place),
batch 1, each ``--context`` of committed slots of random cache, chained steps of each ``--tokens`` size, the two graphs
alternating round by round, each round a run of steps on one graph (its first untimed: the other session's
threads spin a while after its last step, on the same cores); median and best ms and per_layer / stacked. The
runtime's buffers, the commit, every backend and the exporter are untouched: this measures the step-graph half
of the change only.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from step_graph_report import cpu_name, write_report

CACHE = ("past_key", "past_value")
MARK = ".cache-layout-ab"  # in each folder this script makes: the only folders it writes into
BURST = 5  # timed steps in a row on one graph, after one untimed: a decoding loop's steps follow each other


def claim(folder: Path, engine: Path) -> None:
    """Make ``folder`` this script's, or find it so: never the engine's own folder, never a folder it did not make
    (it replaces files there)."""
    if folder.resolve() == engine.resolve():
        raise SystemExit(f"cache_layout_ab: --work puts the rewritten graph in the engine's own folder {engine}: pass another --work")
    if folder.exists() and not (folder / MARK).is_file():
        raise SystemExit(f"cache_layout_ab: {folder} exists and this script did not make it: pass another --work")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / MARK).touch()


def per_layer_graph(step: Path, out: Path) -> int:
    """Write ``step`` rewritten to one cache input a layer at ``out`` (its weights: links beside it); the layers."""
    import onnx
    from onnx import helper, numpy_helper

    from medusa_trt.exporter.logits_gate import node_reads

    model = onnx.load(str(step), load_external_data=False)
    graph = model.graph
    consts = {i.name: i for i in graph.initializer}
    inputs = {i.name: i for i in graph.input}
    layers = inputs[CACHE[0]].type.tensor_type.shape.dim[1].dim_value
    rename, keep = {}, []
    for node in graph.node:
        if node.op_type == "Gather" and node.input[0] in CACHE:
            axis = next(a.i for a in node.attribute if a.name == "axis")
            index = int(numpy_helper.to_array(consts[node.input[1]]))
            if axis != 1:
                raise SystemExit(f"cache_layout_ab: {node.name} gathers the cache on axis {axis}, not the layer axis 1")
            rename[node.output[0]] = f"{node.input[0]}.{index}"
            continue
        if node.op_type == "Shape" and node.input[0] in CACHE:  # (S, layers, B, ...) -> (S, B, ...): dims past 1 move down
            attrs = {a.name: a.i for a in node.attribute}
            start, end = attrs.get("start", 0), attrs.get("end", 5)
            shift = lambda d: d - 1 if d >= 2 else d  # noqa: E731
            if start <= 1 < end:
                raise SystemExit(f"cache_layout_ab: {node.name} reads the layer axis of the cache")
            node.input[0] = f"{node.input[0]}.0"
            del node.attribute[:]
            node.attribute.extend([helper.make_attribute("start", shift(start)), helper.make_attribute("end", shift(end))])
        elif any(i in CACHE for i in node.input):
            raise SystemExit(f"cache_layout_ab: {node.name} ({node.op_type}) reads the stacked cache")
        keep.append(node)
    for node in keep:
        for i, name in enumerate(node.input):
            node.input[i] = rename.get(name, name)
    del graph.node[:]
    graph.node.extend(keep)
    read = {name for node in keep for name in node_reads(node)}  # the logits gate's branch reads the lm_head's weight
    unused = [init for init in graph.initializer if init.name not in read]
    for init in unused:  # the Gathers' layer indices
        graph.initializer.remove(init)
    new_inputs = []
    for i in graph.input:
        if i.name not in CACHE:
            new_inputs.append(i)
            continue
        dims = [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim]
        per = [dims[0], *dims[2:]]  # (S, B, Hkv, D)
        new_inputs += [helper.make_tensor_value_info(f"{i.name}.{layer}", i.type.tensor_type.elem_type, per) for layer in range(layers)]
    del graph.input[:]
    graph.input.extend(new_inputs)
    claim(out.parent, step.parent)
    for data in step.parent.glob(step.name + ".data"):  # the weights, shared: a hard link beside the new graph
        link = out.parent / data.name  # (ONNX Runtime refuses external data that a symbolic link leads out of the folder)
        link.unlink(missing_ok=True)  # a folder this script made: a link of an earlier run may be another engine's
        try:
            os.link(data, link)
        except OSError:  # another file system: a copy
            shutil.copyfile(data, link)
    onnx.save(model, str(out))
    return layers


def session(path: Path, threads: int):
    import onnxruntime as ort

    from medusa_trt.runtime.backends.onnx_backend import STEP_DISABLED_OPTIMIZERS, session_options

    return ort.InferenceSession(
        str(path), session_options(threads, spin=True), ["CPUExecutionProvider"], disabled_optimizers=STEP_DISABLED_OPTIMIZERS
    )


def key(context: int, tokens: int) -> str:
    """A case's name in the JSON report."""
    return f"{context} cached, {tokens} tokens"


def bind(sess, feed: dict):
    """The step's inputs bound in place and its outputs left to ONNX Runtime on the CPU, as the backend binds them."""
    from medusa_trt.runtime.backends.onnx_backend import with_gate

    io = sess.io_binding()
    for name, value in with_gate(sess, feed).items():  # a gated graph's logits computed, as a decoding step's are
        io.bind_cpu_input(name, value)
    for out in sess.get_outputs():
        io.bind_output(out.name, "cpu")
    return io


def feeds(meta, layers: int, context: int, tokens: int, rng) -> tuple[dict, dict]:
    """The same step for both graphs: stacked (S, layers, 1, Hkv, D) and per-layer (S, 1, Hkv, D) contiguous views."""
    slots = context + tokens  # the bound view holds the committed slots and the new keys' (key_slots after them)
    shape = (slots, layers, 1, meta.num_kv_heads, meta.head_dim)
    cache = {name: rng.standard_normal(shape, dtype=np.float32) for name in CACHE}
    common = {
        "input_ids": (np.arange(tokens, dtype=np.int64) * 131 + 7)[None] % meta.vocab_size,
        "position_ids": (context + np.arange(tokens))[None],
        "tree_mask": np.tri(tokens, dtype=bool)[None],
        "cache_lengths": np.array([context]),
        "key_slots": (context + np.arange(tokens))[None],
    }
    stacked = common | cache
    per_layer = common | {f"{n}.{layer}": np.ascontiguousarray(cache[n][:, layer]) for n in CACHE for layer in range(layers)}
    return stacked, per_layer


def parse_ab(description: str, argv, *, rounds: int, extra=()) -> argparse.Namespace:
    """The command line the step A/B scripts share (engines, contexts, step sizes, rounds, threads, --out) and
    ``extra`` (name, keywords) arguments; an engine that does not exist is a one-line error, exit 2."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--engine", type=Path, action="append", required=True, help="an engine folder (repeat)")
    for name, keywords in extra:
        p.add_argument(name, **keywords)
    p.add_argument("--context", type=int, action="append", help="committed tokens before a step (repeat; default 300 and 900)")
    p.add_argument("--tokens", type=int, action="append", help="tokens a step scores (repeat; default 1 and 8)")
    p.add_argument("--rounds", type=int, default=rounds)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, help="also write the figures as JSON here")
    args = p.parse_args(argv)
    for engine in args.engine:
        if not engine.exists():
            p.error(f"{engine} does not exist: pass an engine folder medusa-export wrote")
    return args


def main(argv=None) -> int:
    work = ("--work", dict(type=Path, default=Path("build/cache-layout-ab"), help="where the rewritten graphs go"))
    args = parse_ab(__doc__.split("\n\n")[0], argv, rounds=60, extra=[work])
    from medusa_trt.runtime.engine import EngineFiles, read_meta

    cases = [(c, t) for c in args.context or (300, 900) for t in args.tokens or (1, 8)]  # (context, tokens) of a step
    load_start = os.getloadavg()
    rng = np.random.default_rng(0)
    report = {}
    for engine in args.engine:
        step = EngineFiles.locate(engine).onnx.step
        meta = read_meta(step)
        rewritten = args.work / step.parent.name / "model.onnx"  # the engine folder's name
        layers = per_layer_graph(step, rewritten)
        sessions = {"stacked": session(step, args.threads), "per_layer": session(rewritten, args.threads)}
        calls = {(c, t): feeds(meta, layers, c, t, rng) for c, t in cases}
        bound = {(name, case): bind(sessions[name], calls[case][0 if name == "stacked" else 1]) for name in sessions for case in cases}
        same = True
        for t in cases:  # warm-up, compared
            outs = []
            for name in sessions:
                sessions[name].run_with_iobinding(bound[name, t])
                outs.append(bound[name, t].copy_outputs_to_cpu())
            same &= all(np.array_equal(x, y) for x, y in zip(*outs))
        times = {name: {case: [] for case in cases} for name in sessions}
        for round_ in range(args.rounds):
            for t in cases:
                order = ("stacked", "per_layer") if round_ % 2 == 0 else ("per_layer", "stacked")
                for name in order:  # a run of steps each: the other session's pool threads stop spinning first
                    for i in range(BURST + 1):
                        start = time.perf_counter()
                        sessions[name].run_with_iobinding(bound[name, t])
                        if i:
                            times[name][t].append(time.perf_counter() - start)
        report[str(engine)] = {
            "same_outputs": bool(same),
            "median_ms": {n: {key(*c): statistics.median(v) * 1e3 for c, v in ts.items()} for n, ts in times.items()},
            "best_ms": {n: {key(*c): min(v) * 1e3 for c, v in ts.items()} for n, ts in times.items()},
        }
    load_end = os.getloadavg()
    load = f"load average {load_start[0]:.2f} at the start, {load_end[0]:.2f} at the end"
    print(f"\n{cpu_name()}, {args.threads} threads; {args.rounds} rounds of {BURST} steps; {load}\n")
    print("| engine | cached | tokens | stacked ms (median / best) | per-layer ms (median / best) | per-layer / stacked (median) | same |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for engine, r in report.items():
        for c, t in cases:
            s, q = (r["median_ms"][n][key(c, t)] for n in ("stacked", "per_layer"))
            sb, qb = (r["best_ms"][n][key(c, t)] for n in ("stacked", "per_layer"))
            same = "yes" if r["same_outputs"] else "NO"
            print(f"| {Path(engine).name} | {c} | {t} | {s:.2f} / {sb:.2f} | {q:.2f} / {qb:.2f} | {q / s:.3f} | {same} |")
    if args.out:
        write_report(args.out, args.threads, (load_start[0], load_end[0]), argv, engines=report)
    return 0 if all(r["same_outputs"] for r in report.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
