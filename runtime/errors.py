"""The base of every error a user can cause: commands print its message as one line, exit 2 (``fail``)."""

import sys


class MedusaError(ValueError):
    """A user-caused error (bad model, heads, tree, engine, prompt); the message says what to do."""


class EngineError(MedusaError):
    """The engine or model passed to the runtime cannot be run; the message says what to do."""


def fail(prog: str, exc: BaseException) -> int:
    """One line on stderr, exit status 2: the message already says what to do."""
    message = " ".join(str(exc).split()) or type(exc).__name__
    print(f"{prog}: error: {message}", file=sys.stderr)
    return 2
