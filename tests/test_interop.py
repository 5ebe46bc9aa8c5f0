"""Interop: heads written in the FasterDecoding/Medusa layout and read back by our FasterDecoding
loader give the same logits and, exported, the same tokens; trees written as medusa_choices
compile back to the same tree; what the format cannot carry is refused with nothing written."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest
import torch
from conftest import CUSTOM_TREE, STORIES, TREES, assert_greedy_identical, medusa_model, random_heads
from numerics import assert_close_fp32, assert_same_top_ids, dot_magnitude, fp32_tolerance
from safetensors.torch import load_file
from torch import nn

from medusa_trt.cli.heads import main as heads_main
from medusa_trt.exporter.heads import HeadsConfig, MedusaHeads, init_heads, load_heads, save_heads
from medusa_trt.exporter.interop import (
    FD_CONFIG,
    FD_TOP_K,
    FD_WEIGHTS,
    MEDUSA_CHOICES,
    InteropError,
    convert_heads,
    medusa_choices_json,
    save_fasterdecoding,
    write_medusa_choices,
)
from medusa_trt.runtime import MedusaRuntime
from medusa_trt.runtime.durable import FOLDER_MANIFEST as MANIFEST
from medusa_trt.runtime.durable import NotOursError
from medusa_trt.runtime.tree import chain_paths, compile_tree, load_tree

H, V = 16, 32  # tiny hidden size and vocabulary
REPO = Path(__file__).resolve().parents[1]


def make_lm_head(seed: int = 1) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(H, V, bias=False)


def tiny_heads(*, shared: bool, num_heads: int = 3, num_layers: int = 2, lm_head=None, **kw) -> MedusaHeads:
    config = HeadsConfig(num_heads=num_heads, num_layers=num_layers, hidden_size=H, vocab_size=V, shared_lm_head=shared, **kw)
    lm_head = lm_head if lm_head is not None else make_lm_head()
    embed = nn.Embedding(V, H) if config.reads_next else None
    return init_heads(config, lm_head, random=True, seed=3, embed=embed)


def hidden(*lead: int) -> torch.Tensor:
    return torch.randn(*lead, H, generator=torch.Generator().manual_seed(7))


def load_fd(folder, lm_head=None) -> MedusaHeads:
    return load_heads(folder, hidden_size=H, vocab_size=V, lm_head=lm_head)


def snapshot(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_size for p in sorted(root.rglob("*"))}


def assert_same_as_shared(converted: MedusaHeads, shared: MedusaHeads, x: torch.Tensor, *, top_k: int | None = None) -> None:
    """``converted`` (a copy of the lm_head in every head) gives ``shared``'s logits on ``x``.

    Not bit for bit: shared heads project every head's block output in one GEMM ([..., n, H] rows),
    converted heads one head at a time ([..., H] rows): the same dot products in other shapes,
    which a GEMM library may sum in another order (tests/numerics.py). The block outputs are the
    same modules on the same rows, so the projection's bound is the whole bound. ``top_k``: also
    the same top-k ids per head, ties within that bound aside."""
    want, got = shared(x), converted(x)  # (..., n, V)
    magnitude = dot_magnitude(shared.blocks(x), shared.base_lm_head.weight)  # sum_i |y_i| |w_i| per logit
    assert_close_fp32(got, want, reduction=x.shape[-1], magnitude=magnitude, msg="converted vs shared heads")
    if top_k is not None:
        tolerance = fp32_tolerance(x.shape[-1], magnitude)
        assert_same_top_ids(got, want, k=top_k, tolerance=tolerance, msg="converted vs shared heads")


# ---------------------------------------------------------------- the FasterDecoding layout


@pytest.mark.parametrize("num_layers", [0, 1, 2])
@pytest.mark.parametrize("shared", [False, True], ids=["own_lm_head", "shared_lm_head"])
def test_round_trip_through_our_fasterdecoding_loader_gives_the_same_logits(tmp_path, shared, num_layers):
    lm_head = make_lm_head()
    heads = tiny_heads(shared=shared, num_layers=num_layers, lm_head=lm_head)
    folder = save_fasterdecoding(heads, tmp_path / "fd", base_model="org/base")
    assert sorted(p.name for p in folder.iterdir()) == [FD_CONFIG, MANIFEST, FD_WEIGHTS]  # files.json: what proves it ours
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "temporary folder left behind"
    back = load_fd(folder)  # no lm_head given: every head carries its own projection
    assert back.config == HeadsConfig(
        num_heads=3, num_layers=num_layers, hidden_size=H, vocab_size=V, shared_lm_head=False, base_model="org/base"
    )
    x = hidden(2, 5)
    with torch.no_grad():
        assert back(x).shape == (2, 5, 3, V)
        if shared:
            assert_same_as_shared(back, heads, x)
        else:  # the same modules, weights and shapes: bit for bit
            torch.testing.assert_close(back(x), heads(x), rtol=0, atol=0)


def test_files_hold_exactly_what_fasterdecoding_readers_read(tmp_path):
    """TensorRT-LLM's load_medusa_hf reads {h}.{l}.linear.weight|bias and {h}.{L}.weight per head;
    TGI and vLLM read medusa_num_heads / medusa_num_layers / base_model_name_or_path / sizes."""
    lm_head = make_lm_head()
    heads = tiny_heads(shared=True, num_heads=2, num_layers=1, lm_head=lm_head)
    folder = save_fasterdecoding(heads, tmp_path / "fd", base_model="HuggingFaceTB/SmolLM2-135M-Instruct")
    config = json.loads((folder / FD_CONFIG).read_text())
    assert config == {
        "medusa_num_heads": 2,
        "medusa_num_layers": 1,
        "base_model_name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct",
        "hidden_size": H,
        "vocab_size": V,
    }
    state = load_file(str(folder / FD_WEIGHTS))
    assert {k: tuple(v.shape) for k, v in state.items()} == {
        "0.0.linear.weight": (H, H),
        "0.0.linear.bias": (H,),
        "0.1.weight": (V, H),
        "1.0.linear.weight": (H, H),
        "1.0.linear.bias": (H,),
        "1.1.weight": (V, H),
    }
    # the shared lm_head is materialised into each head, value for value
    for k in range(2):
        assert torch.equal(state[f"{k}.1.weight"], lm_head.weight)
        assert torch.equal(state[f"{k}.0.linear.weight"], heads.heads[k][0].linear.weight)


def test_recorded_base_model_is_the_default_and_a_medusa_trt_name_is_flagged(tmp_path, caplog):
    heads = tiny_heads(shared=False, base_model="smollm2-135m")
    with caplog.at_level(logging.WARNING, logger="medusa_trt.exporter.interop"):
        folder = save_fasterdecoding(heads, tmp_path / "fd")
    assert json.loads((folder / FD_CONFIG).read_text())["base_model_name_or_path"] == "smollm2-135m"
    assert any("name only medusa-trt knows" in r.getMessage() and "--base-model" in r.getMessage() for r in caplog.records)


def test_dtype_casts_the_weights(tmp_path):
    heads = tiny_heads(shared=True)
    folder = save_fasterdecoding(heads, tmp_path / "fd16", dtype=torch.float16)
    state = load_file(str(folder / FD_WEIGHTS))
    assert {v.dtype for v in state.values()} == {torch.float16}
    back = load_fd(folder).float()
    x = hidden(4)
    with torch.no_grad():
        torch.testing.assert_close(back(x), heads(x), rtol=2e-2, atol=2e-2)


def test_tree_is_written_beside_the_heads(tmp_path):
    folder = save_fasterdecoding(tiny_heads(shared=False), tmp_path / "fd", tree=CUSTOM_TREE)
    assert json.loads((folder / MEDUSA_CHOICES).read_text()) == sorted(CUSTOM_TREE, key=lambda p: (len(p), p))
    with pytest.raises(InteropError, match="3 deep but there are only 2 heads"):
        save_fasterdecoding(tiny_heads(shared=False, num_heads=2), tmp_path / "fd2", tree=chain_paths(3))
    assert not (tmp_path / "fd2").exists()


def test_an_earlier_export_is_replaced_and_other_folders_are_left_alone(tmp_path):
    first = save_fasterdecoding(tiny_heads(shared=False, num_heads=3), tmp_path / "fd", tree=CUSTOM_TREE)
    second = save_fasterdecoding(tiny_heads(shared=False, num_heads=2), tmp_path / "fd")
    assert second == first and sorted(p.name for p in second.iterdir()) == [FD_CONFIG, MANIFEST, FD_WEIGHTS]  # the old tree went too
    assert load_fd(second).config.num_heads == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fd"]  # no temp or set-aside folder

    ours = save_heads(tiny_heads(shared=False), tmp_path / "ours")
    before = snapshot(ours)
    with pytest.raises(NotOursError, match="holds medusa-trt heads files, not fasterdecoding files"):
        save_fasterdecoding(tiny_heads(shared=False), ours)
    theirs = tmp_path / "theirs"  # a FasterDecoding folder from elsewhere: the same file names, no files.json of ours
    theirs.mkdir()
    (theirs / FD_CONFIG).write_text("{}")
    (theirs / FD_WEIGHTS).write_bytes(b"their heads")
    with pytest.raises(NotOursError, match=f"theirs/{FD_CONFIG} is not a file medusa-trt wrote"):
        save_fasterdecoding(tiny_heads(shared=False), theirs)
    assert (theirs / FD_WEIGHTS).read_bytes() == b"their heads"
    assert snapshot(ours) == before
    (tmp_path / "file").write_text("x")
    with pytest.raises(InteropError, match="it is a file"):
        save_fasterdecoding(tiny_heads(shared=False), tmp_path / "file")
    with pytest.raises(InteropError, match="does not exist"):
        save_fasterdecoding(tiny_heads(shared=False), tmp_path / "absent" / "fd")


def test_a_failed_write_keeps_the_earlier_export(tmp_path, monkeypatch):
    import medusa_trt.exporter.interop as interop

    folder = save_fasterdecoding(tiny_heads(shared=False, num_heads=2), tmp_path / "fd")
    before = snapshot(folder)

    def full_disk(state, path, metadata=None):
        Path(path).write_bytes(b"half")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("safetensors.torch.save_file", full_disk)
    with pytest.raises(OSError, match="No space"):
        interop.save_fasterdecoding(tiny_heads(shared=False, num_heads=3), folder)
    assert snapshot(folder) == before and sorted(p.name for p in tmp_path.iterdir()) == ["fd"]


# ---------------------------------------------------------------- refusals


@pytest.mark.parametrize("head_input", ["hidden+next", "hidden+path"])
def test_next_token_aware_heads_are_refused_with_the_reason(tmp_path, head_input):
    heads = tiny_heads(shared=True, head_input=head_input)
    with pytest.raises(
        InteropError, match=rf"'{re.escape(head_input)}'.*FasterDecoding format has no next-token input.*--head-input hidden"
    ):
        save_fasterdecoding(heads, tmp_path / "fd")
    assert list(tmp_path.iterdir()) == []


def test_heads_on_an_intermediate_layer_are_refused(tmp_path):
    with pytest.raises(InteropError, match="read decoder layer 1.*without --head-layer"):
        save_fasterdecoding(tiny_heads(shared=False, head_layer=1), tmp_path / "fd")
    assert list(tmp_path.iterdir()) == []


def test_a_shared_lm_head_with_a_bias_is_refused(tmp_path):
    lm_head = nn.Linear(H, V, bias=True)
    with pytest.raises(InteropError, match="lm_head has a bias"):
        save_fasterdecoding(tiny_heads(shared=True, lm_head=lm_head), tmp_path / "fd")
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------- medusa_choices


def _same_tree(a, b) -> None:
    assert a.paths == b.paths and (a.top_k, a.depth_max, a.num_nodes) == (b.top_k, b.depth_max, b.num_nodes)
    for field in ("depth", "parent", "gather_index", "mask", "retrieve", "path_lengths"):
        assert (getattr(a, field) == getattr(b, field)).all(), field


TREE_SPECS = [
    "custom",
    "chain-3",
    str(REPO / "assets" / "smollm2-135m-tree.json"),
    str(REPO / "assets" / "smollm2-135m-medusa" / "template.json"),
]


@pytest.mark.parametrize("spec", TREE_SPECS + (["mc_sim_7b_63"] if TREES.is_file() else []))
def test_medusa_choices_compile_back_to_the_same_tree(tmp_path, spec):
    tree = load_tree(CUSTOM_TREE if spec == "custom" else spec)
    path = write_medusa_choices(tree, tmp_path / "choices.json")
    text = path.read_text()
    assert text.startswith("[[") and text.count("\n") == 1  # one line of JSON: also a Python literal
    import ast

    assert ast.literal_eval(text) == json.loads(text) == [list(p) for p in tree.paths]
    _same_tree(load_tree(path, top_k=tree.top_k), tree)


def test_a_calibrated_tree_round_trips_without_its_top_k(tmp_path):
    """A calibrated tree records top_k = its largest rank + 1, which load_tree infers from the list."""
    calibrated = REPO / "assets" / "smollm2-135m-tree.json"
    tree = load_tree(calibrated)
    assert json.loads(calibrated.read_text())["top_k"] == tree.top_k
    _same_tree(load_tree(write_medusa_choices(tree, tmp_path / "c.json")), tree)


def test_ranks_past_ten_are_flagged(caplog):
    with caplog.at_level(logging.WARNING, logger="medusa_trt.exporter.interop"):
        assert medusa_choices_json([[0], [11]]) == "[[0], [11]]"
    assert any("top 10" in r.getMessage() for r in caplog.records)


# ---------------------------------------------------------------- on a real model


def _materialised(tmp_path, heads, **kw) -> Path:
    return save_fasterdecoding(heads, tmp_path / "fd", **kw)


@pytest.mark.parametrize("shared", [False, True], ids=["own_lm_head", "shared_lm_head"])
def test_stories_heads_round_trip_give_the_same_tokens(tmp_path, stories_base, stories_prompts, shared):
    """Torch backend, both kinds of heads: the same logits on the model's hidden states and the
    same tokens as the original heads. Own-lm_head heads compute exactly what they did, so the
    drafts and the acceptance per step are the same too; shared heads projected all heads in one
    batched matmul, the converted ones one per head, which may round the last bits differently:
    logits within the fp32 bound and the same top-k proposals, ties aside (a near-tie in a top-k
    may then change a draft, never a token)."""
    from medusa_trt.exporter import load_medusa

    heads = random_heads(stories_base, 3, seed=5, shared=shared)
    folder = _materialised(tmp_path, heads)
    converted = load_medusa(str(STORIES), str(folder))
    assert converted.heads.config.shared_lm_head is False
    with torch.no_grad():
        h = stories_base.model.model(torch.tensor([stories_prompts[0]])).last_hidden_state  # (1, L, H)
        if shared:
            assert_same_as_shared(converted.heads, heads, h, top_k=FD_TOP_K)
        else:  # the same modules, weights and shapes: bit for bit
            torch.testing.assert_close(converted.heads(h), heads(h), rtol=0, atol=0)
    cost = {1: 1.0, 8: 1.2, 64: 2.0}  # a fixed drafting budget: a learnt one follows wall-clock step times, so trees could differ
    got = MedusaRuntime(converted, step_cost=cost).generate(stories_prompts, max_new_tokens=24)
    want = MedusaRuntime(medusa_model(stories_base, heads), step_cost=cost).generate(stories_prompts, max_new_tokens=24)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    if not shared:
        assert [r.stats.accepted_per_step for r in got] == [r.stats.accepted_per_step for r in want]


def test_an_engine_exported_from_converted_heads_decodes_the_same_tokens(
    tmp_path, export_engine, stories_base, stories_fitted, stories_prompts
):
    from medusa_trt.exporter import load_medusa

    folder = _materialised(tmp_path, stories_fitted)
    engine = export_engine("interop-fasterdecoding", load_medusa(str(STORIES), str(folder)))
    cost = {1: 1.0, 8: 1.2, 64: 2.0}  # a fixed drafting budget: a learnt one follows wall-clock step times, so trees could differ
    got = MedusaRuntime(engine, step_cost=cost).generate(stories_prompts, max_new_tokens=32)
    # the engine of the original heads (the other suites' key and settings: a full run exports it once)
    original = export_engine("stories-fitted", medusa_model(stories_base, stories_fitted))
    want = MedusaRuntime(original, step_cost=cost).generate(stories_prompts, max_new_tokens=32)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert [r.stats.accepted_per_step for r in got] == [r.stats.accepted_per_step for r in want]
    assert max(r.stats.mean_accepted for r in got) > 1.0  # the converted heads really draft
    assert_greedy_identical(stories_base, stories_prompts[0], got[0].token_ids, 32)


# ---------------------------------------------------------------- medusa-heads convert


def _convert(capsys, *args) -> tuple[int, str, str]:
    try:
        code = heads_main(["convert", *[str(a) for a in args]])
    except SystemExit as exc:  # usage errors (cli.common.Parser: one line, exit 2)
        code = exc.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_cli_converts_shared_heads_with_their_model_and_tree(tmp_path, capsys, stories_base):
    heads = random_heads(stories_base, 3, seed=2, shared=True)
    ours = save_heads(heads, tmp_path / "ours")
    out = tmp_path / "fd"
    code, stdout, err = _convert(
        capsys, "--heads", ours, "--out", out, "--model", STORIES, "--tree", "chain-3", "--base-model", "org/stories"
    )
    assert code == 0, err
    assert sorted(p.name for p in out.iterdir()) == [FD_CONFIG, MANIFEST, MEDUSA_CHOICES, FD_WEIGHTS]
    lines = stdout.strip().splitlines()
    assert lines[0] == f"wrote {out} ({FD_CONFIG}, {MANIFEST}, {MEDUSA_CHOICES}, {FD_WEIGHTS}): 3 heads, 1 layers, base model org/stories"
    assert "--medusa_model_dir" in lines[1] and "--medusa_choices" in lines[1]
    assert json.loads((out / MEDUSA_CHOICES).read_text()) == chain_paths(3)
    back = load_heads(out, hidden_size=heads.config.hidden_size, vocab_size=heads.config.vocab_size, lm_head=None)
    x = torch.randn(3, heads.config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert_same_as_shared(back, heads, x, top_k=FD_TOP_K)


def test_cli_converts_own_lm_head_heads_without_a_model(tmp_path, capsys):
    heads = tiny_heads(shared=False, base_model="org/base")
    ours = save_heads(heads, tmp_path / "ours")
    code, stdout, err = _convert(capsys, "--heads", ours, "--out", tmp_path / "fd", "--dtype", "float16")
    assert code == 0, err
    assert stdout.startswith(f"wrote {tmp_path / 'fd'} ({FD_CONFIG}, {MANIFEST}, {FD_WEIGHTS}): 3 heads, 2 layers, base model org/base")
    assert {v.dtype for v in load_file(str(tmp_path / "fd" / FD_WEIGHTS)).values()} == {torch.float16}


def test_convert_heads_takes_a_cached_hub_id_model_as_the_base_model(tmp_path, monkeypatch, tiny_model_dir):
    """The model by Hub id (from a local hub cache): its lm_head goes into the heads and its id into config.json."""
    from test_models import fake_hub_cache

    from medusa_trt.exporter import load_base_model

    fake_hub_cache(tmp_path / "hub", "org/tiny-llama", tiny_model_dir("llama"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    base = load_base_model("org/tiny-llama")
    heads = random_heads(base, 2, shared=True)
    out = convert_heads(save_heads(heads, tmp_path / "ours"), tmp_path / "fd", model="org/tiny-llama")
    assert json.loads((out / FD_CONFIG).read_text())["base_model_name_or_path"] == "org/tiny-llama"
    back = load_heads(out, hidden_size=64, vocab_size=512, lm_head=None)
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert_same_as_shared(back, heads, x, top_k=FD_TOP_K)


BAD = [  # (argv, fragment of the one line); {tmp} is the test's folder
    (["--heads", "{tmp}/absent", "--out", "{tmp}/o"], "heads path {tmp}/absent does not exist"),
    (["--heads", "{tmp}/next", "--out", "{tmp}/o"], "FasterDecoding format has no next-token input"),
    (["--heads", "{tmp}/next", "--out", "{tmp}/o", "--model", "/nonexistent/m.gguf"], "FasterDecoding format has no next-token input"),
    (["--heads", "{tmp}/layer", "--out", "{tmp}/o"], "read decoder layer 1"),
    (["--heads", "{tmp}/shared", "--out", "{tmp}/o"], "pass the base model they were trained on (--model)"),
    (["--heads", "{tmp}/own", "--out", "{tmp}/none/o"], "folder {tmp}/none does not exist"),
    (["--heads", "{tmp}/own", "--out", "{tmp}/shared"], "{tmp}/shared would be replaced, but it holds medusa-trt heads files"),
    (["--heads", "{tmp}/own", "--out", "{tmp}/o", "--tree", "chain-x"], "write chain-N"),
    (["--heads", "{tmp}/own", "--out", "{tmp}/o", "--tree", "{tmp}/absent.json"], "does not exist"),
    (["--heads", "{tmp}/own", "--out", "{tmp}/o", "--tree", "chain-4"], "4 deep but there are only 3 heads"),
    (["--heads", "{tmp}/own", "--out", "{tmp}/o", "--model", "org/not-cached"], "not in the local Hugging Face cache"),
    (["--heads", "{tmp}/own", "--out", "{tmp}/o", "--to", "vllm"], "argument --to: invalid choice: 'vllm'"),
    (["--heads", "{tmp}/own", "--out", "{tmp}/o", "--dtype", "int8"], "argument --dtype: invalid choice"),
    (["--out", "{tmp}/o"], "the following arguments are required: --heads"),
]


@pytest.fixture
def bad_folder(tmp_path, monkeypatch):
    save_heads(tiny_heads(shared=False), tmp_path / "own")
    save_heads(tiny_heads(shared=True), tmp_path / "shared")
    save_heads(tiny_heads(shared=True, head_input="hidden+next"), tmp_path / "next")
    save_heads(tiny_heads(shared=False, head_layer=1), tmp_path / "layer")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    return tmp_path


@pytest.mark.parametrize("argv,message", BAD, ids=[" ".join(a).replace("{tmp}/", "") for a, _ in BAD])
def test_cli_bad_input_is_one_line_and_writes_nothing(capsys, bad_folder, argv, message):
    from test_bench_bad_input import assert_one_line

    before = snapshot(bad_folder)
    code, _, err = _convert(capsys, *[a.format(tmp=bad_folder) for a in argv])
    assert code == 2
    assert_one_line(err, "medusa-heads convert", message.format(tmp=bad_folder))
    assert snapshot(bad_folder) == before


def test_cli_without_a_command_is_one_line(capsys):
    with pytest.raises(SystemExit) as exc:
        heads_main([])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("medusa-heads: error: ") and "COMMAND" in err


# ---------------------------------------------------------------- medusa-calibrate


def test_calibrate_writes_the_tree_as_medusa_choices(capsys, tmp_path, stories_fitted):
    from medusa_trt.cli.calibrate import main as calibrate_main

    heads = save_heads(stories_fitted, tmp_path / "heads")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"turns": [p]}) + "\n" for p in ["Once upon a time", "Tom had a big red ball"]))
    out = tmp_path / "tree.json"
    code = calibrate_main(
        [
            "--model",
            str(STORIES),
            "--heads",
            str(heads),
            "--prompts",
            str(prompts),
            "--out",
            str(out),
            "--max-new-tokens",
            "16",
            "--max-nodes",
            "8",
            "--top-k",
            "4",
            "--context",
            "32",
            "--repeats",
            "1",
        ]
    )
    printed = capsys.readouterr()
    assert code == 0, printed.err
    choices = out.with_suffix(".medusa_choices.json")
    assert f"wrote {out}, {choices}, " in printed.out
    tree = load_tree(out)
    assert json.loads(choices.read_text()) == [list(p) for p in tree.paths]
    _same_tree(load_tree(choices), tree)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "temporary file left behind"


def test_calibrate_refuses_a_folder_where_medusa_choices_would_go(capsys, tmp_path):
    from test_bench_bad_input import assert_one_line

    from medusa_trt.cli.calibrate import main as calibrate_main

    (tmp_path / "t.medusa_choices.json").mkdir()
    (tmp_path / "p.jsonl").write_text(json.dumps({"turns": ["hi"]}) + "\n")
    code = calibrate_main(
        ["--engine", str(tmp_path / "absent.onnx"), "--prompts", str(tmp_path / "p.jsonl"), "--out", str(tmp_path / "t.json")]
    )
    assert code == 2
    assert_one_line(capsys.readouterr().err, "medusa-calibrate", f"cannot write {tmp_path}/t.medusa_choices.json beside --out")


def test_compile_tree_sorts_before_writing():
    """medusa_choices lists parents before children whatever order the paths came in."""
    assert medusa_choices_json([[0, 0], [1], [0]]) == "[[0], [1], [0, 0]]"
    assert compile_tree(json.loads(medusa_choices_json([[0, 0], [1], [0]]))).paths == ((0,), (1,), (0, 0))
