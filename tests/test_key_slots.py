"""Key slots: a verify step is a plain step, bit for bit (batch-invariant int8).

The pure assignment first (runtime/key_slots.py), then engines: every path token's logits from one
verify step over a tree of 1, 9 or 29 nodes, at batch 1 and 4 (ragged caches), must equal the logits
the same token got from a plain one-token step at batch 1, on fp32 and per-row int8 engines, also
when the tree crosses a key block. An engine exported without key slots still runs.
"""

from __future__ import annotations

import numpy as np
import pytest

from medusa_trt.runtime import key_slots
from medusa_trt.runtime.key_slots import BLOCK, assign

LANES = 16  # the assignment's lane count under test


def _tree(nodes: int, path: int, rng) -> tuple[np.ndarray, np.ndarray]:
    """A random tree of ``nodes`` nodes in depth order holding a chain of ``path`` nodes (the plain path).

    Returns (mask (N, N) bool, path_index (path,)): path_index[d] is the path's node at depth d."""
    parents, depth, on_path = [-1], [0], [0]  # node 0: the root, on the path
    for d in range(1, path):  # the path's nodes, each below the previous one
        parents.append(on_path[-1])
        depth.append(d)
        on_path.append(len(parents) - 1)
    while len(parents) < nodes:  # fillers anywhere above the path's last depth
        p = int(rng.integers(len(parents)))
        if depth[p] + 1 >= max(path, 2) + 1:
            continue
        parents.append(p)
        depth.append(depth[p] + 1)
    order = sorted(range(nodes), key=lambda i: (depth[i], rng.random()))  # depth order, path nodes at random ranks
    where = {old: new for new, old in enumerate(order)}
    mask = np.zeros((nodes, nodes), dtype=bool)
    for new, old in enumerate(order):
        mask[new, new] = True
        p = parents[old]
        while p >= 0:
            mask[new, where[p]] = True
            p = parents[p]
    return mask, np.array([where[i] for i in on_path])


# ----------------------------------------------------------------------------- the assignment


def test_chain_and_single_token_keep_the_plain_layout():
    chain = np.tri(5, dtype=bool)[None].repeat(2, 0)
    slots, exact = assign(chain, np.array([3, 10]), 100)
    np.testing.assert_array_equal(slots, [[3, 4, 5, 6, 7], [10, 11, 12, 13, 14]])
    assert exact.all()
    slots, exact = assign(np.ones((3, 1, 1), bool), np.array([0, 7, 9]), 100)
    np.testing.assert_array_equal(slots, [[0], [7], [9]])
    assert exact.all()


@pytest.mark.parametrize("length", [0, 5, 250, 509])
def test_tree_slots_meet_the_three_conditions(length):
    rng = np.random.default_rng(length)
    for _ in range(200):
        nodes = int(rng.integers(2, 40))
        mask, _ = _tree(nodes, int(rng.integers(1, min(nodes, 6) + 1)), rng)
        slots, exact = (a[0] for a in assign(mask[None], np.array([length]), 10**6, LANES))
        depth = mask.sum(1) - 1
        assert len(set(slots.tolist())) == nodes and slots.min() >= length
        for i in range(nodes):
            ancestors = np.flatnonzero(mask[i])  # itself included, in depth order
            assert (np.diff(slots[ancestors]) > 0).all(), "ancestors must sit in increasing order"
        placed = [
            slots[i] // BLOCK == (length + depth[i]) // BLOCK and slots[i] % LANES == (length + depth[i]) % LANES for i in range(nodes)
        ]
        for i in range(nodes):  # exact: placed where plain decoding puts it, and so are its ancestors
            assert exact[i] == all(placed[j] for j in np.flatnonzero(mask[i]))
        assert exact[0] and exact[np.flatnonzero(mask[:, 0]).min()]
        if (length + nodes * LANES) // BLOCK == length // BLOCK:  # far from a block's end every node is placed exactly
            assert exact.all()


def test_a_row_past_the_limit_falls_back_to_the_appended_layout():
    mask, _ = _tree(20, 3, np.random.default_rng(0))
    slots, exact = assign(mask[None], np.array([100]), limit=121, lanes=LANES)
    np.testing.assert_array_equal(slots[0], 100 + np.arange(20))
    depth = mask.sum(1) - 1
    assert exact[0, 0] and not exact[0, depth % LANES != np.arange(20) % LANES].any()


def test_padding_takes_free_slots_and_is_never_exact():
    mask = np.eye(6, dtype=bool)
    mask[1, 0] = mask[2, 0] = mask[3, :4] = mask[3, 1] = True  # root, two children, a grandchild below node 1; 4 and 5 pad
    mask[3, 2] = False
    slots, exact = (a[0] for a in assign(mask[None], np.array([40]), 1000, LANES))
    assert slots[:4].tolist() == [40, 41, 57, 42] and exact[:4].all()
    assert slots[4:].tolist() == [43, 44] and not exact[4:].any()
    assert key_slots.slack(64) >= key_slots.SLACK_LANES * 32


def test_the_lane_probe_finds_this_machines_lanes():
    """ONNX Runtime's CPU attention lays rows out in 8 or 16 lanes (AVX2 / AVX-512) here; the engines below hold to it."""
    lanes = key_slots.probe_lanes(64, 3, threads=2)
    assert lanes in key_slots.LANES


# ----------------------------------------------------------------------------- engines


def _prompts(tokenizer, count: int, long: bool) -> list[list[int]]:
    texts = ["Once upon a time", "The little dog was sad because", "Lily and Tom went to the park. They saw a big tree and", "One day"]
    ids = [tokenizer(t)["input_ids"] for t in texts[:count]]
    if long:  # cross the first key block: the tree's keys straddle slot BLOCK
        ids = [(p * 60)[: BLOCK - 2 - i] for i, p in enumerate(ids)]
    return ids


def _prefill(backend, prompts: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Prefill right-padded prompts in chunks of the engine's max_tokens; returns (cache lengths (B,), next tokens (B,))."""
    batch, width = len(prompts), max(len(p) for p in prompts)
    ids = np.array([p + [0] * (width - len(p)) for p in prompts])
    lengths = np.array([len(p) for p in prompts])
    nxt = np.zeros(batch, dtype=np.int64)
    for start in range(0, width, backend.max_tokens):
        n = min(backend.max_tokens, width - start)
        cache = np.minimum(lengths, start)  # (B,) rows already done keep their length
        counts = np.clip(lengths - start, 0, n)  # (B,) this chunk's tokens of each row
        chain = np.tri(n, dtype=bool)[None].repeat(batch, 0)
        out = backend.step(ids[:, start : start + n], start + np.arange(n)[None].repeat(batch, 0), chain, cache)
        done = counts > 0
        nxt[done] = out.argmax[np.flatnonzero(done), counts[done] - 1]
        backend.commit(out, np.arange(n)[None].repeat(batch, 0), counts, cache)
    return lengths, nxt


def _plain(engine, prompt: list[int], steps: int) -> tuple[list[int], list[np.ndarray]]:
    """Plain decoding at batch 1: the tokens fed (first: the prefill's choice) and each step's logits."""
    from medusa_trt.runtime.backends.onnx_backend import OnnxBackend

    backend = OnnxBackend(engine, max_batch=1, threads=2)
    (length,), (token,) = _prefill(backend, [prompt])
    tokens, logits = [int(token)], []
    for j in range(steps):
        out = backend.step(np.array([[tokens[-1]]]), np.array([[length + j]]), np.ones((1, 1, 1), bool), np.array([length + j]))
        logits.append(out.logits()[0, 0].copy())
        tokens.append(int(out.argmax[0, 0]))
        backend.commit(out, np.zeros((1, 1), dtype=np.int64), np.array([1]), np.array([length + j]))
    return tokens, logits


def _verify_equals_plain(engine, prompts, nodes: int, seed: int) -> tuple[list[tuple[int, int, float]], int]:
    """(row, depth, max abs diff) of every path token whose verify-step logits differ from its plain-step
    logits although the step says they are exact, and how many path tokens the step does not call exact."""
    from medusa_trt.runtime.backends.onnx_backend import OnnxBackend

    depth = min(nodes, 5)
    reference = [_plain(engine, p, depth) for p in prompts]
    backend = OnnxBackend(engine, max_batch=len(prompts), threads=2)
    lengths, _ = _prefill(backend, prompts)
    rng = np.random.default_rng(seed)
    masks, ids, positions, paths = [], [], [], []
    for (tokens, _), length in zip(reference, lengths):
        mask, path = _tree(nodes, depth, rng)
        toks = rng.integers(0, backend.meta.vocab_size, nodes)
        toks[path] = tokens[:depth]
        masks.append(mask)
        ids.append(toks)
        positions.append(length + mask.sum(1) - 1)
        paths.append(path)
    step = backend.step(np.array(ids), np.array(positions), np.array(masks), lengths.astype(np.int64))
    out = step.logits()
    exact = step.exact if step.exact is not None else np.ones(out.shape[:2], dtype=bool)  # no claim: hold every node to it
    wrong, unclaimed = [], 0
    for b, ((_, plain), path) in enumerate(zip(reference, paths)):
        for d, node in enumerate(path):
            diff = float(np.abs(out[b, node] - plain[d]).max())
            unclaimed += not exact[b, node]
            if diff != 0.0 and exact[b, node]:
                wrong.append((b, d, diff))
    return wrong, unclaimed


@pytest.fixture(scope="module")
def engines(stories_base, tmp_path_factory):
    """stories260K (head_dim 8) fp32, int8-channel and without key slots; a random tiny Llama with
    head_dim 64, whose attention sums its P V product in blocks of 256 keys (SmolLM2's head size)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from medusa_trt.exporter import load_base_model
    from medusa_trt.exporter.onnx_export import ExportConfig, export_onnx
    from medusa_trt.exporter.wrapper import MedusaModel

    torch.manual_seed(0)
    wide = AutoModelForCausalLM.from_config(
        LlamaConfig(
            vocab_size=512,
            hidden_size=128,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=64,
            max_position_embeddings=512,
            initializer_range=0.2,
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=0,
        )
    )
    folder = tmp_path_factory.mktemp("ks-d64-model")
    wide.save_pretrained(folder)
    stories_base.tokenizer.save_pretrained(folder)
    models = {"stories": stories_base, "d64": load_base_model(folder)}
    made = {}
    for name, (model, extra) in {
        "fp32": ("stories", {}),
        "int8-channel": ("stories", {"quantize": "int8-channel"}),
        "int4": ("stories", {"quantize": "int4"}),
        "appended": ("stories", {"key_slots": False}),
        "d64": ("d64", {}),
    }.items():
        out = tmp_path_factory.mktemp(f"ks-{name}") / "model.onnx"
        export_onnx(MedusaModel(models[model], None), ExportConfig(out=out, tree="chain-0", max_batch=4, max_context=512, **extra))
        made[name] = out
    return made


@pytest.mark.parametrize("kind", ["fp32", "int8-channel", "int4"])
@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("nodes", [1, 9, 29])
def test_verify_step_logits_equal_plain_step_logits(engines, stories_base, kind, batch, nodes):
    prompts = _prompts(stories_base.tokenizer, batch, long=False)
    assert _verify_equals_plain(engines[kind], prompts, nodes, seed=nodes * 10 + batch) == ([], 0)


@pytest.mark.parametrize("kind", ["fp32", "int8-channel", "d64"])
def test_exact_across_a_key_block(engines, stories_base, kind):
    """Near the end of a key block some nodes have no exact slot: the step says which, and the rest are exact."""
    prompts = _prompts(stories_base.tokenizer, 4, long=True)
    wrong, unclaimed = _verify_equals_plain(engines[kind], prompts, 29, seed=3)
    assert wrong == [] and unclaimed < 4 * 5


def test_d64_engine_is_exact_away_from_a_block_end(engines, stories_base):
    assert _verify_equals_plain(engines["d64"], _prompts(stories_base.tokenizer, 4, long=False), 29, seed=5) == ([], 0)


def test_engines_without_key_slots_still_run(engines, stories_base):
    """The appended layout (engines exported before key slots): same tokens, logits to float rounding."""
    from medusa_trt.runtime.engine import EngineFiles, read_meta

    assert read_meta(EngineFiles.locate(engines["appended"]).onnx.step).key_slots is False
    assert read_meta(EngineFiles.locate(engines["fp32"]).onnx.step).key_slots is True
    prompts = _prompts(stories_base.tokenizer, 2, long=False)
    wrong, unclaimed = _verify_equals_plain(engines["appended"], prompts, 9, seed=1)
    assert unclaimed == 0 and all(diff < 1e-4 for _, _, diff in wrong)
