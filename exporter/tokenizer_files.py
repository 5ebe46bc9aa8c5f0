"""The engine's tokenizer: the source model's own files, and a check that it encodes like the source.

Where the source has a ``tokenizer.json`` (a Hugging Face folder), the engine gets that file byte for
byte, with ``tokenizer_config.json`` (special tokens, chat template) and the chat template files beside
it: nothing is re-derived from the architecture's tokenizer class, which a transformers release may
change (transformers 5.24's ``AutoTokenizer`` rebuilt a Qwen2 model's word-level tokenizer as a
byte-level BPE that encoded the source's words to nothing). Only a source with no ``tokenizer.json``
(a GGUF file, a SentencePiece ``tokenizer.model``) is converted, by transformers' ``save_pretrained``.

Then ``check_engine_tokenizer`` encodes the probe texts (``runtime/tokenizer_probe.py``) with the engine's
files (``FileTextCodec``, what the runtime and servers load) and with the source (the ``tokenizers``
library on the source's ``tokenizer.json``, transformers otherwise, transformers' chat template for the
conversation): any difference is one ``ExportError`` naming the file and the first text, and the probe
is recorded beside the files for the check at every load.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from medusa_trt.runtime.errors import MedusaError
from medusa_trt.runtime.text import FileTextCodec, TextCodec, TokenizerError
from medusa_trt.runtime.tokenizer_probe import PROBE_FILE, PROBE_TEXTS, first_difference, probe, vocabulary_sample

# the files of a Hugging Face tokenizer folder that the engine carries as they are
SOURCE_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja", "chat_template.json")


class TokenizerExportError(MedusaError):
    """The engine's tokenizer would not encode like the source's; nothing was written."""


def write_engine_tokenizer(tokenizer, source: Path | None, target: Path) -> None:
    """The engine's tokenizer files in ``target``: the source folder's files copied byte for byte where
    ``source`` holds a ``tokenizer.json``, else transformers' conversion of ``tokenizer``."""
    target.mkdir(parents=True, exist_ok=True)
    if source is None:
        tokenizer.save_pretrained(str(target))
        return
    for name in SOURCE_FILES:
        if (source / name).is_file():
            shutil.copyfile(source / name, target / name)


@dataclass
class _SourceCodec(TextCodec):
    """The source's tokenizer for the probe: ``tokenizers`` on its ``tokenizer.json`` for plain text
    where it has one, transformers otherwise; transformers renders the chat template."""

    raw: object = None  # tokenizers.Tokenizer of the source's tokenizer.json, or None

    def encode_raw(self, text: str) -> list[int]:
        return self.raw.encode(text).ids if self.raw is not None else super().encode_raw(text)

    def decode(self, ids: list[int]) -> str:
        return self.raw.decode(list(ids), skip_special_tokens=True) if self.raw is not None else super().decode(ids)


def source_codec(tokenizer, source: Path | None) -> TextCodec:
    raw = None
    if source is not None:
        from tokenizers import Tokenizer

        raw = Tokenizer.from_file(str(source / "tokenizer.json"))
    return _SourceCodec(tokenizer, raw)


def check_engine_tokenizer(tokenizer, source: Path | None, folder: Path, vocab_size: int, *, shown: Path | None = None) -> None:
    """Refuse (``TokenizerExportError``, one line) engine tokenizer files in ``folder`` that encode or
    decode a probe text otherwise than the source; record the probe in ``folder`` when they agree.
    ``shown``: the folder to name in the message (the engine's final place, not the staging folder)."""
    where = source / "tokenizer.json" if source is not None else "the source model's tokenizer"
    try:
        engine = FileTextCodec(folder, check=False)
    except TokenizerError as exc:
        raise TokenizerExportError(f"the engine's tokenizer cannot be read back ({exc}); nothing was written") from exc
    reference = source_codec(tokenizer, source)
    texts = (*PROBE_TEXTS, vocabulary_sample(reference, min(vocab_size, len(tokenizer))))  # a model may pad its vocabulary
    expected, got = probe(reference, texts), probe(engine, texts)
    differs = first_difference(expected, got)
    if differs:
        raise TokenizerExportError(
            f"the engine's tokenizer {(shown or folder) / 'tokenizer.json'} {differs}, the ids of {where}: "
            "nothing was written; report this with the model's tokenizer files"
        )
    (folder / PROBE_FILE).write_text(expected.to_json(), encoding="utf-8")
