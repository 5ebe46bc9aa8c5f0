"""Device-resident ONNX Runtime buffers (runtime/backends/ort_buffers.py).

``DeviceBuffers`` keeps the KV cache and the float outputs in ``OrtValue`` s and runs the commit,
the row gathers and the relayout as tiny ONNX graphs on the device. Here it runs on the CPU
provider (device "cpu", the same code path as CUDA) and must match the numpy ``HostBuffers``
exactly: every step output, the cache after commits and a relayout, the heads' proposals, and the
tokens of greedy, sampled and continuous-batching runs. The CUDA tests need onnxruntime-gpu and a
GPU; elsewhere they skip and say why.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
from conftest import CUSTOM_TREE, STORY_PROMPTS, medusa_model

from medusa_trt.runtime import MedusaRuntime
from medusa_trt.runtime.backends.onnx_backend import OnnxBackend
from medusa_trt.runtime.backends.ort_buffers import FLOAT, FLOAT16, OP_GRAPHS, DeviceBuffers, HostBuffers
from medusa_trt.runtime.engine import EngineError
from medusa_trt.runtime.tree import compile_tree

ort = pytest.importorskip("onnxruntime")

CUDA_MISSING = (
    None
    if "CUDAExecutionProvider" in ort.get_available_providers()
    else f"onnxruntime {ort.__version__} has no CUDAExecutionProvider (providers {ort.get_available_providers()}): "
    "install medusa-trt[gpu] (onnxruntime-gpu) on a machine with an NVIDIA GPU"
)
needs_cuda = pytest.mark.skipif(CUDA_MISSING is not None, reason=CUDA_MISSING or "")


@pytest.fixture(scope="module")
def engine(export_engine, stories_base, stories_fitted):
    return export_engine("stories-fitted", medusa_model(stories_base, stories_fitted))  # shared with other modules


def _host(cache) -> np.ndarray:
    return cache if isinstance(cache, np.ndarray) else cache.numpy()


def test_op_graphs_are_valid_onnx():
    onnx = pytest.importorskip("onnx")
    for name, graph in OP_GRAPHS.items():
        for elem in (FLOAT, FLOAT16):
            model = onnx.load_from_string(graph(elem))
            onnx.checker.check_model(model, full_check=True)
            assert model.opset_import[0].version == 17, name


def test_buffer_kind_follows_the_provider(engine):
    assert isinstance(OnnxBackend(engine).buffers, HostBuffers)  # CPU provider
    device = OnnxBackend(engine, buffers="device").buffers
    assert isinstance(device, DeviceBuffers) and device.key.device_name().lower() == "cpu"
    with pytest.raises(EngineError, match="buffers 'gpu' is not one of auto, host, device"):
        OnnxBackend(engine, buffers="gpu")


def test_device_buffers_match_host_buffers_step_by_step(engine):
    """Prefill two ragged rows, commit, a tree step, commit accepted nodes, heads, then move the
    rows to a 3-row layout: every output and the whole cache agree exactly."""
    host, device = OnnxBackend(engine, buffers="host"), OnnxBackend(engine, buffers="device")
    tree = compile_tree(CUSTOM_TREE)
    gen = np.random.default_rng(0)
    width, counts = 6, np.array([6, 3])
    ids = gen.integers(0, host.meta.vocab_size, size=(2, width))
    positions = np.broadcast_to(np.arange(width), (2, width))
    chain = np.broadcast_to(np.tril(np.ones((width, width), dtype=bool)), (2, width, width))
    lengths = np.zeros(2, dtype=np.int64)

    def both(method, *args):
        return getattr(host, method)(*args), getattr(device, method)(*args)

    def after(outs, method, *args):  # commit / propose: each backend with the output of its own step
        return tuple(getattr(b, method)(out, *args) for b, out in zip((host, device), outs))

    def same_step(a, b):
        assert (a.argmax == b.argmax).all() and (a.topk == b.topk).all()
        assert np.array_equal(a.logits(), b.logits())
        rows, nodes = np.array([1, 0, 1]), np.array([2, 0, 1])
        assert np.array_equal(a.logits_rows(rows, nodes), b.logits_rows(rows, nodes))
        assert np.array_equal(a.hidden_rows(rows, nodes), b.hidden_rows(rows, nodes)) and b.hidden_rows(rows, nodes).dtype == np.float32

    outs = both("step", ids, positions, chain, lengths)
    same_step(*outs)
    after(outs, "commit", np.broadcast_to(np.arange(width), (2, width)), counts, lengths)
    lengths = counts.copy()
    t = tree.num_nodes
    tree_ids = gen.integers(0, host.meta.vocab_size, size=(2, t))
    tree_pos = lengths[:, None] + tree.depth[None, :]
    tree_mask = np.broadcast_to(tree.mask, (2, t, t))
    outs = both("step", tree_ids, tree_pos, tree_mask, lengths)
    same_step(*outs)
    accepted, taken = np.array([[0, 1, 3], [0, 2, 0]]), np.array([3, 2])  # row 1 takes 2 of its 3 listed nodes
    after(outs, "commit", accepted, taken, lengths)
    lengths = lengths + taken
    slots = int(lengths.max())
    assert np.array_equal(_host(host._key)[: slots * 2 * host.kv_row], _host(device._key)[: slots * 2 * host.kv_row])
    a, b = after(outs, "propose", np.array([3, 2]), tree.top_k, np.array([5, 7]))
    assert (a.ids == b.ids).all() and a.ids.shape == (2, host.meta.num_heads, tree.top_k)
    assert np.array_equal(a.logits(), b.logits())
    both("relayout", np.array([1, 0]), 2, 3, slots)  # swap the rows and grow to 3
    for h, d in ((host.buffers.key, device.buffers.key), (host.buffers.value, device.buffers.value)):
        shape = host.buffers.sizes.cache_shape(3, slots)
        h, d = _host(h)[: np.prod(shape)].reshape(shape), _host(d)[: np.prod(shape)].reshape(shape)
        assert np.array_equal(h[:, :, :2], d[:, :, :2])  # row 2 is free: its contents are never read
    moved = np.array([lengths[1], lengths[0], 0])  # row 2 starts empty
    same_step(*both("step", tree_ids[[1, 0, 0]], tree_pos[[1, 0, 0]], np.broadcast_to(tree.mask, (3, t, t)), moved))


# A fixed drafting budget: the learnt one follows measured step times, so two runs could draft
# other trees (same tokens, hidden states off by float noise from the other tree shapes).
FIXED = dict(tree=CUSTOM_TREE, max_batch=4, step_cost={1: 1.0, 64: 1.5})


@pytest.fixture(scope="module")
def runtimes(engine):
    host = MedusaRuntime(engine, **FIXED)
    device = MedusaRuntime(engine, **FIXED)
    device.backend = OnnxBackend(engine, max_batch=4, buffers="device")
    return host, device


def test_tokens_match_greedy_sampled_and_hidden(runtimes):
    host, device = runtimes
    for kwargs in ({}, {"temperature": 0.8, "top_p": 0.9, "seed": 3}, {"hidden": True}):
        want = host.generate(STORY_PROMPTS, max_new_tokens=24, **kwargs)
        got = device.generate(STORY_PROMPTS, max_new_tokens=24, **kwargs)
        assert [r.token_ids for r in got] == [r.token_ids for r in want], kwargs
        if kwargs.get("hidden"):
            assert all(np.array_equal(np.asarray(g.hidden), np.asarray(w.hidden)) for g, w in zip(got, want))
    assert sum(r.stats.steps for r in got) < sum(len(r.token_ids) for r in got)  # drafts were accepted: multi-node commits


def test_next_token_aware_heads_match(export_engine, stories_base, stories_next_aware):
    """Heads that also read the next token (root_ids bound beside the device-gathered hidden state)."""
    engine = export_engine("stories-next-aware", medusa_model(stories_base, stories_next_aware))  # shared with test_onnx_export
    host, device = MedusaRuntime(engine, **FIXED), MedusaRuntime(engine, **FIXED)
    device.backend = OnnxBackend(engine, max_batch=4, buffers="device")
    assert device.backend.meta.head_input == "hidden+next"
    want = host.generate(STORY_PROMPTS, max_new_tokens=24)
    assert [r.token_ids for r in device.generate(STORY_PROMPTS, max_new_tokens=24)] == [r.token_ids for r in want]


def test_continuous_batching_relayout_matches(runtimes, monkeypatch):
    """Requests of different lengths over 4 rows: rows free up and refill, the cache is re-laid out."""
    from medusa_trt.runtime.batching import ContinuousBatcher, Request

    buffers, moves = runtimes[1].backend.buffers, []
    relayout = buffers.relayout
    monkeypatch.setattr(buffers, "relayout", lambda *args: (moves.append(args[1:]), relayout(*args)))

    prompts = STORY_PROMPTS + ["Sam saw a frog", "The sky was blue and"]
    lengths = [30, 5, 18, 26, 9, 34]
    outputs = []
    for runtime in runtimes:
        batcher = ContinuousBatcher(runtime).start()
        results = {}

        def client(i, batcher=batcher, results=results):
            results[i] = batcher.submit(Request(prompts[i], max_new_tokens=lengths[i], chat_template=False)).result().token_ids

        threads = [threading.Thread(target=client, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        batcher.close()
        outputs.append([results[i] for i in range(len(prompts))])
    assert outputs[0] == outputs[1]
    assert moves, "no relayout happened: the test lost its point"


# ----------------------------------------------------------------------------- CUDA (onnxruntime-gpu)


@needs_cuda
@pytest.mark.gpu
def test_cuda_buffers_stay_on_the_device_and_match_the_cpu(engine):
    cpu = MedusaRuntime(engine, **FIXED)
    cpu.backend = OnnxBackend(engine, max_batch=4, providers=["CPUExecutionProvider"])
    cuda = MedusaRuntime(engine, **FIXED)
    cuda.backend = OnnxBackend(engine, max_batch=4, providers=["CUDAExecutionProvider", "CPUExecutionProvider"])
    buffers = cuda.backend.buffers
    assert isinstance(buffers, DeviceBuffers) and buffers.key.device_name().lower() == "cuda"
    before = (buffers.key.data_ptr(), buffers.value.data_ptr(), buffers.out["logits"].data_ptr())
    got = cuda.generate(STORY_PROMPTS, max_new_tokens=24)
    want = cpu.generate(STORY_PROMPTS, max_new_tokens=24)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]  # fp32 stories: CUDA and CPU kernels agree on the argmax
    assert (buffers.key.data_ptr(), buffers.value.data_ptr(), buffers.out["logits"].data_ptr()) == before  # allocated once


@needs_cuda
@pytest.mark.gpu
def test_cuda_device_ops_match_numpy():
    """The commit and the gathers on CUDA against numpy on the same random buffers."""
    from medusa_trt.runtime.backends.ort_buffers import DeviceOps

    gen = np.random.default_rng(0)
    cache = gen.standard_normal((8, 2, 3, 2, 4)).astype(np.float32)  # (S, L, B, Hkv, D)
    new = gen.standard_normal((5, 2, 3, 2, 4)).astype(np.float32)  # (T, L, B, Hkv, D)
    ops = DeviceOps("cuda", 0)
    key, value = (ort.OrtValue.ortvalue_from_numpy(cache.copy(), "cuda", 0) for _ in range(2))
    nk, nv = (ort.OrtValue.ortvalue_from_numpy(new, "cuda", 0) for _ in range(2))
    rows, src, dst = np.array([0, 2, 2]), np.array([1, 0, 4]), np.array([3, 5, 6])
    layers = np.arange(2)[None, :]
    index = lambda slot: np.stack(np.broadcast_arrays(slot[:, None], layers, rows[:, None]), axis=-1).astype(np.int64)  # noqa: E731
    ops.commit(key, value, cache.shape, nk, nv, new.shape, index(src), index(dst), np.float32)
    want = cache.copy()
    want[dst, :, rows] = new[src, :, rows]
    assert np.array_equal(key.numpy(), want) and np.array_equal(value.numpy(), want)
    x = ort.OrtValue.ortvalue_from_numpy(new.reshape(5, 3, -1), "cuda", 0)
    pairs = np.array([[4, 0], [1, 2]], dtype=np.int64)
    assert np.array_equal(ops.gather_rows(x, (5, 3, 16), np.float32, pairs), new.reshape(5, 3, -1)[pairs[:, 0], pairs[:, 1]])
