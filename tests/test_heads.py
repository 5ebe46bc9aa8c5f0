"""Medusa heads: distinct blocks, forward against a hand computation, our format's round trip,
FasterDecoding/Medusa checkpoints built here from raw tensors, and every refusal."""

import json
import logging
from pathlib import Path

import pytest
import torch
from numerics import assert_close_fp32, assert_same_top_ids, dot_magnitude, linear_error, silu_residual_error
from safetensors.torch import save_file
from torch import nn
from torch.nn import functional as F

import medusa_trt.exporter.heads as heads_mod
from medusa_trt.exporter.heads import (
    HeadsConfig,
    HeadsFormatError,
    HeadsMismatchError,
    MedusaHeads,
    ResBlock,
    init_heads,
    load_heads,
    save_heads,
)

H, V = 16, 32  # tiny hidden size and vocabulary


def make_lm_head(seed: int = 1, vocab: int = V) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(H, vocab, bias=False)


def config(num_heads=3, num_layers=2, shared=False, **kw) -> HeadsConfig:
    return HeadsConfig(num_heads=num_heads, num_layers=num_layers, hidden_size=H, vocab_size=V, shared_lm_head=shared, **kw)


def hidden(*lead: int) -> torch.Tensor:
    return torch.randn(*lead, H, generator=torch.Generator().manual_seed(7))


def by_hand(x, blocks, proj):
    """x [..., H]; blocks: [(W [H, H], b [H])] applied in order; proj [V, H] -> logits [..., V]."""
    for w, b in blocks:
        x = x + F.silu(x @ w.T + b)
    return x @ proj.T


def block_tensors(heads: MedusaHeads, k: int):
    return [(m.linear.weight, m.linear.bias) for m in heads.heads[k] if isinstance(m, ResBlock)]


def load(path, lm_head=None, **kw):
    return load_heads(path, hidden_size=kw.pop("hidden_size", H), vocab_size=kw.pop("vocab_size", V), lm_head=lm_head, **kw)


# ---------------------------------------------------------------- the module


def test_every_block_has_its_own_weights():
    heads = init_heads(config(num_heads=2, num_layers=3), make_lm_head(), random=True)
    blocks = [m for head in heads.heads for m in head if isinstance(m, ResBlock)]
    assert len(blocks) == 2 * 3
    weights = [b.linear.weight for b in blocks]
    # not the reference's `[ResBlock(h)] * L`: six modules, six storages, six different values
    assert len({id(b) for b in blocks}) == 6
    assert len({w.untyped_storage().data_ptr() for w in weights}) == 6
    assert len({b.linear.bias.untyped_storage().data_ptr() for b in blocks}) == 6
    for i in range(len(weights)):
        for j in range(i + 1, len(weights)):
            assert not torch.equal(weights[i], weights[j]), f"blocks {i} and {j} hold equal weights"


@pytest.mark.parametrize("lead", [(), (5,), (2, 4)], ids=["single", "seq", "batch_seq"])
def test_forward_own_projection_matches_hand_computation(lead):
    heads = init_heads(config(num_heads=3, num_layers=2), make_lm_head(), random=True)
    with torch.no_grad():  # own projections made distinct from the lm_head copy
        for k, head in enumerate(heads.heads):
            head[-1].weight.normal_(generator=torch.Generator().manual_seed(100 + k))
    x = hidden(*lead)
    with torch.no_grad():
        out = heads(x)
    assert out.shape == (*lead, 3, V)  # (..., n, V)
    for k in range(3):
        expected = by_hand(x, block_tensors(heads, k), heads.heads[k][-1].weight)
        torch.testing.assert_close(out[..., k, :], expected, msg=f"head {k}, lead {lead}")


def test_forward_shared_lm_head_uses_it_and_leaves_it_out_of_state_dict():
    lm_head = make_lm_head()
    heads = init_heads(config(num_heads=2, num_layers=2, shared=True), lm_head, random=True)
    x = hidden(3)
    with torch.no_grad():
        out = heads(x)
    assert out.shape == (3, 2, V)
    for k in range(2):
        torch.testing.assert_close(out[:, k], by_hand(x, block_tensors(heads, k), lm_head.weight))
    # the lm_head belongs to the base model: not saved, not trained, not a child module
    state = heads.state_dict()
    assert all(".linear." in key for key in state), sorted(state)
    assert not any(t.data_ptr() == lm_head.weight.data_ptr() for t in state.values())
    assert not any(p is lm_head.weight for p in heads.parameters())
    assert sum(p.numel() for p in heads.parameters()) == 2 * 2 * (H * H + H)
    # and a change to the base lm_head shows up in the heads' logits
    with torch.no_grad():
        lm_head.weight.mul_(2.0)
        torch.testing.assert_close(heads(x)[:, 0], by_hand(x, block_tensors(heads, 0), lm_head.weight))


def test_shared_config_without_lm_head_is_refused():
    with pytest.raises(HeadsMismatchError, match="lm_head"):
        MedusaHeads(config(shared=True))


def test_default_init_is_identity_blocks_and_a_copy_of_lm_head():
    lm_head = make_lm_head()
    heads = init_heads(config(num_heads=2, num_layers=2), lm_head)
    for k, head in enumerate(heads.heads):
        for w, b in block_tensors(heads, k):
            assert not w.any() and not b.any()
        proj = head[-1].weight
        torch.testing.assert_close(proj, lm_head.weight)
        assert proj.untyped_storage().data_ptr() != lm_head.weight.untyped_storage().data_ptr()  # a copy
    # identity blocks + copied projection: every head starts out predicting what the lm_head does
    x = hidden(4)
    with torch.no_grad():
        out = heads(x)
        torch.testing.assert_close(out, lm_head(x).unsqueeze(-2).expand(4, 2, V))


# ---------------------------------------------------------------- our format


@pytest.mark.parametrize("shared", [False, True], ids=["own_proj", "shared_lm_head"])
def test_save_load_round_trip_gives_identical_outputs(tmp_path, shared):
    lm_head = make_lm_head()
    heads = init_heads(config(num_heads=3, num_layers=2, shared=shared, head_layer=4, base_model="tiny"), lm_head, random=True)
    folder = save_heads(heads, tmp_path / "heads")
    assert sorted(p.name for p in folder.iterdir()) == ["files.json", "heads.json", "heads.safetensors"]
    back = load(folder, lm_head, num_decoder_layers=6)
    assert back.config == heads.config
    assert back.config.head_layer == 4
    x = hidden(2, 3)
    with torch.no_grad():
        torch.testing.assert_close(back(x), heads(x), rtol=0, atol=0)


def test_load_can_override_head_layer(tmp_path):
    folder = save_heads(init_heads(config(head_layer=4), make_lm_head()), tmp_path / "heads")
    assert load(folder, num_decoder_layers=6, head_layer=2).config.head_layer == 2


def test_save_into_missing_parent_fails_and_leaves_nothing(tmp_path):
    target = tmp_path / "absent" / "heads"
    with pytest.raises(HeadsFormatError, match="does not exist"):
        save_heads(init_heads(config(), make_lm_head()), target)
    assert list(tmp_path.iterdir()) == []


def test_save_over_existing_folder_replaces_it_only_when_every_file_is_ours(tmp_path):
    from medusa_trt.runtime.durable import NotOursError

    lm_head = make_lm_head()
    folder = tmp_path / "heads"
    save_heads(init_heads(config(num_heads=2), lm_head, seed=1, random=True), folder)
    (folder / "notes.txt").write_text("the user's own")
    newer = init_heads(config(num_heads=4), lm_head, seed=2, random=True)
    with pytest.raises(NotOursError, match=r"heads/notes\.txt is not a file medusa-trt wrote"):
        save_heads(newer, folder)
    assert (folder / "notes.txt").read_text() == "the user's own" and load(folder).config.num_heads == 2
    (folder / "notes.txt").unlink()
    save_heads(newer, folder)
    assert sorted(p.name for p in folder.iterdir()) == ["files.json", "heads.json", "heads.safetensors"]
    assert [p.name for p in tmp_path.iterdir()] == ["heads"]  # no temp folder left beside it
    back = load(folder)
    assert back.config.num_heads == 4
    x = hidden(3)
    with torch.no_grad():
        torch.testing.assert_close(back(x), newer(x), rtol=0, atol=0)


def test_heads_written_before_manifests_are_refused_with_the_way_on(tmp_path):
    folder = save_heads(init_heads(config(), make_lm_head()), tmp_path / "heads")
    (folder / "files.json").unlink()  # as every heads folder before them
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    with pytest.raises(HeadsFormatError, match=r"before heads folders listed their files .*mv .*heads\.old"):
        save_heads(init_heads(config(), make_lm_head(), seed=3, random=True), folder)
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before


# ---------------------------------------------------------------- FasterDecoding/Medusa checkpoints


def fd_state(num_heads, num_layers, proj=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    state = {}
    for k in range(num_heads):
        for layer in range(num_layers):
            state[f"{k}.{layer}.linear.weight"] = torch.randn(H, H, generator=g) * H**-0.5
            state[f"{k}.{layer}.linear.bias"] = torch.randn(H, generator=g) * 0.1
        if proj:
            state[f"{k}.{num_layers}.weight"] = torch.randn(V, H, generator=g) * H**-0.5
    return state


def write_fd(folder: Path, state, *, heads_claim, layers_claim, version=None, fmt="pt") -> Path:
    folder.mkdir()
    cfg = {"medusa_num_heads": heads_claim, "medusa_num_layers": layers_claim, "base_model_name_or_path": "lmsys/vicuna-7b-v1.3"}
    if version is not None:
        cfg["version"] = version
    (folder / "config.json").write_text(json.dumps(cfg))
    if fmt == "pt":
        torch.save(state, folder / "medusa_lm_head.pt")
    else:
        save_file(state, str(folder / "medusa_lm_head.safetensors"))
    return folder


def fd_by_hand(state, x, k, num_layers, proj):
    blocks = [(state[f"{k}.{i}.linear.weight"], state[f"{k}.{i}.linear.bias"]) for i in range(num_layers)]
    return by_hand(x, blocks, proj)


def test_fasterdecoding_v1_pt_with_own_projections(tmp_path):
    state = fd_state(3, 2)
    folder = write_fd(tmp_path / "medusa", state, heads_claim=3, layers_claim=2)
    heads = load(folder, num_decoder_layers=4)
    cfg = heads.config
    assert (cfg.num_heads, cfg.num_layers, cfg.shared_lm_head) == (3, 2, False)
    assert cfg.head_layer is None and cfg.base_model == "lmsys/vicuna-7b-v1.3"
    x = hidden(2, 5)
    with torch.no_grad():
        out = heads(x)
    assert out.shape == (2, 5, 3, V)
    for k in range(3):
        torch.testing.assert_close(out[..., k, :], fd_by_hand(state, x, k, 2, state[f"{k}.2.weight"]))


def test_fasterdecoding_v2_safetensors_reuses_the_base_lm_head(tmp_path):
    state = fd_state(2, 1, proj=False)
    folder = write_fd(tmp_path / "medusa2", state, heads_claim=2, layers_claim=1, version="2", fmt="safetensors")
    lm_head = make_lm_head()
    heads = load(folder, lm_head)
    assert heads.config.shared_lm_head and heads.config.num_heads == 2
    x = hidden(4)
    with torch.no_grad():
        out = heads(x)
    for k in range(2):
        torch.testing.assert_close(out[:, k], fd_by_hand(state, x, k, 1, lm_head.weight))


def test_fasterdecoding_wrong_head_count_in_config_trusts_the_weights(tmp_path, caplog):
    state = fd_state(3, 1)
    folder = write_fd(tmp_path / "medusa", state, heads_claim=5, layers_claim=1)
    with caplog.at_level(logging.WARNING, logger=heads_mod.__name__):
        heads = load(folder)
    assert heads.config.num_heads == 3
    assert heads(hidden()).shape == (3, V)
    assert any("medusa_num_heads=5" in r.getMessage() and "3 heads" in r.getMessage() for r in caplog.records)


def test_fasterdecoding_wrong_layer_count_in_config_trusts_the_weights(tmp_path, caplog):
    state = fd_state(2, 3)
    folder = write_fd(tmp_path / "medusa", state, heads_claim=2, layers_claim=1)
    with caplog.at_level(logging.WARNING, logger=heads_mod.__name__):
        heads = load(folder)
    assert heads.config.num_layers == 3
    x = hidden()
    with torch.no_grad():
        torch.testing.assert_close(heads(x)[1], fd_by_hand(state, x, 1, 3, state["1.3.weight"]))
    assert any("medusa_num_layers=1" in r.getMessage() for r in caplog.records)


def test_fasterdecoding_weights_file_path_is_accepted(tmp_path):
    folder = write_fd(tmp_path / "medusa", fd_state(2, 1), heads_claim=2, layers_claim=1)
    assert load(folder / "medusa_lm_head.pt").config.num_heads == 2


# ---------------------------------------------------------------- refusals


@pytest.fixture
def ours(tmp_path):
    return save_heads(init_heads(config(head_layer=3), make_lm_head(), random=True), tmp_path / "ours")


@pytest.fixture
def fd(tmp_path):
    return write_fd(tmp_path / "fd", fd_state(2, 1), heads_claim=2, layers_claim=1)


def refuse_building(monkeypatch):
    """From here on, fail loudly if load_heads builds a module: a mismatch must be caught before."""

    def refuse(*args, **kwargs):
        raise AssertionError("MedusaHeads was built before the mismatch was found")

    monkeypatch.setattr(heads_mod, "MedusaHeads", refuse)


@pytest.mark.parametrize("kind", ["ours", "fd"])
@pytest.mark.parametrize(
    "bad, pattern",
    [
        (dict(hidden_size=H + 8), "hidden size 16 .* has 24"),
        (dict(vocab_size=V * 2), "vocabulary of 32 .* has 64"),
    ],
    ids=["hidden", "vocab"],
)
def test_mismatch_with_the_base_model_is_refused_before_building(request, monkeypatch, kind, bad, pattern):
    folder = request.getfixturevalue(kind)
    refuse_building(monkeypatch)
    with pytest.raises(HeadsMismatchError, match=pattern):
        load(folder, **bad)


@pytest.mark.parametrize(
    "num_decoder_layers, override", [(3, None), (8, 8), (8, -1)], ids=["saved_layer_past_end", "override_past_end", "negative"]
)
def test_head_layer_out_of_range_is_refused_before_building(ours, monkeypatch, num_decoder_layers, override):
    refuse_building(monkeypatch)
    with pytest.raises(HeadsMismatchError, match=rf"decoder layer .* layers 0\.\.{num_decoder_layers - 1}"):
        load(ours, num_decoder_layers=num_decoder_layers, head_layer=override)


def test_shared_heads_without_lm_head_are_refused(tmp_path):
    folder = save_heads(init_heads(config(shared=True), make_lm_head()), tmp_path / "shared")
    with pytest.raises(HeadsMismatchError, match="pass it as lm_head="):
        load(folder, lm_head=None)


def test_fasterdecoding_v2_without_lm_head_is_refused(tmp_path):
    folder = write_fd(tmp_path / "fd2", fd_state(2, 1, proj=False), heads_claim=2, layers_claim=1, version="2")
    with pytest.raises(HeadsMismatchError, match="lm_head"):
        load(folder, lm_head=None)


def test_nonexistent_path_is_refused(tmp_path):
    with pytest.raises(HeadsFormatError, match="does not exist"):
        load(tmp_path / "nowhere")


def test_folder_without_heads_files_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"medusa_num_heads": 2}))  # config but no weights
    with pytest.raises(HeadsFormatError, match="holds no Medusa heads"):
        load(tmp_path)


@pytest.mark.parametrize("which", ["ours", "fd_pt", "fd_safetensors"])
def test_corrupt_weights_file_is_refused(tmp_path, ours, which):
    if which == "ours":
        weights = ours / "heads.safetensors"
    else:
        fmt = which.removeprefix("fd_")
        weights = write_fd(tmp_path / which, fd_state(2, 1), heads_claim=2, layers_claim=1, fmt=fmt)
        weights = weights / f"medusa_lm_head.{fmt}"
    weights.write_bytes(b"\x00not a weights file" * 8)
    with pytest.raises(HeadsFormatError, match="cannot read heads weights"):
        load(weights.parent)


def test_weights_that_disagree_with_their_config_are_refused(ours):
    from safetensors.torch import load_file

    state = load_file(str(ours / "heads.safetensors"))
    del state["heads.1.0.linear.bias"]
    save_file(state, str(ours / "heads.safetensors"))
    with pytest.raises(HeadsFormatError, match=r"missing \['1\.0\.linear\.bias'\]"):
        load(ours)


@pytest.mark.parametrize("which", ["ours", "fd"])
@pytest.mark.parametrize("text", ["{truncated", "[1, 2]"], ids=["not_json", "not_an_object"])
def test_corrupt_config_file_is_refused(request, which, text):
    folder = request.getfixturevalue(which)
    (folder / ("heads.json" if which == "ours" else "config.json")).write_text(text)
    with pytest.raises(HeadsFormatError, match="heads config"):
        load(folder)


def test_our_config_without_its_weights_is_refused(ours):
    (ours / "heads.safetensors").unlink()
    with pytest.raises(HeadsFormatError, match="cannot read heads weights"):
        load(ours)


def test_failed_save_keeps_the_previous_heads_and_leaves_no_temp_folder(tmp_path, monkeypatch):
    import safetensors.torch

    lm_head = make_lm_head()
    old = init_heads(config(), lm_head, seed=1, random=True)
    folder = save_heads(old, tmp_path / "heads")

    def disk_full(*args, **kwargs):
        raise OSError("No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", disk_full)
    with pytest.raises(OSError, match="No space left"):
        save_heads(init_heads(config(), lm_head, seed=2, random=True), folder)
    assert [p.name for p in tmp_path.iterdir()] == ["heads"]
    monkeypatch.undo()
    x = hidden(3)
    with torch.no_grad():
        torch.testing.assert_close(load(folder)(x), old(x), rtol=0, atol=0)


# ---------------------------------------------------------------- next-token-aware heads (format version 2)


def make_embed(seed: int = 3) -> nn.Embedding:
    torch.manual_seed(seed)
    return nn.Embedding(V, H)


@pytest.mark.parametrize("shared", [False, True], ids=["own_proj", "shared_lm_head"])
def test_next_aware_heads_read_the_next_token_by_hand(shared):
    lm_head, embed = make_lm_head(), make_embed()
    heads = init_heads(config(num_heads=2, num_layers=2, shared=shared, head_input="hidden+next"), lm_head, random=True, embed=embed)
    x, nxt = hidden(5), torch.tensor([0, 3, 3, 9, 31])
    with torch.no_grad():
        out = heads(x, nxt)  # (5, n, V)
        e = embed(nxt)
        e = e / e.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt()
        for k, head in enumerate(heads.heads):
            first, second = head[0], head[1]
            y = x + F.silu(torch.cat([x, e], -1) @ first.linear.weight.T + first.linear.bias)
            y = y + F.silu(y @ second.linear.weight.T + second.linear.bias)
            proj = lm_head.weight if shared else head[-1].weight
            torch.testing.assert_close(out[:, k], y @ proj.T, rtol=1e-5, atol=1e-5)
        assert not torch.allclose(heads(x, torch.full((5,), 1)), out)  # another next token, other guesses
    with pytest.raises(HeadsMismatchError, match="pass next_ids"):
        heads(x)
    with pytest.raises(HeadsMismatchError, match="embed="):
        MedusaHeads(config(head_input="hidden+next"), lm_head)


def test_untrained_next_aware_heads_start_as_medusa_heads():
    """Zero-initialised blocks ignore the next token at first: training starts from a Medusa head."""
    lm_head, embed = make_lm_head(), make_embed()
    plain = init_heads(config(), lm_head)
    aware = init_heads(config(head_input="hidden+next"), lm_head, embed=embed)
    x = hidden(4)
    with torch.no_grad():
        torch.testing.assert_close(aware(x, torch.tensor([1, 2, 3, 4])), plain(x))


def _assert_round_trip(tmp_path, head_input: str, version: int, *inputs):
    """Heads reading ``head_input`` saved and loaded back: the file says ``version``, the outputs on
    ``inputs`` are bitwise the same, and loading without the embedding they read is refused."""
    lm_head, embed = make_lm_head(), make_embed()
    heads = init_heads(config(head_input=head_input), lm_head, random=True, embed=embed)
    folder = save_heads(heads, tmp_path / head_input.replace("+", "-"))
    raw = json.loads((folder / "heads.json").read_text())
    assert raw["format_version"] == version and raw["head_input"] == head_input
    back = load(folder, lm_head, embed=embed)
    with torch.no_grad():
        torch.testing.assert_close(back(hidden(3), *inputs), heads(hidden(3), *inputs), rtol=0, atol=0)
    with pytest.raises(HeadsMismatchError, match="embed="):
        load(folder, lm_head)


def test_version_2_round_trip_and_version_1_unchanged(tmp_path):
    _assert_round_trip(tmp_path, "hidden+next", 2, torch.tensor([4, 5, 6]))
    lm_head = make_lm_head()
    plain = save_heads(init_heads(config(), lm_head, random=True), tmp_path / "plain")
    raw = json.loads((plain / "heads.json").read_text())
    assert raw["format_version"] == 1 and "head_input" not in raw  # hidden-only heads stay readable by version-1 readers
    assert load(plain, lm_head).config.head_input == "hidden"
    raw["format_version"] = 4
    (plain / "heads.json").write_text(json.dumps(raw))
    with pytest.raises(HeadsFormatError, match="format version 4"):
        load(plain, lm_head)


# ---------------------------------------------------------------- sequential heads (format version 3)


@pytest.mark.parametrize("shared", [False, True], ids=["own_proj", "shared_lm_head"])
def test_sequential_head_k_reads_the_root_and_the_path_above_it_by_hand(shared):
    lm_head, embed = make_lm_head(), make_embed()
    heads = init_heads(config(num_heads=3, num_layers=2, shared=shared, head_input="hidden+path"), lm_head, random=True, embed=embed)
    x, nxt, path = hidden(5), torch.tensor([0, 3, 3, 9, 31]), torch.tensor([[1, 2], [4, 5], [4, 6], [7, 7], [0, 30]])
    with torch.no_grad():
        out = heads(x, nxt, path)  # (5, n, V)
        tokens = torch.cat([nxt[:, None], path], 1)  # (5, n): root first
        e = embed(tokens)
        e = e / e.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt()
        for k, head in enumerate(heads.heads):
            first, second = head[0], head[1]
            assert first.linear.in_features == (k + 2) * H  # the hidden state, the root and k drafted tokens
            y = x + F.silu(torch.cat([x, *e[:, : k + 1].unbind(1)], -1) @ first.linear.weight.T + first.linear.bias)
            y = y + F.silu(y @ second.linear.weight.T + second.linear.bias)
            proj = lm_head.weight if shared else head[-1].weight
            torch.testing.assert_close(out[:, k], y @ proj.T, rtol=1e-5, atol=1e-5)
            # the same block output projected alone (5 rows) and, in forward, beside the other heads' (a shared lm_head
            # projects all 15 rows at once): the same dot products, in GEMMs of other shapes
            assert_close_fp32(
                heads.head_logits(k, x, tokens[:, : k + 1]),
                out[:, k],
                reduction=H,
                magnitude=dot_magnitude(heads.blocks(x, nxt, path)[:, k], proj),
                msg=f"head {k}",
            )
        other = path.clone()
        other[:, 1] = 11  # another token at depth 2 changes head 3 only
        changed = heads(x, nxt, other)
        torch.testing.assert_close(changed[:, :2], out[:, :2], rtol=0, atol=0)
        assert not torch.allclose(changed[:, 2], out[:, 2])
    with pytest.raises(HeadsMismatchError, match="drafted path"):
        heads(x, nxt)


def _first_block_logits_error(heads, embed, k, x, tokens):
    """Bound on how far head k's logits at ``tokens`` [B, k+1] may move when its one block and its
    projection run in GEMMs of other shapes: the block's bound carried into the projection's."""
    assert heads.config.num_layers == 1
    block, proj = heads.heads[k][0].linear, heads.projection_weights(V)[0 if heads.config.shared_lm_head else k]
    inputs = torch.cat([x, heads_mod.unit_rms(embed(tokens)).flatten(-2)], -1)  # (B, (k+2) H)
    z = block(inputs)  # (B, H)
    y_error = silu_residual_error(x, z, linear_error(inputs, block.weight, block.bias))
    return linear_error(x + F.silu(z), proj, x_error=y_error)  # (B, V)


def test_sequential_heads_expand_a_template_along_their_own_top_k():
    """``expand``: head 1 at the root, then head d + 1 below each expanded node, reading the
    top-k token at that node's rank: row by row what ``head_logits`` gives on the same paths."""
    from medusa_trt.runtime.drafting.sequential import expansion

    lm_head, embed = make_lm_head(), make_embed()
    heads = init_heads(config(num_heads=3, num_layers=1, shared=True, head_input="hidden+path"), lm_head, random=True, embed=embed)
    plan = expansion([(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)])  # rows (), (0,), (1,), (0, 0)
    x, roots = hidden(2), torch.tensor([5, 9])
    with torch.no_grad():
        rows = heads.expand(x, roots, plan, top_k=2)  # (2, 4, V)
        top = lambda logits: logits.topk(2, dim=-1).indices  # noqa: E731
        p0 = roots[:, None]  # (2, 1): the path of each row, root first
        root = heads.head_logits(0, x, p0)
        p1, p2 = (torch.cat([p0, top(root)[:, r : r + 1]], 1) for r in (0, 1))
        at0, at1 = heads.head_logits(1, x, p1), heads.head_logits(1, x, p2)
        p00 = torch.cat([p1, top(at0)[:, :1]], 1)
        at00 = heads.head_logits(2, x, p00)
        for row, (want, k, path) in enumerate([(root, 0, p0), (at0, 1, p1), (at1, 1, p2), (at00, 2, p00)]):
            # expand runs a level's rows together (2 x 2 at depth 1), head_logits one row each: other GEMM shapes
            tolerance = _first_block_logits_error(heads, embed, k, x, path)
            assert_close_fp32(rows[:, row], want, tolerance=tolerance, msg=f"row {row}")
            assert_same_top_ids(rows[:, row], want, k=2, tolerance=tolerance, msg=f"row {row}")


def test_untrained_sequential_heads_start_as_medusa_heads_and_head_1_is_next_token_aware():
    lm_head, embed = make_lm_head(), make_embed()
    plain = init_heads(config(), lm_head)
    seq = init_heads(config(head_input="hidden+path"), lm_head, embed=embed)
    x, nxt, path = hidden(4), torch.tensor([1, 2, 3, 4]), torch.tensor([[5, 6], [7, 8], [9, 10], [11, 12]])
    with torch.no_grad():
        torch.testing.assert_close(seq(x, nxt, path), plain(x))
        aware = init_heads(config(head_input="hidden+next"), lm_head, random=True, embed=embed)
        random_seq = init_heads(config(head_input="hidden+path"), lm_head, random=True, embed=embed)
        random_seq.heads[0].load_state_dict(aware.heads[0].state_dict())  # same shapes: a next-token head is a sequential head 1
        torch.testing.assert_close(random_seq(x, nxt, path)[:, 0], aware(x, nxt)[:, 0], rtol=0, atol=0)


def test_version_3_round_trip(tmp_path):
    _assert_round_trip(tmp_path, "hidden+path", 3, torch.tensor([4, 5, 6]), torch.tensor([[1, 2], [3, 4], [5, 6]]))
