"""The lean install (``pip install medusa-trt``, no extras) runs exported ONNX engines.

Two checks: (1) in the full install, the ONNX path (runtime, ``medusa-run --engine``,
``medusa-bench --engine --no-hf``) leaves every export-only framework out of ``sys.modules``;
(2) a fresh venv holding only the lean install (built from this checkout, not editable)
decodes the same tokens, through ``medusa-run`` and ``medusa-bench`` too, as the full install.
"""

from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import STORY_PROMPTS, medusa_model
from helpers import script

from medusa_trt.cli.run import main as run_main
from medusa_trt.runtime import MedusaRuntime

REPO = Path(__file__).resolve().parents[1]
# what the export / train / kernel extras add beside onnxruntime, and TensorRT: none of it on the ONNX path
FORBIDDEN = ("torch", "transformers", "onnx", "onnxscript", "safetensors", "accelerate", "gguf", "sentencepiece", "triton", "tensorrt")
NEW_TOKENS = 32
# a chat template for the stories260K tokenizer (which has none): exercises jinja2 and the special tokens
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
# pip's words when PyPI cannot be reached: the only install failure that skips rather than fails
OFFLINE = (
    "NewConnectionError",
    "Network is unreachable",
    "Temporary failure in name resolution",
    "ConnectTimeout",
    "Failed to establish a new connection",
    "ProxyError",
)

# Runs in a fresh interpreter: records who first imports a forbidden package, then drives the ONNX
# path (runtime, medusa-run, medusa-bench --no-hf) and prints what ended up in sys.modules.
_PROBE = r"""
import json, sys, traceback

forbidden = set(sys.argv[1].split(","))
engine, prompts, out = sys.argv[2:5]
importers = {}

class ImportTracer:
    def find_spec(self, name, path=None, target=None):
        top = name.partition(".")[0]
        if top in forbidden and top not in importers:
            stack = [f for f in traceback.extract_stack()[:-1] if not f.filename.startswith("<frozen")]
            importers[top] = [f"{f.filename}:{f.lineno} in {f.name}" for f in stack[-8:]]
        return None  # only watching: the real finders import it

sys.meta_path.insert(0, ImportTracer())
from medusa_trt.runtime import MedusaRuntime
MedusaRuntime(engine).generate("Once upon a time", max_new_tokens=8)
from medusa_trt.cli import bench, run
assert run.main(["--engine", engine, "--prompt", "One day", "--max-new-tokens", "8"]) == 0
assert bench.main(["--engine", engine, "--prompts", prompts, "--no-hf", "--max-new-tokens", "8", "--out", out]) == 0
loaded = sorted({m.partition(".")[0] for m in sys.modules} & forbidden)
print(json.dumps({"loaded": loaded, "importers": {m: importers.get(m, ["(not seen)"]) for m in loaded}}))
"""


@pytest.fixture(scope="module")
def stories_engine(export_engine, stories_base, stories_fitted):
    return export_engine("stories-fitted", medusa_model(stories_base, stories_fitted))


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("lean-prompts") / "prompts.jsonl"
    path.write_text("".join(json.dumps({"turns": [p]}) + "\n" for p in STORY_PROMPTS[:2]))
    return path


def test_onnx_path_imports_no_export_frameworks(stories_engine, prompts_file, tmp_path):
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE, ",".join(FORBIDDEN), str(stories_engine), str(prompts_file), str(tmp_path / "bench.json")],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    report = "\n".join(f"{m} first imported from:\n    " + "\n    ".join(stack) for m, stack in found["importers"].items())
    assert found["loaded"] == [], f"the ONNX path imported {found['loaded']}\n{report}"
    assert json.loads((tmp_path / "bench.json").read_text())["methods"]


# ----------------------------------------------------------------- the lean venv


lean_report = script("lean_report")  # scripts/lean_report.py builds the lean venv for the report too: one way to build it


@pytest.fixture(scope="module")
def lean_venv(tmp_path_factory) -> Path:
    """A venv with only ``pip install <checkout>`` in it (no extras, not editable); returns its bin/."""
    venv = tmp_path_factory.mktemp("lean") / "venv"
    try:
        lean_report.build_lean_venv(venv)
    except lean_report.LeanInstallError as exc:
        if any(word in exc.output for word in OFFLINE):
            pytest.skip(f"PyPI unreachable, no lean venv: {exc.output.strip().splitlines()[-1]}")
        pytest.fail(f"{exc}:\n{exc.output[-3000:]}")
    return venv / "bin"


def _lean(bin_dir: Path, *args: str, cwd: Path) -> str:
    proc = subprocess.run(
        [str(bin_dir / args[0]), *args[1:]], capture_output=True, text=True, timeout=300, cwd=cwd, env=lean_report.clean_env()
    )
    assert proc.returncode == 0, f"{args[0]} failed in the lean venv:\n{proc.stderr[-3000:]}"
    return proc.stdout


def _no_rate(text: str) -> str:
    return re.sub(r"[\d.]+ tokens/s", "N tokens/s", text)


def _checkout_packages() -> set[str]:
    """Every package of the checkout: folders with an __init__.py under the ones pyproject maps."""
    found = set()
    for package, folder in lean_report.setuptools_table()["package-dir"].items():
        for init in (REPO / folder).rglob("__init__.py"):
            found.add(".".join([package, *init.parent.relative_to(REPO / folder).parts]))
    return found


@pytest.mark.slow
def test_lean_venv_has_every_package_and_no_export_frameworks(lean_venv, tmp_path):
    code = (
        "import importlib.util, json, pathlib, medusa_trt.runtime as r; "
        "root = pathlib.Path(r.__file__).parents[1]; "
        "packages = ['.'.join(('medusa_trt',) + p.parent.relative_to(root).parts) for p in root.rglob('__init__.py')]; "
        f"print(json.dumps([[m for m in {FORBIDDEN!r} if importlib.util.find_spec(m)], r.__file__, packages]))"
    )
    present, installed_at, packages = json.loads(_lean(lean_venv, "python", "-c", code, cwd=tmp_path))
    assert Path(installed_at).is_relative_to(lean_venv.parent), f"runtime imported from {installed_at}, not the lean venv"
    missing = sorted(_checkout_packages() - set(packages))
    assert not missing, f"the installed package lacks {missing}: list them under [tool.setuptools] packages in pyproject.toml"
    assert present == [], f"the lean install pulled in {present}: keep them in the export extra"
    proc = subprocess.run(
        [str(lean_venv / "python"), "-c", "import torch"], capture_output=True, text=True, cwd=tmp_path, env=lean_report.clean_env()
    )
    assert proc.returncode != 0 and "No module named 'torch'" in proc.stderr


@pytest.mark.slow
def test_wheel_carries_the_training_prompts(lean_venv, tmp_path):
    """The built-in prompt pool is package data (training/prompts.jsonl): the wheel reads the same pool."""
    from medusa_trt.training.prompts import pool_digest

    code = "from medusa_trt.training.prompts import builtin_pool, pool_digest; print(len(builtin_pool()), pool_digest())"
    assert _lean(lean_venv, "python", "-c", code, cwd=tmp_path).split() == ["6954", pool_digest()]


@pytest.mark.slow
def test_lean_runtime_decodes_the_same_tokens(lean_venv, stories_engine, tmp_path):
    code = (
        "import json; from medusa_trt.runtime import MedusaRuntime; "
        f"r = MedusaRuntime({str(stories_engine)!r}).generate({STORY_PROMPTS!r}, max_new_tokens={NEW_TOKENS}); "
        "print(json.dumps([[x.token_ids, x.text] for x in r]))"
    )
    lean = json.loads(_lean(lean_venv, "python", "-c", code, cwd=tmp_path))
    full = MedusaRuntime(stories_engine).generate(STORY_PROMPTS, max_new_tokens=NEW_TOKENS)
    assert [ids for ids, _ in lean] == [r.token_ids for r in full]
    assert [text for _, text in lean] == [r.text for r in full]


@pytest.mark.slow
@pytest.mark.parametrize("rule", ["lossless", "typical"])
def test_lean_sampling_matches_the_full_install(lean_venv, stories_engine, tmp_path, rule):
    """Sampling rules run in numpy with seeded generators: the same seeds give the same tokens in both installs."""
    args = [
        "--engine",
        str(stories_engine),
        "--prompt",
        STORY_PROMPTS[0],
        "--prompt",
        STORY_PROMPTS[1],
        "--max-new-tokens",
        str(NEW_TOKENS),
        "--temperature",
        "0.8",
        "--top-p",
        "0.9",
        "--seed",
        "11",
        "--acceptance",
        rule,
        "--json",
    ]
    lean = [json.loads(line)["token_ids"] for line in _lean(lean_venv, "medusa-run", *args, cwd=tmp_path).splitlines()]
    full = MedusaRuntime(stories_engine).generate(
        STORY_PROMPTS[:2], max_new_tokens=NEW_TOKENS, temperature=0.8, top_p=0.9, seed=11, acceptance=rule
    )
    assert lean == [r.token_ids for r in full]


@pytest.mark.slow
def test_lean_medusa_run_prints_what_the_full_install_prints(lean_venv, stories_engine, tmp_path, capsys):
    args = [
        "--engine",
        str(stories_engine),
        "--prompt",
        STORY_PROMPTS[0],
        "--prompt",
        STORY_PROMPTS[2],
        "--max-new-tokens",
        str(NEW_TOKENS),
    ]
    lean = _lean(lean_venv, "medusa-run", *args, cwd=tmp_path)
    assert run_main(args) == 0
    full = capsys.readouterr().out
    assert _no_rate(lean) == _no_rate(full)
    texts = [r.text for r in MedusaRuntime(stories_engine).generate([STORY_PROMPTS[0], STORY_PROMPTS[2]], max_new_tokens=NEW_TOKENS)]
    assert all(text in lean for text in texts) and lean.count("--- prompt") == 2


@pytest.mark.slow
def test_lean_chat_template_matches_transformers(lean_venv, stories_engine, stories_base, tmp_path):
    """The engine's tokenizer folder with a chat template: the lean venv renders it with jinja2 and
    tokenizes with ``tokenizers`` to the ids transformers' apply_chat_template gives."""
    engine = tmp_path / "chat" / stories_engine.name
    engine.parent.mkdir()
    for sibling in stories_engine.parent.iterdir():
        (shutil.copytree if sibling.is_dir() else shutil.copy2)(sibling, engine.parent / sibling.name)
    tokenizer_dir = engine.with_suffix(".tokenizer")
    (tokenizer_dir / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    prompt = STORY_PROMPTS[1]
    code = (
        "import json; from medusa_trt.runtime import MedusaRuntime; "
        f"rt = MedusaRuntime({str(engine)!r}); r = rt.generate({prompt!r}, max_new_tokens={NEW_TOKENS}, chat_template=True); "
        f"print(json.dumps([rt.codec.encode({prompt!r}, chat=True), r.token_ids]))"
    )
    ids, tokens = json.loads(_lean(lean_venv, "python", "-c", code, cwd=tmp_path))
    tokenizer = copy.deepcopy(stories_base.tokenizer)
    tokenizer.chat_template = CHAT_TEMPLATE
    expected = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True)
    expected = list(expected["input_ids"]) if hasattr(expected, "keys") else list(expected)
    assert ids == expected
    assert tokens == MedusaRuntime(engine).generate(expected, max_new_tokens=NEW_TOKENS).token_ids


@pytest.mark.slow
def test_lean_medusa_bench_without_hf(lean_venv, stories_engine, prompts_file, tmp_path):
    out = tmp_path / "bench.json"
    stdout = _lean(
        lean_venv,
        "medusa-bench",
        "--engine",
        str(stories_engine),
        "--prompts",
        str(prompts_file),
        "--no-hf",
        "--max-new-tokens",
        "16",
        "--out",
        str(out),
        cwd=tmp_path,
    )
    report = json.loads(out.read_text())
    assert report["prompts"] == 2 and set(report["methods"]) == {"plain[model]", "medusa[model]"}, report["methods"]
    assert all(m["identical_to_reference"] == 1.0 for m in report["methods"].values())
    assert "medusa[model]" in stdout


@pytest.mark.slow
def test_lean_writes_a_triton_repository_whose_model_imports_no_torch(lean_venv, stories_engine, tmp_path):
    """The serving path is lean too: the repository writer and the served model.py (run by Triton's
    Python backend over this install) import no torch or transformers."""
    out = _lean(lean_venv, "medusa-triton-repo", "--engine", str(stories_engine), "--out", str(tmp_path / "repo"), cwd=tmp_path)
    model = tmp_path / "repo" / "medusa" / "1" / "model.py"
    assert "wrote" in out and model.is_file() and (tmp_path / "repo" / "medusa" / "config.pbtxt").is_file()
    code = (
        "import sys, runpy; from medusa_trt.runtime import MedusaRuntime; "
        f"MedusaRuntime({str(stories_engine)!r}).generate('Once', max_new_tokens=2); runpy.run_path({str(model)!r}); "
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'transformers', 'onnx'}))"
    )
    assert _lean(lean_venv, "python", "-c", code, cwd=tmp_path).strip() == "[]"


@pytest.fixture(scope="module")
def stories_folder(stories_base, stories_fitted, tmp_path_factory):
    """An engine folder (medusa-export --out DIR) with the 63-node preset's top-10 proposals."""
    from conftest import TREES

    from medusa_trt.exporter.onnx_export import ExportConfig, export_onnx

    if not TREES.is_file():
        pytest.skip(f"{TREES} missing: the presets' source is laid beside the checkout")
    out = tmp_path_factory.mktemp("lean-folder") / "stories"
    config = ExportConfig(out=out, tree="mc_sim_7b_63", max_batch=4, max_context=256, backend="onnxruntime")
    export_onnx(medusa_model(stories_base, stories_fitted), config)
    return out


@pytest.mark.slow
def test_wheel_resolves_tree_presets_without_an_environment_variable(lean_venv, stories_folder, tmp_path):
    """The wheel carries the published presets as package data: MedusaRuntime(DIR, tree="mc_sim_7b_63")
    runs in the lean venv with no MEDUSA_TRT_TREE_PRESETS and no checkout in reach."""
    from medusa_trt.runtime.tree import PRESETS_ENV

    assert PRESETS_ENV not in lean_report.clean_env()
    code = (
        "import json; from medusa_trt.runtime import MedusaRuntime; from medusa_trt.runtime.tree import default_presets_file; "
        f"rt = MedusaRuntime({str(stories_folder)!r}, tree='mc_sim_7b_63'); "
        f"r = rt.generate({STORY_PROMPTS!r}, max_new_tokens={NEW_TOKENS}); "
        "print(json.dumps([str(default_presets_file()), rt.tree.name, rt.tree.num_nodes, [x.token_ids for x in r]]))"
    )
    presets, name, nodes, tokens = json.loads(_lean(lean_venv, "python", "-c", code, cwd=tmp_path))
    assert Path(presets).is_relative_to(lean_venv.parent) and Path(presets).is_file(), presets
    assert (name, nodes) == ("mc_sim_7b_63", 64)
    full = MedusaRuntime(stories_folder, tree="mc_sim_7b_63").generate(STORY_PROMPTS, max_new_tokens=NEW_TOKENS)
    assert tokens == [r.token_ids for r in full]
    plain = MedusaRuntime(stories_folder, drafters=()).generate(STORY_PROMPTS, max_new_tokens=NEW_TOKENS)
    assert tokens == [r.token_ids for r in plain]
