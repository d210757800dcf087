"""The processed distribution p (docs/EXACTNESS.md, "The distribution contract"): HF's warpers, in their order."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import stats
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from eagle_tree import SamplingConfig, processed_probs
from eagle_tree.core.sampling import greedy_token
from eagle_tree.core.verify import sample_token


def hf_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """What Hugging Face ``generate`` samples from: its warpers in its order, then softmax."""
    warpers = LogitsProcessorList()
    if temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(temperature))
    if top_k > 0:
        warpers.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p))
    ids = torch.zeros(logits.shape[0], 1, dtype=torch.long)
    return warpers(ids, logits.float()).softmax(dim=-1)


SETTINGS = [
    (1.0, 0, 1.0),
    (0.7, 0, 1.0),
    (1.3, 0, 1.0),
    (1.0, 5, 1.0),
    (0.7, 1, 1.0),
    (1.0, 0, 0.9),
    (0.7, 0, 0.5),
    (0.7, 8, 0.9),
    (1.5, 3, 0.6),
    (0.5, 100, 0.95),  # top_k larger than the vocabulary
]


@pytest.mark.parametrize("temperature, top_k, top_p", SETTINGS)
def test_matches_hugging_face_warpers(temperature, top_k, top_p):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 50, generator=g) * 3  # continuous: no ties at the top-p boundary
    ours = processed_probs(logits, SamplingConfig(temperature, top_k, top_p))
    theirs = hf_probs(logits, temperature, top_k, top_p)
    assert ours.dtype == torch.float32
    assert torch.equal(ours > 0, theirs > 0)  # the same tokens survive
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(ours.sum(-1), torch.ones(64), rtol=0, atol=1e-5)


@pytest.mark.parametrize("top_k", [1, 2, 3, 4])
@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_top_k_keeps_ties_with_the_kth_value_like_hugging_face(top_k, temperature):
    g = torch.Generator().manual_seed(1)
    logits = torch.randint(-2, 3, (64, 12), generator=g).float()  # 5 distinct values: many ties
    ours = processed_probs(logits, SamplingConfig(temperature, top_k))
    theirs = hf_probs(logits, temperature, top_k, 1.0)
    assert torch.equal(ours > 0, theirs > 0)
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-7)
    kept = (ours > 0).sum(-1)
    assert bool((kept >= min(top_k, 12)).all()) and bool((kept > top_k).any())  # ties were kept


def test_top_k_tie_example():
    probs = processed_probs(torch.tensor([1.0, 3.0, 2.0, 3.0, 2.0]), SamplingConfig(top_k=2))
    assert probs.tolist() == pytest.approx([0, 0.5, 0, 0.5, 0])
    probs = processed_probs(torch.tensor([1.0, 3.0, 2.0, 3.0, 2.0]), SamplingConfig(top_k=3))
    e = math.e
    assert probs.tolist() == pytest.approx([0, e, 1, e, 1] / np.float64(2 * e + 2))


def test_top_p_example():
    """p = (0.5, 0.3, 0.15, 0.05): top_p = 0.8 keeps the smallest set of mass >= 0.8: {0, 1}."""
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    assert processed_probs(logits, SamplingConfig(top_p=0.8)).tolist() == pytest.approx([0.625, 0.375, 0, 0])
    assert processed_probs(logits, SamplingConfig(top_p=0.81)).tolist() == pytest.approx(
        [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0]
    )
    assert processed_probs(logits, SamplingConfig(top_p=0.1)).tolist() == [1, 0, 0, 0]  # keeps the top


def test_temperature_is_applied_before_top_p():
    """Hugging Face's order. p = (0.6, 0.3, 0.1), T = 0.5, top_p = 0.65: sharpening first gives
    (0.78, 0.20, 0.02) and top-p keeps only token 0; top-p first would keep tokens 0 and 1."""
    logits = torch.tensor([0.6, 0.3, 0.1]).log()
    assert processed_probs(logits, SamplingConfig(temperature=0.5, top_p=0.65)).tolist() == [1, 0, 0]
    assert processed_probs(logits, SamplingConfig(temperature=1.0, top_p=0.65))[1] > 0


def test_top_k_is_applied_before_top_p():
    """p = (0.45, 0.35, 0.2), top_k = 2, top_p = 0.5: top-k first renormalises to (0.5625, 0.4375)
    and top-p then keeps only token 0; top-p first would keep tokens 0 and 1."""
    logits = torch.tensor([0.45, 0.35, 0.2]).log()
    assert processed_probs(logits, SamplingConfig(top_k=2, top_p=0.5)).tolist() == [1, 0, 0]
    assert processed_probs(logits, SamplingConfig(top_p=0.5))[1] > 0


def test_temperature_scales_logits():
    logits = torch.tensor([[0.0, 1.0, 2.0]])
    torch.testing.assert_close(processed_probs(logits, SamplingConfig(0.5)), (logits / 0.5).softmax(-1))
    torch.testing.assert_close(processed_probs(logits, SamplingConfig(1.0)), logits.softmax(-1))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_output_is_float32_and_normalised(dtype):
    logits = (torch.randn(3, 7, 11, generator=torch.Generator().manual_seed(2)) * 2).to(dtype)
    probs = processed_probs(logits, SamplingConfig(0.8, 4, 0.9))
    assert probs.dtype == torch.float32 and probs.shape == (3, 7, 11)
    torch.testing.assert_close(probs.sum(-1), torch.ones(3, 7), rtol=0, atol=1e-5)
    assert bool(((probs > 0).sum(-1) <= 4).all())


def test_masked_tokens_stay_impossible():
    logits = torch.tensor([0.0, float("-inf"), 1.0, float("-inf")])
    for s in (SamplingConfig(0.5), SamplingConfig(2.0, top_k=3), SamplingConfig(1.0, top_p=0.99)):
        probs = processed_probs(logits, s)
        assert probs[1] == 0 and probs[3] == 0 and probs.sum() == pytest.approx(1)


# ----------------------------------------------------------------------------- greedy


def test_greedy_is_a_point_mass_at_the_argmax():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(32, 20, generator=g)
    probs = processed_probs(logits, SamplingConfig(temperature=0.0))
    assert probs.dtype == torch.float32
    assert torch.equal(probs, torch.nn.functional.one_hot(logits.argmax(-1), 20).float())


def test_greedy_ties_go_to_the_smallest_token_id():
    logits = torch.tensor([[1.0, 3.0, 3.0, 2.0], [0.0, 0.0, 0.0, 0.0], [-1.0, 5.0, 2.0, 5.0]])
    assert greedy_token(logits).tolist() == [1, 0, 1]
    probs = processed_probs(logits, SamplingConfig(temperature=0.0))
    assert probs.tolist() == [[0, 1, 0, 0], [1, 0, 0, 0], [0, 1, 0, 0]]
    # ties far from position 0, with masked tokens, in a large vocabulary
    big = torch.full((50_000,), float("-inf"))
    big[[40_000, 12_345, 49_999]] = 7.0
    assert int(greedy_token(big)) == 12_345
    assert int(processed_probs(big, SamplingConfig(0.0)).argmax()) == 12_345


def test_greedy_ignores_top_k_and_top_p():
    logits = torch.randn(8, 10, generator=torch.Generator().manual_seed(4))
    plain = processed_probs(logits, SamplingConfig(temperature=0.0))
    assert torch.equal(plain, processed_probs(logits, SamplingConfig(temperature=0.0, top_k=3, top_p=0.5)))
    assert SamplingConfig(temperature=0.0).greedy and not SamplingConfig(temperature=0.1).greedy


# ----------------------------------------------------------------------------- invalid input


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"temperature": -0.5}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": "1"}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": -0.1}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": float("nan")}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"top_k": True}, "top_k"),
    ],
)
def test_invalid_settings_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingConfig(**kwargs)


def test_boundary_settings_are_valid():
    """The edges of each range are accepted and mean what they say: temperature 0 is greedy, top_k=0 and
    top_p=1.0 are off, top_k=1 or a tiny top_p keep the most likely token only."""
    logits = torch.tensor([0.5, 2.0, 1.0, -1.0])
    greedy = SamplingConfig(temperature=0.0, top_k=0, top_p=1.0)
    assert greedy.greedy and processed_probs(logits, greedy).tolist() == [0.0, 1.0, 0.0, 0.0]
    full = processed_probs(logits, SamplingConfig(temperature=1.0, top_k=0, top_p=1.0))
    assert torch.allclose(full, torch.softmax(logits, -1))
    for narrow in (SamplingConfig(temperature=1.0, top_k=1), SamplingConfig(temperature=0.7, top_p=1e-6)):
        assert processed_probs(logits, narrow).tolist() == [0.0, 1.0, 0.0, 0.0]
    assert SamplingConfig(temperature=0, top_k=1, top_p=1e-6).greedy


def test_infinite_temperature_is_rejected_and_tiny_temperature_is_finite():
    with pytest.raises(ValueError, match="finite"):
        SamplingConfig(temperature=float("inf"))
    for bad in (True, "1"):
        with pytest.raises(ValueError):
            SamplingConfig(temperature=bad)
    with pytest.raises(ValueError):
        SamplingConfig(top_p=True)
    probs = processed_probs(torch.tensor([1.0, 2.0, float("-inf")]), SamplingConfig(temperature=1e-40))
    assert torch.equal(probs, torch.tensor([0.0, 1.0, 0.0]))


@pytest.mark.parametrize(
    "logits, match",
    [
        (torch.tensor([0.0, float("nan"), 1.0]), "NaN"),
        (torch.tensor([[0.0, 1.0], [float("nan"), 0.0]]), "NaN"),
        (torch.tensor([0.0, float("inf")]), r"\+inf"),
        (torch.tensor([[0.0, 1.0], [float("-inf"), float("-inf")]]), "entirely -inf"),
        (torch.tensor(1.0), "scalar"),
    ],
)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_invalid_logits_raise(logits, match, temperature):
    with pytest.raises(ValueError, match=match):
        processed_probs(logits, SamplingConfig(temperature=temperature))


# ----------------------------------------------------------------------------- sample_token


def test_sample_token_uses_the_callers_generator():
    probs = torch.tensor([0.5, 0.3, 0.2, 0.0])
    g1, g2 = torch.Generator().manual_seed(9), torch.Generator().manual_seed(9)
    seq1 = [sample_token(probs, False, g1) for _ in range(50)]
    state = torch.get_rng_state()
    seq2 = [sample_token(probs, False, g2) for _ in range(50)]
    assert seq1 == seq2 and all(isinstance(t, int) for t in seq1)
    assert torch.equal(state, torch.get_rng_state())  # the global generator is untouched


def test_sample_token_law():
    """10_000 draws from (0.5, 0.3, 0.2, 0): chi-square at 1e-6, token 3 never drawn."""
    probs = torch.tensor([0.5, 0.3, 0.2, 0.0])
    g = torch.Generator().manual_seed(10)
    counts = np.bincount([sample_token(probs, False, g) for _ in range(10_000)], minlength=4)
    assert counts[3] == 0
    assert stats.chisquare(counts[:3], np.array([0.5, 0.3, 0.2]) * 10_000).pvalue > 1e-6


def test_sample_token_greedy_is_the_argmax_with_smallest_id_on_ties():
    probs = torch.tensor([0.1, 0.4, 0.4, 0.1])
    assert sample_token(probs, True, None) == 1
