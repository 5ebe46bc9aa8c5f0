"""Torch backend: runs a ``MedusaModel`` (the export wrapper) eagerly on CPU or CUDA.

The KV cache is allocated once, [max_context, layers, max_batch, Hkv, D] (slot-major, as the step
contract's graph takes it), and each step hands the model a view of the first
S = max(cache_lengths) slots, so cost follows the real context. Only committed tokens enter it.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from medusa_trt.runtime.backends.common import commit_indices
from medusa_trt.runtime.contract import DEFAULT_SUCCESSORS, Proposals, StepCounter, StepOutput

log = logging.getLogger(__name__)


class TorchBackend:
    name = "torch"

    def __init__(self, model, *, max_batch: int, max_context: int, device: str | None = None):
        self.model = model.eval()
        self._steps = StepCounter()
        self.device = torch.device(device) if device else model.device
        if self.device != model.device:
            self.model = self.model.to(self.device)
        spec = model.kv_spec
        self.max_batch, self.max_context = max_batch, max_context
        shape = (max_context, spec.num_layers, max_batch, spec.num_kv_heads, spec.head_dim)
        self.cache_key = torch.zeros(shape, dtype=spec.dtype, device=self.device)
        self.cache_value = torch.zeros(shape, dtype=spec.dtype, device=self.device)
        log.info(
            "torch backend on %s: KV cache %s (%.1f MiB)",
            self.device,
            tuple(shape),
            2 * self.cache_key.numel() * self.cache_key.element_size() / 2**20,
        )
        self._hidden = self._new_key = self._new_value = None
        self.max_tokens = None  # no limit on new tokens per step
        heads = getattr(model, "heads", None)
        self.reads_path = heads is not None and heads.config.reads_path  # sequential heads: the runtime sets what they expand
        self.expansion, self.expansion_top_k = None, 0  # (drafting.sequential.Expansion, its top-k)

    def _tensor(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.require(array, requirements=["C", "W"])).to(self.device, non_blocking=True)

    @torch.inference_mode()
    def describe(self) -> str:
        """The backend as a summary line names it: ``torch (cpu)``."""
        return f"{self.name} ({self.device})"

    def step(
        self, input_ids: np.ndarray, position_ids: np.ndarray, tree_mask: np.ndarray, cache_lengths: np.ndarray, *, logits: bool = True
    ) -> StepOutput:
        """input_ids/position_ids int64 [B, T], tree_mask bool [B, T, T], cache_lengths int64 [B] (``contract.Backend``);
        the model computes its logits whatever ``logits`` says."""
        batch = input_ids.shape[0]
        past = int(cache_lengths.max())  # host value: the view length must be a Python int
        logits, hidden, next_ids, new_key, new_value = self.model(
            self._tensor(input_ids),
            self._tensor(position_ids),
            self._tensor(tree_mask),
            self._tensor(cache_lengths),
            self.cache_key[:past, :, :batch],
            self.cache_value[:past, :, :batch],
        )
        self._hidden, self._new_key, self._new_value = hidden, new_key, new_value
        argmax = next_ids.cpu().numpy()  # host sync: acceptance walks the tree on the host
        topk = logits.topk(DEFAULT_SUCCESSORS, dim=-1).indices.cpu().numpy()  # host sync: the recycle drafter's table
        out = StepOutput(
            argmax,
            topk,
            lambda: self._host(logits),
            lambda rows, nodes: self._host(logits, rows, nodes),
            lambda rows, nodes: self._host(hidden, rows, nodes),
        )
        return self._steps.stamp(out)

    @torch.inference_mode()
    def _host(self, t: torch.Tensor, rows=None, nodes=None) -> np.ndarray:
        """``t`` (or its rows ``t[rows, nodes]``) in fp32 on the host."""
        if rows is not None:
            t = t[self._tensor(np.asarray(rows, dtype=np.int64)), self._tensor(np.asarray(nodes, dtype=np.int64))]
        return t.float().cpu().numpy()  # host sync: sampling walks the tree, and draws drafts, on the host

    @torch.inference_mode()
    def relayout(self, rows: np.ndarray, old_batch: int, new_batch: int, slots: int) -> None:
        """Move cache rows ``rows[i]`` to row i (this cache's layout does not depend on the batch size)."""
        if slots == 0 or len(rows) == 0:
            return
        index = self._tensor(np.asarray(rows, dtype=np.int64))
        for cache in (self.cache_key, self.cache_value):
            cache[:slots, :, : len(rows)] = cache[:slots, :, index]  # advanced indexing reads a copy first

    @torch.inference_mode()
    def commit(self, output: StepOutput, nodes: np.ndarray, counts: np.ndarray, cache_lengths: np.ndarray) -> None:
        """Copy the new K/V of ``nodes[b, :counts[b]]`` (int64 [B, A]) of the step that gave ``output`` into slots
        cache_lengths[b] + 0.. in place."""
        self._steps.check(output, "commit")
        rows, src, dst = (self._tensor(a) for a in commit_indices(nodes, counts, cache_lengths))  # each (N,)
        self.cache_key[dst, :, rows] = self._new_key[src, :, rows]  # (N, layers, Hkv, D)
        self.cache_value[dst, :, rows] = self._new_value[src, :, rows]

    @torch.inference_mode()
    def expand(self, paths: list, top_k: int):
        """Sequential heads: they expand this template (``with_tree`` copies share the backend and take subtrees of it)."""
        if not self.reads_path:
            return None
        from medusa_trt.runtime.drafting.sequential import expansion

        self.expansion, self.expansion_top_k = expansion(paths), top_k
        return self.expansion

    def propose(self, output: StepOutput, nodes: np.ndarray, top_k: int, roots: np.ndarray | None = None) -> Proposals:
        """Medusa heads at node ``nodes[b]`` of the step that gave ``output``: top-k ids int64 [B, n, K] on the host;
        ``roots`` (B,) the next tokens, read by next-token-aware heads."""
        self._steps.check(output, "propose")
        rows = torch.arange(nodes.shape[0], device=self.device)
        hidden = self._hidden[rows, self._tensor(nodes)]  # (B, H)
        roots = None if roots is None else self._tensor(np.asarray(roots, dtype=np.int64))
        logits = self.model.propose(hidden, roots, self.expansion, self.expansion_top_k)  # (B, n | P, V)
        ids = logits.topk(top_k, dim=-1).indices.cpu().numpy()  # host sync: drafting gathers on the host
        return Proposals(ids, lambda: self._host(logits))
