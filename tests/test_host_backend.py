"""The composed host backend (runtime/backends/host_backend.py) over a fake kernel and fake heads on named arrays.

What the backend hands its kernel is checked by value: the key slots of a tree worked out by hand, the bound cache
rounded up to whole key blocks, outputs left unbound on a gated step, the heads' input gathered at the chosen nodes.
The real kernels (native C, OpenVINO) are held to ONNX Runtime and transformers in their own tests.
"""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest

from medusa_trt.runtime.backends.host_backend import HostBackend, cache_slots
from medusa_trt.runtime.backends.ort_buffers import BufferSizes, HostBuffers
from medusa_trt.runtime.contract import (
    HEAD_LOGITS,
    HEAD_TOPK,
    HIDDEN,
    INPUT_IDS,
    KEY_SLOTS_INPUT,
    LOGITS,
    NEXT_IDS,
    NEXT_INPUT,
    PAST_KEY,
    PAST_VALUE,
    POSITION_IDS,
)
from medusa_trt.runtime.engine import FORMAT_VERSION, EngineError, EngineFiles, EngineMeta
from medusa_trt.runtime.exactness import Exactness

META = EngineMeta(
    format_version=FORMAT_VERSION,
    model="fake",
    architecture="llama",
    dtype="fp32",
    vocab_size=50,
    hidden_size=6,
    num_layers=2,
    num_kv_heads=1,
    head_dim=4,
    num_heads=2,
    top_k=3,
    tree=[[0], [1]],
    tree_name="fake",
    max_batch=2,
    max_context=100,
    max_tokens=8,
    eos_token_ids=[2],
    is_chat=False,
    head_input="hidden+next",
    key_slots=True,
)


class FakeKernel:
    """Records what each call is handed; writes hidden = position, next ids = input ids + 1."""

    def __init__(self, exact: bool | None):
        self.exact = exact
        self.calls: list[dict[str, np.ndarray]] = []

    def __call__(self, arrays: dict[str, np.ndarray]) -> None:
        self.calls.append({name: a.copy() for name, a in arrays.items()} | {"bound": set(arrays)})
        arrays[HIDDEN][:] = arrays[POSITION_IDS][..., None]  # (B, T, H)
        if NEXT_IDS in arrays:
            arrays[NEXT_IDS][:] = arrays[INPUT_IDS] + 1

    def describe(self) -> str:
        return "fake"


class FakeHeads:
    """head_topk[b, i, j] = root + 10 * (i + 1) + j; head_logits = the hidden state's first value."""

    confidence = False

    def __init__(self):
        self.calls: list[dict[str, np.ndarray]] = []

    def __call__(self, arrays: dict[str, np.ndarray]) -> None:
        self.calls.append({name: a.copy() for name, a in arrays.items()})
        _, n, k = arrays[HEAD_TOPK].shape
        arrays[HEAD_TOPK][:] = arrays[NEXT_INPUT][:, None, None] + 10 * np.arange(1, n + 1)[None, :, None] + np.arange(k)
        arrays[HEAD_LOGITS][:] = arrays[HIDDEN][:, :1, None]


def backend(*, key_slots: bool, key_block: int = 1, gated: bool = True, exact: bool | None = None) -> HostBackend:
    slots = cache_slots(META.max_context, META.max_tokens, key_slots=key_slots, key_block=key_block)
    sizes = BufferSizes.of(META, max_batch=2, max_context=slots, dtype=np.float32, successors=0)
    files = EngineFiles.beside(Path("fake/model.onnx"))
    kernel = FakeKernel(exact)
    return HostBackend(
        "fake",
        files,
        META,
        kernel,
        HostBuffers(sizes),
        FakeHeads(),
        max_batch=2,
        max_context=META.max_context,
        key_slots=key_slots,
        key_block=key_block,
        gated=gated,
    )


def _tree_step(b: HostBackend, length: int):
    """Root, its child and the child's sibling at cache length ``length`` (batch 1)."""
    mask = np.array([[[1, 0, 0], [1, 1, 0], [1, 0, 1]]], dtype=bool)  # (1, 3, 3)
    positions = (length + np.array([0, 1, 1]))[None]  # (1, 3)
    return b.step(np.array([[7, 8, 9]]), positions, mask, np.array([length]))


def test_cache_slots_hold_the_slack_in_whole_key_blocks():
    assert cache_slots(100, 8) == 100
    assert cache_slots(100, 8, key_slots=True) == 100 + 16 * 8  # key_slots.slack: 16 lanes a node
    assert cache_slots(100, 8, key_slots=True, key_block=64) == 256


def test_key_slots_are_passed_and_the_bound_cache_padded_to_whole_blocks():
    """At cache length 70 and 8 lanes: the root at 70, its child at 71, the sibling at 79 (the next slot of its
    position's lane, 71 being taken); every node placed as plain decoding places it, so each claims exactness. The
    bound key axis holds slot 79: 80 slots, rounded up to 128."""
    b = backend(key_slots=True, key_block=64, gated=False)
    b.key_lanes = 8
    out = _tree_step(b, 70)
    got = b.kernel.calls[-1]
    assert got[KEY_SLOTS_INPUT].tolist() == [[70, 71, 79]] and got[KEY_SLOTS_INPUT].dtype == np.int64
    assert got[PAST_KEY].shape == got[PAST_VALUE].shape == (128, 2, 1, 1, 4)  # (S, L, B, Hkv, D)
    assert out.exact.tolist() == [[True, True, True]]
    assert out.argmax.tolist() == [[8, 9, 10]]


def test_key_slots_without_measured_lanes_append_and_claim_nothing():
    b = backend(key_slots=True, key_block=64)
    out = _tree_step(b, 70)
    got = b.kernel.calls[-1]
    assert got[KEY_SLOTS_INPUT].tolist() == [[70, 71, 72]]  # the appended layout
    assert got[PAST_KEY].shape[0] == 128 and out.exact is None
    assert b.exact is None  # nothing probed
    b.exactness = Exactness(True, 0.0, 6)
    assert b.exact is True


def test_a_chain_from_an_empty_cache_binds_one_block():
    b = backend(key_slots=True, key_block=64)
    b.key_lanes = 16
    b.step(np.array([[1, 2, 3]]), np.arange(3)[None], np.tri(3, dtype=bool)[None], np.array([0]))
    got = b.kernel.calls[-1]
    assert got[KEY_SLOTS_INPUT].tolist() == [[0, 1, 2]] and got[PAST_KEY].shape[0] == 64


def test_without_key_slots_the_cache_is_bound_as_long_as_the_rows_and_an_exact_kernel_claims_every_node():
    """Native's path: no key-slot input, the bound cache exactly the longest row, every node exact when the logits
    are computed; a gated step leaves the lm_head's outputs unbound and claims nothing."""
    b = backend(key_slots=False, exact=True)
    assert b.slots == META.max_context and b.exact is True
    out = b.step(np.array([[4, 5], [6, 7]]), np.array([[37, 38], [12, 13]]), np.tri(2, dtype=bool)[None].repeat(2, 0), np.array([37, 12]))
    got = b.kernel.calls[-1]
    assert KEY_SLOTS_INPUT not in got["bound"] and got[PAST_KEY].shape == (37, 2, 2, 1, 4)
    assert out.exact.tolist() == [[True, True], [True, True]]
    bare = b.step(np.array([[4]]), np.array([[37]]), np.ones((1, 1, 1), bool), np.array([37]), logits=False)
    assert LOGITS not in b.kernel.calls[-1]["bound"] and bare.exact is None


def test_an_ungated_kernel_gets_its_logits_bound_when_none_are_asked():
    b = backend(key_slots=False, gated=False)
    b.step(np.array([[4]]), np.array([[3]]), np.ones((1, 1, 1), bool), np.array([3]), logits=False)
    assert {LOGITS, NEXT_IDS} <= b.kernel.calls[-1]["bound"]


def test_propose_calls_the_heads_on_the_hidden_states_at_the_nodes():
    b = backend(key_slots=False)
    out = b.step(
        np.array([[1, 2, 3], [4, 5, 6]]),
        np.array([[10, 11, 12], [20, 21, 22]]),
        np.tri(3, dtype=bool)[None].repeat(2, 0),
        np.array([10, 20]),
    )
    proposals = b.propose(out, np.array([2, 0]), 2, roots=np.array([5, 9]))
    got = b.heads.calls[-1]
    assert got[HIDDEN][:, 0].tolist() == [12.0, 20.0] and got[NEXT_INPUT].tolist() == [5, 9]  # (B, H) at nodes 2 and 0
    assert proposals.ids.tolist() == [[[15, 16], [25, 26]], [[19, 20], [29, 30]]]  # (B, n, 2)
    assert proposals.logits()[:, 0, 0].tolist() == [12.0, 20.0]
    outside = b.run_heads(np.full((3, META.hidden_size), 4.0, np.float32), np.array([1, 2, 3]))  # its own arrays
    assert outside[HEAD_TOPK].shape == (3, 2, 3) and outside[HEAD_TOPK][:, 0, 0].tolist() == [11, 12, 13]
    assert proposals.ids.tolist() == [[[15, 16], [25, 26]], [[19, 20], [29, 30]]]  # the loop's buffers untouched
    with pytest.raises(EngineError, match="pass roots to propose"):
        b.propose(out, np.array([0, 0]), 2)
    with pytest.raises(EngineError, match="heads return top-3"):
        b.propose(out, np.array([0, 0]), 4, roots=np.array([5, 9]))


def test_no_module_imports_a_backends_private_names():
    """Backends share what they share through public names (host_backend, ort_buffers, common), not each other's
    internals, and so does the rest of the runtime: no ``from medusa_trt.runtime.backends.x import _y`` and no ``x._y``
    on an imported backend module."""
    folder = Path(__file__).resolve().parents[1] / "runtime"
    found = []
    for path in sorted(folder.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        modules = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("medusa_trt.runtime.backends"):
                found += [f"{path.relative_to(folder)}: {node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
                if node.module == "medusa_trt.runtime.backends":  # from the package: a module imported by name
                    modules |= {a.asname or a.name for a in node.names}
            elif isinstance(node, ast.Import):
                modules |= {a.asname or a.name for a in node.names if a.name.startswith("medusa_trt.runtime.backends")}
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and ast.unparse(node.value) in modules:
                found.append(f"{path.relative_to(folder)}: {ast.unparse(node)}")
    assert not found, found
