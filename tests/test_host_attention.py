"""The host tree-attention kernel: the reference's numbers, and a verify step equal to plain steps bit for bit."""

import numpy as np
import pytest
import torch

from medusa_trt.plugins.tree_attention.reference import tree_attention, visibility_bias
from medusa_trt.runtime.host_attention import HostAttention, Shapes

HQ, HKV, LAYERS = 6, 2, 3
DIMS = (24, 64)  # a head dimension off the kernel's lanes (its generic path) and one it keeps in registers


@pytest.fixture(scope="module")
def kernel():
    return HostAttention()  # the native library, built with the package


def tree_mask(parents: list[int]) -> np.ndarray:
    """(T, T) bool: node i sees itself and its ancestors; parents[i] < i, -1 for the root."""
    t = len(parents)
    mask = np.eye(t, dtype=bool)
    for i, p in enumerate(parents):
        while p >= 0:
            mask[i, p] = True
            p = parents[p]
    return mask


def run(kernel, cache_k, cache_v, layer, q, k, v, mask, lengths):
    """One layer: cache (S, layers, B, Hkv, D); q (B, Hq, T, D); k, v (B, Hkv, T, D) -> (B, T, Hq * D)."""
    b, _, t, D = q.shape  # noqa: N806
    out = np.zeros((b, t, HQ * D), dtype=np.float32)
    q, k, v = (np.ascontiguousarray(x, dtype=np.float32) for x in (q, k, v))
    shapes = Shapes(HQ, HKV, D, D**-0.5)
    kernel(shapes, q.ctypes.data, k.ctypes.data, v.ctypes.data, cache_k[:, layer], cache_v[:, layer],
           np.ascontiguousarray(mask, dtype=np.uint8), np.asarray(lengths, dtype=np.int64), out.ctypes.data, b, t)  # fmt: skip
    return out


@pytest.mark.parametrize("D", DIMS)
def test_matches_the_reference(kernel, D):  # noqa: N803
    rng = np.random.default_rng(0)
    lengths = np.array([37, 5])
    s, t = 40, 4
    cache_k, cache_v = (rng.standard_normal((s, LAYERS, 2, HKV, D), dtype=np.float32) for _ in range(2))
    q = rng.standard_normal((2, HQ, t, D), dtype=np.float32)
    k, v = (rng.standard_normal((2, HKV, t, D), dtype=np.float32) for _ in range(2))
    mask = np.stack([tree_mask([-1, 0, 0, 1]), tree_mask([-1, 0, 1, 2])])
    got = run(kernel, cache_k, cache_v, 1, q, k, v, mask, lengths)
    past = lambda c: torch.from_numpy(np.ascontiguousarray(c[:, 1].transpose(1, 2, 0, 3)))  # noqa: E731 (B, Hkv, S, D)
    bias = visibility_bias(torch.from_numpy(lengths), torch.from_numpy(mask), s, torch.float32)
    want = tree_attention(torch.from_numpy(q), torch.from_numpy(k), torch.from_numpy(v), past(cache_k), past(cache_v), bias, D**-0.5)
    want = want.transpose(1, 2).reshape(2, t, HQ * D).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("D", DIMS)
@pytest.mark.parametrize("length", [0, 9, 300])
def test_a_verify_step_is_plain_steps_bit_for_bit(kernel, length, D):  # noqa: N803
    """Each node of a tree scored in one step equals the node scored alone after its ancestors were
    committed (the cache's next slots), in every row of a batch whose rows differ."""
    rng = np.random.default_rng(length)
    parents = [-1, 0, 0, 1, 1, 2, 3, 0, 6]
    t, b = len(parents), 2
    lengths = np.array([length, length // 2])
    s = length + t
    cache_k, cache_v = (rng.standard_normal((s, LAYERS, b, HKV, D), dtype=np.float32) for _ in range(2))
    q = rng.standard_normal((b, HQ, t, D), dtype=np.float32)
    k, v = (rng.standard_normal((b, HKV, t, D), dtype=np.float32) for _ in range(2))
    mask = np.broadcast_to(tree_mask(parents), (b, t, t)).copy()
    verify = run(kernel, cache_k, cache_v, 2, q, k, v, mask, lengths)
    for i in range(t):
        path = [i]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        ancestors = path[:0:-1]  # root first, i excluded
        ck, cv = cache_k.copy(), cache_v.copy()
        for row in range(b):
            for depth, node in enumerate(ancestors):  # committed where plain decoding puts them
                ck[lengths[row] + depth, 2, row] = k[row, :, node]
                cv[lengths[row] + depth, 2, row] = v[row, :, node]
        plain = run(kernel, ck, cv, 2, q[:, :, i : i + 1], k[:, :, i : i + 1], v[:, :, i : i + 1], np.ones((b, 1, 1), bool),
                    lengths + len(ancestors))  # fmt: skip
        assert np.array_equal(plain[:, 0], verify[:, i]), f"node {i} differs from its plain step"


def test_rejects_a_cache_without_contiguous_heads(kernel):
    D = DIMS[0]  # noqa: N806
    cache = np.zeros((4, LAYERS, 1, D, HKV), dtype=np.float32).transpose(0, 1, 2, 4, 3)  # (S, L, B, Hkv, D), heads strided
    x = np.zeros((1, HQ, 1, D), dtype=np.float32)
    with pytest.raises(ValueError, match="contiguous heads"):
        kernel(Shapes(HQ, HKV, D, 1.0), x.ctypes.data, x.ctypes.data, x.ctypes.data, cache[:, 0], cache[:, 0],
               np.ones((1, 1, 1), np.uint8), np.array([2]), x.ctypes.data, 1, 1)  # fmt: skip
