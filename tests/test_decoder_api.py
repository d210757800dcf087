"""The decoder's argument checks (generate, generate_batch, serve): each refusal is a ValueError that
names the argument, raised before any forward; the cache is sized without max_new_tokens."""

from __future__ import annotations

import functools
import math

import pytest
import torch

from eagle_tree.data.tiny import tiny_causal_lm
from eagle_tree.decoding.decoder import SpeculativeDecoder
from eagle_tree.decoding.drafting import TreeConfig
from eagle_tree.decoding.rounds import Request
from eagle_tree.models.target import TargetModel

VOCAB = 64
POSITIONS = 48


@functools.cache
def _decoder() -> SpeculativeDecoder:
    target = TargetModel(tiny_causal_lm("llama", vocab_size=VOCAB, max_position_embeddings=POSITIONS), (1, 2, 3))
    return SpeculativeDecoder(target)


def _refused(call, pattern: str, monkeypatch) -> None:
    forwards = []
    with monkeypatch.context() as patch:
        patch.setattr(TargetModel, "forward", lambda *a, **k: forwards.append(1))
        with pytest.raises(ValueError, match=pattern):
            call()
    assert not forwards  # refused before any work


@pytest.mark.parametrize("prompt, pattern", [
    ([3, VOCAB, 5], rf"input_ids holds token id {VOCAB}, outside the target's vocabulary \[0, {VOCAB}\)"),
    ([3, -1], r"input_ids holds token id -1"),
    ([], r"input_ids must be a non-empty 1-D token sequence"),
    ([1.5, 2.0], r"input_ids must hold integer token ids"),
], ids=["past-the-vocabulary", "negative", "blank", "float"])
def test_generate_refuses_bad_prompts(prompt, pattern, monkeypatch):
    _refused(lambda: _decoder().generate(torch.tensor([prompt]), 4), pattern, monkeypatch)


@pytest.mark.parametrize("budget", [0, 2.5, "8", True, None])
def test_budgets_must_be_positive_integers(budget, monkeypatch):
    prompt = torch.tensor([[1, 2, 3]])
    _refused(lambda: _decoder().generate(prompt, budget), r"max_new_tokens must be an integer >= 1", monkeypatch)
    _refused(lambda: _decoder().generate_batch([prompt[0]], budget), r"max_new_tokens must be an integer", monkeypatch)
    _refused(lambda: _decoder().serve([Request(prompt[0], budget)], 1), r"requests\[0\]\.max_new_tokens",
             monkeypatch)


def test_positions_past_the_context_are_refused(monkeypatch):
    prompt = list(range(40))
    pattern = rf"max_new_tokens=9 after a prompt of 40 tokens runs past the target.s {POSITIONS} positions: .* 8"
    _refused(lambda: _decoder().generate(torch.tensor([prompt]), 9), pattern, monkeypatch)
    _refused(lambda: _decoder().generate(torch.tensor([prompt]), 10**8), "runs past", monkeypatch)
    assert _decoder().generate(torch.tensor([prompt]), 8).new_tokens == 8  # the last position is allowed


def test_batched_prompts_are_named_by_index(monkeypatch):
    good = torch.tensor([1, 2])
    _refused(lambda: _decoder().generate_batch([good, torch.tensor([VOCAB + 3])], 4), r"prompts\[1\] holds token id",
             monkeypatch)
    _refused(lambda: _decoder().serve([Request(good, 4), Request(torch.tensor([], dtype=torch.long), 4)], 2),
             r"requests\[1\]\.prompt must be a non-empty", monkeypatch)


@pytest.mark.parametrize("arrival", [math.nan, math.inf, -math.inf, "0.5", None])
def test_serve_refuses_arrival_times_that_are_not_finite_numbers(arrival, monkeypatch):
    requests = [Request(torch.tensor([1, 2]), 4), Request(torch.tensor([3, 4]), 4, arrival_s=arrival)]
    _refused(lambda: _decoder().serve(requests, 2), r"requests\[1\]\.arrival_s must be a finite number", monkeypatch)


def test_a_huge_budget_without_a_context_limit_allocates_nothing_up_front(monkeypatch):
    """A target that states no context length: max_new_tokens=10**8 decodes (EOS stops it) with a
    cache sized from the prompt and the tree, not from the budget."""
    target = TargetModel(tiny_causal_lm("llama", vocab_size=VOCAB), (1, 2, 3))
    monkeypatch.setattr(target, "max_positions", None)
    dec = SpeculativeDecoder(target, tree=TreeConfig(depth=2, top_k=2, total_tokens=3))
    ref = dec.generate(torch.tensor([[1, 2, 3]]), 6).sequences[0].tolist()
    out = dec.generate_batch([torch.tensor([1, 2, 3])], 10**8, eos_token_id=ref[-1])
    assert out.results[0].stopped_by == "eos" and out.sequences[0].tolist() == ref[: ref.index(ref[-1], 3) + 1]
    assert out.peak_cache_bytes < 4 * 1024 * 1024  # a few hundred slots of a tiny model, not 10**8
