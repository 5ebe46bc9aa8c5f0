"""The draft -> verify -> accept -> commit loop over engine rows that sequences join and leave.

Per row the scheduler keeps ``lengths`` committed tokens in the cache and a *root* token (the
base model's choice after them, already emitted, not yet in the cache), in arrays allocated once
at the engine's max batch. A sequence (``Seq``) keeps what is its own: its request, its output,
its generator, rule and acceptance statistics. Its proposers (the Medusa heads, retrieval,
recycled successors: ``drafting``, each a ``Proposer`` over every row) keep their own state per
sequence. One engine step serves every occupied row at once; ``Scheduler.step`` reads as four
functions over a ``StepPlan``:

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
  commit   K/V of root + accepted nodes into the row; bonus = next root; text is emitted
           (``output.TextOutput``); the proposers observe the step (the heads call runs at each
           row's last accepted node)

The step is W = max over rows wide; a row's unused columns are padding nodes that see only
themselves and are never committed, so they change nothing a real node computes. A step emits
accepted + 1 tokens per decode row. A finished or cancelled sequence frees its row at once; a
waiting one takes a free row between steps (continuous batching: ``admit``).

Rows and the cache layout: the engine takes the cache as [slots, layers, B, Hkv, D] with B the
step's row count, and ONNX Runtime / TensorRT need that block contiguous, so changing B
re-lays the cache out (``backend.relayout``, a copy of the committed slots). The row count
therefore only grows by doubling and shrinks when at most half the rows are in use; in
between, free rows ride along as padding.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from medusa_trt.runtime.acceptance import AcceptanceRule, Draws, Verdict, rule_for
from medusa_trt.runtime.contract import Backend, StepOutput
from medusa_trt.runtime.drafting import Drafting
from medusa_trt.runtime.drafting.base import Observed, StepTree
from medusa_trt.runtime.drafting.builder import Candidates, build_tree, merge, shared_width, take_width
from medusa_trt.runtime.drafting.stats import AcceptanceStats
from medusa_trt.runtime.output import TextOutput
from medusa_trt.runtime.results import GenerationResult, GenerationStats, StepDrafts, StreamEvent
from medusa_trt.runtime.sampling import SamplingParams, sample, warp

_KEYS = itertools.count()  # Seq.key: one per sequence, for the proposers' state


@dataclass(frozen=True)
class SchedulerConfig:
    """What the loop needs of its runtime besides the engine, the drafters and the tokenizer."""

    max_batch: int  # rows: the most sequences decoded together (the engine's cache rows)
    max_context: int  # cache slots per row: prompt + new tokens of one sequence
    prefill_chunk: int  # prompt tokens a row takes per step (bounds the step's width)
    eos: frozenset[int]  # tokens that end a sequence (kept in its output)


@dataclass(frozen=True)
class SeqRequest:
    """What a caller asked of one generation: a prompt of ``generate`` / ``stream``, or a server request."""

    index: int  # which prompt (generate/stream) or request id (ContinuousBatcher)
    prompt: list[int]
    max_new_tokens: int
    stops: tuple[str, ...] = ()
    params: SamplingParams = SamplingParams()
    hidden: bool = False  # record the heads' input hidden state before every new token (GenerationResult.hidden)


@dataclass(eq=False)
class Seq:
    """One generation: its request, its output so far, and what the loop keeps for it wherever its
    row is (the row's own state, length and root, is the scheduler's)."""

    request: SeqRequest
    output: TextOutput = field(init=False)
    finish_reason: str | None = None
    cancelled: bool = False  # set from any thread; honoured between steps
    key: int = field(default_factory=lambda: next(_KEYS))  # the proposers' handle on it (rows move; keys do not)
    # set when it joins the loop (Scheduler.add)
    stats: GenerationStats = None  # type: ignore[assignment]
    history: list[int] = field(default_factory=list)  # prompt + emitted tokens (the root last), grown in place
    rng: np.random.Generator | None = None  # this sequence's own: reproducible whatever shares the batch
    rule: AcceptanceRule | None = None  # its acceptance rule (acceptance.rule_for)
    accept_stats: AcceptanceStats | None = None  # online acceptance estimates per drafter key
    hidden: list[np.ndarray] | None = None  # float32 (n, H) parts, when the request asked for hidden states
    started: float = 0.0  # perf_counter when it joined

    def __post_init__(self):
        self.output = TextOutput(self.request.stops)

    def result(self) -> GenerationResult:
        tokens = self.output.tokens
        hidden = None
        if self.hidden is not None:
            parts = self.hidden or [np.zeros((0, 0), np.float32)]
            hidden = np.concatenate(parts)[: len(tokens)]  # (N, H): a stop may have cut the last step's tokens
        return GenerationResult(self.output.text, tokens, self.finish_reason or "cancelled", self.stats, hidden)


def admit(waiting: deque[Seq], free: int, wave: int = 1) -> list[Seq]:
    """The waiting sequences that take a row now, first come first, as many as ``free`` rows hold;
    none until ``wave`` rows are free (or enough for all that wait). A step is dense (rows x widest
    row), so a row in prefill makes every decoding row pay its chunk width: ``generate`` admits in
    waves of half the rows to pay that once for many; a server (``wave`` 1) admits at once."""
    if not waiting or free < min(wave, len(waiting)):
        return []
    return [waiting.popleft() for _ in range(min(free, len(waiting)))]


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
    logits: bool = True  # False: every row is a prompt chunk before its last, so nothing but the K/V is read


class Scheduler:
    """Runs the loop over an engine's rows (up to ``config.max_batch``). Not thread-safe: one
    thread calls ``add`` and ``step`` (``ContinuousBatcher`` wraps it for servers)."""

    def __init__(self, backend: Backend, drafting: Drafting, codec, config: SchedulerConfig):
        self.backend, self.drafting, self.codec, self.config = backend, drafting, codec, config
        self.proposers = drafting.proposers(backend)  # in drafting.DRAFTERS order
        self.rows: list[Seq | None] = []  # len = the engine's batch B for the next step
        # per row, allocated once; row b's entries are valid while rows[b] holds a sequence (0 otherwise)
        self._lengths = np.zeros(config.max_batch, dtype=np.int64)  # (max_batch,) committed tokens in the cache row
        self._prefilled = np.zeros(config.max_batch, dtype=np.int64)  # (max_batch,) prompt tokens committed so far
        self._roots = np.zeros(config.max_batch, dtype=np.int64)  # (max_batch,) the next tree's root (emitted, not cached)

    # ------------------------------------------------------------------ rows

    @property
    def active(self) -> int:
        return sum(s is not None for s in self.rows)

    @property
    def free(self) -> int:
        return self.config.max_batch - self.active

    def add(self, seqs: list[Seq]) -> None:
        """Give each sequence a row (the caller checks ``free``); grows the row count by doubling."""
        assert len(seqs) <= self.free, "no free row"
        needed = self.active + len(seqs)
        if needed > len(self.rows):
            width = needed if self.active == 0 else min(self.config.max_batch, max(needed, 2 * len(self.rows)))
            self._resize(width)
        now = time.perf_counter()
        for s in seqs:
            request = s.request
            row = self.rows.index(None)
            self.rows[row] = s
            self._lengths[row] = self._prefilled[row] = self._roots[row] = 0
            s.rng = request.params.generator()
            s.stats = GenerationStats(prompt_tokens=len(request.prompt))
            s.history = list(request.prompt)
            s.rule = rule_for(request.params)
            s.accept_stats = AcceptanceStats(self.drafting.prior)
            s.hidden = [] if request.hidden else None
            for p in self.proposers:
                p.start(s.key, s.history, sampled=s.rule.sampled_drafts)
            s.started = now

    def _resize(self, width: int) -> None:
        """Change the row count to ``width``, packing occupied rows first; moves their cache and their row state."""
        old = np.array([b for b, s in enumerate(self.rows) if s is not None], dtype=np.int64)  # (n,) occupied rows
        kept = [self.rows[b] for b in old]
        slots = int(self._lengths[old].max()) if kept else 0
        if kept and (old.tolist() != list(range(len(kept))) or width != len(self.rows)):
            self.backend.relayout(old, len(self.rows), width, slots)
        for state in (self._lengths, self._prefilled, self._roots):
            state[: len(kept)] = state[old]
            state[len(kept) :] = 0
        self.rows = kept + [None] * (width - len(kept))

    def _row_of(self, s: Seq) -> int:
        return next(b for b, r in enumerate(self.rows) if r is s)

    def _release(self, row: int) -> None:
        s = self.rows[row]
        self.rows[row] = None
        self._lengths[row] = self._prefilled[row] = self._roots[row] = 0
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
            self._release(self._row_of(s))
            yield s, StreamEvent(s.request.index, [], "", "cancelled")
        if not self.active:
            return
        plan = self._draft()
        tick = time.perf_counter()
        out = self.backend.step(plan.ids, plan.positions, plan.mask, plan.lengths, logits=plan.logits)  # verify
        verify = time.perf_counter() - tick
        verdicts = self._accept(plan, out)
        yield from self._commit(plan, out, verdicts, verify)

    def _draft(self) -> StepPlan:
        """Every row's input for the step: a tree per decode row, a prompt chunk per prefill row."""
        started = time.perf_counter()
        rows, chunk, prefilled = self.rows, self.config.prefill_chunk, self._prefilled
        prefill = {
            b: min(chunk, len(s.request.prompt) - int(prefilled[b]))
            for b, s in enumerate(rows)
            if s is not None and prefilled[b] < len(s.request.prompt)
        }
        decode = [b for b, s in enumerate(rows) if s is not None and b not in prefill]
        trees, together, draws = {}, {}, {}
        for b in decode:  # a StepTree (a fixed budget, or nothing to draft) or Candidates (budgeted with the step's other rows)
            got, draws[b] = self._tree(b)
            (together if isinstance(got, Candidates) else trees)[b] = got
        if together:
            drafting = self.drafting
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
        lengths = self._lengths[:batch].copy()  # (B,): the plan's own, the rows' lengths move on at commit
        for b, tree in trees.items():
            n = tree.num_nodes
            ids[b, :n] = tree.tokens
            positions[b] = lengths[b]
            positions[b, :n] += tree.depth
            mask[b, :n, :n] = tree.mask()
        for b, n in prefill.items():
            done = int(self._prefilled[b])
            ids[b, :n] = rows[b].request.prompt[done : done + n]
            positions[b] = lengths[b] + np.minimum(np.arange(width), n - 1)
            mask[b, :n, :n] = np.tril(np.ones((n, n), dtype=bool))
        # a row reads the step's outputs when it decodes or its prompt ends here (the first token, the successors)
        reads = bool(trees) or any(self._prefilled[b] + n == len(rows[b].request.prompt) for b, n in prefill.items())
        return StepPlan(ids, positions, mask, lengths, trees, draws, prefill, started, logits=reads)

    def _tree(self, b: int) -> tuple[StepTree | Candidates, Draws | None]:
        """Draft: the proposers' candidates merged below row ``b``'s root; a sampled row's tree under its
        own fixed budget, a greedy row's candidates for the step's shared width (``shared_width``); the row's draws."""
        s, root, drafting = self.rows[b], int(self._roots[b]), self.drafting
        depth = min(self._room(b), drafting.max_depth)
        if depth == 0 or not self.proposers:
            return StepTree.chain(root), None
        proposals = [p.propose(s.key, s.history, depth) for p in self.proposers]
        proposals = [p for p in proposals if p is not None]
        fragments = [p.fragment for p in proposals]
        draws = next((p.draws for p in proposals if p.draws is not None), None)  # the heads' (one proposer samples)
        if not s.rule.learnt_budget:  # sampled rows: the fixed one-row table, so neighbours never change a seed's draws
            return build_tree(root, fragments, s.accept_stats, max_nodes=drafting.max_nodes, cost=drafting.config.cost), draws
        return merge(root, fragments, s.accept_stats), draws

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
            keep = self._room(b) + 1
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
            events.append((self.rows[b], self._emit(b, tokens_b, drafts=drafts)))
        heads = self._observe(plan, out, last)
        host = time.perf_counter() - plan.started - verify - heads
        if verdicts and not plan.prefill:  # a pure decode step: what its width cost, heads call included
            self.drafting.cost.observe(*plan.ids.shape, verify + heads)
        for s, event in events:
            s.stats.host_seconds += host
            if s.finish_reason is not None:
                self._release(self._row_of(s))  # a release may repack the rows: the row is looked up now
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
            self._roots[b] = int(v.bonus)
            s.stats.verify_seconds += verify
            if s.hidden is not None:  # the committed nodes' states: each the one before the token that follows it
                s.hidden.append(out.hidden_rows(np.full(len(v.path), b), v.path))
        for b, n in plan.prefill.items():
            commit_nodes[b, :n] = np.arange(n)
            counts[b] = n
            s = rows[b]
            if self._prefilled[b] + n == len(s.request.prompt):  # the prompt is in: its last node gives the first new token
                root = self._first_token(s, out, b, n - 1)
                self._roots[b] = root
                new[b], last[b] = [root], n - 1
                if s.hidden is not None:
                    s.hidden.append(out.hidden_rows([b], [n - 1]))
        self.backend.commit(out, commit_nodes, counts, plan.lengths)
        for b, n in plan.prefill.items():
            self._prefilled[b] += n
        self._lengths[:batch] += counts
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
        roots = self._roots[: len(self.rows)].copy()  # (B,) next trees' roots, 0 for empty rows
        engine = 0.0
        for p in self.proposers:
            spent = p.observe(observed, roots, out)
            for key, seconds in spent.items():
                by_key[key].stats.heads_seconds += seconds
            engine += max(spent.values(), default=0.0)
        return engine

    def _room(self, b: int) -> int:
        """Most drafted tokens row ``b``'s sequence may still accept (a step emits accepted + 1)."""
        by_context = self.config.max_context - int(self._lengths[b]) - 2  # root pending: total = length + 1
        by_budget = self.rows[b].request.max_new_tokens - len(self.rows[b].output.tokens) - 1
        return max(min(by_context, by_budget), 0)

    # ------------------------------------------------------------------ emit

    def _emit(self, b: int, new: list[int], *, drafts: StepDrafts | None) -> StreamEvent:
        """Row ``b``'s new tokens into its output (EOS and stop strings end it there), then the budget
        and the context; the streamed delta. ``drafts``: the verify step's counts (None for the
        prefill's first token)."""
        s = self.rows[b]
        output, request = s.output, s.request
        if drafts is not None:
            s.stats.steps += 1
            s.stats.accepted_per_step.append(len(new))
            s.stats.drafts.append(drafts)
        before = len(output.tokens)
        s.history.extend(output.add(self.codec, new, self.config.eos))
        if output.stopped:
            s.finish_reason = "stop"
        elif len(output.tokens) >= request.max_new_tokens or self._lengths[b] + 1 >= self.config.max_context:
            s.finish_reason = "length"
        s.stats.new_tokens = len(output.tokens)
        text = output.delta(self.codec, finished=s.finish_reason is not None)
        return StreamEvent(index=request.index, token_ids=output.tokens[before:], text=text, finish_reason=s.finish_reason, drafts=drafts)


def _lazy_probs(logits: np.ndarray, params: SamplingParams):
    """node -> the base model's warped distribution at that node, float64 [V], from one
    sequence's step logits [W, V]; computed only for the nodes a rule visits."""
    cache: dict[int, np.ndarray] = {}

    def probs(node: int) -> np.ndarray:
        if node not in cache:
            cache[node] = warp(logits[node][None], params)[0]
        return cache[node]

    return probs
