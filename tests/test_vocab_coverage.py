"""train/vocab_coverage.py: the share of held-out reply tokens inside the draft vocabulary built from the
training data, counted on loss-masked tokens only."""

from __future__ import annotations

import pytest

from tests.helpers import load_script

vocab_coverage = load_script("train/vocab_coverage.py")


def _ex(ids, mask):
    return {"input_ids": ids, "loss_mask": mask}


def test_coverage_counts_masked_heldout_tokens_inside_the_vocabulary_built_from_training():
    train = [_ex([1, 1, 1, 2, 2, 3, 9], [1, 1, 1, 1, 1, 1, 0])]  # counts: 1 x3, 2 x2, 3 x1 (9 unmasked)
    heldout = [_ex([9, 1, 2, 3, 4], [0, 1, 1, 1, 1])]  # the unmasked 9 is not counted
    shares = vocab_coverage.coverage(train, heldout, vocab_size=10, sizes=[1, 2, 3, 10])
    assert shares == {1: 0.25, 2: 0.5, 3: 0.75, 10: 1.0}
    with pytest.raises(ValueError, match="no reply tokens"):
        vocab_coverage.coverage(train, [_ex([1, 2], [0, 0])], 10, [2])
