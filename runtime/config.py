"""Runtime configuration: one frozen dataclass, defaults defined here only."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RuntimeConfig:
    max_batch: int = 4  # sequences decoded together; the KV cache is allocated for this many
    max_context: int = 1024  # prompt + generated tokens per sequence; the cache's length
    tree: str | tuple | list | None = None  # preset name, chain-N, JSON file or paths; None: default_tree()
    device: str | None = None  # torch backend: "cpu", "cuda"; None: where the model is

    def __post_init__(self):
        if self.max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {self.max_batch}")
        if self.max_context < 2:
            raise ValueError(f"max_context must be >= 2, got {self.max_context}")


def default_tree(num_heads: int) -> str:
    """A chain over the heads: needs no presets file; pass ``tree=`` for a branching one."""
    return f"chain-{num_heads}"
