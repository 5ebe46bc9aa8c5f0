"""Text in, token ids out and back: a thin adapter over whatever tokenizer the engine carries.

Duck-typed on the ``transformers`` tokenizer interface (``__call__``/``encode``, ``decode``,
``apply_chat_template``, ``chat_template``) so this module imports neither torch nor transformers.
"""

from __future__ import annotations

from dataclasses import dataclass


class PromptError(ValueError):
    """A prompt the user passed cannot be run; the message says what to change."""


@dataclass
class TextCodec:
    tokenizer: object

    @property
    def has_chat_template(self) -> bool:
        return getattr(self.tokenizer, "chat_template", None) is not None

    def encode(self, text: str, *, chat: bool) -> list[int]:
        if not text:
            raise PromptError("empty prompt: pass some text or token ids")
        if chat:
            ids = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
            )
            ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
            return [int(i) for i in ids]
        return [int(i) for i in self.tokenizer(text)["input_ids"]]

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)
