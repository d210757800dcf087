"""Draft-shape selection: the C / K criterion, the marginal rule and the tuning file."""

import json
import random

import pytest
import torch

from eagle_tree.bench.tuning import (
    CHAIN_LENGTHS,
    NONE,
    SERVING_CANDIDATES,
    TREES,
    ShapeMeasurement,
    candidate_shapes,
    change_helps,
    grow_while_helps,
    marginal_steps,
    pick_best,
    save_tuned_shapes,
    selection,
)
from eagle_tree.decoding.context import ContextConfig
from eagle_tree.decoding.drafting import TreeConfig
from eagle_tree.decoding.shapes import load_tuned_shape


def _m(tree, c, k, rounds=10):
    return ShapeMeasurement(tree, c, k, rounds)


def test_every_name_the_tuners_write_reads_back():
    """TreeConfig.name is the one spelling: every candidate of the bench (with the context settings the
    shipped decoding.json uses) and of the serving sweep reads back to the same shape; a chain spelled as
    a tree, or a default spelled out, is not a second name."""
    contexts = [ContextConfig(lookup_tokens=8), ContextConfig(lookup_tokens=8, min_ngram=2),
                ContextConfig(lookup_tokens=4, branches=2, min_ngram=3, max_ngram=5, first="head")]
    shapes = candidate_shapes(CHAIN_LENGTHS, TREES, contexts)
    shapes += [TreeConfig.chain(2, sampled=True), TreeConfig(depth=2, top_k=2, total_tokens=6, sampled=True,
                                                            context=contexts[1])]
    for tree in shapes:
        assert TreeConfig.from_name(tree.name) == tree, tree.name
    assert "chain-2+ctx8-g2to4" in {t.name for t in shapes}
    for name in SERVING_CANDIDATES[1:]:
        assert TreeConfig.from_name(name).name == name
    for wrong in ("tree-d4k1n4", "chain-2+ctx8-g1to4", "chain-2+ctx8x1", "chain-0", "chain-2+"):
        with pytest.raises(ValueError, match="not a|must be an integer >= 1"):
            TreeConfig.from_name(wrong)


def test_shape_names():
    assert TreeConfig.chain(4).name == "chain-4"
    assert TreeConfig(depth=6, top_k=8, total_tokens=48).name == "tree-d6k8n48"
    assert TreeConfig(depth=2, top_k=2, total_tokens=6, sampled=True).name == "tree-d2k2n6-sampled"


def test_marginal_rule_by_hand():
    # C = 10 ms, K = 2 tokens: 5 ms per token. One more token for 4 ms pays; for 6 ms or exactly 5 it does not.
    assert change_helps(10.0, 2.0, 4.0, 1.0)
    assert not change_helps(10.0, 2.0, 6.0, 1.0)
    assert not change_helps(10.0, 2.0, 5.0, 1.0)
    assert change_helps(10.0, 2.0, -1.0, 0.0) and not change_helps(10.0, 2.0, 1.0, 0.0)
    assert change_helps(10.0, 2.0, -6.0, -1.0)  # 4 ms / 1 token < 5
    assert not change_helps(10.0, 2.0, -4.0, -1.0)  # 6 ms / 1 token > 5
    with pytest.raises(ValueError):
        change_helps(0.0, 2.0, 1.0, 1.0)
    with pytest.raises(ValueError):
        change_helps(10.0, 2.0, 1.0, -2.0)


def test_marginal_rule_agrees_with_comparing_time_per_token():
    rng = random.Random(0)
    for _ in range(2000):
        c, k = rng.uniform(1e-3, 1.0), rng.uniform(1.0, 6.0)
        dc, dk = rng.uniform(-0.5, 1.0) * c, rng.uniform(-0.5, 3.0)
        if k + dk <= 0 or c + dc <= 0 or abs((c + dc) / (k + dk) - c / k) < 1e-12:
            continue
        assert change_helps(c, k, dc, dk) == ((c + dc) / (k + dk) < c / k)


def test_pick_best_lowest_time_per_token_ties_to_smaller_shape():
    a = _m(TreeConfig.chain(2), 0.020, 2.0)  # 10 ms / token
    b = _m(TreeConfig.chain(4), 0.030, 2.5)  # 12 ms / token
    c = _m(TreeConfig(depth=4, top_k=4, total_tokens=16), 0.036, 4.0)  # 9 ms / token
    assert pick_best([a, b, c]) is c
    assert pick_best([a, b]) is a
    big_tie = _m(TreeConfig(depth=4, top_k=4, total_tokens=32), 0.072, 8.0)  # also 9 ms / token, more nodes
    assert pick_best([big_tie, c]) is c
    with pytest.raises(ValueError):
        pick_best([])
    with pytest.raises(ValueError, match="committed"):
        ShapeMeasurement(TreeConfig.chain(1), 0.01, 0.0)


def test_plain_decoding_is_the_candidate_none():
    """Plain decoding (ShapeMeasurement(None, C, 1)) is named none, round-trips, and pick_best chooses it
    exactly when no drafted shape's C / K is below a plain step's; on a tie it wins (no draft nodes)."""
    plain = _m(None, 0.010, 1.0)  # 10 ms / token
    assert plain.name == NONE == "none" and not plain.drafted and plain.size == 0
    assert ShapeMeasurement.from_dict(plain.to_dict()) == plain and plain.to_dict()["tree"] is None
    slower = [_m(TreeConfig.chain(2), 0.024, 2.0), _m(TreeConfig(depth=4, top_k=4, total_tokens=16), 0.033, 3.0)]
    assert pick_best([plain, *slower]) is plain  # 12 and 11 ms / token: do not speculate
    faster = _m(TreeConfig.chain(3), 0.027, 3.0)  # 9 ms / token
    assert pick_best([plain, *slower, faster]) is faster
    assert pick_best([faster, plain]) is faster  # the order does not matter
    tie = [_m(TreeConfig.chain(1), 0.020, 2.0), _m(TreeConfig.context_only(ContextConfig(lookup_tokens=8)), 0.010,
                                                   1.0)]
    assert pick_best([*tie, plain]) is plain  # 10 ms / token each: the smallest shape, plain decoding


def test_selection_and_tuning_file_with_none(tmp_path):
    """best may be none; every other key names a drafted shape, the marginal tables skip none, and
    load_tuned_shape reads none back as None (plain decoding)."""
    plain = _m(None, 0.010, 1.0)
    chains = [_m(TreeConfig.chain(1), 0.015, 1.4), _m(TreeConfig.chain(3), 0.030, 2.5)]
    trees = [_m(TreeConfig(depth=3, top_k=2, total_tokens=6), 0.030, 2.4)]
    path = tmp_path / "shapes.json"
    data = save_tuned_shapes(path, [plain, *chains, *trees], temperature=1.0)
    assert data["selected"] == {"best": "none", "chain": "chain-1", "tree": "tree-d3k2n6"}  # 10.7, 12.5 ms
    assert data["shapes"][0] == plain.to_dict() | {"name": "none", "tree": None}
    assert all(NONE not in (s["small"], s["large"]) for seq in data["marginal"].values() for s in seq)
    assert set(data["marginal"]) == {"chain", "tree"} and len(data["marginal"]["chain"]) == 1
    assert load_tuned_shape(path) is None
    assert load_tuned_shape(path, "chain") == TreeConfig.chain(1) and load_tuned_shape(path, "tree") == trees[0].tree
    assert [ShapeMeasurement.from_dict(d) for d in json.loads(path.read_text())["shapes"]] == [plain, *chains, *trees]
    ctx = ContextConfig(lookup_tokens=8)
    with_ctx = [plain, _m(TreeConfig(depth=3, top_k=1, total_tokens=3, context=ctx), 0.032, 3.2),
                _m(TreeConfig.context_only(ctx), 0.012, 1.1)]
    chosen = selection(with_ctx)
    assert chosen["best"] is plain and {k: m.name for k, m in chosen.items() if k != "best"} == {
        "chain": "chain-3+ctx8", "context": "chain-3+ctx8", "context_only": "ctx8"}
    # the other direction: a drafted shape below plain's C / K is the best
    faster = _m(TreeConfig.chain(2), 0.016, 2.0)  # 8 ms / token
    save_tuned_shapes(path, [plain, *chains, faster])
    assert load_tuned_shape(path) == TreeConfig.chain(2)


def test_shape_measurements_take_plain_decoding_as_none():
    """The tuning phase's plain method gives the candidate none (K = 1); head_defaults is no candidate."""
    from eagle_tree.bench.runner import HEAD_DEFAULTS, PLAIN, PhaseResult, eagle_method
    from eagle_tree.bench.tuning import shape_measurements
    from eagle_tree.decoding.decoder import GenerateOutput
    from eagle_tree.decoding.rounds import RoundStats

    def out(committed, s):
        rounds = [RoundStats(c - 1, c, 2, 0.001, s - 0.002, 0.001) for c in committed]
        return GenerateOutput(torch.tensor([[1, 2] + [3] * (1 + sum(committed))]), 2, rounds=rounds)

    chain = eagle_method(TreeConfig.chain(2))
    outputs = {"plain": [[out([1, 1, 1, 1], 0.010)]], chain.name: [[out([2, 3], 0.020)]],
               "head_defaults": [[out([2, 2], 0.020)]]}
    result = PhaseResult("tuning", [PLAIN, chain, HEAD_DEFAULTS], outputs, {}, [], "")
    measured = {m.name: m for m in shape_measurements(result)}
    assert set(measured) == {"none", "chain-2"}
    assert measured["none"].tree is None and measured["none"].committed == 1.0 and measured["none"].rounds == 4
    assert measured["none"].round_s == pytest.approx(0.010) and measured["chain-2"].committed == 2.5
    assert pick_best(list(measured.values())).name == "chain-2"  # 8 ms / token against 10


def test_marginal_walk_stops_at_first_step_that_does_not_pay():
    chain = [_m(TreeConfig.chain(n), c, k) for n, c, k in
             [(1, 0.020, 1.6), (2, 0.024, 2.1), (3, 0.030, 2.3), (4, 0.031, 2.9)]]
    steps = marginal_steps(chain)
    assert [s.helps for s in steps] == [True, False, True]
    assert steps[0].marginal_s == pytest.approx(0.004 / 0.5)
    assert steps[0].threshold_s == pytest.approx(0.020 / 1.6)
    assert grow_while_helps(chain) is chain[1]  # the walk stops before chain-3 ...
    assert pick_best(chain) is chain[3]  # ... although chain-4 is the global optimum


def test_tuning_file_round_trip(tmp_path):
    chains = [_m(TreeConfig.chain(1), 0.020, 1.5), _m(TreeConfig.chain(3), 0.030, 2.5)]
    trees = [_m(TreeConfig(depth=3, top_k=2, total_tokens=6), 0.030, 2.4),
             _m(TreeConfig(depth=5, top_k=4, total_tokens=20), 0.040, 3.6)]
    path = tmp_path / "shapes.json"
    data = save_tuned_shapes(path, chains + trees, temperature=0.0)
    assert data["selected"] == {"best": "tree-d5k4n20", "chain": "chain-3", "tree": "tree-d5k4n20"}
    assert json.loads(path.read_text())["context"] == {"temperature": 0.0}
    assert load_tuned_shape(path) == TreeConfig(depth=5, top_k=4, total_tokens=20)
    assert load_tuned_shape(path, "chain") == TreeConfig.chain(3)
    assert [s["helps"] for s in data["marginal"]["chain"]] == [True]
    assert set(selection(chains)) == {"best", "chain"}
    save_tuned_shapes(path, chains)
    with pytest.raises(ValueError, match="selects no 'tree'"):
        load_tuned_shape(path, "tree")
    with pytest.raises(FileNotFoundError, match="eagle-tree bench"):
        load_tuned_shape(tmp_path / "missing.json")
    (tmp_path / "other.json").write_text(json.dumps({"format": "something else"}))
    with pytest.raises(ValueError, match="not an eagle-tree shapes file"):
        load_tuned_shape(tmp_path / "other.json")


def test_context_only_shapes_have_one_spelling_and_need_a_context():
    ctx = ContextConfig(lookup_tokens=8)
    only = TreeConfig.context_only(ctx)
    assert only.name == "ctx8" and TreeConfig.from_name("ctx8") == only
    assert TreeConfig(depth=5, top_k=4, total_tokens=16, context=ctx, head=False) == only  # one shape
    assert not only.is_chain and (only.depth, only.top_k, only.total_tokens, only.sampled) == (1, 1, 1, False)
    assert TreeConfig(**{**only.__dict__}) == only  # read back from decoding.json's mapping
    assert TreeConfig.context_only(ContextConfig(lookup_tokens=8, alone_ngram=3)) == only  # alone: always
    with pytest.raises(ValueError, match="give it a context"):
        TreeConfig(head=False)
    with pytest.raises(ValueError, match="not a context setting"):
        TreeConfig.from_name("ctx8+ctx8")


def test_context_only_is_a_candidate_and_can_be_selected(tmp_path):
    """With context settings and context_only=True the bench's tuning also measures each setting alone,
    so the head's drafts must beat the context branches without them; chain / tree / context keep
    naming the best head shapes."""
    ctx = ContextConfig(lookup_tokens=8)
    shapes = candidate_shapes([4], [], [ctx], context_only=True)
    assert [s.name for s in shapes] == ["chain-4", "chain-4+ctx8", "ctx8"]
    assert "ctx8" not in {s.name for s in candidate_shapes([4], [], [ctx])}  # off unless asked
    chain, with_ctx, only = shapes
    measured = [_m(chain, 0.118, 1.39), _m(with_ctx, 0.140, 2.25), _m(only, 0.100, 1.84)]  # C/K 85, 62, 54 ms
    data = save_tuned_shapes(tmp_path / "shapes.json", measured, temperature=0.0)
    assert data["selected"] == {"best": "ctx8", "chain": "chain-4+ctx8", "no_context": "chain-4",
                                "context": "chain-4+ctx8", "context_only": "ctx8", "head_only_chain": "chain-4"}
    chosen = selection(measured)
    assert chosen["best"].name == "ctx8" and chosen["context_only"].name == "ctx8"
    assert chosen["chain"].name == "chain-4+ctx8" and chosen["context"].name == "chain-4+ctx8"
    assert chosen["no_context"].name == "chain-4" and "tree" not in chosen
    assert load_tuned_shape(tmp_path / "shapes.json") == TreeConfig.context_only(ctx)
    assert all(s["small"] != "ctx8" and s["large"] != "ctx8" for seq in data["marginal"].values() for s in seq)
