"""Text in, token ids out and back: a thin adapter over whatever tokenizer the engine carries.

Duck-typed on the ``transformers`` tokenizer interface (``__call__``/``encode``, ``decode``,
``apply_chat_template``, ``chat_template``) so this module imports neither torch nor transformers.
"""

from __future__ import annotations

from dataclasses import dataclass

from medusa_trt.runtime.errors import MedusaError


class PromptError(MedusaError):
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


class FileTextCodec:
    """Tokenizer files saved beside an engine (``tokenizer.json``, ``tokenizer_config.json``,
    ``chat_template.jinja``), read with the ``tokenizers`` library and ``jinja2``: no transformers."""

    def __init__(self, folder):
        import json
        from pathlib import Path

        from tokenizers import Tokenizer

        folder = Path(folder)
        if not (folder / "tokenizer.json").is_file():
            raise PromptError(f"tokenizer files missing in {folder}: copy the engine's .tokenizer folder beside it or export again")
        self.tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        config_file = folder / "tokenizer_config.json"
        self.config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        template_file = folder / "chat_template.jinja"
        self.chat_template = template_file.read_text() if template_file.is_file() else self.config.get("chat_template")
        self._template = None

    @property
    def has_chat_template(self) -> bool:
        return self.chat_template is not None

    def _render(self, text: str) -> str:
        if self._template is None:
            from jinja2.ext import loopcontrols
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            def raise_exception(message):
                raise PromptError(f"chat template refused the prompt: {message}")

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
            env.globals["raise_exception"] = raise_exception
            self._template = env.from_string(self.chat_template)
        special = {k: v for k, v in self.config.items() if k.endswith("_token") and isinstance(v, str)}
        return self._template.render(messages=[{"role": "user", "content": text}], add_generation_prompt=True, **special)

    def encode(self, text: str, *, chat: bool) -> list[int]:
        if not text:
            raise PromptError("empty prompt: pass some text or token ids")
        if chat:  # the template writes the special tokens itself
            return self.tokenizer.encode(self._render(text), add_special_tokens=False).ids
        return self.tokenizer.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)
