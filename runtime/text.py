"""Text in, token ids out and back: a thin adapter over whatever tokenizer the engine carries.

Duck-typed on the ``transformers`` tokenizer interface (``__call__``/``encode``, ``decode``,
``apply_chat_template``, ``chat_template``) so this module imports neither torch nor transformers.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from medusa_trt.runtime.errors import MedusaError


class PromptError(MedusaError):
    """A prompt the user passed cannot be run; the message says what to change."""


class TokenizerError(MedusaError):
    """The tokenizer files beside an engine cannot be used; the message names the file."""


# distinct from an empty prompt: the text was there, the tokenizer's vocabulary had nothing for it
NO_TOKENS = (
    "the prompt encodes to no tokens with this engine's tokenizer (none of its text is in the vocabulary): "
    "pass text the model's vocabulary covers, or token ids"
)


def _some_tokens(ids: list[int]) -> list[int]:
    if not ids:
        raise PromptError(NO_TOKENS)
    return ids


def check_text(text: str) -> None:
    """A prompt or stop string must be non-empty text that encodes as UTF-8 (command-line bytes
    that are not UTF-8 arrive as lone surrogates)."""
    if not text:
        raise PromptError("empty prompt: pass some text or token ids")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise PromptError(f"the prompt is not valid UTF-8 text (position {exc.start}): pass UTF-8 text") from exc


ROLES = ("system", "user", "assistant")  # the turns a conversation prompt may hold


def check_messages(messages, where: str = "the conversation") -> list[dict]:
    """A conversation prompt: a non-empty list of {"role", "content"} dicts, roles from ``ROLES``,
    contents non-empty UTF-8 text. Returns plain {"role", "content"} dicts for the chat template."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, (list, tuple)) or not messages:
        raise PromptError(f"{where} must be a non-empty list of {{'role', 'content'}} messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or set(m) - {"role", "content"} or not {"role", "content"} <= set(m):
            raise PromptError(f"{where}: message {i} must be a dict with exactly the keys 'role' and 'content', got {m!r:.80}")
        if m["role"] not in ROLES:
            raise PromptError(f"{where}: message {i} has role {m['role']!r}: use one of {', '.join(ROLES)}")
        if not isinstance(m["content"], str):
            raise PromptError(f"{where}: message {i} content must be text, got {type(m['content']).__name__}")
        try:
            check_text(m["content"])
        except PromptError as exc:
            raise PromptError(f"{where}: message {i} ({m['role']}): {exc}") from exc
        out.append({"role": m["role"], "content": m["content"]})
    return out


def _short(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:200] or type(exc).__name__


@dataclass
class TextCodec:
    tokenizer: object

    @property
    def has_chat_template(self) -> bool:
        return getattr(self.tokenizer, "chat_template", None) is not None

    def encode(self, text: str, *, chat: bool) -> list[int]:
        check_text(text)
        if chat:
            return self.encode_chat([{"role": "user", "content": text}])
        return _some_tokens(self.encode_raw(text))

    def encode_raw(self, text: str) -> list[int]:
        """The tokenizer's ids for ``text`` (special tokens as its post-processor adds them), unchecked."""
        return [int(i) for i in self.tokenizer(text)["input_ids"]]

    def encode_chat(self, messages: list[dict]) -> list[int]:
        """A conversation ({"role", "content"} dicts, system / user / assistant turns) through the chat
        template, ready for the reply."""
        messages = check_messages(messages)
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        return _some_tokens([int(i) for i in ids])

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


class FileTextCodec:
    """Tokenizer files saved beside an engine (``tokenizer.json``, ``tokenizer_config.json``,
    ``chat_template.jinja``), read with the ``tokenizers`` library and ``jinja2``: no transformers.

    ``check``: encode the probe texts the export recorded (``runtime/tokenizer_probe.py``) and refuse
    files that no longer give the recorded ids (``TokenizerError``)."""

    def __init__(self, folder, *, check: bool = True):
        import json
        from pathlib import Path

        from tokenizers import Tokenizer

        folder = Path(folder)
        if not (folder / "tokenizer.json").is_file():
            raise PromptError(f"tokenizer files missing in {folder}: copy the engine's .tokenizer folder beside it or export again")
        try:
            self.tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        except Exception as exc:  # noqa: BLE001 - the tokenizers library raises its own untyped errors
            raise TokenizerError(
                f"{folder / 'tokenizer.json'} cannot be read ({_short(exc)}): copy the engine's tokenizer folder again or export again"
            ) from exc
        config_file = folder / "tokenizer_config.json"
        try:
            self.config = json.loads(config_file.read_text(encoding="utf-8")) if config_file.is_file() else {}
            if not isinstance(self.config, dict):
                raise ValueError("not a JSON object")
            template_file = folder / "chat_template.jinja"
            self.chat_template = template_file.read_text(encoding="utf-8") if template_file.is_file() else self.config.get("chat_template")
        except ValueError as exc:  # JSON or UTF-8 errors
            raise TokenizerError(f"tokenizer files in {folder} are corrupt ({_short(exc)}): copy them again or export again") from exc
        if self.chat_template is not None and not isinstance(self.chat_template, str):
            raise TokenizerError(f"{config_file}: chat_template is not a string (multiple named templates are not supported): export again")
        self._template = None
        if self.chat_template is not None:
            self._compile(folder)
        if check:
            self._check_probe(folder)

    def _check_probe(self, folder) -> None:
        from medusa_trt.runtime.tokenizer_probe import PROBE_FILE, first_difference, probe, read_probe

        try:
            recorded = read_probe(folder)
        except (ValueError, KeyError, TypeError) as exc:
            raise TokenizerError(
                f"{folder / PROBE_FILE} is corrupt ({_short(exc)}): copy the engine's tokenizer files again or export again"
            ) from exc
        if recorded is None:
            return
        # the texts only: a chat template may be added or changed after export (put chat_template.jinja beside the files)
        differs = first_difference(dataclasses.replace(recorded, chat=None), probe(self, recorded.texts, chat=False))
        if differs:
            raise TokenizerError(
                f"the engine's tokenizer {folder / 'tokenizer.json'} {differs}, unlike at export "
                "(edited or replaced since): copy the engine's tokenizer files again or export again"
            )

    def _compile(self, folder) -> None:
        """Compile the chat template once, so a broken one is named at load, not on the first request."""
        from jinja2 import TemplateError
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise PromptError(f"chat template refused the prompt: {message}")

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.globals["raise_exception"] = raise_exception
        try:
            self._template = env.from_string(self.chat_template)
        except TemplateError as exc:
            raise TokenizerError(f"the chat template in {folder} is not valid Jinja ({_short(exc)}): fix it or export again") from exc

    @property
    def has_chat_template(self) -> bool:
        return self.chat_template is not None

    def _render(self, messages: list[dict]) -> str:
        from jinja2 import TemplateError

        special = {k: _token_text(v) for k, v in self.config.items() if k.endswith("_token") and _token_text(v) is not None}
        try:
            return self._template.render(messages=messages, add_generation_prompt=True, **special)
        except TemplateError as exc:
            raise PromptError(f"the engine's chat template failed on this prompt ({_short(exc)}): pass chat_template=False") from exc

    def encode(self, text: str, *, chat: bool) -> list[int]:
        check_text(text)
        if chat:  # the template writes the special tokens itself
            return self.encode_chat([{"role": "user", "content": text}])
        return _some_tokens(self.encode_raw(text))

    def encode_raw(self, text: str) -> list[int]:
        """The tokenizer's ids for ``text`` (special tokens as its post-processor adds them), unchecked."""
        return self.tokenizer.encode(text).ids

    def encode_chat(self, messages: list[dict]) -> list[int]:
        """A conversation ({"role", "content"} dicts, system / user / assistant turns) through the chat
        template, ready for the reply."""
        if self.chat_template is None:
            raise PromptError("the tokenizer has no chat template: a conversation cannot be encoded")
        messages = check_messages(messages)
        return _some_tokens(self.tokenizer.encode(self._render(messages), add_special_tokens=False).ids)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)


def _token_text(value) -> str | None:
    """A special token as tokenizer_config.json stores it: a string, or an added-token dict with its ``content``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None
