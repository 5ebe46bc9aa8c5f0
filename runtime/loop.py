"""The draft -> verify -> accept -> commit loop over engine rows that sequences join and leave.

Per sequence the loop keeps ``length`` committed tokens in its cache row, a *root* token (the
base model's choice after them, already emitted, not yet in the cache) and its drafters (the
Medusa heads, retrieval, recycled successors: ``drafting``). One engine step serves every
occupied row at once; ``Scheduler.step`` reads as four functions over a ``StepPlan``:

  draft    each decode row's drafters propose candidates below its root, merged into one trie;
           the greedy rows share one step width W chosen for all of them (a step pays for its
           widest row), each keeping its best W - 1 nodes; sampled rows budget alone. Prefill rows take
           the next ``prefill_chunk`` prompt tokens under a causal mask; empty rows one padding
           token over an empty cache (never committed).
  verify   one engine call over the plan: every node at position length + depth, under its
           row's tree mask; returns the base model's argmax after every node (``StepOutput``)
  accept   each row's rule object (greedy / typical / lossless) picks the accepted path and the
           bonus token; the sequence's acceptance statistics learn from the nodes it tested
  commit   K/V of root + accepted nodes into the row; bonus = next root; the heads propose at
           the last accepted node; drafters observe what was emitted and scored; text is emitted

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

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from medusa_trt.runtime.acceptance import RULES_BY_NAME, Verdict
from medusa_trt.runtime.config import is_int
from medusa_trt.runtime.contract import StepOutput
from medusa_trt.runtime.drafting.builder import Candidates, StepTree, build_tree, merge, shared_width, take_width
from medusa_trt.runtime.drafting.heads import head_confidence
from medusa_trt.runtime.drafting.stats import AcceptanceStats
from medusa_trt.runtime.sampling import SamplingParams, draw_without_replacement, sample, warp
from medusa_trt.runtime.text import PromptError

HEADS_IDLE = 4  # steps in a row whose trees kept none of the heads' nodes before the heads rest
HEADS_REST = 8  # steps a sequence then drafts without the heads (and calls them not)


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


@dataclass
class Seq:
    """One generation: its request, its sampling state and where it is in the loop."""

    index: int
    prompt: list[int]
    max_new_tokens: int
    stops: tuple[str, ...] = ()
    params: SamplingParams = SamplingParams()
    rng: np.random.Generator | None = None  # this sequence's own: reproducible whatever shares the batch
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    text: str = ""
    decoded: tuple[int, int] = (0, 0)  # incremental detokenization: (prefix, read) offsets into tokens
    sent: str = ""  # text already streamed
    stats: GenerationStats = None  # type: ignore[assignment]
    cancelled: bool = False  # set from any thread; honoured between steps
    # loop state
    row: int = -1
    length: int = 0  # committed tokens in its cache row
    prefilled: int = 0  # prompt tokens committed so far
    root: int = 0
    history: list[int] = field(default_factory=list)  # prompt + emitted tokens (the root last), grown in place
    rule: object = None  # acceptance rule object (acceptance.RULES_BY_NAME)
    drafters: list = field(default_factory=list)  # this sequence's drafter objects (drafting.Drafter)
    heads: object = None  # its HeadsDrafter, if the heads draft
    accept_stats: AcceptanceStats | None = None  # online acceptance estimates per drafter key
    proposals: np.ndarray | None = None  # int64 [D, K]: top-k ids or (lossless) draws by sibling rank
    confidence: np.ndarray | None = None  # float32 [D, K]: the heads' probabilities of the top-k ids (greedy drafts)
    drafts_q: np.ndarray | None = None  # float64 [D, V]: the distributions the draws came from
    heads_idle: int = 0  # steps in a row whose trees kept none of the heads' nodes
    heads_rest: int = 0  # steps left that draft without the heads (nor call them)
    started: float = 0.0
    hidden: list[np.ndarray] | None = None  # float32 (n, H) parts, when the caller asked for hidden states

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
    prefill: dict  # row -> prompt tokens this step, for prefill rows
    started: float  # perf_counter when drafting began (host overhead accounting)


class Scheduler:
    """Runs the loop for a ``MedusaRuntime`` over up to ``max_batch`` rows. Not thread-safe:
    one thread calls ``add`` and ``step`` (``ContinuousBatcher`` wraps it for servers)."""

    def __init__(self, runtime):
        self.rt = runtime
        self.backend, self.tree = runtime.backend, runtime.tree
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
            s.row = self.rows.index(None)
            self.rows[s.row] = s
            s.rng = s.params.generator()
            s.stats = GenerationStats(prompt_tokens=len(s.prompt))
            s.length = s.prefilled = 0
            s.history = list(s.prompt)
            s.rule = RULES_BY_NAME[s.params.rule]
            s.accept_stats = AcceptanceStats()
            s.drafters = self.rt.drafting.make(s.history, sampled=s.rule.sampled_drafts)
            s.heads = next((d for d in s.drafters if d.name == "heads"), None)
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
            yield s, StreamEvent(s.index, [], "", "cancelled")
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
        prefill = {b: min(chunk, len(s.prompt) - s.prefilled) for b, s in enumerate(rows) if s is not None and s.prefilled < len(s.prompt)}
        decode = [b for b, s in enumerate(rows) if s is not None and b not in prefill]
        batch = len(rows)
        trees, together = {}, {}
        for b in decode:  # a StepTree (a fixed budget, or nothing to draft) or Candidates (budgeted with the step's other rows)
            got = self._tree(rows[b])
            (together if isinstance(got, Candidates) else trees)[b] = got
        if together:
            drafting = self.rt.drafting
            floor = max([t.num_nodes for t in trees.values()] + list(prefill.values()) + [1])
            shared = shared_width(list(together.values()), max_nodes=drafting.max_nodes, cost=drafting.cost, batch=batch, floor=floor)
            trees |= {b: take_width(c, shared, drafting.max_nodes) for b, c in together.items()}
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
            ids[b, :n] = s.prompt[s.prefilled : s.prefilled + n]
            positions[b] = lengths[b] + np.minimum(np.arange(width), n - 1)
            mask[b, :n, :n] = np.tril(np.ones((n, n), dtype=bool))
        return StepPlan(ids, positions, mask, lengths, trees, prefill, started)

    def _tree(self, s: Seq) -> StepTree | Candidates:
        """Draft: the sequence's drafters' candidates merged; a sampled row's tree under its own
        fixed budget, a greedy row's candidates for the step's shared width (``shared_width``)."""
        depth = min(self._room(s), self.rt.drafting.max_depth)
        if depth == 0 or not s.drafters:
            return StepTree.chain(s.root)
        if s.heads is not None:
            s.heads.proposals, s.heads.confidence = s.proposals, s.confidence
        fragments = [d.propose(s.history, depth) for d in s.drafters if d is not s.heads or not s.heads_rest]
        drafting = self.rt.drafting
        if not s.rule.learnt_budget:  # sampled rows: the fixed one-row table, so neighbours never change a seed's draws
            return build_tree(s.root, fragments, s.accept_stats, max_nodes=drafting.max_nodes, cost=drafting.config.cost)
        return merge(s.root, fragments, s.accept_stats)

    def _accept(self, plan: StepPlan, out: StepOutput) -> dict[int, Verdict]:
        """Each decode row's rule picks its accepted path and bonus; the budget may cut the path."""
        verdicts, host = {}, None
        for b, tree in plan.trees.items():
            s = self.rows[b]
            probs = None
            if s.rule.needs_logits:
                host = out.logits() if host is None else host  # (B, W, V) base logits on the host, fetched once
                probs = _lazy_probs(host[b], s.params)
            verdict = s.rule.accept(tree, out.argmax[b, : tree.num_nodes], probs, s)
            s.accept_stats.learn(tree, verdict.path)
            keep = self._room(s) + 1
            if out.exact is not None:  # past a node whose logits are not its plain-step logits, bit for bit, nothing is kept
                keep = min(keep, max(1, next((j for j, node in enumerate(verdict.path) if not out.exact[b, node]), keep)))
            if len(verdict.path) > keep:  # out of budget: the next accepted draft (a sample of the base model) is the bonus
                verdict = Verdict(verdict.path[:keep], int(tree.tokens[verdict.path[keep]]))
            verdicts[b] = verdict
        return verdicts

    def _commit(self, plan: StepPlan, out: StepOutput, verdicts: dict[int, Verdict], verify: float) -> Iterator[tuple[Seq, StreamEvent]]:
        """K/V of root + accepted nodes into each row, new roots, heads proposals, drafters
        updated, text emitted; finished sequences free their rows."""
        rows, argmax = self.rows, out.argmax
        batch, width = plan.ids.shape
        commit_nodes = np.zeros((batch, max(width, max((len(v.path) for v in verdicts.values()), default=1))), dtype=np.int64)  # (B, A)
        counts = np.zeros(batch, dtype=np.int64)  # (B,)
        heads_at = np.zeros(batch, dtype=np.int64)  # (B,) node whose hidden state feeds the heads
        wants_heads = np.zeros(batch, dtype=bool)  # (B,)
        new: dict[int, list[int]] = {}
        for b, v in verdicts.items():
            s, tree = rows[b], plan.trees[b]
            new[b] = [int(t) for t in tree.tokens[v.path[1:]]] + [int(v.bonus)]
            commit_nodes[b, : len(v.path)] = v.path
            counts[b] = len(v.path)  # root + accepted drafts enter the cache
            s.root = int(v.bonus)
            heads_at[b], wants_heads[b] = v.path[-1], s.heads is not None and not self._rest_heads(s, tree)
            s.stats.verify_seconds += verify
            if s.hidden is not None:  # the committed nodes' states: each the one before the token that follows it
                s.hidden.append(out.hidden_rows(np.full(len(v.path), b), v.path))
        for b, n in plan.prefill.items():
            s = rows[b]
            commit_nodes[b, :n] = np.arange(n)
            counts[b] = n
            if s.prefilled + n == len(s.prompt):  # the prompt is in: its last node gives the first new token
                s.root = int(argmax[b, n - 1])
                if s.params.rule != "greedy":
                    s.root = sample(s.rng, warp(out.logits_rows([b], [n - 1]), s.params)[0])
                heads_at[b], wants_heads[b] = n - 1, s.heads is not None
                new[b] = [s.root]
                if s.hidden is not None:
                    s.hidden.append(out.hidden_rows([b], [n - 1]))
        self.backend.commit(commit_nodes, counts, plan.lengths)
        for b, n in plan.prefill.items():
            rows[b].prefilled += n
        for b in np.flatnonzero(counts):
            rows[b].length += int(counts[b])
        heads = 0.0
        if self.tree.depth_max and wants_heads.any():  # a chain-0 template needs no proposals
            tick = time.perf_counter()
            self._propose(heads_at, wants_heads)
            heads = time.perf_counter() - tick
            for b in np.flatnonzero(wants_heads):
                rows[b].stats.heads_seconds += heads
        events = []
        for b, tokens_b in sorted(new.items()):
            s = rows[b]
            drafts = StepDrafts.of(plan.trees[b], verdicts[b].path) if b in verdicts else None
            events.append((s, self._emit(s, tokens_b, drafts=drafts)))
            tree = plan.trees.get(b)
            n = tree.num_nodes if tree is not None else plan.prefill[b]
            nxt = out.topk[b, :n] if out.topk is not None else argmax[b, :n, None]  # (n, k) successors, best first
            scored = (tree.tokens if tree is not None else plan.ids[b, :n], nxt)
            for d in s.drafters:
                d.observe(s.history, *scored)
        host = time.perf_counter() - plan.started - verify - heads
        if verdicts and not plan.prefill:  # a pure decode step: what its width cost, heads call included
            self.rt.drafting.cost.observe(batch, width, verify + heads)
        for s, event in events:
            s.stats.host_seconds += host
            if s.finish_reason is not None:
                self._release(s)
            yield s, event

    # ------------------------------------------------------------------ propose

    def _propose(self, nodes: np.ndarray, which: np.ndarray) -> None:
        """Heads at ``nodes[b]`` for the rows in ``which`` (B,): their top-K ids, or for lossless
        sampling draws without replacement from each head's warped distribution q_d
        (``walk.draws[d]`` of them, placed by rank)."""
        tree, walk, template = self.tree, self.rt._walk, self.rt.drafting.template
        roots = np.array([s.root if s is not None else 0 for s in self.rows], dtype=np.int64)  # (B,) next trees' roots
        proposals = self.backend.propose(nodes, tree.top_k, roots)
        rows = template.rows  # D heads, or P expanded nodes (sequential heads)
        ids = proposals.ids[:, :rows]  # (B, rows, K)
        head_logits = None
        for b in np.flatnonzero(which):
            s = self.rows[b]
            s.proposals = np.array(ids[b])  # (rows, K) a copy: the backend's buffer is reused
            head_logits = proposals.logits() if head_logits is None else head_logits  # (B, n | P, V) host
            if not s.heads.sampled:  # top-k drafts (greedy rows, sequential heads): keyed by the heads' confidence
                s.confidence = head_confidence(head_logits[b, :rows], s.proposals)  # (rows, K)
            else:
                q = warp(head_logits[b, : tree.depth_max], s.params)  # (D, V)
                for d in range(tree.depth_max):
                    s.proposals[d, : walk.draws[d]] = draw_without_replacement(s.rng, q[d], int(walk.draws[d]))
                s.drafts_q = q

    def _rest_heads(self, s: Seq, tree: StepTree) -> bool:
        """After a step: whether the heads sit out the next one. A heads call costs a fixed share of a
        step whatever the tree keeps, so when the budget kept none of the heads' nodes ``HEADS_IDLE``
        steps in a row, the sequence drafts without them (and calls them not) for ``HEADS_REST``
        steps, then tries again."""
        if s.heads_rest:
            s.heads_rest -= 1
            return s.heads_rest > 0
        s.heads_idle = 0 if any("heads" in sources for sources in tree.sources) else s.heads_idle + 1
        if s.heads_idle >= HEADS_IDLE:
            s.heads_idle, s.heads_rest = 0, HEADS_REST
        return s.heads_rest > 0

    def _room(self, s: Seq) -> int:
        """Most drafted tokens the sequence may still accept (a step emits accepted + 1)."""
        by_context = self.rt.max_context - s.length - 2  # root pending: total = length + 1
        by_budget = s.max_new_tokens - len(s.tokens) - 1
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
        searched = max(len(s.text) - _longest(s.stops) + 1, 0)  # earlier text was searched last step
        s.text += _decode_tail(codec, s, final=False)
        cut = _first_stop(s.text, s.stops, searched)
        if cut is not None:
            s.finish_reason = "stop"
            while len(s.tokens) > before + 1 and _first_stop(codec.decode(s.tokens[:-1]), s.stops, searched) is not None:
                s.tokens.pop()  # keep only the tokens up to the one completing the stop string
            s.text = s.text[:cut]
        if s.finish_reason is None and (len(s.tokens) >= s.max_new_tokens or s.length + 1 >= self.rt.max_context):
            s.finish_reason = "length"
        if s.finish_reason is not None and cut is None:
            s.text += _decode_tail(codec, s, final=True)  # an incomplete character at the very end, as decode() gives it
        s.stats.new_tokens = len(s.tokens)
        end = len(s.text) if s.finish_reason else _safe_end(s.text, s.stops)
        delta = s.text[len(s.sent) : end]
        s.sent = s.text[:end]
        return StreamEvent(index=s.index, token_ids=s.tokens[before:], text=delta, finish_reason=s.finish_reason, drafts=drafts)


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
    return after[len(before):]


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
