"""``MedusaRuntime``: draft -> verify -> accept -> commit over an engine backend.

Per sequence b the loop keeps ``cache_lengths[b]`` committed tokens in the KV cache, a *root*
token (the base model's choice after them, already emitted, not yet in the cache) and the heads'
top-k *proposals* made at the last committed node. One step:

  draft:   tree tokens = [root, proposals] gathered by the compiled tree        (B, T)
  verify:  one engine call on the tree at positions cache_length + depth        (B, T) argmax
  accept:  the acceptance rule picks the last accepted node and the bonus token  (B,)
           (greedy: drafts equal to the base argmax; lossless / typical: ``acceptance``)
  commit:  K/V of root + accepted nodes into the cache; bonus token = next root;
           proposals = heads at the last accepted node (top-k, or draws when sampling)

A step emits accepted + 1 tokens. Each sequence has its own sampling parameters and seeded
generator (``sampling.SamplingParams``), so a batch may mix greedy and sampled sequences. Sequences are ragged: each has its own cache length and
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

from medusa_trt.runtime.acceptance import TreeWalk, greedy_accept, lossless_accept, tree_walk, typical_accept
from medusa_trt.runtime.config import DEFAULT_MAX_BATCH, DEFAULT_MAX_CONTEXT, RuntimeConfig, default_tree
from medusa_trt.runtime.engine import EngineError
from medusa_trt.runtime.sampling import SamplingParams, broadcast_params, draw_without_replacement, sample, warp
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
    params: SamplingParams = SamplingParams()
    rng: np.random.Generator | None = None  # this sequence's own: reproducible whatever shares the batch
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
        if isinstance(engine, (str, os.PathLike)) and str(engine).endswith(".plan"):
            self.backend, codec, info = self._tensorrt(engine, cfg)
        elif isinstance(engine, (str, os.PathLike)):
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
        self._walk: TreeWalk = tree_walk(self.tree)
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
        other._walk = tree_walk(other.tree)
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
    def _tensorrt(path, cfg: RuntimeConfig):
        from medusa_trt.runtime.backends.tensorrt_backend import TensorRTBackend  # tensorrt and torch only on this path

        backend = TensorRTBackend(path, max_batch=cfg.max_batch, max_context=cfg.max_context, cuda_graph=getattr(cfg, "cuda_graph", False))
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

    def generate(self, prompts, *, max_new_tokens: int = 128, stop: str | Sequence[str] | None = None, chat_template: bool | None = None,
                 temperature=None, top_p=None, top_k=None, seed=None, acceptance=None, sampling=None):
        """One ``GenerationResult`` for a single prompt (str or list of ids), a list for a batch.

        Sampling (see ``SamplingParams``): ``temperature`` 0 (default) decodes greedily; above 0
        the default acceptance is ``"lossless"`` (exactly the base model's distribution after
        temperature / top_k / top_p); ``"typical"`` accepts more but is not exact. Each of
        temperature, top_p, top_k, seed, acceptance is one value for all prompts or a list with
        one per prompt; or pass ``sampling=`` SamplingParams (one or a list)."""
        single, batch = self._prompts(prompts, chat_template)
        params = broadcast_params(len(batch), sampling, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, acceptance=acceptance)
        results: list[GenerationResult] = []
        for start in range(0, len(batch), self.max_batch):
            seqs = [_Sequence(p, q) for p, q in zip(batch[start : start + self.max_batch], params[start : start + self.max_batch])]
            for _ in self._run(seqs, max_new_tokens, _stops(stop)):
                pass
            results += [GenerationResult(s.text, s.tokens, s.finish_reason, s.stats) for s in seqs]
        return results[0] if single else results

    def stream(self, prompts, *, max_new_tokens: int = 128, stop: str | Sequence[str] | None = None, chat_template: bool | None = None,
               temperature=None, top_p=None, top_k=None, seed=None, acceptance=None, sampling=None) -> Iterator[StreamEvent]:
        """Yield tokens as they are committed, one event per sequence and step (options as ``generate``)."""
        _, batch = self._prompts(prompts, chat_template)
        params = broadcast_params(len(batch), sampling, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, acceptance=acceptance)
        for start in range(0, len(batch), self.max_batch):
            seqs = [_Sequence(p, q) for p, q in zip(batch[start : start + self.max_batch], params[start : start + self.max_batch])]
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
            s.rng = s.params.generator()
        lossless = np.array([s.params.rule == "lossless" for s in seqs])  # (B,) drafts sampled, rank-gathered
        lengths, root, proposals, drafts_q = self._prefill(seqs)
        yield from self._emit(seqs, [[int(r)] for r in root], lengths, max_new_tokens, stops, counting=False)
        tree, rows = self.tree, np.arange(len(seqs))
        mask = np.ascontiguousarray(np.broadcast_to(tree.mask, (len(seqs), *tree.mask.shape)))  # (B, T, T)
        verify_seconds = heads_seconds = 0.0
        while any(s.finish_reason is None for s in seqs):
            active = np.array([s.finish_reason is None for s in seqs])  # (B,)
            tokens = self._draft(root, proposals, lossless)  # (B, T); -1 where a head had no draw left
            positions = lengths[:, None] + tree.depth[None, :]  # (B, T)
            tick = time.perf_counter()
            target = self.backend.step(np.maximum(tokens, 0), positions, mask, lengths)  # (B, T) base argmax
            verify_seconds += time.perf_counter() - tick
            last, bonus = self._accept(seqs, tokens, target, drafts_q, active)  # (B,), (B,)
            path = tree.retrieve[self._walk.row_of[last]]  # (B, D+1) root-to-leaf nodes through last, -1 padded
            accepted = tree.depth[last]  # (B,)
            room = self._room(seqs, lengths, max_new_tokens)
            cut = accepted > room  # out of budget: keep the first `room` drafts; the next accepted draft
            accepted = np.where(cut, room, accepted)  # (already a sample of the base model) becomes the bonus
            bonus = np.where(cut, tokens[rows, path[rows, np.minimum(accepted + 1, tree.depth_max)]], bonus)
            last = path[rows, accepted]
            new = [list(tokens[b, path[b, 1 : accepted[b] + 1]]) + [int(bonus[b])] for b in rows]
            counts = np.where(active, accepted + 1, 0)  # root + accepted drafts enter the cache
            self.backend.commit(path, counts, lengths)
            lengths = lengths + counts
            root = bonus
            if tree.depth_max:  # plain decoding (chain-0) needs no proposals
                tick = time.perf_counter()
                proposals, drafts_q = self._propose(seqs, last, active, proposals, drafts_q)
                heads_seconds += time.perf_counter() - tick
            yield from self._emit(seqs, new, lengths, max_new_tokens, stops, counting=True)
        elapsed = time.perf_counter() - started
        for s in seqs:
            s.stats.seconds, s.stats.verify_seconds, s.stats.heads_seconds = elapsed, verify_seconds, heads_seconds

    def _prefill(self, seqs: list[_Sequence]) -> tuple[np.ndarray, np.ndarray, np.ndarray, list]:
        """Chain-masked calls over the right-padded prompts, ``prefill_chunk`` tokens at a time;
        commits every prompt token. Returns cache lengths (B,), roots (B,), proposals (B, D, K)
        and per sequence the draft distributions its proposals were drawn from (or None)."""
        batch = len(seqs)
        count = np.array([len(s.prompt) for s in seqs], dtype=np.int64)  # (B,)
        lengths = np.zeros(batch, dtype=np.int64)
        root = np.zeros(batch, dtype=np.int64)
        proposals = np.zeros((batch, self.tree.depth_max, self.tree.top_k), dtype=np.int64)
        drafts_q: list = [None] * batch
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
            for b in np.flatnonzero(ends):
                if seqs[b].params.rule != "greedy":  # the first new token is a sample of the base model
                    root[b] = sample(seqs[b].rng, warp(self.backend.logits_rows([b], [last[b]]), seqs[b].params)[0])
            if self.tree.depth_max:
                proposals, drafts_q = self._propose(seqs, last, ends, proposals, drafts_q)
        return count, root, proposals, drafts_q

    def _propose(self, seqs, nodes: np.ndarray, which: np.ndarray, proposals: np.ndarray, drafts_q: list) -> tuple[np.ndarray, list]:
        """Heads at ``nodes[b]`` for the sequences in ``which`` (B,): their top-K ids, or for
        lossless sampling draws without replacement from each head's warped distribution q_d
        (``walk.draws[d]`` of them, placed by rank). Returns proposals (B, D, K) and the q's."""
        tree, walk = self.tree, self._walk
        ids = self.backend.propose(nodes, tree.top_k)[:, : tree.depth_max]  # (B, D, K)
        proposals = np.where(which[:, None, None], ids, proposals)
        lossless = [b for b in np.flatnonzero(which) if seqs[b].params.rule == "lossless"]
        if lossless:
            head_logits = self.backend.head_logits()  # (B, n, V) host
            drafts_q = list(drafts_q)
            for b in lossless:
                q = warp(head_logits[b, : tree.depth_max], seqs[b].params)  # (D, V)
                for d in range(tree.depth_max):
                    proposals[b, d, : walk.draws[d]] = draw_without_replacement(seqs[b].rng, q[d], int(walk.draws[d]))
                drafts_q[b] = q
        return proposals, drafts_q

    def _accept(self, seqs, tokens: np.ndarray, target: np.ndarray, drafts_q: list, active: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Last accepted node and bonus token per sequence (B,), (B,) by each sequence's rule."""
        tree, rows = self.tree, np.arange(len(seqs))
        best, accepted = greedy_accept(tree, tokens, target)  # (B,), (B,): cheap, vectorised
        last = tree.retrieve[best, accepted]
        bonus = target[rows, last]
        host = None
        for b in np.flatnonzero(active):
            params = seqs[b].params
            if params.rule == "greedy":
                continue
            host = self.backend.host_logits() if host is None else host  # (B, T, V) on the host
            probs = _lazy_probs(host[b], params)
            if params.rule == "lossless":
                last[b], bonus[b] = lossless_accept(self._walk, tokens[b], probs, drafts_q[b], seqs[b].rng)
            else:
                last[b], bonus[b] = typical_accept(tree, tokens[b], probs, params.posterior_threshold, params.posterior_alpha, seqs[b].rng)
        return last, bonus

    def _draft(self, root: np.ndarray, proposals: np.ndarray, lossless: np.ndarray) -> np.ndarray:
        """Tree tokens (B, T): candidates [root, head1 top-K, ..., headD top-K] gathered by the tree
        (by top-k index; for lossless sequences by sibling rank, matching how their draws are laid out)."""
        tree = self.tree
        if tree.depth_max == 0:
            return root[:, None].astype(np.int64)
        heads = proposals.reshape(len(root), -1)  # (B, D*K)
        candidates = np.concatenate([root[:, None], heads], axis=1)  # (B, 1 + D*K)
        gather = np.where(lossless[:, None], self._walk.rank_gather[None, :], tree.gather_index[None, :])  # (B, T)
        return np.take_along_axis(candidates, gather, axis=1)

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


def _lazy_probs(logits: np.ndarray, params: SamplingParams):
    """node -> the base model's warped distribution at that node, float64 [V], from one
    sequence's step logits [T, V]; computed only for the nodes a rule visits."""
    cache: dict[int, np.ndarray] = {}

    def probs(node: int) -> np.ndarray:
        if node not in cache:
            cache[node] = warp(logits[node][None], params)[0]
        return cache[node]

    return probs


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
