"""Ctrl-C and SIGTERM during an export: unwind the stack (every ``finally`` removes its staging
folder), and never let a caught-and-ignored interrupt commit the files.

Python turns SIGINT into ``KeyboardInterrupt`` at whatever bytecode runs next. When that is a
weakref callback or a ``__del__``, the interpreter prints "Exception ignored in ..." and carries
on, and the export would finish as though nothing had been pressed; when it passes through code
that C ran with ``PyRun_*``, the interpreter later kills itself with SIGINT even though the
exception was handled. So while :func:`signals_unwind` is active, both signals raise
:class:`Cancelled` (a ``SystemExit``, not a ``KeyboardInterrupt``), remember that they came, and
:func:`checkpoint`, called right before files are moved into place, raises again if one was lost.
Outside the context (library use) nothing changes and ``checkpoint`` does nothing.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator

_HANDLED = (signal.SIGINT, signal.SIGTERM)
_pending: list[int] = []  # signals received while unwinding is on; a list so the handler needs no global


class Cancelled(SystemExit):
    """The export was interrupted: exit status 128 + signal number (130 for Ctrl-C, 143 for SIGTERM)."""

    def __init__(self, signum: int):
        super().__init__(128 + signum)
        self.signum = signum

    @property
    def word(self) -> str:
        return "interrupted" if self.signum == signal.SIGINT else "terminated"


def _raise(signum, frame):
    _pending.append(signum)
    raise Cancelled(signum)


def checkpoint() -> None:
    """Raise :class:`Cancelled` if a signal came while unwinding was on (even one whose exception
    an ignored callback swallowed). Call it before anything is committed."""
    if _pending:
        raise Cancelled(_pending[0])


@contextlib.contextmanager
def signals_unwind() -> Iterator[None]:
    """Within: SIGINT and SIGTERM raise :class:`Cancelled`. Off the main thread signals stay as they are."""
    try:
        previous = {s: signal.signal(s, _raise) for s in _HANDLED}
    except ValueError:  # not the main thread
        yield
        return
    _pending.clear()
    try:
        yield
        checkpoint()  # a signal whose exception was swallowed after the last checkpoint
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        _pending.clear()
