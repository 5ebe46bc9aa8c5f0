"""What every command shares: logging set-up and turning user errors into one line."""

from __future__ import annotations

import logging
import sys


def _user_errors() -> tuple[type[BaseException], ...]:
    from medusa_trt.runtime import EngineError, InvalidTreeError, PromptError

    errors: list[type[BaseException]] = [EngineError, InvalidTreeError, PromptError, FileNotFoundError, PermissionError]
    try:  # the exporter needs torch; a lean install has only the runtime's errors
        from medusa_trt.exporter import HeadsFormatError, HeadsMismatchError, ModelLoadError

        errors += [HeadsFormatError, HeadsMismatchError, ModelLoadError]
    except ImportError:
        pass
    return tuple(errors)


USER_ERRORS = _user_errors()


def setup_logging(verbose: bool) -> None:
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if not verbose:
        logging.getLogger("transformers").setLevel(logging.ERROR)


def fail(prog: str, exc: BaseException) -> int:
    """One line on stderr, exit status 2: the message already says what to do."""
    message = " ".join(str(exc).split()) or type(exc).__name__
    print(f"{prog}: error: {message}", file=sys.stderr)
    return 2
