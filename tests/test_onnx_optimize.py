"""exporter/onnx_optimize.py: torch's ONNX optimizer with no-ops removed only where they are exact.

A no-op constant is removed when it is exactly 0 (Add, Sub) or 1 (Mul, Div) and kept when it is only
close; an RMSNorm with an epsilon of 1e-8 (Helium's) still fuses to ``RMSNormalization`` and keeps it;
and a model without such a constant gets the graphs ``torch.onnx.export(optimize=True)`` writes.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import onnxscript.optimizer
import pytest
import torch
from conftest import STORIES, medusa_model, random_heads
from onnx import TensorProto, helper, numpy_helper

from medusa_trt.exporter import onnx_export
from medusa_trt.exporter.onnx_optimize import optimize
from medusa_trt.runtime.config import default_tree
from medusa_trt.runtime.tree import load_tree

NEXT_AFTER_ONE = 1 + float(np.finfo(np.float32).eps)  # the float32 just above 1: not a no-op, though close to one


def _binary(op: str, constant: float, constant_first: bool = False) -> ir.Model:
    """y = op(x, c) (or op(c, x)) over a float32 x [2, 3] and a scalar constant c."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])
    c = numpy_helper.from_array(np.array(constant, np.float32), "c")
    node = helper.make_node(op, ["c", "x"] if constant_first else ["x", "c"], ["y"])
    graph = helper.make_graph([node], op, [x], [y], [c])
    return ir.serde.deserialize_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)]))


def _ops(model: ir.Model) -> list[str]:
    return [node.op_type for node in model.graph]


@pytest.mark.parametrize(
    ("op", "constant", "constant_first", "kept"),
    [
        ("Add", 0.0, False, False),
        ("Add", 0.0, True, False),
        ("Add", 1e-8, False, True),
        ("Add", 1e-8, True, True),
        ("Sub", 0.0, False, False),
        ("Sub", 1e-8, False, True),
        ("Mul", 1.0, False, False),
        ("Mul", 1.0, True, False),
        ("Mul", NEXT_AFTER_ONE, False, True),
        ("Div", 1.0, False, False),
        ("Div", NEXT_AFTER_ONE, False, True),
    ],
)
def test_a_no_op_goes_only_when_its_constant_is_exact(op, constant, constant_first, kept):
    model = optimize(_binary(op, constant, constant_first))
    assert (op in _ops(model)) == kept, f"{op} by {constant!r}: {_ops(model)}"


def test_onnxscripts_own_rules_take_1e_8_for_0():
    """Why the module exists: the optimizer torch.onnx.export runs drops x + 1e-8 (when it no longer does, drop the module)."""
    model = onnxscript.optimizer.optimize(_binary("Add", 1e-8))
    assert "Add" not in _ops(model)


class _HeliumNorm(torch.nn.Module):
    """Helium's RMSNorm: x * rsqrt(mean(x^2) + 1e-8) * weight."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.linspace(0.5, 1.5, 8))

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-8))


def test_an_epsilon_of_1e_8_fuses_into_rms_normalization_and_a_zero_row_stays_zero():
    import onnxruntime as ort

    program = torch.onnx.export(_HeliumNorm().eval(), (torch.randn(2, 8),), dynamo=True, opset_version=23, optimize=False, verbose=False)
    model = optimize(program.model)
    norms = [node for node in model.graph if node.op_type == "RMSNormalization"]
    assert len(norms) == 1 and norms[0].attributes["epsilon"].as_float() == pytest.approx(1e-8, rel=1e-6), _ops(model)
    session = ort.InferenceSession(ir.serde.serialize_model(model).SerializeToString(), providers=["CPUExecutionProvider"])
    x = np.zeros((2, 8), np.float32)
    x[1] = np.arange(8)
    (y,) = session.run(None, {model.graph.inputs[0].name: x})
    np.testing.assert_allclose(y, _HeliumNorm()(torch.from_numpy(x)).detach().numpy(), rtol=1e-6, atol=0)
    assert not y[0].any()  # torch's own optimizer: 0 / sqrt(0) = NaN


def _graphs(model, tmp_path, monkeypatch, torch_optimizer: bool) -> list[bytes]:
    """The step and heads graphs as the exporter writes them, or with ``torch.onnx.export``'s own optimizer."""
    with monkeypatch.context() as patch:
        if torch_optimizer:
            export = torch.onnx.export
            patch.setattr(torch.onnx, "export", lambda *args, **kwargs: export(*args, **{**kwargs, "optimize": True}))
            patch.setattr(onnx_export, "_optimized", lambda program: program)
        config = onnx_export._fit_to_model(model, onnx_export.ExportConfig(out=tmp_path / "model.onnx", max_context=64))
        tree = load_tree(default_tree(model.num_heads), max_depth=model.num_heads)
        programs = [onnx_export._export_step(model, config), onnx_export._export_heads(model, tree, config)]
    protos = [ir.serde.serialize_model(program.model) for program in programs]
    for proto in protos:  # torch's note of the traced node behind each output, written after its optimizer ran
        for output in proto.graph.output:
            output.ClearField("metadata_props")
    return [proto.SerializeToString() for proto in protos]


@pytest.mark.skipif(not STORIES.is_file(), reason=f"{STORIES} missing")
def test_graphs_without_a_near_no_op_are_the_ones_torchs_optimizer_writes(stories_base, tmp_path, monkeypatch):
    """Same nodes, names, attributes and weights (RMSNormalization, RotaryEmbedding included): the rule list is onnxscript's.
    A failure after an onnxscript upgrade means its default rules or passes changed: update onnx_optimize.DEFAULT_RULES."""
    model = medusa_model(stories_base, random_heads(stories_base, num_heads=2)).eval()
    ours = _graphs(model, tmp_path, monkeypatch, torch_optimizer=False)
    theirs = _graphs(model, tmp_path, monkeypatch, torch_optimizer=True)
    assert ours[0] == theirs[0], "the step graph differs from torch.onnx.export(optimize=True)'s"
    assert ours[1] == theirs[1], "the heads graph differs from torch.onnx.export(optimize=True)'s"
