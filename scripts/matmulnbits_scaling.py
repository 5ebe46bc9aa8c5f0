"""How ONNX Runtime's CPU ``MatMulNBits`` (the int4 engine's weight matmuls) scales with the
tokens in a step, against a plain fp32 ``MatMul`` of the same shape: one node, one of SmolLM2's
MLP shapes (576 x 1536), M = 1..16 rows (a verify step's tree tokens), each accuracy level,
asymmetric and symmetric 4-bit blocks of 32.

    .venv/bin/python scripts/matmulnbits_scaling.py --out docs/matmulnbits-scaling.json

Why int4 drafting does not pay on this CPU (issue 16): at one row int4 is several times
cheaper than fp32, but from 8 rows on it costs as much as or more than fp32, so a tree's extra
tokens cost far more on the int4 engine than on the fp32 one.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from pathlib import Path

import numpy as np

ROWS = (1, 2, 4, 8, 16)
LEVELS = (1, 2, 3, 4)  # MatMulNBits accuracy_level: fp32, fp16, bf16, int8 compute


def _graph(weight: np.ndarray):
    from onnx import TensorProto, helper, numpy_helper

    k, n = weight.shape
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["y"])],
        "matmul",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["M", n])],
        [numpy_helper.from_array(weight, "W")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _us_per_call(session, rows: int, k: int, repeats: int, calls: int) -> float:
    x = np.random.default_rng(rows).standard_normal((rows, k), dtype=np.float32)  # (M, K)
    for _ in range(calls // 4):
        session.run(None, {"x": x})
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            session.run(None, {"x": x})
        times.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(times)


def main() -> None:
    import onnxruntime as ort
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--k", type=int, default=576)
    p.add_argument("--n", type=int, default=1536)
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--calls", type=int, default=100)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    logging.getLogger("onnxruntime").setLevel(logging.WARNING)
    options = ort.SessionOptions()
    options.intra_op_num_threads = args.threads
    weight = np.random.default_rng(0).standard_normal((args.k, args.n), dtype=np.float32) * 0.05  # (K, N)
    variants = {"fp32 MatMul": _graph(weight)}
    for symmetric in (False, True):
        for level in LEVELS:
            quantizer = MatMulNBitsQuantizer(
                _graph(weight),
                bits=4,
                block_size=args.block_size,
                is_symmetric=symmetric,
                accuracy_level=level,
                op_types_to_quantize=("MatMul",),
            )
            quantizer.process()
            variants[f"int4 {'symmetric' if symmetric else 'asymmetric'}, accuracy level {level}"] = quantizer.model.model
    report = {
        "k": args.k,
        "n": args.n,
        "block_size": args.block_size,
        "threads": args.threads,
        "onnxruntime": ort.__version__,
        "rows": list(ROWS),
        "us_per_call": {},
        "vs_one_row": {},
        "vs_fp32_same_rows": {},
    }
    for name, model in variants.items():
        session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        report["us_per_call"][name] = [round(_us_per_call(session, m, args.k, args.repeats, args.calls), 1) for m in ROWS]
    fp32 = report["us_per_call"]["fp32 MatMul"]
    for name, us in report["us_per_call"].items():
        report["vs_one_row"][name] = [round(u / us[0], 2) for u in us]
        report["vs_fp32_same_rows"][name] = [round(u / f, 2) for u, f in zip(us, fp32)]
        print(
            f"{name:40s} "
            + " ".join(f"{u:7.1f}" for u in us)
            + "  us at M = "
            + "/".join(map(str, ROWS))
            + "   vs fp32: "
            + " ".join(f"{r:.2f}" for r in report["vs_fp32_same_rows"][name])
        )
    if args.out:
        tmp = args.out.with_suffix(".tmp")
        tmp.write_text(json.dumps(report, indent=2) + "\n")
        tmp.replace(args.out)


if __name__ == "__main__":
    main()
