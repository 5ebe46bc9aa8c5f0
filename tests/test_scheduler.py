"""The scheduler's own parts, tokens in, tokens out, on an engine double: admission, rows that
grow and pack while the engine's cache rows follow, and text output with stop strings."""

from __future__ import annotations

from collections import deque

import numpy as np
import pytest

from medusa_trt.runtime.contract import StepCounter, StepOutput
from medusa_trt.runtime.drafting import Drafting, DraftingConfig
from medusa_trt.runtime.output import TextOutput, safe_end
from medusa_trt.runtime.scheduler import Scheduler, SchedulerConfig, Seq, SeqRequest, admit

VOCAB, EOS = 100, 99


class _Letters:
    """A codec double: token i is one letter, a..z repeating."""

    def decode(self, ids) -> str:
        return "".join(chr(ord("a") + int(i) % 26) for i in ids)


class _NextEngine:
    """An engine double whose model says token t + 1 after token t. It keeps its own count of
    committed slots per cache row, moved as ``relayout`` moves rows, and checks every call's
    ``cache_lengths`` against it: the scheduler's row state must describe the cache."""

    name, max_tokens = "next", None

    def __init__(self, max_batch: int, max_context: int):
        self.max_batch, self.max_context = max_batch, max_context
        self.cached = np.zeros(max_batch, dtype=np.int64)  # (max_batch,) committed slots per row
        self.relayouts: list[tuple[list[int], int, int, int]] = []
        self.steps = StepCounter()

    def step(self, input_ids, position_ids, tree_mask, cache_lengths, *, logits=True):
        batch = input_ids.shape[0]
        self.cached[:batch][cache_lengths == 0] = 0  # a free row, or a sequence new to it: its old slots are unseen
        assert cache_lengths.tolist() == self.cached[:batch].tolist()
        assert (position_ids[:, 0] == cache_lengths).all()
        return self.steps.stamp(StepOutput((input_ids + 1) % VOCAB, None, None, None))

    def commit(self, output, nodes, counts, cache_lengths):
        self.steps.check(output, "commit")  # the loop commits the step it just ran, by its output
        assert cache_lengths.tolist() == self.cached[: len(counts)].tolist()
        self.cached[: len(counts)] += counts

    def relayout(self, rows, old_batch, new_batch, slots):
        assert slots == int(self.cached[rows].max())
        self.relayouts.append((rows.tolist(), old_batch, new_batch, slots))
        moved = self.cached[rows]
        self.cached[:] = 0
        self.cached[: len(rows)] = moved


def _scheduler(max_batch: int = 4, max_context: int = 64, chunk: int = 3) -> tuple[Scheduler, _NextEngine]:
    engine = _NextEngine(max_batch, max_context)
    drafting = Drafting((), None, DraftingConfig(), engine_max_nodes=None)  # plain decoding: one token per step
    return Scheduler(engine, drafting, _Letters(), SchedulerConfig(max_batch, max_context, chunk, frozenset({EOS}))), engine


def _seq(index: int, prompt: list[int], max_new_tokens: int, stops: tuple[str, ...] = ()) -> Seq:
    return Seq(SeqRequest(index, prompt, max_new_tokens, stops))


def _run(scheduler: Scheduler, waiting: deque, most: int | None = None) -> list:
    """Every event of the sequences waiting, each joining as soon as a row is free (at most ``most`` per step)."""
    events = []
    while waiting or scheduler.active:
        joining = admit(waiting, min(scheduler.free, most or scheduler.free))
        if joining:
            scheduler.add(joining)
        events += [event for _, event in scheduler.step()]
    return events


def test_admit_waits_for_a_wave_then_fills_the_free_rows():
    waiting = deque("abcde")
    assert admit(waiting, free=1, wave=2) == [] and len(waiting) == 5  # one row free, a wave is two
    assert admit(waiting, free=3, wave=2) == ["a", "b", "c"]  # as many as the free rows hold
    assert admit(waiting, free=1, wave=4) == []
    assert admit(waiting, free=2, wave=4) == ["d", "e"]  # fewer wait than a wave: enough for all of them
    assert admit(waiting, free=4, wave=1) == [] and admit(deque("x"), free=0) == []


def test_sequences_decode_while_rows_grow_and_pack():
    """Five sequences over four rows, joining one at a time: each gets prompt[-1] + 1, + 2, ...
    (its budget, or up to the EOS), the cache rows follow every grow and pack, and a finished
    sequence's row goes to the next one."""
    scheduler, engine = _scheduler()
    prompts = [[1, 2, 3, 4, 5, 6, 7], [10], [20, 21, 22, 23], [95, 96], [40, 41, 42]]
    budgets = [5, 12, 3, 9, 6]
    seqs = [_seq(i, p, n) for i, (p, n) in enumerate(zip(prompts, budgets))]
    events = _run(scheduler, deque(seqs), most=1)
    for s, prompt, budget in zip(seqs, prompts, budgets):
        want = [(prompt[-1] + 1 + i) % VOCAB for i in range(budget)]
        want = want[: want.index(EOS) + 1] if EOS in want else want
        assert s.result().token_ids == want, s.request.index
        assert s.result().finish_reason == ("stop" if EOS in want else "length")
        assert s.result().text == _Letters().decode(want)
        got = [t for e in events if e.index == s.request.index for t in e.token_ids]
        assert got == want and "".join(e.text for e in events if e.index == s.request.index) == s.result().text
    assert scheduler.rows == [] and not scheduler._lengths.any()  # every row released, its state cleared
    assert all(width == 2 * old for _, old, width, _ in engine.relayouts if width > old)  # grown by doubling
    assert any(width < old for _, old, width, _ in engine.relayouts)  # packed as sequences finished


def test_cancelled_sequence_leaves_before_the_step():
    scheduler, _ = _scheduler()
    a, b = _seq(0, [1, 2], 20), _seq(1, [5], 20)
    scheduler.add([a, b])
    list(scheduler.step())
    b.cancelled = True
    events = list(scheduler.step())
    assert events[0][1].finish_reason == "cancelled" and events[0][0] is b
    assert scheduler.active == 1 and scheduler.rows == [a]  # packed into one row
    assert b.result().finish_reason == "cancelled"


def test_context_ends_a_sequence():
    scheduler, _ = _scheduler(max_context=8)
    s = _seq(0, [1, 2, 3, 4, 5], 50)
    _run(scheduler, deque([s]))
    assert s.result().finish_reason == "length" and len(s.result().token_ids) == 8 - 5  # prompt + new fill the context


@pytest.mark.parametrize("steps", [[[2, 3, 4, 5, 6, 7]], [[2], [3], [4, 5], [6], [7]]])
def test_stop_string_cuts_the_text_and_drops_later_tokens(steps):
    """Letters c d e f g h: the stop "ef" ends the text at "cd"; the tokens up to the one completing
    the stop are kept, however the tokens arrive; nothing of "ef" is ever streamed."""
    output, codec, streamed = TextOutput(("ef",)), _Letters(), ""
    for new in steps:
        output.add(codec, new, frozenset())
        streamed += output.delta(codec, finished=output.stopped)
        if output.stopped:
            break
    assert output.stopped and output.text == streamed == "cd"
    assert output.tokens == [2, 3, 4, 5]


def test_eos_ends_the_output_and_is_kept():
    output, codec = TextOutput(), _Letters()
    assert output.add(codec, [1, 2, EOS, 4], frozenset({EOS})) == [1, 2, EOS]
    assert output.stopped and output.tokens == [1, 2, EOS]
    assert output.delta(codec, finished=True) == codec.decode([1, 2, EOS])


def test_streaming_holds_back_a_possible_stop():
    output, codec = TextOutput(("bcx",)), _Letters()
    output.add(codec, [0, 1, 2], frozenset())  # "abc": "bc" may still become "bcx"
    assert output.delta(codec, finished=False) == "a"
    output.add(codec, [3], frozenset())  # "abcd": it did not
    assert output.delta(codec, finished=False) == "bcd"
    assert safe_end("abc", ("cd", "bcx")) == 1
