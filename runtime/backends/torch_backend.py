"""Torch backend: runs a ``MedusaModel`` (the export wrapper) eagerly on CPU or CUDA.

The KV cache is allocated once, [max_context, layers, max_batch, Hkv, D] (slot-major, as the step
contract's graph takes it), and each step hands the model a view of the first
S = max(cache_lengths) slots, so cost follows the real context. Only committed tokens enter it.

With ``cuda_graph=True`` (CUDA only) the verify step is captured as CUDA graphs (``StepGraphs``), as gpt-fast and
vLLM do: one a (batch, tokens) bucket, batch and tokens padded up to powers of two, the whole cache bound (the
Triton kernel reads each row's real length, so cost still follows the context), static buffers filled and the graph
replayed each step: the launches of an eager step, which bound it on a GPU, go.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from medusa_trt.runtime.backends.common import commit_indices
from medusa_trt.runtime.contract import DEFAULT_SUCCESSORS, Proposals, StepCounter, StepOutput
from medusa_trt.runtime.errors import EngineError

log = logging.getLogger(__name__)


class TorchBackend:
    name = "torch"

    def __init__(self, model, *, max_batch: int, max_context: int, device: str | None = None, cuda_graph: bool = False):
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
        if cuda_graph and self.device.type != "cuda":
            raise EngineError(f"cuda_graph=True captures CUDA graphs: the model is on {self.device}; move it to CUDA or drop cuda_graph")
        self.graphs = StepGraphs(self, capture=True) if cuda_graph else None

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
        if self.graphs is not None:
            logits, hidden, next_ids, new_key, new_value = self.graphs.run(input_ids, position_ids, tree_mask, cache_lengths)
        else:
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


def bucket(n: int, most: int | None = None) -> int:
    """The power of two at or above ``n``, at most ``most`` (a bucket of batch rows or tokens)."""
    size = 1 << max(0, int(n) - 1).bit_length()
    return size if most is None else min(size, max(most, int(n)))


class StepGraphs:
    """The verify step as one static step a (batch, tokens) bucket, replayed (``capture``: as a CUDA graph).

    A step of B rows and T tokens runs in the bucket (bucket(B, max_batch), bucket(T)): its inputs are copied into
    the bucket's static buffers, the padding made inert (a padded node sees only itself; a real node never sees a
    padded one; a padded row has no committed slots and its outputs are never read or committed), the model runs on
    the whole cache (rows 0.. of the bucket), and the outputs are the buffers' first B rows and T tokens. Captured,
    the first step of a bucket warms it up on a side stream and captures it; later ones replay. Without ``capture``
    (the CPU, for the tests) the same static step runs eagerly each time. All buckets share one memory pool. A step's
    outputs are its bucket's buffers, valid until that bucket's next step: the loop reads a step's outputs before it
    steps again, and ``StepCounter`` refuses a commit or a heads call on an older step's."""

    def __init__(self, backend: TorchBackend, *, capture: bool):
        self.backend, self.capture = backend, capture
        self.buckets: dict[tuple[int, int], _Bucket] = {}
        self.pool = torch.cuda.graph_pool_handle() if capture else None

    def run(self, input_ids, position_ids, tree_mask, cache_lengths) -> tuple[torch.Tensor, ...]:
        batch, tokens = input_ids.shape
        key = (bucket(batch, self.backend.max_batch), bucket(tokens))
        entry = self.buckets.get(key)
        if entry is None:
            entry = self.buckets[key] = _Bucket(self.backend, *key)
        entry.fill(input_ids, position_ids, tree_mask, cache_lengths)
        if not self.capture:
            outputs = entry.forward()
        elif entry.graph is None:
            outputs = entry.record(self.pool)
            log.info("captured a CUDA graph of the step for the (batch, tokens) bucket %s", key)
        else:
            entry.graph.replay()
            outputs = entry.outputs
        logits, hidden, next_ids, new_key, new_value = outputs
        return (
            logits[:batch, :tokens],
            hidden[:batch, :tokens],
            next_ids[:batch, :tokens],
            new_key[:tokens, :, :batch],
            new_value[:tokens, :, :batch],
        )


class _Bucket:
    """One (batch, tokens) bucket's static inputs, its step, and (captured) its graph and output buffers."""

    def __init__(self, backend: TorchBackend, batch: int, tokens: int):
        self.backend, self.batch, self.tokens = backend, batch, tokens
        device = backend.device
        self.input_ids = torch.zeros((batch, tokens), dtype=torch.int64, device=device)
        self.position_ids = torch.zeros((batch, tokens), dtype=torch.int64, device=device)
        self.tree_mask = torch.zeros((batch, tokens, tokens), dtype=torch.bool, device=device)
        self.cache_lengths = torch.zeros((batch,), dtype=torch.int64, device=device)
        self.graph = None
        self.outputs: tuple[torch.Tensor, ...] = ()
        # the same four on the host, written in place each step and copied over
        self.host = [np.zeros(tuple(t.shape), dtype=np.bool_ if t.dtype == torch.bool else np.int64) for t in self.static]

    @property
    def static(self) -> tuple[torch.Tensor, ...]:
        return self.input_ids, self.position_ids, self.tree_mask, self.cache_lengths

    def fill(self, input_ids: np.ndarray, position_ids: np.ndarray, tree_mask: np.ndarray, cache_lengths: np.ndarray) -> None:
        b, t = input_ids.shape
        ids, pos, mask, lengths = self.host
        for array in self.host:  # zeros: a padded row has no committed slots
            array.fill(0)
        mask[:, np.arange(self.tokens), np.arange(self.tokens)] = True  # a padded node sees itself, nothing else
        ids[:b, :t], pos[:b, :t], mask[:b, :t, :t], lengths[:b] = input_ids, position_ids, tree_mask, cache_lengths
        pos[:b, t:] = np.asarray(position_ids)[:, :1]  # padded nodes of a real row: its first node's position
        for static, array in zip(self.static, self.host):
            static.copy_(torch.from_numpy(array), non_blocking=False)

    def forward(self) -> tuple[torch.Tensor, ...]:
        backend = self.backend
        with torch.no_grad():
            return backend.model(
                self.input_ids,
                self.position_ids,
                self.tree_mask,
                self.cache_lengths,
                backend.cache_key[:, :, : self.batch],
                backend.cache_value[:, :, : self.batch],
            )

    def record(self, pool) -> tuple[torch.Tensor, ...]:
        """Warm up on a side stream (allocations settle, kernels compile), capture, replay once: this step's outputs."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self.forward()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            self.outputs = self.forward()
        graph.replay()
        self.graph = graph
        return self.outputs
