"""What every command shares: logging set-up and turning user errors into one line."""

from __future__ import annotations

import argparse
import logging
import sys

from medusa_trt.runtime.errors import MedusaError, fail  # noqa: F401 (fail: every command imports it from here)

VERBOSE_HELP = "log what each stage does and chooses (INFO), and the libraries' warnings"

# every typed error a user can cause derives from MedusaError; OS errors on their files too
USER_ERRORS = (MedusaError, FileNotFoundError, PermissionError, IsADirectoryError)


def setup_logging(verbose: bool) -> None:
    if not verbose:  # transformers' own bars (the GGUF loader's) read this when it is first imported
        import os

        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if not verbose:
        for noisy in ("transformers", "torch.onnx", "onnxscript"):
            logging.getLogger(noisy).setLevel(logging.ERROR)


def load_model(model: str, heads: str | None, untrained_heads: int | None, head_layer: int | None, device: str):
    """A MedusaModel from the command line's --model / --heads / --untrained-heads / --head-layer."""
    try:
        from medusa_trt.exporter import load_medusa
    except ImportError as exc:  # the lean install: ONNX Runtime only
        raise MedusaError(
            f"--model needs torch and transformers ({exc.name} is not installed): pip install 'medusa-trt[export]', "
            "or run an exported engine with --engine"
        ) from exc

    return load_medusa(model, heads, untrained_heads=untrained_heads, head_layer=head_layer, device=device)


class HelpFormatter(argparse.HelpFormatter):
    """Each option's help ends with its default where it has one the help does not already name."""

    def _get_help_string(self, action) -> str:
        text = action.help or ""
        if action.default in (None, False, argparse.SUPPRESS) or not action.option_strings or "default" in text.lower():
            return text
        return f"{text} (default: %(default)s)" if text else "(default: %(default)s)"


class Parser(argparse.ArgumentParser):
    """argparse with usage errors as one line (``prog: error: ...``, exit 2): the full usage is in --help; each
    option's default shown in it (``HelpFormatter``)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())} (see --help)\n")


def _int_at_least(least: int):
    """An argparse type: a whole number >= ``least`` (argparse turns the error into one usage line)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"must be >= {least}, got {value}")
        return value

    return parse


positive_int = _int_at_least(1)
non_negative_int = _int_at_least(0)


def drafter_list(text: str) -> tuple[str, ...]:
    """argparse type for --draft: 'heads,lookup,recycle', any subset, or 'none' (plain decoding)."""
    from medusa_trt.runtime.drafting import DRAFTERS

    names = tuple(n.strip() for n in text.split(",") if n.strip())
    if names in ((), ("none",)):
        return ()
    unknown = [n for n in names if n not in DRAFTERS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown drafter {unknown[0]!r}: use a comma-separated subset of {','.join(DRAFTERS)}, or none")
    return names


def add_backend_arg(p) -> None:
    """--backend: what runs an ONNX engine (medusa-run, medusa-serve, medusa-triton-repo); default None, the engine folder's choice."""
    from medusa_trt.runtime.backends import ONNX_BACKENDS

    p.add_argument(
        "--backend",
        choices=ONNX_BACKENDS,
        help="what runs an ONNX engine for this run (default: the engine folder's choice, which medusa-export made: native where "
        "it measured exact and faster there, else onnxruntime); native: this project's C step (the families of docs/models.md, "
        "fp32, int8-channel, int4, int8-block)",
    )


def add_sampling_args(p) -> None:
    """--temperature / --top-p / --top-k / --seed / --acceptance (defaults: SamplingParams')."""
    g = p.add_argument_group("sampling (default: greedy)")
    g.add_argument("--temperature", type=float, default=0.0, help="0: greedy; above 0: sample (lossless by default)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: keep tokens up to this cumulative probability")
    g.add_argument("--top-k", type=non_negative_int, default=0, help="keep the k most likely tokens (0: all)")
    g.add_argument("--seed", type=non_negative_int, help="seed of each sequence's generator (same seed, same output)")
    g.add_argument(
        "--acceptance",
        choices=["greedy", "typical", "lossless"],
        help="acceptance rule: lossless keeps the base model's distribution exactly; typical accepts more, not exactly",
    )


def sampling_kwargs(args) -> dict:
    return dict(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed, acceptance=args.acceptance)


def entry(prog: str):
    """Wrap a command's ``main(argv) -> int``: Ctrl-C is one line and exit 130, a closed pipe
    (``| head``) exit 141 with no traceback, undecodable bytes in a file or argument one line."""

    def wrap(main):
        import functools
        import os

        @functools.wraps(main)
        def run(argv: list[str] | None = None) -> int:
            try:
                return main(argv)
            except KeyboardInterrupt:
                print(f"{prog}: interrupted", file=sys.stderr)
                return 130
            except BrokenPipeError:
                # the reader went away: point stdout at /dev/null so the interpreter's final flush stays quiet
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
                return 141
            except UnicodeError as exc:  # a prompt file or argument that is not UTF-8 text
                where = f" ({exc.reason} at position {exc.start})" if hasattr(exc, "start") else ""
                return fail(prog, MedusaError(f"input is not valid UTF-8 text{where}: save the file as UTF-8 or pass UTF-8 text"))

        return run

    return wrap
