"""Torch backend: runs a ``MedusaModel`` (the export wrapper) eagerly on CPU or CUDA.

The KV cache is allocated once, [layers, max_batch, Hkv, max_context + slack, D], and each step
hands the model a view of the first S = max(cache_lengths) slots, so cost follows the real
context. Only committed tokens enter the cache; the ``slack`` slots past ``max_context`` absorb
the padded (ignored) writes of ``commit`` so it never needs a per-row branch.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

log = logging.getLogger(__name__)


class TorchBackend:
    name = "torch"

    def __init__(self, model, *, max_batch: int, max_context: int, slack: int, device: str | None = None):
        self.model = model.eval()
        self.device = torch.device(device) if device else model.device
        if self.device != model.device:
            self.model = self.model.to(self.device)
        spec = model.kv_spec
        self.max_batch, self.max_context = max_batch, max_context
        shape = (spec.num_layers, max_batch, spec.num_kv_heads, max_context + slack, spec.head_dim)
        self.cache_key = torch.zeros(shape, dtype=spec.dtype, device=self.device)
        self.cache_value = torch.zeros(shape, dtype=spec.dtype, device=self.device)
        log.info("torch backend on %s: KV cache %s (%.1f MiB)", self.device, tuple(shape),
                 2 * self.cache_key.numel() * self.cache_key.element_size() / 2**20)
        self._logits = self._hidden = self._new_key = self._new_value = None

    def _tensor(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.require(array, requirements=["C", "W"])).to(self.device, non_blocking=True)

    @torch.inference_mode()
    def step(self, input_ids: np.ndarray, position_ids: np.ndarray, tree_mask: np.ndarray, cache_lengths: np.ndarray) -> np.ndarray:
        """input_ids/position_ids int64 [B, T], tree_mask bool [B, T, T], cache_lengths int64 [B].

        Returns the base model's argmax after each node, int64 [B, T] on the host."""
        batch = input_ids.shape[0]
        past = int(cache_lengths.max())  # host value: the view length must be a Python int
        logits, hidden, new_key, new_value = self.model(
            self._tensor(input_ids),
            self._tensor(position_ids),
            self._tensor(tree_mask),
            self._tensor(cache_lengths),
            self.cache_key[:, :batch, :, :past],
            self.cache_value[:, :batch, :, :past],
        )
        self._logits, self._hidden, self._new_key, self._new_value = logits, hidden, new_key, new_value
        # host sync: acceptance walks the tree on the host
        return logits.argmax(dim=-1).cpu().numpy()

    @torch.inference_mode()
    def commit(self, nodes: np.ndarray, cache_lengths: np.ndarray) -> None:
        """Copy the new K/V of ``nodes`` int64 [B, A] into slots cache_lengths[b] + 0..A-1.

        Entries past a sequence's accepted count are written past its new length, where they stay
        invisible (and are overwritten by the next commit)."""
        batch, count = nodes.shape
        rows = torch.arange(batch, device=self.device)[:, None]  # (B, 1)
        src = self._tensor(nodes)  # (B, A)
        dst = self._tensor(cache_lengths[:, None] + np.arange(count)[None, :])  # (B, A)
        # advanced indices around a slice put (B, A) first: (B, A, layers, Hkv, D)
        self.cache_key[:, rows, :, dst] = self._new_key[:, rows, :, src]
        self.cache_value[:, rows, :, dst] = self._new_value[:, rows, :, src]

    @torch.inference_mode()
    def propose(self, nodes: np.ndarray, top_k: int) -> np.ndarray:
        """Medusa heads at node ``nodes[b]`` of the last step: top-k ids int64 [B, n, K] on the host."""
        rows = torch.arange(nodes.shape[0], device=self.device)
        hidden = self._hidden[rows, self._tensor(nodes)]  # (B, H)
        logits = self.model.propose(hidden)  # (B, n, V)
        return logits.topk(top_k, dim=-1).indices.cpu().numpy()  # host sync: drafting gathers on the host
