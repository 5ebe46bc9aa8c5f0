"""What every command shares: logging set-up and turning user errors into one line."""

from __future__ import annotations

import logging
import sys

from medusa_trt.runtime.errors import MedusaError


# every typed error a user can cause derives from MedusaError; OS errors on their files too
USER_ERRORS = (MedusaError, FileNotFoundError, PermissionError, IsADirectoryError)


def setup_logging(verbose: bool) -> None:
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if not verbose:
        for noisy in ("transformers", "torch.onnx", "onnxscript"):
            logging.getLogger(noisy).setLevel(logging.ERROR)


def fail(prog: str, exc: BaseException) -> int:
    """One line on stderr, exit status 2: the message already says what to do."""
    message = " ".join(str(exc).split()) or type(exc).__name__
    print(f"{prog}: error: {message}", file=sys.stderr)
    return 2


def load_model(model: str, heads: str | None, untrained_heads: int | None, head_layer: int | None, device: str):
    """A MedusaModel from the command line's --model / --heads / --untrained-heads / --head-layer."""
    from medusa_trt.exporter import load_medusa

    return load_medusa(model, heads, untrained_heads=untrained_heads, head_layer=head_layer, device=device)
