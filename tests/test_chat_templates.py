"""The chat templates of the model families: Qwen3's (with its thinking switch),
Gemma-2's and Gemma-3's, Phi-3's, rendered by the engine's lean codec as transformers renders them.

The templates are the published ones (``tests/fixtures/chat_templates/``, origin in its README). Each
family's tokenizer is made here: a small BPE trained with the ``tokenizers`` library through the
pipeline of the family's own transformers class (Qwen2Tokenizer's byte-level BPE, GemmaTokenizer's and
LlamaTokenizer's SentencePiece-style BPE with byte fallback), with the family's special and added
tokens and tokenizer_config.json, saved by that class. An engine's tokenizer folder is written from it
by ``exporter/tokenizer_files.py`` (probe checked and recorded); then:

- ``FileTextCodec`` (jinja2 + tokenizers, no transformers) renders the same text and ids as
  ``AutoTokenizer.apply_chat_template`` on system / user / assistant conversations, with and without
  the generation prompt, Qwen3 with ``enable_thinking`` true, false and unset and with reasoning in
  its history; Gemma-2 refuses a system turn with its own message as a ``PromptError``;
- the Jinja environment's features (``tojson``, ``strftime_now``, ``namespace``, loop controls,
  ``{% generation %}``, special tokens of ``extra_special_tokens``) render as transformers';
- ``chat_template_kwargs`` are checked: an object of JSON values, named for variables the template reads;
- the real OpenAI server (``medusa-serve``) on a stories260K engine carrying each family's tokenizer
  answers /v1/chat/completions with the codec's prompt ids (``usage.prompt_tokens``) and the runtime's
  greedy tokens for them, and takes Qwen3's ``chat_template_kwargs`` {"enable_thinking": false}.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import CUSTOM_TREE, medusa_model, random_heads

from medusa_trt.exporter.tokenizer_files import SOURCE_FILES, check_engine_tokenizer, write_engine_tokenizer
from medusa_trt.runtime.text import FileTextCodec, PromptError, TemplateKwargsError
from medusa_trt.runtime.tokenizer_probe import PROBE_FILE

tokenizers = pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")

FIXTURES = Path(__file__).parent / "fixtures" / "chat_templates"
STORIES_VOCAB = 512  # the served model's vocabulary: every family's tokenizer fits in it


@dataclass(frozen=True)
class Family:
    """One family's tokenizer as its published tokenizer_config.json and tokenizer.json lay it out."""

    template: str  # file under FIXTURES
    tokenizer_class: str  # transformers class; its pipeline (normalizer, pre-tokenizer) is the fixture's
    vocab_specials: tuple[str, ...]  # special tokens at the start of the BPE vocabulary (ids 0, 1, ...)
    byte_fallback: bool  # SentencePiece-style <0xNN> byte tokens in the vocabulary (else byte-level BPE)
    special_tokens: dict  # tokenizer_config.json's named tokens
    added: tuple[tuple[str, bool, bool], ...]  # (content, special, rstrip) added after the vocabulary
    extra_special_tokens: dict | None = None  # Gemma-3's named image tokens


FAMILIES = {
    "qwen3": Family(
        "qwen3.jinja",
        "Qwen2Tokenizer",
        ("<|endoftext|>",),
        False,
        dict(bos_token=None, eos_token="<|im_end|>", pad_token="<|endoftext|>", unk_token=None),
        (
            ("<|im_start|>", True, False),
            ("<|im_end|>", True, False),
            ("<think>", False, False),  # Qwen3's thinking tags are added tokens, not special ones
            ("</think>", False, False),
            ("<tool_call>", False, False),
            ("</tool_call>", False, False),
            ("<tool_response>", False, False),
            ("</tool_response>", False, False),
        ),
    ),
    "gemma2": Family(
        "gemma2.jinja",
        "GemmaTokenizer",
        ("<pad>", "<eos>", "<bos>", "<unk>", "<mask>"),
        True,
        dict(bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>", mask_token="<mask>"),
        (("<start_of_turn>", True, False), ("<end_of_turn>", True, False)),
    ),
    "gemma3": Family(
        "gemma3.jinja",
        "GemmaTokenizer",
        ("<pad>", "<eos>", "<bos>", "<unk>", "<mask>"),
        True,
        dict(bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>", mask_token="<mask>"),
        (
            ("<start_of_turn>", True, False),
            ("<end_of_turn>", True, False),
            ("<start_of_image>", True, False),
            ("<end_of_image>", True, False),
            ("<image_soft_token>", True, False),
        ),
        extra_special_tokens={"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"},
    ),
    "phi3": Family(
        "phi3.jinja",
        "LlamaTokenizer",
        ("<unk>", "<s>", "</s>"),
        True,
        dict(bos_token="<s>", eos_token="<|endoftext|>", pad_token="<|endoftext|>", unk_token="<unk>"),
        # Phi-3's chat tokens strip the whitespace after them (rstrip), as its tokenizer.json has them
        (
            ("<|endoftext|>", True, False),
            ("<|assistant|>", True, True),
            ("<|system|>", True, True),
            ("<|end|>", True, True),
            ("<|user|>", True, True),
        ),
    ),
}

SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
USER = {"role": "user", "content": "What is the capital of France?"}
REPLY = {"role": "assistant", "content": "The capital of France is Paris."}
FOLLOW_UP = {"role": "user", "content": "And of Italy? Réponds en un mot."}
THOUGHT = {"role": "assistant", "content": "<think>\nThe user asks for a capital city.\n</think>\n\nThe capital of France is Paris."}
REASONED = {"role": "assistant", "content": "Rome.", "reasoning_content": "Italy's capital is Rome."}
CONVERSATIONS = {
    "user": [USER],
    "multi-turn": [USER, REPLY, FOLLOW_UP],
    "system multi-turn": [SYSTEM, USER, REPLY, FOLLOW_UP],
    "thinking in history": [SYSTEM, USER, THOUGHT, FOLLOW_UP],  # Qwen3 drops the thought of an earlier turn
    "reasoning_content last": [USER, REPLY, FOLLOW_UP, REASONED],  # ... and keeps the last reply's
}
CORPUS = [
    *(m["content"] for c in CONVERSATIONS.values() for m in c),
    "Hello there, how are you today?",
    "user\nmodel\nassistant\nsystem\n\n",
]


def make_family_tokenizer(name: str, folder: Path) -> Path:
    """``name``'s tokenizer files in ``folder``, saved by its transformers class, template included."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers, trainers

    family = FAMILIES[name]
    cls = getattr(transformers, family.tokenizer_class)
    pipeline = cls().backend_tokenizer  # the class's own normalizer and pre-tokenizer
    bpe = Tokenizer(models.BPE(byte_fallback=family.byte_fallback))
    bpe.normalizer, bpe.pre_tokenizer = pipeline.normalizer, pipeline.pre_tokenizer
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)] if family.byte_fallback else []
    bpe.train_from_iterator(
        CORPUS * 3,
        trainers.BpeTrainer(
            vocab_size=460,
            special_tokens=[*family.vocab_specials, *byte_tokens],
            initial_alphabet=[] if family.byte_fallback else pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    model = json.loads(bpe.to_str())["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    tokenizer = cls(vocab=model["vocab"], merges=merges, **family.special_tokens)
    tokenizer.add_tokens([AddedToken(c, special=s, rstrip=r, normalized=False) for c, s, r in family.added])
    tokenizer.chat_template = (FIXTURES / family.template).read_text(encoding="utf-8")
    tokenizer.save_pretrained(str(folder))
    if family.extra_special_tokens:
        config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
        config["extra_special_tokens"] = family.extra_special_tokens
        (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    return folder


def write_tokenizer_folder(source: Path, target: Path):
    """An engine's tokenizer files in ``target`` from the family folder ``source``, as the exporter writes
    and checks them; returns the transformers tokenizer of ``source``."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(source))
    write_engine_tokenizer(tokenizer, source, target)
    check_engine_tokenizer(tokenizer, source, target, STORIES_VOCAB)
    return tokenizer


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    """name -> (the family's transformers tokenizer, its source folder, an engine tokenizer folder)."""
    made: dict[str, tuple] = {}

    def make(name: str):
        if name not in made:
            source = make_family_tokenizer(name, tmp_path_factory.mktemp(f"{name}-source"))
            target = tmp_path_factory.mktemp(f"{name}-engine-tokenizer")
            made[name] = (write_tokenizer_folder(source, target), source, target)
        return made[name]

    return make


def _apply(tokenizer, conversation, *, tokenize: bool, add_generation_prompt: bool = True, **kwargs):
    out = tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt, tokenize=tokenize, **kwargs)
    return list(out["input_ids"]) if hasattr(out, "keys") else out


def _cases():
    for name in FAMILIES:
        for case, conversation in CONVERSATIONS.items():
            if name == "gemma2" and conversation[0]["role"] == "system":
                continue  # refused: test_gemma2_refuses_a_system_turn_with_its_own_message
            yield pytest.param(name, case, id=f"{name}-{case}")


# ---------------------------------------------------------------------------------- the codec equals transformers


@pytest.mark.parametrize(("name", "case"), list(_cases()))
def test_the_codec_renders_as_transformers(family, name, case):
    tokenizer, source, folder = family(name)
    assert type(tokenizer).__name__ == FAMILIES[name].tokenizer_class  # the family's own class, not a generic one
    codec = FileTextCodec(folder)  # probe checked: the folder is as the exporter recorded it
    conversation = CONVERSATIONS[case]
    for prompt in (True, False):
        want = _apply(tokenizer, conversation, tokenize=False, add_generation_prompt=prompt)
        assert codec.render_chat(conversation, add_generation_prompt=prompt) == want
    assert codec.encode_chat(conversation) == _apply(tokenizer, conversation, tokenize=True)


def test_the_family_tokenizers_are_as_published(family):
    """What the templates rely on: the tokens they write are single ids, Qwen3 has no BOS, Gemma renders its BOS."""
    for name in FAMILIES:
        tokenizer, _, folder = family(name)
        assert len(tokenizer) <= STORIES_VOCAB
        for content, _, _ in FAMILIES[name].added:
            assert len(tokenizer.encode(content, add_special_tokens=False)) == 1, (name, content)
        first = FileTextCodec(folder).encode_chat([USER])[0]
        assert tokenizer.convert_ids_to_tokens(first) == {"qwen3": "<|im_start|>", "phi3": "<|user|>"}.get(name, "<bos>")
        assert (folder / PROBE_FILE).is_file()  # written by the exporter's check, the source's files copied as they are
        assert (folder / "tokenizer.json").read_bytes() == (family(name)[1] / "tokenizer.json").read_bytes()


def test_qwen3_thinking_switch(family):
    tokenizer, _, folder = family("qwen3")
    codec = FileTextCodec(folder)
    conversation = [SYSTEM, USER, THOUGHT, FOLLOW_UP]
    plain = codec.render_chat(conversation)
    on = codec.render_chat(conversation, {"enable_thinking": True})
    off = codec.render_chat(conversation, {"enable_thinking": False})
    assert plain == on and plain.endswith("<|im_start|>assistant\n")
    assert off == plain + "<think>\n\n</think>\n\n"  # the switch closes an empty thought for the model
    assert "The user asks for a capital city" not in plain  # the earlier turn's thought is dropped
    for kwargs in ({}, {"enable_thinking": True}, {"enable_thinking": False}):
        assert codec.render_chat(conversation, kwargs) == _apply(tokenizer, conversation, tokenize=False, **kwargs)
        assert codec.encode_chat(conversation, kwargs) == _apply(tokenizer, conversation, tokenize=True, **kwargs)
    think, end = tokenizer.convert_tokens_to_ids(["<think>", "</think>"])
    off_ids = codec.encode_chat(conversation, {"enable_thinking": False})
    assert off_ids[-4:-1] == [think, tokenizer.encode("\n\n", add_special_tokens=False)[0], end]
    # the last reply's reasoning, given as reasoning_content, is rendered in <think> tags as transformers does
    last = codec.render_chat(CONVERSATIONS["reasoning_content last"], add_generation_prompt=False)
    assert last.endswith("<|im_start|>assistant\n<think>\nItaly's capital is Rome.\n</think>\n\nRome.<|im_end|>\n")


def test_gemma2_refuses_a_system_turn_with_its_own_message(family):
    from jinja2 import TemplateError

    tokenizer, _, folder = family("gemma2")
    codec = FileTextCodec(folder)
    conversation = [SYSTEM, USER]
    with pytest.raises(TemplateError, match="System role not supported"):
        _apply(tokenizer, conversation, tokenize=True)
    with pytest.raises(PromptError) as caught:
        codec.encode_chat(conversation)
    assert str(caught.value) == "the engine's chat template refused this conversation: System role not supported"
    with pytest.raises(PromptError, match="refused this conversation: Conversation roles must alternate user/assistant"):
        codec.encode_chat([USER, USER])
    # Gemma-3 folds the system turn into the first user turn instead
    assert "You are a helpful assistant.\n\nWhat is the capital" in FileTextCodec(family("gemma3")[2]).render_chat([SYSTEM, USER])


# ---------------------------------------------------------------------------------- the Jinja environment

FEATURES = (
    "{% set ns = namespace(n=0) %}{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}"
    "{% set ns.n = ns.n + 1 %}{% generation %}{{ m.content | tojson }}{% endgeneration %}{{ '\\n' }}{% endfor %}"
    "{{ ns.n }} {{ boi_token }} {{ extra | tojson(indent=2) }} {{ strftime_now('%Y') }} {{ dict(a=1) | tojson }}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def test_the_jinja_environment_is_transformers(family, tmp_path):
    """tojson keeps non-ASCII and HTML characters (jinja2's own escapes them), namespace, loop controls,
    {% generation %}, strftime_now, dict, extra_special_tokens' names and a JSON kwarg, as transformers renders them."""
    tokenizer, source, _ = family("gemma3")
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(source))
    tokenizer.chat_template = FEATURES
    folder = tmp_path / "tokenizer"
    folder.mkdir()
    for name in SOURCE_FILES:
        if (source / name).is_file():
            shutil.copyfile(source / name, folder / name)
    (folder / "chat_template.jinja").write_text(FEATURES, encoding="utf-8")
    codec = FileTextCodec(folder, check=False)
    conversation = [SYSTEM, {"role": "user", "content": 'Café <b>"bold"</b> & 日本'}, REPLY]
    extra = {"extra": {"é": [1, 2.5, None, True], "<tag>": "x"}}
    want = _apply(tokenizer, conversation, tokenize=False, **extra)
    assert codec.render_chat(conversation, extra) == want
    assert '"Café <b>\\"bold\\"</b> & 日本"' in want and "\n2 <start_of_image> {\n" in want
    assert codec.encode_chat(conversation, extra) == _apply(tokenizer, conversation, tokenize=True, **extra)
    # a namespace refuses underscore names, as transformers' does
    (folder / "chat_template.jinja").write_text("{% set ns = namespace(_x=1) %}{{ ns._x }}", encoding="utf-8")
    with pytest.raises(PromptError, match="underscore"):
        FileTextCodec(folder, check=False).encode_chat([USER])


# ---------------------------------------------------------------------------------- chat_template_kwargs


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (["enable_thinking"], "chat_template_kwargs must be an object of chat template variables, got list"),
        ({"messages": []}, "chat_template_kwargs: 'messages' is set by the server, not by the request: leave it out"),
        ({"add_generation_prompt": False}, "'add_generation_prompt' is set by the server"),
        # jinja2.meta counts the names the template sets inside its loop as read too: allowed, as transformers would pass them
        ({"enable_reasoning": True}, "does not read 'enable_reasoning' (it reads: content, enable_thinking, reasoning_content)"),
        ({"not a name": 1}, "chat_template_kwargs: 'not a name' is not a template variable name"),
        ({"enable_thinking": object()}, "chat_template_kwargs.enable_thinking is not a JSON value: object"),
        ({"enable_thinking": [float("nan")]}, "chat_template_kwargs.enable_thinking[0] is not a JSON number: nan"),
        ({"enable_thinking": {1: True}}, "chat_template_kwargs.enable_thinking has a key that is not text: 1"),
    ],
)
def test_chat_template_kwargs_are_checked(family, kwargs, message):
    codec = FileTextCodec(family("qwen3")[2])
    with pytest.raises(TemplateKwargsError) as caught:
        codec.encode_chat([USER], kwargs)
    assert message in str(caught.value)
    assert isinstance(caught.value, PromptError)


def test_a_template_without_the_switch_refuses_it(family):
    """Gemma's template has no thinking switch: asked for one, the codec says so instead of ignoring it."""
    with pytest.raises(TemplateKwargsError, match=r"does not read 'enable_thinking' \(it reads: bos_token, role\)"):
        FileTextCodec(family("gemma2")[2]).encode_chat([USER], {"enable_thinking": False})
    deep: dict = {}
    node = deep
    for _ in range(20):
        node["a"] = {}
        node = node["a"]
    with pytest.raises(TemplateKwargsError, match="nests deeper than 16 levels"):
        FileTextCodec(family("qwen3")[2]).encode_chat([USER], {"enable_thinking": deep})


# ---------------------------------------------------------------------------------- the OpenAI server


@pytest.fixture(scope="module")
def stories_engine(stories_base, tmp_path_factory):
    """A stories260K engine folder with random heads (its own tokenizer: replaced per family below);
    unverified, with a fixed drafting budget: the exports elsewhere check the graphs, this one is fast."""
    from medusa_trt.exporter.onnx_export import ExportConfig, export_onnx
    from medusa_trt.runtime.drafting.builder import DEFAULT_STEP_COST

    out = tmp_path_factory.mktemp("stories") / "engine"
    config = ExportConfig(
        out=out, tree=CUSTOM_TREE, max_batch=2, max_context=256, verify=False, step_cost=dict(DEFAULT_STEP_COST), backend="onnxruntime"
    )
    export_onnx(medusa_model(stories_base, random_heads(stories_base, 3)), config)
    return out


def family_engine(stories_engine: Path, source: Path, target: Path) -> Path:
    """A copy of ``stories_engine`` whose tokenizer files are the family's, the manifest rewritten."""
    from medusa_trt.runtime.engine import EngineFiles
    from medusa_trt.runtime.manifest import write_manifest

    shutil.copytree(stories_engine, target)
    for name in (*SOURCE_FILES, PROBE_FILE, "special_tokens_map.json"):
        (target / name).unlink(missing_ok=True)
    write_tokenizer_folder(source, target)
    write_manifest(EngineFiles.in_folder(target))
    return target


@pytest.mark.parametrize("name", list(FAMILIES))
def test_the_openai_server_renders_the_family_template(name, family, stories_engine, tmp_path):
    pytest.importorskip("fastapi", reason="the OpenAI server needs the serve extra")
    httpx = pytest.importorskip("httpx", reason="httpx is in the test extra")
    from test_openai_server import Server

    from medusa_trt.runtime import MedusaRuntime

    _, source, _ = family(name)
    engine = family_engine(stories_engine, source, tmp_path / "engine")
    runtime = MedusaRuntime(str(engine))
    conversation = CONVERSATIONS["multi-turn" if name == "gemma2" else "system multi-turn"]
    server = Server(engine, log=tmp_path / "serve.log")

    def chat(**fields):
        body = {"model": "engine", "messages": conversation, "max_tokens": 8, "temperature": 0} | fields
        return httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120)

    try:
        ids = runtime.codec.encode_chat(conversation)
        answer = chat()
        assert answer.status_code == 200, answer.text
        body = answer.json()
        assert body["usage"]["prompt_tokens"] == len(ids)
        want = runtime.generate(ids, max_new_tokens=8)
        assert body["choices"][0]["message"]["content"] == want.text
        assert body["usage"]["completion_tokens"] == len(want.token_ids)
        if name == "qwen3":  # the thinking switch, as vLLM takes it
            off = runtime.codec.encode_chat(conversation, {"enable_thinking": False})
            assert len(off) == len(ids) + 4  # <think> \n\n </think> \n\n
            answer = chat(chat_template_kwargs={"enable_thinking": False})
            assert answer.status_code == 200, answer.text
            assert answer.json()["usage"]["prompt_tokens"] == len(off)
            assert answer.json()["choices"][0]["message"]["content"] == runtime.generate(off, max_new_tokens=8).text
            assert chat(chat_template_kwargs={"enable_thinking": True}).json()["usage"]["prompt_tokens"] == len(ids)
            # the runtime takes a conversation whose last reply carries its reasoning_content
            reasoned = CONVERSATIONS["reasoning_content last"] + [FOLLOW_UP]
            want = runtime.generate(runtime.codec.encode_chat(reasoned), max_new_tokens=4).token_ids
            assert runtime.generate(reasoned, max_new_tokens=4).token_ids == want
            for bad, message in (
                (["enable_thinking"], "chat_template_kwargs: Input should be an object"),
                ({"enable_reasoning": False}, "does not read 'enable_reasoning' (it reads: content, enable_thinking, reasoning_content)"),
                ({"messages": []}, "'messages' is set by the server"),
            ):
                refused = chat(chat_template_kwargs=bad)
                assert refused.status_code == 400, refused.text
                error = refused.json()["error"]
                assert message in error["message"] and error["param"] == "chat_template_kwargs"
                assert error["type"] == "invalid_request_error"
        if name == "gemma2":  # the template's own refusal is a 400 naming the messages
            refused = chat(messages=[SYSTEM, USER])
            assert refused.status_code == 400, refused.text
            error = refused.json()["error"]
            assert error["message"] == "the engine's chat template refused this conversation: System role not supported"
            assert error["param"] == "messages"
    finally:
        assert server.stop() == 0, server.log.read_text()[-3000:]
