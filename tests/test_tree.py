"""Draft trees given by parent indices: derived views and validation."""

from __future__ import annotations

import pytest
import torch

from eagle_tree import Tree

#        root
#       /  |  \
#      0   1   2          depth 1
#     / \   \
#    3   4   5            depth 2
#    |
#    6                    depth 3
PARENTS = [-1, -1, -1, 0, 0, 1, 3]
TOKENS = [10, 11, 12, 13, 14, 15, 16]


def test_depth_children_leaves_and_paths():
    tree = Tree(PARENTS, TOKENS)
    assert len(tree) == 7
    assert tree.depth == [1, 1, 1, 2, 2, 2, 3]
    assert tree.max_depth == 3
    assert tree.children == {-1: [0, 1, 2], 0: [3, 4], 1: [5], 2: [], 3: [6], 4: [], 5: [], 6: []}
    assert tree.leaves == [2, 4, 5, 6]
    assert tree.paths == [[2], [0, 4], [1, 5], [0, 3, 6]]
    assert tree.path_to(6) == [0, 3, 6] and tree.path_to(1) == [1] and tree.path_to(-1) == []
    assert [[tree.tokens[i] for i in p] for p in tree.paths][-1] == [10, 13, 16]


def test_children_keep_proposal_order():
    """Children are listed in index order, whatever their tokens: the order they were proposed."""
    tree = Tree([-1, -1, 0, -1, 0, 0], [9, 2, 7, 5, 1, 8])
    assert tree.children[-1] == [0, 1, 3]
    assert tree.children[0] == [2, 4, 5]


def test_ancestor_mask():
    mask = Tree(PARENTS, TOKENS).ancestor_mask()
    assert mask.dtype == torch.bool and mask.shape == (7, 7)
    expected = torch.zeros(7, 7, dtype=torch.bool)
    for node, ancestors in {0: [0], 1: [1], 2: [2], 3: [0, 3], 4: [0, 4], 5: [1, 5], 6: [0, 3, 6]}.items():
        expected[node, ancestors] = True
    assert torch.equal(mask, expected)


def test_attention_mask_with_root():
    tree = Tree(PARENTS, TOKENS)
    mask = tree.attention_mask_with_root()
    assert mask.shape == (8, 8)
    assert bool(mask[:, 0].all())  # everything sees the root
    assert mask[0].tolist() == [True] + [False] * 7  # the root sees only itself
    assert torch.equal(mask[1:, 1:], tree.ancestor_mask())


def test_position_offsets():
    offsets = Tree(PARENTS, TOKENS).position_offsets()
    assert offsets.dtype == torch.long
    assert offsets.tolist() == [1, 1, 1, 2, 2, 2, 3]


def test_chain():
    chain = Tree.chain([5, 6, 7, 8])
    assert chain.parents == [-1, 0, 1, 2]
    assert chain.depth == [1, 2, 3, 4]
    assert chain.paths == [[0, 1, 2, 3]]
    assert torch.equal(chain.ancestor_mask(), torch.ones(4, 4, dtype=torch.bool).tril())
    assert chain.position_offsets().tolist() == [1, 2, 3, 4]
    assert Tree.chain([]).parents == [] and Tree.chain([3]).parents == [-1]


def test_tensor_inputs():
    tree = Tree(torch.tensor(PARENTS), torch.tensor(TOKENS))
    assert tree.parents == PARENTS and tree.tokens == TOKENS
    assert all(type(v) is int for v in tree.parents + tree.tokens)


def test_empty_tree():
    tree = Tree([], [])
    assert len(tree) == 0 and tree.max_depth == 0 and tree.leaves == [] and tree.paths == []
    assert tree.children == {-1: []}
    assert tree.ancestor_mask().shape == (0, 0)
    assert tree.attention_mask_with_root().tolist() == [[True]]


@pytest.mark.parametrize(
    "parents, tokens, match",
    [
        ([-1, 1], [0, 0], "node 1 has parent 1"),  # a node its own parent: a cycle
        ([-1, 2, 1], [0, 0, 0], "node 1 has parent 2"),  # parent after the node (and a 2-cycle)
        ([1, 0], [0, 0], "node 0 has parent 1"),  # a cycle through the first node
        ([-2], [0], "node 0 has parent -2"),
        ([-1, 0], [0], "same length"),
        ([-1], [0, 1], "same length"),
        ([-1, 0.5], [0, 0], "integers"),
        ([-1, True], [0, 0], "integers"),
        ([-1, 0], [0, -3], "negative token"),
    ],
)
def test_malformed_trees_raise(parents, tokens, match):
    with pytest.raises(ValueError, match=match):
        Tree(parents, tokens)


def test_malformed_tensor_inputs_raise():
    with pytest.raises(ValueError, match="one-dimensional"):
        Tree(torch.tensor([[-1, 0]]), [0, 0])
    with pytest.raises(ValueError, match="one-dimensional"):
        Tree([-1], torch.tensor([[0]]))
