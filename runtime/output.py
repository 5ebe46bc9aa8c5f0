"""Text output: one sequence's new tokens as text while it streams, ended by EOS or a stop string.

Detokenization is incremental: each step decodes a short window of the newest tokens, so its
cost stays flat however long the output grows. The streamed text holds back an incomplete
multi-byte character and any tail that could still become a stop string (as vLLM and TGI do);
a stop string cuts the text before it and drops the tokens after the one that completed it.
"""

from __future__ import annotations

from medusa_trt.runtime.config import is_int
from medusa_trt.runtime.text import PromptError


def request_limits(max_new_tokens: int, stop: str | list[str] | tuple[str, ...] | None) -> tuple[str, ...]:
    """Check a request's budget and stop strings (an empty one is refused); the stops as a tuple."""
    if not is_int(max_new_tokens) or max_new_tokens < 1:
        raise PromptError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    if stop is None:
        return ()
    stops = (stop,) if isinstance(stop, str) else tuple(stop)
    if any(not isinstance(s, str) or not s for s in stops):
        raise PromptError("stop strings must be non-empty text: remove the empty one")
    for s in stops:
        try:
            s.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise PromptError(f"stop string {s!r} is not valid UTF-8 text: pass UTF-8 text") from exc
    return stops


class TextOutput:
    """One sequence's new tokens and their text. Each step: ``add`` the committed tokens, then
    take the ``delta`` to stream (all that is left once the sequence has finished)."""

    def __init__(self, stops: tuple[str, ...] = ()):
        self.stops = stops
        self.tokens: list[int] = []  # new tokens (an EOS that ended the output included)
        self.text = ""  # their text, special tokens skipped, cut before a stop string
        self.stopped = False  # an EOS or a stop string ended the output
        self._cut = False  # a stop string cut the text
        self._decoded = (0, 0)  # (prefix, read) offsets into tokens: see _tail
        self._streamed = 0  # characters of text already streamed

    def add(self, codec, new: list[int], eos: frozenset[int]) -> list[int]:
        """Append ``new`` up to an EOS (kept); decode the text they add and cut it before the first
        stop string, keeping only the tokens up to the one that completed it. Returns the tokens
        appended before that cut (the sequence's history takes them)."""
        before = len(self.tokens)
        for i, tok in enumerate(new):
            if tok in eos:
                new = new[: i + 1]
                self.stopped = True
                break
        new = [int(t) for t in new]
        self.tokens.extend(new)
        searched = max(len(self.text) - _longest(self.stops) + 1, 0)  # earlier text was searched last step
        self.text += self._tail(codec, final=False)
        cut = _first_stop(self.text, self.stops, searched)
        if cut is not None:
            self.stopped = self._cut = True
            while len(self.tokens) > before + 1 and _first_stop(codec.decode(self.tokens[:-1]), self.stops, searched) is not None:
                self.tokens.pop()  # keep only the tokens up to the one completing the stop string
            self.text = self.text[:cut]
        return new

    def delta(self, codec, *, finished: bool) -> str:
        """The text to stream now: once ``finished``, all that is left (an incomplete character at the
        very end as decode() gives it, unless a stop string cut the text); before, what can no
        longer turn out to be part of a stop string or of a multi-byte character."""
        if finished and not self._cut:
            self.text += self._tail(codec, final=True)
        end = len(self.text) if finished else safe_end(self.text, self.stops)
        delta = self.text[self._streamed : end]
        self._streamed = len(self.text[:end])
        return delta

    def _tail(self, codec, *, final: bool) -> str:
        """Text the newest tokens add, decoding only a short window (per-step cost flat in the output
        length): decode(tokens[prefix:]) minus decode(tokens[prefix:read]), where the tokens before
        ``read`` are already in the text and ``prefix`` gives the decoder their context (spaces,
        merges). Held back while it ends in an incomplete multi-byte character, unless ``final``."""
        prefix, read = self._decoded
        before = codec.decode(self.tokens[prefix:read]) if read > prefix else ""
        after = codec.decode(self.tokens[prefix:])
        if len(after) <= len(before) or (after.endswith("\ufffd") and not final):
            return ""
        self._decoded = (read, len(self.tokens))
        return after[len(before) :]


def _first_stop(text: str, stops: tuple[str, ...], start: int = 0) -> int | None:
    """Where the first stop string begins in ``text[start:]`` (absolute index), or None."""
    found = [i for i in (text.find(s, start) for s in stops) if i >= 0]
    return min(found) if found else None


def _longest(stops: tuple[str, ...]) -> int:
    return max((len(s) for s in stops), default=1)


def safe_end(text: str, stops: tuple[str, ...]) -> int:
    """How much of an unfinished sequence's text may be streamed: not an incomplete multi-byte
    character (U+FFFD at the end), and not a tail that could still grow into a stop string
    (a suffix that is a proper prefix of one), as vLLM and TGI hold back."""
    end = len(text.rstrip("\ufffd")) if text.endswith("\ufffd") else len(text)
    held = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, end), held, -1):  # longest first; only longer than what is held already
            if text.endswith(stop[:k], 0, end):
                held = k
                break
    return end - held
