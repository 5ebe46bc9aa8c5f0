"""Tree compiler: a tree worked out by hand, chains, the published preset, and every rejection."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from medusa_trt.runtime.tree import DEFAULT_MAX_NODES, InvalidTreeError, chain_paths, compile_tree, load_tree, resolve_tree

PRESETS = Path("/work/shared/trees/medusa_choices.json")
needs_presets = pytest.mark.skipif(not PRESETS.is_file(), reason=f"{PRESETS} not present")

# Nodes by (len, path): 0 root, 1 [0], 2 [1], 3 [0,0], 4 [0,1], 5 [1,0], 6 [0,0,0]
HAND_PATHS = [[0, 0, 0], [1, 0], [0], [0, 1], [1], [0, 0]]  # shuffled on purpose


def test_hand_tree():
    t = compile_tree(HAND_PATHS, name="hand")
    assert t.name == "hand"
    assert t.paths == ((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0))
    assert (t.top_k, t.depth_max, t.num_nodes) == (2, 3, 7)
    np.testing.assert_array_equal(t.depth, [0, 1, 1, 2, 2, 2, 3])
    np.testing.assert_array_equal(t.parent, [-1, 0, 0, 1, 1, 2, 3])
    # layout [root, h1 top0, h1 top1, h2 top0, h2 top1, h3 top0, h3 top1]; node -> 1 + (d-1)*2 + p[-1]
    np.testing.assert_array_equal(t.gather_index, [0, 1, 2, 3, 4, 3, 5])
    expected_mask = np.array(
        [
            [1, 0, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0, 0],
            [1, 0, 1, 0, 0, 0, 0],
            [1, 1, 0, 1, 0, 0, 0],
            [1, 1, 0, 0, 1, 0, 0],
            [1, 0, 1, 0, 0, 1, 0],
            [1, 1, 0, 1, 0, 0, 1],
        ],
        dtype=bool,
    )
    np.testing.assert_array_equal(t.mask, expected_mask)
    np.testing.assert_array_equal(t.retrieve, [[0, 1, 4, -1], [0, 2, 5, -1], [0, 1, 3, 6]])
    np.testing.assert_array_equal(t.path_lengths, [3, 3, 4])
    for a in (t.depth, t.parent, t.gather_index, t.retrieve, t.path_lengths):
        assert a.dtype == np.int64
    assert t.mask.dtype == bool


def test_explicit_top_k_changes_layout():
    t = compile_tree(HAND_PATHS, top_k=4)
    assert t.top_k == 4
    np.testing.assert_array_equal(t.gather_index, [0, 1, 2, 5, 6, 5, 9])


def test_arrays_read_only():
    t = compile_tree(HAND_PATHS)
    for a in (t.depth, t.parent, t.gather_index, t.mask, t.retrieve, t.path_lengths):
        assert not a.flags.writeable
        with pytest.raises(ValueError):
            a[0] = 0


def test_chain_0_is_root_only():
    assert chain_paths(0) == []
    t = compile_tree(chain_paths(0))
    assert (t.num_nodes, t.depth_max, t.top_k, t.paths) == (1, 0, 1, ())
    np.testing.assert_array_equal(t.depth, [0])
    np.testing.assert_array_equal(t.parent, [-1])
    np.testing.assert_array_equal(t.gather_index, [0])
    np.testing.assert_array_equal(t.mask, [[True]])
    np.testing.assert_array_equal(t.retrieve, [[0]])
    np.testing.assert_array_equal(t.path_lengths, [1])


def test_chain_4():
    assert chain_paths(4) == [[0], [0, 0], [0, 0, 0], [0, 0, 0, 0]]
    t = load_tree("chain-4")
    assert (t.name, t.num_nodes, t.depth_max, t.top_k) == ("chain-4", 5, 4, 1)
    np.testing.assert_array_equal(t.depth, [0, 1, 2, 3, 4])
    np.testing.assert_array_equal(t.parent, [-1, 0, 1, 2, 3])
    np.testing.assert_array_equal(t.gather_index, [0, 1, 2, 3, 4])
    np.testing.assert_array_equal(t.mask, np.tril(np.ones((5, 5), dtype=bool)))
    np.testing.assert_array_equal(t.retrieve, [[0, 1, 2, 3, 4]])
    np.testing.assert_array_equal(t.path_lengths, [5])


@needs_presets
def test_preset_mc_sim_7b_63():
    t = load_tree("mc_sim_7b_63", presets_file=PRESETS)
    assert (t.name, t.num_nodes, t.depth_max) == ("mc_sim_7b_63", 64, 4)
    assert t.top_k == 1 + max(max(p) for p in t.paths)
    for i in range(1, t.num_nodes):
        p = int(t.parent[i])
        assert 0 <= p < i and t.depth[i] == t.depth[p] + 1
        expected = t.mask[p].copy()
        expected[i] = True
        np.testing.assert_array_equal(t.mask[i], expected, err_msg=f"mask row {i} ({list(t.paths[i - 1])})")
    assert t.gather_index.max() < 1 + t.depth_max * t.top_k
    has_child = np.zeros(t.num_nodes, dtype=bool)
    has_child[t.parent[1:]] = True
    leaves = t.retrieve[np.arange(len(t.retrieve)), t.path_lengths - 1]
    np.testing.assert_array_equal(leaves, np.flatnonzero(~has_child))  # every leaf, by node index
    for row, n in zip(t.retrieve, t.path_lengths):
        assert row[0] == 0 and (row[n:] == -1).all()
        for d in range(1, n):
            assert t.parent[row[d]] == row[d - 1] and t.depth[row[d]] == d


@pytest.mark.parametrize(
    "paths, kwargs, match",
    [
        ("0,1", {}, r"list of paths"),
        ([[0], 1], {}, r"tree path 1 is not a list of ints"),
        ([[0], [0, "a"]], {}, r"tree path \[0, 'a'\] is not a list of ints"),
        ([[0], [True]], {}, r"tree path \[True\] is not a list of ints"),
        ([[0], []], {}, r"tree path \[\] is empty"),
        ([[0], [-1]], {}, r"tree path \[-1\] has a negative index"),
        ([[0], [1], [0]], {}, r"tree path \[0\] appears twice"),
        ([[0], [0, 3]], {"top_k": 3}, r"tree path \[0, 3\] uses index 3 .* top_k=3"),
        (
            [[0], [0, 0], [0, 0, 0]],
            {"max_depth": 2},
            r"tree path \[0, 0, 0\] .* needs 3 heads but only 2 are available; use a shallower tree",
        ),
        ([[0], [0, 0, 1]], {}, r"tree path \[0, 0, 1\] has no parent \[0, 0\]"),
        (
            [[1], [0, 3]],
            {},
            r"tree path \[0, 3\] has no parent \[0\]: a tree must be prefix-closed; "
            r"add \[0\] or remove \[0, 3\]",
        ),
        (chain_paths(5), {"max_nodes": 4}, r"6 nodes .* at most 4 .* path \[0, 0, 0, 0\]"),
    ],
)
def test_rejections(paths, kwargs, match):
    with pytest.raises(InvalidTreeError, match=match):
        compile_tree(paths, **kwargs)


def test_default_max_nodes():
    assert compile_tree(chain_paths(DEFAULT_MAX_NODES - 1)).num_nodes == DEFAULT_MAX_NODES
    with pytest.raises(InvalidTreeError, match=r"129 nodes"):
        compile_tree(chain_paths(DEFAULT_MAX_NODES))


def test_resolve_list_and_chain():
    assert resolve_tree([[0], [1]]) == ("custom", [[0], [1]])
    assert resolve_tree("chain-0") == ("chain-0", [])
    with pytest.raises(InvalidTreeError, match=r"chain-N"):
        resolve_tree("chain-x")


def test_resolve_json_file_both_forms(tmp_path):
    bare = tmp_path / "mine.json"
    bare.write_text(json.dumps(HAND_PATHS))
    assert resolve_tree(str(bare)) == ("mine", HAND_PATHS)
    assert resolve_tree(bare) == ("mine", HAND_PATHS)
    obj = tmp_path / "obj.json"
    obj.write_text(json.dumps({"name": "named", "paths": HAND_PATHS}))
    assert resolve_tree(obj) == ("named", HAND_PATHS)
    obj.write_text(json.dumps({"paths": HAND_PATHS}))
    assert resolve_tree(obj) == ("obj", HAND_PATHS)


def test_to_json_round_trip_keeps_top_k(tmp_path):
    t = compile_tree(HAND_PATHS, top_k=4, name="wide")
    f = tmp_path / "wide.json"
    f.write_text(t.to_json())
    assert json.loads(t.to_json()) == {"name": "wide", "paths": [list(p) for p in t.paths], "top_k": 4}
    u = load_tree(f)
    assert (u.name, u.paths, u.top_k) == ("wide", t.paths, 4)
    np.testing.assert_array_equal(u.gather_index, t.gather_index)
    assert load_tree(f, top_k=2).top_k == 2  # an explicit top_k wins


def test_malformed_json(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("[[0], [1")
    with pytest.raises(InvalidTreeError, match=r"bad\.json"):
        resolve_tree(bad)
    wrong = tmp_path / "wrong.json"
    wrong.write_text('{"nodes": []}')
    with pytest.raises(InvalidTreeError, match=r"wrong\.json.*'paths'"):
        resolve_tree(wrong)
    with pytest.raises(InvalidTreeError, match=r"bad\.json"):
        resolve_tree("mc_sim_7b_63", presets_file=bad)


def test_missing_json_file(tmp_path):
    with pytest.raises(InvalidTreeError, match=r"does not exist"):
        resolve_tree(str(tmp_path / "nope.json"))


def test_unknown_preset(tmp_path):
    presets = tmp_path / "presets.json"
    presets.write_text(json.dumps({"small": [[0]], "big": [[0], [1]]}))
    assert resolve_tree("big", presets_file=presets) == ("big", [[0], [1]])
    with pytest.raises(InvalidTreeError, match=r"unknown tree 'nope'; choose one of big, small, chain-N, or a JSON file"):
        resolve_tree("nope", presets_file=presets)


def test_presets_from_env(tmp_path, monkeypatch):
    presets = tmp_path / "presets.json"
    presets.write_text(json.dumps({"small": [[0]]}))
    monkeypatch.setenv("MEDUSA_TRT_TREE_PRESETS", str(presets))
    assert resolve_tree("small") == ("small", [[0]])


def test_missing_presets_file(tmp_path, monkeypatch):
    monkeypatch.setenv("MEDUSA_TRT_TREE_PRESETS", str(tmp_path / "absent.json"))
    with pytest.raises(InvalidTreeError, match=r"MEDUSA_TRT_TREE_PRESETS.*JSON file"):
        resolve_tree("mc_sim_7b_63")
    with pytest.raises(InvalidTreeError, match=r"MEDUSA_TRT_TREE_PRESETS.*JSON file"):
        resolve_tree("mc_sim_7b_63", presets_file=tmp_path / "gone.json")


@needs_presets
def test_default_presets_path_finds_shared(monkeypatch):
    monkeypatch.delenv("MEDUSA_TRT_TREE_PRESETS", raising=False)
    name, paths = resolve_tree("mc_sim_7b_63")
    assert name == "mc_sim_7b_63" and len(paths) == 63


def test_numpy_only():
    code = "import sys, medusa_trt.runtime.tree; bad = [m for m in ('torch', 'transformers') if m in sys.modules]; assert not bad, bad"
    subprocess.run([sys.executable, "-c", code], check=True)
