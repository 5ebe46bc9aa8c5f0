"""Retrieval drafts: the continuation after earlier occurrences of the context's longest suffix.

Small models copy their prompt and repeat themselves; when the last n tokens (n <= ``max_ngram``)
occurred before in prompt + output, what followed them then is a good guess now (prompt lookup,
SAM-Decoding's retrieval). The index maps every n-gram to the positions right after its most
recent occurrences and is updated per emitted token in O(max_ngram): no rescan of the context.
"""

from __future__ import annotations

from dataclasses import dataclass

from medusa_trt.runtime.drafting.base import Fragment


@dataclass(frozen=True)
class LookupConfig:
    max_ngram: int = 3  # longest suffix matched
    occurrences: int = 2  # distinct continuations proposed (most recent first)
    max_length: int = 8  # longest continuation (the tree builder's budget usually cuts it first)


class NgramIndex:
    """n-gram -> positions just after its latest occurrences in a growing token list."""

    def __init__(self, config: LookupConfig):
        self.config = config
        self.tokens: list[int] = []
        self._after: dict[tuple[int, ...], list[int]] = {}

    def extend(self, tokens) -> None:
        keep = self.config.occurrences + 1  # +1: the context's own suffix is always the latest
        for tok in tokens:
            self.tokens.append(int(tok))
            end = len(self.tokens)
            for n in range(1, min(self.config.max_ngram, end) + 1):
                key = tuple(self.tokens[end - n : end])
                spots = self._after.setdefault(key, [])
                spots.append(end)
                if len(spots) > keep:
                    del spots[0]

    def continuations(self, max_length: int) -> list[tuple[int, list[int]]]:
        """(match length, continuation) pairs, longest match first, distinct continuations only."""
        end, out, seen = len(self.tokens), [], set()
        for n in range(min(self.config.max_ngram, end), 0, -1):
            for start in reversed(self._after.get(tuple(self.tokens[end - n :]), ())):
                if start >= end:  # the suffix itself
                    continue
                cont = tuple(self.tokens[start : start + max_length])
                if cont and cont not in seen:
                    seen.add(cont)
                    out.append((n, list(cont)))
                if len(out) >= self.config.occurrences:
                    return out
        return out


class LookupDrafter:
    name = "lookup"

    def __init__(self, config: LookupConfig, history: list[int]):
        self.config = config
        self.index = NgramIndex(config)
        self.index.extend(history)

    def propose(self, history: list[int], max_depth: int) -> Fragment:
        self._sync(history)
        found = self.index.continuations(min(max_depth, self.config.max_length))
        if not found:
            return Fragment.empty(self.name)
        paths = [cont for _, cont in found]
        keys = [[("lookup", min(n, 3), min(d + 1, 4)) for d in range(len(cont))] for n, cont in found]
        return Fragment.paths(self.name, paths, keys)

    def observe(self, history, scored_tokens, scored_next) -> None:
        self._sync(history)

    def _sync(self, history: list[int]) -> None:
        if len(history) > len(self.index.tokens):
            self.index.extend(history[len(self.index.tokens) :])
