"""Drafters and the per-step tree builder, on hand-worked cases (numpy only, no model)."""

from __future__ import annotations

import numpy as np
import pytest

from medusa_trt.runtime.acceptance import Draws, greedy, lossless, tree_walk, typical
from medusa_trt.runtime.drafting import (
    DETERMINISTIC,
    AcceptanceStats,
    CostModel,
    Drafting,
    DraftingConfig,
    Fragment,
    HeadsProposer,
    HeadsTemplate,
    LookupConfig,
    LookupDrafter,
    NgramIndex,
    RecycleConfig,
    RecycleDrafter,
    StepTree,
    build_tree,
)
from medusa_trt.runtime.drafting.stats import UNKNOWN_PRIOR, prior_of
from medusa_trt.runtime.sampling import SamplingParams
from medusa_trt.runtime.tree import compile_tree

FLAT = CostModel({1: 1.0, 64: 1.0})  # every tree size costs the same: the builder keeps everything
STEEP = CostModel({1: 1.0, 2: 10.0, 64: 100.0})  # any draft costs more than it can bring


def _heads(template: HeadsTemplate, *, sampled: bool, proposals, confidence=None):
    """A heads proposer with one sequence whose last heads call gave ``proposals``: its propose(history, depth)."""
    heads = HeadsProposer(template)
    heads.start(0, [], sampled=sampled)
    heads.set_proposals(0, np.array(proposals), confidence)
    return lambda history, max_depth: heads.propose(0, history, max_depth).fragment


def _stats(value: float) -> AcceptanceStats:
    return AcceptanceStats(prior=lambda key: value)


# ------------------------------------------------------------------ fragments and drafters


def test_fragment_paths_share_prefixes():
    f = Fragment.paths("lookup", [[5, 6, 7], [5, 8]], [["a", "b", "c"], ["a", "d"]])
    assert f.tokens.tolist() == [5, 6, 7, 8]
    assert f.parent.tolist() == [-1, 0, 1, 0]
    assert f.keys == ("a", "b", "c", "d") and (f.draw == DETERMINISTIC).all()


def test_ngram_index_finds_the_longest_earlier_match_incrementally():
    index = NgramIndex(LookupConfig(max_ngram=3, occurrences=2))
    index.extend([1, 2, 3, 4, 9, 2, 3, 5, 1, 2, 3])
    # suffix [1, 2, 3] occurred at 0..2 (followed by 4, 9, ...); [2, 3] also at 5..6 (followed by 5, 1)
    assert index.continuations(3) == [(3, [4, 9, 2]), (2, [5, 1, 2])]
    same = NgramIndex(LookupConfig(max_ngram=3, occurrences=2))
    for tok in [1, 2, 3, 4, 9, 2, 3, 5, 1, 2, 3]:  # one token at a time: the same index
        same.extend([tok])
    assert same.continuations(3) == index.continuations(3)
    assert NgramIndex(LookupConfig()).continuations(4) == []


def test_ngram_index_keeps_a_bounded_number_of_occurrences():
    index = NgramIndex(LookupConfig(max_ngram=1, occurrences=2))
    index.extend([7, 1, 7, 2, 7, 3, 7, 4, 7])
    assert index.continuations(1) == [(1, [4]), (1, [3])]  # the most recent two
    assert all(len(v) <= 3 for v in index._after.values())


def test_lookup_drafter_follows_the_history():
    d = LookupDrafter(LookupConfig(max_length=4), [10, 11, 12, 13, 10])
    f = d.propose([10, 11, 12, 13, 10], max_depth=3)
    assert f.tokens.tolist() == [11, 12, 13] and f.parent.tolist() == [-1, 0, 1]
    assert f.keys[0] == ("lookup", 1, 1)
    f = d.propose([10, 11, 12, 13, 10, 11], max_depth=2)  # two more matched tokens
    assert f.tokens.tolist() == [12, 13] and f.keys[0][1] == 2


def test_recycle_drafter_proposes_remembered_successors():
    d = RecycleDrafter(RecycleConfig(widths=(2, 1)))
    assert d.propose([4], max_depth=2).size == 0
    d.observe([4], np.array([4, 5, 6]), np.array([[5, 6], [7, 8], [9, 1]]))
    f = d.propose([9, 4], max_depth=2)
    assert f.tokens.tolist() == [5, 7, 6, 9]  # 4 -> {5, 6}; 5 -> 7; 6 -> 9
    assert f.parent.tolist() == [-1, 0, -1, 2]
    assert d.propose([9, 4], max_depth=1).tokens.tolist() == [5, 6]


def test_heads_drafter_lays_proposals_out_by_the_template():
    tree = compile_tree([[0], [1], [0, 0]])
    propose = _heads(HeadsTemplate(tree, tree_walk(tree)), sampled=False, proposals=[[20, 21], [30, 31]])
    f = propose([1, 2], max_depth=2)
    assert f.tokens.tolist() == [20, 21, 30] and f.parent.tolist() == [-1, -1, 0]
    assert f.keys == (("heads", 1, 0), ("heads", 1, 1), ("heads", 2, 0))
    assert propose([1, 2], max_depth=1).tokens.tolist() == [20, 21]
    sampled = _heads(HeadsTemplate(tree, tree_walk(tree)), sampled=True, proposals=[[20, 21], [30, 31]])
    assert sampled([1], max_depth=2).draw.tolist() == [0, 1, 2]  # head 1 draws 0, 1; head 2 draw 0


def test_heads_confidence_is_the_softmax_of_the_top_k():
    from medusa_trt.runtime.drafting.heads import head_confidence

    logits = np.random.default_rng(0).normal(size=(3, 2, 50)).astype(np.float32) * 4  # (B, D, V)
    ids = np.argsort(-logits, axis=-1)[..., :4]  # (B, D, K)
    want = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    np.testing.assert_allclose(head_confidence(logits, ids), np.take_along_axis(want, ids, -1), rtol=1e-5)


def test_greedy_heads_drafts_are_keyed_by_confidence():
    """With the heads' probabilities, a draft's key is (depth, probability bucket), so a confident
    head-1 guess and a doubtful one are estimated apart; lossless draws keep their rank keys."""
    tree = compile_tree([[0], [1], [0, 0]])
    confidence = np.array([[0.93, 0.04], [0.5, 0.1]], dtype=np.float32)
    f = _heads(HeadsTemplate(tree, tree_walk(tree)), sampled=False, proposals=[[20, 21], [30, 31]], confidence=confidence)([1, 2], 2)
    assert f.keys == (("heads-p", 1, 10), ("heads-p", 1, 0), ("heads-p", 2, 6))
    stats = AcceptanceStats(prior_of(HeadsProposer.priors))
    assert stats.estimate(f.keys[0]) > 0.8 and stats.estimate(f.keys[1]) < 0.1
    tree_ = build_tree(1, [f], stats, max_nodes=8, cost=CostModel({1: 1.0, 3: 1.0, 4: 1.5, 64: 20.0}))
    assert tree_.tokens.tolist() == [1, 20, 30]  # the doubtful sibling is not worth its node; the confident chain is
    sampled = _heads(HeadsTemplate(tree, tree_walk(tree)), sampled=True, proposals=[[20, 21], [30, 31]], confidence=confidence)
    assert sampled([1], max_depth=2).keys[0][0] == "heads"


def test_heads_take_the_backends_confidence_where_it_computed_it():
    """A backend whose heads computed each top-k id's probability (``Proposals.confidence``: the native heads) is read,
    not recomputed from the logits, and kept as a copy (the buffer is the next call's); without it the logits'
    softmax is taken."""
    from medusa_trt.runtime.contract import Proposals
    from medusa_trt.runtime.drafting.base import Observed

    tree = compile_tree([[0], [1], [0, 0]])
    ids = np.array([[[20, 21], [30, 31]]])  # (B, D, K)
    logits = np.zeros((1, 2, 40), dtype=np.float32)  # (B, D, V): every id 1/40 by the softmax
    given = np.array([[[0.93, 0.04], [0.5, 0.1]]], dtype=np.float32)  # (B, D, K)

    class Backend:
        def __init__(self, confidence):
            self.confidence = confidence

        def propose(self, out, nodes, top_k, roots):
            return Proposals(ids, lambda: logits, self.confidence)

    seen = Observed(0, 0, [1], 0, None, np.array([1]), np.array([[2]]), SamplingParams(), np.random.default_rng(0))
    for confidence, want in ((given, given[0]), (None, np.full((2, 2), 1 / 40, dtype=np.float32))):
        heads = HeadsProposer(HeadsTemplate(tree, tree_walk(tree)), Backend(None if confidence is None else confidence.copy()))
        heads.start(0, [1], sampled=False)
        heads.observe([seen], np.array([1]), None)
        kept = heads._state[0].confidence
        np.testing.assert_allclose(kept, want, rtol=1e-6)
        if confidence is not None:
            heads.backend.confidence[:] = 0  # the next call rewrites the buffer: the sequence's copy stays
            np.testing.assert_allclose(heads._state[0].confidence, given[0])


def test_drafting_reads_what_each_proposer_says_of_itself():
    """The set's depth, fixed step cost and priors come from its proposers, never from their names:
    the heads draft as deep as their template and cost their call; the others take the config's depth."""
    tree = compile_tree([[0], [0, 0], [0, 0, 0]])
    template = HeadsTemplate(tree, tree_walk(tree))
    config = DraftingConfig(max_depth=5)
    heads = Drafting(("heads",), template, config, engine_max_nodes=None, heads_cost=0.3)
    assert heads.max_depth == 3 and heads.fixed_cost == pytest.approx(0.3)
    every = Drafting(None, template, config, engine_max_nodes=None, heads_cost=0.3)
    assert every.names == ("heads", "lookup", "recycle") and every.max_depth == 5
    assert every.prior(("lookup", 3, 1)) == pytest.approx(0.74) and every.prior(("nobody", 1)) == UNKNOWN_PRIOR
    retrieval = Drafting(None, None, config, engine_max_nodes=8)  # no template: the heads are not available
    assert retrieval.names == ("lookup", "recycle") and retrieval.fixed_cost == 0.0 and retrieval.max_nodes == 8
    assert Drafting((), template, config, engine_max_nodes=None).max_depth == 0
    with pytest.raises(Exception, match="needs Medusa heads"):
        Drafting(("heads",), None, config, engine_max_nodes=None)
    assert Drafting(("heads", "lookup"), None, config, engine_max_nodes=None, available_only=True).names == ("lookup",)


# ------------------------------------------------------------------ the builder


def _heads_and_lookup():
    heads = Fragment("heads", np.array([7, 8, 9]), np.array([-1, -1, 0]), (("h", 1), ("h", 2), ("h", 3)), np.full(3, DETERMINISTIC))
    lookup = Fragment.paths("lookup", [[7, 10, 11]], [[("l", 1), ("l", 2), ("l", 3)]])
    return heads, lookup


def test_builder_merges_shared_prefixes_into_one_trie():
    heads, lookup = _heads_and_lookup()
    tree = build_tree(5, [heads, lookup], _stats(0.5), max_nodes=64, cost=FLAT)  # candidates enter in drafter order
    # root 5; depth 1: 7 (heads + lookup), 8; depth 2: 9 (heads under 7), 10 (lookup under 7); depth 3: 11
    assert tree.tokens.tolist() == [5, 7, 8, 9, 10, 11]
    assert tree.parent.tolist() == [-1, 0, 0, 1, 1, 4]
    assert tree.depth.tolist() == [0, 1, 1, 2, 2, 3]
    assert tree.sources[1] == ("heads", "lookup") and tree.sources[4] == ("lookup",)
    assert tree.children[0] == (1, 2) and tree.children[1] == (3, 4)
    np.testing.assert_allclose(tree.score, [1, 0.75, 0.5, 0.375, 0.375, 0.1875])  # noisy-or for the shared node
    mask = tree.mask()
    assert mask[5].tolist() == [True, True, False, False, True, True]
    assert mask.sum() == 6 + 5 + 4  # each node sees itself and its ancestors
    assert tree.path(5) == [0, 1, 4, 5]


def test_builder_budget_follows_the_cost_model():
    heads, lookup = _heads_and_lookup()
    assert build_tree(5, [heads, lookup], _stats(0.5), max_nodes=64, cost=STEEP).num_nodes == 1
    capped = build_tree(5, [heads, lookup], _stats(0.5), max_nodes=3, cost=FLAT)
    assert capped.tokens.tolist() == [5, 7, 8]  # the two best nodes (0.75, 0.5)
    linear = CostModel({1: 1.0, 2: 1.1, 3: 1.2, 4: 1.3, 5: 1.4, 6: 1.5, 64: 10})
    tree = build_tree(5, [heads, lookup], _stats(0.5), max_nodes=64, cost=linear)
    # gains 1.75, 2.25, 2.625, 3.0, 3.19 over costs 1.1..1.5: 3.0 / 1.4 is the best ratio (4 drafted nodes)
    assert tree.num_nodes == 5 and sorted(tree.tokens.tolist()) == [5, 7, 8, 9, 10]


def test_builder_keeps_sampled_head_draws_first_among_siblings():
    heads = Fragment("heads", np.array([7, 8]), np.array([-1, -1]), (("h", 1), ("h", 1)), np.array([0, 1]))
    lookup = Fragment.paths("lookup", [[3]], [[("l", 1)]])
    tree = build_tree(5, [lookup, heads], _stats(0.3), max_nodes=64, cost=FLAT)
    assert tree.tokens.tolist() == [5, 7, 8, 3] and tree.draw.tolist() == [-1, 0, 1, -1]


def test_stats_learn_from_what_was_tested():
    stats = AcceptanceStats(prior=lambda key: 0.5, weight=2)
    assert stats.estimate(("x",)) == 0.5
    stats.update(("x",), True)
    stats.update(("x",), True)
    assert stats.estimate(("x",)) == pytest.approx(3 / 4)


def test_stats_learn_a_step_from_the_children_of_its_accepted_nodes():
    """Root 5 with children 7 ("a") and 8 ("b"), 7 with child 9 ("c"); the path 5 -> 7: "a" was
    tested and accepted, "b" tested and refused, "c" tested (its parent was accepted) and refused."""
    frag = Fragment.paths("lookup", [[7, 9], [8]], [["a", "c"], ["b"]])
    tree = build_tree(5, [frag], _stats(0.5), max_nodes=64, cost=FLAT)
    assert tree.tokens.tolist() == [5, 7, 8, 9]
    stats = AcceptanceStats(prior=lambda key: 0.5, weight=2)
    stats.learn(tree, [0, 1])
    assert [stats.estimate(k) for k in "abc"] == [pytest.approx(2 / 3), pytest.approx(1 / 3), pytest.approx(1 / 3)]
    stats.learn(tree, [0])  # nothing accepted: only the root's children were tested
    assert [stats.estimate(k) for k in "abc"] == [pytest.approx(2 / 4), pytest.approx(1 / 4), pytest.approx(1 / 3)]


# ------------------------------------------------------------------ rules on step trees


def _tree():
    heads, lookup = _heads_and_lookup()
    return build_tree(5, [heads, lookup], _stats(0.5), max_nodes=64, cost=FLAT)  # tokens [5, 7, 8, 9, 10, 11]


def test_greedy_walks_the_matching_children():
    tree = _tree()
    argmax = np.array([7, 10, 0, 0, 11, 42])  # root -> 7 -> 10 -> 11, then the bonus 42
    v = greedy(tree, argmax)
    assert v.path == [0, 1, 4, 5] and v.bonus == 42
    v = greedy(tree, np.array([3, 0, 0, 0, 0, 0]))
    assert v.path == [0] and v.bonus == 3
    assert greedy(StepTree.chain(5), np.array([6])).path == [0]


class _Uniforms:
    def __init__(self, *values):
        self.values = list(values)

    def random(self):
        return self.values.pop(0)


DRAWS = Draws(q=np.array([[0.1, 0.6, 0.3, 0.0]]), ids=np.array([[1, 2]]))  # head 1 drew 1, then 2


def test_lossless_mixes_sampled_and_point_mass_siblings():
    # root (token 9): head-1 draws 1 (q = .6) then 2 (q without 1 = .3/.4 = .75); a lookup draft 3 (point mass)
    tree = StepTree(
        np.array([9, 1, 2, 3]),
        np.array([-1, 0, 0, 0]),
        np.array([0, 1, 1, 1]),
        np.array([-1, 0, 1, -1]),
        ((), ("h",), ("h",), ("l",)),
        ((), ("heads",), ("heads",), ("lookup",)),
        ((1, 2, 3), (), (), ()),
        np.ones(4),
    )
    p = np.array([0.1, 0.2, 0.3, 0.4])
    probs = lambda node: p.copy()  # noqa: E731
    # draw 1: u * .6 < .2 needs u < 1/3: reject at .5; residual max(0, p - q) = [0, 0, 0, .4] -> [0, 0, 0, 1]
    # draw 2: q2 = q without draw 1 = [.25, 0, .75, 0]; residual(2) = 0: rejected; residual stays [0, 0, 0, 1]
    # point mass 3: u * 1 < 1: accepted
    rng = _Uniforms(0.5, 0.6, 0.99, 0.0)  # the last: the bonus after the leaf
    v = lossless(tree, probs, DRAWS, rng)
    assert v.path == [0, 3] and rng.values == []
    # p = [.1, .2, .5, .2]: draw 1 rejected, residual [0, 0, .5, .5]; draw 2: u * .75 < .5 for u = .5: accepted
    p2 = np.array([0.1, 0.2, 0.5, 0.2])
    assert lossless(tree, lambda node: p2.copy(), DRAWS, _Uniforms(0.5, 0.5, 0.0)).path == [0, 2]
    # all rejected: a point mass on a token of zero residual mass is rejected; bonus from the residual
    p = np.array([0.5, 0.5, 0.0, 0.0])
    v = lossless(tree, lambda node: p.copy(), DRAWS, _Uniforms(0.99, 0.99, 0.0, 0.0))
    assert v.path == [0] and v.bonus == 0  # residual after draw 1: [.4, 0, 0, 0] normalised -> 0


def test_typical_on_a_step_tree_takes_the_longest_plausible_path():
    tree = _tree()  # tokens [5, 7, 8, 9, 10, 11]
    peaked = np.full(12, 1e-3)
    peaked[[7, 10, 11]] = 1.0
    peaked /= peaked.sum()
    params = SamplingParams(temperature=1.0, acceptance="typical")
    v = typical(tree, lambda node: peaked, _Uniforms(0.0), threshold=params.posterior_threshold, alpha=params.posterior_alpha)
    assert v.path == [0, 1, 4, 5]


def test_online_cost_learns_a_fixed_overhead_around_the_table():
    from medusa_trt.runtime.drafting import OnlineCost

    table = CostModel({1: 1.0, 8: 1.5, 64: 5.0})
    cost = OnlineCost(table, min_samples=6)
    assert cost.cost(np.array([1, 8])).tolist() == [1.0, 1.5]  # no data: the table
    for w in (1, 4, 8, 2, 6, 8, 3, 1):  # seconds = 0.03 * table(w) + 0.006 (a heads call, say)
        cost.observe(1, w, 0.03 * float(table.cost(np.array([w]))[0]) + 0.006)
    np.testing.assert_allclose(cost.cost(np.array([1, 8])), [1.2, 1.7])  # overhead 0.006 / 0.03 = 0.2 table units
    for w in (2, 5, 7):  # a bigger overhead: seen at the next refit (every 8 steps), not before
        cost.observe(1, w, 0.03 * float(table.cost(np.array([w]))[0]) + 0.03)
    np.testing.assert_allclose(cost.cost(np.array([1, 8])), [1.2, 1.7])
    for w in (1, 4, 8, 2, 6):
        cost.observe(1, w, 0.03 * float(table.cost(np.array([w]))[0]) + 0.03)
    assert cost.cost(np.array([1]))[0] > 1.4
    assert cost.cost(np.array([1]), rows=4)[0] == 1.0  # another row count has its own fit


def test_cost_of_a_batched_step_reads_the_table_at_its_token_count():
    table = CostModel({1: 1.0, 4: 1.0, 8: 2.0, 16: 4.0})
    assert table.cost(np.array([2]), rows=4)[0] == 2.0  # 8 tokens against 4
    assert table.cost(np.array([2]))[0] == 1.0  # one row: 2 tokens cost what 1 does
    heads, lookup = _heads_and_lookup()
    one = build_tree(5, [heads, lookup], _stats(0.5), max_nodes=64, cost=table)
    four = build_tree(5, [heads, lookup], _stats(0.5), max_nodes=64, cost=table, rows=4)
    assert four.num_nodes < one.num_nodes  # the same drafts are worth fewer nodes when four rows share the step


def _chain(tokens, value):
    """Candidates of one drafted chain below root 5, every node estimated at ``value``."""
    from medusa_trt.runtime.drafting.builder import merge

    frag = Fragment.paths("lookup", [list(tokens)], [[("l", i) for i in range(len(tokens))]])
    return merge(5, [frag] if len(tokens) else [], _stats(value))


def test_shared_width_for_one_row_is_its_own_budget():
    from medusa_trt.runtime.drafting.builder import best_count, merge, shared_width

    heads, lookup = _heads_and_lookup()
    rows = merge(5, [heads, lookup], _stats(0.5))
    for cost in (FLAT, STEEP, CostModel({1: 1.0, 4: 1.0, 8: 2.0, 16: 4.0}), CostModel()):
        assert shared_width([rows], max_nodes=64, cost=cost, batch=1) == best_count(rows, max_nodes=64, cost=cost) + 1
    assert shared_width([rows], max_nodes=3, cost=FLAT, batch=1) == 3  # max_nodes caps it


def test_rows_share_one_width_because_the_step_pays_for_its_widest():
    """Row A drafts a chain accepted at 0.9 a node, row B has nothing: a step of W tokens per row
    costs table(2 W) / table(2) whatever B holds. Worked by hand with table 1, 2, 4 tokens: 1.0,
    8: 2.0 (linear between): W = 1: 2 tokens / 1.0; W = 2: 1.9 + 1 over table(4) = 1.0 -> 2.9;
    W = 3: 2.71 + 1 over 1.5 -> 2.47; W = 4: 3.44 + 1 over 2.0 -> 2.22. So W = 2. Alone, A would
    take W = 4 (table(4) = 1.0: 3.44), which would have made B's padding cost the step double."""
    from medusa_trt.runtime.drafting.builder import best_count, shared_width, take_width

    table = CostModel({1: 1.0, 2: 1.0, 4: 1.0, 8: 2.0})
    a, b = _chain([7, 8, 9], 0.9), _chain([], 0.9)
    np.testing.assert_allclose(a.gain, [1.9, 2.71, 3.439])
    assert best_count(a, max_nodes=64, cost=table) == 3  # alone: every node
    width = shared_width([a, b], max_nodes=64, cost=table, batch=2)
    assert width == 2
    assert take_width(a, width, 64).tokens.tolist() == [5, 7] and take_width(b, width, 64).tokens.tolist() == [5]
    # a prefill chunk of 4 tokens in the same step: W = 4 costs nothing more, so A keeps all three nodes
    assert shared_width([a, b], max_nodes=64, cost=table, batch=2, floor=4) == 4
    assert take_width(a, 4, 64).num_nodes == 4
    steep = CostModel({1: 1.0, 2: 10.0, 4: 100.0, 64: 1000.0})  # at 2 rows a second token per row costs 10x
    assert shared_width([a, b], max_nodes=64, cost=steep, batch=2) == 1  # nothing pays: plain decoding


# ------------------------------------------------------------------ sequential heads (an expanded template)


def test_a_template_expands_at_every_node_with_children():
    from medusa_trt.runtime.drafting.sequential import expansion

    plan = expansion([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)])
    assert plan.paths == ((), (0,), (1,), (0, 0))  # the root and the nodes with children, parents first
    assert plan.parent.tolist() == [-1, 0, 0, 1] and plan.rank.tolist() == [0, 0, 1, 0] and plan.depth.tolist() == [0, 1, 1, 2]
    assert [r.tolist() for r in plan.levels()] == [[0], [1, 2], [3]]  # head d runs at level d
    assert plan.node_rows([(0,), (2,), (0, 1), (1, 0), (0, 0, 0)]).tolist() == [0, 0, 1, 2, 3]
    assert expansion([(0,), (1,)]).paths == ((),)  # a depth-1 template: head 1 at the root only


def test_sequential_heads_drafter_reads_each_node_from_its_parents_row():
    """Row r of the proposals holds the guesses below expanded node r; a node's token is
    proposals[row of its parent, its rank], keyed by that row's confidence; under lossless sampling
    the drafts stay these top-k tokens (deterministic, point-mass drafts), never draws."""
    from medusa_trt.runtime.drafting.sequential import TemplateMismatchError, expansion

    tree = compile_tree([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]])
    plan = expansion(tree.paths)  # rows: (), (0,), (1,), (0, 0)
    template = HeadsTemplate(tree, tree_walk(tree), plan)
    assert template.sequential and template.rows == 4
    proposals = np.array([[20, 21], [30, 31], [40, 41], [50, 51]])  # below the root, [0], [1], [0, 0]
    confidence = np.array([[0.95, 0.02], [0.55, 0.3], [0.15, 0.1], [0.45, 0.2]], dtype=np.float32)
    for sampled in (False, True):
        f = _heads(template, sampled=sampled, proposals=proposals, confidence=confidence)([1, 2], 3)
        assert f.tokens.tolist() == [20, 21, 30, 31, 40, 50] and f.parent.tolist() == [-1, -1, 0, 0, 1, 2]
        assert f.keys == (("heads-p", 1, 10), ("heads-p", 1, 0), ("heads-p", 2, 6), ("heads-p", 2, 4), ("heads-p", 2, 2), ("heads-p", 3, 5))
        assert (f.draw == DETERMINISTIC).all()
    with pytest.raises(TemplateMismatchError, match="subtree of that template"):
        HeadsTemplate(compile_tree([[0], [1], [1, 1], [1, 1, 0]]), tree_walk(compile_tree([[0], [1], [1, 1], [1, 1, 0]])), plan)
    subtree = compile_tree([[0], [0, 0]])  # any subtree of the expanded template reads the same rows
    assert HeadsTemplate(subtree, tree_walk(subtree), plan).row.tolist() == [0, 1]


def test_replay_variants_engine_cost_and_modelled_speedup(tmp_path):
    """The replay's --variant changes one DraftingConfig field (nested ones too) and names what it cannot
    parse; --engine reads a folder's measured step cost and heads call; the modelled speed-up charges
    each step its width's cost plus the heads call."""
    import json

    pytest.importorskip("torch")  # the replay runs the heads on the torch model
    from medusa_trt.bench import replay
    from medusa_trt.bench.replay import ReplayError
    from medusa_trt.runtime.drafting import DraftingConfig
    from medusa_trt.runtime.drafting.lookup import LookupConfig
    from medusa_trt.runtime.drafting.recycle import RecycleConfig

    base = DraftingConfig()
    name, config = replay.parse_variant("deep:lookup.max_ngram=4,max_depth=12,recycle.widths=4-2-1", base)
    assert name == "deep" and config.max_depth == 12 and config.recycle == RecycleConfig(widths=(4, 2, 1))
    assert config.lookup == LookupConfig(max_ngram=4) and base.lookup == LookupConfig()  # the base is untouched
    for bad, words in (("nocolon", "is not NAME:FIELD"), ("x:lookup.nope=3", "no field 'lookup.nope'"), ("x:max_depth=deep", "FIELD=INT")):
        with pytest.raises(ReplayError, match=words):
            replay.parse_variant(bad, base)
    (tmp_path / "drafting.json").write_text(json.dumps({"step_cost": {"1": 1.0, "8": 2.0}, "heads_cost": 0.25}))
    cost, heads = replay.engine_cost(tmp_path)
    assert heads == 0.25 and cost.cost(np.array([1, 8])).tolist() == [1.0, 2.0]
    # two steps: 1 token alone (1 + 0.25), 3 tokens from 8 nodes (2 + 0.25): 4 tokens for 3.5 plain steps
    assert replay.modelled_speedup(np.array([1, 3]), np.array([1, 8]), cost, heads) == pytest.approx(4 / 3.5)
    with pytest.raises(ReplayError, match="no step_cost"):
        replay.engine_cost(tmp_path / "missing")
