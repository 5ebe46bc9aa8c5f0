"""What attention on the host, over the cache where it lies, does to a step: each engine's step graph against
its segmented form (``runtime/step_segments.py``: the graph cut at its attentions, ``runtime/host_attention.py``
between the pieces) and against the segments alone (the attention skipped: what the cut costs and what the
kernel may spend), in one run (not a test).

    .venv/bin/python scripts/segmented_step_ab.py --engine build/smollm2-135m-medusa --engine build/smollm2-int4 \\
        --out docs/segmented-step-ab.json

All sessions of the run share one ONNX Runtime pool of ``--threads`` (a pool a segment would spin against the
others). Inputs as ``cache_layout_ab.py`` makes them (batch 1, random cache, a chain of ``--tokens``); the graph
and the segmented form are compared on the first step of each case (the largest logit difference: the kernel
adds in another order than ONNX Runtime's ``Attention``, and int8 activations round it on). Rounds alternate the
forms, each a burst of steps after one untimed. The runtime is untouched: this measures the lever only.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from cache_layout_ab import BURST, bind, feeds, key, parse_ab
from step_graph_report import cpu_name, write_report


class Skipped:
    """A kernel that attends to nothing (its output stays zeros): the segments' own cost."""

    def scratch(self, length: int, tokens: int) -> int:
        return 0

    def raw(self, *args) -> int:
        return 0


def main(argv=None) -> int:
    args = parse_ab(__doc__.split("\n\n")[0], argv, rounds=30)
    import onnx
    import onnxruntime as ort

    from medusa_trt.runtime.backends.onnx_backend import STEP_DISABLED_OPTIMIZERS, session_options
    from medusa_trt.runtime.engine import META_KEY, EngineFiles, EngineMeta
    from medusa_trt.runtime.host_attention import HostAttention
    from medusa_trt.runtime.step_segments import SegmentedStep, share_threads

    share_threads(args.threads)  # before any session of this process
    kernel = HostAttention()
    cases = [(c, t) for c in args.context or (300, 900) for t in args.tokens or (1, 8)]
    load_start = os.getloadavg()
    rng = np.random.default_rng(0)
    report = {}
    for engine in args.engine:
        step = EngineFiles.locate(engine).onnx.step
        proto = onnx.load(str(step), load_external_data=False)
        meta = EngineMeta.from_json(next(m.value for m in proto.metadata_props if m.key == META_KEY), source=str(step))
        options = session_options(None, spin=True)
        options.use_per_session_threads = False
        graph = ort.InferenceSession(str(step), options, ["CPUExecutionProvider"], disabled_optimizers=STEP_DISABLED_OPTIMIZERS)
        forms = {
            "graph": graph,
            "host": SegmentedStep(step, kernel, disabled_optimizers=STEP_DISABLED_OPTIMIZERS),
            "segments_only": SegmentedStep(step, Skipped(), disabled_optimizers=STEP_DISABLED_OPTIMIZERS),
        }
        calls = {case: feeds(meta, meta.num_layers, *case, rng)[0] for case in cases}
        bound = {case: bind(graph, calls[case]) for case in cases}
        names = [o.name for o in graph.get_outputs()]

        def step_once(form: str, case, graph=graph, bound=bound, forms=forms, calls=calls):
            if form == "graph":
                graph.run_with_iobinding(bound[case])
                return None
            return forms[form].run(calls[case])[0]

        diffs = {}
        for case in cases:
            graph.run_with_iobinding(bound[case])
            want = dict(zip(names, bound[case].copy_outputs_to_cpu()))
            got = step_once("host", case)
            diffs[key(*case)] = {
                "max_logit_diff": float(np.abs(got["logits"] - want["logits"]).max()),
                "same_next_ids": bool(np.array_equal(got["next_ids"], want["next_ids"])),
            }
        times = {form: {case: [] for case in cases} for form in forms}
        for round_ in range(args.rounds):
            for case in cases:
                order = list(forms) if round_ % 2 == 0 else list(forms)[::-1]
                for form in order:
                    for i in range(BURST + 1):
                        start = time.perf_counter()
                        step_once(form, case)
                        if i:
                            times[form][case].append(time.perf_counter() - start)
        report[str(engine)] = {
            "median_ms": {f: {key(*c): statistics.median(v) * 1e3 for c, v in ts.items()} for f, ts in times.items()},
            "best_ms": {f: {key(*c): min(v) * 1e3 for c, v in ts.items()} for f, ts in times.items()},
            "against_graph": diffs,
        }
    load_end = os.getloadavg()
    print(f"\n{cpu_name()}, {args.threads} threads (one shared pool); {args.rounds} rounds of {BURST} steps; "
          f"load average {load_start[0]:.2f} at the start, {load_end[0]:.2f} at the end\n")  # fmt: skip
    print("| engine | cached | tokens | graph ms | host attention ms (/ graph) | segments only ms (/ graph) | max logit diff |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for engine, r in report.items():
        for c, t in cases:
            g, h, s = (r["median_ms"][f][key(c, t)] for f in ("graph", "host", "segments_only"))
            d = r["against_graph"][key(c, t)]["max_logit_diff"]
            print(f"| {Path(engine).name} | {c} | {t} | {g:.2f} | {h:.2f} ({h / g:.2f}) | {s:.2f} ({s / g:.2f}) | {d:.2g} |")
    if args.out:
        write_report(args.out, args.threads, (load_start[0], load_end[0]), argv, engines=report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
