"""Head training: the loss, learning on stories260K, exact resume, data rules, the CLI."""

from __future__ import annotations

import dataclasses
import math
import shutil
from pathlib import Path

import pytest
import torch
from helpers import STORY_STARTS

from medusa_trt.training.config import TrainConfig, TrainError
from medusa_trt.training.data import IGNORE, build_sequences, cache_hidden
from medusa_trt.training.train import head_accuracy, loss_curve, medusa_loss, run, train_heads


def test_loss_with_decay_on_hand_computed_logits():
    # two positions, two heads, vocabulary of three
    logits = torch.tensor([[[2.0, 0.0, 0.0], [0.0, 1.0, 0.0]], [[0.0, 0.0, 0.0], [1.0, 1.0, 3.0]]])  # (P=2, n=2, V=3)
    targets = torch.tensor([[0, 1], [2, IGNORE]])  # second position has no target for head 2
    ce = lambda row, t: -(row[t] - math.log(sum(math.exp(x) for x in row)))  # noqa: E731
    head1 = (ce([2.0, 0.0, 0.0], 0) + ce([0.0, 0.0, 0.0], 2)) / 2
    head2 = ce([0.0, 1.0, 0.0], 1)
    loss, per_head = medusa_loss(logits, targets, decay=0.8)
    assert per_head.tolist() == pytest.approx([head1, head2], abs=1e-6)
    assert loss.item() == pytest.approx(0.8 * head1 + 0.8**2 * head2, abs=1e-6)
    # decay 1: plain sum; a head without any target contributes nothing
    loss, _ = medusa_loss(logits, torch.tensor([[0, IGNORE], [2, IGNORE]]), decay=1.0)
    assert loss.item() == pytest.approx(head1, abs=1e-6)


def _config(tmp_path, name="heads", **overrides) -> TrainConfig:
    """Story openings for the TinyStories model: its continuations are what its heads can learn."""
    prompts = tmp_path / "stories.txt"
    prompts.write_text("\n".join(STORY_STARTS))
    base = dict(
        out=str(tmp_path / name),
        data=str(prompts),
        num_prompts=16,
        new_tokens=48,
        epochs=3,
        batch_size=64,
        lr=1e-2,
        warmup_steps=2,
        checkpoint_every=4,
        holdout=0.0,
        seed=1,
        generate_batch=4,
    )
    return TrainConfig(**(base | overrides))


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16-autocast"])
def test_training_lowers_loss_and_raises_head1_accuracy(stories_base, tmp_path, bf16):
    config = _config(tmp_path, epochs=6, bf16=bf16)
    cached = cache_hidden(stories_base, build_sequences(stories_base, config), config)
    assert cached["hidden"].shape[0] == cached["targets"].shape[0] > 500
    untrained, _ = train_heads(stories_base, dataclasses.replace(config, out=str(tmp_path / "untrained")), cached, stop_after=0)
    before = head_accuracy(untrained, cached["hidden"], cached["targets"])["top1"][0]
    before_loss = medusa_loss(untrained(cached["hidden"]), cached["targets"], 0.8)[0].item()
    heads, metrics = train_heads(stories_base, config, cached)
    after = head_accuracy(heads, cached["hidden"], cached["targets"])["top1"][0]
    after_loss = medusa_loss(heads(cached["hidden"]), cached["targets"], 0.8)[0].item()
    assert after_loss < before_loss * 0.8, (before_loss, after_loss)
    assert after > before + 0.05, (before, after)
    assert metrics["steps"] == metrics["total_steps"] > 0
    curve = metrics["loss_curve"]  # at most 64 points, the last at the last step, falling
    assert 0 < len(curve) <= 64 and curve[-1][0] == metrics["steps"] and curve[-1][1] < curve[0][1]


def test_loss_curve_spans_are_means_of_equal_steps():
    assert loss_curve([]) == []
    assert loss_curve([4.0, 2.0, 3.0], points=64) == [[1, 4.0], [2, 2.0], [3, 3.0]]
    assert loss_curve([4.0, 2.0, 3.0, 1.0, 5.0], points=2) == [[3, 3.0], [5, 3.0]]
    assert len(loss_curve([1.0] * 1000)) == 63 and loss_curve([1.0] * 1000)[-1] == [1000, 1.0]


def test_resume_gives_the_same_heads_as_an_uninterrupted_run(stories_base, tmp_path):
    straight = _config(tmp_path, "straight", epochs=2)
    cached = cache_hidden(stories_base, build_sequences(stories_base, straight), straight)
    expected, _ = train_heads(stories_base, straight, cached)

    interrupted = _config(tmp_path, "interrupted", epochs=2)
    first, _ = train_heads(stories_base, interrupted, cached, stop_after=5)  # not a checkpoint multiple
    assert (interrupted.workdir / "checkpoint.pt").is_file()
    resumed, metrics = train_heads(stories_base, interrupted, cached)
    assert metrics["steps"] == metrics["total_steps"]
    for (name, a), (_, b) in zip(expected.state_dict().items(), resumed.state_dict().items()):
        assert torch.equal(a, b), f"{name} differs after resume"
    assert not torch.equal(first.state_dict()["heads.0.0.linear.weight"], resumed.state_dict()["heads.0.0.linear.weight"])


def test_generation_resumes_without_redoing_finished_prompts(stories_base, tmp_path):
    config = _config(tmp_path, num_prompts=6, new_tokens=16, data=None)
    file = config.workdir / "sequences.jsonl"
    first = build_sequences(stories_base, dataclasses.replace(config, num_prompts=3))
    assert len(file.read_text().splitlines()) == 3
    again = build_sequences(stories_base, config)
    assert again[:3] == first and len(again) == 6


def test_shared_lm_head_trains_only_the_blocks(stories_base, tmp_path):
    config = _config(tmp_path, shared_lm_head=True, epochs=1)
    before = stories_base.model.lm_head.weight.clone()
    heads, _ = train_heads(stories_base, config, cache_hidden(stories_base, build_sequences(stories_base, config), config))
    assert torch.equal(stories_base.model.lm_head.weight, before)
    assert all("linear" in k for k in heads.state_dict())


def test_run_writes_heads_that_load_and_generate(stories_base, tmp_path):
    from medusa_trt.exporter import MedusaModel, load_heads
    from medusa_trt.runtime import MedusaRuntime

    config = _config(tmp_path, epochs=1, holdout=0.2)
    metrics = run(stories_base, config)
    out = tmp_path / "heads"
    assert {"heads.json", "heads.safetensors", "train_config.json", "metrics.json"} <= {p.name for p in out.iterdir()}
    assert len(metrics["holdout"]["top1"]) == 4
    cfg = stories_base.model.config
    heads = load_heads(out, hidden_size=cfg.hidden_size, vocab_size=cfg.vocab_size, lm_head=stories_base.model.lm_head)
    result = MedusaRuntime(MedusaModel(stories_base, heads), tree="chain-4").generate("Once upon a time", max_new_tokens=10)
    assert len(result.token_ids) == 10


def test_teacher_forced_corpus(stories_base, tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("Once upon a time there was a little cat who liked to sleep in the sun.\n" * 3)
    config = _config(tmp_path, data=str(corpus), teacher_forced=True)
    sequences = build_sequences(stories_base, config)
    assert len(sequences) == 3 and sequences[0][0] == stories_base.tokenizer(corpus.read_text().splitlines()[0])["input_ids"]


def test_data_rules(stories_base, tmp_path):
    with pytest.raises(TrainError, match="does not exist"):
        build_sequences(stories_base, _config(tmp_path, data=str(tmp_path / "none.jsonl")))
    evaluation = tmp_path / "spec_bench_dev.jsonl"
    evaluation.write_text('{"turns": ["hi"]}\n')
    with pytest.raises(TrainError, match="evaluation set"):
        build_sequences(stories_base, _config(tmp_path, data=str(evaluation)))
    with pytest.raises(TrainError, match="decay"):
        _config(tmp_path, decay=1.5)


def test_changed_config_refuses_a_stale_checkpoint(stories_base, tmp_path):
    config = _config(tmp_path, epochs=1)
    cached = cache_hidden(stories_base, build_sequences(stories_base, config), config)
    train_heads(stories_base, config, cached, stop_after=2)
    with pytest.raises(TrainError, match="another configuration"):
        train_heads(stories_base, dataclasses.replace(config, lr=5e-3), cached)


def test_cli_one_line_errors(capsys, tmp_path):
    from medusa_trt.cli.train import main

    assert main(["--model", "/nonexistent.gguf", "--out", str(tmp_path / "h")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("medusa-train: error: ") and err.count("\n") == 1


# ----------------------------------------------------------------------------- the work folder: what is resumed, what is refused


def _lengths(config) -> list[int]:
    import json

    records = [json.loads(line) for line in (config.workdir / "sequences.jsonl").read_text().splitlines()]
    return [len(r["ids"]) - r["start"] for r in records]


def test_changed_new_tokens_is_not_resumed_on_the_old_data(stories_base, tmp_path):
    config = _config(tmp_path, num_prompts=4, new_tokens=16, epochs=1)
    build_sequences(stories_base, config)
    before = (config.workdir / "sequences.jsonl").read_bytes()
    shorter = dataclasses.replace(config, new_tokens=8)
    with pytest.raises(TrainError, match=r"--new-tokens was 16, now 8.*--restart"):
        run(stories_base, shorter)
    with pytest.raises(TrainError, match=r"--new-tokens was 16, now 8"):  # the stage alone refuses too
        build_sequences(stories_base, shorter)
    assert (config.workdir / "sequences.jsonl").read_bytes() == before and not (tmp_path / "heads").exists()
    metrics = run(stories_base, shorter, restart=True)
    assert metrics["sequences"] == 4 and max(_lengths(shorter)) == 8


def test_changed_model_is_not_resumed_on_the_old_data(stories_base, tmp_path):
    import shutil

    from medusa_trt.exporter import load_base_model

    config = _config(tmp_path, num_prompts=2, new_tokens=8)
    build_sequences(stories_base, config)
    other = tmp_path / "other.gguf"
    shutil.copy(stories_base.name, other)
    with pytest.raises(TrainError, match=r"holds data from another configuration \(--model was .*stories260K.gguf, now .*other.gguf"):
        build_sequences(load_base_model(other), config)


def test_changed_prompts_file_is_not_resumed_but_a_moved_one_is(stories_base, tmp_path):
    config = _config(tmp_path, num_prompts=2, new_tokens=8)
    first = build_sequences(stories_base, config)
    moved = tmp_path / "moved.txt"
    moved.write_bytes(open(config.data, "rb").read())
    assert build_sequences(stories_base, dataclasses.replace(config, data=str(moved))) == first  # same content: resumed
    moved.write_text("The dog ran\nA big ship\n")
    with pytest.raises(TrainError, match=r"--data was a file with sha256 \w+, now a file with sha256 \w+"):
        build_sequences(stories_base, dataclasses.replace(config, data=str(moved)))


def test_changed_head_layer_recomputes_the_cache(stories_base, tmp_path):
    config = _config(tmp_path, num_prompts=2, new_tokens=8)
    sequences = build_sequences(stories_base, config)
    final = cache_hidden(stories_base, sequences, config)
    layer0 = cache_hidden(stories_base, sequences, dataclasses.replace(config, head_layer=0))
    assert not torch.equal(final["hidden"], layer0["hidden"])
    assert torch.equal(cache_hidden(stories_base, sequences, config)["hidden"], final["hidden"])


def test_changed_training_settings_refused_before_any_work_then_restarted_on_the_same_data(stories_base, tmp_path, monkeypatch):
    from medusa_trt.runtime import MedusaRuntime

    config = _config(tmp_path, num_prompts=4, new_tokens=8, epochs=1)
    cached = cache_hidden(stories_base, build_sequences(stories_base, config), config)
    train_heads(stories_base, config, cached, stop_after=2)
    monkeypatch.setattr(MedusaRuntime, "completed", lambda *a, **k: pytest.fail("the sequences were generated again"))
    with pytest.raises(TrainError, match=r"another configuration \(--lr was 0.01, now 0.005\).*--restart"):
        run(stories_base, dataclasses.replace(config, lr=5e-3))
    metrics = run(stories_base, dataclasses.replace(config, lr=5e-3), restart=True)  # checkpoint dropped, sequences kept
    assert metrics["steps"] == metrics["total_steps"] and metrics["sequences"] == 4


def test_interrupted_run_resumes_where_it_stopped(stories_base, tmp_path, monkeypatch):
    """A run stopped during training (Ctrl-C) continues from its checkpoint on the next run, with
    no generation, and ends with the heads of an uninterrupted run."""
    import medusa_trt.training.train as train_module
    from medusa_trt.runtime import MedusaRuntime

    straight = run(stories_base, _config(tmp_path, "straight", num_prompts=6, new_tokens=16, epochs=2, batch_size=16))
    config = _config(tmp_path, "interrupted", num_prompts=6, new_tokens=16, epochs=2, batch_size=16)
    original = train_module.train_heads

    def stopped(base, cfg, cached, **kw):
        original(base, cfg, cached, stop_after=3, **kw)
        raise KeyboardInterrupt

    monkeypatch.setattr(train_module, "train_heads", stopped)
    with pytest.raises(KeyboardInterrupt):
        run(stories_base, config)
    assert {"fingerprint.json", "sequences.jsonl", "hidden", "checkpoint.pt"} <= {
        p.name for p in config.workdir.iterdir()
    }  # states recorded while generating: no cache file
    monkeypatch.setattr(train_module, "train_heads", original)
    monkeypatch.setattr(MedusaRuntime, "completed", lambda *a, **k: pytest.fail("the sequences were generated again"))
    resumed = run(stories_base, config)
    assert resumed["steps"] == straight["steps"] and resumed["loss_last"] == straight["loss_last"]
    from safetensors.torch import load_file

    a, b = load_file(str(tmp_path / "straight" / "heads.safetensors")), load_file(str(tmp_path / "interrupted" / "heads.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_record_cut_off_by_a_kill_is_generated_again(stories_base, tmp_path):
    config = _config(tmp_path, num_prompts=4, new_tokens=8)
    expected = build_sequences(stories_base, config)
    file = config.workdir / "sequences.jsonl"
    lines = file.read_bytes().split(b"\n")
    file.write_bytes(b"\n".join(lines[:2]) + b"\n" + lines[2][:7])  # killed while writing the third record
    again = build_sequences(stories_base, config)
    assert [(s.ids, s.start) for s in again] == [(s.ids, s.start) for s in expected]
    assert again[2].shard != expected[2].shard  # regenerated into a shard of its own
    assert len(file.read_text().splitlines()) == 4
    file.write_bytes(b"\n".join(lines[:1] + [b"\xff{oops"] + lines[2:]))
    with pytest.raises(TrainError, match=r"sequences.jsonl line 2 is not a sequence record.*--restart"):
        build_sequences(stories_base, config)


def test_fewer_prompts_resume_on_fewer_sequences(stories_base, tmp_path):
    config = _config(tmp_path, num_prompts=4, new_tokens=8)
    four = build_sequences(stories_base, config)
    assert build_sequences(stories_base, dataclasses.replace(config, num_prompts=2)) == four[:2]


def test_stopped_before_any_progress_leaves_no_work_folder(stories_base, tmp_path, monkeypatch):
    from medusa_trt.runtime import MedusaRuntime

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(MedusaRuntime, "completed", interrupted)
    config = _config(tmp_path, num_prompts=2, new_tokens=8)
    with pytest.raises(KeyboardInterrupt):
        run(stories_base, config)
    assert not config.workdir.exists() and not (tmp_path / "heads").exists()


def test_cli_refuses_a_stale_work_folder_then_restarts(capsys, tmp_path):
    from conftest import STORIES

    from medusa_trt.cli.train import main

    prompts = tmp_path / "stories.txt"
    prompts.write_text("\n".join(STORY_STARTS[:4]))
    argv = [
        "--model",
        str(STORIES),
        "--out",
        str(tmp_path / "h"),
        "--data",
        str(prompts),
        "--num-prompts",
        "4",
        "--epochs",
        "1",
        "--batch-size",
        "64",
    ]
    assert main(argv + ["--new-tokens", "12"]) == 0
    capsys.readouterr()
    assert main(argv + ["--new-tokens", "6"]) == 2
    err = "\n".join(line for line in capsys.readouterr().err.split("\n") if "\r" not in line)  # less progress bars
    assert err.startswith("medusa-train: error: ") and err.count("\n") == 1, err
    assert "--new-tokens was 12, now 6" in err and "--restart" in err
    assert main(argv + ["--new-tokens", "6", "--restart"]) == 0
    assert "wrote" in capsys.readouterr().out


def test_builtin_pool_is_wide_and_kept_apart_from_evaluation_and_calibration():
    import json

    from conftest import SHARED

    from medusa_trt.training.prompts import training_prompts

    pool = training_prompts(6954)
    assert len(set(pool)) == 6954
    assert training_prompts(500, seed=3) == training_prompts(1000, seed=3)[:500]  # more prompts continue the same list
    with pytest.raises(ValueError, match="6954 distinct prompts"):
        training_prompts(7000)
    calibration = {json.loads(line)["turns"][0] for line in open(Path(__file__).parents[1] / "assets" / "calibration_prompts.jsonl")}
    assert not calibration & set(pool)
    bench = SHARED / "data" / "spec_bench_dev.jsonl"
    if bench.is_file():
        assert not {t for line in open(bench) for t in json.loads(line)["turns"]} & set(pool)


def test_prompt_file_is_the_pool_it_always_was():
    """training/prompts.jsonl: 6954 distinct prompts, sorted, one JSON string a line, with the digest
    the pool had when code wrote it (a work folder made before the move still resumes)."""
    from medusa_trt.training.prompts import POOL_FILE, builtin_pool, pool_digest

    pool = builtin_pool()
    assert len(pool) == len(set(pool)) == 6954 and pool == sorted(pool) and all(isinstance(p, str) and p for p in pool)
    assert len(POOL_FILE.read_text(encoding="utf-8").splitlines()) == 6954
    assert pool_digest() == "ead9c9cac44608a7"


def test_recorded_hidden_states_replace_the_forward_pass(stories_base, tmp_path, monkeypatch):
    """Generation records each sequence's hidden states; the cache is built from them, equal to a
    forward pass over the sequences, and with the shards gone the forward pass runs again."""
    import medusa_trt.training.data as data_module

    config = _config(tmp_path, num_prompts=5, new_tokens=20)
    sequences = build_sequences(stories_base, config)
    assert all(s.shard is not None for s in sequences)
    calls = []
    original = data_module._forward_hidden
    monkeypatch.setattr(data_module, "_forward_hidden", lambda *a: calls.append(1) or original(*a))
    recorded = cache_hidden(stories_base, sequences, config)
    assert len(calls) == 1  # one probe of the recorded states, no pass over the data
    shutil.rmtree(config.workdir / "hidden")
    computed = cache_hidden(stories_base, sequences, config)
    assert len(calls) == 1 + len(sequences)
    for key in ("targets", "next", "sequence"):
        assert torch.equal(recorded[key], computed[key])
    assert (recorded["hidden"] - computed["hidden"]).abs().max() < 1e-2  # float16 storage
    assert torch.equal(computed["next"][:3], torch.tensor(sequences[0].ids[sequences[0].start : sequences[0].start + 3]))


def test_follow_ups_continue_the_models_own_answers(smollm2_base, tmp_path):
    from medusa_trt.training.prompts import training_prompts

    config = TrainConfig(out=str(tmp_path / "heads"), num_prompts=3, follow_ups=3, new_tokens=12, generate_batch=4, seed=2)
    sequences = build_sequences(smollm2_base, config)
    assert len(sequences) == 6
    first, prompts = sequences[:3], training_prompts(3, seed=2)
    tok = smollm2_base.tokenizer
    for j, s in enumerate(sequences[3:]):
        conversation = tok.decode(s.ids[: s.start])
        answer = tok.decode(first[j].ids[first[j].start :], skip_special_tokens=True).strip()
        assert answer[:30] in conversation, (answer, conversation)
        if j % 3 != 2:  # a second turn: the first prompt is there too
            assert prompts[j] in conversation
    with pytest.raises(TrainError, match="exceeds --num-prompts"):
        TrainConfig(out=str(tmp_path / "x"), num_prompts=2, follow_ups=3)


def test_follow_ups_need_a_chat_model(stories_base, tmp_path):
    from medusa_trt.training.checks import check_model

    with pytest.raises(TrainError, match="needs a chat model"):
        check_model(stories_base, _config(tmp_path, follow_ups=2))


def test_next_token_aware_heads_beat_medusa_heads_on_the_same_data(stories_base, tmp_path):
    """Ablation in small: same sequences, epochs and seed; the heads that see the next token guess
    head 1 better on held-out sequences."""
    config = _config(tmp_path, num_prompts=16, new_tokens=64, epochs=8, holdout=0.25)
    cached = cache_hidden(stories_base, build_sequences(stories_base, config), config)
    _, medusa = train_heads(stories_base, config, cached)
    aware = dataclasses.replace(config, out=str(tmp_path / "aware"), head_input="hidden+next", work=str(tmp_path / "aware.work"))
    _, next_aware = train_heads(stories_base, aware, cached)
    assert next_aware["holdout"]["top1"][0] > medusa["holdout"]["top1"][0] + 0.03, (medusa["holdout"], next_aware["holdout"])


def test_sequential_heads_beat_next_token_aware_heads_past_head_1_on_the_same_data(stories_base, tmp_path):
    """Same sequences, epochs and seed; heads that also read the drafted path (teacher-forced: the
    base model's own tokens) guess heads 2 and 3 better on held-out sequences, and the heads file
    says format version 3."""
    config = _config(tmp_path, num_prompts=16, new_tokens=64, epochs=8, holdout=0.25, head_input="hidden+next")
    cached = cache_hidden(stories_base, build_sequences(stories_base, config), config)
    _, aware = train_heads(stories_base, config, cached)
    seq_config = dataclasses.replace(config, out=str(tmp_path / "seq"), head_input="hidden+path", work=str(tmp_path / "seq.work"))
    heads, seq = train_heads(stories_base, seq_config, cached)
    assert heads.config.to_json().count('"format_version": 3') == 1
    for k in (1, 2):
        assert seq["holdout"]["top1"][k] > aware["holdout"]["top1"][k], (aware["holdout"], seq["holdout"])
