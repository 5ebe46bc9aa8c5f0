"""EAGLE-3-style drafter: the unrolled training steps see what a draft tree's nodes see at inference, the EAGLE-2
tree grows from the drafter's own choices, training lowers the loss and resumes, and the folder is written whole."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from medusa_trt.exporter.eagle import (
    EAGLE_WEIGHTS,
    DraftKeys,
    EagleConfig,
    EagleDrafter,
    EagleFormatError,
    base_hidden,
    load_drafter,
    save_drafter,
    ttt_mask,
)
from medusa_trt.runtime.durable import NotOursError


@pytest.fixture(scope="module")
def tiny_base():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        pad_token_id=0,
    )
    return LlamaForCausalLM(config).eval()


def _drafter(base, draft_vocab=48, seed=1) -> EagleDrafter:
    torch.manual_seed(seed)
    drafter = EagleDrafter(EagleConfig(32, 64, draft_vocab, (0, 2, 3), "tiny"), base)
    drafter.init_from_base(torch.arange(draft_vocab) + 64 - draft_vocab)
    for p in drafter.parameters():  # away from the initialisation, so every part matters
        p.data += 0.05 * torch.randn_like(p)
    return drafter.eval()


@torch.no_grad()
def _chain_by_hand(drafter, ids: list[int], anchor: int, steps: int, tokens: list[int]) -> list[torch.Tensor]:
    """Logits of a draft chain below the root ``ids[anchor + 1]``, one node at a time as inference runs them: each
    node sees the committed positions' step-0 keys and its own ancestors' keys."""
    T = len(ids)
    hidden = base_hidden(drafter.base, torch.tensor([ids]), drafter.config.layers)
    keys = DraftKeys()
    g0 = drafter.step(torch.tensor([ids[1:] + ids[-1:]]), drafter.features(hidden), torch.arange(T)[None], ttt_mask(T, 0), keys)
    committed_k, committed_v = keys.new_keys[:, :, : anchor + 1], keys.new_values[:, :, : anchor + 1]
    out = [drafter.logits(g0[:, anchor])]
    feature, chain_k, chain_v = g0[:, anchor], [], []
    for d in range(1, steps):
        cache = DraftKeys(torch.cat([committed_k, *chain_k], dim=2), torch.cat([committed_v, *chain_v], dim=2))
        mask = torch.zeros(1, 1, 1, anchor + 1 + len(chain_k) + 1)
        g = drafter.step(torch.tensor([[tokens[d - 1]]]), feature[:, None], torch.tensor([[anchor + d]]), mask, cache)
        chain_k.append(cache.new_keys)
        chain_v.append(cache.new_values)
        feature = g[:, 0]
        out.append(drafter.logits(g[:, 0]))
    return out


def test_the_unrolled_training_steps_are_what_a_draft_chain_computes(tiny_base):
    from medusa_trt.training.eagle import ttt_forward

    drafter = _drafter(tiny_base)
    ids = torch.randint(1, 64, (1, 20), generator=torch.Generator().manual_seed(3))
    hidden = base_hidden(tiny_base, ids, drafter.config.layers)
    argmax = tiny_base(ids).logits.argmax(-1)
    t2d = torch.full((64,), -1)
    t2d[drafter.d2t] = torch.arange(48)
    with torch.no_grad():
        results = ttt_forward(drafter, ids, hidden, argmax, torch.ones_like(ids, dtype=torch.bool), t2d, 4)
    seq = ids[0].tolist()
    for anchor in (0, 5, 13):
        by_hand = _chain_by_hand(drafter, seq, anchor, 4, [seq[anchor + 1 + d] for d in range(1, 4)])
        for k, (g, _, _) in enumerate(results):
            torch.testing.assert_close(drafter.logits(g[0, anchor]), by_hand[k][0], rtol=1e-4, atol=1e-5)
    # and the steps differ from each other: step k's own features and keys matter
    assert not torch.allclose(results[1][0][0, 5], results[0][0][0, 6], atol=1e-3)


def test_the_draft_tree_grows_from_the_drafters_own_choices(tiny_base):
    from medusa_trt.bench.eagle_replay import EaglePass, draft_tree

    drafter = _drafter(tiny_base)
    ids = torch.randint(1, 64, (24,), generator=torch.Generator().manual_seed(4)).tolist()
    state = EaglePass(drafter, ids)
    anchor = 15
    chain = draft_tree(state, anchor, top_k=1, depth=5, nodes=5, max_depth=5)  # top-1 at every depth: a chain
    assert chain.parent.tolist() == [-1, 0, 1, 2, 3]
    tokens = chain.tokens.tolist()
    by_hand = _chain_by_hand(drafter, ids, anchor, 5, tokens)
    assert tokens == [int(drafter.d2t[logits.argmax()]) for logits in by_hand]
    tree = draft_tree(state, anchor, top_k=4, depth=4, nodes=12, max_depth=4)
    assert tree.size == 12 and (tree.parent < torch.arange(12).numpy()).all()
    assert tree.tokens[0] == tokens[0]  # the most likely first draft is the chain's
    assert tree.keys[0][:2] == ("eagle-p", 1)
    assert draft_tree(state, anchor, top_k=4, depth=4, nodes=12, max_depth=1).parent.max() == -1  # no room: depth 1


def test_training_lowers_the_loss_and_resumes(tiny_base, tmp_path):
    from medusa_trt.training.eagle import EagleTrainConfig, train

    gen = torch.Generator().manual_seed(5)
    rows = []
    for n in (30, 40, 50, 60) * 3:
        ids = torch.randint(1, 64, (1, n), generator=gen)
        hidden = base_hidden(tiny_base, ids, (0, 2, 3))
        rows.append({"ids": ids[0], "hidden": hidden[0].detach().to(torch.bfloat16), "argmax": tiny_base(ids).logits.argmax(-1)[0]})
    base = SimpleNamespace(model=tiny_base, name="tiny")
    config = EagleTrainConfig(
        out=str(tmp_path / "d"),
        work=str(tmp_path),
        draft_vocab=48,
        layers=(0, 2, 3),
        steps=3,
        epochs=20,
        batch_tokens=120,
        lr=1e-2,
        bf16=False,
    )
    (tmp_path / "eagle").mkdir()
    drafter, metrics = train(base, rows, config, tmp_path)
    assert max(metrics["loss_last"]) < 0.8 * min(metrics["loss_first"])
    assert len(metrics["holdout_top1_per_step"]) == 3
    again, resumed = train(base, rows, config, tmp_path)  # the checkpoint holds the finished run
    assert resumed["steps"] == metrics["steps"] and resumed["positions_per_s"] is None
    for a, b in zip(drafter.state_dict().values(), again.state_dict().values()):
        assert torch.equal(a, b)


def test_the_folder_round_trips_and_bad_folders_are_named(tiny_base, tmp_path):
    drafter = _drafter(tiny_base)
    folder = save_drafter(drafter, tmp_path / "drafter")
    loaded = load_drafter(folder, tiny_base)
    g = torch.randn(1, 3, 32)
    torch.testing.assert_close(loaded.logits(g), drafter.logits(g), rtol=0, atol=0)
    assert torch.equal(loaded.d2t, drafter.d2t)
    with pytest.raises(EagleFormatError, match="eagle.json is missing"):
        load_drafter(tmp_path, tiny_base)
    (folder / EAGLE_WEIGHTS).write_bytes(b"not safetensors")
    with pytest.raises(EagleFormatError, match="unreadable"):
        load_drafter(folder, tiny_base)
    folder = save_drafter(drafter, tmp_path / "drafter2")
    again = save_drafter(drafter, folder, extra={"metrics.json": "{}"})  # its own folder (files.json): replaced
    assert sorted(f.name for f in again.iterdir()) == ["eagle.json", "eagle.safetensors", "files.json", "metrics.json"]
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    with pytest.raises(NotOursError, match="notes.txt is not a file medusa-trt wrote"):
        save_drafter(drafter, mine)
    assert [f.name for f in mine.iterdir()] == ["notes.txt"] and (mine / "notes.txt").read_text() == "keep me"
    from medusa_trt.training.eagle import EagleTrainConfig, run

    with pytest.raises(NotOursError):  # refused before any work: no model, no data needed to get there
        run(SimpleNamespace(), EagleTrainConfig(out=str(mine), work=str(tmp_path / "work")), None)
    assert not (tmp_path / "work").exists()
    with pytest.raises(EagleFormatError, match="reach past"):
        EagleDrafter(EagleConfig(32, 64, 48, (0, 4)), tiny_base)
    with pytest.raises(EagleFormatError, match="hidden size 16"):
        EagleDrafter(EagleConfig(16, 64, 48, (0,)), tiny_base)


def test_the_base_choices_of_a_greedy_sequence_and_the_draft_vocabulary():
    from medusa_trt.training.eagle import choices, draft_vocabulary

    ids = [5, 6, 7, 8, 9, 9]  # a prompt of 3, then the base's greedy tokens 8, 9, 9
    assert choices(ids, 3).tolist() == [-1, -1, 8, 9, 9, -1]
    rows = [{"argmax": choices(ids, 3)}, {"argmax": torch.tensor([-1, 4, 9])}]
    assert draft_vocabulary(rows, 12, 2).tolist() == [8, 9]  # the most chosen, in id order; the prompt's -1 ignored


OPENINGS = ["Tim had a red ball", "The sun was hot", "Sara found a box", "A cat sat on the mat", "Ben wanted to fly", "Mom made a cake"]


def test_a_drafter_trained_on_a_models_outputs_drafts_them_in_the_replay(stories_base, stories_next_aware, tmp_path, capsys):
    """End to end on stories260K: the model's own continuations generated, their features cached, the drafter
    trained on them and saved; replayed on the same prompts (which it has learnt), its trees are accepted, alone
    and merged with lookup and recycle, and the report names every row."""
    import json

    from medusa_trt.bench import eagle_replay, replay
    from medusa_trt.exporter.heads import save_heads
    from medusa_trt.training.config import TrainConfig
    from medusa_trt.training.eagle import EagleTrainConfig, run

    prompts = tmp_path / "openings.txt"
    prompts.write_text("\n".join(OPENINGS))
    data = TrainConfig(out=str(tmp_path / "d"), data=str(prompts), num_prompts=len(OPENINGS), new_tokens=48, generate_batch=3)
    config = EagleTrainConfig(
        out=str(tmp_path / "drafter"),
        work=str(tmp_path / "work"),
        draft_vocab=256,
        steps=3,
        epochs=40,
        batch_tokens=256,
        lr=1e-2,
        holdout=0.0,
    )
    metrics = run(stories_base, config, data)
    assert max(metrics["loss_last"]) < 0.5 * min(metrics["loss_first"])
    save_heads(stories_next_aware, tmp_path / "heads")
    engine = tmp_path / "engine"
    engine.mkdir()
    (engine / "drafting.json").write_text(json.dumps({"step_cost": {"1": 1.0, "8": 1.2, "16": 1.5, "64": 3.0}, "heads_cost": 0.1}))
    dev = tmp_path / "dev.jsonl"
    dev.write_text("".join(json.dumps({"turns": [p]}) + "\n" for p in OPENINGS))
    model = str(stories_base.name)
    cache = tmp_path / "cache.npz"
    common = ["--model", model, "--heads", str(tmp_path / "heads"), "--tree", "chain-3"]
    assert (
        replay.main([*common, "--prompts", str(dev), "--every", "1", "--max-new-tokens", "48", "--draft", "heads", "--cache", str(cache)])
        == 0
    )
    out = tmp_path / "eagle.json"
    args = [*common, "--draft-vocab", "512", "--drafter", config.out, "--engine", str(engine), "--depth", "4", "--top-k", "4"]
    assert eagle_replay.main([*args, "--cache", str(cache), "--nodes", "8", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["results"]
    assert set(rows) == {"eagle@8", "heads", "heads,lookup,recycle", "eagle", "eagle,lookup,recycle", "eagle,heads,lookup,recycle"}
    assert rows["eagle@8"]["tokens_per_step"] > 2.0  # it learnt these continuations: most of each tree's path is right
    assert rows["eagle"]["tokens_per_step"] > 1.5 and rows["eagle"]["modelled_vs_plain"] > 0
    assert "eagle,lookup,recycle" in capsys.readouterr().out
    kept = {k: v for k, v in np.load(cache).items() if k not in ("ids1", "cont1", "topk1", "conf1")}  # as if prompt 1 did not fit
    np.savez(tmp_path / "gap.npz", **kept)
    gap = tmp_path / "gap.json"
    assert eagle_replay.main([*args, "--cache", str(tmp_path / "gap.npz"), "--nodes", "8", "--draft", "eagle", "--out", str(gap)]) == 0
    assert json.loads(gap.read_text())["results"]["eagle@8"]["tokens"] < rows["eagle@8"]["tokens"]
