"""Check an exported engine against the torch model it came from.

The ONNX checker first, then ONNX Runtime and torch on the same inputs: a right-padded prefill of
two prompts of different lengths (chain mask, empty cache; at most 7 tokens and never more than
the engine's tokens per step), then a tree step over the committed prefill cache, then the heads
graph. Returns the max abs difference per output.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from medusa_trt.runtime import key_slots
from medusa_trt.runtime.contract import (
    CACHE_LENGTHS,
    HEADS_INPUTS,
    HIDDEN,
    INPUT_IDS,
    KEY_SLOTS_INPUT,
    LOGITS,
    NEW_KEY,
    NEW_VALUE,
    NEXT_IDS,
    NEXT_INPUT,
    PAST_KEY,
    PAST_VALUE,
    POSITION_IDS,
    STEP_OUTPUTS,
    SUCCESSORS_OUTPUT,
    TREE_MASK,
)
from medusa_trt.runtime.drafting.sequential import expansion
from medusa_trt.runtime.engine import EngineFiles
from medusa_trt.runtime.errors import MedusaError
from medusa_trt.runtime.tree import CompiledTree

log = logging.getLogger(__name__)

PREFILL_TOKENS = 7  # the longer checked prompt; the other is 4 (right-padded, ragged)


class VerificationError(MedusaError):
    """The exported graph disagrees with the torch model beyond the tolerance."""


def _diff(a: torch.Tensor, b: np.ndarray) -> float:
    return float(np.abs(a.detach().float().cpu().numpy() - b.astype(np.float32)).max()) if b.size else 0.0


@torch.no_grad()
def verify_engine(
    model,
    files: EngineFiles,
    tree: CompiledTree,
    *,
    strict: bool,
    tolerance: float,
    loose: tuple[str, ...] = (),
    max_tokens: int = PREFILL_TOKENS,
    draft_vocab: int | None = None,
) -> dict[str, float]:
    """Max abs difference ONNX Runtime vs torch per checked output. ``strict`` fails when one
    above ``tolerance`` is not named in ``loose`` (outputs reported, not held to it).
    ``max_tokens``: the engine's new tokens per step, which bounds the checked prefill;
    ``draft_vocab``: the heads graph's logits cover the first N token ids only."""
    import onnx
    import onnxruntime as ort

    onnx.checker.check_model(str(files.step))
    session = ort.InferenceSession(str(files.step), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    spec, device = model.kv_spec, model.device
    np_dtype = np.float16 if spec.dtype == torch.float16 else np.float32
    gen = np.random.default_rng(0)

    scattered = KEY_SLOTS_INPUT in {i.name for i in session.get_inputs()}

    def run(ids, positions, mask, lengths, past_key, past_value):
        feeds = {
            INPUT_IDS: ids,
            POSITION_IDS: positions,
            TREE_MASK: mask,
            CACHE_LENGTHS: lengths,  # the step contract's order
            PAST_KEY: past_key,
            PAST_VALUE: past_value,
        }
        if scattered:  # the new keys go to slots of the view: pad it to hold them
            key_slots.add_to_feeds(feeds)
        ours = dict(zip(names, session.run(None, feeds)))
        theirs = model(*(torch.from_numpy(np.ascontiguousarray(v)).to(device) for v in feeds.values()))
        return ours, dict(zip(STEP_OUTPUTS, theirs))

    # prefill: prompts of 7 and 4 tokens (fewer when a step takes fewer), right-padded, empty cache
    width = min(PREFILL_TOKENS, max_tokens)
    counts = np.array([width, max(1, width * 4 // PREFILL_TOKENS)])
    ids = gen.integers(0, model.vocab_size, size=(2, width)).astype(np.int64)
    positions = np.broadcast_to(np.arange(width), (2, width)).astype(np.int64)
    mask = np.broadcast_to(np.tril(np.ones((width, width), dtype=bool)), (2, width, width)).copy()
    empty = np.zeros((0, spec.num_layers, 2, spec.num_kv_heads, spec.head_dim), dtype=np_dtype)
    ours, theirs = run(ids, positions, mask, np.zeros(2, dtype=np.int64), empty, empty)
    diffs = {
        "prefill logits": max(_diff(theirs[LOGITS][b, : counts[b]], ours[LOGITS][b, : counts[b]]) for b in range(2)),
        "prefill new K/V": max(_diff(theirs[NEW_KEY][: counts[b], :, b], ours[NEW_KEY][: counts[b], :, b]) for b in range(2)),
    }
    # tree step over the committed prefill (ragged: counts tokens)
    past_key = ours[NEW_KEY].copy()  # (width, layers, 2, Hkv, D); slots past a row's length are invisible
    past_value = ours[NEW_VALUE].copy()
    t = tree.num_nodes
    tree_ids = gen.integers(0, model.vocab_size, size=(2, t)).astype(np.int64)
    tree_pos = (counts[:, None] + tree.depth[None, :]).astype(np.int64)
    tree_mask = np.broadcast_to(tree.mask, (2, t, t)).copy()
    ours, theirs = run(tree_ids, tree_pos, tree_mask, counts.astype(np.int64), past_key, past_value)
    diffs["tree logits"] = _diff(theirs[LOGITS], ours[LOGITS])
    if SUCCESSORS_OUTPUT in ours:  # the top-k ids must index the k largest logits (ties may order differently)
        k = ours[SUCCESSORS_OUTPUT].shape[-1]
        picked = np.take_along_axis(ours[LOGITS], ours[SUCCESSORS_OUTPUT], axis=-1)  # (2, T, k)
        kth = -np.partition(-ours[LOGITS], k - 1, axis=-1)[..., k - 1 : k]  # (2, T, 1)
        if not (picked >= kth - 1e-6).all():
            raise VerificationError(f"{files.step.name}: {SUCCESSORS_OUTPUT} does not hold the top-{k} logits: export again")
    diffs["tree hidden"] = _diff(theirs[HIDDEN], ours[HIDDEN])
    if model.num_heads:
        diffs["head logits"] = _heads_diff(model, files, tree, ours, draft_vocab)
    worst = max(v for k, v in diffs.items() if k not in loose)
    log.info("ONNX Runtime vs torch, max abs difference: %s", ", ".join(f"{k} {v:.2e}" for k, v in diffs.items()))
    if strict and worst > tolerance:
        raise VerificationError(
            f"exported graph disagrees with torch: max abs difference {worst:.3g} > tolerance {tolerance:g} "
            f"({', '.join(f'{k} {v:.2e}' for k, v in diffs.items())}); export with --no-verify to keep it anyway"
        )
    return diffs


def _heads_diff(model, files: EngineFiles, tree: CompiledTree, ours: dict[str, np.ndarray], draft_vocab: int | None) -> float:
    """Max abs difference of the heads graph's logits against torch, at node 0 of the checked tree step ``ours``."""
    import onnxruntime as ort

    heads = ort.InferenceSession(str(files.heads), providers=["CPUExecutionProvider"])
    hidden = ours[HIDDEN][:, 0]  # (2, H)
    feeds = {HEADS_INPUTS[0]: np.ascontiguousarray(hidden)}
    roots = ours[NEXT_IDS][:, 0].astype(np.int64)  # (2,) what follows node 0: the next tree's root
    if model.head_input != "hidden":
        feeds[NEXT_INPUT] = roots
    head_topk, head_logits = heads.run(None, feeds)
    hidden_t, roots_t = torch.from_numpy(hidden).to(model.device), torch.from_numpy(roots).to(model.device)
    if model.head_input == "hidden+path":  # the graph expands the tree over the draft vocabulary
        theirs = model.heads.expand(hidden_t, roots_t, expansion(tree.paths), tree.top_k, model.heads.projector(draft_vocab))
    else:
        theirs = model.propose(hidden_t, roots_t)  # (2, n, V)
    return _diff(theirs[..., : draft_vocab or theirs.shape[-1]], head_logits)  # the draft vocabulary's columns
