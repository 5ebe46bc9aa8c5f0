"""Robustness, runtime side: stop strings never leak into streams, token ids are checked at the door,
one bad request never hurts another, and every bad input to medusa-run is one line."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading

import numpy as np
import pytest
from conftest import CUSTOM_TREE, STORY_PROMPTS, medusa_model, random_heads

from medusa_trt.runtime import EngineError, MedusaRuntime, PromptError, RuntimeConfig
from medusa_trt.runtime.batching import ContinuousBatcher, Request
from medusa_trt.runtime.errors import MedusaError
from medusa_trt.runtime.output import safe_end
from medusa_trt.runtime.sampling import SamplingError


@pytest.fixture(scope="module")
def engine(export_engine, stories_base, stories_fitted):
    return export_engine("stories-fitted", medusa_model(stories_base, stories_fitted))


@pytest.fixture(scope="module", params=["onnxruntime", "torch"])
def runtime(request, engine, stories_base, stories_fitted):
    if request.param == "torch":
        return MedusaRuntime(medusa_model(stories_base, stories_fitted), tree=CUSTOM_TREE, max_batch=4, max_context=256)
    return MedusaRuntime(engine, tree=CUSTOM_TREE, max_batch=4)


# ---------------------------------------------------------------- stop strings


def test_safe_end_holds_back_what_could_become_a_stop():
    assert safe_end("1. 1\n2. 2\n3. 3", ("3. 3\n4",)) == len("1. 1\n2. 2\n")
    assert safe_end("the end", ("xyz",)) == len("the end")
    assert safe_end("abc", ("cd", "bcx")) == 1  # the longest candidate wins
    assert safe_end("ab\ufffd", ()) == 2  # an incomplete character is held too
    assert safe_end("", ("a",)) == 0


def _spanning_stops(runtime, prompt: str, n: int) -> tuple[str, list[str]]:
    """The full text and stop strings taken from it that span several tokens."""
    full = runtime.generate(prompt, max_new_tokens=n, chat_template=False).text
    words = full.split(" ")
    assert len(words) > 8, full
    return full, [" ".join(words[3:6]), words[6][-2:] + " " + words[7][:3], " ".join(words[5:9]) + "never"]


@pytest.mark.parametrize("prompt", STORY_PROMPTS[:3])
def test_streamed_text_never_contains_part_of_a_stop_string(runtime, prompt):
    full, stops = _spanning_stops(runtime, prompt, 48)
    for stop in stops:
        result = runtime.generate(prompt, max_new_tokens=48, stop=stop, chat_template=False)
        expected = full[: full.index(stop)] if stop in full else full
        assert result.text == expected
        streamed = ""
        for event in runtime.stream(prompt, max_new_tokens=48, stop=stop, chat_template=False):
            streamed += event.text
            assert expected.startswith(streamed), f"stream sent {streamed!r}, beyond the final text {expected!r} (stop {stop!r})"
        assert streamed == result.text


def test_batcher_stream_holds_back_stop_strings(runtime):
    prompt = STORY_PROMPTS[1]
    full, stops = _spanning_stops(runtime, prompt, 48)
    batcher = ContinuousBatcher(runtime).start()
    try:
        handles = [batcher.submit(Request(prompt, max_new_tokens=48, stop=stop, chat_template=False)) for stop in stops]
        for stop, handle in zip(stops, handles):
            expected = full[: full.index(stop)] if stop in full else full
            assert "".join(e.text for e in handle) == expected
    finally:
        batcher.close()


# ---------------------------------------------------------------- token ids and types at the door


@pytest.mark.parametrize(
    "prompt,message",
    [
        ([1, 2, 10**6], "token id 1000000"),
        ([1, -3, 4], "token id -3"),
        ([1, 2.0, 4], "token id 2.0"),
        ([1, True, 4], "token id True"),
        ([[1, 2], [3, None]], "token id None"),
        (b"abc", "not bytes"),
        ([b"abc"], "is a bytes"),
        (42, "no prompts given"),
        ("", "empty prompt"),
        ("bad \udcff text", "not valid UTF-8"),
    ],
)
def test_bad_prompts_are_refused_before_the_engine(runtime, prompt, message):
    with pytest.raises(PromptError, match=message):
        runtime.generate(prompt, max_new_tokens=2)


def test_numpy_token_ids_are_accepted(runtime, stories_prompts):
    ids = stories_prompts[0]
    assert runtime.generate(np.array(ids), max_new_tokens=4).token_ids == runtime.generate(ids, max_new_tokens=4).token_ids


@pytest.mark.parametrize(
    "kwargs,error,message",
    [
        (dict(top_k=2.0), SamplingError, "top_k must be an integer"),
        (dict(seed=1.0, temperature=0.7), SamplingError, "seed must be an integer"),
        (dict(temperature="hot"), SamplingError, "temperature must be a number"),
        (dict(max_new_tokens=2.5), PromptError, "max_new_tokens must be an integer"),
        (dict(chat_template="no"), PromptError, "chat_template must be True, False or None"),
        (dict(stop="\udcff"), PromptError, "not valid UTF-8"),
    ],
)
def test_options_of_the_wrong_type_are_refused(runtime, kwargs, error, message):
    kwargs = {"max_new_tokens": 3} | kwargs
    with pytest.raises(error, match=message):
        runtime.generate("Once upon a time", **kwargs)


@pytest.mark.parametrize(
    "field,value", [("threads", -3), ("threads", 0), ("max_batch", 2.5), ("prefill_chunk", 0), ("verify_checksums", "yes")]
)
def test_runtime_config_types(field, value):
    with pytest.raises(MedusaError, match=field):
        RuntimeConfig(**{field: value})


# ---------------------------------------------------------------- the batcher: one bad request hurts no one


def test_bad_request_among_good_ones_gets_its_own_error(runtime):
    prompts, lengths = STORY_PROMPTS[:3], [20, 12, 25]
    solo = [runtime.generate(p, max_new_tokens=n, chat_template=False).token_ids for p, n in zip(prompts, lengths)]
    batcher = ContinuousBatcher(runtime).start()
    try:
        good = [batcher.submit(Request(p, max_new_tokens=n, chat_template=False)) for p, n in zip(prompts[:2], lengths[:2])]
        for bad in ([5, 10**6], [5, -1], b"bytes"):
            with pytest.raises(PromptError):
                batcher.submit(Request(bad, max_new_tokens=5))
        good.append(batcher.submit(Request(prompts[2], max_new_tokens=lengths[2], chat_template=False)))
        assert [h.result().token_ids for h in good] == solo
    finally:
        batcher.close()


def test_a_failed_step_ends_only_its_requests_and_the_batcher_keeps_serving(runtime, monkeypatch):
    prompt = STORY_PROMPTS[0]
    expected = runtime.generate(prompt, max_new_tokens=10, chat_template=False).token_ids
    real_step, calls = runtime.backend.step, {"n": 0}

    def failing_step(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected engine failure")
        return real_step(*args, **kwargs)

    monkeypatch.setattr(runtime.backend, "step", failing_step)
    batcher = ContinuousBatcher(runtime).start()
    try:
        first = batcher.submit(Request(prompt, max_new_tokens=30, chat_template=False))
        with pytest.raises(EngineError, match="injected engine failure"):
            first.result()
        again = batcher.submit(Request(prompt, max_new_tokens=10, chat_template=False))  # the batcher still serves
        assert again.result().token_ids == expected
    finally:
        batcher.close()


def test_concurrent_submit_of_bad_and_good(runtime):
    batcher = ContinuousBatcher(runtime).start()
    errors, results = [], {}

    def client(i):
        try:
            prompt = [3, 10**7] if i % 2 else STORY_PROMPTS[i % 4]
            results[i] = batcher.submit(Request(prompt, max_new_tokens=8, chat_template=False)).result()
        except PromptError as exc:
            errors.append(exc)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    batcher.close()
    assert len(errors) == 3 and sorted(results) == [0, 2, 4]
    assert all(len(r.token_ids) == 8 for r in results.values())


# ---------------------------------------------------------------- defaults that fit any valid input


def test_default_context_fits_the_model(stories_base):
    runtime = MedusaRuntime(medusa_model(stories_base, random_heads(stories_base, 2)), tree="chain-2")
    positions = stories_base.model.config.max_position_embeddings
    assert runtime.max_context == min(1024, positions)
    with pytest.raises(EngineError, match="exceeds the model's"):
        MedusaRuntime(medusa_model(stories_base, random_heads(stories_base, 2)), tree="chain-2", max_context=positions + 1)


def test_small_step_engine_runs_with_the_default_prefill_chunk(export_engine, stories_base, stories_fitted, stories_prompts):
    path = export_engine("stories-max-tokens-8", medusa_model(stories_base, stories_fitted), tree="chain-3", max_tokens=8)
    runtime = MedusaRuntime(path)
    assert runtime.config.prefill_chunk == 8
    torch_rt = MedusaRuntime(medusa_model(stories_base, stories_fitted), tree="chain-3", max_context=256)
    long_prompt = stories_prompts[2]  # longer than 8 tokens: several prefill chunks
    assert len(long_prompt) > 8
    assert runtime.generate(long_prompt, max_new_tokens=12).token_ids == torch_rt.generate(long_prompt, max_new_tokens=12).token_ids


# ---------------------------------------------------------------- engine files


def _copy_engine(engine, folder, *, manifest: bool = False):
    """A copy of the engine's files; without its manifest (as an engine exported before manifests,
    or assembled by hand) unless asked, so the checks behind the manifest's are reached."""
    folder.mkdir()
    for p in engine.parent.iterdir():
        if p.name.endswith(".files.json") and not manifest:
            continue
        (shutil.copytree if p.is_dir() else shutil.copy2)(p, folder / p.name)
    return folder / engine.name


def test_the_manifest_names_a_replaced_file_first(engine, tmp_path):
    path = _copy_engine(engine, tmp_path / "engine", manifest=True)
    (path.with_suffix(".tokenizer") / "tokenizer.json").write_text("{}")
    with pytest.raises(EngineError, match=r"tokenizer\.json has 2 bytes but the export wrote"):
        MedusaRuntime(path)


@pytest.mark.parametrize(
    "damage,message",
    [
        (lambda t: (t / "tokenizer.json").write_text("{not json"), "tokenizer.json cannot be read"),
        (lambda t: (t / "tokenizer_config.json").write_bytes(b"\xff\xfe{"), "are corrupt"),
        (
            lambda t: (t / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{% for m in messages %}{{ m"})),
            "not valid Jinja",
        ),
    ],
)
def test_corrupt_tokenizer_beside_an_engine_is_named_at_load(engine, tmp_path, damage, message):
    path = _copy_engine(engine, tmp_path / "engine")
    damage(path.with_suffix(".tokenizer"))
    with pytest.raises(MedusaError, match=message):
        MedusaRuntime(path)


def test_heads_graph_of_another_engine_is_refused_at_load(engine, export_engine, stories_base, tmp_path):
    other = export_engine("stories-random-2", medusa_model(stories_base, random_heads(stories_base, 2)), tree="chain-2")
    path = _copy_engine(engine, tmp_path / "engine")
    shutil.copy2(other.with_name("model.heads.onnx"), path.with_name("model.heads.onnx"))
    with pytest.raises(EngineError, match="belongs to another engine"):
        MedusaRuntime(path)


# ---------------------------------------------------------------- medusa-run: one line for every bad input


def _cli(*args, stdin=None, env=None):
    return subprocess.run([sys.executable, "-m", "medusa_trt.cli.run", *args], capture_output=True, timeout=600, env=env, stdin=stdin)


def _assert_one_line(proc, fragment: str):
    err = proc.stderr.decode("utf-8", "replace")
    lines = [line for line in err.splitlines() if line.strip()]
    assert proc.returncode != 0 and "Traceback" not in err, err
    assert len(lines) == 1 and lines[0].startswith("medusa-run: ") and fragment in lines[0], err


@pytest.mark.parametrize(
    "args,fragment",
    [
        (["--prompt", os.fsdecode(b"caf\xe9 au lait")], "not valid UTF-8"),
        (["--prompt", "a", "--prompt", "b", "--stream"], "--stream prints one prompt"),
        (["--prompt", "a", "--json", "--stream"], "--json prints each whole result"),
        (["--prompt", "a", "--json", "--compare-plain"], "--json prints each whole result"),
        (["--prompt", "a", "--device", "cuda"], "--device goes with --model"),
        (["--prompt", "a", "--max-new-tokens", "0"], "must be >= 1"),
        (["--prompt", "a", "--max-new-tokens", "2.5"], "expected a whole number"),
        (["--prompt", "a", "--top-k", "2.5"], "expected a whole number"),
        (["--prompt", "a", "--seed", "-1"], "must be >= 0"),
        (["--prompt", "a", "--max-batch", "99"], "export again with larger --max-batch"),
        (["--prompt", "a", "--stop", ""], "stop strings must be non-empty"),
    ],
)
def test_run_bad_input_is_one_line(engine, args, fragment):
    _assert_one_line(_cli("--engine", str(engine), *args), fragment)


def test_run_corrupt_data_file_is_one_line(engine, tmp_path):
    path = _copy_engine(engine, tmp_path / "engine")
    tok = path.with_suffix(".tokenizer") / "tokenizer.json"
    tok.write_text(tok.read_text()[:100])
    _assert_one_line(_cli("--engine", str(path), "--prompt", "a"), "tokenizer.json cannot be read")


def test_run_json_into_a_closed_pipe_is_quiet(engine):
    """medusa-run --json | head -1: the reader leaves early; no BrokenPipe traceback."""
    cmd = (
        f"{sys.executable} -m medusa_trt.cli.run --engine {engine} --prompt 'One day' --prompt 'The cat' --prompt 'A dog' "
        "--max-new-tokens 4 --json | head -c 1"
    )
    proc = subprocess.run(["bash", "-c", cmd], capture_output=True, timeout=300)
    assert len(proc.stdout) == 1 and b"Traceback" not in proc.stderr and b"BrokenPipe" not in proc.stderr, proc.stderr


def test_run_stream_and_plain_agree_on_a_spanning_stop(engine, runtime):
    prompt = STORY_PROMPTS[0]
    full, stops = _spanning_stops(runtime, prompt, 40)
    common = [
        "--engine",
        str(engine),
        "--prompt",
        prompt,
        "--max-new-tokens",
        "40",
        "--stop",
        stops[0],
        "--no-chat-template",
        "--tree",
        "chain-2",
    ]
    streamed = _cli(*common, "--stream")
    plain = _cli(*common, "--json")
    assert streamed.returncode == 0 and plain.returncode == 0, (streamed.stderr, plain.stderr)
    text = json.loads(plain.stdout.decode().splitlines()[0])["text"]
    assert text == full[: full.index(stops[0])]
    assert streamed.stdout.decode().split("\nmedusa on ")[0] == text
