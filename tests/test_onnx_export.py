"""medusa-export: round trip in a fresh process, files and metadata, int8, bad input."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import CUSTOM_TREE, STORIES, medusa_model

from medusa_trt.cli.export import main as export_main
from medusa_trt.exporter import HeadsConfig, init_heads, save_heads
from medusa_trt.runtime import EngineError, MedusaRuntime
from medusa_trt.runtime.engine import EngineFiles, read_meta


@pytest.fixture(scope="module")
def stories_engine(export_engine, stories_base, stories_fitted):
    return export_engine("stories-fitted", medusa_model(stories_base, stories_fitted))


def _cli(capsys, *args) -> tuple[int, str, str]:
    code = export_main(list(args))
    captured = capsys.readouterr()
    lines = [line.split("\r")[-1] for line in captured.err.split("\n")]
    errors = [line for line in lines if line.strip() and "medusa-export:" in line]
    return code, captured.out, "\n".join(errors)


def test_files_and_metadata(stories_engine, stories_base):
    files = EngineFiles.beside(stories_engine)
    assert files.step.is_file() and files.heads.is_file() and (files.tokenizer / "tokenizer.json").is_file()
    meta = read_meta(stories_engine)
    assert (meta.num_heads, meta.top_k, meta.max_batch, meta.max_context, meta.dtype) == (4, 10, 4, 256, "fp32")
    assert meta.eos_token_ids == list(stories_base.eos_token_ids) and meta.architecture == "llama"
    assert [list(p) for p in meta.tree][:3] == [[0], [1], [2]] or meta.tree_name == "custom"
    assert not list(files.step.parent.glob(".*")), "temporary files left behind"


def test_round_trip_in_a_fresh_process(stories_engine, stories_base, stories_fitted, stories_prompts):
    """A new interpreter that imports only the runtime reproduces the torch backend's tokens."""
    code = (
        "import json, sys; from medusa_trt.runtime import MedusaRuntime; "
        f"r = MedusaRuntime({str(stories_engine)!r}).generate({stories_prompts!r}, max_new_tokens=32); "
        "print(json.dumps([x.token_ids for x in r])); "
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers'))))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    tokens, heavy = (json.loads(line) for line in proc.stdout.strip().splitlines()[-2:])
    expected = MedusaRuntime(medusa_model(stories_base, stories_fitted), tree="mc_sim_7b_63").generate(stories_prompts, max_new_tokens=32)
    assert tokens == [r.token_ids for r in expected]
    assert heavy == [], f"the ONNX path imported {heavy}"


def test_text_prompts_use_saved_tokenizer(stories_engine, stories_base, stories_fitted):
    onnx_result = MedusaRuntime(stories_engine).generate("Once upon a time", max_new_tokens=20)
    torch_result = MedusaRuntime(medusa_model(stories_base, stories_fitted), tree="mc_sim_7b_63").generate(
        "Once upon a time", max_new_tokens=20
    )
    assert onnx_result.token_ids == torch_result.token_ids and onnx_result.text == torch_result.text


def test_runtime_limits_come_from_the_engine(stories_engine):
    runtime = MedusaRuntime(stories_engine)
    meta = runtime.backend.meta
    assert (runtime.max_batch, runtime.max_context, runtime.tree.name) == (4, 256, meta.tree_name)
    assert [list(p) for p in runtime.tree.paths] == meta.tree
    with pytest.raises(EngineError, match="exported for 4 / 256"):
        MedusaRuntime(stories_engine, max_context=512)


def test_int8_engine_runs_and_reports_agreement(tmp_path, capsys, stories_base):
    out = tmp_path / "int8.onnx"
    code, stdout, err = _cli(
        capsys,
        "--model",
        str(STORIES),
        "--untrained-heads",
        "2",
        "--tree",
        "chain-2",
        "--out",
        str(out),
        "--quantize",
        "int8",
        "--max-context",
        "128",
    )
    assert code == 0, err
    assert "int8 changes the model's numbers: max logit difference" in stdout and "verified" not in stdout  # its error, measured
    meta = read_meta(out)
    assert meta.quantization == "int8"
    import onnx

    ops = [n.op_type for n in onnx.load(str(out), load_external_data=False).graph.node]
    # lean (exporter/lean.py): the rotary tables shared; the weights stay apart (one int8 scale per weight tensor)
    assert ops.count("Cos") == ops.count("Sin") == 1 and "Split" not in ops
    result = MedusaRuntime(out).generate("Once upon a time", max_new_tokens=16)
    assert len(result.token_ids) == 16


def test_heads_int8_engine_keeps_fp32_tokens(export_engine, stories_engine, stories_base, stories_fitted):
    """Only the heads graph is quantized: drafts may change, the accepted tokens may not."""
    import onnx

    engine = export_engine("stories-heads-int8", medusa_model(stories_base, stories_fitted), quantize="heads-int8")
    assert read_meta(engine).quantization == "heads-int8"
    files = EngineFiles.beside(engine)
    heads_ops = {n.op_type for n in onnx.load(str(files.heads)).graph.node}
    step_ops = {n.op_type for n in onnx.load(str(files.step), load_external_data=False).graph.node}
    assert "MatMulInteger" in heads_ops and "MatMulInteger" not in step_ops
    prompts = ["Once upon a time", "Tim had a red ball", "The sun was hot and"]
    quantized = MedusaRuntime(engine).generate(prompts, max_new_tokens=24)
    reference = MedusaRuntime(stories_engine).generate(prompts, max_new_tokens=24)
    assert [r.token_ids for r in quantized] == [r.token_ids for r in reference]
    # the heads still draft: some steps accept more than one token
    assert max(r.stats.mean_accepted for r in quantized) > 1.0


def test_cli_export_and_run(tmp_path, capsys):
    out = tmp_path / "e.onnx"
    code, stdout, err = _cli(
        capsys, "--model", str(STORIES), "--untrained-heads", "3", "--tree", "chain-3", "--out", str(out), "--max-context", "128"
    )
    assert code == 0, err
    first, second = stdout.splitlines()[:2]
    assert first.startswith("exported llama: 5 layers") and second.startswith(f"wrote {out}"), stdout  # what, then where
    assert "verified against torch: max abs difference" in stdout
    from medusa_trt.cli.run import main as run_main

    assert run_main(["--engine", str(out), "--prompt", "Once upon a time", "--max-new-tokens", "12"]) == 0
    summary = capsys.readouterr().out.splitlines()[-1]
    assert summary.startswith("medusa on onnxruntime (") and "heads template chain-3: 12 tokens" in summary, summary


# ----------------------------------------------------------------------------- bad input


def test_missing_truncated_and_foreign_engines(tmp_path, stories_engine):
    with pytest.raises(EngineError, match="does not exist"):
        MedusaRuntime(tmp_path / "none.onnx")
    truncated = tmp_path / "truncated.onnx"
    truncated.write_bytes(stories_engine.read_bytes()[:5000])
    with pytest.raises(EngineError, match="truncated, or not an ONNX file"):
        MedusaRuntime(truncated)
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])],
    )
    foreign = tmp_path / "foreign.onnx"
    onnx.save(helper.make_model(graph), str(foreign))
    with pytest.raises(EngineError, match="not a medusa-trt engine"):
        MedusaRuntime(foreign)
    missing_heads = tmp_path / "copy.onnx"
    shutil.copy(stories_engine, missing_heads)
    with pytest.raises(EngineError, match="heads.onnx is missing"):
        MedusaRuntime(missing_heads)


def test_run_cli_bad_engine_is_one_line(tmp_path, capsys):
    from medusa_trt.cli.run import main as run_main

    (tmp_path / "bad.onnx").write_bytes(b"not onnx")
    assert run_main(["--engine", str(tmp_path / "bad.onnx"), "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("medusa-run: error: cannot load engine") and err.count("\n") == 1


@pytest.fixture
def wrong_heads(tmp_path, stories_base):
    cfg = stories_base.model.config
    heads = init_heads(HeadsConfig(2, 1, cfg.hidden_size, cfg.vocab_size * 2, shared_lm_head=False), None, random=True)
    return save_heads(heads, tmp_path / "wrong")


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--out", "/nonexistent-folder/m.onnx"], "does not exist; create it first"),
        (["--out", "/sys/m.onnx"], "not writable"),
        (["--out", "OUT/m.txt"], "must end in .onnx"),
        (["--untrained-heads", "2", "--tree", "chain-3", "--out", "OUT/m.onnx"], "needs 3 heads"),
        (["--untrained-heads", "2", "--tree", "mc_sim_7b_63", "--out", "OUT/m.onnx", "--max-tokens", "16"], "but only 2 are available"),
        (["--untrained-heads", "2", "--tree", "chain-2", "--out", "OUT/m.onnx", "--max-tokens", "2"], "--max-tokens is 2"),
        (["--heads", "WRONG", "--out", "OUT/m.onnx"], "vocabulary of 1024"),
    ],
)
def test_export_bad_input(tmp_path, capsys, wrong_heads, extra, message):
    if "/sys/m.onnx" in extra and _writable(Path("/sys")):
        pytest.skip("/sys is writable here: no read-only folder to test with")
    args = [a.replace("OUT", str(tmp_path)).replace("WRONG", str(wrong_heads)) for a in extra]
    before = set(tmp_path.rglob("*"))
    code, _, err = _cli(capsys, "--model", str(STORIES), *args)
    assert code == 2 and err.startswith("medusa-export: error: ") and message in err and "\n" not in err, err
    assert set(tmp_path.rglob("*")) == before, "partial files left behind"


def _writable(folder: Path) -> bool:
    try:
        (folder / ".probe").touch()
        (folder / ".probe").unlink()
        return True
    except OSError:
        return False


def test_failed_verification_leaves_nothing(tmp_path, capsys, monkeypatch):
    import medusa_trt.exporter.verify as verify

    def broken(*args, **kwargs):
        raise verify.VerificationError("exported graph disagrees with torch: max abs difference 1 > tolerance 0.001")

    monkeypatch.setattr(verify, "verify_engine", broken)
    code, _, err = _cli(capsys, "--model", str(STORIES), "--out", str(tmp_path / "m.onnx"))
    assert code == 2 and "disagrees with torch" in err
    assert list(tmp_path.iterdir()) == []


def test_fp16_engine(tmp_path, capsys, stories_base):
    out = tmp_path / "f16.onnx"
    code, stdout, err = _cli(
        capsys,
        "--model",
        str(STORIES),
        "--untrained-heads",
        "2",
        "--tree",
        "chain-2",
        "--out",
        str(out),
        "--dtype",
        "fp16",
        "--max-context",
        "128",
    )
    assert code == 0, err
    assert "tolerance 0.05" in stdout and read_meta(out).dtype == "fp16"
    runtime = MedusaRuntime(out)
    assert runtime.backend._key.dtype.name == "float16"
    assert len(runtime.generate("Once upon a time", max_new_tokens=12).token_ids) == 12


def test_external_data_travels_with_both_graphs(tmp_path, monkeypatch, stories_base, stories_fitted, stories_prompts):
    """Large weights go to .data files beside each graph; all of them end up beside the engine,
    and a re-export under the same name leaves no stale files."""
    import medusa_trt.exporter.onnx_export as onnx_export

    monkeypatch.setattr(onnx_export, "EXTERNAL_DATA_BYTES", 0)
    out = tmp_path / "big.onnx"
    model = medusa_model(stories_base, stories_fitted)
    onnx_export.export_onnx(model, onnx_export.ExportConfig(out=out, tree="chain-4", max_context=128))
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["big.heads.onnx", "big.heads.onnx.data", "big.onnx", "big.onnx.data", "big.onnx.files.json", "big.tokenizer"], names
    expected = MedusaRuntime(model, tree="chain-4").generate(stories_prompts[:2], max_new_tokens=12)
    got = MedusaRuntime(out).generate(stories_prompts[:2], max_new_tokens=12)
    assert [r.token_ids for r in got] == [r.token_ids for r in expected]
    monkeypatch.setattr(onnx_export, "EXTERNAL_DATA_BYTES", 2**40)
    onnx_export.export_onnx(model, onnx_export.ExportConfig(out=out, tree="chain-4", max_context=128, verify=False))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big.heads.onnx", "big.onnx", "big.onnx.files.json", "big.tokenizer"]


# ----------------------------------------------------------------------------- int8 heads: rows independent


@pytest.fixture(scope="module")
def heads_int8_random(export_engine, stories_base):
    """stories260K with random heads, heads graph in int8."""
    from conftest import random_heads

    return export_engine("stories-random-heads-int8", medusa_model(stories_base, random_heads(stories_base)), quantize="heads-int8")


def test_int8_head_logits_of_a_row_do_not_depend_on_its_batch(heads_int8_random):
    """One row's int8 head logits are bitwise the same solo and beside other rows (a dynamic
    activation scale over the whole batch would tie them to their neighbours)."""
    import numpy as np
    import onnxruntime as ort

    session = ort.InferenceSession(str(EngineFiles.beside(heads_int8_random).heads), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    hidden = rng.standard_normal((4, session.get_inputs()[0].shape[1])).astype(np.float32)
    hidden *= np.array([1.0, 40.0, 0.05, 5.0], dtype=np.float32)[:, None]  # neighbours of very different scale
    for batch in (2, 3, 4):
        _, together = session.run(None, {"hidden": hidden[:batch]})
        for row in range(batch):
            _, solo = session.run(None, {"hidden": hidden[row : row + 1]})
            assert np.array_equal(solo[0], together[row]), (
                f"row {row} of {batch}: max difference {np.abs(solo[0] - together[row]).max():.3g}"
            )


def test_int8_heads_sample_the_same_tokens_solo_and_batched(heads_int8_random):
    prompts = ["Once upon a time", "Tim had a red ball and a big dog that liked to run", "The sun"]
    runtime = MedusaRuntime(heads_int8_random)
    together = runtime.generate(prompts, max_new_tokens=24, temperature=0.7, seed=1)
    for prompt, row in zip(prompts, together):
        solo = runtime.generate(prompt, max_new_tokens=24, temperature=0.7, seed=1)
        assert solo.token_ids == row.token_ids, prompt


def test_next_token_aware_heads_export_with_root_ids_and_int8(export_engine, stories_base, stories_next_aware):
    """The heads graph of next-token-aware heads takes root_ids; ONNX Runtime's heads match torch's
    (export verification), and heads-int8 keeps every token of the fp32 engine."""
    import onnx

    fp32 = export_engine("stories-next-aware", medusa_model(stories_base, stories_next_aware))
    int8 = export_engine("stories-next-aware-int8", medusa_model(stories_base, stories_next_aware), quantize="heads-int8")
    for engine in (fp32, int8):
        assert read_meta(engine).head_input == "hidden+next"
        inputs = [i.name for i in onnx.load(str(EngineFiles.beside(engine).heads)).graph.input]
        assert inputs == ["hidden", "root_ids"]
    prompts = ["Once upon a time", "Tim had a red ball", "The sun was hot and"]
    reference = MedusaRuntime(fp32).generate(prompts, max_new_tokens=24)
    quantized = MedusaRuntime(int8).generate(prompts, max_new_tokens=24)
    assert [r.token_ids for r in quantized] == [r.token_ids for r in reference]
    assert max(r.stats.mean_accepted for r in quantized) > 1.0


def test_sequential_heads_expand_the_template_in_one_heads_call(export_engine, stories_base, stories_sequential):
    """Sequential heads' graph takes root_ids and returns one proposals row per expanded node of
    the export template; ONNX Runtime's rows are torch's expansion of the same tree (with a draft
    vocabulary too); heads-int8 keeps every token; sampling is reproducible solo and batched; a
    tree the template cannot expand is refused naming the fix."""
    import onnxruntime as ort
    import torch

    from medusa_trt.runtime.drafting.sequential import TemplateMismatchError, expansion

    model = medusa_model(stories_base, stories_sequential)
    fp32 = export_engine("stories-sequential", model)
    small = export_engine("stories-sequential-vocab", model, draft_vocab=128, tree=CUSTOM_TREE)
    int8 = export_engine("stories-sequential-int8", model, quantize="heads-int8")
    meta = read_meta(fp32)
    plan = expansion([tuple(p) for p in meta.tree])
    assert meta.head_input == "hidden+path" and meta.proposal_rows == plan.rows > meta.num_heads
    rng = np.random.default_rng(0)
    for engine, vocab in ((fp32, None), (small, 128)):
        session = ort.InferenceSession(str(EngineFiles.beside(engine).heads), providers=["CPUExecutionProvider"])
        assert [i.name for i in session.get_inputs()] == ["hidden", "root_ids"]
        hidden, roots = rng.normal(size=(3, 64)).astype(np.float32), np.array([5, 17, 300])
        topk, logits = session.run(None, {"hidden": hidden, "root_ids": roots})
        tree = read_meta(engine)
        rows = expansion([tuple(p) for p in tree.tree])
        assert topk.shape == (3, rows.rows, tree.top_k) and logits.shape[:2] == (3, rows.rows)
        saved, model.draft_vocab = model.draft_vocab, vocab
        try:
            want = model.propose(torch.from_numpy(hidden), torch.from_numpy(roots), rows, tree.top_k).numpy()
        finally:
            model.draft_vocab = saved
        np.testing.assert_allclose(logits, want, atol=1e-4)
        assert logits.shape[-1] == (vocab or stories_base.model.config.vocab_size)
    prompts = ["Once upon a time", "Tim had a red ball", "The sun was hot and"]
    reference = MedusaRuntime(fp32).generate(prompts, max_new_tokens=24)
    quantized = MedusaRuntime(int8).generate(prompts, max_new_tokens=24)
    assert [r.token_ids for r in quantized] == [r.token_ids for r in reference]
    assert max(r.stats.mean_accepted for r in quantized) > 1.0
    runtime = MedusaRuntime(fp32)
    together = runtime.generate(prompts, max_new_tokens=24, temperature=0.8, seed=3)
    for prompt, row in zip(prompts, together):
        assert runtime.generate(prompt, max_new_tokens=24, temperature=0.8, seed=3).token_ids == row.token_ids
    with pytest.raises(TemplateMismatchError, match="subtree of that template"):
        MedusaRuntime(small, tree="chain-4")  # the custom template has no node below [0, 0, 0]


def test_a_draft_vocabulary_shrinks_the_heads_projection_and_keeps_every_token(export_engine, stories_engine, stories_base, stories_fitted):
    """--draft-vocab 128: the heads graph projects onto token ids 0..127 only (its logits have 128
    columns, every proposal is below 128, ONNX Runtime matches torch's first 128 columns at export),
    the metadata says so, and greedy output is the full-vocabulary engine's, token for token."""
    import onnx
    import onnxruntime as ort

    engine = export_engine("stories-draft-vocab", medusa_model(stories_base, stories_fitted), draft_vocab=128)
    meta = read_meta(engine)
    assert (meta.draft_vocab, meta.heads_vocab, read_meta(stories_engine).heads_vocab) == (128, 128, stories_base.model.config.vocab_size)
    heads_file = EngineFiles.beside(engine).heads
    sizes = [list(i.dims) for i in onnx.load(str(heads_file)).graph.initializer]
    assert ([128, 64] in sizes or [64, 128] in sizes) and not any(stories_base.model.config.vocab_size in d for d in sizes)
    session = ort.InferenceSession(str(heads_file), providers=["CPUExecutionProvider"])
    topk, logits = session.run(None, {"hidden": np.random.default_rng(0).normal(size=(3, 64)).astype(np.float32)})
    assert logits.shape[-1] == 128 and topk.max() < 128
    prompts = ["Once upon a time", "Tim had a red ball", "The sun was hot and"]
    runtime = MedusaRuntime(engine)
    drafted = runtime.generate(prompts, max_new_tokens=24)
    reference = MedusaRuntime(stories_engine).generate(prompts, max_new_tokens=24)
    assert [r.token_ids for r in drafted] == [r.token_ids for r in reference]
    assert max(r.stats.mean_accepted for r in drafted) > 1.0


def test_metadata_of_older_engines_loads_with_the_defaults_of_later_fields():
    """Fields added since an engine was exported (quantization, attention, successors, head_input, draft_vocab)
    take their defaults; a field every engine has is still required."""
    import dataclasses
    import json

    from medusa_trt.runtime.engine import FORMAT_VERSION, EngineError, EngineMeta

    meta = EngineMeta(
        format_version=FORMAT_VERSION,
        model="m",
        architecture="llama",
        dtype="fp32",
        vocab_size=8,
        hidden_size=4,
        num_layers=1,
        num_kv_heads=1,
        head_dim=4,
        num_heads=2,
        top_k=1,
        tree=[[0]],
        tree_name="chain-1",
        max_batch=1,
        max_context=8,
        max_tokens=4,
        eos_token_ids=[],
        is_chat=False,
    )
    raw = dataclasses.asdict(meta)
    for later in ("quantization", "attention", "successors", "head_input", "draft_vocab"):
        raw.pop(later)
    assert EngineMeta.from_json(json.dumps(raw), source="old.onnx") == meta
    raw.pop("top_k")
    with pytest.raises(EngineError, match=r"lacks \['top_k'\]: export it again"):
        EngineMeta.from_json(json.dumps(raw), source="old.onnx")
