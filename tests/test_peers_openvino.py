"""medusa-bench --peer openvino:DIR: OpenVINO GenAI's LLMPipeline on an OpenVINO folder of
stories260K (a real Llama of 292,800 parameters, exported here by optimum-cli from the model the engine
is exported from), greedy, on the engine's prompt ids, beside the engine's rows.

These skip, saying why, where OpenVINO GenAI is not importable here (``make openvino-peer``) or where
no optimum-cli is (``make openvino-models`` installs optimum-intel in build/openvino-venv: it needs
transformers<5.6, which .venv's pins exclude).
"""

from __future__ import annotations

import pytest
from conftest import STORIES, STORY_PROMPTS, medusa_model
from helpers import run_bench

from medusa_trt.bench.openvino_models import export_openvino, find_optimum_cli, save_hf_folder
from medusa_trt.bench.peers import make_peer, openvino_missing, parse_peer


@pytest.fixture(scope="module")
def openvino_folder(tmp_path_factory, stories_base):
    """stories260K as an fp32 OpenVINO folder (optimum-cli export openvino, about 20 s)."""
    missing = openvino_missing()
    if missing:
        print(f"skipping the OpenVINO peer: {missing}")
        pytest.skip(missing)
    cli = find_optimum_cli()
    if cli is None:
        why = "optimum-cli not found: make openvino-models installs optimum-intel in build/openvino-venv"
        print(f"skipping the OpenVINO peer: {why}")
        pytest.skip(why)
    root = tmp_path_factory.mktemp("openvino")
    hf = save_hf_folder(stories_base, root / "stories-hf")
    return export_openvino(hf, root / "stories-fp32", "fp32", optimum_cli=cli)


def _greedy(base, ids: list[int], n: int) -> list[int]:
    """transformers' greedy continuation of ``ids``: the reference the f32 OpenVINO peer must match."""
    import torch

    out = base.model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, pad_token_id=0)
    new = out[0, len(ids) :].tolist()
    eos = set(base.eos_token_ids)
    return new[: next((i for i, t in enumerate(new) if t in eos), len(new))]


def test_openvino_peer_decodes_as_transformers(openvino_folder, stories_base):
    """f32 inference precision on fp32 weights: the same greedy tokens as transformers, lookup or not."""
    prompts = [stories_base.tokenizer(p)["input_ids"] for p in STORY_PROMPTS]
    eos = frozenset(stories_base.eos_token_ids)
    plain = make_peer(parse_peer(f"openvino:{openvino_folder}"), threads=2, context=256, vocab_size=512)
    lookup = make_peer(parse_peer(f"openvino+lookup:{openvino_folder}"), threads=2, context=256, vocab_size=512)
    assert plain.mode == "f32 precision" and lookup.mode.startswith("f32 precision, lookup ")
    for ids in prompts:
        expected = _greedy(stories_base, ids, 40)
        got, seconds = plain.generate(ids, 40, eos)
        assert got == expected and seconds > 0, (ids, got, expected)
        assert lookup.generate(ids, 40, eos)[0] == expected
    assert plain.generate(prompts[0], 3, eos)[0] == _greedy(stories_base, prompts[0], 3)  # max_new_tokens holds


def test_openvino_rows_beside_the_engine(openvino_folder, tmp_path, capsys, export_engine, stories_base, stories_fitted):
    """The benchmark's own path: each peer in its worker, warmed up, interleaved, agreement against plain[model]."""
    if not STORIES.is_file():
        pytest.skip(f"{STORIES} missing")
    engine = export_engine("stories-fitted", medusa_model(stories_base, stories_fitted))
    args = ["--no-hf", "--threads", "2", "--peer", f"openvino:{openvino_folder}", "--peer", f"openvino+lookup:{openvino_folder}"]
    args += ["--peer", f"openvino-default:{openvino_folder}"]
    methods = run_bench(tmp_path, [engine], ["Once upon a time", "The dog was", "Lily saw a bird. The bird"], *args)["methods"]
    plain, lookup = methods["openvino[stories-fp32]"], methods["openvino+lookup[stories-fp32]"]
    default = methods["openvino-default[stories-fp32]"]
    for row in (plain, lookup, default):
        assert row["tokens_per_s"] > 0 and row["new_tokens"] > 0 and "failure" not in row
    # the engine is exported from the same weights, run in fp32: greedy outputs part only at a near-tie, if at all
    assert plain["matching_prefix_fraction"] > 0.5, plain
    assert lookup["matching_prefix_fraction"] == plain["matching_prefix_fraction"]
    assert plain["mode"] == "f32 precision" and default["mode"].endswith("(the CPU's default) precision")
    assert "openvino+lookup[stories-fp32]" in capsys.readouterr().out


def test_a_failed_openvino_export_leaves_the_earlier_folder_and_a_foreign_one_is_refused(tmp_path):
    """The peers' folders are written whole or not at all (runtime/durable.py): optimum-cli failing (a stand-in that
    exits 1) leaves the earlier folder as it was and nothing staged beside it; a folder this script did not write is
    refused, not replaced."""
    from medusa_trt.runtime.errors import MedusaError

    failing = tmp_path / "optimum-cli"
    failing.write_text("#!/bin/sh\necho 'no such model' >&2\nexit 1\n")
    failing.chmod(0o755)
    earlier = tmp_path / "smollm2-fp32"
    earlier.mkdir()
    (earlier / "openvino_model.xml").write_text("<net/>")
    with pytest.raises(MedusaError, match="failed \\(exit 1\\):\nno such model"):
        export_openvino(tmp_path / "hf", earlier, "fp32", optimum_cli=failing)
    assert (earlier / "openvino_model.xml").read_text() == "<net/>"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["optimum-cli", "smollm2-fp32"]
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    with pytest.raises(MedusaError, match="is not a folder this script wrote"):
        export_openvino(tmp_path / "hf", mine, "fp32", optimum_cli=failing)
    assert (mine / "notes.txt").read_text() == "keep"
    fresh = tmp_path / "build" / "openvino" / "smollm2-fp32"  # a fresh machine: no build/openvino yet
    with pytest.raises(MedusaError, match="failed \\(exit 1\\):\nno such model"):
        export_openvino(tmp_path / "hf", fresh, "fp32", optimum_cli=failing)
    assert not fresh.exists() and list(fresh.parent.iterdir()) == []
