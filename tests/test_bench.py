"""medusa-bench end to end on a small engine: every method, JSON and plot written, ratios consistent."""

from __future__ import annotations

import json

from conftest import STORIES, medusa_model
from helpers import run_bench

from medusa_trt.cli.bench import main


def test_bench_reports_every_method(tmp_path, capsys, export_engine, stories_base, stories_fitted):
    engine = export_engine("stories-fitted", medusa_model(stories_base, stories_fitted))
    args = ("--model", str(STORIES), "--tree", "chain-3", "--tree", "mc_sim_7b_63", "--every", "1")
    report = run_bench(tmp_path, [engine], ["Once upon a time", "The dog", "Lily saw a bird"], *args)
    out, methods = tmp_path / "bench.json", report["methods"]
    assert set(methods) == {"plain[model]", "medusa[model:chain-3]", "medusa[model:mc_sim_7b_63]", "hf", "hf-lookup"}
    # every greedy method decodes the same tokens as plain decoding on the engine
    assert all(m["identical_to_reference"] == 1.0 for m in methods.values()), methods
    assert methods["plain[model]"]["mean_accepted_per_step"] == 1.0 and methods["plain[model]"]["mean_nodes_per_step"] == 1.0
    assert methods["medusa[model:mc_sim_7b_63]"]["mean_nodes_per_step"] > 1.0  # it verified drafts
    assert methods["medusa[model:mc_sim_7b_63]"]["mean_accepted_per_step"] > 1.2
    assert abs(methods["hf"]["speedup_vs_plain"] * methods["plain[model]"]["tokens_per_s"] - methods["hf"]["tokens_per_s"]) < 1e-6
    assert report["heads_cost"]["heads_all_nodes_ms"] > 0
    assert out.with_suffix(".png").stat().st_size > 1000
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench.json", "bench.png", "p.jsonl"]  # written by rename: no temps
    printed = capsys.readouterr().out
    assert "medusa[model:mc_sim_7b_63]" in printed and f"wrote {out} and {out.with_suffix('.png')}" in printed


def test_bench_bad_prompts_file(tmp_path, capsys, export_engine, stories_base, stories_fitted):
    engine = export_engine("stories-fitted", medusa_model(stories_base, stories_fitted))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"no_turns": 1}\n')
    assert main(["--engine", str(engine), "--prompts", str(bad), "--no-hf", "--out", str(tmp_path / "b.json")]) == 2
    assert "bad.jsonl:1: not a Spec-Bench record" in capsys.readouterr().err


def test_bench_rows_per_engine_against_their_own_plain(tmp_path, capsys, stories_base, stories_fitted):
    """Two engines (fp32, int4): each row's agreement with its own engine's plain decoding and
    speed against it, beside the agreement with the first engine's plain decoding."""
    from medusa_trt.exporter.onnx_export import ExportConfig, export_onnx

    model = medusa_model(stories_base, stories_fitted)
    for name, quantize in (("fp32", None), ("int4", "int4")):
        export_onnx(model, ExportConfig(out=tmp_path / f"{name}.onnx", tree="chain-3", max_context=128, quantize=quantize, verify=False))
    engines = [tmp_path / "fp32.onnx", tmp_path / "int4.onnx"]
    methods = run_bench(tmp_path, engines, ["Once upon a time", "Lily saw a bird"], "--no-hf", new_tokens=16)["methods"]
    assert set(methods) == {"plain[fp32]", "medusa[fp32]", "plain[int4]", "medusa[int4]"}
    for name in ("fp32", "int4"):
        plain, drafted = methods[f"plain[{name}]"], methods[f"medusa[{name}]"]
        assert plain["identical_to_own_plain"] == 1.0 and plain["speedup_vs_own_plain"] == 1.0
        assert drafted["identical_to_own_plain"] == 1.0 and drafted["identical_to_own_plain_prompts"] == "2/2"  # greedy: lossless
        assert abs(drafted["speedup_vs_own_plain"] * plain["tokens_per_s"] - drafted["tokens_per_s"]) < 1e-6
    assert methods["plain[fp32]"]["matching_prefix_fraction"] == 1.0
    assert 0.0 < methods["plain[int4]"]["matching_prefix_fraction"] <= 1.0  # against the fp32 engine's plain decoding
    printed = capsys.readouterr().out
    assert "= own plain" in printed and "prefix" in printed


def test_bench_on_next_token_aware_heads(tmp_path, capsys, export_engine, stories_base, stories_next_aware):
    """Heads that read the root token: every drafter row decodes plain's tokens, and the heads-cost
    probe after the rows (which once raised here, after the whole run) feeds them their root."""
    engine = export_engine("stories-next-aware", medusa_model(stories_base, stories_next_aware))
    args = ("--no-hf", "--draft", "heads", "--draft", "heads,lookup,recycle")
    report = run_bench(tmp_path, [engine], ["Once upon a time", "Lily saw a bird"], *args, new_tokens=16)
    drafted = [m for name, m in report["methods"].items() if not name.startswith("plain")]
    assert len(drafted) == 2 and all(m["identical_to_reference"] == 1.0 for m in drafted), report["methods"]
    cost = report["heads_cost"]
    assert cost["heads_one_node_ms"] > 0 and cost["heads_all_nodes_ms"] > 0 and cost["verify_step_ms_ctx128"] > 0


def test_quality_scores_an_engine_against_itself(tmp_path, capsys, export_engine, stories_base, stories_fitted):
    """bench.quality (python -m medusa_trt.bench.quality): an engine scored against itself agrees on every
    next token, with the same perplexity; the texts are turns[0] plus the first reference that is a string."""
    from medusa_trt.bench.quality import main as quality_main
    from medusa_trt.bench.quality import texts

    engine = str(export_engine("stories-fitted", medusa_model(stories_base, stories_fitted)))
    prompts = tmp_path / "p.jsonl"
    rows = [{"turns": ["Once upon a time"], "reference": ["there was a cat."]}, {"turns": ["The dog"], "reference": [["a list"]]}]
    prompts.write_text("\n".join(json.dumps(r) for r in rows))
    assert texts(prompts) == ["Once upon a time\n\nthere was a cat.", "The dog"]
    out = tmp_path / "quality.json"
    assert quality_main(["--engine", engine, "--engine", engine, "--prompts", str(prompts), "--max-len", "32", "--out", str(out)]) == 0
    first, second = json.loads(out.read_text())["rows"]
    assert second["argmax_agreement"] == 1.0 and second["vs_first"] == 1.0 and 1.0 < first["perplexity"] < 1e6
    assert f"| {engine} |" in capsys.readouterr().out
