"""``medusa-heads``: write Medusa heads (and a tree) in the formats other runtimes read.

    medusa-heads convert --heads DIR --to fasterdecoding --out DIR [--tree FILE_OR_PRESET] [--model M]

Writes the FasterDecoding/Medusa layout (``config.json`` + ``medusa_lm_head.safetensors``, and
``medusa_choices.json`` with ``--tree``): TensorRT-LLM's ``--medusa_model_dir`` and
``--medusa_choices``, TGI and FasterDecoding read it (see exporter/interop.py). Heads that
share the base model's lm_head need ``--model`` (its weight is written into every head). Bad
input prints one ``medusa-heads convert: error: ...`` line and exits 2 with nothing written.
"""

from __future__ import annotations

import json
import sys

from medusa_trt.cli.common import USER_ERRORS, VERBOSE_HELP, Parser, entry, fail, setup_logging
from medusa_trt.runtime.errors import MedusaError

DTYPES = ("float32", "float16", "bfloat16")


def build_parser() -> Parser:
    from medusa_trt.exporter.interop import FORMATS

    p = Parser(prog="medusa-heads", description="Medusa heads in the formats other runtimes read.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    c = sub.add_parser(
        "convert",
        help="write heads (and a tree) in another format",
        description="Write Medusa heads in the FasterDecoding/Medusa layout (TensorRT-LLM, TGI, FasterDecoding).",
    )
    c.add_argument("--heads", required=True, help="heads folder (ours, or FasterDecoding)")
    c.add_argument("--to", choices=FORMATS, default=FORMATS[0], help="format to write (default: %(default)s)")
    c.add_argument("--out", required=True, help="folder to write: new, empty, or an earlier export (replaced whole)")
    c.add_argument("--tree", help="also write this tree (JSON file, preset, chain-N) as medusa_choices.json")
    c.add_argument(
        "--model",
        help="the base model (smollm2-135m, a folder, a .gguf file, or a cached Hub id): checks the "
        "heads against it; needed for heads that share its lm_head",
    )
    c.add_argument(
        "--base-model",
        help="base_model_name_or_path written to config.json (default: a Hub id given as --model, else what the heads recorded)",
    )
    c.add_argument("--dtype", choices=DTYPES, help="cast the weights (default: keep them as they are)")
    c.add_argument("-v", "--verbose", action="store_true", help=VERBOSE_HELP)
    return p


def convert(args) -> tuple:
    try:
        import torch

        from medusa_trt.exporter.interop import convert_heads
    except ImportError as exc:  # the lean install: ONNX Runtime only
        raise MedusaError(
            f"medusa-heads needs torch and safetensors ({exc.name} is not installed): pip install 'medusa-trt[export]'"
        ) from exc

    dtype = getattr(torch, args.dtype) if args.dtype else None
    return convert_heads(args.heads, args.out, to=args.to, model=args.model, tree=args.tree, base_model=args.base_model, dtype=dtype)


@entry("medusa-heads")
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.verbose)
    prog = f"medusa-heads {args.command}"
    try:
        out = convert(args)
    except USER_ERRORS as exc:
        return fail(prog, exc)
    config = json.loads((out / "config.json").read_text())
    files = sorted(p.name for p in out.iterdir())
    print(
        f"wrote {out} ({', '.join(files)}): {config['medusa_num_heads']} heads, {config['medusa_num_layers']} layers, "
        f"base model {config['base_model_name_or_path'] or '(none recorded)'}"
    )
    print(
        f"TensorRT-LLM: convert_checkpoint.py --medusa_model_dir {out} --num_medusa_heads {config['medusa_num_heads']}"
        + (f'; run.py --medusa_choices="$(cat {out}/medusa_choices.json)"' if "medusa_choices.json" in files else "")
    )
    sys.stdout.flush()  # a closed pipe (| head) surfaces here, where entry() turns it into a quiet exit
    return 0


if __name__ == "__main__":
    sys.exit(main())
