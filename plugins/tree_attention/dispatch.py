"""One entry point for tree attention in torch code: the Triton kernel on CUDA, else the reference.

    attend(query, key, value, past_key, past_value, tree_mask, cache_lengths, sinks=None, *,
           layer, scale, window=0, softcap=0.0, impl=None)

Arguments follow ``spec.TREE_ATTENTION`` (inputs in order, attributes as keywords; ``sinks`` None,
``window`` 0 and ``softcap`` 0 mean none). ``impl``:

  * ``None``: the Triton kernel when the tensors are on CUDA and ``triton`` imports, otherwise the
    torch reference (CPU, and tracing for ONNX export, which must see plain torch ops);
  * ``"triton"``: the kernel, or ``TritonUnavailableError`` (on CPU it needs ``TRITON_INTERPRET=1``);
  * ``"reference"``: ``reference.tree_attention`` through ``kernel.reference_from_spec``.
"""

from __future__ import annotations

import functools
import logging

import torch

from medusa_trt.plugins.tree_attention.errors import TreeAttentionInputError
from medusa_trt.plugins.tree_attention.kernel import reference_from_spec, tree_attention_triton, triton_importable

log = logging.getLogger(__name__)

IMPLS = ("triton", "reference")


def choose_impl(query: torch.Tensor, impl: str | None = None) -> str:
    """The implementation ``attend`` runs for this query: ``impl`` if given, else by device."""
    if impl is not None:
        if impl not in IMPLS:
            raise TreeAttentionInputError(f"tree attention: impl must be one of {IMPLS} or None, got {impl!r}")
        return impl
    if query.device.type == "cuda":
        if triton_importable():
            return "triton"
        _warn_reference_on_cuda()
    return "reference"


@functools.cache
def _warn_reference_on_cuda() -> None:
    log.warning("tree attention on CUDA uses the torch reference: triton is not importable (pip install 'medusa-trt[kernel]')")


def attend(
    query: torch.Tensor,  # [B, Hq, T, D] rotary applied
    key: torch.Tensor,  # [B, Hkv, T, D] keys of the T new tokens
    value: torch.Tensor,  # [B, Hkv, T, D]
    past_key: torch.Tensor,  # [S, L, B, Hkv, D] the whole committed cache
    past_value: torch.Tensor,  # [S, L, B, Hkv, D]
    tree_mask: torch.Tensor,  # bool [B, T, T] node i sees node j
    cache_lengths: torch.Tensor,  # int64 [B] committed slots per sequence
    sinks: torch.Tensor | None = None,  # float [Hq] per-head sink logits (None: no sinks)
    *,
    layer: int,
    scale: float,
    window: int = 0,  # sliding window (0: none)
    softcap: float = 0.0,  # logit soft-capping (0: none)
    impl: str | None = None,
) -> torch.Tensor:
    """Tree attention output [B, Hq, T, D] in query's dtype."""
    chosen = choose_impl(query, impl)
    fn = tree_attention_triton if chosen == "triton" else reference_from_spec
    inputs = (query, key, value, past_key, past_value, tree_mask, cache_lengths, sinks)
    return fn(*inputs, layer=layer, scale=scale, window=window, softcap=softcap)
