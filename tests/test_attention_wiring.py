"""How the step's KV cache reaches the attention of every family, and whose failure a failed probe is.

The exporter's attention function gets its scratch (the probe, a step's cache) as the ``medusa_kv``
keyword where the model threads its forward's ``**kwargs`` down to attention, else from the context
variable set around the forward (``exporter.architecture.attention_scratch``). StableLM and Nemotron
drop the kwargs in their decoder layers; Helium threads them. Each is exported with medusa-export and
decodes as transformers' generate() does, with test_architectures.py's own fixture and checks (the rows
here are the ``Arch`` lines proposed for tests/architectures.py). A failure inside this project's code
during the probe is reported as ours, in one line; one in the model's own code stays the model's.
"""

from __future__ import annotations

import pytest
import test_architectures as rows
import torch
from architectures import Arch, save_fixture
from conftest import STORIES
from test_architectures import _export_cli, _prefill_logits

from medusa_trt.exporter import architecture, load_base_model, wrapper
from medusa_trt.exporter.architecture import UnsupportedModelError, current_scratch
from medusa_trt.exporter.wrapper import MedusaModel

pytestmark = pytest.mark.skipif(not STORIES.is_file(), reason=f"{STORIES} missing")
family, stories_tokenizer = rows.family, rows.stories_tokenizer  # its fixtures: each row built and exported as there

STABLELM = {"use_qkv_bias": True, "qk_layernorm": True, "use_parallel_residual": True}  # as StableLM-2 12B: all its options count
WIRING = (
    # decoder layers drop **kwargs (the class keeps _supports_attention_backend False); quarter rotary, LayerNorm
    Arch("stablelm", STABLELM, ("partial-rotary", "qk-norm", "parallel-residual")),  # per-head LayerNorms; one norm for both
    Arch("stablelm", {"use_qkv_bias": True}, ("partial-rotary", "layer-norm", "qkv-bias")),  # as StableLM-2 1.6B: native runs it
    Arch("nemotron", {}, ("partial-rotary", "relu2")),  # decoder layers drop **kwargs; LayerNorm1P, half rotary, squared ReLU
    Arch("helium", {"head_dim": 16}),  # its o_proj maps the hidden size: heads x head_dim must equal it (128 by default)
)
by_family = pytest.mark.parametrize("family", WIRING, indirect=True, ids=lambda a: a.id)

# onnxscript's optimizer as torch.onnx.export(optimize=True) runs it rewrites x + c to x for |c| <= 1e-8 (its "no-op"
# rules compare with abs_tol 1e-8, rel_tol 1e-5): Helium's RMSNorm epsilon of 1e-8 would be dropped, and the padding
# token's zero embedding (padding_idx) would normalise to 0 * inf = NaN, which the attention's zero weights (0 * NaN)
# carry to every row of a padded batch. The exporter optimizes with exact no-op rules (exporter/onnx_optimize.py).


@by_family
def test_export_prints_what_it_exported(family):
    rows.test_export_prints_what_it_exported(family)


@by_family
def test_onnx_runtime_is_greedy_identical_at_batch_3_on_a_branching_tree(family):
    rows.test_onnx_runtime_is_greedy_identical_at_batch_3_on_a_branching_tree(family)


@by_family
def test_native_is_greedy_identical_or_refused_by_name(family):
    rows.test_native_is_greedy_identical_at_batch_3_on_a_branching_tree(family)


@by_family
@pytest.mark.parametrize("context", [5, 37])
def test_native_verify_steps_are_plain_steps_bit_for_bit(family, context):
    rows.test_native_verify_steps_are_plain_steps_bit_for_bit(family, context)


@by_family
def test_native_honours_each_feature_it_reads(family, monkeypatch):
    rows.test_native_honours_each_feature_it_reads(family, monkeypatch)


@by_family
@pytest.mark.parametrize("mode", ["int8-channel-native", "int4-native"])
def test_quantized_native_drafted_output_equals_its_own_plain_output(family, mode, tmp_path):
    rows.test_quantized_drafted_output_equals_its_own_plain_output(family, mode, tmp_path)


@pytest.mark.parametrize("family", [WIRING[3]], indirect=True, ids=lambda a: a.id)
def test_the_norm_epsilon_survives_the_onnx_optimizer(family):
    """Every RMSNorm of the step graph keeps its epsilon: fused (RMSNormalization) with it, or its Sqrt reading mean(x^2) + eps."""
    import onnx

    graph = onnx.load(str(family.engine), load_external_data=False).graph
    made_by = {out: node.op_type for node in graph.node for out in node.output}
    bare = [node.name for node in graph.node if node.op_type == "Sqrt" and made_by.get(node.input[0]) == "ReduceMean"]
    assert not bare, f"RMSNorms without their epsilon: {bare}"
    eps = family.reference.model.config.rms_norm_eps
    for node in graph.node:
        if node.op_type == "RMSNormalization":
            got = next(a.f for a in node.attribute if a.name == "epsilon")
            assert got == pytest.approx(eps, rel=1e-6), f"{node.name}: epsilon {got}, the model's {eps}"


@by_family
def test_torch_backend_is_greedy_identical(family):
    rows.test_torch_backend_is_greedy_identical(family)


@by_family
def test_the_wrapped_model_still_runs_as_transformers_runs_it(family):
    """Outside a step the scratch is unset, so plain transformers use runs the model's own attention."""
    assert current_scratch() is None
    rows.test_the_wrapped_model_still_runs_as_transformers_runs_it(family)


# --------------------------------------------------------------------- the route the scratch takes


def _count_scratch_reads(monkeypatch) -> list[int]:
    """How many attention calls took the scratch from the context variable (the keyword did not arrive)."""
    reads = []
    read = wrapper.current_scratch

    def counted():
        reads.append(1)
        return read()

    monkeypatch.setattr(wrapper, "current_scratch", counted)
    return reads


@pytest.mark.parametrize(("model_type", "routed"), [("nemotron", 3), ("llama", 0)])
def test_the_scratch_reaches_a_model_that_drops_kwargs(model_type, routed, tmp_path, stories_tokenizer, monkeypatch):
    """Nemotron's decoder layers call attention without the forward's kwargs: every layer of a step reads the
    scratch from the context variable, and the step's logits are transformers' own. Llama threads them: the
    keyword stays the route there. Without the context variable Nemotron is refused as before."""
    arch = next(a for a in (*WIRING, Arch("llama")) if a.model_type == model_type)
    folder = save_fixture(arch, tmp_path / "model", stories_tokenizer)
    reference = load_base_model(folder)
    model = MedusaModel(load_base_model(folder), None)
    ids = reference.tokenizer(rows.PROMPTS[2])["input_ids"]
    with torch.no_grad():
        want = reference.model(torch.tensor([ids])).logits[0]  # (T, V)
    reads = _count_scratch_reads(monkeypatch)
    torch.testing.assert_close(_prefill_logits(model, ids), want, rtol=0, atol=1e-4)
    assert len(reads) == routed, f"{model_type}: {len(reads)} attention calls read the context variable"
    assert current_scratch() is None  # reset when the step returns

    monkeypatch.setattr(wrapper, "current_scratch", lambda: None)
    if routed:
        with pytest.raises(UnsupportedModelError):
            MedusaModel(load_base_model(folder), None)
    else:
        MedusaModel(load_base_model(folder), None)


def test_the_scratch_is_reset_when_the_forward_raises():
    with pytest.raises(RuntimeError), architecture.attention_scratch("step"):
        assert current_scratch() == "step"
        raise RuntimeError
    assert current_scratch() is None


# --------------------------------------------------------------------- whose failure


def test_a_failure_in_our_wrapper_is_reported_as_ours_in_one_line(tmp_path, stories_tokenizer, capsys, monkeypatch):
    folder = save_fixture(WIRING[0], tmp_path / "model", stories_tokenizer)
    record = wrapper.record_call

    def broken(probe, module, query, key, kwargs):  # our bug at layer 1 (a stand-in called from exporter/wrapper.py)
        if probe.calls:
            raise AttributeError("'Probe' object has no attribute 'layers'")
        return record(probe, module, query, key, kwargs)

    monkeypatch.setattr(wrapper, "record_call", broken)
    code, err = _export_cli(capsys, folder, tmp_path / "engine")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert "medusa-trt's tree attention (exporter/wrapper.py:" in err and "in _medusa_tree_attention)" in err, err
    assert "failed on stablelm (layer 1, AttributeError: 'Probe' object has no attribute 'layers')" in err, err
    assert err.strip().endswith("this is a medusa-trt bug, please report it"), err
    assert "cannot drive" not in err and "recurrent" not in err
    assert not (tmp_path / "engine").exists()


def test_a_failure_in_the_models_own_code_stays_the_models(tmp_path, stories_tokenizer, capsys):
    """Helium with its default head_dim of 128 over a hidden size of 64: its own o_proj cannot take the attention's
    output (transformers' generate() fails the same way), which is not ours to report."""
    folder = save_fixture(Arch("helium"), tmp_path / "model", stories_tokenizer)
    code, err = _export_cli(capsys, folder, tmp_path / "engine")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "model architecture 'helium' has a forward the tree attention cannot drive (RuntimeError: mat1 and mat2" in err, err
    assert "medusa-trt bug" not in err


@pytest.mark.parametrize("arch", [Arch("bloom"), Arch("gpt_neo", {"attention_types": [[["global"], 3]]})], ids=lambda a: a.model_type)
def test_attention_outside_the_interface_is_refused_by_name(arch, tmp_path, stories_tokenizer, capsys):
    """Families whose attention classes compute attention themselves (transformers cannot set their implementation):
    refused naming the class, never as recurrent."""
    folder = save_fixture(arch, tmp_path / "model", stories_tokenizer)
    code, err = _export_cli(capsys, folder, tmp_path / "engine")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"model architecture {arch.model_type!r} computes attention inside its own modules (" in err, err
    assert "not through transformers' AttentionInterface" in err and "recurrent" not in err
