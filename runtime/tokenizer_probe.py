"""The tokenizer probe: texts whose ids an export records beside the engine's tokenizer.

The exporter encodes fixed texts and a sample of the model's own vocabulary with the source model's
tokenizer and with the engine's copy, refuses the export where the two differ
(``exporter/tokenizer_files.py``), and records the ids in ``tokenizer_probe.json`` beside
``tokenizer.json``. Every load of the engine's tokenizer (``FileTextCodec``) encodes the texts again
and refuses files that no longer give the recorded ids: a tokenizer edited, replaced or rebuilt by
another library release after the export. The chat template is checked at export only: a user may
add or change it beside the files afterwards. Engines exported before the probe load with one log
line. Pure Python and json: the lean install reads it.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

PROBE_FILE = "tokenizer_probe.json"
PROBE_VERSION = 1

# One of each kind of text a tokenizer can get wrong: plain ASCII, accents (normalization), CJK and
# emoji (byte fallback, multi-byte pieces), code (newlines, tabs, indentation), leading spaces.
PROBE_TEXTS = (
    "The quick brown fox jumps over the lazy dog. It's 12:30, isn't it?",
    "Café au lait, naïve résumé, Ångström, São Paulo, Zürich, déjà vu.",
    "日本語のテキストと中文文本，还有한국어。",
    "Emoji: 🙂🚀👍🏽 ❤️ and a flag 🇫🇷.",
    "def square(x):\n    return x ** 2  # comment\n\tprint(square(3))\n",
    "   three leading spaces, then  two  inside",
    " one leading space",
)
# a two-turn conversation through the chat template (with the generation prompt the runtime adds)
PROBE_CONVERSATION = (
    {"role": "user", "content": "Hi! What is 2 + 2?"},
    {"role": "assistant", "content": "2 + 2 = 4."},
    {"role": "user", "content": "And in French? Réponds en français."},
)


SAMPLE_IDS = 48  # the vocabulary sample: this many ids spread over the vocabulary, decoded and joined


@dataclass(frozen=True)
class Probe:
    """What a tokenizer makes of the probe texts: their ids, their decoded text, and the ids of the
    probe conversation through the chat template (None without a template)."""

    texts: tuple[str, ...]  # PROBE_TEXTS and a sample of the source's own vocabulary (``vocabulary_sample``)
    ids: tuple[tuple[int, ...], ...]  # one per text
    decoded: tuple[str, ...]  # decode(ids, skip_special_tokens=True) of each
    chat: tuple[int, ...] | None

    def to_json(self) -> str:
        return json.dumps(
            {
                "version": PROBE_VERSION,
                "texts": list(self.texts),
                "ids": [list(i) for i in self.ids],
                "decoded": list(self.decoded),
                "chat": None if self.chat is None else list(self.chat),
            },
            ensure_ascii=False,
        )

    @classmethod
    def from_json(cls, text: str) -> Probe:
        raw = json.loads(text)
        if not isinstance(raw, dict) or raw.get("version") != PROBE_VERSION:
            raise ValueError(f"not a version-{PROBE_VERSION} tokenizer probe")
        texts, ids, decoded, chat = raw["texts"], raw["ids"], raw["decoded"], raw.get("chat")
        if not len(texts) == len(ids) == len(decoded):
            raise ValueError("texts, ids and decoded differ in length")
        return cls(
            tuple(str(t) for t in texts),
            tuple(tuple(int(t) for t in i) for i in ids),
            tuple(str(d) for d in decoded),
            None if chat is None else tuple(int(t) for t in chat),
        )


def vocabulary_sample(codec, vocab_size: int) -> str:
    """``SAMPLE_IDS`` ids spread evenly over the vocabulary, each decoded, joined by spaces: text made of
    the model's own pieces (a custom word-level vocabulary shares no word with the fixed texts)."""
    step = max(1, vocab_size // SAMPLE_IDS)
    return " ".join(piece.strip() for i in range(0, vocab_size, step) if (piece := codec.decode([i])).strip())


def probe(codec, texts: tuple[str, ...], *, chat: bool = True) -> Probe:
    """Run ``texts`` and (with ``chat``, where it has a template) the probe conversation through
    ``codec`` (the ``TextCodec`` / ``FileTextCodec`` interface)."""
    ids = tuple(tuple(codec.encode_raw(t)) for t in texts)
    chat = tuple(codec.encode_chat([dict(m) for m in PROBE_CONVERSATION])) if chat and codec.has_chat_template else None
    return Probe(tuple(texts), ids, tuple(codec.decode(list(i)) for i in ids), chat)


def first_difference(expected: Probe, got: Probe) -> str | None:
    """A short description of the first probe entry where ``got`` differs from ``expected``; None if equal."""
    for text, want, have in zip(expected.texts, expected.ids, got.ids):
        if want != have:
            return f"encodes {text!r:.80} to {_diff(have, want)}"
    for text, want, have in zip(expected.texts, expected.decoded, got.decoded):
        if want != have:
            return f"decodes the ids of {text!r:.80} to {have!r:.80} instead of {want!r:.80}"
    if expected.chat != got.chat:
        if got.chat is None or expected.chat is None:
            return "has no chat template where the source has one" if got.chat is None else "has a chat template where the source has none"
        return f"encodes a two-turn conversation through its chat template to {_diff(got.chat, expected.chat)}"
    return None


def _diff(have, want, n: int = 6) -> str:
    """Where two id lists part, on one line: their lengths and a few ids from the first difference."""
    i = next((j for j, (a, b) in enumerate(zip(have, want)) if a != b), min(len(have), len(want)))
    window = lambda ids: "[" + ", ".join(map(str, ids[i : i + n])) + (", ..." if len(ids) > i + n else "") + "]"  # noqa: E731
    return f"{len(have)} ids instead of {len(want)}, differing from id {i}: {window(have)} instead of {window(want)}"


def read_probe(folder: Path) -> Probe | None:
    """The probe recorded in ``folder``; None where the export predates it. A file that cannot be
    read raises ``ValueError``."""
    path = Path(folder) / PROBE_FILE
    if not path.is_file():
        log.info("%s has no %s (exported before tokenizer probes): its tokenizer is not checked", folder, PROBE_FILE)
        return None
    return Probe.from_json(path.read_text(encoding="utf-8"))
