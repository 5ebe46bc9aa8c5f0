"""Faithful engine tokenizers: the engine encodes exactly as the source model does.

Three source tokenizers, each made here with the ``tokenizers`` / ``sentencepiece`` trainers and saved
beside a tiny random model: a word-level vocabulary on a Qwen2 model whose tokenizer_config says
``PreTrainedTokenizerFast`` (transformers 5.24's ``AutoTokenizer`` rebuilt it as a byte-level BPE that
encoded "w1 w2 w3" to nothing), a GPT-2 style byte-level BPE with a ChatML template on a Llama model,
and a SentencePiece ``tokenizer.model`` (no tokenizer.json) on a Mistral model. Each is exported,
its engine ids compared with the source's on the probe texts, and served: ``MedusaRuntime``'s greedy
tokens equal transformers' on the source ids; the word-level engine also through a real Triton server
and the OpenAI server. A tampered tokenizer (one merge removed) is refused at export and at load; a
prompt that encodes to no tokens gets its own message on every path.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import CUSTOM_TREE, assert_greedy_identical, medusa_model, random_heads

from medusa_trt.exporter import load_base_model
from medusa_trt.exporter.onnx_export import ExportConfig, export_onnx
from medusa_trt.exporter.tokenizer_files import TokenizerExportError
from medusa_trt.runtime import MedusaRuntime
from medusa_trt.runtime.engine import EngineError, EngineFiles
from medusa_trt.runtime.manifest import write_manifest
from medusa_trt.runtime.text import NO_TOKENS, FileTextCodec, PromptError, TokenizerError
from medusa_trt.runtime.tokenizer_probe import PROBE_CONVERSATION, PROBE_FILE, PROBE_TEXTS

tokenizers = pytest.importorskip("tokenizers")

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SP_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}[assistant]{% endif %}"
)
CORPUS = [
    *PROBE_TEXTS,
    *(m["content"] for m in PROBE_CONVERSATION),
    "Once upon a time there was a little dog who liked to run in the park with his friends.",
    "The weather today is sunny, with a light breeze from the west and a high of 21 degrees.",
    "import numpy as np\nfor i in range(10):\n    print(i * 2)\n",
    "Les élèves étudient la géographie et l'histoire à l'école.",
    "東京は日本の首都です。北京是中国的首都。",
] * 4
WORDS = 124  # w1 .. w124 after four special tokens: 128 ids
KINDS = ("wordlevel-qwen2", "bpe-llama", "sentencepiece-mistral")
PROMPT = {"wordlevel-qwen2": "w1 w2 w3", "bpe-llama": "Once upon a time there was", "sentencepiece-mistral": "The weather today is"}


def _tiny_model(kind: str, vocab: int, folder: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config

    common = dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        initializer_range=0.2,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    config = {
        "qwen2": lambda: Qwen2Config(**common, use_sliding_window=False),
        "llama": lambda: LlamaConfig(**common),
        "mistral": lambda: MistralConfig(**common, sliding_window=None),
    }[kind]()
    torch.manual_seed(len(kind))
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)


def _wordlevel(folder: Path) -> int:
    from tokenizers import Tokenizer, models, pre_tokenizers

    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    vocab = {t: i for i, t in enumerate(specials)} | {f"w{i}": 3 + i for i in range(1, WORDS + 1)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(specials)
    tok.save(str(folder / "tokenizer.json"))
    _config(folder, tokenizer_class="PreTrainedTokenizerFast", bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>")
    return len(vocab)


def _bpe(folder: Path) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok.train_from_iterator(
        CORPUS,
        trainers.BpeTrainer(
            vocab_size=400, special_tokens=specials, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        ),
    )
    tok.save(str(folder / "tokenizer.json"))
    _config(
        folder,
        tokenizer_class="GPT2Tokenizer",
        bos_token="<|endoftext|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHATML,
    )
    return tok.get_vocab_size()


def _sentencepiece(folder: Path) -> int:
    spm = pytest.importorskip("sentencepiece")
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS),
        model_prefix=str(folder / "tokenizer"),
        vocab_size=400,
        model_type="bpe",
        byte_fallback=True,
        character_coverage=1.0,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        minloglevel=2,
    )
    (folder / "tokenizer.vocab").unlink()
    _config(
        folder,
        tokenizer_class="LlamaTokenizer",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        add_bos_token=True,
        add_eos_token=False,
        chat_template=SP_TEMPLATE,
    )
    return 400


def _config(folder: Path, **fields) -> None:
    (folder / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 256, **fields}, indent=1))


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """kind -> a Hugging Face model folder with that tokenizer (made once per module)."""
    made: dict[str, Path] = {}

    def make(kind: str) -> Path:
        if kind not in made:
            folder = tmp_path_factory.mktemp(kind)
            vocab = {"wordlevel-qwen2": _wordlevel, "bpe-llama": _bpe, "sentencepiece-mistral": _sentencepiece}[kind](folder)
            _tiny_model(kind.split("-")[1], vocab, folder)
            made[kind] = folder
        return made[kind]

    return make


@pytest.fixture(scope="module")
def exported(source, tmp_path_factory):
    """kind -> (the loaded base model, its engine folder) with three random heads over CUSTOM_TREE."""
    made: dict[str, tuple] = {}

    def make(kind: str):
        if kind not in made:
            base = load_base_model(source(kind))
            out = tmp_path_factory.mktemp(f"engine-{kind}") / "engine"
            config = ExportConfig(out=out, tree=CUSTOM_TREE, max_batch=2, max_context=128, backend="onnxruntime")
            export_onnx(medusa_model(base, random_heads(base, 3)), config)
            made[kind] = (base, out)
        return made[kind]

    return make


def _source_ids(folder: Path, base, text: str) -> list[int]:
    """The source's own ids: the tokenizers library on its tokenizer.json, else transformers."""
    if (folder / "tokenizer.json").is_file():
        return tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json")).encode(text).ids
    return base.tokenizer(text)["input_ids"]


@pytest.mark.parametrize("kind", KINDS)
def test_engine_encodes_like_the_source_and_generates_its_tokens(kind, source, exported):
    folder = source(kind)
    base, engine = exported(kind)
    codec = FileTextCodec(engine)
    for text in PROBE_TEXTS:
        want = _source_ids(folder, base, text)
        assert codec.encode_raw(text) == want, text
        assert codec.decode(want) == base.tokenizer.decode(want, skip_special_tokens=True), text
    if (folder / "tokenizer.json").is_file():  # copied byte for byte, special tokens and template with it
        for name in ("tokenizer.json", "tokenizer_config.json"):
            assert (engine / name).read_bytes() == (folder / name).read_bytes(), name
    if base.tokenizer.chat_template is not None:
        conversation = [dict(m) for m in PROBE_CONVERSATION]
        want = base.tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True)
        want = want["input_ids"] if hasattr(want, "keys") else want
        assert codec.encode_chat(conversation) == list(want)
    assert json.loads((engine / PROBE_FILE).read_text())["texts"][: len(PROBE_TEXTS)] == list(PROBE_TEXTS)
    # served: the runtime encodes the prompt as the source does and generates the model's own greedy tokens
    ids = _source_ids(folder, base, PROMPT[kind])
    assert ids, "the prompt is made of the vocabulary"
    result = MedusaRuntime(str(engine)).generate(PROMPT[kind], max_new_tokens=12, chat_template=False)
    assert_greedy_identical(base, ids, result.token_ids, 12, base.eos_token_ids)


def test_a_wordlevel_source_keeps_its_ids(source, exported):
    """A word-level tokenizer: "w1 w2 w3" is [4, 5, 6] in the source, and so in the engine."""
    base, engine = exported("wordlevel-qwen2")
    assert json.loads((source("wordlevel-qwen2") / "tokenizer_config.json").read_text())["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert base.model.config.model_type == "qwen2"
    assert FileTextCodec(engine).encode("w1 w2 w3", chat=False) == [4, 5, 6]
    assert base.tokenizer("w1 w2 w3")["input_ids"] == [4, 5, 6]  # the torch path too


def _drop_first_merge(tokenizer_json: Path) -> None:
    raw = json.loads(tokenizer_json.read_text(encoding="utf-8"))
    raw["model"]["merges"] = raw["model"]["merges"][1:]
    tokenizer_json.write_text(json.dumps(raw, ensure_ascii=False), encoding="utf-8")


def test_a_tampered_tokenizer_is_refused_at_export(source, tmp_path, monkeypatch):
    """The engine's copy loses one merge: the export stops with one line naming the file and the
    first probe text that differs, and leaves nothing behind."""
    from medusa_trt.exporter import onnx_export

    real = onnx_export.write_engine_tokenizer

    def tampered(tokenizer, src, target):
        real(tokenizer, src, target)
        _drop_first_merge(target / "tokenizer.json")

    monkeypatch.setattr(onnx_export, "write_engine_tokenizer", tampered)
    base = load_base_model(source("bpe-llama"))
    out = tmp_path / "engine"
    with pytest.raises(TokenizerExportError) as caught:
        export_onnx(medusa_model(base, random_heads(base, 3)), ExportConfig(out=out, tree=CUSTOM_TREE, max_batch=2, max_context=128))
    message = str(caught.value)
    assert "\n" not in message and "nothing was written" in message
    assert message.startswith(f"the engine's tokenizer {out / 'tokenizer.json'} encodes \"The quick brown fox")
    assert re.search(r"to \d+ ids instead of \d+, differing from id \d+: \[[\d, .]+\] instead of \[[\d, .]+\], the ids of ", message)
    assert message.endswith(
        f"the ids of {source('bpe-llama') / 'tokenizer.json'}: nothing was written; report this with the model's tokenizer files"
    )
    assert list(tmp_path.iterdir()) == []  # no engine, no staging folder


def test_a_tampered_tokenizer_is_refused_at_load(exported, tmp_path):
    _, engine = exported("bpe-llama")
    copy = shutil.copytree(engine, tmp_path / "engine")
    _drop_first_merge(copy / "tokenizer.json")
    with pytest.raises(EngineError, match="tokenizer.json has .* bytes but the export wrote"):  # the manifest names it first
        MedusaRuntime(str(copy))
    write_manifest(EngineFiles.in_folder(copy))  # the manifest rewritten to match: the probe still refuses it
    with pytest.raises(TokenizerError, match=r"tokenizer\.json encodes \"The quick brown fox.*unlike at export"):
        MedusaRuntime(str(copy))
    with pytest.raises(TokenizerError, match="unlike at export"):
        FileTextCodec(copy)
    # an engine exported before probes (no tokenizer_probe.json) loads unchecked
    shutil.copyfile(engine / "tokenizer.json", copy / "tokenizer.json")
    (copy / PROBE_FILE).unlink()
    write_manifest(EngineFiles.in_folder(copy))
    assert MedusaRuntime(str(copy)).generate(PROMPT["bpe-llama"], max_new_tokens=4, chat_template=False).token_ids


def test_a_chat_template_added_after_export_still_loads(exported, tmp_path):
    """The probe checks the tokenizer at load, not the chat template, which users may add beside the files."""
    _, engine = exported("wordlevel-qwen2")
    copy = shutil.copytree(engine, tmp_path / "engine")
    (copy / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }} {% endfor %}")
    write_manifest(EngineFiles.in_folder(copy))
    assert FileTextCodec(copy).encode_chat([{"role": "user", "content": "w7 w8"}]) == [10, 11]


def test_text_that_encodes_to_no_tokens_has_its_own_message(exported, tmp_path):
    """Whitespace is text, but the word-level tokenizer has no token for it: not 'empty'."""
    _, engine = exported("wordlevel-qwen2")
    runtime = MedusaRuntime(str(engine))
    with pytest.raises(PromptError) as caught:
        runtime.generate("   ", max_new_tokens=4, chat_template=False)
    assert str(caught.value) == NO_TOKENS and "encodes to no tokens with this engine's tokenizer" in NO_TOKENS
    with pytest.raises(PromptError, match="empty prompt"):
        runtime.generate("", max_new_tokens=4, chat_template=False)
    from medusa_trt.runtime.batching import ContinuousBatcher, Request

    batcher = ContinuousBatcher(runtime)  # the servers' path: refused at submit, before any step
    try:
        with pytest.raises(PromptError, match="encodes to no tokens"):
            batcher.submit(Request(prompt="  ", max_new_tokens=4, chat_template=False))
    finally:
        batcher.close()
    run = subprocess.run(
        [sys.executable, "-m", "medusa_trt.cli.run", "--engine", str(engine), "--prompt", "   ", "--max-new-tokens", "4"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 2 and "encodes to no tokens" in run.stderr and "Traceback" not in run.stderr
    assert len(run.stderr.strip().splitlines()) == 1, run.stderr


# ---------------------------------------------------------------------------------- served by both servers


def test_wordlevel_engine_through_the_openai_server(exported, tmp_path):
    pytest.importorskip("fastapi", reason="the OpenAI server needs the serve extra")
    httpx = pytest.importorskip("httpx", reason="httpx is in the test extra")
    from test_openai_server import Server

    _, engine = exported("wordlevel-qwen2")
    want = MedusaRuntime(str(engine)).generate("w1 w2 w3", max_new_tokens=12, chat_template=False)
    server = Server(engine, log=tmp_path / "serve.log")
    try:
        answer = httpx.post(
            f"{server.url}/v1/completions", json={"model": "engine", "prompt": "w1 w2 w3", "max_tokens": 12, "temperature": 0}, timeout=120
        )
        assert answer.status_code == 200, answer.text
        body = answer.json()
        assert body["choices"][0]["text"] == want.text and body["usage"]["completion_tokens"] == len(want.token_ids)
        assert body["usage"]["prompt_tokens"] == 3
        refused = httpx.post(f"{server.url}/v1/completions", json={"model": "engine", "prompt": "   ", "max_tokens": 4}, timeout=60)
        assert refused.status_code == 400 and "encodes to no tokens" in refused.json()["error"]["message"]
    finally:
        assert server.stop() == 0, server.log.read_text()[-3000:]


def test_wordlevel_engine_through_triton(serving, exported, tmp_path):
    from medusa_trt.serving.client import RequestFailed, stream_generate
    from medusa_trt.serving.schema import ServeDefaults
    from medusa_trt.serving.triton import ServeConfig, TritonServer
    from medusa_trt.serving.triton_repo import TritonRepoConfig, write_triton_repo

    _, engine = exported("wordlevel-qwen2")
    want = MedusaRuntime(str(engine)).generate("w1 w2 w3", max_new_tokens=12, chat_template=False)
    write_triton_repo(TritonRepoConfig(engine=engine, repo=tmp_path / "repo", defaults=ServeDefaults(max_tokens=12)))
    with TritonServer(ServeConfig(repo=tmp_path / "repo", log_file=tmp_path / "tritonserver.log")) as server:
        chunks = list(stream_generate(server.grpc_address, "w1 w2 w3", max_tokens=12))
        assert [t for c in chunks for t in c.token_ids] == want.token_ids
        assert "".join(c.text for c in chunks) == want.text
        with pytest.raises(RequestFailed, match="encodes to no tokens"):
            list(stream_generate(server.grpc_address, "   ", max_tokens=4))
