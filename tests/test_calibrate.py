"""Tree calibration: the accuracy model on hand-worked numbers, the cost trade-off on synthetic
latency curves, and the measurements and medusa-calibrate end to end on a tiny engine."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import STORIES, medusa_model

from medusa_trt.cli.calibrate import main
from medusa_trt.runtime.tree import compile_tree, load_tree
from medusa_trt.training.calibrate import (
    CalibrationError,
    best_chain,
    expected_accept,
    greedy_proposals,
    grow_trees,
    head_accuracy,
    hits_from_proposals,
    measure_head_hits,
    measure_heads_ms,
    measure_step_ms,
    pick_tree,
    step_cost,
)

# Decaying accuracies, 3 heads x top-10, each row sums below 1 (misses happen).
ACC = np.array([0.5 * 0.5 ** np.arange(10), 0.4 * 0.5 ** np.arange(10), 0.3 * 0.5 ** np.arange(10)])

PROMPTS = ["Once upon a time", "The little dog was sad because", "Tom had a big red ball", "One day a cat", "Lily went to the park"]


# ----------------------------------------------------------------- the model


def test_head_accuracy_by_hand():
    hits = np.array([[0, 1], [0, -1], [1, 0], [-1, 0]])  # 4 positions, 2 heads
    acc = head_accuracy(hits, top_k=3)
    np.testing.assert_allclose(acc, [[0.5, 0.25, 0.0], [0.5, 0.25, 0.0]])
    assert head_accuracy(hits).shape == (2, 2)  # K inferred from the largest rank
    with pytest.raises(CalibrationError, match="no decoding positions"):
        head_accuracy(np.zeros((0, 2), dtype=np.int64))
    with pytest.raises(CalibrationError, match="must lie in"):
        head_accuracy(hits, top_k=1)


def test_hits_from_proposals_alignment():
    tokens = [5, 6, 7, 8]  # t_0..t_3
    proposals = np.array(
        [  # row i: heads at the emission of t_i; head k guesses t_{i+1+k}
            [[6, 9], [1, 7]],  # head 0 -> t_1 = 6 at rank 0; head 1 -> t_2 = 7 at rank 1
            [[9, 7], [3, 4]],  # head 0 -> t_2 = 7 at rank 1; head 1 -> t_3 = 8 missing
            [[8, 0], [0, 0]],  # head 1 would guess t_4: past the end, row dropped
            [[0, 0], [0, 0]],
        ]
    )
    np.testing.assert_array_equal(hits_from_proposals(tokens, proposals), [[0, 1], [1, -1]])


def test_sequential_hits_follow_the_true_path_through_the_expanded_template():
    """Sequential heads: head k's rank is read in the row of the expanded node the true tokens
    lead to; off the template (a miss, or a node without children) the deeper heads miss."""
    from medusa_trt.runtime.drafting.sequential import expansion

    plan = expansion([(0,), (1,), (0, 0), (1, 0), (1, 1), (1, 1, 0)])  # rows (), (0,), (1,), (1, 1)
    tokens = [5, 6, 7, 8, 9, 9]
    p = np.zeros((6, 4, 2), dtype=np.int64)  # (n, P, K)
    p[0] = [[1, 6], [0, 0], [7, 3], [0, 0]]  # t_1 = 6 at rank 1 -> row 2; t_2 = 7 at rank 0 -> (1, 0): no children
    p[1] = [[7, 2], [0, 8], [0, 0], [0, 0]]  # rank 0 -> row 1; t_3 = 8 at rank 1 -> (0, 1): not expanded
    p[2] = [[0, 8], [0, 0], [3, 9], [9, 4]]  # rank 1 -> row 2; t_4 = 9 at rank 1 -> row 3; t_5 = 9 at rank 0
    p[3] = [[1, 1], [0, 0], [0, 0], [0, 0]]  # t_4 = 9 missing: the rest miss
    np.testing.assert_array_equal(hits_from_proposals(tokens, p, plan, 3), [[1, 0, -1], [0, 1, -1], [1, 1, 0]])


def test_expected_accept_by_hand():
    acc = [[0.5, 0.2], [0.4, 0.1]]
    # [0]: .5, [1]: .2, [0,0]: .5*.4 = .2, [0,1]: .5*.1 = .05, [1,0]: .2*.4 = .08
    assert expected_accept([[0], [1], [0, 0], [0, 1], [1, 0]], acc) == pytest.approx(1.03)
    assert expected_accept([], acc) == 0.0
    with pytest.raises(CalibrationError, match="covers 2 heads"):
        expected_accept([[0], [0, 0], [0, 0, 0]], acc)


def test_grow_trees_small_by_hand():
    acc = [[0.6, 0.2], [0.5, 0.1]]
    trees = grow_trees(acc, 10)
    # [0] .6 > [0,0] .3 > [1] .2 > [1,0] .1 > [0,1] .06 > [1,1] .02; then 2 heads x top-2 are used up
    assert trees == [
        [],
        [[0]],
        [[0], [0, 0]],
        [[0], [0, 0], [1]],
        [[0], [0, 0], [1], [1, 0]],
        [[0], [0, 0], [1], [1, 0], [0, 1]],
        [[0], [0, 0], [1], [1, 0], [0, 1], [1, 1]],
    ]


def test_grow_trees_compile_and_improve():
    trees = grow_trees(ACC, 40)
    assert [len(t) + 1 for t in trees] == list(range(1, 41))
    gains = [expected_accept(t, ACC) for t in trees]
    assert all(b > a for a, b in zip(gains, gains[1:]))  # every added node has P > 0
    for paths in trees:
        seen = {tuple(p) for p in paths}
        assert all(len(p) == 1 or tuple(p[:-1]) in seen for p in paths)  # prefix-closed
        assert compile_tree(paths, max_depth=3, top_k=10).num_nodes == len(paths) + 1
    assert trees[3] == [[0], [1], [0, 0]]  # .5, .25, .5*.4 = .2
    # the greedy tree beats the chain of the same size
    assert gains[3] > expected_accept([[0], [0, 0], [0, 0, 0]], ACC)


def test_step_cost_interpolates_and_clamps():
    ms = {1: 2.0, 4: 5.0, 16: 17.0}
    assert step_cost(ms, 2) == pytest.approx(3.0)
    assert step_cost(ms, 10) == pytest.approx(11.0)
    assert step_cost(ms, 64) == 17.0 and step_cost(ms, 0) == 2.0


def test_flat_cost_picks_a_larger_tree_than_steep_cost():
    """The point of calibrating: the same heads, different hardware, different trees."""
    sizes = [1, 2, 4, 8, 16, 32, 64]
    flat = pick_tree(ACC, {t: 10.0 for t in sizes}, 64)  # a GPU far from saturation
    steep = pick_tree(ACC, {t: 10.0 * t for t in sizes}, 64)  # cost proportional to tokens
    mid = pick_tree(ACC, {t: 10.0 + 0.5 * t for t in sizes}, 64)
    assert flat.num_nodes == 64 and steep.num_nodes == 1
    assert steep.num_nodes < mid.num_nodes < flat.num_nodes
    for choice in (flat, steep, mid):
        assert len(choice.curve) == 64 and [c[0] for c in choice.curve] == list(range(1, 65))
        assert choice.expected_tokens_per_s == max(c[2] for c in choice.curve)
        assert choice.num_nodes == len(choice.paths) + 1
    assert flat.expected_tokens_per_step == pytest.approx(1 + expected_accept(flat.paths, ACC))
    assert flat.expected_tokens_per_s == pytest.approx(flat.expected_tokens_per_step / 10.0 * 1e3)
    # a heads call per step is paid by every tree but not by plain decoding (T = 1): dear enough,
    # it makes plain decoding win; among real trees it makes extra tree tokens relatively cheaper
    heavy = pick_tree(ACC, {t: 10.0 + 0.5 * t for t in sizes}, 64, heads_ms=20.0)
    assert heavy.num_nodes == 1 and heavy.curve[0][2] == pytest.approx(1e3 / 10.5)
    assert max(heavy.curve[1:], key=lambda c: c[2])[0] > mid.num_nodes
    chain = best_chain(ACC, {t: 10.0 for t in sizes}, 64)
    assert chain.paths == ((0,), (0, 0), (0, 0, 0)) and chain.expected_tokens_per_s < flat.expected_tokens_per_s


# ----------------------------------------------------------------- on a tiny engine


@pytest.fixture(scope="module")
def fitted_engine(stories_base, stories_fitted, export_engine):
    """stories260K with 4 fitted heads, max_context 256, top-10 proposals when the presets file is
    there; the same key and settings as the other suites' engine, so a full run exports it once."""
    return export_engine("stories-fitted", medusa_model(stories_base, stories_fitted))


@pytest.fixture(scope="module")
def runtime(fitted_engine):
    from medusa_trt.runtime import MedusaRuntime

    return MedusaRuntime(fitted_engine, max_batch=1).with_tree("chain-0")


def test_measure_step_ms(runtime):
    ms = measure_step_ms(runtime, [1, 4, 16], context=64, repeats=2)
    assert sorted(ms) == [1, 4, 16] and all(v > 0 for v in ms.values())
    with pytest.raises(CalibrationError, match="max_context"):
        measure_step_ms(runtime, [64], context=250)


def test_greedy_proposals_decode_like_the_runtime(runtime):
    ids = runtime.codec.encode(PROMPTS[0], chat=False)
    tokens, proposals = greedy_proposals(runtime, ids, 24, 3)
    assert tokens == runtime.generate(ids, max_new_tokens=24).token_ids
    assert proposals.shape == (len(tokens), 4, 3)
    # head 0 of row i guesses t_{i+1}: that alignment fits far better than its neighbours
    top1 = proposals[:, 0, 0]
    rate = {shift: np.mean(top1[: len(tokens) - 2] == np.array(tokens[shift : len(tokens) - 2 + shift])) for shift in (0, 1, 2)}
    assert rate[1] > rate[0] and rate[1] > rate[2], rate


def test_measure_head_hits_fitted_heads_beat_chance(runtime):
    ids = [runtime.codec.encode(p, chat=False) for p in PROMPTS]
    hits = measure_head_hits(runtime, ids, 32, 10)
    assert hits.shape[1] == 4 and hits.shape[0] > 50
    acc = head_accuracy(hits, hits.max() + 1)
    assert acc[0, 0] > 0.2, acc  # chance is 1 / 512
    assert acc[0, 0] >= acc[3, 0]  # looking further ahead is harder


def test_next_token_aware_heads_are_calibrated_with_their_roots(stories_base, stories_next_aware, export_engine):
    """Heads that read the next token get the token just emitted as their root, as the loop gives
    it: the proposals equal the torch heads' top-k at the same hidden state and root, and the
    timing call passes a root too."""
    from medusa_trt.runtime import MedusaRuntime

    runtime = MedusaRuntime(export_engine("stories-next-aware", medusa_model(stories_base, stories_next_aware)), max_batch=1).with_tree(
        "chain-0"
    )
    ids = runtime.codec.encode(PROMPTS[0], chat=False)
    tokens, proposals = greedy_proposals(runtime, ids, 16, 3)
    assert tokens == runtime.generate(ids, max_new_tokens=16).token_ids
    with torch.no_grad():
        hidden = stories_base.model(torch.tensor([ids + tokens]), output_hidden_states=True).hidden_states[-1][0]  # (L, H)
        rows = torch.arange(len(ids) - 1, len(ids) - 1 + len(tokens))  # the hidden state before each emitted token
        want = stories_next_aware(hidden[rows], torch.tensor(tokens)).topk(3, dim=-1).indices  # (n, heads, 3)
    assert (proposals[:, 0, 0] == want[:, 0, 0].numpy()).mean() > 0.95  # top-1 of head 1; fp32 graph vs torch may swap near-ties
    assert measure_heads_ms(runtime, 3, repeats=2) > 0


def test_sequential_heads_are_calibrated_along_their_expanded_template(stories_base, stories_sequential, export_engine):
    """Sequential heads: the proposals have one row per expanded node of the engine's template, and
    the hits of head 1 (the root's row) are those of the torch heads at the same hidden state and
    root; the deeper heads' hits exist only where the true path stays in the template."""
    from medusa_trt.runtime import MedusaRuntime

    runtime = MedusaRuntime(export_engine("stories-sequential", medusa_model(stories_base, stories_sequential)), max_batch=1).with_tree(
        "chain-0"
    )
    plan = runtime._info.expansion
    hits = measure_head_hits(runtime, [runtime.codec.encode(p, chat=False) for p in PROMPTS[:2]], 24, 3)
    assert hits.shape[1] == runtime.num_heads and (hits[:, 0] == 0).mean() > 0.3
    assert ((hits[:, 1] >= 0) <= (hits[:, 0] >= 0)).all()  # head 2 is read only below a head-1 hit
    ids = runtime.codec.encode(PROMPTS[0], chat=False)
    tokens, proposals = greedy_proposals(runtime, ids, 16, 3)
    assert proposals.shape[1] == plan.rows
    with torch.no_grad():
        hidden = stories_base.model(torch.tensor([ids + tokens]), output_hidden_states=True).hidden_states[-1][0]  # (L, H)
        rows = torch.arange(len(ids) - 1, len(ids) - 1 + len(tokens))
        want = stories_sequential.head_logits(0, hidden[rows], torch.tensor(tokens)[:, None]).topk(3, dim=-1).indices  # (n, 3)
    assert (proposals[:, 0, 0] == want[:, 0].numpy()).mean() > 0.95


def _prompts_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"question_id": i, "turns": [p]}) + "\n" for i, p in enumerate(PROMPTS)))
    return path


def test_cli_end_to_end(capsys, tmp_path, fitted_engine):
    out = tmp_path / "tree.json"
    code = main(
        [
            "--engine",
            str(fitted_engine),
            "--prompts",
            str(_prompts_file(tmp_path)),
            "--out",
            str(out),
            "--max-new-tokens",
            "32",
            "--max-nodes",
            "24",
            "--repeats",
            "2",
        ]
    )
    printed = capsys.readouterr()
    assert code == 0, printed.err
    tree = load_tree(out, max_depth=4)
    assert tree.name == f"calibrated-{tree.num_nodes}" and 1 <= tree.num_nodes <= 24
    assert out.with_suffix(".png").stat().st_size > 0
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "prompts.jsonl",
        "tree.json",
        "tree.medusa_choices.json",
        "tree.png",
        "tree.report.json",
    ]  # no temps
    report = json.loads(out.with_suffix(".report.json").read_text())
    assert report["positions"] > 50 and report["acc"][0][0] > 0.2
    assert sorted(int(k) for k in report["step_ms"]) == [1, 2, 4, 8, 16, 24]
    assert report["choice"]["num_nodes"] == tree.num_nodes and len(report["choice"]["curve"]) == 24
    assert report["config"]["max_nodes"] == 24
    lines = printed.out.strip().splitlines()
    assert lines[0].startswith("head-1 accuracy: top-1 ")
    assert lines[1].startswith(f"chosen tree calibrated-{tree.num_nodes}: {tree.num_nodes} nodes")
    assert lines[2].startswith("best chain chain-")
    # the written tree runs on the engine it was calibrated for
    from medusa_trt.runtime import MedusaRuntime

    result = MedusaRuntime(fitted_engine, tree=str(out)).generate(PROMPTS[0], max_new_tokens=8)
    assert len(result.token_ids) == 8


def test_cli_torch_model_and_heads(capsys, tmp_path, stories_fitted):
    from medusa_trt.exporter import save_heads

    heads = save_heads(stories_fitted, tmp_path / "heads")
    out = tmp_path / "tree.json"
    code = main(
        [
            "--model",
            str(STORIES),
            "--heads",
            str(heads),
            "--prompts",
            str(_prompts_file(tmp_path)),
            "--out",
            str(out),
            "--limit",
            "2",
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
    assert load_tree(out).num_nodes <= 8
    report = json.loads(out.with_suffix(".report.json").read_text())
    assert report["backend"] == "torch" and report["prompts"] == 2 and np.shape(report["acc"]) == (4, 4)


BAD = [  # (argv changes, fragment of the one line); a None value drops the flag; {tmp} is the test's folder
    ({"--prompts": "/nonexistent/p.jsonl"}, "prompts file /nonexistent/p.jsonl does not exist"),
    ({"--prompts": "{tmp}/outdir"}, "prompts file {tmp}/outdir is a folder"),
    ({"--prompts": "{tmp}/p-latin1.jsonl"}, "{tmp}/p-latin1.jsonl:3: not UTF-8 text (byte 0xe9 at column 16): save the file as UTF-8"),
    ({"--prompts": "{tmp}/p-malformed.jsonl"}, "{tmp}/p-malformed.jsonl:3: not a JSON record"),
    ({"--prompts": "{tmp}/p-no-turns.jsonl"}, "{tmp}/p-no-turns.jsonl:1: not a Spec-Bench record with turns[0]"),
    ({"--prompts": "{tmp}/p-turn-not-text.jsonl"}, "p-turn-not-text.jsonl:1: not a Spec-Bench record"),
    ({"--prompts": "{tmp}/p-empty.jsonl"}, "{tmp}/p-empty.jsonl holds no prompts"),
    ({"--heads": "/tmp/x"}, "go with --model"),
    ({"--device": "cpu"}, "go with --model"),
    ({"--engine": None, "--model": "stories260K"}, "--model needs --heads"),
    ({"--engine": None, "--model": "stories260K", "--heads": "{tmp}/outdir", "--device": "tpu"}, "--device tpu: pass cpu or cuda"),
    *(  # a machine without CUDA: one line, before any model loads
        []
        if torch.cuda.is_available()
        else [({"--engine": None, "--model": "stories260K", "--heads": "{tmp}/outdir", "--device": "cuda"}, "torch sees no CUDA GPU here")]
    ),
    ({"--out": "/nonexistent/dir/tree.json"}, "folder /nonexistent/dir does not exist"),
    ({"--out": "{tmp}/p-good.jsonl/tree.json"}, "{tmp}/p-good.jsonl is not a folder"),
    ({"--out": "/sys/medusa-tree.json"}, "folder /sys is not writable"),
    ({"--out": "tree.txt"}, "must end in .json"),
    ({"--out": "{tmp}/outdir/"}, "--out {tmp}/outdir/ is a folder: name the file to write"),
    ({"--out": "{tmp}/outdir"}, "--out {tmp}/outdir is a folder"),
    ({"--out": "{tmp}/plotdir.json"}, "cannot write {tmp}/plotdir.png beside --out {tmp}/plotdir.json: it is a folder"),
    ({"--out": "{tmp}/reportdir.json"}, "cannot write {tmp}/reportdir.report.json beside --out"),
    ({"--engine": "/nonexistent/m.onnx"}, "/nonexistent/m.onnx does not exist"),
    ({"--limit": "0"}, "argument --limit: must be >= 1, got 0"),
    ({"--max-nodes": "0"}, "argument --max-nodes: must be >= 1, got 0"),
    ({"--max-new-tokens": "-1"}, "argument --max-new-tokens: must be >= 1, got -1"),
    ({"--top-k": "0"}, "argument --top-k: must be >= 1, got 0"),
    ({"--context": "-1"}, "argument --context: must be >= 0, got -1"),
    ({"--repeats": "0"}, "argument --repeats: must be >= 1, got 0"),
    ({"--repeats": "two"}, "argument --repeats: expected a whole number, got 'two'"),
    ({"--threads": "-3"}, "argument --threads: must be >= 1, got -3"),
]


@pytest.fixture
def folder(tmp_path, monkeypatch):
    """tmp_path with bad prompt files, folders where outputs would go, and an empty cwd."""
    from test_bench_bad_input import PROMPT_FILES

    for name, data in PROMPT_FILES.items():
        (tmp_path / f"p-{name}.jsonl").write_bytes(data)
    for sub in ("outdir", "plotdir.png", "reportdir.report.json", "cwd"):
        (tmp_path / sub).mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    return tmp_path


@pytest.mark.parametrize("changes,message", BAD, ids=[" ".join(f"{k} {v}" for k, v in c[0].items()) for c in BAD])
def test_bad_input_is_one_line(capsys, folder, changes, message):
    """Each fails before an engine is opened, so no export is needed; nothing is left on disk."""
    from test_bench_bad_input import _snapshot, assert_one_line

    before = _snapshot(folder)
    argv = {"--engine": str(folder / "absent.onnx"), "--prompts": str(folder / "p-good.jsonl"), "--out": str(folder / "t.json")}
    argv |= {k: v if v is None else v.format(tmp=folder) for k, v in changes.items()}
    try:
        code = main([x for k, v in argv.items() if v is not None for x in (k, v)])
    except SystemExit as exc:  # usage errors (cli.common.Parser: one line, exit 2)
        code = exc.code
    assert code not in (0, None)
    assert_one_line(capsys.readouterr().err, "medusa-calibrate", message.format(tmp=folder))
    assert _snapshot(folder) == before


def test_cli_write_failure_leaves_nothing(capsys, tmp_path, fitted_engine, monkeypatch):
    """The plot fails half-written after the tree and report are staged: one line, no file, no temp."""
    import errno

    from medusa_trt.training import calibrate as library

    def full_disk(acc, choice, chain, path):
        path.write_bytes(b"\x89PNG half")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(library, "_plot", full_disk)
    prompts = _prompts_file(tmp_path)
    out = tmp_path / "out" / "tree.json"
    out.parent.mkdir()
    code = main(
        [
            "--engine",
            str(fitted_engine),
            "--prompts",
            str(prompts),
            "--out",
            str(out),
            "--limit",
            "1",
            "--max-new-tokens",
            "8",
            "--max-nodes",
            "4",
            "--context",
            "16",
            "--repeats",
            "1",
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert (
        err.strip() == f"medusa-calibrate: error: cannot write {out}: No space left on device: check the folder "
        "(free space, permissions) or pick another --out"
    )
    assert list(out.parent.iterdir()) == []


def test_cli_on_an_engine_folder_records_its_cost(capsys, tmp_path, stories_base, stories_fitted):
    """medusa-calibrate --engine DIR rewrites the folder's measured step cost (drafting.json) and its manifest."""
    from medusa_trt.exporter.onnx_export import ExportConfig, export_onnx
    from medusa_trt.runtime import MedusaRuntime

    folder = tmp_path / "engine"
    config = ExportConfig(out=folder, tree="chain-3", max_context=256, measure_cost=False, backend="onnxruntime")
    export_onnx(medusa_model(stories_base, stories_fitted), config)
    assert json.loads((folder / "drafting.json").read_text())["step_cost"] is None
    out = tmp_path / "tree.json"
    code = main(
        [
            "--engine",
            str(folder),
            "--prompts",
            str(_prompts_file(tmp_path)),
            "--out",
            str(out),
            "--max-new-tokens",
            "16",
            "--max-nodes",
            "8",
            "--repeats",
            "2",
            "--limit",
            "2",
        ]
    )
    printed = capsys.readouterr()
    assert code == 0, printed.err
    drafting = json.loads((folder / "drafting.json").read_text())
    assert sorted(int(k) for k in drafting["step_cost"]) == [1, 2, 4, 8] and drafting["step_cost"]["1"] == 1.0
    assert drafting["heads_cost"] > 0 and str(folder / "drafting.json") in printed.out
    assert MedusaRuntime(folder).drafting.names  # the manifest still matches: the folder loads
