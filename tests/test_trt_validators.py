"""The TensorRT plugin against NVIDIA's own ``tensorrt.plugin``: its decorators, validators and AOT call convention.

``tensorrt_stand_in`` loads the real package from the ``tensorrt-cu12-bindings`` wheel over a recording stand-in for
the compiled core (``tests/tensorrt_stand_in.py``). What runs here, without TensorRT's libraries or a GPU:

* ``trt_plugin.py`` registers through ``trtp.register`` / ``trtp.autotune`` / ``trtp.aot_impl`` and passes their
  validators (``_validate.py``); the creator TensorRT's registry would hold is found by the exact lookup triple
  the exporter writes on the ONNX node (op_type, plugin_version, plugin_namespace), with one field per attribute;
* the AOT plugin answers the builder's calls in order (output types and shapes, type/format combinations,
  launch parameters, kernel), NVIDIA's code calling ``aot_impl`` positionally with the tactic last; its kernel
  compiles to PTX of the version each target needs (sm_80, sm_90, sm_100, sm_120), fits the shared memory a
  launch gets without opting in, assembles with ``ptxas`` for that target, and its symbolic grid and scalar
  arguments evaluate to what the Python launcher computes for the same shapes;
* a ``tensorrt.plugin`` without AOT support, or a TensorRT older than AOT plugins, is refused in one line.

What only a GPU shows: that TensorRT's builder accepts the kernel, and the engine's tokens (tests/test_tensorrt.py).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import tensorrt_stand_in as stand_in

pytestmark = pytest.mark.skipif(stand_in.MISSING is not None, reason=stand_in.MISSING or "")

onnx = pytest.importorskip("onnx")

from medusa_trt.exporter.tensorrt_build import prepare_for_tensorrt
from medusa_trt.plugins.tree_attention import aot
from medusa_trt.plugins.tree_attention.errors import TensorRTUnavailableError
from medusa_trt.plugins.tree_attention.launch import launch_grid, plan_launch
from medusa_trt.plugins.tree_attention.spec import TREE_ATTENTION as SPEC

ATTRIBUTES = dict(layer=1, scale=0.125, window=0, softcap=0.0)
FIELDS = [("layer", "INT64"), ("scale", "FLOAT64"), ("window", "INT64"), ("softcap", "FLOAT64")]
TARGETS = (80, 90, 100, 120)  # Ampere, Hopper, Blackwell datacenter, Blackwell consumer
# (float type, Hq, Hkv, D, attributes): stories260K's heads, SmolLM2's with a window and soft-capping (Gemma-2
# style), and head size 128 in fp32 (the largest tiles: the shared-memory case)
CASES = (
    ("FLOAT", 8, 4, 8, dict(layer=0, scale=0.35, window=0, softcap=0.0)),
    ("BF16", 9, 3, 64, dict(layer=2, scale=0.125, window=6, softcap=30.0)),
    ("FLOAT", 32, 8, 128, dict(layer=1, scale=0.088, window=0, softcap=0.0)),
)
LAYERS = 3
SIZES = dict(B=2, T=13, S=40)


def _node_lookup(**attributes) -> tuple[tuple[str, str, str], dict]:
    """The lookup triple and attributes of a spec node as ``prepare_for_tensorrt`` hands it to TensorRT's parser."""
    helper = onnx.helper
    node = helper.make_node(SPEC.op_type, list(SPEC.inputs), ["out"], domain=SPEC.domain, **(ATTRIBUTES | attributes))
    model = helper.make_model(
        helper.make_graph([node], "g", [], []), opset_imports=[helper.make_opsetid("", 23), helper.make_opsetid(SPEC.domain, SPEC.version)]
    )
    prepare_for_tensorrt(model)
    attrs = {a.name: helper.get_attribute_value(a) for a in model.graph.node[0].attribute}
    version, namespace = attrs.pop("plugin_version").decode(), attrs.pop("plugin_namespace").decode()
    return (SPEC.op_type, version, namespace), attrs


def test_registration_passes_nvidias_validators():
    lookup, _ = _node_lookup()
    with stand_in.loaded() as core:
        stand_in.import_plugin()  # trtp.register, trtp.autotune and trtp.aot_impl validate as they decorate
        import tensorrt.plugin._lib as lib

        definition = lib.QDP_REGISTRY[SPEC.qualified_name]
        assert definition.aot_impl_func is not None and definition.autotune_func is not None
        assert definition.input_tensor_names == list(SPEC.inputs)
        assert list(definition.input_attrs) == list(SPEC.attributes)
        assert definition.num_outputs == len(SPEC.outputs)
        recorded = stand_in.recorded_creator(core, *lookup)
    assert recorded == dict(name=SPEC.op_type, namespace=SPEC.domain, version=lookup[1], fields=FIELDS), (
        f"TensorRT's parser looks the plugin up as {lookup}; the registry holds {recorded}"
    )


def _one_line_error(error, *fragments):
    message = str(error.value)
    assert "\n" not in message, message
    for fragment in fragments:
        assert fragment in message, message


def test_tensorrt_plugin_without_aot_support_is_one_line():
    """TensorRT 10.6-10.8's tensorrt.plugin has no AOT implementations (no KernelLaunchParams)."""
    with stand_in.loaded(aot=False), pytest.raises(TensorRTUnavailableError) as error:
        stand_in.import_plugin()
    _one_line_error(error, "10.9", "--attention onnx")


def test_tensorrt_older_than_aot_plugins_is_one_line():
    with stand_in.loaded(version="10.8.0.43"), pytest.raises(TensorRTUnavailableError) as error:
        stand_in.import_plugin()
    _one_line_error(error, "TensorRT 10.8.0.43", "10.9")


def test_tensorrt_10_plugin_api_under_strict_numpy_is_one_line():
    """tensorrt.plugin before 11.2 converts each scalar attribute with int(one-element array), which NumPy 2.4+ refuses."""
    import numpy as np

    try:
        int(np.zeros(1))
        pytest.skip("this NumPy still converts one-element arrays: TensorRT 10's tensorrt.plugin works with it")
    except TypeError:
        pass
    with stand_in.loaded(version="10.16.1.11"), pytest.raises(TensorRTUnavailableError) as error:
        stand_in.import_plugin()
    _one_line_error(error, "TensorRT 10.16.1.11", "TensorRT 11.2+")


def test_exporter_turns_plugin_failures_into_one_line(monkeypatch):
    """_register_plugin: a plugin module that cannot register (no AOT support, or a validator's ValueError)
    becomes the exporter's own error, one line."""
    import medusa_trt.exporter.tensorrt_build as build

    with stand_in.loaded(aot=False), pytest.raises(build.TensorRTUnavailableError) as error:
        build._register_plugin()
    _one_line_error(error, "10.9", "--attention onnx")

    def broken(name):
        raise ValueError("Signature of the aot_impl function '(a,\n b)' does not match")

    monkeypatch.setattr(build.importlib, "import_module", broken)
    with pytest.raises(build.TensorRTBuildError) as error:
        build._register_plugin()
    _one_line_error(error, "tensorrt.plugin refused", "does not match")


def _plan(heads):
    hq, hkv, d = heads
    return plan_launch(batch=1, num_q_heads=hq, num_kv_heads=hkv, num_new=None, head_dim=d, cache_slots=0, num_splits=1)


def _expected(heads, attributes) -> tuple[dict, list[tuple[str, int]]]:
    """Launch parameters and scalar arguments the Python launcher computes for SIZES (T dynamic: the largest row block)."""
    hq, hkv, d = heads
    b, t, s = SIZES["B"], SIZES["T"], SIZES["S"]
    plan = _plan(heads)
    grid = launch_grid(plan, batch=b, num_kv_heads=hkv, rows=t * (hq // hkv))
    scalars = aot.scalar_arguments((b, hq, t, d), (b, hkv, t, d), (s, LAYERS, b, hkv, d), layer=attributes["layer"])
    launch = dict(grid_x=grid[0], grid_y=grid[1], grid_z=grid[2], block_x=plan.num_warps * 32, block_y=1, block_z=1)
    return launch, [("INT32", v) for v in scalars]


@pytest.mark.parametrize("capability", TARGETS)
def test_aot_plugin_through_the_builders_calls(tmp_path, capability):
    from triton import knobs

    lookup, _ = _node_lookup()
    cases = [
        dict(float_type=f, heads=[hq, hkv, d], layers=LAYERS, sizes=SIZES, attributes=_node_lookup(**a)[1], lookup=list(lookup))
        for f, hq, hkv, d, a in CASES
    ]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the AOT compile needs the real compiler
    script = Path(stand_in.__file__)
    run = subprocess.run(
        [sys.executable, str(script), str(capability), json.dumps(cases)],
        env=env | {"PYTHONPATH": os.pathsep.join([str(script.parent), env.get("PYTHONPATH", "")])},
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    reports = json.loads(run.stdout.strip().splitlines()[-1])
    names = set()
    for (float_type, hq, hkv, d, attributes), report in zip(CASES, reports):
        case = f"sm_{capability} {float_type} Hq={hq} Hkv={hkv} D={d} {attributes}"
        assert report["output_types"] == [float_type], case
        assert report["output_shape"] == [SIZES["B"], hq, SIZES["T"], d], case
        want = tuple(
            [(float_type, "LINEAR")] * 5 + [("BOOL", "LINEAR"), ("INT64", "LINEAR"), (float_type, "LINEAR"), (float_type, "LINEAR")]
        )
        assert want in {tuple(map(tuple, c)) for c in report["offered"]}, case
        launch, scalars = _expected((hq, hkv, d), attributes)
        # a kernel that needed a smaller row block to fit the shared memory launches more row blocks
        rows = SIZES["T"] * (hq // hkv)
        fitted = {-(-rows // p.block_m) for p in aot.fitting_plans(_plan((hq, hkv, d)))}
        assert report["launch"]["grid_y"] in fitted, case
        assert {k: report["launch"][k] for k in launch if k != "grid_y"} == {k: v for k, v in launch.items() if k != "grid_y"}, case
        assert 0 < report["launch"]["shared_mem"] <= aot.AOT_MAX_SHARED_MEM, case
        assert [tuple(s) for s in report["scalars"]] == scalars, case
        ptx, name = report["ptx"], report["kernel_name"]
        assert f".entry {name}(" in ptx and name not in names, case  # one entry per specialisation
        names.add(name)
        version = aot.ptx_version_for(capability)
        assert f".version {version // 10}.{version % 10}" in ptx, case
        target = re.search(r"^\.target\s+(sm_\w+)", ptx, re.MULTILINE).group(1)
        assert target.startswith(f"sm_{capability}"), case
        ptx_file = tmp_path / f"{name}.ptx"
        ptx_file.write_text(ptx)
        assembled = subprocess.run(
            [knobs.nvidia.ptxas.path, f"-arch={target}", str(ptx_file), "-o", str(tmp_path / f"{name}.cubin")],
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        assert assembled.returncode == 0, f"{case}: {assembled.stderr[-3000:]}"
