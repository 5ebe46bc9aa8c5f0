"""Training prompts written for this project: 6954 distinct, deterministic (``prompts.jsonl``, one
JSON string a line, sorted), plus second turns built on the model's own first answers
(``follow_up_conversation``).

Self-distillation needs prompts, not answers (the base model writes the answers). These cover
the kinds of requests a chat model serves (writing, explanation, factual questions, roleplay,
word problems and puzzles, code, translation both ways, passages to summarise, extract from and
ask about, advice), and are deliberately *not* taken from Spec-Bench, which is kept for
evaluation only; ``assets/calibration_prompts.jsonl`` holds prompts disjoint from these.
"""

from __future__ import annotations

import hashlib
import json
import random
from functools import cache
from pathlib import Path

POOL_FILE = Path(__file__).with_name("prompts.jsonl")  # package data: the wheel carries it beside this module

# second turns, asked after the model's own first answer (training_conversations)
FOLLOW_UPS = [
    "Can you make that shorter?",
    "Please explain that in simpler words.",
    "Can you give me an example?",
    "Now summarize your answer in one sentence.",
    "Can you turn that into a bulleted list?",
    "What is the most important point?",
    "Can you expand on the second point?",
    "Translate your answer into French.",
    "Rewrite it in a more formal style.",
    "Thanks! Can you add a conclusion?",
    "Why is that true?",
    "What would a critic say about your answer?",
    "Write three questions a student might ask about this.",
    "Can you make it funnier?",
    "Give me a title for that.",
]
# tasks over the model's own answer as a long input (training_conversations)
OWN_TEXT_TASKS = [
    "Summarize the following text in two sentences.\n\n{x}",
    "List the key points of this text as bullet points.\n\n{x}",
    "{x}\n\nWrite three quiz questions about the text above, with answers.",
    "Extract every name, place and number from this text.\n\n{x}",
    "Rewrite the following text for a child:\n\n{x}",
]


def follow_up_conversation(prompt: str, answer: str, index: int) -> list[dict]:
    """A second turn on the model's own answer: a follow-up question, or a task over the answer as
    a long input, chosen by ``index``; the messages end with the user's turn."""
    if index % 3 == 2:  # the answer as a document to work on
        return [{"role": "user", "content": OWN_TEXT_TASKS[(index // 3) % len(OWN_TEXT_TASKS)].format(x=answer.strip())}]
    return [
        {"role": "user", "content": prompt},
        {"role": "assistant", "content": answer.strip()},
        {"role": "user", "content": FOLLOW_UPS[index % len(FOLLOW_UPS)]},
    ]


def training_prompts(count: int = 400, seed: int = 0) -> list[str]:
    """``count`` distinct prompts, the same for the same seed, and the first ``count`` of any larger
    ``count`` (a resumed run asked for more continues the same list); ``ValueError`` when the pool
    has fewer."""
    pool = builtin_pool()
    if count > len(pool):
        raise ValueError(f"the built-in pool has {len(pool)} distinct prompts, fewer than {count}")
    random.Random(seed).shuffle(pool)
    return pool[:count]


def builtin_pool() -> list[str]:
    """Every distinct built-in prompt, sorted (``training_prompts`` shuffles them by seed)."""
    return list(_read_pool())


@cache
def _read_pool() -> tuple[str, ...]:
    return tuple(json.loads(line) for line in POOL_FILE.read_text(encoding="utf-8").splitlines() if line)


def pool_digest() -> str:
    """A short hash of the built-in pool: a work folder made from another pool is not resumed."""
    return hashlib.sha256("\n".join(_read_pool()).encode()).hexdigest()[:16]
