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
    from medusa_trt.exporter import HeadsConfig, MedusaModel, init_heads, load_base_model, load_heads

    base = load_base_model(model, device=device)
    cfg = base.model.config
    loaded = None
    if heads:
        loaded = load_heads(heads, hidden_size=cfg.hidden_size, vocab_size=cfg.vocab_size, lm_head=base.model.lm_head,
                            num_decoder_layers=cfg.num_hidden_layers, head_layer=head_layer)
    elif untrained_heads:
        config = HeadsConfig(untrained_heads, 1, cfg.hidden_size, cfg.vocab_size, shared_lm_head=True, head_layer=head_layer)
        loaded = init_heads(config, base.model.lm_head)
    return MedusaModel(base, loaded.eval() if loaded is not None else None)
