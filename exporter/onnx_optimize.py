"""The optimizer ``torch.onnx.export`` runs on the graphs it writes, with exact no-op rules.

``torch.onnx.export(dynamo=True)`` hands each graph to onnxscript's optimizer: constant folding and a
set of rewrite rules (twice), clean-up passes, then the opset-23 fusions (``RMSNormalization``,
``RotaryEmbedding``) that ``exporter/lean.py`` and the native runtime read. Four of those rules remove
"no-ops" (``x + 0``, ``x - 0``, ``x * 1``, ``x / 1``) but compare the constant approximately
(``math.isclose``, abs_tol 1e-8, rel_tol 1e-5): ``x + 1e-8`` counts as ``x + 0``. That drops Helium's
RMSNorm epsilon of 1e-8, and the padding token's zero embedding then normalises to 0 * inf = NaN.

So the exporter passes ``optimize=False`` and runs :func:`optimize`: onnxscript's passes in onnxscript's
order, built from the public API of onnxscript and onnx_ir, with those four rules replaced by ones that
fire only where the constant is exactly 0 or 1. Every other rewrite is onnxscript's own, so a graph
without such a constant is the one ``optimize=True`` writes, node for node and weight for weight
(tests/test_onnx_optimize.py compares them). Only the graph outputs' ``pkg.torch.onnx.original_node_name``
notes differ: torch writes them when it names the outputs, which it does after its optimizer and before ours.

``DEFAULT_RULES`` spells out onnxscript 0.7.2's default rule set (its tuple is private): a rule a later
release renames fails at import, and one it adds is not run here until listed (the comparison test
shows the difference).
"""

from __future__ import annotations

import onnx_ir as ir
import onnx_ir.passes.common as common_passes
import onnxscript.optimizer
import onnxscript.rewriter.onnx_fusions
from onnxscript.rewriter import RewritePass, pattern
from onnxscript.rewriter.rules import common as rules

ITERATIONS = 2  # folding + rewriting rounds, as onnxscript.optimizer.optimize (it stops early once a round changes nothing)


def _exactly(value: int) -> pattern.Constant:
    """A pattern constant that matches a scalar equal to ``value``, not merely close to it."""
    return pattern.Constant(value, rel_tol=0.0, abs_tol=0.0)


def _identity(op, x, **_):
    return op.Identity(x)


EXACT_NO_OPS = (
    *pattern.RewriteRule(lambda op, x: op.Mul(x, _exactly(1)), _identity, name="ExactMulBy1").commute(),
    *pattern.RewriteRule(lambda op, x: op.Add(x, _exactly(0)), _identity, name="ExactAdd0").commute(),
    pattern.RewriteRule(lambda op, x: op.Sub(x, _exactly(0)), _identity, name="ExactSub0"),
    pattern.RewriteRule(lambda op, x: op.Div(x, _exactly(1)), _identity, name="ExactDivBy1"),
)

# onnxscript.rewriter's default rules in their order, its approximate add_0 / sub_0 / mul_by_1 / div_by_1 left out
DEFAULT_RULES = (
    *EXACT_NO_OPS,
    rules.dropout_zero_rule,
    rules.dropout_inference_rule,
    rules.two_reshapes_matmul_reshape_rule,
    rules.one_reshape_matmul_reshape_rule,
    rules.cast_constant_of_shape_rule,
    rules.cast_constant_of_shape_without_value_rule,
    rules.collapse_slice_rule,
    rules.collapse_slice2_rule,
    rules.materialize_reshape_shape_rule,
    rules.min_min_rule,
    rules.max_max_rule,
    rules.min_max_rule,
    rules.max_min_rule,
    rules.successive_clip_relu_rule,
    rules.successive_relu_clip_rule,
    rules.successive_relu_rule,
    rules.successive_clip_rule,
    rules.cast_cast_rule,
    rules.no_op_cast_rule,
    rules.no_op_expand_rule,
    rules.flatten_to_reshape_rule,
    rules.reshape_reshape_rule,
    rules.slice_split_rule,
    rules.no_op_transpose_rule,
    rules.transpose_transpose_rule,
    rules.unsqueeze_unsqueeze_rule,
    rules.squeeze_reshape_1d_rule,
    rules.no_op_dynamic_scatter_nd_rule,
    rules.no_op_static_scatter_nd_rule,
    rules.normalize_pad_format_conv_rule,
    rules.normalize_pad_format_conv_integer_rule,
    rules.fuse_pad_into_conv_rule,
    rules.fuse_pad_into_conv_integer_rule,
    rules.fuse_batchnorm_into_conv_rule,
    rules.fuse_batchnorm_into_conv_transpose_rule,
    rules.fuse_batchnorm_into_gemm_rule,
    rules.remove_optional_bias_from_conv_rule,
    rules.remove_optional_bias_from_conv_transpose_rule,
    rules.remove_optional_bias_from_qlinear_conv_rule,
    rules.remove_optional_bias_from_gemm_rule,
)


class _FoldConstants(ir.passes.InPlacePass):
    """onnxscript's constant folding with node-level shape inference, as its optimizer runs it."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        return onnxscript.optimizer.fold_constants(model, onnx_shape_inference=True)


def optimize(model: ir.Model) -> ir.Model:
    """``model`` optimized in place as ``torch.onnx.export(optimize=True)`` does, no-ops removed only when exact."""
    passes = ir.passes.Sequential(
        common_passes.InlinePass(),
        ir.passes.PassManager(
            [
                _FoldConstants(),
                RewritePass(DEFAULT_RULES),
                common_passes.RemoveUnusedNodesPass(),
                common_passes.RemoveUnusedFunctionsPass(),
                common_passes.RemoveUnusedOpsetsPass(),
            ],
            steps=ITERATIONS,
            early_stop=True,
        ),
        common_passes.RemoveUnusedNodesPass(),
        common_passes.LiftConstantsToInitializersPass(lift_all_constants=True, size_limit=0),
        common_passes.LiftSubgraphInitializersToMainGraphPass(),
        common_passes.DeduplicateInitializersPass(),
        common_passes.CommonSubexpressionEliminationPass(),
        common_passes.OutputFixPass(),
        common_passes.NameFixPass(),
    )
    passes(model)
    onnxscript.rewriter.onnx_fusions.fuse(model)  # RMSNormalization, RotaryEmbedding (opset 23 only, as torch's)
    return model
