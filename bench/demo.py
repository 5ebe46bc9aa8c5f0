"""The demo: a few different prompts, each generated with drafting and with plain decoding on the same engine, greedy,
so the two outputs must be the same tokens (``medusa-demo``, ``make demo``).

The prompts are data (``assets/demo_prompts.json``): ``{"prompts": [{"name", "prompt" | "messages", "stream"?}]}``;
a ``prompt`` is text (the chat template applied), ``messages`` a conversation whose reply is generated. One prompt
may be marked ``"stream": true``: its drafted answer is printed as it is committed.

For every prompt the drafted run comes first, then the plain run (interleaved, so both see the same machine load);
``run_demo`` writes the answer's first lines and its tokens per step, and at the end the aggregate tokens per step, the
speed-up over plain decoding and whether every drafted output equalled its plain output token for token.
"""

from __future__ import annotations

import json
import logging
import sys
import textwrap
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from medusa_trt.runtime.text import PromptError, check_messages

log = logging.getLogger(__name__)
WIDTH = 100  # characters of an answer's line before it wraps
WARM_UP_TOKENS = 4  # tokens each runtime generates untimed first, as medusa-run --compare-plain and medusa-bench do


@dataclass(frozen=True)
class DemoPrompt:
    name: str
    prompt: str | list[dict]  # text, or a conversation of {role, content} turns
    stream: bool = False


@dataclass(frozen=True)
class Run:
    """One generation of one prompt: its new tokens, the tokens each verify step committed and the wall time."""

    text: str
    token_ids: list[int]
    accepted: list[int]  # per verify step (the prefill's first token is not a step), as GenerationStats counts them
    seconds: float


def read_demo_prompts(path: str) -> list[DemoPrompt]:
    """The demo's prompts from a JSON file, or a PromptError naming the file and the fix."""
    file = Path(path)
    if not file.is_file():
        raise PromptError(f"--prompts {file} does not exist: pass a JSON file such as assets/demo_prompts.json")
    try:
        records = json.loads(file.read_text(encoding="utf-8"))["prompts"]
    except (ValueError, KeyError, TypeError) as exc:
        raise PromptError(f'--prompts {file} is not {{"prompts": [{{"name", "prompt" or "messages"}}, ...]}} ({exc})') from exc
    if not isinstance(records, list) or not records:
        raise PromptError(f'--prompts {file}: "prompts" must be a non-empty list')
    prompts = []
    for i, r in enumerate(records):
        where = f"--prompts {file}: prompt {i}"
        if not isinstance(r, dict) or not isinstance(r.get("name"), str) or (("prompt" in r) == ("messages" in r)):
            raise PromptError(f'{where} needs a "name" and exactly one of "prompt" (text) or "messages" (a conversation)')
        if "prompt" in r and (not isinstance(r["prompt"], str) or not r["prompt"].strip()):
            raise PromptError(f'{where}: "prompt" must be non-empty text')
        prompt = r["prompt"] if "prompt" in r else check_messages(r["messages"], where)
        prompts.append(DemoPrompt(r["name"], prompt, bool(r.get("stream", False))))
    if sum(p.stream for p in prompts) > 1:
        raise PromptError(f'--prompts {file}: mark at most one prompt "stream": true')
    return prompts


def _generate(runtime, prompt, gen: dict) -> Run:
    started = time.perf_counter()
    r = runtime.generate(prompt, **gen)
    return Run(r.text, r.token_ids, list(r.stats.accepted_per_step), time.perf_counter() - started)


def _stream(runtime, prompt, gen: dict) -> Run:
    """Print the text as it is committed; one event per step, the first one the prefill's token."""
    started, text, ids, accepted = time.perf_counter(), [], [], []
    for event in runtime.stream(prompt, **gen):
        sys.stdout.write(event.text)
        sys.stdout.flush()
        text.append(event.text)
        ids.extend(event.token_ids)
        if event.drafts is not None:  # a verify step's event (the prefill's carries no drafts)
            accepted.append(len(event.token_ids))
    seconds = time.perf_counter() - started
    sys.stdout.write("\n")
    return Run("".join(text), ids, accepted, seconds)


def _per_step(runs: list[Run]) -> float:
    """Tokens per verify step over all the runs' steps pooled (medusa-bench's mean_accepted_per_step)."""
    steps = [a for r in runs for a in r.accepted]
    return sum(steps) / len(steps) if steps else 0.0


def _first_lines(text: str, lines: int) -> list[str]:
    """The answer's first ``lines`` lines, long ones wrapped at WIDTH characters."""
    rows = [part for row in text.strip().splitlines() if row.strip() for part in textwrap.wrap(row, WIDTH) or [""]]
    shown = [f"  | {row}" for row in rows[:lines]]
    if len(rows) > lines:
        shown.append(f"  | ... ({len(rows) - lines} more lines)")
    return shown


def run_demo(runtime, prompts: list[DemoPrompt], *, max_new_tokens: int, lines: int, out: Callable[[str], None] = print) -> bool:
    """Write each prompt's answer and figures, then the totals, a line per ``out`` call (the one streamed answer goes
    to stdout as it is committed); True when every drafted output equals plain."""
    plain = runtime.plain()
    gen = dict(max_new_tokens=max_new_tokens)
    for warm in (runtime, plain):  # neither timed run pays the first calls' one-time costs
        warm.generate(prompts[0].prompt, max_new_tokens=WARM_UP_TOKENS)
    drafters = ",".join(runtime.drafting.names) or "none"
    out(f"drafters {drafters}; greedy, up to {max_new_tokens} new tokens; each prompt drafted, then plain on the same engine")
    drafted_runs, plain_runs, same = [], [], []
    for i, p in enumerate(prompts, 1):
        out(f"\n[{i}/{len(prompts)}] {p.name}" + (" (streamed)" if p.stream else ""))
        log.info("prompt %s: drafting", p.name)
        drafted = _stream(runtime, p.prompt, gen) if p.stream else _generate(runtime, p.prompt, gen)
        if not p.stream:
            out("\n".join(_first_lines(drafted.text, lines)))
        log.info("prompt %s: plain decoding", p.name)
        reference = _generate(plain, p.prompt, gen)
        same.append(drafted.token_ids == reference.token_ids)
        out(
            f"  {len(drafted.token_ids)} tokens in {len(drafted.accepted)} steps: {_per_step([drafted]):.2f} tokens/step, "
            f"{reference.seconds / drafted.seconds:.2f}x plain; " + ("drafted = plain" if same[-1] else "DRAFTED != PLAIN")
        )
        drafted_runs.append(drafted)
        plain_runs.append(reference)
    tokens = sum(len(r.token_ids) for r in drafted_runs)
    steps = sum(len(r.accepted) for r in drafted_runs)
    fast, slow = sum(r.seconds for r in drafted_runs), sum(r.seconds for r in plain_runs)
    out(
        f"\nall {len(prompts)} prompts: {tokens} tokens in {steps} steps, {_per_step(drafted_runs):.2f} tokens/step; "
        f"{tokens / fast:.1f} tokens/s drafted vs {sum(len(r.token_ids) for r in plain_runs) / slow:.1f} plain: "
        f"{slow / fast:.2f}x over plain decoding"
    )
    if all(same):
        out(f"drafted output = plain output on {len(same)}/{len(same)} prompts, token for token")
    else:
        names = ", ".join(p.name for p, ok in zip(prompts, same) if not ok)
        out(f"drafted output differs from plain on {len(same) - sum(same)}/{len(same)} prompts ({names}): greedy drafting must be exact")
    return all(same)
