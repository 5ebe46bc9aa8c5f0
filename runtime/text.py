"""Text in, token ids out and back: a thin adapter over whatever tokenizer the engine carries.

Duck-typed on the ``transformers`` tokenizer interface (``__call__``/``encode``, ``decode``,
``apply_chat_template``, ``chat_template``) so this module imports neither torch nor transformers.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from medusa_trt.runtime.errors import MedusaError


class PromptError(MedusaError):
    """A prompt the user passed cannot be run; the message says what to change."""


class TemplateKwargsError(PromptError):
    """``chat_template_kwargs`` the chat template cannot take; the message says which and why."""


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
    contents non-empty UTF-8 text; an assistant turn may carry its ``reasoning_content`` (text, as
    vLLM and transformers name a reasoning model's thinking: Qwen3's template renders it in
    ``<think>`` tags). Returns plain dicts of those keys for the chat template."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, (list, tuple)) or not messages:
        raise PromptError(f"{where} must be a non-empty list of {{'role', 'content'}} messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or set(m) - {"role", "content", "reasoning_content"} or not {"role", "content"} <= set(m):
            raise PromptError(
                f"{where}: message {i} must be a dict with exactly the keys 'role' and 'content' "
                f"(an assistant turn may add 'reasoning_content'), got {m!r:.80}"
            )
        if m["role"] not in ROLES:
            raise PromptError(f"{where}: message {i} has role {m['role']!r}: use one of {', '.join(ROLES)}")
        if not isinstance(m["content"], str):
            raise PromptError(f"{where}: message {i} content must be text, got {type(m['content']).__name__}")
        try:
            check_text(m["content"])
        except PromptError as exc:
            raise PromptError(f"{where}: message {i} ({m['role']}): {exc}") from exc
        message = {"role": m["role"], "content": m["content"]}
        if m.get("reasoning_content") is not None:
            reasoning = m["reasoning_content"]
            if m["role"] != "assistant" or not isinstance(reasoning, str):
                raise PromptError(f"{where}: message {i}: reasoning_content is text on an assistant message, got {reasoning!r:.80}")
            try:
                reasoning.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise PromptError(f"{where}: message {i}: reasoning_content is not valid UTF-8 text") from exc
            message["reasoning_content"] = reasoning
        out.append(message)
    return out


# what the codec passes the chat template itself, as transformers' apply_chat_template does
TEMPLATE_ARGS = ("messages", "add_generation_prompt", "tools", "documents")
_JSON_DEPTH = 16  # nesting a template variable may have


@functools.lru_cache(maxsize=16)
def template_variables(template: str) -> frozenset[str]:
    """The variables a chat template reads from its caller (``jinja2.meta``; the environment's globals,
    such as ``raise_exception``, left out)."""
    from jinja2 import meta

    env = _chat_environment()
    return frozenset(meta.find_undeclared_variables(env.parse(template)) - set(env.globals))


def check_template_kwargs(kwargs, variables: frozenset[str] | None) -> dict:
    """Extra variables for the chat template, as vLLM's ``chat_template_kwargs`` (Qwen3's
    ``{"enable_thinking": false}``): an object of JSON values, each named for a variable the template
    reads (``variables``; None: not checked), none of ``TEMPLATE_ARGS``. A name the template does not
    read is refused rather than ignored: the prompt would not be what the caller asked for."""
    where = "chat_template_kwargs"
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict):
        raise TemplateKwargsError(f"{where} must be an object of chat template variables, got {type(kwargs).__name__}")
    for key, value in kwargs.items():
        if not isinstance(key, str) or not key.isidentifier():
            raise TemplateKwargsError(f"{where}: {key!r} is not a template variable name")
        if key in TEMPLATE_ARGS:
            raise TemplateKwargsError(f"{where}: {key!r} is set by the server, not by the request: leave it out")
        if variables is not None and key not in variables:
            known = ", ".join(sorted(variables - set(TEMPLATE_ARGS))) or "none"
            raise TemplateKwargsError(f"{where}: the model's chat template does not read {key!r} (it reads: {known})")
        _check_json(value, f"{where}.{key}", 0)
    return dict(kwargs)


def _check_json(value, where: str, depth: int) -> None:
    if depth > _JSON_DEPTH:
        raise TemplateKwargsError(f"{where} nests deeper than {_JSON_DEPTH} levels")
    if value is None or isinstance(value, (bool, int, str)):
        return
    if isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")):
            raise TemplateKwargsError(f"{where} is not a JSON number: {value}")
        return
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _check_json(item, f"{where}[{i}]", depth + 1)
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise TemplateKwargsError(f"{where} has a key that is not text: {key!r}")
            _check_json(item, f"{where}.{key}", depth + 1)
        return
    raise TemplateKwargsError(f"{where} is not a JSON value: {type(value).__name__}")


def _template_messages(messages: list[dict]) -> list[dict]:
    """Messages as transformers hands them to a template: reasoning under ``thinking`` too (gpt-oss reads that)."""
    return [{"thinking": m["reasoning_content"], **m} if "reasoning_content" in m else m for m in messages]


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

    def _template_kwargs(self, template_kwargs) -> dict:
        template = self.tokenizer.chat_template
        return check_template_kwargs(template_kwargs, template_variables(template) if isinstance(template, str) else None)

    def render_chat(self, messages: list[dict], template_kwargs: dict | None = None, *, add_generation_prompt: bool = True) -> str:
        """The chat template's text for a conversation (transformers' ``apply_chat_template``)."""
        kwargs = self._template_kwargs(template_kwargs)
        messages = check_messages(messages)
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False, **kwargs)

    def encode_chat(self, messages: list[dict], template_kwargs: dict | None = None) -> list[int]:
        """A conversation ({"role", "content"} dicts, system / user / assistant turns) through the chat
        template, ready for the reply; ``template_kwargs``: extra template variables (``check_template_kwargs``)."""
        messages = check_messages(messages)
        kwargs = self._template_kwargs(template_kwargs)
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **kwargs)
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
        self._template, self.template_variables = None, frozenset()
        self.special_tokens = _special_tokens(self.config)  # what transformers passes as its special_tokens_map
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

        try:
            env = _chat_environment()
            self._template = env.from_string(self.chat_template)
            self.template_variables = template_variables(self.chat_template)
        except TemplateError as exc:
            raise TokenizerError(f"the chat template in {folder} is not valid Jinja ({_short(exc)}): fix it or export again") from exc

    @property
    def has_chat_template(self) -> bool:
        return self.chat_template is not None

    def render_chat(self, messages: list[dict], template_kwargs: dict | None = None, *, add_generation_prompt: bool = True) -> str:
        """The chat template's text for a conversation, as transformers' ``apply_chat_template`` renders
        it: the special tokens of tokenizer_config.json, ``tools`` and ``documents`` None, then
        ``template_kwargs`` (``check_template_kwargs``: they may override a special token, as there)."""
        from jinja2 import TemplateError

        if self.chat_template is None:
            raise PromptError("the tokenizer has no chat template: a conversation cannot be encoded")
        messages = _template_messages(check_messages(messages))
        kwargs = self.special_tokens | check_template_kwargs(template_kwargs, self.template_variables)
        try:
            return self._template.render(
                messages=messages, tools=None, documents=None, add_generation_prompt=add_generation_prompt, **kwargs
            )
        except TemplateRefused as exc:
            raise PromptError(f"the engine's chat template refused this conversation: {exc}") from None
        except (TemplateError, TypeError, ValueError, LookupError, AttributeError) as exc:  # what a template's own code may raise
            raise PromptError(f"the engine's chat template failed on this conversation ({_short(exc)}): pass chat_template=False") from exc

    def encode(self, text: str, *, chat: bool) -> list[int]:
        check_text(text)
        if chat:  # the template writes the special tokens itself
            return self.encode_chat([{"role": "user", "content": text}])
        return _some_tokens(self.encode_raw(text))

    def encode_raw(self, text: str) -> list[int]:
        """The tokenizer's ids for ``text`` (special tokens as its post-processor adds them), unchecked."""
        return self.tokenizer.encode(text).ids

    def encode_chat(self, messages: list[dict], template_kwargs: dict | None = None) -> list[int]:
        """A conversation ({"role", "content"} dicts, system / user / assistant turns) through the chat
        template, ready for the reply; ``template_kwargs``: extra template variables (``check_template_kwargs``).
        The template writes the special tokens itself: none are added."""
        return _some_tokens(self.tokenizer.encode(self.render_chat(messages, template_kwargs), add_special_tokens=False).ids)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)


def _special_tokens(config: dict) -> dict[str, str]:
    """The named special tokens of tokenizer_config.json (``bos_token``, ``eos_token``, Gemma-3's
    ``boi_token``...; an ``extra_special_tokens`` object's names too), as transformers' ``special_tokens_map``."""
    named = {k: v for k, v in config.items() if k.endswith("_token")}
    extra = config.get("extra_special_tokens")
    if isinstance(extra, dict):
        named |= {k: v for k, v in extra.items() if isinstance(k, str)}
    return {k: text for k, v in named.items() if (text := _token_text(v)) is not None}


class TemplateRefused(Exception):
    """A chat template's ``raise_exception(message)``: the conversation is not one it renders."""


def _chat_environment():
    """The Jinja environment transformers renders chat templates in (``chat_template_utils``):
    sandboxed, ``trim_blocks`` / ``lstrip_blocks``, loop controls, ``{% generation %}`` blocks (rendered
    as their body), ``raise_exception``, ``strftime_now``, a ``tojson`` that keeps non-ASCII and HTML
    characters as they are, ``dict``, and a ``namespace`` refusing underscore names."""
    import json
    from datetime import datetime

    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        tags = {"generation"}  # marks assistant text for training masks; renders its body

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise TemplateRefused(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    class TemplateDict:
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    class Namespace(jinja2.utils.Namespace):
        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                Namespace._check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            Namespace._check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check_name(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"a chat template cannot store an underscore name on a namespace, got {name!r}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda format: datetime.now().strftime(format)
    env.globals["dict"] = TemplateDict()
    env.globals["namespace"] = Namespace
    return env


def _token_text(value) -> str | None:
    """A special token as tokenizer_config.json stores it: a string, or an added-token dict with its ``content``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None
