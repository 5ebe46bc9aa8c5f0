"""``MedusaRuntime``: draft -> verify -> accept -> commit over an engine backend.

Per sequence b the loop keeps ``cache_lengths[b]`` committed tokens in the KV cache, a *root*
token (the base model's choice after them, already emitted, not yet in the cache) and the heads'
top-k *proposals* made at the last committed node. One step:

  draft:   tree tokens = [root, proposals] gathered by the compiled tree        (B, T)
  verify:  one engine call on the tree at positions cache_length + depth        (B, T) argmax
  accept:  longest path whose drafted tokens match the base model's choices     (B,)
  commit:  K/V of root + accepted nodes into the cache; bonus token = next root;
           proposals = heads at the last accepted node

A step emits accepted + 1 tokens. Sequences are ragged: each has its own cache length and
acceptance length. Small per-step arrays (ids, positions) live on the host; logits, hidden states
and K/V stay inside the backend.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from medusa_trt.runtime.acceptance import greedy_accept
from medusa_trt.runtime.config import DEFAULT_MAX_BATCH, DEFAULT_MAX_CONTEXT, RuntimeConfig, default_tree
from medusa_trt.runtime.engine import EngineError
from medusa_trt.runtime.text import FileTextCodec, PromptError, TextCodec
from medusa_trt.runtime.tree import CompiledTree, compile_tree, load_tree, resolve_tree

log = logging.getLogger(__name__)


@dataclass
class GenerationStats:
    prompt_tokens: int
    new_tokens: int = 0
    steps: int = 0  # verify steps (the prefill is not counted)
    accepted_per_step: list[int] = field(default_factory=list)  # tokens emitted per verify step
    seconds: float = 0.0  # wall time of the batch this sequence ran in
    verify_seconds: float = 0.0  # of which engine steps after the prefill (batch-wide)
    heads_seconds: float = 0.0  # of which Medusa heads calls (batch-wide)

    @property
    def mean_accepted(self) -> float:
        return float(np.mean(self.accepted_per_step)) if self.accepted_per_step else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass
class GenerationResult:
    text: str  # new text, special tokens skipped, cut before a stop string
    token_ids: list[int]  # new tokens only (an EOS that ended generation included)
    finish_reason: str  # "stop" (EOS or stop string) or "length" (max_new_tokens or context)
    stats: GenerationStats


@dataclass(frozen=True)
class StreamEvent:
    index: int  # which prompt
    token_ids: list[int]  # tokens committed in this step
    text: str  # text added by them (held back while a multi-byte character is incomplete)


@dataclass(frozen=True)
class _EngineInfo:
    """What the runtime needs to know of an engine, whichever backend runs it."""

    num_heads: int
    tree: list  # default tree paths
    tree_name: str
    max_top_k: int  # most proposals per head the engine returns
    eos_token_ids: tuple | list
    is_chat: bool


@dataclass
class _Sequence:
    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    text: str = ""
    sent: str = ""  # text already streamed
    stats: GenerationStats = None  # type: ignore[assignment]


class MedusaRuntime:
    """Generate with Medusa over an engine.

    ``engine``: a path to an exported ``.onnx`` engine (ONNX Runtime backend), or a ``MedusaModel``
    from ``medusa_trt.exporter.load_medusa`` (torch backend).
    """

    def __init__(self, engine, config: RuntimeConfig | None = None, *, tokenizer=None, **overrides):
        self.config = cfg = dataclasses.replace(config or RuntimeConfig(), **overrides)
        if isinstance(engine, (str, os.PathLike)):
            self.backend, codec, info = self._onnx(engine, cfg)
        elif hasattr(engine, "kv_spec") and hasattr(engine, "propose"):
            self.backend, codec, info = self._torch(engine, cfg)
        else:
            raise EngineError(f"unsupported engine {type(engine).__name__}: pass an .onnx engine path or a MedusaModel from medusa_trt.exporter.load_medusa")
        self.max_batch, self.max_context = self.backend.max_batch, self.backend.max_context
        self.num_heads = info.num_heads
        if cfg.tree is not None:
            self.tree: CompiledTree = load_tree(cfg.tree, max_depth=self.num_heads)
        else:
            self.tree = compile_tree(info.tree, name=info.tree_name, max_depth=self.num_heads)
        self._info = info
        self._check_tree(self.tree)
        limit = self.backend.max_tokens
        if limit is not None and min(cfg.prefill_chunk, self.max_context) > limit:
            raise EngineError(f"prefill_chunk {cfg.prefill_chunk} exceeds the engine's {limit} tokens per step: lower it")
        self.codec = TextCodec(tokenizer) if tokenizer is not None else codec
        self.eos = frozenset(int(i) for i in info.eos_token_ids)
        self.is_chat = bool(info.is_chat) and self.codec.has_chat_template

    def with_tree(self, tree) -> MedusaRuntime:
        """The same engine and buffers with another tree (``chain-0``: plain decoding). Not for
        concurrent use beside the original: they share the KV cache."""
        other = copy.copy(self)
        other.config = dataclasses.replace(self.config, tree=tree)
        other.tree = load_tree(tree, max_depth=self.num_heads)
        self._check_tree(other.tree)
        return other

    def _check_tree(self, tree: CompiledTree) -> None:
        if tree.top_k > self._info.max_top_k:
            raise EngineError(
                f"tree {tree.name} needs top-{tree.top_k} proposals but the engine gives top-{self._info.max_top_k}: "
                "use a tree with smaller indices or export the engine with this tree"
            )
        limit = self.backend.max_tokens
        if limit is not None and tree.num_nodes > limit:
            raise EngineError(f"tree {tree.name} has {tree.num_nodes} nodes but the engine takes at most {limit} per step: "
                              "use a smaller tree or export with a larger --max-tokens")

    @staticmethod
    def _onnx(path, cfg: RuntimeConfig):
        from medusa_trt.runtime.backends.onnx_backend import OnnxBackend  # onnxruntime only on this path

        backend = OnnxBackend(path, max_batch=cfg.max_batch, max_context=cfg.max_context, threads=cfg.threads)
        meta = backend.meta
        info = _EngineInfo(meta.num_heads, meta.tree, meta.tree_name, meta.top_k, meta.eos_token_ids, meta.is_chat)
        return backend, FileTextCodec(backend.files.tokenizer), info

    @staticmethod
    def _torch(model, cfg: RuntimeConfig):
        from medusa_trt.runtime.backends.torch_backend import TorchBackend  # torch only on this path

        max_context = cfg.max_context or DEFAULT_MAX_CONTEXT
        window = getattr(model, "sliding_window", None)
        if window is not None and max_context > window:
            raise EngineError(f"max_context {max_context} exceeds the model's sliding window {window}: lower max_context")
        backend = TorchBackend(model, max_batch=cfg.max_batch or DEFAULT_MAX_BATCH, max_context=max_context, device=cfg.device)
        name = default_tree(model.num_heads)
        info = _EngineInfo(model.num_heads, resolve_tree(name)[1], name, model.vocab_size, model.eos_token_ids, getattr(model, "is_chat", False))
        return backend, TextCodec(model.tokenizer), info

    # ----------------------------------------------------------------- public API

    def generate(self, prompts, *, max_new_tokens: int = 128, stop: str | Sequence[str] | None = None, chat_template: bool | None = None):
        """One ``GenerationResult`` for a single prompt (str or list of ids), a list for a batch."""
        single, batch = self._prompts(prompts, chat_template)
        results: list[GenerationResult] = []
        for start in range(0, len(batch), self.max_batch):
            seqs = [_Sequence(p) for p in batch[start : start + self.max_batch]]
            for _ in self._run(seqs, max_new_tokens, _stops(stop)):
                pass
            results += [GenerationResult(s.text, s.tokens, s.finish_reason, s.stats) for s in seqs]
        return results[0] if single else results

    def stream(self, prompts, *, max_new_tokens: int = 128, stop: str | Sequence[str] | None = None, chat_template: bool | None = None) -> Iterator[StreamEvent]:
        """Yield tokens as they are committed, one event per sequence and step."""
        _, batch = self._prompts(prompts, chat_template)
        for start in range(0, len(batch), self.max_batch):
            seqs = [_Sequence(p) for p in batch[start : start + self.max_batch]]
            for event in self._run(seqs, max_new_tokens, _stops(stop)):
                yield dataclasses.replace(event, index=event.index + start)

    # ----------------------------------------------------------------- inputs

    def _prompts(self, prompts, chat_template: bool | None) -> tuple[bool, list[list[int]]]:
        chat = self.is_chat if chat_template is None else bool(chat_template)
        if chat and not self.codec.has_chat_template:
            raise PromptError("chat_template=True but the tokenizer has no chat template")
        single = isinstance(prompts, str) or (isinstance(prompts, Sequence) and len(prompts) > 0 and all(isinstance(t, (int, np.integer)) for t in prompts))
        items = [prompts] if single else list(prompts)
        if not items:
            raise PromptError("no prompts given")
        batch = []
        for i, item in enumerate(items):
            ids = self.codec.encode(item, chat=chat) if isinstance(item, str) else [int(t) for t in item]
            if not ids:
                raise PromptError(f"prompt {i} is empty: pass some text or token ids")
            if len(ids) + 1 > self.max_context:
                raise PromptError(
                    f"prompt {i} has {len(ids)} tokens but max_context is {self.max_context} "
                    "(room for at least one new token is needed): shorten the prompt or raise max_context"
                )
            batch.append(ids)
        return single, batch

    # ----------------------------------------------------------------- the loop

    def _run(self, seqs: list[_Sequence], max_new_tokens: int, stops: tuple[str, ...]) -> Iterator[StreamEvent]:
        if max_new_tokens < 1:
            raise PromptError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        started = time.perf_counter()
        for s in seqs:
            s.stats = GenerationStats(prompt_tokens=len(s.prompt))
        lengths, root, proposals = self._prefill(seqs)
        yield from self._emit(seqs, [[int(r)] for r in root], lengths, max_new_tokens, stops, counting=False)
        tree = self.tree
        mask = np.ascontiguousarray(np.broadcast_to(tree.mask, (len(seqs), *tree.mask.shape)))  # (B, T, T)
        verify_seconds = heads_seconds = 0.0
        while any(s.finish_reason is None for s in seqs):
            tokens = self._draft(root, proposals)  # (B, T)
            positions = lengths[:, None] + tree.depth[None, :]  # (B, T)
            tick = time.perf_counter()
            target = self.backend.step(tokens, positions, mask, lengths)  # (B, T) base argmax
            verify_seconds += time.perf_counter() - tick
            best, accepted = greedy_accept(tree, tokens, target)  # (B,), (B,)
            accepted = np.minimum(accepted, self._room(seqs, lengths, max_new_tokens))
            path = tree.retrieve[best]  # (B, D+1) root-to-leaf nodes, -1 padded
            last = path[np.arange(len(seqs)), accepted]  # (B,) last accepted node
            new = [list(tokens[b, path[b, 1 : accepted[b] + 1]]) + [int(target[b, last[b]])] for b in range(len(seqs))]
            active = np.array([s.finish_reason is None for s in seqs])
            counts = np.where(active, accepted + 1, 0)  # root + accepted drafts enter the cache
            self.backend.commit(path, counts, lengths)
            lengths = lengths + counts
            root = target[np.arange(len(seqs)), last]
            if tree.depth_max:  # plain decoding (chain-0) needs no proposals
                tick = time.perf_counter()
                proposals = self.backend.propose(last, tree.top_k)
                heads_seconds += time.perf_counter() - tick
            yield from self._emit(seqs, new, lengths, max_new_tokens, stops, counting=True)
        elapsed = time.perf_counter() - started
        for s in seqs:
            s.stats.seconds, s.stats.verify_seconds, s.stats.heads_seconds = elapsed, verify_seconds, heads_seconds

    def _prefill(self, seqs: list[_Sequence]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Chain-masked calls over the right-padded prompts, ``prefill_chunk`` tokens at a time;
        commits every prompt token. Returns cache lengths, roots and proposals (B,), (B,), (B, n, K)."""
        batch = len(seqs)
        count = np.array([len(s.prompt) for s in seqs], dtype=np.int64)  # (B,)
        lengths = np.zeros(batch, dtype=np.int64)
        root = np.zeros(batch, dtype=np.int64)
        proposals = np.zeros((batch, self.num_heads, self.tree.top_k), dtype=np.int64)
        chunk = self.config.prefill_chunk
        for start in range(0, int(count.max()), chunk):
            width = min(chunk, int(count.max()) - start)
            take = np.clip(count - start, 0, width)  # (B,) real prompt tokens in this chunk
            ids = np.zeros((batch, width), dtype=np.int64)  # (B, W) right-padded; pads are never committed
            for b, s in enumerate(seqs):
                ids[b, : take[b]] = s.prompt[start : start + take[b]]
            positions = lengths[:, None] + np.arange(width)[None, :]  # (B, W)
            causal = np.broadcast_to(np.tril(np.ones((width, width), dtype=bool)), (batch, width, width))
            target = self.backend.step(ids, positions, causal, lengths)  # (B, W)
            self.backend.commit(np.broadcast_to(np.arange(width), (batch, width)), take, lengths)
            lengths = lengths + take
            ends = (count > start) & (count <= start + width)  # (B,) prompt ends in this chunk
            last = np.clip(count - 1 - start, 0, width - 1)  # (B,) its last token's node
            root = np.where(ends, target[np.arange(batch), last], root)
            if self.tree.depth_max:
                proposals = np.where(ends[:, None, None], self.backend.propose(last, self.tree.top_k), proposals)
        return count, root, proposals

    def _draft(self, root: np.ndarray, proposals: np.ndarray | None) -> np.ndarray:
        """Tree tokens (B, T): candidates [root, head1 top-K, ..., headD top-K] gathered by the tree."""
        tree = self.tree
        if tree.depth_max == 0:
            return root[:, None].astype(np.int64)
        heads = proposals[:, : tree.depth_max, : tree.top_k].reshape(len(root), -1)  # (B, D*K)
        candidates = np.concatenate([root[:, None], heads], axis=1)  # (B, 1 + D*K)
        return candidates[:, tree.gather_index]

    def _room(self, seqs: list[_Sequence], lengths: np.ndarray, max_new_tokens: int) -> np.ndarray:
        """Most drafted tokens each sequence may still accept (a step emits accepted + 1)."""
        by_context = self.max_context - lengths - 2  # root pending: total = length + 1
        by_budget = np.array([max_new_tokens - len(s.tokens) - 1 for s in seqs])
        return np.maximum(np.minimum(by_context, by_budget), 0)

    def _emit(self, seqs, new_tokens, lengths, max_new_tokens, stops, *, counting: bool) -> Iterator[StreamEvent]:
        for b, (s, new) in enumerate(zip(seqs, new_tokens)):
            if s.finish_reason is not None:
                continue
            if counting:
                s.stats.steps += 1
                s.stats.accepted_per_step.append(len(new))
            before = len(s.tokens)
            for i, tok in enumerate(new):
                if tok in self.eos:
                    new = new[: i + 1]
                    s.finish_reason = "stop"
                    break
            s.tokens.extend(int(t) for t in new)
            s.text = self.codec.decode(s.tokens)
            cut = _first_stop(s.text, stops)
            if cut is not None:
                s.finish_reason = "stop"
                while len(s.tokens) > before + 1 and _first_stop(self.codec.decode(s.tokens[:-1]), stops) is not None:
                    s.tokens.pop()  # keep only the tokens up to the one completing the stop string
                s.text = s.text[:cut]
            if s.finish_reason is None and (len(s.tokens) >= max_new_tokens or lengths[b] + 1 >= self.max_context):
                s.finish_reason = "length"
            s.stats.new_tokens = len(s.tokens)
            delta_end = len(s.text) if s.finish_reason or not s.text.endswith("\ufffd") else len(s.text.rstrip("\ufffd"))
            delta = s.text[len(s.sent) : delta_end]
            s.sent = s.text[:delta_end]
            yield StreamEvent(index=b, token_ids=s.tokens[before:], text=delta)


def _stops(stop: str | Sequence[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    stops = (stop,) if isinstance(stop, str) else tuple(stop)
    if any(not s for s in stops):
        raise PromptError("empty stop string: remove it")
    return stops


def _first_stop(text: str, stops: tuple[str, ...]) -> int | None:
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(found) if found else None
