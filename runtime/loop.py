"""The draft -> verify -> accept -> commit loop over engine rows that sequences join and leave.

Per sequence the loop keeps ``length`` committed tokens in its cache row and a *root* token (the
base model's choice after them, already emitted, not yet in the cache). Its proposers (the
Medusa heads, retrieval, recycled successors: ``drafting``, each a ``Proposer`` over every row)
keep their own state per sequence. One engine step serves every occupied row at once;
``Scheduler.step`` reads as four functions over a ``StepPlan``:

  draft    each decode row's proposers propose candidates below its root, merged into one trie;
           the greedy rows share one step width W chosen for all of them (a step pays for its
           widest row), each keeping its best W - 1 nodes; sampled rows budget alone. Prefill rows take
           the next ``prefill_chunk`` prompt tokens under a causal mask; empty rows one padding
           token over an empty cache (never committed).
  verify   one engine call over the plan: every node at position length + depth, under its
           row's tree mask; returns the base model's argmax after every node (``StepOutput``)
  accept   each row's rule (``acceptance``: greedy / typical / lossless, functions of the tree, the
           target and draft distributions and the generator) picks the accepted path and the
           bonus token; the sequence's acceptance statistics learn from the nodes it tested
  commit   K/V of root + accepted nodes into the row; bonus = next root; text is emitted; the
           proposers observe the step (the heads call runs at each row's last accepted node)

The step is W = max over rows wide; a row's unused columns are padding nodes that see only
themselves and are never committed, so they change nothing a real node computes. A step emits
accepted + 1 tokens per decode row. A finished or cancelled sequence frees its row at once; a
waiting one takes a free row between steps (continuous batching).

Rows and the cache layout: the engine takes the cache as [slots, layers, B, Hkv, D] with B the
step's row count, and ONNX Runtime / TensorRT need that block contiguous, so changing B
re-lays the cache out (``backend.relayout``, a copy of the committed slots). The row count
therefore only grows by doubling and shrinks when at most half the rows are in use; in
between, free rows ride along as padding.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from medusa_trt.runtime.acceptance import AcceptanceRule, Draws, Verdict, rule_for
from medusa_trt.runtime.config import is_int
from medusa_trt.runtime.contract import StepOutput
from medusa_trt.runtime.drafting.base import Observed
from medusa_trt.runtime.drafting.builder import Candidates, StepTree, build_tree, merge, shared_width, take_width
from medusa_trt.runtime.drafting.stats import AcceptanceStats
from medusa_trt.runtime.sampling import SamplingParams, sample, warp
from medusa_trt.runtime.text import PromptError

_KEYS = itertools.count()  # Seq.key: one per sequence, for the proposers' state


@dataclass(frozen=True)
class StepDrafts:
    """What one verify step drafted and accepted for one sequence, in vLLM's terms (the serving
    metrics count these). ``drafted``: the draft tokens verified, i.e. the step tree's nodes below
    its root (the root is the previous step's bonus token, already emitted: not a draft).
    ``accepted``: the drafted tokens on the accepted path that were committed (a path cut by the
    request's budget counts what was kept); the bonus token after them is not counted, so the step
    emitted ``accepted + 1`` tokens (fewer when an EOS or stop string ends the sequence inside
    them). ``by_drafter``: (drafter, drafted, accepted) per drafter credited with a node; a node
    several drafters proposed is credited once, to the one whose candidate created it (drafters
    enter the tree in ``drafting.DRAFTERS`` order), so the per-drafter counts add up to the totals."""

    drafted: int
    accepted: int
    by_drafter: tuple[tuple[str, int, int], ...] = ()

    @classmethod
    def of(cls, tree: StepTree, path: list[int]) -> StepDrafts:
        """The counts of one row's step: its tree and its committed path (root first)."""
        drafted: dict[str, int] = {}
        accepted: dict[str, int] = {}
        for node in range(1, tree.num_nodes):
            name = tree.sources[node][0] if tree.sources[node] else "unknown"
            drafted[name] = drafted.get(name, 0) + 1
        for node in path[1:]:
            name = tree.sources[node][0] if tree.sources[node] else "unknown"
            accepted[name] = accepted.get(name, 0) + 1
        return cls(tree.num_nodes - 1, len(path) - 1, tuple((n, d, accepted.get(n, 0)) for n, d in drafted.items()))


@dataclass
class GenerationStats:
    prompt_tokens: int
    new_tokens: int = 0
    steps: int = 0  # verify steps (prefill steps not counted)
    accepted_per_step: list[int] = field(default_factory=list)  # tokens emitted per verify step
    drafts: list[StepDrafts] = field(default_factory=list)  # per verify step: drafted and accepted draft tokens
    seconds: float = 0.0  # wall time from joining the batch to finishing
    verify_seconds: float = 0.0  # of which engine steps this sequence took part in after its prefill
    heads_seconds: float = 0.0  # of which Medusa heads calls
    host_seconds: float = 0.0  # of which host work of its steps: draft, tree, accept, commit, emit

    @property
    def drafted_tokens(self) -> int:
        """Draft tokens verified over the whole generation (``StepDrafts.drafted`` summed)."""
        return sum(d.drafted for d in self.drafts)

    @property
    def accepted_tokens(self) -> int:
        """Draft tokens accepted over the whole generation (``StepDrafts.accepted`` summed)."""
        return sum(d.accepted for d in self.drafts)

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
    finish_reason: str  # "stop" (EOS or stop string), "length" (max_new_tokens or context) or "cancelled"
    stats: GenerationStats
    # with hidden=True: float32 (len(token_ids), H), row i the heads' input hidden state at the token
    # before token_ids[i] (the prompt's last for i = 0): what the engine computed, recorded as it ran
    hidden: np.ndarray | None = None


@dataclass(frozen=True)
class StreamEvent:
    index: int  # which prompt (generate/stream) or request id (ContinuousBatcher)
    token_ids: list[int]  # tokens committed in this step
    text: str  # text added by them (held back while a multi-byte character is incomplete)
    finish_reason: str | None = None  # set on the sequence's last event
    drafts: StepDrafts | None = None  # a verify step's drafted / accepted counts; None for prefill and cancellation events


@dataclass(frozen=True)
class SeqRequest:
    """What a caller asked of one generation: a prompt of ``generate`` / ``stream``, or a server request."""

    index: int  # which prompt (generate/stream) or request id (ContinuousBatcher)
    prompt: list[int]
    max_new_tokens: int
    stops: tuple[str, ...] = ()
    params: SamplingParams = SamplingParams()
    hidden: bool = False  # record the heads' input hidden state before every new token (GenerationResult.hidden)


@dataclass
class Seq:
    """One generation in the loop: its request, its output so far and where it is in the loop."""

    request: SeqRequest
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    text: str = ""
    decoded: tuple[int, int] = (0, 0)  # incremental detokenization: (prefix, read) offsets into tokens
    sent: str = ""  # text already streamed
    stats: GenerationStats = None  # type: ignore[assignment]
    cancelled: bool = False  # set from any thread; honoured between steps
    # loop state
    key: int = field(default_factory=lambda: next(_KEYS))  # the proposers' handle on it (rows move; keys do not)
    row: int = -1
    length: int = 0  # committed tokens in its cache row
    prefilled: int = 0  # prompt tokens committed so far
    root: int = 0
    history: list[int] = field(default_factory=list)  # prompt + emitted tokens (the root last), grown in place
    rng: np.random.Generator | None = None  # this sequence's own: reproducible whatever shares the batch
    rule: AcceptanceRule | None = None  # its acceptance rule (acceptance.rule_for)
    accept_stats: AcceptanceStats | None = None  # online acceptance estimates per drafter key
    started: float = 0.0
    hidden: list[np.ndarray] | None = None  # float32 (n, H) parts, when the request asked for hidden states

    def result(self) -> GenerationResult:
        hidden = None
        if self.hidden is not None:
            parts = self.hidden or [np.zeros((0, 0), np.float32)]
            hidden = np.concatenate(parts)[: len(self.tokens)]  # (N, H): a stop may have cut the last step's tokens
        return GenerationResult(self.text, self.tokens, self.finish_reason or "cancelled", self.stats, hidden)


@dataclass
class StepPlan:
    """One engine step: its inputs for every row and what each row drafted."""

    ids: np.ndarray  # int64 (B, W): tree tokens, prompt chunk or padding
    positions: np.ndarray  # int64 (B, W): length + depth (trees), length + i (prompt chunks)
    mask: np.ndarray  # bool (B, W, W): tree / causal mask; padding columns see only themselves
    lengths: np.ndarray  # int64 (B,): committed tokens per row before the step
    trees: dict  # row -> StepTree for decode rows
    draws: dict  # row -> Draws of the row's sampled drafts (None: none)
    prefill: dict  # row -> prompt tokens this step, for prefill rows
    started: float  # perf_counter when drafting began (host overhead accounting)


class Scheduler:
    """Runs the loop for a ``MedusaRuntime`` over up to ``max_batch`` rows. Not thread-safe:
    one thread calls ``add`` and ``step`` (``ContinuousBatcher`` wraps it for servers)."""

    def __init__(self, runtime):
        self.rt = runtime
        self.backend = runtime.backend
        self.proposers = runtime.drafting.proposers(runtime.backend)  # in drafting.DRAFTERS order
        self.rows: list[Seq | None] = []  # len = the engine's batch B for the next step

    # ------------------------------------------------------------------ rows

    @property
    def active(self) -> int:
        return sum(s is not None for s in self.rows)

    @property
    def free(self) -> int:
        return self.rt.max_batch - self.active

    def add(self, seqs: list[Seq]) -> None:
        """Give each sequence a row (the caller checks ``free``); grows the row count by doubling."""
        assert len(seqs) <= self.free, "no free row"
        needed = self.active + len(seqs)
        if needed > len(self.rows):
            width = needed if self.active == 0 else min(self.rt.max_batch, max(needed, 2 * len(self.rows)))
            self._resize(width)
        now = time.perf_counter()
        for s in seqs:
            request = s.request
            s.row = self.rows.index(None)
            self.rows[s.row] = s
            s.rng = request.params.generator()
            s.stats = GenerationStats(prompt_tokens=len(request.prompt))
            s.length = s.prefilled = 0
            s.history = list(request.prompt)
            s.rule = rule_for(request.params)
            s.accept_stats = AcceptanceStats(self.rt.drafting.prior)
            s.hidden = [] if request.hidden else None
            for p in self.proposers:
                p.start(s.key, s.history, sampled=s.rule.sampled_drafts)
            s.started = now

    def _resize(self, width: int) -> None:
        """Change the row count to ``width``, packing occupied rows first; moves their cache."""
        kept = [s for s in self.rows if s is not None]
        old = [s.row for s in kept]
        slots = max((s.length for s in kept), default=0)
        if kept and (old != list(range(len(kept))) or width != len(self.rows)):
            self.backend.relayout(np.array(old, dtype=np.int64), len(self.rows), width, slots)
        self.rows = kept + [None] * (width - len(kept))
        for row, s in enumerate(kept):
            s.row = row

    def _release(self, s: Seq) -> None:
        self.rows[s.row] = None
        for p in self.proposers:
            p.finish(s.key)
        s.stats.seconds = time.perf_counter() - s.started
        if self.active == 0:
            self.rows = []
        elif self.active <= len(self.rows) // 2:
            self._resize(self.active)

    # ------------------------------------------------------------------ one step

    def step(self) -> Iterator[tuple[Seq, StreamEvent]]:
        """One engine call over every row; yields (sequence, event) for what it committed.
        Cancelled sequences leave first; finished ones free their row after the step."""
        for s in [s for s in self.rows if s is not None and s.cancelled]:
            s.finish_reason = "cancelled"
            self._release(s)
            yield s, StreamEvent(s.request.index, [], "", "cancelled")
        if not self.active:
            return
        plan = self._draft()
        tick = time.perf_counter()
        out = self.backend.step(plan.ids, plan.positions, plan.mask, plan.lengths)  # verify
        verify = time.perf_counter() - tick
        verdicts = self._accept(plan, out)
        yield from self._commit(plan, out, verdicts, verify)

    def _draft(self) -> StepPlan:
        """Every row's input for the step: a tree per decode row, a prompt chunk per prefill row."""
        started = time.perf_counter()
        rows, chunk = self.rows, self.rt.config.prefill_chunk
        prefill = {
            b: min(chunk, len(s.request.prompt) - s.prefilled)
            for b, s in enumerate(rows)
            if s is not None and s.prefilled < len(s.request.prompt)
        }
        decode = [b for b, s in enumerate(rows) if s is not None and b not in prefill]
        trees, together, draws = {}, {}, {}
        for b in decode:  # a StepTree (a fixed budget, or nothing to draft) or Candidates (budgeted with the step's other rows)
            got, draws[b] = self._tree(rows[b])
            (together if isinstance(got, Candidates) else trees)[b] = got
        if together:
            drafting = self.rt.drafting
            floor = max([t.num_nodes for t in trees.values()] + list(prefill.values()) + [1])
            shared = shared_width(list(together.values()), max_nodes=drafting.max_nodes, cost=drafting.cost, batch=len(rows), floor=floor)
            trees |= {b: take_width(c, shared, drafting.max_nodes) for b, c in together.items()}
        return self._inputs(trees, draws, prefill, started)

    def _inputs(self, trees: dict, draws: dict, prefill: dict, started: float) -> StepPlan:
        """The step's tensors: each decode row's tree, each prefill row's prompt chunk, padding elsewhere."""
        rows = self.rows
        batch = len(rows)
        width = max([t.num_nodes for t in trees.values()] + list(prefill.values()) + [1])
        ids = np.zeros((batch, width), dtype=np.int64)  # (B, W)
        positions = np.zeros((batch, width), dtype=np.int64)  # (B, W)
        mask = np.broadcast_to(np.eye(width, dtype=bool), (batch, width, width)).copy()  # (B, W, W): padding sees itself
        lengths = np.array([s.length if s is not None else 0 for s in rows], dtype=np.int64)  # (B,)
        for b, tree in trees.items():
            n = tree.num_nodes
            ids[b, :n] = tree.tokens
            positions[b] = lengths[b]
            positions[b, :n] += tree.depth
            mask[b, :n, :n] = tree.mask()
        for b, n in prefill.items():
            s = rows[b]
            ids[b, :n] = s.request.prompt[s.prefilled : s.prefilled + n]
            positions[b] = lengths[b] + np.minimum(np.arange(width), n - 1)
            mask[b, :n, :n] = np.tril(np.ones((n, n), dtype=bool))
        return StepPlan(ids, positions, mask, lengths, trees, draws, prefill, started)

    def _tree(self, s: Seq) -> tuple[StepTree | Candidates, Draws | None]:
        """Draft: the proposers' candidates merged; a sampled row's tree under its own fixed budget,
        a greedy row's candidates for the step's shared width (``shared_width``); the row's draws."""
        depth = min(self._room(s), self.rt.drafting.max_depth)
        if depth == 0 or not self.proposers:
            return StepTree.chain(s.root), None
        proposals = [p.propose(s.key, s.history, depth) for p in self.proposers]
        proposals = [p for p in proposals if p is not None]
        fragments = [p.fragment for p in proposals]
        draws = next((p.draws for p in proposals if p.draws is not None), None)  # the heads' (one proposer samples)
        drafting = self.rt.drafting
        if not s.rule.learnt_budget:  # sampled rows: the fixed one-row table, so neighbours never change a seed's draws
            return build_tree(s.root, fragments, s.accept_stats, max_nodes=drafting.max_nodes, cost=drafting.config.cost), draws
        return merge(s.root, fragments, s.accept_stats), draws

    def _accept(self, plan: StepPlan, out: StepOutput) -> dict[int, Verdict]:
        """Each decode row's rule picks its accepted path and bonus; the budget may cut the path."""
        verdicts, host = {}, None
        for b, tree in plan.trees.items():
            s = self.rows[b]
            probs = None
            if s.rule.needs_logits:
                host = out.logits() if host is None else host  # (B, W, V) base logits on the host, fetched once
                probs = _lazy_probs(host[b], s.request.params)
            verdict = s.rule.accept(tree, out.argmax[b, : tree.num_nodes], probs, plan.draws.get(b), s.rng)
            s.accept_stats.learn(tree, verdict.path)
            keep = self._room(s) + 1
            if out.exact is not None:  # past a node whose logits are not its plain-step logits, bit for bit, nothing is kept
                keep = min(keep, max(1, next((j for j, node in enumerate(verdict.path) if not out.exact[b, node]), keep)))
            if len(verdict.path) > keep:  # out of budget: the next accepted draft (a sample of the base model) is the bonus
                verdict = Verdict(verdict.path[:keep], int(tree.tokens[verdict.path[keep]]))
            verdicts[b] = verdict
        return verdicts

    def _commit(self, plan: StepPlan, out: StepOutput, verdicts: dict[int, Verdict], verify: float) -> Iterator[tuple[Seq, StreamEvent]]:
        """Commit in four steps: K/V of root + accepted nodes into each row and the new roots
        (``_commit_cache``); the new text (``_emit``); the proposers learn from the step, the heads
        proposing at each row's last accepted node (``_observe``); finished sequences free their rows."""
        new, last = self._commit_cache(plan, out, verdicts, verify)
        events = []
        for b, tokens_b in sorted(new.items()):
            drafts = StepDrafts.of(plan.trees[b], verdicts[b].path) if b in verdicts else None
            events.append((self.rows[b], self._emit(self.rows[b], tokens_b, drafts=drafts)))
        heads = self._observe(plan, out, last)
        host = time.perf_counter() - plan.started - verify - heads
        if verdicts and not plan.prefill:  # a pure decode step: what its width cost, heads call included
            self.rt.drafting.cost.observe(*plan.ids.shape, verify + heads)
        for s, event in events:
            s.stats.host_seconds += host
            if s.finish_reason is not None:
                self._release(s)
            yield s, event

    def _commit_cache(
        self, plan: StepPlan, out: StepOutput, verdicts: dict[int, Verdict], verify: float
    ) -> tuple[dict[int, list[int]], dict[int, int]]:
        """K/V of root + accepted nodes (prompt chunks) into each row; the new roots. Returns each
        row's new tokens and its last committed node, for the rows that emit."""
        rows = self.rows
        batch, width = plan.ids.shape
        commit_nodes = np.zeros((batch, max([width] + [len(v.path) for v in verdicts.values()])), dtype=np.int64)  # (B, A)
        counts = np.zeros(batch, dtype=np.int64)  # (B,)
        new, last = {}, {}
        for b, v in verdicts.items():
            s, tree = rows[b], plan.trees[b]
            new[b], last[b] = [int(t) for t in tree.tokens[v.path[1:]]] + [int(v.bonus)], v.path[-1]
            commit_nodes[b, : len(v.path)] = v.path
            counts[b] = len(v.path)  # root + accepted drafts enter the cache
            s.root = int(v.bonus)
            s.stats.verify_seconds += verify
            if s.hidden is not None:  # the committed nodes' states: each the one before the token that follows it
                s.hidden.append(out.hidden_rows(np.full(len(v.path), b), v.path))
        for b, n in plan.prefill.items():
            commit_nodes[b, :n] = np.arange(n)
            counts[b] = n
            s = rows[b]
            if s.prefilled + n == len(s.request.prompt):  # the prompt is in: its last node gives the first new token
                s.root = self._first_token(s, out, b, n - 1)
                new[b], last[b] = [s.root], n - 1
                if s.hidden is not None:
                    s.hidden.append(out.hidden_rows([b], [n - 1]))
        self.backend.commit(commit_nodes, counts, plan.lengths)
        for b, n in plan.prefill.items():
            rows[b].prefilled += n
        for b in np.flatnonzero(counts):
            rows[b].length += int(counts[b])
        return new, last

    def _first_token(self, s: Seq, out: StepOutput, row: int, node: int) -> int:
        """The base model's token after the prompt: its argmax, or for a sampling rule a sample."""
        if not s.rule.needs_logits:
            return int(out.argmax[row, node])
        return sample(s.rng, warp(out.logits_rows([row], [node]), s.request.params)[0])

    def _observe(self, plan: StepPlan, out: StepOutput, last: dict[int, int]) -> float:
        """Every proposer learns from the committed step (the heads make their call here). Returns
        the engine seconds the proposers spent (the heads call), charged to the rows it served."""
        observed = []
        for b, node in sorted(last.items()):
            s, tree = self.rows[b], plan.trees.get(b)
            n = tree.num_nodes if tree is not None else plan.prefill[b]
            scored_next = out.topk[b, :n] if out.topk is not None else out.argmax[b, :n, None]  # (n, k) successors, best first
            scored = tree.tokens if tree is not None else plan.ids[b, :n]  # (n,)
            observed.append(Observed(s.key, b, s.history, node, tree, scored, scored_next, s.request.params, s.rng))
        if not observed:
            return 0.0
        by_key = {s.key: s for s in self.rows if s is not None}
        roots = np.array([s.root if s is not None else 0 for s in self.rows], dtype=np.int64)  # (B,) next trees' roots
        engine = 0.0
        for p in self.proposers:
            spent = p.observe(observed, roots, out)
            for key, seconds in spent.items():
                by_key[key].stats.heads_seconds += seconds
            engine += max(spent.values(), default=0.0)
        return engine

    def _room(self, s: Seq) -> int:
        """Most drafted tokens the sequence may still accept (a step emits accepted + 1)."""
        by_context = self.rt.max_context - s.length - 2  # root pending: total = length + 1
        by_budget = s.request.max_new_tokens - len(s.tokens) - 1
        return max(min(by_context, by_budget), 0)

    # ------------------------------------------------------------------ emit

    def _emit(self, s: Seq, new: list[int], *, drafts: StepDrafts | None) -> StreamEvent:
        """Append new tokens; apply EOS, stop strings, budget and context; the streamed delta.
        ``drafts``: the verify step's counts (None for the prefill's first token)."""
        codec, eos = self.rt.codec, self.rt.eos
        if drafts is not None:
            s.stats.steps += 1
            s.stats.accepted_per_step.append(len(new))
            s.stats.drafts.append(drafts)
        before = len(s.tokens)
        for i, tok in enumerate(new):
            if tok in eos:
                new = new[: i + 1]
                s.finish_reason = "stop"
                break
        s.tokens.extend(int(t) for t in new)
        s.history.extend(int(t) for t in new)
        searched = max(len(s.text) - _longest(s.request.stops) + 1, 0)  # earlier text was searched last step
        s.text += _decode_tail(codec, s, final=False)
        cut = _first_stop(s.text, s.request.stops, searched)
        if cut is not None:
            s.finish_reason = "stop"
            while len(s.tokens) > before + 1 and _first_stop(codec.decode(s.tokens[:-1]), s.request.stops, searched) is not None:
                s.tokens.pop()  # keep only the tokens up to the one completing the stop string
            s.text = s.text[:cut]
        if s.finish_reason is None and (len(s.tokens) >= s.request.max_new_tokens or s.length + 1 >= self.rt.max_context):
            s.finish_reason = "length"
        if s.finish_reason is not None and cut is None:
            s.text += _decode_tail(codec, s, final=True)  # an incomplete character at the very end, as decode() gives it
        s.stats.new_tokens = len(s.tokens)
        end = len(s.text) if s.finish_reason else _safe_end(s.text, s.request.stops)
        delta = s.text[len(s.sent) : end]
        s.sent = s.text[:end]
        return StreamEvent(index=s.request.index, token_ids=s.tokens[before:], text=delta, finish_reason=s.finish_reason, drafts=drafts)


def _lazy_probs(logits: np.ndarray, params: SamplingParams):
    """node -> the base model's warped distribution at that node, float64 [V], from one
    sequence's step logits [W, V]; computed only for the nodes a rule visits."""
    cache: dict[int, np.ndarray] = {}

    def probs(node: int) -> np.ndarray:
        if node not in cache:
            cache[node] = warp(logits[node][None], params)[0]
        return cache[node]

    return probs


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


def _decode_tail(codec, s: Seq, *, final: bool) -> str:
    """Text the newest tokens add, decoding only a short window (per-step cost flat in the output
    length): decode(tokens[prefix:]) minus decode(tokens[prefix:read]), where the tokens before
    ``read`` are already in the text and ``prefix`` gives the decoder their context (spaces,
    merges). Held back while it ends in an incomplete multi-byte character, unless ``final``."""
    prefix, read = s.decoded
    before = codec.decode(s.tokens[prefix:read]) if read > prefix else ""
    after = codec.decode(s.tokens[prefix:])
    if len(after) <= len(before) or (after.endswith("\ufffd") and not final):
        return ""
    s.decoded = (read, len(s.tokens))
    return after[len(before) :]


def _first_stop(text: str, stops: tuple[str, ...], start: int = 0) -> int | None:
    """Where the first stop string begins in ``text[start:]`` (absolute index), or None."""
    found = [i for i in (text.find(s, start) for s in stops) if i >= 0]
    return min(found) if found else None


def _longest(stops: tuple[str, ...]) -> int:
    return max((len(s) for s in stops), default=1)


def _safe_end(text: str, stops: tuple[str, ...]) -> int:
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
