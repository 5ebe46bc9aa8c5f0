"""Base models by Hugging Face id: an id in the local Hugging Face cache loads offline, as the hub
lays a download out (blobs, snapshot links, refs/main), from HF_HUB_CACHE or HF_HOME; an id not
in the cache is one clear error, in the library and on the command line."""

from __future__ import annotations

import hashlib
import os
import shutil
import socket
from pathlib import Path

import pytest
import torch

from medusa_trt.exporter.models import ModelLoadError, hf_hub_cache, is_hub_id, load_base_model

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def fake_hub_cache(cache: Path, repo_id: str, source: Path, commit: str = COMMIT) -> Path:
    """Lay ``source``'s files out in ``cache`` as huggingface_hub stores a download of ``repo_id``:
    content-named blobs, a snapshot folder of relative links to them, refs/main naming the commit."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True)
    for file in sorted(p for p in source.rglob("*") if p.is_file()):
        data = file.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        link = snapshot / file.relative_to(source)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return snapshot


@pytest.fixture
def no_network(monkeypatch):
    """Any connection attempt fails the test: loading must stay offline."""

    def refuse(*args, **kwargs):
        raise AssertionError("tried to reach the network")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


@pytest.fixture
def hub(tmp_path, monkeypatch, tiny_model_dir):
    """A local hub cache at $HF_HUB_CACHE holding org/tiny-llama (random tiny Llama + stories tokenizer)."""
    cache = tmp_path / "hub"
    fake_hub_cache(cache, "org/tiny-llama", tiny_model_dir("llama"))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    return cache


def _logits(base, ids) -> torch.Tensor:
    with torch.no_grad():
        return base.model(torch.tensor([ids])).logits[0]  # (L, V)


def test_a_cached_hub_id_loads_offline_like_its_folder(hub, no_network, tiny_model_dir):
    by_id = load_base_model("org/tiny-llama")
    by_folder = load_base_model(tiny_model_dir("llama"))
    assert by_id.name == "org/tiny-llama" and by_id.model.config.model_type == "llama"
    ids = by_id.tokenizer("Once upon a time")["input_ids"]
    assert ids == by_folder.tokenizer("Once upon a time")["input_ids"]
    torch.testing.assert_close(_logits(by_id, ids), _logits(by_folder, ids), rtol=0, atol=0)
    assert by_id.eos_token_ids == by_folder.eos_token_ids


def test_hf_home_is_used_without_hf_hub_cache(tmp_path, monkeypatch, no_network, tiny_model_dir):
    fake_hub_cache(tmp_path / "home" / "hub", "org/tiny-llama", tiny_model_dir("llama"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    assert hf_hub_cache() == tmp_path / "home" / "hub"
    assert load_base_model("org/tiny-llama").model.config.vocab_size == 512


def test_cache_location_follows_the_environment(tmp_path, monkeypatch):
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "user"))
    assert hf_hub_cache() == tmp_path / "user" / ".cache" / "huggingface" / "hub"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert hf_hub_cache() == tmp_path / "xdg" / "huggingface" / "hub"
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    assert hf_hub_cache() == tmp_path / "home" / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    assert hf_hub_cache() == tmp_path / "cache"


def test_an_existing_folder_of_that_spelling_wins(hub, tmp_path, monkeypatch, tiny_model_dir):
    monkeypatch.chdir(tmp_path)
    shutil.copytree(tiny_model_dir("mistral"), tmp_path / "org" / "tiny-llama")
    assert load_base_model("org/tiny-llama").model.config.model_type == "mistral"


def test_a_hub_id_not_in_the_cache_says_so(hub, no_network):
    with pytest.raises(ModelLoadError) as exc:
        load_base_model("org/missing")
    message = str(exc.value)
    assert f"'org/missing' is not a local folder, and not in the local Hugging Face cache at {hub}" in message
    assert "hf download org/missing" in message and "set HF_HUB_CACHE or HF_HOME" in message and "pass a local folder" in message


def test_a_cached_repo_without_a_model_config_is_named(hub, tmp_path):
    source = tmp_path / "readme-only"
    source.mkdir()
    (source / "README.md").write_text("no weights here")
    snapshot = fake_hub_cache(hub, "org/readme-only", source)
    with pytest.raises(ModelLoadError, match=f"{snapshot} has no config.json"):
        load_base_model("org/readme-only")


@pytest.mark.parametrize(
    "name,expected",
    [
        ("org/name", True),
        ("HuggingFaceTB/SmolLM2-135M-Instruct", True),
        ("a.b/c_d-1.5", True),
        ("name", False),
        ("a/b/c", False),
        ("/abs/path", False),
        ("./x", False),
        ("../x", False),
        ("org/model.gguf", False),
        ("org--x/y", False),
        ("org/x..y", False),
        ("org/", False),
        ("smollm2-135m", False),
    ],
)
def test_what_reads_as_a_hub_id(name, expected):
    assert is_hub_id(name) is expected


def test_other_missing_names_keep_the_general_message():
    with pytest.raises(ModelLoadError, match="not found: pass a local folder .* a Hugging Face id in the local cache"):
        load_base_model("no-such-model")


def test_cli_export_of_an_uncached_hub_id_is_one_line(tmp_path, monkeypatch, capsys):
    from test_bench_bad_input import assert_one_line

    from medusa_trt.cli.export import main as export_main

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    out = tmp_path / "out"
    out.mkdir()
    code = export_main(["--model", "org/missing", "--untrained-heads", "1", "--out", str(out / "e.onnx")])
    assert code == 2
    assert_one_line(
        capsys.readouterr().err,
        "medusa-export",
        f"'org/missing' is not a local folder, and not in the local Hugging Face cache at {tmp_path / 'hub'}",
    )
    assert list(out.iterdir()) == [] and not (tmp_path / "hub").exists()


STORIES = Path(__file__).resolve().parents[2] / "shared" / "models" / "stories260K.gguf"


@pytest.mark.skipif(not STORIES.is_file(), reason="needs ../shared/models/stories260K.gguf")
def test_a_gguf_padding_fix_is_cached_whole_or_not_at_all(tmp_path, monkeypatch):
    """stories260K's padding id is past its vocabulary; the loader reads a patched copy in the cache. A failure while
    patching leaves no copy (and no temporary file) for the next load to trust."""
    import gguf

    from medusa_trt.exporter import models

    monkeypatch.setenv("MEDUSA_TRT_CACHE", str(tmp_path))
    real = gguf.GGUFReader

    def broken(path, mode="r"):
        if mode == "r+":
            raise OSError("disk full")
        return real(path, mode)

    monkeypatch.setattr(gguf, "GGUFReader", broken)
    with pytest.raises(OSError, match="disk full"):
        models.readable_gguf(STORIES)
    assert not list((tmp_path / "gguf").iterdir())
    monkeypatch.setattr(gguf, "GGUFReader", real)
    patched = models.readable_gguf(STORIES)
    assert [p.name for p in (tmp_path / "gguf").iterdir()] == [patched.name]
    field = real(str(patched)).fields["tokenizer.ggml.padding_token_id"]
    assert int(field.parts[field.data[0]][0]) == 0
    assert models.readable_gguf(STORIES) == patched  # the second load reuses it
